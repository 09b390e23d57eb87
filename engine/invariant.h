/* ALWAYS(x) / NEVER(x): conditions the code itself guarantees, written down
 * at the places where one being false would cost memory safety (SQLite's
 * convention, sqliteInt.h).  Each guards a defensive branch:
 *
 *	if (NEVER(i >= n))      // i < n by construction; if not, refuse
 *		return -EINVAL;
 *
 * In a normal build they are just x, so a broken invariant takes the
 * defensive branch and the daemon keeps running.  With KVD_INVARIANTS (the
 * Makefile's SAN= builds and the fuzz targets) a broken one aborts with
 * file:line, so a test or a fuzzer sees the bug instead of the defensive
 * branch hiding it.
 *
 * Never for what arrives from outside (a ring entry, a header in shared
 * memory, a file, a control message): that can be anything and is checked
 * with an ordinary if, in every build.
 *
 * No dependencies, header-only and static: shm/ and the client library use
 * it too, and libkvclient.so must not export a symbol for it.
 */
#ifndef KVD_INVARIANT_H
#define KVD_INVARIANT_H

#ifdef KVD_INVARIANTS
#include <stdio.h>
#include <stdlib.h>

static inline __attribute__((noreturn, cold)) void kvd_invariant_fail(const char *file, int line,
								      const char *what)
{
	fprintf(stderr, "%s:%d: invariant broken: %s\n", file, line, what);
	abort();
}

#define ALWAYS(x) (__builtin_expect(!!(x), 1) ? 1 : \
		   (kvd_invariant_fail(__FILE__, __LINE__, "ALWAYS(" #x ")"), 0))
#define NEVER(x)  (__builtin_expect(!!(x), 0) ? \
		   (kvd_invariant_fail(__FILE__, __LINE__, "NEVER(" #x ")"), 1) : 0)
#else
#define ALWAYS(x) __builtin_expect(!!(x), 1)
#define NEVER(x)  __builtin_expect(!!(x), 0)
#endif

#endif
