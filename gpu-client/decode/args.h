/* kvd-decode's command line: parsed and checked here, apart from CUDA, so
 * tests/unit/test_gpu_plan.c runs it on machines without a GPU.  Pure. */
#ifndef KVD_DECODE_ARGS_H
#define KVD_DECODE_ARGS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum dec_attn { DEC_GPU_DENSE, DEC_KVD };

struct dec_args {
	int attn;                       /* enum dec_attn */
	uint32_t ctx, batch, steps, warmup;
	uint32_t layers;                /* the first `layers` of Llama-3.1-8B's 32 */
	uint32_t K, L, c, sink, window; /* kvd mode */
	uint32_t kv_dtype;              /* kvd mode: enum kvd_kv_dtype of the profile */
	uint32_t estimator;             /* kvd mode: enum kvd_estimator of the profile */
	uint32_t seg_tokens;            /* kvd mode: the profile's segment size */
	int share;                      /* kvd mode: enum dec_share, how sequences 1.. get the
					 * prompt of sequence 0 */
	uint32_t slots;
	uint64_t slot_size;
	uint32_t kvd_threads;           /* 0: kvd's default */
	const char *socket;             /* NULL: start build/kvd in a temporary directory */
	int device, json, help;
	uint64_t seed;
};

/* --share: every sequence prefills its own prompt (none), or sequence 0 does
 * and the others attach it by content key (attach) or fork it (fork). */
enum dec_share { DEC_SHARE_NONE = 0, DEC_SHARE_ATTACH = 1, DEC_SHARE_FORK = 2 };
const char *dec_share_name(int share);

void dec_args_default(struct dec_args *a);

/* argv[0..argc) are the options (no program name).  0; 1 when --help was
 * asked for; -EINVAL with the reason in msg. */
int dec_args_parse(struct dec_args *a, int argc, char **argv, char *msg, size_t len);

void dec_usage(FILE *f);

/* "gpu-dense" / "kvd" */
const char *dec_attn_name(int attn);

#endif
