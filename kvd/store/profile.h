/* The store's profile table (kvd/store/profile.c): profiles by id and by
 * (namespace, name), their reference counts, each profile's copy of dense,
 * W and its logp table.  Internal to the store, below it: store.c embeds
 * one table in each struct kvd_store and is its only caller, and charges
 * (kvd_limits) around these calls, so the table knows nothing of uids'
 * budgets; everyone else uses the kvd_store_profile_* functions of
 * store.h.  Ids are never reused in a table's life.
 */
#ifndef KVD_PROFILE_H
#define KVD_PROFILE_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"

#define KVD_PROF_BUCKETS 1024

struct kvd_prof;

struct kvd_profiles {
	struct kvd_prof *by_id[KVD_PROF_BUCKETS], *by_name[KVD_PROF_BUCKETS];
	uint32_t n, nglobal;            /* all; of them in KVD_STORE_NS_GLOBAL */
	uint32_t next_id;               /* last profile id handed out */
	uint64_t bytes;                 /* kvd_store_profile_bytes of all */
};

/* NULL unless a profile of that name / id is in the table (any namespace by
 * id).  No reference taken. */
const struct kvd_profile *kvd_profiles_find(const struct kvd_profiles *t, uint32_t ns,
					    const char *name);
const struct kvd_profile *kvd_profiles_by_id(const struct kvd_profiles *t, uint32_t id);
/* 1 when a and b have the same fields (name, ids and uid aside). */
int kvd_profiles_same(const struct kvd_profile *a, const struct kvd_profile *b);
/* A copy of want in ns, made by uid, with one reference and the next id:
 * 0, -EOVERFLOW when 2^32-1 ids are used up, -ENOMEM.  W is want's or, when
 * want has none, made from the seed. */
int kvd_profiles_add(struct kvd_profiles *t, uint32_t ns, uint32_t uid,
		     const struct kvd_profile *want, const struct kvd_profile **out);
void kvd_profiles_ref(const struct kvd_profile *p);
/* Drops a reference: 1 when it was the last (p is then freed), else 0. */
int kvd_profiles_unref(struct kvd_profiles *t, const struct kvd_profile *p);
/* Any profile in the table, or NULL when it is empty. */
const struct kvd_profile *kvd_profiles_any(const struct kvd_profiles *t);
/* Frees p whatever its references (a store being destroyed). */
void kvd_profiles_remove(struct kvd_profiles *t, const struct kvd_profile *p);
void kvd_profiles_each(const struct kvd_profiles *t,
		       void (*fn)(void *arg, const struct kvd_profile *p, uint32_t refs),
		       void *arg);

#endif
