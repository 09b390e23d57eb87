/* kvd-decode's model kernels.  See model.h. */
#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "gpu-client/kvg_bf16.cuh"
#include "model.h"

#define NT 256

static __device__ __forceinline__ uint64_t mix64(uint64_t z)
{
	z ^= z >> 30;
	z *= 0xbf58476d1ce4e5b9ull;
	z ^= z >> 27;
	z *= 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static unsigned blocks(size_t n)
{
	size_t b = (n + NT - 1) / NT;

	return (unsigned)(b < 65536 ? (b ? b : 1) : 65536);
}

static __global__ void __launch_bounds__(NT) fill_kernel(uint16_t *p, size_t n, uint64_t seed, float offset, float scale)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		uint64_t z = mix64(seed + (i + 1) * 0x9e3779b97f4a7c15ull);
		float u = (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;

		p[i] = f2bf(offset + scale * u);
	}
}

extern "C" cudaError_t mdl_fill_bf16(uint16_t *p, size_t n, uint64_t seed, float offset,
				     float scale, cudaStream_t st)
{
	fill_kernel<<<blocks(n), NT, 0, st>>>(p, n, seed, offset, scale);
	return cudaGetLastError();
}

static __global__ void __launch_bounds__(NT)
embed_kernel(const uint16_t *emb, const int32_t *tok, float *x, uint32_t hidden)
{
	uint32_t b = blockIdx.y;
	const uint16_t *row = emb + (size_t)tok[b] * hidden;

	for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < hidden; i += gridDim.x * blockDim.x)
		x[(size_t)b * hidden + i] = bf2f(row[i]);
}

extern "C" cudaError_t mdl_embed(const uint16_t *emb, const int32_t *tok, float *x, uint32_t B,
				 uint32_t hidden, cudaStream_t st)
{
	embed_kernel<<<dim3((hidden + NT - 1) / NT, B), NT, 0, st>>>(emb, tok, x, hidden);
	return cudaGetLastError();
}

static __device__ float block_sum(float v, float *sh)
{
	for (int m = 16; m; m >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, m);
	if ((threadIdx.x & 31) == 0)
		sh[threadIdx.x >> 5] = v;
	__syncthreads();
	v = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : 0.0f;
	if (threadIdx.x < 32)
		for (int m = 16; m; m >>= 1)
			v += __shfl_xor_sync(0xffffffffu, v, m);
	if (threadIdx.x == 0)
		sh[0] = v;
	__syncthreads();
	return sh[0];
}

static __global__ void __launch_bounds__(NT)
rmsnorm_kernel(const float *x, const uint16_t *w, uint16_t *out, uint32_t hidden, float eps)
{
	__shared__ float sh[NT / 32];
	const float *xr = x + (size_t)blockIdx.x * hidden;
	float ss = 0.0f, r;

	for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x)
		ss += xr[i] * xr[i];
	ss = block_sum(ss, sh);
	r = rsqrtf(ss / hidden + eps);
	for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x)
		out[(size_t)blockIdx.x * hidden + i] = f2bf(xr[i] * r * bf2f(w[i]));
}

extern "C" cudaError_t mdl_rmsnorm(const float *x, const uint16_t *w, uint16_t *out, uint32_t B,
				   uint32_t hidden, float eps, cudaStream_t st)
{
	rmsnorm_kernel<<<B, NT, 0, st>>>(x, w, out, hidden, eps);
	return cudaGetLastError();
}

/* One block per (token, head) of q, k and v; thread i < d/2 rotates the
 * pair (i, i + d/2). */
static __global__ void __launch_bounds__(NT)
rope_kernel(const float *qkv, uint32_t Hq, uint32_t H, uint32_t d, uint32_t pos, float theta,
	    float *q, float *k, float *v)
{
	uint32_t b = blockIdx.y, hh = blockIdx.x, half = d / 2;
	const float *row = qkv + (size_t)b * (Hq + 2 * H) * d + (size_t)hh * d;
	float *dst;

	if (hh < Hq)
		dst = q + ((size_t)b * Hq + hh) * d;
	else if (hh < Hq + H)
		dst = k + ((size_t)b * H + hh - Hq) * d;
	else {
		for (uint32_t i = threadIdx.x; i < d; i += blockDim.x)
			v[((size_t)b * H + hh - Hq - H) * d + i] = row[i];
		return;
	}
	for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
		/* in double: positions near 10^5 times frequencies near 1 */
		double ang = (double)pos * pow((double)theta, -2.0 * i / d);
		float c = (float)cos(ang), s = (float)sin(ang);
		float x1 = row[i], x2 = row[i + half];

		dst[i] = x1 * c - x2 * s;
		dst[i + half] = x2 * c + x1 * s;
	}
}

extern "C" cudaError_t mdl_rope_split(const float *qkv, uint32_t B, uint32_t Hq, uint32_t H,
				      uint32_t d, uint32_t pos, float theta, float *q, float *k,
				      float *v, cudaStream_t st)
{
	rope_kernel<<<dim3(Hq + 2 * H, B), 64, 0, st>>>(qkv, Hq, H, d, pos, theta, q, k, v);
	return cudaGetLastError();
}

static __global__ void __launch_bounds__(NT) cast_kernel(const float *x, uint16_t *y, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		y[i] = f2bf(x[i]);
}

extern "C" cudaError_t mdl_to_bf16(const float *x, uint16_t *y, size_t n, cudaStream_t st)
{
	cast_kernel<<<blocks(n), NT, 0, st>>>(x, y, n);
	return cudaGetLastError();
}

static __global__ void __launch_bounds__(NT)
swiglu_kernel(const float *gu, uint16_t *out, uint32_t inter)
{
	uint32_t b = blockIdx.y;

	for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < inter; i += gridDim.x * blockDim.x) {
		float g = gu[(size_t)b * 2 * inter + i], u = gu[(size_t)b * 2 * inter + inter + i];

		out[(size_t)b * inter + i] = f2bf(g / (1.0f + expf(-g)) * u);
	}
}

extern "C" cudaError_t mdl_swiglu(const float *gu, uint16_t *out, uint32_t B, uint32_t inter,
				  cudaStream_t st)
{
	swiglu_kernel<<<dim3((inter + NT - 1) / NT, B), NT, 0, st>>>(gu, out, inter);
	return cudaGetLastError();
}

static __global__ void __launch_bounds__(NT)
argmax_kernel(const float *logits, uint32_t vocab, int32_t *tok)
{
	__shared__ float sv[NT];
	__shared__ int32_t si[NT];
	const float *row = logits + (size_t)blockIdx.x * vocab;
	float best = -INFINITY;
	int32_t bi = 0;

	for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x)
		if (row[i] > best) {
			best = row[i];
			bi = (int32_t)i;
		}
	sv[threadIdx.x] = best;
	si[threadIdx.x] = bi;
	__syncthreads();
	for (uint32_t s = blockDim.x / 2; s; s >>= 1) {
		if (threadIdx.x < s) {
			float o = sv[threadIdx.x + s];
			int32_t oi = si[threadIdx.x + s];

			if (o > sv[threadIdx.x] || (o == sv[threadIdx.x] && oi < si[threadIdx.x])) {
				sv[threadIdx.x] = o;
				si[threadIdx.x] = oi;
			}
		}
		__syncthreads();
	}
	if (threadIdx.x == 0)
		tok[blockIdx.x] = si[0];
}

extern "C" cudaError_t mdl_argmax(const float *logits, uint32_t B, uint32_t vocab, int32_t *tok,
				  cudaStream_t st)
{
	argmax_kernel<<<B, NT, 0, st>>>(logits, vocab, tok);
	return cudaGetLastError();
}
