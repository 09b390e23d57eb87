/* kvd_npy: NumPy .npy files (format versions 1.0, 2.0, 3.0), little-endian
 * float32 ('<f4') or float16 ('<f2'), C order, up to 4 dimensions.  Used by
 * `kvbench attn --trace` to read attention dumped from a real model.
 *
 * kvd_npy_parse() is the decoder of untrusted bytes (fuzzed in
 * tests/fuzz/fuzz_npy.c): it checks magic, version, header length, the dict's
 * keys and values, and that shape * item size fits the bytes available.
 */
#ifndef KVD_NPY_H
#define KVD_NPY_H

#include <stddef.h>
#include <stdint.h>

#define KVD_NPY_MAXDIM 4

struct kvd_npy {
	int itemsize;                   /* 4: float32, 2: float16 */
	int ndim;
	uint64_t shape[KVD_NPY_MAXDIM];
	uint64_t count;                 /* product of shape */
	size_t data_off;                /* offset of the data from the file start */
};

/* Parses the header in buf[0..len); len is the whole file's size, so the
 * data's size is checked too.  0 or -KVD_EFORMAT. */
int kvd_npy_parse(const void *buf, size_t len, struct kvd_npy *out);

/* Reads a whole file and converts it to float32 (*data, malloc'd). */
int kvd_npy_load(const char *path, struct kvd_npy *hdr, float **data);

/* Writes float32 data with the given shape (format 1.0). */
int kvd_npy_save(const char *path, const float *data, int ndim, const uint64_t *shape);

#endif
