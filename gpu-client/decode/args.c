/* kvd-decode's flags.  See args.h. */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "engine/attn.h"

void dec_args_default(struct dec_args *a)
{
	/* The profile's estimator, K, L, c, row format and segment size: kvd's
	 * recommended configuration, as every client's defaults. */
	const struct kvd_est_cfg d = KVD_EST_CFG_DEFAULT;

	*a = (struct dec_args){
		.attn = DEC_KVD, .ctx = 4096, .batch = 1, .steps = 32, .warmup = 2, .layers = 32,
		.K = d.K, .L = d.L, .c = d.c, .kv_dtype = d.kv_dtype, .estimator = d.est,
		.seg_tokens = d.seg_tokens,
		.sink = 4, .window = 64, .slots = 16, .slot_size = 4u << 20, .seed = 1,
	};
}

const char *dec_share_name(int share)
{
	return share == DEC_SHARE_ATTACH ? "attach" : share == DEC_SHARE_FORK ? "fork" : "none";
}

const char *dec_attn_name(int attn)
{
	return attn == DEC_GPU_DENSE ? "gpu-dense" : "kvd";
}

void dec_usage(FILE *f)
{
	fputs("usage: kvd-decode [options]\n"
	      "\n"
	      "Decodes with a model of Llama-3.1-8B's geometry (32 layers, hidden 4096, 32 q\n"
	      "heads, 8 kv heads, head_dim 128, MLP 14336, vocabulary 128256) and random bf16\n"
	      "weights, on the GPU with cuBLAS: RMSNorm, QKV and output projections, RoPE,\n"
	      "SwiGLU MLP, LM head, greedy next token.  Its compute and memory traffic are the\n"
	      "real model's, so tokens/s is a real measurement; accuracy is measured elsewhere.\n"
	      "\n"
	      "The prefill is SYNTHETIC: no prompt is run through the model.  Random K/V for\n"
	      "the whole context are written straight into the KV cache (gpu-dense), or\n"
	      "generated on the GPU layer by layer and handed to libkvclient, which centers\n"
	      "and hashes them on the GPU and streams them to kvd (kvd).\n"
	      "\n"
	      "  --attn=gpu-dense|kvd  all KV on the GPU (the baseline), or sink + window on the\n"
	      "                        GPU and the rest in kvd (default kvd)\n"
	      "  --ctx N               context length per sequence; k = x1024 (default 4096)\n"
	      "  --batch N             sequences decoded together (default 1)\n"
	      "  --steps N             decode steps measured (default 32)\n"
	      "  --warmup N            decode steps before measuring (default 2)\n"
	      "  --layers N            the first N of the 32 layers (default 32; for quick runs)\n"
	      "  --K N --L N --c 1|2   SimHash bits, tables, collisions (default 10, 70, 2;\n"
	      "                        MagicPIG's own: 10, 150, 2)\n"
	      "  --sink N --window N   tokens kept on the GPU in kvd mode (default 4, 64)\n"
	      "  --kv-dtype bf16|int8  how kvd stores sealed K/V in kvd mode (default int8)\n"
	      "  --estimator magicpig|hybrid|adaptive|hybrid_cv|hybrid_lcv   how kvd\n"
	      "                        estimates attention over sealed segments in kvd\n"
	      "                        mode (default hybrid_lcv)\n"
	      "  --share none|attach|fork   kvd mode, --batch > 1: sequence 0 prefills the\n"
	      "                        prompt and the others share it (attach: published under\n"
	      "                        content keys and attached, --ctx a multiple of 256;\n"
	      "                        fork: forked), or each prefills its own (default none)\n"
	      "  --slots N --slot-size BYTES   the shared arena (default 16 x 4M)\n"
	      "  --socket PATH         use a running kvd (default: start build/kvd in a\n"
	      "                        temporary directory, next to this binary)\n"
	      "  --kvd-threads N       worker threads of the kvd it starts (default: kvd's)\n"
	      "  --device N            CUDA device (default 0)\n"
	      "  --seed N              weights and data (default 1)\n"
	      "  --json                one JSON line instead of the table\n"
	      "  --help\n"
	      "\n"
	      "Exit status: 0, 1 on failure, 2 on bad usage, 77 when there is no CUDA device\n"
	      "(or the binary was built with CUDA=0).\n", f);
}

/* A count with an optional k (x1024) or M (x1048576) suffix, in [lo, hi]. */
static int num(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
	char *end;
	unsigned long long v;

	if (!s || !*s || *s == '-')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -EINVAL;
	if (*end == 'k' || *end == 'K') {
		if (v > ULLONG_MAX / 1024)
			return -EINVAL;
		v *= 1024;
		end++;
	} else if (*end == 'M') {
		if (v > ULLONG_MAX / 1048576)
			return -EINVAL;
		v *= 1048576;
		end++;
	}
	if (*end || v < lo || v > hi)
		return -EINVAL;
	*out = v;
	return 0;
}

int dec_args_parse(struct dec_args *a, int argc, char **argv, char *msg, size_t len)
{
	static const struct {
		const char *name;
		uint64_t lo, hi;
		size_t off;
		int wide;
	} nums[] = {
#define U32(n, f, lo, hi) { n, lo, hi, offsetof(struct dec_args, f), 0 }
		U32("--ctx", ctx, 1, 1u << 22), U32("--batch", batch, 1, 4096),
		U32("--steps", steps, 1, 1u << 20), U32("--warmup", warmup, 0, 1u << 20),
		U32("--layers", layers, 1, 32), U32("--K", K, 1, 16), U32("--L", L, 1, 1024),
		U32("--c", c, 1, 2), U32("--sink", sink, 0, 1u << 16),
		U32("--window", window, 1, 1u << 16), U32("--slots", slots, 1, 1024),
		U32("--kvd-threads", kvd_threads, 0, 1024), U32("--device", device, 0, 1024),
#undef U32
		{ "--slot-size", 4096, 1ull << 32, offsetof(struct dec_args, slot_size), 1 },
		{ "--seed", 0, UINT64_MAX, offsetof(struct dec_args, seed), 1 },
	};

	for (int i = 0; i < argc; i++) {
		const char *arg = argv[i], *val = NULL, *eq = strchr(arg, '=');
		char name[32];
		size_t nl = eq ? (size_t)(eq - arg) : strlen(arg);
		int done = 0;

		if (nl >= sizeof name) {
			snprintf(msg, len, "unknown option %s", arg);
			return -EINVAL;
		}
		memcpy(name, arg, nl);
		name[nl] = 0;
		if (!strcmp(name, "--help") || !strcmp(name, "-h")) {
			a->help = 1;
			return 1;
		}
		if (!strcmp(name, "--json")) {
			a->json = 1;
			continue;
		}
		/* everything else takes a value: --x=V or --x V */
		val = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
		if (!strcmp(name, "--attn")) {
			if (val && !strcmp(val, "gpu-dense"))
				a->attn = DEC_GPU_DENSE;
			else if (val && !strcmp(val, "kvd"))
				a->attn = DEC_KVD;
			else {
				snprintf(msg, len, "--attn: gpu-dense or kvd, not %s", val ? val : "nothing");
				return -EINVAL;
			}
			continue;
		}
		if (!strcmp(name, "--kv-dtype")) {
			if (!val || kvd_kv_dtype_parse(val, &a->kv_dtype)) {
				snprintf(msg, len, "--kv-dtype: bf16 or int8, not %s",
					 val ? val : "nothing");
				return -EINVAL;
			}
			continue;
		}
		if (!strcmp(name, "--estimator")) {
			if (!val || kvd_estimator_parse(val, &a->estimator)) {
				snprintf(msg, len, "--estimator: magicpig, hybrid, adaptive, hybrid_cv or hybrid_lcv, not %s",
					 val ? val : "nothing");
				return -EINVAL;
			}
			continue;
		}
		if (!strcmp(name, "--share")) {
			if (val && !strcmp(val, "none"))
				a->share = DEC_SHARE_NONE;
			else if (val && !strcmp(val, "attach"))
				a->share = DEC_SHARE_ATTACH;
			else if (val && !strcmp(val, "fork"))
				a->share = DEC_SHARE_FORK;
			else {
				snprintf(msg, len, "--share: none, attach or fork, not %s",
					 val ? val : "nothing");
				return -EINVAL;
			}
			continue;
		}
		if (!strcmp(name, "--socket")) {
			if (!val || !*val) {
				snprintf(msg, len, "--socket needs a path");
				return -EINVAL;
			}
			a->socket = val;
			continue;
		}
		for (size_t j = 0; j < sizeof nums / sizeof nums[0] && !done; j++) {
			uint64_t v;

			if (strcmp(name, nums[j].name))
				continue;
			if (num(val, nums[j].lo, nums[j].hi, &v)) {
				snprintf(msg, len, "%s: %s is not a number in [%llu, %llu]", name,
					 val ? val : "nothing", (unsigned long long)nums[j].lo,
					 (unsigned long long)nums[j].hi);
				return -EINVAL;
			}
			if (nums[j].wide)
				*(uint64_t *)((char *)a + nums[j].off) = v;
			else
				*(uint32_t *)((char *)a + nums[j].off) = (uint32_t)v;
			done = 1;
		}
		if (!done) {
			snprintf(msg, len, "unknown option %s", name);
			return -EINVAL;
		}
	}
	if (a->slot_size % 4096) {
		snprintf(msg, len, "--slot-size: a multiple of 4096");
		return -EINVAL;
	}
	if (a->share && a->attn != DEC_KVD) {
		snprintf(msg, len, "--share: kvd mode only");
		return -EINVAL;
	}
	if (a->share == DEC_SHARE_ATTACH && a->ctx % 256) {
		snprintf(msg, len, "--share attach: --ctx a multiple of 256 (the chunk)");
		return -EINVAL;
	}
	if (a->attn == DEC_KVD && a->layers < 2) {
		snprintf(msg, len, "--layers: kvd mode needs 2 or more (layer 0 stays dense on the GPU)");
		return -EINVAL;
	}
	return 0;
}
