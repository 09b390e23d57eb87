/* kvbench gpu: the GPU side of kvd, JSON lines.
 *
 *   kvbench gpu [--json] [--ctx N] [--batch N] [--dense-batch N] [--steps N]
 *               [--layers N] [--K N] [--L N] [--c 1|2] [--device N] [--no-decode]
 *
 * Per-kernel timings of libkvclient's CUDA backend (key hashing at prefill,
 * query hashing, window attention, dense attention over the context, the
 * LSE merge; median of events over repetitions), then build/kvd-decode's
 * driver in both modes, same run: gpu-dense (all KV on the GPU) and kvd
 * (sink + window on the GPU, the rest in a kvd this starts), and their
 * tokens/s ratio.  Without a CUDA device (or built with CUDA=0) it says so
 * and exits 77; with --json it prints {"bench":"gpu","skipped":...} first.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#ifndef KVC_CUDA

int bench_gpu_main(int argc, char **argv)
{
	int json = 0;

	for (int i = 0; i < argc; i++)
		json |= !strcmp(argv[i], "--json");
	fprintf(stderr, "kvbench gpu: no CUDA device: built without CUDA (CUDA=0)\n");
	if (json)
		printf("{\"bench\":\"gpu\",\"skipped\":\"no CUDA device\",\"why\":\"built without CUDA\"}\n");
	return 77;
}

#else

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "engine/bf16.h"
#include "gpu-client/decode/args.h"
#include "gpu-client/decode/run.h"
#include "proto/kvd_ring.h"
#include "gpu-client/kvg_kern.h"
#include "gpu-client/kvg_plan.h"
#include "engine/lsh.h"
#include "engine/rng.h"

#define CK(x)                                                                           \
	do {                                                                            \
		cudaError_t e_ = (x);                                                   \
		if (e_ != cudaSuccess) {                                                \
			fprintf(stderr, "kvbench gpu: %s: %s\n", #x, cudaGetErrorString(e_)); \
			goto out;                                                       \
		}                                                                       \
	} while (0)

struct gopts {
	int json, decode;
	uint32_t ctx, batch, dense_batch, steps, layers, K, L, c, device;
};

static void gusage(void)
{
	fprintf(stderr, "usage: kvbench gpu [--json] [--ctx N] [--batch N] [--dense-batch N] [--steps N]\n"
			"                   [--layers N] [--K N] [--L N] [--c 1|2] [--device N] [--no-decode]\n");
	exit(2);
}

static uint32_t u32(const char *s)
{
	char *end;
	unsigned long v = s ? strtoul(s, &end, 10) : 0;

	if (!s || end == s || (*end && *end != 'k') || v == 0 || v > (1ul << 22))
		gusage();
	return (uint32_t)(*end == 'k' ? v * 1024 : v);
}

struct timer {
	cudaEvent_t a, b;
	cudaStream_t st;
};

static double t_median(double *x, int n)
{
	return bench_median(x, n);
}

/* Median milliseconds of `reps` runs of the block after TIME(...). */
#define REPS 20
#define TIME(tm, out, body)                                                             \
	do {                                                                            \
		double ms_[REPS];                                                       \
		for (int r_ = 0; r_ < REPS + 2; r_++) {                                 \
			float m_;                                                       \
			CK(cudaEventRecord((tm)->a, (tm)->st));                         \
			body;                                                           \
			CK(cudaEventRecord((tm)->b, (tm)->st));                         \
			CK(cudaEventSynchronize((tm)->b));                              \
			CK(cudaEventElapsedTime(&m_, (tm)->a, (tm)->b));                \
			if (r_ >= 2)                                                    \
				ms_[r_ - 2] = m_;                                       \
		}                                                                       \
		(out) = t_median(ms_, REPS);                                            \
	} while (0)

static void *dev_random_bf16(size_t n, uint64_t seed)
{
	uint16_t *h = malloc(n * 2);
	void *d = NULL;
	struct kvd_rng r = kvd_rng_make(seed);

	if (!h)
		return NULL;
	for (size_t i = 0; i < n; i++)
		h[i] = kvd_f32_to_bf16((float)(kvd_rng_uniform(&r) * 2 - 1));
	if (cudaMalloc(&d, n * 2) != cudaSuccess || cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice)) {
		cudaFree(d);
		d = NULL;
	}
	free(h);
	return d;
}

static void *dev_random_f32(size_t n, uint64_t seed)
{
	float *h = malloc(n * 4);
	void *d = NULL;
	struct kvd_rng r = kvd_rng_make(seed);

	if (!h)
		return NULL;
	for (size_t i = 0; i < n; i++)
		h[i] = (float)(kvd_rng_uniform(&r) * 2 - 1);
	if (cudaMalloc(&d, n * 4) != cudaSuccess || cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice)) {
		cudaFree(d);
		d = NULL;
	}
	free(h);
	return d;
}

static int kernels(const struct gopts *o, const char *dev)
{
	const uint32_t H = 8, Hq = 32, d = 128, K = o->K, L = o->L, KL = K * L, B = o->batch;
	const uint32_t chunk = 640, win = 4 + 64 + KVG_APPEND_BATCH;
	struct timer tm = { 0 };
	cublasHandle_t blas = NULL;
	float *W = NULL, *dW = NULL, *x = NULL, *y = NULL, *q = NULL, *o_ = NULL, *lse = NULL;
	float *part = NULL, *rec = NULL;
	uint16_t *codes = NULL, *wk = NULL, *wv = NULL, *ck = NULL, *cv = NULL;
	struct kvg_rows *rows = calloc(B, sizeof *rows);
	const struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, L);
	struct kvg_code_layout klay = { chunk, L * chunk, chunk, 1 }, qlay = { 1, L, 1, 0 };
	uint32_t rows_max;
	char err[128];
	double ms;
	int rc = 1;

	W = malloc((size_t)d * KL * 4);
	if (!W || !rows)
		goto out;
	kvd_lsh_make_w(1, (int)d, (int)K, (int)L, W);
	CK(cudaStreamCreateWithFlags(&tm.st, cudaStreamNonBlocking));
	CK(cudaEventCreate(&tm.a));
	CK(cudaEventCreate(&tm.b));
	if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS)
		goto out;
	CK(cudaMalloc((void **)&dW, (size_t)d * KL * 4));
	CK(cudaMemcpy(dW, W, (size_t)d * KL * 4, cudaMemcpyHostToDevice));
	rows_max = (64u << 20) / (KL * 4);
	x = dev_random_f32((size_t)H * chunk * d, 2);
	/* room for the dense rows' largest group (8 q heads per kv head) */
	q = dev_random_f32((size_t)(B > o->dense_batch ? B : o->dense_batch) * 8 * H * d, 3);
	CK(cudaMalloc((void **)&y, (size_t)rows_max * KL * 4));
	CK(cudaMalloc((void **)&codes, (size_t)H * chunk * L * 2 + (size_t)B * Hq * L * 2));
	if (!x || !q)
		goto out;

	/* prefill: one slot's chunk of keys, all 8 kv heads */
	TIME(&tm, ms, if (kvg_hash_rows(blas, dW, d, K, L, x, H * chunk, y, rows_max, &klay, codes,
					tm.st, err, sizeof err)) goto out);
	printf("{\"bench\":\"gpu\",\"device\":\"%s\",\"kernel\":\"hash_keys\",\"tokens\":%u,"
	       "\"kv_heads\":%u,\"K\":%u,\"L\":%u,\"ms\":%.4f,\"mtok_s\":%.2f}\n",
	       dev, chunk, H, K, L, ms, chunk / ms / 1e3);
	/* decode: the batch's queries, 32 q heads each */
	TIME(&tm, ms, if (kvg_hash_rows(blas, dW, d, K, L, q, B * Hq, y, rows_max, &qlay, codes,
					tm.st, err, sizeof err)) goto out);
	printf("{\"bench\":\"gpu\",\"device\":\"%s\",\"kernel\":\"hash_query\",\"batch\":%u,"
	       "\"q_heads\":%u,\"K\":%u,\"L\":%u,\"ms\":%.4f}\n", dev, B, Hq, K, L, ms);

	/* window attention: sink 4 + window 64 + 32 pending, a wrapped ring */
	wk = dev_random_bf16((size_t)B * H * win * d, 4);
	wv = dev_random_bf16((size_t)B * H * win * d, 5);
	CK(cudaMalloc((void **)&o_, (size_t)B * Hq * d * 4));
	CK(cudaMalloc((void **)&lse, (size_t)B * Hq * 4));
	if (!wk || !wv)
		goto out;
	{
		struct kvg_attn_plan pl;
		int sms;

		CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, (int)o->device));
		for (uint32_t b = 0; b < B; b++)
			rows[b] = (struct kvg_rows){ wk + (size_t)b * H * win * d,
						     wv + (size_t)b * H * win * d, win, 4, 17, 96 };
		kvg_attn_plan(100, B, H, Hq, d, 4u * (uint32_t)sms, &pl);
		TIME(&tm, ms, CK(kvg_attn(q, rows, B, Hq, H, d, &pl, o_, lse, NULL, tm.st)));
		printf("{\"bench\":\"gpu\",\"device\":\"%s\",\"kernel\":\"window_attn\",\"batch\":%u,"
		       "\"rows\":100,\"ms\":%.4f,\"gbps\":%.1f}\n", dev, B, ms,
		       (double)B * H * 100 * d * 4 / ms / 1e6);

		/* dense attention over the whole context: the gpu-dense baseline's kernel */
		uint32_t n = o->ctx, db = o->dense_batch;

		ck = dev_random_bf16((size_t)db * H * n * d, 6);
		cv = dev_random_bf16((size_t)db * H * n * d, 7);
		if (!ck || !cv) {
			fprintf(stderr, "kvbench gpu: no room for a dense cache of %u x %u tokens\n", db, n);
			goto out;
		}
		for (uint32_t b = 0; b < db; b++)
			rows[b] = (struct kvg_rows){ ck + (size_t)b * H * n * d, cv + (size_t)b * H * n * d,
						     n, 0, 0, n };
		/* The same rows under GQA groups of 1 to 8 q heads per kv head:
		 * bytes stay, work per byte grows with the group. */
		CK(cudaFree(o_));
		CK(cudaFree(lse));
		o_ = lse = NULL;
		CK(cudaMalloc((void **)&o_, (size_t)(B > db ? B : db) * 8 * H * d * 4));
		CK(cudaMalloc((void **)&lse, (size_t)(B > db ? B : db) * 8 * H * 4));
		for (uint32_t G = 1; G <= 8; G *= 2) {
			kvg_attn_plan(n, db, H, G * H, d, 4u * (uint32_t)sms, &pl);
			cudaFree(part);
			part = NULL;
			if (pl.part_floats)
				CK(cudaMalloc((void **)&part, pl.part_floats * 4));
			TIME(&tm, ms, CK(kvg_attn(q, rows, db, G * H, H, d, &pl, o_, lse, part, tm.st)));
			printf("{\"bench\":\"gpu\",\"device\":\"%s\",\"kernel\":\"dense_attn\",\"batch\":%u,"
			       "\"rows\":%u,\"group\":%u,\"nsplit\":%u,\"ms\":%.4f,\"gbps\":%.1f}\n", dev, db,
			       n, G, pl.nsplit, ms, (double)db * H * n * d * 4 / ms / 1e6);
		}
	}

	/* merge with kvd's records (as they come back from the arena) */
	rec = dev_random_f32((size_t)B * lay.out / 4, 8);
	if (!rec)
		goto out;
	TIME(&tm, ms, CK(kvg_merge(o_, lse, rec, lay.out / 4, lay.lse_off / 4, B, Hq, d, 0, tm.st)));
	printf("{\"bench\":\"gpu\",\"device\":\"%s\",\"kernel\":\"merge\",\"batch\":%u,\"q_heads\":%u,"
	       "\"ms\":%.4f}\n", dev, B, Hq, ms);
	rc = 0;
out:
	if (tm.st)
		cudaStreamSynchronize(tm.st);
	if (blas)
		cublasDestroy(blas);
	cudaFree(dW); cudaFree(x); cudaFree(y); cudaFree(q); cudaFree(o_); cudaFree(lse);
	cudaFree(part); cudaFree(rec); cudaFree(codes); cudaFree(wk); cudaFree(wv); cudaFree(ck);
	cudaFree(cv);
	if (tm.a)
		cudaEventDestroy(tm.a);
	if (tm.b)
		cudaEventDestroy(tm.b);
	if (tm.st)
		cudaStreamDestroy(tm.st);
	free(W);
	free(rows);
	return rc;
}

int bench_gpu_main(int argc, char **argv)
{
	struct gopts o = { .decode = 1, .ctx = 8192, .batch = 4, .dense_batch = 4, .steps = 16,
			   .layers = 32, .K = 10, .L = 150, .c = 2 };
	struct cudaDeviceProp prop;
	char dev[128];
	int n = 0;
	cudaError_t e;

	for (int i = 0; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;

		if (!strcmp(a, "--json")) o.json = 1;
		else if (!strcmp(a, "--no-decode")) o.decode = 0;
		else if (!strcmp(a, "--ctx")) { o.ctx = u32(v); i++; }
		else if (!strcmp(a, "--batch")) { o.batch = u32(v); i++; }
		else if (!strcmp(a, "--dense-batch")) { o.dense_batch = u32(v); i++; }
		else if (!strcmp(a, "--steps")) { o.steps = u32(v); i++; }
		else if (!strcmp(a, "--layers")) { o.layers = u32(v); i++; }
		else if (!strcmp(a, "--K")) { o.K = u32(v); i++; }
		else if (!strcmp(a, "--L")) { o.L = u32(v); i++; }
		else if (!strcmp(a, "--c")) { o.c = u32(v); i++; }
		else if (!strcmp(a, "--device")) { o.device = v ? (uint32_t)atoi(v) : 0; i++; }
		else gusage();
	}
	if (o.K > 16 || o.L > 1024 || o.c > 2 || o.layers > 32 || o.layers < 2)
		gusage();
	e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess || n == 0 || (int)o.device >= n) {
		fprintf(stderr, "kvbench gpu: no CUDA device: %s\n",
			e != cudaSuccess ? cudaGetErrorString(e) : "none with that number");
		if (o.json)
			printf("{\"bench\":\"gpu\",\"skipped\":\"no CUDA device\"}\n");
		return 77;
	}
	if (cudaSetDevice((int)o.device) != cudaSuccess ||
	    cudaGetDeviceProperties(&prop, (int)o.device) != cudaSuccess)
		return 1;
	snprintf(dev, sizeof dev, "%.127s", prop.name);
	if (kernels(&o, dev))
		return 1;
	if (!o.decode)
		return 0;

	/* build/kvd-decode's figures, both modes, this run */
	struct dec_args a;
	struct dec_result rd, rk;

	dec_args_default(&a);
	a.ctx = o.ctx;
	a.steps = o.steps;
	a.layers = o.layers;
	a.K = o.K;
	a.L = o.L;
	a.c = o.c;
	a.device = (int)o.device;
	a.attn = DEC_GPU_DENSE;
	a.batch = o.dense_batch;
	if (dec_run(&a, &rd)) {
		fprintf(stderr, "kvbench gpu: decode gpu-dense: %s\n", rd.err);
		return 1;
	}
	dec_print(stdout, &a, &rd, 1);
	a.attn = DEC_KVD;
	a.batch = o.batch;
	if (dec_run(&a, &rk)) {
		fprintf(stderr, "kvbench gpu: decode kvd: %s\n", rk.err);
		return 1;
	}
	dec_print(stdout, &a, &rk, 1);
	printf("{\"bench\":\"gpu\",\"device\":\"%s\",\"summary\":\"decode\",\"ctx\":%u,"
	       "\"gpu_dense_batch\":%u,\"gpu_dense_tok_s\":%.2f,\"kvd_batch\":%u,\"kvd_tok_s\":%.2f,"
	       "\"speedup\":%.3f,\"kvd_gpu_overhead_frac\":%.4f}\n",
	       dev, o.ctx, o.dense_batch, rd.tok_s, o.batch, rk.tok_s, rk.tok_s / rd.tok_s,
	       rk.step_ms > 0 ? (rk.copies_ms + rk.merge_ms) / rk.step_ms : 0.0);
	return 0;
}

#endif
