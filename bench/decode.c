/* kvbench decode: the decode loop as a GPU worker runs it, on the CPU,
 * against a real kvd over the shared-memory rings.
 *
 *   kvbench decode [--json] [--seqs B] [--ctx N] [--layers S] [--steps T]
 *                  [--measure M] [--estimator NAME|default] [--kv-dtype bf16|int8]
 *                  [--kl KxL] [--threads N]
 *
 * B sequences of N prompt tokens (kvd_synth, sequence b of workload b mod 3,
 * as the demo's clients) in S sparse layers of Llama-3.1-8B shape (32 q / 8
 * kv heads, d = 128).  Each of T decode steps appends one token to every
 * layer of every sequence and, layer after layer, ATTENDs the layer for all
 * B sequences in one kvc_attend call, the next layer only once the previous
 * answer is back: what a worker's forward pass does.  Two configurations run
 * in the same kvd on the same rows and queries, each with its own connection,
 * profile and sequences, alternated step by step (the first of a step
 * swaps every step): the candidate the flags ask for (`--estimator default`:
 * KVD_EST_CFG_DEFAULT, whatever --kl and --kv-dtype say), and MagicPIG K10
 * L150 bf16 (KVD_EST_CFG_MAGICPIG), the baseline, always.  The last M steps are measured: wall time,
 * kvd's CPU time (/proc/<kvd>/stat, around each configuration's layers) and
 * the error of the merged answer against exact attention over every token,
 * computed here in double between steps, off the timed path.
 * docs/ARCHITECTURE.md ("kvbench decode") explains every field.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/attn.h"
#include "bench.h"
#include "srv.h"
#include "engine/ref.h"
#include "engine/seg.h"
#include "engine/synth.h"

#define QH 32
#define KVH 8
#define HD 128
#define CTX_MAX 98304u

struct dec_opts {
	int json;
	uint32_t seqs, ctx, layers, steps, measure, K, L, c, est, kv_dtype, threads;
	int est_default;                /* --estimator default: KVD_EST_CFG_DEFAULT */
	uint32_t seg_tokens;            /* both profiles' segments (0: kvd's default) */
	int ctx_given;
};

/* One configuration: its connection, profile and sequences, and what its
 * measured steps added up to. */
struct dec_cfg {
	const char *role;
	struct kvc_model m;
	struct kvc *c;
	struct kvc_seq **s;             /* [B] */
	float *o;                       /* [S][B][QH][HD]: this step's answers */
	double wall_ms, cpu_ms, err2;
	uint64_t nerr;
	double wl_err2[KVD_WL_COUNT];   /* the same per workload */
	uint64_t wl_nerr[KVD_WL_COUNT];
};

static int usage(void)
{
	fprintf(stderr,
		"usage: kvbench decode [--json] [--seqs B<=64] [--ctx N] [--layers S] [--steps T]\n"
		"                      [--measure M<=T] [--estimator magicpig|hybrid|adaptive|default]\n"
		"                      [--kv-dtype bf16|int8] [--kl KxL] [--threads N]\n"
		"  defaults: 4 sequences, 98304 tokens (less where RAM is short), 4 layers,\n"
		"  64 steps, the last 16 measured, magicpig, bf16, 10x150, kvd's threads\n");
	return 2;
}

/* kvd's CPU time so far, user + system, every thread: ms.  -errno. */
static int kvd_cpu_ms(pid_t pid, double *ms)
{
	long long t = daemon_cpu_ticks(pid);

	if (t < 0)
		return -EINVAL;
	*ms = (double)t * 1e3 / (double)sysconf(_SC_CLK_TCK);
	return 0;
}

/* The default context: 98304 tokens, or the largest multiple of 4096 whose
 * rows fit in half the machine's memory -- kvd's segments of both
 * configurations (bf16: int8 is smaller), our float32 copy of every
 * sequence and one prefill buffer -- so nothing swaps or spills.  At the
 * smallest that leaves (a few thousand tokens), each configuration's step
 * still reads B * S layers, far more than any LLC. */
static uint32_t fit_ctx(const struct dec_opts *op, uint64_t *phys)
{
	struct kvd_geom g = { QH, KVH, HD, 10, op->L > 150 ? op->L : 150, 2, KVD_KV_BF16, 0 };
	double per_tok, seg;

	seg = (double)kvd_seg_bytes(&g, 32768) / 32768;
	*phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
	per_tok = 2.0 * op->seqs * op->layers * seg + (op->seqs + 1.0) * KVH * HD * 4 * 2;
	double fit = (double)*phys / 2 / per_tok;
	uint32_t n = fit >= CTX_MAX ? CTX_MAX : (uint32_t)(fit / 4096) * 4096;

	return n < 4096 ? 4096 : n;
}

/* ---- exact reference --------------------------------------------------- */

struct ref_job {
	const struct dec_opts *op;
	const struct kvd_synth *w;      /* [B] */
	const float *qs;                /* [S][T][B][QH][HD] */
	struct dec_cfg *cfg;            /* [2] */
	uint32_t step, ntask;
	uint32_t next;                  /* atomic */
	double err2[2][64 * 64];        /* [cfg][l * B + b] */
};

static const float *query(const struct dec_opts *op, const float *qs, uint32_t l, uint32_t t,
			  uint32_t b)
{
	return qs + (((size_t)l * op->steps + t) * op->seqs + b) * QH * HD;
}

/* Exact attention of (sequence b, layer l) over every token it holds,
 * double, against both configurations' answers. */
static void *ref_worker(void *arg)
{
	struct ref_job *j = arg;
	const struct dec_opts *op = j->op;
	uint32_t k;

	while ((k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->ntask) {
		uint32_t l = k / op->seqs, b = k % op->seqs, n = op->ctx + j->step + 1;
		const struct kvd_synth *w = &j->w[b];
		const float *q = query(op, j->qs, l, j->step, b);
		double num[2] = { 0, 0 }, den = 0;

		for (uint32_t qh = 0; qh < QH; qh++) {
			uint32_t h = qh / (QH / KVH);
			double ex[HD], lse;

			kvd_ref_dense(q + (size_t)qh * HD, HD, w->k + (size_t)h * w->n * HD,
				      w->v + (size_t)h * w->n * HD, NULL, n, ex, &lse);
			for (int c = 0; c < 2; c++) {
				const float *o = j->cfg[c].o + ((size_t)k * QH + qh) * HD;

				for (uint32_t e = 0; e < HD; e++)
					num[c] += (o[e] - ex[e]) * (o[e] - ex[e]);
			}
			for (uint32_t e = 0; e < HD; e++)
				den += ex[e] * ex[e];
		}
		for (int c = 0; c < 2; c++)
			j->err2[c][k] = num[c] / den;
	}
	return NULL;
}

static int reference(struct ref_job *j)
{
	long nt = sysconf(_SC_NPROCESSORS_ONLN);
	pthread_t th[64];
	int n = nt < 1 ? 1 : nt > 64 ? 64 : (int)nt;

	j->next = 0;
	for (int i = 1; i < n; i++)
		if (pthread_create(&th[i], NULL, ref_worker, j))
			n = i;
	ref_worker(j);
	for (int i = 1; i < n; i++)
		pthread_join(th[i], NULL);
	for (int c = 0; c < 2; c++)
		for (uint32_t k = 0; k < j->ntask; k++) {
			struct dec_cfg *cf = &j->cfg[c];
			uint32_t wl = j->w[k % j->op->seqs].kind;

			cf->err2 += j->err2[c][k];
			cf->nerr++;
			cf->wl_err2[wl] += j->err2[c][k];
			cf->wl_nerr[wl]++;
		}
	return 0;
}

/* ---- the loop ---------------------------------------------------------- */

static int cfg_open(struct dec_cfg *cf, const char *sock, const char *role, uint32_t B)
{
	struct kvc_opts o = { .socket_path = sock, .tenant = "bench", .name = role };

	cf->role = role;
	cf->s = calloc(B, sizeof *cf->s);
	cf->o = malloc((size_t)cf->m.layers * B * QH * HD * sizeof *cf->o);
	if (!cf->s || !cf->o)
		return -ENOMEM;
	if (kvc_connect(&o, &cf->c) || kvc_profile(cf->c, &cf->m)) {
		fprintf(stderr, "kvbench decode: %s profile: %s\n", role, kvc_last_error(cf->c));
		return -1;
	}
	for (uint32_t b = 0; b < B; b++)
		if (kvc_seq_create(cf->c, &cf->s[b])) {
			fprintf(stderr, "kvbench decode: %s: %s\n", role, kvc_last_error(cf->c));
			return -1;
		}
	return 0;
}

static void cfg_close(struct dec_cfg *cf, uint32_t B)
{
	for (uint32_t b = 0; cf->c && cf->s && b < B; b++)
		if (cf->s[b])
			kvc_seq_free(cf->c, cf->s[b]);
	if (cf->c)
		kvc_close(cf->c);
	free(cf->s);
	free(cf->o);
}

/* One decode step of one configuration: per layer, append this step's token
 * to every sequence, then ATTEND the layer for all of them at once. */
static int cfg_step(const struct dec_opts *op, struct dec_cfg *cf, const float *qs,
		    const float *kt, const float *vt, uint32_t t)
{
	uint32_t B = op->seqs;

	for (uint32_t l = 0; l < op->layers; l++) {
		for (uint32_t b = 0; b < B; b++)
			if (kvc_append(cf->c, cf->s[b], l, kt + (size_t)b * KVH * HD,
				       vt + (size_t)b * KVH * HD))
				goto fail;
		if (kvc_attend(cf->c, l, cf->s, B, query(op, qs, l, t, 0),
			       cf->o + (size_t)l * B * QH * HD, NULL))
			goto fail;
	}
	return 0;
fail:
	fprintf(stderr, "kvbench decode: %s, step %u: %s\n", cf->role, t, kvc_last_error(cf->c));
	return -1;
}

/* Token t of sequence w, [KVH][HD] each. */
static void token(const struct kvd_synth *w, uint32_t t, float *k, float *v)
{
	for (uint32_t h = 0; h < KVH; h++) {
		memcpy(k + (size_t)h * HD, w->k + ((size_t)h * w->n + t) * HD, HD * sizeof *k);
		memcpy(v + (size_t)h * HD, w->v + ((size_t)h * w->n + t) * HD, HD * sizeof *v);
	}
}

/* x with `prec` decimals, or null where it is not a number (a workload no
 * sequence had; a ratio to a CPU time below clock-tick resolution). */
static const char *jnum(char *buf, size_t n, double x, int prec)
{
	if (!isfinite(x))
		snprintf(buf, n, "null");
	else
		snprintf(buf, n, "%.*f", prec, x);
	return buf;
}

static void print_row(const struct dec_opts *op, const struct dec_cfg *cf,
		      const struct dec_cfg *base, unsigned kvd_threads, uint64_t kvd_bytes)
{
	double M = op->measure, per = M * op->layers * op->seqs;
	double tps = op->seqs * M * 1e3 / cf->wall_ms, core = cf->cpu_ms / per;
	double err = sqrt(cf->err2 / (double)cf->nerr);
	double btps = op->seqs * M * 1e3 / base->wall_ms, bcore = base->cpu_ms / per;
	double berr = sqrt(base->err2 / (double)base->nerr);
	double llc = (double)bench_llc_bytes();
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	char we[KVD_WL_COUNT][32], cv[32];

	for (int i = 0; i < KVD_WL_COUNT; i++) {
		uint64_t k = cf->wl_nerr[i];

		jnum(we[i], sizeof we[i], k ? sqrt(cf->wl_err2[i] / (double)k) : NAN, 5);
	}
	jnum(cv, sizeof cv, core / bcore, 4);
	if (op->json)
		printf("{\"bench\":\"decode\",\"config\":\"%s\",\"estimator\":\"%s\","
		       "\"kv_dtype\":\"%s\",\"K\":%u,\"L\":%u,\"seqs\":%u,\"ctx\":%u,\"layers\":%u,"
		       "\"steps\":%u,\"measured_steps\":%u,\"tokens_per_s\":%.3f,\"step_ms\":%.3f,"
		       "\"core_ms\":%.4f,\"kvd_cpu_ms\":%.0f,\"rel_err\":%.5f,"
		       "\"rel_err_needle\":%s,\"rel_err_dense\":%s,\"rel_err_mixed\":%s,"
		       "\"tokens_per_s_vs_magicpig\":%.4f,\"core_ms_vs_magicpig\":%s,"
		       "\"rel_err_vs_magicpig\":%.4f,\"kvd_threads\":%u,\"kvd_mib\":%.0f,"
		       "\"llc_mib\":%.0f,\"working_set_vs_llc\":%.0f,"
		       "\"machine\":\"%s, %ld CPUs\",\"nproc\":%ld}\n",
		       cf->role, kvd_estimator_name(cf->m.estimator),
		       kvd_kv_dtype_name(cf->m.kv_dtype), cf->m.K, cf->m.L, op->seqs, op->ctx,
		       op->layers, op->steps, op->measure, tps, cf->wall_ms / M, core, cf->cpu_ms,
		       err, we[KVD_WL_NEEDLE], we[KVD_WL_DENSE], we[KVD_WL_MIXED], tps / btps, cv,
		       err / berr, kvd_threads, kvd_bytes / 1048576.0, llc / 1048576.0,
		       kvd_bytes / 2.0 / llc, bench_cpu_name(), ncpu, ncpu);
	else
		printf("%-9s %-8s %-5s %3ux%-4u %9.2f %9.2f %9.3f %9.5f %8.3f %8s %8.3f  "
		       "%s %s %s\n", cf->role, kvd_estimator_name(cf->m.estimator),
		       kvd_kv_dtype_name(cf->m.kv_dtype), cf->m.K, cf->m.L, tps, cf->wall_ms / M,
		       core, err, tps / btps, cv, err / berr, we[0], we[1], we[2]);
}

static int run(const struct dec_opts *op, uint64_t phys)
{
	uint32_t B = op->seqs, S = op->layers, T = op->steps, N = op->ctx, n = N + T;
	struct kvd_synth *w = calloc(B, sizeof *w);
	float *qs = malloc((size_t)S * T * B * QH * HD * sizeof *qs);
	float *qt = malloc((size_t)T * QH * HD * sizeof *qt);
	float *k0 = malloc((size_t)KVH * N * HD * sizeof *k0);
	float *v0 = malloc((size_t)KVH * N * HD * sizeof *v0);
	float *kt = malloc((size_t)B * KVH * HD * sizeof *kt);
	float *vt = malloc((size_t)B * KVH * HD * sizeof *vt);
	struct ref_job *rj = calloc(1, sizeof *rj);
	struct dec_cfg cf[2];
	struct daemon srv = { 0 };
	struct kvc_stats st = { 0 };
	unsigned kvd_threads = op->threads ? op->threads : (unsigned)sysconf(_SC_NPROCESSORS_ONLN);
	int rc = 1, up = 0;

	memset(cf, 0, sizeof cf);
	if (!w || !qs || !qt || !k0 || !v0 || !kt || !vt || !rj) {
		fprintf(stderr, "kvbench decode: out of memory\n");
		goto out;
	}
	if (!op->ctx_given && N < CTX_MAX) {
		fprintf(op->json ? stderr : stdout, "kvbench decode: context %u, not %u: the "
			"largest that fits in half of this machine's %.1f GiB\n", N, CTX_MAX,
			phys / 1073741824.0);
		fflush(stdout);
	}
	/* Queries: sequence b's workload query, drifting over the steps as
	 * kvd_synth_steps makes decode queries drift (docs/WORKLOADS.md,
	 * "Decode steps"); each layer from its own drift stream, so the layers
	 * of a step ask different questions. */
	for (uint32_t b = 0; b < B; b++) {
		uint64_t seed = 1000 + b;

		if (kvd_synth_make(&w[b], (enum kvd_wl)(b % KVD_WL_COUNT), n, QH, KVH, HD, seed)) {
			fprintf(stderr, "kvbench decode: workload: out of memory\n");
			goto out;
		}
		for (uint32_t l = 0; l < S; l++) {
			if (kvd_synth_steps(&w[b], T, seed + ((uint64_t)l << 32), qt))
				goto out;
			for (uint32_t t = 0; t < T; t++)
				memcpy(qs + (((size_t)l * T + t) * B + b) * QH * HD,
				       qt + (size_t)t * QH * HD, (size_t)QH * HD * sizeof *qt);
		}
	}

	/* kvd with the asked-for executor threads (0: one per online CPU). */
	if (srv_start_threads(&srv, op->threads, NULL, NULL)) {
		fprintf(stderr, "kvbench decode: kvd did not start\n");
		goto out;
	}
	up = 1;
	cf[0].m = llama(S);
	cf[0].m.name = "decode-candidate";
	cf[0].m.K = op->K;
	cf[0].m.L = op->L;
	cf[0].m.c = op->c;
	cf[0].m.estimator = op->est;
	cf[0].m.kv_dtype = op->kv_dtype;
	cf[0].m.segment_tokens = op->seg_tokens;
	cf[1].m = llama(S);
	cf[1].m.name = "decode-magicpig";
	cf[1].m.K = KVD_EST_CFG_MAGICPIG.K;
	cf[1].m.L = KVD_EST_CFG_MAGICPIG.L;
	cf[1].m.c = KVD_EST_CFG_MAGICPIG.c;
	cf[1].m.estimator = KVD_EST_CFG_MAGICPIG.est;
	cf[1].m.kv_dtype = KVD_EST_CFG_MAGICPIG.kv_dtype;
	/* the candidate's segments: MagicPIG's estimate does not depend on them */
	cf[1].m.segment_tokens = op->seg_tokens;
	if (cfg_open(&cf[0], srv.sock, op->est_default ? "default" : "candidate", B) ||
	    cfg_open(&cf[1], srv.sock, "magicpig", B))
		goto out;

	/* Prefill: every layer of a sequence gets the same prompt (the data
	 * generator is not what is measured; the layers are still separate
	 * rows in kvd, each read cold). */
	double tp = bench_now_ms();

	for (uint32_t b = 0; b < B; b++) {
		for (uint32_t h = 0; h < KVH; h++) {
			memcpy(k0 + (size_t)h * N * HD, w[b].k + (size_t)h * n * HD,
			       (size_t)N * HD * sizeof *k0);
			memcpy(v0 + (size_t)h * N * HD, w[b].v + (size_t)h * n * HD,
			       (size_t)N * HD * sizeof *v0);
		}
		for (int c = 0; c < 2; c++)
			for (uint32_t l = 0; l < S; l++)
				if (kvc_prefill(cf[c].c, cf[c].s[b], l, k0, v0, N)) {
					fprintf(stderr, "kvbench decode: prefill: %s\n",
						kvc_last_error(cf[c].c));
					goto out;
				}
	}
	free(k0);
	free(v0);
	k0 = v0 = NULL;
	kvc_server_stats(cf[1].c, &st);
	if (!op->json) {
		printf("kvbench decode: %s, %ld CPUs, kvd %u threads; %u sequences of %u tokens "
		       "(needle, dense, mixed in turn), %u sparse layers,\n%u steps, the last %u "
		       "measured; kvd holds %.0f MiB, a configuration's step reads from %.0fx the "
		       "LLC (%zu MiB); prefill %.1f s\n",
		       bench_cpu_name(), sysconf(_SC_NPROCESSORS_ONLN), kvd_threads, B, N, S, T,
		       op->measure, st.bytes / 1048576.0, st.bytes / 2.0 / bench_llc_bytes(),
		       bench_llc_bytes() >> 20, (bench_now_ms() - tp) / 1e3);
		fflush(stdout);
	}

	*rj = (struct ref_job){ .op = op, .w = w, .qs = qs, .cfg = cf, .ntask = B * S };
	for (uint32_t t = 0; t < T; t++) {
		int measured = t >= T - op->measure;

		for (uint32_t b = 0; b < B; b++)
			token(&w[b], N + t, kt + (size_t)b * KVH * HD, vt + (size_t)b * KVH * HD);
		/* Alternate which configuration goes first, so neither always
		 * finds the other's leftovers (caches, kvd's spinning threads). */
		for (int i = 0; i < 2; i++) {
			struct dec_cfg *c = &cf[(t + i) & 1];
			double c0 = 0, c1 = 0, t0;

			if (measured && kvd_cpu_ms(srv.pid, &c0))
				goto cpu_fail;
			t0 = bench_now_ms();
			if (cfg_step(op, c, qs, kt, vt, t))
				goto out;
			if (measured) {
				c->wall_ms += bench_now_ms() - t0;
				if (kvd_cpu_ms(srv.pid, &c1))
					goto cpu_fail;
				c->cpu_ms += c1 - c0;
			}
		}
		if (measured) {
			rj->step = t;
			reference(rj);
		}
	}
	kvc_server_stats(cf[1].c, &st);
	if (!op->json)
		printf("\n%-9s %-8s %-5s %8s %9s %9s %9s %9s %8s %8s %8s  %s\n", "config",
		       "estimator", "dtype", "KxL", "tok/s", "step_ms", "core_ms", "rel_err",
		       "tok/s_vs", "core_vs", "err_vs", "rel_err needle dense mixed");
	print_row(op, &cf[0], &cf[1], kvd_threads, st.bytes);
	print_row(op, &cf[1], &cf[1], kvd_threads, st.bytes);
	if (!op->json)
		printf("(per configuration, over the measured steps: tok/s = B tokens per step / "
		       "the step's wall time\nfor its %u layers; core_ms = kvd's CPU time per "
		       "sequence per layer per step;\nrel_err = RMS of |o - exact| / |exact|; _vs: "
		       "against magicpig K10 L150 bf16)\n", S);
	rc = 0;
	goto out;
cpu_fail:
	fprintf(stderr, "kvbench decode: cannot read kvd's CPU time from /proc/%d/stat\n",
		(int)srv.pid);
out:
	for (int c = 0; c < 2; c++)
		cfg_close(&cf[c], B);
	if (up && daemon_stop(&srv) != 0 && !rc) {
		fprintf(stderr, "kvbench decode: kvd did not exit cleanly\n");
		rc = 1;
	}
	for (uint32_t b = 0; w && b < B; b++)
		kvd_synth_free(&w[b]);
	free(w);
	free(qs);
	free(qt);
	free(k0);
	free(v0);
	free(kt);
	free(vt);
	free(rj);
	return rc;
}

int bench_decode_main(int argc, char **argv)
{
	struct dec_opts op = { .seqs = 4, .layers = 4, .steps = 64, .measure = 16, .K = 10,
			       .L = 150, .c = 2, .est = KVD_EST_MAGICPIG, .kv_dtype = KVD_KV_BF16 };
	uint64_t phys;

	for (int i = 0; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;

		if (!strcmp(a, "--json")) {
			op.json = 1;
			continue;
		}
		if (!v)
			return usage();
		i++;
		if (!strcmp(a, "--estimator")) {
			if ((op.est_default = !strcmp(v, "default"))) {
				struct kvd_est_cfg d = KVD_EST_CFG_DEFAULT;

				op.est = d.est;
				op.K = d.K;
				op.L = d.L;
				op.c = d.c;
				op.kv_dtype = d.kv_dtype;
				op.seg_tokens = d.seg_tokens;
			} else if (kvd_estimator_parse(v, &op.est)) {
				return usage();
			}
		} else if (!strcmp(a, "--kv-dtype")) {
			if (kvd_kv_dtype_parse(v, &op.kv_dtype))
				return usage();
		} else if (!strcmp(a, "--kl")) {
			unsigned k, l;
			int used = 0;

			if (sscanf(v, "%ux%u%n", &k, &l, &used) != 2 || v[used])
				return usage();
			op.K = k;
			op.L = l;
		} else if (!strcmp(a, "--threads")) {
			/* 0: kvd's default, one per online CPU */
			if (strcmp(v, "0") && bench_parse_u32(v, &op.threads))
				return usage();
		} else {
			uint32_t *dst = !strcmp(a, "--seqs") ? &op.seqs :
					!strcmp(a, "--ctx") ? &op.ctx :
					!strcmp(a, "--layers") ? &op.layers :
					!strcmp(a, "--steps") ? &op.steps :
					!strcmp(a, "--measure") ? &op.measure : NULL;

			if (!dst || bench_parse_u32(v, dst))
				return usage();
			op.ctx_given |= dst == &op.ctx;
		}
	}
	/* needle workloads plant their keys beyond the first 1024 tokens */
	if (op.seqs > 64 || op.layers > 64 || op.measure > op.steps ||
	    (op.ctx_given && op.ctx < 2048))
		return usage();
	uint32_t fit = fit_ctx(&op, &phys);

	if (!op.ctx_given)
		op.ctx = fit;
	return run(&op, phys);
}
