/* shm: region layout, validation at attach, the SPSC rings and their
 * wake-ups.  See shm.h for who writes what.
 *
 * Memory-order pairs (each ordering access below carries its label; the
 * relaxed ones say why they may be):
 *
 *   R0 / A0   producer's release store of tail / consumer's acquire load of
 *             tail: the entries written before R0 are visible after A0.
 *   R1 / A1   consumer's release store of head / producer's acquire load of
 *             head: the consumer's reads of a slot finish before the
 *             producer overwrites it.
 *   R2 / A2   producer's release bump of wake / consumer's acquire load of
 *             wake (see the wake-up comment at ring_sleep()).
 *   F0 / F1   seq_cst fences: consumer between "sleeping = 1" and its last
 *             look at tail; producer between its store of tail and its look
 *             at sleeping.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "engine/clock.h"
#include "engine/invariant.h"
#include "shm.h"

#define PAGE            4096u
#define SHM_MAX_ENTRIES (1u << 30)      /* shm_ring_ready() returns an int */

/* The layout is ABI: pin every offset. */
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian layout");
static_assert(sizeof(_Atomic uint32_t) == 4 && ATOMIC_INT_LOCK_FREE == 2,
	      "lock-free 32-bit atomics: they are shared between processes");
static_assert(sizeof(struct shm_hdr) == 112, "shm_hdr size");
static_assert(offsetof(struct shm_hdr, magic) == 0, "hdr.magic");
static_assert(offsetof(struct shm_hdr, abi_version) == 8, "hdr.abi_version");
static_assert(offsetof(struct shm_hdr, hdr_size) == 12, "hdr.hdr_size");
static_assert(offsetof(struct shm_hdr, region_size) == 16, "hdr.region_size");
static_assert(offsetof(struct shm_hdr, entry_size) == 24, "hdr.entry_size");
static_assert(offsetof(struct shm_hdr, sq_entries) == 28, "hdr.sq_entries");
static_assert(offsetof(struct shm_hdr, cq_entries) == 32, "hdr.cq_entries");
static_assert(offsetof(struct shm_hdr, nslots) == 36, "hdr.nslots");
static_assert(offsetof(struct shm_hdr, slot_size) == 40, "hdr.slot_size");
static_assert(offsetof(struct shm_hdr, sq_off) == 48, "hdr.sq_off");
static_assert(offsetof(struct shm_hdr, cq_off) == 56, "hdr.cq_off");
static_assert(offsetof(struct shm_hdr, slots_off) == 64, "hdr.slots_off");
static_assert(offsetof(struct shm_hdr, flags) == 72, "hdr.flags");
static_assert(offsetof(struct shm_hdr, _reserved) == 76, "hdr._reserved");

/* tail, head and the sleep words each on their own 128-byte block (two cache
 * lines: the adjacent-line prefetcher pulls pairs).  sleeping and wake share
 * the third: both are touched only on the way to and out of sleep. */
static_assert(offsetof(struct shm_ring_ctl, tail) == 0 * SHM_BLOCK, "ctl.tail");
static_assert(offsetof(struct shm_ring_ctl, head) == 1 * SHM_BLOCK, "ctl.head");
static_assert(offsetof(struct shm_ring_ctl, sleeping) == 2 * SHM_BLOCK, "ctl.sleeping");
static_assert(offsetof(struct shm_ring_ctl, wake) / SHM_BLOCK == 2, "ctl.wake");
static_assert(offsetof(struct shm_ring_ctl, entries) == 3 * SHM_BLOCK, "ctl.entries");
static_assert(offsetof(struct shm_ring_ctl, entries) % SHM_BLOCK == 0, "entries aligned");
static_assert(sizeof(struct shm_ring_ctl) == 3 * SHM_BLOCK, "ctl size");
static_assert(sizeof(struct shm_hdr) <= PAGE, "header fits its page");

/* gcc >= 11 warns under -fsanitize=thread that TSan does not model fences
 * (the warning comes after inlining: only a file-wide pragma silences it).
 * The fence is still emitted, and no plain data relies on it (the entries
 * are ordered by R0/A0 and R1/A1, which TSan does see): F0/F1 only decide
 * who sees `sleeping`, among atomics. */
#if defined(__SANITIZE_THREAD__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic ignored "-Wtsan"
#endif
#define FULL_FENCE() atomic_thread_fence(memory_order_seq_cst)

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ volatile("yield" ::: "memory");
#endif
}

static int is_pow2(uint64_t x)
{
	return x && !(x & (x - 1));
}

static uint64_t page_up(uint64_t x)
{
	return (x + PAGE - 1) & ~(uint64_t)(PAGE - 1);
}

/* ---- layout ------------------------------------------------------------ */

static int ring_params_ok(uint32_t esize, uint32_t entries)
{
	return esize && esize % 8 == 0 && esize <= 4096 &&
	       is_pow2(entries) && entries <= SHM_MAX_ENTRIES;
}

/* The checks shared by create (params) and attach (a header copy); the
 * slots' total size in *slots_len. */
static int geo_ok(uint32_t esize, uint32_t sq, uint32_t cq, uint32_t nslots,
		  uint64_t slot_size, uint32_t flags, uint64_t *slots_len)
{
	return ring_params_ok(esize, sq) && ring_params_ok(esize, cq) &&
	       slot_size % PAGE == 0 && (slot_size || !nslots) &&
	       !(flags & ~SHM_F_POLL) &&
	       !__builtin_mul_overflow((uint64_t)nslots, slot_size, slots_len);
}

/* Bytes of one ring part: control blocks and entries.  Cannot overflow:
 * 2^30 entries of 4096 bytes is 2^42. */
static uint64_t ring_bytes(uint32_t esize, uint32_t entries)
{
	return sizeof(struct shm_ring_ctl) + (uint64_t)entries * esize;
}

/* Fills in the geometry of a fresh region; 0 if p is invalid. */
static int layout(const struct shm_params *p, struct shm_hdr *h)
{
	uint64_t slots_len, end;

	if (!p || !geo_ok(p->entry_size, p->sq_entries, p->cq_entries, p->nslots,
			  p->slot_size, p->flags, &slots_len))
		return 0;
	memset(h, 0, sizeof *h);
	h->magic = SHM_MAGIC;
	h->abi_version = SHM_ABI_VERSION;
	h->hdr_size = sizeof *h;
	h->entry_size = p->entry_size;
	h->sq_entries = p->sq_entries;
	h->cq_entries = p->cq_entries;
	h->nslots = p->nslots;
	h->slot_size = p->slot_size;
	h->flags = p->flags;
	h->sq_off = PAGE;
	h->cq_off = h->sq_off + page_up(ring_bytes(p->entry_size, p->sq_entries));
	h->slots_off = h->cq_off + page_up(ring_bytes(p->entry_size, p->cq_entries));
	if (__builtin_add_overflow(h->slots_off, slots_len, &end) || end > SIZE_MAX)
		return 0;
	h->region_size = end;
	return 1;
}

size_t shm_region_size(const struct shm_params *p)
{
	struct shm_hdr h;

	return layout(p, &h) ? (size_t)h.region_size : 0;
}

/* [off, off + len) starts at or after `*pos`, page-aligned, without
 * overflow; advances *pos past it. */
static int part_ok(uint64_t off, uint64_t len, uint64_t *pos)
{
	uint64_t end;

	if (off % PAGE || off < *pos || __builtin_add_overflow(off, len, &end))
		return 0;
	*pos = end;
	return 1;
}

/* Checks a header copy against a mapping of `size` bytes.  The creator may be
 * hostile too: nothing is derived from h before these checks pass. */
static int hdr_ok(const struct shm_hdr *h, size_t size)
{
	uint64_t pos = sizeof *h, slots_len;

	if (h->magic != SHM_MAGIC || h->abi_version != SHM_ABI_VERSION ||
	    h->hdr_size != sizeof *h || h->region_size != size)
		return 0;
	if (!geo_ok(h->entry_size, h->sq_entries, h->cq_entries, h->nslots,
		    h->slot_size, h->flags, &slots_len))
		return 0;
	/* In order, disjoint, inside the mapping. */
	return part_ok(h->sq_off, ring_bytes(h->entry_size, h->sq_entries), &pos) &&
	       part_ok(h->cq_off, ring_bytes(h->entry_size, h->cq_entries), &pos) &&
	       part_ok(h->slots_off, slots_len, &pos) &&
	       pos <= size;
}

static void ring_init(struct shm_ring *r, char *base, uint64_t off,
		      uint32_t entries, uint32_t esize)
{
	r->ctl = (struct shm_ring_ctl *)(base + off);
	r->entries = r->ctl->entries;
	r->mask = entries - 1;
	r->esize = esize;
	r->local = 0;
	r->peer = 0;
	r->pending = 0;
	/* Only a geometry layout() or hdr_ok() passed gets here, and the
	 * index masking is right only for a power of two: anything else
	 * would reach outside the entries, so such a ring reads as broken. */
	r->broken = NEVER(!is_pow2(entries) || !esize);
}

static void region_init(struct shm_region *r, void *mem, const struct shm_hdr *h)
{
	char *base = mem;

	memset(r, 0, sizeof *r);
	r->base = mem;
	r->size = (size_t)h->region_size;
	r->hdr = mem;
	r->geo = *h;
	ring_init(&r->sq, base, h->sq_off, h->sq_entries, h->entry_size);
	ring_init(&r->cq, base, h->cq_off, h->cq_entries, h->entry_size);
	r->slots = base + h->slots_off;
}

int shm_region_create(struct shm_region *r, void *mem, const struct shm_params *p)
{
	struct shm_hdr h;
	struct shm_ring_ctl *c[2];

	if (!r || !mem || (uintptr_t)mem % PAGE || !layout(p, &h))
		return -EINVAL;
	memcpy(mem, &h, sizeof h);
	region_init(r, mem, &h);
	/* The contract says zeroed; the indices must be, whatever the caller
	 * did.  Nobody else sees the memory yet: relaxed. */
	c[0] = r->sq.ctl;
	c[1] = r->cq.ctl;
	for (int i = 0; i < 2; i++) {
		atomic_store_explicit(&c[i]->tail, 0, memory_order_relaxed);
		atomic_store_explicit(&c[i]->head, 0, memory_order_relaxed);
		atomic_store_explicit(&c[i]->sleeping, 0, memory_order_relaxed);
		atomic_store_explicit(&c[i]->wake, 0, memory_order_relaxed);
	}
	return 0;
}

int shm_region_attach(struct shm_region *r, void *mem, size_t size)
{
	struct shm_hdr h;
	struct shm_region tmp;

	if (!r || !mem || (uintptr_t)mem % PAGE)
		return -EINVAL;
	if (size < sizeof h)
		return -EPROTO;
	/* One copy, then only the copy: the creator could rewrite the header
	 * between a check and a use. */
	memcpy(&h, mem, sizeof h);
	if (!hdr_ok(&h, size))
		return -EPROTO;
	region_init(&tmp, mem, &h);
	*r = tmp;
	return 0;
}

int shm_memfd_create(const char *name, size_t size, void **map)
{
	void *m;
	int fd, err;

	if (!name || !size || !map || size > (size_t)INT64_MAX)
		return -EINVAL;
	fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)size) < 0)
		goto fail;
	m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED)
		goto fail;
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		err = -errno;
		munmap(m, size);
		close(fd);
		return err;
	}
	*map = m;
	return fd;
fail:
	err = -errno;
	close(fd);
	return err;
}

/* ---- rings ------------------------------------------------------------- */

void *shm_ring_reserve(struct shm_ring *r)
{
	uint32_t size = r->mask + 1, next = r->local + r->pending;

	if (r->broken)
		return NULL;
	if (next - r->peer >= size) {
		/* A1: pairs with R1. */
		uint32_t head = atomic_load_explicit(&r->ctl->head, memory_order_acquire);

		/* A head past our published tail (or more than a ring
		 * behind it) is a lie: never let it buy us space. */
		if (r->local - head > size) {
			r->broken = 1;
			return NULL;
		}
		r->peer = head;
		if (next - head >= size)
			return NULL;
	}
	r->pending++;
	return r->entries + (size_t)(next & r->mask) * r->esize;
}

void shm_ring_commit(struct shm_ring *r, uint32_t n)
{
	if (n > r->pending)
		n = r->pending;
	if (!n)
		return;
	r->local += n;
	r->pending -= n;
	/* reserve() handed out only what fits before the consumer's head
	 * as last read: what is published stays within one ring of it. */
	(void)ALWAYS(r->local - r->peer <= r->mask + 1);
	/* R0: pairs with A0. */
	atomic_store_explicit(&r->ctl->tail, r->local, memory_order_release);
}

int shm_ring_ready(struct shm_ring *r)
{
	uint32_t n = r->peer - r->local, tail;

	if (r->broken)
		return -EPROTO;
	/* peer is process-local and was checked against the ring's size when
	 * read; release() never passes it.  A larger count would hand out
	 * entries the producer has not written (or is rewriting). */
	if (NEVER(n > r->mask + 1)) {
		r->broken = 1;
		return -EPROTO;
	}
	if (n)
		return (int)n;
	/* A0: pairs with R0. */
	tail = atomic_load_explicit(&r->ctl->tail, memory_order_acquire);
	n = tail - r->local;
	if (n > r->mask + 1) {
		r->broken = 1;
		return -EPROTO;
	}
	r->peer = tail;
	return (int)n;
}

void shm_ring_release(struct shm_ring *r, uint32_t n)
{
	uint32_t avail = r->peer - r->local;

	if (n > avail)
		n = avail;
	if (!n)
		return;
	r->local += n;
	/* The consumer never passes the tail it read (checked then against
	 * the ring's size), so a release can hand no entry back twice. */
	(void)ALWAYS(r->peer - r->local <= r->mask + 1);
	/* R1: pairs with A1. */
	atomic_store_explicit(&r->ctl->head, r->local, memory_order_release);
}

uint32_t shm_ring_depth(const struct shm_ring *r)
{
	uint32_t n = atomic_load_explicit(&r->ctl->tail, memory_order_acquire) - r->local;

	return n > r->mask + 1 ? r->mask + 1 : n;
}

uint32_t shm_ring_room(const struct shm_ring *r)
{
	uint32_t used = r->local + r->pending -
			atomic_load_explicit(&r->ctl->head, memory_order_acquire);

	return used > r->mask + 1 ? 0 : r->mask + 1 - used;
}

/* ---- wake-ups ---------------------------------------------------------- */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
	/* Not FUTEX_PRIVATE_FLAG: the word is in a MAP_SHARED memfd and the
	 * other side is another process. */
	return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Why no wake-up is lost.  Consumer: S "sleeping = 1"; F0; W "w = wake"; T
 * "look at tail"; if empty, FUTEX_WAIT(wake, w).  Producer: P "store tail";
 * F1; L "look at sleeping"; if set, B "wake++", FUTEX_WAKE.  Dekker: F0 and
 * F1 are ordered one way or the other, so T sees P or L sees S — never
 * neither.  If T saw P, the consumer does not sleep.  Otherwise L saw S and
 * B happens; W cannot have read B (B is a release after P, W an acquire
 * before T: W reading B would make T see P), so w is stale, and the kernel
 * compares the word and queues the waiter atomically with respect to
 * FUTEX_WAKE: FUTEX_WAIT either fails with EAGAIN or is woken.  Reading w
 * before T (not after) is what makes B visible as a changed word. */
static int ring_sleep(struct shm_ring *r, uint64_t deadline)
{
	struct shm_ring_ctl *c = r->ctl;
	struct timespec ts;
	uint64_t now, left;
	uint32_t w;
	int n;

	for (;;) {
		atomic_store_explicit(&c->sleeping, 1, memory_order_relaxed);
		/* F0: pairs with F1 (shm_ring_wake, shm_ring_needs_kick). */
		FULL_FENCE();
		/* A2: pairs with R2. */
		w = atomic_load_explicit(&c->wake, memory_order_acquire);
		n = shm_ring_ready(r);
		if (n)
			break;
		now = kvd_now_ns();
		if (now >= deadline)
			break;
		left = deadline - now;
		ts.tv_sec = (time_t)(left / 1000000000u);
		ts.tv_nsec = (long)(left % 1000000000u);
		if (futex(&c->wake, FUTEX_WAIT, w, deadline == UINT64_MAX ? NULL : &ts) < 0 &&
		    errno == EINTR) {
			n = -EINTR;
			break;
		}
		/* Woken, EAGAIN (wake moved), ETIMEDOUT: look again. */
	}
	/* A stale 1 seen by the producer costs it one needless FUTEX_WAKE. */
	atomic_store_explicit(&c->sleeping, 0, memory_order_relaxed);
	return n;
}

int shm_ring_wait(struct shm_ring *r, uint64_t spin_ns, uint64_t timeout_ns, int poll)
{
	uint64_t start = kvd_now_ns(), deadline, spin_end;
	int n;

	if (!timeout_ns || __builtin_add_overflow(start, timeout_ns, &deadline))
		deadline = UINT64_MAX;
	if (poll || __builtin_add_overflow(start, spin_ns, &spin_end) || spin_end > deadline)
		spin_end = deadline;
	/* Reading the clock costs more than a look at the ring: every 64th
	 * turn only, and on the first so that spin_ns == 0 means no spin. */
	for (unsigned i = 0;; i++) {
		n = shm_ring_ready(r);
		if (n)
			return n;
		if (!(i % 64) && kvd_now_ns() >= spin_end)
			break;
		cpu_relax();
	}
	if (poll)
		return 0;
	return ring_sleep(r, deadline);
}

int shm_ring_wake(struct shm_ring *r)
{
	struct shm_ring_ctl *c = r->ctl;

	/* F1: pairs with F0 (ring_sleep, shm_ring_set_sleeping): our tail
	 * store is ordered before this look at sleeping. */
	FULL_FENCE();
	if (!atomic_load_explicit(&c->sleeping, memory_order_relaxed))
		return 0;
	/* R2: pairs with A2. */
	atomic_fetch_add_explicit(&c->wake, 1, memory_order_release);
	futex(&c->wake, FUTEX_WAKE, 1, NULL);
	return 1;
}

int shm_ring_needs_kick(struct shm_ring *r)
{
	/* F1: pairs with F0 in shm_ring_set_sleeping(), as in shm_ring_wake(). */
	FULL_FENCE();
	return atomic_load_explicit(&r->ctl->sleeping, memory_order_relaxed) != 0;
}

void shm_ring_set_sleeping(struct shm_ring *r, int sleeping)
{
	atomic_store_explicit(&r->ctl->sleeping, sleeping ? 1 : 0, memory_order_relaxed);
	/* F0: pairs with F1 in shm_ring_needs_kick(): the caller's next
	 * shm_ring_ready() looks at tail only after the flag is visible.  No
	 * fence to clear it: a stale 1 only costs the producer a kick. */
	if (sleeping)
		FULL_FENCE();
}
