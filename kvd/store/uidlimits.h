/* kvd_limits (kvd/store/uidlimits.h: "limits.h" would shadow <limits.h>, as kvd/
 * is on the include path): what each uid uses (connections, sequences, profiles,
 * resident bytes, spill bytes, shared-memory bytes, remote-tier bytes) and the caps the configuration puts on it
 * ([limits] and [memory]/[spill] limit in kvd.conf), plus the sharing
 * groups that map uids to profile namespaces ([sharing] groups).
 *
 * Charge before allocate: a caller asks kvd_limits_charge() for n more of a
 * resource before it allocates or creates anything, and gives it back with
 * kvd_limits_uncharge() when it is freed.  A refused charge changes nothing
 * and says which cap in the message, naming the config key and the numbers:
 *
 *   -EDQUOT  a per-uid cap ("limits.sequences_per_uid: uid 1000 has 16 of 16")
 *   -ENOSPC  a global cap on a count, or on spill bytes ("limits.sequences",
 *            "spill.limit")
 *   -ENOMEM  resident bytes over the memory limit ("memory budget
 *            (memory.limit): 64.0 MiB (67108864 bytes) in use of 64.0 MiB,
 *            uid 1000 needs 196608 bytes")
 *
 * Only uids with nonzero usage have an entry, so the table is bounded by
 * what is charged (every uid with usage holds a connection, a sequence, a
 * profile or bytes).
 *
 * Single-threaded: callers hold the daemon's state (the event loop owns
 * it), as for kvd_store and kvd_tier.  No locks inside.
 */
#ifndef KVD_LIMITS_H
#define KVD_LIMITS_H

#include <stddef.h>
#include <stdint.h>

enum kvd_res {
	KVD_RES_CONNECTIONS = 0,
	KVD_RES_SEQUENCES,
	KVD_RES_PROFILES,
	KVD_RES_MEMORY,                 /* resident bytes (and restore reservations) */
	KVD_RES_SPILL,                  /* bytes of spill files on disk */
	KVD_RES_SHM,                    /* bytes of the connections' shared-memory regions */
	KVD_RES_REMOTE,                 /* bytes of evicted sequences' copies in the remote tier */
	KVD_RES_N
};

/* Namespaces of profiles.  A uid in no sharing group is its own namespace;
 * group i (0-based, in the order of the config) is KVD_NS_GROUP | i.  uids
 * with that bit set are never allocated by Linux user tools (systemd treats
 * them as invalid) and kvd refuses them in groups; such a uid in no group
 * maps to KVD_NS_NONE, in which the store creates and finds no profile. */
#define KVD_NS_GROUP    0x80000000u
#define KVD_NS_NONE     0xffffffffu
#define KVD_LIMITS_SHARE_MAX 256        /* uids in all groups together */
#define KVD_LIMITS_GROUPS_MAX 64

struct kvd_limits_cfg {
	uint64_t cap[KVD_RES_N];        /* over all uids; 0: no cap */
	uint64_t per_uid[KVD_RES_N];    /* each uid; 0: no cap */
	uint32_t share_uid[KVD_LIMITS_SHARE_MAX];
	uint32_t share_group[KVD_LIMITS_SHARE_MAX];     /* group index of share_uid[i] */
	unsigned nshare;
};

struct kvd_limits_usage {
	uint64_t n[KVD_RES_N];
};

struct kvd_limits;

int kvd_limits_create(const struct kvd_limits_cfg *cfg, struct kvd_limits **out);
void kvd_limits_destroy(struct kvd_limits *l);

/* n more of r for uid: 0, or -EDQUOT / -ENOSPC / -ENOMEM (above) with msg
 * filled (msg may be NULL), or -ENOMEM "out of memory" when a new uid's
 * entry cannot be allocated.  n == 0 always succeeds. */
int kvd_limits_charge(struct kvd_limits *l, uint32_t uid, enum kvd_res r, uint64_t n, char *msg,
		      size_t msglen);
/* The same without checking any cap: for what exists already and must be
 * accounted (files found on disk at start-up, bytes a restore reserved and
 * now hands over).  Fails only when the entry cannot be allocated. */
int kvd_limits_force(struct kvd_limits *l, uint32_t uid, enum kvd_res r, uint64_t n);
/* Gives back n of r (clamped at what uid holds; cannot fail).  A uid whose
 * usage drops to zero leaves the table. */
void kvd_limits_uncharge(struct kvd_limits *l, uint32_t uid, enum kvd_res r, uint64_t n);

/* What uid uses now (all zero when it has no entry). */
void kvd_limits_uid_usage(const struct kvd_limits *l, uint32_t uid, struct kvd_limits_usage *out);
/* Totals over all uids. */
void kvd_limits_total(const struct kvd_limits *l, struct kvd_limits_usage *out);
/* Calls fn for every uid with nonzero usage (in no particular order); fn
 * must not charge or uncharge. */
void kvd_limits_each(const struct kvd_limits *l,
		     void (*fn)(void *arg, uint32_t uid, const struct kvd_limits_usage *u),
		     void *arg);
/* How many uids have an entry. */
unsigned kvd_limits_uids(const struct kvd_limits *l);
const struct kvd_limits_cfg *kvd_limits_cfg(const struct kvd_limits *l);

/* The profile namespace of uid (see KVD_NS_GROUP). */
/* A name of namespace ns that is the same on every host configured alike:
 * "u<uid>", or "g<smallest uid of the group>" (the remote tier's keys). */
void kvd_limits_ns_name(const struct kvd_limits *l, uint32_t ns, char *buf, size_t n);
uint32_t kvd_limits_namespace(const struct kvd_limits *l, uint32_t uid);
/* The same from a cfg (kvd_config_namespace uses it). */
uint32_t kvd_limits_cfg_namespace(const struct kvd_limits_cfg *cfg, uint32_t uid);

/* "limits.sequences", ...: the config key of a cap, for messages. */
const char *kvd_limits_key(enum kvd_res r, int per_uid);

#endif
