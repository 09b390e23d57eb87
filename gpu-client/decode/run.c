/* kvd-decode's core: a Llama-3.1-8B-shaped model with random bf16 weights
 * decoding a batch, attention either all on the GPU (gpu-dense) or through
 * libkvclient's CUDA backend and kvd (kvd).  See run.h and docs/GPU.md.
 *
 * One CUDA stream carries the whole step; the host synchronises with it once
 * per step (to time the step and because the next token is chosen there).
 * In kvd mode libkvclient orders its own streams against it with events.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "engine/attn.h"
#include "gpu-client/kvc.h"
#include "gpu-client/kvg_kern.h"
#include "gpu-client/kvg_plan.h"
#include "model.h"
#include "run.h"

/* Llama-3.1-8B */
#define HIDDEN  4096u
#define INTER   14336u
#define VOCAB   128256u
#define QH      32u
#define KVH     8u
#define HD      128u
#define THETA   500000.0f
#define EPS     1e-5f
#define QKV_OUT ((QH + 2 * KVH) * HD)

#define CK(x)                                                                          \
	do {                                                                           \
		cudaError_t e_ = (x);                                                  \
		if (e_ != cudaSuccess) {                                               \
			snprintf(r->err, sizeof r->err, "%s: %s", #x, cudaGetErrorString(e_)); \
			goto out;                                                      \
		}                                                                      \
	} while (0)
#define CB(x)                                                                          \
	do {                                                                           \
		cublasStatus_t b_ = (x);                                               \
		if (b_ != CUBLAS_STATUS_SUCCESS) {                                     \
			snprintf(r->err, sizeof r->err, "%s: %s", #x, cublasGetStatusString(b_)); \
			goto out;                                                      \
		}                                                                      \
	} while (0)
#define KV(x)                                                                          \
	do {                                                                           \
		if ((x) < 0) {                                                         \
			snprintf(r->err, sizeof r->err, "%s: %s", #x, kvc_last_error(kc)); \
			goto out;                                                      \
		}                                                                      \
	} while (0)

struct layer_w {
	uint16_t *qkv, *o, *gu, *down, *n1, *n2;
};

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* Y [B][out] (float) = X [B][in] (bf16) . W^T, W [out][in] (bf16, row-major
 * as checkpoints store it); beta 1 adds to what Y holds (the residual). */
static cublasStatus_t gemm(cublasHandle_t h, const uint16_t *W, const uint16_t *X, float *Y,
			   uint32_t B, uint32_t in, uint32_t out, float beta)
{
	const float one = 1.0f;

	return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)B, (int)in, &one, W,
			    CUDA_R_16BF, (int)in, X, CUDA_R_16BF, (int)in, &beta, Y, CUDA_R_32F,
			    (int)out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* ---- a kvd of our own ------------------------------------------------------ */

struct srv {
	pid_t pid;
	char dir[64], sock[108];
};

static int srv_start(struct srv *s, uint32_t threads)
{
	char exe[PATH_MAX], bin[PATH_MAX + 8], th[16];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);

	if (n <= 0)
		return -1;
	exe[n] = 0;
	*strrchr(exe, '/') = 0;
	snprintf(bin, sizeof bin, "%s/kvd", exe);
	snprintf(th, sizeof th, "%u", threads);
	snprintf(s->dir, sizeof s->dir, "/tmp/kvd-decode.XXXXXX");
	if (!mkdtemp(s->dir))
		return -1;
	snprintf(s->sock, sizeof s->sock, "%s/kvd.sock", s->dir);
	s->pid = fork();
	if (s->pid < 0)
		return -1;
	if (s->pid == 0) {
		execl(bin, "kvd", "--foreground", "--socket", s->sock, "--log-level", "warning",
		      threads ? "--threads" : (char *)NULL, th, (char *)NULL);
		_exit(127);
	}
	for (int i = 0; i < 1000; i++) {
		struct sockaddr_un a = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0), ok;

		memcpy(a.sun_path, s->sock, strlen(s->sock) + 1);
		ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
		if (fd >= 0)
			close(fd);
		if (ok)
			return 0;
		if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
			s->pid = 0;
			return -1;
		}
		usleep(20000);
	}
	return -1;
}

static void srv_stop(struct srv *s)
{
	if (s->pid > 0) {
		kill(s->pid, SIGTERM);
		waitpid(s->pid, NULL, 0);
	}
	if (s->dir[0])
		rmdir(s->dir);
}

/* ---- the run ------------------------------------------------------------------ */

int dec_run(const struct dec_args *a, struct dec_result *r)
{
	const uint32_t B = a->batch, NL = a->layers;
	const uint32_t total = a->warmup + a->steps, cap = a->ctx + total;
	const int kvd_mode = a->attn == DEC_KVD;
	struct cudaDeviceProp prop;
	cudaStream_t st = NULL;
	cublasHandle_t blas = NULL;
	struct layer_w *lw = NULL;
	uint16_t *wbuf = NULL, *emb, *lm, *nf, *hb = NULL, *ab = NULL, *mb = NULL, *kvbuf = NULL;
	uint16_t **kc_k = NULL, **kc_v = NULL;     /* gpu-dense caches [layer][b]: [H][cap][d] */
	float *x = NULL, *y = NULL, *q = NULL, *k = NULL, *v = NULL, *att = NULL, *gu = NULL;
	float *logits = NULL, *part = NULL;
	int32_t *tok = NULL;
	struct kvc *kc = NULL;
	struct kvc_seq **seqs = NULL;
	uint8_t *keys = NULL;           /* --share attach: the prompt's content keys */
	uint32_t nkeys = 0;
	struct srv srv = { 0 };
	struct kvg_rows *rows = NULL;
	struct kvg_put *put = NULL;
	cudaEvent_t *ev = NULL;
	double *step_ms = NULL;
	uint32_t nev = 4 * NL + 2;
	int rc = 1, ndev = 0;
	cudaError_t e;

	memset(r, 0, sizeof *r);
	r->mode = dec_attn_name(a->attn);
	r->ctx = a->ctx;
	r->batch = B;
	r->steps = a->steps;
	r->layers = NL;
	e = cudaGetDeviceCount(&ndev);
	if (e != cudaSuccess || ndev == 0 || a->device >= ndev) {
		snprintf(r->err, sizeof r->err, "%s",
			 e != cudaSuccess ? cudaGetErrorString(e) : "no device with that number");
		return 77;
	}
	CK(cudaSetDevice(a->device));
	CK(cudaGetDeviceProperties(&prop, a->device));
	snprintf(r->device, sizeof r->device, "%.127s", prop.name);
	CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	CB(cublasCreate(&blas));
	CB(cublasSetStream(blas, st));

	/* Weights: one allocation, random bf16, scaled 1/sqrt(fan-in). */
	size_t per_layer = (size_t)QKV_OUT * HIDDEN + (size_t)HIDDEN * HIDDEN +
			   (size_t)2 * INTER * HIDDEN + (size_t)HIDDEN * INTER + 2 * HIDDEN;
	size_t wtotal = per_layer * NL + (size_t)2 * VOCAB * HIDDEN + HIDDEN;

	e = cudaMalloc((void **)&wbuf, wtotal * 2);
	if (e != cudaSuccess) {
		snprintf(r->err, sizeof r->err, "weights: %.1f GB of GPU memory: %s",
			 wtotal * 2 / 1e9, cudaGetErrorString(e));
		goto out;
	}
	lw = calloc(NL, sizeof *lw);
	if (!lw)
		goto oom;
	{
		uint16_t *p = wbuf;
		uint64_t seed = a->seed * 1000003u;
		const float s_in = 1.0f / sqrtf((float)HIDDEN), s_mid = 1.0f / sqrtf((float)INTER);

#define TAKE(dst, n, scale)                                                     \
	do {                                                                    \
		(dst) = p;                                                      \
		CK(mdl_fill_bf16(p, (n), seed++, 0.0f, (scale) * 1.7320508f, st));    \
		p += (n);                                                       \
	} while (0)
		for (uint32_t l = 0; l < NL; l++) {
			TAKE(lw[l].qkv, (size_t)QKV_OUT * HIDDEN, s_in);
			TAKE(lw[l].o, (size_t)HIDDEN * HIDDEN, s_in);
			TAKE(lw[l].gu, (size_t)2 * INTER * HIDDEN, s_in);
			TAKE(lw[l].down, (size_t)HIDDEN * INTER, s_mid);
			lw[l].n1 = p;
			CK(mdl_fill_bf16(p, HIDDEN, seed++, 1.0f, 0.1f, st));   /* norms: 1 +- 0.1 */
			p += HIDDEN;
			lw[l].n2 = p;
			CK(mdl_fill_bf16(p, HIDDEN, seed++, 1.0f, 0.1f, st));   /* norms: 1 +- 0.1 */
			p += HIDDEN;
		}
		TAKE(emb, (size_t)VOCAB * HIDDEN, 1.0f);
		TAKE(lm, (size_t)VOCAB * HIDDEN, s_in);
		nf = p;
		CK(mdl_fill_bf16(p, HIDDEN, seed++, 1.0f, 0.1f, st));
#undef TAKE
	}

	/* Activations. */
	CK(cudaMalloc((void **)&x, (size_t)B * HIDDEN * 4));
	CK(cudaMalloc((void **)&y, (size_t)B * QKV_OUT * 4));
	CK(cudaMalloc((void **)&q, (size_t)B * QH * HD * 4));
	CK(cudaMalloc((void **)&k, (size_t)B * KVH * HD * 4));
	CK(cudaMalloc((void **)&v, (size_t)B * KVH * HD * 4));
	CK(cudaMalloc((void **)&att, (size_t)B * QH * HD * 4));
	CK(cudaMalloc((void **)&gu, (size_t)B * 2 * INTER * 4));
	CK(cudaMalloc((void **)&logits, (size_t)B * VOCAB * 4));
	CK(cudaMalloc((void **)&hb, (size_t)B * HIDDEN * 2));
	CK(cudaMalloc((void **)&ab, (size_t)B * HIDDEN * 2));
	CK(cudaMalloc((void **)&mb, (size_t)B * INTER * 2));
	CK(cudaMalloc((void **)&tok, (size_t)B * 4));
	CK(cudaMemsetAsync(tok, 0, (size_t)B * 4, st));
	rows = calloc(B, sizeof *rows);
	put = calloc(B, sizeof *put);
	ev = calloc(nev, sizeof *ev);
	step_ms = calloc(total, sizeof *step_ms);
	if (!rows || !put || !ev || !step_ms)
		goto oom;
	for (uint32_t i = 0; i < nev; i++)
		CK(cudaEventCreate(&ev[i]));

	/* ---- synthetic prefill ---- */
	double t0 = now_ms();
	const size_t kvn = (size_t)KVH * cap * HD;     /* one cache, one layer, one sequence */

	if (!kvd_mode) {
		kc_k = calloc((size_t)NL * B, sizeof *kc_k);
		kc_v = calloc((size_t)NL * B, sizeof *kc_v);
		if (!kc_k || !kc_v)
			goto oom;
		for (size_t i = 0; i < (size_t)NL * B; i++) {
			e = cudaMalloc((void **)&kc_k[i], kvn * 2);
			if (e == cudaSuccess)
				e = cudaMalloc((void **)&kc_v[i], kvn * 2);
			if (e != cudaSuccess) {
				snprintf(r->err, sizeof r->err,
					 "KV cache: %.1f GB of GPU memory for batch %u at %u tokens: %s",
					 (double)NL * B * kvn * 4 / 1e9, B, cap, cudaGetErrorString(e));
				goto out;
			}
			/* random K/V written straight into the cache: the synthetic prefill */
			CK(mdl_fill_bf16(kc_k[i], kvn, a->seed * 7 + 2 * i, 0.0f, 2.0f, st));
			CK(mdl_fill_bf16(kc_v[i], kvn, a->seed * 7 + 2 * i + 1, 0.0f, 1.0f, st));
		}
		{
			struct kvg_attn_plan pl;

			kvg_attn_plan(cap, B, KVH, QH, HD, 4u * (uint32_t)prop.multiProcessorCount, &pl);
			/* nsplit only grows with rows: the longest step's plan bounds all */
			if (pl.part_floats)
				CK(cudaMalloc((void **)&part, pl.part_floats * 4));
		}
		r->gpu_kv_gb = (double)NL * B * kvn * 4 / 1e9;
	} else {
		static const uint32_t dense2[] = { 0, 16 };
		struct kvc_opts o = {
			.tenant = "kvd-decode", .name = "kvd-decode", .slots = a->slots,
			.slot_size = a->slot_size, .backend = KVC_BACKEND_CUDA, .device = a->device,
			.max_batch = B, .timing = 1,
		};
		struct kvc_model m = {
			.name = "kvd-decode-llama-3.1-8b", .layers = NL, .q_heads = QH,
			.kv_heads = KVH, .head_dim = HD, .K = a->K, .L = a->L, .c = a->c,
			.sink = a->sink, .window = a->window, .estimator = a->estimator,
			.dense_layers = dense2, .n_dense = NL > 16 ? 2 : 1, .kv_dtype = a->kv_dtype,
			.seed = a->seed, .segment_tokens = a->seg_tokens,
		};
		const size_t pn = (size_t)KVH * a->ctx * HD;

		if (a->socket) {
			o.socket_path = a->socket;
		} else {
			if (srv_start(&srv, a->kvd_threads)) {
				snprintf(r->err, sizeof r->err,
					 "could not start kvd (next to this binary; or pass --socket)");
				goto out;
			}
			o.socket_path = srv.sock;
		}
		if (kvc_connect(&o, &kc)) {
			snprintf(r->err, sizeof r->err, "kvc_connect: %s", kvc_last_error(kc));
			goto out;
		}
		KV(kvc_profile(kc, &m));
		seqs = calloc(B, sizeof *seqs);
		if (!seqs)
			goto oom;
		CK(cudaMalloc((void **)&kvbuf, pn * 4));
		for (uint32_t b = 0; b < B; b++) {
			if (b > 0 && a->share) {
				double ts = now_ms();

				if (b == 1) {
					CK(cudaStreamSynchronize(st));
					r->prefill0_s = (ts - t0) / 1e3;
				}
				if (a->share == DEC_SHARE_FORK) {
					KV(kvc_seq_fork(kc, seqs[0], &seqs[b]));
				} else {
					uint64_t got;

					KV(kvc_seq_attach(kc, keys, nkeys, &seqs[b], &got));
					if (got != a->ctx) {
						snprintf(r->err, sizeof r->err, "attach got %llu of %u tokens",
							 (unsigned long long)got, a->ctx);
						goto out;
					}
				}
				r->share_s += (now_ms() - ts) / 1e3;
				continue;
			}
			KV(kvc_seq_create(kc, &seqs[b]));
			for (uint32_t l = 0; l < NL; l++) {
				uint64_t sd = a->seed * 7 + 2 * ((size_t)l * B + b);

				/* random K/V of the whole context, generated on the GPU,
				 * centered and hashed there and streamed to kvd */
				CK(mdl_fill_bf16(kvbuf, pn, sd, 0.0f, 2.0f, st));
				CK(mdl_fill_bf16(kvbuf + pn, pn, sd + 1, 0.0f, 1.0f, st));
				KV(kvc_prefill_dev(kc, seqs[b], l, kvbuf, kvbuf + pn, a->ctx, KVC_BF16, st));
			}
			if (b == 0 && a->share == DEC_SHARE_ATTACH && B > 1) {
				/* the prompt's token ids are synthetic too: 0, 1, 2, ... */
				uint32_t *ids = malloc((size_t)a->ctx * sizeof *ids);
				int nk;

				keys = malloc((size_t)(a->ctx / 256 + 1) * KVC_KEY_BYTES);
				if (!ids || !keys) {
					free(ids);
					goto oom;
				}
				for (uint32_t t = 0; t < a->ctx; t++)
					ids[t] = t;
				nk = kvc_content_keys(kc, ids, a->ctx, keys);
				free(ids);
				if (nk <= 0) {
					snprintf(r->err, sizeof r->err, "content keys: %s", kvc_last_error(kc));
					goto out;
				}
				nkeys = (uint32_t)nk;
				KV(kvc_seq_publish(kc, seqs[0], keys + (size_t)(nk - 1) * KVC_KEY_BYTES));
			}
		}
		CK(cudaFree(kvbuf));
		kvbuf = NULL;
		{
			uint32_t nd = m.n_dense, ns = NL - nd;
			uint64_t win = a->sink + a->window + KVG_APPEND_BATCH;

			r->gpu_kv_gb = (double)B * KVH * HD * 4 * (ns * win + (uint64_t)nd * cap) / 1e9;
		}
	}
	CK(cudaStreamSynchronize(st));
	r->prefill_s = (now_ms() - t0) / 1e3;

	/* ---- decode ---- */
	double lay_ms = 0, attn_ms = 0, head_ms = 0;
	struct kvc_timing kt0 = { 0 }, kt1 = { 0 };

	for (uint32_t s = 0; s < total; s++) {
		uint32_t pos = a->ctx + s;
		int measure = s >= a->warmup;
		double ts = now_ms();

		if (kvd_mode && s == a->warmup)
			KV(kvc_timing(kc, &kt0, 1));
		CK(mdl_embed(emb, tok, x, B, HIDDEN, st));
		for (uint32_t l = 0; l < NL; l++) {
			CK(cudaEventRecord(ev[4 * l], st));
			CK(mdl_rmsnorm(x, lw[l].n1, hb, B, HIDDEN, EPS, st));
			CB(gemm(blas, lw[l].qkv, hb, y, B, HIDDEN, QKV_OUT, 0.0f));
			CK(mdl_rope_split(y, B, QH, KVH, HD, pos, THETA, q, k, v, st));
			CK(cudaEventRecord(ev[4 * l + 1], st));
			if (kvd_mode) {
				KV(kvc_append_dev(kc, l, seqs, B, k, v, KVC_F32, st));
				KV(kvc_attend_dev(kc, l, seqs, B, q, att, NULL, st));
			} else {
				struct kvg_attn_plan pl;

				for (uint32_t b = 0; b < B; b++) {
					size_t i = (size_t)l * B + b;

					put[b] = (struct kvg_put){ kc_k[i], kc_v[i], NULL, cap, pos };
					rows[b] = (struct kvg_rows){ kc_k[i], kc_v[i], cap, 0, 0, pos + 1 };
				}
				kvg_attn_plan(pos + 1, B, KVH, QH, HD,
					      4u * (uint32_t)prop.multiProcessorCount, &pl);
				CK(kvg_append(k, v, KVG_F32, put, B, KVH, HD, st));
				CK(kvg_attn(q, rows, B, QH, KVH, HD, &pl, att, y /* lse: scratch */, part, st));
			}
			CK(cudaEventRecord(ev[4 * l + 2], st));
			CK(mdl_to_bf16(att, ab, (size_t)B * HIDDEN, st));
			CB(gemm(blas, lw[l].o, ab, x, B, HIDDEN, HIDDEN, 1.0f));
			CK(mdl_rmsnorm(x, lw[l].n2, hb, B, HIDDEN, EPS, st));
			CB(gemm(blas, lw[l].gu, hb, gu, B, HIDDEN, 2 * INTER, 0.0f));
			CK(mdl_swiglu(gu, mb, B, INTER, st));
			CB(gemm(blas, lw[l].down, mb, x, B, INTER, HIDDEN, 1.0f));
			CK(cudaEventRecord(ev[4 * l + 3], st));
		}
		CK(cudaEventRecord(ev[4 * NL], st));
		CK(mdl_rmsnorm(x, nf, hb, B, HIDDEN, EPS, st));
		CB(gemm(blas, lm, hb, logits, B, HIDDEN, VOCAB, 0.0f));
		CK(mdl_argmax(logits, B, VOCAB, tok, st));
		CK(cudaEventRecord(ev[4 * NL + 1], st));
		CK(cudaStreamSynchronize(st));
		step_ms[s] = now_ms() - ts;
		if (!measure)
			continue;
		for (uint32_t l = 0; l < NL; l++) {
			float m1, m2, m3;

			CK(cudaEventElapsedTime(&m1, ev[4 * l], ev[4 * l + 1]));
			CK(cudaEventElapsedTime(&m2, ev[4 * l + 1], ev[4 * l + 2]));
			CK(cudaEventElapsedTime(&m3, ev[4 * l + 2], ev[4 * l + 3]));
			lay_ms += m1 + m3;
			attn_ms += m2;
		}
		{
			float mh;

			CK(cudaEventElapsedTime(&mh, ev[4 * NL], ev[4 * NL + 1]));
			head_ms += mh;
		}
	}
	if (kvd_mode) {
		struct kvc_seq_stats ss;

		KV(kvc_timing(kc, &kt1, 0));
		for (uint32_t b = 0; b < B; b++) {
			KV(kvc_seq_stats(kc, seqs[b], &ss));
			r->host_kv_gb += ss.bytes / 1e9;
		}
	}

	double dec = 0, n = a->steps;

	for (uint32_t s = a->warmup; s < total; s++)
		dec += step_ms[s];
	r->tok_s = (double)B * a->steps / (dec / 1e3);
	r->step_ms = dec / n;
	qsort(step_ms + a->warmup, a->steps, sizeof *step_ms, cmp_d);
	r->step_p50_ms = step_ms[a->warmup + a->steps / 2];
	r->step_p99_ms = step_ms[a->warmup + (uint32_t)((a->steps - 1) * 0.99)];
	r->layers_ms = lay_ms / n;
	r->attn_ms = attn_ms / n;
	r->head_ms = head_ms / n;
	r->kvd_wait_ms = kt1.kvd_wait_ms / n;
	r->gpu_wait_ms = kt1.gpu_wait_ms / n;
	r->copies_ms = (kt1.hash_ms + kt1.h2d_ms) / n;
	r->window_ms = kt1.window_ms / n;
	r->merge_ms = kt1.merge_ms / n;
	r->evict_ms = kt1.evict_ms / n;
	(void)kt0;
	rc = 0;
	goto out;
oom:
	snprintf(r->err, sizeof r->err, "out of host memory");
out:
	if (st)
		(void)cudaStreamSynchronize(st);
	if (kc) {
		for (uint32_t b = 0; seqs && b < B; b++)
			if (seqs[b])
				kvc_seq_free(kc, seqs[b]);
		kvc_close(kc);
	}
	srv_stop(&srv);
	for (size_t i = 0; kc_k && i < (size_t)NL * B; i++) {
		cudaFree(kc_k[i]);
		cudaFree(kc_v[i]);
	}
	cudaFree(wbuf); cudaFree(x); cudaFree(y); cudaFree(q); cudaFree(k); cudaFree(v);
	cudaFree(att); cudaFree(gu); cudaFree(logits); cudaFree(hb); cudaFree(ab); cudaFree(mb);
	cudaFree(tok); cudaFree(part); cudaFree(kvbuf);
	for (uint32_t i = 0; ev && i < nev; i++)
		if (ev[i])
			cudaEventDestroy(ev[i]);
	if (blas)
		cublasDestroy(blas);
	if (st)
		cudaStreamDestroy(st);
	free(lw); free(kc_k); free(kc_v); free(seqs); free(rows); free(put); free(ev); free(step_ms);
	free(keys);
	return rc;
}

void dec_print(FILE *f, const struct dec_args *a, const struct dec_result *r, int json)
{
	if (json) {
		fprintf(f,
			"{\"bench\":\"decode\",\"attn\":\"%s\",\"device\":\"%s\",\"ctx\":%u,\"batch\":%u,"
			"\"steps\":%u,\"layers\":%u,\"K\":%u,\"L\":%u,\"c\":%u,\"sink\":%u,\"window\":%u,"
			"\"kv_dtype\":\"%s\",\"estimator\":\"%s\",\"share\":\"%s\","
			"\"prefill0_s\":%.3f,\"share_s\":%.3f,"
			"\"prefill_synthetic\":true,\"prefill_s\":%.3f,\"tok_s\":%.2f,\"step_ms\":%.3f,"
			"\"step_p50_ms\":%.3f,\"step_p99_ms\":%.3f,\"layers_ms\":%.3f,\"attn_ms\":%.3f,"
			"\"head_ms\":%.3f,\"kvd_wait_ms\":%.3f,\"gpu_wait_ms\":%.3f,\"copies_ms\":%.3f,"
			"\"window_ms\":%.3f,\"merge_ms\":%.3f,\"evict_ms\":%.3f,\"gpu_kv_gb\":%.3f,"
			"\"host_kv_gb\":%.3f}\n",
			r->mode, r->device, r->ctx, r->batch, r->steps, r->layers, a->K, a->L, a->c,
			a->sink, a->window, kvd_kv_dtype_name(a->kv_dtype),
			kvd_estimator_name(a->estimator), dec_share_name(a->share), r->prefill0_s,
			r->share_s, r->prefill_s, r->tok_s, r->step_ms, r->step_p50_ms,
			r->step_p99_ms, r->layers_ms, r->attn_ms, r->head_ms, r->kvd_wait_ms,
			r->gpu_wait_ms, r->copies_ms, r->window_ms, r->merge_ms, r->evict_ms,
			r->gpu_kv_gb, r->host_kv_gb);
		return;
	}
	fprintf(f, "kvd-decode: %s, attention %s, %u layers, batch %u, context %u (synthetic prefill %.1f s)\n",
		r->device, r->mode, r->layers, r->batch, r->ctx, r->prefill_s);
	fprintf(f, "  %.1f tokens/s; step %.2f ms (p50 %.2f, p99 %.2f)\n", r->tok_s, r->step_ms,
		r->step_p50_ms, r->step_p99_ms);
	fprintf(f, "  per step: GPU layers %.2f ms, attention %.2f ms (GPU stream, incl. waits), head %.2f ms\n",
		r->layers_ms, r->attn_ms, r->head_ms);
	if (a->attn == DEC_KVD)
		fprintf(f, "  kvd (%s K/V, %s): wait %.2f ms, query to arena %.2f ms, copies+hash "
			   "%.2f ms (GPU), window %.2f ms, merge %.2f ms, evictions %.2f ms\n",
			kvd_kv_dtype_name(a->kv_dtype), kvd_estimator_name(a->estimator), r->kvd_wait_ms,
			r->gpu_wait_ms, r->copies_ms, r->window_ms, r->merge_ms, r->evict_ms);
	if (a->share)
		fprintf(f, "  shared prompt (%s): sequence 0's prefill %.2f s, the other %u's %s %.3f s "
			   "in all\n", dec_share_name(a->share), r->prefill0_s, r->batch - 1,
			dec_share_name(a->share), r->share_s);
	fprintf(f, "  KV: %.2f GB on the GPU, %.2f GB in kvd\n", r->gpu_kv_gb, r->host_kv_gb);
}
