/* Ring stress: a client pushes sequence-numbered entries through the SQ, an
 * echo (kvd's side) copies each one out, checks it and answers through the
 * CQ, and the client checks every answer: nothing lost, duplicated, torn or
 * reordered.  Indices start just below UINT32_MAX, so they wrap early.
 *
 * Each pairing runs three ways: both sides spinning; both sleeping on the
 * futex (no spin at all, so nearly every empty ring goes through the sleep
 * path and its lost-wake-up window); and kvd's real mix, the SQ kicked
 * through an eventfd and the CQ through the futex.  First two threads of one
 * process (so TSan sees every access), then two processes over one memfd
 * (the child maps the inherited fd itself and attaches; it reports through
 * its exit status).  Counts are smaller under sanitizers; KVD_STRESS_N
 * overrides the spinning count (the sleeping runs use half of it). */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "shm/shm.h"

/* The same millions under the sanitizers: TSan still moves >2 M entries/s
 * through a ring, and the race checks are the point of running it there. */
#define N_SPIN 2000000u

#define ESZ        64
#define RING       256
#define BATCH      32
#define START      (UINT32_MAX - 1000)
#define TIMEOUT_NS 10000000000ull      /* a lost wake-up fails, not hangs */
#define SALT_SQ    0x5151u
#define SALT_CQ    0xc0c0u

enum mode { SPIN, FUTEX, KICK };
static const char *const mode_name[] = { "spin", "futex", "eventfd+futex" };

enum {
	E_OK,
	E_ORDER,        /* lost, duplicated, reordered or torn */
	E_TIMEOUT,
	E_PROTO,
	E_ATTACH,
	E_SYS,
};

/* One side's view: the ring it produces into and the one it consumes. */
struct side {
	struct shm_ring *out, *in;
	enum mode mode;
	int efd;                        /* KICK: the SQ's eventfd */
	uint64_t n;
	uint64_t wakes;                 /* times the peer had to be woken */
	int err;
};

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Test-only (as in tests/unit/test_shm.c): a fresh ring starts at index v
 * once its shared tail and head and both sides' cursors say so, before any
 * traffic.  Split in two: across fork, each process sets its own cursors. */
static void shared_start_at(struct shm_ring *r, uint32_t v)
{
	atomic_store_explicit(&r->ctl->tail, v, memory_order_relaxed);
	atomic_store_explicit(&r->ctl->head, v, memory_order_relaxed);
}

static void cursors_at(struct shm_ring *r, uint32_t v)
{
	r->local = r->peer = v;
}

/* Word by word, not memcpy: gcc folds a 64-byte memcpy into moves its TSan
 * does not instrument, and this test is where TSan must see the entries
 * (clang's sees both). */
static void put(void *e, uint64_t v, uint64_t salt)
{
	uint64_t *w = e;

	w[0] = v;
	for (size_t i = 1; i < ESZ / 8; i++)
		w[i] = (v ^ salt) * 0x9e3779b97f4a7c15ull + i;
}

/* Copies the entry out first, as kvd does. */
static int check(const void *e, uint64_t want, uint64_t salt)
{
	const uint64_t *src = e;
	uint64_t w[ESZ / 8];

	for (size_t i = 0; i < ESZ / 8; i++)
		w[i] = src[i];
	if (w[0] != want)
		return 0;
	for (size_t i = 1; i < ESZ / 8; i++)
		if (w[i] != (want ^ salt) * 0x9e3779b97f4a7c15ull + i)
			return 0;
	return 1;
}

static int side_fail(struct side *s, int err, const char *who, uint64_t at)
{
	static const char *const what[] = { "ok", "order", "timeout", "EPROTO", "attach", "syscall" };

	fprintf(stderr, "%s: %s at entry %" PRIu64 "\n", who, what[err], at);
	s->err = err;
	return err;
}

/* Waits for the consumer's ring `in` the way the mode says. */
static int wait_in(struct side *s, int kicked)
{
	uint64_t v, t0;
	int n;

	switch (s->mode) {
	case SPIN:
		/* Poll in 100 us rounds with a yield between: on a loaded
		 * 2-core box the peer may be waiting for our CPU. */
		t0 = now_ns();
		do {
			n = shm_ring_wait(s->in, 0, 100000, 1);
			if (n)
				return n;
			sched_yield();
		} while (now_ns() - t0 < TIMEOUT_NS);
		return 0;
	case FUTEX:
		return shm_ring_wait(s->in, 0, TIMEOUT_NS, 0);
	case KICK:
		if (!kicked)
			return shm_ring_wait(s->in, 0, TIMEOUT_NS, 0);
		/* kvd's dispatcher: announce, look again, then sleep on the
		 * eventfd (it would be epoll over many of them).  A kick can
		 * be stale (written for entries we already took): loop. */
		t0 = now_ns();
		shm_ring_set_sleeping(s->in, 1);
		while (!(n = shm_ring_ready(s->in)) && now_ns() - t0 < TIMEOUT_NS) {
			struct pollfd pfd = { .fd = s->efd, .events = POLLIN };

			if (poll(&pfd, 1, (int)(TIMEOUT_NS / 1000000)) == 1 &&
			    read(s->efd, &v, sizeof v) != sizeof v)
				break;
		}
		shm_ring_set_sleeping(s->in, 0);
		return n;
	}
	return 0;
}

/* After a commit: whatever the consumer of `out` needs to see it. */
static void wake_out(struct side *s, int kicked)
{
	uint64_t one = 1;

	if (s->mode == SPIN)
		return;
	if (s->mode == KICK && kicked) {
		if (shm_ring_needs_kick(s->out)) {
			s->wakes++;
			if (write(s->efd, &one, sizeof one) != sizeof one)
				s->err = E_SYS;
		}
		return;
	}
	s->wakes += (uint64_t)shm_ring_wake(s->out);
}

/* The client: pushes 0..n-1 through out (the SQ), checks the echoes on in. */
static int client(struct side *s)
{
	uint64_t sent = 0, got = 0;

	while (got < s->n) {
		uint32_t k = 0;
		int m;

		while (sent < s->n && k < BATCH) {
			void *e = shm_ring_reserve(s->out);

			if (!e)
				break;
			put(e, sent++, SALT_SQ);
			k++;
		}
		if (k) {
			shm_ring_commit(s->out, k);
			wake_out(s, 1);
		} else if (shm_ring_broken(s->out)) {
			return side_fail(s, E_PROTO, "client", sent);
		}
		m = shm_ring_ready(s->in);
		/* Block only when there is nothing left to send now. */
		if (m == 0 && !k) {
			m = wait_in(s, 0);
			if (m == 0)
				return side_fail(s, E_TIMEOUT, "client", got);
		}
		if (m < 0)
			return side_fail(s, E_PROTO, "client", got);
		for (int i = 0; i < m; i++)
			if (!check(shm_ring_entry(s->in, (uint32_t)i), got + (uint64_t)i, SALT_CQ))
				return side_fail(s, E_ORDER, "client", got + (uint64_t)i);
		shm_ring_release(s->in, (uint32_t)m);
		got += (uint64_t)m;
		if (got > sent)
			return side_fail(s, E_ORDER, "client", got);
	}
	return s->err;
}

/* The echo (kvd's side): answers each SQ entry through the CQ. */
static int echo(struct side *s)
{
	uint64_t done = 0;

	while (done < s->n) {
		uint32_t k = 0;
		int m = shm_ring_ready(s->in);

		if (m == 0) {
			m = wait_in(s, 1);
			if (m == 0)
				return side_fail(s, E_TIMEOUT, "echo", done);
		}
		if (m < 0)
			return side_fail(s, E_PROTO, "echo", done);
		for (int i = 0; i < m; i++) {
			void *e;

			if (!check(shm_ring_entry(s->in, (uint32_t)i), done + (uint64_t)i, SALT_SQ))
				return side_fail(s, E_ORDER, "echo", done + (uint64_t)i);
			/* CQ full: publish what we have and let the client
			 * drain (it never sleeps while the CQ holds entries). */
			while (!(e = shm_ring_reserve(s->out))) {
				if (shm_ring_broken(s->out))
					return side_fail(s, E_PROTO, "echo", done);
				shm_ring_commit(s->out, k);
				wake_out(s, 0);
				k = 0;
				sched_yield();
			}
			put(e, done + (uint64_t)i, SALT_CQ);
			k++;
		}
		shm_ring_release(s->in, (uint32_t)m);
		shm_ring_commit(s->out, k);
		wake_out(s, 0);
		done += (uint64_t)m;
	}
	return s->err;
}

static uint64_t count(enum mode mode)
{
	const char *env = getenv("KVD_STRESS_N");
	uint64_t n = env ? strtoull(env, NULL, 0) : N_SPIN;

	return mode == SPIN ? n : n / 2;
}

static struct shm_params params(void)
{
	return (struct shm_params){ .entry_size = ESZ, .sq_entries = RING,
				    .cq_entries = RING / 2 };
}

static void report(const char *how, enum mode mode, uint64_t n, uint64_t ns,
		   uint64_t wakes_sq, uint64_t wakes_cq)
{
	printf("stress: %-9s %-13s %8" PRIu64 " entries each way in %6.3f s (%5.2f M/s),"
	       " wake-ups SQ %" PRIu64 " CQ %" PRIu64 "\n",
	       how, mode_name[mode], n, ns / 1e9, ns ? n * 1e3 / ns : 0.0, wakes_sq, wakes_cq);
}

/* ---- two threads ------------------------------------------------------- */

static void *echo_main(void *arg)
{
	echo(arg);
	return NULL;
}

/* Each thread's process-local state on its own lines: adjacent on the stack
 * they would share a cache line, and the run would measure that. */
struct view {
	_Alignas(128) struct shm_region r;
	struct side s;
};

static void run_threads(enum mode mode)
{
	struct shm_params p = params();
	size_t size = shm_region_size(&p);
	struct view vk, vc;
	struct shm_region *kvd = &vk.r, *cli = &vc.r;
	struct side *e = &vk.s, *c = &vc.s;
	pthread_t th;
	uint64_t t0;
	void *mem;
	int efd = -1;

	mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	assert_true(mem != MAP_FAILED);
	assert_int_equal(shm_region_create(kvd, mem, &p), 0);
	assert_int_equal(shm_region_attach(cli, mem, size), 0);
	shared_start_at(&kvd->sq, START);
	shared_start_at(&kvd->cq, START - 77);
	cursors_at(&kvd->sq, START);
	cursors_at(&cli->sq, START);
	cursors_at(&kvd->cq, START - 77);
	cursors_at(&cli->cq, START - 77);
	if (mode == KICK) {
		efd = eventfd(0, EFD_CLOEXEC);
		assert_true(efd >= 0);
	}
	*c = (struct side){ .out = &cli->sq, .in = &cli->cq, .mode = mode, .efd = efd,
			    .n = count(mode) };
	*e = (struct side){ .out = &kvd->cq, .in = &kvd->sq, .mode = mode, .efd = efd,
			    .n = c->n };

	t0 = now_ns();
	assert_int_equal(pthread_create(&th, NULL, echo_main, e), 0);
	if (client(c))
		fprintf(stderr, "client failed; the echo fails on its timeout\n");
	pthread_join(th, NULL);
	report("threads", mode, c->n, now_ns() - t0, c->wakes, e->wakes);
	assert_int_equal(c->err, 0);
	assert_int_equal(e->err, 0);
	assert_true(atomic_load(&kvd->sq.ctl->tail) == (uint32_t)(START + c->n));
	assert_true(atomic_load(&kvd->cq.ctl->head) == (uint32_t)(START - 77 + c->n));
	if (efd >= 0)
		close(efd);
	munmap(mem, size);
}

static void test_threads_spin(void **state)
{
	run_threads(SPIN);
}

static void test_threads_futex(void **state)
{
	run_threads(FUTEX);
}

static void test_threads_eventfd(void **state)
{
	run_threads(KICK);
}

/* ---- two processes ----------------------------------------------------- */

/* The child: its own mapping of the inherited memfd, attached as a client
 * would.  Never returns. */
static void child_main(int fd, size_t size, enum mode mode, int efd, uint64_t n,
		       _Atomic uint64_t *wakes)
{
	struct shm_region cli;
	struct side c;
	void *mem;

	prctl(PR_SET_PDEATHSIG, SIGKILL);
	mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (mem == MAP_FAILED)
		_exit(E_SYS);
	if (shm_region_attach(&cli, mem, size))
		_exit(E_ATTACH);
	/* The shared indices were set before the fork; only our cursors. */
	cursors_at(&cli.sq, START);
	cursors_at(&cli.cq, START - 77);
	c = (struct side){ .out = &cli.sq, .in = &cli.cq, .mode = mode, .efd = efd, .n = n };
	client(&c);
	atomic_store(wakes, c.wakes);
	_exit(c.err);
}

static void run_processes(enum mode mode)
{
	struct shm_params p = params();
	size_t size = shm_region_size(&p);
	struct shm_region kvd;
	struct side e;
	uint64_t t0;
	void *mem;
	int fd, efd = -1, status = 0;
	_Atomic uint64_t *child_wakes;
	pid_t pid;

	fd = shm_memfd_create("kvd-stress", size, &mem);
	assert_true(fd >= 0);
	assert_int_equal(shm_region_create(&kvd, mem, &p), 0);
	/* Shared indices now, before the child exists; its cursors there. */
	shared_start_at(&kvd.sq, START);
	shared_start_at(&kvd.cq, START - 77);
	cursors_at(&kvd.sq, START);
	cursors_at(&kvd.cq, START - 77);
	if (mode == KICK) {
		efd = eventfd(0, EFD_CLOEXEC);
		assert_true(efd >= 0);
	}
	e = (struct side){ .out = &kvd.cq, .in = &kvd.sq, .mode = mode, .efd = efd,
			   .n = count(mode) };

	child_wakes = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	assert_true(child_wakes != MAP_FAILED);
	fflush(NULL);
	t0 = now_ns();
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0)
		child_main(fd, size, mode, efd, e.n, child_wakes);
	echo(&e);
	if (e.err)
		kill(pid, SIGKILL);
	assert_int_equal(waitpid(pid, &status, 0), pid);
	report("processes", mode, e.n, now_ns() - t0, atomic_load(child_wakes), e.wakes);
	munmap((void *)child_wakes, 4096);
	assert_int_equal(e.err, 0);
	if (!WIFEXITED(status) || WEXITSTATUS(status))
		fail_msg("child: %s %d", WIFEXITED(status) ? "exit status" : "signal",
			 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
	assert_true(atomic_load(&kvd.cq.ctl->head) == (uint32_t)(START - 77 + e.n));
	if (efd >= 0)
		close(efd);
	munmap(mem, size);
	close(fd);
}

static void test_processes_spin(void **state)
{
	run_processes(SPIN);
}

static void test_processes_futex(void **state)
{
	run_processes(FUTEX);
}

static void test_processes_eventfd(void **state)
{
	run_processes(KICK);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_threads_spin),
		cmocka_unit_test(test_threads_futex),
		cmocka_unit_test(test_threads_eventfd),
		cmocka_unit_test(test_processes_spin),
		cmocka_unit_test(test_processes_futex),
		cmocka_unit_test(test_processes_eventfd),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
