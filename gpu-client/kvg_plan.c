/* kvg_plan: see kvg_plan.h. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/bf16.h"
#include "kvc.h"
#include "kvg_plan.h"

static uint32_t div_up(uint64_t a, uint64_t b)
{
	return (uint32_t)((a + b - 1) / b);
}

void kvg_attn_plan(uint32_t max_rows, uint32_t nseq, uint32_t kv_heads, uint32_t q_heads,
		   uint32_t d, uint32_t target_blocks, struct kvg_attn_plan *p)
{
	uint64_t pairs = (uint64_t)(nseq ? nseq : 1) * (kv_heads ? kv_heads : 1);
	uint32_t want = (uint32_t)((target_blocks + pairs - 1) / pairs);
	uint32_t by_rows = div_up(max_rows ? max_rows : 1, KVG_SPLIT_MIN_ROWS);
	uint32_t ns = want < by_rows ? want : by_rows;

	if (ns > KVG_SPLIT_MAX)
		ns = KVG_SPLIT_MAX;
	if (ns < 1)
		ns = 1;
	/* Whole tiles per split; recount so no split is empty by construction. */
	p->chunk = div_up(div_up(max_rows ? max_rows : 1, ns), KVG_TILE) * KVG_TILE;
	p->nsplit = div_up(max_rows ? max_rows : 1, p->chunk);
	p->part_floats = p->nsplit > 1 ? (size_t)nseq * q_heads * p->nsplit * (d + 1) : 0;
}

void kvg_pack_ref(const float *y, uint32_t R, uint32_t K, uint32_t L,
		  const struct kvg_code_layout *lay, uint16_t *codes)
{
	for (uint32_t r = 0; r < R; r++) {
		const float *yr = y + (size_t)r * K * L;

		for (uint32_t t = 0; t < L; t++) {
			unsigned code = 0;

			for (uint32_t j = 0; j < K; j++)
				code |= (unsigned)(yr[t * K + j] > 0.0f) << j;
			codes[(size_t)(r / lay->per) * lay->sg + (size_t)t * lay->st +
			      (size_t)(r % lay->per) * lay->sr] = (uint16_t)code;
		}
	}
}

void kvg_attn_ref(const float *q, uint32_t G, uint32_t d, const struct kvg_rows *r,
		  uint32_t h, double *o, double *lse)
{
	uint32_t n = kvg_rows_n(r);
	double scale = 1.0 / sqrt((double)d);

	for (uint32_t g = 0; g < G; g++) {
		const float *qg = q + (size_t)g * d;
		double mx = -INFINITY, sum = 0.0;
		double *og = o + (size_t)g * d;

		memset(og, 0, d * sizeof *og);
		/* two passes: the max first, so nothing overflows or is rescaled */
		for (uint32_t i = 0; i < n; i++) {
			const uint16_t *kr = r->k + ((size_t)h * r->cap + kvg_rows_at(r, i)) * d;
			double s = 0.0;

			for (uint32_t e = 0; e < d; e++)
				s += (double)qg[e] * kvd_bf16_to_f32(kr[e]);
			s *= scale;
			mx = s > mx ? s : mx;
		}
		if (n == 0) {
			lse[g] = -INFINITY;
			continue;
		}
		for (uint32_t i = 0; i < n; i++) {
			uint32_t at = kvg_rows_at(r, i);
			const uint16_t *kr = r->k + ((size_t)h * r->cap + at) * d;
			const uint16_t *vr = r->v + ((size_t)h * r->cap + at) * d;
			double s = 0.0, w;

			for (uint32_t e = 0; e < d; e++)
				s += (double)qg[e] * kvd_bf16_to_f32(kr[e]);
			w = exp(s * scale - mx);
			sum += w;
			for (uint32_t e = 0; e < d; e++)
				og[e] += w * kvd_bf16_to_f32(vr[e]);
		}
		for (uint32_t e = 0; e < d; e++)
			og[e] /= sum;
		lse[g] = mx + log(sum);
	}
}

void kvg_merge_ref(double *o, double *lse, const float *o2, const float *lse2, uint32_t G,
		   uint32_t d)
{
	for (uint32_t g = 0; g < G; g++) {
		double a = lse[g], b = lse2[g], mx, wa, wb;

		if (b == -INFINITY)
			continue;
		if (a == -INFINITY) {
			for (uint32_t e = 0; e < d; e++)
				o[(size_t)g * d + e] = o2[(size_t)g * d + e];
			lse[g] = b;
			continue;
		}
		mx = a > b ? a : b;
		wa = exp(a - mx);
		wb = exp(b - mx);
		for (uint32_t e = 0; e < d; e++)
			o[(size_t)g * d + e] = (wa * o[(size_t)g * d + e] + wb * o2[(size_t)g * d + e]) /
					       (wa + wb);
		lse[g] = mx + log(wa + wb);
	}
}

int kvg_backend_wanted(const struct kvc_opts *o, const char *env, char *msg, size_t len)
{
	int want = o ? o->backend : KVC_BACKEND_CPU;

	if (want != KVC_BACKEND_CPU && want != KVC_BACKEND_CUDA && want != KVC_BACKEND_AUTO) {
		snprintf(msg, len, "unknown backend %d", want);
		return -EINVAL;
	}
	if (want != KVC_BACKEND_AUTO || !env || !*env)
		return want;
	if (!strcmp(env, "cpu"))
		return KVC_BACKEND_CPU;
	if (!strcmp(env, "cuda"))
		return KVC_BACKEND_CUDA;
	if (!strcmp(env, "auto"))
		return KVC_BACKEND_AUTO;
	snprintf(msg, len, "KVC_BACKEND=%s: not cpu, cuda or auto", env);
	return -EINVAL;
}
