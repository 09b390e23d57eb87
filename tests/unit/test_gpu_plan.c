/* The CUDA backend's host side, on any machine (no GPU needed): attention
 * split plans, the window ring against the CPU backend's rule, slot and
 * chunk arithmetic against the ring ABI, the code layout of the pack kernel
 * against kvd_prep's codes, the double references the device tests use,
 * backend choice, the device API on the CPU backend, and kvd-decode's
 * flags. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../integration/daemon.h"
#include "engine/attn.h"
#include "engine/bf16.h"
#include "gpu-client/decode/args.h"
#include "gpu-client/kvc.h"
#include "proto/kvd_ring.h"
#include "gpu-client/kvg_plan.h"
#include "engine/lsh.h"
#include "engine/prep.h"
#include "engine/ref.h"
#include "engine/rng.h"
#include "gpuutil.h"
#include "testutil.h"

/* ---- attention plans ------------------------------------------------------ */

static void test_attn_plan(void **state)
{
	static const uint32_t rows[] = { 0, 1, 31, 32, 33, 68, 100, 255, 256, 257, 1000, 4096,
					 98304, 100000, 1u << 20 };
	static const uint32_t nseqs[] = { 1, 4, 64, 256 };
	static const uint32_t targets[] = { 1, 132 * 4, 10000 };

	for (size_t a = 0; a < sizeof rows / sizeof rows[0]; a++)
		for (size_t b = 0; b < sizeof nseqs / sizeof nseqs[0]; b++)
			for (size_t t = 0; t < sizeof targets / sizeof targets[0]; t++) {
				struct kvg_attn_plan p;
				uint32_t n = rows[a] ? rows[a] : 1;

				kvg_attn_plan(rows[a], nseqs[b], 8, 32, 128, targets[t], &p);
				assert_true(p.nsplit >= 1 && p.nsplit <= KVG_SPLIT_MAX);
				assert_int_equal(p.chunk % KVG_TILE, 0);
				assert_true((uint64_t)p.chunk * p.nsplit >= n);
				/* no split starts past the end: none is empty by construction */
				assert_true((uint64_t)p.chunk * (p.nsplit - 1) < n);
				if (p.nsplit > 1)
					assert_int_equal(p.part_floats,
							 (size_t)nseqs[b] * 32 * p.nsplit * 129);
				else
					assert_int_equal(p.part_floats, 0);
				/* short windows never pay for a combine */
				if (rows[a] <= KVG_SPLIT_MIN_ROWS)
					assert_int_equal(p.nsplit, 1);
			}
	/* a long context with few sequences spreads over the machine */
	struct kvg_attn_plan p;

	kvg_attn_plan(98304, 1, 8, 32, 128, 528, &p);
	assert_true(p.nsplit >= 64);
}

/* ---- the window ring ------------------------------------------------------ */

/* Stores token ids in a ring the way the CUDA backend does and checks after
 * every append that the rows it attends over are exactly the CPU backend's
 * local rows (sinks, then the newest tokens, evicting 32 at a time when
 * window + 32 are held), and that evictions send the oldest ones in order. */
static void run_ring(uint32_t sink, uint32_t window, uint32_t prefill, uint32_t appends)
{
	uint32_t cap = sink + window + KVG_APPEND_BATCH;
	uint32_t *store = xmalloc(cap * sizeof *store);
	uint32_t nsink = prefill < sink ? prefill : sink;
	uint32_t lo = nsink, hi = prefill - lo > window ? prefill - window : lo;
	struct kvg_ring r = { nsink, cap - nsink, 0, prefill - hi };
	uint32_t cpu_first = hi;        /* CPU: local recent rows are [cpu_first, n) */
	uint32_t sent = hi;             /* next token kvd should receive */

	for (uint32_t i = 0; i < nsink; i++)
		store[i] = i;
	for (uint32_t i = 0; i < prefill - hi; i++)
		store[nsink + i] = hi + i;
	for (uint32_t n = prefill; n < prefill + appends; n++) {
		store[kvg_ring_tail(&r)] = n;
		r.count++;
		if (n + 1 - nsink - (cpu_first - nsink) >= window + KVG_APPEND_BATCH)
			cpu_first += KVG_APPEND_BATCH;
		if (kvg_ring_must_evict(&r, window)) {
			struct kvg_rows rw = { NULL, NULL, cap, r.nsink, r.head, r.count };

			for (uint32_t i = 0; i < KVG_APPEND_BATCH; i++)
				assert_int_equal(store[kvg_rows_at(&rw, nsink + i)], sent++);
			kvg_ring_drop(&r, KVG_APPEND_BATCH);
		}
		struct kvg_rows rw = { NULL, NULL, cap, r.nsink, r.head, r.count };

		assert_int_equal(kvg_rows_n(&rw), nsink + (n + 1 - cpu_first));
		assert_int_equal(sent, cpu_first);
		for (uint32_t i = 0; i < kvg_rows_n(&rw); i++) {
			uint32_t at = kvg_rows_at(&rw, i);

			assert_true(at < cap);
			/* logical order is token order: sinks, then oldest to newest */
			assert_int_equal(store[at], i < nsink ? i : cpu_first + (i - nsink));
		}
	}
	free(store);
}

static void test_ring(void **state)
{
	run_ring(4, 64, 6000, 500);
	run_ring(4, 64, 10, 300);       /* nothing offloaded at prefill */
	run_ring(4, 64, 2, 300);        /* fewer tokens than sinks */
	run_ring(0, 32, 100, 300);
	run_ring(16, 1, 17, 200);
}

/* ---- slots and chunks ------------------------------------------------------ */

static void test_chunks_and_slots(void **state)
{
	static const uint64_t sizes[] = { 4096, 65536, 1 << 20, 4 << 20, 64 << 20 };
	static const uint32_t geo[][4] = { { 8, 32, 128, 150 }, { 2, 8, 128, 60 },
					   { 1, 16, 64, 1 }, { 4, 64, 256, 1024 } };

	for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
		for (size_t j = 0; j < sizeof geo / sizeof geo[0]; j++) {
			uint32_t H = geo[j][0], Hq = geo[j][1], d = geo[j][2], L = geo[j][3];
			uint32_t ch = kvd_rows_fit(H, d, L, sizes[i]);
			uint32_t per = kvd_attend_fit(Hq, d, L, sizes[i]);
			struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, L);

			if (ch)
				assert_true(kvd_rows_bytes(H, d, L, ch, 1) <= sizes[i]);
			if (ch < 65536)
				assert_true(kvd_rows_bytes(H, d, L, ch + 1, 1) > sizes[i]);
			assert_int_equal(lay.in, kvd_attend_in_bytes(Hq, d, L));
			assert_int_equal(lay.out, kvd_attend_out_bytes(Hq, d));
			assert_int_equal(lay.q_off % 64, 0);
			assert_int_equal(lay.codes_off, 64 + KVD_ALIGN64((uint64_t)Hq * d * 4));
			assert_true(lay.codes_off + (uint64_t)Hq * L * 2 <= lay.in);
			assert_true(lay.lse_off + (uint64_t)Hq * 4 <= lay.out);
			/* outputs at cnt * in (== ALIGN64, in is a multiple of 64) */
			assert_int_equal(lay.in % 64, 0);
			assert_int_equal(lay.out % 64, 0);
			if (per) {
				assert_true((uint64_t)per * (lay.in + lay.out) <= sizes[i]);
				assert_true((uint64_t)(per + 1) * (lay.in + lay.out) > sizes[i] ||
					    per == 4096);
			}
		}
}

/* ---- the pack kernel's layout against kvd_prep's codes ------------------------ */

/* Keys: projections in double, packed by kvg_pack_ref with the key layout,
 * equal kvd_prep_rows' codes exactly when every projection is 1e-3 or more
 * from 0.  Queries likewise against kvd_prep_query_codes. */
static void test_pack_layout_matches_prep(void **state)
{
	const struct kvd_geom g = { 8, 2, 128, 10, 24, 2, KVD_KV_BF16, 0 };
	const uint32_t H = g.kv_heads, d = g.d, K = g.K, L = g.L, KL = K * L, n = 97;
	float *W = xmalloc((size_t)d * KL * sizeof *W);
	float *k = xmalloc((size_t)H * n * d * 4), *v = xmalloc((size_t)H * n * d * 4);
	float *mean = xmalloc((size_t)H * d * 4), *x = xmalloc((size_t)n * d * 4);
	float *y = xmalloc((size_t)H * n * KL * 4);
	double *scr = xmalloc(KL * sizeof *scr);
	uint16_t *kb = xmalloc((size_t)H * n * d * 2), *vb = xmalloc((size_t)H * n * d * 2);
	uint16_t *codes = xmalloc((size_t)H * L * n * 2), *ref = xmalloc((size_t)H * L * n * 2);
	struct kvd_rng r = kvd_rng_make(42);
	struct kvg_code_layout klay = { n, L * n, n, 1 };
	int draws = 0;

	kvd_lsh_make_w(3, (int)d, (int)K, (int)L, W);
	fill_normal(mean, (size_t)H * d, &r, 0.5, 1.0);
	fill_normal(v, (size_t)H * n * d, &r, 0.0, 1.0);
	for (uint32_t h = 0; h < H; h++)
		for (uint32_t i = 0; i < n; i++) {
			float xr[128];

			draws += clean_key(k + ((size_t)h * n + i) * d, mean + (size_t)h * d, W, d, KL, &r,
					   0.5, 1.0, 1e-3, xr, scr);
			proj_double(W, d, KL, xr, scr);
			for (uint32_t t = 0; t < KL; t++)
				y[((size_t)h * n + i) * KL + t] = (float)scr[t];
		}
	assert_true(draws < 2 * (int)(H * n));  /* the margin rejects few rows */
	kvd_prep_rows(&g, W, mean, k, v, n, 0, n, kb, vb, codes, x);
	kvg_pack_ref(y, H * n, K, L, &klay, ref);
	assert_memory_equal(codes, ref, (size_t)H * L * n * 2);

	/* queries: [Hq][L], not centered, not rounded */
	float q[8 * 128];
	uint16_t qc[8 * 24], qref[8 * 24];
	struct kvg_code_layout qlay = { 1, L, 1, 0 };

	for (uint32_t qh = 0; qh < g.q_heads; qh++) {
		clean_query(q + (size_t)qh * d, W, d, KL, &r, 1e-3, scr);
		for (uint32_t t = 0; t < KL; t++)
			y[(size_t)qh * KL + t] = (float)scr[t];
	}
	kvd_prep_query_codes(&g, W, q, qc);
	kvg_pack_ref(y, g.q_heads, K, L, &qlay, qref);
	assert_memory_equal(qc, qref, sizeof qc);

	free(W); free(k); free(v); free(mean); free(x); free(y); free(scr);
	free(kb); free(vb); free(codes); free(ref);
}

/* ---- references ----------------------------------------------------------------- */

/* kvg_attn_ref over a wrapped ring equals kvd_ref_dense over the same rows
 * listed in logical order, and kvd_attn_dense (the CPU backend's kernel)
 * within float tolerance. */
static void test_attn_ref(void **state)
{
	const uint32_t H = 2, G = 4, d = 128, cap = 100, nsink = 4;
	uint16_t *k = xmalloc((size_t)H * cap * d * 2), *v = xmalloc((size_t)H * cap * d * 2);
	float q[4 * 128];
	struct kvd_rng r = kvd_rng_make(7);
	struct kvg_rows rw = { k, v, cap, nsink, 70, 60 };      /* wraps: 70 + 60 > 96 */
	uint32_t n = kvg_rows_n(&rw);
	float *kf = xmalloc((size_t)n * d * 4), *vf = xmalloc((size_t)n * d * 4);
	uint16_t *kl = xmalloc((size_t)n * d * 2), *vl = xmalloc((size_t)n * d * 2);

	fill_bf16(k, (size_t)H * cap * d, &r, 0.0, 1.0);
	fill_bf16(v, (size_t)H * cap * d, &r, 0.0, 1.0);
	fill_normal(q, G * d, &r, 0.0, 1.0);
	for (uint32_t h = 0; h < H; h++) {
		double o[4 * 128], lse[4], ro[128], rl;
		float fo[4 * 128], fl[4], s[KVD_ATTN_DENSE_SCRATCH];

		kvg_attn_ref(q, G, d, &rw, h, o, lse);
		for (uint32_t i = 0; i < n; i++) {
			size_t src = ((size_t)h * cap + kvg_rows_at(&rw, i)) * d;

			memcpy(kl + (size_t)i * d, k + src, d * 2);
			memcpy(vl + (size_t)i * d, v + src, d * 2);
			kvd_bf16_to_f32_n(kf + (size_t)i * d, k + src, d);
			kvd_bf16_to_f32_n(vf + (size_t)i * d, v + src, d);
		}
		for (uint32_t g = 0; g < G; g++) {
			kvd_ref_dense(q + g * d, (int)d, kf, vf, NULL, n, ro, &rl);
			for (uint32_t e = 0; e < d; e++)
				assert_true(fabs(o[g * d + e] - ro[e]) < 1e-12);
			assert_true(fabs(lse[g] - rl) < 1e-12);
		}
		kvd_attn_dense(kvd_kern_get(), q, (int)G, (int)d, kl, vl, n, fo, fl, s);
		assert_true(rel_err_fd(fo, o, G * d) < 1e-5);
		for (uint32_t g = 0; g < G; g++)
			assert_true(fabs(fl[g] - lse[g]) < 1e-4);
	}
	/* empty: (0, -inf) */
	struct kvg_rows empty = { k, v, cap, 0, 0, 0 };
	double o[4 * 128], lse[4];

	kvg_attn_ref(q, G, d, &empty, 0, o, lse);
	for (uint32_t g = 0; g < G; g++)
		assert_true(isinf(lse[g]) && lse[g] < 0);
	free(k); free(v); free(kf); free(vf); free(kl); free(vl);
}

static void test_merge_ref(void **state)
{
	const uint32_t G = 3, d = 16;
	float a[3 * 16], b[3 * 16], la[3] = { 1.5f, -INFINITY, 0.25f }, lb[3] = { 0.5f, 2.0f, -INFINITY };
	double o[3 * 16], lse[3];
	struct kvd_rng r = kvd_rng_make(9);

	fill_normal(a, G * d, &r, 0, 1);
	fill_normal(b, G * d, &r, 0, 1);
	for (uint32_t i = 0; i < G * d; i++)
		o[i] = a[i];
	for (uint32_t g = 0; g < G; g++)
		lse[g] = la[g];
	kvg_merge_ref(o, lse, b, lb, G, d);
	kvd_attn_merge(a, la, b, lb, (int)G, (int)d);
	assert_true(rel_err_fd(a, o, G * d) < 1e-6);
	for (uint32_t g = 0; g < G; g++)
		assert_true(fabs(la[g] - lse[g]) < 1e-6);
	/* g = 1 took b whole, g = 2 kept a */
	assert_true(fabs(lse[1] - 2.0) < 1e-12 && fabs(lse[2] - 0.25) < 1e-12);
}

/* ---- backend choice --------------------------------------------------------------- */

static void test_backend_wanted(void **state)
{
	struct kvc_opts o = { 0 };
	char msg[128];

	assert_int_equal(kvg_backend_wanted(NULL, "cuda", msg, sizeof msg), KVC_BACKEND_CPU);
	assert_int_equal(kvg_backend_wanted(&o, "cuda", msg, sizeof msg), KVC_BACKEND_CPU);
	o.backend = KVC_BACKEND_CUDA;
	assert_int_equal(kvg_backend_wanted(&o, "cpu", msg, sizeof msg), KVC_BACKEND_CUDA);
	o.backend = KVC_BACKEND_AUTO;
	assert_int_equal(kvg_backend_wanted(&o, NULL, msg, sizeof msg), KVC_BACKEND_AUTO);
	assert_int_equal(kvg_backend_wanted(&o, "", msg, sizeof msg), KVC_BACKEND_AUTO);
	assert_int_equal(kvg_backend_wanted(&o, "cpu", msg, sizeof msg), KVC_BACKEND_CPU);
	assert_int_equal(kvg_backend_wanted(&o, "cuda", msg, sizeof msg), KVC_BACKEND_CUDA);
	assert_int_equal(kvg_backend_wanted(&o, "auto", msg, sizeof msg), KVC_BACKEND_AUTO);
	assert_int_equal(kvg_backend_wanted(&o, "gpu", msg, sizeof msg), -EINVAL);
	assert_non_null(strstr(msg, "KVC_BACKEND=gpu"));
	o.backend = 7;
	assert_int_equal(kvg_backend_wanted(&o, NULL, msg, sizeof msg), -EINVAL);
}

/* CUDA asked for on a machine without one fails before connecting, saying
 * so; AUTO falls back to the CPU and goes on to connect. */
static void test_backend_at_connect(void **state)
{
	struct kvc_opts o = { .socket_path = "/nonexistent/kvd.sock", .backend = KVC_BACKEND_CUDA };
	struct kvc *c;
	int rc = kvc_connect(&o, &c);

	if (rc == -ENODEV)
		assert_non_null(strstr(kvc_last_error(c), "no CUDA device"));
	else    /* a device is there: it got as far as the socket */
		assert_int_equal(rc, -ENOENT);
	kvc_close(c);

	o.backend = KVC_BACKEND_AUTO;
	rc = kvc_connect(&o, &c);
	assert_int_equal(rc, -ENOENT);
	kvc_close(c);
	o.backend = 5;
	assert_int_equal(kvc_connect(&o, &c), -EINVAL);
	assert_non_null(strstr(kvc_last_error(c), "unknown backend"));
	kvc_close(c);
}

/* The device API on a CPU-backend connection: -ENOTSUP and a reason, and
 * nothing else changes (the host API keeps working). */
static void test_dev_api_on_cpu_backend(void **state)
{
	static const uint32_t dense[] = { 0 };
	const struct kvc_model m = {
		.name = "gpu-plan", .layers = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 64,
		.K = 4, .L = 8, .c = 1, .sink = 2, .window = 16, .dense_layers = dense,
		.n_dense = 1, .seed = 5,
	};
	struct daemon D;
	struct kvc_opts o = { .tenant = "t", .slots = 4, .slot_size = 1 << 20 };
	struct kvc *c;
	struct kvc_seq *s;
	struct kvc_timing t;
	float k[2 * 100 * 64], v[2 * 100 * 64], q[4 * 64], out[4 * 64], lse[4];
	struct kvd_rng r = kvd_rng_make(1);

	assert_int_equal(daemon_start(&D, NULL), 0);
	o.socket_path = D.sock;
	if (kvc_connect(&o, &c) || kvc_profile(c, &m) || kvc_seq_create(c, &s))
		fail_msg("%s", kvc_last_error(c));
	assert_int_equal(kvc_backend(c), KVC_BACKEND_CPU);
	assert_int_equal(kvc_prefill_dev(c, s, 1, k, v, 100, KVC_F32, NULL), -ENOTSUP);
	assert_non_null(strstr(kvc_last_error(c), "CPU backend") ?
			strstr(kvc_last_error(c), "CPU backend") :
			strstr(kvc_last_error(c), "without CUDA"));
	assert_int_equal(kvc_append_dev(c, 1, &s, 1, k, v, KVC_F32, NULL), -ENOTSUP);
	assert_int_equal(kvc_attend_dev(c, 1, &s, 1, q, out, lse, NULL), -ENOTSUP);
	assert_int_equal(kvc_attend_kvd_dev(c, 1, &s, 1, q, out, lse, NULL), -ENOTSUP);
	assert_int_equal(kvc_timing(c, &t, 1), 0);
	assert_int_equal(t.attends, 0);
	/* the host API is untouched */
	fill_normal(k, sizeof k / 4, &r, 0, 1);
	fill_normal(v, sizeof v / 4, &r, 0, 1);
	fill_normal(q, sizeof q / 4, &r, 0, 1);
	for (uint32_t l = 0; l < 2; l++)
		if (kvc_prefill(c, s, l, k, v, 100))
			fail_msg("%s", kvc_last_error(c));
	if (kvc_attend(c, 1, &s, 1, q, out, lse))
		fail_msg("%s", kvc_last_error(c));
	for (int i = 0; i < 4; i++)
		assert_true(isfinite(lse[i]));
	assert_int_equal(kvc_seq_free(c, s), 0);
	kvc_close(c);
	assert_int_equal(daemon_stop(&D), 0);
}

/* ---- kvd-decode's flags ------------------------------------------------------------ */

static int parse(struct dec_args *a, char *msg, ...)
{
	char *argv[32];
	int argc = 0;
	va_list ap;

	va_start(ap, msg);
	for (char *s; (s = va_arg(ap, char *));)
		argv[argc++] = s;
	va_end(ap);
	dec_args_default(a);
	return dec_args_parse(a, argc, argv, msg, 128);
}

static void test_decode_args(void **state)
{
	struct dec_args a;
	char msg[128];

	assert_int_equal(parse(&a, msg, NULL), 0);
	assert_int_equal(a.attn, DEC_KVD);
	assert_int_equal(a.layers, 32);
	/* kvd's recommended configuration by default */
	assert_int_equal(a.kv_dtype, KVD_EST_CFG_DEFAULT.kv_dtype);
	assert_int_equal(a.estimator, KVD_EST_CFG_DEFAULT.est);
	assert_int_equal(a.L, KVD_EST_CFG_DEFAULT.L);
	assert_int_equal(a.seg_tokens, KVD_EST_CFG_DEFAULT.seg_tokens);
	assert_int_equal(parse(&a, msg, "--kv-dtype", "bf16", NULL), 0);
	assert_int_equal(a.kv_dtype, KVD_KV_BF16);
	assert_int_equal(parse(&a, msg, "--kv-dtype", "int8", NULL), 0);
	assert_int_equal(a.kv_dtype, KVD_KV_INT8);
	assert_int_equal(parse(&a, msg, "--kv-dtype=bf16", NULL), 0);
	assert_int_equal(a.kv_dtype, KVD_KV_BF16);
	assert_int_equal(parse(&a, msg, "--kv-dtype=fp8", NULL), -EINVAL);
	assert_non_null(strstr(msg, "--kv-dtype: bf16 or int8, not fp8"));
	assert_int_equal(parse(&a, msg, "--kv-dtype", NULL), -EINVAL);
	assert_int_equal(a.share, DEC_SHARE_NONE);
	assert_int_equal(parse(&a, msg, "--share", "attach", "--batch", "4", NULL), 0);
	assert_int_equal(a.share, DEC_SHARE_ATTACH);
	assert_int_equal(parse(&a, msg, "--share=fork", NULL), 0);
	assert_int_equal(a.share, DEC_SHARE_FORK);
	assert_int_equal(parse(&a, msg, "--share", "attach", "--ctx", "1000", NULL), -EINVAL);
	assert_non_null(strstr(msg, "multiple of 256"));
	assert_int_equal(parse(&a, msg, "--share", "fork", "--attn", "gpu-dense", NULL), -EINVAL);
	assert_non_null(strstr(msg, "kvd mode only"));
	assert_int_equal(parse(&a, msg, "--share", "copy", NULL), -EINVAL);
	assert_non_null(strstr(msg, "none, attach or fork"));
	assert_int_equal(parse(&a, msg, "--estimator", "magicpig", NULL), 0);
	assert_int_equal(a.estimator, KVD_EST_MAGICPIG);
	assert_int_equal(parse(&a, msg, "--estimator", "hybrid", NULL), 0);
	assert_int_equal(a.estimator, KVD_EST_HYBRID);
	assert_int_equal(parse(&a, msg, "--estimator=adaptive", NULL), 0);
	assert_int_equal(a.estimator, KVD_EST_ADAPTIVE);
	assert_int_equal(parse(&a, msg, "--estimator=exact", NULL), -EINVAL);
	assert_non_null(strstr(msg, "--estimator: magicpig, hybrid, adaptive, hybrid_cv or hybrid_lcv, not exact"));
	assert_int_equal(parse(&a, msg, "--estimator", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--attn=gpu-dense", "--ctx", "96k", "--batch=8",
			       "--steps", "10", "--K", "8", "--L=75", "--c", "1", "--json", NULL), 0);
	assert_int_equal(a.attn, DEC_GPU_DENSE);
	assert_int_equal(a.ctx, 98304);
	assert_int_equal(a.batch, 8);
	assert_int_equal(a.steps, 10);
	assert_int_equal(a.K, 8);
	assert_int_equal(a.L, 75);
	assert_int_equal(a.c, 1);
	assert_int_equal(a.json, 1);
	assert_string_equal(dec_attn_name(a.attn), "gpu-dense");
	assert_int_equal(parse(&a, msg, "--slot-size", "8M", "--socket", "/x/y", "--seed=9", NULL), 0);
	assert_int_equal(a.slot_size, 8u << 20);
	assert_string_equal(a.socket, "/x/y");
	assert_int_equal(a.seed, 9);
	assert_int_equal(parse(&a, msg, "--help", NULL), 1);

	assert_int_equal(parse(&a, msg, "--attn=cpu", NULL), -EINVAL);
	assert_non_null(strstr(msg, "gpu-dense or kvd"));
	assert_int_equal(parse(&a, msg, "--ctx", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--ctx", "0", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--ctx", "12x", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--ctx", "-5", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--K", "17", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--c", "3", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--layers", "33", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--layers", "1", NULL), -EINVAL);      /* kvd mode */
	assert_int_equal(parse(&a, msg, "--attn=gpu-dense", "--layers", "1", NULL), 0);
	assert_int_equal(parse(&a, msg, "--slot-size", "5000", NULL), -EINVAL);
	assert_int_equal(parse(&a, msg, "--bogus", NULL), -EINVAL);
	assert_non_null(strstr(msg, "unknown option --bogus"));
	assert_int_equal(parse(&a, msg, "--seed", "99999999999999999999999", NULL), -EINVAL);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_attn_plan),
		cmocka_unit_test(test_ring),
		cmocka_unit_test(test_chunks_and_slots),
		cmocka_unit_test(test_pack_layout_matches_prep),
		cmocka_unit_test(test_attn_ref),
		cmocka_unit_test(test_merge_ref),
		cmocka_unit_test(test_backend_wanted),
		cmocka_unit_test(test_backend_at_connect),
		cmocka_unit_test(test_dev_api_on_cpu_backend),
		cmocka_unit_test(test_decode_args),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
