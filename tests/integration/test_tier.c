/* The memory budget and the spill tier, through the real daemon: a sequence
 * written out and read back answers ATTEND bit for bit as before (bf16 and
 * int8 profiles); a budget
 * smaller than the sessions evicts the coldest and brings them back; every
 * injected disk fault (fake I/O backend) keeps kvd serving and never gives
 * a wrong answer — data stays in RAM, or the request fails "sequence lost";
 * --persist finds sequences again after a clean stop and after kill -9; a
 * hybrid profile's per-layer estimator state goes to disk and comes back
 * with its sequence (a spilled, restored or restarted sequence answers its
 * next decode step bit for bit as a twin that never left RAM). */
#include <dirent.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "daemon.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "kvd/store/sfmt.h"
#include "engine/synth.h"
#include "testutil.h"

#define N_TOK   6000
#define LAYERS  3
#define APPENDS 100             /* decoded tokens after the prompt: a tail */

static const uint32_t dense_layers[] = { 0 };
static const struct kvc_model model = {
	.name = "tier", .layers = LAYERS, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .seed = 11, .segment_tokens = 4096, .seal_tokens = 256,
};

/* `model` with sealed segments stored int8 (spill files version 2, SEG
 * extents flagged int8). */
static const struct kvc_model model_int8 = {
	.name = "tier-int8", .layers = LAYERS, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .dense_layers = dense_layers,
	.n_dense = 1, .kv_dtype = KVC_KV_INT8, .seed = 11, .segment_tokens = 4096,
	.seal_tokens = 256,
};

static const struct kvc_model model_lcv = {
	.name = "tier-hybrid-lcv", .layers = LAYERS, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .estimator = KVC_EST_HYBRID_LCV,
	.dense_layers = dense_layers, .n_dense = 1, .seed = 11, .segment_tokens = 4096,
	.seal_tokens = 256,
};

static struct daemon D;
static char spill[128];

static struct kvc *client_of(const char *name, const struct kvc_model *m)
{
	struct kvc_opts o = { .socket_path = D.sock, .tenant = "t", .name = name,
			      .slots = 8, .slot_size = 1 << 20 };
	struct kvc *c;

	if (kvc_connect(&o, &c))
		fail_msg("connect: %s", kvc_last_error(c));
	if (kvc_profile(c, m))
		fail_msg("profile: %s", kvc_last_error(c));
	return c;
}

static struct kvc *client(const char *name)
{
	return client_of(name, &model);
}

/* A session: the prompt of every layer, then APPENDS decoded tokens, and
 * kvd's answer for each sparse layer recorded. */
struct session {
	struct kvc_seq *s;
	uint64_t id;
	struct kvd_synth w[LAYERS];
	float o[LAYERS][8 * 128], lse[LAYERS][8];
};

static int build(struct kvc *c, struct session *x, uint64_t seed)
{
	int rc;

	memset(x, 0, sizeof *x);
	if ((rc = kvc_seq_create(c, &x->s)))
		return rc;
	x->id = kvc_seq_id(x->s);
	for (uint32_t l = 0; l < LAYERS; l++) {
		uint32_t n0 = N_TOK - APPENDS;
		float *k0 = xmalloc((size_t)2 * n0 * 128 * 4), *v0 = xmalloc((size_t)2 * n0 * 128 * 4);

		assert_int_equal(kvd_synth_make(&x->w[l], (enum kvd_wl)(l % KVD_WL_COUNT), N_TOK, 8, 2,
						128, seed * 10 + l), 0);
		for (int h = 0; h < 2; h++) {
			memcpy(k0 + (size_t)h * n0 * 128, x->w[l].k + (size_t)h * N_TOK * 128,
			       (size_t)n0 * 128 * 4);
			memcpy(v0 + (size_t)h * n0 * 128, x->w[l].v + (size_t)h * N_TOK * 128,
			       (size_t)n0 * 128 * 4);
		}
		rc = kvc_prefill(c, x->s, l, k0, v0, n0);
		free(k0);
		free(v0);
		if (rc)
			return rc;
	}
	for (uint32_t t = N_TOK - APPENDS; t < N_TOK; t++) {
		for (uint32_t l = 0; l < LAYERS; l++) {
			float kt[2 * 128], vt[2 * 128];

			for (int h = 0; h < 2; h++) {
				memcpy(kt + h * 128, x->w[l].k + ((size_t)h * N_TOK + t) * 128, 512);
				memcpy(vt + h * 128, x->w[l].v + ((size_t)h * N_TOK + t) * 128, 512);
			}
			if ((rc = kvc_append(c, x->s, l, kt, vt)))
				return rc;
		}
	}
	return 0;
}

static int record(struct kvc *c, struct session *x)
{
	int rc;

	for (uint32_t l = 1; l < LAYERS; l++)
		if ((rc = kvc_attend_kvd(c, l, &x->s, 1, x->w[l].q, x->o[l], x->lse[l])))
			return rc;
	return 0;
}

/* kvd's answers now equal the recorded ones bit for bit: 0; else the
 * error of the first ATTEND that failed, or 1 when an answer differs. */
static int same(struct kvc *c, struct session *x)
{
	float o[8 * 128], lse[8];
	int rc;

	for (uint32_t l = 1; l < LAYERS; l++) {
		if ((rc = kvc_attend_kvd(c, l, &x->s, 1, x->w[l].q, o, lse)))
			return rc;
		if (memcmp(o, x->o[l], sizeof o) || memcmp(lse, x->lse[l], sizeof lse))
			return 1;
	}
	return 0;
}

static void drop_session(struct kvc *c, struct session *x)
{
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&x->w[l]);
	if (x->s)
		kvc_seq_free(c, x->s);
	x->s = NULL;
}

static struct kvc_seq_stats seq_stats(struct kvc *c, struct kvc_seq *s)
{
	struct kvc_seq_stats st;

	if (kvc_seq_stats(c, s, &st))
		fail_msg("seq stats: %s", kvc_last_error(c));
	return st;
}

static struct kvc_stats stats(struct kvc *c)
{
	struct kvc_stats st;

	if (kvc_server_stats(c, &st))
		fail_msg("stats: %s", kvc_last_error(c));
	return st;
}

/* Waits until the write kvc_seq_evict() started has ended either way. */
static struct kvc_seq_stats wait_spilled(struct kvc *c, struct kvc_seq *s)
{
	struct kvc_seq_stats st;

	for (int i = 0; i < 3000; i++) {
		st = seq_stats(c, s);
		if (st.state != KVC_SEQ_SPILLING)
			return st;
		daemon_sleep_ms(10);
	}
	fail_msg("spill did not end in 30 s");
	return st;
}

/* ATTEND of the last layer may answer before the restore's last result is
 * in (layers are served as they land): wait for the end. */
static struct kvc_seq_stats wait_restored(struct kvc *c, struct kvc_seq *s)
{
	struct kvc_seq_stats st;

	for (int i = 0; i < 3000 && (st = seq_stats(c, s)).state == KVC_SEQ_RESTORING; i++)
		daemon_sleep_ms(1);
	return st;
}

static unsigned count_files(const char *dir, const char *suffix)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	unsigned n = 0;

	if (!d)
		return 0;
	while ((e = readdir(d))) {
		size_t a = strlen(e->d_name), b = strlen(suffix);

		n += a > b && !strcmp(e->d_name + a - b, suffix);
	}
	closedir(d);
	return n;
}

/* kvd with the spill directory <test dir>/spill and up to two more flags. */
static int up(const char *a1, const char *a2)
{
	char tmpl[] = "/tmp/kvd-spill.XXXXXX";

	if (!spill[0]) {
		if (!mkdtemp(tmpl))
			return -1;
		snprintf(spill, sizeof spill, "%s", tmpl);
	}
	return daemon_start4(&D, "--spill-dir", spill, a1, a2);
}

static void clean_spill(void)
{
	daemon_rm_tree(spill);
	spill[0] = 0;
}

static int down(void **state)
{
	int rc = D.pid > 0 ? daemon_stop(&D) : 0;

	clean_spill();
	return rc == 0 ? 0 : -1;
}

/* ---- real io_uring ------------------------------------------------------ */

/* Started at nice -10 as the unit starts it: after a PREFILL's seals (bulk,
 * run at 0), a write-back and a restore, every thread of kvd is back at
 * -10 but the spill thread, at 5, and the prefault thread, at 10: neither
 * stuck at the bulk niceness nor, relative to -10, above the users. */
static void test_threads_nice(void **state)
{
	struct kvc *c;
	struct session x;
	char tmpl[] = "/tmp/kvd-spill.XXXXXX";
	int spill_nice, pf_nice, bulk_nice, lo, hi;

	if (geteuid() != 0)
		skip();         /* starting kvd at -10 takes CAP_SYS_NICE */
	assert_non_null(mkdtemp(tmpl));
	snprintf(spill, sizeof spill, "%s", tmpl);
	assert_int_equal(daemon_start_nice(&D, -10, "--spill-dir", spill, NULL, NULL), 0);
	c = client("nice");
	assert_int_equal(build(c, &x, 1), 0);
	assert_int_equal(record(c, &x), 0);
	assert_int_equal(kvc_seq_evict(c, x.s), 0);
	assert_int_equal(wait_spilled(c, x.s).state, KVC_SEQ_DISK);
	assert_int_equal(same(c, &x), 0);
	assert_int_equal(wait_restored(c, x.s).state, KVC_SEQ_RAM);
	/* "kvd": the threads not named, the loop, executor and workers; the
	 * spill thread's io_uring workers (iou-wrk-*) are its own, at its 5. */
	thread_nices(D.pid, "kvd-spill", "kvd", &spill_nice, &lo, &hi);
	assert_int_equal(spill_nice, 5);
	assert_int_equal(lo, -10);
	assert_int_equal(hi, -10);
	thread_nices(D.pid, "kvd-prefault", NULL, &pf_nice, &lo, &hi);
	assert_true(pf_nice == INT_MIN || pf_nice == 10);
	/* the threads that sealed, at the bulk niceness */
	thread_nices(D.pid, "kvd-bulk", NULL, &bulk_nice, &lo, &hi);
	assert_int_equal(bulk_nice, 0);
	drop_session(c, &x);
	kvc_close(c);
}

static void test_spill_restore_bit_equal(void **state)
{
	struct kvc *c;
	struct session x;
	struct kvc_seq_stats st;
	struct kvc_stats ss;

	assert_int_equal(up(NULL, NULL), 0);
	c = client("spill");
	assert_int_equal(build(c, &x, 1), 0);
	assert_int_equal(record(c, &x), 0);
	st = seq_stats(c, x.s);
	assert_int_equal(st.state, KVC_SEQ_RAM);
	assert_false(st.durable);
	uint64_t resident = st.bytes;

	if (kvc_seq_evict(c, x.s))
		fail_msg("evict: %s", kvc_last_error(c));
	st = wait_spilled(c, x.s);
	assert_int_equal(st.state, KVC_SEQ_DISK);
	assert_true(st.durable);
	assert_int_equal(st.bytes, 0);
	assert_true(st.disk_bytes >= resident / 2);
	assert_int_equal(count_files(spill, ".kvs"), 1);
	ss = stats(c);
	assert_int_equal(ss.spills, 1);
	assert_int_equal(ss.on_disk, 1);
	assert_int_equal(ss.bytes, 0);

	/* ATTEND brings it back, layer by layer, and answers as before */
	assert_int_equal(same(c, &x), 0);
	st = wait_restored(c, x.s);
	assert_int_equal(st.state, KVC_SEQ_RAM);
	assert_true(st.durable);                /* unchanged since: the file is current */
	assert_int_equal(st.bytes, resident);
	ss = stats(c);
	assert_int_equal(ss.restores, 1);
	assert_int_equal(ss.lost, 0);

	/* a clean sequence goes back to disk without a write */
	assert_int_equal(kvc_seq_evict(c, x.s), 0);
	st = wait_spilled(c, x.s);
	assert_int_equal(st.state, KVC_SEQ_DISK);
	assert_int_equal(stats(c).spills, 1);
	assert_int_equal(stats(c).drops, 1);

	/* PREFETCH, then a change makes the file stale: it goes */
	assert_int_equal(kvc_prefetch(c, x.s), 0);
	for (int i = 0; i < 3000 && seq_stats(c, x.s).state != KVC_SEQ_RAM; i++)
		daemon_sleep_ms(10);
	assert_int_equal(seq_stats(c, x.s).state, KVC_SEQ_RAM);
	assert_int_equal(same(c, &x), 0);
	{
		float kt[2 * 128] = { 1 }, vt[2 * 128] = { 1 };

		/* a window's worth, so a batch of them leaves the client for kvd */
		for (int t = 0; t < 100; t++)
			for (uint32_t l = 0; l < LAYERS; l++)
				assert_int_equal(kvc_append(c, x.s, l, kt, vt), 0);
		assert_int_equal(kvc_nop(c), 0);
	}
	for (int i = 0; i < 300 && count_files(spill, ".kvs"); i++)
		daemon_sleep_ms(10);
	assert_false(seq_stats(c, x.s).durable);
	assert_int_equal(count_files(spill, ".kvs"), 0);

	drop_session(c, &x);
	kvc_close(c);
}

/* The same round trip with an int8 profile: the int8 segments go to disk
 * and come back answering bit for bit; the same rows under the bf16
 * profile take more memory and answer differently, so int8 is what was
 * stored and restored. */
static void test_spill_restore_int8(void **state)
{
	struct kvc *c8, *c16;
	struct session x, y;
	struct kvc_seq_stats st, st16;

	assert_int_equal(up(NULL, NULL), 0);
	c8 = client_of("spill-int8", &model_int8);
	c16 = client("spill-bf16");
	assert_int_equal(build(c8, &x, 2), 0);
	assert_int_equal(record(c8, &x), 0);
	assert_int_equal(build(c16, &y, 2), 0);
	assert_int_equal(record(c16, &y), 0);
	st = seq_stats(c8, x.s);
	st16 = seq_stats(c16, y.s);
	print_message("  resident: int8 %llu bytes, bf16 %llu\n", (unsigned long long)st.bytes,
		      (unsigned long long)st16.bytes);
	assert_int_equal(st.tokens, st16.tokens);
	assert_int_equal(st.segments, st16.segments);
	assert_true(st.bytes < st16.bytes * 3 / 4);
	for (uint32_t l = 1; l < LAYERS; l++)
		assert_true(memcmp(x.o[l], y.o[l], sizeof x.o[l]) != 0);

	assert_int_equal(kvc_seq_evict(c8, x.s), 0);
	assert_int_equal(kvc_seq_evict(c16, y.s), 0);
	st = wait_spilled(c8, x.s);
	st16 = wait_spilled(c16, y.s);
	assert_int_equal(st.state, KVC_SEQ_DISK);
	assert_true(st.durable);
	assert_int_equal(st16.state, KVC_SEQ_DISK);
	print_message("  on disk: int8 %llu bytes, bf16 %llu\n", (unsigned long long)st.disk_bytes,
		      (unsigned long long)st16.disk_bytes);
	assert_true(st.disk_bytes < st16.disk_bytes);
	assert_int_equal(same(c8, &x), 0);
	assert_int_equal(same(c16, &y), 0);
	assert_int_equal(wait_restored(c8, x.s).state, KVC_SEQ_RAM);
	assert_int_equal(wait_restored(c16, y.s).state, KVC_SEQ_RAM);
	assert_int_equal(stats(c8).lost, 0);
	assert_int_equal(stats(c8).restores, 2);
	drop_session(c8, &x);
	drop_session(c16, &y);
	kvc_close(c8);
	kvc_close(c16);
}

/* Six sessions of ~15 MB under a 48 MiB budget: prefill evicts the coldest,
 * ATTEND brings them back, every answer as recorded while resident. */
static void test_budget_evicts_and_restores(void **state)
{
	enum { N = 6 };
	struct kvc *c;
	struct session *x = xmalloc(N * sizeof *x);
	struct kvc_stats ss;

	assert_int_equal(up("--mem-limit", "48M"), 0);
	c = client("budget");
	for (int i = 0; i < N; i++) {
		if (build(c, &x[i], 100 + (uint64_t)i))
			fail_msg("session %d: %s", i, kvc_last_error(c));
		assert_int_equal(record(c, &x[i]), 0);
	}
	ss = stats(c);
	print_message("  %d sessions under 48 MiB: %llu spills, %llu MiB resident, %u on disk\n", N,
		      (unsigned long long)ss.spills, (unsigned long long)(ss.bytes >> 20), ss.on_disk);
	assert_true(ss.spills >= 2);
	assert_true(ss.bytes <= ss.mem_limit);
	for (int round = 0; round < 2; round++)
		for (int i = 0; i < N; i++)
			if (same(c, &x[i]))
				fail_msg("session %d round %d: %s", i, round, kvc_last_error(c));
	ss = stats(c);
	assert_true(ss.restores >= 2);
	assert_int_equal(ss.lost, 0);
	assert_true(ss.bytes <= ss.mem_limit);
	for (int i = 0; i < N; i++)
		drop_session(c, &x[i]);
	assert_int_equal(stats(c).sequences, 0);
	kvc_close(c);
	free(x);
}

/* Without a spill directory the budget is a hard wall with a clear error. */
static void test_budget_without_spill(void **state)
{
	struct kvc *c, *c2;
	struct session x, y;
	int rc;

	assert_int_equal(daemon_start4(&D, "--mem-limit", "24M", NULL, NULL), 0);
	c = client("wall");
	assert_int_equal(build(c, &x, 3), 0);
	rc = build(c, &y, 4);
	assert_int_equal(rc, -ENOMEM);
	print_message("  over budget: %s\n", kvc_last_error(c));
	assert_non_null(strstr(kvc_last_error(c), "memory budget"));
	drop_session(c, &y);
	/* kvd keeps serving: the first session answers, another client works */
	assert_int_equal(record(c, &x), 0);
	c2 = client("other");
	assert_int_equal(kvc_nop(c2), 0);
	kvc_close(c2);
	drop_session(c, &x);
	kvc_close(c);
}

/* ---- faults (fake backend) ---------------------------------------------- */

/* Evicts a recorded session under `fault` and checks what must hold:
 * spill_fails: the write fails and the data stays in RAM, answering as
 * before; read_fails: the write "succeeds" and the restore fails with
 * KVD_ELOST, never a wrong answer; neither: everything round-trips. */
static void fault_case(const char *fault, int spill_fails, int read_fails)
{
	struct kvc *c;
	struct session x, y;
	struct kvc_seq_stats st;
	struct kvc_stats ss;
	int rc;

	assert_int_equal(up("--spill-fault", fault), 0);
	c = client(fault);
	assert_int_equal(build(c, &x, 7), 0);
	assert_int_equal(record(c, &x), 0);
	assert_int_equal(build(c, &y, 8), 0);
	assert_int_equal(record(c, &y), 0);
	assert_int_equal(kvc_seq_evict(c, x.s), 0);
	st = wait_spilled(c, x.s);
	ss = stats(c);
	if (spill_fails) {
		assert_int_equal(st.state, KVC_SEQ_RAM);
		assert_false(st.durable);
		assert_true(ss.spill_errors >= 1);
		assert_int_equal(count_files(spill, ".kvs"), 0);
		assert_int_equal(count_files(spill, ".tmp"), 0);
		assert_int_equal(same(c, &x), 0);
	} else {
		assert_int_equal(st.state, KVC_SEQ_DISK);
		rc = same(c, &x);
		if (read_fails) {
			assert_int_equal(rc, -KVD_ELOST);
			print_message("  %s: %s\n", fault, kvc_last_error(c));
			assert_non_null(strstr(kvc_last_error(c), "lost"));
			assert_int_equal(stats(c).lost, 1);
			assert_int_equal(seq_stats(c, x.s).state, KVC_SEQ_LOST);
			assert_int_equal(seq_stats(c, x.s).bytes, 0);
			/* and stays lost */
			assert_int_equal(same(c, &x), -KVD_ELOST);
		} else {
			assert_int_equal(rc, 0);
		}
	}
	/* the other session never noticed */
	assert_int_equal(same(c, &y), 0);
	drop_session(c, &x);
	drop_session(c, &y);
	/* (a sequence freed while a job of the tier still holds it goes when
	 * that job is reaped) */
	for (int i = 0; i < 1000 && stats(c).sequences != 0; i++)
		daemon_sleep_ms(10);
	assert_int_equal(stats(c).sequences, 0);
	kvc_close(c);
}

static void test_fault_enospc(void **state) { fault_case("enospc@*", 1, 0); }
static void test_fault_eio_write(void **state) { fault_case("eio-write@*", 1, 0); }
static void test_fault_fsync(void **state) { fault_case("fsync@*", 1, 0); }
static void test_fault_short(void **state) { fault_case("short@*", 0, 0); }
static void test_fault_torn(void **state) { fault_case("torn@*", 0, 1); }
static void test_fault_corrupt(void **state) { fault_case("corrupt@*", 0, 1); }
static void test_fault_eio_read(void **state) { fault_case("eio-read@*", 0, 1); }

/* ---- restart ------------------------------------------------------------ */

static void test_persist_clean_restart(void **state)
{
	struct kvc *c, *c2;
	struct session x;
	uint64_t tokens;
	struct kvc_seq *s2;

	assert_int_equal(up("--persist", NULL), 0);
	c = client("persist");
	assert_int_equal(build(c, &x, 21), 0);
	assert_int_equal(record(c, &x), 0);
	assert_int_equal(kvc_seq_evict(c, x.s), 0);
	assert_true(wait_spilled(c, x.s).durable);
	/* kvd stops while the client is attached: the file stays (persist) */
	assert_int_equal(daemon_stop(&D), 0);
	kvc_seq_free(c, x.s);           /* kvd is gone: this frees our handle only */
	kvc_close(c);
	assert_int_equal(count_files(spill, ".kvs"), 1);

	assert_int_equal(up("--persist", NULL), 0);
	c2 = client("persist2");
	assert_int_equal(stats(c2).on_disk, 1);
	assert_int_equal(kvc_seq_open(c2, x.id, &s2, &tokens), 0);
	print_message("  after restart: sequence %016llx found, %llu tokens per layer\n",
		      (unsigned long long)x.id, (unsigned long long)tokens);
	assert_true(tokens > N_TOK - 4 - 64 - 32 && tokens <= N_TOK - 4 - 64);
	x.s = s2;
	assert_int_equal(same(c2, &x), 0);
	assert_int_equal(wait_restored(c2, x.s).state, KVC_SEQ_RAM);
	/* another tenant cannot take it, a second open by the owner's peer neither */
	drop_session(c2, &x);
	kvc_close(c2);
}

/* --persist with an int8 profile: after a restart kvd has recreated the
 * profile from the file as int8 (the same name as bf16 is another
 * profile), and the sequence answers as before. */
static void test_persist_int8_restart(void **state)
{
	struct kvc_opts o = { .tenant = "t", .name = "persist-int8b", .slots = 8,
			      .slot_size = 1 << 20 };
	struct kvc_model as_bf16 = model_int8;
	struct kvc *c, *c2;
	struct session x;
	struct kvc_seq *s2;
	uint64_t tokens;

	assert_int_equal(up("--persist", NULL), 0);
	c = client_of("persist-int8", &model_int8);
	assert_int_equal(build(c, &x, 23), 0);
	assert_int_equal(record(c, &x), 0);
	assert_int_equal(kvc_seq_evict(c, x.s), 0);
	assert_true(wait_spilled(c, x.s).durable);
	assert_int_equal(daemon_stop(&D), 0);
	kvc_seq_free(c, x.s);           /* kvd is gone: this frees our handle only */
	kvc_close(c);
	assert_int_equal(count_files(spill, ".kvs"), 1);

	assert_int_equal(up("--persist", NULL), 0);
	o.socket_path = D.sock;
	assert_int_equal(kvc_connect(&o, &c2), 0);
	as_bf16.kv_dtype = KVC_KV_BF16;
	assert_int_equal(kvc_profile(c2, &as_bf16), -EEXIST);
	assert_int_equal(kvc_profile(c2, &model_int8), 0);
	assert_int_equal(kvc_model_of(c2)->kv_dtype, KVC_KV_INT8);
	assert_int_equal(kvc_seq_open(c2, x.id, &s2, &tokens), 0);
	assert_true(tokens > N_TOK - 4 - 64 - 32 && tokens <= N_TOK - 4 - 64);
	x.s = s2;
	assert_int_equal(same(c2, &x), 0);
	assert_int_equal(wait_restored(c2, x.s).state, KVC_SEQ_RAM);
	assert_int_equal(stats(c2).lost, 0);
	drop_session(c2, &x);
	kvc_close(c2);
}

/* ---- estimator state ---------------------------------------------------- */

/* `model` with the hybrid estimator: same rows, same files but for the
 * PROFILE record's estimator. */
static const struct kvc_model model_hybrid = {
	.name = "tier-hybrid", .layers = LAYERS, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .estimator = KVC_EST_HYBRID,
	.dense_layers = dense_layers, .n_dense = 1, .seed = 11, .segment_tokens = 4096,
	.seal_tokens = 256,
};

/* The same with hybrid_cv, whose segments carry V sums beside them. */
static const struct kvc_model model_cv = {
	.name = "tier-hybrid-cv", .layers = LAYERS, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
	.K = 10, .L = 60, .c = 2, .sink = 4, .window = 64, .estimator = KVC_EST_HYBRID_CV,
	.dense_layers = dense_layers, .n_dense = 1, .seed = 11, .segment_tokens = 4096,
	.seal_tokens = 256,
};

/* ATTEND of every sparse layer of x answers, finite. */
static int finite_answers(struct kvc *c, struct session *x)
{
	float o[8 * 128], lse[8];
	int rc;

	for (uint32_t l = 1; l < LAYERS; l++) {
		if ((rc = kvc_attend_kvd(c, l, &x->s, 1, x->w[l].q, o, lse)))
			return rc;
		for (int i = 0; i < 8 * 128; i++)
			if (!isfinite(o[i]) || (i < 8 && !isfinite(lse[i])))
				return 1;
	}
	return 0;
}

/* Decode step `step` of x: ATTEND of every sparse layer with the layer's
 * query drifted by the step, as a decoder's queries drift; the answers in
 * o and lse. */
static int step(struct kvc *c, struct session *x, int step, float o[LAYERS][8 * 128],
		float lse[LAYERS][8])
{
	float q[8 * 128];
	int rc;

	for (uint32_t l = 1; l < LAYERS; l++) {
		for (int i = 0; i < 8 * 128; i++)
			q[i] = x->w[l].q[i] * (1.0f + 0.02f * (float)step * sinf((float)i));
		if ((rc = kvc_attend_kvd(c, l, &x->s, 1, q, o[l], lse[l])))
			return rc;
	}
	return 0;
}

/* Step `s` of x and of its twin y answer bit for bit alike: 0; the error
 * of a step that failed; 1 when they differ. */
static int same_step(struct kvc *c, struct session *x, struct session *y, int s)
{
	float ox[LAYERS][8 * 128], lx[LAYERS][8], oy[LAYERS][8 * 128], ly[LAYERS][8];
	int rc;

	if ((rc = step(c, x, s, ox, lx)) || (rc = step(c, y, s, oy, ly)))
		return rc;
	for (uint32_t l = 1; l < LAYERS; l++)
		if (memcmp(ox[l], oy[l], sizeof ox[l]) || memcmp(lx[l], ly[l], sizeof lx[l]))
			return 1;
	return 0;
}

#define WARM 6                  /* decode steps before the eviction */

/* A hybrid profile's estimator state travels with its sequence: x, decoded
 * WARM steps, is evicted (its file holds each sparse layer's lists: a
 * HEAVY extent beside what the same rows under magicpig write) and
 * brought back by ATTEND, and from then answers every step bit for bit as
 * its twin y (same rows, same steps, never evicted).  The same rows under
 * magicpig (m: what hybrid answers with empty lists, bit for bit) answer
 * that step otherwise, so the lists are what is compared.  The steps after
 * the restore change the lists: the next eviction writes the file again
 * (it is no longer current), and after a PREFETCH x still answers as y. */
/* hybrid_cv's and hybrid_lcv's segments come back from disk with the V
 * sums and moments they were built with (made on the spill thread from the
 * payload): x, evicted after WARM steps and restored by ATTEND, answers
 * each step bit for bit as its twin y, and otherwise than hybrid on the
 * same rows. */
static void cv_twin(const struct kvc_model *m, const char *name)
{
	float oy[LAYERS][8 * 128], ly[LAYERS][8], oz[LAYERS][8 * 128], lz[LAYERS][8];
	struct kvc *cc, *ch;
	struct session x, y, h;
	char hn[64];

	assert_int_equal(up(NULL, NULL), 0);
	snprintf(hn, sizeof hn, "%s-hybrid", name);
	cc = client_of(name, m);
	ch = client_of(hn, &model_hybrid);
	assert_int_equal(build(cc, &x, 4), 0);
	assert_int_equal(build(cc, &y, 4), 0);
	assert_int_equal(build(ch, &h, 4), 0);
	for (int s = 0; s < WARM; s++) {
		assert_int_equal(same_step(cc, &x, &y, s), 0);
		assert_int_equal(step(ch, &h, s, oz, lz), 0);
	}
	assert_int_equal(kvc_seq_evict(cc, x.s), 0);
	assert_int_equal(wait_spilled(cc, x.s).state, KVC_SEQ_DISK);
	assert_int_equal(same_step(cc, &x, &y, WARM), 0);
	assert_int_equal(wait_restored(cc, x.s).state, KVC_SEQ_RAM);
	assert_int_equal(same_step(cc, &x, &y, WARM + 1), 0);
	assert_int_equal(step(cc, &y, WARM + 2, oy, ly), 0);
	assert_int_equal(step(ch, &h, WARM + 1, oz, lz), 0);
	assert_int_equal(step(ch, &h, WARM + 2, oz, lz), 0);
	assert_true(memcmp(oy[1], oz[1], sizeof oy[1]) || memcmp(oy[2], oz[2], sizeof oy[2]));
	assert_int_equal(step(cc, &x, WARM + 2, oz, lz), 0);
	assert_memory_equal(oz[1], oy[1], (LAYERS - 1) * sizeof oz[1]);
	assert_memory_equal(lz[1], ly[1], (LAYERS - 1) * sizeof lz[1]);
	assert_int_equal(stats(cc).lost, 0);
	drop_session(cc, &x);
	drop_session(cc, &y);
	drop_session(ch, &h);
	kvc_close(cc);
	kvc_close(ch);
}

static void test_spill_cv_answers_as_twin(void **state)
{
	cv_twin(&model_cv, "spill-cv");
}

static void test_spill_lcv_answers_as_twin(void **state)
{
	cv_twin(&model_lcv, "spill-lcv");
}

static void test_spill_keeps_estimator_state(void **state)
{
	const uint64_t hb = 8 * (1 + 32) * sizeof(uint32_t);
	float oy[LAYERS][8 * 128], ly[LAYERS][8], oz[LAYERS][8 * 128], lz[LAYERS][8];
	struct kvc *ch, *cm;
	struct session x, y, m;
	struct kvc_seq_stats st, stm;

	assert_int_equal(up(NULL, NULL), 0);
	ch = client_of("spill-hybrid", &model_hybrid);
	cm = client("spill-magicpig");
	assert_int_equal(kvc_model_of(ch)->estimator, KVC_EST_HYBRID);
	assert_int_equal(build(ch, &x, 4), 0);
	assert_int_equal(build(ch, &y, 4), 0);
	assert_int_equal(build(cm, &m, 4), 0);
	assert_int_equal(finite_answers(cm, &m), 0);
	for (int s = 0; s < WARM; s++)
		assert_int_equal(same_step(ch, &x, &y, s), 0);
	st = seq_stats(ch, x.s);
	stm = seq_stats(cm, m.s);
	assert_int_equal(st.tokens, stm.tokens);
	assert_int_equal(st.bytes, stm.bytes + (LAYERS - 1) * hb);
	uint64_t resident = st.bytes;

	assert_int_equal(kvc_seq_evict(ch, x.s), 0);
	assert_int_equal(kvc_seq_evict(cm, m.s), 0);
	st = wait_spilled(ch, x.s);
	stm = wait_spilled(cm, m.s);
	assert_int_equal(st.state, KVC_SEQ_DISK);
	assert_true(st.durable);
	assert_int_equal(st.bytes, 0);
	assert_int_equal(stm.state, KVC_SEQ_DISK);
	print_message("  on disk: hybrid %llu bytes, magicpig %llu\n",
		      (unsigned long long)st.disk_bytes, (unsigned long long)stm.disk_bytes);
	assert_int_equal(st.disk_bytes, stm.disk_bytes + (LAYERS - 1) * (KVD_SFMT_PAGE +
									   KVD_SFMT_PAGE));

	/* back in RAM by the next step's ATTEND, layer by layer */
	assert_int_equal(same_step(ch, &x, &y, WARM), 0);
	st = wait_restored(ch, x.s);
	assert_int_equal(st.state, KVC_SEQ_RAM);
	assert_int_equal(st.bytes, resident);
	assert_int_equal(same_step(ch, &x, &y, WARM + 1), 0);
	assert_int_equal(step(ch, &y, WARM + 2, oy, ly), 0);
	assert_int_equal(step(cm, &m, WARM + 2, oz, lz), 0);
	assert_true(memcmp(oy[1], oz[1], sizeof oy[1]) || memcmp(oy[2], oz[2], sizeof oy[2]));
	assert_int_equal(step(ch, &x, WARM + 2, oz, lz), 0);
	assert_memory_equal(oz[1], oy[1], (LAYERS - 1) * sizeof oz[1]);
	assert_memory_equal(lz[1], ly[1], (LAYERS - 1) * sizeof lz[1]);

	/* changed by those steps: written again (its stale file goes first:
	 * asked again until it has), and still the twin's */
	for (int i = 0; i < 300 && kvc_seq_evict(ch, x.s); i++)
		daemon_sleep_ms(10);
	assert_int_equal(wait_spilled(ch, x.s).state, KVC_SEQ_DISK);
	assert_int_equal(stats(ch).spills, 3);
	assert_int_equal(kvc_prefetch(ch, x.s), 0);
	for (int i = 0; i < 3000 && seq_stats(ch, x.s).state != KVC_SEQ_RAM; i++)
		daemon_sleep_ms(1);
	assert_int_equal(seq_stats(ch, x.s).state, KVC_SEQ_RAM);
	for (int s = WARM + 3; s < WARM + 5; s++)
		assert_int_equal(same_step(ch, &x, &y, s), 0);
	assert_int_equal(seq_stats(ch, x.s).bytes, resident);
	assert_int_equal(stats(ch).lost, 0);
	drop_session(ch, &x);
	drop_session(ch, &y);
	drop_session(cm, &m);
	assert_int_equal(stats(ch).bytes, 0);
	kvc_close(ch);
	kvc_close(cm);
}

/* --persist with a hybrid profile: after a restart kvd has recreated the
 * profile from the file with its estimator (the same name as magicpig is
 * another profile), and the sequence, decoded WARM steps before, answers
 * the next one bit for bit as its twin did before the stop: the lists came
 * back from the file too. */
static void test_persist_hybrid_restart(void **state)
{
	struct kvc_opts o = { .tenant = "t", .name = "persist-hybridb", .slots = 8,
			      .slot_size = 1 << 20 };
	float oy[LAYERS][8 * 128], ly[LAYERS][8], ox[LAYERS][8 * 128], lx[LAYERS][8];
	struct kvc_model as_magicpig = model_hybrid;
	struct kvc *c, *c2;
	struct session x, y;
	struct kvc_seq *s2;
	uint64_t tokens;

	assert_int_equal(up("--persist", NULL), 0);
	c = client_of("persist-hybrid", &model_hybrid);
	assert_int_equal(build(c, &x, 25), 0);
	assert_int_equal(build(c, &y, 25), 0);
	for (int s = 0; s < WARM; s++)
		assert_int_equal(same_step(c, &x, &y, s), 0);
	assert_int_equal(kvc_seq_evict(c, x.s), 0);
	assert_true(wait_spilled(c, x.s).durable);
	assert_int_equal(step(c, &y, WARM, oy, ly), 0);
	drop_session(c, &y);
	assert_int_equal(daemon_stop(&D), 0);
	kvc_seq_free(c, x.s);           /* kvd is gone: this frees our handle only */
	kvc_close(c);
	assert_int_equal(count_files(spill, ".kvs"), 1);

	assert_int_equal(up("--persist", NULL), 0);
	o.socket_path = D.sock;
	assert_int_equal(kvc_connect(&o, &c2), 0);
	as_magicpig.estimator = KVC_EST_MAGICPIG;
	assert_int_equal(kvc_profile(c2, &as_magicpig), -EEXIST);
	assert_int_equal(kvc_profile(c2, &model_hybrid), 0);
	assert_int_equal(kvc_model_of(c2)->estimator, KVC_EST_HYBRID);
	assert_int_equal(kvc_seq_open(c2, x.id, &s2, &tokens), 0);
	assert_true(tokens > N_TOK - 4 - 64 - 32 && tokens <= N_TOK - 4 - 64);
	x.s = s2;
	assert_int_equal(step(c2, &x, WARM, ox, lx), 0);
	assert_memory_equal(ox[1], oy[1], (LAYERS - 1) * sizeof ox[1]);
	assert_memory_equal(lx[1], ly[1], (LAYERS - 1) * sizeof lx[1]);
	assert_int_equal(wait_restored(c2, x.s).state, KVC_SEQ_RAM);
	assert_int_equal(stats(c2).lost, 0);
	drop_session(c2, &x);
	kvc_close(c2);
}

/* Rewrites every extent header of the one .kvs file in dir as format
 * version 1 wrote it (bf16 files only differ in the version field); the
 * number of extents rewritten. */
static unsigned as_version1(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	char path[512] = "";
	unsigned n = 0;

	assert_non_null(d);
	while ((e = readdir(d)))
		if (strlen(e->d_name) > 4 && !strcmp(e->d_name + strlen(e->d_name) - 4, ".kvs"))
			snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
	closedir(d);
	assert_true(path[0] != 0);

	int fd = open(path, O_RDWR);
	struct kvd_sfmt_hdr h;

	assert_true(fd >= 0);
	for (off_t at = 0; pread(fd, &h, sizeof h, at) == (ssize_t)sizeof h; at += h.extent_bytes) {
		assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, NULL, NULL, 0), 0);
		assert_int_equal(h.version, KVD_SFMT_VERSION);
		assert_int_equal(kvd_sfmt_seg_dtype(&h), KVD_KV_BF16);
		h.version = 1;
		h.hdr_crc = 0;
		h.hdr_crc = kvd_sfmt_crc32c(&h, sizeof h);
		assert_int_equal(pwrite(fd, &h, sizeof h, at), (ssize_t)sizeof h);
		n++;
		if (h.kind == KVD_SFMT_END)
			break;
	}
	assert_int_equal(fsync(fd), 0);
	close(fd);
	return n;
}

/* A file written by format version 1 (bf16 only) is still found by
 * --persist and answers bit for bit. */
static void test_persist_version1_file(void **state)
{
	struct kvc *c, *c2;
	struct session x;
	struct kvc_seq *s2;
	unsigned n;

	assert_int_equal(up("--persist", NULL), 0);
	c = client("v1");
	assert_int_equal(build(c, &x, 27), 0);
	assert_int_equal(record(c, &x), 0);
	assert_int_equal(kvc_seq_evict(c, x.s), 0);
	assert_true(wait_spilled(c, x.s).durable);
	assert_int_equal(daemon_stop(&D), 0);
	kvc_seq_free(c, x.s);           /* kvd is gone: this frees our handle only */
	kvc_close(c);
	n = as_version1(spill);
	print_message("  %u extents rewritten as version 1\n", n);
	assert_true(n >= 2 + 2 * (LAYERS - 1));

	assert_int_equal(up("--persist", NULL), 0);
	c2 = client("v1b");
	assert_int_equal(stats(c2).on_disk, 1);
	assert_int_equal(kvc_seq_open(c2, x.id, &s2, NULL), 0);
	x.s = s2;
	assert_int_equal(same(c2, &x), 0);
	assert_int_equal(wait_restored(c2, x.s).state, KVC_SEQ_RAM);
	assert_int_equal(stats(c2).lost, 0);
	drop_session(c2, &x);
	kvc_close(c2);
}

/* kill -9 in the middle of a burst of write-backs, restart with --persist:
 * every sequence kvd reported durable before the kill is found and answers
 * bit for bit; the others are gone or complete, never half there. */
static void test_crash_during_spill_burst(void **state)
{
	const int N = (int)test_size(8, 4);
	struct kvc *c, *c2;
	struct session *x = xmalloc((size_t)N * sizeof *x);
	int durable[8] = { 0 }, nd = 0, found = 0;
	int st;

	assert_int_equal(up("--persist", NULL), 0);
	c = client("crash");
	for (int i = 0; i < N; i++) {
		assert_int_equal(build(c, &x[i], 300 + (uint64_t)i), 0);
		assert_int_equal(record(c, &x[i]), 0);
	}
	for (int i = 0; i < N; i++)
		assert_int_equal(kvc_seq_evict(c, x[i].s), 0);
	/* Kill once some, not necessarily all, are durable. */
	for (int t = 0; t < 3000 && nd < N / 2; t++) {
		nd = 0;
		for (int i = 0; i < N; i++)
			nd += durable[i] = seq_stats(c, x[i].s).durable;
		if (nd < N / 2)
			daemon_sleep_ms(2);
	}
	kill(D.pid, SIGKILL);
	assert_int_equal(waitpid(D.pid, &st, 0), D.pid);
	D.pid = 0;
	rmdir(D.dir);
	for (int i = 0; i < N; i++)
		kvc_seq_free(c, x[i].s);        /* our handles only: kvd is gone */
	kvc_close(c);
	print_message("  killed with %d of %d sequences durable, %u files, %u temporary\n", nd, N,
		      count_files(spill, ".kvs"), count_files(spill, ".tmp"));
	assert_true(nd >= N / 2);

	assert_int_equal(up("--persist", NULL), 0);
	assert_int_equal(count_files(spill, ".tmp"), 0);
	c2 = client("crash2");
	for (int i = 0; i < N; i++) {
		struct kvc_seq *s2;
		int rc = kvc_seq_open(c2, x[i].id, &s2, NULL);

		x[i].s = NULL;
		if (durable[i])
			assert_int_equal(rc, 0);
		if (rc) {
			assert_int_equal(rc, -ENOENT);
			continue;
		}
		found++;
		x[i].s = s2;
		if (same(c2, &x[i]))
			fail_msg("sequence %d (%s durable): %s", i, durable[i] ? "reported" : "not reported",
				 kvc_last_error(c2));
	}
	print_message("  after restart: %d found, all verified\n", found);
	assert_int_equal(stats(c2).lost, 0);
	for (int i = 0; i < N; i++)
		drop_session(c2, &x[i]);
	kvc_close(c2);
	free(x);
}

/* A persisted file that fails its checks at start-up is moved aside into
 * quarantine/ (for the operator to look at), never deleted, and the good
 * files next to it load and answer as before. */
static void test_persist_bad_file_quarantined(void **state)
{
	struct kvc *c, *c2;
	struct session x[2];
	char path[400], qdir[300];
	struct kvc_seq *s2;
	int fd;

	assert_int_equal(up("--persist", NULL), 0);
	c = client("quar");
	for (int i = 0; i < 2; i++) {
		assert_int_equal(build(c, &x[i], 40 + (uint64_t)i), 0);
		assert_int_equal(record(c, &x[i]), 0);
		assert_int_equal(kvc_seq_evict(c, x[i].s), 0);
	}
	for (int i = 0; i < 2; i++)
		assert_true(wait_spilled(c, x[i].s).durable);
	assert_int_equal(daemon_stop(&D), 0);
	for (int i = 0; i < 2; i++)
		kvc_seq_free(c, x[i].s);
	kvc_close(c);
	assert_int_equal(count_files(spill, ".kvs"), 2);

	/* One byte of the first file's header flipped: its CRC32C fails. */
	snprintf(path, sizeof path, "%s/%016llx.kvs", spill, (unsigned long long)x[0].id);
	fd = open(path, O_RDWR);
	assert_true(fd >= 0);
	{
		uint8_t b;

		assert_int_equal(pread(fd, &b, 1, 40), 1);
		b ^= 0x5a;
		assert_int_equal(pwrite(fd, &b, 1, 40), 1);
	}
	close(fd);

	assert_int_equal(up("--persist", NULL), 0);
	snprintf(qdir, sizeof qdir, "%s/quarantine", spill);
	assert_int_equal(count_files(spill, ".kvs"), 1);
	assert_int_equal(count_files(qdir, ".kvs"), 1);
	c2 = client("quar2");
	assert_int_equal(kvc_seq_open(c2, x[0].id, &s2, NULL), -ENOENT);
	assert_int_equal(kvc_seq_open(c2, x[1].id, &s2, NULL), 0);
	x[1].s = s2;
	assert_int_equal(same(c2, &x[1]), 0);
	drop_session(c2, &x[1]);
	for (uint32_t l = 0; l < LAYERS; l++)
		kvd_synth_free(&x[0].w[l]);
	kvc_close(c2);
	/* A restart keeps the quarantined file where it is. */
	assert_int_equal(daemon_stop(&D), 0);
	assert_int_equal(up("--persist", NULL), 0);
	assert_int_equal(count_files(qdir, ".kvs"), 1);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_teardown(test_threads_nice, down),
		cmocka_unit_test_teardown(test_spill_restore_bit_equal, down),
		cmocka_unit_test_teardown(test_spill_restore_int8, down),
		cmocka_unit_test_teardown(test_budget_evicts_and_restores, down),
		cmocka_unit_test_teardown(test_budget_without_spill, down),
		cmocka_unit_test_teardown(test_fault_enospc, down),
		cmocka_unit_test_teardown(test_fault_eio_write, down),
		cmocka_unit_test_teardown(test_fault_fsync, down),
		cmocka_unit_test_teardown(test_fault_short, down),
		cmocka_unit_test_teardown(test_fault_torn, down),
		cmocka_unit_test_teardown(test_fault_corrupt, down),
		cmocka_unit_test_teardown(test_fault_eio_read, down),
		cmocka_unit_test_teardown(test_persist_clean_restart, down),
		cmocka_unit_test_teardown(test_persist_int8_restart, down),
		cmocka_unit_test_teardown(test_spill_keeps_estimator_state, down),
		cmocka_unit_test_teardown(test_spill_cv_answers_as_twin, down),
		cmocka_unit_test_teardown(test_spill_lcv_answers_as_twin, down),
		cmocka_unit_test_teardown(test_persist_hybrid_restart, down),
		cmocka_unit_test_teardown(test_persist_version1_file, down),
		cmocka_unit_test_teardown(test_crash_during_spill_burst, down),
		cmocka_unit_test_teardown(test_persist_bad_file_quarantined, down),
	};

	if (getenv("KVD_TEST_FILTER"))
		cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
