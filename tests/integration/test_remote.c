/* The remote tier: two kvd daemons (separate run and spill directories)
 * and a real Redis Cluster of 3 masters and 3 replicas on loopback.
 *
 *   test_remote_attach     A publishes a 16k-token prefix; B, which never
 *                          saw it, attaches it by key and answers bit for
 *                          bit as A's sequence does
 *   test_remote_too_big    a third daemon whose memory_per_uid is below the
 *                          prefix's size: its attach is a clean miss,
 *                          refused from the manifest (nothing fetched, no
 *                          file written)
 *   test_remote_ask        the prefix's slot half migrated to another master
 *                          while B reads it (ASK): the attach completes and
 *                          answers as A
 *   test_remote_corrupt    a chunk changed in Redis (SETRANGE): the CRC32C
 *                          check refuses it, B's attach is a clean miss and
 *                          its sequence serves a private prefill
 *   test_remote_failover   the master holding the prefix killed just before
 *                          B reads it: B follows the failover and answers as
 *                          A, or misses cleanly; never a wrong answer
 *   test_remote_isolation  another uid on B misses uid 0's prefix (its
 *                          lookup names its own namespace); what it
 *                          publishes, uid 0 on A does not find
 *   test_remote_hybrid     a hybrid profile's prefix, published after a
 *                          few decode steps, carries its heavy lists: B's
 *                          sequence attached from the cluster answers the
 *                          next step bit for bit as A's publisher
 *   test_remote_evicted    [remote] evicted = yes on a daemon whose uid may
 *                          keep two sequences' files on local disk: five
 *                          sequences evicted, the files of the others live
 *                          in the cluster only, and each comes back bit
 *                          for bit; one whose copy was corrupted in Redis is
 *                          LOST, never a wrong answer; freeing deletes the
 *                          copies
 *   test_remote_quota      the same under remote_per_uid: a copy that would
 *                          pass it is not sent, its file stays local, and
 *                          the eviction that needs its room is refused
 *   test_remote_down       the whole cluster stopped: both daemons keep
 *                          serving (B attaches what it fetched before from
 *                          its own disk, misses the rest, A publishes and
 *                          attaches locally); a sequence whose file is in
 *                          the cluster only is refused with the reason and
 *                          stays on disk (not LOST: the cluster may return)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <grp.h>
#include <limits.h>
#include <hiredis/hiredis.h>
#include <math.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "daemon.h"
#include "gpu-client/kvc.h"
#include "kvd/store/rcl.h"
#include "rcluster.h"
#include "kvd/store/remote.h"
#include "engine/synth.h"
#include "testutil.h"

#define LAYERS  3
#define HQ      8
#define HKV     2
#define D       128
#define CHUNK   256
#define P_TOK   16384           /* the prefix: 64 chunks */
#define NTOT    (P_TOK + 256)
#define UID_B   65534

static const uint32_t dense_layers[] = { 0 };
static const struct kvc_model model = {
	.name = "remote", .layers = LAYERS, .q_heads = HQ, .kv_heads = HKV, .head_dim = D,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 7, .segment_tokens = 4096, .seal_tokens = 256,
};

static struct rcluster RC;
static struct daemon A, B;
static char spill_a[64], spill_b[64], cfg_a[96], cfg_b[96], seeds[512];

/* ---- the cluster and the daemons ------------------------------------------ */

/* retry_ms: how long kvd retries unreachable nodes.  A and B must outlast a
 * failover (a replica takes over ~2 s after its master dies, with the
 * cluster's 1 s node timeout); test_remote_down then waits it out twice
 * against a stopped cluster, so it is no longer than that needs.  A daemon
 * that only meets a stopped cluster retries briefly. */
#define AB_RETRY_MS 5000

static int write_cfg(char *path, size_t n, const char *spill, const char *tag, unsigned retry_ms,
		     const char *extra)
{
	FILE *f;

	snprintf(path, n, "/tmp/kvd-remote-%s.%d.conf", tag, (int)getpid());
	if (!(f = fopen(path, "w")))
		return -1;
	fprintf(f, "[spill]\ndir = %s\n[remote]\nseeds = %s\nreplicas = 1\nwait_timeout_ms = 3000\n"
		"timeout_ms = 1000\nretry_ms = %u\nchunk = 1M\n%s", spill, seeds, retry_ms, extra);
	fclose(f);
	return 0;
}

static int setup(void **state)
{
	char ta[] = "/tmp/kvd-remote-a.XXXXXX", tb[] = "/tmp/kvd-remote-b.XXXXXX";

	if (rcluster_start(&RC, 3, 1)) {
		print_error("cannot start a Redis Cluster (redis-server, redis-cli)\n");
		return -1;
	}
	rcluster_seeds(&RC, seeds, sizeof seeds);
	if (!mkdtemp(ta) || !mkdtemp(tb))
		return -1;
	snprintf(spill_a, sizeof spill_a, "%s", ta);
	snprintf(spill_b, sizeof spill_b, "%s", tb);
	if (write_cfg(cfg_a, sizeof cfg_a, spill_a, "a", AB_RETRY_MS, "") ||
	    write_cfg(cfg_b, sizeof cfg_b, spill_b, "b", AB_RETRY_MS, ""))
		return -1;
	if (daemon_start4(&A, "--config", cfg_a, NULL, NULL) ||
	    daemon_start4(&B, "--config", cfg_b, NULL, NULL))
		return -1;
	return 0;
}

static int teardown(void **state)
{
	int ra = A.pid > 0 ? daemon_stop(&A) : -1, rb = B.pid > 0 ? daemon_stop(&B) : -1;

	rcluster_stop(&RC);
	daemon_rm_tree(spill_a);
	daemon_rm_tree(spill_b);
	unlink(cfg_a);
	unlink(cfg_b);
	if (ra || rb)
		print_error("daemon_stop: %d %d (want 0: clean drains)\n", ra, rb);
	return ra || rb ? -1 : 0;
}

/* ---- data ----------------------------------------------------------------- */

struct src {
	struct kvd_synth w[LAYERS];
	uint32_t tok[NTOT];
};

/* n tokens: the evicted-sequence tests use a few thousand, and making all
 * NTOT of them (Box-Muller, ~1.5 s a source here) was most of their time. */
static void src_make_n(struct src *s, uint64_t seed, uint32_t n)
{
	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvd_synth_make(&s->w[l], (enum kvd_wl)(l % KVD_WL_COUNT), n, HQ,
						HKV, D, seed * 10 + l), 0);
	for (uint32_t i = 0; i < NTOT; i++)
		s->tok[i] = (uint32_t)(seed * 1000003u + i * 7919u);
}

static void src_make(struct src *s, uint64_t seed)
{
	src_make_n(s, seed, NTOT);
}

static void src_free(struct src *s)
{
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&s->w[l]);
}

static struct kvc *kconnect_ok(const struct daemon *d, const char *name)
{
	struct kvc_opts o = { .socket_path = d->sock, .tenant = "t", .name = name, .slots = 8,
			      .slot_size = 1 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c) || kvc_profile(c, &model))
		fail_msg("connect %s: %s", name, c ? kvc_last_error(c) : "no connection");
	return c;
}

static void prefill_ok(struct kvc *c, struct kvc_seq *s, const struct src *src, uint32_t n)
{
	float *k = malloc((size_t)HKV * n * D * 4), *v = malloc((size_t)HKV * n * D * 4);

	assert_non_null(k);
	assert_non_null(v);
	for (uint32_t l = 0; l < LAYERS; l++) {
		assert_true(n <= src->w[l].n);
		for (uint32_t h = 0; h < HKV; h++) {
			memcpy(k + (size_t)h * n * D, src->w[l].k + (size_t)h * src->w[l].n * D,
			       (size_t)n * D * 4);
			memcpy(v + (size_t)h * n * D, src->w[l].v + (size_t)h * src->w[l].n * D,
			       (size_t)n * D * 4);
		}
		if (kvc_extend(c, s, l, k, v, n))
			fail_msg("prefill layer %u: %s", l, kvc_last_error(c));
	}
	free(k);
	free(v);
}

struct ans {
	float o[LAYERS][HQ * D], lse[LAYERS][HQ];
};

static void answer_ok(struct kvc *c, struct kvc_seq *s, const struct src *q, struct ans *a)
{
	memset(a, 0, sizeof *a);
	for (uint32_t l = 0; l < LAYERS; l++)
		if (kvc_attend(c, l, &s, 1, q->w[l].q, a->o[l], a->lse[l]))
			fail_msg("attend: %s", kvc_last_error(c));
	for (size_t i = 0; i < sizeof *a / sizeof(float); i++)
		if (!isfinite(((const float *)a)[i]))
			fail_msg("answer not finite");
}

/* A's sequence of the prompt, published; its answer in *a.  Returns when
 * the prefix's manifest is in the cluster (A sends it in the background). */
static void wait_manifest(const uint8_t *last_key);

static struct kvc_seq *publish_on_a(struct kvc *c, const struct src *src, struct ans *a,
				    uint8_t *last_key)
{
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES];
	int nk = kvc_content_keys(c, src->tok, P_TOK, keys);
	struct kvc_seq *s;

	assert_int_equal(nk, P_TOK / CHUNK);
	if (kvc_seq_create(c, &s))
		fail_msg("seq: %s", kvc_last_error(c));
	prefill_ok(c, s, src, P_TOK);
	if (kvc_seq_publish(c, s, keys + (size_t)(nk - 1) * KVC_KEY_BYTES))
		fail_msg("publish: %s", kvc_last_error(c));
	answer_ok(c, s, src, a);
	memcpy(last_key, keys + (size_t)(nk - 1) * KVC_KEY_BYTES, KVC_KEY_BYTES);
	wait_manifest(last_key);
	return s;
}

/* Returns when the manifest of the prefix published under last_key is in
 * the cluster (the publisher sends it in the background). */
static void wait_manifest(const uint8_t *last_key)
{
	char stem[160], name[170];

	/* The namespace of uid 0 (the tests run as root) is "u<uid>". */
	assert_true(kvd_remote_stem("kvd", "u0", last_key, stem, sizeof stem) > 0);
	snprintf(name, sizeof name, "%s:m", stem);
	struct kvd_rcl_cfg rc = { .seeds = seeds, .retry_ms = 5000 };
	struct kvd_rcl *r;
	char msg[160];

	assert_int_equal(kvd_rcl_create(&rc, &r, msg, sizeof msg), 0);
	for (int i = 0; i < 300; i++) {
		struct kvd_rcl_op op = { .kind = KVD_RCL_EXISTS, .key = name, .klen = strlen(name) };

		if (kvd_rcl_run(r, &op, 1, msg, sizeof msg) == 0 && op.rc == 0) {
			kvd_rcl_destroy(r);
			return;
		}
		daemon_sleep_ms(100);
	}
	kvd_rcl_destroy(r);
	fail_msg("the prefix never reached the cluster");
}

static struct kvc_seq *attach_on(struct kvc *c, const struct src *src, uint32_t n,
				 uint64_t *got)
{
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES];
	int nk = kvc_content_keys(c, src->tok, n, keys);
	struct kvc_seq *s;

	assert_true(nk > 0);
	if (kvc_seq_attach(c, keys, (uint32_t)nk, &s, got))
		fail_msg("attach: %s", kvc_last_error(c));
	return s;
}

static void expect_same(const char *what, const struct ans *x, const struct ans *y)
{
	if (memcmp(x, y, sizeof *x)) {
		for (uint32_t l = 0; l < LAYERS; l++)
			print_message("  %s: layer %u rel %.3g\n", what, l,
				      rel_err_ff(x->o[l], y->o[l], HQ * D));
		fail_msg("%s: answers differ", what);
	}
}

/* A counter of d's metrics (`kvctl metrics`, beside the test binary's
 * directory), or -1. */
static long long metric(const struct daemon *d, const char *name)
{
	char exe[PATH_MAX], cmd[PATH_MAX + 256], line[512];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	long long v = -1;
	FILE *f;

	if (n <= 0)
		return -1;
	exe[n] = 0;
	*strrchr(exe, '/') = 0;
	snprintf(cmd, sizeof cmd, "%s/../kvctl --socket %s metrics", exe, d->sock);
	if (!(f = popen(cmd, "r")))
		return -1;
	while (fgets(line, sizeof line, f))
		if (!strncmp(line, name, strlen(name)) && line[strlen(name)] == ' ')
			v = atoll(line + strlen(name) + 1);
	pclose(f);
	return v;
}

/* A hash tag's slot, from a stem. */
static uint16_t slot_of(const uint8_t *key)
{
	char stem[160];

	kvd_remote_stem("kvd", "u0", key, stem, sizeof stem);
	return kvd_rcl_slot(stem, strlen(stem));
}

/* ==== tests ================================================================ */

static void test_remote_attach(void **state)
{
	struct kvc *a = kconnect_ok(&A, "a"), *b = kconnect_ok(&B, "b");
	struct src src;
	struct ans pa, pb;
	uint8_t key[KVC_KEY_BYTES];
	uint64_t got;

	src_make(&src, 1);
	long long hits = metric(&B, "kvd_remote_hits_total");
	struct kvc_seq *s = publish_on_a(a, &src, &pa, key);
	/* B asks for the prompt and one chunk more: the longest published one
	 * is the prompt, found only in the cluster. */
	struct kvc_seq *x = attach_on(b, &src, P_TOK + CHUNK, &got);

	assert_int_equal(got, P_TOK);
	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvc_seq_tokens(x, l), P_TOK);
	answer_ok(b, x, &src, &pb);
	expect_same("B attached from the cluster vs A", &pb, &pa);
	assert_int_equal(metric(&B, "kvd_remote_hits_total"), hits + 1);
	assert_true(metric(&A, "kvd_remote_puts_total") >= 1);
	/* WAIT saw the replica: the write counted as durable. */
	for (int i = 0; i < 100 && metric(&A, "kvd_remote_durable_total") < 1; i++)
		daemon_sleep_ms(50);
	assert_true(metric(&A, "kvd_remote_durable_total") >= 1);
	/* A second attach on B is local now. */
	struct kvc_seq *y = attach_on(b, &src, P_TOK, &got);

	assert_int_equal(got, P_TOK);
	answer_ok(b, y, &src, &pb);
	expect_same("B's second attach vs A", &pb, &pa);
	assert_int_equal(kvc_seq_free(b, y), 0);
	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	src_free(&src);
	kvc_close(a);
	kvc_close(b);
}

#define HY_TOK  2048            /* the hybrid prefix: 8 chunks */
#define HY_WARM 6               /* decode steps before it is published */

static const struct kvc_model model_hybrid = {
	.name = "remote-hybrid", .layers = LAYERS, .q_heads = HQ, .kv_heads = HKV, .head_dim = D,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .estimator = KVC_EST_HYBRID,
	.dense_layers = dense_layers, .n_dense = 1, .seed = 7, .segment_tokens = 4096,
	.seal_tokens = 256,
};

/* Decode step `step` of s: every layer with its query drifted by the step. */
static void hy_step(struct kvc *c, struct kvc_seq *s, const struct src *src, int step,
		    struct ans *a)
{
	float q[HQ * D];

	memset(a, 0, sizeof *a);
	for (uint32_t l = 0; l < LAYERS; l++) {
		for (int i = 0; i < HQ * D; i++)
			q[i] = src->w[l].q[i] * (1.0f + 0.02f * (float)step * sinf((float)i));
		if (kvc_attend(c, l, &s, 1, q, a->o[l], a->lse[l]))
			fail_msg("attend: %s", kvc_last_error(c));
	}
}

static void test_remote_hybrid(void **state)
{
	struct kvc_opts o = { .tenant = "t", .slots = 8, .slot_size = 1 << 20 };
	uint8_t keys[(HY_TOK / CHUNK) * KVC_KEY_BYTES];
	struct kvc *a, *b;
	struct kvc_seq *s, *x;
	struct src src;
	struct ans pa, pb;
	uint64_t got;

	o.socket_path = A.sock;
	o.name = "ha";
	assert_int_equal(kvc_connect(&o, &a), 0);
	o.socket_path = B.sock;
	o.name = "hb";
	assert_int_equal(kvc_connect(&o, &b), 0);
	assert_int_equal(kvc_profile(a, &model_hybrid), 0);
	assert_int_equal(kvc_profile(b, &model_hybrid), 0);
	src_make_n(&src, 5, HY_TOK);
	assert_int_equal(kvc_content_keys(a, src.tok, HY_TOK, keys), HY_TOK / CHUNK);
	assert_int_equal(kvc_seq_create(a, &s), 0);
	prefill_ok(a, s, &src, HY_TOK);
	for (int t = 0; t < HY_WARM; t++)
		hy_step(a, s, &src, t, &pa);
	if (kvc_seq_publish(a, s, keys + (size_t)(HY_TOK / CHUNK - 1) * KVC_KEY_BYTES))
		fail_msg("publish: %s", kvc_last_error(a));
	wait_manifest(keys + (size_t)(HY_TOK / CHUNK - 1) * KVC_KEY_BYTES);
	if (kvc_seq_attach(b, keys, HY_TOK / CHUNK, &x, &got))
		fail_msg("attach: %s", kvc_last_error(b));
	assert_int_equal(got, HY_TOK);
	/* Both steps after the publish, from the lists the snapshot took. */
	for (int t = HY_WARM; t < HY_WARM + 2; t++) {
		hy_step(a, s, &src, t, &pa);
		hy_step(b, x, &src, t, &pb);
		expect_same("B attached a hybrid prefix vs A's publisher", &pb, &pa);
	}
	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	src_free(&src);
	kvc_close(a);
	kvc_close(b);
}

static int files_in(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int n = 0;

	assert_non_null(d);
	while ((e = readdir(d)))
		n += strstr(e->d_name, ".kvs") != NULL;
	closedir(d);
	return n;
}

static void test_remote_too_big(void **state)
{
	char dir[] = "/tmp/kvd-remote-c.XXXXXX", cfg[96];
	struct daemon C;
	struct src src;
	uint64_t got;

	/* The prompt of test_remote_attach is about 60 MB as a file. */
	assert_non_null(mkdtemp(dir));
	assert_int_equal(write_cfg(cfg, sizeof cfg, dir, "c", 12000, "[limits]\nmemory_per_uid = 16M\n"), 0);
	assert_int_equal(daemon_start4(&C, "--config", cfg, NULL, NULL), 0);
	struct kvc *c = kconnect_ok(&C, "c");

	src_make(&src, 1);
	struct kvc_seq *x = attach_on(c, &src, P_TOK, &got);

	assert_int_equal(got, 0);
	assert_int_equal(metric(&C, "kvd_remote_too_big_total"), 1);
	assert_int_equal(metric(&C, "kvd_remote_hits_total"), 0);
	assert_int_equal(metric(&C, "kvd_remote_get_bytes_total"), 0);
	assert_int_equal(files_in(dir), 0);
	/* Asked again, the same answer from the lookup's memory or a new one. */
	assert_int_equal(kvc_seq_free(c, x), 0);
	x = attach_on(c, &src, P_TOK, &got);
	assert_int_equal(got, 0);
	assert_int_equal(files_in(dir), 0);
	assert_int_equal(kvc_seq_free(c, x), 0);
	kvc_close(c);
	src_free(&src);
	assert_int_equal(daemon_stop(&C), 0);
	daemon_rm_tree(dir);
	unlink(cfg);
}

static void test_remote_ask(void **state)
{
	struct kvc *a = kconnect_ok(&A, "a"), *b = kconnect_ok(&B, "b");
	struct src src;
	struct ans pa, pb;
	uint8_t key[KVC_KEY_BYTES];
	uint64_t got;

	src_make(&src, 2);
	struct kvc_seq *s = publish_on_a(a, &src, &pa, key);
	uint16_t slot = slot_of(key);
	int from = rcluster_master_port(&RC, slot), to = -1;

	assert_true(from > 0);
	for (int i = 0; i < RC.n && to < 0; i++) {
		int p = RC.base + i;

		/* another master: one that serves some other slot */
		for (uint16_t sl = 0; sl < KVD_RCL_SLOTS; sl += 997)
			if (rcluster_master_port(&RC, sl) == p && p != from) {
				to = p;
				break;
			}
	}
	assert_true(to > 0);
	/* Half of the prefix's values (it has about 20) move; the rest stay. */
	long long redir = metric(&B, "kvd_remote_redirects_total");

	assert_int_equal(rcluster_migrate_begin(&RC, slot, to, 10), 0);
	struct kvc_seq *x = attach_on(b, &src, P_TOK, &got);

	assert_int_equal(got, P_TOK);
	assert_true(metric(&B, "kvd_remote_redirects_total") > redir);
	answer_ok(b, x, &src, &pb);
	expect_same("B attached during a migration vs A", &pb, &pa);
	assert_int_equal(rcluster_migrate_finish(&RC, slot, to), 0);
	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	src_free(&src);
	kvc_close(a);
	kvc_close(b);
}

static void test_remote_corrupt(void **state)
{
	struct kvc *a = kconnect_ok(&A, "a"), *b = kconnect_ok(&B, "b");
	struct src src;
	struct ans pa, pb;
	uint8_t key[KVC_KEY_BYTES];
	char stem[160], name[170];
	uint64_t got;

	src_make(&src, 3);
	struct kvc_seq *s = publish_on_a(a, &src, &pa, key);

	/* One byte of chunk 3 changed where the master keeps it. */
	kvd_remote_stem("kvd", "u0", key, stem, sizeof stem);
	snprintf(name, sizeof name, "%s:3", stem);
	int port = rcluster_master_port(&RC, slot_of(key));
	redisContext *rc = redisConnect("127.0.0.1", port);

	assert_non_null(rc);
	assert_int_equal(rc->err, 0);
	redisReply *r = redisCommand(rc, "SETRANGE %s 4321 %b", name, "\x5a", (size_t)1);

	assert_non_null(r);
	assert_int_equal(r->type, REDIS_REPLY_INTEGER);
	freeReplyObject(r);
	redisFree(rc);

	long long bad = metric(&B, "kvd_remote_corrupt_total");
	struct kvc_seq *x = attach_on(b, &src, P_TOK, &got);

	assert_int_equal(got, 0);       /* refused: a miss */
	assert_int_equal(metric(&B, "kvd_remote_corrupt_total"), bad + 1);
	prefill_ok(b, x, &src, P_TOK);  /* and the sequence serves a private prefill */
	answer_ok(b, x, &src, &pb);
	expect_same("B's own prefill vs A", &pb, &pa);
	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	src_free(&src);
	kvc_close(a);
	kvc_close(b);
}

static void test_remote_failover(void **state)
{
	struct kvc *a = kconnect_ok(&A, "a"), *b = kconnect_ok(&B, "b");
	struct src src;
	struct ans pa, pb;
	uint8_t key[KVC_KEY_BYTES];
	uint64_t got;

	src_make(&src, 4);
	/* Published with WAIT for one replica: the replica has it. */
	struct kvc_seq *s = publish_on_a(a, &src, &pa, key);
	int port = rcluster_master_port(&RC, slot_of(key));

	assert_true(port > 0);
	assert_int_equal(rcluster_kill(&RC, port), 0);
	struct kvc_seq *x = attach_on(b, &src, P_TOK, &got);

	print_message("after the failover B got %llu tokens\n", (unsigned long long)got);
	assert_true(got == 0 || got == P_TOK);
	if (!got)
		prefill_ok(b, x, &src, P_TOK);
	answer_ok(b, x, &src, &pb);
	expect_same("B after a failover vs A", &pb, &pa);
	assert_int_equal(rcluster_wait_ok(&RC, 20000), 0);
	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	src_free(&src);
	kvc_close(a);
	kvc_close(b);
}

/* As UID_B on daemon B: uid 0's prompt `src` is a miss; then it publishes
 * `own` and waits until its manifest is in the cluster.  0 or an exit code
 * with msg. */
static int other_uid_main(const struct src *src, const struct src *own, char *msg)
{
	struct kvc *c;
	struct kvc_seq *s;
	uint64_t got;
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES];

	if (setgroups(0, NULL) || setgid(UID_B) || setuid(UID_B)) {
		snprintf(msg, 4096, "cannot become uid %u: %s", UID_B, strerror(errno));
		return 90;
	}
	struct kvc_opts o = { .socket_path = B.sock, .tenant = "t", .name = "other-uid",
			      .slots = 8, .slot_size = 1 << 20 };

	if (kvc_connect(&o, &c) || kvc_profile(c, &model)) {
		snprintf(msg, 4096, "uid %u cannot connect: %s", UID_B, kvc_last_error(c));
		return 2;
	}
	int nk = kvc_content_keys(c, src->tok, P_TOK, keys);

	if (nk <= 0 || kvc_seq_attach(c, keys, (uint32_t)nk, &s, &got) || got) {
		snprintf(msg, 4096, "uid %u: attach of uid 0's prefix: got %llu (%s)", UID_B,
			 (unsigned long long)got, kvc_last_error(c));
		return 3;
	}
	kvc_seq_free(c, s);
	nk = kvc_content_keys(c, own->tok, P_TOK, keys);
	if (kvc_seq_create(c, &s)) {
		snprintf(msg, 4096, "seq: %s", kvc_last_error(c));
		return 4;
	}
	float *k = malloc((size_t)HKV * P_TOK * D * 4), *v = malloc((size_t)HKV * P_TOK * D * 4);

	for (uint32_t l = 0; k && v && l < LAYERS; l++) {
		for (uint32_t h = 0; h < HKV; h++) {
			memcpy(k + (size_t)h * P_TOK * D, own->w[l].k + (size_t)h * NTOT * D,
			       (size_t)P_TOK * D * 4);
			memcpy(v + (size_t)h * P_TOK * D, own->w[l].v + (size_t)h * NTOT * D,
			       (size_t)P_TOK * D * 4);
		}
		if (kvc_extend(c, s, l, k, v, P_TOK)) {
			snprintf(msg, 4096, "prefill: %s", kvc_last_error(c));
			return 5;
		}
	}
	free(k);
	free(v);
	if (kvc_seq_publish(c, s, keys + (size_t)(nk - 1) * KVC_KEY_BYTES)) {
		snprintf(msg, 4096, "publish: %s", kvc_last_error(c));
		return 6;
	}
	kvc_close(c);
	return 0;
}

static void test_remote_isolation(void **state)
{
	char *msg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	struct src src, own;
	pid_t kid;
	int st;

	assert_true(msg != MAP_FAILED);
	src_make(&src, 1);              /* uid 0's, published on A in test 1 */
	src_make(&own, 6);
	chmod(B.dir, 0755);
	chmod(B.sock, 0777);
	kid = fork();
	assert_true(kid >= 0);
	if (kid == 0)
		_exit(other_uid_main(&src, &own, msg));
	assert_int_equal(waitpid(kid, &st, 0), kid);
	assert_true(WIFEXITED(st));
	if (WEXITSTATUS(st) == 90)
		skip();
	if (WEXITSTATUS(st))
		fail_msg("%s", msg);
	munmap(msg, 4096);

	/* UID_B's prefix reaches the cluster under its namespace ... */
	char stem[160], name[170];
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES];
	struct kvc *a = kconnect_ok(&A, "a");
	int nk = kvc_content_keys(a, own.tok, P_TOK, keys);
	struct kvd_rcl_cfg rc = { .seeds = seeds, .retry_ms = 5000 };
	struct kvd_rcl *r;
	int found = 0;

	snprintf(name, sizeof name, "u%u", UID_B);
	kvd_remote_stem("kvd", name, keys + (size_t)(nk - 1) * KVC_KEY_BYTES, stem, sizeof stem);
	snprintf(name, sizeof name, "%s:m", stem);
	char why[160];

	assert_int_equal(kvd_rcl_create(&rc, &r, why, sizeof why), 0);
	for (int i = 0; i < 300 && !found; i++) {
		struct kvd_rcl_op op = { .kind = KVD_RCL_EXISTS, .key = name, .klen = strlen(name) };

		found = kvd_rcl_run(r, &op, 1, why, sizeof why) == 0 && op.rc == 0;
		if (!found)
			daemon_sleep_ms(100);
	}
	kvd_rcl_destroy(r);
	assert_true(found);
	/* ... where uid 0 on A does not find it. */
	uint64_t got;
	struct kvc_seq *x = attach_on(a, &own, P_TOK, &got);

	assert_int_equal(got, 0);
	assert_int_equal(kvc_seq_free(a, x), 0);
	kvc_close(a);
	src_free(&src);
	src_free(&own);
}

/* ---- evicted sequences ---------------------------------------------------- */

#define EV_N    5
#define EV_TOK  2048            /* a file of 5.9 MB: two fit in 12 MiB */
#define EV_SRC  (EV_TOK + 256)

/* The full name of chunk 0 of sequence id's copy, found by SCAN on the
 * live nodes (its key also holds the daemon's lifetime, unknown here). */
static int find_chunk0(uint64_t id, char *name, size_t n)
{
	char pat[96], hex[17];

	for (int i = 0; i < 8; i++)
		snprintf(hex + 2 * i, 3, "%02x", (unsigned)(id >> (8 * i)) & 0xff);
	snprintf(pat, sizeof pat, "kvd:{u0:*%s}:0", hex);
	for (int i = 0; i < RC.n; i++) {
		redisContext *rc = NULL;
		char cur[32] = "0";

		if (RC.pid[i] <= 0 || !(rc = redisConnect("127.0.0.1", RC.base + i)) || rc->err) {
			if (rc)
				redisFree(rc);
			continue;
		}
		do {
			redisReply *r = redisCommand(rc, "SCAN %s MATCH %s COUNT 1000", cur, pat);

			if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
				if (r)
					freeReplyObject(r);
				break;
			}
			snprintf(cur, sizeof cur, "%s", r->element[0]->str);
			if (r->element[1]->elements) {
				snprintf(name, n, "%s", r->element[1]->element[0]->str);
				freeReplyObject(r);
				redisFree(rc);
				return 0;
			}
			freeReplyObject(r);
		} while (strcmp(cur, "0"));
		redisFree(rc);
	}
	return -1;
}

static int local_file(const char *dir, uint64_t id)
{
	char path[160];

	snprintf(path, sizeof path, "%s/%016llx.kvs", dir, (unsigned long long)id);
	return access(path, F_OK) == 0;
}

/* SeqEvict until s is on disk: a write refused for spill room is asked
 * again while copies land.  0, or -1 after 20 s. */
static int evict_until_disk(struct kvc *c, struct kvc_seq *s)
{
	struct kvc_seq_stats st = { 0 };

	for (int k = 0; k < 400; k++) {
		if (kvc_seq_evict(c, s) == 0 && kvc_seq_stats(c, s, &st) == 0 &&
		    st.state == KVC_SEQ_DISK)
			return 0;
		daemon_sleep_ms(50);
	}
	return -1;
}

static void test_remote_evicted(void **state)
{
	char dir[] = "/tmp/kvd-remote-e.XXXXXX", cfg[96];
	struct ans *want = calloc(EV_N, sizeof *want), got;
	struct kvc_seq *x[EV_N];
	struct daemon E;
	struct src src;

	assert_non_null(want);
	assert_non_null(mkdtemp(dir));
	assert_int_equal(write_cfg(cfg, sizeof cfg, dir, "e", 12000,
				   "evicted = yes\n[limits]\nspill_per_uid = 12M\n"), 0);
	assert_int_equal(daemon_start4(&E, "--config", cfg, NULL, NULL), 0);
	struct kvc *c = kconnect_ok(&E, "e");

	for (int i = 0; i < EV_N; i++) {
		src_make_n(&src, 20 + (uint64_t)i, EV_SRC);
		assert_int_equal(kvc_seq_create(c, &x[i]), 0);
		prefill_ok(c, x[i], &src, EV_TOK);
		answer_ok(c, x[i], &src, &want[i]);
		src_free(&src);
	}
	/* Evicted one by one.  A third file does not fit the uid's spill
	 * room until a copy is confirmed: the eviction is refused meanwhile
	 * (the sequence stays in RAM) and asked again. */
	for (int i = 0; i < EV_N; i++) {
		if (evict_until_disk(c, x[i])) {
			print_message("puts %lld errors %lld evicted_puts %lld drops %lld\n",
				      metric(&E, "kvd_remote_puts_total"),
				      metric(&E, "kvd_remote_errors_total"),
				      metric(&E, "kvd_remote_evicted_puts_total"),
				      metric(&E, "kvd_remote_local_drops_total"));
			fail_msg("sequence %d never went to disk: %s", i, kvc_last_error(c));
		}
	}
	/* Two files fit the uid's 12 MiB; the others' live in the cluster. */
	int only = 0, gone = -1;

	for (int i = 0; i < EV_N; i++)
		if (!local_file(dir, kvc_seq_id(x[i]))) {
			only++;
			gone = i;
		}
	if (only < EV_N - 2) {
		char cmd[200];

		snprintf(cmd, sizeof cmd, "ls -ls %s >&2", dir);
		if (system(cmd)) {}
		fail_msg("%d of %d sequences' files are in the cluster only, want >= %d", only, EV_N,
			 EV_N - 2);
	}
	assert_int_equal(metric(&E, "kvd_sequences_remote_only"), only);
	assert_true(metric(&E, "kvd_remote_local_drops_total") >= only);
	assert_true(metric(&E, "kvd_spill_disk_bytes") <= 12 << 20);

	/* One copy corrupted where its master keeps it: that sequence is
	 * LOST when it is wanted, the others come back bit for bit. */
	long long dels = metric(&E, "kvd_remote_deletes_total");
	char name[200];

	assert_int_equal(find_chunk0(kvc_seq_id(x[gone]), name, sizeof name), 0);
	int port = rcluster_master_port(&RC, kvd_rcl_slot(name, strlen(name)));
	redisContext *rc = redisConnect("127.0.0.1", port);

	assert_non_null(rc);
	redisReply *r = redisCommand(rc, "SETRANGE %s 1234 %b", name, "\xa5", (size_t)1);

	assert_non_null(r);
	assert_int_equal(r->type, REDIS_REPLY_INTEGER);
	freeReplyObject(r);
	redisFree(rc);
	for (int i = 0; i < EV_N; i++) {
		src_make_n(&src, 20 + (uint64_t)i, EV_SRC);
		if (i == gone) {
			assert_int_not_equal(kvc_attend(c, 1, &x[i], 1, src.w[1].q, got.o[1],
							got.lse[1]), 0);
			assert_non_null(strstr(kvc_last_error(c), "lost"));
		} else {
			answer_ok(c, x[i], &src, &got);
			expect_same("an evicted sequence back", &got, &want[i]);
		}
		src_free(&src);
	}
	assert_true(metric(&E, "kvd_remote_evicted_fetches_total") >= only - 1);
	assert_true(metric(&E, "kvd_remote_corrupt_total") >= 1);

	/* Freed, their copies go (the LOST one's went when it was lost). */
	uint64_t ids[EV_N];

	for (int i = 0; i < EV_N; i++) {
		ids[i] = kvc_seq_id(x[i]);
		assert_int_equal(kvc_seq_free(c, x[i]), 0);
	}
	for (int k = 0; k < 200 && metric(&E, "kvd_remote_deletes_total") < dels + EV_N; k++)
		daemon_sleep_ms(50);
	assert_true(metric(&E, "kvd_remote_deletes_total") >= dels + EV_N);
	for (int i = 0; i < EV_N; i++)
		assert_int_not_equal(find_chunk0(ids[i], name, sizeof name), 0);
	kvc_close(c);
	free(want);
	assert_int_equal(daemon_stop(&E), 0);
	daemon_rm_tree(dir);
	unlink(cfg);
}

static void test_remote_quota(void **state)
{
	char dir[] = "/tmp/kvd-remote-q.XXXXXX", cfg[96];
	struct kvc_seq *x[3];
	struct daemon F;
	struct src src;
	struct ans a;

	assert_non_null(mkdtemp(dir));
	assert_int_equal(write_cfg(cfg, sizeof cfg, dir, "q", 12000,
				   "evicted = yes\n[limits]\nspill_per_uid = 12M\n"
				   "remote_per_uid = 8M\n"), 0);
	assert_int_equal(daemon_start4(&F, "--config", cfg, NULL, NULL), 0);
	struct kvc *c = kconnect_ok(&F, "q");

	for (int i = 0; i < 3; i++) {
		src_make_n(&src, 20 + (uint64_t)i, EV_SRC);
		assert_int_equal(kvc_seq_create(c, &x[i]), 0);
		prefill_ok(c, x[i], &src, EV_TOK);
		answer_ok(c, x[i], &src, &a);
		src_free(&src);
	}
	/* Two files fit locally; one copy (5.6 MiB) fits the 8 MiB. */
	for (int i = 0; i < 2; i++) {
		struct kvc_seq_stats st = { 0 };
		int k;

		assert_int_equal(kvc_seq_evict(c, x[i]), 0);
		for (k = 0; k < 200 && !(kvc_seq_stats(c, x[i], &st) == 0 &&
					 st.state == KVC_SEQ_DISK); k++)
			daemon_sleep_ms(50);
		assert_int_equal(st.state, KVC_SEQ_DISK);
	}
	for (int k = 0; k < 100 && metric(&F, "kvd_remote_evicted_puts_total") < 1; k++)
		daemon_sleep_ms(50);
	daemon_sleep_ms(300);
	assert_int_equal(metric(&F, "kvd_remote_evicted_puts_total"), 1);
	assert_true(metric(&F, "kvd_remote_bytes{uid=\"0\"}") <= 8 << 20);
	/* The third: one local file can make room (its copy is there), the
	 * other cannot; after that the uid's spill is full. */
	assert_int_equal(kvc_seq_evict(c, x[2]), 0);
	struct kvc_seq_stats st = { 0 };

	for (int k = 0; k < 200 && !(kvc_seq_stats(c, x[2], &st) == 0 &&
				     st.state == KVC_SEQ_DISK); k++)
		daemon_sleep_ms(50);
	assert_int_equal(st.state, KVC_SEQ_DISK);
	assert_int_equal(metric(&F, "kvd_remote_local_drops_total"), 1);
	assert_true(metric(&F, "kvd_remote_bytes{uid=\"0\"}") <= 8 << 20);
	/* A fourth has no room anywhere: refused, naming the limit. */
	struct kvc_seq *y;

	src_make_n(&src, 30, EV_SRC);
	assert_int_equal(kvc_seq_create(c, &y), 0);
	prefill_ok(c, y, &src, EV_TOK);
	src_free(&src);
	assert_int_not_equal(kvc_seq_evict(c, y), 0);
	assert_non_null(strstr(kvc_last_error(c), "spill_per_uid"));
	assert_int_equal(kvc_seq_free(c, y), 0);
	for (int i = 0; i < 3; i++)
		assert_int_equal(kvc_seq_free(c, x[i]), 0);
	kvc_close(c);
	assert_int_equal(daemon_stop(&F), 0);
	daemon_rm_tree(dir);
	unlink(cfg);
}

static void test_remote_down(void **state)
{
	struct kvc *a = kconnect_ok(&A, "a"), *b = kconnect_ok(&B, "b");
	struct kvc *a2 = kconnect_ok(&A, "a2");
	struct src old, src;
	struct ans pa, pb;
	uint64_t got;

	/* A daemon with evicted sequences: two files fit its uid's spill, the
	 * first sequence's file then lives in the cluster only. */
	char dir[] = "/tmp/kvd-remote-d.XXXXXX", cfg[96];
	struct kvc_seq *ev[3];
	struct daemon E;

	assert_non_null(mkdtemp(dir));
	assert_int_equal(write_cfg(cfg, sizeof cfg, dir, "d", 1500,
				   "evicted = yes\n[limits]\nspill_per_uid = 12M\n"), 0);
	assert_int_equal(daemon_start4(&E, "--config", cfg, NULL, NULL), 0);
	struct kvc *e = kconnect_ok(&E, "e");

	for (int i = 0; i < 3; i++) {
		src_make_n(&src, 40 + (uint64_t)i, EV_SRC);
		assert_int_equal(kvc_seq_create(e, &ev[i]), 0);
		prefill_ok(e, ev[i], &src, EV_TOK);
		src_free(&src);
		assert_int_equal(evict_until_disk(e, ev[i]), 0);
	}
	int gone = -1, kept = -1;

	for (int i = 0; i < 3; i++)
		if (!local_file(dir, kvc_seq_id(ev[i])))
			gone = i;
		else
			kept = i;
	assert_true(gone >= 0 && kept >= 0);

	assert_int_equal(rcluster_stop_all(&RC), 0);

	struct kvc_seq_stats st = { 0 };

	src_make_n(&src, 40 + (uint64_t)gone, EV_SRC);
	assert_int_not_equal(kvc_attend(e, 1, &ev[gone], 1, src.w[1].q, pa.o[1], pa.lse[1]), 0);
	assert_non_null(strstr(kvc_last_error(e), "remote tier"));
	assert_null(strstr(kvc_last_error(e), "lost"));
	assert_int_equal(kvc_seq_stats(e, ev[gone], &st), 0);
	assert_int_equal(st.state, KVC_SEQ_DISK);
	src_free(&src);
	/* One on local disk still serves. */
	src_make_n(&src, 40 + (uint64_t)kept, EV_SRC);
	answer_ok(e, ev[kept], &src, &pa);
	src_free(&src);
	for (int i = 0; i < 3; i++)
		assert_int_equal(kvc_seq_free(e, ev[i]), 0);
	kvc_close(e);
	assert_int_equal(daemon_stop(&E), 0);
	daemon_rm_tree(dir);
	unlink(cfg);

	/* B fetched prompt 1 earlier: it is on B's own disk or in its RAM. */
	src_make(&old, 1);
	struct kvc_seq *x = attach_on(b, &old, P_TOK, &got);

	assert_int_equal(got, P_TOK);
	assert_int_equal(kvc_seq_free(b, x), 0);
	/* A new prompt: A publishes (its write to the cluster fails) and
	 * attaches it locally; B misses and prefills. */
	src_make(&src, 5);
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES];
	int nk = kvc_content_keys(a, src.tok, P_TOK, keys);
	struct kvc_seq *s;

	assert_int_equal(kvc_seq_create(a, &s), 0);
	prefill_ok(a, s, &src, P_TOK);
	assert_int_equal(kvc_seq_publish(a, s, keys + (size_t)(nk - 1) * KVC_KEY_BYTES), 0);
	answer_ok(a, s, &src, &pa);
	struct kvc_seq *y = attach_on(a2, &src, P_TOK, &got);

	assert_int_equal(got, P_TOK);
	answer_ok(a2, y, &src, &pb);
	expect_same("A's local attach with the cluster down", &pb, &pa);
	long long errs = metric(&B, "kvd_remote_errors_total");

	x = attach_on(b, &src, P_TOK, &got);
	assert_int_equal(got, 0);
	assert_true(metric(&B, "kvd_remote_errors_total") > errs);
	prefill_ok(b, x, &src, P_TOK);
	answer_ok(b, x, &src, &pb);
	expect_same("B's prefill with the cluster down", &pb, &pa);
	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a2, y), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	src_free(&old);
	src_free(&src);
	kvc_close(a2);
	kvc_close(a);
	kvc_close(b);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_remote_attach),
		cmocka_unit_test(test_remote_too_big),
		cmocka_unit_test(test_remote_ask),
		cmocka_unit_test(test_remote_corrupt),
		cmocka_unit_test(test_remote_failover),
		cmocka_unit_test(test_remote_isolation),
		cmocka_unit_test(test_remote_hybrid),
		cmocka_unit_test(test_remote_evicted),
		cmocka_unit_test(test_remote_quota),
		cmocka_unit_test(test_remote_down),
	};

	return cmocka_run_group_tests(tests, setup, teardown);
}
