/* kern_i8_512.h: qk8 and pv8 (int8 rows) in 512-bit vectors, included by
 * kern_avx512.c (I8_VNNI 0: VPMADDWD then VPADDD) and kern_avx512vnni.c
 * (I8_VNNI 1: VPDPWSSD, the two in one instruction, built with
 * -mavx512vnni).  The sums are the same exact integers either way, so both
 * equal the scalar reference as kern_avx2.c's do (qk8 bit for bit).
 *
 * A chunk is 32 elements: 32 row bytes sign-extended to 16 bits by one
 * VPMOVSXBW against 32 16-bit q (or weight) lanes.  A d that is an odd
 * multiple of 16 ends with a half chunk, loaded under a 16-lane mask (the
 * upper lanes read as zero).  Rows are walked and prefetched as in
 * kern_avx2.c's int8 kernels (kern_walk.h tiles; T1 prefetches four tiles
 * ahead when gathering: sampled int8 per q head 20.1-20.4 -> 19.0-19.4 us
 * on needle, 36.8-37.3 -> 33.8-35.1 on mixed against two, Zen 5).
 *
 * Measured on Sapphire Rapids (kvbench kern: one core, cold, d = 128, qk8
 * then pv8), ns a row against kern_avx2.c's: one head over 8192 gathered
 * rows 20.7 (VNNI 18.9) against 29.8; G = 4 over 98304 contiguous rows 43.9
 * (VNNI 43.5) against 70.4.  The dense case is not bound by memory there:
 * warm it takes as long (41-44), and so does bf16 (42-43).  A prefetch
 * distance of 16 or 32 rows per stream instead of 8 changed nothing.
 *
 * The includer provides kern_walk.h, INLINE and <immintrin.h>.  Defines the
 * static functions qk8_512 and pv8_512 (kern.h's qk8 and pv8).
 */

#define I8_GB_MAX 8     /* q heads per register-resident group */
#define I8_GATHER (4 * TILE)
#define I8_GROUP 32     /* pv8 one head: rows per flush, |sum| < 2^27 */

INLINE __m512i i8_dp(__m512i acc, __m512i a, __m512i b)
{
#if I8_VNNI
	return _mm512_dpwssd_epi32(acc, a, b);
#else
	return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* Chunk c of an int8 row and of a 16-bit vector (q or weights), the half
 * chunk of an odd d/16 with its upper lanes zero. */
INLINE __m512i i8_row(const int8_t *p, int c, int half)
{
	if (!half)
		return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * c)));
	return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(0xffffu, p + 32 * c));
}

INLINE __m512i i8_q(const int16_t *q, int c, int half)
{
	if (!half)
		return _mm512_loadu_si512(q + 32 * c);
	return _mm512_maskz_loadu_epi16(0xffffu, q + 32 * c);
}

INLINE const int8_t *i8_at(const int8_t *base, const uint32_t *idx, size_t i, int d)
{
	return base + (idx ? (size_t)idx[i] : i) * (size_t)d;
}

INLINE void i8_prefetch_row(const int8_t *base, const uint32_t *idx, size_t i, size_t m, int d)
{
	if (i < m) {
		const char *p = (const char *)i8_at(base, idx, i, d);

#pragma GCC unroll 4
		for (int c = 0; c < d; c += 64)
			_mm_prefetch(p + c, _MM_HINT_T1);
		_mm_prefetch(p + d - 1, _MM_HINT_T1);   /* a row that straddles one more line */
	}
}

/* Lane j of the result = sum of the lanes of v[j], for 16 vectors (exact):
 * 45 instructions for 16 sums against ~8 for each one alone. */
INLINE __m512i i8_hsum16(const __m512i *v)
{
	__m512i a[8], b[4], c[2];

#pragma GCC unroll 8
	for (int k = 0; k < 8; k++)
		a[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
					_mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
#pragma GCC unroll 4
	for (int k = 0; k < 4; k++)
		b[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
					_mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
#pragma GCC unroll 2
	for (int k = 0; k < 2; k++)
		c[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], 0x44),
					_mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], 0xee));
	return _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88),
				_mm512_shuffle_i32x4(c[0], c[1], 0xdd));
}

/* ---- qk8 ----------------------------------------------------------------- */

/* One head over gathered rows (the sampled path): rows in blocks of 16, q in
 * registers, one accumulator per row, and the 16 sums reduced together. */
INLINE void qk8_one_512(const int16_t *q, float qscale, const int d, const int8_t *base,
			const uint32_t *idx, size_t m, float *s, const void *side, size_t side_sz)
{
	const int nc = (d + 31) / 32, half = d % 32 != 0;
	__m512i qv[KVD_DMAX / 32];

	for (int c = 0; c < nc; c++)
		qv[c] = i8_q(q, c, half && c == nc - 1);
	for (size_t i = 0; i < I8_GATHER && i < m; i++) {
		i8_prefetch_row(base, idx, i, m, d);
		side_prefetch(side, side_sz, idx, i, m);
	}
	for (size_t i0 = 0; i0 < m; i0 += 16) {
		const size_t nb = m - i0 < 16 ? m - i0 : 16;
		__m512i acc[16];

#pragma GCC unroll 16
		for (size_t k = 0; k < 16; k++) {
			acc[k] = _mm512_setzero_si512();
			if (k < nb) {
				const int8_t *p = i8_at(base, idx, i0 + k, d);

				i8_prefetch_row(base, idx, i0 + k + I8_GATHER, m, d);
				side_prefetch(side, side_sz, idx, i0 + k + I8_GATHER, m);
#pragma GCC unroll 8
				for (int c = 0; c < nc; c++)
					acc[k] = i8_dp(acc[k], qv[c], i8_row(p, c, half && c == nc - 1));
			}
		}
		__m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(i8_hsum16(acc)), _mm512_set1_ps(qscale));

		_mm512_mask_storeu_ps(s + i0, (__mmask16)((1u << nb) - 1), v);
	}
}

/* GB heads over the rows of a tile: NR rows at a time share each load of q;
 * the sums of slot r wait in tmp[g*TILE + r] and are reduced per head at the
 * end, 16 slots in one i8_hsum16.  DC: d as a constant (128), or 0 for any
 * d; with the constant the loops over a row unroll and no load is masked,
 * which took dense G = 4 from ~165 instructions a row to ~130 (12% faster). */
INLINE void qk8_tile_512(const int GB, const int DC, const int16_t *q, const float *qs,
			 const struct walk *w, const struct tile *tl, __m512i *tmp, float *s,
			 size_t lds, int pf)
{
	const int NR = GB == 1 ? 4 : GB == 2 ? 2 : 1;
	const int d = DC ? DC : 2 * w->d, nc = (d + 31) / 32, half = d % 32 != 0;
	/* q in registers when it fits (d = 128, G <= 4: 16 of the 32): stores to
	 * tmp may alias q (__m512i may alias anything), so without the copy every
	 * row reloads it */
	const int QR = DC == 128 && GB <= 4;
	__m512i qr[4][4];

	if (QR)
		for (int g = 0; g < GB; g++)
			for (int c = 0; c < 4; c++)
				qr[g][c] = i8_q(q + g * d, c, 0);
	for (int r0 = 0; r0 < TILE; r0 += NR) {
		const int j = r0 / 4, k0 = r0 % 4;
		const int8_t *rp[4], *pp[4];
		__m512i acc[4][I8_GB_MAX];

		if (k0 >= tl->cnt[j]) {
			for (int k = 0; k < NR; k++)
				for (int g = 0; g < GB; g++)
					tmp[g * TILE + r0 + k] = _mm512_setzero_si512();
			continue;
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++) {
			rp[k] = (const int8_t *)slot_row(w, tl, j, k0 + k);
			pp[k] = pf ? (const int8_t *)slot_pf(w, tl, j, k0 + k) : NULL;
			if (pf && w->odd)
				_mm_prefetch((const char *)(pp[k] + d - 1), _MM_HINT_T1);
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++)
				acc[k][g] = _mm512_setzero_si512();
		}
#pragma GCC unroll 8
		for (int c = 0; c < nc; c++) {
			const int hc = half && c == nc - 1;
			__m512i x[4];

#pragma GCC unroll 4
			for (int k = 0; k < NR; k++) {
				if (pf && c % 2 == 0)
					_mm_prefetch((const char *)(pp[k] + 32 * c), _MM_HINT_T1);
				x[k] = i8_row(rp[k], c, hc);
			}
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++) {
				__m512i qv = QR ? qr[g][c] : i8_q(q + g * d, c, hc);

#pragma GCC unroll 4
				for (int k = 0; k < NR; k++)
					acc[k][g] = i8_dp(acc[k][g], qv, x[k]);
			}
		}
#pragma GCC unroll 4
		for (int k = 0; k < NR; k++)
#pragma GCC unroll 8
			for (int g = 0; g < GB; g++)
				tmp[g * TILE + r0 + k] = acc[k][g];
	}
	for (int g = 0; g < GB; g++) {
		__m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(i8_hsum16(tmp + g * TILE)),
					 _mm512_set1_ps(qs[g]));
		__m128 x[NRUN] = { _mm512_extractf32x4_ps(v, 0), _mm512_extractf32x4_ps(v, 1),
				   _mm512_extractf32x4_ps(v, 2), _mm512_extractf32x4_ps(v, 3) };

		for (int j = 0; j < NRUN; j++)
			if (tl->cnt[j])
				_mm_mask_storeu_ps(s + g * lds + tl->pos[j],
						   (__mmask8)((1u << tl->cnt[j]) - 1), x[j]);
	}
}

typedef void qk8_512_fn(const int16_t *q, const float *qs, const struct walk *w,
			const struct tile *tl, __m512i *tmp, float *s, size_t lds, int pf);
#define QK8_512_TILE(GB)                                                            \
	static __attribute__((noinline)) void qk8_512_tile_##GB(const int16_t *q,   \
		const float *qs, const struct walk *w, const struct tile *tl,         \
		__m512i *tmp, float *s, size_t lds, int pf)                           \
	{                                                                           \
		qk8_tile_512(GB, 0, q, qs, w, tl, tmp, s, lds, pf);                 \
	}                                                                           \
	static __attribute__((noinline)) void qk8_512_tile128_##GB(const int16_t *q, \
		const float *qs, const struct walk *w, const struct tile *tl,         \
		__m512i *tmp, float *s, size_t lds, int pf)                           \
	{                                                                           \
		qk8_tile_512(GB, 128, q, qs, w, tl, tmp, s, lds, pf);               \
	}
#define I8_BY_GB(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8)
#define I8_BY_GB_NAMES(name) { name##_1, name##_2, name##_3, name##_4, \
			       name##_5, name##_6, name##_7, name##_8 }
I8_BY_GB(QK8_512_TILE)
static qk8_512_fn *const qk8_512_tiles[I8_GB_MAX] = I8_BY_GB_NAMES(qk8_512_tile);
static qk8_512_fn *const qk8_512_tiles128[I8_GB_MAX] = I8_BY_GB_NAMES(qk8_512_tile128);

static void qk8_512(const int16_t *q, const float *qscale, int G, int d, const int8_t *base,
		    const uint32_t *idx, size_t m, float *s, size_t lds, const void *side,
		    size_t side_sz)
{
	_Alignas(64) __m512i tmp[I8_GB_MAX * TILE];
	qk8_512_fn *const *tiles = d == 128 ? qk8_512_tiles128 : qk8_512_tiles;
	int ng = (G + I8_GB_MAX - 1) / I8_GB_MAX;
	struct walk w;
	struct tile tl;

	if (m == 0)
		return;
	if (G == 1 && idx) {
		/* d a constant: the loops over a row unroll */
		if (d == 128)
			qk8_one_512(q, qscale[0], 128, base, idx, m, s, side, side_sz);
		else
			qk8_one_512(q, qscale[0], d, base, idx, m, s, side, side_sz);
		return;
	}
	walk_init(&w, (const uint16_t *)base, idx, m, d / 2);
	w.pfd = w.part ? PF_STREAM : I8_GATHER;
	for (size_t t = 0; t < w.ntiles; t++) {
		tile_at(&w, t, &tl);
		for (int k = 0, g0 = 0; k < ng; k++) {
			int gb = (G - g0) / (ng - k);

			tiles[gb - 1](q + (size_t)g0 * d, qscale + g0, &w, &tl, tmp, s + g0 * lds,
				      lds, k == 0);
			g0 += gb;
		}
	}
}

/* ---- pv8 ----------------------------------------------------------------- */

/* Rows go in pairs (a, b), as in kern_avx2.c's pv8: their chunks are
 * sign-extended and interleaved per 128-bit lane (VPUNPCKL/HWD), and the
 * product with the broadcast weight pair (w_a, w_b) adds w_a a_e + w_b b_e
 * into a 32-bit lane.  lo then holds elements 8L+0..3 of 128-bit lane L and
 * hi 8L+4..7; i8_flush puts them back in order, converts, scales and adds
 * them to o. */
static const int64_t i8_perm0[8] = { 0, 1, 8, 9, 2, 3, 10, 11 };
static const int64_t i8_perm1[8] = { 4, 5, 12, 13, 6, 7, 14, 15 };

INLINE void i8_flush(float *op, __m512i lo, __m512i hi, float ws, int half)
{
	const __m512 s = _mm512_set1_ps(ws);
	__m512i n0 = _mm512_permutex2var_epi64(lo, _mm512_loadu_si512(i8_perm0), hi);

	_mm512_storeu_ps(op, _mm512_fmadd_ps(_mm512_cvtepi32_ps(n0), s, _mm512_loadu_ps(op)));
	if (!half) {
		__m512i n1 = _mm512_permutex2var_epi64(lo, _mm512_loadu_si512(i8_perm1), hi);

		_mm512_storeu_ps(op + 16,
				 _mm512_fmadd_ps(_mm512_cvtepi32_ps(n1), s, _mm512_loadu_ps(op + 16)));
	}
}

/* One head over gathered rows: groups of I8_GROUP rows, all chunks of a
 * row in one pass (d <= 256: at most 16 accumulators), flushed per group. */
INLINE void pv8_one_512(const int16_t *w, float ws, const int d, const int8_t *base,
			const uint32_t *idx, size_t m, float *o)
{
	const int nc = (d + 31) / 32, half = d % 32 != 0;

	for (size_t i = 0; i < I8_GATHER && i < m; i++)
		i8_prefetch_row(base, idx, i, m, d);
	for (size_t i0 = 0; i0 < m; i0 += I8_GROUP) {
		size_t i1 = m - i0 < I8_GROUP ? m : i0 + I8_GROUP;
		__m512i al[KVD_DMAX / 32], ah[KVD_DMAX / 32];

#pragma GCC unroll 8
		for (int c = 0; c < KVD_DMAX / 32; c++)
			al[c] = ah[c] = _mm512_setzero_si512();
		for (size_t i = i0; i < i1; i += 2) {
			const int two = i + 1 < i1;
			const int8_t *pa = i8_at(base, idx, i, d);
			const int8_t *pb = two ? i8_at(base, idx, i + 1, d) : pa;
			uint32_t wa = (uint16_t)w[i], wb = two ? (uint16_t)w[i + 1] : 0;
			__m512i wp = _mm512_set1_epi32((int)(wa | wb << 16));

			i8_prefetch_row(base, idx, i + I8_GATHER, m, d);
			i8_prefetch_row(base, idx, i + 1 + I8_GATHER, m, d);
#pragma GCC unroll 8
			for (int c = 0; c < nc; c++) {
				const int hc = half && c == nc - 1;
				__m512i xa = i8_row(pa, c, hc), xb = i8_row(pb, c, hc);

				al[c] = i8_dp(al[c], _mm512_unpacklo_epi16(xa, xb), wp);
				ah[c] = i8_dp(ah[c], _mm512_unpackhi_epi16(xa, xb), wp);
			}
		}
#pragma GCC unroll 8
		for (int c = 0; c < nc; c++)
			i8_flush(o + 32 * c, al[c], ah[c], ws, half && c == nc - 1);
	}
}

/* GB heads over the rows of a tile, in passes of CW chunks (2 * CW * GB
 * accumulators); a tile's sums (at most 8 pairs: |sum| < 2^27) are exact. */
INLINE void pv8_pass_512(const int GB, const int CW, int c0, int nc, int half,
			 const uint32_t *wpair, const float *ws, float *o, int d, int odd,
			 const struct tile *tl, const int8_t *const *rp, const int8_t *const *pp)
{
	__m512i al[8], ah[8];           /* CW * GB <= 8 */

#pragma GCC unroll 8
	for (int k = 0; k < CW * GB; k++)
		al[k] = ah[k] = _mm512_setzero_si512();
	/* A missing row b of a pair is its run's stand-in (kern_walk.h) with
	 * weight 0: loaded, never counted. */
#pragma GCC unroll 8
	for (int r = 0; r < TILE; r += 2) {
		if (r % 4 >= tl->cnt[r / 4])
			continue;
		if (pp) {
#pragma GCC unroll 4
			for (int cc = 0; cc < CW; cc++)
				if ((c0 + cc) % 2 == 0) {
					_mm_prefetch((const char *)(pp[r] + 32 * (c0 + cc)), _MM_HINT_T1);
					_mm_prefetch((const char *)(pp[r + 1] + 32 * (c0 + cc)), _MM_HINT_T1);
				}
			if (c0 == 0 && odd) {
				_mm_prefetch((const char *)(pp[r] + d - 1), _MM_HINT_T1);
				_mm_prefetch((const char *)(pp[r + 1] + d - 1), _MM_HINT_T1);
			}
		}
#pragma GCC unroll 4
		for (int cc = 0; cc < CW; cc++) {
			const int hc = half && c0 + cc == nc - 1;
			__m512i xa = i8_row(rp[r], c0 + cc, hc), xb = i8_row(rp[r + 1], c0 + cc, hc);
			__m512i lo = _mm512_unpacklo_epi16(xa, xb), hi = _mm512_unpackhi_epi16(xa, xb);

#pragma GCC unroll 8
			for (int g = 0; g < GB; g++) {
				__m512i wp = _mm512_set1_epi32((int)wpair[g * TILE / 2 + r / 2]);

				al[cc * GB + g] = i8_dp(al[cc * GB + g], lo, wp);
				ah[cc * GB + g] = i8_dp(ah[cc * GB + g], hi, wp);
			}
		}
	}
#pragma GCC unroll 8
	for (int k = 0; k < CW * GB; k++) {
		const int g = k % GB, c = c0 + k / GB;

		i8_flush(o + g * d + 32 * c, al[k], ah[k], ws[g], half && c == nc - 1);
	}
}

INLINE void pv8_tile_512(const int GB, const int DC, const int16_t *w, size_t ldw,
			 const float *ws, float *o, const struct walk *wk, const struct tile *tl,
			 int pf)
{
	const int CW = GB <= 2 ? 4 : GB <= 4 ? 2 : 1;
	const int d = DC ? DC : 2 * wk->d, nc = (d + 31) / 32, half = d % 32 != 0;
	const int8_t *rp[TILE], *pp[TILE];
	uint32_t wpair[I8_GB_MAX * TILE / 2];   /* (w_a, w_b) of each pair, per head */
	int c0 = 0;

	for (int r = 0; r < TILE; r++) {
		rp[r] = (const int8_t *)slot_row(wk, tl, r / 4, r % 4);
		pp[r] = pf ? (const int8_t *)slot_pf(wk, tl, r / 4, r % 4) : NULL;
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
	for (; c0 + CW <= nc; c0 += CW)
		pv8_pass_512(GB, CW, c0, nc, half, wpair, ws, o, d, wk->odd, tl, rp, pf ? pp : NULL);
	if (CW > 2 && c0 + 2 <= nc) {
		pv8_pass_512(GB, 2, c0, nc, half, wpair, ws, o, d, wk->odd, tl, rp, pf ? pp : NULL);
		c0 += 2;
	}
	if (c0 < nc)
		pv8_pass_512(GB, 1, c0, nc, half, wpair, ws, o, d, wk->odd, tl, rp, pf ? pp : NULL);
}

typedef void pv8_512_fn(const int16_t *w, size_t ldw, const float *ws, float *o,
			const struct walk *wk, const struct tile *tl, int pf);
#define PV8_512_TILE(GB)                                                            \
	static __attribute__((noinline)) void pv8_512_tile_##GB(const int16_t *w,   \
		size_t ldw, const float *ws, float *o, const struct walk *wk,         \
		const struct tile *tl, int pf)                                        \
	{                                                                           \
		pv8_tile_512(GB, 0, w, ldw, ws, o, wk, tl, pf);                     \
	}                                                                           \
	static __attribute__((noinline)) void pv8_512_tile128_##GB(const int16_t *w, \
		size_t ldw, const float *ws, float *o, const struct walk *wk,         \
		const struct tile *tl, int pf)                                        \
	{                                                                           \
		pv8_tile_512(GB, 128, w, ldw, ws, o, wk, tl, pf);                   \
	}
I8_BY_GB(PV8_512_TILE)
static pv8_512_fn *const pv8_512_tiles[I8_GB_MAX] = I8_BY_GB_NAMES(pv8_512_tile);
static pv8_512_fn *const pv8_512_tiles128[I8_GB_MAX] = I8_BY_GB_NAMES(pv8_512_tile128);

static void pv8_512(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
		    const int8_t *base, const uint32_t *idx, size_t m, float *o)
{
	pv8_512_fn *const *tiles = d == 128 ? pv8_512_tiles128 : pv8_512_tiles;
	int ng = (G + I8_GB_MAX - 1) / I8_GB_MAX;
	struct walk wk;
	struct tile tl;

	if (m == 0)
		return;
	if (G == 1 && idx) {
		if (d == 128)
			pv8_one_512(w, wscale[0], 128, base, idx, m, o);
		else
			pv8_one_512(w, wscale[0], d, base, idx, m, o);
		return;
	}
	walk_init(&wk, (const uint16_t *)base, idx, m, d / 2);
	wk.pfd = wk.part ? PF_STREAM : I8_GATHER;
	for (size_t t = 0; t < wk.ntiles; t++) {
		tile_at(&wk, t, &tl);
		for (int k = 0, g0 = 0; k < ng; k++) {
			int gb = (G - g0) / (ng - k);

			tiles[gb - 1](w + g0 * ldw, ldw, wscale + g0, o + (size_t)g0 * d, &wk, &tl,
				      k == 0);
			g0 += gb;
		}
	}
}
