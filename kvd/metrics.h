/* kvd_metrics: kvd's counters, gauges and histograms in the Prometheus text
 * format (0.0.4; every metric in docs/OPERATIONS.md, "Metrics"), served over
 * HTTP by libmicrohttpd ([metrics] listen, GET /metrics) and as the text of
 * MetricsReply on the control socket (the same renderer, so the same text).
 *
 * Contract:
 *  - Counters and histograms are relaxed atomics: any thread counts with
 *    kvd_metrics_ring() .. kvd_metrics_watchdog() without a lock.  m may be
 *    NULL: nothing is counted.  The spill tier counts in its own
 *    (kvd_tier_counters, below the daemon); they are read the same way.
 *  - Gauges (clients and bytes by uid, queue depth, the budget) belong to the
 *    state under the server's lock.  The event loop copies them into a
 *    snapshot (kvd_metrics_collect, under the state lock, then a swap under
 *    this module's own small mutex).  A scrape never takes the state lock: it
 *    asks the loop for a fresh snapshot (an eventfd, kvd_metrics_fd) unless
 *    the last one is under KVD_METRICS_FRESH_MS old, waits for it at most
 *    KVD_METRICS_WAIT_MS, then renders what it has; kvd_snapshot_age_seconds
 *    says how old that is (it grows only while the executor holds the lock
 *    through a long unit).
 *  - Errors are negative errno.
 */
#ifndef KVD_METRICS_H
#define KVD_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#ifndef KVD_VERSION
#define KVD_VERSION "0.1.0"
#endif

#define KVD_METRICS_FRESH_MS    10      /* a snapshot this young is reused */
#define KVD_METRICS_WAIT_MS     250     /* a scrape waits this long for the loop */
#define KVD_METRICS_CTL_OPS     64      /* control request types counted (body case < this) */
#define KVD_METRICS_CONNS       64      /* HTTP connections at once */
#define KVD_METRICS_CONNS_PER_IP 8      /* of them from one peer address */

struct kvd_metrics;
struct kvd_server;
struct kvd_tier_counters;

/* The counters and the refresh eventfd; no thread yet.  0 or -errno. */
int kvd_metrics_create(struct kvd_metrics **out);
/* Starts the HTTP endpoint on "HOST:PORT" (IPv4 dotted quad or [IPv6]; PORT
 * 0 picks a free one, kvd_metrics_port() tells which) on libmicrohttpd's own
 * thread.  s is read only through the snapshot.  A connection carries one
 * request and is shut down request_ms after accept, whatever the peer sends
 * (a thread of this module's own watches the deadlines); one peer address
 * holds at most KVD_METRICS_CONNS_PER_IP of the KVD_METRICS_CONNS.  0 or
 * -errno. */
int kvd_metrics_listen(struct kvd_metrics *m, const char *addr, uint32_t request_ms);
/* "HOST:PORT" as kvd_metrics_listen takes it (also the config's check).
 * 0 or -EINVAL. */
int kvd_metrics_addr_parse(const char *addr, struct sockaddr_storage *ss, socklen_t *sl);
/* The port the endpoint listens on, 0 when it is off. */
unsigned kvd_metrics_port(const struct kvd_metrics *m);
/* Stops the HTTP threads (if any) and frees everything. */
void kvd_metrics_destroy(struct kvd_metrics *m);
/* The spill tier's counters (kvd_tier_counters), rendered as they are at
 * each scrape.  Before kvd_metrics_listen; they must outlive m's renders
 * (destroy m before the tier).  Without: rendered as 0. */
void kvd_metrics_set_tier(struct kvd_metrics *m, const struct kvd_tier_counters *c);

/* The loop polls this fd (readable: a scrape wants a snapshot). */
int kvd_metrics_fd(const struct kvd_metrics *m);
/* The loop, under the state lock: reads the fd and publishes a snapshot of
 * s's gauges. */
void kvd_metrics_collect(struct kvd_metrics *m, struct kvd_server *s);

/* The exposition text into a malloc'd NUL-terminated buffer (*len without
 * the NUL).  only: UINT32_MAX shows every uid's labelled series, else only
 * that uid's.  refresh: 0 renders the current snapshot as it is (callers
 * under the state lock collect first), 1 asks the loop and waits (any other
 * thread).  0 or -ENOMEM. */
int kvd_metrics_render(struct kvd_metrics *m, uint32_t only, int refresh, char **out,
		       size_t *len);

/* ---- counting (any thread) ---- */

/* A ring entry completed: op (KVD_OP_*; >= KVD_OP_MAX counts as "invalid"),
 * res 0 or the negative code of its completion. */
void kvd_metrics_ring(struct kvd_metrics *m, unsigned op, int res);
/* A control request answered: body is its Request body case (0: it did not
 * decode), code 0 or the Error code sent. */
void kvd_metrics_control(struct kvd_metrics *m, unsigned body, int code);
/* One ATTEND record (one sequence, one layer) computed in ns. */
void kvd_metrics_attend(struct kvd_metrics *m, uint64_t ns);
/* The watchdog timer fired: pinged (1) or held back for a silent executor. */
void kvd_metrics_watchdog(struct kvd_metrics *m, int pinged);

/* "ok", "EINVAL", "KVD_ELOST", ...: the result label of a code. */
const char *kvd_metrics_result_name(int code);

#endif
