/* kvd_kern: the CPU kernels, one table of function pointers per ISA.
 *
 * kern_scalar.c is the reference; kern_avx2.c (AVX2+FMA) and kern_avx512.c
 * (AVX-512 F/BW/VL/DQ; plus an "avx512bf16" variant whose qk uses
 * VDPBF16PS) must agree with it within bf16-level tolerance
 * (tests/unit/test_kern.c).  On int8 rows, qk8 and pv8 take 16-bit
 * queries and weights and sum exactly in integers (qk8 equals scalar bit
 * for bit; pv8 as closely as pv does, its exact partial sums added in f32);
 * the AVX-512 tables sum 512 bits wide (kern_i8_512.h), "avx512vnni"
 * is the avx512 table with VPDPWSSD doing those sums, and "avx512amx" is
 * avx512vnni with qk8 and pv8 over contiguous rows on AMX tiles
 * (kern_amx.c; qk8 still bit for bit).
 *
 * kvd_kern_get() picks avx512amx, else avx512vnni, else avx512, else avx2,
 * else scalar, once, unless the environment says
 * KVD_ISA=scalar|avx2|avx512|avx512vnni|avx512bf16|avx512amx.  avx512bf16 is not
 * the default: on Sapphire Rapids VDPBF16PS issues at half the rate of FMA
 * and its qk runs at ~17 GB/s against ~27 for the f32 path.
 * kvd_kern_by_name() lets tests walk every variant; NULL for one this CPU
 * cannot run.
 *
 * The kernels keep up to ~48 KiB on the stack (hash): worker threads need
 * 64 KiB or more.  Row bases 64-byte aligned save a prefetch per row.
 *
 * Rows are bf16 (int8 for qk8 and pv8), d elements, rows of one array
 * contiguous: row i of `base` is base + (idx ? idx[i] : i) * d.  d is a
 * multiple of 16, at most KVD_DMAX.  G (q heads sharing a kv head) is at most
 * KVD_GMAX.  All kernels are pure and thread-safe; none allocates.
 */
#ifndef KVD_KERN_H
#define KVD_KERN_H

#include <stddef.h>
#include <stdint.h>

#define KVD_DMAX 256
#define KVD_GMAX 16

struct kvd_logp_tab;

struct kvd_kern {
	const char *name;

	/* Bit j of codes[t*ldc + i] = (x_i . W[:, t*K + j] > 0); x_i = x + i*ldx. */
	void (*hash)(const float *W, int d, int K, int L, const float *x, size_t ldx,
		     size_t n, uint16_t *codes, size_t ldc);

	/* s[g*lds + i] = q_g . row_i for g < G, i < m; q_g = q + g*d (float32).
	 * Head g's scores are bit for bit those of a call with q_g alone
	 * (G = 1), so a score never depends on how a caller groups heads
	 * (dense blocks score G heads, samples one). */
	void (*qk)(const float *q, int G, int d, const uint16_t *base,
		   const uint32_t *idx, size_t m, float *s, size_t lds);

	/* o[g*d + j] += sum_i w[g*ldw + i] * row_i[j]. */
	void (*pv)(const float *w, size_t ldw, int G, int d, const uint16_t *base,
		   const uint32_t *idx, size_t m, float *o);

	/* Largest of x[0..m); -inf when m == 0. */
	float (*max)(const float *x, size_t m);

	/* x[i] = exp(x[i] - mx) in place (exp(-inf) = 0); returns the sum. */
	float (*expsum)(float *x, size_t m, float mx);

	/* The sampling correction: with cos_i = s[i] * kinv[i] * qinv clamped to
	 * [-1, 1], s[i] = s[i] * scale - lnP(theta_i), lnP from tab (linear
	 * interpolation on theta/pi).  kinv[i] = 1/|k_i| (0 for a zero key). */
	void (*logp)(float *s, size_t m, const float *kinv, float qinv, float scale,
		     const struct kvd_logp_tab *tab);

	/* out[i] = 1/|row_i| over n contiguous rows (0 where the row is zero). */
	void (*kinv)(const uint16_t *rows, size_t n, int d, float *out);

	/* qk and pv over int8 rows (kv_dtype int8): row i of base is
	 * base + (idx ? idx[i] : i) * d bytes.  Callers fold the scales in
	 * (per-channel key scales into q, per-row value scales into w).
	 * qk8 takes q in 16 bits (kvd_q16 below; |q| <= 32767):
	 * s[g*lds + i] = (float)(sum_e q_g[e] * row_i[e]) * qscale[g], the sum
	 * exact in 32 bits (|sum| <= 256 * 32767 * 128 < 2^31).  pv8 takes the
	 * weights in 16 bits too: o[g*d + j] += wscale[g] * sum_i w[g*ldw + i] *
	 * row_i[j], the sum split into exact integer parts (a variant's choice)
	 * added in f32.  side, when not NULL, is a hint: records of side_sz
	 * bytes, one per row of base, that the caller reads for rows idx[]
	 * next (an int8 row's constants, struct kvd_row8); a gathered head
	 * (G = 1, idx) prefetches each into L2 beside its row, where its
	 * misses overlap the row's instead of stalling a loop of their own
	 * after (3-6 % of a mixed layer call: MEASUREMENTS.md, "The row
	 * constants beside the rows, and the lists' ranks in vectors").
	 * The results never depend on it. */
	void (*qk8)(const int16_t *q, const float *qscale, int G, int d, const int8_t *base,
		    const uint32_t *idx, size_t m, float *s, size_t lds, const void *side,
		    size_t side_sz);
	void (*pv8)(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
		    const int8_t *base, const uint32_t *idx, size_t m, float *o);

	/* The candidate walk's counts (lsh.c) as bits: bit j of bits[w] =
	 * (cnt[64w + j] >= c) for w < words, and cnt[0 .. 64 words) zeroed;
	 * bit j of nz[s] = (bits[64s + j] != 0), for the (words + 63) / 64
	 * words of nz (bits past `words` 0).  cnt is 64-byte aligned. */
	void (*ge8)(uint8_t *cnt, size_t words, uint8_t c, uint64_t *bits, uint64_t *nz);

	/* hybrid_lcv's moments (kern_mom.h): mom adds sum_i a_i b_i^T over r
	 * rows of d floats to kv (kv[f*d + e] += sum_i a[i*d+f] * b[i*d+e]);
	 * mv sets y[g*d + e] = col[e] * sum_f x[g*d + f] * row[f] * kv[f*d + e]
	 * for g < G, kv int8 under row and column scales (kvd_seg_head.kv; a
	 * head's bits do not depend on G).  d a multiple of 16. */
	void (*mom)(const float *a, const float *b, size_t r, int d, float *kv);
	void (*mv)(const int8_t *kv, const float *row, const float *col, int d, const float *x,
		   int G, float *y);

	/* rk[i] = the entries j < n that rank above entry i: s[j] > s[i], or
	 * s[j] == s[i] and id[j] < id[i] (ids distinct and no NaN make the
	 * ranks 0 .. n-1), for n <= KVD_KERN_RANK_MAX: the heavy lists' last
	 * selection (attn.c, rank_keep), n^2 compares, which in the baseline
	 * ISA's 4 lanes took 7 % of a dense default layer call. */
	void (*rank)(const float *s, const uint32_t *id, uint32_t n, uint32_t *rk);
};

#define KVD_KERN_RANK_MAX 64

/* q[G][d] (floats) as qk8 and pv8 take them (queries, or weights with d the
 * row count): per head, q16 = round(q / qscale) with qscale = max|q| /
 * 32767, so each element is within qscale/2 of q (2^-16 of the head's
 * largest).  A head with a non-finite element gets q16 = 0 and qscale NaN,
 * so its results are NaN as f32 ones would be. */
void kvd_q16(const float *q, int G, int d, int16_t *q16, float *qscale);
/* The plain C kvd_q16, whatever the CPU (tests compare the two). */
void kvd_q16_ref(const float *q, int G, int d, int16_t *q16, float *qscale);
/* ge8's summary nz of bits[0 .. words), in plain C (the scalar and AVX2
 * ge8 end with it; inline, so that no kernel file calls back into kern.c). */
static inline void kvd_ge8_summary(const uint64_t *bits, size_t words, uint64_t *nz)
{
	for (size_t w = 0; w < words; w += 64) {
		uint64_t y = 0;

		for (size_t k = 0; k < 64 && w + k < words; k++)
			y |= (uint64_t)(bits[w + k] != 0) << k;
		nz[w >> 6] = y;
	}
}

const struct kvd_kern *kvd_kern_get(void);
const struct kvd_kern *kvd_kern_by_name(const char *name);

/* The variants, for kern.c's dispatch only. */
extern const struct kvd_kern kvd_kern_scalar;
extern const struct kvd_kern kvd_kern_avx2;
extern const struct kvd_kern kvd_kern_avx512;
extern const struct kvd_kern kvd_kern_avx512bf16;
extern const struct kvd_kern kvd_kern_avx512vnni;
extern const struct kvd_kern kvd_kern_avx512amx;

/* kern_avx2.c's kvd_q16 (kern.c picks it on AVX2 hosts, AVX-512 ones
 * included). */
void kvd_q16_avx2(const float *q, int G, int d, int16_t *q16, float *qscale);
/* kern_avx512vnni.c's qk8 and pv8, for kern_avx512.c's avx512vnni table. */
void kvd_qk8_avx512vnni(const int16_t *q, const float *qscale, int G, int d, const int8_t *base,
			const uint32_t *idx, size_t m, float *s, size_t lds, const void *side,
			size_t side_sz);
void kvd_pv8_avx512vnni(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
			const int8_t *base, const uint32_t *idx, size_t m, float *o);
/* kern_amx.c's, for kern_avx512.c's avx512amx table. */
void kvd_qk8_amx(const int16_t *q, const float *qscale, int G, int d, const int8_t *base,
		 const uint32_t *idx, size_t m, float *s, size_t lds, const void *side,
		 size_t side_sz);
void kvd_pv8_amx(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
		 const int8_t *base, const uint32_t *idx, size_t m, float *o);

#endif
