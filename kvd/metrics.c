/* kvd_metrics: counters, the gauge snapshot, the Prometheus text and its
 * HTTP endpoint (see metrics.h; the metrics are listed in
 * docs/OPERATIONS.md, "Metrics"). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "engine/clock.h"
#include "proto/ctl.h"
#include "engine/err.h"
#include "engine/invariant.h"
#include "proto/kvd_ring.h"
#include "engine/log.h"
#include "metrics.h"
#include "kvd/store/remote.h"
#include "server_int.h"
#include "shm/shm.h"
#include "kvd/store/store.h"
#include "kvd/store/tier.h"
#include "kvd/store/uidlimits.h"

#ifndef KVD_GIT_REV
#define KVD_GIT_REV "unknown"
#endif

/* ---- result codes -------------------------------------------------------- */

/* Row of a result: 0 ok, 1..ERRNO_ROWS-1 that errno, then kvd's own codes,
 * then one row for anything else. */
#define ERRNO_ROWS      134
#define KVD_ROWS        (KVD_ELAST - KVD_EBASE - 1)
#define NRES            (ERRNO_ROWS + KVD_ROWS + 1)
#define RES_OTHER       (NRES - 1)

static unsigned res_row(int code)
{
	int e = -code;

	if (code == 0)
		return 0;
	if (e > 0 && e < ERRNO_ROWS)
		return (unsigned)e;
	if (e > KVD_EBASE && e < KVD_ELAST)
		return (unsigned)(ERRNO_ROWS + e - KVD_EBASE - 1);
	return RES_OTHER;
}

static const char *row_name(unsigned row)
{
	static const char *const kvd_names[] = { "KVD_EGEOM", "KVD_EFORMAT", "KVD_ESHAPE",
						  "KVD_ELOST", "KVD_EPROTO" };
	const char *n;

	if (row == 0)
		return "ok";
	if (row < ERRNO_ROWS)
		return (n = strerrorname_np((int)row)) ? n : "other";
	if (row < RES_OTHER && row - ERRNO_ROWS < sizeof kvd_names / sizeof kvd_names[0])
		return kvd_names[row - ERRNO_ROWS];
	return "other";
}

const char *kvd_metrics_result_name(int code)
{
	return row_name(res_row(code));
}

/* ---- histograms ---------------------------------------------------------- */

#define HMAX 20

struct hist {
	const double *le;               /* upper bounds in seconds, ascending */
	unsigned n;
	_Atomic uint64_t b[HMAX + 1];   /* per bucket (not cumulative); [n]: above the last */
	_Atomic uint64_t sum_ns;
};

static const double le_attend[] = { 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3,
				    10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1, 2.5, 5, 10 };

static void hist_init(struct hist *h, const double *le, unsigned n)
{
	h->le = le;
	h->n = n;
}

static void hist_observe(struct hist *h, uint64_t ns)
{
	double s = (double)ns / 1e9;
	unsigned i = 0;

	while (i < h->n && s > h->le[i])
		i++;
	atomic_fetch_add_explicit(&h->b[i], 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

/* ---- the module ---------------------------------------------------------- */

#define RING_OPS        (KVD_OP_MAX + 1)        /* the last: an unknown op */

struct snap_uid {
	uint32_t uid;
	uint64_t n[KVD_RES_N];
};

struct snap {
	uint64_t taken_ns;
	uint64_t pending, runnable, parked;
	uint64_t mem_limit, mem_high, mem_low, mem_used, mem_reserved;
	uint64_t on_disk, disk_bytes, disconnects, refused;
	int remote;                     /* the rest: only with a remote tier */
	struct kvd_remote_stats rs;
	uint64_t rem_puts, rem_drops, rem_fetches, rem_only;
	struct snap_uid *uid;
	size_t nuid, cap;
};

struct kvd_metrics {
	_Atomic uint64_t ring[RING_OPS][NRES];
	_Atomic uint64_t ctl[KVD_METRICS_CTL_OPS][NRES];
	struct hist attend;
	_Atomic uint64_t wd_ping, wd_skip;
	const struct kvd_tier_counters *tier;   /* the tier's own (kvd_metrics_set_tier) */

	/* The snapshot: cur is read under mu; stage is the loop's alone. */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct snap cur, stage;
	uint64_t gen;                   /* under mu: snapshots published */
	int efd;                        /* a scrape wants a fresh snapshot */

	struct MHD_Daemon *httpd;
	int lfd;
	unsigned port;

	/* The endpoint's connections by deadline (accept + life_ns), under
	 * cmu: the reaper shuts down the socket of each one past it.  An fd
	 * is here from libmicrohttpd's STARTED notice to its CLOSED one,
	 * which comes before it closes the fd, so the reaper never touches
	 * a number the process has reused. */
	pthread_mutex_t cmu;
	pthread_cond_t ccv;
	struct conn {
		int fd;                 /* -1: a free slot */
		uint64_t deadline;      /* UINT64_MAX: already shut down */
	} conn[KVD_METRICS_CONNS];
	uint64_t life_ns;
	int quit;                       /* under cmu: the reaper returns */
	pthread_t reaper;
	int reaping;                    /* the reaper thread runs */
	_Atomic uint64_t http_cut;
};

int kvd_metrics_create(struct kvd_metrics **out)
{
	struct kvd_metrics *m = calloc(1, sizeof *m);
	pthread_condattr_t ca;

	if (!m)
		return -ENOMEM;
	m->lfd = -1;
	m->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (m->efd < 0) {
		int e = -errno;

		free(m);
		return e;
	}
	hist_init(&m->attend, le_attend, sizeof le_attend / sizeof le_attend[0]);
	pthread_mutex_init(&m->mu, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&m->cv, &ca);
	pthread_mutex_init(&m->cmu, NULL);
	pthread_cond_init(&m->ccv, &ca);
	pthread_condattr_destroy(&ca);
	for (unsigned i = 0; i < KVD_METRICS_CONNS; i++)
		m->conn[i].fd = -1;
	*out = m;
	return 0;
}

void kvd_metrics_destroy(struct kvd_metrics *m)
{
	if (!m)
		return;
	if (m->httpd)
		MHD_stop_daemon(m->httpd);
	if (m->reaping) {
		pthread_mutex_lock(&m->cmu);
		m->quit = 1;
		pthread_cond_signal(&m->ccv);
		pthread_mutex_unlock(&m->cmu);
		pthread_join(m->reaper, NULL);
	}
	if (m->lfd >= 0)
		close(m->lfd);
	close(m->efd);
	pthread_mutex_destroy(&m->mu);
	pthread_cond_destroy(&m->cv);
	pthread_mutex_destroy(&m->cmu);
	pthread_cond_destroy(&m->ccv);
	free(m->cur.uid);
	free(m->stage.uid);
	free(m);
}

int kvd_metrics_fd(const struct kvd_metrics *m)
{
	return m->efd;
}

unsigned kvd_metrics_port(const struct kvd_metrics *m)
{
	return m ? m->port : 0;
}

void kvd_metrics_set_tier(struct kvd_metrics *m, const struct kvd_tier_counters *c)
{
	m->tier = c;
}

/* ---- counting ------------------------------------------------------------ */

#define ADD(x, n) atomic_fetch_add_explicit(&(x), (n), memory_order_relaxed)

void kvd_metrics_ring(struct kvd_metrics *m, unsigned op, int res)
{
	if (m)
		ADD(m->ring[op < KVD_OP_MAX ? op : KVD_OP_MAX][res_row(res)], 1);
}

void kvd_metrics_control(struct kvd_metrics *m, unsigned body, int code)
{
	if (m)
		ADD(m->ctl[body < KVD_METRICS_CTL_OPS ? body : 0][res_row(code)], 1);
}

void kvd_metrics_attend(struct kvd_metrics *m, uint64_t ns)
{
	if (m)
		hist_observe(&m->attend, ns);
}

void kvd_metrics_watchdog(struct kvd_metrics *m, int pinged)
{
	if (m)
		atomic_fetch_add_explicit(pinged ? &m->wd_ping : &m->wd_skip, 1, memory_order_relaxed);
}

#define GET(x) atomic_load_explicit(&(x), memory_order_relaxed)

/* ---- the snapshot (the loop, under the state lock) ------------------------ */

static void uid_row(void *arg, uint32_t uid, const struct kvd_limits_usage *u)
{
	struct snap *sn = arg;

	if (sn->nuid == sn->cap)
		return;         /* sized before the walk: only a bug */
	sn->uid[sn->nuid].uid = uid;
	memcpy(sn->uid[sn->nuid].n, u->n, sizeof u->n);
	sn->nuid++;
}

static int uid_cmp(const void *a, const void *b)
{
	uint32_t x = ((const struct snap_uid *)a)->uid, y = ((const struct snap_uid *)b)->uid;

	return x < y ? -1 : x > y;
}

void kvd_metrics_collect(struct kvd_metrics *m, struct kvd_server *s)
{
	struct snap *sn = &m->stage, tmp;
	struct kvd_tier_stats ts;
	unsigned nu = kvd_limits_uids(s->limits);
	uint64_t x;

	if (read(m->efd, &x, sizeof x) < 0) {
		/* nothing pending: a direct collect (MetricsReq) */
	}
	if (nu > sn->cap) {
		struct snap_uid *p = realloc(sn->uid, nu * sizeof *p);

		if (p) {
			sn->uid = p;
			sn->cap = nu;
		}
	}
	sn->nuid = 0;
	kvd_limits_each(s->limits, uid_row, sn);
	if (sn->nuid)
		qsort(sn->uid, sn->nuid, sizeof *sn->uid, uid_cmp);

	/* Queue depth: entries in each SQ (clamped: the tail is the client's
	 * to scribble on) plus the one being worked on; a client is runnable
	 * when the executor could run something of it now. */
	sn->pending = sn->runnable = sn->parked = 0;
	for (struct client *c = s->clients; c; c = c->next) {
		uint32_t q, room;

		if (!c->hello || c->dead || !c->map)
			continue;       /* control-only connections have no rings */
		q = shm_ring_depth(&c->r.sq);
		room = shm_ring_room(&c->r.cq) > 0;
		sn->pending += q + (c->job.active ? 1 : 0);
		if (c->job.active && c->parked)
			sn->parked++;
		else if (c->job.active || (q && room))
			sn->runnable++;
	}
	kvd_tier_stats(s->tier, &ts);
	sn->mem_limit = ts.limit;
	sn->mem_high = ts.high;
	sn->mem_low = ts.low;
	sn->mem_used = ts.used;
	sn->mem_reserved = ts.reserved;
	sn->on_disk = ts.on_disk;
	sn->disk_bytes = ts.disk_bytes;
	sn->disconnects = s->disconnects;
	sn->refused = s->refused;
	if ((sn->remote = s->remote != NULL))
		kvd_remote_stats(s->remote, &sn->rs);
	sn->rem_puts = ts.rem_puts;
	sn->rem_drops = ts.rem_drops;
	sn->rem_fetches = ts.rem_fetches;
	sn->rem_only = ts.rem_only;
	sn->taken_ns = kvd_now_ns();

	pthread_mutex_lock(&m->mu);
	tmp = m->cur;
	m->cur = *sn;
	*sn = tmp;
	m->gen++;
	pthread_cond_broadcast(&m->cv);
	pthread_mutex_unlock(&m->mu);
}

/* ---- the text ------------------------------------------------------------ */

struct buf {
	char *p;
	size_t len, cap;
	int oom;
};

__attribute__((format(printf, 2, 3)))
static void put(struct buf *b, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (b->oom)
		return;
	for (;;) {
		va_start(ap, fmt);
		n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
		va_end(ap);
		if (n < 0) {
			b->oom = 1;
			return;
		}
		if ((size_t)n < b->cap - b->len) {
			b->len += (size_t)n;
			return;
		}
		size_t cap = b->cap * 2 + (size_t)n + 1;
		char *p = realloc(b->p, cap);

		if (!p) {
			b->oom = 1;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
}

/* A label value as the text format wants it: \ " and newline escaped. */
static const char *esc(char *out, size_t cap, const char *s)
{
	size_t o = 0;

	for (; *s && o + 3 < cap; s++) {
		if (*s == '\\' || *s == '"') {
			out[o++] = '\\';
			out[o++] = *s;
		} else if (*s == '\n') {
			out[o++] = '\\';
			out[o++] = 'n';
		} else {
			out[o++] = *s;
		}
	}
	out[o] = 0;
	return out;
}

static void head(struct buf *b, const char *name, const char *type, const char *help)
{
	put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void scalar(struct buf *b, const char *name, const char *type, const char *help,
		   uint64_t v)
{
	head(b, name, type, help);
	put(b, "%s %llu\n", name, (unsigned long long)v);
}

/* A histogram's lines: n upper bounds le, the per-bucket counts bk[n + 1]
 * and their sum in ns. */
static void hist_lines(struct buf *b, const char *name, const char *labels, const double *le,
		       unsigned n, _Atomic uint64_t *bk, _Atomic uint64_t *sum_ns)
{
	uint64_t cum = 0;
	const char *sep = labels[0] ? "," : "";

	for (unsigned i = 0; i < n; i++) {
		cum += GET(bk[i]);
		put(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep, le[i],
		    (unsigned long long)cum);
	}
	cum += GET(bk[n]);
	put(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep, (unsigned long long)cum);
	put(b, "%s_sum%s%s%s %.9f\n", name, labels[0] ? "{" : "", labels, labels[0] ? "}" : "",
	    (double)GET(*sum_ns) / 1e9);
	/* _count from the buckets themselves, so +Inf and _count always agree. */
	put(b, "%s_count%s%s%s %llu\n", name, labels[0] ? "{" : "", labels, labels[0] ? "}" : "",
	    (unsigned long long)cum);
}

static void hist_put(struct buf *b, const char *name, const char *labels, const struct hist *h)
{
	struct hist *w = (struct hist *)h;

	hist_lines(b, name, labels, h->le, h->n, w->b, &w->sum_ns);
}

static const char *ring_op_name(unsigned op)
{
	static const char *const names[KVD_OP_MAX] = { "nop", "prefill", "append", "attend",
						       "free", "prefetch", "local" };

	return op < KVD_OP_MAX && names[op] ? names[op] : "invalid";
}

static const char *ctl_op_name(unsigned body)
{
	return body ? kvd_ctl_request_name((Kvd__Request__BodyCase)body) : "invalid";
}

/* The table of one counter family by (op, result): ok rows of every known op
 * always (so rates start at 0), other results once seen. */
static void op_table(struct buf *b, const char *name, _Atomic uint64_t (*t)[NRES], unsigned nops,
		     const char *(*opname)(unsigned))
{
	for (unsigned op = 0; op < nops; op++) {
		const char *on = opname(op);

		if (!strcmp(on, "unknown"))
			continue;       /* a body case no request has */
		for (unsigned r = 0; r < NRES; r++) {
			uint64_t v = GET(t[op][r]);

			if (v || (r == 0 && strcmp(on, "invalid")))
				put(b, "%s{op=\"%s\",result=\"%s\"} %llu\n", name, on, row_name(r),
				    (unsigned long long)v);
		}
	}
}

static const struct {
	const char *name;
	enum kvd_res r;
	const char *help;
} uid_gauges[] = {
	{ "kvd_clients", KVD_RES_CONNECTIONS,
	  "Connections of the uid (counted from accept, before Hello)." },
	{ "kvd_sequences", KVD_RES_SEQUENCES, "Live sequences of the uid (in RAM or on disk)." },
	{ "kvd_profiles", KVD_RES_PROFILES, "Live profiles created by the uid." },
	{ "kvd_resident_bytes", KVD_RES_MEMORY,
	  "Bytes the uid holds in RAM against the memory budget: sequences (segments, staging, "
	  "tails, bookkeeping), profiles with W, restore reservations." },
	{ "kvd_spilled_bytes", KVD_RES_SPILL, "Bytes of the uid's spill files on disk." },
	{ "kvd_shm_bytes", KVD_RES_SHM, "Shared-memory regions (rings and slot arena) of the uid's connections." },
	{ "kvd_remote_bytes", KVD_RES_REMOTE,
	  "Bytes of the uid's evicted sequences' copies in the remote tier." },
};

static void render(struct kvd_metrics *m, const struct snap *sn, uint32_t only, struct buf *b)
{
	static const char *const how[3] = { "ok", "error", "cancelled" };
	static const struct kvd_tier_counters none;
	/* The tier's counters, read as they are now (not from the snapshot). */
	struct kvd_tier_counters *tc = (struct kvd_tier_counters *)(m->tier ? m->tier : &none);
	char v[128], g[128];
	uint64_t now = kvd_now_ns();

	head(b, "kvd_build_info", "gauge", "Always 1; the labels say which kvd this is.");
	put(b, "kvd_build_info{version=\"%s\",git=\"%s\"} 1\n", esc(v, sizeof v, KVD_VERSION),
	    esc(g, sizeof g, KVD_GIT_REV));

	head(b, "kvd_ring_requests_total", "counter",
	     "Ring entries completed, by op (invalid: an op kvd does not know) and result "
	     "(ok, or the name of the error code of the completion).");
	op_table(b, "kvd_ring_requests_total", m->ring, RING_OPS, ring_op_name);
	head(b, "kvd_control_requests_total", "counter",
	     "Control-socket requests answered, by request type (invalid: did not decode) and "
	     "result (ok, or the name of the code of the Error sent).");
	op_table(b, "kvd_control_requests_total", m->ctl, KVD_METRICS_CTL_OPS, ctl_op_name);

	head(b, "kvd_attend_layer_seconds", "histogram",
	     "ATTEND records (one sequence, one layer) computed, by the time of the executor's "
	     "pool job that computed them (records batched together share the job's time).");
	hist_put(b, "kvd_attend_layer_seconds", "", &m->attend);

	head(b, "kvd_queue_pending_entries", "gauge",
	     "Ring entries submitted and not yet completed, all clients (in the SQs, plus the one "
	     "each client's turn is working on).");
	put(b, "kvd_queue_pending_entries %llu\n", (unsigned long long)sn->pending);
	scalar(b, "kvd_queue_runnable_clients", "gauge",
	       "Clients the executor could run a unit of now (work queued, room in the CQ, not "
	       "waiting for the spill tier).", sn->runnable);
	scalar(b, "kvd_queue_parked_clients", "gauge",
	       "Clients whose entry waits for a restore or for room in the memory budget.", sn->parked);

	for (size_t k = 0; k < sizeof uid_gauges / sizeof uid_gauges[0]; k++) {
		head(b, uid_gauges[k].name, "gauge", uid_gauges[k].help);
		for (size_t i = 0; i < sn->nuid; i++)
			if (only == UINT32_MAX || sn->uid[i].uid == only)
				put(b, "%s{uid=\"%u\"} %llu\n", uid_gauges[k].name, sn->uid[i].uid,
				    (unsigned long long)sn->uid[i].n[uid_gauges[k].r]);
	}
	head(b, "kvd_shared_bytes", "gauge",
	     "Bytes of the uid's data shared with other sequences by prefix sharing; always 0: "
	     "prefix sharing is not built yet.");
	for (size_t i = 0; i < sn->nuid; i++)
		if (only == UINT32_MAX || sn->uid[i].uid == only)
			put(b, "kvd_shared_bytes{uid=\"%u\"} 0\n", sn->uid[i].uid);

	scalar(b, "kvd_memory_limit_bytes", "gauge", "The memory budget ([memory] limit; 0: none).",
	       sn->mem_limit);
	scalar(b, "kvd_memory_high_watermark_bytes", "gauge",
	       "Above this, least recently used sequences are written to disk.", sn->mem_high);
	scalar(b, "kvd_memory_low_watermark_bytes", "gauge",
	       "Write-backs continue until used bytes are at or below this.", sn->mem_low);
	scalar(b, "kvd_memory_used_bytes", "gauge",
	       "What the budget counts against the limit: resident data, bookkeeping, profiles, "
	       "restore reservations.", sn->mem_used);
	scalar(b, "kvd_memory_reserved_bytes", "gauge",
	       "Bytes reserved by restores in flight and not yet resident.", sn->mem_reserved);
	scalar(b, "kvd_sequences_on_disk", "gauge", "Sequences with nothing resident (state DISK).",
	       sn->on_disk);
	scalar(b, "kvd_spill_disk_bytes", "gauge", "Bytes of spill files on disk, all uids.",
	       sn->disk_bytes);
	if (sn->remote) {
		const struct kvd_remote_stats *r = &sn->rs;

		scalar(b, "kvd_remote_puts_total", "counter",
		       "Published prefixes written to the remote tier.", r->puts);
		scalar(b, "kvd_remote_put_bytes_total", "counter",
		       "Bytes of spill files written to the remote tier.", r->put_bytes);
		scalar(b, "kvd_remote_durable_total", "counter",
		       "Remote writes that WAIT saw reach the configured replicas.", r->durable);
		scalar(b, "kvd_remote_not_durable_total", "counter",
		       "Remote writes that WAIT did not see reach the configured replicas in time.",
		       r->not_durable);
		scalar(b, "kvd_remote_gets_total", "counter",
		       "Remote lookups for attaches (a hit, a miss or an error each).", r->gets);
		scalar(b, "kvd_remote_hits_total", "counter",
		       "Remote lookups that brought a prefix back.", r->hits);
		scalar(b, "kvd_remote_get_bytes_total", "counter",
		       "Bytes of spill files read from the remote tier.", r->get_bytes);
		scalar(b, "kvd_remote_corrupt_total", "counter",
		       "Remote prefixes refused: missing chunks, wrong sizes or CRC32C.", r->corrupt);
		scalar(b, "kvd_remote_too_big_total", "counter",
		       "Remote prefixes larger than the requesting uid may hold, not fetched.",
		       r->too_big);
		scalar(b, "kvd_remote_errors_total", "counter",
		       "Remote writes and lookups that failed on the cluster (down, timeouts).",
		       r->put_errors + r->get_errors);
		scalar(b, "kvd_remote_redirects_total", "counter",
		       "MOVED and ASK redirects followed.", r->rcl.moved + r->rcl.ask);
		scalar(b, "kvd_remote_deletes_total", "counter",
		       "Copies deleted from the remote tier (freed or stopping sequences).", r->dels);
		scalar(b, "kvd_remote_evicted_puts_total", "counter",
		       "Evicted sequences' files the remote tier confirmed ([remote] evicted).",
		       sn->rem_puts);
		scalar(b, "kvd_remote_local_drops_total", "counter",
		       "Local spill files dropped for spill room, their copy in the remote tier.",
		       sn->rem_drops);
		scalar(b, "kvd_remote_evicted_fetches_total", "counter",
		       "Evicted sequences' files fetched back from the remote tier for a restore.",
		       sn->rem_fetches);
		scalar(b, "kvd_sequences_remote_only", "gauge",
		       "Sequences on disk whose file is only in the remote tier.", sn->rem_only);
	}

	head(b, "kvd_spill_writes_total", "counter",
	     "Spill files written (write-backs), by result (cancelled: the sequence was freed "
	     "meanwhile).");
	for (int h = 0; h < 3; h++)
		put(b, "kvd_spill_writes_total{result=\"%s\"} %llu\n", how[h],
		    (unsigned long long)GET(tc->io_n[KVD_TIER_WRITE][h]));
	scalar(b, "kvd_spill_write_bytes_total", "counter", "Bytes of spill files written successfully.",
	       GET(tc->io_bytes[KVD_TIER_WRITE]));
	head(b, "kvd_spill_write_seconds", "histogram",
	     "Write-backs that ended (ok or error), from submission to the synced, renamed file.");
	hist_lines(b, "kvd_spill_write_seconds", "", kvd_tier_io_le, KVD_TIER_IO_LE,
		   tc->io_le[KVD_TIER_WRITE], &tc->io_sum_ns[KVD_TIER_WRITE]);
	head(b, "kvd_restores_total", "counter",
	     "Restores (sequences read back from disk), by result (error: the sequence is lost; "
	     "cancelled: freed meanwhile).");
	for (int h = 0; h < 3; h++)
		put(b, "kvd_restores_total{result=\"%s\"} %llu\n", how[h],
		    (unsigned long long)GET(tc->io_n[KVD_TIER_READ][h]));
	scalar(b, "kvd_restore_bytes_total", "counter", "Bytes of spill files read back by restores that succeeded.",
	       GET(tc->io_bytes[KVD_TIER_READ]));
	head(b, "kvd_restore_seconds", "histogram",
	     "Restores that ended (ok or error), from submission to the last extent installed.");
	hist_lines(b, "kvd_restore_seconds", "", kvd_tier_io_le, KVD_TIER_IO_LE,
		   tc->io_le[KVD_TIER_READ], &tc->io_sum_ns[KVD_TIER_READ]);
	head(b, "kvd_evictions_total", "counter",
	     "Sequences dropped from RAM, by how: written (after their write-back) or dropped "
	     "(their file was current, no write).");
	put(b, "kvd_evictions_total{how=\"written\"} %llu\n", (unsigned long long)GET(tc->evict[1]));
	put(b, "kvd_evictions_total{how=\"dropped\"} %llu\n", (unsigned long long)GET(tc->evict[0]));
	scalar(b, "kvd_sequences_lost_total", "counter",
	       "Sequences lost: a restore failed (I/O error, checksum or structure).", GET(tc->lost));

	scalar(b, "kvd_prefix_attach_hit_tokens_total", "counter",
	       "Tokens a new sequence found already held by prefix sharing; always 0: prefix "
	       "sharing is not built yet.", 0);
	scalar(b, "kvd_prefix_attach_miss_tokens_total", "counter",
	       "Tokens a new sequence could not attach by prefix sharing; always 0: prefix sharing "
	       "is not built yet.", 0);

	scalar(b, "kvd_watchdog_pings_total", "counter",
	       "WATCHDOG=1 notifications sent to systemd (0 without WatchdogSec=).", GET(m->wd_ping));
	scalar(b, "kvd_watchdog_skipped_total", "counter",
	       "Watchdog periods without a ping because the executor was stuck in a unit.",
	       GET(m->wd_skip));
	scalar(b, "kvd_disconnects_total", "counter", "Clients disconnected for protocol violations.",
	       sn->disconnects);
	scalar(b, "kvd_connections_refused_total", "counter",
	       "Connections refused (limits, shutting down).", sn->refused);
	scalar(b, "kvd_metrics_connections_cut_total", "counter",
	       "Connections to this endpoint shut down at [metrics] request_timeout_ms, whatever "
	       "the peer was still sending.", GET(m->http_cut));
	head(b, "kvd_snapshot_age_seconds", "gauge",
	     "Age of the gauges above (copied by the event loop when a scrape asks; grows only "
	     "while the executor holds the state lock through a long unit).");
	put(b, "kvd_snapshot_age_seconds %.6f\n",
	    sn->taken_ns ? (double)(now - sn->taken_ns) / 1e9 : 0.0);
}

int kvd_metrics_render(struct kvd_metrics *m, uint32_t only, int refresh, char **out, size_t *len)
{
	struct buf b = { .cap = 16384 };

	b.p = malloc(b.cap);
	if (!b.p)
		return -ENOMEM;
	b.p[0] = 0;
	pthread_mutex_lock(&m->mu);
	if (refresh && kvd_now_ns() - m->cur.taken_ns > KVD_METRICS_FRESH_MS * 1000000ull) {
		uint64_t gen = m->gen, one = 1;
		struct timespec dl;

		clock_gettime(CLOCK_MONOTONIC, &dl);
		dl.tv_nsec += KVD_METRICS_WAIT_MS * 1000000L;
		dl.tv_sec += dl.tv_nsec / 1000000000L;
		dl.tv_nsec %= 1000000000L;
		if (write(m->efd, &one, sizeof one) < 0) {
			/* the counter is full: a request is pending anyway */
		}
		while (m->gen == gen && pthread_cond_timedwait(&m->cv, &m->mu, &dl) != ETIMEDOUT)
			;
	}
	render(m, &m->cur, only, &b);
	pthread_mutex_unlock(&m->mu);
	if (b.oom) {
		free(b.p);
		return -ENOMEM;
	}
	*out = b.p;
	*len = b.len;
	return 0;
}

/* ---- HTTP ---------------------------------------------------------------- */

/* libmicrohttpd's timeout counts from the last byte received: a peer that
 * drips a byte now and then holds a connection for ever, and 64 such fill
 * the endpoint.  So every connection gets a deadline at accept, and this
 * thread shuts down the socket of each one past it, whatever the peer
 * sends.  shutdown(), not close(): the fd stays libmicrohttpd's, whose poll
 * sees the hang-up and closes the connection on its own thread. */
static void *reaper_main(void *arg)
{
	struct kvd_metrics *m = arg;

	pthread_mutex_lock(&m->cmu);
	while (!m->quit) {
		uint64_t now = kvd_now_ns(), next = UINT64_MAX;

		for (unsigned i = 0; i < KVD_METRICS_CONNS; i++) {
			struct conn *c = &m->conn[i];

			if (c->fd < 0 || c->deadline == UINT64_MAX)
				continue;
			if (c->deadline <= now) {
				shutdown(c->fd, SHUT_RDWR);
				c->deadline = UINT64_MAX;
				ADD(m->http_cut, 1);
			} else if (c->deadline < next) {
				next = c->deadline;
			}
		}
		if (next == UINT64_MAX) {
			pthread_cond_wait(&m->ccv, &m->cmu);
		} else {
			struct timespec dl = { .tv_sec = (time_t)(next / 1000000000u),
					       .tv_nsec = (long)(next % 1000000000u) };

			pthread_cond_timedwait(&m->ccv, &m->cmu, &dl);
		}
	}
	pthread_mutex_unlock(&m->cmu);
	return NULL;
}

/* libmicrohttpd's thread, at accept and when the connection is done (before
 * it closes the fd). */
static void on_conn(void *cls, struct MHD_Connection *conn, void **ctx,
		    enum MHD_ConnectionNotificationCode what)
{
	struct kvd_metrics *m = cls;
	const union MHD_ConnectionInfo *ci;
	struct conn *c = NULL;

	pthread_mutex_lock(&m->cmu);
	if (what != MHD_CONNECTION_NOTIFY_STARTED) {
		if ((c = *ctx))
			c->fd = -1;
		*ctx = NULL;
		pthread_mutex_unlock(&m->cmu);
		return;
	}
	ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
	for (unsigned i = 0; i < KVD_METRICS_CONNS && !c; i++)
		if (m->conn[i].fd < 0)
			c = &m->conn[i];
	/* libmicrohttpd admits KVD_METRICS_CONNS at once and counts one until
	 * after its CLOSED notice, on this same thread: a slot is free. */
	if (NEVER(!ci) || NEVER(!c)) {
		if (ci)
			shutdown(ci->connect_fd, SHUT_RDWR);    /* one we cannot time */
	} else {
		c->fd = ci->connect_fd;
		c->deadline = kvd_now_ns() + m->life_ns;
		*ctx = c;
		pthread_cond_signal(&m->ccv);
	}
	pthread_mutex_unlock(&m->cmu);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
				  const char *method, const char *version, const char *upload,
				  size_t *upload_len, void **con_cls)
{
	struct kvd_metrics *m = cls;
	struct MHD_Response *r;
	enum MHD_Result ret;
	unsigned status = MHD_HTTP_OK;
	char *text = NULL;
	size_t len = 0;

	if (strcmp(method, "GET") && strcmp(method, "HEAD")) {
		static const char msg[] = "only GET\n";

		r = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
		status = MHD_HTTP_METHOD_NOT_ALLOWED;
		if (r)
			MHD_add_response_header(r, "Allow", "GET, HEAD");
	} else if (strcmp(url, "/metrics")) {
		static const char msg[] = "kvd: metrics are at /metrics\n";

		r = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
		status = MHD_HTTP_NOT_FOUND;
	} else if (kvd_metrics_render(m, UINT32_MAX, 1, &text, &len)) {
		static const char msg[] = "out of memory\n";

		r = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
		status = MHD_HTTP_INTERNAL_SERVER_ERROR;
	} else {
		r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
		if (!r)
			free(text);
	}
	if (!r)
		return MHD_NO;
	MHD_add_response_header(r, "Content-Type", status == MHD_HTTP_OK ?
				"text/plain; version=0.0.4; charset=utf-8" : "text/plain");
	/* One request a connection: its deadline bounds that request, and a
	 * kept-alive scraper is never cut in the middle of a later one. */
	MHD_add_response_header(r, "Connection", "close");
	ret = MHD_queue_response(conn, status, r);
	MHD_destroy_response(r);
	return ret;
}

int kvd_metrics_addr_parse(const char *addr, struct sockaddr_storage *ss, socklen_t *sl)
{
	char host[64];
	const char *colon = strrchr(addr, ':');
	unsigned long port;
	char *end;
	size_t hl;

	if (!colon || !colon[1])
		return -EINVAL;
	errno = 0;
	port = strtoul(colon + 1, &end, 10);
	if (*end || errno || port > 65535 || colon[1] < '0' || colon[1] > '9')
		return -EINVAL;
	hl = (size_t)(colon - addr);
	if (hl >= sizeof host)
		return -EINVAL;
	memcpy(host, addr, hl);
	host[hl] = 0;
	memset(ss, 0, sizeof *ss);
	if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {
		struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;

		host[hl - 1] = 0;
		if (inet_pton(AF_INET6, host + 1, &a->sin6_addr) != 1)
			return -EINVAL;
		a->sin6_family = AF_INET6;
		a->sin6_port = htons((uint16_t)port);
		*sl = sizeof *a;
		return 0;
	}
	struct sockaddr_in *a = (struct sockaddr_in *)ss;

	if (inet_pton(AF_INET, host, &a->sin_addr) != 1)
		return -EINVAL;
	a->sin_family = AF_INET;
	a->sin_port = htons((uint16_t)port);
	*sl = sizeof *a;
	return 0;
}

int kvd_metrics_listen(struct kvd_metrics *m, const char *addr, uint32_t request_ms)
{
	struct sockaddr_storage ss;
	socklen_t sl;
	int one = 1, rc;

	if ((rc = kvd_metrics_addr_parse(addr, &ss, &sl)))
		return rc;
	m->life_ns = (uint64_t)request_ms * 1000000u;
	/* Our own socket: bind errors are errnos, and port 0 can be read back. */
	m->lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (m->lfd < 0)
		return -errno;
	setsockopt(m->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(m->lfd, (struct sockaddr *)&ss, sl) || listen(m->lfd, 64) ||
	    getsockname(m->lfd, (struct sockaddr *)&ss, &sl))
		return -errno;
	m->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
						 : ((struct sockaddr_in *)&ss)->sin_port);
	/* One thread of libmicrohttpd's own: a scrape waits at most
	 * KVD_METRICS_WAIT_MS for the loop and never touches the state.  A
	 * peer gets KVD_METRICS_CONNS_PER_IP of the connections, each for
	 * request_ms at most (the reaper); the inactivity timeout only frees
	 * a silent one sooner. */
	m->httpd = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
				    (ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0),
				    0, NULL, NULL, on_request, m,
				    MHD_OPTION_LISTEN_SOCKET, m->lfd,
				    MHD_OPTION_CONNECTION_LIMIT, (unsigned)KVD_METRICS_CONNS,
				    MHD_OPTION_PER_IP_CONNECTION_LIMIT,
				    (unsigned)KVD_METRICS_CONNS_PER_IP,
				    MHD_OPTION_NOTIFY_CONNECTION, on_conn, m,
				    MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10,
				    MHD_OPTION_END);
	if (!m->httpd)
		return -EIO;
	m->lfd = -1;            /* libmicrohttpd closes it */
	/* Connections accepted meanwhile wait in their slots: the reaper's
	 * first pass sees them. */
	if ((rc = -pthread_create(&m->reaper, NULL, reaper_main, m))) {
		MHD_stop_daemon(m->httpd);
		m->httpd = NULL;
		return rc;
	}
	m->reaping = 1;
	return 0;
}
