/* AVX-512 kernels (F/BW/VL/DQ).  kvd_kern_avx512 executes no AVX512_BF16
 * or VNNI instruction; kvd_kern_avx512bf16 differs only in qk, which uses
 * VDPBF16PS, and kvd_kern_avx512vnni only in qk8 and pv8, which use
 * VPDPWSSD (kern_avx512vnni.c).
 *
 * bf16 -> f32 is done 32 elements at a time without shuffles: a 64-byte row
 * chunk read as 16 u32 holds the pairs (2k, 2k+1); `<< 16` yields the even
 * elements and `& 0xffff0000` the odd ones.  qk reorders q once per call to
 * match, pv keeps its accumulators in that order and restores o's order at
 * the end.  A d that is an odd multiple of 16 ends with a half chunk whose
 * upper 16 lanes are zero.
 *
 * Stack use is at most ~48 KiB per call (hash); nothing is allocated.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kern.h"
#include "kern_mom.h"
#include "lsh.h"

#define INLINE static inline __attribute__((always_inline))

#define GB_MAX 8        /* q heads per register-resident group */

static inline size_t round32(int d)
{
	return ((size_t)d + 31) & ~(size_t)31;
}

#include "kern_walk.h"


/* Chunk c (64 bytes) of row p; prefetch_last: the row's last line, which a
 * row that is not 64-byte aligned has beyond its d/32 chunk starts. */
INLINE void prefetch_chunk(const uint16_t *p, int c)
{
	_mm_prefetch((const char *)(p + 32 * c), _MM_HINT_T1);
}

INLINE void prefetch_last(const uint16_t *p, int d)
{
	_mm_prefetch((const char *)(p + d - 1), _MM_HINT_T1);
}

/* ---- shared pieces ------------------------------------------------------ */

INLINE __m512i load_chunk(const uint16_t *p, int half)
{
	if (half)
		return _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p));
	return _mm512_loadu_si512(p);
}

INLINE void bf16_eo(__m512i v, __m512 *e, __m512 *o)
{
	*e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
	*o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

static const int32_t perm_even[16] = { 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30 };
static const int32_t perm_odd[16] = { 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31 };
static const int32_t perm_lo[16] = { 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23 };
static const int32_t perm_hi[16] = { 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31 };

/* dst[32c .. 32c+32) = (even elements, odd elements) of src's chunk c; the
 * missing half of a half chunk is zero.  dst has round_up(d, 32) floats. */
static void deinterleave(float *dst, const float *src, int d)
{
	__m512i pe = _mm512_loadu_si512(perm_even), po = _mm512_loadu_si512(perm_odd);

	for (int c = 0; c < d; c += 32) {
		__m512 a = _mm512_loadu_ps(src + c);
		__m512 b = c + 16 < d ? _mm512_loadu_ps(src + c + 16) : _mm512_setzero_ps();

		_mm512_store_ps(dst + c, _mm512_permutex2var_ps(a, pe, b));
		_mm512_store_ps(dst + c + 16, _mm512_permutex2var_ps(a, po, b));
	}
}

static void interleave(float *dst, const float *src, int d)
{
	__m512i pl = _mm512_loadu_si512(perm_lo), ph = _mm512_loadu_si512(perm_hi);

	for (int c = 0; c < d; c += 32) {
		__m512 e = _mm512_load_ps(src + c), o = _mm512_load_ps(src + c + 16);

		_mm512_storeu_ps(dst + c, _mm512_permutex2var_ps(e, pl, o));
		if (c + 16 < d)
			_mm512_storeu_ps(dst + c + 16, _mm512_permutex2var_ps(e, ph, o));
	}
}

/* Lane j of the result = sum of the lanes of v[j], for 16 vectors: a
 * transposing tree, 45 instructions for 16 dot products. */
INLINE __m512 hsum16(const __m512 *v)
{
	__m512 a[8], b[4], c[2];

#pragma GCC unroll 8
	for (int k = 0; k < 8; k++)
		a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
				     _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
#pragma GCC unroll 4
	for (int k = 0; k < 4; k++) {
		__m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);

		b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
				     _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
	}
#pragma GCC unroll 2
	for (int k = 0; k < 2; k++)
		c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
				     _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
	return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
			     _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The kernels below take the head-group size GB as a first argument and are
 * instantiated once per value (name_1 .. name_8, listed in a table indexed
 * by GB - 1), so that GB is a constant in each and its accumulators live in
 * registers. */
#define BY_GB(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8)
#define BY_GB_NAMES(name) { name##_1, name##_2, name##_3, name##_4, \
			    name##_5, name##_6, name##_7, name##_8 }

/* ---- qk ---------------------------------------------------------------- */

/* Dot products of GB heads with the rows of a tile.  NR rows at a time share
 * each load of q: with one load of q per FMA the L1 was too busy to take
 * fills from memory at full speed.  An accumulator's FMAs form a chain (4
 * cycles each), two FMAs per chunk.  Every (row, head) sum takes the same
 * chain whatever GB is, so a score does not depend on how many heads were
 * scored with it (kern.h's promise; the hybrid estimator once scored a
 * group's union at G heads and had to agree bit for bit with magicpig's
 * heads alone).  Splitting even and odd elements over two
 * accumulators for GB <= 2, as this once did for the FMA ports' sake, broke
 * that.  GB = 1 is the gathered path, bound by memory, not by its 4 chains;
 * GB = 2 keeps 8 chains in flight, enough for both FMA ports.
 * When the NR * GB sums of a group are exactly 16 (GB = 4 or 8) they are
 * reduced and stored at once; otherwise they wait in tmp[g*TILE + slot]
 * until the tile is done. */
INLINE void qk_tile(const int GB, const float *qp, size_t dp, const struct walk *w,
		    const struct tile *tl, __m512 *tmp, float *s, size_t lds, int pf)
{
	const int NR = GB <= 4 ? 4 : 2, DIRECT = GB * NR == TILE;
	const int d = w->d, nc = d / 32, half = d & 16;

	for (int r0 = 0; r0 < TILE; r0 += NR) {
		const int j = r0 / 4, k0 = r0 % 4;
		const uint16_t *rp[4], *pp[4];
		__m512 acc[4][GB_MAX];

		if (k0 >= tl->cnt[j]) {
			for (int k = 0; k < NR && !DIRECT; k++)
				for (int g = 0; g < GB; g++)
					tmp[g * TILE + r0 + k] = _mm512_setzero_ps();
			continue;
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++) {
			rp[k] = slot_row(w, tl, j, k0 + k);
			pp[k] = pf ? slot_pf(w, tl, j, k0 + k) : NULL;
			if (pf && w->odd)
				prefetch_last(pp[k], d);
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++)
				acc[k][g] = _mm512_setzero_ps();
		}
		for (int c = 0; c < nc + !!half; c++) {
			__m512 xe[4], xo[4];

#pragma GCC unroll 4
			for (int k = 0; k < NR; k++) {
				if (pf)
					prefetch_chunk(pp[k], c);
				bf16_eo(load_chunk(rp[k] + 32 * c, c == nc), &xe[k], &xo[k]);
			}
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++) {
				__m512 qe = _mm512_load_ps(qp + g * dp + 32 * c);
				__m512 qo = _mm512_load_ps(qp + g * dp + 32 * c + 16);

#pragma GCC unroll 4
				for (int k = 0; k < NR; k++)
					acc[k][g] = _mm512_fmadd_ps(qo, xo[k],
								    _mm512_fmadd_ps(qe, xe[k], acc[k][g]));
			}
		}
		if (DIRECT) {
			/* Lane g*NR + k: head g, slot r0 + k. */
			_Alignas(64) float out[TILE];
			__m512 v[TILE];
			int n = tl->cnt[j] - k0 < NR ? tl->cnt[j] - k0 : NR;
			__mmask8 keep = (__mmask8)((1u << n) - 1);

#pragma GCC unroll 8
			for (int g = 0; g < GB; g++)
#pragma GCC unroll 4
				for (int k = 0; k < NR; k++)
					v[g * NR + k] = acc[k][g];
			_mm512_store_ps(out, hsum16(v));
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++)
				_mm_mask_storeu_ps(s + g * lds + tl->pos[j] + k0, keep,
						   _mm_maskz_loadu_ps((1u << NR) - 1, out + g * NR));
			continue;
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++)
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++)
				tmp[g * TILE + r0 + k] = acc[k][g];
	}
	if (DIRECT)
		return;
	for (int g = 0; g < GB; g++) {
		__m512 v = hsum16(tmp + g * TILE);

		/* Lane 4j+k of head g's sums goes to position pos[j]+k. */
		for (int j = 0; j < NRUN; j++)
			if (tl->cnt[j])
				_mm512_mask_storeu_ps(s + g * lds + tl->pos[j] - 4 * j,
						      (__mmask16)(((1u << tl->cnt[j]) - 1) << 4 * j), v);
	}
}

typedef void qk_fn(const float *qp, size_t dp, const struct walk *w, const struct tile *tl,
		   __m512 *tmp, float *s, size_t lds, int pf);
#define QK_TILE(GB)                                                                 \
	static __attribute__((noinline)) void qk_tile_##GB(const float *qp, size_t dp, \
		const struct walk *w, const struct tile *tl, __m512 *tmp, float *s,   \
		size_t lds, int pf)                                                 \
	{                                                                           \
		qk_tile(GB, qp, dp, w, tl, tmp, s, lds, pf);                        \
	}
BY_GB(QK_TILE)
static qk_fn *const qk_tiles[GB_MAX] = BY_GB_NAMES(qk_tile);

static void qk_avx512(const float *q, int G, int d, const uint16_t *base,
		      const uint32_t *idx, size_t m, float *s, size_t lds)
{
	_Alignas(64) float qp[KVD_GMAX * KVD_DMAX];
	_Alignas(64) __m512 tmp[GB_MAX * TILE];
	size_t dp = round32(d);
	int g1 = G > GB_MAX ? (G + 1) / 2 : G;
	struct walk w;
	struct tile tl;

	if (m == 0)
		return;
	walk_init(&w, base, idx, m, d);
	for (int g = 0; g < G; g++)
		deinterleave(qp + g * dp, q + (size_t)g * d, d);
	for (size_t t = 0; t < w.ntiles; t++) {
		tile_at(&w, t, &tl);
		qk_tiles[g1 - 1](qp, dp, &w, &tl, tmp, s, lds, 1);
		if (G > g1)
			qk_tiles[G - g1 - 1](qp + g1 * dp, dp, &w, &tl, tmp, s + g1 * lds, lds, 0);
	}
}

/* q_g = hi + lo, both bf16 (hi = RNE(q), lo = RNE(q - hi)): two VDPBF16PS per
 * 32 elements give ~16 significant bits of q against the exact bf16 row. */
static void qsplit_bf16(uint16_t *hi, uint16_t *lo, const float *q, int d)
{
	for (int c = 0; c < d; c += 32) {
		__m512 a = _mm512_loadu_ps(q + c);
		__m512 b = c + 16 < d ? _mm512_loadu_ps(q + c + 16) : _mm512_setzero_ps();
		__m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
		__m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(
			_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
		__m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(
			_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
		__m512i l = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha));

		_mm512_store_si512(hi + c, h);
		_mm512_store_si512(lo + c, l);
	}
}

INLINE void qk_tile_bf16(const int GB, const uint16_t *qh, const uint16_t *ql, size_t dp,
			 const struct walk *w, const struct tile *tl, __m512 *tmp, float *s,
			 size_t lds, int pf)
{
	const int d = w->d, nc = d / 32, half = d & 16;

	for (int r = 0; r < TILE; r++) {
		const uint16_t *rp = slot_row(w, tl, r / 4, r % 4), *pp = NULL;
		__m512 ah[GB_MAX], al[GB_MAX];

		if (r % 4 >= tl->cnt[r / 4]) {
			for (int g = 0; g < GB; g++)
				tmp[g * TILE + r] = _mm512_setzero_ps();
			continue;
		}
		if (pf) {
			pp = slot_pf(w, tl, r / 4, r % 4);
			if (w->odd)
				prefetch_last(pp, d);
		}
#pragma GCC unroll 8
		for (int g = 0; g < GB; g++)
			ah[g] = al[g] = _mm512_setzero_ps();
		for (int c = 0; c < nc + !!half; c++) {
			__m512bh x = (__m512bh)load_chunk(rp + 32 * c, c == nc);

			if (pf)
				prefetch_chunk(pp, c);
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++) {
				size_t o = g * dp + 32 * c;

				ah[g] = _mm512_dpbf16_ps(ah[g], (__m512bh)_mm512_load_si512(qh + o), x);
				al[g] = _mm512_dpbf16_ps(al[g], (__m512bh)_mm512_load_si512(ql + o), x);
			}
		}
#pragma GCC unroll 8
		for (int g = 0; g < GB; g++)
			tmp[g * TILE + r] = _mm512_add_ps(ah[g], al[g]);
	}
	for (int g = 0; g < GB; g++) {
		__m512 v = hsum16(tmp + g * TILE);

		for (int j = 0; j < NRUN; j++)
			if (tl->cnt[j])
				_mm512_mask_storeu_ps(s + g * lds + tl->pos[j] - 4 * j,
						      (__mmask16)(((1u << tl->cnt[j]) - 1) << 4 * j), v);
	}
}

typedef void qkb_fn(const uint16_t *qh, const uint16_t *ql, size_t dp, const struct walk *w,
		    const struct tile *tl, __m512 *tmp, float *s, size_t lds, int pf);
#define QKB_TILE(GB)                                                                \
	static __attribute__((noinline)) void qkb_tile_##GB(const uint16_t *qh,    \
		const uint16_t *ql, size_t dp, const struct walk *w,                \
		const struct tile *tl, __m512 *tmp, float *s, size_t lds, int pf)   \
	{                                                                           \
		qk_tile_bf16(GB, qh, ql, dp, w, tl, tmp, s, lds, pf);               \
	}
BY_GB(QKB_TILE)
static qkb_fn *const qkb_tiles[GB_MAX] = BY_GB_NAMES(qkb_tile);

static void qk_avx512bf16(const float *q, int G, int d, const uint16_t *base,
			  const uint32_t *idx, size_t m, float *s, size_t lds)
{
	_Alignas(64) uint16_t qh[KVD_GMAX * KVD_DMAX], ql[KVD_GMAX * KVD_DMAX];
	_Alignas(64) __m512 tmp[GB_MAX * TILE];
	size_t dp = round32(d);
	int g1 = G > GB_MAX ? (G + 1) / 2 : G;
	struct walk w;
	struct tile tl;

	if (m == 0)
		return;
	walk_init(&w, base, idx, m, d);
	for (int g = 0; g < G; g++)
		qsplit_bf16(qh + g * dp, ql + g * dp, q + (size_t)g * d, d);
	for (size_t t = 0; t < w.ntiles; t++) {
		tile_at(&w, t, &tl);
		qkb_tiles[g1 - 1](qh, ql, dp, &w, &tl, tmp, s, lds, 1);
		if (G > g1)
			qkb_tiles[G - g1 - 1](qh + g1 * dp, ql + g1 * dp, dp, &w, &tl, tmp,
					      s + g1 * lds, lds, 0);
	}
}

/* ---- pv ---------------------------------------------------------------- */

/* oa (GB heads, stride dp, even/odd order) += w . rows of a tile, over the
 * CW chunks from c0 (the last one a half chunk when `half`).  Each
 * accumulator takes one FMA per row, a chain of 4-cycle steps, so a pass
 * keeps 16 of them (CW * GB = 8 pairs) to keep both FMA ports busy, and
 * shares each broadcast weight among CW chunks.  Later passes over the tile
 * read its rows from L1. */
INLINE void pv_pass(const int GB, const int CW, const int half, int c0, const float *w,
		    size_t ldw, float *oa, size_t dp, const struct walk *wk, const struct tile *tl,
		    const uint16_t *const *rp, const uint16_t *const *pp)
{
	__m512 ae[GB_MAX], ao[GB_MAX];

#pragma GCC unroll 8
	for (int k = 0; k < CW * GB; k++) {
		ae[k] = _mm512_load_ps(oa + (k % GB) * dp + 32 * (c0 + k / GB));
		ao[k] = _mm512_load_ps(oa + (k % GB) * dp + 32 * (c0 + k / GB) + 16);
	}
	for (int r = 0; r < TILE; r++) {
		const float *wr = w + tl->pos[r / 4] + r % 4;
		const uint16_t *p = rp[r] + 32 * c0;
		__m512 wv[GB_MAX];

		if (r % 4 == tl->cnt[r / 4]) {
			r |= 3;
			continue;
		}
		if (pp) {
#pragma GCC unroll 4
			for (int cc = 0; cc < CW; cc++)
				prefetch_chunk(pp[r], c0 + cc);
			if (c0 == 0 && wk->odd)
				prefetch_last(pp[r], wk->d);
		}
#pragma GCC unroll 8
		for (int g = 0; g < GB; g++)
			wv[g] = _mm512_set1_ps(wr[g * ldw]);
#pragma GCC unroll 4
		for (int cc = 0; cc < CW; cc++) {
			__m512 xe, xo;

			bf16_eo(load_chunk(p + 32 * cc, half && cc == CW - 1), &xe, &xo);
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++) {
				ae[cc * GB + g] = _mm512_fmadd_ps(wv[g], xe, ae[cc * GB + g]);
				ao[cc * GB + g] = _mm512_fmadd_ps(wv[g], xo, ao[cc * GB + g]);
			}
		}
	}
#pragma GCC unroll 8
	for (int k = 0; k < CW * GB; k++) {
		_mm512_store_ps(oa + (k % GB) * dp + 32 * (c0 + k / GB), ae[k]);
		_mm512_store_ps(oa + (k % GB) * dp + 32 * (c0 + k / GB) + 16, ao[k]);
	}
}

INLINE void pv_tile(const int GB, const float *w, size_t ldw, float *oa, size_t dp,
		    const struct walk *wk, const struct tile *tl, int pf)
{
	const int CW = GB <= 2 ? 4 : GB <= 4 ? 2 : 1;
	const int nc = wk->d / 32;
	const uint16_t *rp[TILE], *pp[TILE];
	int c0 = 0;

	for (int r = 0; r < TILE; r++) {
		rp[r] = slot_row(wk, tl, r / 4, r % 4);
		pp[r] = pf ? slot_pf(wk, tl, r / 4, r % 4) : NULL;
	}
	for (; c0 + CW <= nc; c0 += CW)
		pv_pass(GB, CW, 0, c0, w, ldw, oa, dp, wk, tl, rp, pf ? pp : NULL);
	for (; c0 < nc; c0++)
		pv_pass(GB, 1, 0, c0, w, ldw, oa, dp, wk, tl, rp, pf ? pp : NULL);
	if (wk->d & 16)
		pv_pass(GB, 1, 1, nc, w, ldw, oa, dp, wk, tl, rp, pf ? pp : NULL);
}

typedef void pv_fn(const float *w, size_t ldw, float *oa, size_t dp, const struct walk *wk,
		   const struct tile *tl, int pf);
#define PV_TILE(GB)                                                                 \
	static __attribute__((noinline)) void pv_tile_##GB(const float *w, size_t ldw, \
		float *oa, size_t dp, const struct walk *wk, const struct tile *tl, int pf) \
	{                                                                           \
		pv_tile(GB, w, ldw, oa, dp, wk, tl, pf);                            \
	}
BY_GB(PV_TILE)
static pv_fn *const pv_tiles[GB_MAX] = BY_GB_NAMES(pv_tile);

static void pv_avx512(const float *w, size_t ldw, int G, int d, const uint16_t *base,
		      const uint32_t *idx, size_t m, float *o)
{
	_Alignas(64) float oa[KVD_GMAX * KVD_DMAX];
	size_t dp = round32(d);
	int g1 = G > GB_MAX ? (G + 1) / 2 : G;
	struct walk wk;
	struct tile tl;

	if (m == 0)
		return;
	walk_init(&wk, base, idx, m, d);
	for (int g = 0; g < G; g++)
		deinterleave(oa + g * dp, o + (size_t)g * d, d);
	for (size_t t = 0; t < wk.ntiles; t++) {
		tile_at(&wk, t, &tl);
		pv_tiles[g1 - 1](w, ldw, oa, dp, &wk, &tl, 1);
		if (G > g1)
			pv_tiles[G - g1 - 1](w + g1 * ldw, ldw, oa + g1 * dp, dp, &wk, &tl, 0);
	}
	for (int g = 0; g < G; g++)
		interleave(o + (size_t)g * d, oa + g * dp, d);
}

/* ---- int8 qk / pv ------------------------------------------------------- */

/* kern_i8_512.h, summing with VPMADDWD + VPADDD; kern_avx512vnni.c builds
 * the same code with VPDPWSSD.  VPDPBUSD was tried when qk8 was f32:
 * keeping q to ~23 bits took three signed-byte limbs, and it did not pay
 * (Zen 4, rows in L2: G = 1 slower, G = 4 and 8 even, G = 2 ~18% faster). */
#define I8_VNNI 0
#include "kern_i8_512.h"


/* ---- softmax pieces ------------------------------------------------------ */

static inline __mmask16 tail_mask(size_t n)
{
	return (__mmask16)((1u << n) - 1);
}

static float max_avx512(const float *x, size_t m)
{
	__m512 a0 = _mm512_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0;
	size_t i = 0;

	/* max_ps(x, a) returns a when x is NaN: NaNs are skipped like in scalar. */
	for (; i + 64 <= m; i += 64) {
		a0 = _mm512_max_ps(_mm512_loadu_ps(x + i), a0);
		a1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), a1);
		a2 = _mm512_max_ps(_mm512_loadu_ps(x + i + 32), a2);
		a3 = _mm512_max_ps(_mm512_loadu_ps(x + i + 48), a3);
	}
	for (; i + 16 <= m; i += 16)
		a0 = _mm512_max_ps(_mm512_loadu_ps(x + i), a0);
	if (i < m) {
		__mmask16 k = tail_mask(m - i);

		a1 = _mm512_mask_max_ps(a1, k, _mm512_maskz_loadu_ps(k, x + i), a1);
	}
	a0 = _mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3));
	return _mm512_reduce_max_ps(a0);
}

/* expf: n = round(x / ln2), r = x - n ln2 (Cody-Waite, Cephes' split of ln2),
 * e^r by Cephes' expf polynomial (relative error ~1.2e-7 on |r| <= ln2/2),
 * times 2^n by VSCALEFPS, which rounds denormal results correctly.  Inputs are
 * clamped to [-110, 88.8]: below -104 expf is 0 and the clamp keeps -inf from
 * producing inf - inf; above 88.73 scalef overflows to inf as expf does.
 * NaN propagates. */
INLINE __m512 exp512(__m512 x)
{
	x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
	x = _mm512_min_ps(_mm512_set1_ps(88.8f), x);
	__m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
					_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);

	r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
	__m512 p = _mm512_set1_ps(1.9875691500e-4f);

	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
	p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
	return _mm512_scalef_ps(p, n);
}

static float expsum_avx512(float *x, size_t m, float mx)
{
	__m512 vm = _mm512_set1_ps(mx), s0 = _mm512_setzero_ps(), s1 = s0;
	size_t i = 0;

	for (; i + 32 <= m; i += 32) {
		__m512 a = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
		__m512 b = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), vm));

		_mm512_storeu_ps(x + i, a);
		_mm512_storeu_ps(x + i + 16, b);
		s0 = _mm512_add_ps(s0, a);
		s1 = _mm512_add_ps(s1, b);
	}
	for (; i < m; i += 16) {
		__mmask16 k = m - i < 16 ? tail_mask(m - i) : (__mmask16)0xffff;
		__m512 a = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));

		_mm512_mask_storeu_ps(x + i, k, a);
		s0 = _mm512_mask_add_ps(s0, k, s0, a);
	}
	return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

/* acos by Abramowitz & Stegun 4.4.46: acos(a) = sqrt(1-a) * poly7(a) on
 * [0, 1], absolute error <= 2e-8; acos(-a) = pi - acos(a). */
INLINE __m512 acos512(__m512 c)
{
	__m512 a = _mm512_abs_ps(c);
	__m512 p = _mm512_set1_ps(-0.0012624911f);

	p = _mm512_fmadd_ps(p, a, _mm512_set1_ps(0.0066700901f));
	p = _mm512_fmadd_ps(p, a, _mm512_set1_ps(-0.0170881256f));
	p = _mm512_fmadd_ps(p, a, _mm512_set1_ps(0.0308918810f));
	p = _mm512_fmadd_ps(p, a, _mm512_set1_ps(-0.0501743046f));
	p = _mm512_fmadd_ps(p, a, _mm512_set1_ps(0.0889789874f));
	p = _mm512_fmadd_ps(p, a, _mm512_set1_ps(-0.2145988016f));
	p = _mm512_fmadd_ps(p, a, _mm512_set1_ps(1.5707963050f));
	p = _mm512_mul_ps(p, _mm512_sqrt_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), a)));
	__mmask16 neg = _mm512_cmp_ps_mask(c, _mm512_setzero_ps(), _CMP_LT_OQ);

	return _mm512_mask_sub_ps(p, neg, _mm512_set1_ps((float)M_PI), p);
}

INLINE __m512 logp16(__m512 s, __m512 ki, __m512 qi, __m512 sc, const float *v)
{
	__m512 c = _mm512_mul_ps(_mm512_mul_ps(s, ki), qi);

	/* min_ps(c, 1) returns 1 for a NaN c, so the table index stays in range. */
	c = _mm512_max_ps(_mm512_min_ps(c, _mm512_set1_ps(1.0f)), _mm512_set1_ps(-1.0f));
	__m512 x = _mm512_mul_ps(acos512(c), _mm512_set1_ps((float)(KVD_LOGP_N / M_PI)));
	__m512i j = _mm512_cvttps_epi32(x);

	j = _mm512_max_epi32(_mm512_min_epi32(j, _mm512_set1_epi32(KVD_LOGP_N)), _mm512_setzero_si512());
	__m512 f = _mm512_sub_ps(x, _mm512_cvtepi32_ps(j));
	__m512 v0 = _mm512_i32gather_ps(j, v, 4);
	__m512 v1 = _mm512_i32gather_ps(_mm512_add_epi32(j, _mm512_set1_epi32(1)), v, 4);
	__m512 lp = _mm512_add_ps(v0, _mm512_mul_ps(f, _mm512_sub_ps(v1, v0)));

	return _mm512_sub_ps(_mm512_mul_ps(s, sc), lp);
}

static void logp_avx512(float *s, size_t m, const float *kinv, float qinv, float scale,
			const struct kvd_logp_tab *tab)
{
	__m512 qi = _mm512_set1_ps(qinv), sc = _mm512_set1_ps(scale);

	for (size_t i = 0; i < m; i += 16) {
		__mmask16 k = m - i < 16 ? tail_mask(m - i) : (__mmask16)0xffff;
		__m512 r = logp16(_mm512_maskz_loadu_ps(k, s + i), _mm512_maskz_loadu_ps(k, kinv + i),
				  qi, sc, tab->v);

		_mm512_mask_storeu_ps(s + i, k, r);
	}
}

static void kinv_avx512(const uint16_t *rows, size_t n, int d, float *out)
{
	const int nc = d / 32, half = d & 16;

	for (size_t i = 0; i < n; i++) {
		const uint16_t *p = rows + i * (size_t)d;
		__m512 ae = _mm512_setzero_ps(), ao = ae, xe, xo;

		for (int c = 0; c < nc + !!half; c++) {
			bf16_eo(load_chunk(p + 32 * c, c == nc), &xe, &xo);
			ae = _mm512_fmadd_ps(xe, xe, ae);
			ao = _mm512_fmadd_ps(xo, xo, ao);
		}
		float acc = _mm512_reduce_add_ps(_mm512_add_ps(ae, ao));

		out[i] = acc > 0.0f ? 1.0f / sqrtf(acc) : 0.0f;
	}
}

/* ---- hash ---------------------------------------------------------------- */

/* A GEMM with rows in vector lanes: a block of HR = 32 x rows is transposed
 * into xt[e][32], and each micro-kernel step takes HC = 12 columns of W,
 * broadcast one element at a time, into 2 x 12 accumulators (24 of the 32
 * registers, 26 loads per 24 FMAs).  The compare masks of a column give bit j
 * of 32 rows' codes at once, so codes come out table-major as stored. */
#define HR 32
#define HC 12

INLINE void hash_micro(const float *xt, int d, const float *wp, size_t ldw, __mmask16 mk[2][HC])
{
	__m512 a0[HC], a1[HC];

#pragma GCC unroll 12
	for (int c = 0; c < HC; c++)
		a0[c] = a1[c] = _mm512_setzero_ps();
	for (int e = 0; e < d; e++) {
		__m512 x0 = _mm512_load_ps(xt + e * HR), x1 = _mm512_load_ps(xt + e * HR + 16);
		const float *we = wp + e * ldw;

#pragma GCC unroll 12
		for (int c = 0; c < HC; c++) {
			__m512 b = _mm512_set1_ps(we[c]);

			a0[c] = _mm512_fmadd_ps(x0, b, a0[c]);
			a1[c] = _mm512_fmadd_ps(x1, b, a1[c]);
		}
	}
#pragma GCC unroll 12
	for (int c = 0; c < HC; c++) {
		mk[0][c] = _mm512_cmp_ps_mask(a0[c], _mm512_setzero_ps(), _CMP_GT_OQ);
		mk[1][c] = _mm512_cmp_ps_mask(a1[c], _mm512_setzero_ps(), _CMP_GT_OQ);
	}
}

/* Codes of table t from a row's sign bits, bit c = column c. */
static void hash_codes(const uint8_t *bits, int K, int L, uint16_t *codes, size_t ldc)
{
	for (int t = 0; t < L; t++) {
		uint32_t v;

		memcpy(&v, bits + t * K / 8, sizeof v);
		codes[(size_t)t * ldc] = (uint16_t)((v >> (t * K % 8)) & ((1u << K) - 1));
	}
}

/* A few rows (the query codes of a decode step): W's columns in vector lanes,
 * since a panel of 32 rows would mostly compute on padding.  W is read row
 * by row in spans of HF_COLS columns, 4 rows of W per step into partial sums
 * kept in L1 (columns-outer loops walked W down its columns, one page per
 * element, and ran ~10x slower); each load of W serves R <= 4 rows of x. */
#define HFEW 16         /* fewer rows than this take hash_few */
#define HF_COLS 512

INLINE void hash_span(const int R, const float *W, size_t KL, int d, const float *const *xr,
		      size_t c0, size_t nc, float (*acc)[HF_COLS])
{
	size_t nv = (nc + 15) / 16;
	__mmask16 last = tail_mask(nc - 16 * (nv - 1));

	for (int k = 0; k < R; k++)
		memset(acc[k], 0, nv * 16 * sizeof(float));
	for (int e = 0; e < d; e += 4) {
		const float *we = W + e * KL + c0;
		__m512 xb[4][4];

#pragma GCC unroll 4
		for (int k = 0; k < R; k++)
#pragma GCC unroll 4
			for (int u = 0; u < 4; u++)
				xb[k][u] = _mm512_set1_ps(xr[k][e + u]);
		for (size_t v = 0; v < nv; v++) {
			__mmask16 live = v + 1 < nv ? (__mmask16)0xffff : last;
			__m512 wv[4];

#pragma GCC unroll 4
			for (int u = 0; u < 4; u++)
				wv[u] = _mm512_maskz_loadu_ps(live, we + u * KL + 16 * v);
#pragma GCC unroll 4
			for (int k = 0; k < R; k++) {
				__m512 a = _mm512_load_ps(acc[k] + 16 * v);

#pragma GCC unroll 4
				for (int u = 0; u < 4; u++)
					a = _mm512_fmadd_ps(xb[k][u], wv[u], a);
				_mm512_store_ps(acc[k] + 16 * v, a);
			}
		}
	}
}

/* noinline: its buffers and hash's own are never on the stack together. */
static __attribute__((noinline)) void hash_few(const float *W, int d, int K, int L,
					       const float *x, size_t ldx, size_t n,
					       uint16_t *codes, size_t ldc)
{
	_Alignas(64) float acc[4][HF_COLS];
	/* Sign bits of 4 rows, with room for a 4-byte read at the last code. */
	uint8_t bits[4][KVD_LSH_KMAX * KVD_LSH_LMAX / 8 + 8];
	size_t KL = (size_t)K * L;

	memset(bits, 0, sizeof bits);
	for (size_t i0 = 0; i0 < n; i0 += 4) {
		int nr = n - i0 < 4 ? (int)(n - i0) : 4;
		const float *xr[4];

		for (int k = 0; k < nr; k++)
			xr[k] = x + (i0 + k) * ldx;
		for (size_t c0 = 0; c0 < KL; c0 += HF_COLS) {
			size_t nc = KL - c0 < HF_COLS ? KL - c0 : HF_COLS;

			switch (nr) {
			case 1: hash_span(1, W, KL, d, xr, c0, nc, acc); break;
			case 2: hash_span(2, W, KL, d, xr, c0, nc, acc); break;
			case 3: hash_span(3, W, KL, d, xr, c0, nc, acc); break;
			default: hash_span(4, W, KL, d, xr, c0, nc, acc); break;
			}
			for (int k = 0; k < nr; k++) {
				for (size_t v = 0; v < (nc + 15) / 16; v++) {
					uint16_t m = _mm512_cmp_ps_mask(_mm512_load_ps(acc[k] + 16 * v),
									_mm512_setzero_ps(), _CMP_GT_OQ);

					memcpy(bits[k] + (c0 + 16 * v) / 8, &m, sizeof m);
				}
			}
		}
		for (int k = 0; k < nr; k++)
			hash_codes(bits[k], K, L, codes + i0 + k, ldc);
	}
}

static void hash_avx512(const float *W, int d, int K, int L, const float *x, size_t ldx,
			size_t n, uint16_t *codes, size_t ldc)
{
	_Alignas(64) float xt[KVD_DMAX * HR];
	_Alignas(64) float wt[KVD_DMAX * HC];
	size_t KL = (size_t)K * L, cfull = KL / HC * HC;

	if (n < HFEW) {
		hash_few(W, d, K, L, x, ldx, n, codes, ldc);
		return;
	}
	/* The last, partial panel of W, zero-padded so the kernel reads in bounds. */
	for (int e = 0; e < d; e++)
		for (size_t c = 0; c < HC; c++)
			wt[e * HC + c] = cfull + c < KL ? W[e * KL + cfull + c] : 0.0f;
	for (size_t i0 = 0; i0 < n; i0 += HR) {
		size_t nr = n - i0 < HR ? n - i0 : HR;
		__mmask16 st0 = nr >= 16 ? 0xffff : tail_mask(nr);
		__mmask16 st1 = nr >= 32 ? 0xffff : nr > 16 ? tail_mask(nr - 16) : 0;
		__m512i cv0 = _mm512_setzero_si512(), cv1 = cv0;
		int t = 0, j = 0;

		for (size_t r = 0; r < HR; r++)
			for (int e = 0; e < d; e++)
				xt[e * HR + r] = r < nr ? x[(i0 + r) * ldx + e] : 0.0f;
		for (size_t c0 = 0; c0 < KL; c0 += HC) {
			__mmask16 mk[2][HC];
			size_t nc = KL - c0 < HC ? KL - c0 : HC;

			if (c0 < cfull)
				hash_micro(xt, d, W + c0, KL, mk);
			else
				hash_micro(xt, d, wt, HC, mk);
			for (size_t c = 0; c < nc; c++) {
				__m512i bit = _mm512_set1_epi32(1 << j);

				cv0 = _mm512_mask_or_epi32(cv0, mk[0][c], cv0, bit);
				cv1 = _mm512_mask_or_epi32(cv1, mk[1][c], cv1, bit);
				if (++j == K) {
					uint16_t *out = codes + (size_t)t * ldc + i0;

					_mm512_mask_cvtepi32_storeu_epi16(out, st0, cv0);
					if (st1)
						_mm512_mask_cvtepi32_storeu_epi16(out + 16, st1, cv1);
					cv0 = cv1 = _mm512_setzero_si512();
					j = 0;
					t++;
				}
			}
		}
	}
}

/* The summary from the words written, eight a compare: a test per word in
 * the first loop cost ~40 % more than the loop itself. */
static void ge8_avx512(uint8_t *cnt, size_t words, uint8_t c, uint64_t *bits, uint64_t *nz)
{
	const __m512i t = _mm512_set1_epi8((char)c), z = _mm512_setzero_si512();

	for (size_t w = 0; w < words; w++) {
		void *p = cnt + w * 64;

		bits[w] = _mm512_cmpge_epu8_mask(_mm512_load_si512(p), t);
		_mm512_store_si512(p, z);
	}
	for (size_t w = 0; w < words; w += 64) {
		uint64_t y = 0;

		size_t k = 0;

		for (; k + 8 <= 64 && w + k + 8 <= words; k += 8) {
			__m512i v = _mm512_loadu_si512(bits + w + k);

			y |= (uint64_t)_mm512_test_epi64_mask(v, v) << k;
		}
		for (; k < 64 && w + k < words; k++)
			y |= (uint64_t)(bits[w + k] != 0) << k;
		nz[w >> 6] = y;
	}
}

/* rank: the n <= 64 entries in four vectors (past n: -inf, masked out of
 * the count), each entry against all of them, its count one popcount of
 * the four masks; ids compared unsigned by flipping their sign bits (the
 * intrinsics SIMDe has, for the emulated build). */
static void rank_avx512(const float *s, const uint32_t *id, uint32_t n, uint32_t *rk)
{
	_Alignas(64) float ps[KVD_KERN_RANK_MAX];
	_Alignas(64) uint32_t pi[KVD_KERN_RANK_MAX];
	const __m512i flip = _mm512_set1_epi32(INT32_MIN);
	const uint64_t valid = n < 64 ? (1ull << n) - 1 : ~0ull;
	__m512 sv[4];
	__m512i iv[4];

	for (uint32_t j = 0; j < KVD_KERN_RANK_MAX; j++) {
		ps[j] = j < n ? s[j] : -INFINITY;
		pi[j] = j < n ? id[j] : 0;
	}
	for (uint32_t v = 0; v < 4; v++) {
		sv[v] = _mm512_load_ps(ps + 16 * v);
		iv[v] = _mm512_xor_si512(_mm512_load_si512(pi + 16 * v), flip);
	}
	for (uint32_t i = 0; i < n; i++) {
		const __m512 x = _mm512_set1_ps(s[i]);
		const __m512i y = _mm512_xor_si512(_mm512_set1_epi32((int)id[i]), flip);
		uint64_t above = 0;

		for (uint32_t v = 0; v < 4; v++) {
			__mmask16 gt = _mm512_cmp_ps_mask(sv[v], x, _CMP_GT_OQ);
			__mmask16 eq = _mm512_cmp_ps_mask(sv[v], x, _CMP_EQ_OQ);
			__mmask16 lt = _mm512_cmpgt_epi32_mask(y, iv[v]);

			above |= (uint64_t)(uint16_t)(gt | (eq & lt)) << (16 * v);
		}
		rk[i] = (uint32_t)__builtin_popcountll(above & valid);
	}
}

const struct kvd_kern kvd_kern_avx512 = {
	.name = "avx512",
	.hash = hash_avx512,
	.qk = qk_avx512,
	.pv = pv_avx512,
	.max = max_avx512,
	.expsum = expsum_avx512,
	.logp = logp_avx512,
	.kinv = kinv_avx512,
	.qk8 = qk8_512,
	.pv8 = pv8_512,
	.ge8 = ge8_avx512,
	.mom = mom_kern,
	.mv = mv_kern,
	.rank = rank_avx512,
};

const struct kvd_kern kvd_kern_avx512bf16 = {
	.name = "avx512bf16",
	.hash = hash_avx512,
	.qk = qk_avx512bf16,
	.pv = pv_avx512,
	.max = max_avx512,
	.expsum = expsum_avx512,
	.logp = logp_avx512,
	.kinv = kinv_avx512,
	.qk8 = qk8_512,
	.pv8 = pv8_512,
	.ge8 = ge8_avx512,
	.mom = mom_kern,
	.mv = mv_kern,
	.rank = rank_avx512,
};

const struct kvd_kern kvd_kern_avx512vnni = {
	.name = "avx512vnni",
	.hash = hash_avx512,
	.qk = qk_avx512,
	.pv = pv_avx512,
	.max = max_avx512,
	.expsum = expsum_avx512,
	.logp = logp_avx512,
	.kinv = kinv_avx512,
	.qk8 = kvd_qk8_avx512vnni,
	.pv8 = kvd_pv8_avx512vnni,
	.ge8 = ge8_avx512,
	.mom = mom_kern,
	.mv = mv_kern,
	.rank = rank_avx512,
};

#ifndef KVD_KERN_EMU
/* avx512vnni with qk8 and pv8 over contiguous rows on AMX (kern_amx.c);
 * SIMDe has no AMX, so the emulated build (tests/simd) leaves it out. */
const struct kvd_kern kvd_kern_avx512amx = {
	.name = "avx512amx",
	.hash = hash_avx512,
	.qk = qk_avx512,
	.pv = pv_avx512,
	.max = max_avx512,
	.expsum = expsum_avx512,
	.logp = logp_avx512,
	.kinv = kinv_avx512,
	.qk8 = kvd_qk8_amx,
	.pv8 = kvd_pv8_amx,
	.ge8 = ge8_avx512,
	.mom = mom_kern,
	.mv = mv_kern,
	.rank = rank_avx512,
};
#endif
