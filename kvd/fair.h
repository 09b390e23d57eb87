/* kvd_fair: each uid's fair share of kvd's two threads (daemon insides, not
 * an API; not to be confused with kvd/store/share.h, published prefixes).
 *
 * One struct kvd_fair per uid with a connection: the executor shares its
 * time between uids first and then between a uid's connections (vtime,
 * picked by kvd/exec.c), so more connections buy a uid no more of it; the
 * loop's time for the uid's control requests is a budget refilled at
 * [limits] control_cpu_per_uid of real time, up to one second's worth.  An
 * entry outlives its last connection while the uid owes control time or
 * has a log line pending (kvd_fair_gc frees it after), so closing every
 * connection wipes no debt.  No lock of its own: under the state lock.
 */
#ifndef KVD_FAIR_H
#define KVD_FAIR_H

#include <stdint.h>

struct kvd_fair {
	uint32_t uid, refs;             /* refs: its connections */
	uint64_t vtime;                 /* executor ns charged to the uid (plus rejoins) */
	uint64_t busy_ns;               /* executor ns spent for the uid, nothing else */
	/* At or below 0 the uid's sockets are not read until it refills. */
	int64_t ctl_budget_ns;
	uint64_t ctl_at_ns;             /* when the budget was last refilled */
	uint64_t ctl_ns;                /* control time spent for the uid, in all */
	uint64_t ctl_paused;            /* times one of its connections was paused */
	/* Connections cost their uid control time too (accept, set-up, the
	 * drop); a uid out of budget has new ones refused at accept. */
	uint64_t accepts, conn_refused;
	uint64_t log_ns;                /* start of its current one-second log window */
	uint32_t log_lines, log_quiet;  /* lines logged in that window, lines not logged */
	struct kvd_fair *next;
};

/* Every uid's entry (one per daemon, in struct kvd_server). */
struct kvd_fairs {
	struct kvd_fair *list;
	unsigned idle;                  /* entries without connections, kept for a debt or a log */
	uint32_t ctl_pct;               /* [limits] control_cpu_per_uid: % of one core */
	uint64_t uvclock;               /* executor: the uid clock of the last unit started */
};

/* A reference on uid's entry, made when it has none (level with the
 * others, not ahead, and with a full budget); NULL when out of memory. */
struct kvd_fair *kvd_fair_get(struct kvd_fairs *fs, uint32_t uid);
/* uid's entry when it has one, no reference taken. */
struct kvd_fair *kvd_fair_find(struct kvd_fairs *fs, uint32_t uid);
/* Drops a reference (f may be NULL); an entry left owing stays idle. */
void kvd_fair_put(struct kvd_fairs *fs, struct kvd_fair *f);
/* Frees idle entries whose debt is paid, reporting their lines not logged. */
void kvd_fair_gc(struct kvd_fairs *fs);
/* Frees every entry (at the end, references or not). */
void kvd_fair_destroy(struct kvd_fairs *fs);

/* Refills f's control budget up to now; whether it has any left. */
int kvd_fair_refill(struct kvd_fairs *fs, struct kvd_fair *f, uint64_t now);
/* Charges ns of loop time to f's control budget. */
void kvd_fair_spent(struct kvd_fair *f, uint64_t ns);

/* A line about uid's connections (refused, kicked, gone): at most
 * KVD_FAIR_LOG_LINES a second per uid, the rest counted and reported with
 * the next line logged, so one uid's churn cannot flood the log.  f may be
 * NULL: the line is logged as it is. */
#define KVD_FAIR_LOG_LINES 5
void kvd_fair_log(struct kvd_fair *f, int level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

#endif
