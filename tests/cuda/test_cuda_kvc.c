/* libkvclient's CUDA backend end to end, through a real kvd, against the
 * CPU backend on the same data (needs a CUDA device; without one it says
 * "no CUDA device: skipped" and exits 77):
 *  - host API on both backends: prefill, appends past several evictions,
 *    attend and attend_kvd agree (near-exact profile: tightly; MagicPIG's
 *    sampling profile: within what a few codes flipped at the sign boundary
 *    can move);
 *  - device API, a batch of sequences, bf16 K/V, on a caller's stream;
 *  - misuse gets the right error and leaves the connection usable.
 * Run it under compute-sanitizer too (docs/GPU.md). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "engine/bf16.h"
#include "daemon.h"
#include "gpu-client/kvc.h"
#include "engine/synth.h"
#include "testutil.h"

#define LAYERS  3
#ifndef KVG_EMU
#define N_TOK   3000
#define STEPS   150                     /* > window + 32: several evictions */
#else
/* the host emulation (make check-emu): still several prefill chunks in the
 * sampled profile, a split dense layer, 3 evictions per sparse layer;
 * N_TOK + STEPS > 1044 for kvd_synth's needle workload */
#define N_TOK   1000
#define STEPS   100
#endif

#define CU(x)                                                                        \
	do {                                                                         \
		cudaError_t e_ = (x);                                                \
		if (e_ != cudaSuccess)                                               \
			fail_msg("%s: %s", #x, cudaGetErrorString(e_));              \
	} while (0)

static const uint32_t dense_layers[] = { 0 };

/* Samples nearly every key: the estimate sits near exact attention, so the
 * two backends must agree closely. */
static const struct kvc_model near_exact = {
	.name = "cuda-exact", .layers = LAYERS, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 1, .L = 32, .c = 1, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 8, .segment_tokens = 1024, .seal_tokens = 128,
};

static const struct kvc_model sampled = {
	.name = "cuda-sampled", .layers = LAYERS, .q_heads = 32, .kv_heads = 8, .head_dim = 128,
	.K = 10, .L = 150, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 9, .segment_tokens = 2048, .seal_tokens = 256,
};

static struct daemon D;

static int start(void **state)
{
	return daemon_start(&D, NULL) ? -1 : 0;
}

static int stop(void **state)
{
	return daemon_stop(&D) == 0 ? 0 : -1;
}

static struct kvc *open_dev(int backend, const struct kvc_model *m, int device)
{
	struct kvc_opts o = { .socket_path = D.sock, .tenant = "t",
			      .name = backend == KVC_BACKEND_CUDA ? "cuda" : "cpu", .slots = 8,
			      .slot_size = 2 << 20, .backend = backend, .timing = 1,
			      .device = device };
	struct kvc *c;

	if (kvc_connect(&o, &c) || kvc_profile(c, m))
		fail_msg("%s backend: %s", o.name, kvc_last_error(c));
	assert_int_equal(kvc_backend(c), backend);
	return c;
}

static struct kvc *open_backend(int backend, const struct kvc_model *m)
{
	return open_dev(backend, m, 0);
}

/* The calling thread's current device is the caller's, whatever device the
 * connection uses. */
static void still_current(int want)
{
	int dev = -1;

	CU(cudaGetDevice(&dev));
	assert_int_equal(dev, want);
}

/* How host_api_case runs the CUDA side: on which device (the caller's
 * current device stays 0), and whether evictions are made to fail (the
 * host emulation's fault injection). */
struct variant {
	int device;
	int fail_evictions;
};

static double rel(const float *a, const float *b, size_t n)
{
	return rel_err_ff(a, b, n);
}

static double lse_diff(const float *a, const float *b, size_t n)
{
	double m = 0;

	for (size_t i = 0; i < n; i++) {
		if (isinf(a[i]) || isinf(b[i])) {
			assert_true(a[i] == b[i]);
			continue;
		}
		m = fmax(m, fabs(a[i] - b[i]));
	}
	return m;
}

static void token(const struct kvd_synth *w, uint32_t t, float *k, float *v)
{
	for (uint32_t h = 0; h < w->kv_heads; h++) {
		memcpy(k + (size_t)h * w->d, w->k + ((size_t)h * w->n + t) * w->d, w->d * 4);
		memcpy(v + (size_t)h * w->d, w->v + ((size_t)h * w->n + t) * w->d, w->d * 4);
	}
}

/* Both backends, host API, one sequence: prefill N_TOK, then STEPS decode
 * steps of append + attend on every layer; compare every step's output. */
static void host_api_case_v(const struct kvc_model *m, double tol, uint64_t seed,
			    const struct variant *va)
{
	struct kvc *cpu = open_backend(KVC_BACKEND_CPU, m);
	struct kvc *gpu = open_dev(KVC_BACKEND_CUDA, m, va->device);
	unsigned failed = 0, failed_last = 0;
	struct kvc_seq *sc, *sg;
	struct kvd_synth w[LAYERS];
	const uint32_t Hq = m->q_heads, H = m->kv_heads, d = m->head_dim, n = N_TOK + STEPS;
	float *kt = xmalloc((size_t)H * d * 4), *vt = xmalloc((size_t)H * d * 4);
	float *oc = xmalloc((size_t)Hq * d * 4), *og = xmalloc((size_t)Hq * d * 4);
	float *lc = xmalloc(Hq * 4), *lg = xmalloc(Hq * 4);
	float *k0 = xmalloc((size_t)H * N_TOK * d * 4), *v0 = xmalloc((size_t)H * N_TOK * d * 4);
	double worst = 0, worst_kvd = 0, worst_lse = 0;
	struct kvc_timing t;

	if (kvc_seq_create(cpu, &sc) || kvc_seq_create(gpu, &sg))
		fail_msg("seq");
	for (uint32_t l = 0; l < LAYERS; l++) {
		assert_int_equal(kvd_synth_make(&w[l], (enum kvd_wl)(l % KVD_WL_COUNT), n, Hq, H, d,
						seed * 10 + l), 0);
		for (uint32_t h = 0; h < H; h++) {
			memcpy(k0 + (size_t)h * N_TOK * d, w[l].k + (size_t)h * n * d, (size_t)N_TOK * d * 4);
			memcpy(v0 + (size_t)h * N_TOK * d, w[l].v + (size_t)h * n * d, (size_t)N_TOK * d * 4);
		}
		if (kvc_prefill(cpu, sc, l, k0, v0, N_TOK))
			fail_msg("cpu prefill: %s", kvc_last_error(cpu));
		if (kvc_prefill(gpu, sg, l, k0, v0, N_TOK))
			fail_msg("cuda prefill: %s", kvc_last_error(gpu));
	}
	for (uint32_t s = 0; s < STEPS; s++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			token(&w[l], N_TOK + s, kt, vt);
			if (kvc_append(cpu, sc, l, kt, vt) || kvc_attend(cpu, l, &sc, 1, w[l].q, oc, lc))
				fail_msg("cpu: %s", kvc_last_error(cpu));
			memset(og, 0xff, (size_t)Hq * d * 4);   /* poison */
			memset(lg, 0xff, Hq * 4);
#ifdef KVG_EMU
			/* an eviction's first copy to the arena fails, unless the
			 * layer's last one did: the token is in, the rows stay on
			 * the GPU (its window attention covers them) and the next
			 * append sends them first; nothing may be lost */
			if (va->fail_evictions && !(failed_last >> l & 1))
				emu_fail_next("cudaMemcpyAsync", cudaMemcpyDeviceToHost);
#endif
			int rc = kvc_append(gpu, sg, l, kt, vt);
#ifdef KVG_EMU
			emu_fail_next(NULL, -1);
#endif
			failed_last &= ~(1u << l);
			if (rc == -EIO && va->fail_evictions) {
				failed++;
				failed_last |= 1u << l;
			} else if (rc)
				fail_msg("cuda append: %s", kvc_last_error(gpu));
			still_current(0);
			if (kvc_attend(gpu, l, &sg, 1, w[l].q, og, lg))
				fail_msg("cuda: %s", kvc_last_error(gpu));
			still_current(0);
			worst = fmax(worst, rel(og, oc, (size_t)Hq * d));
			worst_lse = fmax(worst_lse, lse_diff(lg, lc, Hq));
		}
	for (uint32_t l = 1; l < LAYERS; l++) {
		memset(og, 0xff, (size_t)Hq * d * 4);
		if (kvc_attend_kvd(cpu, l, &sc, 1, w[l].q, oc, lc) ||
		    kvc_attend_kvd(gpu, l, &sg, 1, w[l].q, og, lg))
			fail_msg("attend_kvd: %s / %s", kvc_last_error(cpu), kvc_last_error(gpu));
		worst_kvd = fmax(worst_kvd, rel(og, oc, (size_t)Hq * d));
		worst_lse = fmax(worst_lse, lse_diff(lg, lc, Hq));
	}
	assert_int_equal(kvc_timing(gpu, &t, 0), 0);
	still_current(0);
	if (va->fail_evictions)
		assert_true(failed >= LAYERS - 1);     /* the fault did fire */
	print_message("%s (device %d, %u failed evictions): merged rel %.3g, kvd part rel %.3g, "
		      "lse %.3g (tol %.3g); %llu attends, "
		      "%llu evicted, kvd wait %.1f ms, hash %.2f ms, window %.2f ms, h2d %.2f ms, "
		      "merge %.2f ms\n", m->name, va->device, failed, worst, worst_kvd, worst_lse, tol,
		      (unsigned long long)t.attends, (unsigned long long)t.evicted, t.kvd_wait_ms,
		      t.hash_ms, t.window_ms, t.h2d_ms, t.merge_ms);
	assert_true(worst < tol);
	assert_true(worst_kvd < tol);
	assert_true(worst_lse < 50 * tol);
	assert_true(t.evicted >= (uint64_t)(LAYERS - 1) * 3);   /* the window did slide */
	assert_true(t.attends >= (uint64_t)STEPS * LAYERS);
	assert_int_equal(kvc_seq_free(cpu, sc), 0);
	assert_int_equal(kvc_seq_free(gpu, sg), 0);
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&w[l]);
	kvc_close(cpu);
	kvc_close(gpu);
	still_current(0);
	free(kt); free(vt); free(oc); free(og); free(lc); free(lg); free(k0); free(v0);
}

static void host_api_case(const struct kvc_model *m, double tol, uint64_t seed)
{
	static const struct variant plain = { 0, 0 };

	host_api_case_v(m, tol, seed, &plain);
}

/* A connection on device 1 while the caller's thread has device 0 current:
 * every call does its work on device 1 (the emulation faults any work
 * queued on the wrong device) and leaves device 0 current. */
static void test_other_device(void **state)
{
	static const struct variant other = { 1, 0 };
	int n = 0;

	CU(cudaGetDeviceCount(&n));
	if (n < 2) {
		print_message("one CUDA device: skipped\n");
		skip();
	}
	CU(cudaSetDevice(0));
	host_api_case_v(&near_exact, 2e-3, 3, &other);
}

#ifdef KVG_EMU
/* Evictions that fail part way (a copy into the arena) lose no rows. */
static void test_failed_evictions(void **state)
{
	static const struct variant faults = { 0, 1 };
	unsigned before = emu_failures();

	host_api_case_v(&near_exact, 2e-3, 4, &faults);
	assert_true(emu_failures() > before);
}
#endif

static void test_host_api_near_exact(void **state)
{
	host_api_case(&near_exact, 2e-3, 1);
}

static void test_host_api_sampled(void **state)
{
	host_api_case(&sampled, 3e-2, 2);
}

/* kvc_seq_fork on the CUDA backend: the child gets device copies of the
 * parent's rows and answers exactly what the parent answers; after each
 * decodes other tokens, each answers exactly what a sequence given the
 * same tokens from the start answers. */
static void build_seq(struct kvc *g, struct kvc_seq **out, struct kvd_synth *w, const uint32_t *tok,
		      uint32_t ntok, float *k0, float *v0, float *kt, float *vt)
{
	const uint32_t H = w[0].kv_heads, d = w[0].d, n = w[0].n;

	if (kvc_seq_create(g, out))
		fail_msg("seq: %s", kvc_last_error(g));
	for (uint32_t l = 0; l < LAYERS; l++) {
		for (uint32_t h = 0; h < H; h++) {
			memcpy(k0 + (size_t)h * N_TOK * d, w[l].k + (size_t)h * n * d, (size_t)N_TOK * d * 4);
			memcpy(v0 + (size_t)h * N_TOK * d, w[l].v + (size_t)h * n * d, (size_t)N_TOK * d * 4);
		}
		if (kvc_prefill(g, *out, l, k0, v0, N_TOK))
			fail_msg("prefill: %s", kvc_last_error(g));
	}
	for (uint32_t i = 0; i < ntok; i++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			token(&w[l], tok[i], kt, vt);
			if (kvc_append(g, *out, l, kt, vt))
				fail_msg("append: %s", kvc_last_error(g));
		}
}

static void same_answers(struct kvc *g, struct kvc_seq *a, struct kvc_seq *b, struct kvd_synth *w,
			 int want_same)
{
	const uint32_t Hq = w[0].q_heads, d = w[0].d;
	float *oa = xmalloc((size_t)Hq * d * 4), *ob = xmalloc((size_t)Hq * d * 4);
	float la[64], lb[64];
	int same = 1;

	assert_true(Hq <= 64);
	for (uint32_t l = 0; l < LAYERS; l++) {
		if (kvc_attend(g, l, &a, 1, w[l].q, oa, la) || kvc_attend(g, l, &b, 1, w[l].q, ob, lb))
			fail_msg("attend: %s", kvc_last_error(g));
		same &= !memcmp(oa, ob, (size_t)Hq * d * 4) && !memcmp(la, lb, Hq * 4);
	}
	if (want_same && !same)
		fail_msg("answers differ");
	if (!want_same && same)
		fail_msg("answers of different tokens are the same");
	free(oa);
	free(ob);
}

static void test_fork(void **state)
{
	const struct kvc_model *m = &sampled;
	struct kvc *g = open_dev(KVC_BACKEND_CUDA, m, 0);
	struct kvd_synth w[LAYERS];
	const uint32_t Hq = m->q_heads, H = m->kv_heads, d = m->head_dim, n = N_TOK + 3 * STEPS;
	float *kt = xmalloc((size_t)H * d * 4), *vt = xmalloc((size_t)H * d * 4);
	float *k0 = xmalloc((size_t)H * N_TOK * d * 4), *v0 = xmalloc((size_t)H * N_TOK * d * 4);
	uint32_t ta[2 * STEPS], tb[2 * STEPS];
	struct kvc_seq *par, *ch, *pa, *pb;

	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvd_synth_make(&w[l], (enum kvd_wl)(l % KVD_WL_COUNT), n, Hq, H, d,
						70 + l), 0);
	/* parent: the prompt and STEPS/2 decoded tokens; then A or B */
	for (uint32_t i = 0; i < 2 * STEPS; i++) {
		ta[i] = N_TOK + i;
		tb[i] = i < STEPS / 2 ? N_TOK + i : N_TOK + STEPS + i;
	}
	build_seq(g, &par, w, ta, STEPS / 2, k0, v0, kt, vt);
	if (kvc_seq_fork(g, par, &ch))
		fail_msg("fork: %s", kvc_last_error(g));
	same_answers(g, par, ch, w, 1);
	for (uint32_t i = STEPS / 2; i < 2 * STEPS; i++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			token(&w[l], ta[i], kt, vt);
			if (kvc_append(g, par, l, kt, vt))
				fail_msg("append: %s", kvc_last_error(g));
			token(&w[l], tb[i], kt, vt);
			if (kvc_append(g, ch, l, kt, vt))
				fail_msg("append: %s", kvc_last_error(g));
		}
	build_seq(g, &pa, w, ta, 2 * STEPS, k0, v0, kt, vt);
	build_seq(g, &pb, w, tb, 2 * STEPS, k0, v0, kt, vt);
	same_answers(g, par, pa, w, 1);
	same_answers(g, ch, pb, w, 1);
	same_answers(g, par, ch, w, 0);
	/* the parent goes first; the child keeps its rows */
	assert_int_equal(kvc_seq_free(g, par), 0);
	same_answers(g, ch, pb, w, 1);
	assert_int_equal(kvc_seq_free(g, ch), 0);
	assert_int_equal(kvc_seq_free(g, pa), 0);
	assert_int_equal(kvc_seq_free(g, pb), 0);
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&w[l]);
	kvc_close(g);
	free(kt); free(vt); free(k0); free(v0);
}

/* Prefix sharing on the device: a sequence published at a chunk boundary
 * (its rows, sinks and wrapped window ring, dense layer, read back from the
 * device) and attached on another connection (the rows put back on the
 * device) answers as its publisher; both extended alike, still alike. */
static void test_attach(void **state)
{
	const struct kvc_model *m = &sampled;
	struct kvc *g = open_dev(KVC_BACKEND_CUDA, m, 0), *g2 = open_dev(KVC_BACKEND_CUDA, m, 0);
	struct kvd_synth w[LAYERS];
	const uint32_t Hq = m->q_heads, H = m->kv_heads, d = m->head_dim;
	const uint32_t chunk = 256, total = (N_TOK + STEPS + chunk - 1) / chunk * chunk;
	const uint32_t extra = total - N_TOK, n = total + STEPS;
	float *kt = xmalloc((size_t)H * d * 4), *vt = xmalloc((size_t)H * d * 4);
	float *k0 = xmalloc((size_t)H * N_TOK * d * 4), *v0 = xmalloc((size_t)H * N_TOK * d * 4);
	uint32_t *tok = xmalloc((size_t)n * sizeof *tok), *ids = xmalloc((size_t)n * 4);
	uint8_t *keys = xmalloc((size_t)(n / chunk + 1) * KVC_KEY_BYTES);
	struct kvc_seq *par, *ch;
	uint64_t got;
	int nk;

	assert_int_equal(kvc_chunk_tokens(g), chunk);
	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvd_synth_make(&w[l], (enum kvd_wl)(l % KVD_WL_COUNT), n, Hq, H, d,
						90 + l), 0);
	for (uint32_t i = 0; i < n; i++) {
		tok[i] = N_TOK + i;     /* rows appended after the prefill */
		ids[i] = i * 2654435761u;
	}
	build_seq(g, &par, w, tok, extra, k0, v0, kt, vt);
	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvc_seq_tokens(par, l), total);
	nk = kvc_content_keys(g, ids, total, keys);
	assert_int_equal(nk, total / chunk);
	if (kvc_seq_publish(g, par, keys + (size_t)(nk - 1) * KVC_KEY_BYTES))
		fail_msg("publish: %s", kvc_last_error(g));
	if (kvc_seq_attach(g2, keys, (uint32_t)nk, &ch, &got))
		fail_msg("attach: %s", kvc_last_error(g2));
	assert_int_equal(got, total);
	assert_int_equal(kvc_seq_tokens(ch, 1), total);
	same_answers(g, par, ch, w, 1);
	/* the same next tokens on both: the child's ring continues as the
	 * parent's does, evictions included */
	for (uint32_t i = 0; i < STEPS; i++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			token(&w[l], total + i, kt, vt);
			if (kvc_append(g, par, l, kt, vt) || kvc_append(g2, ch, l, kt, vt))
				fail_msg("append: %s / %s", kvc_last_error(g), kvc_last_error(g2));
		}
	same_answers(g, par, ch, w, 1);
	assert_int_equal(kvc_seq_free(g2, ch), 0);
	assert_int_equal(kvc_seq_free(g, par), 0);
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&w[l]);
	kvc_close(g);
	kvc_close(g2);
	free(kt); free(vt); free(k0); free(v0); free(tok); free(ids); free(keys);
}

/* The device API: NS sequences decoded as a batch, K/V handed over as bf16
 * on a caller's stream, against the CPU backend fed the same (bf16-exact)
 * values one sequence at a time. */
#define NS 3
static void test_device_api_batch(void **state)
{
	const struct kvc_model *m = &near_exact;
	const uint32_t Hq = m->q_heads, H = m->kv_heads, d = m->head_dim, n = N_TOK + STEPS;
	struct kvc *cpu = open_backend(KVC_BACKEND_CPU, m), *gpu = open_backend(KVC_BACKEND_CUDA, m);
	struct kvc_seq *sc[NS], *sg[NS];
	struct kvd_synth w[NS][LAYERS];
	cudaStream_t st;
	uint16_t *hk = xmalloc((size_t)H * N_TOK * d * 2), *hv = xmalloc((size_t)H * N_TOK * d * 2);
	float *k0 = xmalloc((size_t)H * N_TOK * d * 4), *v0 = xmalloc((size_t)H * N_TOK * d * 4);
	uint16_t *tk = xmalloc((size_t)NS * H * d * 2), *tv = xmalloc((size_t)NS * H * d * 2);
	float *kt = xmalloc((size_t)H * d * 4), *vt = xmalloc((size_t)H * d * 4);
	float *q = xmalloc((size_t)NS * Hq * d * 4), *oc = xmalloc((size_t)NS * Hq * d * 4);
	float *og = xmalloc((size_t)NS * Hq * d * 4), *lc = xmalloc((size_t)NS * Hq * 4);
	float *lg = xmalloc((size_t)NS * Hq * 4);
	void *dk, *dv, *dtk, *dtv, *dq, *dout, *dl;
	double worst = 0;

	CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	CU(cudaMalloc(&dk, (size_t)H * N_TOK * d * 2));
	CU(cudaMalloc(&dv, (size_t)H * N_TOK * d * 2));
	CU(cudaMalloc(&dtk, (size_t)NS * H * d * 2));
	CU(cudaMalloc(&dtv, (size_t)NS * H * d * 2));
	CU(cudaMalloc(&dq, (size_t)NS * Hq * d * 4));
	CU(cudaMalloc(&dout, (size_t)NS * Hq * d * 4));
	CU(cudaMalloc(&dl, (size_t)NS * Hq * 4));
	for (uint32_t j = 0; j < NS; j++) {
		if (kvc_seq_create(cpu, &sc[j]) || kvc_seq_create(gpu, &sg[j]))
			fail_msg("seq");
		for (uint32_t l = 0; l < LAYERS; l++) {
			struct kvd_synth *x = &w[j][l];

			assert_int_equal(kvd_synth_make(x, (enum kvd_wl)((j + l) % KVD_WL_COUNT), n, Hq, H,
							d, 1000 + j * 10 + l), 0);
			/* the values both backends see: bf16-exact */
			for (size_t i = 0; i < (size_t)H * n * d; i++) {
				x->k[i] = kvd_bf16_to_f32(kvd_f32_to_bf16(x->k[i]));
				x->v[i] = kvd_bf16_to_f32(kvd_f32_to_bf16(x->v[i]));
			}
			for (uint32_t h = 0; h < H; h++)
				for (size_t i = 0; i < (size_t)N_TOK * d; i++) {
					k0[(size_t)h * N_TOK * d + i] = x->k[(size_t)h * n * d + i];
					v0[(size_t)h * N_TOK * d + i] = x->v[(size_t)h * n * d + i];
					hk[(size_t)h * N_TOK * d + i] = kvd_f32_to_bf16(x->k[(size_t)h * n * d + i]);
					hv[(size_t)h * N_TOK * d + i] = kvd_f32_to_bf16(x->v[(size_t)h * n * d + i]);
				}
			if (kvc_prefill(cpu, sc[j], l, k0, v0, N_TOK))
				fail_msg("cpu prefill: %s", kvc_last_error(cpu));
			CU(cudaMemcpyAsync(dk, hk, (size_t)H * N_TOK * d * 2, cudaMemcpyHostToDevice, st));
			CU(cudaMemcpyAsync(dv, hv, (size_t)H * N_TOK * d * 2, cudaMemcpyHostToDevice, st));
			if (kvc_prefill_dev(gpu, sg[j], l, dk, dv, N_TOK, KVC_BF16, st))
				fail_msg("prefill_dev: %s", kvc_last_error(gpu));
		}
	}
	for (uint32_t s = 0; s < STEPS; s++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			for (uint32_t j = 0; j < NS; j++) {
				token(&w[j][l], N_TOK + s, kt, vt);
				for (uint32_t i = 0; i < H * d; i++) {
					tk[(size_t)j * H * d + i] = kvd_f32_to_bf16(kt[i]);
					tv[(size_t)j * H * d + i] = kvd_f32_to_bf16(vt[i]);
				}
				memcpy(q + (size_t)j * Hq * d, w[j][l].q, (size_t)Hq * d * 4);
				if (kvc_append(cpu, sc[j], l, kt, vt))
					fail_msg("cpu append: %s", kvc_last_error(cpu));
			}
			if (kvc_attend(cpu, l, sc, NS, q, oc, lc))
				fail_msg("cpu attend: %s", kvc_last_error(cpu));
			CU(cudaMemcpyAsync(dtk, tk, (size_t)NS * H * d * 2, cudaMemcpyHostToDevice, st));
			CU(cudaMemcpyAsync(dtv, tv, (size_t)NS * H * d * 2, cudaMemcpyHostToDevice, st));
			CU(cudaMemcpyAsync(dq, q, (size_t)NS * Hq * d * 4, cudaMemcpyHostToDevice, st));
			CU(cudaMemsetAsync(dout, 0xff, (size_t)NS * Hq * d * 4, st));
			CU(cudaMemsetAsync(dl, 0xff, (size_t)NS * Hq * 4, st));
			if (kvc_append_dev(gpu, l, sg, NS, dtk, dtv, KVC_BF16, st) ||
			    kvc_attend_dev(gpu, l, sg, NS, dq, dout, dl, st))
				fail_msg("cuda: %s", kvc_last_error(gpu));
			CU(cudaMemcpyAsync(og, dout, (size_t)NS * Hq * d * 4, cudaMemcpyDeviceToHost, st));
			CU(cudaMemcpyAsync(lg, dl, (size_t)NS * Hq * 4, cudaMemcpyDeviceToHost, st));
			CU(cudaStreamSynchronize(st));
			worst = fmax(worst, rel(og, oc, (size_t)NS * Hq * d));
			assert_true(lse_diff(lg, lc, (size_t)NS * Hq) < 0.1);
		}
	print_message("device API, %d sequences, bf16: worst rel %.3g\n", NS, worst);
	assert_true(worst < 2e-3);

	/* misuse: host memory, append before prefill, prefill twice, kvd-only
	 * on a dense layer, an unknown dtype -- each refused, and then the
	 * connection still answers */
	struct kvc_seq *fresh;

	assert_int_equal(kvc_seq_create(gpu, &fresh), 0);
	assert_int_equal(kvc_prefill_dev(gpu, fresh, 1, hk, hv, 10, KVC_BF16, st), -EFAULT);
	assert_non_null(strstr(kvc_last_error(gpu), "host memory"));
	assert_int_equal(kvc_append_dev(gpu, 1, &fresh, 1, dtk, dtv, KVC_BF16, st), -EINVAL);
	assert_int_equal(kvc_prefill_dev(gpu, sg[0], 1, dk, dv, 10, KVC_BF16, st), -EALREADY);
	assert_int_equal(kvc_attend_kvd_dev(gpu, 0, sg, NS, dq, dout, dl, st), -EINVAL);
	assert_int_equal(kvc_prefill_dev(gpu, fresh, 2, dk, dv, 10, 9, st), -EINVAL);
	assert_int_equal(kvc_attend_dev(gpu, LAYERS, sg, NS, dq, dout, dl, st), -EINVAL);
	if (kvc_attend_dev(gpu, 1, sg, NS, dq, dout, dl, st))
		fail_msg("after misuse: %s", kvc_last_error(gpu));
	CU(cudaStreamSynchronize(st));
	assert_int_equal(kvc_seq_free(gpu, fresh), 0);

	for (uint32_t j = 0; j < NS; j++) {
		assert_int_equal(kvc_seq_free(cpu, sc[j]), 0);
		assert_int_equal(kvc_seq_free(gpu, sg[j]), 0);
		for (uint32_t l = 0; l < LAYERS; l++)
			kvd_synth_free(&w[j][l]);
	}
	kvc_close(cpu);
	kvc_close(gpu);
	cudaFree(dk); cudaFree(dv); cudaFree(dtk); cudaFree(dtv); cudaFree(dq); cudaFree(dout);
	cudaFree(dl);
	cudaStreamDestroy(st);
	free(hk); free(hv); free(k0); free(v0); free(tk); free(tv); free(kt); free(vt); free(q);
	free(oc); free(og); free(lc); free(lg);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_host_api_near_exact),
		cmocka_unit_test(test_host_api_sampled),
		cmocka_unit_test(test_device_api_batch),
		cmocka_unit_test(test_fork),
		cmocka_unit_test(test_attach),
		cmocka_unit_test(test_other_device),
#ifdef KVG_EMU
		cmocka_unit_test(test_failed_evictions),
#endif
	};
	int n = 0;
	cudaError_t e = cudaGetDeviceCount(&n);

	if (e != cudaSuccess || n == 0) {
		printf("test_cuda_kvc: no CUDA device: skipped (%s)\n",
		       e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
		return 77;
	}
	return cmocka_run_group_tests(tests, start, stop);
}
