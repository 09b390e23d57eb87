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
 *
 * Backends (kvc_opts.backend; docs/GPU.md): KVC_BACKEND_CPU, the default,
 * does the client's share on the CPU and answers bit for bit what the
 * in-process engine answers.  KVC_BACKEND_CUDA keeps the sinks and windows
 * on a GPU, hashes there, DMAs between device memory and kvd's arena
 * (registered with cudaHostRegister) and merges there; besides the host
 * API below (which then copies to and from the device for you), it offers
 * the stream-ordered device API (kvc_*_dev).  KVC_BACKEND_AUTO takes CUDA
 * when the library was built with it and a device is found, else CPU; the
 * environment variable KVC_BACKEND=cpu|cuda overrides AUTO (and only AUTO).
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
	int backend;                    /* enum kvc_backend; 0: KVC_BACKEND_CPU */
	int device;                     /* CUDA device ordinal */
	uint32_t max_batch;             /* CUDA: sequences per attend launch (scratch is
					 * sized for it at kvc_profile); 0: 256 */
	int timing;                     /* CUDA: time GPU phases with events (kvc_timing) */
};

enum kvc_backend { KVC_BACKEND_CPU = 0, KVC_BACKEND_CUDA = 1, KVC_BACKEND_AUTO = 2 };

/* How kvd stores the K and V rows of sealed segments (Profile.kv_dtype).
 * The client's rows, its window and everything it sends stay bf16 either
 * way: int8 is made by kvd when it seals a segment. */
enum kvc_kv_dtype { KVC_KV_BF16 = 0, KVC_KV_INT8 = 1 };

/* How kvd estimates attention over sealed segments (Profile.estimator,
 * docs/PROTOCOL.md).  Nothing changes on the client's side.  All but
 * magicpig make kvd keep q_heads * (1 + 32) * 4 bytes per (sequence,
 * sparse layer), charged to the sequence's uid. */
enum kvc_estimator {
	KVC_EST_MAGICPIG = 0, KVC_EST_HYBRID = 1, KVC_EST_ADAPTIVE = 2, KVC_EST_HYBRID_CV = 3,
	KVC_EST_HYBRID_LCV = 4,
};

struct kvc_model {
	const char *name;
	uint32_t layers, q_heads, kv_heads, head_dim;
	uint32_t K, L, c;               /* bits per table, tables, collisions needed */
	uint32_t sink, window;          /* tokens kept by the client */
	/* enum kvc_estimator; 0: magicpig.  It took what was padding in
	 * libkvclient.so.2 (the size and every other offset are unchanged),
	 * whose callers may have left garbage there: hence soname
	 * libkvclient.so.3. */
	uint32_t estimator;
	const uint32_t *dense_layers;   /* layers kvd holds nothing of */
	uint32_t n_dense;
	/* enum kvc_kv_dtype; 0: bf16.  It took what was padding in
	 * libkvclient.so.1, whose callers may have left garbage there: hence
	 * soname libkvclient.so.2. */
	uint32_t kv_dtype;
	uint64_t seed;                  /* of the projection matrix W */
	uint32_t segment_tokens, seal_tokens;   /* 0: defaults */
};

/* Always sets *out (free it with kvc_close, even on failure, after reading
 * kvc_last_error).  -ENODEV: KVC_BACKEND_CUDA asked for and no usable
 * device (or a library built without CUDA). */
int kvc_connect(const struct kvc_opts *o, struct kvc **out);
void kvc_close(struct kvc *c);
const char *kvc_last_error(const struct kvc *c);
/* KVC_BACKEND_CPU or KVC_BACKEND_CUDA: what this connection runs on. */
int kvc_backend(const struct kvc *c);

/* Creates the profile, or opens it when kvd has it with the same fields.
 * Once per connection, before any sequence.  -EOPNOTSUPP when kvd answers
 * with another kv_dtype or estimator than asked for (a kvd that predates
 * the field ignores it: bf16, magicpig). */
int kvc_profile(struct kvc *c, const struct kvc_model *m);
/* The profile as kvd filled it in (defaults), and W ([head_dim][K*L]). */
const struct kvc_model *kvc_model_of(const struct kvc *c);
const float *kvc_w(const struct kvc *c);

int kvc_seq_create(struct kvc *c, struct kvc_seq **out);
/* A child of parent that continues from everything parent holds now
 * (parallel samples, beams): kvd shares parent's sealed segments and copies
 * its open tail; the rows kept here (sinks, window) are copied.  The two
 * then diverge independently; either may be freed first.  -EBUSY while a
 * layer of parent is being prefilled, -EAGAIN when kvd has parent on disk
 * (attend it first), -ENOENT for a sequence kvd does not know.  On the
 * CUDA backend the device rows are copied on the device, after the work
 * already queued on the caller's stream. */
int kvc_seq_fork(struct kvc *c, const struct kvc_seq *parent, struct kvc_seq **out);
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
	/* the memory budget and the spill tier (docs/PROTOCOL.md, ServerStats) */
	uint64_t mem_limit, mem_high, mem_low, reserved_bytes, disk_bytes;
	uint32_t on_disk;
	uint64_t spills, restores, drops, spill_errors, lost, spill_bytes, restore_bytes;
	/* what the budget counts against mem_limit (bytes + bookkeeping,
	 * profiles, reservations); connections kvd refused */
	uint64_t used_bytes, refused;
};
int kvc_server_stats(struct kvc *c, struct kvc_stats *st);

enum kvc_seq_state { KVC_SEQ_RAM, KVC_SEQ_SPILLING, KVC_SEQ_DISK, KVC_SEQ_RESTORING, KVC_SEQ_LOST };

struct kvc_seq_stats {
	uint64_t tokens, bytes;
	uint32_t segments;
	uint32_t state;                 /* enum kvc_seq_state */
	int durable;                    /* a synced file on disk holds exactly this data */
	uint64_t disk_bytes;
	uint32_t ready_layers;          /* RESTORING: layers kvd serves already */
};
int kvc_seq_stats(struct kvc *c, const struct kvc_seq *s, struct kvc_seq_stats *st);

/* ---- tiers: kvd may keep a cold sequence on disk (docs/OPERATIONS.md) ---- */

/* Takes over a sequence nobody owns — one kvd found in its spill directories
 * at start-up (--persist) after a restart — under this connection's profile,
 * which must be the one it was written with.  The local part (sinks, window)
 * did not survive: kvc_attend() and kvc_attend_kvd() answer from kvd alone,
 * and kvc_append() refuses (nothing to extend the window with).  *tokens (may be
 * NULL): tokens kvd holds per layer, to check against what the caller
 * expects. */
int kvc_seq_open(struct kvc *c, uint64_t id, struct kvc_seq **out, uint64_t *tokens);

/* Asks kvd to write the sequence out now and drop it from RAM (returns once
 * the write has started; kvc_seq_stats().durable says when it is on disk). */
int kvc_seq_evict(struct kvc *c, struct kvc_seq *s);

/* The sequence will be used soon: if it is on disk, kvd starts reading it
 * back (layer 0 first).  Returns at once. */
int kvc_prefetch(struct kvc *c, struct kvc_seq *s);

/* ---- prefix sharing (docs/PROTOCOL.md "Prefix sharing") -------------------
 *
 * Sequences that begin with the same tokens (a system prompt, a chat's
 * history) share kvd's copy of them.  Each whole chunk of kvc_chunk_tokens()
 * tokens is named by a content key chained over the chunks before it,
 * computed here so that every client agrees; kvd files published prefixes
 * per namespace (the uid, or a sharing group of the config), so a tenant
 * never sees another's.  A publisher publishes a sequence as it is at a
 * chunk boundary; an attacher gets a sequence that is bit for bit that one
 * (kvd's part shared, not copied; the rows kept here fetched from kvd), and
 * continues it with kvc_extend or kvc_append.  On the CUDA backend the rows
 * kept on the device travel through host memory (after the work already
 * queued on the caller's stream); both calls are synchronous. */
#define KVC_KEY_BYTES 16

/* Tokens per chunk of this connection's profile; 0 before kvc_profile or
 * from a kvd without prefix sharing. */
uint32_t kvc_chunk_tokens(const struct kvc *c);
/* The keys of the whole chunks of tokens[0..n): n / kvc_chunk_tokens() of
 * KVC_KEY_BYTES each into keys (key i names chunks 0..i); returns how many. */
int kvc_content_keys(const struct kvc *c, const uint32_t *tokens, size_t n, uint8_t *keys);
/* A layer's length: its tokens here and in kvd. */
uint64_t kvc_seq_tokens(const struct kvc_seq *s, uint32_t layer);
/* Where a layer's tokens are (CPU backend; -ENOTSUP on CUDA): [0, *start)
 * kept here (the sinks), [*start, *end) in kvd, [*end, tokens) kept here
 * (the window, and rows waiting to go); a dense layer: 0, 0.  *mean (may be
 * NULL): the layer's centering mean [kv_heads][head_dim], NULL for a dense
 * layer or before the prefill; valid until s changes.  For bindings that
 * mirror a sequence (an attached one included). */
int kvc_seq_layer(const struct kvc_seq *s, uint32_t layer, uint64_t *start, uint64_t *end,
		  const float **mean);
/* Publishes s as it is now under key, the key of its last chunk: every
 * layer prefilled and of the same length, a whole number of chunks.  kvd
 * keeps a copy-on-write snapshot (sharing its sealed segments) and a copy of
 * the rows kept here; s goes on unchanged.  Publishing a key twice keeps
 * the first.  Published prefixes are a cache: kvd drops the least recently
 * used ones when memory is short (a sequence attached from one keeps its
 * rows; the next attach of it is a miss). */
int kvc_seq_publish(struct kvc *c, struct kvc_seq *s, const uint8_t *key);
/* A new sequence holding the longest published prefix named by keys[0..nkeys)
 * (kvc_content_keys of the prompt); *tokens its length, 0 when nothing was
 * published (an empty sequence: prefill it).  A prefix kvd has on disk is
 * read back first (this waits). */
int kvc_seq_attach(struct kvc *c, const uint8_t *keys, uint32_t nkeys, struct kvc_seq **out,
		   uint64_t *tokens);
/* n more tokens of one layer (k, v [kv_heads][n][head_dim]): kvc_prefill when
 * the layer has none yet, else n kvc_append calls -- the rest of a prompt
 * after an attach.  A sequence built by the same calls answers the same
 * whether its prefix was attached or computed. */
int kvc_extend(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
	       const float *v, uint32_t n);

/* What kvd shares for this connection's namespace (every namespace for a
 * privileged caller: root, kvd's uid, [server] admin_group), summed:
 * ServerStats.share (docs/PROTOCOL.md). */
struct kvc_share_stats {
	uint64_t published;             /* prefixes published now */
	uint64_t published_tokens;      /* their tokens */
	uint64_t hit_tokens;            /* tokens attaches got from the store */
	uint64_t miss_tokens;           /* tokens attaches asked for and did not get */
	uint64_t shared_bytes;          /* resident bytes of the published prefixes */
	uint64_t saved_bytes;           /* bytes attaches shared instead of copying */
};
int kvc_share_stats(struct kvc *c, struct kvc_share_stats *st);

/* ---- device API (CUDA backend; docs/GPU.md) --------------------------------
 *
 * The same operations on device memory, ordered on a CUDA stream the way a
 * CUDA library is: `stream` is a cudaStream_t (NULL: the legacy default
 * stream; pass cudaStreamPerThread explicitly if that is what you use).
 * Inputs are read in stream order after the work already queued on
 * `stream`; outputs are written in stream order, so work queued on `stream`
 * after the call sees them, and the caller synchronises only when it needs
 * them on the host.  Device buffers must stay valid until that work has
 * run (kvc_prefill_dev returns after its inputs are consumed).  No call
 * synchronises the device; a call blocks the host only for what it must
 * hand to kvd (a query, a chunk of rows) to land in the arena, and for
 * kvd's answer.  On the CPU backend every _dev call fails with -ENOTSUP.
 *
 * k, v: `dtype` (KVC_F32 or KVC_BF16), raw (post-RoPE, not centered).
 * q, o: float32; lse float32 or NULL.
 */
enum kvc_dtype { KVC_F32 = 0, KVC_BF16 = 1 };

/* k, v [kv_heads][n][head_dim]; as kvc_prefill. */
int kvc_prefill_dev(struct kvc *c, struct kvc_seq *s, uint32_t layer, const void *k,
		    const void *v, uint32_t n, int dtype, void *stream);

/* One decoded token of each of nseq sequences (each at most once): k, v
 * [nseq][kv_heads][head_dim], the layout a batched QKV projection
 * produces; as kvc_append. */
int kvc_append_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const void *k, const void *v, int dtype, void *stream);

/* q [nseq][q_heads][d] in, o [nseq][q_heads][d] out (lse [nseq][q_heads] or
 * NULL); as kvc_attend: the GPU's window attention runs while kvd samples,
 * then a kernel merges. */
int kvc_attend_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const float *q, float *o, float *lse, void *stream);
int kvc_attend_kvd_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs,
		       uint32_t nseq, const float *q, float *o, float *lse, void *stream);

/* Where the time goes (CUDA backend; zeros on the CPU one).  Host figures
 * are always kept; GPU figures (sparse layers) only with kvc_opts.timing.
 * reset: start again from zero after reading. */
struct kvc_timing {
	uint64_t attends, appends, evicted, prefills;   /* calls; sequences evicted */
	double kvd_wait_ms;     /* host waiting for kvd's completions (attend) */
	double gpu_wait_ms;     /* host waiting for queries to land in the arena */
	double evict_ms;        /* host time in evictions (hash, DMA, kvd's ack) */
	double prefill_ms;      /* host time in prefill */
	double hash_ms;         /* GPU: query projection, codes, copies into the arena */
	double window_ms;       /* GPU: attention over sinks + window */
	double h2d_ms;          /* GPU: kvd's outputs from the arena to the device */
	double merge_ms;        /* GPU: the LSE merge */
};
int kvc_timing(struct kvc *c, struct kvc_timing *t, int reset);

#endif
