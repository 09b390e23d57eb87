/* kvg_kern: the CUDA kernels of libkvclient's GPU backend (kvg_kern.cu) and
 * their host launchers, callable from C.
 *
 * Every launcher only enqueues work on `st` and returns the launch status
 * (cudaSuccess, or the error cudaGetLastError reports); none synchronises.
 * Pointers are device pointers.  Rows are bf16 (uint16_t bit patterns,
 * rounded to nearest even exactly as engine/bf16.h), d is a multiple of 16 and
 * at most 256, a GQA group G = q_heads / kv_heads is at most 16, K <= 16
 * bits: the limits of kvd_geom_check().
 *
 * Conventions are kvd's (engine/attn.h): scores q.k / sqrt(d) over centered
 * keys; a partial result is (o, lse), o normalised, empty = (0, -inf).
 */
#ifndef KVG_KERN_H
#define KVG_KERN_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kvg_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kvg_dtype { KVG_F32 = 0, KVG_BF16 = 1 };

/* ---- prefill: centering mean, rows, codes -------------------------------- */

/* Scratch (bytes) kvg_mean needs for H heads of d. */
size_t kvg_mean_scratch(uint32_t H, uint32_t d);

/* mean[H][d] of rows [lo, hi) of k ([H][n][d] of dtype), summed in double
 * (partial sums per block, then the partials in a fixed order: the result is
 * deterministic and equals kvd_prep_mean's unless a double sum lands within
 * ~1e-14 of a float rounding boundary).  Zeros when lo == hi. */
cudaError_t kvg_mean(const void *k, int dtype, uint32_t H, uint32_t n, uint32_t d,
		     uint32_t lo, uint32_t hi, float *mean, double *scratch, cudaStream_t st);

/* Rows [t0, t0+cnt) of k, v ([H][n][d] of dtype): kb = bf16(k - mean) (mean
 * [H][d], NULL: none), vb = bf16(v), written at rows row0.. of kb, vb laid
 * out [H][ldo][d]; x (NULL: skipped) = float(kb) as [H][cnt][d], what the
 * hash multiplies (kvd_prep_rows hashes exactly the stored key). */
cudaError_t kvg_rows(const void *k, const void *v, int dtype, uint32_t H, uint32_t n,
		     uint32_t d, uint32_t t0, uint32_t cnt, const float *mean, uint16_t *kb,
		     uint16_t *vb, size_t ldo, uint32_t row0, float *x, cudaStream_t st);

/* One new token per sequence: k, v [nseq][H][d] of dtype go to row `row` of
 * put[j]'s storage ([H][cap][d]), centered with put[j].mean when not NULL. */
struct kvg_put {
	uint16_t *k, *v;
	const float *mean;
	uint32_t cap, row;
};
cudaError_t kvg_append(const void *k, const void *v, int dtype, const struct kvg_put *put,
		       uint32_t nseq, uint32_t H, uint32_t d, cudaStream_t st);

/* Eviction: the `cnt` oldest ring rows of ev[j] (ring as struct kvg_rows:
 * head, nsink, cap) copied to ev[j].kb, ev[j].vb ([H][cnt][d]) and, as
 * float, to x + j*H*cnt*d ([H][cnt][d] per sequence). */
struct kvg_evict {
	const uint16_t *k, *v;
	uint16_t *kb, *vb;
	uint32_t cap, nsink, head, _pad;
};
#define KVG_EVICT_BATCH 32u
cudaError_t kvg_gather(const struct kvg_evict *ev, uint32_t nev, uint32_t H, uint32_t d,
		       uint32_t cnt, float *x, cudaStream_t st);

/* Codes of rows r0 .. r0+R-1 from their projections y ([R][K*L], row r0
 * first) into codes with the layout lay (kvg_plan.h; r is the global row). */
cudaError_t kvg_pack(const float *y, uint32_t r0, uint32_t R, uint32_t K, uint32_t L,
		     const struct kvg_code_layout *lay, uint16_t *codes, cudaStream_t st);

/* ---- decode --------------------------------------------------------------- */

/* Exact attention of q ([nseq][Hq][d] float32) over rows[j] (host array of
 * nseq descriptors, passed to the kernels by value, so it may be reused as
 * soon as this returns) split as plan says (kvg_attn_plan with the same
 * nseq, H, Hq, d); part: plan->part_floats floats of scratch (unused when
 * nsplit == 1).  o [nseq][Hq][d], lse [nseq][Hq]. */
cudaError_t kvg_attn(const float *q, const struct kvg_rows *rows, uint32_t nseq, uint32_t Hq,
		     uint32_t H, uint32_t d, const struct kvg_attn_plan *plan, float *o,
		     float *lse, float *part, cudaStream_t st);

/* LSE merge in place of (o, lse) ([nseq][Hq][d], [nseq][Hq]) with kvd's
 * part: record j of kvd's output at rec + j * rec_floats, its o at +0 and
 * lse at + lse_floats (proto/kvd_ring.h).  kvd_only: (o, lse) = kvd's part. */
cudaError_t kvg_merge(float *o, float *lse, const float *rec, size_t rec_floats,
		      size_t lse_floats, uint32_t nseq, uint32_t Hq, uint32_t d, int kvd_only,
		      cudaStream_t st);

/* ---- hashing: cuBLAS projection + pack (kvg_hash.c) ------------------------ */

/* Codes of the R rows of x ([R][d] float32) with W ([d][K*L] float32, as
 * kvd_lsh.h) into codes (layout lay): y = x . W by cuBLAS in full float32
 * (CUBLAS_COMPUTE_32F_PEDANTIC: never TF32, so signs away from 0 agree with
 * the CPU's), rows_max rows at a time through y ([rows_max][K*L]), then
 * kvg_pack.  Binds `blas` to `st`.  0, or -EIO with the reason in err. */
struct cublasContext;
int kvg_hash_rows(struct cublasContext *blas, const float *W, uint32_t d, uint32_t K, uint32_t L,
		  const float *x, uint32_t R, float *y, uint32_t rows_max,
		  const struct kvg_code_layout *lay, uint16_t *codes, cudaStream_t st, char *err,
		  size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
