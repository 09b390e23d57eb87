/* The store's private part: a sequence's and its layers' fields.
 *
 * Only kvd/store/store.c and the tier (tier_int.h) include this.  The tier is the store's
 * close partner: it moves a sequence's data between RAM and disk (state,
 * ready, gen, its record in `tier`) and writes a layer's parts out as they
 * lie.  Everyone else goes through the functions in store.h, so that the
 * rules about a sequence's state (which layer can be attended, who owns
 * it) stay in one place.
 */
#ifndef KVD_STORE_INT_H
#define KVD_STORE_INT_H

#include "store.h"

struct kvd_layer_state {
	float *mean;                    /* [kv][d], NULL until the first PREFILL */
	struct kvd_seg **seg;
	uint32_t nseg, segcap;
	int sealed;                     /* prefill finished (KVD_RF_LAST seen) */
	/* Prefill staging: rows of the segment being filled, K and V
	 * [kv][stage_cap][d], codes [kv][L][stage_cap]; stage_n rows used. */
	uint16_t *stage_k, *stage_v, *stage_codes;
	uint32_t stage_n, stage_cap;
	/* The tail (APPEND after prefill), K and V [kv][seal_tokens][d], codes
	 * [kv][L][seal_tokens]; tail_n rows used, sealed into a segment when
	 * it reaches seal_tokens.  tail_k, tail_v, tail_codes are tail's
	 * buffers (NULL without one), which forks share (struct kvd_tail). */
	struct kvd_tail *tail;
	uint16_t *tail_k, *tail_v, *tail_codes;
	uint32_t tail_n;
	uint64_t tokens;                /* tokens kvd holds for this layer */
	/* The estimator's state (kvd_store_layer_heavy): kvd_heavy_words(g)
	 * words, counted in q->bytes; NULL until first used (and always for
	 * magicpig).  Written to spill files (HEAVY extents) with the rows. */
	uint32_t *heavy;
};

/* A layer's tail buffers, shared copy-on-write: a fork (SeqFork, a
 * publish's snapshot, an attach) takes a reference instead of copying, so
 * that a fork costs the state lock no copy of every layer's open rows.
 * Nobody writes a tail that another sequence holds (refs - io > 1): a
 * holder about to write (an APPEND) first makes its own copy (tail_own in
 * store.c), and the rows [0, tail_n) each holder sees stay as they were.  Charged once, like a segment, to
 * chg_uid (whoever made it), counted once in the store's total and in
 * full in every holder's bytes; the last holder's put frees and uncharges
 * it.  A write-back reading the rows off the lock holds one too (io): it
 * reads the rows [0, tail_n) it found, so the layer may still APPEND after
 * them in place, as long as it does not seal (that starts the rows over at
 * 0, tail_copy_needed in store.c). */
struct kvd_tail {
	uint32_t refs;
	uint32_t io;                    /* of refs, write-backs' (kvd_store_tail_hold) */
	uint32_t chg_uid, chg_node;
	uint16_t *k, *v, *codes;
};

/* The client's own rows of a sequence (kvd_store_local_put), kept for the
 * sequences that attach it once it is published: reference counted (the
 * snapshot and every attached child), charged once to `uid`, never spilled.
 * Per layer K and V [kv][cap][d] bf16, n rows used. */
struct kvd_local {
	uint32_t refs, uid;
	size_t bytes;
	struct kvd_local_layer {
		uint16_t *k, *v;
		uint32_t n, cap;
	} ly[];                         /* [layers] */
};

struct kvd_seqn {
	uint64_t id;
	uint64_t owner;                 /* client id */
	uint32_t uid;                   /* charged for it (the number before ':' in tenant) */
	char tenant[KVD_NAME_MAX + 1];
	const struct kvd_profile *p;
	struct kvd_layer_state *ly;     /* [layers] */
	size_t bytes;                   /* resident: segments and their tables, staging,
					 * tail, means (0 on disk); shared segments in
					 * full, as if private */
	size_t segb;                    /* the segments' part of bytes: each segment
					 * is charged once, to its chg_uid, not to
					 * every holder (kvd_store_seq_freeable) */
	size_t fixed;                   /* the struct, its layer array and the tier's
					 * record: charged, and kept when dropped, but
					 * not in bytes */
	uint64_t gen;                   /* bumped before and after every change to the
					 * data: a state seen mid-change has a gen the
					 * sequence no longer has once it is done */
	uint32_t pins;                  /* units changing it now (kvd_store_seq_pin) */
	uint8_t state;                  /* enum kvd_seq_state */
	uint32_t ready;                 /* RESTORING: layers [0, ready) are usable */
	uint32_t node;                  /* NUMA node (index into the store's nodes) */
	void *tier;                     /* kvd_tier's record, or NULL */
	struct kvd_local *loc;          /* the client's rows, or NULL */
	uint8_t hidden;                 /* a published snapshot: no client names it */
	uint8_t pubkey[16];             /* hidden: the key it is published under, */
	uint64_t pubtok;                /* and its tokens (written in its file: PUB) */
	struct kvd_seqn *next;          /* hash chain */
	struct kvd_seqn *onext, *oprev; /* its owner's list (owner != 0) */
};

#endif
