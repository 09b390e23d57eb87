/* SimHash tables and retrieval: see lsh.h for the conventions. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kern.h"
#include "lsh.h"
#include "rng.h"

void kvd_lsh_make_w(uint64_t seed, int d, int K, int L, float *W)
{
	size_t m = d > 0 && K > 0 && L > 0 ? (size_t)d * K * L : 0;

	for (size_t e = 0; e < m; e++)
		W[e] = (float)kvd_rng_normal_at(seed, e);
}

void kvd_lsh_hash(const float *W, int d, int K, int L,
		  const float *x, size_t ldx, size_t n, uint16_t *codes, size_t ldc)
{
	kvd_kern_get()->hash(W, d, K, L, x, ldx, n, codes, ldc);
}

/* ---- tables ------------------------------------------------------------ */

static int geom_ok(uint32_t n, int K, int L)
{
	return n >= 1 && n <= KVD_SEG_MAX && K >= 1 && K <= KVD_LSH_KMAX &&
	       L >= 1 && L <= KVD_LSH_LMAX;
}

static size_t align64(size_t x)
{
	return (x + 63) & ~(size_t)63;
}

static size_t off_bytes(int K, int L)
{
	return align64((size_t)L * ((1u << K) + 1) * sizeof(uint16_t));
}

static size_t ids_bytes(uint32_t n, int L)
{
	return align64((size_t)L * n * sizeof(uint16_t));
}

size_t kvd_lsh_tables_bytes(uint32_t n, int K, int L)
{
	if (!geom_ok(n, K, L))
		return 0;
	return off_bytes(K, L) + ids_bytes(n, L) + align64((size_t)L * sizeof(uint32_t));
}

/*
 * The build is a counting sort per table, and nearly all of its time goes to
 * two loops over the n codes: the histogram and the placement.  Both are
 * chains through memory (load a counter, store it back plus one), so with
 * skewed codes -- a few hot buckets, which real keys produce -- consecutive
 * tokens wait on each other's store-to-load forwarding.  Counting table t+1
 * inside table t's placement loop gives the core two independent chains,
 * which measured 1.5-2x faster on hot-bucket codes than the two loops apart
 * (interleaving two *placements* instead is worse: the scattered writes of
 * two tables no longer fit in L1).
 *
 * Counters live in the output itself: table t's off[b+1] first counts bucket
 * b, the prefix pass turns it into the start of b, and the placement bumps it
 * to the end of b, which is the start of b+1 -- the finished CSR offsets.
 * All of it is uint16 arithmetic, so a segment of exactly 65536 tokens wraps
 * the same way the stored offsets do.
 */

static inline void count_one(uint16_t *restrict h, uint16_t code, uint32_t mask)
{
	h[code & mask]++;
}

static void count(uint16_t *restrict h, const uint16_t *restrict c, uint32_t n, uint32_t mask)
{
	uint32_t i = 0;

	for (; i + 4 <= n; i += 4) {
		count_one(h, c[i], mask);
		count_one(h, c[i + 1], mask);
		count_one(h, c[i + 2], mask);
		count_one(h, c[i + 3], mask);
	}
	for (; i < n; i++)
		count_one(h, c[i], mask);
}

static inline void place_one(uint16_t *restrict cur, uint16_t *restrict ids, uint16_t code,
			     uint32_t mask, uint32_t i)
{
	ids[cur[code & mask]++] = (uint16_t)i;
}

static void place(uint16_t *restrict cur, uint16_t *restrict ids, const uint16_t *restrict c,
		  uint32_t n, uint32_t mask)
{
	uint32_t i = 0;

	for (; i + 4 <= n; i += 4) {
		place_one(cur, ids, c[i], mask, i);
		place_one(cur, ids, c[i + 1], mask, i + 1);
		place_one(cur, ids, c[i + 2], mask, i + 2);
		place_one(cur, ids, c[i + 3], mask, i + 3);
	}
	for (; i < n; i++)
		place_one(cur, ids, c[i], mask, i);
}

/* How far ahead the placement prefetches the line it will write. */
#define PLACE_AHEAD 32
/* ...when the 2^K lines being written at once outgrow L1 (48 KiB here). */
#define PLACE_AHEAD_K 9

/*
 * place() for table t and count() for table t+1 in one loop, with two
 * prefetches place() alone does not need: for K around 10 a table's ids are
 * written at ~2^K places at once, more lines than L1 holds, so each store
 * would miss; prefetching the line of token i + PLACE_AHEAD (its bucket's
 * cursor now) cut the uniform-code build from ~11 to ~7 ms.  And table t+1's
 * ids region, next to be scattered over, is touched in order, one line per
 * 32 tokens, which hides its misses when the memory is cold.
 */
static void place_count(uint16_t *restrict cur, uint16_t *restrict ids, const uint16_t *restrict c,
			uint16_t *restrict h, const uint16_t *restrict cn, const uint16_t *idsn,
			uint32_t n, uint32_t mask, int ahead)
{
	uint32_t i = 0;

	for (; i + 32 + PLACE_AHEAD <= n; i += 32) {
		__builtin_prefetch(idsn + i, 1);
		for (uint32_t k = i; k < i + 32; k += 4) {
			const uint16_t *ca = c + k + PLACE_AHEAD;

			if (ahead) {
				__builtin_prefetch(&ids[cur[ca[0] & mask]], 1);
				__builtin_prefetch(&ids[cur[ca[1] & mask]], 1);
				__builtin_prefetch(&ids[cur[ca[2] & mask]], 1);
				__builtin_prefetch(&ids[cur[ca[3] & mask]], 1);
			}
			place_one(cur, ids, c[k], mask, k);
			count_one(h, cn[k], mask);
			place_one(cur, ids, c[k + 1], mask, k + 1);
			count_one(h, cn[k + 1], mask);
			place_one(cur, ids, c[k + 2], mask, k + 2);
			count_one(h, cn[k + 2], mask);
			place_one(cur, ids, c[k + 3], mask, k + 3);
			count_one(h, cn[k + 3], mask);
		}
	}
	for (; i < n; i++) {
		place_one(cur, ids, c[i], mask, i);
		count_one(h, cn[i], mask);
	}
}

/* Counts in off[1..nb] -> bucket starts in off[1..nb]; off[0] = 0. */
static void starts(uint16_t *off, uint32_t nb)
{
	uint16_t s = 0;

	off[0] = 0;
	for (uint32_t b = 1; b <= nb; b++) {
		uint16_t x = off[b];

		off[b] = s;
		s = (uint16_t)(s + x);
	}
}

/* With the counts in off[1..], the bucket of token 0 holds everything iff
 * its count is n: for n = 65536 that count reads 0, and a bucket holding
 * token 0 cannot be empty, so the test stays exact. */
static uint32_t full_bucket(const uint16_t *off, const uint16_t *c, uint32_t n, uint32_t mask)
{
	uint32_t b = c[0] & mask;

	return off[b + 1] == (uint16_t)n ? b : UINT32_MAX;
}

int kvd_lsh_tables_layout(struct kvd_lsh_tables *t, void *mem, uint32_t n, int K, int L)
{
	char *p = mem;

	if (!geom_ok(n, K, L))
		return -KVD_EGEOM;
	t->n = n;
	t->K = (uint32_t)K;
	t->L = (uint32_t)L;
	t->off = (uint16_t *)p;
	t->ids = (uint16_t *)(p + off_bytes(K, L));
	t->full = (uint32_t *)(p + off_bytes(K, L) + ids_bytes(n, L));
	return 0;
}

int kvd_lsh_build(struct kvd_lsh_tables *t, void *mem, uint32_t n, int K, int L,
		  const uint16_t *codes, size_t ldc)
{
	if (kvd_lsh_tables_layout(t, mem, n, K, L))
		return -KVD_EGEOM;
	kvd_lsh_build_range(t, codes, ldc, 0, (uint32_t)L);
	return 0;
}

void kvd_lsh_build_range(const struct kvd_lsh_tables *t, const uint16_t *codes, size_t ldc,
			 uint32_t l0, uint32_t l1)
{
	uint32_t n = t->n, K = t->K, nb = 1u << K, mask = nb - 1;
	size_t stride = (size_t)nb + 1;

	if (l0 >= l1)
		return;
	/* Codes are masked to K bits everywhere: they may come from a client. */
	memset(t->off + (size_t)l0 * stride, 0, stride * sizeof(uint16_t));
	count(t->off + (size_t)l0 * stride + 1, codes + (size_t)l0 * ldc, n, mask);
	for (uint32_t l = l0; l < l1; l++) {
		uint16_t *off = t->off + (size_t)l * stride;
		uint16_t *ids = t->ids + (size_t)l * n;
		const uint16_t *c = codes + (size_t)l * ldc;

		t->full[l] = full_bucket(off, c, n, mask);
		starts(off, nb);
		if (l + 1 < l1) {
			memset(off + stride, 0, stride * sizeof(uint16_t));
			place_count(off + 1, ids, c, off + stride + 1, c + ldc, ids + n, n, mask,
				    (int)K >= PLACE_AHEAD_K);
		} else {
			place(off + 1, ids, c, n, mask);
		}
	}
}

/* Descents of a[k] against its predecessor b[k] = a[k-1], and the largest
 * id, over a block of fixed length with 16-bit sums: -O2 vectorizes this
 * form (its cheap cost model takes no loop of unknown length), ~4x the
 * scalar loop. */
#define CHECK_BLOCK 64

static inline void check_block(const uint16_t *restrict a, const uint16_t *restrict b,
			       uint16_t *down, uint16_t *max)
{
	uint16_t dn = 0, mx = 0;

	for (int k = 0; k < CHECK_BLOCK; k++) {
		dn += (uint16_t)(a[k] <= b[k]);
		mx = a[k] > mx ? a[k] : mx;
	}
	*down = dn;
	*max = mx;
}

/*
 * The check reads every bucket exactly as kvd_lsh_bucket() does (uint16
 * difference, `full` only for a difference of 0) and keeps the true running
 * total `at` beside it.  The stored start of a bucket must equal `at` modulo
 * 2^16, and `at` plus the count may not pass n: since `at` <= n <= 65536,
 * the start equals `at` except when `at` == 65536, and then the count must be
 * 0.  So every bucket reads inside [0, n), and the buckets tile it in order.
 *
 * Ids are then checked in one flat pass, not bucket by bucket (buckets hold
 * a handful of ids each: a loop per bucket measured ~3 ns an id, the
 * whole check this way ~0.5): "strictly ascending within each bucket" is "every descent of
 * the whole array (an id not above the one before it) falls on the first id
 * of a bucket", so the flat pass counts descents and the bucket pass counts
 * the ones at bucket starts.
 */
static int table_check(const uint16_t *off, const uint16_t *ids, uint32_t full, uint32_t n,
		       uint32_t nb)
{
	uint32_t at = 0, all = UINT32_MAX, at_starts = 0, down = 0;
	uint16_t mx = ids[0];

	if (off[0] != 0 || off[nb] != (uint16_t)n || (full != UINT32_MAX && full >= nb))
		return -KVD_EFORMAT;
	for (uint32_t b = 0; b < nb; b++) {
		uint32_t start = off[b], cnt = (uint16_t)(off[b + 1] - start);

		if (cnt == 0 && full == b)
			cnt = n;
		if (start != (at & 0xffff) || cnt > n - at)
			return -KVD_EFORMAT;
		/* at < n here whenever cnt > 0, so ids[at] is in the table */
		if (cnt && at)
			at_starts += ids[at] <= ids[at - 1];
		all = cnt == n ? b : all;
		at += cnt;
	}
	/* kvd_lsh_build() sets full exactly when one bucket holds everything. */
	if (at != n || full != all)
		return -KVD_EFORMAT;
	uint32_t j = 1;

	for (; j + CHECK_BLOCK <= n; j += CHECK_BLOCK) {
		uint16_t dn, m;

		check_block(ids + j, ids + j - 1, &dn, &m);
		down += dn;
		mx = m > mx ? m : mx;
	}
	for (; j < n; j++) {
		down += ids[j] <= ids[j - 1];
		mx = ids[j] > mx ? ids[j] : mx;
	}
	if (down != at_starts || (uint32_t)mx >= n)
		return -KVD_EFORMAT;
	return 0;
}

int kvd_lsh_tables_check(const void *mem, uint32_t n, int K, int L)
{
	struct kvd_lsh_tables t;

	if ((uintptr_t)mem & 63)
		return -EINVAL;
	/* layout() only computes addresses; nothing is written through t. */
	if (kvd_lsh_tables_layout(&t, (void *)mem, n, K, L))
		return -KVD_EGEOM;

	uint32_t nb = 1u << K;

	for (uint32_t l = 0; l < (uint32_t)L; l++) {
		int rc = table_check(t.off + (size_t)l * (nb + 1), t.ids + (size_t)l * n, t.full[l],
				     n, nb);

		if (rc)
			return rc;
	}
	return 0;
}

/* ---- retrieval ---------------------------------------------------------- */

int kvd_lsh_scratch_init(struct kvd_lsh_scratch *s, uint32_t cap)
{
	memset(s, 0, sizeof *s);
	if (cap < 1 || cap > KVD_SEG_MAX)
		return -KVD_EGEOM;
	s->cnt = aligned_alloc(64, (size_t)(cap + 63) / 64 * 64);
	s->bits = calloc((cap + 63) / 64, sizeof(uint64_t));
	s->nz = calloc((cap + 4095) / 4096, sizeof(uint64_t));
	if (!s->cnt || !s->bits || !s->nz) {
		kvd_lsh_scratch_free(s);
		return -ENOMEM;
	}
	memset(s->cnt, 0, (size_t)(cap + 63) / 64 * 64);
	s->cap = cap;
	s->slots = 2;
	return 0;
}

void kvd_lsh_scratch_free(struct kvd_lsh_scratch *s)
{
	free(s->cnt);
	free(s->bits);
	free(s->nz);
	memset(s, 0, sizeof *s);
}

/* Tables whose buckets are looked up (and their ids prefetched) ahead of the
 * walk: each table is a separate region, so every bucket is a cache miss,
 * and issuing a batch of them at once overlaps the misses.  Every table's
 * offset line is prefetched before the first batch, and every line of each
 * batch's buckets while the batch before it is walked, so that on cold
 * tables (as in decoding) the walk rarely waits for either.  (The first and
 * last line only, which left the middle of the ~100-byte buckets of a 32k
 * segment to the hardware, took ~10 % longer per cold call on Zen 4.) */
#define CAND_BATCH 16

/* The ids set in want[] into out, ascending, and want[] zero again,
 * visiting only the words nz marks (ge8's summary, a bit a word): with ~90
 * candidates among 32k ids, as a dense head has, 5 words in 6 are empty,
 * and visiting all 512 took ~80 % of the drain's time, ~8 % of a dense
 * sampled head's (Zen 5, 98k tokens, cold; docs/MEASUREMENTS.md).  Sets
 * *nw to the words visited.
 * A loop that runs once per id mispredicts about once a word (a word holds
 * 1, 2 or 3 candidates at random), which took a quarter of the walk.
 * Instead each word fills W slots unconditionally, each advancing out by
 * one only while ids remain (ctz of the word with bit 63 forced, so that a
 * word out of ids reads 63, not an undefined ctz(0)), and only a word of
 * more than W ids loops.  W follows the density of the last call (scratch's
 * slots), which changes the speed of a call, never its result.  A slot
 * past the last id is overwritten or beyond m; m + W <= n keeps it inside
 * out. */
static inline __attribute__((always_inline)) uint32_t drain(const uint32_t W,
							    uint64_t *want, const uint64_t *nz,
							    uint32_t words, uint32_t n, uint16_t *out,
							    uint32_t *nw)
{
	uint32_t m = 0, v = 0;

	for (uint32_t sw = 0; sw < (words + 63) / 64; sw++) {
		for (uint64_t y = nz[sw]; y; y &= y - 1) {
			uint32_t w = sw * 64 + (uint32_t)__builtin_ctzll(y);
			uint64_t x = want[w];
			uint32_t base = w * 64;

			want[w] = 0;
			v++;
			if (m + W <= n)
				for (uint32_t k = 0; k < W; k++) {
					out[m] = (uint16_t)(base +
							    (uint32_t)__builtin_ctzll(x | 1ull << 63));
					m += x != 0;
					x &= x - 1;
				}
			while (x) {
				out[m++] = (uint16_t)(base + (uint32_t)__builtin_ctzll(x));
				x &= x - 1;
			}
		}
	}
	*nw = v;
	return m;
}

/*
 * A byte per token counts the tables an id is in (a table never holds an id
 * twice): one add to memory an id.  The kernels' ge8 then turns the counts
 * into a bitmap of the ids seen c times or more, 64 ids an instruction or
 * two, and zeroes them; the drain (above) lists that bitmap in ascending
 * order.  This replaced two bitmaps, `once` and `twice`, that counted to
 * two with two loads and two stores an id: on an Emerald Rapids VM (48 KiB
 * L1), one process alternating the two, a 32k-token call took 0.71-0.90
 * of their time cold, 0.66-0.85 right after the same call and 0.61-0.66
 * looping on one head; 0.72-0.75 cold at L300, and 0.75-0.92 at 64k
 * tokens, whose counts outgrow L1 (same candidates).  On Zen 4 a byte
 * count had lost to the bitmaps (~18 against ~8 us a call, tables
 * cached), but that one kept a list of the ids it touched to clear them.
 *
 * Counts above 255 would wrap (L may reach KVD_LSH_LMAX): every FOLD
 * tables they are capped at 2, which keeps "at least c" for c <= 2 and
 * every count at most 2 + FOLD = 242.
 *
 * Buckets are walked two at a time, an id from each in turn: the two
 * streams of loads and stores are independent, and a walked id took ~9 %
 * less (Zen 5, needle and dense, 32k tokens, cold).
 */
#define FOLD (15 * CAND_BATCH)

static void fold(uint8_t *cnt, size_t n)
{
	for (size_t i = 0; i < n; i++)
		cnt[i] = cnt[i] < 2 ? cnt[i] : 2;
}

uint32_t kvd_lsh_candidates(const struct kvd_lsh_tables *t, const uint16_t *qcodes,
			    int c, struct kvd_lsh_scratch *s, uint16_t *out)
{
	return kvd_lsh_candidates_n(t, qcodes, t->L, c, s, out);
}

uint32_t kvd_lsh_candidates_n(const struct kvd_lsh_tables *t, const uint16_t *qcodes,
			      uint32_t nt, int c, struct kvd_lsh_scratch *s, uint16_t *out)
{
	if (t->n > s->cap || c < 1 || c > 2 || nt < 1 || nt > t->L)
		return 0;

	uint8_t *restrict cnt = s->cnt;
	uint32_t mask = (1u << t->K) - 1, words = (t->n + 63) / 64, m = 0;

	const uint16_t *ids[2][CAND_BATCH];
	uint32_t len[2][CAND_BATCH];

	for (uint32_t tab = 0; tab < nt; tab++)
		__builtin_prefetch(t->off + (size_t)tab * ((1u << t->K) + 1) + (qcodes[tab] & mask));
	for (uint32_t t0 = 0; t0 < nt + CAND_BATCH; t0 += CAND_BATCH) {
		/* look up and prefetch batch t0; walk batch t0 - CAND_BATCH */
		uint32_t cur = t0 / CAND_BATCH & 1;

		for (uint32_t k = 0; k < CAND_BATCH && t0 + k < nt; k++) {
			len[cur][k] = kvd_lsh_bucket(t, t0 + k, qcodes[t0 + k] & mask, &ids[cur][k]);
			__builtin_prefetch(ids[cur][k]);
			for (uint32_t l = 32; l < len[cur][k]; l += 32)
				__builtin_prefetch(ids[cur][k] + l);
			__builtin_prefetch(ids[cur][k] + len[cur][k] - (len[cur][k] > 0));
		}
		if (t0 == 0)
			continue;

		uint32_t prev = cur ^ 1, p0 = t0 - CAND_BATCH;
		uint32_t pn = nt - p0 < CAND_BATCH ? nt - p0 : CAND_BATCH;

		for (uint32_t k = 0; k < pn; k += 2) {
			const uint16_t *restrict a = ids[prev][k];
			const uint16_t *restrict b = k + 1 < pn ? ids[prev][k + 1] : a;
			uint32_t la = len[prev][k], lb = k + 1 < pn ? len[prev][k + 1] : 0;
			uint32_t both = la < lb ? la : lb, j = 0;

			for (; j < both; j++) {
				cnt[a[j]]++;
				cnt[b[j]]++;
			}
			for (uint32_t i = j; i < la; i++)
				cnt[a[i]]++;
			for (uint32_t i = j; i < lb; i++)
				cnt[b[i]]++;
		}
		if ((p0 + CAND_BATCH) % FOLD == 0 && p0 + CAND_BATCH < nt)
			fold(cnt, (size_t)words * 64);
	}
	kvd_kern_get()->ge8(cnt, words, (uint8_t)c, s->bits, s->nz);

	uint32_t nw = 0;

	switch (s->slots) {
	case 2:
		m = drain(2, s->bits, s->nz, words, t->n, out, &nw);
		break;
	case 4:
		m = drain(4, s->bits, s->nz, words, t->n, out, &nw);
		break;
	case 8:
		m = drain(8, s->bits, s->nz, words, t->n, out, &nw);
		break;
	default:
		m = drain(16, s->bits, s->nz, words, t->n, out, &nw);
		break;
	}
	/* Slots for the next call, most likely the next q head of the same
	 * layer: with ids spread at random (Poisson, 1, 3 and 6 a word on
	 * average at the tops of the ranges, so 1.6, 3.2 and 6 a word that
	 * holds any), a word visited has more than W in 13 % of them at the
	 * top of W = 2's range, under 20 % at the top of the others. */
	s->slots = 5 * m <= 8 * nw ? 2 : 5 * m <= 16 * nw ? 4 : m <= 6 * nw ? 8 : 16;
	return m;
}

/* ---- collision probability --------------------------------------------- */

/*
 * ln P as a function of r = 1 - theta/pi, so the table can pass r = i/N
 * exactly.  P(c=2) = 1 - (1-p)^(L-1) (1 + (L-1)p) = -expm1(a) with
 * a = (L-1) log1p(-p) + log1p((L-1)p).  For small x = (L-1)p the two terms
 * of a cancel to about -L(L-1)p^2/2 and, once p^2 drops below the rounding
 * of x, to garbage or zero; there a is summed from its series instead:
 *     a = sum_{k>=2} ((-1)^(k+1) x^k - (L-1) p^k) / k,
 * whose terms alternate and shrink by about x, so no digits are lost.
 */
static double logp_r(double r, int K, int L, int c)
{
	if (K < 1 || L < 1 || (c != 1 && c != 2))
		return NAN;
	if (r <= 0.0)
		return -INFINITY;
	if (r >= 1.0)           /* every table collides */
		return c <= L ? 0.0 : -INFINITY;

	double p = pow(r, K);

	if (c == 1)
		return log(-expm1(L * log1p(-p)));
	if (L == 1)
		return -INFINITY;

	double m = L - 1, x = m * p, a;

	if (x < 0.125) {
		double xk = x, pk = p;

		a = 0.0;
		for (int k = 2; k < 64; k++) {
			xk *= x;
			pk *= p;

			a += ((k & 1 ? xk : -xk) - m * pk) / k;
			/* Not the term itself: for L = 2 every odd term is 0. */
			if (xk <= 0x1p-60 * fabs(a))
				break;
		}
	} else {
		a = m * log1p(-p) + log1p(x);
	}
	return log(-expm1(a));
}

double kvd_lsh_logp(double cos_theta, int K, int L, int c)
{
	double cs = cos_theta > 1.0 ? 1.0 : cos_theta < -1.0 ? -1.0 : cos_theta;

	return logp_r(1.0 - acos(cs) / M_PI, K, L, c);
}

void kvd_logp_tab_init(struct kvd_logp_tab *tab, int K, int L, int c)
{
	tab->K = K;
	tab->L = L;
	tab->c = c;
	for (int i = 0; i <= KVD_LOGP_N; i++) {
		double v = logp_r((double)(KVD_LOGP_N - i) / KVD_LOGP_N, K, L, c);

		/* Written as a test so that NaN (bad K, L, c) also lands on the floor. */
		tab->v[i] = v > KVD_LOGP_FLOOR ? (float)v : KVD_LOGP_FLOOR;
	}
	tab->v[KVD_LOGP_N + 1] = tab->v[KVD_LOGP_N];
}
