/* The data plane: fixed-size ring entries between a client and kvd, and the
 * payload layouts they point at in the arena.  docs/PROTOCOL.md is the prose
 * version; this header is the ABI (little-endian, no padding surprises:
 * every size is asserted below).
 *
 * A submission names an arena slot and a byte range in it.  kvd copies the
 * entry out of shared memory, checks every field (kvd/wire.c), and answers
 * with exactly one completion carrying the same user_data.  Outputs (ATTEND)
 * are written into the same slot at out_off before the completion is
 * published, so the client may read them as soon as it sees the completion.
 * A slot belongs to the client: it must not reuse it before the completion.
 */
#ifndef KVD_PROTO_RING_H
#define KVD_PROTO_RING_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#define KVD_RING_ENTRY 64

enum kvd_op {
	KVD_OP_NOP     = 0,     /* no payload; completes with 0 */
	KVD_OP_PREFILL = 1,     /* rows of one layer entering kvd at prefill */
	KVD_OP_APPEND  = 2,     /* rows leaving the GPU window after prefill */
	KVD_OP_ATTEND  = 3,     /* one layer, a batch of sequences x q heads */
	KVD_OP_FREE    = 4,     /* drop a sequence (same as the control message) */
	KVD_OP_PREFETCH = 5,    /* seq: start reading it back if it was spilled;
				 * completes at once (0, or why it cannot) */
	KVD_OP_LOCAL   = 6,     /* the client's own rows of one layer (sinks,
				 * window, dense layers) for prefix sharing:
				 * put before SeqPublish, get after an attach */
	KVD_OP_MAX
};

/* PREFILL / APPEND flags */
#define KVD_RF_MEAN 0x01        /* payload starts with the layer's centering mean */
#define KVD_RF_LAST 0x02        /* PREFILL: last chunk of this layer: seal the rest */
/* LOCAL flags */
#define KVD_LF_GET 0x01         /* kvd writes rows [row0, row0+ntok) at out_off;
				 * without it the payload puts them (row0 must be
				 * the rows put so far, or 0 to start again) */
#define KVD_LF_MEAN 0x02        /* GET: the layer's centering mean comes first */

struct kvd_sqe {
	uint8_t op;
	uint8_t flags;
	uint16_t layer;
	uint32_t slot;
	uint64_t user_data;     /* echoed in the completion */
	uint64_t seq;           /* PREFILL, APPEND, FREE: the sequence */
	uint32_t off, len;      /* payload: bytes [off, off+len) of the slot */
	uint32_t ntok;          /* PREFILL, APPEND, LOCAL: tokens in the payload */
	union {
		uint32_t nseq;  /* ATTEND: sequences in the batch */
		uint32_t row0;  /* LOCAL: the first row */
	};
	uint32_t out_off, out_len; /* ATTEND, LOCAL get: where the output goes */
	uint32_t _reserved[4];  /* must be zero */
};
static_assert(sizeof(struct kvd_sqe) == KVD_RING_ENTRY, "sqe size");
static_assert(offsetof(struct kvd_sqe, slot) == 4 && offsetof(struct kvd_sqe, user_data) == 8 &&
	      offsetof(struct kvd_sqe, seq) == 16 && offsetof(struct kvd_sqe, off) == 24 &&
	      offsetof(struct kvd_sqe, ntok) == 32 && offsetof(struct kvd_sqe, out_off) == 40 &&
	      offsetof(struct kvd_sqe, _reserved) == 48, "sqe layout");

struct kvd_cqe {
	uint64_t user_data;
	int32_t res;            /* 0, or -errno / -KVD_E* (engine/err.h) */
	uint32_t _reserved;
	char msg[48];           /* NUL-terminated reason when res < 0 */
};
static_assert(sizeof(struct kvd_cqe) == KVD_RING_ENTRY, "cqe size");
static_assert(offsetof(struct kvd_cqe, res) == 8 && offsetof(struct kvd_cqe, msg) == 16,
	      "cqe layout");

/* PREFILL / APPEND payload, for a profile with kv heads H, head_dim d,
 * L tables, ntok tokens; every part starts 64-byte aligned from `off`:
 *
 *   [mean: float32 [H][d]]           only with KVD_RF_MEAN
 *   K:     bf16    [H][ntok][d]      centered keys
 *   V:     bf16    [H][ntok][d]
 *   codes: uint16  [H][L][ntok]      the keys' SimHash codes, table-major
 *
 * ATTEND payload, per sequence of the batch (nseq of them), each entry
 * 64-byte aligned:
 *
 *   uint64 seq; uint32 _zero[14]      (a 64-byte record header)
 *   q:     float32 [Hq][d]
 *   codes: uint16  [Hq][L]
 *
 * ATTEND output at out_off, per sequence, each entry 64-byte aligned:
 *
 *   o:   float32 [Hq][d]              normalised, kvd's part only
 *   lse: float32 [Hq]                 ln sum exp(q.k/sqrt d) over kvd's part
 */
#define KVD_ALIGN64(x) (((x) + 63u) & ~(uint64_t)63u)

/* LOCAL payload (put) or output (get), ntok rows of one layer, each part
 * 64-byte aligned:
 *
 *   [mean: float32 [H][d]]           get with KVD_LF_MEAN (sparse layers)
 *   K:     bf16    [H][ntok][d]      as the client keeps them (sparse: centered)
 *   V:     bf16    [H][ntok][d]
 *
 * A put carries no payload for the mean; a get's input range is empty
 * (off = len = 0). */

/* ABI limits: kvd refuses an entry beyond them (kvd/wire.c), so a client
 * never cuts a batch or a chunk larger. */
#define KVD_WIRE_MAX_NSEQ 4096          /* sequences in one ATTEND batch */
#define KVD_WIRE_MAX_NTOK 65536         /* tokens in one PREFILL/APPEND */

/* The layout functions below are the only place these offsets are computed,
 * for kvd and every client alike.  They are pure and saturate: a size that
 * does not fit 64 bits comes out as UINT64_MAX, larger than any slot, so a
 * check against the slot refuses it instead of seeing a wrapped value. */
static inline uint64_t kvd_sat_mul(uint64_t a, uint64_t b)
{
	return b && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

static inline uint64_t kvd_sat_add(uint64_t a, uint64_t b)
{
	return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static inline uint64_t kvd_sat_align64(uint64_t x)
{
	return x > UINT64_MAX - 63 ? UINT64_MAX : KVD_ALIGN64(x);
}

/* One PREFILL/APPEND payload: offsets from `off` (the mean, when sent, is
 * at 0) and the exact length kvd expects. */
struct kvd_rows_layout {
	uint64_t k, v, codes;
	uint64_t bytes;
};

static inline struct kvd_rows_layout kvd_rows_layout(uint32_t H, uint32_t d, uint32_t L,
						     uint32_t ntok, int mean)
{
	uint64_t m = mean ? kvd_sat_align64(kvd_sat_mul((uint64_t)H * d, 4)) : 0;
	uint64_t rows = kvd_sat_align64(kvd_sat_mul((uint64_t)H * ntok, (uint64_t)d * 2));
	uint64_t codes = kvd_sat_align64(kvd_sat_mul((uint64_t)H * L, (uint64_t)ntok * 2));
	struct kvd_rows_layout lay;

	lay.k = m;
	lay.v = kvd_sat_add(lay.k, rows);
	lay.codes = kvd_sat_add(lay.v, rows);
	lay.bytes = kvd_sat_add(lay.codes, codes);
	return lay;
}

static inline uint64_t kvd_rows_bytes(uint32_t H, uint32_t d, uint32_t L, uint32_t ntok, int mean)
{
	return kvd_rows_layout(H, d, L, ntok, mean).bytes;
}

/* Most tokens of one PREFILL chunk (it carries the mean) that fit a slot
 * of slot_size bytes, at most KVD_WIRE_MAX_NTOK; 0 when not even one. */
static inline uint32_t kvd_rows_fit(uint32_t H, uint32_t d, uint32_t L, uint64_t slot_size)
{
	uint32_t lo = 0, hi = KVD_WIRE_MAX_NTOK;

	while (lo < hi) {
		uint32_t mid = (lo + hi + 1) / 2;

		if (kvd_rows_bytes(H, d, L, mid, 1) <= slot_size)
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

/* LOCAL: mean (when asked) at 0, then K and V; the exact length. */
struct kvd_local_layout {
	uint64_t k, v, bytes;
};

static inline struct kvd_local_layout kvd_local_layout(uint32_t H, uint32_t d, uint32_t ntok,
						       int mean)
{
	struct kvd_rows_layout r = kvd_rows_layout(H, d, 0, ntok, mean);
	struct kvd_local_layout lay = { r.k, r.v, r.codes };

	return lay;
}

/* Most rows of one LOCAL get (with the mean) that fit slot_size bytes. */
static inline uint32_t kvd_local_fit(uint32_t H, uint32_t d, uint64_t slot_size)
{
	uint32_t lo = 0, hi = KVD_WIRE_MAX_NTOK;

	while (lo < hi) {
		uint32_t mid = (lo + hi + 1) / 2;

		if (kvd_local_layout(H, d, mid, 1).bytes <= slot_size)
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

/* One ATTEND record (the record header at 0) and one output entry (o at
 * 0), for a profile of Hq q heads.  Both sizes are multiples of 64, so
 * record i is at i * in and output i at out_off + i * out. */
#define KVD_ATTEND_HDR 64               /* a record's header: uint64 seq, then zeros */

struct kvd_attend_layout {
	uint64_t in, q_off, codes_off;  /* a record: its size, q, codes */
	uint64_t out, lse_off;          /* an output entry: its size, lse */
};

static inline struct kvd_attend_layout kvd_attend_layout(uint32_t Hq, uint32_t d, uint32_t L)
{
	uint64_t qb = kvd_sat_align64(kvd_sat_mul((uint64_t)Hq * d, 4));
	uint64_t cb = kvd_sat_align64(kvd_sat_mul((uint64_t)Hq * L, 2));
	struct kvd_attend_layout lay;

	lay.q_off = KVD_ATTEND_HDR;
	lay.codes_off = kvd_sat_add(lay.q_off, qb);
	lay.in = kvd_sat_add(lay.codes_off, cb);
	lay.lse_off = qb;
	lay.out = kvd_sat_add(lay.lse_off, KVD_ALIGN64((uint64_t)Hq * 4));
	return lay;
}

static inline uint64_t kvd_attend_in_bytes(uint32_t Hq, uint32_t d, uint32_t L)
{
	return kvd_attend_layout(Hq, d, L).in;
}

static inline uint64_t kvd_attend_out_bytes(uint32_t Hq, uint32_t d)
{
	return kvd_attend_layout(Hq, d, 0).out;
}

/* Where a batch of nseq records puts its outputs: right after its input. */
static inline uint64_t kvd_attend_out_off(const struct kvd_attend_layout *lay, uint32_t nseq)
{
	return kvd_sat_align64(kvd_sat_mul(nseq, lay->in));
}

/* Most records of one ATTEND, with their outputs, that fit a slot of
 * slot_size bytes (in and out are multiples of 64, so this is exact), at
 * most KVD_WIRE_MAX_NSEQ; 0 when not even one. */
static inline uint32_t kvd_attend_fit(uint32_t Hq, uint32_t d, uint32_t L, uint64_t slot_size)
{
	struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, L);
	uint64_t per = slot_size / kvd_sat_add(lay.in, lay.out);

	return per > KVD_WIRE_MAX_NSEQ ? KVD_WIRE_MAX_NSEQ : (uint32_t)per;
}

#endif
