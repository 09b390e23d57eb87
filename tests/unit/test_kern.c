/* Every SIMD kernel variant this CPU supports against kvd_kern_scalar, on
 * random inputs.  Buffers are sized exactly (so ASan sees any overrun) and
 * padding between output rows is checked to be left alone.
 *
 * Tolerances: qk and pv errors are measured against the sum of |terms|, the
 * scale of float rounding in a dot product; the f32 variants differ from
 * scalar only in summation order and FMA, the bf16 one also in q's 16-bit
 * (hi + lo bf16) representation.  qk8 sums in integers and must equal
 * scalar bit for bit; pv8 adds exact integer partial sums in f32 and is held
 * to the f32 tolerance, on inputs shaped like attn.c's: weights spanning
 * e^-20 with zeros, rounded to 16 bits.
 */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/bf16.h"
#include "engine/kern.h"
#include "engine/lsh.h"
#include "engine/rng.h"

static const struct kvd_kern *const ref = &kvd_kern_scalar;

/* The variants under test: those of all[] this CPU runs (group setup). */
static const char *const all[] = { "avx2", "avx512", "avx512vnni", "avx512bf16", "avx512amx" };
#define NV (sizeof all / sizeof all[0])
static const struct kvd_kern *var[NV];
static size_t nvar;
static double worst[NV];        /* per variant, reset by each test */

static const uint64_t seeds[] = { 1, 0x5eed2024 };
#define NSEEDS (sizeof seeds / sizeof seeds[0])

static const size_t ms[] = { 0, 1, 15, 17, 100, 1000 };
static const int ds[] = { 16, 64, 128, 256 };
static const int gs[] = { 1, 4, 8, 16 };
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

static void start(void)
{
	if (nvar == 0)
		skip();
	memset(worst, 0, sizeof worst);
}

static void note(size_t v, double err)
{
	if (err > worst[v])
		worst[v] = err;
}

static void report(const char *what, const char *fmt)
{
	for (size_t v = 0; v < nvar; v++) {
		print_message("%-10s %-6s ", var[v]->name, what);
		print_message(fmt, worst[v]);
		print_message("\n");
	}
}

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);

	assert_non_null(p);
	return p;
}

/* N(0,1) draws are slow to make (Box-Muller in double); big inputs pick
 * them at random from a pool instead. */
#define POOL (1u << 16)
static float pool[POOL];

/* bf16 rows from N(0,1) times one random scale in [2^-6, 2^6].  64-byte
 * aligned (as kvd stores them) when the size allows it exactly, so that ASan
 * still sees an overrun by one element. */
static uint16_t *rand_rows(struct kvd_rng *r, size_t n, int d)
{
	size_t bytes = n * d * sizeof(uint16_t);
	uint16_t *rows = bytes && bytes % 64 == 0 ? aligned_alloc(64, bytes) : xmalloc(bytes);

	assert_non_null(rows);
	float sc = (float)exp2(12.0 * kvd_rng_uniform(r) - 6.0);
	uint64_t bits = 0;

	for (size_t i = 0; i < n * d; i++) {
		if (i % 4 == 0)
			bits = kvd_rng_bits(r);
		rows[i] = kvd_f32_to_bf16(sc * pool[bits & (POOL - 1)]);
		bits >>= 16;
	}
	return rows;
}

static float *rand_f32(struct kvd_rng *r, size_t n, double sc)
{
	float *x = xmalloc(n * sizeof *x);

	for (size_t i = 0; i < n; i++)
		x[i] = (float)(sc * kvd_rng_normal(r));
	return x;
}

static const uint16_t *rowp(const uint16_t *base, const uint32_t *idx, size_t i, int d)
{
	return base + (idx ? idx[i] : i) * (size_t)d;
}

/* ---- qk / pv ----------------------------------------------------------- */

static double dot_tol(const struct kvd_kern *k)
{
	return strcmp(k->name, "avx512bf16") == 0 ? 2e-5 : 2e-6;
}

static uint32_t *rand_idx(struct kvd_rng *r, size_t m, size_t nrows)
{
	uint32_t *idx = xmalloc(m * sizeof *idx);

	for (size_t i = 0; i < m; i++)
		idx[i] = kvd_rng_below(r, (uint32_t)nrows);
	return idx;
}

static void check_qk(struct kvd_rng *r, int d, int G, size_t m, int gather)
{
	size_t nrows = gather ? m + 7 : m;
	uint16_t *rows = rand_rows(r, nrows, d);
	uint32_t *idx = gather ? rand_idx(r, m, nrows) : NULL;
	float *q = rand_f32(r, (size_t)G * d, 1.0);
	size_t lds = m + 3, ns = (G - 1) * lds + m;
	float *s0 = xmalloc(ns * sizeof *s0), *s1 = xmalloc(ns * sizeof *s1);
	float *one = xmalloc((m ? m : 1) * sizeof *one);
	float *mag = xmalloc(ns * sizeof *mag);

	ref->qk(q, G, d, rows, idx, m, s0, lds);
	for (int g = 0; g < G; g++) {
		for (size_t i = 0; i < m; i++) {
			const uint16_t *p = rowp(rows, idx, i, d);
			float a = 0.0f;

			for (int j = 0; j < d; j++)
				a += fabsf(q[g * d + j] * kvd_bf16_to_f32(p[j]));
			mag[g * lds + i] = a;
		}
	}
	for (size_t v = 0; v < nvar; v++) {
		const struct kvd_kern *k = var[v];
		double tol = dot_tol(k);

		for (size_t i = 0; i < ns; i++)
			s1[i] = 12345.0f;
		k->qk(q, G, d, rows, idx, m, s1, lds);
		for (int g = 0; g < G; g++) {
			for (size_t i = 0; i < m; i++) {
				size_t e = g * lds + i;
				double dv = fabs((double)s1[e] - s0[e]), bound = tol * mag[e] + 1e-30;

				note(v, dv * tol / bound);
				if (!(dv <= bound))
					fail_msg("%s qk d=%d G=%d m=%zu idx=%d: s[%d][%zu] = %g, scalar %g",
						 k->name, d, G, m, gather, g, i, s1[e], s0[e]);
			}
			for (size_t i = m; g + 1 < G && i < lds; i++)
				assert_true(s1[g * lds + i] == 12345.0f);
		}
		/* A head's scores do not depend on the heads scored with it
		 * (attention's union and per-head paths must agree). */
		for (int g = 0; g < G && G > 1; g++) {
			k->qk(q + (size_t)g * d, 1, d, rows, idx, m, one, m);
			if (memcmp(one, s1 + g * lds, m * sizeof *one))
				fail_msg("%s qk d=%d G=%d m=%zu idx=%d: head %d alone differs",
					 k->name, d, G, m, gather, g);
		}
	}
	free(one);
	free(rows);
	free(idx);
	free(q);
	free(s0);
	free(s1);
	free(mag);
}

static void check_pv(struct kvd_rng *r, int d, int G, size_t m, int gather)
{
	size_t nrows = gather ? m + 7 : m, no = (size_t)G * d;
	uint16_t *rows = rand_rows(r, nrows, d);
	uint32_t *idx = gather ? rand_idx(r, m, nrows) : NULL;
	size_t ldw = m + 2, nw = (G - 1) * ldw + m;
	float *w = rand_f32(r, nw, 1.0);
	float *oi = rand_f32(r, no, 1.0);
	float *o0 = xmalloc(no * sizeof *o0), *o1 = xmalloc(no * sizeof *o1);
	float *mag = xmalloc(no * sizeof *mag);

	memcpy(o0, oi, no * sizeof *o0);
	ref->pv(w, ldw, G, d, rows, idx, m, o0);
	for (size_t i = 0; i < no; i++)
		mag[i] = fabsf(oi[i]);
	for (size_t i = 0; i < m; i++) {
		const uint16_t *p = rowp(rows, idx, i, d);

		for (int g = 0; g < G; g++)
			for (int j = 0; j < d; j++)
				mag[g * d + j] += fabsf(w[g * ldw + i] * kvd_bf16_to_f32(p[j]));
	}
	for (size_t v = 0; v < nvar; v++) {
		const struct kvd_kern *k = var[v];
		double tol = 2e-6;

		memcpy(o1, oi, no * sizeof *o1);
		k->pv(w, ldw, G, d, rows, idx, m, o1);
		for (size_t e = 0; e < no; e++) {
			double dv = fabs((double)o1[e] - o0[e]), bound = tol * mag[e] + 1e-30;

			note(v, dv * tol / bound);
			if (!(dv <= bound))
				fail_msg("%s pv d=%d G=%d m=%zu idx=%d: o[%zu][%zu] = %g, scalar %g",
					 k->name, d, G, m, gather, e / d, e % d, o1[e], o0[e]);
		}
	}
	free(rows);
	free(idx);
	free(w);
	free(oi);
	free(o0);
	free(o1);
	free(mag);
}

/* The full grid (without the largest m after the first seed, to stay quick
 * under TSan), then every head-group size the kernels specialise on, with d
 * an odd multiple of 16 (a half chunk for AVX-512). */
static void test_qk(void **state)
{
	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0x9c);

		for (size_t a = 0; a < N_OF(ds); a++)
			for (size_t b = 0; b < N_OF(gs); b++)
				for (size_t c = 0; c < N_OF(ms) - !!s; c++)
					for (int gather = 0; gather < 2; gather++)
						check_qk(&r, ds[a], gs[b], ms[c], gather);
		for (int G = 1; G <= KVD_GMAX; G++)
			check_qk(&r, G % 2 ? 48 : 80, G, 37, 1);
		/* Long contiguous calls are walked differently (kern_avx512.c). */
		for (size_t m = 255; m < 4200 && s == 0; m = m * 2 + 1)
			check_qk(&r, 128, 4, m, 0);
	}
	report("qk", "worst |err| / sum|q_e k_e| = %.2e");
}

static void test_pv(void **state)
{
	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0x9d);

		for (size_t a = 0; a < N_OF(ds); a++)
			for (size_t b = 0; b < N_OF(gs); b++)
				for (size_t c = 0; c < N_OF(ms) - !!s; c++)
					for (int gather = 0; gather < 2; gather++)
						check_pv(&r, ds[a], gs[b], ms[c], gather);
		for (int G = 1; G <= KVD_GMAX; G++)
			check_pv(&r, G % 2 ? 48 : 80, G, 37, 1);
		for (size_t m = 255; m < 4200 && s == 0; m = m * 2 + 1)
			check_pv(&r, 128, 4, m, 0);
	}
	report("pv", "worst |err| / (|o| + sum|w_i v_ij|) = %.2e");
}

/* ---- qk8 / pv8 --------------------------------------------------------- */

/* int8 rows, every value -128..127 equally likely, and now and then a row
 * of all -128 or all 127 (the largest sums). */
static int8_t *rand_rows8(struct kvd_rng *r, size_t n, int d)
{
	size_t bytes = n * d;
	int8_t *rows = bytes && bytes % 64 == 0 ? aligned_alloc(64, bytes) : xmalloc(bytes);
	uint64_t bits = 0;

	assert_non_null(rows);
	for (size_t i = 0; i < n * d; i++) {
		if (i % 8 == 0)
			bits = kvd_rng_bits(r);
		rows[i] = (int8_t)(bits & 0xff);
		bits >>= 8;
	}
	for (size_t i = 0; i < n; i++) {
		uint32_t u = kvd_rng_below(r, 8);

		if (u < 2)
			memset(rows + i * d, u ? 127 : -128, d);
	}
	return rows;
}

/* q as attn.c passes it: q times per-channel key scales, here spread over
 * 2^-4 .. 2^4 on some calls, so channels differ widely in magnitude. */
static float *rand_q8(struct kvd_rng *r, int G, int d)
{
	float *q = rand_f32(r, (size_t)G * d, 1.0);

	if (kvd_rng_below(r, 2)) {
		for (int e = 0; e < d; e++) {
			float sc = (float)exp2(8.0 * kvd_rng_uniform(r) - 4.0);

			for (int g = 0; g < G; g++)
				q[g * d + e] *= sc;
		}
	}
	return q;
}

static const int8_t *rowp8(const int8_t *base, const uint32_t *idx, size_t i, int d)
{
	return base + (idx ? idx[i] : i) * (size_t)d;
}

/* kvd_q16 on q: every element within half a step of q, the head's largest
 * at +-32767 (when finite and nonzero), and bit for bit what the plain C
 * version gives (kvd_q16 takes the AVX2 one where it can). */
static void check_q16(const float *q, int G, int d, const int16_t *q16, const float *qsc)
{
	int16_t *r16 = malloc((size_t)G * d * sizeof *r16 + 1);
	float rsc[KVD_GMAX];

	assert_non_null(r16);
	assert_true(G <= KVD_GMAX);
	kvd_q16_ref(q, G, d, r16, rsc);
	assert_memory_equal(r16, q16, (size_t)G * d * sizeof *r16);
	assert_memory_equal(rsc, qsc, (size_t)G * sizeof *rsc);
	free(r16);
	for (int g = 0; g < G; g++) {
		int top = 0;

		assert_true(qsc[g] >= 0.0f);
		for (int e = 0; e < d; e++) {
			double x = q[g * d + e], y = (double)q16[g * d + e] * qsc[g];

			assert_true(q16[g * d + e] >= -32767);
			/* half a step, and float rounding of q * (32767 / max) */
			if (!(fabs(x - y) <= 0.5 * qsc[g] + 4 * FLT_EPSILON * fabs(x)))
				fail_msg("q16 head %d [%d]: %g -> %d * %g", g, e, x, q16[g * d + e], qsc[g]);
			top |= q16[g * d + e] == 32767 || q16[g * d + e] == -32767;
		}
		assert_true(top || qsc[g] == 0.0f);
	}
}

/* qk8 sums in integers: every variant equals the scalar reference bit for
 * bit, and the reference equals the exact (64-bit) sum, converted and
 * scaled.  One head in four has every |q16| = 32767, which with the rows of
 * all -128 or 127 reaches the largest sums.  The variants get a side array
 * of 12-byte records when the rows are gathered, as the sampled path
 * passes its row constants: a hint that must not change a bit. */
static void check_qk8(struct kvd_rng *r, int d, int G, size_t m, int gather)
{
	size_t nrows = gather ? m + 7 : m;
	int8_t *rows = rand_rows8(r, nrows, d);
	uint32_t *idx = gather ? rand_idx(r, m, nrows) : NULL;
	float *q = rand_q8(r, G, d), qsc[KVD_GMAX];
	int16_t *q16 = xmalloc((size_t)G * d * sizeof *q16);
	size_t lds = m + 3, ns = (G - 1) * lds + m;
	float *s0 = xmalloc(ns * sizeof *s0), *s1 = xmalloc(ns * sizeof *s1);
	char *side = gather ? xmalloc(nrows * 12) : NULL;

	for (int g = 0; g < G; g++)
		if (kvd_rng_below(r, 4) == 0)
			for (int e = 0; e < d; e++)
				q[g * d + e] = kvd_rng_below(r, 2) ? 3.0f : -3.0f;
	kvd_q16(q, G, d, q16, qsc);
	check_q16(q, G, d, q16, qsc);
	ref->qk8(q16, qsc, G, d, rows, idx, m, s0, lds, NULL, 0);
	for (int g = 0; g < G; g++) {
		for (size_t i = 0; i < m; i++) {
			const int8_t *p = rowp8(rows, idx, i, d);
			int64_t a = 0;

			for (int j = 0; j < d; j++)
				a += (int64_t)q16[g * d + j] * p[j];
			if (s0[g * lds + i] != (float)a * qsc[g])
				fail_msg("scalar qk8 d=%d G=%d: s[%d][%zu] = %g, exact %g", d, G, g, i,
					 s0[g * lds + i], (float)a * qsc[g]);
		}
	}
	for (size_t v = 0; v < nvar; v++) {
		const struct kvd_kern *k = var[v];

		for (size_t i = 0; i < ns; i++)
			s1[i] = 12345.0f;
		k->qk8(q16, qsc, G, d, rows, idx, m, s1, lds, side, side ? 12 : 0);
		for (int g = 0; g < G; g++) {
			for (size_t i = 0; i < m; i++) {
				size_t e = g * lds + i;

				if (memcmp(&s1[e], &s0[e], sizeof s1[e]))
					fail_msg("%s qk8 d=%d G=%d m=%zu idx=%d: s[%d][%zu] = %g, scalar %g",
						 k->name, d, G, m, gather, g, i, s1[e], s0[e]);
			}
			for (size_t i = m; g + 1 < G && i < lds; i++)
				assert_true(s1[g * lds + i] == 12345.0f);
		}
	}
	free(rows);
	free(idx);
	free(q);
	free(q16);
	free(s0);
	free(s1);
	free(side);
}

/* kvd_q16 on the edges: a zero head, a head with a NaN or an infinity
 * (q16 = 0, qscale NaN, so scores are NaN), a head of one huge element. */
static void test_q16(void **state)
{
	float q[4 * 16], qsc[4];
	int16_t q16[4 * 16];

	(void)state;
	for (int i = 0; i < 4 * 16; i++)
		q[i] = (float)(i % 7) - 3.0f;
	for (int i = 0; i < 16; i++)
		q[i] = 0.0f;
	q[16 + 5] = NAN;
	q[32 + 9] = -INFINITY;
	q[48 + 2] = FLT_MAX;
	kvd_q16(q, 4, 16, q16, qsc);
	assert_true(qsc[0] == 0.0f);
	assert_true(isnan(qsc[1]) && isnan(qsc[2]));
	{
		int16_t r16[4 * 16];
		float rsc[4];

		kvd_q16_ref(q, 4, 16, r16, rsc);
		assert_memory_equal(r16, q16, sizeof r16);
	}
	for (int e = 0; e < 48; e++)
		assert_int_equal(q16[e], 0);
	check_q16(q + 48, 1, 16, q16 + 48, qsc + 3);
	assert_int_equal(q16[48 + 2], 32767);
}

/* Weights as attn.c passes them: softmax weights (many tiny, some zero)
 * times per-row value scales, with random signs to make cancellation. */
static float *rand_w8(struct kvd_rng *r, size_t n)
{
	float *w = xmalloc(n * sizeof *w);

	for (size_t i = 0; i < n; i++) {
		uint32_t u = kvd_rng_below(r, 16);

		w[i] = u == 0 ? 0.0f : (float)(exp(-20.0 * kvd_rng_uniform(r)) * kvd_rng_normal(r));
	}
	return w;
}

static void check_pv8(struct kvd_rng *r, int d, int G, size_t m, int gather)
{
	size_t nrows = gather ? m + 7 : m, no = (size_t)G * d;
	int8_t *rows = rand_rows8(r, nrows, d);
	uint32_t *idx = gather ? rand_idx(r, m, nrows) : NULL;
	size_t ldw = m + 2, nw = (G - 1) * ldw + m;
	float *w = rand_w8(r, nw);
	float *oi = rand_f32(r, no, 1.0);
	float *o0 = xmalloc(no * sizeof *o0), *o1 = xmalloc(no * sizeof *o1);
	float *mag = xmalloc(no * sizeof *mag), wsc[KVD_GMAX];
	int16_t *w16 = xmalloc(nw * sizeof *w16);

	/* as attn.c passes them: each head's weights rounded to 16 bits */
	for (int g = 0; g < G; g++) {
		kvd_q16(w + g * ldw, 1, (int)m, w16 + g * ldw, &wsc[g]);
		check_q16(w + g * ldw, 1, (int)m, w16 + g * ldw, &wsc[g]);
	}
	memcpy(o0, oi, no * sizeof *o0);
	ref->pv8(w16, ldw, wsc, G, d, rows, idx, m, o0);
	for (size_t i = 0; i < no; i++)
		mag[i] = fabsf(oi[i]);
	for (size_t i = 0; i < m; i++) {
		const int8_t *p = rowp8(rows, idx, i, d);

		for (int g = 0; g < G; g++)
			for (int j = 0; j < d; j++)
				mag[g * d + j] += fabsf(w16[g * ldw + i] * wsc[g] * (float)p[j]);
	}
	for (size_t v = 0; v < nvar; v++) {
		const struct kvd_kern *k = var[v];
		double tol = 2e-6;

		memcpy(o1, oi, no * sizeof *o1);
		k->pv8(w16, ldw, wsc, G, d, rows, idx, m, o1);
		for (size_t e = 0; e < no; e++) {
			double dv = fabs((double)o1[e] - o0[e]), bound = tol * mag[e] + 1e-30;

			note(v, dv * tol / bound);
			if (!(dv <= bound))
				fail_msg("%s pv8 d=%d G=%d m=%zu idx=%d: o[%zu][%zu] = %g, scalar %g",
					 k->name, d, G, m, gather, e / d, e % d, o1[e], o0[e]);
		}
	}
	free(rows);
	free(idx);
	free(w);
	free(w16);
	free(oi);
	free(o0);
	free(o1);
	free(mag);
}

/* As test_qk, over d that are odd multiples of 16 and over 64, and every
 * head-group size a variant specialises on (1..16) on the short grid; the
 * multiples of 64 are the d avx512amx takes to its tiles (in groups of up to
 * 7 heads, pv8 a window of 16384 / d rows at a time). */
static const int ds8[] = { 16, 48, 64, 80, 128, 192, 256 };
static const int gs8[] = { 1, 2, 3, 4, 5, 8, 9, 16 };

static void test_qk8(void **state)
{
	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0xa3);

		for (size_t a = 0; a < N_OF(ds8); a++)
			for (size_t b = 0; b < N_OF(gs8); b++)
				for (size_t c = 0; c < N_OF(ms) - !!s; c++)
					for (int gather = 0; gather < 2; gather++)
						check_qk8(&r, ds8[a], gs8[b], ms[c], gather);
		for (int G = 1; G <= KVD_GMAX; G++)
			for (int gather = 0; gather < 2; gather++)
				check_qk8(&r, G % 2 ? 48 : 80, G, 37, gather);
		for (int G = 1; G <= KVD_GMAX; G++)
			check_qk8(&r, G % 2 ? 64 : 128, G, 37 + 100 * (size_t)G, 0);
		for (size_t m = 255; m < 4200 && s == 0; m = m * 2 + 1) {
			check_qk8(&r, 128, 4, m, 0);
			check_qk8(&r, 80, 1 + (int)(m % 7), m + 1, 0);
		}
	}
}

static void test_pv8(void **state)
{
	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0xa4);

		for (size_t a = 0; a < N_OF(ds8); a++)
			for (size_t b = 0; b < N_OF(gs8); b++)
				for (size_t c = 0; c < N_OF(ms) - !!s; c++)
					for (int gather = 0; gather < 2; gather++)
						check_pv8(&r, ds8[a], gs8[b], ms[c], gather);
		for (int G = 1; G <= KVD_GMAX; G++)
			for (int gather = 0; gather < 2; gather++)
				check_pv8(&r, G % 2 ? 48 : 80, G, 37, gather);
		for (int G = 1; G <= KVD_GMAX; G++)
			check_pv8(&r, G % 2 ? 64 : 128, G, 37 + 100 * (size_t)G, 0);
		for (size_t m = 255; m < 4200 && s == 0; m = m * 2 + 1) {
			check_pv8(&r, 128, 4, m, 0);
			check_pv8(&r, 80, 1 + (int)(m % 7), m + 1, 0);
		}
	}
	report("pv8", "worst |err| / (|o| + sum|w_i v_ij|) = %.2e");
}

/* ---- max / expsum ---------------------------------------------------------- */

static float *rand_scores(struct kvd_rng *r, size_t m)
{
	float *x = rand_f32(r, m, 20.0);

	for (size_t i = 0; i < m; i++) {
		uint32_t u = kvd_rng_below(r, 16);

		if (u == 0)
			x[i] = -INFINITY;
		else if (u == 1)
			x[i] = -200.0f - (float)kvd_rng_uniform(r) * 1e6f;
		else if (u == 2)
			x[i] = -87.0f - 20.0f * (float)kvd_rng_uniform(r);     /* denormal results */
	}
	return x;
}

static void test_max(void **state)
{
	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0x9e);

		for (size_t m = 0; m <= 300; m += m < 40 ? 1 : 37) {
			float *x = rand_scores(&r, m), *y = xmalloc(m * sizeof *y);
			size_t at = m ? kvd_rng_below(&r, (uint32_t)m) : 0;

			for (size_t i = 0; i < m; i++)
				y[i] = i == at ? 3.5f : -INFINITY;
			for (size_t v = 0; v < nvar; v++) {
				assert_true(var[v]->max(x, m) == ref->max(x, m));
				assert_true(var[v]->max(y, m) == (m ? 3.5f : -INFINITY));
			}
			free(x);
			free(y);
		}
	}
	report("max", "equal to scalar's");
}

static void check_expsum(float *x, size_t m, float mx)
{
	float *y0 = xmalloc(m * sizeof *y0), *y1 = xmalloc(m * sizeof *y1);

	memcpy(y0, x, m * sizeof *y0);
	float s0 = ref->expsum(y0, m, mx);

	for (size_t v = 0; v < nvar; v++) {
		const struct kvd_kern *k = var[v];

		memcpy(y1, x, m * sizeof *y1);
		float s1 = k->expsum(y1, m, mx);

		for (size_t i = 0; i < m; i++) {
			double dv = fabs((double)y1[i] - y0[i]);

			/* The absolute term admits one ulp of a denormal result. */
			if (!(dv <= 1e-5 * y0[i] + 1e-44))
				fail_msg("%s expsum m=%zu: exp(%g - %g) = %g, scalar %g",
					 k->name, m, x[i], mx, y1[i], y0[i]);
			if (y0[i] > 1e-30)
				note(v, dv / y0[i]);
			if (x[i] == -INFINITY || x[i] - mx < -110.0f)
				assert_true(y1[i] == 0.0f);
		}
		if (!(fabs((double)s1 - s0) <= 1e-5 * s0))
			fail_msg("%s expsum m=%zu: sum %g, scalar %g", k->name, m, s1, s0);
	}
	free(y0);
	free(y1);
}

/* Scores with -inf, hopeless (< -200) and denormal-result entries. */
static void test_expsum(void **state)
{
	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0x9f);

		for (size_t m = 0; m <= 1100; m += m < 40 ? 1 : 97) {
			float *x = rand_scores(&r, m);
			float mx = ref->max(x, m);

			if (m && mx == -INFINITY)
				mx = 0.0f;
			check_expsum(x, m, mx);
			check_expsum(x, m, mx + 30.0f);
			free(x);
		}
	}
	report("expsum", "worst relative error %.2e");
}

/* ---- logp ------------------------------------------------------------------ */

static void check_logp(struct kvd_rng *r, const struct kvd_logp_tab *tab, int d, size_t m)
{
	float *q = rand_f32(r, d, 1.0), qn = 0.0f;
	float *dots = xmalloc(m * sizeof *dots), *kinv = xmalloc(m * sizeof *kinv);
	float *s0 = xmalloc(m * sizeof *s0), *s1 = xmalloc(m * sizeof *s1);
	float *key = xmalloc(d * sizeof *key);
	float scale = 1.0f / sqrtf((float)d);

	for (int j = 0; j < d; j++)
		qn += q[j] * q[j];
	qn = sqrtf(qn);
	for (size_t i = 0; i < m; i++) {
		uint32_t u = kvd_rng_below(r, 8);
		float dot = 0.0f, kn = 0.0f;

		/* Mostly random keys (cos near 0, as in attention), and the edges:
		 * keys along +-q (|cos| at or just over 1), zero keys, and cosines
		 * spread uniformly over [-1, 1]. */
		for (int j = 0; j < d; j++) {
			float x = (float)kvd_rng_normal(r);

			key[j] = u == 0 ? 3.0f * q[j] : u == 1 ? -0.5f * q[j] : u == 2 ? 0.0f : x;
			dot += q[j] * key[j];
			kn += key[j] * key[j];
		}
		kinv[i] = kn > 0.0f ? 1.0f / sqrtf(kn) : 0.0f;
		if (u == 3)
			dot = (float)(2.0 * kvd_rng_uniform(r) - 1.0) * qn * sqrtf(kn);
		dots[i] = dot;
	}
	memcpy(s0, dots, m * sizeof *s0);
	ref->logp(s0, m, kinv, 1.0f / qn, scale, tab);
	for (size_t v = 0; v < nvar; v++) {
		const struct kvd_kern *k = var[v];

		memcpy(s1, dots, m * sizeof *s1);
		k->logp(s1, m, kinv, 1.0f / qn, scale, tab);
		for (size_t i = 0; i < m; i++) {
			double dv = fabs((double)s1[i] - s0[i]);
			/* theta is a float: near pi, x = theta * N/pi carries an error
			 * of a few ulps of 4096 (2^-11 each) in any implementation,
			 * which matters only where the table is steep (the last step
			 * down to the floor). */
			float c = fmaxf(-1.0f, fminf(1.0f, dots[i] * kinv[i] / qn));
			int j = (int)(acosf(c) * (float)(KVD_LOGP_N / M_PI));

			j = j > KVD_LOGP_N ? KVD_LOGP_N : j;
			double slope = fabs(tab->v[j + 1] - tab->v[j]);

			if (slope < 1.0)
				note(v, dv);
			if (!(dv <= 1e-4 + 4 * 0x1p-11 * slope))
				fail_msg("%s logp K=%d L=%d m=%zu: s[%zu] = %.7g, scalar %.7g",
					 k->name, tab->K, tab->L, m, i, s1[i], s0[i]);
		}
	}
	free(q);
	free(dots);
	free(kinv);
	free(s0);
	free(s1);
	free(key);
}

static void test_logp(void **state)
{
	static const int prof[][3] = { { 10, 150, 2 }, { 8, 75, 1 }, { 16, 1024, 2 }, { 1, 1, 1 } };
	struct kvd_logp_tab *tab = xmalloc(sizeof *tab);

	start();
	for (size_t p = 0; p < N_OF(prof); p++) {
		struct kvd_rng r = kvd_rng_make(0xa0 + p);

		kvd_logp_tab_init(tab, prof[p][0], prof[p][1], prof[p][2]);
		for (size_t c = 0; c < N_OF(ms); c++)
			check_logp(&r, tab, 128, ms[c]);
		check_logp(&r, tab, 64, 4000);
	}
	free(tab);
	report("logp", "worst absolute error %.2e where the table is smooth");
}

/* NaN scores (a client's NaN rows or query) must stay inside the table in
 * every variant, the scalar one included: UBSan and ASan watch the index. */
static void test_logp_nan(void **state)
{
	struct kvd_logp_tab *tab = xmalloc(sizeof *tab);
	float s[37], kinv[37];
	const struct kvd_kern *vars[8];
	size_t n = 0;

	vars[n++] = &kvd_kern_scalar;
	for (size_t v = 0; v < nvar; v++)
		vars[n++] = var[v];
	kvd_logp_tab_init(tab, 10, 150, 2);
	for (size_t v = 0; v < n; v++) {
		for (int i = 0; i < 37; i++) {
			s[i] = i % 3 ? NAN : (float)i;
			kinv[i] = i % 5 ? 1.0f : NAN;
		}
		vars[v]->logp(s, 37, kinv, 1.0f, 0.1f, tab);
		for (int i = 0; i < 37; i++)
			if (!isnan(s[i]) && !(s[i] > -1e30f && s[i] < 1e30f))
				fail_msg("%s: s[%d] = %g", vars[v]->name, i, s[i]);
	}
	free(tab);
}

/* ---- kinv ------------------------------------------------------------------ */

static void test_kinv(void **state)
{
	static const int dk[] = { 16, 48, 64, 128, 256 };

	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0xa1);

		for (size_t a = 0; a < N_OF(dk); a++) {
			for (size_t c = 0; c < N_OF(ms); c++) {
				size_t n = ms[c];
				int d = dk[a];
				uint16_t *rows = rand_rows(&r, n, d);
				float *o0 = xmalloc(n * sizeof *o0), *o1 = xmalloc(n * sizeof *o1);

				for (size_t i = 0; i < n; i += 7)
					memset(rows + i * d, 0, d * sizeof *rows);
				ref->kinv(rows, n, d, o0);
				for (size_t v = 0; v < nvar; v++) {
					var[v]->kinv(rows, n, d, o1);
					for (size_t i = 0; i < n; i++) {
						double dv = fabs((double)o1[i] - o0[i]);

						if (o0[i] > 0.0f)
							note(v, dv / o0[i]);
						if (!(dv <= 1e-5 * o0[i]))
							fail_msg("%s kinv d=%d n=%zu: [%zu] = %g, scalar %g",
								 var[v]->name, d, n, i, o1[i], o0[i]);
					}
				}
				free(rows);
				free(o0);
				free(o1);
			}
		}
	}
	report("kinv", "worst relative error %.2e");
}

/* ---- mv -------------------------------------------------------------------- */

/* hybrid_lcv's product with the int8 moments, every kernel the scalar one
 * included, against double: col[e] * sum_f x[f] row[f] kv[f][e], within
 * float rounding of the sum of the terms' sizes; and a head's result is
 * the same bits whatever its group (G = 1 against its place in G). */
static void test_mv(void **state)
{
	static const int dm[] = { 16, 64, 128 };

	(void)state;
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0x3b);

		for (size_t a = 0; a < N_OF(dm); a++) {
			const int d = dm[a], G = 8;
			int8_t *kv = xmalloc((size_t)d * d);
			float *row = xmalloc(d * sizeof *row), *col = xmalloc(d * sizeof *col);
			float *x = xmalloc((size_t)G * d * sizeof *x), *y = xmalloc((size_t)G * d * sizeof *y);
			float y1[256];

			for (int i = 0; i < d * d; i++)
				kv[i] = (int8_t)((int)kvd_rng_below(&r, 255) - 127);
			for (int f = 0; f < d; f++) {
				row[f] = (float)(0.01 + kvd_rng_below(&r, 1000) / 100.0);
				col[f] = (float)(0.01 + kvd_rng_below(&r, 1000) / 1000.0);
			}
			for (int i = 0; i < G * d; i++)
				x[i] = (float)((int)kvd_rng_below(&r, 2001) - 1000) / 100.0f;
			for (size_t v = 0; v <= nvar; v++) {
				const struct kvd_kern *kk = v ? var[v - 1] : ref;

				kk->mv(kv, row, col, d, x, G, y);
				for (int g = 0; g < G; g++) {
					for (int e = 0; e < d; e++) {
						double t = 0, m = 0;

						for (int f = 0; f < d; f++) {
							double u = (double)x[g * d + f] * row[f] * kv[f * d + e];

							t += u;
							m += fabs(u);
						}
						t *= col[e];
						m *= col[e];
						if (!(fabs(y[g * d + e] - t) <= 1e-5 * m + 1e-30))
							fail_msg("%s mv d=%d g=%d e=%d: %g, double %g", kk->name,
								 d, g, e, y[g * d + e], t);
					}
					kk->mv(kv, row, col, d, x + (size_t)g * d, 1, y1);
					assert_memory_equal(y1, y + (size_t)g * d, (size_t)d * sizeof *y1);
				}
			}
			free(kv);
			free(row);
			free(col);
			free(x);
			free(y);
		}
	}
}

/* ---- ge8 ------------------------------------------------------------------- */

/* Every variant, scalar included, against the definition: counts of every
 * size (the walk's are mostly 0-2, up to 242; 255 and 128 cross AVX2's
 * signed compares), thresholds from 1 up, the summary of non-zero words
 * (bits past the last word 0), and cnt left zero. */
static void test_ge8(void **state)
{
	static const size_t nw[] = { 1, 2, 7, 64, 513, 1024 };
	static const uint8_t cs[] = { 1, 2, 3, 127, 128, 200, 255 };

	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0x9e8);

		for (size_t a = 0; a < N_OF(nw); a++) {
			size_t words = nw[a];
			uint8_t *cnt = aligned_alloc(64, words * 64), *src = xmalloc(words * 64);
			uint64_t *bits = xmalloc(words * sizeof *bits);
			uint64_t *nz = xmalloc((words + 63) / 64 * sizeof *nz);

			assert_non_null(cnt);
			for (size_t i = 0; i < words * 64; i++) {
				uint32_t x = kvd_rng_below(&r, 8);

				src[i] = (uint8_t)(x < 6 ? x / 2 : kvd_rng_below(&r, 256));
			}
			for (size_t c = 0; c < N_OF(cs); c++)
				for (size_t v = 0; v <= nvar; v++) {
					const struct kvd_kern *k = v < nvar ? var[v] : ref;

					memcpy(cnt, src, words * 64);
					memset(bits, 0xa5, words * sizeof *bits);
					memset(nz, 0xa5, (words + 63) / 64 * sizeof *nz);
					k->ge8(cnt, words, cs[c], bits, nz);
					for (size_t w = 0; w < (words + 63) / 64 * 64; w++) {
						int want = w < words && bits[w] != 0,
						    got = (int)(nz[w / 64] >> (w % 64) & 1);

						if (got != want)
							fail_msg("%s ge8 words=%zu c=%u: summary bit %zu %d, want %d",
								 k->name, words, cs[c], w, got, want);
					}
					for (size_t i = 0; i < words * 64; i++) {
						int want = src[i] >= cs[c], got = (int)(bits[i / 64] >> (i % 64) & 1);

						if (got != want)
							fail_msg("%s ge8 words=%zu c=%u: id %zu (count %u) %d, want %d",
								 k->name, words, cs[c], i, src[i], got, want);
						if (cnt[i])
							fail_msg("%s ge8: count %zu left %u", k->name, i, cnt[i]);
					}
				}
			free(cnt);
			free(src);
			free(bits);
			free(nz);
		}
	}
	report("ge8", "%.0f mismatches");
}

/* ---- rank ------------------------------------------------------------------ */

/* Every variant, scalar included, against the definition, for every n up to
 * KVD_KERN_RANK_MAX: scores drawn from few values (ties broken by id), some
 * -inf, ids with the top bit set (AVX2 compares them signed, flipped), and
 * the ranks a permutation of 0 .. n-1. */
static void test_rank(void **state)
{
	start();
	for (size_t sd = 0; sd < NSEEDS; sd++) {
		struct kvd_rng r = kvd_rng_make(seeds[sd] ^ 0x4a7);

		for (uint32_t n = 0; n <= KVD_KERN_RANK_MAX; n++) {
			float s[KVD_KERN_RANK_MAX];
			uint32_t id[KVD_KERN_RANK_MAX], rk[KVD_KERN_RANK_MAX];

			for (uint32_t i = 0; i < n; i++) {
				uint32_t x = kvd_rng_below(&r, 16);

				s[i] = x == 0 ? -INFINITY : x < 8 ? (float)x - 4.0f :
					(float)kvd_rng_uniform(&r) * 8.0f - 4.0f;
				/* distinct: a random high half over the index */
				id[i] = kvd_rng_below(&r, 4) << 30 | kvd_rng_below(&r, 1u << 20) << 6 | i;
			}
			for (size_t v = 0; v <= nvar; v++) {
				const struct kvd_kern *k = v < nvar ? var[v] : ref;
				uint64_t seen = 0;

				for (uint32_t i = 0; i < KVD_KERN_RANK_MAX; i++)
					rk[i] = 0xa5a5a5a5u;
				k->rank(s, id, n, rk);
				for (uint32_t i = 0; i < n; i++) {
					uint32_t want = 0;

					for (uint32_t j = 0; j < n; j++)
						want += s[j] > s[i] || (s[j] == s[i] && id[j] < id[i]);
					if (rk[i] != want)
						fail_msg("%s rank n=%u: rk[%u] = %u, want %u", k->name, n, i,
							 rk[i], want);
					seen |= 1ull << rk[i];
				}
				assert_true(seen == (n < 64 ? (1ull << n) - 1 : ~0ull));
				for (uint32_t i = n; i < KVD_KERN_RANK_MAX; i++)
					assert_true(rk[i] == 0xa5a5a5a5u);
			}
		}
	}
	report("rank", "%.0f mismatches");
}

/* ---- hash ------------------------------------------------------------------ */

static void check_hash(struct kvd_rng *r, int d, int K, int L, size_t n)
{
	size_t KL = (size_t)K * L, ldx = d + 3, ldc = n + 5, nc = (L - 1) * ldc + n;
	float *W = rand_f32(r, d * KL, 1.0);
	float *x = rand_f32(r, n ? (n - 1) * ldx + d : 0, 1.0);
	uint16_t *c0 = xmalloc(nc * sizeof *c0), *c1 = xmalloc(nc * sizeof *c1);

	/* Column 0 orthogonal to row 0: a sign that rounding decides. */
	if (n) {
		double xw = 0.0, xx = 0.0;

		for (int e = 0; e < d; e++) {
			xw += (double)x[e] * W[e * KL];
			xx += (double)x[e] * x[e];
		}
		for (int e = 0; e < d; e++)
			W[e * KL] = (float)(W[e * KL] - xw / xx * x[e]);
	}
	ref->hash(W, d, K, L, x, ldx, n, c0, ldc);
	for (size_t v = 0; v < nvar; v++) {
		const struct kvd_kern *k = var[v];

		for (size_t i = 0; i < nc; i++)
			c1[i] = 0xdead;
		k->hash(W, d, K, L, x, ldx, n, c1, ldc);
		for (int t = 0; t < L; t++) {
			for (size_t i = 0; i < n; i++) {
				unsigned diff = c0[t * ldc + i] ^ c1[t * ldc + i];

				if (c1[t * ldc + i] >> K)
					fail_msg("%s hash K=%d: code %#x has bits above K",
						 k->name, K, c1[t * ldc + i]);
				for (int j = 0; j < K; j++) {
					if (!(diff >> j & 1))
						continue;
					/* Only a dot product within rounding of 0 may flip. */
					double dot = 0.0, xn = 0.0, wn = 0.0;

					for (int e = 0; e < d; e++) {
						double xe = x[i * ldx + e], we = W[e * KL + t * K + j];

						dot += xe * we;
						xn += xe * xe;
						wn += we * we;
					}
					if (!(fabs(dot) < 1e-4 * sqrt(xn * wn)))
						fail_msg("%s hash d=%d K=%d L=%d n=%zu: table %d row %zu bit %d (dot %g)",
							 k->name, d, K, L, n, t, i, j, dot);
					worst[v] += 1.0;
				}
			}
			for (size_t i = n; t + 1 < L && i < ldc; i++)
				assert_int_equal(c1[t * ldc + i], 0xdead);
		}
	}
	free(W);
	free(x);
	free(c0);
	free(c1);
}

static void test_hash(void **state)
{
	static const int kl[][2] = { { 1, 1 }, { 1, 7 }, { 3, 5 }, { 7, 13 }, { 8, 16 },
				     { 10, 40 }, { 12, 1 }, { 16, 3 }, { 16, 20 } };
	static const size_t ns[] = { 0, 1, 2, 3, 5, 7, 15, 16, 17, 31, 32, 33, 100 };

	start();
	for (size_t s = 0; s < NSEEDS; s++) {
		struct kvd_rng r = kvd_rng_make(seeds[s] ^ 0xa2);

		for (size_t a = 0; a < N_OF(kl); a++)
			for (size_t b = 0; b < N_OF(ns); b++)
				check_hash(&r, s ? 128 : 64, kl[a][0], kl[a][1], ns[b]);
		check_hash(&r, 16, 10, 30, 50);
		check_hash(&r, 256, 9, 11, 40);
	}
	report("hash", "codes equal scalar's except %.0f bits on a near-zero dot product");
}

static int setup(void **state)
{
	struct kvd_rng r = kvd_rng_make(0x900d);

	for (size_t i = 0; i < POOL; i++)
		pool[i] = (float)kvd_rng_normal(&r);
	for (size_t v = 0; v < NV; v++) {
		const struct kvd_kern *k = kvd_kern_by_name(all[v]);

		if (k) {
			var[nvar++] = k;
			print_message("kern: testing %s against scalar\n", all[v]);
		} else {
			print_message("SKIP: %s not supported on this CPU\n", all[v]);
		}
	}
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_qk),
		cmocka_unit_test(test_pv),
		cmocka_unit_test(test_qk8),
		cmocka_unit_test(test_q16),
		cmocka_unit_test(test_pv8),
		cmocka_unit_test(test_max),
		cmocka_unit_test(test_expsum),
		cmocka_unit_test(test_logp),
		cmocka_unit_test(test_logp_nan),
		cmocka_unit_test(test_kinv),
		cmocka_unit_test(test_mv),
		cmocka_unit_test(test_ge8),
		cmocka_unit_test(test_rank),
		cmocka_unit_test(test_hash),
	};

	return cmocka_run_group_tests(tests, setup, NULL);
}
