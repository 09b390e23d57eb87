/* The executor: one thread that runs every client's ring entries in small
 * units, fairly, on the worker pools (see server_int.h for the locking).
 *
 * Units.  An ATTEND entry of n records is n units (one (sequence, layer)
 * each) after a cheap check pass over its copied sequence ids; every other
 * entry is one unit.  A pass picks the ready client whose uid has had the
 * least executor time, and within the uid the client that has had the least
 * (start-time fair queueing at both levels: what was idle rejoins at the
 * current clock, so sleeping earns no credit), and runs its next unit; when
 * that is an ATTEND record, the next records of up to PASS_UNITS other ready
 * ATTEND clients whose uids are not ahead join it in the same pool job
 * (continuous batching), and while the job has fewer than FILL_TASKS tasks a
 * worker, further records of the same clients fill it; each answer is
 * bit-identical to running it alone.  The pass's time is charged to its
 * clients and uids in proportion to their tasks.  Long work inside a unit
 * (copying a prefill chunk into staging, sealing a segment) runs as sliced
 * pool jobs on the pool's bulk threads, and other clients' records run
 * beside each slice (slice_wait) and between slices (slice_yield).  So a
 * client's big batch or prefill delays another client's single ATTEND by
 * about one unit, not by the batch, the seal or a slice.
 *
 * Shared memory.  An entry is copied out and checked once (kvd_wire_sqe) and
 * its SQ slot given back at once; an ATTEND's sequence ids are copied out
 * once, before any is looked up; a record's query and codes are copied out
 * once, right before its unit runs.  Nothing is read twice, so a client
 * rewriting its slot mid-batch garbles only its own answers.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "engine/clock.h"
#include "engine/err.h"
#include "engine/invariant.h"
#include "engine/kern.h"
#include "engine/log.h"
#include "engine/pool.h"
#include "clients.h"
#include "server_int.h"
#include "config.h"
#include "kvd/store/tier.h"

#define PASS_UNITS 16           /* ATTEND records in one pool job */
#define YIELD_ROUNDS 4          /* batches of others' records between two slices, at most */
#define DRAIN_SECONDS 30        /* at stop: answer what is queued for at most this long */

/* A client joins the pass of the client whose turn it is only while its
 * uid is at most this much executor time ahead of that client's uid: a uid
 * with many connections gets no more than a uid with one. */
#define JOIN_SLACK_NS 1000000u

struct unit {
	struct client *c;
	uint32_t rec;
	uint32_t tasks;
	struct kvd_layer_view lv;
};

struct kvd_exec_buf {
	size_t qb, cb, ob, lb;          /* bytes per unit of each buffer */
	float *q, *o, *lse;
	uint16_t *qc;
	struct unit u[PASS_UNITS];
	struct kvd_attn_req req[PASS_UNITS];
	struct client *top[PASS_UNITS];
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#endif
}

/* ---- fair share ---------------------------------------------------------- */

static void charge(struct client *c, uint64_t ns)
{
	c->vtime += ns;
	c->fair->vtime += ns;
	c->fair->busy_ns += ns;
}

/* Whether (uid a, client a) goes before (uid b, client b): the uid with
 * less time first, then the client with less. */
static int before(uint64_t sa, uint64_t ca, uint64_t sb, uint64_t cb)
{
	return sa < sb || (sa == sb && ca < cb);
}

static int ahead(const struct client *a, const struct client *b)
{
	return before(a->fair->vtime, a->vtime, b->fair->vtime, b->vtime);
}

/* ---- completions -------------------------------------------------------- */

/* Fills c's reserved completion, publishes it and ends the job. */
static void finish(struct kvd_server *s, struct client *c, int res, const char *msg)
{
	struct job *j = &c->job;
	struct kvd_cqe *e = j->cqe;

	memset(e, 0, sizeof *e);
	e->user_data = j->e.user_data;
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
	if (!c->poll)
		shm_ring_wake(&c->r.cq);
	s->requests++;
	kvd_metrics_ring(s->metrics, j->e.op, res);
	j->active = 0;
	j->cqe = NULL;
	kvd_tier_unwait(s->tier, c->id);
}

/* ---- readiness ---------------------------------------------------------- */

/* Whether c has a unit to run now: a job that is not parked, or an entry in
 * its SQ and room in its CQ for the answer. */
static int client_ready(struct kvd_server *s, struct client *c)
{
	int n;

	if (!c->hello || c->control || c->dead)
		return 0;
	if (c->job.active)
		return !c->parked;
	n = shm_ring_ready(&c->r.sq);
	if (n < 0) {
		kvd_client_kick(s, c, "submission ring indices corrupted");
		return 0;
	}
	if (n == 0)
		return 0;
	if (!shm_ring_reserve(&c->r.cq)) {
		if (shm_ring_broken(&c->r.cq))
			kvd_client_kick(s, c, "completion ring indices corrupted");
		return 0;       /* back-pressure: no room for the answer, no new work */
	}
	shm_ring_unreserve(&c->r.cq);
	return 1;
}

/* Takes c's next entry: reserve its completion, copy and check the entry,
 * give the SQ slot back.  Entries that need no unit complete here. */
static void job_start(struct kvd_server *s, struct client *c)
{
	struct job *j = &c->job;
	char msg[160] = "";
	int rc;

	j->cqe = shm_ring_reserve(&c->r.cq);
	if (!j->cqe)
		return;         /* client_ready() said there was room: only a broken ring */
	rc = kvd_wire_sqe(shm_ring_entry(&c->r.sq, 0), c->r.geo.nslots, c->r.geo.slot_size, &j->e,
			  msg, sizeof msg);
	/* The copy is what counts from here on: the entry goes back now. */
	shm_ring_release(&c->r.sq, 1);
	j->active = 1;
	j->next = 0;
	j->checked = 0;
	j->pid = 0;
	if (rc)
		finish(s, c, rc, msg);
	else if (j->e.op == KVD_OP_NOP)
		finish(s, c, 0, NULL);
}

/* ---- whole-entry units -------------------------------------------------- */

static const char *slot_base(const struct client *c, const struct kvd_sqe *e)
{
	return (const char *)shm_slot(&c->r, e->slot) + e->off;
}

/* The client's own sequence e->seq, with e's sizes checked against its
 * profile: 0, or -ENOENT / kvd_wire_payload's refusal. */
static int own_seq(struct kvd_server *s, struct client *c, const struct kvd_sqe *e,
		   struct kvd_seqn **q, const struct kvd_profile **p, char *msg, size_t msglen)
{
	if (!(*q = kvd_client_seq(s, c, e->seq))) {
		snprintf(msg, msglen, "no sequence %llu of yours", (unsigned long long)e->seq);
		return -ENOENT;
	}
	*p = kvd_store_seq_profile(*q);
	return kvd_wire_payload(e, *p, msg, msglen);
}

static int rows_unit(struct kvd_server *s, struct client *c, const struct kvd_sqe *e,
		     struct kvd_seqn *q, const struct kvd_profile *p, char *msg, size_t msglen)
{
	const char *base;
	struct kvd_rows_layout lay;
	int rc;

	/* The layer must be resident, and the rows need room: staging plus
	 * the segment they seal into, about twice the payload. */
	if ((rc = kvd_tier_want(s->tier, q, e->layer, msg, msglen)) ||
	    (rc = kvd_tier_room(s->tier, (uint64_t)e->len * 2, msg, msglen)))
		return rc;
	lay = kvd_rows_layout(p->g.kv_heads, p->g.d, p->g.L, e->ntok, e->flags & KVD_RF_MEAN);
	/* The store copies the rows into its staging exactly once; their sizes
	 * come from the checked copy of the entry, so a client rewriting them
	 * garbles only its own rows. */
	base = slot_base(c, e);
	const float *mean = e->flags & KVD_RF_MEAN ? (const float *)base : NULL;
	const uint16_t *k = (const uint16_t *)(base + lay.k);
	const uint16_t *v = (const uint16_t *)(base + lay.v);
	const uint16_t *codes = (const uint16_t *)(base + lay.codes);

	rc = kvd_store_rows(s->store, q, e->layer, e->op == KVD_OP_APPEND, e->flags & KVD_RF_LAST,
			    mean, k, v, codes, e->ntok, msg, msglen);
	kvd_tier_changed(s->tier, q);
	return rc;
}


/* LOCAL: the client's own rows of a layer, put for a publish or got after an
 * attach.  A put copies the rows out of the slot once (a client rewriting
 * them garbles only its own rows); a get writes into the client's slot. */
static int local_unit(struct kvd_server *s, struct client *c, const struct kvd_sqe *e,
		      struct kvd_seqn *q, const struct kvd_profile *p, char *msg, size_t msglen)
{
	struct kvd_local_layout lay;
	int rc;

	/* The rows live with the sequence's RAM (a file holds them while it is
	 * on disk): resident first, every layer. */
	if ((rc = kvd_tier_want(s->tier, q, UINT32_MAX, msg, msglen)))
		return rc;
	lay = kvd_local_layout(p->g.kv_heads, p->g.d, e->ntok, e->flags & KVD_LF_MEAN);
	if (!(e->flags & KVD_LF_GET)) {
		const char *base = slot_base(c, e);
		size_t need = kvd_store_local_need(q, e->layer, e->row0, e->ntok);

		/* Room first, as for rows: the budget may write others out
		 * (-EINPROGRESS parks the entry until it has). */
		if (need && (rc = kvd_tier_room_uid(s->tier, kvd_store_seq_uid(q), need, msg, msglen)))
			return rc;
		return kvd_store_local_put(s->store, q, e->layer, e->row0,
					   (const uint16_t *)(base + lay.k),
					   (const uint16_t *)(base + lay.v), e->ntok, msg, msglen);
	}
	char *out = (char *)shm_slot(&c->r, e->slot) + e->out_off;

	if (e->flags & KVD_LF_MEAN) {
		const float *mean;

		if (!(mean = kvd_store_layer_mean(q, e->layer))) {
			snprintf(msg, msglen, "layer %u has no mean yet", e->layer);
			return -ENODATA;
		}
		memcpy(out, mean, (size_t)p->g.kv_heads * p->g.d * sizeof(float));
	}
	if (kvd_store_local_get(q, e->layer, e->row0, e->ntok, (uint16_t *)(out + lay.k),
				(uint16_t *)(out + lay.v))) {
		snprintf(msg, msglen, "rows [%u, +%u) of layer %u: kvd holds %u", e->row0, e->ntok,
			 e->layer, kvd_store_local_rows(q, e->layer));
		return -ERANGE;
	}
	return 0;
}

typedef int (*seq_unit_fn)(struct kvd_server *s, struct client *c, const struct kvd_sqe *e,
			   struct kvd_seqn *q, const struct kvd_profile *p, char *msg,
			   size_t msglen);

/* A unit that changes the client's sequence e->seq pins it from start to
 * end: others' records run between its slices (slice_yield) and may need
 * room, and the sequence in the middle of this change must not be what
 * they write out. */
static int pinned(struct kvd_server *s, struct client *c, const struct kvd_sqe *e,
		  seq_unit_fn fn, char *msg, size_t msglen)
{
	struct kvd_seqn *q;
	const struct kvd_profile *p;
	int rc;

	if ((rc = own_seq(s, c, e, &q, &p, msg, msglen)))
		return rc;
	kvd_store_seq_pin(q);
	rc = fn(s, c, e, q, p, msg, msglen);
	kvd_store_seq_unpin(q);
	return rc;
}

/* ATTEND pass 1: copy every record's sequence id out once, then check that
 * each exists for this tenant, all share one profile, and every one has the
 * layer resident.  Restores of all of them start before any waiting, so a
 * batch waits for the slowest once.  Runs again (on the copied ids) after a
 * park. */
static int attend_check(struct kvd_server *s, struct client *c, char *msg, size_t msglen)
{
	struct job *j = &c->job;
	const struct kvd_sqe *e = &j->e;
	int rc, wait = 0;

	/* kvd_wire_sqe() held the copied nseq to 1..KVD_WIRE_MAX_NSEQ, all
	 * that ids[] has room for: more and the copies below overrun it. */
	if (NEVER(e->nseq == 0 || e->nseq > KVD_WIRE_MAX_NSEQ)) {
		snprintf(msg, msglen, "batch of %u sequences", e->nseq);
		return -ERANGE;
	}
	if (!j->pid) {
		const char *in = slot_base(c, e);
		const struct kvd_profile *p;
		struct kvd_seqn *q0;
		uint64_t stride;

		memcpy(&j->ids[0], in, sizeof j->ids[0]);
		q0 = kvd_store_seq_get(s->store, j->ids[0], c->tenant);
		if (!q0) {
			snprintf(msg, msglen, "batch[0]: no sequence %llu",
				 (unsigned long long)j->ids[0]);
			return -ENOENT;
		}
		p = kvd_store_seq_profile(q0);
		/* The payload's length is checked against this profile, so every
		 * record header below lies inside the slot. */
		if ((rc = kvd_wire_payload(e, p, msg, msglen)))
			return rc;
		stride = kvd_attend_layout(p->g.q_heads, p->g.d, p->g.L).in;
		for (uint32_t i = 1; i < e->nseq; i++)
			memcpy(&j->ids[i], in + i * stride, sizeof j->ids[i]);
		j->pid = p->id;
	}
	for (uint32_t i = 0; i < e->nseq; i++) {
		struct kvd_seqn *q = kvd_store_seq_get(s->store, j->ids[i], c->tenant);
		char m[128];

		if (!q) {
			snprintf(msg, msglen, "batch[%u]: no sequence %llu", i,
				 (unsigned long long)j->ids[i]);
			return -ENOENT;
		}
		if (kvd_store_seq_profile(q)->id != j->pid) {
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
	}
	if (wait)
		return -EINPROGRESS;
	j->checked = 1;
	return 0;
}

/* Runs c's job as one unit (everything but ATTEND records).  A job that must
 * wait (a restore, room being made) parks with its completion still
 * reserved and runs again after the tier reports progress. */
static void run_whole(struct kvd_server *s, struct client *c)
{
	struct job *j = &c->job;
	const struct kvd_sqe *e = &j->e;
	char msg[160] = "";
	int rc = 0;

	kvd_tier_begin(s->tier);
	kvd_tier_part(s->tier, c->id, c->uid);
	switch (e->op) {
	case KVD_OP_FREE:
	case KVD_OP_PREFETCH: {
		struct kvd_seqn *q = kvd_client_seq(s, c, e->seq);

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
		rc = pinned(s, c, e, rows_unit, msg, sizeof msg);
		break;
	case KVD_OP_LOCAL:
		rc = pinned(s, c, e, local_unit, msg, sizeof msg);
		break;
	case KVD_OP_ATTEND:
		rc = attend_check(s, c, msg, sizeof msg);
		if (!rc)
			return;         /* records next */
		break;
	}
	if (rc == -EINPROGRESS) {
		kvd_log(LOG_DEBUG, "client %llu: entry waits for the spill tier",
			(unsigned long long)c->id);
		c->parked = 1;
		return;
	}
	finish(s, c, rc, msg);
}

/* ---- ATTEND records ----------------------------------------------------- */

/* Looks up and checks record i of c (j->next, or one after it when the
 * pass takes several of c's records) and copies its query out into unit
 * slot k.  0 and the unit filled; 1 when c must wait (parked) or the record
 * belongs in a later pass (another node's pool, or the estimator state of
 * a record already in this pass); or the job was finished with an error. */
static int unit_prepare(struct kvd_server *s, struct client *c, uint32_t i, unsigned k,
			struct kvd_pool **pool, unsigned *node)
{
	struct kvd_exec_buf *xb = s->xb;
	struct job *j = &c->job;
	const struct kvd_sqe *e = &j->e;
	struct kvd_store_attend_view v;
	char msg[160], m[128];
	int rc;

	/* A job is in records only while one is left (the last one finishes
	 * it): ids[] past nseq is a stale id, or past the array. */
	if (NEVER(i >= e->nseq)) {
		finish(s, c, -EINVAL, "batch: no record left");
		return -1;
	}
	kvd_tier_part(s->tier, c->id, c->uid);
	rc = kvd_store_attend_view(s->store, j->ids[i], c->tenant, j->pid, e->layer, *pool, &v, m,
				   sizeof m);
	if (rc == 1)
		return 1;       /* another node's pool: a later pass */
	if (rc == -EINPROGRESS) {
		c->parked = 1;  /* the tier restores the layer */
		return 1;
	}
	if (rc) {
		snprintf(msg, sizeof msg, "batch[%u]: %s", i, m);
		finish(s, c, rc, msg);
		return -1;
	}

	const struct kvd_profile *p = v.p;
	size_t qb = (size_t)p->g.q_heads * p->g.d * sizeof(float);
	size_t cb = (size_t)p->g.q_heads * p->g.L * sizeof(uint16_t);
	const struct kvd_attend_layout lay = kvd_attend_layout(p->g.q_heads, p->g.d, p->g.L);
	const char *rec = slot_base(c, e) + i * lay.in;
	struct unit *u = &xb->u[k];
	struct kvd_attn_req *r = &xb->req[k];

	/* xb holds PASS_UNITS units of the largest geometry a profile may
	 * have (kvd_geom_check() at creation): a bigger one would spill into
	 * the next unit's query or answer. */
	if (NEVER(qb > xb->qb || cb > xb->cb || p->g.q_heads * sizeof(float) > xb->lb)) {
		finish(s, c, -EINVAL, "profile geometry beyond the executor's buffers");
		return -1;
	}
	/* The engine rewrites the state after the step: two records of one
	 * pass on the same (sequence, layer) must not share it.  Of two
	 * connections of a tenant, the later one goes without; a record of
	 * the same batch waits for the next pass, where it sees the state the
	 * first one left, as it would have run alone.  Decided before the
	 * record is read: a record put off is read then, and only then. */
	uint32_t *heavy = v.heavy;

	for (unsigned o = 0; heavy && o < k; o++) {
		if (xb->req[o].heavy != heavy)
			continue;
		if (xb->u[o].c == c)
			return 1;
		heavy = NULL;
	}
	/* The one read of this record's query and codes. */
	memcpy((char *)xb->q + k * xb->qb, rec + lay.q_off, qb);
	memcpy((char *)xb->qc + k * xb->cb, rec + lay.codes_off, cb);
	u->c = c;
	u->rec = i;
	u->lv = v.lv;
	u->tasks = (u->lv.nseg + (u->lv.tail_n ? 1 : 0)) * p->g.kv_heads;
	*r = (struct kvd_attn_req){
		.g = &p->g, .tab = p->tab, .lv = &u->lv,
		.q = (const float *)((char *)xb->q + k * xb->qb),
		.qc = (const uint16_t *)((char *)xb->qc + k * xb->cb),
		.o = (float *)((char *)xb->o + k * xb->ob),
		.lse = (float *)((char *)xb->lse + k * xb->lb),
		.est = p->estimator,
		.tab_lo = p->estimator == KVD_EST_HYBRID_LCV ? &p->tab[1] : NULL,
		/* Taken on the loop (kvd_store_attend_view), not in the pool
		 * job: the store is the loop's.  NULL (magicpig, dense, no room
		 * for it) attends the layer without state. */
		.heavy = heavy,
	};
	*pool = v.pool;
	*node = v.node;
	return 0;
}

/* Adds records of top[0..n) after the one each already has in the pass
 * (round robin, in turn order) while the pass has fewer than FILL_TASKS
 * tasks a worker: one client's batch of sequences becomes one pool job
 * instead of one job, and one barrier, per sequence.  A big pool left most
 * of its workers waiting on the few tasks of one (sequence, layer); a small
 * one already has enough, and a pass no longer than one record keeps a
 * neighbour's wait as short as before.  Returns the units now in the pass. */
#define FILL_TASKS 8u

static unsigned fill(struct kvd_server *s, struct client **top, unsigned n, unsigned k,
		     struct kvd_pool **pool, unsigned *node, uint64_t *tasks)
{
	struct kvd_exec_buf *xb = s->xb;
	uint32_t taken[PASS_UNITS] = { 0 };
	uint64_t cap = (uint64_t)FILL_TASKS * (*pool ? kvd_pool_size(*pool) : 1);
	int more = 1;

	for (unsigned i = 0; i < k; i++)
		for (unsigned c = 0; c < n; c++)
			taken[c] += xb->u[i].c == top[c];
	while (more && k < PASS_UNITS && *tasks < cap) {
		more = 0;
		for (unsigned c = 0; c < n && k < PASS_UNITS && *tasks < cap; c++) {
			struct job *j = &top[c]->job;
			uint32_t i = j->next + taken[c];

			/* taken[c] == 0: the client's first record was not
			 * taken (parked, another pool, finished): none after. */
			if (!taken[c] || !j->active || top[c]->parked || i >= j->e.nseq)
				continue;
			if (unit_prepare(s, top[c], i, k, pool, node) != 0) {
				/* Parked, or finished with an error: the records
				 * already in the pass are dropped with the job. */
				taken[c] = 0;
				continue;
			}
			*tasks += xb->u[k++].tasks;
			taken[c]++;
			more = 1;
		}
	}
	return k;
}

/* One pool job over the next record of each of the n clients in top[]
 * (first the one whose turn it is), and more of theirs while the pool has
 * few tasks (fill).  Charges each its share of the time. */
static void run_records(struct kvd_server *s, struct client **top, unsigned n)
{
	struct kvd_exec_buf *xb = s->xb;
	struct kvd_pool *pool = NULL;
	unsigned node = 0, k = 0;
	uint64_t t0 = kvd_now_ns(), total = 0;

	/* pick() takes at most PASS_UNITS clients and joiners() only drops
	 * some: u[], req[] and the buffers have room for no more. */
	if (NEVER(n > PASS_UNITS))
		n = PASS_UNITS;
	kvd_tier_begin(s->tier);
	for (unsigned i = 0; i < n; i++)
		if (unit_prepare(s, top[i], top[i]->job.next, k, &pool, &node) == 0)
			total += xb->u[k++].tasks;
	if (k)
		k = fill(s, top, n, k, &pool, &node, &total);
	if (k)
		kvd_attn_layers(pool, s->scrs[node], kvd_kern_get(), xb->req, k, NULL);
	uint64_t dt = kvd_now_ns() - t0;

	for (unsigned i = 0; i < k; i++) {
		struct unit *u = &xb->u[i];
		struct client *c = u->c;
		struct job *j = &c->job;
		const struct kvd_attn_req *r = &xb->req[i];

		charge(c, total ? dt * u->tasks / total : dt / k);
		/* Finished already: a later record of the pass failed its
		 * check (fill), or an earlier one failed here.  Its slot is
		 * the client's again: nothing more is written there. */
		if (!j->active)
			continue;
		if (r->rc) {
			char msg[160];

			snprintf(msg, sizeof msg, "batch[%u]: %s", u->rec, kvd_strerror(r->rc));
			finish(s, c, r->rc, msg);
			continue;
		}
		const struct kvd_geom *g = r->g;
		const struct kvd_attend_layout lay = kvd_attend_layout(g->q_heads, g->d, g->L);
		char *out = (char *)shm_slot(&c->r, j->e.slot) + j->e.out_off + u->rec * lay.out;

		memcpy(out, r->o, (size_t)g->q_heads * g->d * sizeof(float));
		memcpy(out + lay.lse_off, r->lse, (size_t)g->q_heads * sizeof(float));
		kvd_metrics_attend(s->metrics, dt);
		if (++j->next == j->e.nseq)
			finish(s, c, 0, NULL);
	}
}

static int in_records(const struct client *c)
{
	return c->job.active && c->job.e.op == KVD_OP_ATTEND && c->job.checked && !c->parked;
}

/* ---- the pass ----------------------------------------------------------- */

/* Up to PASS_UNITS ready clients, the least time (by uid, then client)
 * first. */
static unsigned pick(struct kvd_server *s, struct client **top)
{
	unsigned n = 0;

	for (struct client *c = s->clients; c; c = c->next) {
		int ready = client_ready(s, c);

		if (ready && !c->was_ready) {
			/* Rejoining: no credit for idle time. */
			if (c->vtime < s->vclock)
				c->vtime = s->vclock;
			if (c->fair->vtime < s->fair.uvclock)
				c->fair->vtime = s->fair.uvclock;
		}
		c->was_ready = ready;
		if (!ready)
			continue;
		if (n == PASS_UNITS && !ahead(c, top[n - 1]))
			continue;
		unsigned i = n < PASS_UNITS ? n++ : n - 1;

		while (i > 0 && ahead(c, top[i - 1])) {
			top[i] = top[i - 1];
			i--;
		}
		top[i] = c;
	}
	return n;
}

/* The clients of top[0..n) whose next unit is an ATTEND record and whose
 * uid is not too far ahead of top[0]'s, packed to the front; how many. */
static unsigned joiners(struct client **top, unsigned n)
{
	uint64_t lim = top[0]->fair->vtime + JOIN_SLACK_NS;
	unsigned m = 0;

	for (unsigned i = 0; i < n; i++)
		if (in_records(top[i]) && top[i]->fair->vtime <= lim)
			top[m++] = top[i];
	return m;
}

/* The cheap steps of a turn: take c's next entry, check an ATTEND's ids.
 * They cost little and let c's records join the batch being formed. */
static void prepare(struct kvd_server *s, struct client *c)
{
	if (!c->job.active)
		job_start(s, c);
	if (c->job.active && c->job.e.op == KVD_OP_ATTEND && !c->job.checked && !c->parked)
		run_whole(s, c);
}

/* Called between the slices of a sliced pool job (kvd_pool_set_yield): a
 * segment being sealed, rows being copied into staging, deep inside a
 * PREFILL or APPEND unit.  Runs batches of other clients' ATTEND records,
 * so a long seal or copy delays them by a slice, not by the whole.  Only
 * records (and the cheap steps; any other entry taken waits for its own
 * pass): records read sequences and never change one, and the sequence
 * being worked on is still prefilling that layer (its records fail EBUSY)
 * or is changed only by its own, running, entry.  The records may restore
 * their sequences and make room for that, but never by writing out the
 * unit's sequence (it is pinned), and never with the room the unit's change
 * counted on (kvd_store_rows charged its peak before it began). */
static void slice_yield(void *arg)
{
	struct kvd_server *s = arg;
	struct client *top[PASS_UNITS], *owner = s->unit_client;

	if (s->nested)
		return;
	s->nested = 1;
	/* Fair share inside the unit too: batches of others' records run
	 * while their clients have had less time than the unit's owner has
	 * had so far (counting this unit), at least one batch, at most a few,
	 * so the owner still moves. */
	for (int round = 0; round < YIELD_ROUNDS; round++) {
		uint64_t t0 = kvd_now_ns(), el;
		unsigned n = pick(s, top), m = 0;

		for (unsigned i = 0; i < n; i++)
			prepare(s, top[i]);
		m = n ? joiners(top, n) : 0;
		if (m)
			run_records(s, top, m);
		s->nested_ns += kvd_now_ns() - t0;
		if (!m || !owner)
			break;
		el = kvd_now_ns() - s->unit_t0 - s->nested_ns;
		if (!before(top[0]->fair->vtime, top[0]->vtime, owner->fair->vtime + el,
			    owner->vtime + el))
			break;
	}
	s->nested = 0;
}

static void set_sleeping(struct kvd_server *s, int on);
static void exec_sleep(struct kvd_server *s, int ms);

/* The ready clients (after their cheap steps) whose next unit is an ATTEND
 * record, packed into top; how many. */
static unsigned ready_records(struct kvd_server *s, struct client **top)
{
	unsigned n = pick(s, top), m = 0;

	for (unsigned i = 0; i < n; i++) {
		prepare(s, top[i]);
		if (in_records(top[i]))
			top[m++] = top[i];
	}
	return m;
}

/* While a slice of a sliced pool job runs on the pool's bulk threads
 * (kvd_pool_set_wait): others' ATTEND records run as they arrive, on the
 * workers, not after the slice, then the executor sleeps until the slice
 * is done (slice_done) or a client submits.  Only what slice_yield may
 * run (records, and the cheap steps), but beside the slice's tasks, which
 * write only what the unit is making (a segment not yet in its sequence,
 * staging rows past the ones a record may read): nothing a record reads.
 * Without slice_yield's fair-share cut: the unit's owner moves meanwhile
 * on the pool, and none of this time is taken off its charge. */
static void slice_wait(void *arg)
{
	struct kvd_server *s = arg;
	struct client *top[PASS_UNITS];
	unsigned m = 0;

	if (NEVER(s->nested))
		return;
	s->nested = 1;
	for (int round = 0; round < YIELD_ROUNDS && (m = ready_records(s, top)); round++)
		run_records(s, top, m);
	s->nested = 0;
	if (m)
		return;         /* more came: the pool calls again */
	/* As the idle executor does: announce sleep, look once more, and
	 * only then block; bounded, so no lost wake-up holds the slice. */
	set_sleeping(s, 1);
	if (!ready_records(s, top))
		exec_sleep(s, 1);
	set_sleeping(s, 0);
}

/* A slice's last task ran (on a pool thread). */
static void slice_done(void *arg)
{
	kvd_exec_notify(arg);
}

/* One pass: returns 0 when no client had anything to run. */
static int exec_pass(struct kvd_server *s)
{
	struct client **top = s->xb->top;

	if (kvd_tier_waiting(s->tier)) {
		uint64_t who;

		if (kvd_tier_due(s->tier, kvd_now_ns(), &who))
			kvd_unpark(s, 0);
		else if (who)
			kvd_unpark(s, who);
	}

	unsigned n = pick(s, top), m = 0;

	if (!n)
		return 0;
	if (top[0]->vtime > s->vclock)
		s->vclock = top[0]->vtime;
	if (top[0]->fair->vtime > s->fair.uvclock)
		s->fair.uvclock = top[0]->fair->vtime;
	for (unsigned i = 0; i < n; i++) {
		uint64_t t0 = kvd_now_ns();

		prepare(s, top[i]);
		charge(top[i], kvd_now_ns() - t0);
	}
	if (in_records(top[0])) {
		m = joiners(top, n);
		run_records(s, top, m);
	} else if (top[0]->job.active && !top[0]->parked) {
		struct client *c = top[0];
		uint64_t t0 = kvd_now_ns();

		s->nested_ns = 0;
		s->unit_client = c;
		s->unit_t0 = t0;
		run_whole(s, c);
		s->unit_client = NULL;
		/* What ran for others inside the unit is theirs, not c's. */
		charge(c, kvd_now_ns() - t0 - s->nested_ns);
	}
	/* Records that ran inside a unit and waited for room only its pinned
	 * sequence could give go again now. */
	if (kvd_tier_take_pin_waits(s->tier))
		kvd_unpark(s, 0);
	kvd_tier_balance(s->tier);
	return 1;
}

/* ---- the thread --------------------------------------------------------- */

/* Between units: when the loop is waiting for the lock, it gets one turn.
 * One, not as many as it wants: a client flooding the control socket must
 * not starve the data plane either, so the two alternate. */
static void yield_to_loop(struct kvd_server *s)
{
	uint64_t turn = s->loop_turns;

	while (atomic_load_explicit(&s->loop_wants, memory_order_acquire) &&
	       s->loop_turns == turn)
		pthread_cond_wait(&s->handoff, &s->mu);
}

/* A pass done (work or none): a loop breathing (kvd_loop_breathe) waits
 * for exactly this. */
static int passed(struct kvd_server *s, int worked)
{
	s->exec_passes++;
	if (s->loop_parked)
		pthread_cond_broadcast(&s->handoff);
	return worked;
}

static void set_sleeping(struct kvd_server *s, int on)
{
	for (struct client *c = s->clients; c; c = c->next)
		if (c->hello && !c->control && !c->dead)
			shm_ring_set_sleeping(&c->r.sq, on);
}

/* Until a client's kick, a notify (kvd_exec_notify) or ms have passed. */
static void exec_sleep(struct kvd_server *s, int ms)
{
	struct epoll_event ev[16];
	uint64_t x;

	epoll_wait(s->xepfd, ev, 16, ms);
	if (read(s->xnfd, &x, sizeof x) < 0) {
		/* nothing pending: a kick woke us */
	}
}

static void *exec_main(void *arg)
{
	struct kvd_server *s = arg;
	uint64_t idle_since = kvd_now_ns();

	kvd_pool_set_yield(slice_yield, s);
	kvd_pool_set_wait(slice_wait, slice_done);
	pthread_mutex_lock(&s->mu);
	for (;;) {
		atomic_store_explicit(&s->exec_beat_ns, kvd_now_ns(), memory_order_relaxed);
		/* Draining is bounded: a client that keeps submitting must not
		 * keep kvd from stopping. */
		if (s->exec_stop && kvd_now_ns() > s->stop_deadline_ns) {
			kvd_log(LOG_WARNING, "drain: still busy after %d s, stopping anyway",
				DRAIN_SECONDS);
			break;
		}
		if (passed(s, exec_pass(s))) {
			idle_since = kvd_now_ns();
			yield_to_loop(s);
			continue;
		}
		if (s->exec_stop)
			break;          /* drained: nothing left that can run */
		if (kvd_now_ns() - idle_since < s->cfg->spin_ns) {
			/* Spin without the lock, so the loop is never kept out. */
			pthread_mutex_unlock(&s->mu);
			for (int i = 0; i < 64; i++)
				cpu_relax();
			pthread_mutex_lock(&s->mu);
			continue;
		}
		/* Idle: announce sleep on every SQ, then look once more before
		 * blocking — a client that committed before seeing the flag is
		 * caught by this second look (see shm_ring_set_sleeping); one
		 * that commits after it kicks its eventfd and the loop wakes us. */
		set_sleeping(s, 1);
		if (!passed(s, exec_pass(s)) && !s->exec_stop) {
			/* Bounded: no lost wake-up can hold a client longer.  The
			 * lock is free meanwhile. */
			atomic_store_explicit(&s->exec_idle, 1, memory_order_relaxed);
			pthread_mutex_unlock(&s->mu);
			exec_sleep(s, 1000);
			pthread_mutex_lock(&s->mu);
			atomic_store_explicit(&s->exec_idle, 0, memory_order_relaxed);
		}
		set_sleeping(s, 0);
		idle_since = kvd_now_ns();
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

void kvd_exec_notify(struct kvd_server *s)
{
	uint64_t one = 1;

	if (write(s->xnfd, &one, sizeof one) < 0) {
		/* the counter is full: a wake-up is pending anyway */
	}
}

int kvd_exec_init(struct kvd_server *s)
{
	struct epoll_event ev = { .events = EPOLLIN };

	s->xepfd = epoll_create1(EPOLL_CLOEXEC);
	s->xnfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (s->xepfd < 0 || s->xnfd < 0 || epoll_ctl(s->xepfd, EPOLL_CTL_ADD, s->xnfd, &ev))
		return -errno;
	return 0;
}

/* Edge-triggered: every write of the client is a new edge, so the eventfd
 * is never read, and a stale event of a client that left names nothing. */
int kvd_exec_watch(struct kvd_server *s, int fd)
{
	struct epoll_event ev = { .events = EPOLLIN | EPOLLET };

	return epoll_ctl(s->xepfd, EPOLL_CTL_ADD, fd, &ev) ? -errno : 0;
}

void kvd_exec_unwatch(struct kvd_server *s, int fd)
{
	epoll_ctl(s->xepfd, EPOLL_CTL_DEL, fd, NULL);
}

int kvd_exec_start(struct kvd_server *s)
{
	struct kvd_exec_buf *xb = calloc(1, sizeof *xb);
	int rc;

	if (!xb)
		return -ENOMEM;
	s->xb = xb;
	xb->qb = KVD_ALIGN64((size_t)KVD_QHEADS_MAX * KVD_DMAX * sizeof(float));
	xb->ob = xb->qb;
	xb->cb = KVD_ALIGN64((size_t)KVD_QHEADS_MAX * KVD_LSH_LMAX * sizeof(uint16_t));
	xb->lb = KVD_ALIGN64((size_t)KVD_QHEADS_MAX * sizeof(float));
	/* Untouched pages cost nothing: these are sized for the largest
	 * profile and only what a pass uses is ever faulted in. */
	xb->q = malloc(PASS_UNITS * xb->qb);
	xb->o = malloc(PASS_UNITS * xb->ob);
	xb->qc = malloc(PASS_UNITS * xb->cb);
	xb->lse = malloc(PASS_UNITS * xb->lb);
	if (!xb->q || !xb->o || !xb->qc || !xb->lse)
		return -ENOMEM;
	atomic_store(&s->exec_beat_ns, kvd_now_ns());
	s->exec_running = 1;

	/* Started after the loop unblocked its signals: block them here, as
	 * every other thread does, so the handler runs on the loop's thread
	 * only, and no thread the executor starts (the pool's prefault side
	 * thread) takes one either.  A SIGTERM sent just after start-up was
	 * seen lost, once, under TSan, which defers a signal to whatever
	 * thread it landed on. */
	sigset_t mask, old;

	kvd_signal_set(&mask);
	pthread_sigmask(SIG_BLOCK, &mask, &old);
	rc = pthread_create(&s->exec_th, NULL, exec_main, s);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		s->exec_running = 0;
		return -rc;
	}
	return 0;
}

void kvd_exec_stop(struct kvd_server *s)
{
	if (!s->exec_running)
		return;
	kvd_state_lock(s);
	s->exec_stop = 1;
	s->stop_deadline_ns = kvd_now_ns() + DRAIN_SECONDS * 1000000000ull;
	kvd_state_unlock(s);
	kvd_exec_notify(s);
	pthread_join(s->exec_th, NULL);
}

void kvd_exec_free(struct kvd_server *s)
{
	if (s->xepfd >= 0)
		close(s->xepfd);
	if (s->xnfd >= 0)
		close(s->xnfd);
	s->xepfd = s->xnfd = -1;
	if (!s->xb)
		return;
	free(s->xb->q);
	free(s->xb->o);
	free(s->xb->qc);
	free(s->xb->lse);
	free(s->xb);
	s->xb = NULL;
}
