/* The tier's private part, shared by its files, each calling only the ones
 * above it in this list:
 *
 *   tier_io.c    the mechanics: a write-back's extents built from the
 *                sequence (the spill thread fills the tails), a restore's
 *                extents installed, unlinks, job buffers, the counters
 *   tier.c       the policy: records and the LRU, the budget and its
 *                victims, when a sequence is written out, dropped, restored
 *                or lost, the copies in the remote tier; most of tier.h
 *   tier_done.c  the spill thread's results (kvd_tier_poll): what a write
 *                or restore that ended means for its sequence
 *   tier_boot.c  the start-up: persisted files become DISK sequences
 *                (kvd_tier_load, kvd_tier_adopt)
 *
 * Everyone else goes through tier.h.
 */
#ifndef KVD_TIER_INT_H
#define KVD_TIER_INT_H

#include <stdatomic.h>
#include <stdint.h>

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
	uint64_t who;                   /* and the part of it (kvd_tier_part) */
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
	size_t *iob;                    /* [next]: a MINE_SEG buffer's io bytes, more
					 * than the extent in buf (the moments) */
	struct ext *wext;               /* WRITE: the extents being written */
	struct kvd_seg **wseg;          /* WRITE: the segments whose header pages it uses */
	unsigned nwseg;
	struct wfill *wfill;            /* WRITE: [next], the LAYER extents' tail copies,
					 * made on the spill thread (fill_layer) */
	struct rfill *rfill;            /* READ: [next], the LAYER extents' tails and the
					 * SEG extents' V sums, made on the spill thread */
	uint64_t reserved;              /* READ: budget held for what is not installed
					 * (charged to uid's memory in kvd_limits) */
	uint64_t rhold;                 /* READ: the restore's whole need, until the
					 * job ends */
	struct rec *rprev, *rnext;      /* t->rlist while rhold is */
	uint64_t fresh_who;             /* restored for this part (kvd_tier_part), which
					 * has not used it yet: no victim till then */
	uint64_t fresh_until;           /* ... or till this time, if it never does */
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

/* A data-plane request waiting for room (kvd_tier_part's who): the room
 * that comes goes to the one waiting longest first. */
#define ROOM_WAITERS 32
/* How long a restored sequence is kept for a requester that does not come
 * back for it (its record failed otherwise): long enough for a loaded
 * executor to reach it, short enough that nobody waits long behind one. */
#define FRESH_NS (500ull * 1000000)
struct room_wait {
	uint64_t who, bytes;
	uint64_t since, seen;           /* its turn (first wait, rotated by uid), its last */
	uint32_t uid;
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
	uint64_t epoch, who;
	uint32_t who_uid;               /* kvd_tier_part's uid */
	uint64_t reserved, pending;     /* restores' reservations; bytes being written out to drop */
	struct rec *rlist;              /* restores in flight (rhold: what each will hold) */
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
	struct room_wait rw[ROOM_WAITERS];
	unsigned nrw;
	uint64_t wake;                  /* the earliest fresh_until (kvd_tier_due) */
	int pin_wait;                   /* a request waits for a pinned sequence's unit,
					 * or another part's request, to end
					 * (kvd_tier_take_pin_waits) */
	char why[160];                  /* why evict() refused (kvd_tier_evict's message) */
};

static inline struct kvd_limits *lim(const struct kvd_tier *t)
{
	return kvd_store_limits(t->st);
}

/* The counters (struct kvd_tier_counters): relaxed, read from any thread. */
#define ADD(x, n) atomic_fetch_add_explicit(&(x), (n), memory_order_relaxed)
#define GET(x) atomic_load_explicit(&(x), memory_order_relaxed)

/* ---- across the files ---------------------------------------------------- */

/* tier_io.c */
void kvd_tier_count_io(struct kvd_tier *t, int kind, int how, uint64_t bytes, uint64_t ns);
void kvd_tier_unlink_file(struct kvd_tier *t, struct rec *r);
void kvd_tier_unl_done(struct kvd_tier *t, struct unl *u);
void *kvd_tier_page_alloc(uint64_t bytes);
void kvd_tier_page_free(void *p, uint64_t bytes);
void kvd_tier_job_release(struct kvd_tier *t, struct rec *r);
int kvd_tier_job_alloc(struct rec *r, unsigned n);
/* A restore's extent i, made ready for the spill thread's work on it as it
 * verifies: a LAYER with tail rows gets the tail they go into and the copy
 * into it (tier_io.c, drain_layer), a SEG the buffer for its V sums
 * (drain_seg). */
int kvd_tier_read_prep(struct kvd_tier *t, struct rec *r, unsigned i);
int kvd_tier_build_write(struct kvd_tier *t, struct rec *r, int evict);
uint32_t kvd_tier_ready_after(const struct rec *r, unsigned i);
int kvd_tier_install(struct kvd_tier *t, struct rec *r, unsigned i);

/* tier.c */
struct rec *kvd_tier_rec_of(struct kvd_tier *t, struct kvd_seqn *q);
void kvd_tier_rec_free(struct kvd_tier *t, struct rec *r);
void kvd_tier_lru_use(struct kvd_tier *t, struct rec *r);
void kvd_tier_spill_unchg(struct kvd_tier *t, struct rec *r);
void kvd_tier_forget_file(struct kvd_tier *t, struct rec *r);
void kvd_tier_drop(struct kvd_tier *t, struct rec *r);
void kvd_tier_lose(struct kvd_tier *t, struct rec *r, const char *why);
void kvd_tier_rem_send(struct kvd_tier *t, struct rec *r);
void kvd_tier_rem_forget(struct kvd_tier *t, struct rec *r);
void kvd_tier_file_path(const struct kvd_tier *t, unsigned dir, uint64_t id, char *buf,
			size_t n);

#endif
