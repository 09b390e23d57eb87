#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "err.h"
#include "pool.h"
#include "prep.h"

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct prep_job {
	const struct kvd_geom *g;
	const float *W, *k, *v;
	float *mean;
	uint32_t n, lo, hi, seg_tokens, nseg;
	uint16_t *kb, *vb, *codes;      /* one segment's worth, all heads */
	uint32_t seg;                   /* the segment being prepared */
	_Atomic int err;
};

void kvd_prep_mean(const float *k, uint32_t H, uint32_t d, uint32_t n, uint32_t lo,
		   uint32_t hi, float *mean)
{
	/* double: n can be 10^5 rows of |k| ~ 30 */
	for (uint32_t h = 0; h < H; h++) {
		double acc[KVD_DMAX] = { 0 };

		for (uint32_t t = lo; t < hi; t++) {
			const float *x = k + ((size_t)h * n + t) * d;

			for (uint32_t e = 0; e < d; e++)
				acc[e] += x[e];
		}
		for (uint32_t e = 0; e < d; e++)
			mean[(size_t)h * d + e] = hi > lo ? (float)(acc[e] / (hi - lo)) : 0.0f;
	}
}

static void mean_task(void *arg, uint32_t h, unsigned worker)
{
	struct prep_job *j = arg;
	uint32_t d = j->g->d;

	kvd_prep_mean(j->k + (size_t)h * j->n * d, 1, d, j->n, j->lo, j->hi, j->mean + (size_t)h * d);
}

void kvd_prep_rows(const struct kvd_geom *g, const float *W, const float *mean,
		   const float *k, const float *v, uint32_t n, uint32_t t0, uint32_t cnt,
		   uint16_t *kb, uint16_t *vb, uint16_t *codes, float *x)
{
	uint32_t d = g->d, L = g->L;

	for (uint32_t h = 0; h < g->kv_heads; h++) {
		const float *m = mean + (size_t)h * d;
		uint16_t *kh = kb + (size_t)h * cnt * d, *vh = vb + (size_t)h * cnt * d;

		for (uint32_t i = 0; i < cnt; i++) {
			const float *kr = k + ((size_t)h * n + t0 + i) * d;
			const float *vr = v + ((size_t)h * n + t0 + i) * d;

			for (uint32_t e = 0; e < d; e++) {
				kh[(size_t)i * d + e] = kvd_f32_to_bf16(kr[e] - m[e]);
				/* Hash exactly the stored key, so its probability is
				 * computed from the same vector that was hashed. */
				x[(size_t)i * d + e] = kvd_bf16_to_f32(kh[(size_t)i * d + e]);
				vh[(size_t)i * d + e] = kvd_f32_to_bf16(vr[e]);
			}
		}
		kvd_lsh_hash(W, (int)d, (int)g->K, (int)L, x, d, cnt, codes + (size_t)h * L * cnt, cnt);
	}
}

/* Task h: center, round and hash kv head h of segment j->seg. */
static void seg_task(void *arg, uint32_t h, unsigned worker)
{
	struct prep_job *j = arg;
	struct kvd_geom g1 = *j->g;
	uint32_t d = g1.d, L = g1.L;
	uint32_t t0 = j->lo + j->seg * j->seg_tokens;
	uint32_t cnt = j->hi - t0 < j->seg_tokens ? j->hi - t0 : j->seg_tokens;
	float *x = malloc((size_t)cnt * d * sizeof *x);

	if (!x) {
		atomic_store(&j->err, -ENOMEM);
		return;
	}
	g1.kv_heads = 1;
	kvd_prep_rows(&g1, j->W, j->mean + (size_t)h * d, j->k + (size_t)h * j->n * d,
		      j->v + (size_t)h * j->n * d, j->n, t0, cnt, j->kb + (size_t)h * cnt * d,
		      j->vb + (size_t)h * cnt * d, j->codes + (size_t)h * L * cnt, x);
	free(x);
}

static void run(struct kvd_pool *pool, uint32_t n, kvd_pool_fn fn, void *arg)
{
	if (pool) {
		kvd_pool_run(pool, n, fn, arg);
		return;
	}
	for (uint32_t i = 0; i < n; i++)
		fn(arg, i, 0);
}

int kvd_prep_layer(struct kvd_prep *p, const struct kvd_geom *g, const float *W,
		   const float *k, const float *v, uint32_t n, uint32_t lo, uint32_t hi,
		   uint32_t seg_tokens, struct kvd_pool *pool)
{
	int rc = kvd_geom_check(g);

	memset(p, 0, sizeof *p);
	if (rc)
		return rc;
	if (lo >= hi || hi > n || seg_tokens < 1 || seg_tokens > KVD_SEG_MAX)
		return -KVD_EGEOM;
	p->g = *g;
	p->lo = lo;
	p->hi = hi;
	p->nseg = (hi - lo + seg_tokens - 1) / seg_tokens;
	p->mean = malloc((size_t)g->kv_heads * g->d * sizeof *p->mean);
	p->seg = calloc(p->nseg, sizeof *p->seg);

	uint32_t cap = hi - lo < seg_tokens ? hi - lo : seg_tokens;
	struct prep_job j = {
		.g = g, .W = W, .k = k, .v = v, .mean = p->mean, .n = n, .lo = lo, .hi = hi,
		.seg_tokens = seg_tokens, .nseg = p->nseg,
		.kb = malloc((size_t)g->kv_heads * cap * g->d * sizeof(uint16_t)),
		.vb = malloc((size_t)g->kv_heads * cap * g->d * sizeof(uint16_t)),
		.codes = malloc((size_t)g->kv_heads * g->L * cap * sizeof(uint16_t)),
	};

	rc = -ENOMEM;
	if (!p->mean || !p->seg || !j.kb || !j.vb || !j.codes)
		goto out;
	run(pool, g->kv_heads, mean_task, &j);
	for (uint32_t s = 0; s < p->nseg; s++) {
		uint32_t t0 = lo + s * seg_tokens;
		uint32_t cnt = hi - t0 < seg_tokens ? hi - t0 : seg_tokens;
		double t = now_ms();

		j.seg = s;
		run(pool, g->kv_heads, seg_task, &j);
		rc = atomic_load(&j.err);
		if (rc)
			goto out;
		p->hash_ms += now_ms() - t;
		t = now_ms();
		rc = kvd_seg_build(g, cnt, j.kb, j.vb, j.codes, pool, &p->seg[s]);
		if (rc)
			goto out;
		p->build_ms += now_ms() - t;
		p->tables_ms += p->seg[s]->tables_ms;
	}
	rc = 0;
out:
	free(j.kb);
	free(j.vb);
	free(j.codes);
	if (rc)
		kvd_prep_free(p);
	return rc;
}

void kvd_prep_free(struct kvd_prep *p)
{
	for (uint32_t s = 0; p->seg && s < p->nseg; s++)
		kvd_seg_free(p->seg[s]);
	free(p->seg);
	free(p->mean);
	memset(p, 0, sizeof *p);
}

void kvd_prep_query_codes(const struct kvd_geom *g, const float *W, const float *q,
			  uint16_t *qc)
{
	uint32_t H = g->q_heads, L = g->L;
	uint16_t *codes = malloc((size_t)H * L * sizeof *codes);

	if (!codes) {           /* one head at a time: slower */
		for (uint32_t h = 0; h < H; h++)
			kvd_lsh_hash(W, (int)g->d, (int)g->K, (int)L, q + (size_t)h * g->d, g->d, 1,
				     qc + (size_t)h * L, 1);
		return;
	}
	/* One call over all heads keeps the hash kernel's lanes full (~3x
	 * faster than one head at a time); its output is table-major, so
	 * transpose to [head][table]. */
	kvd_lsh_hash(W, (int)g->d, (int)g->K, (int)L, q, g->d, H, codes, H);
	for (uint32_t t = 0; t < L; t++)
		for (uint32_t h = 0; h < H; h++)
			qc[(size_t)h * L + t] = codes[(size_t)t * H + h];
	free(codes);
}

struct kvd_layer_view kvd_prep_view(const struct kvd_prep *p)
{
	return (struct kvd_layer_view){
		.seg = (const struct kvd_seg *const *)p->seg, .nseg = p->nseg,
	};
}
