/* kvt: libkvclient's transport, the one connection to kvd that both
 * backends sit on (the CPU backend in kvc.c, the CUDA backend in
 * kvg_cuda.c): the control socket and its messages (Hello, the profile,
 * sequences, stats), the shared region with its two rings, and the arena
 * slots.  It moves bytes and keeps the connection's state; it computes
 * nothing and calls no backend.
 *
 * Every int function returns 0 (or a count/slot) or a negative code, with
 * the reason in kvt_error(); a backend records its own failures there with
 * kvt_fail, so kvc_last_error() has one place to look.  Same threading rule
 * as kvc.h: one thread per struct kvt at a time.  Nothing here is exported
 * from libkvclient.so (gpu-client/libkvclient.map).
 */
#ifndef KVT_H
#define KVT_H

#include <stddef.h>
#include <stdint.h>

#include "kvc.h"

struct kvd_geom;
struct kvd_sqe;
struct kvt;

/* ---- the connection --------------------------------------------------- */

/* A transport not yet connected (NULL: out of memory); kvt_connect then
 * says Hello with o's socket, tenant, name and ring options (o may be NULL)
 * and maps the region kvd hands back.  On failure the transport stays
 * valid for kvt_error and kvt_close. */
struct kvt *kvt_new(void);
int kvt_connect(struct kvt *t, const struct kvc_opts *o);
/* Unmaps and closes everything; a backend that registered the region must
 * have let go of it first.  NULL is fine. */
void kvt_close(struct kvt *t);
void *kvt_map(const struct kvt *t, size_t *size);

int kvt_fail(struct kvt *t, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const char *kvt_error(const struct kvt *t);

/* ---- control messages --------------------------------------------------- */

/* ProfileCreate, once per connection; then the profile as kvd made it. */
int kvt_profile(struct kvt *t, const struct kvc_model *m);
const struct kvc_model *kvt_model(const struct kvt *t);         /* NULL before */
const struct kvd_geom *kvt_geom(const struct kvt *t);
const float *kvt_w(const struct kvt *t);                         /* [d][K*L] */
int kvt_dense(const struct kvt *t, uint32_t layer);

int kvt_seq_create(struct kvt *t, uint64_t *id);
/* A copy-on-write child of kvd's sequence parent (SeqCreate.parent). */
int kvt_seq_fork(struct kvt *t, uint64_t parent, uint64_t *id);
int kvt_seq_free(struct kvt *t, uint64_t id);

/* ---- prefix sharing (docs/PROTOCOL.md "Prefix sharing") ------------------ */

/* Profile.chunk_tokens as kvd made it; 0 from a kvd without sharing. */
uint32_t kvt_chunk_tokens(const struct kvt *t);
/* SeqCreate.attach_keys: *id a new sequence, *tokens the prefix it holds (0: a
 * miss), local_rows[layers] the rows of each layer to fetch with
 * kvt_local_get (0 on a miss).  nkeys 0: a plain create. */
int kvt_seq_attach(struct kvt *t, const uint8_t *keys, uint32_t nkeys, uint64_t *id,
		   uint64_t *tokens, uint32_t *local_rows);
/* Waits for the rows in flight (LOCAL puts), then SeqPublish. */
int kvt_seq_publish(struct kvt *t, uint64_t id, const uint8_t *key, uint64_t tokens);
/* LOCAL puts of rows [0, n) of a layer (k, v [kv][stride][d] bf16), fire and
 * forget (kvt_drain or kvt_seq_publish collects errors); a get of rows [0, n),
 * n >= 1, into k, v of the same shape, and the layer's mean ([kv][d]) when
 * mean is not NULL, waited for. */
int kvt_local_put(struct kvt *t, uint64_t id, uint32_t layer, const uint16_t *k,
		  const uint16_t *v, uint32_t n, uint32_t stride);
int kvt_local_get(struct kvt *t, uint64_t id, uint32_t layer, float *mean, uint16_t *k,
		  uint16_t *v, uint32_t n, uint32_t stride);
/* SeqOpen of a sequence of this connection's profile: its tokens in kvd. */
int kvt_seq_open(struct kvt *t, uint64_t id, uint64_t *tokens);
/* Waits for the rows in flight, then SeqEvict. */
int kvt_seq_evict(struct kvt *t, uint64_t id);
int kvt_seq_stats(struct kvt *t, uint64_t id, struct kvc_seq_stats *st);
int kvt_server_stats(struct kvt *t, struct kvc_stats *st);
/* ServerStats.share, summed over the namespaces the caller sees. */
int kvt_share_stats(struct kvt *t, struct kvc_share_stats *st);

/* ---- the rings and the arena -------------------------------------------- */

uint32_t kvt_nslots(const struct kvt *t);
uint64_t kvt_slot_size(const struct kvt *t);
void *kvt_slot(const struct kvt *t, uint32_t i);
/* A free slot, waiting for completions when none is: fire = 1 frees itself
 * when kvd completes it (PREFILL, APPEND), fire = 0 stays the caller's
 * until kvt_slot_put.  kvt_slot_put also takes back a fire slot that was
 * never submitted. */
int kvt_slot_get(struct kvt *t, int fire);
void kvt_slot_put(struct kvt *t, uint32_t i);
/* Puts e on the submission ring (waiting for room) and kicks kvd if asked. */
int kvt_submit(struct kvt *t, const struct kvd_sqe *e);
/* Waits for kvd's completion of an owned slot: 0 and *res, *msg (valid
 * until the slot is put back), or a ring failure. */
int kvt_wait_slot(struct kvt *t, uint32_t i, int32_t *res, const char **msg);
/* Waits for every fire-and-forget slot; the first error kvd reported. */
int kvt_drain(struct kvt *t, const char *what);

/* A NOP through both rings; a PREFETCH of a sequence, waited for. */
int kvt_nop(struct kvt *t);
int kvt_prefetch(struct kvt *t, uint64_t id);

#endif
