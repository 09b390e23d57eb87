/* The synthetic workload; docs/WORKLOADS.md is the specification.
 *
 * Every random number is addressed by (stream, index) through the
 * counter-based generator of rng.h, never drawn from a shared cursor, so a
 * key's value depends only on (seed, kv head, token, dim): the bulk can be
 * split across threads any way without changing a bit, keys do not move
 * when q_heads, kv_heads, the kind or n changes, and another implementation
 * can reproduce them from the document alone.  Only the few sequential
 * draws (needle positions, mixed picks, scale dimensions) use a cursor, each
 * on its own stream, serially.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE     /* sched_getaffinity; the Makefile defines it anyway */
#endif
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rng.h"
#include "synth.h"

/* The specification rounds each product before adding: a fused multiply-add
 * would move an occasional float32 result by one ulp.  gcc in ISO C mode
 * (-std=c11) does not contract; clang does unless told. */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

/* Stream labels: seed of (label, head) = fork(fork(make(seed), label), head).
 * Part of the specification; never renumber. */
enum {
	ST_MU = 1,      /* kv head: mu, normal index j */
	ST_SDIM,        /* kv head: the dimensions with s = 6, below() cursor */
	ST_Z,           /* kv head: z_t[j], normal index t*d + j */
	ST_R,           /* kv head: ln r_t / 0.25, normal index t */
	ST_SINK,        /* kv head: u, normal index j */
	ST_VAL,         /* kv head: v_t[j] - 0.5, normal index t*d + j */
	ST_QDIR,        /* q head: e (needle, dense), normal index j */
	ST_NF,          /* q head: f_i of needle i, normal index i*d + j */
	ST_NPOS,        /* q head: needle positions, below() cursor */
	ST_MPOS,        /* q head: the 64 keys of mixed, below() cursor */
	ST_MG,          /* q head: g of mixed, normal index j */
	ST_QSTEP,       /* q head: z_t[j] of decode step t >= 1, normal index (t-1)*d + j */
};
_Static_assert(ST_MG == 11 && ST_QSTEP == 12, "stream labels are part of the specification");

#define SCALE_DIMS   4
#define SCALE_HI     6.0
#define MU_GAIN      3.0
#define LOGR_SIGMA   0.25
#define SINK_GAIN    40.0
#define VAL_MEAN     0.5
#define SINK_Q       0.15
#define NEEDLE_Q     1.5
#define NEEDLE_COS   0.8
#define NEEDLE_SIN   0.6
#define NEEDLE_NORM  2.0
#define NEEDLE_GUARD 1024u      /* needles stay out of the last 1024 tokens */
#define DENSE_Q      0.35
#define MIXED_Q      0.6
#define MIXED_KEYS   64u
#define BLOCK        1024u      /* tokens per parallel task */
#define MAX_THREADS  64u

static uint64_t stream(uint64_t seed, uint64_t label, uint64_t head)
{
	struct kvd_rng root = kvd_rng_make(seed);
	struct kvd_rng l = kvd_rng_fork(&root, label);

	return kvd_rng_fork(&l, head).seed;
}

/* A uniformly random unit vector from normals base .. base+d-1 of a stream.
 * A zero draw cannot happen in practice; e_0 keeps the result defined. */
static void unit_vec(double *x, uint32_t d, uint64_t seed, uint64_t base)
{
	double nn = 0.0;

	for (uint32_t j = 0; j < d; j++) {
		x[j] = kvd_rng_normal_at(seed, base + j);
		nn += x[j] * x[j];
	}
	if (nn == 0.0) {
		memset(x, 0, d * sizeof(*x));
		x[0] = 1.0;
		return;
	}
	nn = 1.0 / sqrt(nn);
	for (uint32_t j = 0; j < d; j++)
		x[j] *= nn;
}

static int in_list(const uint32_t *a, uint32_t n, uint32_t x)
{
	for (uint32_t i = 0; i < n; i++)
		if (a[i] == x)
			return 1;
	return 0;
}

/* Per kv head constants and the statistics of its non-sink keys. */
struct head {
	uint64_t seed_z, seed_r, seed_v;
	double *mu, *s, *u;     /* [d] each */
	double *m;              /* [d] mean of non-sink keys (needle, mixed) */
	double T;               /* RMS norm of the centered non-sink keys */
};

struct job {
	struct kvd_synth *w;
	struct head *hd;
	uint32_t nblk;
	void (*fn)(struct job *, uint32_t);
	atomic_uint next;
	uint32_t ntasks;
};

static void *worker(void *p)
{
	struct job *j = p;
	unsigned t;

	/* Tasks touch disjoint rows; relaxed is enough since pthread_join
	 * orders every write before the caller reads the result. */
	while ((t = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < j->ntasks)
		j->fn(j, t);
	return NULL;
}

static unsigned ncpus(void)
{
	cpu_set_t set;
	long n;

	if (sched_getaffinity(0, sizeof(set), &set) == 0)
		n = CPU_COUNT(&set);
	else
		n = sysconf(_SC_NPROCESSORS_ONLN);
	return n < 1 ? 1 : n > (long)MAX_THREADS ? MAX_THREADS : (unsigned)n;
}

/* Runs fn over tasks 0..ntasks-1 on up to one thread per CPU.  A thread that
 * cannot be created is just not used: the caller does the work itself. */
static void par_for(struct job *j, uint32_t ntasks, void (*fn)(struct job *, uint32_t))
{
	pthread_t th[MAX_THREADS];
	unsigned nt = ncpus(), started = 0;

	j->fn = fn;
	j->ntasks = ntasks;
	atomic_store_explicit(&j->next, 0, memory_order_relaxed);
	if (nt > ntasks)
		nt = ntasks;
	for (unsigned i = 1; i < nt; i++) {
		if (pthread_create(&th[started], NULL, worker, j) != 0)
			break;
		started++;
	}
	worker(j);
	for (unsigned i = 0; i < started; i++)
		pthread_join(th[i], NULL);
}

static void gen_block(struct job *j, uint32_t task)
{
	const struct kvd_synth *w = j->w;
	uint32_t h = task / j->nblk, d = w->d;
	const struct head *hd = &j->hd[h];
	uint64_t t0 = (uint64_t)(task % j->nblk) * BLOCK;
	uint64_t t1 = t0 + BLOCK < w->n ? t0 + BLOCK : w->n;

	for (uint64_t t = t0; t < t1; t++) {
		float *k = w->k + ((size_t)h * w->n + t) * d;
		float *v = w->v + ((size_t)h * w->n + t) * d;

		if (t < KVD_SYNTH_SINKS) {
			for (uint32_t e = 0; e < d; e++)
				k[e] = (float)(hd->mu[e] + SINK_GAIN * hd->u[e]);
		} else {
			double r = exp(LOGR_SIGMA * kvd_rng_normal_at(hd->seed_r, t));

			for (uint32_t e = 0; e < d; e++)
				k[e] = (float)(MU_GAIN * hd->mu[e] +
					       r * hd->s[e] * kvd_rng_normal_at(hd->seed_z, t * d + e));
		}
		for (uint32_t e = 0; e < d; e++)
			v[e] = (float)(VAL_MEAN + kvd_rng_normal_at(hd->seed_v, t * d + e));
	}
}

/* Mean and RMS centered norm of one kv head's non-sink keys, in double and
 * in token order, so they do not depend on how the keys were generated. */
static void stats_head(struct job *j, uint32_t h)
{
	const struct kvd_synth *w = j->w;
	struct head *hd = &j->hd[h];
	uint32_t d = w->d;
	double cnt = (double)(w->n - KVD_SYNTH_SINKS), ss = 0.0;

	memset(hd->m, 0, d * sizeof(double));
	for (size_t t = KVD_SYNTH_SINKS; t < w->n; t++) {
		const float *k = w->k + ((size_t)h * w->n + t) * d;

		for (uint32_t e = 0; e < d; e++)
			hd->m[e] += k[e];
	}
	for (uint32_t e = 0; e < d; e++)
		hd->m[e] /= cnt;
	for (size_t t = KVD_SYNTH_SINKS; t < w->n; t++) {
		const float *k = w->k + ((size_t)h * w->n + t) * d;

		for (uint32_t e = 0; e < d; e++) {
			double c = k[e] - hd->m[e];

			ss += c * c;
		}
	}
	hd->T = sqrt(ss / cnt);
}

static void head_setup(struct head *hd, uint32_t h, uint32_t d, uint64_t seed)
{
	struct kvd_rng sd = kvd_rng_make(stream(seed, ST_SDIM, h));
	uint32_t dims[SCALE_DIMS], nd = d < SCALE_DIMS ? d : SCALE_DIMS;
	uint64_t smu = stream(seed, ST_MU, h);

	hd->seed_z = stream(seed, ST_Z, h);
	hd->seed_r = stream(seed, ST_R, h);
	hd->seed_v = stream(seed, ST_VAL, h);
	for (uint32_t e = 0; e < d; e++) {
		hd->mu[e] = kvd_rng_normal_at(smu, e);
		hd->s[e] = 1.0;
	}
	/* Distinct dimensions by rejection, in draw order. */
	for (uint32_t i = 0; i < nd; i++) {
		uint32_t x;

		do
			x = kvd_rng_below(&sd, d);
		while (in_list(dims, i, x));
		dims[i] = x;
		hd->s[x] = SCALE_HI;
	}
	unit_vec(hd->u, d, stream(seed, ST_SINK, h), 0);
}

static int bad_shape(enum kvd_wl kind, uint32_t n, uint32_t q_heads, uint32_t kv_heads,
		     uint32_t d)
{
	uint64_t G;

	if ((unsigned)kind >= KVD_WL_COUNT || n == 0 || d == 0 || kv_heads == 0 ||
	    q_heads == 0 || q_heads % kv_heads)
		return 1;
	G = q_heads / kv_heads;
	switch (kind) {
	case KVD_WL_NEEDLE:
		/* f needs a direction orthogonal to e, and every needle of a
		 * group its own position before the guard. */
		return d < 2 || n <= KVD_SYNTH_SINKS + NEEDLE_GUARD ||
		       n - KVD_SYNTH_SINKS - NEEDLE_GUARD < G * KVD_SYNTH_NEEDLES;
	case KVD_WL_MIXED:
		return n < KVD_SYNTH_SINKS + MIXED_KEYS;
	default:
		return 0;
	}
}

/* Needles of q head g: positions distinct within the kv head's group (taken
 * holds the group's earlier ones), keys planted after m and T were taken. */
static void plant(struct kvd_synth *w, const struct head *hd, uint32_t g, const double *e,
		  double *f, uint32_t *taken, uint32_t ntaken, uint64_t seed)
{
	struct kvd_rng pr = kvd_rng_make(stream(seed, ST_NPOS, g));
	uint64_t sf = stream(seed, ST_NF, g);
	uint32_t d = w->d, h = g / (w->q_heads / w->kv_heads);
	uint32_t range = w->n - KVD_SYNTH_SINKS - NEEDLE_GUARD;

	for (uint32_t i = 0; i < KVD_SYNTH_NEEDLES; i++) {
		uint32_t p;
		double dot = 0.0, nn = 0.0;
		float *k;

		do
			p = KVD_SYNTH_SINKS + kvd_rng_below(&pr, range);
		while (in_list(taken, ntaken, p));
		taken[ntaken++] = p;
		w->needle_pos[(size_t)g * KVD_SYNTH_NEEDLES + i] = p;

		/* Gram-Schmidt against e.  A draw (nearly) parallel to e has
		 * probability zero; f then comes from axis 0, or axis 1 when e
		 * lies close to axis 0, so that it is still defined. */
		for (uint32_t j = 0; j < d; j++) {
			f[j] = kvd_rng_normal_at(sf, (uint64_t)i * d + j);
			dot += f[j] * e[j];
		}
		for (uint32_t j = 0; j < d; j++) {
			f[j] -= dot * e[j];
			nn += f[j] * f[j];
		}
		if (nn < 1e-12) {
			uint32_t a = fabs(e[0]) < 0.5 ? 0 : 1;

			for (uint32_t j = 0; j < d; j++)
				f[j] = (j == a) - e[a] * e[j];
			nn = 0.0;
			for (uint32_t j = 0; j < d; j++)
				nn += f[j] * f[j];
		}
		nn = 1.0 / sqrt(nn);
		for (uint32_t j = 0; j < d; j++)
			f[j] *= nn;
		k = w->k + ((size_t)h * w->n + p) * d;
		for (uint32_t j = 0; j < d; j++)
			k[j] = (float)(hd->m[j] + NEEDLE_NORM * hd->T *
				       (NEEDLE_COS * e[j] + NEEDLE_SIN * f[j]));
	}
}

/* ê of mixed: the normalised sum of MIXED_KEYS distinct non-sink keys of the
 * kv head, centered with m. */
static void mixed_dir(const struct kvd_synth *w, const struct head *hd, uint32_t g,
		      double *e, uint64_t seed)
{
	struct kvd_rng pr = kvd_rng_make(stream(seed, ST_MPOS, g));
	uint32_t pick[MIXED_KEYS], d = w->d, h = g / (w->q_heads / w->kv_heads);
	double nn = 0.0;

	for (uint32_t i = 0; i < MIXED_KEYS; i++) {
		uint32_t p;

		do
			p = KVD_SYNTH_SINKS + kvd_rng_below(&pr, w->n - KVD_SYNTH_SINKS);
		while (in_list(pick, i, p));
		pick[i] = p;
	}
	memset(e, 0, d * sizeof(*e));
	for (uint32_t i = 0; i < MIXED_KEYS; i++) {
		const float *k = w->k + ((size_t)h * w->n + pick[i]) * d;

		for (uint32_t j = 0; j < d; j++)
			e[j] += k[j] - hd->m[j];
	}
	for (uint32_t j = 0; j < d; j++)
		nn += e[j] * e[j];
	if (nn > 0.0) {
		nn = 1.0 / sqrt(nn);
		for (uint32_t j = 0; j < d; j++)
			e[j] *= nn;
	}
}

static void make_queries(struct kvd_synth *w, struct head *hd, double *e, double *f,
			 uint32_t *taken, uint64_t seed)
{
	uint32_t d = w->d, G = w->q_heads / w->kv_heads;
	double sd = sqrt((double)d);

	for (uint32_t g = 0; g < w->q_heads; g++) {
		const struct head *h = &hd[g / G];
		float *q = w->q + (size_t)g * d;
		uint64_t smg;

		switch (w->kind) {
		case KVD_WL_NEEDLE:
			unit_vec(e, d, stream(seed, ST_QDIR, g), 0);
			plant(w, h, g, e, f, taken, (g % G) * KVD_SYNTH_NEEDLES, seed);
			for (uint32_t j = 0; j < d; j++)
				q[j] = (float)(NEEDLE_Q * sd * e[j] + SINK_Q * sd * h->u[j]);
			break;
		case KVD_WL_DENSE:
			unit_vec(e, d, stream(seed, ST_QDIR, g), 0);
			for (uint32_t j = 0; j < d; j++)
				q[j] = (float)(DENSE_Q * sd * e[j] + SINK_Q * sd * h->u[j]);
			break;
		default:
			mixed_dir(w, h, g, e, seed);
			smg = stream(seed, ST_MG, g);
			for (uint32_t j = 0; j < d; j++) {
				double gj = kvd_rng_normal_at(smg, j);

				q[j] = (float)(MIXED_Q * sd * (0.5 * e[j] + 0.5 * gj / sd) +
					       SINK_Q * sd * h->u[j]);
			}
			break;
		}
	}
}

int kvd_synth_make(struct kvd_synth *w, enum kvd_wl kind, uint32_t n, uint32_t q_heads,
		   uint32_t kv_heads, uint32_t d, uint64_t seed)
{
	struct job job = { 0 };
	struct head *hd = NULL;
	double *scratch = NULL, *e, *f;
	uint32_t *taken = NULL;
	size_t nkv, bytes, qbytes;

	memset(w, 0, sizeof(*w));
	if (bad_shape(kind, n, q_heads, kv_heads, d))
		return -EINVAL;
	/* Too big to address: the array size, a normal's counter 2*(t*d + j)
	 * and the task count must not wrap (malloc would fail long before). */
	if (__builtin_mul_overflow((size_t)kv_heads * n, (size_t)d, &nkv) ||
	    __builtin_mul_overflow(nkv, sizeof(float), &bytes) ||
	    __builtin_mul_overflow((size_t)q_heads * d, sizeof(float), &qbytes) ||
	    (uint64_t)n * d > UINT64_MAX / 4 ||
	    (uint64_t)kv_heads * ((n + BLOCK - 1) / BLOCK) > UINT32_MAX - MAX_THREADS)
		return -EINVAL;

	w->kind = kind;
	w->n = n;
	w->q_heads = q_heads;
	w->kv_heads = kv_heads;
	w->d = d;
	w->k = malloc(bytes);
	w->v = malloc(bytes);
	w->q = malloc(qbytes);
	hd = calloc(kv_heads, sizeof(*hd));
	/* mu, s, u, m per kv head, then e and f for the query pass. */
	scratch = calloc(((size_t)kv_heads * 4 + 2) * d, sizeof(double));
	if (kind == KVD_WL_NEEDLE) {
		w->needle_pos = calloc((size_t)q_heads * KVD_SYNTH_NEEDLES, sizeof(uint32_t));
		taken = calloc((size_t)(q_heads / kv_heads) * KVD_SYNTH_NEEDLES,
			       sizeof(uint32_t));
	}
	if (!w->k || !w->v || !w->q || !hd || !scratch ||
	    (kind == KVD_WL_NEEDLE && (!w->needle_pos || !taken))) {
		free(hd);
		free(scratch);
		free(taken);
		kvd_synth_free(w);
		return -ENOMEM;
	}

	for (uint32_t h = 0; h < kv_heads; h++) {
		double *b = scratch + (size_t)h * 4 * d;

		hd[h].mu = b;
		hd[h].s = b + d;
		hd[h].u = b + 2 * (size_t)d;
		hd[h].m = b + 3 * (size_t)d;
		head_setup(&hd[h], h, d, seed);
	}
	e = scratch + (size_t)kv_heads * 4 * d;
	f = e + d;

	job.w = w;
	job.hd = hd;
	job.nblk = (n + BLOCK - 1) / BLOCK;
	par_for(&job, kv_heads * job.nblk, gen_block);
	/* Dense never centers anything: m and T are left unset. */
	if (kind != KVD_WL_DENSE)
		par_for(&job, kv_heads, stats_head);
	make_queries(w, hd, e, f, taken, seed);

	free(hd);
	free(scratch);
	free(taken);
	return 0;
}

void kvd_synth_free(struct kvd_synth *w)
{
	free(w->k);
	free(w->v);
	free(w->q);
	free(w->needle_pos);
	memset(w, 0, sizeof(*w));
}

/* An AR(1) walk per dimension: delta_t = rho delta_{t-1} + sqrt(1-rho^2) z_t
 * keeps every step's delta a unit-variance normal once stationary, while
 * consecutive steps share rho of it, as successive decode queries do.  The
 * loop runs j outside t so each dimension's walk is one scalar: no scratch,
 * no -ENOMEM, and the order of operations is the document's per element. */
int kvd_synth_steps(const struct kvd_synth *w, uint32_t steps, uint64_t seed, float *out)
{
	uint32_t d = w->d, qh = w->q_heads;
	size_t plane = (size_t)qh * d, total;
	double a = KVD_SYNTH_RHO, b = sqrt(1.0 - KVD_SYNTH_RHO * KVD_SYNTH_RHO);
	double sd = sqrt((double)d);

	/* The normal counter 2*((t-1)*d + j) must not wrap either. */
	if (steps == 0 || __builtin_mul_overflow(plane, (size_t)steps, &total) ||
	    __builtin_mul_overflow(total, sizeof(float), &total) ||
	    (uint64_t)steps * d > UINT64_MAX / 4)
		return -EINVAL;
	/* Step 0 is copied, not recomputed: q0 + sigma*0 would turn -0 into +0. */
	memcpy(out, w->q, plane * sizeof(float));
	for (uint32_t g = 0; g < qh; g++) {
		const float *q0 = w->q + (size_t)g * d;
		uint64_t sz = stream(seed, ST_QSTEP, g);
		double nn = 0.0, sigma;

		for (uint32_t j = 0; j < d; j++)
			nn += (double)q0[j] * q0[j];
		sigma = KVD_SYNTH_DRIFT * sqrt(nn) / sd;
		for (uint32_t j = 0; j < d; j++) {
			double delta = 0.0;

			for (uint32_t t = 1; t < steps; t++) {
				double z = kvd_rng_normal_at(sz, (uint64_t)(t - 1) * d + j);

				delta = a * delta + b * z;
				out[(size_t)t * plane + (size_t)g * d + j] = (float)(q0[j] + sigma * delta);
			}
		}
	}
	return 0;
}

static const char *const wl_names[KVD_WL_COUNT] = {
	[KVD_WL_NEEDLE] = "needle",
	[KVD_WL_DENSE] = "dense",
	[KVD_WL_MIXED] = "mixed",
};

const char *kvd_wl_name(enum kvd_wl kind)
{
	return (unsigned)kind < KVD_WL_COUNT ? wl_names[kind] : "?";
}

int kvd_wl_parse(const char *name)
{
	for (int i = 0; name && i < KVD_WL_COUNT; i++)
		if (strcmp(name, wl_names[i]) == 0)
			return i;
	return -1;
}
