#include <string.h>

#include "err.h"

const char *kvd_strerror(int err)
{
	static const char *const own[] = {
		[KVD_EGEOM - KVD_EBASE]   = "geometry out of range",
		[KVD_EFORMAT - KVD_EBASE] = "malformed input",
		[KVD_ESHAPE - KVD_EBASE]  = "array shapes do not agree",
		[KVD_ELOST - KVD_EBASE]   = "sequence lost, prefill again",
		[KVD_EPROTO - KVD_EBASE]  = "protocol violation",
	};
	int e = err < 0 ? -err : err;

	if (e == 0)
		return "success";
	if (e > KVD_EBASE && e < KVD_ELAST)
		return own[e - KVD_EBASE];
	return strerror(e);
}
