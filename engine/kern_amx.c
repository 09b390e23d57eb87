/* The int8 kernels of kvd_kern_avx512amx: qk8 and pv8 over contiguous rows
 * (exact attention over int8 segments) on the AMX tile unit; gathered rows
 * and a d that is not a multiple of 64 go to the avx512vnni ones.  This
 * file alone is built with -mamx-tile -mamx-int8; the table is in
 * kern_avx512.c, and kern.c asks the kernel for the tile state
 * (arch_prctl) before it offers the table.
 *
 * TDPBSSD multiplies int8 by int8; q and the weights are 16-bit.  Each
 * 16-bit x is split exactly as x = 256 hi + lo' + 128 with hi = x >> 8 and
 * lo' = (x & 255) - 128, both int8, so one TDPBSSD over [hi | lo' | 1]
 * gives three integer sums and 256 A + B + 128 C is the exact sum the
 * scalar reference takes: qk8 equals it bit for bit, and pv8 adds the exact
 * sums of a window of AMX_VBUF / d rows to o in f32.  2G + 1 columns (rows for pv8)
 * fit in a tile's 16 when G <= 7; larger G goes in groups.
 *
 * qk8: A = 16 key rows x 64 bytes straight from the store (stride d), B =
 * the split q, C[i][col] read back per head with a gather.  pv8: B must be
 * V in 4-row interleaved form (B[i/4][4j + i%4] = V[i][j]); rows are
 * rearranged into a buffer a window at a time (eight shuffles a row at
 * d = 128), which leaves C's columns permuted within each 64, undone at
 * the flush.
 *
 * Tiles are configured at entry and released at exit, so a thread that is
 * not in a kernel holds no tile state.  The kernels keep up to ~25 KiB on
 * the stack.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kern.h"

#define AMX_GB   7      /* heads per group: 2 GB + 1 <= 16 */
#define AMX_VBUF 16384  /* pv8's rearranged rows: AMX_VBUF / d rows a window */
#define AMX_PF   64     /* rows ahead to prefetch (32-512, T0 or T1: alike) */

/* Rows [i, i + n) of base prefetched: tile loads of cold rows keep few
 * misses in flight.  Rows past the end (the caller's next block, usually)
 * are fine, a prefetch cannot fault; the address is formed as an integer
 * because such a pointer would be out of its array. */
static inline void pf_rows(const int8_t *base, size_t i, size_t n, int d)
{
	uintptr_t p = (uintptr_t)base + i * (size_t)d;

	for (size_t b = 0; b < n * (size_t)d; b += 64)
		_mm_prefetch((const char *)(p + b), _MM_HINT_T1);
}

struct tilecfg {
	uint8_t palette, start_row, rsvd[14];
	uint16_t colsb[16];
	uint8_t rows[16];
};

static void tile_shape(struct tilecfg *c, int t, int rows, int colsb)
{
	c->rows[t] = (uint8_t)rows;
	c->colsb[t] = (uint16_t)colsb;
}

/* ---- qk8 ----------------------------------------------------------------- */

/* C tile c = the sums of the 16 rows at a, chunk by chunk.  The chunks'
 * loads alternate between tiles 0 and 1 in case a load into the tile the
 * last TDPBSSD reads waits for it; that was not measured against one tile
 * (pv8 loads all its blocks into tile 1). */
#define QK_BLOCK(c, a, nch, d)                                         \
	do {                                                           \
		_tile_zero(c);                                         \
		_tile_loadd(0, (a), (d));                              \
		_tile_dpbssd(c, 0, 2);                                 \
		if ((nch) > 1) {                                       \
			_tile_loadd(1, (a) + 64, (d));                 \
			_tile_dpbssd(c, 1, 3);                         \
		}                                                      \
		if ((nch) > 2) {                                       \
			_tile_loadd(0, (a) + 128, (d));                \
			_tile_dpbssd(c, 0, 4);                         \
		}                                                      \
		if ((nch) > 3) {                                       \
			_tile_loadd(1, (a) + 192, (d));                \
			_tile_dpbssd(c, 1, 5);                         \
		}                                                      \
	} while (0)

/* s[g*lds + i] for the n rows of a block from its sums cb[i][col], col =
 * hi of head g, GB + g its lo', 2 GB the row's sum. */
static inline void qk_sums(const int32_t (*cb)[16], size_t n, int GB, const float *qs, float *s,
			   size_t lds)
{
	const __m512i rix = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112,
					      128, 144, 160, 176, 192, 208, 224, 240);
	const __m512i one = _mm512_slli_epi32(
		_mm512_i32gather_epi32(_mm512_add_epi32(rix, _mm512_set1_epi32(2 * GB)), cb, 4), 7);
	const __mmask16 k = (__mmask16)((1u << n) - 1);

	for (int g = 0; g < GB; g++) {
		__m512i hi = _mm512_i32gather_epi32(_mm512_add_epi32(rix, _mm512_set1_epi32(g)), cb, 4);
		__m512i lo = _mm512_i32gather_epi32(_mm512_add_epi32(rix, _mm512_set1_epi32(GB + g)), cb, 4);
		__m512i v = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo), one);

		_mm512_mask_storeu_ps(s + g * lds, k, _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(qs[g])));
	}
}

/* GB heads over m contiguous rows.  Tiles: 0, 1 = key rows, 2..5 = the
 * split q per 64-byte chunk, 6, 7 = the sums of two blocks. */
static void qk8_group(const int16_t *q, const float *qs, int GB, int d, const int8_t *base,
		      size_t m, float *s, size_t lds)
{
	const int nch = d / 64, N = 2 * GB + 1;
	_Alignas(64) int8_t bq[4][16][64];
	_Alignas(64) int32_t cb[2][16][16];
	_Alignas(64) int8_t pad[16 * KVD_DMAX];
	struct tilecfg cfg;

	/* B[r][col] (as dwords) = bytes 4r..4r+3 of column col's 64: each
	 * column's chunk scattered down its column; the rest of a row unused */
	for (int c = 0; c < nch; c++) {
		const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112,
						      128, 144, 160, 176, 192, 208, 224, 240);

		for (int g = 0; g < GB; g++) {
			__m512i x0 = _mm512_loadu_si512(q + g * d + 64 * c);
			__m512i x1 = _mm512_loadu_si512(q + g * d + 64 * c + 32);
			__m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(
					_mm512_cvtepi16_epi8(_mm512_srai_epi16(x0, 8))),
					_mm512_cvtepi16_epi8(_mm512_srai_epi16(x1, 8)), 1);
			__m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(
					_mm512_cvtepi16_epi8(x0)), _mm512_cvtepi16_epi8(x1), 1);

			lo = _mm512_xor_si512(lo, _mm512_set1_epi8(-128));      /* (x & 255) - 128 */
			_mm512_i32scatter_epi32(bq[c], _mm512_add_epi32(col, _mm512_set1_epi32(g)), hi, 4);
			_mm512_i32scatter_epi32(bq[c], _mm512_add_epi32(col, _mm512_set1_epi32(GB + g)), lo, 4);
		}
		_mm512_i32scatter_epi32(bq[c], _mm512_add_epi32(col, _mm512_set1_epi32(2 * GB)),
					_mm512_set1_epi8(1), 4);
	}

	memset(&cfg, 0, sizeof cfg);
	cfg.palette = 1;
	tile_shape(&cfg, 0, 16, 64);
	tile_shape(&cfg, 1, 16, 64);
	for (int c = 0; c < nch; c++)
		tile_shape(&cfg, 2 + c, 16, 4 * N);
	tile_shape(&cfg, 6, 16, 4 * N);
	tile_shape(&cfg, 7, 16, 4 * N);
	_tile_loadconfig(&cfg);
	_tile_loadd(2, bq[0], 64);
	if (nch > 1)
		_tile_loadd(3, bq[1], 64);
	if (nch > 2)
		_tile_loadd(4, bq[2], 64);
	if (nch > 3)
		_tile_loadd(5, bq[3], 64);

	/* Two blocks of 16 rows at a time, in C tiles 6 and 7, so the tile
	 * unit works on one while the other's sums are read back. */
	for (size_t i0 = 0; i0 < m; i0 += 32) {
		const size_t na = m - i0 < 16 ? m - i0 : 16, nb = m - i0 <= 16 ? 0 : m - i0 - 16 < 16 ? m - i0 - 16 : 16;
		const int8_t *a = base + i0 * (size_t)d, *b = a + 16 * (size_t)d;

		if (na < 16 || (nb && nb < 16)) {       /* the tail: never read past the rows */
			const int8_t *t = na < 16 ? a : b;
			size_t nt = na < 16 ? na : nb;

			memcpy(pad, t, nt * (size_t)d);
			memset(pad + nt * (size_t)d, 0, (16 - nt) * (size_t)d);
			if (na < 16)
				a = pad;
			else
				b = pad;
		}
		pf_rows(base, i0 + AMX_PF, 32, d);
		QK_BLOCK(6, a, nch, d);
		if (nb)
			QK_BLOCK(7, b, nch, d);
		_tile_stored(6, cb[0], 64);
		if (nb)
			_tile_stored(7, cb[1], 64);
		qk_sums(cb[0], na, GB, qs, s + i0, lds);
		if (nb)
			qk_sums(cb[1], nb, GB, qs, s + i0 + 16, lds);
	}
}

void kvd_qk8_amx(const int16_t *q, const float *qscale, int G, int d, const int8_t *base,
		 const uint32_t *idx, size_t m, float *s, size_t lds, const void *side,
		 size_t side_sz)
{
	if (idx || d % 64 || m == 0) {
		kvd_qk8_avx512vnni(q, qscale, G, d, base, idx, m, s, lds, side, side_sz);
		return;
	}
	int ng = (G + AMX_GB - 1) / AMX_GB;

	for (int k = 0, g0 = 0; k < ng; k++) {
		int gb = (G - g0) / (ng - k);

		qk8_group(q + (size_t)g0 * d, qscale + g0, gb, d, base, m, s + (size_t)g0 * lds, lds);
		g0 += gb;
	}
	_tile_release();
}

/* ---- pv8 ----------------------------------------------------------------- */

/* Rows [i0, i0 + n) (n <= the window) into vb in the interleaved form:
 * group r4 of four rows, 64-byte chunk h, gives rows r4 % 16 of the four B
 * tiles of blocks 4h..4h+3 of 64-row group r4 / 16.  Block 4h + k, column
 * 4L + t holds j = 64h + 16L + 4k + t.  Rows past n read as zero. */
static const int8_t zero_row[KVD_DMAX] __attribute__((aligned(64)));

static void pv8_rearrange(const int8_t *base, size_t n, int d, int8_t *vb)
{
	const int nbk = d / 16;

	for (size_t r4 = 0; r4 < (n + 3) / 4; r4++) {
		const int8_t *p[4];

#pragma GCC unroll 4
		for (int t = 0; t < 4; t++)
			p[t] = 4 * r4 + t < n ? base + (4 * r4 + t) * (size_t)d : zero_row;
		pf_rows(base, 4 * r4 + AMX_PF, 4, d);
		for (int h = 0; h < d / 64; h++) {
			__m512i x[4];

#pragma GCC unroll 4
			for (int t = 0; t < 4; t++)
				x[t] = _mm512_loadu_si512(p[t] + 64 * h);
			__m512i t0 = _mm512_unpacklo_epi8(x[0], x[1]), t1 = _mm512_unpackhi_epi8(x[0], x[1]);
			__m512i t2 = _mm512_unpacklo_epi8(x[2], x[3]), t3 = _mm512_unpackhi_epi8(x[2], x[3]);
			int8_t *o = vb + ((r4 / 16 * nbk + 4 * h) * 16 + r4 % 16) * 64;

			_mm512_store_si512(o + 0 * 1024, _mm512_unpacklo_epi16(t0, t2));
			_mm512_store_si512(o + 1 * 1024, _mm512_unpackhi_epi16(t0, t2));
			_mm512_store_si512(o + 2 * 1024, _mm512_unpacklo_epi16(t1, t3));
			_mm512_store_si512(o + 3 * 1024, _mm512_unpackhi_epi16(t1, t3));
		}
	}
	/* a window's last group of 64 rows padded with zero rows */
	for (size_t r4 = (n + 3) / 4; r4 % 16; r4++)
		for (int bk = 0; bk < nbk; bk++)
			memset(vb + ((r4 / 16 * nbk + bk) * 16 + r4 % 16) * 64, 0, 64);
}

/* Columns 64h.. of the sums (cb: rows [hi | lo' | 1], 64 ints each, block
 * k's 16 at 16k) put back in order and added to o, head by head. */
static void pv8_flush(const int32_t *cb, int GB, const float *ws, float *o, int d, int h)
{
	for (int g = 0; g < GB; g++) {
		__m512i x[4];

		for (int k = 0; k < 4; k++) {
			__m512i hi = _mm512_load_si512(cb + g * 64 + 16 * k);
			__m512i lo = _mm512_load_si512(cb + (GB + g) * 64 + 16 * k);
			__m512i one = _mm512_load_si512(cb + 2 * GB * 64 + 16 * k);

			x[k] = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo),
						_mm512_slli_epi32(one, 7));
		}
		__m512i p0 = _mm512_shuffle_i32x4(x[0], x[1], 0x44), p1 = _mm512_shuffle_i32x4(x[2], x[3], 0x44);
		__m512i p2 = _mm512_shuffle_i32x4(x[0], x[1], 0xee), p3 = _mm512_shuffle_i32x4(x[2], x[3], 0xee);
		__m512i y[4] = { _mm512_shuffle_i32x4(p0, p1, 0x88), _mm512_shuffle_i32x4(p0, p1, 0xdd),
				 _mm512_shuffle_i32x4(p2, p3, 0x88), _mm512_shuffle_i32x4(p2, p3, 0xdd) };
		const __m512 sc = _mm512_set1_ps(ws[g]);
		float *op = o + (size_t)g * d + 64 * h;

		for (int L = 0; L < 4; L++)
			_mm512_storeu_ps(op + 16 * L, _mm512_fmadd_ps(_mm512_cvtepi32_ps(y[L]), sc,
								      _mm512_loadu_ps(op + 16 * L)));
	}
}

/* GB heads over m contiguous rows, a window of rows at a time.  Tiles: 0 =
 * the split weights of a 64-row group, 1 = a block of rearranged rows,
 * 4..7 = the sums of four blocks (one 64-column chunk h). */
static void pv8_group(const int16_t *w, size_t ldw, const float *ws, int GB, int d,
		      const int8_t *base, size_t m, float *o)
{
	const int M = 2 * GB + 1, nbk = d / 16;
	const size_t win = AMX_VBUF / (size_t)d / 64 * 64;
	_Alignas(64) int8_t vb[AMX_VBUF];
	_Alignas(64) int8_t wa[16][AMX_VBUF / 64];      /* [M][win] */
	_Alignas(64) int32_t cb[16][64];
	struct tilecfg cfg;

	memset(&cfg, 0, sizeof cfg);
	cfg.palette = 1;
	tile_shape(&cfg, 0, M, 64);
	tile_shape(&cfg, 1, 16, 64);
	for (int t = 4; t < 8; t++)
		tile_shape(&cfg, t, M, 64);
	_tile_loadconfig(&cfg);

	for (size_t at = 0; at < m; at += win) {
		const size_t n = m - at < win ? m - at : win, ngr = (n + 63) / 64;

		pv8_rearrange(base + at * (size_t)d, n, d, vb);
		for (int g = 0; g < GB; g++)
			for (size_t i = 0; i < ngr * 64; i += 32) {
				const size_t k = n - i < 32 ? n - i : 32;
				__m512i x = i < n ? _mm512_maskz_loadu_epi16((__mmask32)(k == 32 ? ~0u : (1u << k) - 1),
									     w + g * ldw + at + i)
						  : _mm512_setzero_si512();

				_mm256_store_si256((__m256i *)&wa[g][i], _mm512_cvtepi16_epi8(_mm512_srai_epi16(x, 8)));
				_mm256_store_si256((__m256i *)&wa[GB + g][i],
						   _mm256_xor_si256(_mm512_cvtepi16_epi8(x), _mm256_set1_epi8(-128)));
			}
		memset(wa[2 * GB], 1, ngr * 64);
		for (int h = 0; h < d / 64; h++) {
			_tile_zero(4);
			_tile_zero(5);
			_tile_zero(6);
			_tile_zero(7);
			for (size_t gr = 0; gr < ngr; gr++) {
				const int8_t *b = vb + (gr * nbk + 4 * h) * 1024;

				_tile_loadd(0, &wa[0][64 * gr], (long)sizeof wa[0]);
				_tile_loadd(1, b, 64);
				_tile_dpbssd(4, 0, 1);
				_tile_loadd(1, b + 1024, 64);
				_tile_dpbssd(5, 0, 1);
				_tile_loadd(1, b + 2048, 64);
				_tile_dpbssd(6, 0, 1);
				_tile_loadd(1, b + 3072, 64);
				_tile_dpbssd(7, 0, 1);
			}
			_tile_stored(4, &cb[0][0], 256);
			_tile_stored(5, &cb[0][16], 256);
			_tile_stored(6, &cb[0][32], 256);
			_tile_stored(7, &cb[0][48], 256);
			pv8_flush(&cb[0][0], GB, ws, o, d, h);
		}
	}
}

void kvd_pv8_amx(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
		 const int8_t *base, const uint32_t *idx, size_t m, float *o)
{
	if (idx || d % 64 || m == 0) {
		kvd_pv8_avx512vnni(w, ldw, wscale, G, d, base, idx, m, o);
		return;
	}
	int ng = (G + AMX_GB - 1) / AMX_GB;

	for (int k = 0, g0 = 0; k < ng; k++) {
		int gb = (G - g0) / (ng - k);

		pv8_group(w + (size_t)g0 * ldw, ldw, wscale + g0, gb, d, base, m, o + (size_t)g0 * d);
		g0 += gb;
	}
	_tile_release();
}
