/* shm: region sizes and layout, attach's refusal of every corrupted header
 * field, the ring's FIFO order across the u32 wrap, full and broken rings,
 * the observer's gauges, the memfd's seals, and the wait / wake paths
 * (timeout, futex, polling, eventfd flag, signals).  Fast: the long runs are in tests/stress/.
 *
 * Indices are free-running, so a ring may start anywhere: ring_start_at()
 * (test-only) moves a fresh ring pair to index v by writing the shared tail
 * and head and both sides' local cursors, before any traffic. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "shm/shm.h"

#define ESZ 64

static void ring_start_at(struct shm_ring *prod, struct shm_ring *cons, uint32_t v)
{
	atomic_store_explicit(&prod->ctl->tail, v, memory_order_relaxed);
	atomic_store_explicit(&prod->ctl->head, v, memory_order_relaxed);
	prod->local = prod->peer = v;
	cons->local = cons->peer = v;
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(unsigned ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000 };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static void *map_zeroed(size_t size)
{
	void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	assert_true(m != MAP_FAILED);
	return m;
}

/* kvd's view (SQ consumer, CQ producer) and the client's of one mapping. */
struct pair {
	struct shm_params p;
	size_t size;
	void *mem;
	struct shm_region kvd, cli;
};

static void pair_open(struct pair *x, uint32_t sq, uint32_t cq, uint32_t nslots)
{
	memset(x, 0, sizeof *x);
	x->p = (struct shm_params){ .entry_size = ESZ, .sq_entries = sq,
				    .cq_entries = cq, .nslots = nslots, .slot_size = 4096 };
	x->size = shm_region_size(&x->p);
	assert_true(x->size > 0);
	x->mem = map_zeroed(x->size);
	assert_int_equal(shm_region_create(&x->kvd, x->mem, &x->p), 0);
	assert_int_equal(shm_region_attach(&x->cli, x->mem, x->size), 0);
}

static void pair_close(struct pair *x)
{
	munmap(x->mem, x->size);
}

/* ---- sizes and layout -------------------------------------------------- */

static void test_region_size(void **state)
{
	struct shm_params p = { .entry_size = 64, .sq_entries = 256, .cq_entries = 512,
				.nslots = 3, .slot_size = 8192 };
	struct shm_params q;
	/* header page, SQ: 384 + 256 * 64 -> 5 pages, CQ: 384 + 512 * 64 -> 9 */
	size_t want = 4096 + 5 * 4096 + 9 * 4096 + 3 * 8192;

	assert_int_equal(shm_region_size(&p), want);
	assert_int_equal(shm_region_size(NULL), 0);

	q = p, q.sq_entries = 0;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.sq_entries = 384;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.cq_entries = 3;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.cq_entries = 1u << 31;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.entry_size = 0;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.entry_size = 60;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.entry_size = 8192;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.slot_size = 1000;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.slot_size = 0;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.flags = 2;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.nslots = UINT32_MAX, q.slot_size = 1ull << 40;
	assert_int_equal(shm_region_size(&q), 0);
	q = p, q.nslots = 4, q.slot_size = UINT64_MAX & ~4095ull;
	assert_int_equal(shm_region_size(&q), 0);

	/* Smallest legal: one entry each way, no slots. */
	q = (struct shm_params){ .entry_size = 8, .sq_entries = 1, .cq_entries = 1 };
	assert_int_equal(shm_region_size(&q), 3 * 4096);
	q.flags = SHM_F_POLL;
	assert_int_equal(shm_region_size(&q), 3 * 4096);
}

static void test_create_attach_round_trip(void **state)
{
	struct pair x;
	struct shm_region r;
	char *base;

	pair_open(&x, 64, 128, 4);
	base = x.mem;
	assert_true(x.kvd.hdr == x.mem && x.cli.hdr == x.mem);
	assert_memory_equal(&x.kvd.geo, &x.cli.geo, sizeof x.kvd.geo);
	assert_true(x.cli.geo.magic == SHM_MAGIC);
	assert_int_equal(x.cli.geo.abi_version, SHM_ABI_VERSION);
	assert_int_equal(x.cli.geo.region_size, x.size);
	assert_int_equal(x.cli.size, x.size);
	assert_int_equal(x.cli.geo.sq_entries, 64);
	assert_int_equal(x.cli.geo.cq_entries, 128);
	assert_true(x.cli.sq.ctl == x.kvd.sq.ctl && x.cli.cq.ctl == x.kvd.cq.ctl);
	assert_true((char *)x.cli.sq.ctl == base + x.cli.geo.sq_off);
	assert_int_equal(x.cli.geo.sq_off % 4096, 0);
	assert_int_equal(x.cli.geo.cq_off % 4096, 0);
	assert_int_equal(x.cli.geo.slots_off % 4096, 0);
	assert_int_equal((uintptr_t)x.cli.sq.entries % SHM_BLOCK, 0);
	assert_int_equal(x.cli.sq.mask, 63);
	assert_int_equal(x.cli.cq.mask, 127);
	assert_int_equal(x.cli.sq.esize, ESZ);
	assert_true(shm_slot(&x.cli, 0) == base + x.cli.geo.slots_off);
	assert_true((char *)shm_slot(&x.cli, 3) + 4096 == base + x.size);
	assert_null(shm_slot(&x.cli, 4));
	assert_null(shm_slot(&x.cli, UINT32_MAX));

	/* Caller errors. */
	assert_int_equal(shm_region_create(&r, base + 64, &x.p), -EINVAL);
	assert_int_equal(shm_region_create(&r, NULL, &x.p), -EINVAL);
	x.p.sq_entries = 3;
	assert_int_equal(shm_region_create(&r, x.mem, &x.p), -EINVAL);
	assert_int_equal(shm_region_attach(&r, NULL, x.size), -EINVAL);
	assert_int_equal(shm_region_attach(&r, base + 8, x.size), -EINVAL);
	pair_close(&x);
}

/* Each corruption of a valid header that attach must refuse. */
struct corrupt {
	const char *what;
	void (*apply)(struct shm_hdr *h, size_t *size);
};

#define CORRUPT(name, body) \
	static void c_##name(struct shm_hdr *h, size_t *size) { body; }

CORRUPT(magic, h->magic ^= 1)
CORRUPT(version, h->abi_version++)
CORRUPT(hdr_small, h->hdr_size -= 8)
CORRUPT(hdr_big, h->hdr_size += 8)
CORRUPT(region_big, h->region_size += 4096)
CORRUPT(region_small, h->region_size -= 4096)
CORRUPT(map_small, *size -= 4096)
CORRUPT(map_tiny, *size = 16)
CORRUPT(esize_0, h->entry_size = 0)
CORRUPT(esize_odd, h->entry_size = 60)
CORRUPT(esize_big, h->entry_size = 8192)
CORRUPT(sq_npot, h->sq_entries = 48)
CORRUPT(sq_0, h->sq_entries = 0)
CORRUPT(sq_huge, h->sq_entries = 1u << 31)
CORRUPT(cq_npot, h->cq_entries += 1)
CORRUPT(cq_big, h->cq_entries = 1u << 20)
CORRUPT(slot_align, h->slot_size = 4000)
CORRUPT(slot_zero, h->slot_size = 0)
CORRUPT(nslots_big, h->nslots++)
CORRUPT(nslots_ovf, h->nslots = UINT32_MAX; h->slot_size = 1ull << 52)
CORRUPT(sq_off_0, h->sq_off = 0)
CORRUPT(sq_off_align, h->sq_off += 128)
CORRUPT(sq_off_past, h->sq_off = h->region_size)
CORRUPT(sq_off_ovf, h->sq_off = UINT64_MAX & ~4095ull)
CORRUPT(cq_off_overlap, h->cq_off = h->sq_off)
CORRUPT(cq_off_past, h->cq_off = h->region_size + 4096)
CORRUPT(slots_off_past, h->slots_off += 4096)
CORRUPT(slots_off_ovf, h->slots_off = 1ull << 63)
CORRUPT(flags, h->flags |= 0x80)

static void test_attach_rejects_corruption(void **state)
{
	static const struct corrupt cases[] = {
#define C(n) { #n, c_##n }
		C(magic), C(version), C(hdr_small), C(hdr_big), C(region_big),
		C(region_small), C(map_small), C(map_tiny), C(esize_0), C(esize_odd),
		C(esize_big), C(sq_npot), C(sq_0), C(sq_huge), C(cq_npot), C(cq_big),
		C(slot_align), C(slot_zero), C(nslots_big), C(nslots_ovf), C(sq_off_0),
		C(sq_off_align), C(sq_off_past), C(sq_off_ovf), C(cq_off_overlap),
		C(cq_off_past), C(slots_off_past), C(slots_off_ovf), C(flags),
#undef C
	};
	struct pair x;
	struct shm_hdr good;
	struct shm_region r, sentinel;

	pair_open(&x, 64, 64, 2);
	memcpy(&good, x.mem, sizeof good);
	memset(&sentinel, 0x5a, sizeof sentinel);
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		size_t size = x.size;

		memcpy(x.mem, &good, sizeof good);
		cases[i].apply(x.mem, &size);
		r = sentinel;
		if (shm_region_attach(&r, x.mem, size) != -EPROTO)
			fail_msg("attach accepted corruption '%s'", cases[i].what);
		/* Nothing touched on failure. */
		assert_memory_equal(&r, &sentinel, sizeof r);
	}
	memcpy(x.mem, &good, sizeof good);
	assert_int_equal(shm_region_attach(&r, x.mem, x.size), 0);
	pair_close(&x);
}

/* ---- rings ------------------------------------------------------------- */

/* An entry carries v and seven words derived from it: a torn or stale
 * entry does not check. */
static void put(void *e, uint64_t v)
{
	uint64_t w[ESZ / 8];

	w[0] = v;
	for (size_t i = 1; i < ESZ / 8; i++)
		w[i] = v * 0x9e3779b97f4a7c15ull + i;
	memcpy(e, w, ESZ);
}

static uint64_t get(const void *e)
{
	uint64_t w[ESZ / 8];

	memcpy(w, e, ESZ);
	for (size_t i = 1; i < ESZ / 8; i++)
		assert_true(w[i] == w[0] * 0x9e3779b97f4a7c15ull + i);
	return w[0];
}

static void test_ring_fifo_wraps(void **state)
{
	struct pair x;
	struct shm_ring *prod, *cons;
	uint64_t sent = 0, got = 0;
	uint32_t start = UINT32_MAX - 20;

	pair_open(&x, 8, 8, 0);
	prod = &x.cli.sq;
	cons = &x.kvd.sq;
	ring_start_at(prod, cons, start);
	assert_int_equal(shm_ring_ready(cons), 0);

	/* Batches of 1..8 against reads of 1..8: crosses the wrap of the u32
	 * indices (at entry 21) and of the mask many times. */
	for (int round = 0; round < 200; round++) {
		uint32_t nput = 1 + round % 8, nget = 1 + (round * 5 + 3) % 8, k = 0;
		int n;

		while (k < nput) {
			void *e = shm_ring_reserve(prod);

			if (!e)
				break;
			put(e, sent + k);
			k++;
		}
		shm_ring_commit(prod, k);
		sent += k;
		/* The cached tail may hold back part of what was sent, never
		 * all of it. */
		n = shm_ring_ready(cons);
		assert_true(n >= 0 && (uint64_t)n <= sent - got);
		assert_true(n > 0 || sent == got);
		if ((uint32_t)n > nget)
			n = (int)nget;
		for (int i = 0; i < n; i++)
			assert_true(get(shm_ring_entry(cons, (uint32_t)i)) == got + (uint64_t)i);
		shm_ring_release(cons, (uint32_t)n);
		got += (uint64_t)n;
	}
	assert_true(sent > 100);
	assert_true(prod->local == (uint32_t)(start + sent));
	assert_true(atomic_load(&prod->ctl->tail) == (uint32_t)(start + sent));
	assert_true(atomic_load(&prod->ctl->head) == (uint32_t)(start + got));
	assert_false(shm_ring_broken(prod));
	assert_false(shm_ring_broken(cons));
	pair_close(&x);
}

static void test_ring_full_and_batches(void **state)
{
	struct pair x;
	struct shm_ring *prod, *cons;
	void *e[9];

	pair_open(&x, 8, 8, 0);
	prod = &x.kvd.cq;
	cons = &x.cli.cq;
	ring_start_at(prod, cons, UINT32_MAX - 3);

	/* Reserving advances; nothing shows until commit. */
	for (int i = 0; i < 8; i++) {
		e[i] = shm_ring_reserve(prod);
		assert_non_null(e[i]);
		put(e[i], (uint64_t)i);
		if (i)
			assert_true(e[i] != e[i - 1]);
	}
	assert_null(shm_ring_reserve(prod));
	assert_false(shm_ring_broken(prod));
	assert_int_equal(shm_ring_ready(cons), 0);
	shm_ring_commit(prod, 3);
	assert_int_equal(shm_ring_ready(cons), 3);
	shm_ring_commit(prod, 100);     /* cut to the 5 still reserved */
	assert_int_equal(prod->pending, 0);
	/* The cached count stands until it is consumed... */
	assert_int_equal(shm_ring_ready(cons), 3);
	shm_ring_release(cons, 3);
	/* ...then the tail is read again. */
	assert_int_equal(shm_ring_ready(cons), 5);
	assert_true(get(shm_ring_entry(cons, 0)) == 3);
	/* Space came back: 3 free, seen once the cached head says full. */
	for (int i = 0; i < 3; i++)
		assert_non_null(shm_ring_reserve(prod));
	assert_null(shm_ring_reserve(prod));
	shm_ring_commit(prod, 3);
	shm_ring_release(cons, 100);    /* cut to the 5 known ready */
	assert_int_equal(shm_ring_ready(cons), 3);
	shm_ring_release(cons, 3);
	assert_int_equal(shm_ring_ready(cons), 0);
	shm_ring_commit(prod, 1);       /* nothing reserved: no-op */
	assert_int_equal(shm_ring_ready(cons), 0);
	assert_false(shm_ring_broken(prod) || shm_ring_broken(cons));
	pair_close(&x);
}

static void test_ring_corrupt_peer_index(void **state)
{
	struct pair x;
	struct shm_ring *prod, *cons;
	uint32_t start = UINT32_MAX - 2;

	/* Consumer: a tail more than a ring ahead. */
	pair_open(&x, 8, 8, 0);
	prod = &x.cli.sq;
	cons = &x.kvd.sq;
	ring_start_at(prod, cons, start);
	atomic_store(&prod->ctl->tail, start + 8);
	assert_int_equal(shm_ring_ready(cons), 8);      /* a full ring is legal */
	shm_ring_release(cons, 8);
	atomic_store(&prod->ctl->tail, start + 8 + 9);
	assert_int_equal(shm_ring_ready(cons), -EPROTO);
	assert_true(shm_ring_broken(cons));
	atomic_store(&prod->ctl->tail, start + 8);     /* "healing" does not count */
	assert_int_equal(shm_ring_ready(cons), -EPROTO);
	assert_int_equal(shm_ring_wait(cons, 1000, 1000000, 0), -EPROTO);
	pair_close(&x);

	/* Consumer: a tail behind our head. */
	pair_open(&x, 8, 8, 0);
	ring_start_at(&x.kvd.cq, &x.cli.cq, start);
	atomic_store(&x.kvd.cq.ctl->tail, start - 1);
	assert_int_equal(shm_ring_ready(&x.cli.cq), -EPROTO);
	pair_close(&x);

	/* Producer: a head past our tail buys no space. */
	pair_open(&x, 8, 8, 0);
	prod = &x.kvd.cq;
	cons = &x.cli.cq;
	ring_start_at(prod, cons, start);
	for (int i = 0; i < 8; i++)
		assert_non_null(shm_ring_reserve(prod));
	shm_ring_commit(prod, 8);
	atomic_store(&prod->ctl->head, start + 8 + 1);
	assert_null(shm_ring_reserve(prod));
	assert_true(shm_ring_broken(prod));
	atomic_store(&prod->ctl->head, start + 8);
	assert_null(shm_ring_reserve(prod));
	pair_close(&x);

	/* Producer: a head more than a ring behind our tail. */
	pair_open(&x, 8, 8, 0);
	prod = &x.kvd.cq;
	ring_start_at(prod, &x.cli.cq, start);
	for (int i = 0; i < 8; i++)
		assert_non_null(shm_ring_reserve(prod));
	shm_ring_commit(prod, 8);
	atomic_store(&prod->ctl->head, start - 1);
	assert_null(shm_ring_reserve(prod));
	assert_true(shm_ring_broken(prod));
	pair_close(&x);
}

/* The observer's gauges across the wrap, with reserved entries, and clamped
 * (not trusted, not judged) when the peer's index is impossible. */
static void test_ring_gauges(void **state)
{
	struct pair x;
	struct shm_ring *prod, *cons;
	uint32_t start = UINT32_MAX - 2;

	pair_open(&x, 8, 8, 0);
	prod = &x.cli.sq;
	cons = &x.kvd.sq;
	ring_start_at(prod, cons, start);
	assert_int_equal(shm_ring_depth(cons), 0);
	assert_int_equal(shm_ring_room(prod), 8);
	for (int i = 0; i < 5; i++)
		assert_non_null(shm_ring_reserve(prod));
	assert_int_equal(shm_ring_room(prod), 3);
	assert_int_equal(shm_ring_depth(cons), 0);      /* reserved is not published */
	shm_ring_commit(prod, 5);
	assert_int_equal(shm_ring_depth(cons), 5);
	assert_int_equal(shm_ring_ready(cons), 5);
	shm_ring_release(cons, 2);
	assert_int_equal(shm_ring_depth(cons), 3);
	assert_int_equal(shm_ring_room(prod), 5);
	atomic_store(&prod->ctl->tail, start + 2 + 100);        /* a lie: clamped */
	assert_int_equal(shm_ring_depth(cons), 8);
	assert_false(shm_ring_broken(cons));
	atomic_store(&cons->ctl->head, start + 6);              /* past the tail: no room */
	assert_int_equal(shm_ring_room(prod), 0);
	assert_false(shm_ring_broken(prod));
	pair_close(&x);
}

/* ---- memfd ------------------------------------------------------------- */

static void test_memfd_sealed(void **state)
{
	struct shm_params p = { .entry_size = ESZ, .sq_entries = 16, .cq_entries = 16,
				.nslots = 2, .slot_size = 4096 };
	size_t size = shm_region_size(&p);
	struct shm_region kvd, cli;
	void *m = NULL, *m2;
	int fd, seals;

	assert_int_equal(shm_memfd_create("kvd-test", 0, &m), -EINVAL);
	fd = shm_memfd_create("kvd-test", size, &m);
	assert_true(fd >= 0);
	assert_non_null(m);
	seals = fcntl(fd, F_GET_SEALS);
	assert_true(seals >= 0);
	assert_int_equal(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
			 F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	assert_false(seals & F_SEAL_WRITE);
	assert_true(fcntl(fd, F_GETFD) & FD_CLOEXEC);
	assert_int_equal(ftruncate(fd, (off_t)size + 4096), -1);
	assert_int_equal(errno, EPERM);
	assert_int_equal(ftruncate(fd, 4096), -1);
	assert_int_equal(errno, EPERM);
	assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);

	/* A second mapping of the fd (what the client does) sees the region. */
	assert_int_equal(shm_region_create(&kvd, m, &p), 0);
	m2 = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(m2 != MAP_FAILED);
	assert_int_equal(shm_region_attach(&cli, m2, size), 0);
	put(shm_ring_reserve(&cli.sq), 42);
	shm_ring_commit(&cli.sq, 1);
	assert_int_equal(shm_ring_ready(&kvd.sq), 1);
	assert_true(get(shm_ring_entry(&kvd.sq, 0)) == 42);
	munmap(m2, size);
	munmap(m, size);
	close(fd);
}

/* ---- wait / wake ------------------------------------------------------- */

static void test_wait_times_out(void **state)
{
	struct pair x;
	uint64_t t0, dt;

	pair_open(&x, 8, 8, 0);
	t0 = now_ns();
	assert_int_equal(shm_ring_wait(&x.cli.cq, 20000, 30000000, 0), 0);
	dt = now_ns() - t0;
	assert_true(dt >= 30000000 && dt < 2000000000);
	assert_int_equal(atomic_load(&x.cli.cq.ctl->sleeping), 0);

	t0 = now_ns();
	assert_int_equal(shm_ring_wait(&x.cli.cq, 0, 10000000, 1), 0);
	dt = now_ns() - t0;
	assert_true(dt >= 10000000 && dt < 2000000000);

	/* No sleeper: waking is free and says so. */
	assert_int_equal(shm_ring_wake(&x.kvd.cq), 0);
	pair_close(&x);
}

struct waker {
	struct shm_ring *prod;
	unsigned delay_ms;
	int woke;                       /* shm_ring_wake()'s answer */
};

static void *waker_main(void *arg)
{
	struct waker *w = arg;

	sleep_ms(w->delay_ms);
	put(shm_ring_reserve(w->prod), 7);
	shm_ring_commit(w->prod, 1);
	w->woke = shm_ring_wake(w->prod);
	return NULL;
}

static void wait_for_waker(int polling)
{
	struct pair x;
	struct waker w;
	pthread_t th;
	uint64_t t0, dt;
	int n;

	pair_open(&x, 8, 8, 0);
	ring_start_at(&x.kvd.cq, &x.cli.cq, UINT32_MAX);
	w = (struct waker){ .prod = &x.kvd.cq, .delay_ms = 50 };
	t0 = now_ns();
	assert_int_equal(pthread_create(&th, NULL, waker_main, &w), 0);
	/* Spin 10 us, then sleep (or poll); 10 s is "never" here. */
	n = shm_ring_wait(&x.cli.cq, 10000, 10000000000ull, polling);
	dt = now_ns() - t0;
	pthread_join(th, NULL);
	assert_int_equal(n, 1);
	assert_true(get(shm_ring_entry(&x.cli.cq, 0)) == 7);
	assert_true(dt >= 50000000 && dt < 2000000000);
	/* Asleep after 50 ms unless polling: the futex path did the waking. */
	assert_int_equal(w.woke, !polling);
	assert_int_equal(atomic_load(&x.cli.cq.ctl->sleeping), 0);
	pair_close(&x);
}

static void test_wait_woken_by_futex(void **state)
{
	wait_for_waker(0);
}

static void test_wait_polling(void **state)
{
	wait_for_waker(1);
}

static void test_kick_flag(void **state)
{
	struct pair x;
	struct shm_ring *cons, *prod;

	pair_open(&x, 8, 8, 0);
	prod = &x.cli.sq;
	cons = &x.kvd.sq;
	assert_int_equal(shm_ring_needs_kick(prod), 0);
	shm_ring_set_sleeping(cons, 1);
	assert_int_equal(shm_ring_needs_kick(prod), 1);
	assert_int_equal(shm_ring_ready(cons), 0);
	put(shm_ring_reserve(prod), 1);
	shm_ring_commit(prod, 1);
	assert_int_equal(shm_ring_needs_kick(prod), 1);
	shm_ring_set_sleeping(cons, 0);
	assert_int_equal(shm_ring_needs_kick(prod), 0);
	assert_int_equal(shm_ring_ready(cons), 1);
	pair_close(&x);
}

static void on_usr1(int sig)
{
}

struct interrupter {
	pthread_t target;
	unsigned delay_ms;
};

static void *interrupter_main(void *arg)
{
	struct interrupter *it = arg;

	sleep_ms(it->delay_ms);
	pthread_kill(it->target, SIGUSR1);
	return NULL;
}

static void test_wait_interrupted(void **state)
{
	struct sigaction sa = { .sa_handler = on_usr1 }, old;   /* no SA_RESTART */
	struct interrupter it = { .target = pthread_self(), .delay_ms = 50 };
	struct pair x;
	pthread_t th;
	int n;

	sigemptyset(&sa.sa_mask);
	assert_int_equal(sigaction(SIGUSR1, &sa, &old), 0);
	pair_open(&x, 8, 8, 0);
	assert_int_equal(pthread_create(&th, NULL, interrupter_main, &it), 0);
	n = shm_ring_wait(&x.cli.cq, 0, 10000000000ull, 0);
	pthread_join(th, NULL);
	assert_int_equal(n, -EINTR);
	assert_int_equal(atomic_load(&x.cli.cq.ctl->sleeping), 0);
	sigaction(SIGUSR1, &old, NULL);
	pair_close(&x);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_region_size),
		cmocka_unit_test(test_create_attach_round_trip),
		cmocka_unit_test(test_attach_rejects_corruption),
		cmocka_unit_test(test_ring_fifo_wraps),
		cmocka_unit_test(test_ring_full_and_batches),
		cmocka_unit_test(test_ring_corrupt_peer_index),
		cmocka_unit_test(test_ring_gauges),
		cmocka_unit_test(test_memfd_sealed),
		cmocka_unit_test(test_wait_times_out),
		cmocka_unit_test(test_wait_woken_by_futex),
		cmocka_unit_test(test_wait_polling),
		cmocka_unit_test(test_kick_flag),
		cmocka_unit_test(test_wait_interrupted),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
