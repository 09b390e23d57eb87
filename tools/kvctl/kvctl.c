/* kvctl: kvd's admin CLI over the control socket (docs/kvctl.1).
 *
 * One control-only connection (Hello.control: kvd maps no shared memory for
 * it; it counts against the uid's connection limit like any other), one
 * request per subcommand, listings paged through to the end.  Every reply
 * is decoded and checked by kvd_ctl_decode_response() as libkvclient's are.
 *
 * What the caller sees is kvd's decision (SO_PEERCRED): root, kvd's own uid
 * and members of kvd's [server] admin_group see every uid; anyone else
 * only its own.
 *
 * Exit status (sysexits.h where one fits; the man page lists them):
 *   0  done
 *   1  kvd refused the request; its message is on stderr
 *   2  usage: unknown subcommand or option, a bad number
 *  69  EX_UNAVAILABLE: kvd not reachable (no socket, nobody listening, kvd
 *      stopping, no answer within --timeout)
 *  75  EX_TEMPFAIL: kvd refused the connection at a connection limit, or
 *      a drain still running after --timeout
 *  76  EX_PROTOCOL: kvd's answer did not decode, or the connection broke
 *  77  EX_NOPERM: no permission to connect to the socket
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "engine/attn.h"
#include "kvd/config.h"
#include "proto/ctl.h"
#include "engine/err.h"

enum {
	EXIT_REFUSED = 1,
	EXIT_USAGE = 2,
	EXIT_UNAVAILABLE = 69,
	EXIT_TEMPFAIL = 75,
	EXIT_PROTOCOL = 76,
	EXIT_NOPERM = 77,
};


static const char *prog = "kvctl";
static const char *sock_path = KVD_CONFIG_SOCKET;
static int json;
static int timeout_ms = 60000;
static const char *cmd_name = "";       /* for messages: "seq free 12" */
static char cmd_buf[128];

static int fd = -1;
static uint8_t *rx;
static uint64_t next_id;
static uint32_t kvd_pid;

__attribute__((format(printf, 2, 3), noreturn))
static void die(int code, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s: ", prog);
	if (cmd_name[0])
		fprintf(stderr, "%s: ", cmd_name);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(code);
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: %s [--socket PATH] [--json] [--timeout SECONDS] COMMAND [ARGS]\n"
		"\n"
		"kvd's admin tool, over its control socket.  Root, kvd's own uid and members\n"
		"of kvd's [server] admin_group see every uid; anyone else only their own.\n"
		"\n"
		"commands:\n"
		"  status              daemon counters, memory budget, spill tier, usage per uid\n"
		"  clients             connections: id, uid, pid, tenant, name, shared memory\n"
		"  seqs [--uid U]      sequences (of uid U: a number or a user name)\n"
		"  seq show ID         one sequence\n"
		"  seq evict ID        write it to the spill tier and drop it from RAM\n"
		"  seq free ID         free it (its client's next use of it fails)\n"
		"  profiles            model profiles: geometry, K/V dtype, estimator,\n"
		"                      references, bytes\n"
		"  limits              caps ([limits], memory, spill) and usage per uid\n"
		"  shares              published prefixes (snapshots): key, uid, tokens, bytes,\n"
		"                      what a drop gives back, attaches, idle time\n"
		"  share drop KEY      drop the prefixes published under KEY (32 hex digits);\n"
		"                      sequences attached from them keep their rows\n"
		"  drain [--no-wait]   stop kvd as SIGTERM does: stop accepting, answer what\n"
		"                      clients queued, exit; waits until kvd has let go\n"
		"  metrics             kvd's metrics, Prometheus text (other uids' series only\n"
		"                      for root, kvd's uid and [server] admin_group)\n"
		"\n"
		"options:\n"
		"  -s, --socket PATH   control socket (default " KVD_CONFIG_SOCKET ")\n"
		"  -j, --json          one JSON object (status, seq show, limits, drain,\n"
		"                      metrics) or array (clients, seqs, profiles, shares) on\n"
		"                      stdout\n"
		"  -t, --timeout S     wait at most S seconds for each answer, and for a\n"
		"                      drain to finish (default 60)\n"
		"  -h, --help          this text\n"
		"\n"
		"exit status: 0 done; 1 kvd refused (its message on stderr); 2 usage;\n"
		"69 kvd unreachable (no socket, not listening, stopping, no answer);\n"
		"75 at a connection limit, or drain not over within --timeout;\n"
		"76 kvd's answer did not decode or the connection broke; 77 no permission\n"
		"to connect.  man kvctl has the details.\n",
		prog);
}

__attribute__((format(printf, 1, 2), noreturn))
static void usage_error(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s: ", prog);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n(%s --help for usage)\n", prog);
	exit(EXIT_USAGE);
}

/* ---- numbers and sizes ------------------------------------------------- */

static int parse_u64(const char *s, uint64_t *out)
{
	uint64_t v = 0;

	if (!s || !*s)
		return -1;
	for (; *s; s++) {
		if (*s < '0' || *s > '9' || __builtin_mul_overflow(v, 10, &v) ||
		    __builtin_add_overflow(v, (uint64_t)(*s - '0'), &v))
			return -1;
	}
	*out = v;
	return 0;
}

static const char *human(char *buf, size_t cap, uint64_t b)
{
	static const char *const unit[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB" };
	double v = (double)b;
	int u = 0;

	while (v >= 1024 && u < 5) {
		v /= 1024;
		u++;
	}
	if (u == 0)
		snprintf(buf, cap, "%" PRIu64 " B", b);
	else
		snprintf(buf, cap, "%.1f %s", v, unit[u]);
	return buf;
}

#define H(x) human((char[32]){ 0 }, 32, (x))

static const char *state_name(uint32_t st)
{
	static const char *const n[] = { "ram", "spilling", "disk", "restoring", "lost" };

	return st < 5 ? n[st] : "?";
}

static const char *errname(int code)
{
	static char buf[32];
	const char *n;

	switch (-code) {
	case KVD_EGEOM:   return "KVD_EGEOM";
	case KVD_EFORMAT: return "KVD_EFORMAT";
	case KVD_ESHAPE:  return "KVD_ESHAPE";
	case KVD_ELOST:   return "KVD_ELOST";
	case KVD_EPROTO:  return "KVD_EPROTO";
	}
	n = code < 0 ? strerrorname_np(-code) : NULL;
	if (n)
		return n;
	snprintf(buf, sizeof buf, "code %d", code);
	return buf;
}

/* ---- JSON -------------------------------------------------------------- */

/* A minimal writer: nesting with commas handled, strings escaped. */
static int js_need_comma[16];
static int js_depth;

static void js_sep(void)
{
	if (js_need_comma[js_depth])
		putchar(',');
	js_need_comma[js_depth] = 1;
}

static void js_str_raw(const char *s)
{
	putchar('"');
	for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
		if (*p == '"' || *p == '\\')
			printf("\\%c", *p);
		else if (*p < 0x20 || *p >= 0x7f)
			printf("\\u%04x", *p);
		else
			putchar(*p);
	}
	putchar('"');
}

static void js_open(char c)
{
	putchar(c);
	js_need_comma[++js_depth] = 0;
}

static void js_close(char c)
{
	putchar(c);
	js_depth--;
}

static void js_key(const char *k)
{
	js_sep();
	js_str_raw(k);
	putchar(':');
	/* the value that follows needs no comma of its own */
	js_need_comma[js_depth] = 0;
}

static void js_val_done(void)
{
	js_need_comma[js_depth] = 1;
}

static void ju(const char *k, uint64_t v)
{
	js_key(k);
	printf("%" PRIu64, v);
	js_val_done();
}

static void jb(const char *k, int v)
{
	js_key(k);
	fputs(v ? "true" : "false", stdout);
	js_val_done();
}

static void js(const char *k, const char *v)
{
	js_key(k);
	js_str_raw(v);
	js_val_done();
}

static void jobj_open(const char *k)
{
	if (k)
		js_key(k);
	else
		js_sep();
	js_open('{');
}

static void jobj_close(void)
{
	js_close('}');
	js_val_done();
}

static void jarr_open(const char *k)
{
	if (k)
		js_key(k);
	else
		js_sep();
	js_open('[');
}

static void jarr_close(void)
{
	js_close(']');
	js_val_done();
}

/* ---- the connection ---------------------------------------------------- */

/* Waits for a datagram (or EOF) for at most timeout_ms. */
static int wait_readable(int ms)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	int n;

	do
		n = poll(&p, 1, ms);
	while (n < 0 && errno == EINTR);
	return n;
}

/* An Error kvd sent before we asked anything (a refused connection): id 0. */
static void refused_at_connect(const struct kvd_ctl_err *e)
{
	int code = e->code;

	if (code == -EDQUOT || code == -ENOSPC)
		die(EXIT_TEMPFAIL, "kvd refused the connection: %s (%s)", e->msg, errname(code));
	if (code == -ESHUTDOWN)
		die(EXIT_UNAVAILABLE, "kvd refused the connection: %s (%s)", e->msg, errname(code));
	die(EXIT_REFUSED, "kvd refused the connection: %s (%s)", e->msg, errname(code));
}

/* Sends rq, returns its decoded Response of body want; anything else is
 * reported and the program exits: an Error 1 (or as refused_at_connect for
 * an id-0 Error before Hello is answered), a reply of another body or none
 * as its kind. */
static Kvd__Response *call(Kvd__Request *rq, Kvd__Response__BodyCase want)
{
	int hello = rq->body_case == KVD__REQUEST__BODY_HELLO;
	struct kvd_ctl_err e;
	Kvd__Response *r;

	rq->id = ++next_id;
	r = kvd_ctl_call(fd, rq, want, rx, timeout_ms, NULL, NULL, &e);
	if (r)
		return r;
	if (e.remote && hello && e.id == 0)
		refused_at_connect(&e);
	if (e.remote)
		die(EXIT_REFUSED, "%s (%s)", e.msg, errname(e.code));
	if (e.code == -ETIMEDOUT)
		die(EXIT_UNAVAILABLE, "no answer from kvd at %s within %d s", sock_path,
		    timeout_ms / 1000);
	if (e.code == -EPIPE)
		die(hello ? EXIT_UNAVAILABLE : EXIT_PROTOCOL, "kvd at %s closed the connection%s",
		    sock_path, hello ? " (stopping?)" : "");
	die(EXIT_PROTOCOL, "%s", e.msg);
}

static void connect_kvd(void)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__Hello h = KVD__HELLO__INIT;
	Kvd__Response *r;

	if (strlen(sock_path) >= sizeof a.sun_path)
		usage_error("socket path too long (%zu bytes, at most %zu): %s", strlen(sock_path),
			    sizeof a.sun_path - 1, sock_path);
	memcpy(a.sun_path, sock_path, strlen(sock_path) + 1);
	rx = malloc(KVD_CTL_RX_MAX);
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (!rx || fd < 0)
		die(EXIT_UNAVAILABLE, "socket: %s", strerror(errno));
	if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
		int e = errno;

		if (e == EACCES || e == EPERM)
			die(EXIT_NOPERM, "cannot connect to %s: %s (kvd's socket is for root and "
			    "group kvd)", sock_path, strerror(e));
		if (e == ENOENT)
			die(EXIT_UNAVAILABLE, "cannot connect to %s: no such socket (is kvd running? "
			    "--socket PATH)", sock_path);
		if (e == ECONNREFUSED)
			die(EXIT_UNAVAILABLE, "cannot connect to %s: nobody listening (kvd not running)",
			    sock_path);
		die(EXIT_UNAVAILABLE, "cannot connect to %s: %s", sock_path, strerror(e));
	}
	h.version = KVD_CTL_VERSION;
	h.tenant = "";
	h.client_name = "kvctl";
	h.control = 1;
	rq.body_case = KVD__REQUEST__BODY_HELLO;
	rq.hello = &h;
	r = call(&rq, KVD__RESPONSE__BODY_HELLO);
	if (!r->hello->control)
		die(EXIT_PROTOCOL, "kvd at %s does not take control-only connections (an older "
		    "kvd?)", sock_path);
	kvd_pid = r->hello->pid;
	kvd_ctl_free_response(r);
}

/* ---- status ------------------------------------------------------------ */

static int by_uid(const void *a, const void *b)
{
	uint32_t x = (*(Kvd__UidUsage *const *)a)->uid, y = (*(Kvd__UidUsage *const *)b)->uid;

	return x < y ? -1 : x > y;
}

static void uid_rows_json(const char *key, Kvd__UidUsage **u, size_t n)
{
	jarr_open(key);
	for (size_t i = 0; i < n; i++) {
		jobj_open(NULL);
		ju("uid", u[i]->uid);
		ju("connections", u[i]->connections);
		ju("sequences", u[i]->sequences);
		ju("profiles", u[i]->profiles);
		ju("bytes", u[i]->bytes);
		ju("spill_bytes", u[i]->spill_bytes);
		ju("shm_bytes", u[i]->shm_bytes);
		ju("exec_ns", u[i]->exec_ns);
		ju("control_ns", u[i]->control_ns);
		ju("control_paused", u[i]->control_paused);
		ju("accepts", u[i]->accepts);
		ju("conn_refused", u[i]->conn_refused);
		jobj_close();
	}
	jarr_close();
}

static void uid_rows_text(Kvd__UidUsage **u, size_t n)
{
	printf("%-10s %6s %8s %8s %12s %12s %12s %10s %10s %8s %8s\n", "UID", "CONNS", "SEQS",
	       "PROFILES", "BYTES", "SPILL", "SHM", "EXEC_S", "CTL_S", "CTL_WAIT", "REFUSED");
	for (size_t i = 0; i < n; i++)
		printf("%-10u %6u %8u %8u %12s %12s %12s %10.3f %10.3f %8llu %8llu\n", u[i]->uid,
		       u[i]->connections, u[i]->sequences, u[i]->profiles, H(u[i]->bytes),
		       H(u[i]->spill_bytes), H(u[i]->shm_bytes), (double)u[i]->exec_ns / 1e9,
		       (double)u[i]->control_ns / 1e9, (unsigned long long)u[i]->control_paused,
		       (unsigned long long)u[i]->conn_refused);
}

static int cmd_status(void)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;
	const Kvd__ServerStats *m;

	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	r = call(&rq, KVD__RESPONSE__BODY_SERVER_STATS);
	m = r->server_stats;
	qsort(m->uids, m->n_uids, sizeof *m->uids, by_uid);
	if (json) {
		jobj_open(NULL);
		ju("pid", kvd_pid);
		ju("clients", m->clients);
		ju("sequences", m->sequences);
		ju("profiles", m->profiles);
		ju("bytes", m->bytes);
		ju("used_bytes", m->used_bytes);
		ju("mem_limit", m->mem_limit);
		ju("mem_high", m->mem_high);
		ju("mem_low", m->mem_low);
		ju("reserved_bytes", m->reserved_bytes);
		ju("requests", m->requests);
		ju("errors", m->errors);
		ju("disconnects", m->disconnects);
		ju("refused", m->refused);
		ju("slots_in_use", m->slots_in_use);
		ju("mapped_bytes", m->mapped_bytes);
		ju("on_disk", m->on_disk);
		ju("disk_bytes", m->disk_bytes);
		ju("spills", m->spills);
		ju("spill_bytes", m->spill_bytes);
		ju("restores", m->restores);
		ju("restore_bytes", m->restore_bytes);
		ju("drops", m->drops);
		ju("spill_errors", m->spill_errors);
		ju("lost", m->lost);
		uid_rows_json("uids", m->uids, m->n_uids);
		jobj_close();
		putchar('\n');
	} else {
		printf("kvd pid %u on %s\n", kvd_pid, sock_path);
		printf("clients %u, sequences %u (%u on disk), profiles %u\n", m->clients, m->sequences,
		       m->on_disk, m->profiles);
		if (m->mem_limit)
			printf("memory: %s used of %s (spill above %s, down to %s); sequences %s, "
			       "restores reserve %s\n", H(m->used_bytes), H(m->mem_limit), H(m->mem_high),
			       H(m->mem_low), H(m->bytes), H(m->reserved_bytes));
		else
			printf("memory: %s used, no limit; sequences %s\n", H(m->used_bytes), H(m->bytes));
		printf("ring entries: %" PRIu64 " completed, %" PRIu64 " failed; clients disconnected "
		       "%" PRIu64 ", connections refused %" PRIu64 "\n", m->requests, m->errors,
		       m->disconnects, m->refused);
		printf("shared memory: %s mapped, %u slots\n", H(m->mapped_bytes), m->slots_in_use);
		printf("spill: %s on disk; %" PRIu64 " spills (%s), %" PRIu64 " restores (%s), %" PRIu64
		       " drops, %" PRIu64 " errors, %" PRIu64 " lost\n", H(m->disk_bytes), m->spills,
		       H(m->spill_bytes), m->restores, H(m->restore_bytes), m->drops, m->spill_errors,
		       m->lost);
		if (m->n_uids) {
			putchar('\n');
			uid_rows_text(m->uids, m->n_uids);
		}
	}
	kvd_ctl_free_response(r);
	return 0;
}

/* ---- listings ---------------------------------------------------------- */

static void page_check(uint64_t after, uint64_t next)
{
	if (next && next <= after)
		die(EXIT_PROTOCOL, "kvd's listing went backwards (next %" PRIu64 " after %" PRIu64 ")",
		    next, after);
}

static int cmd_clients(void)
{
	uint64_t after = 0, next;
	unsigned rows = 0;

	if (json)
		jarr_open(NULL);
	else
		printf("%-8s %-10s %-8s %-8s %-16s %-16s %6s %8s %10s\n", "ID", "UID", "PID", "KIND",
		       "TENANT", "NAME", "SEQS", "PROFILES", "SHM");
	do {
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__ClientsReq cr = KVD__CLIENTS_REQ__INIT;
		Kvd__Response *r;

		cr.after = after;
		rq.body_case = KVD__REQUEST__BODY_CLIENTS;
		rq.clients = &cr;
		r = call(&rq, KVD__RESPONSE__BODY_CLIENT_LIST);
		for (size_t i = 0; i < r->client_list->n_clients; i++) {
			const Kvd__ClientInfo *c = r->client_list->clients[i];
			const char *kind = c->control ? "control" : c->hello ? "data" : "new";

			rows++;
			if (json) {
				jobj_open(NULL);
				ju("id", c->client_id);
				ju("uid", c->uid);
				ju("pid", c->pid);
				js("kind", kind);
				js("tenant", c->tenant);
				js("name", c->name);
				jb("poll", c->poll);
				ju("slots", c->slots);
				ju("slot_size", c->slot_size);
				ju("shm_bytes", c->shm_bytes);
				ju("sequences", c->sequences);
				ju("profiles", c->profiles);
				jobj_close();
			} else {
				printf("%-8" PRIu64 " %-10u %-8u %-8s %-16s %-16s %6u %8u %10s\n",
				       c->client_id, c->uid, c->pid, kind, c->tenant, c->name,
				       c->sequences, c->profiles, H(c->shm_bytes));
			}
		}
		next = r->client_list->next;
		kvd_ctl_free_response(r);
		page_check(after, next);
		after = next;
	} while (after);
	if (json) {
		jarr_close();
		putchar('\n');
	}
	return 0;
}

static void seq_json(const Kvd__SeqInfo *q)
{
	jobj_open(NULL);
	ju("seq", q->seq);
	ju("uid", q->uid);
	js("tenant", q->tenant);
	ju("owner", q->owner);
	ju("profile_id", q->profile_id);
	js("profile", q->profile);
	ju("tokens", q->tokens);
	ju("segments", q->segments);
	ju("bytes", q->bytes);
	js("state", state_name(q->state));
	jb("durable", q->durable);
	ju("disk_bytes", q->disk_bytes);
	jobj_close();
}

static int cmd_seqs(int filter, uint32_t uid)
{
	uint64_t after = 0, next;

	if (json)
		jarr_open(NULL);
	else
		printf("%-20s %-10s %-16s %-8s %-16s %10s %10s %-9s %s\n", "SEQ", "UID", "TENANT",
		       "OWNER", "PROFILE", "TOKENS", "BYTES", "STATE", "DURABLE");
	do {
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__SeqListReq sr = KVD__SEQ_LIST_REQ__INIT;
		Kvd__Response *r;

		sr.after = after;
		sr.filter_uid = filter;
		sr.uid = filter ? uid : 0;
		rq.body_case = KVD__REQUEST__BODY_SEQ_LIST;
		rq.seq_list = &sr;
		r = call(&rq, KVD__RESPONSE__BODY_SEQ_LIST);
		for (size_t i = 0; i < r->seq_list->n_seqs; i++) {
			const Kvd__SeqInfo *q = r->seq_list->seqs[i];

			if (json)
				seq_json(q);
			else
				printf("%-20" PRIu64 " %-10u %-16s %-8" PRIu64 " %-16s %10" PRIu64
				       " %10s %-9s %s\n", q->seq, q->uid, q->tenant, q->owner,
				       q->profile, q->tokens, H(q->bytes), state_name(q->state),
				       q->durable ? "yes" : "no");
		}
		next = r->seq_list->next;
		kvd_ctl_free_response(r);
		page_check(after, next);
		after = next;
	} while (after);
	if (json) {
		jarr_close();
		putchar('\n');
	}
	return 0;
}

static int cmd_seq(uint32_t op, uint64_t seq)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqAdmin sa = KVD__SEQ_ADMIN__INIT;
	Kvd__Response *r;

	sa.seq = seq;
	sa.op = op;
	rq.body_case = KVD__REQUEST__BODY_SEQ_ADMIN;
	rq.seq_admin = &sa;
	if (op != KVD__SEQ_ADMIN_OP__SEQ_ADMIN_SHOW) {
		const char *what = op == KVD__SEQ_ADMIN_OP__SEQ_ADMIN_EVICT ? "evict" : "free";

		r = call(&rq, KVD__RESPONSE__BODY_OK);
		kvd_ctl_free_response(r);
		if (json) {
			jobj_open(NULL);
			ju("seq", seq);
			js("done", what);
			jobj_close();
			putchar('\n');
		} else {
			printf("sequence %" PRIu64 ": %s\n", seq,
			       op == KVD__SEQ_ADMIN_OP__SEQ_ADMIN_EVICT ?
			       "eviction started (seq show: state disk once written)" : "freed");
		}
		return 0;
	}
	r = call(&rq, KVD__RESPONSE__BODY_SEQ_INFO);
	if (json) {
		seq_json(r->seq_info);
		putchar('\n');
	} else {
		const Kvd__SeqInfo *q = r->seq_info;

		printf("seq        %" PRIu64 "\n", q->seq);
		printf("uid        %u\n", q->uid);
		printf("tenant     %s\n", q->tenant);
		printf("owner      %" PRIu64 "%s\n", q->owner, q->owner ? "" : " (none: found on disk)");
		printf("profile    %s (id %u)\n", q->profile, q->profile_id);
		printf("tokens     %" PRIu64 " per layer, %u sealed segments\n", q->tokens, q->segments);
		printf("resident   %s\n", H(q->bytes));
		printf("state      %s\n", state_name(q->state));
		printf("durable    %s%s\n", q->durable ? "yes" : "no",
		       q->durable ? "" : " (no synced file holds exactly this data)");
		printf("on disk    %s\n", H(q->disk_bytes));
	}
	kvd_ctl_free_response(r);
	return 0;
}

static int cmd_profiles(void)
{
	uint64_t after = 0, next;

	if (json)
		jarr_open(NULL);
	else
		printf("%-6s %-10s %-20s %6s %4s %4s %4s %3s %5s %2s %-4s %-8s %6s %6s %5s %5s %10s\n",
		       "ID", "UID", "NAME", "LAYERS", "QH", "KVH", "D", "K", "L", "C", "KV", "EST",
		       "SINK", "WINDOW", "DENSE", "REFS", "BYTES");
	do {
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__ProfilesReq pr = KVD__PROFILES_REQ__INIT;
		Kvd__Response *r;

		if (after > UINT32_MAX)
			die(EXIT_PROTOCOL, "kvd's profile listing cursor %" PRIu64 " is not a profile id",
			    after);
		pr.after = (uint32_t)after;
		rq.body_case = KVD__REQUEST__BODY_PROFILES;
		rq.profiles = &pr;
		r = call(&rq, KVD__RESPONSE__BODY_PROFILE_LIST);
		for (size_t i = 0; i < r->profile_list->n_profiles; i++) {
			const Kvd__ProfileInfo *pi = r->profile_list->profiles[i];
			const Kvd__Profile *p = pi->profile;
			/* the decoder checked it: never NULL */
			const char *dt = kvd_kv_dtype_name(p->kv_dtype);
			const char *est = kvd_estimator_name(p->estimator);

			if (json) {
				jobj_open(NULL);
				ju("id", pi->profile_id);
				ju("uid", pi->uid);
				js("name", p->name);
				ju("layers", p->layers);
				ju("q_heads", p->q_heads);
				ju("kv_heads", p->kv_heads);
				ju("head_dim", p->head_dim);
				ju("k_bits", p->k_bits);
				ju("tables", p->tables);
				ju("min_collisions", p->min_collisions);
				js("kv_dtype", dt);
				js("estimator", est);
				ju("sink_tokens", p->sink_tokens);
				ju("window_tokens", p->window_tokens);
				ju("dense_layers", pi->n_dense);
				ju("seed", p->seed);
				ju("segment_tokens", p->segment_tokens);
				ju("seal_tokens", p->seal_tokens);
				ju("refs", pi->refs);
				ju("bytes", pi->bytes);
				jobj_close();
			} else {
				printf("%-6u %-10u %-20s %6u %4u %4u %4u %3u %5u %2u %-4s %-8s %6u %6u %5u %5u %10s\n",
				       pi->profile_id, pi->uid, p->name, p->layers, p->q_heads, p->kv_heads,
				       p->head_dim, p->k_bits, p->tables, p->min_collisions, dt, est,
				       p->sink_tokens, p->window_tokens, pi->n_dense, pi->refs, H(pi->bytes));
			}
		}
		next = r->profile_list->next;
		kvd_ctl_free_response(r);
		page_check(after, next);
		after = next;
	} while (after);
	if (json) {
		jarr_close();
		putchar('\n');
	}
	return 0;
}

static int cmd_limits(void)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__LimitsReq lq = KVD__LIMITS_REQ__INIT;
	Kvd__Response *r;
	const Kvd__LimitsReply *l;

	rq.body_case = KVD__REQUEST__BODY_LIMITS;
	rq.limits = &lq;
	r = call(&rq, KVD__RESPONSE__BODY_LIMITS);
	l = r->limits;
	qsort(l->uids, l->n_uids, sizeof *l->uids, by_uid);
	if (json) {
		jobj_open(NULL);
		jarr_open("limits");
		for (size_t i = 0; i < l->n_rows; i++) {
			jobj_open(NULL);
			js("key", l->rows[i]->key);
			ju("cap", l->rows[i]->cap);
			ju("per_uid", l->rows[i]->per_uid);
			ju("used", l->rows[i]->used);
			jobj_close();
		}
		jarr_close();
		uid_rows_json("uids", l->uids, l->n_uids);
		ju("uids_total", l->uids_total);
		jobj_close();
		putchar('\n');
	} else {
		int bytes;

		printf("%-20s %14s %14s %14s\n", "KEY", "CAP", "PER_UID", "USED");
		for (size_t i = 0; i < l->n_rows; i++) {
			const Kvd__LimitRow *w = l->rows[i];
			char a[32], b[32], c[32];

			bytes = !strcmp(w->key, "memory.limit") || !strcmp(w->key, "spill.limit") ||
				!strcmp(w->key, "limits.shm");
			if (bytes) {
				human(a, sizeof a, w->cap);
				human(b, sizeof b, w->per_uid);
				human(c, sizeof c, w->used);
			} else {
				snprintf(a, sizeof a, "%" PRIu64, w->cap);
				snprintf(b, sizeof b, "%" PRIu64, w->per_uid);
				snprintf(c, sizeof c, "%" PRIu64, w->used);
			}
			printf("%-20s %14s %14s %14s\n", w->key, w->cap ? a : "none",
			       w->per_uid ? b : "none", c);
		}
		putchar('\n');
		uid_rows_text(l->uids, l->n_uids);
		if (l->uids_total > l->n_uids)
			printf("(%zu of %u uids shown)\n", l->n_uids, l->uids_total);
	}
	kvd_ctl_free_response(r);
	return 0;
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Ok first; kvd then answers what its clients queued and closes every
 * connection, this one included: its EOF says the drain is over. */
static int cmd_drain(int wait)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__DrainReq dr = KVD__DRAIN_REQ__INIT;
	Kvd__Response *r;
	double t0 = now_s();
	int done = 0;

	rq.body_case = KVD__REQUEST__BODY_DRAIN;
	rq.drain = &dr;
	r = call(&rq, KVD__RESPONSE__BODY_OK);
	kvd_ctl_free_response(r);
	while (wait && !done) {
		int left = timeout_ms - (int)((now_s() - t0) * 1000);
		int n;

		if (left <= 0)
			die(EXIT_TEMPFAIL, "kvd (pid %u) still draining after %d s", kvd_pid,
			    timeout_ms / 1000);
		n = wait_readable(left);
		if (n > 0) {
			n = kvd_ctl_recv(fd, rx, KVD_CTL_RX_MAX, NULL, NULL);
			done = n == 0 || n == -ECONNRESET;
			if (n < 0 && !done)
				die(EXIT_PROTOCOL, "waiting for kvd to finish: %s", kvd_strerror(n));
		}
	}
	if (json) {
		jobj_open(NULL);
		ju("pid", kvd_pid);
		jb("drained", done);
		js_key("seconds");
		printf("%.3f", now_s() - t0);
		js_val_done();
		jobj_close();
		putchar('\n');
	} else if (done) {
		printf("kvd (pid %u) drained and let go of its clients in %.1f s\n", kvd_pid,
		       now_s() - t0);
	} else {
		printf("kvd (pid %u) is draining\n", kvd_pid);
	}
	return 0;
}

/* kvd's metrics (Prometheus text, as its HTTP endpoint serves them); series
 * of other uids only for a privileged caller. */
static int cmd_metrics(void)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__MetricsReq mq = KVD__METRICS_REQ__INIT;
	Kvd__Response *r;

	rq.body_case = KVD__REQUEST__BODY_METRICS;
	rq.metrics = &mq;
	r = call(&rq, KVD__RESPONSE__BODY_METRICS);
	if (json) {
		jobj_open(NULL);
		ju("pid", kvd_pid);
		js("text", r->metrics->text);
		jobj_close();
		putchar('\n');
	} else {
		fputs(r->metrics->text, stdout);
	}
	kvd_ctl_free_response(r);
	return 0;
}

/* ---- published prefixes ------------------------------------------------ */

static const char *key_hex(const ProtobufCBinaryData *k, char *buf)
{
	for (size_t i = 0; i < k->len && i < KVD_CTL_CONTENT_KEY; i++)
		snprintf(buf + 2 * i, 3, "%02x", k->data[i]);
	return buf;
}

static int cmd_shares(void)
{
	uint64_t after = 0, next;
	char hex[2 * KVD_CTL_CONTENT_KEY + 1] = "";

	if (json)
		jarr_open(NULL);
	else
		printf("%-32s %-10s %-8s %10s %10s %10s %8s %9s %s\n", "KEY", "UID", "PROFILE",
		       "TOKENS", "BYTES", "FREEABLE", "ATTACHES", "IDLE_S", "STATE");
	do {
		Kvd__Request rq = KVD__REQUEST__INIT;
		Kvd__SharesReq sr = KVD__SHARES_REQ__INIT;
		Kvd__Response *r;

		sr.after = after;
		rq.body_case = KVD__REQUEST__BODY_SHARES;
		rq.shares = &sr;
		r = call(&rq, KVD__RESPONSE__BODY_SHARE_LIST);
		for (size_t i = 0; i < r->share_list->n_shares; i++) {
			const Kvd__ShareInfo *x = r->share_list->shares[i];

			key_hex(&x->key, hex);
			if (json) {
				jobj_open(NULL);
				js("key", hex);
				ju("seq", x->seq);
				ju("uid", x->uid);
				ju("ns", x->ns);
				ju("profile_id", x->profile_id);
				ju("tokens", x->tokens);
				ju("bytes", x->bytes);
				ju("freeable_bytes", x->freeable_bytes);
				ju("attaches", x->attaches);
				ju("idle_ms", x->idle_ms);
				js("state", state_name(x->state));
				jobj_close();
			} else {
				printf("%-32s %-10u %-8u %10" PRIu64 " %10s %10s %8" PRIu64 " %9.1f %s\n",
				       hex, x->uid, x->profile_id, x->tokens, H(x->bytes),
				       H(x->freeable_bytes), x->attaches, (double)x->idle_ms / 1000,
				       state_name(x->state));
			}
		}
		next = r->share_list->next;
		kvd_ctl_free_response(r);
		page_check(after, next);
		after = next;
	} while (after);
	if (json) {
		jarr_close();
		putchar('\n');
	}
	return 0;
}

static int cmd_share_drop(const uint8_t *key, const char *hex)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ShareDrop sd = KVD__SHARE_DROP__INIT;
	Kvd__Response *r;

	sd.key.data = (uint8_t *)key;
	sd.key.len = KVD_CTL_CONTENT_KEY;
	rq.body_case = KVD__REQUEST__BODY_SHARE_DROP;
	rq.share_drop = &sd;
	r = call(&rq, KVD__RESPONSE__BODY_OK);
	kvd_ctl_free_response(r);
	if (json) {
		jobj_open(NULL);
		js("key", hex);
		js("done", "drop");
		jobj_close();
		putchar('\n');
	} else {
		printf("prefix %s: dropped\n", hex);
	}
	return 0;
}

/* ---- main -------------------------------------------------------------- */

/* 32 hex digits -> a content key. */
static void parse_key(const char *s, uint8_t *key)
{
	if (!s)
		usage_error("%s: missing KEY", cmd_name);
	for (int i = 0; i < 2 * KVD_CTL_CONTENT_KEY; i++) {
		int c = s[i], v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 :
				  c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;

		if (v < 0)
			usage_error("%s: '%s' is not a key (%d hex digits)", cmd_name, s,
				    2 * KVD_CTL_CONTENT_KEY);
		key[i / 2] = (uint8_t)(i % 2 ? key[i / 2] | v : v << 4);
	}
	if (s[2 * KVD_CTL_CONTENT_KEY])
		usage_error("%s: '%s' is not a key (%d hex digits)", cmd_name, s,
			    2 * KVD_CTL_CONTENT_KEY);
}

static uint64_t parse_seq(const char *s)
{
	uint64_t v;

	if (!s)
		usage_error("%s: missing sequence ID", cmd_name);
	if (parse_u64(s, &v) || v == 0)
		usage_error("%s: '%s' is not a sequence id (a whole number above 0)", cmd_name, s);
	return v;
}

static uint32_t parse_uid(const char *s)
{
	uint64_t v;
	const struct passwd *pw;

	if (!parse_u64(s, &v)) {
		if (v > UINT32_MAX - 1)
			usage_error("--uid %s: above %u", s, UINT32_MAX - 1);
		return (uint32_t)v;
	}
	pw = getpwnam(s);
	if (!pw)
		usage_error("--uid %s: neither a number nor a user name", s);
	return pw->pw_uid;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "json", no_argument, NULL, 'j' },
		{ "timeout", required_argument, NULL, 't' },
		{ "uid", required_argument, NULL, 'u' },
		{ "no-wait", no_argument, NULL, 'n' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *uid_arg = NULL, *cmd;
	int no_wait = 0, o, nargs;
	uint64_t t;

	if (argv[0] && strrchr(argv[0], '/'))
		prog = strrchr(argv[0], '/') + 1;
	else if (argv[0] && argv[0][0])
		prog = argv[0];
	opterr = 0;
	while ((o = getopt_long(argc, argv, ":s:jt:h", opts, NULL)) != -1) {
		switch (o) {
		case 's':
			sock_path = optarg;
			break;
		case 'j':
			json = 1;
			break;
		case 't':
			if (parse_u64(optarg, &t) || t < 1 || t > 86400)
				usage_error("--timeout %s: not a whole number of seconds in [1, 86400]",
					    optarg);
			timeout_ms = (int)t * 1000;
			break;
		case 'u':
			uid_arg = optarg;
			break;
		case 'n':
			no_wait = 1;
			break;
		case 'h':
			usage(stdout);
			return 0;
		case ':':
			usage_error("option %s needs a value", argv[optind - 1]);
		default:
			usage_error("unknown option %s", argv[optind - 1]);
		}
	}
	if (optind >= argc)
		usage_error("no command");
	cmd = argv[optind];
	nargs = argc - optind - 1;
	cmd_name = cmd;
	if (!strcmp(cmd, "help")) {
		usage(stdout);
		return 0;
	}
	if (uid_arg && strcmp(cmd, "seqs"))
		usage_error("--uid goes with seqs only");
	if (no_wait && strcmp(cmd, "drain"))
		usage_error("--no-wait goes with drain only");

	if (!strcmp(cmd, "seq")) {
		static const char *const ops[] = { NULL, "show", "evict", "free" };
		uint32_t op = 0;
		uint64_t seq;

		if (nargs < 1)
			usage_error("seq: show, evict or free, then an ID");
		for (uint32_t i = 1; i < 4; i++)
			if (!strcmp(argv[optind + 1], ops[i]))
				op = i;
		if (!op)
			usage_error("seq %s: not show, evict or free", argv[optind + 1]);
		snprintf(cmd_buf, sizeof cmd_buf, "seq %s", ops[op]);
		cmd_name = cmd_buf;
		if (nargs > 2)
			usage_error("%s: one ID, not %d arguments", cmd_name, nargs - 1);
		seq = parse_seq(nargs > 1 ? argv[optind + 2] : NULL);
		snprintf(cmd_buf, sizeof cmd_buf, "seq %s %" PRIu64, ops[op], seq);
		connect_kvd();
		return cmd_seq(op, seq);
	}
	if (!strcmp(cmd, "share")) {
		uint8_t key[KVD_CTL_CONTENT_KEY];

		if (nargs < 1 || strcmp(argv[optind + 1], "drop"))
			usage_error("share: drop, then a KEY");
		cmd_name = "share drop";
		if (nargs > 2)
			usage_error("%s: one KEY, not %d arguments", cmd_name, nargs - 1);
		parse_key(nargs > 1 ? argv[optind + 2] : NULL, key);
		snprintf(cmd_buf, sizeof cmd_buf, "share drop %s", argv[optind + 2]);
		cmd_name = cmd_buf;
		connect_kvd();
		return cmd_share_drop(key, argv[optind + 2]);
	}
	if (strcmp(cmd, "status") && strcmp(cmd, "clients") && strcmp(cmd, "seqs") &&
	    strcmp(cmd, "profiles") && strcmp(cmd, "limits") && strcmp(cmd, "drain") &&
	    strcmp(cmd, "metrics") && strcmp(cmd, "shares"))
		usage_error("unknown command '%s'", cmd);
	if (nargs)
		usage_error("%s takes no arguments ('%s')", cmd, argv[optind + 1]);
	{
		uint32_t uid = uid_arg ? parse_uid(uid_arg) : 0;

		connect_kvd();
		if (!strcmp(cmd, "status"))
			return cmd_status();
		if (!strcmp(cmd, "clients"))
			return cmd_clients();
		if (!strcmp(cmd, "seqs"))
			return cmd_seqs(uid_arg != NULL, uid);
		if (!strcmp(cmd, "profiles"))
			return cmd_profiles();
		if (!strcmp(cmd, "limits"))
			return cmd_limits();
		if (!strcmp(cmd, "metrics"))
			return cmd_metrics();
		if (!strcmp(cmd, "shares"))
			return cmd_shares();
		return cmd_drain(!no_wait);
	}
}
