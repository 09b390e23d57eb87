#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kvd/store/store.h"
#include "wire.h"

#define FAIL(code, ...) do { snprintf(msg, msglen, __VA_ARGS__); return (code); } while (0)

static const uint8_t allowed_flags[KVD_OP_MAX] = {
	[KVD_OP_PREFILL] = KVD_RF_MEAN | KVD_RF_LAST,
	[KVD_OP_APPEND]  = 0,
	[KVD_OP_LOCAL]   = KVD_LF_GET | KVD_LF_MEAN,
};

static int out_range(const struct kvd_sqe *e, uint64_t slot_size, char *msg, size_t msglen)
{
	if (e->out_off % 64)
		FAIL(-EINVAL, "output offset %u not 64-byte aligned", e->out_off);
	if ((uint64_t)e->out_off + e->out_len > slot_size)
		FAIL(-ERANGE, "output [%u, +%u) past the slot's %llu bytes", e->out_off, e->out_len,
		     (unsigned long long)slot_size);
	if ((uint64_t)e->out_off < (uint64_t)e->off + e->len &&
	    (uint64_t)e->off < (uint64_t)e->out_off + e->out_len)
		FAIL(-EINVAL, "output range overlaps the input");
	return 0;
}

int kvd_wire_sqe(const void *entry, uint32_t nslots, uint64_t slot_size,
		 struct kvd_sqe *out, char *msg, size_t msglen)
{
	struct kvd_sqe e;

	/* One copy: every later check and use sees the same bytes. */
	memcpy(&e, entry, sizeof e);
	*out = e;
	if (e.op >= KVD_OP_MAX)
		FAIL(-EINVAL, "unknown op %u", e.op);
	if (e.flags & ~allowed_flags[e.op])
		FAIL(-EINVAL, "flags 0x%x not valid for op %u", e.flags, e.op);
	if (e._reserved[0] || e._reserved[1] || e._reserved[2] || e._reserved[3])
		FAIL(-EINVAL, "reserved fields must be zero");
	if (e.op == KVD_OP_NOP || e.op == KVD_OP_FREE || e.op == KVD_OP_PREFETCH)
		return 0;

	if (e.slot >= nslots)
		FAIL(-ERANGE, "slot %u out of range (%u slots)", e.slot, nslots);
	if (e.off % 64)
		FAIL(-EINVAL, "payload offset %u not 64-byte aligned", e.off);
	if ((uint64_t)e.off + e.len > slot_size)
		FAIL(-ERANGE, "payload [%u, +%u) past the slot's %llu bytes", e.off, e.len,
		     (unsigned long long)slot_size);
	if (e.op == KVD_OP_PREFILL || e.op == KVD_OP_APPEND) {
		if (e.ntok > KVD_WIRE_MAX_NTOK)
			FAIL(-ERANGE, "ntok %u above %u", e.ntok, KVD_WIRE_MAX_NTOK);
		if (e.op == KVD_OP_APPEND && e.ntok == 0)
			FAIL(-EINVAL, "APPEND of 0 tokens");
		if (e.nseq || e.out_off || e.out_len)
			FAIL(-EINVAL, "nseq/out_off/out_len must be zero for rows");
		return 0;
	}
	if (e.op == KVD_OP_LOCAL) {
		if (e.ntok == 0 || e.ntok > KVD_WIRE_MAX_NTOK)
			FAIL(-ERANGE, "LOCAL of %u rows (1..%u)", e.ntok, KVD_WIRE_MAX_NTOK);
		if (!(e.flags & KVD_LF_GET)) {
			if (e.flags & KVD_LF_MEAN)
				FAIL(-EINVAL, "LOCAL put takes no mean");
			if (e.out_off || e.out_len)
				FAIL(-EINVAL, "out_off/out_len must be zero for a LOCAL put");
			return 0;
		}
		if (e.len)
			FAIL(-EINVAL, "a LOCAL get has no input");
		return out_range(&e, slot_size, msg, msglen);
	}
	/* ATTEND */
	if (e.nseq == 0 || e.nseq > KVD_WIRE_MAX_NSEQ)
		FAIL(-ERANGE, "nseq %u not in 1..%u", e.nseq, KVD_WIRE_MAX_NSEQ);
	if (e.ntok)
		FAIL(-EINVAL, "ntok must be zero for ATTEND");
	return out_range(&e, slot_size, msg, msglen);
}

int kvd_wire_payload(const struct kvd_sqe *e, const struct kvd_profile *p,
		     char *msg, size_t msglen)
{
	uint32_t H = p->g.kv_heads, Hq = p->g.q_heads, d = p->g.d, L = p->g.L;

	switch (e->op) {
	case KVD_OP_PREFILL:
	case KVD_OP_APPEND: {
		uint64_t want = kvd_rows_bytes(H, d, L, e->ntok, e->flags & KVD_RF_MEAN);

		if (e->layer >= p->layers)
			FAIL(-ERANGE, "layer %u out of range (%u layers)", e->layer, p->layers);
		if (p->dense[e->layer])
			FAIL(-EINVAL, "layer %u is dense: kvd holds nothing for it", e->layer);
		if (e->len != want)
			FAIL(-EBADMSG, "payload of %u bytes, %llu expected for %u tokens", e->len,
			     (unsigned long long)want, e->ntok);
		return 0;
	}
	case KVD_OP_ATTEND: {
		struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, L);
		uint64_t in = kvd_sat_mul(e->nseq, lay.in), out = kvd_sat_mul(e->nseq, lay.out);

		if (e->layer >= p->layers)
			FAIL(-ERANGE, "layer %u out of range (%u layers)", e->layer, p->layers);
		if (p->dense[e->layer])
			FAIL(-EINVAL, "layer %u is dense: kvd holds nothing for it", e->layer);
		if (e->len != in)
			FAIL(-EBADMSG, "ATTEND payload of %u bytes, %llu expected for %u sequences",
			     e->len, (unsigned long long)in, e->nseq);
		if (e->out_len < out)
			FAIL(-EBADMSG, "ATTEND output room %u bytes, %llu needed", e->out_len,
			     (unsigned long long)out);
		return 0;
	}
	case KVD_OP_LOCAL: {
		int get = e->flags & KVD_LF_GET;
		uint64_t want = kvd_local_layout(H, d, e->ntok, e->flags & KVD_LF_MEAN).bytes;

		if (e->layer >= p->layers)
			FAIL(-ERANGE, "layer %u out of range (%u layers)", e->layer, p->layers);
		if (e->flags & KVD_LF_MEAN && p->dense[e->layer])
			FAIL(-EINVAL, "layer %u is dense: it has no mean", e->layer);
		if (!get && e->len != want)
			FAIL(-EBADMSG, "LOCAL payload of %u bytes, %llu expected for %u rows", e->len,
			     (unsigned long long)want, e->ntok);
		if (get && e->out_len < want)
			FAIL(-EBADMSG, "LOCAL output room %u bytes, %llu needed", e->out_len,
			     (unsigned long long)want);
		return 0;
	}
	default:
		return 0;
	}
}
