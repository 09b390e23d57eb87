/* libFuzzer target for the spill format (kvd/store/sfmt.c) and the segment check
 * (kvd_seg_check): what stands between a file on disk and kvd's memory.
 *
 * The input is one extent without its page padding: the header struct
 * (sizeof(struct kvd_sfmt_hdr) bytes), then the payload.  The seeds in
 * tests/fuzz/seeds/fuzz_sfmt are real sealed extents of every kind, written
 * by tests/unit/test_sfmt.c (KVD_SFMT_SEEDS=DIR).
 *
 * Each input runs twice: as it is, and with crc and hdr_crc recomputed over
 * what is there, so that mutations get past the checksums to the checks
 * behind them.  Whatever the checks accept must be safe to act on:
 *  - every refusal is -KVD_EFORMAT and says why;
 *  - PROFILE: kvd_sfmt_profile_get agrees with kvd_sfmt_check_payload, the
 *    profile read hashes to the header's fingerprint, and putting it back
 *    gives the very same bytes;
 *  - LAYER, LOCAL: every part lies inside the payload (read end to end);
 *  - HEAVY: the payload is exactly the state of n q heads
 *    (kvd_heavy_words), n a group of kv_heads, read end to end with each
 *    head's count clamped as the engine clamps it;
 *  - SEG: checked in a buffer of exactly its size (a read past it is an ASan
 *    report), then copied into an io buffer whose header page and padding
 *    are poisoned, adopted, and queried on every kv head with
 *    kvd_lsh_candidates (ids < n) and kvd_attn_sampled, query codes and q
 *    taken from the input: a gather outside the rows or tables is an ASan
 *    report.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <sanitizer/asan_interface.h>

#include "engine/attn.h"
#include "engine/err.h"
#include "engine/kern.h"
#include "engine/lsh.h"
#include "kvd/store/sfmt.h"

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t len);

#define HDR sizeof(struct kvd_sfmt_hdr)

/* Bytes of the input, cycled, for query codes and q. */
struct knobs {
	const uint8_t *p;
	size_t n, at;
};

static uint8_t knob(struct knobs *k)
{
	return k->n ? k->p[k->at++ % k->n] : 0;
}

static void refused(int rc, const char *msg)
{
	if (rc != -KVD_EFORMAT || !memchr(msg, 0, 256) || !msg[0])
		abort();
}

static void profile(const struct kvd_sfmt_hdr *h, const uint8_t *pl, int ok)
{
	struct kvd_profile p;
	char msg[256] = "";
	int rc = kvd_sfmt_profile_get(pl, h->payload_bytes, &p, msg, sizeof msg);

	if (rc) {
		if (ok)                 /* check_payload passed what profile_get refuses */
			abort();
		refused(rc, msg);
		return;
	}
	uint64_t bytes = kvd_sfmt_profile_bytes(&p);
	uint8_t *back = malloc(bytes);

	if (!back || bytes != h->payload_bytes)
		abort();
	kvd_sfmt_profile_put(&p, back);
	if (memcmp(back, pl, bytes))
		abort();                /* a checked record is canonical */
	if (ok && kvd_sfmt_profile_fp(&p) != h->profile_fp)
		abort();
	free(back);
	free(p.dense);
	free(p.W);
}

/* A LOCAL extent as tier_io.c installs it: K [kv][n][d] at 0, V at half the
 * payload, read end to end. */
static void local(const struct kvd_sfmt_hdr *h, const uint8_t *pl)
{
	const struct kvd_geom g = { .q_heads = h->kv_heads, .kv_heads = h->kv_heads, .d = h->d,
				    .K = h->K, .L = h->L, .c = 1 };
	uint64_t half = kvd_sfmt_local_bytes(&g, h->n) / 2;
	size_t rows = (size_t)h->kv_heads * h->n * h->d;
	const uint16_t *k = (const uint16_t *)pl, *v = (const uint16_t *)(pl + half);
	volatile uint32_t sink;
	uint32_t acc = 0;

	if (half * 2 != h->payload_bytes || rows * 2 > half)
		abort();
	for (size_t i = 0; i < rows; i++)
		acc += k[i] ^ v[i];
	sink = acc;
	(void)sink;
}

/* A HEAVY extent as tier_io.c installs it into a layer of a profile with
 * h->n q heads: words the engine reads per q head, a count and up to
 * KVD_HEAVY_MAX entries. */
static void heavy(const struct kvd_sfmt_hdr *h, const uint8_t *pl)
{
	const struct kvd_geom g = { .q_heads = h->n, .kv_heads = h->kv_heads, .d = h->d,
				    .K = h->K, .L = h->L, .c = 1 };
	volatile uint32_t sink;
	uint32_t acc = 0;

	if (kvd_geom_check(&g) || h->payload_bytes != kvd_heavy_words(&g) * sizeof(uint32_t))
		abort();
	for (uint32_t qh = 0; qh < h->n; qh++) {
		const uint8_t *e = pl + (size_t)qh * (1 + KVD_HEAVY_MAX) * sizeof(uint32_t);
		uint32_t cnt;

		memcpy(&cnt, e, sizeof cnt);
		cnt = cnt < KVD_HEAVY_MAX ? cnt : KVD_HEAVY_MAX;
		for (uint32_t k = 0; k < cnt; k++) {
			uint32_t id;

			memcpy(&id, e + (1 + k) * sizeof id, sizeof id);
			acc += id;
		}
	}
	sink = acc;
	(void)sink;
}

static void layer(const struct kvd_sfmt_hdr *h, uint8_t *pl)
{
	const struct kvd_geom g = { .q_heads = h->kv_heads, .kv_heads = h->kv_heads, .d = h->d,
				    .K = h->K, .L = h->L, .c = 1 };
	size_t H = h->kv_heads, n = h->n, d = h->d, L = h->L;
	int mean = h->flags & KVD_SFMT_LF_MEAN;
	volatile uint32_t sink;
	uint32_t acc = 0;
	float *m;
	uint16_t *k, *v, *codes;

	kvd_sfmt_layer_parts(&g, h->n, mean, pl, &m, &k, &v, &codes);
	if ((uint8_t *)(codes + H * L * n) > pl + h->payload_bytes)
		abort();
	for (size_t i = 0; mean && i < H * d; i++) {
		uint32_t u;

		memcpy(&u, &m[i], sizeof u);    /* the bits: a float cast of NaN is UB */
		acc += u;
	}
	for (size_t i = 0; i < H * n * d; i++)
		acc += k[i] ^ v[i];
	for (size_t i = 0; i < H * L * n; i++)
		acc += codes[i];
	sink = acc;
	(void)sink;
}

static struct kvd_attn_scratch scr;
static struct kvd_logp_tab tab;

static void seg_query(const struct kvd_sfmt_hdr *h, const struct kvd_seg *s, struct knobs *kn)
{
	struct kvd_geom g = { .q_heads = h->kv_heads, .kv_heads = h->kv_heads, .d = h->d,
			      .K = h->K, .L = h->L, .c = 1 + (knob(kn) & 1),
			      .kv_dtype = kvd_sfmt_seg_dtype(h) };
	uint16_t qc[KVD_LSH_LMAX];
	float q[KVD_DMAX], o[KVD_DMAX], lse;

	if (!scr.cap && kvd_attn_scratch_init(&scr, KVD_SEG_MAX))
		abort();
	/* The table costs ~4000 logs: build it only when the profile changes. */
	if (tab.K != (int)g.K || tab.L != (int)g.L || tab.c != (int)g.c)
		kvd_logp_tab_init(&tab, (int)g.K, (int)g.L, (int)g.c);
	for (uint32_t hd = 0; hd < g.kv_heads; hd++) {
		for (uint32_t t = 0; t < g.L; t++)
			qc[t] = (uint16_t)(knob(kn) | knob(kn) << 8);
		for (uint32_t e = 0; e < g.d; e++)
			q[e] = (float)(int8_t)knob(kn) / 16.0f;

		uint32_t m = kvd_lsh_candidates(&s->h[hd].tab, qc, (int)g.c, &scr.lsh, scr.cand);

		if (m > s->n)
			abort();
		for (uint32_t i = 0; i < m; i++)
			if (scr.cand[i] >= s->n)
				abort();
		kvd_attn_sampled(kvd_kern_get(), &g, &tab, s, hd, q, qc, &scr, o, &lse, NULL);
	}
}

static void seg(const struct kvd_sfmt_hdr *h, const uint8_t *pl, struct knobs *kn)
{
	const struct kvd_geom g = { .q_heads = h->kv_heads, .kv_heads = h->kv_heads, .d = h->d,
				    .K = h->K, .L = h->L, .c = 1, .kv_dtype = kvd_sfmt_seg_dtype(h) };
	size_t bytes;
	uint8_t *io = kvd_seg_io_alloc(&g, h->n, &bytes);
	struct kvd_seg *s;

	if (!io || bytes != h->extent_bytes)
		abort();
	memcpy(io + KVD_SFMT_PAGE, pl, h->payload_bytes);
	ASAN_POISON_MEMORY_REGION(io, KVD_SFMT_PAGE);
	ASAN_POISON_MEMORY_REGION(io + KVD_SFMT_PAGE + h->payload_bytes,
				  bytes - KVD_SFMT_PAGE - h->payload_bytes);
	if (kvd_seg_check(&g, h->n, io + KVD_SFMT_PAGE) || kvd_seg_adopt(&g, h->n, io, bytes, NULL, &s))
		abort();
	seg_query(h, s, kn);
	/* Before the free: a mapping handed back poisoned would poison
	 * whatever is mapped there next. */
	ASAN_UNPOISON_MEMORY_REGION(io, bytes);
	kvd_seg_free(s);
}

static void one(const uint8_t *buf, size_t len)
{
	struct kvd_sfmt_hdr h;
	char msg[256] = "";
	int rc = kvd_sfmt_check_hdr(buf, len, &h, msg, sizeof msg);

	if (rc) {
		refused(rc, msg);
		return;
	}
	if (h.payload_bytes > len - HDR)
		return;

	/* Exactly payload_bytes, 64-aligned as in an io buffer: the checks
	 * may not read a byte past it. */
	size_t pb = (size_t)h.payload_bytes;
	uint8_t *pl = aligned_alloc(64, pb ? (pb + 63) & ~(size_t)63 : 64);
	struct knobs kn = { buf + HDR, len - HDR, 0 };

	if (!pl)
		abort();
	memcpy(pl, buf + HDR, pb);
	ASAN_POISON_MEMORY_REGION(pl + pb, ((pb + 63) & ~(size_t)63) - pb);
	msg[0] = 0;
	rc = kvd_sfmt_check_payload(&h, pl, msg, sizeof msg);
	if (rc)
		refused(rc, msg);
	switch (h.kind) {
	case KVD_SFMT_PROFILE:
		profile(&h, pl, !rc);
		break;
	case KVD_SFMT_LAYER:
		layer(&h, pl);
		break;
	case KVD_SFMT_LOCAL:
		local(&h, pl);
		break;
	case KVD_SFMT_HEAVY:
		heavy(&h, pl);
		break;
	case KVD_SFMT_SEG:
		if (!rc)
			seg(&h, pl, &kn);
		break;
	}
	ASAN_UNPOISON_MEMORY_REGION(pl, (pb + 63) & ~(size_t)63);
	free(pl);
}

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t len)
{
	one(buf, len);
	if (len < HDR)
		return 0;

	/* Again with the checksums made to match. */
	uint8_t *fx = malloc(len);
	struct kvd_sfmt_hdr h;

	if (!fx)
		abort();
	memcpy(fx, buf, len);
	memcpy(&h, fx, HDR);
	h.crc = kvd_sfmt_crc32c(fx + HDR, h.payload_bytes < len - HDR ? h.payload_bytes : len - HDR);
	h.hdr_crc = 0;
	h.hdr_crc = kvd_sfmt_crc32c(&h, HDR);
	memcpy(fx, &h, HDR);
	one(fx, len);
	free(fx);
	return 0;
}
