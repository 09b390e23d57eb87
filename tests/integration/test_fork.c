/* Sequence fork (kvc_seq_fork, SeqCreate.parent) through the real daemon.
 *
 *   test_fork_matches_parent     a fork (and a fork of the fork) answers
 *                                ATTEND exactly as its parent, kvd's part and
 *                                the merged answer; the segments it shares
 *                                are counted once
 *   test_fork_diverges_like_private
 *                                parent and child extended differently past
 *                                a seal equal two private sequences given the
 *                                same calls; a frozen sibling still answers
 *                                what the parent did at the fork
 *   test_fork_between_layers     a fork taken between two layers' prefills
 *                                finishes its prefill on its own
 *   test_fork_free_order         either may be freed first; the survivor
 *                                answers as before and keeps growing;
 *                                ServerStats come back to where they were
 *   test_fork_errors             -ENOENT for a freed id, a made-up id, another
 *                                tenant's sequence and another uid's (the
 *                                same text, so existence does not leak),
 *                                -EINVAL for another profile, -EBUSY
 *                                mid-prefill (raw ring), then fine after
 *                                KVD_RF_LAST
 *   test_fork_tier               -EAGAIN while the parent is on disk (-ENOENT
 *                                to another tenant); a restored parent
 *                                forks, and one being written; parent and
 *                                child sharing segments spill and restore
 *                                bit for bit, in either order
 *   test_fork_hybrid             a hybrid profile's fork inherits its parent's
 *                                estimator state: after the parent's decode
 *                                steps both answer the next query bit for bit,
 *                                unlike a never-attended copy
 *   test_fork_storm              another process forks a parent with open
 *                                tails over and over (16 children alive at
 *                                once, some decoding, then freed) while a
 *                                quiet client attends: the forks copy no tail
 *                                (16 cost less than one layer's tail), a
 *                                child's decode copies only its own, the
 *                                quiet client's answers never change, and
 *                                every byte comes back
 *   test_fork_race               three connections of one tenant fork one
 *                                parent (kvc, and raw SeqCreate racing the
 *                                parent's free), attend and free the
 *                                children while the parent is attended, then
 *                                freed; everything comes back to zero
 *
 * kvc_seq_fork needs the parent's local part (its kvc_seq), which is plain
 * memory: the race test hands the parent's handle to the other connections
 * under a read lock, and frees it under the write lock.  The forks that race
 * the free for real go through the control protocol by hand (SeqCreate with
 * parent, no local part needed), and their children are attended through the
 * ring by hand.
 *
 * Threads and forked children never use cmocka's asserts: they report
 * through a message and the main thread fails. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ctype.h>
#include <dirent.h>
#include <grp.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "proto/ctl.h"
#include "daemon.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "proto/kvd_ring.h"
#include "engine/prep.h"
#include "raw.h"
#include "shm/shm.h"
#include "engine/synth.h"
#include "testutil.h"

#define LAYERS  3
#define HQ      8
#define HKV     2
#define D       128
#define NT      60              /* tables (L) */
#define P_TOK   3000            /* the prompt: 3 sealed segments of 1024 per sparse layer */
#define H_TOK   100             /* decoded before the fork: 96 rows in kvd's tail */
#define X_TOK   320             /* decoded after it: one more seal (256) per side */
#define NTOT    (P_TOK + H_TOK + X_TOK)
#define UID_B   65534
#define CQE_S   300             /* ring completions: generous for sanitizer builds */
#define TAIL_KV ((uint64_t)2 * HKV * 256 * D * 2)      /* one layer's tail, K and V */

static const uint32_t dense_layers[] = { 0 };
static const struct kvc_model model = {
	.name = "fork", .layers = LAYERS, .q_heads = HQ, .kv_heads = HKV, .head_dim = D,
	.K = 10, .L = NT, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 7, .segment_tokens = 1024, .seal_tokens = 256,
};
/* The same geometry, another seed: another profile. */
static const struct kvc_model model_other = {
	.name = "fork-other", .layers = LAYERS, .q_heads = HQ, .kv_heads = HKV, .head_dim = D,
	.K = 10, .L = NT, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 8, .segment_tokens = 1024, .seal_tokens = 256,
};
static const struct kvd_geom geom = { HQ, HKV, D, 10, NT, 2, 0, 0 };

static struct daemon D_;
static char spill[128];

/* ---- the daemon ----------------------------------------------------------- */

static int start(void **state)
{
	return daemon_start(&D_, NULL) ? -1 : 0;
}

static int start_spill(void **state)
{
	char tmpl[] = "/tmp/kvd-fork-spill.XXXXXX";

	if (!mkdtemp(tmpl))
		return -1;
	snprintf(spill, sizeof spill, "%s", tmpl);
	return daemon_start4(&D_, "--spill-dir", spill, NULL, NULL) ? -1 : 0;
}

/* A clean drain and exit is part of every test. */
static int stop(void **state)
{
	int rc = D_.pid > 0 ? daemon_stop(&D_) : -1;

	if (spill[0]) {
		daemon_rm_tree(spill);
		spill[0] = 0;
	}
	if (rc)
		print_error("daemon_stop: %d (want 0: a clean drain)\n", rc);
	return rc == 0 ? 0 : -1;
}

/* ---- kvc ------------------------------------------------------------------ */

static struct kvc *kconnect(const char *tenant, const char *name, const struct kvc_model *m)
{
	struct kvc_opts o = { .socket_path = D_.sock, .tenant = tenant, .name = name,
			      .slots = 8, .slot_size = 1 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c))
		fail_msg("connect: %s", kvc_last_error(c));
	if (kvc_profile(c, m))
		fail_msg("profile: %s", kvc_last_error(c));
	return c;
}

static struct kvc_stats stats(struct kvc *c)
{
	struct kvc_stats st;

	if (kvc_server_stats(c, &st))
		fail_msg("server stats: %s", kvc_last_error(c));
	return st;
}

static struct kvc_seq_stats seq_stats(struct kvc *c, const struct kvc_seq *s)
{
	struct kvc_seq_stats st;

	if (kvc_seq_stats(c, s, &st))
		fail_msg("seq stats: %s", kvc_last_error(c));
	return st;
}

/* Tokens [0, NTOT) of every layer, and the layer's query. */
struct src {
	struct kvd_synth w[LAYERS];
};

static void src_make(struct src *s, uint64_t seed)
{
	for (uint32_t l = 0; l < LAYERS; l++)
		assert_int_equal(kvd_synth_make(&s->w[l], (enum kvd_wl)(l % KVD_WL_COUNT), NTOT, HQ,
						HKV, D, seed * 10 + l), 0);
}

static void src_free(struct src *s)
{
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&s->w[l]);
}

/* Prefills layers [l0, l1) of s with tokens [0, n) of src. */
static int prefill_layers(struct kvc *c, struct kvc_seq *s, const struct src *src, uint32_t n,
			  uint32_t l0, uint32_t l1)
{
	float *k = xmalloc((size_t)HKV * n * D * 4), *v = xmalloc((size_t)HKV * n * D * 4);
	int rc = 0;

	for (uint32_t l = l0; l < l1 && !rc; l++) {
		for (uint32_t h = 0; h < HKV; h++) {
			memcpy(k + (size_t)h * n * D, src->w[l].k + (size_t)h * NTOT * D, (size_t)n * D * 4);
			memcpy(v + (size_t)h * n * D, src->w[l].v + (size_t)h * NTOT * D, (size_t)n * D * 4);
		}
		rc = kvc_prefill(c, s, l, k, v, n);
	}
	free(k);
	free(v);
	return rc;
}

/* Decodes tokens [t0, t0 + cnt) of src into every layer of s. */
static int feed(struct kvc *c, struct kvc_seq *s, const struct src *src, uint32_t t0, uint32_t cnt)
{
	float kt[HKV * D], vt[HKV * D];
	int rc;

	for (uint32_t t = t0; t < t0 + cnt; t++)
		for (uint32_t l = 0; l < LAYERS; l++) {
			for (uint32_t h = 0; h < HKV; h++) {
				memcpy(kt + h * D, src->w[l].k + ((size_t)h * NTOT + t) * D, D * 4);
				memcpy(vt + h * D, src->w[l].v + ((size_t)h * NTOT + t) * D, D * 4);
			}
			if ((rc = kvc_append(c, s, l, kt, vt)))
				return rc;
		}
	return 0;
}

/* A sequence with the prompt and the history: what a parent is at its fork. */
static struct kvc_seq *make_parent(struct kvc *c, const struct src *src)
{
	struct kvc_seq *s;

	if (kvc_seq_create(c, &s))
		fail_msg("seq: %s", kvc_last_error(c));
	if (prefill_layers(c, s, src, P_TOK, 0, LAYERS))
		fail_msg("prefill: %s", kvc_last_error(c));
	if (feed(c, s, src, P_TOK, H_TOK))
		fail_msg("append: %s", kvc_last_error(c));
	return s;
}

static struct kvc_seq *fork_of(struct kvc *c, const struct kvc_seq *p)
{
	struct kvc_seq *s;

	if (kvc_seq_fork(c, p, &s))
		fail_msg("fork: %s", kvc_last_error(c));
	return s;
}

/* Every answer a sequence gives to the layers' queries: the merged one
 * (kvc_attend, every layer) and kvd's part (kvc_attend_kvd, sparse layers;
 * layer 0's stays zero). */
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

static int ans_same(const struct ans *a, const struct ans *b)
{
	return !memcmp(a, b, sizeof *a);
}

/* Says where two answers differ and by how much. */
static void ans_diff(const char *what, const struct ans *a, const struct ans *b)
{
	for (uint32_t l = 0; l < LAYERS; l++) {
		if (memcmp(a->o[l], b->o[l], sizeof a->o[l]) || memcmp(a->lse[l], b->lse[l], sizeof a->lse[l]))
			print_message("  %s: layer %u merged answer differs, rel %.3g\n", what, l,
				      rel_err_ff(a->o[l], b->o[l], HQ * D));
		if (memcmp(a->ko[l], b->ko[l], sizeof a->ko[l]) ||
		    memcmp(a->klse[l], b->klse[l], sizeof a->klse[l]))
			print_message("  %s: layer %u kvd's part differs, rel %.3g\n", what, l,
				      rel_err_ff(a->ko[l], b->ko[l], HQ * D));
	}
}

static void expect_same(const char *what, const struct ans *a, const struct ans *b)
{
	if (!ans_same(a, b)) {
		ans_diff(what, a, b);
		fail_msg("%s: answers differ", what);
	}
}

/* Two sequences hold the same: tokens, segments and bytes. */
static void expect_same_stats(const char *what, struct kvc *ca, const struct kvc_seq *a,
			      struct kvc *cb, const struct kvc_seq *b)
{
	struct kvc_seq_stats x = seq_stats(ca, a), y = seq_stats(cb, b);

	if (x.tokens != y.tokens || x.segments != y.segments || x.bytes != y.bytes)
		fail_msg("%s: %llu tokens / %u segments / %llu bytes vs %llu / %u / %llu", what,
			 (unsigned long long)x.tokens, x.segments, (unsigned long long)x.bytes,
			 (unsigned long long)y.tokens, y.segments, (unsigned long long)y.bytes);
}

/* ---- the raw client (raw.h): what the fork tests add ---------------------- */

/* ProfileCreate of `model`'s fields under `name`. */
static int raw_profile_create_model(struct raw *x, const char *name, uint32_t *id)
{
	Kvd__Profile p = KVD__PROFILE__INIT;
	uint32_t dense[] = { 0 };

	p.name = (char *)name;
	p.layers = LAYERS;
	p.q_heads = HQ;
	p.kv_heads = HKV;
	p.head_dim = D;
	p.k_bits = 10;
	p.tables = NT;
	p.min_collisions = 2;
	p.seed = 7;
	p.n_dense_layers = 1;
	p.dense_layers = dense;
	return raw_profile_create(x, &p, id);
}

static int raw_seq_free(struct raw *x, uint64_t seq)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqFree sf = KVD__SEQ_FREE__INIT;

	sf.seq = seq;
	rq.body_case = KVD__REQUEST__BODY_SEQ_FREE;
	rq.seq_free = &sf;
	return raw_expect(x, &rq, KVD__RESPONSE__BODY_OK, NULL);
}

/* One PREFILL of ntok zero rows into `layer` (the mean with `first`). */
static int raw_prefill_zero(struct raw *x, uint64_t seq, uint32_t layer, uint32_t ntok, int first,
			    int last)
{
	const uint32_t len = (uint32_t)kvd_rows_bytes(HKV, D, NT, ntok, first);
	struct kvd_sqe e = { .op = KVD_OP_PREFILL, .layer = (uint16_t)layer, .slot = 0, .seq = seq,
			     .len = len, .ntok = ntok,
			     .flags = (uint8_t)((first ? KVD_RF_MEAN : 0) | (last ? KVD_RF_LAST : 0)) };

	void *base = shm_slot(&x->r, 0);

	if (!base)
		return -ERANGE;
	memset(base, 0, len);                   /* mean 0, K = V = 0, codes 0 */
	return raw_ring(x, &e);
}

/* kvd's part of ATTEND for one sequence, through the ring: q [HQ][D]. */
static int raw_attend(struct raw *x, const float *W, uint32_t layer, uint64_t seq, const float *q,
		      float *o, float *lse)
{
	const struct kvd_attend_layout lay = kvd_attend_layout(HQ, D, NT);
	const uint32_t out = (uint32_t)kvd_attend_out_off(&lay, 1);
	uint8_t *base = shm_slot(&x->r, 1);
	struct kvd_sqe e = { .op = KVD_OP_ATTEND, .layer = (uint16_t)layer, .slot = 1,
			     .len = (uint32_t)lay.in, .nseq = 1, .out_off = out,
			     .out_len = (uint32_t)lay.out };
	int rc;

	if (!base)
		return -ERANGE;
	memset(base, 0, KVD_ATTEND_HDR);
	memcpy(base, &seq, sizeof seq);
	memcpy(base + lay.q_off, q, (size_t)HQ * D * 4);
	kvd_prep_query_codes(&geom, W, q, (uint16_t *)(base + lay.codes_off));
	if ((rc = raw_ring(x, &e)))
		return rc;
	memcpy(o, base + out, (size_t)HQ * D * 4);
	memcpy(lse, base + out + lay.lse_off, (size_t)HQ * 4);
	return 0;
}

static void raw_up(struct raw *x, const char *tenant, uint32_t *pid)
{
	int rc;

	assert_int_equal(raw_open(x, D_.sock, 0), 0);
	if ((rc = raw_hello(x, "fork-raw", tenant, 2, 1 << 20)))
		fail_msg("raw hello: %d %s", rc, x->msg);
	if (pid && (rc = raw_profile_open(x, model.name, pid)))
		fail_msg("raw profile open: %d %s", rc, x->msg);
}

/* An error message with every run of digits made '#': the shape of it. */
static void shape_of(const char *msg, char *out, size_t cap)
{
	size_t n = 0;

	for (const char *p = msg; *p && n + 1 < cap; p++) {
		if (isdigit((unsigned char)*p)) {
			out[n++] = '#';
			while (isdigit((unsigned char)p[1]))
				p++;
		} else {
			out[n++] = *p;
		}
	}
	out[n] = 0;
}

/* ==== 1. a fork answers as its parent ===================================== */

static void test_fork_matches_parent(void **state)
{
	struct kvc *c = kconnect("t", "matches", &model);
	struct kvc_stats st0 = stats(c), st;
	struct kvc_seq *par, *ch, *gch;
	struct kvc_seq_stats ps, cs;
	struct src src;
	struct ans ap, ac, ag;

	src_make(&src, 1);
	par = make_parent(c, &src);
	ps = seq_stats(c, par);
	/* 3 prompt segments per sparse layer and a tail of 96 decoded rows:
	 * both kinds of data kvd holds, and the client a window */
	assert_int_equal(ps.segments, 3 * (LAYERS - 1));
	assert_int_equal(ps.tokens, P_TOK - 4 - 64 + 96);      /* per layer */
	st = stats(c);
	assert_int_equal(st.bytes - st0.bytes, ps.bytes);

	ch = fork_of(c, par);
	assert_true(kvc_seq_id(ch) != kvc_seq_id(par));
	cs = seq_stats(c, ch);
	print_message("  parent %llu: %llu tokens, %u segments, %llu bytes; child %llu: %llu, %u, %llu\n",
		      (unsigned long long)kvc_seq_id(par), (unsigned long long)ps.tokens, ps.segments,
		      (unsigned long long)ps.bytes, (unsigned long long)kvc_seq_id(ch),
		      (unsigned long long)cs.tokens, cs.segments, (unsigned long long)cs.bytes);
	expect_same_stats("child vs parent", c, ch, c, par);
	/* the shared segments and tails count once: the child adds what it
	 * copied (its means, tables), less than one layer's tail */
	st = stats(c);
	assert_int_equal(st.sequences, st0.sequences + 2);
	assert_true(st.bytes - st0.bytes > ps.bytes);
	assert_true(st.bytes - st0.bytes < ps.bytes + TAIL_KV);
	uint64_t own = st.bytes - st0.bytes - ps.bytes;        /* what one fork copies */

	answer_ok(c, par, &src, &ap);
	answer_ok(c, ch, &src, &ac);
	assert_true(ans_finite(&ap));
	expect_same("child vs parent", &ac, &ap);

	/* both in one batch: the same answers */
	for (uint32_t l = 0; l < LAYERS; l++) {
		struct kvc_seq *both[2] = { par, ch };
		float q2[2 * HQ * D], o2[2 * HQ * D], l2[2 * HQ], ko2[2 * HQ * D], kl2[2 * HQ];

		memcpy(q2, src.w[l].q, HQ * D * 4);
		memcpy(q2 + HQ * D, src.w[l].q, HQ * D * 4);
		assert_int_equal(kvc_attend(c, l, both, 2, q2, o2, l2), 0);
		assert_memory_equal(o2, ap.o[l], HQ * D * 4);
		assert_memory_equal(o2 + HQ * D, ap.o[l], HQ * D * 4);
		assert_memory_equal(l2, ap.lse[l], HQ * 4);
		assert_memory_equal(l2 + HQ, ap.lse[l], HQ * 4);
		if (l == 0)
			continue;
		assert_int_equal(kvc_attend_kvd(c, l, both, 2, q2, ko2, kl2), 0);
		assert_memory_equal(ko2, ap.ko[l], HQ * D * 4);
		assert_memory_equal(ko2 + HQ * D, ap.ko[l], HQ * D * 4);
		assert_memory_equal(kl2, ap.klse[l], HQ * 4);
		assert_memory_equal(kl2 + HQ, ap.klse[l], HQ * 4);
	}

	/* a fork of the fork, on another connection of the tenant */
	struct kvc *c2 = kconnect("t", "matches-2", &model);

	gch = fork_of(c2, ch);
	answer_ok(c2, gch, &src, &ag);
	expect_same("grandchild vs parent", &ag, &ap);
	expect_same_stats("grandchild vs parent", c2, gch, c, par);
	st = stats(c);
	assert_int_equal(st.bytes - st0.bytes, ps.bytes + 2 * own);
	assert_int_equal(st.sequences, st0.sequences + 3);

	assert_int_equal(kvc_seq_free(c, ch), 0);
	assert_int_equal(kvc_seq_free(c2, gch), 0);
	assert_int_equal(kvc_seq_free(c, par), 0);
	st = stats(c);
	assert_int_equal(st.sequences, st0.sequences);
	assert_int_equal(st.bytes, st0.bytes);
	kvc_close(c2);
	kvc_close(c);
	src_free(&src);
}

/* ==== 2. diverging like private copies ==================================== */

static void test_fork_diverges_like_private(void **state)
{
	struct kvc *c = kconnect("t", "diverge", &model);
	struct kvc_stats st0 = stats(c);
	struct kvc_seq *par, *ch, *frozen, *pa, *pb;
	struct kvc_seq_stats s0, s1;
	struct src src, srcb;
	struct ans a0, ap, ac, af, aa, ab;

	src_make(&src, 2);
	src_make(&srcb, 3);             /* B: other tokens at the same positions */
	par = make_parent(c, &src);
	answer_ok(c, par, &src, &a0);
	ch = fork_of(c, par);
	frozen = fork_of(c, par);
	s0 = seq_stats(c, par);

	/* A to the parent, B to the child: each seals a segment of its own */
	if (feed(c, par, &src, P_TOK + H_TOK, X_TOK))
		fail_msg("append A: %s", kvc_last_error(c));
	if (feed(c, ch, &srcb, P_TOK + H_TOK, X_TOK))
		fail_msg("append B: %s", kvc_last_error(c));
	s1 = seq_stats(c, par);
	assert_int_equal(s1.segments, s0.segments + (LAYERS - 1));
	assert_int_equal(seq_stats(c, ch).segments, s0.segments + (LAYERS - 1));

	/* the same calls to two private sequences */
	if (kvc_seq_create(c, &pa) || prefill_layers(c, pa, &src, P_TOK, 0, LAYERS) ||
	    feed(c, pa, &src, P_TOK, H_TOK) || feed(c, pa, &src, P_TOK + H_TOK, X_TOK))
		fail_msg("private A: %s", kvc_last_error(c));
	if (kvc_seq_create(c, &pb) || prefill_layers(c, pb, &src, P_TOK, 0, LAYERS) ||
	    feed(c, pb, &src, P_TOK, H_TOK) || feed(c, pb, &srcb, P_TOK + H_TOK, X_TOK))
		fail_msg("private B: %s", kvc_last_error(c));

	answer_ok(c, par, &src, &ap);
	answer_ok(c, ch, &src, &ac);
	answer_ok(c, frozen, &src, &af);
	answer_ok(c, pa, &src, &aa);
	answer_ok(c, pb, &src, &ab);
	assert_true(ans_finite(&ap) && ans_finite(&ac));
	expect_same("parent vs private A", &ap, &aa);
	expect_same("child vs private B", &ac, &ab);
	/* they did diverge, in kvd's part and in the merged answer */
	for (uint32_t l = 1; l < LAYERS; l++) {
		assert_true(memcmp(ap.ko[l], ac.ko[l], sizeof ap.ko[l]) != 0);
		assert_true(memcmp(ap.o[l], ac.o[l], sizeof ap.o[l]) != 0);
	}
	/* the shared segments were not touched: a sibling that stayed put
	 * answers what the parent did at the fork */
	expect_same("frozen sibling vs parent at the fork", &af, &a0);
	expect_same_stats("parent vs private A", c, par, c, pa);
	expect_same_stats("child vs private B", c, ch, c, pb);

	struct kvc_seq *all[] = { par, ch, frozen, pa, pb };

	for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
		assert_int_equal(kvc_seq_free(c, all[i]), 0);
	assert_int_equal(stats(c).bytes, st0.bytes);
	assert_int_equal(stats(c).sequences, st0.sequences);
	kvc_close(c);
	src_free(&src);
	src_free(&srcb);
}

/* ==== 3. a fork between two layers' prefills ============================== */

/* Layer 0 (dense) and 1 prefilled, 2 not yet: nothing is mid-prefill, so it
 * forks; parent and child each prefill layer 2 and answer alike, and like
 * a sequence prefilled in one go. */
static void test_fork_between_layers(void **state)
{
	struct kvc *c = kconnect("t", "layers", &model);
	struct kvc_seq *par, *ch, *whole;
	struct src src;
	struct ans ap, ac, aw;

	src_make(&src, 4);
	assert_int_equal(kvc_seq_create(c, &par), 0);
	if (prefill_layers(c, par, &src, P_TOK, 0, 2))
		fail_msg("prefill: %s", kvc_last_error(c));
	ch = fork_of(c, par);
	if (prefill_layers(c, par, &src, P_TOK, 2, 3) || prefill_layers(c, ch, &src, P_TOK, 2, 3))
		fail_msg("prefill of layer 2: %s", kvc_last_error(c));
	/* a layer is prefilled once, in the child too */
	assert_int_equal(prefill_layers(c, ch, &src, P_TOK, 1, 2), -EALREADY);
	if (feed(c, par, &src, P_TOK, H_TOK) || feed(c, ch, &src, P_TOK, H_TOK))
		fail_msg("append: %s", kvc_last_error(c));
	whole = make_parent(c, &src);
	answer_ok(c, par, &src, &ap);
	answer_ok(c, ch, &src, &ac);
	answer_ok(c, whole, &src, &aw);
	expect_same("parent vs one-go", &ap, &aw);
	expect_same("child vs one-go", &ac, &aw);
	expect_same_stats("child vs one-go", c, ch, c, whole);
	assert_int_equal(kvc_seq_free(c, par), 0);
	assert_int_equal(kvc_seq_free(c, ch), 0);
	assert_int_equal(kvc_seq_free(c, whole), 0);
	assert_int_equal(stats(c).bytes, 0);
	kvc_close(c);
	src_free(&src);
}

/* ==== 4. either may be freed first ======================================== */

static void free_order(struct kvc *c, const struct src *src, int parent_first,
		       const struct kvc_stats *st0)
{
	struct kvc_seq *par = make_parent(c, src), *ch = fork_of(c, par);
	struct kvc_seq *first = parent_first ? par : ch, *last = parent_first ? ch : par;
	const char *who = parent_first ? "child" : "parent";
	struct ans before, after;
	struct kvc_stats st;
	struct kvc_seq_stats ls;

	answer_ok(c, last, src, &before);
	assert_int_equal(kvc_seq_free(c, first), 0);
	st = stats(c);
	ls = seq_stats(c, last);
	assert_int_equal(st.sequences, st0->sequences + 1);
	assert_int_equal(st.bytes - st0->bytes, ls.bytes);
	answer_ok(c, last, src, &after);
	print_message("  %s first: the %s answers as before: %s\n", parent_first ? "parent" : "child",
		      who, ans_same(&before, &after) ? "yes" : "NO");
	expect_same(who, &after, &before);
	/* and grows past a seal of its own (its segment table was shared) */
	if (feed(c, last, src, P_TOK + H_TOK, X_TOK))
		fail_msg("append after the other was freed: %s", kvc_last_error(c));
	assert_int_equal(seq_stats(c, last).segments, ls.segments + (LAYERS - 1));
	answer_ok(c, last, src, &after);
	assert_true(ans_finite(&after));
	assert_int_equal(kvc_seq_free(c, last), 0);
	st = stats(c);
	assert_int_equal(st.sequences, st0->sequences);
	assert_int_equal(st.bytes, st0->bytes);
	assert_int_equal(st.used_bytes, st0->used_bytes);
}

static void test_fork_free_order(void **state)
{
	struct kvc *c = kconnect("t", "order", &model);
	struct kvc_stats st0 = stats(c);
	struct src src;

	/* nothing else is alive in this daemon */
	assert_int_equal(st0.sequences, 0);
	assert_int_equal(st0.bytes, 0);
	src_make(&src, 5);
	free_order(c, &src, 1, &st0);
	free_order(c, &src, 0, &st0);
	src_free(&src);
	kvc_close(c);
}

/* ==== 5. errors ============================================================ */

/* Another uid (run as root): a fork of uid 0's sequence, and of a made-up
 * id, must read the same (`want`: the shape of the made-up one's text). */
static void other_uid(uint64_t victim, const char *want, char *kid_msg)
{
	pid_t kid = fork();

	assert_true(kid >= 0);
	if (kid == 0) {
		struct raw x;
		uint32_t pid;
		uint64_t q;
		char sh[256];
		int rc;

		if (setgroups(0, NULL) || setgid(UID_B) || setuid(UID_B)) {
			snprintf(kid_msg, 4096, "cannot become uid %d: %s", UID_B, strerror(errno));
			_exit(90);
		}
		if (raw_open(&x, D_.sock, 0) || raw_hello(&x, "fork-raw", "t", 2, 1 << 20)) {
			snprintf(kid_msg, 4096, "uid %d: cannot connect: %s", UID_B, x.msg);
			_exit(2);
		}
		/* its own profile of that name (profiles are per uid) */
		if ((rc = raw_profile_create_model(&x, model.name, &pid))) {
			snprintf(kid_msg, 4096, "uid %d: profile: %d %s", UID_B, rc, x.msg);
			_exit(3);
		}
		rc = raw_seq_create(&x, pid, victim, &q);
		shape_of(x.msg, sh, sizeof sh);
		if (rc != -ENOENT || strcmp(sh, want)) {
			snprintf(kid_msg, 4096, "uid %d, tenant \"t\": fork of uid 0's sequence: %d '%s', "
				 "want %d '%s'", UID_B, rc, x.msg, -ENOENT, want);
			_exit(4);
		}
		rc = raw_seq_create(&x, pid, victim ^ 0x5a5a, &q);
		shape_of(x.msg, sh, sizeof sh);
		if (rc != -ENOENT || strcmp(sh, want)) {
			snprintf(kid_msg, 4096, "uid %d: fork of a made-up id: %d '%s'", UID_B, rc, x.msg);
			_exit(5);
		}
		raw_close(&x);
		_exit(0);
	}
	int st;

	assert_int_equal(waitpid(kid, &st, 0), kid);
	if (!WIFEXITED(st))
		fail_msg("uid %d: killed by signal %d", UID_B, WTERMSIG(st));
	if (WEXITSTATUS(st))
		fail_msg("%s", kid_msg);
}

static void test_fork_errors(void **state)
{
	struct kvc *c = kconnect("t", "errors", &model);
	struct kvc_stats st0 = stats(c);
	struct kvc_seq *par, *gone;
	struct raw x, y;
	uint32_t pid, pid_y, pid_other;
	uint64_t q, q2, gone_id;
	char none[256], freed[256], other[256], other_kvc[256];
	struct src src;
	int rc;

	src_make(&src, 6);
	par = make_parent(c, &src);
	raw_up(&x, "t", &pid);

	/* a same-tenant connection that does not own it may fork it */
	assert_int_equal(raw_seq_create(&x, pid, kvc_seq_id(par), &q), 0);
	assert_int_equal(raw_seq_free(&x, q), 0);

	/* a made-up id */
	rc = raw_seq_create(&x, pid, kvc_seq_id(par) ^ 0x5a5a, &q);
	print_message("  made-up id: %d %s\n", rc, x.msg);
	assert_int_equal(rc, -ENOENT);
	shape_of(x.msg, none, sizeof none);

	/* a freed one */
	assert_int_equal(kvc_seq_create(c, &gone), 0);
	gone_id = kvc_seq_id(gone);
	assert_int_equal(kvc_seq_free(c, gone), 0);
	rc = raw_seq_create(&x, pid, gone_id, &q);
	print_message("  freed id: %d %s\n", rc, x.msg);
	assert_int_equal(rc, -ENOENT);
	shape_of(x.msg, freed, sizeof freed);
	assert_string_equal(freed, none);

	/* another tenant of the same uid, by hand and through kvc */
	raw_up(&y, "u", &pid_y);
	rc = raw_seq_create(&y, pid_y, kvc_seq_id(par), &q);
	print_message("  other tenant: %d %s\n", rc, y.msg);
	assert_int_equal(rc, -ENOENT);
	shape_of(y.msg, other, sizeof other);
	assert_string_equal(other, none);
	{
		struct kvc *cu = kconnect("u", "errors-u", &model);
		struct kvc *co = kconnect("u", "errors-u2", &model_other);
		struct kvc_seq *s;
		char want[300], shape[256];

		rc = kvc_seq_fork(cu, par, &s);
		print_message("  other tenant, through kvc: %d %s\n", rc, kvc_last_error(cu));
		assert_int_equal(rc, -ENOENT);
		shape_of(kvc_last_error(cu), other_kvc, sizeof other_kvc);
		snprintf(want, sizeof want, "kvd: %s", none);
		assert_string_equal(other_kvc, want);
		rc = kvc_seq_fork(c, par, &s);          /* (the owner's tenant may) */
		assert_int_equal(rc, 0);
		assert_int_equal(kvc_seq_free(c, s), 0);
		/* another tenant with another profile: still "no such
		 * sequence", not a profile mismatch that would say it exists */
		rc = kvc_seq_fork(co, par, &s);
		print_message("  other tenant, other profile: %d %s\n", rc, kvc_last_error(co));
		assert_int_equal(rc, -ENOENT);
		shape_of(kvc_last_error(co), shape, sizeof shape);
		assert_string_equal(shape, want);
		kvc_close(co);
		kvc_close(cu);
	}

	/* another uid, tenant "t" too */
	if (geteuid() == 0) {
		char *kid_msg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

		assert_true(kid_msg != MAP_FAILED);
		chmod(D_.dir, 0755);
		chmod(D_.sock, 0777);
		other_uid(kvc_seq_id(par), none, kid_msg);
		print_message("  uid %d, tenant \"t\": -ENOENT, '%s' as for a made-up id\n", UID_B, none);
		munmap(kid_msg, 4096);
	} else {
		print_message("  not root: the other uid is not tested\n");
	}

	/* another profile of the same tenant: -EINVAL */
	{
		struct kvc *co = kconnect("t", "errors-other", &model_other);
		struct kvc_seq *s;

		assert_int_equal(raw_profile_open(&x, model_other.name, &pid_other), 0);
		rc = raw_seq_create(&x, pid_other, kvc_seq_id(par), &q);
		print_message("  other profile: %d %s\n", rc, x.msg);
		assert_int_equal(rc, -EINVAL);
		rc = kvc_seq_fork(co, par, &s);
		assert_int_equal(rc, -EINVAL);
		kvc_close(co);
	}

	/* mid-prefill: layer 1 has its mean and rows, no KVD_RF_LAST yet */
	assert_int_equal(raw_seq_create(&x, pid, 0, &q), 0);
	if ((rc = raw_prefill_zero(&x, q, 1, 8, 1, 0)))
		fail_msg("prefill without LAST: %d %s", rc, x.msg);
	rc = raw_seq_create(&x, pid, q, &q2);
	print_message("  mid-prefill: %d %s\n", rc, x.msg);
	assert_int_equal(rc, -EBUSY);
	/* another tenant is told "no such sequence", not "busy" */
	assert_int_equal(raw_seq_create(&y, pid_y, q, &q2), -ENOENT);
	if ((rc = raw_prefill_zero(&x, q, 1, 8, 0, 1)))
		fail_msg("prefill with LAST: %d %s", rc, x.msg);
	assert_int_equal(raw_seq_create(&x, pid, q, &q2), 0);
	assert_int_equal(raw_seq_free(&x, q2), 0);
	/* the second layer mid-prefill: -EBUSY again */
	if ((rc = raw_prefill_zero(&x, q, 2, 8, 1, 0)))
		fail_msg("prefill of layer 2 without LAST: %d %s", rc, x.msg);
	assert_int_equal(raw_seq_create(&x, pid, q, &q2), -EBUSY);
	assert_int_equal(raw_seq_free(&x, q), 0);
	/* a fork of a fork that was freed */
	assert_int_equal(raw_seq_create(&x, pid, q, &q2), -ENOENT);

	/* nothing was left behind by the refusals */
	assert_int_equal(stats(c).sequences, st0.sequences + 1);
	assert_int_equal(kvc_seq_free(c, par), 0);
	assert_int_equal(stats(c).sequences, st0.sequences);
	assert_int_equal(stats(c).bytes, st0.bytes);
	raw_close(&y);
	raw_close(&x);
	kvc_close(c);
	src_free(&src);
}

/* ==== 6. the spill tier =================================================== */

static struct kvc_seq_stats wait_state(struct kvc *c, struct kvc_seq *s, uint32_t leave)
{
	struct kvc_seq_stats st;

	for (int i = 0; i < 3000; i++) {
		st = seq_stats(c, s);
		if (st.state != leave)
			return st;
		daemon_sleep_ms(10);
	}
	fail_msg("sequence still in state %u after 30 s", leave);
	return st;
}

/* Starts the eviction of s; "its stale file is being deleted: try
 * again" (-EAGAIN) is tried again. */
static void evict(struct kvc *c, struct kvc_seq *s)
{
	int rc = -EAGAIN;

	for (int i = 0; i < 3000 && rc == -EAGAIN; i++)
		if ((rc = kvc_seq_evict(c, s)) == -EAGAIN)
			daemon_sleep_ms(10);
	if (rc)
		fail_msg("evict: %d %s", rc, kvc_last_error(c));
}

static void test_fork_tier(void **state)
{
	struct kvc *c = kconnect("t", "tier", &model);
	struct kvc_seq *par, *ch;
	struct kvc_seq_stats ps;
	struct src src;
	struct ans ap, ac, ap2;
	int rc;

	src_make(&src, 7);
	par = make_parent(c, &src);
	answer_ok(c, par, &src, &ap);
	ps = seq_stats(c, par);
	evict(c, par);
	assert_int_equal(wait_state(c, par, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);

	rc = kvc_seq_fork(c, par, &ch);
	print_message("  parent on disk: %d %s\n", rc, kvc_last_error(c));
	assert_int_equal(rc, -EAGAIN);
	{
		/* another tenant is not told where it is */
		struct kvc *cu = kconnect("u", "tier-u", &model);

		assert_int_equal(kvc_seq_fork(cu, par, &ch), -ENOENT);
		kvc_close(cu);
	}
	assert_int_equal(stats(c).sequences, 1);

	/* attending brings it back; then it forks */
	answer_ok(c, par, &src, &ap2);
	expect_same("restored parent", &ap2, &ap);
	assert_int_equal(wait_state(c, par, KVC_SEQ_RESTORING).state, KVC_SEQ_RAM);
	ch = fork_of(c, par);
	answer_ok(c, ch, &src, &ac);
	expect_same("fork of a restored parent", &ac, &ap);
	expect_same_stats("fork of a restored parent", c, ch, c, par);
	assert_true(stats(c).bytes < 2 * seq_stats(c, par).bytes);
	assert_true(stats(c).bytes > seq_stats(c, par).bytes);

	/* the parent goes to disk while its child shares its segments: the
	 * child answers as before */
	evict(c, par);
	assert_int_equal(wait_state(c, par, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);
	assert_int_equal(stats(c).bytes, seq_stats(c, ch).bytes);
	answer_ok(c, ch, &src, &ac);
	expect_same("child while its parent is on disk", &ac, &ap);
	/* the child too: nothing resident */
	evict(c, ch);
	assert_int_equal(wait_state(c, ch, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);
	assert_int_equal(stats(c).bytes, 0);
	assert_int_equal(stats(c).on_disk, 2);
	/* both back, alike */
	answer_ok(c, ch, &src, &ac);
	expect_same("restored child", &ac, &ap);
	answer_ok(c, par, &src, &ap2);
	expect_same("parent restored after its child", &ap2, &ap);
	assert_int_equal(wait_state(c, par, KVC_SEQ_RESTORING).state, KVC_SEQ_RAM);
	assert_int_equal(wait_state(c, ch, KVC_SEQ_RESTORING).state, KVC_SEQ_RAM);
	print_message("  parent %llu bytes before any spill, %llu now; child %llu\n",
		      (unsigned long long)ps.bytes, (unsigned long long)seq_stats(c, par).bytes,
		      (unsigned long long)seq_stats(c, ch).bytes);

	/* the child forked again, then freed while the parent is on disk */
	assert_int_equal(kvc_seq_free(c, ch), 0);
	ch = fork_of(c, par);
	evict(c, par);
	assert_int_equal(wait_state(c, par, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);
	assert_int_equal(kvc_seq_free(c, ch), 0);
	answer_ok(c, par, &src, &ap2);
	expect_same("parent restored after its child left", &ap2, &ap);
	assert_int_equal(wait_state(c, par, KVC_SEQ_RESTORING).state, KVC_SEQ_RAM);

	/* both written out at once while they share segments: a segment's
	 * header page goes into one file at a time (the second SeqEvict says
	 * -EAGAIN until the first write is done), and neither is lost */
	ch = fork_of(c, par);
	evict(c, par);
	for (int i = 0; (rc = kvc_seq_evict(c, ch)) == -EAGAIN && i < 5000; i++)
		usleep(1000);
	if (rc)
		fail_msg("evict of the child: %d %s", rc, kvc_last_error(c));
	assert_int_equal(wait_state(c, par, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);
	assert_int_equal(wait_state(c, ch, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);
	answer_ok(c, ch, &src, &ac);
	expect_same("child written out beside its parent", &ac, &ap);
	answer_ok(c, par, &src, &ap2);
	expect_same("parent written out beside its child", &ap2, &ap);
	assert_int_equal(stats(c).lost, 0);
	assert_int_equal(wait_state(c, ch, KVC_SEQ_RESTORING).state, KVC_SEQ_RAM);
	assert_int_equal(kvc_seq_free(c, ch), 0);
	assert_int_equal(wait_state(c, par, KVC_SEQ_RESTORING).state, KVC_SEQ_RAM);

	/* a fork right behind an evict: the parent is still being written
	 * (allowed), or already on disk (-EAGAIN); a child made while it was
	 * written answers as it did, after the write dropped the parent.  A
	 * clean parent would be dropped at once, without a write: change it. */
	if (feed(c, par, &src, P_TOK + H_TOK, 64))
		fail_msg("append: %s", kvc_last_error(c));
	answer_ok(c, par, &src, &ap);
	assert_false(seq_stats(c, par).durable);
	evict(c, par);
	rc = kvc_seq_fork(c, par, &ch);
	print_message("  fork right behind an evict: %d%s%s\n", rc, rc ? " " : "",
		      rc ? kvc_last_error(c) : "");
	if (rc != -EAGAIN) {
		assert_int_equal(rc, 0);
		assert_int_equal(wait_state(c, par, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);
		answer_ok(c, ch, &src, &ac);
		expect_same("child made while its parent was written", &ac, &ap);
		assert_int_equal(kvc_seq_free(c, ch), 0);
	}
	assert_int_equal(wait_state(c, par, KVC_SEQ_SPILLING).state, KVC_SEQ_DISK);
	answer_ok(c, par, &src, &ap2);
	expect_same("parent, restored once more", &ap2, &ap);
	/* (freed while its restore runs, it would leave when the read ends) */
	assert_int_equal(wait_state(c, par, KVC_SEQ_RESTORING).state, KVC_SEQ_RAM);
	assert_int_equal(kvc_seq_free(c, par), 0);
	assert_int_equal(stats(c).sequences, 0);
	assert_int_equal(stats(c).bytes, 0);
	kvc_close(c);
	src_free(&src);
}

/* ==== 6b. estimator state (hybrid) ====================================== */

static const struct kvc_model model_hybrid = {
	.name = "fork-hybrid", .layers = LAYERS, .q_heads = HQ, .kv_heads = HKV, .head_dim = D,
	.K = 10, .L = NT, .c = 2, .sink = 4, .window = 64, .estimator = KVC_EST_HYBRID,
	.dense_layers = dense_layers, .n_dense = 1, .seed = 7, .segment_tokens = 1024,
	.seal_tokens = 256,
};

static void test_fork_hybrid(void **state)
{
	struct kvc *c = kconnect("t", "hybrid", &model_hybrid);
	struct kvc_seq *par, *ch, *fresh;
	struct src src;
	struct ans a, ap, ac, af;
	float steps[4][HQ * D];

	src_make(&src, 9);
	par = make_parent(c, &src);
	fresh = make_parent(c, &src);
	/* a few decode steps' queries: the parent's heavy lists fill */
	assert_int_equal(kvd_synth_steps(&src.w[1], 4, 91, &steps[0][0]), 0);
	for (int i = 1; i < 4; i++) {
		struct src q = src;

		q.w[1].q = steps[i];
		q.w[2].q = steps[i];
		answer_ok(c, par, &q, &a);
	}
	print_message("  parent %llu bytes after attends, a never-attended copy %llu\n",
		      (unsigned long long)seq_stats(c, par).bytes,
		      (unsigned long long)seq_stats(c, fresh).bytes);
	ch = fork_of(c, par);
	answer_ok(c, ch, &src, &ac);
	answer_ok(c, par, &src, &ap);
	answer_ok(c, fresh, &src, &af);
	/* The child inherits the parent's estimator state with its data: it
	 * answers the next query exactly as its parent does, and is charged
	 * what the parent holds, state included; a never-attended copy, with
	 * empty lists, answers otherwise. */
	expect_same("hybrid child vs parent", &ac, &ap);
	assert_false(ans_same(&ac, &af));
	assert_true(ans_finite(&ac));
	assert_int_equal(kvc_seq_free(c, ch), 0);
	assert_int_equal(kvc_seq_free(c, par), 0);
	assert_int_equal(kvc_seq_free(c, fresh), 0);
	assert_int_equal(stats(c).bytes, 0);
	kvc_close(c);
	src_free(&src);
}

/* ==== 7. the race ========================================================== */

#define RACE_WORKERS 3
#define RACE_MS      1500

static pthread_rwlock_t race_lock;
static struct kvc_seq *race_par;        /* under race_lock; NULL once freed */
static uint64_t race_par_id;
static atomic_int race_stop, race_freeing, race_freed;

struct worker {
	pthread_t th;
	int idx;
	struct kvc *c;
	struct raw x;
	uint32_t pid;
	const struct src *src;
	const struct ans *ref;
	atomic_long forks, raw_forks, raw_gone;
	long attends, not_finite;
	int bad;
	char why[512];
};

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct ans *a = xmalloc(sizeof *a);
	float o[HQ * D], lse[HQ];
	const float *W = kvc_w(w->c);

	while (!atomic_load(&race_stop) && !w->bad) {
		struct kvc_seq *ch = NULL;
		uint64_t id;
		int rc = 1, freed;

		/* kvc: the parent's handle, read while it lives */
		pthread_rwlock_rdlock(&race_lock);
		if (race_par)
			rc = kvc_seq_fork(w->c, race_par, &ch);
		pthread_rwlock_unlock(&race_lock);
		if (rc == 1)
			daemon_sleep_ms(1);     /* the parent is gone: raw forks only, not flat out */
		if (rc == 0) {
			atomic_fetch_add(&w->forks, 1);
			rc = answer(w->c, ch, w->src, a);
			if (rc) {
				snprintf(w->why, sizeof w->why, "attend of a child: %d %s", rc,
					 kvc_last_error(w->c));
				w->bad = 1;
			} else {
				w->attends++;
				w->not_finite += !ans_finite(a);
				if (!ans_same(a, w->ref)) {
					snprintf(w->why, sizeof w->why, "a child answers unlike its parent "
						 "(layer 1 kvd rel %.3g, merged rel %.3g)",
						 rel_err_ff(a->ko[1], w->ref->ko[1], HQ * D),
						 rel_err_ff(a->o[1], w->ref->o[1], HQ * D));
					w->bad = 1;
				}
			}
			if ((rc = kvc_seq_free(w->c, ch)) && !w->bad) {
				snprintf(w->why, sizeof w->why, "free of a child: %d %s", rc,
					 kvc_last_error(w->c));
				w->bad = 1;
			}
		} else if (rc != 1) {
			snprintf(w->why, sizeof w->why, "fork of a live parent: %d %s", rc,
				 kvc_last_error(w->c));
			w->bad = 1;
		}
		if (w->bad)
			break;

		/* by hand: SeqCreate(parent) racing the parent's free */
		freed = atomic_load(&race_freed);
		rc = raw_seq_create(&w->x, w->pid, race_par_id, &id);
		if (rc == 0) {
			atomic_fetch_add(&w->raw_forks, 1);
			if (freed) {
				snprintf(w->why, sizeof w->why, "a fork after the parent's free "
					 "succeeded: %llu", (unsigned long long)id);
				w->bad = 1;
			}
			for (uint32_t l = 1; l < LAYERS && !w->bad; l++) {
				if ((rc = raw_attend(&w->x, W, l, id, w->src->w[l].q, o, lse))) {
					snprintf(w->why, sizeof w->why, "ring attend of a raw child: %d %s",
						 rc, w->x.msg);
					w->bad = 1;
				} else if (memcmp(o, w->ref->ko[l], sizeof o) ||
					   memcmp(lse, w->ref->klse[l], sizeof lse)) {
					snprintf(w->why, sizeof w->why, "a raw child answers unlike its "
						 "parent, layer %u (rel %.3g)", l,
						 rel_err_ff(o, w->ref->ko[l], HQ * D));
					w->bad = 1;
				}
			}
			if ((rc = raw_seq_free(&w->x, id)) && !w->bad) {
				snprintf(w->why, sizeof w->why, "free of a raw child: %d %s", rc, w->x.msg);
				w->bad = 1;
			}
		} else if (rc == -ENOENT) {
			atomic_fetch_add(&w->raw_gone, 1);
			if (!atomic_load(&race_freeing)) {
				snprintf(w->why, sizeof w->why, "-ENOENT before the parent's free: %s",
					 w->x.msg);
				w->bad = 1;
			}
		} else {
			snprintf(w->why, sizeof w->why, "raw fork: %d %s", rc, w->x.msg);
			w->bad = 1;
		}
	}
	free(a);
	return NULL;
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Every worker did at least `n` of both kinds of fork (or failed). */
static int all_did(struct worker *w, long n, int raw_gone)
{
	for (int i = 0; i < RACE_WORKERS; i++) {
		if (w[i].bad)
			continue;
		if (raw_gone ? atomic_load(&w[i].raw_gone) < n
			     : atomic_load(&w[i].forks) < n || atomic_load(&w[i].raw_forks) < n)
			return 0;
	}
	return 1;
}

static void test_fork_race(void **state)
{
	struct kvc *cp = kconnect("t", "race-parent", &model);
	struct worker *w = calloc(RACE_WORKERS, sizeof *w);
	struct ans *ref = xmalloc(sizeof *ref), *a = xmalloc(sizeof *a);
	struct kvc_stats st0, st;
	struct src src;
	long pattends = 0;
	double t0, half;

	assert_non_null(w);
	src_make(&src, 8);
	for (int i = 0; i < RACE_WORKERS; i++) {
		char name[32];

		snprintf(name, sizeof name, "race-%d", i);
		w[i].idx = i;
		w[i].c = kconnect("t", name, &model);
		raw_up(&w[i].x, "t", &w[i].pid);
		w[i].src = &src;
		w[i].ref = ref;
	}
	st0 = stats(cp);
	assert_int_equal(st0.sequences, 0);
	assert_int_equal(st0.bytes, 0);
	race_par = make_parent(cp, &src);
	race_par_id = kvc_seq_id(race_par);
	answer_ok(cp, race_par, &src, ref);
	assert_true(ans_finite(ref));
	atomic_store(&race_stop, 0);
	atomic_store(&race_freeing, 0);
	{
		/* the free must not wait behind a stream of readers */
		pthread_rwlockattr_t ra;

		pthread_rwlockattr_init(&ra);
		pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
		pthread_rwlock_init(&race_lock, &ra);
		pthread_rwlockattr_destroy(&ra);
	}
	atomic_store(&race_freed, 0);

	for (int i = 0; i < RACE_WORKERS; i++)
		assert_int_equal(pthread_create(&w[i].th, NULL, worker_main, &w[i]), 0);
	/* the first half: the parent attended while it is forked; it ends
	 * after RACE_MS / 2 and once every worker forked a few times */
	t0 = now_ms();
	while (now_ms() - t0 < RACE_MS / 2 || !all_did(w, 2, 0)) {
		if (answer(cp, race_par, &src, a))
			fail_msg("attend of the parent: %s", kvc_last_error(cp));
		pattends++;
		if (!ans_same(a, ref)) {
			ans_diff("parent during the race", a, ref);
			fail_msg("the parent's answer changed while it was forked");
		}
		if (now_ms() - t0 > 120000)
			fail_msg("the workers did not fork twice each in 120 s");
	}
	/* the parent goes: kvc forks wait for it (they read its handle), the
	 * raw ones race it */
	pthread_rwlock_wrlock(&race_lock);
	atomic_store(&race_freeing, 1);
	if (kvc_seq_free(cp, race_par))
		fail_msg("free of the parent: %s", kvc_last_error(cp));
	race_par = NULL;
	pthread_rwlock_unlock(&race_lock);
	atomic_store(&race_freed, 1);
	half = now_ms();
	while (now_ms() - half < RACE_MS / 2 || !all_did(w, 1, 1)) {
		daemon_sleep_ms(10);
		if (now_ms() - half > 120000)
			fail_msg("the workers did not fork after the free in 120 s");
	}
	atomic_store(&race_stop, 1);
	for (int i = 0; i < RACE_WORKERS; i++)
		pthread_join(w[i].th, NULL);

	for (int i = 0; i < RACE_WORKERS; i++) {
		print_message("  worker %d: %ld kvc forks attended and freed, %ld raw forks, "
			      "%ld refused after the free; %ld not finite\n", i,
			      (long)atomic_load(&w[i].forks), (long)atomic_load(&w[i].raw_forks),
			      (long)atomic_load(&w[i].raw_gone), w[i].not_finite);
		if (w[i].bad)
			fail_msg("worker %d: %s", i, w[i].why);
		assert_int_equal(w[i].not_finite, 0);
	}
	print_message("  the parent answered %ld times, all alike\n", pattends);
	st = stats(cp);
	assert_int_equal(st.sequences, 0);
	assert_int_equal(st.bytes, 0);
	assert_int_equal(st.used_bytes, st0.used_bytes);
	for (int i = 0; i < RACE_WORKERS; i++) {
		raw_close(&w[i].x);
		kvc_close(w[i].c);
	}
	kvc_close(cp);
	pthread_rwlock_destroy(&race_lock);
	free(w);
	free(ref);
	free(a);
	src_free(&src);
}

/* ==== 8. a storm of forks beside a quiet client ============================ */

#define STORM_ALIVE 16
#define STORM_ROUNDS 4
#define STORM_DECODE 32         /* a child's decode: rows reach kvd's tail */

struct storm {
	volatile int ready, go, done, failed;
	uint64_t b0, b16, bdecoded, bend;
	char msg[512];
};

static int storm_fail(struct storm *sh, struct kvc *c, const char *what)
{
	snprintf(sh->msg, sizeof sh->msg, "attacker: %s: %s", what, c ? kvc_last_error(c) : "");
	sh->failed = 1;
	return 1;
}

/* The attacker: forks its parent STORM_ALIVE times, then frees the
 * children, STORM_ROUNDS times; in the second round each child decodes
 * STORM_DECODE tokens first (so it copies its tails).  ServerStats bytes before, with
 * the first round's children alive, with the decoded ones alive, after. */
static int storm_main(struct storm *sh)
{
	struct kvc_opts o = { .socket_path = D_.sock, .tenant = "t", .name = "storm",
			      .slots = 8, .slot_size = 1 << 20 };
	struct kvc_seq *par, *ch[STORM_ALIVE];
	struct kvc_stats st;
	struct kvc *c;
	struct src src;

	if (kvc_connect(&o, &c) || kvc_profile(c, &model))
		return storm_fail(sh, c, "connect");
	src_make(&src, 9);
	if (kvc_seq_create(c, &par) || prefill_layers(c, par, &src, P_TOK, 0, LAYERS) ||
	    feed(c, par, &src, P_TOK, H_TOK))
		return storm_fail(sh, c, "parent");
	sh->ready = 1;
	while (!sh->go && !sh->failed)
		daemon_sleep_ms(1);
	/* the quiet client's sequence is made by now: nothing else changes */
	if (kvc_server_stats(c, &st))
		return storm_fail(sh, c, "stats");
	sh->b0 = st.bytes;
	for (int r = 0; r < STORM_ROUNDS; r++) {
		for (int i = 0; i < STORM_ALIVE; i++) {
			if (kvc_seq_fork(c, par, &ch[i]))
				return storm_fail(sh, c, "fork");
			if (r == 1 && feed(c, ch[i], &src, P_TOK + H_TOK, STORM_DECODE))
				return storm_fail(sh, c, "child's decode");
		}
		if (kvc_server_stats(c, &st))
			return storm_fail(sh, c, "stats");
		if (r == 0)
			sh->b16 = st.bytes;
		if (r == 1)
			sh->bdecoded = st.bytes;
		for (int i = 0; i < STORM_ALIVE; i++)
			if (kvc_seq_free(c, ch[i]))
				return storm_fail(sh, c, "free");
	}
	if (kvc_server_stats(c, &st))
		return storm_fail(sh, c, "stats");
	sh->bend = st.bytes;
	if (kvc_seq_free(c, par))
		return storm_fail(sh, c, "free of the parent");
	kvc_close(c);
	src_free(&src);
	return 0;
}

static void test_fork_storm(void **state)
{
	struct storm *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
				MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	struct ans ref, a;
	struct src src;
	struct kvc *v;
	struct kvc_seq *s;
	long attends = 0;
	pid_t kid;
	int st;

	assert_true(sh != MAP_FAILED);
	memset(sh, 0, sizeof *sh);
	kid = fork();
	assert_true(kid >= 0);
	if (kid == 0)
		_exit(storm_main(sh));
	v = kconnect("quiet", "storm-victim", &model);
	src_make(&src, 10);
	s = make_parent(v, &src);
	answer_ok(v, s, &src, &ref);
	while (!sh->ready && !sh->failed)
		daemon_sleep_ms(1);
	sh->go = 1;
	for (;;) {
		int done = waitpid(kid, &st, WNOHANG) == kid;

		answer_ok(v, s, &src, &a);
		attends++;
		expect_same("the quiet client during the forks", &a, &ref);
		if (done)
			break;
	}
	if (!WIFEXITED(st) || WEXITSTATUS(st) || sh->failed)
		fail_msg("%s", sh->failed ? sh->msg : "attacker died");
	print_message("  bytes: before %llu, +16 forks %llu, +16 decoded %llu; %ld quiet attends\n",
		      (unsigned long long)sh->b0, (unsigned long long)(sh->b16 - sh->b0),
		      (unsigned long long)(sh->bdecoded - sh->b0), attends);
	/* sixteen forks share the parent's tails (2 sparse layers of 96 rows
	 * in a 256-row buffer): together they cost less than one layer's
	 * tail; copied, they were 32 tails */
	assert_true(sh->b16 > sh->b0);
	assert_true(sh->b16 - sh->b0 < TAIL_KV);
	/* a child that decodes copies its own tails, nobody else's */
	assert_true(sh->bdecoded - sh->b0 >= STORM_ALIVE * (LAYERS - 1) * TAIL_KV);
	assert_true(sh->bdecoded - sh->b0 < STORM_ALIVE * (LAYERS - 1) * 2 * TAIL_KV);
	assert_int_equal(sh->bend, sh->b0);
	assert_int_equal(kvc_seq_free(v, s), 0);
	assert_int_equal(stats(v).bytes, 0);
	kvc_close(v);
	src_free(&src);
	munmap(sh, sizeof *sh);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_fork_matches_parent, start, stop),
		cmocka_unit_test_setup_teardown(test_fork_diverges_like_private, start, stop),
		cmocka_unit_test_setup_teardown(test_fork_between_layers, start, stop),
		cmocka_unit_test_setup_teardown(test_fork_free_order, start, stop),
		cmocka_unit_test_setup_teardown(test_fork_errors, start, stop),
		cmocka_unit_test_setup_teardown(test_fork_tier, start_spill, stop),
		cmocka_unit_test_setup_teardown(test_fork_hybrid, start, stop),
		cmocka_unit_test_setup_teardown(test_fork_storm, start, stop),
		cmocka_unit_test_setup_teardown(test_fork_race, start, stop),
	};

	signal(SIGPIPE, SIG_IGN);
	if (getenv("KVD_TEST_FILTER"))
		cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
