/* The decode driver's core (run.c, CUDA builds only): one run of the model
 * in one attention mode, and its figures.  build/kvd-decode prints them;
 * `kvbench gpu` runs both modes and prints both. */
#ifndef KVD_DECODE_RUN_H
#define KVD_DECODE_RUN_H

#include <stdint.h>
#include <stdio.h>

#include "args.h"

struct dec_result {
	char err[256];                  /* why the run failed, or was skipped */
	char device[128];
	const char *mode;
	uint32_t ctx, batch, steps, layers;
	double prefill_s;               /* synthetic prefill, every layer and sequence */
	double prefill0_s;              /* --share: sequence 0's prefill (and publish) */
	double share_s;                 /* --share: the other sequences' attaches or forks */
	double tok_s;                   /* batch * steps / decode wall time */
	double step_ms, step_p50_ms, step_p99_ms;
	/* per step, averaged over the measured steps */
	double layers_ms;               /* GPU: everything but attention (norms, GEMMs, RoPE, MLP) */
	double attn_ms;                 /* GPU stream time from q ready to o merged, incl. waits */
	double head_ms;                 /* GPU: final norm, LM head, argmax */
	double kvd_wait_ms;             /* host blocked on kvd (kvd mode) */
	double gpu_wait_ms;             /* host blocked until queries reached the arena */
	double copies_ms;               /* GPU: query hashing + copies to and from the arena */
	double window_ms, merge_ms;     /* GPU: kvd mode's window attention and merge */
	double evict_ms;                /* host: evictions to kvd */
	double gpu_kv_gb;               /* KV bytes held on the GPU */
	double host_kv_gb;              /* KV bytes held by kvd (kvd mode) */
};

/* 0; 77 when there is no CUDA device; 1 on failure (r->err says why). */
int dec_run(const struct dec_args *a, struct dec_result *r);

void dec_print(FILE *f, const struct dec_args *a, const struct dec_result *r, int json);

#endif
