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
#include "kvt.h"

int kvg_choose(const struct kvc_opts *o, char *msg, size_t len)
{
	int want = kvg_backend_wanted(o, getenv("KVC_BACKEND"), msg, len);

	if (want == KVC_BACKEND_CUDA) {
		snprintf(msg, len, "no CUDA device: libkvclient was built without CUDA (CUDA=0)");
		return -ENODEV;
	}
	return want == KVC_BACKEND_AUTO ? KVC_BACKEND_CPU : want;
}

int kvg_open(struct kvt *t, const struct kvc_opts *o, struct kvg **out)
{
	*out = NULL;
	return kvt_fail(t, -ENODEV, "built without CUDA");
}

void kvg_close(struct kvg *g)
{
}

int kvg_profile(struct kvt *t, struct kvg *g)
{
	return 0;
}

void kvg_seq_free(struct kvt *t, struct kvg *g, struct kvg_seq *s)
{
}

int kvg_seq_fork(struct kvt *t, struct kvg *g, const struct kvc_seq *parent,
		 struct kvc_seq *child)
{
	return -ENOTSUP;
}

int kvg_seq_publish(struct kvt *t, struct kvg *g, struct kvc_seq *s, const uint8_t *key)
{
	return kvt_fail(t, -ENOTSUP, "built without CUDA");
}

int kvg_seq_attached(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint64_t tokens,
		     const uint32_t *rows)
{
	return kvt_fail(t, -ENOTSUP, "built without CUDA");
}

uint64_t kvg_layer_tokens(const struct kvc_seq *s, uint32_t layer)
{
	return 0;
}

int kvg_layer_prefilled(const struct kvc_seq *s, uint32_t layer)
{
	return 0;
}

int kvg_prefill_host(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		     const float *k, const float *v, uint32_t n)
{
	return kvt_fail(t, -ENOTSUP, "built without CUDA");
}

int kvg_append_host(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		    const float *k, const float *v)
{
	return kvt_fail(t, -ENOTSUP, "built without CUDA");
}

int kvg_attend_host(struct kvt *t, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		    uint32_t nseq, const float *q, float *o, float *lse, int kvd_only)
{
	return kvt_fail(t, -ENOTSUP, "built without CUDA");
}

static int no_dev(struct kvt *t, const char *fn)
{
	return kvt_fail(t, -ENOTSUP, "%s: libkvclient was built without CUDA (CUDA=0)", fn);
}

int kvg_prefill_dev(struct kvt *t, struct kvg *g, struct kvc_seq *s, uint32_t layer,
		    const void *k, const void *v, uint32_t n, int dtype, void *stream)
{
	return no_dev(t, "kvc_prefill_dev");
}

int kvg_append_dev(struct kvt *t, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		   uint32_t nseq, const void *k, const void *v, int dtype, void *stream)
{
	return no_dev(t, "kvc_append_dev");
}

int kvg_attend_dev(struct kvt *t, struct kvg *g, uint32_t layer, struct kvc_seq *const *seqs,
		   uint32_t nseq, const float *q, float *o, float *lse, int kvd_only,
		   void *stream)
{
	return no_dev(t, kvd_only ? "kvc_attend_kvd_dev" : "kvc_attend_dev");
}

int kvg_timing(struct kvt *t, struct kvg *g, struct kvc_timing *tm, int reset)
{
	memset(tm, 0, sizeof *tm);
	return 0;
}
