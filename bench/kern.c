/* kvbench kern: the row kernels of every ISA variant this CPU runs, on one
 * core, cold, int8 (qk8 + pv8) against bf16 (qk + pv) in the same run.
 *
 * Two cases, the two shapes attention has:
 *   gather  G = 1 over --gather sorted random rows of a table far larger
 *           than the LLC (the sampled path: one q head, its own rows);
 *   dense   G = 4 over --dense contiguous rows at a random start (the tail
 *           and the dense baseline: a GQA group over a block).
 * Each rep times every variant in turn, each after a sweep of the caches
 * (bench_sweep), so the noise of a shared machine falls on all of them, and
 * then once more at once, warm; medians of --reps.  Lines: one per (isa,
 * case, kv_dtype) with ns_per_row and the GB/s of rows read, qk's share of
 * the time, warm_ns_per_row (the kernels' own speed: cold minus warm is
 * what memory costs), and ratios measured in this run: int8 against bf16
 * of the same variant, and each variant against avx2.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "engine/kern.h"
#include "engine/mem.h"
#include "engine/pool.h"
#include "engine/rng.h"

#define D 128
#define G_DENSE 4
#define MAXV 5

struct kcase {
	const char *name;
	int G;
	size_t m;
	uint32_t *idx;                  /* NULL: contiguous from `start` */
	size_t start;
};

struct kdata {
	int8_t *r8;
	uint16_t *r16;
	size_t n;                       /* rows in each table */
	float q[G_DENSE * D], w32[G_DENSE * 131072], s[G_DENSE * 131072], o[G_DENSE * D];
	int16_t q16[G_DENSE * D], w16[G_DENSE * 131072];
	float qs[G_DENSE], ws[G_DENSE];
};

/* qk then pv, as attention runs them (pv finds the rows qk brought in);
 * the time of qk alone goes to *qk_ms. */
static double run(const struct kvd_kern *k, struct kdata *x, const struct kcase *c, int int8,
		  double *qk_ms)
{
	size_t lds = c->m;
	double t0 = bench_now_ms();

	if (int8) {
		const int8_t *base = x->r8 + (c->idx ? 0 : c->start * D);

		k->qk8(x->q16, x->qs, c->G, D, base, c->idx, c->m, x->s, lds, NULL, 0);
		*qk_ms = bench_now_ms() - t0;
		k->pv8(x->w16, c->m, x->ws, c->G, D, base, c->idx, c->m, x->o);
	} else {
		const uint16_t *base = x->r16 + (c->idx ? 0 : c->start * D);

		k->qk(x->q, c->G, D, base, c->idx, c->m, x->s, lds);
		*qk_ms = bench_now_ms() - t0;
		k->pv(x->w32, c->m, c->G, D, base, c->idx, c->m, x->o);
	}
	return bench_now_ms() - t0;
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return (x > y) - (x < y);
}

int bench_kern_main(int argc, char **argv)
{
	static const char *const names[MAXV] = { "avx2", "avx512", "avx512vnni", "avx512amx", "scalar" };
	uint32_t reps = 9, gather = 8192, dense = 98304, mb = 512;
	int json = 0;

	for (int i = 1; i < argc; i++) {
		uint32_t *v = !strcmp(argv[i], "--reps") ? &reps : !strcmp(argv[i], "--gather") ? &gather :
			      !strcmp(argv[i], "--dense") ? &dense : !strcmp(argv[i], "--table-mib") ? &mb : NULL;

		if (!strcmp(argv[i], "--json")) {
			json = 1;
		} else if (v && i + 1 < argc && bench_parse_u32(argv[i + 1], v) == 0 && *v) {
			i++;
		} else {
			fprintf(stderr, "usage: kvbench kern [--json] [--reps N] [--gather ROWS] "
					"[--dense ROWS] [--table-mib MIB]\n");
			return 2;
		}
	}
	if (gather > 131072 || dense > 131072) {
		fprintf(stderr, "kvbench kern: at most 131072 rows a case\n");
		return 2;
	}

	const struct kvd_kern *var[MAXV];
	int nv = 0, nver = 0;

	/* scalar only where nothing else runs: it is the reference, not a contender */
	for (int v = 0; v < MAXV; v++)
		if ((var[nv] = kvd_kern_by_name(names[v])) && (v < MAXV - 1 || nv == 0))
			nv++;
	nver = nv;

	struct kvd_pool *pool;
	int rc = kvd_pool_create(0, 1, &pool);

	if (rc < 0) {
		fprintf(stderr, "kvbench kern: pool: %s\n", strerror(-rc));
		return 1;
	}
	struct bench_sweep *sw = bench_sweep_new(bench_llc_bytes());
	struct kdata *x = calloc(1, sizeof *x);
	struct kvd_rng r = kvd_rng_make(42);

	x->n = (size_t)mb << 20 >> 7;   /* D-byte int8 rows; bf16 rows are twice as big */
	if (x->n < dense)
		x->n = dense;
	x->r8 = kvd_mem_alloc(x->n * D);         /* huge pages, as segments have */
	x->r16 = kvd_mem_alloc(x->n * D * 2);
	if (!sw || !x || !x->r8 || !x->r16) {
		fprintf(stderr, "kvbench kern: %s\n", strerror(ENOMEM));
		return 1;
	}
	for (size_t i = 0; i < x->n * D; i++) {
		x->r8[i] = (int8_t)((int)kvd_rng_below(&r, 255) - 127);
		x->r16[i] = (uint16_t)(0x3c00 + kvd_rng_below(&r, 0x0800));    /* bf16 in [2^-7, 2^-3) */
	}
	for (size_t i = 0; i < G_DENSE * D; i++)
		x->q[i] = (float)(kvd_rng_uniform(&r) * 2 - 1);
	for (size_t i = 0; i < G_DENSE * (size_t)131072; i++)
		x->w32[i] = (float)kvd_rng_uniform(&r) / 1024.0f;
	kvd_q16(x->q, G_DENSE, D, x->q16, x->qs);
	for (int g = 0; g < G_DENSE; g++)
		kvd_q16(x->w32 + (size_t)g * 131072, 1, 131072, x->w16 + (size_t)g * 131072, x->ws + g);

	struct kcase cs[2] = {
		{ "gather", 1, gather, malloc(gather * sizeof(uint32_t)), 0 },
		{ "dense", G_DENSE, dense, NULL, kvd_rng_below(&r, (uint32_t)(x->n - dense + 1)) },
	};

	if (!cs[0].idx)
		return 1;
	for (size_t i = 0; i < gather; i++)
		cs[0].idx[i] = kvd_rng_below(&r, (uint32_t)x->n);
	qsort(cs[0].idx, gather, sizeof(uint32_t), cmp_u32);

	/* t[measure][case][dtype][variant][rep]; measures: cold, its qk part,
	 * warm (the same call again at once: rows in cache, the kernels' own
	 * speed) */
	size_t per = (size_t)2 * 2 * MAXV * reps;
	double *t = calloc(3 * per, sizeof *t);

	if (!t)
		return 1;
#define T(me, c, dt, v) (t + (me) * per + (((size_t)(c) * 2 + (dt)) * MAXV + (v)) * reps)
	for (uint32_t rep = 0; rep < reps; rep++)
		for (int c = 0; c < 2; c++)
			for (int dt = 0; dt < 2; dt++)
				for (int v = 0; v < nv; v++) {
					double qk;

					bench_sweep(pool, sw);
					T(0, c, dt, v)[rep] = run(var[v], x, &cs[c], dt, &qk);
					T(1, c, dt, v)[rep] = qk;
					T(2, c, dt, v)[rep] = run(var[v], x, &cs[c], dt, &qk);
				}

	double med[3][2][2][MAXV];

	for (int me = 0; me < 3; me++)
		for (int c = 0; c < 2; c++)
			for (int dt = 0; dt < 2; dt++)
				for (int v = 0; v < nv; v++)
					med[me][c][dt][v] = bench_median(T(me, c, dt, v), (int)reps);
#undef T
	if (!json)
		printf("kvbench kern: %s, one core, cold, d=%d, %u reps (median)\n", bench_cpu_name(), D,
		       reps);
	for (int c = 0; c < 2; c++)
		for (int v = 0; v < nver; v++)
			for (int dt = 0; dt < 2; dt++) {
				const char *dtype = dt ? "int8" : "bf16";
				double ms = med[0][c][dt][v], rows = (double)cs[c].m;
				double ns = ms * 1e6 / rows, warm = med[2][c][dt][v] * 1e6 / rows;
				double gbps = rows * D * (dt ? 1 : 2) / (ms * 1e6);
				double qk = med[1][c][dt][v] / ms;
				double vs_avx2 = ms / med[0][c][dt][0];
				double i8 = med[0][c][1][v] / med[0][c][0][v];

				if (json)
					printf("{\"bench\":\"kern\",\"cpu\":\"%s\",\"isa\":\"%s\",\"case\":\"%s\","
					       "\"kv_dtype\":\"%s\",\"G\":%d,\"rows\":%zu,\"reps\":%u,"
					       "\"ms\":%.4f,\"ns_per_row\":%.2f,\"gbps\":%.2f,\"qk_frac\":%.3f,"
					       "\"warm_ns_per_row\":%.2f,\"time_vs_%s\":%.3f,\"int8_vs_bf16\":%.3f}\n",
					       bench_cpu_name(), var[v]->name, cs[c].name, dtype, cs[c].G,
					       cs[c].m, reps, ms, ns, gbps, qk, warm, var[0]->name, vs_avx2, i8);
				else
					printf("  %-7s %-11s %-5s G=%d %6zu rows  %8.3f ms  %6.2f ns/row  "
					       "%6.2f GB/s  qk %.2f  warm %6.2f ns/row  x%.2f of %s  "
					       "int8/bf16 %.2f\n",
					       cs[c].name, var[v]->name, dtype, cs[c].G, cs[c].m, ms, ns, gbps,
					       qk, warm, vs_avx2, var[0]->name, i8);
			}
	free(t);
	free(cs[0].idx);
	kvd_mem_free(x->r8, x->n * D);
	kvd_mem_free(x->r16, x->n * D * 2);
	free(x);
	bench_sweep_free(sw);
	kvd_pool_destroy(pool);
	return 0;
}
