/* kvd_lsh: SimHash projection, codes, per-segment bucket tables, candidate
 * retrieval and the collision probability (docs/ARCHITECTURE.md, the estimator).
 *
 * Conventions, shared with the GPU client:
 *  - W is head_dim x (K*L) float32, row-major: W[i*(K*L) + t*K + j] multiplies
 *    coordinate i for bit j of table t.  Element e is kvd_rng_normal_at(seed, e).
 *  - Bit j of table t's code of x is 1 iff x . W[:, t*K+j] > 0 (so 0 and -0 hash
 *    to 0).  Codes are uint16 (K <= 16).
 *  - Key codes are table-major: codes[t*ldc + i] for token i, table t.
 *
 * Tables: for each table t, ids[t*n ..] lists the local token ids of the segment
 * sorted by bucket (stable: ascending id within a bucket), and bucket b holds
 * ids[t*n + off[t*(2^K+1) + b] .. off[t*(2^K+1) + b+1]).  Offsets are uint16
 * taken modulo 2^16; kvd_lsh_bucket() resolves the one ambiguous case (all
 * 65536 tokens of a segment in one bucket) through `full`.
 *
 * Everything here is pure and thread-safe except a kvd_lsh_scratch, which
 * belongs to one thread.
 */
#ifndef KVD_LSH_H
#define KVD_LSH_H

#include <stddef.h>
#include <stdint.h>

#define KVD_LSH_KMAX 16
#define KVD_LSH_LMAX 1024
#define KVD_SEG_MAX  65536u     /* tokens per segment: local ids fit uint16 */

/* Fills W (d * K * L floats) from seed. */
void kvd_lsh_make_w(uint64_t seed, int d, int K, int L, float *W);

/* Codes of n vectors x_i = x + i*ldx (float32, d each) into codes[t*ldc + i],
 * with the kernels chosen by kvd_kern_get(). */
void kvd_lsh_hash(const float *W, int d, int K, int L,
		  const float *x, size_t ldx, size_t n, uint16_t *codes, size_t ldc);

struct kvd_lsh_tables {
	uint32_t n, K, L;
	uint16_t *off;          /* [L][2^K + 1] */
	uint16_t *ids;          /* [L][n] */
	uint32_t *full;         /* [L]: the bucket holding all n ids, or UINT32_MAX */
};

/* Bytes kvd_lsh_build() needs for off + ids + full, each part 64-byte aligned. */
size_t kvd_lsh_tables_bytes(uint32_t n, int K, int L);

/* Lays the tables out in mem (kvd_lsh_tables_bytes() bytes, 64-byte aligned)
 * and builds them by counting sort: O(L * (n + 2^K)).  codes as above.
 * Returns 0, or -KVD_EGEOM when n, K or L are out of range. */
int kvd_lsh_build(struct kvd_lsh_tables *t, void *mem, uint32_t n, int K, int L,
		  const uint16_t *codes, size_t ldc);
/* Builds tables [l0, l1) of tables already laid out (kvd_lsh_tables_layout):
 * disjoint ranges may be built by different threads at once, and building
 * every range is kvd_lsh_build(). */
void kvd_lsh_build_range(const struct kvd_lsh_tables *t, const uint16_t *codes, size_t ldc,
			 uint32_t l0, uint32_t l1);

/* Points t at tables of (n, K, L) already laid out in mem the way
 * kvd_lsh_build() lays them out; reads and writes nothing in mem.  For tables
 * that came from elsewhere (a spill file): check them first.  0, or
 * -KVD_EGEOM when n, K or L are out of range. */
int kvd_lsh_tables_layout(struct kvd_lsh_tables *t, void *mem, uint32_t n, int K, int L);

/* Checks tables laid out in mem (64-byte aligned, kvd_lsh_tables_bytes()
 * bytes) for everything kvd_lsh_build() guarantees and retrieval relies on,
 * in one pass over off and ids: per table, off[0] == 0; bucket b, read as
 * kvd_lsh_bucket() reads it, starts where bucket b-1 ends (modulo 2^16) and
 * the counts add up to exactly n, with off[2^K] == n modulo 2^16; full[t]
 * is the one bucket holding all n ids, or UINT32_MAX when there is none;
 * within a bucket ids are < n and strictly ascending.  Tables that pass can
 * never make kvd_lsh_bucket() / kvd_lsh_candidates() read outside table t's
 * n ids or return an id >= n, and no id is counted twice by one table.
 * (Which bucket an id belongs in is not checkable without the codes: that
 * is the payload CRC's job.)  Pure.  0, -KVD_EFORMAT, -KVD_EGEOM (n, K, L out
 * of range) or -EINVAL (mem not 64-byte aligned). */
int kvd_lsh_tables_check(const void *mem, uint32_t n, int K, int L);

/* Bucket b of table t: sets *ids and returns its length. */
static inline uint32_t kvd_lsh_bucket(const struct kvd_lsh_tables *t, uint32_t tab,
				      uint32_t b, const uint16_t **ids)
{
	const uint16_t *off = t->off + (size_t)tab * ((1u << t->K) + 1);
	uint32_t cnt = (uint16_t)(off[b + 1] - off[b]);

	if (cnt == 0 && t->full[tab] == b)
		cnt = t->n;
	*ids = t->ids + (size_t)tab * t->n + off[b];
	return cnt;
}

/* Per-thread retrieval state, sized for segments of up to `cap` tokens.  The
 * counts are zero between calls. */
struct kvd_lsh_scratch {
	uint32_t cap;
	uint32_t slots;         /* the drain's unrolled slots a word (lsh.c), from the last call */
	uint8_t *cnt;           /* [cap rounded up to 64], 64-byte aligned: tables an id is in */
	uint64_t *bits;         /* [(cap + 63) / 64]: the ids counted c times or more */
	uint64_t *nz;           /* [(cap + 4095) / 4096]: the words of bits not 0 */
};

int kvd_lsh_scratch_init(struct kvd_lsh_scratch *s, uint32_t cap);
void kvd_lsh_scratch_free(struct kvd_lsh_scratch *s);

/* Local ids of the tokens whose code equals qcodes[t] in at least c of the L
 * tables (c is 1 or 2), in ascending order, into out (room for n; entries
 * past the returned count may be overwritten with scratch values).
 * Returns how many; 0 when the segment has more tokens than s->cap or c is
 * not 1 or 2.  Codes are masked to K bits (they come from clients).  Cost:
 * the total length of the L buckets visited, plus n/64 bytes' counts to
 * compare, and the words holding candidates to drain. */
uint32_t kvd_lsh_candidates(const struct kvd_lsh_tables *t, const uint16_t *qcodes,
			    int c, struct kvd_lsh_scratch *s, uint16_t *out);
/* The same over the first nt tables only (1 <= nt <= L; 0 returned
 * otherwise): the candidates of a segment with nt tables, so a sample
 * weighted by P over nt tables (hybrid_lcv's reduced budget). */
uint32_t kvd_lsh_candidates_n(const struct kvd_lsh_tables *t, const uint16_t *qcodes,
			      uint32_t nt, int c, struct kvd_lsh_scratch *s, uint16_t *out);

/* Collision probability of a key at angle theta from the query, exactly as in
 * docs/ARCHITECTURE.md: p = (1 - theta/pi)^K; P(c=1) = 1-(1-p)^L;
 * P(c=2) = 1-(1-p)^L - L p (1-p)^(L-1).  Computed in double with log1p/expm1
 * so small probabilities keep their digits.  Returns ln P (-inf when P = 0). */
double kvd_lsh_logp(double cos_theta, int K, int L, int c);

/* ln P tabulated on theta/pi in [0, 1] for the kernels: v[i] = ln P at
 * theta = pi*i/N, floored at KVD_LOGP_FLOOR, linear interpolation between.
 * The interpolation error is below 2e-5 in ln P wherever P > 1e-6 for the
 * profiles of MagicPIG (measured in tests/unit/test_lsh.c). */
#define KVD_LOGP_N     4096
#define KVD_LOGP_FLOOR (-80.0f)
struct kvd_logp_tab {
	int K, L, c;
	float v[KVD_LOGP_N + 2];        /* v[N+1] = v[N]: lookups at theta = pi stay in range */
};

void kvd_logp_tab_init(struct kvd_logp_tab *tab, int K, int L, int c);

#endif
