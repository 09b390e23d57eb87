/* Hostile clients against the real daemon: one regression test per defect
 * that a client (or a uid) could use to crash, stall or exhaust kvd for
 * everyone else.  Every test starts its own kvd and stops it at the end:
 * daemon_stop() returning 0 (a clean drain) is part of every test.
 *
 *   test_attend_ids_rewritten   ATTEND records' sequence ids rewritten in
 *                               shared memory while kvd runs the batch
 *   test_loop_not_stalled       a big ATTEND batch must not hold up another
 *                               client's ATTEND or control request
 *   test_nonfinite_queries      NaN, infinite and huge query elements reach
 *                               only their own q heads' answers
 *   test_seq_create_budget      sequences count against --mem-limit
 *   test_profiles_per_uid       [limits] profiles_per_uid; profiles freed
 *   test_profile_namespace      profile names are per uid
 *   test_connections_per_uid    [limits] connections_per_uid
 *   test_emfile_no_spin         accept() failing EMFILE must not spin
 *   test_prefill_staging_budget one-token PREFILLs stay within --mem-limit
 *   test_shm_per_uid            [limits] shm_per_uid: the regions of one uid's
 *                               connections, counted at Hello
 *   test_uid_fair_share         a uid with six busy connections gets no more
 *                               executor time than a uid with one
 *   test_big_profiles_no_stall  creating profiles with 16 MiB of W each must
 *                               not hold other clients' decode
 *   test_share_per_uid          a uid flooding LOCAL rows is refused at
 *                               memory_per_uid; one publishing prefix after
 *                               prefix stays within sequences_per_uid (its
 *                               own oldest snapshots make way); a third uid
 *                               decoding meanwhile sees no error and never
 *                               another's prefix
 *
 * Forked children never use cmocka's asserts (they would longjmp into the
 * child's copy of the runner): they report through exit codes and a shared
 * message page.  Tests needing a second uid run as root (CI does) and skip
 * otherwise. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "proto/ctl.h"
#include "daemon.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "proto/kvd_ring.h"
#include "raw.h"
#include "shm/shm.h"
#include "engine/synth.h"
#include "testutil.h"

#define CQE_S     300           /* ring completions: generous for sanitizer builds */
#define UID_B     65534
#define UID_C     65533

static struct daemon D;
static char cfg_path[128];
static int died_status = -1;    /* the daemon's wait status once it died under us */

/* Children this test forked: teardown kills what is left. */
static pid_t kids[8];
static int nkids;

/* A shared page where children write why they failed. */
static char *kid_msg;

static void kid_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
static void kid_fail(int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(kid_msg, 4096, fmt, ap);
	va_end(ap);
	_exit(code);
}

static pid_t spawn(void)
{
	pid_t p = fork();

	assert_true(p >= 0);
	if (p > 0)
		kids[nkids++] = p;
	return p;
}

/* Waits for a child (up to `secs`), returns its exit code; fails the test
 * with the child's message when it did not exit 0. */
static void expect_kid_ok(pid_t p, int secs, const char *what)
{
	int st = 0;

	for (int i = 0; i < secs * 10; i++) {
		pid_t r = waitpid(p, &st, WNOHANG);

		if (r == p) {
			for (int k = 0; k < nkids; k++)
				if (kids[k] == p)
					kids[k] = 0;
			if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
				return;
			if (WIFEXITED(st))
				fail_msg("%s: exit %d: %s", what, WEXITSTATUS(st), kid_msg);
			fail_msg("%s: killed by signal %d", what, WTERMSIG(st));
		}
		daemon_sleep_ms(100);
	}
	fail_msg("%s: still running after %d s", what, secs);
}

/* 0 once kvd has died (and records how). */
static int daemon_alive(void)
{
	int st;

	if (D.pid <= 0)
		return 0;
	if (waitpid(D.pid, &st, WNOHANG) == D.pid) {
		died_status = st;
		D.pid = 0;
		return 0;
	}
	return 1;
}

static void fail_if_dead(const char *when)
{
	if (!daemon_alive()) {
		if (WIFSIGNALED(died_status))
			fail_msg("kvd died %s: killed by signal %d", when, WTERMSIG(died_status));
		fail_msg("kvd died %s: exit %d", when, WEXITSTATUS(died_status));
	}
}

static void write_config(const char *body)
{
	FILE *f;

	snprintf(cfg_path, sizeof cfg_path, "/tmp/kvd-hostile.%d.conf", (int)getpid());
	f = fopen(cfg_path, "w");
	assert_non_null(f);
	fputs(body, f);
	fclose(f);
}

/* Other uids must reach the socket. */
static void open_perms(void)
{
	chmod(D.dir, 0755);
	chmod(D.sock, 0777);
}

static int start_plain(void **state)
{
	died_status = -1;
	return daemon_start(&D, NULL) ? -1 : 0;
}

static int start_open(void **state)
{
	if (start_plain(state))
		return -1;
	open_perms();
	return 0;
}

static int start_mem64(void **state)
{
	died_status = -1;
	return daemon_start4(&D, "--mem-limit", "64M", NULL, NULL) ? -1 : 0;
}

/* The [limits] section does not exist in an old kvd: it refuses the file
 * and these setups fail (as they should: the limits are not there). */
static int start_cfg(const char *body, const char *mem)
{
	died_status = -1;
	write_config(body);
	if (daemon_start4(&D, "--config", cfg_path, mem ? "--mem-limit" : NULL, mem)) {
		print_error("kvd did not start with config:\n%s", body);
		return -1;
	}
	open_perms();
	return 0;
}

static int start_seq_budget(void **state)
{
	return start_cfg("[limits]\nsequences = 200000\nsequences_per_uid = 200000\n", "64M");
}

static int start_profiles(void **state)
{
	return start_cfg("[limits]\nprofiles_per_uid = 4\n", NULL);
}

static int start_shm(void **state)
{
	return start_cfg("[limits]\nshm_per_uid = 64M\nshm = 1G\n", NULL);
}

static int start_ctl_cpu(void **state)
{
	return start_cfg("[limits]\ncontrol_cpu_per_uid = 5%\n", NULL);
}

static int start_share(void **state)
{
	return start_cfg("[limits]\nmemory_per_uid = 64M\nsequences_per_uid = 12\n", NULL);
}

static int start_conns(void **state)
{
	return start_cfg("[limits]\nconnections_per_uid = 8\nconnections = 64\n", NULL);
}

static void stop_threads(void);

static int stop(void **state)
{
	int rc;

	stop_threads();
	for (int i = 0; i < nkids; i++)
		if (kids[i] > 0) {
			kill(kids[i], SIGKILL);
			waitpid(kids[i], NULL, 0);
		}
	nkids = 0;
	if (cfg_path[0]) {
		unlink(cfg_path);
		cfg_path[0] = 0;
	}
	if (D.pid <= 0) {
		print_error("kvd was not running at teardown (died earlier)\n");
		return -1;
	}
	rc = daemon_stop(&D);
	if (rc)
		print_error("daemon_stop: %d (want 0: a clean drain)\n", rc);
	return rc == 0 ? 0 : -1;
}

static int need_root(void)
{
	if (geteuid() != 0) {
		print_message("  not root: cannot test a second uid\n");
		return 0;
	}
	return 1;
}

/* In a forked child: become another uid. */
static void become(uid_t uid)
{
	if (setgroups(0, NULL) || setgid(uid) || setuid(uid))
		kid_fail(90, "cannot become uid %d: %s", (int)uid, strerror(errno));
}

/* ---- the raw client (raw.h): profiles, stats and the ring ---------------- */

static Kvd__Profile mkprof(const char *name, uint32_t layers, uint32_t qh, uint32_t kvh,
			   uint32_t d, uint32_t K, uint32_t L, uint64_t seed)
{
	Kvd__Profile p = KVD__PROFILE__INIT;

	p.name = (char *)name;
	p.layers = layers;
	p.q_heads = qh;
	p.kv_heads = kvh;
	p.head_dim = d;
	p.k_bits = K;
	p.tables = L;
	p.min_collisions = 1;
	p.seed = seed;
	return p;
}

static int raw_stats(struct raw *x, Kvd__ServerStats *st)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;
	int rc;

	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	rc = raw_expect(x, &rq, KVD__RESPONSE__BODY_SERVER_STATS, &r);
	if (!rc) {
		*st = *r->server_stats;
		kvd_ctl_free_response(r);
	}
	return rc;
}

/* Publishes n entries (assumes room) and kicks kvd if it sleeps. */
static void raw_submit(struct raw *x, const struct kvd_sqe *e, uint32_t n)
{
	uint64_t one = 1;

	for (uint32_t i = 0; i < n; i++) {
		void *p = shm_ring_reserve(&x->r.sq);

		assert_non_null(p);
		memcpy(p, &e[i], sizeof e[i]);
		shm_ring_commit(&x->r.sq, 1);
	}
	if (shm_ring_needs_kick(&x->r.sq) && write(x->efd, &one, 8) != 8)
		fail_msg("eventfd write: %s", strerror(errno));
}

/* The next completion (parent side: notices kvd dying). */
static struct kvd_cqe raw_wait(struct raw *x)
{
	struct kvd_cqe c;

	for (int i = 0; i < CQE_S * 10; i++) {
		int n = shm_ring_wait(&x->r.cq, 50000, 100000000ull, 0);

		if (n > 0) {
			memcpy(&c, shm_ring_entry(&x->r.cq, 0), sizeof c);
			shm_ring_release(&x->r.cq, 1);
			return c;
		}
		assert_true(n == 0 || n == -EINTR);
		fail_if_dead("while a ring entry was outstanding");
	}
	fail_msg("no completion in %d s", CQE_S);
	memset(&c, 0, sizeof c);
	return c;
}

/* ---- /proc --------------------------------------------------------------- */

static long proc_vmrss_kib(pid_t pid)
{
	char path[64], line[256];
	long kib = -1;
	FILE *f;

	snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof line, f))
		if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
			break;
	fclose(f);
	return kib;
}

static int proc_nfds(pid_t pid)
{
	char path[64];
	int n = 0;

	snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
	DIR *d = opendir(path);

	if (!d)
		return -1;
	for (struct dirent *e; (e = readdir(d));)
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

static long file_size(const char *path)
{
	struct stat st;

	return stat(path, &st) ? 0 : (long)st.st_size;
}

/* ==== 1. ATTEND records rewritten mid-batch =============================== */

/* P1 samples nearly every key (K = 1, c = 1), so each record costs kvd real
 * work and the batch stays in its second pass a while. */
static const uint32_t dense0[] = { 0 };
static const struct kvc_model P1 = {
	.name = "hostile-p1", .layers = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 1, .L = 32, .c = 1, .sink = 4, .window = 64, .dense_layers = dense0, .n_dense = 1,
	.seed = 8, .segment_tokens = 1024, .seal_tokens = 128,
};
/* Another profile, one layer and another geometry: its sequences have no
 * layer 1 at all. */
static const struct kvc_model P2 = {
	.name = "hostile-p2", .layers = 1, .q_heads = 4, .kv_heads = 4, .head_dim = 64,
	.K = 8, .L = 8, .c = 1, .seed = 9,
};

static struct kvc *kconnect(const char *tenant, const struct kvc_model *m, uint32_t slots,
			    uint64_t slot_size)
{
	struct kvc_opts o = { .socket_path = D.sock, .tenant = tenant, .name = "hostile-kvc",
			      .slots = slots, .slot_size = slot_size };
	struct kvc *c;

	if (kvc_connect(&o, &c) || kvc_profile(c, m)) {
		fprintf(stderr, "kvc: %s\n", kvc_last_error(c));
		kvc_close(c);
		return NULL;
	}
	return c;
}

/* Creates a sequence and prefills every layer with synthetic rows. */
static struct kvc_seq *kprefill(struct kvc *c, const struct kvc_model *m, uint32_t n,
				uint64_t seed, struct kvd_synth *w)
{
	struct kvc_seq *s;

	if (kvd_synth_make(w, KVD_WL_MIXED, n, m->q_heads, m->kv_heads, m->head_dim, seed))
		return NULL;
	if (kvc_seq_create(c, &s))
		return NULL;
	for (uint32_t l = 0; l < m->layers; l++)
		if (kvc_prefill(c, s, l, w->k, w->v, n))
			return NULL;
	return s;
}

struct writer {
	pthread_t th;
	int started;
	atomic_int stop, armed, busy, mode;
	uint8_t *in, *out;
	uint32_t nseq, stride;
	uint64_t bad[3];        /* 0, a random id, a valid id of another profile */
	uint64_t good;
	atomic_ulong writes;
};
static struct writer W;

static void stop_threads(void)
{
	if (W.started) {
		atomic_store(&W.stop, 1);
		pthread_join(W.th, NULL);
		W.started = 0;
	}
}

static inline void put_id(uint32_t i, uint64_t v)
{
	/* atomic: every store reaches shared memory, and the writer thread and
	 * the test thread never race (as TSan sees it) */
	atomic_store_explicit((_Atomic uint64_t *)(void *)(W.in + (size_t)i * W.stride), v,
			      memory_order_relaxed);
}

static void *writer_main(void *arg)
{
	uint64_t r = 0x9e3779b97f4a7c15ull, k = 0;

	while (!atomic_load(&W.stop)) {
		if (!atomic_load(&W.armed)) {
			sched_yield();
			continue;
		}
		/* Dekker with the test thread: it clears armed, then waits
		 * for busy to be 0; we set busy, then re-check armed. */
		atomic_store(&W.busy, 1);
		if (!atomic_load(&W.armed)) {
			atomic_store(&W.busy, 0);
			continue;
		}
		if (atomic_load(&W.mode) == 0) {
			/* Wait for kvd's second pass to begin (the first output
			 * lands), then rewrite every record it has not reached. */
			while (atomic_load(&W.armed) && !atomic_load(&W.stop) &&
			       atomic_load_explicit((_Atomic uint32_t *)(void *)W.out,
						    memory_order_relaxed) == 0xffffffffu)
				;
			while (atomic_load(&W.armed) && !atomic_load(&W.stop))
				for (uint32_t i = 1; i < W.nseq; i++) {
					r = r * 6364136223846793005ull + 1442695040888963407ull;
					W.bad[1] = r | 1;
					put_id(i, W.bad[k++ % 3]);
				}
		} else {
			/* Flip random records between bad and good. */
			while (atomic_load(&W.armed) && !atomic_load(&W.stop)) {
				r = r * 6364136223846793005ull + 1442695040888963407ull;
				uint32_t i = (uint32_t)(r >> 33) % W.nseq;

				W.bad[1] = r | 1;
				put_id(i, W.bad[k++ % 3]);
				for (volatile int s = 0; s < 200; s++)
					;
				put_id(i, W.good);
			}
		}
		atomic_fetch_add(&W.writes, 1);
		atomic_store(&W.busy, 0);
	}
	return arg;
}

/* The honest client, another process and tenant: it prefills a sequence of
 * P1, asks for one layer-1 answer, writes a byte to `ready`, then asks
 * again and again until `go` reaches EOF (the parent closes its end), every
 * answer bit for bit the first.  Returns its pid; *go_w is the parent's end. */
static pid_t spawn_honest(int *go_w, int *ready_r)
{
	int ready[2], go[2];
	pid_t honest;
	char b;

	assert_int_equal(pipe(ready), 0);
	assert_int_equal(pipe(go), 0);
	honest = spawn();
	if (honest == 0) {
		struct kvd_synth w;
		struct kvc *c = kconnect("honest", &P1, 4, 1 << 20);
		struct kvc_seq *s;
		float o0[8 * 128], l0[8], o[8 * 128], l[8];
		long rounds = 0;

		close(go[1]);
		if (!c || !(s = kprefill(c, &P1, 1500, 31, &w)))
			kid_fail(2, "honest client: setup failed");
		if (kvc_attend_kvd(c, 1, &s, 1, w.q, o0, l0))
			kid_fail(3, "honest client: first attend: %s", kvc_last_error(c));
		if (write(ready[1], "r", 1) != 1)
			_exit(4);
		for (;;) {
			struct pollfd p = { .fd = go[0], .events = POLLIN };
			int last = poll(&p, 1, 0) > 0;  /* EOF: the parent is done */

			if (kvc_attend_kvd(c, 1, &s, 1, w.q, o, l))
				kid_fail(5, "honest client: attend %ld: %s", rounds, kvc_last_error(c));
			if (memcmp(o, o0, sizeof o) || memcmp(l, l0, sizeof l))
				kid_fail(6, "honest client: answer %ld differs from the first", rounds);
			rounds++;
			if (last)
				break;
			daemon_sleep_ms(20);
		}
		kvc_seq_free(c, s);
		kvc_close(c);
		_exit(0);
	}
	close(go[0]);
	close(ready[1]);
	if (read(ready[0], &b, 1) != 1)
		expect_kid_ok(honest, 60, "honest client");
	*go_w = go[1];
	*ready_r = ready[0];
	return honest;
}

#define H1_TOK   300
#define H1_NSEQ  test_size(1024, 256)
#define H1_BATCH 6

static void test_attend_ids_rewritten(void **state)
{
	int go_w, ready_r;
	pid_t honest = spawn_honest(&go_w, &ready_r);

	/* The hostile side: a prefilled sequence of P1 and an empty one of P2
	 * in its tenant (through libkvclient), and a raw connection of the same
	 * tenant whose ATTEND records it rewrites. */
	struct kvd_synth w;
	struct kvc *c1 = kconnect("hostile", &P1, 4, 1 << 20), *c2 = kconnect("hostile", &P2, 2, 1 << 20);
	struct kvc_seq *s1, *s2;

	assert_non_null(c1);
	assert_non_null(c2);
	s1 = kprefill(c1, &P1, H1_TOK, 32, &w);
	assert_non_null(s1);
	assert_int_equal(kvc_seq_create(c2, &s2), 0);

	const uint32_t stride = (uint32_t)kvd_attend_in_bytes(8, 128, 32);
	const uint32_t outb = (uint32_t)kvd_attend_out_bytes(8, 128);
	const uint32_t in_len = stride * H1_NSEQ, out_off = (uint32_t)KVD_ALIGN64(in_len);
	const uint64_t slot = KVD_ALIGN64((uint64_t)out_off + (uint64_t)outb * H1_NSEQ + 4095) & ~4095ull;
	struct raw x;

	assert_int_equal(raw_open(&x, D.sock, 0), 0);
	assert_int_equal(raw_hello(&x, "hostile", "hostile", 2, slot), 0);
	uint8_t *in = shm_slot(&x.r, 0), *out = in + out_off;

	for (uint32_t i = 0; i < H1_NSEQ; i++) {
		uint8_t *rec = in + (size_t)i * stride;

		memset(rec, 0, stride);
		memcpy(rec + 64, w.q, 8 * 128 * 4);     /* codes stay 0: valid for K = 1 */
	}
	memset(&W, 0, sizeof W);
	W.in = in;
	W.out = out;
	W.nseq = H1_NSEQ;
	W.stride = stride;
	W.good = kvc_seq_id(s1);
	W.bad[0] = 0;
	W.bad[2] = kvc_seq_id(s2);
	assert_int_equal(pthread_create(&W.th, NULL, writer_main, NULL), 0);
	W.started = 1;

	int ok = 0, errs = 0;

	for (int bi = 0; bi < H1_BATCH; bi++) {
		struct kvd_sqe e = { .op = KVD_OP_ATTEND, .layer = 1, .slot = 0, .user_data = 100 + bi,
				     .off = 0, .len = in_len, .nseq = H1_NSEQ, .out_off = out_off,
				     .out_len = outb * H1_NSEQ };

		for (uint32_t i = 0; i < H1_NSEQ; i++)
			put_id(i, W.good);
		memset(out, 0xff, (size_t)outb * H1_NSEQ);
		atomic_store(&W.mode, bi % 2);
		atomic_store(&W.armed, 1);
		raw_submit(&x, &e, 1);
		struct kvd_cqe c = raw_wait(&x);

		atomic_store(&W.armed, 0);
		while (atomic_load(&W.busy))
			;
		assert_int_equal(c.user_data, 100 + bi);
		assert_true(c.res <= 0);
		if (c.res == 0)
			ok++;
		else
			errs++;
	}
	print_message("  hostile batches: %d answered, %d refused (%s)\n", ok, errs,
		      "any mix is fine");
	stop_threads();
	fail_if_dead("after the hostile batches");
	/* still attached, still served */
	struct kvd_sqe nop = { .op = KVD_OP_NOP, .user_data = 7 };

	raw_submit(&x, &nop, 1);
	struct kvd_cqe c = raw_wait(&x);

	assert_int_equal(c.user_data, 7);
	assert_int_equal(c.res, 0);
	close(go_w);
	expect_kid_ok(honest, 120, "honest client");
	raw_close(&x);
	assert_int_equal(kvc_seq_free(c1, s1), 0);
	assert_int_equal(kvc_seq_free(c2, s2), 0);
	kvc_close(c1);
	kvc_close(c2);
	kvd_synth_free(&w);
	close(ready_r);
}

/* ==== 2. big ATTEND batches must not stall the loop ======================= */

static const struct kvc_model PS = {
	.name = "hostile-stall", .layers = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 64,
	.K = 1, .L = 16, .c = 1, .sink = 4, .window = 64, .dense_layers = dense0, .n_dense = 1,
	.seed = 11, .segment_tokens = 1024, .seal_tokens = 128,
};

#define ST_TOK    300
#define ST_NSEQ   4096
#define ST_BATCH  3

struct stall_shared {
	uint32_t cq_tail0;                      /* A's CQ tail before its batches */
	atomic_uint at_attend, at_stats;        /* A's completions kvd had published */
	atomic_int b_done;
};

static void test_loop_not_stalled(void **state)
{
	int ready[2], go[2];
	char b;
	struct kvd_synth w;
	struct kvc *ca = kconnect("a", &PS, 2, 1 << 20);
	struct kvc_seq *sa;
	struct stall_shared *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
				       MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	assert_true(sh != MAP_FAILED);
	assert_non_null(ca);
	sa = kprefill(ca, &PS, ST_TOK, 41, &w);
	assert_non_null(sa);

	/* Client A: ATTEND of ST_NSEQ records in each of ST_BATCH slots. */
	const uint32_t stride = (uint32_t)kvd_attend_in_bytes(8, 64, 16);
	const uint32_t outb = (uint32_t)kvd_attend_out_bytes(8, 64);
	const uint32_t in_len = stride * ST_NSEQ, out_off = (uint32_t)KVD_ALIGN64(in_len);
	const uint64_t slot = KVD_ALIGN64((uint64_t)out_off + (uint64_t)outb * ST_NSEQ + 4095) & ~4095ull;
	struct raw x;

	assert_int_equal(raw_open(&x, D.sock, 0), 0);
	assert_int_equal(raw_hello(&x, "hostile", "a", ST_BATCH, slot), 0);
	for (uint32_t s = 0; s < ST_BATCH; s++)
		for (uint32_t i = 0; i < ST_NSEQ; i++) {
			uint8_t *rec = (uint8_t *)shm_slot(&x.r, s) + (size_t)i * stride;
			uint64_t id = kvc_seq_id(sa);

			memset(rec, 0, stride);
			memcpy(rec, &id, 8);
			memcpy(rec + 64, w.q, 8 * 64 * 4);
		}

	/* Client B, another process: it inherits the mapping of A's region
	 * only to read how many completions kvd had published for A when its
	 * own answers came. */
	assert_int_equal(pipe(ready), 0);
	assert_int_equal(pipe(go), 0);
	pid_t kid = spawn();

	if (kid == 0) {
		struct kvd_synth wb;
		struct kvc *cb = kconnect("b", &PS, 2, 1 << 20);
		struct kvc_seq *sb;
		struct kvc_stats st;
		float o[8 * 64], l[8];

		if (!cb || !(sb = kprefill(cb, &PS, 300, 42, &wb)))
			kid_fail(2, "client B: setup failed");
		if (kvc_attend_kvd(cb, 1, &sb, 1, wb.q, o, l))
			kid_fail(3, "client B: warm-up attend: %s", kvc_last_error(cb));
		if (write(ready[1], "r", 1) != 1 || read(go[0], &b, 1) != 1)
			_exit(4);
		if (kvc_attend_kvd(cb, 1, &sb, 1, wb.q, o, l))
			kid_fail(5, "client B: attend: %s", kvc_last_error(cb));
		atomic_store(&sh->at_attend, atomic_load(&x.r.cq.ctl->tail) - sh->cq_tail0);
		if (kvc_server_stats(cb, &st))
			kid_fail(6, "client B: stats: %s", kvc_last_error(cb));
		atomic_store(&sh->at_stats, atomic_load(&x.r.cq.ctl->tail) - sh->cq_tail0);
		atomic_store(&sh->b_done, 1);
		kvc_close(cb);
		_exit(0);
	}
	close(ready[1]);
	close(go[0]);
	if (read(ready[0], &b, 1) != 1)
		expect_kid_ok(kid, 60, "client B");

	struct kvd_sqe e[ST_BATCH];

	sh->cq_tail0 = atomic_load(&x.r.cq.ctl->tail);
	for (uint32_t s = 0; s < ST_BATCH; s++)
		e[s] = (struct kvd_sqe){ .op = KVD_OP_ATTEND, .layer = 1, .slot = s, .user_data = 200 + s,
					 .len = in_len, .nseq = ST_NSEQ, .out_off = out_off,
					 .out_len = outb * ST_NSEQ };
	uint64_t t0 = 0;
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	t0 = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
	raw_submit(&x, e, ST_BATCH);
	/* Let kvd pick A's batches up before B asks (an old kvd then sits in
	 * them), and no longer: A's three batches took ~200 ms on 2 cores, and
	 * waiting 200 ms here let a faster kvd finish them all before B asked,
	 * which fails a kvd that is right.  Too short only lets B in first. */
	daemon_sleep_ms(10);
	assert_int_equal(write(go[1], "g", 1), 1);
	for (uint32_t s = 0; s < ST_BATCH; s++) {
		struct kvd_cqe c = raw_wait(&x);

		assert_int_equal(c.user_data, 200 + s);
		if (c.res)
			fail_msg("A's batch %u: %d %s", s, c.res, c.msg);
		/* every output is a finite number */
		const float *o = (const float *)((uint8_t *)shm_slot(&x.r, s) + out_off);

		for (uint32_t i = 0; i < ST_NSEQ; i += 97)
			assert_true(isfinite(o[(size_t)i * outb / 4]));
	}
	clock_gettime(CLOCK_MONOTONIC, &ts);
	print_message("  A's %d batches of %d sequences took %llu ms\n", ST_BATCH, ST_NSEQ,
		      (unsigned long long)((uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000 - t0));
	expect_kid_ok(kid, 300, "client B");
	print_message("  B's ATTEND came after %u of A's batches, its ServerStats after %u\n",
		      atomic_load(&sh->at_attend), atomic_load(&sh->at_stats));
	if (atomic_load(&sh->at_attend) >= ST_BATCH)
		fail_msg("B's single-sequence ATTEND waited for all %d of A's batches", ST_BATCH);
	if (atomic_load(&sh->at_stats) >= ST_BATCH)
		fail_msg("B's ServerStats waited for all %d of A's batches", ST_BATCH);
	raw_close(&x);
	assert_int_equal(kvc_seq_free(ca, sa), 0);
	kvc_close(ca);
	kvd_synth_free(&w);
	munmap(sh, 4096);
	close(ready[0]);
	close(go[1]);
}

/* ==== 3. sequences count against the memory budget ======================= */

static void test_seq_create_budget(void **state)
{
	struct raw x;
	Kvd__Profile p = mkprof("hostile-many-layers", 128, 8, 2, 128, 10, 60, 5);
	Kvd__ServerStats st;
	uint32_t pid;
	uint64_t seq, n = 0;
	long rss0, rss1;
	int rc = 0;

	assert_int_equal(raw_open(&x, D.sock, 0), 0);
	assert_int_equal(raw_hello(&x, "hostile", "t", 1, 1 << 16), 0);
	assert_int_equal(raw_profile_create(&x, &p, &pid), 0);
	rss0 = proc_vmrss_kib(D.pid);
	while (n < 250000 && !(rc = raw_seq_create(&x, pid, 0, &seq)))
		n++;
	rss1 = proc_vmrss_kib(D.pid);
	print_message("  %llu sequences accepted, then %d (%s); VmRSS %ld -> %ld KiB\n",
		      (unsigned long long)n, rc, rc ? x.msg : "-", rss0, rss1);
	if (!rc)
		fail_msg("250000 SeqCreate accepted under --mem-limit 64M: no limit enforced");
	fail_if_dead("after the SeqCreate loop");
	/* The budget: -ENOMEM ("memory budget: ..."), or, where the per-uid
	 * share ([limits] memory_per_uid, by default the whole budget) is
	 * checked first and runs out at the same time, -EDQUOT naming it. */
	if (rc != -ENOMEM && !(rc == -EDQUOT && strstr(x.msg, "memory_per_uid")))
		fail_msg("SeqCreate refused with %d '%s', want -ENOMEM (or -EDQUOT for "
			 "memory_per_uid)", rc, x.msg);
	if (!strstr(x.msg, "memory"))
		fail_msg("refusal does not say it is the memory budget: '%s'", x.msg);
	assert_int_equal(raw_stats(&x, &st), 0);
	print_message("  used_bytes %llu (resident %llu) of mem_limit %llu, %u sequences\n",
		      (unsigned long long)st.used_bytes, (unsigned long long)st.bytes,
		      (unsigned long long)st.mem_limit, st.sequences);
	assert_int_equal(st.mem_limit, 64ull << 20);
	/* The budget was full when kvd refused (the sequences' bookkeeping is
	 * what filled it): what it counts says so, and never more. */
	if (st.used_bytes + (1ull << 20) < st.mem_limit)
		fail_msg("ServerStats used_bytes is %llu with %u sequences and the budget refusing more",
			 (unsigned long long)st.used_bytes, st.sequences);
	assert_true(st.used_bytes <= st.mem_limit);
	assert_true(st.bytes <= st.mem_limit);
	assert_true(st.sequences >= n);
	/* 64 MiB of budget plus slack; sanitizer builds (the daemon is built
	 * like this test) add shadow memory and redzones on top. */
	long slack_mib = 96;
#if defined(__SANITIZE_THREAD__)
	slack_mib = 640;
#elif defined(__SANITIZE_ADDRESS__)
	slack_mib = 192;
#endif
	if (rss1 - rss0 > slack_mib * 1024)
		fail_msg("kvd's RSS grew by %ld MiB for sequences within a 64 MiB budget "
			 "(allowed: %ld)", (rss1 - rss0) / 1024, slack_mib);
	raw_close(&x);
}

/* ==== 4. profiles per uid ================================================ */

static Kvd__ServerStats stats_of(struct raw *o)
{
	Kvd__ServerStats st;
	int rc = raw_stats(o, &st);

	if (rc)
		fail_msg("ServerStats: %d %s", rc, o->msg);
	return st;
}

/* Creates profiles "<prefix>0".."<prefix>{n-1}" of distinct fields; returns
 * how many succeeded before the first refusal (its code in *code). */
static int create_profiles(struct raw *x, const char *prefix, int n, int *code)
{
	char name[64];

	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof name, "%s%d", prefix, i);
		Kvd__Profile p = mkprof(name, 2, 4, 2, 64, 8, 8, 100 + (uint64_t)i);
		uint32_t id;

		if ((*code = raw_profile_create(x, &p, &id)))
			return i;
	}
	*code = 0;
	return n;
}

static void test_profiles_per_uid(void **state)
{
	struct raw a, obs;
	int code, got;
	uint32_t base;

	if (!need_root())
		skip();
	kid_msg[0] = 0;
	assert_int_equal(raw_open(&obs, D.sock, 0), 0);
	assert_int_equal(raw_hello(&obs, "hostile", "obs", 1, 1 << 16), 0);
	base = stats_of(&obs).profiles;

	assert_int_equal(raw_open(&a, D.sock, 0), 0);
	assert_int_equal(raw_hello(&a, "hostile", "t", 1, 1 << 16), 0);
	got = create_profiles(&a, "hostile-pa", 5, &code);
	print_message("  uid 0 created %d profiles, then %d (%s)\n", got, code, code ? a.msg : "-");
	if (got == 5)
		fail_msg("a 5th profile was accepted with profiles_per_uid = 4");
	assert_int_equal(got, 4);
	assert_int_equal(code, -EDQUOT);
	if (!strstr(a.msg, "profiles_per_uid"))
		fail_msg("refusal does not name profiles_per_uid: '%s'", a.msg);
	assert_int_equal(stats_of(&obs).profiles, base + 4);

	/* another uid is not affected */
	pid_t kid = spawn();

	if (kid == 0) {
		struct raw b;
		int c2;

		become(UID_B);
		if (raw_open(&b, D.sock, 0) || raw_hello(&b, "hostile", "t", 1, 1 << 16))
			kid_fail(2, "uid %d: cannot connect: %s", UID_B, b.msg);
		if (create_profiles(&b, "hostile-pb", 1, &c2) != 1)
			kid_fail(3, "uid %d: ProfileCreate refused: %d %s", UID_B, c2, b.msg);
		raw_close(&b);
		_exit(0);
	}
	expect_kid_ok(kid, 60, "client of another uid");

	/* A's profiles go when A does (nothing else uses them) */
	raw_close(&a);
	uint32_t now = 0;

	for (int i = 0; i < 300; i++) {
		now = stats_of(&obs).profiles;
		if (now == base)
			break;
		daemon_sleep_ms(100);
	}
	if (now != base)
		fail_msg("profiles stay at %u after their clients left (was %u)", now, base);

	assert_int_equal(raw_open(&a, D.sock, 0), 0);
	assert_int_equal(raw_hello(&a, "hostile", "t", 1, 1 << 16), 0);
	got = create_profiles(&a, "hostile-pa", 5, &code);
	assert_int_equal(got, 4);
	assert_int_equal(code, -EDQUOT);
	raw_close(&a);
	raw_close(&obs);
}

/* ==== 5. profile names are per uid ======================================= */

static void test_profile_namespace(void **state)
{
	struct raw a;
	Kvd__Profile pa = mkprof("p", 2, 4, 2, 64, 8, 8, 1);
	uint32_t id_a, id_again;
	uint64_t seq;

	if (!need_root())
		skip();
	kid_msg[0] = 0;
	assert_int_equal(raw_open(&a, D.sock, 0), 0);
	assert_int_equal(raw_hello(&a, "hostile", "t", 1, 1 << 16), 0);
	assert_int_equal(raw_profile_create(&a, &pa, &id_a), 0);

	/* same tenant name on purpose: only the uid separates them */
	pid_t kid = spawn();

	if (kid == 0) {
		struct raw b;
		Kvd__Profile pb = mkprof("p", 3, 8, 8, 128, 10, 20, 2);
		uint32_t id;
		uint64_t s;
		int rc;

		become(UID_B);
		if (raw_open(&b, D.sock, 0) || raw_hello(&b, "hostile", "t", 1, 1 << 16))
			kid_fail(2, "uid %d: cannot connect: %s", UID_B, b.msg);
		rc = raw_profile_open(&b, "p", &id);
		if (rc != -ENOENT)
			kid_fail(10, "uid %d: ProfileOpen of uid 0's \"p\": %d (%s), want -ENOENT",
				 UID_B, rc, rc ? b.msg : "opened it");
		rc = raw_profile_create(&b, &pb, &id);
		if (rc)
			kid_fail(11, "uid %d: ProfileCreate \"p\" with its own fields: %d (%s)", UID_B,
				 rc, b.msg);
		if (id == id_a)
			kid_fail(12, "uid %d: its \"p\" has uid 0's profile id %u", UID_B, id);
		rc = raw_seq_create(&b, id_a, 0, &s);
		if (rc != -ENOENT)
			kid_fail(13, "uid %d: SeqCreate on uid 0's profile id: %d (%s), want -ENOENT",
				 UID_B, rc, rc ? b.msg : "created");
		if ((rc = raw_seq_create(&b, id, 0, &s)))
			kid_fail(14, "uid %d: SeqCreate on its own profile: %d (%s)", UID_B, rc, b.msg);
		raw_close(&b);
		_exit(0);
	}
	expect_kid_ok(kid, 60, "client of another uid");
	assert_int_equal(raw_profile_create(&a, &pa, &id_again), 0);
	assert_int_equal(id_again, id_a);
	assert_int_equal(raw_seq_create(&a, id_a, 0, &seq), 0);
	raw_close(&a);
}

/* ==== 6. connections per uid ============================================= */

/* A refused connection: an Error naming the key, or closed; never a
 * working Hello.  0 when refused, else why not in kid_msg. */
static int refused_hello(struct raw *x)
{
	int rc = raw_hello(x, "hostile", "t", 1, 1 << 16);

	if (rc == 0) {
		snprintf(kid_msg, 4096, "connection over connections_per_uid got a working Hello");
		return -1;
	}
	if (rc == -EPIPE) {
		snprintf(kid_msg, 4096, "the connection over the limit was closed");
		return 0;
	}
	if (rc == -ETIMEDOUT) {
		snprintf(kid_msg, 4096, "connection over connections_per_uid: no answer, not closed");
		return -1;
	}
	if (rc != -EDQUOT || !strstr(x->msg, "connections_per_uid")) {
		snprintf(kid_msg, 4096, "connection over connections_per_uid: %d '%s', want -EDQUOT "
			 "naming connections_per_uid", rc, x->msg);
		return -1;
	}
	snprintf(kid_msg, 4096, "the connection over the limit got %d '%s'", rc, x->msg);
	return 0;
}

static void test_connections_per_uid(void **state)
{
	int held[2], rel[2];
	char b;

	if (!need_root())
		skip();
	kid_msg[0] = 0;
	assert_int_equal(pipe(held), 0);
	assert_int_equal(pipe(rel), 0);
	pid_t ka = spawn();

	if (ka == 0) {
		struct raw c[9], again;
		int ok = 0;

		become(UID_B);
		for (int i = 0; i < 8; i++)
			if (raw_open(&c[i], D.sock, 0))
				kid_fail(2, "uid %d: connection %d: %s", UID_B, i, strerror(errno));
		if (raw_open(&c[8], D.sock, 0) == 0 && refused_hello(&c[8]))
			_exit(3);
		if (write(held[1], "h", 1) != 1 || read(rel[0], &b, 1) != 1)
			_exit(4);
		for (int i = 0; i < 9; i++)
			raw_close(&c[i]);
		/* once kvd has seen them go, this uid may connect again */
		for (int i = 0; i < 300 && !ok; i++) {
			ok = raw_open(&again, D.sock, 0) == 0 &&
			     raw_hello(&again, "hostile", "t", 1, 1 << 16) == 0;
			if (!ok)
				daemon_sleep_ms(100);
			raw_close(&again);
		}
		if (!ok)
			kid_fail(5, "uid %d cannot connect after closing its connections", UID_B);
		_exit(0);
	}
	close(held[1]);
	close(rel[0]);
	if (read(held[0], &b, 1) != 1)
		expect_kid_ok(ka, 60, "uid A");         /* it failed: say why */

	/* uid C connects and is served while A holds its 8 */
	pid_t kc = spawn();

	if (kc == 0) {
		struct raw c;
		Kvd__ServerStats st;
		int rc;

		become(UID_C);
		if (raw_open(&c, D.sock, 0))
			kid_fail(2, "uid %d: connect: %s", UID_C, strerror(errno));
		if ((rc = raw_hello(&c, "hostile", "t", 1, 1 << 16)))
			kid_fail(3, "uid %d: Hello: %d %s", UID_C, rc, c.msg);
		if ((rc = raw_stats(&c, &st)))
			kid_fail(4, "uid %d: ServerStats: %d %s", UID_C, rc, c.msg);
		raw_close(&c);
		_exit(0);
	}
	print_message("  %s\n", kid_msg);
	expect_kid_ok(kc, 60, "client of another uid");
	assert_int_equal(write(rel[1], "r", 1), 1);
	expect_kid_ok(ka, 60, "uid A");
	close(held[0]);
	close(rel[1]);
}

/* ==== 7. EMFILE must not spin ============================================ */

static void test_emfile_no_spin(void **state)
{
	char log[128];
	struct rlimit low;
	int base, lim, nfd = 0, fds[4096], rc = 0;
	long tck = sysconf(_SC_CLK_TCK);

	snprintf(log, sizeof log, "/tmp/kvd-hostile-log.%d", (int)getpid());
	unlink(log);
	/* How many fds does an idle kvd hold?  Then lower its limit (soft and
	 * hard, so it cannot raise it again) to a few more than that. */
	assert_int_equal(daemon_start4(&D, "--log-file", log, NULL, NULL), 0);
	daemon_sleep_ms(200);
	base = proc_nfds(D.pid);
	assert_true(base > 0);
	lim = base + 24;
	low.rlim_cur = low.rlim_max = (rlim_t)lim;
	assert_int_equal(prlimit(D.pid, RLIMIT_NOFILE, &low, NULL), 0);
	print_message("  kvd holds %d fds idle; RLIMIT_NOFILE lowered to %d\n", base, lim);

	/* More connections than it has fds: connect() succeeds while the
	 * backlog has room; stop when it does not. */
	for (nfd = 0; nfd < lim + 64; nfd++) {
		struct sockaddr_un a = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

		assert_true(fd >= 0);
		memcpy(a.sun_path, D.sock, strlen(D.sock) + 1);
		if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
			close(fd);
			break;
		}
		fds[nfd] = fd;
	}
	daemon_sleep_ms(500);
	fail_if_dead("once out of fds");
	long log0 = file_size(log);
	long long cpu0 = daemon_cpu_ticks(D.pid);

	daemon_sleep_ms(2000);
	long long cpu1 = daemon_cpu_ticks(D.pid);
	long log1 = file_size(log);

	print_message("  %d connections open; kvd holds %d fds; over 2 s: %.2f s of CPU, "
		      "%ld bytes of log\n", nfd, proc_nfds(D.pid), (double)(cpu1 - cpu0) / tck,
		      log1 - log0);
	assert_true(cpu0 >= 0 && cpu1 >= 0);
	if ((double)(cpu1 - cpu0) / tck >= 0.25)
		fail_msg("kvd used %.2f s of CPU in 2 s with nothing to do but a full fd table",
			 (double)(cpu1 - cpu0) / tck);
	if (log1 - log0 >= 64 * 1024)
		fail_msg("kvd wrote %ld bytes of log in 2 s", log1 - log0);

	/* Free most of them: a new client is served within a few seconds. */
	for (int i = 4; i < nfd; i++)
		close(fds[i]);
	struct raw x;
	int ok = 0;

	for (int i = 0; i < 300 && !ok; i++) {
		if (raw_open(&x, D.sock, 0) == 0 &&
		    (rc = raw_hello(&x, "hostile", "t", 1, 1 << 16)) == 0)
			ok = 1;
		else
			daemon_sleep_ms(100);
		raw_close(&x);
	}
	for (int i = 0; i < 4 && i < nfd; i++)
		close(fds[i]);
	if (!ok)
		fail_msg("no new client served after connections were closed (%d %s)", rc, x.msg);
	unlink(log);
}

/* ==== 8. a one-token PREFILL within the memory wall ====================== */

static void test_prefill_staging_budget(void **state)
{
	/* 64 kv heads, d = 256, 1024 tables: one token's row is 192 KiB, so a
	 * staging area for 1024 tokens (192 MiB) cannot fit in 64 MiB. */
	const uint32_t H = 64, d = 256, L = 1024, layers = 6;
	Kvd__Profile p = mkprof("hostile-wide", layers, 64, 64, 256, 1, 1024, 3);
	struct raw x;
	uint32_t pid;
	uint64_t seq;
	Kvd__ServerStats st;
	int ok = 0, nomem = 0;

	assert_int_equal(raw_open(&x, D.sock, 0), 0);
	assert_int_equal(raw_hello(&x, "hostile", "t", 2, 1 << 20), 0);
	assert_int_equal(raw_profile_create(&x, &p, &pid), 0);
	assert_int_equal(raw_seq_create(&x, pid, 0, &seq), 0);

	const uint32_t len = (uint32_t)kvd_rows_bytes(H, d, L, 1, 1);
	uint8_t *base = shm_slot(&x.r, 0);

	assert_true(len <= (1u << 20));
	memset(base, 0, len);           /* mean 0, K = V = 0, codes 0 (K = 1) */
	for (uint32_t l = 0; l < layers; l++) {
		struct kvd_sqe e = { .op = KVD_OP_PREFILL, .flags = KVD_RF_MEAN, .layer = (uint16_t)l,
				     .slot = 0, .user_data = 300 + l, .seq = seq, .len = len, .ntok = 1 };

		if (l == layers - 1)
			e.flags |= KVD_RF_LAST;
		raw_submit(&x, &e, 1);
		struct kvd_cqe c = raw_wait(&x);

		assert_int_equal(c.user_data, 300 + l);
		if (c.res == 0)
			ok++;
		else if (c.res == -ENOMEM)
			nomem++;
		else
			fail_msg("PREFILL of one token into layer %u: %d %s", l, c.res, c.msg);
		assert_int_equal(raw_stats(&x, &st), 0);
		print_message("  layer %u: %d; bytes %llu + reserved %llu, limit %llu\n", l, c.res,
			      (unsigned long long)st.bytes, (unsigned long long)st.reserved_bytes,
			      (unsigned long long)st.mem_limit);
		assert_int_equal(st.mem_limit, 64ull << 20);
		if (st.bytes + st.reserved_bytes > st.mem_limit)
			fail_msg("one-token PREFILL into layer %u: %llu bytes in use, over the %llu "
				 "limit", l, (unsigned long long)(st.bytes + st.reserved_bytes),
				 (unsigned long long)st.mem_limit);
	}
	print_message("  %d accepted, %d refused with -ENOMEM\n", ok, nomem);
	raw_close(&x);
}

/* A uid's connections may map at most shm_per_uid of regions between them:
 * the Hello over it is refused (-EDQUOT, naming the key) before anything is
 * made, a smaller arena still fits, and closing a connection gives its
 * share back.  ServerStats shows the uid's shm_bytes. */
static void test_shm_per_uid(void **state)
{
	struct raw a, b, c;
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;
	uint64_t shm = 0;
	int rc;

	assert_int_equal(raw_open(&a, D.sock, 0), 0);
	assert_int_equal(raw_hello(&a, "hostile", "t", 8, 4 << 20), 0);      /* 32 MiB + rings */
	assert_int_equal(raw_open(&b, D.sock, 0), 0);
	rc = raw_hello(&b, "hostile", "t", 8, 4 << 20);
	print_message("  a second 32 MiB arena: %d '%s'\n", rc, rc ? b.msg : "");
	assert_int_equal(rc, -EDQUOT);
	assert_non_null(strstr(b.msg, "shm_per_uid"));
	/* The refused Hello left nothing behind: a small arena fits. */
	assert_int_equal(raw_hello(&b, "hostile", "t", 1, 64 << 10), 0);
	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	assert_int_equal(raw_expect(&a, &rq, KVD__RESPONSE__BODY_SERVER_STATS, &r), 0);
	for (size_t i = 0; i < r->server_stats->n_uids; i++)
		if (r->server_stats->uids[i]->uid == geteuid())
			shm = r->server_stats->uids[i]->shm_bytes;
	kvd_ctl_free_response(r);
	print_message("  uid %u: %llu bytes of shared memory\n", (unsigned)geteuid(),
		      (unsigned long long)shm);
	assert_true(shm > (32ull << 20) + (64 << 10) && shm <= 64ull << 20);
	/* a's share comes back when it goes */
	raw_close(&a);
	assert_int_equal(raw_open(&c, D.sock, 0), 0);
	for (int i = 0; i < 500 && (rc = raw_hello(&c, "hostile", "t", 8, 4 << 20)) == -EDQUOT; i++) {
		raw_close(&c);
		daemon_sleep_ms(10);
		assert_int_equal(raw_open(&c, D.sock, 0), 0);
	}
	assert_int_equal(rc, 0);
	raw_close(&b);
	raw_close(&c);
}

/* Executor time is shared between uids before connections: uid A keeps six
 * connections busy with ATTEND batches, uid B one; over a measured window B
 * must get about half of what both use (per connection it would be 1/7).
 * The shares are kvd's own count (ServerStats UidUsage.exec_ns), a ratio
 * that does not depend on the machine's speed. */
struct fair_shared {
	_Atomic int ready, stop;
	_Atomic uint64_t batches[8];
};

#define FAIR_A 6
#define FAIR_N 64

static uint64_t uid_exec_ns(struct raw *x, uid_t uid)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;
	uint64_t ns = 0;

	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	assert_int_equal(raw_expect(x, &rq, KVD__RESPONSE__BODY_SERVER_STATS, &r), 0);
	for (size_t i = 0; i < r->server_stats->n_uids; i++)
		if (r->server_stats->uids[i]->uid == uid)
			ns = r->server_stats->uids[i]->exec_ns;
	kvd_ctl_free_response(r);
	return ns;
}

static void test_uid_fair_share(void **state)
{
	struct fair_shared *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
				      -1, 0);
	const uid_t ua = 65534, ub = 65533;
	uint64_t a0, b0, a1, b1;
	struct raw obs;
	pid_t kid[FAIR_A + 1];

	if (!need_root())
		skip();
	assert_true(sh != MAP_FAILED);
	kid_msg[0] = 0;
	for (int i = 0; i <= FAIR_A; i++) {
		kid[i] = spawn();
		if (kid[i] == 0) {
			struct kvd_synth w;
			struct kvc *c;
			struct kvc_seq *sq, *seqs[FAIR_N];
			static float q[FAIR_N * 8 * 64], o[FAIR_N * 8 * 64], l[FAIR_N * 8];

			become(i < FAIR_A ? ua : ub);
			if (!(c = kconnect("t", &PS, 2, 1 << 20)) || !(sq = kprefill(c, &PS, 2000, 60 + i, &w)))
				kid_fail(2, "client %d: setup failed", i);
			for (int k = 0; k < FAIR_N; k++) {
				seqs[k] = sq;
				memcpy(q + (size_t)k * 8 * 64, w.q, sizeof(float) * 8 * 64);
			}
			atomic_fetch_add(&sh->ready, 1);
			while (!atomic_load(&sh->stop)) {
				if (kvc_attend_kvd(c, 1, seqs, FAIR_N, q, o, l))
					kid_fail(3, "client %d: attend: %s", i, kvc_last_error(c));
				atomic_fetch_add(&sh->batches[i], 1);
			}
			kvc_close(c);
			_exit(0);
		}
	}
	for (int t = 0; t < 3000 && atomic_load(&sh->ready) < FAIR_A + 1; t++)
		daemon_sleep_ms(10);
	assert_int_equal(atomic_load(&sh->ready), FAIR_A + 1);
	assert_int_equal(raw_open(&obs, D.sock, 0), 0);
	assert_int_equal(raw_hello(&obs, "hostile", "obs", 1, 1 << 16), 0);
	daemon_sleep_ms(300);
	a0 = uid_exec_ns(&obs, ua);
	b0 = uid_exec_ns(&obs, ub);
	daemon_sleep_ms(1500);
	a1 = uid_exec_ns(&obs, ua);
	b1 = uid_exec_ns(&obs, ub);
	atomic_store(&sh->stop, 1);
	for (int i = 0; i <= FAIR_A; i++)
		expect_kid_ok(kid[i], 120, "a busy client");
	raw_close(&obs);

	double da = (double)(a1 - a0), db = (double)(b1 - b0), share = db / (da + db);

	print_message("  executor time over the window: uid A (%d connections) %.0f ms, uid B (1) "
		      "%.0f ms: B's share %.2f\n", FAIR_A, da / 1e6, db / 1e6, share);
	assert_true(da > 0 && db > 0);
	/* Per connection B would get 1/7 (0.14); per uid 1/2. */
	if (share < 0.3)
		fail_msg("uid B got %.2f of the executor against a uid with %d connections", share,
			 FAIR_A);
	munmap(sh, 4096);
}

/* Control-plane CPU is bounded per uid: uid A floods ServerStats on four
 * connections (pipelined, never waiting) under control_cpu_per_uid = 5%.
 * Over a measured window kvd may spend on A's control requests at most 5%
 * of the window plus its one-second burst (kvd's own count, UidUsage
 * control_ns; unbounded, a flood takes most of the loop), A's connections
 * were paused, and every request A sent is still answered in the end:
 * waiting loses nothing. */
struct ctl_shared {
	_Atomic int flooding, stop;
	_Atomic uint64_t sent, answered;
};

#define CTL_CONNS 4

static void uid_ctl(struct raw *x, uid_t uid, uint64_t *ns, uint64_t *paused)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;

	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	assert_int_equal(raw_expect(x, &rq, KVD__RESPONSE__BODY_SERVER_STATS, &r), 0);
	*ns = *paused = 0;
	for (size_t i = 0; i < r->server_stats->n_uids; i++)
		if (r->server_stats->uids[i]->uid == uid) {
			*ns = r->server_stats->uids[i]->control_ns;
			*paused = r->server_stats->uids[i]->control_paused;
		}
	kvd_ctl_free_response(r);
}

static uint64_t mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void test_control_cpu_per_uid(void **state)
{
	struct ctl_shared *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
				     -1, 0);
	const uid_t ua = 65534;
	uint64_t n0, n1, p0, p1, t0, t1;
	struct raw obs;

	if (!need_root())
		skip();
	assert_true(sh != MAP_FAILED);
	kid_msg[0] = 0;

	pid_t kid = spawn();

	if (kid == 0) {
		struct raw x[CTL_CONNS];
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
		uint64_t sent[CTL_CONNS] = { 0 }, got[CTL_CONNS] = { 0 };

		become(ua);
		rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
		rq.server_stats = &sr;
		for (int i = 0; i < CTL_CONNS; i++)
			if (raw_open(&x[i], D.sock, 1) ||
			    raw_hello(&x[i], "hostile", "flood", 1, 1 << 16))
				kid_fail(2, "connection %d: setup failed", i);
		atomic_store(&sh->flooding, 1);
		for (int draining = 0;;) {
			int busy = 0;

			for (int i = 0; i < CTL_CONNS; i++) {
				int fds[KVD_CTL_MAX_FDS], nfds = KVD_CTL_MAX_FDS;

				/* keep up to 256 in flight per connection */
				while (!draining && sent[i] - got[i] < 256) {
					rq.id = ++x[i].next;
					if (kvd_ctl_send(x[i].fd, &rq.base, NULL, 0))
						break;
					sent[i]++;
				}
				while (kvd_ctl_recv(x[i].fd, x[i].rx, RX_CAP, fds, &nfds) > 0) {
					got[i]++;
					nfds = KVD_CTL_MAX_FDS;
				}
				busy |= got[i] < sent[i];
			}
			uint64_t a = 0, b = 0;

			for (int i = 0; i < CTL_CONNS; i++)
				a += sent[i], b += got[i];
			atomic_store(&sh->sent, a);
			atomic_store(&sh->answered, b);
			if (!draining && atomic_load(&sh->stop))
				draining = 1;
			if (draining && !busy)
				break;
			daemon_sleep_ms(1);
		}
		for (int i = 0; i < CTL_CONNS; i++)
			raw_close(&x[i]);
		_exit(0);
	}
	for (int t = 0; t < 3000 && !atomic_load(&sh->flooding); t++)
		daemon_sleep_ms(10);
	assert_true(atomic_load(&sh->flooding));
	assert_int_equal(raw_open(&obs, D.sock, 0), 0);
	assert_int_equal(raw_hello(&obs, "hostile", "obs", 1, 1 << 16), 0);
	/* let the flood spend its burst */
	daemon_sleep_ms(1500);
	t0 = mono_ns();
	uid_ctl(&obs, ua, &n0, &p0);
	daemon_sleep_ms(2000);
	uid_ctl(&obs, ua, &n1, &p1);
	t1 = mono_ns();
	atomic_store(&sh->stop, 1);
	expect_kid_ok(kid, 120, "the flooding client");
	raw_close(&obs);

	double win = (double)(t1 - t0) / 1e9, spent = (double)(n1 - n0) / 1e9;

	print_message("  uid %u: %.3f s of control time in a %.2f s window (5%%: %.3f s), paused %llu "
		      "times; %llu requests sent, %llu answered\n", (unsigned)ua, spent, win,
		      0.05 * win, (unsigned long long)p1, (unsigned long long)atomic_load(&sh->sent),
		      (unsigned long long)atomic_load(&sh->answered));
	assert_true(p1 > 0);
	assert_true(n1 > n0);
	/* 5% of the window, plus a full burst (5% of a second), plus the
	 * request in hand on each side of the window */
	if (spent > 0.05 * win + 0.05 + 0.05)
		fail_msg("uid %u took %.3f s of kvd's loop in %.2f s at 5%%", (unsigned)ua, spent, win);
	assert_int_equal(atomic_load(&sh->answered), atomic_load(&sh->sent));
	munmap(sh, 4096);
}

/* ProfileCreate of the largest W (d 256, K 16, L 1024: 16 MiB of Gaussians,
 * ~130 ms each on one core): eight pipelined on one connection while
 * another client decodes.  W is made without kvd's state lock, so the
 * decoder keeps being answered while they are made; held under the lock,
 * the eight would hold it for a second and the decoder would get about
 * nothing done in the meantime. */
struct bigp_shared {
	_Atomic int ready, stop;
	_Atomic uint64_t done;
};

static void test_big_profiles_no_stall(void **state)
{
	struct bigp_shared *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
				      -1, 0);
	enum { NP = 8 };
	char names[NP][32];
	struct raw a;
	uint64_t d0, d1;
	pid_t kid;

	assert_true(sh != MAP_FAILED);
	kid_msg[0] = 0;
	kid = spawn();
	if (kid == 0) {
		struct kvd_synth w;
		struct kvc *c;
		struct kvc_seq *sq;
		float o[8 * 64], l[8];

		if (!(c = kconnect("dec", &PS, 2, 1 << 20)) || !(sq = kprefill(c, &PS, 1000, 71, &w)))
			kid_fail(2, "decoder: setup failed");
		atomic_store(&sh->ready, 1);
		while (!atomic_load(&sh->stop)) {
			if (kvc_attend_kvd(c, 1, &sq, 1, w.q, o, l))
				kid_fail(3, "decoder: attend: %s", kvc_last_error(c));
			atomic_fetch_add(&sh->done, 1);
		}
		kvc_close(c);
		_exit(0);
	}
	for (int t = 0; t < 3000 && atomic_load(&sh->done) < 3; t++)
		daemon_sleep_ms(10);
	assert_true(atomic_load(&sh->done) >= 3);
	assert_int_equal(raw_open(&a, D.sock, 0), 0);
	assert_int_equal(raw_hello(&a, "hostile", "big", 1, 1 << 16), 0);
	d0 = atomic_load(&sh->done);
	for (int i = 0; i < NP; i++) {
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__ProfileCreate pc = KVD__PROFILE_CREATE__INIT;
		Kvd__Profile p;

		snprintf(names[i], sizeof names[i], "hostile-bigw-%d", i);
		p = mkprof(names[i], 2, 8, 2, 256, 16, 1024, 500 + (uint64_t)i);
		pc.profile = &p;
		rq.body_case = KVD__REQUEST__BODY_PROFILE_CREATE;
		rq.profile_create = &pc;
		rq.id = ++a.next;
		assert_int_equal(kvd_ctl_send(a.fd, &rq.base, NULL, 0), 0);
	}
	for (int i = 0; i < NP; i++) {
		struct pollfd pf = { .fd = a.fd, .events = POLLIN };
		int fds[KVD_CTL_MAX_FDS], nfds = KVD_CTL_MAX_FDS, n;
		struct kvd_ctl_err e;
		Kvd__Response *r;

		assert_int_equal(poll(&pf, 1, CALL_MS), 1);
		n = kvd_ctl_recv(a.fd, a.rx, RX_CAP, fds, &nfds);
		assert_true(n > 0);
		r = kvd_ctl_decode_response(a.rx, (size_t)n, a.next - NP + 1 + (uint64_t)i, &e);
		if (!r)
			fail_msg("profile %d: reply does not decode: %s", i, e.msg);
		if (r->body_case != KVD__RESPONSE__BODY_PROFILE)
			fail_msg("profile %d: %s", i, r->body_case == KVD__RESPONSE__BODY_ERROR ?
			     r->error->message : "unexpected reply");
		kvd_ctl_free_response(r);
	}
	d1 = atomic_load(&sh->done);
	atomic_store(&sh->stop, 1);
	expect_kid_ok(kid, 60, "the decoder");
	raw_close(&a);
	print_message("  the decoder got %llu answers while %d profiles of 16 MiB of W were made\n",
		      (unsigned long long)(d1 - d0), NP);
	/* Held, the decoder got 1 to 10 answers; made outside, thousands. */
	if (d1 - d0 < 50)
		fail_msg("the decoder got %llu answers while the profiles were made: they held it",
			 (unsigned long long)(d1 - d0));
	munmap(sh, 4096);
}

/* ==== prefix sharing: LOCAL rows and snapshots per uid ==================== */

struct share_dec {
	atomic_int stop;
	atomic_long answers, errors;
	char msg[256];
};

/* uid 0's decoding client: answers until told to stop; any error counts
 * (in a process of its own: sd is shared memory). */
static void *share_decoder(void *arg)
{
	struct share_dec *sd = arg;
	struct kvc *c = kconnect("good", &P1, 4, 1 << 20);
	struct kvd_synth w;
	struct kvc_seq *s;
	float o[8 * 128], lse[8];

	if (!c || !(s = kprefill(c, &P1, 2048, 5, &w))) {
		snprintf(sd->msg, sizeof sd->msg, "decoder setup: %s", c ? kvc_last_error(c) : "");
		atomic_fetch_add(&sd->errors, 1);
		kvc_close(c);
		return NULL;
	}
	while (!atomic_load(&sd->stop)) {
		if (kvc_attend(c, 1, &s, 1, w.q, o, lse)) {
			snprintf(sd->msg, sizeof sd->msg, "attend: %s", kvc_last_error(c));
			atomic_fetch_add(&sd->errors, 1);
			break;
		}
		atomic_fetch_add(&sd->answers, 1);
	}
	kvc_seq_free(c, s);
	kvd_synth_free(&w);
	kvc_close(c);
	return NULL;
}

/* As uid B: LOCAL puts of 1 MiB-slot chunks into one sequence until kvd
 * refuses (-EDQUOT at memory_per_uid), through a raw ring. */
static void share_local_flood(void)
{
	struct raw x;
	uint32_t pid;
	uint64_t seq;
	Kvd__Profile p = mkprof("hostile-share", 3, 8, 2, 128, 4, 8, 1);
	const uint32_t n = 1024;        /* 1 MiB of K and V at kv 2, d 128 */
	const uint32_t len = (uint32_t)kvd_local_layout(2, 128, n, 0).bytes;
	int rc;

	become(UID_B);
	if (raw_open(&x, D.sock, 0) || raw_hello(&x, "flood", "t", 4, 2 << 20) ||
	    raw_profile_create(&x, &p, &pid) || raw_seq_create(&x, pid, 0, &seq))
		kid_fail(2, "uid B setup: %s", x.msg);
	memset(shm_slot(&x.r, 0), 0x3c, len);
	for (uint32_t i = 0; i < 4096; i++) {
		struct kvd_sqe e = { .op = KVD_OP_LOCAL, .layer = 0, .slot = 0, .seq = seq,
				     .len = len, .ntok = n, .row0 = i * n };

		rc = raw_ring(&x, &e);
		if (rc == -EDQUOT) {
			if (!strstr(x.msg, "memory_per_uid"))
				kid_fail(3, "refusal without the limit's name: %s", x.msg);
			if (i < 8)
				kid_fail(4, "refused after %u MiB, the limit is 64", i);
			_exit(0);
		}
		if (rc)
			kid_fail(5, "LOCAL put %u: %d %s", i, rc, x.msg);
	}
	kid_fail(6, "8 GiB of LOCAL rows and no refusal");
}

/* As uid B: prefix after prefix of one growing sequence, published.  Past
 * sequences_per_uid the uid's oldest snapshots make way, so publishes go on
 * succeeding; one that still does not fit memory_per_uid (each snapshot
 * keeps a dense layer's rows whole) is refused naming the limit, and the
 * client goes on. */
static void share_publish_flood(void)
{
	struct kvc *c;
	struct kvd_synth w;
	struct kvc_seq *s;
	uint32_t chunk, tok[64 * 128];

	become(UID_B);
	if (!(c = kconnect("t", &P1, 4, 1 << 20)) || !(s = kprefill(c, &P1, 128, 6, &w)))
		kid_fail(2, "uid B setup");
	chunk = kvc_chunk_tokens(c);
	if (chunk != 128)
		kid_fail(3, "chunk_tokens %u, want 128 (seal_tokens)", chunk);
	for (uint32_t i = 0; i < 64 * 128; i++)
		tok[i] = i;
	uint32_t ok = 0, refused = 0;

	for (uint32_t i = 1; i <= 40; i++) {
		uint8_t keys[64 * KVC_KEY_BYTES];
		float k[2 * 128], v[2 * 128];
		int nk;

		if (i > 1)
			for (uint32_t t = 0; t < chunk; t++)
				for (uint32_t l = 0; l < P1.layers; l++) {
					memcpy(k, w.k + (t % 128) * 128, sizeof k / 2);
					memcpy(k + 128, w.k + (128 + t % 128) * 128, sizeof k / 2);
					memcpy(v, k, sizeof v);
					if (kvc_append(c, s, l, k, v))
						kid_fail(4, "append: %s", kvc_last_error(c));
				}
		nk = kvc_content_keys(c, tok, i * chunk, keys);
		if (nk != (int)i)
			kid_fail(5, "keys %u: %d", i, nk);
		int rc = kvc_seq_publish(c, s, keys + (i - 1) * KVC_KEY_BYTES);

		if (rc == -EDQUOT && strstr(kvc_last_error(c), "memory_per_uid"))
			refused++;
		else if (rc)
			kid_fail(6, "publish %u: %s", i, kvc_last_error(c));
		else
			ok++;
	}
	if (ok < 20)
		kid_fail(7, "%u publishes of 40 went through (%u refused): too few", ok, refused);
	_exit(0);
}

static void test_share_per_uid(void **state)
{
	/* The decoder is a process, not a thread: this one forks the floods,
	 * and a multi-threaded fork is what TSan (rightly) refuses. */
	struct share_dec *sd = mmap(NULL, sizeof *sd, PROT_READ | PROT_WRITE,
				    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	struct raw o;
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;
	pid_t kid, dec;

	if (!need_root())
		skip();
	assert_true(sd != MAP_FAILED);
	memset(sd, 0, sizeof *sd);
	if ((dec = spawn()) == 0) {
		share_decoder(sd);
		_exit(0);
	}
	while (!atomic_load(&sd->answers) && !atomic_load(&sd->errors))
		daemon_sleep_ms(10);

	if ((kid = spawn()) == 0)
		share_local_flood();
	expect_kid_ok(kid, 120, "uid B's LOCAL flood");
	if ((kid = spawn()) == 0)
		share_publish_flood();
	expect_kid_ok(kid, 240, "uid B's publish flood");

	atomic_store(&sd->stop, 1);
	expect_kid_ok(dec, 60, "uid 0's decoder");
	fail_if_dead("after the floods");
	print_message("  uid 0 decoded %ld steps meanwhile, %ld errors %s\n",
		      atomic_load(&sd->answers), atomic_load(&sd->errors), sd->msg);
	assert_int_equal(atomic_load(&sd->errors), 0);
	assert_true(atomic_load(&sd->answers) > 0);
	munmap(sd, sizeof *sd);

	/* what uid B holds now: its snapshots, within its limits, and none of
	 * them visible to uid 0 */
	assert_int_equal(raw_open(&o, D.sock, 0), 0);
	assert_int_equal(raw_hello(&o, "observer", "good", 1, 64 << 10), 0);
	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	assert_int_equal(raw_expect(&o, &rq, KVD__RESPONSE__BODY_SERVER_STATS, &r), 0);

	const Kvd__ServerStats st = *r->server_stats;

	for (size_t i = 0; i < st.n_uids; i++) {
		const Kvd__UidUsage *u = st.uids[i];

		if (u->uid != UID_B)
			continue;
		print_message("  uid B: %u sequences, %llu bytes\n", u->sequences,
			      (unsigned long long)u->bytes);
		assert_true(u->sequences <= 12);
		assert_true(u->bytes <= 64ull << 20);
	}
	for (size_t i = 0; i < st.n_share; i++)
		if (st.share[i]->ns == UID_B)
			assert_true(st.share[i]->published > 0 && st.share[i]->published < 12);
	kvd_ctl_free_response(r);
	raw_close(&o);
}

/* ==== non-finite queries ================================================== */

/* A client's queries are floats it chose: NaN, infinities, the largest
 * finite values.  Whatever kvd answers that client, it must not crash, the
 * client's other q heads must get the answer they get without the poison
 * (magicpig and the tail's exact part work per q head), the next clean
 * query must be answered as before, and another tenant must see nothing.
 * The hybrid estimators keep per-sequence state (heavy lists) that a
 * poisoned query updates: there the clean query afterwards must still be
 * finite everywhere, since the lists hold row ids, never scores. */
static void test_nonfinite_queries(void **state)
{
	static const struct {
		uint32_t dt, est;
		const char *name;
	} pr[] = {
		{ KVC_KV_BF16, KVC_EST_MAGICPIG, "hostile-nf-bf16" },
		{ KVC_KV_INT8, KVC_EST_MAGICPIG, "hostile-nf-int8" },
		{ KVC_KV_INT8, KVC_EST_HYBRID, "hostile-nf-int8-hybrid" },
		{ KVC_KV_BF16, KVC_EST_ADAPTIVE, "hostile-nf-bf16-adaptive" },
	};
	const float bad[] = { NAN, -NAN, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, 1e-45f };
	const int sick[2] = { 0, 5 };   /* one q head in each kv group */
	int go_w, ready_r, calls = 0;
	pid_t honest = spawn_honest(&go_w, &ready_r);

	for (size_t p = 0; p < sizeof pr / sizeof pr[0]; p++) {
		struct kvc_model m = P1;
		struct kvd_synth w;
		struct kvc *c;
		struct kvc_seq *s;
		float q[8 * 128], o0[8 * 128], l0[8], o[8 * 128], l[8];
		const int exact = pr[p].est == KVC_EST_MAGICPIG;

		m.name = pr[p].name;
		m.K = 4;
		m.L = 32;
		m.c = 2;
		m.kv_dtype = pr[p].dt;
		m.estimator = pr[p].est;
		c = kconnect("nonfinite", &m, 4, 1 << 20);
		assert_non_null(c);
		s = kprefill(c, &m, 1500, 40 + p, &w);
		assert_non_null(s);
		for (uint32_t layer = 1; layer < m.layers; layer++) {
			assert_int_equal(kvc_attend_kvd(c, layer, &s, 1, w.q, o0, l0), 0);
			for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
				for (int all = 0; all < 2; all++) {
					memcpy(q, w.q, sizeof q);
					for (int k = 0; k < 2; k++)
						for (int e = 0; e < 128; e++)
							if (all || e == 17)
								q[sick[k] * 128 + e] = bad[b];
					int rc = kvc_attend_kvd(c, layer, &s, 1, q, o, l);

					fail_if_dead("after a non-finite query");
					if (rc)
						fail_msg("%s layer %u: value %g (all %d): %s", m.name, layer,
							 (double)bad[b], all, kvc_last_error(c));
					calls++;
					for (int h = 0; exact && h < 8; h++) {
						if (h == sick[0] || h == sick[1])
							continue;
						if (memcmp(o + h * 128, o0 + h * 128, 128 * sizeof(float)) ||
						    memcmp(&l[h], &l0[h], sizeof(float)))
							fail_msg("%s layer %u: value %g (all %d) changed clean "
								 "head %d", m.name, layer, (double)bad[b], all, h);
					}
				}
			}
			assert_int_equal(kvc_attend_kvd(c, layer, &s, 1, w.q, o, l), 0);
			if (exact) {
				assert_memory_equal(o, o0, sizeof o);
				assert_memory_equal(l, l0, sizeof l);
			}
			for (int i = 0; i < 8 * 128; i++)
				if (!isfinite(o[i]))
					fail_msg("%s layer %u: a clean query after the poison: o[%d] = %g",
						 m.name, layer, i, (double)o[i]);
			for (int h = 0; h < 8; h++)
				assert_true(isfinite(l[h]));
		}
		assert_int_equal(kvc_seq_free(c, s), 0);
		kvc_close(c);
		kvd_synth_free(&w);
	}
	print_message("  %d poisoned queries over %zu profiles, clean heads unchanged\n", calls,
		      sizeof pr / sizeof pr[0]);
	fail_if_dead("after the non-finite queries");
	close(go_w);
	expect_kid_ok(honest, 120, "honest client");
	close(ready_r);
}

/* ==== a control client that never reads ================================ */

/* A client pipelines ServerStats and never reads an answer.  Once its
 * socket holds all it can, kvd's reply to it fails (sent after the state
 * lock, kvd_ctl_defer) and kvd drops it, counted as a disconnect; kvd goes
 * on answering others. */
static void test_reader_never_reads(void **state)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__ServerStats st;
	struct raw a, b;
	uint64_t sent = 0, until = mono_ns() + 30ull * 1000000000;
	int gone = 0;

	assert_int_equal(raw_open(&a, D.sock, 1), 0);
	assert_int_equal(raw_hello(&a, "hostile", "deaf", 1, 1 << 16), 0);
	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	while (!gone && mono_ns() < until) {
		struct pollfd pf = { .fd = a.fd, .events = POLLOUT };
		int rc;

		rq.id = ++sent;
		rc = kvd_ctl_send(a.fd, &rq.base, NULL, 0);
		if (rc == -EAGAIN) {
			sent--;
			/* kvd reads no faster than it answers */
			if (poll(&pf, 1, 10) > 0 && (pf.revents & (POLLHUP | POLLERR)))
				gone = 1;
			continue;
		}
		if (rc == -EPIPE || rc == -ECONNRESET)
			gone = 1;
		else
			assert_int_equal(rc, 0);
	}
	print_message("  %llu requests sent, none read: %s\n", (unsigned long long)sent,
		      gone ? "kvd hung up" : "still connected");
	raw_close(&a);
	fail_if_dead("after a client that never read");
	if (!gone)
		fail_msg("kvd kept a client that never read its %llu answers for 30 s",
			 (unsigned long long)sent);
	/* The others are still answered (waiting, at most, for the uid's
	 * control budget the deaf one spent), and the drop was counted. */
	assert_int_equal(raw_open(&b, D.sock, 0), 0);
	assert_int_equal(raw_hello(&b, "hostile", "obs", 1, 1 << 16), 0);
	assert_int_equal(raw_stats(&b, &st), 0);
	assert_true(st.disconnects >= 1);
	raw_close(&b);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_attend_ids_rewritten, start_plain, stop),
		cmocka_unit_test_setup_teardown(test_loop_not_stalled, start_plain, stop),
		cmocka_unit_test_setup_teardown(test_reader_never_reads, start_plain, stop),
		cmocka_unit_test_setup_teardown(test_nonfinite_queries, start_plain, stop),
		cmocka_unit_test_setup_teardown(test_seq_create_budget, start_seq_budget, stop),
		cmocka_unit_test_setup_teardown(test_profiles_per_uid, start_profiles, stop),
		cmocka_unit_test_setup_teardown(test_profile_namespace, start_open, stop),
		cmocka_unit_test_setup_teardown(test_connections_per_uid, start_conns, stop),
		cmocka_unit_test_teardown(test_emfile_no_spin, stop),
		cmocka_unit_test_setup_teardown(test_prefill_staging_budget, start_mem64, stop),
		cmocka_unit_test_setup_teardown(test_shm_per_uid, start_shm, stop),
		cmocka_unit_test_setup_teardown(test_uid_fair_share, start_open, stop),
		cmocka_unit_test_setup_teardown(test_big_profiles_no_stall, start_plain, stop),
		cmocka_unit_test_setup_teardown(test_control_cpu_per_uid, start_ctl_cpu, stop),
		cmocka_unit_test_setup_teardown(test_share_per_uid, start_share, stop),
	};

	kid_msg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (kid_msg == MAP_FAILED)
		return 1;
	signal(SIGPIPE, SIG_IGN);
	if (getenv("KVD_TEST_FILTER"))
		cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
