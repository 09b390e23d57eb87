/* kvd_wire: checks of data-plane submissions (proto/kvd_ring.h), the first
 * thing kvd does with every ring entry a client wrote.
 *
 * kvd_wire_sqe() copies the entry out of shared memory — the client can
 * rewrite it at any moment — and checks everything that needs no state: the
 * op, flags and reserved fields, that the payload and output ranges lie in
 * one of the client's slots without overflow and do not overlap, and the
 * counts' ranges.  kvd_wire_payload() then checks the sizes against the
 * sequence's profile.  Both fill `msg` with the reason on failure and return
 * a negative code (-EINVAL, -ERANGE, -EBADMSG).  Pure functions: fuzzed in
 * tests/fuzz/fuzz_wire.c.
 */
#ifndef KVD_WIRE_H
#define KVD_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "proto/kvd_ring.h"

struct kvd_profile;

/* The ABI limits KVD_WIRE_MAX_NSEQ and KVD_WIRE_MAX_NTOK and the payload
 * layouts checked here are proto/kvd_ring.h's. */

int kvd_wire_sqe(const void *entry, uint32_t nslots, uint64_t slot_size,
		 struct kvd_sqe *out, char *msg, size_t msglen);

int kvd_wire_payload(const struct kvd_sqe *e, const struct kvd_profile *p,
		     char *msg, size_t msglen);

#endif
