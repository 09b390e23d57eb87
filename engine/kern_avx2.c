/* AVX2 + FMA kernels.  Same structure as kern_avx512.c (read its notes on
 * walking rows and prefetching) at half the width and with 16 registers.
 *
 * bf16 -> f32 is done 16 elements at a time without shuffles: a 32-byte row
 * chunk read as 8 u32 holds the pairs (2k, 2k+1); `<< 16` yields the even
 * elements and `& 0xffff0000` the odd ones.  qk reorders q once per call to
 * match, pv keeps its accumulators in that order and restores o's order at
 * the end.  d is a multiple of 16, so there is no partial chunk.
 *
 * Stack use is at most ~24 KiB per call; nothing is allocated.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kern.h"
#include "kern_mom.h"
#include "lsh.h"

#define INLINE static inline __attribute__((always_inline))

#define GB_MAX 6        /* q heads per group: 12 accumulators + row pair + q */

#include "kern_walk.h"


/* The line holding chunk c (16 elements) of row p (two chunks share a line:
 * prefetching it twice costs less than a branch); prefetch_last: the row's
 * last line, for rows that are not 64-byte aligned. */
INLINE void prefetch_chunk(const uint16_t *p, int c)
{
	_mm_prefetch((const char *)(p + 16 * c), _MM_HINT_T1);
}

INLINE void prefetch_last(const uint16_t *p, int d)
{
	_mm_prefetch((const char *)(p + d - 1), _MM_HINT_T1);
}

/* ---- shared pieces ------------------------------------------------------ */

INLINE void bf16_eo(const uint16_t *p, __m256 *e, __m256 *o)
{
	__m256i v = _mm256_loadu_si256((const __m256i *)p);

	*e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
	*o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* dst[16c .. 16c+16) = (even elements, odd elements) of src's chunk c. */
static void deinterleave(float *dst, const float *src, int d)
{
	for (int c = 0; c < d; c += 16) {
		__m256 a = _mm256_loadu_ps(src + c), b = _mm256_loadu_ps(src + c + 8);
		/* shuffle_ps works per 128-bit lane; permute4x64 restores order. */
		__m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
		__m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));

		e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
		o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
		_mm256_store_ps(dst + c, e);
		_mm256_store_ps(dst + c + 8, o);
	}
}

static void interleave(float *dst, const float *src, int d)
{
	for (int c = 0; c < d; c += 16) {
		__m256 e = _mm256_load_ps(src + c), o = _mm256_load_ps(src + c + 8);
		__m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);

		_mm256_storeu_ps(dst + c, _mm256_permute2f128_ps(lo, hi, 0x20));
		_mm256_storeu_ps(dst + c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
	}
}

/* Lane j of the result = sum of the lanes of v[j], for 8 vectors. */
INLINE __m256 hsum8(const __m256 *v)
{
	__m256 a[4], b[2];

#pragma GCC unroll 4
	for (int k = 0; k < 4; k++)
		a[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]),
				     _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
#pragma GCC unroll 2
	for (int k = 0; k < 2; k++) {
		__m256d x = _mm256_castps_pd(a[2 * k]), y = _mm256_castps_pd(a[2 * k + 1]);

		b[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
				     _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
	}
	return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
			     _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

static inline float hsum(__m256 v)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));

	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

/* The kernels below take the head-group size GB as a first argument and are
 * instantiated once per value (name_1 .. name_6, listed in a table indexed
 * by GB - 1), so that GB is a constant in each and its accumulators live in
 * registers.  G heads go in ng groups of near-equal size, at most GB_MAX. */
#define BY_GB(F) F(1) F(2) F(3) F(4) F(5) F(6)
#define BY_GB_NAMES(name) { name##_1, name##_2, name##_3, name##_4, name##_5, name##_6 }

/* ---- qk ---------------------------------------------------------------- */

/* Dot products of GB heads with the rows of a tile into tmp[g*TILE + slot],
 * then s.  NR rows at a time share each load of q.  Even and odd elements
 * have separate accumulators, so each takes one FMA per chunk: 2 * NR * GB
 * chains of 4-cycle FMAs, >= 8 to keep both FMA ports busy (6 for GB = 3). */
INLINE void qk_tile(const int GB, const float *qp, const struct walk *w, const struct tile *tl,
		    __m256 *tmp, float *s, size_t lds, int pf)
{
	const int NR = GB == 1 ? 4 : GB == 2 ? 2 : 1;
	const int d = w->d, nch = d / 16;

	for (int r0 = 0; r0 < TILE; r0 += NR) {
		const int j = r0 / 4, k0 = r0 % 4;
		const uint16_t *rp[4], *pp[4];
		__m256 ae[4][GB_MAX], ao[4][GB_MAX];

		if (k0 >= tl->cnt[j]) {
			for (int k = 0; k < NR; k++)
				for (int g = 0; g < GB; g++)
					tmp[g * TILE + r0 + k] = _mm256_setzero_ps();
			continue;
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++) {
			rp[k] = slot_row(w, tl, j, k0 + k);
			pp[k] = pf ? slot_pf(w, tl, j, k0 + k) : NULL;
			if (pf && w->odd)
				prefetch_last(pp[k], d);
#pragma GCC unroll 6
			for (int g = 0; g < GB; g++)
				ae[k][g] = ao[k][g] = _mm256_setzero_ps();
		}
		for (int c = 0; c < nch; c++) {
			__m256 xe[4], xo[4];

#pragma GCC unroll 4
			for (int k = 0; k < NR; k++) {
				if (pf)
					prefetch_chunk(pp[k], c);
				bf16_eo(rp[k] + 16 * c, &xe[k], &xo[k]);
			}
#pragma GCC unroll 6
			for (int g = 0; g < GB; g++) {
				__m256 qe = _mm256_load_ps(qp + g * d + 16 * c);
				__m256 qo = _mm256_load_ps(qp + g * d + 16 * c + 8);

#pragma GCC unroll 4
				for (int k = 0; k < NR; k++) {
					ae[k][g] = _mm256_fmadd_ps(qe, xe[k], ae[k][g]);
					ao[k][g] = _mm256_fmadd_ps(qo, xo[k], ao[k][g]);
				}
			}
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++)
#pragma GCC unroll 6
			for (int g = 0; g < GB; g++)
				tmp[g * TILE + r0 + k] = _mm256_add_ps(ae[k][g], ao[k][g]);
	}
	for (int g = 0; g < GB; g++) {
		for (int h = 0; h < 2; h++) {
			__m256 v = hsum8(tmp + g * TILE + 8 * h);

			/* Lane 4j+k of head g's sums goes to position pos[j]+k. */
			for (int j = 2 * h; j < 2 * h + 2; j++) {
				__m128 x = j % 2 ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v);
				float *out = s + g * lds + tl->pos[j];

				if (tl->cnt[j] == 4)
					_mm_storeu_ps(out, x);
				else if (tl->cnt[j])
					_mm_maskstore_ps(out, _mm_cmpgt_epi32(_mm_set1_epi32(tl->cnt[j]),
									      _mm_setr_epi32(0, 1, 2, 3)), x);
			}
		}
	}
}

typedef void qk_fn(const float *qp, const struct walk *w, const struct tile *tl, __m256 *tmp,
		   float *s, size_t lds, int pf);
#define QK_TILE(GB)                                                                 \
	static __attribute__((noinline)) void qk_tile_##GB(const float *qp,        \
		const struct walk *w, const struct tile *tl, __m256 *tmp, float *s,   \
		size_t lds, int pf)                                                 \
	{                                                                           \
		qk_tile(GB, qp, w, tl, tmp, s, lds, pf);                            \
	}
BY_GB(QK_TILE)
static qk_fn *const qk_tiles[GB_MAX] = BY_GB_NAMES(qk_tile);

static void qk_avx2(const float *q, int G, int d, const uint16_t *base,
		    const uint32_t *idx, size_t m, float *s, size_t lds)
{
	_Alignas(32) float qp[KVD_GMAX * KVD_DMAX];
	_Alignas(32) __m256 tmp[GB_MAX * TILE];
	int ng = (G + GB_MAX - 1) / GB_MAX;
	struct walk w;
	struct tile tl;

	if (m == 0)
		return;
	walk_init(&w, base, idx, m, d);
	for (int g = 0; g < G; g++)
		deinterleave(qp + g * d, q + (size_t)g * d, d);
	for (size_t t = 0; t < w.ntiles; t++) {
		tile_at(&w, t, &tl);
		for (int k = 0, g0 = 0; k < ng; k++) {
			int gb = (G - g0) / (ng - k);

			qk_tiles[gb - 1](qp + g0 * d, &w, &tl, tmp, s + g0 * lds, lds, k == 0);
			g0 += gb;
		}
	}
}

/* ---- pv ---------------------------------------------------------------- */

/* oa (GB heads, stride d, even/odd order) += w . rows of a tile, over CW
 * chunks from c0, with 2 * CW * GB (8 to 12) accumulators: one FMA per row
 * each, enough chains to keep both FMA ports busy. */
INLINE void pv_pass(const int GB, const int CW, int c0, const float *w, size_t ldw, float *oa,
		    const struct walk *wk, const struct tile *tl, const uint16_t *const *rp,
		    const uint16_t *const *pp)
{
	const int d = wk->d;
	__m256 ae[GB_MAX], ao[GB_MAX];

#pragma GCC unroll 12
	for (int k = 0; k < CW * GB; k++) {
		ae[k] = _mm256_load_ps(oa + (k % GB) * d + 16 * (c0 + k / GB));
		ao[k] = _mm256_load_ps(oa + (k % GB) * d + 16 * (c0 + k / GB) + 8);
	}
	for (int r = 0; r < TILE; r++) {
		const float *wr = w + tl->pos[r / 4] + r % 4;
		const uint16_t *p = rp[r] + 16 * c0;

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
#pragma GCC unroll 4
		for (int cc = 0; cc < CW; cc++) {
			__m256 xe, xo;

			bf16_eo(p + 16 * cc, &xe, &xo);
#pragma GCC unroll 6
			for (int g = 0; g < GB; g++) {
				__m256 wv = _mm256_broadcast_ss(wr + g * ldw);

				ae[cc * GB + g] = _mm256_fmadd_ps(wv, xe, ae[cc * GB + g]);
				ao[cc * GB + g] = _mm256_fmadd_ps(wv, xo, ao[cc * GB + g]);
			}
		}
	}
#pragma GCC unroll 12
	for (int k = 0; k < CW * GB; k++) {
		_mm256_store_ps(oa + (k % GB) * d + 16 * (c0 + k / GB), ae[k]);
		_mm256_store_ps(oa + (k % GB) * d + 16 * (c0 + k / GB) + 8, ao[k]);
	}
}

INLINE void pv_tile(const int GB, const float *w, size_t ldw, float *oa,
		    const struct walk *wk, const struct tile *tl, int pf)
{
	const int CW = GB == 1 ? 4 : GB <= 3 ? 2 : 1;
	const int nch = wk->d / 16;
	const uint16_t *rp[TILE], *pp[TILE];
	int c0 = 0;

	for (int r = 0; r < TILE; r++) {
		rp[r] = slot_row(wk, tl, r / 4, r % 4);
		pp[r] = pf ? slot_pf(wk, tl, r / 4, r % 4) : NULL;
	}
	for (; c0 + CW <= nch; c0 += CW)
		pv_pass(GB, CW, c0, w, ldw, oa, wk, tl, rp, pf ? pp : NULL);
	for (; c0 < nch; c0++)
		pv_pass(GB, 1, c0, w, ldw, oa, wk, tl, rp, pf ? pp : NULL);
}

typedef void pv_fn(const float *w, size_t ldw, float *oa, const struct walk *wk,
		   const struct tile *tl, int pf);
#define PV_TILE(GB)                                                                 \
	static __attribute__((noinline)) void pv_tile_##GB(const float *w, size_t ldw, \
		float *oa, const struct walk *wk, const struct tile *tl, int pf)      \
	{                                                                           \
		pv_tile(GB, w, ldw, oa, wk, tl, pf);                                \
	}
BY_GB(PV_TILE)
static pv_fn *const pv_tiles[GB_MAX] = BY_GB_NAMES(pv_tile);

static void pv_avx2(const float *w, size_t ldw, int G, int d, const uint16_t *base,
		    const uint32_t *idx, size_t m, float *o)
{
	_Alignas(32) float oa[KVD_GMAX * KVD_DMAX];
	int ng = (G + GB_MAX - 1) / GB_MAX;
	struct walk wk;
	struct tile tl;

	if (m == 0)
		return;
	walk_init(&wk, base, idx, m, d);
	for (int g = 0; g < G; g++)
		deinterleave(oa + g * d, o + (size_t)g * d, d);
	for (size_t t = 0; t < wk.ntiles; t++) {
		tile_at(&wk, t, &tl);
		for (int k = 0, g0 = 0; k < ng; k++) {
			int gb = (G - g0) / (ng - k);

			pv_tiles[gb - 1](w + g0 * ldw, ldw, oa + g0 * d, &wk, &tl, k == 0);
			g0 += gb;
		}
	}
	for (int g = 0; g < G; g++)
		interleave(o + (size_t)g * d, oa + g * d, d);
}

/* ---- int8 qk / pv ------------------------------------------------------- */

/* int8 rows (qk8, pv8; kern_i8_512.h does the same 512 bits wide) are walked as in
 * kern_walk.h, which counts in u16 elements: a row of d bytes is d/2 of
 * them, so walk_init(base, d/2) gives the same tiles and streams, and w->odd
 * the right answer for byte rows (the u16 pointers are only offset, never
 * read).  A chunk is 16 elements in natural order; a 64-byte line holds 4
 * chunks and is prefetched with the first of them.
 *
 * Prefetches go to L2 (T1), four tiles ahead when gathering: T0 prefetches
 * find the L1 miss buffers full, and on Zen 4 a gather then ran at ~15 ns a
 * row whatever the distance (8000 rows of d = 128 out of 64 MiB, G = 4,
 * the f32 kernels of the time: qk8 + pv8 in 426 us with T0, 226 us with T1
 * two tiles ahead; streams gain a few % as well).  Four tiles, not bf16's
 * two: an int8 row is done in about half the time, so the same lead in
 * rows was half the lead in time (kvbench lsh, Zen 5, sampled int8 per q
 * head: 21.4-21.7 -> 19.2-19.9 us needle, 38.8-39.6 -> 34.2-35.8 mixed;
 * bf16 at four tiles did not gain). */
#define PF8_HINT _MM_HINT_T1
#define PF8_GATHER (4 * TILE)
#define PF8_STREAM PF_STREAM

static inline const int8_t *p8(const uint16_t *p)
{
	return (const int8_t *)p;
}

INLINE void prefetch8(const int8_t *p, int c)
{
	if (c % 4 == 0)
		_mm_prefetch((const char *)(p + 16 * c), PF8_HINT);
}

/* Lane j of the result = sum of the lanes of v[j], for 8 vectors (exact). */
INLINE __m256i hsum8i(const __m256i *v)
{
	__m256i a[4], b[2];

#pragma GCC unroll 4
	for (int k = 0; k < 4; k++)
		a[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
					_mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
#pragma GCC unroll 2
	for (int k = 0; k < 2; k++)
		b[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
					_mm256_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
	return _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20),
				_mm256_permute2x128_si256(b[0], b[1], 0x31));
}

/* qk8 in integers: a chunk of 16 row bytes is sign-extended to 16 bits once
 * (VPMOVSXBW) and multiplied into every head's 16-bit q with VPMADDWD, pairs
 * summed into 32-bit lanes: 3 instructions per 16 elements and head against
 * the f32 path's 6 (two conversions, an FMA, per 8).  Sums are exact, so
 * every variant and every order of rows agrees with the scalar reference
 * bit for bit. */
INLINE void qk8_tile(const int GB, const int16_t *q, const float *qs, const struct walk *w,
		     const struct tile *tl, __m256i *tmp, float *s, size_t lds, int pf)
{
	const int NR = GB == 1 ? 4 : GB == 2 ? 2 : 1;
	const int d = 2 * w->d, nch = d / 16;

	for (int r0 = 0; r0 < TILE; r0 += NR) {
		const int j = r0 / 4, k0 = r0 % 4;
		const int8_t *rp[4], *pp[4];
		__m256i acc[4][GB_MAX];

		if (k0 >= tl->cnt[j]) {
			for (int k = 0; k < NR; k++)
				for (int g = 0; g < GB; g++)
					tmp[g * TILE + r0 + k] = _mm256_setzero_si256();
			continue;
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++) {
			rp[k] = p8(slot_row(w, tl, j, k0 + k));
			pp[k] = pf ? p8(slot_pf(w, tl, j, k0 + k)) : NULL;
			if (pf && w->odd)
				_mm_prefetch((const char *)(pp[k] + d - 1), PF8_HINT);
#pragma GCC unroll 6
			for (int g = 0; g < GB; g++)
				acc[k][g] = _mm256_setzero_si256();
		}
		for (int c = 0; c < nch; c++) {
			__m256i x[4];

#pragma GCC unroll 4
			for (int k = 0; k < NR; k++) {
				if (pf)
					prefetch8(pp[k], c);
				x[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rp[k] + 16 * c)));
			}
#pragma GCC unroll 6
			for (int g = 0; g < GB; g++) {
				__m256i qv = _mm256_loadu_si256((const __m256i *)(q + g * d + 16 * c));

#pragma GCC unroll 4
				for (int k = 0; k < NR; k++)
					acc[k][g] = _mm256_add_epi32(acc[k][g], _mm256_madd_epi16(qv, x[k]));
			}
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++)
#pragma GCC unroll 6
			for (int g = 0; g < GB; g++)
				tmp[g * TILE + r0 + k] = acc[k][g];
	}
	for (int g = 0; g < GB; g++) {
		const __m256 sg = _mm256_set1_ps(qs[g]);

		for (int h = 0; h < 2; h++) {
			__m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8i(tmp + g * TILE + 8 * h)), sg);

			for (int j = 2 * h; j < 2 * h + 2; j++) {
				__m128 x = j % 2 ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v);
				float *out = s + g * lds + tl->pos[j];

				if (tl->cnt[j] == 4)
					_mm_storeu_ps(out, x);
				else if (tl->cnt[j])
					_mm_maskstore_ps(out, _mm_cmpgt_epi32(_mm_set1_epi32(tl->cnt[j]),
									      _mm_setr_epi32(0, 1, 2, 3)), x);
			}
		}
	}
}

typedef void qk8_fn(const int16_t *q, const float *qs, const struct walk *w,
		    const struct tile *tl, __m256i *tmp, float *s, size_t lds, int pf);
#define QK8_TILE(GB)                                                                \
	static __attribute__((noinline)) void qk8_tile_##GB(const int16_t *q,       \
		const float *qs, const struct walk *w, const struct tile *tl,         \
		__m256i *tmp, float *s, size_t lds, int pf)                           \
	{                                                                           \
		qk8_tile(GB, q, qs, w, tl, tmp, s, lds, pf);                        \
	}
BY_GB(QK8_TILE)
static qk8_fn *const qk8_tiles[GB_MAX] = BY_GB_NAMES(qk8_tile);

/* kvd_q16 (kern.c) on AVX2 hosts: the same operations in the same order
 * per element (|x|, max, x * (32767 / max), plus 0.5 with x's sign,
 * truncated), so the result equals kern.c's bit for bit. */
void kvd_q16_avx2(const float *q, int G, int d, int16_t *q16, float *qscale)
{
	const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
	const __m256 fmax = _mm256_set1_ps(FLT_MAX), half = _mm256_set1_ps(0.5f);

	for (int g = 0; g < G; g++) {
		const float *qg = q + (size_t)g * d;
		int16_t *o = q16 + (size_t)g * d;
		__m256 mv = _mm256_setzero_ps(), bv = _mm256_setzero_ps();
		float mx = 0.0f;
		int bad = 0, e = 0;

		for (; e + 8 <= d; e += 8) {
			__m256 a = _mm256_and_ps(_mm256_loadu_ps(qg + e), absm);

			bv = _mm256_or_ps(bv, _mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));
			mv = _mm256_max_ps(mv, a);
		}
		for (; e < d; e++) {
			float a = fabsf(qg[e]);

			mx = a > mx ? a : mx;
			bad |= !(a <= FLT_MAX);
		}
		_Alignas(32) float lanes[8];

		_mm256_store_ps(lanes, mv);
		for (int k = 0; k < 8; k++)
			mx = lanes[k] > mx ? lanes[k] : mx;
		bad |= _mm256_movemask_ps(bv) != 0;
		if (bad || mx == 0.0f) {
			memset(o, 0, (size_t)d * sizeof *o);
			qscale[g] = bad ? NAN : 0.0f;
			continue;
		}
		float inv = 32767.0f / mx;
		const __m256 iv = _mm256_set1_ps(inv);

		for (e = 0; e + 16 <= d; e += 16) {
			__m256 v0 = _mm256_mul_ps(_mm256_loadu_ps(qg + e), iv);
			__m256 v1 = _mm256_mul_ps(_mm256_loadu_ps(qg + e + 8), iv);
			__m256i r0 = _mm256_cvttps_epi32(_mm256_add_ps(v0,
				_mm256_or_ps(half, _mm256_andnot_ps(absm, v0))));
			__m256i r1 = _mm256_cvttps_epi32(_mm256_add_ps(v1,
				_mm256_or_ps(half, _mm256_andnot_ps(absm, v1))));

			/* |r| <= 32767: the saturating pack is exact */
			_mm256_storeu_si256((__m256i *)(o + e),
					    _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xd8));
		}
		for (; e < d; e++) {
			float v = qg[e] * inv;
			int r = (int)(v + (v >= 0.0f ? 0.5f : -0.5f));

			o[e] = (int16_t)(r > 32767 ? 32767 : r < -32767 ? -32767 : r);
		}
		qscale[g] = mx / 32767.0f;
	}
}

/* One head over gathered rows, the sampled path's case: a plain loop over
 * rows, each row's lines prefetched PF8_GATHER rows ahead.  At G = 1 the
 * tile walk's bookkeeping cost more instructions than the arithmetic
 * (callgrind, d = 128: ~95 a row for qk8 and ~117 for pv8, of which ~35 are
 * the sums). */
INLINE const int8_t *row_at(const int8_t *base, const uint32_t *idx, size_t i, int d)
{
	return base + (idx ? (size_t)idx[i] : i) * (size_t)d;
}

INLINE void prefetch_row8(const int8_t *base, const uint32_t *idx, size_t i, size_t m, int d)
{
	if (i < m) {
		const char *p = (const char *)row_at(base, idx, i, d);

#pragma GCC unroll 4
		for (int c = 0; c < d; c += 64)
			_mm_prefetch(p + c, PF8_HINT);
		_mm_prefetch(p + d - 1, PF8_HINT);      /* a row that straddles one more line */
	}
}

INLINE void qk8_one(const int16_t *q, float qscale, const int d, const int8_t *base,
		    const uint32_t *idx, size_t m, float *s, const void *side, size_t side_sz)
{
	for (size_t i = 0; i < PF8_GATHER && i < m; i++) {
		prefetch_row8(base, idx, i, m, d);
		side_prefetch(side, side_sz, idx, i, m);
	}
	for (size_t i = 0; i < m; i++) {
		const int8_t *p = row_at(base, idx, i, d);
		__m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
		int c = 0;

		prefetch_row8(base, idx, i + PF8_GATHER, m, d);
		side_prefetch(side, side_sz, idx, i + PF8_GATHER, m);
#pragma GCC unroll 8
		for (; c + 32 <= d; c += 32) {
			a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(
				_mm256_loadu_si256((const __m256i *)(q + c)),
				_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + c)))));
			a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(
				_mm256_loadu_si256((const __m256i *)(q + c + 16)),
				_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + c + 16)))));
		}
		if (c < d)
			a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(
				_mm256_loadu_si256((const __m256i *)(q + c)),
				_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + c)))));
		a0 = _mm256_add_epi32(a0, a1);

		__m128i x = _mm_add_epi32(_mm256_castsi256_si128(a0), _mm256_extracti128_si256(a0, 1));

		x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
		x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
		s[i] = (float)_mm_cvtsi128_si32(x) * qscale;
	}
}

/* pv8 for one head: rows in groups of PV8_GROUP, each group in passes of
 * CW chunks (2 * CW accumulators: interleaved pairs as in pv8_pass), flushed
 * to o once per group and pass.  The second pass finds the group's rows in
 * L1.  |sum| < PV8_GROUP * 32767 * 128 < 2^31. */
#define PV8_GROUP 32

INLINE void pv8_one_pass(const int CW, int c0, const int16_t *w, float ws, int d,
			 const int8_t *base, const uint32_t *idx, size_t i0, size_t i1, size_t m,
			 float *o, int pf)
{
	__m256i al[4], ah[4];

#pragma GCC unroll 4
	for (int k = 0; k < CW; k++)
		al[k] = ah[k] = _mm256_setzero_si256();
	for (size_t i = i0; i < i1; i += 2) {
		const int two = i + 1 < i1;
		const int8_t *pa = row_at(base, idx, i, d) + 16 * c0;
		const int8_t *pb = two ? row_at(base, idx, i + 1, d) + 16 * c0 : pa;
		uint32_t wa = (uint16_t)w[i], wb = two ? (uint16_t)w[i + 1] : 0;
		__m256i wp = _mm256_set1_epi32((int)(wa | wb << 16));

		if (pf) {
			prefetch_row8(base, idx, i + PF8_GATHER, m, d);
			prefetch_row8(base, idx, i + 1 + PF8_GATHER, m, d);
		}
#pragma GCC unroll 4
		for (int k = 0; k < CW; k++) {
			__m256i xa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(pa + 16 * k)));
			__m256i xb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(pb + 16 * k)));

			al[k] = _mm256_add_epi32(al[k], _mm256_madd_epi16(_mm256_unpacklo_epi16(xa, xb), wp));
			ah[k] = _mm256_add_epi32(ah[k], _mm256_madd_epi16(_mm256_unpackhi_epi16(xa, xb), wp));
		}
	}
#pragma GCC unroll 4
	for (int k = 0; k < CW; k++) {
		float *op = o + 16 * (c0 + k);
		__m256 s = _mm256_set1_ps(ws);
		__m256i n0 = _mm256_permute2x128_si256(al[k], ah[k], 0x20);
		__m256i n1 = _mm256_permute2x128_si256(al[k], ah[k], 0x31);

		_mm256_storeu_ps(op, _mm256_fmadd_ps(_mm256_cvtepi32_ps(n0), s, _mm256_loadu_ps(op)));
		_mm256_storeu_ps(op + 8,
				 _mm256_fmadd_ps(_mm256_cvtepi32_ps(n1), s, _mm256_loadu_ps(op + 8)));
	}
}

INLINE void pv8_one(const int16_t *w, float ws, const int d, const int8_t *base,
		    const uint32_t *idx, size_t m, float *o)
{
	for (size_t i = 0; i < PF8_GATHER && i < m; i++)
		prefetch_row8(base, idx, i, m, d);
	for (size_t i0 = 0; i0 < m; i0 += PV8_GROUP) {
		size_t i1 = m - i0 < PV8_GROUP ? m : i0 + PV8_GROUP;
		int nch = d / 16, c0 = 0;

		for (; c0 + 4 <= nch; c0 += 4)
			pv8_one_pass(4, c0, w, ws, d, base, idx, i0, i1, m, o, c0 == 0);
		if (c0 + 2 <= nch) {
			pv8_one_pass(2, c0, w, ws, d, base, idx, i0, i1, m, o, c0 == 0);
			c0 += 2;
		}
		if (c0 < nch)
			pv8_one_pass(1, c0, w, ws, d, base, idx, i0, i1, m, o, c0 == 0);
	}
}

static void qk8_avx2(const int16_t *q, const float *qscale, int G, int d, const int8_t *base,
		     const uint32_t *idx, size_t m, float *s, size_t lds, const void *side,
		     size_t side_sz)
{
	_Alignas(32) __m256i tmp[GB_MAX * TILE];
	int ng = (G + GB_MAX - 1) / GB_MAX;
	struct walk w;
	struct tile tl;

	if (m == 0)
		return;
	if (G == 1 && idx) {
		/* d a constant: the loops over a row unroll */
		if (d == 128)
			qk8_one(q, qscale[0], 128, base, idx, m, s, side, side_sz);
		else
			qk8_one(q, qscale[0], d, base, idx, m, s, side, side_sz);
		return;
	}
	walk_init(&w, (const uint16_t *)base, idx, m, d / 2);
	w.pfd = w.part ? PF8_STREAM : PF8_GATHER;
	for (size_t t = 0; t < w.ntiles; t++) {
		tile_at(&w, t, &tl);
		for (int k = 0, g0 = 0; k < ng; k++) {
			int gb = (G - g0) / (ng - k);

			qk8_tiles[gb - 1](q + (size_t)g0 * d, qscale + g0, &w, &tl, tmp,
					  s + g0 * lds, lds, k == 0);
			g0 += gb;
		}
	}
}

/* pv8 in integers.  The rows of a tile go in pairs (a, b): their chunks are
 * sign-extended to 16 bits and interleaved (VPUNPCKL/HWD: elements 0-3 and
 * 8-11 of the chunk, then 4-7 and 12-15, as (a_e, b_e) pairs), and VPMADDWD
 * against the broadcast weight pair (w_a, w_b) adds w_a a_e + w_b b_e into a
 * 32-bit lane: per pair of rows and chunk, 4 shared instructions and 2 per
 * head, against 4 and 4 per single row for f32.  A tile's sums (at most
 * 8 pairs: |sum| < 2^27) are exact; each is converted, scaled and added to o
 * in f32 once per tile. */
INLINE void pv8_pass(const int GB, const int CW, int c0, const uint32_t *wpair,
		     const float *ws, float *o, int d, int odd, const struct tile *tl,
		     const int8_t *const *rp, const int8_t *const *pp)
{
	__m256i al[GB_MAX], ah[GB_MAX];

#pragma GCC unroll 12
	for (int k = 0; k < CW * GB; k++)
		al[k] = ah[k] = _mm256_setzero_si256();
	/* A missing row b of a pair is its run's stand-in (kern_walk.h) with
	 * weight 0: loaded, never counted. */
#pragma GCC unroll 8
	for (int r = 0; r < TILE; r += 2) {
		if (r % 4 >= tl->cnt[r / 4])
			continue;
		const int8_t *pa = rp[r] + 16 * c0, *pb = rp[r + 1] + 16 * c0;

		if (pp) {
#pragma GCC unroll 4
			for (int cc = 0; cc < CW; cc++) {
				prefetch8(pp[r], c0 + cc);
				prefetch8(pp[r + 1], c0 + cc);
			}
			if (c0 == 0 && odd) {
				_mm_prefetch((const char *)(pp[r] + d - 1), PF8_HINT);
				_mm_prefetch((const char *)(pp[r + 1] + d - 1), PF8_HINT);
			}
		}
#pragma GCC unroll 4
		for (int cc = 0; cc < CW; cc++) {
			__m256i xa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(pa + 16 * cc)));
			__m256i xb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(pb + 16 * cc)));
			__m256i lo = _mm256_unpacklo_epi16(xa, xb), hi = _mm256_unpackhi_epi16(xa, xb);

#pragma GCC unroll 6
			for (int g = 0; g < GB; g++) {
				__m256i wp = _mm256_set1_epi32((int)wpair[g * TILE / 2 + r / 2]);

				al[cc * GB + g] = _mm256_add_epi32(al[cc * GB + g], _mm256_madd_epi16(lo, wp));
				ah[cc * GB + g] = _mm256_add_epi32(ah[cc * GB + g], _mm256_madd_epi16(hi, wp));
			}
		}
	}
#pragma GCC unroll 12
	for (int k = 0; k < CW * GB; k++) {
		const int g = k % GB;
		float *op = o + g * d + 16 * (c0 + k / GB);
		__m256 s = _mm256_set1_ps(ws[g]);
		__m256i n0 = _mm256_permute2x128_si256(al[k], ah[k], 0x20);
		__m256i n1 = _mm256_permute2x128_si256(al[k], ah[k], 0x31);

		_mm256_storeu_ps(op, _mm256_fmadd_ps(_mm256_cvtepi32_ps(n0), s, _mm256_loadu_ps(op)));
		_mm256_storeu_ps(op + 8,
				 _mm256_fmadd_ps(_mm256_cvtepi32_ps(n1), s, _mm256_loadu_ps(op + 8)));
	}
}

INLINE void pv8_tile(const int GB, const int16_t *w, size_t ldw, const float *ws, float *o,
		     const struct walk *wk, const struct tile *tl, int pf)
{
	const int CW = GB == 1 ? 4 : GB <= 3 ? 2 : 1;
	const int d = 2 * wk->d, nch = d / 16;
	const int8_t *rp[TILE], *pp[TILE];
	uint32_t wpair[GB_MAX * TILE / 2];      /* (w_a, w_b) of each pair, per head */
	int c0 = 0;

	for (int r = 0; r < TILE; r++) {
		rp[r] = p8(slot_row(wk, tl, r / 4, r % 4));
		pp[r] = pf ? p8(slot_pf(wk, tl, r / 4, r % 4)) : NULL;
	}
	for (int r = 0; r < TILE; r += 2) {
		const int j = r / 4, k = r % 4;
		const int16_t *wr = w + tl->pos[j] + k;

		for (int g = 0; g < GB; g++) {
			uint32_t a = k < tl->cnt[j] ? (uint16_t)wr[g * ldw] : 0;
			uint32_t b = k + 1 < tl->cnt[j] ? (uint16_t)wr[g * ldw + 1] : 0;

			wpair[g * TILE / 2 + r / 2] = a | b << 16;
		}
	}
	for (; c0 + CW <= nch; c0 += CW)
		pv8_pass(GB, CW, c0, wpair, ws, o, d, wk->odd, tl, rp, pf ? pp : NULL);
	/* The rest in at most two passes (a pass costs a walk over the
	 * tile's rows, more than its madds when it is narrow). */
	if (CW > 2 && c0 + 2 <= nch) {
		pv8_pass(GB, 2, c0, wpair, ws, o, d, wk->odd, tl, rp, pf ? pp : NULL);
		c0 += 2;
	}
	if (c0 < nch)
		pv8_pass(GB, 1, c0, wpair, ws, o, d, wk->odd, tl, rp, pf ? pp : NULL);
}

typedef void pv8_fn(const int16_t *w, size_t ldw, const float *ws, float *o,
		    const struct walk *wk, const struct tile *tl, int pf);
#define PV8_TILE(GB)                                                                \
	static __attribute__((noinline)) void pv8_tile_##GB(const int16_t *w,       \
		size_t ldw, const float *ws, float *o, const struct walk *wk,         \
		const struct tile *tl, int pf)                                        \
	{                                                                           \
		pv8_tile(GB, w, ldw, ws, o, wk, tl, pf);                            \
	}
BY_GB(PV8_TILE)
static pv8_fn *const pv8_tiles[GB_MAX] = BY_GB_NAMES(pv8_tile);

static void pv8_avx2(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
		     const int8_t *base, const uint32_t *idx, size_t m, float *o)
{
	int ng = (G + GB_MAX - 1) / GB_MAX;
	struct walk wk;
	struct tile tl;

	if (m == 0)
		return;
	if (G == 1 && idx) {
		if (d == 128)
			pv8_one(w, wscale[0], 128, base, idx, m, o);
		else
			pv8_one(w, wscale[0], d, base, idx, m, o);
		return;
	}
	walk_init(&wk, (const uint16_t *)base, idx, m, d / 2);
	wk.pfd = wk.part ? PF8_STREAM : PF8_GATHER;
	for (size_t t = 0; t < wk.ntiles; t++) {
		tile_at(&wk, t, &tl);
		for (int k = 0, g0 = 0; k < ng; k++) {
			int gb = (G - g0) / (ng - k);

			pv8_tiles[gb - 1](w + g0 * ldw, ldw, wscale + g0, o + (size_t)g0 * d, &wk,
					  &tl, k == 0);
			g0 += gb;
		}
	}
}

/* ---- softmax pieces ------------------------------------------------------ */

/* Tails shorter than a vector go through an 8-float stack buffer padded with
 * a neutral value, so every kernel reads and writes only x[0..m). */
static float max_avx2(const float *x, size_t m)
{
	__m256 a0 = _mm256_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0;
	size_t i = 0;

	/* max_ps(x, a) returns a when x is NaN: NaNs are skipped like in scalar. */
	for (; i + 32 <= m; i += 32) {
		a0 = _mm256_max_ps(_mm256_loadu_ps(x + i), a0);
		a1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), a1);
		a2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), a2);
		a3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), a3);
	}
	for (; i + 8 <= m; i += 8)
		a0 = _mm256_max_ps(_mm256_loadu_ps(x + i), a0);
	if (i < m) {
		_Alignas(32) float t[8] = { -INFINITY, -INFINITY, -INFINITY, -INFINITY,
					    -INFINITY, -INFINITY, -INFINITY, -INFINITY };

		memcpy(t, x + i, (m - i) * sizeof *t);
		a1 = _mm256_max_ps(_mm256_load_ps(t), a1);
	}
	a0 = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
	__m128 v = _mm_max_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));

	v = _mm_max_ps(v, _mm_movehl_ps(v, v));
	v = _mm_max_ss(v, _mm_movehdup_ps(v));
	return _mm_cvtss_f32(v);
}

/* expf as in kern_avx512.c (Cephes' reduction and polynomial, relative error
 * ~1.2e-7); without VSCALEFPS, 2^n is applied as 2^(n>>1) * 2^(n - (n>>1)),
 * both normal for n in [-159, 128], so denormal results round once, right. */
INLINE __m256 exp256(__m256 x)
{
	x = _mm256_max_ps(_mm256_set1_ps(-110.0f), x);
	x = _mm256_min_ps(_mm256_set1_ps(88.8f), x);
	__m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
				   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);

	r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
	__m256 p = _mm256_set1_ps(1.9875691500e-4f);

	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
	p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
	__m256i ni = _mm256_cvtps_epi32(n);
	__m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
	__m256i bias = _mm256_set1_epi32(127);
	__m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
	__m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));

	return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

static float expsum_avx2(float *x, size_t m, float mx)
{
	__m256 vm = _mm256_set1_ps(mx), s0 = _mm256_setzero_ps(), s1 = s0;
	size_t i = 0;

	for (; i + 16 <= m; i += 16) {
		__m256 a = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
		__m256 b = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vm));

		_mm256_storeu_ps(x + i, a);
		_mm256_storeu_ps(x + i + 8, b);
		s0 = _mm256_add_ps(s0, a);
		s1 = _mm256_add_ps(s1, b);
	}
	if (i + 8 <= m) {
		__m256 a = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));

		_mm256_storeu_ps(x + i, a);
		s0 = _mm256_add_ps(s0, a);
		i += 8;
	}
	if (i < m) {
		_Alignas(32) float t[8] = { 0 };
		__m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
		__m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(m - i)), lane));

		memcpy(t, x + i, (m - i) * sizeof *t);
		__m256 a = exp256(_mm256_sub_ps(_mm256_load_ps(t), vm));

		_mm256_store_ps(t, a);
		memcpy(x + i, t, (m - i) * sizeof *t);
		s1 = _mm256_add_ps(s1, _mm256_and_ps(a, live));
	}
	return hsum(_mm256_add_ps(s0, s1));
}

/* acos by Abramowitz & Stegun 4.4.46: see kern_avx512.c. */
INLINE __m256 acos256(__m256 c)
{
	__m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), c);
	__m256 p = _mm256_set1_ps(-0.0012624911f);

	p = _mm256_fmadd_ps(p, a, _mm256_set1_ps(0.0066700901f));
	p = _mm256_fmadd_ps(p, a, _mm256_set1_ps(-0.0170881256f));
	p = _mm256_fmadd_ps(p, a, _mm256_set1_ps(0.0308918810f));
	p = _mm256_fmadd_ps(p, a, _mm256_set1_ps(-0.0501743046f));
	p = _mm256_fmadd_ps(p, a, _mm256_set1_ps(0.0889789874f));
	p = _mm256_fmadd_ps(p, a, _mm256_set1_ps(-0.2145988016f));
	p = _mm256_fmadd_ps(p, a, _mm256_set1_ps(1.5707963050f));
	p = _mm256_mul_ps(p, _mm256_sqrt_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), a)));
	__m256 neg = _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_LT_OQ);

	return _mm256_blendv_ps(p, _mm256_sub_ps(_mm256_set1_ps((float)M_PI), p), neg);
}

INLINE __m256 logp8(__m256 s, __m256 ki, __m256 qi, __m256 sc, const float *v)
{
	__m256 c = _mm256_mul_ps(_mm256_mul_ps(s, ki), qi);

	/* min_ps(c, 1) returns 1 for a NaN c, so the table index stays in range. */
	c = _mm256_max_ps(_mm256_min_ps(c, _mm256_set1_ps(1.0f)), _mm256_set1_ps(-1.0f));
	__m256 x = _mm256_mul_ps(acos256(c), _mm256_set1_ps((float)(KVD_LOGP_N / M_PI)));
	__m256i j = _mm256_cvttps_epi32(x);

	j = _mm256_max_epi32(_mm256_min_epi32(j, _mm256_set1_epi32(KVD_LOGP_N)), _mm256_setzero_si256());
	__m256 f = _mm256_sub_ps(x, _mm256_cvtepi32_ps(j));
	__m256 v0 = _mm256_i32gather_ps(v, j, 4);
	__m256 v1 = _mm256_i32gather_ps(v, _mm256_add_epi32(j, _mm256_set1_epi32(1)), 4);
	__m256 lp = _mm256_add_ps(v0, _mm256_mul_ps(f, _mm256_sub_ps(v1, v0)));

	return _mm256_sub_ps(_mm256_mul_ps(s, sc), lp);
}

static void logp_avx2(float *s, size_t m, const float *kinv, float qinv, float scale,
		      const struct kvd_logp_tab *tab)
{
	__m256 qi = _mm256_set1_ps(qinv), sc = _mm256_set1_ps(scale);
	size_t i = 0;

	for (; i + 8 <= m; i += 8)
		_mm256_storeu_ps(s + i, logp8(_mm256_loadu_ps(s + i), _mm256_loadu_ps(kinv + i),
					      qi, sc, tab->v));
	if (i < m) {
		_Alignas(32) float ts[8] = { 0 }, tk[8] = { 0 };

		memcpy(ts, s + i, (m - i) * sizeof *ts);
		memcpy(tk, kinv + i, (m - i) * sizeof *tk);
		_mm256_store_ps(ts, logp8(_mm256_load_ps(ts), _mm256_load_ps(tk), qi, sc, tab->v));
		memcpy(s + i, ts, (m - i) * sizeof *ts);
	}
}

static void kinv_avx2(const uint16_t *rows, size_t n, int d, float *out)
{
	for (size_t i = 0; i < n; i++) {
		const uint16_t *p = rows + i * (size_t)d;
		__m256 ae = _mm256_setzero_ps(), ao = ae, xe, xo;

		for (int c = 0; c < d; c += 16) {
			bf16_eo(p + c, &xe, &xo);
			ae = _mm256_fmadd_ps(xe, xe, ae);
			ao = _mm256_fmadd_ps(xo, xo, ao);
		}
		float acc = hsum(_mm256_add_ps(ae, ao));

		out[i] = acc > 0.0f ? 1.0f / sqrtf(acc) : 0.0f;
	}
}

/* ---- hash ---------------------------------------------------------------- */

/* As in kern_avx512.c: rows in vector lanes, HR = 16 x rows transposed into
 * xt[e][16], HC = 6 columns of W broadcast per step into 2 x 6 accumulators
 * (12 of 16 registers; 8 loads per 12 FMAs). */
#define HR 16
#define HC 6

INLINE void hash_micro(const float *xt, int d, const float *wp, size_t ldw, __m256i mk[2][HC])
{
	__m256 a0[HC], a1[HC];

#pragma GCC unroll 6
	for (int c = 0; c < HC; c++)
		a0[c] = a1[c] = _mm256_setzero_ps();
	for (int e = 0; e < d; e++) {
		__m256 x0 = _mm256_load_ps(xt + e * HR), x1 = _mm256_load_ps(xt + e * HR + 8);
		const float *we = wp + e * ldw;

#pragma GCC unroll 6
		for (int c = 0; c < HC; c++) {
			__m256 b = _mm256_broadcast_ss(we + c);

			a0[c] = _mm256_fmadd_ps(x0, b, a0[c]);
			a1[c] = _mm256_fmadd_ps(x1, b, a1[c]);
		}
	}
#pragma GCC unroll 6
	for (int c = 0; c < HC; c++) {
		mk[0][c] = _mm256_castps_si256(_mm256_cmp_ps(a0[c], _mm256_setzero_ps(), _CMP_GT_OQ));
		mk[1][c] = _mm256_castps_si256(_mm256_cmp_ps(a1[c], _mm256_setzero_ps(), _CMP_GT_OQ));
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

/* A few rows (the query codes of a decode step): as in kern_avx512.c, W's
 * columns in vector lanes, W read row by row in spans of HF_COLS columns, 2
 * rows of W per step into partial sums kept in L1, each load of W serving
 * R <= 4 rows of x. */
#define HFEW 8          /* fewer rows than this take hash_few */
#define HF_COLS 512

INLINE void hash_span(const int R, const float *W, size_t KL, int d, const float *const *xr,
		      size_t c0, size_t nc, float (*acc)[HF_COLS])
{
	size_t nv = (nc + 7) / 8;
	__m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nc - 8 * (nv - 1))),
					  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));

	for (int k = 0; k < R; k++)
		memset(acc[k], 0, nv * 8 * sizeof(float));
	for (int e = 0; e < d; e += 2) {
		const float *we = W + e * KL + c0;
		__m256 xb[4][2];

#pragma GCC unroll 4
		for (int k = 0; k < R; k++) {
			xb[k][0] = _mm256_broadcast_ss(xr[k] + e);
			xb[k][1] = _mm256_broadcast_ss(xr[k] + e + 1);
		}
		for (size_t v = 0; v < nv; v++) {
			__m256 w0, w1;

			if (v + 1 < nv) {
				w0 = _mm256_loadu_ps(we + 8 * v);
				w1 = _mm256_loadu_ps(we + KL + 8 * v);
			} else {
				w0 = _mm256_maskload_ps(we + 8 * v, last);
				w1 = _mm256_maskload_ps(we + KL + 8 * v, last);
			}
#pragma GCC unroll 4
			for (int k = 0; k < R; k++) {
				__m256 a = _mm256_load_ps(acc[k] + 8 * v);

				a = _mm256_fmadd_ps(xb[k][0], w0, a);
				a = _mm256_fmadd_ps(xb[k][1], w1, a);
				_mm256_store_ps(acc[k] + 8 * v, a);
			}
		}
	}
}

/* noinline: its buffers and hash's own are never on the stack together. */
static __attribute__((noinline)) void hash_few(const float *W, int d, int K, int L,
					       const float *x, size_t ldx, size_t n,
					       uint16_t *codes, size_t ldc)
{
	_Alignas(32) float acc[4][HF_COLS];
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
				for (size_t v = 0; v < (nc + 7) / 8; v++) {
					__m256 a = _mm256_load_ps(acc[k] + 8 * v);

					bits[k][(c0 + 8 * v) / 8] = (uint8_t)_mm256_movemask_ps(
						_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GT_OQ));
				}
			}
		}
		for (int k = 0; k < nr; k++)
			hash_codes(bits[k], K, L, codes + i0 + k, ldc);
	}
}

static void hash_avx2(const float *W, int d, int K, int L, const float *x, size_t ldx,
		      size_t n, uint16_t *codes, size_t ldc)
{
	_Alignas(32) float xt[KVD_DMAX * HR];
	_Alignas(32) float wt[KVD_DMAX * HC];
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
		__m256i cv0 = _mm256_setzero_si256(), cv1 = cv0;
		int t = 0, j = 0;

		for (size_t r = 0; r < HR; r++)
			for (int e = 0; e < d; e++)
				xt[e * HR + r] = r < nr ? x[(i0 + r) * ldx + e] : 0.0f;
		for (size_t c0 = 0; c0 < KL; c0 += HC) {
			__m256i mk[2][HC];
			size_t nc = KL - c0 < HC ? KL - c0 : HC;

			if (c0 < cfull)
				hash_micro(xt, d, W + c0, KL, mk);
			else
				hash_micro(xt, d, wt, HC, mk);
			for (size_t c = 0; c < nc; c++) {
				__m256i bit = _mm256_set1_epi32(1 << j);

				cv0 = _mm256_or_si256(cv0, _mm256_and_si256(mk[0][c], bit));
				cv1 = _mm256_or_si256(cv1, _mm256_and_si256(mk[1][c], bit));
				if (++j == K) {
					/* packus interleaves 128-bit lanes; permute4x64 undoes it. */
					__m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi32(cv0, cv1),
									     _MM_SHUFFLE(3, 1, 2, 0));
					uint16_t *out = codes + (size_t)t * ldc + i0;

					if (nr == HR) {
						_mm256_storeu_si256((__m256i *)out, v);
					} else {
						_Alignas(32) uint16_t tmp[HR];

						_mm256_store_si256((__m256i *)tmp, v);
						memcpy(out, tmp, nr * sizeof *tmp);
					}
					cv0 = cv1 = _mm256_setzero_si256();
					j = 0;
					t++;
				}
			}
		}
	}
}

/* a >= c as max(a, c) == a: AVX2 compares bytes only as signed. */
static void ge8_avx2(uint8_t *cnt, size_t words, uint8_t c, uint64_t *bits, uint64_t *nz)
{
	const __m256i t = _mm256_set1_epi8((char)c), z = _mm256_setzero_si256();
	for (size_t w = 0; w < words; w++) {
		__m256i *p = (__m256i *)(cnt + w * 64);
		__m256i a = _mm256_load_si256(p), b = _mm256_load_si256(p + 1);
		uint32_t lo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(a, t), a));
		uint32_t hi = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(b, t), b));

		bits[w] = (uint64_t)hi << 32 | lo;
		_mm256_store_si256(p, z);
		_mm256_store_si256(p + 1, z);
	}
	kvd_ge8_summary(bits, words, nz);
}

/* rank: the n <= 64 entries in 8 vectors, each entry against all of them;
 * ids compared unsigned by flipping their sign bits.  Lanes past n hold
 * -inf and are masked out of the count. */
static void rank_avx2(const float *s, const uint32_t *id, uint32_t n, uint32_t *rk)
{
	_Alignas(32) float ps[KVD_KERN_RANK_MAX];
	_Alignas(32) uint32_t pi[KVD_KERN_RANK_MAX];
	const uint32_t nv = (n + 7) / 8;
	const __m256i flip = _mm256_set1_epi32(INT32_MIN);
	const uint64_t valid = n < 64 ? (1ull << n) - 1 : ~0ull;

	for (uint32_t j = 0; j < nv * 8; j++) {
		ps[j] = j < n ? s[j] : -INFINITY;
		pi[j] = j < n ? id[j] : 0;
	}
	for (uint32_t i = 0; i < n; i++) {
		const __m256 x = _mm256_set1_ps(s[i]);
		const __m256i y = _mm256_xor_si256(_mm256_set1_epi32((int)id[i]), flip);
		uint64_t above = 0;

		for (uint32_t v = 0; v < nv; v++) {
			__m256 a = _mm256_load_ps(ps + 8 * v);
			__m256i b = _mm256_xor_si256(_mm256_load_si256((const __m256i *)(pi + 8 * v)),
						     flip);
			__m256 gt = _mm256_cmp_ps(a, x, _CMP_GT_OQ);
			__m256 eq = _mm256_cmp_ps(a, x, _CMP_EQ_OQ);
			__m256 lt = _mm256_castsi256_ps(_mm256_cmpgt_epi32(y, b));

			above |= (uint64_t)(uint32_t)_mm256_movemask_ps(
					 _mm256_or_ps(gt, _mm256_and_ps(eq, lt))) << (8 * v);
		}
		rk[i] = (uint32_t)__builtin_popcountll(above & valid);
	}
}

const struct kvd_kern kvd_kern_avx2 = {
	.name = "avx2",
	.hash = hash_avx2,
	.qk = qk_avx2,
	.pv = pv_avx2,
	.max = max_avx2,
	.expsum = expsum_avx2,
	.logp = logp_avx2,
	.kinv = kinv_avx2,
	.qk8 = qk8_avx2,
	.pv8 = pv8_avx2,
	.ge8 = ge8_avx2,
	.mom = mom_kern,
	.mv = mv_kern,
	.rank = rank_avx2,
};
