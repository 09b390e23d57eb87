/* Published snapshots under memory pressure, and kvctl's view of them,
 * through the real daemon with a hostile uid in a child process.
 *
 *   test_snap_give_way      a second uid (a real process) publishes prefixes
 *                           until kvd's memory (no spill tier, 32 MiB) is full
 *                           and leaves; uid 0's PREFILL that needs the room
 *                           then succeeds (the snapshots gave way, least
 *                           recently used first: uid 0's own published prefix
 *                           among them), and a sequence uid 0 attached from
 *                           that prefix before still answers bit for bit
 *   test_snap_per_uid       under memory_per_uid the uid's own snapshots give
 *                           way to its next sequences: it publishes far more
 *                           than its share, every PREFILL and publish succeeds
 *   test_snap_kvctl         kvctl shares lists the snapshots (every uid's for
 *                           root, its own for another uid); share drop KEY is
 *                           refused to that uid (EPERM), works for root, and
 *                           a sequence attached from the dropped prefix
 *                           answers bit for bit; dropping it again is ENOENT
 *
 * Forked children never use cmocka's asserts: they report through a shared
 * message and the parent fails. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <grp.h>
#include <math.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "daemon.h"
#include "gpu-client/kvc.h"
#include "engine/rng.h"
#include "testutil.h"

#define LAYERS  2
#define HQ      4
#define HKV     2
#define D       128
#define CHUNK   256             /* the profile's default: seal_tokens 256 */
#define P_TOK   1024            /* a prefix: 4 chunks, about 2.2 MiB in kvd */
#define MEM_MB  32              /* --mem-limit */
#define N_PUB   20              /* the attacker's prefixes: about 44 MiB of them */
#define UID_B   65534

static const struct kvc_model model = {
	.name = "snap", .layers = LAYERS, .q_heads = HQ, .kv_heads = HKV, .head_dim = D,
	.K = 8, .L = 16, .c = 2, .sink = 4, .window = 16, .seed = 5,
	.segment_tokens = 1024, .seal_tokens = 256,
};

static struct daemon D_;

/* No spill directory: nothing can go to disk, only the cache can give way. */
static int start(void **state)
{
	if (daemon_start4(&D_, "--mem-limit", "32M", NULL, NULL))
		return -1;
	chmod(D_.dir, 0755);            /* other uids must reach the socket */
	chmod(D_.sock, 0777);
	return 0;
}

/* The same with [limits] memory_per_uid = 12M: about five prefixes a uid. */
static char cfg[128];

static int start_per_uid(void **state)
{
	FILE *f;

	snprintf(cfg, sizeof cfg, "/tmp/kvd-snap.%d.conf", (int)getpid());
	if (!(f = fopen(cfg, "w")))
		return -1;
	fprintf(f, "[limits]\nmemory_per_uid = 12M\n");
	fclose(f);
	if (daemon_start4(&D_, "--config", cfg, "--mem-limit", "32M"))
		return -1;
	chmod(D_.dir, 0755);
	chmod(D_.sock, 0777);
	return 0;
}

static int stop(void **state)
{
	int rc = D_.pid > 0 ? daemon_stop(&D_) : -1;

	if (cfg[0]) {
		unlink(cfg);
		cfg[0] = 0;
	}

	if (rc)
		print_error("daemon_stop: %d (want 0: a clean drain)\n", rc);
	return rc == 0 ? 0 : -1;
}

/* ---- data ----------------------------------------------------------------- */

/* Prefix `seed`: its token ids and rows (every layer), and a query. */
struct src {
	uint32_t tok[P_TOK];
	float k[LAYERS][HKV * P_TOK * D], v[LAYERS][HKV * P_TOK * D];
	float q[HQ * D];
};

static struct src *src_make(uint64_t seed)
{
	struct src *s = xmalloc(sizeof *s);
	struct kvd_rng r = kvd_rng_make(seed);

	for (uint32_t i = 0; i < P_TOK; i++)
		s->tok[i] = (uint32_t)(seed * 1000003u + i * 7919u);
	for (uint32_t l = 0; l < LAYERS; l++) {
		fill_normal(s->k[l], HKV * P_TOK * D, &r, 0.5, 1);
		fill_normal(s->v[l], HKV * P_TOK * D, &r, 0, 1);
	}
	fill_normal(s->q, HQ * D, &r, 0, 1);
	return s;
}

static struct kvc *kconnect(const char *name)
{
	struct kvc_opts o = { .socket_path = D_.sock, .tenant = "t", .name = name, .slots = 8,
			      .slot_size = 1 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c) || kvc_profile(c, &model))
		return kvc_close(c), NULL;
	return c;
}

/* A new sequence holding src's P_TOK tokens, published under its last key
 * (keys: P_TOK / CHUNK of them).  0 or the failing call's code. */
static int publish(struct kvc *c, const struct src *s, uint8_t *keys, struct kvc_seq **out)
{
	struct kvc_seq *q;
	int rc;

	if (kvc_content_keys(c, s->tok, P_TOK, keys) != P_TOK / CHUNK)
		return -EINVAL;
	if ((rc = kvc_seq_create(c, &q)))
		return rc;
	for (uint32_t l = 0; l < LAYERS && !rc; l++)
		rc = kvc_extend(c, q, l, s->k[l], s->v[l], P_TOK);
	if (!rc)
		rc = kvc_seq_publish(c, q, keys + (P_TOK / CHUNK - 1) * KVC_KEY_BYTES);
	if (rc || !out)
		kvc_seq_free(c, q);
	else
		*out = q;
	return rc;
}

struct ans {
	float o[LAYERS][HQ * D], lse[LAYERS][HQ];
};

static void answer(struct kvc *c, struct kvc_seq *q, const struct src *s, struct ans *a)
{
	memset(a, 0, sizeof *a);
	for (uint32_t l = 0; l < LAYERS; l++)
		if (kvc_attend(c, l, &q, 1, s->q, a->o[l], a->lse[l]))
			fail_msg("attend: %s", kvc_last_error(c));
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < HQ; h++)
			if (!isfinite(a->lse[l][h]))
				fail_msg("attend: not finite");
}

static struct kvc_seq *attach(struct kvc *c, const uint8_t *keys, uint64_t want)
{
	struct kvc_seq *q;
	uint64_t got;

	if (kvc_seq_attach(c, keys, P_TOK / CHUNK, &q, &got))
		fail_msg("attach: %s", kvc_last_error(c));
	if (got != want)
		fail_msg("attach got %llu tokens, want %llu", (unsigned long long)got,
			 (unsigned long long)want);
	return q;
}

static struct kvc_stats stats(struct kvc *c)
{
	struct kvc_stats st;

	if (kvc_server_stats(c, &st))
		fail_msg("server stats: %s", kvc_last_error(c));
	return st;
}

/* ---- the other uid -------------------------------------------------------- */

/* In a child as UID_B: publishes prefixes of seeds [seed0, seed0 + n), each
 * from a sequence it frees at once, stopping at the first refusal (the old
 * kvd's full memory), then leaves.  *done: how many it published. */
static int attacker_main(uint64_t seed0, int n, int *done, char *msg)
{
	uint8_t keys[(P_TOK / CHUNK) * KVC_KEY_BYTES];
	struct kvc *c;

	if (setgroups(0, NULL) || setgid(UID_B) || setuid(UID_B)) {
		snprintf(msg, 512, "cannot become uid %u: %s", UID_B, strerror(errno));
		return 90;
	}
	if (!(c = kconnect("attacker"))) {
		snprintf(msg, 512, "uid %u cannot connect", UID_B);
		return 2;
	}
	for (*done = 0; *done < n; (*done)++) {
		struct src *s = src_make(seed0 + (uint64_t)*done);
		int rc = publish(c, s, keys, NULL);

		free(s);
		if (rc) {
			snprintf(msg, 512, "publish %d: %s", *done, kvc_last_error(c));
			break;
		}
	}
	kvc_close(c);
	return 0;
}

/* Runs attacker_main to its end; returns how many it published.  Skips
 * without root (no other uid). */
static int attack(uint64_t seed0, int n)
{
	char *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	int *done = (int *)shared, st, got;
	pid_t kid;

	assert_true(shared != MAP_FAILED);
	if (geteuid() != 0) {
		munmap(shared, 4096);
		print_message("  not root: no other uid to attack with\n");
		skip();
	}
	kid = fork();
	assert_true(kid >= 0);
	if (kid == 0)
		_exit(attacker_main(seed0, n, done, shared + 64));
	assert_int_equal(waitpid(kid, &st, 0), kid);
	if (!WIFEXITED(st))
		fail_msg("the attacker was killed by signal %d", WTERMSIG(st));
	if (WEXITSTATUS(st) == 90)
		skip();
	if (WEXITSTATUS(st))
		fail_msg("the attacker failed: %s", shared + 64);
	got = *done;
	if (shared[64])
		print_message("  attacker stopped: %s\n", shared + 64);
	munmap(shared, 4096);
	return got;
}

/* ---- the tests ------------------------------------------------------------ */

static void test_snap_give_way(void **state)
{
	uint8_t keys[(P_TOK / CHUNK) * KVC_KEY_BYTES];
	struct src *p = src_make(1), *v = src_make(2);
	struct kvc *a = kconnect("victim");
	struct kvc_seq *x, *y, *pub;
	struct kvc_stats st;
	struct ans before, after;
	int n;

	assert_non_null(a);
	/* uid 0's prefix, attached by a sequence of its: the snapshot is the
	 * least recently used of all once the attacker has published. */
	if (publish(a, p, keys, &pub))
		fail_msg("publish: %s", kvc_last_error(a));
	assert_int_equal(kvc_seq_free(a, pub), 0);
	x = attach(a, keys, P_TOK);
	answer(a, x, p, &before);

	n = attack(100, N_PUB);
	st = stats(a);
	print_message("  attacker published %d of %d; used %.1f of %d MiB\n", n, N_PUB,
		      (double)st.used_bytes / (1 << 20), MEM_MB);
	/* It filled the memory: at least as much as fits was published. */
	assert_true(n >= (MEM_MB / 3));
	assert_true(st.used_bytes > (uint64_t)MEM_MB * (1 << 20) / 4 * 3);

	/* A PREFILL that needs the room: the snapshots give way. */
	if (kvc_seq_create(a, &y))
		fail_msg("seq create under a full memory: %s", kvc_last_error(a));
	for (uint32_t l = 0; l < LAYERS; l++)
		if (kvc_extend(a, y, l, v->k[l], v->v[l], P_TOK))
			fail_msg("prefill of layer %u under a full memory: %s", l, kvc_last_error(a));
	/* The attached sequence kept every row of the prefix. */
	answer(a, x, p, &after);
	if (memcmp(&before, &after, sizeof before))
		fail_msg("the attached sequence answers differently after its prefix gave way");
	/* uid 0's own prefix was the least recently used: it went first. */
	{
		struct kvc_seq *m = attach(a, keys, 0);

		assert_int_equal(kvc_seq_free(a, m), 0);
	}
	assert_int_equal(kvc_seq_free(a, y), 0);
	assert_int_equal(kvc_seq_free(a, x), 0);
	kvc_close(a);
	free(p);
	free(v);
}

static void test_snap_per_uid(void **state)
{
	struct kvc *a = kconnect("root");
	struct kvc_stats st;
	int n;

	assert_non_null(a);
	n = attack(200, N_PUB / 2);
	st = stats(a);
	print_message("  uid %u published %d of %d under a 12 MiB share; used %.1f MiB\n", UID_B,
		      n, N_PUB / 2, (double)st.used_bytes / (1 << 20));
	assert_int_equal(n, N_PUB / 2);
	/* What it still holds is within its share. */
	assert_true(st.used_bytes < (16u << 20));
	kvc_close(a);
}

/* ---- kvctl ---------------------------------------------------------------- */

struct run {
	int status;
	char out[1 << 16], err[4096];
};

static struct run R;

static void read_back(int fd, char *buf, size_t cap)
{
	ssize_t n = pread(fd, buf, cap - 1, 0);

	buf[n > 0 ? n : 0] = 0;
	close(fd);
}

/* Runs <this test's dir>/../kvctl --socket <D_'s> ARGS... as uid (-1: as we
 * are) and fills R. */
static int kvctl_as(int uid, ...)
{
	char exe[PATH_MAX], bin[PATH_MAX + 16], outp[] = "/tmp/kvctl-out.XXXXXX",
	     errp[] = "/tmp/kvctl-err.XXXXXX";
	const char *argv[16] = { "kvctl", "--socket", D_.sock };
	int argc = 3, fo, fe, st;
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	va_list ap;
	pid_t pid;

	assert_true(n > 0);
	exe[n] = 0;
	*strrchr(exe, '/') = 0;
	snprintf(bin, sizeof bin, "%s/../kvctl", exe);
	va_start(ap, uid);
	for (const char *x; (x = va_arg(ap, const char *)) && argc < 15;)
		argv[argc++] = x;
	va_end(ap);
	argv[argc] = NULL;
	fo = mkstemp(outp);
	fe = mkstemp(errp);
	assert_true(fo >= 0 && fe >= 0);
	unlink(outp);
	unlink(errp);
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		dup2(fo, 1);
		dup2(fe, 2);
		if (uid >= 0 && (setgroups(0, NULL) || setgid((gid_t)uid) || setuid((uid_t)uid)))
			_exit(120);
		execv(bin, (char *const *)argv);
		_exit(121);
	}
	assert_int_equal(waitpid(pid, &st, 0), pid);
	R.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
	read_back(fo, R.out, sizeof R.out);
	read_back(fe, R.err, sizeof R.err);
	if (R.status == 120 || R.status == 121)
		fail_msg("could not run %s as uid %d (status %d)", bin, uid, R.status);
	return R.status;
}

#define kvctl(...) kvctl_as(-1, __VA_ARGS__, (const char *)NULL)
#define kvctl_b(...) kvctl_as(UID_B, __VA_ARGS__, (const char *)NULL)

static void expect(int want, const char *what)
{
	if (R.status != want)
		fail_msg("%s: exit %d, want %d\nstdout: %.2000s\nstderr: %.2000s", what, R.status,
			 want, R.out, R.err);
}

static int count_of(const char *s, const char *needle)
{
	int n = 0;

	for (const char *q = s; (q = strstr(q, needle)); q += strlen(needle))
		n++;
	return n;
}

static void hex_of(const uint8_t *key, char *hex)
{
	for (int i = 0; i < KVC_KEY_BYTES; i++)
		snprintf(hex + 2 * i, 3, "%02x", key[i]);
}

static void test_snap_kvctl(void **state)
{
	uint8_t k1[(P_TOK / CHUNK) * KVC_KEY_BYTES], k2[(P_TOK / CHUNK) * KVC_KEY_BYTES];
	uint8_t kb[(P_TOK / CHUNK) * KVC_KEY_BYTES];
	const uint8_t *last1 = k1 + (P_TOK / CHUNK - 1) * KVC_KEY_BYTES;
	char h1[2 * KVC_KEY_BYTES + 1], hb[2 * KVC_KEY_BYTES + 1], row[96];
	struct src *s1 = src_make(11), *s2 = src_make(12), *sb = src_make(100);
	struct kvc *a = kconnect("owner");
	struct kvc_seq *q, *x;
	struct ans before, after;

	assert_non_null(a);
	if (publish(a, s1, k1, &q) || kvc_seq_free(a, q) || publish(a, s2, k2, &q) ||
	    kvc_seq_free(a, q))
		fail_msg("publish: %s", kvc_last_error(a));
	/* One prefix of the other uid (the attacker's first seed). */
	assert_int_equal(attack(100, 1), 1);
	assert_int_equal(kvc_content_keys(a, sb->tok, P_TOK, kb), P_TOK / CHUNK);
	hex_of(last1, h1);
	hex_of(kb + (P_TOK / CHUNK - 1) * KVC_KEY_BYTES, hb);

	/* root sees all three, with the publisher and the size */
	kvctl("--json", "shares");
	expect(0, "root: shares");
	assert_int_equal(count_of(R.out, "\"key\":"), 3);
	snprintf(row, sizeof row, "\"key\":\"%s\",\"seq\":", hb);
	if (!strstr(R.out, row) || !strstr(R.out, "\"uid\":65534") ||
	    !strstr(R.out, "\"tokens\":1024"))
		fail_msg("root: shares: uid %u's prefix %s missing:\n%s", UID_B, hb, R.out);
	kvctl("shares");
	expect(0, "root: shares (text)");
	if (!strstr(R.out, h1) || !strstr(R.out, "FREEABLE"))
		fail_msg("root: shares (text):\n%s", R.out);
	/* the other uid sees its own only, and may not drop */
	kvctl_b("--json", "shares");
	expect(0, "uid B: shares");
	assert_int_equal(count_of(R.out, "\"key\":"), 1);
	if (!strstr(R.out, hb) || strstr(R.out, h1))
		fail_msg("uid B: shares shows another uid's prefix:\n%s", R.out);
	kvctl_b("share", "drop", hb);
	expect(1, "uid B: share drop");
	if (!strstr(R.err, "EPERM"))
		fail_msg("uid B: share drop: %s", R.err);
	kvctl("share", "drop", "0123");
	expect(2, "share drop of a short key");

	/* root drops uid 0's prefix while a sequence attached from it lives */
	x = attach(a, k1, P_TOK);
	answer(a, x, s1, &before);
	kvctl("share", "drop", h1);
	expect(0, "root: share drop");
	kvctl("--json", "shares");
	expect(0, "root: shares after the drop");
	assert_int_equal(count_of(R.out, "\"key\":"), 2);
	if (strstr(R.out, h1))
		fail_msg("the dropped prefix is still listed:\n%s", R.out);
	answer(a, x, s1, &after);
	if (memcmp(&before, &after, sizeof before))
		fail_msg("the attached sequence answers differently after its prefix was dropped");
	q = attach(a, k1, 0);           /* a miss now */
	assert_int_equal(kvc_seq_free(a, q), 0);
	kvctl("share", "drop", h1);
	expect(1, "root: share drop of a dropped prefix");
	if (!strstr(R.err, "ENOENT"))
		fail_msg("share drop again: %s", R.err);
	/* the other uid's goes too */
	kvctl("share", "drop", hb);
	expect(0, "root: share drop of uid B's");
	kvctl_b("--json", "shares");
	expect(0, "uid B: shares after the drop");
	assert_int_equal(count_of(R.out, "\"key\":"), 0);

	assert_int_equal(kvc_seq_free(a, x), 0);
	kvc_close(a);
	free(s1);
	free(s2);
	free(sb);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_snap_give_way, start, stop),
		cmocka_unit_test_setup_teardown(test_snap_per_uid, start_per_uid, stop),
		cmocka_unit_test_setup_teardown(test_snap_kvctl, start, stop),
	};

	signal(SIGPIPE, SIG_IGN);
	return cmocka_run_group_tests(tests, NULL, NULL);
}
