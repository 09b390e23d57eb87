/* kvd_seg: a sealed segment of one layer, and the geometry it is laid out for.
 *
 * A segment holds n <= KVD_SEG_MAX tokens of every kv head of one layer:
 * centered K and V rows (bf16, or int8 with scales), 1/|k| (f32) and the L
 * bucket tables.  It is immutable once built and may be read by any number
 * of threads.  It lives in an io buffer laid out as one spill extent
 * (kvd/store/sfmt.h): a KVD_SEG_IO_PAGE header page, then the kvd_seg_bytes()
 * payload padded to a multiple of the page, 4096-aligned, so spilling it and
 * reading it back (O_DIRECT) need no copy, and a segment read back is
 * adopted in place after kvd_seg_check().
 *
 * One module owns the layout so that build, check, adopt and the byte count
 * cannot disagree; attention (engine/attn.h) only reads segments.
 */
#ifndef KVD_SEG_H
#define KVD_SEG_H

#include <stddef.h>
#include <stdint.h>

#include "kern.h"
#include "lsh.h"

struct kvd_pool;

#define KVD_QHEADS_MAX 1024

/* How a segment stores K and V.  The open tail and everything a client
 * sends stay bf16; int8 is made when a segment is sealed. */
enum kvd_kv_dtype {
	KVD_KV_BF16 = 0,
	KVD_KV_INT8 = 1,
};
#define KVD_KV_DTYPE_MAX KVD_KV_INT8

struct kvd_geom {
	uint32_t q_heads, kv_heads, d;  /* d: head_dim, multiple of 16, <= KVD_DMAX */
	uint32_t K, L, c;               /* K <= 16 bits, L tables, c in {1, 2} */
	uint32_t kv_dtype;              /* enum kvd_kv_dtype; 0 (bf16) when left out */
	uint32_t moments;               /* 1: segments keep hybrid_lcv's moments
					 * (kvd_seg_head.ksum, kv); a profile sets it
					 * from its estimator, never the wire */
};

/* "bf16" / "int8"; NULL for an unknown value.  kvd_kv_dtype_parse: 0 and
 * *out, or -EINVAL. */
const char *kvd_kv_dtype_name(uint32_t dt);
int kvd_kv_dtype_parse(const char *s, uint32_t *out);

/* 0, or -KVD_EGEOM when a field is out of range (q_heads <= KVD_QHEADS_MAX)
 * or q_heads / kv_heads is not an integer <= KVD_GMAX. */
int kvd_geom_check(const struct kvd_geom *g);
static inline uint32_t kvd_geom_group(const struct kvd_geom *g)
{
	return g->q_heads / g->kv_heads;
}

/* An int8 row's three floats, side by side so that a gathered row costs one
 * line for them, not three.  kinv is 1/|k| of the dequantized key, the key
 * that is scored. */
struct kvd_row8 {
	float kinv, kfac, vscale;
};

/* bf16 segments set k, v and kinv; int8 segments set k8, v8, kscale and r8
 * instead, with key e of row i = r8[i].kfac * kscale[e] * k8[i][e] (a scale
 * per channel per segment head, from a power of the channel's range searched
 * per head: centered keys have outlier channels, and a per-token scale alone
 * would let them crush every other channel; then a per-row least-squares
 * factor) and value e of row i = r8[i].vscale * v8[i][e]. */
struct kvd_seg_head {
	uint16_t *k, *v;                /* [n][d] bf16 */
	float *kinv;                    /* [n] bf16: 1/|k| */
	int8_t *k8, *v8;                /* [n][d] int8 */
	float *kscale;                  /* [d] */
	struct kvd_row8 *r8;            /* [n] */
	struct kvd_lsh_tables tab;
	float *vsum;                    /* [d]: the sum of the head's V rows as attention
					 * reads them (int8: dequantized), for the control
					 * variate (engine/attn.h); kept beside the segment,
					 * not in its payload */
	float *ksum;                    /* [d]: the sum of the keys as scored */
	int8_t *kv;                     /* [d][d]: the centered cross moment
					 * C[f][e] = sum_i (k_i[f] - ksum[f]/n) v_i[e],
					 * keys and values as attention reads them, as
					 * kv[f*d + e] * kv_row[f] * kv_col[e] */
	float *kv_row, *kv_col;         /* [d] each; ksum, kv and its scales are
					 * hybrid_lcv's moments, in the io buffer
					 * after the payload, never in a file */
};

struct kvd_seg {
	uint32_t n, kv_heads, d, K, L, kv_dtype;
	size_t bytes;                   /* the io buffer: what this segment keeps resident */
	uint32_t refs;                  /* holders (sequences sharing it after a fork):
					 * kvd_seg_ref adds one, kvd_seg_free drops one
					 * and frees with the last.  The owner's thread
					 * only (the daemon's loop). */
	uint32_t chg_uid, chg_node;     /* the store's: who pays for it (once, whoever
					 * holds it) and where it lives */
	uint32_t wbusy;                 /* the tier's: a file write uses its header page
					 * (a shared segment goes in one file at a time) */
	double tables_ms;               /* time kvd_seg_build spent on the tables */
	void *io;                       /* the io buffer: header page, then mem */
	void *mem;                      /* io + KVD_SEG_IO_PAGE: kvd_seg_bytes() of payload */
	struct kvd_seg_head h[];        /* [kv_heads] */
};

/* Builds a segment from centered rows k, v ([kv_heads][n][d] bf16) and the
 * keys' codes ([kv_heads][L][n]); copies (or, for g->kv_dtype int8,
 * quantizes) everything it keeps.  Quantization is round to nearest with
 * scales from the largest finite |x| (of a row for values; for keys, the
 * channels' ranges to the power, of 1, 3/4, 1/2, 1/4 and 0, that rounds a
 * sample of the head's rows closest, then each row's own); infinities
 * saturate and NaN becomes -127, so every scale and 1/|k| of a built segment
 * is finite and kvd_seg_check accepts it.  Work is split
 * over the pool (NULL: the calling thread).  0, -KVD_EGEOM, -ENOMEM. */
int kvd_seg_build(const struct kvd_geom *g, uint32_t n, const uint16_t *k,
		  const uint16_t *v, const uint16_t *codes, struct kvd_pool *pool,
		  struct kvd_seg **out);
/* The same with its memory on NUMA node `node` (kvd_mem_alloc_node; -1: no
 * preference), from rows `ld` (>= n) apart: k and v [H][ld][d], codes
 * [H][L][ld], the first n rows of each used.  A partly filled buffer is
 * sealed where it lies: compacting it in place first was a copy of up to a
 * segment that no pool task could cut short.  Pass a pool whose workers run
 * on that node. */
int kvd_seg_build_node(const struct kvd_geom *g, uint32_t n, uint32_t ld, const uint16_t *k,
		       const uint16_t *v, const uint16_t *codes, struct kvd_pool *pool, int node,
		       struct kvd_seg **out);
/* Drops a reference (a built or adopted segment has one); the last frees. */
void kvd_seg_free(struct kvd_seg *s);
static inline struct kvd_seg *kvd_seg_ref(struct kvd_seg *s)
{
	s->refs++;
	return s;
}
/* A build is split into per-head pool tasks run with kvd_pool_run_sliced():
 * a thread with a yield hook (kvd_pool_set_yield) answers other requests
 * between its slices. */

/* Bytes of a segment's payload (rows, scales, 1/|k|, tables of every kv head), as
 * kvd_seg_build lays it out; a SEG extent's payload_bytes. */
size_t kvd_seg_bytes(const struct kvd_geom *g, uint32_t n);

/* Segment io buffers.  Of g only kv_heads, d, K, L and kv_dtype count (q_heads and c
 * are not part of a segment), each range-checked as by kvd_geom_check.
 *
 * kvd_seg_io_bytes: KVD_SEG_IO_PAGE + kvd_seg_bytes() rounded up to the
 * page, what a segment keeps resident (its `bytes`) and its extent_bytes on
 * disk; 0 when g or n (1..KVD_SEG_MAX) is out of range.
 * kvd_seg_io_alloc: a zero-filled, 4096-aligned buffer of that size (huge
 * pages from KVD_MEM_HUGE up, as kvd_mem_alloc), its size in *bytes; NULL
 * on a bad geometry or without memory.  Free with kvd_seg_io_free, or hand
 * it to kvd_seg_adopt. */
#define KVD_SEG_IO_PAGE 4096u
size_t kvd_seg_io_bytes(const struct kvd_geom *g, uint32_t n);
void *kvd_seg_io_alloc(const struct kvd_geom *g, uint32_t n, size_t *bytes);
void *kvd_seg_io_alloc_node(const struct kvd_geom *g, uint32_t n, int node, size_t *bytes);
void kvd_seg_io_free(void *io, size_t bytes);

/* Checks a segment payload of n tokens at mem (64-byte aligned,
 * kvd_seg_bytes() bytes) that did not come from kvd_seg_build -- a spill
 * file: for every kv head, 1/|k| and (int8) the scales are finite and >= 0
 * (what a build computes) and the L tables pass kvd_lsh_tables_check().  A segment that
 * passes can never make retrieval or the kernels read outside its own rows
 * and tables, whatever its bytes.  One pass over the tables; pure and
 * thread-safe.  0, -KVD_EFORMAT, or -KVD_EGEOM / -EINVAL (bad g, n or
 * alignment: a caller's bug). */
int kvd_seg_check(const struct kvd_geom *g, uint32_t n, const void *mem);

/* Rewrites an int8 payload written before spill format 4 (three float
 * arrays vscale, kfac, kinv per head where kvd_row8 [n] now lies, in the
 * same room) into the current layout, in place; nothing for bf16.  Call it
 * once per buffer, before kvd_seg_check.  0, -ENOMEM, or -KVD_EGEOM. */
int kvd_seg_upgrade_r8(const struct kvd_geom *g, uint32_t n, void *mem);

/* Wraps an io buffer from kvd_seg_io_alloc(g, n, &bytes) whose payload
 * passed kvd_seg_check() into a segment: head pointers exactly as
 * kvd_seg_build sets them, nothing copied or recomputed but the sums beside
 * it (tables_ms is 0).  vsum: from kvd_seg_sums on this io, or NULL to
 * compute them all here.
 * On success the segment owns io (kvd_seg_free frees it); on failure the
 * caller still does.  0, -KVD_EGEOM, -EINVAL (bytes is not
 * kvd_seg_io_bytes(g, n) or io is not 4096-aligned), -ENOMEM. */
int kvd_seg_adopt(const struct kvd_geom *g, uint32_t n, void *io, size_t bytes,
		  const float *vsum, struct kvd_seg **out);

/* The sums kept beside a payload that passed kvd_seg_check, in an io buffer
 * from kvd_seg_io_alloc: the V sums of every kv head into vsum
 * ([kv_heads][d], as kvd_seg_head.vsum), summed in double in row order, and
 * the moments (kvd_seg_head.ksum, kv) into io past the payload.  About d*d
 * FMAs a row, which kvd_seg_adopt makes itself when given no vsum (a
 * restore makes them on the spill thread instead, off the daemon's lock).
 * The same bits as kvd_seg_build's.  Thread-safe; 0 or -ENOMEM. */
int kvd_seg_sums(const struct kvd_geom *g, uint32_t n, void *io, float *vsum);

#endif
