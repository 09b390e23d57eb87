/* kvbench load: many decoding client processes against one real kvd, with
 * and without noisy neighbours, and the in-process engine doing the same
 * work (docs/ARCHITECTURE.md, "kvbench load fields").
 *
 *   kvbench load [--json] [--ctx N] [--steps N] [--clients LIST] [--layers N]
 *                [--batch N]
 *
 * Setup (not measured): the parent makes one synthetic sequence per decode
 * client (engine/synth.h, workloads rotating needle/dense/mixed as in the demo),
 * centers, rounds and hashes its rows once on a pool (kvd_prep_mean /
 * kvd_prep_rows, exactly the pieces kvd_prep_layer builds segments from),
 * and makes every query of the run and its codes.  It then starts kvd as a
 * child (with a watchdog), builds the same segments in-process from the
 * same rows and runs every ATTEND of scenario A at the largest N on them,
 * one submitter thread: that is the in-process figure and the reference
 * answers.  Then it forks the clients; they inherit the prepared rows,
 * queries and answers, and speak the wire protocol directly (prepared
 * PREFILL chunks and ATTEND records, as the GPU backend does), so no client
 * hashes anything on the CPU.
 *
 * Scenario A: N decode clients (N from --clients), each doing --steps steps
 * of one ATTEND per sparse layer of its own sequence, waiting for each
 * completion.  Scenario B: the same, while one more client prefills
 * 2 x ctx tokens into every layer over and over (sealing segments) and
 * another sends ATTEND batches of --batch records of its own sequence, for
 * the whole time the decode clients run.  Every answer through kvd is
 * compared bit for bit with the in-process one.
 */
#include <dirent.h>
#include <errno.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "engine/attn.h"
#include "bench.h"
#include "srv.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "proto/kvd_ring.h"
#include "gpu-client/kvt.h"
#include "engine/lsh.h"
#include "engine/pool.h"
#include "engine/prep.h"
#include "engine/rng.h"
#include "engine/synth.h"

#define MAXC    16              /* decode clients */
#define MAXN    8               /* entries of --clients */
#define MAXP    16              /* pieces (segments) of one client's rows */
#define WD_USEC 2000000         /* WATCHDOG_USEC given to kvd: pings every 1 s */
#define WD_MAX  65536
#define BLAT    4096            /* batch latencies kept per phase */

/* Rows as kvd receives them: centered bf16 K and V, codes; in pieces of at
 * most segment_tokens (what one segment is built from). */
struct piece {
	uint32_t n;
	uint16_t *k, *v, *c;    /* [H][n][d], [H][n][d], [H][L][n] */
};

struct rows {
	uint32_t n, np;
	const float *mean;      /* [H][d] */
	struct piece p[MAXP];
};

struct phase_res {
	uint32_t n, mism;
	double t0, t1;          /* first submit, last completion */
};

struct noise_res {
	uint64_t batches, records, mism, tokens, seqs, errors;
	uint32_t nbl;
	float batch_ms[BLAT];
};

struct shared {
	_Atomic uint32_t go, done, ready, noise_go, noise_stop, noise_started, noise_idle;
	_Atomic uint32_t failed;
	uint32_t scen, N;       /* of the phase `go` / `noise_go` names */
	char err[MAXC + 2][160];
	struct phase_res pr[2 * MAXN][MAXC];
	struct noise_res nr[2 * MAXN];
	float lat[];            /* [phase][client][steps * layers] */
};

struct cfg {
	int json;
	uint32_t ctx, steps, layers, batch, ncl, cl[MAXN], nmax;
	struct kvd_geom g;
	struct kvc_model m;
	const char *sock;
	uint32_t seg_tokens, chunk;
	uint64_t slot_size;
	struct rows *rows;      /* [nprep] */
	struct rows big;        /* the prefiller's: rows[0] then rows[1] */
	const float *q;         /* [nmax][layers][steps][Hq][d] */
	const uint16_t *qc;     /* [nmax][layers][steps][Hq][L] */
	const float *ro, *rl;   /* reference o [..][Hq][d], lse [..][Hq] */
	struct shared *sh;
	uint32_t per;           /* latency samples per (phase, client) */
};

#define END_GEN 0xffffffffu

static void fwait(_Atomic uint32_t *w, uint32_t old)
{
	struct timespec ts = { 0, 50 * 1000000L };

	syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, old, &ts, NULL, 0);
}

static void fstore(_Atomic uint32_t *w, uint32_t v)
{
	atomic_store(w, v);
	syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

static void fbump(_Atomic uint32_t *w)
{
	atomic_fetch_add(w, 1);
	syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

static size_t qidx(const struct cfg *cf, uint32_t i, uint32_t l, uint32_t s)
{
	return ((size_t)i * cf->layers + l) * cf->steps + s;
}

static float *lat_of(const struct cfg *cf, uint32_t ph, uint32_t i)
{
	return cf->sh->lat + ((size_t)ph * MAXC + i) * cf->per;
}

/* ---- setup in the parent ------------------------------------------------ */

struct prep_arg {
	struct cfg *cf;
	const float *W;
	struct kvd_synth *w;
	uint32_t nprep, i, piece, t0;
	_Atomic int err;
};

static void synth_task(void *arg, uint32_t i, unsigned worker)
{
	struct prep_arg *a = arg;
	const struct kvd_geom *g = &a->cf->g;

	if (kvd_synth_make(&a->w[i], (enum kvd_wl)(i % KVD_WL_COUNT), a->cf->ctx, g->q_heads,
			   g->kv_heads, g->d, 3000 + (uint64_t)i))
		atomic_store(&a->err, -ENOMEM);
}

/* Task h: kv head h of piece a->piece of client a->i, as kvd_prep_layer's
 * seg_task does it. */
static void rows_task(void *arg, uint32_t h, unsigned worker)
{
	struct prep_arg *a = arg;
	struct kvd_geom g1 = a->cf->g;
	struct rows *r = &a->cf->rows[a->i];
	struct piece *p = &r->p[a->piece];
	const struct kvd_synth *w = &a->w[a->i];
	uint32_t d = g1.d, L = g1.L, n = w->n;
	float *x = malloc((size_t)p->n * d * sizeof *x);

	if (!x) {
		atomic_store(&a->err, -ENOMEM);
		return;
	}
	g1.kv_heads = 1;
	kvd_prep_rows(&g1, a->W, r->mean + (size_t)h * d, w->k + (size_t)h * n * d,
		      w->v + (size_t)h * n * d, n, a->t0, p->n, p->k + (size_t)h * p->n * d,
		      p->v + (size_t)h * p->n * d, p->c + (size_t)h * L * p->n, x);
	free(x);
}

static int prepare(struct cfg *cf, const float *W, struct kvd_pool *pool, uint32_t nprep,
		   float **qkeep)
{
	const uint32_t H = cf->g.kv_heads, d = cf->g.d, L = cf->g.L, Hq = cf->g.q_heads;
	uint32_t lo = cf->m.sink, hi = cf->ctx - cf->m.window;
	struct prep_arg a = { .cf = cf, .W = W, .nprep = nprep };

	a.w = calloc(nprep, sizeof *a.w);
	cf->rows = calloc(nprep, sizeof *cf->rows);
	if (!a.w || !cf->rows)
		return -ENOMEM;
	kvd_pool_run(pool, nprep, synth_task, &a);
	if (atomic_load(&a.err))
		return -ENOMEM;
	for (uint32_t i = 0; i < nprep; i++) {
		struct rows *r = &cf->rows[i];
		float *mean = malloc((size_t)H * d * sizeof *mean);

		if (!mean)
			return -ENOMEM;
		kvd_prep_mean(a.w[i].k, H, d, a.w[i].n, lo, hi, mean);
		r->mean = mean;
		r->n = hi - lo;
		r->np = (r->n + cf->seg_tokens - 1) / cf->seg_tokens;
		a.i = i;
		for (uint32_t s = 0; s < r->np; s++) {
			struct piece *p = &r->p[s];

			a.t0 = lo + s * cf->seg_tokens;
			p->n = hi - a.t0 < cf->seg_tokens ? hi - a.t0 : cf->seg_tokens;
			p->k = malloc((size_t)H * p->n * d * 2);
			p->v = malloc((size_t)H * p->n * d * 2);
			p->c = malloc((size_t)H * L * p->n * 2);
			if (!p->k || !p->v || !p->c)
				return -ENOMEM;
			a.piece = s;
			kvd_pool_run(pool, H, rows_task, &a);
			if (atomic_load(&a.err))
				return -ENOMEM;
		}
		qkeep[i] = malloc((size_t)Hq * d * sizeof(float));
		if (!qkeep[i])
			return -ENOMEM;
		memcpy(qkeep[i], a.w[i].q, (size_t)Hq * d * sizeof(float));
		kvd_synth_free(&a.w[i]);
	}
	free(a.w);
	/* The prefiller streams client 0's rows then client 1's: 2 x ctx tokens
	 * that nobody attends, so their content does not matter. */
	cf->big.mean = cf->rows[0].mean;
	for (uint32_t i = 0; i < 2; i++)
		for (uint32_t s = 0; s < cf->rows[i].np; s++)
			cf->big.p[cf->big.np++] = cf->rows[i].p[s];
	cf->big.n = cf->rows[0].n + cf->rows[1].n;
	return 0;
}

/* Queries: the workload's query of each client, perturbed per (layer,
 * step) by 0.25 x its per-element rms of Gaussian noise, so no two ATTENDs
 * of a client ask the same thing.  Codes as the client makes them. */
static int make_queries(struct cfg *cf, const float *W, float **qbase)
{
	const uint32_t Hq = cf->g.q_heads, d = cf->g.d, L = cf->g.L;
	size_t nq = (size_t)cf->nmax * cf->layers * cf->steps;
	float *q = malloc(nq * Hq * d * sizeof *q);
	uint16_t *qc = malloc(nq * Hq * L * sizeof *qc);

	if (!q || !qc)
		return -ENOMEM;
	for (uint32_t i = 0; i < cf->nmax; i++)
		for (uint32_t l = 0; l < cf->layers; l++)
			for (uint32_t s = 0; s < cf->steps; s++) {
				size_t at = qidx(cf, i, l, s);
				float *dst = q + at * Hq * d;

				for (uint32_t h = 0; h < Hq; h++) {
					const float *src = qbase[i] + (size_t)h * d;
					double ss = 0;

					for (uint32_t e = 0; e < d; e++)
						ss += (double)src[e] * src[e];
					double sig = 0.25 * sqrt(ss / d);

					for (uint32_t e = 0; e < d; e++)
						dst[(size_t)h * d + e] = (float)(src[e] + sig *
							kvd_rng_normal_at(0x10ad0000ull + at, (uint64_t)h * d + e));
				}
				kvd_prep_query_codes(&cf->g, W, dst, qc + at * Hq * L);
			}
	cf->q = q;
	cf->qc = qc;
	return 0;
}

/* The in-process engine: the same segments (kvd_seg_build from the same
 * rows), every ATTEND of scenario A at N = nmax in the order a step visits
 * them, one submitter.  Keeps every answer as the reference.  Returns the
 * seconds it took, or < 0. */
static double inproc(struct cfg *cf, struct kvd_pool *pool)
{
	const uint32_t Hq = cf->g.q_heads, d = cf->g.d, nw = kvd_pool_size(pool);
	size_t nq = (size_t)cf->nmax * cf->layers * cf->steps;
	struct kvd_seg **seg = calloc((size_t)cf->nmax * cf->layers * MAXP, sizeof *seg);
	struct kvd_attn_scratch *scr = calloc(nw, sizeof *scr);
	struct kvd_logp_tab *tab = malloc(sizeof *tab);
	float *ro = malloc(nq * Hq * d * sizeof *ro), *rl = malloc(nq * Hq * sizeof *rl);
	double t = -1;

	if (!seg || !scr || !tab || !ro || !rl)
		return -1;
	for (unsigned w = 0; w < nw; w++)
		if (kvd_attn_scratch_init(&scr[w], cf->seg_tokens))
			return -1;
	kvd_logp_tab_init(tab, (int)cf->g.K, (int)cf->g.L, (int)cf->g.c);
	for (uint32_t i = 0; i < cf->nmax; i++)
		for (uint32_t l = 0; l < cf->layers; l++)
			for (uint32_t s = 0; s < cf->rows[i].np; s++) {
				const struct piece *p = &cf->rows[i].p[s];

				if (kvd_seg_build(&cf->g, p->n, p->k, p->v, p->c, pool,
						  &seg[((size_t)i * cf->layers + l) * MAXP + s]))
					return -1;
			}
	double t0 = bench_now_ms();

	for (uint32_t s = 0; s < cf->steps; s++)
		for (uint32_t i = 0; i < cf->nmax; i++)
			for (uint32_t l = 0; l < cf->layers; l++) {
				size_t at = qidx(cf, i, l, s);
				struct kvd_layer_view lv = {
					.seg = (const struct kvd_seg *const *)&seg[((size_t)i * cf->layers + l) * MAXP],
					.nseg = cf->rows[i].np,
				};

				if (kvd_attn_layer(pool, scr, kvd_kern_get(), &cf->g, tab, &lv,
						   cf->q + at * Hq * d, cf->qc + at * Hq * cf->g.L,
						   ro + at * Hq * d, rl + at * Hq, NULL))
					return -1;
			}
	t = (bench_now_ms() - t0) / 1e3;
	for (size_t i = 0; i < (size_t)cf->nmax * cf->layers * MAXP; i++)
		if (seg[i])
			kvd_seg_free(seg[i]);
	for (unsigned w = 0; w < nw; w++)
		kvd_attn_scratch_free(&scr[w]);
	free(seg);
	free(scr);
	free(tab);
	cf->ro = ro;
	cf->rl = rl;
	return t;
}

/* ---- the clients (forked) ----------------------------------------------- */

static int kid_fail(struct cfg *cf, uint32_t i, struct kvt *c, const char *what)
{
	snprintf(cf->sh->err[i], sizeof cf->sh->err[i], "%s: %s", what,
		 c ? kvt_error(c) : "connect");
	fstore(&cf->sh->failed, 1);
	return 1;
}

/* Rows [t0, t0+cnt) of r into a PREFILL payload's K, V and codes. */
static void copy_rows(const struct cfg *cf, const struct rows *r, uint32_t t0, uint32_t cnt,
		      uint16_t *kd, uint16_t *vd, uint16_t *cd)
{
	const size_t H = cf->g.kv_heads, d = cf->g.d, L = cf->g.L;
	uint32_t ps = 0;

	for (uint32_t s = 0; s < r->np; ps += r->p[s].n, s++) {
		const struct piece *p = &r->p[s];
		uint32_t a = t0 > ps ? t0 : ps, b = t0 + cnt < ps + p->n ? t0 + cnt : ps + p->n;

		if (a >= b)
			continue;
		for (size_t h = 0; h < H; h++) {
			memcpy(kd + (h * cnt + (a - t0)) * d, p->k + (h * p->n + (a - ps)) * d,
			       (size_t)(b - a) * d * 2);
			memcpy(vd + (h * cnt + (a - t0)) * d, p->v + (h * p->n + (a - ps)) * d,
			       (size_t)(b - a) * d * 2);
			for (size_t t = 0; t < L; t++)
				memcpy(cd + (h * L + t) * cnt + (a - t0),
				       p->c + (h * L + t) * p->n + (a - ps), (size_t)(b - a) * 2);
		}
	}
}

/* Prefills r into `layer` of sequence `seq` in slot-sized PREFILL chunks
 * (fire and forget; the caller drains).  stop: checked between chunks. */
static int prefill_layer(const struct cfg *cf, struct kvt *c, uint64_t seq, uint32_t layer,
			 const struct rows *r, _Atomic uint32_t *stop, uint32_t gen,
			 uint64_t *tokens, _Atomic uint32_t **started)
{
	const uint32_t H = cf->g.kv_heads, d = cf->g.d, L = cf->g.L;

	for (uint32_t t = 0; t < r->n; t += cf->chunk) {
		uint32_t cnt = r->n - t < cf->chunk ? r->n - t : cf->chunk;
		int first = t == 0, last = t + cnt >= r->n;
		int slot;

		if (stop && atomic_load(stop) == gen)
			return 1;
		slot = kvt_slot_get(c, 1);
		if (slot < 0)
			return slot;
		char *base = kvt_slot(c, (uint32_t)slot);
		const struct kvd_rows_layout lay = kvd_rows_layout(H, d, L, cnt, first);
		struct kvd_sqe e = {
			.op = KVD_OP_PREFILL, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
			.user_data = (uint64_t)slot, .seq = seq, .len = (uint32_t)lay.bytes, .ntok = cnt,
			.flags = (uint8_t)((first ? KVD_RF_MEAN : 0) | (last ? KVD_RF_LAST : 0)),
		};

		if (first)
			memcpy(base, r->mean, (size_t)H * d * sizeof(float));
		copy_rows(cf, r, t, cnt, (uint16_t *)(base + lay.k), (uint16_t *)(base + lay.v),
			  (uint16_t *)(base + lay.codes));
		int rc = kvt_submit(c, &e);

		if (rc)
			return rc;
		if (started && *started) {      /* the neighbour is in kvd's ring now */
			fbump(*started);
			*started = NULL;
		}
		if (tokens)
			*tokens += cnt;
	}
	return 0;
}

/* One ATTEND of `nrec` records of sequence seq, layer l, record j asking
 * query (qi, l, s0 + j mod steps); waits, then compares every answer with
 * the reference.  *ms: submit -> completion; *mism: answers that differ. */
static int attend(const struct cfg *cf, struct kvt *c, uint64_t seq, uint32_t l, uint32_t qi,
		  uint32_t s0, uint32_t nrec, double *ms, uint32_t *mism, _Atomic uint32_t **started)
{
	const uint32_t Hq = cf->g.q_heads, d = cf->g.d, L = cf->g.L;
	const struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, L);
	int slot = kvt_slot_get(c, 0);
	int32_t res;
	const char *msg;
	int rc;

	if (slot < 0)
		return slot;
	char *base = kvt_slot(c, (uint32_t)slot);

	for (uint32_t j = 0; j < nrec; j++) {
		char *rec = base + j * lay.in;
		size_t at = qidx(cf, qi, l, (s0 + j) % cf->steps);

		memset(rec, 0, KVD_ATTEND_HDR);
		memcpy(rec, &seq, sizeof seq);
		memcpy(rec + lay.q_off, cf->q + at * Hq * d, (size_t)Hq * d * 4);
		memcpy(rec + lay.codes_off, cf->qc + at * Hq * L, (size_t)Hq * L * 2);
	}
	struct kvd_sqe e = {
		.op = KVD_OP_ATTEND, .layer = (uint16_t)l, .slot = (uint32_t)slot,
		.user_data = (uint64_t)slot, .len = (uint32_t)(nrec * lay.in), .nseq = nrec,
		.out_off = (uint32_t)kvd_attend_out_off(&lay, nrec),
		.out_len = (uint32_t)(nrec * lay.out),
	};
	double t = bench_now_ms();

	rc = kvt_submit(c, &e);
	if (!rc && started && *started) {
		fbump(*started);
		*started = NULL;
	}
	if (rc || (rc = kvt_wait_slot(c, (uint32_t)slot, &res, &msg))) {
		kvt_slot_put(c, (uint32_t)slot);
		return rc;
	}
	*ms = bench_now_ms() - t;
	if (res < 0) {
		kvt_fail(c, res, "attend: kvd: %s", msg);
		kvt_slot_put(c, (uint32_t)slot);
		return res;
	}
	const char *o = base + e.out_off;

	for (uint32_t j = 0; j < nrec; j++) {
		size_t at = qidx(cf, qi, l, (s0 + j) % cf->steps);
		const char *r = o + j * lay.out;

		*mism += memcmp(r, cf->ro + at * Hq * d, (size_t)Hq * d * 4) != 0 ||
			 memcmp(r + lay.lse_off, cf->rl + at * Hq, (size_t)Hq * 4) != 0;
	}
	kvt_slot_put(c, (uint32_t)slot);
	return 0;
}

/* Connects, opens the profile, makes a sequence and prefills rows r into
 * every layer.  The clients speak the ring protocol themselves, on
 * libkvclient's transport (kvt.h) without a backend. */
static int kid_setup(struct cfg *cf, uint32_t i, const char *name, uint64_t slot_size,
		     const struct rows *r, struct kvt **cp, uint64_t *sp)
{
	struct kvc_opts o = { .socket_path = cf->sock, .tenant = "load", .name = name,
			      .slot_size = slot_size, .slots = slot_size ? 2 : 0 };

	if (!(*cp = kvt_new()) || kvt_connect(*cp, &o) || kvt_profile(*cp, &cf->m) ||
	    kvt_seq_create(*cp, sp))
		return kid_fail(cf, i, *cp, "setup");
	for (uint32_t l = 0; r && l < cf->layers; l++)
		if (prefill_layer(cf, *cp, *sp, l, r, NULL, 0, NULL, NULL))
			return kid_fail(cf, i, *cp, "prefill");
	if (r && kvt_drain(*cp, "prefill"))
		return kid_fail(cf, i, *cp, "prefill");
	return 0;
}

static int decode_kid(struct cfg *cf, uint32_t i)
{
	struct shared *sh = cf->sh;
	struct kvt *c = NULL;
	uint64_t s;
	char name[32];
	uint32_t gen = 0;

	snprintf(name, sizeof name, "load-decode-%u", i);
	if (kid_setup(cf, i, name, 0, &cf->rows[i], &c, &s))
		goto out;
	fbump(&sh->ready);
	for (;;) {
		uint32_t g;

		while ((g = atomic_load(&sh->go)) == gen && !atomic_load(&sh->failed))
			fwait(&sh->go, gen);
		if (g == END_GEN || atomic_load(&sh->failed))
			break;
		gen = g;
		if (i >= sh->N)
			continue;
		uint32_t ph = gen - 1;
		struct phase_res *pr = &sh->pr[ph][i];
		float *lat = lat_of(cf, ph, i);

		for (uint32_t step = 0; step < cf->steps; step++)
			for (uint32_t l = 0; l < cf->layers; l++) {
				double ms, t = bench_now_ms();

				if (attend(cf, c, s, l, i, step, 1, &ms, &pr->mism, NULL)) {
					kid_fail(cf, i, c, "attend");
					goto out;
				}
				if (pr->n == 0)
					pr->t0 = t;
				pr->t1 = bench_now_ms();
				lat[pr->n++] = (float)ms;
			}
		fbump(&sh->done);
	}
	kvt_seq_free(c, s);
out:
	kvt_close(c);
	return atomic_load(&sh->failed) != 0;
}

/* The noisy neighbours: role 0 sends big ATTEND batches, role 1 prefills. */
static int noise_kid(struct cfg *cf, uint32_t i, int role)
{
	struct shared *sh = cf->sh;
	const uint32_t Hq = cf->g.q_heads, d = cf->g.d, L = cf->g.L;
	uint64_t need = 0;
	struct kvt *c = NULL;
	uint64_t s;
	uint32_t gen = 0;

	if (role == 0) {
		const struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, L);

		need = kvd_attend_out_off(&lay, cf->batch) + (uint64_t)cf->batch * lay.out;
		need = need <= cf->slot_size ? 0 : (need + 4095) / 4096 * 4096;
	}
	if (kid_setup(cf, i, role ? "load-prefill" : "load-batch", need,
		      role ? NULL : &cf->rows[0], &c, &s))
		goto out;
	if (role)
		kvt_seq_free(c, s);
	fbump(&sh->ready);
	for (;;) {
		uint32_t g;

		while ((g = atomic_load(&sh->noise_go)) == gen && !atomic_load(&sh->failed))
			fwait(&sh->noise_go, gen);
		if (g == END_GEN || atomic_load(&sh->failed))
			break;
		gen = g;
		struct noise_res *nr = &sh->nr[gen - 1];
		/* bumped once this neighbour's first entry is submitted: the
		 * decode clients start when both are */
		_Atomic uint32_t *started = &sh->noise_started;

		while (atomic_load(&sh->noise_stop) != gen && !atomic_load(&sh->failed)) {
			if (role == 0) {
				double ms = 0;
				uint32_t mism = 0, l = (uint32_t)(nr->batches % cf->layers);

				if (attend(cf, c, s, l, 0, (uint32_t)nr->batches, cf->batch,
					   &ms, &mism, &started)) {
					kid_fail(cf, i, c, "batch attend");
					goto out;
				}
				nr->mism += mism;
				nr->records += cf->batch;
				if (nr->nbl < BLAT)
					nr->batch_ms[nr->nbl++] = (float)ms;
				nr->batches++;
			} else {
				uint64_t ps;
				int rc = 0;

				if (kvt_seq_create(c, &ps)) {
					kid_fail(cf, i, c, "prefill seq");
					goto out;
				}
				for (uint32_t l = 0; l < cf->layers && rc == 0; l++) {
					rc = prefill_layer(cf, c, ps, l, &cf->big,
							   &sh->noise_stop, gen, &nr->tokens, &started);
				}
				if (rc < 0 || kvt_drain(c, "prefill") || kvt_seq_free(c, ps)) {
					kid_fail(cf, i, c, "prefill");
					goto out;
				}
				nr->seqs += rc == 0;
			}
		}
		if (started)
			fbump(started);
		fbump(&sh->noise_idle);
	}
	if (role == 0)
		kvt_seq_free(c, s);
out:
	kvt_close(c);
	return atomic_load(&sh->failed) != 0;
}

static int load_kid(uint32_t i, void *arg)
{
	struct cfg *cf = arg;

	if (i < cf->nmax)
		return decode_kid(cf, i);
	return noise_kid(cf, i, (int)(i - cf->nmax));
}

struct clients_thr {
	struct cfg *cf;
	int failed;
};

static void *clients_main(void *arg)
{
	struct clients_thr *t = arg;

	t->failed = run_clients(t->cf->nmax + 2, load_kid, t->cf);
	if (t->failed)
		fstore(&t->cf->sh->failed, 1);
	return NULL;
}

/* ---- watchdog ------------------------------------------------------------ */

struct wd {
	int fd;
	char path[108];
	_Atomic int stop;
	uint32_t n;
	double t[WD_MAX];
};

static void *wd_main(void *arg)
{
	struct wd *w = arg;
	char buf[512];

	while (!atomic_load(&w->stop)) {
		ssize_t n = recv(w->fd, buf, sizeof buf - 1, 0);

		if (n <= 0)
			continue;
		buf[n] = 0;
		if (strstr(buf, "WATCHDOG=1") && w->n < WD_MAX)
			w->t[w->n++] = bench_now_ms();
	}
	return NULL;
}

static int wd_open(struct wd *w)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct timeval tv = { 0, 200000 };

	w->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	snprintf(w->path, sizeof w->path, "/tmp/kvbench-load-notify.%d", (int)getpid());
	unlink(w->path);
	memcpy(a.sun_path, w->path, strlen(w->path) + 1);
	if (w->fd < 0 || bind(w->fd, (struct sockaddr *)&a, sizeof a))
		return -1;
	setsockopt(w->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	return 0;
}

/* ---- results -------------------------------------------------------------- */

static int cmp_f(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;

	return (x > y) - (x < y);
}

static float pct(float *x, uint32_t n, double p)       /* sorts x */
{
	if (!n)
		return 0;
	qsort(x, n, sizeof *x, cmp_f);
	uint32_t k = (uint32_t)(n * p);

	return x[k < n ? k : n - 1];
}

/* The daemon's threads: count and names, from /proc. */
static int daemon_threads(pid_t pid, char *names, size_t len)
{
	char path[64];
	DIR *dir;
	struct dirent *de;
	int n = 0;
	size_t at = 0;

	snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
	names[0] = 0;
	if (!(dir = opendir(path)))
		return 0;
	while ((de = readdir(dir))) {
		char p2[300], comm[32] = "";
		FILE *f;

		if (de->d_name[0] == '.')
			continue;
		snprintf(p2, sizeof p2, "/proc/%d/task/%s/comm", (int)pid, de->d_name);
		if ((f = fopen(p2, "r"))) {
			if (fgets(comm, sizeof comm, f))
				comm[strcspn(comm, "\n\"\\")] = 0;
			fclose(f);
		}
		if (at + strlen(comm) + 2 < len)
			at += (size_t)snprintf(names + at, len - at, "%s%s", n ? "," : "", comm);
		n++;
	}
	closedir(dir);
	return n;
}

static int parse_list(const char *s, uint32_t *out, uint32_t *n)
{
	char *end;

	*n = 0;
	while (*s) {
		unsigned long v = strtoul(s, &end, 10);

		if (end == s || v == 0 || v > MAXC || *n == MAXN || (*end && *end != ','))
			return -1;
		out[(*n)++] = (uint32_t)v;
		s = *end ? end + 1 : end;
	}
	return *n ? 0 : -1;
}

static int usage(void)
{
	fprintf(stderr, "usage: kvbench load [--json] [--ctx N] [--steps N] [--clients N[,N..]]\n"
			"                    [--layers N<=16] [--batch N<=%u]\n", KVD_WIRE_MAX_NSEQ);
	return 2;
}

int bench_load_main(int argc, char **argv)
{
	static struct cfg C;
	struct cfg *cf = &C;
	struct daemon srv;
	struct wd *wd = calloc(1, sizeof *wd);
	double t_start = bench_now_ms(), t_setup, t_meas;
	int rc = 1;

	cf->ctx = 32768;
	cf->steps = 8;
	cf->layers = 3;
	cf->ncl = 4;
	cf->cl[0] = 1, cf->cl[1] = 2, cf->cl[2] = 4, cf->cl[3] = 8;
	for (int i = 0; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		char *end;

		if (!strcmp(a, "--json")) {
			cf->json = 1;
			continue;
		}
		if (!v)
			return usage();
		i++;
		if (!strcmp(a, "--clients")) {
			if (parse_list(v, cf->cl, &cf->ncl))
				return usage();
			continue;
		}
		unsigned long x = strtoul(v, &end, 10);
		uint32_t *dst = !strcmp(a, "--ctx") ? &cf->ctx : !strcmp(a, "--steps") ? &cf->steps :
				!strcmp(a, "--layers") ? &cf->layers : !strcmp(a, "--batch") ? &cf->batch : NULL;

		if (!dst || *end || !*v || x == 0 || x > (1ul << 20))
			return usage();
		*dst = (uint32_t)x;
	}
	if (cf->layers > 16 || cf->ctx < 2048 || cf->batch > KVD_WIRE_MAX_NSEQ || !wd)
		return usage();
	for (uint32_t k = 0; k < cf->ncl; k++)
		cf->nmax = cf->cl[k] > cf->nmax ? cf->cl[k] : cf->nmax;
	cf->m = llama(cf->layers);
	cf->g = (struct kvd_geom){ cf->m.q_heads, cf->m.kv_heads, cf->m.head_dim, cf->m.K,
				   cf->m.L, cf->m.c, cf->m.kv_dtype,
				   cf->m.estimator == KVC_EST_HYBRID_LCV };
	const uint32_t Hq = cf->g.q_heads, d = cf->g.d, L = cf->g.L, H = cf->g.kv_heads;
	uint32_t nprep = cf->nmax < 2 ? 2 : cf->nmax;

	/* kvd, with a watchdog whose pings we record */
	pthread_t wdt, clt;
	char usec[32];

	if (wd_open(wd)) {
		perror("kvbench load: notify socket");
		return 1;
	}
	snprintf(usec, sizeof usec, "%d", WD_USEC);
	setenv("NOTIFY_SOCKET", wd->path, 1);
	setenv("WATCHDOG_USEC", usec, 1);
	int up = srv_start_conf(&srv, NULL, NULL);

	unsetenv("NOTIFY_SOCKET");
	unsetenv("WATCHDOG_USEC");
	if (up) {
		fprintf(stderr, "kvbench load: kvd did not start\n");
		return 1;
	}
	pthread_create(&wdt, NULL, wd_main, wd);
	cf->sock = srv.sock;

	/* W, segment size and slot size as kvd gives them */
	struct kvc_opts o = { .socket_path = srv.sock, .tenant = "load", .name = "load-parent" };
	struct kvt *pc;
	float *W = malloc((size_t)d * cf->g.K * L * sizeof *W);
	float **qbase = calloc(nprep, sizeof *qbase);
	struct kvd_pool *pool = NULL;

	if (!(pc = kvt_new()) || kvt_connect(pc, &o) || kvt_profile(pc, &cf->m)) {
		fprintf(stderr, "kvbench load: %s\n", pc ? kvt_error(pc) : "out of memory");
		goto stop;
	}
	memcpy(W, kvt_w(pc), (size_t)d * cf->g.K * L * sizeof *W);
	cf->seg_tokens = kvt_model(pc)->segment_tokens;
	cf->slot_size = kvt_slot_size(pc);
	kvt_close(pc);
	if (cf->ctx - cf->m.sink - cf->m.window > (uint64_t)MAXP / 2 * cf->seg_tokens) {
		fprintf(stderr, "kvbench load: --ctx above %u tokens\n", MAXP / 2 * cf->seg_tokens);
		goto stop;
	}
	cf->chunk = kvd_rows_fit(H, d, L, cf->slot_size);
	/* The noisy neighbour's batch: by default the largest the protocol
	 * allows (its client asks for slots big enough). */
	if (!cf->batch)
		cf->batch = KVD_WIRE_MAX_NSEQ;

	if (!cf->json)
		printf("kvbench load: %u-token sequences, %u sparse layers (Llama-3.1-8B heads, K=10, "
		       "L=150), %u steps, clients %u..%u; preparing rows...\n",
		       cf->ctx, cf->layers, cf->steps, cf->cl[0], cf->nmax);
	fflush(stdout);
	if (kvd_pool_create(0, 1, &pool) || prepare(cf, W, pool, nprep, qbase) ||
	    make_queries(cf, W, qbase)) {
		fprintf(stderr, "kvbench load: out of memory preparing the data\n");
		goto stop;
	}
	double t_prep = bench_now_ms(), inproc_s = inproc(cf, pool), t_inproc = bench_now_ms();

	kvd_pool_destroy(pool);
	pool = NULL;
	if (inproc_s < 0) {
		fprintf(stderr, "kvbench load: in-process engine failed\n");
		goto stop;
	}

	/* the clients */
	cf->per = cf->steps * cf->layers;
	cf->sh = shared_mem(sizeof *cf->sh + (size_t)2 * MAXN * MAXC * cf->per * sizeof(float));
	if (!cf->sh)
		goto stop;
	struct shared *sh = cf->sh;
	struct clients_thr ct = { cf, 0 };

	pthread_create(&clt, NULL, clients_main, &ct);
	for (uint32_t r; (r = atomic_load(&sh->ready)) < cf->nmax + 2 && !atomic_load(&sh->failed);)
		fwait(&sh->ready, r);
	t_setup = bench_now_ms();
	uint32_t nph = 0;

	for (uint32_t scen = 0; scen < 2 && !atomic_load(&sh->failed); scen++)
		for (uint32_t k = 0; k < cf->ncl && !atomic_load(&sh->failed); k++, nph++) {
			uint32_t gen = nph + 1;

			sh->scen = scen;
			sh->N = cf->cl[k];
			atomic_store(&sh->done, 0);
			if (scen == 1) {
				atomic_store(&sh->noise_started, 0);
				atomic_store(&sh->noise_idle, 0);
				fstore(&sh->noise_go, gen);
				for (uint32_t r; (r = atomic_load(&sh->noise_started)) < 2 &&
						 !atomic_load(&sh->failed);)
					fwait(&sh->noise_started, r);
			}
			fstore(&sh->go, gen);
			for (uint32_t r; (r = atomic_load(&sh->done)) < sh->N && !atomic_load(&sh->failed);)
				fwait(&sh->done, r);
			if (scen == 1) {
				fstore(&sh->noise_stop, gen);
				for (uint32_t r; (r = atomic_load(&sh->noise_idle)) < 2 &&
						 !atomic_load(&sh->failed);)
					fwait(&sh->noise_idle, r);
			}
		}
	t_meas = bench_now_ms();
	char tnames[512];
	int nthr = daemon_threads(srv.pid, tnames, sizeof tnames);

	fstore(&sh->go, END_GEN);
	fstore(&sh->noise_go, END_GEN);
	pthread_join(clt, NULL);
	double t_wd_end = bench_now_ms();
	int st = daemon_stop(&srv);

	atomic_store(&wd->stop, 1);
	pthread_join(wdt, NULL);
	close(wd->fd);
	unlink(wd->path);
	if (ct.failed || atomic_load(&sh->failed)) {
		for (uint32_t i = 0; i < cf->nmax + 2; i++)
			if (sh->err[i][0])
				fprintf(stderr, "kvbench load: client %u: %s\n", i, sh->err[i]);
		return 1;
	}

	/* ---- report ---- */
	uint64_t comparisons = 0, mism = 0;
	double p99_all[2][MAXN], p99_worst[2][MAXN], thr[2][MAXN];
	float *all = malloc((size_t)MAXC * cf->per * sizeof *all);

	if (!cf->json)
		printf("\n%-4s %3s %6s %-7s %6s %9s %9s %9s %5s\n", "scen", "N", "client", "workload",
		       "count", "p50_ms", "p99_ms", "max_ms", "diff");
	for (uint32_t ph = 0; ph < nph; ph++) {
		uint32_t scen = ph / cf->ncl, k = ph % cf->ncl, N = cf->cl[k], na = 0;
		double t0 = 1e300, t1 = 0, worst = 0;
		const char *sn = scen ? "B" : "A";

		for (uint32_t i = 0; i < N; i++) {
			struct phase_res *pr = &sh->pr[ph][i];
			float *lat = lat_of(cf, ph, i);

			memcpy(all + na, lat, pr->n * sizeof *all);
			na += pr->n;
			comparisons += pr->n;
			mism += pr->mism;
			t0 = pr->t0 < t0 ? pr->t0 : t0;
			t1 = pr->t1 > t1 ? pr->t1 : t1;
			float p50 = pct(lat, pr->n, 0.5), p99 = pct(lat, pr->n, 0.99);

			worst = p99 > worst ? p99 : worst;
			if (cf->json)
				printf("{\"bench\":\"load\",\"line\":\"client\",\"scenario\":\"%s\",\"clients\":%u,"
				       "\"client\":%u,\"workload\":\"%s\",\"count\":%u,\"p50_ms\":%.3f,"
				       "\"p99_ms\":%.3f,\"max_ms\":%.3f,\"mismatches\":%u}\n",
				       sn, N, i, kvd_wl_name((enum kvd_wl)(i % KVD_WL_COUNT)), pr->n, p50, p99,
				       lat[pr->n - 1], pr->mism);
			else
				printf("%-4s %3u %6u %-7s %6u %9.3f %9.3f %9.3f %5u\n", sn, N, i,
				       kvd_wl_name((enum kvd_wl)(i % KVD_WL_COUNT)), pr->n, p50, p99,
				       lat[pr->n - 1], pr->mism);
		}
		double wall = (t1 - t0) / 1e3;

		thr[scen][k] = na / wall;
		p99_worst[scen][k] = worst;
		float p50a = pct(all, na, 0.5);

		p99_all[scen][k] = pct(all, na, 0.99);
		struct noise_res *nr = &sh->nr[ph];
		float bp50 = pct(nr->batch_ms, nr->nbl, 0.5);

		if (scen) {
			comparisons += nr->records;
			mism += nr->mism;
		}
		if (cf->json) {
			printf("{\"bench\":\"load\",\"line\":\"aggregate\",\"scenario\":\"%s\",\"clients\":%u,"
			       "\"attends\":%u,\"wall_s\":%.3f,\"attends_per_s\":%.1f,\"p50_ms\":%.3f,"
			       "\"p99_ms\":%.3f,\"worst_client_p99_ms\":%.3f",
			       sn, N, na, wall, thr[scen][k], p50a, p99_all[scen][k], worst);
			if (scen)
				printf(",\"batch_records\":%u,\"batches\":%llu,\"batch_p50_ms\":%.1f,"
				       "\"batch_mismatches\":%llu,\"prefill_tokens\":%llu,"
				       "\"prefill_tok_s\":%.0f,\"prefills_done\":%llu",
				       cf->batch, (unsigned long long)nr->batches, bp50,
				       (unsigned long long)nr->mism, (unsigned long long)nr->tokens,
				       nr->tokens / wall, (unsigned long long)nr->seqs);
			printf("}\n");
		} else {
			printf("%-4s %3u    all %-7s %6u %9.3f %9.3f %9s   %.1f layer-attends/s over %.2f s\n",
			       sn, N, "", na, p50a, p99_all[scen][k], "", thr[scen][k], wall);
			if (scen)
				printf("          neighbours: %llu batches of %u records (p50 %.1f ms), "
				       "%llu tokens prefilled (%.0f tok/s)\n",
				       (unsigned long long)nr->batches, cf->batch, bp50,
				       (unsigned long long)nr->tokens, nr->tokens / wall);
		}
	}
	free(all);

	/* the summary */
	uint32_t k4 = 0, k8 = 0;

	for (uint32_t k = 0; k < cf->ncl; k++) {
		if (cf->cl[k] <= 4 && cf->cl[k] >= cf->cl[k4])
			k4 = k;
		if (cf->cl[k] >= cf->cl[k8])
			k8 = k;
	}
	size_t nq = (size_t)cf->nmax * cf->layers * cf->steps;
	double inproc_tp = nq / inproc_s, gap = 0;

	for (uint32_t j = 1; j < wd->n; j++)
		gap = wd->t[j] - wd->t[j - 1] > gap ? wd->t[j] - wd->t[j - 1] : gap;
	if (wd->n)
		gap = t_wd_end - wd->t[wd->n - 1] > gap ? t_wd_end - wd->t[wd->n - 1] : gap;
	int identical = mism == 0 && comparisons > 0;
	double ratio = p99_all[1][k4] / p99_all[0][k4];
	double ratio_w = p99_worst[1][k4] / p99_worst[0][k4];
	double vs = thr[0][k8] / inproc_tp;
	double total_s = (bench_now_ms() - t_start) / 1e3;
	long cores = sysconf(_SC_NPROCESSORS_ONLN);

	if (cf->json) {
		printf("{\"bench\":\"load\",\"line\":\"inproc\",\"clients\":%u,\"attends\":%zu,"
		       "\"wall_s\":%.3f,\"attends_per_s\":%.1f,\"submitters\":1}\n",
		       cf->nmax, nq, inproc_s, inproc_tp);
		printf("{\"bench\":\"load\",\"line\":\"summary\",\"ctx\":%u,\"layers\":%u,\"steps\":%u,"
		       "\"q_heads\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"K\":%u,\"L\":%u,\"c\":%u,"
		       "\"batch_records\":%u,\"prefill_tokens_per_layer\":%u,"
		       "\"p99_ratio_noisy\":%.3f,\"p99_ratio_noisy_worst_client\":%.3f,\"p99_ratio_clients\":%u,"
		       "\"throughput_vs_inproc\":%.3f,\"throughput_clients\":%u,"
		       "\"watchdog_usec\":%d,\"watchdog_pings\":%u,\"watchdog_max_gap_ms\":%.1f,"
		       "\"identical\":%s,\"comparisons\":%llu,\"mismatches\":%llu,"
		       "\"cpu\":\"%s\",\"cores\":%ld,\"daemon_threads\":%d,\"daemon_thread_names\":\"%s\","
		       "\"kvd_exit\":%d,\"setup_s\":%.1f,\"setup_prep_s\":%.1f,\"setup_inproc_s\":%.1f,"
		       "\"setup_clients_s\":%.1f,\"measure_s\":%.1f,\"total_s\":%.1f}\n",
		       cf->ctx, cf->layers, cf->steps, Hq, H, d, cf->g.K, L, cf->g.c, cf->batch,
		       cf->big.n, ratio, ratio_w, cf->cl[k4], vs,
		       cf->cl[k8], WD_USEC, wd->n, gap, identical ? "true" : "false",
		       (unsigned long long)comparisons, (unsigned long long)mism, bench_cpu_name(),
		       cores, nthr, tnames, st, (t_setup - t_start) / 1e3, (t_prep - t_start) / 1e3,
		       (t_inproc - t_prep) / 1e3, (t_setup - t_inproc) / 1e3, (t_meas - t_setup) / 1e3,
		       total_s);
	} else {
		printf("\nin-process engine (one submitter, %u clients' work): %zu layer-attends in %.2f s, "
		       "%.1f/s\n", cf->nmax, nq, inproc_s, inproc_tp);
		printf("p99 with neighbours / without at N=%u: %.2f (all samples), %.2f (worst client)\n",
		       cf->cl[k4], ratio, ratio_w);
		printf("throughput through kvd / in-process at N=%u: %.3f\n", cf->cl[k8], vs);
		printf("watchdog (WATCHDOG_USEC=%d): %u pings, max gap %.1f ms\n", WD_USEC, wd->n, gap);
		printf("identical: %s (%llu answers compared, %llu differ)\n", identical ? "yes" : "NO",
		       (unsigned long long)comparisons, (unsigned long long)mism);
		printf("%s, %ld cores; kvd: %d threads (%s), exit status %d\n", bench_cpu_name(), cores,
		       nthr, tnames, st);
		printf("setup %.1f s (data %.1f, in-process %.1f, clients' prefill %.1f), measurement "
		       "%.1f s, %.1f s in all\n", (t_setup - t_start) / 1e3, (t_prep - t_start) / 1e3,
		       (t_inproc - t_prep) / 1e3, (t_setup - t_inproc) / 1e3, (t_meas - t_setup) / 1e3,
		       total_s);
	}
	return identical && st == 0 ? 0 : 1;
stop:
	if (pool)
		kvd_pool_destroy(pool);
	daemon_stop(&srv);
	atomic_store(&wd->stop, 1);
	pthread_join(wdt, NULL);
	unlink(wd->path);
	return rc;
}
