/* kvd_ctl: control-plane codec and socket I/O.  See ctl.h. */
#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "engine/attn.h"
#include "ctl.h"
#include "engine/err.h"
#include "engine/lsh.h"
#include "engine/model.h"

/* W travels as little-endian float32 and is memcpy'd. */
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvd_ctl assumes a little-endian host");
static_assert(KVD_CTL_VERSION == KVD__VERSION__VERSION_CURRENT, "KVD_CTL_VERSION");
static_assert(KVD_CTL_NAME_MAX == KVD_MODEL_NAME_MAX, "one name limit");
static_assert(KVD_CTL_LAYERS_MAX % 64 == 0, "dense layer bitmap");
/* Profile.kv_dtype goes into kvd_geom.kv_dtype as it is. */
static_assert((int)KVD__KV_DTYPE__KV_DTYPE_BF16 == (int)KVD_KV_BF16 &&
	      (int)KVD__KV_DTYPE__KV_DTYPE_INT8 == (int)KVD_KV_INT8 &&
	      KVD_KV_DTYPE_MAX == KVD_KV_INT8, "Profile.kv_dtype numbers");
/* Profile.estimator goes into kvd_profile.estimator and kvd_attn_req.est as
 * it is. */
static_assert((int)KVD__ESTIMATOR__ESTIMATOR_MAGICPIG == (int)KVD_EST_MAGICPIG &&
	      (int)KVD__ESTIMATOR__ESTIMATOR_HYBRID == (int)KVD_EST_HYBRID &&
	      (int)KVD__ESTIMATOR__ESTIMATOR_ADAPTIVE == (int)KVD_EST_ADAPTIVE &&
	      (int)KVD__ESTIMATOR__ESTIMATOR_HYBRID_CV == (int)KVD_EST_HYBRID_CV &&
	      (int)KVD__ESTIMATOR__ESTIMATOR_HYBRID_LCV == (int)KVD_EST_HYBRID_LCV &&
	      KVD_EST_MAX == KVD_EST_HYBRID_LCV, "Profile.estimator numbers");

__attribute__((format(printf, 3, 4)))
static int fail(struct kvd_ctl_err *err, int code, const char *fmt, ...)
{
	va_list ap;

	if (err) {
		err->code = code;
		va_start(ap, fmt);
		vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
		va_end(ap);
	}
	return code;
}

static int printable(unsigned char c)
{
	return c >= 0x20 && c <= 0x7e;
}

/* s[0..n) quoted for a message, C-escaped, cut after 32 source bytes: the
 * value a peer sent is shown, never echoed raw. */
static const char *quote(char *out, size_t cap, const void *s, size_t n)
{
	const unsigned char *p = s;
	size_t o = 0;

	out[o++] = '"';
	for (size_t i = 0; i < n && i < 32 && o + 6 < cap; i++) {
		if (printable(p[i]) && p[i] != '"' && p[i] != '\\')
			out[o++] = (char)p[i];
		else
			o += (size_t)snprintf(out + o, cap - o, "\\x%02x", p[i]);
	}
	out[o++] = '"';
	out[o] = 0;
	if (n > 32 && o + 4 < cap)
		strcat(out, "...");
	return out;
}

static const char *str_or_empty(const char *s)
{
	return s ? s : "";
}

/* A name: at most KVD_CTL_NAME_MAX bytes of printable ASCII. */
static int check_name(const char *s, const char *what, int required, struct kvd_ctl_err *err)
{
	char q[160];
	size_t n;

	s = str_or_empty(s);
	n = strnlen(s, KVD_CTL_NAME_MAX + 1);
	if (n > KVD_CTL_NAME_MAX)
		return fail(err, -EINVAL, "%s %s is longer than %d bytes", what,
			    quote(q, sizeof(q), s, n), KVD_CTL_NAME_MAX);
	if (required && n == 0)
		return fail(err, -EINVAL, "%s is empty", what);
	for (size_t i = 0; i < n; i++) {
		if (!printable((unsigned char)s[i]))
			return fail(err, -EINVAL,
				    "%s %s: byte %zu (0x%02x) is not printable ASCII", what,
				    quote(q, sizeof(q), s, n), i, (unsigned char)s[i]);
	}
	return 0;
}

static int pow2(uint64_t x)
{
	return x && !(x & (x - 1));
}

static uint32_t seg_tokens(const Kvd__Profile *p)
{
	return p->segment_tokens ? p->segment_tokens : KVD_CTL_SEG_DEFAULT;
}

static uint32_t seal_tokens(const Kvd__Profile *p)
{
	uint32_t seg = seg_tokens(p);

	if (p->seal_tokens)
		return p->seal_tokens;
	return seg < KVD_CTL_SEAL_DEFAULT ? seg : KVD_CTL_SEAL_DEFAULT;
}

uint32_t kvd_ctl_chunk_default(uint32_t seal)
{
	uint32_t c = seal < KVD_CTL_CHUNK_DEFAULT ? seal : KVD_CTL_CHUNK_DEFAULT;

	while (c > 1 && seal % c)
		c--;
	return c ? c : 1;
}

static uint32_t chunk_tokens(const Kvd__Profile *p)
{
	return p->chunk_tokens ? p->chunk_tokens : kvd_ctl_chunk_default(seal_tokens(p));
}

/* ---- profiles ----------------------------------------------------------- */

int kvd_ctl_check_profile(const Kvd__Profile *p, int filled, struct kvd_ctl_err *err)
{
	uint64_t seen[KVD_CTL_LAYERS_MAX / 64] = { 0 };
	struct kvd_geom g;
	uint32_t seg;
	int rc;

	if (!p)
		return fail(err, -EINVAL, "profile missing");
	rc = check_name(p->name, "profile name", 1, err);
	if (rc)
		return rc;
	if (p->layers < 1 || p->layers > KVD_CTL_LAYERS_MAX)
		return fail(err, -EINVAL, "profile layers %u out of range [1, %d]",
			    p->layers, KVD_CTL_LAYERS_MAX);

	/* kvd_geom_check() only says no; these say which field and why. */
	if (p->q_heads < 1 || p->q_heads > KVD_QHEADS_MAX)
		return fail(err, -KVD_EGEOM, "profile q_heads %u out of range [1, %d]",
			    p->q_heads, KVD_QHEADS_MAX);
	if (p->kv_heads < 1 || p->q_heads % p->kv_heads)
		return fail(err, -KVD_EGEOM, "profile kv_heads %u does not divide q_heads %u",
			    p->kv_heads, p->q_heads);
	if (p->q_heads / p->kv_heads > KVD_GMAX)
		return fail(err, -KVD_EGEOM,
			    "profile q_heads / kv_heads = %u / %u: more than %d q heads per kv head",
			    p->q_heads, p->kv_heads, KVD_GMAX);
	if (p->head_dim < 16 || p->head_dim > KVD_DMAX || p->head_dim % 16)
		return fail(err, -KVD_EGEOM,
			    "profile head_dim %u is not a multiple of 16 in [16, %d]",
			    p->head_dim, KVD_DMAX);
	if (p->k_bits < 1 || p->k_bits > KVD_LSH_KMAX)
		return fail(err, -KVD_EGEOM, "profile k_bits %u out of range [1, %d]",
			    p->k_bits, KVD_LSH_KMAX);
	if (p->tables < 1 || p->tables > KVD_LSH_LMAX)
		return fail(err, -KVD_EGEOM, "profile tables %u out of range [1, %d]",
			    p->tables, KVD_LSH_LMAX);
	if (p->min_collisions != 1 && p->min_collisions != 2)
		return fail(err, -KVD_EGEOM, "profile min_collisions %u is not 1 or 2",
			    p->min_collisions);
	/* A storage choice, not a shape: -EINVAL, though kvd_geom_check()
	 * would say -KVD_EGEOM. */
	if (p->kv_dtype > KVD_KV_DTYPE_MAX)
		return fail(err, -EINVAL, "profile kv_dtype %u is not 0 (bf16) or 1 (int8)",
			    p->kv_dtype);
	if (p->estimator > KVD_EST_MAX)
		return fail(err, -EINVAL,
			    "profile estimator %u is not 0 (magicpig), 1 (hybrid), 2 (adaptive), 3 (hybrid_cv) or 4 (hybrid_lcv)",
			    p->estimator);
	rc = kvd_ctl_profile_to_geom(p, &g);
	if (rc)
		return fail(err, rc, "profile geometry refused by kvd_geom_check");

	if (p->sink_tokens > KVD_CTL_TOKENS_MAX)
		return fail(err, -EINVAL, "profile sink_tokens %u above %u", p->sink_tokens,
			    KVD_CTL_TOKENS_MAX);
	if (p->window_tokens > KVD_CTL_TOKENS_MAX)
		return fail(err, -EINVAL, "profile window_tokens %u above %u", p->window_tokens,
			    KVD_CTL_TOKENS_MAX);
	if (p->n_dense_layers > p->layers)
		return fail(err, -EINVAL, "profile has %zu dense_layers but only %u layers",
			    p->n_dense_layers, p->layers);
	for (size_t i = 0; i < p->n_dense_layers; i++) {
		uint32_t l = p->dense_layers[i];

		if (l >= p->layers)
			return fail(err, -EINVAL, "profile dense_layers[%zu] = %u: not below layers %u",
				    i, l, p->layers);
		if (seen[l / 64] & (1ull << (l % 64)))
			return fail(err, -EINVAL, "profile dense_layers[%zu] = %u: listed twice", i, l);
		seen[l / 64] |= 1ull << (l % 64);
	}

	if ((filled || p->segment_tokens) &&
	    (!pow2(p->segment_tokens) || p->segment_tokens < KVD_CTL_SEG_MIN ||
	     p->segment_tokens > KVD_SEG_MAX))
		return fail(err, -EINVAL,
			    "profile segment_tokens %u is not a power of two in [%u, %u]%s",
			    p->segment_tokens, KVD_CTL_SEG_MIN, KVD_SEG_MAX,
			    filled ? "" : " (or 0: the default)");
	seg = seg_tokens(p);
	if ((filled || p->seal_tokens) &&
	    (p->seal_tokens < KVD_CTL_SEAL_MIN || p->seal_tokens > seg))
		return fail(err, -EINVAL,
			    "profile seal_tokens %u out of range [%u, segment_tokens %u]%s",
			    p->seal_tokens, KVD_CTL_SEAL_MIN, seg,
			    filled ? "" : " (or 0: the default)");
	if ((filled || p->chunk_tokens) &&
	    (!p->chunk_tokens || seal_tokens(p) % p->chunk_tokens))
		return fail(err, -EINVAL, "profile chunk_tokens %u does not divide seal_tokens %u%s",
			    p->chunk_tokens, seal_tokens(p), filled ? "" : " (or 0: the default)");
	return 0;
}

void kvd_ctl_profile_defaults(Kvd__Profile *p)
{
	/* seal first: it depends on the segment size the profile asked for. */
	p->seal_tokens = seal_tokens(p);
	p->segment_tokens = seg_tokens(p);
	p->chunk_tokens = chunk_tokens(p);
}

static void dense_set(const Kvd__Profile *p, uint64_t *set)
{
	memset(set, 0, KVD_CTL_LAYERS_MAX / 8);
	for (size_t i = 0; i < p->n_dense_layers; i++) {
		if (p->dense_layers[i] < KVD_CTL_LAYERS_MAX)
			set[p->dense_layers[i] / 64] |= 1ull << (p->dense_layers[i] % 64);
	}
}

int kvd_ctl_profile_equal(const Kvd__Profile *a, const Kvd__Profile *b)
{
	uint64_t da[KVD_CTL_LAYERS_MAX / 64], db[KVD_CTL_LAYERS_MAX / 64];

	if (strcmp(str_or_empty(a->name), str_or_empty(b->name)) ||
	    a->layers != b->layers || a->q_heads != b->q_heads ||
	    a->kv_heads != b->kv_heads || a->head_dim != b->head_dim ||
	    a->k_bits != b->k_bits || a->tables != b->tables ||
	    a->min_collisions != b->min_collisions || a->sink_tokens != b->sink_tokens ||
	    a->window_tokens != b->window_tokens || a->seed != b->seed ||
	    a->kv_dtype != b->kv_dtype || a->estimator != b->estimator ||
	    seg_tokens(a) != seg_tokens(b) || seal_tokens(a) != seal_tokens(b) ||
	    chunk_tokens(a) != chunk_tokens(b))
		return 0;
	dense_set(a, da);
	dense_set(b, db);
	return !memcmp(da, db, sizeof(da));
}

int kvd_ctl_profile_to_geom(const Kvd__Profile *p, struct kvd_geom *g)
{
	g->q_heads = p->q_heads;
	g->kv_heads = p->kv_heads;
	g->d = p->head_dim;
	g->K = p->k_bits;
	g->L = p->tables;
	g->c = p->min_collisions;
	g->kv_dtype = p->kv_dtype;
	g->moments = p->estimator == KVD_EST_HYBRID_LCV;
	return kvd_geom_check(g);
}

int kvd_ctl_profile_get(const Kvd__Profile *m, struct kvd_model *p)
{
	int rc = kvd_ctl_profile_to_geom(m, &p->g);

	snprintf(p->name, sizeof(p->name), "%s", str_or_empty(m->name));
	p->layers = m->layers;
	p->sink = m->sink_tokens;
	p->window = m->window_tokens;
	p->seg_tokens = m->segment_tokens;
	p->seal_tokens = m->seal_tokens;
	p->chunk_tokens = m->chunk_tokens;
	p->seed = m->seed;
	p->estimator = m->estimator;
	return rc;
}

void kvd_ctl_profile_put(const struct kvd_model *p, const uint32_t *dense, size_t n,
			 Kvd__Profile *m)
{
	m->name = (char *)p->name;
	m->layers = p->layers;
	m->q_heads = p->g.q_heads;
	m->kv_heads = p->g.kv_heads;
	m->head_dim = p->g.d;
	m->k_bits = p->g.K;
	m->tables = p->g.L;
	m->min_collisions = p->g.c;
	m->kv_dtype = p->g.kv_dtype;
	m->estimator = p->estimator;
	m->sink_tokens = p->sink;
	m->window_tokens = p->window;
	m->n_dense_layers = n;
	m->dense_layers = (uint32_t *)dense;
	m->seed = p->seed;
	m->segment_tokens = p->seg_tokens;
	m->seal_tokens = p->seal_tokens;
	m->chunk_tokens = p->chunk_tokens;
}

/* Bytes of W for a checked profile: at most 256 * 16 * 1024 * 4 = 16 MiB. */
static size_t w_bytes(const Kvd__Profile *p)
{
	return (size_t)p->head_dim * p->k_bits * p->tables * sizeof(float);
}

int kvd_ctl_profile_w(const Kvd__ProfileReply *r, float *W)
{
	const Kvd__Profile *p = r->profile;

	if (!p || kvd_ctl_check_profile(p, 1, NULL))
		return -KVD_EPROTO;
	if (r->w.len == 0) {
		kvd_lsh_make_w(p->seed, (int)p->head_dim, (int)p->k_bits, (int)p->tables, W);
		return 0;
	}
	if (r->w.len != w_bytes(p) || !r->w.data)
		return -KVD_EPROTO;
	memcpy(W, r->w.data, r->w.len);
	return 0;
}

int kvd_ctl_check_arena(uint64_t slots, uint64_t slot_size, struct kvd_ctl_err *err)
{
	if (slots < 1 || slots > KVD_CTL_SLOTS_MAX)
		return fail(err, -EINVAL, "slots %llu out of range [1, %u]",
			    (unsigned long long)slots, KVD_CTL_SLOTS_MAX);
	if (slot_size % 4096 || slot_size < KVD_CTL_SLOT_MIN || slot_size > KVD_CTL_SLOT_MAX)
		return fail(err, -EINVAL,
			    "slot_size %llu is not a multiple of 4096 in [%llu, %llu]",
			    (unsigned long long)slot_size, KVD_CTL_SLOT_MIN, KVD_CTL_SLOT_MAX);
	/* Both bounded above: no overflow. */
	if (slots * slot_size > KVD_CTL_ARENA_MAX)
		return fail(err, -EINVAL, "slots %llu x slot_size %llu = %llu bytes, above %llu",
			    (unsigned long long)slots, (unsigned long long)slot_size,
			    (unsigned long long)(slots * slot_size), KVD_CTL_ARENA_MAX);
	return 0;
}

const char *kvd_ctl_request_name(Kvd__Request__BodyCase c)
{
	switch (c) {
	case KVD__REQUEST__BODY__NOT_SET:       return "none";
	case KVD__REQUEST__BODY_HELLO:          return "hello";
	case KVD__REQUEST__BODY_PROFILE_CREATE: return "profile_create";
	case KVD__REQUEST__BODY_PROFILE_OPEN:   return "profile_open";
	case KVD__REQUEST__BODY_SEQ_CREATE:     return "seq_create";
	case KVD__REQUEST__BODY_SEQ_FREE:       return "seq_free";
	case KVD__REQUEST__BODY_SEQ_STATS:      return "seq_stats";
	case KVD__REQUEST__BODY_SERVER_STATS:   return "server_stats";
	case KVD__REQUEST__BODY_SEQ_OPEN:       return "seq_open";
	case KVD__REQUEST__BODY_SEQ_EVICT:      return "seq_evict";
	case KVD__REQUEST__BODY_SEQ_PUBLISH:    return "seq_publish";
	case KVD__REQUEST__BODY_CLIENTS:        return "clients";
	case KVD__REQUEST__BODY_SEQ_LIST:       return "seq_list";
	case KVD__REQUEST__BODY_SEQ_ADMIN:      return "seq_admin";
	case KVD__REQUEST__BODY_PROFILES:       return "profiles";
	case KVD__REQUEST__BODY_LIMITS:         return "limits";
	case KVD__REQUEST__BODY_DRAIN:          return "drain";
	case KVD__REQUEST__BODY_SHARES:         return "shares";
	case KVD__REQUEST__BODY_SHARE_DROP:     return "share_drop";
	case KVD__REQUEST__BODY_METRICS:        return "metrics";
	default:                                return "unknown";
	}
}

/* ---- requests ----------------------------------------------------------- */

static int check_hello(const Kvd__Hello *h, struct kvd_ctl_err *err)
{
	int rc;

	if (h->version != KVD_CTL_VERSION)
		return fail(err, -EPROTONOSUPPORT, "protocol version %u not supported, kvd speaks %u",
			    h->version, KVD_CTL_VERSION);
	rc = check_name(h->tenant, "hello tenant", 0, err);
	if (!rc)
		rc = check_name(h->client_name, "hello client_name", 0, err);
	if (rc)
		return rc;
	if (h->slots > KVD_CTL_SLOTS_MAX)
		return fail(err, -EINVAL, "hello slots %u above %u", h->slots, KVD_CTL_SLOTS_MAX);
	if (h->slot_size &&
	    (h->slot_size % 4096 || h->slot_size < KVD_CTL_SLOT_MIN ||
	     h->slot_size > KVD_CTL_SLOT_MAX))
		return fail(err, -EINVAL,
			    "hello slot_size %llu is not a multiple of 4096 in [%llu, %llu] (or 0)",
			    (unsigned long long)h->slot_size, KVD_CTL_SLOT_MIN, KVD_CTL_SLOT_MAX);
	if (h->control && (h->slots || h->slot_size || h->poll))
		return fail(err, -EINVAL,
			    "hello control with slots %u, slot_size %llu, poll %d: a control "
			    "connection has no region (all must be 0)",
			    h->slots, (unsigned long long)h->slot_size, (int)h->poll);
	if (h->slots && h->slot_size) {
		rc = kvd_ctl_check_arena(h->slots, h->slot_size, err);
		if (rc)
			return fail(err, rc, "hello slots %u x slot_size %llu above %llu bytes",
				    h->slots, (unsigned long long)h->slot_size, KVD_CTL_ARENA_MAX);
	}
	return 0;
}

/* A listing's page size: 0 (the most) or up to KVD_CTL_LIST_MAX. */
static int check_limit(uint32_t limit, const char *what, struct kvd_ctl_err *err)
{
	if (limit > KVD_CTL_LIST_MAX)
		return fail(err, -EINVAL, "%s limit %u above %u", what, limit, KVD_CTL_LIST_MAX);
	return 0;
}

static int check_request(const Kvd__Request *r, struct kvd_ctl_err *err)
{
	switch (r->body_case) {
	case KVD__REQUEST__BODY__NOT_SET:
		return fail(err, -EOPNOTSUPP, "request %llu has no body (a request type kvd does not know?)",
			    (unsigned long long)r->id);
	case KVD__REQUEST__BODY_HELLO:
		if (!r->hello)
			break;
		return check_hello(r->hello, err);
	case KVD__REQUEST__BODY_PROFILE_CREATE:
		if (!r->profile_create)
			break;
		if (!r->profile_create->profile)
			return fail(err, -EINVAL, "profile_create without a profile");
		return kvd_ctl_check_profile(r->profile_create->profile, 0, err);
	case KVD__REQUEST__BODY_PROFILE_OPEN:
		if (!r->profile_open)
			break;
		return check_name(r->profile_open->name, "profile_open name", 1, err);
	case KVD__REQUEST__BODY_SEQ_CREATE:
		if (!r->seq_create)
			break;
		if (!r->seq_create->profile_id)
			return fail(err, -EINVAL, "seq_create profile_id is 0");
		if (r->seq_create->content_key.len > KVD_CTL_KEY_MAX)
			return fail(err, -EINVAL, "seq_create content_key of %zu bytes, above %d",
				    r->seq_create->content_key.len, KVD_CTL_KEY_MAX);
		if (r->seq_create->n_attach_keys > KVD_CTL_ATTACH_KEYS_MAX)
			return fail(err, -E2BIG, "seq_create of %zu attach_keys, above %d",
				    r->seq_create->n_attach_keys, KVD_CTL_ATTACH_KEYS_MAX);
		if (r->seq_create->n_attach_keys && r->seq_create->parent)
			return fail(err, -EINVAL, "seq_create with both parent and attach_keys");
		for (size_t i = 0; i < r->seq_create->n_attach_keys; i++)
			if (r->seq_create->attach_keys[i].len != KVD_CTL_CONTENT_KEY)
				return fail(err, -EINVAL, "seq_create attach_keys[%zu] of %zu bytes, not %d",
					    i, r->seq_create->attach_keys[i].len, KVD_CTL_CONTENT_KEY);
		return 0;
	case KVD__REQUEST__BODY_SEQ_PUBLISH:
		if (!r->seq_publish)
			break;
		if (!r->seq_publish->seq)
			return fail(err, -EINVAL, "seq_publish seq is 0");
		if (r->seq_publish->key.len != KVD_CTL_CONTENT_KEY)
			return fail(err, -EINVAL, "seq_publish key of %zu bytes, not %d",
				    r->seq_publish->key.len, KVD_CTL_CONTENT_KEY);
		return 0;
	case KVD__REQUEST__BODY_SEQ_FREE:
		if (!r->seq_free)
			break;
		if (!r->seq_free->seq)
			return fail(err, -EINVAL, "seq_free seq is 0");
		return 0;
	case KVD__REQUEST__BODY_SEQ_STATS:
		if (!r->seq_stats)
			break;
		if (!r->seq_stats->seq)
			return fail(err, -EINVAL, "seq_stats seq is 0");
		return 0;
	case KVD__REQUEST__BODY_SERVER_STATS:
		if (!r->server_stats)
			break;
		return 0;
	case KVD__REQUEST__BODY_SEQ_OPEN:
		if (!r->seq_open)
			break;
		if (!r->seq_open->seq)
			return fail(err, -EINVAL, "seq_open seq is 0");
		return 0;
	case KVD__REQUEST__BODY_SEQ_EVICT:
		if (!r->seq_evict)
			break;
		if (!r->seq_evict->seq)
			return fail(err, -EINVAL, "seq_evict seq is 0");
		return 0;
	case KVD__REQUEST__BODY_CLIENTS:
		if (!r->clients)
			break;
		return check_limit(r->clients->limit, "clients", err);
	case KVD__REQUEST__BODY_SEQ_LIST:
		if (!r->seq_list)
			break;
		if (!r->seq_list->filter_uid && r->seq_list->uid)
			return fail(err, -EINVAL, "seq_list uid %u without filter_uid",
				    r->seq_list->uid);
		return check_limit(r->seq_list->limit, "seq_list", err);
	case KVD__REQUEST__BODY_SEQ_ADMIN:
		if (!r->seq_admin)
			break;
		if (!r->seq_admin->seq)
			return fail(err, -EINVAL, "seq_admin seq is 0");
		if (r->seq_admin->op < KVD__SEQ_ADMIN_OP__SEQ_ADMIN_SHOW ||
		    r->seq_admin->op > KVD__SEQ_ADMIN_OP__SEQ_ADMIN_FREE)
			return fail(err, -EINVAL, "seq_admin op %u is not 1 (show), 2 (evict) or 3 (free)",
				    r->seq_admin->op);
		return 0;
	case KVD__REQUEST__BODY_PROFILES:
		if (!r->profiles)
			break;
		return check_limit(r->profiles->limit, "profiles", err);
	case KVD__REQUEST__BODY_LIMITS:
		if (!r->limits)
			break;
		return 0;
	case KVD__REQUEST__BODY_DRAIN:
		if (!r->drain)
			break;
		return 0;
	case KVD__REQUEST__BODY_SHARES:
		if (!r->shares)
			break;
		return check_limit(r->shares->limit, "shares", err);
	case KVD__REQUEST__BODY_SHARE_DROP:
		if (!r->share_drop)
			break;
		if (r->share_drop->key.len != KVD_CTL_CONTENT_KEY)
			return fail(err, -EINVAL, "share_drop key of %zu bytes, not %d",
				    r->share_drop->key.len, KVD_CTL_CONTENT_KEY);
		return 0;
	case KVD__REQUEST__BODY_METRICS:
		if (!r->metrics)
			break;
		return 0;
	default:
		return fail(err, -EOPNOTSUPP, "request %llu: unknown body %d",
			    (unsigned long long)r->id, (int)r->body_case);
	}
	/* Unpack always allocates the body it names; only a bug gets here. */
	return fail(err, -KVD_EFORMAT, "request %llu: %s body missing", (unsigned long long)r->id,
		    kvd_ctl_request_name(r->body_case));
}

static void err_reset(struct kvd_ctl_err *err)
{
	err->code = 0;
	err->id = 0;
	err->msg[0] = 0;
	err->remote = 0;
}

Kvd__Request *kvd_ctl_decode_request(const void *buf, size_t len, struct kvd_ctl_err *err)
{
	struct kvd_ctl_err dummy;
	Kvd__Request *r;

	if (!err)
		err = &dummy;
	err_reset(err);
	if (len > KVD_CTL_REQ_MAX) {
		fail(err, -EMSGSIZE, "request of %zu bytes, above %u", len, KVD_CTL_REQ_MAX);
		return NULL;
	}
	r = kvd__request__unpack(NULL, len, buf);
	if (!r) {
		fail(err, -KVD_EFORMAT, "%zu bytes that are not a kvd.Request", len);
		return NULL;
	}
	err->id = r->id;
	if (check_request(r, err)) {
		kvd__request__free_unpacked(r, NULL);
		return NULL;
	}
	return r;
}

void kvd_ctl_free_request(Kvd__Request *r)
{
	if (r)
		kvd__request__free_unpacked(r, NULL);
}

/* ---- responses ---------------------------------------------------------- */

static void sanitize(char *s, size_t cap)
{
	size_t n = strnlen(s, cap - 1);

	s[n] = 0;
	for (size_t i = 0; i < n; i++) {
		if (!printable((unsigned char)s[i]))
			s[i] = '?';
	}
}

/* A string from kvd for display: NULL becomes "" (protobuf-c gives the
 * empty default anyway), cut to KVD_CTL_NAME_MAX bytes, made printable. */
static void display_name(char *s)
{
	/* An absent string is protobuf-c's shared, read-only "". */
	if (s && s[0])
		sanitize(s, KVD_CTL_NAME_MAX + 1);
}

static int check_client_list(Kvd__ClientList *l, struct kvd_ctl_err *err)
{
	if (l->n_clients > KVD_CTL_LIST_MAX)
		return fail(err, -KVD_EPROTO, "client list of %zu rows, above %u", l->n_clients,
			    KVD_CTL_LIST_MAX);
	for (size_t i = 0; i < l->n_clients; i++) {
		Kvd__ClientInfo *c = l->clients[i];

		if (!c || !c->client_id)
			return fail(err, -KVD_EPROTO, "client list row %zu: client_id 0", i);
		display_name(c->tenant);
		display_name(c->name);
	}
	return 0;
}

static int check_seq_info(Kvd__SeqInfo *q, struct kvd_ctl_err *err)
{
	if (!q || !q->seq)
		return fail(err, -KVD_EPROTO, "seq info: seq 0");
	if (q->state > 4)
		return fail(err, -KVD_EPROTO, "seq info %llu: state %u unknown",
			    (unsigned long long)q->seq, q->state);
	display_name(q->tenant);
	display_name(q->profile);
	return 0;
}

static int check_profile_list(Kvd__ProfileList *l, struct kvd_ctl_err *err)
{
	struct kvd_ctl_err why;

	if (l->n_profiles > KVD_CTL_LIST_MAX)
		return fail(err, -KVD_EPROTO, "profile list of %zu rows, above %u", l->n_profiles,
			    KVD_CTL_LIST_MAX);
	for (size_t i = 0; i < l->n_profiles; i++) {
		Kvd__ProfileInfo *p = l->profiles[i];

		if (!p || !p->profile_id || !p->profile)
			return fail(err, -KVD_EPROTO, "profile list row %zu: no id or profile", i);
		if (kvd_ctl_check_profile(p->profile, 1, &why))
			return fail(err, -KVD_EPROTO, "profile list row %zu: %.200s", i, why.msg);
		if (p->n_dense > p->profile->layers)
			return fail(err, -KVD_EPROTO, "profile list row %zu: %u dense of %u layers", i,
				    p->n_dense, p->profile->layers);
	}
	return 0;
}

static int check_limits_reply(Kvd__LimitsReply *l, struct kvd_ctl_err *err)
{
	if (l->n_rows > KVD_CTL_LIMIT_ROWS || l->n_uids > KVD_CTL_LIST_MAX)
		return fail(err, -KVD_EPROTO, "limits reply of %zu rows and %zu uids, above %u and %u",
			    l->n_rows, l->n_uids, KVD_CTL_LIMIT_ROWS, KVD_CTL_LIST_MAX);
	for (size_t i = 0; i < l->n_rows; i++) {
		if (!l->rows[i])
			return fail(err, -KVD_EPROTO, "limits reply row %zu missing", i);
		display_name(l->rows[i]->key);
	}
	for (size_t i = 0; i < l->n_uids; i++) {
		if (!l->uids[i])
			return fail(err, -KVD_EPROTO, "limits reply uid row %zu missing", i);
	}
	return 0;
}

static int check_response(Kvd__Response *r, uint64_t want_id, struct kvd_ctl_err *err)
{
	const Kvd__HelloReply *h;
	const Kvd__ProfileReply *p;
	struct kvd_ctl_err why;

	if (r->id != want_id && !(r->id == 0 && r->body_case == KVD__RESPONSE__BODY_ERROR))
		return fail(err, -KVD_EPROTO, "response id %llu, expected %llu",
			    (unsigned long long)r->id, (unsigned long long)want_id);
	switch (r->body_case) {
	case KVD__RESPONSE__BODY__NOT_SET:
		return fail(err, -KVD_EPROTO, "response %llu has no body (a newer kvd?)",
			    (unsigned long long)r->id);
	case KVD__RESPONSE__BODY_ERROR:
		if (!r->error)
			break;
		if (r->error->code >= 0 || r->error->code <= -KVD_ELAST)
			return fail(err, -KVD_EPROTO, "error code %d is not a -errno or -KVD_E*",
				    r->error->code);
		/* The message goes to logs: never raw bytes from the peer. */
		if (!r->error->message || !r->error->message[0])
			return 0;
		sanitize(r->error->message, KVD_CTL_MSG_MAX);
		return 0;
	case KVD__RESPONSE__BODY_HELLO:
		if (!(h = r->hello))
			break;
		if (h->version != KVD_CTL_VERSION)
			return fail(err, -EPROTONOSUPPORT,
				    "kvd answered with protocol version %u, this client speaks %u",
				    h->version, KVD_CTL_VERSION);
		if (!h->client_id)
			return fail(err, -KVD_EPROTO, "hello reply client_id is 0");
		if (h->control) {
			if (h->region_size)
				return fail(err, -KVD_EPROTO,
					    "hello reply control with region_size %llu, expected 0",
					    (unsigned long long)h->region_size);
			return 0;
		}
		if (h->region_size < 4096 || h->region_size % 4096 ||
		    h->region_size > KVD_CTL_REGION_MAX)
			return fail(err, -KVD_EPROTO,
				    "hello reply region_size %llu is not a multiple of 4096 in [4096, %llu]",
				    (unsigned long long)h->region_size, KVD_CTL_REGION_MAX);
		return 0;
	case KVD__RESPONSE__BODY_PROFILE:
		if (!(p = r->profile))
			break;
		if (!p->profile_id)
			return fail(err, -KVD_EPROTO, "profile reply profile_id is 0");
		if (!p->profile)
			return fail(err, -KVD_EPROTO, "profile reply without a profile");
		if (kvd_ctl_check_profile(p->profile, 1, &why))
			return fail(err, -KVD_EPROTO, "profile reply: %.200s", why.msg);
		if (p->w.len && p->w.len != w_bytes(p->profile))
			return fail(err, -KVD_EPROTO,
				    "profile reply w of %zu bytes, expected %zu (head_dim x K x L x 4) or 0",
				    p->w.len, w_bytes(p->profile));
		return 0;
	case KVD__RESPONSE__BODY_SEQ:
		if (!r->seq)
			break;
		if (!r->seq->seq)
			return fail(err, -KVD_EPROTO, "seq reply seq is 0");
		return 0;
	case KVD__RESPONSE__BODY_SEQ_STATS:
		if (!r->seq_stats)
			break;
		return 0;
	case KVD__RESPONSE__BODY_SERVER_STATS:
		if (!r->server_stats)
			break;
		return 0;
	case KVD__RESPONSE__BODY_OK:
		if (!r->ok)
			break;
		return 0;
	case KVD__RESPONSE__BODY_CLIENT_LIST:
		if (!r->client_list)
			break;
		return check_client_list(r->client_list, err);
	case KVD__RESPONSE__BODY_SEQ_LIST:
		if (!r->seq_list)
			break;
		if (r->seq_list->n_seqs > KVD_CTL_LIST_MAX)
			return fail(err, -KVD_EPROTO, "seq list of %zu rows, above %u",
				    r->seq_list->n_seqs, KVD_CTL_LIST_MAX);
		for (size_t i = 0; i < r->seq_list->n_seqs; i++) {
			int rc = check_seq_info(r->seq_list->seqs[i], err);

			if (rc)
				return rc;
		}
		return 0;
	case KVD__RESPONSE__BODY_SEQ_INFO:
		if (!r->seq_info)
			break;
		return check_seq_info(r->seq_info, err);
	case KVD__RESPONSE__BODY_PROFILE_LIST:
		if (!r->profile_list)
			break;
		return check_profile_list(r->profile_list, err);
	case KVD__RESPONSE__BODY_LIMITS:
		if (!r->limits)
			break;
		return check_limits_reply(r->limits, err);
	case KVD__RESPONSE__BODY_SHARE_LIST:
		if (!r->share_list)
			break;
		if (r->share_list->n_shares > KVD_CTL_LIST_MAX)
			return fail(err, -KVD_EPROTO, "share list of %zu rows, above %u",
				    r->share_list->n_shares, KVD_CTL_LIST_MAX);
		for (size_t i = 0; i < r->share_list->n_shares; i++) {
			const Kvd__ShareInfo *x = r->share_list->shares[i];

			if (!x || !x->seq || x->key.len != KVD_CTL_CONTENT_KEY)
				return fail(err, -KVD_EPROTO, "share list row %zu: no id, or a key "
					    "not of %d bytes", i, KVD_CTL_CONTENT_KEY);
			if (x->state > 4)
				return fail(err, -KVD_EPROTO, "share list row %zu: state %u unknown",
					    i, x->state);
		}
		return 0;
	case KVD__RESPONSE__BODY_METRICS:
		if (!r->metrics)
			break;
		/* Text for a terminal: nothing but printable ASCII and newlines. */
		for (char *ch = r->metrics->text; ch && *ch; ch++)
			if (*ch != '\n' && !printable((unsigned char)*ch))
				*ch = '?';
		return 0;
	default:
		return fail(err, -KVD_EPROTO, "response %llu: unknown body %d",
			    (unsigned long long)r->id, (int)r->body_case);
	}
	return fail(err, -KVD_EFORMAT, "response %llu: body missing", (unsigned long long)r->id);
}

Kvd__Response *kvd_ctl_decode_response(const void *buf, size_t len, uint64_t want_id,
				       struct kvd_ctl_err *err)
{
	struct kvd_ctl_err dummy;
	Kvd__Response *r;

	if (!err)
		err = &dummy;
	err_reset(err);
	if (len > KVD_CTL_MAX) {
		fail(err, -EMSGSIZE, "response of %zu bytes, above %u", len, KVD_CTL_MAX);
		return NULL;
	}
	r = kvd__response__unpack(NULL, len, buf);
	if (!r) {
		fail(err, -KVD_EFORMAT, "%zu bytes that are not a kvd.Response", len);
		return NULL;
	}
	err->id = r->id;
	if (check_response(r, want_id, err)) {
		kvd__response__free_unpacked(r, NULL);
		return NULL;
	}
	return r;
}

void kvd_ctl_free_response(Kvd__Response *r)
{
	if (r)
		kvd__response__free_unpacked(r, NULL);
}

/* ---- socket I/O --------------------------------------------------------- */

union cmsg_buf {
	struct cmsghdr align;
	char buf[CMSG_SPACE(sizeof(int) * KVD_CTL_MAX_FDS)];
};

_Thread_local int kvd_ctl_sent_code;

#define DEFER_MAX 16            /* a burst of control requests is 8 */

static _Thread_local struct {
	int fd;                 /* deferring sends to it; -1: none */
	unsigned n;
	struct {
		uint8_t *buf;
		size_t len;
	} q[DEFER_MAX];
} dq = { .fd = -1 };

static int send_one(int fd, const uint8_t *buf, size_t n, const int *fds, int nfds)
{
	union cmsg_buf cb;
	struct iovec iov = { (void *)buf, n };
	struct msghdr mh = { 0 };
	ssize_t w;

	mh.msg_iov = &iov;
	mh.msg_iovlen = 1;
	if (nfds) {
		struct cmsghdr *c;

		memset(&cb, 0, sizeof(cb));
		mh.msg_control = cb.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
		c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
	}
	do
		w = sendmsg(fd, &mh, MSG_NOSIGNAL);
	while (w < 0 && errno == EINTR);
	/* SEQPACKET sends all or nothing; a short count would be a kernel bug. */
	return w < 0 ? -errno : (size_t)w == n ? 0 : -EIO;
}

void kvd_ctl_defer(int fd)
{
	dq.fd = fd;
}

unsigned kvd_ctl_deferred(void)
{
	return dq.n;
}

/* Sends the kept replies, in order; the rest dropped after a failure. */
static int send_kept(void)
{
	int rc = 0;

	for (unsigned i = 0; i < dq.n; i++) {
		if (!rc)
			rc = send_one(dq.fd, dq.q[i].buf, dq.q[i].len, NULL, 0);
		free(dq.q[i].buf);
	}
	dq.n = 0;
	return rc;
}

int kvd_ctl_flush(void)
{
	int rc = send_kept();

	dq.fd = -1;
	return rc;
}

int kvd_ctl_send(int fd, const ProtobufCMessage *msg, const int *fds, int nfds)
{
	uint8_t small[4096], *buf = small;
	size_t n;
	int rc;

	if (nfds < 0 || nfds > KVD_CTL_MAX_FDS || (nfds && !fds))
		return -EINVAL;
	n = protobuf_c_message_get_packed_size(msg);
	/* An empty datagram would read as EOF on the other side. */
	if (n == 0 || n > KVD_CTL_MAX)
		return -EMSGSIZE;
	int deferred = fd >= 0 && fd == dq.fd;
	int keep = deferred && !nfds && n <= KVD_CTL_DEFER_BYTES && dq.n < DEFER_MAX;

	if ((n > sizeof(small) || keep) && !(buf = malloc(n)))
		return -ENOMEM;
	protobuf_c_message_pack(msg, buf);
	if (keep) {
		dq.q[dq.n].buf = buf;
		dq.q[dq.n++].len = n;
		rc = 0;
	} else {
		/* what was kept for fd goes first */
		rc = deferred ? send_kept() : 0;
		if (!rc)
			rc = send_one(fd, buf, n, fds, nfds);
	}
	if (msg->descriptor == &kvd__response__descriptor) {
		const Kvd__Response *r = (const Kvd__Response *)msg;

		kvd_ctl_sent_code = r->body_case == KVD__RESPONSE__BODY_ERROR && r->error ?
				    r->error->code : 0;
	}
	if (buf != small && !keep)
		free(buf);
	return rc;
}

int kvd_ctl_recv(int fd, void *buf, size_t cap, int *fds, int *nfds)
{
	union cmsg_buf cb;
	struct iovec iov = { buf, cap > INT_MAX ? INT_MAX : cap };
	struct msghdr mh = { 0 };
	int room = fds && nfds && *nfds > 0 ? *nfds : 0, got = 0, over = 0;
	ssize_t r;

	if (nfds)
		*nfds = 0;
	mh.msg_iov = &iov;
	mh.msg_iovlen = 1;
	mh.msg_control = cb.buf;
	mh.msg_controllen = sizeof(cb.buf);
	do
		r = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return -errno;

	/* Take every fd that came, wanted or not: an fd left in a cmsg we do
	 * not look at would leak into this process. */
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		size_t k;

		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
		    c->cmsg_len < CMSG_LEN(0))
			continue;
		k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k; i++) {
			int f;

			memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
			if (got < room) {
				fds[got++] = f;
			} else {
				close(f);
				over = 1;
			}
		}
	}
	if (over || r == 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
		for (int i = 0; i < got; i++) {
			close(fds[i]);
			fds[i] = -1;
		}
		/* A zero-length datagram is not a message: EOF. */
		return r == 0 && !over && !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ? 0 : -EMSGSIZE;
	}
	if (nfds)
		*nfds = got;
	return (int)r;
}

int kvd_ctl_send_error(int fd, uint64_t id, int code, const char *fmt, ...)
{
	Kvd__Response resp = KVD__RESPONSE__INIT;
	Kvd__Error e = KVD__ERROR__INIT;
	char m[KVD_CTL_MSG_MAX];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(m, sizeof(m), fmt, ap);
	va_end(ap);
	sanitize(m, sizeof(m));
	e.code = code < 0 && code > -KVD_ELAST ? code : -KVD_EPROTO;
	e.message = m;
	resp.id = id;
	resp.body_case = KVD__RESPONSE__BODY_ERROR;
	resp.error = &e;
	return kvd_ctl_send(fd, &resp.base, NULL, 0);
}

int kvd_ctl_send_ok(int fd, uint64_t id)
{
	Kvd__Response resp = KVD__RESPONSE__INIT;
	Kvd__Ok ok = KVD__OK__INIT;

	resp.id = id;
	resp.body_case = KVD__RESPONSE__BODY_OK;
	resp.ok = &ok;
	return kvd_ctl_send(fd, &resp.base, NULL, 0);
}

static int readable(int fd, int ms)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	int n;

	do
		n = poll(&p, 1, ms);
	while (n < 0 && errno == EINTR);
	return n < 0 ? -errno : n;
}

static Kvd__Response *call_fail(struct kvd_ctl_err *err, int *fds, int *nfds, int code,
				const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static Kvd__Response *call_fail(struct kvd_ctl_err *err, int *fds, int *nfds, int code,
				const char *fmt, ...)
{
	va_list ap;

	for (int i = 0; nfds && i < *nfds; i++)
		close(fds[i]);
	if (nfds)
		*nfds = 0;
	err->code = code;
	va_start(ap, fmt);
	vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
	va_end(ap);
	return NULL;
}

Kvd__Response *kvd_ctl_call(int fd, Kvd__Request *rq, Kvd__Response__BodyCase want, void *rx,
			    int timeout_ms, int *fds, int *nfds, struct kvd_ctl_err *err)
{
	const char *what = kvd_ctl_request_name(rq->body_case);
	int room = fds && nfds ? *nfds : 0, sent, n;
	struct kvd_ctl_err dummy;
	Kvd__Response *r;

	if (!err)
		err = &dummy;
	err_reset(err);
	if (nfds)
		*nfds = 0;
	sent = kvd_ctl_send(fd, &rq->base, NULL, 0);
	if (sent && sent != -EPIPE && sent != -ECONNRESET)
		return call_fail(err, NULL, NULL, sent, "sending %s: %s", what, kvd_strerror(sent));
	/* Gone already: only what kvd queued before closing is left to read. */
	n = readable(fd, sent ? 0 : timeout_ms);
	if (n == 0 && !sent)
		return call_fail(err, NULL, NULL, -ETIMEDOUT, "no answer to %s within %d ms", what,
				 timeout_ms);
	if (n > 0) {
		if (nfds)
			*nfds = room;
		n = kvd_ctl_recv(fd, rx, KVD_CTL_RX_MAX, fds, nfds);
	}
	/* kvd closing a connection it refused, with our request unread, shows
	 * as ECONNRESET first; the reason it queued before closing comes next. */
	if (n == -ECONNRESET && readable(fd, 100) > 0) {
		if (nfds)
			*nfds = room;
		n = kvd_ctl_recv(fd, rx, KVD_CTL_RX_MAX, fds, nfds);
	}
	if (n == 0 || n == -ECONNRESET)
		return call_fail(err, fds, nfds, -EPIPE, "kvd closed the connection before "
				 "answering %s", what);
	if (n < 0)
		return call_fail(err, fds, nfds, n, "receiving the answer to %s: %s", what,
				 kvd_strerror(n));
	r = kvd_ctl_decode_response(rx, (size_t)n, rq->id, err);
	if (!r) {
		char why[KVD_CTL_MSG_MAX];

		memcpy(why, err->msg, sizeof(why));
		return call_fail(err, fds, nfds, err->code, "kvd's answer to %s does not decode: "
				 "%.200s", what, why);
	}
	if (!want || r->body_case == want)
		return r;
	err->id = r->id;
	err->remote = r->body_case == KVD__RESPONSE__BODY_ERROR;
	if (err->remote)
		call_fail(err, fds, nfds, r->error->code, "%s", r->error->message);
	else
		call_fail(err, fds, nfds, -KVD_EPROTO, "kvd answered %s with another kind of "
			  "reply (body %d)", what, (int)r->body_case);
	kvd_ctl_free_response(r);
	return NULL;
}
