/* kvg: the seam between kvc.c (the API, the rings, the CPU backend) and the
 * CUDA backend (kvg_cuda.c; kvg_nocuda.c when built with CUDA=0).
 *
 * Nothing declared here is exported from libkvclient.so: kvg_* and kvci_*
 * are not kvc_* (gpu-client/libkvclient.map).
 *
 * kvc.c calls kvg_* at the points where a connection picks its backend and
 * where the data path forks; kvg_cuda.c calls back into kvc.c through the
 * kvci_* accessors for the rings, the arena slots and the profile.  Same
 * threading rule as kvc.h: one thread per struct kvc at a time.
 */
#ifndef KVG_H
#define KVG_H

#include <stddef.h>
#include <stdint.h>

#include "kvc.h"

struct kvd_geom;
struct kvd_sqe;
struct kvg;
struct kvg_seq;

/* ---- implemented by the backend (kvg_cuda.c or kvg_nocuda.c) ------------- */

/* The backend opts asks for, before anything else happens: KVC_BACKEND_CPU
 * or KVC_BACKEND_CUDA, or a negative code with the reason in msg (CUDA
 * asked for and no device, or a build without CUDA). */
int kvg_choose(const struct kvc_opts *o, char *msg, size_t len);

/* Sets the device up for the connection and registers the mapped region
 * with CUDA.  Failure: a negative code and kvc_last_error() set. */
int kvg_open(struct kvc *c, const struct kvc_opts *o, void *map, size_t map_size,
	     struct kvg **out);
/* Waits for the backend's own work, unregisters the region, frees. */
void kvg_close(struct kvg *g);

/* After kvc_profile got the profile and W: device copies and scratch. */
int kvg_profile(struct kvc *c, struct kvg *g);

int kvg_seq_init(struct kvc *c, struct kvg *g, struct kvg_seq **out);
void kvg_seq_free(struct kvc *c, struct kvg *g, struct kvg_seq *s);

/* The host-pointer API on the CUDA backend: inputs are copied to the
 * device, the device path runs, outputs come back; synchronous as kvc.h
 * promises. */
int kvg_prefill_host(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
		     const float *v, uint32_t n);
int kvg_append_host(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
		    const float *v);
int kvg_attend_host(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		    const float *q, float *o, float *lse, int kvd_only);

/* ---- implemented by kvc.c for the backend --------------------------------- */

int kvci_fail(struct kvc *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
struct kvg *kvci_gpu(const struct kvc *c);
int kvci_profiled(const struct kvc *c);
const struct kvd_geom *kvci_geom(const struct kvc *c);
int kvci_dense(const struct kvc *c, uint32_t layer);
/* The backend's state of a sequence (NULL until the backend creates it). */
struct kvg_seq **kvci_seq_gpu(struct kvc_seq *s);

uint32_t kvci_nslots(const struct kvc *c);
uint64_t kvci_slot_size(const struct kvc *c);
void *kvci_slot(const struct kvc *c, uint32_t i);
/* A free slot, waiting for completions when none is: fire = 1 frees itself
 * when kvd completes it (PREFILL, APPEND), fire = 0 stays the caller's
 * until kvci_slot_put.  kvci_slot_put also takes back a fire slot that was
 * never submitted. */
int kvci_slot_get(struct kvc *c, int fire);
void kvci_slot_put(struct kvc *c, uint32_t i);
int kvci_submit(struct kvc *c, const struct kvd_sqe *e);
/* Waits for kvd's completion of an owned slot: 0 and *res, *msg (valid
 * until the slot is put back), or a ring failure. */
int kvci_wait_slot(struct kvc *c, uint32_t i, int32_t *res, const char **msg);
/* Waits for every fire-and-forget slot; the first error kvd reported. */
int kvci_drain(struct kvc *c, const char *what);

#endif
