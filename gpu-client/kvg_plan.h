/* kvg_plan: the host-side arithmetic of libkvclient's CUDA backend, kept
 * apart from CUDA so CI tests it on machines without a GPU
 * (tests/unit/test_gpu_plan.c): how attention is split over thread blocks,
 * the window ring of each (sequence, layer), and the double-precision
 * references the device tests compare the kernels with.
 *
 * Everything here is pure and thread-safe; nothing allocates except the
 * reference functions' documented scratch.
 */
#ifndef KVG_PLAN_H
#define KVG_PLAN_H

#include <stddef.h>
#include <stdint.h>

#define KVG_TILE        32u     /* rows per attention tile (one per lane) */
#define KVG_ATTN_BATCH  64u     /* sequences per attention launch (by-value descriptors) */
#define KVG_SPLIT_MAX   128u    /* most blocks one (sequence, kv head) is split over */
#define KVG_SPLIT_MIN_ROWS 256u /* fewer rows per split than this is not worth a combine */
#define KVG_APPEND_BATCH 32u    /* window evictions sent to kvd together (both backends) */

/* ---- attention over rows held on the GPU --------------------------------- */

/* One sequence's rows of one layer, all kv heads: k, v are bf16
 * [kv_heads][cap][d].  Logical row i (0 <= i < nsink + count) is stored at
 *   i                                  for i < nsink (the sinks)
 *   nsink + (head + i - nsink) % (cap - nsink)   otherwise (the ring)
 * Softmax does not care about order, so a ring costs nothing and evicting
 * the oldest rows moves no data.  A dense cache is nsink = head = 0. */
struct kvg_rows {
	const uint16_t *k, *v;
	uint32_t cap, nsink, head, count;
};

static inline uint32_t kvg_rows_n(const struct kvg_rows *r)
{
	return r->nsink + r->count;
}

/* Storage row of logical row i (as above). */
static inline uint32_t kvg_rows_at(const struct kvg_rows *r, uint32_t i)
{
	uint32_t R = r->cap - r->nsink;

	return i < r->nsink ? i : r->nsink + (uint32_t)(((uint64_t)r->head + (i - r->nsink)) % R);
}

/* How one launch splits rows: every (sequence, kv head) is cut into nsplit
 * chunks of `chunk` logical rows (a multiple of KVG_TILE); with nsplit > 1
 * each block writes a partial (o, lse) into scratch of part_floats floats
 * that a combine kernel merges.  target_blocks: blocks wanted in flight (a
 * few per SM); max_rows: the longest sequence of the batch. */
struct kvg_attn_plan {
	uint32_t nsplit, chunk;
	size_t part_floats;             /* nseq * q_heads * nsplit * (d + 1), 0 when nsplit == 1 */
};

void kvg_attn_plan(uint32_t max_rows, uint32_t nseq, uint32_t kv_heads, uint32_t q_heads,
		   uint32_t d, uint32_t target_blocks, struct kvg_attn_plan *p);

/* ---- the window ring of a sparse layer ----------------------------------- */

/* The client keeps nsink sink rows and a ring of the most recent rows; a
 * token appended when the ring holds window + KVG_APPEND_BATCH rows makes the
 * oldest KVG_APPEND_BATCH leave for kvd (the CPU backend's rule, kvc.c). */
struct kvg_ring {
	uint32_t nsink, R;              /* ring capacity R = cap - nsink */
	uint32_t head, count;
};

/* Storage row the next appended token goes to. */
static inline uint32_t kvg_ring_tail(const struct kvg_ring *r)
{
	return r->nsink + (uint32_t)(((uint64_t)r->head + r->count) % r->R);
}

/* After one append: 1 when the oldest KVG_APPEND_BATCH rows must go. */
static inline int kvg_ring_must_evict(const struct kvg_ring *r, uint32_t window)
{
	return r->count >= window + KVG_APPEND_BATCH;
}

/* Drops the oldest cnt rows (cnt <= count). */
static inline void kvg_ring_drop(struct kvg_ring *r, uint32_t cnt)
{
	r->head = (uint32_t)(((uint64_t)r->head + cnt) % r->R);
	r->count -= cnt;
}

/* The data plane's sizes and offsets (chunks, records, outputs) are the
 * ABI's: kvd_rows_fit, kvd_attend_fit and kvd_attend_layout in
 * proto/kvd_ring.h. */

/* ---- backend choice ---------------------------------------------------------- */

struct kvc_opts;

/* The backend opts asks for once the environment has had its say:
 * KVC_BACKEND_CPU (opts NULL or backend 0), _CUDA or _AUTO, the variable
 * KVC_BACKEND=cpu|cuda|auto replacing AUTO only.  -EINVAL with msg set for
 * an unknown backend or value. */
int kvg_backend_wanted(const struct kvc_opts *o, const char *env, char *msg, size_t len);

/* ---- references (tests) --------------------------------------------------- */

/* The code layout the pack kernel writes: projections y ([R][K*L] row-major,
 * row r) into codes, code of row r and table t at
 *   (r / per) * sg + t * st + (r % per) * sr.
 * Keys of one chunk: per = cnt, sg = L*cnt, st = cnt, sr = 1 ([H][L][cnt]);
 * queries: per = 1, sg = L, st = 1, sr = 0 ([nseq*Hq][L]).  Bit j of the
 * code is y[r][t*K + j] > 0. */
struct kvg_code_layout {
	uint32_t per, sg, st, sr;
};
void kvg_pack_ref(const float *y, uint32_t R, uint32_t K, uint32_t L,
		  const struct kvg_code_layout *lay, uint16_t *codes);

/* Exact attention in double of G q heads over one kv head's logical rows
 * of r (bf16, converted exactly): o[G][d], lse[G]; scores q.k / sqrt(d).
 * Empty: o = 0, lse = -inf.  h: the kv head. */
void kvg_attn_ref(const float *q, uint32_t G, uint32_t d, const struct kvg_rows *r,
		  uint32_t h, double *o, double *lse);

/* The LSE merge in double of (o, lse) with (o2, lse2), G heads of d. */
void kvg_merge_ref(double *o, double *lse, const float *o2, const float *lse2, uint32_t G,
		   uint32_t d);

#endif
