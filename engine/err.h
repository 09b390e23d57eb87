/* kvd error codes.
 *
 * Every fallible function returns 0 (or a count) on success and a negative
 * value on failure: -errno for system errors, or -KVD_E* for kvd's own,
 * which live in one reserved range above every errno.  kvd_strerror()
 * describes both.  Thread-safe; the strings are static.
 */
#ifndef KVD_ERR_H
#define KVD_ERR_H

enum {
	KVD_EBASE = 4096,
	KVD_EGEOM,      /* a geometry field (heads, head_dim, K, L, c) out of range */
	KVD_EFORMAT,    /* a file or message does not parse */
	KVD_ESHAPE,     /* arrays whose shapes do not agree */
	KVD_ELOST,      /* sequence lost, prefill again */
	KVD_EPROTO,     /* protocol violation by a peer */
	KVD_ELAST
};

const char *kvd_strerror(int err);

#endif
