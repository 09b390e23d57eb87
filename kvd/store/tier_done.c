/* kvd_tier: the spill thread's results (kvd_tier_poll), what a write-back or
 * restore that ended means for its sequence.  See tier_int.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <syslog.h>

#include "engine/clock.h"
#include "engine/err.h"
#include "engine/log.h"
#include "tier_int.h"

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
		kvd_tier_spill_unchg(t, r); /* no file */
	}
	kvd_tier_count_io(t, KVD_TIER_WRITE, j->res == 0 ? KVD_TIER_OK : j->res == -ECANCELED ?
			  KVD_TIER_CANCELLED : KVD_TIER_ERROR, j->disk_bytes,
			  kvd_now_ns() - r->io_t0);
	if (j->res && j->res != -ECANCELED) {
		r->backoff_until = kvd_now_ns() + BACKOFF_NS;
		kvd_log(LOG_WARNING, "spill of sequence %016llx failed, it stays in RAM: %s",
			(unsigned long long)q->id, j->msg[0] ? j->msg : kvd_strerror(j->res));
	}
	int evict_now = r->evict_after && j->res == 0;

	kvd_log(LOG_DEBUG, "sequence %016llx: write %s (%d)", (unsigned long long)q->id,
		j->res ? "failed" : "done", j->res);

	r->evict_after = 0;
	kvd_tier_job_release(t, r);
	if (r->has_file && r->file_gen != q->gen) {
		kvd_tier_forget_file(t, r); /* changed while being written */
		return;
	}
	if (j->res == 0 && t->rem && !kvd_store_seq_hidden(q) && !r->freeing)
		kvd_tier_rem_send(t, r);
	if (j->res == 0 && t->on_written && kvd_store_seq_hidden(q) && !r->freeing) {
		char path[4200];

		kvd_tier_file_path(t, r->dir, q->id, path, sizeof path);
		t->on_written(t->on_written_arg, q, path);
	}
	if (evict_now && !r->freeing) {
		kvd_tier_drop(t, r);
		ADD(t->ctr.evict[1], 1);
	}
}

static void read_progress(struct kvd_tier *t, struct rec *r, unsigned i)
{
	int rc;

	if (r->freeing || r->q->state != KVD_SEQ_RESTORING)
		return;
	size_t before = r->q->bytes;

	rc = kvd_tier_install(t, r, i);
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
		kvd_tier_lose(t, r, why);
		kvd_spill_cancel(t->sp, &r->job);
		return;
	}
	r->q->ready = kvd_tier_ready_after(r, i + 1);
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
	kvd_tier_count_io(t, KVD_TIER_READ, how, r->disk_bytes, kvd_now_ns() - r->io_t0);
	if (q->state == KVD_SEQ_RESTORING) {
		if (j->res == 0 && j->done == j->next) {
			q->state = KVD_SEQ_RAM;
			q->ready = q->p->layers;
			t->restores++;
			t->restore_bytes += r->disk_bytes;
			kvd_tier_lru_use(t, r);
			if (r->fresh_who) {
				r->fresh_until = kvd_now_ns() + FRESH_NS;
				if (!t->wake || r->fresh_until < t->wake)
					t->wake = r->fresh_until;
			}
		} else if (!r->freeing) {
			char why[128];

			snprintf(why, sizeof why, "restore failed: %s",
				 j->msg[0] ? j->msg : kvd_strerror(j->res ? j->res : -EIO));
			kvd_tier_lose(t, r, why);
		}
	}
	kvd_tier_job_release(t, r);
	if (r->has_file && r->file_gen != q->gen)
		kvd_tier_forget_file(t, r);
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
					kvd_tier_unl_done(t, u);
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

				kvd_tier_rem_forget(t, r);
				kvd_tier_forget_file(t, r);
				kvd_tier_rec_free(t, r);
				kvd_store_seq_free(t->st, q);
			}
		}
	}
	return total;
}
