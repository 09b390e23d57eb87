/* kvg_kern: CUDA kernels of libkvclient's GPU backend.  See kvg_kern.h. */
#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "kvg_bf16.cuh"
#include "kvg_kern.h"
#include "kvg_launch.cuh"

#define NT 128                  /* threads per block of every kernel here */
#define MEAN_NB 256             /* most partial-sum blocks per head */

template <int DT> static __device__ __forceinline__ float ld(const void *p, size_t i);
template <> __device__ __forceinline__ float ld<KVG_F32>(const void *p, size_t i)
{
	return ((const float *)p)[i];
}
template <> __device__ __forceinline__ float ld<KVG_BF16>(const void *p, size_t i)
{
	return bf2f(((const uint16_t *)p)[i]);
}

static unsigned grid_for(size_t work)
{
	size_t b = (work + NT - 1) / NT;

	/* grid-stride loops cover the rest */
	return (unsigned)(b < 65535 * 8 ? (b ? b : 1) : 65535 * 8);
}

static cudaError_t launched(void)
{
	return cudaGetLastError();
}

/* ---- mean ----------------------------------------------------------------- */

/* Block (b, h): column sums in double of rows [lo + b*per, ..) of head h.
 * blockDim.x >= d is not needed: columns are strided over the block. */
template <int DT>
static __global__ void __launch_bounds__(NT)
mean_part(const void *k, uint32_t n, uint32_t d, uint32_t lo, uint32_t hi, uint32_t per,
	  double *part)
{
	uint32_t h = blockIdx.y, b = blockIdx.x, nb = gridDim.x;
	uint32_t t0 = lo + b * per, t1 = min(hi, t0 + per);

	for (uint32_t e = threadIdx.x; e < d; e += blockDim.x) {
		double acc = 0.0;

#pragma unroll 8
		for (uint32_t t = t0; t < t1; t++)
			acc += (double)ld<DT>(k, ((size_t)h * n + t) * d + e);
		part[((size_t)h * nb + b) * d + e] = acc;
	}
}

static __global__ void __launch_bounds__(NT)
mean_final(const double *part, uint32_t nb, uint32_t d, uint32_t rows, float *mean)
{
	uint32_t h = blockIdx.x;

	for (uint32_t e = threadIdx.x; e < d; e += blockDim.x) {
		double acc = 0.0;

		for (uint32_t b = 0; b < nb; b++)
			acc += part[((size_t)h * nb + b) * d + e];
		mean[(size_t)h * d + e] = rows ? (float)(acc / rows) : 0.0f;
	}
}

extern "C" size_t kvg_mean_scratch(uint32_t H, uint32_t d)
{
	return (size_t)H * MEAN_NB * d * sizeof(double);
}

extern "C" cudaError_t kvg_mean(const void *k, int dtype, uint32_t H, uint32_t n, uint32_t d,
				uint32_t lo, uint32_t hi, float *mean, double *scratch,
				cudaStream_t st)
{
	uint32_t rows = hi > lo ? hi - lo : 0;
	uint32_t nb = rows ? (rows + 63) / 64 : 1, per;

	if (H == 0 || d == 0)
		return cudaSuccess;
	if (nb > MEAN_NB)
		nb = MEAN_NB;
	per = rows ? (rows + nb - 1) / nb : 0;
	nb = rows ? (rows + per - 1) / per : 1;
	dim3 g(nb, H);

	if (dtype == KVG_BF16)
		KVG_LAUNCH(mean_part<KVG_BF16>, g, NT, 0, st, k, n, d, lo, hi, per, scratch);
	else
		KVG_LAUNCH(mean_part<KVG_F32>, g, NT, 0, st, k, n, d, lo, hi, per, scratch);
	KVG_LAUNCH(mean_final, H, NT, 0, st, scratch, nb, d, rows, mean);
	return launched();
}

/* ---- rows ---------------------------------------------------------------- */

template <int DT>
static __global__ void __launch_bounds__(NT)
rows_kernel(const void *k, const void *v, uint32_t H, uint32_t n, uint32_t d, uint32_t t0,
	    uint32_t cnt, const float *mean, uint16_t *kb, uint16_t *vb, size_t ldo,
	    uint32_t row0, float *x)
{
	size_t total = (size_t)H * cnt * d;

	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
	     idx += (size_t)gridDim.x * blockDim.x) {
		uint32_t e = (uint32_t)(idx % d);
		size_t hi_ = idx / d;
		uint32_t i = (uint32_t)(hi_ % cnt), h = (uint32_t)(hi_ / cnt);
		size_t src = ((size_t)h * n + t0 + i) * d + e;
		size_t dst = ((size_t)h * ldo + row0 + i) * d + e;
		float kf = ld<DT>(k, src);
		uint16_t kr = f2bf(mean ? kf - mean[(size_t)h * d + e] : kf);

		kb[dst] = kr;
		vb[dst] = f2bf(ld<DT>(v, src));
		if (x)
			x[idx] = bf2f(kr);
	}
}

extern "C" cudaError_t kvg_rows(const void *k, const void *v, int dtype, uint32_t H, uint32_t n,
				uint32_t d, uint32_t t0, uint32_t cnt, const float *mean,
				uint16_t *kb, uint16_t *vb, size_t ldo, uint32_t row0, float *x,
				cudaStream_t st)
{
	size_t total = (size_t)H * cnt * d;

	if (total == 0)
		return cudaSuccess;
	if (dtype == KVG_BF16)
		KVG_LAUNCH(rows_kernel<KVG_BF16>, grid_for(total), NT, 0, st, k, v, H, n, d, t0, cnt, mean,
								      kb, vb, ldo, row0, x);
	else
		KVG_LAUNCH(rows_kernel<KVG_F32>, grid_for(total), NT, 0, st, k, v, H, n, d, t0, cnt, mean,
								     kb, vb, ldo, row0, x);
	return launched();
}

/* ---- append ---------------------------------------------------------------- */

struct put_args {
	const void *k, *v;
	uint32_t H, d, j0;
	struct kvg_put put[KVG_ATTN_BATCH];
};

template <int DT>
static __global__ void __launch_bounds__(NT) append_kernel(const __grid_constant__ put_args a)
{
	uint32_t j = blockIdx.y;
	const struct kvg_put *p = &a.put[j];
	uint32_t Hd = a.H * a.d;

	for (uint32_t idx = blockIdx.x * blockDim.x + threadIdx.x; idx < Hd;
	     idx += gridDim.x * blockDim.x) {
		uint32_t h = idx / a.d, e = idx % a.d;
		size_t src = (size_t)(a.j0 + j) * Hd + idx;
		size_t dst = ((size_t)h * p->cap + p->row) * a.d + e;
		float kf = ld<DT>(a.k, src);

		p->k[dst] = f2bf(p->mean ? kf - p->mean[idx] : kf);
		p->v[dst] = f2bf(ld<DT>(a.v, src));
	}
}

extern "C" cudaError_t kvg_append(const void *k, const void *v, int dtype,
				  const struct kvg_put *put, uint32_t nseq, uint32_t H, uint32_t d,
				  cudaStream_t st)
{
	for (uint32_t j0 = 0; j0 < nseq; j0 += KVG_ATTN_BATCH) {
		uint32_t cnt = nseq - j0 < KVG_ATTN_BATCH ? nseq - j0 : KVG_ATTN_BATCH;
		put_args a;
		dim3 g((H * d + NT - 1) / NT, cnt);

		a.k = k;
		a.v = v;
		a.H = H;
		a.d = d;
		a.j0 = j0;
		for (uint32_t j = 0; j < cnt; j++)
			a.put[j] = put[j0 + j];
		if (dtype == KVG_BF16)
			KVG_LAUNCH(append_kernel<KVG_BF16>, g, NT, 0, st, a);
		else
			KVG_LAUNCH(append_kernel<KVG_F32>, g, NT, 0, st, a);
		cudaError_t rc = launched();

		if (rc != cudaSuccess)
			return rc;
	}
	return cudaSuccess;
}

/* ---- eviction gather ----------------------------------------------------- */

struct gather_args {
	uint32_t H, d, cnt, j0;
	float *x;
	struct kvg_evict ev[KVG_EVICT_BATCH];
};

static __global__ void __launch_bounds__(NT) gather_kernel(const __grid_constant__ gather_args a)
{
	uint32_t j = blockIdx.y;
	const struct kvg_evict *p = &a.ev[j];
	uint32_t R = p->cap - p->nsink;
	size_t per = (size_t)a.H * a.cnt * a.d;

	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < per;
	     idx += (size_t)gridDim.x * blockDim.x) {
		uint32_t e = (uint32_t)(idx % a.d);
		uint32_t i = (uint32_t)((idx / a.d) % a.cnt), h = (uint32_t)(idx / a.d / a.cnt);
		uint32_t r = p->head + i;
		size_t src;

		r = p->nsink + (r >= R ? r - R : r);
		src = ((size_t)h * p->cap + r) * a.d + e;
		uint16_t kr = p->k[src];

		p->kb[idx] = kr;
		p->vb[idx] = p->v[src];
		a.x[(size_t)(a.j0 + j) * per + idx] = bf2f(kr);
	}
}

extern "C" cudaError_t kvg_gather(const struct kvg_evict *ev, uint32_t nev, uint32_t H,
				  uint32_t d, uint32_t cnt, float *x, cudaStream_t st)
{
	for (uint32_t j0 = 0; j0 < nev; j0 += KVG_EVICT_BATCH) {
		uint32_t n = nev - j0 < KVG_EVICT_BATCH ? nev - j0 : KVG_EVICT_BATCH;
		gather_args a;
		size_t per = (size_t)H * cnt * d;
		dim3 g((unsigned)((per + NT - 1) / NT < 4096 ? (per + NT - 1) / NT : 4096), n);

		a.H = H;
		a.d = d;
		a.cnt = cnt;
		a.j0 = j0;
		a.x = x;
		for (uint32_t j = 0; j < n; j++)
			a.ev[j] = ev[j0 + j];
		KVG_LAUNCH(gather_kernel, g, NT, 0, st, a);
		cudaError_t rc = launched();

		if (rc != cudaSuccess)
			return rc;
	}
	return cudaSuccess;
}

/* ---- code packing ---------------------------------------------------------- */

/* Block (x, y) packs rows [32x, 32x+32) x tables [32y, 32y+32) through a
 * shared-memory tile, so both sides are coalesced: a warp reads 32 tables'
 * K-float groups of one row (contiguous in y), then writes 32 codes that are
 * adjacent in the output layout (consecutive rows when sr == 1, consecutive
 * tables otherwise). */
#define PT 32                           /* rows and tables per pack tile */

static __global__ void __launch_bounds__(NT)
pack_kernel(const float *y, uint32_t r0, uint32_t R, uint32_t K, uint32_t L,
	    struct kvg_code_layout lay, uint16_t *codes)
{
	KVG_DYN_SMEM(uint16_t, tile);           /* [PT][PT + 1] */
	const uint32_t rb = blockIdx.x * PT, tb = blockIdx.y * PT;

	for (uint32_t p = threadIdx.x; p < PT * PT; p += NT) {
		uint32_t rl = p / PT, tl = p % PT, t = tb + tl;

		if (rb + rl < R && t < L) {
			const float *yr = y + (size_t)(rb + rl) * K * L + (size_t)t * K;
			unsigned code = 0;

			for (uint32_t j = 0; j < K; j++)
				code |= (unsigned)(yr[j] > 0.0f) << j;
			tile[rl * (PT + 1) + tl] = (uint16_t)code;
		}
	}
	__syncthreads();
	for (uint32_t p = threadIdx.x; p < PT * PT; p += NT) {
		uint32_t rl = lay.sr == 1 ? p % PT : p / PT, tl = lay.sr == 1 ? p / PT : p % PT;
		uint32_t t = tb + tl, r = r0 + rb + rl;

		if (rb + rl < R && t < L)
			codes[(size_t)(r / lay.per) * lay.sg + (size_t)t * lay.st +
			      (size_t)(r % lay.per) * lay.sr] = tile[rl * (PT + 1) + tl];
	}
}

extern "C" cudaError_t kvg_pack(const float *y, uint32_t r0, uint32_t R, uint32_t K, uint32_t L,
				const struct kvg_code_layout *lay, uint16_t *codes, cudaStream_t st)
{
	if ((size_t)R * L == 0)
		return cudaSuccess;
	KVG_LAUNCH(pack_kernel, dim3((R + PT - 1) / PT, (L + PT - 1) / PT), NT,
		   PT * (PT + 1) * sizeof(uint16_t), st, y, r0, R, K, L, *lay, codes);
	return launched();
}

/* ---- attention ------------------------------------------------------------- */

/*
 * Block (split s, kv head h, sequence j) takes logical rows
 * [s*chunk, min((s+1)*chunk, n)) of the sequence's kv head h for all G q
 * heads of the group.  Tiles of KVG_TILE rows of K and V are staged in shared
 * memory (rows padded by one 32-bit word so lane i reading row i hits bank
 * i + const: conflict-free); the next tile's loads are in registers while
 * the current one is computed.  Warp w owns q heads w, w+4, w+8, w+12 with an
 * online softmax each: lane i scores row i of the tile, then every lane
 * accumulates its own pairs of output columns (2*lane + 64*jj).
 */
#define AW (NT / 32)                    /* warps per block */
#define HPW (16 / AW)                   /* q heads per warp at most (G <= 16) */

struct attn_args {
	const float *q;
	float *o, *lse, *part;
	uint32_t Hq, H, d, G, chunk, nsplit, j0, nseq_total;
	float scale;
	struct kvg_rows rows[KVG_ATTN_BATCH];
};

static __device__ __forceinline__ float warp_max(float x)
{
	for (int m = 16; m; m >>= 1)
		x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
	return x;
}

static __device__ __forceinline__ float warp_sum(float x)
{
	for (int m = 16; m; m >>= 1)
		x += __shfl_xor_sync(0xffffffffu, x, m);
	return x;
}

template <int NJ>
static __global__ void __launch_bounds__(NT) attn_kernel(const __grid_constant__ attn_args a)
{
	KVG_DYN_SMEM(unsigned char, smem);
	const uint32_t d = a.d, G = a.G, s = blockIdx.x, h = blockIdx.y, j = blockIdx.z;
	const struct kvg_rows *rw = &a.rows[j];
	const uint32_t n = rw->nsink + rw->count, R = rw->cap - rw->nsink;
	const uint32_t r0 = s * a.chunk, r1 = min(n, r0 + a.chunk);
	const uint32_t W2 = d / 2 + 1;          /* padded row, in 32-bit words */
	const uint32_t C8 = d / 8;              /* 16-byte pieces per row */
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	float *qs = (float *)smem;
	uint32_t *ks = (uint32_t *)(smem + (size_t)G * d * sizeof(float));
	uint32_t *vs = ks + KVG_TILE * W2;
	const uint32_t seq = a.j0 + j;

	for (uint32_t i = threadIdx.x; i < G * d; i += NT)
		qs[i] = a.q[((size_t)seq * a.Hq + (size_t)h * G) * d + i] * a.scale;

	float m[HPW], l[HPW], acc[HPW][NJ][2];

#pragma unroll
	for (int u = 0; u < HPW; u++) {
		m[u] = -INFINITY;
		l[u] = 0.0f;
#pragma unroll
		for (int jj = 0; jj < NJ; jj++)
			acc[u][jj][0] = acc[u][jj][1] = 0.0f;
	}

	/* Register-staged loads: piece c = threadIdx.x + NT*u of the tile. */
	uint4 kr[2 * NJ], vr[2 * NJ];
	const size_t hb = (size_t)h * rw->cap;

	auto load = [&](uint32_t t0) {
#pragma unroll
		for (int u = 0; u < 2 * NJ; u++) {
			uint32_t c = threadIdx.x + NT * u, row = c / C8, col = c % C8;
			uint32_t lr = t0 + row;

			kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
			if (c < KVG_TILE * C8 && lr < r1) {
				uint32_t sr;

				if (lr < rw->nsink) {
					sr = lr;
				} else {
					uint32_t x = rw->head + (lr - rw->nsink);

					sr = rw->nsink + (x >= R ? x - R : x);
				}
				size_t off = (hb + sr) * d + (size_t)col * 8;

				kr[u] = *(const uint4 *)(rw->k + off);
				vr[u] = *(const uint4 *)(rw->v + off);
			}
		}
	};
	auto store = [&]() {
#pragma unroll
		for (int u = 0; u < 2 * NJ; u++) {
			uint32_t c = threadIdx.x + NT * u, row = c / C8, col = c % C8;

			if (c < KVG_TILE * C8) {
				uint32_t *kd = ks + row * W2 + col * 4, *vd = vs + row * W2 + col * 4;

				kd[0] = kr[u].x; kd[1] = kr[u].y; kd[2] = kr[u].z; kd[3] = kr[u].w;
				vd[0] = vr[u].x; vd[1] = vr[u].y; vd[2] = vr[u].z; vd[3] = vr[u].w;
			}
		}
	};

	if (r0 < r1)
		load(r0);
	for (uint32_t t0 = r0; t0 < r1; t0 += KVG_TILE) {
		__syncthreads();                /* the previous tile is consumed (and qs written) */
		store();
		__syncthreads();
		if (t0 + KVG_TILE < r1)
			load(t0 + KVG_TILE);    /* in flight while this tile is computed */

		const bool valid = t0 + lane < r1;

#pragma unroll
		for (int u = 0; u < HPW; u++) {
			uint32_t g = warp + AW * u;

			if (g >= G)
				break;
			const float *qg = qs + (size_t)g * d;
			const uint32_t *krow = ks + lane * W2;
			float sc = 0.0f;

			for (uint32_t e2 = 0; e2 < d / 2; e2++) {
				uint32_t w = krow[e2];
				float2 qq = *(const float2 *)(qg + 2 * e2);

				sc = fmaf(qq.x, __uint_as_float(w << 16), sc);
				sc = fmaf(qq.y, __uint_as_float(w & 0xffff0000u), sc);
			}
			sc = valid ? sc : -INFINITY;

			float mt = warp_max(sc), mn = fmaxf(m[u], mt);

			if (mn == -INFINITY)
				continue;       /* nothing but -inf so far */
			float alpha = m[u] == -INFINITY ? 0.0f : expf(m[u] - mn);
			float p = sc == -INFINITY ? 0.0f : expf(sc - mn);

			l[u] = l[u] * alpha + warp_sum(p);
			m[u] = mn;
#pragma unroll
			for (int jj = 0; jj < NJ; jj++) {
				acc[u][jj][0] *= alpha;
				acc[u][jj][1] *= alpha;
			}
			uint32_t nv = min((uint32_t)KVG_TILE, r1 - t0);

			for (uint32_t i = 0; i < nv; i++) {
				float pi = __shfl_sync(0xffffffffu, p, (int)i);
				const uint32_t *vrow = vs + i * W2;

#pragma unroll
				for (int jj = 0; jj < NJ; jj++) {
					uint32_t w2 = lane + 32 * jj;

					if (2 * w2 < d) {
						uint32_t w = vrow[w2];

						acc[u][jj][0] = fmaf(pi, __uint_as_float(w << 16), acc[u][jj][0]);
						acc[u][jj][1] = fmaf(pi, __uint_as_float(w & 0xffff0000u),
								     acc[u][jj][1]);
					}
				}
			}
		}
	}

	/* Results: final when unsplit, else this split's partial. */
#pragma unroll
	for (int u = 0; u < HPW; u++) {
		uint32_t g = warp + AW * u;

		if (g >= G)
			break;
		uint32_t qh = h * G + g;
		float r = l[u] > 0.0f ? 1.0f / l[u] : 0.0f;
		float ls = l[u] > 0.0f ? m[u] + logf(l[u]) : -INFINITY;
		float *od;
		float *ld_;

		if (a.nsplit == 1) {
			od = a.o + ((size_t)seq * a.Hq + qh) * d;
			ld_ = a.lse + (size_t)seq * a.Hq + qh;
		} else {
			size_t pi = ((size_t)seq * a.Hq + qh) * a.nsplit + s;

			od = a.part + pi * d;
			ld_ = a.part + (size_t)a.nseq_total * a.Hq * a.nsplit * d + pi;
		}
#pragma unroll
		for (int jj = 0; jj < NJ; jj++) {
			uint32_t e = 2 * (lane + 32 * jj);

			if (e < d) {
				od[e] = acc[u][jj][0] * r;
				od[e + 1] = acc[u][jj][1] * r;
			}
		}
		if (lane == 0)
			*ld_ = ls;
	}
}

/* One block per (sequence, q head): the LSE merge of nsplit partials.  The
 * block finds the max and the weights once (in shared memory: nsplit
 * weights, then two words per warp for the reductions); every thread then
 * combines its columns. */
static __global__ void __launch_bounds__(NT)
combine_kernel(const float *part, uint32_t nseq, uint32_t Hq, uint32_t d, uint32_t nsplit,
	       float *o, float *lse)
{
	KVG_DYN_SMEM(float, w);
	float *red = w + nsplit;
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	size_t pi = blockIdx.x;                 /* seq * Hq + qh */
	const float *po = part + pi * nsplit * d;
	const float *pl = part + (size_t)nseq * Hq * nsplit * d + pi * nsplit;
	float mx = -INFINITY, sum = 0.0f;

	for (uint32_t s = threadIdx.x; s < nsplit; s += NT)
		mx = fmaxf(mx, pl[s]);
	mx = warp_max(mx);
	if (lane == 0)
		red[warp] = mx;
	__syncthreads();
	mx = red[0];
	for (uint32_t i = 1; i < AW; i++)
		mx = fmaxf(mx, red[i]);
	for (uint32_t s = threadIdx.x; s < nsplit; s += NT) {
		float e = mx == -INFINITY || pl[s] == -INFINITY ? 0.0f : expf(pl[s] - mx);

		w[s] = e;
		sum += e;
	}
	sum = warp_sum(sum);
	if (lane == 0)
		red[AW + warp] = sum;
	__syncthreads();                        /* w[] and the partial sums are written */
	sum = 0.0f;
	for (uint32_t i = 0; i < AW; i++)
		sum += red[AW + i];
	for (uint32_t e = threadIdx.x; e < d; e += blockDim.x) {
		float acc = 0.0f;

		for (uint32_t s = 0; s < nsplit; s++)
			if (w[s] != 0.0f)
				acc = fmaf(w[s], po[(size_t)s * d + e], acc);
		o[pi * d + e] = sum > 0.0f ? acc / sum : 0.0f;
	}
	if (threadIdx.x == 0)
		lse[pi] = sum > 0.0f ? mx + logf(sum) : -INFINITY;
}

static size_t attn_smem(uint32_t G, uint32_t d)
{
	return (size_t)G * d * sizeof(float) + 2 * (size_t)KVG_TILE * (d / 2 + 1) * 4;
}

template <int NJ>
static cudaError_t attn_launch(const attn_args &a, dim3 g, size_t smem, cudaStream_t st)
{
	if (smem > 48 * 1024) {
		cudaError_t rc = cudaFuncSetAttribute(attn_kernel<NJ>,
						      cudaFuncAttributeMaxDynamicSharedMemorySize,
						      (int)smem);

		if (rc != cudaSuccess)
			return rc;
	}
	KVG_LAUNCH(attn_kernel<NJ>, g, NT, smem, st, a);
	return launched();
}

extern "C" cudaError_t kvg_attn(const float *q, const struct kvg_rows *rows, uint32_t nseq,
				uint32_t Hq, uint32_t H, uint32_t d,
				const struct kvg_attn_plan *plan, float *o, float *lse, float *part,
				cudaStream_t st)
{
	uint32_t G = H ? Hq / H : 0;
	size_t smem = attn_smem(G, d);

	if (nseq == 0)
		return cudaSuccess;
	if (H == 0 || G == 0 || G > 16 || G * H != Hq || d == 0 || d % 16 || d > 256 ||
	    plan->nsplit == 0 || plan->chunk % KVG_TILE || (plan->nsplit > 1 && !part))
		return cudaErrorInvalidValue;
	for (uint32_t j0 = 0; j0 < nseq; j0 += KVG_ATTN_BATCH) {
		uint32_t cnt = nseq - j0 < KVG_ATTN_BATCH ? nseq - j0 : KVG_ATTN_BATCH;
		attn_args a;
		dim3 g(plan->nsplit, H, cnt);
		cudaError_t rc;

		a.q = q;
		a.o = o;
		a.lse = lse;
		a.part = part;
		a.Hq = Hq;
		a.H = H;
		a.d = d;
		a.G = G;
		a.chunk = plan->chunk;
		a.nsplit = plan->nsplit;
		a.j0 = j0;
		a.nseq_total = nseq;
		a.scale = 1.0f / sqrtf((float)d);
		for (uint32_t j = 0; j < cnt; j++)
			a.rows[j] = rows[j0 + j];
		if (d <= 64)
			rc = attn_launch<1>(a, g, smem, st);
		else if (d <= 128)
			rc = attn_launch<2>(a, g, smem, st);
		else if (d <= 192)
			rc = attn_launch<3>(a, g, smem, st);
		else
			rc = attn_launch<4>(a, g, smem, st);
		if (rc != cudaSuccess)
			return rc;
	}
	if (plan->nsplit > 1) {
		KVG_LAUNCH(combine_kernel, nseq * Hq, NT, (plan->nsplit + 2 * AW) * sizeof(float), st,
			   part, nseq, Hq, d, plan->nsplit, o, lse);
		return launched();
	}
	return cudaSuccess;
}

/* ---- merge ------------------------------------------------------------------ */

static __global__ void __launch_bounds__(NT)
merge_kernel(float *o, float *lse, const float *rec, size_t rec_floats, size_t lse_floats,
	     uint32_t Hq, uint32_t d, int kvd_only)
{
	size_t pi = blockIdx.x;                 /* seq * Hq + qh */
	uint32_t seq = (uint32_t)(pi / Hq), qh = (uint32_t)(pi % Hq);
	const float *o2 = rec + (size_t)seq * rec_floats + (size_t)qh * d;
	float b = rec[(size_t)seq * rec_floats + lse_floats + qh];
	float a = kvd_only ? -INFINITY : lse[pi];
	float *og = o + pi * d;

	/* kvd_attn_merge's formula, close but not bit for bit: nvcc contracts
	 * a*x + b*y into FMAs and the device's expf/logf are within 2 ulp of
	 * glibc's, so results differ from the CPU merge by a few ulp (the
	 * tests allow 1e-5 relative). */
	if (b == -INFINITY && !kvd_only)
		return;                         /* uniform over the block: no barrier below */
	if (a == -INFINITY) {
		for (uint32_t e = threadIdx.x; e < d; e += blockDim.x)
			og[e] = o2[e];
	} else {
		float mx = fmaxf(a, b), wa = expf(a - mx), wb = expf(b - mx), r = 1.0f / (wa + wb);

		for (uint32_t e = threadIdx.x; e < d; e += blockDim.x)
			og[e] = (wa * og[e] + wb * o2[e]) * r;
		b = mx + logf(wa + wb);
	}
	__syncthreads();                        /* every thread has read lse[pi] */
	if (threadIdx.x == 0)
		lse[pi] = b;
}

extern "C" cudaError_t kvg_merge(float *o, float *lse, const float *rec, size_t rec_floats,
				 size_t lse_floats, uint32_t nseq, uint32_t Hq, uint32_t d,
				 int kvd_only, cudaStream_t st)
{
	if (nseq == 0 || Hq == 0)
		return cudaSuccess;
	KVG_LAUNCH(merge_kernel, nseq * Hq, NT, 0, st, o, lse, rec, rec_floats, lse_floats, Hq, d, kvd_only);
	return launched();
}
