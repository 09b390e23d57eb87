/* kvbench lsh: what retrieval costs next to the rest of a sampled layer, on
 * one core, cold, bf16 and int8 segments of the same keys in the same run.
 *
 * One segment of --ctx tokens (synthetic layer, 32 q / 8 kv heads, d = 128,
 * K10 L150 c = 2) per workload.  Each rep, after a sweep of the caches
 * (bench_sweep): the candidate walk (kvd_lsh_candidates) of all 32 q heads;
 * then, after another sweep, the whole per-segment sampled attention
 * (kvd_attn_sampled: the same walk, the kernels, correction, softmax) of the
 * 8 kv heads, bf16 and then int8; then the walk once more at once (warm:
 * the 32 heads' buckets come from L2 or L3); then each head's walk right
 * after an untimed one of the same head (hot: its buckets and offsets in L1
 * or L2), which leaves the walk's own instructions.
 * Medians of --reps.  The walk is the same work for both dtypes, so its
 * share of the sampled time bounds what fewer bytes a row can buy:
 * `int8_vs_bf16_no_walk` is the ratio with the walk taken out of both.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/attn.h"
#include "bench.h"
#include "engine/kern.h"
#include "engine/lsh.h"
#include "engine/pool.h"
#include "engine/prep.h"
#include "engine/synth.h"

#define QH 32
#define KVH 8
#define D 128
#define LK 10
#define LL 150

struct lsh_run {
	struct kvd_geom g;
	struct kvd_prep p[2];           /* bf16, int8 */
	uint16_t qc[QH * LL];
	const float *q;
	struct kvd_lsh_scratch ls;
	struct kvd_attn_scratch as;
	struct kvd_logp_tab *tab;
	uint16_t *out;
	uint64_t ids, cand;
};

static double walk(struct lsh_run *r, int count, int hot)
{
	double t = bench_now_ms(), untimed = 0.0;

	for (int qh = 0; qh < QH; qh++) {
		const struct kvd_lsh_tables *tb = &r->p[0].seg[0]->h[qh / (QH / KVH)].tab;

		if (hot) {
			double t0 = bench_now_ms();

			(void)kvd_lsh_candidates(tb, r->qc + qh * LL, 2, &r->ls, r->out);
			untimed += bench_now_ms() - t0;
		}

		uint32_t m = kvd_lsh_candidates(tb, r->qc + qh * LL, 2, &r->ls, r->out);

		if (count) {
			r->cand += m;
			for (uint32_t i = 0; i < LL; i++) {
				const uint16_t *ids;

				r->ids += kvd_lsh_bucket(tb, i, r->qc[qh * LL + i] & ((1u << LK) - 1), &ids);
			}
		}
	}
	return bench_now_ms() - t - untimed;
}

static double sampled(struct lsh_run *r, int dt)
{
	const struct kvd_kern *kk = kvd_kern_get();
	float o[QH / KVH * D], lse[QH / KVH];
	double t = bench_now_ms();

	for (uint32_t h = 0; h < KVH; h++)
		kvd_attn_sampled(kk, &r->g, r->tab, r->p[dt].seg[0], h, r->q + h * (QH / KVH) * D,
				 r->qc + h * (QH / KVH) * LL, &r->as, o, lse, NULL);
	return bench_now_ms() - t;
}

int bench_lsh_main(int argc, char **argv)
{
	uint32_t n = 32768, reps = 9;
	int json = 0;
	struct kvd_pool *pool;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--json"))
			json = 1;
		else if (!strcmp(argv[i], "--ctx") && i + 1 < argc &&
			 !bench_parse_u32(argv[i + 1], &n) && n >= 2048 && n <= KVD_SEG_MAX)
			i++;
		else if (!strcmp(argv[i], "--reps") && i + 1 < argc &&
			 !bench_parse_u32(argv[i + 1], &reps))
			i++;
		else {
			fprintf(stderr, "usage: kvbench lsh [--json] [--ctx 2048..65536] [--reps N]\n");
			return 2;
		}
	}
	if (kvd_pool_create(0, 1, &pool))
		return 1;

	struct bench_sweep *sw = bench_sweep_new(bench_llc_bytes());
	float *W = malloc(sizeof(float) * D * LK * LL);
	struct lsh_run *r = calloc(1, sizeof *r);
	double *t = malloc(sizeof(double) * 5 * reps);

	if (!sw || !W || !r || !t || kvd_lsh_scratch_init(&r->ls, n) ||
	    kvd_attn_scratch_init(&r->as, n) || !(r->tab = malloc(sizeof *r->tab)) ||
	    !(r->out = malloc(sizeof(uint16_t) * n))) {
		fprintf(stderr, "kvbench lsh: out of memory\n");
		return 1;
	}
	kvd_lsh_make_w(1, D, LK, LL, W);
	kvd_logp_tab_init(r->tab, LK, LL, 2);
	if (!json)
		printf("kvbench lsh: %s, one core, cold, %u tokens, K%d L%d, %u reps (median)\n",
		       bench_cpu_name(), n, LK, LL, reps);
	for (int wl = 0; wl < KVD_WL_COUNT; wl++) {
		struct kvd_synth w;

		if (kvd_synth_make(&w, (enum kvd_wl)wl, n, QH, KVH, D, 1)) {
			fprintf(stderr, "kvbench lsh: cannot make %s\n", kvd_wl_name((enum kvd_wl)wl));
			return 1;
		}
		for (int dt = 0; dt < 2; dt++) {
			r->g = (struct kvd_geom){ .q_heads = QH, .kv_heads = KVH, .d = D, .K = LK,
						  .L = LL, .c = 2, .kv_dtype = (uint32_t)dt };
			if (kvd_prep_layer(&r->p[dt], &r->g, W, w.k, w.v, n, 0, n, n, pool)) {
				fprintf(stderr, "kvbench lsh: cannot build the segment\n");
				return 1;
			}
		}
		r->q = w.q;
		kvd_prep_query_codes(&r->g, W, w.q, r->qc);
		r->ids = r->cand = 0;
		walk(r, 1, 0);
		for (uint32_t k = 0; k < reps; k++) {
			bench_sweep(pool, sw);
			t[k] = walk(r, 0, 0);
			for (int dt = 0; dt < 2; dt++) {
				bench_sweep(pool, sw);
				t[(1 + dt) * reps + k] = sampled(r, dt);
			}
			t[3 * reps + k] = walk(r, 0, 0);
			t[4 * reps + k] = walk(r, 0, 1);
		}

		double cold = bench_median(t, (int)reps), warm = bench_median(t + 3 * reps, (int)reps);
		double hot = bench_median(t + 4 * reps, (int)reps);
		double sb = bench_median(t + reps, (int)reps), si = bench_median(t + 2 * reps, (int)reps);
		double ids = (double)r->ids / QH, cand = (double)r->cand / QH;
		const char *name = kvd_wl_name((enum kvd_wl)wl);

		if (json)
			printf("{\"bench\":\"lsh\",\"cpu\":\"%s\",\"isa\":\"%s\",\"workload\":\"%s\","
			       "\"tokens\":%u,\"K\":%d,\"L\":%d,\"reps\":%u,\"ids_per_call\":%.0f,"
			       "\"cand_per_call\":%.0f,\"walk_us\":%.2f,\"walk_warm_us\":%.2f,"
			       "\"walk_hot_us\":%.2f,\"walk_ns_per_id\":%.2f,\"walk_hot_ns_per_id\":%.2f,"
			       "\"sampled_bf16_us\":%.2f,\"sampled_int8_us\":%.2f,"
			       "\"walk_share_bf16\":%.3f,\"walk_share_int8\":%.3f,\"int8_vs_bf16\":%.3f,"
			       "\"int8_vs_bf16_no_walk\":%.3f}\n",
			       bench_cpu_name(), kvd_kern_get()->name, name, n, LK, LL, reps, ids, cand,
			       cold * 1e3 / QH, warm * 1e3 / QH, hot * 1e3 / QH,
			       cold * 1e6 / (ids * QH), hot * 1e6 / (ids * QH), sb * 1e3 / QH,
			       si * 1e3 / QH, cold / sb, cold / si, si / sb, (si - cold) / (sb - cold));
		else
			printf("  %-6s %5.0f ids %5.0f cand per q head: walk %6.2f us (warm %6.2f, "
			       "hot %6.2f; %.2f ns/id, hot %.2f); sampled bf16 %6.2f us, int8 %6.2f us; "
			       "walk share %.2f / %.2f; int8/bf16 %.3f, without the walk %.3f\n",
			       name, ids, cand, cold * 1e3 / QH, warm * 1e3 / QH, hot * 1e3 / QH,
			       cold * 1e6 / (ids * QH), hot * 1e6 / (ids * QH), sb * 1e3 / QH,
			       si * 1e3 / QH, cold / sb, cold / si, si / sb, (si - cold) / (sb - cold));
		for (int dt = 0; dt < 2; dt++)
			kvd_prep_free(&r->p[dt]);
		kvd_synth_free(&w);
	}
	kvd_lsh_scratch_free(&r->ls);
	kvd_attn_scratch_free(&r->as);
	free(r->tab);
	free(r->out);
	free(r);
	free(t);
	free(W);
	bench_sweep_free(sw);
	kvd_pool_destroy(pool);
	return 0;
}
