/* kvd_sfmt: the on-disk format of a spilled sequence.
 *
 * One file holds one sequence as a run of extents.  An extent is a 4096-byte
 * header page followed by its payload, padded to a multiple of 4096, so every
 * extent starts and ends 4 KiB aligned and an O_DIRECT read puts it straight
 * back into the RAM buffer it was written from (a segment's buffer begins
 * with its header page: kvd_seg_io_alloc()).
 *
 * Extent order in a file: PROFILE (the profile's fields and W, so the file
 * describes itself), then for every sparse layer in layer order one LAYER
 * extent (centering mean and the open tail), that layer's HEAVY extent (its
 * estimator state, when it has one) and its SEG extents, then one LOCAL
 * extent per layer whose client rows kvd keeps (a published prefix's sinks,
 * window and dense layers: kvd/store/share.h), a PUB extent when the
 * sequence is a published prefix, and last an END extent.  A file without
 * a valid END is not complete.
 *
 * Integrity: `crc` is CRC32C (ISA-L) of the payload; `hdr_crc` is CRC32C of
 * the header struct with hdr_crc zero, so it covers `crc` too and the two
 * together cover header and payload.  A start-up scan reads headers only
 * (hdr_crc); a restore checks payloads (crc, and a SEG's table structure).
 * All integers little-endian; the struct below is the disk format.  Only
 * the struct at the start of the header page is read; the rest of the page
 * and the padding after a payload carry nothing (write zeros: segment io
 * buffers come zero-filled) and are never checked.
 *
 * CRC32C is the standard one (iSCSI, ext4, `crc32c` tools): initial value
 * and final xor 0xffffffff, so the CRC of "123456789" is 0xe3069283 and of
 * nothing is 0 (kvd_sfmt_crc32c).
 *
 * Header fields by kind (kvd_sfmt_check_hdr enforces them):
 *   all      geometry (kv_heads, d, K, L) valid as kvd_geom_check wants it;
 *            END may instead leave all four 0.  flags 0 except LAYER's and
 *            SEG's.
 *            tenant NUL-terminated, printable ASCII.
 *   PROFILE  index 0; payload_bytes within what a profile of that geometry
 *            can take (exact only once the record is read).
 *   LAYER    layer < KVD_PROFILE_LAYERS_MAX; n <= KVD_SEG_MAX tail rows and
 *            tok_end - tok_begin == n; flags within KVD_SFMT_LF_*.
 *   SEG      layer < KVD_PROFILE_LAYERS_MAX; n in 1..KVD_SEG_MAX and
 *            tok_end - tok_begin == n; flags within KVD_SFMT_SF_* (none in
 *            a version 1 file).
 *
 * Versions: 5 added HEAVY extents (files without them read unchanged: the
 * sequence comes back with empty lists, as it did then);
 * 4 put an int8 segment's three per-row floats side by side
 * (struct kvd_row8, in the room of the three arrays before it; older int8
 * segments are rewritten as they are read, bf16 ones read unchanged);
 * 3 added LOCAL extents (files without them read unchanged);
 * 2 added int8 segments (KVD_SFMT_SF_INT8, the PROFILE record's
 * kv_dtype).  Version 1 files, all bf16, read unchanged: their SEG flags and
 * the field that is now kv_dtype were 0.  kvd writes version 5.  The
 * PROFILE record's estimator took the first 4 of its reserved bytes without
 * a new version: files written before it have 0 there (magicpig), which is
 * what their profiles were.
 *   LOCAL    version >= 3; layer < KVD_PROFILE_LAYERS_MAX; n in
 *            1..KVD_SFMT_LOCAL_MAX rows; payload K then V, bf16
 *            [kv_heads][n][d] each, each part 64-byte aligned
 *            (kvd_sfmt_local_bytes).
 *   PUB      version >= 3; no payload; layer 0, n >= 1 the prefix's tokens,
 *            and the 16-byte content key it is published under in
 *            tok_begin (bytes 0..7) and tok_end (8..15), little-endian
 *            (kvd_sfmt_pub_key), all covered by hdr_crc.
 *   HEAVY    version >= 5; layer < KVD_PROFILE_LAYERS_MAX; n the q heads, a
 *            multiple of kv_heads that kvd_geom_check takes; payload_bytes
 *            exactly kvd_heavy_words() of that geometry * 4; tok_begin and
 *            tok_end 0.  The payload is the layer's state as the engine
 *            keeps it (engine/attn.h): only its size and crc are checked,
 *            since any words there are safe (a count is clamped, an entry
 *            that names no row is ignored).
 *   END      payload_bytes 0; n == index.
 * Fields a kind does not mention are not checked (seq, gen, profile_fp:
 * the reader compares them with what it expects).
 *
 * Pure functions, safe from any thread.  Errors: -KVD_EFORMAT with a reason
 * in msg (when msg is not NULL).
 */
#ifndef KVD_SFMT_H
#define KVD_SFMT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/seg.h"
#include "store.h"

#define KVD_SFMT_PAGE 4096u
#define KVD_SFMT_VERSION 5u
#define KVD_SFMT_VERSION_MIN 1u
#define KVD_SFMT_MAGIC "KVDSPILL"       /* 8 bytes, no NUL on disk */

enum kvd_sfmt_kind {
	KVD_SFMT_PROFILE = 1,
	KVD_SFMT_LAYER = 2,
	KVD_SFMT_SEG = 3,
	KVD_SFMT_END = 4,
	KVD_SFMT_LOCAL = 5,             /* version 3: a layer's client rows (prefix sharing) */
	KVD_SFMT_PUB = 6,               /* version 3: the file is a published prefix */
	KVD_SFMT_HEAVY = 7,             /* version 5: a layer's estimator state */
};

#define KVD_SFMT_LF_MEAN 0x1            /* LAYER: the payload starts with the mean */
#define KVD_SFMT_LF_SEALED 0x2          /* LAYER: prefill of this layer finished */
#define KVD_SFMT_SF_INT8 0x1            /* SEG: int8 rows and scales (kvd_seg_head) */

struct kvd_sfmt_hdr {
	char magic[8];                  /* KVD_SFMT_MAGIC */
	uint32_t version;               /* KVD_SFMT_VERSION */
	uint32_t kind;                  /* enum kvd_sfmt_kind */
	uint64_t payload_bytes;         /* bytes after the header page that carry data */
	uint64_t extent_bytes;          /* PAGE + payload_bytes rounded up to PAGE */
	uint64_t seq;                   /* sequence id (all extents of a file) */
	uint64_t gen;                   /* spill generation (all extents of a file) */
	uint64_t profile_fp;            /* kvd_sfmt_profile_fp() of the profile */
	uint64_t tok_begin, tok_end;    /* SEG: its tokens within the layer; LAYER: the tail's */
	uint32_t index;                 /* position of this extent in the file */
	uint32_t layer;                 /* LAYER, SEG */
	uint32_t kv_heads, d, K, L;     /* geometry the payload is laid out for */
	uint32_t n;                     /* SEG: tokens; LAYER: tail rows; HEAVY: q heads;
					 * END: extents before it */
	uint32_t flags;                 /* LAYER: KVD_SFMT_LF_* */
	char tenant[72];                /* NUL-terminated, <= KVD_NAME_MAX chars */
	uint32_t crc;                   /* CRC32C of payload_bytes of payload */
	uint32_t hdr_crc;               /* CRC32C of this struct with hdr_crc = 0 */
};

/* PAGE + payload rounded up to PAGE; 0 when that does not fit 64 bits. */
uint64_t kvd_sfmt_extent_bytes(uint64_t payload_bytes);

/* CRC32C of len bytes (the convention above); p may be NULL when len is 0. */
uint32_t kvd_sfmt_crc32c(const void *p, uint64_t len);

/* xxHash64 (XXH3_64bits) of everything that defines a profile except its id:
 * name, geometry, layers, sink, window, seg/seal tokens, seed, the dense map
 * and W.  Equal profiles in two daemon lifetimes hash equal.  Precisely:
 * XXH3_64bits of the PROFILE payload without its padding, i.e. of the
 * record, dense[layers] (each 0 or 1) and W, so it can be checked on the
 * payload itself (kvd_sfmt_check_payload does). */
uint64_t kvd_sfmt_profile_fp(const struct kvd_profile *p);

/* Payload layouts.
 * PROFILE: a fixed 256-byte record of the fields, dense[layers] as bytes
 *   padded to 64, then W [d][K*L] f32.
 * LAYER: mean [kv][d] f32 (when KVD_SFMT_LF_MEAN), then tail K [kv][n][d]
 *   bf16, tail V, tail codes [kv][L][n] u16; each part 64-byte aligned.
 * SEG: the segment's memory exactly as kvd_seg_build lays it out
 *   (kvd_seg_bytes(g, n) bytes).
 * HEAVY: kvd_heavy_words(g) u32, per q head a count then KVD_HEAVY_MAX
 *   entries (segment << 16 | row), as kvd_store_layer_heavy holds them.
 * END: none. */
#define KVD_SFMT_PROFILE_REC 256u

/* The PROFILE record.  Canonical: the name is zero-padded, reserved bytes
 * are zero, so equal profiles give equal bytes (and equal fingerprints). */
struct kvd_sfmt_profile_rec {
	char name[72];                  /* 1..KVD_NAME_MAX printable chars, NUL-padded */
	uint32_t q_heads, kv_heads, d, K, L, c;
	uint32_t layers, sink, window, seg_tokens, seal_tokens;
	uint32_t kv_dtype;              /* enum kvd_kv_dtype (0 before version 2) */
	uint64_t seed;
	uint32_t estimator;             /* enum kvd_estimator (0, magicpig, in files
					 * written before it: it was reserved) */
	uint32_t chunk_tokens;          /* 0: kvd_store_chunk_default(seal_tokens), as in
					 * files written before it (reserved then) */
	uint8_t reserved[120];          /* 0 */
};

uint64_t kvd_sfmt_profile_bytes(const struct kvd_profile *p);
/* Writes kvd_sfmt_profile_bytes(p) bytes (padding zeroed, dense[] as 0/1).
 * payload needs no alignment. */
void kvd_sfmt_profile_put(const struct kvd_profile *p, void *payload);
/* Fills *out from a PROFILE payload, validating every field (kvd_geom_check
 * and a profile's limits in store.h, KVD_PROFILE_*: name, layers,
 * sink/window, seg/seal tokens, as a request's), the record's canonical form, dense[] of 0/1
 * with zero padding, bytes exactly kvd_sfmt_profile_bytes(), and W finite;
 * out->dense and out->W are malloc'd, out->tab is NULL and out->id is 0.
 * payload needs no alignment.  0 or -KVD_EFORMAT / -ENOMEM. */
int kvd_sfmt_profile_get(const void *payload, uint64_t bytes, struct kvd_profile *out,
			 char *msg, size_t msglen);

uint64_t kvd_sfmt_layer_bytes(const struct kvd_geom *g, uint32_t n, int mean);
/* A LOCAL payload of n rows: K at 0, V at half of it (each part the same size). */
#define KVD_SFMT_LOCAL_MAX (1u << 24)
uint64_t kvd_sfmt_local_bytes(const struct kvd_geom *g, uint32_t n);
/* A HEAVY payload for q_heads q heads (kvd_heavy_words * 4). */
uint64_t kvd_sfmt_heavy_bytes(uint32_t q_heads);
/* A PUB extent's key: to the header's two fields, and back. */
void kvd_sfmt_pub_key_put(struct kvd_sfmt_hdr *h, const uint8_t *key);
void kvd_sfmt_pub_key(const struct kvd_sfmt_hdr *h, uint8_t *key);
/* Pointers into a LAYER payload laid out for (g, n, mean); mean is NULL when
 * absent. */
void kvd_sfmt_layer_parts(const struct kvd_geom *g, uint32_t n, int mean, void *payload,
			  float **m, uint16_t **k, uint16_t **v, uint16_t **codes);

/* The extent writer: the one place a header is filled, so the writers of
 * files (kvd/store/tier.c, bench/spill.c, the tests) cannot disagree on which
 * fields a kind carries.
 *
 * kvd_sfmt_file: what every extent of one file shares.  profile_fp is
 * kvd_sfmt_profile_fp(p), passed in because it hashes W (once per file,
 * not per extent).  kvd_sfmt_ext: what differs per extent; tok_end is
 * always tok_begin + n, an END's n is its index, a HEAVY's n is
 * p->g.q_heads (e->n is not read), a SEG's flags come from p->g.kv_dtype
 * and only a LAYER takes `flags` (KVD_SFMT_LF_*). */
struct kvd_sfmt_file {
	const struct kvd_profile *p;
	uint64_t seq, gen, profile_fp;
	const char *tenant;
};

struct kvd_sfmt_ext {
	uint32_t kind;                  /* enum kvd_sfmt_kind */
	uint32_t index;                 /* position in the file */
	uint32_t layer;                 /* LAYER, SEG, HEAVY, LOCAL */
	uint32_t n;                     /* LAYER: tail rows; SEG: tokens */
	uint32_t flags;                 /* LAYER: KVD_SFMT_LF_* */
	uint64_t tok_begin;             /* LAYER, SEG */
};

/* payload_bytes of extent e: the PROFILE payload of f->p, a LAYER of n
 * tail rows (with the mean when KVD_SFMT_LF_MEAN), a SEG of n tokens, a
 * HEAVY of f->p's q heads, or 0 for END (PUB too).  Size the extent's
 * buffer with kvd_sfmt_extent_bytes() of it. */
uint64_t kvd_sfmt_ext_payload(const struct kvd_sfmt_file *f, const struct kvd_sfmt_ext *e);

/* Zeroes *h and fills every field of extent e of file f except magic,
 * version, extent_bytes and the CRCs, which kvd_sfmt_seal adds once the
 * payload is in place (the spill engine seals each WRITE extent itself, on
 * its own thread, so writers that go through it do not). */
void kvd_sfmt_hdr_fill(struct kvd_sfmt_hdr *h, const struct kvd_sfmt_file *f,
		       const struct kvd_sfmt_ext *e);

/* The kv_dtype a checked header's payload is laid out for: a SEG's flag;
 * bf16 for every other kind. */
uint32_t kvd_sfmt_seg_dtype(const struct kvd_sfmt_hdr *h);

/* Completes a header kvd_sfmt_hdr_fill (or a test, by hand) filled: writes
 * magic, version, extent_bytes, crc over `payload`, then hdr_crc. */
void kvd_sfmt_seal(struct kvd_sfmt_hdr *h, const void *payload);

/* Checks a header read from disk: magic, version, hdr_crc, kind, sizes
 * consistent with kind and geometry (a SEG's payload_bytes must equal
 * kvd_seg_bytes for its geometry and n; geometry passes kvd_geom_check;
 * tenant NUL-terminated).  Copies it to *out.  len: bytes available at page
 * (at least sizeof(struct kvd_sfmt_hdr) or it fails). */
int kvd_sfmt_check_hdr(const void *page, size_t len, struct kvd_sfmt_hdr *out, char *msg,
		       size_t msglen);

/* Checks a payload against its (already checked) header: crc, and for SEG
 * the structure of every table (kvd_seg_check), so a restored segment can
 * never send a gather outside its rows.  An int8 SEG of a file before
 * version 4 is first rewritten in place into the current layout
 * (kvd_seg_upgrade_r8), once its crc has passed: check each buffer once.  A PROFILE's record must also pass
 * kvd_sfmt_profile_get's checks, match the header's geometry and hash to
 * its profile_fp.  payload: h->payload_bytes bytes, 64-byte aligned for a
 * SEG (where it lies in its io buffer); -EINVAL when it is not. */
int kvd_sfmt_check_payload(const struct kvd_sfmt_hdr *h, void *payload, char *msg,
			   size_t msglen);

#endif
