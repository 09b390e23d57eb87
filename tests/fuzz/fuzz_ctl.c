/* libFuzzer target for the control-plane decoders, kvd_ctl_decode_request()
 * (the daemon's, fed by any local process) and kvd_ctl_decode_response()
 * (the client's).
 *
 * Byte 0 picks: bit 0 clear, the rest is a Request; set, a Response, with
 * want_id = byte 0 >> 1 (0..127, a one-byte varint the fuzzer finds easily).
 * What the decoders promise is then checked, so a validation hole shows as
 * an abort rather than passing quietly: a refusal carries a negative code
 * and a message; an accepted profile has a valid geometry, kv_dtype and
 * estimator, dense layers below `layers` and W of the size it claims; an
 * error message is short and printable.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/attn.h"
#include "proto/ctl.h"
#include "engine/err.h"

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t len);

static void check_profile(const Kvd__Profile *p, int filled)
{
	struct kvd_geom g;

	if (kvd_ctl_check_profile(p, filled, NULL) || kvd_ctl_profile_to_geom(p, &g) ||
	    g.kv_dtype != p->kv_dtype || !kvd_kv_dtype_name(g.kv_dtype) ||
	    !kvd_estimator_name(p->estimator) ||
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
		if (r->hello->control && (r->hello->slots || r->hello->slot_size || r->hello->poll))
			abort();
		break;
	case KVD__REQUEST__BODY_CLIENTS:
		if (r->clients->limit > KVD_CTL_LIST_MAX)
			abort();
		break;
	case KVD__REQUEST__BODY_SEQ_LIST:
		if (r->seq_list->limit > KVD_CTL_LIST_MAX || (!r->seq_list->filter_uid && r->seq_list->uid))
			abort();
		break;
	case KVD__REQUEST__BODY_SEQ_ADMIN:
		if (!r->seq_admin->seq || r->seq_admin->op < 1 || r->seq_admin->op > 3)
			abort();
		break;
	case KVD__REQUEST__BODY_PROFILES:
		if (r->profiles->limit > KVD_CTL_LIST_MAX)
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
		if (!r->seq_create->profile_id || r->seq_create->content_key.len > KVD_CTL_KEY_MAX ||
		    r->seq_create->n_attach_keys > KVD_CTL_ATTACH_KEYS_MAX ||
		    (r->seq_create->n_attach_keys && r->seq_create->parent))
			abort();
		for (size_t i = 0; i < r->seq_create->n_attach_keys; i++)
			if (r->seq_create->attach_keys[i].len != KVD_CTL_CONTENT_KEY)
				abort();
		break;
	case KVD__REQUEST__BODY_SEQ_PUBLISH:
		if (!r->seq_publish->seq || r->seq_publish->key.len != KVD_CTL_CONTENT_KEY)
			abort();
		break;
	case KVD__REQUEST__BODY__NOT_SET:
		abort();
	default:
		break;
	}
	kvd_ctl_free_request(r);
}

/* A string from kvd, after the decoder: at most a name's length, printable. */
static void check_shown(const char *s)
{
	if (strlen(s) > KVD_CTL_NAME_MAX)
		abort();
	for (; *s; s++) {
		if (*s < 0x20 || *s > 0x7e)
			abort();
	}
}

static void check_seq_info(const Kvd__SeqInfo *q)
{
	if (!q || !q->seq || q->state > 4)
		abort();
	check_shown(q->tenant);
	check_shown(q->profile);
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
		if (!r->hello->client_id || r->hello->region_size % 4096 ||
		    (r->hello->control && r->hello->region_size))
			abort();
		break;
	case KVD__RESPONSE__BODY_CLIENT_LIST:
		if (r->client_list->n_clients > KVD_CTL_LIST_MAX)
			abort();
		for (size_t i = 0; i < r->client_list->n_clients; i++) {
			const Kvd__ClientInfo *c = r->client_list->clients[i];

			if (!c || !c->client_id)
				abort();
			check_shown(c->tenant);
			check_shown(c->name);
		}
		break;
	case KVD__RESPONSE__BODY_SEQ_LIST:
		if (r->seq_list->n_seqs > KVD_CTL_LIST_MAX)
			abort();
		for (size_t i = 0; i < r->seq_list->n_seqs; i++)
			check_seq_info(r->seq_list->seqs[i]);
		break;
	case KVD__RESPONSE__BODY_SEQ_INFO:
		check_seq_info(r->seq_info);
		break;
	case KVD__RESPONSE__BODY_PROFILE_LIST:
		if (r->profile_list->n_profiles > KVD_CTL_LIST_MAX)
			abort();
		for (size_t i = 0; i < r->profile_list->n_profiles; i++) {
			const Kvd__ProfileInfo *pi = r->profile_list->profiles[i];

			if (!pi || !pi->profile_id || !pi->profile || pi->n_dense > pi->profile->layers)
				abort();
			check_profile(pi->profile, 1);
		}
		break;
	case KVD__RESPONSE__BODY_LIMITS:
		if (r->limits->n_rows > KVD_CTL_LIMIT_ROWS || r->limits->n_uids > KVD_CTL_LIST_MAX)
			abort();
		for (size_t i = 0; i < r->limits->n_rows; i++) {
			if (!r->limits->rows[i])
				abort();
			check_shown(r->limits->rows[i]->key);
		}
		for (size_t i = 0; i < r->limits->n_uids; i++) {
			if (!r->limits->uids[i])
				abort();
		}
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
