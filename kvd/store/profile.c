/* The store's profile table: see profile.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/invariant.h"
#include "engine/rng.h"
#include "profile.h"

uint32_t kvd_store_chunk_default(uint32_t seal)
{
	uint32_t c = seal < KVD_PROFILE_CHUNK_DEFAULT ? seal : KVD_PROFILE_CHUNK_DEFAULT;

	while (c > 1 && seal % c)
		c--;
	return c ? c : 1;
}

/* A profile and the table's bookkeeping; callers see &p. */
struct kvd_prof {
	struct kvd_profile p;
	uint32_t refs;
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

int kvd_profiles_same(const struct kvd_profile *a, const struct kvd_profile *b)
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

size_t kvd_store_profile_bytes(const struct kvd_profile *p)
{
	return sizeof(struct kvd_prof) + p->layers +
	       (size_t)p->g.d * p->g.K * p->g.L * sizeof(float) + 2 * sizeof(struct kvd_logp_tab);
}

const struct kvd_profile *kvd_profiles_find(const struct kvd_profiles *t, uint32_t ns,
					    const char *name)
{
	for (struct kvd_prof *x = t->by_name[pname_bucket(ns, name)]; x; x = x->next_name)
		if (x->p.ns == ns && !strcmp(x->p.name, name))
			return &x->p;
	return NULL;
}

const struct kvd_profile *kvd_profiles_by_id(const struct kvd_profiles *t, uint32_t id)
{
	for (struct kvd_prof *x = t->by_id[pid_bucket(id)]; x; x = x->next_id)
		if (x->p.id == id)
			return &x->p;
	return NULL;
}

int kvd_profiles_add(struct kvd_profiles *t, uint32_t ns, uint32_t uid,
		     const struct kvd_profile *want, const struct kvd_profile **out)
{
	size_t wn = (size_t)want->g.d * want->g.K * want->g.L;
	struct kvd_prof *x;

	if (t->next_id == UINT32_MAX)
		return -EOVERFLOW;
	x = calloc(1, sizeof *x);
	if (x) {
		x->p = *want;
		x->p.dense = malloc(want->layers);
		x->p.W = malloc(wn * sizeof *x->p.W);
		x->p.tab = malloc(2 * sizeof *x->p.tab);
	}
	if (!x || !x->p.dense || !x->p.W || !x->p.tab) {
		profile_free(x);
		return -ENOMEM;
	}
	x->p.id = ++t->next_id;         /* never reused: the counter only grows */
	x->p.ns = ns;
	x->p.uid = uid;
	x->refs = 1;
	memcpy(x->p.dense, want->dense, want->layers);
	if (want->W)                    /* made by the caller from the same seed */
		memcpy(x->p.W, want->W, wn * sizeof *x->p.W);
	else
		kvd_lsh_make_w(x->p.seed, (int)x->p.g.d, (int)x->p.g.K, (int)x->p.g.L, x->p.W);
	kvd_logp_tab_init(&x->p.tab[0], (int)x->p.g.K, (int)x->p.g.L, (int)x->p.g.c);
	kvd_logp_tab_init(&x->p.tab[1], (int)x->p.g.K, (int)KVD_LCV_LO(x->p.g.L), (int)x->p.g.c);
	x->next_id = t->by_id[pid_bucket(x->p.id)];
	t->by_id[pid_bucket(x->p.id)] = x;
	x->next_name = t->by_name[pname_bucket(ns, x->p.name)];
	t->by_name[pname_bucket(ns, x->p.name)] = x;
	t->n++;
	t->nglobal += ns == KVD_STORE_NS_GLOBAL;
	t->bytes += kvd_store_profile_bytes(&x->p);
	*out = &x->p;
	return 0;
}

void kvd_profiles_remove(struct kvd_profiles *t, const struct kvd_profile *p)
{
	struct kvd_prof *x = prof_of(p);
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
	t->bytes -= kvd_store_profile_bytes(&x->p);
	profile_free(x);
}

void kvd_profiles_ref(const struct kvd_profile *p)
{
	prof_of(p)->refs++;
}

int kvd_profiles_unref(struct kvd_profiles *t, const struct kvd_profile *p)
{
	struct kvd_prof *x = prof_of(p);

	/* A profile in the table has a reference (kvd_profiles_add gives one,
	 * the last unref frees): none is an unref too many. */
	if (NEVER(x->refs == 0) || --x->refs)
		return 0;
	kvd_profiles_remove(t, p);
	return 1;
}

const struct kvd_profile *kvd_profiles_any(const struct kvd_profiles *t)
{
	for (uint32_t b = 0; b < KVD_PROF_BUCKETS; b++)
		if (t->by_id[b])
			return &t->by_id[b]->p;
	return NULL;
}

void kvd_profiles_each(const struct kvd_profiles *t,
		       void (*fn)(void *arg, const struct kvd_profile *p, uint32_t refs),
		       void *arg)
{
	for (uint32_t b = 0; b < KVD_PROF_BUCKETS; b++)
		for (struct kvd_prof *x = t->by_id[b]; x; x = x->next_id)
			fn(arg, &x->p, x->refs);
}
