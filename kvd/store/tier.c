/* kvd_tier: RAM or disk, and the budget: the policy.  See tier.h, and
 * tier_int.h for the other files. */
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
#include "tier_int.h"

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

/* ---- records and the LRU ------------------------------------------------ */

struct rec *kvd_tier_rec_of(struct kvd_tier *t, struct kvd_seqn *q)
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

void kvd_tier_lru_use(struct kvd_tier *t, struct rec *r)
{
	lru_del(t, r);
	r->prev = t->tail;
	*(t->tail ? &t->tail->next : &t->head) = r;
	t->tail = r;
	r->in_lru = 1;
	r->epoch = t->epoch;
	r->who = t->who;
}

/* Gives back the spill bytes r's file was charged (the file is going, or
 * was never written). */
void kvd_tier_spill_unchg(struct kvd_tier *t, struct rec *r)
{
	if (lim(t))
		kvd_limits_uncharge(lim(t), r->uid, KVD_RES_SPILL, r->spill_chg);
	r->spill_chg = 0;
}

static void rem_unchg(struct kvd_tier *t, struct rec *r);

void kvd_tier_rec_free(struct kvd_tier *t, struct rec *r)
{
	/* a restore's job ends (kvd_tier_job_release) before its record goes */
	if (NEVER(r->rhold))
		kvd_tier_job_release(t, r);
	kvd_tier_spill_unchg(t, r);
	rem_unchg(t, r);
	lru_del(t, r);
	if (r->unl)
		r->unl->r = NULL;
	if (r->q)
		r->q->tier = NULL;
	free(r->ext);
	free(r);
}

void kvd_tier_forget_file(struct kvd_tier *t, struct rec *r)
{
	if (!r->has_file)
		return;
	if (!(t->stopping && t->cfg.persist))
		kvd_tier_unlink_file(t, r);
	kvd_tier_spill_unchg(t, r);
	r->has_file = 0;
	free(r->ext);
	r->ext = NULL;
	r->next_ext = 0;
}

static int clean(const struct rec *r)
{
	return r->has_file && r->file_gen == r->q->gen;
}

/* ---- write-back --------------------------------------------------------- */

/* Drops q's resident data; a current file holds it. */
void kvd_tier_drop(struct kvd_tier *t, struct rec *r)
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
		kvd_tier_drop(t, r);
		ADD(t->ctr.evict[0], 1);
		return 0;
	}
	if (!kvd_store_spillable(q))
		return -EBUSY;
	if (r->has_file) {
		/* A stale file goes first: the write comes once it is gone. */
		kvd_tier_forget_file(t, r);
		return r->unl ? -EAGAIN : -EBUSY;
	}
	if ((rc = kvd_tier_build_write(t, r, evict)))
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
		kvd_tier_job_release(t, r);
		return rc;
	}
	r->spill_chg = lim(t) ? fb : 0;
	if ((rc = kvd_spill_submit(t->sp, &r->job))) {
		kvd_tier_job_release(t, r);
		kvd_tier_spill_unchg(t, r);
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
	if (!(r = kvd_tier_rec_of(t, q)))
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
void kvd_tier_file_path(const struct kvd_tier *t, unsigned dir, uint64_t id, char *buf, size_t n)
{
	snprintf(buf, n, "%s/%016llx.kvs", kvd_spill_dir(t->sp, dir), (unsigned long long)id);
}

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
void kvd_tier_rem_send(struct kvd_tier *t, struct rec *r)
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
	kvd_tier_file_path(t, r->dir, r->q->id, path, sizeof path);
	if (kvd_remote_put(t->rem, ns, key, 0, path,
			   KVD_REMOTE_FOR_TIER, r->q->id) == 0)
		r->rem_sent = 1;
}

/* The cluster's copy goes with the sequence (queued after any put of it:
 * the remote thread runs its jobs in order). */
void kvd_tier_rem_forget(struct kvd_tier *t, struct rec *r)
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
	kvd_tier_unlink_file(a->t, r);
	kvd_tier_spill_unchg(a->t, r);
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
		kvd_tier_spill_unchg(t, r);
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
		kvd_tier_rem_forget(arg, q->tier);
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

			kvd_tier_file_path(t, d->dir, d->seq, path, sizeof path);
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
	kvd_tier_spill_unchg(t, r);
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
	kvd_tier_lose(t, r, why);
}

/* ---- restore ------------------------------------------------------------ */

static int start_restore(struct kvd_tier *t, struct rec *r, char *msg, size_t msglen)
{
	struct kvd_seqn *q = r->q;
	const struct kvd_geom *g = &q->p->g;
	uint64_t need = 0;
	int rc;

	/* The budget for the restore: every extent's buffer, and what
	 * installing a layer allocates besides (mean, tail, segment table,
	 * estimator state). */
	for (unsigned i = 0; i < r->next_ext; i++) {
		const struct ext *e = &r->ext[i];
		uint32_t nseg = 0;

		/* a segment's io buffer holds its moments past the extent */
		need += e->kind == KVD_SFMT_SEG ? kvd_seg_io_bytes(g, e->n) : e->bytes;
		if (e->kind == KVD_SFMT_HEAVY)
			need += kvd_store_heavy_bytes(q);
		if (e->kind != KVD_SFMT_LAYER)
			continue;
		for (unsigned k = i + 1; k < r->next_ext && (r->ext[k].kind == KVD_SFMT_SEG ||
							      r->ext[k].kind == KVD_SFMT_HEAVY) &&
					 r->ext[k].layer == e->layer; k++)
			nseg += r->ext[k].kind == KVD_SFMT_SEG;
		need += kvd_store_install_bytes(q, !!(e->flags & KVD_SFMT_LF_MEAN), e->n, nseg);
	}
	if ((rc = kvd_tier_room_uid(t, r->uid, need, msg, msglen)))
		return rc;
	/* kvd_tier_room is the policy (evict, wait); the charge is the wall. */
	if (lim(t) && (rc = kvd_limits_charge(lim(t), r->uid, KVD_RES_MEMORY, need, msg, msglen)))
		return rc;
	r->reserved = need;
	t->reserved += need;
	if (kvd_tier_job_alloc(r, r->next_ext))
		goto nomem;
	r->job.next = r->next_ext;
	for (unsigned i = 0; i < r->next_ext; i++) {
		size_t b = r->ext[i].bytes;

		if (r->ext[i].kind == KVD_SFMT_SEG) {
			size_t io = 0;

			r->buf[i].p = kvd_seg_io_alloc_node(g, r->ext[i].n,
							    kvd_store_mem_node(t->st, q), &io);
			if (r->buf[i].p &&
			    b != kvd_sfmt_extent_bytes(kvd_seg_bytes(g, r->ext[i].n))) {
				kvd_seg_io_free(r->buf[i].p, io);
				r->buf[i].p = NULL;
				snprintf(msg, msglen, "extent %u: %zu bytes, the file says %llu", i, b,
					 (unsigned long long)r->ext[i].bytes);
				r->mine[i] = 0;
				kvd_tier_job_release(t, r);
				return -KVD_EFORMAT;
			}
		} else {
			r->buf[i].p = kvd_tier_page_alloc(b);
		}
		r->buf[i].bytes = b;
		r->mine[i] = r->ext[i].kind == KVD_SFMT_SEG ? MINE_SEG : MINE_PAGE;
		r->iob[i] = kvd_seg_io_bytes(g, r->ext[i].n);
		if (!r->buf[i].p || kvd_tier_read_prep(t, r, i))
			goto nomem;
	}
	r->job = (struct kvd_spill_job){ .op = KVD_SPILL_READ, .seq = q->id, .gen = r->file_gen,
					 .dir = r->dir, .ext = r->buf, .next = r->next_ext,
					 .user = r };
	if ((rc = kvd_spill_submit(t->sp, &r->job))) {
		snprintf(msg, msglen, "cannot start the restore: %s", kvd_strerror(rc));
		kvd_tier_job_release(t, r);
		return rc;
	}
	r->busy = 1;
	r->rhold = need;
	r->rprev = NULL;
	r->rnext = t->rlist;
	if (t->rlist)
		t->rlist->rprev = r;
	t->rlist = r;
	r->fresh_who = t->who;
	r->io_t0 = kvd_now_ns();
	q->state = KVD_SEQ_RESTORING;
	q->ready = kvd_tier_ready_after(r, 0);
	kvd_log(LOG_DEBUG, "sequence %016llx: restoring %llu bytes", (unsigned long long)q->id,
		(unsigned long long)need);
	return 0;
nomem:
	kvd_tier_job_release(t, r);
	snprintf(msg, msglen, "out of memory for the restore");
	return -ENOMEM;
}

void kvd_tier_lose(struct kvd_tier *t, struct rec *r, const char *why)
{
	struct kvd_seqn *q = r->q;

	kvd_store_seq_drop(t->st, q);
	q->state = KVD_SEQ_LOST;
	q->ready = 0;
	snprintf(r->why, sizeof r->why, "%s", why);
	ADD(t->ctr.lost, 1);
	kvd_log(LOG_ERR, "sequence %016llx lost: %s", (unsigned long long)q->id, why);
	kvd_tier_rem_forget(t, r);
	r->rem_only = 0;
	kvd_tier_forget_file(t, r);
}

/* ---- the API ------------------------------------------------------------ */

/* The store asks before rows that need room (see kvd_store_set_room). */
static int room_cb(void *arg, uint32_t uid, uint64_t bytes, char *msg, size_t msglen)
{
	return kvd_tier_room_uid(arg, uid, bytes, msg, msglen);
}

/* And before a record attends a layer (see kvd_store_set_want). */
static int want_cb(void *arg, struct kvd_seqn *q, uint32_t layer, char *msg, size_t msglen)
{
	return kvd_tier_want(arg, q, layer, msg, msglen);
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
	kvd_store_set_want(st, want_cb, t);
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
		kvd_tier_job_release(t, r);
	if (r->freeing) {
		r->q = NULL;
		kvd_store_seq_free(t->st, q);
	} else {
		r->q->tier = NULL;
		r->q = NULL;
	}
	kvd_tier_spill_unchg(t, r);
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
		kvd_tier_unl_done(t, t->unls);
	kvd_store_each(t->st, free_all, t);
	kvd_store_set_room(t->st, NULL, NULL);
	kvd_store_set_want(t->st, NULL, NULL);
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
	t->who = 0;
}

void kvd_tier_part(struct kvd_tier *t, uint64_t who, uint32_t uid)
{
	t->who = who;
	t->who_uid = uid;
}

/* ---- waiting for room, in turn ------------------------------------------ */

/* Parked entries try again on every I/O result and the end of every unit,
 * in the scheduler's order, not the order they began to wait: three
 * clients taking the room in turns left a fourth, last in that order,
 * waiting for seconds (test_tier_race).  A waiter that has not asked for
 * so long is taken for gone, so that nobody waits behind a record kvd
 * forgot to drop. */
#define ROOM_STALE_NS (5ull * 1000000000)

static void rw_del(struct kvd_tier *t, unsigned i)
{
	t->rw[i] = t->rw[--t->nrw];
	/* whoever waited behind it may fit now */
	t->pin_wait = 1;
}

void kvd_tier_unwait(struct kvd_tier *t, uint64_t who)
{
	for (unsigned i = 0; who && i < t->nrw; i++)
		if (t->rw[i].who == who) {
			rw_del(t, i);
			return;
		}
}

/* The waiter who has waited longest, the stale ones dropped; NULL if none.
 * One served keeps its place (bytes 0) till its entry ends, for a unit
 * asks for room in steps, and parks and starts over when a later step
 * must wait: queued again at the back each time, a big APPEND never got
 * through.  It is first again when it asks again (asker). */
static const struct room_wait *rw_first(struct kvd_tier *t, uint64_t now, uint64_t asker)
{
	const struct room_wait *f = NULL;

	for (unsigned i = 0; i < t->nrw;) {
		const struct room_wait *w = &t->rw[i];

		if (now - w->seen > ROOM_STALE_NS) {
			rw_del(t, i);
			continue;
		}
		if ((w->bytes || (asker && w->who == asker)) && (!f || w->since < f->since))
			f = w;
		i++;
	}
	return f;
}

/* The current who got its room: it keeps its place, asking for nothing,
 * and its uid's other waiters go behind everyone waiting now, their order
 * kept.  By age alone, a uid with many clients queued first was served
 * all of them before another uid's one waiter. */
static void rw_served(struct kvd_tier *t, uint64_t now)
{
	const struct room_wait *s = NULL;

	for (unsigned i = 0; t->who && i < t->nrw; i++)
		if (t->rw[i].who == t->who && t->rw[i].bytes) {
			s = &t->rw[i];
			t->rw[i].bytes = 0;
			/* whoever waited behind it may fit now */
			t->pin_wait = 1;
		}
	if (!s)
		return;
	/* Just behind the newest now, in their order: now + their rank (a uid
	 * has at most KVD_TIER_ROOM_PER_UID places).  Not shifted by how long
	 * s waited, which grows with every step a unit is served and would
	 * put them behind newcomers for as long again. */
	uint64_t newest = now, key[KVD_TIER_ROOM_PER_UID];
	unsigned n = 0, idx[KVD_TIER_ROOM_PER_UID];

	for (unsigned i = 0; i < t->nrw; i++) {
		if (t->rw[i].since > newest)
			newest = t->rw[i].since;
		if (t->rw[i].uid == s->uid && t->rw[i].who != s->who && n < KVD_TIER_ROOM_PER_UID) {
			key[n] = t->rw[i].since;
			idx[n++] = i;
		}
	}
	for (unsigned a = 0; a < n; a++) {
		unsigned rank = 1;

		for (unsigned b = 0; b < n; b++)
			rank += key[b] < key[a] || (key[b] == key[a] && b < a);
		t->rw[idx[a]].since = newest + rank;
	}
}

/* The current who waits for bytes: queued, or its entry refreshed (its
 * place kept).  A full queue, or its uid's KVD_TIER_ROOM_PER_UID places taken,
 * leaves it out: it still waits behind, and asks again for a place. */
static void rw_note(struct kvd_tier *t, uint64_t bytes, uint64_t now)
{
	unsigned i = 0, mine = 0;

	if (!t->who)
		return;
	for (unsigned k = 0; k < t->nrw; k++)
		mine += t->rw[k].uid == t->who_uid;
	while (i < t->nrw && t->rw[i].who != t->who)
		i++;
	if (i == t->nrw) {
		if (t->nrw == ROOM_WAITERS || mine >= KVD_TIER_ROOM_PER_UID)
			return;
		t->rw[t->nrw++] = (struct room_wait){ .who = t->who, .since = now,
						      .uid = t->who_uid };
	}
	t->rw[i].bytes = bytes;
	t->rw[i].seen = now;
}

/* Whether r may be written out now for the current request: not a
 * sequence the request itself uses (epoch), nor one whose I/O is in flight
 * or whose write failed a moment ago, and never one a running unit is
 * changing.  Requests run between the slices of another's seal: the seal's
 * sequence is in the LRU under an older epoch, and writing it out there
 * captured half a change under a generation that counted as current.
 * Where the room will come all the same, *wait says when (WAIT_*): a
 * pinned sequence's when its unit ends, one that another part of the
 * request uses (kvd_tier_part) when the request ends, a fresh restore's
 * when its requester has used it. */
#define WAIT_PIN 1                /* the room comes at the end of a unit */
#define WAIT_FRESH 2              /* ... when a restore's requester has run */

static int victim(struct kvd_tier *t, const struct rec *r, uint64_t now, int *wait)
{
	if (r->epoch == t->epoch) {
		/* another part's: its room comes when the request ends */
		if (r->who != t->who)
			*wait |= WAIT_PIN;
		return 0;
	}
	if (r->busy || r->backoff_until > now)
		return 0;
	if (kvd_store_seq_pinned(r->q)) {
		*wait |= WAIT_PIN;
		return 0;
	}
	/* Restored for a request that has not run yet.  Taken, its restore
	 * was for nothing, and two clients whose sequences did not both fit
	 * took each other's as soon as they were back, for ever. */
	if (r->fresh_who && now < r->fresh_until) {
		*wait |= WAIT_FRESH;
		return 0;
	}
	return 1;
}

/* What restores in flight will hold once done: of uid, or (any) of all. */
static uint64_t restoring(const struct kvd_tier *t, int any, uint32_t uid)
{
	uint64_t b = 0;

	for (const struct rec *r = t->rlist; r; r = r->rnext)
		if (any || r->uid == uid)
			b += r->rhold;
	return b;
}

int kvd_tier_waiting(const struct kvd_tier *t)
{
	return t->nrw || t->wake;
}

int kvd_tier_due(struct kvd_tier *t, uint64_t now, uint64_t *who)
{
	const struct room_wait *f;

	*who = 0;
	if (t->wake && now >= t->wake) {
		t->wake = 0;
		return 1;
	}
	if (t->nrw && (f = rw_first(t, now, 0)) && used(t) + f->bytes <= t->cfg.limit)
		*who = f->who;
	return 0;
}

int kvd_tier_take_pin_waits(struct kvd_tier *t)
{
	int w = t->pin_wait;

	t->pin_wait = 0;
	return w;
}

int kvd_tier_room(struct kvd_tier *t, uint64_t bytes, char *msg, size_t msglen)
{
	uint64_t u = used(t), now = kvd_now_ns(), ahead = 0;

	if (!t->cfg.limit)
		return 0;
	if (bytes > t->cfg.limit) {
		/* More than an empty budget holds: nobody's sequences go for
		 * it, and nobody waits behind it. */
		snprintf(msg, msglen, "memory budget: %llu MiB needed, limit %llu MiB",
			 (unsigned long long)((bytes + (1 << 20) - 1) >> 20),
			 (unsigned long long)(t->cfg.limit >> 20));
		kvd_tier_unwait(t, t->who);
		return -ENOMEM;
	}
	const struct room_wait *f = rw_first(t, now, t->who);

	if (f && f->who != t->who)
		ahead = f->bytes;
	if (u + bytes + ahead <= t->cfg.limit) {
		rw_served(t, now);
		return 0;
	}
	if (ahead) {
		/* Not a victim taken for it either: the room that comes is
		 * the first waiter's, who makes it when it asks again.  No
		 * pin_wait: this one tries again once the first is served
		 * (rw_del) or an I/O result comes, not after every unit, or
		 * it would spin, and the scheduler favours the cheap spinner
		 * over the waiter it waits for. */
		rw_note(t, bytes, now);
		kvd_log(LOG_DEBUG, "room for %llu bytes: waiting behind %llu bytes asked first",
			(unsigned long long)bytes, (unsigned long long)ahead);
		return -EINPROGRESS;
	}
	if (t->sp) {
		int later = 0, wait = 0;

		for (struct rec *r = t->head, *nx; r && u + bytes > t->cfg.limit + t->pending; r = nx) {
			int rc;

			nx = r->next;
			if (!victim(t, r, now, &wait))
				continue;
			rc = evict(t, r);
			if (rc == 0)
				u = used(t);
			later |= rc == -EAGAIN;
		}
		u = used(t);
		if (u + bytes <= t->cfg.limit) {
			rw_served(t, now);
			return 0;
		}
		t->pin_wait |= wait & WAIT_PIN;
		/* A restore in flight is room that comes back: once done, its
		 * sequence is a victim like any other.  Refused instead, a
		 * request lost the budget to whoever restored next, and one
		 * client could be refused for seconds while the others'
		 * restores took the room in turns.  Waiting ends: the own
		 * request's restores, the only ones that stay unevictable,
		 * finish and leave restoring. */
		uint64_t back = restoring(t, 1, 0);

		if (later || wait || u + bytes <= t->cfg.limit + t->pending + back) {
			kvd_log(LOG_DEBUG, "room for %llu bytes: waiting for %llu being written out, "
				"%llu being restored", (unsigned long long)bytes,
				(unsigned long long)t->pending, (unsigned long long)back);
			rw_note(t, bytes, now);
			return -EINPROGRESS;
		}
	}
	/* Published snapshots are a cache: they give way before a refusal. */
	if (kvd_store_reclaim(t->st, 0, 1, u + bytes - t->cfg.limit) &&
	    (u = used(t)) + bytes <= t->cfg.limit) {
		rw_served(t, now);
		return 0;
	}
	kvd_tier_unwait(t, t->who);
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
	int later = 0, wait = 0;

	if (cap && bytes > cap) {
		/* more than the uid may ever hold: nobody's sequences go */
		snprintf(msg, msglen, "memory_per_uid: %llu MiB needed, %llu MiB allowed",
			 (unsigned long long)((bytes + (1 << 20) - 1) >> 20),
			 (unsigned long long)(cap >> 20));
		kvd_tier_unwait(t, t->who);
		return -EDQUOT;
	}
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
		if (!victim(t, r, now, &wait))
			continue;
		rc = evict(t, r);
		later |= rc == -EAGAIN;
		if (rc == 0 && r->evict_after)
			pend += r->pend;
	}
	/* the uid's restores in flight come back as its victims, as in
	 * kvd_tier_room */
	pend += restoring(t, 0, uid);
	if (uid_mem(t, uid) + bytes > cap && (wait & WAIT_PIN))
		t->pin_wait = 1;
	if (uid_mem(t, uid) + bytes > cap &&
	    (later || wait || uid_mem(t, uid) + bytes <= cap + pend)) {
		kvd_log(LOG_DEBUG, "uid %u: room for %llu bytes under memory_per_uid: waiting for "
			"%llu being written out", uid, (unsigned long long)bytes,
			(unsigned long long)pend);
		rw_note(t, bytes, now);
		return -EINPROGRESS;
	}
	return kvd_tier_room(t, bytes, msg, msglen);
}

int kvd_tier_want(struct kvd_tier *t, struct kvd_seqn *q, uint32_t layer, char *msg,
		  size_t msglen)
{
	struct rec *r = kvd_tier_rec_of(t, q);
	int rc;

	if (!r) {
		snprintf(msg, msglen, "out of memory");
		return -ENOMEM;
	}
	switch (q->state) {
	case KVD_SEQ_RAM:
	case KVD_SEQ_SPILLING:
		kvd_tier_lru_use(t, r);
		if (r->fresh_who && r->fresh_who == t->who) {
			/* used: once this request ends, a victim like any */
			r->fresh_who = 0;
			t->pin_wait = 1;
		}
		return 0;
	case KVD_SEQ_LOST:
		snprintf(msg, msglen, "sequence lost, prefill again (%s)", r->why);
		return -KVD_ELOST;
	case KVD_SEQ_DISK:
		r->epoch = t->epoch;
		r->who = t->who;
		if (r->rem_only)
			return rem_fetch(t, r, msg, msglen);
		if ((rc = start_restore(t, r, msg, msglen)))
			return rc;
		break;
	case KVD_SEQ_RESTORING:
		r->epoch = t->epoch;
		r->who = t->who;
		break;
	}
	return layer != UINT32_MAX && layer < q->ready ? 0 : -EINPROGRESS;
}

void kvd_tier_changed(struct kvd_tier *t, struct kvd_seqn *q)
{
	struct rec *r = q->tier;

	if (r && r->has_file && r->file_gen != q->gen && !r->busy)
		kvd_tier_forget_file(t, r);
}

int kvd_tier_prefetch(struct kvd_tier *t, struct kvd_seqn *q, char *msg, size_t msglen)
{
	uint64_t who = t->who;
	int rc;

	/* nobody waits for what it restores: not kept for anyone */
	t->who = 0;
	rc = kvd_tier_want(t, q, UINT32_MAX, msg, msglen);
	t->who = who;
	return rc == -EINPROGRESS ? 0 : rc;
}

int kvd_tier_evict(struct kvd_tier *t, struct kvd_seqn *q, char *msg, size_t msglen)
{
	struct rec *r = kvd_tier_rec_of(t, q);
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
			kvd_store_seq_disown(t->st, q);
			lru_del(t, r);
			kvd_spill_cancel(t->sp, &r->job);
		}
		return;
	}
	if (r) {
		kvd_tier_rem_forget(t, r);
		kvd_tier_forget_file(t, r);
		kvd_tier_rec_free(t, r);
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

	kvd_store_each_owned(t->st, owner, free_if_owner, &a);
	return a.n;
}

void kvd_tier_stopping(struct kvd_tier *t)
{
	t->stopping = 1;
}

void kvd_tier_balance(struct kvd_tier *t)
{
	uint64_t now;

	if (!t->sp || !t->cfg.limit || used(t) <= t->cfg.high)
		return;
	now = kvd_now_ns();
	for (struct rec *r = t->head, *nx; r; r = nx) {
		uint64_t u = used(t);
		int wait = 0;

		nx = r->next;
		if (u <= t->cfg.low + t->pending)
			break;
		if (!victim(t, r, now, &wait))
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
