/* kvbench share's prefix-sharing scenes (bench/prefix.c): a system prompt
 * shared by attach against private prefills, and chat sessions whose
 * histories are prefixes of their next turns under a tight memory budget. */
#ifndef KVD_BENCH_PREFIX_H
#define KVD_BENCH_PREFIX_H

#include <stdint.h>

struct prefix_opts {
	uint32_t layers;
	/* prompt */
	uint32_t clients, ctx, priv, steps;
	/* chat */
	uint32_t sessions, procs, turns, base, msg_min, msg_max, gen;
};

struct prefix_prompt_res {
	int identical;
	double prefill_ms, attach_ms, publish_ms;
	uint64_t prompt_bytes, part_bytes, shared_bytes;
	double rss_private, rss_shared, ideal, resident_ratio, private_ratio;
};

struct prefix_chat_res {
	int identical;
	uint64_t total_bytes, budget_bytes, asked, hit, turns, checked, mismatches, refused;
	uint64_t spills, restores, lost;
	double hit_rate, attach_ms, turn_ms, wall_s;
};

/* 0, or 1 when a run failed (its reasons on stderr). */
int bench_prefix_prompt(const struct prefix_opts *op, struct prefix_prompt_res *out);
int bench_prefix_chat(const struct prefix_opts *op, struct prefix_chat_res *out);

#endif
