/* kvd_mem: memory for big, long-lived arrays (segments, staging, benchmark
 * buffers).  From 2 MiB up it is an anonymous mapping advised to use
 * transparent huge pages: sampled attention gathers rows at random from
 * hundreds of MB, and 4 KiB pages would cost a TLB miss per row, and a page
 * fault per 4 KiB at prefill.  Smaller requests are 64-byte aligned heap
 * memory.  Pages are faulted in by whoever touches them first: prefaulting
 * here (MADV_POPULATE_WRITE, or a touch per page) runs on one thread and
 * measured slower than letting the pool's workers fault their own parts.
 * A mapping is the size asked for in whole 4 KiB pages, and only its whole
 * aligned 2 MiB ranges can become huge pages: what it holds resident is at
 * most that size, the bytes its owner was charged (the last partial 2 MiB
 * is small pages, a TLB miss per 4 KiB there, never a huge page more).
 * kvd_mem_free() needs the size given to kvd_mem_alloc(). */
#ifndef KVD_MEM_H
#define KVD_MEM_H

#include <stddef.h>

#define KVD_MEM_HUGE (2u << 20)
#define KVD_MEM_PAGE 4096u

void *kvd_mem_alloc(size_t bytes);

/* As kvd_mem_alloc(), with a mapping's (>= KVD_MEM_HUGE) pages preferring
 * NUMA node `node` (mbind MPOL_PREFERRED, set before any page exists, so it
 * holds whichever thread faults them).  Preferred, not bound: when the node
 * is full, pages come from another node rather than the OOM killer ending
 * the daemon -- remote memory is slower, not fatal.  node < 0, smaller
 * requests (heap, placed by first touch), and a policy the kernel refuses
 * (no NUMA, a node outside the cpuset or >= KVD_NUMA_MAX_NODES) all give
 * ordinary memory: placement is a matter of speed here, never a failure.
 * Pass kvd_numa's node->mem.  Free with kvd_mem_free(). */
void *kvd_mem_alloc_node(size_t bytes, int node);
void kvd_mem_free(void *p, size_t bytes);

/* Faults [p, p + bytes) in for writing without writing a byte
 * (MADV_POPULATE_WRITE, Linux 5.14; without it, nothing), a huge page at a
 * time.  The advice holds the process's mmap lock for all it is given, and
 * every mmap or munmap on another thread waits for that, the event loop's
 * under kvd's state lock too: 185-260 ms for a 100 MB restore buffer on a
 * VM, faulted in whole by the advice or by io_uring registering it. */
void kvd_mem_populate(void *p, size_t bytes);

/* From now on, kvd_mem_free() of a mapping hands it to a thread that
 * unmaps it, and returns at once: unmapping a dropped sequence's hundreds
 * of MB took 15 ms, and its caller holds the daemon's state lock.  The
 * pages stay resident until that thread gets to them (a few ms): what was
 * given back may show in RSS for that long.  0, or -errno when the thread
 * cannot start (frees stay synchronous).  kvd_mem_settle() returns once
 * every mapping freed before it is unmapped. */
int kvd_mem_free_behind(void);
void kvd_mem_settle(void);

#endif
