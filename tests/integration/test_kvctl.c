/* kvctl, the admin CLI, against the real daemon: the built binary
 * (<dir of this test>/../kvctl) runs as a subprocess, as root and, where the
 * test runs as root (CI does), as other uids.  Every test starts its own
 * kvd (with a spill directory and a config naming an admin group) and stops
 * it; daemon_stop() returning 0 is part of every test but the drain one.
 *
 *   test_usage_and_unreachable  exit 2 on usage errors, 69 without a daemon
 *   test_control_hello          a control-only Hello maps nothing, holds no
 *                               region, cannot create; its checks
 *   test_status                 status, text and --json
 *   test_clients                clients lists data and control connections
 *   test_seqs_and_show          seqs, seq show, a missing seq (exit 1)
 *   test_seq_evict_free         seq evict reaches disk, seq free frees
 *   test_paging                 a listing longer than one reply pages
 *   test_profiles_limits        profiles (with their kv_dtype and estimator) and
 *                               limits, text and --json
 *   test_visibility             uid B cannot see or touch uid A's things:
 *                               the same error as a missing seq; an admin
 *                               group sees everything; only admins drain
 *   test_connection_limit       kvctl counts against connections_per_uid
 *   test_metrics                metrics prints kvd's metrics text (MetricsReq)
 *   test_drain                  drain: Ok, the daemon exits 0, then 69
 *
 * --json output is checked with a small JSON parser: exactly one value, an
 * object or an array as documented, and nothing after it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "proto/ctl.h"
#include "daemon.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "testutil.h"

#define UID_B     65534
#define UID_C     65533
#define ADMIN_GID 4242

static struct daemon D;
static char cfg_path[128], spill_dir[64];

/* ---- a tiny JSON checker ----------------------------------------------- */

static const char *jp_ws(const char *p)
{
	while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')
		p++;
	return p;
}

static const char *jp_value(const char *p, int depth);

static const char *jp_string(const char *p)
{
	if (*p++ != '"')
		return NULL;
	while (*p && *p != '"') {
		if ((unsigned char)*p < 0x20)
			return NULL;
		if (*p == '\\') {
			p++;
			if (*p == 'u') {
				for (int i = 1; i <= 4; i++)
					if (!strchr("0123456789abcdefABCDEF", p[i]) || !p[i])
						return NULL;
				p += 4;
			} else if (!*p || !strchr("\"\\/bfnrt", *p)) {
				return NULL;
			}
		}
		p++;
	}
	return *p == '"' ? p + 1 : NULL;
}

static const char *jp_number(const char *p)
{
	const char *s = p;

	if (*p == '-')
		p++;
	if (*p < '0' || *p > '9')
		return NULL;
	while ((*p >= '0' && *p <= '9') || *p == '.' || *p == 'e' || *p == 'E' || *p == '+' ||
	       *p == '-')
		p++;
	return p > s ? p : NULL;
}

static const char *jp_seq(const char *p, char close, int obj, int depth)
{
	p = jp_ws(p + 1);
	if (*p == close)
		return p + 1;
	for (;;) {
		if (obj) {
			p = jp_string(jp_ws(p));
			if (!p)
				return NULL;
			p = jp_ws(p);
			if (*p++ != ':')
				return NULL;
		}
		p = jp_value(p, depth + 1);
		if (!p)
			return NULL;
		p = jp_ws(p);
		if (*p == close)
			return p + 1;
		if (*p++ != ',')
			return NULL;
	}
}

static const char *jp_value(const char *p, int depth)
{
	p = jp_ws(p);
	if (depth > 32)
		return NULL;
	switch (*p) {
	case '{': return jp_seq(p, '}', 1, depth);
	case '[': return jp_seq(p, ']', 0, depth);
	case '"': return jp_string(p);
	case 't': return strncmp(p, "true", 4) ? NULL : p + 4;
	case 'f': return strncmp(p, "false", 5) ? NULL : p + 5;
	case 'n': return strncmp(p, "null", 4) ? NULL : p + 4;
	default:  return jp_number(p);
	}
}

/* Exactly one JSON value of kind '{' or '['. */
static void assert_json(const char *s, char kind)
{
	const char *end;

	if (*jp_ws(s) != kind)
		fail_msg("not a JSON %s: %.300s", kind == '{' ? "object" : "array", s);
	end = jp_value(s, 0);
	if (!end || *jp_ws(end))
		fail_msg("not one JSON value: %.300s", s);
}

static int count_of(const char *s, const char *needle)
{
	int n = 0;

	for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

/* ---- running kvctl ------------------------------------------------------ */

struct run {
	int status;             /* exit status, or 128 + signal */
	char out[1 << 20];
	char err[8192];
};

static struct run R;

static void read_back(int fd, char *buf, size_t cap)
{
	ssize_t n = pread(fd, buf, cap - 1, 0);

	buf[n > 0 ? n : 0] = 0;
	close(fd);
}

/* Runs kvctl --socket <D's> ARGS... (NULL-terminated) as uid/gid (uid < 0:
 * as we are) with supplementary groups `groups` (ngroups of them).  Fills R. */
static int kvctl_as(int uid, gid_t gid, const gid_t *groups, int ngroups, ...)
{
	char exe[PATH_MAX], bin[PATH_MAX + 16], outp[] = "/tmp/kvctl-out.XXXXXX",
	     errp[] = "/tmp/kvctl-err.XXXXXX";
	const char *argv[32] = { "kvctl", "--socket", D.sock };
	int argc = 3, fo, fe, st;
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	va_list ap;
	pid_t p;

	assert_true(n > 0);
	exe[n] = 0;
	*strrchr(exe, '/') = 0;
	snprintf(bin, sizeof bin, "%s/../kvctl", exe);
	va_start(ap, ngroups);
	for (const char *a; (a = va_arg(ap, const char *)) && argc < 31;)
		argv[argc++] = a;
	va_end(ap);
	argv[argc] = NULL;
	fo = mkstemp(outp);
	fe = mkstemp(errp);
	assert_true(fo >= 0 && fe >= 0);
	unlink(outp);
	unlink(errp);
	p = fork();
	assert_true(p >= 0);
	if (p == 0) {
		dup2(fo, 1);
		dup2(fe, 2);
		if (uid >= 0 && (setgroups((size_t)ngroups, groups) || setgid(gid) || setuid((uid_t)uid)))
			_exit(120);
		execv(bin, (char *const *)argv);
		_exit(121);
	}
	assert_int_equal(waitpid(p, &st, 0), p);
	R.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
	read_back(fo, R.out, sizeof R.out);
	read_back(fe, R.err, sizeof R.err);
	if (R.status == 120 || R.status == 121)
		fail_msg("could not run %s as uid %d (status %d)", bin, uid, R.status);
	return R.status;
}

#define kvctl(...) kvctl_as(-1, 0, NULL, 0, __VA_ARGS__, (const char *)NULL)
#define kvctl_uid(uid, ...) kvctl_as((uid), (uid), NULL, 0, __VA_ARGS__, (const char *)NULL)

static void expect(int want, const char *what)
{
	if (R.status != want)
		fail_msg("%s: exit %d, want %d\nstdout: %.2000s\nstderr: %.2000s", what, R.status,
			 want, R.out, R.err);
}

static void expect_out(const char *needle, const char *what)
{
	if (!strstr(R.out, needle))
		fail_msg("%s: '%s' not in stdout:\n%.3000s", what, needle, R.out);
}

static void expect_err(const char *needle, const char *what)
{
	if (!strstr(R.err, needle))
		fail_msg("%s: '%s' not in stderr:\n%.2000s", what, needle, R.err);
}

/* ---- the daemon and its clients ---------------------------------------- */

static int start(void **state)
{
	FILE *f;

	snprintf(spill_dir, sizeof spill_dir, "/tmp/kvd-kvctl-spill.XXXXXX");
	if (!mkdtemp(spill_dir))
		return -1;
	snprintf(cfg_path, sizeof cfg_path, "/tmp/kvd-kvctl.%d.conf", (int)getpid());
	f = fopen(cfg_path, "w");
	if (!f)
		return -1;
	fprintf(f, "[server]\nadmin_group = %d\n[limits]\nconnections_per_uid = 4\n", ADMIN_GID);
	fclose(f);
	if (daemon_start4(&D, "--config", cfg_path, "--spill-dir", spill_dir))
		return -1;
	/* other uids must reach the socket */
	chmod(D.dir, 0755);
	chmod(D.sock, 0777);
	return 0;
}

static void cleanup_files(void)
{
	char cmd[128];

	unlink(cfg_path);
	snprintf(cmd, sizeof cmd, "rm -rf %s", spill_dir);
	if (system(cmd)) {
		/* best effort */
	}
}

static pid_t kid_pid;            /* a client of another uid still running */

static int stop(void **state)
{
	int rc;

	if (kid_pid > 0) {
		kill(kid_pid, SIGKILL);
		waitpid(kid_pid, NULL, 0);
		kid_pid = 0;
	}
	rc = daemon_stop(&D);

	cleanup_files();
	if (rc)
		print_error("daemon_stop: %d (want 0: a clean drain)\n", rc);
	return rc == 0 ? 0 : -1;
}

static const struct kvc_model model = {
	.name = "kvctl-test", .layers = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 16,
	.K = 4, .L = 8, .c = 1, .sink = 4, .window = 16, .segment_tokens = 256,
	.seal_tokens = 16, .seed = 3,
};

static struct kvc *data_client(const char *name, const struct kvc_model *m)
{
	struct kvc_opts o = { .socket_path = D.sock, .tenant = "t", .name = name, .slots = 4,
			      .slot_size = 1 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c))
		fail_msg("connect: %s", kvc_last_error(c));
	if (kvc_profile(c, m))
		fail_msg("profile: %s", kvc_last_error(c));
	return c;
}

/* Prefills every layer with n random tokens. */
static void prefill(struct kvc *c, struct kvc_seq *s, uint32_t n)
{
	size_t cnt = (size_t)model.kv_heads * n * model.head_dim;
	float *k = xmalloc(cnt * sizeof *k), *v = xmalloc(cnt * sizeof *v);
	struct kvd_rng r = kvd_rng_make(11);

	fill_normal(k, cnt, &r, 0, 1);
	fill_normal(v, cnt, &r, 0, 1);
	for (uint32_t l = 0; l < model.layers; l++)
		if (kvc_prefill(c, s, l, k, v, n))
			fail_msg("prefill: %s", kvc_last_error(c));
	free(k);
	free(v);
}

static int need_root(void)
{
	if (geteuid() != 0) {
		print_message("  not root: cannot run kvctl as other uids\n");
		return 0;
	}
	return 1;
}

/* A client of another uid in a child: creates a profile (named `prof`) and
 * a sequence, writes the sequence's id to *out, and holds both until the
 * parent closes the pipe. */
struct kid {
	pid_t pid;
	int hold;
};

static struct kid other_uid_client(uid_t uid, const char *prof, uint64_t *out)
{
	int go[2], ready[2];
	struct kid k;

	assert_int_equal(pipe(go), 0);
	assert_int_equal(pipe(ready), 0);
	k.pid = fork();
	assert_true(k.pid >= 0);
	if (k.pid == 0) {
		struct kvc_opts o = { .socket_path = D.sock, .tenant = "b", .name = "other",
				      .slots = 4, .slot_size = 1 << 20 };
		struct kvc_model m = model;
		struct kvc *c;
		struct kvc_seq *s;
		uint64_t id = 0;
		char x;

		close(go[1]);
		close(ready[0]);
		m.name = prof;
		if (setgroups(0, NULL) || setgid(uid) || setuid(uid))
			_exit(2);
		if (kvc_connect(&o, &c) || kvc_profile(c, &m) || kvc_seq_create(c, &s))
			_exit(3);
		id = kvc_seq_id(s);
		if (write(ready[1], &id, sizeof id) != sizeof id)
			_exit(4);
		if (read(go[0], &x, 1) < 0) {
			/* EOF: the parent is done */
		}
		kvc_seq_free(c, s);
		kvc_close(c);
		_exit(0);
	}
	kid_pid = k.pid;
	close(go[0]);
	close(ready[1]);
	if (read(ready[0], out, sizeof *out) != sizeof *out)
		fail_msg("the client of uid %d did not start", (int)uid);
	close(ready[0]);
	k.hold = go[1];
	return k;
}

static void release(struct kid *k)
{
	int st;

	close(k->hold);
	assert_int_equal(waitpid(k->pid, &st, 0), k->pid);
	kid_pid = 0;
	assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* ---- tests -------------------------------------------------------------- */

static void test_usage_and_unreachable(void **state)
{
	kvctl("--help");
	expect(0, "--help");
	expect_out("usage:", "--help");
	expect_out("exit status", "--help");
	kvctl_as(-1, 0, NULL, 0, (const char *)NULL);
	expect(2, "no command");
	kvctl("bogus");
	expect(2, "unknown command");
	expect_err("unknown command 'bogus'", "unknown command");
	kvctl("seq", "show", "abc");
	expect(2, "seq show abc");
	kvctl("seq", "show", "0");
	expect(2, "seq show 0");
	kvctl("seq", "show");
	expect(2, "seq show without id");
	kvctl("seq", "poke", "5");
	expect(2, "seq poke");
	kvctl("status", "--uid", "0");
	expect(2, "--uid with status");
	kvctl("status", "extra");
	expect(2, "status extra");
	kvctl("--timeout", "0", "status");
	expect(2, "--timeout 0");
	kvctl("--frobnicate", "status");
	expect(2, "unknown option");
	kvctl("seqs", "--uid");
	expect(2, "--uid without a value");
	kvctl("seqs", "--uid", "no-such-user-kvctl");
	expect(2, "--uid of an unknown user");

	/* no daemon there */
	kvctl_as(-1, 0, NULL, 0, "--socket", "/tmp/kvctl-no-such.sock", "status", (const char *)NULL);
	expect(69, "status without a daemon");
	expect_err("no such socket", "status without a daemon");
}

/* What kvctl's Hello does, by hand: no fds, no region, nothing mapped. */
static void test_control_hello(void **state)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	uint8_t *rx = xmalloc(KVD_CTL_RX_MAX);
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__Hello h = KVD__HELLO__INIT;
	Kvd__ProfileCreate pc = KVD__PROFILE_CREATE__INIT;
	Kvd__Profile p = KVD__PROFILE__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;
	int fds[KVD_CTL_MAX_FDS], nfds;

	memcpy(a.sun_path, D.sock, strlen(D.sock) + 1);
	assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);

	/* control with an arena is refused and the connection stays */
	h.version = KVD_CTL_VERSION;
	h.control = 1;
	h.slots = 4;
	rq.id = 1;
	rq.body_case = KVD__REQUEST__BODY_HELLO;
	rq.hello = &h;
	nfds = KVD_CTL_MAX_FDS;
	r = kvd_ctl_call(fd, &rq, 0, rx, -1, fds, &nfds, NULL);
	assert_non_null(r);
	assert_int_equal(r->body_case, KVD__RESPONSE__BODY_ERROR);
	assert_int_equal(r->error->code, -EINVAL);
	assert_non_null(strstr(r->error->message, "control"));
	kvd_ctl_free_response(r);

	h.slots = 0;
	rq.id = 2;
	nfds = KVD_CTL_MAX_FDS;
	r = kvd_ctl_call(fd, &rq, 0, rx, -1, fds, &nfds, NULL);
	assert_non_null(r);
	assert_int_equal(nfds, 0);
	assert_int_equal(r->body_case, KVD__RESPONSE__BODY_HELLO);
	assert_true(r->hello->control);
	assert_int_equal(r->hello->region_size, 0);
	kvd_ctl_free_response(r);

	/* nothing mapped for it */
	rq.id = 3;
	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	r = kvd_ctl_call(fd, &rq, 0, rx, -1, NULL, NULL, NULL);
	assert_non_null(r);
	assert_int_equal(r->body_case, KVD__RESPONSE__BODY_SERVER_STATS);
	assert_int_equal(r->server_stats->mapped_bytes, 0);
	assert_int_equal(r->server_stats->slots_in_use, 0);
	/* (clients is not checked: daemon_start's probe connection may not be
	 * reaped yet) */
	kvd_ctl_free_response(r);

	/* no data plane: no profiles */
	p.name = "x";
	p.layers = 1;
	p.q_heads = p.kv_heads = 1;
	p.head_dim = 16;
	p.k_bits = 1;
	p.tables = 1;
	p.min_collisions = 1;
	pc.profile = &p;
	rq.id = 4;
	rq.body_case = KVD__REQUEST__BODY_PROFILE_CREATE;
	rq.profile_create = &pc;
	r = kvd_ctl_call(fd, &rq, 0, rx, -1, NULL, NULL, NULL);
	assert_non_null(r);
	assert_int_equal(r->body_case, KVD__RESPONSE__BODY_ERROR);
	assert_int_equal(r->error->code, -EOPNOTSUPP);
	kvd_ctl_free_response(r);

	/* kvctl sees itself as a control connection with no shared memory */
	kvctl("--json", "clients");
	expect(0, "clients");
	assert_json(R.out, '[');
	expect_out("\"kind\":\"control\"", "clients");
	assert_int_equal(count_of(R.out, "\"shm_bytes\":0"), 2);
	close(fd);
	free(rx);
}

static void test_status(void **state)
{
	struct kvc *c = data_client("status-client", &model);
	struct kvc_seq *s;

	assert_int_equal(kvc_seq_create(c, &s), 0);
	kvctl("status");
	expect(0, "status");
	expect_out("clients 2, sequences 1", "status");
	expect_out("memory:", "status");
	kvctl("--json", "status");
	expect(0, "status --json");
	assert_json(R.out, '{');
	expect_out("\"sequences\":1", "status --json");
	expect_out("\"uids\":[{\"uid\":0,", "status --json");
	/* options after the command work too */
	kvctl("status", "--json");
	expect(0, "status --json after the command");
	assert_json(R.out, '{');
	kvc_seq_free(c, s);
	kvc_close(c);
}

static void test_clients(void **state)
{
	struct kvc *c = data_client("clients-data", &model);

	kvctl("clients");
	expect(0, "clients");
	expect_out("clients-data", "clients");
	expect_out("data", "clients");
	expect_out("control", "clients");
	kvctl("-j", "clients");
	expect(0, "clients --json");
	assert_json(R.out, '[');
	expect_out("\"name\":\"clients-data\"", "clients --json");
	expect_out("\"tenant\":\"t\"", "clients --json");
	expect_out("\"profiles\":1", "clients --json");
	assert_int_equal(count_of(R.out, "\"id\":"), 2);
	/* each client's own sequences, counted as they come and go */
	struct kvc_seq *s[3];

	for (int i = 0; i < 3; i++)
		assert_int_equal(kvc_seq_create(c, &s[i]), 0);
	kvctl("-j", "clients");
	expect(0, "clients --json");
	expect_out("\"sequences\":3", "clients --json");
	assert_int_equal(kvc_seq_free(c, s[1]), 0);
	kvctl("-j", "clients");
	expect(0, "clients --json");
	expect_out("\"sequences\":2", "clients --json");
	assert_int_equal(kvc_seq_free(c, s[0]), 0);
	assert_int_equal(kvc_seq_free(c, s[2]), 0);
	kvc_close(c);
}

static void test_seqs_and_show(void **state)
{
	struct kvc *c = data_client("seqs", &model);
	struct kvc_seq *s[3];
	char id[32], missing[32];

	for (int i = 0; i < 3; i++)
		assert_int_equal(kvc_seq_create(c, &s[i]), 0);
	prefill(c, s[0], 300);
	kvctl("seqs");
	expect(0, "seqs");
	for (int i = 0; i < 3; i++) {
		snprintf(id, sizeof id, "%" PRIu64, kvc_seq_id(s[i]));
		expect_out(id, "seqs");
	}
	expect_out("kvctl-test", "seqs");
	kvctl("--json", "seqs");
	expect(0, "seqs --json");
	assert_json(R.out, '[');
	assert_int_equal(count_of(R.out, "\"seq\":"), 3);
	kvctl("--json", "seqs", "--uid", "0");
	assert_json(R.out, '[');
	assert_int_equal(count_of(R.out, "\"seq\":"), 3);
	kvctl("--json", "seqs", "--uid", "12345");
	expect(0, "seqs --uid 12345");
	assert_json(R.out, '[');
	assert_int_equal(count_of(R.out, "\"seq\":"), 0);

	snprintf(id, sizeof id, "%" PRIu64, kvc_seq_id(s[0]));
	kvctl("seq", "show", id);
	expect(0, "seq show");
	expect_out("tokens     280 per layer", "seq show");  /* 300 - sink - window */
	expect_out("state      ram", "seq show");
	kvctl("--json", "seq", "show", id);
	expect(0, "seq show --json");
	assert_json(R.out, '{');
	expect_out("\"tokens\":280", "seq show --json");
	expect_out("\"owner\":", "seq show --json");

	snprintf(missing, sizeof missing, "%" PRIu64, (uint64_t)(kvc_seq_id(s[0]) ^ 0x5a5a5a5a5a5aull));
	kvctl("seq", "show", missing);
	expect(1, "seq show of a missing sequence");
	expect_err("no sequence", "seq show of a missing sequence");
	expect_err("ENOENT", "seq show of a missing sequence");
	kvctl("seq", "free", missing);
	expect(1, "seq free of a missing sequence");
	for (int i = 0; i < 3; i++)
		kvc_seq_free(c, s[i]);
	kvc_close(c);
}

static void test_seq_evict_free(void **state)
{
	struct kvc *c = data_client("evict", &model);
	struct kvc_seq *s;
	struct kvc_seq_stats st;
	char id[32];
	int on_disk = 0;

	assert_int_equal(kvc_seq_create(c, &s), 0);
	prefill(c, s, 600);
	snprintf(id, sizeof id, "%" PRIu64, kvc_seq_id(s));
	kvctl("seq", "evict", id);
	expect(0, "seq evict");
	for (int i = 0; i < 200 && !on_disk; i++) {
		kvctl("--json", "seq", "show", id);
		expect(0, "seq show after evict");
		on_disk = strstr(R.out, "\"state\":\"disk\"") != NULL;
		if (!on_disk)
			daemon_sleep_ms(50);
	}
	if (!on_disk)
		fail_msg("sequence not on disk after seq evict: %s", R.out);
	expect_out("\"durable\":true", "seq show after evict");
	assert_int_equal(kvc_seq_stats(c, s, &st), 0);
	assert_int_equal(st.state, KVC_SEQ_DISK);

	kvctl("seq", "free", id);
	expect(0, "seq free");
	expect_out("freed", "seq free");
	kvctl("seq", "show", id);
	expect(1, "seq show after free");
	expect_err("no sequence", "seq show after free");
	/* its client finds it gone */
	assert_int_equal(kvc_seq_stats(c, s, &st), -ENOENT);
	kvctl("--json", "seqs");
	assert_json(R.out, '[');
	assert_int_equal(count_of(R.out, "\"seq\":"), 0);
	kvc_seq_free(c, s);       /* gone in kvd already: freed here */
	kvc_close(c);
}

static void test_paging(void **state)
{
	struct kvc *c = data_client("paging", &model);
	enum { N = 2 * KVD_CTL_LIST_MAX + 37 };
	struct kvc_seq *s[N];

	for (int i = 0; i < N; i++)
		assert_int_equal(kvc_seq_create(c, &s[i]), 0);
	kvctl("--json", "seqs");
	expect(0, "seqs of more than a page");
	assert_json(R.out, '[');
	assert_int_equal(count_of(R.out, "\"seq\":"), N);
	kvctl("seqs");
	expect(0, "seqs text");
	assert_int_equal(count_of(R.out, "\n"), N + 1);
	for (int i = 0; i < N; i++)
		kvc_seq_free(c, s[i]);
	kvc_close(c);
}

static void test_profiles_limits(void **state)
{
	struct kvc *c = data_client("profiles", &model), *c8, *ch;
	struct kvc_model m8 = model, mh = model;

	kvctl("profiles");
	expect(0, "profiles");
	expect_out("kvctl-test", "profiles");
	kvctl("--json", "profiles");
	expect(0, "profiles --json");
	assert_json(R.out, '[');
	expect_out("\"name\":\"kvctl-test\"", "profiles --json");
	expect_out("\"head_dim\":16", "profiles --json");
	expect_out("\"refs\":1", "profiles --json");

	kvctl("limits");
	expect(0, "limits");
	expect_out("limits.connections", "limits");
	expect_out("memory.limit", "limits");
	kvctl("--json", "limits");
	expect(0, "limits --json");
	assert_json(R.out, '{');
	expect_out("{\"key\":\"limits.connections\",\"cap\":1024,\"per_uid\":4,\"used\":2}",
		   "limits --json");
	expect_out("\"uids\":[{\"uid\":0,", "limits --json");

	/* how each profile stores K/V: its own column and key */
	m8.name = "kvctl-int8";
	m8.kv_dtype = KVC_KV_INT8;
	c8 = data_client("profiles-int8", &m8);
	kvctl("profiles");
	expect(0, "profiles");
	expect_out(" KV ", "profiles");
	expect_out(" bf16 ", "profiles");
	expect_out(" int8 ", "profiles");
	kvctl("--json", "profiles");
	expect(0, "profiles --json");
	assert_json(R.out, '[');
	expect_out("\"name\":\"kvctl-test\",\"layers\":2,\"q_heads\":4,\"kv_heads\":2,"
		   "\"head_dim\":16,\"k_bits\":4,\"tables\":8,\"min_collisions\":1,"
		   "\"kv_dtype\":\"bf16\"", "profiles --json");
	expect_out("\"name\":\"kvctl-int8\",\"layers\":2,\"q_heads\":4,\"kv_heads\":2,"
		   "\"head_dim\":16,\"k_bits\":4,\"tables\":8,\"min_collisions\":1,"
		   "\"kv_dtype\":\"int8\"", "profiles --json");

	/* how each profile estimates attention: its own column and key */
	mh.name = "kvctl-hybrid";
	mh.estimator = KVC_EST_HYBRID;
	ch = data_client("profiles-hybrid", &mh);
	kvctl("profiles");
	expect(0, "profiles");
	expect_out(" KV   EST ", "profiles");
	expect_out(" magicpig ", "profiles");
	expect_out(" hybrid ", "profiles");
	kvctl("--json", "profiles");
	expect(0, "profiles --json");
	assert_json(R.out, '[');
	expect_out("\"name\":\"kvctl-test\",\"layers\":2,\"q_heads\":4,\"kv_heads\":2,"
		   "\"head_dim\":16,\"k_bits\":4,\"tables\":8,\"min_collisions\":1,"
		   "\"kv_dtype\":\"bf16\",\"estimator\":\"magicpig\"", "profiles --json");
	expect_out("\"name\":\"kvctl-hybrid\",\"layers\":2,\"q_heads\":4,\"kv_heads\":2,"
		   "\"head_dim\":16,\"k_bits\":4,\"tables\":8,\"min_collisions\":1,"
		   "\"kv_dtype\":\"bf16\",\"estimator\":\"hybrid\"", "profiles --json");
	kvc_close(ch);
	kvc_close(c8);
	kvc_close(c);
}

/* s with every occurrence of id replaced by "ID" (in place). */
static char *without(char *s, const char *id)
{
	size_t n = strlen(id);

	for (char *p; (p = strstr(s, id));)
		memmove(p + 2, p + n, strlen(p + n) + 1), memcpy(p, "ID", 2);
	return s;
}

static void test_visibility(void **state)
{
	struct kvc *c;
	struct kvc_seq *s;
	struct kid kb;
	uint64_t seq_b;
	char id_a[32], id_b[32], missing[32], err_missing[sizeof R.err], err_b[sizeof R.err];
	const gid_t admin[] = { ADMIN_GID };

	if (!need_root())
		skip();
	c = data_client("uid-a", &model);
	assert_int_equal(kvc_seq_create(c, &s), 0);
	snprintf(id_a, sizeof id_a, "%" PRIu64, kvc_seq_id(s));
	kb = other_uid_client(UID_B, "prof-b", &seq_b);
	snprintf(id_b, sizeof id_b, "%" PRIu64, seq_b);
	snprintf(missing, sizeof missing, "%" PRIu64, (uint64_t)(seq_b ^ 0x77777777u));

	/* root sees both uids */
	kvctl("--json", "seqs");
	expect(0, "root: seqs");
	assert_int_equal(count_of(R.out, "\"seq\":"), 2);
	kvctl("--json", "seqs", "--uid", "65534");
	assert_int_equal(count_of(R.out, "\"seq\":"), 1);
	expect_out(id_b, "root: seqs --uid 65534");
	kvctl("--json", "profiles");
	assert_int_equal(count_of(R.out, "\"id\":"), 2);

	/* uid C sees nothing of A's or B's, and a seq of B's is "missing" */
	kvctl_uid(UID_C, "--json", "seqs");
	expect(0, "uid C: seqs");
	assert_json(R.out, '[');
	assert_int_equal(count_of(R.out, "\"seq\":"), 0);
	kvctl_uid(UID_C, "--json", "seqs", "--uid", "65534");
	expect(0, "uid C: seqs --uid B");
	assert_int_equal(count_of(R.out, "\"seq\":"), 0);
	kvctl_uid(UID_C, "--json", "profiles");
	assert_int_equal(count_of(R.out, "\"id\":"), 0);
	kvctl_uid(UID_C, "--json", "clients");
	expect(0, "uid C: clients");
	assert_int_equal(count_of(R.out, "\"id\":"), 1);       /* its own kvctl */
	expect_out("\"uid\":65533", "uid C: clients");
	kvctl_uid(UID_C, "seq", "show", missing);
	expect(1, "uid C: seq show of a missing seq");
	memcpy(err_missing, R.err, sizeof R.err);
	kvctl_uid(UID_C, "seq", "show", id_b);
	expect(1, "uid C: seq show of B's seq");
	memcpy(err_b, R.err, sizeof R.err);
	/* the same words, but for the number */
	assert_string_equal(without(err_missing, missing), without(err_b, id_b));
	kvctl_uid(UID_C, "seq", "free", id_b);
	expect(1, "uid C: seq free of B's seq");
	expect_err("no sequence", "uid C: seq free of B's seq");
	kvctl_uid(UID_C, "seq", "evict", id_a);
	expect(1, "uid C: seq evict of A's seq");
	kvctl_uid(UID_C, "drain");
	expect(1, "uid C: drain");
	expect_err("EPERM", "uid C: drain");
	kvctl_uid(UID_C, "--json", "status");
	expect(0, "uid C: status");
	expect_out("\"uids\":[{\"uid\":65533,", "uid C: status");
	assert_int_equal(count_of(R.out, "\"uid\":"), 1);
	kvctl_uid(UID_C, "--json", "limits");
	assert_int_equal(count_of(R.out, "\"uid\":"), 1);

	/* B's own: still there after C's tries, visible and manageable by B */
	kvctl("seq", "show", id_b);
	expect(0, "root: B's seq survived");
	kvctl_uid(UID_B, "--json", "seqs");
	expect(0, "uid B: seqs");
	assert_int_equal(count_of(R.out, "\"seq\":"), 1);
	expect_out(id_b, "uid B: seqs");
	kvctl_uid(UID_B, "--json", "profiles");
	assert_int_equal(count_of(R.out, "\"id\":"), 1);
	expect_out("prof-b", "uid B: profiles");
	kvctl_uid(UID_B, "seq", "show", id_a);
	expect(1, "uid B: A's seq");

	/* the admin group sees every uid: as primary or supplementary group */
	kvctl_as(UID_C, ADMIN_GID, NULL, 0, "--json", "seqs", (const char *)NULL);
	expect(0, "admin gid: seqs");
	assert_int_equal(count_of(R.out, "\"seq\":"), 2);
	kvctl_as(UID_C, UID_C, admin, 1, "--json", "clients", (const char *)NULL);
	expect(0, "admin supplementary group: clients");
	expect_out("\"uid\":65534", "admin supplementary group: clients");
	kvctl_as(UID_C, UID_C, admin, 1, "seq", "show", id_b, (const char *)NULL);
	expect(0, "admin supplementary group: seq show of B's");

	kvctl_uid(UID_B, "seq", "free", id_b);
	expect(0, "uid B: seq free of its own");
	kvctl("--json", "seqs");
	assert_int_equal(count_of(R.out, "\"seq\":"), 1);
	release(&kb);
	kvc_seq_free(c, s);
	kvc_close(c);
}

static void test_connection_limit(void **state)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	int fds[4];

	if (!need_root())
		skip();
	memcpy(a.sun_path, D.sock, strlen(D.sock) + 1);
	{
		pid_t p;
		int go[2], ready[2], st;
		char x = 0;

		assert_int_equal(pipe(go), 0);
		assert_int_equal(pipe(ready), 0);
		p = fork();
		kid_pid = p;
		if (p == 0) {
			/* uid B holds connections_per_uid (4) connections */
			close(go[1]);
			close(ready[0]);
			if (setgroups(0, NULL) || setgid(UID_B) || setuid(UID_B))
				_exit(2);
			for (int i = 0; i < 4; i++) {
				fds[i] = socket(AF_UNIX, SOCK_SEQPACKET, 0);
				if (connect(fds[i], (struct sockaddr *)&a, sizeof a))
					_exit(3);
			}
			if (write(ready[1], &x, 1) != 1 || read(go[0], &x, 1) < 0)
				_exit(4);
			_exit(0);
		}
		close(go[0]);
		close(ready[1]);
		assert_int_equal(read(ready[0], &x, 1), 1);
		daemon_sleep_ms(200);           /* kvd has accepted them */
		kvctl_uid(UID_B, "status");
		expect(75, "uid B at its connection limit");
		expect_err("connections_per_uid", "uid B at its connection limit");
		/* other uids are not affected */
		kvctl_uid(UID_C, "status");
		expect(0, "uid C beside B's limit");
		close(go[1]);
		assert_int_equal(waitpid(p, &st, 0), p);
		kid_pid = 0;
		assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
		close(ready[0]);
	}
	for (int i = 0; i < 100; i++) {
		if (kvctl_uid(UID_B, "status") == 0)
			break;
		daemon_sleep_ms(50);
	}
	expect(0, "uid B once its connections closed");
}

static void test_metrics(void **state)
{
	kvctl("metrics");
	expect(0, "metrics");
	expect_out("# TYPE ", "metrics");
	kvctl("--json", "metrics");
	expect(0, "metrics --json");
	assert_json(R.out, '{');
	expect_out("\"text\":\"# HELP ", "metrics --json");
	if (geteuid() == 0) {
		kvctl_uid(UID_C, "metrics");
		expect(0, "uid C: metrics");
		expect_out("# TYPE ", "uid C: metrics");
	}
}

static void test_drain(void **state)
{
	struct kvc *c = data_client("drain", &model);
	struct kvc_seq *s;
	int st = -1;

	assert_int_equal(kvc_seq_create(c, &s), 0);
	prefill(c, s, 300);
	kvctl("--json", "drain");
	expect(0, "drain");
	assert_json(R.out, '{');
	expect_out("\"drained\":true", "drain");
	for (int i = 0; i < 500; i++) {
		if (waitpid(D.pid, &st, WNOHANG) == D.pid)
			break;
		st = -1;
		daemon_sleep_ms(20);
	}
	if (st == -1)
		fail_msg("kvd still running 10 s after kvctl drain returned");
	assert_true(WIFEXITED(st));
	assert_int_equal(WEXITSTATUS(st), 0);
	D.pid = 0;
	rmdir(D.dir);
	kvctl("status");
	expect(69, "status after drain");
	kvc_seq_free(c, s);        /* kvd is gone: freed here */
	kvc_close(c);
}

static int stop_drained(void **state)
{
	cleanup_files();
	if (D.pid > 0)
		return stop(state);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_usage_and_unreachable, start, stop),
		cmocka_unit_test_setup_teardown(test_control_hello, start, stop),
		cmocka_unit_test_setup_teardown(test_status, start, stop),
		cmocka_unit_test_setup_teardown(test_clients, start, stop),
		cmocka_unit_test_setup_teardown(test_seqs_and_show, start, stop),
		cmocka_unit_test_setup_teardown(test_seq_evict_free, start, stop),
		cmocka_unit_test_setup_teardown(test_paging, start, stop),
		cmocka_unit_test_setup_teardown(test_profiles_limits, start, stop),
		cmocka_unit_test_setup_teardown(test_visibility, start, stop),
		cmocka_unit_test_setup_teardown(test_connection_limit, start, stop),
		cmocka_unit_test_setup_teardown(test_metrics, start, stop),
		cmocka_unit_test_setup_teardown(test_drain, start, stop_drained),
	};

	signal(SIGPIPE, SIG_IGN);
	if (getenv("KVD_TEST_FILTER"))
		cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
