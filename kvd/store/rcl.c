/* kvd_rcl: a Redis Cluster client on hiredis 0.14 (rcl.h).
 *
 * Every reply is checked for type and range before use: the cluster is the
 * operator's, but a broken or hostile one must cost an error, not kvd.
 * There is no fuzz target for it (its input is the operator's cluster, not
 * the clients'); tests/unit/test_rcl.c feeds it broken replies from a fake
 * node instead.
 *
 * A batch fails as a whole (rcl.h) only when no node answered any of it;
 * when some did, an op whose node stayed unreachable past retry_ms has that
 * error as its own rc and the batch returns 0.
 *
 * hiredis writes with write(2), so a node gone mid-write raises SIGPIPE: the
 * process ignores it (kvd's server does; the tests do).
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <hiredis/sds.h>

#include "rcl.h"

#define HOST_MAX 255
#define NODES_MAX 1024          /* a map naming more nodes is refused */
#define ARRAY_MAX 65536         /* CLUSTER SLOTS has at most 16384 entries */
#define RETRY_SLEEP_MS 50
#define FLUSH_BYTES (1u << 20)
#define NO_NODE 0xffff

static const char *const cmd_name[] = { "GET", "SET", "DEL", "EXISTS" };

struct node {
	char *host;
	int port;
	bool seed;
	redisContext *ctx;
};

/* Where one op of a batch stands. */
struct opst {
	uint16_t slot;
	bool done, asking;
	int node;                       /* MOVED/ASK target; -1: the map's */
	int dest;                       /* this round's node; -1: none */
	int err;                        /* why it is still pending */
	unsigned redir;
};

struct kvd_rcl {
	uint32_t connect_ms, io_ms, retry_ms;
	unsigned redirects;
	struct node *nodes;
	unsigned nnodes, cap;
	bool have_map;
	struct kvd_rcl_stats st;
	uint16_t owner[KVD_RCL_SLOTS];  /* node index or NO_NODE */
	uint16_t fresh[KVD_RCL_SLOTS];  /* the map being read */
};

/* ---- slots -------------------------------------------------------------- */

static uint16_t crc16(const unsigned char *p, size_t n)
{
	uint16_t crc = 0;

	while (n--) {
		crc ^= (uint16_t)(*p++ << 8);
		for (int i = 0; i < 8; i++)
			crc = (uint16_t)(crc & 0x8000 ? crc << 1 ^ 0x1021 : crc << 1);
	}
	return crc;
}

uint16_t kvd_rcl_slot(const void *key, size_t klen)
{
	const unsigned char *k = key, *open = klen ? memchr(k, '{', klen) : NULL;

	if (open) {
		size_t rest = klen - (size_t)(open + 1 - k);
		const unsigned char *close = memchr(open + 1, '}', rest);

		if (close && close > open + 1)
			return crc16(open + 1, (size_t)(close - open - 1)) & (KVD_RCL_SLOTS - 1);
	}
	return crc16(k, klen) & (KVD_RCL_SLOTS - 1);
}

/* ---- helpers ------------------------------------------------------------ */

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static struct timeval tv_ms(uint64_t ms)
{
	return (struct timeval){ (time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000 };
}

/* min..max from exactly n decimal digits (at most 5), or -1. */
static int num_parse(const char *p, size_t n, int min, int max)
{
	int v = 0;

	if (n < 1 || n > 5)
		return -1;
	for (size_t i = 0; i < n; i++) {
		if (p[i] < '0' || p[i] > '9')
			return -1;
		v = v * 10 + (p[i] - '0');
	}
	return v >= min && v <= max ? v : -1;
}

/* hiredis 0.14 callocs the array a reply announces and aborts when that
 * fails: "*2000000000" from a broken node would end kvd.  Refusing it
 * makes the reader fail ("out of memory"), which costs the connection. */
static redisReplyObjectFunctions *dflt_fns, capped_fns;
static pthread_once_t fns_once = PTHREAD_ONCE_INIT;

static void *capped_array(const redisReadTask *t, int elements)
{
	return elements > ARRAY_MAX ? NULL : dflt_fns->createArray(t, elements);
}

static void fns_init(void)
{
	redisReader *r = redisReaderCreate();

	if (!r)
		return;
	capped_fns = *r->fn;
	capped_fns.createArray = capped_array;
	dflt_fns = r->fn;
	redisReaderFree(r);
}

/* A context's error as a negative errno.  hiredis keeps errno from the
 * failed call; a timed-out blocking read leaves EAGAIN. */
static int ctx_err(const redisContext *x, int eno, int dflt)
{
	switch (x->err) {
	case REDIS_ERR_PROTOCOL:
	case REDIS_ERR_OOM:
		return -EPROTO;
	case REDIS_ERR_EOF:
		return -ECONNRESET;
	}
	switch (eno) {
	case EAGAIN:
	case EINPROGRESS:
		return -ETIMEDOUT;
	case ECONNREFUSED: case ETIMEDOUT: case EHOSTUNREACH: case ENETUNREACH:
	case ECONNRESET: case EPIPE:
		return -eno;
	}
	return dflt;
}

static int node_find(struct kvd_rcl *c, const char *host, size_t hlen, int port)
{
	struct node *nd;

	for (unsigned i = 0; i < c->nnodes; i++)
		if (c->nodes[i].port == port && !strncmp(c->nodes[i].host, host, hlen) &&
		    !c->nodes[i].host[hlen])
			return (int)i;
	if (c->nnodes == NODES_MAX)
		return -ENOSPC;
	if (c->nnodes == c->cap) {
		unsigned cap = c->cap ? c->cap * 2 : 8;

		nd = realloc(c->nodes, cap * sizeof *nd);
		if (!nd)
			return -ENOMEM;
		c->nodes = nd;
		c->cap = cap;
	}
	nd = &c->nodes[c->nnodes];
	*nd = (struct node){ .host = strndup(host, hlen), .port = port };
	if (!nd->host)
		return -ENOMEM;
	return (int)c->nnodes++;
}

/* A host as a reply names it: bounded, no NUL inside.  Empty means the
 * node that answered (the spec's "same endpoint"). */
static int node_named(struct kvd_rcl *c, unsigned from, const char *host, size_t hlen, int port)
{
	if (hlen > HOST_MAX || memchr(host, 0, hlen))
		return -EPROTO;
	if (!hlen) {
		host = c->nodes[from].host;
		hlen = strlen(host);
	}
	return node_find(c, host, hlen, port);
}

static void drop(struct kvd_rcl *c, unsigned i)
{
	redisFree(c->nodes[i].ctx);
	c->nodes[i].ctx = NULL;
}

/* Drops node i after its connection failed, with why in msg. */
static int lost(struct kvd_rcl *c, unsigned i, int eno, char *msg, size_t msglen)
{
	int r = ctx_err(c->nodes[i].ctx, eno, -ECONNRESET);

	snprintf(msg, msglen, "%s:%d: %s", c->nodes[i].host, c->nodes[i].port, c->nodes[i].ctx->errstr);
	c->st.conn_errors++;
	drop(c, i);
	return r;
}

static int conn(struct kvd_rcl *c, unsigned i, char *msg, size_t msglen)
{
	struct node *nd = &c->nodes[i];
	redisContext *x;
	int eno;

	if (nd->ctx)
		return 0;
	x = redisConnectWithTimeout(nd->host, nd->port, tv_ms(c->connect_ms));
	eno = errno;
	if (!x) {
		snprintf(msg, msglen, "%s:%d: out of memory", nd->host, nd->port);
		return -ENOMEM;
	}
	if (!x->err && redisSetTimeout(x, tv_ms(c->io_ms)) != REDIS_OK)
		eno = errno;
	if (x->err) {
		int r = ctx_err(x, eno, -EHOSTUNREACH);

		snprintf(msg, msglen, "%s:%d: %s", nd->host, nd->port, x->errstr);
		redisFree(x);
		c->st.conn_errors++;
		return r;
	}
	pthread_once(&fns_once, fns_init);
	if (dflt_fns)
		x->reader->fn = &capped_fns;
	nd->ctx = x;
	c->st.connects++;
	return 0;
}

/* ---- the slot map ------------------------------------------------------- */

/* CLUSTER SLOTS: [[start, end, [host, port, id...], replicas...]...] */
static int map_parse(struct kvd_rcl *c, unsigned from, const redisReply *r, char *msg, size_t msglen)
{
	const char *host = c->nodes[from].host;   /* not moved by node_find */
	int port = c->nodes[from].port, k;
	unsigned served = 0;

	if (r->type != REDIS_REPLY_ARRAY)
		goto bad;
	for (unsigned s = 0; s < KVD_RCL_SLOTS; s++)
		c->fresh[s] = NO_NODE;
	for (size_t i = 0; i < r->elements; i++) {
		const redisReply *e = r->element[i], *lo, *hi, *m;

		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3)
			goto bad;
		lo = e->element[0];
		hi = e->element[1];
		m = e->element[2];
		if (lo->type != REDIS_REPLY_INTEGER || hi->type != REDIS_REPLY_INTEGER ||
		    lo->integer < 0 || hi->integer < lo->integer || hi->integer >= KVD_RCL_SLOTS ||
		    m->type != REDIS_REPLY_ARRAY || m->elements < 2 ||
		    m->element[0]->type != REDIS_REPLY_STRING || m->element[1]->type != REDIS_REPLY_INTEGER ||
		    m->element[1]->integer < 1 || m->element[1]->integer > 65535)
			goto bad;
		/* "?": a node whose endpoint is unknown; nothing to connect to. */
		if (m->element[0]->len == 1 && m->element[0]->str[0] == '?')
			continue;
		k = node_named(c, from, m->element[0]->str, m->element[0]->len, (int)m->element[1]->integer);
		if (k < 0) {
			snprintf(msg, msglen, "%s:%d: CLUSTER SLOTS: %s", host, port,
				 k == -ENOSPC ? "more than 1024 nodes" : "a bad host");
			return k == -ENOMEM ? k : -EPROTO;
		}
		for (long long s = lo->integer; s <= hi->integer; s++) {
			served += c->fresh[s] == NO_NODE;
			c->fresh[s] = (uint16_t)k;
		}
	}
	if (!served) {
		snprintf(msg, msglen, "%s:%d: CLUSTER SLOTS: no slot served", host, port);
		return -EHOSTUNREACH;
	}
	memcpy(c->owner, c->fresh, sizeof c->owner);
	c->have_map = true;
	c->st.refreshes++;
	return 0;
bad:
	snprintf(msg, msglen, "%s:%d: CLUSTER SLOTS: malformed reply", host, port);
	return -EPROTO;
}

/* Seeds first, then every other node known when it started (not those a
 * bad map just added). */
static int refresh(struct kvd_rcl *c, char *msg, size_t msglen)
{
	unsigned n = c->nnodes;
	int r = -EHOSTUNREACH;

	for (int pass = 0; pass < 2; pass++)
		for (unsigned i = 0; i < n; i++) {
			redisReply *rep;

			if (c->nodes[i].seed != !pass || (r = conn(c, i, msg, msglen)))
				continue;
			rep = redisCommand(c->nodes[i].ctx, "CLUSTER SLOTS");
			if (!rep) {
				r = lost(c, i, errno, msg, msglen);
				continue;
			}
			if (rep->type == REDIS_REPLY_ERROR) {
				snprintf(msg, msglen, "%s:%d: CLUSTER SLOTS: %.200s", c->nodes[i].host,
					 c->nodes[i].port, rep->str);
				r = -EIO;
			} else {
				r = map_parse(c, i, rep, msg, msglen);
			}
			freeReplyObject(rep);
			if (!r)
				return 0;
		}
	return r;
}

/* Forgets nodes that are neither seeds nor in the map, so a cluster that
 * changes over months does not fill the table. */
static void prune(struct kvd_rcl *c)
{
	uint16_t to[NODES_MAX];
	bool used[NODES_MAX] = { false };
	unsigned n = 0;

	for (unsigned s = 0; s < KVD_RCL_SLOTS; s++)
		if (c->owner[s] != NO_NODE)
			used[c->owner[s]] = true;
	for (unsigned i = 0; i < c->nnodes; i++) {
		to[i] = NO_NODE;
		if (!used[i] && !c->nodes[i].seed) {
			redisFree(c->nodes[i].ctx);
			free(c->nodes[i].host);
			continue;
		}
		to[i] = (uint16_t)n;
		c->nodes[n++] = c->nodes[i];
	}
	if (n == c->nnodes)
		return;
	c->nnodes = n;
	for (unsigned s = 0; s < KVD_RCL_SLOTS; s++)
		if (c->owner[s] != NO_NODE)
			c->owner[s] = to[c->owner[s]];
}

/* ---- create / destroy --------------------------------------------------- */

int kvd_rcl_create(const struct kvd_rcl_cfg *cfg, struct kvd_rcl **out, char *msg, size_t msglen)
{
	struct kvd_rcl *c;
	const char *p;

	*out = NULL;
	if (!cfg || !cfg->seeds || !*cfg->seeds) {
		snprintf(msg, msglen, "no seeds");
		return -EINVAL;
	}
	c = calloc(1, sizeof *c);
	if (!c) {
		snprintf(msg, msglen, "out of memory");
		return -ENOMEM;
	}
	c->connect_ms = cfg->connect_ms ? cfg->connect_ms : 500;
	c->io_ms = cfg->io_ms ? cfg->io_ms : 2000;
	c->retry_ms = cfg->retry_ms;
	c->redirects = cfg->redirects ? cfg->redirects : 5;
	for (unsigned s = 0; s < KVD_RCL_SLOTS; s++)
		c->owner[s] = NO_NODE;
	for (p = cfg->seeds;; p++) {
		const char *end = p + strcspn(p, ","), *next = end, *host, *colon;
		size_t hlen;
		int port, k;

		/* "a:1, b:2" as a configuration file may well say it */
		while (*p == ' ' || *p == '\t')
			p++;
		while (end > p && (end[-1] == ' ' || end[-1] == '\t'))
			end--;
		colon = memrchr(p, ':', (size_t)(end - p));
		host = p;
		hlen = colon ? (size_t)(colon - p) : 0;
		port = colon ? num_parse(colon + 1, (size_t)(end - colon - 1), 1, 65535) : -1;

		if (hlen >= 2 && host[0] == '[' && host[hlen - 1] == ']') {
			host++;
			hlen -= 2;
		}
		if (!hlen || hlen > HOST_MAX || port < 0 || memchr(host, ' ', hlen) || memchr(host, '\t', hlen)) {
			snprintf(msg, msglen, "seed '%.*s': want host:port, port 1-65535", (int)(end - p), p);
			kvd_rcl_destroy(c);
			return -EINVAL;
		}
		k = node_find(c, host, hlen, port);
		if (k < 0) {
			snprintf(msg, msglen, k == -ENOSPC ? "more than 1024 seeds" : "out of memory");
			kvd_rcl_destroy(c);
			return k == -ENOSPC ? -EINVAL : k;
		}
		c->nodes[k].seed = true;
		p = next;
		if (!*p)
			break;
	}
	*out = c;
	return 0;
}

void kvd_rcl_destroy(struct kvd_rcl *c)
{
	if (!c)
		return;
	for (unsigned i = 0; i < c->nnodes; i++) {
		redisFree(c->nodes[i].ctx);
		free(c->nodes[i].host);
	}
	free(c->nodes);
	free(c);
}

void kvd_rcl_stats(const struct kvd_rcl *c, struct kvd_rcl_stats *st)
{
	*st = c->st;
}

/* ---- batches ------------------------------------------------------------ */

/* Node u's ops from index i on go back to the map with error r. */
static void node_failed(struct opst *s, unsigned n, unsigned i, int u, int r)
{
	for (; i < n; i++)
		if (!s[i].done && s[i].dest == u) {
			s[i].err = r;
			s[i].node = -1;
			s[i].asking = false;
			s[i].dest = -1;
		}
}

static bool prefix(const redisReply *r, const char *p)
{
	size_t n = strlen(p);

	return r->len >= n && !memcmp(r->str, p, n);
}

/* "MOVED|ASK slot host:port": the node named, or a negative errno. */
static int redirect(struct kvd_rcl *c, unsigned from, const redisReply *r, size_t skip)
{
	const char *p = r->str + skip, *end = r->str + r->len, *sp, *colon;
	int port;

	sp = memchr(p, ' ', (size_t)(end - p));
	if (!sp || num_parse(p, (size_t)(sp - p), 0, KVD_RCL_SLOTS - 1) < 0)
		return -EPROTO;
	colon = memrchr(sp + 1, ':', (size_t)(end - sp - 1));
	if (!colon || (port = num_parse(colon + 1, (size_t)(end - colon - 1), 1, 65535)) < 0)
		return -EPROTO;
	return node_named(c, from, sp + 1, (size_t)(colon - sp - 1), port);
}

/* One reply to op i from node u: done, or redirected / to be retried. */
static void reply(struct kvd_rcl *c, struct kvd_rcl_op *op, struct opst *s, unsigned u,
		  redisReply *r, bool *moved, bool *wait, char *msg, size_t msglen)
{
	const char *host = c->nodes[u].host;     /* not moved by node_find */
	int port = c->nodes[u].port, k;
	bool ask = false;

	if (r->type == REDIS_REPLY_ERROR && (prefix(r, "MOVED ") || (ask = prefix(r, "ASK ")))) {
		k = redirect(c, u, r, ask ? 4 : 6);
		if (k < 0 || ++s->redir > c->redirects) {
			snprintf(msg, msglen, "%s:%d: %s: %s: %.200s", host, port, cmd_name[op->kind],
				 k < 0 ? "bad redirect" : "too many redirects", r->str);
			op->rc = k == -ENOMEM ? k : k < 0 ? -EPROTO : -EIO;
			s->done = true;
			return;
		}
		s->node = k;
		s->asking = ask;
		*moved |= !ask;
		if (ask)
			c->st.ask++;
		else
			c->st.moved++;
		return;
	}
	/* The slot's master is failing over or loading: a matter of time. */
	if (r->type == REDIS_REPLY_ERROR && (prefix(r, "CLUSTERDOWN") || prefix(r, "TRYAGAIN") ||
					     prefix(r, "LOADING") || prefix(r, "MASTERDOWN"))) {
		snprintf(msg, msglen, "%s:%d: %.200s", host, port, r->str);
		s->err = -EIO;
		*wait = true;
		return;
	}
	s->done = true;
	if (r->type == REDIS_REPLY_ERROR) {
		snprintf(msg, msglen, "%s:%d: %s: %.200s", host, port, cmd_name[op->kind], r->str);
		op->rc = -EIO;
		return;
	}
	op->rc = -EPROTO;
	switch (op->kind) {
	case KVD_RCL_GET:
		if (r->type == REDIS_REPLY_NIL) {
			op->rc = -ENOENT;
		} else if (r->type == REDIS_REPLY_STRING) {
			/* hiredis allocates with malloc (hi_malloc): hand the
			 * value over rather than copy up to megabytes. */
			op->data = r->str;
			op->len = r->len;
			r->str = NULL;
			op->rc = 0;
		}
		break;
	case KVD_RCL_SET:
		if (r->type == REDIS_REPLY_STATUS && r->len == 2 && !memcmp(r->str, "OK", 2))
			op->rc = 0;
		break;
	case KVD_RCL_DEL:
	case KVD_RCL_EXISTS:
		if (r->type == REDIS_REPLY_INTEGER && r->integer >= 0)
			op->rc = r->integer ? 0 : -ENOENT;
		break;
	}
	if (op->rc == -EPROTO)
		snprintf(msg, msglen, "%s:%d: %s: a reply of type %d", host, port, cmd_name[op->kind], r->type);
}

static int append(redisContext *x, const struct kvd_rcl_op *op, bool asking)
{
	const char *argv[3] = { cmd_name[op->kind], op->klen ? op->key : "", op->vlen ? op->val : "" };
	size_t len[3] = { strlen(cmd_name[op->kind]), op->klen, op->vlen };

	if (asking && redisAppendCommand(x, "ASKING") != REDIS_OK)
		return -ENOMEM;
	return redisAppendCommandArgv(x, op->kind == KVD_RCL_SET ? 3 : 2, argv, len) == REDIS_OK ? 0 : -ENOMEM;
}

static int flush(struct kvd_rcl *c, unsigned u, char *msg, size_t msglen)
{
	int done = 0;

	while (!done)
		if (redisBufferWrite(c->nodes[u].ctx, &done) != REDIS_OK)
			return lost(c, u, errno, msg, msglen);
	return 0;
}

/* One round: every pending op to its node, pipelined: appended per node,
 * every node's buffer written (so all work at once), then replies read. */
/* Reads exactly n bytes for a reply: first what the reader holds, then
 * from the socket (SO_RCVTIMEO is io_ms), never past the reply, so the
 * next reply's bytes stay for the reader. */
static int take(redisContext *x, char *to, size_t n)
{
	redisReader *rd = x->reader;
	size_t have = rd->len - rd->pos, k = have < n ? have : n;

	memcpy(to, rd->buf + rd->pos, k);
	rd->pos += k;
	if (rd->pos == rd->len || rd->pos >= 1024) {
		sdsrange(rd->buf, (int)rd->pos, -1);
		rd->pos = 0;
		rd->len = sdslen(rd->buf);
	}
	for (size_t got = k; got < n;) {
		ssize_t m = read(x->fd, to + got, n - got);

		if (m < 0 && errno == EINTR)
			continue;
		if (m <= 0) {
			errno = m == 0 ? ECONNRESET : errno == EAGAIN ? ETIMEDOUT : errno;
			x->err = REDIS_ERR_IO;
			snprintf(x->errstr, sizeof x->errstr, "%s", strerror(errno));
			return -1;
		}
		got += (size_t)m;
	}
	return 0;
}

/* A reply; a GET's bulk string of up to megabytes read straight into dst
 * (when it fits cap) or into a buffer of its own.  hiredis would read it
 * 16 KiB at a time into a reader buffer grown a MiB at a time (a copy per
 * MiB of value), then copy it once more into the reply.  Anything but a
 * bulk string (nil, an error, MOVED, ASK), or a reader in the middle of
 * something, goes to hiredis.  The reply is built as hiredis builds one
 * (malloc'd: freeReplyObject frees it); a value put in dst leaves str NULL
 * and len its length. */
static int read_reply(redisContext *x, bool get, void *dst, size_t cap, redisReply **out)
{
	redisReader *rd = x->reader;
	char *p, *nl, *end, crlf[2];

	if (!get || rd->ridx != -1)
		return redisGetReply(x, (void **)out);
	for (;;) {
		size_t avail = rd->len - rd->pos;

		p = rd->buf + rd->pos;
		if (avail && p[0] != '$')
			return redisGetReply(x, (void **)out);
		if (avail && (nl = memchr(p, '\n', avail)))
			break;
		if (avail > 32)
			return redisGetReply(x, (void **)out);
		if (redisBufferRead(x) != REDIS_OK)
			return REDIS_ERR;
	}
	long long blen = strtoll(p + 1, &end, 10);

	if (end != nl - 1 || *end != '\r' || blen < 0 || blen > (512ll << 20))
		return redisGetReply(x, (void **)out);  /* nil, or hiredis's error */
	size_t L = (size_t)blen;
	redisReply *r = calloc(1, sizeof *r);
	char *buf = dst && L <= cap ? NULL : malloc(L + 1);

	if (!r || (!buf && !(dst && L <= cap))) {
		free(r);
		free(buf);
		x->err = REDIS_ERR_OOM;
		snprintf(x->errstr, sizeof x->errstr, "out of memory");
		errno = ENOMEM;
		return REDIS_ERR;
	}
	rd->pos += (size_t)(nl + 1 - p);
	if (take(x, buf ? buf : dst, L) || take(x, crlf, 2)) {
		free(r);
		free(buf);
		return REDIS_ERR;
	}
	if (crlf[0] != '\r' || crlf[1] != '\n') {
		free(r);
		free(buf);
		x->err = REDIS_ERR_PROTOCOL;
		snprintf(x->errstr, sizeof x->errstr, "bulk string not ended by CRLF");
		errno = EPROTO;
		return REDIS_ERR;
	}
	if (buf)
		buf[L] = 0;
	r->type = REDIS_REPLY_STRING;
	r->str = buf;
	r->len = L;
	*out = r;
	return REDIS_OK;
}

static void round_run(struct kvd_rcl *c, struct kvd_rcl_op *ops, struct opst *s, unsigned n,
		      bool *moved, bool *wait, bool *answered, char *msg, size_t msglen)
{
	uint16_t used[NODES_MAX];
	bool mark[NODES_MAX] = { false };
	unsigned nused = 0;
	int r;

	for (unsigned i = 0; i < n; i++) {
		int d = s[i].node >= 0 ? s[i].node : c->owner[s[i].slot];

		s[i].dest = -1;
		if (s[i].done)
			continue;
		if (d == NO_NODE) {
			snprintf(msg, msglen, "slot %u is not served", s[i].slot);
			s[i].err = -EHOSTUNREACH;
			*wait = true;
			continue;
		}
		s[i].dest = d;
		if (!mark[d]) {
			mark[d] = true;
			used[nused++] = (uint16_t)d;
		}
	}
	for (unsigned j = 0; j < nused; j++) {
		unsigned u = used[j];
		size_t queued = 0;

		r = conn(c, u, msg, msglen);
		for (unsigned i = 0; !r && i < n; i++) {
			if (s[i].dest != (int)u)
				continue;
			r = append(c->nodes[u].ctx, &ops[i], s[i].asking);
			c->st.commands++;
			/* hiredis grows its output buffer by a MiB at a time:
			 * writing it out as it fills saves copying a batch of
			 * large values once per value. */
			queued += ops[i].klen + (ops[i].kind == KVD_RCL_SET ? ops[i].vlen : 0);
			if (!r && queued >= FLUSH_BYTES) {
				r = flush(c, u, msg, msglen);
				queued = 0;
			}
		}
		if (r == -ENOMEM && c->nodes[u].ctx) {
			snprintf(msg, msglen, "out of memory");
			drop(c, u);
		}
		if (r) {
			node_failed(s, n, 0, (int)u, r);
			*wait = true;
		}
	}
	for (unsigned j = 0; j < nused; j++) {
		unsigned u = used[j];

		if (c->nodes[u].ctx && (r = flush(c, u, msg, msglen))) {
			node_failed(s, n, 0, (int)u, r);
			*wait = true;
		}
	}
	for (unsigned j = 0; j < nused; j++) {
		unsigned u = used[j];

		for (unsigned i = 0; c->nodes[u].ctx && i < n; i++) {
			redisReply *rep = NULL;

			if (s[i].dest != (int)u)
				continue;
			/* ASKING's own reply says nothing the command's will not. */
			if (s[i].asking && redisGetReply(c->nodes[u].ctx, (void **)&rep) == REDIS_OK)
				freeReplyObject(rep);
			if (!c->nodes[u].ctx->err &&
			    read_reply(c->nodes[u].ctx, ops[i].kind == KVD_RCL_GET, ops[i].dst,
				       ops[i].cap, &rep) == REDIS_OK) {
				*answered = true;
				s[i].node = -1;
				s[i].asking = false;
				reply(c, &ops[i], &s[i], u, rep, moved, wait, msg, msglen);
				freeReplyObject(rep);
				continue;
			}
			node_failed(s, n, i, (int)u, lost(c, u, errno, msg, msglen));
			*wait = true;
		}
	}
}

int kvd_rcl_run(struct kvd_rcl *c, struct kvd_rcl_op *ops, unsigned n, char *msg, size_t msglen)
{
	uint64_t deadline = now_ms() + c->retry_ms;
	bool answered = false, need_map = !c->have_map;
	unsigned pending = 0;
	struct opst *s;
	int err = 0;

	if (msglen)
		msg[0] = 0;
	for (unsigned i = 0; i < n; i++) {
		ops[i].rc = 0;
		ops[i].data = NULL;
		ops[i].len = 0;
	}
	s = calloc(n ? n : 1, sizeof *s);
	if (!s) {
		snprintf(msg, msglen, "out of memory");
		err = -ENOMEM;
		goto fail;
	}
	for (unsigned i = 0; i < n; i++) {
		const struct kvd_rcl_op *op = &ops[i];

		s[i].node = -1;
		if ((unsigned)op->kind > KVD_RCL_EXISTS || (!op->key && op->klen) ||
		    (op->kind == KVD_RCL_SET && !op->val && op->vlen)) {
			snprintf(msg, msglen, "op %u: bad kind, key or value", i);
			ops[i].rc = -EINVAL;
			s[i].done = true;
			continue;
		}
		s[i].slot = kvd_rcl_slot(op->key, op->klen);
		pending++;
	}
	prune(c);
	while (pending) {
		bool moved = false, wait = false;
		uint64_t t;

		if (need_map && (err = refresh(c, msg, msglen)) && !c->have_map)
			wait = true;
		else
			round_run(c, ops, s, n, &moved, &wait, &answered, msg, msglen);
		need_map = moved;
		pending = 0;
		for (unsigned i = 0; i < n; i++)
			pending += !s[i].done;
		if (!pending || !wait)
			continue;
		/* A node is down or the cluster fails over: wait a little,
		 * then ask the others for the map again. */
		t = now_ms();
		if (t >= deadline) {
			/* Past it, redirected ops still get their resend. */
			bool redirected = false;

			for (unsigned i = 0; i < n; i++)
				redirected |= !s[i].done && s[i].node >= 0;
			if (!redirected)
				break;
			continue;
		}
		nanosleep(&(struct timespec){ 0, (long)(deadline - t < RETRY_SLEEP_MS ?
							  deadline - t : RETRY_SLEEP_MS) * 1000000L }, NULL);
		need_map = true;
	}
	for (unsigned i = 0; i < n; i++)
		if (!s[i].done) {
			ops[i].rc = s[i].err ? s[i].err : err ? err : -EHOSTUNREACH;
			err = ops[i].rc;
		}
	free(s);
	/* Nothing answered: the cluster could not be reached, the batch fails. */
	if (answered || !pending)
		return 0;
fail:
	for (unsigned i = 0; i < n; i++) {
		free(ops[i].data);
		ops[i].data = NULL;
		ops[i].len = 0;
		ops[i].rc = err;
	}
	return err;
}

/* ---- WAIT --------------------------------------------------------------- */

int kvd_rcl_wait(struct kvd_rcl *c, const void *key, size_t klen, unsigned replicas,
		 uint32_t timeout_ms, char *msg, size_t msglen)
{
	char nr[16], tm[16];
	const char *argv[3] = { "WAIT", nr, tm };
	uint16_t u = c->have_map ? c->owner[kvd_rcl_slot(key, klen)] : NO_NODE;
	redisContext *x = u != NO_NODE ? c->nodes[u].ctx : NULL;
	redisReply *rep;
	int r;

	/* WAIT counts the writes of its own connection: on a new one it
	 * would vouch for nothing.  Redis's timeout 0 (for ever) ends here
	 * after io_ms. */
	if (!x) {
		snprintf(msg, msglen, "WAIT: no connection to the master of slot %u", kvd_rcl_slot(key, klen));
		return -ENOTCONN;
	}
	snprintf(nr, sizeof nr, "%u", replicas);
	snprintf(tm, sizeof tm, "%u", timeout_ms);
	if (redisSetTimeout(x, tv_ms((uint64_t)timeout_ms + c->io_ms)) != REDIS_OK)
		return lost(c, u, errno, msg, msglen);
	rep = redisCommandArgv(x, 3, argv, NULL);
	if (!rep)
		return lost(c, u, errno, msg, msglen);
	if (rep->type == REDIS_REPLY_INTEGER && rep->integer >= 0) {
		r = rep->integer > INT_MAX ? INT_MAX : (int)rep->integer;
	} else {
		r = rep->type == REDIS_REPLY_ERROR ? -EIO : -EPROTO;
		snprintf(msg, msglen, "%s:%d: WAIT: %.200s", c->nodes[u].host, c->nodes[u].port,
			 rep->type == REDIS_REPLY_ERROR ? rep->str : "a reply of the wrong type");
	}
	freeReplyObject(rep);
	if (redisSetTimeout(x, tv_ms(c->io_ms)) != REDIS_OK)
		return lost(c, u, errno, msg, msglen);
	return r;
}
