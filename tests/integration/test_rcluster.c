/* kvd_rcl against a real Redis Cluster (tests/unit/rcluster.h): 3 masters
 * with a replica each, started once for the group.  The tests run in
 * order and change the cluster as they go: pipelined batches over every
 * master, a master killed (its replica takes over), a slot migrated half
 * way (ASK) then fully (MOVED), and last the whole cluster down.
 * Exits 77 (skip) without redis-server and redis-cli. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "kvd/store/rcl.h"
#include "rcluster.h"

#define NKEYS 200
#define VLEN (1 << 20)

static struct rcluster rc;
static struct kvd_rcl *cl;      /* retry_ms long enough for a failover */
static char seeds[512];

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* Bytes of key i, NULs and all; 8 at a time, for the sanitizers' sake. */
static void fill(unsigned char *p, size_t n, uint64_t i)
{
	uint64_t x = 0x9e3779b97f4a7c15ull * (i + 1);

	for (size_t k = 0; k < n; k += 8) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		memcpy(p + k, &x, n - k < 8 ? n - k : 8);
	}
}

static struct kvd_rcl *client(uint32_t retry_ms, uint32_t io_ms)
{
	struct kvd_rcl_cfg cfg = { .seeds = seeds, .retry_ms = retry_ms, .io_ms = io_ms };
	struct kvd_rcl *c;
	char msg[256];

	assert_int_equal(kvd_rcl_create(&cfg, &c, msg, sizeof msg), 0);
	return c;
}

static long long run_ms;        /* in kvd_rcl_run */

static int run(struct kvd_rcl *c, struct kvd_rcl_op *ops, unsigned n)
{
	long long t = now_ms();
	char msg[256];
	int r = kvd_rcl_run(c, ops, n, msg, sizeof msg);

	run_ms += now_ms() - t;
	if (r)
		fprintf(stderr, "kvd_rcl_run: %d: %s\n", r, msg);
	return r;
}

/* Sets (val != NULL) or gets and checks keys named fmt % i, i < n, with
 * values of vlen bytes from fill(). */
static void set_all(struct kvd_rcl *c, const char *fmt, unsigned n, size_t vlen)
{
	struct kvd_rcl_op *ops = calloc(n, sizeof *ops);
	char (*keys)[32] = calloc(n, sizeof *keys);
	unsigned char **vals = calloc(n, sizeof *vals);

	assert_non_null(ops);
	for (unsigned i = 0; i < n; i++) {
		snprintf(keys[i], sizeof keys[i], fmt, i);
		vals[i] = malloc(vlen);
		assert_non_null(vals[i]);
		fill(vals[i], vlen, i);
		ops[i] = (struct kvd_rcl_op){ .kind = KVD_RCL_SET, .key = keys[i], .klen = strlen(keys[i]),
					      .val = vals[i], .vlen = vlen };
	}
	assert_int_equal(run(c, ops, n), 0);
	for (unsigned i = 0; i < n; i++) {
		assert_int_equal(ops[i].rc, 0);
		free(vals[i]);
	}
	free(vals);
	free(keys);
	free(ops);
}

static void get_all(struct kvd_rcl *c, const char *fmt, unsigned n, size_t vlen)
{
	struct kvd_rcl_op *ops = calloc(n, sizeof *ops);
	char (*keys)[32] = calloc(n, sizeof *keys);
	unsigned char *want = malloc(vlen);

	assert_non_null(ops);
	for (unsigned i = 0; i < n; i++) {
		snprintf(keys[i], sizeof keys[i], fmt, i);
		ops[i] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = keys[i], .klen = strlen(keys[i]) };
	}
	assert_int_equal(run(c, ops, n), 0);
	for (unsigned i = 0; i < n; i++) {
		assert_int_equal(ops[i].rc, 0);
		assert_int_equal(ops[i].len, vlen);
		fill(want, vlen, i);
		assert_memory_equal(ops[i].data, want, vlen);
		free(ops[i].data);
	}
	free(want);
	free(keys);
	free(ops);
}

/* ---- the group ----------------------------------------------------------- */

static int up(void **state)
{
	long long t = now_ms();

	if (rcluster_start(&rc, 3, 1))
		return -1;
	printf("cluster: 6 nodes on %d..%d, up in %lld ms\n", rc.base, rc.base + rc.n - 1, now_ms() - t);
	rcluster_seeds(&rc, seeds, sizeof seeds);
	cl = client(15000, 0);
	return 0;
}

static int down(void **state)
{
	kvd_rcl_destroy(cl);
	rcluster_stop(&rc);
	return 0;
}

/* The slots the servers compute (CLUSTER KEYSLOT) for keys with and
 * without tags, binary ones included. */
static void test_slot_agrees(void **state)
{
	redisContext *x = redisConnect("127.0.0.1", rc.base);

	assert_non_null(x);
	assert_int_equal(x->err, 0);
	for (unsigned i = 0; i < 300; i++) {
		unsigned char key[24];
		size_t n = 1 + i % sizeof key;
		redisReply *r;

		fill(key, n, i + 1000);
		if (i % 3 == 0)
			key[i % n] = '{';
		if (i % 5 == 0)
			key[(i * 7) % n] = '}';
		r = redisCommand(x, "CLUSTER KEYSLOT %b", key, n);
		assert_non_null(r);
		assert_int_equal(r->type, REDIS_REPLY_INTEGER);
		assert_int_equal(r->integer, kvd_rcl_slot(key, n));
		freeReplyObject(r);
	}
	redisFree(x);
}

static void test_pipeline(void **state)
{
	struct kvd_rcl_op ops[12];
	struct kvd_rcl_stats st0, st;
	int masters[3] = { 0 }, nm = 0;
	char msg[256];
	long long t;

	kvd_rcl_stats(cl, &st0);
	t = run_ms;
	set_all(cl, "rcl:pipe:%u", NKEYS, VLEN);
	printf("SET %d x 1 MiB: %lld ms\n", NKEYS, run_ms - t);
	t = run_ms;
	get_all(cl, "rcl:pipe:%u", NKEYS, VLEN);
	printf("GET %d x 1 MiB: %lld ms\n", NKEYS, run_ms - t);
	kvd_rcl_stats(cl, &st);
	assert_int_equal(st.commands - st0.commands, 2 * NKEYS);
	assert_int_equal(st.moved + st.ask, 0);
	/* A seed for the map (a replica, maybe) and the three masters. */
	assert_true(st.connects >= 3 && st.connects <= 4);

	/* Every master has keys, and each acknowledges them to its replica. */
	for (unsigned i = 0; i < NKEYS && nm < 3; i++) {
		char key[32];
		int port, k;

		snprintf(key, sizeof key, "rcl:pipe:%u", i);
		port = rcluster_master_port(&rc, kvd_rcl_slot(key, strlen(key)));
		assert_true(port > 0);
		for (k = 0; k < nm && masters[k] != port; k++)
			;
		if (k < nm)
			continue;
		masters[nm++] = port;
		assert_int_equal(kvd_rcl_wait(cl, key, strlen(key), 1, 5000, msg, sizeof msg), 1);
	}
	assert_int_equal(nm, 3);

	/* Misses, EXISTS, DEL, an empty value, an empty key, in one batch. */
	ops[0] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "rcl:none:1", .klen = 10 };
	ops[1] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "rcl:none:2", .klen = 10 };
	ops[2] = (struct kvd_rcl_op){ .kind = KVD_RCL_EXISTS, .key = "rcl:none:3", .klen = 10 };
	ops[3] = (struct kvd_rcl_op){ .kind = KVD_RCL_EXISTS, .key = "rcl:pipe:7", .klen = 10 };
	ops[4] = (struct kvd_rcl_op){ .kind = KVD_RCL_DEL, .key = "rcl:pipe:8", .klen = 10 };
	ops[5] = (struct kvd_rcl_op){ .kind = KVD_RCL_DEL, .key = "rcl:none:4", .klen = 10 };
	ops[6] = (struct kvd_rcl_op){ .kind = KVD_RCL_SET, .key = "rcl:empty", .klen = 9, .val = NULL };
	ops[7] = (struct kvd_rcl_op){ .kind = KVD_RCL_SET, .key = "", .klen = 0, .val = "e", .vlen = 1 };
	ops[8] = (struct kvd_rcl_op){ .kind = 99, .key = "x", .klen = 1 };
	assert_int_equal(run(cl, ops, 9), 0);
	assert_int_equal(ops[0].rc, -ENOENT);
	assert_null(ops[0].data);
	assert_int_equal(ops[1].rc, -ENOENT);
	assert_int_equal(ops[2].rc, -ENOENT);
	assert_int_equal(ops[3].rc, 0);
	assert_int_equal(ops[4].rc, 0);
	assert_int_equal(ops[5].rc, -ENOENT);
	assert_int_equal(ops[6].rc, 0);
	assert_int_equal(ops[7].rc, 0);
	assert_int_equal(ops[8].rc, -EINVAL);
	ops[0] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "rcl:pipe:8", .klen = 10 };
	ops[1] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "rcl:empty", .klen = 9 };
	ops[2] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "", .klen = 0 };
	assert_int_equal(run(cl, ops, 3), 0);
	assert_int_equal(ops[0].rc, -ENOENT);
	assert_int_equal(ops[1].rc, 0);
	assert_int_equal(ops[1].len, 0);
	assert_non_null(ops[1].data);
	assert_int_equal(ops[2].rc, 0);
	assert_int_equal(ops[2].len, 1);
	assert_memory_equal(ops[2].data, "e", 1);
	free(ops[1].data);
	free(ops[2].data);
}

/* The master of a slot dies: the client rides through its replica's
 * promotion (retry_ms: refused by the dead one, CLUSTERDOWN from the
 * others meanwhile), and reads what WAIT said the replica had. */
static void test_failover(void **state)
{
	const char *tag = "fo";
	struct kvd_rcl_stats st0, st;
	char msg[256];
	int port;
	long long t;

	set_all(cl, "{fo}:a%u", 10, 1000);
	set_all(cl, "{fo}:b%u", 10, 1000);
	set_all(cl, "rcl:fo:%u", 30, 1000);
	assert_int_equal(kvd_rcl_wait(cl, "{fo}", 4, 1, 5000, msg, sizeof msg), 1);
	port = rcluster_master_port(&rc, kvd_rcl_slot(tag, strlen(tag)));
	assert_true(port > 0);
	kvd_rcl_stats(cl, &st0);
	assert_int_equal(rcluster_kill(&rc, port), 0);
	t = now_ms();
	/* Straight away: refused until a replica is promoted. */
	get_all(cl, "{fo}:a%u", 10, 1000);
	get_all(cl, "rcl:fo:%u", 30, 1000);
	printf("master %d killed: GET answered after %lld ms\n", port, now_ms() - t);
	assert_int_equal(rcluster_wait_ok(&rc, 20000), 0);
	printf("master %d killed: cluster ok after %lld ms\n", port, now_ms() - t);
	get_all(cl, "{fo}:b%u", 10, 1000);
	get_all(cl, "rcl:pipe:%u", 8, VLEN);     /* rcl:pipe:8 was deleted */
	kvd_rcl_stats(cl, &st);
	assert_true(st.refreshes > st0.refreshes);
	assert_true(st.conn_errors > st0.conn_errors);
	assert_int_not_equal(rcluster_master_port(&rc, kvd_rcl_slot(tag, strlen(tag))), port);
}

/* A slot half migrated: the moved keys answer through ASK, without the
 * map changing; finished, the stale map gets MOVED. */
static void test_ask_then_moved(void **state)
{
	uint16_t slot = kvd_rcl_slot("ask", 3);
	struct kvd_rcl_stats st0, st;
	struct kvd_rcl_op op = { .kind = KVD_RCL_SET, .key = "{ask}:new", .klen = 9, .val = "n", .vlen = 1 };
	int src = rcluster_master_port(&rc, slot), to = -1;

	assert_true(src > 0);
	for (unsigned s = 0; s < KVD_RCL_SLOTS && to < 0; s += 1000) {
		int p = rcluster_master_port(&rc, (uint16_t)s);

		if (p > 0 && p != src)
			to = p;
	}
	assert_true(to > 0);
	set_all(cl, "{ask}:%u", 20, 4096);
	kvd_rcl_stats(cl, &st0);
	assert_int_equal(rcluster_migrate_begin(&rc, slot, to, 10), 0);
	get_all(cl, "{ask}:%u", 20, 4096);
	kvd_rcl_stats(cl, &st);
	assert_int_equal(st.ask - st0.ask, 10);
	assert_int_equal(st.moved, st0.moved);
	assert_int_equal(st.refreshes, st0.refreshes);
	/* A new key of a migrating slot goes to the target. */
	assert_int_equal(run(cl, &op, 1), 0);
	assert_int_equal(op.rc, 0);

	assert_int_equal(rcluster_migrate_finish(&rc, slot, to), 0);
	assert_int_equal(rcluster_master_port(&rc, slot), to);
	kvd_rcl_stats(cl, &st0);
	get_all(cl, "{ask}:%u", 20, 4096);
	kvd_rcl_stats(cl, &st);
	assert_true(st.moved > st0.moved);
	assert_true(st.refreshes > st0.refreshes);
	op = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "{ask}:new", .klen = 9 };
	assert_int_equal(run(cl, &op, 1), 0);
	assert_int_equal(op.rc, 0);
	assert_memory_equal(op.data, "n", 1);
	free(op.data);
	/* The map has it now: no more redirects. */
	kvd_rcl_stats(cl, &st0);
	get_all(cl, "{ask}:%u", 20, 4096);
	kvd_rcl_stats(cl, &st);
	assert_int_equal(st.moved + st.ask, st0.moved + st0.ask);
}

/* Last: every node killed.  The batch fails within about retry_ms. */
static void test_cluster_down(void **state)
{
	struct kvd_rcl *c = client(1000, 500);
	struct kvd_rcl_op ops[3];
	long long t;
	int r;

	set_all(c, "rcl:down:%u", 3, 10);
	assert_int_equal(rcluster_stop_all(&rc), 0);
	for (unsigned i = 0; i < 3; i++)
		ops[i] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "rcl:down:1", .klen = 10 };
	t = now_ms();
	r = kvd_rcl_run(c, ops, 3, NULL, 0);
	t = now_ms() - t;
	printf("cluster down: %d after %lld ms\n", r, t);
	assert_true(r == -ECONNREFUSED || r == -ECONNRESET || r == -ETIMEDOUT || r == -EHOSTUNREACH);
	assert_true(t >= 900 && t < 10000);
	for (unsigned i = 0; i < 3; i++) {
		assert_int_equal(ops[i].rc, r);
		assert_null(ops[i].data);
	}
	kvd_rcl_destroy(c);
}

/* redis-server and redis-cli on PATH. */
static int have(const char *prog)
{
	char cmd[128];

	snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", prog);
	return system(cmd) == 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_slot_agrees),
		cmocka_unit_test(test_pipeline),
		cmocka_unit_test(test_failover),
		cmocka_unit_test(test_ask_then_moved),
		cmocka_unit_test(test_cluster_down),
	};

	if (!have("redis-server") || !have("redis-cli")) {
		printf("SKIP: redis-server or redis-cli not installed (Debian: redis-server redis-tools)\n");
		return 77;
	}
	/* hiredis writes with write(2): a killed node must not end the test. */
	signal(SIGPIPE, SIG_IGN);
	return cmocka_run_group_tests(tests, up, down);
}
