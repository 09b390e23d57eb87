/* kvd_share: prefixes published by content key, and attaching them.
 *
 * A published prefix is a snapshot: a hidden copy-on-write fork of the
 * publishing sequence as it was when it published (its sealed segments and
 * open tails shared, reference counted; its means copied) together with
 * the client's own rows it sent with LOCAL (kvd_store_local_*), filed under
 * (namespace, profile, key of its last chunk).  An attach forks the
 * snapshot for the attaching client, so the child is bit for bit the
 * publisher at that moment: its answers equal those of a private sequence
 * given the same rows in the same calls.  The namespace is the caller's
 * (kvd_limits_namespace: its uid or its sharing group); lookups never leave
 * it, so a miss and another namespace's hit look the same.
 *
 * Snapshots are sequences to the tier: charged to the publisher's uid,
 * counted against its sequences, written out and restored like any other.
 * A published prefix is a cache, and gives way under pressure:
 *  - when a memory charge is refused at a limit, or the tier's budget would
 *    refuse a request (kvd_store_reclaim, set by kvd_share_create), the
 *    least recently published or attached snapshots go until the room is
 *    made: any uid's for the global limit, the uid's own for memory_per_uid.
 *    Resident ones first, then those on disk (only their bookkeeping is in
 *    memory); never one an attach is using, or one whose I/O runs.  When
 *    even all of them could not make the room, none goes;
 *  - when a publish is refused for the uid's limits (a count, not bytes),
 *    up to four of that uid's least recently used snapshots are dropped;
 *  - an admin drops them by key (kvd_share_drop_key).
 * A snapshot's segments are freed with their last holder: a sequence that
 * attached it keeps its own references and every row, so a snapshot that
 * gives way frees only what no one else holds.
 * A snapshot that is lost on disk drops out at its next attach (a miss).
 *
 * Single-threaded: the daemon's state lock, like the store.
 */
#ifndef KVD_SHARE_H
#define KVD_SHARE_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"
#include "tier.h"

#define KVD_SHARE_KEY 16                /* bytes of a content key (XXH3-128) */
#define KVD_SHARE_MAX_KEYS 2048         /* keys in one attach (a request is <= 64 KiB) */

struct kvd_share;

int kvd_share_create(struct kvd_store *st, struct kvd_tier *t, struct kvd_share **out);
/* Frees every snapshot (their files go: a published prefix does not outlive
 * kvd).  Before kvd_tier_stopping and the store's destruction. */
void kvd_share_destroy(struct kvd_share *sh);

/* Publishes q (ns: its caller's namespace) under key: `tokens` is its length,
 * a multiple of the profile's chunk_tokens.  q must be resident with every
 * layer's prefill done; per layer the rows kvd holds plus the client rows
 * put with LOCAL must be `tokens` (dense layers: all rows put).  Those rows
 * move to the snapshot.  0 (also when key is published already: nothing
 * changes), -EINVAL, -EAGAIN (q on disk), -EBUSY (mid-prefill), or a
 * refusal of the limits once the uid's other snapshots are gone. */
int kvd_share_publish(struct kvd_share *sh, uint32_t ns, struct kvd_seqn *q,
		      const uint8_t *key, uint64_t tokens, char *msg, size_t msglen);

/* Attaches the longest published prefix of ns and profile p named by keys
 * (nkeys of KVD_SHARE_KEY bytes; key i names chunks 0..i): a new sequence
 * for (uid, tenant, owner) either way, *tokens the prefix's length (0: a
 * miss, the sequence is empty).  -EAGAIN when the prefix is on disk (its
 * restore has started: ask again), else as kvd_store_seq_create_uid. */
int kvd_share_attach(struct kvd_share *sh, uint32_t ns, const struct kvd_profile *p,
		     const uint8_t *keys, uint32_t nkeys, uint32_t uid, const char *tenant,
		     uint64_t owner, struct kvd_seqn **out, uint64_t *tokens, char *msg,
		     size_t msglen);

/* The remote tier (remote.h), or NULL: published prefixes are sent there
 * once their file is written, and an attach whose longest key is not
 * published here asks it first (-EAGAIN meanwhile). */
struct kvd_remote;
struct kvd_remote_done;
void kvd_share_set_remote(struct kvd_share *sh, struct kvd_remote *rem);
/* A lookup finished (kvd_remote_poll): its file is taken in. */
void kvd_share_remote_done(struct kvd_share *sh, const struct kvd_remote_done *d);

struct kvd_share_usage {
	uint32_t ns, published;
	uint64_t published_tokens, hit_tokens, miss_tokens, shared_bytes, saved_bytes;
};
/* Calls fn for every namespace that published or attached. */
void kvd_share_each(const struct kvd_share *sh,
		    void (*fn)(void *arg, const struct kvd_share_usage *u), void *arg);

/* One published prefix, for kvctl shares. */
struct kvd_share_info {
	uint8_t key[KVD_SHARE_KEY];
	uint64_t seq;                   /* the snapshot's sequence id (hidden from SeqList) */
	uint32_t ns, uid, profile_id;   /* uid: the publisher's, charged for it */
	uint64_t tokens;
	uint64_t bytes;                 /* resident, its client rows included */
	uint64_t freeable;              /* what dropping it gives back now */
	uint64_t attaches;              /* since it was published */
	uint64_t idle_ns;               /* since its publish or last attach */
	enum kvd_seq_state state;
};
/* Calls fn for every published prefix, most recently used first; fn must
 * not publish, attach or drop. */
void kvd_share_list(const struct kvd_share *sh,
		    void (*fn)(void *arg, const struct kvd_share_info *i), void *arg);
/* Drops every snapshot filed under key (any namespace, any profile), *n of
 * them: sequences attached from them keep their rows.  0 (also when none
 * is filed under it: *n 0), or -EBUSY when every one under it is in use. */
int kvd_share_drop_key(struct kvd_share *sh, const uint8_t *key, unsigned *n);

#endif
