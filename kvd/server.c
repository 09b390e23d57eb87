/* The event loop (kvd/server.h, kvd/server_int.h). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "config.h"
#include "proto/ctl.h"
#include "engine/clock.h"
#include "engine/err.h"
#include "kvd.pb-c.h"
#include "engine/log.h"
#include "engine/mem.h"
#include "engine/pool.h"
#include "clients.h"
#include "fair.h"
#include "server.h"
#include "server_int.h"
#include "kvd/store/store.h"
#include "kvd/store/remote.h"
#include "kvd/store/share.h"
#include "kvd/store/tier.h"

/* ---- signals ----------------------------------------------------------- */

/* A handler that only records the signal and pokes an eventfd the loop
 * polls (the self-pipe trick).  signalfd would do, but sanitizers intercept
 * signal delivery and never hand a blocked signal to a signalfd. */
static int sig_efd = -1;
static volatile sig_atomic_t sig_term, sig_hup;

static void poke(int fd)
{
	uint64_t one = 1;

	if (write(fd, &one, sizeof one) < 0) {
		/* the counter is full: a wake-up is pending anyway */
	}
}

static void on_signal(int sig)
{
	int e = errno;

	if (sig == SIGHUP)
		sig_hup = 1;
	else
		sig_term = sig;
	poke(sig_efd);
	errno = e;
}

/* ---- clients ----------------------------------------------------------- */

int kvd_ep_add(struct kvd_server *s, int fd, void *tag)
{
	struct epoll_event ev = { .events = EPOLLIN, .data.ptr = tag };

	return epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &ev) ? -errno : 0;
}

static void listen_resume(struct kvd_server *s)
{
	struct epoll_event ev = { .events = EPOLLIN, .data.ptr = &s->ev_listen };

	if (!s->listen_paused || s->stopping)
		return;
	if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, s->lfd, &ev) == 0)
		s->listen_paused = 0;
}

static void client_drop(struct kvd_server *s, struct client *c, const char *why)
{
	struct client **pp = &s->clients;
	uint64_t t0 = kvd_now_ns();
	unsigned nseq;

	while (*pp && *pp != c)
		pp = &(*pp)->next;
	if (*pp)
		*pp = c->next;
	s->nclients--;
	/* Its own sequences only (the store keeps them per owner). */
	kvd_tier_unwait(s->tier, c->id);
	nseq = c->owns ? kvd_tier_free_owner(s->tier, c->id) : 0;
	if (nseq && kvd_tier_waiting(s->tier))
		kvd_exec_notify(s);
	kvd_control_release(s, c);
	kvd_limits_uncharge(s->limits, c->uid, KVD_RES_CONNECTIONS, 1);
	kvd_fair_log(c->fair, c->hello ? LOG_INFO : LOG_DEBUG,
		     "client %llu (%s, pid %d, uid %u) gone: %s; released %u sequence(s), %zu bytes of shared memory",
		     (unsigned long long)c->id, c->name[0] ? c->name : "?", (int)c->pid,
		     (unsigned)c->uid, why, nseq, c->map_size);
	kvd_control_unmap(s, c);
	epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
	close(c->fd);
	if (c->ctl_paused)
		s->ctl_paused--;
	/* Its going is the uid's control time too, as its coming was. */
	if (c->fair)
		kvd_fair_spent(c->fair, kvd_now_ns() - t0);
	kvd_fair_put(&s->fair, c->fair);
	free(c->job.ids);
	free(c);
	/* A descriptor is free again: accept() may work now. */
	listen_resume(s);
}

int kvd_peer_in_group(int fd, uint32_t gid, uint32_t pgid)
{
	gid_t g[256];
	socklen_t len = sizeof g;

	if (pgid == gid)
		return 1;
	/* Linux >= 4.13.  More than 256 groups, or an older kernel: not a
	 * member (the safe answer). */
	if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, g, &len))
		return 0;
	for (size_t i = 0; i < len / sizeof g[0]; i++)
		if (g[i] == gid)
			return 1;
	return 0;
}

/* Out of descriptors: stop polling the listener (it stays readable and would
 * spin the loop) until a client leaves or a second passes; one log line per
 * minute at most. */
static void listen_pause(struct kvd_server *s, int err)
{
	struct epoll_event ev = { .events = 0, .data.ptr = &s->ev_listen };
	uint64_t now = kvd_now_ns();

	if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, s->lfd, &ev) == 0)
		s->listen_paused = 1;
	if (!s->emfile_logged_ns || now - s->emfile_logged_ns > 60ull * 1000000000u) {
		kvd_log(LOG_WARNING, "accept: %s: not accepting until a descriptor frees "
			"(raise LimitNOFILE=, or [limits] connections)", strerror(err));
		s->emfile_logged_ns = now;
	}
}

/* A connection we will not serve: say why when we can, then close. */
static void refuse(struct kvd_server *s, int fd, int code, const char *why)
{
	s->refused++;
	kvd_ctl_send_error(fd, 0, code, "%s", why);
	close(fd);
}

/* What one accepted connection costs its uid's control budget at least
 * (its accept, set-up and drop measured, when more): churn is paid for, at
 * most 1 s / KVD_CONN_COST_NS * control_cpu_per_uid connections a second. */
#define KVD_CONN_COST_NS 200000u
/* Connections taken per listener event: the backlog's rest comes next
 * turn, after the other events. */
#define ACCEPT_BURST 16

/* Called without the state lock, and takes it only around what is state
 * (the uid's budget, the limits, the client list): a uid churning
 * connections makes the loop accept and refuse tens of thousands a second,
 * and with the system calls under the lock the executor waited out every
 * hold the scheduler stretched by preempting the loop (a victim's ATTEND,
 * 110 ms).  The loop thread alone reads and writes listen_paused, stopping
 * and refused. */
static void accept_clients(struct kvd_server *s)
{
	for (int burst = 0; burst < ACCEPT_BURST && !s->listen_paused; burst++) {
		uint64_t t0 = kvd_now_ns(), spent;
		int fd = accept4(s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		struct ucred cred;
		socklen_t len = sizeof cred;
		struct client *c;
		struct kvd_fair *f;
		char msg[160];
		int rc;

		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
				listen_pause(s, errno);
			else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
				kvd_log(LOG_WARNING, "accept: %s", strerror(errno));
			return;
		}
		if (s->stopping) {
			refuse(s, fd, -ESHUTDOWN, "kvd is shutting down");
			continue;
		}
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len)) {
			close(fd);
			continue;
		}
		spent = kvd_now_ns() - t0;
		kvd_state_lock(s);
		t0 = kvd_now_ns();
		/* Out of control budget: refused before anything is made for
		 * it, at the cost of the refusal, which the uid pays too. */
		f = kvd_fair_find(&s->fair, cred.uid);
		if (f && !kvd_fair_refill(&s->fair, f, t0)) {
			f->conn_refused++;
			kvd_fair_log(f, LOG_NOTICE, "refusing a connection of pid %d (uid %u): "
				     "past limits.control_cpu_per_uid (%u%% of a core)", (int)cred.pid,
				     (unsigned)cred.uid, s->cfg->control_cpu_pct);
			spent += kvd_now_ns() - t0;
			kvd_state_unlock(s);
			t0 = kvd_now_ns();
			refuse(s, fd, -EAGAIN,
			       "connections past limits.control_cpu_per_uid: try later");
			spent += kvd_now_ns() - t0;
			/* f stays: entries are freed on this thread only
			 * (kvd_fair_gc, after the events). */
			kvd_state_lock(s);
			kvd_fair_spent(f, spent);
			kvd_state_unlock(s);
			continue;
		}
		/* Counted before anything is allocated for it, per uid: a uid that
		 * opens connections and never says Hello runs into its own cap. */
		rc = kvd_limits_charge(s->limits, cred.uid, KVD_RES_CONNECTIONS, 1, msg, sizeof msg);
		if (rc) {
			/* A uid at its own cap holds connections, so has an entry:
			 * its lines are its own.  At the global cap, one a second. */
			if (f)
				kvd_fair_log(f, LOG_NOTICE,
					     "refusing a connection of pid %d (uid %u): %s",
					     (int)cred.pid, (unsigned)cred.uid, msg);
			else
				kvd_log_refusal("refusing a connection of pid %d (uid %u): %s",
						(int)cred.pid, (unsigned)cred.uid, msg);
			kvd_state_unlock(s);
			refuse(s, fd, rc, msg);
			continue;
		}
		c = calloc(1, sizeof *c);
		if (c) {
			c->job.ids = malloc(KVD_WIRE_MAX_NSEQ * sizeof *c->job.ids);
			c->fair = kvd_fair_get(&s->fair, cred.uid);
		}
		if (!c || !c->job.ids || !c->fair) {
			if (c) {
				kvd_fair_put(&s->fair, c->fair);
				free(c->job.ids);
				free(c);
			}
			kvd_limits_uncharge(s->limits, cred.uid, KVD_RES_CONNECTIONS, 1);
			kvd_state_unlock(s);
			refuse(s, fd, -ENOMEM, "out of memory");
			continue;
		}
		c->id = ++s->next_client;
		c->fd = fd;
		c->efd = c->memfd = -1;
		c->pid = cred.pid;
		c->uid = cred.uid;
		c->ns = kvd_limits_namespace(s->limits, cred.uid);
		c->admin = cred.uid == 0 || cred.uid == geteuid() ||
			   (s->cfg->admin_group && kvd_peer_in_group(fd, s->cfg->admin_gid, cred.gid));
		c->ev_ctl.kind = EV_CTL;
		c->ev_ctl.c = c;
		if (kvd_ep_add(s, fd, &c->ev_ctl)) {
			kvd_limits_uncharge(s->limits, cred.uid, KVD_RES_CONNECTIONS, 1);
			close(fd);
			kvd_fair_put(&s->fair, c->fair);
			free(c->job.ids);
			free(c);
			kvd_state_unlock(s);
			continue;
		}
		c->next = s->clients;
		s->clients = c;
		s->nclients++;
		kvd_fair_log(c->fair, LOG_DEBUG, "client %llu connected: pid %d uid %d",
			     (unsigned long long)c->id, (int)cred.pid, (int)cred.uid);
		spent += kvd_now_ns() - t0;
		c->fair->accepts++;
		kvd_fair_spent(c->fair, spent > KVD_CONN_COST_NS ? spent : KVD_CONN_COST_NS);
		kvd_state_unlock(s);
	}
}

/* ---- loop -------------------------------------------------------------- */

static void reap_dead(struct kvd_server *s)
{
	for (struct client *c = s->clients, *nx; c; c = nx) {
		nx = c->next;
		if (c->dead)
			client_drop(s, c, "disconnected");
	}
}

/* I/O results: restores progressed or room was made, so every waiting
 * client tries its entry again. */
static void remote_done(void *arg, const struct kvd_remote_done *d)
{
	struct kvd_server *s = arg;

	if (d->who == KVD_REMOTE_FOR_TIER) {
		kvd_tier_remote_done(s->tier, d);
		/* A fetched file lets a parked restore go on. */
		if (d->op == KVD_REMOTE_GET) {
			kvd_unpark(s, 0);
			kvd_exec_notify(s);
		}
	} else if (s->share) {
		kvd_share_remote_done(s->share, d);
	}
}

static void tier_event(struct kvd_server *s)
{
	if (!kvd_tier_poll(s->tier))
		return;
	kvd_unpark(s, 0);
	kvd_tier_balance(s->tier);
	kvd_exec_notify(s);
}

/* What the handler recorded.  Called after every event batch and every
 * wait, not only when the eventfd fires: the flags, not the wake-up, are
 * the truth. */
static void check_signals(struct kvd_server *s)
{
	if (sig_hup) {
		int rc = s->cfg->log_path[0] ? kvd_log_open(s->cfg->log_path) : 0;

		sig_hup = 0;
		if (rc)
			kvd_log(LOG_ERR, "SIGHUP: cannot reopen %s: %s", s->cfg->log_path,
				kvd_strerror(rc));
		else
			kvd_log(LOG_INFO, "SIGHUP: %s", s->cfg->log_path[0] ?
				"log file reopened" : "logging to stderr, nothing to reopen");
	}
	if (sig_term && !s->stopping) {
		kvd_log(LOG_INFO, "signal %d: draining and stopping", (int)sig_term);
		s->stopping = 1;
	}
}

/* The watchdog says the daemon works, not only that the loop turns: it is
 * pinged while the executor is asleep for want of work or finished a unit
 * within the last watchdog interval.  A unit stuck longer than that is a
 * hung daemon, and systemd restarts it. */
static void watchdog(struct kvd_server *s)
{
	uint64_t beat = atomic_load_explicit(&s->exec_beat_ns, memory_order_relaxed);

	if (atomic_load_explicit(&s->exec_idle, memory_order_relaxed) ||
	    kvd_now_ns() - beat < s->watchdog_usec * 1000) {
		kvd_metrics_watchdog(s->metrics, sd_notify(0, "WATCHDOG=1") > 0);
		return;
	}
	kvd_metrics_watchdog(s->metrics, 0);
	kvd_log(LOG_ERR, "executor silent for %llu ms: not pinging the watchdog",
			(unsigned long long)((kvd_now_ns() - beat) / 1000000));
}

static void handle_events(struct kvd_server *s, struct epoll_event *ev, int n)
{
	int locked = 0;

	/* Signals and the watchdog first, without the lock: neither may wait
	 * for an executor unit. */
	for (int i = 0; i < n; i++) {
		const struct ev_tag *tag = ev[i].data.ptr;
		uint64_t x;

		if (tag->kind == EV_SIGNAL) {
			if (read(s->sfd, &x, sizeof x) < 0 && errno != EAGAIN)
				continue;
		} else if (tag->kind == EV_TIMER) {
			if (read(s->tfd, &x, sizeof x) > 0)
				watchdog(s);
		}
	}
	check_signals(s);
	/* New connections too: accept_clients takes the lock itself, briefly. */
	for (int i = 0; i < n; i++)
		if (((const struct ev_tag *)ev[i].data.ptr)->kind == EV_LISTEN)
			accept_clients(s);
	for (int i = 0; i < n; i++) {
		const struct ev_tag *tag = ev[i].data.ptr;
		struct client *c = tag->c;

		if (tag->kind == EV_SIGNAL || tag->kind == EV_TIMER || tag->kind == EV_LISTEN)
			continue;
		if (!locked) {
			kvd_state_lock(s);
			locked = 1;
		} else {
			kvd_loop_breathe(s);
		}
		switch (tag->kind) {
		case EV_CTL:
			/* A paused socket reports only hang-ups and errors: the
			 * peer left, nobody waits for its queued requests, and
			 * left in the set the level-triggered hang-up would spin
			 * the loop until the budget refilled. */
			if (c->ctl_paused && (ev[i].events & (EPOLLHUP | EPOLLERR)))
				c->dead = 1;
			if (!c->dead)
				kvd_control_event(s, c);
			break;
		case EV_TIER:
			tier_event(s);
			break;
		case EV_METRICS:
			kvd_metrics_collect(s->metrics, s);
			break;
		case EV_REMOTE:
			kvd_remote_poll(s->remote, remote_done, s);
			break;
		}
	}
	if (!locked) {
		kvd_state_lock(s);
		locked = 1;
	}
	reap_dead(s);
	if (s->ctl_paused)
		kvd_client_resume(s);
	if (s->fair.idle)
		kvd_fair_gc(&s->fair);
	/* Paused for EMFILE: try again now and then even if no client left
	 * (descriptors also free when spill files close). */
	int resumed = s->listen_paused && kvd_now_ns() - s->emfile_logged_ns > 1000000000u;

	if (resumed)
		listen_resume(s);
	kvd_state_unlock(s);
	if (resumed)
		accept_clients(s);
}

static unsigned total_workers(const struct kvd_server *s)
{
	unsigned n = 0;

	for (unsigned i = 0; i < s->npools; i++)
		n += kvd_pool_size(s->pools[i]);
	return n;
}

int kvd_server_run(struct kvd_server *s)
{
	struct epoll_event ev[64];
	int rc = kvd_exec_start(s);

	if (rc) {
		kvd_log(LOG_ERR, "cannot start the executor: %s", kvd_strerror(rc));
		return rc;
	}
	sd_notify(0, "READY=1\nSTATUS=serving");
	errno = 0;
	int nice = getpriority(PRIO_PROCESS, 0);

	/* The niceness too: decoders wait on these threads, and one started
	 * without the unit's Nice= queues them behind users' CPU hogs. */
	kvd_log(LOG_INFO, "serving on %s with %u worker(s), kernels %s, nice %d",
		s->cfg->socket_path, total_workers(s), kvd_kern_get()->name, errno ? 0 : nice);
	if (s->numa.active)
		kvd_log(LOG_INFO, "NUMA: %u node(s), one pool each; sequences placed by resident bytes",
			s->npools);
	while (!s->stopping) {
		/* The executor polls the rings; the loop only waits for events.
		 * A bounded wait: a second's wake-up costs nothing and re-checks
		 * the signal flags and a paused listener; uids kept for a
		 * debt are looked at ten times a second. */
		int ms = s->ctl_paused ? 5 : s->fair.idle ? 100 : 1000;
		int n = epoll_wait(s->epfd, ev, 64, ms);

		handle_events(s, ev, n > 0 ? n : 0);
	}
	sd_notify(0, "STOPPING=1\nSTATUS=draining");
	/* Drain: what clients already queued is answered, then everyone goes. */
	kvd_exec_stop(s);
	/* Published prefixes outlive kvd only with --persist (their files stay,
	 * written when they were published); else they go now, files
	 * included, before the tier starts keeping files. */
	kvd_share_set_remote(s->share, NULL);
	/* Evicted sequences' copies are of this lifetime: they go too (a few
	 * seconds at most; a crash leaves them, see OPERATIONS.md). */
	if (s->remote) {
		kvd_tier_remote_forget_all(s->tier);
		kvd_remote_flush(s->remote, 5000);
	}
	kvd_tier_set_remote(s->tier, NULL);
	kvd_remote_destroy(s->remote);
	s->remote = NULL;
	if (s->cfg->persist)
		kvd_tier_stopping(s->tier);
	kvd_share_destroy(s->share);
	s->share = NULL;
	kvd_tier_stopping(s->tier);
	while (s->clients)
		client_drop(s, s->clients, "server stopping");
	kvd_log(LOG_INFO, "stopped: %llu requests, %llu errors, %llu disconnects, %llu refused",
		(unsigned long long)s->requests, (unsigned long long)s->errors,
		(unsigned long long)s->disconnects, (unsigned long long)s->refused);
	return 0;
}

/* ---- setup ------------------------------------------------------------- */

/* One node: one pool over every allowed CPU, as ever.  Several: a pool per
 * node pinned to its CPUs, `threads` shared out in proportion. */
static int make_pools(struct kvd_server *s)
{
	unsigned total = 0;
	int rc = kvd_numa_init(&s->numa, KVD_STORE_NODES);

	if (rc)
		return rc;
	/* Dropping a sequence unmaps it under the state lock: behind it. */
	int frc = kvd_mem_free_behind();

	if (frc)
		kvd_log(LOG_WARNING, "frees stay synchronous: %s", kvd_strerror(frc));
	if (!s->numa.active) {
		s->npools = 1;
		rc = kvd_pool_create(s->cfg->threads, 1, &s->pools[0]);
	} else {
		for (unsigned i = 0; i < s->numa.nnodes; i++)
			total += s->numa.node[i].ncpus;
		for (unsigned i = 0; i < s->numa.nnodes && !rc; i++) {
			const struct kvd_numa_node *nd = &s->numa.node[i];
			unsigned th = s->cfg->threads ? (s->cfg->threads * nd->ncpus + total - 1) / total
						      : nd->ncpus;

			rc = kvd_pool_create_cpus(th, nd->cpu, nd->ncpus, &s->pools[i]);
			if (!rc)
				s->npools = i + 1;
		}
	}
	for (unsigned i = 0; i < s->npools && !rc; i++) {
		s->scrs[i] = calloc(kvd_pool_size(s->pools[i]), sizeof *s->scrs[i]);
		if (!s->scrs[i])
			return -ENOMEM;
		for (unsigned w = 0; w < kvd_pool_size(s->pools[i]) && !rc; w++)
			rc = kvd_attn_scratch_init(&s->scrs[i][w], KVD_SEG_MAX);
	}
	return rc;
}

static int listen_on(const char *path)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(path) >= sizeof a.sun_path)
		return -ENAMETOOLONG;
	memcpy(a.sun_path, path, strlen(path) + 1);
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	/* A stale socket from a crashed kvd would block bind(); a live kvd on
	 * the same path is the operator's mistake and is reported by connect. */
	if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
		close(fd);
		return -EADDRINUSE;
	}
	unlink(path);
	/* Who may connect is the umask's business (systemd/kvd.service). */
	if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 128)) {
		int e = -errno;

		close(fd);
		return e;
	}
	return fd;
}

int kvd_server_create(const struct kvd_config *cfg, struct kvd_server **out)
{
	struct kvd_server *s = calloc(1, sizeof *s);
	sigset_t mask;
	int rc;

	if (!s)
		return -ENOMEM;
	/* Workers must never run the signal handler: block the signals while
	 * the pool starts (threads inherit the mask), unblock them after. */
	kvd_signal_set(&mask);
	pthread_sigmask(SIG_BLOCK, &mask, NULL);
	signal(SIGPIPE, SIG_IGN);
	s->cfg = cfg;
	s->fair.ctl_pct = cfg->control_cpu_pct;
	s->lfd = s->epfd = s->sfd = s->tfd = s->xepfd = s->xnfd = -1;
	s->ev_listen.kind = EV_LISTEN;
	s->ev_signal.kind = EV_SIGNAL;
	s->ev_timer.kind = EV_TIMER;
	s->rxbuf = malloc(KVD_CTL_REQ_MAX);
	rc = -ENOMEM;
	if (!s->rxbuf)
		goto fail;
	pthread_mutex_init(&s->mu, NULL);
	{
		pthread_condattr_t ca;

		/* kvd_loop_breathe waits on it against kvd_now_ns(). */
		pthread_condattr_init(&ca);
		pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
		pthread_cond_init(&s->handoff, &ca);
		pthread_condattr_destroy(&ca);
	}
	s->sync_init = 1;
	if ((rc = kvd_exec_init(s)) || (rc = kvd_metrics_create(&s->metrics)))
		goto fail;
	{
		struct kvd_limits_cfg lc;

		kvd_config_limits(cfg, &lc);
		if ((rc = kvd_limits_create(&lc, &s->limits)))
			goto fail;
	}
	if ((rc = make_pools(s)))
		goto fail;
	if ((rc = kvd_store_create(s->pools[0], &s->store)) ||
	    (rc = kvd_store_set_limits(s->store, s->limits)))
		goto fail;
	if (s->numa.active) {
		int mem[KVD_STORE_NODES];

		for (unsigned i = 0; i < s->npools; i++)
			mem[i] = s->numa.node[i].mem;
		if ((rc = kvd_store_nodes(s->store, s->pools, mem, s->npools)))
			goto fail;
	}
	{
		struct kvd_tier_cfg tc = { 0 };

		tc.limit = cfg->mem_limit;
		tc.high = cfg->mem_limit / 100 * cfg->mem_high;
		tc.low = cfg->mem_limit / 100 * cfg->mem_low;
		tc.spill = cfg->spill_ndirs > 0;
		tc.persist = cfg->persist;
		tc.remote = cfg->remote_seeds[0] != 0;
		for (unsigned i = 0; i < cfg->spill_ndirs; i++)
			tc.io.dirs[i] = cfg->spill_dir[i];
		tc.io.ndirs = cfg->spill_ndirs;
		tc.io.limit = cfg->spill_limit;
		tc.io.qd = cfg->spill_qd;
		tc.io.block = cfg->spill_block;
		tc.io.buffered = cfg->spill_buffered;
		tc.io.fault = cfg->spill_fault_on ? cfg->spill_fault : NULL;
		if ((rc = kvd_tier_create(&tc, s->store, &s->tier))) {
			kvd_log(LOG_ERR, "spill: %s", kvd_strerror(rc));
			goto fail;
		}
		kvd_metrics_set_tier(s->metrics, kvd_tier_counters(s->tier));
		/* Before the load: published prefixes found on disk are filed
		 * again as they are read. */
		if ((rc = kvd_share_create(s->store, s->tier, &s->share))) {
			kvd_log(LOG_ERR, "share: %s", kvd_strerror(rc));
			goto fail;
		}
		rc = kvd_tier_load(s->tier);
		if (rc < 0) {
			kvd_log(LOG_ERR, "spill: cannot scan the spill directories: %s", kvd_strerror(rc));
			goto fail;
		}
		if (tc.spill)
			kvd_log(LOG_INFO, "spill: %u director%s%s, %d sequence(s) found on disk",
				tc.io.ndirs, tc.io.ndirs == 1 ? "y" : "ies",
				tc.persist ? ", persistent" : "", rc);
		rc = 0;
	}
	if (cfg->remote_seeds[0]) {
		struct kvd_remote_cfg rc_ = {
			.rcl = { .seeds = cfg->remote_seeds, .connect_ms = cfg->remote_connect_ms,
				 .io_ms = cfg->remote_timeout_ms, .retry_ms = cfg->remote_retry_ms },
			.prefix = cfg->remote_prefix,
			.chunk_bytes = cfg->remote_chunk,
			.replicas = cfg->remote_replicas,
			.wait_ms = cfg->remote_wait_ms,
		};
		char msg[160] = "";

		rc_.dir = kvd_tier_spill_dir(s->tier, &rc_.dir_index);
		if ((rc = kvd_remote_create(&rc_, &s->remote, msg, sizeof msg))) {
			kvd_log(LOG_ERR, "[remote]: %s", msg[0] ? msg : kvd_strerror(rc));
			goto fail;
		}
		kvd_share_set_remote(s->share, s->remote);
		if (cfg->remote_evicted)
			kvd_tier_set_remote(s->tier, s->remote);
		kvd_log(LOG_INFO, "remote: Redis Cluster at %s, keys %s:{...}%s%s", cfg->remote_seeds,
			cfg->remote_prefix, cfg->remote_replicas ? ", WAIT for replicas" : "",
			cfg->remote_evicted ? ", evicted sequences too" : "");
	}

	s->sfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	s->epfd = epoll_create1(EPOLL_CLOEXEC);
	if (s->sfd < 0 || s->epfd < 0) {
		rc = -errno;
		goto fail;
	}
	/* The metrics endpoint's thread starts while the signals are blocked,
	 * like the workers.  An address given explicitly must work; the
	 * built-in default is best effort (another kvd may hold it). */
	if (cfg->metrics_listen[0]) {
		rc = kvd_metrics_listen(s->metrics, cfg->metrics_listen, cfg->metrics_request_ms);
		if (rc && cfg->metrics_listen_set) {
			kvd_log(LOG_ERR, "[metrics] listen = %s: %s", cfg->metrics_listen,
				kvd_strerror(rc));
			goto fail;
		}
		if (rc)
			kvd_log(LOG_WARNING, "metrics: cannot listen on %s (the default): %s; "
				"no metrics endpoint ([metrics] listen)", cfg->metrics_listen,
				kvd_strerror(rc));
		else
			kvd_log(LOG_INFO, "metrics: http://%s/metrics (port %u)", cfg->metrics_listen,
				kvd_metrics_port(s->metrics));
		rc = 0;
	}
	{
		struct sigaction sa = { .sa_handler = on_signal };

		sig_efd = s->sfd;
		sigemptyset(&sa.sa_mask);
		sa.sa_flags = SA_RESTART;
		sigaction(SIGTERM, &sa, NULL);
		sigaction(SIGINT, &sa, NULL);
		sigaction(SIGHUP, &sa, NULL);
		pthread_sigmask(SIG_UNBLOCK, &mask, NULL);
	}
	s->lfd = listen_on(cfg->socket_path);
	if (s->lfd < 0) {
		rc = s->lfd;
		kvd_log(LOG_ERR, "cannot listen on %s: %s", cfg->socket_path, kvd_strerror(rc));
		goto fail;
	}
	if ((rc = kvd_ep_add(s, s->lfd, &s->ev_listen)) || (rc = kvd_ep_add(s, s->sfd, &s->ev_signal)))
		goto fail;
	s->ev_tier.kind = EV_TIER;
	if (kvd_tier_fd(s->tier) >= 0 && (rc = kvd_ep_add(s, kvd_tier_fd(s->tier), &s->ev_tier)))
		goto fail;
	s->ev_remote.kind = EV_REMOTE;
	if (s->remote && (rc = kvd_ep_add(s, kvd_remote_fd(s->remote), &s->ev_remote)))
		goto fail;
	s->ev_metrics.kind = EV_METRICS;
	if ((rc = kvd_ep_add(s, kvd_metrics_fd(s->metrics), &s->ev_metrics)))
		goto fail;
	if (sd_watchdog_enabled(0, &s->watchdog_usec) > 0) {
		struct itimerspec it = { 0 };
		/* A quarter, not the customary half: a ping may wait for the
		 * lock behind one executor unit, and even then no gap between
		 * pings may reach half the period. */
		uint64_t every = s->watchdog_usec / 4;

		it.it_interval.tv_sec = (time_t)(every / 1000000);
		it.it_interval.tv_nsec = (long)(every % 1000000) * 1000;
		it.it_value = it.it_interval;
		s->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
		if (s->tfd < 0 || timerfd_settime(s->tfd, 0, &it, NULL) ||
		    (rc = kvd_ep_add(s, s->tfd, &s->ev_timer))) {
			rc = rc ? rc : -errno;
			goto fail;
		}
	}
	*out = s;
	return 0;
fail:
	kvd_server_destroy(s);
	return rc;
}

void kvd_server_destroy(struct kvd_server *s)
{
	if (!s)
		return;
	kvd_exec_stop(s);
	while (s->clients)
		client_drop(s, s->clients, "server destroyed");
	if (s->lfd >= 0) {
		close(s->lfd);
		unlink(s->cfg->socket_path);
	}
	if (s->epfd >= 0)
		close(s->epfd);
	if (s->sfd >= 0)
		close(s->sfd);
	if (s->tfd >= 0)
		close(s->tfd);
	if (s->share)
		kvd_share_set_remote(s->share, NULL);
	if (s->tier)
		kvd_tier_set_remote(s->tier, NULL);
	/* Before the tier, whose counters a scrape reads.  A scrape in flight
	 * stops waiting for the loop after KVD_METRICS_WAIT_MS. */
	kvd_metrics_destroy(s->metrics);
	kvd_remote_destroy(s->remote);
	kvd_share_destroy(s->share);
	kvd_tier_destroy(s->tier);
	kvd_store_destroy(s->store);
	for (unsigned i = 0; i < s->npools; i++) {
		for (unsigned w = 0; s->scrs[i] && w < kvd_pool_size(s->pools[i]); w++)
			kvd_attn_scratch_free(&s->scrs[i][w]);
		free(s->scrs[i]);
		kvd_pool_destroy(s->pools[i]);
	}
	kvd_numa_fini(&s->numa);
	free(s->rxbuf);
	kvd_exec_free(s);
	kvd_fair_destroy(&s->fair);     /* some kept for a debt after their last client */
	kvd_limits_destroy(s->limits);
	if (s->sync_init) {
		pthread_mutex_destroy(&s->mu);
		pthread_cond_destroy(&s->handoff);
	}
	free(s);
}
