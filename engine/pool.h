/* kvd_pool: a fixed set of worker threads running parallel-for jobs.
 *
 * kvd_pool_run() hands a job of `ntasks` independent tasks to the workers and
 * returns when every task has run; fn(arg, task, worker) gets the index of
 * the worker running it (0 .. kvd_pool_size()-1), so jobs keep per-worker
 * scratch without locks.  Several threads may call kvd_pool_run() on one pool
 * at once: jobs are taken in arrival order and never interleave their tasks
 * on one worker, so scratch per worker is safe across concurrent jobs.
 * Idle workers spin briefly, then sleep.
 *
 * kvd_pool_create(n > 1) starts n - 1 threads: worker n - 1 is whichever
 * submitter is in kvd_pool_run(), which runs tasks of its own job (ahead
 * of earlier jobs, if any) instead of only waiting for them; one submitter
 * at a time, the others wait.  kvd_pool_create_cpus() starts a thread per
 * worker, all pinned: its submitters may be off the pool's node.
 *
 * Pinning: kvd_pool_create() with `pin` pins thread i to the i-th CPU of the
 * calling thread's affinity mask (round-robin), best effort: a worker the
 * kernel will not pin runs unpinned, since pinning only buys locality (the
 * submitter's worker runs where the submitter does).
 * kvd_pool_create_cpus() pins worker i to cpus[i % ncpus] and fails if it
 * cannot: it is how a pool is kept on one NUMA node (engine/numa_nodes.h).  Either
 * way the affinity is set before the thread runs, so no task of a pinned
 * worker ever runs elsewhere.
 */
#ifndef KVD_POOL_H
#define KVD_POOL_H

#include <stddef.h>
#include <stdint.h>

struct kvd_pool;
typedef void (*kvd_pool_fn)(void *arg, uint32_t task, unsigned worker);

/* nthreads == 0: one per CPU the process may run on. */
int kvd_pool_create(unsigned nthreads, int pin, struct kvd_pool **out);
/* nthreads == 0: one per CPU listed.  cpus is copied, not kept.  -EINVAL
 * for no CPUs or a negative one; a CPU the kernel will not pin to (offline,
 * outside the cpuset) fails with pthread_create's error; either way nothing
 * is left behind. */
int kvd_pool_create_cpus(unsigned nthreads, const int *cpus, unsigned ncpus,
			 struct kvd_pool **out);
void kvd_pool_destroy(struct kvd_pool *p);
unsigned kvd_pool_size(const struct kvd_pool *p);
/* The CPU worker `worker` is pinned to; -1 when unpinned (the submitter's
 * worker included) or no such worker. */
int kvd_pool_worker_cpu(const struct kvd_pool *p, unsigned worker);
void kvd_pool_run(struct kvd_pool *p, uint32_t ntasks, kvd_pool_fn fn, void *arg);

/* Long jobs that may let other work in.  A thread that owns a queue of short
 * requests (the daemon's executor) sets a yield hook for itself; then
 * kvd_pool_run_sliced() runs a job one task per worker at a time and calls
 * the hook between the slices, and kvd_pool_yield() calls it between a
 * caller's phases.  Without a hook (any other thread, the default) both are
 * kvd_pool_run() and nothing.  The hook runs on the calling thread and must
 * not start sliced jobs itself; what the job is working on must stay
 * untouched by it. */
void kvd_pool_set_yield(void (*fn)(void *arg), void *arg);
/* With a yield hook set, makes its thread a waiting submitter: the slices of
 * its sliced jobs run on bulk threads of the pool's (one per worker, on the
 * workers' CPUs, at the bulk niceness, started on first use), never on the
 * workers or on it, and it calls wait(arg) while each slice runs (the hook
 * still runs between them), and while kvd_pool_prefault's side thread
 * faults.  wait runs what is ready and may then block, until wake(arg) or
 * for a bounded time: wake is called from the pool's thread that ends a
 * slice or a prefault, possibly after the call it ended has returned, so
 * arg must outlive the pool and a late wake be harmless.  The hook's rules
 * hold for wait, and what wait runs runs beside the slice's tasks.  A bulk
 * thread's tasks see worker ids from kvd_pool_size() to 2 kvd_pool_size()
 * - 1: a sliced job's per-worker scratch needs twice the slots.
 * kvd_pool_set_yield() clears it. */
void kvd_pool_set_wait(void (*wait)(void *arg), void (*wake)(void *arg));
void kvd_pool_run_sliced(struct kvd_pool *p, uint32_t ntasks, kvd_pool_fn fn, void *arg);
void kvd_pool_yield(void);
/* A sliced job's tasks are bulk: a thread above the users' default
 * niceness (below 0) runs them at 0 and comes back after, so a daemon
 * started above its users does its bulk work at their priority.  Returns
 * the niceness a thread at `nice` runs bulk tasks at: 0 or `nice`, which
 * it stays at when threads could not come back (no CAP_SYS_NICE,
 * RLIMIT_NICE too low). */
int kvd_pool_bulk_nice(int nice);
/* Puts the calling thread `by` above the bulk niceness of the one it has
 * (a side thread of kvd's, at its start): relative, so a daemon started at
 * -10 keeps it as far below its bulk work as one started at 0. */
void kvd_pool_thread_below_bulk(int by);

/* Faults in [mem, mem + bytes), memory a sliced job is about to fill,
 * without writing it (MADV_POPULATE_WRITE, Linux 5.14).  With a yield hook
 * set, the faults run on the pool's side thread (started on first use, at
 * a low priority) while this thread keeps calling the hook, so other
 * requests run during them; returns when every page is in, or when the
 * side thread is too slow to be worth waiting for (starved by busier
 * threads, and never before KVD_POOL_PREFAULT_WAIT_MIN_NS), leaving the
 * rest to the job while the side thread goes on.  A first touch is where a big
 * job's time can go (a fresh huge page on a VM faulted in 4 ms), and a task
 * faulting one in is a task the hook cannot cut short.  Without a hook, the
 * advice, or the side thread, it does nothing: the job's workers fault
 * their own parts, faster on an idle machine. */
#define KVD_POOL_PREFAULT_WAIT_MIN_NS 5000000ull
void kvd_pool_prefault(struct kvd_pool *p, void *mem, size_t bytes);

#endif
