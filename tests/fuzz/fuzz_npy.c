/* libFuzzer target for kvd_npy_parse(), the decoder of untrusted .npy bytes.
 *
 * The input is the whole file.  On success the claimed data range is read
 * end to end, so a wrong bound shows up as an ASan report rather than as a
 * silent overread in kvbench later; the header fields are cross-checked
 * against each other for the same reason.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "engine/err.h"
#include "engine/npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t len);

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t len)
{
	struct kvd_npy h;
	uint64_t count = 1, bytes;
	volatile uint8_t sink;
	uint8_t acc = 0;
	int rc = kvd_npy_parse(buf, len, &h);

	if (rc) {
		if (rc != -KVD_EFORMAT)
			abort();
		return 0;
	}
	if ((h.itemsize != 2 && h.itemsize != 4) || h.ndim < 1 || h.ndim > KVD_NPY_MAXDIM)
		abort();
	for (int i = 0; i < h.ndim; i++) {
		if (h.shape[i] == 0 || __builtin_mul_overflow(count, h.shape[i], &count))
			abort();
	}
	if (count != h.count || __builtin_mul_overflow(count, (uint64_t)h.itemsize, &bytes) ||
	    h.data_off > len || bytes > len - h.data_off)
		abort();
	for (uint64_t i = 0; i < bytes; i++)
		acc += buf[h.data_off + i];
	sink = acc;
	(void)sink;
	return 0;
}
