/* Prefix sharing (kvc_seq_publish, kvc_seq_attach; SeqPublish,
 * SeqCreate.attach_keys, LOCAL) through the real daemon.
 *
 *   test_share_attach_matches    a sequence attached on another connection
 *                                answers bit for bit as its publisher did;
 *                                extended past the prefix it answers as a
 *                                private sequence given the same calls; the
 *                                publisher's later tokens do not reach it;
 *                                ShareUsage counts the hit and the miss
 *   test_share_after_decode      a prefix published mid-decode (window part
 *                                full): attacher and publisher given the same
 *                                next tokens answer alike at every step; the
 *                                publish and the attach copy no open tail
 *   test_share_errors            a length that is not whole chunks, a layer
 *                                mid-prefill, a freed or foreign sequence,
 *                                bad keys and LOCAL ranges (raw): clear errors;
 *                                unknown keys are a miss, not an error
 *   test_share_isolation         another uid with the same tokens misses, and
 *                                its own publish does not reach uid 0; a second
 *                                tenant of the same uid hits
 *   test_share_group             [sharing] groups: a uid of the group hits, one
 *                                outside it misses
 *   test_share_free              publisher and attachers freed in any order:
 *                                the prefix still attaches; every byte but the
 *                                published snapshot's comes back
 *   test_share_spilled           a published prefix written out under the
 *                                memory budget (the client rows kept for it
 *                                too) is read back by the attach that wants
 *                                it and answers bit for bit
 *   test_share_persist           under --persist a published prefix survives
 *                                kill -9: attached after the restart it answers
 *                                bit for bit; a corrupted file is a miss, never
 *                                a wrong answer
 *   test_share_race              three connections attach, extend, publish and
 *                                free concurrently under a budget that sends
 *                                snapshots and sequences to disk and back (TSan):
 *                                answers stay those of the prefix, nothing is
 *                                lost or leaks
 *
 * Forked children and threads never use cmocka's asserts: they report
 * through a message and the main thread fails. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <grp.h>
#include <math.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "proto/ctl.h"
#include "daemon.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "proto/kvd_ring.h"
#include "raw.h"
#include "shm/shm.h"
#include "engine/synth.h"
#include "testutil.h"

#define LAYERS  3
#define HQ      8
#define HKV     2
#define D       128
#define NT      60              /* tables (L) */
#define CHUNK   256             /* the profile's default: seal_tokens 256 */
#define P_TOK   3072            /* the shared prompt: 12 chunks */
#define X_TOK   300             /* each sequence's own part after it */
#define NTOT    (P_TOK + X_TOK + 400)
#define UID_B   65534
#define UID_C   65533
#define TAIL_KV ((uint64_t)2 * HKV * CHUNK * D * 2)    /* one layer's tail, K and V */

static const uint32_t dense_layers[] = { 0 };
static const struct kvc_model model = {
	.name = "share", .layers = LAYERS, .q_heads = HQ, .kv_heads = HKV, .head_dim = D,
	.K = 10, .L = NT, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 7, .segment_tokens = 1024, .seal_tokens = 256,
};

static struct daemon D_;
static char spill[128];

/* ---- the daemon ----------------------------------------------------------- */

static int start(void **state)
{
	return daemon_start(&D_, NULL) ? -1 : 0;
}

/* A budget of 56 MiB: about six of these sequences. */
static int start_spill(void **state)
{
	char tmpl[] = "/tmp/kvd-share-spill.XXXXXX";

	if (!mkdtemp(tmpl))
		return -1;
	snprintf(spill, sizeof spill, "%s", tmpl);
	return daemon_start4(&D_, "--spill-dir", spill, "--mem-limit", "56M") ? -1 : 0;
}

/* --persist: published prefixes are written at once and come back. */
static int start_persist(void **state)
{
	char tmpl[] = "/tmp/kvd-share-persist.XXXXXX";

	if (!mkdtemp(tmpl))
		return -1;
	snprintf(spill, sizeof spill, "%s", tmpl);
	return daemon_start4(&D_, "--spill-dir", spill, "--persist", NULL) ? -1 : 0;
}

/* kill -9, then the same daemon again on the same spill directory. */
static void crash_and_restart(void)
{
	assert_int_equal(kill(D_.pid, SIGKILL), 0);
	assert_int_equal(waitpid(D_.pid, NULL, 0), D_.pid);
	D_.pid = 0;
	unlink(D_.sock);
	rmdir(D_.dir);
	assert_int_equal(daemon_start4(&D_, "--spill-dir", spill, "--persist", NULL), 0);
}

/* [sharing] groups: uid 0 and UID_B share a namespace; UID_C is alone. */
static char cfg[128];

static int start_group(void **state)
{
	FILE *f;

	snprintf(cfg, sizeof cfg, "/tmp/kvd-share.%d.conf", (int)getpid());
	if (!(f = fopen(cfg, "w")))
		return -1;
	fprintf(f, "[sharing]\ngroups = 0,%d\n", UID_B);
	fclose(f);
	return daemon_start4(&D_, "--config", cfg, NULL, NULL) ? -1 : 0;
}

/* The race runs under a budget with a spill directory: snapshots and the
 * sequences attached from them go to disk and come back while it runs. */
static int start_race(void **state)
{
	char tmpl[] = "/tmp/kvd-share-race.XXXXXX";

	if (!mkdtemp(tmpl))
		return -1;
	snprintf(spill, sizeof spill, "%s", tmpl);
	return daemon_start4(&D_, "--spill-dir", spill, "--mem-limit", "56M") ? -1 : 0;
}

static int stop(void **state)
{
	int rc = D_.pid > 0 ? daemon_stop(&D_) : -1;

	if (spill[0]) {
		daemon_rm_tree(spill);
		spill[0] = 0;
	}
	if (cfg[0]) {
		unlink(cfg);
		cfg[0] = 0;
	}
	if (rc)
		print_error("daemon_stop: %d (want 0: a clean drain)\n", rc);
	return rc == 0 ? 0 : -1;
}

/* ---- data ----------------------------------------------------------------- */

/* Rows [0, NTOT) of every layer with their token ids, and the queries. */
struct src {
	struct kvd_synth w[LAYERS];
	uint32_t tok[NTOT];
};

static void src_make(struct src *s, uint64_t seed)
{
	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvd_synth_make(&s->w[l], (enum kvd_wl)(l % KVD_WL_COUNT), NTOT, HQ,
						HKV, D, seed * 10 + l), 0);
	for (uint32_t i = 0; i < NTOT; i++)
		s->tok[i] = (uint32_t)(seed * 1000003u + i * 7919u);
}

static void src_free(struct src *s)
{
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&s->w[l]);
}

static struct kvc *kconnect(const char *tenant, const char *name)
{
	struct kvc_opts o = { .socket_path = D_.sock, .tenant = tenant, .name = name,
			      .slots = 8, .slot_size = 1 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c) || kvc_profile(c, &model))
		return kvc_close(c), NULL;
	return c;
}

static struct kvc *kconnect_ok(const char *tenant, const char *name)
{
	struct kvc *c = kconnect(tenant, name);

	if (!c)
		fail_msg("connect %s/%s failed", tenant, name);
	return c;
}

/* Tokens [t0, t0 + n) of src into every layer of s (kvc_extend: a prefill
 * for an empty layer, appends after). */
static int extend(struct kvc *c, struct kvc_seq *s, const struct src *src, uint32_t t0,
		  uint32_t n)
{
	float *k = malloc((size_t)HKV * n * D * 4), *v = malloc((size_t)HKV * n * D * 4);
	int rc = k && v ? 0 : -ENOMEM;

	for (uint32_t l = 0; l < LAYERS && !rc; l++) {
		for (uint32_t h = 0; h < HKV; h++) {
			memcpy(k + (size_t)h * n * D, src->w[l].k + ((size_t)h * NTOT + t0) * D,
			       (size_t)n * D * 4);
			memcpy(v + (size_t)h * n * D, src->w[l].v + ((size_t)h * NTOT + t0) * D,
			       (size_t)n * D * 4);
		}
		rc = kvc_extend(c, s, l, k, v, n);
	}
	free(k);
	free(v);
	return rc;
}

static void extend_ok(struct kvc *c, struct kvc_seq *s, const struct src *src, uint32_t t0,
		      uint32_t n)
{
	if (extend(c, s, src, t0, n))
		fail_msg("extend [%u, +%u): %s", t0, n, kvc_last_error(c));
}

/* A private sequence of tokens [0, n): what the others are compared with. */
static struct kvc_seq *private_seq(struct kvc *c, const struct src *src, uint32_t n)
{
	struct kvc_seq *s;

	if (kvc_seq_create(c, &s))
		fail_msg("seq: %s", kvc_last_error(c));
	extend_ok(c, s, src, 0, n);
	return s;
}

static void publish_ok(struct kvc *c, struct kvc_seq *s, const struct src *src, uint32_t n)
{
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES];
	int nk = kvc_content_keys(c, src->tok, n, keys);

	if (nk != (int)(n / CHUNK))
		fail_msg("content keys: %d (%s)", nk, kvc_last_error(c));
	if (kvc_seq_publish(c, s, keys + (size_t)(nk - 1) * KVC_KEY_BYTES))
		fail_msg("publish %u tokens: %s", n, kvc_last_error(c));
}

/* Attaches the longest published prefix of tokens [0, n). */
static int attach(struct kvc *c, const struct src *src, uint32_t n, struct kvc_seq **s,
		  uint64_t *got)
{
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES];
	int nk = kvc_content_keys(c, src->tok, n, keys);

	if (nk < 0)
		return nk;
	return kvc_seq_attach(c, keys, (uint32_t)nk, s, got);
}

static struct kvc_seq *attach_ok(struct kvc *c, const struct src *src, uint32_t n,
				 uint64_t want)
{
	struct kvc_seq *s;
	uint64_t got;

	if (attach(c, src, n, &s, &got))
		fail_msg("attach: %s", kvc_last_error(c));
	if (got != want)
		fail_msg("attach of %u tokens got %llu, want %llu", n, (unsigned long long)got,
			 (unsigned long long)want);
	return s;
}

/* Every answer: merged (every layer) and kvd's part (sparse layers). */
struct ans {
	float o[LAYERS][HQ * D], lse[LAYERS][HQ];
	float ko[LAYERS][HQ * D], klse[LAYERS][HQ];
};

static int answer(struct kvc *c, struct kvc_seq *s, const struct src *q, struct ans *a)
{
	int rc;

	memset(a, 0, sizeof *a);
	for (uint32_t l = 0; l < LAYERS; l++)
		if ((rc = kvc_attend(c, l, &s, 1, q->w[l].q, a->o[l], a->lse[l])))
			return rc;
	for (uint32_t l = 1; l < LAYERS; l++)
		if ((rc = kvc_attend_kvd(c, l, &s, 1, q->w[l].q, a->ko[l], a->klse[l])))
			return rc;
	return 0;
}

static void answer_ok(struct kvc *c, struct kvc_seq *s, const struct src *q, struct ans *a)
{
	if (answer(c, s, q, a))
		fail_msg("attend of %llu: %s", (unsigned long long)kvc_seq_id(s), kvc_last_error(c));
}

static int ans_finite(const struct ans *a)
{
	const float *x = (const float *)a;

	for (size_t i = 0; i < sizeof *a / sizeof *x; i++)
		if (!isfinite(x[i]))
			return 0;
	return 1;
}

static void expect_same(const char *what, const struct ans *a, const struct ans *b)
{
	if (memcmp(a, b, sizeof *a)) {
		for (uint32_t l = 0; l < LAYERS; l++)
			print_message("  %s: layer %u merged rel %.3g, kvd's rel %.3g\n", what, l,
				      rel_err_ff(a->o[l], b->o[l], HQ * D),
				      rel_err_ff(a->ko[l], b->ko[l], HQ * D));
		fail_msg("%s: answers differ", what);
	}
	if (!ans_finite(a))
		fail_msg("%s: answers not finite", what);
}

static struct kvc_stats stats(struct kvc *c)
{
	struct kvc_stats st;

	if (kvc_server_stats(c, &st))
		fail_msg("server stats: %s", kvc_last_error(c));
	return st;
}

static struct kvc_share_stats share_stats(struct kvc *c)
{
	struct kvc_share_stats st;

	if (kvc_share_stats(c, &st))
		fail_msg("share stats: %s", kvc_last_error(c));
	return st;
}

static struct kvc_seq_stats seq_stats(struct kvc *c, const struct kvc_seq *s)
{
	struct kvc_seq_stats st;

	if (kvc_seq_stats(c, s, &st))
		fail_msg("seq stats: %s", kvc_last_error(c));
	return st;
}

/* ==== 1. an attached sequence answers as its publisher ===================== */

static void test_share_attach_matches(void **state)
{
	struct kvc *a = kconnect_ok("t", "publisher"), *b = kconnect_ok("t2", "attacher");
	struct src src;
	struct ans pub, att, priv, ext;
	struct kvc_seq *s, *x, *p;
	struct kvc_share_stats sh;

	assert_int_equal(kvc_chunk_tokens(a), CHUNK);
	src_make(&src, 1);
	s = private_seq(a, &src, P_TOK);
	publish_ok(a, s, &src, P_TOK);
	answer_ok(a, s, &src, &pub);

	/* Another connection and tenant of the same uid: the uid's namespace.
	 * It asks for the prompt and its own part: 13 chunks, 12 published. */
	x = attach_ok(b, &src, P_TOK + X_TOK, P_TOK);
	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvc_seq_tokens(x, l), P_TOK);
	answer_ok(b, x, &src, &att);
	expect_same("attached vs publisher", &att, &pub);
	{
		struct kvc_seq_stats u = seq_stats(a, s), v = seq_stats(b, x);

		assert_int_equal(u.tokens, v.tokens);
		assert_int_equal(u.segments, v.segments);
	}
	sh = share_stats(b);
	assert_int_equal(sh.published, 1);
	assert_int_equal(sh.published_tokens, P_TOK);
	assert_int_equal(sh.hit_tokens, P_TOK);
	assert_int_equal(sh.miss_tokens, CHUNK);
	assert_true(sh.shared_bytes > 0 && sh.saved_bytes > 0);

	/* The publisher goes on: the attached sequence does not see it. */
	extend_ok(a, s, &src, P_TOK, 50);
	answer_ok(b, x, &src, &att);
	expect_same("attached after the publisher moved on", &att, &pub);

	/* Past the prefix: as a private sequence given the same calls (a
	 * prefill of the prompt, then appends), through a seal of the tail. */
	extend_ok(b, x, &src, P_TOK, X_TOK);
	p = private_seq(a, &src, P_TOK);
	extend_ok(a, p, &src, P_TOK, X_TOK);
	answer_ok(b, x, &src, &ext);
	answer_ok(a, p, &src, &priv);
	expect_same("attached + extended vs private", &ext, &priv);
	assert_true(memcmp(&ext, &pub, sizeof ext) != 0);

	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a, p), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	kvc_close(a);
	kvc_close(b);
	src_free(&src);
}

/* ==== 2. published mid-decode ============================================= */

static void test_share_after_decode(void **state)
{
	struct kvc *a = kconnect_ok("t", "decoder"), *b = kconnect_ok("t", "attacher");
	struct src src;
	struct ans u, v;
	struct kvc_seq *s, *x;
	struct kvc_stats st0, st1, st2;

	src_make(&src, 2);
	/* 3000 prefilled, 72 decoded: the window holds rows waiting for their
	 * batch to go to kvd, and the tail some that went. */
	s = private_seq(a, &src, 3000);
	extend_ok(a, s, &src, 3000, P_TOK - 3000);
	st0 = stats(a);
	publish_ok(a, s, &src, P_TOK);
	st1 = stats(a);
	x = attach_ok(b, &src, P_TOK, P_TOK);
	st2 = stats(a);
	/* the snapshot and the attached child share the open tails (two
	 * sparse layers) like the segments: each costs less than one */
	assert_true(st1.bytes - st0.bytes < TAIL_KV);
	assert_true(st2.bytes - st1.bytes < TAIL_KV);
	for (uint32_t t = P_TOK; t < P_TOK + 200; t += 40) {
		answer_ok(a, s, &src, &u);
		answer_ok(b, x, &src, &v);
		expect_same("attached vs publisher, decoding the same tokens", &v, &u);
		extend_ok(a, s, &src, t, 40);
		extend_ok(b, x, &src, t, 40);
	}
	assert_int_equal(kvc_seq_free(b, x), 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	kvc_close(a);
	kvc_close(b);
	src_free(&src);
}

/* ==== 3. errors ============================================================= */

static void raw_up(struct raw *x, const char *tenant, uint32_t *pid)
{
	int rc;

	assert_int_equal(raw_open(x, D_.sock, 0), 0);
	if ((rc = raw_hello(x, "share-raw", tenant, 2, 1 << 20)))
		fail_msg("raw hello: %d %s", rc, x->msg);
	if ((rc = raw_profile_open(x, model.name, pid)))
		fail_msg("raw profile open: %d %s", rc, x->msg);
}

static int raw_publish(struct raw *x, uint64_t seq, const uint8_t *key, size_t keylen,
		       uint64_t tokens)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqPublish sp = KVD__SEQ_PUBLISH__INIT;

	sp.seq = seq;
	sp.key = (ProtobufCBinaryData){ keylen, (uint8_t *)key };
	sp.tokens = tokens;
	rq.body_case = KVD__REQUEST__BODY_SEQ_PUBLISH;
	rq.seq_publish = &sp;
	return raw_expect(x, &rq, KVD__RESPONSE__BODY_OK, NULL);
}

static int raw_attach(struct raw *x, uint32_t pid, const uint8_t *keys, size_t nkeys,
		      size_t keylen, uint64_t *tokens)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqCreate sc = KVD__SEQ_CREATE__INIT;
	ProtobufCBinaryData *kb = calloc(nkeys ? nkeys : 1, sizeof *kb);
	Kvd__Response *r = NULL;
	int rc;

	if (!kb)
		return -ENOMEM;
	for (size_t i = 0; i < nkeys; i++)
		kb[i] = (ProtobufCBinaryData){ keylen, (uint8_t *)keys + i * keylen };
	sc.profile_id = pid;
	sc.n_attach_keys = nkeys;
	sc.attach_keys = kb;
	rq.body_case = KVD__REQUEST__BODY_SEQ_CREATE;
	rq.seq_create = &sc;
	rc = raw_expect(x, &rq, KVD__RESPONSE__BODY_SEQ, &r);
	if (!rc) {
		*tokens = r->seq->tokens;
		kvd_ctl_free_response(r);
	}
	free(kb);
	return rc;
}

static void test_share_errors(void **state)
{
	struct kvc *a = kconnect_ok("t", "errors");
	struct src src;
	uint8_t keys[(NTOT / CHUNK) * KVC_KEY_BYTES], junk[KVC_KEY_BYTES] = { 1, 2, 3 };
	struct kvc_seq *s, *x;
	struct raw r;
	uint32_t pid = 0;
	uint64_t got = 0, id = 0;
	int rc;

	src_make(&src, 3);
	assert_int_equal(kvc_content_keys(a, src.tok, P_TOK, keys), P_TOK / CHUNK);

	/* Not whole chunks: kvd refuses, and nothing is published. */
	s = private_seq(a, &src, P_TOK - 100);
	rc = kvc_seq_publish(a, s, keys);
	assert_int_equal(rc, -EINVAL);
	assert_non_null(strstr(kvc_last_error(a), "chunk"));
	assert_int_equal(share_stats(a).published, 0);

	/* Unknown keys: a miss, an empty sequence to prefill. */
	x = attach_ok(a, &src, P_TOK, 0);
	assert_int_equal(kvc_seq_tokens(x, 1), 0);
	extend_ok(a, x, &src, 0, P_TOK);
	publish_ok(a, x, &src, P_TOK);
	assert_int_equal(kvc_seq_free(a, x), 0);
	/* Published twice: the first stays, Ok. */
	x = attach_ok(a, &src, P_TOK, P_TOK);
	publish_ok(a, x, &src, P_TOK);
	assert_int_equal(share_stats(a).published, 1);

	raw_up(&r, "t", &pid);
	/* A freed sequence, a made-up one, a key of the wrong size. */
	id = kvc_seq_id(s);
	assert_int_equal(kvc_seq_free(a, s), 0);
	assert_int_equal(raw_publish(&r, id, junk, KVC_KEY_BYTES, P_TOK), -ENOENT);
	assert_int_equal(raw_publish(&r, 12345, junk, KVC_KEY_BYTES, P_TOK), -ENOENT);
	assert_int_equal(raw_publish(&r, kvc_seq_id(x), junk, 5, P_TOK), -EINVAL);
	/* Another connection's sequence (same tenant): not its to publish. */
	assert_int_equal(raw_publish(&r, kvc_seq_id(x), junk, KVC_KEY_BYTES, P_TOK), -ENOENT);
	/* Keys of the wrong size, too many keys. */
	assert_int_equal(raw_attach(&r, pid, keys, 2, 15, &got), -EINVAL);
	{
		size_t n = KVD_CTL_ATTACH_KEYS_MAX + 1;
		uint8_t *many = calloc(n, KVC_KEY_BYTES);

		assert_non_null(many);
		assert_int_equal(raw_attach(&r, pid, many, n, KVC_KEY_BYTES, &got), -E2BIG);
		free(many);
	}
	/* The raw connection attaches and reads the rows kvd keeps for it. */
	assert_int_equal(raw_attach(&r, pid, keys, P_TOK / CHUNK, KVC_KEY_BYTES, &got), 0);
	assert_int_equal(got, P_TOK);
	assert_int_equal(raw_seq_create(&r, pid, 0, &id), 0);
	{
		/* rows beyond what kvd keeps (4 sinks + 64 window of a sparse
		 * layer): -ERANGE; a put that skips rows: -EINVAL; a mean of a
		 * dense layer: -EINVAL */
		const struct kvd_local_layout lay = kvd_local_layout(HKV, D, 8, 1);
		struct kvd_sqe e = { .op = KVD_OP_LOCAL, .flags = KVD_LF_GET | KVD_LF_MEAN,
				     .layer = 1, .slot = 0, .ntok = 8, .row0 = 64,
				     .out_len = (uint32_t)lay.bytes };
		uint64_t ids[1];
		Kvd__Response *rr = NULL;
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__SeqCreate sc = KVD__SEQ_CREATE__INIT;
		ProtobufCBinaryData kb[P_TOK / CHUNK];

		for (size_t i = 0; i < P_TOK / CHUNK; i++)
			kb[i] = (ProtobufCBinaryData){ KVC_KEY_BYTES, keys + i * KVC_KEY_BYTES };
		sc.profile_id = pid;
		sc.n_attach_keys = P_TOK / CHUNK;
		sc.attach_keys = kb;
		rq.body_case = KVD__REQUEST__BODY_SEQ_CREATE;
		rq.seq_create = &sc;
		assert_int_equal(raw_expect(&r, &rq, KVD__RESPONSE__BODY_SEQ, &rr), 0);
		ids[0] = rr->seq->seq;
		assert_int_equal(rr->seq->n_local_rows, LAYERS);
		assert_int_equal(rr->seq->local_rows[0], P_TOK);
		assert_int_equal(rr->seq->local_rows[1], 4 + 64);
		kvd_ctl_free_response(rr);

		e.seq = ids[0];
		e.row0 = 4 + 64 - 8;
		assert_int_equal(raw_ring(&r, &e), 0);
		e.row0 = 4 + 64 - 7;
		assert_int_equal(raw_ring(&r, &e), -ERANGE);
		e.layer = 0;
		e.row0 = 0;
		assert_int_equal(raw_ring(&r, &e), -EINVAL);
		/* a put into a sequence of its own, with a gap */
		struct kvd_sqe p = { .op = KVD_OP_LOCAL, .layer = 1, .slot = 0, .seq = id,
				     .ntok = 8, .row0 = 0,
				     .len = (uint32_t)kvd_local_layout(HKV, D, 8, 0).bytes };

		assert_int_equal(raw_ring(&r, &p), 0);
		p.row0 = 9;
		assert_int_equal(raw_ring(&r, &p), -EINVAL);
		/* another connection's attached sequence */
		e.seq = kvc_seq_id(x);
		e.layer = 1;
		assert_int_equal(raw_ring(&r, &e), -ENOENT);
		/* publishing a sequence whose layers are not prefilled */
		assert_int_equal(raw_publish(&r, id, junk, KVC_KEY_BYTES, CHUNK), -EBUSY);
	}
	raw_close(&r);
	assert_int_equal(kvc_seq_free(a, x), 0);
	kvc_close(a);
	src_free(&src);
}

/* ==== 4. namespaces ========================================================= */

/* As uid `uid`: attaching uid 0's prefix gets `want` tokens (0: a miss, in
 * another namespace); a miss is then prefilled and published, and its own
 * prefix it attaches.  0 or an exit code with kid_msg. */
static int other_uid_main(const struct src *src, uint32_t uid, uint64_t want, char *kid_msg)
{
	struct kvc *c;
	struct kvc_seq *s, *x;
	uint64_t got;

	if (setgroups(0, NULL) || setgid(uid) || setuid(uid)) {
		snprintf(kid_msg, 4096, "cannot become uid %u: %s", uid, strerror(errno));
		return 90;
	}
	struct kvc_opts o = { .socket_path = D_.sock, .tenant = "t", .name = "other-uid",
			      .slots = 8, .slot_size = 1 << 20 };

	if (kvc_connect(&o, &c) || kvc_profile(c, &model)) {
		snprintf(kid_msg, 4096, "uid %u cannot connect: %s", uid, kvc_last_error(c));
		return 2;
	}
	if (attach(c, src, P_TOK, &s, &got) || got != want) {
		snprintf(kid_msg, 4096, "uid %u: attach of uid 0's prefix: got %llu, want %llu (%s)",
			 uid, (unsigned long long)got, (unsigned long long)want, kvc_last_error(c));
		return 3;
	}
	if (want) {
		kvc_close(c);
		return 0;
	}
	if (extend(c, s, src, 0, P_TOK)) {
		snprintf(kid_msg, 4096, "uid %u: prefill: %s", uid, kvc_last_error(c));
		return 4;
	}
	uint8_t keys[(P_TOK / CHUNK) * KVC_KEY_BYTES];

	if (kvc_content_keys(c, src->tok, P_TOK, keys) != P_TOK / CHUNK ||
	    kvc_seq_publish(c, s, keys + (P_TOK / CHUNK - 1) * KVC_KEY_BYTES)) {
		snprintf(kid_msg, 4096, "uid %u: publish: %s", uid, kvc_last_error(c));
		return 5;
	}
	/* Its own prefix it attaches. */
	if (attach(c, src, P_TOK, &x, &got) || got != P_TOK) {
		snprintf(kid_msg, 4096, "uid %u: attach of its own: %llu (%s)", uid,
			 (unsigned long long)got, kvc_last_error(c));
		return 6;
	}
	kvc_close(c);
	return 0;
}

/* Runs other_uid_main in a child as uid; skips without root. */
static void as_uid(const struct src *src, uint32_t uid, uint64_t want)
{
	char *kid_msg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	pid_t kid;
	int st;

	assert_true(kid_msg != MAP_FAILED);
	chmod(D_.dir, 0755);
	chmod(D_.sock, 0777);
	kid = fork();
	assert_true(kid >= 0);
	if (kid == 0)
		_exit(other_uid_main(src, uid, want, kid_msg));
	assert_int_equal(waitpid(kid, &st, 0), kid);
	if (!WIFEXITED(st))
		fail_msg("uid %u: killed by signal %d", uid, WTERMSIG(st));
	if (WEXITSTATUS(st) == 90)
		skip();
	if (WEXITSTATUS(st))
		fail_msg("%s", kid_msg);
	munmap(kid_msg, 4096);
}

static void test_share_isolation(void **state)
{
	struct kvc *a = kconnect_ok("t", "owner");
	struct src src;
	struct kvc_seq *s, *x;

	src_make(&src, 4);
	s = private_seq(a, &src, P_TOK);
	publish_ok(a, s, &src, P_TOK);
	assert_int_equal(kvc_seq_free(a, s), 0);
	as_uid(&src, UID_B, 0);

	/* uid 0 still gets its own prefix, not uid B's (both exist now). */
	x = attach_ok(a, &src, P_TOK, P_TOK);
	{
		struct ans u, v;
		struct kvc_seq *p = private_seq(a, &src, P_TOK);

		answer_ok(a, x, &src, &u);
		answer_ok(a, p, &src, &v);
		expect_same("uid 0's attach vs its private sequence", &u, &v);
		assert_int_equal(kvc_seq_free(a, p), 0);
	}
	/* root sees both namespaces' prefixes in ServerStats */
	assert_int_equal(share_stats(a).published, 2);
	assert_int_equal(kvc_seq_free(a, x), 0);
	kvc_close(a);
	src_free(&src);
}

/* [sharing] groups = 0,UID_B: UID_B attaches uid 0's prefix (the group's
 * namespace), UID_C, outside the group, misses. */
static void test_share_group(void **state)
{
	struct kvc *a = kconnect_ok("t", "group-owner");
	struct src src;
	struct kvc_seq *s;

	src_make(&src, 8);
	s = private_seq(a, &src, P_TOK);
	publish_ok(a, s, &src, P_TOK);
	as_uid(&src, UID_B, P_TOK);
	as_uid(&src, UID_C, 0);
	assert_int_equal(kvc_seq_free(a, s), 0);
	kvc_close(a);
	src_free(&src);
}

/* ==== 5. free order ========================================================= */

static void test_share_free(void **state)
{
	struct kvc *a = kconnect_ok("t", "free");
	struct src src;
	struct ans pub, att;
	struct kvc_seq *s, *x, *y;
	struct kvc_stats st0 = stats(a), st1;
	struct kvc_share_stats sh;

	src_make(&src, 5);
	s = private_seq(a, &src, P_TOK);
	publish_ok(a, s, &src, P_TOK);
	answer_ok(a, s, &src, &pub);
	x = attach_ok(a, &src, P_TOK, P_TOK);
	assert_int_equal(kvc_seq_free(a, s), 0);        /* the publisher first */
	answer_ok(a, x, &src, &att);
	expect_same("attached after its publisher was freed", &att, &pub);
	y = attach_ok(a, &src, P_TOK, P_TOK);
	assert_int_equal(kvc_seq_free(a, x), 0);
	answer_ok(a, y, &src, &att);
	expect_same("second attach after the first was freed", &att, &pub);
	assert_int_equal(kvc_seq_free(a, y), 0);

	/* What stays is the published snapshot: one sequence, its bytes; not
	 * one an admin's listing shows (nor frees). */
	st1 = stats(a);
	sh = share_stats(a);
	assert_int_equal(st1.sequences, st0.sequences + 1);
	{
		struct raw r;
		uint32_t pid;
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__SeqListReq lr = KVD__SEQ_LIST_REQ__INIT;
		Kvd__Response *resp = NULL;

		raw_up(&r, "t", &pid);
		rq.body_case = KVD__REQUEST__BODY_SEQ_LIST;
		rq.seq_list = &lr;
		assert_int_equal(raw_expect(&r, &rq, KVD__RESPONSE__BODY_SEQ_LIST, &resp), 0);
		assert_int_equal(resp->seq_list->total, 0);
		kvd_ctl_free_response(resp);
		raw_close(&r);
	}
	assert_true(st1.bytes > st0.bytes);
	/* its segments and tails, and the rows the client kept beside them */
	assert_true(sh.shared_bytes > st1.bytes - st0.bytes);
	kvc_close(a);
	src_free(&src);
}

/* ==== 6. a published prefix on disk ========================================= */

static void test_share_spilled(void **state)
{
	struct kvc *a = kconnect_ok("t", "spilled");
	struct src src;
	struct ans pub, att;
	struct kvc_seq *s, *x, *fill[8];
	struct kvc_stats st;
	uint32_t n = 0;

	src_make(&src, 6);
	s = private_seq(a, &src, P_TOK);
	publish_ok(a, s, &src, P_TOK);
	answer_ok(a, s, &src, &pub);
	assert_int_equal(kvc_seq_free(a, s), 0);
	/* Newer sequences push the snapshot, now the least recently used, out
	 * to disk. */
	for (int i = 0; i < 200 && n < 8; i++) {
		st = stats(a);
		if (st.on_disk >= 1)
			break;
		fill[n++] = private_seq(a, &src, P_TOK);
		usleep(20000);
	}
	for (int i = 0; i < 500 && stats(a).on_disk < 1; i++)
		usleep(20000);
	st = stats(a);
	if (st.on_disk < 1)
		fail_msg("nothing went to disk (%u sequences, %llu used of %llu)", n,
			 (unsigned long long)st.used_bytes, (unsigned long long)st.mem_limit);
	/* the snapshot went whole: its segments and the client rows beside it */
	assert_int_equal(share_stats(a).shared_bytes, 0);
	x = attach_ok(a, &src, P_TOK, P_TOK);
	assert_true(share_stats(a).shared_bytes > 0);
	/* the merged answers use the rows read back for the client's part */
	answer_ok(a, x, &src, &att);
	expect_same("attached from disk vs publisher", &att, &pub);
	assert_true(stats(a).restores >= 1);
	assert_int_equal(kvc_seq_free(a, x), 0);
	while (n)
		assert_int_equal(kvc_seq_free(a, fill[--n]), 0);
	kvc_close(a);
	src_free(&src);
}

/* ==== 6b. --persist: a warm restart ======================================== */

/* The one spill file in the directory (the snapshot's): flips a byte of
 * its payload well past the headers. */
static void corrupt_file(void)
{
	DIR *d = opendir(spill);
	struct dirent *e;
	char path[400];
	int n = 0;

	assert_non_null(d);
	while ((e = readdir(d))) {
		FILE *f;
		long size;
		int c;

		if (!strstr(e->d_name, ".kvs") || strstr(e->d_name, ".tmp"))
			continue;
		snprintf(path, sizeof path, "%s/%s", spill, e->d_name);
		assert_non_null(f = fopen(path, "r+b"));
		fseek(f, 0, SEEK_END);
		size = ftell(f);
		fseek(f, size / 2, SEEK_SET);
		c = fgetc(f);
		fseek(f, size / 2, SEEK_SET);
		fputc(c ^ 0x5a, f);
		fclose(f);
		n++;
	}
	closedir(d);
	assert_int_equal(n, 1);
}

/* Published under --persist, the prefix is on disk at once; after kill -9
 * and a restart on the same directory, an attach by key still hits and
 * answers bit for bit as before, the client rows included.  A file
 * corrupted while kvd was down is refused when the attach reads it: a miss
 * (and a log line), never a wrong answer. */
static void test_share_persist(void **state)
{
	struct kvc *a = kconnect_ok("t", "persist");
	struct src src;
	struct ans pub, att;
	struct kvc_seq *s, *x;

	src_make(&src, 9);
	s = private_seq(a, &src, P_TOK);
	publish_ok(a, s, &src, P_TOK);
	answer_ok(a, s, &src, &pub);
	assert_int_equal(kvc_seq_free(a, s), 0);
	for (int i = 0; i < 1000 && stats(a).spills < 1; i++)
		usleep(10000);
	assert_int_equal(stats(a).spills, 1);   /* written, and still resident */
	assert_int_equal(stats(a).on_disk, 0);
	kvc_close(a);

	crash_and_restart();
	a = kconnect_ok("t", "persist-2");
	assert_int_equal(share_stats(a).published, 1);
	assert_int_equal(stats(a).on_disk, 1);
	x = attach_ok(a, &src, P_TOK + X_TOK, P_TOK);
	answer_ok(a, x, &src, &att);
	expect_same("attached after a crash and a restart vs before", &att, &pub);
	assert_int_equal(kvc_seq_free(a, x), 0);
	kvc_close(a);

	/* Another crash: the file stays as it was; corrupted, it is refused. */
	crash_and_restart();
	assert_int_equal(kill(D_.pid, SIGKILL), 0);
	assert_int_equal(waitpid(D_.pid, NULL, 0), D_.pid);
	D_.pid = 0;
	unlink(D_.sock);
	rmdir(D_.dir);
	corrupt_file();
	assert_int_equal(daemon_start4(&D_, "--spill-dir", spill, "--persist", NULL), 0);
	a = kconnect_ok("t", "persist-3");
	x = attach_ok(a, &src, P_TOK, 0);
	assert_int_equal(stats(a).lost, 1);
	assert_int_equal(share_stats(a).published, 0);
	assert_int_equal(kvc_seq_free(a, x), 0);
	kvc_close(a);
	src_free(&src);
}

/* ==== 7. races ============================================================== */

struct worker {
	pthread_t th;
	int id;
	const struct src *src;
	const struct ans *want;
	long rounds;
	long refusals;                  /* attaches refused -ENOMEM */
	char msg[512];
};

/* Under the test's budget an attach often waits (-EAGAIN, asked again by
 * libkvclient) while the other workers' restores hold the room; it must
 * never be refused for it, since that room comes back.  kvd once refused
 * it -ENOMEM, for seconds under TSan, while those restores took the room
 * in turns.  A refusal is asked again for up to 60 s so that the answers
 * are still checked, and counted. */
static int attach_retry(struct kvc *c, struct worker *w, struct kvc_seq **x, uint64_t *got)
{
	int rc;

	for (int k = 0; (rc = attach(c, w->src, P_TOK + CHUNK, x, got)) == -ENOMEM && k < 30000;
	     k++) {
		w->refusals++;
		daemon_sleep_ms(2);
	}
	return rc;
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	char name[32];
	struct kvc *c;

	snprintf(name, sizeof name, "race%d", w->id);
	if (!(c = kconnect("t", name))) {
		snprintf(w->msg, sizeof w->msg, "connect failed");
		return NULL;
	}
	for (long i = 0; i < w->rounds && !w->msg[0]; i++) {
		struct kvc_seq *x;
		struct ans a;
		uint64_t got;

		if (attach_retry(c, w, &x, &got)) {
			snprintf(w->msg, sizeof w->msg, "attach: %s", kvc_last_error(c));
			break;
		}
		if (answer(c, x, w->src, &a))
			snprintf(w->msg, sizeof w->msg, "attend: %s", kvc_last_error(c));
		else if (got == P_TOK && memcmp(&a, w->want, sizeof a))
			snprintf(w->msg, sizeof w->msg, "round %ld: answer differs", i);
		else if (got != P_TOK && got != P_TOK + CHUNK)
			snprintf(w->msg, sizeof w->msg, "attach got %llu", (unsigned long long)got);
		/* To disk and back while it shares segments with a snapshot (a
		 * write of another holder in flight says -EAGAIN: ask again). */
		int rc = -EAGAIN;

		for (int k = 0; !w->msg[0] && rc == -EAGAIN && k < 2000; k++)
			if ((rc = kvc_seq_evict(c, x)) == -EAGAIN)
				usleep(1000);
		if (rc && !w->msg[0])
			snprintf(w->msg, sizeof w->msg, "evict: %s", kvc_last_error(c));
		for (int k = 0; !w->msg[0] && k < 5000; k++) {
			struct kvc_seq_stats ss;

			if (kvc_seq_stats(c, x, &ss) || ss.state == KVC_SEQ_DISK)
				break;
			usleep(1000);
		}
		if (!w->msg[0]) {
			struct ans b;

			if (answer(c, x, w->src, &b))
				snprintf(w->msg, sizeof w->msg, "attend after evict: %s",
					 kvc_last_error(c));
			else if (memcmp(&a, &b, sizeof a))
				snprintf(w->msg, sizeof w->msg, "round %ld: answer differs after evict",
					 i);
		}
		/* Grow it by a chunk and publish that too: attaches racing it
		 * get either prefix. */
		if (!w->msg[0] && got == P_TOK) {
			uint8_t keys[(P_TOK / CHUNK + 1) * KVC_KEY_BYTES];

			if (extend(c, x, w->src, P_TOK, CHUNK) ||
			    kvc_content_keys(c, w->src->tok, P_TOK + CHUNK, keys) != P_TOK / CHUNK + 1 ||
			    kvc_seq_publish(c, x, keys + P_TOK / CHUNK * KVC_KEY_BYTES))
				snprintf(w->msg, sizeof w->msg, "grow and publish: %s",
					 kvc_last_error(c));
		}
		if (kvc_seq_free(c, x) && !w->msg[0])
			snprintf(w->msg, sizeof w->msg, "free: %s", kvc_last_error(c));
	}
	kvc_close(c);
	return NULL;
}

static void test_share_race(void **state)
{
	struct kvc *a = kconnect_ok("t", "race");
	struct src src;
	struct ans want;
	struct kvc_seq *s;
	struct worker w[3];
	struct kvc_stats st0 = stats(a);

	src_make(&src, 7);
	s = private_seq(a, &src, P_TOK);
	publish_ok(a, s, &src, P_TOK);
	answer_ok(a, s, &src, &want);
	for (int i = 0; i < 3; i++) {
		w[i] = (struct worker){ .id = i, .src = &src, .want = &want, .rounds = 4 };
		assert_int_equal(pthread_create(&w[i].th, NULL, worker_main, &w[i]), 0);
	}
	/* The publisher frees its sequence while they run. */
	assert_int_equal(kvc_seq_free(a, s), 0);
	for (int i = 0; i < 3; i++)
		pthread_join(w[i].th, NULL);
	for (int i = 0; i < 3; i++) {
		if (w[i].msg[0])
			fail_msg("worker %d: %s", i, w[i].msg);
		print_message("  worker %d: %ld attaches refused\n", i, w[i].refusals);
		assert_int_equal(w[i].refusals, 0);
	}
	/* Two snapshots remain (the prompt and the prompt + a chunk). */
	assert_int_equal(share_stats(a).published, 2);
	/* (a sequence freed while its write runs goes when the write ends) */
	for (int i = 0; i < 1000 && stats(a).sequences != st0.sequences + 2; i++)
		usleep(10000);
	assert_int_equal(stats(a).sequences, st0.sequences + 2);
	print_message("  %llu spills, %llu restores\n", (unsigned long long)stats(a).spills,
		      (unsigned long long)stats(a).restores);
	assert_true(stats(a).spills > 0);
	assert_int_equal(stats(a).lost, 0);
	kvc_close(a);
	src_free(&src);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_share_attach_matches, start, stop),
		cmocka_unit_test_setup_teardown(test_share_after_decode, start, stop),
		cmocka_unit_test_setup_teardown(test_share_errors, start, stop),
		cmocka_unit_test_setup_teardown(test_share_isolation, start, stop),
		cmocka_unit_test_setup_teardown(test_share_group, start_group, stop),
		cmocka_unit_test_setup_teardown(test_share_free, start, stop),
		cmocka_unit_test_setup_teardown(test_share_spilled, start_spill, stop),
		cmocka_unit_test_setup_teardown(test_share_persist, start_persist, stop),
		cmocka_unit_test_setup_teardown(test_share_race, start_race, stop),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
