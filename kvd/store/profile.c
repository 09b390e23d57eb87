/* The store's profile table (kvd/store/profile.h): create or open by name,
 * look up by id or name within a namespace, reference counts, and what a
 * profile costs its creator.  The API is store.h's kvd_store_profile_*. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/invariant.h"
#include "engine/rng.h"
#include "profile.h"

#define MAX_PROFILES 256        /* old API without limits: the cap it always had */

uint32_t kvd_store_chunk_default(uint32_t seal)
{
	uint32_t c = seal < KVD_PROFILE_CHUNK_DEFAULT ? seal : KVD_PROFILE_CHUNK_DEFAULT;

	while (c > 1 && seal % c)
		c--;
	return c ? c : 1;
}

/* A profile and the store's bookkeeping; callers see &p. */
struct kvd_prof {
	struct kvd_profile p;
	uint32_t refs;
	size_t bytes;                   /* charged to p.uid */
	struct kvd_prof *next_id, *next_name;
};

static void profile_free(struct kvd_prof *x)
{
	if (!x)
		return;
	free(x->p.dense);
	free(x->p.W);
	free(x->p.tab);
	free(x);
}

static int same_profile(const struct kvd_profile *a, const struct kvd_profile *b)
{
	return !memcmp(&a->g, &b->g, sizeof a->g) && a->layers == b->layers &&
	       a->sink == b->sink && a->window == b->window && a->seg_tokens == b->seg_tokens &&
	       a->seal_tokens == b->seal_tokens && a->seed == b->seed &&
	       a->estimator == b->estimator && !memcmp(a->dense, b->dense, a->layers);
}

static uint32_t pid_bucket(uint32_t id)
{
	return (uint32_t)(kvd_mix64(id) & (KVD_PROF_BUCKETS - 1));
}

static uint32_t pname_bucket(uint32_t ns, const char *name)
{
	uint64_t h = kvd_mix64(ns);

	for (; *name; name++)
		h = kvd_mix64(h ^ (unsigned char)*name);
	return (uint32_t)(h & (KVD_PROF_BUCKETS - 1));
}

static struct kvd_prof *prof_of(const struct kvd_profile *p)
{
	/* Every profile callers see is the first member of a struct kvd_prof. */
	return (struct kvd_prof *)(uintptr_t)p;
}

static void prof_unlink(struct kvd_store *s, struct kvd_prof *x)
{
	struct kvd_profiles *t = kvd_store_profiles(s);
	struct kvd_limits *lim = kvd_store_limits(s);
	struct kvd_prof **pp = &t->by_id[pid_bucket(x->p.id)];

	while (*pp && *pp != x)
		pp = &(*pp)->next_id;
	if (*pp)
		*pp = x->next_id;
	pp = &t->by_name[pname_bucket(x->p.ns, x->p.name)];
	while (*pp && *pp != x)
		pp = &(*pp)->next_name;
	if (*pp)
		*pp = x->next_name;
	t->n--;
	t->nglobal -= x->p.ns == KVD_STORE_NS_GLOBAL;
	t->bytes -= x->bytes;
	kvd_store_mem_uncharge(s, x->p.uid, x->bytes);
	if (lim)
		kvd_limits_uncharge(lim, x->p.uid, KVD_RES_PROFILES, 1);
}

size_t kvd_store_profile_bytes(const struct kvd_profile *p)
{
	return sizeof(struct kvd_prof) + p->layers +
	       (size_t)p->g.d * p->g.K * p->g.L * sizeof(float) + sizeof(struct kvd_logp_tab);
}

const struct kvd_profile *kvd_store_profile_find(struct kvd_store *s, uint32_t ns, const char *name)
{
	struct kvd_profiles *t = kvd_store_profiles(s);

	for (struct kvd_prof *x = t->by_name[pname_bucket(ns, name)]; x; x = x->next_name)
		if (x->p.ns == ns && !strcmp(x->p.name, name))
			return &x->p;
	return NULL;
}

const struct kvd_profile *kvd_store_profile_get(struct kvd_store *s, uint32_t ns, uint32_t id)
{
	const struct kvd_profile *p = kvd_store_profile_by_id(s, id);

	return p && p->ns == ns ? p : NULL;
}

void kvd_store_profile_ref(struct kvd_store *s, const struct kvd_profile *p)
{
	prof_of(p)->refs++;
}

void kvd_store_profile_unref(struct kvd_store *s, const struct kvd_profile *p)
{
	struct kvd_prof *x = prof_of(p);

	/* A profile in the table has a reference (profile_new gives one, the
	 * last unref frees): none is an unref too many. */
	if (NEVER(x->refs == 0) || --x->refs)
		return;
	prof_unlink(s, x);
	profile_free(x);
}

/* A new profile in ns, charged to uid, with one reference. */
static int profile_new(struct kvd_store *s, uint32_t ns, uint32_t uid,
		       const struct kvd_profile *want, struct kvd_prof **out, char *msg, size_t msglen)
{
	struct kvd_profiles *t = kvd_store_profiles(s);
	struct kvd_limits *lim = kvd_store_limits(s);
	size_t wn = (size_t)want->g.d * want->g.K * want->g.L;
	size_t bytes = kvd_store_profile_bytes(want);
	struct kvd_prof *x;
	int rc;

	if (t->next_id == UINT32_MAX) {
		say(msg, msglen, "profile ids used up (restart kvd)");
		return -EOVERFLOW;
	}
	if (lim) {
		if ((rc = kvd_limits_charge(lim, uid, KVD_RES_PROFILES, 1, msg, msglen)))
			return rc;
		if ((rc = kvd_store_mem_charge(s, uid, bytes, msg, msglen))) {
			kvd_limits_uncharge(lim, uid, KVD_RES_PROFILES, 1);
			return rc;
		}
	}
	x = calloc(1, sizeof *x);
	if (x) {
		x->p = *want;
		x->p.dense = malloc(want->layers);
		x->p.W = malloc(wn * sizeof *x->p.W);
		x->p.tab = malloc(sizeof *x->p.tab);
	}
	if (!x || !x->p.dense || !x->p.W || !x->p.tab) {
		profile_free(x);
		if (lim) {
			kvd_limits_uncharge(lim, uid, KVD_RES_MEMORY, bytes);
			kvd_limits_uncharge(lim, uid, KVD_RES_PROFILES, 1);
		}
		say(msg, msglen, "out of memory");
		return -ENOMEM;
	}
	x->p.id = ++t->next_id;         /* never reused: the counter only grows */
	x->p.ns = ns;
	x->p.uid = uid;
	x->bytes = bytes;
	x->refs = 1;
	memcpy(x->p.dense, want->dense, want->layers);
	if (want->W)                    /* made by the caller from the same seed */
		memcpy(x->p.W, want->W, wn * sizeof *x->p.W);
	else
		kvd_lsh_make_w(x->p.seed, (int)x->p.g.d, (int)x->p.g.K, (int)x->p.g.L, x->p.W);
	kvd_logp_tab_init(x->p.tab, (int)x->p.g.K, (int)x->p.g.L, (int)x->p.g.c);
	x->next_id = t->by_id[pid_bucket(x->p.id)];
	t->by_id[pid_bucket(x->p.id)] = x;
	x->next_name = t->by_name[pname_bucket(ns, x->p.name)];
	t->by_name[pname_bucket(ns, x->p.name)] = x;
	t->n++;
	t->nglobal += ns == KVD_STORE_NS_GLOBAL;
	t->bytes += bytes;
	*out = x;
	return 0;
}

int kvd_store_profile_ns(struct kvd_store *s, uint32_t ns, uint32_t uid,
			 const struct kvd_profile *want, const struct kvd_profile **out, char *msg,
			 size_t msglen)
{
	const struct kvd_profile *old;
	struct kvd_prof *x;
	int rc;

	if (ns == KVD_NS_NONE) {
		say(msg, msglen, "uid %u is outside the uids kvd serves (below %u)", uid,
		    KVD_NS_GROUP);
		return -EACCES;
	}
	if ((old = kvd_store_profile_find(s, ns, want->name))) {
		if (!same_profile(old, want)) {
			say(msg, msglen, "profile '%s' exists with other fields", want->name);
			return -EEXIST;
		}
		kvd_store_profile_ref(s, old);
		*out = old;
		return 0;
	}
	if ((rc = profile_new(s, ns, uid, want, &x, msg, msglen)))
		return rc;
	*out = &x->p;
	return 0;
}

int kvd_store_profile(struct kvd_store *s, const struct kvd_profile *want,
		      const struct kvd_profile **out)
{
	const struct kvd_profile *old = kvd_store_profile_by_name(s, want->name);
	struct kvd_prof *x;
	int rc;

	if (old) {
		if (!same_profile(old, want))
			return -EEXIST;
		*out = old;
		return 0;
	}
	if (!kvd_store_limits(s) && kvd_store_profiles(s)->nglobal == MAX_PROFILES)
		return -ENOSPC;
	/* The reference profile_new gives is never dropped: old-API profiles
	 * live as long as the store, as they always did. */
	if ((rc = profile_new(s, KVD_STORE_NS_GLOBAL, 0, want, &x, NULL, 0)))
		return rc;
	*out = &x->p;
	return 0;
}

const struct kvd_profile *kvd_store_profile_by_id(struct kvd_store *s, uint32_t id)
{
	struct kvd_profiles *t = kvd_store_profiles(s);

	for (struct kvd_prof *x = t->by_id[pid_bucket(id)]; x; x = x->next_id)
		if (x->p.id == id)
			return &x->p;
	return NULL;
}

const struct kvd_profile *kvd_store_profile_by_name(struct kvd_store *s, const char *name)
{
	return kvd_store_profile_find(s, KVD_STORE_NS_GLOBAL, name);
}

void kvd_store_profile_each(struct kvd_store *s,
			    void (*fn)(void *arg, const struct kvd_profile *p, uint32_t refs),
			    void *arg)
{
	struct kvd_profiles *t = kvd_store_profiles(s);

	for (uint32_t b = 0; b < KVD_PROF_BUCKETS; b++)
		for (struct kvd_prof *x = t->by_id[b]; x; x = x->next_id)
			fn(arg, &x->p, x->refs);
}

void kvd_store_profiles_free(struct kvd_store *s)
{
	struct kvd_profiles *t = kvd_store_profiles(s);

	for (uint32_t b = 0; b < KVD_PROF_BUCKETS; b++) {
		while (t->by_id[b]) {
			struct kvd_prof *x = t->by_id[b];

			prof_unlink(s, x);
			profile_free(x);
		}
	}
}
