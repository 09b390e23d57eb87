/* kvd_model: what a profile says about a model, as C.  The daemon's store
 * keeps one in each struct kvd_profile (kvd/store/store.h), libkvclient one
 * per connection; the control codec converts it to and from the wire's
 * Profile (kvd_ctl_profile_get / _put, proto/ctl.h), so that the field list
 * is written once.  Dense layers stay beside it: the store keeps them as a
 * byte per layer, the wire and libkvclient as a list.
 *
 * KVD_MODEL_FIELDS is the member list, so that a struct can hold the same
 * members by name and as one struct kvd_model in a union (store.h):
 * p->layers and p->model.layers are one object.
 */
#ifndef KVD_MODEL_H
#define KVD_MODEL_H

#include <stdint.h>

#include "seg.h"

#define KVD_MODEL_NAME_MAX 64

/* name: 1..KVD_MODEL_NAME_MAX printable bytes; g: the geometry, kv_dtype
 * included; tokens kept beside the sampled part (sink, window); segment and
 * seal sizes and the content-key chunk (0 in a request: the defaults); the
 * seed of W; estimator: enum kvd_estimator (engine/attn.h). */
#define KVD_MODEL_FIELDS                                                        \
	char name[KVD_MODEL_NAME_MAX + 1];                                      \
	struct kvd_geom g;                                                      \
	uint32_t layers, sink, window, seg_tokens, seal_tokens;                 \
	uint32_t chunk_tokens;                                                  \
	uint64_t seed;                                                          \
	uint32_t estimator;

struct kvd_model {
	KVD_MODEL_FIELDS
};

#endif
