/* The client registry and the state lock (kvd/clients.h). */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include "engine/clock.h"
#include "engine/log.h"
#include "clients.h"
#include "fair.h"
#include "server_int.h"
#include "kvd/store/store.h"

/* ---- the state lock ---------------------------------------------------- */

void kvd_state_lock(struct kvd_server *s)
{
	/* Pairs with the executor's acquire load in yield_to_loop(): it sees
	 * we wait and hands the lock over after its unit. */
	atomic_fetch_add_explicit(&s->loop_wants, 1, memory_order_release);
	pthread_mutex_lock(&s->mu);
	atomic_fetch_sub_explicit(&s->loop_wants, 1, memory_order_relaxed);
	s->hold_t0 = kvd_now_ns();
}

void kvd_state_unlock(struct kvd_server *s)
{
	s->loop_turns++;
	pthread_cond_broadcast(&s->handoff);
	pthread_mutex_unlock(&s->mu);
}

void kvd_loop_breathe(struct kvd_server *s)
{
	uint64_t now = kvd_now_ns(), p0 = s->exec_passes, until;
	struct timespec ts;

	if (now - s->hold_t0 < KVD_LOOP_HOLD_NS)
		return;
	/* A new turn releases an executor waiting in yield_to_loop(); counted
	 * in loop_wants, we get the lock back after its next pass.  An idle
	 * executor has nothing to run: a short wait lets one just woken in. */
	until = now + (atomic_load_explicit(&s->exec_idle, memory_order_relaxed) ? 100000
										: KVD_LOOP_WAIT_NS);
	ts.tv_sec = (time_t)(until / 1000000000u);
	ts.tv_nsec = (long)(until % 1000000000u);
	s->loop_turns++;
	s->loop_parked = 1;
	atomic_fetch_add_explicit(&s->loop_wants, 1, memory_order_release);
	pthread_cond_broadcast(&s->handoff);
	while (s->exec_passes == p0 && !s->exec_stop &&
	       pthread_cond_timedwait(&s->handoff, &s->mu, &ts) != ETIMEDOUT) {
	}
	atomic_fetch_sub_explicit(&s->loop_wants, 1, memory_order_relaxed);
	s->loop_parked = 0;
	s->hold_t0 = kvd_now_ns();
}

/* ---- clients ----------------------------------------------------------- */

/* The loop's eventfd (the one its signal handler pokes): it wakes and reaps
 * the client the executor kicked. */
static void wake_loop(struct kvd_server *s)
{
	uint64_t one = 1;

	if (write(s->sfd, &one, sizeof one) < 0) {
		/* the counter is full: a wake-up is pending anyway */
	}
}

/* A protocol violation: this client only.  Either thread, under the lock;
 * the loop reaps it (wake_loop: the executor may be the one). */
void kvd_client_kick(struct kvd_server *s, struct client *c, const char *why)
{
	if (c->dead)
		return;
	s->disconnects++;
	kvd_fair_log(c->fair, LOG_WARNING, "client %llu (uid %u): %s: disconnecting",
		     (unsigned long long)c->id, (unsigned)c->uid, why);
	c->dead = 1;
	wake_loop(s);
}

struct kvd_seqn *kvd_client_seq(struct kvd_server *s, struct client *c, uint64_t seq)
{
	struct kvd_seqn *q = kvd_store_seq_get(s->store, seq, c->tenant);

	return q && kvd_store_seq_owner(q) == c->id ? q : NULL;
}

void kvd_log_refusal(const char *fmt, ...)
{
	static uint64_t last_ns, quiet;
	uint64_t now = kvd_now_ns();
	char line[512];
	va_list ap;

	if (last_ns && now - last_ns < 1000000000u) {
		quiet++;
		return;
	}
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	if (quiet)
		kvd_log(LOG_NOTICE, "%s (and %llu refusals not logged)", line, (unsigned long long)quiet);
	else
		kvd_log(LOG_NOTICE, "%s", line);
	last_ns = now;
	quiet = 0;
}

/* ---- control-plane CPU per uid ----------------------------------------- */

static void ctl_poll(struct kvd_server *s, struct client *c, uint32_t events)
{
	struct epoll_event ev = { .events = events, .data.ptr = &c->ev_ctl };

	/* Fails only for a descriptor already gone, which reap_dead handles. */
	epoll_ctl(s->epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

int kvd_client_admit(struct kvd_server *s, struct client *c)
{
	struct kvd_fair *f = c->fair;

	if (!f || kvd_fair_refill(&s->fair, f, kvd_now_ns()))
		return 1;
	if (!c->ctl_paused) {
		ctl_poll(s, c, 0);
		c->ctl_paused = 1;
		s->ctl_paused++;
		f->ctl_paused++;
		kvd_log_refusal("uid %u: control requests past limits.control_cpu_per_uid "
				"(%u%% of a core): its connections wait", f->uid,
				s->fair.ctl_pct);
	}
	return 0;
}

/* Paused connections whose uid's budget refilled are polled again (their
 * queued requests are still in the socket, level-triggered). */
void kvd_client_resume(struct kvd_server *s)
{
	uint64_t now = kvd_now_ns();

	for (struct client *c = s->clients; c && s->ctl_paused; c = c->next) {
		if (!c->ctl_paused || c->dead || !kvd_fair_refill(&s->fair, c->fair, now))
			continue;
		ctl_poll(s, c, EPOLLIN);
		c->ctl_paused = 0;
		s->ctl_paused--;
	}
}
