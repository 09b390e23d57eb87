/* Control-plane requests: the protobuf messages of a client's Unix socket
 * (docs/PROTOCOL.md), decoded by proto/ctl.c and answered on the loop
 * thread under the state lock.  Each is cheap (a lookup, a create, a
 * counter read), so it waits for at most one executor unit and delays the
 * executor by as little.  Here: reading the socket within the uid's budget,
 * and the session's own requests (Hello, profiles, the client's sequences);
 * the server-wide views and acts of kvctl are kvd/admin.c's.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config.h"
#include "proto/ctl.h"
#include "engine/clock.h"
#include "engine/err.h"
#include "engine/log.h"
#include "engine/lsh.h"
#include "admin.h"
#include "clients.h"
#include "server_int.h"
#include "kvd/store/share.h"
#include "kvd/store/tier.h"

static int reply(struct client *c, Kvd__Response *r, const int *fds, int nfds)
{
	return kvd_ctl_send(c->fd, &r->base, fds, nfds);
}

void kvd_control_unmap(struct kvd_server *s, struct client *c)
{
	if (c->map)
		munmap(c->map, c->map_size);
	if (c->memfd >= 0)
		close(c->memfd);
	/* The client holds its own copy of the eventfd, so closing ours would
	 * leave the registration alive: remove it from the set explicitly. */
	if (c->efd >= 0) {
		kvd_exec_unwatch(s, c->efd);
		close(c->efd);
	}
	kvd_limits_uncharge(s->limits, c->uid, KVD_RES_SHM, c->shm_bytes);
	c->map = NULL;
	c->map_size = 0;
	c->shm_bytes = 0;
	c->memfd = c->efd = -1;
}

/* kvctl: no region, no eventfd, no fds; the connection was counted at
 * accept like any other. */
static int do_hello_control(struct client *c, uint64_t id, const Kvd__Hello *h)
{
	Kvd__HelloReply hr = KVD__HELLO_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;

	snprintf(c->tenant, sizeof c->tenant, "%u:%s", (unsigned)c->uid, h->tenant);
	snprintf(c->name, sizeof c->name, "%s", h->client_name);
	c->control = 1;
	c->hello = 1;
	hr.version = KVD__VERSION__VERSION_CURRENT;
	hr.client_id = c->id;
	hr.pid = (uint32_t)getpid();
	hr.control = 1;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_HELLO;
	r.hello = &hr;
	kvd_log(LOG_DEBUG, "client %llu: control connection of uid %u, pid %d (%s)%s",
		(unsigned long long)c->id, (unsigned)c->uid, (int)c->pid, c->name,
		c->admin ? ", privileged" : "");
	return reply(c, &r, NULL, 0);
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
	if (h->control)
		return do_hello_control(c, id, h);
	struct kvd_ctl_err err;

	if (kvd_ctl_check_arena(p.nslots, p.slot_size, &err))
		return kvd_ctl_send_error(c->fd, id, err.code, "%s", err.msg);
	if (!size)
		return kvd_ctl_send_error(c->fd, id, -EINVAL, "slots %u x %llu bytes not possible",
					  p.nslots, (unsigned long long)p.slot_size);
	/* The region is counted against the uid before it exists: kvd writes
	 * outputs into it, so its pages can become kvd's. */
	char msg[160];

	rc = kvd_limits_charge(s->limits, c->uid, KVD_RES_SHM, size, msg, sizeof msg);
	if (rc) {
		kvd_log_refusal("client %llu (uid %u): hello refused: %s", (unsigned long long)c->id,
				(unsigned)c->uid, msg);
		return kvd_ctl_send_error(c->fd, id, rc, "shared memory: %s", msg);
	}
	c->shm_bytes = size;
	rc = shm_memfd_create("kvd-client", size, &c->map);
	if (rc < 0) {
		c->map = NULL;
		kvd_control_unmap(s, c);
		return kvd_ctl_send_error(c->fd, id, rc, "shared memory: %s", kvd_strerror(rc));
	}
	c->memfd = rc;
	c->map_size = size;
	rc = shm_region_create(&c->r, c->map, &p);
	if (!rc) {
		c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
		rc = c->efd < 0 ? -errno : kvd_exec_watch(s, c->efd);
	}
	if (rc) {
		/* Nothing half-made stays behind: a later Hello starts afresh. */
		kvd_control_unmap(s, c);
		return kvd_ctl_send_error(c->fd, id, rc, "attach: %s", kvd_strerror(rc));
	}
	snprintf(c->tenant, sizeof c->tenant, "%u:%s", (unsigned)c->uid, h->tenant);
	snprintf(c->name, sizeof c->name, "%s", h->client_name);
	c->poll = h->poll;
	c->hello = 1;
	/* An executor asleep flagged "sleeping" on the rings it knew; this one
	 * is not flagged, so its first submit would not kick and would wait
	 * for the executor's 1 s timeout.  Wake it: its next sleep flags us. */
	kvd_exec_notify(s);

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

	for (uint32_t l = 0; l < p->layers; l++)
		if (p->dense[l])
			dense[nd++] = l;
	kvd_ctl_profile_put(&p->model, dense, nd, m);
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

/* The connection takes one reference on each profile it created or opened,
 * dropped when it goes (kvd_control_release): a profile lives while a
 * client or a sequence uses it. */
static int hold_profile(struct kvd_server *s, struct client *c, const struct kvd_profile *p)
{
	for (uint32_t i = 0; i < c->nprof; i++)
		if (c->prof[i] == p->id)
			return 0;
	if (c->nprof == CLIENT_PROFILES)
		return -EDQUOT;
	kvd_store_profile_ref(s->store, p);
	c->prof[c->nprof++] = p->id;
	return 0;
}

void kvd_control_release(struct kvd_server *s, struct client *c)
{
	for (uint32_t i = 0; i < c->nprof; i++) {
		const struct kvd_profile *p = kvd_store_profile_get(s->store, c->ns, c->prof[i]);

		if (p)
			kvd_store_profile_unref(s->store, p);
	}
	c->nprof = 0;
}

static int do_profile_open(struct kvd_server *s, struct client *c, uint64_t id, const char *name)
{
	const struct kvd_profile *p = kvd_store_profile_find(s->store, c->ns, name);

	if (!p)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no profile '%s'", name);
	if (hold_profile(s, c, p))
		return kvd_ctl_send_error(c->fd, id, -EDQUOT, "a connection holds at most %d profiles",
					  CLIENT_PROFILES);
	return send_profile(c, id, p);
}

static int do_profile_create(struct kvd_server *s, struct client *c, uint64_t id,
			     const Kvd__Profile *m)
{
	struct kvd_profile want = { 0 };
	Kvd__Profile filled = *m;
	const struct kvd_profile *p;
	uint8_t *dense = calloc(m->layers, 1);
	char msg[160] = "";
	int rc;

	if (!dense)
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	kvd_ctl_profile_defaults(&filled);
	rc = kvd_ctl_profile_get(&filled, &want.model);
	for (size_t i = 0; i < m->n_dense_layers; i++)
		dense[m->dense_layers[i]] = 1;
	want.dense = dense;
	/* W of a new profile is made without the state lock, whatever its
	 * size: up to 16 MiB of Gaussians (130 ms on one core), and a few
	 * hundred KiB pipelined from several connections add up as much.
	 * Counted first, like everything a client makes kvd hold. */
	size_t wbytes = rc ? 0 : (size_t)want.g.d * want.g.K * want.g.L * sizeof(float);
	int wcharged = 0;

	if (!rc && wbytes && !kvd_store_profile_find(s->store, c->ns, want.name)) {
		rc = kvd_limits_charge(s->limits, c->uid, KVD_RES_MEMORY, wbytes, msg, sizeof msg);
		wcharged = !rc;
		if (!rc && !(want.W = malloc(wbytes)))
			rc = -ENOMEM;
		if (!rc) {
			kvd_state_unlock(s);
			kvd_lsh_make_w(want.seed, (int)want.g.d, (int)want.g.K, (int)want.g.L, want.W);
			kvd_state_lock(s);
		}
	}
	if (!rc)
		rc = kvd_store_profile_ns(s->store, c->ns, c->uid, &want, &p, msg, sizeof msg);
	free(dense);
	free(want.W);
	if (wcharged)
		kvd_limits_uncharge(s->limits, c->uid, KVD_RES_MEMORY, wbytes);
	if (rc == -EEXIST)
		return kvd_ctl_send_error(c->fd, id, rc, "profile '%s' exists with other fields", m->name);
	if (rc) {
		if (rc == -EDQUOT || rc == -ENOSPC || rc == -ENOMEM)
			kvd_log_refusal("client %llu (uid %u): profile refused: %s", (unsigned long long)c->id,
					(unsigned)c->uid, msg[0] ? msg : kvd_strerror(rc));
		return kvd_ctl_send_error(c->fd, id, rc, "profile: %s", msg[0] ? msg : kvd_strerror(rc));
	}
	rc = hold_profile(s, c, p);
	kvd_store_profile_unref(s->store, p);   /* the connection's own, if any, stays */
	if (rc)
		return kvd_ctl_send_error(c->fd, id, rc, "a connection holds at most %d profiles",
					  CLIENT_PROFILES);
	return send_profile(c, id, p);
}

static int do_seq_create(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__SeqCreate *m)
{
	const struct kvd_profile *p = kvd_store_profile_get(s->store, c->ns, m->profile_id);
	struct kvd_seqn *q;
	uint64_t attached = 0;
	uint32_t *local = NULL;
	char msg[160] = "";
	int rc;

	if (!p)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no profile %u", m->profile_id);
	if (m->content_key.len)
		return kvd_ctl_send_error(c->fd, id, -EOPNOTSUPP,
					  "SeqCreate.content_key: use attach_keys and SeqPublish");
	if (m->n_attach_keys) {
		/* Copied out of the decoded message into one array (each key was
		 * checked to be KVD_CTL_CONTENT_KEY bytes by kvd_ctl_check). */
		uint8_t *keys = malloc(m->n_attach_keys * KVD_SHARE_KEY);

		if (!keys)
			return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
		for (size_t i = 0; i < m->n_attach_keys; i++)
			memcpy(keys + i * KVD_SHARE_KEY, m->attach_keys[i].data, KVD_SHARE_KEY);
		rc = kvd_share_attach(s->share, c->ns, p, keys, (uint32_t)m->n_attach_keys, c->uid,
				      c->tenant, c->id, &q, &attached, msg, sizeof msg);
		free(keys);
		if (rc == -EAGAIN)
			return kvd_ctl_send_error(c->fd, id, rc, "attach: %s", msg);
	} else if (m->parent) {
		/* A fork: of a sequence of the caller's tenant only; any other
		 * is "no such sequence", whether it exists or not. */
		struct kvd_seqn *par = kvd_store_seq_get(s->store, m->parent, c->tenant);

		if (!par)
			return kvd_ctl_send_error(c->fd, id, -ENOENT, "fork: no sequence %llu",
						  (unsigned long long)m->parent);
		if (kvd_store_seq_profile(par) != p)
			return kvd_ctl_send_error(c->fd, id, -EINVAL,
						  "fork: sequence %llu has profile %u, not %u",
						  (unsigned long long)m->parent,
						  kvd_store_seq_profile(par)->id, m->profile_id);
		rc = kvd_store_seq_fork(s->store, par, c->uid, c->tenant, c->id, &q, msg,
					sizeof msg);
		if (rc)
			return kvd_ctl_send_error(c->fd, id, rc, "fork: %s",
						  msg[0] ? msg : kvd_strerror(rc));
	} else {
		rc = kvd_store_seq_create_uid(s->store, p, c->uid, c->tenant, c->id, &q, msg,
					      sizeof msg);
	}
	if (rc) {
		if (rc == -EDQUOT || rc == -ENOSPC || rc == -ENOMEM)
			kvd_log_refusal("client %llu (uid %u): sequence refused: %s", (unsigned long long)c->id,
					(unsigned)c->uid, msg[0] ? msg : kvd_strerror(rc));
		return kvd_ctl_send_error(c->fd, id, rc, "sequence: %s", msg[0] ? msg : kvd_strerror(rc));
	}

	Kvd__SeqReply sr = KVD__SEQ_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;

	c->owns = 1;
	sr.seq = kvd_store_seq_id(q);
	if (attached) {
		if (!(local = malloc(p->layers * sizeof *local))) {
			kvd_tier_free(s->tier, q);
			return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
		}
		for (uint32_t l = 0; l < p->layers; l++)
			local[l] = kvd_store_local_rows(q, l);
		sr.tokens = attached;
		sr.n_local_rows = p->layers;
		sr.local_rows = local;
	}
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SEQ;
	r.seq = &sr;
	rc = reply(c, &r, NULL, 0);
	free(local);
	return rc;
}

static int do_seq_publish(struct kvd_server *s, struct client *c, uint64_t id,
			  const Kvd__SeqPublish *m)
{
	struct kvd_seqn *q = kvd_client_seq(s, c, m->seq);
	char msg[160] = "";
	int rc;

	if (!q)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu of yours",
					  (unsigned long long)m->seq);
	kvd_tier_begin(s->tier);
	rc = kvd_share_publish(s->share, c->ns, q, m->key.data, m->tokens, msg, sizeof msg);
	if (rc) {
		if (rc == -EDQUOT || rc == -ENOSPC || rc == -ENOMEM)
			kvd_log_refusal("client %llu (uid %u): publish refused: %s",
					(unsigned long long)c->id, (unsigned)c->uid,
					msg[0] ? msg : kvd_strerror(rc));
		return kvd_ctl_send_error(c->fd, id, rc, "publish: %s",
					  msg[0] ? msg : kvd_strerror(rc));
	}
	return kvd_ctl_send_ok(c->fd, id);
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
	st.seq = kvd_store_seq_id(q);
	st.profile_id = kvd_store_seq_profile(q)->id;
	st.tokens = tokens;
	st.segments = segs;
	st.bytes = kvd_store_seq_bytes(q);
	st.state = kvd_store_seq_state(q);
	st.ready_layers = kvd_store_seq_ready_layers(q);
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

static int do_seq_open(struct kvd_server *s, struct client *c, uint64_t id, uint64_t seq)
{
	struct kvd_seqn *q = kvd_store_seq_get(s->store, seq, c->tenant);
	Kvd__SeqReply sr = KVD__SEQ_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	uint32_t segs;
	int rc;

	if (!q)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu",
					  (unsigned long long)seq);
	if ((rc = kvd_store_seq_claim(s->store, q, c->id)))
		return kvd_ctl_send_error(c->fd, id, rc, rc == -EBUSY ?
					  "sequence %llu belongs to another client" :
					  "sequence %llu: out of memory", (unsigned long long)seq);
	c->owns = 1;
	sr.seq = kvd_store_seq_id(q);
	sr.profile_id = kvd_store_seq_profile(q)->id;
	kvd_store_seq_stats(q, &sr.tokens, &segs);
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SEQ;
	r.seq = &sr;
	return reply(c, &r, NULL, 0);
}

static int do_seq_evict(struct kvd_server *s, struct client *c, uint64_t id, uint64_t seq)
{
	struct kvd_seqn *q = kvd_client_seq(s, c, seq);
	char msg[160] = "";
	int rc;

	if (!q)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu of yours",
					  (unsigned long long)seq);
	rc = kvd_tier_evict(s->tier, q, msg, sizeof msg);
	return rc ? kvd_ctl_send_error(c->fd, id, rc, "%s", msg[0] ? msg : kvd_strerror(rc))
		  : kvd_ctl_send_ok(c->fd, id);
}

struct prof_ref {
	const struct kvd_profile *p;
	uint32_t refs;
};

static int by_profile_id(const void *a, const void *b)
{
	uint32_t x = ((const struct prof_ref *)a)->p->id, y = ((const struct prof_ref *)b)->p->id;

	return x < y ? -1 : x > y;
}

struct prof_pick {
	const struct client *c;
	uint32_t after;
	struct prof_ref *sel;
	uint32_t n, cap, total;
};

static void pick_profile(void *arg, const struct kvd_profile *p, uint32_t refs)
{
	struct prof_pick *pp = arg;

	if (!pp->c->admin && p->ns != pp->c->ns && p->uid != pp->c->uid)
		return;
	pp->total++;
	if (p->id > pp->after && pp->n < pp->cap)
		pp->sel[pp->n++] = (struct prof_ref){ p, refs };
}

static int do_profiles(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__ProfilesReq *m)
{
	struct kvd_store_stats st;
	uint32_t lim = kvd_admin_page(m->limit);
	struct prof_pick pp = { .c = c, .after = m->after };
	Kvd__ProfileList pl = KVD__PROFILE_LIST__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	Kvd__ProfileInfo *row = calloc(lim, sizeof *row);
	Kvd__ProfileInfo **ptr = calloc(lim, sizeof *ptr);
	Kvd__Profile *pm = calloc(lim, sizeof *pm);
	uint32_t *dense = malloc((KVD_CTL_LAYERS_MAX + 1) * sizeof *dense);
	int rc;

	kvd_store_stats(s->store, &st);
	pp.cap = st.profiles + 1;
	pp.sel = calloc(pp.cap, sizeof *pp.sel);
	if (!pp.sel || !row || !ptr || !pm || !dense) {
		rc = kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
		goto out;
	}
	kvd_store_profile_each(s->store, pick_profile, &pp);
	qsort(pp.sel, pp.n, sizeof *pp.sel, by_profile_id);
	pl.next = pp.n > lim ? pp.sel[lim - 1].p->id : 0;
	pp.n = pp.n > lim ? lim : pp.n;
	for (uint32_t i = 0; i < pp.n; i++) {
		const struct kvd_profile *p = pp.sel[i].p;
		Kvd__ProfileInfo *pi = &row[i];

		kvd__profile_info__init(pi);
		kvd__profile__init(&pm[i]);
		profile_to_msg(p, &pm[i], dense);
		pi->n_dense = (uint32_t)pm[i].n_dense_layers;
		pm[i].n_dense_layers = 0;       /* the count is enough for a listing */
		pm[i].dense_layers = NULL;
		pi->profile_id = p->id;
		pi->uid = p->uid;
		pi->profile = &pm[i];
		pi->refs = pp.sel[i].refs;
		pi->bytes = kvd_store_profile_bytes(p);
		ptr[i] = pi;
	}
	pl.n_profiles = pp.n;
	pl.profiles = ptr;
	pl.total = pp.total;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_PROFILE_LIST;
	r.profile_list = &pl;
	rc = reply(c, &r, NULL, 0);
out:
	free(pp.sel);
	free(row);
	free(ptr);
	free(pm);
	free(dense);
	return rc;
}

static void handle_request(struct kvd_server *s, struct client *c, const Kvd__Request *rq)
{
	uint64_t id = rq->id;
	int rc;

	kvd_ctl_sent_code = 0;
	if (!c->hello && rq->body_case != KVD__REQUEST__BODY_HELLO) {
		rc = kvd_ctl_send_error(c->fd, id, -KVD_EPROTO, "say hello first");
	} else if (c->control && (rq->body_case == KVD__REQUEST__BODY_PROFILE_CREATE ||
				  rq->body_case == KVD__REQUEST__BODY_PROFILE_OPEN ||
				  rq->body_case == KVD__REQUEST__BODY_SEQ_CREATE ||
				  rq->body_case == KVD__REQUEST__BODY_SEQ_OPEN)) {
		rc = kvd_ctl_send_error(c->fd, id, -EOPNOTSUPP,
					"%s on a control-only connection (no shared memory, no rings)",
					kvd_ctl_request_name(rq->body_case));
	} else {
		switch (rq->body_case) {
		case KVD__REQUEST__BODY_HELLO:
			rc = do_hello(s, c, id, rq->hello);
			break;
		case KVD__REQUEST__BODY_PROFILE_CREATE:
			rc = do_profile_create(s, c, id, rq->profile_create->profile);
			break;
		case KVD__REQUEST__BODY_PROFILE_OPEN:
			rc = do_profile_open(s, c, id, rq->profile_open->name);
			break;
		case KVD__REQUEST__BODY_SEQ_CREATE:
			rc = do_seq_create(s, c, id, rq->seq_create);
			break;
		case KVD__REQUEST__BODY_SEQ_FREE: {
			struct kvd_seqn *q = kvd_client_seq(s, c, rq->seq_free->seq);

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
		case KVD__REQUEST__BODY_SEQ_OPEN:
			rc = do_seq_open(s, c, id, rq->seq_open->seq);
			break;
		case KVD__REQUEST__BODY_SEQ_PUBLISH:
			rc = do_seq_publish(s, c, id, rq->seq_publish);
			break;
		case KVD__REQUEST__BODY_SEQ_EVICT:
			rc = do_seq_evict(s, c, id, rq->seq_evict->seq);
			break;
		case KVD__REQUEST__BODY_PROFILES:
			rc = do_profiles(s, c, id, rq->profiles);
			break;
		/* The views and acts of kvctl, kvd/admin.c. */
		case KVD__REQUEST__BODY_SERVER_STATS:
		case KVD__REQUEST__BODY_CLIENTS:
		case KVD__REQUEST__BODY_SEQ_LIST:
		case KVD__REQUEST__BODY_SEQ_ADMIN:
		case KVD__REQUEST__BODY_LIMITS:
		case KVD__REQUEST__BODY_DRAIN:
		case KVD__REQUEST__BODY_SHARES:
		case KVD__REQUEST__BODY_SHARE_DROP:
		case KVD__REQUEST__BODY_METRICS:
			rc = kvd_admin_request(s, c, rq);
			break;
		default:
			rc = kvd_ctl_send_error(c->fd, id, -KVD_EPROTO, "unknown request");
			break;
		}
	}
	kvd_metrics_control(s->metrics, (unsigned)rq->body_case, kvd_ctl_sent_code);
	/* a free, an evict or a drop may be the room an entry waits for */
	if (kvd_tier_waiting(s->tier))
		kvd_exec_notify(s);
	if (rc)
		kvd_client_kick(s, c, "cannot reply on the control socket");
}

/* A few messages per wake-up: the socket is level-triggered, so the rest
 * comes next turn, after the other clients and the executor had theirs. */
#define CTL_BURST 8

static void control_burst(struct kvd_server *s, struct client *c)
{
	uint64_t t0 = kvd_now_ns(), t1;

	/* Every message is charged to the uid's control budget, from its
	 * receipt to its reply; past the budget the socket waits. */
	for (int burst = 0; burst < CTL_BURST && kvd_client_admit(s, c);
	     burst++, kvd_fair_spent(c->fair, (t1 = kvd_now_ns()) - t0), t0 = t1) {
		int fds[4], nfds = 4, n;
		struct kvd_ctl_err err;
		Kvd__Request *rq;

		/* Bounded in time too: past its hold, the loop lets the
		 * executor run a pass between two requests (not charged). */
		if (burst) {
			kvd_loop_breathe(s);
			t0 = kvd_now_ns();
			if (c->dead)
				return;
		}
		n = kvd_ctl_recv(c->fd, s->rxbuf, KVD_CTL_REQ_MAX, fds, &nfds);

		for (int i = 0; i < nfds; i++)
			close(fds[i]);          /* clients have no business sending fds */
		if (n == -EAGAIN || n == -EINTR)
			return;
		if (n == 0) {
			c->dead = 1;            /* orderly close */
			return;
		}
		if (n < 0) {
			kvd_client_kick(s, c, n == -EMSGSIZE ? "oversized control message" : "control socket error");
			return;
		}
		rq = kvd_ctl_decode_request(s->rxbuf, (size_t)n, &err);
		if (!rq) {
			/* A malformed request is answered, not fatal (id 0 when it
			 * did not even unpack). */
			s->errors++;
			kvd_metrics_control(s->metrics, 0, err.code);
			if (kvd_ctl_send_error(c->fd, err.id, err.code, "%s", err.msg))
				kvd_client_kick(s, c, "cannot reply on the control socket");
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

/* The replies go after the lock does (kvd_ctl_defer): sent under it, one
 * woke its client, which took the loop's CPU, and the lock with it, for up
 * to 25 ms on a 2-core VM while a restore kept the other core.  Only this
 * thread closes a client's fd, so it is still c's when they go. */
void kvd_control_event(struct kvd_server *s, struct client *c)
{
	uint64_t t0;
	int rc;

	kvd_ctl_defer(c->fd);
	control_burst(s, c);
	if (!kvd_ctl_deferred()) {
		(void)kvd_ctl_flush();  /* nothing kept: it only stops deferring */
		return;
	}
	kvd_state_unlock(s);
	t0 = kvd_now_ns();
	rc = kvd_ctl_flush();
	t0 = kvd_now_ns() - t0;
	kvd_state_lock(s);
	kvd_fair_spent(c->fair, t0);
	if (rc)
		kvd_client_kick(s, c, "cannot reply on the control socket");
}

