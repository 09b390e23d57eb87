/* kvd_mem: memory for big, long-lived arrays (segments, staging, benchmark
 * buffers).  From 2 MiB up it is an anonymous mapping advised to use
 * transparent huge pages: sampled attention gathers rows at random from
 * hundreds of MB, and 4 KiB pages would cost a TLB miss per row, and a page
 * fault per 4 KiB at prefill.  Smaller requests are 64-byte aligned heap
 * memory.  Pages are faulted in by whoever touches them first: prefaulting
 * here (MADV_POPULATE_WRITE, or a touch per page) runs on one thread and
 * measured slower than letting the pool's workers fault their own parts.
 * kvd_mem_free() needs the size given to kvd_mem_alloc(). */
#ifndef KVD_MEM_H
#define KVD_MEM_H

#include <stddef.h>

#define KVD_MEM_HUGE (2u << 20)

void *kvd_mem_alloc(size_t bytes);
void kvd_mem_free(void *p, size_t bytes);

#endif
