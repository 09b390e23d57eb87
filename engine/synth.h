/* kvd_synth: the synthetic attention workload used by tests, benchmarks and
 * the demo.  docs/WORKLOADS.md is its specification; this generator is the
 * one implementation, so figures mean the same thing everywhere.
 *
 * One layer: per kv head h, n keys and values; q_heads queries, q head g
 * belonging to kv head g / (q_heads / kv_heads).  Everything is float32,
 * raw (not centered).  Deterministic in (kind, shape, seed).
 */
#ifndef KVD_SYNTH_H
#define KVD_SYNTH_H

#include <stddef.h>
#include <stdint.h>

enum kvd_wl { KVD_WL_NEEDLE, KVD_WL_DENSE, KVD_WL_MIXED, KVD_WL_COUNT };

#define KVD_SYNTH_SINKS   4     /* sink tokens at positions 0..3 */
#define KVD_SYNTH_NEEDLES 4     /* planted keys per q head (needle) */
/* Decode steps (kvd_synth_steps): the query of a step drifts from the base
 * query by about DRIFT * |q0| in norm, and consecutive steps stay correlated
 * by RHO, so estimators that keep state across steps have something to keep. */
#define KVD_SYNTH_DRIFT   0.5
#define KVD_SYNTH_RHO     0.8

struct kvd_synth {
	enum kvd_wl kind;
	uint32_t n, q_heads, kv_heads, d;
	float *k;               /* [kv_heads][n][d] */
	float *v;               /* [kv_heads][n][d] */
	float *q;               /* [q_heads][d] */
	uint32_t *needle_pos;   /* [q_heads][KVD_SYNTH_NEEDLES], needle only, else NULL */
};

/* Returns 0, -EINVAL on a bad shape (n <= sinks + 1024 for needle, q_heads
 * not a multiple of kv_heads, d == 0; the full list is in docs/WORKLOADS.md),
 * -ENOMEM. */
int kvd_synth_make(struct kvd_synth *w, enum kvd_wl kind, uint32_t n, uint32_t q_heads,
		   uint32_t kv_heads, uint32_t d, uint64_t seed);
void kvd_synth_free(struct kvd_synth *w);

/* Queries of `steps` decode steps, out[steps][q_heads][d]: step 0 is w->q
 * itself; later steps drift (docs/WORKLOADS.md, "Decode steps").  `seed` is
 * the seed w was made with: the drift comes from its own stream, so w stores
 * nothing for it.  0, or -EINVAL for steps == 0 (or an out array too large
 * to address). */
int kvd_synth_steps(const struct kvd_synth *w, uint32_t steps, uint64_t seed, float *out);

const char *kvd_wl_name(enum kvd_wl kind);
/* -1 when the name is none of "needle", "dense", "mixed". */
int kvd_wl_parse(const char *name);

#endif
