#include <numaif.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "mem.h"
#include "numa_nodes.h"

static size_t round_huge(size_t bytes)
{
	return (bytes + KVD_MEM_HUGE - 1) & ~(size_t)(KVD_MEM_HUGE - 1);
}

void *kvd_mem_alloc(size_t bytes)
{
	if (bytes < KVD_MEM_HUGE)
		return aligned_alloc(64, (bytes + 63) & ~(size_t)63);

	/* Over-map by one huge page so the start can be aligned to one: THP
	 * only backs aligned 2 MiB ranges. */
	size_t len = round_huge(bytes) + KVD_MEM_HUGE;
	char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	uintptr_t a = ((uintptr_t)p + KVD_MEM_HUGE - 1) & ~(uintptr_t)(KVD_MEM_HUGE - 1);
	size_t head = a - (uintptr_t)p, tail = len - head - round_huge(bytes);

	if (head)
		munmap(p, head);
	if (tail)
		munmap((char *)a + round_huge(bytes), tail);
	/* Advice only: without THP this is ordinary memory. */
	(void)madvise((void *)a, round_huge(bytes), MADV_HUGEPAGE);
	return (void *)a;
}

void *kvd_mem_alloc_node(size_t bytes, int node)
{
	void *p = kvd_mem_alloc(bytes);

	if (p && bytes >= KVD_MEM_HUGE && node >= 0 && node < KVD_NUMA_MAX_NODES) {
		unsigned long mask[KVD_NUMA_MAX_NODES / (8 * sizeof(unsigned long))] = { 0 };

		mask[node / (8 * sizeof mask[0])] = 1ul << (node % (8 * sizeof mask[0]));
		/* Nothing is faulted yet (kvd_mem_alloc only advises), so the
		 * policy covers every page; no MPOL_MF_MOVE needed.  maxnode is
		 * bits + 1 as libnuma passes it: the kernel reads maxnode - 1.
		 * Failure leaves default placement (see mem.h). */
		(void)mbind(p, round_huge(bytes), MPOL_PREFERRED, mask,
			    KVD_NUMA_MAX_NODES + 1, 0);
	}
	return p;
}

void kvd_mem_free(void *p, size_t bytes)
{
	if (!p)
		return;
	if (bytes < KVD_MEM_HUGE)
		free(p);
	else
		munmap(p, round_huge(bytes));
}
