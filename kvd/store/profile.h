/* The store's profile table (kvd/store/profile.c): profiles by id and by
 * (namespace, name), their references and what they cost.  Internal to the
 * store: store.c embeds one table in each struct kvd_store and frees it
 * last; everyone else uses the kvd_store_profile_* functions of store.h.
 * A profile is charged to its creator like any other memory of the store,
 * through the store's own charge, so that the caches give way for it too.
 */
#ifndef KVD_PROFILE_H
#define KVD_PROFILE_H

#include <stdarg.h>
#include <stdio.h>

#include "store.h"

#define KVD_PROF_BUCKETS 1024

struct kvd_prof;

struct kvd_profiles {
	struct kvd_prof *by_id[KVD_PROF_BUCKETS], *by_name[KVD_PROF_BUCKETS];
	uint32_t n, nglobal;            /* all; of them in KVD_STORE_NS_GLOBAL */
	uint32_t next_id;               /* last profile id handed out */
	uint64_t bytes;                 /* all profiles, charged to their creators */
};

/* store.c's side: s's table, and the memory charge of kvd_limits (s has
 * limits: kvd_store_limits) with the caches asked to give way once. */
struct kvd_profiles *kvd_store_profiles(struct kvd_store *s);
int kvd_store_mem_charge(struct kvd_store *s, uint32_t uid, uint64_t n, char *msg, size_t msglen);
void kvd_store_mem_uncharge(struct kvd_store *s, uint32_t uid, size_t n);

/* profile.c's side: every profile freed and uncharged, references or not
 * (kvd_store_destroy, once no sequence holds one). */
void kvd_store_profiles_free(struct kvd_store *s);

/* A message into msg (which may be NULL); 0, so that a caller can
 * `return say(...), -EINVAL`. */
__attribute__((format(printf, 3, 4)))
static inline int say(char *msg, size_t msglen, const char *fmt, ...)
{
	va_list ap;

	if (msg && msglen) {
		va_start(ap, fmt);
		vsnprintf(msg, msglen, fmt, ap);
		va_end(ap);
	}
	return 0;
}

#endif
