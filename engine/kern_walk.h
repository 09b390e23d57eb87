/* kern_walk.h: the order in which the SIMD kernels visit rows, shared by
 * kern_avx2.c and kern_avx512.c (plain C; each file includes it once and
 * adds its own prefetch of a chunk, whose width is its vector width). */
#ifndef KVD_KERN_WALK_H
#define KVD_KERN_WALK_H

#include <stddef.h>
#include <stdint.h>

/*
 * qk and pv visit rows in tiles of 16 slots: 4 runs of up to 4 rows at
 * consecutive positions (slot 4j+k is position pos[j]+k).  Gathered rows go
 * in order, a tile covering positions i0 .. i0+15.  The contiguous rows of a
 * long call are cut into 4 streams walked side by side, one run from each
 * per tile, so that the L2 streamer keeps 4 streams of prefetches in flight:
 * one stream cannot cover memory latency while the FMAs run (2 threads of
 * qk+pv at G=4, d=128 on Sapphire Rapids: 78% of a plain streaming read with
 * one stream, 93-97% with four).
 *
 * Every row is also prefetched in software, a fixed number of tiles ahead,
 * one 64-byte line alongside each chunk of the current row (prefetch_chunk):
 * gathered rows are random reads no hardware prefetcher predicts, and spread
 * out like this fewer prefetches find the L1 fill buffers full than when a
 * whole row is prefetched at once (gathered qk: 5.8 -> 7 GB/s on one core).
 * The variants prefetch into L2 (T1), two tiles ahead: with T0 the L1 miss
 * buffers fill and gathers stall at ~15 ns a row whatever the distance (Zen
 * 4, bf16 qk+pv of 8000 gathered rows at G=4: 617 -> ~370 us; a 98k-token
 * layer, cold: sampled 4.4-5.3 -> 3.9-4.0 ms, dense 22-30 -> 16-19 ms).
 */
#define NRUN 4
#define TILE 16
#define STREAM_MIN 256  /* contiguous calls at least this long use 4 streams */
#define PF_GATHER 32    /* rows ahead to prefetch: two tiles */
#define PF_STREAM 8     /* rows ahead in each stream: two tiles */

struct walk {
	const uint16_t *base;
	const uint32_t *idx;
	size_t m;
	size_t part;            /* rows per stream (a multiple of 4), or 0: in order */
	size_t ntiles;
	size_t pfd;             /* rows ahead to prefetch */
	int d;
	int odd;                /* rows may straddle one more line than d/32 */
};

struct tile {
	size_t pos[NRUN], end[NRUN];    /* end: of the stream, for prefetching */
	int cnt[NRUN];
};

static void walk_init(struct walk *w, const uint16_t *base, const uint32_t *idx, size_t m, int d)
{
	w->base = base;
	w->idx = idx;
	w->m = m;
	w->d = d;
	w->part = !idx && m >= STREAM_MIN ? ((m + 15) / 16) * 4 : 0;
	w->ntiles = w->part ? w->part / 4 : (m + TILE - 1) / TILE;
	w->pfd = w->part ? PF_STREAM : PF_GATHER;
	w->odd = (((uintptr_t)base | 2 * (size_t)d) & 63) != 0;
}

/* Run 0 of a tile is never empty: its first row stands in for the missing
 * rows of the others (qk drops their results, pv skips them). */
static inline void tile_at(const struct walk *w, size_t t, struct tile *tl)
{
	for (int j = 0; j < NRUN; j++) {
		size_t p = w->part ? j * w->part + 4 * t : TILE * t + 4 * j;
		size_t e = w->part && (j + 1) * w->part < w->m ? (j + 1) * w->part : w->m;

		tl->pos[j] = p;
		tl->end[j] = e;
		tl->cnt[j] = p >= e ? 0 : e - p < 4 ? (int)(e - p) : 4;
	}
}

static inline const uint16_t *walk_ptr(const struct walk *w, size_t p)
{
	return w->base + (w->idx ? (size_t)w->idx[p] : p) * (size_t)w->d;
}

/* Slot k of run j: its row, or run 0's first row past the run's end. */
static inline const uint16_t *slot_row(const struct walk *w, const struct tile *tl, int j, int k)
{
	return walk_ptr(w, k < tl->cnt[j] ? tl->pos[j] + k : tl->pos[0]);
}

/* The row to prefetch while slot k of run j is used (the stream's last row
 * near its end: prefetching it again costs next to nothing). */
static inline const uint16_t *slot_pf(const struct walk *w, const struct tile *tl, int j, int k)
{
	size_t p = tl->pos[j] + k + w->pfd;

	return walk_ptr(w, p < tl->end[j] ? p : tl->end[j] - 1);
}

/* qk8's side record of gathered row i (kern.h), into L2 (T1, as the rows
 * are), both ends: a record may straddle two lines. */
static inline void side_prefetch(const void *side, size_t sz, const uint32_t *idx, size_t i,
				 size_t m)
{
	if (side && i < m) {
		const char *p = (const char *)side + (size_t)idx[i] * sz;

		__builtin_prefetch(p, 0, 2);
		__builtin_prefetch(p + sz - 1, 0, 2);
	}
}

#endif
