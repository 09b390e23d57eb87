#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/err.h"
#include "engine/invariant.h"
#include "engine/mem.h"
#include "engine/pool.h"
#include "engine/rng.h"
#include "profile.h"
#include "store_int.h"

#define SEQ_BUCKET_BITS 12
#define SEQ_BUCKETS (1u << SEQ_BUCKET_BITS)     /* chains stay short for thousands of sequences */
#define OWNER_BUCKETS 256u                      /* by client id, which counts up */

/* The sequences one client owns, so that what concerns a client (a listing
 * of clients with their counts, its sequences freed when it goes) costs
 * what it owns, not a walk of every sequence. */
struct kvd_owner {
	uint64_t id;
	uint32_t n;
	struct kvd_seqn *head;
	struct kvd_owner *next;
};

struct kvd_store {
	struct kvd_pool *pool[KVD_STORE_NODES];
	int mem[KVD_STORE_NODES];
	uint64_t node_bytes[KVD_STORE_NODES];
	unsigned nnodes;
	uint64_t picks;
	struct kvd_profiles prof;
	uint64_t fixed;                 /* sequences' structs and layer arrays */
	size_t seq_extra;               /* kvd_store_set_seq_extra: in every q->fixed */
	uint64_t local_bytes;           /* kvd_local blobs, each once */
	struct kvd_limits *lim;
	kvd_store_room_fn room;         /* the tier's policy before the wall */
	void *room_arg;
	kvd_store_want_fn want;         /* the tier's residency, for records */
	void *want_arg;
	kvd_store_reclaim_fn reclaim;   /* caches that give way at the wall */
	void *reclaim_arg;
	int exact;                      /* this rows call grows staging exactly */
	/* kvd_store_rows' reservation: the peak its change charges, charged
	 * before the change begins.  Requests run between the slices of its
	 * seals, and a restore there must not take the room the change
	 * counted on and fail it half done: take() draws q's bytes from it,
	 * give() puts them back, and what is left is uncharged at the end. */
	struct kvd_seqn *resv_q;
	uint64_t resv;
	char why[192];                  /* the last refused charge's message */
	struct kvd_seqn *bucket[SEQ_BUCKETS];
	struct kvd_owner *owners[OWNER_BUCKETS];
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

int kvd_store_set_limits(struct kvd_store *s, struct kvd_limits *l)
{
	if (s->nseq || s->prof.n)
		return -EBUSY;
	s->lim = l;
	return 0;
}

struct kvd_limits *kvd_store_limits(const struct kvd_store *s)
{
	return s->lim;
}

void kvd_store_set_room(struct kvd_store *s, kvd_store_room_fn fn, void *arg)
{
	s->room = fn;
	s->room_arg = arg;
}

void kvd_store_set_want(struct kvd_store *s, kvd_store_want_fn fn, void *arg)
{
	s->want = fn;
	s->want_arg = arg;
}

void kvd_store_set_reclaim(struct kvd_store *s, kvd_store_reclaim_fn fn, void *arg)
{
	s->reclaim = fn;
	s->reclaim_arg = arg;
}

uint64_t kvd_store_reclaim(struct kvd_store *s, uint32_t uid, int any, uint64_t need)
{
	return s->reclaim && need ? s->reclaim(s->reclaim_arg, uid, any, need) : 0;
}

int kvd_store_set_seq_extra(struct kvd_store *s, size_t bytes)
{
	if (s->nseq)
		return -EBUSY;
	s->seq_extra = bytes;
	return 0;
}

/* ---- charges ------------------------------------------------------------ */

/* Before n more bytes of uid's are refused at a memory limit: the caches
 * give way, what is over uid's own limit from uid's, what is over the
 * global one from anyone's.  Returns whether anything was freed. */
static int make_room(struct kvd_store *s, uint32_t uid, uint64_t n)
{
	const struct kvd_limits_cfg *c = kvd_limits_cfg(s->lim);
	const uint64_t per = c->per_uid[KVD_RES_MEMORY], cap = c->cap[KVD_RES_MEMORY];
	struct kvd_limits_usage u;
	uint64_t got = 0;

	kvd_limits_uid_usage(s->lim, uid, &u);
	if (per && u.n[KVD_RES_MEMORY] + n > per)
		got += kvd_store_reclaim(s, uid, 0, u.n[KVD_RES_MEMORY] + n - per);
	kvd_limits_total(s->lim, &u);
	if (cap && u.n[KVD_RES_MEMORY] + n > cap)
		got += kvd_store_reclaim(s, uid, 1, u.n[KVD_RES_MEMORY] + n - cap);
	return got > 0;
}

/* The checked memory charge: refused at a limit, asked again once the
 * caches made room. */
static int mem_charge(struct kvd_store *s, uint32_t uid, uint64_t n, char *msg, size_t msglen)
{
	int rc = kvd_limits_charge(s->lim, uid, KVD_RES_MEMORY, n, msg, msglen);

	if ((rc == -ENOMEM || rc == -EDQUOT) && s->reclaim && make_room(s, uid, n))
		rc = kvd_limits_charge(s->lim, uid, KVD_RES_MEMORY, n, msg, msglen);
	return rc;
}

/* n bytes more for uid, before they are allocated.  force: the room was
 * reserved already (restores).  The message of a refusal stays in s->why. */
static int charge(struct kvd_store *s, uint32_t uid, size_t n, int force)
{
	int rc;

	if (!s->lim || !n)
		return 0;
	if (force)
		rc = kvd_limits_force(s->lim, uid, KVD_RES_MEMORY, n);
	else
		rc = mem_charge(s, uid, n, s->why, sizeof s->why);
	if (rc == -ENOMEM && force)
		snprintf(s->why, sizeof s->why, "out of memory");
	return rc;
}

static void uncharge(struct kvd_store *s, uint32_t uid, size_t n)
{
	struct kvd_limits_usage u;

	if (!s->lim)
		return;
	/* The store gives back only what it charged, to whom it charged it:
	 * a uid's memory never goes below 0 (kvd_limits clamps, which would
	 * hide the broken count and let the uid past its cap later). */
	kvd_limits_uid_usage(s->lim, uid, &u);
	if (NEVER(u.n[KVD_RES_MEMORY] < n))
		n = u.n[KVD_RES_MEMORY];
	kvd_limits_uncharge(s->lim, uid, KVD_RES_MEMORY, n);
}

static void account(struct kvd_store *s, struct kvd_seqn *q, ptrdiff_t delta)
{
	q->bytes += (size_t)delta;
	s->bytes += (uint64_t)delta;
	s->node_bytes[q->node] += (uint64_t)delta;
}

/* n bytes for q: from the reservation of the rows call changing q, if
 * any, else charged. */
static int charge_q(struct kvd_store *s, struct kvd_seqn *q, size_t n, int force)
{
	if (q == s->resv_q && n <= s->resv) {
		s->resv -= n;
		return 0;
	}
	return charge(s, q->uid, n, force);
}

/* n bytes of q given back: to the reservation while q's rows call runs. */
static void uncharge_q(struct kvd_store *s, struct kvd_seqn *q, size_t n)
{
	if (q == s->resv_q && s->lim)
		s->resv += n;
	else
		uncharge(s, q->uid, n);
}

/* Charge and account n bytes of q (before allocating them). */
static int take(struct kvd_store *s, struct kvd_seqn *q, size_t n, int force)
{
	int rc = charge_q(s, q, n, force);

	if (!rc)
		account(s, q, (ptrdiff_t)n);
	return rc;
}

/* After freeing n bytes of q. */
static void give(struct kvd_store *s, struct kvd_seqn *q, size_t n)
{
	account(s, q, -(ptrdiff_t)n);
	uncharge_q(s, q, n);
}

/* Segments are charged once, to the uid of the sequence that made them
 * (sealed or read back), and counted once in the store's total, however
 * many sequences hold them; each holder counts them in its own bytes (what
 * it uses) and segb.  seg_new: q made seg (its bytes were charged already);
 * seg_hold: q takes one more reference on a segment someone else made;
 * seg_put: q lets go, and the last holder's put frees and uncharges. */
static void seg_new(struct kvd_store *s, struct kvd_seqn *q, struct kvd_seg *seg)
{
	seg->chg_uid = q->uid;
	seg->chg_node = q->node;
	q->bytes += seg->bytes;
	q->segb += seg->bytes;
	s->bytes += seg->bytes;
	s->node_bytes[q->node] += seg->bytes;
}

static struct kvd_seg *seg_hold(struct kvd_seqn *q, struct kvd_seg *seg)
{
	q->bytes += seg->bytes;
	q->segb += seg->bytes;
	return kvd_seg_ref(seg);
}

static void seg_put(struct kvd_store *s, struct kvd_seqn *q, struct kvd_seg *seg)
{
	/* q holds a reference (seg_new or seg_hold) and counts the segment
	 * in its bytes and segb; the store's total counts it once until the
	 * last holder lets go.  Else the counts would wrap: leak it instead. */
	if (NEVER(seg->refs == 0 || q->segb < seg->bytes || q->bytes < seg->bytes) ||
	    NEVER(seg->refs == 1 && s->bytes < seg->bytes))
		return;
	q->bytes -= seg->bytes;
	q->segb -= seg->bytes;
	if (seg->refs == 1) {
		s->bytes -= seg->bytes;
		s->node_bytes[seg->chg_node] -= seg->bytes;
		uncharge(s, seg->chg_uid, seg->bytes);
	}
	kvd_seg_free(seg);
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

static void tail_put(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l);

/* Frees a layer's resident data; its segments and tail through seg_put and
 * tail_put, the rest left in q->bytes for the caller to give back. */
static void layer_free(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l)
{
	const struct kvd_profile *p = q->p;

	for (uint32_t i = 0; i < l->nseg; i++)
		seg_put(s, q, l->seg[i]);
	free(l->seg);
	free(l->mean);
	free(l->heavy);
	rows_free(p, l->stage_k, l->stage_v, l->stage_codes, l->stage_cap);
	tail_put(s, q, l);
	memset(l, 0, sizeof *l);
}

static size_t mean_bytes(const struct kvd_profile *p)
{
	return (size_t)p->g.kv_heads * p->g.d * sizeof(float);
}

static size_t heavy_bytes(const struct kvd_profile *p)
{
	return kvd_heavy_words(&p->g) * sizeof(uint32_t);
}

static void local_unref(struct kvd_store *s, const struct kvd_profile *p, struct kvd_local *b);
static void profile_uncharge(struct kvd_store *s, uint32_t uid, size_t bytes);

/* Frees q, gives back everything charged for it and its profile reference. */
static struct kvd_owner **owner_slot(struct kvd_store *s, uint64_t id)
{
	struct kvd_owner **pp = &s->owners[id % OWNER_BUCKETS];

	while (*pp && (*pp)->id != id)
		pp = &(*pp)->next;
	return pp;
}

/* q, which has no owner, goes to `owner` (0: stays without).  0 or -ENOMEM
 * (a client's first sequence makes its entry). */
static int own(struct kvd_store *s, struct kvd_seqn *q, uint64_t owner)
{
	struct kvd_owner **pp, *o;

	if (NEVER(q->owner) || !owner)
		return 0;
	pp = owner_slot(s, owner);
	if (!(o = *pp)) {
		if (!(o = calloc(1, sizeof *o)))
			return -ENOMEM;
		o->id = owner;
		*pp = o;
	}
	q->oprev = NULL;
	q->onext = o->head;
	if (o->head)
		o->head->oprev = q;
	o->head = q;
	o->n++;
	q->owner = owner;
	return 0;
}

static void disown(struct kvd_store *s, struct kvd_seqn *q)
{
	struct kvd_owner **pp, *o;

	if (!q->owner)
		return;
	pp = owner_slot(s, q->owner);
	o = *pp;
	q->owner = 0;
	/* own() put it on this list; an owner with none has no entry. */
	if (NEVER(!o || !o->n))
		return;
	if (q->oprev)
		q->oprev->onext = q->onext;
	else
		o->head = q->onext;
	if (q->onext)
		q->onext->oprev = q->oprev;
	q->onext = q->oprev = NULL;
	if (--o->n == 0) {
		(void)ALWAYS(!o->head);
		*pp = o->next;
		free(o);
	}
}

uint32_t kvd_store_owner_count(struct kvd_store *s, uint64_t owner)
{
	const struct kvd_owner *o = owner ? *owner_slot(s, owner) : NULL;

	return o ? o->n : 0;
}

unsigned kvd_store_each_owned(struct kvd_store *s, uint64_t owner,
			      void (*fn)(void *arg, struct kvd_seqn *q), void *arg)
{
	const struct kvd_owner *o = owner ? *owner_slot(s, owner) : NULL;
	unsigned n = 0;

	/* fn may disown or free q (and with the last one, the entry): take
	 * the next first. */
	for (struct kvd_seqn *q = o ? o->head : NULL, *nx; q; q = nx) {
		nx = q->onext;
		fn(arg, q);
		n++;
	}
	return n;
}

void kvd_store_seq_disown(struct kvd_store *s, struct kvd_seqn *q)
{
	disown(s, q);
}

static void seq_destroy(struct kvd_store *s, struct kvd_seqn *q)
{
	const struct kvd_profile *p = q->p;

	disown(s, q);
	local_unref(s, p, q->loc);
	for (uint32_t i = 0; i < p->layers; i++)
		layer_free(s, q, &q->ly[i]);
	free(q->ly);
	s->bytes -= q->bytes;
	s->node_bytes[q->node] -= q->bytes;
	s->fixed -= q->fixed;
	uncharge(s, q->uid, q->bytes + q->fixed);
	if (s->lim)
		kvd_limits_uncharge(s->lim, q->uid, KVD_RES_SEQUENCES, 1);
	free(q);
	kvd_store_profile_unref(s, p);
}

void kvd_store_destroy(struct kvd_store *s)
{
	if (!s)
		return;
	for (uint32_t b = 0; b < SEQ_BUCKETS; b++) {
		for (struct kvd_seqn *q = s->bucket[b], *nx; q; q = nx) {
			nx = q->next;
			seq_destroy(s, q);
		}
	}
	/* Old-API profiles keep their reference to the end. */
	for (const struct kvd_profile *p; (p = kvd_profiles_any(&s->prof));) {
		profile_uncharge(s, p->uid, kvd_store_profile_bytes(p));
		kvd_profiles_remove(&s->prof, p);
	}
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

__attribute__((format(printf, 3, 4)))
static int say(char *msg, size_t msglen, const char *fmt, ...)
{
	va_list ap;

	if (msg && msglen) {
		va_start(ap, fmt);
		vsnprintf(msg, msglen, fmt, ap);
		va_end(ap);
	}
	return 0;
}

/* ---- profiles (the table: profile.c; here the namespaces and charges) -- */

#define MAX_PROFILES 256        /* old API without limits: the cap it always had */

static void profile_uncharge(struct kvd_store *s, uint32_t uid, size_t bytes)
{
	uncharge(s, uid, bytes);
	if (s->lim)
		kvd_limits_uncharge(s->lim, uid, KVD_RES_PROFILES, 1);
}

/* A new profile in ns, charged to uid, with one reference. */
static int profile_new(struct kvd_store *s, uint32_t ns, uint32_t uid,
		       const struct kvd_profile *want, const struct kvd_profile **out, char *msg,
		       size_t msglen)
{
	size_t bytes = kvd_store_profile_bytes(want);
	int rc;

	if (s->prof.next_id == UINT32_MAX) {
		say(msg, msglen, "profile ids used up (restart kvd)");
		return -EOVERFLOW;
	}
	if (s->lim) {
		if ((rc = kvd_limits_charge(s->lim, uid, KVD_RES_PROFILES, 1, msg, msglen)))
			return rc;
		if ((rc = mem_charge(s, uid, bytes, msg, msglen))) {
			kvd_limits_uncharge(s->lim, uid, KVD_RES_PROFILES, 1);
			return rc;
		}
	}
	if ((rc = kvd_profiles_add(&s->prof, ns, uid, want, out))) {
		if (s->lim) {
			kvd_limits_uncharge(s->lim, uid, KVD_RES_MEMORY, bytes);
			kvd_limits_uncharge(s->lim, uid, KVD_RES_PROFILES, 1);
		}
		say(msg, msglen, "out of memory");
		return rc;
	}
	return 0;
}

const struct kvd_profile *kvd_store_profile_find(struct kvd_store *s, uint32_t ns, const char *name)
{
	return kvd_profiles_find(&s->prof, ns, name);
}

const struct kvd_profile *kvd_store_profile_get(struct kvd_store *s, uint32_t ns, uint32_t id)
{
	const struct kvd_profile *p = kvd_profiles_by_id(&s->prof, id);

	return p && p->ns == ns ? p : NULL;
}

void kvd_store_profile_ref(struct kvd_store *s, const struct kvd_profile *p)
{
	kvd_profiles_ref(p);
}

void kvd_store_profile_unref(struct kvd_store *s, const struct kvd_profile *p)
{
	uint32_t uid = p->uid;
	size_t bytes = kvd_store_profile_bytes(p);

	/* The last reference frees p: its creator gets back what profile_new
	 * charged. */
	if (kvd_profiles_unref(&s->prof, p))
		profile_uncharge(s, uid, bytes);
}

int kvd_store_profile_ns(struct kvd_store *s, uint32_t ns, uint32_t uid,
			 const struct kvd_profile *want, const struct kvd_profile **out, char *msg,
			 size_t msglen)
{
	const struct kvd_profile *old;

	if (ns == KVD_NS_NONE) {
		say(msg, msglen, "uid %u is outside the uids kvd serves (below %u)", uid,
		    KVD_NS_GROUP);
		return -EACCES;
	}
	if ((old = kvd_profiles_find(&s->prof, ns, want->name))) {
		if (!kvd_profiles_same(old, want)) {
			say(msg, msglen, "profile '%s' exists with other fields", want->name);
			return -EEXIST;
		}
		kvd_profiles_ref(old);
		*out = old;
		return 0;
	}
	return profile_new(s, ns, uid, want, out, msg, msglen);
}

int kvd_store_profile(struct kvd_store *s, const struct kvd_profile *want,
		      const struct kvd_profile **out)
{
	const struct kvd_profile *old = kvd_store_profile_by_name(s, want->name);

	if (old) {
		if (!kvd_profiles_same(old, want))
			return -EEXIST;
		*out = old;
		return 0;
	}
	if (!s->lim && s->prof.nglobal == MAX_PROFILES)
		return -ENOSPC;
	/* The reference profile_new gives is never dropped: old-API profiles
	 * live as long as the store, as they always did. */
	return profile_new(s, KVD_STORE_NS_GLOBAL, 0, want, out, NULL, 0);
}

const struct kvd_profile *kvd_store_profile_by_id(struct kvd_store *s, uint32_t id)
{
	return kvd_profiles_by_id(&s->prof, id);
}

const struct kvd_profile *kvd_store_profile_by_name(struct kvd_store *s, const char *name)
{
	return kvd_profiles_find(&s->prof, KVD_STORE_NS_GLOBAL, name);
}

void kvd_store_profile_each(struct kvd_store *s,
			    void (*fn)(void *arg, const struct kvd_profile *p, uint32_t refs),
			    void *arg)
{
	kvd_profiles_each(&s->prof, fn, arg);
}

/* ---- sequences --------------------------------------------------------- */

/* The top bits: ids are already mix64 of a counter and a secret key
 * (kvd_store_seq_create_uid), uniform and not a client's choice, and a
 * bucket is then a range of ids, so listings page in id order bucket by
 * bucket (kvd_store_each_after). */
static uint32_t bucket_of(uint64_t id)
{
	return (uint32_t)(id >> (64 - SEQ_BUCKET_BITS));
}

static struct kvd_seqn *seq_find(struct kvd_store *s, uint64_t id)
{
	for (struct kvd_seqn *q = s->bucket[bucket_of(id)]; q; q = q->next)
		if (q->id == id)
			return q;
	return NULL;
}

uint32_t kvd_store_tenant_uid(const char *tenant)
{
	uint64_t v = 0;
	const char *t = tenant;

	for (; *t >= '0' && *t <= '9' && v <= UINT32_MAX; t++)
		v = v * 10 + (uint64_t)(*t - '0');
	return t > tenant && *t == ':' && v <= UINT32_MAX ? (uint32_t)v : 0;
}

static int seq_new(struct kvd_store *s, const struct kvd_profile *p, uint32_t uid,
		   const char *tenant, uint64_t id, uint64_t owner, struct kvd_seqn **out,
		   char *msg, size_t msglen)
{
	size_t fixed = sizeof(struct kvd_seqn) + (size_t)p->layers * sizeof(struct kvd_layer_state) +
		       s->seq_extra;
	struct kvd_seqn *q;
	int rc;

	if (s->lim) {
		if ((rc = kvd_limits_charge(s->lim, uid, KVD_RES_SEQUENCES, 1, msg, msglen)))
			return rc;
		if ((rc = mem_charge(s, uid, fixed, msg, msglen))) {
			kvd_limits_uncharge(s->lim, uid, KVD_RES_SEQUENCES, 1);
			return rc;
		}
	}
	q = calloc(1, sizeof *q);
	if (q && !(q->ly = calloc(p->layers, sizeof *q->ly))) {
		free(q);
		q = NULL;
	}
	if (q && own(s, q, owner)) {
		free(q->ly);
		free(q);
		q = NULL;
	}
	if (!q) {
		if (s->lim) {
			kvd_limits_uncharge(s->lim, uid, KVD_RES_MEMORY, fixed);
			kvd_limits_uncharge(s->lim, uid, KVD_RES_SEQUENCES, 1);
		}
		say(msg, msglen, "out of memory");
		return -ENOMEM;
	}
	q->uid = uid;
	q->fixed = fixed;
	q->id = id;
	/* The node with the fewest resident bytes; ties go round robin. */
	q->node = (uint32_t)(s->picks++ % s->nnodes);
	for (unsigned i = 0; i < s->nnodes; i++)
		if (s->node_bytes[i] < s->node_bytes[q->node])
			q->node = i;
	snprintf(q->tenant, sizeof q->tenant, "%s", tenant);
	q->p = p;
	kvd_store_profile_ref(s, p);
	s->fixed += fixed;
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
	return kvd_store_seq_create_uid(s, p, kvd_store_tenant_uid(tenant), tenant, owner, out,
					NULL, 0);
}

int kvd_store_seq_create_uid(struct kvd_store *s, const struct kvd_profile *p, uint32_t uid,
			     const char *tenant, uint64_t owner, struct kvd_seqn **out, char *msg,
			     size_t msglen)
{
	uint64_t id;

	/* mix64 is a bijection, so distinct counters give distinct ids within
	 * a lifetime; ids adopted from disk come from other lifetimes, hence
	 * the lookup.  0 is skipped because clients use it as "none". */
	do
		id = kvd_mix64(++s->next_id ^ s->id_key);
	while (id == 0 || seq_find(s, id));
	return seq_new(s, p, uid, tenant, id, owner, out, msg, msglen);
}

int kvd_store_seq_adopt(struct kvd_store *s, const struct kvd_profile *p, const char *tenant,
			uint64_t id, uint64_t owner, struct kvd_seqn **out)
{
	if (id == 0 || seq_find(s, id))
		return -EEXIST;
	return seq_new(s, p, kvd_store_tenant_uid(tenant), tenant, id, owner, out, NULL, 0);
}

struct kvd_seqn *kvd_store_seq_get(struct kvd_store *s, uint64_t id, const char *tenant)
{
	struct kvd_seqn *q = seq_find(s, id);

	return q && !q->hidden && !strcmp(q->tenant, tenant) ? q : NULL;
}

struct kvd_seqn *kvd_store_seq_any(struct kvd_store *s, uint64_t id)
{
	struct kvd_seqn *q = seq_find(s, id);

	/* kvd_tier_free empties the tenant of one it frees later.  A published
	 * snapshot belongs to the share table: not even an admin frees it. */
	return q && q->tenant[0] && !q->hidden ? q : NULL;
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

static int by_id(const void *a, const void *b)
{
	uint64_t x = (*(struct kvd_seqn *const *)a)->id, y = (*(struct kvd_seqn *const *)b)->id;

	return x < y ? -1 : x > y;
}

uint64_t kvd_store_each_after(struct kvd_store *s, uint64_t after, uint32_t budget,
			      int (*fn)(void *arg, struct kvd_seqn *q), void *arg)
{
	struct kvd_seqn *stack[64], **v = stack;
	uint32_t cap = 64, seen = 0;
	uint64_t next = 0;

	for (uint32_t b = bucket_of(after); b < SEQ_BUCKETS; b++) {
		uint32_t n = 0;

		for (struct kvd_seqn *q = s->bucket[b]; q; q = q->next) {
			seen++;
			if (q->id <= after)
				continue;
			if (n == cap) {
				struct kvd_seqn **w = malloc(2 * cap * sizeof *w);

				if (!w) {
					/* out of memory: the same page again next time */
					next = after;
					goto out;
				}
				memcpy(w, v, n * sizeof *v);
				if (v != stack)
					free(v);
				v = w;
				cap *= 2;
			}
			v[n++] = q;
		}
		qsort(v, n, sizeof *v, by_id);
		for (uint32_t i = 0; i < n; i++)
			if (fn(arg, v[i])) {
				next = v[i]->id;
				goto out;
			}
		/* the last id of bucket b's range: past `after`, or the page
		 * would not move */
		next = ((uint64_t)(b + 1) << (64 - SEQ_BUCKET_BITS)) - 1;
		if (seen >= budget && b + 1 < SEQ_BUCKETS && next > after)
			goto out;
		next = 0;
	}
out:
	if (v != stack)
		free(v);
	return next;
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
	seq_destroy(s, q);
}

/* ---- rows -------------------------------------------------------------- */

static size_t rows_bytes(const struct kvd_profile *p, uint32_t cap)
{
	return 2 * kv_bytes(p, cap) + codes_bytes(p, cap);
}

/* Copies n rows (of a [H][n][d] / [H][L][n] batch, starting at row `from`)
 * into a [H][cap][d] / [H][L][cap] buffer at row `at`. */
struct put_job {
	const struct kvd_profile *p;
	uint16_t *dk, *dv, *dc;
	const uint16_t *k, *v, *c;
	size_t cap, at, n, from, cnt;
};

/* A task copies rows [r0, r1) of one head: chunks, not whole heads, so a
 * task stays a few milliseconds even when staging moves to a bigger buffer
 * (a segment's worth of rows into fresh pages). */
#define PUT_ROWS_PER_TASK 4096u

static uint32_t put_chunks(size_t cnt)
{
	return (uint32_t)((cnt + PUT_ROWS_PER_TASK - 1) / PUT_ROWS_PER_TASK);
}

static void put_head(void *arg, uint32_t task, unsigned worker)
{
	const struct put_job *j = arg;
	size_t d = j->p->g.d, L = j->p->g.L, per = put_chunks(j->cnt);
	size_t h = task / per, r0 = task % per * PUT_ROWS_PER_TASK;
	size_t m = j->cnt - r0 < PUT_ROWS_PER_TASK ? j->cnt - r0 : PUT_ROWS_PER_TASK;
	size_t at = j->at + r0, from = j->from + r0;

	memcpy(j->dk + (h * j->cap + at) * d, j->k + (h * j->n + from) * d, m * d * sizeof *j->k);
	memcpy(j->dv + (h * j->cap + at) * d, j->v + (h * j->n + from) * d, m * d * sizeof *j->v);
	for (size_t t = 0; t < L; t++)
		memcpy(j->dc + (h * L + t) * j->cap + at, j->c + (h * L + t) * j->n + from,
		       m * sizeof *j->c);
}

/* Big copies (a prefill chunk, staging moving to a bigger buffer: up to a
 * segment, hundreds of MB of fresh pages) go over the pool, sliced so the
 * daemon's executor answers other clients in between; small ones (a decoded
 * token) are not worth a pool job. */
#define PUT_POOL_BYTES (1u << 20)

static void put_rows_on(struct kvd_pool *pool, const struct kvd_profile *p, uint16_t *dk,
			uint16_t *dv, uint16_t *dc, uint32_t cap, uint32_t at, const uint16_t *k,
			const uint16_t *v, const uint16_t *c, uint32_t n, uint32_t from, uint32_t cnt)
{
	struct put_job j = { p, dk, dv, dc, k, v, c, cap, at, n, from, cnt };
	uint32_t tasks = p->g.kv_heads * put_chunks(cnt);

	if (!cnt)
		return;
	if (pool && rows_bytes(p, cnt) >= PUT_POOL_BYTES) {
		size_t d = p->g.d, H = p->g.kv_heads, L = p->g.L;

		/* What the copy writes, from the first head's row `at` to the
		 * last head's last: fresh pages (a new staging buffer or tail)
		 * faulted while others' requests run (pool.h). */
		kvd_pool_prefault(pool, dk + at * d, ((H - 1) * cap + cnt) * d * sizeof *dk);
		kvd_pool_prefault(pool, dv + at * d, ((H - 1) * cap + cnt) * d * sizeof *dv);
		kvd_pool_prefault(pool, dc + at, ((H * L - 1) * cap + cnt) * sizeof *dc);
		kvd_pool_run_sliced(pool, tasks, put_head, &j);
		return;
	}
	for (uint32_t t = 0; t < tasks; t++)
		put_head(&j, t, 0);
}

static void put_rows(const struct kvd_profile *p, uint16_t *dk, uint16_t *dv, uint16_t *dc,
		     uint32_t cap, uint32_t at, const uint16_t *k, const uint16_t *v,
		     const uint16_t *c, uint32_t n, uint32_t from, uint32_t cnt)
{
	put_rows_on(NULL, p, dk, dv, dc, cap, at, k, v, c, n, from, cnt);
}

/* ---- tails (struct kvd_tail: shared copy-on-write by forks) ------------ */

/* What a tail costs: its three buffers of seal_tokens rows and the
 * struct. */
static size_t tail_bytes(const struct kvd_profile *p)
{
	return rows_bytes(p, p->seal_tokens) + sizeof(struct kvd_tail);
}

static void tail_set(struct kvd_layer_state *l, struct kvd_tail *t)
{
	l->tail = t;
	l->tail_k = t ? t->k : NULL;
	l->tail_v = t ? t->v : NULL;
	l->tail_codes = t ? t->codes : NULL;
}

/* t, charged to q's uid already, becomes q's with one reference. */
static void tail_own_charged(struct kvd_store *s, struct kvd_seqn *q, struct kvd_tail *t)
{
	size_t tb = tail_bytes(q->p);

	t->refs = 1;
	t->chg_uid = q->uid;
	t->chg_node = q->node;
	q->bytes += tb;
	s->bytes += tb;
	s->node_bytes[q->node] += tb;
}

/* A new, empty tail for q, charged to q's uid before it is allocated
 * (force: the room was reserved, a restore).  Not yet in a layer. */
static int tail_new(struct kvd_store *s, struct kvd_seqn *q, int force, struct kvd_tail **out)
{
	const struct kvd_profile *p = q->p;
	size_t tb = tail_bytes(p);
	struct kvd_tail *t;
	int rc;

	if ((rc = charge_q(s, q, tb, force)))
		return rc;
	if (!(t = calloc(1, sizeof *t)) ||
	    rows_alloc(p, &t->k, &t->v, &t->codes, p->seal_tokens, s->mem[q->node])) {
		free(t);
		uncharge_q(s, q, tb);
		snprintf(s->why, sizeof s->why, "out of memory");
		return -ENOMEM;
	}
	tail_own_charged(s, q, t);
	*out = t;
	return 0;
}

/* q's layer b takes a reference on t (a fork): counted in q's bytes, not
 * charged again. */
static void tail_hold(struct kvd_seqn *q, struct kvd_layer_state *b, struct kvd_tail *t)
{
	q->bytes += tail_bytes(q->p);
	t->refs++;
	tail_set(b, t);
}

/* One holder lets go of t; the last frees and uncharges it. */
static void tail_unref(struct kvd_store *s, const struct kvd_profile *p, struct kvd_tail *t)
{
	size_t tb = tail_bytes(p);

	if (NEVER(t->refs == 0) || --t->refs)
		return;
	s->bytes -= tb;
	s->node_bytes[t->chg_node] -= tb;
	uncharge(s, t->chg_uid, tb);
	rows_free(p, t->k, t->v, t->codes, p->seal_tokens);
	free(t);
}

/* l lets go of its tail (if any); the last holder frees and uncharges it. */
static void tail_put(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l)
{
	struct kvd_tail *t = l->tail;

	if (!t)
		return;
	tail_set(l, NULL);
	q->bytes -= tail_bytes(q->p);
	tail_unref(s, q->p, t);
}

struct kvd_tail *kvd_store_tail_hold(struct kvd_seqn *q, uint32_t layer)
{
	struct kvd_tail *t = layer < q->p->layers ? q->ly[layer].tail : NULL;

	if (t) {
		t->refs++;
		t->io++;
	}
	return t;
}

void kvd_store_tail_bufs(const struct kvd_tail *t, const uint16_t **k, const uint16_t **v,
			 const uint16_t **codes)
{
	*k = t->k;
	*v = t->v;
	*codes = t->codes;
}

void kvd_store_tail_drop(struct kvd_store *s, const struct kvd_profile *p, struct kvd_tail *t)
{
	if (!t || NEVER(t->io == 0))
		return;
	t->io--;
	tail_unref(s, p, t);
}

/* Whether an APPEND of n rows to l needs a tail made or copied first.  A
 * tail that only write-backs share with l stays: they read the rows
 * [0, tail_n) they found, and an APPEND that does not reach seal_tokens
 * writes only after them (one that seals starts the rows over at 0). */
static int tail_copy_needed(const struct kvd_profile *p, const struct kvd_layer_state *l,
			    uint32_t n)
{
	const struct kvd_tail *t = l->tail;

	if (!t)
		return 1;
	return t->refs - t->io > 1 || (t->io && (uint64_t)l->tail_n + n >= p->seal_tokens);
}

/* Before q writes into l's tail (an APPEND): a tail of its own, made when
 * it has none and copied when it shares one.  Only the rows [0, tail_n)
 * are copied, one layer per call, inside the APPEND's unit (sliced over
 * the pool when big) -- not every layer at the fork, under the state
 * lock.  Charged before anything changes: a refusal leaves l as it was. */
static int tail_own(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l, uint32_t n)
{
	const struct kvd_profile *p = q->p;
	struct kvd_tail *t, *old = l->tail;
	int rc;

	if (!tail_copy_needed(p, l, n))
		return 0;
	if ((rc = tail_new(s, q, 0, &t)))
		return rc;
	if (old)
		put_rows_on(s->pool[q->node], p, t->k, t->v, t->codes, p->seal_tokens, 0, old->k,
			    old->v, old->codes, p->seal_tokens, 0, l->tail_n);
	tail_put(s, q, l);
	tail_set(l, t);
	return 0;
}

/* The table of a layer with room for n segments (the growth of seg_room). */
static uint32_t seg_cap(uint32_t n)
{
	uint32_t c = 0;

	while (c < n)
		c = c ? 2 * c : 4;
	return c;
}

/* Room in l->seg for one more segment, charged to q.  0 or -ENOMEM /
 * -EDQUOT. */
static int seg_room(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l, int force)
{
	if (l->nseg == l->segcap) {
		uint32_t nc = seg_cap(l->segcap + 1);
		size_t more = (size_t)(nc - l->segcap) * sizeof(struct kvd_seg *);
		struct kvd_seg **ns;
		int rc;

		if ((rc = take(s, q, more, force)))
			return rc;
		if (!(ns = realloc(l->seg, nc * sizeof *ns))) {
			give(s, q, more);
			return -ENOMEM;
		}
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
	struct kvd_seg *seg;
	size_t sb;
	int rc;

	if (cnt == 0)
		return 0;
	if ((rc = seg_room(s, q, l, 0)))
		return rc;
	/* The segment is charged before kvd_seg_build allocates it. */
	sb = kvd_seg_io_bytes(&p->g, cnt);
	if ((rc = take(s, q, sb, 0)))
		return rc;
	rc = kvd_seg_build_node(&p->g, cnt, cap, k, v, c, s->pool[q->node], s->mem[q->node], &seg);
	if (rc) {
		give(s, q, sb);
		return rc;
	}
	/* From here the segment carries its charge (seg_new), not q. */
	account(s, q, -(ptrdiff_t)sb);
	if (seg->bytes != sb) {         /* kvd_seg_io_bytes is its size: never, but stay exact */
		uncharge(s, q->uid, sb);
		charge(s, q->uid, seg->bytes, 1);
	}
	seg_new(s, q, seg);
	l->seg[l->nseg++] = seg;
	return 0;
}

/* The staging size for `need` rows: it grows geometrically from what is
 * needed (double the old size, at least `need`, at most a segment) -- or
 * exactly `need` when kvd_store_rows found that doubling does not fit the
 * budget.  Never 1024 rows for one token: that broke the wall. */
static uint32_t staging_cap(const struct kvd_store *s, const struct kvd_profile *p,
			    uint32_t scap, uint32_t need)
{
	uint32_t cap = !s->exact && scap * 2 > need ? scap * 2 : need;

	return cap > p->seg_tokens ? p->seg_tokens : cap;
}

/* Staging for `need` rows, charged before it is allocated: the new buffer
 * in full while the old one is still held. */
static int grow_staging(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l,
			uint32_t need)
{
	const struct kvd_profile *p = q->p;
	uint32_t cap = staging_cap(s, p, l->stage_cap, need);
	uint16_t *nk, *nv, *nc;
	int rc;

	if (need <= l->stage_cap)
		return 0;
	if ((rc = take(s, q, rows_bytes(p, cap), 0)))
		return rc;
	if (rows_alloc(p, &nk, &nv, &nc, cap, s->mem[q->node])) {
		give(s, q, rows_bytes(p, cap));
		return -ENOMEM;
	}
	if (l->stage_n)
		put_rows_on(s->pool[q->node], p, nk, nv, nc, cap, 0, l->stage_k, l->stage_v,
			    l->stage_codes, l->stage_cap, 0, l->stage_n);
	rows_free(p, l->stage_k, l->stage_v, l->stage_codes, l->stage_cap);
	give(s, q, rows_bytes(p, l->stage_cap));
	l->stage_k = nk;
	l->stage_v = nv;
	l->stage_codes = nc;
	l->stage_cap = cap;
	return 0;
}

static void drop_staging(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l)
{
	rows_free(q->p, l->stage_k, l->stage_v, l->stage_codes, l->stage_cap);
	give(s, q, rows_bytes(q->p, l->stage_cap));
	l->stage_k = l->stage_v = l->stage_codes = NULL;
	l->stage_cap = l->stage_n = 0;
}

static int prefill(struct kvd_store *s, struct kvd_seqn *q, struct kvd_layer_state *l, int last,
		   const uint16_t *k, const uint16_t *v, const uint16_t *c, uint32_t n)
{
	const struct kvd_profile *p = q->p;
	uint32_t done = 0;
	int rc;

	while (done < n) {
		uint32_t cnt = n - done;

		if (cnt > p->seg_tokens - l->stage_n)
			cnt = p->seg_tokens - l->stage_n;
		if ((rc = grow_staging(s, q, l, l->stage_n + cnt)))
			return rc;
		put_rows_on(s->pool[q->node], p, l->stage_k, l->stage_v, l->stage_codes,
			    l->stage_cap, l->stage_n, k, v, c, n, done, cnt);
		l->stage_n += cnt;
		done += cnt;
		l->tokens += cnt;
		if (l->stage_n == p->seg_tokens) {
			if ((rc = seal(s, q, l, l->stage_k, l->stage_v, l->stage_codes, l->stage_cap, l->stage_n)))
				return rc;
			l->stage_n = 0;
		}
	}
	if (last) {
		if ((rc = seal(s, q, l, l->stage_k, l->stage_v, l->stage_codes, l->stage_cap, l->stage_n)))
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

	/* kvd_store_rows made the tail q's own, or one that only write-backs
	 * share and that this APPEND does not seal (tail_own) */
	if (NEVER(!l->tail || l->tail->refs - l->tail->io != 1 ||
		  (l->tail->io && (uint64_t)l->tail_n + n >= cap)))
		return -EINVAL;
	while (done < n) {
		uint32_t cnt = n - done < cap - l->tail_n ? n - done : cap - l->tail_n;

		/* Sliced when big: a profile may seal at 65536 rows, and one
		 * APPEND may bring that many. */
		put_rows_on(s->pool[q->node], p, l->tail_k, l->tail_v, l->tail_codes, cap, l->tail_n,
			    k, v, c, n, done, cnt);
		l->tail_n += cnt;
		done += cnt;
		l->tokens += cnt;
		if (l->tail_n == cap) {
			if ((rc = seal(s, q, l, l->tail_k, l->tail_v, l->tail_codes, cap, cap)))
				return rc;
			l->tail_n = 0;
		}
	}
	return 0;
}

/* A segment of cnt rows sealed, in rows_peak's bookkeeping. */
static void sim_seal(const struct kvd_profile *p, uint32_t *nseg, uint32_t *segcap, uint32_t cnt,
		     uint64_t *cur, uint64_t *peak)
{
	if (*nseg == *segcap) {
		uint32_t nc = seg_cap(*segcap + 1);

		*cur += (uint64_t)(nc - *segcap) * sizeof(struct kvd_seg *);
		*segcap = nc;
	}
	*cur += kvd_seg_io_bytes(&p->g, cnt);
	(*nseg)++;
	*peak = *cur > *peak ? *cur : *peak;
}

/* The most bytes a kvd_store_rows call will have charged at one time
 * (everything is charged before it is allocated, and staging is given back
 * only after its successor is allocated): prefill and append step by step
 * as below, with s->exact as the staging policy. */
static uint64_t rows_peak(const struct kvd_store *s, const struct kvd_seqn *q,
			  const struct kvd_layer_state *l, int is_append, int last, int mean,
			  uint32_t n)
{
	const struct kvd_profile *p = q->p;
	uint64_t cur = mean ? mean_bytes(p) : 0, peak = cur;
	uint32_t nseg = l->nseg, segcap = l->segcap, done = 0;

	if (is_append) {
		uint32_t tn = l->tail_n, cap = p->seal_tokens;

		if (tail_copy_needed(p, l, n))        /* made, or copied (tail_own) */
			peak = cur += tail_bytes(p);
		while (done < n) {
			uint32_t cnt = n - done < cap - tn ? n - done : cap - tn;

			tn += cnt;
			done += cnt;
			if (tn == cap) {
				sim_seal(p, &nseg, &segcap, cap, &cur, &peak);
				tn = 0;
			}
		}
		return peak;
	}
	uint32_t sn = l->stage_n, scap = l->stage_cap;

	while (done < n || sn == p->seg_tokens) {
		uint32_t cnt = n - done < p->seg_tokens - sn ? n - done : p->seg_tokens - sn;

		if (sn + cnt > scap) {
			uint32_t nc = staging_cap(s, p, scap, sn + cnt);

			cur += rows_bytes(p, nc);
			peak = cur > peak ? cur : peak;
			cur -= rows_bytes(p, scap);
			scap = nc;
		}
		sn += cnt;
		done += cnt;
		if (sn == p->seg_tokens) {
			sim_seal(p, &nseg, &segcap, sn, &cur, &peak);
			sn = 0;
		}
	}
	if (last && sn)
		sim_seal(p, &nseg, &segcap, sn, &cur, &peak);
	return peak;
}

/* The end of a rows call: what its reservation did not use goes back. */
static void rows_done(struct kvd_store *s)
{
	if (s->resv_q)
		uncharge(s, s->resv_q->uid, s->resv);
	s->resv_q = NULL;
	s->resv = 0;
}

/* Before a rows call changes anything: the tier's policy for the bytes it
 * needs at least (evict others, or wait for write-backs: -EINPROGRESS),
 * then the wall.  Doubling staging is used when its peak fits, exact
 * growth when only that fits; else the call is refused whole. */
static int rows_budget(struct kvd_store *s, struct kvd_seqn *q, const struct kvd_layer_state *l,
		       int is_append, int last, int mean, uint32_t n, char *msg, size_t msglen)
{
	uint64_t p1, p2;
	int rc;

	s->exact = 0;
	if (!s->lim)
		return 0;
	p2 = rows_peak(s, q, l, is_append, last, mean, n);
	s->exact = 1;
	p1 = rows_peak(s, q, l, is_append, last, mean, n);
	if (s->room && (rc = s->room(s->room_arg, q->uid, p1, msg, msglen)))
		return rc;
	if (!kvd_limits_charge(s->lim, q->uid, KVD_RES_MEMORY, p2, NULL, 0)) {
		s->exact = 0;
		s->resv = p2;
		return 0;
	}
	if ((rc = mem_charge(s, q->uid, p1, msg, msglen)))
		return rc;
	s->resv = p1;
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
	/* The executor asked the tier for the layer first (kvd_tier_want):
	 * rows go only into a layer in RAM, never into one on disk, lost or
	 * still being restored. */
	if (NEVER(layer >= kvd_store_seq_ready_layers(q))) {
		snprintf(msg, msglen, "layer %u is not resident", layer);
		return -EAGAIN;
	}
	l = &q->ly[layer];
	s->why[0] = 0;
	/* Every check before any change, so that a refusal (or a wait for
	 * room) leaves the sequence as it was and the entry can run again. */
	if (mean && l->mean) {
		snprintf(msg, msglen, "layer %u already has its mean", layer);
		return -EINVAL;
	}
	if (!mean && !l->mean) {
		snprintf(msg, msglen, "layer %u: first rows must carry the mean", layer);
		return -EINVAL;
	}
	if (is_append ? !l->sealed : l->sealed) {
		snprintf(msg, msglen, "layer %u: %s", layer,
			 is_append ? "APPEND before the prefill's last chunk" : "PREFILL after the last chunk");
		return -EINVAL;
	}
	if (NEVER(s->resv_q != NULL))
		return -EBUSY;          /* one change at a time: the executor's */
	s->resv = 0;
	if ((rc = rows_budget(s, q, l, is_append, last, mean != NULL, n, s->why, sizeof s->why))) {
		snprintf(msg, msglen, "layer %u: %s", layer, s->why);
		return rc;
	}
	s->resv_q = q;
	/* The tail APPEND writes into: q's own, before the rows change
	 * anything.  Pinned: a big copy yields between its slices. */
	if (is_append) {
		kvd_store_seq_pin(q);
		rc = tail_own(s, q, l, n);
		kvd_store_seq_unpin(q);
		if (rc) {
			snprintf(msg, msglen, "layer %u: %s", layer, s->why);
			rows_done(s);
			return rc;
		}
	}
	if (mean) {
		if ((rc = take(s, q, mean_bytes(p), 0))) {
			snprintf(msg, msglen, "layer %u: %s", layer, s->why);
			rows_done(s);
			return rc;
		}
		l->mean = malloc(mean_bytes(p));
		if (!l->mean) {
			give(s, q, mean_bytes(p));
			snprintf(msg, msglen, "layer %u: out of memory", layer);
			rows_done(s);
			return -ENOMEM;
		}
		memcpy(l->mean, mean, mean_bytes(p));
		q->gen++;
	}
	q->gen++;
	/* The client's rows put for a publish (or kept for an attach to
	 * fetch) describe the sequence as it was: new rows make them stale. */
	local_unref(s, p, q->loc);
	q->loc = NULL;
	/* A seal yields to other requests between its slices (kvd_pool_yield):
	 * pinned, q is not theirs to write out, and the gen after the change
	 * makes stale whatever was seen of it before the change was done. */
	kvd_store_seq_pin(q);
	rc = is_append ? append(s, q, l, k, v, codes, n) : prefill(s, q, l, last, k, v, codes, n);
	q->gen++;
	kvd_store_seq_unpin(q);
	rows_done(s);
	if (rc)
		snprintf(msg, msglen, "layer %u: %s", layer, s->why[0] ? s->why : kvd_strerror(rc));
	return rc;
}

/* ---- tiers ------------------------------------------------------------- */

void kvd_store_seq_drop(struct kvd_store *s, struct kvd_seqn *q)
{
	for (uint32_t i = 0; i < q->p->layers; i++) {
		struct kvd_layer_state *l = &q->ly[i];
		uint64_t tokens = l->tokens;
		int sealed = l->sealed;

		layer_free(s, q, l);
		l->tokens = tokens;
		l->sealed = sealed;
	}
	/* The file holds the client's rows too (a LOCAL extent per layer). */
	local_unref(s, q->p, q->loc);
	q->loc = NULL;
	give(s, q, q->bytes);           /* the struct and layer array (q->fixed) stay */
}

size_t kvd_store_install_bytes(const struct kvd_seqn *q, int mean, uint32_t tn, uint32_t nseg)
{
	const struct kvd_profile *p = q->p;

	return (mean ? mean_bytes(p) : 0) + (tn ? tail_bytes(p) : 0) +
	       (size_t)seg_cap(nseg) * sizeof(struct kvd_seg *);
}

struct kvd_tail *kvd_store_rtail_new(struct kvd_store *s, const struct kvd_seqn *q)
{
	struct kvd_tail *t = calloc(1, sizeof *t);

	if (t && rows_alloc(q->p, &t->k, &t->v, &t->codes, q->p->seal_tokens, s->mem[q->node])) {
		free(t);
		t = NULL;
	}
	return t;
}

void kvd_store_rtail_fill(const struct kvd_profile *p, struct kvd_tail *t, const uint16_t *k,
			  const uint16_t *v, const uint16_t *codes, uint32_t tn)
{
	if (tn <= p->seal_tokens)
		put_rows(p, t->k, t->v, t->codes, p->seal_tokens, 0, k, v, codes, tn, 0, tn);
}

void kvd_store_rtail_free(const struct kvd_profile *p, struct kvd_tail *t)
{
	if (!t || NEVER(t->refs))
		return;
	rows_free(p, t->k, t->v, t->codes, p->seal_tokens);
	free(t);
}

int kvd_store_install_layer(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const float *mean, int sealed, uint64_t tokens, struct kvd_tail *tail,
			    uint32_t tn)
{
	const struct kvd_profile *p = q->p;
	struct kvd_layer_state *l = &q->ly[layer];

	/* Only a restore installs (the tier's read_progress), into a sequence
	 * it set RESTORING and whose dropped layers are empty. */
	if (NEVER(q->state != KVD_SEQ_RESTORING))
		return -EINVAL;
	if (layer >= p->layers || tn > p->seal_tokens || (tn && !sealed) || l->mean || l->tail_k ||
	    l->nseg)
		return -EINVAL;
	if (mean) {
		if (take(s, q, mean_bytes(p), 1))
			return -ENOMEM;
		if (!(l->mean = malloc(mean_bytes(p)))) {
			give(s, q, mean_bytes(p));
			return -ENOMEM;
		}
		memcpy(l->mean, mean, mean_bytes(p));
	}
	if (tn) {
		if (!tail || tail->refs)
			return -EINVAL;
		if (charge_q(s, q, tail_bytes(p), 1))
			return -ENOMEM;
		tail_own_charged(s, q, tail);
		tail_set(l, tail);
	}
	l->tail_n = tn;
	l->sealed = sealed;
	l->tokens = tokens;
	return 0;
}

int kvd_store_install_seg(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			  struct kvd_seg *seg)
{
	struct kvd_layer_state *l = &q->ly[layer];
	int rc;

	/* A restore's (see kvd_store_install_layer), and the segment is the
	 * one kvd_seg_adopt just made: nobody else holds it yet. */
	if (NEVER(q->state != KVD_SEQ_RESTORING || seg->refs != 1))
		return -EINVAL;
	if ((rc = seg_room(s, q, l, 1)) || (rc = charge(s, q->uid, seg->bytes, 1)))
		return rc;
	seg_new(s, q, seg);
	l->seg[l->nseg++] = seg;
	return 0;
}

int kvd_store_spillable(const struct kvd_seqn *q)
{
	for (uint32_t i = 0; i < q->p->layers; i++)
		if (q->ly[i].stage_cap) /* staging exists from a layer's first PREFILL to its LAST */
			return 0;
	return 1;
}

/* What a fork of parent is charged: every layer's mean, estimator state
 * and segment table.  Not the segments nor the tails: they stay charged
 * once, to whoever made them (a tail the child writes into is copied, and
 * charged, then: tail_own). */
static size_t fork_bytes(const struct kvd_seqn *parent)
{
	const struct kvd_profile *p = parent->p;
	size_t n = 0;

	for (uint32_t i = 0; i < p->layers; i++) {
		const struct kvd_layer_state *l = &parent->ly[i];

		n += (l->mean ? mean_bytes(p) : 0) + (l->heavy ? heavy_bytes(p) : 0) +
		     (size_t)l->segcap * sizeof(struct kvd_seg *);
	}
	return n;
}

size_t kvd_store_fork_bytes(const struct kvd_seqn *parent)
{
	return fork_bytes(parent) + parent->fixed;
}

int kvd_store_seq_fork(struct kvd_store *s, struct kvd_seqn *parent, uint32_t uid,
		       const char *tenant, uint64_t owner, struct kvd_seqn **out, char *msg,
		       size_t msglen)
{
	const struct kvd_profile *p = parent->p;
	struct kvd_seqn *q;
	size_t n;
	int rc;

	if (parent->state != KVD_SEQ_RAM && parent->state != KVD_SEQ_SPILLING) {
		say(msg, msglen, "the parent is not resident (on disk or being restored): "
		    "attend it, then fork");
		return -EAGAIN;
	}
	if (!kvd_store_spillable(parent)) {
		say(msg, msglen, "the parent is being prefilled: fork after KVD_RF_LAST");
		return -EBUSY;
	}
	if ((rc = kvd_store_seq_create_uid(s, p, uid, tenant, owner, &q, msg, msglen)))
		return rc;
	/* Its node: the segments it shares live there. */
	q->node = parent->node;
	n = fork_bytes(parent);
	if ((rc = take(s, q, n, 0))) {
		say(msg, msglen, "%s", s->why);
		kvd_store_seq_free(s, q);
		return rc;
	}
	for (uint32_t i = 0; i < p->layers; i++) {
		const struct kvd_layer_state *a = &parent->ly[i];
		struct kvd_layer_state *b = &q->ly[i];

		b->sealed = a->sealed;
		b->tokens = a->tokens;
		b->tail_n = a->tail_n;
		if (a->mean && !(b->mean = malloc(mean_bytes(p))))
			goto oom;
		if (a->mean)
			memcpy(b->mean, a->mean, mean_bytes(p));
		/* The estimator's state too: the child answers its next step as
		 * the parent would. */
		if (a->heavy && !(b->heavy = malloc(heavy_bytes(p))))
			goto oom;
		if (a->heavy)
			memcpy(b->heavy, a->heavy, heavy_bytes(p));
		if (a->segcap && !(b->seg = malloc(a->segcap * sizeof *b->seg)))
			goto oom;
		b->segcap = a->segcap;
		for (uint32_t j = 0; j < a->nseg; j++)
			b->seg[b->nseg++] = seg_hold(q, a->seg[j]);
		/* Shared, not copied: under the state lock a fork costs no
		 * copy of every layer's open rows (tail_own copies one layer
		 * when either side next appends to it). */
		if (a->tail)
			tail_hold(q, b, a->tail);
	}
	*out = q;
	return 0;
oom:
	/* Everything was charged up front; free gives back what is held. */
	say(msg, msglen, "out of memory");
	kvd_store_seq_free(s, q);
	return -ENOMEM;
}

struct kvd_layer_view kvd_store_view(const struct kvd_seqn *q, uint32_t layer)
{
	const struct kvd_layer_state *l = &q->ly[layer];

	return (struct kvd_layer_view){
		.seg = (const struct kvd_seg *const *)l->seg, .nseg = l->nseg,
		.tail_k = l->tail_k, .tail_v = l->tail_v, .tail_n = l->tail_n,
		.tail_cap = q->p->seal_tokens,
	};
}

int kvd_store_attend_ready(const struct kvd_seqn *q, uint32_t layer)
{
	const struct kvd_layer_state *l = &q->ly[layer];

	return l->mean && !l->sealed ? -EBUSY : 0;
}

int kvd_store_attend_view(struct kvd_store *s, uint64_t id, const char *tenant, uint32_t pid,
			  uint32_t layer, const struct kvd_pool *pool,
			  struct kvd_store_attend_view *v, char *msg, size_t msglen)
{
	struct kvd_seqn *q = kvd_store_seq_get(s, id, tenant);
	int rc;

	if (!q || q->p->id != pid)
		return say(msg, msglen, "sequence %llu is gone", (unsigned long long)id), -ENOENT;
	if (pool && s->pool[q->node] != pool)
		return 1;
	if (NEVER(layer >= q->p->layers))
		return say(msg, msglen, "layer %u of %u", layer, q->p->layers), -EINVAL;
	if (s->want && (rc = s->want(s->want_arg, q, layer, msg, msglen)))
		return rc;
	/* The tier said the layer is in RAM (without a tier, all is):
	 * attending one that is not would silently answer from nothing. */
	if (NEVER(layer >= kvd_store_seq_ready_layers(q)))
		return say(msg, msglen, "layer %u is not resident", layer), -EAGAIN;
	if ((rc = kvd_store_attend_ready(q, layer)))
		return say(msg, msglen, "layer %u is still being prefilled", layer), rc;
	*v = (struct kvd_store_attend_view){
		.q = q, .p = q->p, .lv = kvd_store_view(q, layer),
		.heavy = kvd_store_layer_heavy(s, q, layer),
		.pool = s->pool[q->node], .node = q->node,
	};
	return 0;
}

uint64_t kvd_store_seq_id(const struct kvd_seqn *q)
{
	return q->id;
}

uint64_t kvd_store_seq_owner(const struct kvd_seqn *q)
{
	return q->owner;
}

uint32_t kvd_store_seq_uid(const struct kvd_seqn *q)
{
	return q->uid;
}

const char *kvd_store_seq_tenant(const struct kvd_seqn *q)
{
	return q->tenant;
}

const struct kvd_profile *kvd_store_seq_profile(const struct kvd_seqn *q)
{
	return q->p;
}

size_t kvd_store_seq_bytes(const struct kvd_seqn *q)
{
	return q->bytes;
}

size_t kvd_store_seq_freeable(const struct kvd_seqn *q)
{
	size_t n = q->bytes + (q->loc && q->loc->refs == 1 ? q->loc->bytes : 0);

	for (uint32_t i = 0; i < q->p->layers; i++) {
		for (uint32_t j = 0; j < q->ly[i].nseg; j++)
			if (q->ly[i].seg[j]->refs > 1)
				n -= q->ly[i].seg[j]->bytes;
		/* a write-back's hold ends with its write */
		if (q->ly[i].tail && q->ly[i].tail->refs - q->ly[i].tail->io > 1)
			n -= tail_bytes(q->p);
	}
	return n;
}

void kvd_store_seq_pin(struct kvd_seqn *q)
{
	q->pins++;
}

void kvd_store_seq_unpin(struct kvd_seqn *q)
{
	if (NEVER(q->pins == 0))
		return;
	q->pins--;
}

int kvd_store_seq_pinned(const struct kvd_seqn *q)
{
	return q->pins != 0;
}

/* A set of pointers, each with a count (kvd_store_freeable_set). */
struct ptr_count {
	const void *p;
	uint32_t n;
};

static void pc_add(struct ptr_count *t, size_t mask, const void *p)
{
	size_t i = (size_t)kvd_mix64((uint64_t)(uintptr_t)p) & mask;

	while (t[i].p && t[i].p != p)
		i = (i + 1) & mask;
	t[i].p = p;
	t[i].n++;
}

/* How many of p's holders were added, counted once: 0 after the first ask. */
static uint32_t pc_take(struct ptr_count *t, size_t mask, const void *p)
{
	size_t i = (size_t)kvd_mix64((uint64_t)(uintptr_t)p) & mask;
	uint32_t n;

	while (t[i].p != p)
		i = (i + 1) & mask;
	n = t[i].n;
	t[i].n = 0;
	return n;
}

uint64_t kvd_store_freeable_set(struct kvd_seqn *const *qs, size_t n)
{
	uint64_t got = 0, upper = 0;
	size_t held = 0, cap = 16;
	struct ptr_count *t;

	for (size_t k = 0; k < n; k++) {
		const struct kvd_seqn *q = qs[k];

		upper += q->bytes + q->fixed + (q->loc ? q->loc->bytes : 0);
		held += 1;
		for (uint32_t i = 0; i < q->p->layers; i++)
			held += q->ly[i].nseg + 1;
	}
	while (cap < 2 * held)
		cap *= 2;
	/* Without the room to count, the upper bound: nothing is dropped
	 * that could have made the room. */
	if (!(t = calloc(cap, sizeof *t)))
		return upper;
	for (size_t k = 0; k < n; k++) {
		const struct kvd_seqn *q = qs[k];
		uint64_t own = q->bytes + q->fixed;

		for (uint32_t i = 0; i < q->p->layers; i++) {
			for (uint32_t j = 0; j < q->ly[i].nseg; j++) {
				own -= q->ly[i].seg[j]->bytes;
				pc_add(t, cap - 1, q->ly[i].seg[j]);
			}
			if (q->ly[i].tail) {
				own -= tail_bytes(q->p);
				pc_add(t, cap - 1, q->ly[i].tail);
			}
		}
		got += own;
		if (q->loc)
			pc_add(t, cap - 1, q->loc);
	}
	/* A segment, an open tail or a blob of client rows goes when every
	 * holder is in the set: their refs are their holders. */
	for (size_t k = 0; k < n; k++) {
		const struct kvd_seqn *q = qs[k];

		for (uint32_t i = 0; i < q->p->layers; i++) {
			for (uint32_t j = 0; j < q->ly[i].nseg; j++) {
				const struct kvd_seg *sg = q->ly[i].seg[j];

				if (pc_take(t, cap - 1, sg) == sg->refs)
					got += sg->bytes;
			}
			if (q->ly[i].tail && pc_take(t, cap - 1, q->ly[i].tail) == q->ly[i].tail->refs)
				got += tail_bytes(q->p);
		}
		if (q->loc && pc_take(t, cap - 1, q->loc) == q->loc->refs)
			got += q->loc->bytes;
	}
	free(t);
	return got;
}

uint64_t kvd_store_seq_gen(const struct kvd_seqn *q)
{
	return q->gen;
}

enum kvd_seq_state kvd_store_seq_state(const struct kvd_seqn *q)
{
	return (enum kvd_seq_state)q->state;
}

uint32_t kvd_store_seq_ready_layers(const struct kvd_seqn *q)
{
	switch (q->state) {
	case KVD_SEQ_RAM:
	case KVD_SEQ_SPILLING:
		return q->p->layers;
	case KVD_SEQ_RESTORING:
		return q->ready;
	}
	return 0;
}

uint32_t kvd_store_seq_node(const struct kvd_seqn *q)
{
	return q->node;
}

int kvd_store_seq_claim(struct kvd_store *s, struct kvd_seqn *q, uint64_t owner)
{
	if (q->hidden || (q->owner && q->owner != owner))
		return -EBUSY;
	return q->owner == owner ? 0 : own(s, q, owner);
}

const float *kvd_store_layer_mean(const struct kvd_seqn *q, uint32_t layer)
{
	return q->ly[layer].mean;
}

uint64_t kvd_store_layer_tokens(const struct kvd_seqn *q, uint32_t layer)
{
	return q->ly[layer].tokens;
}

const uint16_t *kvd_store_layer_tail_codes(const struct kvd_seqn *q, uint32_t layer)
{
	return q->ly[layer].tail_codes;
}

uint32_t *kvd_store_layer_heavy(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer)
{
	const struct kvd_profile *p = q->p;
	struct kvd_layer_state *l;
	size_t n = heavy_bytes(p);

	if (p->estimator == KVD_EST_MAGICPIG || layer >= p->layers || p->dense[layer] ||
	    layer >= kvd_store_seq_ready_layers(q))
		return NULL;
	l = &q->ly[layer];
	if (!l->heavy) {
		/* A refused charge is no error: the layer is attended without
		 * state. */
		if (take(s, q, n, 0))
			return NULL;
		if (!(l->heavy = calloc(1, n))) {
			give(s, q, n);
			return NULL;
		}
	}
	/* The step rewrites it: a file written before holds other lists, and
	 * a sequence dropped for it would come back answering differently. */
	q->gen++;
	return l->heavy;
}

size_t kvd_store_heavy_bytes(const struct kvd_seqn *q)
{
	return heavy_bytes(q->p);
}

int kvd_store_install_heavy(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const uint32_t *words)
{
	const struct kvd_profile *p = q->p;
	struct kvd_layer_state *l;
	size_t n = heavy_bytes(p);

	/* A restore's (see kvd_store_install_layer). */
	if (NEVER(q->state != KVD_SEQ_RESTORING))
		return -EINVAL;
	if (p->estimator == KVD_EST_MAGICPIG || layer >= p->layers || p->dense[layer] ||
	    q->ly[layer].heavy)
		return -EINVAL;
	l = &q->ly[layer];
	/* Counted before it exists, as kvd_store_layer_heavy does: the charge
	 * never falls below what is held. */
	if (take(s, q, n, 1))
		return -ENOMEM;
	if (!(l->heavy = malloc(n))) {
		give(s, q, n);
		return -ENOMEM;
	}
	memcpy(l->heavy, words, n);
	return 0;
}

void kvd_store_stats(const struct kvd_store *s, struct kvd_store_stats *st)
{
	st->sequences = s->nseq;
	st->profiles = s->prof.n;
	st->bytes = s->bytes;
	st->profile_bytes = s->prof.bytes;
	st->fixed_bytes = s->fixed;
	st->local_bytes = s->local_bytes;
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

/* ---- the client's own rows (prefix sharing) ----------------------------- */

static size_t local_layer_bytes(const struct kvd_profile *p, uint32_t cap)
{
	return 2 * kv_bytes(p, cap);
}

static void local_unref(struct kvd_store *s, const struct kvd_profile *p, struct kvd_local *b)
{
	if (!b || NEVER(b->refs == 0) || --b->refs)
		return;
	for (uint32_t l = 0; l < p->layers; l++) {
		free(b->ly[l].k);
		free(b->ly[l].v);
	}
	s->local_bytes -= b->bytes;
	uncharge(s, b->uid, b->bytes);
	free(b);
}

/* q's own blob, made (or unshared: a snapshot's rows never change) for a
 * put.  The struct is charged like its rows. */
static int local_own(struct kvd_store *s, struct kvd_seqn *q, int force)
{
	const struct kvd_profile *p = q->p;
	size_t n = sizeof(struct kvd_local) + p->layers * sizeof(struct kvd_local_layer);
	struct kvd_local *b;
	int rc;

	if (q->loc && q->loc->refs == 1)
		return 0;
	if ((rc = charge(s, q->uid, n, force)))
		return rc;
	if (!(b = calloc(1, n))) {
		uncharge(s, q->uid, n);
		snprintf(s->why, sizeof s->why, "out of memory");
		return -ENOMEM;
	}
	b->refs = 1;
	b->uid = q->uid;
	b->bytes = n;
	s->local_bytes += n;
	local_unref(s, p, q->loc);
	q->loc = b;
	return 0;
}

static int local_put(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer, uint32_t row0,
		     const uint16_t *k, const uint16_t *v, uint32_t n, int force, char *msg,
		     size_t msglen);

int kvd_store_local_put(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer, uint32_t row0,
			const uint16_t *k, const uint16_t *v, uint32_t n, char *msg, size_t msglen)
{
	return local_put(s, q, layer, row0, k, v, n, 0, msg, msglen);
}

int kvd_store_install_local(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer,
			    const uint16_t *k, const uint16_t *v, uint32_t n)
{
	if (NEVER(q->state != KVD_SEQ_RESTORING))
		return -EINVAL;
	if (layer >= q->p->layers || (q->loc && q->loc->ly[layer].n))
		return -EINVAL;
	return local_put(s, q, layer, 0, k, v, n, 1, NULL, 0);
}

static int local_put(struct kvd_store *s, struct kvd_seqn *q, uint32_t layer, uint32_t row0,
		     const uint16_t *k, const uint16_t *v, uint32_t n, int force, char *msg,
		     size_t msglen)
{
	const struct kvd_profile *p = q->p;
	const size_t H = p->g.kv_heads, d = p->g.d;
	struct kvd_local_layer *l;
	uint32_t have = q->loc ? q->loc->ly[layer].n : 0;
	uint64_t need;
	int rc;

	if (layer >= p->layers || !n)
		return say(msg, msglen, "layer %u, %u rows", layer, n), -EINVAL;
	if (row0 != 0 && row0 != have)
		return say(msg, msglen, "rows must continue at %u (or start again at 0), not %u",
			   have, row0), -EINVAL;
	need = (uint64_t)row0 + n;
	if (need > UINT32_MAX / 2)
		return say(msg, msglen, "%llu rows of layer %u", (unsigned long long)need, layer),
		       -E2BIG;
	if ((rc = local_own(s, q, force))) {
		say(msg, msglen, "%s", s->why);
		return rc;
	}
	if (!force)             /* a restore puts back what the file holds */
		q->gen++;
	l = &q->loc->ly[layer];
	if (row0 == 0)
		l->n = 0;
	if (need > l->cap) {
		uint32_t cap = l->cap ? l->cap : 64;
		size_t more;
		uint16_t *nk, *nv;

		while (cap < need)
			cap *= 2;
		more = local_layer_bytes(p, cap) - local_layer_bytes(p, l->cap);
		if ((rc = charge(s, q->uid, more, force))) {
			say(msg, msglen, "%s", s->why);
			return rc;
		}
		nk = malloc(kv_bytes(p, cap));
		nv = malloc(kv_bytes(p, cap));
		if (!nk || !nv) {
			free(nk);
			free(nv);
			uncharge(s, q->uid, more);
			return say(msg, msglen, "out of memory"), -ENOMEM;
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
		q->loc->bytes += more;
		s->local_bytes += more;
	}
	for (size_t h = 0; h < H; h++) {
		memcpy(l->k + (h * l->cap + l->n) * d, k + h * n * d, (size_t)n * d * 2);
		memcpy(l->v + (h * l->cap + l->n) * d, v + h * n * d, (size_t)n * d * 2);
	}
	l->n += n;
	return 0;
}

size_t kvd_store_local_need(const struct kvd_seqn *q, uint32_t layer, uint32_t row0, uint32_t n)
{
	const struct kvd_profile *p = q->p;
	const struct kvd_local_layer *l = q->loc && q->loc->refs == 1 ? &q->loc->ly[layer] : NULL;
	uint32_t have = l ? l->cap : 0, cap = have ? have : 64;
	uint64_t need = (uint64_t)row0 + n;
	size_t more = q->loc && q->loc->refs == 1 ? 0 :
		      sizeof(struct kvd_local) + p->layers * sizeof(struct kvd_local_layer);

	if (layer >= p->layers || need > UINT32_MAX / 2)
		return 0;
	if (need <= have)
		return more;
	while (cap < need)
		cap *= 2;
	return more + local_layer_bytes(p, cap) - local_layer_bytes(p, have);
}

uint32_t kvd_store_local_rows(const struct kvd_seqn *q, uint32_t layer)
{
	return q->loc && layer < q->p->layers ? q->loc->ly[layer].n : 0;
}

int kvd_store_local_get(const struct kvd_seqn *q, uint32_t layer, uint32_t row0, uint32_t n,
			uint16_t *k, uint16_t *v)
{
	const size_t H = q->p->g.kv_heads, d = q->p->g.d;
	const struct kvd_local_layer *l;

	if ((uint64_t)row0 + n > kvd_store_local_rows(q, layer))
		return -ERANGE;
	l = &q->loc->ly[layer];
	for (size_t h = 0; h < H; h++) {
		memcpy(k + h * n * d, l->k + (h * l->cap + row0) * d, (size_t)n * d * 2);
		memcpy(v + h * n * d, l->v + (h * l->cap + row0) * d, (size_t)n * d * 2);
	}
	return 0;
}

void kvd_store_local_give(struct kvd_store *s, struct kvd_seqn *from, struct kvd_seqn *to,
			  int move)
{
	struct kvd_local *b = from->loc;

	if (b == to->loc)
		return;
	if (b && !move)
		b->refs++;
	local_unref(s, to->p, to->loc);
	to->loc = b;
	if (move)
		from->loc = NULL;
}

size_t kvd_store_local_bytes(const struct kvd_seqn *q)
{
	return q->loc ? q->loc->bytes : 0;
}

void kvd_store_seq_hide(struct kvd_seqn *q, const uint8_t *key, uint64_t tokens)
{
	q->hidden = 1;
	memcpy(q->pubkey, key, sizeof q->pubkey);
	q->pubtok = tokens;
}

int kvd_store_seq_hidden(const struct kvd_seqn *q)
{
	return q->hidden;
}

const uint8_t *kvd_store_seq_pubkey(const struct kvd_seqn *q, uint64_t *tokens)
{
	if (!q->hidden)
		return NULL;
	*tokens = q->pubtok;
	return q->pubkey;
}

void kvd_store_seq_unhide(struct kvd_seqn *q)
{
	q->hidden = 0;
}
