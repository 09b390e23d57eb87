/* libFuzzer target for the control-plane decoders, kvd_ctl_decode_request()
 * (the daemon's, fed by any local process) and kvd_ctl_decode_response()
 * (the client's).
 *
 * Byte 0 picks: bit 0 clear, the rest is a Request; set, a Response, with
 * want_id = byte 0 >> 1 (0..127, a one-byte varint the fuzzer finds easily).
 * What the decoders promise is then checked, so a validation hole shows as
 * an abort rather than passing quietly: a refusal carries a negative code
 * and a message; an accepted profile has a valid geometry, dense layers
 * below `layers` and W of the size it claims; an error message is short
 * and printable.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "ctl.h"
#include "err.h"

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t len);

static void check_profile(const Kvd__Profile *p, int filled)
{
	struct kvd_geom g;

	if (kvd_ctl_check_profile(p, filled, NULL) || kvd_ctl_profile_to_geom(p, &g) ||
	    !kvd_ctl_profile_equal(p, p) || strlen(p->name) > KVD_CTL_NAME_MAX ||
	    p->n_dense_layers > p->layers)
		abort();
	for (size_t i = 0; i < p->n_dense_layers; i++) {
		if (p->dense_layers[i] >= p->layers)
			abort();
	}
}

static void request(const uint8_t *buf, size_t len)
{
	struct kvd_ctl_err e;
	Kvd__Request *r = kvd_ctl_decode_request(buf, len, &e);

	if (!r) {
		if (e.code >= 0 || !e.msg[0])
			abort();
		return;
	}
	if (e.code)
		abort();
	switch (r->body_case) {
	case KVD__REQUEST__BODY_HELLO:
		if (r->hello->version != KVD_CTL_VERSION || r->hello->slots > KVD_CTL_SLOTS_MAX ||
		    r->hello->slot_size % 4096 || r->hello->slot_size > KVD_CTL_SLOT_MAX ||
		    strlen(r->hello->tenant) > KVD_CTL_NAME_MAX)
			abort();
		break;
	case KVD__REQUEST__BODY_PROFILE_CREATE: {
		Kvd__Profile *p = r->profile_create->profile;

		check_profile(p, 0);
		kvd_ctl_profile_defaults(p);
		check_profile(p, 1);
		break;
	}
	case KVD__REQUEST__BODY_SEQ_CREATE:
		if (!r->seq_create->profile_id || r->seq_create->content_key.len > KVD_CTL_KEY_MAX)
			abort();
		break;
	case KVD__REQUEST__BODY__NOT_SET:
		abort();
	default:
		break;
	}
	kvd_ctl_free_request(r);
}

static void response(const uint8_t *buf, size_t len, uint64_t want)
{
	struct kvd_ctl_err e;
	Kvd__Response *r = kvd_ctl_decode_response(buf, len, want, &e);

	if (!r) {
		if (e.code >= 0 || !e.msg[0])
			abort();
		return;
	}
	if (e.code || (r->id != want && r->body_case != KVD__RESPONSE__BODY_ERROR))
		abort();
	switch (r->body_case) {
	case KVD__RESPONSE__BODY_ERROR:
		if (r->error->code >= 0 || strlen(r->error->message) >= KVD_CTL_MSG_MAX)
			abort();
		for (const char *s = r->error->message; *s; s++) {
			if (*s < 0x20 || *s > 0x7e)
				abort();
		}
		break;
	case KVD__RESPONSE__BODY_PROFILE: {
		const Kvd__Profile *p = r->profile->profile;
		size_t n;

		check_profile(p, 1);
		n = (size_t)p->head_dim * p->k_bits * p->tables;
		/* W from the seed costs n normals: only for small geometries. */
		if (n <= 4096 || r->profile->w.len) {
			float *W = malloc(n * sizeof(float));

			if (!W || kvd_ctl_profile_w(r->profile, W))
				abort();
			free(W);
		}
		break;
	}
	case KVD__RESPONSE__BODY_HELLO:
		if (!r->hello->client_id || r->hello->region_size % 4096)
			abort();
		break;
	case KVD__RESPONSE__BODY__NOT_SET:
		abort();
	default:
		break;
	}
	kvd_ctl_free_response(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t len)
{
	if (len < 1)
		return 0;
	if (buf[0] & 1)
		response(buf + 1, len - 1, buf[0] >> 1);
	else
		request(buf + 1, len - 1);
	return 0;
}
