/* kvbench remote: kvd's remote tier on a Redis Cluster (kvd/store/rcl.h,
 * kvd/store/remote.h), one JSON line per measurement with --json.
 *
 *   kvbench remote [--json] [--ctx N] [--layers N] [--value SIZE] [--pipeline N]
 *                  [--values N] [--seeds HOST:PORT,...]
 *
 * Without --seeds it starts a Redis Cluster of its own on loopback (3
 * masters, 1 replica each: tests/unit/rcluster.c, Debian's redis-server)
 * and stops it at the end.  With --seeds it uses that cluster: it writes
 * keys under a tag of its own ("kvd:{bench:...}") and redis-benchmark's
 * "key:__rand_int__", and deletes them again.
 *
 * 1. Throughput of kvd's cluster client against redis-benchmark, at the
 *    same value size (--value, default 4 MiB: kvd's chunk) and pipeline
 *    depth (--pipeline, default 8), one connection each, to the same master
 *    and the same slot:
 *    - redis-benchmark (no --cluster, no -r) names one key,
 *      "key:__rand_int__"; its slot's master is read from CLUSTER SLOTS and
 *      redis-benchmark is pointed at it (-c 1 -P pipeline -d value -n values
 *      -t set,get --csv -e).  Its requests are checked on that master:
 *      INFO commandstats and stats before and after (SET and GET calls grew
 *      by at least --values, no failed or rejected calls, no error replies,
 *      every GET a keyspace hit), STRLEN of the key is the value size, and
 *      no "Error" in its output.  Its figure is its own requests/s times
 *      the value size.
 *    - kvd: --values values (default 64) of random bytes under one hash tag,
 *      as kvd's remote tier names chunks, the tag chosen so that its slot
 *      is redis-benchmark's key's slot; SET in pipelined batches of
 *      --pipeline through one kvd_rcl handle (kvd_rcl_run, as the remote
 *      tier calls it), timed; then GET the same way, timed, each value
 *      straight into its place in one buffer (op.dst, as the remote tier
 *      reads a prefix's chunks into the file's buffer; allocated once, as
 *      redis-benchmark reads into a buffer of its own: the page faults of a
 *      fresh buffer show in restore_ms, not here), every value checked
 *      byte for byte afterwards (outside the timed region).
 *    Each side runs 3 times, the two interleaved (kvd first in runs 0 and
 *    2, redis-benchmark first in run 1); between runs the keys are deleted
 *    and WAIT lets the replica catch up (untimed), so neither side pays for
 *    the other's replication.  Medians are reported; WAIT's time after
 *    kvd's writes (what the remote tier adds for `replicas = 1`) is reported
 *    beside them, not in the write figure: redis-benchmark does not WAIT.
 *
 * 2. restore_vs_prefill: two kvd daemons, each with its own spill directory,
 *    [remote] seeds = the cluster, replicas = 1, chunk = --value.  Daemon A
 *    prefills a --ctx token prompt (kvd_synth's mixed workload, the same
 *    rows in every layer, as bench/prefix.c) of a Llama-3.1-8B-shaped
 *    profile cut to --layers layers (layer 0 dense) and publishes it; once
 *    its manifest is in the cluster (EXISTS polled every 10 ms: upload_ms,
 *    from publish's return), daemon B, which never saw the prompt, attaches
 *    it by content key: B's local lookup misses, B fetches the prefix from
 *    the cluster into its spill directory and restores it (restore_ms, the
 *    client's kvc_seq_attach, its -EAGAIN retries included).  Then B
 *    prefills the same tokens into a private sequence (prefill_ms).  B's
 *    connection is warmed first by an untimed private prefill, freed, so
 *    neither timing pays for the connection's first pages.  Checked: the
 *    attach got every token on every layer, and B's attached sequence
 *    answers kvc_attend on every layer bit for bit as A's does
 *    (identical); B's private prefill too (prefill_identical).
 *
 * 3. evicted_vs_local ([remote] evicted = yes): daemon C, its uid's spill
 *    room (spill_per_uid) 1.5 times the prompt's file, holds two private
 *    sequences of the same prompt, answered once.  S1 is evicted; then S2,
 *    whose write is refused until S1's copy is in the cluster, which then
 *    deletes S1's local file to make room: S1 is on disk in the cluster
 *    only, S2 on local disk.  Timed: one kvc_attend per layer of S1 (the
 *    fetch from the cluster and the restore: evicted_restore_ms), then the
 *    same of S2 (a restore from local disk: local_restore_ms).  Both must
 *    answer bit for bit as before the evictions (evicted_identical).  The
 *    spill directory is under /tmp (tmpfs or not: `spill_fs` says which
 *    statfs found), so local_restore_ms is what that file system gives.
 *
 * The exit status is 0 when every check held, 1 otherwise, 2 on bad usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/vfs.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "bench.h"
#include "srv.h"
#include "engine/err.h"
#include "gpu-client/kvc.h"
#include "kvd/store/rcl.h"
#include "kvd/store/remote.h"
#include "engine/synth.h"
#include "tests/unit/rcluster.h"

#define RM_REPS   3
#define RB_KEY    "key:__rand_int__"    /* redis-benchmark's key without -r */
#define RM_VALMAX (512u << 20)          /* Redis's largest value */

struct rm_opts {
	int json;
	uint32_t ctx, layers, pipeline, values;
	uint64_t value;
	const char *seeds;
};

/* Everything one run holds, so that one exit path frees it. */
struct rm {
	struct rm_opts op;
	struct rcluster rc;
	int own_cluster;
	char seeds[1024];
	char host[64];                  /* the master of RB_KEY's slot */
	int port;
	uint16_t slot;
	unsigned replicas;              /* connected to that master */
	char redis_version[32];
	struct kvd_rcl *rcl;
	redisContext *mc;               /* a connection to that master */
	uint8_t *src;                   /* values * value bytes */
	char (*names)[96];
	struct kvd_rcl_op *ops;
	void **got;
	size_t *got_len;
	char *dst;                      /* GETs land here: allocated once, as
					 * redis-benchmark reads into a buffer of its own */
	/* the restore scene */
	struct daemon a, b, c;
	char spill_a[64], spill_b[64], spill_c[64];
	struct kvc *ca, *cb, *cc;
	struct kvd_synth w;
	uint32_t *tok;
	float *k0, *v0, *ans_a, *ans_b;
	char prefix_stem[160];          /* --seeds: the prefix to delete at the end */
	uint64_t prefix_chunks;
};

struct tp_res {                         /* one side's medians */
	double write_ms, read_ms, wait_ms;
	double write_runs[RM_REPS], read_runs[RM_REPS], wait_runs[RM_REPS];
	int acks;
};

struct rb_res {
	double set_rps, get_rps;
	double set_runs[RM_REPS], get_runs[RM_REPS];
	uint64_t set_calls, get_calls, get_hits, get_misses, errors;   /* summed over the runs */
	int verified;
};

struct rs_res {
	uint64_t got, prefix_bytes, chunks;
	double prefill_a_ms, publish_ms, upload_ms, restore_ms, prefill_ms;
	int identical, prefill_identical, exit_a, exit_b;
	/* the evicted scene */
	double evict_wait_ms, evicted_restore_ms, local_restore_ms;
	uint64_t file_bytes;
	int evicted_identical, exit_c, tmpfs;
};

static const uint32_t dense0[] = { 0 };

static int usage(void)
{
	fprintf(stderr, "usage: kvbench remote [--json] [--ctx N] [--layers N in 2..32] "
			"[--value SIZE (1..512M)]\n"
			"                      [--pipeline N] [--values N] [--seeds HOST:PORT,...]\n");
	return 2;
}

static int fail(const char *what, const char *why)
{
	fprintf(stderr, "kvbench remote: %s: %s\n", what, why);
	return 1;
}

/* "4M", "4MiB", "4194304", "512K": binary multiples. */
static int parse_size(const char *s, uint64_t *out)
{
	char *end;
	unsigned long long v = strtoull(s, &end, 10);
	unsigned shift = 0;

	if (end == s || *s == '-')
		return -1;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	default: break;
	}
	if (shift && (!strcmp(end, "iB") || !strcmp(end, "B")))
		end += strlen(end);
	if (*end || !v || v > (RM_VALMAX >> shift))
		return -1;
	*out = (uint64_t)v << shift;
	return 0;
}

/* ---- the master of a slot, and what it says ------------------------------- */

static redisContext *connect_to(const char *host, int port)
{
	struct timeval tv = { 5, 0 };
	redisContext *c = redisConnectWithTimeout(host, port, tv);

	if (c && !c->err && redisSetTimeout(c, (struct timeval){ 30, 0 }) == REDIS_OK)
		return c;
	if (c)
		redisFree(c);
	return NULL;
}

/* The master that serves slot, from CLUSTER SLOTS of the first seed that
 * answers. */
static int slot_master(const char *seeds, uint16_t slot, char *host, size_t hn, int *port)
{
	char buf[1024], *save, *tok;

	snprintf(buf, sizeof buf, "%s", seeds);
	for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		char *colon = strrchr(tok, ':');
		redisContext *c;
		redisReply *r;
		int found = 0;

		if (!colon)
			continue;
		*colon = 0;
		if (!(c = connect_to(tok, atoi(colon + 1))))
			continue;
		r = redisCommand(c, "CLUSTER SLOTS");
		for (size_t i = 0; r && r->type == REDIS_REPLY_ARRAY && i < r->elements && !found; i++) {
			redisReply *e = r->element[i];

			if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
			    e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2)
				continue;
			if ((long long)slot < e->element[0]->integer ||
			    (long long)slot > e->element[1]->integer)
				continue;
			const redisReply *ip = e->element[2]->element[0];

			/* An empty address: the node we asked ("unknown endpoint"). */
			snprintf(host, hn, "%s", ip->type == REDIS_REPLY_STRING && ip->len ? ip->str : tok);
			*port = (int)e->element[2]->element[1]->integer;
			found = 1;
		}
		if (r)
			freeReplyObject(r);
		redisFree(c);
		if (found)
			return 0;
	}
	return -EHOSTUNREACH;
}

/* INFO section of c, or NULL. */
static char *info(redisContext *c, const char *section)
{
	redisReply *r = redisCommand(c, "INFO %s", section);
	char *s = NULL;

	if (r && r->type == REDIS_REPLY_STRING)
		s = strdup(r->str);
	if (r)
		freeReplyObject(r);
	return s;
}

/* The number after `key` on the line that starts with `line` ("cmdstat_set:",
 * key "calls="; or "keyspace_hits:", key NULL); 0 when there is none (a
 * command never called has no line). */
static uint64_t info_u64(const char *text, const char *line, const char *key)
{
	size_t ll = strlen(line);

	for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
		if (strncmp(p, line, ll))
			continue;
		const char *v = p + ll, *eol = strchr(v, '\n');

		if (key) {
			const char *k = strstr(v, key);

			if (!k || (eol && k > eol))
				return 0;
			v = k + strlen(key);
		}
		return strtoull(v, NULL, 10);
	}
	return 0;
}

struct snap {
	uint64_t set_calls, get_calls, failed, hits, misses, errors;
};

static int snapshot(redisContext *c, struct snap *s)
{
	char *cs = info(c, "commandstats"), *st = info(c, "stats");

	if (cs && st) {
		s->set_calls = info_u64(cs, "cmdstat_set:", "calls=");
		s->get_calls = info_u64(cs, "cmdstat_get:", "calls=");
		s->failed = info_u64(cs, "cmdstat_set:", "failed_calls=") +
			    info_u64(cs, "cmdstat_set:", "rejected_calls=") +
			    info_u64(cs, "cmdstat_get:", "failed_calls=") +
			    info_u64(cs, "cmdstat_get:", "rejected_calls=");
		s->hits = info_u64(st, "keyspace_hits:", NULL);
		s->misses = info_u64(st, "keyspace_misses:", NULL);
		s->errors = info_u64(st, "total_error_replies:", NULL);
	}
	free(cs);
	free(st);
	return cs && st ? 0 : -EIO;
}

/* DEL of RB_KEY on the master, then WAIT until the replicas have everything
 * up to it (this connection's last write).  Untimed. */
static int settle_rb(struct rm *x)
{
	redisReply *r = redisCommand(x->mc, "DEL %s", RB_KEY);
	int ok = r && r->type == REDIS_REPLY_INTEGER;

	if (r)
		freeReplyObject(r);
	if (ok && x->replicas) {
		r = redisCommand(x->mc, "WAIT %u 20000", x->replicas);
		ok = r && r->type == REDIS_REPLY_INTEGER;
		if (r)
			freeReplyObject(r);
	}
	return ok ? 0 : -EIO;
}

/* ---- redis-benchmark ------------------------------------------------------ */

/* Runs redis-benchmark against the master; its SET and GET requests/s.  The
 * output goes to out (NUL-terminated). */
static int rb_exec(const struct rm *x, double *set_rps, double *get_rps, char *out, size_t n)
{
	char port[16], P[16], d[24], num[16];
	char *argv[] = { "redis-benchmark", "-h", (char *)x->host, "-p", port, "-c", "1",
			 "-P", P, "-d", d, "-n", num, "-t", "set,get", "--csv", "-e", NULL };
	int fd[2], st;
	size_t len = 0;
	pid_t pid;

	snprintf(port, sizeof port, "%d", x->port);
	snprintf(P, sizeof P, "%u", x->op.pipeline);
	snprintf(d, sizeof d, "%llu", (unsigned long long)x->op.value);
	snprintf(num, sizeof num, "%u", x->op.values);
	if (pipe(fd))
		return -errno;
	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		dup2(fd[1], 1);
		dup2(fd[1], 2);
		close(fd[0]);
		close(fd[1]);
		execvp(argv[0], argv);
		_exit(127);
	}
	close(fd[1]);
	for (;;) {
		ssize_t k = read(fd[0], out + len, n - 1 - len);

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			break;
		len += (size_t)k;
		if (len == n - 1)       /* the rest is not wanted */
			len = 0;
	}
	out[len] = 0;
	close(fd[0]);
	if (waitpid(pid, &st, 0) != pid)
		return -ECHILD;
	if (!WIFEXITED(st) || WEXITSTATUS(st))
		return WIFEXITED(st) && WEXITSTATUS(st) == 127 ? -ENOENT : -EIO;
	*set_rps = *get_rps = 0;
	for (char *p = out; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
		if (!strncmp(p, "\"SET\",\"", 7))
			*set_rps = strtod(p + 7, NULL);
		else if (!strncmp(p, "\"GET\",\"", 7))
			*get_rps = strtod(p + 7, NULL);
	}
	return *set_rps > 0 && *get_rps > 0 ? 0 : -EPROTO;
}

/* One redis-benchmark run, checked on the master. */
static int rb_run(struct rm *x, struct rb_res *res, int i)
{
	static char out[65536];
	struct snap s0, s1;
	redisReply *r;
	uint64_t slen = 0;
	int rc;

	if ((rc = snapshot(x->mc, &s0)))
		return fail("redis-benchmark", "INFO before the run failed");
	rc = rb_exec(x, &res->set_runs[i], &res->get_runs[i], out, sizeof out);
	if (rc == -ENOENT)
		return fail("redis-benchmark", "not found (Debian package redis-tools)");
	if (rc) {
		fprintf(stderr, "%s", out);
		return fail("redis-benchmark", rc == -EPROTO ? "no SET/GET figures in its output"
							     : "failed");
	}
	/* Before STRLEN, which is a keyspace hit of its own. */
	if (snapshot(x->mc, &s1))
		return fail("redis-benchmark", "INFO after the run failed");
	r = redisCommand(x->mc, "STRLEN %s", RB_KEY);
	if (r && r->type == REDIS_REPLY_INTEGER)
		slen = (uint64_t)r->integer;
	if (r)
		freeReplyObject(r);
	uint64_t set = s1.set_calls - s0.set_calls, get = s1.get_calls - s0.get_calls;
	uint64_t hits = s1.hits - s0.hits, errs = s1.errors - s0.errors + s1.failed - s0.failed;
	uint64_t misses = s1.misses - s0.misses;

	res->set_calls += set;
	res->get_calls += get;
	res->get_hits += hits;
	res->errors += errs;
	res->get_misses += misses;
	if (set < x->op.values || get < x->op.values || hits < x->op.values || misses || errs ||
	    slen != x->op.value || strstr(out, "Error") || strstr(out, "ERR")) {
		fprintf(stderr, "%s", out);
		fprintf(stderr, "kvbench remote: redis-benchmark on %s:%d: %llu SET, %llu GET, "
				"%llu hits, %llu misses, %llu errors, STRLEN %llu (want %u, %u, %u, 0, 0, "
				"%llu)\n",
			x->host, x->port, (unsigned long long)set, (unsigned long long)get,
			(unsigned long long)hits, (unsigned long long)misses, (unsigned long long)errs,
			(unsigned long long)slen, x->op.values, x->op.values, x->op.values,
			(unsigned long long)x->op.value);
		res->verified = 0;
	}
	if (settle_rb(x))
		return fail("redis-benchmark", "DEL/WAIT after the run failed");
	return 0;
}

/* ---- kvd's client --------------------------------------------------------- */

/* kind over every value, in batches of pipeline ops, each batch one
 * kvd_rcl_run.  Its wall time in *ms. */
static int kvd_pass(struct rm *x, enum kvd_rcl_kind kind, double *ms)
{
	const uint32_t nv = x->op.values, P = x->op.pipeline;
	char msg[200];
	double t = bench_now_ms();

	for (uint32_t i = 0; i < nv; i += P) {
		uint32_t m = nv - i < P ? nv - i : P;
		struct kvd_rcl_op *ops = x->ops + i;
		int rc;

		for (uint32_t j = 0; j < m; j++) {
			ops[j] = (struct kvd_rcl_op){ .kind = kind, .key = x->names[i + j],
						      .klen = strlen(x->names[i + j]) };
			if (kind == KVD_RCL_SET) {
				ops[j].val = x->src + (size_t)(i + j) * x->op.value;
				ops[j].vlen = x->op.value;
			}
			if (kind == KVD_RCL_GET) {
				/* into its place, as the remote tier reads chunks */
				ops[j].dst = x->dst + (size_t)(i + j) * x->op.value;
				ops[j].cap = x->op.value;
			}
		}
		if ((rc = kvd_rcl_run(x->rcl, ops, m, msg, sizeof msg)))
			return fail("kvd_rcl_run", msg[0] ? msg : kvd_strerror(rc));
		for (uint32_t j = 0; j < m; j++) {
			if (kind == KVD_RCL_GET) {
				x->got[i + j] = ops[j].data;    /* NULL: it went to dst */
				x->got_len[i + j] = ops[j].len;
			}
			if (ops[j].rc && !(kind == KVD_RCL_DEL && ops[j].rc == -ENOENT))
				return fail(x->names[i + j], kvd_strerror(ops[j].rc));
		}
	}
	*ms = bench_now_ms() - t;
	return 0;
}

static int kvd_run(struct rm *x, struct tp_res *res, int i)
{
	char msg[200];
	double t, del_ms;
	int rc, bad = 0;

	if ((rc = kvd_pass(x, KVD_RCL_SET, &res->write_runs[i])))
		return rc;
	/* What `replicas = 1` adds to a put: not part of the write figure. */
	res->wait_runs[i] = 0;
	if (x->replicas) {
		t = bench_now_ms();
		res->acks = kvd_rcl_wait(x->rcl, x->names[x->op.values - 1],
					 strlen(x->names[x->op.values - 1]), x->replicas, 20000, msg,
					 sizeof msg);
		res->wait_runs[i] = bench_now_ms() - t;
		if (res->acks < 0)
			return fail("WAIT", msg[0] ? msg : kvd_strerror(res->acks));
	}
	memset(x->got, 0, x->op.values * sizeof *x->got);
	if ((rc = kvd_pass(x, KVD_RCL_GET, &res->read_runs[i])))
		return rc;
	for (uint32_t v = 0; v < x->op.values; v++) {
		bad |= x->got[v] || x->got_len[v] != x->op.value;
		free(x->got[v]);
		x->got[v] = NULL;
	}
	bad |= memcmp(x->dst, x->src, (size_t)x->op.values * x->op.value) != 0;
	memset(x->dst, 0, (size_t)x->op.values * x->op.value);
	if (bad)
		return fail("kvd GET", "a value did not come back as it was written");
	if ((rc = kvd_pass(x, KVD_RCL_DEL, &del_ms)))
		return rc;
	if (x->replicas && (rc = kvd_rcl_wait(x->rcl, x->names[0], strlen(x->names[0]),
					      x->replicas, 20000, msg, sizeof msg)) < 0)
		return fail("WAIT", msg[0] ? msg : kvd_strerror(rc));
	return 0;
}

/* A tag whose slot is `slot`, as kvd names a prefix: "kvd:{bench:<hex>}". */
static int pick_stem(uint16_t slot, char *stem, size_t n)
{
	uint8_t key[16] = { 0 };

	for (uint32_t i = 0; i < (1u << 24); i++) {
		memcpy(key, &i, sizeof i);
		key[15] = 0xbe;
		if (kvd_remote_stem("kvd", "bench", key, stem, n) < 0)
			return -ENAMETOOLONG;
		if (kvd_rcl_slot(stem, strlen(stem)) == slot)
			return 0;
	}
	return -ENOENT;
}

static int throughput(struct rm *x, struct tp_res *kv, struct rb_res *rb)
{
	const uint32_t nv = x->op.values;
	struct kvd_rcl_cfg cfg = { .seeds = x->seeds, .connect_ms = 2000, .io_ms = 30000,
				   .retry_ms = 10000 };
	char stem[96], msg[200], *rep;
	uint64_t s = 0x9e3779b97f4a7c15ull;
	int rc;

	x->slot = kvd_rcl_slot(RB_KEY, strlen(RB_KEY));
	if (slot_master(x->seeds, x->slot, x->host, sizeof x->host, &x->port))
		return fail("CLUSTER SLOTS", "no seed answered");
	if (!(x->mc = connect_to(x->host, x->port)))
		return fail("connect", "the master of redis-benchmark's slot does not answer");
	if (!(rep = info(x->mc, "replication")))
		return fail("INFO", "the master does not answer");
	x->replicas = (unsigned)info_u64(rep, "connected_slaves:", NULL);
	free(rep);
	if ((rep = info(x->mc, "server"))) {
		const char *v = strstr(rep, "redis_version:");

		if (v)
			sscanf(v + 14, "%31[^\r\n]", x->redis_version);
		free(rep);
	}
	if (pick_stem(x->slot, stem, sizeof stem))
		return fail("hash tag", "none found for the slot");

	x->src = malloc((size_t)nv * x->op.value);
	x->names = calloc(nv, sizeof *x->names);
	x->ops = calloc(nv, sizeof *x->ops);
	x->got = calloc(nv, sizeof *x->got);
	x->dst = calloc(nv, x->op.value);
	x->got_len = calloc(nv, sizeof *x->got_len);
	if (!x->src || !x->names || !x->ops || !x->got || !x->got_len || !x->dst)
		return fail("buffers", "out of memory");
	for (size_t i = 0; i < (size_t)nv * x->op.value / 8; i++) {
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		memcpy(x->src + i * 8, &s, 8);
	}
	for (size_t i = (size_t)nv * x->op.value / 8 * 8; i < (size_t)nv * x->op.value; i++)
		x->src[i] = (uint8_t)i;
	for (uint32_t i = 0; i < nv; i++)
		snprintf(x->names[i], sizeof x->names[i], "%s:%u", stem, i);

	if ((rc = kvd_rcl_create(&cfg, &x->rcl, msg, sizeof msg)))
		return fail("kvd_rcl_create", msg[0] ? msg : kvd_strerror(rc));
	/* The client connects and reads the slot map on its first run: do
	 * that outside the timings. */
	struct kvd_rcl_op op = { .kind = KVD_RCL_EXISTS, .key = x->names[0],
				 .klen = strlen(x->names[0]) };

	if ((rc = kvd_rcl_run(x->rcl, &op, 1, msg, sizeof msg)))
		return fail("kvd_rcl_run", msg[0] ? msg : kvd_strerror(rc));

	rb->verified = 1;
	for (int i = 0; i < RM_REPS; i++) {
		if (i % 2 == 0 && (rc = kvd_run(x, kv, i)))
			return rc;
		if ((rc = rb_run(x, rb, i)))
			return rc;
		if (i % 2 == 1 && (rc = kvd_run(x, kv, i)))
			return rc;
	}
	{
		double tmp[RM_REPS];

		memcpy(tmp, kv->write_runs, sizeof tmp);
		kv->write_ms = bench_median(tmp, RM_REPS);
		memcpy(tmp, kv->read_runs, sizeof tmp);
		kv->read_ms = bench_median(tmp, RM_REPS);
		memcpy(tmp, kv->wait_runs, sizeof tmp);
		kv->wait_ms = bench_median(tmp, RM_REPS);
		memcpy(tmp, rb->set_runs, sizeof tmp);
		rb->set_rps = bench_median(tmp, RM_REPS);
		memcpy(tmp, rb->get_runs, sizeof tmp);
		rb->get_rps = bench_median(tmp, RM_REPS);
	}
	return 0;
}

/* ---- restore against prefill ---------------------------------------------- */

static int extend_all(struct rm *x, struct kvc *c, struct kvc_seq *s, uint32_t layers)
{
	int rc;

	for (uint32_t l = 0; l < layers; l++)
		if ((rc = kvc_extend(c, s, l, x->k0, x->v0, x->op.ctx)))
			return rc;
	return 0;
}

static int answer(struct rm *x, struct kvc *c, struct kvc_seq *s, const struct kvc_model *m,
		  float *ans)
{
	const size_t qd = (size_t)m->q_heads * m->head_dim;
	float *lse = ans + (size_t)m->layers * qd;
	int rc;

	for (uint32_t l = 0; l < m->layers; l++)
		if ((rc = kvc_attend(c, l, &s, 1, x->w.q, ans + l * qd, lse + (size_t)l * m->q_heads)))
			return rc;
	return 0;
}

static int kvc_fail(struct kvc *c, const char *what, int rc)
{
	return fail(what, c ? kvc_last_error(c) : kvd_strerror(rc));
}

static int start_daemon(struct rm *x, struct daemon *d, char *spill, size_t sn, const char *tag,
			const char *more)
{
	char extra[1792];

	snprintf(spill, sn, "/tmp/kvbench-remote-%s.XXXXXX", tag);
	if (!mkdtemp(spill)) {
		spill[0] = 0;
		return fail("mkdtemp", strerror(errno));
	}
	snprintf(extra, sizeof extra,
		 "\n[metrics]\nlisten =\n\n[spill]\ndir = %s\n\n[remote]\nseeds = %s\nreplicas = 1\nwait_timeout_ms = 5000\n"
		 "timeout_ms = 10000\nretry_ms = 12000\nchunk = %llu\n%s",
		 spill, x->seeds, (unsigned long long)x->op.value, more);
	if (srv_start_conf(d, NULL, extra))
		return fail("kvd", "did not start");
	return 0;
}

static int restore(struct rm *x, struct rs_res *res)
{
	const struct rm_opts *op = &x->op;
	struct kvc_model m = llama(op->layers);
	struct kvc_opts oa = { .tenant = "bench", .name = "remote-a" };
	struct kvc_opts ob = { .tenant = "bench", .name = "remote-b" };
	struct kvc_seq *sa = NULL, *sx = NULL, *sp = NULL;
	uint8_t *keys = NULL;
	const uint32_t H = m.kv_heads, d = m.head_dim;
	uint64_t seed = ((uint64_t)getpid() << 32) ^ (uint64_t)(bench_now_ms() * 1000);
	char stem[160], name[176], msg[200];
	uint32_t chunk;
	double t;
	int rc, nk;

	if (op->layers != 32) {
		m.dense_layers = dense0;
		m.n_dense = 1;
	}
	if ((rc = kvd_synth_make(&x->w, KVD_WL_MIXED, op->ctx, m.q_heads, H, d, 3000)))
		return fail("workload", kvd_strerror(rc));
	const size_t ans_n = (size_t)m.layers * m.q_heads * (d + 1);

	x->tok = malloc((size_t)op->ctx * sizeof *x->tok);
	x->k0 = malloc((size_t)H * op->ctx * d * sizeof *x->k0);
	x->v0 = malloc((size_t)H * op->ctx * d * sizeof *x->v0);
	x->ans_a = malloc(ans_n * sizeof *x->ans_a);
	x->ans_b = malloc(ans_n * sizeof *x->ans_b);
	if (!x->tok || !x->k0 || !x->v0 || !x->ans_a || !x->ans_b)
		return fail("buffers", "out of memory");
	memcpy(x->k0, x->w.k, (size_t)H * op->ctx * d * sizeof *x->k0);
	memcpy(x->v0, x->w.v, (size_t)H * op->ctx * d * sizeof *x->v0);
	/* Token ids of this run's own (content keys name them): a cluster
	 * given with --seeds may hold an earlier run's prompt. */
	for (uint32_t i = 0; i < op->ctx; i++)
		x->tok[i] = (uint32_t)(seed * 1000003u + i * 7919u) ^ (uint32_t)(seed >> 32);

	if (start_daemon(x, &x->a, x->spill_a, sizeof x->spill_a, "a", "") ||
	    start_daemon(x, &x->b, x->spill_b, sizeof x->spill_b, "b", ""))
		return 1;
	oa.socket_path = x->a.sock;
	ob.socket_path = x->b.sock;
	if ((rc = kvc_connect(&oa, &x->ca)) || (rc = kvc_profile(x->ca, &m)))
		return kvc_fail(x->ca, "connect to A", rc);
	if ((rc = kvc_connect(&ob, &x->cb)) || (rc = kvc_profile(x->cb, &m)))
		return kvc_fail(x->cb, "connect to B", rc);
	chunk = kvc_chunk_tokens(x->ca);
	if (!chunk || op->ctx % chunk) {
		fprintf(stderr, "kvbench remote: --ctx %u: not a multiple of kvd's chunk of %u tokens\n",
			op->ctx, chunk);
		return 1;
	}
	if (!(keys = malloc((size_t)(op->ctx / chunk) * KVC_KEY_BYTES)))
		return fail("buffers", "out of memory");
	nk = kvc_content_keys(x->ca, x->tok, op->ctx, keys);
	if (nk != (int)(op->ctx / chunk)) {
		free(keys);
		return fail("content keys", "wrong count");
	}

	/* A: prefill, publish, answer. */
	t = bench_now_ms();
	if ((rc = kvc_seq_create(x->ca, &sa)) || (rc = extend_all(x, x->ca, sa, m.layers)))
		goto fail_a;
	res->prefill_a_ms = bench_now_ms() - t;
	t = bench_now_ms();
	if ((rc = kvc_seq_publish(x->ca, sa, keys + (size_t)(nk - 1) * KVC_KEY_BYTES)))
		goto fail_a;
	double published = bench_now_ms();

	res->publish_ms = published - t;
	if ((rc = answer(x, x->ca, sa, &m, x->ans_a)))
		goto fail_a;

	/* The manifest in the cluster: A's upload is done. */
	snprintf(msg, sizeof msg, "u%u", (unsigned)getuid());
	kvd_remote_stem("kvd", msg, keys + (size_t)(nk - 1) * KVC_KEY_BYTES, stem, sizeof stem);
	snprintf(name, sizeof name, "%s:m", stem);
	struct kvd_rcl_op mo = { .kind = KVD_RCL_EXISTS, .key = name, .klen = strlen(name) };
	int found = 0;

	for (int i = 0; i < 30000 && !found; i++) {     /* 300 s */
		mo = (struct kvd_rcl_op){ .kind = KVD_RCL_EXISTS, .key = name, .klen = strlen(name) };
		found = kvd_rcl_run(x->rcl, &mo, 1, msg, sizeof msg) == 0 && mo.rc == 0;
		if (!found)
			daemon_sleep_ms(10);
	}
	res->upload_ms = bench_now_ms() - published;
	if (!found) {
		free(keys);
		return fail("upload", "A's prefix never reached the cluster (300 s)");
	}
	mo = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = name, .klen = strlen(name) };
	if (kvd_rcl_run(x->rcl, &mo, 1, msg, sizeof msg) == 0 && mo.rc == 0 &&
	    mo.len == sizeof(struct kvd_remote_manifest)) {
		struct kvd_remote_manifest mf;

		memcpy(&mf, mo.data, sizeof mf);
		res->prefix_bytes = mf.bytes;
		res->chunks = x->prefix_chunks = mf.chunks;
	}
	free(mo.data);
	/* A cluster given with --seeds keeps no prefix of ours after the run. */
	if (!x->own_cluster)
		snprintf(x->prefix_stem, sizeof x->prefix_stem, "%s", stem);

	/* B: warm the connection (untimed), then restore from the cluster,
	 * then a private prefill of the same tokens. */
	if ((rc = kvc_seq_create(x->cb, &sp)) || (rc = extend_all(x, x->cb, sp, m.layers)))
		goto fail_b;
	rc = kvc_seq_free(x->cb, sp);
	sp = NULL;
	if (rc)
		goto fail_b;
	t = bench_now_ms();
	rc = kvc_seq_attach(x->cb, keys, (uint32_t)nk, &sx, &res->got);
	res->restore_ms = bench_now_ms() - t;
	if (rc)
		goto fail_b;
	int whole = res->got == op->ctx;

	for (uint32_t l = 0; l < m.layers; l++)
		whole &= kvc_seq_tokens(sx, l) == op->ctx;
	if ((rc = answer(x, x->cb, sx, &m, x->ans_b)))
		goto fail_b;
	res->identical = whole && !memcmp(x->ans_a, x->ans_b, ans_n * sizeof *x->ans_a);
	t = bench_now_ms();
	if ((rc = kvc_seq_create(x->cb, &sp)) || (rc = extend_all(x, x->cb, sp, m.layers)))
		goto fail_b;
	res->prefill_ms = bench_now_ms() - t;
	if ((rc = answer(x, x->cb, sp, &m, x->ans_b)))
		goto fail_b;
	res->prefill_identical = !memcmp(x->ans_a, x->ans_b, ans_n * sizeof *x->ans_a);
	free(keys);
	if ((rc = kvc_seq_free(x->cb, sx)) || (rc = kvc_seq_free(x->cb, sp)) ||
	    (rc = kvc_seq_free(x->ca, sa)))
		return kvc_fail(x->ca, "free", rc);
	kvc_close(x->ca);
	kvc_close(x->cb);
	x->ca = x->cb = NULL;
	res->exit_a = daemon_stop(&x->a);
	res->exit_b = daemon_stop(&x->b);
	if (!whole)
		fprintf(stderr, "kvbench remote: B's attach got %llu of %u tokens\n",
			(unsigned long long)res->got, op->ctx);
	return 0;

fail_a:
	free(keys);
	return kvc_fail(x->ca, "daemon A", rc);
fail_b:
	free(keys);
	return kvc_fail(x->cb, "daemon B", rc);
}

/* Every layer of s answered into out, timed. */
static int timed_answer(struct rm *x, struct kvc *c, struct kvc_seq *s, const struct kvc_model *m,
			float *out, double *ms)
{
	double t = bench_now_ms();
	int rc = answer(x, c, s, m, out);

	*ms = bench_now_ms() - t;
	return rc;
}

static int evicted(struct rm *x, struct rs_res *res)
{
	const struct rm_opts *op = &x->op;
	struct kvc_model m = llama(op->layers);
	struct kvc_opts oc = { .tenant = "bench", .name = "remote-c" };
	struct kvc_seq *s1 = NULL, *s2 = NULL;
	struct kvc_seq_stats st;
	const size_t ans_n = (size_t)m.layers * m.q_heads * (m.head_dim + 1);
	char more[128];
	struct statfs sf;
	double t;
	int rc;

	if (op->layers != 32) {
		m.dense_layers = dense0;
		m.n_dense = 1;
	}
	/* The private file is the published one less its PUB and LOCAL
	 * extents: room for one, not two. */
	snprintf(more, sizeof more, "evicted = yes\n[limits]\nspill_per_uid = %llu\n",
		 (unsigned long long)(res->prefix_bytes * 3 / 2 > (1u << 20) ? res->prefix_bytes * 3 / 2
									 : 1u << 20));
	if (start_daemon(x, &x->c, x->spill_c, sizeof x->spill_c, "c", more))
		return 1;
	res->tmpfs = statfs(x->spill_c, &sf) == 0 && sf.f_type == 0x01021994;   /* TMPFS_MAGIC */
	oc.socket_path = x->c.sock;
	if ((rc = kvc_connect(&oc, &x->cc)) || (rc = kvc_profile(x->cc, &m)))
		return kvc_fail(x->cc, "connect to C", rc);
	if ((rc = kvc_seq_create(x->cc, &s1)) || (rc = extend_all(x, x->cc, s1, m.layers)) ||
	    (rc = kvc_seq_create(x->cc, &s2)) || (rc = extend_all(x, x->cc, s2, m.layers)) ||
	    (rc = answer(x, x->cc, s1, &m, x->ans_a)))
		return kvc_fail(x->cc, "daemon C", rc);
	if ((rc = kvc_seq_evict(x->cc, s1)))
		return kvc_fail(x->cc, "evict S1", rc);
	for (int i = 0; i < 30000; i++) {
		if (kvc_seq_stats(x->cc, s1, &st) == 0 && st.state == KVC_SEQ_DISK && st.durable)
			break;
		daemon_sleep_ms(10);
	}
	res->file_bytes = st.disk_bytes;
	/* S2's write waits for S1's copy, which then makes room. */
	t = bench_now_ms();
	for (int i = 0; i < 30000 && (rc = kvc_seq_evict(x->cc, s2)); i++)
		daemon_sleep_ms(10);
	if (rc)
		return kvc_fail(x->cc, "evict S2 (S1's copy never made room)", rc);
	for (int i = 0; i < 30000; i++) {
		if (kvc_seq_stats(x->cc, s2, &st) == 0 && st.state == KVC_SEQ_DISK && st.durable)
			break;
		daemon_sleep_ms(10);
	}
	res->evict_wait_ms = bench_now_ms() - t;
	if (kvc_seq_stats(x->cc, s1, &st) || st.state != KVC_SEQ_DISK || st.disk_bytes)
		return fail("evicted scene", "S1's local file is still there");
	if ((rc = timed_answer(x, x->cc, s1, &m, x->ans_b, &res->evicted_restore_ms)))
		return kvc_fail(x->cc, "S1 from the cluster", rc);
	res->evicted_identical = !memcmp(x->ans_a, x->ans_b, ans_n * sizeof *x->ans_a);
	if ((rc = timed_answer(x, x->cc, s2, &m, x->ans_b, &res->local_restore_ms)))
		return kvc_fail(x->cc, "S2 from local disk", rc);
	res->evicted_identical &= !memcmp(x->ans_a, x->ans_b, ans_n * sizeof *x->ans_a);
	if ((rc = kvc_seq_free(x->cc, s1)) || (rc = kvc_seq_free(x->cc, s2)))
		return kvc_fail(x->cc, "free", rc);
	kvc_close(x->cc);
	x->cc = NULL;
	res->exit_c = daemon_stop(&x->c);
	return 0;
}

/* ---- output --------------------------------------------------------------- */

static void runs_json(const double *v, double scale)
{
	for (int i = 0; i < RM_REPS; i++)
		printf("%s%.1f", i ? "," : "[", v[i] * scale);
	printf("]");
}

static int report(struct rm *x, const struct tp_res *kv, const struct rb_res *rb,
		  const struct rs_res *rs)
{
	const struct rm_opts *op = &x->op;
	const double bytes = (double)op->values * op->value;
	const double kw = bytes / (kv->write_ms / 1e3), kr = bytes / (kv->read_ms / 1e3);
	const double rw = rb->set_rps * op->value, rr = rb->get_rps * op->value;
	long cores = sysconf(_SC_NPROCESSORS_ONLN);
	const char *cluster = x->own_cluster ? "own: 3 masters, 1 replica each, loopback" : "seeds";
	int ok = rb->verified && rs->identical && rs->prefill_identical && !rs->exit_a &&
		 !rs->exit_b && rs->evicted_identical && !rs->exit_c;
	const double ev_ratio = rs->evicted_restore_ms / rs->local_restore_ms;

	if (op->json) {
		double w[RM_REPS], r[RM_REPS];

		for (int i = 0; i < RM_REPS; i++) {
			w[i] = bytes / (kv->write_runs[i] / 1e3);
			r[i] = bytes / (kv->read_runs[i] / 1e3);
		}
		printf("{\"bench\":\"remote\",\"kind\":\"kvd_write\",\"value_bytes\":%llu,"
		       "\"values\":%u,\"pipeline\":%u,\"reps\":%d,\"ms\":%.2f,\"bytes_per_s\":%.0f,"
		       "\"runs_bytes_per_s\":",
		       (unsigned long long)op->value, op->values, op->pipeline, RM_REPS, kv->write_ms, kw);
		runs_json(w, 1);
		printf(",\"wait_ms\":%.2f,\"wait_acks\":%d,\"slot\":%u,\"master\":\"%s:%d\"}\n",
		       kv->wait_ms, kv->acks, x->slot, x->host, x->port);
		printf("{\"bench\":\"remote\",\"kind\":\"kvd_read\",\"value_bytes\":%llu,"
		       "\"values\":%u,\"pipeline\":%u,\"reps\":%d,\"ms\":%.2f,\"bytes_per_s\":%.0f,"
		       "\"runs_bytes_per_s\":",
		       (unsigned long long)op->value, op->values, op->pipeline, RM_REPS, kv->read_ms, kr);
		runs_json(r, 1);
		printf(",\"verified\":true,\"slot\":%u,\"master\":\"%s:%d\"}\n", x->slot, x->host,
		       x->port);
		printf("{\"bench\":\"remote\",\"kind\":\"redis_benchmark_set\",\"value_bytes\":%llu,"
		       "\"values\":%u,\"pipeline\":%u,\"reps\":%d,\"rps\":%.2f,\"bytes_per_s\":%.0f,"
		       "\"runs_bytes_per_s\":",
		       (unsigned long long)op->value, op->values, op->pipeline, RM_REPS, rb->set_rps, rw);
		runs_json(rb->set_runs, (double)op->value);
		printf(",\"set_calls\":%llu,\"errors\":%llu,\"verified\":%s,\"slot\":%u,"
		       "\"master\":\"%s:%d\"}\n",
		       (unsigned long long)rb->set_calls, (unsigned long long)rb->errors,
		       rb->verified ? "true" : "false", x->slot, x->host, x->port);
		printf("{\"bench\":\"remote\",\"kind\":\"redis_benchmark_get\",\"value_bytes\":%llu,"
		       "\"values\":%u,\"pipeline\":%u,\"reps\":%d,\"rps\":%.2f,\"bytes_per_s\":%.0f,"
		       "\"runs_bytes_per_s\":",
		       (unsigned long long)op->value, op->values, op->pipeline, RM_REPS, rb->get_rps, rr);
		runs_json(rb->get_runs, (double)op->value);
		printf(",\"get_calls\":%llu,\"get_hits\":%llu,\"get_misses\":%llu,\"errors\":%llu,"
		       "\"verified\":%s,\"slot\":%u,\"master\":\"%s:%d\"}\n",
		       (unsigned long long)rb->get_calls, (unsigned long long)rb->get_hits,
		       (unsigned long long)rb->get_misses, (unsigned long long)rb->errors, rb->verified ? "true" : "false", x->slot,
		       x->host, x->port);
		printf("{\"bench\":\"remote\",\"kind\":\"restore\",\"ctx\":%u,\"layers\":%u,"
		       "\"dense_layers\":1,\"q_heads\":32,\"kv_heads\":8,\"head_dim\":128,"
		       "\"workload\":\"mixed\",\"chunk_bytes\":%llu,\"prefix_bytes\":%llu,\"chunks\":%llu,"
		       "\"prefill_a_ms\":%.1f,\"publish_ms\":%.2f,\"upload_ms\":%.1f,"
		       "\"restore_ms\":%.1f,\"prefill_ms\":%.1f,\"restore_vs_prefill\":%.4f,"
		       "\"got_tokens\":%llu,\"identical\":%s,\"prefill_identical\":%s,"
		       "\"kvd_exit\":[%d,%d]}\n",
		       op->ctx, op->layers, (unsigned long long)op->value,
		       (unsigned long long)rs->prefix_bytes, (unsigned long long)rs->chunks,
		       rs->prefill_a_ms, rs->publish_ms, rs->upload_ms, rs->restore_ms, rs->prefill_ms,
		       rs->restore_ms / rs->prefill_ms, (unsigned long long)rs->got,
		       rs->identical ? "true" : "false", rs->prefill_identical ? "true" : "false",
		       rs->exit_a, rs->exit_b);
		printf("{\"bench\":\"remote\",\"kind\":\"evicted\",\"ctx\":%u,\"layers\":%u,"
		       "\"file_bytes\":%llu,\"evict_wait_ms\":%.1f,\"evicted_restore_ms\":%.1f,"
		       "\"local_restore_ms\":%.1f,\"evicted_vs_local\":%.3f,"
		       "\"evicted_vs_prefill\":%.4f,\"spill_fs\":\"%s\",\"identical\":%s,"
		       "\"kvd_exit\":%d}\n",
		       op->ctx, op->layers, (unsigned long long)rs->file_bytes, rs->evict_wait_ms,
		       rs->evicted_restore_ms, rs->local_restore_ms, ev_ratio,
		       rs->evicted_restore_ms / rs->prefill_ms, rs->tmpfs ? "tmpfs" : "other",
		       rs->evicted_identical ? "true" : "false", rs->exit_c);
		printf("{\"bench\":\"remote\",\"kind\":\"summary\",\"value_bytes\":%llu,\"values\":%u,"
		       "\"pipeline\":%u,\"reps\":%d,\"kvd_write_bytes_per_s\":%.0f,"
		       "\"kvd_read_bytes_per_s\":%.0f,\"redis_benchmark_set_bytes_per_s\":%.0f,"
		       "\"redis_benchmark_get_bytes_per_s\":%.0f,\"write_vs_redis_benchmark\":%.3f,"
		       "\"read_vs_redis_benchmark\":%.3f,\"redis_benchmark_verified\":%s,"
		       "\"ctx\":%u,\"layers\":%u,\"restore_ms\":%.1f,\"prefill_ms\":%.1f,"
		       "\"restore_vs_prefill\":%.4f,\"identical\":%s,\"evicted_vs_local\":%.3f,"
		       "\"evicted_identical\":%s,\"cluster\":\"%s\",\"replicas\":%u,\"redis_version\":\"%s\",\"cpu\":\"%s\",\"cores\":%ld}\n",
		       (unsigned long long)op->value, op->values, op->pipeline, RM_REPS, kw, kr, rw, rr,
		       kw / rw, kr / rr, rb->verified ? "true" : "false", op->ctx, op->layers,
		       rs->restore_ms, rs->prefill_ms, rs->restore_ms / rs->prefill_ms,
		       rs->identical ? "true" : "false", ev_ratio,
		       rs->evicted_identical ? "true" : "false", cluster, x->replicas, x->redis_version,
		       bench_cpu_name(), cores);
	} else {
		printf("kvbench remote: Redis %s cluster (%s), master %s:%d, slot %u, %u replica(s); "
		       "%s, %ld cores\n"
		       "  %u values of %llu bytes, pipeline %u, one connection; medians of %d runs, "
		       "interleaved\n"
		       "                       write MB/s   read MB/s\n"
		       "  kvd_rcl              %10.1f  %10.1f   (WAIT for the replica after writes: %.1f ms)\n"
		       "  redis-benchmark      %10.1f  %10.1f   (checked on the master: %s)\n"
		       "  kvd / redis-bench    %10.3f  %10.3f\n"
		       "  restore: %u tokens, %u layers (1 dense), prefix %.1f MiB in %llu chunks; "
		       "A prefill %.1f ms, upload %.1f ms\n"
		       "  B: restore from the cluster %.1f ms, private prefill %.1f ms: "
		       "restore / prefill %.4f; identical: %s (prefill: %s)\n"
		       "  C (evicted = yes): %.1f MiB file; restore from the cluster %.1f ms, "
		       "from local disk (%s) %.1f ms: %.3f; identical: %s\n",
		       x->redis_version, cluster, x->host, x->port, x->slot, x->replicas,
		       bench_cpu_name(), cores, op->values, (unsigned long long)op->value,
		       op->pipeline, RM_REPS, kw / 1e6, kr / 1e6, kv->wait_ms, rw / 1e6, rr / 1e6,
		       rb->verified ? "yes" : "NO", kw / rw, kr / rr, op->ctx, op->layers,
		       rs->prefix_bytes / 1048576.0, (unsigned long long)rs->chunks, rs->prefill_a_ms,
		       rs->upload_ms, rs->restore_ms, rs->prefill_ms, rs->restore_ms / rs->prefill_ms,
		       rs->identical ? "yes" : "NO", rs->prefill_identical ? "yes" : "NO",
		       rs->file_bytes / 1048576.0, rs->evicted_restore_ms,
		       rs->tmpfs ? "tmpfs" : "disk", rs->local_restore_ms, ev_ratio,
		       rs->evicted_identical ? "yes" : "NO");
	}
	fflush(stdout);
	if (!rb->verified)
		fprintf(stderr, "kvbench remote: redis-benchmark's requests did not all succeed\n");
	if (!rs->identical || !rs->prefill_identical)
		fprintf(stderr, "kvbench remote: B did not answer as A, bit for bit\n");
	if (!rs->evicted_identical)
		fprintf(stderr, "kvbench remote: C's evicted sequences did not answer as before\n");
	return ok ? 0 : 1;
}

static void rm_free(struct rm *x)
{
	if (x->ca)
		kvc_close(x->ca);
	if (x->cb)
		kvc_close(x->cb);
	if (x->cc)
		kvc_close(x->cc);
	if (x->a.pid > 0)
		daemon_stop(&x->a);
	if (x->b.pid > 0)
		daemon_stop(&x->b);
	if (x->c.pid > 0)
		daemon_stop(&x->c);
	if (x->spill_a[0])
		daemon_rm_tree(x->spill_a);
	if (x->spill_b[0])
		daemon_rm_tree(x->spill_b);
	if (x->spill_c[0])
		daemon_rm_tree(x->spill_c);
	if (x->rcl && x->names && !x->own_cluster) {
		double ms;

		kvd_pass(x, KVD_RCL_DEL, &ms);  /* whatever a failed run left */
	}
	for (uint64_t i = 0; x->rcl && x->prefix_stem[0] && i <= x->prefix_chunks; i++) {
		char name[sizeof x->prefix_stem + 24], msg[200];
		struct kvd_rcl_op op = { .kind = KVD_RCL_DEL, .key = name };

		if (i < x->prefix_chunks)
			snprintf(name, sizeof name, "%s:%llu", x->prefix_stem, (unsigned long long)i);
		else
			snprintf(name, sizeof name, "%s:m", x->prefix_stem);
		op.klen = strlen(name);
		kvd_rcl_run(x->rcl, &op, 1, msg, sizeof msg);
	}
	if (x->mc) {
		if (!x->own_cluster)
			freeReplyObject(redisCommand(x->mc, "DEL %s", RB_KEY));
		redisFree(x->mc);
	}
	kvd_rcl_destroy(x->rcl);
	if (x->own_cluster)
		rcluster_stop(&x->rc);
	for (uint32_t i = 0; x->got && i < x->op.values; i++)
		free(x->got[i]);
	free(x->got);
	free(x->dst);
	free(x->got_len);
	free(x->ops);
	free(x->names);
	free(x->src);
	kvd_synth_free(&x->w);
	free(x->tok);
	free(x->k0);
	free(x->v0);
	free(x->ans_a);
	free(x->ans_b);
	free(x);
}

int bench_remote_main(int argc, char **argv)
{
	struct rm *x = calloc(1, sizeof *x);
	struct tp_res kv = { 0 };
	struct rb_res rb = { 0 };
	struct rs_res rs = { 0 };
	int rc;

	if (!x)
		return fail("kvbench remote", "out of memory");
	x->op = (struct rm_opts){ .ctx = 16384, .layers = 8, .pipeline = 8, .values = 64,
				  .value = 4u << 20 };
	for (int i = 0; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		uint32_t *dst = !strcmp(a, "--ctx") ? &x->op.ctx :
				!strcmp(a, "--layers") ? &x->op.layers :
				!strcmp(a, "--pipeline") ? &x->op.pipeline :
				!strcmp(a, "--values") ? &x->op.values : NULL;

		if (!strcmp(a, "--json")) {
			x->op.json = 1;
			continue;
		}
		i++;
		if (v && !strcmp(a, "--seeds") && *v) {
			x->op.seeds = v;
			continue;
		}
		if (v && !strcmp(a, "--value") && !parse_size(v, &x->op.value))
			continue;
		if (!v || !dst || bench_parse_u32(v, dst) || x->op.layers < 2 || x->op.layers > 32 ||
		    x->op.ctx < 1024 || (uint64_t)x->op.values * x->op.value > (16ull << 30)) {
			free(x);
			return usage();
		}
	}
	signal(SIGPIPE, SIG_IGN);
	if (x->op.seeds) {
		snprintf(x->seeds, sizeof x->seeds, "%s", x->op.seeds);
	} else {
		if ((rc = rcluster_start(&x->rc, 3, 1))) {
			free(x);
			return fail("Redis Cluster", rc == -ENOENT ? "redis-server or redis-cli missing"
								   : "did not start (see above)");
		}
		x->own_cluster = 1;
		rcluster_seeds(&x->rc, x->seeds, sizeof x->seeds);
	}
	rc = throughput(x, &kv, &rb);
	if (!rc)
		rc = restore(x, &rs);
	if (!rc)
		rc = evicted(x, &rs);
	if (!rc)
		rc = report(x, &kv, &rb, &rs);
	rm_free(x);
	return rc;
}
