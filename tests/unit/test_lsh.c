/* kvd_lsh: the tables against a brute-force bucket scan, retrieval against
 * brute-force collision counting (random codes, and codes from every hash
 * kernel this CPU runs), the collision probability against Monte Carlo and
 * against an independent evaluation, the logp table's interpolation error,
 * and argument checking. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/err.h"
#include "engine/kern.h"
#include "engine/lsh.h"
#include "engine/rng.h"
#include "testutil.h"

/* ---- helpers ------------------------------------------------------------ */

#define GUARD 64

struct built {
	struct kvd_lsh_tables t;
	unsigned char *mem;
	size_t bytes;
};

/* Builds into garbage-filled memory followed by a guard band, so the tables
 * can rely on nothing being zeroed and a write past the end shows. */
static void build(struct built *b, uint32_t n, int K, int L, const uint16_t *codes, size_t ldc)
{
	b->bytes = kvd_lsh_tables_bytes(n, K, L);
	assert_true(b->bytes > 0);
	assert_int_equal(b->bytes % 64, 0);
	b->mem = aligned_alloc(64, b->bytes + GUARD);
	assert_non_null(b->mem);
	memset(b->mem, 0xa5, b->bytes + GUARD);
	assert_int_equal(kvd_lsh_build(&b->t, b->mem, n, K, L, codes, ldc), 0);
	for (size_t i = 0; i < GUARD; i++)
		assert_int_equal(b->mem[b->bytes + i], 0xa5);

	const struct kvd_lsh_tables *t = &b->t;
	unsigned char *lo = b->mem, *hi = b->mem + b->bytes;
	unsigned char *po = (unsigned char *)t->off, *pi = (unsigned char *)t->ids;
	unsigned char *pf = (unsigned char *)t->full;

	assert_int_equal(t->n, n);
	assert_int_equal(t->K, K);
	assert_int_equal(t->L, L);
	assert_int_equal((uintptr_t)po % 64, 0);
	assert_int_equal((uintptr_t)pi % 64, 0);
	assert_int_equal((uintptr_t)pf % 64, 0);
	/* The three parts lie inside mem, in this order, without overlap. */
	assert_true(po >= lo && po + (size_t)L * ((1u << K) + 1) * 2 <= pi);
	assert_true(pi + (size_t)L * n * 2 <= pf);
	assert_true(pf + (size_t)L * 4 <= hi);
}

static void unbuild(struct built *b)
{
	free(b->mem);
	b->mem = NULL;
}

enum dist { D_UNIFORM, D_SKEWED, D_EQUAL, D_SMALL, D_JUNK, D_COUNT };
static const char *const dist_name[] = {
	"uniform", "skewed", "all-equal", "small", "junk-high-bits",
};

/* codes[t*ldc + i]; D_JUNK sets bits above K, which every consumer must
 * ignore (codes can come from a client). */
static void gen_codes(uint16_t *codes, uint32_t n, int K, int L, size_t ldc, enum dist dist,
		      struct kvd_rng *r)
{
	uint32_t nb = 1u << K;

	for (int t = 0; t < L; t++) {
		uint16_t *c = codes + (size_t)t * ldc;
		uint16_t hot[3] = { (uint16_t)kvd_rng_below(r, nb), (uint16_t)kvd_rng_below(r, nb),
				    (uint16_t)kvd_rng_below(r, nb) };

		for (uint32_t i = 0; i < n; i++) {
			switch (dist) {
			case D_UNIFORM:
				c[i] = (uint16_t)kvd_rng_below(r, nb);
				break;
			case D_SKEWED:
				c[i] = kvd_rng_below(r, 4) ? hot[kvd_rng_below(r, 3)]
							    : (uint16_t)kvd_rng_below(r, nb);
				break;
			case D_EQUAL:
				c[i] = hot[0];
				break;
			case D_SMALL:   /* geometric-ish: small codes far more likely */
				c[i] = (uint16_t)kvd_rng_below(r, 1 + kvd_rng_below(r, nb));
				break;
			default:
				c[i] = (uint16_t)kvd_rng_bits(r);
				break;
			}
		}
		/* Pad between tables: must never be read as a code. */
		for (size_t i = n; i < ldc; i++)
			c[i] = (uint16_t)kvd_rng_bits(r);
	}
}

/* The tables, checked against the codes without sharing any logic with the
 * build: every listed id has the bucket's code, lists are strictly
 * ascending, and every id is listed exactly once -- which together say each
 * bucket is exactly its ids in ascending order.  For small n * 2^K also the
 * literal scan: bucket b == [i for i in 0..n if code(i) == b]. */
static void check_tables(const struct kvd_lsh_tables *t, const uint16_t *codes, size_t ldc)
{
	uint32_t n = t->n, nb = 1u << t->K, mask = nb - 1;
	unsigned char *seen = xmalloc(n);
	uint16_t *scan = xmalloc((size_t)n * 2);
	int literal = (uint64_t)n * nb <= (1u << 16);

	for (uint32_t tab = 0; tab < t->L; tab++) {
		const uint16_t *c = codes + (size_t)tab * ldc;
		const uint16_t *lo = t->ids + (size_t)tab * n, *hi = lo + n;
		uint64_t total = 0;
		uint32_t all = c[0] & mask;

		memset(seen, 0, n);
		for (uint32_t i = 1; i < n && all != UINT32_MAX; i++)
			if ((c[i] & mask) != all)
				all = UINT32_MAX;
		assert_int_equal(t->full[tab], all);
		for (uint32_t b = 0; b < nb; b++) {
			const uint16_t *ids;
			uint32_t len = kvd_lsh_bucket(t, tab, b, &ids);

			assert_true(ids >= lo && ids + len <= hi);
			for (uint32_t j = 0; j < len; j++) {
				uint16_t id = ids[j];

				assert_true(id < n);
				assert_int_equal(c[id] & mask, b);
				assert_true(j == 0 || ids[j - 1] < id);
				assert_false(seen[id]);
				seen[id] = 1;
			}
			total += len;
			if (literal) {
				uint32_t m = 0;

				for (uint32_t i = 0; i < n; i++)
					if ((c[i] & mask) == b)
						scan[m++] = (uint16_t)i;
				assert_int_equal(m, len);
				assert_memory_equal(scan, ids, (size_t)m * 2);
			}
		}
		assert_int_equal(total, n);
	}
	free(seen);
	free(scan);
}

/* Dispatched hashing; while a SIMD kernel file is still a placeholder its
 * hash is NULL, and the tests fall back to scalar rather than crash. */
static void hash(const float *W, int d, int K, int L, const float *x, size_t ldx, size_t n,
		 uint16_t *codes, size_t ldc)
{
	static int said;

	if (kvd_kern_get()->hash) {
		kvd_lsh_hash(W, d, K, L, x, ldx, n, codes, ldc);
		return;
	}
	if (!said++)
		printf("SKIP: dispatched kernel %s has no hash yet; hashing with scalar\n",
		       kvd_kern_get()->name);
	kvd_kern_scalar.hash(W, d, K, L, x, ldx, n, codes, ldc);
}

/* ---- 1. tables ------------------------------------------------------------ */

static void test_tables_match_scan(void **state)
{
	struct {
		uint32_t n;
		int K, L;
		enum dist dist;
	} fixed[] = {
		{ 1, 1, 1, D_UNIFORM },
		{ 1, 16, 3, D_UNIFORM },
		{ 7, 3, 5, D_UNIFORM },
		{ 7, 16, 2, D_JUNK },
		{ 1000, 10, 40, D_SKEWED },
		{ 1000, 1, 17, D_UNIFORM },
		{ 65536, 10, 6, D_UNIFORM },
		{ 65536, 16, 3, D_UNIFORM },
		{ 65536, 1, 2, D_SKEWED },
		{ 65536, 7, 4, D_EQUAL },       /* full[] with offsets wrapping to 0 */
		{ 65535, 5, 3, D_EQUAL },
		{ 40000, 12, 5, D_JUNK },
		{ 30000, 14, 4, D_SMALL },
	};
	const int nfixed = sizeof fixed / sizeof fixed[0], nrand = 16;
	struct kvd_rng r = kvd_rng_make(101);
	int dists[D_COUNT] = { 0 };
	uint64_t elems = 0;

	for (int cs = 0; cs < nfixed + nrand; cs++) {
		uint32_t n;
		int K, L;
		enum dist dist;

		if (cs < nfixed) {
			n = fixed[cs].n;
			K = fixed[cs].K;
			L = fixed[cs].L;
			dist = fixed[cs].dist;
		} else {
			static const uint32_t ns[] = { 1, 7, 1000, 65536 };

			n = kvd_rng_below(&r, 5) < 4 ? ns[kvd_rng_below(&r, 4)] : 1 + kvd_rng_below(&r, 65536);
			K = 1 + (int)kvd_rng_below(&r, 16);
			L = 1 + (int)kvd_rng_below(&r, 40);
			dist = (enum dist)kvd_rng_below(&r, D_COUNT);
			if ((uint64_t)n * L > 600000)
				L = 1 + (int)(600000 / n);
		}

		size_t ldc = n + (cs & 1 ? 13 : 0);
		uint16_t *codes = xmalloc((size_t)L * ldc * 2);
		struct built b;

		gen_codes(codes, n, K, L, ldc, dist, &r);
		build(&b, n, K, L, codes, ldc);
		check_tables(&b.t, codes, ldc);
		unbuild(&b);
		free(codes);
		dists[dist]++;
		elems += (uint64_t)n * L;
	}
	printf("tables: %d builds (%d fixed incl. n=65536 all-equal, %d random K 1..16, L 1..40), "
	       "%llu codes; distributions:", nfixed + nrand, nfixed, nrand, (unsigned long long)elems);
	for (int i = 0; i < D_COUNT; i++)
		printf(" %s %d", dist_name[i], dists[i]);
	printf("\n");
}

/* ---- 2. retrieval --------------------------------------------------------- */

/* hits[i] = the number of tables where token i's code equals the query's. */
static void brute_hits(const uint16_t *codes, size_t ldc, uint32_t n, int K, int L,
		       const uint16_t *q, uint16_t *hits)
{
	uint32_t mask = (1u << K) - 1;

	memset(hits, 0, (size_t)n * 2);
	for (int t = 0; t < L; t++) {
		const uint16_t *c = codes + (size_t)t * ldc;
		uint16_t qt = q[t] & mask;

		for (uint32_t i = 0; i < n; i++)
			hits[i] += (c[i] & mask) == qt;
	}
}

static void assert_scratch_clean(const struct kvd_lsh_scratch *s)
{
	for (uint32_t w = 0; w < (s->cap + 63) / 64; w++) {
		if (s->bits[w])
			fail_msg("scratch word %u = %#llx after a query", w,
				 (unsigned long long)s->bits[w]);
		for (uint32_t j = 0; j < 64; j++)
			if (s->cnt[w * 64 + j])
				fail_msg("scratch count %u = %u after a query", w * 64 + j,
					 s->cnt[w * 64 + j]);
	}
}

/* Queries: random; one token's codes (so it and its twins collide
 * everywhere); per table the code of some random token (ids colliding in
 * one table, few in two); a token's codes with half the tables randomised. */
static void gen_query(uint16_t *q, int mode, const uint16_t *codes, size_t ldc, uint32_t n,
		      int K, int L, struct kvd_rng *r)
{
	uint32_t j = kvd_rng_below(r, n);

	for (int t = 0; t < L; t++) {
		switch (mode) {
		case 0:
			q[t] = (uint16_t)kvd_rng_bits(r);       /* junk high bits too */
			break;
		case 1:
			q[t] = codes[(size_t)t * ldc + j];
			break;
		case 2:
			q[t] = codes[(size_t)t * ldc + kvd_rng_below(r, n)];
			break;
		default:
			q[t] = kvd_rng_below(r, 2) ? codes[(size_t)t * ldc + j]
						   : (uint16_t)kvd_rng_below(r, 1u << K);
			break;
		}
	}
}

/* Returns the number of candidates (summed over c = 1, 2). */
/* Candidates: as many as brute force finds, each one a token that collides
 * in >= c tables, in ascending order (so none twice) -- equal sets. */
static uint64_t check_retrieval(const struct kvd_lsh_tables *t, const uint16_t *codes, size_t ldc,
				const uint16_t *q, struct kvd_lsh_scratch *s)
{
	uint32_t n = t->n;
	uint16_t *got = xmalloc((size_t)n * 2), *hits = xmalloc((size_t)n * 2);
	unsigned char *seen = xmalloc(n);
	uint64_t total = 0;

	brute_hits(codes, ldc, n, (int)t->K, (int)t->L, q, hits);
	for (int c = 1; c <= 2; c++) {
		uint32_t nw = 0;

		for (uint32_t i = 0; i < n; i++)
			nw += hits[i] >= c;

		/* Four times with the same scratch (the first call must leave it
		 * clean), once with each width of the drain's unrolled slots:
		 * any width gives the same ids, and none writes past n (got holds
		 * exactly n; the ASan build checks). */
		for (int rep = 0; rep < 4; rep++) {
			memset(got, 0xee, (size_t)n * 2);
			memset(seen, 0, n);
			s->slots = 2u << rep;

			uint32_t ng = kvd_lsh_candidates(t, q, c, s, got);

			assert_int_equal(ng, nw);
			for (uint32_t k = 0; k < ng; k++) {
				uint16_t id = got[k];

				assert_true(id < n);
				assert_true(k == 0 || id > got[k - 1]);     /* ascending */
				assert_true(hits[id] >= c);
				assert_false(seen[id]);
				seen[id] = 1;
			}
		}
		assert_scratch_clean(s);
		total += nw;
	}
	free(got);
	free(hits);
	free(seen);
	return total;
}

static void test_retrieval_matches_brute_force(void **state)
{
	struct kvd_rng r = kvd_rng_make(202);
	struct kvd_lsh_scratch s, tight;
	uint64_t queries = 0, cands = 0;
	int cases = 0, big = 0;

	assert_int_equal(kvd_lsh_scratch_init(&s, KVD_SEG_MAX), 0);
	for (int cs = 0; cs < 16; cs++) {
		uint32_t n;
		int K, L;
		enum dist dist = (enum dist)kvd_rng_below(&r, D_COUNT);

		switch (cs) {
		case 0:         /* L > 255: per-id byte counts must not wrap */
			n = 500;
			K = 1;
			L = 300;
			break;
		case 4:         /* a token in all 256 tables: a wrapped count reads 0 */
			n = 500;
			K = 1;
			L = 256;
			break;
		case 1:
			n = 65536;
			K = 8;
			L = 8;
			break;
		case 2:
			n = 65536;
			K = 3;
			L = 3;
			dist = D_EQUAL;
			break;
		case 3:
			n = 1;
			K = 5;
			L = 9;
			break;
		case 5:         /* the fold over a big segment too */
			n = 50000;
			K = 1;
			L = 300;
			break;
		default:
			n = 1 + kvd_rng_below(&r, 65536);
			K = 1 + (int)kvd_rng_below(&r, 16);
			L = 1 + (int)kvd_rng_below(&r, 40);
			if ((uint64_t)n * L > 250000)
				L = 1 + (int)(250000 / n);
			break;
		}

		size_t ldc = n + 3;
		uint16_t *codes = xmalloc((size_t)L * ldc * 2), *q = xmalloc((size_t)L * 2);
		struct built b;
		int nq = n * L > 100000 ? 3 : 8;

		gen_codes(codes, n, K, L, ldc, dist, &r);
		build(&b, n, K, L, codes, ldc);
		for (int k = 0; k < nq; k++) {
			gen_query(q, k % 4, codes, ldc, n, K, L, &r);
			cands += check_retrieval(&b.t, codes, ldc, q, &s);
			queries++;
		}
		/* A scratch of exactly n entries works too. */
		assert_int_equal(kvd_lsh_scratch_init(&tight, n), 0);
		gen_query(q, 1, codes, ldc, n, K, L, &r);
		cands += check_retrieval(&b.t, codes, ldc, q, &tight);
		kvd_lsh_scratch_free(&tight);
		unbuild(&b);
		free(codes);
		free(q);
		cases++;
		big += n == 65536;
	}
	kvd_lsh_scratch_free(&s);
	printf("retrieval: %d table sets (%d with n = 65536; L = 300 over 500 and 50000 ids, 256 once), %llu queries x "
	       "c in {1, 2} x 4 drain widths on one scratch, %llu candidates, scratch clean after "
	       "each\n",
	       cases, big, (unsigned long long)queries, (unsigned long long)cands);
}

/* ---- 3. hash kernels and retrieval from real vectors --------------------- */

/* Bits where a kernel may disagree with scalar: the projection is within
 * rounding of zero. */
static void compare_codes(const uint16_t *got, const uint16_t *ref, const float *W, int d, int K,
			  int L, const float *x, size_t n, uint32_t *nflip)
{
	int KL = K * L;

	for (int t = 0; t < L; t++)
		for (size_t i = 0; i < n; i++) {
			unsigned diff = got[(size_t)t * n + i] ^ ref[(size_t)t * n + i];

			for (int j = 0; j < K; j++) {
				if (!(diff >> j & 1))
					continue;

				double y = 0, xx = 0, ww = 0;

				for (int e = 0; e < d; e++) {
					double w = W[(size_t)e * KL + t * K + j], v = x[i * d + e];

					y += v * w;
					xx += v * v;
					ww += w * w;
				}
				if (fabs(y) >= 1e-4 * sqrt(xx * ww))
					fail_msg("table %d bit %d of vector %zu differs from scalar: "
						 "projection %g, |x||w| %g", t, j, i, y, sqrt(xx * ww));
				(*nflip)++;
			}
		}
}

static void test_hash_kernels_and_retrieval(void **state)
{
	static const char *const names[] = { "scalar", "avx2", "avx512", "avx512bf16" };
	const int d = 64, K = 10, L = 16, nq = 8;
	const uint32_t n = 1000;
	struct kvd_rng r = kvd_rng_make(303);
	float *W = xmalloc(sizeof(float) * d * K * L), *x = xmalloc(sizeof(float) * n * d);
	float *qv = xmalloc(sizeof(float) * nq * d);
	uint16_t *ref = xmalloc((size_t)L * n * 2), *codes = xmalloc((size_t)L * n * 2);
	uint16_t *q = xmalloc((size_t)L * 2);
	struct kvd_lsh_scratch s;

	kvd_lsh_make_w(77, d, K, L, W);
	fill_normal(x, (size_t)n * d, &r, 0.0, 1.0);
	/* Tokens 1..9 are near-copies of token 0: real bucket-mates. */
	for (uint32_t i = 1; i < 10; i++)
		for (int e = 0; e < d; e++)
			x[i * d + e] = x[e] + 0.05f * (float)kvd_rng_normal(&r);
	fill_normal(qv, (size_t)nq * d, &r, 0.0, 1.0);
	/* Half the queries sit close to some key, so candidates are not empty. */
	for (int k = 0; k < nq / 2; k++) {
		uint32_t j = k == 0 ? 0 : kvd_rng_below(&r, n);

		for (int e = 0; e < d; e++)
			qv[k * d + e] = x[j * d + e] + 0.2f * qv[k * d + e];
	}
	kvd_kern_scalar.hash(W, d, K, L, x, d, n, ref, n);
	assert_int_equal(kvd_lsh_scratch_init(&s, n), 0);

	/* The dispatched path, whatever it chose. */
	hash(W, d, K, L, x, d, n, codes, n);
	{
		uint32_t flips = 0;

		compare_codes(codes, ref, W, d, K, L, x, n, &flips);
		printf("hash: kvd_lsh_hash via %s: %u near-zero bits differ from scalar\n",
		       kvd_kern_get()->hash ? kvd_kern_get()->name : "the scalar fallback", flips);
	}

	for (size_t v = 0; v < sizeof names / sizeof names[0]; v++) {
		const struct kvd_kern *k = kvd_kern_by_name(names[v]);
		uint32_t flips = 0;
		uint64_t cands = 0;
		struct built b;

		if (!k) {
			printf("SKIP: hash kernel %s not supported on this CPU\n", names[v]);
			continue;
		}
		if (!k->hash) {
			printf("SKIP: hash kernel %s is still a placeholder (NULL hash)\n", names[v]);
			continue;
		}
		memset(codes, 0xff, (size_t)L * n * 2);
		k->hash(W, d, K, L, x, d, n, codes, n);
		compare_codes(codes, ref, W, d, K, L, x, n, &flips);

		build(&b, n, K, L, codes, n);
		check_tables(&b.t, codes, n);
		for (int j = 0; j < nq; j++) {
			k->hash(W, d, K, L, qv + (size_t)j * d, d, 1, q, 1);
			cands += check_retrieval(&b.t, codes, n, q, &s);
		}
		unbuild(&b);
		printf("hash: %s: n=%u d=%d K=%d L=%d, %u near-zero bits differ from scalar; "
		       "%d hashed queries retrieve %llu candidates (c = 1 + 2), equal to brute force\n",
		       names[v], n, d, K, L, flips, nq, (unsigned long long)cands);
		assert_true(cands > 0);
	}
	kvd_lsh_scratch_free(&s);
	free(W);
	free(x);
	free(qv);
	free(ref);
	free(codes);
	free(q);
}

static void test_make_w(void **state)
{
	const int d = 16, K = 3, L = 5;
	float W[16 * 3 * 5], W2[16 * 15 * 1];

	kvd_lsh_make_w(0x1234, d, K, L, W);
	for (int e = 0; e < d * K * L; e++)
		assert_true(W[e] == (float)kvd_rng_normal_at(0x1234, (uint64_t)e));
	/* Element e depends on e alone, not on how K and L split the columns. */
	kvd_lsh_make_w(0x1234, d, K * L, 1, W2);
	assert_memory_equal(W, W2, sizeof W);
}

/* ---- 4. Monte Carlo --------------------------------------------------------- */

static double P_of(double cs, int K, int L, int c)
{
	return exp(kvd_lsh_logp(cs, K, L, c));
}

/* With |freq - P| <= 5 sigma + 1e-3, a correct formula fails with
 * probability ~1e-6 per comparison, while an off-by-one in L or c, or a
 * wrong exponent, moves P by many sigma at these sizes. */
static void check_freq(const char *what, double freq, double P, double trials)
{
	double tol = 5 * sqrt(P * (1 - P) / trials) + 1e-3;

	if (fabs(freq - P) > tol)
		fail_msg("%s: measured %.5f, formula %.5f, tolerance %.5f", what, freq, P, tol);
}

static void test_probability_monte_carlo(void **state)
{
	static const double coss[] = { 0.9, 0.6, 0.3, 0.0, -0.3 };
	static const struct { int K, L; } cfg[] = { { 4, 8 }, { 2, 3 } };
	enum { NA = sizeof coss / sizeof coss[0], d = 64, trials = 5000 };
	struct kvd_rng r = kvd_rng_make(404);
	float pairs[2 * NA * d], u[d], v[d];
	double cosf64[NA];

	/* q = u; k = cos u + sin v with v orthonormal to u.  The formula gets the
	 * angle of the float vectors, recomputed in double. */
	fill_normal(u, d, &r, 0, 1);
	fill_normal(v, d, &r, 0, 1);
	{
		double uu = 0, uv = 0, vv = 0;

		for (int e = 0; e < d; e++)
			uu += (double)u[e] * u[e];
		for (int e = 0; e < d; e++)
			u[e] = (float)(u[e] / sqrt(uu));
		for (int e = 0; e < d; e++)
			uv += (double)u[e] * v[e];
		for (int e = 0; e < d; e++)
			v[e] = (float)(v[e] - uv * u[e]);
		for (int e = 0; e < d; e++)
			vv += (double)v[e] * v[e];
		for (int e = 0; e < d; e++)
			v[e] = (float)(v[e] / sqrt(vv));
	}
	for (int a = 0; a < NA; a++) {
		double sn = sqrt(1 - coss[a] * coss[a]), qk = 0, qq = 0, kk = 0;
		float *qa = pairs + (size_t)(2 * a) * d, *ka = qa + d;

		for (int e = 0; e < d; e++) {
			qa[e] = u[e];
			ka[e] = (float)(coss[a] * u[e] + sn * v[e]);
		}
		for (int e = 0; e < d; e++) {
			qk += (double)qa[e] * ka[e];
			qq += (double)qa[e] * qa[e];
			kk += (double)ka[e] * ka[e];
		}
		cosf64[a] = qk / sqrt(qq * kk);
	}

	for (size_t g = 0; g < sizeof cfg / sizeof cfg[0]; g++) {
		int K = cfg[g].K, L = cfg[g].L;
		float *W = xmalloc(sizeof(float) * d * K * L);
		uint16_t *codes = xmalloc(sizeof(uint16_t) * L * 2 * NA);
		uint64_t tab[NA] = { 0 }, ge1[NA] = { 0 }, ge2[NA] = { 0 };

		for (int tr = 0; tr < trials; tr++) {
			/* An independent W per draw, as a fresh profile seed gives. */
			kvd_lsh_make_w(kvd_mix64(1000 + tr), d, K, L, W);
			hash(W, d, K, L, pairs, d, 2 * NA, codes, 2 * NA);
			for (int a = 0; a < NA; a++) {
				int m = 0;

				for (int t = 0; t < L; t++)
					m += codes[t * 2 * NA + 2 * a] == codes[t * 2 * NA + 2 * a + 1];
				tab[a] += m;
				ge1[a] += m >= 1;
				ge2[a] += m >= 2;
			}
		}
		printf("monte carlo K=%d L=%d, %d draws of W:\n", K, L, trials);
		for (int a = 0; a < NA; a++) {
			double cs = cosf64[a], p = pow(1 - acos(cs) / M_PI, K);
			double f0 = tab[a] / ((double)trials * L), f1 = ge1[a] / (double)trials;
			double f2 = ge2[a] / (double)trials, P1 = P_of(cs, K, L, 1), P2 = P_of(cs, K, L, 2);

			printf("  cos %+.1f: per table %.4f (p %.4f), >=1 %.4f (P1 %.4f), >=2 %.4f (P2 %.4f)\n",
			       cs, f0, p, f1, P1, f2, P2);
			check_freq("per-table collision", f0, p, (double)trials * L);
			check_freq(">= 1 collisions", f1, P1, trials);
			check_freq(">= 2 collisions", f2, P2, trials);
		}
		free(W);
		free(codes);
	}
}

/* ---- 5. ln P: formula and table ------------------------------------------- */

/* P(>= c of L) = sum_{j >= c} C(L, j) p^j (1-p)^(L-j): positive terms only, so
 * it keeps full relative precision even where the closed form cancels. */
static double logp_binomial(double cs, int K, int L, int c)
{
	double p = pow(1 - acos(cs) / M_PI, K), sum = 0;

	if (p <= 0)
		return -INFINITY;
	if (p >= 1)
		return c <= L ? 0.0 : -INFINITY;
	for (int j = c; j <= L; j++) {
		double lc = lgamma(L + 1.0) - lgamma(j + 1.0) - lgamma(L - j + 1.0);

		sum += exp(lc + j * log(p) + (L - j) * log1p(-p));
	}
	return log(sum);
}

static double P_naive(double cs, int K, int L, int c)
{
	double p = pow(1 - acos(cs) / M_PI, K);
	double P = 1 - pow(1 - p, L);

	if (c == 2)
		P -= L * p * pow(1 - p, L - 1);
	return P;
}

static void test_logp_formula(void **state)
{
	struct kvd_rng r = kvd_rng_make(505);
	double worst_naive = 0, worst_binom = 0, smallest = 0;
	int nnaive = 0, nbinom = 0;

	/* Edges: no NaN anywhere, exact ends. */
	for (int K = 1; K <= 16; K++)
		for (int L = 1; L <= 1024; L = L * 3 + 1)
			for (int c = 1; c <= 2; c++) {
				assert_true(kvd_lsh_logp(-1.0, K, L, c) == -INFINITY);
				assert_true(kvd_lsh_logp(-1.5, K, L, c) == -INFINITY);
				assert_true(kvd_lsh_logp(1.0, K, L, c) == (c <= L ? 0.0 : -INFINITY));
				assert_true(kvd_lsh_logp(2.0, K, L, c) == kvd_lsh_logp(1.0, K, L, c));
				for (int i = -1000; i <= 1000; i += 7) {
					double v = kvd_lsh_logp(i / 1000.0, K, L, c);

					assert_false(isnan(v));
					assert_true(v <= 0);
				}
			}
	assert_true(kvd_lsh_logp(0.3, 10, 1, 2) == -INFINITY);        /* c > L */
	assert_true(isnan(kvd_lsh_logp(0.3, 0, 10, 1)));
	assert_true(isnan(kvd_lsh_logp(0.3, 10, 0, 1)));
	assert_true(isnan(kvd_lsh_logp(0.3, 10, 10, 3)));

	for (int k = 0; k < 20000; k++) {
		int K = 1 + (int)kvd_rng_below(&r, 16), L = 1 + (int)kvd_rng_below(&r, 300);
		int c = 1 + (int)kvd_rng_below(&r, 2);
		/* Half the angles near pi, where p is tiny and the closed form cancels. */
		double cs = k & 1 ? 2 * kvd_rng_uniform(&r) - 1
				  : -1 + pow(10, -16 * kvd_rng_uniform(&r));
		double got = kvd_lsh_logp(cs, K, L, c);
		double want = logp_binomial(cs, K, L, c);

		if (want > -700) {      /* ln of a normal double */
			double e = fabs(got - want);

			if (e > 1e-10)
				fail_msg("logp(%.17g, K=%d, L=%d, c=%d) = %.17g, binomial sum %.17g",
					 cs, K, L, c, got, want);
			worst_binom = e > worst_binom ? e : worst_binom;
			smallest = want < smallest ? want : smallest;
			nbinom++;
		}

		/* The naive form's error is about L eps (1-P)/P (rounding 1-p, raised
		 * to the L): below 1e-12 for P >= 0.1. */
		double Pn = P_naive(cs, K, L, c);

		if (Pn > 0.1 && Pn < 0.99) {
			double e = fabs(exp(got) - Pn) / Pn;

			if (e > 1e-12)
				fail_msg("logp(%.17g, K=%d, L=%d, c=%d): P %.17g, naive %.17g",
					 cs, K, L, c, exp(got), Pn);
			worst_naive = e > worst_naive ? e : worst_naive;
			nnaive++;
		}
	}
	printf("logp: %d points vs binomial tail sum (ln P down to %.0f): worst |d ln P| %.2g; "
	       "%d points with 0.1 < P < 0.99 vs the naive closed form: worst rel %.2g\n",
	       nbinom, smallest, worst_binom, nnaive, worst_naive);
}

static void test_logp_table(void **state)
{
	static const struct { int K, L, c; double pmin; } prof[] = {
		{ 10, 150, 2, 1e-6 }, { 10, 170, 2, 1e-6 }, { 11, 300, 2, 1e-6 },
		{ 10, 170, 1, 1e-6 }, { 4, 10, 2, 1e-6 },
		/* ln P = ln(1 - theta/pi) is too curved near pi for 4096 linear
		 * pieces: below P ~ 0.02 its error passes 2e-5.  Not a profile anyone
		 * runs (K = L = 1); checked where the bound holds. */
		{ 1, 1, 1, 0.02 },
	};
	struct kvd_rng r = kvd_rng_make(606);
	static struct kvd_logp_tab tab;

	for (size_t g = 0; g < sizeof prof / sizeof prof[0]; g++) {
		int K = prof[g].K, L = prof[g].L, c = prof[g].c;
		double worst = 0, lnmin = log(prof[g].pmin);
		int used = 0;

		kvd_logp_tab_init(&tab, K, L, c);
		assert_int_equal(tab.K, K);
		assert_int_equal(tab.L, L);
		assert_int_equal(tab.c, c);
		assert_true(tab.v[KVD_LOGP_N + 1] == tab.v[KVD_LOGP_N]);
		assert_true(tab.v[KVD_LOGP_N] == KVD_LOGP_FLOOR);       /* theta = pi: P = 0 */
		assert_true(tab.v[0] == (float)kvd_lsh_logp(1.0, K, L, c));
		for (int i = 0; i <= KVD_LOGP_N + 1; i++) {
			assert_true(tab.v[i] >= KVD_LOGP_FLOOR && tab.v[i] <= 0);
			assert_true(i == 0 || tab.v[i] <= tab.v[i - 1]);   /* P falls with theta */
		}
		for (int k = 0; k < 200000; k++) {
			/* Uniform in cos, and uniform in theta to cover both ends. */
			double cs = k & 1 ? 2 * kvd_rng_uniform(&r) - 1 : cos(M_PI * kvd_rng_uniform(&r));
			double want = kvd_lsh_logp(cs, K, L, c);

			if (!(want > lnmin))
				continue;

			/* As the kernels interpolate. */
			double x = acos(cs) * KVD_LOGP_N / M_PI;
			int j = (int)x;

			j = j > KVD_LOGP_N ? KVD_LOGP_N : j;

			double f = x - j, got = tab.v[j] + f * ((double)tab.v[j + 1] - tab.v[j]);
			double e = fabs(got - want);

			if (e > 2e-5)
				fail_msg("K=%d L=%d c=%d cos %.17g: table %.9g, exact %.9g", K, L, c,
					 cs, got, want);
			worst = e > worst ? e : worst;
			used++;
		}
		printf("logp table K=%d L=%d c=%d: %d points with P > %g, worst |error| %.3g\n",
		       K, L, c, used, prof[g].pmin, worst);
	}
}

/* ---- 6. arguments --------------------------------------------------------- */

static void test_bad_arguments(void **state)
{
	static const struct { uint32_t n; int K, L; } bad[] = {
		{ 0, 10, 10 }, { KVD_SEG_MAX + 1, 10, 10 }, { 100, 0, 10 }, { 100, 17, 10 },
		{ 100, -1, 10 }, { 100, 10, 0 }, { 100, 10, KVD_LSH_LMAX + 1 }, { 100, 10, -5 },
	};
	uint16_t codes[4] = { 0 }, out[4], q[4] = { 0 };
	struct kvd_lsh_tables t;
	struct kvd_lsh_scratch s;
	struct built b;

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		assert_int_equal(kvd_lsh_tables_bytes(bad[i].n, bad[i].K, bad[i].L), 0);
		/* Rejected before mem or codes are touched. */
		assert_int_equal(kvd_lsh_build(&t, NULL, bad[i].n, bad[i].K, bad[i].L, codes, 1),
				 -KVD_EGEOM);
	}
	assert_true(kvd_lsh_tables_bytes(KVD_SEG_MAX, KVD_LSH_KMAX, KVD_LSH_LMAX) > 0);
	assert_int_equal(kvd_lsh_scratch_init(&s, 0), -KVD_EGEOM);
	assert_int_equal(kvd_lsh_scratch_init(&s, KVD_SEG_MAX + 1), -KVD_EGEOM);
	kvd_lsh_scratch_free(&s);       /* harmless after a failed init */

	/* A scratch smaller than the segment, or c out of 1..2: nothing. */
	build(&b, 4, 2, 1, codes, 4);
	assert_int_equal(kvd_lsh_scratch_init(&s, 3), 0);
	assert_int_equal(kvd_lsh_candidates(&b.t, q, 1, &s, out), 0);
	kvd_lsh_scratch_free(&s);
	assert_int_equal(kvd_lsh_scratch_init(&s, 4), 0);
	assert_int_equal(kvd_lsh_candidates(&b.t, q, 0, &s, out), 0);
	assert_int_equal(kvd_lsh_candidates(&b.t, q, 3, &s, out), 0);
	assert_int_equal(kvd_lsh_candidates(&b.t, q, 1, &s, out), 4);
	assert_int_equal(kvd_lsh_candidates(&b.t, q, 2, &s, out), 0);    /* c > L */
	assert_scratch_clean(&s);
	kvd_lsh_scratch_free(&s);
	unbuild(&b);
	printf("arguments: n, K, L out of range -> -KVD_EGEOM and 0 bytes; scratch cap 0 and "
	       "65537 -> -KVD_EGEOM\n");
}

/* Tables built in disjoint ranges (as segment sealing does, a few dozen
 * tables per pool task) are byte for byte the tables built in one go. */
static void test_build_in_ranges(void **state)
{
	const uint32_t n = 3000;
	const int K = 9, L = 70;
	uint16_t *codes = malloc((size_t)L * n * sizeof *codes);
	struct built whole;
	struct kvd_lsh_tables t;
	size_t bytes = kvd_lsh_tables_bytes(n, K, L);
	unsigned char *mem = aligned_alloc(64, bytes);
	uint64_t r = 99;
	const uint32_t cut[] = { 0, 1, 2, 31, 32, 40, 69, 70 };

	assert_non_null(codes);
	assert_non_null(mem);
	for (size_t i = 0; i < (size_t)L * n; i++) {
		r = r * 6364136223846793005ull + 1442695040888963407ull;
		/* skewed, with bits above K set: the build masks them */
		codes[i] = (uint16_t)((r >> 33) % 7 == 0 ? 5 : (r >> 40));
	}
	build(&whole, n, K, L, codes, n);
	memset(mem, 0xa5, bytes);       /* as build() fills it: padding compares equal */
	assert_int_equal(kvd_lsh_tables_layout(&t, mem, n, K, L), 0);
	/* Ranges out of order, as workers would finish them. */
	for (int i = (int)(sizeof cut / sizeof cut[0]) - 2; i >= 0; i--)
		kvd_lsh_build_range(&t, codes, n, cut[i], cut[i + 1]);
	assert_memory_equal(mem, whole.mem, bytes);
	free(whole.mem);
	free(mem);
	free(codes);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_tables_match_scan),
		cmocka_unit_test(test_build_in_ranges),
		cmocka_unit_test(test_retrieval_matches_brute_force),
		cmocka_unit_test(test_make_w),
		cmocka_unit_test(test_hash_kernels_and_retrieval),
		cmocka_unit_test(test_probability_monte_carlo),
		cmocka_unit_test(test_logp_formula),
		cmocka_unit_test(test_logp_table),
		cmocka_unit_test(test_bad_arguments),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
