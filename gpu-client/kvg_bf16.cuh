/* bf16 on the device, bit for bit as engine/bf16.h on the host (round to
 * nearest even, NaN kept quiet): the kernels and kvd-decode share it so
 * rows rounded on either side of the PCIe bus are the same bits. */
#ifndef KVG_BF16_CUH
#define KVG_BF16_CUH

#include <stdint.h>

static __device__ __forceinline__ float bf2f(uint16_t h)
{
	return __uint_as_float((uint32_t)h << 16);
}

static __device__ __forceinline__ uint16_t f2bf(float f)
{
	uint32_t u = __float_as_uint(f);

	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fffu + ((u >> 16) & 1);
	return (uint16_t)(u >> 16);
}

#endif
