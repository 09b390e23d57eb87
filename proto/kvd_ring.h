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
	KVD_OP_MAX
};

/* PREFILL / APPEND flags */
#define KVD_RF_MEAN 0x01        /* payload starts with the layer's centering mean */
#define KVD_RF_LAST 0x02        /* PREFILL: last chunk of this layer: seal the rest */

struct kvd_sqe {
	uint8_t op;
	uint8_t flags;
	uint16_t layer;
	uint32_t slot;
	uint64_t user_data;     /* echoed in the completion */
	uint64_t seq;           /* PREFILL, APPEND, FREE: the sequence */
	uint32_t off, len;      /* payload: bytes [off, off+len) of the slot */
	uint32_t ntok;          /* PREFILL, APPEND: tokens in the payload */
	uint32_t nseq;          /* ATTEND: sequences in the batch */
	uint32_t out_off, out_len; /* ATTEND: where (o, lse) go in the slot */
	uint32_t _reserved[4];  /* must be zero */
};
static_assert(sizeof(struct kvd_sqe) == KVD_RING_ENTRY, "sqe size");

struct kvd_cqe {
	uint64_t user_data;
	int32_t res;            /* 0, or -errno / -KVD_E* (kvd/err.h) */
	uint32_t _reserved;
	char msg[48];           /* NUL-terminated reason when res < 0 */
};
static_assert(sizeof(struct kvd_cqe) == KVD_RING_ENTRY, "cqe size");

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

static inline uint64_t kvd_rows_bytes(uint32_t H, uint32_t d, uint32_t L, uint32_t ntok, int mean)
{
	uint64_t m = mean ? KVD_ALIGN64((uint64_t)H * d * 4) : 0;
	uint64_t rows = KVD_ALIGN64((uint64_t)H * ntok * d * 2);

	return m + 2 * rows + KVD_ALIGN64((uint64_t)H * L * ntok * 2);
}

static inline uint64_t kvd_attend_in_bytes(uint32_t Hq, uint32_t d, uint32_t L)
{
	return 64 + KVD_ALIGN64((uint64_t)Hq * d * 4) + KVD_ALIGN64((uint64_t)Hq * L * 2);
}

static inline uint64_t kvd_attend_out_bytes(uint32_t Hq, uint32_t d)
{
	return KVD_ALIGN64((uint64_t)Hq * d * 4) + KVD_ALIGN64((uint64_t)Hq * 4);
}

#endif
