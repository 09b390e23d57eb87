/* Attention over a layer's segments and tail: see attn.h.  Segments
 * themselves are engine/seg.c's. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>

#include "attn.h"
#include "rng.h"
#include "err.h"
#include "pool.h"

#define ALIGN64(x) (((x) + 63) & ~(size_t)63)

/* ---- estimators --------------------------------------------------------- */

static const char *const est_names[] = {
	[KVD_EST_MAGICPIG] = "magicpig", [KVD_EST_HYBRID] = "hybrid",
	[KVD_EST_ADAPTIVE] = "adaptive", [KVD_EST_HYBRID_CV] = "hybrid_cv",
	[KVD_EST_HYBRID_LCV] = "hybrid_lcv",
};

const char *kvd_estimator_name(uint32_t est)
{
	return est <= KVD_EST_MAX ? est_names[est] : NULL;
}

int kvd_estimator_parse(const char *s, uint32_t *out)
{
	for (uint32_t i = 0; i <= KVD_EST_MAX; i++)
		if (strcmp(s, est_names[i]) == 0) {
			*out = i;
			return 0;
		}
	return -EINVAL;
}

size_t kvd_heavy_words(const struct kvd_geom *g)
{
	return (size_t)g->q_heads * (1 + KVD_HEAVY_MAX);
}

/* ---- scratch ----------------------------------------------------------- */

int kvd_attn_scratch_init(struct kvd_attn_scratch *s, uint32_t cap)
{
	memset(s, 0, sizeof *s);
	if (cap < 1 || cap > KVD_SEG_MAX)
		return -EINVAL;
	s->cap = cap;
	s->cand = malloc(cap * sizeof *s->cand);
	s->rows = malloc(cap * sizeof *s->rows);
	s->kinv = malloc(cap * sizeof *s->kinv);
	s->vsc = malloc(cap * sizeof *s->vsc);
	s->w16 = malloc(cap * sizeof *s->w16);
	s->t = malloc(2 * (size_t)cap * sizeof *s->t);
	/* One q head's scores at a time; dense attention reuses s in blocks of
	 * DENSE_BLOCK rows for the G heads of a group. */
	s->s = aligned_alloc(64, ALIGN64((size_t)(cap > KVD_ATTN_DENSE_SCRATCH ?
						  cap : KVD_ATTN_DENSE_SCRATCH) * sizeof(float)));
	if (!s->cand || !s->rows || !s->kinv || !s->vsc || !s->w16 || !s->t || !s->s ||
	    kvd_lsh_scratch_init(&s->lsh, cap)) {
		kvd_attn_scratch_free(s);
		return -ENOMEM;
	}
	return 0;
}

void kvd_attn_scratch_free(struct kvd_attn_scratch *s)
{
	kvd_lsh_scratch_free(&s->lsh);
	free(s->cand);
	free(s->rows);
	free(s->kinv);
	free(s->vsc);
	free(s->w16);
	free(s->t);
	free(s->s);
	free(s->job);
	memset(s, 0, sizeof *s);
}

/* ---- sampled attention over one segment-head ---------------------------- */

static void empty_result(int G, int d, float *o, float *lse)
{
	memset(o, 0, (size_t)G * d * sizeof(float));
	for (int g = 0; g < G; g++)
		lse[g] = -INFINITY;
}

/* The heavy keys of one segment-head for the G q heads of its group: ids
 * (segment << 16 | row, rows ascending and distinct) and how many per q
 * head. */
struct heavy_in {
	const uint32_t *id[KVD_GMAX];           /* packed (segment << 16 | row) */
	uint32_t n[KVD_GMAX];
	uint8_t lo[KVD_GMAX];                   /* hybrid_lcv: the reduced budget */
	uint32_t seg;
};

/* What a (segment, kv head) pair reports for the next step's heavy lists:
 * per q head gi of the group, the KVD_HEAVY_MAX rows with the largest exact
 * score among those it gathered, s[gi * KVD_HEAVY_MAX + k] and id[...]
 * (packed segment << 16 | row), n[gi] of them.  Each head's slot is written
 * by the one task that attends it. */
struct heavy_top {
	float *s;
	uint32_t *id;
	uint32_t *n;
};

/* Keep the k largest (s, id) in a min-heap on s (ties: the larger id is the
 * smaller entry, so equal scores keep the lowest ids whatever the order of
 * insertion). */
static int top_less(float a, uint32_t ia, float b, uint32_t ib)
{
	return a < b || (a == b && ia > ib);
}

static void top_push(float *hs, uint32_t *hid, uint32_t *n, uint32_t k, float s, uint32_t id)
{
	uint32_t i;

	if (!(s == s))                          /* NaN never becomes heavy */
		return;
	if (*n < k) {
		i = (*n)++;
		while (i > 0 && top_less(s, id, hs[(i - 1) / 2], hid[(i - 1) / 2])) {
			hs[i] = hs[(i - 1) / 2];
			hid[i] = hid[(i - 1) / 2];
			i = (i - 1) / 2;
		}
		hs[i] = s;
		hid[i] = id;
		return;
	}
	if (!top_less(hs[0], hid[0], s, id))
		return;
	i = 0;
	for (;;) {
		uint32_t l = 2 * i + 1, r = l + 1, m = i;
		float ms = s;
		uint32_t mid = id;

		if (l < k && top_less(hs[l], hid[l], ms, mid))
			m = l, ms = hs[l], mid = hid[l];
		if (r < k && top_less(hs[r], hid[r], ms, mid))
			m = r;
		if (m == i)
			break;
		hs[i] = hs[m];
		hid[i] = hid[m];
		i = m;
	}
	hs[i] = s;
	hid[i] = id;
}

/* A sampled row's 1/|k| (and int8's kfac and vscale) is a random read as
 * its K and V rows are.  rows_consts reads them once, after the scores, into
 * kinv, (int8) vsc and the scores sc, prefetching
 * CONSTS_AHEAD rows ahead: both ends of a row's 12 bytes, as 2 rows in 16
 * straddle two lines and the second was a miss in the loop (1-4 % of a
 * default layer call, MEASUREMENTS.md, "Roulette, and where a default
 * layer call's time goes").  Prefetching every row's line as soon as the row
 * list existed, as this did before, issued ~500 prefetches at once, and the
 * int8 loop after the kernels still stalled on a miss a row (the lines had
 * not come, or the rows' own lines had pushed them out); a window ahead of
 * the reads took int8's qk8 + pv8 + consts from 0.67 to 0.58 of bf16's
 * qk + pv + consts (Zen 4, kvbench lsh, perf samples).  Even so this loop,
 * a load a row and little else, waited on its misses: half of sampled()'s
 * own time on mixed.  int8 rows now have qk8 prefetch their constants
 * beside the K rows (its side hint), whose misses they overlap; the window
 * here stays for bf16's kinv and as a second chance. */
#define CONSTS_AHEAD 32

static void rows_consts(const struct kvd_seg *seg, const struct kvd_seg_head *sh,
			const uint32_t *rows, uint32_t m, float *sc, float *kinv, float *vsc)
{
	if (seg->kv_dtype != KVD_KV_INT8) {
		for (uint32_t i = 0; i < m; i++) {
			if (i + CONSTS_AHEAD < m)
				__builtin_prefetch(&sh->kinv[rows[i + CONSTS_AHEAD]]);
			kinv[i] = sh->kinv[rows[i]];
		}
		return;
	}
	for (uint32_t i = 0; i < m; i++) {
		const struct kvd_row8 *r = &sh->r8[rows[i]];

		if (i + CONSTS_AHEAD < m) {
			const struct kvd_row8 *a = &sh->r8[rows[i + CONSTS_AHEAD]];

			__builtin_prefetch(a);
			__builtin_prefetch(&a->vscale);
		}
		kinv[i] = r->kinv;
		vsc[i] = r->vscale;
		sc[i] *= r->kfac;
	}
}

/* Roulette (attn.h): a weight below tau is worth less than a quarter of
 * the mean, and its V row two random lines.  The loop has no branch on the
 * weights (which are in no order); u is compared as a 24-bit fraction of
 * tau, which loses nothing a float weight holds. */
uint32_t kvd_attn_roulette(float *w, uint32_t *rows, float *aux, uint32_t m, uint64_t seed)
{
	float sa = 0.0f;

	for (uint32_t i = 0; i < m; i++)
		sa += fabsf(w[i]);
	if (!(sa > 0.0f) || sa > FLT_MAX)
		return m;

	const float tau = KVD_RR_SHARE * sa / (float)m, ut = tau * 0x1p-24f;
	uint32_t k = 0;

	for (uint32_t i = 0; i < m; i++) {
		float x = w[i], a = fabsf(x);
		uint32_t r = rows[i];
		float u = (float)(uint32_t)(kvd_rng_bits_at(seed, r) >> 40) * ut;
		int big = a >= tau;

		w[k] = big ? x : copysignf(tau, x);
		rows[k] = r;
		if (aux)
			aux[k] = aux[i];
		k += (uint32_t)(big | (u < a));
	}
	return k;
}

uint64_t kvd_attn_rr_seed(const float *q, const uint16_t *qc, uint32_t nc, uint32_t seg)
{
	uint64_t z = kvd_mix64(seg + KVD_RNG_GOLDEN);

	for (int e = 0; e < 8; e++) {
		uint32_t b;

		memcpy(&b, &q[e], sizeof b);
		z = kvd_mix64(z ^ b);
	}
	for (uint32_t t = 0; t < nc && t < 4; t++)
		z = kvd_mix64(z ^ qc[t]);
	return z;
}

/* og <- the sum over the m rows of weight sc[i] times V row rows[i] (og is
 * zero; int8 overwrites sc with the weights times the rows' vscale). */
static void weighted_v(const struct kvd_kern *kk, const struct kvd_seg *seg,
		       const struct kvd_seg_head *sh, int d, float *sc, const uint32_t *rows,
		       const float *vsc, uint32_t m, int16_t *w16, float *og)
{
	if (seg->kv_dtype == KVD_KV_INT8) {
		float wsc;

		for (uint32_t i = 0; i < m; i++)
			sc[i] *= vsc[i];
		kvd_q16(sc, 1, (int)m, w16, &wsc);
		kk->pv8(w16, m, &wsc, 1, d, sh->v8, rows, m, og);
	} else {
		kk->pv(sc, m, 1, d, sh->v, rows, m, og);
	}
}

/* softmax_v's end, once the weights exp(sc - mx) summing to sum are in sc:
 * also the control variates' where they fall back to none, so that those
 * answer its bits. */
static float plain_v(const struct kvd_kern *kk, const struct kvd_seg *seg,
		     const struct kvd_seg_head *sh, int d, float *sc, const uint32_t *rows,
		     const float *vsc, uint32_t m, int16_t *w16, float *og, float mx, float sum)
{
	float r = sum > 0.0f ? 1.0f / sum : 0.0f;

	weighted_v(kk, seg, sh, d, sc, rows, vsc, m, w16, og);
	for (int e = 0; e < d; e++)
		og[e] *= r;
	return mx + logf(sum);
}

/* One q head's softmax over the m corrected scores sc of rows (overwritten
 * with weights) and the weighted sum of their V rows into og, which is
 * zero; returns the lse, or -inf when no score is above -inf.  int8: vsc
 * holds the rows' vscale as rows_consts read it (reading r8 here again
 * was a second random pass, ~4 % of a sampled int8 head). */
static float softmax_v(const struct kvd_kern *kk, const struct kvd_seg *seg,
		       const struct kvd_seg_head *sh, int d, float *sc, const uint32_t *rows,
		       const float *vsc, uint32_t m, int16_t *w16, float *og)
{
	float mx = kk->max(sc, m);

	if (mx == -INFINITY)
		return -INFINITY;
	return plain_v(kk, seg, sh, d, sc, rows, vsc, m, w16, og, mx, kk->expsum(sc, m, mx));
}

/* softmax_v with the control variate (hybrid_cv).  t holds each row's raw
 * score (sc before the sampling correction; the two are equal for heavy
 * rows).  With a_i = exp(sc_i - mx) = e_i / P_i and 1/P_i = exp(sc_i -
 * t_i), the segment-head's mass and V sum are estimated as
 *   Z = c n + sum_i (a_i - c / P_i),  N = c vsum + sum_i (a_i - c / P_i) v_i
 * over its n rows, the sum over the rows attended: every row's weight e_i
 * is replaced by the constant c where it is summed exactly, and only the
 * differences are sampled (heavy rows, P = 1, give e_i - c exactly).  For
 * a fixed c both are unbiased; the c that minimizes the variance of Z,
 * sum (e_i - c)^2 (1 - P_i) / P_i, is sum e_i (1 - P_i) / P_i over
 * sum (1 - P_i) / P_i, estimated here from the rows themselves with a
 * further 1/P_i (heavy rows weigh 0 in it).  Where Z would not be a
 * positive number c is 0: hybrid's estimate, bit for bit. */
static float softmax_v_cv(const struct kvd_kern *kk, const struct kvd_seg *seg,
			  const struct kvd_seg_head *sh, int d, float *sc, float *t,
			  const uint32_t *rows, const float *vsc, uint32_t m, int16_t *w16,
			  float *og)
{
	float mx = kk->max(sc, m), sum, ips, c = 0.0f;
	double num = 0.0, den = 0.0, z;

	if (mx == -INFINITY)
		return -INFINITY;
	for (uint32_t i = 0; i < m; i++)
		t[i] = sc[i] - t[i];                    /* -ln P_i, in [0, 80] */
	sum = kk->expsum(sc, m, mx);
	/* 1/P_i by the softmax's own vector exp (exact 1 at 0, so a heavy row
	 * weighs nothing below): a libm exp per row cost as much as the
	 * row's scoring. */
	ips = kk->expsum(t, m, 0.0f);
	for (uint32_t i = 0; i < m; i++) {
		double ip = t[i];

		num += (ip - 1.0) * sc[i];              /* (1/P - 1) e/P (e/P = a) */
		den += ip * (ip - 1.0);                 /* (1/P - 1) / P */
	}
	if (den > 0.0)
		c = (float)(num / den);
	z = (double)c * seg->n + sum - (double)c * ips;
	if (!(c > 0.0f) || !(z > 0.0) || !(z <= DBL_MAX))
		c = 0.0f;
	if (c == 0.0f)
		return plain_v(kk, seg, sh, d, sc, rows, vsc, m, w16, og, mx, sum);
	for (uint32_t i = 0; i < m; i++)
		sc[i] -= c * t[i];
	weighted_v(kk, seg, sh, d, sc, rows, vsc, m, w16, og);
	for (int e = 0; e < d; e++)
		og[e] = (float)((og[e] + (double)c * sh->vsum[e]) / z);
	return mx + (float)log(z);
}

/* The control variate of hybrid_lcv: linear in the raw score, c_i = alpha +
 * beta (s_i - mu), mu the mean raw score over the segment-head's n rows.
 * Then sum c_i = alpha n and sum c_i v_i = alpha vsum + beta scale C^T q,
 * from the segment's moments (sq = C^T q, C the centered cross moment
 * sum_i (k_i - ksum/n) v_i^T, kept in int8: seg.h), and Z and N are
 * estimated as in softmax_v_cv with c_i in place of c.  For fixed (alpha,
 * beta) both stay unbiased but for C's rounding (a fixed error of at most
 * |beta| scale sum_f |q_f| row_f col_e / 2 in N's entry e); the pair that
 * minimizes the variance of Z,
 * sum (e_i - c_i)^2 (1 - P_i) / P_i, is a weighted least-squares fit of
 * e_i on (1, s_i - mu) with weights (1 - P_i) / P_i, estimated from the
 * attended rows with a further 1/P_i (heavy rows weigh 0).  Where the fit
 * is singular, or leaves Z not a positive number, the constant of
 * softmax_v_cv is used, and where that fails too, none: hybrid's bits.
 * With a control variate, the V sum's weights go through the roulette
 * (seed rr), which packs the kept ones to the front of sc, rows and int8's
 * vsc; *vm gets the V rows read.  x holds s_i - mu (scratch of m floats). */
static float softmax_v_lcv(const struct kvd_kern *kk, const struct kvd_seg *seg,
			   const struct kvd_seg_head *sh, int d, float *sc, float *t, float *x,
			   uint32_t *rows, float *vsc, uint32_t m, int16_t *w16,
			   float *og, const float *sq, float mu, float scale, uint64_t rr,
			   uint32_t *vm)
{
	float *aux = seg->kv_dtype == KVD_KV_INT8 ? vsc : NULL, mx = kk->max(sc, m), sum;
	double s0 = 0, s1 = 0, s2 = 0, b0 = 0, b1 = 0, det, al = 0, be = 0, z = 0;

	*vm = 0;
	if (mx == -INFINITY)
		return -INFINITY;
	for (uint32_t i = 0; i < m; i++) {
		x[i] = t[i] - mu;
		t[i] = sc[i] - t[i];                    /* -ln P_i, in [0, 80] */
	}
	sum = kk->expsum(sc, m, mx);
	(void)kk->expsum(t, m, 0.0f);                  /* 1/P_i */
	for (uint32_t i = 0; i < m; i++) {
		double ip = t[i], w = (ip - 1.0) * ip, e = sc[i] / ip, xi = x[i];

		s0 += w;
		s1 += w * xi;
		s2 += w * xi * xi;
		b0 += w * e;
		b1 += w * e * xi;
	}
	det = s0 * s2 - s1 * s1;
	if (s0 > 0.0 && det > 1e-9 * s0 * s2) {
		al = (b0 * s2 - b1 * s1) / det;
		be = (s0 * b1 - s1 * b0) / det;
	}
	for (int pass = 0; pass < 2; pass++) {
		if (pass || !(al != 0.0 || be != 0.0)) {
			/* the constant, where it is positive */
			al = s0 > 0.0 && b0 > 0.0 ? b0 / s0 : 0.0;
			be = 0.0;
		}
		if (al == 0.0 && be == 0.0)
			break;
		z = al * seg->n + sum;
		for (uint32_t i = 0; i < m; i++)
			z -= (al + be * x[i]) * t[i];
		if (z > 0.0 && z <= DBL_MAX)
			break;
		al = be = 0.0;
	}
	if (al == 0.0 && be == 0.0) {
		*vm = m;
		return plain_v(kk, seg, sh, d, sc, rows, vsc, m, w16, og, mx, sum);
	}
	for (uint32_t i = 0; i < m; i++)
		sc[i] -= (float)((al + be * x[i]) * t[i]);
	*vm = kvd_attn_roulette(sc, rows, aux, m, rr);
	weighted_v(kk, seg, sh, d, sc, rows, vsc, *vm, w16, og);
	for (int e = 0; e < d; e++)
		og[e] = (float)((og[e] + al * sh->vsum[e] + be * (double)scale * sq[e]) / z);
	return mx + (float)log(z);
}

/* The rows one q head attends in a segment: its sample cand[0..nc), ascending
 * as kvd_lsh_candidates leaves it, and its heavy keys hid[0..hn) (segment
 * << 16 | row, rows ascending and distinct as heavy_of leaves them), merged
 * into rows in ascending order.  A heavy key the head also sampled is one
 * row, attended as heavy.  hidx gets the heavy rows' positions in rows, *nh
 * how many; returns the rows' count. */
static uint32_t own_rows(const uint16_t *cand, uint32_t nc, const uint32_t *hid, uint32_t hn,
			 uint32_t *rows, uint32_t *hidx, uint32_t *nh)
{
	uint32_t i = 0, j = 0, m = 0;

	*nh = 0;
	while (j < hn) {
		uint32_t hr = hid[j++] & 0xffff;

		while (i < nc && cand[i] < hr)
			rows[m++] = cand[i++];
		if (i < nc && cand[i] == hr)
			i++;
		hidx[(*nh)++] = m;
		rows[m++] = hr;
	}
	while (i < nc)
		rows[m++] = cand[i++];
	return m;
}

/* cm[c] = max(cm[c], x[c]) for c < KVD_HEAVY_MAX, a NaN in x never taken:
 * in vectors of 4 (the baseline ISA this file is built for). */
_Static_assert(KVD_HEAVY_MAX % 4 == 0, "lane_max takes the lanes 4 at a time");
typedef float top_v __attribute__((vector_size(16)));
typedef int32_t top_m __attribute__((vector_size(16)));

static inline void lane_max(float *cm, const float *x)
{
	for (int c = 0; c < KVD_HEAVY_MAX; c += 4) {
		top_v a, b;
		top_m gt;

		memcpy(&a, cm + c, sizeof a);
		memcpy(&b, x + c, sizeof b);
		gt = b > a;
		a = (top_v)(((top_m)b & gt) | ((top_m)a & ~gt));
		memcpy(cm + c, &a, sizeof a);
	}
}

/* The least of the maxima of KVD_HEAVY_MAX disjoint sets of the n >=
 * KVD_HEAVY_MAX scores s: those are as many distinct entries, so the
 * KVD_HEAVY_MAX-th largest score is at least that.  Set c is the entries i
 * with i mod KVD_HEAVY_MAX = c, so the maxima are lane-wise over whole
 * blocks, without a branch (contiguous chunks, whose ends mispredicted,
 * came before). */
static float lanes_floor(const float *s, uint32_t n)
{
	float cm[KVD_HEAVY_MAX], lo = INFINITY;
	uint32_t i = 0;

	for (uint32_t c = 0; c < KVD_HEAVY_MAX; c++)
		cm[c] = -INFINITY;
	for (; i + KVD_HEAVY_MAX <= n; i += KVD_HEAVY_MAX)
		lane_max(cm, s + i);
	for (; i < n; i++)
		cm[i % KVD_HEAVY_MAX] = s[i] > cm[i % KVD_HEAVY_MAX] ? s[i] : cm[i % KVD_HEAVY_MAX];
	for (uint32_t c = 0; c < KVD_HEAVY_MAX; c++)
		lo = cm[c] < lo ? cm[c] : lo;
	return lo;
}

/* The KVD_HEAVY_MAX largest of n <= 2 * KVD_HEAVY_MAX entries as
 * top_select leaves them: those that fewer than KVD_HEAVY_MAX others beat
 * (ranks under a total order are distinct, so exactly that many), in
 * their order.  n^2 compares without a branch (kern.h, rank): ~2x faster
 * than a heap at 40-64 entries in plain C (Zen 5, random scores), and the
 * AVX-512 kernel took a further ~6 % off a dense default layer call. */
_Static_assert(2 * KVD_HEAVY_MAX <= KVD_KERN_RANK_MAX, "rank_keep ranks 2 lists at once");
static uint32_t rank_keep(const struct kvd_kern *kk, float *s, uint32_t *id, uint32_t n)
{
	uint32_t rk[2 * KVD_HEAVY_MAX], ki[2 * KVD_HEAVY_MAX], c = 0;
	float ks[2 * KVD_HEAVY_MAX];

	kk->rank(s, id, n, rk);
	for (uint32_t i = 0; i < n; i++) {
		ks[c] = s[i];
		ki[c] = id[i];
		c += rk[i] < KVD_HEAVY_MAX;
	}
	memcpy(s, ks, c * sizeof *s);
	memcpy(id, ki, c * sizeof *id);
	return c;
}

/*
 * The KVD_HEAVY_MAX largest of the n entries (s[i], id[i]) under
 * top_less's order (ids distinct, no NaN), left in s[0..) and id[0..) in
 * no order; returns how many: min(n, KVD_HEAVY_MAX).  Entries below
 * lanes_floor() cannot be among them, so each pass keeps only those at or
 * above it (in place, without a branch) and the next pass's floor, over
 * fewer entries, is higher; of the at most 2k left after a few passes,
 * those beaten by fewer than k others are kept (rank_keep), and a heap
 * takes any more.  A heap over every entry mispredicted a branch or two a
 * level on each push: on mixed (~1200 rows a segment and head, 98304
 * tokens) the lists cost as much as the scores.  The set kept is exact
 * whatever the passes do: only entries below the k-th largest score are
 * ever dropped before the end.
 */
static uint32_t top_select(const struct kvd_kern *kk, float *s, uint32_t *id, uint32_t n)
{
	const uint32_t k = KVD_HEAVY_MAX;

	for (int pass = 0; pass < 4 && n > k; pass++) {
		float lo = lanes_floor(s, n);
		uint32_t c = 0;

		for (uint32_t i = 0; i < n; i++) {
			float x = s[i];
			uint32_t y = id[i];

			s[c] = x;
			id[c] = y;
			c += x >= lo;
		}
		if (c == n)
			break;
		n = c;
	}
	if (n <= k)
		return n;
	if (n <= 2 * k)
		return rank_keep(kk, s, id, n);

	float hs[KVD_HEAVY_MAX];
	uint32_t hid[KVD_HEAVY_MAX], hn = 0;

	for (uint32_t i = 0; i < n; i++)
		top_push(hs, hid, &hn, k, s[i], id[i]);
	memcpy(s, hs, hn * sizeof *s);
	memcpy(id, hid, hn * sizeof *id);
	return hn;
}

/* Head gi's KVD_HEAVY_MAX rows of largest exact score among its m scored
 * rows (raw dot products in sc), into top's slot gi.  A row below
 * 2^-KVD_HEAVY_SHARE_LOG2 of the best weight here is below that share of
 * the head's mass too.  The selection runs on dot products (scaled once
 * at the end), so its compares are exact; ties go to the lower row, as
 * top_less orders them.  cs and cid are scratch of m entries. */
static void top_of(const struct kvd_kern *kk, const float *sc, const uint32_t *rows, uint32_t m,
		   uint32_t seg, float scale, struct heavy_top *top, int gi, float *cs,
		   uint32_t *cid)
{
	float *hs = top->s + gi * KVD_HEAVY_MAX;
	uint32_t *hid = top->id + gi * KVD_HEAVY_MAX, c = 0;
	float floor = kk->max(sc, m) - (float)(KVD_HEAVY_SHARE_LOG2 * M_LN2) / scale;

	/* Rows arrive in no order of score: on a sample of 128 rows or more
	 * the lanes' floor turns most of them away before anything else. */
	if (m >= 4 * KVD_HEAVY_MAX) {
		float lo = lanes_floor(sc, m);

		if (lo > floor)
			floor = lo;
	}
	for (uint32_t i = 0; i < m; i++) {
		float x = sc[i];

		cs[c] = x;
		cid[c] = seg << 16 | rows[i];
		c += x > -INFINITY && x >= floor;
	}
	c = top_select(kk, cs, cid, c);
	for (uint32_t k = 0; k < c; k++) {
		hs[k] = cs[k] * scale;
		hid[k] = cid[k];
	}
	top->n[gi] = c;
}

/* hybrid_lcv's moments of a (kv head, segment) pair against q heads of its
 * group: C^T q_g (seg.h: kv, centered) into lm[g*d..] and the mean raw
 * score mu_g = scale q_g . ksum / n into lm[G*d + g], for g0, g0 + gstep,
 * ... < G. */
static void lcv_moments(const struct kvd_kern *kk, const struct kvd_seg *seg, uint32_t h,
			const float *q, uint32_t G, uint32_t d, uint32_t g0, uint32_t gstep,
			float *lm)
{
	const struct kvd_seg_head *sh = &seg->h[h];
	const float scale = 1.0f / sqrtf((float)d);

	if (gstep == 1)
		kk->mv(sh->kv, sh->kv_row, sh->kv_col, (int)d, q, (int)G, lm);
	for (uint32_t gi = g0; gi < G; gi += gstep) {
		double qk = 0.0;

		if (gstep != 1)
			kk->mv(sh->kv, sh->kv_row, sh->kv_col, (int)d, q + (size_t)gi * d, 1,
			       lm + (size_t)gi * d);
		for (uint32_t e = 0; e < d; e++)
			qk += (double)q[(size_t)gi * d + e] * sh->ksum[e];
		lm[G * d + gi] = (float)(scale * qk / seg->n);
	}
}

static size_t lcv_floats(const struct kvd_geom *g)
{
	return (size_t)kvd_geom_group(g) * (g->d + 1);
}

static int is_lcv(const struct kvd_attn_req *r)
{
	return r->est == KVD_EST_HYBRID_LCV && r->heavy && r->tab;
}

/*
 * Where a task finds a pair's moments.  The first task of the pair to start
 * makes them for the whole group (reading kv, d*d bytes, once) into
 * `shared` and marks it ready; a q head needs its own only at the end of
 * its sample, by when they are most often there.  A task that finds them
 * not ready makes its heads' own (a head's product does not depend on the
 * others': kern.h, mv), so no task ever waits on another.  Made in a pool
 * job of their own before the layer's tasks, they cost that job's wait and
 * wake-ups: ~15 % of a dense layer's CPU time (98304 tokens, 2 threads,
 * Zen 5); made by every task, 4x the reads of kv, more still.
 */
struct lcv_src {
	const struct kvd_kern *kk;
	const struct kvd_seg *seg;
	uint32_t h, G, d;
	const float *q;                 /* the group's [G][d] */
	float *shared;                  /* [G * (d + 1)] */
	_Atomic uint32_t *ready;
	float *own;                     /* [G * (d + 1)], this task's */
};

static const float *lcv_of(const struct lcv_src *ls, uint32_t gi)
{
	if (atomic_load_explicit(ls->ready, memory_order_acquire) == 2)
		return ls->shared;
	lcv_moments(ls->kk, ls->seg, ls->h, ls->q, ls->G, ls->d, gi, ls->G, ls->own);
	return ls->own;
}

/* Sampled attention of one segment-head.  Each q head gathers, scores,
 * weighs and sums only its own rows: its sample and, with hv, its heavy
 * keys, attended exactly (weight 1, their raw dot products kept across the
 * sampling correction) and left out of the sampled part; with top, it
 * reports its best rows among those for the next step's list.  A group's
 * samples barely overlap (98k tokens, K10 L150, G = 4: the union holds 3.8
 * heads' worth), so a walk over the union for every head of the group, as
 * the hybrid estimators did to find heavy candidates among their siblings'
 * samples too, spent ~G times the kernel work on rows whose weight is zero
 * (1.2-2.0x magicpig's time at the same L).  Rows shared by two heads are
 * gathered twice.  Only q heads g0, g0 + gstep, ... are attended, the
 * others get the empty result and no report: the layer driver spreads a
 * group over several tasks. */
static void sampled(const struct kvd_kern *kk, const struct kvd_geom *g,
		    const struct kvd_logp_tab *tab, const struct kvd_logp_tab *tab_lo,
		    const struct kvd_seg *seg, uint32_t h,
		    const float *q, const uint16_t *qc, struct kvd_attn_scratch *s, float *o,
		    float *lse, struct kvd_attn_stats *st, const struct heavy_in *hv,
		    struct heavy_top *top, int cv, const struct lcv_src *ls, int g0, int gstep)
{
	const struct kvd_seg_head *sh = &seg->h[h];
	const int G = (int)kvd_geom_group(g), d = (int)g->d, L = (int)g->L;
	const float scale = 1.0f / sqrtf((float)d);
	float *sc = s->s;
	uint64_t cand = 0, rows = 0, vrows = 0, walked = 0;

	empty_result(G, d, o, lse);
	for (int gi = g0; gi < G; gi += gstep) {
		const float *qg = q + (size_t)gi * d;
		float *og = o + (size_t)gi * d;
		/* the reduced budget: a sample of the first tab_lo->L tables */
		const struct kvd_logp_tab *tb = tab_lo && hv && hv->lo[gi] ? tab_lo : tab;
		uint32_t nc = kvd_lsh_candidates_n(&sh->tab, qc + (size_t)gi * L, (uint32_t)tb->L,
						   (int)g->c, &s->lsh, s->cand), m, nh,
			 hidx[KVD_HEAVY_MAX];
		float hraw[KVD_HEAVY_MAX], nn = 0.0f;
		const float *lm;

		cand += nc;
		if (st) {
			const uint16_t *ids;

			for (int t = 0; t < tb->L; t++)
				walked += kvd_lsh_bucket(&sh->tab, (uint32_t)t,
							 qc[(size_t)gi * L + t], &ids);
		}
		/* Ascending rows: the gather walks memory forwards and the sums
		 * do not depend on the tables' bucket order. */
		m = own_rows(s->cand, nc, hv ? hv->id[gi] : NULL, hv ? hv->n[gi] : 0, s->rows,
			     hidx, &nh);
		rows += m;
		if (top)
			top->n[gi] = 0;
		if (m == 0)
			continue;
		if (seg->kv_dtype == KVD_KV_INT8) {
			float qs[KVD_DMAX], qsc;
			int16_t q16[KVD_DMAX];

			for (int e = 0; e < d; e++)
				qs[e] = qg[e] * sh->kscale[e];
			kvd_q16(qs, 1, d, q16, &qsc);
			kk->qk8(q16, &qsc, 1, d, sh->k8, s->rows, m, sc, m, sh->r8, sizeof *sh->r8);
		} else {
			kk->qk(qg, 1, d, sh->k, s->rows, m, sc, m);
		}
		rows_consts(seg, sh, s->rows, m, sc, s->kinv, s->vsc);
		if (top)
			top_of(kk, sc, s->rows, m, hv->seg, scale, top, gi, s->t,
			       (uint32_t *)(s->t + s->cap));
		for (int e = 0; e < d; e++)
			nn += qg[e] * qg[e];
		for (uint32_t j = 0; j < nh; j++)
			hraw[j] = sc[hidx[j]];
		if (cv)
			for (uint32_t i = 0; i < m; i++)
				s->t[i] = sc[i] * scale;
		kk->logp(sc, m, s->kinv, nn > 0.0f ? 1.0f / sqrtf(nn) : 0.0f, scale, tb);
		for (uint32_t j = 0; j < nh; j++)
			sc[hidx[j]] = hraw[j] * scale;
		/* hybrid_lcv's line only on the reduced budget: a head on
		 * every table misses mass the sample does not find, which a
		 * line follows no better than a constant, and a group none of
		 * whose heads needs the line skips the moments (layer_task). */
		int cvh = cv == 2 && tab_lo && tb != tab_lo ? 1 : cv;

		uint32_t vm = m;

		if (cvh == 2) {
			lm = lcv_of(ls, (uint32_t)gi);
			lse[gi] = softmax_v_lcv(kk, seg, sh, d, sc, s->t, s->t + m, s->rows,
						s->vsc, m, s->w16, og, lm + (size_t)gi * d,
						lm[G * d + gi], scale,
						kvd_attn_rr_seed(qg, qc + (size_t)gi * L,
								 (uint32_t)L, hv->seg),
						&vm);
		} else {
			lse[gi] = cvh ? softmax_v_cv(kk, seg, sh, d, sc, s->t, s->rows, s->vsc, m,
						     s->w16, og)
				      : softmax_v(kk, seg, sh, d, sc, s->rows, s->vsc, m, s->w16,
						  og);
		}
		vrows += vm;
	}
	if (st) {
		st->cand += cand;
		st->rows += rows;
		st->vrows += vrows;
		st->bucket_ids += walked;
	}
}

void kvd_attn_sampled(const struct kvd_kern *kk, const struct kvd_geom *g,
		      const struct kvd_logp_tab *tab, const struct kvd_seg *seg, uint32_t h,
		      const float *q, const uint16_t *qc, struct kvd_attn_scratch *s,
		      float *o, float *lse, struct kvd_attn_stats *st)
{
	sampled(kk, g, tab, NULL, seg, h, q, qc, s, o, lse, st, NULL, NULL, 0, NULL, 0, 1);
}

/* ---- exact attention over contiguous rows ------------------------------- */

#define DENSE_BLOCK 256

/* Contiguous rows of either dtype; for int8 the scales as in kvd_seg_head. */
struct dense_rows {
	const uint16_t *k, *v;
	const int8_t *k8, *v8;
	const float *kscale;
	const struct kvd_row8 *r8;
};

/* s[i] *= f[i] for i < n, n a multiple of 16: the fixed inner length lets
 * the compiler vectorize it at -O2. */
static void row_mul(float *restrict s, const float *restrict f, size_t n)
{
	for (size_t i = 0; i < n; i += 16)
		for (int j = 0; j < 16; j++)
			s[i + j] *= f[i + j];
}

static void dense(const struct kvd_kern *kk, const float *q, int G, int d,
		  const struct dense_rows *rw, size_t n, float *o, float *lse, float *s)
{
	float qs[KVD_GMAX * KVD_DMAX], mx[KVD_GMAX], sum[KVD_GMAX], qsc[KVD_GMAX];
	float kf[DENSE_BLOCK], vf[DENSE_BLOCK];
	int16_t q16[KVD_GMAX * KVD_DMAX];
	const float scale = 1.0f / sqrtf((float)d);

	if (n == 0) {
		empty_result(G, d, o, lse);
		return;
	}
	/* Scaling q once makes qk produce scores directly. */
	for (int i = 0; i < G * d; i++)
		qs[i] = q[i] * scale * (rw->kscale ? rw->kscale[i % d] : 1.0f);
	if (rw->k8)
		kvd_q16(qs, G, d, q16, qsc);
	for (int gi = 0; gi < G; gi++) {
		mx[gi] = -INFINITY;
		sum[gi] = 0.0f;
	}
	memset(o, 0, (size_t)G * d * sizeof(float));

	for (size_t at = 0; at < n; at += DENSE_BLOCK) {
		size_t b = n - at < DENSE_BLOCK ? n - at : DENSE_BLOCK, bu = (b + 15) & ~(size_t)15;

		if (rw->k8) {
			/* The row factors out of r8 once, up to a multiple of 16
			 * (zeros past b), so the loops over heads are fixed-length
			 * vector multiplies: read at r8's stride head by head, in
			 * scalar, they took a fifth of int8's dense time. */
			for (size_t i = 0; i < bu; i++) {
				kf[i] = i < b ? rw->r8[at + i].kfac : 0.0f;
				vf[i] = i < b ? rw->r8[at + i].vscale : 0.0f;
			}
			kk->qk8(q16, qsc, G, d, rw->k8 + at * d, NULL, b, s, DENSE_BLOCK, NULL, 0);
			for (int gi = 0; gi < G; gi++)
				row_mul(s + (size_t)gi * DENSE_BLOCK, kf, bu);
		} else
			kk->qk(qs, G, d, rw->k + at * d, NULL, b, s, DENSE_BLOCK);
		for (int gi = 0; gi < G; gi++) {
			float *sg = s + (size_t)gi * DENSE_BLOCK;
			float bm = kk->max(sg, b), nm = bm > mx[gi] ? bm : mx[gi];

			if (nm == -INFINITY) {          /* only -inf scores so far */
				memset(sg, 0, b * sizeof(float));
				continue;
			}
			if (nm > mx[gi] && mx[gi] != -INFINITY) {
				float r = expf(mx[gi] - nm);

				sum[gi] *= r;
				for (int e = 0; e < d; e++)
					o[(size_t)gi * d + e] *= r;
			}
			mx[gi] = nm;
			sum[gi] += kk->expsum(sg, b, nm);
		}
		if (rw->v8) {
			for (int gi = 0; gi < G; gi++)
				row_mul(s + (size_t)gi * DENSE_BLOCK, vf, bu);
			int16_t w16[KVD_GMAX * DENSE_BLOCK];
			float wsc[KVD_GMAX];

			for (int gi = 0; gi < G; gi++)
				kvd_q16(s + (size_t)gi * DENSE_BLOCK, 1, (int)b, w16 + gi * DENSE_BLOCK,
					&wsc[gi]);
			kk->pv8(w16, DENSE_BLOCK, wsc, G, d, rw->v8 + at * d, NULL, b, o);
		} else {
			kk->pv(s, DENSE_BLOCK, G, d, rw->v + at * d, NULL, b, o);
		}
	}
	for (int gi = 0; gi < G; gi++) {
		float r = sum[gi] > 0.0f ? 1.0f / sum[gi] : 0.0f;

		for (int e = 0; e < d; e++)
			o[(size_t)gi * d + e] *= r;
		lse[gi] = sum[gi] > 0.0f ? mx[gi] + logf(sum[gi]) : -INFINITY;
	}
}

void kvd_attn_dense(const struct kvd_kern *kk, const float *q, int G, int d,
		    const uint16_t *k, const uint16_t *v, size_t n, float *o, float *lse,
		    float *s)
{
	struct dense_rows r = { .k = k, .v = v };

	dense(kk, q, G, d, &r, n, o, lse, s);
}

/* Rows [a, b) of kv head h of a segment. */
static void dense_seg_rows(const struct kvd_kern *kk, const float *q, int G,
			   const struct kvd_seg *seg, uint32_t h, size_t a, size_t b, float *o,
			   float *lse, float *s)
{
	const struct kvd_seg_head *sh = &seg->h[h];
	const size_t d = seg->d;
	struct dense_rows r = { .kscale = sh->kscale };

	if (seg->kv_dtype == KVD_KV_INT8) {
		r.k8 = sh->k8 + a * d;
		r.v8 = sh->v8 + a * d;
		r.r8 = sh->r8 + a;
	} else {
		r.k = sh->k + a * d;
		r.v = sh->v + a * d;
	}
	dense(kk, q, G, (int)d, &r, b - a, o, lse, s);
}

void kvd_attn_dense_seg(const struct kvd_kern *kk, const float *q, int G,
			const struct kvd_seg *seg, uint32_t h, float *o, float *lse, float *s)
{
	dense_seg_rows(kk, q, G, seg, h, 0, seg->n, o, lse, s);
}

void kvd_attn_merge(float *o, float *lse, const float *o2, const float *lse2, int G, int d)
{
	for (int gi = 0; gi < G; gi++) {
		float a = lse[gi], b = lse2[gi];
		float *og = o + (size_t)gi * d;
		const float *o2g = o2 + (size_t)gi * d;

		if (b == -INFINITY)
			continue;
		if (a == -INFINITY) {
			memcpy(og, o2g, (size_t)d * sizeof(float));
			lse[gi] = b;
			continue;
		}
		float mx = a > b ? a : b;
		float wa = expf(a - mx), wb = expf(b - mx), r = 1.0f / (wa + wb);

		for (int e = 0; e < d; e++)
			og[e] = (wa * og[e] + wb * o2g[e]) * r;
		lse[gi] = mx + logf(wa + wb);
	}
}

/* ---- one layer ---------------------------------------------------------- */

/* Tasks are (request, kv head, part, sub) with part < nseg a segment and
 * part == nseg the tail; each writes its own slot of `part_o`/`part_lse`,
 * merged afterwards in (part, sub) order, so a request's result depends
 * neither on scheduling nor on which other requests share the job (nor on
 * the pool's size: the split is fixed).
 *
 * A (kv head, part) pair alone is too coarse to keep a many-core host busy:
 * 8 kv heads over 3 segments and a tail are 32 tasks, and 48 cores would
 * idle a third of them; with 24 tasks on 16 cores the second wave runs half
 * empty.  So each pair is split KVD_ATTN_SPLIT ways: sampled parts by q
 * head (sub s attends heads s, s + SPLIT, ...; the estimators' heads are
 * independent), dense parts and the tail by rows (a range of whole
 * DENSE_BLOCKs each, so the G heads still share every K and V row read).
 * Requests whose pairs hold
 * KVD_ATTN_SPLIT_FLOATS output floats or more (128 pairs at G = 4, d = 128),
 * which feed a pool on their own: the split multiplies the slots to merge
 * and part_o, and this bounds what it adds to 3 * 256 KiB a request.
 * Requests with estimator state split as the others: each q head keeps,
 * scores and reports only its own rows (sampled()). */
struct layer_job {
	struct kvd_attn_scratch *scr;
	const struct kvd_kern *kk;
	struct kvd_attn_req *r;
	uint32_t n;
	const uint32_t *first;              /* [n + 1]: request i owns tasks [first[i], first[i+1]) */
	const size_t *po;                   /* [n]: request i's first float in part_o */
	const size_t *pl;                   /* [n]: and in part_lse */
	float *part_o, *part_lse;
	/* Requests with estimator state: per (kv head, part) pair, G *
	 * KVD_HEAVY_MAX scores and ids and G counts from top[ri] on, in pair
	 * order (h * nparts + part). */
	float *top_s[KVD_ATTN_BATCH_MAX];
	uint32_t *top_id[KVD_ATTN_BATCH_MAX], *top_n[KVD_ATTN_BATCH_MAX];
	struct kvd_attn_stats *st;          /* [workers] */
	/* hybrid_lcv requests: per (kv head, part) pair, lcv_floats() from
	 * lcv[ri] on and a ready flag from lready[ri] on (0: not made, 1:
	 * being made, 2: made), in pair order. */
	float *lcv[KVD_ATTN_BATCH_MAX];
	_Atomic uint32_t *lready[KVD_ATTN_BATCH_MAX];
	/* Per (request, kv head), from hfirst[ri] on: its tasks not yet done.
	 * The task that takes it to zero finishes the head (head_done). */
	_Atomic uint32_t *left;
	const uint32_t *hfirst;             /* [n] */
	/* Whether head_done updates request i's lists: not when another
	 * request of the batch holds the same state, which its tasks may
	 * still be reading (kvd_attn_layers updates those after the job). */
	uint8_t own_state[KVD_ATTN_BATCH_MAX];
};

static int has_state(const struct kvd_attn_req *r)
{
	return r->est != KVD_EST_MAGICPIG && r->heavy && r->tab;
}

/* The heavy keys of q heads h*G + g0, h*G + g0 + gstep, ... < h*G + G (the
 * heads one task attends; the others' slots are left as they are) that lie
 * in segment `seg` of n rows, ascending and each once (sampled() merges
 * them with a sample).
 * Entries that name no row of it are skipped: the state is the daemon's
 * own, but it may predate a change of the layer, and nothing else here
 * relies on its order. */
static void heavy_of(const uint32_t *heavy, uint32_t h, uint32_t G, uint32_t g0, uint32_t gstep,
		     uint32_t seg, uint32_t n, uint32_t ids[][KVD_HEAVY_MAX], struct heavy_in *hv)
{
	hv->seg = seg;
	for (uint32_t gi = g0; gi < G; gi += gstep) {
		const uint32_t *e = heavy + (size_t)(h * G + gi) * (1 + KVD_HEAVY_MAX);
		uint32_t c0 = e[0] & 0xffff, cnt = c0 < KVD_HEAVY_MAX ? c0 : KVD_HEAVY_MAX, k = 0;

		for (uint32_t i = 0; i < cnt; i++) {
			uint32_t x = e[1 + i], j = k;

			if (x >> 16 != seg || (x & 0xffff) >= n)
				continue;
			while (j > 0 && ids[gi][j - 1] > x)
				j--;
			if (j > 0 && ids[gi][j - 1] == x)
				continue;
			memmove(&ids[gi][j + 1], &ids[gi][j], (k - j) * sizeof ids[gi][0]);
			ids[gi][j] = x;
			k++;
		}
		hv->id[gi] = ids[gi];
		hv->n[gi] = k;
		hv->lo[gi] = !!(e[0] & KVD_HEAVY_LO);
	}
}

/* Whether any q head of kv head h's group is on hybrid_lcv's reduced
 * budget.  Every task of the group reads the same bits: the state is
 * rewritten only once all of them are done (head_done). */
static int group_lo(const uint32_t *heavy, uint32_t h, uint32_t G)
{
	uint32_t lo = 0;

	for (uint32_t gi = 0; gi < G; gi++)
		lo |= heavy[(size_t)(h * G + gi) * (1 + KVD_HEAVY_MAX)];
	return !!(lo & KVD_HEAVY_LO);
}

static uint32_t nparts_of(const struct kvd_layer_view *lv)
{
	return lv->nseg + (lv->tail_n ? 1 : 0);
}

#define KVD_ATTN_SPLIT        4u
#define KVD_ATTN_SPLIT_FLOATS 65536u

static uint32_t split_of(const struct kvd_attn_req *r)
{
	size_t floats = (size_t)nparts_of(r->lv) * r->g->q_heads * r->g->d;

	return floats >= KVD_ATTN_SPLIT_FLOATS ? 1 : KVD_ATTN_SPLIT;
}

/* Sub `sub` of `split`'s rows of n: whole DENSE_BLOCKs, the last one short. */
static void rows_of(size_t n, uint32_t sub, uint32_t split, size_t *a, size_t *b)
{
	size_t per = ((n + split - 1) / split + DENSE_BLOCK - 1) / DENSE_BLOCK * DENSE_BLOCK;

	*a = (size_t)sub * per < n ? (size_t)sub * per : n;
	*b = *a + per < n ? *a + per : n;
}

static void head_done(struct layer_job *j, uint32_t ri, uint32_t h);

static void layer_task(void *arg, uint32_t task, unsigned worker)
{
	struct layer_job *j = arg;
	uint32_t ri = 0;

	while (task >= j->first[ri + 1])
		ri++;
	task -= j->first[ri];

	const struct kvd_attn_req *r = &j->r[ri];
	const struct kvd_geom *g = r->g;
	const struct kvd_layer_view *lv = r->lv;
	uint32_t G = kvd_geom_group(g), d = g->d, nparts = nparts_of(lv), split = split_of(r);
	uint32_t h = task / split / nparts, part = task / split % nparts, sub = task % split;
	const float *q = r->q + (size_t)h * G * d;
	size_t a, b;
	float *o = j->part_o + j->po[ri] + (size_t)task * G * d;
	float *lse = j->part_lse + j->pl[ri] + (size_t)task * G;
	struct kvd_attn_scratch *s = &j->scr[worker];

	if (part < lv->nseg && r->tab) {
		/* ids pack seg << 16; a later segment goes without state */
		int state = has_state(r) && part < 0xffff;
		/* a segment made without moments would answer with hybrid_cv's
		 * constant (none should reach here: segments are shared only
		 * within a profile, and the profile's geometry says) */
		int lcv = state && r->est == KVD_EST_HYBRID_LCV && lv->seg[part]->h[h].kv;
		/* which sampled() gives the line: heads on the reduced budget */
		int line = lcv && (!r->tab_lo || group_lo(r->heavy, h, G));
		size_t pair = (size_t)h * nparts + part;
		uint32_t ids[KVD_GMAX][KVD_HEAVY_MAX];
		float own[KVD_GMAX * (KVD_DMAX + 1)];
		struct lcv_src ls;
		struct heavy_in hv;
		struct heavy_top top;

		if (state) {
			top = (struct heavy_top){
				.s = j->top_s[ri] + pair * G * KVD_HEAVY_MAX,
				.id = j->top_id[ri] + pair * G * KVD_HEAVY_MAX,
				.n = j->top_n[ri] + pair * G,
			};
			heavy_of(r->heavy, h, G, sub, split, part, lv->seg[part]->n, ids, &hv);
		}
		if (lcv) {
			uint32_t none = 0;

			ls = (struct lcv_src){ j->kk, lv->seg[part], h, G, d, q,
					       j->lcv[ri] + pair * lcv_floats(g),
					       j->lready[ri] + pair, own };
			if (line && atomic_compare_exchange_strong_explicit(ls.ready, &none, 1,
									    memory_order_relaxed,
									    memory_order_relaxed)) {
				lcv_moments(j->kk, lv->seg[part], h, q, G, d, 0, 1, ls.shared);
				atomic_store_explicit(ls.ready, 2, memory_order_release);
			}
		}
		sampled(j->kk, g, r->tab, r->tab_lo, lv->seg[part], h, q,
			r->qc + (size_t)h * G * g->L, s,
			o, lse, j->st ? &j->st[worker] : NULL, state ? &hv : NULL,
			state ? &top : NULL,
			lcv ? 2 : r->est == KVD_EST_HYBRID_CV || r->est == KVD_EST_HYBRID_LCV,
			lcv ? &ls : NULL, (int)sub, (int)split);
	} else if (part < lv->nseg) {
		rows_of(lv->seg[part]->n, sub, split, &a, &b);
		dense_seg_rows(j->kk, q, (int)G, lv->seg[part], h, a, b, o, lse, s->s);
	} else {
		size_t off = (size_t)h * (lv->tail_cap ? lv->tail_cap : lv->tail_n) * d;

		rows_of(lv->tail_n, sub, split, &a, &b);
		kvd_attn_dense(j->kk, q, (int)G, (int)d, lv->tail_k + off + a * d,
			       lv->tail_v + off + a * d, b - a, o, lse, s->s);
	}
	/* acq_rel: the last task of the head sees every other's slot and report */
	if (atomic_fetch_sub_explicit(&j->left[j->hfirst[ri] + h], 1, memory_order_acq_rel) == 1)
		head_done(j, ri, h);
}

/* The next step's heavy lists of the q heads of kv head h of request r
 * from its tasks' reports: per q head the KVD_HEAVY_MAX best rows over all
 * segments, and for adaptive only those that carried at least
 * 2^-KVD_HEAVY_SHARE_LOG2 of the head's mass in this step (r->lse is kvd's
 * part, merged). */
static void heavy_update(const struct kvd_kern *kk, struct kvd_attn_req *r, uint32_t h,
			 const float *ts, const uint32_t *tid, const uint32_t *tn)
{
	const struct kvd_geom *g = r->g;
	uint32_t G = kvd_geom_group(g), nseg = r->lv->nseg, nparts = nparts_of(r->lv);

	for (uint32_t qh = h * G; qh < h * G + G; qh++) {
		uint32_t gi = qh % G, n = 0, cnt = 0;
		uint32_t *e = r->heavy + (size_t)qh * (1 + KVD_HEAVY_MAX);
		/* The reports in turn, cut back to the list's size whenever the
		 * next might not fit (top_select). */
		float hs[4 * KVD_HEAVY_MAX], floor = -INFINITY;
		uint32_t hid[4 * KVD_HEAVY_MAX];

		/* adaptive's floor first: on a diffuse head it turns away
		 * every report before the selection sees it */
		if (r->est == KVD_EST_ADAPTIVE)
			floor = r->lse[qh] - (float)(KVD_HEAVY_SHARE_LOG2 * M_LN2);

		for (uint32_t p = 0; p < nseg; p++) {
			size_t t = ((size_t)h * nparts + p) * G + gi;

			if (n + tn[t] > 4 * KVD_HEAVY_MAX)
				n = top_select(kk, hs, hid, n);
			for (uint32_t k = 0; k < tn[t]; k++) {
				float x = ts[t * KVD_HEAVY_MAX + k];

				hs[n] = x;
				hid[n] = tid[t * KVD_HEAVY_MAX + k];
				n += x >= floor;
			}
		}
		n = top_select(kk, hs, hid, n);
		/* ascending ids by insertion: at most 32, and qsort's calls
		 * were half of this function's time */
		for (uint32_t k = 0; k < n; k++) {
			uint32_t x = hid[k], i = cnt++;

			while (i > 0 && e[i] > x) {
				e[1 + i] = e[i];
				i--;
			}
			e[1 + i] = x;
		}
		e[0] = cnt;
		/* hybrid_lcv's budget for the next step: the reduced one
		 * unless half the list or more holds keys of at least
		 * 2^-KVD_HEAVY_SHARE_LOG2 of the head's mass.  Such a head
		 * may have more of them than the list takes out, left to the
		 * sample, which wants every table; half, not all, so that a
		 * head on the reduced budget, which finds fewer, still comes
		 * back (a full list as the test held mixed's heads there). */
		if (r->est == KVD_EST_HYBRID_LCV && r->tab_lo) {
			float sig = r->lse[qh] - (float)(KVD_HEAVY_SHARE_LOG2 * M_LN2);
			uint32_t big = 0;

			for (uint32_t k = 0; k < n; k++)
				big += hs[k] >= sig;
			if (big < KVD_HEAVY_MAX / 2)
				e[0] |= KVD_HEAVY_LO;
		}
	}
}

/* Head h of request ri, by whichever task of it finished last: its parts
 * merged into the request's answer in part order (so the bits do not depend
 * on which task that was), then its q heads' lists for the next step.  Done
 * after the job by one thread, this was ~15 % of a dense layer's wall time
 * (98304 tokens, 2 threads, Zen 5), the other worker idle. */
static void head_done(struct layer_job *j, uint32_t ri, uint32_t h)
{
	struct kvd_attn_req *r = &j->r[ri];
	uint32_t G = kvd_geom_group(r->g), d = r->g->d, nslots = nparts_of(r->lv) * split_of(r);
	float *oh = r->o + (size_t)h * G * d, *lh = r->lse + (size_t)h * G;

	empty_result((int)G, (int)d, oh, lh);
	for (uint32_t p = 0; p < nslots; p++) {
		size_t t = (size_t)h * nslots + p;

		kvd_attn_merge(oh, lh, j->part_o + j->po[ri] + t * G * d,
			       j->part_lse + j->pl[ri] + t * G, (int)G, (int)d);
	}
	if (j->own_state[ri] && has_state(r))
		heavy_update(j->kk, r, h, j->top_s[ri], j->top_id[ri], j->top_n[ri]);
}

static int req_check(const struct kvd_attn_req *r, const struct kvd_attn_scratch *scr)
{
	const struct kvd_geom *g = r->g;
	const struct kvd_layer_view *lv = r->lv;
	int rc = kvd_geom_check(g);

	if (rc)
		return rc;
	if (r->tab && ((int)r->tab->K != (int)g->K || (int)r->tab->L != (int)g->L ||
		       (int)r->tab->c != (int)g->c))
		return -KVD_ESHAPE;
	if (r->tab_lo && (!r->tab || r->tab_lo->K != r->tab->K || r->tab_lo->c != r->tab->c ||
			  r->tab_lo->L < 1 || r->tab_lo->L > r->tab->L))
		return -KVD_ESHAPE;
	for (uint32_t i = 0; i < lv->nseg; i++)
		if (lv->seg[i]->kv_heads != g->kv_heads || lv->seg[i]->d != g->d ||
		    lv->seg[i]->K != g->K || lv->seg[i]->L != g->L ||
		    lv->seg[i]->kv_dtype != g->kv_dtype || lv->seg[i]->n > scr[0].cap)
			return -KVD_ESHAPE;
	return 0;
}

/* A job's buffers, kept in the first worker's scratch between calls up to
 * KVD_ATTN_JOB_KEEP bytes: a block of 128 KiB or more is a mapping of its
 * own in kvd (kvd/main.c), and mapping, faulting in and unmapping ~1 MiB a
 * call (a batch of 4 sequences at 98304 tokens) cost ~5 % of kvd's CPU time
 * in kvbench decode.  Larger blocks are the call's own. */
static void *job_buf(struct kvd_attn_scratch *s, size_t bytes)
{
	void *p;

	if (bytes <= s->job_bytes)
		return s->job;
	p = aligned_alloc(64, ALIGN64(bytes));
	if (p && bytes <= KVD_ATTN_JOB_KEEP) {
		free(s->job);
		s->job = p;
		s->job_bytes = ALIGN64(bytes);
	}
	return p;
}

static void job_done(struct kvd_attn_scratch *s, void *blk)
{
	if (blk != s->job)
		free(blk);
}

int kvd_attn_layers(struct kvd_pool *pool, struct kvd_attn_scratch *scr,
		    const struct kvd_kern *kk, struct kvd_attn_req *r, uint32_t n,
		    struct kvd_attn_stats *st)
{
	unsigned nw = kvd_pool_size(pool);
	struct kvd_attn_stats wst[nw];
	uint32_t first[KVD_ATTN_BATCH_MAX + 1];
	size_t po[KVD_ATTN_BATCH_MAX], pl[KVD_ATTN_BATCH_MAX], no = 0, nl = 0;
	int ok = 0;

	if (n > KVD_ATTN_BATCH_MAX)
		return -EINVAL;
	first[0] = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t G = 0, tasks = 0;

		r[i].rc = req_check(&r[i], scr);
		if (!r[i].rc) {
			G = kvd_geom_group(r[i].g);
			tasks = nparts_of(r[i].lv) * r[i].g->kv_heads * split_of(&r[i]);
			ok++;
		}
		first[i + 1] = first[i] + tasks;
		po[i] = no;
		pl[i] = nl;
		no += (size_t)tasks * G * (r[i].rc ? 0 : r[i].g->d);
		nl += (size_t)tasks * G;
	}
	if (!ok)
		return 0;

	/* Per (kv head, part) pair of a request with state: G * KVD_HEAVY_MAX
	 * scores and ids, G counts (zero where no task reports). */
	size_t nt = 0, tw[KVD_ATTN_BATCH_MAX];

	for (uint32_t i = 0; i < n; i++) {
		tw[i] = nt;
		if (!r[i].rc && has_state(&r[i]))
			nt += (size_t)nparts_of(r[i].lv) * r[i].g->kv_heads * kvd_geom_group(r[i].g);
	}

	/* Per (request, kv head): its tasks left; hybrid_lcv: per (kv head,
	 * part) pair, the moments and their flag */
	uint32_t hfirst[KVD_ATTN_BATCH_MAX], nh = 0;
	size_t lw[KVD_ATTN_BATCH_MAX], nlf = 0, nlp = 0, lp[KVD_ATTN_BATCH_MAX];

	for (uint32_t i = 0; i < n; i++) {
		size_t pairs = !r[i].rc && is_lcv(&r[i]) ?
			       (size_t)nparts_of(r[i].lv) * r[i].g->kv_heads : 0;

		hfirst[i] = nh;
		nh += r[i].rc ? 0 : r[i].g->kv_heads;
		lw[i] = nlf;
		lp[i] = nlp;
		nlf += pairs ? pairs * lcv_floats(r[i].g) : 0;
		nlp += pairs;
	}

	/* One block: part_o and part_lse, the reports, the counters, the
	 * moments, each 64-byte aligned. */
	size_t b_o = ALIGN64((no + nl) * sizeof(float));
	size_t b_top = ALIGN64(nt * (2 * KVD_HEAVY_MAX + 1) * sizeof(uint32_t));
	size_t b_left = ALIGN64((nh + nlp) * sizeof(_Atomic uint32_t));
	size_t b_lcv = ALIGN64(nlf * sizeof(float));
	char *blk = job_buf(&scr[0], b_o + b_top + b_left + b_lcv);

	if (!blk) {
		for (uint32_t i = 0; i < n; i++)
			r[i].rc = r[i].rc ? r[i].rc : -ENOMEM;
		return -ENOMEM;
	}

	float *part_o = (float *)blk;
	uint32_t *topbuf = nt ? (uint32_t *)(blk + b_o) : NULL;
	_Atomic uint32_t *left = (_Atomic uint32_t *)(blk + b_o + b_top);
	float *lcvbuf = nlf ? (float *)(blk + b_o + b_top + b_left) : NULL;

	memset(wst, 0, sizeof wst);
	struct layer_job j = {
		.scr = scr, .kk = kk, .r = r, .n = n, .first = first, .po = po, .pl = pl,
		.part_o = part_o, .part_lse = part_o + no, .st = st ? wst : NULL, .left = left,
		.hfirst = hfirst,
	};

	for (uint32_t i = 0; topbuf && i < n; i++) {
		j.top_s[i] = (float *)(topbuf + tw[i] * KVD_HEAVY_MAX);
		j.top_id[i] = topbuf + (nt + tw[i]) * KVD_HEAVY_MAX;
		j.top_n[i] = topbuf + 2 * nt * KVD_HEAVY_MAX + tw[i];
	}
	if (topbuf)
		memset(topbuf + 2 * nt * KVD_HEAVY_MAX, 0, nt * sizeof *topbuf);
	for (size_t p = 0; p < nlp; p++)
		atomic_init(&left[nh + p], 0);
	for (uint32_t i = 0; i < n; i++) {
		for (uint32_t h = 0; !r[i].rc && h < r[i].g->kv_heads; h++)
			atomic_init(&left[hfirst[i] + h], nparts_of(r[i].lv) * split_of(&r[i]));
		j.lcv[i] = lcvbuf ? lcvbuf + lw[i] : NULL;
		j.lready[i] = left + nh + lp[i];
		/* A request reads the state as it was before the job, even when
		 * the batch holds the same layer twice. */
		j.own_state[i] = !r[i].rc && has_state(&r[i]);
		for (uint32_t k = 0; j.own_state[i] && k < n; k++)
			if (k != i && !r[k].rc && has_state(&r[k]) && r[k].heavy == r[i].heavy)
				j.own_state[i] = 0;
		/* A request with no part (kvd holds nothing of the layer) has no
		 * task to finish its heads: its answer is the empty one. */
		if (!r[i].rc && first[i + 1] == first[i])
			empty_result((int)r[i].g->q_heads, (int)r[i].g->d, r[i].o, r[i].lse);
	}

	kvd_pool_run(pool, first[n], layer_task, &j);

	for (uint32_t i = 0; topbuf && i < n; i++)
		if (!r[i].rc && has_state(&r[i]) && !j.own_state[i])
			for (uint32_t h = 0; h < r[i].g->kv_heads; h++)
				heavy_update(j.kk, &r[i], h, j.top_s[i], j.top_id[i], j.top_n[i]);
	if (st) {
		memset(st, 0, sizeof *st);
		for (unsigned w = 0; w < nw; w++) {
			st->cand += wst[w].cand;
			st->rows += wst[w].rows;
			st->vrows += wst[w].vrows;
			st->bucket_ids += wst[w].bucket_ids;
		}
	}
	job_done(&scr[0], blk);
	return 0;
}

static int run_layer(struct kvd_pool *pool, struct kvd_attn_scratch *scr,
		     const struct kvd_kern *kk, const struct kvd_geom *g,
		     const struct kvd_logp_tab *tab, const struct kvd_layer_view *lv,
		     const float *q, const uint16_t *qc, float *o, float *lse,
		     struct kvd_attn_stats *st)
{
	struct kvd_attn_req r = { .g = g, .tab = tab, .lv = lv, .q = q, .qc = qc, .o = o,
				  .lse = lse };
	int rc = kvd_attn_layers(pool, scr, kk, &r, 1, st);

	return rc ? rc : r.rc;
}

int kvd_attn_layer(struct kvd_pool *pool, struct kvd_attn_scratch *scr,
		   const struct kvd_kern *kk, const struct kvd_geom *g,
		   const struct kvd_logp_tab *tab, const struct kvd_layer_view *lv,
		   const float *q, const uint16_t *qc, float *o, float *lse,
		   struct kvd_attn_stats *st)
{
	return run_layer(pool, scr, kk, g, tab, lv, q, qc, o, lse, st);
}

int kvd_attn_layer_dense(struct kvd_pool *pool, struct kvd_attn_scratch *scr,
			 const struct kvd_kern *kk, const struct kvd_geom *g,
			 const struct kvd_layer_view *lv, const float *q, float *o, float *lse)
{
	return run_layer(pool, scr, kk, g, NULL, lv, q, NULL, o, lse, NULL);
}
