/* kvd_tier's mechanics: a write-back's extents, a restore's installed,
 * unlinks, job buffers, the counters.  See tier_int.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/clock.h"
#include "engine/err.h"
#include "engine/invariant.h"
#include "engine/mem.h"
#include "tier_int.h"

/* ---- the counters ------------------------------------------------------- */

const double kvd_tier_io_le[KVD_TIER_IO_LE] = { 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
						250e-3, 500e-3, 1, 2.5, 5, 10, 30, 60 };

/* A write-back or restore ended (KVD_TIER_WRITE or _READ): how, the bytes it
 * moved when it succeeded, the time since its submission. */
void kvd_tier_count_io(struct kvd_tier *t, int kind, int how, uint64_t bytes, uint64_t ns)
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

/* ---- unlinks ------------------------------------------------------------ */

void kvd_tier_unlink_file(struct kvd_tier *t, struct rec *r)
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

void kvd_tier_unl_done(struct kvd_tier *t, struct unl *u)
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

/* ---- buffers of a job --------------------------------------------------- */

/* From 2 MiB up a mapping of its own (kvd_mem): freed, it is unmapped
 * behind the caller, not by free() under the state lock, where returning
 * a 97 MB tail's file buffer to the kernel took 10 ms. */
void *kvd_tier_page_alloc(uint64_t bytes)
{
	void *p = NULL;

	if (bytes >= KVD_MEM_HUGE)
		return kvd_mem_alloc(bytes);
	return posix_memalign(&p, PAGE, bytes) ? NULL : p;
}

void kvd_tier_page_free(void *p, uint64_t bytes)
{
	if (bytes >= KVD_MEM_HUGE)
		kvd_mem_free(p, bytes);
	else
		free(p);
}

/* A LAYER extent's tail rows, copied into the file on the spill thread from
 * a tail the write holds (kvd_store_tail_hold): the rows stay as they are
 * while it is held, so the state lock pays for no tail copy.  Its header
 * page and mean go the same way, from a small copy made under the lock
 * (the engine copies the header, struct kvd_spill_buf's hdr): the file
 * buffer is fresh memory in huge pages, and touching its first page under
 * the lock cost a SeqEvict of 8 layers ~30 ms of page clearing on a VM
 * whose freed pages the host takes back. */
struct wfill {
	struct kvd_tail *tail;          /* NULL: nothing to fill */
	const struct kvd_geom *g;
	uint32_t n, cap;                /* rows to copy, rows the tail holds */
	int mean;
	uint64_t bytes;                 /* the payload's, padding included */
	char *head;                     /* the header page, then the mean */
	size_t head_bytes;
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
	memcpy(payload, w->head + PAGE, w->head_bytes - PAGE);     /* the mean */
	memset(k, 0, w->bytes - (size_t)((char *)k - (char *)payload));
	for (size_t hh = 0; hh < g->kv_heads; hh++) {
		memcpy((char *)k + hh * rowb, tk + hh * w->cap * g->d, rowb);
		memcpy((char *)v + hh * rowb, tv + hh * w->cap * g->d, rowb);
		for (size_t tb = 0; tb < g->L; tb++)
			memcpy(c + (hh * g->L + tb) * w->n, tc + (hh * g->L + tb) * w->cap,
			       (size_t)w->n * 2);
	}
}

/* A LAYER extent's tail rows, copied on the spill thread into a tail made
 * before the read (kvd_store_rtail_new) as soon as the extent verifies;
 * the install takes the tail over.  As on the way out (fill_layer), the
 * state lock pays for no tail copy, nor for the tail's fresh pages. */
struct rfill {
	const struct kvd_profile *p;
	struct kvd_tail *tail;          /* LAYER: NULL once installed */
	float *vsum;                    /* SEG: [kv_heads][d], kvd_seg_sums of the payload */
	uint32_t layer, n;
	int filled;                     /* set on the spill thread before its progress
					 * result, read after that result is reaped */
};

static void drain_layer(void *arg, void *page)
{
	struct rfill *f = arg;
	const struct kvd_sfmt_hdr *h = page;
	const struct kvd_geom *g = &f->p->g;
	float *m;
	uint16_t *k, *v, *c;

	/* The engine checked the CRC and that the extent is the file's i-th,
	 * not that it is what this sequence expects: kvd_tier_install checks
	 * all of it again; this is what the copy needs to stay in bounds. */
	if (h->kind != KVD_SFMT_LAYER || h->layer != f->layer || h->n != f->n ||
	    h->kv_heads != g->kv_heads || h->d != g->d || h->K != g->K || h->L != g->L ||
	    f->n > f->p->seal_tokens)
		return;
	kvd_sfmt_layer_parts(g, f->n, !!(h->flags & KVD_SFMT_LF_MEAN), (char *)page + PAGE, &m,
			     &k, &v, &c);
	kvd_store_rtail_fill(f->p, f->tail, k, v, c, f->n);
	f->filled = 1;
}

/* A SEG extent's sums (kvd_seg_sums: V sums, moments), made here on the
 * spill thread: a pass over the segment's rows, which the install would
 * otherwise make under the daemon's lock. */
static void drain_seg(void *arg, void *page)
{
	struct rfill *f = arg;
	const struct kvd_sfmt_hdr *h = page;
	const struct kvd_geom *g = &f->p->g;

	/* kvd_sfmt_check_payload passed the payload for the header's own
	 * geometry; the install refuses one that is not the profile's. */
	if (h->kind != KVD_SFMT_SEG || h->layer != f->layer || h->n != f->n ||
	    h->kv_heads != g->kv_heads || h->d != g->d || h->K != g->K || h->L != g->L ||
	    kvd_sfmt_seg_dtype(h) != g->kv_dtype)
		return;
	f->filled = kvd_seg_sums(g, f->n, page, f->vsum) == 0;
}

static int read_seg(struct rec *r, unsigned i)
{
	const struct kvd_profile *p = r->q->p;
	const struct ext *e = &r->ext[i];

	/* A few KiB a segment, freed at the install: under what the restore
	 * reserved for the segments themselves. */
	r->rfill[i] = (struct rfill){ .p = p, .layer = e->layer, .n = e->n,
				      .vsum = malloc((size_t)p->g.kv_heads * p->g.d * sizeof(float)) };
	if (!r->rfill[i].vsum)
		return -ENOMEM;
	r->buf[i].drain = drain_seg;
	r->buf[i].fill_arg = &r->rfill[i];
	return 0;
}

int kvd_tier_read_prep(struct kvd_tier *t, struct rec *r, unsigned i)
{
	const struct kvd_profile *p = r->q->p;
	const struct ext *e = &r->ext[i];

	if ((e->kind != KVD_SFMT_LAYER && e->kind != KVD_SFMT_SEG) || !e->n ||
	    e->layer >= p->layers || p->dense[e->layer])
		return 0;               /* nothing to prepare, or what the install refuses */
	if (!r->rfill && !(r->rfill = calloc(r->next_ext, sizeof *r->rfill)))
		return -ENOMEM;
	if (e->kind == KVD_SFMT_SEG)
		return read_seg(r, i);
	if (e->n > p->seal_tokens)
		return 0;
	r->rfill[i] = (struct rfill){ .p = p, .tail = kvd_store_rtail_new(t->st, r->q),
				      .layer = e->layer, .n = e->n };
	if (!r->rfill[i].tail)
		return -ENOMEM;
	r->buf[i].drain = drain_layer;
	r->buf[i].fill_arg = &r->rfill[i];
	return 0;
}

void kvd_tier_job_release(struct kvd_tier *t, struct rec *r)
{
	for (unsigned i = 0; r->rfill && i < r->job.next; i++) {
		kvd_store_rtail_free(r->q->p, r->rfill[i].tail);
		free(r->rfill[i].vsum);
	}
	free(r->rfill);
	r->rfill = NULL;
	for (unsigned i = 0; r->wfill && i < r->job.next; i++) {
		kvd_store_tail_drop(t->st, r->q->p, r->wfill[i].tail);
		free(r->wfill[i].head);
	}
	free(r->wfill);
	r->wfill = NULL;
	for (unsigned i = 0; r->buf && r->mine && i < r->job.next; i++) {
		if (!r->mine[i] || !r->buf[i].p)
			continue;
		if (r->mine[i] == MINE_SEG)     /* an io buffer, longer than its extent */
			kvd_seg_io_free(r->buf[i].p, r->iob[i]);
		else
			kvd_tier_page_free(r->buf[i].p, r->buf[i].bytes);
	}
	for (unsigned i = 0; i < r->nwseg; i++)
		r->wseg[i]->wbusy = 0;
	free(r->wseg);
	r->wseg = NULL;
	r->nwseg = 0;
	free(r->buf);
	free(r->mine);
	free(r->iob);
	free(r->wext);
	r->buf = NULL;
	r->mine = NULL;
	r->iob = NULL;
	r->wext = NULL;
	t->reserved -= r->reserved;
	if (r->rhold) {
		r->rhold = 0;
		*(r->rprev ? &r->rprev->rnext : &t->rlist) = r->rnext;
		if (r->rnext)
			r->rnext->rprev = r->rprev;
		r->rprev = r->rnext = NULL;
	}
	if (lim(t))
		kvd_limits_uncharge(lim(t), r->uid, KVD_RES_MEMORY, r->reserved + r->wcopy);
	r->reserved = 0;
	r->wcopy = 0;
	r->busy = 0;
	memset(&r->job, 0, sizeof r->job);
}

int kvd_tier_job_alloc(struct rec *r, unsigned n)
{
	r->buf = calloc(n, sizeof *r->buf);
	r->mine = calloc(n, 1);
	r->iob = calloc(n, sizeof *r->iob);
	return r->buf && r->mine && r->iob ? 0 : -ENOMEM;
}

/* ---- write-back --------------------------------------------------------- */

static unsigned count_extents(const struct kvd_seqn *q)
{
	unsigned n = 2;                 /* PROFILE, END */

	for (uint32_t i = 0; i < q->p->layers; i++) {
		const struct kvd_layer_state *l = &q->ly[i];

		if (l->mean || l->tail_n || l->nseg)
			n += 1 + l->nseg;
		if (l->heavy)
			n++;
		if (q->loc && q->loc->ly[i].n)
			n++;
	}
	return n + q->hidden;
}

/* Extent i of r's write: a header page alone (PUB, END). */
static int header_ext(struct rec *r, unsigned i, const struct kvd_sfmt_file *f,
		      const struct kvd_sfmt_ext *e)
{
	if (!(r->buf[i].p = kvd_tier_page_alloc(PAGE)))
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
 * (PROFILE, each LAYER's mean and tail, HEAVY state, LOCAL rows, PUB and
 * END pages). */
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
			if (l->tail_n) {        /* the head's copy (struct wfill) */
				e.n = 0;
				b += kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(f, &e));
			}
		}
		if (l->heavy) {
			e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_HEAVY };
			b += kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(f, &e));
		}
		if (q->loc && q->loc->ly[ly].n) {
			e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_LOCAL, .n = q->loc->ly[ly].n };
			b += kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(f, &e));
		}
	}
	return b + (q->hidden ? 2 : 1) * (uint64_t)PAGE;
}

/* Builds the WRITE job of q's whole data: PROFILE, per layer LAYER, HEAVY
 * and SEGs, END; -EAGAIN while a segment of q is in another write (forks
 * and attached prefixes share segments, and each file writes its own
 * header into the segment's header page).  Segments are written from their
 * own buffers (their header page); profile, layer, heavy and end extents
 * are copies, so later appends and steps do not race the write.  A layer's
 * estimator state (l->heavy, hybrid and adaptive profiles) goes with its
 * rows: the restored sequence answers its next step as this one would.
 * Its HEAVY extent comes before the layer's SEGs, so a restore makes the
 * layer ready (kvd_tier_ready_after) only once its state is back. */
int kvd_tier_build_write(struct kvd_tier *t, struct rec *r, int evict)
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
	if (kvd_tier_job_alloc(r, n) || !(r->wext = calloc(n, sizeof *r->wext)) ||
	    !(r->wseg = calloc(n, sizeof *r->wseg)) || !(r->wfill = calloc(n, sizeof *r->wfill)))
		goto nomem;

	e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_PROFILE, .index = i };
	r->buf[i].bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(&f, &e));
	if (!(r->buf[i].p = kvd_tier_page_alloc(r->buf[i].bytes)))
		goto nomem;
	r->mine[i] = 1;
	memset(r->buf[i].p, 0, r->buf[i].bytes);
	kvd_sfmt_hdr_fill(r->buf[i].p, &f, &e);
	kvd_sfmt_profile_put(p, (char *)r->buf[i].p + PAGE);
	r->wext[i] = (struct ext){ .kind = KVD_SFMT_PROFILE, .bytes = r->buf[i].bytes };
	i++;

	for (uint32_t ly = 0; ly < p->layers; ly++) {
		const struct kvd_layer_state *l = &q->ly[ly];
		struct kvd_sfmt_hdr *h;
		float *m;
		uint16_t *k, *v, *c;

		if (!(l->mean || l->tail_n || l->nseg))
			goto heavy;
		e = (struct kvd_sfmt_ext){
			.kind = KVD_SFMT_LAYER, .index = i, .layer = ly, .n = l->tail_n,
			.flags = (l->mean ? KVD_SFMT_LF_MEAN : 0) | (l->sealed ? KVD_SFMT_LF_SEALED : 0),
			.tok_begin = l->tokens - l->tail_n,
		};
		r->buf[i].bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(&f, &e));
		if (!(r->buf[i].p = kvd_tier_page_alloc(r->buf[i].bytes)))
			goto nomem;
		r->mine[i] = 1;
		h = r->buf[i].p;
		kvd_sfmt_layer_parts(g, l->tail_n, l->mean != NULL, (char *)h + PAGE, &m, &k, &v, &c);
		if (l->tail_n) {
			/* Here only a copy of the header page and the mean; the
			 * buffer, rows and all, is written on the spill thread
			 * (struct wfill). */
			size_t hb = (size_t)((char *)k - (char *)h);
			char *head = malloc(hb);

			if (NEVER(!l->tail) || !head) {
				free(head);
				goto nomem;
			}
			memset(head, 0, hb);
			h = (struct kvd_sfmt_hdr *)head;
			kvd_sfmt_hdr_fill(h, &f, &e);
			if (m)
				memcpy(head + PAGE, l->mean, (size_t)g->kv_heads * g->d * sizeof(float));
			r->wfill[i] = (struct wfill){ .tail = kvd_store_tail_hold(q, ly), .g = g,
						      .n = l->tail_n, .cap = p->seal_tokens,
						      .mean = m != NULL,
						      .bytes = r->buf[i].bytes - PAGE,
						      .head = head, .head_bytes = hb };
			r->buf[i].fill = fill_layer;
			r->buf[i].fill_arg = &r->wfill[i];
			r->buf[i].hdr = head;
		} else {
			memset(h, 0, r->buf[i].bytes);
			kvd_sfmt_hdr_fill(h, &f, &e);
			if (m)
				memcpy(m, l->mean, (size_t)g->kv_heads * g->d * sizeof(float));
		}
		r->wext[i] = (struct ext){ KVD_SFMT_LAYER, ly, l->tail_n, h->flags, r->buf[i].bytes,
					   h->tok_begin, h->tok_end };
		i++;
heavy:
		if (l->heavy) {
			e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_HEAVY, .index = i,
						   .layer = ly };
			r->buf[i].bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(&f, &e));
			if (!(r->buf[i].p = kvd_tier_page_alloc(r->buf[i].bytes)))
				goto nomem;
			r->mine[i] = 1;
			h = r->buf[i].p;
			memset(h, 0, r->buf[i].bytes);
			kvd_sfmt_hdr_fill(h, &f, &e);
			memcpy((char *)h + PAGE, l->heavy, h->payload_bytes);
			r->wext[i] = (struct ext){ .kind = KVD_SFMT_HEAVY, .layer = ly, .n = h->n,
						   .bytes = r->buf[i].bytes };
			i++;
		}

		uint64_t tok = 0;

		for (uint32_t sgi = 0; sgi < l->nseg; sgi++) {
			struct kvd_seg *sg = l->seg[sgi];

			sg->wbusy = 1;
			r->wseg[r->nwseg++] = sg;
			/* the header page and the payload: the moments past
			 * it stay out of the file (kvd_seg_sums remakes them) */
			r->buf[i].p = sg->io;
			r->buf[i].bytes = kvd_sfmt_extent_bytes(kvd_seg_bytes(&q->p->g, sg->n));
			h = sg->io;
			e = (struct kvd_sfmt_ext){ .kind = KVD_SFMT_SEG, .index = i, .layer = ly,
						   .n = sg->n, .tok_begin = tok };
			kvd_sfmt_hdr_fill(h, &f, &e);
			tok += sg->n;
			r->wext[i] = (struct ext){ KVD_SFMT_SEG, ly, sg->n, 0, r->buf[i].bytes, h->tok_begin,
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
		if (!(r->buf[i].p = kvd_tier_page_alloc(r->buf[i].bytes)))
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
	kvd_tier_job_release(t, r);
	return -ENOMEM;
}

/* ---- restore: installing ------------------------------------------------ */

/* The first layer the file has not delivered yet, once extents [0, i) are in. */
uint32_t kvd_tier_ready_after(const struct rec *r, unsigned i)
{
	for (; i < r->next_ext; i++)
		if (r->ext[i].kind == KVD_SFMT_LAYER || r->ext[i].kind == KVD_SFMT_SEG ||
		    r->ext[i].kind == KVD_SFMT_HEAVY)
			return r->ext[i].layer;
	return r->q->p->layers;
}

/* Extent i of r's restore has been read and verified: put it in place. */
int kvd_tier_install(struct kvd_tier *t, struct rec *r, unsigned i)
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
		struct rfill *f = r->rfill ? &r->rfill[i] : NULL;

		rc = kvd_store_install_layer(t->st, q, e->layer, m, !!(h->flags & KVD_SFMT_LF_SEALED),
					     h->tok_end, f && f->filled ? f->tail : NULL, e->n);
		if (!rc && f)
			f->tail = NULL;         /* the layer's now */
		break;
	}
	case KVD_SFMT_SEG: {
		struct kvd_seg *sg;

		if (e->layer >= q->p->layers || q->p->dense[e->layer])
			return -KVD_EFORMAT;
		struct rfill *f = r->rfill ? &r->rfill[i] : NULL;

		rc = kvd_seg_adopt(g, e->n, r->buf[i].p, r->iob[i],
				   f && f->filled ? f->vsum : NULL, &sg);
		if (rc)
			return rc;
		r->mine[i] = 0;         /* the segment owns it now */
		if ((rc = kvd_store_install_seg(t->st, q, e->layer, sg))) {
			kvd_seg_free(sg);
			return rc;
		}
		break;
	}
	case KVD_SFMT_HEAVY:
		/* The profile's q heads, so the payload is exactly its state;
		 * what the words say is the engine's to bound (engine/attn.h). */
		if (e->n != g->q_heads)
			return -KVD_EFORMAT;
		rc = kvd_store_install_heavy(t->st, q, e->layer, payload);
		break;
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
