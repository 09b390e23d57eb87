/* kvd_store: the model profiles and the sequences kvd holds.
 *
 * A profile is immutable once created: geometry, LSH parameters, sink and
 * window sizes, dense layers, and W.  A sequence belongs to one tenant and
 * one owning client; per sparse layer it has a centering mean, sealed
 * segments, the prefill staging area (rows of the segment being filled) and
 * the tail (rows appended after prefill, attended exactly until seal_tokens
 * of them are sealed into a segment).
 *
 * Single-threaded: only the daemon's event loop calls these; the attention
 * that reads segments runs on the pool while the loop waits for it.
 * Everything a client sent has been bounds-checked (kvd/wire.c) before it
 * reaches here; these functions still check what depends on the sequence's
 * state (token order, mean present, layer kind) and fail with a message.
 *
 * Limits (kvd/store/uidlimits.h), once kvd_store_set_limits() gave the store a
 * kvd_limits: every allocation a client can cause -- a sequence's struct
 * and layer array, prefill staging, tails, means, estimator state,
 * segments and their tables, a profile with its dense array, W and logp
 * table -- is charged to the sequence's (or the profile creator's) uid as
 * KVD_RES_MEMORY before it is made, and refused when the charge is:
 * -ENOMEM at the memory limit, -EDQUOT at memory_per_uid, with a message
 * naming the limit.  Sequences count against KVD_RES_SEQUENCES, profiles
 * against KVD_RES_PROFILES.
 * A sealed segment is charged once, to the uid of the sequence that sealed
 * (or read) it, and stays charged until its last holder lets go: a fork,
 * an attach or a snapshot holding it is not charged for it again, and the
 * store's total counts it once (each holder's own bytes count it in full).
 * A layer's open tail, shared copy-on-write by forks, is charged the same
 * way, to the uid whose sequence made it.
 * Everything is uncharged when freed or dropped.  Without limits nothing
 * is refused for the budget (the tier's pre-checks still apply), as before.
 *
 * Profiles live in namespaces (kvd_limits_namespace: a uid, or a sharing
 * group): kvd_store_profile_ns/find/get see only their namespace, so a uid
 * can neither read nor squat another's profile names.  A profile is
 * reference counted (each sequence using it, each client holding it) and
 * freed with its last reference; ids are never reused in a daemon's life.
 * The old kvd_store_profile/_by_id/_by_name work on KVD_STORE_NS_GLOBAL,
 * whose profiles are never freed, until the server has switched.
 */
#ifndef KVD_STORE_H
#define KVD_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/attn.h"
#include "engine/lsh.h"
#include "engine/model.h"
#include "uidlimits.h"

struct kvd_pool;

#define KVD_NAME_MAX KVD_MODEL_NAME_MAX

/* A profile's limits, kept by the store (a profile read back from a spill
 * file is checked against them, kvd/store/sfmt.c) and by the control
 * codec for a request (proto/ctl.h's KVD_CTL_*, which tests/unit/test_sfmt.c
 * holds equal to these): a profile on disk was once a valid request. */
#define KVD_PROFILE_LAYERS_MAX 1024
#define KVD_PROFILE_TOKENS_MAX 65536u   /* sink, window */
#define KVD_PROFILE_SEG_MIN    256u     /* seg_tokens: a power of two in [MIN, KVD_SEG_MAX] */
#define KVD_PROFILE_SEAL_MIN   16u      /* seal_tokens in [MIN, seg_tokens] */
/* The content-key chunk of a profile that names none: KVD_PROFILE_CHUNK_DEFAULT
 * tokens when that divides seal, else the largest divisor of seal below it
 * (kvd_store_chunk_default).  A chunk_tokens that is not 0 divides
 * seal_tokens. */
#define KVD_PROFILE_CHUNK_DEFAULT 256u
uint32_t kvd_store_chunk_default(uint32_t seal);

struct kvd_profile {
	uint32_t id;                    /* unique in a daemon's life, never 0 */
	uint32_t ns;                    /* namespace (KVD_STORE_NS_GLOBAL: old API) */
	uint32_t uid;                   /* its creator: charged for its bytes */
	/* name, g, layers, sink, window, seg_tokens, seal_tokens, chunk_tokens
	 * (content-key chunk, divides seal_tokens; 0: kvd_store_chunk_default
	 * (seal_tokens)), seed, estimator (part of equality): engine/model.h,
	 * by name or as p->model for the control codec */
	union {
		struct { KVD_MODEL_FIELDS };
		struct kvd_model model;
	};
	uint8_t *dense;                 /* [layers]: 1 = stays on the GPU */
	float *W;                       /* [d][K*L] */
	struct kvd_logp_tab *tab;       /* [2]: L tables, then KVD_LCV_LO(L) (hybrid_lcv's
					 * reduced budget) */
};

/* Where a sequence's data is (kvd/store/tier.c moves it). */
enum kvd_seq_state {
	KVD_SEQ_RAM = 0,                /* all resident */
	KVD_SEQ_SPILLING,               /* all resident, a file being written */
	KVD_SEQ_DISK,                   /* nothing resident: a durable file holds it */
	KVD_SEQ_RESTORING,              /* layers below `ready` resident, the rest being read */
	KVD_SEQ_LOST,                   /* a restore failed: every use fails -KVD_ELOST */
};

/* A sequence.  Its fields are the store's (and the tier's, kvd/store/tier.c,
 * which moves its data): kvd/store/store_int.h.  Everyone else reads it through
 * the kvd_store_seq_* functions below, so every rule about a sequence's
 * state lives here. */
struct kvd_seqn;

struct kvd_store;

/* The namespace of the old, global profile API: no uid has it (uids at
 * and above KVD_NS_GROUP are groups or refused). */
#define KVD_STORE_NS_GLOBAL 0xfffffffeu

int kvd_store_create(struct kvd_pool *pool, struct kvd_store **out);
/* Charge everything to l from now on (see above).  Before any sequence or
 * profile exists (-EBUSY otherwise); destroy the store before l. */
int kvd_store_set_limits(struct kvd_store *s, struct kvd_limits *l);
struct kvd_limits *kvd_store_limits(const struct kvd_store *s);
/* The tier's budget policy (kvd_tier_room_uid), asked by kvd_store_rows,
 * with limits set, for the least it will charge to the sequence's uid
 * before it changes anything: 0,
 * -EINPROGRESS (room is being made: run the request again later, nothing
 * was changed) or -ENOMEM with msg.  kvd_tier_create sets it. */
typedef int (*kvd_store_room_fn)(void *arg, uint32_t uid, uint64_t bytes, char *msg,
				 size_t msglen);
void kvd_store_set_room(struct kvd_store *s, kvd_store_room_fn fn, void *arg);
/* The tier's residency policy (kvd_tier_want), asked by
 * kvd_store_attend_view for the layer a record attends: 0 when it is
 * resident, -EINPROGRESS while it is being restored (nothing changed: ask
 * again later), or another negative code with msg (-KVD_ELOST, -ENOMEM).
 * kvd_tier_create sets it; without one every sequence is resident. */
typedef int (*kvd_store_want_fn)(void *arg, struct kvd_seqn *q, uint32_t layer, char *msg,
				 size_t msglen);
void kvd_store_set_want(struct kvd_store *s, kvd_store_want_fn fn, void *arg);
/* A cache's policy under pressure (kvd_share: published snapshots, which
 * kvd_share_create sets): free at least `need` bytes of memory, of uid's
 * (any 0: under its per-uid limit) or of anyone's (any 1: under the global
 * limit), least recently used first, from what no request is using; return
 * the bytes freed (0: nothing, also when `need` cannot be met).  With limits
 * set, a memory charge that a limit refuses asks it for the difference, then
 * is tried once more; the tier asks it before its budget refuses. */
typedef uint64_t (*kvd_store_reclaim_fn)(void *arg, uint32_t uid, int any, uint64_t need);
void kvd_store_set_reclaim(struct kvd_store *s, kvd_store_reclaim_fn fn, void *arg);
uint64_t kvd_store_reclaim(struct kvd_store *s, uint32_t uid, int any, uint64_t need);
/* Bytes a layer above keeps for every sequence (the tier's record), made
 * part of each sequence's fixed bytes: charged with them at SeqCreate (a
 * refusal there is the client's answer) and given back with them when the
 * sequence is freed, so that the layer never charges them on its own.
 * Before any sequence exists (-EBUSY otherwise).  kvd_tier_create sets it. */
int kvd_store_set_seq_extra(struct kvd_store *s, size_t bytes);
/* NUMA: sequences are spread over n nodes (the one with the fewest resident
 * bytes takes the next sequence); node i seals on pools[i] and allocates
 * with kvd_mem_alloc_node(mem[i]).  Before any sequence exists.  Without
 * it: one node, the create's pool, no placement. */
#define KVD_STORE_NODES 64
int kvd_store_nodes(struct kvd_store *s, struct kvd_pool *const *pools, const int *mem,
		    unsigned n);
struct kvd_pool *kvd_store_pool(const struct kvd_store *s, const struct kvd_seqn *q);
int kvd_store_mem_node(const struct kvd_store *s, const struct kvd_seqn *q);
void kvd_store_destroy(struct kvd_store *s);

/* A profile from validated fields (geometry already checked by the caller).
 * A name that exists with identical fields returns the existing profile; with
 * different fields, -EEXIST. */
int kvd_store_profile(struct kvd_store *s, const struct kvd_profile *want,
		      const struct kvd_profile **out);
/* Old API: any namespace by id; KVD_STORE_NS_GLOBAL by name. */
const struct kvd_profile *kvd_store_profile_by_id(struct kvd_store *s, uint32_t id);
const struct kvd_profile *kvd_store_profile_by_name(struct kvd_store *s, const char *name);

/* Create-or-open want->name in namespace ns (want->id, ns, uid ignored;
 * want->W, when not NULL, is W already made from want->seed, copied instead
 * of made again -- the daemon makes a big one without holding its lock):
 * identical fields return the existing profile, different ones -EEXIST
 * (only names within ns collide).  A new profile is charged to uid
 * (KVD_RES_PROFILES 1 and its bytes as KVD_RES_MEMORY) before anything is
 * allocated.  Either way the caller gets a reference (drop it with
 * kvd_store_profile_unref).  -EACCES for KVD_NS_NONE, -EOVERFLOW when
 * 2^32-1 profile ids are used up; msg says why (may be NULL). */
int kvd_store_profile_ns(struct kvd_store *s, uint32_t ns, uint32_t uid,
			 const struct kvd_profile *want, const struct kvd_profile **out, char *msg,
			 size_t msglen);
/* NULL unless a profile of that name / id is in ns.  No reference taken. */
const struct kvd_profile *kvd_store_profile_find(struct kvd_store *s, uint32_t ns,
						 const char *name);
const struct kvd_profile *kvd_store_profile_get(struct kvd_store *s, uint32_t ns, uint32_t id);
/* References: the last unref frees the profile and uncharges its creator
 * (old-API profiles hold a permanent one). */
void kvd_store_profile_ref(struct kvd_store *s, const struct kvd_profile *p);
void kvd_store_profile_unref(struct kvd_store *s, const struct kvd_profile *p);
/* What a profile of this geometry costs: struct, dense, W, logp table. */
size_t kvd_store_profile_bytes(const struct kvd_profile *p);

/* "1000:chat" -> 1000: the number before ':' in a tenant; 0 without one. */
uint32_t kvd_store_tenant_uid(const char *tenant);
/* uid is kvd_store_tenant_uid(tenant). */
int kvd_store_seq_create(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
			 uint64_t owner, struct kvd_seqn **out);
/* The same, charged to uid (KVD_RES_SEQUENCES 1, its struct and layer
 * array as memory) before anything is allocated: 0, or -EDQUOT / -ENOSPC /
 * -ENOMEM with msg (may be NULL).  The sequence takes a reference on p. */
int kvd_store_seq_create_uid(struct kvd_store *s, const struct kvd_profile *p, uint32_t uid,
			     const char *tenant, uint64_t owner, struct kvd_seqn **out, char *msg,
			     size_t msglen);
/* A copy-on-write child of parent (SeqFork: parallel samples, beams): the
 * same profile, charged to uid and owned by `owner` under `tenant`; every
 * layer's mean, token count and estimator state are copied, its sealed
 * segments and open tails shared (reference counted, freed with their last
 * holder; a shared tail is copied by whichever holder next APPENDs to that
 * layer, charged then, in kvd_store_rows).  What the child copies is
 * charged to it before anything is allocated; what it shares stays charged
 * once, to whoever made it, so no memory is held that nobody was charged
 * for.  No tail rows are copied here: the cost is the layers' means and
 * tables, not their open rows.  -EAGAIN unless parent is resident,
 * -EBUSY while a layer of parent is mid-prefill, else as
 * kvd_store_seq_create_uid; msg says why. */
int kvd_store_seq_fork(struct kvd_store *s, struct kvd_seqn *parent, uint32_t uid,
		       const char *tenant, uint64_t owner, struct kvd_seqn **out, char *msg,
		       size_t msglen);
/* What kvd_store_seq_fork of parent charges: its struct and everything it
 * holds (for the tier to make room first). */
size_t kvd_store_fork_bytes(const struct kvd_seqn *parent);
/* The same with a given id (sequences found on disk at start-up): -EEXIST
 * when the id is taken; charged as kvd_store_seq_create (uid from tenant). */
int kvd_store_seq_adopt(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
			uint64_t id, uint64_t owner, struct kvd_seqn **out);
/* NULL unless the sequence exists and belongs to `tenant`. */
struct kvd_seqn *kvd_store_seq_get(struct kvd_store *s, uint64_t id, const char *tenant);
void kvd_store_seq_free(struct kvd_store *s, struct kvd_seqn *q);
/* Calls fn on every sequence; fn may free the one it is given. */
void kvd_store_each(struct kvd_store *s, void (*fn)(void *arg, struct kvd_seqn *q), void *arg);
/* A bounded walk for listings: fn on the sequences with ids above `after`
 * in ascending id order, until fn returns nonzero or about `budget`
 * sequences were looked at (whole hash buckets, each a range of ids).
 * Returns the id to go on after: the one fn stopped at, the end of the
 * last range looked at when the budget ran out (no sequence's id, possibly),
 * or 0 when every sequence above `after` was seen.  fn must not create or
 * free sequences. */
uint64_t kvd_store_each_after(struct kvd_store *s, uint64_t after, uint32_t budget,
			      int (*fn)(void *arg, struct kvd_seqn *q), void *arg);
/* Any tenant's sequence (admin requests): NULL unless it exists, is not
 * being freed and is not a published snapshot (kvd/store/share.h owns
 * those). */
struct kvd_seqn *kvd_store_seq_any(struct kvd_store *s, uint64_t id);
/* Calls fn on every profile with its reference count; fn must not create,
 * reference or free profiles. */
void kvd_store_profile_each(struct kvd_store *s,
			    void (*fn)(void *arg, const struct kvd_profile *p, uint32_t refs),
			    void *arg);

/* Tiering (kvd/store/tier.c).  drop frees every resident byte of a sequence but
 * keeps its identity and token counts (and its fixed bytes); the install
 * functions put restored parts back, accounted.  A layer's tail and a
 * segment are taken over, never copied.  Install charges without checking
 * caps: the tier reserved the room before the restore
 * (kvd_store_install_bytes) and gives back, as it installs, what each call
 * added to q->bytes. */
void kvd_store_seq_drop(struct kvd_store *s, struct kvd_seqn *q);
/* A restore's tail: made before the read (kvd_store_rtail_new, uncharged:
 * the restore's reservation stands for it), filled with the LAYER extent's
 * tn rows on the spill thread as the extent verifies (kvd_store_rtail_fill
 * touches only the tail, so no lock), then taken over by
 * kvd_store_install_layer (tail, when tn > 0), which charges it.  So the
 * state lock pays neither for the copy (up to seal_tokens rows, 65536 in a
 * profile that asks) nor for faulting in its fresh pages.  One never taken
 * over goes with kvd_store_rtail_free. */
struct kvd_tail *kvd_store_rtail_new(struct kvd_store *s, const struct kvd_seqn *q);
void kvd_store_rtail_fill(const struct kvd_profile *p, struct kvd_tail *t, const uint16_t *k,
			  const uint16_t *v, const uint16_t *codes, uint32_t tn);
void kvd_store_rtail_free(const struct kvd_profile *p, struct kvd_tail *t);
int kvd_store_install_layer(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const float *mean, int sealed, uint64_t tokens, struct kvd_tail *tail,
			    uint32_t tn);
int kvd_store_install_seg(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			  struct kvd_seg *seg);
/* What installing a layer adds besides its segments' io buffers: the mean,
 * the tail buffer (when tn > 0) and a table for nseg segments. */
size_t kvd_store_install_bytes(const struct kvd_seqn *q, int mean, uint32_t tn, uint32_t nseg);
/* A write-back's hold on layer `layer`'s tail: a reference that keeps the
 * rows [0, tail_n) as they are while the file is written off the state lock
 * (an APPEND copies a shared tail first), counted in no sequence's bytes;
 * NULL when the layer has no tail.  kvd_store_tail_bufs gives the buffers,
 * [kv][seal_tokens][d] and [kv][L][seal_tokens]; kvd_store_tail_drop lets
 * go, and the last holder frees and uncharges.  Hold and drop under the
 * state lock; the buffers may be read anywhere in between. */
struct kvd_tail *kvd_store_tail_hold(struct kvd_seqn *q, uint32_t layer);
void kvd_store_tail_bufs(const struct kvd_tail *t, const uint16_t **k, const uint16_t **v,
			 const uint16_t **codes);
void kvd_store_tail_drop(struct kvd_store *s, const struct kvd_profile *p, struct kvd_tail *t);
/* Whether every sparse layer's prefill staging is empty: only then can the
 * sequence be written out whole (sealed segments, tails, means). */
int kvd_store_spillable(const struct kvd_seqn *q);
/* A unit that may change q is running: the executor's for its whole unit,
 * and kvd_store_rows for its own change, during which other requests run
 * between the slices of a seal.  While pinned, q is no write-back's victim
 * and no file may capture it (a file must hold a state q really had when
 * the change was done, see gen).  Pins nest; each pin has its unpin. */
void kvd_store_seq_pin(struct kvd_seqn *q);
void kvd_store_seq_unpin(struct kvd_seqn *q);
int kvd_store_seq_pinned(const struct kvd_seqn *q);

/* Rows entering a layer: PREFILL (append to staging, seal full segments,
 * and everything with `last`) or APPEND (the tail, sealed at seal_tokens;
 * a tail shared with a fork is first copied into one of q's own).
 * mean is [kv][d] or NULL; k, v [kv][n][d] bf16; codes [kv][L][n].
 * 0, or a negative code with msg filled.  With limits, the most the call
 * will hold at once is checked before anything changes: -EINPROGRESS from
 * the room function, or -ENOMEM / -EDQUOT, leave the sequence untouched. */
int kvd_store_rows(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer, int append,
		   int last, const float *mean, const uint16_t *k, const uint16_t *v,
		   const uint16_t *codes, uint32_t n, char *msg, size_t msglen);

/* kvd's part of one layer for one sequence, for kvd_attn_layer(). */
struct kvd_layer_view kvd_store_view(const struct kvd_seqn *q, uint32_t layer);

/* Whether layer (< the profile's layers) of q can be attended: -EBUSY while
 * its prefill is under way (a mean came, KVD_RF_LAST has not), because the
 * rows staged for the segment being filled are in no view and an answer
 * would silently leave them out; 0 otherwise.  Residency is the tier's
 * question (kvd_tier_want), asked first. */
int kvd_store_attend_ready(const struct kvd_seqn *q, uint32_t layer);

/* Everything one ATTEND record reads of a sequence's layer, valid until the
 * sequence next changes. */
struct kvd_store_attend_view {
	struct kvd_seqn *q;
	const struct kvd_profile *p;
	struct kvd_layer_view lv;       /* segments and tail (kvd_store_view) */
	uint32_t *heavy;                /* estimator state (kvd_store_layer_heavy), or NULL */
	struct kvd_pool *pool;          /* the pool of the sequence's node (kvd_store_pool) */
	uint32_t node;                  /* kvd_store_seq_node */
};
/* The executor's one call per ATTEND record: sequence id of tenant, attended
 * at layer with profile pid, checked in the order the answers need.
 * -ENOENT unless it exists, is tenant's and has profile pid (an id the
 * client freed, or reused for another profile, since the entry was
 * checked); 1 when pool is not NULL and the sequence's pool is another
 * (its node's pass comes later; nothing was asked of the tier); else the
 * want hook's answer for the layer unless 0 (-EINPROGRESS while it is
 * restored); -EBUSY while its prefill is under way (kvd_store_attend_ready);
 * 0 with *v filled, the estimator state allocated on first use.  msg says
 * why on a negative code.  layer is below the profile's layers (the entry
 * was checked against pid's). */
int kvd_store_attend_view(struct kvd_store *s, uint64_t id, const char *tenant, uint32_t pid,
			  uint32_t layer, const struct kvd_pool *pool,
			  struct kvd_store_attend_view *v, char *msg, size_t msglen);

/* A sequence's identity and state, read-only.  ready_layers: how many
 * layers, from 0, can be used now (all when resident, those restored so
 * far while RESTORING, none on disk or lost). */
uint64_t kvd_store_seq_id(const struct kvd_seqn *q);
uint64_t kvd_store_seq_owner(const struct kvd_seqn *q);
uint32_t kvd_store_seq_uid(const struct kvd_seqn *q);
const char *kvd_store_seq_tenant(const struct kvd_seqn *q);
const struct kvd_profile *kvd_store_seq_profile(const struct kvd_seqn *q);
size_t kvd_store_seq_bytes(const struct kvd_seqn *q);
/* What dropping q would give back now: its bytes less the segments another
 * sequence also holds. */
size_t kvd_store_seq_freeable(const struct kvd_seqn *q);
/* What freeing all of qs[0..n) (distinct sequences) at once would give back
 * now, bookkeeping included: segments and client rows count when every one
 * of their holders is in the set.  Without memory to count: an upper bound. */
uint64_t kvd_store_freeable_set(struct kvd_seqn *const *qs, size_t n);
uint64_t kvd_store_seq_gen(const struct kvd_seqn *q);
enum kvd_seq_state kvd_store_seq_state(const struct kvd_seqn *q);
uint32_t kvd_store_seq_ready_layers(const struct kvd_seqn *q);
uint32_t kvd_store_seq_node(const struct kvd_seqn *q);
/* Gives q to client `owner` (SEQ_OPEN): 0, -EBUSY when another client
 * owns it, or -ENOMEM.  A sequence whose owner left (owner 0) can be taken. */
int kvd_store_seq_claim(struct kvd_store *s, struct kvd_seqn *q, uint64_t owner);
/* q has no owner from now on (it is being freed). */
void kvd_store_seq_disown(struct kvd_store *s, struct kvd_seqn *q);
/* How many sequences client `owner` holds, and each of them to fn (which
 * may free it), in no particular order: kept per owner, so both cost what
 * the client owns, not a walk of every sequence. */
uint32_t kvd_store_owner_count(struct kvd_store *s, uint64_t owner);
unsigned kvd_store_each_owned(struct kvd_store *s, uint64_t owner,
			      void (*fn)(void *arg, struct kvd_seqn *q), void *arg);

/* One layer's parts, read-only, valid until q next changes: the centering
 * mean ([kv][d], NULL before the first PREFILL), the tokens kvd holds, and
 * the tail's codes ([kv][L][seal_tokens], NULL without a tail; the tail's
 * rows are in kvd_store_view). */
const float *kvd_store_layer_mean(const struct kvd_seqn *q, uint32_t layer);
uint64_t kvd_store_layer_tokens(const struct kvd_seqn *q, uint32_t layer);
const uint16_t *kvd_store_layer_tail_codes(const struct kvd_seqn *q, uint32_t layer);

/* The estimator state of a sparse layer (kvd_heavy_words of the profile's
 * geometry), allocated zero-filled and charged to the sequence's uid
 * (KVD_RES_MEMORY, counted in q->bytes like a mean) on first use; NULL for
 * magicpig profiles, dense layers, layers not resident (on disk, not yet
 * restored), or when the charge or the allocation fails (the layer is then
 * attended by magicpig: an answer is never refused for it).  Freed with the
 * layer's other resident data (kvd_store_seq_drop, seq free).  Part of the
 * sequence like its rows: the tier writes it to the spill file (a HEAVY
 * extent) and kvd_store_install_heavy puts it back, so a sequence that was
 * spilled and restored answers as if it never left.  Handing it out bumps
 * the sequence's gen (the step that gets it rewrites it after), so a file
 * written before no longer counts as current.  Event loop only: the pool
 * job that attends the layer gets the pointer from here. */
uint32_t *kvd_store_layer_heavy(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer);
/* The bytes of one layer's estimator state (kvd_heavy_words * 4). */
size_t kvd_store_heavy_bytes(const struct kvd_seqn *q);
/* A layer's state read back from a spill file (HEAVY extent): words are
 * kvd_store_heavy_bytes(q) bytes, copied; charged without a check (the tier
 * reserved the room, kvd_store_heavy_bytes).  -EINVAL for a magicpig
 * profile, a dense layer, a layer out of range or one that has state
 * already; -ENOMEM. */
int kvd_store_install_heavy(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const uint32_t *words);

/* ---- prefix sharing (kvd/store/share.c builds on these) ----------------
 *
 * The client's own rows of a layer -- the sinks and window of a sparse
 * layer, every row of a dense one, as the client keeps them (bf16, keys of
 * sparse layers centered) -- which kvd holds only so that a sequence
 * attaching a published prefix can fetch them.  put appends rows [row0,
 * row0+n) (row0 must be the rows put so far, or 0 to start the layer
 * again), charged to the sequence's uid before anything is allocated; k, v
 * are [kv][n][d] and copied once.  A blob shared with a snapshot is never
 * changed: a put then starts a private one.  get copies rows out; -ERANGE
 * beyond what was put.  Rows entering the sequence (kvd_store_rows) drop
 * them: they no longer describe it.  The tier writes them with the
 * sequence (LOCAL extents) and drops them with its RAM. */
int kvd_store_local_put(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer, uint32_t row0,
			const uint16_t *k, const uint16_t *v, uint32_t n, char *msg, size_t msglen);
uint32_t kvd_store_local_rows(const struct kvd_seqn *q, uint32_t layer);
/* What kvd_store_local_put of rows [row0, row0+n) would charge (for the
 * tier to make room first). */
size_t kvd_store_local_need(const struct kvd_seqn *q, uint32_t layer, uint32_t row0, uint32_t n);
int kvd_store_local_get(const struct kvd_seqn *q, uint32_t layer, uint32_t row0, uint32_t n,
			uint16_t *k, uint16_t *v);
/* A layer's rows read back from a spill file (LOCAL extent): charged
 * without a check (the tier reserved the room).  -EINVAL when the layer
 * has rows already. */
int kvd_store_install_local(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const uint16_t *k, const uint16_t *v, uint32_t n);
/* to takes from's rows: moved (from keeps none) or shared (a reference). */
void kvd_store_local_give(struct kvd_store *s, struct kvd_seqn *from, struct kvd_seqn *to,
			  int move);
/* Bytes of q's rows blob (0 without one); shared blobs count in each. */
size_t kvd_store_local_bytes(const struct kvd_seqn *q);
/* A published snapshot, under key (16 bytes) with `tokens` tokens:
 * kvd_store_seq_get and claims no longer find it; the tier writes the key
 * into its file. */
void kvd_store_seq_hide(struct kvd_seqn *q, const uint8_t *key, uint64_t tokens);
int kvd_store_seq_hidden(const struct kvd_seqn *q);
/* A hidden sequence's key (16 bytes) and tokens; NULL for any other. */
const uint8_t *kvd_store_seq_pubkey(const struct kvd_seqn *q, uint64_t *tokens);
/* No longer a snapshot: an ordinary sequence without an owner. */
void kvd_store_seq_unhide(struct kvd_seqn *q);

struct kvd_store_stats {
	uint32_t sequences, profiles;
	uint64_t bytes;                 /* resident, all sequences */
	uint64_t profile_bytes;         /* all profiles (charged to their creators) */
	uint64_t fixed_bytes;           /* all sequences' structs and layer arrays */
	uint64_t local_bytes;           /* clients' rows kept for sharing (once each) */
};
/* Per-uid usage is kvd_limits_uid_usage / kvd_limits_each on
 * kvd_store_limits(s). */
void kvd_store_stats(const struct kvd_store *s, struct kvd_store_stats *st);
void kvd_store_seq_stats(const struct kvd_seqn *q, uint64_t *tokens, uint32_t *segments);

#endif
