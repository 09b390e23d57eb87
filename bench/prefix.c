/* kvbench share --scene prompt | chat: prefix sharing by content key
 * (kvc_seq_publish, kvc_seq_attach) through the real daemon, against the
 * same sequences built privately in the same run (docs/ARCHITECTURE.md,
 * "kvbench share fields").
 *
 * prompt: `clients` client processes hold one --ctx token system prompt and
 *   --private tokens of their own each, then decode --steps tokens.  In the
 *   private run every client prefills the prompt itself; in the shared run
 *   client 0 prefills and publishes it and the others attach it.  Measured
 *   in each run: kvd's anonymous resident memory (RssAnon: sequences,
 *   tables and the client rows kept for sharing; the shared-memory arenas
 *   are RssShmem and left out) from all clients connected to all done;
 *   client 0's prompt prefill against the others' attaches (client's view:
 *   the control round trip and the rows fetched for its window and dense
 *   layers), each timed alone as the prefill is (the attaches take turns, and
 *   every client starts on its own part once all are done); and whether every shared-run client answers its decode-step
 *   query on every layer bit for bit as the same client did in the private
 *   run.
 *
 * chat: --sessions chat sessions in --procs client processes, --turns turns
 *   each, under a memory budget of a third of what all of them hold at the
 *   end (spilling to a temporary directory).  A turn's prompt is the
 *   session's history and a new message; the client attaches the longest
 *   published prefix of it, extends to the prompt's last chunk boundary,
 *   publishes there, extends the rest and decodes --gen tokens.  hit_rate is
 *   the tokens attached over the prompt tokens asked for.  Every turn's
 *   answer is checked bit for bit against a private sequence given the same
 *   calls (the first prefill, then every token appended).
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "prefix.h"
#include "srv.h"
#include "engine/seg.h"
#include "engine/synth.h"

#define PX_MAXCLIENT 64

static const uint32_t dense0[] = { 0 };

/* Llama-3.1-8B's geometry; a slice keeps layer 0 dense (as the full model's
 * profile keeps 0 and 16), so shared prefixes carry a dense layer's rows. */
static struct kvc_model px_model(uint32_t layers)
{
	struct kvc_model m = llama(layers);

	if (layers != 32) {
		m.dense_layers = dense0;
		m.n_dense = 1;
	}
	return m;
}

/* Rows [t0, t0 + n) of the synthetic layer, as [kv][n][d], into k, v. */
static void rows_of(const struct kvd_synth *w, uint32_t t0, uint32_t n, float *k, float *v)
{
	for (uint32_t h = 0; h < w->kv_heads; h++) {
		memcpy(k + (size_t)h * n * w->d, w->k + ((size_t)h * w->n + t0) * w->d,
		       (size_t)n * w->d * sizeof *k);
		memcpy(v + (size_t)h * n * w->d, w->v + ((size_t)h * w->n + t0) * w->d,
		       (size_t)n * w->d * sizeof *v);
	}
}

/* Positions [t0, t0 + n) of the synthetic rows into every layer of s (every
 * layer gets the same rows: the generator is not what is measured). */
static int extend_rows(struct kvc *c, struct kvc_seq *s, const struct kvd_synth *w,
		       uint32_t layers, uint32_t t0, uint32_t n)
{
	float *k, *v;
	int rc = 0;

	if (!n)
		return 0;
	k = malloc((size_t)w->kv_heads * n * w->d * sizeof *k);
	v = malloc((size_t)w->kv_heads * n * w->d * sizeof *v);
	if (!k || !v) {
		free(k);
		free(v);
		return -ENOMEM;
	}
	rows_of(w, t0, n, k, v);
	for (uint32_t l = 0; l < layers && !rc; l++)
		rc = kvc_extend(c, s, l, k, v, n);
	free(k);
	free(v);
	return rc;
}

/* The merged answer of every layer to the workload's query. */
static int answer_all(struct kvc *c, struct kvc_seq *s, const struct kvd_synth *w,
		      uint32_t layers, float *o, float *lse)
{
	const size_t qd = (size_t)w->q_heads * w->d;
	int rc;

	for (uint32_t l = 0; l < layers; l++)
		if ((rc = kvc_attend(c, l, &s, 1, w->q, o + l * qd, lse + (size_t)l * w->q_heads)))
			return rc;
	return 0;
}

static void spin_until(atomic_uint *x, unsigned want)
{
	while (atomic_load(x) < want)
		usleep(200);
}

static int keys_of(struct kvc *c, const uint32_t *tok, uint32_t n, uint8_t **keys)
{
	uint32_t chunk = kvc_chunk_tokens(c);

	if (!chunk)
		return -EOPNOTSUPP;
	if (!(*keys = malloc((size_t)(n / chunk + 1) * KVC_KEY_BYTES)))
		return -ENOMEM;
	return kvc_content_keys(c, tok, n, *keys);
}

/* ==== prompt ================================================================ */

struct pr_res {
	int ok;
	char err[200];
	double prefill_ms, attach_ms, publish_ms;
	uint64_t hit, prompt_bytes, full_bytes;
};

/* What every process of a run sees: barriers, results, answers. */
struct pr_run {
	atomic_uint connected, go, published, done, release;
	atomic_uint turn;               /* the client whose attach is timed now */
	int shared;                     /* this run shares the prompt */
	pid_t kvd;
	uint64_t rss0, rss1, shared_bytes;
	struct pr_res r[PX_MAXCLIENT];
};

struct pr_arg {
	const struct prefix_opts *op;
	const char *sock;
	const struct kvd_synth *w;
	const uint32_t *tok;            /* token ids of the prompt */
	struct kvc_model m;
	struct pr_run *run;
	float *ans;                     /* [clients][layers * (q_heads * d + q_heads)] */
};

static size_t ans_floats(const struct kvc_model *m)
{
	return (size_t)m->layers * m->q_heads * (m->head_dim + 1);
}

static int pr_fail(struct pr_res *r, struct kvc *c, const char *what, int rc)
{
	snprintf(r->err, sizeof r->err, "%s: %s", what,
		 c ? kvc_last_error(c) : kvd_strerror(rc));
	return 1;
}

static int pr_kid(uint32_t i, void *arg)
{
	struct pr_arg *a = arg;
	const struct prefix_opts *op = a->op;
	struct pr_run *run = a->run;
	struct pr_res *r = &run->r[i];
	struct kvc_opts o = { .socket_path = a->sock, .tenant = "bench", .name = "prefix" };
	struct kvc_seq *s = NULL;
	struct kvc_seq_stats ss;
	struct kvc *c = NULL;
	float *ans = a->ans + i * ans_floats(&a->m);
	uint8_t *keys = NULL;
	double t;
	int rc, nk;

	if ((rc = kvc_connect(&o, &c)) || (rc = kvc_profile(c, &a->m)))
		return pr_fail(r, c, "connect", rc);
	atomic_fetch_add(&run->connected, 1);
	spin_until(&run->go, 1);
	if (!run->shared || i == 0) {
		if ((rc = kvc_seq_create(c, &s)))
			return pr_fail(r, c, "create", rc);
		t = bench_now_ms();
		if ((rc = extend_rows(c, s, a->w, a->m.layers, 0, op->ctx)))
			return pr_fail(r, c, "prefill", rc);
		r->prefill_ms = bench_now_ms() - t;
		if ((rc = kvc_seq_stats(c, s, &ss)))
			return pr_fail(r, c, "stats", rc);
		r->prompt_bytes = ss.bytes;
		if (run->shared) {
			struct kvc_share_stats sh;

			if ((nk = keys_of(c, a->tok, op->ctx, &keys)) <= 0)
				return pr_fail(r, c, "keys", nk);
			t = bench_now_ms();
			if ((rc = kvc_seq_publish(c, s, keys + (size_t)(nk - 1) * KVC_KEY_BYTES)))
				return pr_fail(r, c, "publish", rc);
			r->publish_ms = bench_now_ms() - t;
			if ((rc = kvc_share_stats(c, &sh)))
				return pr_fail(r, c, "share stats", rc);
			run->shared_bytes = sh.shared_bytes;
			atomic_store(&run->turn, 1);
			atomic_store(&run->published, 1);
		}
	} else {
		/* One attach at a time, each timed alone as client 0's prefill
		 * was: like for like. */
		spin_until(&run->published, 1);
		spin_until(&run->turn, i);
		if ((nk = keys_of(c, a->tok, op->ctx, &keys)) <= 0)
			return pr_fail(r, c, "keys", nk);
		t = bench_now_ms();
		rc = kvc_seq_attach(c, keys, (uint32_t)nk, &s, &r->hit);
		r->attach_ms = bench_now_ms() - t;
		atomic_fetch_add(&run->turn, 1);
		if (rc)
			return pr_fail(r, c, "attach", rc);
		if (r->hit != op->ctx) {
			snprintf(r->err, sizeof r->err, "attach got %llu tokens of %u",
				 (unsigned long long)r->hit, op->ctx);
			return 1;
		}
	}
	free(keys);
	/* Nobody computes while an attach is timed. */
	if (run->shared)
		spin_until(&run->turn, op->clients);
	/* Its own part, then the decode steps every client takes alike. */
	if ((rc = extend_rows(c, s, a->w, a->m.layers, op->ctx + i * op->priv, op->priv)) ||
	    (rc = extend_rows(c, s, a->w, a->m.layers, op->ctx + op->clients * op->priv,
			      op->steps)))
		return pr_fail(r, c, "extend", rc);
	if ((rc = kvc_seq_stats(c, s, &ss)))
		return pr_fail(r, c, "stats", rc);
	r->full_bytes = ss.bytes;
	if ((rc = answer_all(c, s, a->w, a->m.layers, ans,
			     ans + (size_t)a->m.layers * a->m.q_heads * a->m.head_dim)))
		return pr_fail(r, c, "attend", rc);
	r->ok = 1;
	atomic_fetch_add(&run->done, 1);
	spin_until(&run->release, 1);
	kvc_seq_free(c, s);
	kvc_close(c);
	return 0;
}

static void pr_mid(void *arg)
{
	struct pr_arg *a = arg;
	struct pr_run *run = a->run;

	spin_until(&run->connected, a->op->clients);
	bench_proc_kib(run->kvd, "RssAnon:", &run->rss0);
	atomic_store(&run->go, 1);
	/* A client that failed never says done: stop waiting once all exited
	 * is the caller's; here, poll with a bound. */
	for (int i = 0; i < 6000000 && atomic_load(&run->done) < a->op->clients; i++) {
		int failed = 0;

		for (uint32_t k = 0; k < a->op->clients; k++)
			failed |= run->r[k].err[0] != 0;
		if (failed)
			break;
		usleep(1000);
	}
	bench_proc_kib(run->kvd, "RssAnon:", &run->rss1);
	atomic_store(&run->release, 1);
}

static int pr_one(const struct prefix_opts *op, const struct kvd_synth *w, const uint32_t *tok,
		  const struct kvc_model *m, struct pr_run *run, float *ans)
{
	struct daemon srv;
	struct pr_arg a = { op, NULL, w, tok, *m, run, ans };
	int failed, st;

	if (srv_start_conf(&srv, NULL, NULL)) {
		if (srv.pid > 0)
			daemon_stop(&srv);
		fprintf(stderr, "kvbench share: kvd did not start\n");
		return 1;
	}
	a.sock = srv.sock;
	run->kvd = srv.pid;
	failed = run_clients_mid(op->clients, pr_kid, pr_mid, &a);
	st = daemon_stop(&srv);
	for (uint32_t i = 0; i < op->clients; i++)
		if (!run->r[i].ok)
			fprintf(stderr, "kvbench share: %s run, client %u: %s\n",
				run->shared ? "shared" : "private", i,
				run->r[i].err[0] ? run->r[i].err : "died");
	return failed || st;
}

int bench_prefix_prompt(const struct prefix_opts *op, struct prefix_prompt_res *out)
{
	const struct kvc_model m = px_model(op->layers);
	const uint32_t N = op->ctx + op->clients * op->priv + op->steps;
	struct pr_run *run = shared_mem(2 * sizeof *run);
	float *ans = shared_mem(2 * op->clients * ans_floats(&m) * sizeof(float));
	uint32_t *tok = malloc((size_t)op->ctx * sizeof *tok);
	struct kvd_synth w = { 0 };
	int rc = 1;

	if (!run || !ans || !tok || op->clients < 2 || op->clients > PX_MAXCLIENT)
		goto out;
	if (kvd_synth_make(&w, KVD_WL_MIXED, N, m.q_heads, m.kv_heads, m.head_dim, 3000))
		goto out;
	for (uint32_t t = 0; t < op->ctx; t++)
		tok[t] = t * 2654435761u + 17;
	run[1].shared = 1;
	if (pr_one(op, &w, tok, &m, &run[0], ans) ||
	    pr_one(op, &w, tok, &m, &run[1], ans + op->clients * ans_floats(&m)))
		goto out;

	struct prefix_prompt_res *x = out;
	double att[PX_MAXCLIENT];
	uint64_t part = 0;

	memset(x, 0, sizeof *x);
	x->identical = !memcmp(ans, ans + op->clients * ans_floats(&m),
			       op->clients * ans_floats(&m) * sizeof(float));
	for (uint32_t i = 1; i < op->clients; i++)
		att[i - 1] = run[1].r[i].attach_ms;
	x->attach_ms = bench_median(att, (int)op->clients - 1);
	x->prefill_ms = run[1].r[0].prefill_ms;
	x->publish_ms = run[1].r[0].publish_ms;
	for (uint32_t i = 0; i < op->clients; i++)
		part += run[0].r[i].full_bytes - run[0].r[i].prompt_bytes;
	x->part_bytes = part / op->clients;
	x->prompt_bytes = run[0].r[0].prompt_bytes;
	x->shared_bytes = run[1].shared_bytes;
	x->rss_private = run[0].rss1 - run[0].rss0;
	x->rss_shared = run[1].rss1 - run[1].rss0;
	/* One prompt as kvd holds it to share it (its segments, and the rows a
	 * client keeps for it, dense layers included), plus every own part. */
	x->ideal = (double)x->shared_bytes + (double)op->clients * x->part_bytes;
	x->resident_ratio = x->rss_shared / x->ideal;
	x->private_ratio = x->rss_private / x->ideal;
	rc = 0;
out:
	kvd_synth_free(&w);
	free(tok);
	if (run)
		munmap(run, 2 * sizeof *run);
	if (ans)
		munmap(ans, 2 * op->clients * ans_floats(&m) * sizeof(float));
	return rc;
}

/* ==== chat ================================================================== */

struct ch_res {
	int ok;
	char err[200];
	uint64_t asked, hit, turns, checked, mismatches, final_bytes, refused;
	double attach_ms, turn_ms;
};

struct ch_arg {
	const struct prefix_opts *op;
	const char *sock;
	const struct kvd_synth *w;
	struct kvc_model m;
	struct ch_res *res;             /* [procs] */
};

static int ch_fail(struct ch_res *r, struct kvc *c, const char *what, int rc)
{
	snprintf(r->err, sizeof r->err, "%s: %s", what,
		 c ? kvc_last_error(c) : kvd_strerror(rc));
	return 1;
}

/* Session s's token ids: distinct per session, so sessions never share. */
static void ch_tokens(uint32_t s, uint32_t n, uint32_t *tok)
{
	for (uint32_t t = 0; t < n; t++)
		tok[t] = (s + 1) * 0x9e3779b1u ^ (t * 2654435761u);
}

/* The new message of session s's turn t: [msg_min, msg_max] tokens. */
static uint32_t ch_msg(const struct prefix_opts *op, uint32_t s, uint32_t t)
{
	uint32_t span = op->msg_max - op->msg_min + 1;

	return op->msg_min + (uint32_t)((s * 7919u + t * 104729u) % span);
}

static uint32_t ch_final(const struct prefix_opts *op, uint32_t s)
{
	uint32_t n = op->base;

	for (uint32_t t = 0; t < op->turns; t++)
		n += ch_msg(op, s, t) + op->gen;
	return n;
}

struct ch_sess {
	uint32_t hlen;                  /* history: tokens [0, hlen) */
	uint32_t first;                 /* the chain's first prefill (0: none yet) */
};

/* One turn of session s: attach, extend, publish, decode, check. */
static int ch_turn(struct ch_arg *a, struct kvc *c, uint32_t s, uint32_t t, struct ch_sess *ss,
		   const uint32_t *tok, float *ans, float *ref, struct ch_res *r)
{
	const struct prefix_opts *op = a->op;
	const uint32_t chunk = kvc_chunk_tokens(c), L = a->m.layers;
	const uint32_t P = ss->hlen + (t ? ch_msg(op, s, t) : op->base + ch_msg(op, s, 0));
	const uint32_t C = P / chunk * chunk, end = P + op->gen;
	const size_t lo = (size_t)L * a->m.q_heads * a->m.head_dim;
	struct kvc_seq *q, *p;
	uint8_t *keys = NULL;
	uint64_t hit;
	double t0 = bench_now_ms(), t1;
	int rc, nk;

	if ((nk = keys_of(c, tok, P, &keys)) < 0)
		return ch_fail(r, c, "keys", nk);
	rc = kvc_seq_attach(c, keys, (uint32_t)nk, &q, &hit);
	t1 = bench_now_ms();
	if (rc) {
		free(keys);
		snprintf(r->err, sizeof r->err, "session %u turn %u: attach: %s", s, t,
			 kvc_last_error(c));
		return 1;
	}
	r->attach_ms += t1 - t0;
	r->asked += P;
	r->hit += hit;
	if (!hit)       /* a new chain: its first call is a prefill */
		ss->first = C > 0 ? C : P;
	/* Up to the last chunk boundary, publish, then the rest and the reply. */
	if (C > hit && (rc = extend_rows(c, q, a->w, L, (uint32_t)hit, C - (uint32_t)hit))) {
		free(keys);
		snprintf(r->err, sizeof r->err, "session %u turn %u: %s", s, t, kvc_last_error(c));
		return 1;
	}
	/* A publish kvd refuses for its limits costs a later miss, not the
	 * turn: a serving stack goes on. */
	if (C > hit && (rc = kvc_seq_publish(c, q, keys + (size_t)(nk - 1) * KVC_KEY_BYTES))) {
		if (rc != -ENOMEM && rc != -EDQUOT && rc != -ENOSPC) {
			free(keys);
			snprintf(r->err, sizeof r->err, "session %u turn %u: %s", s, t,
				 kvc_last_error(c));
			return 1;
		}
		r->refused++;
	}
	if ((rc = extend_rows(c, q, a->w, L, C > hit ? C : (uint32_t)hit,
			      P - (C > hit ? C : (uint32_t)hit))) ||
	    (rc = extend_rows(c, q, a->w, L, P, op->gen)) ||
	    (rc = answer_all(c, q, a->w, L, ans, ans + lo))) {
		free(keys);
		snprintf(r->err, sizeof r->err, "session %u turn %u: %s", s, t, kvc_last_error(c));
		return 1;
	}
	free(keys);
	r->turn_ms += bench_now_ms() - t0;
	if (t + 1 == op->turns) {
		struct kvc_seq_stats st;

		if (!kvc_seq_stats(c, q, &st))
			r->final_bytes += st.bytes;
	}
	kvc_seq_free(c, q);
	/* The same calls on a private sequence: the first prefill, then every
	 * token appended. */
	if ((rc = kvc_seq_create(c, &p)) ||
	    (rc = extend_rows(c, p, a->w, L, 0, ss->first)) ||
	    (rc = extend_rows(c, p, a->w, L, ss->first, end - ss->first)) ||
	    (rc = answer_all(c, p, a->w, L, ref, ref + lo))) {
		snprintf(r->err, sizeof r->err, "session %u turn %u: reference: %s", s, t,
			 kvc_last_error(c));
		return 1;
	}
	r->checked++;
	r->mismatches += memcmp(ans, ref, ans_floats(&a->m) * sizeof(float)) != 0;
	kvc_seq_free(c, p);
	ss->hlen = end;
	r->turns++;
	return 0;
}

static int ch_kid(uint32_t i, void *arg)
{
	struct ch_arg *a = arg;
	const struct prefix_opts *op = a->op;
	struct ch_res *r = &a->res[i];
	struct kvc_opts o = { .socket_path = a->sock, .tenant = "chat", .name = "chat" };
	struct ch_sess ss[256] = { { 0 } };
	uint32_t maxn = 0, *tok;
	float *ans = malloc(2 * ans_floats(&a->m) * sizeof *ans);
	struct kvc *c = NULL;
	int rc;

	for (uint32_t s = i; s < op->sessions; s += op->procs)
		maxn = ch_final(op, s) > maxn ? ch_final(op, s) : maxn;
	tok = malloc((size_t)maxn * sizeof *tok);
	if (!ans || !tok)
		return ch_fail(r, NULL, "memory", -ENOMEM);
	if ((rc = kvc_connect(&o, &c)) || (rc = kvc_profile(c, &a->m)))
		return ch_fail(r, c, "connect", rc);
	/* Turn by turn over the process's sessions, so every session's
	 * sequences wait (and go cold) while the others take their turns. */
	for (uint32_t t = 0; t < op->turns; t++)
		for (uint32_t s = i, k = 0; s < op->sessions; s += op->procs, k++) {
			ch_tokens(s, ch_final(op, s), tok);
			if (ch_turn(a, c, s, t, &ss[k], tok, ans, ans + ans_floats(&a->m), r))
				return 1;
		}
	r->ok = 1;
	kvc_close(c);
	free(ans);
	free(tok);
	return 0;
}

int bench_prefix_chat(const struct prefix_opts *op, struct prefix_chat_res *out)
{
	const struct kvc_model m = px_model(op->layers);
	struct ch_res *res = shared_mem(op->procs * sizeof *res);
	struct kvd_geom g = { m.q_heads, m.kv_heads, m.head_dim, m.K, m.L, m.c, m.kv_dtype,
			      m.estimator == KVC_EST_HYBRID_LCV };
	uint32_t maxn = 0;
	uint64_t total = 0;
	char mem[128], spill[256], dir[200];
	struct kvd_synth w = { 0 };
	struct daemon srv;
	int failed = 1, st = 0;

	memset(out, 0, sizeof *out);
	if (!res || op->procs < 1 || op->procs > PX_MAXCLIENT || op->sessions > 256 * op->procs ||
	    op->msg_min > op->msg_max)
		return 1;
	/* What every session holds at the end (kvd's segments of its tokens),
	 * the budget a third of it. */
	for (uint32_t s = 0; s < op->sessions; s++) {
		uint32_t n = ch_final(op, s);

		maxn = n > maxn ? n : maxn;
		total += (uint64_t)(m.layers - m.n_dense) * kvd_seg_bytes(&g, n - m.sink - m.window);
	}
	out->total_bytes = total;
	out->budget_bytes = total / 3;
	if (kvd_synth_make(&w, KVD_WL_MIXED, maxn, m.q_heads, m.kv_heads, m.head_dim, 4000))
		return 1;
	snprintf(mem, sizeof mem, "limit = %lluM\nhigh = 90%%\nlow = 75%%",
		 (unsigned long long)(out->budget_bytes >> 20));
	snprintf(dir, sizeof dir, "/var/tmp/kvd-share-chat.XXXXXX");
	if (!mkdtemp(dir)) {
		kvd_synth_free(&w);
		return 1;
	}
	snprintf(spill, sizeof spill, "\n[spill]\ndir = %s\n", dir);
	if (srv_start_conf(&srv, mem, spill)) {
		fprintf(stderr, "kvbench share: kvd did not start\n");
	} else {
		struct ch_arg a = { op, srv.sock, &w, m, res };
		double t0 = bench_now_ms();

		failed = run_clients(op->procs, ch_kid, &a);
		out->wall_s = (bench_now_ms() - t0) / 1e3;
		{
			struct kvc_opts o = { .socket_path = srv.sock, .tenant = "chat", .name = "stats" };
			struct kvc_stats ks;
			struct kvc *c;

			if (!kvc_connect(&o, &c) && !kvc_server_stats(c, &ks)) {
				out->spills = ks.spills;
				out->restores = ks.restores;
				out->lost = ks.lost;
			}
			kvc_close(c);
		}
	}
	if (srv.pid > 0)
		st = daemon_stop(&srv);
	rmdir(dir);
	for (uint32_t i = 0; i < op->procs; i++) {
		struct ch_res *r = &res[i];

		if (!r->ok)
			fprintf(stderr, "kvbench share: chat process %u: %s\n", i,
				r->err[0] ? r->err : "died");
		out->asked += r->asked;
		out->hit += r->hit;
		out->turns += r->turns;
		out->checked += r->checked;
		out->mismatches += r->mismatches;
		out->refused += r->refused;
		out->attach_ms += r->attach_ms;
		out->turn_ms += r->turn_ms;
	}
	out->hit_rate = out->asked ? (double)out->hit / (double)out->asked : 0;
	out->identical = out->checked == out->turns && out->turns == (uint64_t)op->sessions * op->turns &&
			 !out->mismatches;
	kvd_synth_free(&w);
	munmap(res, op->procs * sizeof *res);
	return failed || st || !out->identical;
}
