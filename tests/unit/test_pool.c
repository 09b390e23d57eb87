/* The worker pool: every task runs exactly once, on a valid worker id, and
 * its writes are visible when kvd_pool_run() returns — also with several
 * submitting threads at once (this test runs under TSan in `make test`). */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>
#include <cmocka.h>

#include "engine/clock.h"
#include "engine/mem.h"
#include "engine/pool.h"
#include "testutil.h"

struct count_job {
	unsigned nworkers;
	uint32_t *hits;                 /* plain writes: each slot has one writer */
	int bad_worker;                 /* written only on failure, by whoever */
	uint64_t *per_worker;           /* [nworkers], touched only by its worker */
};

static void count_task(void *arg, uint32_t t, unsigned w)
{
	struct count_job *j = arg;

	if (w >= j->nworkers) {
		__atomic_store_n(&j->bad_worker, 1, __ATOMIC_RELAXED);
		return;
	}
	j->hits[t]++;
	j->per_worker[w] += t;
}

static void run_and_check(struct kvd_pool *p, uint32_t ntasks)
{
	unsigned nw = kvd_pool_size(p);
	struct count_job j = { .nworkers = nw };
	uint64_t sum = 0;

	j.hits = calloc(ntasks + 1, sizeof *j.hits);
	j.per_worker = calloc(nw, sizeof *j.per_worker);
	assert_non_null(j.hits);
	kvd_pool_run(p, ntasks, count_task, &j);
	assert_int_equal(j.bad_worker, 0);
	for (uint32_t t = 0; t < ntasks; t++)
		assert_int_equal(j.hits[t], 1);
	for (unsigned w = 0; w < nw; w++)
		sum += j.per_worker[w];
	assert_true(sum == (uint64_t)ntasks * (ntasks - (ntasks > 0)) / 2 || ntasks == 0);
	free(j.hits);
	free(j.per_worker);
}

static void test_each_task_once(void **state)
{
	struct kvd_pool *p;

	for (unsigned n = 1; n <= 4; n++) {
		assert_int_equal(kvd_pool_create(n, 0, &p), 0);
		assert_int_equal(kvd_pool_size(p), n);
		for (uint32_t t = 0; t < 50; t++)
			run_and_check(p, t);
		run_and_check(p, 10000);
		kvd_pool_destroy(p);
	}
}

static void test_default_size_and_pinning(void **state)
{
	struct kvd_pool *p;

	assert_int_equal(kvd_pool_create(0, 1, &p), 0);
	assert_true(kvd_pool_size(p) >= 1);
	run_and_check(p, 1000);
	kvd_pool_destroy(p);
}

struct submitter {
	struct kvd_pool *p;
	int rounds;
};

static void *submit_main(void *arg)
{
	struct submitter *s = arg;

	for (int r = 0; r < s->rounds; r++)
		run_and_check(s->p, (uint32_t)(1 + r % 37));
	return NULL;
}

static void test_concurrent_submitters(void **state)
{
	struct kvd_pool *p;
	pthread_t th[4];
	struct submitter s;

	assert_int_equal(kvd_pool_create(3, 0, &p), 0);
	s.p = p;
	s.rounds = 300;
	for (int i = 0; i < 4; i++)
		assert_int_equal(pthread_create(&th[i], NULL, submit_main, &s), 0);
	for (int i = 0; i < 4; i++)
		pthread_join(th[i], NULL);
	kvd_pool_destroy(p);
}

static void test_idle_pool_sleeps_and_wakes(void **state)
{
	struct kvd_pool *p;
	struct timespec ts = { 0, 20 * 1000 * 1000 };

	assert_int_equal(kvd_pool_create(2, 0, &p), 0);
	run_and_check(p, 10);
	nanosleep(&ts, NULL);           /* past the spin: workers are asleep */
	run_and_check(p, 10);
	kvd_pool_destroy(p);
}

/* The submitter is the last worker of a kvd_pool_create() pool.  With the
 * pool's one thread held in job A (one of A's two tasks; the other ran on
 * A's submitter), job B still completes: its submitter runs every task as
 * worker 1, and unlinks B, which was never the head of the list, before
 * returning.  Then A finishes. */
struct held {
	struct kvd_pool *p;
	_Atomic int thread_in, release, bad;
	_Atomic uint32_t b_ran;
};

static void held_task(void *arg, uint32_t t, unsigned w)
{
	struct held *h = arg;
	struct timespec ts = { 0, 100 * 1000 };

	(void)t;
	if (w == 0) {
		atomic_store(&h->thread_in, 1);
		while (!atomic_load(&h->release))
			nanosleep(&ts, NULL);
	} else {
		while (!atomic_load(&h->thread_in))
			nanosleep(&ts, NULL);
	}
}

static void b_task(void *arg, uint32_t t, unsigned w)
{
	struct held *h = arg;

	(void)t;
	if (w != 1)
		atomic_store(&h->bad, 1);
	atomic_fetch_add(&h->b_ran, 1);
}

static void *held_main(void *arg)
{
	struct held *h = arg;

	kvd_pool_run(h->p, 2, held_task, h);
	return NULL;
}

/* Releases the thread after 20 s should B wait on it after all (A's
 * submitter descheduled between its task and giving up the slot), so the
 * test fails instead of hanging. */
static void *watchdog_main(void *arg)
{
	struct held *h = arg;
	struct timespec ts = { 0, 10 * 1000 * 1000 };

	for (int i = 0; i < 2000 && !atomic_load(&h->release); i++)
		nanosleep(&ts, NULL);
	atomic_store(&h->release, 2);
	return NULL;
}

static void test_submitter_runs_its_job(void **state)
{
	struct held h = { 0 };
	struct timespec ts = { 0, 100 * 1000 };
	pthread_t th, wd;

	assert_int_equal(kvd_pool_create(2, 0, &h.p), 0);
	assert_int_equal(kvd_pool_size(h.p), 2);
	assert_int_equal(pthread_create(&th, NULL, held_main, &h), 0);
	assert_int_equal(pthread_create(&wd, NULL, watchdog_main, &h), 0);
	while (!atomic_load(&h.thread_in))
		nanosleep(&ts, NULL);
	/* A's submitter leaves its task once the thread is in A: give it
	 * time to give up the slot */
	for (int i = 0; i < 100; i++)
		nanosleep(&ts, NULL);
	kvd_pool_run(h.p, 4, b_task, &h);
	assert_int_equal(atomic_load(&h.release), 0);
	assert_int_equal(atomic_load(&h.b_ran), 4);
	assert_int_equal(atomic_load(&h.bad), 0);
	atomic_store(&h.release, 1);
	pthread_join(th, NULL);
	pthread_join(wd, NULL);
	run_and_check(h.p, 100);
	kvd_pool_destroy(h.p);
}

/* kvd_pool_run_sliced: without a hook one job; with one, every task runs
 * once, at most a worker's worth between two calls of the hook, the hook
 * runs on the caller between slices (never before the first), and
 * kvd_pool_yield calls it. */
struct sliced {
	_Atomic uint32_t *hits;
	_Atomic uint32_t since_hook;
	_Atomic uint32_t worst;
	unsigned hooks;
	pthread_t caller;
	int off_thread;
};

static void sliced_task(void *arg, uint32_t t, unsigned w)
{
	struct sliced *x = arg;
	uint32_t n = atomic_fetch_add(&x->since_hook, 1) + 1;

	atomic_fetch_add(&x->hits[t], 1);
	if (n > atomic_load(&x->worst))
		atomic_store(&x->worst, n);
}

static void sliced_hook(void *arg)
{
	struct sliced *x = arg;

	x->hooks++;
	x->off_thread |= !pthread_equal(pthread_self(), x->caller);
	atomic_store(&x->since_hook, 0);
}

static void test_sliced_with_yield_hook(void **state)
{
	struct kvd_pool *p;
	struct sliced x = { 0 };
	enum { N = 37 };

	assert_int_equal(kvd_pool_create(3, 0, &p), 0);
	x.hits = calloc(N, sizeof *x.hits);
	x.caller = pthread_self();
	kvd_pool_run_sliced(p, N, sliced_task, &x);     /* no hook: one job */
	assert_int_equal(x.hooks, 0);
	kvd_pool_set_yield(sliced_hook, &x);
	kvd_pool_yield();
	assert_int_equal(x.hooks, 1);
	x.hooks = 0;
	atomic_store(&x.worst, 0);
	atomic_store(&x.since_hook, 0);
	kvd_pool_run_sliced(p, N, sliced_task, &x);
	kvd_pool_set_yield(NULL, NULL);
	for (int t = 0; t < N; t++)
		assert_int_equal(atomic_load(&x.hits[t]), 2);
	assert_int_equal(x.hooks, (N + 2) / 3 - 1);
	assert_true(atomic_load(&x.worst) <= 3);
	assert_int_equal(x.off_thread, 0);
	free((void *)x.hits);
	kvd_pool_destroy(p);
}

/* A waiting submitter (kvd_pool_set_wait): the slices of its sliced job run
 * on the bulk threads, never on the workers or on it; it calls its wait
 * hook while a slice runs, and a plain job it submits from there runs at
 * once, beside a slice task that is still running (the first task holds
 * until that job has run: on the hook-between-slices pool it would wait
 * for good, and time out) and on the workers (a worker busy with a slice
 * task would hold it as long); wake comes once a slice, from a pool
 * thread. */
struct waiter {
	pthread_t caller;
	struct kvd_pool *p;
	unsigned size;
	_Atomic int released, timed_out, on_caller, bad_worker, nested_on_workers;
	_Atomic int in_task;            /* slice tasks running now */
	_Atomic int wakes, wake_on_caller;
	_Atomic int nested_beside;      /* a slice task was running at the release */
	int waits, hooks;
	_Atomic uint32_t *hits;
};

static void waiter_task(void *arg, uint32_t t, unsigned w)
{
	struct waiter *x = arg;
	struct timespec ts = { 0, 100 * 1000 };

	atomic_fetch_add(&x->in_task, 1);
	if (pthread_equal(pthread_self(), x->caller))
		atomic_store(&x->on_caller, 1);
	if (w < x->size || w >= 2 * x->size)
		atomic_store(&x->bad_worker, 1);
	atomic_fetch_add(&x->hits[t], 1);
	/* 5 s at most: a pool that never lets the caller in fails, not hangs */
	for (int i = 0; t == 0 && !atomic_load(&x->released) && i < 50000; i++)
		nanosleep(&ts, NULL);
	if (t == 0 && !atomic_load(&x->released))
		atomic_store(&x->timed_out, 1);
	atomic_fetch_sub(&x->in_task, 1);
}

static void release_task(void *arg, uint32_t t, unsigned w)
{
	struct waiter *x = arg;

	(void)t;
	if (w < x->size)
		atomic_fetch_add(&x->nested_on_workers, 1);
	if (atomic_load(&x->in_task) > 0)
		atomic_store(&x->nested_beside, 1);
	atomic_store(&x->released, 1);
}

static void waiter_hook(void *arg)
{
	struct waiter *x = arg;

	x->hooks++;
}

static void waiter_wait(void *arg)
{
	struct waiter *x = arg;
	struct timespec ts = { 0, 50 * 1000 };

	if (!pthread_equal(pthread_self(), x->caller))
		atomic_store(&x->on_caller, 1);
	x->waits++;
	if (!atomic_load(&x->released) && atomic_load(&x->in_task) > 0)
		kvd_pool_run(x->p, 2, release_task, x);
	nanosleep(&ts, NULL);
}

static void waiter_wake(void *arg)
{
	struct waiter *x = arg;

	if (pthread_equal(pthread_self(), x->caller))
		atomic_store(&x->wake_on_caller, 1);
	atomic_fetch_add(&x->wakes, 1);
}

static void test_sliced_waiting_submitter(void **state)
{
	enum { N = 7 };
	struct waiter x = { 0 };
	int named, lo, hi;

	(void)state;
	assert_int_equal(kvd_pool_create(2, 0, &x.p), 0);
	x.size = kvd_pool_size(x.p);
	x.caller = pthread_self();
	x.hits = calloc(N, sizeof *x.hits);
	kvd_pool_set_wait(waiter_wait, waiter_wake);     /* no hook: ignored */
	kvd_pool_set_yield(waiter_hook, &x);
	kvd_pool_set_wait(waiter_wait, waiter_wake);
	kvd_pool_run_sliced(x.p, N, waiter_task, &x);
	kvd_pool_set_yield(NULL, NULL);
	for (int t = 0; t < N; t++)
		assert_int_equal(atomic_load(&x.hits[t]), 1);
	assert_int_equal(atomic_load(&x.timed_out), 0);
	assert_int_equal(atomic_load(&x.nested_beside), 1);
	assert_int_equal(atomic_load(&x.on_caller), 0);
	assert_int_equal(atomic_load(&x.bad_worker), 0);
	assert_int_equal(atomic_load(&x.nested_on_workers), 2);
	assert_true(x.waits >= 1);
	/* ceil(N / size) slices, the hook between them as before (a wake
	 * for each, counted below: the last may come after the return) */
	assert_int_equal(x.hooks, (N + x.size - 1) / x.size - 1);
	thread_nices(0, "kvd-bulk", NULL, &named, &lo, &hi);
	assert_int_equal(named, kvd_pool_bulk_nice(0));

	/* set_yield cleared the wait: the caller runs tasks again */
	atomic_store(&x.released, 1);
	x.waits = 0;
	kvd_pool_set_yield(waiter_hook, &x);
	kvd_pool_run_sliced(x.p, N, waiter_task, &x);
	kvd_pool_set_yield(NULL, NULL);
	assert_int_equal(x.waits, 0);
	free((void *)x.hits);
	kvd_pool_destroy(x.p);
	assert_int_equal(atomic_load(&x.wakes), (N + x.size - 1) / x.size);
	assert_int_equal(atomic_load(&x.wake_on_caller), 0);
}

/* Two waiting submitters on one pool: one has the bulk threads, the other
 * runs its slices as before (the workers and itself); every task of both
 * runs exactly once, many jobs over. */
struct two {
	struct kvd_pool *p;
	_Atomic uint32_t hits[2][64];
	_Atomic int bulk_ids[2];
};

struct two_arg {
	struct two *x;
	int who;
};

static void two_task(void *arg, uint32_t t, unsigned w)
{
	struct two_arg *a = arg;

	atomic_fetch_add(&a->x->hits[a->who][t], 1);
	if (w >= kvd_pool_size(a->x->p))
		atomic_store(&a->x->bulk_ids[a->who], 1);
}

/* A yield hook with nothing to run between slices. */
static void noop_hook(void *arg)
{
	(void)arg;
}

static void two_wait(void *arg)
{
	(void)arg;
	sched_yield();
}

static void *two_main(void *arg)
{
	struct two_arg *a = arg;

	kvd_pool_set_yield(noop_hook, a);
	kvd_pool_set_wait(two_wait, NULL);
	for (int r = 0; r < 200; r++)
		kvd_pool_run_sliced(a->x->p, 64, two_task, a);
	kvd_pool_set_yield(NULL, NULL);
	return NULL;
}

static void test_two_waiting_submitters(void **state)
{
	struct two x = { 0 };
	struct two_arg a[2] = { { &x, 0 }, { &x, 1 } };
	pthread_t th[2];

	(void)state;
	assert_int_equal(kvd_pool_create(3, 0, &x.p), 0);
	for (int i = 0; i < 2; i++)
		assert_int_equal(pthread_create(&th[i], NULL, two_main, &a[i]), 0);
	for (int i = 0; i < 2; i++)
		pthread_join(th[i], NULL);
	for (int i = 0; i < 2; i++)
		for (int t = 0; t < 64; t++)
			assert_int_equal(atomic_load(&x.hits[i][t]), 200);
	/* the bulk threads ran some slices of one of them at least */
	assert_true(atomic_load(&x.bulk_ids[0]) || atomic_load(&x.bulk_ids[1]));
	kvd_pool_destroy(x.p);
}

/* Slices of different sizes back to back on the bulk threads, more threads
 * than CPUs so that they are preempted anywhere: every task of every slice
 * runs once, with its own slice's arguments, and the submitter's count
 * ends at its slice's size.  A thread that read a short slice's claim and
 * then a longer next slice's size, still being written, claimed a task
 * past the short slice's end: it ran a task twice (or with a slice's
 * arguments that were gone) and its count went one past the next slice's,
 * whose submitter then waited for ever. */
enum { MIX_CALLS = 4000, MIX_MAX = 8 };

struct mix_call {
	uint32_t call;
	_Atomic uint32_t *hits;         /* [MIX_CALLS][MIX_MAX] */
	_Atomic int *bad;
};

struct mix_wait {
	uint64_t t0;
	uint32_t calls;
};

static void mix_task(void *arg, uint32_t t, unsigned w)
{
	const struct mix_call *c = arg;

	(void)w;
	if (t >= MIX_MAX)
		atomic_store(c->bad, 1);
	else
		atomic_fetch_add(&c->hits[c->call * MIX_MAX + t], 1);
}

static void mix_wait(void *arg)
{
	struct mix_wait *x = arg;

	/* the old count overran and never ended: fail, not hang */
	if (kvd_now_ns() - x->t0 > 60ull * 1000000000) {
		fprintf(stderr, "kvd_pool_run_sliced never ended (call %u)\n", x->calls);
		abort();
	}
	sched_yield();
}

static void test_bulk_slices_of_every_size(void **state)
{
	struct kvd_pool *p;
	_Atomic int bad = 0;
	_Atomic uint32_t *hits = calloc((size_t)MIX_CALLS * MIX_MAX, sizeof *hits);
	struct mix_wait x = { kvd_now_ns(), 0 };

	(void)state;
	assert_non_null(hits);
	assert_int_equal(kvd_pool_create(MIX_MAX, 0, &p), 0);
	kvd_pool_set_yield(noop_hook, &x);
	kvd_pool_set_wait(mix_wait, NULL);
	for (uint32_t i = 0; i < MIX_CALLS; i++) {
		/* one slice each: 1, 8, 2, 7, ... a short one before a long one */
		uint32_t n = i % 2 ? MIX_MAX - (i / 2) % MIX_MAX : (i / 2) % MIX_MAX + 1;
		struct mix_call c = { i, hits, &bad };

		x.calls = i;
		kvd_pool_run_sliced(p, n, mix_task, &c);
		for (uint32_t t = 0; t < MIX_MAX; t++)
			assert_int_equal(atomic_load(&hits[i * MIX_MAX + t]), t < n);
	}
	kvd_pool_set_yield(NULL, NULL);
	kvd_pool_destroy(p);
	assert_int_equal(atomic_load(&bad), 0);
	/* the tasks of a late, phantom claim land after their call was checked */
	for (size_t i = 0; i < (size_t)MIX_CALLS * MIX_MAX; i++)
		assert_true(atomic_load(&hits[i]) <= 1);
	free((void *)hits);
}

/* Each task and hook notes the niceness it ran at. */
struct nices {
	_Atomic int task_min, task_max;
	int hook_min, hook_max;
};

static int my_nice(void)
{
	errno = 0;
	int n = getpriority(PRIO_PROCESS, 0);

	assert_int_equal(errno, 0);
	return n;
}

static void nice_task(void *arg, uint32_t t, unsigned worker)
{
	struct nices *x = arg;
	int n = my_nice(), m;

	(void)t;
	(void)worker;
	for (m = atomic_load(&x->task_min); n < m && !atomic_compare_exchange_weak(&x->task_min, &m, n);)
		;
	for (m = atomic_load(&x->task_max); n > m && !atomic_compare_exchange_weak(&x->task_max, &m, n);)
		;
}

static void nice_hook(void *arg)
{
	struct nices *x = arg;
	int n = my_nice();

	x->hook_min = n < x->hook_min ? n : x->hook_min;
	x->hook_max = n > x->hook_max ? n : x->hook_max;
}

/* A thread below nice 0 runs a sliced job's tasks at 0 (kvd_pool_bulk_nice)
 * and the hook between slices, a plain job's tasks and what follows at its
 * own.  Lowering one's niceness takes CAP_SYS_NICE: as root (CI) the pool
 * is made from a thread at -5, otherwise at the test's own niceness, where
 * nothing may change. */
static void test_sliced_bulk_nice(void **state)
{
	struct kvd_pool *p;
	struct nices x = { .task_min = 99, .task_max = -99, .hook_min = 99, .hook_max = -99 };
	int base, was = test_set_nice(-5, my_nice(), &base), bulk = kvd_pool_bulk_nice(base);

	(void)state;
	if (geteuid() == 0)
		assert_int_equal(bulk, 0);
	else
		assert_int_equal(bulk, base < 0 ? bulk : base);
	assert_int_equal(kvd_pool_bulk_nice(7), 7);
	assert_int_equal(kvd_pool_create(3, 0, &p), 0);
	kvd_pool_set_yield(nice_hook, &x);
	kvd_pool_run_sliced(p, 30, nice_task, &x);
	kvd_pool_set_yield(NULL, NULL);
	assert_int_equal(atomic_load(&x.task_min), bulk);
	assert_int_equal(atomic_load(&x.task_max), bulk);
	assert_int_equal(x.hook_min, base);
	assert_int_equal(x.hook_max, base);
	assert_int_equal(my_nice(), base);
	atomic_store(&x.task_min, 99);
	atomic_store(&x.task_max, -99);
	kvd_pool_run(p, 30, nice_task, &x);
	assert_int_equal(atomic_load(&x.task_min), base);
	assert_int_equal(atomic_load(&x.task_max), base);
	kvd_pool_destroy(p);
	test_restore_nice(was);
}

struct pf {
	unsigned hooks, waits;
	_Atomic int wakes;
	int off_thread;
	pthread_t caller;
};

static void pf_hook(void *arg)
{
	struct pf *x = arg;

	x->hooks++;
	x->off_thread |= !pthread_equal(pthread_self(), x->caller);
}

static void pf_wait(void *arg)
{
	struct pf *x = arg;
	struct timespec ts = { 0, 20 * 1000 };

	x->waits++;
	x->off_thread |= !pthread_equal(pthread_self(), x->caller);
	nanosleep(&ts, NULL);
}

static void pf_wake(void *arg)
{
	struct pf *x = arg;

	atomic_fetch_add(&x->wakes, 1);
}

static size_t resident(unsigned char *m, size_t len)
{
	size_t pages = len / 4096, n = 0;
	unsigned char *vec = malloc(pages);

	assert_non_null(vec);
	assert_int_equal(mincore(m, len, vec), 0);
	for (size_t i = 0; i < pages; i++)
		n += vec[i] & 1;
	free(vec);
	return n;
}

/* kvd_pool_prefault on a fresh pool: the range is in when it returns early
 * (before it may give up on a starved side thread), and by the time the
 * pool is gone (its side thread goes on when it gives up). */
static void prefault_on_new_pool(unsigned char *m, size_t len, unsigned char *a, size_t n,
				 void (*wait)(void *), void (*wake)(void *), void *arg)
{
	struct kvd_pool *p;
	uint64_t t0;

	assert_int_equal(kvd_pool_create(2, 0, &p), 0);
	kvd_pool_set_yield(pf_hook, arg);
	kvd_pool_set_wait(wait, wake);
	t0 = kvd_now_ns();
	kvd_pool_prefault(p, a, n);
	t0 = kvd_now_ns() - t0;
	kvd_pool_set_yield(NULL, NULL);
	if (t0 < KVD_POOL_PREFAULT_WAIT_MIN_NS)
		assert_int_equal(resident(m, len), len / 4096);
	kvd_pool_destroy(p);
	assert_int_equal(resident(m, len), len / 4096);
}

/* The range is in, what was written stays, and the caller's hook ran
 * meanwhile (on the caller); without a hook it leaves the faults to the
 * job. */
static void test_prefault(void **state)
{
	enum { LEN = 16 << 20 };
	struct kvd_pool *p;
	struct pf x = { 0 };
	unsigned char *m = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
				-1, 0);

	(void)state;
	assert_true(m != MAP_FAILED);
	/* Small pages whatever the machine's THP setting, so one byte written
	 * is one page resident. */
	assert_int_equal(madvise(m, LEN, MADV_NOHUGEPAGE), 0);
	assert_int_equal(kvd_pool_create(2, 0, &p), 0);
	m[3 * 4096 + 7] = 0x5a;
	m[LEN - 1] = 0xa5;
	kvd_pool_prefault(p, m + 4096, LEN - 4096);     /* no hook */
	assert_int_equal(resident(m, LEN), 2);
	kvd_pool_destroy(p);
	x.caller = pthread_self();
	/* rounded out to whole pages */
	prefault_on_new_pool(m, LEN, m + 100, LEN - 200, NULL, NULL, &x);
	assert_true(x.hooks >= 1);
	assert_int_equal(x.off_thread, 0);
	assert_int_equal(m[3 * 4096 + 7], 0x5a);
	assert_int_equal(m[LEN - 1], 0xa5);
	assert_int_equal(m[5 * 4096], 0);

	/* A waiting submitter waits in its wait hook, woken by the side
	 * thread once the range is in (perhaps after the call returned) */
	assert_int_equal(madvise(m, LEN, MADV_DONTNEED), 0);
	x.hooks = 0;
	prefault_on_new_pool(m, LEN, m, LEN, pf_wait, pf_wake, &x);
	assert_int_equal(x.hooks, 0);
	assert_true(x.waits >= 1);
	assert_int_equal(atomic_load(&x.wakes), 1);
	assert_int_equal(x.off_thread, 0);
	munmap(m, LEN);
}

/* The side thread sits PREFAULT_NICE (10) above the bulk niceness of the
 * thread that started it (kvd_pool_bulk_nice), not above that thread's. */
static void test_prefault_nicer(void **state)
{
	enum { LEN = 1 << 20 };
	struct kvd_pool *p;
	struct pf x = { .caller = pthread_self() };
	unsigned char *m = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
				-1, 0);

	(void)state;
	assert_true(m != MAP_FAILED);
	/* As root, below 0 as under the unit: the thread sits at 10, not at
	 * base + 10. */
	int base, was = test_set_nice(-5, 3, &base);

	assert_int_equal(kvd_pool_create(2, 0, &p), 0);
	kvd_pool_set_yield(pf_hook, &x);
	kvd_pool_prefault(p, m, LEN);
	kvd_pool_set_yield(NULL, NULL);
	int want = kvd_pool_bulk_nice(base) + 10;

	if (geteuid() == 0)
		assert_int_equal(want, 10);
	assert_int_equal(thread_nice("kvd-prefault", base), want > 19 ? 19 : want);
	kvd_pool_destroy(p);
	test_restore_nice(was);
	munmap(m, LEN);
}

static int unmapped(void *p, size_t len)
{
	unsigned char vec[2048];

	return mincore(p, len, vec) == -1 && errno == ENOMEM;
}

/* Freed behind the caller's back, every mapping is still unmapped by the
 * time kvd_mem_settle returns; heap blocks are freed as before.  Last in
 * the file: the switch is for the process's life. */
static void test_free_behind(void **state)
{
	enum { N = 16, LEN = 4 << 20 };
	char *m[N];

	(void)state;
	m[0] = kvd_mem_alloc(LEN);
	assert_non_null(m[0]);
	kvd_mem_free(m[0], LEN);
	assert_true(unmapped(m[0], LEN));
	assert_int_equal(kvd_mem_free_behind(), 0);
	assert_int_equal(kvd_mem_free_behind(), 0);     /* once is enough */
	for (int i = 0; i < N; i++) {
		m[i] = kvd_mem_alloc(LEN);
		assert_non_null(m[i]);
		memset(m[i], i, LEN);
	}
	for (int i = 0; i < N; i++)
		kvd_mem_free(m[i], LEN);
	kvd_mem_settle();
	for (int i = 0; i < N; i++)
		assert_true(unmapped(m[i], LEN));
	kvd_mem_free(kvd_mem_alloc(1000), 1000);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_each_task_once),
		cmocka_unit_test(test_default_size_and_pinning),
		cmocka_unit_test(test_concurrent_submitters),
		cmocka_unit_test(test_idle_pool_sleeps_and_wakes),
		cmocka_unit_test(test_submitter_runs_its_job),
		cmocka_unit_test(test_sliced_with_yield_hook),
		cmocka_unit_test(test_sliced_waiting_submitter),
		cmocka_unit_test(test_two_waiting_submitters),
		cmocka_unit_test(test_bulk_slices_of_every_size),
		cmocka_unit_test(test_sliced_bulk_nice),
		cmocka_unit_test(test_prefault),
		cmocka_unit_test(test_prefault_nicer),
		cmocka_unit_test(test_free_behind),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
