/* Segments: layout, build (with int8 quantization), check, adopt and io
 * buffers.  See seg.h for the contract. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "seg.h"
#include "bf16.h"
#include "err.h"
#include "invariant.h"
#include "kern.h"
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
	if (g->kv_dtype > KVD_KV_DTYPE_MAX || g->moments > 1)
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
 * bf16 1/|k| [n], for int8 the key scales [d] and the rows' kvd_row8 [n] (in
 * room for three float arrays: the layout before spill format 4, which
 * kvd_seg_upgrade_r8 rewrites in place), then the tables.  One function so
 * that build, check, adopt and the byte count cannot disagree. */
struct head_parts {
	char *k, *v, *kscale, *r8, *kinv, *tab;
	size_t bytes;
};

/* Offsets are summed as numbers and added to p only when there is one:
 * head_bytes() asks with p NULL, and an offset added to a null pointer is
 * undefined (UBSan's fuzz build reported it). */
static struct head_parts head_parts_at(const struct kvd_geom *g, uint32_t n, char *p)
{
	int i8 = g->kv_dtype == KVD_KV_INT8;
	size_t rows = ALIGN64((size_t)n * g->d * (i8 ? 1 : sizeof(uint16_t)));
	size_t vec = ALIGN64((size_t)n * sizeof(float));
	size_t o = 2 * rows, kscale = 0, r8 = 0, kinv = 0;
	struct head_parts hp = { 0 };

	if (i8) {
		kscale = o;
		o += ALIGN64((size_t)g->d * sizeof(float));
		r8 = o;
		o += 3 * vec;
	} else {
		kinv = o;
		o += vec;
	}
	hp.bytes = o + kvd_lsh_tables_bytes(n, (int)g->K, (int)g->L);
	if (p) {
		hp.k = p;
		hp.v = p + rows;
		hp.kscale = i8 ? p + kscale : NULL;
		hp.r8 = i8 ? p + r8 : NULL;
		hp.kinv = i8 ? NULL : p + kinv;
		hp.tab = p + o;
	}
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
	       g->moments <= 1 &&
	       n >= 1 && n <= KVD_SEG_MAX;
}

#define PAGE_UP(x) (((x) + IO_PAGE - 1) & ~(IO_PAGE - 1))

/* The moments of every head, where the geometry asks for them: ksum,
 * kv_row and kv_col (d floats each) then kv (d*d bytes), 12d + d^2 bytes,
 * a multiple of 64 for d a multiple of 16. */
static size_t mom_bytes(const struct kvd_geom *g)
{
	return g->moments ? 3 * sizeof(float) * g->d + (size_t)g->d * g->d : 0;
}

/* Points sh's moments at m (mom_bytes(g) bytes). */
static void mom_layout(struct kvd_seg_head *sh, char *m, size_t d)
{
	sh->ksum = (float *)m;
	sh->kv_row = sh->ksum + d;
	sh->kv_col = sh->kv_row + d;
	sh->kv = (int8_t *)(sh->kv_col + d);
}

/* Where they lie in the io buffer: past the payload's last page, so that a
 * read of the segment's extent (header page, payload pages) never reaches
 * them, and what is charged for the buffer covers them. */
static size_t mom_off(const struct kvd_geom *g, uint32_t n)
{
	return IO_PAGE + PAGE_UP(kvd_seg_bytes(g, n));
}

size_t kvd_seg_io_bytes(const struct kvd_geom *g, uint32_t n)
{
	if (!seg_geom_ok(g, n))
		return 0;
	/* At most 1024 heads of ~330 MiB: far from overflowing. */
	return mom_off(g, n) + PAGE_UP(g->kv_heads * mom_bytes(g));
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
		sh->r8 = (struct kvd_row8 *)hp.r8;
	} else {
		sh->k = (uint16_t *)hp.k;
		sh->v = (uint16_t *)hp.v;
		sh->kinv = (float *)hp.kinv;
	}
	(void)kvd_lsh_tables_layout(&sh->tab, hp.tab, s->n, (int)s->K, (int)s->L);
	if (g->moments)
		mom_layout(sh, (char *)s->io + mom_off(g, s->n) + h * mom_bytes(g), g->d);
}

static struct kvd_seg *seg_new(const struct kvd_geom *g, uint32_t n)
{
	size_t hb = g->kv_heads * sizeof(struct kvd_seg_head);
	struct kvd_seg *s = calloc(1, sizeof *s + hb + (size_t)g->kv_heads * g->d * sizeof(float));

	if (!s)
		return NULL;
	for (uint32_t h = 0; h < g->kv_heads; h++)
		s->h[h].vsum = (float *)((char *)s->h + hb) + (size_t)h * g->d;
	s->n = n;
	s->refs = 1;
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
	size_t ld;                      /* rows between heads in k, v and codes' tables */
	double *vpart;                  /* [kv_heads][2][row_tasks][d]: each row task's V
					 * sums, then its K sums */
	float *mpart;                   /* [kv_heads][row_tasks][d*d]: its k v^T sums */
};

/* ---- V sums -------------------------------------------------------------- */

/* A head's V sums are defined chunk by chunk: rows [r0, r1) of each chunk
 * of VSUM_ROWS summed in double in row order, the chunks' sums added in
 * order, rounded to float once.  The build's row tasks each make one
 * chunk's sum and a restore makes them all on one thread; both get the
 * same bits, so a restored segment answers as the one that was built. */
#define VSUM_ROWS 4096u

static void vsum_chunk(const struct kvd_seg_head *sh, int i8, size_t d, size_t r0, size_t r1,
		       double *acc)
{
	for (size_t e = 0; e < d; e++)
		acc[e] = 0.0;
	for (size_t i = r0; i < r1; i++) {
		if (i8) {
			double f = sh->r8[i].vscale;

			for (size_t e = 0; e < d; e++)
				acc[e] += f * sh->v8[i * d + e];
		} else {
			for (size_t e = 0; e < d; e++)
				acc[e] += kvd_bf16_to_f32(sh->v[i * d + e]);
		}
	}
}

static void vsum_reduce(const double *part, uint32_t chunks, size_t d, float *out)
{
	for (size_t e = 0; e < d; e++) {
		double t = 0.0;

		for (uint32_t c = 0; c < chunks; c++)
			t += part[c * d + e];
		out[e] = (float)t;
	}
}

/* ---- moments (hybrid_lcv) ----------------------------------------------- */

/* Defined chunk by chunk as the V sums are: a chunk's k v^T summed in
 * float by the kernel (kern.h mom), its K sums in double in row order, the
 * chunks' sums added in double in order and rounded to float once; the
 * build's row tasks and a restore get the same bits. */
#define MOM_BLOCK 32u

static void row_f32(const struct kvd_seg_head *sh, int i8, size_t d, size_t i, float *k, float *v)
{
	if (i8) {
		float kf = sh->r8[i].kfac, vf = sh->r8[i].vscale;

		for (size_t e = 0; e < d; e++) {
			k[e] = kf * sh->kscale[e] * sh->k8[i * d + e];
			v[e] = vf * sh->v8[i * d + e];
		}
	} else {
		for (size_t e = 0; e < d; e++) {
			k[e] = kvd_bf16_to_f32(sh->k[i * d + e]);
			v[e] = kvd_bf16_to_f32(sh->v[i * d + e]);
		}
	}
}

static void mom_chunk(const struct kvd_seg_head *sh, int i8, size_t d, size_t r0, size_t r1,
		      double *ks, float *kv)
{
	const struct kvd_kern *kk = kvd_kern_get();
	float kb[MOM_BLOCK * KVD_DMAX], vb[MOM_BLOCK * KVD_DMAX];

	memset(kv, 0, d * d * sizeof *kv);
	for (size_t e = 0; e < d; e++)
		ks[e] = 0.0;
	for (size_t i0 = r0; i0 < r1; i0 += MOM_BLOCK) {
		size_t r = r1 - i0 < MOM_BLOCK ? r1 - i0 : MOM_BLOCK;

		for (size_t i = 0; i < r; i++) {
			row_f32(sh, i8, d, i0 + i, kb + i * d, vb + i * d);
			for (size_t e = 0; e < d; e++)
				ks[e] += kb[i * d + e];
		}
		kk->mom(kb, vb, r, (int)d, kv);
	}
}

/*
 * Head sh's moments from acc, the double sums over its n rows of k v^T
 * ([d][d], f major) then of k ([d]); sh->vsum is already made.  The cross
 * moment is kept centered, C = sum k v^T - ksum vsum^T / n: attention needs
 * only C q (the line's slope term, engine/attn.c), and uncentered the
 * large common part ksum vsum^T / n would cancel in it after rounding.  C
 * is kept in int8 under a scale per row and per column, C[f][e] ~ kv[f][e]
 * kv_row[f] kv_col[e], each entry within kv_row[f] kv_col[e] / 2: a quarter
 * of a float matrix's bytes, which every step reads cold.  A non-finite
 * entry (a client's NaN or infinite rows) makes its column's scale NaN, so
 * the product's entry is NaN as a float matrix's would be.  acc is
 * overwritten.  Build and restore both end here, so their bits agree.
 */
static void mom_store(struct kvd_seg_head *sh, double *acc, uint32_t n, size_t d)
{
	for (size_t e = 0; e < d; e++)
		sh->ksum[e] = (float)acc[d * d + e];
	for (size_t e = 0; e < d; e++) {
		double mx = 0.0;

		for (size_t f = 0; f < d; f++) {
			double *c = &acc[f * d + e];

			*c -= (double)sh->ksum[f] * sh->vsum[e] / n;
			mx = isfinite(*c) && isfinite(mx) ? fmax(mx, fabs(*c)) : NAN;
		}
		sh->kv_col[e] = (float)mx;
	}
	for (size_t f = 0; f < d; f++) {
		double mx = 0.0;

		for (size_t e = 0; e < d; e++)
			if (sh->kv_col[e] > 0.0f)
				mx = fmax(mx, fabs(acc[f * d + e]) / sh->kv_col[e]);
		sh->kv_row[f] = (float)(mx / 127.0);
		for (size_t e = 0; e < d; e++) {
			double u = (double)sh->kv_row[f] * sh->kv_col[e], x = 0.0;

			if (u > 0.0) {
				x = nearbyint(acc[f * d + e] / u);
				x = x > 127.0 ? 127.0 : x < -127.0 ? -127.0 : x;
			}
			sh->kv[f * d + e] = (int8_t)x;
		}
	}
}

/* The chunks' parts (ks [chunks][d], kv [chunks][d*d]) summed in double in
 * chunk order into acc ([d*d + d]), as mom_head sums them. */
static void mom_reduce(const double *ks, const float *kv, uint32_t chunks, size_t d,
		       double *acc)
{
	for (size_t e = 0; e < d; e++) {
		double t = 0.0;

		for (uint32_t c = 0; c < chunks; c++)
			t += ks[c * d + e];
		acc[d * d + e] = t;
	}
	for (size_t x = 0; x < d * d; x++) {
		double t = 0.0;

		for (uint32_t c = 0; c < chunks; c++)
			t += kv[c * d * d + x];
		acc[x] = t;
	}
}

/* Every chunk on this thread: ~d*d FMAs a row. */
static int mom_head(struct kvd_seg_head *sh, int i8, size_t n, size_t d)
{
	uint32_t chunks = (uint32_t)((n + VSUM_ROWS - 1) / VSUM_ROWS);
	double *acc = calloc(d * d + d, sizeof *acc), ks[KVD_DMAX];
	float *part = malloc(d * d * sizeof *part);

	if (!acc || !part) {
		free(acc);
		free(part);
		return -ENOMEM;
	}
	for (uint32_t c = 0; c < chunks; c++) {
		size_t r0 = (size_t)c * VSUM_ROWS, r1 = r0 + VSUM_ROWS < n ? r0 + VSUM_ROWS : n;

		mom_chunk(sh, i8, d, r0, r1, ks, part);
		for (size_t e = 0; e < d; e++)
			acc[d * d + e] += ks[e];
		for (size_t x = 0; x < d * d; x++)
			acc[x] += part[x];
	}
	mom_store(sh, acc, (uint32_t)n, d);
	free(acc);
	free(part);
	return 0;
}

static void vsum_head(const struct kvd_seg_head *sh, int i8, size_t n, size_t d, float *out)
{
	uint32_t chunks = (uint32_t)((n + VSUM_ROWS - 1) / VSUM_ROWS);
	double part[KVD_DMAX], acc[KVD_DMAX];

	for (size_t e = 0; e < d; e++)
		acc[e] = 0.0;
	for (uint32_t c = 0; c < chunks; c++) {
		size_t r0 = (size_t)c * VSUM_ROWS, r1 = r0 + VSUM_ROWS < n ? r0 + VSUM_ROWS : n;

		vsum_chunk(sh, i8, d, r0, r1, part);
		for (size_t e = 0; e < d; e++)
			acc[e] += part[e];
	}
	for (size_t e = 0; e < d; e++)
		out[e] = (float)acc[e];
}

/* Phase 1, per (head, chunk of ROWS_PER_TASK rows): copy the rows, 1/|k|,
 * and fault in the same share of the head's table memory on this worker
 * (the tables phase then does only the counting sort).  Chunks rather than
 * whole heads: copying into fresh pages is most of a seal, and a task of a
 * few milliseconds is what a sliced build makes others wait for. */
#define ROWS_PER_TASK 4096u
_Static_assert(ROWS_PER_TASK == VSUM_ROWS, "a row task makes one chunk's V sums");

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

/* Round to nearest (ties to even, as lrintf) of x * inv, saturated to
 * [-127, 127]; written so that NaN lands on -127 (a conversion of NaN would
 * be anything).  Adding and taking away 1.5 * 2^23 rounds a float of
 * magnitude below 2^22 to an integer in the current (nearest) mode without
 * a libm call: lrintf and fmaxf were calls per element, and an int8 seal
 * of 1024 rows took 6x a bf16 one. */
static inline int8_t quant(float x, float inv)
{
	const float magic = 12582912.0f;
	float y = x * inv;

	y = y > 127.0f ? 127.0f : y >= -127.0f ? y : -127.0f;
	return (int8_t)(int)((y + magic) - magic);
}

/* One key row on the grid of channel scales ks (cinv = 1 / ks, 0 where ks
 * is): the row's int8 codes into kq, and the sums a least-squares factor
 * needs, *dot = k.y and *nn = |y|^2 with y = ks * kq.  The one place a key
 * row is rounded, so the scale search below scores what the build stores. */
static void quant_key(const uint16_t *kr, const float *ks, const float *cinv, size_t d,
		      int8_t *kq, float *dot, float *nn)
{
	float z[KVD_DMAX], t = 0.0f, dt = 0.0f, nt = 0.0f;

	for (size_t e = 0; e < d; e++) {
		z[e] = kvd_bf16_to_f32(kr[e]) * cinv[e];
		float a = finite_abs(z[e]);

		t = a > t ? a : t;
	}
	float ti = t > 0.0f ? 127.0f / t : 0.0f;

	for (size_t e = 0; e < d; e++) {
		kq[e] = quant(z[e], ti);
		float y = ks[e] * kq[e];

		nt += y * y;
		dt += kvd_bf16_to_f32(kr[e]) * y;
	}
	*dot = dt;
	*nn = nt;
}

/* How strongly the channel scales follow the channels' ranges: kscale[e] is
 * M (mx[e] / M)^a / 127, M the largest mx.  a = 1 brings every channel to
 * the same range; smaller a leaves outlier channels partly larger, which
 * costs the rows that have outliers (their grid is set by them) and spares
 * those that have none (their outlier channels are not rounded on a grid
 * made for the outliers).  Which side matters depends on the keys, so each
 * segment head takes the a with the smallest mean relative error of its
 * rows, over a sample of KSCALE_SAMPLE of them.  On the synthetic layers
 * (docs/WORKLOADS.md) it picks 3/4 and cuts needle's output error from int8
 * keys by a sixth against a = 1, moving dense and mixed by 1e-4 at most. */
static const float kscale_pow[] = { 1.0f, 0.75f, 0.5f, 0.25f, 0.0f };
#define KSCALE_SAMPLE 256u

static void kscale_of(const float *mx, float M, size_t d, float a, float *ks, float *cinv)
{
	for (size_t e = 0; e < d; e++) {
		ks[e] = mx[e] <= 0.0f ? 0.0f : a == 1.0f ? mx[e] / 127.0f : M * powf(mx[e] / M, a) / 127.0f;
		cinv[e] = ks[e] > 0.0f ? 1.0f / ks[e] : 0.0f;
	}
}

/* Mean over sampled rows of |k - k~|^2 / |k|^2, k~ with its least-squares
 * factor: 1 - (k.y)^2 / (|k|^2 |y|^2), in double. */
static double kscale_err(const uint16_t *k, size_t n, size_t d, const float *ks, const float *cinv)
{
	size_t step = n > KSCALE_SAMPLE ? n / KSCALE_SAMPLE : 1, rows = 0;
	double sum = 0.0;
	int8_t kq[KVD_DMAX];

	for (size_t i = 0; i < n; i += step) {
		const uint16_t *kr = k + i * d;
		double kk = 0.0;
		float dot, nn;

		for (size_t e = 0; e < d; e++) {
			double x = kvd_bf16_to_f32(kr[e]);

			kk += x <= DBL_MAX && x >= -DBL_MAX ? x * x : 0.0;
		}
		if (!(kk > 0.0 && kk <= DBL_MAX))
			continue;
		quant_key(kr, ks, cinv, d, kq, &dot, &nn);
		rows++;
		sum += nn > 0.0f && dot <= FLT_MAX && dot >= -FLT_MAX
			       ? fmax(0.0, 1.0 - (double)dot * dot / (kk * nn)) : 1.0;
	}
	return rows ? sum / (double)rows : 0.0;
}

/* Phase 0 of an int8 build, one task per head: the per-channel key scales,
 * which every row chunk of phase 1 needs. */
static void seg_build_kscale(void *arg, uint32_t h, unsigned worker)
{
	struct seg_build *b = arg;
	struct kvd_seg *s = b->seg;
	size_t n = s->n, d = s->d;
	const uint16_t *k = b->k + h * b->ld * d;
	float mx[KVD_DMAX] = { 0 }, ks[KVD_DMAX], cinv[KVD_DMAX];
	float M = 0.0f;
	double best = INFINITY;

	(void)worker;
	for (size_t i = 0; i < n; i++)
		for (size_t e = 0; e < d; e++) {
			float a = finite_abs(kvd_bf16_to_f32(k[i * d + e]));

			mx[e] = a > mx[e] ? a : mx[e];
		}
	for (size_t e = 0; e < d; e++)
		M = mx[e] > M ? mx[e] : M;
	/* Ties keep the earlier (larger) power: a = 1 unless another is better. */
	for (size_t j = 0; j < sizeof kscale_pow / sizeof kscale_pow[0]; j++) {
		kscale_of(mx, M, d, kscale_pow[j], ks, cinv);
		double err = kscale_err(k, n, d, ks, cinv);

		if (err < best) {
			best = err;
			memcpy(s->h[h].kscale, ks, d * sizeof *ks);
		}
	}
}

/* Keys in two levels: the channel scales narrow the outlier channels'
 * range to (about) the others', then each row is rounded on its own grid, so a
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
		const uint16_t *vr = v + i * d;
		int8_t *vq = sh->v8 + i * d;
		float vmx = 0.0f, nn, dot;

		quant_key(k + i * d, sh->kscale, cinv, d, sh->k8 + i * d, &dot, &nn);
		float f = nn > 0.0f ? dot / nn : 0.0f;

		f = f > 0.0f && f <= FLT_MAX ? f : nn > 0.0f ? 1.0f : 0.0f;
		sh->r8[i].kfac = f;
		sh->r8[i].kinv = nn > 0.0f ? 1.0f / (f * sqrtf(nn)) : 0.0f;
		for (size_t e = 0; e < d; e++) {
			float a = finite_abs(kvd_bf16_to_f32(vr[e]));

			vmx = a > vmx ? a : vmx;
		}
		sh->r8[i].vscale = vmx / 127.0f;
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
		quant_rows(sh, b->k + h * b->ld * d, b->v + h * b->ld * d, r0, r1, d);
	} else {
		memcpy(sh->k + r0 * d, b->k + (h * b->ld + r0) * d, (r1 - r0) * d * sizeof(uint16_t));
		memcpy(sh->v + r0 * d, b->v + (h * b->ld + r0) * d, (r1 - r0) * d * sizeof(uint16_t));
		kvd_kern_get()->kinv(sh->k + r0 * d, r1 - r0, (int)d, sh->kinv + r0);
	}
	vsum_chunk(sh, s->kv_dtype == KVD_KV_INT8, d, r0, r1,
		   b->vpart + ((size_t)h * 2 * per + chunk) * d);
	if (b->mpart)
		mom_chunk(sh, s->kv_dtype == KVD_KV_INT8, d, r0, r1,
			  b->vpart + (((size_t)h * 2 + 1) * per + chunk) * d,
			  b->mpart + ((size_t)h * per + chunk) * d * d);

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

	kvd_lsh_build_range(&s->h[h].tab, b->codes + (size_t)h * s->L * b->ld, b->ld, l0, l1);
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

/* A segment's buffer is made on the pool, as a one-task sliced job, and
 * the executor answers others meanwhile (kvd_pool_set_wait): a mapping
 * waits for the address space's lock behind every fault and populate in
 * flight (0.7 ms median beside a big APPEND on 2 cores), and a smaller
 * buffer is zeroed, its fresh pages faulted one by one (there 1.2 ms on
 * average from the segment's charge to its prefault).  Below this, not
 * worth a pool job. */
#define IO_ALLOC_POOL (64u << 10)
struct io_alloc {
	const struct kvd_geom *g;
	uint32_t n;
	int node;
	size_t bytes;
	void *io;
};

static void io_alloc_task(void *arg, uint32_t task, unsigned worker)
{
	struct io_alloc *a = arg;

	(void)task;
	(void)worker;
	a->io = kvd_seg_io_alloc_node(a->g, a->n, a->node, &a->bytes);
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
	return kvd_seg_build_node(g, n, n, k, v, codes, pool, -1, out);
}

int kvd_seg_build_node(const struct kvd_geom *g, uint32_t n, uint32_t ld, const uint16_t *k,
		       const uint16_t *v, const uint16_t *codes, struct kvd_pool *pool, int node,
		       struct kvd_seg **out)
{
	struct kvd_seg *s;
	int rc = kvd_geom_check(g);

	if (rc)
		return rc;
	if (n < 1 || n > KVD_SEG_MAX || ld < n)
		return -KVD_EGEOM;
	s = seg_new(g, n);
	if (!s)
		return -ENOMEM;
	struct io_alloc ia = { g, n, node, 0, NULL };

	if (kvd_seg_io_bytes(g, n) >= IO_ALLOC_POOL)
		run_heads(pool, 1, io_alloc_task, &ia);
	else
		io_alloc_task(&ia, 0, 0);
	s->io = ia.io;
	s->bytes = ia.bytes;
	if (!s->io) {
		free(s);
		return -ENOMEM;
	}
	s->mem = (char *)s->io + IO_PAGE;
	kvd_pool_prefault(pool, s->io, s->bytes);

	size_t parts = (size_t)g->kv_heads * row_tasks(s);
	struct seg_build b = { g, s, k, v, codes, ld, calloc(parts * 2 * g->d, sizeof(double)),
			       g->moments ? malloc(parts * g->d * g->d * sizeof(float)) : NULL };
	double *macc = g->moments ? malloc((g->d * g->d + g->d) * sizeof *macc) : NULL;

	if (!b.vpart || (g->moments && (!b.mpart || !macc))) {
		free(b.vpart);
		free(b.mpart);
		free(macc);
		kvd_seg_free(s);
		return -ENOMEM;
	}
	for (uint32_t h = 0; h < g->kv_heads; h++)
		head_layout(g, s, h);
	if (g->kv_dtype == KVD_KV_INT8)
		run_heads(pool, g->kv_heads, seg_build_kscale, &b);
	run_heads(pool, g->kv_heads * row_tasks(s), seg_build_rows, &b);
	for (uint32_t h = 0; h < g->kv_heads; h++) {
		const double *vp = b.vpart + (size_t)h * 2 * row_tasks(s) * g->d;

		vsum_reduce(vp, row_tasks(s), g->d, s->h[h].vsum);
		if (g->moments) {
			mom_reduce(vp + (size_t)row_tasks(s) * g->d,
				   b.mpart + (size_t)h * row_tasks(s) * g->d * g->d, row_tasks(s),
				   g->d, macc);
			mom_store(&s->h[h], macc, n, g->d);
		}
	}
	free(b.vpart);
	free(b.mpart);
	free(macc);
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
		int rc = g->kv_dtype == KVD_KV_INT8 ?
				 kinv_check((const float *)hp.kscale, g->d) |
					 kinv_check((const float *)hp.r8, 3 * n) :
				 kinv_check((const float *)hp.kinv, n);

		if (!rc)
			rc = kvd_lsh_tables_check(hp.tab, n, (int)g->K, (int)g->L);
		if (rc)
			return rc;
	}
	return 0;
}

int kvd_seg_upgrade_r8(const struct kvd_geom *g, uint32_t n, void *mem)
{
	size_t vec = ALIGN64((size_t)n * sizeof(float));
	float *old;

	if (!seg_geom_ok(g, n))
		return -KVD_EGEOM;
	if (g->kv_dtype != KVD_KV_INT8)
		return 0;
	old = malloc(3 * vec);
	if (!old)
		return -ENOMEM;
	for (uint32_t h = 0; h < g->kv_heads; h++) {
		struct head_parts hp = head_parts(g, n, mem, h);
		struct kvd_row8 *r8 = (struct kvd_row8 *)hp.r8;
		const float *vscale = old, *kfac = old + vec / 4, *kinv = old + 2 * vec / 4;

		memcpy(old, hp.r8, 3 * vec);
		memset(hp.r8, 0, 3 * vec);
		for (uint32_t i = 0; i < n; i++)
			r8[i] = (struct kvd_row8){ .kinv = kinv[i], .kfac = kfac[i],
						   .vscale = vscale[i] };
	}
	free(old);
	return 0;
}

int kvd_seg_sums(const struct kvd_geom *g, uint32_t n, void *io, float *vsum)
{
	for (uint32_t h = 0; h < g->kv_heads; h++) {
		struct head_parts hp = head_parts(g, n, (char *)io + IO_PAGE, h);
		struct kvd_seg_head sh = {
			.k = (uint16_t *)hp.k, .v = (uint16_t *)hp.v, .k8 = (int8_t *)hp.k,
			.v8 = (int8_t *)hp.v, .kscale = (float *)hp.kscale,
			.r8 = (struct kvd_row8 *)hp.r8, .vsum = vsum + (size_t)h * g->d,
		};
		int rc;

		if (g->moments)
			mom_layout(&sh, (char *)io + mom_off(g, n) + h * mom_bytes(g), g->d);
		vsum_head(&sh, g->kv_dtype == KVD_KV_INT8, n, g->d, vsum + (size_t)h * g->d);
		if (g->moments && (rc = mom_head(&sh, g->kv_dtype == KVD_KV_INT8, n, g->d)))
			return rc;
	}
	return 0;
}

int kvd_seg_adopt(const struct kvd_geom *g, uint32_t n, void *io, size_t bytes,
		  const float *vsum, struct kvd_seg **out)
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
	for (uint32_t h = 0; h < g->kv_heads; h++) {
		head_layout(g, s, h);
		if (vsum) {
			memcpy(s->h[h].vsum, vsum + (size_t)h * g->d, g->d * sizeof(float));
		} else {
			vsum_head(&s->h[h], g->kv_dtype == KVD_KV_INT8, n, g->d, s->h[h].vsum);
			if (g->moments &&
			    mom_head(&s->h[h], g->kv_dtype == KVD_KV_INT8, n, g->d)) {
				free(s);        /* io is the caller's still */
				return -ENOMEM;
			}
		}
	}
	*out = s;
	return 0;
}

void kvd_seg_free(struct kvd_seg *s)
{
	/* Each holder drops the one reference it took (kvd_seg_ref, or the
	 * build's): none left is a second drop, and the segment is gone. */
	if (!s || NEVER(s->refs == 0) || --s->refs)
		return;
	kvd_seg_io_free(s->io, s->bytes);
	free(s);
}
