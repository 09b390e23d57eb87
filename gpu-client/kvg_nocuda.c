/* libkvclient built without CUDA (make CUDA=0, or no nvcc/cuBLAS): the
 * backend seam of kvg.h answers "CPU only", and the device API exists (the
 * library's exports do not depend on the build) but fails with -ENOTSUP. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvc.h"
#include "kvg.h"
#include "kvg_plan.h"

int kvg_choose(const struct kvc_opts *o, char *msg, size_t len)
{
	int want = kvg_backend_wanted(o, getenv("KVC_BACKEND"), msg, len);

	if (want == KVC_BACKEND_CUDA) {
		snprintf(msg, len, "no CUDA device: libkvclient was built without CUDA (CUDA=0)");
		return -ENODEV;
	}
	return want == KVC_BACKEND_AUTO ? KVC_BACKEND_CPU : want;
}

int kvg_open(struct kvc *c, const struct kvc_opts *o, void *map, size_t map_size,
	     struct kvg **out)
{
	*out = NULL;
	return kvci_fail(c, -ENODEV, "built without CUDA");
}

void kvg_close(struct kvg *g)
{
}

int kvg_profile(struct kvc *c, struct kvg *g)
{
	return 0;
}

int kvg_seq_init(struct kvc *c, struct kvg *g, struct kvg_seq **out)
{
	*out = NULL;
	return 0;
}

void kvg_seq_free(struct kvc *c, struct kvg *g, struct kvg_seq *s)
{
}

int kvg_prefill_host(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
		     const float *v, uint32_t n)
{
	return kvci_fail(c, -ENOTSUP, "built without CUDA");
}

int kvg_append_host(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
		    const float *v)
{
	return kvci_fail(c, -ENOTSUP, "built without CUDA");
}

int kvg_attend_host(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		    const float *q, float *o, float *lse, int kvd_only)
{
	return kvci_fail(c, -ENOTSUP, "built without CUDA");
}

static int no_dev(struct kvc *c, const char *fn)
{
	return kvci_fail(c, -ENOTSUP, "%s: libkvclient was built without CUDA (CUDA=0)", fn);
}

int kvc_prefill_dev(struct kvc *c, struct kvc_seq *s, uint32_t layer, const void *k,
		    const void *v, uint32_t n, int dtype, void *stream)
{
	return no_dev(c, "kvc_prefill_dev");
}

int kvc_append_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const void *k, const void *v, int dtype, void *stream)
{
	return no_dev(c, "kvc_append_dev");
}

int kvc_attend_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const float *q, float *o, float *lse, void *stream)
{
	return no_dev(c, "kvc_attend_dev");
}

int kvc_attend_kvd_dev(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs,
		       uint32_t nseq, const float *q, float *o, float *lse, void *stream)
{
	return no_dev(c, "kvc_attend_kvd_dev");
}

int kvc_timing(struct kvc *c, struct kvc_timing *t, int reset)
{
	memset(t, 0, sizeof *t);
	return 0;
}
