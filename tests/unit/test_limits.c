/* kvd_limits: charge and uncharge, every cap with its error code and a
 * message that names the config key and the numbers, the uid table
 * shrinking back to nothing, the iterator, and sharing namespaces. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kvd/store/uidlimits.h"

static struct kvd_limits *make(void)
{
	struct kvd_limits_cfg c;
	struct kvd_limits *l;

	memset(&c, 0, sizeof c);
	c.cap[KVD_RES_CONNECTIONS] = 4;
	c.per_uid[KVD_RES_CONNECTIONS] = 2;
	c.cap[KVD_RES_SEQUENCES] = 40;
	c.per_uid[KVD_RES_SEQUENCES] = 16;
	c.cap[KVD_RES_PROFILES] = 3;
	c.per_uid[KVD_RES_PROFILES] = 2;
	c.cap[KVD_RES_MEMORY] = 64ull << 20;
	c.per_uid[KVD_RES_MEMORY] = 40ull << 20;
	c.cap[KVD_RES_SPILL] = 0;               /* no global cap */
	c.per_uid[KVD_RES_SPILL] = 1ull << 20;
	assert_int_equal(kvd_limits_create(&c, &l), 0);
	return l;
}

static void want_msg(const char *msg, const char *a, const char *b)
{
	if (!strstr(msg, a) || (b && !strstr(msg, b)))
		fail_msg("'%s' lacks '%s' or '%s'", msg, a, b ? b : "");
}

static void test_counts(void **state)
{
	struct kvd_limits *l = make();
	struct kvd_limits_usage u;
	char msg[200];

	for (int i = 0; i < 16; i++)
		assert_int_equal(kvd_limits_charge(l, 1000, KVD_RES_SEQUENCES, 1, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 1000, KVD_RES_SEQUENCES, 1, msg, sizeof msg), -EDQUOT);
	assert_string_equal(msg, "limits.sequences_per_uid: uid 1000 has 16 of 16");
	/* a refusal changes nothing */
	kvd_limits_uid_usage(l, 1000, &u);
	assert_int_equal(u.n[KVD_RES_SEQUENCES], 16);
	/* the global cap: 16 + 16 + 8 = 40 */
	for (int i = 0; i < 16; i++)
		assert_int_equal(kvd_limits_charge(l, 1001, KVD_RES_SEQUENCES, 1, NULL, 0), 0);
	assert_int_equal(kvd_limits_charge(l, 1002, KVD_RES_SEQUENCES, 8, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 1003, KVD_RES_SEQUENCES, 1, msg, sizeof msg), -ENOSPC);
	want_msg(msg, "limits.sequences: 40 in use of 40", "uid 1003");
	assert_int_equal(kvd_limits_uids(l), 3);        /* a refused uid gets no entry */
	kvd_limits_uncharge(l, 1002, KVD_RES_SEQUENCES, 1);
	assert_int_equal(kvd_limits_charge(l, 1003, KVD_RES_SEQUENCES, 1, msg, sizeof msg), 0);

	/* connections and profiles the same way */
	assert_int_equal(kvd_limits_charge(l, 5, KVD_RES_CONNECTIONS, 2, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 5, KVD_RES_CONNECTIONS, 1, msg, sizeof msg), -EDQUOT);
	assert_string_equal(msg, "limits.connections_per_uid: uid 5 has 2 of 2");
	assert_int_equal(kvd_limits_charge(l, 6, KVD_RES_CONNECTIONS, 2, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 7, KVD_RES_CONNECTIONS, 1, msg, sizeof msg), -ENOSPC);
	want_msg(msg, "limits.connections: 4 in use of 4", NULL);
	assert_int_equal(kvd_limits_charge(l, 5, KVD_RES_PROFILES, 2, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 5, KVD_RES_PROFILES, 1, msg, sizeof msg), -EDQUOT);
	assert_string_equal(msg, "limits.profiles_per_uid: uid 5 has 2 of 2");
	assert_int_equal(kvd_limits_charge(l, 6, KVD_RES_PROFILES, 1, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 6, KVD_RES_PROFILES, 1, msg, sizeof msg), -ENOSPC);
	want_msg(msg, "limits.profiles: 3 in use of 3", NULL);
	/* zero is always fine, also over a cap */
	assert_int_equal(kvd_limits_charge(l, 6, KVD_RES_PROFILES, 0, msg, sizeof msg), 0);
	kvd_limits_destroy(l);
}

static void test_bytes(void **state)
{
	struct kvd_limits *l = make();
	struct kvd_limits_usage u;
	char msg[200];

	assert_int_equal(kvd_limits_charge(l, 1, KVD_RES_MEMORY, 40ull << 20, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 1, KVD_RES_MEMORY, 1, msg, sizeof msg), -EDQUOT);
	want_msg(msg, "limits.memory_per_uid: uid 1 has 40.0 MiB", "of 40.0 MiB");
	assert_int_equal(kvd_limits_charge(l, 2, KVD_RES_MEMORY, 24ull << 20, msg, sizeof msg), 0);
	/* the memory limit is a wall: one byte more is refused with ENOMEM */
	assert_int_equal(kvd_limits_charge(l, 3, KVD_RES_MEMORY, 4096, msg, sizeof msg), -ENOMEM);
	want_msg(msg, "memory budget (memory.limit): 64.0 MiB (67108864 bytes) in use of 64.0 MiB",
		 "uid 3 needs 4096 bytes");
	kvd_limits_total(l, &u);
	assert_int_equal(u.n[KVD_RES_MEMORY], 64ull << 20);
	/* overflow is refused, not wrapped (the per-uid cap is checked first) */
	assert_int_equal(kvd_limits_charge(l, 2, KVD_RES_MEMORY, UINT64_MAX, msg, sizeof msg),
			 -EDQUOT);
	/* force ignores caps (what exists must be accounted) */
	assert_int_equal(kvd_limits_force(l, 3, KVD_RES_MEMORY, 4096), 0);
	kvd_limits_total(l, &u);
	assert_int_equal(u.n[KVD_RES_MEMORY], (64ull << 20) + 4096);
	kvd_limits_uncharge(l, 3, KVD_RES_MEMORY, 4096);

	/* spill: a per-uid cap without a global one */
	assert_int_equal(kvd_limits_charge(l, 1, KVD_RES_SPILL, 1ull << 20, msg, sizeof msg), 0);
	assert_int_equal(kvd_limits_charge(l, 1, KVD_RES_SPILL, 8192, msg, sizeof msg), -EDQUOT);
	want_msg(msg, "limits.spill_per_uid: uid 1 has 1.0 MiB", "needs 8192 bytes");
	assert_int_equal(kvd_limits_charge(l, 2, KVD_RES_SPILL, 1ull << 20, msg, sizeof msg), 0);
	kvd_limits_destroy(l);

	/* a global spill cap: ENOSPC */
	{
		struct kvd_limits_cfg c = { .cap = { [KVD_RES_SPILL] = 1 << 20 } };

		assert_int_equal(kvd_limits_create(&c, &l), 0);
		assert_int_equal(kvd_limits_charge(l, 9, KVD_RES_SPILL, 2 << 20, msg, sizeof msg),
				 -ENOSPC);
		want_msg(msg, "spill.limit: 0 bytes in use of 1.0 MiB", NULL);
		/* no caps at all for the rest */
		assert_int_equal(kvd_limits_charge(l, 9, KVD_RES_MEMORY, UINT64_MAX / 2, msg,
						   sizeof msg), 0);
		kvd_limits_destroy(l);
	}
}

struct seen {
	unsigned n;
	uint64_t seq;
};

static void each(void *arg, uint32_t uid, const struct kvd_limits_usage *u)
{
	struct seen *s = arg;

	s->n++;
	s->seq += u->n[KVD_RES_SEQUENCES];
	assert_true(uid >= 100 && uid < 1100);
}

static void test_table_shrinks(void **state)
{
	struct kvd_limits_cfg c = { 0 };
	struct kvd_limits *l;
	struct kvd_limits_usage u;
	struct seen s = { 0 };

	assert_int_equal(kvd_limits_create(&c, &l), 0);
	for (uint32_t uid = 100; uid < 1100; uid++) {
		assert_int_equal(kvd_limits_charge(l, uid, KVD_RES_SEQUENCES, 2, NULL, 0), 0);
		assert_int_equal(kvd_limits_charge(l, uid, KVD_RES_MEMORY, uid, NULL, 0), 0);
	}
	assert_int_equal(kvd_limits_uids(l), 1000);
	kvd_limits_each(l, each, &s);
	assert_int_equal(s.n, 1000);
	assert_int_equal(s.seq, 2000);
	kvd_limits_uid_usage(l, 500, &u);
	assert_int_equal(u.n[KVD_RES_SEQUENCES], 2);
	assert_int_equal(u.n[KVD_RES_MEMORY], 500);
	kvd_limits_uid_usage(l, 99, &u);
	assert_int_equal(u.n[KVD_RES_SEQUENCES], 0);
	for (uint32_t uid = 100; uid < 1100; uid++) {
		kvd_limits_uncharge(l, uid, KVD_RES_SEQUENCES, 2);
		assert_int_equal(kvd_limits_uids(l), 1000 - (uid - 100));       /* memory left */
		kvd_limits_uncharge(l, uid, KVD_RES_MEMORY, uid + 5);            /* clamped */
	}
	assert_int_equal(kvd_limits_uids(l), 0);
	kvd_limits_total(l, &u);
	for (int r = 0; r < KVD_RES_N; r++)
		assert_int_equal(u.n[r], 0);
	/* uncharging what was never charged is harmless */
	kvd_limits_uncharge(l, 7, KVD_RES_MEMORY, 10);
	assert_int_equal(kvd_limits_uids(l), 0);
	kvd_limits_destroy(l);
}

static void test_namespaces(void **state)
{
	struct kvd_limits_cfg c = { 0 };
	struct kvd_limits *l;

	c.share_uid[0] = 1000;
	c.share_uid[1] = 1001;
	c.share_uid[2] = 2000;
	c.share_uid[3] = 2001;
	c.share_group[2] = c.share_group[3] = 1;
	c.nshare = 4;
	assert_int_equal(kvd_limits_create(&c, &l), 0);
	assert_int_equal(kvd_limits_namespace(l, 1000), KVD_NS_GROUP | 0);
	assert_int_equal(kvd_limits_namespace(l, 1001), KVD_NS_GROUP | 0);
	assert_int_equal(kvd_limits_namespace(l, 2001), KVD_NS_GROUP | 1);
	assert_int_equal(kvd_limits_namespace(l, 1002), 1002);
	assert_int_equal(kvd_limits_namespace(l, 0), 0);
	assert_int_equal(kvd_limits_namespace(l, 0x80000001u), KVD_NS_NONE);
	assert_string_equal(kvd_limits_key(KVD_RES_MEMORY, 0), "memory.limit");
	assert_string_equal(kvd_limits_key(KVD_RES_SPILL, 1), "limits.spill_per_uid");
	assert_string_equal(kvd_limits_key(KVD_RES_REMOTE, 0), "remote.limit");
	assert_string_equal(kvd_limits_key(KVD_RES_REMOTE, 1), "limits.remote_per_uid");
	kvd_limits_destroy(l);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_counts),
		cmocka_unit_test(test_bytes),
		cmocka_unit_test(test_table_shrinks),
		cmocka_unit_test(test_namespaces),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
