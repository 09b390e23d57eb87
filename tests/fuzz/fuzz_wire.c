/* libFuzzer target: data-plane entry validation (kvd/wire.c).  The input is
 * a 64-byte ring entry followed by a few bytes choosing the client's arena
 * and the sequence's profile.  Whatever the checks accept must be safe to
 * act on: the payload and output ranges lie inside one slot and do not
 * overlap, and the payload size matches the profile exactly. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/kvd_ring.h"
#include "kvd/store/store.h"
#include "kvd/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	uint8_t entry[KVD_RING_ENTRY] = { 0 }, knobs[8] = { 0 };
	struct kvd_sqe e;
	char msg[160];

	memcpy(entry, data, size < sizeof entry ? size : sizeof entry);
	if (size > sizeof entry)
		memcpy(knobs, data + sizeof entry,
		       size - sizeof entry < sizeof knobs ? size - sizeof entry : sizeof knobs);

	uint32_t nslots = 1 + knobs[0] % 64;
	uint64_t slot_size = (uint64_t)(1 + knobs[1] % 64) << 16;

	if (kvd_wire_sqe(entry, nslots, slot_size, &e, msg, sizeof msg)) {
		if (!memchr(msg, 0, sizeof msg) || !msg[0])
			abort();                /* every refusal says why */
		return 0;
	}
	if (e.op == KVD_OP_PREFILL || e.op == KVD_OP_APPEND || e.op == KVD_OP_ATTEND ||
	    e.op == KVD_OP_LOCAL) {
		if (e.slot >= nslots || (uint64_t)e.off + e.len > slot_size)
			abort();
	}
	if (e.op == KVD_OP_LOCAL && (e.ntok == 0 || e.ntok > KVD_WIRE_MAX_NTOK ||
				     ((e.flags & KVD_LF_GET) ? e.len != 0 : e.out_len != 0)))
		abort();
	if (e.op == KVD_OP_ATTEND || (e.op == KVD_OP_LOCAL && (e.flags & KVD_LF_GET))) {
		if ((uint64_t)e.out_off + e.out_len > slot_size)
			abort();
		if (e.len && e.out_len && e.out_off < e.off + (uint64_t)e.len &&
		    e.off < e.out_off + (uint64_t)e.out_len)
			abort();
	}

	uint8_t dense[64] = { 0 };
	struct kvd_profile p = {
		.g = { .q_heads = 4u << (knobs[2] % 3), .kv_heads = 1u << (knobs[2] % 3),
		       .d = 16u << (knobs[3] % 4), .K = 1 + knobs[4] % 16, .L = 1 + knobs[5],
		       .c = 1 + knobs[6] % 2 },
		.layers = 1 + knobs[7] % 64,
		.dense = dense,
	};

	dense[knobs[7] % 64] = 1;
	if (kvd_wire_payload(&e, &p, msg, sizeof msg) == 0 &&
	    (e.op == KVD_OP_PREFILL || e.op == KVD_OP_APPEND)) {
		if (e.layer >= p.layers || p.dense[e.layer] ||
		    e.len != kvd_rows_bytes(p.g.kv_heads, p.g.d, p.g.L, e.ntok, e.flags & KVD_RF_MEAN))
			abort();
	}
	if (kvd_wire_payload(&e, &p, msg, sizeof msg) == 0 && e.op == KVD_OP_LOCAL) {
		uint64_t want = kvd_local_layout(p.g.kv_heads, p.g.d, e.ntok,
						 e.flags & KVD_LF_MEAN).bytes;

		if (e.layer >= p.layers || ((e.flags & KVD_LF_MEAN) && p.dense[e.layer]) ||
		    ((e.flags & KVD_LF_GET) ? e.out_len < want : e.len != want))
			abort();
	}
	return 0;
}
