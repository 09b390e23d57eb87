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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "config.h"
#include "ctl.h"
#include "err.h"
#include "kvd.pb-c.h"
#include "log.h"
#include "pool.h"
#include "server.h"
#include "shm.h"
#include "numa_nodes.h"
#include "store.h"
#include "tier.h"
#include "wire.h"

#define BURST       32          /* ring entries per client per round: fairness */
#define MAX_CLIENTS 1024

/* What an epoll event's data points at. */
enum { EV_LISTEN = 1, EV_SIGNAL, EV_TIMER, EV_CTL, EV_KICK, EV_TIER };
struct ev_tag {
	int kind;
	struct client *c;
};

struct client {
	uint64_t id;
	int fd, efd, memfd;
	pid_t pid;
	uid_t uid;
	char tenant[KVD_NAME_MAX + 16];         /* "<uid>:<tenant>" */
	char name[KVD_NAME_MAX + 1];
	int hello, poll, dead;
	int parked;                     /* its next entry waits for a restore or for room */
	struct shm_region r;
	void *map;
	size_t map_size;
	struct client *next;
	struct ev_tag ev_ctl, ev_kick;
};

struct kvd_server {
	const struct kvd_config *cfg;
	int lfd, epfd, sfd, tfd;
	/* One pool per NUMA node whose CPUs we may use (one in all on a
	 * one-node machine); a sequence is sealed and attended on its node's. */
	struct kvd_numa numa;
	unsigned npools;
	struct kvd_pool *pools[KVD_STORE_NODES];
	struct kvd_attn_scratch *scrs[KVD_STORE_NODES];
	struct kvd_store *store;
	struct kvd_tier *tier;
	struct client *clients;
	uint32_t nclients;
	uint64_t next_client;
	uint64_t requests, errors, disconnects;
	int stopping;
	uint64_t watchdog_usec;
	void *rxbuf;
	float *qbuf, *obuf, *lbuf;
	uint16_t *cbuf;
	struct ev_tag ev_listen, ev_signal, ev_timer, ev_tier;
};

/* ---- signals ----------------------------------------------------------- */

/* A handler that only records the signal and pokes an eventfd the loop
 * polls (the self-pipe trick).  signalfd would do, but sanitizers intercept
 * signal delivery and never hand a blocked signal to a signalfd. */
static int sig_efd = -1;
static volatile sig_atomic_t sig_term, sig_hup;

static void on_signal(int sig)
{
	uint64_t one = 1;
	int e = errno;

	if (sig == SIGHUP)
		sig_hup = 1;
	else
		sig_term = sig;
	if (write(sig_efd, &one, sizeof one) < 0) {
		/* the counter is full: a wake-up is pending anyway */
	}
	errno = e;
}

/* ---- clients ----------------------------------------------------------- */

static void client_drop(struct kvd_server *s, struct client *c, const char *why)
{
	struct client **pp = &s->clients;
	unsigned nseq;

	while (*pp && *pp != c)
		pp = &(*pp)->next;
	if (*pp)
		*pp = c->next;
	s->nclients--;
	nseq = kvd_tier_free_owner(s->tier, c->id);
	kvd_log(LOG_INFO, "client %llu (%s, pid %d) gone: %s; released %u sequence(s), %zu bytes of shared memory",
		(unsigned long long)c->id, c->name[0] ? c->name : "?", (int)c->pid, why, nseq,
		c->map_size);
	if (c->map)
		munmap(c->map, c->map_size);
	if (c->memfd >= 0)
		close(c->memfd);
	/* The client holds its own copy of the eventfd, so closing ours would
	 * leave the registration alive and its next kick pointing at freed
	 * memory: remove both fds from the set explicitly. */
	if (c->efd >= 0) {
		epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->efd, NULL);
		close(c->efd);
	}
	epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
	close(c->fd);
	free(c);
}

/* A protocol violation: this client only. */
static void client_kick(struct kvd_server *s, struct client *c, const char *why)
{
	s->disconnects++;
	kvd_log(LOG_WARNING, "client %llu: %s: disconnecting", (unsigned long long)c->id, why);
	c->dead = 1;
}

static int ep_add(struct kvd_server *s, int fd, void *tag)
{
	struct epoll_event ev = { .events = EPOLLIN, .data.ptr = tag };

	return epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &ev) ? -errno : 0;
}

static void accept_clients(struct kvd_server *s)
{
	for (;;) {
		int fd = accept4(s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		struct ucred cred;
		socklen_t len = sizeof cred;
		struct client *c;

		if (fd < 0) {
			if (errno != EAGAIN && errno != EINTR)
				kvd_log(LOG_WARNING, "accept: %s", strerror(errno));
			return;
		}
		if (s->stopping || s->nclients >= MAX_CLIENTS ||
		    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) || !(c = calloc(1, sizeof *c))) {
			kvd_log(LOG_WARNING, "refusing a connection (%s)",
				s->stopping ? "shutting down" : "no room");
			close(fd);
			continue;
		}
		c->id = ++s->next_client;
		c->fd = fd;
		c->efd = c->memfd = -1;
		c->pid = cred.pid;
		c->uid = cred.uid;
		c->ev_ctl.kind = EV_CTL;
		c->ev_ctl.c = c;
		c->ev_kick.kind = EV_KICK;
		c->ev_kick.c = c;
		if (ep_add(s, fd, &c->ev_ctl)) {
			close(fd);
			free(c);
			continue;
		}
		c->next = s->clients;
		s->clients = c;
		s->nclients++;
		kvd_log(LOG_DEBUG, "client %llu connected: pid %d uid %d", (unsigned long long)c->id,
			(int)cred.pid, (int)cred.uid);
	}
}

/* ---- control plane ----------------------------------------------------- */

static int reply(struct client *c, Kvd__Response *r, const int *fds, int nfds)
{
	return kvd_ctl_send(c->fd, &r->base, fds, nfds);
}

static int do_hello(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__Hello *h)
{
	const struct kvd_config *cfg = s->cfg;
	struct shm_params p = {
		.entry_size = KVD_RING_ENTRY,
		.sq_entries = cfg->sq_entries,
		.cq_entries = cfg->sq_entries,
		.nslots = h->slots ? h->slots : cfg->slots,
		.slot_size = h->slot_size ? h->slot_size : cfg->slot_size,
		.flags = h->poll ? SHM_F_POLL : 0,
	};
	size_t size = shm_region_size(&p);
	int rc;

	if (c->hello)
		return kvd_ctl_send_error(c->fd, id, -KVD_EPROTO, "hello already done");
	struct kvd_ctl_err err;

	if (kvd_ctl_check_arena(p.nslots, p.slot_size, &err))
		return kvd_ctl_send_error(c->fd, id, err.code, "%s", err.msg);
	if (!size)
		return kvd_ctl_send_error(c->fd, id, -EINVAL, "slots %u x %llu bytes not possible",
					  p.nslots, (unsigned long long)p.slot_size);
	rc = shm_memfd_create("kvd-client", size, &c->map);
	if (rc < 0)
		return kvd_ctl_send_error(c->fd, id, rc, "shared memory: %s", kvd_strerror(rc));
	c->memfd = rc;
	c->map_size = size;
	rc = shm_region_create(&c->r, c->map, &p);
	if (!rc) {
		c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
		rc = c->efd < 0 ? -errno : ep_add(s, c->efd, &c->ev_kick);
	}
	if (rc)
		return kvd_ctl_send_error(c->fd, id, rc, "attach: %s", kvd_strerror(rc));
	snprintf(c->tenant, sizeof c->tenant, "%u:%s", (unsigned)c->uid, h->tenant);
	snprintf(c->name, sizeof c->name, "%s", h->client_name);
	c->poll = h->poll;
	c->hello = 1;

	Kvd__HelloReply hr = KVD__HELLO_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	int fds[2] = { c->memfd, c->efd };

	hr.version = KVD__VERSION__VERSION_CURRENT;
	hr.client_id = c->id;
	hr.region_size = size;
	hr.pid = (uint32_t)getpid();
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_HELLO;
	r.hello = &hr;
	kvd_log(LOG_INFO, "client %llu attached: %s, tenant %s, pid %d, %u slots x %llu bytes%s",
		(unsigned long long)c->id, c->name, c->tenant, (int)c->pid, p.nslots,
		(unsigned long long)p.slot_size, c->poll ? ", polling" : "");
	return reply(c, &r, fds, 2);
}

static void profile_to_msg(const struct kvd_profile *p, Kvd__Profile *m, uint32_t *dense)
{
	uint32_t nd = 0;

	m->name = (char *)p->name;
	m->layers = p->layers;
	m->q_heads = p->g.q_heads;
	m->kv_heads = p->g.kv_heads;
	m->head_dim = p->g.d;
	m->k_bits = p->g.K;
	m->tables = p->g.L;
	m->min_collisions = p->g.c;
	m->sink_tokens = p->sink;
	m->window_tokens = p->window;
	for (uint32_t l = 0; l < p->layers; l++)
		if (p->dense[l])
			dense[nd++] = l;
	m->n_dense_layers = nd;
	m->dense_layers = dense;
	m->seed = p->seed;
	m->segment_tokens = p->seg_tokens;
	m->seal_tokens = p->seal_tokens;
}

static int send_profile(struct client *c, uint64_t id, const struct kvd_profile *p)
{
	Kvd__ProfileReply pr = KVD__PROFILE_REPLY__INIT;
	Kvd__Profile pm = KVD__PROFILE__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	uint32_t *dense = malloc((p->layers + 1) * sizeof *dense);
	int rc;

	if (!dense)
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	profile_to_msg(p, &pm, dense);
	pr.profile_id = p->id;
	pr.profile = &pm;
	/* W is float32 little-endian on the wire; x86-64 and arm64 are LE.
	 * Too big for one datagram, it stays home: the client makes the same
	 * numbers from the seed (kvd_ctl_profile_w). */
	size_t wlen = (size_t)p->g.d * p->g.K * p->g.L * sizeof(float);

	if (wlen <= KVD_CTL_W_INLINE_MAX) {
		pr.w.data = (uint8_t *)p->W;
		pr.w.len = wlen;
	}
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_PROFILE;
	r.profile = &pr;
	rc = reply(c, &r, NULL, 0);
	free(dense);
	return rc;
}

static int do_profile_create(struct kvd_server *s, struct client *c, uint64_t id,
			     const Kvd__Profile *m)
{
	struct kvd_profile want = { 0 };
	const struct kvd_profile *p;
	uint8_t *dense = calloc(m->layers, 1);
	int rc;

	if (!dense)
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	rc = kvd_ctl_profile_to_geom(m, &want.g);
	snprintf(want.name, sizeof want.name, "%s", m->name);
	want.layers = m->layers;
	want.sink = m->sink_tokens;
	want.window = m->window_tokens;
	want.seed = m->seed;
	want.seg_tokens = m->segment_tokens ? m->segment_tokens : KVD_CTL_SEG_DEFAULT;
	want.seal_tokens = m->seal_tokens ? m->seal_tokens :
			   (KVD_CTL_SEAL_DEFAULT < want.seg_tokens ? KVD_CTL_SEAL_DEFAULT : want.seg_tokens);
	for (size_t i = 0; i < m->n_dense_layers; i++)
		dense[m->dense_layers[i]] = 1;
	want.dense = dense;
	if (!rc)
		rc = kvd_store_profile(s->store, &want, &p);
	free(dense);
	if (rc == -EEXIST)
		return kvd_ctl_send_error(c->fd, id, rc, "profile '%s' exists with other fields", m->name);
	if (rc)
		return kvd_ctl_send_error(c->fd, id, rc, "profile: %s", kvd_strerror(rc));
	return send_profile(c, id, p);
}

static int do_seq_create(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__SeqCreate *m)
{
	const struct kvd_profile *p = kvd_store_profile_by_id(s->store, m->profile_id);
	struct kvd_seqn *q;
	int rc;

	if (!p)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no profile %u", m->profile_id);
	if (m->content_key.len || m->parent)
		return kvd_ctl_send_error(c->fd, id, -EOPNOTSUPP,
					  "content keys and forks are not supported yet");
	rc = kvd_store_seq_create(s->store, p, c->tenant, c->id, &q);
	if (rc)
		return kvd_ctl_send_error(c->fd, id, rc, "sequence: %s", kvd_strerror(rc));

	Kvd__SeqReply sr = KVD__SEQ_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;

	sr.seq = q->id;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SEQ;
	r.seq = &sr;
	return reply(c, &r, NULL, 0);
}

static struct kvd_seqn *own_seq(struct kvd_server *s, struct client *c, uint64_t seq)
{
	struct kvd_seqn *q = kvd_store_seq_get(s->store, seq, c->tenant);

	return q && q->owner == c->id ? q : NULL;
}

static int do_seq_stats(struct kvd_server *s, struct client *c, uint64_t id, uint64_t seq)
{
	struct kvd_seqn *q = kvd_store_seq_get(s->store, seq, c->tenant);
	Kvd__SeqStats st = KVD__SEQ_STATS__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	uint64_t tokens;
	uint32_t segs;

	if (!q)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu", (unsigned long long)seq);
	kvd_store_seq_stats(q, &tokens, &segs);
	st.seq = q->id;
	st.profile_id = q->p->id;
	st.tokens = tokens;
	st.segments = segs;
	st.bytes = q->bytes;
	st.state = q->state;
	st.ready_layers = q->state == KVD_SEQ_RESTORING ? q->ready :
			  q->state == KVD_SEQ_RAM || q->state == KVD_SEQ_SPILLING ? q->p->layers : 0;
	{
		int durable;

		kvd_tier_seq_info(s->tier, q, &durable, &st.disk_bytes);
		st.durable = durable;
	}
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SEQ_STATS;
	r.seq_stats = &st;
	return reply(c, &r, NULL, 0);
}

void kvd_server_stats(const struct kvd_server *s, struct kvd_server_stats *st)
{
	struct kvd_store_stats ss;

	kvd_store_stats(s->store, &ss);
	memset(st, 0, sizeof *st);
	st->clients = s->nclients;
	st->sequences = ss.sequences;
	st->profiles = ss.profiles;
	st->bytes = ss.bytes;
	st->requests = s->requests;
	st->errors = s->errors;
	st->disconnects = s->disconnects;
	for (const struct client *c = s->clients; c; c = c->next) {
		st->mapped_bytes += c->map_size;
		st->slots_in_use += c->hello ? c->r.geo.nslots : 0;
	}
}

static int do_seq_open(struct kvd_server *s, struct client *c, uint64_t id, uint64_t seq)
{
	struct kvd_seqn *q = kvd_store_seq_get(s->store, seq, c->tenant);
	Kvd__SeqReply sr = KVD__SEQ_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	uint32_t segs;

	if (!q)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu",
					  (unsigned long long)seq);
	if (q->owner && q->owner != c->id)
		return kvd_ctl_send_error(c->fd, id, -EBUSY, "sequence %llu belongs to another client",
					  (unsigned long long)seq);
	q->owner = c->id;
	sr.seq = q->id;
	sr.profile_id = q->p->id;
	kvd_store_seq_stats(q, &sr.tokens, &segs);
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SEQ;
	r.seq = &sr;
	return reply(c, &r, NULL, 0);
}

static int do_seq_evict(struct kvd_server *s, struct client *c, uint64_t id, uint64_t seq)
{
	struct kvd_seqn *q = own_seq(s, c, seq);
	char msg[160] = "";
	int rc;

	if (!q)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu of yours",
					  (unsigned long long)seq);
	rc = kvd_tier_evict(s->tier, q, msg, sizeof msg);
	return rc ? kvd_ctl_send_error(c->fd, id, rc, "%s", msg[0] ? msg : kvd_strerror(rc))
		  : kvd_ctl_send_ok(c->fd, id);
}

static int do_server_stats(struct kvd_server *s, struct client *c, uint64_t id)
{
	Kvd__ServerStats m = KVD__SERVER_STATS__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	struct kvd_server_stats st;

	kvd_server_stats(s, &st);
	m.clients = st.clients;
	m.sequences = st.sequences;
	m.profiles = st.profiles;
	m.bytes = st.bytes;
	m.requests = st.requests;
	m.errors = st.errors;
	m.disconnects = st.disconnects;
	m.slots_in_use = st.slots_in_use;
	m.mapped_bytes = st.mapped_bytes;
	{
		struct kvd_tier_stats ts;

		kvd_tier_stats(s->tier, &ts);
		m.mem_limit = ts.limit;
		m.mem_high = ts.high;
		m.mem_low = ts.low;
		m.reserved_bytes = ts.reserved;
		m.on_disk = ts.on_disk;
		m.disk_bytes = ts.disk_bytes;
		m.spills = ts.spills;
		m.restores = ts.restores;
		m.drops = ts.drops;
		m.spill_errors = ts.spill_errors;
		m.lost = ts.lost;
		m.spill_bytes = ts.spill_bytes;
		m.restore_bytes = ts.restore_bytes;
	}
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SERVER_STATS;
	r.server_stats = &m;
	return reply(c, &r, NULL, 0);
}

static void handle_request(struct kvd_server *s, struct client *c, const Kvd__Request *rq)
{
	uint64_t id = rq->id;
	int rc;

	if (!c->hello && rq->body_case != KVD__REQUEST__BODY_HELLO) {
		rc = kvd_ctl_send_error(c->fd, id, -KVD_EPROTO, "say hello first");
	} else {
		switch (rq->body_case) {
		case KVD__REQUEST__BODY_HELLO:
			rc = do_hello(s, c, id, rq->hello);
			break;
		case KVD__REQUEST__BODY_PROFILE_CREATE:
			rc = do_profile_create(s, c, id, rq->profile_create->profile);
			break;
		case KVD__REQUEST__BODY_PROFILE_OPEN: {
			const struct kvd_profile *p = kvd_store_profile_by_name(s->store, rq->profile_open->name);

			rc = p ? send_profile(c, id, p)
			       : kvd_ctl_send_error(c->fd, id, -ENOENT, "no profile '%s'", rq->profile_open->name);
			break;
		}
		case KVD__REQUEST__BODY_SEQ_CREATE:
			rc = do_seq_create(s, c, id, rq->seq_create);
			break;
		case KVD__REQUEST__BODY_SEQ_FREE: {
			struct kvd_seqn *q = own_seq(s, c, rq->seq_free->seq);

			if (q)
				kvd_tier_free(s->tier, q);
			rc = q ? kvd_ctl_send_ok(c->fd, id)
			       : kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu of yours",
						    (unsigned long long)rq->seq_free->seq);
			break;
		}
		case KVD__REQUEST__BODY_SEQ_STATS:
			rc = do_seq_stats(s, c, id, rq->seq_stats->seq);
			break;
		case KVD__REQUEST__BODY_SERVER_STATS:
			rc = do_server_stats(s, c, id);
			break;
		case KVD__REQUEST__BODY_SEQ_OPEN:
			rc = do_seq_open(s, c, id, rq->seq_open->seq);
			break;
		case KVD__REQUEST__BODY_SEQ_EVICT:
			rc = do_seq_evict(s, c, id, rq->seq_evict->seq);
			break;
		default:
			rc = kvd_ctl_send_error(c->fd, id, -KVD_EPROTO, "unknown request");
			break;
		}
	}
	if (rc)
		client_kick(s, c, "cannot reply on the control socket");
}

static void control_event(struct kvd_server *s, struct client *c)
{
	for (;;) {
		int fds[4], nfds = 4;
		int n = kvd_ctl_recv(c->fd, s->rxbuf, KVD_CTL_REQ_MAX, fds, &nfds);
		struct kvd_ctl_err err;
		Kvd__Request *rq;

		for (int i = 0; i < nfds; i++)
			close(fds[i]);          /* clients have no business sending fds */
		if (n == -EAGAIN || n == -EINTR)
			return;
		if (n == 0) {
			c->dead = 1;            /* orderly close */
			return;
		}
		if (n < 0) {
			client_kick(s, c, n == -EMSGSIZE ? "oversized control message" : "control socket error");
			return;
		}
		rq = kvd_ctl_decode_request(s->rxbuf, (size_t)n, &err);
		if (!rq) {
			/* A malformed request is answered, not fatal (id 0 when it
			 * did not even unpack). */
			s->errors++;
			if (kvd_ctl_send_error(c->fd, err.id, err.code, "%s", err.msg))
				client_kick(s, c, "cannot reply on the control socket");
			if (c->dead)
				return;
			continue;
		}
		handle_request(s, c, rq);
		kvd_ctl_free_request(rq);
		if (c->dead)
			return;
	}
}

/* ---- data plane -------------------------------------------------------- */

/* Fills the completion reserved for this request and publishes it. */
static void complete(struct kvd_server *s, struct client *c, struct kvd_cqe *e,
		     uint64_t user_data, int res, const char *msg)
{
	memset(e, 0, sizeof *e);
	e->user_data = user_data;
	e->res = res;
	if (res < 0) {
		const char *m = msg && *msg ? msg : kvd_strerror(res);
		size_t n = strnlen(m, sizeof e->msg - 1);

		/* The CQE's reason is cut to fit; the full one is in our log. */
		memcpy(e->msg, m, n);
		e->msg[n] = 0;
		if (strlen(m) >= sizeof e->msg)
			kvd_log(LOG_DEBUG, "client %llu: %s", (unsigned long long)c->id, m);
		s->errors++;
	}
	shm_ring_commit(&c->r.cq, 1);
	s->requests++;
}

static int do_rows(struct kvd_server *s, struct client *c, const struct kvd_sqe *e, char *msg,
		   size_t msglen)
{
	struct kvd_seqn *q = own_seq(s, c, e->seq);
	const char *base;
	const struct kvd_profile *p;
	uint64_t H, d, off = 0;
	int rc;

	if (!q) {
		snprintf(msg, msglen, "no sequence %llu of yours", (unsigned long long)e->seq);
		return -ENOENT;
	}
	p = q->p;
	if ((rc = kvd_wire_payload(e, p, msg, msglen)))
		return rc;
	/* The layer must be resident, and the rows need room: staging plus
	 * the segment they seal into, about twice the payload. */
	if ((rc = kvd_tier_want(s->tier, q, e->layer, msg, msglen)) ||
	    (rc = kvd_tier_room(s->tier, (uint64_t)e->len * 2, msg, msglen)))
		return rc;
	H = p->g.kv_heads;
	d = p->g.d;
	/* The payload stays in shared memory: its sizes come from the copied,
	 * checked entry, so a client rewriting it only garbles its own rows. */
	base = (const char *)shm_slot(&c->r, e->slot) + e->off;
	const float *mean = NULL;

	if (e->flags & KVD_RF_MEAN) {
		mean = (const float *)base;
		off = KVD_ALIGN64(H * d * 4);
	}
	const uint16_t *k = (const uint16_t *)(base + off);
	const uint16_t *v = (const uint16_t *)(base + off + KVD_ALIGN64(H * e->ntok * d * 2));
	const uint16_t *codes = (const uint16_t *)(base + off + 2 * KVD_ALIGN64(H * e->ntok * d * 2));

	rc = kvd_store_rows(s->store, q, e->layer, e->op == KVD_OP_APPEND, e->flags & KVD_RF_LAST,
			    mean, k, v, codes, e->ntok, msg, msglen);
	kvd_tier_changed(s->tier, q);
	return rc;
}

static int do_attend(struct kvd_server *s, struct client *c, const struct kvd_sqe *e, char *msg,
		     size_t msglen)
{
	const char *in = (const char *)shm_slot(&c->r, e->slot) + e->off;
	char *out = (char *)shm_slot(&c->r, e->slot) + e->out_off;
	const struct kvd_profile *p = NULL;
	int rc, wait = 0;

	/* Pass 1: every sequence exists, agrees on the profile and has this
	 * layer resident.  Restores of all of them start before any waiting,
	 * so a batch waits for the slowest once, not for each in turn. */
	const char *rec = in;

	for (uint32_t i = 0; i < e->nseq; i++) {
		uint64_t seq;
		struct kvd_seqn *q;
		char m[128];

		memcpy(&seq, rec, sizeof seq);
		q = kvd_store_seq_get(s->store, seq, c->tenant);
		if (!q) {
			snprintf(msg, msglen, "batch[%u]: no sequence %llu", i, (unsigned long long)seq);
			return -ENOENT;
		}
		if (!p) {
			p = q->p;
			if ((rc = kvd_wire_payload(e, p, msg, msglen)))
				return rc;
		} else if (q->p != p) {
			snprintf(msg, msglen, "batch[%u]: sequences of different profiles", i);
			return -EINVAL;
		}
		rc = kvd_tier_want(s->tier, q, e->layer, m, sizeof m);
		if (rc == -EINPROGRESS) {
			wait = 1;
		} else if (rc) {
			snprintf(msg, msglen, "batch[%u]: %s", i, m);
			return rc;
		}
		rec += kvd_attend_in_bytes(p->g.q_heads, p->g.d, p->g.L);
	}
	if (wait)
		return -EINPROGRESS;
	for (uint32_t i = 0; i < e->nseq; i++) {
		uint64_t seq;
		struct kvd_seqn *q;

		memcpy(&seq, in, sizeof seq);
		q = kvd_store_seq_get(s->store, seq, c->tenant);
		const struct kvd_layer_state *l = &q->ly[e->layer];

		if (l->mean && !l->sealed) {
			snprintf(msg, msglen, "batch[%u]: layer %u is still being prefilled", i, e->layer);
			return -EBUSY;
		}
		uint32_t Hq = p->g.q_heads, d = p->g.d, L = p->g.L;
		size_t qb = (size_t)Hq * d * sizeof(float), cb = (size_t)Hq * L * sizeof(uint16_t);

		/* Copy the query out: it is read by every worker, and a client
		 * rewriting it mid-flight must not give workers different views. */
		memcpy(s->qbuf, in + 64, qb);
		memcpy(s->cbuf, in + 64 + KVD_ALIGN64(qb), cb);
		struct kvd_layer_view lv = kvd_store_view(q, e->layer);

		rc = kvd_attn_layer(kvd_store_pool(s->store, q), s->scrs[q->node], kvd_kern_get(),
				    &p->g, p->tab, &lv, s->qbuf,
				    s->cbuf, s->obuf, s->lbuf, NULL);
		if (rc) {
			snprintf(msg, msglen, "batch[%u]: %s", i, kvd_strerror(rc));
			return rc;
		}
		memcpy(out, s->obuf, qb);
		memcpy(out + KVD_ALIGN64(qb), s->lbuf, (size_t)Hq * sizeof(float));
		in += kvd_attend_in_bytes(Hq, d, L);
		out += kvd_attend_out_bytes(Hq, d);
	}
	return 0;
}

/* Runs one entry.  Returns 1 when it must wait (a restore, or room being
 * made): nothing was done and no completion was used; the entry stays in
 * the ring and runs again after the tier reports progress. */
static int execute(struct kvd_server *s, struct client *c, const struct kvd_sqe *e,
		   struct kvd_cqe *cqe)
{
	char msg[160] = "";
	int rc = 0;

	kvd_tier_begin(s->tier);
	switch (e->op) {
	case KVD_OP_NOP:
		break;
	case KVD_OP_FREE:
	case KVD_OP_PREFETCH: {
		struct kvd_seqn *q = own_seq(s, c, e->seq);

		if (!q)
			rc = -ENOENT, snprintf(msg, sizeof msg, "no sequence %llu of yours",
					       (unsigned long long)e->seq);
		else if (e->op == KVD_OP_FREE)
			kvd_tier_free(s->tier, q);
		else
			rc = kvd_tier_prefetch(s->tier, q, msg, sizeof msg);
		break;
	}
	case KVD_OP_PREFILL:
	case KVD_OP_APPEND:
		rc = do_rows(s, c, e, msg, sizeof msg);
		break;
	case KVD_OP_ATTEND:
		rc = do_attend(s, c, e, msg, sizeof msg);
		break;
	}
	if (rc == -EINPROGRESS)
		return 1;
	complete(s, c, cqe, e->user_data, rc, msg);
	return 0;
}

/* Up to BURST entries of one client.  Returns how many it took. */
static int process_ring(struct kvd_server *s, struct client *c)
{
	int ready, done = 0;

	if (!c->hello || c->dead || c->parked)
		return 0;
	ready = shm_ring_ready(&c->r.sq);
	if (ready < 0) {
		client_kick(s, c, "submission ring indices corrupted");
		return 0;
	}
	while (done < ready && done < BURST) {
		struct kvd_sqe e;
		struct kvd_cqe *cqe;
		char msg[160];
		int rc;

		/* Back-pressure: no room for the completion, no new work. */
		cqe = shm_ring_reserve(&c->r.cq);
		if (!cqe) {
			if (shm_ring_broken(&c->r.cq))
				client_kick(s, c, "completion ring indices corrupted");
			break;
		}
		rc = kvd_wire_sqe(shm_ring_entry(&c->r.sq, (uint32_t)done), c->r.geo.nslots,
				  c->r.geo.slot_size, &e, msg, sizeof msg);
		if (rc) {
			complete(s, c, cqe, e.user_data, rc, msg);
		} else if (execute(s, c, &e, cqe)) {
			/* It runs again later and reserves its completion then. */
			shm_ring_unreserve(&c->r.cq);
			kvd_log(LOG_DEBUG, "client %llu: entry waits for the spill tier",
				(unsigned long long)c->id);
			c->parked = 1;
			break;
		}
		done++;
	}
	if (done) {
		shm_ring_release(&c->r.sq, (uint32_t)done);
		if (!c->poll)
			shm_ring_wake(&c->r.cq);
	}
	return done;
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

static int poll_rings(struct kvd_server *s)
{
	int work = 0;

	for (struct client *c = s->clients; c; c = c->next)
		work += process_ring(s, c);
	if (work)
		kvd_tier_balance(s->tier);
	return work;
}

/* I/O results: restores progressed or room was made, so every waiting
 * client tries its entry again. */
static void tier_event(struct kvd_server *s)
{
	if (!kvd_tier_poll(s->tier))
		return;
	for (struct client *c = s->clients; c; c = c->next)
		c->parked = 0;
	kvd_tier_balance(s->tier);
}

static void set_sleeping(struct kvd_server *s, int on)
{
	for (struct client *c = s->clients; c; c = c->next)
		if (c->hello && !c->dead)
			shm_ring_set_sleeping(&c->r.sq, on);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
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

static void handle_events(struct kvd_server *s, struct epoll_event *ev, int n)
{
	for (int i = 0; i < n; i++) {
		const struct ev_tag *tag = ev[i].data.ptr;
		struct client *c = tag->c;

		switch (tag->kind) {
		case EV_LISTEN:
			accept_clients(s);
			break;
		case EV_SIGNAL: {
			uint64_t x;

			if (read(s->sfd, &x, sizeof x) < 0 && errno != EAGAIN)
				break;
			check_signals(s);
			break;
		}
		case EV_TIMER: {
			uint64_t x;

			if (read(s->tfd, &x, sizeof x) > 0)
				sd_notify(0, "WATCHDOG=1");
			break;
		}
		case EV_CTL:
			if (!c->dead)
				control_event(s, c);
			break;
		case EV_TIER:
			tier_event(s);
			break;
		case EV_KICK: {
			uint64_t x;

			if (read(c->efd, &x, sizeof x) < 0 && errno != EAGAIN)
				client_kick(s, c, "eventfd error");
			break;
		}
		}
	}
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
	uint64_t idle_since = now_ns();

	sd_notify(0, "READY=1\nSTATUS=serving");
	kvd_log(LOG_INFO, "serving on %s with %u worker(s), kernels %s", s->cfg->socket_path,
		total_workers(s), kvd_kern_get()->name);
	if (s->numa.active)
		kvd_log(LOG_INFO, "NUMA: %u node(s), one pool each; sequences placed by resident bytes",
			s->npools);
	while (!s->stopping) {
		int n = epoll_wait(s->epfd, ev, 64, 0);

		if (n > 0)
			handle_events(s, ev, n);
		reap_dead(s);
		if (poll_rings(s)) {
			idle_since = now_ns();
			continue;
		}
		reap_dead(s);
		if (now_ns() - idle_since < s->cfg->spin_ns)
			continue;
		/* Idle: announce sleep on every SQ, then look once more before
		 * blocking — a client that committed before seeing the flag is
		 * caught by this second look (see shm_ring_set_sleeping). */
		set_sleeping(s, 1);
		if (poll_rings(s) == 0) {
			/* A bounded sleep: a wake-up a second costs nothing
			 * and no lost wake-up can hold kvd longer. */
			n = epoll_wait(s->epfd, ev, 64, 1000);
			if (n > 0)
				handle_events(s, ev, n);
			check_signals(s);
		}
		set_sleeping(s, 0);
		reap_dead(s);
		idle_since = now_ns();
	}
	sd_notify(0, "STOPPING=1\nSTATUS=draining");
	/* Drain: what clients already queued is answered, then everyone goes. */
	while (poll_rings(s))
		;
	kvd_tier_stopping(s->tier);
	while (s->clients)
		client_drop(s, s->clients, "server stopping");
	kvd_log(LOG_INFO, "stopped: %llu requests, %llu errors, %llu disconnects",
		(unsigned long long)s->requests, (unsigned long long)s->errors,
		(unsigned long long)s->disconnects);
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
	sigemptyset(&mask);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigaddset(&mask, SIGHUP);
	pthread_sigmask(SIG_BLOCK, &mask, NULL);
	signal(SIGPIPE, SIG_IGN);
	s->cfg = cfg;
	s->lfd = s->epfd = s->sfd = s->tfd = -1;
	s->ev_listen.kind = EV_LISTEN;
	s->ev_signal.kind = EV_SIGNAL;
	s->ev_timer.kind = EV_TIMER;
	s->rxbuf = malloc(KVD_CTL_REQ_MAX);
	s->qbuf = malloc((size_t)KVD_QHEADS_MAX * KVD_DMAX * sizeof(float));
	s->obuf = malloc((size_t)KVD_QHEADS_MAX * KVD_DMAX * sizeof(float));
	s->lbuf = malloc((size_t)KVD_QHEADS_MAX * sizeof(float));
	s->cbuf = malloc((size_t)KVD_QHEADS_MAX * KVD_LSH_LMAX * sizeof(uint16_t));
	rc = -ENOMEM;
	if (!s->rxbuf || !s->qbuf || !s->obuf || !s->lbuf || !s->cbuf)
		goto fail;
	if ((rc = make_pools(s)))
		goto fail;
	if ((rc = kvd_store_create(s->pools[0], &s->store)))
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
		rc = kvd_tier_load(s->tier);
		if (rc < 0) {
			kvd_log(LOG_ERR, "spill: cannot scan the spill directories: %s", kvd_strerror(rc));
			goto fail;
		}
		if (tc.spill)
			kvd_log(LOG_INFO, "spill: %u director%s%s, %d sequence(s) found on disk",
				tc.io.ndirs, tc.io.ndirs == 1 ? "y" : "ies",
				tc.persist ? ", persistent" : "", rc);
	}

	s->sfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	s->epfd = epoll_create1(EPOLL_CLOEXEC);
	if (s->sfd < 0 || s->epfd < 0) {
		rc = -errno;
		goto fail;
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
	if ((rc = ep_add(s, s->lfd, &s->ev_listen)) || (rc = ep_add(s, s->sfd, &s->ev_signal)))
		goto fail;
	s->ev_tier.kind = EV_TIER;
	if (kvd_tier_fd(s->tier) >= 0 && (rc = ep_add(s, kvd_tier_fd(s->tier), &s->ev_tier)))
		goto fail;
	if (sd_watchdog_enabled(0, &s->watchdog_usec) > 0) {
		struct itimerspec it = { 0 };
		uint64_t half = s->watchdog_usec / 2;

		it.it_interval.tv_sec = (time_t)(half / 1000000);
		it.it_interval.tv_nsec = (long)(half % 1000000) * 1000;
		it.it_value = it.it_interval;
		s->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
		if (s->tfd < 0 || timerfd_settime(s->tfd, 0, &it, NULL) ||
		    (rc = ep_add(s, s->tfd, &s->ev_timer))) {
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
	free(s->qbuf);
	free(s->obuf);
	free(s->lbuf);
	free(s->cbuf);
	free(s);
}
