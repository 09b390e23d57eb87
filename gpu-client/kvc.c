/* libkvclient: the API of kvc.h and its CPU backend, which computes with
 * kvd's own engine (hashing, prep, attention) in the calling thread.  The
 * connection is the transport's (kvt.h); the CUDA backend (kvg.h) sits on
 * the same transport and gets the calls this file does not compute. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <xxhash.h>

#include "engine/attn.h"
#include "engine/bf16.h"
#include "engine/err.h"
#include "kvc.h"
#include "proto/kvd_ring.h"
#include "kvg.h"
#include "kvg_plan.h"
#include "kvt.h"
#include "engine/lsh.h"
#include "engine/prep.h"


struct kvc_layer {
	float *mean;                    /* [H][d]; NULL: dense layer or not prefilled */
	uint16_t *k, *v;                /* [H][cap][d]: sinks, then recent tokens */
	uint32_t n, cap, nsink;
	int prefilled;
	uint64_t tokens;                /* the layer's length: here and in kvd */
};

struct kvc {
	struct kvt *t;                  /* the connection, profile included */
	struct kvg *gpu;                /* CUDA backend (kvg_cuda.c), else NULL */
	const struct kvd_kern *kk;
	/* the transport's profile, cached: NULL until kvc_profile */
	const struct kvc_model *m;
	const struct kvd_geom *g;
	const float *W;
};

const char *kvc_last_error(const struct kvc *c)
{
	return c->t ? kvt_error(c->t) : "out of memory";
}

int kvc_connect(const struct kvc_opts *o, struct kvc **out)
{
	struct kvc *c = calloc(1, sizeof *c);
	char msg[256];
	int rc, backend;

	if (!c)
		return -ENOMEM;
	c->kk = kvd_kern_get();
	*out = c;                       /* so kvc_last_error works on failure */
	if (!(c->t = kvt_new()))
		return -ENOMEM;
	if ((backend = kvg_choose(o, msg, sizeof msg)) < 0)
		return kvt_fail(c->t, backend, "%s", msg);
	if ((rc = kvt_connect(c->t, o)))
		return rc;
	if (backend == KVC_BACKEND_CUDA)
		return kvg_open(c->t, o, &c->gpu);
	return 0;
}

void kvc_close(struct kvc *c)
{
	if (!c)
		return;
	kvg_close(c->gpu);              /* unregisters the region: before munmap */
	kvt_close(c->t);
	free(c);
}

int kvc_profile(struct kvc *c, const struct kvc_model *m)
{
	int rc = kvt_profile(c->t, m);

	if (rc)
		return rc;
	c->m = kvt_model(c->t);
	c->g = kvt_geom(c->t);
	c->W = kvt_w(c->t);
	return c->gpu ? kvg_profile(c->t, c->gpu) : 0;
}

const struct kvc_model *kvc_model_of(const struct kvc *c)
{
	return c->m;
}

const float *kvc_w(const struct kvc *c)
{
	return kvt_w(c->t);
}

int kvc_nop(struct kvc *c)
{
	return kvt_nop(c->t);
}

/* ---- sequences --------------------------------------------------------- */

static struct kvc_seq *seq_new(struct kvc *c, uint64_t id)
{
	struct kvc_seq *s = calloc(1, sizeof *s);

	if (s)
		s->ly = calloc(c->m->layers, sizeof *s->ly);
	if (!s || !s->ly) {
		free(s ? s->ly : NULL);
		free(s);
		return NULL;
	}
	s->id = id;
	return s;
}

int kvc_seq_create(struct kvc *c, struct kvc_seq **out)
{
	uint64_t id;
	int rc = kvt_seq_create(c->t, &id);

	if (rc)
		return rc;
	if (!(*out = seq_new(c, id)))
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	return 0;
}

static void free_layers(struct kvc *c, struct kvc_seq *s);

int kvc_seq_fork(struct kvc *c, const struct kvc_seq *parent, struct kvc_seq **out)
{
	size_t H, d;
	uint64_t id;
	struct kvc_seq *s;
	int rc;

	if (parent->reopened)
		return kvt_fail(c->t, -EINVAL, "fork: a reopened sequence has no local part");
	H = c->g->kv_heads;
	d = c->g->d;
	if ((rc = kvt_seq_fork(c->t, parent->id, &id)))
		return rc;
	if (!(s = seq_new(c, id))) {
		kvt_seq_free(c->t, id);
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	}
	if (c->gpu) {
		if ((rc = kvg_seq_fork(c->t, c->gpu, parent, s))) {
			kvt_seq_free(c->t, id);
			free_layers(c, s);
			free(s);
			return rc;
		}
		*out = s;
		return 0;
	}
	for (uint32_t l = 0; l < c->m->layers; l++) {
		const struct kvc_layer *a = &parent->ly[l];
		struct kvc_layer *b = &s->ly[l];

		*b = (struct kvc_layer){ .n = a->n, .cap = a->cap, .nsink = a->nsink,
					 .prefilled = a->prefilled, .tokens = a->tokens };
		if (a->mean && (b->mean = malloc(H * d * sizeof *b->mean)))
			memcpy(b->mean, a->mean, H * d * sizeof *b->mean);
		if (a->k && (b->k = malloc(H * a->cap * d * sizeof *b->k)))
			memcpy(b->k, a->k, H * a->cap * d * sizeof *b->k);
		if (a->v && (b->v = malloc(H * a->cap * d * sizeof *b->v)))
			memcpy(b->v, a->v, H * a->cap * d * sizeof *b->v);
		if ((a->mean && !b->mean) || (a->k && !b->k) || (a->v && !b->v)) {
			kvt_seq_free(c->t, id);
			free_layers(c, s);
			free(s);
			return kvt_fail(c->t, -ENOMEM, "out of memory");
		}
	}
	*out = s;
	return 0;
}

uint64_t kvc_seq_id(const struct kvc_seq *s)
{
	return s->id;
}

static void free_layers(struct kvc *c, struct kvc_seq *s)
{
	for (uint32_t l = 0; s->ly && l < c->m->layers; l++) {
		free(s->ly[l].mean);
		free(s->ly[l].k);
		free(s->ly[l].v);
	}
	free(s->ly);
}

int kvc_seq_free(struct kvc *c, struct kvc_seq *s)
{
	int rc = kvt_seq_free(c->t, s->id);

	if (c->gpu)
		kvg_seq_free(c->t, c->gpu, s->gs);
	free_layers(c, s);
	free(s);
	return rc;
}

static int local_reserve(struct kvc *c, struct kvc_layer *l, uint32_t need)
{
	size_t H = c->g->kv_heads, d = c->g->d;
	uint32_t cap = l->cap ? l->cap : 64;

	if (need <= l->cap)
		return 0;
	while (cap < need)
		cap *= 2;
	uint16_t *nk = malloc(H * cap * d * 2), *nv = malloc(H * cap * d * 2);

	if (!nk || !nv) {
		free(nk);
		free(nv);
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	}
	for (size_t h = 0; h < H && l->n; h++) {
		memcpy(nk + h * cap * d, l->k + h * l->cap * d, (size_t)l->n * d * 2);
		memcpy(nv + h * cap * d, l->v + h * l->cap * d, (size_t)l->n * d * 2);
	}
	free(l->k);
	free(l->v);
	l->k = nk;
	l->v = nv;
	l->cap = cap;
	return 0;
}

/* Appends tokens [t0, t0+cnt) of k, v ([H][n][d]) to the local rows,
 * centered with l->mean (NULL: as they are) and rounded to bf16 the same way
 * kvd_prep_rows rounds what goes to kvd. */
static int local_put(struct kvc *c, struct kvc_layer *l, const float *k, const float *v,
		     uint32_t n, uint32_t t0, uint32_t cnt)
{
	size_t H = c->g->kv_heads, d = c->g->d;
	int rc = local_reserve(c, l, l->n + cnt);

	if (rc)
		return rc;
	for (size_t h = 0; h < H; h++) {
		const float *m = l->mean ? l->mean + h * d : NULL;

		for (uint32_t i = 0; i < cnt; i++) {
			const float *kr = k + (h * n + t0 + i) * d, *vr = v + (h * n + t0 + i) * d;
			uint16_t *kd = l->k + (h * l->cap + l->n + i) * d;
			uint16_t *vd = l->v + (h * l->cap + l->n + i) * d;

			for (size_t e = 0; e < d; e++) {
				kd[e] = kvd_f32_to_bf16(m ? kr[e] - m[e] : kr[e]);
				vd[e] = kvd_f32_to_bf16(vr[e]);
			}
		}
	}
	l->n += cnt;
	return 0;
}

int kvc_prefill(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
		const float *v, uint32_t n)
{
	const uint32_t H = c->g->kv_heads, d = c->g->d, L = c->g->L;
	struct kvc_layer *l;
	uint32_t chunk, lo, hi;
	float *x;
	int rc;

	if (c->gpu)
		return kvg_prefill_host(c->t, c->gpu, s, layer, k, v, n);
	if (!c->m || layer >= c->m->layers)
		return kvt_fail(c->t, -EINVAL, "layer %u out of range", layer);
	l = &s->ly[layer];
	if (l->prefilled)
		return kvt_fail(c->t, -EALREADY, "layer %u already prefilled", layer);
	l->prefilled = 1;
	l->tokens = n;
	if (kvt_dense(c->t, layer))
		return local_put(c, l, k, v, n, 0, n);

	l->nsink = n < c->m->sink ? n : c->m->sink;
	lo = l->nsink;
	hi = n - lo > c->m->window ? n - c->m->window : lo;
	l->mean = malloc((size_t)H * d * sizeof *l->mean);
	if (!l->mean)
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	kvd_prep_mean(k, H, d, n, lo, hi, l->mean);
	if ((rc = local_put(c, l, k, v, n, 0, lo)) || (rc = local_put(c, l, k, v, n, hi, n - hi)))
		return rc;

	chunk = kvd_rows_fit(H, d, L, kvt_slot_size(c->t));
	if (chunk == 0)
		return kvt_fail(c->t, -EMSGSIZE, "slots of %llu bytes hold no token",
				(unsigned long long)kvt_slot_size(c->t));
	x = malloc((size_t)chunk * d * sizeof *x);
	if (!x)
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	for (uint32_t t = lo; t < hi || t == lo; t += chunk) {
		uint32_t cnt = hi - t < chunk ? hi - t : chunk;
		int first = t == lo, last = t + cnt >= hi;
		int slot = kvt_slot_get(c->t, 1);

		if (slot < 0) {
			free(x);
			return slot;
		}
		char *base = kvt_slot(c->t, (uint32_t)slot);
		const struct kvd_rows_layout lay = kvd_rows_layout(H, d, L, cnt, first);
		struct kvd_sqe e = {
			.op = KVD_OP_PREFILL, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
			.user_data = (uint64_t)slot, .seq = s->id, .len = (uint32_t)lay.bytes, .ntok = cnt,
			.flags = (uint8_t)((first ? KVD_RF_MEAN : 0) | (last ? KVD_RF_LAST : 0)),
		};

		if (first)
			memcpy(base, l->mean, (size_t)H * d * sizeof(float));
		/* Rows go straight into the slot: the arena is the only copy. */
		kvd_prep_rows(c->g, c->W, l->mean, k, v, n, t, cnt, (uint16_t *)(base + lay.k),
			      (uint16_t *)(base + lay.v), (uint16_t *)(base + lay.codes), x);
		if ((rc = kvt_submit(c->t, &e))) {
			free(x);
			return rc;
		}
		if (last)
			break;
	}
	free(x);
	return kvt_drain(c->t, "prefill");
}

/* Sends the oldest `cnt` recent rows of a sparse layer to kvd. */
static int evict(struct kvc *c, struct kvc_seq *s, uint32_t layer, uint32_t cnt)
{
	struct kvc_layer *l = &s->ly[layer];
	const uint32_t H = c->g->kv_heads, d = c->g->d, L = c->g->L;
	const struct kvd_rows_layout lay = kvd_rows_layout(H, d, L, cnt, 0);
	float *x;
	int slot, rc;

	/* Checked before a slot is taken: an error return must not keep one. */
	if (lay.bytes > kvt_slot_size(c->t))
		return kvt_fail(c->t, -EMSGSIZE, "slots too small for %u appended tokens", cnt);
	x = malloc((size_t)cnt * d * sizeof *x);
	if (!x)
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	slot = kvt_slot_get(c->t, 1);
	if (slot < 0) {
		free(x);
		return slot;
	}

	char *base = kvt_slot(c->t, (uint32_t)slot);
	uint16_t *kb = (uint16_t *)(base + lay.k), *vb = (uint16_t *)(base + lay.v);
	uint16_t *codes = (uint16_t *)(base + lay.codes);

	for (uint32_t h = 0; h < H; h++) {
		const uint16_t *src_k = l->k + ((size_t)h * l->cap + l->nsink) * d;
		const uint16_t *src_v = l->v + ((size_t)h * l->cap + l->nsink) * d;

		memcpy(kb + (size_t)h * cnt * d, src_k, (size_t)cnt * d * 2);
		memcpy(vb + (size_t)h * cnt * d, src_v, (size_t)cnt * d * 2);
		kvd_bf16_to_f32_n(x, src_k, (size_t)cnt * d);
		kvd_lsh_hash(c->W, (int)d, (int)c->g->K, (int)L, x, d, cnt,
			     codes + (size_t)h * L * cnt, cnt);
		/* the window slides down over the evicted rows */
		memmove(l->k + ((size_t)h * l->cap + l->nsink) * d, src_k + (size_t)cnt * d,
			(size_t)(l->n - l->nsink - cnt) * d * 2);
		memmove(l->v + ((size_t)h * l->cap + l->nsink) * d, src_v + (size_t)cnt * d,
			(size_t)(l->n - l->nsink - cnt) * d * 2);
	}
	free(x);
	l->n -= cnt;

	struct kvd_sqe e = {
		.op = KVD_OP_APPEND, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
		.user_data = (uint64_t)slot, .seq = s->id, .len = (uint32_t)lay.bytes, .ntok = cnt,
	};

	if ((rc = kvt_submit(c->t, &e)))
		return rc;
	return kvt_drain(c->t, "append");
}

int kvc_append(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k, const float *v)
{
	struct kvc_layer *l;
	int rc;

	if (c->gpu)
		return kvg_append_host(c->t, c->gpu, s, layer, k, v);
	if (!c->m || layer >= c->m->layers)
		return kvt_fail(c->t, -EINVAL, "layer %u out of range", layer);
	l = &s->ly[layer];
	if (s->reopened)
		return kvt_fail(c->t, -EINVAL, "sequence %llu was reopened: its window did not "
				"survive, so it can be attended but not extended",
				(unsigned long long)s->id);
	if (!l->prefilled)
		return kvt_fail(c->t, -EINVAL, "layer %u: append before prefill", layer);
	if ((rc = local_put(c, l, k, v, 1, 0, 1)))
		return rc;
	l->tokens++;
	if (!kvt_dense(c->t, layer) && l->n - l->nsink >= c->m->window + KVG_APPEND_BATCH)
		return evict(c, s, layer, KVG_APPEND_BATCH);
	return 0;
}

/* ---- attention --------------------------------------------------------- */

struct batch {
	int slot;
	uint32_t first, nseq;
};

/* Submits kvd's part for seqs[0..nseq) in as many slots as it takes. */
static int attend_submit(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs,
			 uint32_t nseq, const float *q, struct batch *b, uint32_t *nb)
{
	const uint32_t Hq = c->g->q_heads, d = c->g->d, L = c->g->L;
	const struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, L);
	uint32_t per = kvd_attend_fit(Hq, d, L, kvt_slot_size(c->t));
	int rc;

	if (per == 0)
		return kvt_fail(c->t, -EMSGSIZE, "slots too small for one query");
	*nb = 0;
	for (uint32_t i = 0; i < nseq; i += per) {
		uint32_t cnt = nseq - i < per ? nseq - i : per;
		int slot = kvt_slot_get(c->t, 0);

		if (slot < 0)
			return slot;
		char *base = kvt_slot(c->t, (uint32_t)slot);

		for (uint32_t j = 0; j < cnt; j++) {
			char *rec = base + j * lay.in;
			const float *qs = q + (size_t)(i + j) * Hq * d;

			memset(rec, 0, KVD_ATTEND_HDR);
			memcpy(rec, &seqs[i + j]->id, sizeof(uint64_t));
			memcpy(rec + lay.q_off, qs, (size_t)Hq * d * sizeof(float));
			kvd_prep_query_codes(c->g, c->W, qs, (uint16_t *)(rec + lay.codes_off));
		}
		struct kvd_sqe e = {
			.op = KVD_OP_ATTEND, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
			.user_data = (uint64_t)slot, .len = (uint32_t)(cnt * lay.in), .nseq = cnt,
			.out_off = (uint32_t)kvd_attend_out_off(&lay, cnt),
			.out_len = (uint32_t)(cnt * lay.out),
		};

		b[*nb] = (struct batch){ slot, i, cnt };
		++*nb;
		if ((rc = kvt_submit(c->t, &e)))
			return rc;
	}
	return 0;
}

/* Waits for batch b and hands its (o, lse) per sequence to fn. */
static int attend_collect(struct kvc *c, const struct batch *b, float *o, float *lse, int merge)
{
	const uint32_t Hq = c->g->q_heads, d = c->g->d, G = kvd_geom_group(c->g);
	const struct kvd_attend_layout lay = kvd_attend_layout(Hq, d, c->g->L);
	int32_t res;
	const char *msg;
	int rc = kvt_wait_slot(c->t, (uint32_t)b->slot, &res, &msg);

	if (rc)
		return rc;
	if (res < 0) {
		rc = kvt_fail(c->t, res, "attend: kvd: %s", msg);
		kvt_slot_put(c->t, (uint32_t)b->slot);
		return rc;
	}
	const char *out = (const char *)kvt_slot(c->t, (uint32_t)b->slot) +
			  kvd_attend_out_off(&lay, b->nseq);

	for (uint32_t j = 0; j < b->nseq; j++) {
		const float *ko = (const float *)(out + j * lay.out);
		const float *kl = (const float *)(out + j * lay.out + lay.lse_off);
		float *oo = o + (size_t)(b->first + j) * Hq * d, *ll = lse + (size_t)(b->first + j) * Hq;

		if (merge) {
			for (uint32_t h = 0; h < Hq; h += G)
				kvd_attn_merge(oo + (size_t)h * d, ll + h, ko + (size_t)h * d, kl + h,
					       (int)G, (int)d);
		} else {
			memcpy(oo, ko, (size_t)Hq * d * sizeof(float));
			memcpy(ll, kl, (size_t)Hq * sizeof(float));
		}
	}
	kvt_slot_put(c->t, (uint32_t)b->slot);
	return 0;
}

/* The client's exact part: every local row of every sequence. */
static void attend_local(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs,
			 uint32_t nseq, const float *q, float *o, float *lse)
{
	const uint32_t Hq = c->g->q_heads, d = c->g->d, G = kvd_geom_group(c->g);
	float s[KVD_ATTN_DENSE_SCRATCH];

	for (uint32_t i = 0; i < nseq; i++) {
		const struct kvc_layer *l = &seqs[i]->ly[layer];

		for (uint32_t h = 0; h < c->g->kv_heads; h++) {
			size_t qo = ((size_t)i * Hq + (size_t)h * G) * d;

			kvd_attn_dense(c->kk, q + qo, (int)G, (int)d, l->k ? l->k + (size_t)h * l->cap * d : NULL,
				       l->v ? l->v + (size_t)h * l->cap * d : NULL, l->n, o + qo,
				       lse + (size_t)i * Hq + (size_t)h * G, s);
		}
	}
}

static int attend(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		  const float *q, float *o, float *lse, int kvd_only)
{
	struct batch *b;
	uint32_t nb = 0;
	float *lbuf = NULL;
	int rc = 0;

	if (c->gpu)
		return kvg_attend_host(c->t, c->gpu, layer, seqs, nseq, q, o, lse, kvd_only);
	if (!c->m || layer >= c->m->layers)
		return kvt_fail(c->t, -EINVAL, "layer %u out of range", layer);
	for (uint32_t i = 0; i < nseq; i++)
		if (!seqs[i]->ly[layer].prefilled)
			return kvt_fail(c->t, -EINVAL, "layer %u of sequence %u not prefilled", layer, i);
	if (!lse) {
		lbuf = malloc((size_t)nseq * c->g->q_heads * sizeof *lbuf);
		if (!lbuf)
			return kvt_fail(c->t, -ENOMEM, "out of memory");
		lse = lbuf;
	}
	if (kvt_dense(c->t, layer)) {
		if (kvd_only)
			rc = kvt_fail(c->t, -EINVAL, "layer %u is dense: kvd holds nothing", layer);
		else
			attend_local(c, layer, seqs, nseq, q, o, lse);
		free(lbuf);
		return rc;
	}
	b = malloc((nseq + 1) * sizeof *b);
	if (!b) {
		free(lbuf);
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	}
	rc = attend_submit(c, layer, seqs, nseq, q, b, &nb);
	/* kvd works on its part while we do ours. */
	if (!rc && !kvd_only)
		attend_local(c, layer, seqs, nseq, q, o, lse);
	for (uint32_t i = 0; i < nb; i++) {
		int r2 = attend_collect(c, &b[i], o, lse, !kvd_only);

		rc = rc ? rc : r2;
	}
	free(b);
	free(lbuf);
	return rc;
}

int kvc_attend(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
	       const float *q, float *o, float *lse)
{
	return attend(c, layer, seqs, nseq, q, o, lse, 0);
}

int kvc_attend_kvd(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const float *q, float *o, float *lse)
{
	return attend(c, layer, seqs, nseq, q, o, lse, 1);
}

/* ---- stats and tiers ------------------------------------------------------ */

int kvc_server_stats(struct kvc *c, struct kvc_stats *st)
{
	return kvt_server_stats(c->t, st);
}

int kvc_seq_stats(struct kvc *c, const struct kvc_seq *s, struct kvc_seq_stats *st)
{
	return kvt_seq_stats(c->t, s->id, st);
}

int kvc_seq_open(struct kvc *c, uint64_t id, struct kvc_seq **out, uint64_t *tokens)
{
	struct kvc_seq *s;
	uint64_t n;
	int rc = kvt_seq_open(c->t, id, &n);

	if (rc)
		return rc;
	if (!(s = seq_new(c, id)))
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	s->reopened = 1;
	for (uint32_t l = 0; l < c->m->layers; l++)
		s->ly[l].prefilled = 1;
	if (tokens)
		*tokens = n;
	*out = s;
	return 0;
}

/* ---- prefix sharing --------------------------------------------------- */

uint32_t kvc_chunk_tokens(const struct kvc *c)
{
	return kvt_chunk_tokens(c->t);
}

int kvc_content_keys(const struct kvc *c, const uint32_t *tokens, size_t n, uint8_t *keys)
{
	const uint32_t chunk = kvt_chunk_tokens(c->t);
	XXH128_canonical_t prev = { { 0 } };
	XXH3_state_t *st;
	size_t nk;

	if (!chunk)
		return kvt_fail(c->t, -EOPNOTSUPP, "kvd has no content keys (or no profile yet)");
	nk = n / chunk;
	if (nk > INT32_MAX)
		return kvt_fail(c->t, -E2BIG, "%zu chunks", nk);
	if (!(st = XXH3_createState()))
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	/* key_i = XXH3-128(key_{i-1}, profile name, seed, chunk, token ids of
	 * chunk i), little-endian fields; key_{-1} is 16 zero bytes.  The
	 * namespace is kvd's to apply: it files keys per uid or group. */
	for (size_t i = 0; i < nk; i++) {
		const char *name = c->m->name;
		uint64_t seed = c->m->seed;

		XXH3_128bits_reset(st);
		XXH3_128bits_update(st, &prev, sizeof prev);
		XXH3_128bits_update(st, name, strlen(name) + 1);
		XXH3_128bits_update(st, &seed, sizeof seed);
		XXH3_128bits_update(st, &chunk, sizeof chunk);
		XXH3_128bits_update(st, tokens + i * chunk, (size_t)chunk * sizeof *tokens);
		XXH128_canonicalFromHash(&prev, XXH3_128bits_digest(st));
		memcpy(keys + i * KVC_KEY_BYTES, &prev, KVC_KEY_BYTES);
	}
	XXH3_freeState(st);
	return (int)nk;
}

int kvc_share_stats(struct kvc *c, struct kvc_share_stats *st)
{
	return kvt_share_stats(c->t, st);
}

uint64_t kvc_seq_tokens(const struct kvc_seq *s, uint32_t layer)
{
	if (s->gs)
		return kvg_layer_tokens(s, layer);
	return s->ly ? s->ly[layer].tokens : 0;
}

int kvc_seq_layer(const struct kvc_seq *s, uint32_t layer, uint64_t *start, uint64_t *end,
		  const float **mean)
{
	const struct kvc_layer *l;

	if (s->gs || !s->ly)
		return -ENOTSUP;
	l = &s->ly[layer];
	*start = l->mean ? l->nsink : 0;
	*end = l->mean ? l->tokens - (l->n - l->nsink) : 0;
	if (mean)
		*mean = l->mean;
	return 0;
}

int kvc_seq_publish(struct kvc *c, struct kvc_seq *s, const uint8_t *key)
{
	uint64_t n;
	int rc;

	if (s->reopened)
		return kvt_fail(c->t, -EINVAL, "publish: a reopened sequence has no local part");
	if (c->gpu)
		return kvg_seq_publish(c->t, c->gpu, s, key);
	n = s->ly[0].tokens;
	for (uint32_t l = 0; l < c->m->layers; l++) {
		if (!s->ly[l].prefilled)
			return kvt_fail(c->t, -EINVAL, "publish: layer %u not prefilled", l);
		if (s->ly[l].tokens != n)
			return kvt_fail(c->t, -EINVAL, "publish: layer %u has %llu tokens, layer 0 %llu",
					l, (unsigned long long)s->ly[l].tokens,
					(unsigned long long)n);
	}
	/* What kvd cannot have: this side's rows of every layer. */
	for (uint32_t l = 0; l < c->m->layers; l++) {
		const struct kvc_layer *a = &s->ly[l];

		if (a->n && (rc = kvt_local_put(c->t, s->id, l, a->k, a->v, a->n, a->cap)))
			return rc;
	}
	return kvt_seq_publish(c->t, s->id, key, n);
}

int kvc_seq_attach(struct kvc *c, const uint8_t *keys, uint32_t nkeys, struct kvc_seq **out,
		   uint64_t *tokens)
{
	const size_t H = c->g->kv_heads, d = c->g->d;
	uint32_t *rows;
	uint64_t id, n = 0;
	struct kvc_seq *s;
	int rc;

	if (!(rows = calloc(c->m->layers, sizeof *rows)))
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	/* A prefix on disk is being read back: kvd says so, and asks again. */
	for (int tries = 0;; tries++) {
		rc = kvt_seq_attach(c->t, keys, nkeys, &id, &n, rows);
		if (rc != -EAGAIN || tries >= 30000)
			break;
		nanosleep(&(struct timespec){ 0, 1000000 }, NULL);
	}
	if (rc) {
		free(rows);
		return rc;
	}
	if (!(s = seq_new(c, id))) {
		free(rows);
		kvt_seq_free(c->t, id);
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	}
	if (c->gpu) {
		rc = n ? kvg_seq_attached(c->t, c->gpu, s, n, rows) : 0;
		free(rows);
		if (rc) {
			kvc_seq_free(c, s);
			return rc;
		}
		*tokens = n;
		*out = s;
		return 0;
	}
	for (uint32_t l = 0; n && l < c->m->layers; l++) {
		struct kvc_layer *a = &s->ly[l];
		int dense = kvt_dense(c->t, l);

		a->prefilled = 1;
		a->tokens = n;
		a->nsink = dense ? 0 : (uint32_t)(n < c->m->sink ? n : c->m->sink);
		if (!dense && !(a->mean = malloc(H * d * sizeof *a->mean)))
			rc = kvt_fail(c->t, -ENOMEM, "out of memory");
		if (!rc && rows[l] && (rc = local_reserve(c, a, rows[l])) == 0)
			rc = kvt_local_get(c->t, id, l, a->mean, a->k, a->v, rows[l], a->cap);
		if (!rc)
			a->n = rows[l];
		if (!rc && !dense && a->nsink > a->n)
			rc = kvt_fail(c->t, -KVD_EPROTO, "attach: layer %u has %u rows, fewer than "
				      "its %u sinks", l, a->n, a->nsink);
		if (rc) {
			free(rows);
			kvc_seq_free(c, s);
			return rc;
		}
	}
	free(rows);
	*tokens = n;
	*out = s;
	return 0;
}

int kvc_extend(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
	       const float *v, uint32_t n)
{
	const size_t H = c->g ? c->g->kv_heads : 0, d = c->g ? c->g->d : 0;
	float *kr, *vr;
	int rc = 0;

	if (!c->m || layer >= c->m->layers)
		return kvt_fail(c->t, -EINVAL, "layer %u out of range", layer);
	if (c->gpu ? kvg_layer_prefilled(s, layer) == 0 : !s->ly[layer].prefilled)
		return kvc_prefill(c, s, layer, k, v, n);
	if (!(kr = malloc(2 * H * d * sizeof *kr)))
		return kvt_fail(c->t, -ENOMEM, "out of memory");
	vr = kr + H * d;
	for (uint32_t i = 0; i < n && !rc; i++) {
		for (size_t h = 0; h < H; h++) {
			memcpy(kr + h * d, k + (h * n + i) * d, d * sizeof *kr);
			memcpy(vr + h * d, v + (h * n + i) * d, d * sizeof *vr);
		}
		rc = kvc_append(c, s, layer, kr, vr);
	}
	free(kr);
	return rc;
}

int kvc_seq_evict(struct kvc *c, struct kvc_seq *s)
{
	return kvt_seq_evict(c->t, s->id);
}

int kvc_prefetch(struct kvc *c, struct kvc_seq *s)
{
	return kvt_prefetch(c->t, s->id);
}

/* ---- the CUDA backend's entry points (kvg.h) ------------------------------ */

int kvc_backend(const struct kvc *c)
{
	return c->gpu ? KVC_BACKEND_CUDA : KVC_BACKEND_CPU;
}

int kvc_prefill_dev(struct kvc *c, struct kvc_seq *s, uint32_t layer, const void *k,
		    const void *v, uint32_t n, int dtype, void *stream)
{
	return kvg_prefill_dev(c->t, c->gpu, s, layer, k, v, n, dtype, stream);
}

int kvc_append_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const void *k, const void *v, int dtype, void *stream)
{
	return kvg_append_dev(c->t, c->gpu, layer, seqs, nseq, k, v, dtype, stream);
}

int kvc_attend_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const float *q, float *o, float *lse, void *stream)
{
	return kvg_attend_dev(c->t, c->gpu, layer, seqs, nseq, q, o, lse, 0, stream);
}

int kvc_attend_kvd_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs,
		       uint32_t nseq, const float *q, float *o, float *lse, void *stream)
{
	return kvg_attend_dev(c->t, c->gpu, layer, seqs, nseq, q, o, lse, 1, stream);
}

int kvc_timing(struct kvc *c, struct kvc_timing *t, int reset)
{
	return kvg_timing(c->t, c->gpu, t, reset);
}
