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

#include "attn.h"
#include "bench.h"
#include "err.h"
#include "kvc.h"
#include "pool.h"
#include "prep.h"
#include "ref.h"
#include "synth.h"

struct srv {
	pid_t pid;
	char dir[64], sock[108];
};

static int srv_start(struct srv *s)
{
	char exe[PATH_MAX], bin[PATH_MAX + 8], conf[128];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	FILE *f;

	if (n <= 0)
		return -1;
	exe[n] = 0;
	*strrchr(exe, '/') = 0;
	snprintf(bin, sizeof bin, "%s/kvd", exe);
	snprintf(s->dir, sizeof s->dir, "/tmp/kvd-run.XXXXXX");
	if (!mkdtemp(s->dir))
		return -1;
	snprintf(s->sock, sizeof s->sock, "%s/kvd.sock", s->dir);
	snprintf(conf, sizeof conf, "%s/kvd.conf", s->dir);
	f = fopen(conf, "w");
	if (!f)
		return -1;
	/* The default configuration, written out so the demo shows one. */
	fprintf(f, "[server]\nsocket = %s\nthreads = 0\n\n[memory]\nlimit = 75%%\n\n"
		   "[transport]\nslots = 16\nslot_size = 4M\nring_entries = 256\nspin_us = 50\n\n"
		   "[log]\nlevel = warning\n", s->sock);
	fclose(f);
	s->pid = fork();
	if (s->pid == 0) {
		execl(bin, "kvd", "--foreground", "--config", conf, (char *)NULL);
		perror("kvbench: exec kvd");
		_exit(127);
	}
	for (int i = 0; i < 500; i++) {
		struct sockaddr_un a = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0), ok;

		memcpy(a.sun_path, s->sock, strlen(s->sock) + 1);
		ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
		close(fd);
		if (ok)
			return 0;
		if (waitpid(s->pid, NULL, WNOHANG) == s->pid)
			return -1;
		usleep(20000);
	}
	return -1;
}

static int srv_stop(struct srv *s)
{
	char conf[128];
	int st = 0;

	kill(s->pid, SIGTERM);
	waitpid(s->pid, &st, 0);
	snprintf(conf, sizeof conf, "%s/kvd.conf", s->dir);
	unlink(conf);
	rmdir(s->dir);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static const uint32_t llama_dense[] = { 0, 16 };

static struct kvc_model llama(uint32_t layers)
{
	return (struct kvc_model){
		.name = layers == 32 ? "llama-3.1-8b" : "llama-3.1-8b-slice", .layers = layers,
		.q_heads = 32, .kv_heads = 8, .head_dim = 128, .K = 10, .L = 150, .c = 2,
		.sink = 4, .window = 64, .dense_layers = llama_dense,
		.n_dense = layers == 32 ? 2 : 0, .seed = 1,
	};
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

/* Results that child processes write and the parent reads. */
static void *shared_mem(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED) {
		perror("kvbench: mmap");
		return NULL;
	}
	return p;
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

static int parse_u32(const char *s, uint32_t *out)
{
	char *end;
	unsigned long v = strtoul(s, &end, 10);

	if (!*s || *end || v == 0 || v > 1u << 20)
		return -1;
	*out = (uint32_t)v;
	return 0;
}

int bench_demo_main(int argc, char **argv)
{
	uint32_t clients = 4, ctx = 8192, steps = 32;
	struct srv srv;
	struct client_res *res;
	double t0 = bench_now_ms();

	for (int i = 0; i + 1 < argc; i += 2) {
		uint32_t *dst = !strcmp(argv[i], "--clients") ? &clients :
				!strcmp(argv[i], "--ctx") ? &ctx :
				!strcmp(argv[i], "--steps") ? &steps : NULL;

		if (!dst || parse_u32(argv[i + 1], dst) || clients > 64 || ctx < 200) {
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
	if (srv_start(&srv)) {
		fprintf(stderr, "kvbench: kvd did not start\n");
		return 1;
	}
	printf("kvd started (pid %d, socket %s)\n", (int)srv.pid, srv.sock);
	fflush(stdout);
	pid_t *kids = calloc(clients, sizeof *kids);

	for (uint32_t i = 0; i < clients; i++) {
		kids[i] = fork();
		if (kids[i] == 0) {
			demo_client(srv.sock, (int)i, ctx, steps, &res[i]);
			_exit(res[i].ok ? 0 : 1);
		}
	}
	int failed = 0;

	for (uint32_t i = 0; i < clients; i++) {
		int st;

		waitpid(kids[i], &st, 0);
		failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
	}
	int rc = srv_stop(&srv);

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
	printf("\nall clients: %.1f tokens/s; kvd exited with status %d after SIGTERM; %.1f s in all\n",
	       total, rc, (bench_now_ms() - t0) / 1e3);
	printf("(per-layer latency = append + attend of one sparse layer, client's view;\n"
	       " rel_err = last step, layer 1, against exact attention over all tokens)\n");
	free(kids);
	return failed || rc ? 1 : 0;
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
	struct kvd_geom g = { m.q_heads, m.kv_heads, m.head_dim, m.K, m.L, m.c };
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

int bench_serve_main(int argc, char **argv)
{
	uint32_t clients = 1, ctx = 65536, layers = 4, reps = 9;
	int json = 0;
	struct srv srv;
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

		if (!dst || i + 1 >= argc || parse_u32(argv[++i], dst) || clients > 64 || ctx < 200) {
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
	pid_t kids[64];

	for (uint32_t i = 0; i < clients; i++) {
		kids[i] = fork();
		if (kids[i] == 0) {
			serve_client(srv.sock, (int)i, ctx, layers, (int)reps, sh);
			_exit(sh->r[i].ok ? 0 : 1);
		}
	}
	int failed = 0;

	for (uint32_t i = 0; i < clients; i++) {
		int st;

		waitpid(kids[i], &st, 0);
		failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
	}
	srv_stop(&srv);
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
