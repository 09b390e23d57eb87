/* kvd_sfmt and restorable segments: every extent kind sealed, checked and
 * read back (a restored segment answers attention bit for bit like the one
 * it was spilled from); every single-bit flip of a header and a flipped
 * payload byte rejected; every table corruption kvd_seg_check guards
 * against rejected even with the CRCs recomputed; profile fingerprints that
 * follow every field.
 *
 * With KVD_SFMT_SEEDS=DIR set, also writes the sealed extents it makes to
 * DIR as fuzz seeds (tests/fuzz/fuzz_sfmt.c: header struct, then payload):
 *   KVD_SFMT_SEEDS=tests/fuzz/seeds/fuzz_sfmt build/tests/test_sfmt
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/attn.h"
#include "proto/ctl.h"
#include "engine/err.h"
#include "engine/lsh.h"
#include "engine/pool.h"
#include "engine/prep.h"
#include "kvd/store/sfmt.h"
#include "engine/synth.h"
#include "testutil.h"

#define PAGE KVD_SFMT_PAGE

/* A profile on disk was once a valid request: the store's limits (which
 * sfmt checks) are the wire's. */
static_assert(KVD_NAME_MAX == KVD_CTL_NAME_MAX, "one name limit");
static_assert(KVD_PROFILE_LAYERS_MAX == KVD_CTL_LAYERS_MAX, "one layers limit");
static_assert(KVD_PROFILE_TOKENS_MAX == KVD_CTL_TOKENS_MAX, "one sink/window limit");
static_assert(KVD_PROFILE_SEG_MIN == KVD_CTL_SEG_MIN, "one seg_tokens minimum");
static_assert(KVD_PROFILE_SEAL_MIN == KVD_CTL_SEAL_MIN, "one seal_tokens minimum");
static_assert(KVD_PROFILE_CHUNK_DEFAULT == KVD_CTL_CHUNK_DEFAULT, "one chunk default");

static const struct kvd_kern *kv[8];
static int nkv;

/* ---- helpers ------------------------------------------------------------ */

static void seed_write(const char *name, const struct kvd_sfmt_hdr *h, const void *payload)
{
	const char *dir = getenv("KVD_SFMT_SEEDS");
	char path[512];
	FILE *f;

	if (!dir || !*dir)
		return;
	snprintf(path, sizeof path, "%s/%s", dir, name);
	f = fopen(path, "wb");
	assert_non_null(f);
	assert_int_equal(fwrite(h, sizeof *h, 1, f), 1);
	if (h->payload_bytes)
		assert_int_equal(fwrite(payload, h->payload_bytes, 1, f), 1);
	assert_int_equal(fclose(f), 0);
}

static void hdr_base(struct kvd_sfmt_hdr *h, uint32_t kind, const struct kvd_geom *g)
{
	memset(h, 0, sizeof *h);
	h->kind = kind;
	h->seq = 0x1234567890abcdefull;
	h->gen = 7;
	h->profile_fp = 0xfeedfacecafebeefull;
	h->kv_heads = g->kv_heads;
	h->d = g->d;
	h->K = g->K;
	h->L = g->L;
	strcpy(h->tenant, "1000:team-a");
}

/* Seals h over payload and checks it as a reader would. */
static void seal_and_check(struct kvd_sfmt_hdr *h, void *payload)
{
	struct kvd_sfmt_hdr got;
	char msg[256] = "";

	kvd_sfmt_seal(h, payload);
	assert_int_equal(h->extent_bytes, kvd_sfmt_extent_bytes(h->payload_bytes));
	if (kvd_sfmt_check_hdr(h, sizeof *h, &got, msg, sizeof msg))
		fail_msg("check_hdr: %s", msg);
	assert_memory_equal(&got, h, sizeof got);
	if (kvd_sfmt_check_payload(&got, payload, msg, sizeof msg))
		fail_msg("check_payload: %s", msg);
}

static void expect_hdr_fail(const struct kvd_sfmt_hdr *h, const char *what)
{
	struct kvd_sfmt_hdr got;
	char msg[256] = "";
	int rc = kvd_sfmt_check_hdr(h, sizeof *h, &got, msg, sizeof msg);

	if (rc != -KVD_EFORMAT)
		fail_msg("%s: check_hdr returned %d, want -KVD_EFORMAT", what, rc);
	assert_true(msg[0] != 0);
}

/* Rewrites hdr_crc only (kvd_sfmt_seal would also fix magic, version and
 * extent_bytes, which some cases corrupt on purpose). */
static void fix_hdr_crc(struct kvd_sfmt_hdr *h)
{
	h->hdr_crc = 0;
	h->hdr_crc = kvd_sfmt_crc32c(h, sizeof *h);
}

/* ---- basics ------------------------------------------------------------- */

static void test_constants(void **state)
{
	assert_int_equal(sizeof(struct kvd_sfmt_hdr), 184);
	assert_int_equal(kvd_sfmt_extent_bytes(0), PAGE);
	assert_int_equal(kvd_sfmt_extent_bytes(1), 2 * PAGE);
	assert_int_equal(kvd_sfmt_extent_bytes(PAGE), 2 * PAGE);
	assert_int_equal(kvd_sfmt_extent_bytes(PAGE + 1), 3 * PAGE);
	assert_int_equal(kvd_sfmt_extent_bytes(UINT64_MAX), 0);
	assert_int_equal(kvd_sfmt_extent_bytes(UINT64_MAX - 2 * PAGE + 1), 0);
	assert_int_equal(kvd_sfmt_crc32c("123456789", 9), 0xe3069283u);
	assert_int_equal(kvd_sfmt_crc32c(NULL, 0), 0);
	/* a header that is too short is refused without being read past len */
	struct kvd_sfmt_hdr h;
	char msg[128];

	memset(&h, 0, sizeof h);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h - 1, NULL, msg, sizeof msg), -KVD_EFORMAT);
	assert_int_equal(kvd_sfmt_check_hdr(NULL, 0, NULL, NULL, 0), -KVD_EFORMAT);
	/* The store's chunk default (what a file writes as 0) is the wire's
	 * for every seal_tokens a profile may have. */
	for (uint32_t seal = 1; seal <= KVD_SEG_MAX; seal++)
		if (kvd_store_chunk_default(seal) != kvd_ctl_chunk_default(seal))
			fail_msg("seal %u: store's chunk %u, ctl's %u", seal,
				 kvd_store_chunk_default(seal), kvd_ctl_chunk_default(seal));
}

/* ---- profiles ----------------------------------------------------------- */

struct prof {
	struct kvd_profile p;
	uint8_t dense[KVD_PROFILE_LAYERS_MAX];
	float *W;
};

static void prof_make(struct prof *x, uint32_t d, uint32_t K, uint32_t L, uint32_t layers)
{
	memset(&x->p, 0, sizeof x->p);
	strcpy(x->p.name, "llama-3-8b/test");
	x->p.id = 3;
	x->p.g = (struct kvd_geom){ .q_heads = 8, .kv_heads = 2, .d = d, .K = K, .L = L, .c = 2 };
	x->p.layers = layers;
	x->p.sink = 4;
	x->p.window = 64;
	x->p.seg_tokens = 4096;
	x->p.seal_tokens = 1024;
	x->p.seed = 0x5eed;
	memset(x->dense, 0, sizeof x->dense);
	x->dense[0] = 1;
	x->dense[layers - 1] = 1;
	x->p.dense = x->dense;
	/* room for any geometry a test switches to */
	x->W = xmalloc((size_t)KVD_DMAX * KVD_LSH_KMAX * 64 * sizeof(float));
	kvd_lsh_make_w(x->p.seed, (int)d, (int)K, (int)L, x->W);
	x->p.W = x->W;
}

static void prof_free(struct prof *x)
{
	free(x->W);
}

static uint8_t *profile_payload(const struct kvd_profile *p, struct kvd_sfmt_hdr *h)
{
	uint64_t bytes = kvd_sfmt_profile_bytes(p);
	uint8_t *pl = xmalloc(bytes);

	kvd_sfmt_profile_put(p, pl);
	hdr_base(h, KVD_SFMT_PROFILE, &p->g);
	h->payload_bytes = bytes;
	h->profile_fp = kvd_sfmt_profile_fp(p);
	return pl;
}

static void test_profile_round_trip(void **state)
{
	struct prof x;
	struct kvd_sfmt_hdr h;
	struct kvd_profile got;
	char msg[256];

	prof_make(&x, 64, 8, 10, 5);
	x.dense[2] = 7;         /* any nonzero means dense; stored as 1 */
	x.p.estimator = KVD_EST_ADAPTIVE;
	uint8_t *pl = profile_payload(&x.p, &h);

	assert_int_equal(h.payload_bytes, 256 + 64 + 64 * 8 * 10 * 4);
	seal_and_check(&h, pl);

	if (kvd_sfmt_profile_get(pl, h.payload_bytes, &got, msg, sizeof msg))
		fail_msg("%s", msg);
	assert_string_equal(got.name, x.p.name);
	assert_int_equal(got.id, 0);
	assert_null(got.tab);
	assert_memory_equal(&got.g, &x.p.g, sizeof got.g);
	assert_int_equal(got.layers, 5);
	assert_int_equal(got.sink, 4);
	assert_int_equal(got.window, 64);
	assert_int_equal(got.seg_tokens, 4096);
	assert_int_equal(got.seal_tokens, 1024);
	assert_int_equal(got.seed, 0x5eed);
	assert_int_equal(got.estimator, KVD_EST_ADAPTIVE);
	const uint8_t want_dense[5] = { 1, 0, 1, 0, 1 };

	assert_memory_equal(got.dense, want_dense, 5);
	assert_memory_equal(got.W, x.W, (size_t)64 * 8 * 10 * sizeof(float));
	/* the profile read back is the same profile */
	assert_true(kvd_sfmt_profile_fp(&got) == kvd_sfmt_profile_fp(&x.p));
	free(got.dense);
	free(got.W);
	free(pl);

	prof_free(&x);
}

/* Each case corrupts a valid PROFILE payload; profile_get must refuse it,
 * and so must check_payload with the CRC (and fingerprint) recomputed. */
static void test_profile_rejects(void **state)
{
	enum { NAME_EMPTY, NAME_LONG, NAME_CTRL, NAME_PAD, RESERVED0, RESERVED, ESTIMATOR, GEOM_D,
	       GEOM_G, LAYERS0, LAYERS_BIG, SINK, SEG_POW2, SEG_SMALL, SEAL_BIG, SEAL_SMALL, DENSE2,
	       DENSE_PAD, W_NAN, W_INF, SHORT, LONG, NCASES };
	struct prof x;
	struct kvd_sfmt_hdr h0;
	char msg[256];

	prof_make(&x, 32, 6, 4, 5);
	uint8_t *good = profile_payload(&x.p, &h0);
	uint64_t bytes = h0.payload_bytes;
	uint8_t *pl = xmalloc(bytes + 64);

	for (int c = 0; c < NCASES; c++) {
		struct kvd_sfmt_profile_rec r;
		struct kvd_profile got;
		uint64_t nb = bytes;
		uint8_t *w = pl + 256 + 64;

		memcpy(pl, good, bytes);
		memcpy(&r, pl, sizeof r);
		switch (c) {
		case NAME_EMPTY: memset(r.name, 0, sizeof r.name); break;
		case NAME_LONG: memset(r.name, 'a', sizeof r.name); break;
		case NAME_CTRL: r.name[2] = '\n'; break;
		case NAME_PAD: r.name[70] = 'x'; break;
		case RESERVED0: r.kv_dtype = KVD_KV_DTYPE_MAX + 1; break;
		case RESERVED: r.reserved[sizeof r.reserved - 1] = 1; break;
		case ESTIMATOR: r.estimator = KVD_EST_MAX + 1; break;
		case GEOM_D: r.d = 24; break;
		case GEOM_G: r.kv_heads = 3; break;
		case LAYERS0: r.layers = 0; break;
		case LAYERS_BIG: r.layers = KVD_PROFILE_LAYERS_MAX + 1; break;
		case SINK: r.sink = KVD_PROFILE_TOKENS_MAX + 1; break;
		case SEG_POW2: r.seg_tokens = 3000; break;
		case SEG_SMALL: r.seg_tokens = 128; break;
		case SEAL_BIG: r.seal_tokens = 8192; break;
		case SEAL_SMALL: r.seal_tokens = 8; break;
		case DENSE2: pl[256 + 1] = 2; break;
		case DENSE_PAD: pl[256 + 63] = 1; break;
		case W_NAN: memcpy(w + 40, &(float){ NAN }, 4); break;
		case W_INF: memcpy(w + bytes - 256 - 64 - 4, &(float){ INFINITY }, 4); break;
		case SHORT: nb = bytes - 4; break;
		case LONG: nb = bytes + 64; memset(pl + bytes, 0, 64); break;
		}
		if (c < DENSE2)
			memcpy(pl, &r, sizeof r);
		msg[0] = 0;
		if (kvd_sfmt_profile_get(pl, nb, &got, msg, sizeof msg) != -KVD_EFORMAT)
			fail_msg("case %d accepted by profile_get", c);
		assert_true(msg[0] != 0);
		assert_null(got.dense);
		assert_null(got.W);

		/* the structural checks, not the CRC, catch it */
		struct kvd_sfmt_hdr h = h0;

		h.payload_bytes = nb;
		kvd_sfmt_seal(&h, pl);
		if (!kvd_sfmt_check_hdr(&h, sizeof h, &h, msg, sizeof msg))
			assert_int_equal(kvd_sfmt_check_payload(&h, pl, msg, sizeof msg),
					 -KVD_EFORMAT);
	}

	/* a valid record whose header disagrees: geometry, fingerprint */
	struct kvd_sfmt_hdr h = h0;

	h.profile_fp ^= 1;
	kvd_sfmt_seal(&h, good);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &h, msg, sizeof msg), 0);
	assert_int_equal(kvd_sfmt_check_payload(&h, good, msg, sizeof msg), -KVD_EFORMAT);
	assert_non_null(strstr(msg, "fingerprint"));
	h = h0;
	h.kv_heads = 1;
	kvd_sfmt_seal(&h, good);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &h, msg, sizeof msg), 0);
	assert_int_equal(kvd_sfmt_check_payload(&h, good, msg, sizeof msg), -KVD_EFORMAT);
	free(pl);
	free(good);
	prof_free(&x);
}

static void test_fingerprint_fields(void **state)
{
	struct prof x;

	prof_make(&x, 64, 8, 10, 6);
	const struct kvd_profile base = x.p;
	const uint64_t fp0 = kvd_sfmt_profile_fp(&x.p);
	uint64_t seen[64];
	int ns = 0;

	seen[ns++] = fp0;
	for (int c = 0;; c++) {
		struct kvd_profile *p = &x.p;

		*p = base;
		kvd_lsh_make_w(base.seed, 64, 8, 10, x.W);
		switch (c) {
		case 0: p->name[0] ^= 1; break;
		case 1: strcat(p->name, "x"); break;
		case 2: p->g.q_heads = 16; break;
		case 3: p->g.kv_heads = 4; break;
		case 4: p->g.d = 80; break;
		case 5: p->g.K = 9; break;
		case 6: p->g.L = 11; break;
		case 7: p->g.c = 1; break;
		case 8: p->layers = 7; break;
		case 9: p->sink = 5; break;
		case 10: p->window = 65; break;
		case 11: p->seg_tokens = 8192; break;
		case 12: p->seal_tokens = 512; break;
		case 13: p->seed ^= 1; break;
		case 14: x.dense[3] = 1; break;
		case 15: x.W[0] = nextafterf(x.W[0], INFINITY); break;
		case 16: x.W[64 * 8 * 10 - 1] = -x.W[64 * 8 * 10 - 1]; break;
		case 17: p->estimator = KVD_EST_HYBRID; break;
		case 18: p->estimator = KVD_EST_ADAPTIVE; break;
		default: goto done;
		}
		uint64_t fp = kvd_sfmt_profile_fp(p);

		for (int i = 0; i < ns; i++)
			if (seen[i] == fp)
				fail_msg("change %d: fingerprint %016llx seen before", c,
					 (unsigned long long)fp);
		seen[ns++] = fp;
		x.dense[3] = 0;
	}
done:
	/* what is not the profile's definition does not count */
	x.p = base;
	kvd_lsh_make_w(base.seed, 64, 8, 10, x.W);
	x.p.id = 99;
	x.p.tab = (struct kvd_logp_tab *)&x;    /* never read */
	x.p.name[strlen(x.p.name) + 1] = 'z';   /* past the NUL */
	x.dense[1] = 5;                         /* nonzero is nonzero */
	x.dense[0] = 1;
	uint64_t fp1 = kvd_sfmt_profile_fp(&x.p);

	x.dense[1] = 1;
	assert_true(fp1 == kvd_sfmt_profile_fp(&x.p));
	x.dense[1] = 0;
	assert_true(kvd_sfmt_profile_fp(&x.p) == fp0);
	prof_free(&x);
}

/* ---- layers and END ----------------------------------------------------- */

static void test_layer_round_trip(void **state)
{
	const struct kvd_geom g = { .q_heads = 8, .kv_heads = 2, .d = 32, .K = 6, .L = 5, .c = 1 };
	struct kvd_rng r = kvd_rng_make(3);

	for (int mean = 0; mean <= 1; mean++) {
		for (uint32_t n = 0; n <= 37; n += 37) {
			uint64_t bytes = kvd_sfmt_layer_bytes(&g, n, mean);
			size_t H = g.kv_heads, d = g.d, L = g.L;
			uint8_t *pl = aligned_alloc(64, bytes + 64);
			float *m;
			uint16_t *k, *v, *codes;
			struct kvd_sfmt_hdr h;

			kvd_sfmt_layer_parts(&g, n, mean, pl, &m, &k, &v, &codes);
			/* parts in order, 64-aligned, each inside the payload */
			uint8_t *pm = (uint8_t *)m, *pk = (uint8_t *)k, *pv = (uint8_t *)v;
			uint8_t *pc = (uint8_t *)codes;

			assert_true(mean ? m == (float *)pl : m == NULL);
			assert_true(!mean || pm + H * d * 4 <= pk);
			assert_true(pk == pl + (mean ? 256 : 0));
			assert_true(pk + H * n * d * 2 <= pv);
			assert_true(pv + H * n * d * 2 <= pc);
			assert_true(pc + H * L * n * 2 <= pl + bytes);
			assert_int_equal(((uintptr_t)pk | (uintptr_t)pv | (uintptr_t)pc) % 64, 0);
			memset(pl, 0, bytes);
			if (mean)
				fill_normal(m, H * d, &r, 0, 1);
			fill_bf16(k, H * n * d, &r, 0, 1);
			fill_bf16(v, H * n * d, &r, 0, 1);
			for (size_t i = 0; i < H * L * n; i++)
				codes[i] = (uint16_t)kvd_rng_bits(&r);

			hdr_base(&h, KVD_SFMT_LAYER, &g);
			h.index = 1;
			h.layer = 3;
			h.n = n;
			h.tok_begin = 4096;
			h.tok_end = 4096 + n;
			h.flags = (mean ? KVD_SFMT_LF_MEAN : 0) | KVD_SFMT_LF_SEALED;
			h.payload_bytes = bytes;
			seal_and_check(&h, pl);
			free(pl);
		}
	}
}

static void test_end_round_trip(void **state)
{
	const struct kvd_geom g = { .q_heads = 8, .kv_heads = 2, .d = 32, .K = 6, .L = 5, .c = 1 };
	const struct kvd_geom zero = { 0 };
	struct kvd_sfmt_hdr h;

	hdr_base(&h, KVD_SFMT_END, &g);
	h.index = h.n = 9;
	seal_and_check(&h, NULL);
	assert_int_equal(h.extent_bytes, PAGE);
	assert_int_equal(h.crc, 0);
	hdr_base(&h, KVD_SFMT_END, &zero);
	h.index = h.n = 2;
	seal_and_check(&h, NULL);
}

/* ---- headers ------------------------------------------------------------ */

/* One sealed header of each kind, with their payloads. */
struct kinds {
	struct kvd_sfmt_hdr h[4];
	void *pl[4];
	struct prof x;
	struct kvd_seg *seg;
};

static void seg_from_codes(const struct kvd_geom *g, uint32_t n, const uint16_t *codes,
			   uint64_t seed, struct kvd_seg **out)
{
	struct kvd_rng r = kvd_rng_make(seed);
	uint16_t *k = xmalloc((size_t)g->kv_heads * n * g->d * 2);
	uint16_t *v = xmalloc((size_t)g->kv_heads * n * g->d * 2);

	fill_bf16(k, (size_t)g->kv_heads * n * g->d, &r, 0, 1);
	fill_bf16(v, (size_t)g->kv_heads * n * g->d, &r, 0.5, 1);
	assert_int_equal(kvd_seg_build(g, n, k, v, codes, NULL, out), 0);
	free(k);
	free(v);
}

static void seg_random(const struct kvd_geom *g, uint32_t n, uint64_t seed, struct kvd_seg **out)
{
	struct kvd_rng r = kvd_rng_make(seed ^ 0xc0de);
	size_t nc = (size_t)g->kv_heads * g->L * n;
	uint16_t *codes = xmalloc(nc * 2);

	for (size_t i = 0; i < nc; i++)
		codes[i] = (uint16_t)kvd_rng_bits(&r);
	seg_from_codes(g, n, codes, seed, out);
	free(codes);
}

/* The header of a SEG extent, written into the segment's own header page
 * and sealed over its payload: exactly what the spill engine writes. */
static struct kvd_sfmt_hdr *seg_extent(struct kvd_seg *s, uint32_t index, uint64_t tok)
{
	struct kvd_sfmt_hdr *h = s->io;
	const struct kvd_geom g = { .q_heads = s->kv_heads, .kv_heads = s->kv_heads, .d = s->d,
				    .K = s->K, .L = s->L, .c = 1, .kv_dtype = s->kv_dtype };

	hdr_base(h, KVD_SFMT_SEG, &g);
	h->flags = s->kv_dtype == KVD_KV_INT8 ? KVD_SFMT_SF_INT8 : 0;
	h->index = index;
	h->layer = 1;
	h->n = s->n;
	h->tok_begin = tok;
	h->tok_end = tok + s->n;
	h->payload_bytes = kvd_seg_bytes(&g, s->n);
	kvd_sfmt_seal(h, s->mem);
	return h;
}

static void kinds_make(struct kinds *x)
{
	const struct kvd_geom g = { .q_heads = 4, .kv_heads = 2, .d = 16, .K = 4, .L = 3, .c = 1 };

	prof_make(&x->x, 16, 4, 3, 4);
	x->x.p.g = g;
	x->pl[0] = profile_payload(&x->x.p, &x->h[0]);
	kvd_sfmt_seal(&x->h[0], x->pl[0]);

	hdr_base(&x->h[1], KVD_SFMT_LAYER, &g);
	x->h[1].index = 1;
	x->h[1].n = 3;
	x->h[1].tok_end = 3;
	x->h[1].flags = KVD_SFMT_LF_MEAN;
	x->h[1].payload_bytes = kvd_sfmt_layer_bytes(&g, 3, 1);
	x->pl[1] = calloc(1, x->h[1].payload_bytes);
	memset(x->pl[1], 0x3c, x->h[1].payload_bytes);
	kvd_sfmt_seal(&x->h[1], x->pl[1]);

	seg_random(&g, 100, 9, &x->seg);
	x->h[2] = *seg_extent(x->seg, 2, 0);
	x->pl[2] = x->seg->mem;

	hdr_base(&x->h[3], KVD_SFMT_END, &g);
	x->h[3].index = x->h[3].n = 3;
	x->pl[3] = NULL;
	kvd_sfmt_seal(&x->h[3], NULL);
	for (int i = 0; i < 4; i++)
		assert_int_equal(kvd_sfmt_check_hdr(&x->h[i], sizeof x->h[i], NULL, NULL, 0), 0);
}

static void kinds_free(struct kinds *x)
{
	free(x->pl[0]);
	free(x->pl[1]);
	kvd_seg_free(x->seg);
	prof_free(&x->x);
}

static void test_header_bit_flips(void **state)
{
	struct kinds x;

	kinds_make(&x);
	for (int i = 0; i < 4; i++) {
		uint8_t page[PAGE];

		memset(page, 0, sizeof page);
		memcpy(page, &x.h[i], sizeof x.h[i]);
		for (size_t bit = 0; bit < 8 * sizeof x.h[i]; bit++) {
			char msg[256] = "";

			page[bit / 8] ^= (uint8_t)(1u << (bit % 8));
			if (kvd_sfmt_check_hdr(page, sizeof page, NULL, msg, sizeof msg) != -KVD_EFORMAT)
				fail_msg("kind %d: flip of bit %zu accepted", i + 1, bit);
			assert_true(msg[0] != 0);
			page[bit / 8] ^= (uint8_t)(1u << (bit % 8));
		}
		/* the rest of the page is not part of the header */
		page[PAGE - 1] = 0xff;
		assert_int_equal(kvd_sfmt_check_hdr(page, sizeof page, NULL, NULL, 0), 0);
	}
	kinds_free(&x);
}

static void test_payload_byte_flips(void **state)
{
	struct kinds x;

	kinds_make(&x);
	for (int i = 0; i < 3; i++) {
		uint64_t n = x.h[i].payload_bytes;
		uint8_t *pl = aligned_alloc(64, (n + 63) & ~(uint64_t)63);
		const uint64_t at[] = { 0, 1, n / 2, n - 1 };

		memcpy(pl, x.pl[i], n);
		for (size_t j = 0; j < sizeof at / sizeof at[0]; j++) {
			for (int b = 0; b < 8; b += 7) {
				char msg[256] = "";

				pl[at[j]] ^= (uint8_t)(1u << b);
				assert_int_equal(kvd_sfmt_check_payload(&x.h[i], pl, msg, sizeof msg),
						 -KVD_EFORMAT);
				assert_non_null(strstr(msg, "checksum"));
				pl[at[j]] ^= (uint8_t)(1u << b);
			}
		}
		assert_int_equal(kvd_sfmt_check_payload(&x.h[i], pl, NULL, 0), 0);
		free(pl);
	}
	kinds_free(&x);
}

/* Headers that are well sealed but say something impossible. */
static void test_header_semantics(void **state)
{
	struct kinds x;

	kinds_make(&x);
	for (int c = 0;; c++) {
		struct kvd_sfmt_hdr h;
		int k = 2;              /* SEG unless the case says otherwise */

		switch (c) {
		case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7: case 8: case 9:
		case 10: case 11: case 12: case 13: case 14: case 15:
			break;
		case 16: case 17: case 18: case 19:
			k = 1;
			break;
		case 20: case 21: case 22: case 23: case 24:
			k = 3;
			break;
		case 25: case 26: case 27:
			k = 0;
			break;
		default:
			goto done;
		}
		h = x.h[k];
		switch (c) {
		case 0: h.kind = 0; break;
		case 1: h.kind = 5; break;
		case 2: h.d = 24; break;
		case 3: h.kv_heads = 0; break;
		case 4: h.K = 17; break;
		case 5: h.L = 0; break;
		case 6: h.n = 0; h.tok_end = h.tok_begin; break;
		case 7: h.n = KVD_SEG_MAX + 1; h.tok_end = h.tok_begin + h.n; break;
		case 8: h.n = 99; break;                        /* tokens disagree */
		case 9: h.tok_begin = 5; h.tok_end = 4; h.n = UINT32_MAX; break;
		case 10: h.payload_bytes += 64; break;
		case 11: h.payload_bytes -= 1; break;
		case 12: h.flags = KVD_SFMT_LF_MEAN; break;
		case 13: h.layer = KVD_PROFILE_LAYERS_MAX; break;
		case 14: memset(h.tenant, 'a', sizeof h.tenant); break;
		case 15: h.tenant[0] = 0x7f; break;
		case 16: h.flags = 0x4; break;                  /* LAYER */
		case 17: h.flags = 0; break;                    /* mean's bytes, no mean */
		case 18: h.n = KVD_SEG_MAX + 1; h.tok_end = h.n; break;
		case 19: h.tok_begin = 1; break;
		case 20: h.payload_bytes = 64; break;           /* END */
		case 21: h.n = 2; break;
		case 22: h.flags = 1; break;
		case 23: h.d = 7; break;
		case 24: h.kind = KVD_SFMT_PROFILE; break;      /* PROFILE with END's fields */
		case 25: h.index = 1; break;                    /* PROFILE */
		case 26: h.payload_bytes = 256 + 16 * 4 * 3 * 4; break;
		case 27: h.payload_bytes += 1024; break;
		}
		/* sizes first, then extent_bytes made consistent so that only
		 * the case's field is wrong */
		h.extent_bytes = kvd_sfmt_extent_bytes(h.payload_bytes);
		fix_hdr_crc(&h);
		char what[32];

		snprintf(what, sizeof what, "case %d", c);
		expect_hdr_fail(&h, what);
	}
done:;
	/* magic, version and extent_bytes with hdr_crc matching */
	struct kvd_sfmt_hdr h = x.h[2];

	h.magic[0] = 'k';
	fix_hdr_crc(&h);
	expect_hdr_fail(&h, "magic");
	h = x.h[2];
	h.version = KVD_SFMT_VERSION + 1;
	fix_hdr_crc(&h);
	expect_hdr_fail(&h, "version");
	h = x.h[2];
	h.extent_bytes += PAGE;
	fix_hdr_crc(&h);
	expect_hdr_fail(&h, "extent_bytes");
	h = x.h[2];
	h.payload_bytes = UINT64_MAX;
	h.extent_bytes = 0;
	fix_hdr_crc(&h);
	expect_hdr_fail(&h, "huge payload");
	kinds_free(&x);
}

/* ---- segments ----------------------------------------------------------- */

static void test_io_buffers(void **state)
{
	const struct kvd_geom small = { .q_heads = 1, .kv_heads = 1, .d = 16, .K = 3, .L = 2, .c = 1 };
	const struct kvd_geom big = { .q_heads = 8, .kv_heads = 8, .d = 128, .K = 10, .L = 20, .c = 2,
				      .moments = 1 };
	const struct kvd_geom *gs[] = { &small, &big };

	for (int i = 0; i < 2; i++) {
		uint32_t n = i ? 4000 : 10;
		size_t bytes = 0, want = kvd_seg_io_bytes(gs[i], n);
		uint8_t *io = kvd_seg_io_alloc(gs[i], n, &bytes);

		assert_non_null(io);
		assert_int_equal(bytes, want);
		assert_int_equal(bytes % PAGE, 0);
		/* the header page, the payload's pages, the moments' pages */
		size_t mom = gs[i]->moments ? gs[i]->kv_heads * (3 * gs[i]->d * sizeof(float) +
							      gs[i]->d * gs[i]->d) : 0;

		assert_int_equal(bytes, PAGE + (kvd_seg_bytes(gs[i], n) + PAGE - 1) / PAGE * PAGE +
					       (mom + PAGE - 1) / PAGE * PAGE);
		assert_int_equal((uintptr_t)io % PAGE, 0);
		for (size_t j = 0; j < bytes; j += 97)
			assert_int_equal(io[j], 0);
		assert_int_equal(io[bytes - 1], 0);
		/* adoption wants the buffer exactly as allocated */
		struct kvd_seg *s = NULL;

		assert_int_equal(kvd_seg_adopt(gs[i], n, io, bytes - PAGE, NULL, &s), -EINVAL);
		assert_int_equal(kvd_seg_adopt(gs[i], n, io + 64, bytes, NULL, &s), -EINVAL);
		assert_int_equal(kvd_seg_adopt(gs[i], 0, io, bytes, NULL, &s), -KVD_EGEOM);
		assert_null(s);
		kvd_seg_io_free(io, bytes);
	}
	struct kvd_geom bad = small;

	assert_int_equal(kvd_seg_io_bytes(&small, 0), 0);
	assert_int_equal(kvd_seg_io_bytes(&small, KVD_SEG_MAX + 1), 0);
	bad.d = 8;
	assert_int_equal(kvd_seg_io_bytes(&bad, 10), 0);
	assert_null(kvd_seg_io_alloc(&bad, 10, NULL));
	assert_int_equal(kvd_seg_check(&bad, 10, NULL), -KVD_EGEOM);

	/* q_heads and c are not a segment's business */
	struct kvd_seg *s;

	seg_random(&small, 10, 1, &s);
	assert_int_equal(s->bytes, kvd_seg_io_bytes(&small, 10));
	assert_ptr_equal(s->mem, (uint8_t *)s->io + PAGE);
	bad = small;
	bad.q_heads = 0;
	bad.c = 7;
	assert_int_equal(kvd_seg_check(&bad, 10, s->mem), 0);
	assert_int_equal(kvd_seg_check(&small, 10, (uint8_t *)s->mem + 8), -EINVAL);
	kvd_seg_free(s);
}

/* Spills every segment of a layer (header page sealed in place), "reads"
 * each extent into a fresh io buffer, checks and adopts it: the restored
 * layer answers exactly like the original, on every kernel. */
static void seg_restore_attention(uint32_t dt)
{
	const struct kvd_geom g = { .q_heads = 8, .kv_heads = 2, .d = 128, .K = 9, .L = 60, .c = 2,
				    .kv_dtype = dt, .moments = 1 };
	const uint32_t n = 7000;
	struct kvd_pool *pool;
	struct kvd_synth w;
	struct kvd_prep p;
	float *W = xmalloc((size_t)g.d * g.K * g.L * sizeof(float));
	uint16_t *qc = xmalloc((size_t)g.q_heads * g.L * 2);

	assert_int_equal(kvd_pool_create(2, 0, &pool), 0);
	assert_int_equal(kvd_synth_make(&w, KVD_WL_MIXED, n, g.q_heads, g.kv_heads, g.d, 21), 0);
	kvd_lsh_make_w(0x5eed, (int)g.d, (int)g.K, (int)g.L, W);
	kvd_prep_query_codes(&g, W, w.q, qc);
	assert_int_equal(kvd_prep_layer(&p, &g, W, w.k, w.v, n, 4, n - 64, 2048, pool), 0);
	assert_true(p.nseg >= 3);       /* the last one partly filled */

	struct kvd_seg **back = xmalloc(p.nseg * sizeof *back);

	for (uint32_t i = 0; i < p.nseg; i++) {
		struct kvd_seg *s = p.seg[i];
		struct kvd_sfmt_hdr *h = seg_extent(s, i + 1, 4 + (uint64_t)i * 2048), got;
		size_t bytes;
		uint8_t *io = kvd_seg_io_alloc(&g, s->n, &bytes);
		char msg[256];

		/* the extent: the io buffer but the moments past its payload */
		assert_int_equal(h->extent_bytes, kvd_sfmt_extent_bytes(kvd_seg_bytes(&g, s->n)));
		assert_true(h->extent_bytes < s->bytes);
		assert_int_equal(bytes, s->bytes);
		assert_int_equal(kvd_seg_check(&g, s->n, s->mem), 0);
		memcpy(io, s->io, h->extent_bytes);     /* write, then read back */
		if (kvd_sfmt_check_hdr(io, PAGE, &got, msg, sizeof msg) ||
		    kvd_sfmt_check_payload(&got, io + PAGE, msg, sizeof msg))
			fail_msg("segment %u: %s", i, msg);
		assert_int_equal(kvd_seg_adopt(&g, got.n, io, bytes, NULL, &back[i]), 0);
		assert_int_equal(back[i]->n, s->n);
		assert_int_equal(back[i]->bytes, s->bytes);
		assert_int_equal(back[i]->tables_ms, 0);
		for (uint32_t hh = 0; hh < g.kv_heads; hh++) {
			/* the same offsets inside the buffer as the original */
			const struct kvd_seg_head *a = &s->h[hh], *b = &back[i]->h[hh];
			ptrdiff_t ds = (uint8_t *)back[i]->io - (uint8_t *)s->io;

			if (dt == KVD_KV_INT8) {
				assert_true((uint8_t *)b->k8 - (uint8_t *)a->k8 == ds);
				assert_true((uint8_t *)b->v8 - (uint8_t *)a->v8 == ds);
				assert_true((uint8_t *)b->kscale - (uint8_t *)a->kscale == ds);
				assert_true((uint8_t *)b->r8 - (uint8_t *)a->r8 == ds);
			} else {
				assert_true((uint8_t *)b->k - (uint8_t *)a->k == ds);
				assert_true((uint8_t *)b->v - (uint8_t *)a->v == ds);
				assert_true((uint8_t *)b->kinv - (uint8_t *)a->kinv == ds);
			}
			assert_true((uint8_t *)b->tab.off - (uint8_t *)a->tab.off == ds);
			assert_true((uint8_t *)b->tab.ids - (uint8_t *)a->tab.ids == ds);
			assert_true((uint8_t *)b->tab.full - (uint8_t *)a->tab.full == ds);
			assert_int_equal(b->tab.n, a->tab.n);
			assert_int_equal(b->tab.K, a->tab.K);
			assert_int_equal(b->tab.L, a->tab.L);
		}
	}

	struct kvd_layer_view lv = kvd_prep_view(&p), lb = lv;
	struct kvd_attn_scratch scr[2];
	struct kvd_logp_tab *tab = xmalloc(sizeof *tab);
	float o1[8 * 128], l1[8], o2[8 * 128], l2[8];

	lb.seg = (const struct kvd_seg *const *)back;
	kvd_logp_tab_init(tab, (int)g.K, (int)g.L, (int)g.c);
	for (int i = 0; i < 2; i++)
		assert_int_equal(kvd_attn_scratch_init(&scr[i], KVD_SEG_MAX), 0);
	for (int i = 0; i < nkv; i++) {
		struct kvd_attn_stats s1, s2;

		assert_int_equal(kvd_attn_layer(pool, scr, kv[i], &g, tab, &lv, w.q, qc, o1, l1, &s1), 0);
		assert_int_equal(kvd_attn_layer(pool, scr, kv[i], &g, tab, &lb, w.q, qc, o2, l2, &s2), 0);
		assert_true(s1.cand > 0);
		assert_memory_equal(&s1, &s2, sizeof s1);
		assert_memory_equal(o1, o2, sizeof o1);
		assert_memory_equal(l1, l2, sizeof l1);
	}
	for (int i = 0; i < 2; i++)
		kvd_attn_scratch_free(&scr[i]);
	for (uint32_t i = 0; i < p.nseg; i++)
		kvd_seg_free(back[i]);
	free(back);
	free(tab);
	kvd_prep_free(&p);
	kvd_synth_free(&w);
	free(W);
	free(qc);
	kvd_pool_destroy(pool);
}

static void test_seg_restore_attention(void **state)
{
	seg_restore_attention(KVD_KV_BF16);
	seg_restore_attention(KVD_KV_INT8);
}

/* ---- versions ----------------------------------------------------------- */

/* Version 3 added LOCAL extents: the client rows of a published prefix, K
 * then V of n rows; refused in an older header, with a size other than n
 * rows', with no rows, with a token range, with flags. */
static void test_local_extent(void **state)
{
	const struct kvd_geom g = { .q_heads = 4, .kv_heads = 2, .d = 16, .K = 4, .L = 3, .c = 1 };
	struct kvd_profile geo = { .g = g };
	const struct kvd_sfmt_file f = { .p = &geo, .seq = 1, .gen = 1, .profile_fp = 2,
					 .tenant = "t" };
	const struct kvd_sfmt_ext e = { .kind = KVD_SFMT_LOCAL, .index = 4, .layer = 0, .n = 70 };
	struct kvd_sfmt_hdr h, bad;
	uint64_t bytes = kvd_sfmt_local_bytes(&g, 70);
	uint8_t *pl = calloc(1, bytes);

	assert_non_null(pl);
	/* K is 2 heads x 70 rows x 16 x 2 bytes = 4480, padded to 4480 (64 | 4480) */
	assert_int_equal(bytes, 2 * 4480);
	for (uint64_t i = 0; i < bytes; i++)
		pl[i] = (uint8_t)(i * 7);
	kvd_sfmt_hdr_fill(&h, &f, &e);
	assert_int_equal(h.payload_bytes, bytes);
	assert_int_equal(h.n, 70);
	seal_and_check(&h, pl);
	seed_write("local", &h, pl);
	bad = h;
	bad.version = 2;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "LOCAL in a version 2 file");
	bad = h;
	bad.n = 71;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "LOCAL rows disagree with payload_bytes");
	bad = h;
	bad.n = 0;
	bad.payload_bytes = 0;
	bad.extent_bytes = PAGE;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "LOCAL of no rows");
	bad = h;
	bad.tok_end = 70;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "LOCAL with a token range");
	bad = h;
	bad.flags = 1;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "LOCAL with flags");
	pl[5] ^= 1;
	{
		char msg[256];

		assert_int_equal(kvd_sfmt_check_payload(&h, pl, msg, sizeof msg), -KVD_EFORMAT);
	}
	free(pl);

	/* PUB: the key and the tokens of a published prefix, in the header */
	const struct kvd_sfmt_ext ep = { .kind = KVD_SFMT_PUB, .index = 5, .n = 768 };
	uint8_t key[16], back[16];
	struct kvd_sfmt_hdr got;
	char msg[256];

	for (int i = 0; i < 16; i++)
		key[i] = (uint8_t)(0xa0 + i);
	kvd_sfmt_hdr_fill(&h, &f, &ep);
	kvd_sfmt_pub_key_put(&h, key);
	assert_int_equal(h.payload_bytes, 0);
	seal_and_check(&h, NULL);
	seed_write("pub", &h, NULL);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &got, msg, sizeof msg), 0);
	kvd_sfmt_pub_key(&got, back);
	assert_memory_equal(back, key, 16);
	assert_int_equal(got.n, 768);
	bad = h;
	bad.tok_begin ^= 1;             /* the key is under hdr_crc */
	expect_hdr_fail(&bad, "PUB key changed");
	bad = h;
	bad.n = 0;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "PUB of no tokens");
	bad = h;
	bad.version = 2;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "PUB in a version 2 file");
	bad = h;
	bad.payload_bytes = 64;
	bad.extent_bytes = 2 * PAGE;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "PUB with a payload");
}

/* Version 5 added HEAVY extents: a sparse layer's estimator state, exactly
 * kvd_heavy_words() of the profile's q heads; refused in an older header,
 * with a size other than its q heads', with q heads that make no group of
 * kv_heads, with a token range or flags, and by crc.  The words themselves
 * are not judged: any are safe to attend with (engine/attn.h). */
static void test_heavy_extent(void **state)
{
	const struct kvd_geom g = { .q_heads = 8, .kv_heads = 2, .d = 16, .K = 4, .L = 3, .c = 1 };
	struct kvd_profile geo = { .g = g };
	const struct kvd_sfmt_file f = { .p = &geo, .seq = 1, .gen = 1, .profile_fp = 2,
					 .tenant = "t" };
	const struct kvd_sfmt_ext e = { .kind = KVD_SFMT_HEAVY, .index = 2, .layer = 3 };
	struct kvd_sfmt_hdr h, bad, got;
	uint64_t bytes = kvd_sfmt_heavy_bytes(8);
	uint32_t *pl = calloc(1, bytes);
	char msg[256];

	assert_non_null(pl);
	assert_int_equal(bytes, kvd_heavy_words(&g) * sizeof(uint32_t));
	assert_int_equal(bytes, 8 * (1 + KVD_HEAVY_MAX) * 4);
	for (uint64_t i = 0; i < bytes / 4; i++)
		pl[i] = (uint32_t)(i * 2654435761u);     /* ids that name nothing: fine */
	kvd_sfmt_hdr_fill(&h, &f, &e);
	assert_int_equal(h.payload_bytes, bytes);
	assert_int_equal(h.n, 8);
	assert_int_equal(h.layer, 3);
	assert_int_equal(kvd_sfmt_ext_payload(&f, &e), bytes);
	seal_and_check(&h, pl);
	assert_int_equal(h.version, KVD_SFMT_VERSION);
	assert_int_equal(h.extent_bytes, 2 * PAGE);
	seed_write("heavy", &h, pl);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &got, msg, sizeof msg), 0);
	assert_int_equal(kvd_sfmt_check_payload(&got, pl, msg, sizeof msg), 0);

	bad = h;
	bad.version = 4;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY in a version 4 file");
	bad = h;
	bad.payload_bytes = bytes + 4;  /* extent_bytes still right */
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY a word too long");
	bad = h;
	bad.payload_bytes = bytes - 4;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY a word short");
	bad = h;
	bad.n = 4;                      /* a valid group, another size */
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY q heads disagree with payload_bytes");
	bad = h;
	bad.n = 7;
	bad.payload_bytes = kvd_sfmt_heavy_bytes(7);
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY q heads not a multiple of kv_heads");
	bad = h;
	bad.n = 0;
	bad.payload_bytes = 0;
	bad.extent_bytes = PAGE;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY of no q heads");
	bad = h;
	bad.n = 2 * (KVD_GMAX + 1);
	bad.payload_bytes = kvd_sfmt_heavy_bytes(bad.n);
	bad.extent_bytes = kvd_sfmt_extent_bytes(bad.payload_bytes);
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY of a group too large");
	bad = h;
	bad.layer = KVD_PROFILE_LAYERS_MAX;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY layer out of range");
	bad = h;
	bad.tok_end = 1;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY with a token range");
	bad = h;
	bad.flags = 1;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "HEAVY with flags");
	((uint8_t *)pl)[bytes - 1] ^= 0x80;
	assert_int_equal(kvd_sfmt_check_payload(&got, pl, msg, sizeof msg), -KVD_EFORMAT);
	assert_non_null(strstr(msg, "HEAVY"));
	free(pl);
}

/* Version 2 added int8 segments.  A version 1 file (bf16 only: no SEG flags,
 * a zero where the profile record now keeps kv_dtype) still reads; the int8
 * flag is refused in a version 1 header and unknown flags in any; a header
 * whose flag disagrees with its payload's size is refused by size. */
static void test_versions(void **state)
{
	const struct kvd_geom g8 = { .q_heads = 4, .kv_heads = 2, .d = 16, .K = 4, .L = 3, .c = 1,
				     .kv_dtype = KVD_KV_INT8 };
	struct kvd_geom g16 = g8;
	struct kvd_seg *s8, *s16;
	struct kvd_sfmt_hdr h, got;
	char msg[256];
	struct kvd_profile geo = { .g = g8 };      /* only its geometry counts */
	const struct kvd_sfmt_file f = { .p = &geo, .seq = 1, .gen = 1, .profile_fp = 2,
					 .tenant = "t" };
	const struct kvd_sfmt_ext e = { .kind = KVD_SFMT_SEG, .index = 1, .layer = 1, .n = 100 };

	g16.kv_dtype = KVD_KV_BF16;
	seg_random(&g8, 100, 3, &s8);
	seg_random(&g16, 100, 3, &s16);
	assert_true(kvd_seg_bytes(&g8, 100) < kvd_seg_bytes(&g16, 100));

	/* what kvd writes: the current version, the flag from the geometry */
	kvd_sfmt_hdr_fill(&h, &f, &e);
	assert_int_equal(h.payload_bytes, kvd_seg_bytes(&g8, 100));
	assert_int_equal(h.tok_end, 100);
	assert_int_equal(h.flags, KVD_SFMT_SF_INT8);
	seal_and_check(&h, s8->mem);
	assert_int_equal(h.version, KVD_SFMT_VERSION);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &got, msg, sizeof msg), 0);
	assert_int_equal(kvd_sfmt_seg_dtype(&got), KVD_KV_INT8);

	struct kvd_sfmt_hdr bad = h;

	bad.flags = KVD_SFMT_SF_INT8 | 0x4;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "unknown SEG flag");
	bad = h;
	bad.version = 1;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "int8 SEG in a version 1 file");
	bad = h;
	bad.flags = 0;                  /* a bf16 header over an int8 payload's size */
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "flag disagrees with payload_bytes");
	bad = h;
	bad.version = KVD_SFMT_VERSION + 1;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "a later version");
	bad.version = 0;
	fix_hdr_crc(&bad);
	expect_hdr_fail(&bad, "version 0");

	/* a version 1 bf16 SEG reads, as bf16 */
	geo.g = g16;
	kvd_sfmt_hdr_fill(&h, &f, &e);
	assert_int_equal(h.payload_bytes, kvd_seg_bytes(&g16, 100));
	assert_int_equal(h.flags, 0);
	kvd_sfmt_seal(&h, s16->mem);
	h.version = 1;
	fix_hdr_crc(&h);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &got, msg, sizeof msg), 0);
	assert_int_equal(kvd_sfmt_seg_dtype(&got), KVD_KV_BF16);
	assert_int_equal(kvd_sfmt_check_payload(&got, s16->mem, msg, sizeof msg), 0);

	/* A version 2 or 3 int8 SEG, its per-row floats as three arrays per
	 * head (vscale, kfac, kinv, each 64-byte aligned, where kvd_row8 [n]
	 * now lies), reads into the current layout byte for byte. */
	for (uint32_t ver = 2; ver <= 3; ver++) {
		size_t pb = kvd_seg_bytes(&g8, 100), vec = (100 * 4 + 63) & ~(size_t)63;
		uint8_t *old = aligned_alloc(64, (pb + 63) & ~(size_t)63);

		assert_non_null(old);
		memcpy(old, s8->mem, pb);
		for (uint32_t hh = 0; hh < g8.kv_heads; hh++) {
			const struct kvd_row8 *r8 = s8->h[hh].r8;
			float *a = (float *)(old + ((const uint8_t *)r8 - (const uint8_t *)s8->mem));

			memset(a, 0, 3 * vec);
			for (uint32_t i = 0; i < 100; i++) {
				a[i] = r8[i].vscale;
				a[vec / 4 + i] = r8[i].kfac;
				a[2 * vec / 4 + i] = r8[i].kinv;
			}
		}
		geo.g = g8;
		kvd_sfmt_hdr_fill(&h, &f, &e);
		kvd_sfmt_seal(&h, old);
		h.version = ver;
		fix_hdr_crc(&h);
		assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &got, msg, sizeof msg), 0);
		if (kvd_sfmt_check_payload(&got, old, msg, sizeof msg))
			fail_msg("version %u int8 SEG: %s", ver, msg);
		assert_memory_equal(old, s8->mem, pb);
		free(old);
	}

	/* the profile record: kv_dtype round-trips and is part of the profile */
	struct prof x;
	struct kvd_profile p16;
	uint8_t *pl;

	prof_make(&x, 64, 8, 10, 5);
	x.p.g.kv_dtype = KVD_KV_INT8;
	uint64_t fp8 = kvd_sfmt_profile_fp(&x.p);

	pl = profile_payload(&x.p, &h);
	seal_and_check(&h, pl);
	if (kvd_sfmt_profile_get(pl, h.payload_bytes, &p16, msg, sizeof msg))
		fail_msg("%s", msg);
	assert_int_equal(p16.g.kv_dtype, KVD_KV_INT8);
	free(p16.dense);
	free(p16.W);
	free(pl);
	x.p.g.kv_dtype = KVD_KV_BF16;
	assert_true(kvd_sfmt_profile_fp(&x.p) != fp8);
	/* a version 1 PROFILE extent (kv_dtype 0 there) reads as bf16 */
	pl = profile_payload(&x.p, &h);
	kvd_sfmt_seal(&h, pl);
	h.version = 1;
	fix_hdr_crc(&h);
	assert_int_equal(kvd_sfmt_check_hdr(&h, sizeof h, &got, msg, sizeof msg), 0);
	assert_int_equal(kvd_sfmt_check_payload(&got, pl, msg, sizeof msg), 0);
	if (kvd_sfmt_profile_get(pl, h.payload_bytes, &p16, msg, sizeof msg))
		fail_msg("%s", msg);
	assert_int_equal(p16.g.kv_dtype, KVD_KV_BF16);
	free(p16.dense);
	free(p16.W);
	free(pl);
	prof_free(&x);
	kvd_seg_free(s8);
	kvd_seg_free(s16);
}

/* ---- table corruptions -------------------------------------------------- */

enum corrupt {
	C_OFF0,         /* off[0] != 0 */
	C_OFF_LAST,     /* off[2^K] != n */
	C_OFF_UP,       /* an offset above the next one: that count wraps */
	C_OFF_DOWN,     /* an offset below the one before it: a count wraps */
	C_OFF_PAST,     /* a bucket reaching past n */
	C_ID_N,         /* an id == n */
	C_ID_MAX,       /* an id == 65535 */
	C_ID_ORDER,     /* two ids of a bucket swapped */
	C_ID_DUP,       /* an id twice in one bucket */
	C_FULL_RANGE,   /* full[t] >= 2^K */
	C_FULL_EMPTY,   /* full[t] on an empty bucket: would read n ids from its start */
	C_FULL_PART,    /* full[t] on a bucket that holds some but not all */
	C_KINV_NAN,
	C_KINV_NEG,
	C_KINV_INF,
	C_COUNT
};

static const char *const corrupt_name[] = {
	"off0", "off-last", "off-up", "off-down", "off-past", "id-n", "id-65535", "id-order", "id-dup",
	"full-range", "full-empty", "full-partial", "kinv-nan", "kinv-neg", "kinv-inf",
};

/* The first bucket of table t with at least `min` ids, and an empty one. */
static uint32_t bucket_with(const struct kvd_lsh_tables *t, uint32_t tab, uint32_t min)
{
	for (uint32_t b = 0; b < (1u << t->K); b++) {
		const uint16_t *ids;

		if (kvd_lsh_bucket(t, tab, b, &ids) >= min && (min || !kvd_lsh_bucket(t, tab, b, &ids)))
			return b;
	}
	return UINT32_MAX;
}

static int corrupt(struct kvd_seg *s, uint32_t head, uint32_t tab, enum corrupt c)
{
	struct kvd_lsh_tables *t = &s->h[head].tab;
	uint32_t nb = 1u << t->K, n = t->n;
	uint16_t *off = t->off + (size_t)tab * (nb + 1), *ids = t->ids + (size_t)tab * n;
	uint32_t b = bucket_with(t, tab, 2), e = bucket_with(t, tab, 0);

	switch (c) {
	case C_OFF0: off[0] = 1; break;
	case C_OFF_LAST: off[nb] = (uint16_t)(n - 1); break;
	case C_OFF_UP:
		if (b + 2 > nb)
			return 0;
		off[b + 1] = (uint16_t)(off[b + 2] + 1);
		break;
	case C_OFF_DOWN: off[b + 1] = (uint16_t)(off[b] - 1); break;
	case C_OFF_PAST: off[nb - 1] = (uint16_t)(n + 1); break;
	case C_ID_N: ids[off[b]] = (uint16_t)n; break;
	case C_ID_MAX: ids[n / 2] = 65535; break;
	case C_ID_ORDER: {
		uint16_t x = ids[off[b]];

		ids[off[b]] = ids[off[b] + 1];
		ids[off[b] + 1] = x;
		break;
	}
	case C_ID_DUP: ids[off[b] + 1] = ids[off[b]]; break;
	case C_FULL_RANGE: t->full[tab] = nb; break;
	case C_FULL_EMPTY:
		if (e == UINT32_MAX)
			return 0;
		t->full[tab] = e;
		break;
	case C_FULL_PART: t->full[tab] = b; break;
	case C_KINV_NAN: s->h[head].kinv[n - 1] = NAN; break;
	case C_KINV_NEG: s->h[head].kinv[0] = -1.0f; break;
	case C_KINV_INF: s->h[head].kinv[n / 3] = INFINITY; break;
	case C_COUNT: break;
	}
	return 1;
}

/* A copy of segment s in a fresh io buffer, adopted without a check so the
 * test can corrupt it through its pointers. */
static struct kvd_seg *seg_copy(const struct kvd_geom *g, const struct kvd_seg *s)
{
	size_t bytes;
	void *io = kvd_seg_io_alloc(g, s->n, &bytes);
	struct kvd_seg *c;

	assert_non_null(io);
	memcpy(io, s->io, bytes);
	assert_int_equal(kvd_seg_adopt(g, s->n, io, bytes, NULL, &c), 0);
	return c;
}

/* Corrupted, resealed (so the CRCs agree), and still refused. */
static void expect_seg_refused(const struct kvd_geom *g, struct kvd_seg *c, const char *what)
{
	struct kvd_sfmt_hdr *h = seg_extent(c, 1, 0), got;
	char msg[256] = "";
	int rc;

	assert_int_equal(kvd_sfmt_check_hdr(h, PAGE, &got, NULL, 0), 0);
	rc = kvd_seg_check(g, c->n, c->mem);
	if (rc != -KVD_EFORMAT)
		fail_msg("%s: kvd_seg_check returned %d", what, rc);
	assert_int_equal(kvd_sfmt_check_payload(&got, c->mem, msg, sizeof msg), -KVD_EFORMAT);
	assert_non_null(strstr(msg, "malformed"));
}

static void test_seg_corruptions(void **state)
{
	/* K = 8 for 300 ids: buckets of several ids, and empty ones */
	const struct kvd_geom g = { .q_heads = 2, .kv_heads = 2, .d = 16, .K = 8, .L = 3, .c = 1 };
	struct kvd_seg *s;
	int applied = 0;

	seg_random(&g, 300, 5, &s);
	assert_int_equal(kvd_seg_check(&g, s->n, s->mem), 0);
	for (int c = 0; c < C_COUNT; c++) {
		/* every table of the last head, and one of the first */
		for (uint32_t t = 0; t <= g.L; t++) {
			struct kvd_seg *x = seg_copy(&g, s);
			uint32_t head = t < g.L ? 1 : 0, tab = t < g.L ? t : 1;
			char what[64];

			snprintf(what, sizeof what, "%s head %u table %u", corrupt_name[c], head, tab);
			if (corrupt(x, head, tab, (enum corrupt)c)) {
				expect_seg_refused(&g, x, what);
				applied++;
			}
			kvd_seg_free(x);
		}
	}
	assert_int_equal(applied, C_COUNT * (g.L + 1));
	kvd_seg_free(s);
}

/* The `full` convention: n < 65536 with every id in one bucket (its count
 * reads n) and n == 65536 (its count reads 0: only full[] tells). */
static void test_seg_full_buckets(void **state)
{
	const struct kvd_geom g = { .q_heads = 1, .kv_heads = 1, .d = 16, .K = 3, .L = 3, .c = 1 };
	const uint32_t ns[] = { 200, KVD_SEG_MAX };

	for (int i = 0; i < 2; i++) {
		uint32_t n = ns[i];
		uint16_t *codes = xmalloc((size_t)g.L * n * 2);
		struct kvd_seg *s, *x;
		struct kvd_lsh_scratch ls;
		uint16_t *out = xmalloc((size_t)n * 2), q[3] = { 5, 5, 2 };

		/* table 0 and 1: all in bucket 5; table 2: spread (for n = 65536
		 * its last offset wraps to 0) */
		for (uint32_t j = 0; j < n; j++) {
			codes[j] = 5;
			codes[n + j] = 5 | 0xfff8;      /* junk above K */
			codes[2 * n + j] = (uint16_t)(j % 7);
		}
		seg_from_codes(&g, n, codes, 77, &s);
		assert_int_equal(s->h[0].tab.full[0], 5);
		assert_int_equal(s->h[0].tab.full[2], UINT32_MAX);
		assert_int_equal(kvd_seg_check(&g, n, s->mem), 0);
		if (n == KVD_SEG_MAX)
			assert_int_equal(s->h[0].tab.off[2 * 9 + 8], 0);

		/* restored, it retrieves everything the original does */
		x = seg_copy(&g, s);
		assert_int_equal(kvd_lsh_scratch_init(&ls, KVD_SEG_MAX), 0);
		assert_int_equal(kvd_lsh_candidates(&x->h[0].tab, q, 2, &ls, out), n);
		kvd_lsh_scratch_free(&ls);
		kvd_seg_free(x);

		/* full cleared: for n < 65536 not what the build makes; for
		 * 65536 the bucket would read empty and the counts not add up */
		x = seg_copy(&g, s);
		x->h[0].tab.full[1] = UINT32_MAX;
		expect_seg_refused(&g, x, "full cleared");
		kvd_seg_free(x);
		/* full set on a table without a full bucket */
		x = seg_copy(&g, s);
		x->h[0].tab.full[2] = 1;
		expect_seg_refused(&g, x, "full on a partial bucket");
		kvd_seg_free(x);
		/* full out of range */
		x = seg_copy(&g, s);
		x->h[0].tab.full[0] = 8;
		expect_seg_refused(&g, x, "full out of range");
		kvd_seg_free(x);
		/* a second full bucket: its own count would read n on top */
		x = seg_copy(&g, s);
		x->h[0].tab.off[2 * 9 + 8] ^= 1;
		expect_seg_refused(&g, x, "last offset");
		kvd_seg_free(x);
		if (n < KVD_SEG_MAX) {
			/* full moved to an empty bucket: kvd_lsh_bucket would read n
			 * ids from that bucket's start, past the table */
			x = seg_copy(&g, s);
			x->h[0].tab.full[0] = 7;
			expect_seg_refused(&g, x, "full on an empty bucket");
			kvd_seg_free(x);
		}
		kvd_seg_free(s);
		free(codes);
		free(out);
	}
}

/* The smallest extents of every kind round-trip too (and are the fuzz
 * seeds: see the top of the file). */
static void test_tiny_extents(void **state)
{
	const struct kvd_geom g = { .q_heads = 1, .kv_heads = 1, .d = 16, .K = 3, .L = 2, .c = 1 };
	struct kvd_sfmt_hdr h;
	struct prof x;
	struct kvd_lsh_scratch ls;
	uint16_t out[24], q[2] = { 1, 6 };
	uint8_t *pl;

	prof_make(&x, 16, 3, 2, 2);
	x.p.g = g;
	pl = profile_payload(&x.p, &h);
	seal_and_check(&h, pl);
	seed_write("profile", &h, pl);
	free(pl);
	prof_free(&x);

	for (int mean = 0; mean <= 1; mean++) {
		uint32_t n = mean ? 3 : 0;

		hdr_base(&h, KVD_SFMT_LAYER, &g);
		h.index = 1;
		h.n = n;
		h.tok_begin = 24;
		h.tok_end = 24 + n;
		h.flags = mean ? KVD_SFMT_LF_MEAN | KVD_SFMT_LF_SEALED : 0;
		h.payload_bytes = kvd_sfmt_layer_bytes(&g, n, mean);
		pl = calloc(1, h.payload_bytes + 1);
		for (uint64_t i = 0; i < h.payload_bytes; i++)
			pl[i] = (uint8_t)(i * 7);
		seal_and_check(&h, pl);
		seed_write(mean ? "layer_mean" : "layer_empty", &h, pl);
		free(pl);
	}

	assert_int_equal(kvd_lsh_scratch_init(&ls, 24), 0);
	for (int full = 0; full <= 1; full++) {
		uint16_t codes[2 * 24];
		struct kvd_seg *s, *c;

		for (uint32_t i = 0; i < 2 * 24; i++)
			codes[i] = full ? 6 : (uint16_t)(i * 5 % 8);
		seg_from_codes(&g, 24, codes, 4, &s);
		seal_and_check(seg_extent(s, 2, 0), s->mem);
		seed_write(full ? "seg_full" : "seg", s->io, s->mem);
		if (!full) {
			struct kvd_geom g8 = g;
			struct kvd_seg *s8;

			g8.kv_dtype = KVD_KV_INT8;
			seg_from_codes(&g8, 24, codes, 4, &s8);
			seal_and_check(seg_extent(s8, 2, 0), s8->mem);
			seed_write("seg_int8", s8->io, s8->mem);
			kvd_seg_free(s8);
		}
		c = seg_copy(&g, s);
		assert_int_equal(kvd_seg_check(&g, 24, c->mem), 0);
		assert_int_equal(kvd_lsh_candidates(&c->h[0].tab, q, 1, &ls, out),
				 kvd_lsh_candidates(&s->h[0].tab, q, 1, &ls, out));
		kvd_seg_free(c);
		kvd_seg_free(s);
	}
	kvd_lsh_scratch_free(&ls);

	hdr_base(&h, KVD_SFMT_END, &g);
	h.index = h.n = 3;
	seal_and_check(&h, NULL);
	seed_write("end", &h, NULL);
}

/* One linear pass: fast enough to run on every segment restored. */
static void test_seg_check_speed(void **state)
{
	const struct kvd_geom g = { .q_heads = 8, .kv_heads = 8, .d = 128, .K = 10, .L = 150, .c = 2 };
	const uint32_t n = 8192;
	struct timespec t0, t1;
	struct kvd_seg *s;

	seg_random(&g, n, 3, &s);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	assert_int_equal(kvd_seg_check(&g, n, s->mem), 0);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
	double ids = (double)g.kv_heads * g.L * n;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	uint32_t c = kvd_sfmt_crc32c(s->mem, kvd_seg_bytes(&g, n));
	clock_gettime(CLOCK_MONOTONIC, &t1);
	double crc_ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;

	print_message("  kvd_seg_check: %.1f ms for %.1f M ids (%.2f ns/id); CRC32C of the "
		      "%.0f MB payload %.1f ms (crc %08x)\n", ms, ids / 1e6, ms * 1e6 / ids,
		      kvd_seg_bytes(&g, n) / 1e6, crc_ms, c);
	kvd_seg_free(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_constants),
		cmocka_unit_test(test_profile_round_trip),
		cmocka_unit_test(test_profile_rejects),
		cmocka_unit_test(test_fingerprint_fields),
		cmocka_unit_test(test_layer_round_trip),
		cmocka_unit_test(test_end_round_trip),
		cmocka_unit_test(test_header_bit_flips),
		cmocka_unit_test(test_payload_byte_flips),
		cmocka_unit_test(test_header_semantics),
		cmocka_unit_test(test_io_buffers),
		cmocka_unit_test(test_seg_restore_attention),
		cmocka_unit_test(test_versions),
		cmocka_unit_test(test_local_extent),
		cmocka_unit_test(test_heavy_extent),
		cmocka_unit_test(test_seg_corruptions),
		cmocka_unit_test(test_seg_full_buckets),
		cmocka_unit_test(test_tiny_extents),
		cmocka_unit_test(test_seg_check_speed),
	};

	nkv = kern_variants(kv);
	return cmocka_run_group_tests(tests, NULL, NULL);
}
