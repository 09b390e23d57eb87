/* kvd_tier's policy without the daemon: a store with kvd_limits (as the
 * daemon has), the tier over the spill engine's fake backend in a temporary
 * directory, and the calls the executor makes (kvd_tier_begin per request,
 * kvd_tier_want before a layer is used, rows through kvd_store_rows, which
 * asks kvd_tier_room).  What tier.h promises:
 *
 *  - room beyond the limit evicts the least recently used sequences, never
 *    one the current request touched, and the request waits (-EINPROGRESS)
 *    for the write-back; a file that is current is dropped at once;
 *  - above the high watermark the coldest are written out until used is at
 *    or below the low one;
 *  - a restore brings the layers back in order, reserving its room first,
 *    and the data comes back bit for bit;
 *  - -ENOMEM with a message when nothing can go (no spill, only the current
 *    request's sequences, a prefill in progress), and -KVD_ELOST after a
 *    restore that does not verify;
 *  - a wait, not a refusal, while a restore is in flight; the room that
 *    comes goes to the entries in the order they began to wait, and a
 *    restored sequence to the request that restored it;
 *  - every byte charged comes back when the sequences are freed, and their
 *    files go. */
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/clock.h"
#include "engine/err.h"
#include "engine/pool.h"
#include "engine/rng.h"
#include "kvd/store/store.h"
#include "testutil.h"
#include "kvd/store/tier.h"
#include "kvd/store/uidlimits.h"

#define KV 2
#define D 16
#define KB 4
#define LT 8
#define LAYERS 4                /* layer 0 is dense */
#define SEAL 64
#define TOK 300                 /* prefilled per sparse layer: segments of 256 and 44 */
#define TAIL 10                 /* appended after the prefill */
#define UID 1000
#define MAXSEG 8

static struct kvd_pool *pool;
static char root[64];
static unsigned ndirs;
static uint8_t dense[LAYERS] = { 1, 0, 0, 0 };

struct env {
	struct kvd_limits *l;
	struct kvd_store *s;
	struct kvd_tier *t;
	const struct kvd_profile *p;
	char dir[96];
};

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint64_t env_mem_per_uid;        /* [limits] memory_per_uid of the next env_open */
static uint64_t env_poll_ns;            /* the tier's poll budget of the next env_open */
static int env_persist;                 /* the tier's persist of the next env_open */

static void env_open(struct env *e, uint64_t limit, uint64_t high, uint64_t low, int spill,
		     const char *fault)
{
	struct kvd_limits_cfg lc;
	struct kvd_tier_cfg tc;
	struct kvd_profile want;
	char msg[200];

	memset(e, 0, sizeof *e);
	memset(&lc, 0, sizeof lc);
	lc.cap[KVD_RES_MEMORY] = limit;         /* the wall is the budget, as in kvd */
	lc.per_uid[KVD_RES_MEMORY] = env_mem_per_uid;
	lc.cap[KVD_RES_SEQUENCES] = 1024;
	lc.cap[KVD_RES_PROFILES] = 16;
	assert_int_equal(kvd_limits_create(&lc, &e->l), 0);
	assert_int_equal(kvd_store_create(pool, &e->s), 0);
	assert_int_equal(kvd_store_set_limits(e->s, e->l), 0);

	snprintf(e->dir, sizeof e->dir, "%s/d%u", root, ndirs++);
	memset(&tc, 0, sizeof tc);
	tc.limit = limit;
	tc.high = high;
	tc.low = low;
	tc.spill = spill;
	tc.io.dirs[0] = e->dir;
	tc.io.ndirs = 1;
	tc.io.fault = fault;                    /* the fake backend: no io_uring needed */
	tc.poll_ns = env_poll_ns;
	tc.persist = env_persist;
	assert_int_equal(kvd_tier_create(&tc, e->s, &e->t), 0);

	memset(&want, 0, sizeof want);
	snprintf(want.name, sizeof want.name, "tier-policy");
	want.g = (struct kvd_geom){ 4, KV, D, KB, LT, 2, KVD_KV_BF16, 0 };
	want.layers = LAYERS;
	want.sink = 4;
	want.window = 64;
	want.seg_tokens = 256;
	want.seal_tokens = SEAL;
	want.seed = 3;
	want.dense = dense;
	assert_int_equal(kvd_store_profile_ns(e->s, kvd_limits_namespace(e->l, UID), UID, &want,
					      &e->p, msg, sizeof msg), 0);
}

static uint64_t used(const struct env *e)
{
	struct kvd_tier_stats st;

	kvd_tier_stats(e->t, &st);
	return st.used;
}

static struct kvd_tier_stats stats(const struct env *e)
{
	struct kvd_tier_stats st;

	kvd_tier_stats(e->t, &st);
	return st;
}

/* Waits up to 100 ms for I/O results and reaps them. */
static unsigned pump(struct env *e)
{
	struct pollfd pfd = { .fd = kvd_tier_fd(e->t), .events = POLLIN };

	if (pfd.fd >= 0)
		poll(&pfd, 1, 100);
	return kvd_tier_poll(e->t);
}

#define WAIT_UNTIL(e, cond) do {						\
		uint64_t t_end_ = now_ms() + 20000;				\
		while (!(cond)) {						\
			if (now_ms() > t_end_)					\
				fail_msg("timed out waiting for %s", #cond);	\
			pump(e);						\
		}								\
	} while (0)

static unsigned files(const struct env *e)
{
	DIR *d = opendir(e->dir);
	struct dirent *de;
	unsigned n = 0;

	if (!d)
		return 0;
	while ((de = readdir(d)))
		n += strstr(de->d_name, ".kvs") != NULL;
	closedir(d);
	return n;
}

static void count_seq(void *arg, struct kvd_seqn *q)
{
	(*(unsigned *)arg)++;
}

static unsigned sequences(struct env *e)
{
	unsigned n = 0;

	kvd_store_each(e->s, count_seq, &n);
	return n;
}

static void free_one(void *arg, struct kvd_seqn *q)
{
	struct env *e = arg;

	if (kvd_store_seq_tenant(q)[0]) /* not one already being freed */
		kvd_tier_free(e->t, q);
}

/* Frees every sequence and the profile: every byte charged comes back,
 * and the files go. */
static void env_close(struct env *e)
{
	struct kvd_limits_usage u;

	kvd_store_each(e->s, free_one, e);
	WAIT_UNTIL(e, sequences(e) == 0);
	kvd_limits_total(e->l, &u);
	assert_int_equal(u.n[KVD_RES_MEMORY], kvd_store_profile_bytes(e->p));
	assert_int_equal(u.n[KVD_RES_SPILL], 0);
	assert_int_equal(stats(e).reserved, 0);
	kvd_store_profile_unref(e->s, e->p);
	kvd_limits_total(e->l, &u);
	assert_int_equal(u.n[KVD_RES_MEMORY], 0);
	assert_int_equal(used(e), 0);
	WAIT_UNTIL(e, files(e) == 0);
	kvd_tier_destroy(e->t);
	kvd_store_destroy(e->s);
	assert_int_equal(kvd_limits_uids(e->l), 0);
	kvd_limits_destroy(e->l);
	rmdir(e->dir);
}

/* ---- sequences ---------------------------------------------------------- */

/* Rows of layer ly as the executor would put them: the layer wanted first,
 * then the rows; both may say "wait for I/O" (-EINPROGRESS), and then the
 * request runs again.  *waits counts those. */
static int rows(struct env *e, struct kvd_seqn *q, uint32_t ly, int is_append, int last,
		uint32_t n, uint64_t seed, unsigned *waits, char *msg, size_t msglen)
{
	struct kvd_rng r = kvd_rng_make(seed);
	float mean[KV * D];
	uint16_t *k = xmalloc((size_t)KV * n * D * 2), *v = xmalloc((size_t)KV * n * D * 2);
	uint16_t *c = xmalloc((size_t)KV * LT * n * 2);
	uint64_t t_end = now_ms() + 20000;
	int rc;

	fill_normal(mean, KV * D, &r, 0, 0.1);
	fill_bf16(k, (size_t)KV * n * D, &r, 0, 1);
	fill_bf16(v, (size_t)KV * n * D, &r, 0, 1);
	for (size_t i = 0; i < (size_t)KV * LT * n; i++)
		c[i] = (uint16_t)kvd_rng_below(&r, 1u << KB);
	for (;;) {
		rc = kvd_tier_want(e->t, q, ly, msg, msglen);
		if (!rc)
			rc = kvd_store_rows(e->s, q, ly, is_append, last,
					    is_append || kvd_store_layer_mean(q, ly) ? NULL : mean, k, v, c, n,
					    msg, msglen);
		if (rc != -EINPROGRESS)
			break;
		if (waits)
			(*waits)++;
		if (now_ms() > t_end)
			fail_msg("rows of layer %u still waiting", ly);
		pump(e);
	}
	if (!rc)
		kvd_tier_changed(e->t, q);
	free(k);
	free(v);
	free(c);
	return rc;
}

/* A new sequence with TOK prefilled and TAIL appended tokens in every
 * sparse layer, as one request. */
static struct kvd_seqn *seq_full_uid(struct env *e, uint32_t uid, uint64_t seed, unsigned *waits)
{
	struct kvd_seqn *q;
	char msg[200], tenant[32];
	int rc;

	snprintf(tenant, sizeof tenant, "%u:t", uid);
	kvd_tier_begin(e->t);
	assert_int_equal(kvd_store_seq_create_uid(e->s, e->p, uid, tenant, 1, &q, msg, sizeof msg),
			 0);
	for (uint32_t ly = 1; ly < LAYERS; ly++) {
		if ((rc = rows(e, q, ly, 0, 1, TOK, seed * 100 + ly, waits, msg, sizeof msg)) ||
		    (rc = rows(e, q, ly, 1, 0, TAIL, seed * 100 + 50 + ly, waits, msg, sizeof msg)))
			fail_msg("sequence %llu layer %u: %d %s", (unsigned long long)seed, ly, rc, msg);
	}
	return q;
}

static struct kvd_seqn *seq_full(struct env *e, uint64_t seed, unsigned *waits)
{
	return seq_full_uid(e, UID, seed, waits);
}

/* One request using q (marks it most recently used). */
static void touch(struct env *e, struct kvd_seqn *q)
{
	char msg[200];

	kvd_tier_begin(e->t);
	assert_int_equal(kvd_tier_want(e->t, q, 1, msg, sizeof msg), 0);
}

/* Until every layer of q is resident again, as requests that wait. */
static void restore(struct env *e, struct kvd_seqn *q)
{
	char msg[200];
	int rc;

	WAIT_UNTIL(e, (rc = kvd_tier_want(e->t, q, UINT32_MAX, msg, sizeof msg)) != -EINPROGRESS);
	if (rc)
		fail_msg("restore: %d %s", rc, msg);
	assert_int_equal(kvd_store_seq_state(q), KVD_SEQ_RAM);
}

static uint64_t tokens_of(const struct kvd_seqn *q)
{
	uint64_t tokens;
	uint32_t segs;

	kvd_store_seq_stats(q, &tokens, &segs);
	return tokens;
}

/* What a sequence holds, to compare after a round trip through the disk. */
struct snap {
	size_t bytes;
	uint64_t tokens[LAYERS];
	uint32_t nseg[LAYERS], tn[LAYERS];
	void *seg[LAYERS][MAXSEG];
	size_t segb[LAYERS][MAXSEG];
	uint16_t tk[LAYERS][KV * SEAL * D], tv[LAYERS][KV * SEAL * D], tc[LAYERS][KV * LT * SEAL];
	float mean[LAYERS][KV * D];
};

static void snap_take(const struct kvd_seqn *q, struct snap *s)
{
	memset(s, 0, sizeof *s);
	s->bytes = kvd_store_seq_bytes(q);
	for (uint32_t ly = 1; ly < LAYERS; ly++) {
		struct kvd_layer_view lv = kvd_store_view(q, ly);
		const float *mean = kvd_store_layer_mean(q, ly);

		assert_true(lv.nseg <= MAXSEG);
		s->tokens[ly] = kvd_store_layer_tokens(q, ly);
		s->nseg[ly] = lv.nseg;
		s->tn[ly] = lv.tail_n;
		for (uint32_t j = 0; j < lv.nseg; j++) {
			s->segb[ly][j] = kvd_seg_bytes(&kvd_store_seq_profile(q)->g, lv.seg[j]->n);
			s->seg[ly][j] = xmalloc(s->segb[ly][j]);
			memcpy(s->seg[ly][j], lv.seg[j]->mem, s->segb[ly][j]);
		}
		assert_non_null(mean);
		memcpy(s->mean[ly], mean, sizeof s->mean[ly]);
		assert_int_equal(lv.tail_cap, SEAL);
		memcpy(s->tk[ly], lv.tail_k, sizeof s->tk[ly]);
		memcpy(s->tv[ly], lv.tail_v, sizeof s->tv[ly]);
		assert_non_null(kvd_store_layer_tail_codes(q, ly));
		memcpy(s->tc[ly], kvd_store_layer_tail_codes(q, ly), sizeof s->tc[ly]);
	}
}

/* Layer ly of q holds what s recorded: every segment byte for byte, the
 * tail's rows and codes, the mean, the token count. */
static void snap_layer_equal(const struct kvd_seqn *q, const struct snap *s, uint32_t ly)
{
	struct kvd_layer_view lv = kvd_store_view(q, ly);
	const float *mean = kvd_store_layer_mean(q, ly);
	const uint16_t *tc = kvd_store_layer_tail_codes(q, ly);

	assert_int_equal(kvd_store_layer_tokens(q, ly), s->tokens[ly]);
	assert_int_equal(lv.nseg, s->nseg[ly]);
	assert_int_equal(lv.tail_n, s->tn[ly]);
	for (uint32_t j = 0; j < lv.nseg; j++) {
		assert_int_equal(kvd_seg_bytes(&kvd_store_seq_profile(q)->g, lv.seg[j]->n), s->segb[ly][j]);
		assert_memory_equal(lv.seg[j]->mem, s->seg[ly][j], s->segb[ly][j]);
	}
	assert_non_null(mean);
	assert_memory_equal(mean, s->mean[ly], sizeof s->mean[ly]);
	for (uint32_t h = 0; h < KV; h++) {
		size_t o = (size_t)h * SEAL * D;

		assert_memory_equal(lv.tail_k + o, s->tk[ly] + o, (size_t)lv.tail_n * D * 2);
		assert_memory_equal(lv.tail_v + o, s->tv[ly] + o, (size_t)lv.tail_n * D * 2);
		for (uint32_t t = 0; t < LT; t++)
			assert_memory_equal(tc + (h * LT + t) * SEAL,
					    s->tc[ly] + (h * LT + t) * SEAL, (size_t)lv.tail_n * 2);
	}
}

static void snap_equal(const struct kvd_seqn *q, const struct snap *s)
{
	for (uint32_t ly = 1; ly < LAYERS; ly++)
		snap_layer_equal(q, s, ly);
	assert_int_equal(kvd_store_seq_bytes(q), s->bytes);
}

static void snap_free(struct snap *s)
{
	for (uint32_t ly = 0; ly < LAYERS; ly++)
		for (uint32_t j = 0; j < MAXSEG; j++)
			free(s->seg[ly][j]);
}

/* The budget a profile takes (base) and one sequence (per), measured. */
static void measure(uint64_t *base, uint64_t *per)
{
	struct env e;

	env_open(&e, 0, 0, 0, 0, NULL);
	*base = used(&e);
	seq_full(&e, 1, NULL);
	*per = used(&e) - *base;
	env_close(&e);
}

/* ---- the tests ---------------------------------------------------------- */

/* Room beyond the limit: the coldest sequence is written out and dropped,
 * the request waits for it; a restore makes room the same way. */
static void test_evicts_coldest_first(void **state)
{
	uint64_t base, per, limit;
	struct kvd_seqn *q[4];
	struct snap *s1 = xmalloc(sizeof *s1);
	unsigned waits = 0;
	struct env e;

	measure(&base, &per);
	print_message("  profile %llu bytes, sequence %llu bytes\n", (unsigned long long)base,
		      (unsigned long long)per);
	limit = base + 4 * per - 1;             /* three fit, not four */
	env_open(&e, limit, limit, limit, 1, "");
	for (int i = 0; i < 3; i++)
		q[i] = seq_full(&e, 10 + (uint64_t)i, &waits);
	assert_int_equal(waits, 0);
	assert_int_equal(used(&e), base + 3 * per);
	snap_take(q[1], s1);
	/* coldest first: q1, q0, q2 */
	touch(&e, q[1]);
	touch(&e, q[0]);
	touch(&e, q[2]);

	q[3] = seq_full(&e, 13, &waits);
	assert_true(waits > 0);                 /* it waited for the write-back */
	assert_int_equal(kvd_store_seq_state(q[1]), KVD_SEQ_DISK);
	assert_int_equal(kvd_store_seq_bytes(q[1]), 0);
	assert_int_equal(tokens_of(q[1]), TOK + TAIL);
	assert_int_equal(kvd_store_seq_state(q[0]), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(q[2]), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(q[3]), KVD_SEQ_RAM);
	assert_int_equal(stats(&e).spills, 1);
	assert_int_equal(stats(&e).on_disk, 1);
	/* q1 keeps only its struct and record */
	assert_true(used(&e) <= limit);
	assert_true(used(&e) > base + 3 * per && used(&e) < base + 3 * per + per / 8);
	assert_int_equal(files(&e), 1);

	/* q1 comes back: now q0 is the coldest and makes the room */
	kvd_tier_begin(e.t);
	restore(&e, q[1]);
	snap_equal(q[1], s1);
	assert_int_equal(kvd_store_seq_state(q[0]), KVD_SEQ_DISK);
	assert_int_equal(kvd_store_seq_state(q[2]), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(q[3]), KVD_SEQ_RAM);
	assert_int_equal(stats(&e).spills, 2);
	assert_int_equal(stats(&e).restores, 1);
	assert_int_equal(stats(&e).reserved, 0);
	assert_true(used(&e) <= limit);
	assert_true(used(&e) > base + 3 * per && used(&e) < base + 3 * per + per / 8);
	snap_free(s1);
	free(s1);
	env_close(&e);
}

/* Above the high watermark, kvd_tier_balance writes the coldest out until
 * used, minus what is being written, is at or below the low watermark;
 * never those the current request uses. */
static void test_watermarks(void **state)
{
	uint64_t base, per, high, low;
	struct kvd_seqn *q[5];
	struct env e;

	measure(&base, &per);
	high = base + 7 * per / 2;
	low = base + 5 * per / 2;
	env_open(&e, base + 10 * per, high, low, 1, "");
	for (int i = 0; i < 5; i++)
		q[i] = seq_full(&e, 20 + (uint64_t)i, NULL);
	/* coldest first: q2, q0, q3, q1, q4 */
	touch(&e, q[2]);
	touch(&e, q[0]);
	touch(&e, q[3]);
	touch(&e, q[1]);
	touch(&e, q[4]);
	kvd_tier_begin(e.t);
	kvd_tier_balance(e.t);
	/* 5 resident, low at 2.5: the three coldest go */
	assert_int_equal(kvd_store_seq_state(q[2]), KVD_SEQ_SPILLING);
	assert_int_equal(kvd_store_seq_state(q[0]), KVD_SEQ_SPILLING);
	assert_int_equal(kvd_store_seq_state(q[3]), KVD_SEQ_SPILLING);
	assert_int_equal(kvd_store_seq_state(q[1]), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(q[4]), KVD_SEQ_RAM);
	WAIT_UNTIL(&e, kvd_store_seq_state(q[2]) == KVD_SEQ_DISK &&
		       kvd_store_seq_state(q[0]) == KVD_SEQ_DISK &&
		       kvd_store_seq_state(q[3]) == KVD_SEQ_DISK);
	assert_true(used(&e) <= low);
	assert_true(used(&e) > base + 2 * per);
	assert_int_equal(stats(&e).spills, 3);
	assert_int_equal(stats(&e).on_disk, 3);
	/* below the high watermark nothing more happens */
	kvd_tier_begin(e.t);
	kvd_tier_balance(e.t);
	assert_int_equal(kvd_store_seq_state(q[1]), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(q[4]), KVD_SEQ_RAM);

	/* one request brings the three back, above the high watermark again;
	 * balancing now may take only the two it did not use, and stops there
	 * although used stays above low */
	kvd_tier_begin(e.t);
	restore(&e, q[2]);
	restore(&e, q[0]);
	restore(&e, q[3]);
	assert_true(used(&e) > high);
	kvd_tier_balance(e.t);
	assert_int_equal(kvd_store_seq_state(q[1]), KVD_SEQ_SPILLING);
	assert_int_equal(kvd_store_seq_state(q[4]), KVD_SEQ_SPILLING);
	assert_int_equal(kvd_store_seq_state(q[2]), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(q[0]), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(q[3]), KVD_SEQ_RAM);
	WAIT_UNTIL(&e, kvd_store_seq_state(q[1]) == KVD_SEQ_DISK &&
		       kvd_store_seq_state(q[4]) == KVD_SEQ_DISK);
	assert_true(used(&e) > low);
	assert_int_equal(stats(&e).spills, 5);
	assert_int_equal(stats(&e).restores, 3);
	assert_int_equal(stats(&e).drops, 0);
	env_close(&e);
}

/* A restore: the room reserved first, the layers in file order (dense
 * layer 0 needs nothing), each complete before it is served, and the data
 * bit for bit.  Evicting again while the file is current only drops; a
 * change makes the file stale and the next eviction writes again. */
static void test_restore_in_order(void **state)
{
	struct snap *s = xmalloc(sizeof *s);
	struct kvd_seqn *q;
	uint64_t used0, last;
	char msg[200], seen[64];
	size_t ns = 0;
	struct env e;
	int rc;

	env_open(&e, 0, 0, 0, 1, "");
	q = seq_full(&e, 30, NULL);
	snap_take(q, s);
	used0 = used(&e);
	assert_int_equal(kvd_tier_evict(e.t, q, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_state(q), KVD_SEQ_SPILLING);
	WAIT_UNTIL(&e, kvd_store_seq_state(q) == KVD_SEQ_DISK);
	assert_int_equal(kvd_store_seq_bytes(q), 0);
	assert_int_equal(tokens_of(q), TOK + TAIL);
	assert_int_equal(used(&e), used0 - s->bytes);

	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_want(e.t, q, 1, msg, sizeof msg), -EINPROGRESS);
	assert_int_equal(kvd_store_seq_state(q), KVD_SEQ_RESTORING);
	/* nothing reaped yet: the room is reserved, layer 0 (dense) usable */
	assert_int_equal(kvd_store_seq_ready_layers(q), 1);
	assert_true(stats(&e).reserved >= s->bytes);
	assert_true(used(&e) >= used0);
	assert_int_equal(kvd_tier_want(e.t, q, 0, msg, sizeof msg), 0);
	assert_int_equal(kvd_tier_want(e.t, q, LAYERS - 1, msg, sizeof msg), -EINPROGRESS);
	last = kvd_store_seq_ready_layers(q);
	seen[ns++] = (char)('0' + kvd_store_seq_ready_layers(q));
	/* reaped as soon as posted, without waiting, to catch the layers
	 * arriving one by one */
	for (uint64_t t_end = now_ms() + 20000; kvd_store_seq_state(q) == KVD_SEQ_RESTORING;) {
		if (now_ms() > t_end)
			fail_msg("restore did not end");
		if (!kvd_tier_poll(e.t)) {
			sched_yield();
			continue;
		}
		assert_true(kvd_store_seq_ready_layers(q) >= last);
		if (kvd_store_seq_ready_layers(q) != last && ns < sizeof seen - 1)
			seen[ns++] = (char)('0' + kvd_store_seq_ready_layers(q));
		last = kvd_store_seq_ready_layers(q);
		if (kvd_store_seq_state(q) != KVD_SEQ_RESTORING)
			break;
		for (uint32_t ly = 1; ly < LAYERS; ly++) {
			rc = kvd_tier_want(e.t, q, ly, msg, sizeof msg);
			if (ly < kvd_store_seq_ready_layers(q)) {
				assert_int_equal(rc, 0);
				snap_layer_equal(q, s, ly);
			} else {
				assert_int_equal(rc, -EINPROGRESS);
			}
		}
	}
	seen[ns] = 0;
	print_message("  layers ready as the restore went: %s\n", seen);
	assert_int_equal(kvd_store_seq_state(q), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_ready_layers(q), LAYERS);
	assert_int_equal(stats(&e).reserved, 0);
	assert_int_equal(stats(&e).restores, 1);
	snap_equal(q, s);
	assert_int_equal(used(&e), used0);

	/* its file is current: evicting again drops it at once */
	assert_int_equal(kvd_tier_evict(e.t, q, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_state(q), KVD_SEQ_DISK);
	assert_int_equal(kvd_store_seq_bytes(q), 0);
	assert_int_equal(stats(&e).drops, 1);
	assert_int_equal(stats(&e).spills, 1);
	kvd_tier_begin(e.t);
	restore(&e, q);
	snap_equal(q, s);

	/* a token more: the file is stale, goes, and the next eviction writes */
	assert_int_equal(rows(&e, q, 2, 1, 0, 1, 99, NULL, msg, sizeof msg), 0);
	{
		int durable;
		uint64_t disk;

		kvd_tier_seq_info(e.t, q, &durable, &disk);
		assert_int_equal(durable, 0);
	}
	WAIT_UNTIL(&e, (rc = kvd_tier_evict(e.t, q, msg, sizeof msg)) != -EAGAIN);
	assert_int_equal(rc, 0);
	assert_int_equal(kvd_store_seq_state(q), KVD_SEQ_SPILLING);
	WAIT_UNTIL(&e, kvd_store_seq_state(q) == KVD_SEQ_DISK);
	assert_int_equal(stats(&e).spills, 2);
	assert_int_equal(stats(&e).drops, 1);
	assert_int_equal(tokens_of(q), TOK + TAIL + 1);
	snap_free(s);
	free(s);
	env_close(&e);
}

/* Nothing can be evicted: -ENOMEM with the budget in the message, and
 * nothing changed by the refused request. */
static void test_refused_when_nothing_can_go(void **state)
{
	uint64_t base, per, limit, need;
	struct kvd_seqn *q0, *q1;
	char msg[200];
	size_t bytes;
	struct env e;
	int rc;

	measure(&base, &per);
	limit = base + 3 * per / 2;

	/* no spill directory: the budget is a wall */
	env_open(&e, limit, limit, limit, 0, NULL);
	q0 = seq_full(&e, 40, NULL);
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_store_seq_create_uid(e.s, e.p, UID, "1000:t", 1, &q1, msg, sizeof msg), 0);
	rc = 0;
	for (uint32_t ly = 1; ly < LAYERS && !rc; ly++) {
		bytes = kvd_store_seq_bytes(q1);
		rc = rows(&e, q1, ly, 0, 1, TOK, 41, NULL, msg, sizeof msg);
	}
	assert_int_equal(rc, -ENOMEM);
	assert_non_null(strstr(msg, "memory budget"));
	assert_int_equal(kvd_store_seq_bytes(q1), bytes);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_RAM);
	assert_true(used(&e) <= limit);
	assert_int_equal(kvd_tier_evict(e.t, q0, msg, sizeof msg), -EOPNOTSUPP);
	assert_non_null(strstr(msg, "no spill directory"));
	kvd_tier_begin(e.t);
	msg[0] = 0;
	assert_int_equal(kvd_tier_room(e.t, per, msg, sizeof msg), -ENOMEM);
	assert_non_null(strstr(msg, "memory budget"));
	env_close(&e);

	/* the only candidate is in the current request */
	env_open(&e, limit, limit, limit, 1, "");
	q0 = seq_full(&e, 42, NULL);
	touch(&e, q0);
	msg[0] = 0;
	assert_int_equal(kvd_tier_room(e.t, per, msg, sizeof msg), -ENOMEM);
	assert_non_null(strstr(msg, "memory budget"));
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_RAM);
	assert_int_equal(stats(&e).spills, 0);
	/* the next request may evict it: wait for the write, then room */
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_room(e.t, per, msg, sizeof msg), -EINPROGRESS);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_SPILLING);
	WAIT_UNTIL(&e, (rc = kvd_tier_room(e.t, per, msg, sizeof msg)) != -EINPROGRESS);
	assert_int_equal(rc, 0);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_DISK);

	/* a restore that does not fit beside the current request's sequence
	 * is refused before it starts */
	q1 = seq_full(&e, 43, NULL);
	touch(&e, q1);
	msg[0] = 0;
	assert_int_equal(kvd_tier_want(e.t, q0, 1, msg, sizeof msg), -ENOMEM);
	assert_non_null(strstr(msg, "memory budget"));
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_DISK);
	assert_int_equal(stats(&e).reserved, 0);
	/* in a new request q1 goes and q0 comes back */
	kvd_tier_begin(e.t);
	restore(&e, q0);
	assert_int_equal(kvd_store_seq_state(q1), KVD_SEQ_DISK);
	env_close(&e);

	/* a sequence with a prefill in progress cannot be written out */
	env_open(&e, limit, limit, limit, 1, "");
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_store_seq_create_uid(e.s, e.p, UID, "1000:t", 1, &q0, msg, sizeof msg), 0);
	assert_int_equal(rows(&e, q0, 1, 0, 0, TOK, 44, NULL, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_spillable(q0), 0);
	kvd_tier_begin(e.t);
	msg[0] = 0;
	assert_int_equal(kvd_tier_evict(e.t, q0, msg, sizeof msg), -EBUSY);
	assert_non_null(strstr(msg, "prefill is in progress"));
	assert_int_equal(kvd_tier_room(e.t, limit - used(&e) + 1, msg, sizeof msg), -ENOMEM);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_RAM);
	/* its last chunk makes it spillable */
	assert_int_equal(rows(&e, q0, 1, 0, 1, 0, 45, NULL, msg, sizeof msg), 0);
	kvd_tier_begin(e.t);
	need = limit - used(&e) + 1;
	WAIT_UNTIL(&e, (rc = kvd_tier_room(e.t, need, msg, sizeof msg)) != -EINPROGRESS);
	assert_int_equal(rc, 0);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_DISK);
	env_close(&e);
}

/* A restore that does not verify (every read corrupted) leaves the
 * sequence LOST: every use fails -KVD_ELOST, nothing stays reserved. */
static void test_lost(void **state)
{
	struct kvd_seqn *q;
	char msg[200];
	struct env e;

	env_open(&e, 0, 0, 0, 1, "corrupt@*");
	q = seq_full(&e, 50, NULL);
	assert_int_equal(kvd_tier_evict(e.t, q, msg, sizeof msg), 0);
	WAIT_UNTIL(&e, kvd_store_seq_state(q) == KVD_SEQ_DISK);
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_want(e.t, q, 1, msg, sizeof msg), -EINPROGRESS);
	WAIT_UNTIL(&e, kvd_store_seq_state(q) == KVD_SEQ_LOST);
	WAIT_UNTIL(&e, stats(&e).reserved == 0);
	msg[0] = 0;
	assert_int_equal(kvd_tier_want(e.t, q, 1, msg, sizeof msg), -KVD_ELOST);
	assert_non_null(strstr(msg, "sequence lost, prefill again"));
	assert_int_equal(kvd_tier_prefetch(e.t, q, msg, sizeof msg), -KVD_ELOST);
	assert_int_equal(kvd_store_seq_bytes(q), 0);
	assert_int_equal(stats(&e).lost, 1);
	assert_int_equal(stats(&e).restores, 0);
	env_close(&e);
}

/* Under memory_per_uid a uid's own coldest sequence makes room for it (as
 * the global budget does with anyone's), not another uid's, and not by a
 * refusal: with room for two, a third sequence of the uid writes the first
 * out, and bringing the first back writes the second out.  Without a
 * spill tier the same request is refused with the limit's message. */
static void test_uid_share_evicts_own(void **state)
{
	uint64_t base, per;
	struct kvd_seqn *a, *b, *c, *d;
	unsigned waits = 0;
	struct kvd_limits_usage u;
	char msg[200];
	struct env e;

	measure(&base, &per);
	env_mem_per_uid = 2 * per + per / 2;
	env_open(&e, 0, 0, 0, 1, "");
	a = seq_full(&e, 60, NULL);
	b = seq_full(&e, 61, NULL);
	c = seq_full_uid(&e, 2000, 62, NULL);
	d = seq_full(&e, 63, &waits);
	print_message("  the third sequence of uid %u waited %u times for its first to be written out\n",
		      UID, waits);
	assert_true(waits > 0);
	assert_int_equal(kvd_store_seq_state(a), KVD_SEQ_DISK);
	assert_int_equal(kvd_store_seq_state(b), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(c), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(d), KVD_SEQ_RAM);
	kvd_limits_uid_usage(e.l, UID, &u);
	assert_true(u.n[KVD_RES_MEMORY] <= env_mem_per_uid);
	/* a comes back; b, now the uid's coldest, goes */
	kvd_tier_begin(e.t);
	restore(&e, a);
	assert_int_equal(kvd_store_seq_state(b), KVD_SEQ_DISK);
	assert_int_equal(kvd_store_seq_state(c), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(d), KVD_SEQ_RAM);
	/* more than the uid may ever hold: refused at once, its sequences
	 * stay */
	kvd_tier_begin(e.t);
	msg[0] = 0;
	assert_int_equal(kvd_tier_room_uid(e.t, UID, env_mem_per_uid + 1, msg, sizeof msg), -EDQUOT);
	assert_non_null(strstr(msg, "memory_per_uid"));
	assert_int_equal(kvd_store_seq_state(a), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_state(d), KVD_SEQ_RAM);
	env_close(&e);

	/* no spill tier: refused, naming the limit */
	env_open(&e, 0, 0, 0, 0, NULL);
	seq_full(&e, 64, NULL);
	seq_full(&e, 65, NULL);
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_store_seq_create_uid(e.s, e.p, UID, "1000:t", 1, &d, msg, sizeof msg), 0);
	int rc = 0;

	for (uint32_t ly = 1; ly < LAYERS && !rc; ly++)
		rc = rows(&e, d, ly, 0, 1, TOK, 66 + ly, NULL, msg, sizeof msg);
	assert_int_equal(rc, -EDQUOT);
	assert_non_null(strstr(msg, "memory_per_uid"));
	env_close(&e);
	env_mem_per_uid = 0;
}

/* A fork shares its parent's segments, and a file write fills each
 * segment's header page: while the parent's write is in flight the child
 * cannot start its own (-EAGAIN, saying why), once it is reaped it can, and
 * both come back bit for bit.  Charges: the child pays for what it copied,
 * the shared segments stay charged once, and dropping the parent frees
 * none of them. */
static void test_shared_segments_write_in_turn(void **state)
{
	struct kvd_seqn *a, *b;
	struct snap sa, sb;
	struct kvd_limits_usage u0, u1;
	char msg[200];
	struct env e;

	env_open(&e, 0, 0, 0, 1, "");
	a = seq_full(&e, 70, NULL);
	kvd_limits_uid_usage(e.l, UID, &u0);
	assert_int_equal(kvd_store_seq_fork(e.s, a, UID, "1000:t", 2, &b, msg, sizeof msg), 0);
	kvd_limits_uid_usage(e.l, UID, &u1);
	assert_true(u1.n[KVD_RES_MEMORY] - u0.n[KVD_RES_MEMORY] < kvd_store_seq_bytes(a) / 2);
	assert_int_equal(kvd_store_seq_bytes(b), kvd_store_seq_bytes(a));
	assert_true(kvd_store_seq_freeable(a) < kvd_store_seq_bytes(a) / 2);
	snap_take(a, &sa);
	snap_take(b, &sb);

	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_evict(e.t, a, msg, sizeof msg), 0);
	/* a's write is not reaped before the next call: b must wait for it */
	msg[0] = 0;
	assert_int_equal(kvd_tier_evict(e.t, b, msg, sizeof msg), -EAGAIN);
	assert_non_null(strstr(msg, "shares"));
	WAIT_UNTIL(&e, kvd_store_seq_state(a) == KVD_SEQ_DISK);
	/* a's segments are b's too: nothing of them was given back */
	assert_int_equal(kvd_store_seq_bytes(b), sb.bytes);
	assert_int_equal(kvd_tier_evict(e.t, b, msg, sizeof msg), 0);
	WAIT_UNTIL(&e, kvd_store_seq_state(b) == KVD_SEQ_DISK);
	assert_int_equal(used(&e), stats(&e).used);
	restore(&e, b);
	restore(&e, a);
	snap_equal(a, &sa);
	snap_equal(b, &sb);
	assert_int_equal(stats(&e).lost, 0);
	snap_free(&sa);
	snap_free(&sb);
	env_close(&e);
}

/* A write-back reads the tails it writes off the state lock, from a
 * reference it holds: a sharer APPENDing while the write runs copies its
 * tail first, so the file holds exactly the rows of its generation and the
 * sharer's new rows are its own.  The sequence itself, when it stays
 * resident, APPENDs after the rows the write reads, and copies the tail
 * first when it seals.  Once the write ends every tail it held is given
 * back. */
static void test_write_back_holds_tails(void **state)
{
	struct kvd_seqn *a, *b;
	struct snap sa, sb;
	char msg[200];
	struct env e;
	uint64_t base;

	env_persist = 1;                /* kvd_tier_write writes only for persist */
	env_open(&e, 0, 0, 0, 1, "");
	env_persist = 0;
	base = used(&e);
	a = seq_full(&e, 80, NULL);
	snap_take(a, &sa);
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_evict(e.t, a, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_state(a), KVD_SEQ_SPILLING);
	/* the write holds a's tails: dropping a would still free them */
	assert_int_equal(kvd_store_seq_freeable(a), kvd_store_seq_bytes(a));
	assert_int_equal(kvd_store_seq_fork(e.s, a, UID, "1000:t", 2, &b, msg, sizeof msg), 0);
	for (uint32_t ly = 1; ly < LAYERS; ly++) {
		const uint16_t *shared = kvd_store_view(a, ly).tail_k;

		assert_int_equal(rows(&e, b, ly, 1, 0, 3, 900 + ly, NULL, msg, sizeof msg), 0);
		assert_ptr_not_equal(kvd_store_view(b, ly).tail_k, shared);
		assert_ptr_equal(kvd_store_view(a, ly).tail_k, shared);
	}
	WAIT_UNTIL(&e, kvd_store_seq_state(a) == KVD_SEQ_DISK);
	/* b's own tails, written while b stays: an APPEND meanwhile writes
	 * after the rows the write reads, and one that seals copies the tail
	 * first (it starts the rows over) */
	assert_int_equal(kvd_tier_write(e.t, b), 0);
	assert_int_equal(kvd_store_seq_state(b), KVD_SEQ_SPILLING);
	for (uint32_t ly = 1; ly < LAYERS; ly++) {
		const uint16_t *held = kvd_store_view(b, ly).tail_k;

		assert_int_equal(rows(&e, b, ly, 1, 0, 2, 950 + ly, NULL, msg, sizeof msg), 0);
		assert_ptr_equal(kvd_store_view(b, ly).tail_k, held);
		assert_int_equal(rows(&e, b, ly, 1, 0, SEAL, 970 + ly, NULL, msg, sizeof msg), 0);
		assert_ptr_not_equal(kvd_store_view(b, ly).tail_k, held);
	}
	snap_take(b, &sb);
	WAIT_UNTIL(&e, kvd_store_seq_state(b) == KVD_SEQ_RAM);
	restore(&e, a);
	snap_equal(a, &sa);
	for (uint32_t ly = 1; ly < LAYERS; ly++)
		assert_int_equal(kvd_store_layer_tokens(b, ly), sa.tokens[ly] + 5 + SEAL);
	assert_int_equal(kvd_tier_evict(e.t, b, msg, sizeof msg), 0);
	WAIT_UNTIL(&e, kvd_store_seq_state(b) == KVD_SEQ_DISK);
	restore(&e, b);
	snap_equal(b, &sb);
	assert_int_equal(used(&e), stats(&e).used);
	kvd_tier_free(e.t, a);
	kvd_tier_free(e.t, b);
	WAIT_UNTIL(&e, sequences(&e) == 0);
	assert_int_equal(used(&e), base);
	assert_int_equal(stats(&e).lost, 0);
	snap_free(&sa);
	snap_free(&sb);
	env_close(&e);
}

/* The client rows a published prefix keeps (kvd_store_local_*) go to disk
 * with their sequence and come back bit for bit, charged again; rows
 * entering the sequence drop them. */
static void test_local_rows_spill(void **state)
{
	struct kvd_seqn *q;
	struct kvd_rng r = kvd_rng_make(80);
	uint16_t k[KV * 70 * D], v[KV * 70 * D], k2[KV * 70 * D], v2[KV * 70 * D];
	char msg[200];
	struct env e;

	fill_bf16(k, KV * 70 * D, &r, 0, 1);
	fill_bf16(v, KV * 70 * D, &r, 0, 1);
	env_open(&e, 0, 0, 0, 1, "");
	q = seq_full(&e, 81, NULL);
	/* a dense layer's 70 rows and a sparse layer's 68, in two puts */
	assert_int_equal(kvd_store_local_put(e.s, q, 0, 0, k, v, 70, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_local_put(e.s, q, 2, 0, k, v, 40, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_local_put(e.s, q, 2, 40, k + KV * 40 * D, v + KV * 40 * D, 28,
					     msg, sizeof msg), 0);
	/* a gap: refused */
	assert_int_equal(kvd_store_local_put(e.s, q, 2, 70, k, v, 8, msg, sizeof msg), -EINVAL);
	uint64_t before = used(&e);

	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_evict(e.t, q, msg, sizeof msg), 0);
	WAIT_UNTIL(&e, kvd_store_seq_state(q) == KVD_SEQ_DISK);
	assert_int_equal(kvd_store_local_rows(q, 0), 0);
	assert_true(used(&e) < before);
	restore(&e, q);
	assert_int_equal(used(&e), before);
	assert_int_equal(kvd_store_local_rows(q, 0), 70);
	assert_int_equal(kvd_store_local_rows(q, 1), 0);
	assert_int_equal(kvd_store_local_rows(q, 2), 68);
	assert_int_equal(kvd_store_local_get(q, 0, 0, 70, k2, v2), 0);
	assert_memory_equal(k2, k, sizeof k);
	assert_memory_equal(v2, v, sizeof v);
	assert_int_equal(kvd_store_local_get(q, 2, 10, 30, k2, v2), 0);
	for (uint32_t h = 0; h < KV; h++) {
		assert_memory_equal(k2 + h * 30 * D, k + (h * 40 + 10) * D, 30 * D * 2);
		assert_memory_equal(v2 + h * 30 * D, v + (h * 40 + 10) * D, 30 * D * 2);
	}
	assert_int_equal(kvd_store_local_get(q, 2, 40, 28, k2, v2), 0);
	assert_memory_equal(k2, k + KV * 40 * D, KV * 28 * D * 2);
	assert_int_equal(kvd_store_local_get(q, 2, 60, 9, k2, v2), -ERANGE);
	/* an appended row makes them stale: gone */
	assert_int_equal(rows(&e, q, 1, 1, 0, 1, 82, NULL, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_local_rows(q, 0), 0);
	env_close(&e);
}

/* Between the slices of a seal the executor runs other clients' records
 * (kvd_pool_set_yield), and one of them may restore its sequence and need
 * room.  The sequence being sealed must not be what goes: written out
 * there, its file held half the change under the generation the change had
 * already bumped, counted as current, and the rows appended after it were
 * lost with the drop.  The hook forces that interleaving: at the seal's
 * first yield B is restored, and the only room there is is A. */
struct mid_seal {
	struct env *e;
	struct kvd_seqn *a, *b;
	int calls, rc;
	enum kvd_seq_state a_state;
};

static void mid_seal_hook(void *arg)
{
	struct mid_seal *m = arg;
	char msg[200];

	if (m->calls++)
		return;
	kvd_tier_begin(m->e->t);        /* another client's request */
	m->rc = kvd_tier_want(m->e->t, m->b, 1, msg, sizeof msg);
	m->a_state = kvd_store_seq_state(m->a);
}

static void test_no_write_back_inside_seal(void **state)
{
	uint64_t base, per;
	struct snap *sa = xmalloc(sizeof *sa);
	struct mid_seal m = { 0 };
	char msg[200];
	struct env e;
	int rc;

	measure(&base, &per);
	env_open(&e, base + per + per / 2, 0, 0, 1, "");      /* one fits, not two */
	m.e = &e;
	m.b = seq_full(&e, 90, NULL);
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_evict(e.t, m.b, msg, sizeof msg), 0);
	WAIT_UNTIL(&e, kvd_store_seq_state(m.b) == KVD_SEQ_DISK);
	m.a = seq_full(&e, 91, NULL);
	/* The tail holds TAIL rows: SEAL more fill it, seal it, and start the
	 * next tail with TAIL. */
	kvd_pool_set_yield(mid_seal_hook, &m);
	kvd_tier_begin(e.t);
	rc = rows(&e, m.a, 1, 1, 0, SEAL, 92, NULL, msg, sizeof msg);
	kvd_pool_set_yield(NULL, NULL);
	assert_int_equal(rc, 0);
	assert_true(m.calls > 0);
	assert_int_equal(kvd_store_layer_tokens(m.a, 1), TOK + TAIL + SEAL);
	snap_take(m.a, sa);

	/* B comes back once A's unit is over: A goes whole, and returns as
	 * it was after the append. */
	kvd_tier_begin(e.t);
	restore(&e, m.b);
	assert_int_equal(kvd_store_seq_state(m.a), KVD_SEQ_DISK);
	kvd_tier_begin(e.t);
	restore(&e, m.a);
	snap_equal(m.a, sa);
	assert_int_equal(stats(&e).lost, 0);

	/* Inside the seal B was told to wait for A's unit, A was untouched,
	 * and the executor was told to retry the waiting after the unit. */
	assert_int_equal(m.rc, -EINPROGRESS);
	assert_int_equal(m.a_state, KVD_SEQ_RAM);
	assert_int_equal(kvd_tier_take_pin_waits(e.t), 1);
	assert_int_equal(kvd_tier_take_pin_waits(e.t), 0);
	/* A pinned sequence is refused by SeqEvict too, saying why. */
	kvd_store_seq_pin(m.a);
	assert_int_equal(kvd_tier_evict(e.t, m.a, msg, sizeof msg), -EBUSY);
	assert_non_null(strstr(msg, "changing"));
	kvd_store_seq_unpin(m.a);
	snap_free(sa);
	free(sa);
	env_close(&e);
}

/* The loop installs a restore's extents under the state lock: a poll takes
 * results for its budget only (at least one batch of 4), so a restore of
 * many extents is spread over many loop turns instead of holding every
 * client up for the whole file.  With a budget of 1 ns every poll takes
 * one batch. */
static void test_poll_is_bounded(void **state)
{
	struct kvd_seqn *q;
	struct snap *s = xmalloc(sizeof *s);
	unsigned polls = 0, results = 0, n;
	char msg[200];
	int rc;
	struct env e;

	env_poll_ns = 1;
	env_open(&e, 0, 0, 0, 1, "");
	env_poll_ns = 0;
	q = seq_full(&e, 95, NULL);
	snap_take(q, s);
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_evict(e.t, q, msg, sizeof msg), 0);
	WAIT_UNTIL(&e, kvd_store_seq_state(q) == KVD_SEQ_DISK);
	kvd_tier_begin(e.t);
	assert_int_equal(kvd_tier_want(e.t, q, UINT32_MAX, msg, sizeof msg), -EINPROGRESS);
	for (uint64_t t_end = now_ms() + 20000; kvd_store_seq_state(q) == KVD_SEQ_RESTORING;) {
		struct pollfd pfd = { .fd = kvd_tier_fd(e.t), .events = POLLIN };

		if (now_ms() > t_end)
			fail_msg("restore did not end");
		poll(&pfd, 1, 100);
		n = kvd_tier_poll(e.t);
		assert_true(n <= 4);
		polls += n > 0;
		results += n;
	}
	print_message("  a restore of %u results took %u polls\n", results, polls);
	/* PROFILE, three sparse layers of a LAYER and two SEGs, END: 11
	 * extents, each reported, and the final result. */
	assert_true(results >= 12);
	assert_true(polls >= results / 4);
	rc = kvd_tier_want(e.t, q, UINT32_MAX, msg, sizeof msg);
	assert_int_equal(rc, 0);
	snap_equal(q, s);
	snap_free(s);
	free(s);
	env_close(&e);
}

/* A change charges its peak before it begins: what runs between the
 * slices of its seals sees that room as used.  At the first seal of an
 * APPEND of two, another uid takes every byte the budget still shows free;
 * the second seal must still have its room, and the APPEND completes whole
 * (it used to fail half done, with one seal's rows in and the rest lost). */
struct grab {
	struct env *e;
	uint64_t limit, took;
	int calls;
};

static void grab_hook(void *arg)
{
	struct grab *g = arg;
	struct kvd_limits_usage u;

	if (g->calls++)
		return;
	kvd_limits_total(g->e->l, &u);
	g->took = g->limit - u.n[KVD_RES_MEMORY];
	assert_int_equal(kvd_limits_charge(g->e->l, 2000, KVD_RES_MEMORY, g->took, NULL, 0), 0);
}

static void test_change_keeps_its_room(void **state)
{
	uint64_t base, per;
	struct grab g = { 0 };
	struct kvd_seqn *q;
	char msg[200];
	struct env e;
	int rc;

	measure(&base, &per);
	g.limit = base + 2 * per;
	env_open(&e, g.limit, 0, 0, 0, NULL);
	g.e = &e;
	q = seq_full(&e, 96, NULL);
	kvd_pool_set_yield(grab_hook, &g);
	kvd_tier_begin(e.t);
	rc = rows(&e, q, 1, 1, 0, 2 * SEAL, 97, NULL, msg, sizeof msg);
	kvd_pool_set_yield(NULL, NULL);
	print_message("  another uid took the %llu bytes left at the first seal\n",
		      (unsigned long long)g.took);
	if (rc)
		fail_msg("the APPEND failed in its second seal: %d %s", rc, msg);
	assert_true(g.calls >= 2);
	assert_int_equal(kvd_store_layer_tokens(q, 1), TOK + TAIL + 2 * SEAL);
	kvd_limits_uncharge(e.l, 2000, KVD_RES_MEMORY, g.took);
	env_close(&e);
}

/* Two sequences, both on disk: the budget (or the uid's share) holds one
 * and a half. */
static void two_on_disk(struct env *e, uint64_t seed, struct kvd_seqn **q0, struct kvd_seqn **q1)
{
	char msg[200];

	*q0 = seq_full(e, seed, NULL);
	*q1 = seq_full(e, seed + 1, NULL);      /* wrote q0 out to fit */
	kvd_tier_begin(e->t);
	assert_int_equal(kvd_tier_evict(e->t, *q1, msg, sizeof msg), 0);
	WAIT_UNTIL(e, kvd_store_seq_state(*q0) == KVD_SEQ_DISK &&
			      kvd_store_seq_state(*q1) == KVD_SEQ_DISK);
}

/* A request of client `who` that uses layer 1 of q. */
static int part_want(struct env *e, uint64_t who, struct kvd_seqn *q)
{
	char msg[200];

	kvd_tier_begin(e->t);
	kvd_tier_part(e->t, who, 0);
	return kvd_tier_want(e->t, q, 1, msg, sizeof msg);
}

/* Room is handed out in turn (tier.h, kvd_tier_part).  Clients are parts
 * 1, 2, 3...; a budget that holds one sequence and a half. */
static void test_room_in_turn(void **state)
{
	uint64_t base, per, who;
	struct kvd_seqn *q0, *q1;
	char msg[200];
	struct env e;
	int rc;

	measure(&base, &per);
	env_open(&e, base + per + per / 2, 0, 0, 1, "");
	two_on_disk(&e, 100, &q0, &q1);

	/* 1 restores q0.  2's restore of q1 does not fit beside it, and
	 * nothing else can go: it waits for 1's restore, where it used to be
	 * refused -ENOMEM. */
	assert_int_equal(part_want(&e, 1, q0), -EINPROGRESS);
	assert_int_equal(part_want(&e, 2, q1), -EINPROGRESS);
	assert_int_equal(kvd_store_seq_state(q1), KVD_SEQ_DISK);
	assert_true(kvd_tier_waiting(e.t));

	/* Back, q0 is kept for 1 until 1 has used it: 2 does not take it. */
	WAIT_UNTIL(&e, kvd_store_seq_state(q0) == KVD_SEQ_RAM);
	assert_int_equal(part_want(&e, 2, q1), -EINPROGRESS);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_RAM);
	(void)kvd_tier_take_pin_waits(e.t);
	assert_int_equal(part_want(&e, 1, q0), 0);
	assert_int_equal(kvd_tier_take_pin_waits(e.t), 1);       /* the waiters go again */

	/* 3 asks for less than is free, but not beside what 2 waits for: it
	 * waits behind 2, and evicts nothing for itself. */
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 3, 0);
	assert_int_equal(kvd_tier_room(e.t, per / 4, msg, sizeof msg), -EINPROGRESS);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_RAM);
	assert_int_equal(kvd_tier_due(e.t, kvd_now_ns(), &who), 0);
	assert_int_equal(who, 0);               /* 2 would not fit yet */
	/* 2's client goes: 3 is first, and would fit now without any I/O */
	kvd_tier_unwait(e.t, 2);
	assert_int_equal(kvd_tier_take_pin_waits(e.t), 1);
	assert_int_equal(kvd_tier_due(e.t, kvd_now_ns(), &who), 0);
	assert_int_equal(who, 3);
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 3, 0);
	assert_int_equal(kvd_tier_room(e.t, per / 4, msg, sizeof msg), 0);
	kvd_tier_unwait(e.t, 3);
	/* q0's hold for 1 would have ended by itself (1 used it already) */
	assert_int_equal(kvd_tier_due(e.t, kvd_now_ns() + 3600ull * 1000000000, &who), 1);
	assert_false(kvd_tier_waiting(e.t));

	/* More than the whole budget is refused at once: q0 stays, and
	 * nobody is queued. */
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 6, 0);
	msg[0] = 0;
	assert_int_equal(kvd_tier_room(e.t, base + 2 * per, msg, sizeof msg), -ENOMEM);
	assert_non_null(strstr(msg, "memory budget"));
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_RAM);
	assert_false(kvd_tier_waiting(e.t));

	/* A waiter served keeps its place until its entry ends: 4 waits
	 * (q0 pinned by a unit), 5 waits behind it, 4 gets its room and asks
	 * again, as a unit asks in steps, and is still ahead of 5. */
	kvd_store_seq_pin(q0);
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 4, 0);
	assert_int_equal(kvd_tier_room(e.t, per, msg, sizeof msg), -EINPROGRESS);
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 5, 0);
	assert_int_equal(kvd_tier_room(e.t, per, msg, sizeof msg), -EINPROGRESS);
	kvd_store_seq_unpin(q0);
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 4, 0);
	WAIT_UNTIL(&e, (rc = kvd_tier_room(e.t, per, msg, sizeof msg)) != -EINPROGRESS);
	assert_int_equal(rc, 0);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_DISK);
	/* (queued again behind 5, 4 would wait: base + 2 per is over) */
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 4, 0);
	assert_int_equal(kvd_tier_room(e.t, per, msg, sizeof msg), 0);
	kvd_tier_unwait(e.t, 4);
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 5, 0);
	assert_int_equal(kvd_tier_room(e.t, per, msg, sizeof msg), 0);
	kvd_tier_unwait(e.t, 5);
	assert_false(kvd_tier_waiting(e.t));
	assert_int_equal(stats(&e).lost, 0);
	env_close(&e);
}

/* Under memory_per_uid the same: a restore of the uid's in flight is room
 * that comes back to it, so a second one waits instead of being refused
 * EDQUOT. */
static void test_uid_room_waits_for_restores(void **state)
{
	uint64_t base, per;
	struct kvd_seqn *q0, *q1;
	struct env e;

	measure(&base, &per);
	env_mem_per_uid = per + per / 2;
	env_open(&e, 0, 0, 0, 1, "");
	two_on_disk(&e, 110, &q0, &q1);
	assert_int_equal(part_want(&e, 1, q0), -EINPROGRESS);
	assert_int_equal(part_want(&e, 2, q1), -EINPROGRESS);
	assert_int_equal(kvd_store_seq_state(q1), KVD_SEQ_DISK);
	/* q0 back and used by 1; then 2's restore takes its place */
	WAIT_UNTIL(&e, kvd_store_seq_state(q0) == KVD_SEQ_RAM);
	assert_int_equal(part_want(&e, 1, q0), 0);
	kvd_tier_begin(e.t);
	kvd_tier_part(e.t, 2, 0);
	restore(&e, q1);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_DISK);
	kvd_tier_unwait(e.t, 1);
	kvd_tier_unwait(e.t, 2);
	assert_int_equal(stats(&e).lost, 0);
	env_close(&e);
	env_mem_per_uid = 0;
}

/* A request of client who of uid for bytes of room. */
static int part_room(struct env *e, uint64_t who, uint32_t uid, uint64_t bytes)
{
	char msg[200];

	kvd_tier_begin(e->t);
	kvd_tier_part(e->t, who, uid);
	return kvd_tier_room(e->t, bytes, msg, sizeof msg);
}

/* Places in turn by uid: uid 1's six clients queue before uid 2's one;
 * uid 1 gets KVD_TIER_ROOM_PER_UID places, and once one of its clients
 * is served, uid 2's client comes next, not uid 1's five others. */
static void test_room_turns_by_uid(void **state)
{
	uint64_t base, per, who;
	struct kvd_seqn *q0;
	struct env e;
	int rc;

	measure(&base, &per);
	env_open(&e, base + per + per / 2, 0, 0, 1, "");
	q0 = seq_full(&e, 120, NULL);
	/* room comes only when q0's unit ends: everyone waits */
	kvd_store_seq_pin(q0);
	for (uint64_t c = 11; c <= 16; c++)
		assert_int_equal(part_room(&e, c, 1, per), -EINPROGRESS);
	assert_int_equal(part_room(&e, 21, 2, per), -EINPROGRESS);
	kvd_store_seq_unpin(q0);

	/* 11, first, gets its room (q0 written out) and its entry ends */
	WAIT_UNTIL(&e, (rc = part_room(&e, 11, 1, per)) != -EINPROGRESS);
	assert_int_equal(rc, 0);
	assert_int_equal(kvd_store_seq_state(q0), KVD_SEQ_DISK);
	kvd_tier_unwait(e.t, 11);
	assert_int_equal(kvd_tier_due(e.t, kvd_now_ns(), &who), 0);
	assert_int_equal(who, 21);
	assert_int_equal(part_room(&e, 21, 2, per), 0);
	kvd_tier_unwait(e.t, 21);

	/* then uid 1's others with a place, in their order */
	for (uint64_t c = 12; c < 11 + KVD_TIER_ROOM_PER_UID; c++) {
		assert_int_equal(kvd_tier_due(e.t, kvd_now_ns(), &who), 0);
		assert_int_equal(who, c);
		assert_int_equal(part_room(&e, c, 1, per), 0);
		kvd_tier_unwait(e.t, c);
	}
	/* 15 and 16 had no place: nobody is queued now */
	assert_false(kvd_tier_waiting(e.t));
	assert_int_equal(stats(&e).lost, 0);
	env_close(&e);
}

static int setup(void **state)
{
	return kvd_pool_create(2, 0, &pool);
}

static int teardown(void **state)
{
	kvd_pool_destroy(pool);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_evicts_coldest_first),
		cmocka_unit_test(test_watermarks),
		cmocka_unit_test(test_restore_in_order),
		cmocka_unit_test(test_refused_when_nothing_can_go),
		cmocka_unit_test(test_lost),
		cmocka_unit_test(test_uid_share_evicts_own),
		cmocka_unit_test(test_shared_segments_write_in_turn),
		cmocka_unit_test(test_write_back_holds_tails),
		cmocka_unit_test(test_local_rows_spill),
		cmocka_unit_test(test_no_write_back_inside_seal),
		cmocka_unit_test(test_poll_is_bounded),
		cmocka_unit_test(test_change_keeps_its_room),
		cmocka_unit_test(test_room_in_turn),
		cmocka_unit_test(test_uid_room_waits_for_restores),
		cmocka_unit_test(test_room_turns_by_uid),
	};
	int rc;

	snprintf(root, sizeof root, "/tmp/kvd-tier-policy-XXXXXX");
	if (!mkdtemp(root)) {
		perror("mkdtemp");
		return 1;
	}
	rc = cmocka_run_group_tests(tests, setup, teardown);
	rmdir(root);
	return rc;
}
