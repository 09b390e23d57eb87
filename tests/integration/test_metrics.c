/* kvd's metrics (kvd/metrics.h, docs/OPERATIONS.md "Metrics") against a real
 * daemon: every exposed series checked against known traffic (ring ops and
 * errors, control requests and errors, ATTEND records, queue depth, usage
 * by uid, the budget, spill and restore I/O with injected faults,
 * evictions, losses, watchdog pings, disconnects and refusals); the text
 * passes `promtool check metrics`; a real Prometheus server scrapes kvd and
 * its query API returns a counter's value; the endpoint answers in bounded
 * time while the executor is busy with a large prefill, and beside 70
 * connections dripping a byte every 200 ms from one peer or from ten (the
 * per-peer limit, the total time of a connection), and one connection
 * dripping a byte every 100 ms is cut at request_timeout_ms; MetricsReq on the
 * control socket returns the endpoint's text, filtered to the caller's uid
 * for non-admins; `listen =` turns the endpoint off.
 *
 * Needs promtool and prometheus (tools/deps.sh installs them): without them
 * the test exits 77 (skipped) and installs nothing. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <math.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "proto/ctl.h"
#include "daemon.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "proto/kvd_ring.h"
#include "kvd/metrics.h"
#include "shm/shm.h"
#include "engine/synth.h"
#include "testutil.h"

#define N_TOK   3000
#define LAYERS  3

static const uint32_t dense_layers[] = { 0 };
static const struct kvc_model model = {
	.name = "mtest", .layers = LAYERS, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 7, .segment_tokens = 4096, .seal_tokens = 256,
};

static struct daemon D;
static unsigned port;
static char conf[128];

/* ---- helpers ------------------------------------------------------------ */

static unsigned free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t sl = sizeof a;
	int fd = socket(AF_INET, SOCK_STREAM, 0);

	assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
	assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
	close(fd);
	return ntohs(a.sin_port);
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* HTTP/1.0 GET by hand (libmicrohttpd is a server library): the body, or
 * NULL when nothing answers within ms (between two reads); *status the
 * status code. */
static char *http_get_ms(unsigned p, const char *path, int *status, int ms)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)p),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct timeval tv = { ms / 1000, (ms % 1000) * 1000 };
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	size_t len = 0, cap = 1 << 16;
	char *buf = xmalloc(cap), req[512], *body;
	ssize_t n;

	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
		close(fd);
		free(buf);
		return NULL;
	}
	snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
	assert_int_equal(write(fd, req, strlen(req)), (ssize_t)strlen(req));
	while ((n = read(fd, buf + len, cap - len - 1)) > 0) {
		len += (size_t)n;
		if (len + 1 == cap)
			buf = realloc(buf, cap *= 2);
	}
	close(fd);
	buf[len] = 0;
	*status = 0;
	sscanf(buf, "HTTP/1.%*d %d", status);
	body = strstr(buf, "\r\n\r\n");
	if (!body) {
		free(buf);
		return NULL;
	}
	memmove(buf, body + 4, strlen(body + 4) + 1);
	return buf;
}

static char *http_get(unsigned p, const char *path, int *status)
{
	return http_get_ms(p, path, status, 10000);
}

static char *scrape(void)
{
	int st;
	char *t = http_get(port, "/metrics", &st);

	if (!t)
		fail_msg("no answer from the metrics endpoint on port %u", port);
	assert_int_equal(st, 200);
	return t;
}

/* The value of one series ("name" or "name{labels}" exactly as kvd writes
 * it), NAN when absent. */
static double metric(const char *text, const char *series)
{
	size_t n = strlen(series);

	for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
		if (!strncmp(p, series, n) && p[n] == ' ')
			return strtod(p + n + 1, NULL);
	return NAN;
}

static double mf(const char *text, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static double mf(const char *text, const char *fmt, ...)
{
	char s[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(s, sizeof s, fmt, ap);
	va_end(ap);
	return metric(text, s);
}

#define EXPECT(text, want, ...)                                                           \
	do {                                                                              \
		double got_ = mf(text, __VA_ARGS__);                                      \
		if (got_ != (double)(want)) {                                             \
			char s_[256];                                                     \
			snprintf(s_, sizeof s_, __VA_ARGS__);                             \
			fail_msg("%s = %g, expected %g", s_, got_, (double)(want));       \
		}                                                                         \
	} while (0)

/* Sum of every sample of a family whose line contains `part` (NULL: all). */
static double family_sum(const char *text, const char *name, const char *part)
{
	size_t n = strlen(name);
	double sum = 0;

	for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
		const char *eol = strchr(p, '\n');
		char line[512];
		size_t len = eol ? (size_t)(eol - p) : strlen(p);

		if (strncmp(p, name, n) || (p[n] != '{' && p[n] != ' ') || len >= sizeof line)
			continue;
		memcpy(line, p, len);
		line[len] = 0;
		if (part && !strstr(line, part))
			continue;
		sum += strtod(strrchr(line, ' ') + 1, NULL);
	}
	return sum;
}

static int have(const char *tool)
{
	char cmd[128];

	snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", tool);
	return system(cmd) == 0;
}

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	assert_non_null(f);
	fputs(text, f);
	fclose(f);
}

/* ---- a raw client: the protocol by hand --------------------------------- */

struct raw {
	int fd;
	struct shm_region r;
	void *map;
	size_t size;
	int efd;
	uint64_t next;
	void *rx;
};

#define RX_CAP KVD_CTL_RX_MAX

static int raw_connect(struct raw *x, const char *sock)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };

	memset(x, 0, sizeof *x);
	x->efd = -1;
	memcpy(a.sun_path, sock, strlen(sock) + 1);
	x->fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
	x->rx = xmalloc(RX_CAP);
	return connect(x->fd, (struct sockaddr *)&a, sizeof a);
}

/* The response to rq (NULL if the socket broke). */
static Kvd__Response *raw_call(struct raw *x, Kvd__Request *rq, int *fds, int *nfds)
{
	rq->id = ++x->next;
	return kvd_ctl_call(x->fd, rq, 0, x->rx, -1, fds, nfds, NULL);
}

/* Hello: a control-only connection (no rings) or one with a region of
 * ring_entries-deep rings. */
static int raw_hello(struct raw *x, int control)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__Hello h = KVD__HELLO__INIT;
	int fds[4], nfds = 4;

	h.version = KVD_CTL_VERSION;
	h.tenant = "t";
	h.client_name = "raw";
	h.control = control;
	if (!control) {
		h.slots = 2;
		h.slot_size = 1 << 20;
	}
	rq.body_case = KVD__REQUEST__BODY_HELLO;
	rq.hello = &h;
	Kvd__Response *r = raw_call(x, &rq, fds, &nfds);

	if (!r || r->body_case != KVD__RESPONSE__BODY_HELLO) {
		kvd_ctl_free_response(r);
		return -1;
	}
	if (!control) {
		if (nfds != 2)
			return -1;
		x->size = r->hello->region_size;
		x->efd = fds[1];
		x->map = mmap(NULL, x->size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
		close(fds[0]);
		if (x->map == MAP_FAILED || shm_region_attach(&x->r, x->map, x->size))
			return -1;
	}
	kvd_ctl_free_response(r);
	return 0;
}

static void raw_close(struct raw *x)
{
	if (x->map)
		munmap(x->map, x->size);
	if (x->efd >= 0)
		close(x->efd);
	close(x->fd);
	free(x->rx);
}

/* MetricsReq: the text (malloc'd), or NULL. */
static char *raw_metrics(struct raw *x)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__MetricsReq m = KVD__METRICS_REQ__INIT;
	char *t = NULL;

	rq.body_case = KVD__REQUEST__BODY_METRICS;
	rq.metrics = &m;
	Kvd__Response *r = raw_call(x, &rq, NULL, NULL);

	if (r && r->body_case == KVD__RESPONSE__BODY_METRICS)
		t = strdup(r->metrics->text);
	kvd_ctl_free_response(r);
	return t;
}

/* A request expected to fail: its Error code (1 if it did not fail). */
static int raw_error(struct raw *x, Kvd__Request *rq)
{
	Kvd__Response *r = raw_call(x, rq, NULL, NULL);
	int code = r && r->body_case == KVD__RESPONSE__BODY_ERROR ? r->error->code : 1;

	kvd_ctl_free_response(r);
	return code;
}

static int raw_seq_free(struct raw *x, uint64_t seq)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqFree sf = KVD__SEQ_FREE__INIT;

	sf.seq = seq;
	rq.body_case = KVD__REQUEST__BODY_SEQ_FREE;
	rq.seq_free = &sf;
	return raw_error(x, &rq);
}

/* ServerStats.uids' row of uid (zeros when absent). */
static Kvd__UidUsage uid_usage(struct raw *x, uint32_t uid)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__UidUsage u = KVD__UID_USAGE__INIT;

	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	Kvd__Response *r = raw_call(x, &rq, NULL, NULL);

	assert_non_null(r);
	assert_int_equal(r->body_case, KVD__RESPONSE__BODY_SERVER_STATS);
	for (size_t i = 0; i < r->server_stats->n_uids; i++)
		if (r->server_stats->uids[i]->uid == uid)
			u = *r->server_stats->uids[i];
	u.base.unknown_fields = NULL;
	u.base.n_unknown_fields = 0;
	kvd_ctl_free_response(r);
	return u;
}

static void raw_submit_nowait(struct raw *x, const struct kvd_sqe *e)
{
	void *p = shm_ring_reserve(&x->r.sq);
	uint64_t one = 1;

	assert_non_null(p);
	memcpy(p, e, sizeof *e);
	shm_ring_commit(&x->r.sq, 1);
	if (shm_ring_needs_kick(&x->r.sq))
		assert_int_equal(write(x->efd, &one, 8), 8);
}

/* Waits until n completions are in the CQ (does not reap them): kvd's
 * tail against our head, as shm_ring_ready caches its count. */
static void raw_wait_cq(struct raw *x, uint32_t n)
{
	for (int i = 0; i < 1000; i++) {
		if (atomic_load(&x->r.cq.ctl->tail) - x->r.cq.local >= n)
			return;
		daemon_sleep_ms(10);
	}
	fail_msg("fewer than %u completions after 10 s", n);
}

/* Reaps n completions, one by one; returns how many had res == want. */
static int raw_reap(struct raw *x, int n, int want)
{
	int same = 0;

	for (int i = 0; i < n; i++) {
		if (shm_ring_wait(&x->r.cq, 0, 10000000000ull, 1) < 1)
			fail_msg("completion %d of %d missing after 10 s", i, n);
		same += ((const struct kvd_cqe *)shm_ring_entry(&x->r.cq, 0))->res == want;
		shm_ring_release(&x->r.cq, 1);
	}
	return same;
}

/* ---- the daemon --------------------------------------------------------- */

static int start_with(const char *body, const char *a3, const char *a4)
{
	char addr[64];

	port = free_port();
	snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
	snprintf(conf, sizeof conf, "/tmp/kvd-metrics.%d.conf", (int)getpid());
	write_file(conf, body);
	return daemon_start4(&D, "--config", conf, "--metrics-listen", addr) ? -1 : 0;
	(void)a3;
	(void)a4;
}

static int start(void **state)
{
	return start_with("[memory]\nlimit = 256M\n[transport]\nring_entries = 16\n", NULL, NULL);
}

static int stop(void **state)
{
	unlink(conf);
	return daemon_stop(&D) == 0 ? 0 : -1;
}

static struct kvc *client(const char *name)
{
	struct kvc_opts o = { .socket_path = D.sock, .tenant = "t", .name = name,
			      .slots = 4, .slot_size = 8 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c))
		fail_msg("connect: %s", kvc_last_error(c));
	if (kvc_profile(c, &model))
		fail_msg("profile: %s", kvc_last_error(c));
	return c;
}

/* A sequence with every layer prefilled from synthetic rows of `seed`. */
static struct kvc_seq *prefilled(struct kvc *c, struct kvd_synth *w, uint64_t seed, uint32_t n)
{
	struct kvc_seq *s;

	assert_int_equal(kvd_synth_make(w, KVD_WL_MIXED, n, 8, 2, 128, seed), 0);
	if (kvc_seq_create(c, &s))
		fail_msg("seq: %s", kvc_last_error(c));
	for (uint32_t l = 0; l < LAYERS; l++)
		if (kvc_prefill(c, s, l, w->k, w->v, n))
			fail_msg("prefill: %s", kvc_last_error(c));
	return s;
}

/* ---- tests -------------------------------------------------------------- */

/* Known traffic, then every counter and gauge it moves, exactly; the text
 * passes promtool; MetricsReq returns the same text. */
static void test_counts(void **state)
{
	char *t, path[128], cmd[256];
	struct kvd_synth w1, w2;
	struct kvc_stats st;
	float o[8 * 128], lse[8];

	/* Nothing yet: every ok row is there at 0. */
	t = scrape();
	EXPECT(t, 0, "kvd_ring_requests_total{op=\"attend\",result=\"ok\"}");
	EXPECT(t, 0, "kvd_control_requests_total{op=\"hello\",result=\"ok\"}");
	EXPECT(t, 0, "kvd_attend_layer_seconds_count");
	{
		const char *bi = strstr(t, "\nkvd_build_info{version=\"" KVD_VERSION "\",git=\"");
		char git[64] = "";

		assert_non_null(bi);
		assert_int_equal(sscanf(strstr(bi, "git=\"") + 5, "%63[^\"]", git), 1);
		EXPECT(t, 1, "kvd_build_info{version=\"%s\",git=\"%s\"}", KVD_VERSION, git);
	}
	free(t);

	/* ---- a well-behaved client: 1 hello, 1 profile, 2 sequences, each
	 * of the 2 sparse layers prefilled in one PREFILL entry (8 MiB slots),
	 * 3 x 2 ATTENDs of one record, 5 NOPs, 1 ServerStats, 1 SeqFree. */
	struct kvc *c = client("good");
	struct kvc_seq *s1 = prefilled(c, &w1, 1, N_TOK), *s2 = prefilled(c, &w2, 2, N_TOK);

	for (int i = 0; i < 3; i++)
		for (uint32_t l = 1; l < LAYERS; l++)
			assert_int_equal(kvc_attend_kvd(c, l, &s1, 1, w1.q, o, lse), 0);
	for (int i = 0; i < 5; i++)
		assert_int_equal(kvc_nop(c), 0);

	/* ---- a hand-made client: ring errors and control errors. */
	struct raw x, y;

	assert_int_equal(raw_connect(&x, D.sock), 0);
	/* before hello: seq_free refused KVD_EPROTO */
	assert_int_equal(raw_seq_free(&x, 99), -KVD_EPROTO);
	assert_int_equal(raw_hello(&x, 0), 0);
	/* 2 x seq_free of nothing: ENOENT */
	assert_int_equal(raw_seq_free(&x, 12345), -ENOENT);
	assert_int_equal(raw_seq_free(&x, 12346), -ENOENT);
	/* 1 datagram that is no Request: invalid, KVD_EFORMAT */
	{
		uint8_t junk[64];
		int n;

		for (int i = 0; i < 64; i++)
			junk[i] = (uint8_t)(i * 37 + 11);
		assert_int_equal(send(x.fd, junk, sizeof junk, 0), (ssize_t)sizeof junk);
		n = kvd_ctl_recv(x.fd, x.rx, RX_CAP, NULL, NULL);
		assert_true(n > 0);
	}
	/* ring: 1 unknown op (EINVAL, "invalid"), 3 FREEs of nothing
	 * (ENOENT), 1 ATTEND of zero sequences (ERANGE), 2 NOPs */
	{
		struct kvd_sqe bad_op = { .op = 9 }, fr = { .op = KVD_OP_FREE, .seq = 777 },
			       att = { .op = KVD_OP_ATTEND, .nseq = 0 }, nop = { .op = KVD_OP_NOP };

		raw_submit_nowait(&x, &bad_op);
		assert_int_equal(raw_reap(&x, 1, -EINVAL), 1);
		for (int i = 0; i < 3; i++)
			raw_submit_nowait(&x, &fr);
		assert_int_equal(raw_reap(&x, 3, -ENOENT), 3);
		raw_submit_nowait(&x, &att);
		assert_int_equal(raw_reap(&x, 1, -ERANGE), 1);
		for (int i = 0; i < 2; i++)
			raw_submit_nowait(&x, &nop);
		assert_int_equal(raw_reap(&x, 2, 0), 2);
	}

	/* ---- queue depth: 16 NOPs fill the 16-entry CQ (not reaped), 5 more
	 * wait in the SQ: 5 pending, nobody runnable (back-pressure). */
	{
		struct kvd_sqe nop = { .op = KVD_OP_NOP };

		for (int i = 0; i < 16; i++)
			raw_submit_nowait(&x, &nop);
		raw_wait_cq(&x, 16);
		for (int i = 0; i < 5; i++)
			raw_submit_nowait(&x, &nop);
		daemon_sleep_ms(50);
		t = scrape();
		EXPECT(t, 5, "kvd_queue_pending_entries");
		EXPECT(t, 0, "kvd_queue_runnable_clients");
		EXPECT(t, 0, "kvd_queue_parked_clients");
		free(t);
		assert_int_equal(raw_reap(&x, 16, 0), 16);
		assert_int_equal(raw_reap(&x, 5, 0), 5);
	}

	/* ---- control-only connection for MetricsReq and ServerStats. */
	assert_int_equal(raw_connect(&y, D.sock), 0);
	assert_int_equal(raw_hello(&y, 1), 0);
	Kvd__UidUsage u = uid_usage(&y, 0);
	int nstats = 2;

	assert_int_equal(kvc_server_stats(c, &st), 0);
	uint64_t s2_id = kvc_seq_id(s2);

	assert_int_equal(kvc_seq_free(c, s2), 0);
	/* a corrupted ring index: x is disconnected */
	atomic_store(&x.r.sq.ctl->tail, atomic_load(&x.r.sq.ctl->head) + 100000);
	{
		uint64_t one = 1;
		char b;

		assert_int_equal(write(x.efd, &one, 8), 8);
		assert_int_equal(recv(x.fd, &b, 1, 0), 0);
	}
	(void)s2_id;

	/* Refreshed usage after the free and the disconnect. */
	for (int i = 0; i < 100; i++) {
		u = uid_usage(&y, 0);
		nstats++;
		if (u.connections == 2)
			break;
		daemon_sleep_ms(10);
	}
	assert_int_equal(u.connections, 2);
	t = scrape();

	/* ring, by op and result */
	EXPECT(t, 2 * 2, "kvd_ring_requests_total{op=\"prefill\",result=\"ok\"}");
	EXPECT(t, 6, "kvd_ring_requests_total{op=\"attend\",result=\"ok\"}");
	EXPECT(t, 5 + 2 + 21, "kvd_ring_requests_total{op=\"nop\",result=\"ok\"}");
	EXPECT(t, 3, "kvd_ring_requests_total{op=\"free\",result=\"ENOENT\"}");
	EXPECT(t, 1, "kvd_ring_requests_total{op=\"attend\",result=\"ERANGE\"}");
	EXPECT(t, 1, "kvd_ring_requests_total{op=\"invalid\",result=\"EINVAL\"}");
	EXPECT(t, 0, "kvd_ring_requests_total{op=\"append\",result=\"ok\"}");
	EXPECT(t, 0, "kvd_ring_requests_total{op=\"free\",result=\"ok\"}");
	EXPECT(t, 0, "kvd_ring_requests_total{op=\"prefetch\",result=\"ok\"}");
	/* and nothing else: the totals are ServerStats' */
	assert_int_equal(family_sum(t, "kvd_ring_requests_total", NULL), 4 + 6 + 28 + 3 + 1 + 1);
	assert_int_equal(family_sum(t, "kvd_ring_requests_total", NULL), st.requests);
	/* ServerStats.errors also counts the control datagram that did not
	 * decode */
	assert_int_equal(family_sum(t, "kvd_ring_requests_total", NULL) -
			 family_sum(t, "kvd_ring_requests_total", "result=\"ok\"") + 1, st.errors);

	/* control, by op and result */
	EXPECT(t, 2 + 1, "kvd_control_requests_total{op=\"hello\",result=\"ok\"}");
	EXPECT(t, 1, "kvd_control_requests_total{op=\"profile_create\",result=\"ok\"}");
	EXPECT(t, 2, "kvd_control_requests_total{op=\"seq_create\",result=\"ok\"}");
	EXPECT(t, 1, "kvd_control_requests_total{op=\"seq_free\",result=\"ok\"}");
	EXPECT(t, 2, "kvd_control_requests_total{op=\"seq_free\",result=\"ENOENT\"}");
	EXPECT(t, 1, "kvd_control_requests_total{op=\"seq_free\",result=\"KVD_EPROTO\"}");
	EXPECT(t, 1, "kvd_control_requests_total{op=\"invalid\",result=\"KVD_EFORMAT\"}");
	EXPECT(t, nstats, "kvd_control_requests_total{op=\"server_stats\",result=\"ok\"}");
	/* and no other control results */
	assert_int_equal(family_sum(t, "kvd_control_requests_total", NULL), 3 + 1 + 2 + 1 + 2 + 1 + 1 +
			 nstats);
	EXPECT(t, 0, "kvd_control_requests_total{op=\"metrics\",result=\"ok\"}");

	/* ATTEND records: one per (sequence, layer) */
	EXPECT(t, 6, "kvd_attend_layer_seconds_count");
	EXPECT(t, 6, "kvd_attend_layer_seconds_bucket{le=\"+Inf\"}");
	assert_true(mf(t, "kvd_attend_layer_seconds_sum") > 0);
	assert_true(mf(t, "kvd_attend_layer_seconds_bucket{le=\"10\"}") == 6);

	/* by uid: ours is 0 (tests run as root) */
	EXPECT(t, u.connections, "kvd_clients{uid=\"0\"}");
	EXPECT(t, 1, "kvd_sequences{uid=\"0\"}");
	EXPECT(t, u.sequences, "kvd_sequences{uid=\"0\"}");
	EXPECT(t, 1, "kvd_profiles{uid=\"0\"}");
	EXPECT(t, u.bytes, "kvd_resident_bytes{uid=\"0\"}");
	assert_true(u.bytes > 0);
	EXPECT(t, 0, "kvd_spilled_bytes{uid=\"0\"}");
	EXPECT(t, 0, "kvd_shared_bytes{uid=\"0\"}");
	EXPECT(t, u.shm_bytes, "kvd_shm_bytes{uid=\"0\"}");
	/* the budget: 256 MiB, 90% and 80% */
	EXPECT(t, 256 << 20, "kvd_memory_limit_bytes");
	EXPECT(t, (256 << 20) / 100 * 90, "kvd_memory_high_watermark_bytes");
	EXPECT(t, (256 << 20) / 100 * 80, "kvd_memory_low_watermark_bytes");
	EXPECT(t, st.mem_high, "kvd_memory_high_watermark_bytes");
	EXPECT(t, u.bytes, "kvd_memory_used_bytes");
	EXPECT(t, 0, "kvd_memory_reserved_bytes");
	EXPECT(t, 0, "kvd_sequences_on_disk");
	EXPECT(t, 0, "kvd_spill_disk_bytes");
	/* no spill tier: no I/O, no evictions */
	EXPECT(t, 0, "kvd_spill_writes_total{result=\"ok\"}");
	EXPECT(t, 0, "kvd_spill_write_seconds_count");
	EXPECT(t, 0, "kvd_restores_total{result=\"ok\"}");
	EXPECT(t, 0, "kvd_evictions_total{how=\"written\"}");
	EXPECT(t, 0, "kvd_evictions_total{how=\"dropped\"}");
	EXPECT(t, 0, "kvd_sequences_lost_total");
	/* no sharing yet, no watchdog (not under systemd) */
	EXPECT(t, 0, "kvd_prefix_attach_hit_tokens_total");
	EXPECT(t, 0, "kvd_prefix_attach_miss_tokens_total");
	EXPECT(t, 0, "kvd_watchdog_pings_total");
	EXPECT(t, 0, "kvd_watchdog_skipped_total");
	EXPECT(t, 1, "kvd_disconnects_total");
	EXPECT(t, 0, "kvd_connections_refused_total");
	EXPECT(t, 0, "kvd_queue_pending_entries");
	assert_true(mf(t, "kvd_snapshot_age_seconds") < 1);

	/* promtool agrees it is valid exposition text */
	snprintf(path, sizeof path, "/tmp/kvd-metrics.%d.txt", (int)getpid());
	write_file(path, t);
	snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
	if (system(cmd))
		fail_msg("promtool check metrics failed on %s", path);
	unlink(path);

	/* MetricsReq: the same text (root sees every uid), but for the
	 * request being counted and the snapshot's age */
	char *ctl = raw_metrics(&y);

	assert_non_null(ctl);
	/* The request is counted once its reply is sent, on the loop thread:
	 * the client may scrape before that. */
	for (int i = 0; i < 500; i++) {
		free(t);
		t = scrape();
		if (mf(t, "kvd_control_requests_total{op=\"metrics\",result=\"ok\"}") >= 1)
			break;
		daemon_sleep_ms(10);
	}
	EXPECT(ctl, 0, "kvd_control_requests_total{op=\"metrics\",result=\"ok\"}");
	EXPECT(t, 1, "kvd_control_requests_total{op=\"metrics\",result=\"ok\"}");
	{
		char *a = strstr(ctl, "kvd_control_requests_total{op=\"metrics\""),
		     *b = strstr(t, "kvd_control_requests_total{op=\"metrics\"");
		char *ea = strstr(ctl, "# HELP kvd_snapshot_age_seconds"),
		     *eb = strstr(t, "# HELP kvd_snapshot_age_seconds");

		assert_non_null(a);
		assert_non_null(b);
		assert_non_null(ea);
		assert_non_null(eb);
		assert_int_equal(a - ctl, b - t);
		assert_memory_equal(ctl, t, (size_t)(a - ctl));
		a = strchr(a, '\n');
		b = strchr(b, '\n');
		assert_int_equal(ea - a, eb - b);
		assert_memory_equal(a, b, (size_t)(ea - a));
	}
	free(ctl);
	free(t);
	kvd_synth_free(&w1);
	kvd_synth_free(&w2);
	assert_int_equal(kvc_seq_free(c, s1), 0);
	kvc_close(c);
	raw_close(&x);
	raw_close(&y);
}

/* MetricsReq from another uid shows only that uid's labelled series; root
 * sees both. */
static void test_uid_visibility(void **state)
{
	struct raw y;
	int pfd[2], gfd[2], st;
	pid_t kid;
	char b;

	if (geteuid() != 0) {
		print_message("  not root: cannot test a second uid\n");
		skip();
	}
	chmod(D.dir, 0755);
	chmod(D.sock, 0777);
	assert_int_equal(pipe(pfd), 0);
	assert_int_equal(pipe(gfd), 0);
	kid = fork();
	if (kid == 0) {
		struct raw x;
		char *t;

		close(pfd[0]);
		close(gfd[1]);

		if (setgroups(0, NULL) || setgid(65534) || setuid(65534))
			_exit(90);
		if (raw_connect(&x, D.sock) || raw_hello(&x, 1))
			_exit(91);
		t = raw_metrics(&x);
		if (!t)
			_exit(92);
		if (mf(t, "kvd_clients{uid=\"65534\"}") != 1)
			_exit(93);
		if (strstr(t, "uid=\"0\""))
			_exit(94);
		if (write(pfd[1], "r", 1) != 1)
			_exit(95);
		/* wait for the parent's look */
		if (read(gfd[0], &b, 1) != 1)
			_exit(96);
		free(t);
		raw_close(&x);
		_exit(0);
	}
	close(pfd[1]);
	close(gfd[0]);
	if (read(pfd[0], &b, 1) != 1) {
		waitpid(kid, &st, 0);
		fail_msg("the uid 65534 child failed: status %d", WEXITSTATUS(st));
	}
	assert_int_equal(raw_connect(&y, D.sock), 0);
	assert_int_equal(raw_hello(&y, 1), 0);
	char *t = raw_metrics(&y);

	assert_non_null(t);
	EXPECT(t, 1, "kvd_clients{uid=\"65534\"}");
	EXPECT(t, 1, "kvd_clients{uid=\"0\"}");
	free(t);
	t = scrape();
	EXPECT(t, 1, "kvd_clients{uid=\"65534\"}");
	EXPECT(t, 1, "kvd_clients{uid=\"0\"}");
	free(t);
	assert_int_equal(write(gfd[1], "g", 1), 1);
	assert_int_equal(waitpid(kid, &st, 0), kid);
	assert_true(WIFEXITED(st));
	assert_int_equal(WEXITSTATUS(st), 0);
	close(pfd[0]);
	close(gfd[1]);
	raw_close(&y);
}

/* ---- the spill tier with injected faults ---------------------------------- */

static char spill_dir[64];

static int start_spill(void **state)
{
	char addr[64];

	snprintf(spill_dir, sizeof spill_dir, "/tmp/kvd-metrics-spill.XXXXXX");
	if (!mkdtemp(spill_dir))
		return -1;
	port = free_port();
	snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
	conf[0] = 0;
	return daemon_start4(&D, "--spill-dir", spill_dir, "--metrics-listen", addr) ? -1 : 0;
}

static int stop_spill(void **state)
{
	int rc = daemon_stop(&D);
	char cmd[128];

	snprintf(cmd, sizeof cmd, "rm -rf %s", spill_dir);
	if (system(cmd)) {
		/* left behind in /tmp */
	}
	return rc == 0 ? 0 : -1;
}

static struct kvc_seq_stats seq_state(struct kvc *c, struct kvc_seq *s, uint32_t want)
{
	struct kvc_seq_stats st;

	for (int i = 0; i < 1000; i++) {
		assert_int_equal(kvc_seq_stats(c, s, &st), 0);
		if (st.state == want && (want != KVC_SEQ_DISK || st.durable))
			return st;
		daemon_sleep_ms(10);
	}
	fail_msg("sequence never reached state %u (is %u)", want, st.state);
	return st;
}

/* Evictions, writes and restores: B and C are written and dropped, C comes
 * back and is dropped again without a write (its file is current). */
static void test_spill(void **state)
{
	struct kvc *c = client("spill");
	struct kvd_synth wb, wc;
	struct kvc_seq *b = prefilled(c, &wb, 11, N_TOK), *cc = prefilled(c, &wc, 12, N_TOK);
	struct kvc_seq_stats sb, sc;
	struct kvc_stats st;
	float o[8 * 128], lse[8];
	char *t;
	struct raw y;

	assert_int_equal(kvc_seq_evict(c, b), 0);
	sb = seq_state(c, b, KVC_SEQ_DISK);
	assert_int_equal(kvc_seq_evict(c, cc), 0);
	sc = seq_state(c, cc, KVC_SEQ_DISK);
	t = scrape();
	EXPECT(t, 2, "kvd_spill_writes_total{result=\"ok\"}");
	EXPECT(t, 0, "kvd_spill_writes_total{result=\"error\"}");
	EXPECT(t, sb.disk_bytes + sc.disk_bytes, "kvd_spill_write_bytes_total");
	EXPECT(t, 2, "kvd_spill_write_seconds_count");
	EXPECT(t, 2, "kvd_evictions_total{how=\"written\"}");
	EXPECT(t, 2, "kvd_sequences_on_disk");
	EXPECT(t, sb.disk_bytes + sc.disk_bytes, "kvd_spill_disk_bytes");
	EXPECT(t, sb.disk_bytes + sc.disk_bytes, "kvd_spilled_bytes{uid=\"0\"}");
	free(t);

	/* C back (a restore), then out again: dropped, no write */
	assert_int_equal(kvc_attend_kvd(c, 1, &cc, 1, wc.q, o, lse), 0);
	seq_state(c, cc, KVC_SEQ_RAM);
	assert_int_equal(kvc_seq_evict(c, cc), 0);
	seq_state(c, cc, KVC_SEQ_DISK);
	assert_int_equal(kvc_server_stats(c, &st), 0);
	t = scrape();
	EXPECT(t, 1, "kvd_restores_total{result=\"ok\"}");
	EXPECT(t, 0, "kvd_restores_total{result=\"error\"}");
	EXPECT(t, 0, "kvd_restores_total{result=\"cancelled\"}");
	EXPECT(t, sc.disk_bytes, "kvd_restore_bytes_total");
	EXPECT(t, st.restore_bytes, "kvd_restore_bytes_total");
	EXPECT(t, st.spill_bytes, "kvd_spill_write_bytes_total");
	EXPECT(t, 1, "kvd_restore_seconds_count");
	EXPECT(t, 2, "kvd_spill_writes_total{result=\"ok\"}");
	EXPECT(t, 1, "kvd_evictions_total{how=\"dropped\"}");
	EXPECT(t, st.drops, "kvd_evictions_total{how=\"dropped\"}");
	EXPECT(t, 2, "kvd_evictions_total{how=\"written\"}");
	EXPECT(t, 0, "kvd_sequences_lost_total");
	EXPECT(t, 1, "kvd_ring_requests_total{op=\"attend\",result=\"ok\"}");
	EXPECT(t, 3, "kvd_control_requests_total{op=\"seq_evict\",result=\"ok\"}");
	free(t);
	assert_int_equal(raw_connect(&y, D.sock), 0);
	assert_int_equal(raw_hello(&y, 1), 0);
	Kvd__UidUsage u = uid_usage(&y, 0);

	t = scrape();
	EXPECT(t, u.spill_bytes, "kvd_spilled_bytes{uid=\"0\"}");
	free(t);
	raw_close(&y);
	assert_int_equal(kvc_seq_free(c, b), 0);
	assert_int_equal(kvc_seq_free(c, cc), 0);
	kvd_synth_free(&wb);
	kvd_synth_free(&wc);
	kvc_close(c);
}

/* Faults: the first write fails (the sequence stays in RAM), the first read
 * fails (that sequence is lost). */
static int start_faulty(void **state)
{
	char addr[64];

	snprintf(spill_dir, sizeof spill_dir, "/tmp/kvd-metrics-spill.XXXXXX");
	if (!mkdtemp(spill_dir))
		return -1;
	port = free_port();
	snprintf(addr, sizeof addr, "--metrics-listen=127.0.0.1:%u", port);
	return daemon_start4(&D, "--spill-dir", spill_dir, "--spill-fault=eio-write@0,eio-read@0",
			     addr) ? -1 : 0;
}

static void test_spill_faults(void **state)
{
	struct kvc *c = client("faulty");
	struct kvd_synth wa, wb;
	struct kvc_seq *a = prefilled(c, &wa, 21, N_TOK), *b = prefilled(c, &wb, 22, N_TOK);
	struct kvc_seq_stats sa;
	float o[8 * 128], lse[8];
	char *t = NULL;

	assert_int_equal(kvc_seq_evict(c, a), 0);
	for (int i = 0; i < 1000; i++) {        /* the write fails: A stays in RAM */
		free(t);
		t = scrape();
		if (mf(t, "kvd_spill_writes_total{result=\"error\"}") == 1)
			break;
		daemon_sleep_ms(10);
	}
	EXPECT(t, 1, "kvd_spill_writes_total{result=\"error\"}");
	EXPECT(t, 0, "kvd_spill_writes_total{result=\"ok\"}");
	EXPECT(t, 0, "kvd_spill_write_bytes_total");
	EXPECT(t, 1, "kvd_spill_write_seconds_count");
	EXPECT(t, 0, "kvd_evictions_total{how=\"written\"}");
	free(t);
	assert_int_equal(kvc_seq_stats(c, a, &sa), 0);
	assert_int_equal(sa.state, KVC_SEQ_RAM);

	assert_int_equal(kvc_seq_evict(c, b), 0);
	seq_state(c, b, KVC_SEQ_DISK);
	/* B's restore reads fail: B is lost */
	assert_int_equal(kvc_attend_kvd(c, 1, &b, 1, wb.q, o, lse), -KVD_ELOST);
	t = scrape();
	EXPECT(t, 1, "kvd_spill_writes_total{result=\"ok\"}");
	EXPECT(t, 1, "kvd_evictions_total{how=\"written\"}");
	EXPECT(t, 1, "kvd_restores_total{result=\"error\"}");
	EXPECT(t, 0, "kvd_restores_total{result=\"ok\"}");
	EXPECT(t, 0, "kvd_restore_bytes_total");
	EXPECT(t, 1, "kvd_restore_seconds_count");
	EXPECT(t, 1, "kvd_sequences_lost_total");
	EXPECT(t, 1, "kvd_ring_requests_total{op=\"attend\",result=\"KVD_ELOST\"}");
	free(t);
	assert_int_equal(kvc_seq_free(c, a), 0);
	assert_int_equal(kvc_seq_free(c, b), 0);
	kvd_synth_free(&wa);
	kvd_synth_free(&wb);
	kvc_close(c);
}

/* ---- a real Prometheus ----------------------------------------------------- */

static void test_prometheus_scrapes(void **state)
{
	char dir[64] = "/tmp/kvd-prom.XXXXXX", yml[128], data[128], lst[64], target[64], cmd[256];
	unsigned pport = free_port();
	struct kvc *c = client("prom");
	pid_t prom;
	int ok = 0;

	for (int i = 0; i < 7; i++)
		assert_int_equal(kvc_nop(c), 0);
	assert_non_null(mkdtemp(dir));
	snprintf(yml, sizeof yml, "%s/prometheus.yml", dir);
	snprintf(data, sizeof data, "--storage.tsdb.path=%s/data", dir);
	snprintf(lst, sizeof lst, "--web.listen-address=127.0.0.1:%u", pport);
	snprintf(target, sizeof target, "127.0.0.1:%u", port);
	{
		char body[512];

		snprintf(body, sizeof body,
			 "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
			 "scrape_configs:\n  - job_name: kvd\n    static_configs:\n"
			 "      - targets: ['%s']\n", target);
		write_file(yml, body);
	}
	snprintf(cmd, sizeof cmd, "--config.file=%s", yml);
	prom = fork();
	if (prom == 0) {
		int null = open("/dev/null", O_WRONLY);

		dup2(null, 1);
		dup2(null, 2);
		execlp("prometheus", "prometheus", cmd, data, lst, "--web.enable-lifecycle",
		       (char *)NULL);
		_exit(127);
	}
	/* its query API, until the counter has been scraped (30 s at most) */
	for (int i = 0; i < 300 && !ok; i++) {
		int status;
		char *r = http_get(pport, "/api/v1/query?query="
				   "kvd_ring_requests_total%7Bop%3D%22nop%22%2Cresult%3D%22ok%22%7D", &status);

		if (r && status == 200 && strstr(r, "\"status\":\"success\"") &&
		    strstr(r, "\"job\":\"kvd\"")) {
			char *v = strstr(r, "\"value\":[");

			assert_non_null(v);
			v = strchr(v, ',');
			assert_non_null(v);
			if (strncmp(v, ",\"7\"]", 5))
				fail_msg("Prometheus says %.40s, expected 7", v);
			ok = 1;
		}
		free(r);
		if (!ok)
			daemon_sleep_ms(100);
	}
	kill(prom, SIGTERM);
	waitpid(prom, NULL, 0);
	snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
	if (system(cmd)) {
		/* left in /tmp */
	}
	kvc_close(c);
	if (!ok)
		fail_msg("Prometheus never returned kvd's counter");
}

/* ---- the endpoint while the executor is busy -------------------------------- */

static void test_scrape_during_prefill(void **state)
{
	int pfd[2];
	pid_t kid;
	char b;
	double worst = 0, age = 0;
	int scrapes = 0, st;

	assert_int_equal(pipe(pfd), 0);
	kid = fork();
	if (kid == 0) {
		/* 2 sparse layers x 60k tokens, each sealed as one 60k-token
		 * segment at its last chunk: units that hold the state lock
		 * (and so the event loop) for a long time */
		struct kvc_model big = model;
		struct kvd_synth w;
		struct kvc_opts o = { .socket_path = D.sock, .tenant = "t", .name = "big",
				      .slots = 4, .slot_size = 8 << 20 };
		struct kvc *c;
		struct kvc_seq *s;
		const uint32_t n = 60000;

		big.name = "mtest-big";
		big.segment_tokens = 65536;
		if (kvc_connect(&o, &c) || kvc_profile(c, &big) || kvc_seq_create(c, &s))
			_exit(2);
		if (kvd_synth_make(&w, KVD_WL_DENSE, n, 8, 2, 128, 5))
			_exit(3);
		if (write(pfd[1], "s", 1) != 1)
			_exit(4);
		for (uint32_t l = 0; l < LAYERS; l++)
			if (kvc_prefill(c, s, l, w.k, w.v, n))
				_exit(5);
		_exit(0);
	}
	close(pfd[1]);
	assert_int_equal(read(pfd[0], &b, 1), 1);
	/* scrape while it runs */
	for (;;) {
		double t0 = now_ms(), dt;
		char *t = scrape();

		dt = now_ms() - t0;
		if (dt > worst)
			worst = dt;
		scrapes++;
		if (mf(t, "kvd_snapshot_age_seconds") > age)
			age = mf(t, "kvd_snapshot_age_seconds");
		free(t);
		if (waitpid(kid, &st, WNOHANG) == kid)
			break;
		daemon_sleep_ms(20);
	}
	assert_true(WIFEXITED(st));
	assert_int_equal(WEXITSTATUS(st), 0);
	print_message("  %d scrapes during the prefill, slowest %.1f ms, oldest snapshot %.0f ms\n",
		      scrapes, worst, age * 1e3);
	/* the HTTP thread waits at most 250 ms for the loop: never more than
	 * that plus a render, with room for sanitizers */
	assert_true(scrapes >= 3);
	assert_true(worst < 1500);
	close(pfd[0]);
	char *t = scrape();

	EXPECT(t, 0, "kvd_queue_pending_entries");
	assert_true(mf(t, "kvd_ring_requests_total{op=\"prefill\",result=\"ok\"}") >= 2);
	/* every one of them ok */
	assert_true(family_sum(t, "kvd_ring_requests_total", "op=\"prefill\"") ==
		    mf(t, "kvd_ring_requests_total{op=\"prefill\",result=\"ok\"}"));
	free(t);
}

/* ---- watchdog --------------------------------------------------------------- */

/* A hostile local process holds every HTTP connection the endpoint allows,
 * each with half a request, and floods garbage on more: the endpoint is
 * its own thread with its own connection limit, so decoding clients and the
 * control socket's MetricsReq are not held up, and once the process is
 * gone a scrape answers again. */
static void test_hostile_scrapers(void **state)
{
	struct kvd_synth w;
	struct kvc *c = client("decoder");
	struct kvc_seq *s = prefilled(c, &w, 11, 1500);
	float o[8 * 128], lse[8];
	double worst = 0;
	struct raw x;
	char *t;
	int st;
	pid_t kid = fork();

	if (kid == 0) {
		struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
					 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };

		for (int i = 0; i < 200; i++) {
			int fd = socket(AF_INET, SOCK_STREAM, 0);

			if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a))
				continue;
			if (i % 2)
				(void)!write(fd, "GET /metr", 9);       /* and never the rest */
			else
				(void)!write(fd, "\x16\x03\x01garbage\r\n\r\n", 14);
		}
		pause();
		_exit(0);
	}
	assert_true(kid > 0);
	daemon_sleep_ms(300);                   /* the connections are held */
	for (int i = 0; i < 20; i++) {
		double t0 = now_ms();

		for (uint32_t l = 1; l < LAYERS; l++)
			assert_int_equal(kvc_attend_kvd(c, l, &s, 1, w.q, o, lse), 0);
		worst = fmax(worst, now_ms() - t0);
	}
	assert_int_equal(raw_connect(&x, D.sock), 0);
	assert_int_equal(raw_hello(&x, 1), 0);
	t = raw_metrics(&x);
	assert_non_null(t);
	assert_non_null(strstr(t, "kvd_build_info"));
	free(t);
	raw_close(&x);
	print_message("200 hostile HTTP connections: worst decode step %.1f ms\n", worst);
	assert_true(worst < 250);
	kill(kid, SIGKILL);
	waitpid(kid, NULL, 0);
	/* freed connections: the endpoint serves again */
	t = NULL;
	for (int i = 0; i < 50 && !t; i++) {
		t = http_get(port, "/metrics", &st);
		if (!t)
			daemon_sleep_ms(100);
	}
	assert_non_null(t);
	assert_int_equal(st, 200);
	free(t);
	assert_int_equal(kvc_seq_free(c, s), 0);
	kvd_synth_free(&w);
	kvc_close(c);
}

/* ---- slowloris ------------------------------------------------------------ */

#define LIFE_MS 1500    /* [metrics] request_timeout_ms of the short-lived daemon */

static int start_short(void **state)
{
	return start_with("[memory]\nlimit = 256M\n[metrics]\nrequest_timeout_ms = 1500\n", NULL,
			  NULL);
}

static int start_long(void **state)
{
	return start_with("[memory]\nlimit = 256M\n[metrics]\nrequest_timeout_ms = 60000\n", NULL,
			  NULL);
}

/* A child that opens n connections to the endpoint, the i-th from 127.0.0.(2
 * + i % nips) (all of 127/8 is loopback), and drips one more byte of a
 * request into each every 200 ms, so libmicrohttpd's inactivity timeout
 * never fires; a connection kvd closes stays closed.  Returns once every
 * connect is done. */
static pid_t dripper(int n, int nips)
{
	int pfd[2];
	char ok;
	pid_t kid;

	assert_true(n <= 128);
	assert_int_equal(pipe(pfd), 0);
	kid = fork();
	assert_true(kid >= 0);
	if (kid == 0) {
		static const char req[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Drip: ";
		struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
					 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
		int fd[128];
		size_t at = 0;

		prctl(PR_SET_PDEATHSIG, SIGKILL);
		close(pfd[0]);
		for (int i = 0; i < n; i++) {
			struct sockaddr_in me = { .sin_family = AF_INET };

			me.sin_addr.s_addr = htonl(0x7f000002u + (uint32_t)(i % nips));
			fd[i] = socket(AF_INET, SOCK_STREAM, 0);
			if (fd[i] < 0 || bind(fd[i], (struct sockaddr *)&me, sizeof me) ||
			    connect(fd[i], (struct sockaddr *)&a, sizeof a))
				_exit(2);
		}
		(void)!write(pfd[1], "k", 1);
		for (;;) {
			char ch = at < sizeof req - 1 ? req[at++] : 'a';

			for (int i = 0; i < n; i++)
				if (fd[i] >= 0 && send(fd[i], &ch, 1, MSG_NOSIGNAL) != 1) {
					close(fd[i]);
					fd[i] = -1;
				}
			daemon_sleep_ms(200);
		}
	}
	close(pfd[1]);
	assert_int_equal(read(pfd[0], &ok, 1), 1);
	close(pfd[0]);
	daemon_sleep_ms(300);                   /* kvd has accepted what it takes */
	return kid;
}

/* 70 dripping connections from one peer (the attack filled all 64
 * of the endpoint's): the peer holds KVD_METRICS_CONNS_PER_IP of them, and
 * a scraper from another address is answered at once, every time, long
 * before any connection's total time is up (60 s here). */
static void test_slowloris_one_peer(void **state)
{
	pid_t kid = dripper(70, 1);

	for (int i = 0; i < 3; i++) {
		double t0 = now_ms(), dt;
		int st = 0;
		char *t = http_get_ms(port, "/metrics", &st, 3000);

		dt = now_ms() - t0;
		if (!t)
			fail_msg("scrape %d: no answer in %.0f ms beside 70 dripping "
				 "connections", i, dt);
		assert_int_equal(st, 200);
		assert_non_null(strstr(t, "kvd_build_info"));
		free(t);
		print_message("  scrape %d beside 70 dripping connections of one peer: %.1f ms\n",
			      i, dt);
		daemon_sleep_ms(100);
	}
	kill(kid, SIGKILL);
	waitpid(kid, NULL, 0);
}

/* 70 dripping connections from 10 peers: 64 fill the endpoint (7 a peer is
 * within the per-peer limit), and only their total time frees it: a scraper
 * retrying is answered within LIFE_MS and a margin, and the cut ones are
 * counted. */
static void test_slowloris_many_peers(void **state)
{
	pid_t kid = dripper(70, 10);
	double t0 = now_ms(), dt;
	char *t = NULL;
	int st = 0, tries = 0;

	while (!t && now_ms() - t0 < LIFE_MS + 4000) {
		tries++;
		if (!(t = http_get_ms(port, "/metrics", &st, LIFE_MS + 4000)))
			daemon_sleep_ms(50);
	}
	dt = now_ms() - t0;
	if (!t)
		fail_msg("no answer in %.0f ms (%d tries) beside 70 dripping connections", dt,
			 tries);
	assert_int_equal(st, 200);
	print_message("  scrape beside 70 dripping connections of 10 peers: %.0f ms, %d tries, "
		      "%g cut\n", dt, tries, mf(t, "kvd_metrics_connections_cut_total"));
	assert_true(dt < LIFE_MS + 4000);
	assert_true(mf(t, "kvd_metrics_connections_cut_total") >= 1);
	free(t);
	kill(kid, SIGKILL);
	waitpid(kid, NULL, 0);
}

/* One connection that sends a byte every 100 ms (never idle) is closed
 * LIFE_MS after it was accepted all the same, and not before. */
static void test_drip_cut(void **state)
{
	static const char req[] = "GET /metrics HTTP/1.1\r\nX-Drip: ";
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int fd = socket(AF_INET, SOCK_STREAM, 0), closed = 0;
	double t0 = now_ms(), dt = 0;
	size_t at = 0;
	char *t;
	int st;

	assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
	while (!closed && (dt = now_ms() - t0) < LIFE_MS + 4000) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		char ch = at < sizeof req - 1 ? req[at++] : 'a', b[256];

		if (send(fd, &ch, 1, MSG_NOSIGNAL) != 1)
			closed = 1;
		else if (poll(&p, 1, 100) == 1 && recv(fd, b, sizeof b, 0) <= 0)
			closed = 1;
	}
	dt = now_ms() - t0;
	close(fd);
	print_message("  a connection dripping a byte every 100 ms closed after %.0f ms "
		      "(request_timeout_ms = %d)\n", dt, LIFE_MS);
	if (!closed)
		fail_msg("still open after %.0f ms of dripping", dt);
	assert_true(dt >= LIFE_MS);
	t = http_get(port, "/metrics", &st);
	assert_non_null(t);
	EXPECT(t, 1, "kvd_metrics_connections_cut_total");
	free(t);
}

static void test_watchdog(void **state)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	char buf[256], addr[64], *t;
	int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0), got = 0, after;
	struct timeval tv = { 5, 0 };
	double m;

	snprintf(a.sun_path, sizeof a.sun_path, "/tmp/kvd-metrics-notify.%d", (int)getpid());
	unlink(a.sun_path);
	assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setenv("NOTIFY_SOCKET", a.sun_path, 1);
	setenv("WATCHDOG_USEC", "100000", 1);
	port = free_port();
	snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
	assert_int_equal(daemon_start4(&D, "--metrics-listen", addr, NULL, NULL), 0);
	unsetenv("NOTIFY_SOCKET");
	unsetenv("WATCHDOG_USEC");
	while (got < 4) {
		ssize_t n = recv(fd, buf, sizeof buf - 1, 0);

		assert_true(n > 0);
		buf[n] = 0;
		got += strstr(buf, "WATCHDOG=1") != NULL;
	}
	t = scrape();
	m = mf(t, "kvd_watchdog_pings_total");
	EXPECT(t, 0, "kvd_watchdog_skipped_total");
	free(t);
	/* every ping sent before the scrape is in our socket now */
	after = got;
	for (;;) {
		ssize_t n = recv(fd, buf, sizeof buf - 1, MSG_DONTWAIT);

		if (n <= 0)
			break;
		buf[n] = 0;
		after += strstr(buf, "WATCHDOG=1") != NULL;
	}
	print_message("  %d pings received before the scrape, %g counted, %d after\n", got, m,
		      after);
	assert_true(m >= got && m <= after);
	assert_int_equal(daemon_stop(&D), 0);
	close(fd);
	unlink(a.sun_path);
}

/* ---- off --------------------------------------------------------------------- */

/* The TCP sockets kvd listens on: none when the endpoint is off. */
static int tcp_listeners(pid_t pid)
{
	char p[64], l[512];
	int n = 0;

	for (int fdn = 0; fdn < 1024; fdn++) {
		char link[64];
		ssize_t k;
		unsigned long ino;

		snprintf(p, sizeof p, "/proc/%d/fd/%d", (int)pid, fdn);
		k = readlink(p, link, sizeof link - 1);
		if (k <= 0)
			continue;
		link[k] = 0;
		if (sscanf(link, "socket:[%lu]", &ino) != 1)
			continue;
		for (int v6 = 0; v6 < 2; v6++) {
			FILE *f = fopen(v6 ? "/proc/net/tcp6" : "/proc/net/tcp", "r");

			while (f && fgets(l, sizeof l, f)) {
				unsigned st;
				unsigned long i;

				if (sscanf(l, "%*d: %*s %*s %x %*s %*s %*s %*s %*s %lu", &st, &i) == 2 &&
				    st == 0x0A && i == ino)
					n++;
			}
			if (f)
				fclose(f);
		}
	}
	return n;
}

static void test_off(void **state)
{
	struct raw x, z;
	char path[128];
	char *t;
	int st;

	/* on: one listener, the port answers */
	assert_int_equal(start_with("[limits]\nconnections = 1\nconnections_per_uid = 1\n", NULL, NULL), 0);
	assert_int_equal(tcp_listeners(D.pid), 1);
	t = http_get(port, "/nope", &st);
	assert_non_null(t);
	assert_int_equal(st, 404);
	free(t);
	assert_int_equal(daemon_stop(&D), 0);
	unlink(conf);

	/* `listen =` in the file: none, and MetricsReq still answers */
	snprintf(path, sizeof path, "/tmp/kvd-metrics-off.%d.conf", (int)getpid());
	write_file(path, "[metrics]\nlisten =\n[limits]\nconnections = 1\nconnections_per_uid = 1\n");
	assert_int_equal(daemon_start4(&D, "--config", path, NULL, NULL), 0);
	assert_int_equal(tcp_listeners(D.pid), 0);
	assert_int_equal(raw_connect(&x, D.sock), 0);
	assert_int_equal(raw_hello(&x, 1), 0);
	/* a second connection is over the limit: refused */
	assert_int_equal(raw_connect(&z, D.sock), 0);
	{
		char b[512];

		assert_true(recv(z.fd, b, sizeof b, 0) > 0);    /* the Error */
		assert_int_equal(recv(z.fd, b, sizeof b, 0), 0); /* then closed */
	}
	raw_close(&z);
	t = raw_metrics(&x);
	assert_non_null(t);
	EXPECT(t, 1, "kvd_connections_refused_total");
	EXPECT(t, 1, "kvd_clients{uid=\"0\"}");
	EXPECT(t, 1, "kvd_control_requests_total{op=\"hello\",result=\"ok\"}");
	free(t);
	raw_close(&x);
	assert_int_equal(daemon_stop(&D), 0);
	unlink(path);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_counts, start, stop),
		cmocka_unit_test_setup_teardown(test_uid_visibility, start, stop),
		cmocka_unit_test_setup_teardown(test_spill, start_spill, stop_spill),
		cmocka_unit_test_setup_teardown(test_spill_faults, start_faulty, stop_spill),
		cmocka_unit_test_setup_teardown(test_prometheus_scrapes, start, stop),
		cmocka_unit_test_setup_teardown(test_scrape_during_prefill, start, stop),
		cmocka_unit_test_setup_teardown(test_hostile_scrapers, start, stop),
		cmocka_unit_test_setup_teardown(test_slowloris_one_peer, start_long, stop),
		cmocka_unit_test_setup_teardown(test_slowloris_many_peers, start_short, stop),
		cmocka_unit_test_setup_teardown(test_drip_cut, start_short, stop),
		cmocka_unit_test(test_watchdog),
		cmocka_unit_test(test_off),
	};

	if (!have("promtool") || !have("prometheus")) {
		printf("test_metrics: SKIP: promtool or prometheus not installed "
		       "(tools/deps.sh installs Debian's prometheus package)\n");
		return 77;
	}
	if (getenv("KVD_TEST_FILTER"))
		cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
