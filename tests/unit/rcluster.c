/* A Redis Cluster on loopback for the tests (rcluster.h). */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "rcluster.h"

#define SLOTS 16384
#define HOST "127.0.0.1"

static void nap(int ms)
{
	nanosleep(&(struct timespec){ ms / 1000, (long)(ms % 1000) * 1000000L }, NULL);
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* Free for redis-server: nothing bound to it, not even a TIME_WAIT that
 * would make bind() without SO_REUSEADDR fail. */
static bool port_free(int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	bool ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0;

	if (fd >= 0)
		close(fd);
	return ok;
}

/* One admin command to the node on port, or NULL (and why on stderr). */
static redisReply *cmd(int port, const char *fmt, ...)
{
	redisContext *x = redisConnectWithTimeout(HOST, port, (struct timeval){ 2, 0 });
	redisReply *r = NULL;
	va_list ap;

	if (x && !x->err && redisSetTimeout(x, (struct timeval){ 10, 0 }) == REDIS_OK) {
		va_start(ap, fmt);
		r = redisvCommand(x, fmt, ap);
		va_end(ap);
	}
	if (!r)
		fprintf(stderr, "rcluster: %d: %s\n", port, x ? x->errstr : "out of memory");
	redisFree(x);
	return r;
}

/* The node on port answers PING (quietly: it may be starting). */
static bool answers(int port)
{
	redisContext *x = redisConnectWithTimeout(HOST, port, (struct timeval){ 1, 0 });
	redisReply *r = x && !x->err ? redisCommand(x, "PING") : NULL;
	bool ok = r && r->type == REDIS_REPLY_STATUS;

	freeReplyObject(r);
	redisFree(x);
	return ok;
}

/* The command's reply is +OK. */
static int cmd_ok(int port, const char *what, redisReply *r)
{
	int rc = r && r->type == REDIS_REPLY_STATUS && !strcmp(r->str, "OK") ? 0 : -EIO;

	if (r && rc)
		fprintf(stderr, "rcluster: %d: %s: %s\n", port, what, r->str ? r->str : "(not OK)");
	freeReplyObject(r);
	return r ? rc : -ECONNREFUSED;
}

/* Forks argv with output to the file out; the child dies with us. */
static pid_t spawn(char *const argv[], const char *out)
{
	pid_t parent = getpid(), pid;
	int fd = open(out, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

	if (fd < 0)
		return -errno;
	pid = fork();
	if (pid == 0) {
		/* A test that aborts takes its cluster with it. */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(126);
		dup2(fd, 1);
		dup2(fd, 2);
		execvp(argv[0], argv);
		_exit(127);
	}
	close(fd);
	return pid < 0 ? -errno : pid;
}

/* Each slot's master port as the node on port sees it (0: none). */
static int slot_map(int port, uint16_t *map)
{
	redisReply *r = cmd(port, "CLUSTER SLOTS");
	int rc = -EPROTO;

	memset(map, 0, SLOTS * sizeof *map);
	if (!r)
		return -ECONNREFUSED;
	if (r->type != REDIS_REPLY_ARRAY)
		goto out;
	for (size_t i = 0; i < r->elements; i++) {
		redisReply *e = r->element[i];

		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[2]->elements < 2)
			goto out;
		for (long long s = e->element[0]->integer; s <= e->element[1]->integer && s < SLOTS; s++)
			map[s] = (uint16_t)e->element[2]->element[1]->integer;
	}
	rc = 0;
out:
	freeReplyObject(r);
	return rc;
}

static bool live(const struct rcluster *rc, int port)
{
	return port >= rc->base && port < rc->base + rc->n && rc->pid[port - rc->base] > 0;
}

static int first_live(const struct rcluster *rc)
{
	for (int i = 0; i < rc->n; i++)
		if (rc->pid[i] > 0)
			return rc->base + i;
	return -ESRCH;
}

/* How far the cluster is from ready, or "" when it is: every live node
 * says ok and agrees on a map of live masters; with replicas >= 0 every
 * master also has that many replicas online. */
static const char *not_ready(const struct rcluster *rc, int replicas, char *why, size_t n)
{
	static uint16_t map[SLOTS], first[SLOTS];
	bool have = false;

	for (int i = 0; i < rc->n; i++) {
		int port = rc->base + i;
		redisReply *r;
		bool ok;

		if (rc->pid[i] <= 0)
			continue;
		r = cmd(port, "CLUSTER INFO");
		ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok") &&
		     strstr(r->str, "cluster_slots_ok:16384");
		freeReplyObject(r);
		if (!ok) {
			snprintf(why, n, "%d: cluster_state not ok", port);
			return why;
		}
		if (slot_map(port, have ? map : first)) {
			snprintf(why, n, "%d: CLUSTER SLOTS failed", port);
			return why;
		}
		if (have && memcmp(map, first, sizeof map)) {
			snprintf(why, n, "%d: a slot map of its own", port);
			return why;
		}
		have = true;
	}
	if (!have)
		return snprintf(why, n, "no node running"), why;
	for (int s = 0; s < SLOTS; s++) {
		redisReply *r;
		const char *p;
		int online = 0;

		if (!live(rc, first[s])) {
			snprintf(why, n, "slot %d: master %d is not running", s, first[s]);
			return why;
		}
		if (replicas < 0 || (s && first[s] == first[s - 1]))
			continue;
		r = cmd(first[s], "INFO replication");
		for (p = r && r->type == REDIS_REPLY_STRING ? r->str : ""; (p = strstr(p, "state=online")); p++)
			online++;
		freeReplyObject(r);
		if (online < replicas) {
			snprintf(why, n, "master %d: %d of %d replicas online", first[s], online, replicas);
			return why;
		}
	}
	return "";
}

static int wait_ready(const struct rcluster *rc, int replicas, int timeout_ms)
{
	long long end = now_ms() + timeout_ms;
	char why[128];

	while (*not_ready(rc, replicas, why, sizeof why)) {
		if (now_ms() > end) {
			fprintf(stderr, "rcluster: not ready after %d ms: %s\n", timeout_ms, why);
			return -ETIMEDOUT;
		}
		nap(100);
	}
	return 0;
}

int rcluster_wait_ok(const struct rcluster *rc, int timeout_ms)
{
	return wait_ready(rc, -1, timeout_ms);
}

/* Waits for child pid up to timeout_ms: its exit status, or -ETIMEDOUT. */
static int reap(pid_t pid, int timeout_ms)
{
	long long end = now_ms() + timeout_ms;
	int st;

	while (waitpid(pid, &st, WNOHANG) == 0) {
		if (now_ms() > end)
			return -ETIMEDOUT;
		nap(20);
	}
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static int node_start(struct rcluster *rc, int i)
{
	char port[16], dir[160], log[192];
	char *argv[] = { "redis-server", "--port", port, "--bind", HOST, "--dir", dir, "--logfile", log,
			 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			 "--cluster-node-timeout", "1000", "--appendonly", "no", "--save", "",
			 "--daemonize", "no", "--protected-mode", "no",
			 /* the defaults delay a replica's first sync by 5 s */
			 "--repl-diskless-sync-delay", "0", NULL };
	pid_t pid;

	snprintf(port, sizeof port, "%d", rc->base + i);
	snprintf(dir, sizeof dir, "%s/%d", rc->dir, rc->base + i);
	snprintf(log, sizeof log, "%s/redis.log", dir);
	if (mkdir(dir, 0700) && errno != EEXIST)
		return -errno;
	pid = spawn(argv, log);
	if (pid < 0)
		return pid;
	rc->pid[i] = pid;
	return 0;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
	remove(path);
	return 0;
}

void rcluster_stop(struct rcluster *rc)
{
	rcluster_stop_all(rc);
	if (rc->dir[0])
		nftw(rc->dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
	rc->dir[0] = 0;
}

int rcluster_stop_all(struct rcluster *rc)
{
	for (int i = 0; i < rc->n; i++)
		if (rc->pid[i] > 0) {
			kill(rc->pid[i], SIGKILL);
			waitpid(rc->pid[i], NULL, 0);
			rc->pid[i] = 0;
		}
	return 0;
}

int rcluster_kill(struct rcluster *rc, int port)
{
	int i = port - rc->base;

	if (!live(rc, port)) {
		fprintf(stderr, "rcluster: no node running on %d\n", port);
		return -ESRCH;
	}
	kill(rc->pid[i], SIGKILL);
	waitpid(rc->pid[i], NULL, 0);
	rc->pid[i] = 0;
	return 0;
}

const char *rcluster_seeds(const struct rcluster *rc, char *buf, size_t n)
{
	size_t len = 0;

	if (n)
		buf[0] = 0;
	for (int i = 0; i < rc->n && len < n; i++)
		len += (size_t)snprintf(buf + len, n - len, "%s%s:%d", i ? "," : "", HOST, rc->base + i);
	return buf;
}

/* The end of a log to stderr: the directory goes when start fails. */
static void dump(const char *path)
{
	char buf[2048];
	FILE *f = fopen(path, "r");
	size_t n;

	if (!f)
		return;
	fseek(f, 0, SEEK_END);
	if (ftell(f) > (long)sizeof buf - 1)
		fseek(f, -(long)sizeof buf + 1, SEEK_END);
	else
		rewind(f);
	n = fread(buf, 1, sizeof buf - 1, f);
	buf[n] = 0;
	fclose(f);
	fprintf(stderr, "---- %s:\n%s\n----\n", path, buf);
}

/* Starts the cluster on the first free ports from the skip'th base on. */
static int start_at(struct rcluster *rc, int masters, int replicas, int skip)
{
	char *argv[8 + RCLUSTER_MAX] = { "redis-cli", "--cluster", "create" };
	char addr[RCLUSTER_MAX][24], nrep[16], log[160];
	int n = masters * (1 + replicas), k = 3, r;

	memset(rc, 0, sizeof *rc);
	if (masters < 3 || replicas < 0 || n > RCLUSTER_MAX) {
		fprintf(stderr, "rcluster: %d masters, %d replicas each: want 3+ masters, %d nodes at most\n",
			masters, replicas, RCLUSTER_MAX);
		return -EINVAL;
	}
	/* Below 32768 for the nodes and their buses (+10000), where the
	 * kernel hands out no ephemeral ports. */
	for (int t = 0; t < 160 && !rc->base; t++) {
		int base = 20000 + (int)((getpid() + skip + t) % 160) * 16;

		rc->base = base;
		for (int i = 0; i < n && rc->base; i++)
			if (!port_free(base + i) || !port_free(base + i + 10000))
				rc->base = 0;
	}
	if (!rc->base) {
		fprintf(stderr, "rcluster: no %d free ports between 20000 and 22576\n", n);
		return -EAGAIN;
	}
	snprintf(rc->dir, sizeof rc->dir, "%s/rcluster.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (!mkdtemp(rc->dir)) {
		r = -errno;
		fprintf(stderr, "rcluster: mkdtemp %s: %s\n", rc->dir, strerror(errno));
		rc->dir[0] = 0;
		return r;
	}
	rc->n = n;
	rc->masters = masters;
	for (int i = 0; i < n; i++)
		if ((r = node_start(rc, i))) {
			fprintf(stderr, "rcluster: starting redis-server: %s\n", strerror(-r));
			goto fail;
		}
	for (int i = 0; i < n; i++) {
		long long end = now_ms() + 10000;

		while (!answers(rc->base + i)) {
			if ((r = reap(rc->pid[i], 0)) >= 0) {
				rc->pid[i] = 0;
				fprintf(stderr, "rcluster: redis-server on %d exited with %d\n", rc->base + i, r);
				snprintf(log, sizeof log, "%s/%d/redis.log", rc->dir, rc->base + i);
				dump(log);
				/* Most likely another test took a port since. */
				r = r == 127 ? -ENOENT : -EADDRINUSE;
				goto fail;
			}
			if (now_ms() > end) {
				r = -ETIMEDOUT;
				goto fail;
			}
			nap(20);
		}
	}
	for (int i = 0; i < n; i++) {
		snprintf(addr[i], sizeof addr[i], "%s:%d", HOST, rc->base + i);
		argv[k++] = addr[i];
	}
	snprintf(nrep, sizeof nrep, "%d", replicas);
	argv[k++] = "--cluster-replicas";
	argv[k++] = nrep;
	argv[k++] = "--cluster-yes";
	argv[k] = NULL;
	snprintf(log, sizeof log, "%s/create.log", rc->dir);
	r = spawn(argv, log);
	if (r > 0) {
		pid_t pid = r;

		r = reap(pid, 30000);
		if (r == -ETIMEDOUT) {
			kill(pid, SIGKILL);
			waitpid(pid, NULL, 0);
		}
	}
	if (r) {
		fprintf(stderr, "rcluster: redis-cli --cluster create: %s\n",
			r < 0 ? strerror(-r) : r == 127 ? "not found" : "failed");
		dump(log);
		r = r < 0 ? r : r == 127 ? -ENOENT : -EIO;
		goto fail;
	}
	if (!(r = wait_ready(rc, replicas, 30000)))
		return 0;
fail:
	rcluster_stop(rc);
	return r;
}

int rcluster_master_port(const struct rcluster *rc, uint16_t slot)
{
	static uint16_t map[SLOTS];
	int port = first_live(rc), r;

	if (slot >= SLOTS)
		return -EINVAL;
	if (port < 0 || (r = slot_map(port, map)))
		return port < 0 ? port : r;
	return map[slot] ? map[slot] : -ENOENT;
}

static int node_id(int port, char *id, size_t n)
{
	redisReply *r = cmd(port, "CLUSTER MYID");
	int rc = r && r->type == REDIS_REPLY_STRING && r->len < n ? 0 : -EPROTO;

	if (!rc)
		memcpy(id, r->str, r->len + 1);
	freeReplyObject(r);
	return rc;
}

/* MIGRATEs up to max keys of slot from src to dst: how many, or -errno. */
static int move_keys(int src, int dst, uint16_t slot, int max)
{
	redisReply *keys = cmd(src, "CLUSTER GETKEYSINSLOT %d %d", (int)slot, max);
	int moved = 0, r = 0;

	if (!keys || keys->type != REDIS_REPLY_ARRAY) {
		freeReplyObject(keys);
		return -EPROTO;
	}
	for (size_t i = 0; i < keys->elements && !r; i++) {
		redisReply *k = keys->element[i];

		r = cmd_ok(src, "MIGRATE", cmd(src, "MIGRATE %s %d %b 0 10000", HOST, dst, k->str, k->len));
		moved++;
	}
	freeReplyObject(keys);
	return r ? r : moved;
}

int rcluster_migrate_begin(struct rcluster *rc, uint16_t slot, int to_port, int keys)
{
	int src = rcluster_master_port(rc, slot), r;
	char sid[64], did[64];

	if (src < 0)
		return src;
	if (src == to_port || !live(rc, to_port))
		return -EINVAL;
	if ((r = node_id(src, sid, sizeof sid)) || (r = node_id(to_port, did, sizeof did)))
		return r;
	if ((r = cmd_ok(to_port, "SETSLOT IMPORTING",
			cmd(to_port, "CLUSTER SETSLOT %d IMPORTING %s", (int)slot, sid))) ||
	    (r = cmd_ok(src, "SETSLOT MIGRATING", cmd(src, "CLUSTER SETSLOT %d MIGRATING %s", (int)slot, did))))
		return r;
	r = keys > 0 ? move_keys(src, to_port, slot, keys) : 0;
	return r < 0 ? r : 0;
}

int rcluster_migrate_finish(struct rcluster *rc, uint16_t slot, int to_port)
{
	static uint16_t map[SLOTS];
	int src = rcluster_master_port(rc, slot), r;
	char did[64];

	if (src < 0)
		return src;
	while (src != to_port && (r = move_keys(src, to_port, slot, 100)) > 0)
		;
	if (src != to_port && r < 0)
		return r;
	if ((r = node_id(to_port, did, sizeof did)) || (r = slot_map(to_port, map)))
		return r;
	/* The target first, then the source, as redis-cli does: the target's
	 * bumped epoch wins the gossip. */
	if ((r = cmd_ok(to_port, "SETSLOT NODE", cmd(to_port, "CLUSTER SETSLOT %d NODE %s", (int)slot, did))) ||
	    (src != to_port &&
	     (r = cmd_ok(src, "SETSLOT NODE", cmd(src, "CLUSTER SETSLOT %d NODE %s", (int)slot, did)))))
		return r;
	for (int s = 0; s < SLOTS; s++) {
		int m = map[s];

		if (!m || m == src || m == to_port || (s && map[s - 1] == m) || !live(rc, m))
			continue;
		if ((r = cmd_ok(m, "SETSLOT NODE", cmd(m, "CLUSTER SETSLOT %d NODE %s", (int)slot, did))))
			return r;
	}
	/* Replicas learn it by gossip: wait, so a test sees one map. */
	for (long long end = now_ms() + 10000; now_ms() < end; nap(50)) {
		bool agree = true;

		for (int i = 0; i < rc->n && agree; i++)
			agree = rc->pid[i] <= 0 || (!slot_map(rc->base + i, map) && map[slot] == to_port);
		if (agree)
			return 0;
	}
	fprintf(stderr, "rcluster: slot %u: not every node says %d serves it\n", slot, to_port);
	return -ETIMEDOUT;
}

int rcluster_start(struct rcluster *rc, int masters, int replicas)
{
	int r = -EADDRINUSE;

	for (int t = 0; t < 3 && r == -EADDRINUSE; t++)
		r = start_at(rc, masters, replicas, t * 37);
	return r;
}
