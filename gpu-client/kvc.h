/* libkvclient: the decoding process's side of kvd.
 *
 * A client connects to kvd, opens one model profile, and per sequence keeps
 * the sink tokens and a recent window of every sparse layer itself ("on the
 * GPU"), sending everything else to kvd.  Attention is the LSE merge of the
 * client's exact part with kvd's sampled part.  This is the CPU backend: it
 * does the GPU's share (centering, hashing, window attention, merge) on the
 * CPU so the whole path runs anywhere; the CUDA backend implements the same
 * functions.
 *
 * Threading: a struct kvc is used by one thread at a time.  Every call
 * returns 0 (or a count) or a negative code (-errno or -KVD_E*); the reason
 * is then in kvc_last_error().  Keys and values are float32, raw (post-RoPE,
 * not centered); queries too.
 */
#ifndef KVC_H
#define KVC_H

#include <stddef.h>
#include <stdint.h>

struct kvc;
struct kvc_seq;

struct kvc_opts {
	const char *socket_path;        /* default /run/kvd/kvd.sock */
	const char *tenant;             /* default "default" */
	const char *name;               /* for kvd's logs; default "kvc" */
	int poll;                       /* never sleep waiting for kvd */
	uint32_t slots;                 /* 0: kvd's default */
	uint64_t slot_size;             /* 0: kvd's default */
	uint64_t spin_ns;               /* spin before sleeping; 0: 50 us */
};

struct kvc_model {
	const char *name;
	uint32_t layers, q_heads, kv_heads, head_dim;
	uint32_t K, L, c;               /* bits per table, tables, collisions needed */
	uint32_t sink, window;          /* tokens kept by the client */
	const uint32_t *dense_layers;   /* layers kvd holds nothing of */
	uint32_t n_dense;
	uint64_t seed;                  /* of the projection matrix W */
	uint32_t segment_tokens, seal_tokens;   /* 0: defaults */
};

int kvc_connect(const struct kvc_opts *o, struct kvc **out);
void kvc_close(struct kvc *c);
const char *kvc_last_error(const struct kvc *c);

/* Creates the profile, or opens it when kvd has it with the same fields.
 * Once per connection, before any sequence. */
int kvc_profile(struct kvc *c, const struct kvc_model *m);
/* The profile as kvd filled it in (defaults), and W ([head_dim][K*L]). */
const struct kvc_model *kvc_model_of(const struct kvc *c);
const float *kvc_w(const struct kvc *c);

int kvc_seq_create(struct kvc *c, struct kvc_seq **out);
uint64_t kvc_seq_id(const struct kvc_seq *s);
/* Frees the sequence in kvd and here. */
int kvc_seq_free(struct kvc *c, struct kvc_seq *s);

/* The prompt's keys and values of one layer: k, v [kv_heads][n][head_dim].
 * Sparse layers: tokens [sink, n - window) go to kvd (centered with their
 * mean, hashed, streamed through the arena with back-pressure); the rest
 * stays here.  Dense layers stay here whole.  Once per layer. */
int kvc_prefill(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
		const float *v, uint32_t n);

/* One decoded token of one layer: k, v [kv_heads][head_dim].  Tokens leaving
 * the window go to kvd in batches. */
int kvc_append(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
	       const float *v);

/* Attention of one layer for a batch of sequences: q [nseq][q_heads][d] in,
 * o [nseq][q_heads][d] out.  kvd's sampled part runs while the client
 * attends its own part; the two are merged.  lse (may be NULL):
 * [nseq][q_heads] of the merged result, with centered keys. */
int kvc_attend(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
	       const float *q, float *o, float *lse);

/* kvd's part alone (tests and benchmarks): o, lse as kvd returned them. */
int kvc_attend_kvd(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const float *q, float *o, float *lse);

/* A NOP through the rings (round-trip probes). */
int kvc_nop(struct kvc *c);

struct kvc_stats {
	uint32_t clients, sequences, profiles, slots_in_use;
	uint64_t bytes, requests, errors, disconnects, mapped_bytes;
};
int kvc_server_stats(struct kvc *c, struct kvc_stats *st);

struct kvc_seq_stats {
	uint64_t tokens, bytes;
	uint32_t segments;
};
int kvc_seq_stats(struct kvc *c, const struct kvc_seq *s, struct kvc_seq_stats *st);

#endif
