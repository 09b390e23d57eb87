/* kvd_tier's start-up: persisted spill files become DISK sequences.  See
 * tier_int.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <syslog.h>

#include "engine/attn.h"
#include "engine/err.h"
#include "engine/log.h"
#include "tier_int.h"

/* ---- start-up ----------------------------------------------------------- */

static int load_one(void *arg, unsigned dir, const struct kvd_sfmt_hdr *hdr, unsigned n,
		    const void *profile, uint64_t profile_bytes, uint64_t disk_bytes)
{
	struct kvd_tier *t = arg;
	struct kvd_profile want;
	const struct kvd_profile *p;
	struct kvd_seqn *q;
	struct rec *r;
	char msg[160];
	int rc;

	if (kvd_sfmt_profile_get(profile, profile_bytes, &want, msg, sizeof msg)) {
		kvd_log(LOG_WARNING, "spill file of %016llx: bad profile: %s",
			(unsigned long long)hdr[0].seq, msg);
		return -KVD_EFORMAT;    /* quarantined: the file is bad */
	}
	/* With limits, the profile is made in the namespace of the uid in the
	 * file's tenant and charged to it; the reference taken here is
	 * dropped once the sequence holds its own. */
	const char *tenant = t->adopt_tenant ? t->adopt_tenant : hdr[0].tenant;
	uint32_t uid = kvd_store_tenant_uid(tenant);

	msg[0] = 0;
	if (lim(t))
		rc = kvd_store_profile_ns(t->st, kvd_limits_namespace(lim(t), uid), uid, &want, &p, msg,
					  sizeof msg);
	else
		rc = kvd_store_profile(t->st, &want, &p);
	free(want.dense);
	free(want.W);
	if (!rc && kvd_sfmt_profile_fp(p) != hdr[0].profile_fp) {
		if (lim(t))
			kvd_store_profile_unref(t->st, p);
		rc = -KVD_EFORMAT;
		snprintf(msg, sizeof msg, "does not match its fingerprint");
	}
	if (rc) {
		kvd_log(LOG_WARNING, "spill file of %016llx: profile '%s': %s",
			(unsigned long long)hdr[0].seq, want.name,
			msg[0] ? msg : rc == -EEXIST ? "conflicts with another of that name"
						     : kvd_strerror(rc));
		/* A file that does not fit (a fingerprint, a name taken with other
		 * fields) is set aside; one refused for memory or a limit stays for
		 * the next start. */
		return rc == -KVD_EFORMAT || rc == -EEXIST ? -KVD_EFORMAT : rc;
	}
	rc = kvd_store_seq_adopt(t->st, p, tenant, hdr[0].seq, 0, &q);
	if (lim(t))
		kvd_store_profile_unref(t->st, p);
	if (rc) {
		kvd_log(LOG_WARNING, "spill file of %016llx: %s", (unsigned long long)hdr[0].seq,
			rc == -EEXIST ? "that sequence is already loaded" : kvd_strerror(rc));
		return rc == -EEXIST ? -KVD_EFORMAT : rc;
	}
	if (!(r = kvd_tier_rec_of(t, q)) || !(r->ext = calloc(n, sizeof *r->ext))) {
		if (r)
			kvd_tier_rec_free(t, r);
		kvd_store_seq_free(t->st, q);
		return -ENOMEM;         /* left in place: next start tries again */
	}
	uint32_t last = 0;

	for (unsigned i = 0; i < n; i++) {
		const struct kvd_sfmt_hdr *h = &hdr[i];
		int data = h->kind == KVD_SFMT_LAYER || h->kind == KVD_SFMT_SEG ||
			   h->kind == KVD_SFMT_HEAVY;

		r->ext[i] = (struct ext){ h->kind, h->layer, h->n, h->flags, h->extent_bytes,
					  h->tok_begin, h->tok_end };
		if (data && (h->layer >= p->layers || p->dense[h->layer] || h->layer < last)) {
			kvd_log(LOG_WARNING, "spill file of %016llx: extent %u names layer %u out of order",
				(unsigned long long)hdr[0].seq, i, h->layer);
			kvd_tier_rec_free(t, r);
			kvd_store_seq_free(t->st, q);
			return -KVD_EFORMAT;
		}
		if (data)
			last = h->layer;
		if (h->kind == KVD_SFMT_PUB) {
			uint8_t key[16];

			kvd_sfmt_pub_key(h, key);
			kvd_store_seq_hide(q, key, h->n);
		}
		if (h->kind == KVD_SFMT_LOCAL && h->layer >= p->layers) {
			kvd_log(LOG_WARNING, "spill file of %016llx: LOCAL extent %u names layer %u of %u",
				(unsigned long long)hdr[0].seq, i, h->layer, p->layers);
			kvd_tier_rec_free(t, r);
			kvd_store_seq_free(t->st, q);
			return -KVD_EFORMAT;
		}
		/* The state of the profile's estimator and q heads, or the
		 * file is not this profile's. */
		if (h->kind == KVD_SFMT_HEAVY &&
		    (p->estimator == KVD_EST_MAGICPIG || h->n != p->g.q_heads)) {
			kvd_log(LOG_WARNING, "spill file of %016llx: HEAVY extent %u of %u q heads "
				"for a %s profile of %u", (unsigned long long)hdr[0].seq, i, h->n,
				kvd_estimator_name(p->estimator), p->g.q_heads);
			kvd_tier_rec_free(t, r);
			kvd_store_seq_free(t->st, q);
			return -KVD_EFORMAT;
		}
		if (h->kind == KVD_SFMT_LAYER) {
			q->ly[h->layer].tokens = h->tok_end;
			q->ly[h->layer].sealed = !!(h->flags & KVD_SFMT_LF_SEALED);
		}
	}
	r->next_ext = n;
	r->has_file = 1;
	r->dir = dir;
	r->file_gen = hdr[0].gen;
	r->disk_bytes = disk_bytes;
	/* The file exists: accounted to its uid even above spill_per_uid
	 * (which then holds back that uid's next spills). */
	if (lim(t) && !kvd_limits_force(lim(t), r->uid, KVD_RES_SPILL, disk_bytes))
		r->spill_chg = disk_bytes;
	q->gen = hdr[0].gen;
	q->state = KVD_SEQ_DISK;
	if (kvd_store_seq_hidden(q) && t->on_pub)
		t->on_pub(t->on_pub_arg, q);
	return 0;
}

int kvd_tier_adopt(struct kvd_tier *t, unsigned dir, uint64_t seq, const char *tenant)
{
	int rc;

	if (!t->sp)
		return -ENOENT;
	t->adopt_tenant = tenant;
	rc = kvd_spill_scan_one(t->sp, dir, seq, load_one, t);
	t->adopt_tenant = NULL;
	return rc;
}

int kvd_tier_load(struct kvd_tier *t)
{
	if (!t->sp)
		return 0;
	return kvd_spill_scan(t->sp, t->cfg.persist, t->cfg.persist ? load_one : NULL, t);
}
