/* kvd_tier: where each sequence lives — RAM or its spill file — and the
 * memory budget that decides.
 *
 * Budget: "used" is what the store holds resident plus what restores in
 * flight have reserved.  Above the high watermark, the least recently used
 * sequences are written out in the background (or dropped at once when a
 * durable file already holds exactly their data) until used, minus what is
 * being written out, is at or below the low watermark.  A request that
 * needs room beyond the limit waits for writes in flight to land, or, when
 * nothing more can go to disk and the published snapshots that no request
 * is using have given way (kvd_store_reclaim), fails with -ENOMEM and a
 * message.
 *
 * A sequence on disk comes back on demand: kvd_tier_want() starts a
 * restore and says -EINPROGRESS until the layer asked for is resident;
 * layers arrive in order, so layer 0 is served before the last one lands.
 * A restore that fails (I/O error, a checksum or table that does not
 * verify) leaves the sequence LOST: every later use fails -KVD_ELOST
 * ("sequence lost, prefill again"), never a wrong answer.
 *
 * A file is current only while it holds exactly the sequence's data (its
 * generation equals the sequence's); a change makes it stale, and a stale
 * file is deleted.  A sequence a running unit has pinned
 * (kvd_store_seq_pin) is never written out or dropped: requests run between
 * the slices of a change, and a file of half a change would be current for
 * rows the sequence does not have.  With persist, files survive kvd (clean
 * stop or crash) and kvd_tier_load() finds them at start-up; without it
 * they are deleted.
 *
 * Single-threaded: the event loop only.  The I/O runs on kvd_spill's thread.
 */
#ifndef KVD_TIER_H
#define KVD_TIER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "spill.h"
#include "store.h"

struct kvd_tier_cfg {
	uint64_t limit;                 /* bytes; 0: no budget */
	uint64_t high, low;             /* watermarks in bytes, low < high <= limit */
	int spill;                      /* 0: no spill directories (budget only) */
	int persist;
	int remote;                     /* published prefixes get a file at once, as
					 * with persist (the remote tier sends it) */
	struct kvd_spill_cfg io;
	uint64_t poll_ns;               /* kvd_tier_poll's budget (0: 2 ms) */
};

struct kvd_tier;

int kvd_tier_create(const struct kvd_tier_cfg *cfg, struct kvd_store *st, struct kvd_tier **out);
/* Stops the I/O, frees every buffer; deletes the files unless persist. */
void kvd_tier_destroy(struct kvd_tier *t);
/* Readable when I/O results wait: then call kvd_tier_poll().  -1 without spill. */
int kvd_tier_fd(const struct kvd_tier *t);

/* persist: the sequences in the spill directories become DISK sequences
 * without an owner (SeqOpen takes them over); else the directories are
 * emptied.  Returns how many were found, or -errno. */
int kvd_tier_load(struct kvd_tier *t);

/* A new request begins: sequences it touches are not evicted to make room
 * for it. */
void kvd_tier_begin(struct kvd_tier *t);

/* The data-plane client (who != 0) a request, or the part of one that
 * runs now, is for; an executor's pass of ATTEND records is one request of
 * several parts.  Another part's sequences are still not evicted for it,
 * but the room they hold comes back when the request ends, so a part that
 * needs it waits (-EINPROGRESS; kvd_tier_take_pin_waits) instead of being
 * refused.  A who that waits for room is queued: while it waits, the room
 * that comes is its first, and a request of anyone else that does not fit
 * beside it waits too (control requests, who = 0, included).  The entry
 * goes when who gets its room or a refusal, or with kvd_tier_unwait.
 * Waiters are served in turn by uid: a uid holds at most
 * KVD_TIER_ROOM_PER_UID places (the others wait without one), and when one of its waiters is served the others go behind
 * everyone waiting now, so that a uid with many clients delays another
 * uid's waiter by one of its own, not by all of them. */
#define KVD_TIER_ROOM_PER_UID 4
void kvd_tier_part(struct kvd_tier *t, uint64_t who, uint32_t uid);

/* who's request ended (done, refused, its client gone): not waiting. */
void kvd_tier_unwait(struct kvd_tier *t, uint64_t who);

/* Which requests that wait for room should try again now, though no I/O
 * result came: all of them (1) when a restored sequence its requester
 * never used stops being kept for it; else (0) the first waiter, in *who,
 * when it would fit now (room came back from a drop, a free, the end of a
 * request), or none (*who = 0).  Only the first: the others would wait
 * behind it again, and spinning, cheap, be scheduled before it. */
int kvd_tier_due(struct kvd_tier *t, uint64_t now, uint64_t *who);

/* Whether any request waits for room (kvd_tier_due has work). */
int kvd_tier_waiting(const struct kvd_tier *t);

/* Before a request uses `layer` of q (UINT32_MAX: every layer): 0 when it
 * is resident; -EINPROGRESS when it is being restored (retry after
 * kvd_tier_poll() reports progress); -KVD_ELOST; -ENOMEM when the budget
 * cannot hold it.  Marks q used (LRU). */
int kvd_tier_want(struct kvd_tier *t, struct kvd_seqn *q, uint32_t layer, char *msg,
		  size_t msglen);
/* Room for `bytes` more resident: 0, -EINPROGRESS (writes in flight will
 * make room: retry after progress), or -ENOMEM with a message. */
int kvd_tier_room(struct kvd_tier *t, uint64_t bytes, char *msg, size_t msglen);
/* The same for bytes charged to uid: under [limits] memory_per_uid, with a
 * spill tier, the uid's own least recently used sequences are written out
 * first (as the budget does with anyone's), so a uid at its share keeps
 * working on its hot sequences instead of being refused; -EINPROGRESS while
 * its write-backs will make the room.  What still does not fit is left to
 * the charge that follows, which refuses it (-EDQUOT, naming the limit). */
int kvd_tier_room_uid(struct kvd_tier *t, uint32_t uid, uint64_t bytes, char *msg,
		      size_t msglen);
/* Whether a request was told to wait (-EINPROGRESS) because the only room
 * to be had is a sequence a running unit has pinned (kvd_store_seq_pin);
 * clears it.  The executor asks after each unit: then the waiting requests
 * try again, and the sequence, unpinned, can go. */
int kvd_tier_take_pin_waits(struct kvd_tier *t);
/* After q's data changed: its file, if any, is stale and goes. */
void kvd_tier_changed(struct kvd_tier *t, struct kvd_seqn *q);

/* PREFETCH: start the restore of a DISK sequence (0 also when resident). */
int kvd_tier_prefetch(struct kvd_tier *t, struct kvd_seqn *q, char *msg, size_t msglen);
/* SeqEvict: write q out and drop it from RAM (0 once started). */
int kvd_tier_evict(struct kvd_tier *t, struct kvd_seqn *q, char *msg, size_t msglen);

/* With spill and persist, starts writing q's file if it has no current one,
 * keeping q resident (a published prefix: a restart brings it back): 0 also
 * when there is nothing to do; else why not (as SeqEvict). */
int kvd_tier_write(struct kvd_tier *t, struct kvd_seqn *q);
/* fn(arg, q) for every published prefix kvd_tier_load finds (a file with a
 * PUB extent: q is hidden, its key set).  Before kvd_tier_load. */
void kvd_tier_on_pub(struct kvd_tier *t, void (*fn)(void *arg, struct kvd_seqn *q), void *arg);

/* Frees q (after its I/O, if any, has been cancelled and has ended: until
 * then it is invisible to every tenant). */
/* fn(arg, q, path) once a hidden sequence (a published prefix) has a
 * current file at path, written by kvd_tier_write. */
void kvd_tier_on_written(struct kvd_tier *t,
			 void (*fn)(void *arg, struct kvd_seqn *q, const char *path), void *arg);
/* Takes in <spill dir `dir`>/<seq>.kvs, put there by the remote tier, as
 * kvd_tier_load takes in files at start-up, but as `tenant`'s (the
 * requester's) whatever the file says; a published prefix in it goes to
 * the on_pub callback.  0, or negative with the file gone or set aside. */
int kvd_tier_adopt(struct kvd_tier *t, unsigned dir, uint64_t seq, const char *tenant);
/* The index of the spill directory fetched files go to, and its path
 * (NULL without spill). */
const char *kvd_tier_spill_dir(const struct kvd_tier *t, unsigned *dir);
void kvd_tier_free(struct kvd_tier *t, struct kvd_seqn *q);
unsigned kvd_tier_free_owner(struct kvd_tier *t, uint64_t owner);
/* kvd is stopping: freeing sequences from now on keeps their files
 * (persist). */
void kvd_tier_stopping(struct kvd_tier *t);

/* Reaps I/O results for about cfg.poll_ns at most, a few at a time (the
 * rest wait for the next call; kvd_tier_fd stays readable).  Returns how many; nonzero means
 * waiting requests may proceed. */
unsigned kvd_tier_poll(struct kvd_tier *t);
/* Starts write-backs when used is above the high watermark. */
void kvd_tier_balance(struct kvd_tier *t);

/* The remote tier for evicted sequences ([remote] evicted = yes): once a
 * private sequence's spill file is written it is also sent to the cluster
 * (kvd_remote_put, under the uid's namespace and a key of this lifetime and
 * the sequence); when the spill room is short (spill_per_uid, the spill
 * limit), local files of sequences on disk whose current file the cluster
 * holds go first, and a restore of such a sequence fetches its file back
 * before reading it (kvd_tier_want: -EINPROGRESS meanwhile; a file that
 * does not come back or does not verify makes the sequence LOST, never a
 * wrong answer).  Freeing a sequence deletes its copy.  rem NULL: none;
 * needs spill. */
struct kvd_remote;
struct kvd_remote_done;
void kvd_tier_set_remote(struct kvd_tier *t, struct kvd_remote *rem);
/* A remote result for KVD_REMOTE_FOR_TIER. */
void kvd_tier_remote_done(struct kvd_tier *t, const struct kvd_remote_done *d);
/* kvd stops: queue the deletion of every copy in the cluster (sequences
 * do not outlive this lifetime there). */
void kvd_tier_remote_forget_all(struct kvd_tier *t);

struct kvd_tier_stats {
	uint64_t limit, high, low, used, reserved, disk_bytes;
	uint64_t spills, restores, drops, spill_errors, lost, spill_bytes, restore_bytes;
	uint64_t rem_puts, rem_drops, rem_fetches;      /* kvd_tier_set_remote */
	uint32_t on_disk, rem_only;
};
void kvd_tier_stats(const struct kvd_tier *t, struct kvd_tier_stats *st);

/* What the tier did, counted as it happens in relaxed atomics: the tier
 * bumps them on the state's side and knows nothing of who reads them;
 * kvd_metrics renders them live from any thread, without the state lock.
 * They live as long as the tier. */
enum { KVD_TIER_WRITE = 0, KVD_TIER_READ = 1 };         /* a write-back, a restore */
enum { KVD_TIER_OK = 0, KVD_TIER_ERROR = 1, KVD_TIER_CANCELLED = 2 };  /* how it ended */
#define KVD_TIER_IO_LE 15
/* The upper bounds, in seconds, of the buckets of io_le. */
extern const double kvd_tier_io_le[KVD_TIER_IO_LE];
struct kvd_tier_counters {
	_Atomic uint64_t io_n[2][3];    /* [kind][how] */
	_Atomic uint64_t io_bytes[2];   /* moved by the ones that ended ok */
	/* The ones that ended ok or in error, by the time from submission:
	 * per bucket (not cumulative), [KVD_TIER_IO_LE] above the last bound. */
	_Atomic uint64_t io_le[2][KVD_TIER_IO_LE + 1];
	_Atomic uint64_t io_sum_ns[2];
	_Atomic uint64_t evict[2];      /* left RAM: [1] written (after a write-back),
					 * [0] dropped (their file was current) */
	_Atomic uint64_t lost;          /* a restore, or the fetch of its file, failed */
};
const struct kvd_tier_counters *kvd_tier_counters(const struct kvd_tier *t);
/* durable: a synced file holds exactly q's data (its estimator state too:
 * an ATTEND of a hybrid or adaptive profile ends that); its bytes on disk. */
void kvd_tier_seq_info(const struct kvd_tier *t, const struct kvd_seqn *q, int *durable,
		       uint64_t *disk_bytes);

#endif
