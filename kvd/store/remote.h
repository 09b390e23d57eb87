/* kvd_remote: the remote tier, published prefixes kept in a Redis Cluster
 * so that another host's kvd can attach them.
 *
 * What goes there is a published prefix's spill file, byte for byte (the
 * same extents and CRC32C checks as on local disk), cut into values of
 * chunk_bytes under one hash tag, so a prefix lives on one shard and comes
 * back in one pipelined read:
 *
 *   <prefix>:{<ns>:<key as 32 hex digits>}:m     manifest (struct below)
 *   <prefix>:{<ns>:<key as 32 hex digits>}:<i>   chunk i, i = 0..chunks-1
 *
 * <ns> names the namespace the same way on every host ("u1000" for a uid of
 * its own, "g1000" for a sharing group, named by its smallest uid), so a
 * lookup never leaves the caller's namespace.  Chunks are written before the
 * manifest; a write is remote-durable once WAIT has seen `replicas`
 * replicas acknowledge it.  A read takes the manifest, then every chunk,
 * and checks the whole file's CRC32C against the manifest: a missing,
 * partial or corrupt value is a miss (counted, with a log line from the
 * caller), never a file handed on.  The file it writes into the spill
 * directory is then checked again, extent by extent, as any spill file is.
 *
 * Threads: one of its own runs every cluster call (kvd_rcl blocks, with
 * timeouts), lookups before uploads and deletes (someone waits on each
 * lookup; uploads and deletes keep their order among themselves, so a
 * delete follows the upload of the same key).  At most PUTS_NS_MAX
 * uploads and deletes of one namespace wait at once: one uid cannot fill
 * the queue for the others.  The event loop queues work with kvd_remote_put/get and reaps
 * results with kvd_remote_poll when kvd_remote_fd() is readable; nothing
 * else is shared.  A cluster that is down makes puts and gets fail (counted
 * in errors); kvd goes on with RAM and disk.
 */
#ifndef KVD_REMOTE_H
#define KVD_REMOTE_H

#include <stddef.h>
#include <stdint.h>

#include "rcl.h"

#define KVD_REMOTE_NS_MAX 24    /* bytes of a namespace name, NUL included */

struct kvd_remote_cfg {
	struct kvd_rcl_cfg rcl;
	const char *prefix;             /* key prefix, no braces; NULL: "kvd" */
	uint32_t chunk_bytes;           /* 0: 4 MiB */
	unsigned replicas;              /* WAIT for this many; 0: no WAIT */
	uint32_t wait_ms;               /* WAIT's timeout; 0: 1000 */
	const char *dir;                /* where fetched files go: a spill directory */
	unsigned dir_index;             /* its index among the spill directories */
	uint64_t max_bytes;             /* a manifest naming more is refused; 0: 64 GiB */
};

/* The manifest value, little-endian as laid out. */
struct kvd_remote_manifest {
	char magic[8];                  /* "KVDRMT1\0" */
	uint32_t chunks, chunk_bytes;
	uint64_t bytes;                 /* the file's size */
	uint64_t tokens;
	uint8_t key[16];
	uint32_t crc;                   /* CRC32C of the whole file */
	uint32_t reserved;
};

enum { KVD_REMOTE_GET, KVD_REMOTE_PUT };
/* Who asked: results go back to the caller's caller by it. */
enum { KVD_REMOTE_FOR_SHARE, KVD_REMOTE_FOR_TIER };

struct kvd_remote_done {
	int op;                         /* KVD_REMOTE_GET or _PUT */
	int who;                        /* as given to kvd_remote_get / _put */
	uint64_t cookie;                /* likewise */
	int rc;                         /* 0: a file was written; -ENOENT: none of the
					 * keys is there; -KVD_EFORMAT: found but
					 * corrupt, partial or oversized; -EFBIG:
					 * larger than the lookup's max_bytes;
					 * -EEXIST: its file is here already; else
					 * the cluster's error */
	uint32_t index;                 /* rc 0: which key of the request */
	uint8_t key[16];                /* ... that key */
	unsigned dir;                   /* the file's spill directory (cfg.dir_index) */
	uint64_t seq;                   /* rc 0 or -EEXIST: the file's sequence
					 * (PUT: of the file sent) */
	uint64_t gen;                   /* PUT: the generation of the file sent */
	int durable;                    /* PUT: WAIT saw the replicas */
	uint64_t bytes;
	double fetch_ms, file_ms;       /* rc 0: reading the cluster; writing the file */
	char msg[160];
};

struct kvd_remote_stats {
	uint64_t puts, put_bytes, put_errors, durable, not_durable, dels;
	uint64_t gets, hits, misses, corrupt, too_big, get_errors, get_bytes;
	uint64_t queued;                /* jobs waiting or running now */
	struct kvd_rcl_stats rcl;
};

struct kvd_remote;

int kvd_remote_create(const struct kvd_remote_cfg *cfg, struct kvd_remote **out, char *msg,
		      size_t msglen);
/* Joins the thread after its current job (bounded by the cluster timeouts);
 * queued jobs are dropped. */
void kvd_remote_destroy(struct kvd_remote *r);
int kvd_remote_fd(const struct kvd_remote *r);
/* Waits until every queued job has run, or ms have passed: 0 or -ETIMEDOUT. */
int kvd_remote_flush(struct kvd_remote *r, unsigned ms);

/* Queues the upload of the spill file at path under (ns, key): the file as
 * it is when the thread reads it (its header's generation is reported).
 * cookie != 0: the result comes back through kvd_remote_poll (op PUT).
 * -ENOMEM, -EBUSY when too many jobs wait (it is skipped and counted in
 * put_errors; uploads and deletes may take half the queue, lookups the
 * rest). */
int kvd_remote_put(struct kvd_remote *r, const char *ns, const uint8_t *key, uint64_t tokens,
		   const char *path, int who, uint64_t cookie);
/* Queues the deletion of (ns, key): its manifest, then its chunks.  Not
 * reported; -ENOMEM, -EBUSY as for puts. */
int kvd_remote_del(struct kvd_remote *r, const char *ns, const uint8_t *key);
/* Queues a lookup of nkeys keys (key i names a prefix of i + 1 chunks): the
 * longest one present is fetched into the directory, unless its manifest
 * names more than max_bytes (0: cfg.max_bytes), which is refused before
 * anything is read or allocated for it (-EFBIG): the caller bounds what
 * one requester can make the thread hold and write.  -ENOMEM, -EBUSY. */
int kvd_remote_get(struct kvd_remote *r, const char *ns, const uint8_t *keys, uint32_t nkeys,
		   uint64_t max_bytes, int who, uint64_t cookie);
/* Calls fn for every finished lookup; returns how many. */
unsigned kvd_remote_poll(struct kvd_remote *r,
			 void (*fn)(void *arg, const struct kvd_remote_done *d), void *arg);
void kvd_remote_stats(struct kvd_remote *r, struct kvd_remote_stats *st);

/* The key names of (ns, key): the hash-tagged stem, "<prefix>:{<ns>:<hex>}". */
int kvd_remote_stem(const char *prefix, const char *ns, const uint8_t *key, char *buf, size_t n);

#endif
