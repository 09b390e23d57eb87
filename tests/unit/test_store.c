/* kvd_store with kvd_limits: the memory limit is a wall (sequence structs,
 * staging, means, segments are charged before they are allocated), profile
 * namespaces (no cross-uid lookups or name collisions, sharing groups),
 * profile references and ids that are never reused, the per-uid caps, and
 * the old API without limits.  Then the rows themselves: PREFILL staging
 * sealed every seg_tokens and at LAST, the APPEND tail sealed at
 * seal_tokens and starting over, every row in its place, and rows out of
 * order refused without a change.  Then the estimator state of hybrid
 * profiles: charged, zero-filled, given back on drop and free.  Last,
 * forks: segments and open tails shared (a tail copied by the holder that
 * next appends to it, charged then, refused without a change), every byte
 * charged once and given back in any order. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/err.h"
#include "engine/pool.h"
#include "engine/rng.h"
#include "kvd/store/store.h"
#include "kvd/store/store_int.h"       /* q->state: an install is a restore's */
#include "testutil.h"
#include "kvd/store/uidlimits.h"

#define KV 2
#define D 64
#define KB 8
#define LT 16
#define LAYERS 2
/* A tail's K, V and codes (seal_tokens 64): what a fork shares, not copies. */
#define TAIL_ROWS_BYTES ((size_t)2 * KV * 64 * D * 2 + (size_t)KV * LT * 64 * 2)

static struct kvd_pool *pool;
static uint8_t dense[LAYERS];

static struct kvd_profile profile(const char *name, uint64_t seed)
{
	struct kvd_profile p;

	memset(&p, 0, sizeof p);
	snprintf(p.name, sizeof p.name, "%s", name);
	p.g = (struct kvd_geom){ 4, KV, D, KB, LT, 2, KVD_KV_BF16, 0 };
	p.layers = LAYERS;
	p.sink = 4;
	p.window = 64;
	p.seg_tokens = 256;
	p.seal_tokens = 64;
	p.seed = seed;
	p.dense = dense;
	return p;
}

static struct kvd_limits *limits(uint64_t mem, uint64_t mem_uid, uint32_t seqs_uid,
				 uint32_t profs_uid)
{
	struct kvd_limits_cfg c;
	struct kvd_limits *l;

	memset(&c, 0, sizeof c);
	c.cap[KVD_RES_MEMORY] = mem;
	c.per_uid[KVD_RES_MEMORY] = mem_uid;
	c.per_uid[KVD_RES_SEQUENCES] = seqs_uid;
	c.per_uid[KVD_RES_PROFILES] = profs_uid;
	c.cap[KVD_RES_SEQUENCES] = 1u << 24;
	c.cap[KVD_RES_PROFILES] = 1024;
	c.share_uid[0] = 3000;
	c.share_uid[1] = 3001;
	c.nshare = 2;
	assert_int_equal(kvd_limits_create(&c, &l), 0);
	return l;
}

static struct kvd_store *store(struct kvd_limits *l)
{
	struct kvd_store *s;

	assert_int_equal(kvd_store_create(pool, &s), 0);
	if (l)
		assert_int_equal(kvd_store_set_limits(s, l), 0);
	return s;
}

static uint64_t mem_total(const struct kvd_limits *l)
{
	struct kvd_limits_usage u;

	kvd_limits_total(l, &u);
	return u.n[KVD_RES_MEMORY];
}

/* What the store itself says it holds. */
static uint64_t store_total(const struct kvd_store *s)
{
	struct kvd_store_stats st;

	kvd_store_stats(s, &st);
	return st.bytes + st.fixed_bytes + st.profile_bytes;
}

static void test_seq_creates_hit_the_wall(void **state)
{
	const uint64_t limit = 2u << 20;
	struct kvd_limits *l = limits(limit, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 1);
	const struct kvd_profile *p;
	static struct kvd_seqn *q[100000];
	unsigned made = 0, refused = 0;
	char msg[200];

	assert_int_equal(kvd_store_profile_ns(s, 1000, 1000, &want, &p, msg, sizeof msg), 0);
	for (unsigned i = 0; i < 100000; i++) {
		int rc = kvd_store_seq_create_uid(s, p, 1000, "1000:t", 1, &q[made], msg, sizeof msg);

		if (rc == 0) {
			assert_int_equal(refused, 0);   /* once full, it stays full */
			made++;
		} else {
			assert_int_equal(rc, -ENOMEM);
			if (!refused++)
				assert_non_null(strstr(msg, "memory.limit"));
		}
		assert_true(mem_total(l) <= limit);
		assert_true(store_total(s) <= limit);
	}
	print_message("  %u sequences made under %llu bytes, %u refused\n", made,
		      (unsigned long long)limit, refused);
	assert_true(made > 1000);
	assert_true(refused > 0);
	assert_int_equal(store_total(s), mem_total(l));
	/* the old entry point charges the uid in the tenant the same way */
	assert_int_equal(kvd_store_seq_create(s, p, "1000:t", 1, &q[made]), -ENOMEM);
	for (unsigned i = 0; i < made; i++)
		kvd_store_seq_free(s, q[i]);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	assert_int_equal(kvd_limits_uids(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* One PREFILL of one token: mean, staging, and with `last` its segment. */
static int prefill1(struct kvd_store *s, struct kvd_seqn *q, int last, char *msg, size_t n)
{
	static float mean[KV * D];
	static uint16_t k[KV * D], v[KV * D], c[KV * LT];
	struct kvd_rng r = kvd_rng_make(7);

	fill_bf16(k, KV * D, &r, 0, 1);
	fill_bf16(v, KV * D, &r, 0, 1);
	for (size_t i = 0; i < KV * LT; i++)
		c[i] = (uint16_t)kvd_rng_below(&r, 1u << KB);
	return kvd_store_rows(s, q, 0, 0, last, mean, k, v, c, 1, msg, n);
}

static void test_prefill_one_token(void **state)
{
	struct kvd_profile want = profile("p", 1);
	uint64_t base = 0;
	unsigned fit = 0, refused = 0;
	char msg[256];

	for (uint64_t room = 0; room <= 24 << 10; room += 512) {
		for (int last = 0; last < 2; last++) {
			struct kvd_limits *l = limits(UINT64_MAX, 0, 0, 0);
			struct kvd_store *s = store(l);
			const struct kvd_profile *p;
			struct kvd_seqn *q;
			int rc;

			assert_int_equal(kvd_store_profile_ns(s, 1, 1, &want, &p, msg, sizeof msg), 0);
			assert_int_equal(kvd_store_seq_create_uid(s, p, 1, "1:t", 1, &q, msg, sizeof msg), 0);
			base = mem_total(l);
			kvd_store_seq_free(s, q);
			kvd_store_profile_unref(s, p);
			kvd_store_destroy(s);
			kvd_limits_destroy(l);

			/* The same again with the limit `room` above that. */
			l = limits(base + room, 0, 0, 0);
			s = store(l);
			assert_int_equal(kvd_store_profile_ns(s, 1, 1, &want, &p, msg, sizeof msg), 0);
			assert_int_equal(kvd_store_seq_create_uid(s, p, 1, "1:t", 1, &q, msg, sizeof msg), 0);
			msg[0] = 0;
			rc = prefill1(s, q, last, msg, sizeof msg);
			if (rc) {
				assert_int_equal(rc, -ENOMEM);
				assert_non_null(strstr(msg, "memory.limit"));
				refused++;
			} else {
				fit++;
			}
			assert_true(mem_total(l) <= base + room);
			assert_true(store_total(s) <= base + room);
			assert_int_equal(store_total(s), mem_total(l));
			/* 4 KiB are plenty for a token's mean and staging: the
			 * staging is not 1024 rows any more */
			if (room >= 4096 && !last)
				assert_int_equal(rc, 0);
			kvd_store_seq_free(s, q);
			kvd_store_profile_unref(s, p);
			assert_int_equal(mem_total(l), 0);
			kvd_store_destroy(s);
			kvd_limits_destroy(l);
		}
	}
	print_message("  1-token prefills: %u fit, %u refused with ENOMEM\n", fit, refused);
	assert_true(fit > 0 && refused > 0);
}

/* A prefill of many tokens across segments, then append into the tail,
 * under a per-uid cap: everything charged, nothing above the cap, and
 * freeing gives it all back. */
static void test_rows_charged(void **state)
{
	struct kvd_limits *l = limits(0, 1u << 20, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 2);
	const struct kvd_profile *p;
	struct kvd_seqn *q;
	char msg[256];
	int rc = 0, last = 0;

	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	for (int i = 0; i < 4000 && !rc; i++) {
		static uint16_t k[KV * 16 * D], v[KV * 16 * D], c[KV * LT * 16];
		static float mean[KV * D];

		rc = kvd_store_rows(s, q, 1, 0, 0, i ? NULL : mean, k, v, c, 16, msg, sizeof msg);
		assert_true(mem_total(l) <= 1u << 20);
		last = i;
	}
	assert_int_equal(rc, -EDQUOT);
	assert_non_null(strstr(msg, "limits.memory_per_uid: uid 9"));
	/* refused whole: nothing changed, and again the same */
	{
		static uint16_t k[KV * 16 * D], v[KV * 16 * D], c[KV * LT * 16];
		uint64_t tokens, mem = mem_total(l);
		uint32_t segs;

		kvd_store_seq_stats(q, &tokens, &segs);
		assert_int_equal(kvd_store_rows(s, q, 1, 0, 0, NULL, k, v, c, 16, msg, sizeof msg),
				 -EDQUOT);
		assert_int_equal(mem_total(l), mem);
		kvd_store_seq_stats(q, &tokens, &segs);
		assert_int_equal(tokens, (uint64_t)last * 16);
	}
	print_message("  per-uid cap reached after %d chunks: %s\n", last, msg);
	assert_int_equal(store_total(s), mem_total(l));
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

static void test_profile_namespaces(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile a = profile("llama", 1), b = profile("llama", 2);
	const struct kvd_profile *pa, *pb, *pc, *pd;
	char msg[200];

	assert_int_equal(kvd_store_profile_ns(s, 1000, 1000, &a, &pa, msg, sizeof msg), 0);
	assert_int_equal(pa->ns, 1000);
	assert_int_equal(pa->uid, 1000);
	/* uid 2000 finds nothing of uid 1000's, by name or id */
	assert_null(kvd_store_profile_find(s, 2000, "llama"));
	assert_null(kvd_store_profile_get(s, 2000, pa->id));
	assert_ptr_equal(kvd_store_profile_get(s, 1000, pa->id), pa);
	assert_ptr_equal(kvd_store_profile_find(s, 1000, "llama"), pa);
	/* and cannot squat or collide: other fields under the same name are
	 * its own profile */
	assert_int_equal(kvd_store_profile_ns(s, 2000, 2000, &b, &pb, msg, sizeof msg), 0);
	assert_true(pb != pa && pb->id != pa->id);
	assert_ptr_equal(kvd_store_profile_find(s, 2000, "llama"), pb);
	/* within a namespace, other fields are EEXIST, identical ones open */
	assert_int_equal(kvd_store_profile_ns(s, 1000, 1000, &b, &pc, msg, sizeof msg), -EEXIST);
	assert_non_null(strstr(msg, "exists with other fields"));
	assert_int_equal(kvd_store_profile_ns(s, 1000, 1000, &a, &pc, msg, sizeof msg), 0);
	assert_ptr_equal(pc, pa);
	kvd_store_profile_unref(s, pc);
	/* a sharing group is one namespace */
	assert_int_equal(kvd_limits_namespace(l, 3000), kvd_limits_namespace(l, 3001));
	assert_int_equal(kvd_store_profile_ns(s, kvd_limits_namespace(l, 3000), 3000, &a, &pc, msg,
					      sizeof msg), 0);
	assert_true(pc != pa);
	assert_ptr_equal(kvd_store_profile_find(s, kvd_limits_namespace(l, 3001), "llama"), pc);
	assert_null(kvd_store_profile_find(s, 3001, "llama"));
	assert_int_equal(kvd_store_profile_ns(s, kvd_limits_namespace(l, 3001), 3001, &a, &pd, msg,
					      sizeof msg), 0);
	assert_ptr_equal(pd, pc);
	/* the old API lives in its own namespace */
	assert_null(kvd_store_profile_by_name(s, "llama"));
	assert_int_equal(kvd_store_profile(s, &a, &pd), 0);
	assert_int_equal(pd->ns, KVD_STORE_NS_GLOBAL);
	assert_ptr_equal(kvd_store_profile_by_name(s, "llama"), pd);
	/* uids at or above 0x80000000 outside a group get no profiles */
	assert_int_equal(kvd_store_profile_ns(s, kvd_limits_namespace(l, 0x90000000u), 0x90000000u,
					      &a, &pd, msg, sizeof msg), -EACCES);
	kvd_store_destroy(s);           /* frees what is left, references or not */
	assert_int_equal(mem_total(l), 0);
	kvd_limits_destroy(l);
}

static void test_profile_refs(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile a = profile("m", 1);
	const struct kvd_profile *p, *p2;
	struct kvd_store_stats st;
	struct kvd_limits_usage u;
	struct kvd_seqn *q;
	uint32_t id;
	char msg[200];

	assert_int_equal(kvd_store_profile_ns(s, 5, 5, &a, &p, msg, sizeof msg), 0);
	id = p->id;
	kvd_limits_uid_usage(l, 5, &u);
	assert_int_equal(u.n[KVD_RES_PROFILES], 1);
	assert_int_equal(u.n[KVD_RES_MEMORY], kvd_store_profile_bytes(p));
	assert_true(kvd_store_profile_bytes(p) > D * KB * LT * sizeof(float));
	assert_int_equal(kvd_store_seq_create_uid(s, p, 5, "5:t", 1, &q, msg, sizeof msg), 0);
	kvd_store_profile_unref(s, p);          /* the client lets go; the sequence holds it */
	assert_ptr_equal(kvd_store_profile_get(s, 5, id), p);
	kvd_store_seq_free(s, q);               /* the last reference */
	assert_null(kvd_store_profile_get(s, 5, id));
	assert_null(kvd_store_profile_find(s, 5, "m"));
	assert_null(kvd_store_profile_by_id(s, id));
	kvd_store_stats(s, &st);
	assert_int_equal(st.profiles, 0);
	assert_int_equal(st.profile_bytes, 0);
	assert_int_equal(kvd_limits_uids(l), 0);
	/* made again: a new id, never the old one */
	for (int i = 0; i < 100; i++) {
		assert_int_equal(kvd_store_profile_ns(s, 5, 5, &a, &p2, msg, sizeof msg), 0);
		assert_true(p2->id > id);
		id = p2->id;
		kvd_store_profile_unref(s, p2);
	}
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

static void test_per_uid_caps(void **state)
{
	struct kvd_limits *l = limits(0, 0, 3, 2);
	struct kvd_store *s = store(l);
	struct kvd_profile a = profile("a", 1), b = profile("b", 1), c = profile("c", 1);
	const struct kvd_profile *pa, *pb, *pc;
	struct kvd_seqn *q[4];
	char msg[200];

	assert_int_equal(kvd_store_profile_ns(s, 7, 7, &a, &pa, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_profile_ns(s, 7, 7, &b, &pb, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_profile_ns(s, 7, 7, &c, &pc, msg, sizeof msg), -EDQUOT);
	assert_string_equal(msg, "limits.profiles_per_uid: uid 7 has 2 of 2");
	/* opening one it has costs nothing; another uid has its own count */
	assert_int_equal(kvd_store_profile_ns(s, 7, 7, &a, &pc, msg, sizeof msg), 0);
	kvd_store_profile_unref(s, pc);
	assert_int_equal(kvd_store_profile_ns(s, 8, 8, &c, &pc, msg, sizeof msg), 0);
	/* sequences */
	for (int i = 0; i < 3; i++)
		assert_int_equal(kvd_store_seq_create_uid(s, pa, 7, "7:x", 1, &q[i], msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, pa, 7, "7:x", 1, &q[3], msg, sizeof msg), -EDQUOT);
	assert_string_equal(msg, "limits.sequences_per_uid: uid 7 has 3 of 3");
	kvd_store_seq_free(s, q[0]);
	assert_int_equal(kvd_store_seq_create_uid(s, pa, 7, "7:x", 1, &q[0], msg, sizeof msg), 0);
	kvd_store_destroy(s);
	assert_int_equal(kvd_limits_uids(l), 0);
	kvd_limits_destroy(l);
}

/* kvd_store_each_after: pages by a bounded walk return every sequence once,
 * in ascending id order, from any cursor, and a page looks at about the
 * budget (whole buckets), however many there are; ids adopted from disk
 * land where their value says, a hundred of them in one bucket included. */
struct walk {
	uint64_t last;
	uint32_t n, lim, taken;
};

static int walk_take(void *arg, struct kvd_seqn *q)
{
	struct walk *w = arg;

	assert_true(kvd_store_seq_id(q) > w->last);
	w->last = kvd_store_seq_id(q);
	w->n++;
	return ++w->taken == w->lim;
}

static void test_each_after(void **state)
{
	struct kvd_store *s = store(NULL);
	struct kvd_profile a = profile("w", 1);
	const struct kvd_profile *p;
	struct kvd_seqn *q;
	uint64_t after = 0;
	uint32_t pages = 0;
	struct walk w = { .lim = 300 };
	char msg[200];
	enum { N = 3000, SAME = 100 };

	assert_int_equal(kvd_store_profile_ns(s, 1, 1, &a, &p, msg, sizeof msg), 0);
	for (int i = 0; i < N; i++)
		assert_int_equal(kvd_store_seq_create_uid(s, p, 1, "1:t", 1, &q, msg, sizeof msg), 0);
	for (uint64_t i = 0; i < SAME; i++)     /* one bucket: the top 12 bits all ones */
		assert_int_equal(kvd_store_seq_adopt(s, p, "1:t", ~0ull - 7 * i, 0, &q), 0);
	do {
		uint64_t next;

		w.taken = 0;
		next = kvd_store_each_after(s, after, 500, walk_take, &w);
		assert_true(!next || next > after);
		assert_true(next || w.n == N + SAME);
		after = next;
		pages++;
	} while (after);
	assert_int_equal(w.n, N + SAME);
	/* a page stops at its limit or at about its budget of buckets */
	assert_true(pages >= (N + SAME) / 300 && pages < (N + SAME) / 8);
	kvd_store_profile_unref(s, p);
	kvd_store_destroy(s);
}

/* Each client's sequences are kept per owner: counted and walked without
 * a walk of every sequence, and right through creates, frees in any order,
 * claims and disowning. */
struct owned_walk {
	struct kvd_store *s;
	uint64_t owner;
	unsigned n, freed;
};

static void owned_free_odd(void *arg, struct kvd_seqn *q)
{
	struct owned_walk *w = arg;

	assert_int_equal(kvd_store_seq_owner(q), w->owner);
	if (w->n++ % 2) {
		kvd_store_seq_free(w->s, q);
		w->freed++;
	}
}

static void owned_count(void *arg, struct kvd_seqn *q)
{
	struct owned_walk *w = arg;

	assert_int_equal(kvd_store_seq_owner(q), w->owner);
	w->n++;
}

static void test_owners(void **state)
{
	struct kvd_store *s = store(NULL);
	struct kvd_profile a = profile("o", 1);
	const struct kvd_profile *p;
	struct kvd_seqn *q[40], *orphan;
	char msg[200];

	assert_int_equal(kvd_store_profile_ns(s, 1, 1, &a, &p, msg, sizeof msg), 0);
	/* owners 1..3, and 257 in owner 1's hash chain */
	for (int i = 0; i < 40; i++) {
		uint64_t owner = i < 20 ? 1 : i < 30 ? 2 : i < 35 ? 3 : 257;

		assert_int_equal(kvd_store_seq_create_uid(s, p, 1, "1:t", owner, &q[i], msg,
							  sizeof msg), 0);
	}
	assert_int_equal(kvd_store_owner_count(s, 1), 20);
	assert_int_equal(kvd_store_owner_count(s, 2), 10);
	assert_int_equal(kvd_store_owner_count(s, 257), 5);
	assert_int_equal(kvd_store_owner_count(s, 4), 0);
	assert_int_equal(kvd_store_owner_count(s, 0), 0);
	/* freed from the middle, the head and the tail of owner 2's list */
	kvd_store_seq_free(s, q[25]);
	kvd_store_seq_free(s, q[29]);
	kvd_store_seq_free(s, q[20]);
	assert_int_equal(kvd_store_owner_count(s, 2), 7);
	/* a walk that frees every other one as it goes */
	struct owned_walk w = { s, 1, 0, 0 };

	assert_int_equal(kvd_store_each_owned(s, 1, owned_free_odd, &w), 20);
	assert_int_equal(w.freed, 10);
	assert_int_equal(kvd_store_owner_count(s, 1), 10);
	/* disowned, a sequence can be claimed by another; owned, it cannot */
	kvd_store_seq_disown(s, q[30]);
	assert_int_equal(kvd_store_seq_owner(q[30]), 0);
	assert_int_equal(kvd_store_owner_count(s, 3), 4);
	assert_int_equal(kvd_store_seq_claim(s, q[30], 2), 0);
	assert_int_equal(kvd_store_owner_count(s, 2), 8);
	assert_int_equal(kvd_store_seq_claim(s, q[31], 2), -EBUSY);
	assert_int_equal(kvd_store_seq_claim(s, q[31], 3), 0);
	assert_int_equal(kvd_store_owner_count(s, 3), 4);
	/* no owner: in no list */
	assert_int_equal(kvd_store_seq_adopt(s, p, "1:t", 12345, 0, &orphan), 0);
	assert_int_equal(kvd_store_owner_count(s, 0), 0);
	/* every owner's walk visits exactly its count, all its own */
	static const uint64_t owners[] = { 1, 2, 3, 257 };

	for (int i = 0; i < 4; i++) {
		struct owned_walk x = { s, owners[i], 0, 0 };

		assert_int_equal(kvd_store_each_owned(s, owners[i], owned_count, &x),
				 kvd_store_owner_count(s, owners[i]));
		assert_int_equal(x.n, kvd_store_owner_count(s, owners[i]));
	}
	/* what is left goes with the store (ASan: no entry leaks) */
	kvd_store_profile_unref(s, p);
	kvd_store_destroy(s);
}

/* Without limits everything works as before (old API included). */
static void test_no_limits(void **state)
{
	struct kvd_store *s = store(NULL);
	struct kvd_profile a = profile("old", 3);
	const struct kvd_profile *p;
	struct kvd_store_stats st;
	struct kvd_seqn *q;
	char msg[200];

	assert_int_equal(kvd_store_profile(s, &a, &p), 0);
	assert_ptr_equal(kvd_store_profile_by_id(s, p->id), p);
	assert_ptr_equal(kvd_store_profile_by_name(s, "old"), p);
	assert_int_equal(kvd_store_seq_create(s, p, "42:t", 7, &q), 0);
	assert_int_equal(kvd_store_seq_uid(q), 42);
	assert_int_equal(kvd_store_tenant_uid("x:y"), 0);
	assert_int_equal(kvd_store_tenant_uid("12"), 0);
	assert_int_equal(prefill1(s, q, 1, msg, sizeof msg), 0);
	kvd_store_stats(s, &st);
	assert_true(st.bytes > 0);
	assert_true(st.fixed_bytes > 0);
	kvd_store_seq_drop(s, q);
	assert_int_equal(kvd_store_seq_bytes(q), 0);
	kvd_store_seq_free(s, q);
	kvd_store_stats(s, &st);
	assert_int_equal(st.bytes, 0);
	assert_int_equal(st.fixed_bytes, 0);
	assert_int_equal(st.profiles, 1);       /* old-API profiles stay */
	kvd_store_destroy(s);
}

/* ---- staging and seal rules --------------------------------------------- */

/* Rows whose every element says which head and token it is, so a row that
 * lands in the wrong place (staging compaction, the tail's wrap) shows. */
static uint16_t row_elem(uint32_t h, uint32_t tok, uint32_t e, uint32_t salt)
{
	uint32_t x = e == 0 ? tok & 0xff : e == 1 ? tok >> 8 : (h * 31 + e * 7 + salt) & 0xff;

	/* a finite bf16 in [-2, -1] or [1, 2]: 8 bits of x */
	return (uint16_t)(0x3f80 | (x & 0x7f) | ((x & 0x80) << 8));
}

static uint16_t code_of(uint32_t h, uint32_t t, uint32_t tok)
{
	return (uint16_t)((tok * 7 + t * 3 + h * 5) & ((1u << KB) - 1));
}

/* Tokens [t0, t0 + n) as a batch: k, v [KV][n][D], codes [KV][LT][n]. */
struct batch {
	uint16_t *k, *v, *c;
	uint32_t n;
};

static struct batch batch_make(uint32_t t0, uint32_t n)
{
	struct batch b = { xmalloc((size_t)KV * n * D * 2), xmalloc((size_t)KV * n * D * 2),
			   xmalloc((size_t)KV * LT * n * 2), n };

	for (uint32_t h = 0; h < KV; h++) {
		for (uint32_t i = 0; i < n; i++) {
			for (uint32_t e = 0; e < D; e++) {
				b.k[((size_t)h * n + i) * D + e] = row_elem(h, t0 + i, e, 1);
				b.v[((size_t)h * n + i) * D + e] = row_elem(h, t0 + i, e, 2);
			}
			for (uint32_t t = 0; t < LT; t++)
				b.c[((size_t)h * LT + t) * n + i] = code_of(h, t, t0 + i);
		}
	}
	return b;
}

static void batch_free(struct batch *b)
{
	free(b->k);
	free(b->v);
	free(b->c);
}

/* PREFILL (append = 0) or APPEND of tokens [t0, t0 + n) into layer ly. */
static int rows(struct kvd_store *s, struct kvd_seqn *q, uint32_t ly, int is_append, int last,
		int mean, uint32_t t0, uint32_t n, char *msg, size_t msglen)
{
	static float m[KV * D];
	struct batch b = batch_make(t0, n);
	int rc = kvd_store_rows(s, q, ly, is_append, last, mean ? m : NULL, b.k, b.v, b.c, n, msg,
				msglen);

	batch_free(&b);
	return rc;
}

/* Segment j of the view holds tokens [t0, t0 + n) in order: rows, and every
 * token in the bucket of its code in each table. */
static void seg_holds(const struct kvd_layer_view *lv, uint32_t j, uint32_t t0, uint32_t n)
{
	const struct kvd_seg *sg;

	assert_true(j < lv->nseg);
	sg = lv->seg[j];
	assert_int_equal(sg->n, n);
	for (uint32_t h = 0; h < KV; h++) {
		const struct kvd_lsh_tables *tb = &sg->h[h].tab;

		for (uint32_t i = 0; i < n; i++) {
			for (uint32_t e = 0; e < D; e++) {
				if (sg->h[h].k[(size_t)i * D + e] != row_elem(h, t0 + i, e, 1) ||
				    sg->h[h].v[(size_t)i * D + e] != row_elem(h, t0 + i, e, 2))
					fail_msg("segment %u head %u row %u is not token %u", j, h, i,
						 t0 + i);
			}
		}
		assert_int_equal(tb->n, n);
		for (uint32_t t = 0; t < LT; t++) {
			const uint16_t *off = tb->off + (size_t)t * ((1u << KB) + 1);
			uint32_t seen = 0;

			for (uint32_t bk = 0; bk < (1u << KB); bk++) {
				uint16_t len = (uint16_t)(off[bk + 1] - off[bk]);

				for (uint16_t x = 0; x < len; x++) {
					uint16_t id = tb->ids[(size_t)t * n + off[bk] + x];

					assert_true(id < n);
					if (code_of(h, t, t0 + id) != bk)
						fail_msg("segment %u head %u table %u: token %u in bucket %u",
							 j, h, t, t0 + id, bk);
				}
				seen += len;
			}
			assert_int_equal(seen, n);
		}
	}
}

/* The tail's rows [0, n) are tokens [t0, t0 + n). */
static void tail_holds(const struct kvd_layer_view *lv, uint32_t t0, uint32_t n)
{
	assert_int_equal(lv->tail_n, n);
	assert_int_equal(lv->tail_cap, 64);
	for (uint32_t h = 0; h < KV; h++)
		for (uint32_t i = 0; i < n; i++)
			for (uint32_t e = 0; e < D; e++)
				if (lv->tail_k[((size_t)h * lv->tail_cap + i) * D + e] !=
				    row_elem(h, t0 + i, e, 1) ||
				    lv->tail_v[((size_t)h * lv->tail_cap + i) * D + e] !=
				    row_elem(h, t0 + i, e, 2))
					fail_msg("tail head %u row %u is not token %u", h, i, t0 + i);
}

static uint64_t tokens_of(const struct kvd_seqn *q)
{
	uint64_t tokens;
	uint32_t segs;

	kvd_store_seq_stats(q, &tokens, &segs);
	return tokens;
}

/* PREFILL goes to staging and seals a segment every seg_tokens (256 here),
 * across chunk boundaries; LAST seals what is staged, and only then is the
 * sequence spillable.  All of it charged, and given back. */
static void test_prefill_staging_seals(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 4);
	const struct kvd_profile *p;
	struct kvd_layer_view lv;
	struct kvd_seqn *q;
	char msg[256];

	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_spillable(q), 1);

	/* 100 tokens: staged, nothing sealed, not spillable */
	assert_int_equal(rows(s, q, 0, 0, 0, 1, 0, 100, msg, sizeof msg), 0);
	lv = kvd_store_view(q, 0);
	assert_int_equal(lv.nseg, 0);
	assert_int_equal(lv.tail_n, 0);
	assert_int_equal(tokens_of(q), 100);
	assert_int_equal(kvd_store_spillable(q), 0);
	assert_true(kvd_store_seq_bytes(q) > 0);
	/* 500 more: segments at 256 and 512, 88 staged */
	assert_int_equal(rows(s, q, 0, 0, 0, 0, 100, 500, msg, sizeof msg), 0);
	lv = kvd_store_view(q, 0);
	assert_int_equal(lv.nseg, 2);
	seg_holds(&lv, 0, 0, 256);
	seg_holds(&lv, 1, 256, 256);
	assert_int_equal(tokens_of(q), 600);
	assert_int_equal(kvd_store_spillable(q), 0);
	/* LAST of no more tokens seals the 88 staged */
	assert_int_equal(rows(s, q, 0, 0, 1, 0, 600, 0, msg, sizeof msg), 0);
	lv = kvd_store_view(q, 0);
	assert_int_equal(lv.nseg, 3);
	seg_holds(&lv, 2, 512, 88);
	assert_int_equal(lv.tail_n, 0);
	assert_int_equal(tokens_of(q), 600);
	assert_int_equal(kvd_store_spillable(q), 1);

	/* layer 1: exactly one segment's worth with LAST seals no empty one */
	assert_int_equal(rows(s, q, 1, 0, 1, 1, 0, 256, msg, sizeof msg), 0);
	lv = kvd_store_view(q, 1);
	assert_int_equal(lv.nseg, 1);
	seg_holds(&lv, 0, 0, 256);
	assert_int_equal(kvd_store_spillable(q), 1);
	assert_int_equal(store_total(s), mem_total(l));

	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* A layer cannot be attended while its prefill is under way (its staged
 * rows are in no view), from the first PREFILL to the LAST; before any rows
 * and after the LAST, and through APPENDs, it can.  Layers are independent.
 * A sequence belongs to the client that claimed it first. */
static void test_attend_ready(void **state)
{
	struct kvd_store *s = store(NULL);
	struct kvd_profile want = profile("p", 6);
	const struct kvd_profile *p;
	struct kvd_seqn *q;
	char msg[256];

	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_attend_ready(q, 0), 0);
	assert_int_equal(rows(s, q, 0, 0, 0, 1, 0, 100, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_attend_ready(q, 0), -EBUSY);
	assert_int_equal(kvd_store_attend_ready(q, 1), 0);
	/* a full segment sealed mid-prefill does not make the layer ready */
	assert_int_equal(rows(s, q, 0, 0, 0, 0, 100, 300, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_view(q, 0).nseg, 1);
	assert_int_equal(kvd_store_attend_ready(q, 0), -EBUSY);
	assert_int_equal(rows(s, q, 0, 0, 1, 0, 400, 10, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_attend_ready(q, 0), 0);
	assert_int_equal(rows(s, q, 0, 1, 0, 0, 410, 5, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_attend_ready(q, 0), 0);

	assert_int_equal(kvd_store_seq_owner(q), 1);
	assert_int_equal(kvd_store_seq_claim(s, q, 2), -EBUSY);
	assert_int_equal(kvd_store_seq_owner(q), 1);
	assert_int_equal(kvd_store_seq_claim(s, q, 1), 0);
	assert_int_equal(kvd_store_seq_state(q), KVD_SEQ_RAM);
	assert_int_equal(kvd_store_seq_ready_layers(q), LAYERS);

	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	kvd_store_destroy(s);
}

/* The want hook of test_attend_view: records what it was asked and answers
 * want_rc. */
static int want_rc, want_calls;
static uint32_t want_layer;

static int want(void *arg, struct kvd_seqn *q, uint32_t layer, char *msg, size_t msglen)
{
	want_calls++;
	want_layer = layer;
	if (want_rc)
		snprintf(msg, msglen, "the hook says no");
	return want_rc;
}

/* kvd_store_attend_view: one record's whole view, its checks in order --
 * the sequence (tenant, profile), the pool, the tier's residency (the want
 * hook's answer passed on, message and all), the prefill -- and then what
 * the separate calls give: the view, the estimator state, pool and node. */
static void test_attend_view(void **state)
{
	struct kvd_store *s = store(NULL);
	struct kvd_profile want_p = profile("av", 3);
	const struct kvd_profile *p;
	struct kvd_store_attend_view v;
	struct kvd_layer_view lv;
	struct kvd_seqn *q;
	uint64_t id;
	char msg[256];

	want_p.estimator = KVD_EST_HYBRID;
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want_p, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	id = kvd_store_seq_id(q);
	kvd_store_set_want(s, want, NULL);
	want_rc = want_calls = 0;

	assert_int_equal(kvd_store_attend_view(s, id, "9:u", p->id, 0, NULL, &v, msg, sizeof msg),
			 -ENOENT);
	assert_non_null(strstr(msg, "is gone"));
	assert_int_equal(kvd_store_attend_view(s, id, "9:t", p->id + 1, 0, NULL, &v, msg,
					       sizeof msg), -ENOENT);
	assert_int_equal(kvd_store_attend_view(s, id, "9:t", p->id, 0, (struct kvd_pool *)&v, &v,
					       msg, sizeof msg), 1);
	assert_int_equal(want_calls, 0);

	want_rc = -EINPROGRESS;
	assert_int_equal(kvd_store_attend_view(s, id, "9:t", p->id, 1, NULL, &v, msg, sizeof msg),
			 -EINPROGRESS);
	assert_int_equal(want_calls, 1);
	assert_int_equal(want_layer, 1);
	want_rc = -KVD_ELOST;
	assert_int_equal(kvd_store_attend_view(s, id, "9:t", p->id, 1, NULL, &v, msg, sizeof msg),
			 -KVD_ELOST);
	assert_string_equal(msg, "the hook says no");
	want_rc = 0;

	assert_int_equal(rows(s, q, 0, 0, 0, 1, 0, 300, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_attend_view(s, id, "9:t", p->id, 0, NULL, &v, msg, sizeof msg),
			 -EBUSY);
	assert_string_equal(msg, "layer 0 is still being prefilled");
	assert_int_equal(rows(s, q, 0, 0, 1, 0, 300, 10, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 0, 1, 0, 0, 310, 5, msg, sizeof msg), 0);

	assert_int_equal(kvd_store_attend_view(s, id, "9:t", p->id, 0, kvd_store_pool(s, q), &v,
					       msg, sizeof msg), 0);
	lv = kvd_store_view(q, 0);
	assert_ptr_equal(v.q, q);
	assert_ptr_equal(v.p, p);
	assert_ptr_equal(v.lv.seg, lv.seg);
	assert_int_equal(v.lv.nseg, lv.nseg);
	assert_ptr_equal(v.lv.tail_k, lv.tail_k);
	assert_ptr_equal(v.lv.tail_v, lv.tail_v);
	assert_int_equal(v.lv.tail_n, lv.tail_n);
	assert_int_equal(v.lv.tail_cap, lv.tail_cap);
	assert_int_equal(v.lv.nseg, 2);          /* 256 sealed full, 54 at the LAST */
	assert_int_equal(v.lv.tail_n, 5);
	assert_non_null(v.heavy);
	assert_ptr_equal(v.heavy, kvd_store_layer_heavy(s, q, 0));
	assert_ptr_equal(v.pool, kvd_store_pool(s, q));
	assert_int_equal(v.node, kvd_store_seq_node(q));

	kvd_store_set_want(s, NULL, NULL);
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	kvd_store_destroy(s);
}

/* APPEND fills the tail and seals it into a segment at seal_tokens (64
 * here), then starts over at the tail's row 0, also within one call. */
static void test_append_tail_seals(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 5);
	const struct kvd_profile *p;
	struct kvd_layer_view lv;
	struct kvd_seqn *q;
	uint32_t tok = 300;
	size_t bytes;
	char msg[256];

	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 1, 0, 1, 1, 0, tok, msg, sizeof msg), 0);
	lv = kvd_store_view(q, 1);
	assert_int_equal(lv.nseg, 2);           /* 256 + 44 */
	assert_int_equal(lv.tail_n, 0);

	/* one token at a time up to seal_tokens - 1: all in the tail */
	for (uint32_t i = 0; i < 63; i++, tok++)
		assert_int_equal(rows(s, q, 1, 1, 0, 0, tok, 1, msg, sizeof msg), 0);
	lv = kvd_store_view(q, 1);
	assert_int_equal(lv.nseg, 2);
	tail_holds(&lv, 300, 63);
	bytes = kvd_store_seq_bytes(q);
	/* the 64th seals the tail into a segment and empties it */
	assert_int_equal(rows(s, q, 1, 1, 0, 0, tok++, 1, msg, sizeof msg), 0);
	lv = kvd_store_view(q, 1);
	assert_int_equal(lv.nseg, 3);
	seg_holds(&lv, 2, 300, 64);
	assert_int_equal(lv.tail_n, 0);
	assert_true(kvd_store_seq_bytes(q) > bytes);
	/* 5 more start at the tail's row 0 */
	assert_int_equal(rows(s, q, 1, 1, 0, 0, tok, 5, msg, sizeof msg), 0);
	tok += 5;
	lv = kvd_store_view(q, 1);
	tail_holds(&lv, 364, 5);
	/* 130 in one call: 59 fill the tail, 64 seal again, 7 stay */
	assert_int_equal(rows(s, q, 1, 1, 0, 0, tok, 130, msg, sizeof msg), 0);
	tok += 130;
	lv = kvd_store_view(q, 1);
	assert_int_equal(lv.nseg, 5);
	seg_holds(&lv, 3, 364, 64);
	seg_holds(&lv, 4, 428, 64);
	tail_holds(&lv, 492, 7);
	assert_int_equal(tokens_of(q), tok);
	/* the other layer is untouched */
	lv = kvd_store_view(q, 0);
	assert_int_equal(lv.nseg, 0);
	assert_int_equal(lv.tail_n, 0);
	assert_int_equal(kvd_store_spillable(q), 1);
	assert_int_equal(store_total(s), mem_total(l));

	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* A big APPEND into the tail of a profile that seals late is copied over
 * the pool in slices, the caller's yield hook running between them (where
 * the daemon serves other clients), with every row and code in its place. */
static unsigned yields;

static void count_yield(void *arg)
{
	(void)arg;
	yields++;
}

static void test_big_append_sliced(void **state)
{
	enum { SEAL = 16384, N = 16000 };
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 7);
	const struct kvd_profile *p;
	struct kvd_layer_view lv;
	struct kvd_seqn *q;
	const uint16_t *codes;
	char msg[256];

	(void)state;
	want.seg_tokens = SEAL;
	want.seal_tokens = SEAL;
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 1, 0, 1, 1, 0, 10, msg, sizeof msg), 0);
	yields = 0;
	kvd_pool_set_yield(count_yield, NULL);
	assert_int_equal(rows(s, q, 1, 1, 0, 0, 10, N, msg, sizeof msg), 0);
	kvd_pool_set_yield(NULL, NULL);
	/* 4 chunks of 4096 rows in each of 2 heads: 4 slices on 2 workers */
	assert_true(yields >= 3);
	lv = kvd_store_view(q, 1);
	assert_int_equal(lv.nseg, 1);
	assert_int_equal(lv.tail_n, N);
	assert_int_equal(lv.tail_cap, SEAL);
	codes = kvd_store_layer_tail_codes(q, 1);
	for (uint32_t h = 0; h < KV; h++) {
		for (uint32_t i = 0; i < N; i++) {
			for (uint32_t e = 0; e < D; e++)
				if (lv.tail_k[((size_t)h * SEAL + i) * D + e] != row_elem(h, 10 + i, e, 1) ||
				    lv.tail_v[((size_t)h * SEAL + i) * D + e] != row_elem(h, 10 + i, e, 2))
					fail_msg("tail head %u row %u is not token %u", h, i, 10 + i);
			for (uint32_t t = 0; t < LT; t++)
				if (codes[((size_t)h * LT + t) * SEAL + i] != code_of(h, t, 10 + i))
					fail_msg("tail head %u table %u row %u: wrong code", h, t, i);
		}
	}
	assert_int_equal(store_total(s), mem_total(l));
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* Rows out of order are refused with a message, and a refused call changes
 * nothing: no bytes, no tokens, no generation. */
static void test_row_order_refused(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 6);
	static uint8_t dense1[LAYERS] = { 0, 1 };
	const struct kvd_profile *p;
	struct kvd_seqn *q;
	char msg[256];

	want.dense = dense1;
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);

#define REFUSED(call, why) do {							\
		size_t b0 = kvd_store_seq_bytes(q);				\
		uint64_t g0 = kvd_store_seq_gen(q);				\
		uint64_t t0 = tokens_of(q), m0 = mem_total(l);		\
		msg[0] = 0;							\
		assert_int_equal((call), -EINVAL);				\
		if (!strstr(msg, (why)))					\
			fail_msg("\"%s\" does not say \"%s\"", msg, (why));	\
		assert_int_equal(kvd_store_seq_bytes(q), b0);			\
		assert_int_equal(kvd_store_seq_gen(q), g0);			\
		assert_int_equal(tokens_of(q), t0);				\
		assert_int_equal(mem_total(l), m0);				\
	} while (0)

	REFUSED(rows(s, q, 0, 0, 0, 0, 0, 10, msg, sizeof msg), "first rows must carry the mean");
	REFUSED(rows(s, q, 0, 1, 0, 1, 0, 10, msg, sizeof msg),
		"APPEND before the prefill's last chunk");
	REFUSED(rows(s, q, 1, 0, 0, 1, 0, 10, msg, sizeof msg), "dense");
	REFUSED(rows(s, q, LAYERS, 0, 0, 1, 0, 10, msg, sizeof msg), "out of range");
	assert_int_equal(rows(s, q, 0, 0, 0, 1, 0, 10, msg, sizeof msg), 0);
	REFUSED(rows(s, q, 0, 0, 0, 1, 10, 10, msg, sizeof msg), "already has its mean");
	REFUSED(rows(s, q, 0, 1, 0, 0, 10, 1, msg, sizeof msg),
		"APPEND before the prefill's last chunk");
	assert_int_equal(rows(s, q, 0, 0, 1, 0, 10, 10, msg, sizeof msg), 0);
	REFUSED(rows(s, q, 0, 0, 0, 0, 20, 10, msg, sizeof msg), "PREFILL after the last chunk");
	REFUSED(rows(s, q, 0, 0, 1, 0, 20, 0, msg, sizeof msg), "PREFILL after the last chunk");
	REFUSED(rows(s, q, 0, 1, 0, 1, 20, 1, msg, sizeof msg), "already has its mean");
	assert_int_equal(rows(s, q, 0, 1, 0, 0, 20, 1, msg, sizeof msg), 0);
#undef REFUSED
	assert_int_equal(tokens_of(q), 21);

	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* The estimator state of a hybrid or adaptive profile's sparse layer:
 * allocated zero-filled on first use, counted in the sequence's bytes and
 * charged to its uid, the same pointer (and contents) until the layer's
 * resident data goes, given back by drop and by free; none for a magicpig
 * profile or a dense layer, and none (no error) when the charge is refused;
 * a restore puts it back (kvd_store_install_heavy) charged the same, and
 * handing it out for a step moves the sequence's gen.  A profile of the
 * same name with another estimator is another profile. */
static void test_heavy_state(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	static uint8_t dn[LAYERS] = { 0, 1 };   /* layer 1 stays on the GPU */
	struct kvd_profile want = profile("hy", 8), mp = profile("mp", 8);
	const struct kvd_profile *p, *pm, *px;
	struct kvd_seqn *q, *qm;
	uint32_t *h, *h2;
	uint64_t base, seqb;
	size_t words, hb;
	char msg[256];

	want.estimator = KVD_EST_HYBRID;
	want.dense = dn;
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(p->estimator, KVD_EST_HYBRID);
	words = kvd_heavy_words(&p->g);
	hb = words * sizeof(uint32_t);
	assert_int_equal(words, p->g.q_heads * (1 + KVD_HEAVY_MAX));
	/* equal fields but the estimator: -EEXIST; equal: the same profile */
	want.estimator = KVD_EST_ADAPTIVE;
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &px, msg, sizeof msg), -EEXIST);
	assert_non_null(strstr(msg, "exists with other fields"));
	want.estimator = KVD_EST_HYBRID;
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &px, msg, sizeof msg), 0);
	assert_ptr_equal(px, p);
	kvd_store_profile_unref(s, px);

	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	base = mem_total(l);
	assert_int_equal(kvd_store_seq_bytes(q), 0);

	/* first use: zero-filled, charged, counted in the sequence's bytes */
	h = kvd_store_layer_heavy(s, q, 0);
	assert_non_null(h);
	for (size_t i = 0; i < words; i++)
		assert_int_equal(h[i], 0);
	assert_int_equal(kvd_store_seq_bytes(q), hb);
	assert_int_equal(mem_total(l), base + hb);
	assert_int_equal(store_total(s), mem_total(l));
	/* later uses: the same state, kept as the engine left it, not charged again */
	for (size_t i = 0; i < words; i++)
		h[i] = (uint32_t)(i * 2654435761u);
	h2 = kvd_store_layer_heavy(s, q, 0);
	assert_ptr_equal(h2, h);
	assert_int_equal(h2[words - 1], (uint32_t)((words - 1) * 2654435761u));
	assert_int_equal(mem_total(l), base + hb);
	/* a dense layer and a layer out of range have none */
	assert_null(kvd_store_layer_heavy(s, q, 1));
	assert_null(kvd_store_layer_heavy(s, q, LAYERS));
	assert_int_equal(mem_total(l), base + hb);

	/* with rows beside it, drop gives all of it back */
	assert_int_equal(rows(s, q, 0, 0, 1, 1, 0, 300, msg, sizeof msg), 0);
	seqb = kvd_store_seq_bytes(q);
	assert_true(seqb > hb);
	assert_int_equal(mem_total(l), base + seqb);
	kvd_store_seq_drop(s, q);
	assert_int_equal(kvd_store_seq_bytes(q), 0);
	assert_int_equal(mem_total(l), base);
	assert_int_equal(store_total(s), mem_total(l));
	/* a restore puts the lists back as they were written (a HEAVY
	 * extent): a copy, charged as first use charges it */
	{
		uint32_t *w = malloc(hb);
		uint64_t gen;

		assert_non_null(w);
		for (size_t i = 0; i < words; i++)
			w[i] = (uint32_t)(i * 40503u + 7);
		q->state = KVD_SEQ_RESTORING;
		assert_int_equal(kvd_store_install_heavy(s, q, 1, w), -EINVAL);  /* dense */
		assert_int_equal(kvd_store_install_heavy(s, q, LAYERS, w), -EINVAL);
		assert_int_equal(mem_total(l), base);
		assert_int_equal(kvd_store_install_heavy(s, q, 0, w), 0);
		assert_int_equal(kvd_store_seq_bytes(q), hb);
		assert_int_equal(mem_total(l), base + hb);
		assert_int_equal(kvd_store_install_heavy(s, q, 0, w), -EINVAL);  /* has one */
		assert_int_equal(mem_total(l), base + hb);
		q->state = KVD_SEQ_RAM;
		/* handed out for a step: the same words, and the gen moves (a
		 * file written before holds other lists) */
		gen = kvd_store_seq_gen(q);
		h = kvd_store_layer_heavy(s, q, 0);
		assert_non_null(h);
		assert_memory_equal(h, w, hb);
		assert_true(kvd_store_seq_gen(q) > gen);
		free(w);
		kvd_store_seq_drop(s, q);
		assert_int_equal(mem_total(l), base);
	}
	/* dropped with no file to come back from: empty lists again */
	h = kvd_store_layer_heavy(s, q, 0);
	assert_non_null(h);
	for (size_t i = 0; i < words; i++)
		assert_int_equal(h[i], 0);
	assert_int_equal(mem_total(l), base + hb);

	/* a magicpig profile: none, nothing charged */
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &mp, &pm, msg, sizeof msg), 0);
	assert_int_equal(pm->estimator, KVD_EST_MAGICPIG);
	assert_int_equal(kvd_store_seq_create_uid(s, pm, 9, "9:t", 1, &qm, msg, sizeof msg), 0);
	seqb = mem_total(l);
	assert_null(kvd_store_layer_heavy(s, qm, 0));
	assert_null(kvd_store_layer_heavy(s, qm, 1));
	assert_int_equal(kvd_store_seq_bytes(qm), 0);
	assert_int_equal(mem_total(l), seqb);
	/* and a file that says otherwise does not fit it */
	qm->state = KVD_SEQ_RESTORING;
	assert_int_equal(kvd_store_install_heavy(s, qm, 0, h), -EINVAL);
	qm->state = KVD_SEQ_RAM;
	assert_int_equal(mem_total(l), seqb);
	kvd_store_seq_free(s, qm);
	kvd_store_profile_unref(s, pm);

	/* free gives the state back with the rest */
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	assert_int_equal(kvd_limits_uids(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);

	/* at the memory limit: no state, no error, nothing charged; the
	 * layer is attended by magicpig */
	l = limits(UINT64_MAX, 0, 0, 0);
	s = store(l);
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	base = mem_total(l);
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
	l = limits(base + hb - 1, 0, 0, 0);
	s = store(l);
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	assert_int_equal(mem_total(l), base);
	assert_null(kvd_store_layer_heavy(s, q, 0));
	assert_int_equal(kvd_store_seq_bytes(q), 0);
	assert_int_equal(mem_total(l), base);
	assert_int_equal(store_total(s), mem_total(l));
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
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

/* A fork shares its parent's sealed segments and open tails (the same
 * objects, one more reference each) and copies the mean; each side then
 * seals its own segments; freeing either first leaves the other whole; it
 * is charged for what it copies, not for the segments and tails it shares
 * (those stay charged once, to their maker, until their last holder lets
 * go, so the uid's charge never falls short of what is held) and
 * everything returns to zero.  Mid-prefill, over the uid's
 * memory, or on disk, the fork is refused and nothing is left behind. */
static void test_fork(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 4);
	const struct kvd_profile *p;
	struct kvd_layer_view a, b;
	struct kvd_seqn *q, *f, *g;
	char msg[256];

	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	/* mid-prefill: refused */
	assert_int_equal(rows(s, q, 0, 0, 0, 1, 0, 300, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_fork(s, q, 9, "9:t", 2, &f, msg, sizeof msg), -EBUSY);
	assert_non_null(strstr(msg, "prefilled"));
	assert_int_equal(rows(s, q, 0, 0, 1, 0, 300, 300, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 1, 0, 1, 1, 0, 256, msg, sizeof msg), 0);
	/* 40 decoded tokens in layer 0's tail */
	assert_int_equal(rows(s, q, 0, 1, 0, 0, 600, 40, msg, sizeof msg), 0);

	uint64_t before = mem_total(l);
	size_t qb = kvd_store_seq_bytes(q);

	assert_int_equal(kvd_store_seq_fork(s, q, 9, "9:t", 2, &f, msg, sizeof msg), 0);
	assert_true(kvd_store_seq_id(f) != kvd_store_seq_id(q));
	assert_int_equal(kvd_store_seq_owner(f), 2);
	assert_ptr_equal(kvd_store_seq_profile(f), p);
	assert_int_equal(tokens_of(f), tokens_of(q));
	assert_int_equal(kvd_store_seq_bytes(f), qb);
	/* charged its own struct, means and tables: not the segments, nor
	 * layer 0's tail (64 rows: K, V and codes, and its struct) */
	{
		size_t segs = 0, tailb;

		for (uint32_t j = 0; j < 2; j++)
			for (uint32_t k = 0; k < kvd_store_view(q, j).nseg; k++)
				segs += kvd_store_view(q, j).seg[k]->bytes;
		assert_true(segs > 0);
		tailb = qb - segs - kvd_store_seq_freeable(f);
		assert_true(tailb >= TAIL_ROWS_BYTES && tailb < TAIL_ROWS_BYTES + 256);
		assert_true(mem_total(l) - before > qb - segs - tailb &&
			    mem_total(l) - before < qb - segs - tailb + 4096);
	}
	assert_int_equal(store_total(s), mem_total(l));
	a = kvd_store_view(q, 0);
	b = kvd_store_view(f, 0);
	assert_int_equal(a.nseg, 3);
	assert_int_equal(b.nseg, 3);
	for (uint32_t j = 0; j < a.nseg; j++) {
		assert_ptr_equal(a.seg[j], b.seg[j]);
		assert_int_equal(a.seg[j]->refs, 2);
	}
	assert_ptr_equal(a.tail_k, b.tail_k);
	assert_ptr_equal(kvd_store_layer_tail_codes(q, 0), kvd_store_layer_tail_codes(f, 0));
	tail_holds(&b, 600, 40);
	assert_memory_equal(kvd_store_layer_mean(q, 0), kvd_store_layer_mean(f, 0),
			    KV * D * sizeof(float));
	assert_true(kvd_store_layer_mean(q, 0) != kvd_store_layer_mean(f, 0));

	/* they diverge: the parent's next 24 tokens seal its tail (64), the
	 * child's 10 others stay in its own */
	assert_int_equal(rows(s, q, 0, 1, 0, 0, 640, 24, msg, sizeof msg), 0);
	assert_int_equal(rows(s, f, 0, 1, 0, 0, 5000, 10, msg, sizeof msg), 0);
	a = kvd_store_view(q, 0);
	b = kvd_store_view(f, 0);
	assert_int_equal(a.nseg, 4);
	assert_int_equal(b.nseg, 3);
	seg_holds(&a, 3, 600, 64);
	assert_int_equal(b.tail_n, 50);
	assert_true(a.tail_k != b.tail_k);
	assert_int_equal(store_total(s), mem_total(l));

	/* a fork of the fork; then the original goes first */
	assert_int_equal(kvd_store_seq_fork(s, f, 9, "9:t", 3, &g, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_view(g, 1).seg[0]->refs, 3);
	/* what freeing a set gives back: all three, everything but the
	 * profile; q alone, exactly what its free then gives back (the
	 * segments f and g hold stay) */
	{
		struct kvd_seqn *all[3] = { q, f, g };
		uint64_t fq = kvd_store_freeable_set(all, 1), m = mem_total(l);

		assert_int_equal(kvd_store_freeable_set(all, 3), m - kvd_store_profile_bytes(p));
		assert_true(kvd_store_freeable_set(all + 1, 2) < kvd_store_freeable_set(all, 3) - fq);
		kvd_store_seq_free(s, q);
		assert_int_equal(m - mem_total(l), fq);
	}
	/* the segments q made stay charged while f and g hold them */
	assert_int_equal(store_total(s), mem_total(l));
	b = kvd_store_view(f, 0);
	assert_int_equal(b.seg[0]->refs, 2);
	seg_holds(&b, 0, 0, 256);
	seg_holds(&b, 2, 512, 88);
	kvd_store_seq_free(s, f);
	b = kvd_store_view(g, 0);
	assert_int_equal(b.seg[0]->refs, 1);
	seg_holds(&b, 1, 256, 256);
	kvd_store_seq_free(s, g);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	assert_int_equal(store_total(s), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* Rows [row0, row0 + n) of a layer's tail are tokens [t0, t0 + n): K, V
 * and codes. */
static void tail_rows(const struct kvd_seqn *q, uint32_t ly, uint32_t row0, uint32_t t0,
		      uint32_t n)
{
	struct kvd_layer_view lv = kvd_store_view(q, ly);
	const uint16_t *c = kvd_store_layer_tail_codes(q, ly);

	assert_true(row0 + n <= lv.tail_n);
	assert_non_null(c);
	for (uint32_t h = 0; h < KV; h++) {
		for (uint32_t i = row0; i < row0 + n; i++) {
			for (uint32_t e = 0; e < D; e++)
				if (lv.tail_k[((size_t)h * lv.tail_cap + i) * D + e] !=
				    row_elem(h, t0 + i - row0, e, 1) ||
				    lv.tail_v[((size_t)h * lv.tail_cap + i) * D + e] !=
				    row_elem(h, t0 + i - row0, e, 2))
					fail_msg("layer %u tail head %u row %u is not token %u", ly, h,
						 i, t0 + i - row0);
			for (uint32_t t = 0; t < LT; t++)
				if (c[((size_t)h * LT + t) * lv.tail_cap + i] !=
				    code_of(h, t, t0 + i - row0))
					fail_msg("layer %u tail head %u table %u row %u: code", ly, h, t,
						 i);
		}
	}
}

/* A prefilled sequence of uid 9 with open tails: 40 rows in layer 0
 * (tokens 600..639), 20 in layer 1 (700..719). */
static struct kvd_seqn *tailed(struct kvd_store *s, const struct kvd_profile *p)
{
	struct kvd_seqn *q;
	char msg[256];

	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	for (uint32_t ly = 0; ly < LAYERS; ly++)
		assert_int_equal(rows(s, q, ly, 0, 1, 1, 0, 300, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 0, 1, 0, 0, 600, 40, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 1, 1, 0, 0, 700, 20, msg, sizeof msg), 0);
	return q;
}

/* A fork copies no tail: it takes a reference on each layer's (the same
 * buffers, not charged again, so the fork costs less than one tail).  The
 * first APPEND of any holder copies that one layer's rows into a tail of
 * its own, charged then; the others' rows stay bit for bit; the last
 * holder writes in place, without a copy.  Seals work on each side, a drop
 * while shared leaves the others whole, and freeing in any order returns
 * every byte. */
static void test_fork_shares_tails(void **state)
{
	struct kvd_limits *l = limits(0, 0, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 5);
	const struct kvd_profile *p;
	struct kvd_layer_view a, b, c;
	struct kvd_seqn *q, *f, *g;
	const uint16_t *k0;
	uint64_t m0;
	size_t qb;
	char msg[256];

	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	q = tailed(s, p);
	m0 = mem_total(l);
	qb = kvd_store_seq_bytes(q);
	assert_int_equal(kvd_store_seq_fork(s, q, 9, "9:t", 2, &f, msg, sizeof msg), 0);
	assert_true(mem_total(l) - m0 < TAIL_ROWS_BYTES);
	assert_int_equal(store_total(s), mem_total(l));
	assert_int_equal(kvd_store_seq_bytes(f), qb);
	assert_int_equal(kvd_store_seq_fork(s, f, 9, "9:t", 3, &g, msg, sizeof msg), 0);
	for (uint32_t ly = 0; ly < LAYERS; ly++) {
		assert_ptr_equal(kvd_store_view(q, ly).tail_k, kvd_store_view(f, ly).tail_k);
		assert_ptr_equal(kvd_store_view(q, ly).tail_v, kvd_store_view(g, ly).tail_v);
		assert_ptr_equal(kvd_store_layer_tail_codes(q, ly), kvd_store_layer_tail_codes(g, ly));
	}
	/* nothing of a shared tail is freeable: dropping one holder gives
	 * none of it back */
	assert_true(kvd_store_seq_freeable(q) < qb - 2 * TAIL_ROWS_BYTES);

	/* the middle one appends: a tail of its own for layer 0, charged now */
	m0 = mem_total(l);
	assert_int_equal(rows(s, f, 0, 1, 0, 0, 5000, 3, msg, sizeof msg), 0);
	assert_true(mem_total(l) - m0 >= TAIL_ROWS_BYTES &&
		    mem_total(l) - m0 < TAIL_ROWS_BYTES + 256);
	assert_int_equal(store_total(s), mem_total(l));
	a = kvd_store_view(q, 0);
	b = kvd_store_view(f, 0);
	c = kvd_store_view(g, 0);
	assert_ptr_equal(a.tail_k, c.tail_k);
	assert_true(b.tail_k != a.tail_k);
	assert_int_equal(b.tail_n, 43);
	tail_rows(f, 0, 0, 600, 40);
	tail_rows(f, 0, 40, 5000, 3);
	assert_int_equal(a.tail_n, 40);
	assert_int_equal(c.tail_n, 40);
	tail_rows(q, 0, 0, 600, 40);
	tail_rows(g, 0, 0, 600, 40);
	/* layer 1 is still one tail for all three */
	assert_ptr_equal(kvd_store_view(f, 1).tail_k, kvd_store_view(q, 1).tail_k);

	/* the parent's 24 fill its (copied) tail and seal it; g's stays */
	assert_int_equal(rows(s, q, 0, 1, 0, 0, 640, 24, msg, sizeof msg), 0);
	a = kvd_store_view(q, 0);
	c = kvd_store_view(g, 0);
	assert_int_equal(a.nseg, 3);
	seg_holds(&a, 2, 600, 64);
	assert_int_equal(a.tail_n, 0);
	assert_int_equal(c.nseg, 2);
	tail_rows(g, 0, 0, 600, 40);
	assert_int_equal(store_total(s), mem_total(l));

	/* g is the old tail's last holder: it writes in place, no copy */
	k0 = c.tail_k;
	m0 = mem_total(l);
	assert_int_equal(rows(s, g, 0, 1, 0, 0, 900, 1, msg, sizeof msg), 0);
	assert_ptr_equal(kvd_store_view(g, 0).tail_k, k0);
	assert_int_equal(mem_total(l), m0);
	tail_rows(g, 0, 0, 600, 40);
	tail_rows(g, 0, 40, 900, 1);

	/* q dropped (written out) while it shares layer 1's tail: the tail
	 * stays with f and g, charged as before */
	m0 = mem_total(l);
	kvd_store_seq_drop(s, q);
	assert_int_equal(store_total(s), mem_total(l));
	assert_true(m0 - mem_total(l) < 2 * qb);
	tail_rows(f, 1, 0, 700, 20);
	kvd_store_seq_free(s, f);
	tail_rows(g, 1, 0, 700, 20);
	assert_int_equal(store_total(s), mem_total(l));
	/* ... and g, the last holder, seals it */
	assert_int_equal(rows(s, g, 1, 1, 0, 0, 720, 44, msg, sizeof msg), 0);
	b = kvd_store_view(g, 1);
	assert_int_equal(b.tail_n, 0);
	seg_holds(&b, b.nseg - 1, 700, 64);
	kvd_store_seq_free(s, g);
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	assert_int_equal(store_total(s), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* The copy of a shared tail is charged before the APPEND changes
 * anything: refused at the uid's limit, the child keeps sharing, with the
 * same rows, bytes and generation; once there is room, it goes through. */
static void test_fork_tail_copy_refused(void **state)
{
	struct kvd_limits *l = limits(0, 4u << 20, 0, 0);
	struct kvd_store *s = store(l);
	struct kvd_profile want = profile("p", 6);
	const struct kvd_profile *p;
	static struct kvd_seqn *fill[65536];
	struct kvd_seqn *q, *f;
	uint32_t nf = 0;
	uint64_t m0, gen;
	size_t fb;
	char msg[256];

	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	q = tailed(s, p);
	/* the child is uid 10's: what it holds of q's stays charged to 9 */
	assert_int_equal(kvd_store_seq_fork(s, q, 10, "10:t", 2, &f, msg, sizeof msg), 0);
	while (nf < 65536 &&
	       !kvd_store_seq_create_uid(s, p, 10, "10:t", 1, &fill[nf], msg, sizeof msg))
		nf++;
	assert_true(nf < 65536);
	m0 = mem_total(l);
	gen = kvd_store_seq_gen(f);
	fb = kvd_store_seq_bytes(f);
	assert_int_equal(rows(s, f, 0, 1, 0, 0, 5000, 1, msg, sizeof msg), -EDQUOT);
	assert_non_null(strstr(msg, "memory_per_uid"));
	assert_int_equal(mem_total(l), m0);
	assert_int_equal(kvd_store_seq_gen(f), gen);
	assert_int_equal(kvd_store_seq_bytes(f), fb);
	assert_ptr_equal(kvd_store_view(f, 0).tail_k, kvd_store_view(q, 0).tail_k);
	tail_rows(f, 0, 0, 600, 40);
	assert_int_equal(kvd_store_view(f, 0).tail_n, 40);
	while (nf)
		kvd_store_seq_free(s, fill[--nf]);
	assert_int_equal(rows(s, f, 0, 1, 0, 0, 5000, 1, msg, sizeof msg), 0);
	tail_rows(f, 0, 0, 600, 40);
	tail_rows(f, 0, 40, 5000, 1);
	tail_rows(q, 0, 0, 600, 40);
	assert_int_equal(kvd_store_view(q, 0).tail_n, 40);
	assert_int_equal(store_total(s), mem_total(l));
	kvd_store_seq_free(s, q);
	kvd_store_seq_free(s, f);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

/* A fork over the uid's memory is refused before anything is allocated. */
static void test_fork_over_budget(void **state)
{
	struct kvd_profile want = profile("p", 4);
	const struct kvd_profile *p;
	struct kvd_limits *l;
	struct kvd_store *s;
	struct kvd_seqn *q, *f = NULL;
	char msg[256];
	uint64_t used;

	/* size the budget from one sequence's use: room for it and a bit */
	l = limits(0, 0, 0, 0);
	s = store(l);
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 0, 0, 1, 1, 0, 600, msg, sizeof msg), 0);
	used = mem_total(l);
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);

	l = limits(0, used + used / 2, 0, 0);
	s = store(l);
	assert_int_equal(kvd_store_profile_ns(s, 9, 9, &want, &p, msg, sizeof msg), 0);
	assert_int_equal(kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &q, msg, sizeof msg), 0);
	assert_int_equal(rows(s, q, 0, 0, 1, 1, 0, 600, msg, sizeof msg), 0);
	/* the rest of the budget: empty sequences until one no longer fits,
	 * so a fork (its struct and more) does not either */
	struct kvd_seqn *fill[4096];
	uint32_t nf = 0;

	while (nf < 4096 &&
	       !kvd_store_seq_create_uid(s, p, 9, "9:t", 1, &fill[nf], msg, sizeof msg))
		nf++;
	assert_true(nf < 4096);
	used = mem_total(l);
	assert_int_equal(kvd_store_seq_fork(s, q, 9, "9:t", 2, &f, msg, sizeof msg), -EDQUOT);
	assert_non_null(strstr(msg, "memory_per_uid"));
	assert_int_equal(mem_total(l), used);
	assert_int_equal(kvd_store_view(q, 0).seg[0]->refs, 1);
	while (nf)
		kvd_store_seq_free(s, fill[--nf]);
	kvd_store_seq_free(s, q);
	kvd_store_profile_unref(s, p);
	assert_int_equal(mem_total(l), 0);
	kvd_store_destroy(s);
	kvd_limits_destroy(l);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_seq_creates_hit_the_wall),
		cmocka_unit_test(test_prefill_one_token),
		cmocka_unit_test(test_rows_charged),
		cmocka_unit_test(test_profile_namespaces),
		cmocka_unit_test(test_profile_refs),
		cmocka_unit_test(test_per_uid_caps),
		cmocka_unit_test(test_no_limits),
		cmocka_unit_test(test_each_after),
		cmocka_unit_test(test_owners),
		cmocka_unit_test(test_prefill_staging_seals),
		cmocka_unit_test(test_append_tail_seals),
		cmocka_unit_test(test_big_append_sliced),
		cmocka_unit_test(test_attend_ready),
		cmocka_unit_test(test_attend_view),
		cmocka_unit_test(test_row_order_refused),
		cmocka_unit_test(test_heavy_state),
		cmocka_unit_test(test_fork),
		cmocka_unit_test(test_fork_over_budget),
		cmocka_unit_test(test_fork_shares_tails),
		cmocka_unit_test(test_fork_tail_copy_refused),
	};

	return cmocka_run_group_tests(tests, setup, teardown);
}
