/* A real Redis Cluster on loopback for the tests, from Debian's
 * redis-server and redis-cli (packages redis-server, redis-tools).
 *
 * The servers die with the thread that started them (PR_SET_PDEATHSIG), so
 * a test that aborts leaves none behind; rcluster_stop() kills them and
 * removes their directory.  Every function returns 0 (or a port) or a
 * negative errno, and says why on stderr.
 */
#ifndef KVD_TEST_RCLUSTER_H
#define KVD_TEST_RCLUSTER_H

#include <stddef.h>
#include <stdint.h>

#define RCLUSTER_MAX 12

struct rcluster {
	char dir[128];
	int base;               /* node i listens on base + i, its bus on +10000 */
	int n;                  /* masters * (1 + replicas) */
	int masters;
	int pid[RCLUSTER_MAX];  /* 0: not running */
};

/* Starts masters + masters*replicas redis-server processes on 127.0.0.1
 * ports base..base+n-1 (base picked free), each with its own directory
 * under a mkdtemp directory, joins them with `redis-cli --cluster create`
 * and waits (up to ~30 s) until every node reports cluster_state:ok and
 * every master has its replicas online.  -EAGAIN: no free ports;
 * -ENOENT: redis-server or redis-cli missing (a test may skip then). */
int rcluster_start(struct rcluster *rc, int masters, int replicas);

/* SIGKILLs every node, reaps it and removes the directory. */
void rcluster_stop(struct rcluster *rc);

/* "127.0.0.1:p,..." of every node, dead ones included. */
const char *rcluster_seeds(const struct rcluster *rc, char *buf, size_t n);

/* The port of the master that serves slot now (as the first live node
 * sees it), or a negative errno. */
int rcluster_master_port(const struct rcluster *rc, uint16_t slot);

/* SIGKILLs the node on port and reaps it. */
int rcluster_kill(struct rcluster *rc, int port);

/* SIGKILLs every node but keeps the directory: the cluster is down. */
int rcluster_stop_all(struct rcluster *rc);

/* Waits until every live node reports cluster_state:ok and all of them
 * agree that each of the 16384 slots is served by a live master. */
int rcluster_wait_ok(const struct rcluster *rc, int timeout_ms);

/* Moves slot from its master to the master on to_port as `redis-cli
 * --cluster reshard` does, but stops half way: IMPORTING on the target,
 * MIGRATING on the source, then MIGRATE of only the first `keys` keys of
 * the slot, so clients get ASK for those.  rcluster_migrate_finish()
 * migrates the rest and assigns the slot to the target on every master. */
int rcluster_migrate_begin(struct rcluster *rc, uint16_t slot, int to_port, int keys);
int rcluster_migrate_finish(struct rcluster *rc, uint16_t slot, int to_port);

#endif
