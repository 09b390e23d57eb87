/* kvd_prep: the prefill path on the CPU.  Turns one layer's raw float32 keys
 * and values into what kvd stores: the offloaded range [lo, hi) centered with
 * its own mean (docs/ARCHITECTURE.md, the estimator), rounded to bf16, hashed with W, and cut
 * into segments of at most seg_tokens.  This is the GPU client's job; the CPU
 * backend, the tests and kvbench use this one implementation.
 */
#ifndef KVD_PREP_H
#define KVD_PREP_H

#include <stdint.h>

#include "attn.h"

struct kvd_pool;

struct kvd_prep {
	struct kvd_geom g;
	uint32_t lo, hi;
	float *mean;                    /* [kv_heads][d] */
	uint32_t nseg;
	struct kvd_seg **seg;
	double hash_ms, build_ms;       /* time spent hashing keys / in kvd_seg_build */
	double tables_ms;               /* of build_ms: building the tables from codes */
};

/* k, v: [kv_heads][n][d] float32.  0, -KVD_EGEOM, -ENOMEM. */
int kvd_prep_layer(struct kvd_prep *p, const struct kvd_geom *g, const float *W,
		   const float *k, const float *v, uint32_t n, uint32_t lo, uint32_t hi,
		   uint32_t seg_tokens, struct kvd_pool *pool);
void kvd_prep_free(struct kvd_prep *p);

/* Codes of q[q_heads][d] into qc[q_heads][L] (queries are not centered). */
void kvd_prep_query_codes(const struct kvd_geom *g, const float *W, const float *q,
			  uint16_t *qc);

/* The two steps, for callers that stream rows (the client library): the
 * centering mean of rows [lo, hi) of k ([H][n][d]) in double, into
 * mean[H][d] (zeros when lo == hi); and rows [t0, t0+cnt) centered, rounded
 * to bf16 (kb, vb: [H][cnt][d]) and hashed (codes: [H][L][cnt]).  x is
 * scratch of cnt*d floats.  kvd_prep_layer() is built from these, so rows
 * prepared either way are bit-identical. */
void kvd_prep_mean(const float *k, uint32_t H, uint32_t d, uint32_t n, uint32_t lo,
		   uint32_t hi, float *mean);
void kvd_prep_rows(const struct kvd_geom *g, const float *W, const float *mean,
		   const float *k, const float *v, uint32_t n, uint32_t t0, uint32_t cnt,
		   uint16_t *kb, uint16_t *vb, uint16_t *codes, float *x);

/* The view kvd_attn_layer() takes, over all of p's segments and no tail. */
struct kvd_layer_view kvd_prep_view(const struct kvd_prep *p);

#endif
