/* kvd_tier: RAM or disk, and the budget.  See tier.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>

#include "engine/clock.h"
#include "engine/err.h"
#include "engine/invariant.h"
#include "engine/log.h"
#include "remote.h"
#include "engine/rng.h"
#include "store_int.h"
#include "tier.h"

#define BACKOFF_NS (5ull * 1000000000ull)      /* after a failed write */
#define POLL_NS 2000000ull                      /* kvd_tier_poll's default budget */
#define POLL_BATCH 4                            /* results reaped at once */
#define PAGE KVD_SFMT_PAGE
enum { MINE_PAGE = 1, MINE_SEG = 2 };

/* What a file holds, one entry per extent (from the write, or the scan). */
struct ext {
	uint32_t kind, layer, n, flags;
	uint64_t bytes, tok_begin, tok_end;
};

struct unl;

struct rec {
	struct kvd_seqn *q;
	uint32_t uid;                   /* q's: what this record charged is on it */
	struct unl *unl;                /* an UNLINK of our file in flight */
	struct rec *prev, *next;        /* LRU of resident sequences, head = coldest */
	int in_lru;
	uint64_t epoch;                 /* request that last used it */
	/* the file */
	int has_file;
	unsigned dir;
	uint64_t file_gen, disk_bytes;
	struct ext *ext;
	unsigned next_ext;
	/* the job in flight, if busy */
	int busy, freeing, evict_after;
	struct kvd_spill_job job;
	struct kvd_spill_buf *buf;      /* job.ext */
	uint8_t *mine;                  /* [next]: buf[i] is ours to free at the end:
					 * MINE_PAGE or MINE_SEG (kvd_seg_io_alloc) */
	struct ext *wext;               /* WRITE: the extents being written */
	struct kvd_seg **wseg;          /* WRITE: the segments whose header pages it uses */
	unsigned nwseg;
	struct wfill *wfill;            /* WRITE: [next], the LAYER extents' tail copies,
					 * made on the spill thread (fill_layer) */
	uint64_t reserved;              /* READ: budget held for what is not installed
					 * (charged to uid's memory in kvd_limits) */
	uint64_t spill_chg;             /* bytes of the file (being) written, charged to
					 * uid's KVD_RES_SPILL until the file goes */
	uint64_t pend;                  /* WRITE with evict_after: counted in t->pending
					 * (what the drop frees, and wcopy) */
	uint64_t wcopy;                 /* WRITE: its copies and arrays (write_copies),
					 * charged to uid's memory in kvd_limits */
	uint64_t backoff_until;
	uint64_t io_t0;                 /* when the running write or restore was submitted */
	char why[96];                   /* LOST: the reason */
	/* its copy in the remote tier (kvd_tier_set_remote) */
	int rem_sent;                   /* a put was queued: the keys may exist */
	int rem_ok;                     /* the cluster holds the file of rem_gen */
	int rem_only;                   /* ... and the local file went (ext is kept) */
	int rem_getting;                /* the file is being fetched back */
	uint64_t rem_fail_until;        /* the cluster failed that fetch: not before then */
	uint64_t rem_gen, rem_bytes;
	uint64_t rem_chg;               /* charged to uid's KVD_RES_REMOTE: the copy's bytes */
};

/* An UNLINK job.  The engine must not run two jobs of one sequence at
 * once, so the record knows of it (no new write until it has ended); it
 * outlives a freed record and frees itself when reaped. */
struct unl {
	struct kvd_spill_job j;
	struct rec *r;
	struct unl *next;               /* t->unls: freed at destroy if never reaped */
};

struct kvd_tier {
	struct kvd_tier_cfg cfg;
	struct kvd_store *st;
	struct kvd_spill *sp;
	struct rec *head, *tail;        /* LRU */
	void (*on_pub)(void *arg, struct kvd_seqn *q);  /* a published prefix found at load */
	void *on_pub_arg;
	void (*on_written)(void *arg, struct kvd_seqn *q, const char *path);
	void *on_written_arg;
	const char *adopt_tenant;       /* kvd_tier_adopt: the tenant load_one uses */
	uint64_t epoch;
	uint64_t reserved, pending;     /* restores' reservations; bytes being written out to drop */
	struct unl *unls;
	struct kvd_tier_counters ctr;   /* write-backs, drops, losses: kvd_tier_stats' too */
	uint64_t restores, restore_bytes;
	struct kvd_remote *rem;         /* evicted sequences' files go there too */
	uint64_t inst;                  /* this lifetime's half of their keys */
	uint64_t rem_puts, rem_drops, rem_fetches;
	/* rem_room found nothing for (dry_uid, or anyone's with dry_any) and
	 * nothing has become droppable since: the next refusal skips the walk
	 * of every sequence (a uid at its limit asks on every write-back). */
	int dry, dry_any;
	uint32_t dry_uid;
	uint64_t rem_down_until;        /* the cluster failed us: keep local files till then */
	int stopping;
	int pin_wait;                   /* a request waits for a pinned sequence's unit
					 * to end (kvd_tier_take_pin_waits) */
	char why[160];                  /* why evict() refused (kvd_tier_evict's message) */
};

static struct kvd_limits *lim(const struct kvd_tier *t)
{
	return kvd_store_limits(t->st);
}

/* With limits, everything charged as memory: sequences, profiles, the
 * restores' reservations and the records here; the store's charges are the
 * wall, this is the same number so the watermarks see what the wall sees. */
static uint64_t used(const struct kvd_tier *t)
{
	struct kvd_store_stats ss;

	if (lim(t)) {
		struct kvd_limits_usage u;

		kvd_limits_total(lim(t), &u);
		return u.n[KVD_RES_MEMORY];
	}
	kvd_store_stats(t->st, &ss);
	return ss.bytes + ss.fixed_bytes + ss.profile_bytes + ss.local_bytes + t->reserved;
}

const double kvd_tier_io_le[KVD_TIER_IO_LE] = { 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
						250e-3, 500e-3, 1, 2.5, 5, 10, 30, 60 };

#define ADD(x, n) atomic_fetch_add_explicit(&(x), (n), memory_order_relaxed)
#define GET(x) atomic_load_explicit(&(x), memory_order_relaxed)

/* A write-back or restore ended (KVD_TIER_WRITE or _READ): how, the bytes it
 * moved when it succeeded, the time since its submission. */
static void count_io(struct kvd_tier *t, int kind, int how, uint64_t bytes, uint64_t ns)
{
	struct kvd_tier_counters *c = &t->ctr;
	double s = (double)ns / 1e9;
	unsigned i = 0;

	ADD(c->io_n[kind][how], 1);
	if (how == KVD_TIER_OK)
		ADD(c->io_bytes[kind], bytes);
	if (how == KVD_TIER_CANCELLED)
		return;
	while (i < KVD_TIER_IO_LE && s > kvd_tier_io_le[i])
		i++;
	ADD(c->io_le[kind][i], 1);
	ADD(c->io_sum_ns[kind], ns);
}

static void *page_alloc(uint64_t bytes)
{
	void *p = NULL;

	return posix_memalign(&p, PAGE, bytes) ? NULL : p;
}

/* ---- records and the LRU ------------------------------------------------ */

static struct rec *rec_of(struct kvd_tier *t, struct kvd_seqn *q)
{
	struct rec *r = q->tier;

	/* Not charged here: the record is part of q's fixed bytes, charged
	 * (and refusable) at SeqCreate (kvd_store_set_seq_extra). */
	if (!r && !(r = calloc(1, sizeof *r)))
		return NULL;
	if (!r->q) {
		r->q = q;
		r->uid = q->uid;
		q->tier = r;
	}
	return r;
}

static void lru_del(struct kvd_tier *t, struct rec *r)
{
	if (!r->in_lru)
		return;
	*(r->prev ? &r->prev->next : &t->head) = r->next;
	*(r->next ? &r->next->prev : &t->tail) = r->prev;
	r->prev = r->next = NULL;
	r->in_lru = 0;
}

static void lru_use(struct kvd_tier *t, struct rec *r)
{
	lru_del(t, r);
	r->prev = t->tail;
	*(t->tail ? &t->tail->next : &t->head) = r;
	t->tail = r;
	r->in_lru = 1;
	r->epoch = t->epoch;
}

/* Gives back the spill bytes r's file was charged (the file is going, or
 * was never written). */
static void spill_unchg(struct kvd_tier *t, struct rec *r)
{
	if (lim(t))
		kvd_limits_uncharge(lim(t), r->uid, KVD_RES_SPILL, r->spill_chg);
	r->spill_chg = 0;
}

static void rem_unchg(struct kvd_tier *t, struct rec *r);

static void rec_free(struct kvd_tier *t, struct rec *r)
{
	spill_unchg(t, r);
	rem_unchg(t, r);
	lru_del(t, r);
	if (r->unl)
		r->unl->r = NULL;
	if (r->q)
		r->q->tier = NULL;
	free(r->ext);
	free(r);
}


static void unlink_file(struct kvd_tier *t, struct rec *r)
{
	struct unl *u = calloc(1, sizeof *u);

	if (!u || !t->sp) {
		free(u);
		return;
	}
	u->j.op = KVD_SPILL_UNLINK;
	u->j.seq = r->q->id;
	u->j.dir = r->dir;
	u->j.user = NULL;
	u->r = r;
	if (kvd_spill_submit(t->sp, &u->j)) {
		free(u);
		return;
	}
	r->unl = u;
	u->next = t->unls;
	t->unls = u;
}

static void unl_done(struct kvd_tier *t, struct unl *u)
{
	struct unl **pp = &t->unls;

	while (*pp && *pp != u)
		pp = &(*pp)->next;
	if (*pp)
		*pp = u->next;
	if (u->r)
		u->r->unl = NULL;
	free(u);
}

static void forget_file(struct kvd_tier *t, struct rec *r)
{
	if (!r->has_file)
		return;
	if (!(t->stopping && t->cfg.persist))
		unlink_file(t, r);
	spill_unchg(t, r);
	r->has_file = 0;
	free(r->ext);
	r->ext = NULL;
	r->next_ext = 0;
}

static int clean(const struct rec *r)
{
	return r->has_file && r->file_gen == r->q->gen;
}

/* ---- buffers of a job --------------------------------------------------- */

/* A LAYER extent's tail rows, copied into the file on the spill thread from
 * a tail the write holds (kvd_store_tail_hold): the rows stay as they are
 * while it is held, so the state lock pays for no tail copy. */
struct wfill {
	struct kvd_tail *tail;          /* NULL: nothing to fill */
	const struct kvd_geom *g;
	uint32_t n, cap;                /* rows to copy, rows the tail holds */
	int mean;
	uint64_t bytes;                 /* the payload's, padding included */
};

static void fill_layer(void *arg, void *payload)
{
	const struct wfill *w = arg;
	const struct kvd_geom *g = w->g;
	const uint16_t *tk, *tv, *tc;
	size_t rowb = (size_t)w->n * g->d * 2;
	float *m;
	uint16_t *k, *v, *c;

	kvd_store_tail_bufs(w->tail, &tk, &tv, &tc);
	kvd_sfmt_layer_parts(g, w->n, w->mean, payload, &m, &k, &v, &c);
	/* from the rows on: the mean before them was written under the lock */
	memset(k, 0, w->bytes - (size_t)((char *)k - (char *)payload));
	for (size_t hh = 0; hh < g->kv_heads; hh++) {
		memcpy((char *)k + hh * rowb, tk + hh * w->cap * g->d, rowb);
		memcpy((char *)v + hh * rowb, tv + hh * w->cap * g->d, rowb);
		for (size_t tb = 0; tb < g->L; tb++)
			memcpy(c + (hh * g->L + tb) * w->n, tc + (hh * g->L + tb) * w->cap,
			       (size_t)w->n * 2);
	}
}

static void job_release(struct kvd_tier *t, struct rec *r)
{
	for (unsigned i = 0; r->wfill && i < r->job.next; i++)
		kvd_store_tail_drop(t->st, r->q->p, r->wfill[i].tail);
	free(r->wfill);
	r->wfill = NULL;
	for (unsigned i = 0; r->buf && r->mine && i < r->job.next; i++) {
		if (!r->mine[i] || !r->buf[i].p)
			continue;
		if (r->mine[i] == MINE_SEG)
			kvd_seg_io_free(r->buf[i].p, r->buf[i].bytes);
		else
			free(r->buf[i].p);
	}
	for (unsigned i = 0; i < r->nwseg; i++)
		r->wseg[i]->wbusy = 0;
	free(r->wseg);
	r->wseg = NULL;
	r->nwseg = 0;
	free(r->buf);
	free(r->mine);
	free(r->wext);
	r->buf = NULL;
	r->mine = NULL;
	r->wext = NULL;
	t->reserved -= r->reserved;
	if (lim(t))
		kvd_limits_uncharge(lim(t), r->uid, KVD_RES_MEMORY, r->reserved + r->wcopy);
	r->reserved = 0;
	r->wcopy = 0;
	r->busy = 0;
	memset(&r->job, 0, sizeof r->job);
}

static int job_alloc(struct rec *r, unsigned n)
{
	r->buf = calloc(n, sizeof *r->buf);
	r->mine = calloc(n, 1);
	return r->buf && r->mine ? 0 : -ENOMEM;
}

/* ---- write-back --------------------------------------------------------- */

static unsigned count_extents(const struct kvd_seqn *q)
{
	unsigned n = 2;                 /* PROFILE, END */

	for (uint32_t i = 0; i < q->p->layers; i++) {
		const struct kvd_layer_state *l = &q->ly[i];

		if (l->mean || l->tail_n || l->nseg)
			n += 1 + l->nseg;
		if (q->loc && q->loc->ly[i].n)
			n++;
	}
	return n + q->hidden;
}

/* Extent i of r's write: a header page alone (PUB, END). */
static int header_ext(struct rec *r, unsigned i, const struct kvd_sfmt_file *f,
		      const struct kvd_sfmt_ext *e)
{
	if (!(r->buf[i].p = page_alloc(PAGE)))
		return -ENOMEM;
	r->buf[i].bytes = PAGE;
	r->mine[i] = 1;
	memset(r->buf[i].p, 0, PAGE);
	kvd_sfmt_hdr_fill(r->buf[i].p, f, e);
	r->wext[i] = (struct ext){ .kind = e->kind, .n = ((struct kvd_sfmt_hdr *)r->buf[i].p)->n,
				   .bytes = PAGE };
	return 0;
}

/* What build_write allocates for q's file besides the segments' own
 * buffers: the job's arrays for n extents, and the extents it copies
 * (PROFILE, each LAYER's mean and tail, LOCAL rows, PUB and END pages). */
static uint64_t write_copies(const struct kvd_sfmt_file *f, const struct kvd_seqn *q, unsigned n)
{
	const struct kvd_profile *p = q->p;
	struct kvd_sfmt_ext e = { .kind = KVD_SFMT_PROFILE };
	uint64_t b = (uint64_t)n * (sizeof(struct kvd_spill_buf) + 1 + sizeof(struct ext) +
				    sizeof(struct kvd_seg *) + sizeof(struct wfill));

	b += kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(f, &e));
	for (uint32_t ly = 0; ly < p->layers; ly++) {
		const struct kvd_layer_state *l = &q->ly[ly];

		if (l->mean || l->tail_n || l->nseg) {
			e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_LAYER, .n = l->tail_n,
						   .flags = l->mean ? KVD_SFMT_LF_MEAN : 0 };
			b += kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(f, &e));
		}
		if (q->loc && q->loc->ly[ly].n) {
			e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_LOCAL, .n = q->loc->ly[ly].n };
			b += kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(f, &e));
		}
	}
	return b + (q->hidden ? 2 : 1) * (uint64_t)PAGE;
}

/* Builds the WRITE job of q's whole data: PROFILE, per layer LAYER + SEGs,
 * END; -EAGAIN while a segment of q is in another write (forks and
 * attached prefixes share segments, and each file writes its own header
 * into the segment's header page).  Segments are written from their own
 * buffers (their header page);
 * profile, layer and end extents are copies, so later appends do not race
 * the write.  A layer's estimator state (l->heavy, hybrid and adaptive
 * profiles) is not written: it is scratch, dropped with the sequence's
 * RAM, and a restored sequence starts again from empty lists. */
static int build_write(struct kvd_tier *t, struct rec *r, int evict)
{
	struct kvd_seqn *q = r->q;
	const struct kvd_profile *p = q->p;
	const struct kvd_geom *g = &p->g;
	const struct kvd_sfmt_file f = { .p = p, .seq = q->id, .gen = q->gen,
					 .profile_fp = kvd_sfmt_profile_fp(p), .tenant = q->tenant };
	unsigned n = count_extents(q), i = 0;
	struct kvd_sfmt_ext e;

	/* A file taken in the middle of a change would be current (the change
	 * bumped gen before it began) for rows the sequence is still adding:
	 * write_out refuses pinned sequences, so none gets here. */
	if (NEVER(kvd_store_seq_pinned(q)))
		return -EBUSY;
	for (uint32_t ly = 0; ly < p->layers; ly++)
		for (uint32_t sgi = 0; sgi < q->ly[ly].nseg; sgi++)
			if (q->ly[ly].seg[sgi]->wbusy) {
				snprintf(t->why, sizeof t->why, "a segment it shares is being written "
					 "out with another sequence: try again");
				return -EAGAIN;
			}
	/* The copies are the uid's memory while the write runs: charged before
	 * they exist, checked like any other bytes.  Refused, the sequence
	 * stays in RAM and is not tried again before the back-off.  Except
	 * for a write that drops the sequence after (an eviction, the
	 * budget's or a SeqEvict): it frees far more than its copies, and at
	 * the limit refusing it left nothing able to go and every request
	 * failing until something was freed.  Its copies are charged all the
	 * same: an overshoot of one write's copies while it runs. */
	if (lim(t)) {
		uint64_t cb = write_copies(&f, q, n);
		char why[128];
		int rc = kvd_limits_charge(lim(t), r->uid, KVD_RES_MEMORY, cb, why, sizeof why);

		if (rc && evict)
			rc = kvd_limits_force(lim(t), r->uid, KVD_RES_MEMORY, cb);
		if (rc) {
			snprintf(t->why, sizeof t->why, "the write-back's copies: %s", why);
			r->backoff_until = kvd_now_ns() + BACKOFF_NS;
			return rc;
		}
		r->wcopy = cb;
	}
	if (job_alloc(r, n) || !(r->wext = calloc(n, sizeof *r->wext)) ||
	    !(r->wseg = calloc(n, sizeof *r->wseg)) || !(r->wfill = calloc(n, sizeof *r->wfill)))
		goto nomem;

	e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_PROFILE, .index = i };
	r->buf[i].bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(&f, &e));
	if (!(r->buf[i].p = page_alloc(r->buf[i].bytes)))
		goto nomem;
	r->mine[i] = 1;
	memset(r->buf[i].p, 0, r->buf[i].bytes);
	kvd_sfmt_hdr_fill(r->buf[i].p, &f, &e);
	kvd_sfmt_profile_put(p, (char *)r->buf[i].p + PAGE);
	r->wext[i] = (struct ext){ .kind = KVD_SFMT_PROFILE, .bytes = r->buf[i].bytes };
	i++;

	for (uint32_t ly = 0; ly < p->layers; ly++) {
		const struct kvd_layer_state *l = &q->ly[ly];

		if (!(l->mean || l->tail_n || l->nseg))
			continue;
		struct kvd_sfmt_hdr *h;
		float *m;
		uint16_t *k, *v, *c;

		e = (struct kvd_sfmt_ext){
			.kind = KVD_SFMT_LAYER, .index = i, .layer = ly, .n = l->tail_n,
			.flags = (l->mean ? KVD_SFMT_LF_MEAN : 0) | (l->sealed ? KVD_SFMT_LF_SEALED : 0),
			.tok_begin = l->tokens - l->tail_n,
		};
		r->buf[i].bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(&f, &e));
		if (!(r->buf[i].p = page_alloc(r->buf[i].bytes)))
			goto nomem;
		r->mine[i] = 1;
		h = r->buf[i].p;
		kvd_sfmt_layer_parts(g, l->tail_n, l->mean != NULL, (char *)h + PAGE, &m, &k, &v, &c);
		/* The header page and the mean here; the tail's rows, as many
		 * bytes as a segment's, on the spill thread (fill_layer). */
		memset(h, 0, (size_t)((char *)k - (char *)h));
		kvd_sfmt_hdr_fill(h, &f, &e);
		if (m)
			memcpy(m, l->mean, (size_t)g->kv_heads * g->d * sizeof(float));
		if (l->tail_n) {
			if (NEVER(!l->tail))
				goto nomem;
			r->wfill[i] = (struct wfill){ .tail = kvd_store_tail_hold(q, ly), .g = g,
						      .n = l->tail_n, .cap = p->seal_tokens,
						      .mean = m != NULL,
						      .bytes = r->buf[i].bytes - PAGE };
			r->buf[i].fill = fill_layer;
			r->buf[i].fill_arg = &r->wfill[i];
		} else {
			memset(k, 0, r->buf[i].bytes - (size_t)((char *)k - (char *)h));
		}
		r->wext[i] = (struct ext){ KVD_SFMT_LAYER, ly, l->tail_n, h->flags, r->buf[i].bytes,
					   h->tok_begin, h->tok_end };
		i++;

		uint64_t tok = 0;

		for (uint32_t sgi = 0; sgi < l->nseg; sgi++) {
			struct kvd_seg *sg = l->seg[sgi];

			sg->wbusy = 1;
			r->wseg[r->nwseg++] = sg;
			r->buf[i].p = sg->io;
			r->buf[i].bytes = sg->bytes;
			h = sg->io;
			e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_SEG, .index = i, .layer = ly,
						   .n = sg->n, .tok_begin = tok };
			kvd_sfmt_hdr_fill(h, &f, &e);
			tok += sg->n;
			r->wext[i] = (struct ext){ KVD_SFMT_SEG, ly, sg->n, 0, sg->bytes, h->tok_begin,
						   h->tok_end };
			i++;
		}
	}
	/* The client rows kvd keeps for a published prefix: copies, like the
	 * layers' (a later put or rows entering replace them, not change them). */
	for (uint32_t ly = 0; q->loc && ly < p->layers; ly++) {
		const struct kvd_local_layer *lo = &q->loc->ly[ly];
		uint64_t half;

		if (!lo->n)
			continue;
		e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_LOCAL, .index = i, .layer = ly,
					   .n = lo->n };
		r->buf[i].bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(&f, &e));
		if (!(r->buf[i].p = page_alloc(r->buf[i].bytes)))
			goto nomem;
		r->mine[i] = 1;
		memset(r->buf[i].p, 0, r->buf[i].bytes);
		kvd_sfmt_hdr_fill(r->buf[i].p, &f, &e);
		half = kvd_sfmt_local_bytes(g, lo->n) / 2;
		for (size_t hh = 0; hh < g->kv_heads; hh++) {
			size_t rowb = (size_t)lo->n * g->d * 2;
			char *pl = (char *)r->buf[i].p + PAGE;

			memcpy(pl + hh * rowb, lo->k + hh * lo->cap * g->d, rowb);
			memcpy(pl + half + hh * rowb, lo->v + hh * lo->cap * g->d, rowb);
		}
		r->wext[i] = (struct ext){ .kind = KVD_SFMT_LOCAL, .layer = ly, .n = lo->n,
					   .bytes = r->buf[i].bytes };
		i++;
	}
	/* A published prefix says so, and under which key: --persist brings it
	 * back as one. */
	if (q->hidden) {
		e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_PUB, .index = i,
					   .n = (uint32_t)q->pubtok };
		if (header_ext(r, i, &f, &e))
			goto nomem;
		kvd_sfmt_pub_key_put(r->buf[i].p, q->pubkey);
		i++;
	}
	e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_END, .index = i };
	if (header_ext(r, i, &f, &e))
		goto nomem;
	i++;

	r->job = (struct kvd_spill_job){ .op = KVD_SPILL_WRITE, .seq = q->id, .gen = q->gen,
					 .ext = r->buf, .next = n, .user = r };
	return 0;
nomem:
	r->job.next = n;
	job_release(t, r);
	return -ENOMEM;
}

/* Drops q's resident data; a current file holds it. */
static void drop(struct kvd_tier *t, struct rec *r)
{
	/* The unit changing a pinned sequence still uses its buffers. */
	if (NEVER(kvd_store_seq_pinned(r->q)))
		return;
	t->dry = 0;
	kvd_store_seq_drop(t->st, r->q);
	r->q->state = KVD_SEQ_DISK;
	r->q->ready = 0;
	lru_del(t, r);
}

/* Starts evicting r: at once when its file is current, else a write-back
 * that drops it when done.  0, or why not. */
static int write_out(struct kvd_tier *t, struct rec *r, int evict);
static int spill_charge(struct kvd_tier *t, uint32_t uid, uint64_t bytes, char *msg,
			size_t msglen);

static int evict(struct kvd_tier *t, struct rec *r)
{
	return write_out(t, r, 1);
}


/* Starts writing r's file: then drops it from RAM (evict), or keeps it
 * resident with a current file (a published prefix, under persist). */
static int write_out(struct kvd_tier *t, struct rec *r, int evict)
{
	struct kvd_seqn *q = r->q;
	int rc;

	if (kvd_store_seq_pinned(q))
		return -EBUSY;          /* a unit is changing it (see victim()) */
	if (!evict && (q->state != KVD_SEQ_RAM || clean(r) || r->busy))
		return 0;
	if (q->state == KVD_SEQ_SPILLING) {
		if (!r->evict_after) {
			r->pend = kvd_store_seq_freeable(q) + r->wcopy;
			t->pending += r->pend;
		}
		r->evict_after = 1;
		return 0;
	}
	if (q->state != KVD_SEQ_RAM)
		return -EBUSY;
	if (r->unl)
		return -EAGAIN;
	if (clean(r)) {
		kvd_log(LOG_DEBUG, "sequence %016llx: dropped, its file is current",
			(unsigned long long)q->id);
		drop(t, r);
		ADD(t->ctr.evict[0], 1);
		return 0;
	}
	if (!kvd_store_spillable(q))
		return -EBUSY;
	if (r->has_file) {
		/* A stale file goes first: the write comes once it is gone. */
		forget_file(t, r);
		return r->unl ? -EAGAIN : -EBUSY;
	}
	if ((rc = build_write(t, r, evict)))
		return rc;
	/* The file's bytes are charged to the uid's spill before the write
	 * starts; refused, the sequence stays in RAM (and is not tried again
	 * before the back-off). */
	uint64_t fb = 0;

	for (unsigned i = 0; i < r->job.next; i++)
		fb += r->wext[i].bytes;
	if (lim(t) && (rc = spill_charge(t, r->uid, fb, t->why, sizeof t->why))) {
		kvd_log(LOG_DEBUG, "sequence %016llx stays in RAM: %s", (unsigned long long)q->id,
			t->why);
		r->backoff_until = kvd_now_ns() + BACKOFF_NS;
		job_release(t, r);
		return rc;
	}
	r->spill_chg = lim(t) ? fb : 0;
	if ((rc = kvd_spill_submit(t->sp, &r->job))) {
		job_release(t, r);
		spill_unchg(t, r);
		return rc;
	}
	r->busy = 1;
	r->io_t0 = kvd_now_ns();
	r->evict_after = evict;
	q->state = KVD_SEQ_SPILLING;
	if (evict) {
		r->pend = kvd_store_seq_freeable(q) + r->wcopy;
		t->pending += r->pend;
	}
	kvd_log(LOG_DEBUG, "sequence %016llx: writing %zu bytes out%s", (unsigned long long)q->id,
		q->bytes, evict ? "" : " (it stays)");
	return 0;
}

int kvd_tier_write(struct kvd_tier *t, struct kvd_seqn *q)
{
	struct rec *r;

	if (!t->sp || !(t->cfg.persist || t->cfg.remote))
		return 0;
	if (!(r = rec_of(t, q)))
		return -ENOMEM;
	t->why[0] = 0;
	return write_out(t, r, 0);
}

void kvd_tier_on_written(struct kvd_tier *t,
			 void (*fn)(void *arg, struct kvd_seqn *q, const char *path), void *arg)
{
	t->on_written = fn;
	t->on_written_arg = arg;
}

const char *kvd_tier_spill_dir(const struct kvd_tier *t, unsigned *dir)
{
	*dir = 0;
	return t->sp ? kvd_spill_dir(t->sp, 0) : NULL;
}

void kvd_tier_on_pub(struct kvd_tier *t, void (*fn)(void *arg, struct kvd_seqn *q), void *arg)
{
	t->on_pub = fn;
	t->on_pub_arg = arg;
}

/* ---- copies in the remote tier ----------------------------------------- */

/* Where the spill engine keeps sequence id's file in directory dir. */
static void file_path(const struct kvd_tier *t, unsigned dir, uint64_t id, char *buf, size_t n)
{
	snprintf(buf, n, "%s/%016llx.kvs", kvd_spill_dir(t->sp, dir), (unsigned long long)id);
}

static void lose(struct kvd_tier *t, struct rec *r, const char *why);

/* A private sequence's keys: its uid's namespace, and (this lifetime, id),
 * so that no other daemon's or lifetime's sequence shares them. */
static void rem_key(const struct kvd_tier *t, const struct rec *r, char *ns, uint8_t *key)
{
	uint64_t id = r->q->id;

	snprintf(ns, KVD_REMOTE_NS_MAX, "u%u", r->uid);
	memcpy(key, &t->inst, 8);
	memcpy(key + 8, &id, 8);
}

static void rem_unchg(struct kvd_tier *t, struct rec *r)
{
	if (lim(t))
		kvd_limits_uncharge(lim(t), r->uid, KVD_RES_REMOTE, r->rem_chg);
	r->rem_chg = 0;
}

/* The copy replaces any older one under the same keys: charged as the new
 * file's bytes before it is queued; refused, it is not sent (the file
 * stays local only, and the old copy, if any, stays stale). */
static void rem_send(struct kvd_tier *t, struct rec *r)
{
	char ns[KVD_REMOTE_NS_MAX], path[4200], why[160];
	uint64_t old = r->rem_chg;
	uint8_t key[16];

	if (lim(t)) {
		rem_unchg(t, r);
		if (kvd_limits_charge(lim(t), r->uid, KVD_RES_REMOTE, r->disk_bytes, why,
				      sizeof why)) {
			kvd_log(LOG_DEBUG, "sequence %016llx: not sent to the remote tier: %s",
				(unsigned long long)r->q->id, why);
			if (!kvd_limits_force(lim(t), r->uid, KVD_RES_REMOTE, old))
				r->rem_chg = old;
			return;
		}
		r->rem_chg = r->disk_bytes;
	}
	rem_key(t, r, ns, key);
	file_path(t, r->dir, r->q->id, path, sizeof path);
	if (kvd_remote_put(t->rem, ns, key, 0, path,
			   KVD_REMOTE_FOR_TIER, r->q->id) == 0)
		r->rem_sent = 1;
}

/* The cluster's copy goes with the sequence (queued after any put of it:
 * the remote thread runs its jobs in order). */
static void rem_forget(struct kvd_tier *t, struct rec *r)
{
	char ns[KVD_REMOTE_NS_MAX];
	uint8_t key[16];

	if (!t->rem || !r->rem_sent || !r->q)
		return;
	rem_key(t, r, ns, key);
	if (kvd_remote_del(t->rem, ns, key))
		kvd_log(LOG_WARNING, "remote: the copy of sequence %016llx stays in the cluster "
			"(the queue is full)", (unsigned long long)r->q->id);
	r->rem_sent = r->rem_ok = 0;
	rem_unchg(t, r);
}

struct room_arg {
	struct kvd_tier *t;
	uint32_t uid;
	int any;                        /* any uid's files (a global limit) */
	uint64_t want, got;
};

static void drop_local(void *arg, struct kvd_seqn *q)
{
	struct room_arg *a = arg;
	struct rec *r = q->tier;

	if (a->got >= a->want || !r || q->state != KVD_SEQ_DISK || !r->has_file || r->busy ||
	    r->unl || !r->rem_ok || r->rem_gen != r->file_gen || (!a->any && r->uid != a->uid))
		return;
	/* The file stays described (ext) for the restore that fetches it. */
	a->got += r->spill_chg;
	unlink_file(a->t, r);
	spill_unchg(a->t, r);
	r->has_file = 0;
	r->rem_only = 1;
	a->t->rem_drops++;
	kvd_log(LOG_DEBUG, "sequence %016llx: its file lives in the remote tier only",
		(unsigned long long)q->id);
}

/* Spill room for `bytes` of uid's: the local files of sequences on disk
 * whose current file the cluster holds go (their uid's own first; any
 * uid's when `any`, a global limit).  Returns the bytes given back. */
static uint64_t rem_room(struct kvd_tier *t, uint32_t uid, uint64_t bytes, int any)
{
	struct room_arg a = { t, uid, 0, bytes, 0 };

	/* While the cluster fails, a local file is the only one that can be
	 * read: none goes. */
	if (!t->rem || t->rem_down_until > kvd_now_ns() ||
	    (t->dry && (t->dry_any || (t->dry_uid == uid && !any))))
		return 0;
	kvd_store_each(t->st, drop_local, &a);
	if (a.got < bytes && any) {
		a.any = 1;
		kvd_store_each(t->st, drop_local, &a);
	}
	if (!a.got) {
		t->dry = 1;
		t->dry_uid = uid;
		t->dry_any = any;
	}
	return a.got;
}

/* The spill charge of a file of uid's, making room from the remote tier
 * when refused. */
static int spill_charge(struct kvd_tier *t, uint32_t uid, uint64_t bytes, char *msg,
			size_t msglen)
{
	int rc = kvd_limits_charge(lim(t), uid, KVD_RES_SPILL, bytes, msg, msglen);

	if (rc && rem_room(t, uid, bytes, rc == -ENOSPC))
		rc = kvd_limits_charge(lim(t), uid, KVD_RES_SPILL, bytes, msg, msglen);
	return rc;
}

/* A DISK sequence whose file is only in the cluster: fetch it back into the
 * spill directory (-EINPROGRESS; the restore proper follows). */
static int rem_fetch(struct kvd_tier *t, struct rec *r, char *msg, size_t msglen)
{
	char ns[KVD_REMOTE_NS_MAX];
	uint8_t key[16];
	int rc;

	if (r->rem_getting || r->unl)
		return -EINPROGRESS;    /* the fetch, or the old file's unlink, runs */
	if (r->rem_fail_until > kvd_now_ns()) {
		snprintf(msg, msglen, "its file is in the remote tier, which failed (%s): try again",
			 r->why);
		return -EIO;
	}
	/* The file will exist: charged, over the limit if it must be (the
	 * restore needs it).  No other local file goes for it: the fetch may
	 * fail, and they would be gone for nothing; the next write-back that
	 * is refused makes the room. */
	if (lim(t) && kvd_limits_charge(lim(t), r->uid, KVD_RES_SPILL, r->rem_bytes, NULL, 0) &&
	    kvd_limits_force(lim(t), r->uid, KVD_RES_SPILL, r->rem_bytes))
		return -ENOMEM;
	r->spill_chg = lim(t) ? r->rem_bytes : 0;
	rem_key(t, r, ns, key);
	if ((rc = kvd_remote_get(t->rem, ns, key, 1, r->rem_bytes, KVD_REMOTE_FOR_TIER,
				 r->q->id))) {
		spill_unchg(t, r);
		snprintf(msg, msglen, "the remote tier is busy (%s): try again", kvd_strerror(rc));
		return -EBUSY;
	}
	r->rem_getting = 1;
	kvd_log(LOG_DEBUG, "sequence %016llx: fetching its file from the remote tier",
		(unsigned long long)r->q->id);
	return -EINPROGRESS;
}

static void forget_copy(void *arg, struct kvd_seqn *q)
{
	if (q->tier)
		rem_forget(arg, q->tier);
}

void kvd_tier_remote_forget_all(struct kvd_tier *t)
{
	if (t->rem)
		kvd_store_each(t->st, forget_copy, t);
}

void kvd_tier_set_remote(struct kvd_tier *t, struct kvd_remote *rem)
{
	t->rem = t->sp ? rem : NULL;
	if (t->rem && !t->inst) {
		struct timespec ts;

		clock_gettime(CLOCK_REALTIME, &ts);
		t->inst = kvd_mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
				    ((uint64_t)getpid() << 48) ^ (uint64_t)(uintptr_t)t);
	}
}

void kvd_tier_remote_done(struct kvd_tier *t, const struct kvd_remote_done *d)
{
	uint64_t id = d->cookie;
	struct kvd_seqn *q = kvd_store_seq_any(t->st, id);
	struct rec *r = q ? q->tier : NULL;

	if (d->op == KVD_REMOTE_PUT) {
		if (d->rc && d->rc != -ENOENT && d->rc != -ENOMEM)
			t->rem_down_until = kvd_now_ns() + BACKOFF_NS;
		if (!r || d->rc || d->seq != id) {
			kvd_log(LOG_DEBUG, "remote: the copy of %016llx did not go: %s",
				(unsigned long long)id,
				!r ? "freed" : d->rc ? (d->msg[0] ? d->msg : kvd_strerror(d->rc))
						     : "not its file");
			return;
		}
		t->rem_puts++;
		t->dry = 0;
		/* The copy is of the file the thread read, which may be older
		 * or newer than the one the record knows. */
		r->rem_ok = 1;
		r->rem_gen = d->gen;
		r->rem_bytes = d->bytes;
		return;
	}
	if (!r || !r->rem_getting) {
		/* Freed meanwhile: the fetched file is nobody's. */
		if (d->rc == 0) {
			char path[4200];

			file_path(t, d->dir, d->seq, path, sizeof path);
			unlink(path);
		}
		return;
	}
	r->rem_getting = 0;
	if ((d->rc == 0 || d->rc == -EEXIST) && d->seq == id) {
		/* Its extents are as they were written; the restore checks
		 * every one against seq and generation. */
		r->has_file = 1;
		r->rem_only = 0;
		r->dir = d->dir;
		r->disk_bytes = d->bytes;
		if (d->rc == 0)
			kvd_spill_disk_add(t->sp, d->bytes);
		t->rem_fetches++;
		t->dry = 0;
		return;
	}
	spill_unchg(t, r);
	if (d->rc != -ENOENT && d->rc != -KVD_EFORMAT && d->rc != -EFBIG && d->rc != 0 &&
	    d->rc != -EEXIST) {
		/* The cluster, not the copy: the sequence waits for it (each
		 * want in the meantime is refused at once, then tried again). */
		r->rem_fail_until = t->rem_down_until = kvd_now_ns() + BACKOFF_NS;
		snprintf(r->why, sizeof r->why, "%.90s", d->msg[0] ? d->msg : kvd_strerror(d->rc));
		kvd_log(LOG_WARNING, "sequence %016llx: its file could not be fetched from the remote "
			"tier: %s", (unsigned long long)id, r->why);
		return;
	}
	r->rem_only = 0;
	char why[96];

	snprintf(why, sizeof why, "its file in the remote tier: %.60s",
		 d->msg[0] ? d->msg : kvd_strerror(d->rc));
	lose(t, r, why);
}

static void write_done(struct kvd_tier *t, struct rec *r)
{
	struct kvd_seqn *q = r->q;
	struct kvd_spill_job *j = &r->job;
	uint64_t gen = j->gen;

	if (r->evict_after)
		t->pending -= r->pend;
	r->pend = 0;
	q->state = KVD_SEQ_RAM;
	if (j->res == 0) {
		r->has_file = 1;
		r->dir = j->wdir;
		r->file_gen = gen;
		r->disk_bytes = j->disk_bytes;
		free(r->ext);
		r->ext = r->wext;
		r->next_ext = j->next;
		r->wext = NULL;
	} else {
		spill_unchg(t, r);      /* no file */
	}
	count_io(t, KVD_TIER_WRITE,
		 j->res == 0 ? KVD_TIER_OK : j->res == -ECANCELED ? KVD_TIER_CANCELLED : KVD_TIER_ERROR,
		 j->disk_bytes, kvd_now_ns() - r->io_t0);
	if (j->res && j->res != -ECANCELED) {
		r->backoff_until = kvd_now_ns() + BACKOFF_NS;
		kvd_log(LOG_WARNING, "spill of sequence %016llx failed, it stays in RAM: %s",
			(unsigned long long)q->id, j->msg[0] ? j->msg : kvd_strerror(j->res));
	}
	int evict_now = r->evict_after && j->res == 0;

	kvd_log(LOG_DEBUG, "sequence %016llx: write %s (%d)", (unsigned long long)q->id,
		j->res ? "failed" : "done", j->res);

	r->evict_after = 0;
	job_release(t, r);
	if (r->has_file && r->file_gen != q->gen) {
		forget_file(t, r);      /* changed while being written */
		return;
	}
	if (j->res == 0 && t->rem && !kvd_store_seq_hidden(q) && !r->freeing)
		rem_send(t, r);
	if (j->res == 0 && t->on_written && kvd_store_seq_hidden(q) && !r->freeing) {
		char path[4200];

		file_path(t, r->dir, q->id, path, sizeof path);
		t->on_written(t->on_written_arg, q, path);
	}
	if (evict_now && !r->freeing) {
		drop(t, r);
		ADD(t->ctr.evict[1], 1);
	}
}

/* ---- restore ------------------------------------------------------------ */

/* The first layer the file has not delivered yet, once extents [0, i) are in. */
static uint32_t ready_after(const struct rec *r, unsigned i)
{
	for (; i < r->next_ext; i++)
		if (r->ext[i].kind == KVD_SFMT_LAYER || r->ext[i].kind == KVD_SFMT_SEG)
			return r->ext[i].layer;
	return r->q->p->layers;
}

static int start_restore(struct kvd_tier *t, struct rec *r, char *msg, size_t msglen)
{
	struct kvd_seqn *q = r->q;
	const struct kvd_geom *g = &q->p->g;
	uint64_t need = 0;
	int rc;

	/* The budget for the restore: every extent's buffer, and what
	 * installing a layer allocates besides (mean, tail, segment table). */
	for (unsigned i = 0; i < r->next_ext; i++) {
		const struct ext *e = &r->ext[i];
		uint32_t nseg = 0;

		need += e->bytes;
		if (e->kind != KVD_SFMT_LAYER)
			continue;
		for (unsigned k = i + 1; k < r->next_ext && r->ext[k].kind == KVD_SFMT_SEG &&
					 r->ext[k].layer == e->layer; k++)
			nseg++;
		need += kvd_store_install_bytes(q, !!(e->flags & KVD_SFMT_LF_MEAN), e->n, nseg);
	}
	if ((rc = kvd_tier_room_uid(t, r->uid, need, msg, msglen)))
		return rc;
	/* kvd_tier_room is the policy (evict, wait); the charge is the wall. */
	if (lim(t) && (rc = kvd_limits_charge(lim(t), r->uid, KVD_RES_MEMORY, need, msg, msglen)))
		return rc;
	r->reserved = need;
	t->reserved += need;
	if (job_alloc(r, r->next_ext))
		goto nomem;
	r->job.next = r->next_ext;
	for (unsigned i = 0; i < r->next_ext; i++) {
		size_t b = r->ext[i].bytes;

		if (r->ext[i].kind == KVD_SFMT_SEG) {
			r->buf[i].p = kvd_seg_io_alloc_node(g, r->ext[i].n,
							    kvd_store_mem_node(t->st, q), &b);
			if (r->buf[i].p && b != r->ext[i].bytes) {
				kvd_seg_io_free(r->buf[i].p, b);
				r->buf[i].p = NULL;
				snprintf(msg, msglen, "extent %u: %zu bytes, the file says %llu", i, b,
					 (unsigned long long)r->ext[i].bytes);
				r->mine[i] = 0;
				job_release(t, r);
				return -KVD_EFORMAT;
			}
		} else {
			r->buf[i].p = page_alloc(b);
		}
		r->buf[i].bytes = b;
		r->mine[i] = r->ext[i].kind == KVD_SFMT_SEG ? MINE_SEG : MINE_PAGE;
		if (!r->buf[i].p)
			goto nomem;
	}
	r->job = (struct kvd_spill_job){ .op = KVD_SPILL_READ, .seq = q->id, .gen = r->file_gen,
					 .dir = r->dir, .ext = r->buf, .next = r->next_ext,
					 .user = r };
	if ((rc = kvd_spill_submit(t->sp, &r->job))) {
		snprintf(msg, msglen, "cannot start the restore: %s", kvd_strerror(rc));
		job_release(t, r);
		return rc;
	}
	r->busy = 1;
	r->io_t0 = kvd_now_ns();
	q->state = KVD_SEQ_RESTORING;
	q->ready = ready_after(r, 0);
	kvd_log(LOG_DEBUG, "sequence %016llx: restoring %llu bytes", (unsigned long long)q->id,
		(unsigned long long)need);
	return 0;
nomem:
	job_release(t, r);
	snprintf(msg, msglen, "out of memory for the restore");
	return -ENOMEM;
}

static void lose(struct kvd_tier *t, struct rec *r, const char *why)
{
	struct kvd_seqn *q = r->q;

	kvd_store_seq_drop(t->st, q);
	q->state = KVD_SEQ_LOST;
	q->ready = 0;
	snprintf(r->why, sizeof r->why, "%s", why);
	ADD(t->ctr.lost, 1);
	kvd_log(LOG_ERR, "sequence %016llx lost: %s", (unsigned long long)q->id, why);
	rem_forget(t, r);
	r->rem_only = 0;
	forget_file(t, r);
}

/* Extent i of r's restore has been read and verified: put it in place. */
static int install(struct kvd_tier *t, struct rec *r, unsigned i)
{
	struct kvd_seqn *q = r->q;
	const struct kvd_geom *g = &q->p->g;
	const struct ext *e = &r->ext[i];
	const struct kvd_sfmt_hdr *h = r->buf[i].p;
	void *payload = (char *)r->buf[i].p + PAGE;
	int rc = 0;

	/* The header was checked against seq, gen and index; its fields must
	 * also be what this sequence expects. */
	if (h->kind != e->kind || h->layer != e->layer || h->n != e->n ||
	    h->kv_heads != g->kv_heads || h->d != g->d || h->K != g->K || h->L != g->L ||
	    (h->kind == KVD_SFMT_SEG && kvd_sfmt_seg_dtype(h) != g->kv_dtype))
		return -KVD_EFORMAT;
	switch (e->kind) {
	case KVD_SFMT_PROFILE:
		if (h->profile_fp != kvd_sfmt_profile_fp(q->p))
			return -KVD_EFORMAT;
		break;
	case KVD_SFMT_LAYER: {
		float *m;
		uint16_t *k, *v, *c;

		if (e->layer >= q->p->layers || q->p->dense[e->layer])
			return -KVD_EFORMAT;
		kvd_sfmt_layer_parts(g, e->n, !!(h->flags & KVD_SFMT_LF_MEAN), payload, &m, &k, &v, &c);
		rc = kvd_store_install_layer(t->st, q, e->layer, m, !!(h->flags & KVD_SFMT_LF_SEALED),
					     h->tok_end, k, v, c, e->n);
		break;
	}
	case KVD_SFMT_SEG: {
		struct kvd_seg *sg;

		if (e->layer >= q->p->layers || q->p->dense[e->layer])
			return -KVD_EFORMAT;
		rc = kvd_seg_adopt(g, e->n, r->buf[i].p, r->buf[i].bytes, &sg);
		if (rc)
			return rc;
		r->mine[i] = 0;         /* the segment owns it now */
		if ((rc = kvd_store_install_seg(t->st, q, e->layer, sg))) {
			kvd_seg_free(sg);
			return rc;
		}
		break;
	}
	case KVD_SFMT_LOCAL: {
		uint64_t half = kvd_sfmt_local_bytes(g, e->n) / 2;

		if (e->layer >= q->p->layers)
			return -KVD_EFORMAT;
		rc = kvd_store_install_local(t->st, q, e->layer, payload,
					     (const uint16_t *)((char *)payload + half), e->n);
		break;
	}
	case KVD_SFMT_END:
		break;
	}
	return rc;
}

static void read_progress(struct kvd_tier *t, struct rec *r, unsigned i)
{
	int rc;

	if (r->freeing || r->q->state != KVD_SEQ_RESTORING)
		return;
	size_t before = r->q->bytes;

	rc = install(t, r, i);
	/* What the store now holds moves out of the reservation: the store
	 * charged it (unchecked), the reservation gives it back. */
	uint64_t moved = r->q->bytes > before ? r->q->bytes - before : 0;

	if (moved > r->reserved)
		moved = r->reserved;
	r->reserved -= moved;
	t->reserved -= moved;
	if (lim(t))
		kvd_limits_uncharge(lim(t), r->uid, KVD_RES_MEMORY, moved);
	if (rc) {
		char why[96];

		snprintf(why, sizeof why, "extent %u does not fit the sequence: %s", i,
			 kvd_strerror(rc));
		lose(t, r, why);
		kvd_spill_cancel(t->sp, &r->job);
		return;
	}
	r->q->ready = ready_after(r, i + 1);
}

static void read_done(struct kvd_tier *t, struct rec *r)
{
	struct kvd_seqn *q = r->q;
	struct kvd_spill_job *j = &r->job;

	kvd_log(LOG_DEBUG, "sequence %016llx: restore %s (%d, %u of %u extents)",
		(unsigned long long)q->id, j->res ? "failed" : "done", j->res, j->done, j->next);
	int how = KVD_TIER_OK;

	if (r->freeing || (q->state != KVD_SEQ_RESTORING && q->state != KVD_SEQ_LOST))
		how = KVD_TIER_CANCELLED;
	else if (q->state == KVD_SEQ_LOST || j->res || j->done != j->next)
		how = KVD_TIER_ERROR;
	count_io(t, KVD_TIER_READ, how, r->disk_bytes, kvd_now_ns() - r->io_t0);
	if (q->state == KVD_SEQ_RESTORING) {
		if (j->res == 0 && j->done == j->next) {
			q->state = KVD_SEQ_RAM;
			q->ready = q->p->layers;
			t->restores++;
			t->restore_bytes += r->disk_bytes;
			lru_use(t, r);
		} else if (!r->freeing) {
			char why[128];

			snprintf(why, sizeof why, "restore failed: %s",
				 j->msg[0] ? j->msg : kvd_strerror(j->res ? j->res : -EIO));
			lose(t, r, why);
		}
	}
	job_release(t, r);
	if (r->has_file && r->file_gen != q->gen)
		forget_file(t, r);
}

/* ---- the API ------------------------------------------------------------ */

/* The store asks before rows that need room (see kvd_store_set_room). */
static int room_cb(void *arg, uint32_t uid, uint64_t bytes, char *msg, size_t msglen)
{
	return kvd_tier_room_uid(arg, uid, bytes, msg, msglen);
}

int kvd_tier_create(const struct kvd_tier_cfg *cfg, struct kvd_store *st, struct kvd_tier **out)
{
	struct kvd_tier *t = calloc(1, sizeof *t);
	int rc;

	if (!t)
		return -ENOMEM;
	t->cfg = *cfg;
	if (!t->cfg.poll_ns)
		t->cfg.poll_ns = POLL_NS;
	t->st = st;
	if ((rc = kvd_store_set_seq_extra(st, sizeof(struct rec))) ||
	    (cfg->spill && (rc = kvd_spill_create(&t->cfg.io, &t->sp)))) {
		free(t);
		return rc;
	}
	kvd_store_set_room(st, room_cb, t);
	*out = t;
	return 0;
}

static void free_all(void *arg, struct kvd_seqn *q)
{
	struct kvd_tier *t = arg;
	struct rec *r = q->tier;

	if (!r)
		return;
	if (r->busy)
		job_release(t, r);
	if (r->freeing) {
		r->q = NULL;
		kvd_store_seq_free(t->st, q);
	} else {
		r->q->tier = NULL;
		r->q = NULL;
	}
	spill_unchg(t, r);
	rem_unchg(t, r);
	lru_del(t, r);
	free(r->ext);
	free(r);
}

void kvd_tier_destroy(struct kvd_tier *t)
{
	if (!t)
		return;
	/* After destroy no SQE references anything: the buffers are ours. */
	if (t->sp)
		kvd_spill_destroy(t->sp);
	t->sp = NULL;
	while (t->unls)
		unl_done(t, t->unls);
	kvd_store_each(t->st, free_all, t);
	kvd_store_set_room(t->st, NULL, NULL);
	if (t->cfg.spill && !t->cfg.persist) {
		/* Nothing outlives kvd without persist: empty the directories
		 * now rather than at the next start. */
		struct kvd_spill *sp;

		if (!kvd_spill_create(&t->cfg.io, &sp)) {
			kvd_spill_scan(sp, 0, NULL, NULL);
			kvd_spill_destroy(sp);
		}
	}
	free(t);
}

int kvd_tier_fd(const struct kvd_tier *t)
{
	return t->sp ? kvd_spill_fd(t->sp) : -1;
}

void kvd_tier_begin(struct kvd_tier *t)
{
	t->epoch++;
}

/* Whether r may be written out now for the current request: not a
 * sequence the request itself uses (epoch), nor one whose I/O is in flight
 * or whose write failed a moment ago, and never one a running unit is
 * changing.  Requests run between the slices of another's seal: the seal's
 * sequence is in the LRU under an older epoch, and writing it out there
 * captured half a change under a generation that counted as current.  A
 * pinned one sets *pinned: the room comes when its unit ends. */
static int victim(struct kvd_tier *t, const struct rec *r, uint64_t now, int *pinned)
{
	if (r->epoch == t->epoch || r->busy || r->backoff_until > now)
		return 0;
	if (kvd_store_seq_pinned(r->q)) {
		*pinned = 1;
		return 0;
	}
	return 1;
}

int kvd_tier_take_pin_waits(struct kvd_tier *t)
{
	int w = t->pin_wait;

	t->pin_wait = 0;
	return w;
}

int kvd_tier_room(struct kvd_tier *t, uint64_t bytes, char *msg, size_t msglen)
{
	uint64_t u = used(t);

	if (!t->cfg.limit || u + bytes <= t->cfg.limit)
		return 0;
	if (t->sp) {
		uint64_t now = kvd_now_ns();
		int later = 0, pinned = 0;

		for (struct rec *r = t->head, *nx; r && u + bytes > t->cfg.limit + t->pending; r = nx) {
			int rc;

			nx = r->next;
			if (!victim(t, r, now, &pinned))
				continue;
			rc = evict(t, r);
			if (rc == 0)
				u = used(t);
			later |= rc == -EAGAIN;
		}
		u = used(t);
		if (u + bytes <= t->cfg.limit)
			return 0;
		t->pin_wait |= pinned;
		if (later || pinned || (t->pending && u + bytes <= t->cfg.limit + t->pending)) {
			kvd_log(LOG_DEBUG, "room for %llu bytes: waiting for %llu being written out",
				(unsigned long long)bytes, (unsigned long long)t->pending);
			return -EINPROGRESS;
		}
	}
	/* Published snapshots are a cache: they give way before a refusal. */
	if (kvd_store_reclaim(t->st, 0, 1, u + bytes - t->cfg.limit) &&
	    (u = used(t)) + bytes <= t->cfg.limit)
		return 0;
	snprintf(msg, msglen, "memory budget: %llu MiB in use, %llu MiB more needed, limit %llu MiB",
		 (unsigned long long)(u >> 20), (unsigned long long)((bytes + (1 << 20) - 1) >> 20),
		 (unsigned long long)(t->cfg.limit >> 20));
	return -ENOMEM;
}

static uint64_t uid_mem(const struct kvd_tier *t, uint32_t uid)
{
	struct kvd_limits_usage u;

	kvd_limits_uid_usage(lim(t), uid, &u);
	return u.n[KVD_RES_MEMORY];
}

int kvd_tier_room_uid(struct kvd_tier *t, uint32_t uid, uint64_t bytes, char *msg,
		      size_t msglen)
{
	uint64_t cap = lim(t) ? kvd_limits_cfg(lim(t))->per_uid[KVD_RES_MEMORY] : 0;
	uint64_t pend = 0, now = kvd_now_ns();
	int later = 0, pinned = 0;

	if (!cap || !t->sp || uid_mem(t, uid) + bytes <= cap)
		return kvd_tier_room(t, bytes, msg, msglen);
	for (struct rec *r = t->head, *nx; r; r = nx) {
		int rc;

		nx = r->next;
		if (r->uid != uid)
			continue;
		if (r->evict_after) {           /* being written out already */
			pend += r->pend;
			continue;
		}
		if (uid_mem(t, uid) + bytes <= cap + pend)
			break;
		if (!victim(t, r, now, &pinned))
			continue;
		rc = evict(t, r);
		later |= rc == -EAGAIN;
		if (rc == 0 && r->evict_after)
			pend += r->pend;
	}
	if (uid_mem(t, uid) + bytes > cap && pinned)
		t->pin_wait = 1;
	if (uid_mem(t, uid) + bytes > cap &&
	    (later || pinned || uid_mem(t, uid) + bytes <= cap + pend)) {
		kvd_log(LOG_DEBUG, "uid %u: room for %llu bytes under memory_per_uid: waiting for "
			"%llu being written out", uid, (unsigned long long)bytes,
			(unsigned long long)pend);
		return -EINPROGRESS;
	}
	return kvd_tier_room(t, bytes, msg, msglen);
}

int kvd_tier_want(struct kvd_tier *t, struct kvd_seqn *q, uint32_t layer, char *msg,
		  size_t msglen)
{
	struct rec *r = rec_of(t, q);
	int rc;

	if (!r) {
		snprintf(msg, msglen, "out of memory");
		return -ENOMEM;
	}
	switch (q->state) {
	case KVD_SEQ_RAM:
	case KVD_SEQ_SPILLING:
		lru_use(t, r);
		return 0;
	case KVD_SEQ_LOST:
		snprintf(msg, msglen, "sequence lost, prefill again (%s)", r->why);
		return -KVD_ELOST;
	case KVD_SEQ_DISK:
		r->epoch = t->epoch;
		if (r->rem_only)
			return rem_fetch(t, r, msg, msglen);
		if ((rc = start_restore(t, r, msg, msglen)))
			return rc;
		break;
	case KVD_SEQ_RESTORING:
		r->epoch = t->epoch;
		break;
	}
	return layer != UINT32_MAX && layer < q->ready ? 0 : -EINPROGRESS;
}

void kvd_tier_changed(struct kvd_tier *t, struct kvd_seqn *q)
{
	struct rec *r = q->tier;

	if (r && r->has_file && r->file_gen != q->gen && !r->busy)
		forget_file(t, r);
}

int kvd_tier_prefetch(struct kvd_tier *t, struct kvd_seqn *q, char *msg, size_t msglen)
{
	int rc = kvd_tier_want(t, q, UINT32_MAX, msg, msglen);

	return rc == -EINPROGRESS ? 0 : rc;
}

int kvd_tier_evict(struct kvd_tier *t, struct kvd_seqn *q, char *msg, size_t msglen)
{
	struct rec *r = rec_of(t, q);
	int rc;

	if (!t->sp) {
		snprintf(msg, msglen, "no spill directory configured");
		return -EOPNOTSUPP;
	}
	if (!r)
		return -ENOMEM;
	if (q->state == KVD_SEQ_DISK)
		return 0;
	if (q->state == KVD_SEQ_LOST) {
		snprintf(msg, msglen, "sequence lost, prefill again (%s)", r->why);
		return -KVD_ELOST;
	}
	if (q->state == KVD_SEQ_RESTORING) {
		snprintf(msg, msglen, "sequence is being restored");
		return -EBUSY;
	}
	t->why[0] = 0;
	rc = evict(t, r);
	if (rc == -EAGAIN)
		rc = evict(t, r);       /* only if the unlink already ended: else say so */
	if (rc && t->why[0])
		snprintf(msg, msglen, "%s", t->why);
	else if (rc == -EAGAIN)
		snprintf(msg, msglen, "its stale file is being deleted: try again");
	else if (rc == -EBUSY && kvd_store_seq_pinned(q))
		snprintf(msg, msglen, "a request is changing it: try again");
	else if (rc == -EBUSY)
		snprintf(msg, msglen, "a layer's prefill is in progress: finish it first");
	else if (rc)
		snprintf(msg, msglen, "cannot start the write: %s", kvd_strerror(rc));
	return rc;
}

void kvd_tier_free(struct kvd_tier *t, struct kvd_seqn *q)
{
	struct rec *r = q->tier;

	if (r && r->busy) {
		/* The engine may still have SQEs on our buffers: hide the
		 * sequence now, free it when the job has ended. */
		if (!r->freeing) {
			r->freeing = 1;
			q->tenant[0] = 0;
			q->owner = 0;
			lru_del(t, r);
			kvd_spill_cancel(t->sp, &r->job);
		}
		return;
	}
	if (r) {
		rem_forget(t, r);
		forget_file(t, r);
		rec_free(t, r);
	}
	kvd_store_seq_free(t->st, q);
}

struct owner_arg {
	struct kvd_tier *t;
	uint64_t owner;
	unsigned n;
};

static void free_if_owner(void *arg, struct kvd_seqn *q)
{
	struct owner_arg *a = arg;

	if (q->owner == a->owner && q->tenant[0]) {
		kvd_tier_free(a->t, q);
		a->n++;
	}
}

unsigned kvd_tier_free_owner(struct kvd_tier *t, uint64_t owner)
{
	struct owner_arg a = { t, owner, 0 };

	kvd_store_each(t->st, free_if_owner, &a);
	return a.n;
}

void kvd_tier_stopping(struct kvd_tier *t)
{
	t->stopping = 1;
}

unsigned kvd_tier_poll(struct kvd_tier *t)
{
	struct kvd_spill_result res[POLL_BATCH];
	unsigned n, total = 0;
	uint64_t t0 = kvd_now_ns();

	if (!t->sp)
		return 0;
	/* Installing a restored extent checks and copies it, under the state
	 * lock: a whole restore at once held every client up for tens of ms.
	 * What is left after the budget stays queued, and the fd readable;
	 * one batch is always taken, so every call makes progress. */
	while ((!total || kvd_now_ns() - t0 < t->cfg.poll_ns) &&
	       (n = kvd_spill_reap(t->sp, res, POLL_BATCH)) > 0) {
		total += n;
		for (unsigned i = 0; i < n; i++) {
			struct kvd_spill_job *j = res[i].job;
			struct rec *r = j->user;

			if (!r) {               /* an unlink */
				struct unl *u = (struct unl *)j;

				if (res[i].final)
					unl_done(t, u);
				continue;
			}
			if (!res[i].final) {
				read_progress(t, r, res[i].ext);
				continue;
			}
			if (j->op == KVD_SPILL_WRITE)
				write_done(t, r);
			else
				read_done(t, r);
			if (r->freeing) {
				struct kvd_seqn *q = r->q;

				rem_forget(t, r);
				forget_file(t, r);
				rec_free(t, r);
				kvd_store_seq_free(t->st, q);
			}
		}
	}
	return total;
}

void kvd_tier_balance(struct kvd_tier *t)
{
	uint64_t now;

	if (!t->sp || !t->cfg.limit || used(t) <= t->cfg.high)
		return;
	now = kvd_now_ns();
	for (struct rec *r = t->head, *nx; r; r = nx) {
		uint64_t u = used(t);
		int pinned = 0;

		nx = r->next;
		if (u <= t->cfg.low + t->pending)
			break;
		if (!victim(t, r, now, &pinned))
			continue;
		evict(t, r);
	}
}

struct count_arg {
	uint32_t on_disk, rem_only;
	uint64_t disk;
};

static void count_disk(void *arg, struct kvd_seqn *q)
{
	struct count_arg *a = arg;
	const struct rec *r = q->tier;

	a->on_disk += q->state == KVD_SEQ_DISK;
	a->rem_only += r && r->rem_only;
	if (r && r->has_file)
		a->disk += r->disk_bytes;
}

void kvd_tier_stats(const struct kvd_tier *t, struct kvd_tier_stats *st)
{
	struct count_arg a = { 0, 0, 0 };

	memset(st, 0, sizeof *st);
	st->limit = t->cfg.limit;
	st->high = t->cfg.high;
	st->low = t->cfg.low;
	st->used = used(t);
	st->reserved = t->reserved;
	st->spills = GET(t->ctr.io_n[KVD_TIER_WRITE][KVD_TIER_OK]);
	st->drops = GET(t->ctr.evict[0]);
	st->spill_errors = GET(t->ctr.io_n[KVD_TIER_WRITE][KVD_TIER_ERROR]);
	st->lost = GET(t->ctr.lost);
	st->spill_bytes = GET(t->ctr.io_bytes[KVD_TIER_WRITE]);
	/* Not from ctr: a restore that lands while its sequence is being freed
	 * counts here, and as cancelled there. */
	st->restores = t->restores;
	st->restore_bytes = t->restore_bytes;
	st->rem_puts = t->rem_puts;
	st->rem_drops = t->rem_drops;
	st->rem_fetches = t->rem_fetches;
	kvd_store_each(t->st, count_disk, &a);
	st->on_disk = a.on_disk;
	st->rem_only = a.rem_only;
	st->disk_bytes = t->sp ? kvd_spill_disk_bytes(t->sp) : 0;
}

const struct kvd_tier_counters *kvd_tier_counters(const struct kvd_tier *t)
{
	return &t->ctr;
}

void kvd_tier_seq_info(const struct kvd_tier *t, const struct kvd_seqn *q, int *durable,
		       uint64_t *disk_bytes)
{
	const struct rec *r = q->tier;

	*durable = r && clean(r);
	*disk_bytes = r && r->has_file ? r->disk_bytes : 0;
}

/* ---- start-up ----------------------------------------------------------- */

static int load_one(void *arg, unsigned dir, const struct kvd_sfmt_hdr *hdr, unsigned n,
		    const void *profile, uint64_t profile_bytes, uint64_t disk_bytes)
{
	struct kvd_tier *t = arg;
	struct kvd_profile want;
	const struct kvd_profile *p;
	struct kvd_seqn *q;
	struct rec *r;
	char msg[160];
	int rc;

	if (kvd_sfmt_profile_get(profile, profile_bytes, &want, msg, sizeof msg)) {
		kvd_log(LOG_WARNING, "spill file of %016llx: bad profile: %s",
			(unsigned long long)hdr[0].seq, msg);
		return -KVD_EFORMAT;    /* quarantined: the file is bad */
	}
	/* With limits, the profile is made in the namespace of the uid in the
	 * file's tenant and charged to it; the reference taken here is
	 * dropped once the sequence holds its own. */
	const char *tenant = t->adopt_tenant ? t->adopt_tenant : hdr[0].tenant;
	uint32_t uid = kvd_store_tenant_uid(tenant);

	msg[0] = 0;
	if (lim(t))
		rc = kvd_store_profile_ns(t->st, kvd_limits_namespace(lim(t), uid), uid, &want, &p, msg,
					  sizeof msg);
	else
		rc = kvd_store_profile(t->st, &want, &p);
	free(want.dense);
	free(want.W);
	if (!rc && kvd_sfmt_profile_fp(p) != hdr[0].profile_fp) {
		if (lim(t))
			kvd_store_profile_unref(t->st, p);
		rc = -KVD_EFORMAT;
		snprintf(msg, sizeof msg, "does not match its fingerprint");
	}
	if (rc) {
		kvd_log(LOG_WARNING, "spill file of %016llx: profile '%s': %s",
			(unsigned long long)hdr[0].seq, want.name,
			msg[0] ? msg : rc == -EEXIST ? "conflicts with another of that name"
						     : kvd_strerror(rc));
		/* A file that does not fit (a fingerprint, a name taken with other
		 * fields) is set aside; one refused for memory or a limit stays for
		 * the next start. */
		return rc == -KVD_EFORMAT || rc == -EEXIST ? -KVD_EFORMAT : rc;
	}
	rc = kvd_store_seq_adopt(t->st, p, tenant, hdr[0].seq, 0, &q);
	if (lim(t))
		kvd_store_profile_unref(t->st, p);
	if (rc) {
		kvd_log(LOG_WARNING, "spill file of %016llx: %s", (unsigned long long)hdr[0].seq,
			rc == -EEXIST ? "that sequence is already loaded" : kvd_strerror(rc));
		return rc == -EEXIST ? -KVD_EFORMAT : rc;
	}
	if (!(r = rec_of(t, q)) || !(r->ext = calloc(n, sizeof *r->ext))) {
		if (r)
			rec_free(t, r);
		kvd_store_seq_free(t->st, q);
		return -ENOMEM;         /* left in place: next start tries again */
	}
	uint32_t last = 0;

	for (unsigned i = 0; i < n; i++) {
		const struct kvd_sfmt_hdr *h = &hdr[i];
		int data = h->kind == KVD_SFMT_LAYER || h->kind == KVD_SFMT_SEG;

		r->ext[i] = (struct ext){ h->kind, h->layer, h->n, h->flags, h->extent_bytes,
					  h->tok_begin, h->tok_end };
		if (data && (h->layer >= p->layers || p->dense[h->layer] || h->layer < last)) {
			kvd_log(LOG_WARNING, "spill file of %016llx: extent %u names layer %u out of order",
				(unsigned long long)hdr[0].seq, i, h->layer);
			rec_free(t, r);
			kvd_store_seq_free(t->st, q);
			return -KVD_EFORMAT;
		}
		if (data)
			last = h->layer;
		if (h->kind == KVD_SFMT_PUB) {
			uint8_t key[16];

			kvd_sfmt_pub_key(h, key);
			kvd_store_seq_hide(q, key, h->n);
		}
		if (h->kind == KVD_SFMT_LOCAL && h->layer >= p->layers) {
			kvd_log(LOG_WARNING, "spill file of %016llx: LOCAL extent %u names layer %u of %u",
				(unsigned long long)hdr[0].seq, i, h->layer, p->layers);
			rec_free(t, r);
			kvd_store_seq_free(t->st, q);
			return -KVD_EFORMAT;
		}
		if (h->kind == KVD_SFMT_LAYER) {
			q->ly[h->layer].tokens = h->tok_end;
			q->ly[h->layer].sealed = !!(h->flags & KVD_SFMT_LF_SEALED);
		}
	}
	r->next_ext = n;
	r->has_file = 1;
	r->dir = dir;
	r->file_gen = hdr[0].gen;
	r->disk_bytes = disk_bytes;
	/* The file exists: accounted to its uid even above spill_per_uid
	 * (which then holds back that uid's next spills). */
	if (lim(t) && !kvd_limits_force(lim(t), r->uid, KVD_RES_SPILL, disk_bytes))
		r->spill_chg = disk_bytes;
	q->gen = hdr[0].gen;
	q->state = KVD_SEQ_DISK;
	if (kvd_store_seq_hidden(q) && t->on_pub)
		t->on_pub(t->on_pub_arg, q);
	return 0;
}

int kvd_tier_adopt(struct kvd_tier *t, unsigned dir, uint64_t seq, const char *tenant)
{
	int rc;

	if (!t->sp)
		return -ENOENT;
	t->adopt_tenant = tenant;
	rc = kvd_spill_scan_one(t->sp, dir, seq, load_one, t);
	t->adopt_tenant = NULL;
	return rc;
}

int kvd_tier_load(struct kvd_tier *t)
{
	if (!t->sp)
		return 0;
	return kvd_spill_scan(t->sp, t->cfg.persist, t->cfg.persist ? load_one : NULL, t);
}
