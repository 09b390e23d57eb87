/* kern_mom.h: the two kernels of hybrid_lcv's moments (kern.h: mom, mv),
 * in GCC vector extensions, so that each kernel file compiles them with its
 * own ISA flags: 8 floats a vector with AVX (kern_avx2.c, kern_avx512.c), 4
 * without (kern_scalar.c).  Each file includes it once. */
#ifndef KVD_KERN_MOM_H
#define KVD_KERN_MOM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kern.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef __AVX__
typedef float mom_v __attribute__((vector_size(32)));
#else
typedef float mom_v __attribute__((vector_size(16)));
#endif
#define MOM_LN ((int)(sizeof(mom_v) / sizeof(float)))
#define MOM_COLS 16                     /* columns of kv a block holds */
#define MOM_NV (MOM_COLS / MOM_LN)

static inline mom_v mom_ld(const float *p)
{
	mom_v x;

	memcpy(&x, p, sizeof x);
	return x;
}

static inline void mom_st(float *p, mom_v x)
{
	memcpy(p, &x, sizeof x);
}

/* Contracted to FMAs where the ISA has them (GCC keeps a*b+c apart in ISO
 * C mode): the same bits for build and restore, which use one kernel
 * table.  clang's fuzz build does not time it. */
#if defined(__clang__)
#define MOM_CONTRACT
#else
#define MOM_CONTRACT __attribute__((optimize("fp-contract=fast")))
#endif

/* kv[f*d + e] += sum_i a[i*d + f] * b[i*d + e] over r rows: blocks of 4
 * rows of kv by 16 columns, their accumulators held across the rows. */
MOM_CONTRACT
static void mom_kern(const float *a, const float *b, size_t r, int d, float *kv)
{
	for (int f = 0; f < d; f += 4)
		for (int e = 0; e < d; e += MOM_COLS) {
			/* unrolled whole, so that the sums stay in registers
			 * (rolled, GCC kept them on the stack: a load and a
			 * store per multiply-add) */
			mom_v s[4][MOM_NV];

#pragma GCC unroll 16
			for (int x = 0; x < 4; x++)
#pragma GCC unroll 16
				for (int j = 0; j < MOM_NV; j++)
					s[x][j] = mom_ld(kv + (size_t)(f + x) * d + e + j * MOM_LN);
			for (size_t i = 0; i < r; i++) {
				mom_v bv[MOM_NV];

#pragma GCC unroll 16
				for (int j = 0; j < MOM_NV; j++)
					bv[j] = mom_ld(b + i * d + e + j * MOM_LN);
#pragma GCC unroll 16
				for (int x = 0; x < 4; x++) {
					float ax = a[i * d + f + x];

#pragma GCC unroll 16
					for (int j = 0; j < MOM_NV; j++)
						s[x][j] += ax * bv[j];
				}
			}
#pragma GCC unroll 16
			for (int x = 0; x < 4; x++)
#pragma GCC unroll 16
				for (int j = 0; j < MOM_NV; j++)
					mom_st(kv + (size_t)(f + x) * d + e + j * MOM_LN, s[x][j]);
		}
}

/* y[g*d + e] = col[e] * sum_f (x[g*d + f] * row[f]) * kv[f*d + e] for g <
 * G, f ascending whatever G (a head's result does not depend on its
 * group).  kv is read once, row after row, as a stream (a block of columns
 * at a time walked it at a stride, and the walk waited on memory: ~70 % of
 * its time); a row is widened to floats once for all G, and the sums stay
 * in y, in L1.  In vectors of 16 floats where the ISA has them: a row of
 * d = 128 is then 8 multiply-adds a head. */
#ifdef __AVX512F__
typedef float mv_v __attribute__((vector_size(64)));
#else
typedef mom_v mv_v;
#endif
#define MV_LN ((int)(sizeof(mv_v) / sizeof(float)))

/* wf[0..d) = kr[0..d) as floats.  By intrinsics: GCC 12 turns the vector
 * extensions' int8 -> float conversion into one scalar convert a lane. */
static inline void mv_widen(const int8_t *kr, int d, float *wf)
{
#if defined(__AVX512F__)
	for (int e = 0; e < d; e += 16)
		_mm512_storeu_ps(wf + e, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
						 _mm_loadu_si128((const __m128i *)(kr + e)))));
#elif defined(__AVX2__)
	for (int e = 0; e < d; e += 8)
		_mm256_storeu_ps(wf + e, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
						 _mm_loadl_epi64((const __m128i *)(kr + e)))));
#else
	for (int e = 0; e < d; e++)
		wf[e] = (float)kr[e];
#endif
}

static inline mv_v mv_ld(const float *p)
{
	mv_v x;

	memcpy(&x, p, sizeof x);
	return x;
}

static void mv_kern(const int8_t *kv, const float *row, const float *col, int d, const float *x,
		    int G, float *y)
{
	float wf[4][KVD_DMAX] __attribute__((aligned(64)));

	memset(y, 0, (size_t)G * d * sizeof *y);
	/* four rows at a time (d is a multiple of 16), each y vector loaded
	 * and stored once for them; the additions stay in row order */
	for (int f = 0; f < d; f += 4) {
		const int8_t *kr = kv + (size_t)f * d;

		for (int e = 0; e < 4 * d; e += 64)
			__builtin_prefetch(kr + 8 * d + e);
		for (int r = 0; r < 4; r++)
			mv_widen(kr + (size_t)r * d, d, wf[r]);
		for (int g = 0; g < G; g++) {
			const float *xg = x + (size_t)g * d + f;
			float x0 = xg[0] * row[f], x1 = xg[1] * row[f + 1];
			float x2 = xg[2] * row[f + 2], x3 = xg[3] * row[f + 3], *yg = y + (size_t)g * d;

			for (int e = 0; e < d; e += MV_LN) {
				mv_v t = mv_ld(yg + e);

				t = t + x0 * mv_ld(wf[0] + e);
				t = t + x1 * mv_ld(wf[1] + e);
				t = t + x2 * mv_ld(wf[2] + e);
				t = t + x3 * mv_ld(wf[3] + e);
				memcpy(yg + e, &t, sizeof t);
			}
		}
	}
	for (int g = 0; g < G; g++)
		for (int e = 0; e < d; e += MV_LN) {
			mv_v t = mv_ld(y + (size_t)g * d + e) * mv_ld(col + e);

			memcpy(y + (size_t)g * d + e, &t, sizeof t);
		}
}

#endif
