/* The daemon's insides, shared by its parts (not an API).  Each calls only
 * the ones listed below it, never one above:
 *
 *   server.c   the event loop: listening socket, clients' control sockets,
 *              signals, the watchdog timer, the tier's fd; accepts and
 *              drops clients.
 *   control.c  control-plane requests (protobuf over the socket), run by the
 *              loop thread: the session's own (Hello, profiles, sequences)
 *   admin.c    and the server-wide views and acts of kvctl (admin.h).
 *   exec.c     the executor thread: every ring entry, in small units
 *              (one ATTEND record, one PREFILL/APPEND entry), fair across
 *              clients, on the worker pools.
 *   clients.c  the client registry and the state lock (clients.h): what
 *              the parts above need of each other's clients.
 *   fair.c     each uid's share of the executor and of the loop (fair.h).
 *
 * Threads and the state lock.  Everything below — clients, store, tier,
 * counters — is guarded by s->mu.  The executor holds it while it runs a
 * unit and gives it to the loop between units whenever the loop asks
 * (loop_wants), so a control request waits for at most one unit.  The loop
 * never holds it across epoll_wait, and takes signals and the watchdog
 * timer without it, so neither waits for a unit.  A client's SQ is consumed
 * and its CQ produced only by the executor (or by the loop while the
 * executor is stopped, during drain), so each ring keeps a single consumer
 * and a single producer.
 *
 * The metrics endpoint's thread (kvd/metrics.c, libmicrohttpd) never takes
 * s->mu: it reads atomic counters and a snapshot of the gauges that the loop
 * copies under the lock when a scrape asks.
 */
#ifndef KVD_SERVER_INT_H
#define KVD_SERVER_INT_H

#include <signal.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "engine/attn.h"
#include "fair.h"
#include "kvd.pb-c.h"
#include "metrics.h"
#include "proto/kvd_ring.h"
#include "engine/numa_nodes.h"
#include "kvd/store/uidlimits.h"
#include "shm/shm.h"
#include "kvd/store/store.h"
#include "wire.h"

/* What an epoll event's data points at. */
enum { EV_LISTEN = 1, EV_SIGNAL, EV_TIMER, EV_CTL, EV_TIER, EV_METRICS, EV_REMOTE };
struct ev_tag {
	int kind;
	struct client *c;
};

/* The ring entry a client's executor turn is working through: copied out of
 * shared memory and checked once, then only this copy is used. */
struct job {
	int active;
	struct kvd_sqe e;
	struct kvd_cqe *cqe;            /* reserved in the client's CQ */
	/* ATTEND: the records' sequence ids, copied out once (pass 1), the
	 * profile they agreed on, and the next record to run. */
	uint32_t next;
	int checked;
	uint32_t pid;
	uint64_t *ids;                  /* [KVD_WIRE_MAX_NSEQ], allocated at Hello */
};

#define CLIENT_PROFILES 64              /* profile references one connection may hold */

struct client {
	uint64_t id;
	int fd, efd, memfd;
	pid_t pid;
	uid_t uid;
	uint32_t ns;                    /* profile namespace (kvd_config_namespace) */
	char tenant[KVD_NAME_MAX + 16]; /* "<uid>:<tenant>" */
	char name[KVD_NAME_MAX + 1];
	int hello, poll, dead;
	int control;                    /* Hello.control: no region, no rings (kvctl) */
	int admin;                      /* root, kvd's uid or [server] admin_group: sees every uid */
	int parked;                     /* its job waits for a restore or for room */
	int ctl_paused;                 /* its uid's control budget ran out: fd not polled */
	int owns;                       /* created or opened a sequence: its drop looks */
	int was_ready;
	uint64_t vtime;                 /* executor ns charged: the fair-share clock */
	struct kvd_fair *fair;          /* its uid's share of the threads (fair.h) */
	struct job job;
	uint32_t prof[CLIENT_PROFILES]; /* profile ids this connection holds a reference on */
	uint32_t nprof;
	struct shm_region r;
	void *map;
	size_t map_size;
	uint64_t shm_bytes;             /* charged to the uid as KVD_RES_SHM */
	struct client *next;
	struct ev_tag ev_ctl;
};

struct kvd_server {
	const struct kvd_config *cfg;
	int lfd, epfd, sfd, tfd;
	int listen_paused;              /* accept() hit EMFILE: listener out of the set */
	uint64_t emfile_logged_ns;
	/* One pool per NUMA node whose CPUs we may use (one in all on a
	 * one-node machine); a sequence is sealed and attended on its node's. */
	struct kvd_numa numa;
	unsigned npools;
	struct kvd_pool *pools[KVD_STORE_NODES];
	struct kvd_attn_scratch *scrs[KVD_STORE_NODES];
	struct kvd_store *store;
	struct kvd_tier *tier;
	struct kvd_share *share;        /* published prefixes (kvd/store/share.h) */
	struct kvd_remote *remote;      /* the remote tier, or NULL (kvd/store/remote.h) */
	struct kvd_limits *limits;
	struct client *clients;
	uint32_t nclients;
	uint64_t next_client;
	uint64_t requests, errors, disconnects, refused;
	int stopping;
	uint64_t watchdog_usec;
	void *rxbuf;
	struct ev_tag ev_listen, ev_signal, ev_timer, ev_tier, ev_metrics, ev_remote;
	/* Counters (atomics, any thread) and the gauge snapshot the loop
	 * publishes for scrapes (kvd/metrics.h). */
	struct kvd_metrics *metrics;

	/* The state lock and the executor (exec.c). */
	int sync_init;
	pthread_mutex_t mu;
	/* The executor sleeps in its own epoll set: the clients' kick eventfds
	 * (edge-triggered, never read: a kick is only a wake-up) and xnfd, the
	 * loop's "look again" (tier progress, stop).  So a client's kick never
	 * waits for the loop, whatever the loop is busy with. */
	int xepfd, xnfd;
	pthread_cond_t handoff;         /* executor: the loop is done with the lock */
	_Atomic int loop_wants;
	uint64_t loop_turns;            /* under mu: the loop's critical sections so far */
	_Atomic uint64_t exec_beat_ns;  /* executor's last sign of life */
	_Atomic int exec_idle;          /* executor asleep waiting for work */
	int exec_stop;                  /* under mu: drain, then exit */
	uint64_t stop_deadline_ns;      /* under mu: end of the drain */
	int exec_running;               /* the thread was started (loop thread only) */
	pthread_t exec_th;
	int nested;                     /* inside slice_yield */
	uint64_t nested_ns;             /* time slice_yield spent in the current unit */
	struct client *unit_client;     /* whose whole-entry unit is running */
	uint64_t unit_t0;
	uint64_t vclock;                /* fair-share clock of the last unit started */
	struct kvd_fairs fair;          /* every uid's share, and their clock (fair.h) */
	uint64_t hold_t0;               /* loop thread: when it took the lock (or last breathed) */
	uint64_t exec_passes;           /* under mu: the executor's passes so far */
	int loop_parked;                /* under mu: the loop waits for an executor pass */
	unsigned ctl_paused;            /* connections paused for their uid's control budget */
	struct kvd_exec_buf *xb;        /* the executor's unit buffers */
};

/* server.c */
int kvd_ep_add(struct kvd_server *s, int fd, void *tag);
/* The signals only the loop's thread takes: every other thread is started
 * with them blocked.  Inline: exec.c needs it, and server.c calls exec.c. */
static inline void kvd_signal_set(sigset_t *mask)
{
	sigemptyset(mask);
	sigaddset(mask, SIGTERM);
	sigaddset(mask, SIGINT);
	sigaddset(mask, SIGHUP);
}
/* Whether the peer is a member of gid (its primary group or a supplementary
 * one, from SO_PEERCRED / SO_PEERGROUPS at accept). */
int kvd_peer_in_group(int fd, uint32_t gid, uint32_t pgid);

/* control.c: reads and answers what c's control socket holds (under the
 * lock). */
void kvd_control_event(struct kvd_server *s, struct client *c);
/* Unmaps c's region, closes its memfd and eventfd, gives back its charge:
 * a failed Hello and a leaving client alike (under the lock). */
void kvd_control_unmap(struct kvd_server *s, struct client *c);
/* Drops every profile reference c holds (under the lock). */
void kvd_control_release(struct kvd_server *s, struct client *c);

/* Parked clients try their entries again (under the lock): every one, or
 * with id != 0 that client alone. */
static inline void kvd_unpark(struct kvd_server *s, uint64_t id)
{
	for (struct client *c = s->clients; c; c = c->next)
		if (!id || c->id == id)
			c->parked = 0;
}

/* exec.c */
int kvd_exec_start(struct kvd_server *s);
/* Asks the executor to answer what is queued and exit; joins it.  Called by
 * the loop without the lock. */
void kvd_exec_stop(struct kvd_server *s);
/* The executor's epoll set and notify fd; before any client (create). */
int kvd_exec_init(struct kvd_server *s);
/* New work may be ready (an unparked client, stop).  Any thread. */
void kvd_exec_notify(struct kvd_server *s);
/* A client's kick eventfd joins / leaves the executor's set. */
int kvd_exec_watch(struct kvd_server *s, int fd);
void kvd_exec_unwatch(struct kvd_server *s, int fd);
void kvd_exec_free(struct kvd_server *s);

#endif
