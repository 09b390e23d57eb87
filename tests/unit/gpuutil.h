/* Helpers shared by the GPU backend's tests: the CPU-side one
 * (tests/unit/test_gpu_plan.c) and the device ones (tests/cuda/).
 * Header-only. */
#ifndef KVD_GPUUTIL_H
#define KVD_GPUUTIL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "engine/bf16.h"
#include "engine/rng.h"

/* y[t] = x . W[:, t] in double, t < KL. */
static inline void proj_double(const float *W, uint32_t d, uint32_t KL, const float *x, double *y)
{
	for (uint32_t t = 0; t < KL; t++) {
		double acc = 0.0;

		for (uint32_t e = 0; e < d; e++)
			acc += (double)x[e] * W[(size_t)e * KL + t];
		y[t] = acc;
	}
}

/* Smallest |x . W[:, t]| over t < KL. */
static inline double proj_margin(const float *W, uint32_t d, uint32_t KL, const float *x,
				 double *scratch)
{
	double m = INFINITY;

	proj_double(W, d, KL, x, scratch);
	for (uint32_t t = 0; t < KL; t++)
		m = fabs(scratch[t]) < m ? fabs(scratch[t]) : m;
	return m;
}

/* Fills key row kr (d floats, N(mu, sd)) so that the vector the client
 * hashes, bf16(kr - mean) as float, has every projection at least `margin`
 * from 0: the sign boundary where float summation order decides.  Returns
 * the number of draws it took. */
static inline int clean_key(float *kr, const float *mean, const float *W, uint32_t d, uint32_t KL,
			    struct kvd_rng *r, double mu, double sd, double margin, float *x,
			    double *scratch)
{
	for (int tries = 1;; tries++) {
		for (uint32_t e = 0; e < d; e++) {
			kr[e] = (float)(mu + sd * kvd_rng_normal(r));
			x[e] = kvd_bf16_to_f32(kvd_f32_to_bf16(mean ? kr[e] - mean[e] : kr[e]));
		}
		if (proj_margin(W, d, KL, x, scratch) >= margin)
			return tries;
	}
}

/* A query (not centered, not rounded: hashed as it is) with the same margin. */
static inline int clean_query(float *q, const float *W, uint32_t d, uint32_t KL, struct kvd_rng *r,
			      double margin, double *scratch)
{
	for (int tries = 1;; tries++) {
		for (uint32_t e = 0; e < d; e++)
			q[e] = (float)kvd_rng_normal(r);
		if (proj_margin(W, d, KL, q, scratch) >= margin)
			return tries;
	}
}

#endif
