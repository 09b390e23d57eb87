/* kvd_numa: which NUMA nodes this process may use, and their CPUs.
 *
 * The daemon runs one worker pool per node (kvd_pool_create_cpus over the
 * node's cpu[]), gives each new sequence a node (kvd_numa_pick), allocates
 * the sequence's memory there (kvd_mem_alloc_node(bytes, node->mem)) and runs
 * its attention on that node's pool, so workers read local memory.
 *
 * kvd_numa_init() asks libnuma for the nodes and intersects each node's CPUs
 * with the calling thread's affinity mask (call it from the main thread at
 * start-up, before anything narrows that mask, and never from two threads at
 * once: libnuma caches node masks without a lock); nodes left with no CPU
 * are skipped.  It is active (n->active = 1) only with two or more such nodes.
 * Otherwise -- libnuma unavailable, one node, max_nodes == 1, or a topology
 * that does not add up -- it describes one pseudo-node holding every allowed
 * CPU with id = mem = -1, makes no binding call at all, and the daemon
 * behaves as without NUMA support; n->why says which case it was, for one
 * log line at start-up.  Nothing here logs or prints, and the libnuma calls
 * that would warn on stderr (missing sysfs files) are not reached.
 *
 * The result is plain data: read it from any thread, never change it, free
 * it once with kvd_numa_fini().  kvd_numa_pick() is a pure function.
 *
 * (Not named numa.h: with -Ikvd that would hide libnuma's <numa.h>.)
 */
#ifndef KVD_NUMA_NODES_H
#define KVD_NUMA_NODES_H

#include <stdint.h>

/* Node ids handled: the kernel's MAX_NUMNODES ceiling on x86-64
 * (NODES_SHIFT 10).  Memory policies for nodes at or above it are not set. */
#define KVD_NUMA_MAX_NODES 1024

struct kvd_numa_node {
	int id;                 /* kernel node number; -1 for the pseudo-node */
	int mem;                /* node for kvd_mem_alloc_node(): id, or -1 when the
				 * node has no memory this process may use
				 * (memoryless node, cpuset mems) or for the
				 * pseudo-node: the kernel then places pages */
	unsigned ncpus;         /* >= 1 */
	int *cpu;               /* [ncpus], ascending, all allowed to the caller */
};

struct kvd_numa {
	int active;             /* 1: nnodes >= 2 and memory is placed per node */
	unsigned nnodes;        /* >= 1 after a successful init */
	struct kvd_numa_node *node;     /* [nnodes], ascending id */
	const char *why;        /* static text: "numa" when active, else the reason */
};

/* max_nodes: use at most this many nodes (the lowest ids; the CPUs of the
 * others are left out); 0 means no limit, 1 forces the pseudo-node.
 * Returns 0, or -ENOMEM / -errno of sched_getaffinity; *out is zeroed on
 * failure.  Absence of NUMA is not a failure. */
int kvd_numa_init(struct kvd_numa *out, unsigned max_nodes);
void kvd_numa_fini(struct kvd_numa *n);

/* The node (an index into n->node) for a new sequence: the one with the least
 * load[i] (e.g. resident bytes of its sequences; NULL: all equal), ties
 * broken round-robin starting at index hint % nnodes, so a burst of
 * sequences created before any of them holds memory still spreads when hint
 * is a running count.  Deterministic; 0 when nnodes <= 1. */
unsigned kvd_numa_pick(const struct kvd_numa *n, const uint64_t *load, unsigned hint);

#endif
