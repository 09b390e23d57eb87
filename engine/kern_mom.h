/* kern_mom.h: the two kernels of hybrid_lcv's moments (kern.h: mom, mv),
 * in GCC vector extensions, so that each kernel file compiles them with its
 * own ISA flags: 8 floats a vector with AVX (kern_avx2.c, kern_avx512.c), 4
 * without (kern_scalar.c).  Each file includes it once. */
#ifndef KVD_KERN_MOM_H
#define KVD_KERN_MOM_H

#include <stddef.h>
#include <string.h>

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

/* y[g*d + e] = sum_f x[g*d + f] * kv[f*d + e] for g < G, f ascending
 * whatever G (a head's result does not depend on its group).  kv is read
 * once, row after row, as a stream (a block of columns at a time walked it
 * at a stride, and the walk waited on memory: ~70 % of its time); the sums
 * stay in y, in L1. */
static void mv_kern(const float *kv, int d, const float *x, int G, float *y)
{
	memset(y, 0, (size_t)G * d * sizeof *y);
	for (int f = 0; f < d; f++) {
		const float *row = kv + (size_t)f * d;

		for (int e = 0; e < d; e += 16)
			__builtin_prefetch(row + 4 * d + e);
		for (int g = 0; g < G; g++) {
			float xf = x[(size_t)g * d + f], *yg = y + (size_t)g * d;

			for (int e = 0; e < d; e += MOM_LN)
				mom_st(yg + e, mom_ld(yg + e) + xf * mom_ld(row + e));
		}
	}
}

#endif
