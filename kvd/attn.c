#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attn.h"
#include "bf16.h"
#include "err.h"
#include "mem.h"
#include "pool.h"

#define ALIGN64(x) (((x) + 63) & ~(size_t)63)

int kvd_geom_check(const struct kvd_geom *g)
{
	if (!g->q_heads || !g->kv_heads || g->q_heads > KVD_QHEADS_MAX || g->q_heads % g->kv_heads ||
	    g->q_heads / g->kv_heads > KVD_GMAX)
		return -KVD_EGEOM;
	if (g->d < 16 || g->d > KVD_DMAX || g->d % 16)
		return -KVD_EGEOM;
	if (g->K < 1 || g->K > KVD_LSH_KMAX || g->L < 1 || g->L > KVD_LSH_LMAX)
		return -KVD_EGEOM;
	if (g->c != 1 && g->c != 2)
		return -KVD_EGEOM;
	if (g->kv_dtype > KVD_KV_DTYPE_MAX)
		return -KVD_EGEOM;
	return 0;
}

static const char *const dtype_names[] = { [KVD_KV_BF16] = "bf16", [KVD_KV_INT8] = "int8" };

const char *kvd_kv_dtype_name(uint32_t dt)
{
	return dt <= KVD_KV_DTYPE_MAX ? dtype_names[dt] : NULL;
}

int kvd_kv_dtype_parse(const char *s, uint32_t *out)
{
	for (uint32_t i = 0; i <= KVD_KV_DTYPE_MAX; i++)
		if (strcmp(s, dtype_names[i]) == 0) {
			*out = i;
			return 0;
		}
	return -EINVAL;
}

/* ---- segments ---------------------------------------------------------- */

/* A head's payload, each part 64-byte aligned: K rows, V rows, then for
 * int8 the key scales [d], value scales [n] and key factors [n], then 1/|k|
 * [n] and the tables.  One function so that build, check, adopt and the byte count
 * cannot disagree. */
struct head_parts {
	char *k, *v, *kscale, *vscale, *kfac, *kinv, *tab;
	size_t bytes;
};

static struct head_parts head_parts_at(const struct kvd_geom *g, uint32_t n, char *p)
{
	int i8 = g->kv_dtype == KVD_KV_INT8;
	size_t rows = ALIGN64((size_t)n * g->d * (i8 ? 1 : sizeof(uint16_t)));
	size_t vec = ALIGN64((size_t)n * sizeof(float));
	struct head_parts hp = { .k = p, .v = p + rows };

	p += 2 * rows;
	if (i8) {
		hp.kscale = p;
		p += ALIGN64((size_t)g->d * sizeof(float));
		hp.vscale = p;
		p += vec;
		hp.kfac = p;
		p += vec;
	}
	hp.kinv = p;
	hp.tab = p + vec;
	hp.bytes = (size_t)(hp.tab - hp.k) + kvd_lsh_tables_bytes(n, (int)g->K, (int)g->L);
	return hp;
}

static size_t head_bytes(const struct kvd_geom *g, uint32_t n)
{
	return head_parts_at(g, n, NULL).bytes;
}

size_t kvd_seg_bytes(const struct kvd_geom *g, uint32_t n)
{
	return (size_t)g->kv_heads * head_bytes(g, n);
}

/* ---- io buffers --------------------------------------------------------- */

#define IO_PAGE ((size_t)KVD_SEG_IO_PAGE)

static int seg_geom_ok(const struct kvd_geom *g, uint32_t n)
{
	return g->kv_heads >= 1 && g->kv_heads <= KVD_QHEADS_MAX && g->d >= 16 &&
	       g->d <= KVD_DMAX && g->d % 16 == 0 && g->K >= 1 && g->K <= KVD_LSH_KMAX &&
	       g->L >= 1 && g->L <= KVD_LSH_LMAX && g->kv_dtype <= KVD_KV_DTYPE_MAX &&
	       n >= 1 && n <= KVD_SEG_MAX;
}

size_t kvd_seg_io_bytes(const struct kvd_geom *g, uint32_t n)
{
	if (!seg_geom_ok(g, n))
		return 0;
	/* At most 1024 heads of ~330 MiB: far from overflowing. */
	return IO_PAGE + ((kvd_seg_bytes(g, n) + IO_PAGE - 1) & ~(IO_PAGE - 1));
}

void *kvd_seg_io_alloc(const struct kvd_geom *g, uint32_t n, size_t *bytes)
{
	return kvd_seg_io_alloc_node(g, n, -1, bytes);
}

void *kvd_seg_io_alloc_node(const struct kvd_geom *g, uint32_t n, int node, size_t *bytes)
{
	size_t b = kvd_seg_io_bytes(g, n);
	void *p;

	if (!b)
		return NULL;
	if (b >= KVD_MEM_HUGE) {
		/* Huge-page aligned, and zero as every fresh mapping is; touching
		 * it here would fault huge pages on this thread, not on the
		 * workers that fill them. */
		p = kvd_mem_alloc_node(b, node);
	} else {
		/* Zeroed so that no stale heap bytes reach a file through the
		 * header page or the padding. */
		p = aligned_alloc(IO_PAGE, b);
		if (p)
			memset(p, 0, b);
	}
	if (p && bytes)
		*bytes = b;
	return p;
}

void kvd_seg_io_free(void *io, size_t bytes)
{
	if (bytes >= KVD_MEM_HUGE)
		kvd_mem_free(io, bytes);
	else
		free(io);
}

/* ---- build, check, adopt ----------------------------------------------- */

/* Where head h's parts lie in a payload. */
static struct head_parts head_parts(const struct kvd_geom *g, uint32_t n, void *mem, uint32_t h)
{
	return head_parts_at(g, n, (char *)mem + h * head_bytes(g, n));
}

/* The one place a head's pointers are set: build and adopt must agree. */
static void head_layout(const struct kvd_geom *g, struct kvd_seg *s, uint32_t h)
{
	struct head_parts hp = head_parts(g, s->n, s->mem, h);
	struct kvd_seg_head *sh = &s->h[h];

	if (s->kv_dtype == KVD_KV_INT8) {
		sh->k8 = (int8_t *)hp.k;
		sh->v8 = (int8_t *)hp.v;
		sh->kscale = (float *)hp.kscale;
		sh->vscale = (float *)hp.vscale;
		sh->kfac = (float *)hp.kfac;
	} else {
		sh->k = (uint16_t *)hp.k;
		sh->v = (uint16_t *)hp.v;
	}
	sh->kinv = (float *)hp.kinv;
	(void)kvd_lsh_tables_layout(&sh->tab, hp.tab, s->n, (int)s->K, (int)s->L);
}

static struct kvd_seg *seg_new(const struct kvd_geom *g, uint32_t n)
{
	struct kvd_seg *s = calloc(1, sizeof *s + g->kv_heads * sizeof s->h[0]);

	if (!s)
		return NULL;
	s->n = n;
	s->kv_heads = g->kv_heads;
	s->d = g->d;
	s->K = g->K;
	s->L = g->L;
	s->kv_dtype = g->kv_dtype;
	return s;
}

struct seg_build {
	const struct kvd_geom *g;
	struct kvd_seg *seg;
	const uint16_t *k, *v, *codes;
};

/* Phase 1, per (head, chunk of ROWS_PER_TASK rows): copy the rows, 1/|k|,
 * and fault in the same share of the head's table memory on this worker
 * (the tables phase then does only the counting sort).  Chunks rather than
 * whole heads: copying into fresh pages is most of a seal, and a task of a
 * few milliseconds is what a sliced build makes others wait for. */
#define ROWS_PER_TASK 4096u

static uint32_t row_tasks(const struct kvd_seg *s)
{
	return (s->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
}

/* ---- int8 quantization --------------------------------------------------- */

/* |x| when finite, else 0: a scale comes from finite values only. */
static inline float finite_abs(float x)
{
	float a = fabsf(x);

	return a <= FLT_MAX ? a : 0.0f;
}

/* Round to nearest of x * inv, saturated to [-127, 127]; written so that
 * NaN lands on -127 (a conversion of NaN would be anything). */
static inline int8_t quant(float x, float inv)
{
	float y = x * inv;

	y = y > 127.0f ? 127.0f : y >= -127.0f ? y : -127.0f;
	return (int8_t)lrintf(y);
}

/* Phase 0 of an int8 build, one task per head: the per-channel key scales,
 * which every row chunk of phase 1 needs. */
static void seg_build_kscale(void *arg, uint32_t h, unsigned worker)
{
	struct seg_build *b = arg;
	struct kvd_seg *s = b->seg;
	size_t n = s->n, d = s->d;
	const uint16_t *k = b->k + h * n * d;
	float mx[KVD_DMAX] = { 0 };

	(void)worker;
	for (size_t i = 0; i < n; i++)
		for (size_t e = 0; e < d; e++) {
			float a = finite_abs(kvd_bf16_to_f32(k[i * d + e]));

			mx[e] = a > mx[e] ? a : mx[e];
		}
	for (size_t e = 0; e < d; e++)
		s->h[h].kscale[e] = mx[e] / 127.0f;
}

/* Keys in two levels: the channel scales bring every channel to the same
 * range (outlier channels), then each row is rounded on its own grid, so a
 * row of small norm keeps its precision instead of rounding to zero on a
 * grid made for the largest rows.  The row's factor is the least-squares fit
 * f = k.y / |y|^2 of the row to y = kscale * k8, which absorbs the row's grid
 * and leaves the error orthogonal to the key: the keys that dominate a
 * softmax are nearly parallel to the query, and for them that removes most
 * of the score error (needle at 16k tokens: 0.016 -> 0.013, bf16 keys 0.0064). */
static void quant_rows(struct kvd_seg_head *sh, const uint16_t *k, const uint16_t *v,
		       size_t r0, size_t r1, size_t d)
{
	float cinv[KVD_DMAX];

	for (size_t e = 0; e < d; e++)
		cinv[e] = sh->kscale[e] > 0.0f ? 1.0f / sh->kscale[e] : 0.0f;
	for (size_t i = r0; i < r1; i++) {
		const uint16_t *kr = k + i * d, *vr = v + i * d;
		int8_t *kq = sh->k8 + i * d, *vq = sh->v8 + i * d;
		float z[KVD_DMAX], t = 0.0f, vmx = 0.0f, nn = 0.0f, dot = 0.0f;

		for (size_t e = 0; e < d; e++) {
			z[e] = kvd_bf16_to_f32(kr[e]) * cinv[e];
			t = fmaxf(t, finite_abs(z[e]));
		}
		float ti = t > 0.0f ? 127.0f / t : 0.0f;

		for (size_t e = 0; e < d; e++) {
			kq[e] = quant(z[e], ti);
			float y = sh->kscale[e] * kq[e];

			nn += y * y;
			dot += kvd_bf16_to_f32(kr[e]) * y;
		}
		float f = nn > 0.0f ? dot / nn : 0.0f;

		f = f > 0.0f && f <= FLT_MAX ? f : nn > 0.0f ? 1.0f : 0.0f;
		sh->kfac[i] = f;
		sh->kinv[i] = nn > 0.0f ? 1.0f / (f * sqrtf(nn)) : 0.0f;
		for (size_t e = 0; e < d; e++) {
			float a = finite_abs(kvd_bf16_to_f32(vr[e]));

			vmx = a > vmx ? a : vmx;
		}
		sh->vscale[i] = vmx / 127.0f;
		float vi = vmx > 0.0f ? 127.0f / vmx : 0.0f;

		for (size_t e = 0; e < d; e++)
			vq[e] = quant(kvd_bf16_to_f32(vr[e]), vi);
	}
}

static void seg_build_rows(void *arg, uint32_t task, unsigned worker)
{
	struct seg_build *b = arg;
	struct kvd_seg *s = b->seg;
	uint32_t per = row_tasks(s), h = task / per, chunk = task % per;
	struct kvd_seg_head *sh = &s->h[h];
	size_t n = s->n, d = s->d, r0 = (size_t)chunk * ROWS_PER_TASK;
	size_t r1 = r0 + ROWS_PER_TASK < n ? r0 + ROWS_PER_TASK : n;

	(void)worker;
	if (s->kv_dtype == KVD_KV_INT8) {
		quant_rows(sh, b->k + h * n * d, b->v + h * n * d, r0, r1, d);
	} else {
		memcpy(sh->k + r0 * d, b->k + (h * n + r0) * d, (r1 - r0) * d * sizeof(uint16_t));
		memcpy(sh->v + r0 * d, b->v + (h * n + r0) * d, (r1 - r0) * d * sizeof(uint16_t));
		kvd_kern_get()->kinv(sh->k + r0 * d, r1 - r0, (int)d, sh->kinv + r0);
	}

	char *tab = head_parts(b->g, s->n, s->mem, h).tab;
	size_t tb = kvd_lsh_tables_bytes(s->n, (int)s->K, (int)s->L);
	size_t t0 = tb * chunk / per / 4096 * 4096, t1 = chunk + 1 == per ? tb : tb * (chunk + 1) / per / 4096 * 4096;

	for (size_t off = t0; off < t1; off += 4096)
		tab[off] = 0;
}

/* Phase 2: tables [l0, l0 + TABLES_PER_TASK) of one head from the codes.
 * Tasks of a few dozen tables rather than whole heads keep a pool task (and
 * so what a sliced build makes others wait for) to a few milliseconds even
 * for a full 65536-token segment. */
#define TABLES_PER_TASK 32

static uint32_t table_tasks(const struct kvd_seg *s)
{
	return (s->L + TABLES_PER_TASK - 1) / TABLES_PER_TASK;
}

static void seg_build_tables(void *arg, uint32_t task, unsigned worker)
{
	struct seg_build *b = arg;
	struct kvd_seg *s = b->seg;
	uint32_t per = table_tasks(s), h = task / per, l0 = task % per * TABLES_PER_TASK;
	uint32_t l1 = l0 + TABLES_PER_TASK < s->L ? l0 + TABLES_PER_TASK : s->L;

	kvd_lsh_build_range(&s->h[h].tab, b->codes + (size_t)h * s->L * s->n, s->n, l0, l1);
}

/* With the executor's yield hook set (kvd_pool_set_yield), one head per
 * worker at a time, other clients' requests between the slices. */
static void run_heads(struct kvd_pool *pool, uint32_t H, kvd_pool_fn fn, void *arg)
{
	if (pool) {
		kvd_pool_run_sliced(pool, H, fn, arg);
		return;
	}
	for (uint32_t h = 0; h < H; h++)
		fn(arg, h, 0);
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int kvd_seg_build(const struct kvd_geom *g, uint32_t n, const uint16_t *k,
		  const uint16_t *v, const uint16_t *codes, struct kvd_pool *pool,
		  struct kvd_seg **out)
{
	return kvd_seg_build_node(g, n, k, v, codes, pool, -1, out);
}

int kvd_seg_build_node(const struct kvd_geom *g, uint32_t n, const uint16_t *k,
		       const uint16_t *v, const uint16_t *codes, struct kvd_pool *pool, int node,
		       struct kvd_seg **out)
{
	struct kvd_seg *s;
	int rc = kvd_geom_check(g);

	if (rc)
		return rc;
	if (n < 1 || n > KVD_SEG_MAX)
		return -KVD_EGEOM;
	s = seg_new(g, n);
	if (!s)
		return -ENOMEM;
	s->io = kvd_seg_io_alloc_node(g, n, node, &s->bytes);
	if (!s->io) {
		free(s);
		return -ENOMEM;
	}
	s->mem = (char *)s->io + IO_PAGE;

	struct seg_build b = { g, s, k, v, codes };

	for (uint32_t h = 0; h < g->kv_heads; h++)
		head_layout(g, s, h);
	if (g->kv_dtype == KVD_KV_INT8)
		run_heads(pool, g->kv_heads, seg_build_kscale, &b);
	run_heads(pool, g->kv_heads * row_tasks(s), seg_build_rows, &b);
	kvd_pool_yield();
	double t = now_ms();

	run_heads(pool, g->kv_heads * table_tasks(s), seg_build_tables, &b);
	s->tables_ms = now_ms() - t;
	*out = s;
	return 0;
}

/* 1/|k| as the kernels compute it is 0 or 1/sqrt of a positive float, and
 * a scale is a finite maximum over 127: never negative, NaN or infinite. */
static int kinv_check(const float *kinv, uint32_t n)
{
	uint32_t bad = 0;

	for (uint32_t i = 0; i < n; i++)
		bad |= !(kinv[i] >= 0.0f && kinv[i] <= FLT_MAX);
	return bad ? -KVD_EFORMAT : 0;
}

int kvd_seg_check(const struct kvd_geom *g, uint32_t n, const void *mem)
{
	if (!seg_geom_ok(g, n))
		return -KVD_EGEOM;
	if ((uintptr_t)mem & 63)
		return -EINVAL;
	for (uint32_t h = 0; h < g->kv_heads; h++) {
		/* head_parts() only computes addresses. */
		struct head_parts hp = head_parts(g, n, (void *)mem, h);
		int rc = kinv_check((const float *)hp.kinv, n);

		if (!rc && g->kv_dtype == KVD_KV_INT8)
			rc = kinv_check((const float *)hp.kscale, g->d) |
			     kinv_check((const float *)hp.vscale, n) |
			     kinv_check((const float *)hp.kfac, n);

		if (!rc)
			rc = kvd_lsh_tables_check(hp.tab, n, (int)g->K, (int)g->L);
		if (rc)
			return rc;
	}
	return 0;
}

int kvd_seg_adopt(const struct kvd_geom *g, uint32_t n, void *io, size_t bytes,
		  struct kvd_seg **out)
{
	struct kvd_seg *s;

	if (!seg_geom_ok(g, n))
		return -KVD_EGEOM;
	if (!io || (uintptr_t)io % IO_PAGE || bytes != kvd_seg_io_bytes(g, n))
		return -EINVAL;
	s = seg_new(g, n);
	if (!s)
		return -ENOMEM;
	s->io = io;
	s->mem = (char *)io + IO_PAGE;
	s->bytes = bytes;
	for (uint32_t h = 0; h < g->kv_heads; h++)
		head_layout(g, s, h);
	*out = s;
	return 0;
}

void kvd_seg_free(struct kvd_seg *s)
{
	if (!s)
		return;
	kvd_seg_io_free(s->io, s->bytes);
	free(s);
}

/* ---- scratch ----------------------------------------------------------- */

int kvd_attn_scratch_init(struct kvd_attn_scratch *s, uint32_t cap)
{
	size_t words = (cap + 63) / 64;

	memset(s, 0, sizeof *s);
	if (cap < 1 || cap > KVD_SEG_MAX)
		return -EINVAL;
	s->cap = cap;
	s->bits = calloc(words, sizeof *s->bits);
	s->mask = calloc(cap, sizeof *s->mask);
	s->cand = malloc(cap * sizeof *s->cand);
	s->rows = malloc(cap * sizeof *s->rows);
	s->kinv = malloc(cap * sizeof *s->kinv);
	/* Dense attention reuses s in blocks of DENSE_BLOCK rows. */
	s->s = aligned_alloc(64, ALIGN64((size_t)KVD_GMAX * (cap > 256 ? cap : 256) * sizeof(float)));
	if (!s->bits || !s->mask || !s->cand || !s->rows || !s->kinv || !s->s ||
	    kvd_lsh_scratch_init(&s->lsh, cap)) {
		kvd_attn_scratch_free(s);
		return -ENOMEM;
	}
	return 0;
}

void kvd_attn_scratch_free(struct kvd_attn_scratch *s)
{
	kvd_lsh_scratch_free(&s->lsh);
	free(s->bits);
	free(s->mask);
	free(s->cand);
	free(s->rows);
	free(s->kinv);
	free(s->s);
	memset(s, 0, sizeof *s);
}

/* ---- sampled attention over one segment-head ---------------------------- */

static void empty_result(int G, int d, float *o, float *lse)
{
	memset(o, 0, (size_t)G * d * sizeof(float));
	for (int g = 0; g < G; g++)
		lse[g] = -INFINITY;
}

void kvd_attn_sampled(const struct kvd_kern *kk, const struct kvd_geom *g,
		      const struct kvd_logp_tab *tab, const struct kvd_seg *seg, uint32_t h,
		      const float *q, const uint16_t *qc, struct kvd_attn_scratch *s,
		      float *o, float *lse, struct kvd_attn_stats *st)
{
	const struct kvd_seg_head *sh = &seg->h[h];
	const int G = (int)kvd_geom_group(g), d = (int)g->d, L = (int)g->L;
	const uint32_t n = seg->n, words = (n + 63) / 64;
	uint64_t cand = 0, walked = 0;
	uint32_t m = 0;

	/* Union of the group's candidates: a bit per id for the ascending scan,
	 * and per id the set of q heads that sampled it.  Both are reset from
	 * the union itself, so the cost follows the sample, not n. */
	for (int gi = 0; gi < G; gi++) {
		uint32_t nc = kvd_lsh_candidates(&sh->tab, qc + (size_t)gi * L, (int)g->c,
						 &s->lsh, s->cand);

		cand += nc;
		for (uint32_t i = 0; i < nc; i++) {
			uint32_t id = s->cand[i];

			s->bits[id >> 6] |= 1ull << (id & 63);
			s->mask[id] |= (uint16_t)(1u << gi);
		}
		if (st) {
			const uint16_t *ids;

			for (int t = 0; t < L; t++)
				walked += kvd_lsh_bucket(&sh->tab, (uint32_t)t,
							 qc[(size_t)gi * L + t], &ids);
		}
	}
	for (uint32_t w = 0; w < words; w++) {
		uint64_t x = s->bits[w];

		if (!x)
			continue;
		s->bits[w] = 0;
		do {
			s->rows[m++] = w * 64 + (uint32_t)__builtin_ctzll(x);
			x &= x - 1;
		} while (x);
	}
	if (st) {
		st->cand += cand;
		st->rows += m;
		st->bucket_ids += walked;
	}
	if (m == 0) {
		empty_result(G, d, o, lse);
		return;
	}

	float *sc = s->s;
	const float scale = 1.0f / sqrtf((float)d);

	for (uint32_t i = 0; i < m; i++)
		s->kinv[i] = sh->kinv[s->rows[i]];
	if (seg->kv_dtype == KVD_KV_INT8) {
		/* q . (kscale * k8) = (q * kscale) . k8 */
		float qs[KVD_GMAX * KVD_DMAX];

		for (int gi = 0; gi < G; gi++)
			for (int e = 0; e < d; e++)
				qs[gi * d + e] = q[(size_t)gi * d + e] * sh->kscale[e];
		kk->qk8(qs, G, d, sh->k8, s->rows, m, sc, m);
		for (uint32_t i = 0; i < m; i++) {
			float f = sh->kfac[s->rows[i]];

			for (int gi = 0; gi < G; gi++)
				sc[(size_t)gi * m + i] *= f;
		}
	} else {
		kk->qk(q, G, d, sh->k, s->rows, m, sc, m);
	}
	for (int gi = 0; gi < G; gi++) {
		const float *qg = q + (size_t)gi * d;
		float nn = 0.0f;

		for (int e = 0; e < d; e++)
			nn += qg[e] * qg[e];
		kk->logp(sc + (size_t)gi * m, m, s->kinv, nn > 0.0f ? 1.0f / sqrtf(nn) : 0.0f,
			 scale, tab);
	}
	/* Keys in the union that this q head did not sample weigh nothing. */
	for (uint32_t i = 0; i < m; i++) {
		uint32_t id = s->rows[i];
		unsigned msk = s->mask[id];

		s->mask[id] = 0;
		for (int gi = 0; gi < G; gi++)
			if (!(msk >> gi & 1))
				sc[(size_t)gi * m + i] = -INFINITY;
	}
	float sum[KVD_GMAX];

	for (int gi = 0; gi < G; gi++) {
		float *sg = sc + (size_t)gi * m;
		float mx = kk->max(sg, m);

		if (mx == -INFINITY) {
			memset(sg, 0, m * sizeof(float));
			sum[gi] = 0.0f;
			lse[gi] = -INFINITY;
		} else {
			sum[gi] = kk->expsum(sg, m, mx);
			lse[gi] = mx + logf(sum[gi]);
		}
	}
	memset(o, 0, (size_t)G * d * sizeof(float));
	if (seg->kv_dtype == KVD_KV_INT8) {
		/* Each weight takes its row's value scale; the sums above stay
		 * those of the softmax. */
		for (uint32_t i = 0; i < m; i++)
			s->kinv[i] = sh->vscale[s->rows[i]];
		for (int gi = 0; gi < G; gi++)
			for (uint32_t i = 0; i < m; i++)
				sc[(size_t)gi * m + i] *= s->kinv[i];
		kk->pv8(sc, m, G, d, sh->v8, s->rows, m, o);
	} else {
		kk->pv(sc, m, G, d, sh->v, s->rows, m, o);
	}
	for (int gi = 0; gi < G; gi++) {
		float r = sum[gi] > 0.0f ? 1.0f / sum[gi] : 0.0f;

		for (int e = 0; e < d; e++)
			o[(size_t)gi * d + e] *= r;
	}
}

/* ---- exact attention over contiguous rows ------------------------------- */

#define DENSE_BLOCK 256

/* Contiguous rows of either dtype; for int8 the scales as in kvd_seg_head. */
struct dense_rows {
	const uint16_t *k, *v;
	const int8_t *k8, *v8;
	const float *kscale, *vscale, *kfac;
};

static void dense(const struct kvd_kern *kk, const float *q, int G, int d,
		  const struct dense_rows *rw, size_t n, float *o, float *lse, float *s)
{
	float qs[KVD_GMAX * KVD_DMAX], mx[KVD_GMAX], sum[KVD_GMAX];
	const float scale = 1.0f / sqrtf((float)d);

	if (n == 0) {
		empty_result(G, d, o, lse);
		return;
	}
	/* Scaling q once makes qk produce scores directly. */
	for (int i = 0; i < G * d; i++)
		qs[i] = q[i] * scale * (rw->kscale ? rw->kscale[i % d] : 1.0f);
	for (int gi = 0; gi < G; gi++) {
		mx[gi] = -INFINITY;
		sum[gi] = 0.0f;
	}
	memset(o, 0, (size_t)G * d * sizeof(float));

	for (size_t at = 0; at < n; at += DENSE_BLOCK) {
		size_t b = n - at < DENSE_BLOCK ? n - at : DENSE_BLOCK;

		if (rw->k8) {
			kk->qk8(qs, G, d, rw->k8 + at * d, NULL, b, s, DENSE_BLOCK);
			for (int gi = 0; gi < G; gi++)
				for (size_t i = 0; i < b; i++)
					s[(size_t)gi * DENSE_BLOCK + i] *= rw->kfac[at + i];
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
				for (size_t i = 0; i < b; i++)
					s[(size_t)gi * DENSE_BLOCK + i] *= rw->vscale[at + i];
			kk->pv8(s, DENSE_BLOCK, G, d, rw->v8 + at * d, NULL, b, o);
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

void kvd_attn_dense_seg(const struct kvd_kern *kk, const float *q, int G,
			const struct kvd_seg *seg, uint32_t h, float *o, float *lse, float *s)
{
	const struct kvd_seg_head *sh = &seg->h[h];
	struct dense_rows r = { .k = sh->k, .v = sh->v, .k8 = sh->k8, .v8 = sh->v8,
				.kscale = sh->kscale, .vscale = sh->vscale, .kfac = sh->kfac };

	dense(kk, q, G, (int)seg->d, &r, seg->n, o, lse, s);
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

/* Tasks are (request, part, kv head) with part < nseg a segment and part ==
 * nseg the tail; each writes its own slot of `part_o`/`part_lse`, merged
 * afterwards in part order, so a request's result depends neither on
 * scheduling nor on which other requests share the job. */
struct layer_job {
	struct kvd_attn_scratch *scr;
	const struct kvd_kern *kk;
	struct kvd_attn_req *r;
	uint32_t n;
	const uint32_t *first;              /* [n + 1]: request i owns tasks [first[i], first[i+1]) */
	const size_t *po;                   /* [n]: request i's first float in part_o */
	const size_t *pl;                   /* [n]: and in part_lse */
	float *part_o, *part_lse;
	struct kvd_attn_stats *st;          /* [workers] */
};

static uint32_t nparts_of(const struct kvd_layer_view *lv)
{
	return lv->nseg + (lv->tail_n ? 1 : 0);
}

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
	uint32_t G = kvd_geom_group(g), d = g->d, nparts = nparts_of(lv);
	uint32_t h = task / nparts, part = task % nparts;
	const float *q = r->q + (size_t)h * G * d;
	float *o = j->part_o + j->po[ri] + (size_t)task * G * d;
	float *lse = j->part_lse + j->pl[ri] + (size_t)task * G;
	struct kvd_attn_scratch *s = &j->scr[worker];

	if (part < lv->nseg && r->tab) {
		kvd_attn_sampled(j->kk, g, r->tab, lv->seg[part], h, q,
				 r->qc + (size_t)h * G * g->L, s, o, lse,
				 j->st ? &j->st[worker] : NULL);
	} else if (part < lv->nseg) {
		kvd_attn_dense_seg(j->kk, q, (int)G, lv->seg[part], h, o, lse, s->s);
	} else {
		size_t off = (size_t)h * (lv->tail_cap ? lv->tail_cap : lv->tail_n) * d;

		kvd_attn_dense(j->kk, q, (int)G, (int)d, lv->tail_k + off, lv->tail_v + off,
			       lv->tail_n, o, lse, s->s);
	}
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
	for (uint32_t i = 0; i < lv->nseg; i++)
		if (lv->seg[i]->kv_heads != g->kv_heads || lv->seg[i]->d != g->d ||
		    lv->seg[i]->K != g->K || lv->seg[i]->L != g->L ||
		    lv->seg[i]->kv_dtype != g->kv_dtype || lv->seg[i]->n > scr[0].cap)
			return -KVD_ESHAPE;
	return 0;
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
			tasks = nparts_of(r[i].lv) * r[i].g->kv_heads;
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

	float *part_o = malloc((no + nl) * sizeof(float));

	if (!part_o) {
		for (uint32_t i = 0; i < n; i++)
			r[i].rc = r[i].rc ? r[i].rc : -ENOMEM;
		return -ENOMEM;
	}
	memset(wst, 0, sizeof wst);
	struct layer_job j = {
		.scr = scr, .kk = kk, .r = r, .n = n, .first = first, .po = po, .pl = pl,
		.part_o = part_o, .part_lse = part_o + no, .st = st ? wst : NULL,
	};

	kvd_pool_run(pool, first[n], layer_task, &j);

	for (uint32_t i = 0; i < n; i++) {
		const struct kvd_geom *g = r[i].g;
		uint32_t G, d, nparts;

		if (r[i].rc)
			continue;
		G = kvd_geom_group(g);
		d = g->d;
		nparts = nparts_of(r[i].lv);
		for (uint32_t h = 0; h < g->kv_heads; h++) {
			float *oh = r[i].o + (size_t)h * G * d, *lh = r[i].lse + (size_t)h * G;

			empty_result((int)G, (int)d, oh, lh);
			for (uint32_t p = 0; p < nparts; p++) {
				uint32_t t = h * nparts + p;

				kvd_attn_merge(oh, lh, part_o + po[i] + (size_t)t * G * d,
					       part_o + no + pl[i] + (size_t)t * G, (int)G, (int)d);
			}
		}
	}
	if (st) {
		memset(st, 0, sizeof *st);
		for (unsigned w = 0; w < nw; w++) {
			st->cand += wst[w].cand;
			st->rows += wst[w].rows;
			st->bucket_ids += wst[w].bucket_ids;
		}
	}
	free(part_o);
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
