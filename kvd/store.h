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
 */
#ifndef KVD_STORE_H
#define KVD_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "attn.h"
#include "lsh.h"

struct kvd_pool;

#define KVD_NAME_MAX 64

struct kvd_profile {
	uint32_t id;
	char name[KVD_NAME_MAX + 1];
	struct kvd_geom g;
	uint32_t layers, sink, window, seg_tokens, seal_tokens;
	uint64_t seed;
	uint8_t *dense;                 /* [layers]: 1 = stays on the GPU */
	float *W;                       /* [d][K*L] */
	struct kvd_logp_tab *tab;
};

struct kvd_layer_state {
	float *mean;                    /* [kv][d], NULL until the first PREFILL */
	struct kvd_seg **seg;
	uint32_t nseg, segcap;
	int sealed;                     /* prefill finished (KVD_RF_LAST seen) */
	/* prefill staging: rows of the next segment, [kv][cap][d] / [kv][L][cap] */
	uint16_t *sk, *sv, *sc;
	uint32_t sn, scap;
	/* tail: [kv][seal_tokens][d] / [kv][L][seal_tokens] */
	uint16_t *tk, *tv, *tc;
	uint32_t tn;
	uint64_t tokens;                /* tokens kvd holds for this layer */
};

/* Where a sequence's data is (kvd/tier.c moves it). */
enum kvd_seq_state {
	KVD_SEQ_RAM = 0,                /* all resident */
	KVD_SEQ_SPILLING,               /* all resident, a file being written */
	KVD_SEQ_DISK,                   /* nothing resident: a durable file holds it */
	KVD_SEQ_RESTORING,              /* layers below `ready` resident, the rest being read */
	KVD_SEQ_LOST,                   /* a restore failed: every use fails -KVD_ELOST */
};

struct kvd_seqn {
	uint64_t id;
	uint64_t owner;                 /* client id */
	char tenant[KVD_NAME_MAX + 1];
	const struct kvd_profile *p;
	struct kvd_layer_state *ly;     /* [layers] */
	size_t bytes;                   /* resident: segments + staging + tail + means */
	uint64_t gen;                   /* bumped by every change to the data */
	uint8_t state;                  /* enum kvd_seq_state */
	uint32_t ready;                 /* RESTORING: layers [0, ready) are usable */
	uint32_t node;                  /* NUMA node (index into the store's nodes) */
	void *tier;                     /* kvd_tier's record, or NULL */
	struct kvd_seqn *next;          /* hash chain */
};

struct kvd_store;

int kvd_store_create(struct kvd_pool *pool, struct kvd_store **out);
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
const struct kvd_profile *kvd_store_profile_by_id(struct kvd_store *s, uint32_t id);
const struct kvd_profile *kvd_store_profile_by_name(struct kvd_store *s, const char *name);

int kvd_store_seq_create(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
			 uint64_t owner, struct kvd_seqn **out);
/* The same with a given id (sequences found on disk at start-up): -EEXIST
 * when the id is taken. */
int kvd_store_seq_adopt(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
			uint64_t id, uint64_t owner, struct kvd_seqn **out);
/* NULL unless the sequence exists and belongs to `tenant`. */
struct kvd_seqn *kvd_store_seq_get(struct kvd_store *s, uint64_t id, const char *tenant);
void kvd_store_seq_free(struct kvd_store *s, struct kvd_seqn *q);
/* Calls fn on every sequence; fn may free the one it is given. */
void kvd_store_each(struct kvd_store *s, void (*fn)(void *arg, struct kvd_seqn *q), void *arg);

/* Tiering (kvd/tier.c).  drop frees every resident byte of a sequence but
 * keeps its identity and token counts; the install functions put restored
 * parts back, accounted.  A layer's tail rows are copied; a segment is
 * taken over. */
void kvd_store_seq_drop(struct kvd_store *s, struct kvd_seqn *q);
int kvd_store_install_layer(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const float *mean, int sealed, uint64_t tokens, const uint16_t *k,
			    const uint16_t *v, const uint16_t *codes, uint32_t tn);
int kvd_store_install_seg(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			  struct kvd_seg *seg);
/* Whether every sparse layer's prefill staging is empty: only then can the
 * sequence be written out whole (sealed segments, tails, means). */
int kvd_store_spillable(const struct kvd_seqn *q);

/* Rows entering a layer: PREFILL (append to staging, seal full segments,
 * and everything with `last`) or APPEND (the tail, sealed at seal_tokens).
 * mean is [kv][d] or NULL; k, v [kv][n][d] bf16; codes [kv][L][n].
 * 0, or a negative code with msg filled. */
int kvd_store_rows(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer, int append,
		   int last, const float *mean, const uint16_t *k, const uint16_t *v,
		   const uint16_t *codes, uint32_t n, char *msg, size_t msglen);

/* kvd's part of one layer for one sequence, for kvd_attn_layer(). */
struct kvd_layer_view kvd_store_view(const struct kvd_seqn *q, uint32_t layer);

struct kvd_store_stats {
	uint32_t sequences, profiles;
	uint64_t bytes;                 /* resident, all sequences */
};
void kvd_store_stats(const struct kvd_store *s, struct kvd_store_stats *st);
void kvd_store_seq_stats(const struct kvd_seqn *q, uint64_t *tokens, uint32_t *segments);

#endif
