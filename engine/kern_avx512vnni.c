/* The int8 kernels of kvd_kern_avx512vnni: kern_i8_512.h summing with
 * VPDPWSSD.  This file alone is built with -mavx512vnni, so no other code
 * meets a VNNI instruction; the table is in kern_avx512.c. */
#include <immintrin.h>
#include <stdint.h>

#include "kern.h"

#define INLINE static inline __attribute__((always_inline))

#include "kern_walk.h"

#define I8_VNNI 1
#include "kern_i8_512.h"

void kvd_qk8_avx512vnni(const int16_t *q, const float *qscale, int G, int d, const int8_t *base,
			const uint32_t *idx, size_t m, float *s, size_t lds, const void *side,
			size_t side_sz)
{
	qk8_512(q, qscale, G, d, base, idx, m, s, lds, side, side_sz);
}

void kvd_pv8_avx512vnni(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
			const int8_t *base, const uint32_t *idx, size_t m, float *o)
{
	pv8_512(w, ldw, wscale, G, d, base, idx, m, o);
}
