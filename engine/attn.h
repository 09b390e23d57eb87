/* kvd_attn: attention over what kvd holds of one layer — sealed segments
 * answered by sampling (MagicPIG's estimator, docs/ARCHITECTURE.md) and the
 * exact tail — and the LSE merge that joins partial results.
 *
 * Conventions: scores are q.k / sqrt(d) over centered keys; a partial result
 * is (o, lse) with o normalised (the softmax-weighted mean of V) and
 * lse = ln sum exp(score).  An empty part is (0, -inf) and merges as nothing.
 * The q heads of a GQA group (G consecutive q heads) share one kv head.
 * Segments and the geometry (kvd_geom) are engine/seg.h's; attention only
 * reads them.
 *
 * Scratch is per worker thread (kvd_attn_scratch); everything else is pure.
 */
#ifndef KVD_ATTN_H
#define KVD_ATTN_H

#include <stddef.h>
#include <stdint.h>

#include "kern.h"
#include "lsh.h"
#include "seg.h"

struct kvd_pool;

struct kvd_attn_stats {
	uint64_t cand;                  /* sum over q heads of sampled keys */
	uint64_t rows;                  /* K rows gathered: each q head's own sample
					 * and (hybrid, adaptive) heavy keys */
	uint64_t vrows;                 /* V rows gathered: the same rows */
	uint64_t bucket_ids;            /* bucket entries walked */
};

struct kvd_attn_scratch {
	struct kvd_lsh_scratch lsh;
	uint32_t cap;
	uint16_t *cand;                 /* [cap]: one q head's sample */
	uint32_t *rows;                 /* [cap]: its sample and heavy keys, ascending */
	float *kinv;                    /* [cap] */
	float *vsc;                     /* [cap]: int8's vscale, read with kinv */
	int16_t *w16;                   /* [cap]: one q head's weights for pv8 */
	float *s;                       /* [max(cap, KVD_ATTN_DENSE_SCRATCH)]: scores */
	float *t;                       /* [cap]: hybrid_cv's raw scores, then 1/P */
	/* kvd_attn_layers()'s buffers when this is the first of its scratch
	 * array (up to KVD_ATTN_JOB_KEEP bytes, kept between calls) */
	void *job;
	size_t job_bytes;
};
#define KVD_ATTN_JOB_KEEP (2u << 20)

int kvd_attn_scratch_init(struct kvd_attn_scratch *s, uint32_t cap);
void kvd_attn_scratch_free(struct kvd_attn_scratch *s);

/* Sampled attention of the G q heads q[G][d] (codes qc[G][L]) over kv head h
 * of segment seg.  o[G][d], lse[G].  st may be NULL. */
void kvd_attn_sampled(const struct kvd_kern *kk, const struct kvd_geom *g,
		      const struct kvd_logp_tab *tab, const struct kvd_seg *seg, uint32_t h,
		      const float *q, const uint16_t *qc, struct kvd_attn_scratch *s,
		      float *o, float *lse, struct kvd_attn_stats *st);

/* Exact attention of G q heads over n contiguous rows k, v ([n][d] bf16):
 * the tail, and the dense baseline.  s: scratch of KVD_ATTN_DENSE_SCRATCH
 * floats (a kvd_attn_scratch's s always has room). */
void kvd_attn_dense(const struct kvd_kern *kk, const float *q, int G, int d,
		    const uint16_t *k, const uint16_t *v, size_t n, float *o, float *lse,
		    float *s);
/* The same over all rows of kv head h of a segment, bf16 or int8. */
void kvd_attn_dense_seg(const struct kvd_kern *kk, const float *q, int G,
			const struct kvd_seg *seg, uint32_t h, float *o, float *lse, float *s);
#define KVD_ATTN_DENSE_SCRATCH (KVD_GMAX * 256)

/* (o, lse) <- merge of (o, lse) and (o2, lse2), for G heads of d. */
void kvd_attn_merge(float *o, float *lse, const float *o2, const float *lse2, int G, int d);

/* One layer: all q heads over the segments and the tail (tail_k/tail_v
 * [kv_heads][tail_cap][d] holding tail_n rows per head, may be 0).  q[q_heads][d], qc[q_heads][L];
 * o[q_heads][d], lse[q_heads].  Tasks are (segment, kv head) pairs plus the
 * tail, each split in up to 4 (by q head, or by rows for dense parts),
 * spread over the pool, whose workers use scr[worker]. */
struct kvd_layer_view {
	const struct kvd_seg *const *seg;
	uint32_t nseg;
	const uint16_t *tail_k, *tail_v;
	uint32_t tail_n;
	uint32_t tail_cap;              /* rows per head in tail_k/v (0: tail_n) */
};
int kvd_attn_layer(struct kvd_pool *pool, struct kvd_attn_scratch *scr,
		   const struct kvd_kern *kk, const struct kvd_geom *g,
		   const struct kvd_logp_tab *tab, const struct kvd_layer_view *lv,
		   const float *q, const uint16_t *qc, float *o, float *lse,
		   struct kvd_attn_stats *st);

/* Estimators (docs/ARCHITECTURE.md, "Estimators"), chosen per profile.
 *
 * magicpig: every sealed segment by LSH sampling, each sampled key weighted
 *   1/P(key sampled) (Horvitz-Thompson); no state.
 * hybrid: a per-(sequence, layer, q head) heavy list -- the keys with the
 *   largest exact weight seen in the previous steps -- is attended exactly
 *   (weight 1) and the rest by the same sampling as magicpig, keys of the
 *   list excluded from it.  Up to KVD_HEAVY_MAX keys per q head.
 * adaptive: hybrid, but a key stays in the list only while it carried at
 *   least 2^-KVD_HEAVY_SHARE_LOG2 of its head's attention mass, so each
 *   head spends extra rows only where sampling variance matters (diffuse
 *   heads keep an empty list and cost what magicpig costs).
 * hybrid_cv: hybrid, plus a control variate for the sampled remainder of
 *   each segment-head: a constant c per (segment, q head) stands in for
 *   every key's weight, summed exactly over all the segment's rows (c n and
 *   c sum(V)), and only the differences exp(score) - c are sampled.  c is
 *   the variance-minimizing constant estimated from the sample itself, so
 *   the estimate is consistent rather than unbiased (docs/ARCHITECTURE.md,
 *   "The control variate"); where it would leave no positive mass it falls
 *   back to hybrid's own.
 * hybrid_lcv: hybrid_cv with a line in the raw score, c_i = alpha + beta
 *   (s_i - mu), in place of the constant: its sums over all rows are exact
 *   from the segment's moments (kvd_seg_head.ksum, kv), and alpha, beta
 *   are a weighted least-squares fit on the sample (consistent, not
 *   unbiased; "The linear control variate"), falling back to hybrid_cv's
 *   constant, then to hybrid's own.  Its budget is per q head: a head
 *   whose list did not fill with keys of at least 2^-KVD_HEAVY_SHARE_LOG2
 *   of its mass last step walks only the first KVD_LCV_LO(L) tables
 *   (tab_lo in the request), a sample of that many tables, weighted by
 *   their P, with the line; the others walk all L with hybrid_cv's
 *   constant, and a group none of whose heads has the line reads no
 *   moments ("The per-head budget").  Where the line answers, the V rows
 *   of small weight go through Russian roulette (kvd_attn_roulette): most
 *   of a peaked head's sampled rows are never read for V ("Roulette on
 *   the V rows").
 *
 * The state of one layer is kvd_heavy_words(g) uint32 words, zero-filled
 * when new (empty lists): per q head a count then KVD_HEAVY_MAX entries
 * (segment << 16 | row), ascending; hybrid_lcv keeps its budget in bit 16
 * of the count word.  Attention reads it; kvd_attn_layers
 * rewrites it after the step.  Entries that no longer name a row of the
 * view are ignored, so any bytes there are safe. */
enum kvd_estimator {
	KVD_EST_MAGICPIG = 0,
	KVD_EST_HYBRID = 1,
	KVD_EST_ADAPTIVE = 2,
	KVD_EST_HYBRID_CV = 3,
	KVD_EST_HYBRID_LCV = 4,
};
#define KVD_EST_MAX KVD_EST_HYBRID_LCV
#define KVD_HEAVY_MAX 32
#define KVD_HEAVY_SHARE_LOG2 10
#define KVD_HEAVY_LO (1u << 16)         /* count word: the reduced budget */
#define KVD_LCV_LO(L) ((L) / 2 ? (L) / 2 : 1)
/*
 * Russian roulette on the weights w[0..m) of rows[0..m) (and aux[0..m),
 * int8's value scales, when not NULL), in place: a weight of magnitude at
 * least tau = KVD_RR_SHARE * sum|w| / m stays; a smaller one becomes
 * sign(w) * tau when u < |w| / tau and is dropped otherwise, u uniform on
 * [0, 1) in steps of 2^-24 from kvd_rng_bits_at(seed, row).  Given the
 * weights, every kept weight's expectation over u is its weight (to 2^-24
 * of tau), so a sum over the rows stays unbiased.  The kept entries are
 * packed to the front in their order; returns how many.
 */
#define KVD_RR_SHARE 0.25f
uint32_t kvd_attn_roulette(float *w, uint32_t *rows, float *aux, uint32_t m, uint64_t seed);
/* The roulette's seed for a q head's part of segment `seg` (its number in
 * the view): from the query's first 8 coordinates (d >= 8), its first nc
 * codes (up to 4) and seg, so that it changes with every step's query. */
uint64_t kvd_attn_rr_seed(const float *q, const uint16_t *qc, uint32_t nc, uint32_t seg);

/* "magicpig" / "hybrid" / "adaptive" / "hybrid_cv" / "hybrid_lcv"; NULL for
 * an unknown value.
 * kvd_estimator_parse: 0 and *out, or -EINVAL. */
const char *kvd_estimator_name(uint32_t est);
int kvd_estimator_parse(const char *s, uint32_t *out);
/* Words of one layer's state (q_heads * (1 + KVD_HEAVY_MAX)). */
size_t kvd_heavy_words(const struct kvd_geom *g);

/* What a profile chooses for its sparse layers: estimator, bits per table,
 * tables, collisions needed, row format and tokens per segment (0: kvd's
 * default, 32768).  KVD_EST_CFG_MAGICPIG is MagicPIG's own choice, the
 * yardstick of every _vs_magicpig figure; it has no segments, and its
 * estimate does not depend on them (no state per segment), so kvbench cuts
 * its layer as the configuration it is compared with.  KVD_EST_CFG_DEFAULT
 * is what kvd recommends, what the client libraries' profiles get unless
 * they say otherwise (the Python Model, kvd-decode; on the wire 0 stays
 * magicpig, bf16 and 32768), and what kvbench's `--estimator default`
 * measures against MagicPIG's: hybrid_lcv at 70 tables in int8, in
 * segments of 65536 tokens, which met MagicPIG's accuracy on every
 * workload measured (docs/ARCHITECTURE.md, "The default"). */
struct kvd_est_cfg {
	uint32_t est, K, L, c, kv_dtype, seg_tokens;
};
#define KVD_EST_CFG_MAGICPIG ((struct kvd_est_cfg){ KVD_EST_MAGICPIG, 10, 150, 2, KVD_KV_BF16, 0 })
#define KVD_EST_CFG_DEFAULT                                                           \
	((struct kvd_est_cfg){ KVD_EST_HYBRID_LCV, 10, 70, 2, KVD_KV_INT8, 65536 })

/* Several layers' requests (of any sequences and profiles) in one pool job,
 * so requests from different clients share one pass over the workers.
 * Each result is bit-identical to kvd_attn_layer() on the same request: its
 * tasks and merge order do not depend on the others.  r[i].rc is set per
 * request (0, -KVD_EGEOM, -KVD_ESHAPE, -ENOMEM); a bad request does not stop
 * the rest.  tab NULL in a request means exact (dense) attention.  st, when
 * not NULL, sums over all requests.  n <= KVD_ATTN_BATCH_MAX; returns 0,
 * or -EINVAL / -ENOMEM when nothing ran.  scr is the pool's scratch, one a
 * worker; the call keeps its buffers in scr[0] (freed with it), so calls
 * with the same scr must not overlap. */
#define KVD_ATTN_BATCH_MAX 64
struct kvd_attn_req {
	const struct kvd_geom *g;
	const struct kvd_logp_tab *tab;
	const struct kvd_layer_view *lv;
	const float *q;
	const uint16_t *qc;
	float *o, *lse;
	uint32_t est;                   /* enum kvd_estimator; magicpig without heavy */
	uint32_t *heavy;                /* kvd_heavy_words(g), or NULL (no state) */
	/* hybrid_lcv: the logp table of (K, KVD_LCV_LO(L), c) for heads on
	 * the reduced budget; NULL: every head walks all L tables */
	const struct kvd_logp_tab *tab_lo;
	int rc;
};
int kvd_attn_layers(struct kvd_pool *pool, struct kvd_attn_scratch *scr,
		    const struct kvd_kern *kk, struct kvd_attn_req *r, uint32_t n,
		    struct kvd_attn_stats *st);

/* Exact dense attention of the whole layer (the baseline to beat): the same
 * rows as `lv`, every one of them, no sampling, spread over the pool. */
int kvd_attn_layer_dense(struct kvd_pool *pool, struct kvd_attn_scratch *scr,
			 const struct kvd_kern *kk, const struct kvd_geom *g,
			 const struct kvd_layer_view *lv, const float *q, float *o, float *lse);

#endif
