/* kvd_ref: double-precision references for tests and benchmarks.  Slow and
 * obvious on purpose; never used on a serving path.
 *
 * Inputs are float32 rows (convert bf16 with kvd_bf16_to_f32 first to compare
 * with the kernels on the same values).  Scores are q.k / sqrt(d).
 */
#ifndef KVD_REF_H
#define KVD_REF_H

#include <stddef.h>
#include <stdint.h>

/* Exact attention of one query over rows idx[0..m) (idx NULL: rows 0..m-1) of
 * k, v ([*][d]).  o[d], *lse.  Empty: o = 0, lse = -inf. */
void kvd_ref_dense(const float *q, int d, const float *k, const float *v,
		   const uint32_t *idx, size_t m, double *o, double *lse);

/* MagicPIG's estimator over the candidate rows idx[0..m): score
 * q.k/sqrt(d) - ln P(theta(q, k)) with P from kvd_lsh_logp (double). */
void kvd_ref_sampled(const float *q, int d, const float *k, const float *v,
		     const uint32_t *idx, size_t m, int K, int L, int c,
		     double *o, double *lse);

/* softmax(w) . V over rows idx[0..m) of v ([*][d]; idx NULL: rows 0..m-1),
 * w the rows' log-weights (scores): o[d], *lse = ln sum exp(w).  Empty (or
 * all -inf): o = 0, lse = -inf.  The core of the two functions above. */
void kvd_ref_softmax_v(const float *v, int d, const uint32_t *idx, size_t m, const double *w,
		       double *o, double *lse);

/* LSE merge in double. */
void kvd_ref_merge(double *o, double *lse, const double *o2, double lse2, int d);

#endif
