/* The spill file format: see sfmt.h for the contract. */
#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <isa-l/crc.h>
#define XXH_STATIC_LINKING_ONLY         /* XXH3_state_t on the stack: no malloc, no failure */
#include <xxhash.h>

#include "engine/attn.h"
#include "engine/err.h"
#include "sfmt.h"

/* The header is the disk format: every offset pinned, no padding anywhere. */
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the format is little-endian, as stored");
static_assert(offsetof(struct kvd_sfmt_hdr, magic) == 0, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, version) == 8, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, kind) == 12, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, payload_bytes) == 16, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, extent_bytes) == 24, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, seq) == 32, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, gen) == 40, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, profile_fp) == 48, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, tok_begin) == 56, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, tok_end) == 64, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, index) == 72, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, layer) == 76, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, kv_heads) == 80, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, d) == 84, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, K) == 88, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, L) == 92, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, n) == 96, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, flags) == 100, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, tenant) == 104, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, crc) == 176, "layout");
static_assert(offsetof(struct kvd_sfmt_hdr, hdr_crc) == 180, "layout");
static_assert(sizeof(struct kvd_sfmt_hdr) == 184, "no tail padding");
static_assert(sizeof(struct kvd_sfmt_hdr) <= KVD_SFMT_PAGE, "the header fits its page");
static_assert(sizeof(KVD_SFMT_MAGIC) - 1 == sizeof(((struct kvd_sfmt_hdr *)0)->magic), "magic");
static_assert(sizeof(((struct kvd_sfmt_hdr *)0)->tenant) > KVD_NAME_MAX, "tenant and its NUL");

static_assert(offsetof(struct kvd_sfmt_profile_rec, q_heads) == 72, "layout");
static_assert(offsetof(struct kvd_sfmt_profile_rec, layers) == 96, "layout");
static_assert(offsetof(struct kvd_sfmt_profile_rec, kv_dtype) == 116, "layout");
static_assert(offsetof(struct kvd_sfmt_profile_rec, seed) == 120, "layout");
static_assert(offsetof(struct kvd_sfmt_profile_rec, estimator) == 128, "layout");
static_assert(offsetof(struct kvd_sfmt_profile_rec, chunk_tokens) == 132 &&
	      offsetof(struct kvd_sfmt_profile_rec, reserved) == 136, "layout");
static_assert(sizeof(struct kvd_sfmt_profile_rec) == KVD_SFMT_PROFILE_REC, "record size");
static_assert(sizeof(((struct kvd_sfmt_profile_rec *)0)->name) > KVD_NAME_MAX, "name + NUL");

/* A segment's io buffer is its extent. */
static_assert(KVD_SFMT_PAGE == KVD_SEG_IO_PAGE, "segment header page");

#define A64(x) (((uint64_t)(x) + 63) & ~(uint64_t)63)

__attribute__((format(printf, 4, 5)))
static int failf(int rc, char *msg, size_t msglen, const char *fmt, ...)
{
	va_list ap;

	if (msg && msglen) {
		va_start(ap, fmt);
		vsnprintf(msg, msglen, fmt, ap);
		va_end(ap);
	}
	return rc;
}

#define fail(msg, msglen, ...) failf(-KVD_EFORMAT, msg, msglen, __VA_ARGS__)

static const char *kind_name(uint32_t kind)
{
	switch (kind) {
	case KVD_SFMT_PROFILE: return "PROFILE";
	case KVD_SFMT_LAYER: return "LAYER";
	case KVD_SFMT_SEG: return "SEG";
	case KVD_SFMT_END: return "END";
	case KVD_SFMT_LOCAL: return "LOCAL";
	case KVD_SFMT_PUB: return "PUB";
	case KVD_SFMT_HEAVY: return "HEAVY";
	}
	return "?";
}

uint64_t kvd_sfmt_extent_bytes(uint64_t payload_bytes)
{
	const uint64_t pg = KVD_SFMT_PAGE;

	if (payload_bytes > UINT64_MAX - 2 * pg)
		return 0;
	return pg + ((payload_bytes + pg - 1) & ~(pg - 1));
}

/* crc32_iscsi() neither inverts on entry nor on exit, so its running value
 * chains across calls, and takes an int length: payloads of big segments
 * pass 2 GiB, hence the chunks. */
#define CRC_CHUNK (1u << 30)

uint32_t kvd_sfmt_crc32c(const void *p, uint64_t len)
{
	const unsigned char *b = p;
	uint32_t c = 0xffffffffu;

	while (len) {
		uint32_t k = len > CRC_CHUNK ? CRC_CHUNK : (uint32_t)len;

		c = crc32_iscsi((unsigned char *)b, (int)k, c);
		b += k;
		len -= k;
	}
	return ~c;
}

static uint32_t hdr_crc(const struct kvd_sfmt_hdr *h)
{
	struct kvd_sfmt_hdr t = *h;

	t.hdr_crc = 0;
	return kvd_sfmt_crc32c(&t, sizeof t);
}

/* ---- profiles ----------------------------------------------------------- */

static uint64_t w_bytes(uint32_t d, uint32_t K, uint32_t L)
{
	return (uint64_t)d * K * L * sizeof(float);
}

static void rec_make(const struct kvd_profile *p, struct kvd_sfmt_profile_rec *r)
{
	memset(r, 0, sizeof *r);
	memcpy(r->name, p->name, strnlen(p->name, KVD_NAME_MAX));
	r->q_heads = p->g.q_heads;
	r->kv_heads = p->g.kv_heads;
	r->d = p->g.d;
	r->K = p->g.K;
	r->L = p->g.L;
	r->c = p->g.c;
	r->layers = p->layers;
	r->sink = p->sink;
	r->window = p->window;
	r->seg_tokens = p->seg_tokens;
	r->seal_tokens = p->seal_tokens;
	r->seed = p->seed;
	r->kv_dtype = p->g.kv_dtype;
	r->estimator = p->estimator;
	/* The default is written as 0, so a profile's record (and fingerprint)
	 * is what it was before the field existed. */
	r->chunk_tokens = p->chunk_tokens == kvd_store_chunk_default(p->seal_tokens) ? 0 :
			  p->chunk_tokens;
}

uint64_t kvd_sfmt_profile_bytes(const struct kvd_profile *p)
{
	return KVD_SFMT_PROFILE_REC + A64(p->layers) + w_bytes(p->g.d, p->g.K, p->g.L);
}

void kvd_sfmt_profile_put(const struct kvd_profile *p, void *payload)
{
	struct kvd_sfmt_profile_rec r;
	uint8_t *o = payload;

	rec_make(p, &r);
	memcpy(o, &r, sizeof r);
	o += sizeof r;
	for (uint32_t i = 0; i < p->layers; i++)
		o[i] = p->dense[i] != 0;
	memset(o + p->layers, 0, A64(p->layers) - p->layers);
	o += A64(p->layers);
	memcpy(o, p->W, w_bytes(p->g.d, p->g.K, p->g.L));
}

/* The same byte stream whether it comes from a profile or from a payload:
 * record, dense[layers], W. */
uint64_t kvd_sfmt_profile_fp(const struct kvd_profile *p)
{
	struct kvd_sfmt_profile_rec r;
	XXH3_state_t st;
	uint8_t dn[256];

	rec_make(p, &r);
	XXH3_64bits_reset(&st);
	XXH3_64bits_update(&st, &r, sizeof r);
	for (uint32_t at = 0; at < p->layers; at += sizeof dn) {
		uint32_t k = p->layers - at < sizeof dn ? p->layers - at : (uint32_t)sizeof dn;

		for (uint32_t i = 0; i < k; i++)
			dn[i] = p->dense[at + i] != 0;
		XXH3_64bits_update(&st, dn, k);
	}
	XXH3_64bits_update(&st, p->W, w_bytes(p->g.d, p->g.K, p->g.L));
	return XXH3_64bits_digest(&st);
}

/* A checked payload (see rec_check). */
static uint64_t payload_fp(const uint8_t *pl, const struct kvd_sfmt_profile_rec *r)
{
	XXH3_state_t st;

	XXH3_64bits_reset(&st);
	XXH3_64bits_update(&st, pl, KVD_SFMT_PROFILE_REC + r->layers);
	XXH3_64bits_update(&st, pl + KVD_SFMT_PROFILE_REC + A64(r->layers),
			   w_bytes(r->d, r->K, r->L));
	return XXH3_64bits_digest(&st);
}

static int all_zero(const uint8_t *p, size_t n)
{
	uint8_t acc = 0;

	for (size_t i = 0; i < n; i++)
		acc |= p[i];
	return acc == 0;
}

static int pow2(uint32_t x)
{
	return x && !(x & (x - 1));
}

/* Every check of kvd_sfmt_profile_get, without allocating: the limits are
 * the store's (KVD_PROFILE_*: a profile on disk was once a valid request), the
 * form canonical (what kvd_sfmt_profile_put writes) so that the
 * fingerprint of the bytes is the fingerprint of the profile.  Fills *r. */
static int rec_check(const uint8_t *pl, uint64_t bytes, struct kvd_sfmt_profile_rec *r,
		     char *msg, size_t msglen)
{
	if (bytes < sizeof *r)
		return fail(msg, msglen, "PROFILE payload of %llu bytes is shorter than its %u-byte record",
			    (unsigned long long)bytes, KVD_SFMT_PROFILE_REC);
	memcpy(r, pl, sizeof *r);

	const char *nul = memchr(r->name, 0, sizeof r->name);
	size_t len = nul ? (size_t)(nul - r->name) : 0;

	if (!nul || len < 1 || len > KVD_NAME_MAX)
		return fail(msg, msglen, "PROFILE name is not 1..%d characters and a NUL",
			    KVD_NAME_MAX);
	for (size_t i = 0; i < len; i++)
		if (r->name[i] < 0x20 || r->name[i] > 0x7e)
			return fail(msg, msglen, "PROFILE name has a non-printable byte 0x%02x at %zu",
				    (unsigned char)r->name[i], i);
	if (!all_zero((const uint8_t *)r->name + len, sizeof r->name - len) ||
	    !all_zero(r->reserved, sizeof r->reserved))
		return fail(msg, msglen, "PROFILE record: name padding or reserved bytes not zero");
	if (r->estimator > KVD_EST_MAX)
		return fail(msg, msglen, "PROFILE estimator %u is not 0 to %d", r->estimator,
			    KVD_EST_MAX);

	struct kvd_geom g = { r->q_heads, r->kv_heads, r->d, r->K, r->L, r->c, r->kv_dtype, 0 };

	if (kvd_geom_check(&g))
		return fail(msg, msglen,
			    "PROFILE geometry q_heads %u kv_heads %u head_dim %u K %u L %u c %u kv_dtype %u refused by kvd_geom_check",
			    r->q_heads, r->kv_heads, r->d, r->K, r->L, r->c, r->kv_dtype);
	if (r->layers < 1 || r->layers > KVD_PROFILE_LAYERS_MAX)
		return fail(msg, msglen, "PROFILE layers %u out of range [1, %d]", r->layers,
			    KVD_PROFILE_LAYERS_MAX);
	if (r->sink > KVD_PROFILE_TOKENS_MAX || r->window > KVD_PROFILE_TOKENS_MAX)
		return fail(msg, msglen, "PROFILE sink %u / window %u above %u", r->sink, r->window,
			    KVD_PROFILE_TOKENS_MAX);
	if (!pow2(r->seg_tokens) || r->seg_tokens < KVD_PROFILE_SEG_MIN ||
	    r->seg_tokens > KVD_SEG_MAX)
		return fail(msg, msglen, "PROFILE seg_tokens %u is not a power of two in [%u, %u]",
			    r->seg_tokens, KVD_PROFILE_SEG_MIN, KVD_SEG_MAX);
	if (r->seal_tokens < KVD_PROFILE_SEAL_MIN || r->seal_tokens > r->seg_tokens)
		return fail(msg, msglen, "PROFILE seal_tokens %u out of range [%u, seg_tokens %u]",
			    r->seal_tokens, KVD_PROFILE_SEAL_MIN, r->seg_tokens);
	if (r->chunk_tokens && r->seal_tokens % r->chunk_tokens)
		return fail(msg, msglen, "PROFILE chunk_tokens %u does not divide seal_tokens %u",
			    r->chunk_tokens, r->seal_tokens);
	/* Canonical: the default is written as 0, never as its value. */
	if (r->chunk_tokens && r->chunk_tokens == kvd_store_chunk_default(r->seal_tokens))
		return fail(msg, msglen, "PROFILE chunk_tokens %u is the default, written as 0",
			    r->chunk_tokens);

	/* All factors bounded above by now: no overflow. */
	uint64_t want = KVD_SFMT_PROFILE_REC + A64(r->layers) + w_bytes(r->d, r->K, r->L);

	if (bytes != want)
		return fail(msg, msglen,
			    "PROFILE payload of %llu bytes, its record (layers %u, head_dim %u, K %u, L %u) makes %llu",
			    (unsigned long long)bytes, r->layers, r->d, r->K, r->L,
			    (unsigned long long)want);

	const uint8_t *dense = pl + KVD_SFMT_PROFILE_REC;

	for (uint32_t i = 0; i < r->layers; i++)
		if (dense[i] > 1)
			return fail(msg, msglen, "PROFILE dense[%u] = %u: not 0 or 1", i, dense[i]);
	if (!all_zero(dense + r->layers, A64(r->layers) - r->layers))
		return fail(msg, msglen, "PROFILE dense padding not zero");

	/* W is always kvd_lsh_make_w's normals: anything infinite or NaN is a
	 * broken file, and would hash every key to the same bucket. */
	const uint8_t *w = dense + A64(r->layers);
	uint64_t nw = w_bytes(r->d, r->K, r->L) / sizeof(float);

	for (uint64_t i = 0; i < nw; i++) {
		uint32_t u;

		memcpy(&u, w + i * sizeof u, sizeof u);
		if ((u & 0x7f800000u) == 0x7f800000u)
			return fail(msg, msglen, "PROFILE W[%llu] is not finite",
				    (unsigned long long)i);
	}
	return 0;
}

int kvd_sfmt_profile_get(const void *payload, uint64_t bytes, struct kvd_profile *out,
			 char *msg, size_t msglen)
{
	struct kvd_sfmt_profile_rec r;
	const uint8_t *pl = payload;
	int rc = rec_check(pl, bytes, &r, msg, msglen);

	memset(out, 0, sizeof *out);
	if (rc)
		return rc;
	memcpy(out->name, r.name, KVD_NAME_MAX);
	out->name[KVD_NAME_MAX] = 0;
	out->g = (struct kvd_geom){ r.q_heads, r.kv_heads, r.d, r.K, r.L, r.c, r.kv_dtype,
				    r.estimator == KVD_EST_HYBRID_LCV };
	out->layers = r.layers;
	out->sink = r.sink;
	out->window = r.window;
	out->seg_tokens = r.seg_tokens;
	out->seal_tokens = r.seal_tokens;
	out->seed = r.seed;
	out->estimator = r.estimator;
	out->chunk_tokens = r.chunk_tokens ? r.chunk_tokens :
			    kvd_store_chunk_default(r.seal_tokens);
	out->dense = malloc(r.layers);
	out->W = malloc(w_bytes(r.d, r.K, r.L));
	if (!out->dense || !out->W) {
		free(out->dense);
		free(out->W);
		memset(out, 0, sizeof *out);
		return failf(-ENOMEM, msg, msglen, "out of memory for a profile's W");
	}
	memcpy(out->dense, pl + KVD_SFMT_PROFILE_REC, r.layers);
	memcpy(out->W, pl + KVD_SFMT_PROFILE_REC + A64(r.layers), w_bytes(r.d, r.K, r.L));
	return 0;
}

/* ---- layers ------------------------------------------------------------- */

uint64_t kvd_sfmt_layer_bytes(const struct kvd_geom *g, uint32_t n, int mean)
{
	uint64_t H = g->kv_heads;

	return (mean ? A64(H * g->d * sizeof(float)) : 0) +
	       2 * A64(H * n * g->d * sizeof(uint16_t)) + A64(H * g->L * n * sizeof(uint16_t));
}

void kvd_sfmt_layer_parts(const struct kvd_geom *g, uint32_t n, int mean, void *payload,
			  float **m, uint16_t **k, uint16_t **v, uint16_t **codes)
{
	uint64_t H = g->kv_heads, rows = A64(H * n * g->d * sizeof(uint16_t));
	char *p = payload;

	*m = mean ? (float *)p : NULL;
	p += mean ? A64(H * g->d * sizeof(float)) : 0;
	*k = (uint16_t *)p;
	*v = (uint16_t *)(p + rows);
	*codes = (uint16_t *)(p + 2 * rows);
}

void kvd_sfmt_pub_key_put(struct kvd_sfmt_hdr *h, const uint8_t *key)
{
	memcpy(&h->tok_begin, key, 8);
	memcpy(&h->tok_end, key + 8, 8);
}

void kvd_sfmt_pub_key(const struct kvd_sfmt_hdr *h, uint8_t *key)
{
	memcpy(key, &h->tok_begin, 8);
	memcpy(key + 8, &h->tok_end, 8);
}

uint64_t kvd_sfmt_heavy_bytes(uint32_t q_heads)
{
	const struct kvd_geom g = { .q_heads = q_heads };

	return (uint64_t)kvd_heavy_words(&g) * sizeof(uint32_t);
}

uint64_t kvd_sfmt_local_bytes(const struct kvd_geom *g, uint32_t n)
{
	return 2 * A64((uint64_t)g->kv_heads * n * g->d * 2);
}

/* ---- headers ------------------------------------------------------------ */

uint64_t kvd_sfmt_ext_payload(const struct kvd_sfmt_file *f, const struct kvd_sfmt_ext *e)
{
	switch (e->kind) {
	case KVD_SFMT_PROFILE:
		return kvd_sfmt_profile_bytes(f->p);
	case KVD_SFMT_LAYER:
		return kvd_sfmt_layer_bytes(&f->p->g, e->n, !!(e->flags & KVD_SFMT_LF_MEAN));
	case KVD_SFMT_SEG:
		return kvd_seg_bytes(&f->p->g, e->n);
	case KVD_SFMT_LOCAL:
		return kvd_sfmt_local_bytes(&f->p->g, e->n);
	case KVD_SFMT_HEAVY:
		return kvd_sfmt_heavy_bytes(f->p->g.q_heads);
	}
	return 0;
}

void kvd_sfmt_hdr_fill(struct kvd_sfmt_hdr *h, const struct kvd_sfmt_file *f,
		       const struct kvd_sfmt_ext *e)
{
	const struct kvd_geom *g = &f->p->g;

	memset(h, 0, sizeof *h);
	h->kind = e->kind;
	h->index = e->index;
	h->payload_bytes = kvd_sfmt_ext_payload(f, e);
	h->seq = f->seq;
	h->gen = f->gen;
	h->profile_fp = f->profile_fp;
	h->kv_heads = g->kv_heads;
	h->d = g->d;
	h->K = g->K;
	h->L = g->L;
	switch (e->kind) {
	case KVD_SFMT_LAYER:
	case KVD_SFMT_SEG:
		h->layer = e->layer;
		h->n = e->n;
		h->tok_begin = e->tok_begin;
		h->tok_end = e->tok_begin + e->n;
		if (e->kind == KVD_SFMT_LAYER)
			h->flags = e->flags;
		else if (g->kv_dtype == KVD_KV_INT8)
			h->flags = KVD_SFMT_SF_INT8;
		break;
	case KVD_SFMT_LOCAL:
	case KVD_SFMT_PUB:
		h->layer = e->layer;
		h->n = e->n;
		break;
	case KVD_SFMT_HEAVY:
		h->layer = e->layer;
		h->n = g->q_heads;      /* the payload's size follows from it */
		break;
	case KVD_SFMT_END:
		h->n = e->index;        /* the extents before it */
		break;
	}
	snprintf(h->tenant, sizeof h->tenant, "%s", f->tenant);
}

void kvd_sfmt_seal(struct kvd_sfmt_hdr *h, const void *payload)
{
	memcpy(h->magic, KVD_SFMT_MAGIC, sizeof h->magic);
	h->version = KVD_SFMT_VERSION;
	h->extent_bytes = kvd_sfmt_extent_bytes(h->payload_bytes);
	h->crc = kvd_sfmt_crc32c(payload, h->payload_bytes);
	h->hdr_crc = hdr_crc(h);
}

uint32_t kvd_sfmt_seg_dtype(const struct kvd_sfmt_hdr *h)
{
	return h->kind == KVD_SFMT_SEG && (h->flags & KVD_SFMT_SF_INT8) ? KVD_KV_INT8 : KVD_KV_BF16;
}

/* q_heads and c are not part of what an extent stores: a group of 1 and
 * c = 1 let kvd_geom_check judge the fields that are. */
static struct kvd_geom hdr_geom(const struct kvd_sfmt_hdr *h)
{
	return (struct kvd_geom){ .q_heads = h->kv_heads, .kv_heads = h->kv_heads, .d = h->d,
				  .K = h->K, .L = h->L, .c = 1, .kv_dtype = kvd_sfmt_seg_dtype(h) };
}

/* A token range [begin, end) of exactly n tokens, without wrapping. */
static int tok_ok(const struct kvd_sfmt_hdr *h)
{
	return h->tok_end >= h->tok_begin && h->tok_end - h->tok_begin == h->n;
}

static int check_kind(const struct kvd_sfmt_hdr *h, char *msg, size_t msglen)
{
	struct kvd_geom g = hdr_geom(h);
	const char *kn = kind_name(h->kind);
	uint64_t want;

	if (h->kind < KVD_SFMT_PROFILE || h->kind > KVD_SFMT_HEAVY ||
	    (h->kind >= KVD_SFMT_LOCAL && h->version < 3) ||
	    (h->kind == KVD_SFMT_HEAVY && h->version < 5))
		return fail(msg, msglen, "extent %u: unknown kind %u for version %u", h->index, h->kind,
			    h->version);
	if (kvd_geom_check(&g) &&
	    !(h->kind == KVD_SFMT_END && !h->kv_heads && !h->d && !h->K && !h->L))
		return fail(msg, msglen,
			    "%s extent %u: geometry kv_heads %u d %u K %u L %u refused by kvd_geom_check",
			    kn, h->index, h->kv_heads, h->d, h->K, h->L);
	if (h->kind != KVD_SFMT_LAYER && h->kind != KVD_SFMT_SEG && h->flags)
		return fail(msg, msglen, "%s extent %u: flags 0x%x, only LAYER and SEG have flags",
			    kn, h->index, h->flags);

	switch (h->kind) {
	case KVD_SFMT_PROFILE: {
		/* The record says how many layers, so only the range is known
		 * here: dense[] takes 64 to A64(KVD_PROFILE_LAYERS_MAX) bytes. */
		uint64_t fixed = KVD_SFMT_PROFILE_REC + w_bytes(h->d, h->K, h->L);
		uint64_t pad = h->payload_bytes - fixed;

		if (h->index != 0)
			return fail(msg, msglen, "PROFILE extent at index %u, not first", h->index);
		if (h->payload_bytes < fixed || pad < 64 || pad > A64(KVD_PROFILE_LAYERS_MAX) || pad % 64)
			return fail(msg, msglen,
				    "PROFILE extent: payload_bytes %llu impossible for head_dim %u K %u L %u",
				    (unsigned long long)h->payload_bytes, h->d, h->K, h->L);
		break;
	}
	case KVD_SFMT_LAYER:
		if (h->layer >= KVD_PROFILE_LAYERS_MAX || h->n > KVD_SEG_MAX || !tok_ok(h))
			return fail(msg, msglen,
				    "LAYER extent %u: layer %u, tail of %u rows, tokens [%llu, %llu) out of range",
				    h->index, h->layer, h->n, (unsigned long long)h->tok_begin,
				    (unsigned long long)h->tok_end);
		if (h->flags & ~(uint32_t)(KVD_SFMT_LF_MEAN | KVD_SFMT_LF_SEALED))
			return fail(msg, msglen, "LAYER extent %u: unknown flags 0x%x", h->index,
				    h->flags);
		want = kvd_sfmt_layer_bytes(&g, h->n, h->flags & KVD_SFMT_LF_MEAN);
		if (h->payload_bytes != want)
			return fail(msg, msglen,
				    "LAYER extent %u: payload_bytes %llu, a tail of %u rows%s takes %llu",
				    h->index, (unsigned long long)h->payload_bytes, h->n,
				    h->flags & KVD_SFMT_LF_MEAN ? " and a mean" : "",
				    (unsigned long long)want);
		break;
	case KVD_SFMT_SEG:
		if (h->layer >= KVD_PROFILE_LAYERS_MAX || h->n < 1 || h->n > KVD_SEG_MAX ||
		    !tok_ok(h))
			return fail(msg, msglen,
				    "SEG extent %u: layer %u, %u tokens, tokens [%llu, %llu) out of range",
				    h->index, h->layer, h->n, (unsigned long long)h->tok_begin,
				    (unsigned long long)h->tok_end);
		/* Version 1 wrote bf16 segments only. */
		if (h->flags & ~(h->version >= 2 ? (uint32_t)KVD_SFMT_SF_INT8 : 0u))
			return fail(msg, msglen, "SEG extent %u: unknown flags 0x%x for version %u",
				    h->index, h->flags, h->version);
		want = kvd_seg_bytes(&g, h->n);
		if (h->payload_bytes != want)
			return fail(msg, msglen,
				    "SEG extent %u: payload_bytes %llu, a segment of %u tokens takes %llu",
				    h->index, (unsigned long long)h->payload_bytes, h->n,
				    (unsigned long long)want);
		break;
	case KVD_SFMT_LOCAL:
		if (h->layer >= KVD_PROFILE_LAYERS_MAX || h->n < 1 || h->n > KVD_SFMT_LOCAL_MAX ||
		    h->tok_begin || h->tok_end)
			return fail(msg, msglen, "LOCAL extent %u: layer %u, %u rows out of range",
				    h->index, h->layer, h->n);
		want = kvd_sfmt_local_bytes(&g, h->n);
		if (h->payload_bytes != want)
			return fail(msg, msglen,
				    "LOCAL extent %u: payload_bytes %llu, %u rows take %llu", h->index,
				    (unsigned long long)h->payload_bytes, h->n, (unsigned long long)want);
		break;
	case KVD_SFMT_HEAVY: {
		/* The header stores no q_heads but n: the group it makes with
		 * kv_heads must be one kvd_geom_check takes, so that the size
		 * below is bounded and is a profile's. */
		struct kvd_geom gq = g;

		gq.q_heads = h->n;
		if (h->layer >= KVD_PROFILE_LAYERS_MAX || kvd_geom_check(&gq) || h->tok_begin ||
		    h->tok_end)
			return fail(msg, msglen,
				    "HEAVY extent %u: layer %u, %u q heads for %u kv heads, tokens [%llu, %llu) out of range",
				    h->index, h->layer, h->n, h->kv_heads,
				    (unsigned long long)h->tok_begin,
				    (unsigned long long)h->tok_end);
		want = kvd_sfmt_heavy_bytes(h->n);
		if (h->payload_bytes != want)
			return fail(msg, msglen,
				    "HEAVY extent %u: payload_bytes %llu, the state of %u q heads takes %llu",
				    h->index, (unsigned long long)h->payload_bytes, h->n,
				    (unsigned long long)want);
		break;
	}
	case KVD_SFMT_PUB:
		if (h->layer || !h->n || h->payload_bytes)
			return fail(msg, msglen, "PUB extent %u: layer %u, %u tokens, payload_bytes %llu",
				    h->index, h->layer, h->n, (unsigned long long)h->payload_bytes);
		break;
	case KVD_SFMT_END:
		if (h->payload_bytes || h->n != h->index)
			return fail(msg, msglen,
				    "END extent %u: payload_bytes %llu (must be 0), n %u (must be its index)",
				    h->index, (unsigned long long)h->payload_bytes, h->n);
		break;
	}
	/* payload_bytes is bounded by now (at most a few hundred GiB). */
	want = kvd_sfmt_extent_bytes(h->payload_bytes);
	if (!want || h->extent_bytes != want)
		return fail(msg, msglen, "%s extent %u: extent_bytes %llu, payload_bytes %llu makes %llu",
			    kn, h->index, (unsigned long long)h->extent_bytes,
			    (unsigned long long)h->payload_bytes, (unsigned long long)want);
	return 0;
}

int kvd_sfmt_check_hdr(const void *page, size_t len, struct kvd_sfmt_hdr *out, char *msg,
		       size_t msglen)
{
	struct kvd_sfmt_hdr h;

	if (!page || len < sizeof h)
		return fail(msg, msglen, "extent header: %zu bytes, need %zu", page ? len : 0,
			    sizeof h);
	memcpy(&h, page, sizeof h);
	/* Magic and version first: a file that is not ours, or from another
	 * format, says so rather than "bad checksum". */
	if (memcmp(h.magic, KVD_SFMT_MAGIC, sizeof h.magic))
		return fail(msg, msglen, "extent header: bad magic, not a kvd spill extent");
	if (h.version < KVD_SFMT_VERSION_MIN || h.version > KVD_SFMT_VERSION)
		return fail(msg, msglen, "extent header: format version %u, kvd reads %u to %u",
			    h.version, KVD_SFMT_VERSION_MIN, KVD_SFMT_VERSION);
	uint32_t c = hdr_crc(&h);

	if (c != h.hdr_crc)
		return fail(msg, msglen, "extent header: checksum %08x, computed %08x", h.hdr_crc, c);

	const char *nul = memchr(h.tenant, 0, KVD_NAME_MAX + 1);

	if (!nul)
		return fail(msg, msglen, "extent %u: tenant not NUL-terminated within %d bytes",
			    h.index, KVD_NAME_MAX + 1);
	for (const char *t = h.tenant; t < nul; t++)
		if (*t < 0x20 || *t > 0x7e)
			return fail(msg, msglen, "extent %u: tenant has a non-printable byte 0x%02x",
				    h.index, (unsigned char)*t);

	int rc = check_kind(&h, msg, msglen);

	if (rc)
		return rc;
	if (out)
		*out = h;
	return 0;
}

int kvd_sfmt_check_payload(const struct kvd_sfmt_hdr *h, void *payload, char *msg,
			   size_t msglen)
{
	uint32_t c = kvd_sfmt_crc32c(payload, h->payload_bytes);
	const char *kn = kind_name(h->kind);

	if (c != h->crc)
		return fail(msg, msglen, "%s extent %u: payload checksum %08x, header says %08x", kn,
			    h->index, c, h->crc);

	switch (h->kind) {
	case KVD_SFMT_PROFILE: {
		struct kvd_sfmt_profile_rec r;
		int rc = rec_check(payload, h->payload_bytes, &r, msg, msglen);

		if (rc)
			return rc;
		if (r.kv_heads != h->kv_heads || r.d != h->d || r.K != h->K || r.L != h->L)
			return fail(msg, msglen,
				    "PROFILE extent: record geometry kv_heads %u d %u K %u L %u, header says %u %u %u %u",
				    r.kv_heads, r.d, r.K, r.L, h->kv_heads, h->d, h->K, h->L);
		uint64_t fp = payload_fp(payload, &r);

		if (fp != h->profile_fp)
			return fail(msg, msglen,
				    "PROFILE extent: fingerprint %016llx, header says %016llx",
				    (unsigned long long)fp, (unsigned long long)h->profile_fp);
		return 0;
	}
	case KVD_SFMT_SEG: {
		struct kvd_geom g = hdr_geom(h);
		int rc = 0;

		/* The checksum covers the bytes as written: rewrite only now. */
		if (h->version < 4)
			rc = kvd_seg_upgrade_r8(&g, h->n, payload);
		if (rc == -ENOMEM)
			return failf(rc, msg, msglen, "SEG extent %u: out of memory", h->index);
		if (!rc)
			rc = kvd_seg_check(&g, h->n, payload);

		if (rc == -EINVAL)
			return failf(rc, msg, msglen, "SEG extent %u: payload not 64-byte aligned",
				     h->index);
		if (rc)
			return fail(msg, msglen,
				    "SEG extent %u (layer %u, tokens [%llu, %llu)): bucket tables, scales or 1/|k| malformed",
				    h->index, h->layer, (unsigned long long)h->tok_begin,
				    (unsigned long long)h->tok_end);
		return 0;
	}
	}
	return 0;
}
