/* NUMA discovery.
 *
 * libnuma answers which nodes exist and which CPUs each holds; the calling
 * thread's affinity mask says which CPUs we may use, and get_mempolicy's
 * MPOL_F_MEMS_ALLOWED which nodes we may take memory from (the cpuset's
 * mems, which exclude memoryless nodes).  libnuma's own mems-allowed mask is
 * read once at library load and some versions fetch the wrong mask, hence
 * the direct call.
 *
 * libnuma prints to stderr when a node's sysfs files are missing and exits
 * when a bitmask allocation fails.  The first is avoided by asking only about
 * nodes numa_nodes_ptr lists, and only when there are two or more (a
 * container without /sys looks like one node and never gets that far); the
 * second is a few bytes at start-up and not worth re-implementing sysfs
 * parsing for.
 */
#include <errno.h>
#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "numa_nodes.h"

#define LONG_BITS (8 * sizeof(unsigned long))

/* The calling thread's allowed CPUs, ascending.  The kernel's cpumask may be
 * larger than glibc's cpu_set_t: grow until sched_getaffinity accepts it. */
static int allowed_cpus(int **out, unsigned *nout)
{
	for (int bits = CPU_SETSIZE;; bits *= 2) {
		size_t sz = CPU_ALLOC_SIZE(bits);
		cpu_set_t *set = CPU_ALLOC(bits);

		if (!set)
			return -ENOMEM;
		if (sched_getaffinity(0, sz, set) < 0) {
			int e = errno;

			CPU_FREE(set);
			if (e == EINVAL && bits < 1 << 20)
				continue;
			return -e;
		}
		unsigned n = (unsigned)CPU_COUNT_S(sz, set), k = 0;
		int *cpu = n ? malloc(n * sizeof *cpu) : NULL;

		if (!cpu) {
			CPU_FREE(set);
			return n ? -ENOMEM : -EINVAL;
		}
		for (int c = 0; c < bits && k < n; c++)
			if (CPU_ISSET_S(c, sz, set))
				cpu[k++] = c;
		CPU_FREE(set);
		*out = cpu;
		*nout = n;
		return 0;
	}
}

void kvd_numa_fini(struct kvd_numa *n)
{
	if (!n)
		return;
	for (unsigned i = 0; i < n->nnodes; i++)
		free(n->node[i].cpu);
	free(n->node);
	memset(n, 0, sizeof *n);
}

/* Fills out->node from libnuma.  Returns NULL when out is now active, the
 * reason for the pseudo-node otherwise (out left empty), or sets *err.
 * owner[k]: the node index allowed[k] belongs to, -1 if none yet. */
static const char *discover(struct kvd_numa *out, const int *allowed, unsigned nallowed,
			    unsigned max_nodes, int *owner, int *err)
{
	unsigned long mems[KVD_NUMA_MAX_NODES / LONG_BITS] = { 0 };
	struct bitmask *mask;
	const char *why = NULL;
	int max;

	if (max_nodes == 1)
		return "max_nodes is 1";
	if (numa_available() < 0)
		return "libnuma unavailable";
	max = numa_max_node();
	if (max < 1)
		return "one node";
	if (max >= KVD_NUMA_MAX_NODES)
		max = KVD_NUMA_MAX_NODES - 1;   /* CPUs beyond fail the coverage check */
	if (get_mempolicy(NULL, mems, KVD_NUMA_MAX_NODES + 1, NULL, MPOL_F_MEMS_ALLOWED) < 0)
		return "memory policy calls refused";
	out->node = calloc((size_t)max + 1, sizeof *out->node);
	if (!out->node) {
		*err = -ENOMEM;
		return NULL;
	}
	mask = numa_allocate_cpumask();
	for (int id = 0; id <= max && !why && !*err; id++) {
		struct kvd_numa_node *nd = &out->node[out->nnodes];
		unsigned cnt = 0;

		if (!numa_bitmask_isbitset(numa_nodes_ptr, (unsigned)id))
			continue;
		if (numa_node_to_cpus(id, mask) < 0) {
			why = "a node's cpumap unreadable";
			break;
		}
		for (unsigned k = 0; k < nallowed; k++)
			cnt += numa_bitmask_isbitset(mask, (unsigned)allowed[k]) != 0;
		if (cnt == 0)
			continue;
		nd->cpu = malloc(cnt * sizeof *nd->cpu);
		if (!nd->cpu) {
			*err = -ENOMEM;
			break;
		}
		for (unsigned k = 0; k < nallowed; k++) {
			if (!numa_bitmask_isbitset(mask, (unsigned)allowed[k]))
				continue;
			if (owner[k] >= 0) {
				why = "a CPU on two nodes";
				break;
			}
			owner[k] = (int)out->nnodes;
			nd->cpu[nd->ncpus++] = allowed[k];
		}
		nd->id = id;
		nd->mem = (mems[id / LONG_BITS] >> (id % LONG_BITS)) & 1 ? id : -1;
		out->nnodes++;
	}
	numa_bitmask_free(mask);
	if (!why && !*err) {
		for (unsigned k = 0; k < nallowed && !why; k++)
			if (owner[k] < 0)
				why = "allowed CPUs outside every node";
		if (!why && out->nnodes < 2)
			why = "one node with allowed CPUs";
	}
	if (why || *err) {
		kvd_numa_fini(out);
		return why;
	}
	if (max_nodes && out->nnodes > max_nodes) {
		/* Checked coverage first: these CPUs are left out on purpose. */
		for (unsigned i = max_nodes; i < out->nnodes; i++)
			free(out->node[i].cpu);
		out->nnodes = max_nodes;
	}
	out->active = 1;
	out->why = "numa";
	return NULL;
}

int kvd_numa_init(struct kvd_numa *out, unsigned max_nodes)
{
	int *allowed = NULL, *owner, err;
	unsigned nallowed = 0;
	const char *why;

	memset(out, 0, sizeof *out);
	err = allowed_cpus(&allowed, &nallowed);
	if (err)
		return err;
	owner = malloc(nallowed * sizeof *owner);
	if (!owner) {
		free(allowed);
		return -ENOMEM;
	}
	for (unsigned k = 0; k < nallowed; k++)
		owner[k] = -1;
	why = discover(out, allowed, nallowed, max_nodes, owner, &err);
	free(owner);
	if (err) {
		free(allowed);
		return err;
	}
	if (out->active) {
		free(allowed);
		return 0;
	}
	out->node = calloc(1, sizeof *out->node);
	if (!out->node) {
		free(allowed);
		return -ENOMEM;
	}
	out->nnodes = 1;
	out->node[0] = (struct kvd_numa_node){
		.id = -1, .mem = -1, .ncpus = nallowed, .cpu = allowed,
	};
	out->why = why;
	return 0;
}

unsigned kvd_numa_pick(const struct kvd_numa *n, const uint64_t *load, unsigned hint)
{
	unsigned start, best;

	if (n->nnodes <= 1)
		return 0;
	start = best = hint % n->nnodes;
	/* Strictly less: of equal loads the first at or after `start` wins,
	 * which is what makes ties round-robin. */
	for (unsigned k = 1; load && k < n->nnodes; k++) {
		unsigned i = (start + k) % n->nnodes;

		if (load[i] < load[best])
			best = i;
	}
	return best;
}
