#include <errno.h>
#include <numaif.h>
#include <pthread.h>
#include <stdatomic.h>
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

void kvd_mem_populate(void *p, size_t bytes)
{
	char *a = p, *end = a + bytes;

	while (a < end) {
		/* up to the next 2 MiB boundary: one huge page a call */
		char *b = (char *)(((uintptr_t)a + KVD_MEM_HUGE) & ~(uintptr_t)(KVD_MEM_HUGE - 1));

		if (b > end)
			b = end;
		char *pa = (char *)((uintptr_t)a & ~(uintptr_t)(KVD_MEM_PAGE - 1));

		if (madvise(pa, (size_t)(b - pa), MADV_POPULATE_WRITE))
			return;         /* no such advice, or no memory now: the touch faults */
		a = b;
	}
}

/* Mappings waiting for the unmapping thread.  Not linked through their own
 * first bytes: a page never touched would fault in (a huge page, on a VM
 * milliseconds) only to be unmapped. */
struct behind {
	struct behind *next;
	void *p;
	size_t len;
};

static struct {
	pthread_mutex_t mu;
	pthread_cond_t work, settled;
	struct behind *head;
	_Atomic int on;
	int busy;                       /* the thread holds mappings it took */
} fb = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
	 NULL, 0, 0 };

static void *behind_main(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&fb.mu);
	for (;;) {
		while (!fb.head)
			pthread_cond_wait(&fb.work, &fb.mu);
		struct behind *b = fb.head;

		fb.head = NULL;
		fb.busy = 1;
		pthread_mutex_unlock(&fb.mu);
		while (b) {
			struct behind *nx = b->next;

			munmap(b->p, b->len);
			free(b);
			b = nx;
		}
		pthread_mutex_lock(&fb.mu);
		fb.busy = 0;
		if (!fb.head)
			pthread_cond_broadcast(&fb.settled);
	}
	return NULL;
}

int kvd_mem_free_behind(void)
{
	pthread_t th;
	int rc = 0;

	pthread_mutex_lock(&fb.mu);
	if (!fb.on) {
		/* Detached and never stopped: it owns nothing but what it is
		 * given, and the process's exit unmaps that anyway. */
		rc = pthread_create(&th, NULL, behind_main, NULL);
		if (!rc) {
			pthread_detach(th);
			fb.on = 1;
		}
	}
	pthread_mutex_unlock(&fb.mu);
	return -rc;
}

void kvd_mem_settle(void)
{
	pthread_mutex_lock(&fb.mu);
	while (fb.head || fb.busy)
		pthread_cond_wait(&fb.settled, &fb.mu);
	pthread_mutex_unlock(&fb.mu);
}

void kvd_mem_free(void *p, size_t bytes)
{
	if (!p)
		return;
	if (bytes < KVD_MEM_HUGE) {
		free(p);
		return;
	}
	/* Without the node, now: memory that short is better given back. */
	struct behind *b = atomic_load_explicit(&fb.on, memory_order_relaxed) ?
				   malloc(sizeof *b) : NULL;

	if (b) {
		b->p = p;
		b->len = map_len(bytes);
		pthread_mutex_lock(&fb.mu);
		b->next = fb.head;
		fb.head = b;
		pthread_cond_signal(&fb.work);
		pthread_mutex_unlock(&fb.mu);
		return;
	}
	munmap(p, map_len(bytes));
}
