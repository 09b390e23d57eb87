/* Worker pool: a FIFO of jobs, each a parallel-for of independent tasks.
 *
 * The mutex guards the list of jobs; the tasks of a job are claimed with an
 * atomic counter.  A worker joins the job at the head under the lock (a
 * reference, so the job, which lives on its submitter's stack, outlives
 * every worker that holds it), claims and runs tasks until none is left,
 * and takes the lock again only to unlink the job and leave it.  Claiming
 * each task under the lock cost two acquisitions a task: nothing on two
 * workers, but a decode layer of 128 tasks on 16 workers queued them all on
 * one contended mutex.  Completion is counted with an atomic so the
 * submitter can spin on it without the lock.
 *
 * A pool from kvd_pool_create() of n > 1 starts n - 1 threads and lets the
 * submitter be worker n - 1: it runs its own job's tasks while the threads
 * wake.  A submitter that only waited lost twice a job: workers asleep
 * after their spin took ~30 us to wake on a VM, and the submitter, asleep
 * too by the end, as long again to see the job done; a 98k-token sampled
 * layer on 2 threads (Zen 5 VM) idled each worker 14 % of its wall time.
 * One submitter at a time holds the slot (its scratch is worker n - 1's);
 * another only waits, as before, on the threads.
 *
 * A submitter with a wait hook (the daemon's executor) hands its sliced
 * jobs to threads of their own, one per worker, at the bulk niceness, and
 * waits in its hook, answering others' short requests while the slice runs
 * instead of after it.  A slice's task is up to a few milliseconds of
 * copying or table building: a decoder's ATTEND that waited for its end
 * took ~1.4 ms at p99 against 0.18 quiet on 2 cores.  Not the workers:
 * a short job for another client would then wait for their tasks to end,
 * or run on the submitter alone; beside bulk threads its workers preempt
 * them at once, as their niceness says.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "clock.h"
#include "invariant.h"
#include "mem.h"
#include "pool.h"

/* How long a worker waiting for a job, or a submitter waiting for its job
 * to finish, spins before it sleeps.  Bounded in time, not in pauses: a
 * pause is 10 to 150 cycles depending on the CPU, and 20000 of them were
 * 540 us on Zen 4, long enough that with as many workers as CPUs the
 * spinning submitter took a core from its own job's workers. */
#define SPIN_NS 30000

struct job {
	kvd_pool_fn fn;
	void *arg;
	uint32_t ntasks;
	int bulk;                       /* a slice of kvd_pool_run_sliced: bulk_enter() */
	_Atomic uint32_t next;          /* the next task to claim; >= ntasks: none left */
	_Atomic uint32_t done;
	unsigned refs;                  /* workers in the job, under pool->mu */
	struct job *link;               /* under pool->mu */
};

/* The pool's one bulk job, reused slice after slice.  Lock-free: its
 * submitter runs at kvd's niceness and its threads at the users', and a
 * lock that a preempted bulk thread held kept the submitter from its hook
 * for milliseconds.  A thread joins a slice by its number (gen) and claims a
 * task by a compare-and-swap on claim, which holds the number and the tasks
 * not yet claimed: a thread late from an older slice claims nothing of a
 * newer one, and a claim needs nothing read outside the word.  Only after
 * it succeeds are fn, arg and ntasks read: the slice cannot end (nor the
 * next be written) before the claimed task has run.  Read before it, the
 * size of a next slice being written let a thread claim past a short
 * slice's end. */
struct bulk_job {
	_Atomic uint32_t gen;           /* futex word: the slice's number; bumped at stop */
	_Atomic uint64_t claim;         /* gen << 32 | tasks left to claim */
	_Atomic uint32_t done;          /* tasks run */
	_Atomic uint32_t ntasks;
	_Atomic(kvd_pool_fn) fn;
	_Atomic(void *) arg;
	_Atomic(void (*)(void *)) wake;
	_Atomic(void *) wake_arg;
};

struct worker {
	struct kvd_pool *pool;
	unsigned id;
	int cpu;                        /* pinned to, or -1; fixed before the thread starts */
	pthread_t th;
};

struct kvd_pool {
	pthread_mutex_t mu;
	pthread_cond_t work;            /* a job was queued, or stop */
	pthread_cond_t fin;             /* some job finished */
	struct job *head, *tail;        /* jobs with unclaimed tasks */
	_Atomic unsigned queued;        /* jobs in the list, read lock-free by spinners */
	unsigned sleepers;
	int stop;
	unsigned help;                  /* 1: a submitter is worker n too */
	_Atomic int helping;            /* a submitter holds worker n's slot */
	/* the bulk threads: a waiting submitter's sliced jobs */
	struct bulk_job b;
	_Atomic int b_busy;             /* a waiting submitter holds b; it alone
					 * touches bw, nb, b_state, b_gen */
	_Atomic int b_stop;
	struct worker *bw;              /* [nb], ids kvd_pool_size() + i */
	unsigned nb;
	int b_state;                    /* 0: not started, 1: running, -1: failed to start */
	uint32_t b_gen;
	/* kvd_pool_prefault's side thread, all under pf_mu */
	pthread_mutex_t pf_mu;
	pthread_cond_t pf_go;           /* a range to fault, or stop */
	pthread_cond_t pf_done;         /* the range is in (CLOCK_MONOTONIC) */
	pthread_t pf_th;
	int pf_state;                   /* 0: not started, 1: running, -1: failed to start */
	int pf_stop;
	char *pf_mem;
	_Atomic size_t pf_len;          /* 0: nothing to fault; read lock-free by a waiting submitter */
	void (*pf_wake)(void *arg);     /* a waiting submitter's (kvd_pool_set_wait) */
	void *pf_wake_arg;
	unsigned n;
	struct worker w[];
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#endif
}

/* Pauses until *v != 0 (ne) or *v == want (!ne), or SPIN_NS have passed,
 * reading the clock every 32 pauses.  Returns whether the wait ended. */
static int spin(const _Atomic unsigned *v, unsigned want, int ne)
{
	uint64_t end = kvd_now_ns() + SPIN_NS;

	for (;;) {
		for (int i = 0; i < 32; i++) {
			unsigned x = atomic_load_explicit(v, memory_order_acquire);

			if (ne ? x != 0 : x == want)
				return 1;
			cpu_relax();
		}
		if (kvd_now_ns() >= end)
			return 0;
	}
}

/* Called with mu held; returns with it held.  Returns 0 when the pool stops. */
static int wait_for_job(struct kvd_pool *p)
{
	while (!p->head) {
		if (p->stop)
			return 0;
		pthread_mutex_unlock(&p->mu);
		spin(&p->queued, 0, 1);
		pthread_mutex_lock(&p->mu);
		if (p->head || p->stop)
			continue;
		p->sleepers++;
		pthread_cond_wait(&p->work, &p->mu);
		p->sleepers--;
	}
	return 1;
}

/* A sliced job is bulk: a seal's rows and tables, a big copy.  A thread
 * above the users' niceness (the unit's Nice=-10) runs its tasks at theirs,
 * 0, and everything else (a decode's ATTEND, the hook between slices,
 * waiting for work) at its own: kvd's short requests then wait on no
 * user's CPU-bound process, and its bulk work for one user does not take
 * the CPU from another's decoder waiting at nice 0 for its answer.  On 2
 * cores, -10 for everything cut a quiet decoder's p99 beside connection
 * churn from ~10 to 1-5 ms but raised it beside a big APPEND from ~1.1 to
 * ~2.2.  Only where the thread may come back after (CAP_SYS_NICE, or
 * RLIMIT_NICE: the unit's LimitNICE=), checked once on a throwaway thread:
 * a thread stuck at the bulk niceness would be worse than none. */

static int bulk_ok;
static pthread_once_t bulk_once = PTHREAD_ONCE_INIT;

static int thread_nice(void)
{
	errno = 0;
	int n = getpriority(PRIO_PROCESS, 0);

	return errno ? INT_MIN : n;
}

static int set_thread_nice(int n)
{
	return setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), n > 19 ? 19 : n);
}

static void *bulk_probe_main(void *arg)
{
	int base = thread_nice();

	(void)arg;
	bulk_ok = base != INT_MIN && base + 1 <= 19 && !set_thread_nice(base + 1) &&
		  !set_thread_nice(base) && thread_nice() == base;
	return NULL;
}

static void bulk_probe(void)
{
	pthread_t th;

	if (!pthread_create(&th, NULL, bulk_probe_main, NULL))
		pthread_join(th, NULL);
}

/* Returns what bulk_leave() puts back: INT_MIN for nothing. */
static int bulk_enter(void)
{
	int own = thread_nice();

	return own < 0 && own != INT_MIN && !set_thread_nice(0) ? own : INT_MIN;
}

static void bulk_leave(int own)
{
	if (own != INT_MIN)
		(void)set_thread_nice(own);
}

int kvd_pool_bulk_nice(int nice)
{
	pthread_once(&bulk_once, bulk_probe);
	return bulk_ok && nice < 0 ? 0 : nice;
}

void kvd_pool_thread_below_bulk(int by)
{
	int own = thread_nice();

	(void)set_thread_nice(kvd_pool_bulk_nice(own == INT_MIN ? 0 : own) + by);
}

/* Claims and runs tasks of j until none is left. */
static void run_tasks(struct job *j, unsigned worker)
{
	const int own = j->bulk ? bulk_enter() : INT_MIN;

	for (;;) {
		uint32_t t = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);

		if (t >= j->ntasks) {
			bulk_leave(own);
			return;
		}
		j->fn(j->arg, t, worker);
		/* Release: the task's writes happen-before the submitter's
		 * acquire load that sees the final count. */
		atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
	}
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct kvd_pool *p = w->pool;

	pthread_mutex_lock(&p->mu);
	while (wait_for_job(p)) {
		struct job *j = p->head;

		j->refs++;
		pthread_mutex_unlock(&p->mu);
		run_tasks(j, w->id);
		pthread_mutex_lock(&p->mu);
		/* Every task is claimed: the job leaves the list (the first
		 * worker back unlinks it; only the head is ever claimed from,
		 * so it is still the head), and the last worker out tells the
		 * submitter, which waits for no worker to hold it any more. */
		if (p->head == j) {
			p->head = j->link;
			if (!p->head)
				p->tail = NULL;
			atomic_fetch_sub_explicit(&p->queued, 1, memory_order_relaxed);
		}
		if (--j->refs == 0)
			pthread_cond_broadcast(&p->fin);
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

unsigned kvd_pool_size(const struct kvd_pool *p)
{
	return p->n + p->help;
}

int kvd_pool_worker_cpu(const struct kvd_pool *p, unsigned worker)
{
	return worker < p->n ? p->w[worker].cpu : -1;
}

static _Thread_local struct {
	void (*fn)(void *arg);
	void (*wait)(void *arg);
	void (*wake)(void *arg);
	void *arg;
} yield_hook;

/* ---- the bulk threads: a waiting submitter's sliced jobs --------------- */

static int start_thread(struct worker *w, void *(*fn)(void *), int strict);

static void futex_wait(_Atomic uint32_t *w, uint32_t val)
{
	syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *w)
{
	syscall(SYS_futex, w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Claims and runs tasks of slice g until none is left, or a newer slice is
 * up; the thread whose task is the slice's last wakes the submitter (which
 * may have gone on by then: the wake only has to be harmless). */
static void bulk_run(struct bulk_job *b, uint32_t g, unsigned id)
{
	for (;;) {
		uint64_t c = atomic_load_explicit(&b->claim, memory_order_acquire);

		if ((uint32_t)(c >> 32) != g || !(uint32_t)c)
			return;
		if (!atomic_compare_exchange_weak_explicit(&b->claim, &c, c - 1, memory_order_acquire,
							   memory_order_relaxed))
			continue;

		uint32_t n = atomic_load_explicit(&b->ntasks, memory_order_relaxed);
		kvd_pool_fn fn = atomic_load_explicit(&b->fn, memory_order_relaxed);
		void *arg = atomic_load_explicit(&b->arg, memory_order_relaxed);
		void (*wake)(void *) = atomic_load_explicit(&b->wake, memory_order_relaxed);
		void *warg = atomic_load_explicit(&b->wake_arg, memory_order_relaxed);

		fn(arg, n - (uint32_t)c, id);
		/* Release: the task's writes happen-before the submitter's
		 * acquire load that sees the final count. */
		if (atomic_fetch_add_explicit(&b->done, 1, memory_order_release) + 1 == n && wake)
			wake(warg);
	}
}

static void *bulk_main(void *arg)
{
	struct worker *w = arg;
	struct kvd_pool *p = w->pool;
	uint32_t seen = 0;              /* started before slice 1 is up */

	kvd_pool_thread_below_bulk(0);
	pthread_setname_np(pthread_self(), "kvd-bulk");
	for (;;) {
		uint32_t g = atomic_load_explicit(&p->b.gen, memory_order_acquire);
		uint64_t end;

		if (atomic_load_explicit(&p->b_stop, memory_order_acquire))
			return NULL;
		if (g != seen) {
			seen = g;
			bulk_run(&p->b, g, w->id);
			continue;
		}
		/* Slices come back to back (the submitter runs its hook in
		 * between): spin a little before sleeping. */
		for (end = kvd_now_ns() + SPIN_NS;
		     atomic_load_explicit(&p->b.gen, memory_order_relaxed) == g && kvd_now_ns() < end;)
			cpu_relax();
		futex_wait(&p->b.gen, g);
	}
}

/* The bulk threads, one per worker (the submitter's slot too), on the
 * workers' CPUs, started on first use.  0 when none could start. */
static int bulk_threads(struct kvd_pool *p)
{
	unsigned want = p->n + p->help;

	if (p->b_state)
		return p->b_state > 0;
	p->b_state = -1;
	if (!(p->bw = calloc(want, sizeof *p->bw)))
		return 0;
	for (unsigned i = 0; i < want; i++) {
		struct worker *w = &p->bw[i];

		w->pool = p;
		w->id = want + i;
		w->cpu = i < p->n ? p->w[i].cpu : -1;
		if (start_thread(w, bulk_main, 0))
			break;
		p->nb = i + 1;
	}
	if (p->nb)
		p->b_state = 1;
	return p->nb > 0;
}

/* A waiting submitter's slice, on the bulk threads; 0 when they are not
 * to be had (another waiting submitter has them, or none could start). */
static int run_bulk(struct kvd_pool *p, uint32_t ntasks, kvd_pool_fn fn, void *arg)
{
	struct bulk_job *b = &p->b;
	uint32_t g;

	if (atomic_exchange_explicit(&p->b_busy, 1, memory_order_acquire))
		return 0;
	if (!bulk_threads(p)) {
		atomic_store_explicit(&p->b_busy, 0, memory_order_release);
		return 0;
	}
	if (!(g = ++p->b_gen))
		g = ++p->b_gen;         /* 0 is a new thread's "seen" */
	atomic_store_explicit(&b->ntasks, ntasks, memory_order_relaxed);
	atomic_store_explicit(&b->fn, fn, memory_order_relaxed);
	atomic_store_explicit(&b->arg, arg, memory_order_relaxed);
	atomic_store_explicit(&b->wake, yield_hook.wake, memory_order_relaxed);
	atomic_store_explicit(&b->wake_arg, yield_hook.arg, memory_order_relaxed);
	atomic_store_explicit(&b->done, 0, memory_order_relaxed);
	atomic_store_explicit(&b->claim, (uint64_t)g << 32 | ntasks, memory_order_release);
	atomic_store_explicit(&b->gen, g, memory_order_release);
	futex_wake_all(&b->gen);
	for (uint32_t d; (d = atomic_load_explicit(&b->done, memory_order_acquire)) != ntasks;) {
		/* A count past the slice's would never come back to it: a task
		 * claimed twice (see struct bulk_job).  Crash a test, not hang. */
		if (NEVER(d > ntasks))
			break;
		yield_hook.wait(yield_hook.arg);
	}
	atomic_store_explicit(&p->b_busy, 0, memory_order_release);
	return 1;
}

static void run_job(struct kvd_pool *p, uint32_t ntasks, kvd_pool_fn fn, void *arg, int bulk)
{
	struct job j = { .fn = fn, .arg = arg, .ntasks = ntasks, .bulk = bulk };

	if (ntasks == 0)
		return;
	pthread_mutex_lock(&p->mu);
	if (p->tail)
		p->tail->link = &j;
	else
		p->head = &j;
	p->tail = &j;
	atomic_fetch_add_explicit(&p->queued, 1, memory_order_relaxed);
	if (p->sleepers)
		pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->mu);

	if (p->help && !atomic_exchange_explicit(&p->helping, 1, memory_order_acquire)) {
		/* Acquire and release: the slot's scratch passes from one
		 * submitter to the next as a worker's does from job to job. */
		run_tasks(&j, p->n);
		atomic_store_explicit(&p->helping, 0, memory_order_release);
	}
	/* Done means every task ran; the job may still be referenced by a
	 * worker on its way out, and it lives in this frame: wait for the
	 * last one under the lock (cheap: it is leaving). */
	spin(&j.done, ntasks, 0);
	pthread_mutex_lock(&p->mu);
	while (atomic_load_explicit(&j.done, memory_order_acquire) != ntasks || j.refs)
		pthread_cond_wait(&p->fin, &p->mu);
	/* A job whose tasks the submitter claimed before any worker came
	 * back is still listed (behind another job, maybe): unlink it, or it
	 * dangles once this frame returns. */
	for (struct job **pp = &p->head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->link)
		if (*pp == &j) {
			*pp = j.link;
			if (p->tail == &j)
				p->tail = prev;
			atomic_fetch_sub_explicit(&p->queued, 1, memory_order_relaxed);
			break;
		}
	pthread_mutex_unlock(&p->mu);
}

void kvd_pool_run(struct kvd_pool *p, uint32_t ntasks, kvd_pool_fn fn, void *arg)
{
	run_job(p, ntasks, fn, arg, 0);
}

void kvd_pool_set_yield(void (*fn)(void *arg), void *arg)
{
	yield_hook.fn = fn;
	yield_hook.arg = arg;
	yield_hook.wait = NULL;
	yield_hook.wake = NULL;
}

void kvd_pool_set_wait(void (*wait)(void *arg), void (*wake)(void *arg))
{
	if (yield_hook.fn) {
		yield_hook.wait = wait;
		yield_hook.wake = wake;
	}
}

void kvd_pool_yield(void)
{
	if (yield_hook.fn)
		yield_hook.fn(yield_hook.arg);
}

struct slice {
	kvd_pool_fn fn;
	void *arg;
	uint32_t t0;
};

static void slice_task(void *arg, uint32_t t, unsigned worker)
{
	const struct slice *sl = arg;

	sl->fn(sl->arg, sl->t0 + t, worker);
}

void kvd_pool_run_sliced(struct kvd_pool *p, uint32_t ntasks, kvd_pool_fn fn, void *arg)
{
	if (!yield_hook.fn) {
		kvd_pool_run(p, ntasks, fn, arg);
		return;
	}
	const uint32_t n = kvd_pool_size(p);
	const int bulk = kvd_pool_bulk_nice(-1) == 0;     /* switching works */

	for (uint32_t t0 = 0; t0 < ntasks; t0 += n) {
		struct slice sl = { fn, arg, t0 };
		uint32_t m = ntasks - t0 < n ? ntasks - t0 : n;

		if (t0)
			yield_hook.fn(yield_hook.arg);
		/* A waiting submitter's slices go to the bulk threads (never
		 * nested: the hook starts no sliced job). */
		if (!yield_hook.wait || !run_bulk(p, m, slice_task, &sl))
			run_job(p, m, slice_task, &sl, bulk);
	}
}

/* ---- the side thread: first touches off the hook's thread -------------- */

/* Below this, a few small pages: not worth a handoff.  A huge page is: on a
 * VM its first touch took 4 ms. */
#define PREFAULT_MIN (64u << 10)
/* How long the waiting thread sleeps between calls of its hook: what a
 * request arriving meanwhile may wait for it, at most. */
#define PREFAULT_POLL_NS 100000
/* Niceness of the side thread above its creator's bulk niceness.  Low, so
 * that a worker woken for a short request preempts it at once; not
 * SCHED_IDLE, under which any busy process on the machine could starve it
 * for good. */
#define PREFAULT_NICE 10
/* A side thread slower than this (ns a byte: 0.25 GB/s, half the coldest
 * faults measured) is being starved by busier threads, at its niceness:
 * the caller stops waiting and the job's workers fault the rest, at
 * theirs, while the side thread goes on.  At least
 * KVD_POOL_PREFAULT_WAIT_MIN_NS. */
#define PREFAULT_NS_PER_BYTE 4


static void *side_main(void *arg)
{
	struct kvd_pool *p = arg;

	kvd_pool_thread_below_bulk(PREFAULT_NICE);
	pthread_setname_np(pthread_self(), "kvd-prefault");
	pthread_mutex_lock(&p->pf_mu);
	for (;;) {
		while (!atomic_load_explicit(&p->pf_len, memory_order_relaxed) && !p->pf_stop)
			pthread_cond_wait(&p->pf_go, &p->pf_mu);
		if (p->pf_stop)
			break;
		char *m = p->pf_mem;
		size_t len = atomic_load_explicit(&p->pf_len, memory_order_relaxed);

		pthread_mutex_unlock(&p->pf_mu);
		/* Only the advice (kvd_mem_populate), never a touch per
		 * page: the job may write the range while this is still at
		 * it (see above).  A kernel without the advice, or no memory
		 * now, leaves the faults to the job. */
		kvd_mem_populate(m, len);
		pthread_mutex_lock(&p->pf_mu);
		atomic_store_explicit(&p->pf_len, 0, memory_order_release);
		pthread_cond_broadcast(&p->pf_done);
		if (p->pf_wake) {
			void (*wake)(void *arg) = p->pf_wake;
			void *warg = p->pf_wake_arg;

			pthread_mutex_unlock(&p->pf_mu);
			wake(warg);
			pthread_mutex_lock(&p->pf_mu);
		}
	}
	pthread_mutex_unlock(&p->pf_mu);
	return NULL;
}

void kvd_pool_prefault(struct kvd_pool *p, void *mem, size_t bytes)
{
	uintptr_t a = (uintptr_t)mem & ~(uintptr_t)4095;
	size_t len = ((uintptr_t)mem + bytes - a + 4095) & ~(size_t)4095;

	if (!p || !yield_hook.fn || bytes < PREFAULT_MIN)
		return;
	/* A waiting submitter never waits for the lock: the side thread,
	 * preempted at its low priority while it held it, would keep it from
	 * its hook.  Then the job faults the range. */
	if (yield_hook.wait ? pthread_mutex_trylock(&p->pf_mu) : pthread_mutex_lock(&p->pf_mu))
		return;
	if (p->pf_state == 0)
		p->pf_state = pthread_create(&p->pf_th, NULL, side_main, p) ? -1 : 1;
	/* One range at a time: a range given up on (below) is still being
	 * faulted, and the job's workers fault this one. */
	if (p->pf_state < 0 || atomic_load_explicit(&p->pf_len, memory_order_relaxed)) {
		pthread_mutex_unlock(&p->pf_mu);
		return;
	}
	p->pf_mem = (char *)a;
	atomic_store_explicit(&p->pf_len, len, memory_order_relaxed);
	p->pf_wake = yield_hook.wake;
	p->pf_wake_arg = yield_hook.arg;
	pthread_cond_signal(&p->pf_go);

	uint64_t wait = (uint64_t)len * PREFAULT_NS_PER_BYTE, t0 = kvd_now_ns();

	if (wait < KVD_POOL_PREFAULT_WAIT_MIN_NS)
		wait = KVD_POOL_PREFAULT_WAIT_MIN_NS;
	if (yield_hook.wait) {
		/* Woken by the side thread when the range is in. */
		pthread_mutex_unlock(&p->pf_mu);
		while (atomic_load_explicit(&p->pf_len, memory_order_acquire) &&
		       kvd_now_ns() - t0 < wait)
			yield_hook.wait(yield_hook.arg);
		return;
	}
	while (atomic_load_explicit(&p->pf_len, memory_order_relaxed) && kvd_now_ns() - t0 < wait) {
		struct timespec ts;

		pthread_mutex_unlock(&p->pf_mu);
		yield_hook.fn(yield_hook.arg);
		clock_gettime(CLOCK_MONOTONIC, &ts);
		ts.tv_nsec += PREFAULT_POLL_NS;
		if (ts.tv_nsec >= 1000000000) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000;
		}
		pthread_mutex_lock(&p->pf_mu);
		if (atomic_load_explicit(&p->pf_len, memory_order_relaxed))
			pthread_cond_timedwait(&p->pf_done, &p->pf_mu, &ts);
	}
	pthread_mutex_unlock(&p->pf_mu);
}

/* The affinity goes in the thread's attributes, not a call in worker_main:
 * glibc applies it before the thread runs and fails pthread_create when the
 * kernel refuses it, so a worker never runs a task off its CPU and a bad CPU
 * is reported to the creator instead of ignored. */
static int start_thread(struct worker *w, void *(*fn)(void *), int strict)
{
	pthread_attr_t attr;
	int rc = pthread_attr_init(&attr);

	if (rc)
		return rc;
	if (w->cpu >= 0) {
		size_t sz = CPU_ALLOC_SIZE(w->cpu + 1);
		cpu_set_t *set = CPU_ALLOC(w->cpu + 1);

		if (set) {
			CPU_ZERO_S(sz, set);
			CPU_SET_S(w->cpu, sz, set);
			rc = pthread_attr_setaffinity_np(&attr, sz, set);
			CPU_FREE(set);
		} else {
			rc = ENOMEM;
		}
	}
	if (!rc)
		rc = pthread_create(&w->th, &attr, fn, w);
	pthread_attr_destroy(&attr);
	if (rc && w->cpu >= 0 && !strict) {
		/* kvd_pool_create's pinning only buys locality: better an
		 * unpinned worker (a seccomp'd sched_setaffinity, a cpuset that
		 * shrank since we read it) than no pool. */
		w->cpu = -1;
		rc = pthread_create(&w->th, NULL, fn, w);
	}
	return rc;
}

/* cpus == NULL: unpinned.  strict: fail rather than run a worker unpinned.
 * help: the submitter is the last worker, and one thread fewer starts. */
static int pool_start(unsigned nthreads, const int *cpus, unsigned ncpus, int strict,
		      unsigned help, struct kvd_pool **out)
{
	struct kvd_pool *p;

	if (nthreads > 1024)
		return -EINVAL;
	p = calloc(1, sizeof *p + nthreads * sizeof p->w[0]);
	if (!p)
		return -ENOMEM;
	pthread_mutex_init(&p->mu, NULL);
	pthread_cond_init(&p->work, NULL);
	pthread_cond_init(&p->fin, NULL);
	pthread_mutex_init(&p->pf_mu, NULL);
	pthread_cond_init(&p->pf_go, NULL);
	pthread_condattr_t ca;

	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&p->pf_done, &ca);
	pthread_condattr_destroy(&ca);
	p->help = help;
	for (unsigned i = 0; i < nthreads - help; i++) {
		struct worker *w = &p->w[i];

		w->pool = p;
		w->id = i;
		w->cpu = cpus ? cpus[i % ncpus] : -1;
		int rc = start_thread(w, worker_main, strict);

		if (rc) {
			kvd_pool_destroy(p);
			return -rc;
		}
		p->n = i + 1;
	}
	*out = p;
	return 0;
}

int kvd_pool_create_cpus(unsigned nthreads, const int *cpus, unsigned ncpus,
			 struct kvd_pool **out)
{
	if (!cpus || ncpus == 0)
		return -EINVAL;
	for (unsigned i = 0; i < ncpus; i++)
		if (cpus[i] < 0 || cpus[i] >= 1 << 20)  /* the bound keeps CPU_ALLOC sane */
			return -EINVAL;
	return pool_start(nthreads ? nthreads : ncpus, cpus, ncpus, 1, 0, out);
}

int kvd_pool_create(unsigned nthreads, int pin, struct kvd_pool **out)
{
	cpu_set_t set;
	int cpus[CPU_SETSIZE];
	unsigned ncpu = 0;

	if (sched_getaffinity(0, sizeof set, &set) == 0) {
		for (int c = 0; c < CPU_SETSIZE; c++)
			if (CPU_ISSET(c, &set))
				cpus[ncpu++] = c;
	}
	if (nthreads == 0)
		nthreads = ncpu > 0 ? ncpu : 1;
	return pool_start(nthreads, pin && ncpu > 0 ? cpus : NULL, ncpu, 0, nthreads > 1, out);
}

void kvd_pool_destroy(struct kvd_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->mu);
	p->stop = 1;
	pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->mu);
	atomic_store_explicit(&p->b_stop, 1, memory_order_release);
	atomic_fetch_add_explicit(&p->b.gen, 1, memory_order_release);
	futex_wake_all(&p->b.gen);
	for (unsigned i = 0; i < p->n; i++)
		pthread_join(p->w[i].th, NULL);
	for (unsigned i = 0; i < p->nb; i++)
		pthread_join(p->bw[i].th, NULL);
	free(p->bw);
	pthread_mutex_lock(&p->pf_mu);
	p->pf_stop = 1;
	pthread_cond_signal(&p->pf_go);
	pthread_mutex_unlock(&p->pf_mu);
	if (p->pf_state > 0)
		pthread_join(p->pf_th, NULL);
	pthread_cond_destroy(&p->pf_done);
	pthread_cond_destroy(&p->pf_go);
	pthread_mutex_destroy(&p->pf_mu);
	pthread_cond_destroy(&p->fin);
	pthread_cond_destroy(&p->work);
	pthread_mutex_destroy(&p->mu);
	free(p);
}
