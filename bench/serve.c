/* kvbench demo / serve: a real kvd and real decoding client processes.
 *
 *   kvbench demo  [--clients N] [--ctx N] [--steps N]
 *     The main job: starts kvd in a temporary run directory, runs N client
 *     processes that each prefill a synthetic context into every layer of a
 *     Llama-3.1-8B-shaped model and decode `steps` tokens, prints a table and
 *     stops kvd.
 *   kvbench serve [--json] [--clients N] [--ctx N] [--layers N] [--reps N]
 *     Decode steps through the daemon against the in-process engine on the
 *     same rows, same run: overhead_frac = daemon / in-process - 1.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/attn.h"
#include "bench.h"
#include "prefix.h"
#include "srv.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "engine/pool.h"
#include "engine/prep.h"
#include "engine/ref.h"
#include "engine/synth.h"

static int srv_start(struct daemon *s)
{
	return srv_start_conf(s, NULL, NULL);
}

/* ---- demo ---------------------------------------------------------------- */

#define MAX_LAT 65536

struct client_res {
	int ok;
	char err[160];
	char workload[16];
	double prefill_s, decode_s, rel_err;
	uint32_t nlat;
	float lat_ms[MAX_LAT];
};

static void copy_token(const struct kvd_synth *w, uint32_t t, float *k, float *v)
{
	for (uint32_t h = 0; h < w->kv_heads; h++) {
		memcpy(k + (size_t)h * w->d, w->k + ((size_t)h * w->n + t) * w->d, w->d * sizeof *k);
		memcpy(v + (size_t)h * w->d, w->v + ((size_t)h * w->n + t) * w->d, w->d * sizeof *v);
	}
}

/* One decoding process: every layer gets the same synthetic layer (the data
 * generator is not what is measured), each decode step appends one token
 * and attends every layer. */
static void demo_client(const char *sock, int id, uint32_t ctx, uint32_t steps,
			struct client_res *r)
{
	char name[32];
	struct kvc_opts o = { .socket_path = sock, .tenant = "demo", .name = name };
	struct kvc_model m = llama(32);
	struct kvc *c;
	struct kvc_seq *s;
	struct kvd_synth w;
	uint32_t n = ctx + steps, H = m.kv_heads, d = m.head_dim;
	enum kvd_wl kind = (enum kvd_wl)(id % KVD_WL_COUNT);

	snprintf(name, sizeof name, "demo-%d", id);
	snprintf(r->workload, sizeof r->workload, "%s", kvd_wl_name(kind));
	if (kvd_synth_make(&w, kind, n, m.q_heads, H, d, 1000 + (uint64_t)id)) {
		snprintf(r->err, sizeof r->err, "workload: out of memory");
		return;
	}
	if (kvc_connect(&o, &c) || kvc_profile(c, &m) || kvc_seq_create(c, &s)) {
		snprintf(r->err, sizeof r->err, "%s", kvc_last_error(c));
		return;
	}
	float *k0 = malloc((size_t)H * ctx * d * 4), *v0 = malloc((size_t)H * ctx * d * 4);
	float kt[8 * 128], vt[8 * 128], *o_ = malloc((size_t)m.q_heads * d * 4);

	for (uint32_t h = 0; h < H; h++) {
		memcpy(k0 + (size_t)h * ctx * d, w.k + (size_t)h * n * d, (size_t)ctx * d * 4);
		memcpy(v0 + (size_t)h * ctx * d, w.v + (size_t)h * n * d, (size_t)ctx * d * 4);
	}
	double t = bench_now_ms();

	for (uint32_t l = 0; l < m.layers; l++)
		if (kvc_prefill(c, s, l, k0, v0, ctx))
			goto fail;
	r->prefill_s = (bench_now_ms() - t) / 1e3;
	t = bench_now_ms();
	for (uint32_t step = 0; step < steps; step++) {
		copy_token(&w, ctx + step, kt, vt);
		for (uint32_t l = 0; l < m.layers; l++) {
			double t0 = bench_now_ms();

			if (kvc_append(c, s, l, kt, vt) || kvc_attend(c, l, &s, 1, w.q, o_, NULL))
				goto fail;
			if (r->nlat < MAX_LAT && !(l == 0 || l == 16))
				r->lat_ms[r->nlat++] = (float)(bench_now_ms() - t0);
		}
	}
	r->decode_s = (bench_now_ms() - t) / 1e3;

	/* The last step's layer 1 against exact attention over every token. */
	double num = 0, den = 0;

	for (uint32_t qh = 0; qh < m.q_heads; qh++) {
		double ro[128], rl;
		uint32_t h = qh / (m.q_heads / H);

		kvd_ref_dense(w.q + (size_t)qh * d, (int)d, w.k + (size_t)h * n * d,
			      w.v + (size_t)h * n * d, NULL, n, ro, &rl);
		for (uint32_t e = 0; e < d; e++) {
			num += (o_[qh * d + e] - ro[e]) * (o_[qh * d + e] - ro[e]);
			den += ro[e] * ro[e];
		}
	}
	r->rel_err = sqrt(num / den);
	r->ok = 1;
	kvc_seq_free(c, s);
	goto out;
fail:
	snprintf(r->err, sizeof r->err, "%s", kvc_last_error(c));
out:
	kvc_close(c);
	kvd_synth_free(&w);
	free(k0);
	free(v0);
	free(o_);
}

static struct client_res *mmap_shared_results(uint32_t n)
{
	return shared_mem(n * sizeof(struct client_res));
}

static int cmp_f(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;

	return (x > y) - (x < y);
}

/* ---- demo --spill: more sessions than RAM ------------------------------- */

struct spill_res {
	int ok;
	char err[160];
	uint32_t checks, mismatches, came_back, steps;
	double decode_s, rel_err;
	uint32_t nback, nlat;
	float back_ms[256];             /* first ATTEND of a session that was on disk */
	float lat_ms[MAX_LAT];
};

/* One process with `nsess` chat sessions taking turns: prefill them all,
 * then `turns` rounds in which each session decodes `steps` tokens.  Between
 * its turns a session sits idle and kvd may put it on disk; at the start of
 * each turn kvd's answer for a probe query must equal, bit for bit, the one
 * it gave at the end of the previous turn. */
static void spill_client(const char *sock, int id, uint32_t nsess, uint32_t ctx, uint32_t turns,
			 uint32_t steps, struct spill_res *r)
{
	char name[32];
	struct kvc_opts o = { .socket_path = sock, .tenant = "demo", .name = name };
	struct kvc_model m = llama(32);
	struct kvc *c = NULL;
	uint32_t n = ctx + turns * steps, H = m.kv_heads, d = m.head_dim;
	struct kvd_synth *w = calloc(nsess, sizeof *w);
	struct kvc_seq **s = calloc(nsess, sizeof *s);
	float *probe = malloc((size_t)nsess * m.q_heads * d * 4), *o_ = malloc((size_t)m.q_heads * d * 4);
	float *k0 = malloc((size_t)H * ctx * d * 4), *v0 = malloc((size_t)H * ctx * d * 4);
	float kt[8 * 128], vt[8 * 128], lse[32];

	snprintf(name, sizeof name, "spill-demo-%d", id);
	if (!w || !s || !probe || !o_ || !k0 || !v0) {
		snprintf(r->err, sizeof r->err, "out of memory");
		goto out;
	}
	if (kvc_connect(&o, &c) || kvc_profile(c, &m))
		goto fail;
	for (uint32_t j = 0; j < nsess; j++) {
		if (kvd_synth_make(&w[j], (enum kvd_wl)((id + j) % KVD_WL_COUNT), n, m.q_heads, H, d,
				   5000 + 100 * (uint64_t)id + j)) {
			snprintf(r->err, sizeof r->err, "workload: out of memory");
			goto out;
		}
		for (uint32_t h = 0; h < H; h++) {
			memcpy(k0 + (size_t)h * ctx * d, w[j].k + (size_t)h * n * d, (size_t)ctx * d * 4);
			memcpy(v0 + (size_t)h * ctx * d, w[j].v + (size_t)h * n * d, (size_t)ctx * d * 4);
		}
		if (kvc_seq_create(c, &s[j]))
			goto fail;
		for (uint32_t l = 0; l < m.layers; l++)
			if (kvc_prefill(c, s[j], l, k0, v0, ctx))
				goto fail;
		if (kvc_attend_kvd(c, 1, &s[j], 1, w[j].q, probe + (size_t)j * m.q_heads * d, lse))
			goto fail;
	}
	double t = bench_now_ms();

	for (uint32_t turn = 0; turn < turns; turn++) {
		for (uint32_t j = 0; j < nsess; j++) {
			struct kvc_seq_stats st;
			float *pr = probe + (size_t)j * m.q_heads * d;
			double t0 = bench_now_ms();

			if (kvc_seq_stats(c, s[j], &st))
				goto fail;
			if (kvc_attend_kvd(c, 1, &s[j], 1, w[j].q, o_, lse))
				goto fail;
			if (st.state == KVC_SEQ_DISK || st.state == KVC_SEQ_RESTORING) {
				r->came_back++;
				if (r->nback < 256)
					r->back_ms[r->nback++] = (float)(bench_now_ms() - t0);
			}
			r->checks++;
			r->mismatches += memcmp(o_, pr, (size_t)m.q_heads * d * 4) != 0;
			for (uint32_t step = 0; step < steps; step++) {
				copy_token(&w[j], ctx + turn * steps + step, kt, vt);
				for (uint32_t l = 0; l < m.layers; l++) {
					double t1 = bench_now_ms();

					if (kvc_append(c, s[j], l, kt, vt) ||
					    kvc_attend(c, l, &s[j], 1, w[j].q, o_, NULL))
						goto fail;
					if (r->nlat < MAX_LAT && !(l == 0 || l == 16))
						r->lat_ms[r->nlat++] = (float)(bench_now_ms() - t1);
				}
				r->steps++;
			}
			if (kvc_attend_kvd(c, 1, &s[j], 1, w[j].q, pr, lse))
				goto fail;
		}
	}
	r->decode_s = (bench_now_ms() - t) / 1e3;

	/* The last session's full answer (layer 1) against exact attention. */
	{
		uint32_t j = nsess - 1;
		double num = 0, den = 0;

		if (kvc_attend(c, 1, &s[j], 1, w[j].q, o_, NULL))
			goto fail;
		for (uint32_t qh = 0; qh < m.q_heads; qh++) {
			double ro[128], rl;
			uint32_t h = qh / (m.q_heads / H);

			kvd_ref_dense(w[j].q + (size_t)qh * d, (int)d, w[j].k + (size_t)h * n * d,
				      w[j].v + (size_t)h * n * d, NULL, n, ro, &rl);
			for (uint32_t e = 0; e < d; e++) {
				num += (o_[qh * d + e] - ro[e]) * (o_[qh * d + e] - ro[e]);
				den += ro[e] * ro[e];
			}
		}
		r->rel_err = sqrt(num / den);
	}
	r->ok = 1;
	goto out;
fail:
	snprintf(r->err, sizeof r->err, "%s", c ? kvc_last_error(c) : "connect");
out:
	for (uint32_t j = 0; s && j < nsess; j++)
		if (s[j])
			kvc_seq_free(c, s[j]);
	if (c)
		kvc_close(c);
	for (uint32_t j = 0; w && j < nsess; j++)
		kvd_synth_free(&w[j]);
	free(w);
	free(s);
	free(probe);
	free(o_);
	free(k0);
	free(v0);
}

/* Starts kvd (srv_start_conf) and says so. */
static int srv_up(struct daemon *srv, const char *memory, const char *extra)
{
	if (srv_start_conf(srv, memory, extra)) {
		fprintf(stderr, "kvbench: kvd did not start\n");
		return -1;
	}
	printf("kvd started (pid %d, socket %s)\n", (int)srv->pid, srv->sock);
	fflush(stdout);
	return 0;
}

struct demo_arg {
	const char *sock;
	uint32_t ctx, steps;
	struct client_res *res;
};

static int demo_kid(uint32_t i, void *arg)
{
	struct demo_arg *a = arg;

	demo_client(a->sock, (int)i, a->ctx, a->steps, &a->res[i]);
	return !a->res[i].ok;
}

struct spill_arg {
	const char *sock;
	uint32_t nsess, ctx, turns, steps;
	struct spill_res *res;
};

static int spill_kid(uint32_t i, void *arg)
{
	struct spill_arg *a = arg;

	spill_client(a->sock, (int)i, a->nsess, a->ctx, a->turns, a->steps, &a->res[i]);
	return !a->res[i].ok;
}

/* Resident bytes of one session of the demo's model (one segment per sparse
 * layer while ctx fits one), to size the budget at a third of the total. */
static uint64_t session_bytes(uint32_t ctx)
{
	struct kvc_model m = llama(32);
	struct kvd_geom g = { m.q_heads, m.kv_heads, m.head_dim, m.K, m.L, m.c, m.kv_dtype,
			      m.estimator == KVC_EST_HYBRID_LCV };
	uint32_t n = ctx - m.sink - m.window, segs = (n + 32767) / 32768;

	return (uint64_t)(m.layers - m.n_dense) * segs * (kvd_seg_bytes(&g, (n + segs - 1) / segs) + 8192);
}

static int demo_spill(uint32_t clients, uint32_t nsess, uint32_t ctx, uint32_t turns,
		      uint32_t steps)
{
	struct daemon srv;
	struct spill_res *res = shared_mem(clients * sizeof *res);
	uint64_t total = (uint64_t)clients * nsess * session_bytes(ctx), limit = total / 3;
	char mem[128], spill[256], dir[200];
	double t0 = bench_now_ms();
	struct kvc_stats st = { 0 };
	int failed = 0;

	if (!res)
		return 1;
	snprintf(mem, sizeof mem, "limit = %lluM\nhigh = 90%%\nlow = 75%%",
		 (unsigned long long)(limit >> 20));
	snprintf(dir, sizeof dir, "/var/tmp/kvd-demo-spill.XXXXXX");
	if (!mkdtemp(dir)) {
		perror("kvbench: mkdtemp");
		return 1;
	}
	snprintf(spill, sizeof spill, "\n[spill]\ndir = %s\n", dir);
	printf("kvd demo --spill: %u clients x %u chat sessions of %u tokens, %u turns of %u decode\n"
	       "steps each; Llama-3.1-8B geometry as in the plain demo.  The sessions take %.1f GiB in\n"
	       "kvd, the memory budget is %.1f GiB (a third): idle sessions go to %s and come\n"
	       "back when their turn comes.  Each turn starts by checking that kvd's answer equals,\n"
	       "bit for bit, the one it gave at the end of the session's previous turn.\n\n",
	       clients, nsess, ctx, turns, steps, total / 1073741824.0, limit / 1073741824.0, dir);
	if (srv_up(&srv, mem, spill))
		return 1;
	struct spill_arg sa = { srv.sock, nsess, ctx, turns, steps, res };

	failed = run_clients(clients, spill_kid, &sa);
	{
		struct kvc_opts o = { .socket_path = srv.sock, .tenant = "demo", .name = "stats" };
		struct kvc *c;

		if (kvc_connect(&o, &c) == 0)
			kvc_server_stats(c, &st);
		kvc_close(c);
	}
	int rc = daemon_stop(&srv);

	rmdir(dir);
	printf("\n%-7s %7s %10s %10s %10s %12s %12s %13s %9s\n", "client", "checks", "mismatch",
	       "came_back", "tokens/s", "layer_p50_ms", "layer_p99_ms", "back_p50_ms", "rel_err");
	uint32_t mism = 0, back = 0;

	for (uint32_t i = 0; i < clients; i++) {
		struct spill_res *r = &res[i];

		if (!r->ok) {
			printf("%-7u failed: %s\n", i, r->err);
			continue;
		}
		qsort(r->lat_ms, r->nlat, sizeof r->lat_ms[0], cmp_f);
		qsort(r->back_ms, r->nback, sizeof r->back_ms[0], cmp_f);
		printf("%-7u %7u %10u %10u %10.2f %12.3f %12.3f %13.1f %9.4f\n", i, r->checks,
		       r->mismatches, r->came_back, r->steps / r->decode_s, r->lat_ms[r->nlat / 2],
		       r->lat_ms[(uint32_t)(r->nlat * 0.99)], r->nback ? r->back_ms[r->nback / 2] : 0.0,
		       r->rel_err);
		mism += r->mismatches;
		back += r->came_back;
	}
	printf("\nkvd: %llu spills (%.2f GiB written), %llu restores (%.2f GiB read), %llu drops of\n"
	       "clean sessions, %llu spill errors, %llu lost; %.2f GiB resident at the end, budget %.2f GiB.\n",
	       (unsigned long long)st.spills, st.spill_bytes / 1073741824.0,
	       (unsigned long long)st.restores, st.restore_bytes / 1073741824.0,
	       (unsigned long long)st.drops, (unsigned long long)st.spill_errors,
	       (unsigned long long)st.lost, st.bytes / 1073741824.0, st.mem_limit / 1073741824.0);
	printf("%u sessions came back from disk, %u answers differed; kvd exited with status %d; %.1f s in all\n",
	       back, mism, rc, (bench_now_ms() - t0) / 1e3);
	return failed || rc || mism || !back || st.lost ? 1 : 0;
}

/* The demo's shared-prompt scene (bench/prefix.c): `clients` processes hold
 * one system prompt, first each its own copy, then one published and the
 * others attached. */
static int demo_share(uint32_t clients)
{
	struct prefix_opts px = { .layers = 8, .clients = clients < 2 ? 2 : clients, .ctx = 4096,
				  .priv = 512, .steps = 4 };
	struct prefix_prompt_res r;

	printf("\nShared system prompt: %u clients, one %u-token prompt + %u tokens of their own each\n"
	       "(the same geometry on 8 layers, one dense).  First each prefills the prompt itself;\n"
	       "then client 0 prefills and publishes it under its content keys and the others\n"
	       "attach it (kvd shares the prompt's segments; the rows a client keeps, its sinks,\n"
	       "window and dense layer, come from kvd).\n", px.clients, px.ctx, px.priv);
	fflush(stdout);
	if (bench_prefix_prompt(&px, &r)) {
		printf("  shared-prompt scene failed\n");
		return 1;
	}
	printf("  prefill of the prompt %.0f ms; attach %.1f ms (median of %u): %.0fx faster\n"
	       "  kvd's memory for all %u sequences: %.0f MiB shared, %.0f MiB private: %.0f MiB "
	       "(%.0f%%) saved\n"
	       "  every client answered bit for bit as it did with its own prefill: %s\n",
	       r.prefill_ms, r.attach_ms, px.clients - 1, r.prefill_ms / r.attach_ms, px.clients,
	       r.rss_shared / 1048576, r.rss_private / 1048576,
	       (r.rss_private - r.rss_shared) / 1048576,
	       100 * (r.rss_private - r.rss_shared) / r.rss_private, r.identical ? "yes" : "NO");
	return r.identical ? 0 : 1;
}

int bench_demo_main(int argc, char **argv)
{
	uint32_t clients = 4, ctx = 8192, steps = 32, sessions = 6, turns = 3, spill = 0;
	struct daemon srv;
	struct client_res *res;
	double t0 = bench_now_ms();

	for (int i = 0; i < argc; i++) {
		if (!strcmp(argv[i], "--spill")) {
			spill = 1;
			clients = 2;
			ctx = 2048;
			steps = 4;
			memmove(argv + i, argv + i + 1, (size_t)(argc - i - 1) * sizeof *argv);
			argc--;
			break;
		}
	}
	for (int i = 0; i + 1 < argc; i += 2) {
		uint32_t *dst = !strcmp(argv[i], "--clients") ? &clients :
				!strcmp(argv[i], "--ctx") ? &ctx :
				!strcmp(argv[i], "--steps") ? &steps :
				spill && !strcmp(argv[i], "--sessions") ? &sessions :
				spill && !strcmp(argv[i], "--turns") ? &turns : NULL;

		if (!dst || bench_parse_u32(argv[i + 1], dst) || clients > 64 || ctx < 200 || sessions > 64) {
			fprintf(stderr, "usage: kvbench demo [--clients N<=64] [--ctx N>=200] [--steps N]\n"
					"       kvbench demo --spill [--clients N] [--sessions N<=64] [--ctx N]\n"
					"                    [--turns N] [--steps N]\n");
			return 2;
		}
	}
	if (spill)
		return demo_spill(clients, sessions, ctx, turns, steps);

	for (int i = 0; i + 1 < argc; i += 2) {
		uint32_t *dst = !strcmp(argv[i], "--clients") ? &clients :
				!strcmp(argv[i], "--ctx") ? &ctx :
				!strcmp(argv[i], "--steps") ? &steps : NULL;

		if (!dst || bench_parse_u32(argv[i + 1], dst) || clients > 64 || ctx < 200) {
			fprintf(stderr, "usage: kvbench demo [--clients N<=64] [--ctx N>=200] [--steps N]\n");
			return 2;
		}
	}
	res = mmap_shared_results(clients);
	if (!res)
		return 1;
	printf("kvd demo: %u decoding clients, %u-token synthetic prompts, %u decode steps,\n"
	       "Llama-3.1-8B geometry (32 layers, 32 q / 8 kv heads, d=128; layers 0 and 16 dense),\n"
	       "4 sink + 64 window tokens per layer kept by the client, the rest in kvd (K=10, L=150).\n\n",
	       clients, ctx, steps);
	if (srv_up(&srv, NULL, NULL))
		return 1;
	struct demo_arg da = { srv.sock, ctx, steps, res };
	int failed = run_clients(clients, demo_kid, &da);

	int rc = daemon_stop(&srv);

	printf("\n%-7s %-8s %10s %10s %12s %12s %9s\n", "client", "workload", "prefill_s",
	       "tokens/s", "layer_p50_ms", "layer_p99_ms", "rel_err");
	double total = 0;

	for (uint32_t i = 0; i < clients; i++) {
		struct client_res *r = &res[i];

		if (!r->ok) {
			printf("%-7u failed: %s\n", i, r->err);
			continue;
		}
		qsort(r->lat_ms, r->nlat, sizeof r->lat_ms[0], cmp_f);
		printf("%-7u %-8s %10.2f %10.2f %12.3f %12.3f %9.4f\n", i, r->workload, r->prefill_s,
		       steps / r->decode_s, r->lat_ms[r->nlat / 2],
		       r->lat_ms[(uint32_t)(r->nlat * 0.99)], r->rel_err);
		total += steps / r->decode_s;
	}
	printf("\nall clients: %.1f tokens/s; kvd exited with status %d after SIGTERM\n", total, rc);
	printf("(per-layer latency = append + attend of one sparse layer, client's view;\n"
	       " rel_err = last step, layer 1, against exact attention over all tokens)\n");
	int shared = demo_share(clients);

	printf("\n%.1f s in all\n", (bench_now_ms() - t0) / 1e3);
	return failed || rc || shared ? 1 : 0;
}

/* ---- serve: daemon against the in-process engine ------------------------ */

struct serve_shared {
	pthread_barrier_t bar;
	struct {
		int ok;
		char err[160];
		double daemon_ms, inproc_ms;
	} r[64];
};

static void serve_client(const char *sock, int id, uint32_t ctx, uint32_t layers, int reps,
			 struct serve_shared *sh)
{
	struct kvc_opts o = { .socket_path = sock, .tenant = "bench", .name = "serve" };
	struct kvc_model m = llama(layers);
	struct kvd_geom g = { m.q_heads, m.kv_heads, m.head_dim, m.K, m.L, m.c, m.kv_dtype,
			      m.estimator == KVC_EST_HYBRID_LCV };
	struct kvc *c;
	struct kvc_seq *s;
	struct kvd_synth w;
	struct kvd_pool *pool;
	struct kvd_prep *p = calloc(layers, sizeof *p);
	double *td = malloc(reps * sizeof *td), *ti = malloc(reps * sizeof *ti);
	float *o_ = malloc((size_t)m.q_heads * m.head_dim * 4), lse[32];
	uint16_t *qc = malloc((size_t)m.q_heads * m.L * 2);
	struct kvd_logp_tab *tab = malloc(sizeof *tab);

	if (kvd_synth_make(&w, KVD_WL_DENSE, ctx, m.q_heads, m.kv_heads, m.head_dim, 2000 + (uint64_t)id) ||
	    kvd_pool_create(0, 1, &pool)) {
		snprintf(sh->r[id].err, sizeof sh->r[id].err, "out of memory");
		goto out;
	}
	if (kvc_connect(&o, &c) || kvc_profile(c, &m) || kvc_seq_create(c, &s))
		goto fail;
	for (uint32_t l = 0; l < layers; l++)
		if (kvc_prefill(c, s, l, w.k, w.v, ctx))
			goto fail;
	const struct kvc_model *mm = kvc_model_of(c);
	unsigned nw = kvd_pool_size(pool);
	struct kvd_attn_scratch *scr = calloc(nw, sizeof *scr);

	for (unsigned i = 0; i < nw; i++)
		kvd_attn_scratch_init(&scr[i], mm->segment_tokens);
	for (uint32_t l = 0; l < layers; l++)
		kvd_prep_layer(&p[l], &g, kvc_w(c), w.k, w.v, ctx, m.sink, ctx - m.window,
			       mm->segment_tokens, pool);
	kvd_prep_query_codes(&g, kvc_w(c), w.q, qc);
	kvd_logp_tab_init(tab, (int)m.K, (int)m.L, (int)m.c);
	pthread_barrier_wait(&sh->bar);
	for (int r = -1; r < reps; r++) {       /* r = -1 warms up */
		double t = bench_now_ms();

		for (uint32_t l = 0; l < layers; l++)
			if (kvc_attend_kvd(c, l, &s, 1, w.q, o_, lse))
				goto fail;
		if (r >= 0)
			td[r] = bench_now_ms() - t;
		pthread_barrier_wait(&sh->bar);
		t = bench_now_ms();
		for (uint32_t l = 0; l < layers; l++) {
			struct kvd_layer_view lv = kvd_prep_view(&p[l]);

			/* the same work as the client does per layer: hash the query */
			kvd_prep_query_codes(&g, kvc_w(c), w.q, qc);
			kvd_attn_layer(pool, scr, kvd_kern_get(), &g, tab, &lv, w.q, qc, o_, lse, NULL);
		}
		if (r >= 0)
			ti[r] = bench_now_ms() - t;
		pthread_barrier_wait(&sh->bar);
	}
	sh->r[id].daemon_ms = bench_median(td, reps);
	sh->r[id].inproc_ms = bench_median(ti, reps);
	sh->r[id].ok = 1;
	for (unsigned i = 0; i < nw; i++)
		kvd_attn_scratch_free(&scr[i]);
	free(scr);
	kvc_seq_free(c, s);
	goto out;
fail:
	snprintf(sh->r[id].err, sizeof sh->r[id].err, "%s", kvc_last_error(c));
	/* the others wait at the barrier forever otherwise */
	_exit(1);
out:
	for (uint32_t l = 0; l < layers; l++)
		kvd_prep_free(&p[l]);
	kvc_close(c);
	kvd_synth_free(&w);
	kvd_pool_destroy(pool);
	free(p);
	free(td);
	free(ti);
	free(o_);
	free(qc);
	free(tab);
}

struct serve_arg {
	const char *sock;
	uint32_t ctx, layers;
	int reps;
	struct serve_shared *sh;
};

static int serve_kid(uint32_t i, void *arg)
{
	struct serve_arg *a = arg;

	serve_client(a->sock, (int)i, a->ctx, a->layers, a->reps, a->sh);
	return !a->sh->r[i].ok;
}

int bench_serve_main(int argc, char **argv)
{
	uint32_t clients = 1, ctx = 65536, layers = 4, reps = 9;
	int json = 0;
	struct daemon srv;
	struct serve_shared *sh;
	pthread_barrierattr_t ba;

	for (int i = 0; i < argc; i++) {
		if (!strcmp(argv[i], "--json")) {
			json = 1;
			continue;
		}
		uint32_t *dst = !strcmp(argv[i], "--clients") ? &clients :
				!strcmp(argv[i], "--ctx") ? &ctx :
				!strcmp(argv[i], "--layers") ? &layers :
				!strcmp(argv[i], "--reps") ? &reps : NULL;

		if (!dst || i + 1 >= argc || bench_parse_u32(argv[++i], dst) || clients > 64 || ctx < 200) {
			fprintf(stderr, "usage: kvbench serve [--json] [--clients N<=64] [--ctx N] "
					"[--layers N] [--reps N]\n");
			return 2;
		}
	}
	sh = shared_mem(sizeof *sh);
	if (!sh)
		return 1;
	pthread_barrierattr_init(&ba);
	pthread_barrierattr_setpshared(&ba, PTHREAD_PROCESS_SHARED);
	pthread_barrier_init(&sh->bar, &ba, clients);
	if (srv_start(&srv)) {
		fprintf(stderr, "kvbench: kvd did not start\n");
		return 1;
	}
	struct serve_arg sa = { srv.sock, ctx, layers, (int)reps, sh };
	int failed = run_clients(clients, serve_kid, &sa);

	daemon_stop(&srv);
	if (failed) {
		for (uint32_t i = 0; i < clients; i++)
			if (!sh->r[i].ok)
				fprintf(stderr, "kvbench serve: client %u: %s\n", i, sh->r[i].err);
		return 1;
	}
	double dm = 0, im = 0;

	for (uint32_t i = 0; i < clients; i++) {
		dm += sh->r[i].daemon_ms / clients;
		im += sh->r[i].inproc_ms / clients;
	}
	if (json)
		printf("{\"bench\":\"serve\",\"clients\":%u,\"ctx\":%u,\"layers\":%u,\"q_heads\":32,"
		       "\"kv_heads\":8,\"head_dim\":128,\"K\":10,\"L\":150,\"daemon_step_ms\":%.3f,"
		       "\"inproc_step_ms\":%.3f,\"overhead_frac\":%.4f,\"daemon_tok_s\":%.2f,"
		       "\"inproc_tok_s\":%.2f,\"cpu\":\"%s\"}\n",
		       clients, ctx, layers, dm, im, dm / im - 1, clients * 1e3 / dm, clients * 1e3 / im,
		       bench_cpu_name());
	else
		printf("serve: %u client(s), %u-token context, %u layers (kvd's part only):\n"
		       "  through kvd %.3f ms/step, in-process engine %.3f ms/step, overhead %+.1f%%\n",
		       clients, ctx, layers, dm, im, 100 * (dm / im - 1));
	return 0;
}
