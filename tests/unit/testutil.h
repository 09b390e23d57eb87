/* Small helpers shared by the unit tests (header-only). */
#ifndef KVD_TESTUTIL_H
#define KVD_TESTUTIL_H

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "engine/bf16.h"
#include "engine/kern.h"
#include "engine/rng.h"

/* Sanitizer builds run the heaviest tests on smaller problems (fewer draws,
 * fewer sessions, one kernel variant where the kernels are not what is under
 * test): they look for memory errors, undefined behaviour and races, which
 * the smaller run reaches through the same code, while the plain build keeps
 * the sizes that the statistics and the stress need.  KVD_TEST_FULL=1
 * (`make test-long`) keeps the full sizes in every build. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TEST_SANITIZED 1
#else
#define TEST_SANITIZED 0
#endif

/* Walks the threads of process pid (0: this one): the niceness of the
 * thread named `comm` (pthread_setname_np) into *named, INT_MIN when none
 * is; the lowest and highest of the threads named `others` into *lo, *hi
 * (INT_MAX, INT_MIN: none). */
static inline void thread_nices(int pid, const char *comm, const char *others, int *named,
				int *lo, int *hi)
{
	char dir[64];
	DIR *d;
	struct dirent *e;

	snprintf(dir, sizeof dir, pid ? "/proc/%d/task" : "/proc/self/task", pid);
	*named = INT_MIN;
	*lo = INT_MAX;
	*hi = INT_MIN;
	if (!(d = opendir(dir)))
		return;
	while ((e = readdir(d))) {
		char path[400], name[32] = "", st[512], *p;
		FILE *f;
		size_t n;
		int nice;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof path, "%s/%s/comm", dir, e->d_name);
		if (!(f = fopen(path, "r")))
			continue;
		if (!fgets(name, sizeof name, f))
			name[0] = 0;
		fclose(f);
		name[strcspn(name, "\n")] = 0;
		snprintf(path, sizeof path, "%s/%s/stat", dir, e->d_name);
		if (!(f = fopen(path, "r")))
			continue;
		n = fread(st, 1, sizeof st - 1, f);
		fclose(f);
		st[n] = 0;
		/* after comm's ")": state ppid pgrp session tty_nr tpgid flags
		 * minflt cminflt majflt cmajflt utime stime cutime cstime
		 * priority nice(19) */
		if (!(p = strrchr(st, ')')) ||
		    sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %d",
			   &nice) != 1)
			continue;
		if (!strcmp(name, comm)) {
			*named = nice;
		} else if (others && !strcmp(name, others)) {
			*lo = nice < *lo ? nice : *lo;
			*hi = nice > *hi ? nice : *hi;
		}
	}
	closedir(d);
}

/* The niceness of this process's thread named `comm`, waiting up to 2 s
 * for it to exist and differ from `not`: the thread sets its own niceness
 * after it starts.  INT_MIN: no such thread. */
static inline int thread_nice(const char *comm, int not)
{
	int got = INT_MIN, lo, hi;

	for (int i = 0; i < 200; i++) {
		thread_nices(0, comm, NULL, &got, &lo, &hi);
		if (got != INT_MIN && got != not)
			return got;
		struct timespec ts = { 0, 10000000 };

		nanosleep(&ts, NULL);
	}
	return got;
}

/* Sets this thread's niceness to `root` when the test runs as root (it may
 * lower it), else to at least `user` (raising needs no privilege).  Returns
 * the niceness it had; *now: the one it has. */
static inline int test_set_nice(int root, int user, int *now)
{
	errno = 0;
	int was = getpriority(PRIO_PROCESS, 0), want = geteuid() == 0 ? root : was < user ? user : was;

	assert_int_equal(errno, 0);
	assert_int_equal(setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), want), 0);
	*now = getpriority(PRIO_PROCESS, 0);
	assert_int_equal(*now, want);
	return was;
}

/* Puts back what test_set_nice() returned, where the test may (as root). */
static inline void test_restore_nice(int was)
{
	if (geteuid() == 0)
		assert_int_equal(setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), was), 0);
}

static inline int test_quick(void)
{
	const char *e = getenv("KVD_TEST_FULL");

	return TEST_SANITIZED && !(e && *e && strcmp(e, "0"));
}

/* test_quick() ? quick : full */
static inline unsigned test_size(unsigned full, unsigned quick)
{
	return test_quick() ? quick : full;
}

static inline void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);

	if (!p) {
		fprintf(stderr, "out of memory\n");
		exit(1);
	}
	return p;
}

static inline void fill_normal(float *x, size_t n, struct kvd_rng *r, double mean, double sd)
{
	for (size_t i = 0; i < n; i++)
		x[i] = (float)(mean + sd * kvd_rng_normal(r));
}

static inline void fill_bf16(uint16_t *x, size_t n, struct kvd_rng *r, double mean, double sd)
{
	for (size_t i = 0; i < n; i++)
		x[i] = kvd_f32_to_bf16((float)(mean + sd * kvd_rng_normal(r)));
}

/* ||a - b|| / ||b|| over n doubles/floats. */
static inline double rel_err_fd(const float *a, const double *b, size_t n)
{
	double num = 0, den = 0;

	for (size_t i = 0; i < n; i++) {
		num += (a[i] - b[i]) * (a[i] - b[i]);
		den += b[i] * b[i];
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}

static inline double rel_err_ff(const float *a, const float *b, size_t n)
{
	double num = 0, den = 0;

	for (size_t i = 0; i < n; i++) {
		num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
		den += (double)b[i] * b[i];
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The kernel variants this CPU runs, scalar first. */
static inline int kern_variants(const struct kvd_kern **out)
{
	static const char *const names[] = { "scalar", "avx2", "avx512", "avx512bf16", "avx512amx" };
	int n = 0;

	for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
		const struct kvd_kern *k = kvd_kern_by_name(names[i]);

		if (k && k->qk)
			out[n++] = k;
		else
			printf("SKIP: kernel variant %s not supported on this CPU\n", names[i]);
	}
	return n;
}

/* The variants a test of what the kernels feed (the estimators, the layer
 * driver) walks: every one in the plain build, the dispatched one in a quick
 * run; test_kern walks every variant in every build. */
static inline int kern_variants_of_callers(const struct kvd_kern **out)
{
	if (!test_quick())
		return kern_variants(out);
	out[0] = kvd_kern_get();
	printf("quick run: the dispatched kernels (%s) only\n", out[0]->name);
	return 1;
}

#endif
