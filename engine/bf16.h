/* bfloat16 <-> float, the storage format of every K and V row in kvd.
 *
 * Rounding is to nearest, ties to even; NaN stays NaN (quiet).  These are the
 * reference conversions: SIMD kernels must produce the same bits.
 */
#ifndef KVD_BF16_H
#define KVD_BF16_H

#include <stdint.h>
#include <string.h>

static inline float kvd_bf16_to_f32(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;

	memcpy(&f, &u, sizeof f);
	return f;
}

static inline uint16_t kvd_f32_to_bf16(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof u);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fffu + ((u >> 16) & 1);
	return (uint16_t)(u >> 16);
}

static inline void kvd_bf16_from_f32_n(uint16_t *dst, const float *src, size_t n)
{
	for (size_t i = 0; i < n; i++)
		dst[i] = kvd_f32_to_bf16(src[i]);
}

static inline void kvd_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n)
{
	for (size_t i = 0; i < n; i++)
		dst[i] = kvd_bf16_to_f32(src[i]);
}

#endif
