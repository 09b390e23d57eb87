/* kvbench share: sharing one prompt's KV in kvd (docs/ARCHITECTURE.md,
 * "kvbench share fields"), one JSON line per scene.
 *
 *   kvbench share [--json] [--scene fork|prompt|chat|all] [--ctx N] [--layers N]
 *                 [--children N] [--clients N] [--private N] [--steps N]
 *                 [--sessions N] [--procs N] [--turns N] [--base N]
 *                 [--msg-min N] [--msg-max N] [--gen N]
 *
 * The prompt and chat scenes (prefix sharing by content key) are
 * bench/prefix.c's.  The fork scene: one client, one kvd started for the
 * run.  A --ctx token prompt (kvd_synth,
 * the mixed workload; every layer gets the same rows, as in serve and the
 * demo: the generator is not what is measured) is prefilled into one parent
 * sequence of a Llama-3.1-8B-shaped profile cut to --layers layers (layer 0
 * dense, as Llama's profile has it), then forked --children times, so
 * 1 + children sequences hold one prompt.  Reported: the parent's prefill
 * against a fork, kvd's resident memory (VmRSS from /proc) for the parent
 * and for the children, and what kvd charges for them all (ServerStats
 * bytes), which counts each shared segment once.
 *
 * Checked: every child answers kvc_attend on every layer bit for bit as the
 * parent does; after 300 appended tokens, different for child 1 and the
 * parent, child 1 answers as a private sequence given the prompt and the
 * same 300 tokens; and ServerStats bytes are back to 0 once everything is
 * freed.  Any of those failing makes the exit status 1.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "srv.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "prefix.h"
#include "engine/synth.h"

#define SH_APPEND   300         /* tokens decoded into child 1 and the parent */
#define SH_MAXCHILD 64

struct share_opts {
	int json;
	uint32_t ctx, layers, children;
	struct prefix_opts px;
	const char *scene;
	int layers_given;
};

/* Everything one run holds, so one exit path frees it. */
struct share {
	struct share_opts op;
	struct daemon srv;
	struct kvc *c;
	struct kvc_model m;
	struct kvd_synth w;             /* ctx + 2 * SH_APPEND tokens */
	float *k0, *v0;                 /* the prompt, [kv_heads][ctx][d] */
	struct kvc_seq *parent, *priv, *child[SH_MAXCHILD];
	float *o_ref, *lse_ref, *o, *lse;       /* [layers][q_heads][d], [layers][q_heads] */
	uint32_t nchild;
};

static const uint32_t dense0[] = { 0 };

static int usage(void)
{
	fprintf(stderr, "usage: kvbench share [--json] [--scene fork|prompt|chat|all] "
			"[--ctx N>=1024] [--layers N in 2..32]\n"
			"         [--children N in 1..%d] [--clients N in 2..64] [--private N] "
			"[--steps N]\n"
			"         [--sessions N] [--procs N] [--turns N] [--base N] [--msg-min N] "
			"[--msg-max N] [--gen N]\n", SH_MAXCHILD);
	return 2;
}

static int scene_prompt(const struct share_opts *op)
{
	struct prefix_opts px = op->px;
	struct prefix_prompt_res r;
	long cores = sysconf(_SC_NPROCESSORS_ONLN);
	int rc;

	px.ctx = op->ctx;
	/* One dense layer of 8 unless --layers says otherwise: an attach ships
	 * the dense layers' rows whole, and Llama-3.1-8B keeps 2 of 32 dense, so
	 * a slice of 4 (1 of 4) would weigh them double. */
	px.layers = op->layers_given ? op->layers : 8;
	if ((rc = bench_prefix_prompt(&px, &r)))
		return rc;
	if (op->json)
		printf("{\"bench\":\"share\",\"scene\":\"prompt\",\"ctx\":%u,\"private\":%u,"
		       "\"clients\":%u,\"layers\":%u,\"dense_layers\":1,\"steps\":%u,"
		       "\"workload\":\"mixed\",\"prefill_ms\":%.1f,\"publish_ms\":%.2f,"
		       "\"attach_ms\":%.3f,\"attach_vs_prefill\":%.5f,\"identical\":%s,"
		       "\"prompt_bytes\":%llu,\"shared_bytes\":%llu,\"part_bytes\":%llu,"
		       "\"ideal_bytes\":%.0f,\"rss_shared_bytes\":%.0f,\"rss_private_bytes\":%.0f,"
		       "\"resident_ratio\":%.3f,\"private_resident_ratio\":%.3f,"
		       "\"rss_saved_bytes\":%.0f,\"cpu\":\"%s\",\"cores\":%ld}\n",
		       px.ctx, px.priv, px.clients, px.layers, px.steps, r.prefill_ms, r.publish_ms,
		       r.attach_ms, r.attach_ms / r.prefill_ms, r.identical ? "true" : "false",
		       (unsigned long long)r.prompt_bytes, (unsigned long long)r.shared_bytes,
		       (unsigned long long)r.part_bytes, r.ideal, r.rss_shared, r.rss_private,
		       r.resident_ratio, r.private_ratio, r.rss_private - r.rss_shared,
		       bench_cpu_name(), cores);
	else
		printf("share, prompt: %u clients, one %u-token prompt + %u own tokens each, %u layers "
		       "(1 dense); %s, %ld cores\n"
		       "  prefill of the prompt %.1f ms, publish %.2f ms, attach %.3f ms (median): "
		       "attach / prefill %.5f\n"
		       "  kvd resident (RssAnon) for all %u: shared %.1f MiB, private %.1f MiB "
		       "(saved %.1f MiB);\n"
		       "  shared / (one prompt + %u own parts) %.3f, private / same %.3f; "
		       "identical: %s\n",
		       px.clients, px.ctx, px.priv, px.layers, bench_cpu_name(), cores, r.prefill_ms,
		       r.publish_ms, r.attach_ms, r.attach_ms / r.prefill_ms, px.clients,
		       r.rss_shared / 1048576, r.rss_private / 1048576,
		       (r.rss_private - r.rss_shared) / 1048576, px.clients, r.resident_ratio,
		       r.private_ratio, r.identical ? "yes" : "NO");
	fflush(stdout);
	return r.identical ? 0 : 1;
}

static int scene_chat(const struct share_opts *op)
{
	struct prefix_opts px = op->px;
	struct prefix_chat_res r;
	long cores = sysconf(_SC_NPROCESSORS_ONLN);
	int rc;

	px.layers = op->layers;
	rc = bench_prefix_chat(&px, &r);
	if (op->json)
		printf("{\"bench\":\"share\",\"scene\":\"chat\",\"sessions\":%u,\"procs\":%u,"
		       "\"turns\":%u,\"base\":%u,\"msg_min\":%u,\"msg_max\":%u,\"gen\":%u,"
		       "\"layers\":%u,\"total_bytes\":%llu,\"budget_bytes\":%llu,"
		       "\"asked_tokens\":%llu,\"hit_tokens\":%llu,\"hit_rate\":%.4f,"
		       "\"publish_refused\":%llu,"
		       "\"checked\":%llu,\"mismatches\":%llu,\"identical\":%s,\"spills\":%llu,"
		       "\"restores\":%llu,\"lost\":%llu,\"attach_ms_mean\":%.3f,"
		       "\"turn_ms_mean\":%.1f,\"wall_s\":%.1f,\"cpu\":\"%s\",\"cores\":%ld}\n",
		       px.sessions, px.procs, px.turns, px.base, px.msg_min, px.msg_max, px.gen,
		       px.layers, (unsigned long long)r.total_bytes, (unsigned long long)r.budget_bytes,
		       (unsigned long long)r.asked, (unsigned long long)r.hit, r.hit_rate,
		       (unsigned long long)r.refused, (unsigned long long)r.checked, (unsigned long long)r.mismatches,
		       r.identical ? "true" : "false", (unsigned long long)r.spills,
		       (unsigned long long)r.restores, (unsigned long long)r.lost,
		       r.turns ? r.attach_ms / r.turns : 0, r.turns ? r.turn_ms / r.turns : 0,
		       r.wall_s, bench_cpu_name(), cores);
	else
		printf("share, chat: %u sessions x %u turns in %u processes, budget %.1f MiB of %.1f "
		       "MiB; %s, %ld cores\n"
		       "  hit rate %.3f (%llu of %llu prompt tokens from the store), %llu publishes "
		       "refused, %llu spills, %llu restores, %llu lost\n"
		       "  attach %.2f ms, turn %.1f ms (means); %llu turns checked against private "
		       "sequences, %llu differ\n",
		       px.sessions, px.turns, px.procs, r.budget_bytes / 1048576.0,
		       r.total_bytes / 1048576.0, bench_cpu_name(), cores, r.hit_rate,
		       (unsigned long long)r.hit, (unsigned long long)r.asked,
		       (unsigned long long)r.refused, (unsigned long long)r.spills, (unsigned long long)r.restores,
		       (unsigned long long)r.lost, r.turns ? r.attach_ms / r.turns : 0,
		       r.turns ? r.turn_ms / r.turns : 0, (unsigned long long)r.checked,
		       (unsigned long long)r.mismatches);
	fflush(stdout);
	return rc;
}

static int charged(struct share *x, uint64_t *bytes)
{
	struct kvc_stats st;
	int rc = kvc_server_stats(x->c, &st);

	if (!rc)
		*bytes = st.bytes;
	return rc;
}

/* Decodes tokens [t0, t0 + n) of the synthetic layer into every layer of s. */
static int feed(struct share *x, struct kvc_seq *s, uint32_t t0, uint32_t n)
{
	const uint32_t H = x->w.kv_heads, d = x->w.d, N = x->w.n;
	float kt[8 * 128], vt[8 * 128];
	int rc;

	for (uint32_t t = t0; t < t0 + n; t++) {
		for (uint32_t h = 0; h < H; h++) {
			memcpy(kt + (size_t)h * d, x->w.k + ((size_t)h * N + t) * d, d * sizeof *kt);
			memcpy(vt + (size_t)h * d, x->w.v + ((size_t)h * N + t) * d, d * sizeof *vt);
		}
		for (uint32_t l = 0; l < x->m.layers; l++)
			if ((rc = kvc_append(x->c, s, l, kt, vt)))
				return rc;
	}
	return 0;
}

static int prefill(struct share *x, struct kvc_seq *s)
{
	int rc;

	for (uint32_t l = 0; l < x->m.layers; l++)
		if ((rc = kvc_prefill(x->c, s, l, x->k0, x->v0, x->op.ctx)))
			return rc;
	return 0;
}

/* s's merged answer on every layer to the workload's query, into o, lse. */
static int answer(struct share *x, struct kvc_seq *s, float *o, float *lse)
{
	const size_t qd = (size_t)x->m.q_heads * x->m.head_dim;
	int rc;

	for (uint32_t l = 0; l < x->m.layers; l++)
		if ((rc = kvc_attend(x->c, l, &s, 1, x->w.q, o + l * qd, lse + (size_t)l * x->m.q_heads)))
			return rc;
	return 0;
}

/* 1 when s answers bit for bit what o_ref, lse_ref hold; -1 on an error. */
static int same_as_ref(struct share *x, struct kvc_seq *s)
{
	const size_t no = (size_t)x->m.layers * x->m.q_heads * x->m.head_dim;
	const size_t nl = (size_t)x->m.layers * x->m.q_heads;

	if (answer(x, s, x->o, x->lse))
		return -1;
	return !memcmp(x->o, x->o_ref, no * sizeof *x->o) &&
	       !memcmp(x->lse, x->lse_ref, nl * sizeof *x->lse);
}

static int run(struct share *x)
{
	const struct share_opts *op = &x->op;
	const uint32_t N = op->ctx + 2 * SH_APPEND;
	struct kvc_opts o = { .tenant = "bench", .name = "share" };
	uint64_t rss0, rss1, rss2, ch0, ch1, ch2, after;
	double t, prefill_ms, fork_ms[SH_MAXCHILD];
	int identical = 1, same, rc, st;
	const char *what;
	uint32_t H, d;

	x->m = llama(op->layers);
	H = x->m.kv_heads;
	d = x->m.head_dim;
	/* Llama's own profile at 32 layers (0 and 16 dense); a slice keeps
	 * layer 0 dense, so the forks copy a dense layer's rows too. */
	if (op->layers != 32) {
		x->m.dense_layers = dense0;
		x->m.n_dense = 1;
	}
	what = "workload";
	if ((rc = kvd_synth_make(&x->w, KVD_WL_MIXED, N, x->m.q_heads, H, d, 3000)))
		goto fail_rc;
	what = "buffers";
	rc = -ENOMEM;
	{
		const size_t no = (size_t)x->m.layers * x->m.q_heads * d;
		const size_t nl = (size_t)x->m.layers * x->m.q_heads;

		x->k0 = malloc((size_t)H * op->ctx * d * sizeof *x->k0);
		x->v0 = malloc((size_t)H * op->ctx * d * sizeof *x->v0);
		x->o_ref = malloc(no * sizeof *x->o_ref);
		x->o = malloc(no * sizeof *x->o);
		x->lse_ref = malloc(nl * sizeof *x->lse_ref);
		x->lse = malloc(nl * sizeof *x->lse);
	}
	if (!x->k0 || !x->v0 || !x->o_ref || !x->o || !x->lse_ref || !x->lse)
		goto fail_rc;
	for (uint32_t h = 0; h < H; h++) {
		memcpy(x->k0 + (size_t)h * op->ctx * d, x->w.k + (size_t)h * N * d,
		       (size_t)op->ctx * d * sizeof *x->k0);
		memcpy(x->v0 + (size_t)h * op->ctx * d, x->w.v + (size_t)h * N * d,
		       (size_t)op->ctx * d * sizeof *x->v0);
	}

	what = "kvd did not start";
	/* A start that timed out leaves srv.pid set: share_free stops it. */
	if (srv_start_conf(&x->srv, NULL, NULL))
		goto fail;
	o.socket_path = x->srv.sock;
	what = "connect";
	if ((rc = kvc_connect(&o, &x->c)))
		goto fail_kvc;
	what = "profile";
	if ((rc = kvc_profile(x->c, &x->m)))
		goto fail_kvc;

	/* The private sequence first: its prefill also faults in the
	 * connection's arena in kvd (and the client), so the parent's
	 * figures below are a warm connection's, and kvd's resident growth
	 * for the parent is the parent's rows, not the arena's pages. */
	what = "private sequence";
	if ((rc = kvc_seq_create(x->c, &x->priv)) || (rc = prefill(x, x->priv)))
		goto fail_kvc;

	what = "stats";
	if ((rc = bench_proc_kib(x->srv.pid, "VmRSS:", &rss0)) || (rc = charged(x, &ch0)))
		goto fail_rc;
	what = "parent";
	t = bench_now_ms();
	if ((rc = kvc_seq_create(x->c, &x->parent)) || (rc = prefill(x, x->parent)))
		goto fail_kvc;
	prefill_ms = bench_now_ms() - t;
	what = "stats";
	if ((rc = bench_proc_kib(x->srv.pid, "VmRSS:", &rss1)) || (rc = charged(x, &ch1)))
		goto fail_rc;
	what = "fork";
	for (uint32_t i = 0; i < op->children; i++) {
		t = bench_now_ms();
		if ((rc = kvc_seq_fork(x->c, x->parent, &x->child[i])))
			goto fail_kvc;
		fork_ms[i] = bench_now_ms() - t;
		x->nchild++;
	}
	/* Before any ATTEND, whose scratch in kvd is not the sequences'. */
	what = "stats";
	if ((rc = bench_proc_kib(x->srv.pid, "VmRSS:", &rss2)) || (rc = charged(x, &ch2)))
		goto fail_rc;

	what = "attend";
	if ((rc = answer(x, x->parent, x->o_ref, x->lse_ref)))
		goto fail_kvc;
	for (uint32_t i = 0; i < x->nchild; i++) {
		if ((same = same_as_ref(x, x->child[i])) < 0)
			goto fail_kvc;
		identical &= same;
	}
	/* Diverge: child 1 and the private one decode the same tokens, the
	 * parent others.  Child 1 must now be what a prefill of the prompt
	 * and those tokens makes, with nothing of the parent's in it. */
	what = "append";
	if ((rc = feed(x, x->child[0], op->ctx, SH_APPEND)) ||
	    (rc = feed(x, x->priv, op->ctx, SH_APPEND)) ||
	    (rc = feed(x, x->parent, op->ctx + SH_APPEND, SH_APPEND)))
		goto fail_kvc;
	what = "attend";
	if ((rc = answer(x, x->priv, x->o_ref, x->lse_ref)))
		goto fail_kvc;
	if ((same = same_as_ref(x, x->child[0])) < 0)
		goto fail_kvc;
	identical &= same;

	/* Free everything (kvc_seq_free drops the handle whatever kvd
	 * answers, so it is forgotten first): kvd's books must come back to
	 * nothing, the shared segments included. */
	what = "free";
	while (x->nchild)
		if ((rc = kvc_seq_free(x->c, x->child[--x->nchild])))
			goto fail_kvc;
	rc = kvc_seq_free(x->c, x->parent);
	x->parent = NULL;
	if (rc)
		goto fail_kvc;
	rc = kvc_seq_free(x->c, x->priv);
	x->priv = NULL;
	if (rc)
		goto fail_kvc;
	what = "stats";
	if ((rc = charged(x, &after)))
		goto fail_kvc;
	kvc_close(x->c);
	x->c = NULL;
	st = daemon_stop(&x->srv);

	double fork_med = bench_median(fork_ms, (int)op->children);
	double parent_b = (double)rss1 - (double)rss0, forks_b = (double)rss2 - (double)rss1;
	double all_b = (double)rss2 - (double)rss0;
	uint64_t ch_all = ch2 - ch0, ch_parent = ch1 - ch0;
	long cores = sysconf(_SC_NPROCESSORS_ONLN);

	if (op->json)
		printf("{\"bench\":\"share\",\"scene\":\"fork\",\"ctx\":%u,\"layers\":%u,\"dense_layers\":%u,"
		       "\"children\":%u,\"sequences\":%u,\"workload\":\"mixed\",\"q_heads\":%u,"
		       "\"kv_heads\":%u,\"head_dim\":%u,\"K\":%u,\"L\":%u,\"c\":%u,"
		       "\"prefill_ms\":%.1f,\"fork_ms\":%.3f,\"fork_vs_prefill\":%.5f,"
		       "\"identical\":%s,\"rss_base_bytes\":%llu,\"rss_parent_bytes\":%.0f,"
		       "\"rss_forks_bytes\":%.0f,\"resident_ratio\":%.3f,"
		       "\"private_ratio_expected\":%u,\"charged_parent_bytes\":%llu,"
		       "\"charged_bytes\":%llu,\"charged_vs_resident\":%.3f,"
		       "\"bytes_after_free\":%llu,\"kvd_exit\":%d,\"cpu\":\"%s\",\"cores\":%ld}\n",
		       op->ctx, x->m.layers, x->m.n_dense, op->children, op->children + 1,
		       x->m.q_heads, x->m.kv_heads, x->m.head_dim, x->m.K, x->m.L, x->m.c,
		       prefill_ms, fork_med, fork_med / prefill_ms, identical ? "true" : "false",
		       (unsigned long long)rss0, parent_b, forks_b, all_b / parent_b,
		       op->children + 1, (unsigned long long)ch_parent, (unsigned long long)ch_all,
		       ch_all / all_b, (unsigned long long)after, st, bench_cpu_name(), cores);
	else
		printf("share: %u-token prompt, %u layers (%u dense), 1 parent + %u forks; %s, %ld cores\n"
		       "  prefill %.1f ms, fork %.3f ms (median), fork / prefill %.5f\n"
		       "  kvd resident: parent +%.1f MiB, forks +%.1f MiB; all / parent %.3f "
		       "(private prefills: %u)\n"
		       "  charged %.1f MiB = %.2f x resident growth; identical: %s; "
		       "bytes after free %llu; kvd exit %d\n",
		       op->ctx, x->m.layers, x->m.n_dense, op->children, bench_cpu_name(), cores,
		       prefill_ms, fork_med, fork_med / prefill_ms, parent_b / 1048576,
		       forks_b / 1048576, all_b / parent_b, op->children + 1, ch_all / 1048576.0,
		       ch_all / all_b, identical ? "yes" : "NO", (unsigned long long)after, st);
	fflush(stdout);
	if (!identical)
		fprintf(stderr, "kvbench share: a fork did not answer as it should, bit for bit\n");
	if (after)
		fprintf(stderr, "kvbench share: %llu bytes still charged after every free\n",
			(unsigned long long)after);
	return identical && !after && !st ? 0 : 1;

fail_kvc:
	fprintf(stderr, "kvbench share: %s: %s\n", what, x->c ? kvc_last_error(x->c) : "?");
	return 1;
fail_rc:
	fprintf(stderr, "kvbench share: %s: %s\n", what, kvd_strerror(rc));
	return 1;
fail:
	fprintf(stderr, "kvbench share: %s\n", what);
	return 1;
}

/* Whatever a run left: sequences, the connection, kvd, buffers. */
static void share_free(struct share *x)
{
	if (x->c) {
		while (x->nchild)
			kvc_seq_free(x->c, x->child[--x->nchild]);
		if (x->parent)
			kvc_seq_free(x->c, x->parent);
		if (x->priv)
			kvc_seq_free(x->c, x->priv);
		kvc_close(x->c);
	}
	if (x->srv.pid > 0)
		daemon_stop(&x->srv);
	kvd_synth_free(&x->w);
	free(x->k0);
	free(x->v0);
	free(x->o_ref);
	free(x->o);
	free(x->lse_ref);
	free(x->lse);
}

int bench_share_main(int argc, char **argv)
{
	struct share *x = calloc(1, sizeof *x);
	int rc;

	if (!x) {
		fprintf(stderr, "kvbench share: out of memory\n");
		return 1;
	}
	int layers_given = 0;

	x->op = (struct share_opts){ .ctx = 16384, .layers = 4, .children = 7, .scene = "all",
		.px = { .clients = 8, .priv = 2048, .steps = 8, .sessions = 32, .procs = 4,
			.turns = 3, .base = 768, .msg_min = 200, .msg_max = 600, .gen = 32 } };
	for (int i = 0; i < argc; i++) {
		struct prefix_opts *px = &x->op.px;

		if (!strcmp(argv[i], "--json")) {
			x->op.json = 1;
			continue;
		}
		if (!strcmp(argv[i], "--scene") && i + 1 < argc) {
			x->op.scene = argv[++i];
			continue;
		}
		if (!strcmp(argv[i], "--layers"))
			layers_given = 1;
		uint32_t *dst = !strcmp(argv[i], "--ctx") ? &x->op.ctx :
				!strcmp(argv[i], "--layers") ? &x->op.layers :
				!strcmp(argv[i], "--children") ? &x->op.children :
				!strcmp(argv[i], "--clients") ? &px->clients :
				!strcmp(argv[i], "--private") ? &px->priv :
				!strcmp(argv[i], "--steps") ? &px->steps :
				!strcmp(argv[i], "--sessions") ? &px->sessions :
				!strcmp(argv[i], "--procs") ? &px->procs :
				!strcmp(argv[i], "--turns") ? &px->turns :
				!strcmp(argv[i], "--base") ? &px->base :
				!strcmp(argv[i], "--msg-min") ? &px->msg_min :
				!strcmp(argv[i], "--msg-max") ? &px->msg_max :
				!strcmp(argv[i], "--gen") ? &px->gen : NULL;

		if (!dst || i + 1 >= argc || bench_parse_u32(argv[++i], dst) || x->op.ctx < 1024 ||
		    x->op.layers < 2 || x->op.layers > 32 || x->op.children > SH_MAXCHILD ||
		    px->clients < 2 || px->clients > 64 || px->procs > 64 ||
		    px->msg_min > px->msg_max) {
			free(x);
			return usage();
		}
	}
	const char *sc = x->op.scene;

	x->op.layers_given = layers_given;
	int all = !strcmp(sc, "all");

	if (!all && strcmp(sc, "fork") && strcmp(sc, "prompt") && strcmp(sc, "chat")) {
		free(x);
		return usage();
	}
	rc = 0;
	if (all || !strcmp(sc, "fork")) {
		rc |= run(x);
		share_free(x);
	}
	if (all || !strcmp(sc, "prompt"))
		rc |= scene_prompt(&x->op);
	if (all || !strcmp(sc, "chat"))
		rc |= scene_chat(&x->op);
	free(x);
	return rc;
}
