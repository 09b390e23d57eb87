#include <numaif.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "mem.h"
#include "numa_nodes.h"

/* A mapping's length: whole 4 KiB pages, never a whole huge page more.  The
 * kernel backs with a huge page only an aligned 2 MiB range that lies inside
 * the mapping, so a buffer of 2 MiB + 4 KiB is one huge page and one small
 * one (2 MiB + 4 KiB resident, what its owner was charged), not two huge
 * pages (4 MiB) as it was when the mapping was rounded up to 2 MiB. */
static size_t map_len(size_t bytes)
{
	return (bytes + KVD_MEM_PAGE - 1) & ~(size_t)(KVD_MEM_PAGE - 1);
}

void *kvd_mem_alloc(size_t bytes)
{
	if (bytes < KVD_MEM_HUGE)
		return aligned_alloc(64, (bytes + 63) & ~(size_t)63);

	/* Over-map by one huge page so the start can be aligned to one: THP
	 * only backs aligned 2 MiB ranges. */
	size_t len = map_len(bytes) + KVD_MEM_HUGE;
	char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	uintptr_t a = ((uintptr_t)p + KVD_MEM_HUGE - 1) & ~(uintptr_t)(KVD_MEM_HUGE - 1);
	size_t head = a - (uintptr_t)p, tail = len - head - map_len(bytes);

	if (head)
		munmap(p, head);
	if (tail)
		munmap((char *)a + map_len(bytes), tail);
	/* Advice only: without THP this is ordinary memory.  The last partial
	 * 2 MiB (if any) stays in small pages whatever the advice (above). */
	(void)madvise((void *)a, map_len(bytes), MADV_HUGEPAGE);
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
		(void)mbind(p, map_len(bytes), MPOL_PREFERRED, mask,
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
		munmap(p, map_len(bytes));
}
