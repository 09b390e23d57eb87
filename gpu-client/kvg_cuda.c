/* libkvclient, CUDA backend.  See kvc.h (the API), kvg.h (the seam with
 * kvc.c), kvt.h (the transport it sits on) and docs/GPU.md (the design).
 *
 * Streams.  The backend owns `cs`: hashing, prefill, evictions and every
 * copy between the device and the arena run there.  The caller's stream
 * (`st`, a cudaStream_t given to each _dev call) gets the work whose results
 * the caller consumes: appending rows, window attention, the merge.  Each
 * call orders the two both ways with events (cs waits for st's inputs; st
 * waits for cs's last work), so any mix of caller streams is safe.  The
 * host-pointer API runs the same code on a second internal stream `hs`.
 *
 * The host blocks only on events of cs (a query or a chunk reaching the
 * arena before its submission; an eviction), on kvd's completions, and on
 * streams of its own in the host-pointer API; never on the device.
 *
 * Arena slots of an ATTEND are still being read by cs (kvd's outputs, host
 * to device) when the call returns; they go back to the transport at the
 * start of the next call (settle()), by which time that copy is long done.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "engine/attn.h"
#include "engine/err.h"
#include "kvc.h"
#include "proto/kvd_ring.h"
#include "kvg.h"
#include "kvg_kern.h"
#include "kvg_plan.h"
#include "kvt.h"

/* A CUDA call that must succeed: otherwise the call fails with -EIO and
 * kvc_last_error() names the call and CUDA's reason. */
#define CK(c, call)                                                                     \
	do {                                                                            \
		cudaError_t ck_ = (call);                                               \
		if (ck_ != cudaSuccess)                                                 \
			return kvt_fail((c), -EIO, "%s: %s", #call, cudaGetErrorString(ck_)); \
	} while (0)

/* The same where a value is being collected rather than returned. */
#define CKR(c, rc, call)                                                                \
	do {                                                                            \
		cudaError_t ck_ = (call);                                               \
		if (ck_ != cudaSuccess && !(rc))                                        \
			(rc) = kvt_fail((c), -EIO, "%s: %s", #call, cudaGetErrorString(ck_)); \
	} while (0)

#define Y_BYTES_MAX (64u << 20)         /* projection scratch: rows per GEMM follow */
#define DEFAULT_MAX_BATCH 256u

struct batch {
	int slot;
	uint32_t first, cnt;
	int submitted;
};

struct kvg_layer {
	uint16_t *k, *v;                /* [H][cap][d] bf16, centered for sparse layers */
	float *mean;                    /* [H][d]; NULL for dense layers */
	uint32_t cap;
	struct kvg_ring ring;           /* dense: nsink 0, R = cap, head 0 */
	int prefilled;                  /* 1 done; -1 started and failed: unusable */
	uint64_t tokens;                /* the layer's length: here and in kvd */
};

struct kvg_seq {
	struct kvg_layer *ly;           /* [layers] */
	uint64_t stamp;                 /* the append call that last saw it */
};

enum { T_HASH0, T_HASH1, T_WIN0, T_WIN1, T_H2D0, T_H2D1, T_MRG0, T_MRG1, T_N };

struct kvg {
	int dev, sms;
	cudaStream_t cs, hs;
	cublasHandle_t blas;
	cudaMemPool_t pool;
	void *map;
	size_t map_size;
	int registered, ready;
	uint32_t max_batch_opt;

	/* the profile */
	uint32_t H, Hq, d, K, L, G, sink, window, layers, cap_win;
	uint32_t chunk, rows_max, per_slot, max_batch;
	struct kvd_attend_layout lay;
	uint64_t rows_payload;          /* APPEND payload of KVG_APPEND_BATCH rows */

	/* device scratch, sized at kvc_profile */
	float *W;                       /* [d][K*L] */
	unsigned char *stg[2];          /* PREFILL payloads, slot_size each */
	unsigned char *estg;            /* evictions: K, V, codes of KVG_EVICT_BATCH seqs */
	float *x, *y;
	size_t x_floats;
	double *mscr;
	uint16_t *qc;                   /* [max_batch][Hq][L] */
	float *kout;                    /* kvd's outputs, max_batch records */
	float *lse;                     /* [max_batch][Hq] when the caller gives none */

	/* host-side */
	struct kvg_rows *rows;          /* [max_batch] descriptors */
	struct kvg_put *put;            /* [max_batch] */
	struct kvg_evict *ev;           /* [KVG_EVICT_BATCH] */
	uint32_t *evs;                  /* [max_batch]: indices of sequences to evict */
	uint32_t npend, *pend;          /* attend slots until ev_out completes */

	cudaEvent_t ev_in, ev_cs, ev_out, ev_user, ev_g, *ev_b;
	uint32_t nev_b;
	int checked_append, checked_attend;
	uint64_t stamp;
	struct batch *bt;               /* [nslots] */

	/* Timing events in two sets used in turn: an attend's sample is read
	 * while the next one records, so the host never waits for a merge. */
	int timing, tcur, tim_pending[2];
	cudaEvent_t te[2][T_N];
	struct kvc_timing t;
};

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---- choosing and opening ------------------------------------------------ */

int kvg_choose(const struct kvc_opts *o, char *msg, size_t len)
{
	int want = kvg_backend_wanted(o, getenv("KVC_BACKEND"), msg, len);
	int dev = o ? o->device : 0, n = 0;
	cudaError_t e;

	if (want < 0 || want == KVC_BACKEND_CPU)
		return want;
	e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess || n <= 0 || dev < 0 || dev >= n) {
		if (want == KVC_BACKEND_AUTO)
			return KVC_BACKEND_CPU;
		if (e != cudaSuccess)
			snprintf(msg, len, "no CUDA device: %s", cudaGetErrorString(e));
		else
			snprintf(msg, len, "no CUDA device %d (%d found)", dev, n);
		return -ENODEV;
	}
	return KVC_BACKEND_CUDA;
}

static int dev_enter(struct kvt *c, struct kvg *g, int *prev);
static int settle(struct kvt *c, struct kvg *g);
static void dev_leave(const struct kvg *g, int prev);

static int open_dev(struct kvt *c, struct kvg *g)
{
	struct cudaMemPoolProps pp;
	uint64_t thr = UINT64_MAX;

	CK(c, cudaDeviceGetAttribute(&g->sms, cudaDevAttrMultiProcessorCount, g->dev));
	CK(c, cudaStreamCreateWithFlags(&g->cs, cudaStreamNonBlocking));
	CK(c, cudaStreamCreateWithFlags(&g->hs, cudaStreamNonBlocking));
	CK(c, cudaEventCreateWithFlags(&g->ev_in, cudaEventDisableTiming));
	CK(c, cudaEventCreateWithFlags(&g->ev_cs, cudaEventDisableTiming));
	CK(c, cudaEventCreateWithFlags(&g->ev_out, cudaEventDisableTiming));
	CK(c, cudaEventCreateWithFlags(&g->ev_user, cudaEventDisableTiming));
	CK(c, cudaEventCreateWithFlags(&g->ev_g, cudaEventDisableTiming));
	for (int i = 0; g->timing && i < 2 * T_N; i++)
		CK(c, cudaEventCreate(&g->te[i / T_N][i % T_N]));
	/* Our own pool: what we free stays cached for the next call instead of
	 * going back to the driver, and the process's default pool is left alone. */
	memset(&pp, 0, sizeof pp);
	pp.allocType = cudaMemAllocationTypePinned;
	pp.location.type = cudaMemLocationTypeDevice;
	pp.location.id = g->dev;
	CK(c, cudaMemPoolCreate(&g->pool, &pp));
	CK(c, cudaMemPoolSetAttribute(g->pool, cudaMemPoolAttrReleaseThreshold, &thr));
	if (cublasCreate(&g->blas) != CUBLAS_STATUS_SUCCESS) {
		g->blas = NULL;
		return kvt_fail(c, -EIO, "cublasCreate failed");
	}
	/* The arena becomes DMA-able: queries, codes and rows go from device
	 * memory straight into kvd's shared memory and outputs come straight
	 * back, with no bounce buffer. */
	CK(c, cudaHostRegister(g->map, g->map_size, cudaHostRegisterDefault));
	g->registered = 1;
	return 0;
}

int kvg_open(struct kvt *c, const struct kvc_opts *o, struct kvg **out)
{
	struct kvg *g = calloc(1, sizeof *g);
	int prev, rc;

	*out = g;
	if (!g)
		return kvt_fail(c, -ENOMEM, "out of memory");
	g->dev = o ? o->device : 0;
	g->timing = o ? o->timing : 0;
	g->max_batch_opt = o && o->max_batch ? o->max_batch : DEFAULT_MAX_BATCH;
	g->map = kvt_map(c, &g->map_size);
	if ((rc = dev_enter(c, g, &prev)))
		return rc;
	rc = open_dev(c, g);
	dev_leave(g, prev);
	return rc;
}

static void dfree(void *p)
{
	if (p)
		(void)cudaFree(p);
}

static void close_dev(struct kvg *g)
{
	/* Everything of ours must be done before memory goes away: our streams,
	 * and what we queued last on a caller's stream. */
	if (g->ev_user)
		(void)cudaEventSynchronize(g->ev_user);
	if (g->cs)
		(void)cudaStreamSynchronize(g->cs);
	if (g->hs)
		(void)cudaStreamSynchronize(g->hs);
	if (g->registered)
		(void)cudaHostUnregister(g->map);
	if (g->blas)
		cublasDestroy(g->blas);
	dfree(g->W);
	dfree(g->stg[0]);
	dfree(g->stg[1]);
	dfree(g->estg);
	dfree(g->x);
	dfree(g->y);
	dfree(g->mscr);
	dfree(g->qc);
	dfree(g->kout);
	dfree(g->lse);
	for (uint32_t i = 0; g->ev_b && i < g->nev_b; i++)
		if (g->ev_b[i])
			(void)cudaEventDestroy(g->ev_b[i]);
	cudaEvent_t evs[] = { g->ev_in, g->ev_cs, g->ev_out, g->ev_user, g->ev_g };

	for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++)
		if (evs[i])
			(void)cudaEventDestroy(evs[i]);
	for (int i = 0; i < 2 * T_N; i++)
		if (g->te[i / T_N][i % T_N])
			(void)cudaEventDestroy(g->te[i / T_N][i % T_N]);
	if (g->pool)
		(void)cudaMemPoolDestroy(g->pool);
	if (g->cs)
		(void)cudaStreamDestroy(g->cs);
	if (g->hs)
		(void)cudaStreamDestroy(g->hs);
}

void kvg_close(struct kvg *g)
{
	int prev = g ? g->dev : 0;

	if (!g)
		return;
	(void)cudaGetDevice(&prev);
	if (prev == g->dev || cudaSetDevice(g->dev) == cudaSuccess)
		close_dev(g);
	dev_leave(g, prev);
	free(g->rows);
	free(g->put);
	free(g->ev);
	free(g->evs);
	free(g->pend);
	free(g->ev_b);
	free(g->bt);
	free(g);
}

static int profile_dev(struct kvt *c, struct kvg *g)
{
	const struct kvd_geom *geo = kvt_geom(c);
	const struct kvc_model *m = kvt_model(c);
	uint32_t nslots = kvt_nslots(c);
	uint64_t ss = kvt_slot_size(c), KL;

	g->H = geo->kv_heads;
	g->Hq = geo->q_heads;
	g->d = geo->d;
	g->K = geo->K;
	g->L = geo->L;
	g->G = g->Hq / g->H;
	g->sink = m->sink;
	g->window = m->window;
	g->layers = m->layers;
	g->cap_win = m->sink + m->window + KVG_APPEND_BATCH;
	if (g->d % 16 || g->d > 256 || g->G > 16 || g->G * g->H != g->Hq)
		return kvt_fail(c, -KVD_EGEOM, "CUDA backend: head_dim %u, group %u not supported",
				 g->d, g->G);
	KL = (uint64_t)g->K * g->L;
	g->chunk = kvd_rows_fit(g->H, g->d, g->L, ss);
	g->per_slot = kvd_attend_fit(g->Hq, g->d, g->L, ss);
	if (g->chunk == 0 || g->per_slot == 0)
		return kvt_fail(c, -EMSGSIZE, "slots of %llu bytes are too small",
				 (unsigned long long)ss);
	g->lay = kvd_attend_layout(g->Hq, g->d, g->L);
	g->max_batch = g->max_batch_opt;
	/* one attend's batches need a slot each at once */
	if ((uint64_t)g->max_batch > (uint64_t)g->per_slot * nslots)
		g->max_batch = g->per_slot * nslots;
	g->rows_max = (uint32_t)(Y_BYTES_MAX / (KL * 4));
	if (g->rows_max < 1)
		g->rows_max = 1;
	g->rows_payload = kvd_rows_bytes(g->H, g->d, g->L, KVG_APPEND_BATCH, 0);
	if (g->rows_payload > ss)
		return kvt_fail(c, -EMSGSIZE, "slots too small for %u appended tokens",
				 KVG_APPEND_BATCH);
	g->x_floats = (size_t)g->H * g->chunk * g->d;
	if (g->x_floats < (size_t)KVG_EVICT_BATCH * g->H * KVG_APPEND_BATCH * g->d)
		g->x_floats = (size_t)KVG_EVICT_BATCH * g->H * KVG_APPEND_BATCH * g->d;

	g->rows = calloc(g->max_batch, sizeof *g->rows);
	g->put = calloc(g->max_batch, sizeof *g->put);
	g->ev = calloc(KVG_EVICT_BATCH, sizeof *g->ev);
	g->evs = calloc(g->max_batch, sizeof *g->evs);
	g->pend = calloc(nslots, sizeof *g->pend);
	g->nev_b = nslots < 2 ? 2 : nslots;
	g->ev_b = calloc(g->nev_b, sizeof *g->ev_b);
	g->bt = calloc(nslots, sizeof *g->bt);
	if (!g->rows || !g->put || !g->ev || !g->evs || !g->pend || !g->ev_b || !g->bt)
		return kvt_fail(c, -ENOMEM, "out of memory");
	for (uint32_t i = 0; i < g->nev_b; i++)
		CK(c, cudaEventCreateWithFlags(&g->ev_b[i], cudaEventDisableTiming));

	/* Scratch is allocated once here, never in the decode loop. */
	CK(c, cudaMalloc((void **)&g->W, KL * g->d * sizeof(float)));
	CK(c, cudaMemcpyAsync(g->W, kvt_w(c), KL * g->d * sizeof(float), cudaMemcpyHostToDevice,
			      g->cs));
	CK(c, cudaStreamSynchronize(g->cs));
	CK(c, cudaMalloc((void **)&g->stg[0], ss));
	CK(c, cudaMalloc((void **)&g->stg[1], ss));
	CK(c, cudaMalloc((void **)&g->estg, (size_t)KVG_EVICT_BATCH * g->rows_payload));
	CK(c, cudaMalloc((void **)&g->x, g->x_floats * sizeof(float)));
	CK(c, cudaMalloc((void **)&g->y, (size_t)g->rows_max * KL * sizeof(float)));
	CK(c, cudaMalloc((void **)&g->mscr, kvg_mean_scratch(g->H, g->d)));
	CK(c, cudaMalloc((void **)&g->qc, (size_t)g->max_batch * g->Hq * g->L * 2));
	CK(c, cudaMalloc((void **)&g->kout, (size_t)g->max_batch * g->lay.out));
	CK(c, cudaMalloc((void **)&g->lse, (size_t)g->max_batch * g->Hq * sizeof(float)));
	/* The 64-byte alignment gaps of a payload are never written by a kernel
	 * but are copied into the arena: zero them once (and keep
	 * compute-sanitizer's initcheck quiet). */
	CK(c, cudaMemsetAsync(g->stg[0], 0, ss, g->cs));
	CK(c, cudaMemsetAsync(g->stg[1], 0, ss, g->cs));
	CK(c, cudaMemsetAsync(g->estg, 0, (size_t)KVG_EVICT_BATCH * g->rows_payload, g->cs));
	CK(c, cudaStreamSynchronize(g->cs));
	g->ready = 1;
	return 0;
}

int kvg_profile(struct kvt *c, struct kvg *g)
{
	int prev, rc = dev_enter(c, g, &prev);

	if (rc)
		return rc;
	rc = profile_dev(c, g);
	dev_leave(g, prev);
	return rc;
}

/* ---- sequences ------------------------------------------------------------- */

static int seq_init(struct kvt *c, struct kvg *g, struct kvg_seq **out)
{
	struct kvg_seq *s = calloc(1, sizeof *s);

	if (s)
		s->ly = calloc(g->layers ? g->layers : 1, sizeof *s->ly);
	if (!s || !s->ly) {
		free(s);
		return kvt_fail(c, -ENOMEM, "out of memory");
	}
	*out = s;
	return 0;
}

void kvg_seq_free(struct kvt *c, struct kvg *g, struct kvg_seq *s)
{
	int prev;

	if (!s)
		return;
	if (dev_enter(c, g, &prev)) {
		/* Freeing on another device is worse than leaking: leak. */
		free(s->ly);
		free(s);
		return;
	}
	/* Stream-ordered frees after the last work that may use the rows: no
	 * device-wide synchronisation (cudaFree would be one). */
	if (cudaStreamWaitEvent(g->cs, g->ev_user, 0) == cudaSuccess) {
		for (uint32_t l = 0; l < g->layers; l++) {
			struct kvg_layer *ly = &s->ly[l];

			if (ly->k)
				(void)cudaFreeAsync(ly->k, g->cs);
			if (ly->v)
				(void)cudaFreeAsync(ly->v, g->cs);
			if (ly->mean)
				(void)cudaFreeAsync(ly->mean, g->cs);
		}
	}
	dev_leave(g, prev);
	free(s->ly);
	free(s);
}

static int seq_state(struct kvt *c, struct kvg *g, struct kvc_seq *s, struct kvg_seq **out)
{
	int rc;

	if (!s->gs && (rc = seq_init(c, g, &s->gs)))
		return rc;
	*out = s->gs;
	return 0;
}

/* ---- common ----------------------------------------------------------------- */

static int dalloc(struct kvt *c, struct kvg *g, void **p, size_t bytes, cudaStream_t st)
{
	CK(c, cudaMallocFromPoolAsync(p, bytes ? bytes : 1, g->pool, st));
	return 0;
}

/* One device buffer of parent's copied into *dst (NULL stays NULL). */
static int dcopy(struct kvt *c, struct kvg *g, void **dst, const void *src, size_t bytes)
{
	int rc;

	*dst = NULL;
	if (!src)
		return 0;
	if ((rc = dalloc(c, g, dst, bytes, g->cs)))
		return rc;
	CK(c, cudaMemcpyAsync(*dst, src, bytes, cudaMemcpyDeviceToDevice, g->cs));
	return 0;
}

/* A layer's K or V storage copied: only the rows that hold tokens (the sinks
 * and the ring's live span, maybe wrapped), since the rest was never written
 * and a copy of it would read uninitialized device memory. */
static int dcopy_rows(struct kvt *c, struct kvg *g, void **dst, const void *src,
		      const struct kvg_layer *ly)
{
	const size_t rowb = (size_t)g->d * 2, pitch = (size_t)ly->cap * rowb;
	const struct kvg_ring *r = &ly->ring;
	uint32_t sinks = ly->tokens < r->nsink ? (uint32_t)ly->tokens : r->nsink;
	uint32_t first = r->count < r->R - r->head ? r->count : r->R - r->head;
	/* {storage row, rows}: sinks, ring head to the end, its wrapped rest */
	const uint32_t span[3][2] = {
		{ 0, sinks }, { r->nsink + r->head, first }, { r->nsink, r->count - first } };
	int rc;

	*dst = NULL;
	if (!src)
		return 0;
	if ((rc = dalloc(c, g, dst, (size_t)g->H * pitch, g->cs)))
		return rc;
	for (int i = 0; i < 3; i++)
		if (span[i][1])
			CK(c, cudaMemcpy2DAsync((char *)*dst + span[i][0] * rowb, pitch,
						(const char *)src + span[i][0] * rowb, pitch,
						span[i][1] * rowb, g->H, cudaMemcpyDeviceToDevice,
						g->cs));
	return 0;
}

int kvg_seq_fork(struct kvt *c, struct kvg *g, const struct kvc_seq *parent,
		 struct kvc_seq *child)
{
	const struct kvg_seq *a = parent->gs;
	struct kvg_seq *b;
	int prev, rc;

	if (!a)
		return 0;               /* nothing of it on the device yet */
	if ((rc = dev_enter(c, g, &prev)))
		return rc;
	if ((rc = seq_init(c, g, &b)))
		goto out;
	/* After whatever the caller's stream still does with the rows. */
	if (cudaStreamWaitEvent(g->cs, g->ev_user, 0) != cudaSuccess)
		rc = kvt_fail(c, -EIO, "fork: cannot order after the caller's stream");
	for (uint32_t l = 0; !rc && l < g->layers; l++) {
		const struct kvg_layer *x = &a->ly[l];
		struct kvg_layer *y = &b->ly[l];

		*y = *x;
		y->k = y->v = NULL;
		y->mean = NULL;
		if ((rc = dcopy_rows(c, g, (void **)&y->k, x->k, x)) ||
		    (rc = dcopy_rows(c, g, (void **)&y->v, x->v, x)) ||
		    (rc = dcopy(c, g, (void **)&y->mean, x->mean, (size_t)g->H * g->d * 4)))
			break;
	}
	if (!rc && cudaStreamSynchronize(g->cs) != cudaSuccess)
		rc = kvt_fail(c, -EIO, "fork: device copies failed");
	if (rc) {
		dev_leave(g, prev);
		kvg_seq_free(c, g, b);
		return rc;
	}
	child->gs = b;
out:
	dev_leave(g, prev);
	return rc;
}

/* ---- prefix sharing ---------------------------------------------------------- */

uint64_t kvg_layer_tokens(const struct kvc_seq *s, uint32_t layer)
{
	return s->gs ? s->gs->ly[layer].tokens : 0;
}

int kvg_layer_prefilled(const struct kvc_seq *s, uint32_t layer)
{
	return s->gs ? s->gs->ly[layer].prefilled : 0;
}

/* Rows [0, n) of a layer in the order the CPU backend keeps them (sinks,
 * then the window oldest first) into host hk, hv [H][n][d], on cs. */
static int rows_to_host(struct kvt *c, struct kvg *g, const struct kvg_layer *ly, uint16_t *hk,
			uint16_t *hv, uint32_t n)
{
	const size_t rowb = (size_t)g->d * 2, hp = (size_t)n * rowb, dp = (size_t)ly->cap * rowb;
	const struct kvg_ring *r = &ly->ring;
	uint32_t first = r->count < r->R - r->head ? r->count : r->R - r->head;

	/* sinks, the ring from its head to the end of storage, its wrapped rest */
	if (r->nsink)
		CK(c, cudaMemcpy2DAsync(hk, hp, ly->k, dp, r->nsink * rowb, g->H,
					cudaMemcpyDeviceToHost, g->cs));
	if (r->nsink)
		CK(c, cudaMemcpy2DAsync(hv, hp, ly->v, dp, r->nsink * rowb, g->H,
					cudaMemcpyDeviceToHost, g->cs));
	if (first) {
		CK(c, cudaMemcpy2DAsync((char *)hk + r->nsink * rowb, hp,
					(const char *)ly->k + (r->nsink + r->head) * rowb, dp,
					first * rowb, g->H, cudaMemcpyDeviceToHost, g->cs));
		CK(c, cudaMemcpy2DAsync((char *)hv + r->nsink * rowb, hp,
					(const char *)ly->v + (r->nsink + r->head) * rowb, dp,
					first * rowb, g->H, cudaMemcpyDeviceToHost, g->cs));
	}
	if (r->count > first) {
		CK(c, cudaMemcpy2DAsync((char *)hk + (r->nsink + first) * rowb, hp,
					(const char *)ly->k + r->nsink * rowb, dp,
					(r->count - first) * rowb, g->H, cudaMemcpyDeviceToHost, g->cs));
		CK(c, cudaMemcpy2DAsync((char *)hv + (r->nsink + first) * rowb, hp,
					(const char *)ly->v + r->nsink * rowb, dp,
					(r->count - first) * rowb, g->H, cudaMemcpyDeviceToHost, g->cs));
	}
	return 0;
}

int kvg_seq_publish(struct kvt *c, struct kvg *g, struct kvc_seq *s, const uint8_t *key)
{
	const struct kvg_seq *gs = s->gs;
	uint16_t *hk = NULL, *hv = NULL;
	uint64_t tokens;
	int prev, rc;

	if (!gs)
		return kvt_fail(c, -EINVAL, "publish: nothing prefilled");
	tokens = gs->ly[0].tokens;
	for (uint32_t l = 0; l < g->layers; l++) {
		if (gs->ly[l].prefilled <= 0)
			return kvt_fail(c, -EINVAL, "publish: layer %u not prefilled", l);
		if (gs->ly[l].tokens != tokens)
			return kvt_fail(c, -EINVAL, "publish: layer %u has %llu tokens, layer 0 %llu", l,
					(unsigned long long)gs->ly[l].tokens,
					(unsigned long long)tokens);
	}
	if ((rc = dev_enter(c, g, &prev)))
		return rc;
	if ((rc = settle(c, g)))
		goto out;
	/* After whatever the caller's stream still does with the rows. */
	CKR(c, rc, cudaStreamWaitEvent(g->cs, g->ev_user, 0));
	for (uint32_t l = 0; !rc && l < g->layers; l++) {
		const struct kvg_layer *ly = &gs->ly[l];
		uint32_t n = ly->ring.nsink + ly->ring.count;
		size_t bytes = (size_t)g->H * n * g->d * 2;

		if (!n)
			continue;
		free(hk);
		free(hv);
		hk = malloc(bytes);
		hv = malloc(bytes);
		if (!hk || !hv) {
			rc = kvt_fail(c, -ENOMEM, "out of memory");
			break;
		}
		if ((rc = rows_to_host(c, g, ly, hk, hv, n)))
			break;
		CKR(c, rc, cudaStreamSynchronize(g->cs));
		if (!rc)
			rc = kvt_local_put(c, s->id, l, hk, hv, n, n);
	}
	free(hk);
	free(hv);
	if (!rc)
		rc = kvt_seq_publish(c, s->id, key, tokens);
out:
	dev_leave(g, prev);
	return rc;
}

int kvg_seq_attached(struct kvt *c, struct kvg *g, struct kvc_seq *s, uint64_t tokens,
		     const uint32_t *rows)
{
	const size_t rowb = (size_t)g->d * 2;
	uint16_t *hk = NULL, *hv = NULL;
	float *hm = NULL;
	struct kvg_seq *gs;
	int prev, rc;

	if ((rc = dev_enter(c, g, &prev)))
		return rc;
	if ((rc = seq_state(c, g, s, &gs)))
		goto out;
	if (!(hm = malloc((size_t)g->H * g->d * sizeof *hm))) {
		rc = kvt_fail(c, -ENOMEM, "out of memory");
		goto out;
	}
	for (uint32_t l = 0; !rc && l < g->layers; l++) {
		struct kvg_layer *ly = &gs->ly[l];
		int dense = kvt_dense(c, l);
		uint32_t n = rows[l], nsink = dense ? 0 : (uint32_t)(tokens < g->sink ? tokens : g->sink);
		uint32_t cap = 64;

		if (dense) {
			while (cap < n + 1)
				cap *= 2;
		} else {
			cap = g->cap_win;
			if (n < nsink || n - nsink >= cap - nsink) {
				rc = kvt_fail(c, -KVD_EPROTO, "attach: layer %u: %u rows for a window "
					      "of %u", l, n, cap);
				break;
			}
		}
		ly->prefilled = -1;     /* until it is complete */
		ly->cap = cap;
		ly->ring = (struct kvg_ring){ nsink, cap - nsink, 0, n - nsink };
		ly->tokens = tokens;
		if ((rc = dalloc(c, g, (void **)&ly->k, (size_t)g->H * cap * rowb, g->cs)) ||
		    (rc = dalloc(c, g, (void **)&ly->v, (size_t)g->H * cap * rowb, g->cs)) ||
		    (!dense && (rc = dalloc(c, g, (void **)&ly->mean, (size_t)g->H * g->d * 4, g->cs))))
			break;
		free(hk);
		free(hv);
		hk = malloc((size_t)g->H * (n ? n : 1) * rowb);
		hv = malloc((size_t)g->H * (n ? n : 1) * rowb);
		if (!hk || !hv) {
			rc = kvt_fail(c, -ENOMEM, "out of memory");
			break;
		}
		if (n && (rc = kvt_local_get(c, s->id, l, dense ? NULL : hm, hk, hv, n, n)))
			break;
		if (n) {
			CKR(c, rc, cudaMemcpy2DAsync(ly->k, cap * rowb, hk, n * rowb, n * rowb, g->H,
						     cudaMemcpyHostToDevice, g->cs));
			CKR(c, rc, cudaMemcpy2DAsync(ly->v, cap * rowb, hv, n * rowb, n * rowb, g->H,
						     cudaMemcpyHostToDevice, g->cs));
		}
		if (!dense)
			CKR(c, rc, cudaMemcpyAsync(ly->mean, hm, (size_t)g->H * g->d * 4,
						   cudaMemcpyHostToDevice, g->cs));
		/* the host buffers are reused: the copies must have read them */
		CKR(c, rc, cudaStreamSynchronize(g->cs));
		if (!rc)
			ly->prefilled = 1;
	}
out:
	free(hk);
	free(hv);
	free(hm);
	dev_leave(g, prev);
	return rc;
}

/* Accumulates the GPU times of an attend (opts.timing) from event set
 * `set`; without `block`, only once they have completed. */
static void tim_collect(struct kvg *g, int set, int block)
{
	cudaEvent_t *te = g->te[set];
	float ms[T_N / 2];

	if (!g->tim_pending[set])
		return;
	if (!block && (cudaEventQuery(te[T_MRG1]) != cudaSuccess ||
		       cudaEventQuery(te[T_H2D1]) != cudaSuccess))
		return;
	g->tim_pending[set] = 0;
	if (cudaEventSynchronize(te[T_MRG1]) != cudaSuccess ||
	    cudaEventSynchronize(te[T_H2D1]) != cudaSuccess)
		return;
	for (int i = 0; i < T_N / 2; i++)
		if (cudaEventElapsedTime(&ms[i], te[2 * i], te[2 * i + 1]) != cudaSuccess)
			ms[i] = 0.0f;
	g->t.hash_ms += ms[0];
	g->t.window_ms += ms[1];
	g->t.h2d_ms += ms[2];
	g->t.merge_ms += ms[3];
}

/* An attend takes the set its predecessor did not use; that set's sample
 * is two attends old and done in practice, so the wait is a formality. */
static void tim_begin(struct kvg *g)
{
	if (!g->timing)
		return;
	g->tcur ^= 1;
	tim_collect(g, g->tcur, 1);
}

static void tim(struct kvg *g, int which, cudaStream_t st)
{
	if (g->timing)
		(void)cudaEventRecord(g->te[g->tcur][which], st);
}

/* Hands back the slots of the previous attend once its copy out of them is
 * done (it is, in practice: this only makes sure). */
static int settle(struct kvt *c, struct kvg *g)
{
	if (g->npend) {
		CK(c, cudaEventSynchronize(g->ev_out));
		for (uint32_t i = 0; i < g->npend; i++)
			kvt_slot_put(c, g->pend[i]);
		g->npend = 0;
	}
	if (g->timing) {
		tim_collect(g, 0, 0);
		tim_collect(g, 1, 0);
	}
	return 0;
}

/* Orders cs after the caller's stream, and the caller's stream after cs. */
static int join(struct kvt *c, struct kvg *g, cudaStream_t st)
{
	CK(c, cudaEventRecord(g->ev_in, st));
	CK(c, cudaStreamWaitEvent(g->cs, g->ev_in, 0));
	/* our last work on a caller's stream (maybe another one): the merge
	 * reading kout, attention reading rows an eviction may recycle */
	CK(c, cudaStreamWaitEvent(g->cs, g->ev_user, 0));
	CK(c, cudaEventRecord(g->ev_cs, g->cs));
	CK(c, cudaStreamWaitEvent(st, g->ev_cs, 0));
	return 0;
}

static int done_user(struct kvt *c, struct kvg *g, cudaStream_t st)
{
	CK(c, cudaEventRecord(g->ev_user, st));
	return 0;
}

static int check_ptr(struct kvt *c, const void *p, const char *what)
{
	struct cudaPointerAttributes a;
	cudaError_t e = cudaPointerGetAttributes(&a, p);

	if (e != cudaSuccess)
		return kvt_fail(c, -EFAULT, "%s: %s", what, cudaGetErrorString(e));
	if (a.type == cudaMemoryTypeUnregistered)
		return kvt_fail(c, -EFAULT, "%s is host memory, not device memory", what);
	return 0;
}

static int check_common(struct kvt *c, struct kvg *g, uint32_t layer, const char *fn)
{
	if (!g)
		return kvt_fail(c, -ENOTSUP, "%s: this connection uses the CPU backend", fn);
	if (!kvt_model(c) || !g->ready)
		return kvt_fail(c, -EINVAL, "%s: no profile yet", fn);
	if (layer >= g->layers)
		return kvt_fail(c, -EINVAL, "layer %u out of range", layer);
	return 0;
}

/* Makes g's device current for the calling thread; *prev is the one to give
 * back with dev_leave.  cudaGetDevice/cudaSetDevice are host-side and cheap
 * when nothing changes. */
static int dev_enter(struct kvt *c, struct kvg *g, int *prev)
{
	cudaError_t e = cudaGetDevice(prev);

	if (e == cudaSuccess && *prev != g->dev)
		e = cudaSetDevice(g->dev);
	if (e != cudaSuccess)
		return kvt_fail(c, -EIO, "cudaSetDevice(%d): %s", g->dev, cudaGetErrorString(e));
	return 0;
}

static void dev_leave(const struct kvg *g, int prev)
{
	if (prev != g->dev)
		(void)cudaSetDevice(prev);
}

/* ---- prefill ------------------------------------------------------------------ */

/* Enqueues the building of the payload of tokens [t, t+cnt) in stg. */
static int prefill_chunk(struct kvt *c, struct kvg *g, const struct kvg_layer *ly,
			 const void *k, const void *v, int dtype, uint32_t n, uint32_t t,
			 uint32_t cnt, int first, unsigned char *stg)
{
	const struct kvd_rows_layout rl = kvd_rows_layout(g->H, g->d, g->L, cnt, first);
	struct kvg_code_layout lay = { cnt ? cnt : 1, g->L * cnt, cnt, 1 };
	char err[128];
	int rc;

	if (first)
		CK(c, cudaMemcpyAsync(stg, ly->mean, (size_t)g->H * g->d * 4, cudaMemcpyDeviceToDevice,
				      g->cs));
	if (cnt) {
		CK(c, kvg_rows(k, v, dtype, g->H, n, g->d, t, cnt, ly->mean, (uint16_t *)(stg + rl.k),
			       (uint16_t *)(stg + rl.v), cnt, 0, g->x, g->cs));
		rc = kvg_hash_rows(g->blas, g->W, g->d, g->K, g->L, g->x, g->H * cnt, g->y,
				   g->rows_max, &lay, (uint16_t *)(stg + rl.codes), g->cs, err,
				   sizeof err);
		if (rc)
			return kvt_fail(c, rc, "prefill: %s", err);
	}
	return 0;
}

static int prefill(struct kvt *c, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		   const void *k, const void *v, uint32_t n, int dtype, cudaStream_t st)
{
	struct kvg_seq *gs;
	struct kvg_layer *ly;
	uint32_t lo, hi;
	int rc = check_common(c, g, layer, "prefill");
	double t0 = now_ms();

	if (rc || (rc = settle(c, g)) || (rc = seq_state(c, g, s, &gs)))
		return rc;
	if (dtype != KVC_F32 && dtype != KVC_BF16)
		return kvt_fail(c, -EINVAL, "prefill: dtype %d", dtype);
	if (n && ((rc = check_ptr(c, k, "prefill: k")) || (rc = check_ptr(c, v, "prefill: v"))))
		return rc;
	ly = &gs->ly[layer];
	if (ly->prefilled)
		return kvt_fail(c, -EALREADY, ly->prefilled > 0 ? "layer %u already prefilled"
				 : "layer %u: an earlier prefill of it failed", layer);
	/* Until it is complete: whatever fails below leaves the layer refused
	 * by append and attend rather than half built. */
	ly->prefilled = -1;
	if ((rc = join(c, g, st)))
		return rc;

	if (kvt_dense(c, layer)) {
		uint32_t cap = 64;

		while (cap < n + 1)
			cap *= 2;
		if ((rc = dalloc(c, g, (void **)&ly->k, (size_t)g->H * cap * g->d * 2, g->cs)) ||
		    (rc = dalloc(c, g, (void **)&ly->v, (size_t)g->H * cap * g->d * 2, g->cs)))
			return rc;
		ly->cap = cap;
		ly->ring = (struct kvg_ring){ 0, cap, 0, n };
		ly->tokens = n;
		CK(c, kvg_rows(k, v, dtype, g->H, n, g->d, 0, n, NULL, ly->k, ly->v, cap, 0, NULL,
			       g->cs));
		CK(c, cudaEventRecord(g->ev_cs, g->cs));
		CK(c, cudaStreamWaitEvent(st, g->ev_cs, 0));
		if ((rc = done_user(c, g, st)))
			return rc;
		ly->prefilled = 1;
		g->t.prefills++;
		g->t.prefill_ms += now_ms() - t0;
		return 0;
	}

	uint32_t nsink = n < g->sink ? n : g->sink;

	lo = nsink;
	hi = n - lo > g->window ? n - g->window : lo;
	ly->cap = g->cap_win;
	ly->ring = (struct kvg_ring){ nsink, g->cap_win - nsink, 0, n - hi };
	ly->tokens = n;
	if ((rc = dalloc(c, g, (void **)&ly->k, (size_t)g->H * ly->cap * g->d * 2, g->cs)) ||
	    (rc = dalloc(c, g, (void **)&ly->v, (size_t)g->H * ly->cap * g->d * 2, g->cs)) ||
	    (rc = dalloc(c, g, (void **)&ly->mean, (size_t)g->H * g->d * 4, g->cs)))
		return rc;
	CK(c, kvg_mean(k, dtype, g->H, n, g->d, lo, hi, ly->mean, g->mscr, g->cs));
	CK(c, kvg_rows(k, v, dtype, g->H, n, g->d, 0, lo, ly->mean, ly->k, ly->v, ly->cap, 0, NULL,
		       g->cs));
	CK(c, kvg_rows(k, v, dtype, g->H, n, g->d, hi, n - hi, ly->mean, ly->k, ly->v, ly->cap,
		       nsink, NULL, g->cs));

	/* Chunks as the CPU backend cuts them (an empty first-and-last one when
	 * nothing is offloaded: kvd still gets the mean).  Chunk i is built in
	 * stg[i % 2] while the host submits chunk i-1, then copied into its
	 * slot; at most one slot is held unsubmitted, so one slot is enough. */
	struct kvd_sqe prev;
	int have_prev = 0, i = 0;

	for (uint32_t t = lo; t < hi || t == lo; t += g->chunk, i++) {
		uint32_t cnt = hi - t < g->chunk ? hi - t : g->chunk;
		int first = t == lo, last = t + cnt >= hi, slot;
		uint64_t len = kvd_rows_bytes(g->H, g->d, g->L, cnt, first);

		if ((rc = prefill_chunk(c, g, ly, k, v, dtype, n, t, cnt, first, g->stg[i % 2])))
			goto fail;
		if (have_prev) {
			CKR(c, rc, cudaEventSynchronize(g->ev_b[(i - 1) % 2]));
			if (rc || (rc = kvt_submit(c, &prev)))
				goto fail;
			have_prev = 0;
		}
		if ((slot = kvt_slot_get(c, 1)) < 0) {
			rc = slot;
			goto fail;
		}
		rc = 0;
		CKR(c, rc, cudaMemcpyAsync(kvt_slot(c, (uint32_t)slot), g->stg[i % 2], len,
					   cudaMemcpyDeviceToHost, g->cs));
		CKR(c, rc, cudaEventRecord(g->ev_b[i % 2], g->cs));
		if (rc) {
			/* never submitted: hand it back once cs is idle */
			(void)cudaStreamSynchronize(g->cs);
			kvt_slot_put(c, (uint32_t)slot);
			goto fail;
		}
		prev = (struct kvd_sqe){
			.op = KVD_OP_PREFILL, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
			.user_data = (uint64_t)slot, .seq = s->id, .len = (uint32_t)len,
			.ntok = cnt,
			.flags = (uint8_t)((first ? KVD_RF_MEAN : 0) | (last ? KVD_RF_LAST : 0)),
		};
		have_prev = 1;
		if (last)
			break;
	}
	CKR(c, rc, cudaEventSynchronize(g->ev_b[i % 2]));
	if (rc || (rc = kvt_submit(c, &prev)))
		goto fail;
	have_prev = 0;
	/* Every read of k and v is done: the caller may reuse them now. */
	CKR(c, rc, cudaEventRecord(g->ev_cs, g->cs));
	CKR(c, rc, cudaStreamWaitEvent(st, g->ev_cs, 0));
	if (rc || (rc = done_user(c, g, st)))
		goto fail;
	rc = kvt_drain(c, "prefill");
	if (!rc)
		ly->prefilled = 1;
	g->t.prefills++;
	g->t.prefill_ms += now_ms() - t0;
	return rc;
fail:
	if (have_prev) {
		/* built and copied but not submitted */
		(void)cudaStreamSynchronize(g->cs);
		kvt_slot_put(c, prev.slot);
	}
	(void)kvt_drain(c, "prefill");
	return rc;
}

/* ---- append --------------------------------------------------------------------- */

/* Dense layers keep every row: double the storage (stream-ordered on cs). */
static int grow(struct kvt *c, struct kvg *g, struct kvg_layer *ly)
{
	uint32_t cap = ly->cap * 2;
	uint16_t *nk, *nv;
	size_t rowb = (size_t)g->d * 2;
	int rc;

	if ((rc = dalloc(c, g, (void **)&nk, (size_t)g->H * cap * rowb, g->cs)))
		return rc;
	if ((rc = dalloc(c, g, (void **)&nv, (size_t)g->H * cap * rowb, g->cs))) {
		(void)cudaFreeAsync(nk, g->cs);
		return rc;
	}
	CK(c, cudaMemcpy2DAsync(nk, cap * rowb, ly->k, ly->cap * rowb, ly->ring.count * rowb, g->H,
				cudaMemcpyDeviceToDevice, g->cs));
	CK(c, cudaMemcpy2DAsync(nv, cap * rowb, ly->v, ly->cap * rowb, ly->ring.count * rowb, g->H,
				cudaMemcpyDeviceToDevice, g->cs));
	CK(c, cudaFreeAsync(ly->k, g->cs));
	CK(c, cudaFreeAsync(ly->v, g->cs));
	ly->k = nk;
	ly->v = nv;
	ly->cap = cap;
	ly->ring.R = cap;
	return 0;
}

/* Sends the oldest KVG_APPEND_BATCH rows of layer `layer` of seqs[evs[0..nev)]
 * to kvd (nev <= KVG_EVICT_BATCH): gather on cs, hash, then the payloads go
 * into slots a group at a time, with one host wait per group.  A sequence's
 * rows leave its ring only once their APPEND is submitted: after a failure
 * the others keep theirs (a full ring), and the next append sends them
 * before it writes anything. */
static int evict(struct kvt *c, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		 const uint32_t *evs, uint32_t nev, cudaStream_t st)
{
	const uint32_t B = KVG_APPEND_BATCH, H = g->H, d = g->d, L = g->L;
	size_t kvb = (size_t)nev * H * B * d * 2;
	uint16_t *Kall = (uint16_t *)g->estg, *Vall = Kall + kvb / 2, *Call = Vall + kvb / 2;
	struct kvg_code_layout lay = { B, L * B, B, 1 };
	const struct kvd_rows_layout rl = kvd_rows_layout(H, d, L, B, 0);
	/* Slots held unsubmitted cannot complete: leave the rest of the arena
	 * to the completions kvt_slot_get may have to wait for. */
	uint32_t group = kvt_nslots(c) / 2 ? kvt_nslots(c) / 2 : 1;
	int slots[KVG_EVICT_BATCH];
	char err[128];
	int rc;

	for (uint32_t j = 0; j < nev; j++) {
		const struct kvg_layer *ly = &seqs[evs[j]]->gs->ly[layer];

		g->ev[j] = (struct kvg_evict){
			.k = ly->k, .v = ly->v, .kb = Kall + (size_t)j * H * B * d,
			.vb = Vall + (size_t)j * H * B * d, .cap = ly->cap, .nsink = ly->ring.nsink,
			.head = ly->ring.head,
		};
	}
	/* the rows are read only after the appends that precede them on st */
	CK(c, cudaEventRecord(g->ev_in, st));
	CK(c, cudaStreamWaitEvent(g->cs, g->ev_in, 0));
	CK(c, kvg_gather(g->ev, nev, H, d, B, g->x, g->cs));
	/* ... and later appends on st may overwrite them only after the gather */
	CK(c, cudaEventRecord(g->ev_g, g->cs));
	CK(c, cudaStreamWaitEvent(st, g->ev_g, 0));
	rc = kvg_hash_rows(g->blas, g->W, d, g->K, L, g->x, nev * H * B, g->y, g->rows_max, &lay,
			   Call, g->cs, err, sizeof err);
	if (rc)
		return kvt_fail(c, rc, "append: %s", err);
	for (uint32_t j0 = 0; j0 < nev; j0 += group) {
		uint32_t cnt = nev - j0 < group ? nev - j0 : group, got = 0;

		rc = 0;
		while (got < cnt && !rc) {
			uint32_t j = j0 + got;
			int slot = kvt_slot_get(c, 1);
			char *base;

			if (slot < 0) {
				rc = slot;
				break;
			}
			slots[got++] = slot;
			base = kvt_slot(c, (uint32_t)slot);
			CKR(c, rc, cudaMemcpyAsync(base + rl.k, Kall + (size_t)j * H * B * d,
						   (size_t)H * B * d * 2, cudaMemcpyDeviceToHost, g->cs));
			CKR(c, rc, cudaMemcpyAsync(base + rl.v, Vall + (size_t)j * H * B * d,
						   (size_t)H * B * d * 2, cudaMemcpyDeviceToHost, g->cs));
			CKR(c, rc, cudaMemcpyAsync(base + rl.codes, Call + (size_t)j * H * L * B,
						   (size_t)H * L * B * 2, cudaMemcpyDeviceToHost, g->cs));
		}
		CKR(c, rc, cudaEventRecord(g->ev_b[0], g->cs));
		CKR(c, rc, cudaEventSynchronize(g->ev_b[0]));
		if (rc) {
			/* never submitted: back once cs no longer writes them */
			(void)cudaStreamSynchronize(g->cs);
			for (uint32_t i = 0; i < got; i++)
				kvt_slot_put(c, (uint32_t)slots[i]);
			return rc;
		}
		for (uint32_t i = 0; i < cnt; i++) {
			struct kvg_layer *ly = &seqs[evs[j0 + i]]->gs->ly[layer];
			struct kvd_sqe e = {
				.op = KVD_OP_APPEND, .layer = (uint16_t)layer, .slot = (uint32_t)slots[i],
				.user_data = (uint64_t)slots[i], .seq = seqs[evs[j0 + i]]->id,
				.len = (uint32_t)g->rows_payload, .ntok = B,
			};

			if ((rc = kvt_submit(c, &e))) {
				for (uint32_t k = i; k < cnt; k++)
					kvt_slot_put(c, (uint32_t)slots[k]);
				return rc;
			}
			kvg_ring_drop(&ly->ring, B);
			g->t.evicted++;
		}
	}
	return 0;
}

static int append(struct kvt *c, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		  uint32_t nseq, const void *k, const void *v, int dtype, cudaStream_t st)
{
	int rc = check_common(c, g, layer, "append"), dense, drain = 0, r2;
	size_t per;

	if (rc || (rc = settle(c, g)))
		return rc;
	per = (size_t)g->H * g->d * (dtype == KVC_BF16 ? 2 : 4);
	if (dtype != KVC_F32 && dtype != KVC_BF16)
		return kvt_fail(c, -EINVAL, "append: dtype %d", dtype);
	if (nseq == 0)
		return 0;
	if (!g->checked_append) {
		if ((rc = check_ptr(c, k, "append: k")) || (rc = check_ptr(c, v, "append: v")))
			return rc;
		g->checked_append = 1;
	}
	dense = kvt_dense(c, layer);
	g->stamp++;
	for (uint32_t j = 0; j < nseq; j++) {
		struct kvg_seq *gs = seqs[j]->gs;

		if (!gs || gs->ly[layer].prefilled != 1)
			return kvt_fail(c, -EINVAL, "layer %u of sequence %u: %s", layer, j,
					 gs && gs->ly[layer].prefilled ? "its prefill failed"
					 : "append before prefill");
		if (gs->stamp == g->stamp)
			return kvt_fail(c, -EINVAL, "append: sequence %u twice in a batch", j);
		gs->stamp = g->stamp;
	}
	if ((rc = join(c, g, st)))
		return rc;
	for (uint32_t j0 = 0; j0 < nseq && !rc; j0 += g->max_batch) {
		uint32_t cnt = nseq - j0 < g->max_batch ? nseq - j0 : g->max_batch, nev = 0;
		int grew = 0;
		double t0 = now_ms(), t1;

		/* A ring that a failed eviction left full sends its oldest rows
		 * before anything overwrites them. */
		for (uint32_t j = 0; j < cnt && !dense; j++) {
			const struct kvg_ring *r = &seqs[j0 + j]->gs->ly[layer].ring;

			if (r->count >= r->R)
				g->evs[nev++] = j0 + j;
		}
		for (uint32_t i = 0; i < nev && !rc; i += KVG_EVICT_BATCH)
			rc = evict(c, g, layer, seqs, g->evs + i,
				   nev - i < KVG_EVICT_BATCH ? nev - i : KVG_EVICT_BATCH, st);
		drain |= nev > 0;
		g->t.evict_ms += now_ms() - t0;
		if (rc)
			break;
		nev = 0;
		for (uint32_t j = 0; j < cnt && !rc; j++) {
			struct kvg_layer *ly = &seqs[j0 + j]->gs->ly[layer];

			if (dense && ly->ring.count == ly->cap) {
				if ((rc = grow(c, g, ly)))
					break;
				grew = 1;
			}
			g->put[j] = (struct kvg_put){
				.k = ly->k, .v = ly->v, .mean = ly->mean, .cap = ly->cap,
				.row = kvg_ring_tail(&ly->ring),
			};
			ly->ring.count++;
			ly->tokens++;
			if (!dense && kvg_ring_must_evict(&ly->ring, g->window))
				g->evs[nev++] = j0 + j;
		}
		if (grew) {
			CKR(c, rc, cudaEventRecord(g->ev_cs, g->cs));
			CKR(c, rc, cudaStreamWaitEvent(st, g->ev_cs, 0));
		}
		if (rc)
			break;
		CKR(c, rc, kvg_append((const char *)k + j0 * per, (const char *)v + j0 * per, dtype,
				      g->put, cnt, g->H, g->d, st));
		/* Rows leaving the window go to kvd (every 32 steps per sequence). */
		t1 = now_ms();
		for (uint32_t i = 0; i < nev && !rc; i += KVG_EVICT_BATCH)
			rc = evict(c, g, layer, seqs, g->evs + i,
				   nev - i < KVG_EVICT_BATCH ? nev - i : KVG_EVICT_BATCH, st);
		drain |= nev > 0;
		g->t.evict_ms += now_ms() - t1;
	}
	if (drain) {
		r2 = kvt_drain(c, "append");
		rc = rc ? rc : r2;
	}
	g->t.appends++;
	/* Also after a failure: a later join or free must wait for whatever
	 * this call queued on st. */
	r2 = done_user(c, g, st);
	return rc ? rc : r2;
}

/* ---- attend ----------------------------------------------------------------------- */

/* One sub-batch of at most g->max_batch sequences. */
static int attend_some(struct kvt *c, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		       uint32_t nseq, const float *q, float *o, float *lse, int kvd_only,
		       cudaStream_t st)
{
	const uint32_t Hq = g->Hq, d = g->d, L = g->L;
	const int dense = kvt_dense(c, layer);
	struct batch *b = g->bt;
	uint32_t nb = 0, max_rows = 0;
	struct kvg_code_layout qlay = { 1, L, 1, 0 };
	float *part = NULL;
	char err[128];
	int rc = 0;

	if (!lse)
		lse = g->lse;
	tim_begin(g);
	if ((rc = join(c, g, st)))
		return rc;

	if (!dense) {
		/* The query's codes, then each record's q and codes straight into
		 * its slot (two strided DMAs per slot). */
		tim(g, T_HASH0, g->cs);
		rc = kvg_hash_rows(g->blas, g->W, d, g->K, L, q, nseq * Hq, g->y, g->rows_max, &qlay,
				   g->qc, g->cs, err, sizeof err);
		if (rc)
			return kvt_fail(c, rc, "attend: %s", err);
		for (uint32_t first = 0; first < nseq; first += g->per_slot) {
			uint32_t cnt = nseq - first < g->per_slot ? nseq - first : g->per_slot;
			int slot = kvt_slot_get(c, 0);
			char *base;

			if (slot < 0) {
				rc = slot;
				goto out;
			}
			b[nb] = (struct batch){ slot, first, cnt, 0 };
			nb++;
			base = kvt_slot(c, (uint32_t)slot);
			for (uint32_t j = 0; j < cnt; j++) {
				uint64_t id = seqs[first + j]->id;

				memset(base + j * g->lay.in, 0, KVD_ATTEND_HDR);
				memcpy(base + j * g->lay.in, &id, sizeof id);
			}
			CKR(c, rc, cudaMemcpy2DAsync(base + g->lay.q_off, g->lay.in,
						     q + (size_t)first * Hq * d, (size_t)Hq * d * 4,
						     (size_t)Hq * d * 4, cnt, cudaMemcpyDeviceToHost,
						     g->cs));
			CKR(c, rc, cudaMemcpy2DAsync(base + g->lay.codes_off, g->lay.in,
						     g->qc + (size_t)first * Hq * L, (size_t)Hq * L * 2,
						     (size_t)Hq * L * 2, cnt, cudaMemcpyDeviceToHost,
						     g->cs));
			CKR(c, rc, cudaEventRecord(g->ev_b[nb - 1], g->cs));
			if (rc)
				goto out;
		}
		tim(g, T_HASH1, g->cs);
	}

	/* The GPU's exact part over sinks + window runs while kvd samples. */
	if (!kvd_only) {
		struct kvg_attn_plan plan;

		for (uint32_t j = 0; j < nseq; j++) {
			const struct kvg_layer *ly = &seqs[j]->gs->ly[layer];

			g->rows[j] = (struct kvg_rows){ ly->k, ly->v, ly->cap, ly->ring.nsink,
							ly->ring.head, ly->ring.count };
			if (kvg_rows_n(&g->rows[j]) > max_rows)
				max_rows = kvg_rows_n(&g->rows[j]);
		}
		kvg_attn_plan(max_rows, nseq, g->H, Hq, d, 4u * (uint32_t)g->sms, &plan);
		if (plan.part_floats) {
			CKR(c, rc, cudaMallocFromPoolAsync((void **)&part,
							   plan.part_floats * sizeof(float), g->pool, st));
			if (rc)
				goto out;
		}
		tim(g, T_WIN0, st);
		CKR(c, rc, kvg_attn(q, g->rows, nseq, Hq, g->H, d, &plan, o, lse, part, st));
		tim(g, T_WIN1, st);
		if (part)
			CKR(c, rc, cudaFreeAsync(part, st));
		if (rc)
			goto out;
	}
	if (dense)
		goto out;

	/* Submit each batch as soon as its records are in the arena. */
	for (uint32_t i = 0; i < nb; i++) {
		double t0 = now_ms();
		struct kvd_sqe e = {
			.op = KVD_OP_ATTEND, .layer = (uint16_t)layer, .slot = (uint32_t)b[i].slot,
			.user_data = (uint64_t)b[i].slot, .len = (uint32_t)(b[i].cnt * g->lay.in),
			.nseq = b[i].cnt, .out_off = (uint32_t)kvd_attend_out_off(&g->lay, b[i].cnt),
			.out_len = (uint32_t)(b[i].cnt * g->lay.out),
		};

		CKR(c, rc, cudaEventSynchronize(g->ev_b[i]));
		g->t.gpu_wait_ms += now_ms() - t0;
		if (rc || (rc = kvt_submit(c, &e)))
			goto out;
		b[i].submitted = 1;
	}
	/* kvd's answers come straight back from the arena.  (With several
	 * batches, h2d_ms also counts cs idling while kvd finishes the next.) */
	for (uint32_t i = 0; i < nb; i++) {
		double t0 = now_ms();
		int32_t res;
		const char *msg;
		int r2 = kvt_wait_slot(c, (uint32_t)b[i].slot, &res, &msg);

		g->t.kvd_wait_ms += now_ms() - t0;
		if (r2)
			return r2;              /* the ring is broken: nothing more to do */
		b[i].submitted = 0;
		if (res < 0 && !rc)
			rc = kvt_fail(c, res, "attend: kvd: %s", msg);
		if (rc)
			continue;
		if (i == 0)
			tim(g, T_H2D0, g->cs);
		CKR(c, rc, cudaMemcpyAsync((char *)g->kout + (size_t)b[i].first * g->lay.out,
					   (char *)kvt_slot(c, (uint32_t)b[i].slot) +
					   kvd_attend_out_off(&g->lay, b[i].cnt),
					   (size_t)b[i].cnt * g->lay.out, cudaMemcpyHostToDevice, g->cs));
	}
	tim(g, T_H2D1, g->cs);
	CKR(c, rc, cudaEventRecord(g->ev_out, g->cs));
	if (rc)
		goto out;
	/* the slots go back once ev_out has completed (settle) */
	for (uint32_t i = 0; i < nb; i++)
		g->pend[g->npend++] = (uint32_t)b[i].slot;
	nb = 0;
	CKR(c, rc, cudaStreamWaitEvent(st, g->ev_out, 0));
	tim(g, T_MRG0, st);
	CKR(c, rc, kvg_merge(o, lse, g->kout, g->lay.out / 4, g->lay.lse_off / 4, nseq, Hq, d,
			     kvd_only, st));
	tim(g, T_MRG1, st);
	if (!rc && g->timing && !kvd_only)
		g->tim_pending[g->tcur] = 1;
out:
	/* On failure: slots kvd still holds are waited for, then all go back
	 * once cs no longer reads them. */
	if (nb) {
		for (uint32_t i = 0; i < nb; i++) {
			int32_t res;
			const char *msg;

			if (b[i].submitted && kvt_wait_slot(c, (uint32_t)b[i].slot, &res, &msg))
				continue;       /* broken ring: the slot is lost with it */
		}
		(void)cudaStreamSynchronize(g->cs);
		for (uint32_t i = 0; i < nb; i++)
			kvt_slot_put(c, (uint32_t)b[i].slot);
	}
	if (!rc)
		rc = done_user(c, g, st);
	return rc;
}

static int attend(struct kvt *c, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		  uint32_t nseq, const float *q, float *o, float *lse, int kvd_only,
		  cudaStream_t st)
{
	int rc = check_common(c, g, layer, kvd_only ? "attend_kvd" : "attend");

	if (rc || (rc = settle(c, g)))
		return rc;
	if (kvd_only && kvt_dense(c, layer))
		return kvt_fail(c, -EINVAL, "layer %u is dense: kvd holds nothing", layer);
	for (uint32_t i = 0; i < nseq; i++) {
		const struct kvg_seq *gs = seqs[i]->gs;

		if (!kvd_only && (!gs || gs->ly[layer].prefilled != 1))
			return kvt_fail(c, -EINVAL, "layer %u of sequence %u %s", layer, i,
					 gs && gs->ly[layer].prefilled ? "failed to prefill"
					 : "not prefilled");
	}
	if (nseq == 0)
		return 0;
	if (!g->checked_attend) {
		if ((rc = check_ptr(c, q, "attend: q")) || (rc = check_ptr(c, o, "attend: o")) ||
		    (lse && (rc = check_ptr(c, lse, "attend: lse"))))
			return rc;
		g->checked_attend = 1;
	}
	for (uint32_t i = 0; i < nseq && !rc; i += g->max_batch) {
		uint32_t cnt = nseq - i < g->max_batch ? nseq - i : g->max_batch;

		if (i && (rc = settle(c, g)))
			break;
		rc = attend_some(c, g, layer, seqs + i, cnt, q + (size_t)i * g->Hq * g->d,
				 o + (size_t)i * g->Hq * g->d, lse ? lse + (size_t)i * g->Hq : NULL,
				 kvd_only, st);
	}
	g->t.attends++;
	return rc;
}

/* kvd_only with a sequence that has no GPU state (kvc_seq_open): its layers
 * were never prefilled here, which attend_kvd does not need. */

/* ---- the host-pointer API on this backend ------------------------------------------- */

static int h2d(struct kvt *c, struct kvg *g, void **dst, const void *src, size_t bytes)
{
	int rc = dalloc(c, g, dst, bytes, g->hs);

	if (rc)
		return rc;
	CK(c, cudaMemcpyAsync(*dst, src, bytes, cudaMemcpyHostToDevice, g->hs));
	return 0;
}

static void hfree(struct kvg *g, void *p)
{
	if (p)
		(void)cudaFreeAsync(p, g->hs);
}

int kvg_prefill_host(struct kvt *c, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		     const float *k, const float *v, uint32_t n)
{
	void *dk = NULL, *dv = NULL;
	int prev, rc = check_common(c, g, layer, "prefill");
	size_t bytes;

	if (rc || (rc = dev_enter(c, g, &prev)))
		return rc;
	bytes = (size_t)g->H * n * g->d * 4;
	if (!(rc = h2d(c, g, &dk, k, bytes)) && !(rc = h2d(c, g, &dv, v, bytes)))
		rc = prefill(c, g, s, layer, dk, dv, n, KVC_F32, g->hs);
	hfree(g, dk);
	hfree(g, dv);
	CKR(c, rc, cudaStreamSynchronize(g->hs));
	dev_leave(g, prev);
	return rc;
}

int kvg_append_host(struct kvt *c, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		    const float *k, const float *v)
{
	void *dk = NULL, *dv = NULL;
	int prev, rc = check_common(c, g, layer, "append");
	size_t bytes;

	if (rc || (rc = dev_enter(c, g, &prev)))
		return rc;
	bytes = (size_t)g->H * g->d * 4;
	if (!(rc = h2d(c, g, &dk, k, bytes)) && !(rc = h2d(c, g, &dv, v, bytes)))
		rc = append(c, g, layer, &s, 1, dk, dv, KVC_F32, g->hs);
	hfree(g, dk);
	hfree(g, dv);
	CKR(c, rc, cudaStreamSynchronize(g->hs));
	dev_leave(g, prev);
	return rc;
}

int kvg_attend_host(struct kvt *c, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		    uint32_t nseq, const float *q, float *o, float *lse, int kvd_only)
{
	void *dq = NULL, *dout = NULL;
	int prev, rc = check_common(c, g, layer, "attend");
	size_t qb, lb;

	if (rc || (rc = dev_enter(c, g, &prev)))
		return rc;
	qb = (size_t)nseq * g->Hq * g->d * 4;
	lb = (size_t)nseq * g->Hq * 4;
	if (!(rc = h2d(c, g, &dq, q, qb)) && !(rc = dalloc(c, g, &dout, qb + lb, g->hs)))
		rc = attend(c, g, layer, seqs, nseq, dq, dout, (float *)((char *)dout + qb), kvd_only,
			    g->hs);
	if (!rc) {
		CKR(c, rc, cudaMemcpyAsync(o, dout, qb, cudaMemcpyDeviceToHost, g->hs));
		if (lse)
			CKR(c, rc, cudaMemcpyAsync(lse, (char *)dout + qb, lb, cudaMemcpyDeviceToHost,
						   g->hs));
	}
	hfree(g, dq);
	hfree(g, dout);
	CKR(c, rc, cudaStreamSynchronize(g->hs));
	dev_leave(g, prev);
	return rc;
}

/* ---- the public device API ----------------------------------------------------------- */

/* Each entry point runs on the connection's device and gives the calling
 * thread its own current device back (the caller may drive several GPUs). */
#define ON_DEVICE(c, g, call)                                                           \
	do {                                                                            \
		int prev_, rc_ = (g) ? dev_enter((c), (g), &prev_) : 0;                 \
		if (rc_)                                                                \
			return rc_;                                                     \
		rc_ = (call);                                                           \
		if (g)                                                                  \
			dev_leave((g), prev_);                                          \
		return rc_;                                                             \
	} while (0)

int kvg_prefill_dev(struct kvt *c, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		    const void *k, const void *v, uint32_t n, int dtype, void *stream)
{
	ON_DEVICE(c, g, prefill(c, g, s, layer, k, v, n, dtype, (cudaStream_t)stream));
}

int kvg_append_dev(struct kvt *c, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		   uint32_t nseq, const void *k, const void *v, int dtype, void *stream)
{
	ON_DEVICE(c, g, append(c, g, layer, seqs, nseq, k, v, dtype, (cudaStream_t)stream));
}

int kvg_attend_dev(struct kvt *c, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		   uint32_t nseq, const float *q, float *o, float *lse, int kvd_only,
		   void *stream)
{
	ON_DEVICE(c, g, attend(c, g, layer, seqs, nseq, q, o, lse, kvd_only, (cudaStream_t)stream));
}

int kvg_timing(struct kvt *c, struct kvg *g, struct kvc_timing *t, int reset)
{
	if (!g) {
		memset(t, 0, sizeof *t);
		return 0;
	}
	if (g->timing) {
		int prev;

		if (dev_enter(c, g, &prev))
			return -EIO;
		tim_collect(g, 0, 1);
		tim_collect(g, 1, 1);
		dev_leave(g, prev);
	}
	*t = g->t;
	if (reset)
		memset(&g->t, 0, sizeof g->t);
	return 0;
}
