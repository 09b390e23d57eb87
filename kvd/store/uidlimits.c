/* kvd_limits: per-uid usage and caps.  See uidlimits.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/invariant.h"
#include "uidlimits.h"

#define UID_BUCKETS 256         /* uids with usage are bounded by connections */

struct uent {
	uint32_t uid;
	struct kvd_limits_usage u;
	struct uent *next;
};

struct kvd_limits {
	struct kvd_limits_cfg cfg;
	struct kvd_limits_usage total;
	struct uent *bucket[UID_BUCKETS];
	unsigned nuids;
};

static const char *const names[KVD_RES_N] = { "connections", "sequences", "profiles", "memory",
					       "spill", "shm", "remote" };

const char *kvd_limits_key(enum kvd_res r, int per_uid)
{
	static const char *const global[KVD_RES_N] = { "limits.connections", "limits.sequences",
						       "limits.profiles", "memory.limit",
						       "spill.limit", "limits.shm", "remote.limit" };
	static const char *const uid[KVD_RES_N] = {
		"limits.connections_per_uid", "limits.sequences_per_uid", "limits.profiles_per_uid",
		"limits.memory_per_uid", "limits.spill_per_uid", "limits.shm_per_uid",
		"limits.remote_per_uid" };

	return (unsigned)r < KVD_RES_N ? (per_uid ? uid[r] : global[r]) : "?";
}

int kvd_limits_create(const struct kvd_limits_cfg *cfg, struct kvd_limits **out)
{
	struct kvd_limits *l = calloc(1, sizeof *l);

	if (!l)
		return -ENOMEM;
	if (cfg->nshare > KVD_LIMITS_SHARE_MAX) {
		free(l);
		return -EINVAL;
	}
	l->cfg = *cfg;
	*out = l;
	return 0;
}

void kvd_limits_destroy(struct kvd_limits *l)
{
	if (!l)
		return;
	for (unsigned b = 0; b < UID_BUCKETS; b++) {
		for (struct uent *e = l->bucket[b], *nx; e; e = nx) {
			nx = e->next;
			free(e);
		}
	}
	free(l);
}

static unsigned bucket_of(uint32_t uid)
{
	/* Multiplicative hash: consecutive uids (1000, 1001, ...) spread. */
	return (uid * 2654435761u) >> 24 & (UID_BUCKETS - 1);
}

static struct uent *find(const struct kvd_limits *l, uint32_t uid)
{
	for (struct uent *e = l->bucket[bucket_of(uid)]; e; e = e->next)
		if (e->uid == uid)
			return e;
	return NULL;
}

static struct uent *get(struct kvd_limits *l, uint32_t uid)
{
	struct uent *e = find(l, uid);
	unsigned b = bucket_of(uid);

	if (e || !(e = calloc(1, sizeof *e)))
		return e;
	e->uid = uid;
	e->next = l->bucket[b];
	l->bucket[b] = e;
	l->nuids++;
	return e;
}

static void put_if_idle(struct kvd_limits *l, struct uent *e)
{
	struct uent **pp = &l->bucket[bucket_of(e->uid)];

	for (unsigned i = 0; i < KVD_RES_N; i++)
		if (e->u.n[i])
			return;
	while (*pp && *pp != e)
		pp = &(*pp)->next;
	if (*pp) {
		*pp = e->next;
		l->nuids--;
		free(e);
	}
}

/* "64.0 MiB (67108864 bytes)" for byte counts, the number for counts. */
static const char *amount(char *buf, size_t n, enum kvd_res r, uint64_t v)
{
	if (r != KVD_RES_MEMORY && r != KVD_RES_SPILL && r != KVD_RES_SHM && r != KVD_RES_REMOTE)
		snprintf(buf, n, "%llu", (unsigned long long)v);
	else if (v >= (1u << 20))
		snprintf(buf, n, "%.1f MiB (%llu bytes)", (double)v / (1 << 20), (unsigned long long)v);
	else
		snprintf(buf, n, "%llu bytes", (unsigned long long)v);
	return buf;
}

int kvd_limits_charge(struct kvd_limits *l, uint32_t uid, enum kvd_res r, uint64_t n, char *msg,
		      size_t msglen)
{
	const struct uent *e = find(l, uid);
	uint64_t has = e ? e->u.n[r] : 0, tot = l->total.n[r];
	uint64_t ucap = l->cfg.per_uid[r], gcap = l->cfg.cap[r];
	char a[64], b[64], c[64];

	if (!n)
		return 0;
	if (ucap && (has + n < has || has + n > ucap)) {
		if (msg && msglen)
			snprintf(msg, msglen, "%s: uid %u has %s of %s%s%s", kvd_limits_key(r, 1), uid,
				 amount(a, sizeof a, r, has), amount(b, sizeof b, r, ucap),
				 n > 1 ? ", needs " : "", n > 1 ? amount(c, sizeof c, r, n) : "");
		return -EDQUOT;
	}
	if (gcap && (tot + n < tot || tot + n > gcap)) {
		/* The memory limit is the tier's budget too: its messages and
		 * these both say "memory budget". */
		if (msg && msglen && r == KVD_RES_MEMORY)
			snprintf(msg, msglen, "memory budget (%s): %s in use of %s, uid %u needs %s",
				 kvd_limits_key(r, 0), amount(a, sizeof a, r, tot),
				 amount(b, sizeof b, r, gcap), uid, amount(c, sizeof c, r, n));
		else if (msg && msglen)
			snprintf(msg, msglen, "%s: %s in use of %s, uid %u needs %s%s",
				 kvd_limits_key(r, 0), amount(a, sizeof a, r, tot),
				 amount(b, sizeof b, r, gcap), uid, amount(c, sizeof c, r, n),
				 r == KVD_RES_SPILL || r == KVD_RES_REMOTE ? "" : " more");
		return r == KVD_RES_MEMORY ? -ENOMEM : -ENOSPC;
	}
	if (kvd_limits_force(l, uid, r, n)) {
		if (msg && msglen)
			snprintf(msg, msglen, "out of memory for the %s of uid %u", names[r], uid);
		return -ENOMEM;
	}
	return 0;
}

int kvd_limits_force(struct kvd_limits *l, uint32_t uid, enum kvd_res r, uint64_t n)
{
	struct uent *e;

	if (!n)
		return 0;
	if (!(e = get(l, uid)))
		return -ENOMEM;
	/* Counts and bytes of what exists fit 64 bits with room to spare;
	 * the total is the sum over the uids, so it holds at least each
	 * uid's part.  A wrap would let every uid past every cap. */
	if (NEVER(e->u.n[r] + n < n || l->total.n[r] + n < n || l->total.n[r] < e->u.n[r]))
		return -EOVERFLOW;
	e->u.n[r] += n;
	l->total.n[r] += n;
	return 0;
}

void kvd_limits_uncharge(struct kvd_limits *l, uint32_t uid, enum kvd_res r, uint64_t n)
{
	struct uent *e = find(l, uid);

	if (!e || !n)
		return;
	/* Clamped: a caller's bookkeeping error must not wrap the counters
	 * and lock every uid out. */
	if (n > e->u.n[r])
		n = e->u.n[r];
	e->u.n[r] -= n;
	/* The total is the sum over the uids, so it holds at least this
	 * uid's part: less means our own accounting broke, and a wrapped
	 * total would refuse every uid from then on. */
	if (NEVER(n > l->total.n[r]))
		n = l->total.n[r];
	l->total.n[r] -= n;
	put_if_idle(l, e);
}

void kvd_limits_uid_usage(const struct kvd_limits *l, uint32_t uid, struct kvd_limits_usage *out)
{
	const struct uent *e = find(l, uid);

	if (e)
		*out = e->u;
	else
		memset(out, 0, sizeof *out);
}

void kvd_limits_total(const struct kvd_limits *l, struct kvd_limits_usage *out)
{
	*out = l->total;
}

void kvd_limits_each(const struct kvd_limits *l,
		     void (*fn)(void *arg, uint32_t uid, const struct kvd_limits_usage *u),
		     void *arg)
{
	for (unsigned b = 0; b < UID_BUCKETS; b++)
		for (const struct uent *e = l->bucket[b]; e; e = e->next)
			fn(arg, e->uid, &e->u);
}

unsigned kvd_limits_uids(const struct kvd_limits *l)
{
	return l->nuids;
}

const struct kvd_limits_cfg *kvd_limits_cfg(const struct kvd_limits *l)
{
	return &l->cfg;
}

uint32_t kvd_limits_cfg_namespace(const struct kvd_limits_cfg *cfg, uint32_t uid)
{
	for (unsigned i = 0; i < cfg->nshare; i++)
		if (cfg->share_uid[i] == uid)
			return KVD_NS_GROUP | cfg->share_group[i];
	return uid & KVD_NS_GROUP ? KVD_NS_NONE : uid;
}

uint32_t kvd_limits_namespace(const struct kvd_limits *l, uint32_t uid)
{
	return kvd_limits_cfg_namespace(&l->cfg, uid);
}

void kvd_limits_ns_name(const struct kvd_limits *l, uint32_t ns, char *buf, size_t n)
{
	uint32_t min = UINT32_MAX;

	if (!l || !(ns & KVD_NS_GROUP)) {
		snprintf(buf, n, "u%u", (unsigned)ns);
		return;
	}
	for (unsigned i = 0; i < l->cfg.nshare; i++)
		if ((l->cfg.share_group[i] | KVD_NS_GROUP) == ns && l->cfg.share_uid[i] < min)
			min = l->cfg.share_uid[i];
	snprintf(buf, n, "g%u", (unsigned)min);
}
