/* kvg: the seam between kvc.c (the API of kvc.h and the CPU backend) and
 * the CUDA backend (kvg_cuda.c; kvg_nocuda.c when built with CUDA=0).  Both
 * backends sit on the transport (kvt.h) for the connection, the profile,
 * the rings and the arena; neither calls the other's code.
 *
 * Nothing declared here is exported from libkvclient.so: kvg_* are not
 * kvc_* (gpu-client/libkvclient.map).
 *
 * kvc.c calls kvg_* where a connection picks its backend and where the
 * data path forks; the kvc_*_dev entry points of kvc.h land here too.
 * Every call gets the connection's transport for its errors (kvt_fail).
 * Same threading rule as kvc.h: one thread per struct kvc at a time.
 */
#ifndef KVG_H
#define KVG_H

#include <stddef.h>
#include <stdint.h>

#include "kvc.h"

struct kvc_layer;
struct kvg;
struct kvg_seq;
struct kvt;

/* A sequence as kvc.h hands it out: kvd's id and each backend's own
 * state of it. */
struct kvc_seq {
	uint64_t id;
	int reopened;                   /* kvc_seq_open: no local part, kvd's alone */
	struct kvc_layer *ly;           /* CPU backend (kvc.c) */
	struct kvg_seq *gs;             /* CUDA backend, NULL until it makes it */
};

/* The backend opts asks for, before anything else happens: KVC_BACKEND_CPU
 * or KVC_BACKEND_CUDA, or a negative code with the reason in msg (CUDA
 * asked for and no device, or a build without CUDA). */
int kvg_choose(const struct kvc_opts *o, char *msg, size_t len);

/* Sets the device up for the connection and registers t's mapped region
 * with CUDA. */
int kvg_open(struct kvt *t, const struct kvc_opts *o, struct kvg **out);
/* Waits for the backend's own work, unregisters the region, frees. */
void kvg_close(struct kvg *g);

/* After kvt_profile got the profile and W: device copies and scratch. */
int kvg_profile(struct kvt *t, struct kvg *g);

void kvg_seq_free(struct kvt *t, struct kvg *g, struct kvg_seq *s);
/* kvc_seq_fork's device part: child gets copies of parent's device rows
 * (sinks, window, dense layers) and means, after the work already queued
 * on them; synchronous. */
int kvg_seq_fork(struct kvt *t, struct kvg *g, const struct kvc_seq *parent,
		 struct kvc_seq *child);

/* Prefix sharing on the device (kvc_seq_publish, kvc_seq_attach): the
 * client rows of every layer -- sinks and window ring of a sparse layer,
 * all rows of a dense one -- go to kvd through host memory after the
 * caller's queued work, or come from kvd onto the device; synchronous.
 * publish: every layer prefilled, of one length (*tokens).  attach: s is a
 * fresh kvc_seq of kvd's sequence `id` holding `tokens` tokens, rows[l]
 * client rows in layer l. */
int kvg_seq_publish(struct kvt *t, struct kvg *g, struct kvc_seq *s, const uint8_t *key);
int kvg_seq_attached(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint64_t tokens,
		     const uint32_t *rows);
/* A layer's length (prefill and appends), and whether it was prefilled. */
uint64_t kvg_layer_tokens(const struct kvc_seq *s, uint32_t layer);
int kvg_layer_prefilled(const struct kvc_seq *s, uint32_t layer);

/* The host-pointer API on the CUDA backend: inputs are copied to the
 * device, the device path runs, outputs come back; synchronous as kvc.h
 * promises. */
int kvg_prefill_host(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		     const float *k, const float *v, uint32_t n);
int kvg_append_host(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		    const float *k, const float *v);
int kvg_attend_host(struct kvt *t, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		    uint32_t nseq, const float *q, float *o, float *lse, int kvd_only);

/* kvc.h's device API (kvc_*_dev, kvc_timing); g is NULL on a connection
 * that uses the CPU backend, which these refuse (-ENOTSUP). */
int kvg_prefill_dev(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		    const void *k, const void *v, uint32_t n, int dtype, void *stream);
int kvg_append_dev(struct kvt *t, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		   uint32_t nseq, const void *k, const void *v, int dtype, void *stream);
int kvg_attend_dev(struct kvt *t, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		   uint32_t nseq, const float *q, float *o, float *lse, int kvd_only,
		   void *stream);
int kvg_timing(struct kvt *t, struct kvg *g, struct kvc_timing *tm, int reset);

#endif
