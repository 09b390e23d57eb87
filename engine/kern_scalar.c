/* The reference kernels: plain C, float32 accumulation in index order.  The
 * SIMD variants are checked against these, so they stay obvious. */
#include <math.h>
#include <string.h>

#include "bf16.h"
#include "kern.h"
#include "kern_mom.h"
#include "lsh.h"

static void hash_scalar(const float *W, int d, int K, int L, const float *x, size_t ldx,
			size_t n, uint16_t *codes, size_t ldc)
{
	int KL = K * L;

	for (size_t i = 0; i < n; i++) {
		const float *xi = x + i * ldx;

		for (int t = 0; t < L; t++) {
			unsigned code = 0;

			for (int j = 0; j < K; j++) {
				float y = 0.0f;

				for (int e = 0; e < d; e++)
					y += xi[e] * W[(size_t)e * KL + t * K + j];
				code |= (unsigned)(y > 0.0f) << j;
			}
			codes[(size_t)t * ldc + i] = (uint16_t)code;
		}
	}
}

static inline const uint16_t *row(const uint16_t *base, const uint32_t *idx, size_t i, int d)
{
	return base + (idx ? idx[i] : i) * (size_t)d;
}

static void qk_scalar(const float *q, int G, int d, const uint16_t *base,
		      const uint32_t *idx, size_t m, float *s, size_t lds)
{
	for (size_t i = 0; i < m; i++) {
		const uint16_t *r = row(base, idx, i, d);

		for (int g = 0; g < G; g++) {
			const float *qg = q + (size_t)g * d;
			float acc = 0.0f;

			for (int e = 0; e < d; e++)
				acc += qg[e] * kvd_bf16_to_f32(r[e]);
			s[(size_t)g * lds + i] = acc;
		}
	}
}

static void pv_scalar(const float *w, size_t ldw, int G, int d, const uint16_t *base,
		      const uint32_t *idx, size_t m, float *o)
{
	for (size_t i = 0; i < m; i++) {
		const uint16_t *r = row(base, idx, i, d);

		for (int g = 0; g < G; g++) {
			float wi = w[(size_t)g * ldw + i];
			float *og = o + (size_t)g * d;

			for (int e = 0; e < d; e++)
				og[e] += wi * kvd_bf16_to_f32(r[e]);
		}
	}
}

static inline const int8_t *row8(const int8_t *base, const uint32_t *idx, size_t i, int d)
{
	return base + (idx ? idx[i] : i) * (size_t)d;
}

static void qk8_scalar(const int16_t *q, const float *qscale, int G, int d,
		       const int8_t *base, const uint32_t *idx, size_t m, float *s, size_t lds,
		       const void *side, size_t side_sz)
{
	(void)side;
	(void)side_sz;
	for (size_t i = 0; i < m; i++) {
		const int8_t *r = row8(base, idx, i, d);

		for (int g = 0; g < G; g++) {
			const int16_t *qg = q + (size_t)g * d;
			int32_t acc = 0;

			for (int e = 0; e < d; e++)
				acc += (int32_t)qg[e] * r[e];
			s[(size_t)g * lds + i] = (float)acc * qscale[g];
		}
	}
}

static void pv8_scalar(const int16_t *w, size_t ldw, const float *wscale, int G, int d,
		       const int8_t *base, const uint32_t *idx, size_t m, float *o)
{
	for (int g = 0; g < G; g++) {
		int64_t acc[KVD_DMAX] = { 0 };
		float *og = o + (size_t)g * d;

		for (size_t i = 0; i < m; i++) {
			const int8_t *r = row8(base, idx, i, d);
			int32_t wi = w[(size_t)g * ldw + i];

			for (int e = 0; e < d; e++)
				acc[e] += wi * r[e];
		}
		for (int e = 0; e < d; e++)
			og[e] += (float)acc[e] * wscale[g];
	}
}

static float max_scalar(const float *x, size_t m)
{
	float mx = -INFINITY;

	for (size_t i = 0; i < m; i++)
		mx = x[i] > mx ? x[i] : mx;
	return mx;
}

static float expsum_scalar(float *x, size_t m, float mx)
{
	float sum = 0.0f;

	for (size_t i = 0; i < m; i++) {
		x[i] = expf(x[i] - mx);
		sum += x[i];
	}
	return sum;
}

static void logp_scalar(float *s, size_t m, const float *kinv, float qinv, float scale,
			const struct kvd_logp_tab *tab)
{
	for (size_t i = 0; i < m; i++) {
		float c = s[i] * kinv[i] * qinv;

		/* Written so that NaN (from a client's NaN rows or query) lands
		 * on -1 like the vector kernels' min/max: (int)NaN would index
		 * the table anywhere. */
		c = c > 1.0f ? 1.0f : c >= -1.0f ? c : -1.0f;
		float x = acosf(c) * (float)(KVD_LOGP_N / M_PI);
		int j = (int)x;

		j = j > KVD_LOGP_N ? KVD_LOGP_N : j;
		float f = x - (float)j;
		float lp = tab->v[j] + f * (tab->v[j + 1] - tab->v[j]);

		s[i] = s[i] * scale - lp;
	}
}

static void kinv_scalar(const uint16_t *rows, size_t n, int d, float *out)
{
	for (size_t i = 0; i < n; i++) {
		float acc = 0.0f;

		for (int e = 0; e < d; e++) {
			float v = kvd_bf16_to_f32(rows[i * (size_t)d + e]);

			acc += v * v;
		}
		out[i] = acc > 0.0f ? 1.0f / sqrtf(acc) : 0.0f;
	}
}

/* Eight counts at a time for c <= 128 (the walk's c is 1 or 2): a byte b
 * of y is >= c when its top bit is set, or else when (b | 0x80) - c keeps
 * it, which never borrows from the next byte; the eight top bits are then
 * gathered into a byte by one multiply. */
static void ge8_scalar(uint8_t *cnt, size_t words, uint8_t c, uint64_t *bits, uint64_t *nz)
{
	const uint64_t H = 0x8080808080808080ull, L = 0x0101010101010101ull;

	for (size_t w = 0; w < words; w++) {
		uint64_t x = 0;

		for (int k = 0; k < 8; k++) {
			const uint8_t *p = cnt + w * 64 + k * 8;
			uint64_t y, ge = 0;

			if (c <= 128) {
				memcpy(&y, p, 8);
				ge = ((((y & ~H) | H) - c * L) | y) & H;
				ge = (ge >> 7) * 0x0102040810204080ull >> 56;
			} else {
				for (int j = 0; j < 8; j++)
					ge |= (uint64_t)(p[j] >= c) << j;
			}
			x |= ge << (8 * k);
		}
		bits[w] = x;
	}
	kvd_ge8_summary(bits, words, nz);
	memset(cnt, 0, words * 64);
}

/* Vectorized at -O2 by GCC only with its dynamic cost model (the loop's
 * trip count is not a multiple of the vector); clang vectorizes it anyway
 * and knows no such attribute. */
#if defined(__clang__)
#define VEC_DYNAMIC
#else
#define VEC_DYNAMIC __attribute__((optimize("vect-cost-model=dynamic")))
#endif

VEC_DYNAMIC
static void rank_scalar(const float *s, const uint32_t *id, uint32_t n, uint32_t *rk)
{
	for (uint32_t i = 0; i < n; i++) {
		float x = s[i];
		uint32_t y = id[i], r = 0;

		for (uint32_t j = 0; j < n; j++)
			r += (uint32_t)((s[j] > x) | ((s[j] == x) & (id[j] < y)));
		rk[i] = r;
	}
}

const struct kvd_kern kvd_kern_scalar = {
	.name = "scalar",
	.hash = hash_scalar,
	.qk = qk_scalar,
	.pv = pv_scalar,
	.max = max_scalar,
	.expsum = expsum_scalar,
	.logp = logp_scalar,
	.kinv = kinv_scalar,
	.qk8 = qk8_scalar,
	.pv8 = pv8_scalar,
	.ge8 = ge8_scalar,
	.mom = mom_kern,
	.mv = mv_kern,
	.rank = rank_scalar,
};
