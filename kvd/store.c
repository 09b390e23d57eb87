#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "err.h"
#include "mem.h"
#include "rng.h"
#include "store.h"

#define SEQ_BUCKETS 4096        /* chains stay short for thousands of sequences */
#define MAX_PROFILES 256

struct kvd_store {
	struct kvd_pool *pool[KVD_STORE_NODES];
	int mem[KVD_STORE_NODES];
	uint64_t node_bytes[KVD_STORE_NODES];
	unsigned nnodes;
	uint64_t picks;
	struct kvd_profile *prof[MAX_PROFILES];
	uint32_t nprof;
	struct kvd_seqn *bucket[SEQ_BUCKETS];
	uint32_t nseq;
	uint64_t bytes;
	uint64_t next_id;
	uint64_t id_key;
};

int kvd_store_create(struct kvd_pool *pool, struct kvd_store **out)
{
	struct kvd_store *s = calloc(1, sizeof *s);
	struct timespec ts;

	if (!s)
		return -ENOMEM;
	s->pool[0] = pool;
	s->mem[0] = -1;
	s->nnodes = 1;
	/* Ids are a keyed permutation of a counter: unique, and not guessable
	 * across restarts (tenancy is still checked on every use). */
	clock_gettime(CLOCK_REALTIME, &ts);
	s->id_key = kvd_mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)getpid());
	*out = s;
	return 0;
}

static void profile_free(struct kvd_profile *p)
{
	if (!p)
		return;
	free(p->dense);
	free(p->W);
	free(p->tab);
	free(p);
}

/* Row buffers of `cap` tokens: K and V [H][cap][d], codes [H][L][cap]. */
static size_t kv_bytes(const struct kvd_profile *p, uint32_t cap)
{
	return (size_t)p->g.kv_heads * cap * p->g.d * sizeof(uint16_t);
}

static size_t codes_bytes(const struct kvd_profile *p, uint32_t cap)
{
	return (size_t)p->g.kv_heads * p->g.L * cap * sizeof(uint16_t);
}

static void rows_free(const struct kvd_profile *p, uint16_t *k, uint16_t *v, uint16_t *c,
		      uint32_t cap)
{
	kvd_mem_free(k, kv_bytes(p, cap));
	kvd_mem_free(v, kv_bytes(p, cap));
	kvd_mem_free(c, codes_bytes(p, cap));
}

static int rows_alloc(const struct kvd_profile *p, uint16_t **k, uint16_t **v, uint16_t **c,
		      uint32_t cap, int node)
{
	*k = kvd_mem_alloc_node(kv_bytes(p, cap), node);
	*v = kvd_mem_alloc_node(kv_bytes(p, cap), node);
	*c = kvd_mem_alloc_node(codes_bytes(p, cap), node);
	if (*k && *v && *c)
		return 0;
	rows_free(p, *k, *v, *c, cap);
	*k = *v = *c = NULL;
	return -ENOMEM;
}

static void layer_free(const struct kvd_profile *p, struct kvd_layer_state *l)
{
	for (uint32_t i = 0; i < l->nseg; i++)
		kvd_seg_free(l->seg[i]);
	free(l->seg);
	free(l->mean);
	rows_free(p, l->sk, l->sv, l->sc, l->scap);
	if (l->tk)
		rows_free(p, l->tk, l->tv, l->tc, p->seal_tokens);
	memset(l, 0, sizeof *l);
}

static size_t mean_bytes(const struct kvd_profile *p)
{
	return (size_t)p->g.kv_heads * p->g.d * sizeof(float);
}

static void seq_destroy(struct kvd_seqn *q)
{
	for (uint32_t i = 0; i < q->p->layers; i++)
		layer_free(q->p, &q->ly[i]);
	free(q->ly);
	free(q);
}

void kvd_store_destroy(struct kvd_store *s)
{
	if (!s)
		return;
	for (uint32_t b = 0; b < SEQ_BUCKETS; b++) {
		for (struct kvd_seqn *q = s->bucket[b], *nx; q; q = nx) {
			nx = q->next;
			seq_destroy(q);
		}
	}
	for (uint32_t i = 0; i < s->nprof; i++)
		profile_free(s->prof[i]);
	free(s);
}

int kvd_store_nodes(struct kvd_store *s, struct kvd_pool *const *pools, const int *mem,
		    unsigned n)
{
	if (n < 1 || n > KVD_STORE_NODES || s->nseq)
		return -EINVAL;
	for (unsigned i = 0; i < n; i++) {
		s->pool[i] = pools[i];
		s->mem[i] = mem[i];
	}
	s->nnodes = n;
	return 0;
}

struct kvd_pool *kvd_store_pool(const struct kvd_store *s, const struct kvd_seqn *q)
{
	return s->pool[q->node];
}

int kvd_store_mem_node(const struct kvd_store *s, const struct kvd_seqn *q)
{
	return s->mem[q->node];
}

/* ---- profiles ---------------------------------------------------------- */

static int same_profile(const struct kvd_profile *a, const struct kvd_profile *b)
{
	return !memcmp(&a->g, &b->g, sizeof a->g) && a->layers == b->layers &&
	       a->sink == b->sink && a->window == b->window && a->seg_tokens == b->seg_tokens &&
	       a->seal_tokens == b->seal_tokens && a->seed == b->seed &&
	       !memcmp(a->dense, b->dense, a->layers);
}

int kvd_store_profile(struct kvd_store *s, const struct kvd_profile *want,
		      const struct kvd_profile **out)
{
	const struct kvd_profile *old = kvd_store_profile_by_name(s, want->name);
	struct kvd_profile *p;
	size_t wn = (size_t)want->g.d * want->g.K * want->g.L;

	if (old) {
		if (!same_profile(old, want))
			return -EEXIST;
		*out = old;
		return 0;
	}
	if (s->nprof == MAX_PROFILES)
		return -ENOSPC;
	p = calloc(1, sizeof *p);
	if (!p)
		return -ENOMEM;
	*p = *want;
	p->id = s->nprof + 1;
	p->dense = malloc(want->layers);
	p->W = malloc(wn * sizeof *p->W);
	p->tab = malloc(sizeof *p->tab);
	if (!p->dense || !p->W || !p->tab) {
		profile_free(p);
		return -ENOMEM;
	}
	memcpy(p->dense, want->dense, want->layers);
	kvd_lsh_make_w(p->seed, (int)p->g.d, (int)p->g.K, (int)p->g.L, p->W);
	kvd_logp_tab_init(p->tab, (int)p->g.K, (int)p->g.L, (int)p->g.c);
	s->prof[s->nprof++] = p;
	*out = p;
	return 0;
}

const struct kvd_profile *kvd_store_profile_by_id(struct kvd_store *s, uint32_t id)
{
	return id >= 1 && id <= s->nprof ? s->prof[id - 1] : NULL;
}

const struct kvd_profile *kvd_store_profile_by_name(struct kvd_store *s, const char *name)
{
	for (uint32_t i = 0; i < s->nprof; i++)
		if (!strcmp(s->prof[i]->name, name))
			return s->prof[i];
	return NULL;
}

/* ---- sequences --------------------------------------------------------- */

static uint32_t bucket_of(uint64_t id)
{
	return (uint32_t)(kvd_mix64(id) & (SEQ_BUCKETS - 1));
}

static struct kvd_seqn *seq_find(struct kvd_store *s, uint64_t id)
{
	for (struct kvd_seqn *q = s->bucket[bucket_of(id)]; q; q = q->next)
		if (q->id == id)
			return q;
	return NULL;
}

static int seq_new(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
		   uint64_t id, uint64_t owner, struct kvd_seqn **out)
{
	struct kvd_seqn *q = calloc(1, sizeof *q);

	if (!q)
		return -ENOMEM;
	q->ly = calloc(p->layers, sizeof *q->ly);
	if (!q->ly) {
		free(q);
		return -ENOMEM;
	}
	q->id = id;
	q->owner = owner;
	/* The node with the fewest resident bytes; ties go round robin. */
	q->node = (uint32_t)(s->picks++ % s->nnodes);
	for (unsigned i = 0; i < s->nnodes; i++)
		if (s->node_bytes[i] < s->node_bytes[q->node])
			q->node = i;
	snprintf(q->tenant, sizeof q->tenant, "%s", tenant);
	q->p = p;
	uint32_t b = bucket_of(q->id);

	q->next = s->bucket[b];
	s->bucket[b] = q;
	s->nseq++;
	*out = q;
	return 0;
}

int kvd_store_seq_create(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
			 uint64_t owner, struct kvd_seqn **out)
{
	uint64_t id;

	/* mix64 is a bijection, so distinct counters give distinct ids within
	 * a lifetime; ids adopted from disk come from other lifetimes, hence
	 * the lookup.  0 is skipped because clients use it as "none". */
	do
		id = kvd_mix64(++s->next_id ^ s->id_key);
	while (id == 0 || seq_find(s, id));
	return seq_new(s, p, tenant, id, owner, out);
}

int kvd_store_seq_adopt(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
			uint64_t id, uint64_t owner, struct kvd_seqn **out)
{
	if (id == 0 || seq_find(s, id))
		return -EEXIST;
	return seq_new(s, p, tenant, id, owner, out);
}

struct kvd_seqn *kvd_store_seq_get(struct kvd_store *s, uint64_t id, const char *tenant)
{
	struct kvd_seqn *q = seq_find(s, id);

	return q && !strcmp(q->tenant, tenant) ? q : NULL;
}

void kvd_store_each(struct kvd_store *s, void (*fn)(void *arg, struct kvd_seqn *q), void *arg)
{
	for (uint32_t b = 0; b < SEQ_BUCKETS; b++) {
		for (struct kvd_seqn *q = s->bucket[b], *nx; q; q = nx) {
			nx = q->next;
			fn(arg, q);
		}
	}
}

void kvd_store_seq_free(struct kvd_store *s, struct kvd_seqn *q)
{
	struct kvd_seqn **pp = &s->bucket[bucket_of(q->id)];

	while (*pp && *pp != q)
		pp = &(*pp)->next;
	if (!*pp)
		return;
	*pp = q->next;
	s->nseq--;
	s->bytes -= q->bytes;
	s->node_bytes[q->node] -= q->bytes;
	seq_destroy(q);
}

/* ---- rows -------------------------------------------------------------- */

static void account(struct kvd_store *s, struct kvd_seqn *q, ptrdiff_t delta)
{
	q->bytes += (size_t)delta;
	s->bytes += (uint64_t)delta;
	s->node_bytes[q->node] += (uint64_t)delta;
}

static size_t rows_bytes(const struct kvd_profile *p, uint32_t cap)
{
	return 2 * kv_bytes(p, cap) + codes_bytes(p, cap);
}

/* Copies n rows (of a [H][n][d] / [H][L][n] batch, starting at row `from`)
 * into a [H][cap][d] / [H][L][cap] buffer at row `at`. */
static void put_rows(const struct kvd_profile *p, uint16_t *dk, uint16_t *dv, uint16_t *dc,
		     uint32_t cap, uint32_t at, const uint16_t *k, const uint16_t *v,
		     const uint16_t *c, uint32_t n, uint32_t from, uint32_t cnt)
{
	size_t H = p->g.kv_heads, d = p->g.d, L = p->g.L;

	for (size_t h = 0; h < H; h++) {
		memcpy(dk + (h * cap + at) * d, k + (h * n + from) * d, cnt * d * sizeof *k);
		memcpy(dv + (h * cap + at) * d, v + (h * n + from) * d, cnt * d * sizeof *v);
		for (size_t t = 0; t < L; t++)
			memcpy(dc + (h * L + t) * cap + at, c + (h * L + t) * n + from,
			       cnt * sizeof *c);
	}
}

/* Room in l->seg for one more segment.  0 or -ENOMEM. */
static int seg_room(struct kvd_layer_state *l)
{
	if (l->nseg == l->segcap) {
		uint32_t nc = l->segcap ? 2 * l->segcap : 4;
		struct kvd_seg **ns = realloc(l->seg, nc * sizeof *ns);

		if (!ns)
			return -ENOMEM;
		l->seg = ns;
		l->segcap = nc;
	}
	return 0;
}

/* Seals `cnt` rows held in a [H][cap][d] buffer into a new segment. */
static int seal(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l,
		const uint16_t *k, const uint16_t *v, const uint16_t *c, uint32_t cap, uint32_t cnt)
{
	const struct kvd_profile *p = q->p;
	size_t H = p->g.kv_heads, d = p->g.d, L = p->g.L;
	uint16_t *kk = (uint16_t *)k, *vv = (uint16_t *)v, *cc = (uint16_t *)c;
	struct kvd_seg *seg;
	int rc;

	if (cnt == 0)
		return 0;
	if (seg_room(l))
		return -ENOMEM;
	/* kvd_seg_build wants [H][cnt][d]: compact a partly filled buffer in
	 * place (heads move towards the front, so ascending order is safe). */
	if (cnt < cap) {
		for (size_t h = 1; h < H; h++) {
			memmove(kk + h * cnt * d, kk + h * cap * d, cnt * d * sizeof *kk);
			memmove(vv + h * cnt * d, vv + h * cap * d, cnt * d * sizeof *vv);
		}
		for (size_t r = 1; r < H * L; r++)
			memmove(cc + r * cnt, cc + r * cap, cnt * sizeof *cc);
	}
	rc = kvd_seg_build_node(&p->g, cnt, kk, vv, cc, s->pool[q->node], s->mem[q->node], &seg);
	if (rc)
		return rc;
	l->seg[l->nseg++] = seg;
	account(s, q, (ptrdiff_t)seg->bytes);
	return 0;
}

static int grow_staging(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l,
			uint32_t need)
{
	const struct kvd_profile *p = q->p;
	uint32_t cap = l->scap ? l->scap : 1024;
	uint16_t *nk, *nv, *nc;

	while (cap < need)
		cap *= 2;
	if (cap > p->seg_tokens)
		cap = p->seg_tokens;
	if (cap <= l->scap)
		return 0;
	if (rows_alloc(p, &nk, &nv, &nc, cap, s->mem[q->node]))
		return -ENOMEM;
	if (l->sn)
		put_rows(p, nk, nv, nc, cap, 0, l->sk, l->sv, l->sc, l->scap, 0, l->sn);
	rows_free(p, l->sk, l->sv, l->sc, l->scap);
	account(s, q, (ptrdiff_t)rows_bytes(p, cap) - (ptrdiff_t)rows_bytes(p, l->scap));
	l->sk = nk;
	l->sv = nv;
	l->sc = nc;
	l->scap = cap;
	return 0;
}

static void drop_staging(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l)
{
	account(s, q, -(ptrdiff_t)rows_bytes(q->p, l->scap));
	rows_free(q->p, l->sk, l->sv, l->sc, l->scap);
	l->sk = l->sv = l->sc = NULL;
	l->scap = l->sn = 0;
}

static int prefill(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l, int last,
		   const uint16_t *k, const uint16_t *v, const uint16_t *c, uint32_t n)
{
	const struct kvd_profile *p = q->p;
	uint32_t done = 0;
	int rc;

	while (done < n) {
		uint32_t cnt = n - done;

		if (cnt > p->seg_tokens - l->sn)
			cnt = p->seg_tokens - l->sn;
		if ((rc = grow_staging(s, q, l, l->sn + cnt)))
			return rc;
		put_rows(p, l->sk, l->sv, l->sc, l->scap, l->sn, k, v, c, n, done, cnt);
		l->sn += cnt;
		done += cnt;
		l->tokens += cnt;
		if (l->sn == p->seg_tokens) {
			if ((rc = seal(s, q, l, l->sk, l->sv, l->sc, l->scap, l->sn)))
				return rc;
			l->sn = 0;
		}
	}
	if (last) {
		if ((rc = seal(s, q, l, l->sk, l->sv, l->sc, l->scap, l->sn)))
			return rc;
		drop_staging(s, q, l);
		l->sealed = 1;
	}
	return 0;
}

static int append(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l,
		  const uint16_t *k, const uint16_t *v, const uint16_t *c, uint32_t n)
{
	const struct kvd_profile *p = q->p;
	uint32_t cap = p->seal_tokens, done = 0;
	int rc;

	if (!l->tk) {
		if (rows_alloc(p, &l->tk, &l->tv, &l->tc, cap, s->mem[q->node]))
			return -ENOMEM;
		account(s, q, (ptrdiff_t)rows_bytes(p, cap));
	}
	while (done < n) {
		uint32_t cnt = n - done < cap - l->tn ? n - done : cap - l->tn;

		put_rows(p, l->tk, l->tv, l->tc, cap, l->tn, k, v, c, n, done, cnt);
		l->tn += cnt;
		done += cnt;
		l->tokens += cnt;
		if (l->tn == cap) {
			if ((rc = seal(s, q, l, l->tk, l->tv, l->tc, cap, cap)))
				return rc;
			l->tn = 0;
		}
	}
	return 0;
}

int kvd_store_rows(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer, int is_append,
		   int last, const float *mean, const uint16_t *k, const uint16_t *v,
		   const uint16_t *codes, uint32_t n, char *msg, size_t msglen)
{
	const struct kvd_profile *p = q->p;
	struct kvd_layer_state *l;
	int rc;

	if (layer >= p->layers || p->dense[layer]) {
		snprintf(msg, msglen, "layer %u is %s", layer,
			 layer >= p->layers ? "out of range" : "dense (stays on the GPU)");
		return -EINVAL;
	}
	l = &q->ly[layer];
	if (mean) {
		if (l->mean) {
			snprintf(msg, msglen, "layer %u already has its mean", layer);
			return -EINVAL;
		}
		l->mean = malloc(mean_bytes(p));
		if (!l->mean)
			return -ENOMEM;
		memcpy(l->mean, mean, mean_bytes(p));
		account(s, q, (ptrdiff_t)mean_bytes(p));
		q->gen++;
	}
	if (!l->mean) {
		snprintf(msg, msglen, "layer %u: first rows must carry the mean", layer);
		return -EINVAL;
	}
	if (is_append ? !l->sealed : l->sealed) {
		snprintf(msg, msglen, "layer %u: %s", layer,
			 is_append ? "APPEND before the prefill's last chunk" : "PREFILL after the last chunk");
		return -EINVAL;
	}
	q->gen++;
	rc = is_append ? append(s, q, l, k, v, codes, n) : prefill(s, q, l, last, k, v, codes, n);
	if (rc)
		snprintf(msg, msglen, "layer %u: %s", layer, kvd_strerror(rc));
	return rc;
}

/* ---- tiers ------------------------------------------------------------- */

void kvd_store_seq_drop(struct kvd_store *s, struct kvd_seqn *q)
{
	for (uint32_t i = 0; i < q->p->layers; i++) {
		struct kvd_layer_state *l = &q->ly[i];
		uint64_t tokens = l->tokens;
		int sealed = l->sealed;

		layer_free(q->p, l);
		l->tokens = tokens;
		l->sealed = sealed;
	}
	s->bytes -= q->bytes;
	s->node_bytes[q->node] -= q->bytes;
	q->bytes = 0;
}

int kvd_store_install_layer(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const float *mean, int sealed, uint64_t tokens, const uint16_t *k,
			    const uint16_t *v, const uint16_t *codes, uint32_t tn)
{
	const struct kvd_profile *p = q->p;
	struct kvd_layer_state *l = &q->ly[layer];

	if (layer >= p->layers || tn > p->seal_tokens || (tn && !sealed) || l->mean || l->tk ||
	    l->nseg)
		return -EINVAL;
	if (mean) {
		if (!(l->mean = malloc(mean_bytes(p))))
			return -ENOMEM;
		memcpy(l->mean, mean, mean_bytes(p));
		account(s, q, (ptrdiff_t)mean_bytes(p));
	}
	if (tn) {
		if (rows_alloc(p, &l->tk, &l->tv, &l->tc, p->seal_tokens, s->mem[q->node]))
			return -ENOMEM;
		account(s, q, (ptrdiff_t)rows_bytes(p, p->seal_tokens));
		put_rows(p, l->tk, l->tv, l->tc, p->seal_tokens, 0, k, v, codes, tn, 0, tn);
	}
	l->tn = tn;
	l->sealed = sealed;
	l->tokens = tokens;
	return 0;
}

int kvd_store_install_seg(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			  struct kvd_seg *seg)
{
	struct kvd_layer_state *l = &q->ly[layer];

	if (seg_room(l))
		return -ENOMEM;
	l->seg[l->nseg++] = seg;
	account(s, q, (ptrdiff_t)seg->bytes);
	return 0;
}

int kvd_store_spillable(const struct kvd_seqn *q)
{
	for (uint32_t i = 0; i < q->p->layers; i++)
		if (q->ly[i].scap)      /* staging exists from a layer's first PREFILL to its LAST */
			return 0;
	return 1;
}

struct kvd_layer_view kvd_store_view(const struct kvd_seqn *q, uint32_t layer)
{
	const struct kvd_layer_state *l = &q->ly[layer];

	return (struct kvd_layer_view){
		.seg = (const struct kvd_seg *const *)l->seg, .nseg = l->nseg,
		.tail_k = l->tk, .tail_v = l->tv, .tail_n = l->tn, .tail_cap = q->p->seal_tokens,
	};
}

void kvd_store_stats(const struct kvd_store *s, struct kvd_store_stats *st)
{
	st->sequences = s->nseq;
	st->profiles = s->nprof;
	st->bytes = s->bytes;
}

void kvd_store_seq_stats(const struct kvd_seqn *q, uint64_t *tokens, uint32_t *segments)
{
	*tokens = 0;
	*segments = 0;
	for (uint32_t i = 0; i < q->p->layers; i++) {
		*tokens = q->ly[i].tokens > *tokens ? q->ly[i].tokens : *tokens;
		*segments += q->ly[i].nseg;
	}
}
