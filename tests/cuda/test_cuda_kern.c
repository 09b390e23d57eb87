/* The CUDA kernels of libkvclient against the CPU (needs a CUDA device;
 * without one it says "no CUDA device: skipped" and exits 77):
 *  - centered bf16 rows and SimHash codes equal kvd_prep_rows' bit for bit,
 *    and query codes equal kvd_prep_query_codes', on inputs with every
 *    projection 1e-3 or more from 0;
 *  - the centering mean equals kvd_prep_mean's to within one float ulp;
 *  - window attention (ring layout, every head_dim/group shape the backend
 *    takes, split or not) and the LSE merge against double-precision
 *    references, ||delta|| / ||ref|| below bf16's 2^-8 with fresh random
 *    inputs and outputs poisoned (NaN) before every run;
 *  - append and eviction gather move exactly the right rows.
 * Run it under compute-sanitizer too (docs/GPU.md). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "engine/attn.h"
#include "engine/bf16.h"
#include "proto/kvd_ring.h"
#include "gpu-client/kvg_kern.h"
#include "gpu-client/kvg_plan.h"
#include "engine/lsh.h"
#include "engine/prep.h"
#include "engine/ref.h"
#include "gpuutil.h"
#include "testutil.h"

#define TOL_BF16 (1.0 / 256)            /* 2^-8: bf16's relative precision */

/* Under the host emulation (make check-emu, -DKVG_EMU) the largest cases
 * shrink; every path (GEMM pieces, splits, > 48 KiB smem, batches past one
 * launch) is still taken. */
#ifdef KVG_EMU
#define EMU_OR(full, emu) (emu)
#else
#define EMU_OR(full, emu) (full)
#endif

#define CU(x)                                                                        \
	do {                                                                         \
		cudaError_t e_ = (x);                                                \
		if (e_ != cudaSuccess)                                               \
			fail_msg("%s: %s", #x, cudaGetErrorString(e_));              \
	} while (0)

static cudaStream_t st;
static cublasHandle_t blas;

static void *dup_dev(const void *h, size_t bytes)
{
	void *d;

	CU(cudaMalloc(&d, bytes ? bytes : 1));
	if (bytes)
		CU(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
	return d;
}

static void *poisoned(size_t bytes)
{
	void *d;

	CU(cudaMalloc(&d, bytes ? bytes : 1));
	/* NaN as float, 0xffff as code.  On st, where the kernels that write it
	 * run: cudaMemset would go on the legacy stream, which a non-blocking
	 * stream does not wait for (the emulation flags that race). */
	CU(cudaMemsetAsync(d, 0xff, bytes ? bytes : 1, st));
	return d;
}

static void back(void *h, const void *d, size_t bytes)
{
	CU(cudaStreamSynchronize(st));
	CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

/* ---- prefill rows and codes --------------------------------------------------------- */

static void rows_and_codes(uint32_t H, uint32_t d, uint32_t K, uint32_t L, uint32_t n,
			   uint32_t t0, uint32_t cnt, int dtype, uint64_t seed)
{
	const struct kvd_geom g = { H, H, d, K, L, 1, KVD_KV_BF16, 0 };
	const uint32_t KL = K * L;
	float *W = xmalloc((size_t)d * KL * 4), *mean = xmalloc((size_t)H * d * 4);
	float *k = xmalloc((size_t)H * n * d * 4), *v = xmalloc((size_t)H * n * d * 4);
	float *x = xmalloc((size_t)cnt * d * 4), xr[256];
	double *scr = xmalloc(KL * sizeof *scr);
	uint16_t *kb = xmalloc((size_t)H * cnt * d * 2), *vb = xmalloc((size_t)H * cnt * d * 2);
	uint16_t *codes = xmalloc((size_t)H * L * cnt * 2), *got = xmalloc((size_t)H * L * cnt * 2);
	uint16_t *kb16 = xmalloc((size_t)H * n * d * 2), *vb16 = xmalloc((size_t)H * n * d * 2);
	struct kvd_rng r = kvd_rng_make(seed);
	struct kvg_code_layout lay = { cnt, L * cnt, cnt, 1 };
	char err[128];

	kvd_lsh_make_w(seed + 1, (int)d, (int)K, (int)L, W);
	fill_normal(mean, (size_t)H * d, &r, 0.3, 0.5);
	fill_normal(v, (size_t)H * n * d, &r, 0.0, 1.0);
	for (uint32_t h = 0; h < H; h++)
		for (uint32_t i = 0; i < n; i++) {
			float *kr = k + ((size_t)h * n + i) * d;

			clean_key(kr, mean + (size_t)h * d, W, d, KL, &r, 0.3, 1.0, 1e-3, xr, scr);
			if (dtype == KVG_BF16) {
				/* the GPU reads bf16: give the CPU the same values, and
				 * make sure the margin still holds for them */
				for (uint32_t e = 0; e < d; e++)
					kr[e] = kvd_bf16_to_f32(kvd_f32_to_bf16(kr[e]));
				for (uint32_t e = 0; e < d; e++)
					xr[e] = kvd_bf16_to_f32(kvd_f32_to_bf16(kr[e] - mean[h * d + e]));
				if (proj_margin(W, d, KL, xr, scr) < 1e-3) {
					i--;
					continue;
				}
			}
		}
	for (size_t i = 0; i < (size_t)H * n * d; i++) {
		if (dtype == KVG_BF16)
			v[i] = kvd_bf16_to_f32(kvd_f32_to_bf16(v[i]));
		kb16[i] = kvd_f32_to_bf16(k[i]);
		vb16[i] = kvd_f32_to_bf16(v[i]);
	}
	kvd_prep_rows(&g, W, mean, k, v, n, t0, cnt, kb, vb, codes, x);

	const void *dk = dtype == KVG_BF16 ? dup_dev(kb16, (size_t)H * n * d * 2) :
					     dup_dev(k, (size_t)H * n * d * 4);
	const void *dv = dtype == KVG_BF16 ? dup_dev(vb16, (size_t)H * n * d * 2) :
					     dup_dev(v, (size_t)H * n * d * 4);
	float *dW = dup_dev(W, (size_t)d * KL * 4), *dmean = dup_dev(mean, (size_t)H * d * 4);
	uint16_t *dkb = poisoned((size_t)H * cnt * d * 2), *dvb = poisoned((size_t)H * cnt * d * 2);
	uint16_t *dc = poisoned((size_t)H * L * cnt * 2);
	float *dx = poisoned((size_t)H * cnt * d * 4);
	uint32_t rows_max = 300;        /* several GEMM pieces */
	float *dy = poisoned((size_t)rows_max * KL * 4);

	CU(kvg_rows(dk, dv, dtype, H, n, d, t0, cnt, dmean, dkb, dvb, cnt, 0, dx, st));
	assert_int_equal(kvg_hash_rows(blas, dW, d, K, L, dx, H * cnt, dy, rows_max, &lay, dc, st,
				       err, sizeof err), 0);
	uint16_t *gkb = xmalloc((size_t)H * cnt * d * 2);

	back(gkb, dkb, (size_t)H * cnt * d * 2);
	assert_memory_equal(gkb, kb, (size_t)H * cnt * d * 2);
	back(gkb, dvb, (size_t)H * cnt * d * 2);
	assert_memory_equal(gkb, vb, (size_t)H * cnt * d * 2);
	back(got, dc, (size_t)H * L * cnt * 2);
	assert_memory_equal(got, codes, (size_t)H * L * cnt * 2);

	cudaFree((void *)dk); cudaFree((void *)dv); cudaFree(dW); cudaFree(dmean); cudaFree(dkb);
	cudaFree(dvb); cudaFree(dc); cudaFree(dx); cudaFree(dy);
	free(W); free(mean); free(k); free(v); free(x); free(scr); free(kb); free(vb); free(codes);
	free(got); free(kb16); free(vb16); free(gkb);
}

static void test_codes_equal_cpu(void **state)
{
	/* Llama-3.1-8B profile */
	rows_and_codes(8, 128, 10, 150, EMU_OR(700, 100), 4, EMU_OR(632, 90), KVG_F32, 11);
	rows_and_codes(8, 128, 10, 150, EMU_OR(300, 60), 0, EMU_OR(300, 60), KVG_BF16, 12);
	rows_and_codes(2, 64, 16, 6, 129, 1, 128, KVG_F32, 13);
	rows_and_codes(1, 256, 1, 32, 50, 10, 33, KVG_F32, 14);
}

static void test_query_codes_equal_cpu(void **state)
{
	const struct kvd_geom g = { 32, 8, 128, 10, 150, 2, KVD_KV_BF16, 0 };
	const uint32_t nseq = 5, Hq = g.q_heads, d = g.d, KL = g.K * g.L;
	float *W = xmalloc((size_t)d * KL * 4), *q = xmalloc((size_t)nseq * Hq * d * 4);
	double *scr = xmalloc(KL * sizeof *scr);
	uint16_t *want = xmalloc((size_t)nseq * Hq * g.L * 2), *got = xmalloc((size_t)nseq * Hq * g.L * 2);
	struct kvd_rng r = kvd_rng_make(21);
	struct kvg_code_layout lay = { 1, g.L, 1, 0 };
	char err[128];

	kvd_lsh_make_w(22, (int)d, (int)g.K, (int)g.L, W);
	for (uint32_t i = 0; i < nseq * Hq; i++)
		clean_query(q + (size_t)i * d, W, d, KL, &r, 1e-3, scr);
	for (uint32_t s = 0; s < nseq; s++)
		kvd_prep_query_codes(&g, W, q + (size_t)s * Hq * d, want + (size_t)s * Hq * g.L);

	float *dq = dup_dev(q, (size_t)nseq * Hq * d * 4), *dW = dup_dev(W, (size_t)d * KL * 4);
	float *dy = poisoned((size_t)nseq * Hq * KL * 4);
	uint16_t *dc = poisoned((size_t)nseq * Hq * g.L * 2);

	assert_int_equal(kvg_hash_rows(blas, dW, d, g.K, g.L, dq, nseq * Hq, dy, nseq * Hq, &lay, dc,
				       st, err, sizeof err), 0);
	back(got, dc, (size_t)nseq * Hq * g.L * 2);
	assert_memory_equal(got, want, (size_t)nseq * Hq * g.L * 2);
	cudaFree(dq); cudaFree(dW); cudaFree(dy); cudaFree(dc);
	free(W); free(q); free(scr); free(want); free(got);
}

/* ---- mean -------------------------------------------------------------------------------- */

static uint32_t ulps(float a, float b)
{
	int32_t ia, ib;

	memcpy(&ia, &a, 4);
	memcpy(&ib, &b, 4);
	if ((ia < 0) != (ib < 0))
		return a == b ? 0 : UINT32_MAX;
	return (uint32_t)(ia > ib ? ia - ib : ib - ia);
}

static void mean_case(uint32_t H, uint32_t d, uint32_t n, uint32_t lo, uint32_t hi, int dtype,
		      uint64_t seed)
{
	float *k = xmalloc((size_t)H * n * d * 4), *want = xmalloc((size_t)H * d * 4);
	float *got = xmalloc((size_t)H * d * 4);
	uint16_t *kb = xmalloc((size_t)H * n * d * 2);
	struct kvd_rng r = kvd_rng_make(seed);
	uint32_t exact = 0;

	fill_normal(k, (size_t)H * n * d, &r, 2.0, 30.0);       /* |k| ~ 30, as kvd_prep_mean says */
	for (size_t i = 0; i < (size_t)H * n * d; i++) {
		kb[i] = kvd_f32_to_bf16(k[i]);
		if (dtype == KVG_BF16)
			k[i] = kvd_bf16_to_f32(kb[i]);
	}
	kvd_prep_mean(k, H, d, n, lo, hi, want);

	void *dk = dtype == KVG_BF16 ? dup_dev(kb, (size_t)H * n * d * 2) :
				       dup_dev(k, (size_t)H * n * d * 4);
	float *dm = poisoned((size_t)H * d * 4);
	double *scr;

	CU(cudaMalloc((void **)&scr, kvg_mean_scratch(H, d)));
	CU(kvg_mean(dk, dtype, H, n, d, lo, hi, dm, scr, st));
	back(got, dm, (size_t)H * d * 4);
	for (uint32_t i = 0; i < H * d; i++) {
		assert_true(ulps(got[i], want[i]) <= 1);
		exact += got[i] == want[i];
	}
	print_message("mean: %u of %u equal to kvd_prep_mean's bits (n %u), the rest 1 ulp off\n",
		      exact, H * d, hi - lo);
	cudaFree(dk); cudaFree(dm); cudaFree(scr);
	free(k); free(want); free(got); free(kb);
}

static void test_mean(void **state)
{
	mean_case(8, 128, 20000, 4, 19936, KVG_F32, 31);
	mean_case(2, 64, 100, 50, 50, KVG_F32, 32);             /* empty range: zeros */
	mean_case(3, 80, 777, 0, 777, KVG_BF16, 33);
}

/* ---- attention ----------------------------------------------------------------------------- */

struct attn_case {
	uint32_t H, G, d;
	uint32_t nseq;
	uint32_t cap, nsink;            /* ring geometry; nsink 0 and head 0: dense */
	uint32_t count_max;
	uint32_t target_blocks;
};

static void attn_case(const struct attn_case *ac, uint64_t seed)
{
	const uint32_t H = ac->H, G = ac->G, Hq = H * G, d = ac->d, nseq = ac->nseq;
	struct kvd_rng r = kvd_rng_make(seed);
	struct kvg_rows *rows = xmalloc(nseq * sizeof *rows), *drows = xmalloc(nseq * sizeof *drows);
	uint16_t **hk = xmalloc(nseq * sizeof *hk), **hv = xmalloc(nseq * sizeof *hv);
	float *q = xmalloc((size_t)nseq * Hq * d * 4), *o = xmalloc((size_t)nseq * Hq * d * 4);
	float *lse = xmalloc((size_t)nseq * Hq * 4);
	double *ro = xmalloc((size_t)G * d * 8), rl[16];
	uint32_t max_rows = 0;
	struct kvg_attn_plan plan;
	size_t rowsz = (size_t)H * ac->cap * d;

	fill_normal(q, (size_t)nseq * Hq * d, &r, 0.0, 1.0);
	for (uint32_t j = 0; j < nseq; j++) {
		uint32_t R = ac->cap - ac->nsink;
		/* the edges first (empty, one row, the longest), then random lengths */
		uint32_t count = j == 0 ? 0 : j == 1 ? 1 : j == 2 ? ac->count_max
					: kvd_rng_below(&r, ac->count_max + 1);

		if (count > R)
			count = R;
		hk[j] = xmalloc(rowsz * 2);
		hv[j] = xmalloc(rowsz * 2);
		/* keys with a spread of scales, so the softmax is not flat */
		fill_bf16(hk[j], rowsz, &r, 0.0, 1.5);
		fill_bf16(hv[j], rowsz, &r, 0.0, 1.0);
		rows[j] = (struct kvg_rows){ hk[j], hv[j], ac->cap, ac->nsink,
					     ac->nsink ? kvd_rng_below(&r, R) : 0, count };
		drows[j] = rows[j];
		drows[j].k = dup_dev(hk[j], rowsz * 2);
		drows[j].v = dup_dev(hv[j], rowsz * 2);
		max_rows = kvg_rows_n(&rows[j]) > max_rows ? kvg_rows_n(&rows[j]) : max_rows;
	}
	kvg_attn_plan(max_rows, nseq, H, Hq, d, ac->target_blocks, &plan);

	float *dq = dup_dev(q, (size_t)nseq * Hq * d * 4);
	float *dout = poisoned((size_t)nseq * Hq * d * 4), *dl = poisoned((size_t)nseq * Hq * 4);
	float *part = plan.part_floats ? poisoned(plan.part_floats * 4) : NULL;
	double num = 0, den = 0, lerr = 0;

	CU(kvg_attn(dq, drows, nseq, Hq, H, d, &plan, dout, dl, part, st));
	back(o, dout, (size_t)nseq * Hq * d * 4);
	back(lse, dl, (size_t)nseq * Hq * 4);
	for (uint32_t j = 0; j < nseq; j++)
		for (uint32_t h = 0; h < H; h++) {
			size_t qo = ((size_t)j * Hq + (size_t)h * G) * d;

			kvg_attn_ref(q + qo, G, d, &rows[j], h, ro, rl);
			for (uint32_t g = 0; g < G; g++) {
				float l = lse[(size_t)j * Hq + h * G + g];

				if (kvg_rows_n(&rows[j]) == 0) {
					assert_true(isinf(l) && l < 0);
					for (uint32_t e = 0; e < d; e++)
						assert_true(o[qo + g * d + e] == 0.0f);
					continue;
				}
				assert_true(isfinite(l));
				lerr = fmax(lerr, fabs(l - rl[g]));
				for (uint32_t e = 0; e < d; e++) {
					double dd = o[qo + g * d + e] - ro[g * d + e];

					assert_false(isnan(o[qo + g * d + e]));
					num += dd * dd;
					den += ro[g * d + e] * ro[g * d + e];
				}
			}
		}
	print_message("attn H %u G %u d %u nseq %u rows<=%u nsplit %u: rel %.3g, lse %.3g\n", H, G, d,
		      nseq, max_rows, plan.nsplit, sqrt(num / den), lerr);
	assert_true(sqrt(num / den) < TOL_BF16);
	assert_true(lerr < 1e-3);
	for (uint32_t j = 0; j < nseq; j++) {
		cudaFree((void *)drows[j].k);
		cudaFree((void *)drows[j].v);
		free(hk[j]);
		free(hv[j]);
	}
	cudaFree(dq); cudaFree(dout); cudaFree(dl); cudaFree(part);
	free(rows); free(drows); free(hk); free(hv); free(q); free(o); free(lse); free(ro);
}

static void test_window_attention(void **state)
{
	static const struct attn_case cases[] = {
		/* Llama-3.1-8B, sink 4 + window 64 + 32, a batch past one launch */
		{ 8, 4, 128, 70, 100, 4, 96, 528 },
		{ 1, 1, 64, 3, 40, 0, 40, 1 },
		{ 2, 8, 80, 4, 300, 16, 284, 64 },
		{ 1, 16, 256, 2, 200, 4, 196, 8 },      /* > 48 KiB shared memory */
		{ 4, 2, 192, 5, 120, 8, 112, 16 },
		{ 8, 4, 112, 3, 77, 0, 77, 1 },
	};

	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		attn_case(&cases[i], 100 + i);
}

static void test_dense_split_attention(void **state)
{
	/* long dense caches: split over many blocks, then combined */
	static const struct attn_case cases[] = {
		{ 8, 4, 128, 3, EMU_OR(20000, 4000), 0, EMU_OR(20000, 4000), 528 },
		{ 2, 2, 64, 5, 5000, 0, 5000, 4096 },
		/* G 8: a split of 132 blocks */
		{ 4, 8, 128, 4, EMU_OR(9000, 3000), 0, EMU_OR(9000, 3000), 132 },
	};

	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		attn_case(&cases[i], 200 + i);
}

/* ---- merge --------------------------------------------------------------------------------- */

static void test_merge(void **state)
{
	const uint32_t nseq = 7, Hq = 32, d = 128;
	const struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, 150);
	struct kvd_rng r = kvd_rng_make(41);

	for (int kvd_only = 0; kvd_only < 2; kvd_only++) {
		size_t rf = lay.out / 4, lf = lay.lse_off / 4;
		float *o = xmalloc((size_t)nseq * Hq * d * 4), *lse = xmalloc((size_t)nseq * Hq * 4);
		float *rec = xmalloc((size_t)nseq * lay.out), *got = xmalloc((size_t)nseq * Hq * d * 4);
		float *gl = xmalloc((size_t)nseq * Hq * 4);
		double *ro = xmalloc((size_t)Hq * d * 8), rl[32];
		double num = 0, den = 0;

		fill_normal(o, (size_t)nseq * Hq * d, &r, 0, 1);
		fill_normal(rec, (size_t)nseq * lay.out / 4, &r, 0, 1);
		for (uint32_t i = 0; i < nseq * Hq; i++) {
			uint32_t s = i / Hq, h = i % Hq;

			lse[i] = (float)(5 * kvd_rng_normal(&r));
			rec[s * rf + lf + h] = (float)(5 * kvd_rng_normal(&r));
			/* empty parts on either side */
			if (i % 11 == 3)
				lse[i] = -INFINITY;
			/* kvd answers an empty sample as (0, -inf): its o is zeros */
			if (i % 13 == 5) {
				rec[s * rf + lf + h] = -INFINITY;
				memset(rec + s * rf + (size_t)h * d, 0, (size_t)d * 4);
			}
		}
		float *d_o = dup_dev(o, (size_t)nseq * Hq * d * 4), *d_l = dup_dev(lse, (size_t)nseq * Hq * 4);
		float *d_r = dup_dev(rec, (size_t)nseq * lay.out);

		CU(kvg_merge(d_o, d_l, d_r, rf, lf, nseq, Hq, d, kvd_only, st));
		back(got, d_o, (size_t)nseq * Hq * d * 4);
		back(gl, d_l, (size_t)nseq * Hq * 4);
		for (uint32_t s = 0; s < nseq; s++) {
			for (uint32_t i = 0; i < Hq * d; i++)
				ro[i] = kvd_only ? 0.0 : o[(size_t)s * Hq * d + i];
			for (uint32_t h = 0; h < Hq; h++)
				rl[h] = kvd_only ? -INFINITY : lse[s * Hq + h];
			kvg_merge_ref(ro, rl, rec + s * rf, rec + s * rf + lf, Hq, d);
			for (uint32_t h = 0; h < Hq; h++) {
				float l = gl[s * Hq + h];

				if (isinf(rl[h]))
					assert_true(isinf(l) && l < 0);
				else
					assert_true(fabs(l - rl[h]) < 1e-4 * fmax(1.0, fabs(rl[h])));
			}
			for (uint32_t i = 0; i < Hq * d; i++) {
				double dd = got[(size_t)s * Hq * d + i] - ro[i];

				assert_false(isnan(got[(size_t)s * Hq * d + i]));
				num += dd * dd;
				den += ro[i] * ro[i];
			}
		}
		print_message("merge (kvd_only %d): rel %.3g\n", kvd_only, sqrt(num / den));
		assert_true(sqrt(num / den) < 1e-5);
		cudaFree(d_o); cudaFree(d_l); cudaFree(d_r);
		free(o); free(lse); free(rec); free(got); free(gl); free(ro);
	}
}

/* ---- append and eviction --------------------------------------------------------------------- */

static void test_append_and_gather(void **state)
{
	const uint32_t H = 8, d = 128, cap = 100, nsink = 4, nseq = 70, B = KVG_APPEND_BATCH;
	struct kvd_rng r = kvd_rng_make(51);
	float *k = xmalloc((size_t)nseq * H * d * 4), *v = xmalloc((size_t)nseq * H * d * 4);
	float *mean = xmalloc((size_t)H * d * 4);
	uint16_t *store = xmalloc((size_t)H * cap * d * 2);
	struct kvg_put *put = xmalloc(nseq * sizeof *put);
	uint16_t **dk = xmalloc(nseq * sizeof *dk), **dv = xmalloc(nseq * sizeof *dv);
	float *dmean;

	fill_normal(k, (size_t)nseq * H * d, &r, 0, 1);
	fill_normal(v, (size_t)nseq * H * d, &r, 0, 1);
	fill_normal(mean, (size_t)H * d, &r, 0, 1);
	dmean = dup_dev(mean, (size_t)H * d * 4);
	for (uint32_t j = 0; j < nseq; j++) {
		dk[j] = poisoned((size_t)H * cap * d * 2);
		dv[j] = poisoned((size_t)H * cap * d * 2);
		put[j] = (struct kvg_put){ dk[j], dv[j], j % 2 ? dmean : NULL, cap, (j * 7) % cap };
	}
	float *dkin = dup_dev(k, (size_t)nseq * H * d * 4), *dvin = dup_dev(v, (size_t)nseq * H * d * 4);

	CU(kvg_append(dkin, dvin, KVG_F32, put, nseq, H, d, st));
	for (uint32_t j = 0; j < nseq; j++) {
		back(store, dk[j], (size_t)H * cap * d * 2);
		for (uint32_t h = 0; h < H; h++)
			for (uint32_t e = 0; e < d; e++) {
				float kf = k[((size_t)j * H + h) * d + e];

				assert_int_equal(store[((size_t)h * cap + put[j].row) * d + e],
						 kvd_f32_to_bf16(j % 2 ? kf - mean[h * d + e] : kf));
			}
		back(store, dv[j], (size_t)H * cap * d * 2);
		for (uint32_t h = 0; h < H; h++)
			assert_int_equal(store[((size_t)h * cap + put[j].row) * d + 3],
					 kvd_f32_to_bf16(v[((size_t)j * H + h) * d + 3]));
	}

	/* gather the 32 oldest ring rows of 3 sequences whose rings wrap */
	const uint32_t nev = 3;
	struct kvg_evict ev[3];
	uint16_t *src = xmalloc((size_t)H * cap * d * 2), *got = xmalloc((size_t)H * B * d * 2);
	uint16_t *dkb = poisoned((size_t)nev * H * B * d * 2), *dvb = poisoned((size_t)nev * H * B * d * 2);
	float *dx = poisoned((size_t)nev * H * B * d * 4), *x = xmalloc((size_t)nev * H * B * d * 4);
	uint16_t *dsrc[3];

	for (uint32_t j = 0; j < nev; j++) {
		uint32_t head = (uint32_t[]){ 0, 80, 95 }[j];

		fill_bf16(src, (size_t)H * cap * d, &r, 0, 1);
		dsrc[j] = dup_dev(src, (size_t)H * cap * d * 2);
		ev[j] = (struct kvg_evict){ dsrc[j], dsrc[j], dkb + (size_t)j * H * B * d,
					    dvb + (size_t)j * H * B * d, cap, nsink, head, 0 };
	}
	CU(kvg_gather(ev, nev, H, d, B, dx, st));
	back(x, dx, (size_t)nev * H * B * d * 4);
	for (uint32_t j = 0; j < nev; j++) {
		struct kvg_rows rw = { NULL, NULL, cap, nsink, ev[j].head, B };

		CU(cudaMemcpy(src, dsrc[j], (size_t)H * cap * d * 2, cudaMemcpyDeviceToHost));
		back(got, dkb + (size_t)j * H * B * d, (size_t)H * B * d * 2);
		for (uint32_t h = 0; h < H; h++)
			for (uint32_t i = 0; i < B; i++) {
				const uint16_t *want = src + ((size_t)h * cap + kvg_rows_at(&rw, nsink + i)) * d;

				assert_memory_equal(got + ((size_t)h * B + i) * d, want, d * 2);
				for (uint32_t e = 0; e < d; e++)
					assert_true(x[(((size_t)j * H + h) * B + i) * d + e] ==
						    kvd_bf16_to_f32(want[e]));
			}
		cudaFree(dsrc[j]);
	}
	for (uint32_t j = 0; j < nseq; j++) {
		cudaFree(dk[j]);
		cudaFree(dv[j]);
	}
	cudaFree(dmean); cudaFree(dkin); cudaFree(dvin); cudaFree(dkb); cudaFree(dvb); cudaFree(dx);
	free(k); free(v); free(mean); free(store); free(put); free(dk); free(dv); free(src); free(got);
	free(x);
}

/* ---- bad arguments ------------------------------------------------------------------------------ */

static void test_bad_arguments(void **state)
{
	struct kvg_attn_plan p = { 1, 32, 0 };
	struct kvg_rows rw = { 0 };

	/* d not a multiple of 16, group above 16, a split plan with no scratch */
	assert_int_equal(kvg_attn(NULL, &rw, 1, 4, 1, 72, &p, NULL, NULL, NULL, st),
			 cudaErrorInvalidValue);
	assert_int_equal(kvg_attn(NULL, &rw, 1, 17, 1, 64, &p, NULL, NULL, NULL, st),
			 cudaErrorInvalidValue);
	p.nsplit = 2;
	assert_int_equal(kvg_attn(NULL, &rw, 1, 4, 1, 64, &p, NULL, NULL, NULL, st),
			 cudaErrorInvalidValue);
	/* nothing to do is not an error */
	assert_int_equal(kvg_attn(NULL, &rw, 0, 4, 1, 64, &p, NULL, NULL, NULL, st), cudaSuccess);
	assert_int_equal(kvg_merge(NULL, NULL, NULL, 0, 0, 0, 4, 64, 0, st), cudaSuccess);
}

static int setup(void **state)
{
	if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess ||
	    cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS)
		return -1;
	return 0;
}

static int teardown(void **state)
{
	cublasDestroy(blas);
	cudaStreamDestroy(st);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_codes_equal_cpu),
		cmocka_unit_test(test_query_codes_equal_cpu),
		cmocka_unit_test(test_mean),
		cmocka_unit_test(test_window_attention),
		cmocka_unit_test(test_dense_split_attention),
		cmocka_unit_test(test_merge),
		cmocka_unit_test(test_append_and_gather),
		cmocka_unit_test(test_bad_arguments),
	};
	int n = 0;
	cudaError_t e = cudaGetDeviceCount(&n);

	if (e != cudaSuccess || n == 0) {
		printf("test_cuda_kern: no CUDA device: skipped (%s)\n",
		       e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
		return 77;
	}
	return cmocka_run_group_tests(tests, setup, teardown);
}
