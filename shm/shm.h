/* shm: one client's shared-memory region — a versioned header, a submission
 * ring, a completion ring and an arena of fixed-size payload slots — with
 * spin-then-sleep wake-ups.  Nothing here knows about attention: ring
 * entries are opaque fixed-size records.
 *
 * Region layout (all offsets from the start of the mapping, 4096-aligned
 * parts, every field little-endian):
 *
 *   struct shm_hdr            magic, ABI version, sizes: written once by the
 *                             creator (kvd) before the memfd is sealed and
 *                             handed over; checked by shm_region_attach()
 *   SQ: struct shm_ring_ctl + sq_entries * entry_size
 *   CQ: struct shm_ring_ctl + cq_entries * entry_size
 *   slots: nslots * slot_size
 *
 * Who writes what: the client controls the SQ tail and the CQ head; kvd
 * controls the SQ head and the CQ tail.  Each index lives on its own
 * 128-byte block.  Indices are free-running u32, masked on access.
 * Process-local cursors (the cached peer index, the mask, the pointers) live
 * in struct shm_ring, outside the mapping, so a peer can neither see nor
 * corrupt them.  Everything the peer writes is untrusted: shm_ring_peek()
 * reports a peer index that claims more entries than the ring holds as
 * -EPROTO, and callers copy an entry out before checking it.
 *
 * Wake-ups: the consumer of a ring spins, then raises the ring's `sleeping`
 * word and sleeps; the producer, after publishing, issues a full fence and
 * wakes the sleeper if that word is set.  For the SQ (many clients, one kvd
 * dispatcher) the wake-up is an eventfd the client writes; for the CQ it is
 * a futex on the ring's `wake` word (shared, not _PRIVATE: two processes).
 * A client that asks for pure polling never sleeps, and kvd never needs to
 * wake it.
 */
#ifndef SHM_SHM_H
#define SHM_SHM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define SHM_MAGIC       0x4b56445348u   /* "HSDVK": kvd shared memory */
#define SHM_ABI_VERSION 1u
#define SHM_BLOCK       128             /* index isolation: two cache lines */

struct shm_hdr {
	uint64_t magic;
	uint32_t abi_version;
	uint32_t hdr_size;              /* sizeof(struct shm_hdr) of the creator */
	uint64_t region_size;
	uint32_t entry_size;            /* bytes per ring entry, both rings */
	uint32_t sq_entries, cq_entries;/* powers of two */
	uint32_t nslots;
	uint64_t slot_size;             /* multiple of 4096 */
	uint64_t sq_off, cq_off, slots_off;
	uint32_t flags;                 /* SHM_F_* chosen at attach */
	uint32_t _reserved[9];
};

#define SHM_F_POLL 1u                   /* the client never sleeps on its CQ */

struct shm_ring_ctl {
	_Alignas(SHM_BLOCK) _Atomic uint32_t tail;     /* producer's */
	_Alignas(SHM_BLOCK) _Atomic uint32_t head;     /* consumer's */
	/* Consumer's: 1 while it sleeps or is about to. */
	_Alignas(SHM_BLOCK) _Atomic uint32_t sleeping;
	/* Futex word: the producer bumps it before a FUTEX_WAKE. */
	_Atomic uint32_t wake;
	_Alignas(SHM_BLOCK) char entries[];
};

/* Process-local view of one ring. */
struct shm_ring {
	struct shm_ring_ctl *ctl;
	char *entries;
	uint32_t mask, esize;
	uint32_t local;                 /* our own index (tail or head), authoritative */
	uint32_t peer;                  /* cached copy of the peer's index */
	uint32_t pending;               /* producer: reserved, not yet committed */
	int broken;                     /* the peer's index was impossible: sticky */
};

/* Process-local view of a region. */
struct shm_region {
	void *base;
	size_t size;
	const struct shm_hdr *hdr;      /* points into the mapping; copy before trusting */
	struct shm_hdr geo;             /* the validated copy */
	struct shm_ring sq, cq;         /* initialised for the side that calls */
	char *slots;
};

struct shm_params {
	uint32_t entry_size, sq_entries, cq_entries, nslots;
	uint64_t slot_size;
	uint32_t flags;
};

/* Size of the region for these parameters, or 0 if they are invalid
 * (entries not powers of two or above 2^30, entry_size not a multiple of 8
 * or > 4096, slot_size not a multiple of 4096, unknown flags, overflow). */
size_t shm_region_size(const struct shm_params *p);

/* kvd's side: lays out a fresh region in mem (shm_region_size() bytes,
 * zeroed, page-aligned) and fills in r as the SQ consumer / CQ producer. */
int shm_region_create(struct shm_region *r, void *mem, const struct shm_params *p);

/* The client's side: checks the header of a mapping of `size` bytes (magic,
 * version, sizes, offsets all inside the mapping) and fills in r as the SQ
 * producer / CQ consumer.  -EPROTO on a mismatch, with nothing touched. */
int shm_region_attach(struct shm_region *r, void *mem, size_t size);

/* Creates a sealed memfd of `size` bytes (F_SEAL_SHRINK | F_SEAL_GROW |
 * F_SEAL_SEAL) and maps it.  Returns the fd, or -errno. */
int shm_memfd_create(const char *name, size_t size, void **map);

/* Pointer to slot i, or NULL when i is out of range. */
static inline void *shm_slot(const struct shm_region *r, uint32_t i)
{
	return i < r->geo.nslots ? r->slots + (size_t)i * r->geo.slot_size : NULL;
}

/* Producer: space for one more entry (each call reserves the next one), or
 * NULL when the ring is full or broken.  The consumer's index is re-read only
 * when the cached copy says full. */
void *shm_ring_reserve(struct shm_ring *r);
/* Producer: takes back the newest reserved, uncommitted entry (a reservation
 * that turned out not to be needed); nothing reaches the consumer. */
static inline void shm_ring_unreserve(struct shm_ring *r)
{
	if (r->pending)
		r->pending--;
}
/* Producer: publishes the n oldest reserved entries (release store of tail);
 * n above the number reserved is cut to it. */
void shm_ring_commit(struct shm_ring *r, uint32_t n);
/* 1 once the peer's index claimed the impossible (a head past our tail, a
 * tail more than a ring ahead of our head): from then on reserve returns
 * NULL and ready -EPROTO.  Tells a broken ring from a full one. */
static inline int shm_ring_broken(const struct shm_ring *r)
{
	return r->broken;
}

/* Consumer: number of entries ready (>= 0), or -EPROTO when the peer's
 * index claims more than the ring holds (a corrupted or hostile peer).  The
 * tail is re-read only once the cached count is released: it may trail. */
int shm_ring_ready(struct shm_ring *r);
/* Consumer: the i-th ready entry (i < shm_ring_ready()).  It lives in shared
 * memory: copy it before checking it. */
static inline const void *shm_ring_entry(const struct shm_ring *r, uint32_t i)
{
	return r->entries + (size_t)((r->local + i) & r->mask) * r->esize;
}
/* Consumer: gives back n entries (release store of head). */
void shm_ring_release(struct shm_ring *r, uint32_t n);

/* Gauges for an observer beside the owner of r (kvd's metrics): the peer's
 * index read afresh, nothing cached or changed, a peer's impossible index
 * only clamped (the owner's shm_ring_ready() and shm_ring_reserve() are
 * what judge it).  Consumer: entries published and not yet released, at
 * most the ring's size.  Producer: entries free for shm_ring_reserve()
 * (reserved ones count as used), 0 when the peer's head is impossible. */
uint32_t shm_ring_depth(const struct shm_ring *r);
uint32_t shm_ring_room(const struct shm_ring *r);

/* Wake-ups.  The consumer's wait: spins `spin_ns`, then sleeps on the ring's
 * futex (with poll: keeps spinning) until an entry is ready, `timeout_ns`
 * passes (0 = forever) or a signal arrives.  Returns entries ready, 0 on
 * timeout or -EINTR, -EPROTO as shm_ring_ready(). */
int shm_ring_wait(struct shm_ring *r, uint64_t spin_ns, uint64_t timeout_ns, int poll);
/* The producer, after shm_ring_commit(): wakes a sleeping consumer through
 * the futex.  Returns 1 if it had to wake it. */
int shm_ring_wake(struct shm_ring *r);
/* The producer's check for the eventfd variant: 1 if the consumer sleeps
 * (or is about to) and must be kicked by other means. */
int shm_ring_needs_kick(struct shm_ring *r);
/* The consumer's side of the eventfd variant: announce sleep (1) or wake (0).
 * After announcing, re-check shm_ring_ready() before sleeping. */
void shm_ring_set_sleeping(struct shm_ring *r, int sleeping);

#endif
