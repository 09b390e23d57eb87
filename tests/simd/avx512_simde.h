/* AVX-512 on any x86-64 host, for tests only: SIMDe's portable versions of
 * the intrinsics under their usual names, so that kern_avx512.c and
 * kern_avx512vnni.c build with -mavx2 and test_kern checks them against
 * the scalar reference on a machine without AVX-512 (make check-avx512-emu).
 * Force-included (-include) before the kernel file: SIMDe pulls in
 * <immintrin.h>, whose include guard then makes the file's own #include a
 * no-op.  SIMDe 0.7.4 lacks a few intrinsics the kernels use; they are
 * defined below, element by element.  Speed means nothing here. */
#ifndef KVD_AVX512_SIMDE_H
#define KVD_AVX512_SIMDE_H

#include <stdint.h>
#include <string.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* SIMDe 0.7.4 aliases _mm512_madd_epi16 to the masked form's 4 arguments */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16((a), (b))
#undef _mm512_zextsi256_si512
#define _mm512_zextsi256_si512(a) simde_mm512_inserti64x4(simde_mm512_setzero_si512(), (a), 0)
static inline simde__m512i emu_shuffle_i32x4(simde__m512i a, simde__m512i b, int imm)
{
	int32_t x[16], y[16], r[16];
	simde_mm512_storeu_si512(x, a);
	simde_mm512_storeu_si512(y, b);
	for (int l = 0; l < 4; l++) {
		const int32_t *s = l < 2 ? x : y;
		int sel = (imm >> (2 * l)) & 3;
		for (int k = 0; k < 4; k++)
			r[4 * l + k] = s[4 * sel + k];
	}
	return simde_mm512_loadu_si512(r);
}
#undef _mm512_shuffle_i32x4
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_i32x4(a, b, imm) emu_shuffle_i32x4((a), (b), (imm))
#define _mm512_shuffle_f32x4(a, b, imm) simde_mm512_castsi512_ps(emu_shuffle_i32x4(simde_mm512_castps_si512(a), simde_mm512_castps_si512(b), (imm)))
static inline void emu_mask_storeu_ps512(void *p, simde__mmask16 k, simde__m512 v)
{
	float x[16];
	simde_mm512_storeu_ps(x, v);
	for (int i = 0; i < 16; i++)
		if (k >> i & 1)
			((float *)p)[i] = x[i];
}
static inline void emu_mask_storeu_ps128(void *p, simde__mmask8 k, simde__m128 v)
{
	float x[4];
	simde_mm_storeu_ps(x, v);
	for (int i = 0; i < 4; i++)
		if (k >> i & 1)
			((float *)p)[i] = x[i];
}
static inline simde__m128 emu_maskz_loadu_ps128(simde__mmask8 k, const void *p)
{
	float x[4] = { 0 };
	for (int i = 0; i < 4; i++)
		if (k >> i & 1)
			x[i] = ((const float *)p)[i];
	return simde_mm_loadu_ps(x);
}
#undef _mm512_mask_storeu_ps
#undef _mm_mask_storeu_ps
#undef _mm_maskz_loadu_ps
#define _mm512_mask_storeu_ps(p, k, v) emu_mask_storeu_ps512((p), (k), (v))
#define _mm_mask_storeu_ps(p, k, v) emu_mask_storeu_ps128((p), (k), (v))
#define _mm_maskz_loadu_ps(k, p) emu_maskz_loadu_ps128((k), (p))
static inline simde__m512bh emu_cvtne2ps_pbh(simde__m512 a, simde__m512 b)
{
	float x[32];
	uint16_t r[32];
	simde__m512bh out;
	simde_mm512_storeu_ps(x, b);
	simde_mm512_storeu_ps(x + 16, a);
	for (int i = 0; i < 32; i++) {
		uint32_t u;
		memcpy(&u, &x[i], 4);
		if ((u & 0x7fffffff) > 0x7f800000)
			r[i] = (uint16_t)((u >> 16) | 0x40);
		else
			r[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
	}
	memcpy(&out, r, 64);
	return out;
}
static inline simde__m512i emu_cvtepu16_epi32(simde__m256i a)
{
	uint16_t x[16];
	int32_t r[16];
	simde_mm256_storeu_si256(x, a);
	for (int i = 0; i < 16; i++)
		r[i] = x[i];
	return simde_mm512_loadu_si512(r);
}
#undef _mm512_cvtne2ps_pbh
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtne2ps_pbh(a, b) emu_cvtne2ps_pbh((a), (b))
#define _mm512_cvtepu16_epi32(a) emu_cvtepu16_epi32(a)
static inline float emu_reduce_max_ps(simde__m512 v)
{
	float x[16], m;
	simde_mm512_storeu_ps(x, v);
	m = x[0];
	for (int i = 1; i < 16; i++)
		m = x[i] > m ? x[i] : m;
	return m;
}
static inline simde__m512 emu_maskz_loadu_ps512(simde__mmask16 k, const void *p)
{
	float x[16] = { 0 };
	for (int i = 0; i < 16; i++)
		if (k >> i & 1)
			x[i] = ((const float *)p)[i];
	return simde_mm512_loadu_ps(x);
}
#undef _mm512_reduce_max_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_reduce_max_ps(v) emu_reduce_max_ps(v)
#define _mm512_maskz_loadu_ps(k, p) emu_maskz_loadu_ps512((k), (p))
static inline float emu_reduce_add_ps(simde__m512 v)
{
	/* the same tree as GCC's: halves, then quarters, then pairs */
	float x[16];
	simde_mm512_storeu_ps(x, v);
	for (int w = 8; w >= 1; w /= 2)
		for (int i = 0; i < w; i++)
			x[i] += x[i + w];
	return x[0];
}
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(v) emu_reduce_add_ps(v)
static inline simde__m512 emu_i32gather_ps(simde__m512i vi, const void *base, int scale)
{
	int32_t ix[16];
	float r[16];
	simde_mm512_storeu_si512(ix, vi);
	for (int i = 0; i < 16; i++)
		memcpy(&r[i], (const char *)base + (ptrdiff_t)ix[i] * scale, 4);
	return simde_mm512_loadu_ps(r);
}
static inline simde__m512i emu_cvttps_epi32(simde__m512 v)
{
	float x[16];
	int32_t r[16];
	simde_mm512_storeu_ps(x, v);
	for (int i = 0; i < 16; i++)
		r[i] = (x[i] >= -2147483648.0f && x[i] < 2147483648.0f) ? (int32_t)x[i] : INT32_MIN;
	return simde_mm512_loadu_si512(r);
}
static inline simde__m512 emu_cvtepi32_ps(simde__m512i v)
{
	int32_t x[16];
	float r[16];
	simde_mm512_storeu_si512(x, v);
	for (int i = 0; i < 16; i++)
		r[i] = (float)x[i];
	return simde_mm512_loadu_ps(r);
}
#undef _mm512_i32gather_ps
#undef _mm512_cvttps_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_i32gather_ps(vi, b, s) emu_i32gather_ps((vi), (b), (s))
#define _mm512_cvttps_epi32(v) emu_cvttps_epi32(v)
#define _mm512_cvtepi32_ps(v) emu_cvtepi32_ps(v)
static inline void emu_mask_cvtepi32_storeu_epi16(void *p, simde__mmask16 k, simde__m512i v)
{
	int32_t x[16];
	simde_mm512_storeu_si512(x, v);
	for (int i = 0; i < 16; i++)
		if (k >> i & 1)
			((int16_t *)p)[i] = (int16_t)x[i];
}
#undef _mm512_mask_cvtepi32_storeu_epi16
#define _mm512_mask_cvtepi32_storeu_epi16(p, k, v) emu_mask_cvtepi32_storeu_epi16((p), (k), (v))

static inline simde__m256i emu_maskz_loadu_epi8_256(simde__mmask32 k, const void *p)
{
	int8_t x[32] = { 0 };
	for (int i = 0; i < 32; i++)
		if (k >> i & 1)
			x[i] = ((const int8_t *)p)[i];
	return simde_mm256_loadu_si256(x);
}
static inline simde__m512i emu_maskz_loadu_epi16_512(simde__mmask32 k, const void *p)
{
	int16_t x[32] = { 0 };
	for (int i = 0; i < 32; i++)
		if (k >> i & 1)
			memcpy(&x[i], (const char *)p + 2 * i, 2);
	return simde_mm512_loadu_si512(x);
}
#undef _mm256_maskz_loadu_epi8
#undef _mm512_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi8(k, p) emu_maskz_loadu_epi8_256((k), (p))
#define _mm512_maskz_loadu_epi16(k, p) emu_maskz_loadu_epi16_512((k), (p))

#endif
