/* Admin requests: the server-wide views and acts of the control plane
 * (kvctl; docs/PROTOCOL.md, "Admin requests"), answered on the loop thread
 * under the state lock like the session's own requests (kvd/control.c),
 * which hands them here.
 *
 * A privileged caller (c->admin: root, kvd's own uid, [server] admin_group)
 * sees every uid; anyone else only its own uid, every tenant of it.  What a
 * caller may not see does not exist for it: the same -ENOENT as a missing
 * id, an empty page for a uid it may not list.  Listings page in ascending
 * id order, at most KVD_CTL_LIST_MAX rows a reply.  Clients are a bounded
 * table, one pass; a SeqList page looks at a bounded part of the sequences
 * (SEQ_LIST_VISIT), as many as there may be.
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/ctl.h"
#include "engine/err.h"
#include "engine/log.h"
#include "admin.h"
#include "server_int.h"
#include "kvd/store/share.h"
#include "kvd/store/tier.h"

static int reply(struct client *c, Kvd__Response *r)
{
	return kvd_ctl_send(c->fd, &r->base, NULL, 0);
}

struct uid_rows {
	const struct kvd_fair *fairs;
	Kvd__UidUsage *row;
	Kvd__UidUsage **ptr;
	size_t n, cap;
	uint32_t only;                  /* UINT32_MAX: every uid */
	uint32_t seen;                  /* rows that passed `only`, kept or not */
};

static void uid_row(void *arg, uint32_t uid, const struct kvd_limits_usage *u)
{
	struct uid_rows *ur = arg;
	Kvd__UidUsage *m;

	if (ur->only != UINT32_MAX && uid != ur->only)
		return;
	ur->seen++;
	if (ur->n == ur->cap)
		return;
	m = &ur->row[ur->n];
	kvd__uid_usage__init(m);
	m->uid = uid;
	m->connections = (uint32_t)u->n[KVD_RES_CONNECTIONS];
	m->sequences = (uint32_t)u->n[KVD_RES_SEQUENCES];
	m->profiles = (uint32_t)u->n[KVD_RES_PROFILES];
	m->bytes = u->n[KVD_RES_MEMORY];
	m->spill_bytes = u->n[KVD_RES_SPILL];
	m->shm_bytes = u->n[KVD_RES_SHM];
	for (const struct kvd_fair *f = ur->fairs; f; f = f->next)
		if (f->uid == uid)
			m->exec_ns = f->busy_ns, m->control_ns = f->ctl_ns,
			m->control_paused = f->ctl_paused, m->accepts = f->accepts,
			m->conn_refused = f->conn_refused;
	ur->ptr[ur->n++] = m;
}

/* ServerStats.share: the caller's namespace, or every one for an admin. */
struct share_rows {
	uint32_t only;                  /* UINT32_MAX: every namespace */
	Kvd__ShareUsage *row, **ptr;
	size_t n, cap;
};

static void share_row(void *arg, const struct kvd_share_usage *u)
{
	struct share_rows *r = arg;

	if (r->only != UINT32_MAX && u->ns != r->only)
		return;
	if (r->n == r->cap) {
		size_t cap = r->cap ? 2 * r->cap : 8;
		Kvd__ShareUsage *row = realloc(r->row, cap * sizeof *row);
		Kvd__ShareUsage **ptr;

		if (!row)
			return;         /* a shorter listing, not a failed request */
		r->row = row;
		for (size_t i = 0; i < r->n; i++)
			r->ptr[i] = &r->row[i];
		if (!(ptr = realloc(r->ptr, cap * sizeof *ptr)))
			return;
		r->ptr = ptr;
		r->cap = cap;
	}
	Kvd__ShareUsage *m = &r->row[r->n];

	kvd__share_usage__init(m);
	m->ns = u->ns;
	m->published = u->published;
	m->published_tokens = u->published_tokens;
	m->hit_tokens = u->hit_tokens;
	m->miss_tokens = u->miss_tokens;
	m->shared_bytes = u->shared_bytes;
	m->saved_bytes = u->saved_bytes;
	r->ptr[r->n] = m;
	r->n++;
}

static int do_server_stats(struct kvd_server *s, struct client *c, uint64_t id)
{
	Kvd__ServerStats m = KVD__SERVER_STATS__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	struct kvd_store_stats ss;
	/* Tenants never see each other: root, kvd's own uid and [server]
	 * admin_group see every uid, anyone else only their own. */
	struct uid_rows ur = {
		.fairs = s->fair.list,
		.cap = kvd_limits_uids(s->limits),
		.only = c->admin ? UINT32_MAX : c->uid,
	};
	int rc;

	ur.row = calloc(ur.cap ? ur.cap : 1, sizeof *ur.row);
	ur.ptr = calloc(ur.cap ? ur.cap : 1, sizeof *ur.ptr);
	if (!ur.row || !ur.ptr) {
		free(ur.row);
		free(ur.ptr);
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	}
	kvd_limits_each(s->limits, uid_row, &ur);
	m.n_uids = ur.n;
	m.uids = ur.ptr;
	m.refused = s->refused;
	struct share_rows sr = { .only = c->admin ? UINT32_MAX : c->ns };

	if (s->share)
		kvd_share_each(s->share, share_row, &sr);
	m.n_share = sr.n;
	m.share = sr.ptr;

	kvd_store_stats(s->store, &ss);
	m.clients = s->nclients;
	m.sequences = ss.sequences;
	m.profiles = ss.profiles;
	m.bytes = ss.bytes;
	m.requests = s->requests;
	m.errors = s->errors;
	m.disconnects = s->disconnects;
	for (const struct client *o = s->clients; o; o = o->next) {
		m.mapped_bytes += o->map_size;
		m.slots_in_use += o->hello && !o->control ? o->r.geo.nslots : 0;
	}
	{
		struct kvd_tier_stats ts;

		kvd_tier_stats(s->tier, &ts);
		m.mem_limit = ts.limit;
		m.used_bytes = ts.used;
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
	rc = reply(c, &r);
	free(ur.row);
	free(ur.ptr);
	free(sr.row);
	free(sr.ptr);
	return rc;
}

static int may_see(const struct client *c, uint32_t uid)
{
	return c->admin || c->uid == uid;
}

/* "1000:chat" -> "chat". */
static char *tenant_part(const char *t)
{
	const char *p = strchr(t, ':');

	return (char *)(p ? p + 1 : t);
}

static int by_client_id(const void *a, const void *b)
{
	uint64_t x = (*(const struct client *const *)a)->id, y = (*(const struct client *const *)b)->id;

	return x < y ? -1 : x > y;
}

static int do_clients(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__ClientsReq *m)
{
	uint32_t lim = kvd_admin_page(m->limit), total = 0, n = 0;
	struct client **sel = calloc(s->nclients + 1, sizeof *sel);
	Kvd__ClientInfo *row = calloc(lim, sizeof *row);
	Kvd__ClientInfo **ptr = calloc(lim, sizeof *ptr);
	Kvd__ClientList cl = KVD__CLIENT_LIST__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	int rc;

	if (!sel || !row || !ptr) {
		free(sel);
		free(row);
		free(ptr);
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	}
	for (struct client *x = s->clients; x; x = x->next) {
		if (x->dead || !may_see(c, x->uid))
			continue;
		total++;
		if (x->id > m->after)
			sel[n++] = x;
	}
	qsort(sel, n, sizeof *sel, by_client_id);
	cl.next = n > lim ? sel[lim - 1]->id : 0;
	n = n > lim ? lim : n;
	for (uint32_t i = 0; i < n; i++) {
		const struct client *x = sel[i];
		Kvd__ClientInfo *ci = &row[i];

		kvd__client_info__init(ci);
		ci->client_id = x->id;
		ci->uid = x->uid;
		ci->pid = (uint32_t)x->pid;
		ci->tenant = tenant_part(x->tenant);
		ci->name = (char *)x->name;
		ci->control = x->control;
		ci->hello = x->hello;
		ci->poll = x->poll;
		if (x->hello && !x->control) {
			ci->slots = x->r.geo.nslots;
			ci->slot_size = x->r.geo.slot_size;
		}
		ci->shm_bytes = x->shm_bytes;
		ci->profiles = x->nprof;
		/* A sequence being freed has no owner any more. */
		ci->sequences = kvd_store_owner_count(s->store, x->id);
		ptr[i] = ci;
	}
	cl.n_clients = n;
	cl.clients = ptr;
	cl.total = total;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_CLIENT_LIST;
	r.client_list = &cl;
	rc = reply(c, &r);
	free(sel);
	free(row);
	free(ptr);
	return rc;
}

static void seq_info(struct kvd_server *s, struct kvd_seqn *q, Kvd__SeqInfo *m)
{
	int durable;

	kvd__seq_info__init(m);
	m->seq = kvd_store_seq_id(q);
	m->uid = kvd_store_seq_uid(q);
	m->tenant = tenant_part(kvd_store_seq_tenant(q));
	m->owner = kvd_store_seq_owner(q);
	m->profile_id = kvd_store_seq_profile(q)->id;
	m->profile = (char *)kvd_store_seq_profile(q)->name;
	kvd_store_seq_stats(q, &m->tokens, &m->segments);
	m->bytes = kvd_store_seq_bytes(q);
	m->state = kvd_store_seq_state(q);
	kvd_tier_seq_info(s->tier, q, &durable, &m->disk_bytes);
	m->durable = durable;
}

/* A page of SeqList looks at about this many sequences, whatever the table
 * holds (its walk is under the state lock); a page may then hold fewer rows
 * than asked, none even, with `next` to go on from. */
#define SEQ_LIST_VISIT 4096u

struct seq_page {
	const struct client *c;
	const Kvd__SeqListReq *m;
	struct kvd_seqn **sel;
	uint32_t n, lim, total;
};

static int seq_visible(const struct seq_page *p, struct kvd_seqn *q)
{
	uint32_t uid = kvd_store_seq_uid(q);

	return kvd_store_seq_tenant(q)[0] && !kvd_store_seq_hidden(q) && may_see(p->c, uid) &&
	       (!p->m->filter_uid || uid == p->m->uid);
}

static int take_seq(void *arg, struct kvd_seqn *q)
{
	struct seq_page *p = arg;

	if (seq_visible(p, q))
		p->sel[p->n++] = q;
	return p->n == p->lim;
}

static void count_seq(void *arg, struct kvd_seqn *q)
{
	struct seq_page *p = arg;

	p->total += seq_visible(p, q);
}

static int do_seq_list(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__SeqListReq *m)
{
	uint32_t lim = kvd_admin_page(m->limit);
	struct seq_page p = { .c = c, .m = m, .lim = lim };
	Kvd__SeqList sl = KVD__SEQ_LIST__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	struct kvd_store_stats st;
	Kvd__SeqInfo *row;
	Kvd__SeqInfo **ptr;
	int rc;

	p.sel = calloc(lim, sizeof *p.sel);
	row = calloc(lim, sizeof *row);
	ptr = calloc(lim, sizeof *ptr);
	if (!p.sel || !row || !ptr) {
		free(p.sel);
		free(row);
		free(ptr);
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	}
	sl.next = kvd_store_each_after(s->store, m->after, SEQ_LIST_VISIT, take_seq, &p);
	/* Counted only while a count costs no more than a page. */
	kvd_store_stats(s->store, &st);
	if (st.sequences <= SEQ_LIST_VISIT)
		kvd_store_each(s->store, count_seq, &p);
	for (uint32_t i = 0; i < p.n; i++) {
		seq_info(s, p.sel[i], &row[i]);
		ptr[i] = &row[i];
	}
	sl.n_seqs = p.n;
	sl.seqs = ptr;
	sl.total = p.total;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SEQ_LIST;
	r.seq_list = &sl;
	rc = reply(c, &r);
	free(p.sel);
	free(row);
	free(ptr);
	return rc;
}

static int do_seq_admin(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__SeqAdmin *m)
{
	struct kvd_seqn *q = kvd_store_seq_any(s->store, m->seq);
	char msg[160] = "";
	int rc;

	/* Another uid's sequence, to an unprivileged caller, is one that does
	 * not exist: same code, same words. */
	if (!q || !may_see(c, kvd_store_seq_uid(q)))
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no sequence %llu",
					  (unsigned long long)m->seq);
	switch (m->op) {
	case KVD__SEQ_ADMIN_OP__SEQ_ADMIN_SHOW: {
		Kvd__SeqInfo si;
		Kvd__Response r = KVD__RESPONSE__INIT;

		seq_info(s, q, &si);
		r.id = id;
		r.body_case = KVD__RESPONSE__BODY_SEQ_INFO;
		r.seq_info = &si;
		return reply(c, &r);
	}
	case KVD__SEQ_ADMIN_OP__SEQ_ADMIN_EVICT:
		rc = kvd_tier_evict(s->tier, q, msg, sizeof msg);
		if (rc)
			return kvd_ctl_send_error(c->fd, id, rc, "%s", msg[0] ? msg : kvd_strerror(rc));
		kvd_log(LOG_INFO, "client %llu (uid %u, pid %d): evicted sequence %llu of uid %u",
			(unsigned long long)c->id, (unsigned)c->uid, (int)c->pid,
			(unsigned long long)kvd_store_seq_id(q), (unsigned)kvd_store_seq_uid(q));
		return kvd_ctl_send_ok(c->fd, id);
	default:
		kvd_log(LOG_INFO, "client %llu (uid %u, pid %d): freed sequence %llu of uid %u (owner client %llu)",
			(unsigned long long)c->id, (unsigned)c->uid, (int)c->pid,
			(unsigned long long)kvd_store_seq_id(q), (unsigned)kvd_store_seq_uid(q),
			(unsigned long long)kvd_store_seq_owner(q));
		kvd_tier_free(s->tier, q);
		return kvd_ctl_send_ok(c->fd, id);
	}
}

/* SharesReq: the published snapshots, paged by their ids as SeqList. */
struct share_pick {
	const struct client *c;
	uint64_t after;
	struct kvd_share_info *sel;     /* a max-heap by seq of the cap smallest past after */
	uint32_t n, cap, total;
};

static void share_swap(struct kvd_share_info *a, struct kvd_share_info *b)
{
	struct kvd_share_info t = *a;

	*a = *b;
	*b = t;
}

static void pick_share(void *arg, const struct kvd_share_info *x)
{
	struct share_pick *p = arg;
	uint32_t i;

	if (!may_see(p->c, x->uid))
		return;
	p->total++;
	if (x->seq <= p->after)
		return;
	if (p->n < p->cap) {
		p->sel[i = p->n++] = *x;
		for (; i && p->sel[(i - 1) / 2].seq < p->sel[i].seq; i = (i - 1) / 2)
			share_swap(&p->sel[i], &p->sel[(i - 1) / 2]);
		return;
	}
	if (x->seq >= p->sel[0].seq)
		return;
	p->sel[0] = *x;
	for (i = 0;;) {
		uint32_t l = 2 * i + 1, r = l + 1, m = i;

		if (l < p->n && p->sel[l].seq > p->sel[m].seq)
			m = l;
		if (r < p->n && p->sel[r].seq > p->sel[m].seq)
			m = r;
		if (m == i)
			break;
		share_swap(&p->sel[i], &p->sel[m]);
		i = m;
	}
}

static int by_share_seq(const void *a, const void *b)
{
	uint64_t x = ((const struct kvd_share_info *)a)->seq;
	uint64_t y = ((const struct kvd_share_info *)b)->seq;

	return x < y ? -1 : x > y;
}

static int do_shares(struct kvd_server *s, struct client *c, uint64_t id, const Kvd__SharesReq *m)
{
	uint32_t lim = kvd_admin_page(m->limit);
	struct share_pick p = { .c = c, .after = m->after, .cap = lim + 1 };
	Kvd__ShareList sl = KVD__SHARE_LIST__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	Kvd__ShareInfo *row = calloc(lim, sizeof *row);
	Kvd__ShareInfo **ptr = calloc(lim, sizeof *ptr);
	int rc;

	p.sel = calloc(p.cap, sizeof *p.sel);
	if (!p.sel || !row || !ptr) {
		free(p.sel);
		free(row);
		free(ptr);
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	}
	if (s->share)
		kvd_share_list(s->share, pick_share, &p);
	qsort(p.sel, p.n, sizeof *p.sel, by_share_seq);
	sl.next = p.n > lim ? p.sel[lim - 1].seq : 0;
	p.n = p.n > lim ? lim : p.n;
	for (uint32_t i = 0; i < p.n; i++) {
		const struct kvd_share_info *x = &p.sel[i];
		Kvd__ShareInfo *si = &row[i];

		kvd__share_info__init(si);
		si->key.data = (uint8_t *)x->key;
		si->key.len = sizeof x->key;
		si->seq = x->seq;
		si->uid = x->uid;
		si->ns = x->ns;
		si->profile_id = x->profile_id;
		si->tokens = x->tokens;
		si->bytes = x->bytes;
		si->freeable_bytes = x->freeable;
		si->attaches = x->attaches;
		si->idle_ms = x->idle_ns / 1000000;
		si->state = x->state;
		ptr[i] = si;
	}
	sl.n_shares = p.n;
	sl.shares = ptr;
	sl.total = p.total;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_SHARE_LIST;
	r.share_list = &sl;
	rc = reply(c, &r);
	free(p.sel);
	free(row);
	free(ptr);
	return rc;
}

/* ShareDrop: a cache entry goes; sequences attached from it keep theirs. */
static int do_share_drop(struct kvd_server *s, struct client *c, uint64_t id,
			 const Kvd__ShareDrop *m)
{
	char hex[2 * KVD_CTL_CONTENT_KEY + 1];
	unsigned n = 0;
	int rc;

	if (!c->admin)
		return kvd_ctl_send_error(c->fd, id, -EPERM,
					  "share drop: uid %u may not drop published prefixes (root, "
					  "kvd's own uid and [server] admin_group may)", (unsigned)c->uid);
	for (int i = 0; i < KVD_CTL_CONTENT_KEY; i++)
		snprintf(hex + 2 * i, 3, "%02x", m->key.data[i]);
	rc = s->share ? kvd_share_drop_key(s->share, m->key.data, &n) : 0;
	if (rc)
		return kvd_ctl_send_error(c->fd, id, rc, "prefix %s is in use: try again", hex);
	if (!n)
		return kvd_ctl_send_error(c->fd, id, -ENOENT, "no prefix published under %s", hex);
	kvd_log(LOG_INFO, "client %llu (uid %u, pid %d): dropped %u published prefix(es) under %s",
		(unsigned long long)c->id, (unsigned)c->uid, (int)c->pid, n, hex);
	return kvd_ctl_send_ok(c->fd, id);
}

static_assert(KVD_RES_N <= KVD_CTL_LIMIT_ROWS, "LimitsReply rows");

static int do_limits(struct kvd_server *s, struct client *c, uint64_t id)
{
	const struct kvd_limits_cfg *cfg = kvd_limits_cfg(s->limits);
	struct kvd_limits_usage tot;
	Kvd__LimitRow rows[KVD_RES_N], *rp[KVD_RES_N];
	Kvd__LimitsReply lr = KVD__LIMITS_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	struct uid_rows ur = {
		.fairs = s->fair.list,
		.cap = KVD_CTL_LIST_MAX,
		.only = c->admin ? UINT32_MAX : c->uid,
	};
	int rc;

	ur.row = calloc(ur.cap, sizeof *ur.row);
	ur.ptr = calloc(ur.cap, sizeof *ur.ptr);
	if (!ur.row || !ur.ptr) {
		free(ur.row);
		free(ur.ptr);
		return kvd_ctl_send_error(c->fd, id, -ENOMEM, "out of memory");
	}
	kvd_limits_total(s->limits, &tot);
	for (int i = 0; i < KVD_RES_N; i++) {
		kvd__limit_row__init(&rows[i]);
		rows[i].key = (char *)kvd_limits_key((enum kvd_res)i, 0);
		rows[i].cap = cfg->cap[i];
		rows[i].per_uid = cfg->per_uid[i];
		rows[i].used = tot.n[i];
		rp[i] = &rows[i];
	}
	kvd_limits_each(s->limits, uid_row, &ur);
	lr.n_rows = KVD_RES_N;
	lr.rows = rp;
	lr.n_uids = ur.n;
	lr.uids = ur.ptr;
	lr.uids_total = ur.seen;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_LIMITS;
	r.limits = &lr;
	rc = reply(c, &r);
	free(ur.row);
	free(ur.ptr);
	return rc;
}

/* The SIGTERM path (kvd_server_run): the loop ends after this batch of
 * events, the executor answers what clients queued (at most 30 s), every
 * client is released, kvd exits 0.  Ok goes out first. */
static int do_drain(struct kvd_server *s, struct client *c, uint64_t id)
{
	int rc;

	if (!c->admin)
		return kvd_ctl_send_error(c->fd, id, -EPERM,
					  "drain: uid %u may not stop kvd (root, kvd's own uid and "
					  "[server] admin_group may)", (unsigned)c->uid);
	kvd_log(LOG_INFO, "drain requested by client %llu (uid %u, pid %d): draining and stopping",
		(unsigned long long)c->id, (unsigned)c->uid, (int)c->pid);
	rc = kvd_ctl_send_ok(c->fd, id);
	s->stopping = 1;
	return rc;
}

/* MetricsReq: the HTTP endpoint's text (kvd/metrics.h), from a snapshot
 * taken now (we hold the lock); uid-labelled series of the caller's uid
 * only unless it is an admin, as in ServerStats. */
static int do_metrics(struct kvd_server *s, struct client *c, uint64_t id)
{
	Kvd__MetricsReply mr = KVD__METRICS_REPLY__INIT;
	Kvd__Response r = KVD__RESPONSE__INIT;
	size_t len;
	char *text;
	int rc;

	kvd_metrics_collect(s->metrics, s);
	rc = kvd_metrics_render(s->metrics, c->admin ? UINT32_MAX : c->uid, 0, &text, &len);
	if (rc)
		return kvd_ctl_send_error(c->fd, id, rc, "metrics: %s", kvd_strerror(rc));
	mr.text = text;
	r.id = id;
	r.body_case = KVD__RESPONSE__BODY_METRICS;
	r.metrics = &mr;
	rc = reply(c, &r);
	free(text);
	/* Too big for one datagram (thousands of uids): say so, keep the client. */
	if (rc == -EMSGSIZE)
		rc = kvd_ctl_send_error(c->fd, id, -EMSGSIZE, "metrics text of %zu bytes does not fit "
					"a datagram: scrape the HTTP endpoint", len);
	return rc;
}

int kvd_admin_request(struct kvd_server *s, struct client *c, const Kvd__Request *rq)
{
	uint64_t id = rq->id;

	switch (rq->body_case) {
	case KVD__REQUEST__BODY_SERVER_STATS:
		return do_server_stats(s, c, id);
	case KVD__REQUEST__BODY_CLIENTS:
		return do_clients(s, c, id, rq->clients);
	case KVD__REQUEST__BODY_SEQ_LIST:
		return do_seq_list(s, c, id, rq->seq_list);
	case KVD__REQUEST__BODY_SEQ_ADMIN:
		return do_seq_admin(s, c, id, rq->seq_admin);
	case KVD__REQUEST__BODY_LIMITS:
		return do_limits(s, c, id);
	case KVD__REQUEST__BODY_DRAIN:
		return do_drain(s, c, id);
	case KVD__REQUEST__BODY_SHARES:
		return do_shares(s, c, id, rq->shares);
	case KVD__REQUEST__BODY_SHARE_DROP:
		return do_share_drop(s, c, id, rq->share_drop);
	case KVD__REQUEST__BODY_METRICS:
		return do_metrics(s, c, id);
	default:
		return kvd_ctl_send_error(c->fd, id, -KVD_EPROTO, "unknown request");
	}
}
