/* kvd_rcl without a cluster: slots and hash tags against the spec's
 * values, seed lists refused, a node that is not there, and a fake node
 * (a forked child answering canned bytes) whose broken replies must cost
 * an error, never a crash.  tests/integration/test_rcluster.c runs it
 * against a real cluster. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvd/store/rcl.h"

static uint16_t slot_s(const char *k)
{
	return kvd_rcl_slot(k, strlen(k));
}

/* The slot of the whole key, a second CRC16/XMODEM (no hash tags). */
static uint16_t whole(const char *k)
{
	unsigned crc = 0;

	for (; *k; k++) {
		crc ^= (unsigned)(unsigned char)*k << 8;
		for (int i = 0; i < 8; i++)
			crc = (crc & 0x8000 ? crc << 1 ^ 0x1021 : crc << 1) & 0xffff;
	}
	return (uint16_t)(crc % KVD_RCL_SLOTS);
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* ---- slots -------------------------------------------------------------- */

static void test_slot_values(void **state)
{
	/* CRC16/XMODEM's check value is 0x31c3, under 16384 as it is. */
	assert_int_equal(slot_s("123456789"), 0x31c3);
	assert_int_equal(slot_s("foo"), 12182);
	assert_int_equal(slot_s("bar"), 5061);
	assert_int_equal(slot_s("hello"), 866);
	assert_int_equal(kvd_rcl_slot(NULL, 0), 0);
	assert_int_equal(kvd_rcl_slot("a\0b", 3) < KVD_RCL_SLOTS, 1);
	assert_int_not_equal(kvd_rcl_slot("a\0b", 3), kvd_rcl_slot("a\0c", 3));
}

static void test_slot_hash_tags(void **state)
{
	assert_int_equal(slot_s("{user1000}.following"), slot_s("{user1000}.followers"));
	assert_int_equal(slot_s("{user1000}.following"), slot_s("user1000"));
	/* Empty first tag: the whole key. */
	assert_int_equal(slot_s("foo{}{bar}"), whole("foo{}{bar}"));
	/* First '{', then the next '}'. */
	assert_int_equal(slot_s("foo{{bar}}zap"), slot_s("{bar"));
	assert_int_equal(slot_s("foo{bar}{zap}"), slot_s("bar"));
	/* No '}' after the '{': the whole key. */
	assert_int_equal(slot_s("foo{bar"), whole("foo{bar"));
	assert_int_equal(slot_s("foo}bar{"), whole("foo}bar{"));
	assert_int_equal(slot_s("{}"), whole("{}"));
	assert_int_equal(slot_s("x{a}"), slot_s("a"));
	assert_int_equal(kvd_rcl_slot("{a\0b}c", 6), kvd_rcl_slot("a\0b", 3));
}

/* ---- create ------------------------------------------------------------- */

static void test_create_bad_seeds(void **state)
{
	static const char *const bad[] = {
		"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000", ":6379",
		"127.0.0.1:6379,", "a:1,,b:2", "a:12x", "a:-1", "a:123456", "[]:1", " ", "a:1, ",
		"a :1", "a: 1",
	};
	struct kvd_rcl_cfg cfg = { 0 };
	struct kvd_rcl *c = (void *)1;
	char msg[128];

	assert_int_equal(kvd_rcl_create(&cfg, &c, msg, sizeof msg), -EINVAL);
	assert_null(c);
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		cfg.seeds = bad[i];
		msg[0] = 0;
		assert_int_equal(kvd_rcl_create(&cfg, &c, msg, sizeof msg), -EINVAL);
		assert_null(c);
		assert_true(msg[0]);
	}
	cfg.seeds = "127.0.0.1:6379,[::1]:7000, localhost:1 ,127.0.0.1:6379,::1:6379";
	assert_int_equal(kvd_rcl_create(&cfg, &c, msg, sizeof msg), 0);
	kvd_rcl_destroy(c);
	kvd_rcl_destroy(NULL);
}

/* A TCP port bound but not listening: connecting is refused, and nobody
 * else gets the port while fd is open. */
static int dead_port(int *fd)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof a;

	*fd = socket(AF_INET, SOCK_STREAM, 0);
	assert_true(*fd >= 0);
	assert_int_equal(bind(*fd, (struct sockaddr *)&a, sizeof a), 0);
	assert_int_equal(getsockname(*fd, (struct sockaddr *)&a, &len), 0);
	return ntohs(a.sin_port);
}

static void test_nobody_there(void **state)
{
	struct kvd_rcl_op op[2] = { { .kind = KVD_RCL_GET, .key = "a", .klen = 1 },
				    { .kind = KVD_RCL_SET, .key = "b", .klen = 1, .val = "v", .vlen = 1 } };
	struct kvd_rcl_cfg cfg = { .connect_ms = 200, .io_ms = 200 };
	struct kvd_rcl_stats st;
	struct kvd_rcl *c;
	char seeds[64], msg[128];
	int fd, port = dead_port(&fd);
	long long t;

	snprintf(seeds, sizeof seeds, "127.0.0.1:%d", port);
	cfg.seeds = seeds;
	assert_int_equal(kvd_rcl_create(&cfg, &c, msg, sizeof msg), 0);
	t = now_ms();
	assert_int_equal(kvd_rcl_run(c, op, 2, msg, sizeof msg), -ECONNREFUSED);
	assert_true(now_ms() - t < 1000);
	assert_int_equal(op[0].rc, -ECONNREFUSED);
	assert_int_equal(op[1].rc, -ECONNREFUSED);
	assert_null(op[0].data);
	assert_non_null(strstr(msg, seeds));
	kvd_rcl_stats(c, &st);
	assert_true(st.conn_errors >= 1);
	assert_int_equal(st.connects, 0);
	assert_int_equal(kvd_rcl_wait(c, "a", 1, 1, 10, msg, sizeof msg), -ENOTCONN);
	assert_int_equal(kvd_rcl_run(c, op, 0, msg, sizeof msg), 0);
	kvd_rcl_destroy(c);

	/* With retry_ms it keeps asking, then gives up about that late. */
	cfg.retry_ms = 300;
	assert_int_equal(kvd_rcl_create(&cfg, &c, msg, sizeof msg), 0);
	t = now_ms();
	assert_int_equal(kvd_rcl_run(c, op, 1, msg, sizeof msg), -ECONNREFUSED);
	t = now_ms() - t;
	assert_true(t >= 290 && t < 2000);
	kvd_rcl_stats(c, &st);
	assert_true(st.conn_errors >= 3);
	kvd_rcl_destroy(c);
	close(fd);
}

/* ---- a fake node --------------------------------------------------------- */

struct fake {
	int fd, port;
	pid_t pid;
	char seeds[64];
};

static void fake_listen(struct fake *f)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof a;

	f->fd = socket(AF_INET, SOCK_STREAM, 0);
	assert_true(f->fd >= 0);
	assert_int_equal(bind(f->fd, (struct sockaddr *)&a, sizeof a), 0);
	assert_int_equal(listen(f->fd, 8), 0);
	assert_int_equal(getsockname(f->fd, (struct sockaddr *)&a, &len), 0);
	f->port = ntohs(a.sin_port);
	snprintf(f->seeds, sizeof f->seeds, "127.0.0.1:%d", f->port);
}

static size_t count(const char *buf, size_t n, const char *what)
{
	size_t k = 0, w = strlen(what);

	for (size_t i = 0; i + w <= n; i++)
		k += !memcmp(buf + i, what, w);
	return k;
}

/* Answers CLUSTER SLOTS with slots, every GET with get, ASKING with +OK,
 * one connection at a time, until killed. */
static void fake_fork(struct fake *f, const char *slots, const char *get)
{
	f->pid = fork();
	assert_true(f->pid >= 0);
	if (f->pid)
		return;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	signal(SIGPIPE, SIG_IGN);
	for (;;) {
		int s = accept(f->fd, NULL, NULL);
		char buf[4096];
		ssize_t n;

		while (s >= 0 && (n = read(s, buf, sizeof buf)) > 0) {
			for (size_t k = count(buf, (size_t)n, "SLOTS"); k--;)
				(void)!write(s, slots, strlen(slots));
			for (size_t k = count(buf, (size_t)n, "ASKING"); k--;)
				(void)!write(s, "+OK\r\n", 5);
			for (size_t k = count(buf, (size_t)n, "$3\r\nGET\r\n"); k--;)
				(void)!write(s, get, strlen(get));
		}
		close(s);
	}
}

static void fake_stop(struct fake *f)
{
	kill(f->pid, SIGKILL);
	waitpid(f->pid, NULL, 0);
	close(f->fd);
}

/* One GET against a fake node answering slots and get: run's result. */
static int fake_get(const char *slots_fmt, const char *get_fmt, struct kvd_rcl_op *op,
		    struct kvd_rcl_stats *st, char *msg, size_t msglen)
{
	struct kvd_rcl_cfg cfg = { .connect_ms = 500, .io_ms = 300 };
	char slots[512], get[256];
	struct fake f;
	struct kvd_rcl *c;
	int r;

	fake_listen(&f);
	snprintf(slots, sizeof slots, slots_fmt, f.port);
	snprintf(get, sizeof get, get_fmt, f.port);
	fake_fork(&f, slots, get);
	cfg.seeds = f.seeds;
	assert_int_equal(kvd_rcl_create(&cfg, &c, msg, msglen), 0);
	*op = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = "k", .klen = 1 };
	r = kvd_rcl_run(c, op, 1, msg, msglen);
	kvd_rcl_stats(c, st);
	kvd_rcl_destroy(c);
	fake_stop(&f);
	return r;
}

/* Every slot on the fake node itself. */
#define SELF "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n$2\r\nid\r\n"

static void test_fake_bad_maps(void **state)
{
	static const struct { const char *slots; int rc; } bad[] = {
		{ "*2000000000\r\n", -EPROTO },
		{ "*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", -EPROTO },
		{ "+OK\r\n", -EPROTO },
		{ "-ERR This instance has cluster support disabled\r\n", -EIO },
		{ "*0\r\n", -EHOSTUNREACH },
		{ "*1\r\n:5\r\n", -EPROTO },
		{ "*1\r\n*2\r\n:0\r\n:16383\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:0\r\n:16384\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:-1\r\n:10\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:10\r\n:9\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:0\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:65536\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n:1\r\n:%d\r\n", -EPROTO },
		{ "*1\r\n*3\r\n$1\r\n0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:0\r\n:16383\r\n*1\r\n$9\r\n127.0.0.1\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:0\r\n:16383\r\n$9\r\n127.0.0.1\r\n", -EPROTO },
		{ "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$1\r\n?\r\n:%d\r\n", -EHOSTUNREACH },
		{ "garbage\r\n", -EPROTO },
		/* Nothing more: the reply never ends. */
		{ "*1\r\n*3\r\n:0\r\n", -ETIMEDOUT },
	};
	struct kvd_rcl_stats st;
	struct kvd_rcl_op op;
	char msg[256];

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		int r = fake_get(bad[i].slots, "$1\r\nv\r\n", &op, &st, msg, sizeof msg);

		if (r != bad[i].rc)
			fprintf(stderr, "map %zu: %d (%s), want %d\n", i, r, msg, bad[i].rc);
		assert_int_equal(r, bad[i].rc);
		assert_int_equal(op.rc, r);
		assert_null(op.data);
		assert_true(msg[0]);
		assert_int_equal(st.refreshes, 0);
	}
}

static void test_fake_replies(void **state)
{
	/* run: the batch's result; a reply of any kind means it went through,
	 * a reply hiredis could not read costs the connection. */
	static const struct { const char *get; int rc, run; unsigned moved, ask; } cases[] = {
		{ "$3\r\nabc\r\n", 0, 0, 0, 0 },
		{ "$0\r\n\r\n", 0, 0, 0, 0 },
		{ "$-1\r\n", -ENOENT, 0, 0, 0 },
		{ ":5\r\n", -EPROTO, 0, 0, 0 },
		{ "+OK\r\n", -EPROTO, 0, 0, 0 },
		{ "*1\r\n$1\r\na\r\n", -EPROTO, 0, 0, 0 },
		{ "-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", -EIO, 0, 0, 0 },
		{ "-MOVED 99999 127.0.0.1:%d\r\n", -EPROTO, 0, 0, 0 },
		{ "-MOVED 1 127.0.0.1:0\r\n", -EPROTO, 0, 0, 0 },
		{ "-MOVED 1 127.0.0.1\r\n", -EPROTO, 0, 0, 0 },
		{ "-MOVED x 127.0.0.1:%d\r\n", -EPROTO, 0, 0, 0 },
		{ "-MOVED\r\n", -EIO, 0, 0, 0 },
		/* Redirected to itself for ever: five followed, then given up. */
		{ "-MOVED 1 127.0.0.1:%d\r\n", -EIO, 0, 5, 0 },
		{ "-ASK 1 :%d\r\n", -EIO, 0, 0, 5 },
		{ "*2000000000\r\n", -EPROTO, -EPROTO, 0, 0 },
		{ "garbage\r\n", -EPROTO, -EPROTO, 0, 0 },
		{ "$100000000000\r\n", -ETIMEDOUT, -ETIMEDOUT, 0, 0 },
	};
	struct kvd_rcl_stats st;
	struct kvd_rcl_op op;
	char msg[256];

	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		int r = fake_get(SELF, cases[i].get, &op, &st, msg, sizeof msg);

		if (op.rc != cases[i].rc)
			fprintf(stderr, "reply %zu: %d (%s), want %d\n", i, op.rc, msg, cases[i].rc);
		assert_int_equal(op.rc, cases[i].rc);
		/* A reply of any kind: the batch itself went through. */
		assert_int_equal(r, cases[i].run);
		assert_int_equal(st.moved, cases[i].moved);
		assert_int_equal(st.ask, cases[i].ask);
		assert_true(st.refreshes >= 1);
		if (!op.rc)
			assert_non_null(op.data);
		else
			assert_null(op.data);
		free(op.data);
	}
	fake_get(SELF, "$3\r\nabc\r\n", &op, &st, msg, sizeof msg);
	assert_int_equal(op.len, 3);
	assert_memory_equal(op.data, "abc", 3);
	free(op.data);
}

/* Half the slots on a node that is not there: the batch goes through,
 * with the error on the ops of that half only. */
static void test_fake_half_down(void **state)
{
	struct kvd_rcl_op op[2] = { { .kind = KVD_RCL_GET, .key = "bar", .klen = 3 },   /* 5061 */
				    { .kind = KVD_RCL_GET, .key = "foo", .klen = 3 } }; /* 12182 */
	struct kvd_rcl_cfg cfg = { .connect_ms = 200, .io_ms = 200, .retry_ms = 200 };
	char slots[512], msg[256];
	struct kvd_rcl *c;
	struct fake f;
	int fd, dead = dead_port(&fd);

	fake_listen(&f);
	snprintf(slots, sizeof slots, "*2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
		 "*3\r\n:8192\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", f.port, dead);
	fake_fork(&f, slots, "$1\r\nv\r\n");
	cfg.seeds = f.seeds;
	assert_int_equal(kvd_rcl_create(&cfg, &c, msg, sizeof msg), 0);
	assert_int_equal(kvd_rcl_run(c, op, 2, msg, sizeof msg), 0);
	assert_int_equal(op[0].rc, 0);
	assert_int_equal(op[0].len, 1);
	assert_memory_equal(op[0].data, "v", 1);
	assert_int_equal(op[1].rc, -ECONNREFUSED);
	assert_null(op[1].data);
	free(op[0].data);
	kvd_rcl_destroy(c);
	fake_stop(&f);
	close(fd);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_slot_values),
		cmocka_unit_test(test_slot_hash_tags),
		cmocka_unit_test(test_create_bad_seeds),
		cmocka_unit_test(test_nobody_there),
		cmocka_unit_test(test_fake_bad_maps),
		cmocka_unit_test(test_fake_replies),
		cmocka_unit_test(test_fake_half_down),
	};

	/* hiredis writes with write(2): a gone node must not end the test. */
	signal(SIGPIPE, SIG_IGN);
	return cmocka_run_group_tests(tests, NULL, NULL);
}
