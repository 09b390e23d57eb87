/* kvbench stall: how long one uid's big operations hold up a quiet
 * neighbour.  A victim process ATTENDs one layer of its own small sequence
 * back to back; meanwhile an attacker, in turn:
 *
 *   quiet          nothing
 *   busy           spins on the CPU in its own process, never calling kvd: on a
 *                  machine with few cores, what any CPU-bound neighbour costs
 *                  the victim through the scheduler alone (the control for
 *                  the phases below, whose attacker also hashes on the CPU)
 *   append         decodes into every layer of a big sequence (APPENDs of
 *                  32 rows, a seal of seal_tokens rows every so often)
 *   fork           forks the big sequence and frees the child, over and over
 *                  (the child shares every layer's open tail: it copied
 *                  them all under the state lock before they were
 *                  copy-on-write)
 *   evict_restore  writes the big sequence out and reads it back, over and
 *                  over (the write-back's copies, the restore's installs)
 *   big_append     one APPEND of 59904 rows (2 kv heads, L 150: 97 MB in one
 *                  ring entry) into a fresh sequence, freed after, over and
 *                  over (the row copy and 59 seals inside one unit)
 *   big_tail       the same APPEND in a profile that seals at 65536, so the
 *                  rows stay one open tail of 97 MB, written out, read back
 *                  and freed, over and over (the tail's copies at the
 *                  APPEND and at the restore)
 *   churn_control  six processes connect and close, over and over, to a
 *                  socket of their own that a seventh accepts and closes: what
 *                  such a neighbour costs the victim through the scheduler
 *                  alone (the control for the next phase)
 *   churn          the same against kvd's socket, without a Hello
 *   control_spam   six processes, each with its own connection, ask for
 *                  ServerStats and SeqStats back to back
 *
 *   kvbench stall [--json] [--ctx N] [--layers N] [--secs N] [--phases a,b,...]
 *                 [--kvd-nice N] [--victim-nice N]
 *
 * --phases runs only the phases named (quiet always runs first: it is what
 * the others are measured against).  kvd runs at --kvd-nice, -10 by
 * default as systemd/kvd.service starts it; the victim at --victim-nice, 0
 * by default, as the attacker: a decoder its operator did not favour.
 *
 * The victim waits 1 ms between ATTENDs (a decode step's other work), so it
 * is a quiet client, not one that keeps kvd busy itself.  One row per
 * phase: the victim's ATTEND latency (p50, p99, max, ms) and
 * its p99 and max against the quiet phase of the same run.  kvd runs with
 * 2 executor threads and a spill directory under /var/tmp.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "proto/kvd_ring.h"
#include "gpu-client/kvt.h"
#include "engine/rng.h"

#define MAXLAT 400000
enum { PH_QUIET, PH_BUSY, PH_APPEND, PH_FORK, PH_EVICT, PH_BIG, PH_TAIL, PH_CHURN0, PH_CHURN,
       PH_SPAM, NPH, PH_END = NPH };
static const char *const ph_name[NPH] = { "quiet", "busy", "append", "fork", "evict_restore",
					  "big_append", "big_tail", "churn_control", "churn",
					  "control_spam" };
#define NKIDS 6
#define BIG_ROWS 59904

struct shared {
	volatile int phase;             /* what the attacker does now; PH_END: stop */
	volatile int ready;             /* the victim has its sequence */
	volatile int failed;
	uint32_t n[NPH];
	float ms[NPH][MAXLAT];
};

static const uint32_t dense0[] = { 0 };

/* The comma-separated phase names in `list` into run[]: 0, or -1 for a
 * name that is no phase. */
static int pick_phases(const char *list, int *run)
{
	for (int ph = 1; ph < NPH; ph++)
		run[ph] = 0;
	for (const char *p = list; *p;) {
		size_t n = strcspn(p, ",");
		int ph = 0;

		while (ph < NPH && (strlen(ph_name[ph]) != n || strncmp(p, ph_name[ph], n)))
			ph++;
		if (ph == NPH)
			return -1;
		run[ph] = 1;
		p += n + (p[n] == ',');
	}
	return 0;
}

static int usage(void)
{
	fprintf(stderr, "usage: kvbench stall [--json] [--ctx N] [--layers N] [--secs N] "
			"[--phases a,b,...] [--kvd-nice N] [--victim-nice N]\n"
			"  defaults: 16384 tokens, 8 layers, 3 s a phase, every phase, kvd at "
			"nice -10, the victim at 0\n");
	return 2;
}

static struct kvc *connect_model(const char *sock, const char *tenant, const struct kvc_model *m)
{
	struct kvc_opts o = { .socket_path = sock, .tenant = tenant, .name = m->name,
			      .slots = 8, .slot_size = 4 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c) || kvc_profile(c, m)) {
		fprintf(stderr, "stall: %s: %s\n", m->name, kvc_last_error(c));
		return NULL;
	}
	return c;
}

static int prefill(struct kvc *c, struct kvc_seq *s, const struct kvc_model *m, uint32_t n,
		   uint64_t seed)
{
	struct kvd_rng r = kvd_rng_make(seed);
	size_t sz = (size_t)m->kv_heads * n * m->head_dim;
	float *k = malloc(sz * 4), *v = malloc(sz * 4);
	int rc = 0;

	if (!k || !v)
		rc = -ENOMEM;
	for (uint32_t l = 0; l < m->layers && !rc; l++) {
		for (size_t i = 0; i < sz; i++) {
			k[i] = (float)(kvd_rng_uniform(&r) * 2 - 1);
			v[i] = (float)(kvd_rng_uniform(&r) * 2 - 1);
		}
		rc = kvc_prefill(c, s, l, k, v, n);
	}
	free(k);
	free(v);
	return rc;
}

/* A niceness, -20..19, into *dst: 0, or -1. */
static int parse_nice(const char *s, int *dst)
{
	char *end;
	long v = strtol(s, &end, 10);

	if (end == s || *end || v < -20 || v > 19)
		return -1;
	*dst = (int)v;
	return 0;
}

static void victim(const char *sock, struct shared *sh, int nice)
{
	static const struct kvc_model m = {
		.name = "stall-victim", .layers = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
		.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .dense_layers = dense0,
		.n_dense = 1, .seed = 5,
	};
	struct kvc *c = NULL;
	struct kvc_seq *s;
	float q[8 * 128], o[8 * 128], lse[8];
	struct kvd_rng r = kvd_rng_make(6);

	if (nice && setpriority(PRIO_PROCESS, 0, nice))
		perror("stall: victim: setpriority");
	else
		c = connect_model(sock, "victim", &m);
	if (!c || kvc_seq_create(c, &s) || prefill(c, s, &m, 4096, 7)) {
		sh->failed = 1;
		_exit(1);
	}
	for (size_t i = 0; i < 8 * 128; i++)
		q[i] = (float)(kvd_rng_uniform(&r) * 2 - 1);
	sh->ready = 1;
	for (int ph; (ph = sh->phase) != PH_END;) {
		double t0 = bench_now_ms();

		if (kvc_attend_kvd(c, 1, &s, 1, q, o, lse)) {
			fprintf(stderr, "stall: victim: %s\n", kvc_last_error(c));
			sh->failed = 1;
			_exit(1);
		}
		if (ph == sh->phase && sh->n[ph] < MAXLAT)
			sh->ms[ph][sh->n[ph]++] = (float)(bench_now_ms() - t0);
		/* A decode step's other work: the victim is quiet, not a
		 * neighbour that saturates kvd itself. */
		usleep(1000);
	}
	_exit(0);
}

static int cmpf(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;

	return (x > y) - (x < y);
}

static float pct(float *x, uint32_t n, double p)
{
	return n ? x[(size_t)(p * (n - 1))] : 0;
}

static int wait_tstate(struct kvt *t, uint64_t id, uint32_t state)
{
	struct kvc_seq_stats st;

	for (int i = 0; i < 60000; i++) {
		if (kvt_seq_stats(t, id, &st))
			return -1;
		if (st.state == state)
			return 0;
		usleep(500);
	}
	return -1;
}

static int wait_state(struct kvc *c, struct kvc_seq *s, uint32_t state)
{
	struct kvc_seq_stats st;

	for (int i = 0; i < 60000; i++) {
		if (kvc_seq_stats(c, s, &st))
			return -1;
		if (st.state == state)
			return 0;
		usleep(500);
	}
	return -1;
}

/* The big APPEND's connection: a profile of 2 kv heads whose one slot
 * holds BIG_ROWS rows, the slot filled once. */
static const struct kvc_model big_model = {
	.name = "stall-big", .layers = 1, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 150, .c = 2, .sink = 4, .window = 64, .seed = 12,
};
static const struct kvc_model tail_model = {
	.name = "stall-tail", .layers = 1, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 150, .c = 2, .sink = 4, .window = 64, .seed = 12,
	.segment_tokens = 65536, .seal_tokens = 65536,
};

static struct kvt *big_connect(const char *sock, const struct kvc_model *model)
{
	const struct kvd_rows_layout lay = kvd_rows_layout(2, 128, 150, BIG_ROWS, 1);
	struct kvc_opts o = { .socket_path = sock, .tenant = "attacker", .name = model->name,
			      .slots = 2, .slot_size = (lay.bytes + 4095) & ~4095ull };
	struct kvt *t = kvt_new();
	struct kvd_rng r = kvd_rng_make(13);

	if (!t || kvt_connect(t, &o) || kvt_profile(t, model)) {
		fprintf(stderr, "stall: big: %s\n", t ? kvt_error(t) : "out of memory");
		kvt_close(t);
		return NULL;
	}
	/* mean 0, random rows and codes: what matters is their size */
	char *b = kvt_slot(t, 0);
	uint16_t *rows = (uint16_t *)(b + lay.k), *codes = (uint16_t *)(b + lay.codes);

	memset(b, 0, lay.k);
	for (size_t i = 0; i < (size_t)2 * 2 * BIG_ROWS * 128; i++)
		rows[i] = (uint16_t)(0x3c00 + kvd_rng_below(&r, 0x800));
	for (size_t i = 0; i < (size_t)2 * 150 * BIG_ROWS; i++)
		codes[i] = (uint16_t)kvd_rng_below(&r, 1024);
	return t;
}

/* A fresh sequence: one prefilled row (the mean, LAST), then BIG_ROWS rows
 * in one APPEND; freed unless keep gets its id.  0, or -1. */
static int big_append(struct kvt *t, uint64_t *keep)
{
	const struct kvd_rows_layout one = kvd_rows_layout(2, 128, 150, 1, 1);
	const struct kvd_rows_layout lay = kvd_rows_layout(2, 128, 150, BIG_ROWS, 0);
	const struct kvd_rows_layout with_mean = kvd_rows_layout(2, 128, 150, BIG_ROWS, 1);
	uint64_t id;
	int32_t res = 0;
	const char *msg = "";
	int a = kvt_slot_get(t, 0), b = kvt_slot_get(t, 0), rc = -1;

	/* Both slots held: slot 0 keeps the rows written at connect (after
	 * their mean), the other takes the one-row prefill. */
	if (a < 0 || b < 0 || kvt_seq_create(t, &id))
		goto out;
	uint32_t pf = a == 0 ? (uint32_t)b : (uint32_t)a;

	memset(kvt_slot(t, pf), 0, one.bytes);
	struct kvd_sqe p = { .op = KVD_OP_PREFILL, .flags = KVD_RF_MEAN | KVD_RF_LAST, .slot = pf,
			     .user_data = pf, .seq = id, .len = (uint32_t)one.bytes, .ntok = 1 };
	struct kvd_sqe e = { .op = KVD_OP_APPEND, .slot = 0, .user_data = 0, .seq = id,
			     .off = (uint32_t)with_mean.k, .len = (uint32_t)lay.bytes,
			     .ntok = BIG_ROWS };

	if (kvt_submit(t, &p) || kvt_wait_slot(t, pf, &res, &msg) || res ||
	    kvt_submit(t, &e) || kvt_wait_slot(t, 0, &res, &msg) || res) {
		fprintf(stderr, "stall: big APPEND: %d %s\n", res, res ? msg : kvt_error(t));
		goto out;
	}
	if (keep) {
		*keep = id;
		rc = 0;
	} else {
		rc = kvt_seq_free(t, id) ? -1 : 0;
	}
out:
	if (a >= 0)
		kvt_slot_put(t, (uint32_t)a);
	if (b >= 0)
		kvt_slot_put(t, (uint32_t)b);
	return rc;
}

/* One of NKIDS processes of the churn and control_spam phases, until
 * `until` (bench_now_ms): never returns.  Run as root, they are another
 * uid (65534), as a hostile tenant would be: root is the admin, and its
 * control budget is not a tenant's. */
static void kid(int ph, const char *sock, double until)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct kvc_opts o = { .socket_path = sock, .tenant = "attacker", .name = "stall-spam" };
	struct kvc *c = NULL;
	struct kvc_seq *s = NULL;
	struct kvc_stats st;
	struct kvc_seq_stats ss;

	if (strlen(sock) >= sizeof a.sun_path)
		_exit(1);
	memcpy(a.sun_path, sock, strlen(sock) + 1);
	if (geteuid() == 0 && (setgroups(0, NULL) || setgid(65534) || setuid(65534)))
		_exit(1);
	/* Refused past the uid's control budget, as the point is: again. */
	while (ph == PH_SPAM && (kvc_connect(&o, &c) || kvc_profile(c, &big_model) ||
				 kvc_seq_create(c, &s))) {
		kvc_close(c);
		c = NULL;
		if (bench_now_ms() >= until)
			_exit(0);
		usleep(1000);
	}
	while (bench_now_ms() < until) {
		if (ph == PH_CHURN || ph == PH_CHURN0) {
			int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

			if (fd >= 0) {
				(void)connect(fd, (const struct sockaddr *)&a, sizeof a);
				close(fd);
			}
		} else {
			/* refusals past the uid's control budget are the point */
			(void)kvc_server_stats(c, &st);
			(void)kvc_seq_stats(c, s, &ss);
		}
	}
	_exit(0);
}

/* churn_control's listener at `path`, until `until`: accepts, writes a
 * few bytes (kvd's refusal is a short error) and closes.  Its pid, or -1. */
static pid_t acceptor(const char *path, double until)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	pid_t pid;

	if (strlen(path) >= sizeof a.sun_path)
		return -1;
	memcpy(a.sun_path, path, strlen(path) + 1);
	unlink(path);
	if (lfd < 0 || bind(lfd, (const struct sockaddr *)&a, sizeof a) || listen(lfd, 128) ||
	    chmod(path, 0777)) {
		if (lfd >= 0)
			close(lfd);
		return -1;
	}
	if ((pid = fork()) == 0) {
		static const char no[32] = "refused";

		while (bench_now_ms() < until) {
			int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

			if (fd < 0) {
				usleep(100);
				continue;
			}
			(void)!write(fd, no, sizeof no);
			close(fd);
		}
		_exit(0);
	}
	close(lfd);
	return pid;
}

static int kids(int ph, const char *dir, const char *sock, double secs)
{
	double until = bench_now_ms() + secs * 1e3;
	pid_t pid[NKIDS], acc = -1;
	char own[200];
	int rc = 0;

	/* Other uids must reach the socket. */
	if (geteuid() == 0 && (chmod(dir, 0755) || chmod(sock, 0777)))
		return -1;
	if (ph == PH_CHURN0) {
		snprintf(own, sizeof own, "%s/churn.sock", dir);
		if ((acc = acceptor(own, until)) < 0)
			return -1;
		sock = own;
	}

	for (int i = 0; i < NKIDS; i++)
		if ((pid[i] = fork()) == 0)
			kid(ph, sock, until);
	for (int i = 0; i < NKIDS; i++) {
		int st;

		if (pid[i] < 0 || waitpid(pid[i], &st, 0) != pid[i] || !WIFEXITED(st) ||
		    WEXITSTATUS(st))
			rc = -1;
	}
	if (acc > 0)
		waitpid(acc, NULL, 0);
	return rc;
}

/* One phase of the attacker, for secs seconds: 0, or -1. */
static int attack(int ph, const char *dir, const char *sock, struct kvc *c, struct kvc_seq *s,
		  const struct kvc_model *m, struct kvt *big, struct kvt *tail, double secs,
		  struct kvd_rng *r)
{
	double until = bench_now_ms() + secs * 1e3;
	float kt[8 * 128], vt[8 * 128];

	if (ph == PH_CHURN0 || ph == PH_CHURN || ph == PH_SPAM)
		return kids(ph, dir, sock, secs);

	while (bench_now_ms() < until) {
		switch (ph) {
		case PH_QUIET:
			usleep(10000);
			break;
		case PH_BUSY:
			for (volatile uint64_t x = 0; x < 1000000; x++) {
			}
			break;
		case PH_APPEND:
			for (uint32_t l = 0; l < m->layers; l++) {
				for (size_t i = 0; i < (size_t)m->kv_heads * m->head_dim; i++) {
					kt[i] = (float)(kvd_rng_uniform(r) * 2 - 1);
					vt[i] = (float)(kvd_rng_uniform(r) * 2 - 1);
				}
				if (kvc_append(c, s, l, kt, vt))
					return -1;
			}
			break;
		case PH_FORK: {
			struct kvc_seq *ch;

			if (kvc_seq_fork(c, s, &ch) || kvc_seq_free(c, ch))
				return -1;
			break;
		}
		case PH_EVICT:
			if (kvc_seq_evict(c, s) || wait_state(c, s, KVC_SEQ_DISK) ||
			    kvc_prefetch(c, s) || wait_state(c, s, KVC_SEQ_RAM))
				return -1;
			break;
		case PH_BIG:
			if (big_append(big, NULL))
				return -1;
			break;
		case PH_TAIL: {
			uint64_t id;

			if (big_append(tail, &id) || kvt_seq_evict(tail, id) ||
			    wait_tstate(tail, id, KVC_SEQ_DISK) || kvt_prefetch(tail, id) ||
			    wait_tstate(tail, id, KVC_SEQ_RAM) || kvt_seq_free(tail, id))
				return -1;
			break;
		}
		}
	}
	return 0;
}

int bench_stall_main(int argc, char **argv)
{
	uint32_t ctx = 16384, layers = 8, secs = 3;
	int json = 0, rc = 1, run[NPH], kvd_nice = -10, victim_nice = 0;

	for (int ph = 0; ph < NPH; ph++)
		run[ph] = 1;
	for (int i = 0; i < argc; i++) {
		if (!strcmp(argv[i], "--phases") && i + 1 < argc) {
			if (pick_phases(argv[++i], run))
				return usage();
			continue;
		}
		if ((!strcmp(argv[i], "--kvd-nice") || !strcmp(argv[i], "--victim-nice")) &&
		    i + 1 < argc) {
			if (parse_nice(argv[i + 1], argv[i][2] == 'k' ? &kvd_nice : &victim_nice))
				return usage();
			i++;
			continue;
		}
		uint32_t *dst = !strcmp(argv[i], "--ctx") ? &ctx : !strcmp(argv[i], "--layers") ? &layers :
				!strcmp(argv[i], "--secs") ? &secs : NULL;

		if (!strcmp(argv[i], "--json"))
			json = 1;
		else if (!dst || i + 1 == argc || bench_parse_u32(argv[++i], dst) || !*dst)
			return usage();
	}
	if (layers < 2 || layers > 64)
		return usage();

	struct daemon d;
	char spill[160];

	if (daemon_mkdir(&d, "/var/tmp/kvbench-stall.XXXXXX"))
		return 1;
	d.nice = kvd_nice;
	snprintf(spill, sizeof spill, "%s/spill", d.dir);
	const char *args[] = { "--socket", d.sock, "--threads", "2", "--spill-dir", spill,
			       "--log-level", "warning", "--metrics-listen", "", NULL };

	if (daemon_spawn(&d, "kvd", args)) {
		fprintf(stderr, "stall: kvd did not start\n");
		return 1;
	}
	struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
				 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	pid_t vp = -1;

	if (sh == MAP_FAILED)
		goto out;
	memset(sh, 0, sizeof *sh);
	sh->phase = PH_QUIET;

	const struct kvc_model m = {
		.name = "stall-attacker", .layers = layers, .q_heads = 32, .kv_heads = 8,
		.head_dim = 128, .K = 10, .L = 150, .c = 2, .sink = 4, .window = 64,
		.dense_layers = dense0, .n_dense = 1, .seed = 9,
	};
	struct kvc *c = connect_model(d.sock, "attacker", &m);
	struct kvt *big = big_connect(d.sock, &big_model), *tail = big_connect(d.sock, &tail_model);
	struct kvc_seq *s;
	struct kvd_rng r = kvd_rng_make(10);

	if (!c || !big || !tail || kvc_seq_create(c, &s) || prefill(c, s, &m, ctx, 11)) {
		fprintf(stderr, "stall: attacker: %s\n", c ? kvc_last_error(c) : "connect");
		goto out;
	}
	/* An open tail in every layer: what a fork copies and a write-back
	 * writes from a copy. */
	if (attack(PH_APPEND, d.dir, d.sock, c, s, &m, big, tail, 1.0, &r))
		goto out;
	if ((vp = fork()) == 0)
		victim(d.sock, sh, victim_nice);
	while (!sh->ready && !sh->failed)
		usleep(1000);
	for (int ph = 0; ph < NPH && !sh->failed; ph++) {
		if (!run[ph])
			continue;
		sh->phase = ph;
		if (attack(ph, d.dir, d.sock, c, s, &m, big, tail, secs, &r)) {
			fprintf(stderr, "stall: %s: %s\n", ph_name[ph], kvc_last_error(c));
			goto out;
		}
	}
	sh->phase = PH_END;
	waitpid(vp, NULL, 0);
	vp = -1;
	if (sh->failed)
		goto out;

	float q99 = 0, qmax = 0;

	if (!json)
		printf("  %-14s %8s %9s %9s %9s %9s %9s\n", "phase", "attends", "p50_ms", "p99_ms",
		       "max_ms", "p99_x", "max_x");
	for (int ph = 0; ph < NPH; ph++) {
		if (!run[ph])
			continue;
		uint32_t n = sh->n[ph];
		float *x = sh->ms[ph];

		qsort(x, n, sizeof *x, cmpf);
		float p50 = pct(x, n, 0.5), p99 = pct(x, n, 0.99), mx = n ? x[n - 1] : 0;

		if (ph == PH_QUIET)
			q99 = p99, qmax = mx;
		if (json)
			printf("{\"bench\":\"stall\",\"phase\":\"%s\",\"ctx\":%u,\"layers\":%u,"
			       "\"kvd_nice\":%d,\"victim_nice\":%d,\"attends\":%u,\"p50_ms\":%.3f,"
			       "\"p99_ms\":%.3f,\"max_ms\":%.3f,\"p99_vs_quiet\":%.2f,"
			       "\"max_vs_quiet\":%.2f}\n",
			       ph_name[ph], ctx, layers, kvd_nice, victim_nice, n, p50, p99, mx,
			       q99 > 0 ? p99 / q99 : 0, qmax > 0 ? mx / qmax : 0);
		else
			printf("  %-14s %8u %9.3f %9.3f %9.3f %9.2f %9.2f\n", ph_name[ph], n, p50, p99,
			       mx, q99 > 0 ? p99 / q99 : 0, qmax > 0 ? mx / qmax : 0);
	}
	rc = 0;
out:
	if (sh != MAP_FAILED) {
		sh->phase = PH_END;
		if (vp > 0) {
			kill(vp, SIGKILL);
			waitpid(vp, NULL, 0);
		}
		munmap(sh, sizeof *sh);
	}
	daemon_stop(&d);
	daemon_rm_tree(spill);
	return rc;
}
