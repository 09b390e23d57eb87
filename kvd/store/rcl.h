/* kvd_rcl: a small Redis Cluster client on hiredis (whose Debian version,
 * 0.14, has no cluster support), written against the Redis Cluster
 * specification.
 *
 * It knows the slot map (CLUSTER SLOTS, asked of any node that answers,
 * seeds first), routes each key by its slot (CRC16/XMODEM of the key, or of
 * its hash tag: the bytes between the first '{' and the next '}' when that is
 * not empty), keeps one connection per master, and runs a batch of
 * commands pipelined: grouped per node, every command of a group appended,
 * then every reply read.  A MOVED reply refreshes the map and resends the
 * command to the node it names; ASK sends ASKING then the command to the
 * node it names, once, without changing the map.  A node that cannot be
 * reached (refused, reset, timed out) is dropped, the map refreshed from the
 * others, and the command retried until cfg.retry_ms has passed, which
 * covers a replica's promotion after its master failed.
 *
 * Blocking, with timeouts on connect and on every reply: call it from a
 * thread of its own (kvd's remote tier does), never from the event loop.
 * One thread at a time per handle.  hiredis writes with write(2): the
 * process must ignore SIGPIPE.  Errors are negative errno values with a
 * message: -ECONNREFUSED / -ETIMEDOUT / -EHOSTUNREACH when no node answers,
 * -EPROTO for a reply of the wrong type, -EIO for an error reply.
 */
#ifndef KVD_RCL_H
#define KVD_RCL_H

#include <stddef.h>
#include <stdint.h>

#define KVD_RCL_SLOTS 16384

struct kvd_rcl_cfg {
	const char *seeds;              /* "host:port[,host:port...]", at least one */
	uint32_t connect_ms;            /* per connection attempt; 0: 500 */
	uint32_t io_ms;                 /* per reply; 0: 2000 */
	uint32_t retry_ms;              /* how long unreachable nodes are retried
					 * through map refreshes; 0: 0 (no retry) */
	unsigned redirects;             /* MOVED/ASK followed per command; 0: 5 */
};

enum kvd_rcl_kind { KVD_RCL_GET, KVD_RCL_SET, KVD_RCL_DEL, KVD_RCL_EXISTS };

/* One command of a batch.  The caller fills the inputs; kvd_rcl_run fills
 * rc and, for GET, len and data (malloc'd, the caller frees; NULL on a
 * miss, or when the value went into dst). */
struct kvd_rcl_op {
	enum kvd_rcl_kind kind;
	const void *key;
	size_t klen;
	const void *val;                /* SET */
	size_t vlen;
	void *dst;                      /* GET: the value goes here when it fits cap */
	size_t cap;                     /* (then data stays NULL, len is its length) */
	int rc;                         /* 0; -ENOENT: GET/EXISTS of a missing key,
					 * DEL of none; or an error as above */
	void *data;                     /* GET */
	size_t len;
};

struct kvd_rcl_stats {
	uint64_t commands;              /* sent, redirected resends included */
	uint64_t moved, ask;            /* redirects followed */
	uint64_t refreshes;             /* slot map fetches */
	uint64_t connects, conn_errors; /* connections made; lost or refused */
};

struct kvd_rcl;

/* Parses the seeds; connects lazily (the first run).  -EINVAL for a
 * malformed seed list (msg says which), -ENOMEM. */
int kvd_rcl_create(const struct kvd_rcl_cfg *cfg, struct kvd_rcl **out, char *msg, size_t msglen);
void kvd_rcl_destroy(struct kvd_rcl *c);

/* The slot of a key (hash tag rules above). */
uint16_t kvd_rcl_slot(const void *key, size_t klen);

/* Runs n commands pipelined.  Returns 0 when each op has its own rc (a
 * missing key is not a failure of the batch; an op whose node stayed
 * unreachable past retry_ms has that error), or a negative errno when no
 * node answered any of it or the map could not be read (then every op's
 * rc is that error too). */
int kvd_rcl_run(struct kvd_rcl *c, struct kvd_rcl_op *ops, unsigned n, char *msg, size_t msglen);

/* WAIT numreplicas timeout on the connection to the master that holds the
 * key's slot (the one the batch's writes of that slot went to).  Returns the
 * number of replicas that acknowledged (>= 0; it may be fewer than asked)
 * or a negative errno. */
int kvd_rcl_wait(struct kvd_rcl *c, const void *key, size_t klen, unsigned replicas,
		 uint32_t timeout_ms, char *msg, size_t msglen);

void kvd_rcl_stats(const struct kvd_rcl *c, struct kvd_rcl_stats *st);

#endif
