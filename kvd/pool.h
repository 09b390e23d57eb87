/* kvd_pool: a fixed set of worker threads running parallel-for jobs.
 *
 * kvd_pool_run() hands a job of `ntasks` independent tasks to the workers and
 * returns when every task has run; fn(arg, task, worker) gets the index of
 * the worker running it (0 .. kvd_pool_size()-1), so jobs keep per-worker
 * scratch without locks.  Several threads may call kvd_pool_run() on one pool
 * at once: jobs are taken in arrival order and never interleave their tasks
 * on one worker, so scratch per worker is safe across concurrent jobs.
 * Idle workers spin briefly, then sleep.  Workers are pinned to CPUs (one per
 * CPU of the process's affinity mask, round-robin) when `pin` is set.
 */
#ifndef KVD_POOL_H
#define KVD_POOL_H

#include <stdint.h>

struct kvd_pool;
typedef void (*kvd_pool_fn)(void *arg, uint32_t task, unsigned worker);

/* nthreads == 0: one per CPU the process may run on. */
int kvd_pool_create(unsigned nthreads, int pin, struct kvd_pool **out);
void kvd_pool_destroy(struct kvd_pool *p);
unsigned kvd_pool_size(const struct kvd_pool *p);
void kvd_pool_run(struct kvd_pool *p, uint32_t ntasks, kvd_pool_fn fn, void *arg);

#endif
