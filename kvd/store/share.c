#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/clock.h"
#include "engine/err.h"
#include "engine/log.h"
#include "remote.h"
#include "engine/rng.h"
#include "share.h"
#include "uidlimits.h"

#define PUB_BUCKETS 4096
#define KVD_SHARE_MAKE_WAY 4            /* snapshots one publish may drop */
#define ROOM_SLACK (1u << 20)
#define FETCH_MAX 64                    /* remote lookups at once, all namespaces */
#define FETCH_NS_MAX 8                  /* ... and of one namespace */
#define FETCH_KEEP_NS 2000000000ull     /* a finished lookup answers retries this long */
#define FETCH_STALE_NS 60000000000ull   /* a lookup never answered is given up */

/* One published prefix.  Chained by (ns, profile, key); on the LRU list,
 * most recently published or attached first. */
struct pub {
	uint32_t ns, pid;
	uint8_t key[KVD_SHARE_KEY];
	uint64_t tokens;
	struct kvd_seqn *snap;
	int sent;                       /* queued for the remote tier */
	int pinned;                     /* an attach is using it: it does not give way */
	uint64_t attaches, used_ns;     /* since it was filed; its last publish or attach */
	struct pub *next;               /* hash chain */
	struct pub *lru_prev, *lru_next;
};

struct ns_usage {
	struct kvd_share_usage u;       /* published, published_tokens: live counts */
	struct ns_usage *next;
};

/* A lookup in the remote tier for an attach: (ns, profile, its longest
 * key).  The attach is answered -EAGAIN while it runs; once it has
 * finished, retries take the local answer (the fetched prefix, if any, is
 * filed by then) until it expires. */
struct fetch {
	uint32_t ns, pid;
	uint8_t key[KVD_SHARE_KEY];
	uint64_t cookie, t0, done_ns;   /* done_ns 0: running */
	char tenant[KVD_NAME_MAX + 1];
	struct fetch *next;
};

struct kvd_share {
	struct kvd_store *st;
	struct kvd_tier *t;
	struct kvd_remote *rem;
	struct fetch *fetches;
	unsigned nfetch;
	uint64_t cookie;
	struct pub *bucket[PUB_BUCKETS];
	struct pub *lru_head, *lru_tail;
	struct ns_usage *usage;
};

static void say(char *msg, size_t msglen, const char *fmt, ...)
{
	va_list ap;

	if (!msg || !msglen)
		return;
	va_start(ap, fmt);
	vsnprintf(msg, msglen, fmt, ap);
	va_end(ap);
}

static uint32_t bucket_of(uint32_t ns, uint32_t pid, const uint8_t *key)
{
	uint64_t a, b;

	memcpy(&a, key, 8);
	memcpy(&b, key + 8, 8);
	return (uint32_t)(kvd_mix64(a ^ kvd_mix64(b ^ ((uint64_t)ns << 32 | pid))) &
			  (PUB_BUCKETS - 1));
}

static struct pub *find(const struct kvd_share *sh, uint32_t ns, uint32_t pid,
			const uint8_t *key)
{
	for (struct pub *x = sh->bucket[bucket_of(ns, pid, key)]; x; x = x->next)
		if (x->ns == ns && x->pid == pid && !memcmp(x->key, key, KVD_SHARE_KEY))
			return x;
	return NULL;
}

/* The namespace's counters, made on first use (NULL only without memory:
 * then nothing is counted for it). */
static struct ns_usage *usage_of(struct kvd_share *sh, uint32_t ns)
{
	struct ns_usage *u;

	for (u = sh->usage; u; u = u->next)
		if (u->u.ns == ns)
			return u;
	if (!(u = calloc(1, sizeof *u)))
		return NULL;
	u->u.ns = ns;
	u->next = sh->usage;
	sh->usage = u;
	return u;
}

static void lru_unlink(struct kvd_share *sh, struct pub *x)
{
	*(x->lru_prev ? &x->lru_prev->lru_next : &sh->lru_head) = x->lru_next;
	*(x->lru_next ? &x->lru_next->lru_prev : &sh->lru_tail) = x->lru_prev;
	x->lru_prev = x->lru_next = NULL;
}

static void lru_front(struct kvd_share *sh, struct pub *x)
{
	if (sh->lru_head == x)
		return;
	if (x->lru_prev || x->lru_next || sh->lru_tail == x)
		lru_unlink(sh, x);
	x->lru_next = sh->lru_head;
	if (sh->lru_head)
		sh->lru_head->lru_prev = x;
	sh->lru_head = x;
	if (!sh->lru_tail)
		sh->lru_tail = x;
}

static void pub_drop(struct kvd_share *sh, struct pub *x)
{
	struct pub **pp = &sh->bucket[bucket_of(x->ns, x->pid, x->key)];
	struct ns_usage *u = usage_of(sh, x->ns);

	while (*pp != x)
		pp = &(*pp)->next;
	*pp = x->next;
	lru_unlink(sh, x);
	if (u) {
		u->u.published--;
		u->u.published_tokens -= x->tokens;
	}
	kvd_tier_free(sh->t, x->snap);
	free(x);
}

/* Files a snapshot under its key (publish, or found on disk at start-up). */
static int pub_add(struct kvd_share *sh, uint32_t ns, struct kvd_seqn *snap, const uint8_t *key,
		   uint64_t tokens)
{
	const struct kvd_profile *p = kvd_store_seq_profile(snap);
	struct ns_usage *u = usage_of(sh, ns);
	struct pub *x = calloc(1, sizeof *x);
	uint32_t b = bucket_of(ns, p->id, key);

	if (!x || !u) {
		free(x);
		return -ENOMEM;
	}
	x->ns = ns;
	x->pid = p->id;
	memcpy(x->key, key, KVD_SHARE_KEY);
	x->tokens = tokens;
	x->snap = snap;
	x->next = sh->bucket[b];
	sh->bucket[b] = x;
	x->used_ns = kvd_now_ns();
	lru_front(sh, x);
	u->u.published++;
	u->u.published_tokens += tokens;
	return 0;
}

/* kvd_tier_load found a published prefix on disk (--persist). */
static void loaded(void *arg, struct kvd_seqn *q)
{
	struct kvd_share *sh = arg;
	struct kvd_limits *l = kvd_store_limits(sh->st);
	uint32_t uid = kvd_store_seq_uid(q);
	uint32_t ns = l ? kvd_limits_namespace(l, uid) : uid;
	uint64_t tokens = 0;
	const uint8_t *key = kvd_store_seq_pubkey(q, &tokens);
	const struct kvd_profile *p = kvd_store_seq_profile(q);

	/* A key filed twice (two files of one prefix) or that cannot be
	 * filed: the extra one stays an ordinary sequence without an owner. */
	if (!key || tokens % p->chunk_tokens || find(sh, ns, p->id, key) ||
	    pub_add(sh, ns, q, key, tokens))
		kvd_store_seq_unhide(q);
}

/* ---- under pressure ------------------------------------------------------- */

/* Memory charged now: anyone's (any), or uid's. */
static uint64_t mem_now(const struct kvd_share *sh, uint32_t uid, int any)
{
	struct kvd_limits *l = kvd_store_limits(sh->st);
	struct kvd_limits_usage u;
	struct kvd_store_stats ss;

	if (l) {
		if (any)
			kvd_limits_total(l, &u);
		else
			kvd_limits_uid_usage(l, uid, &u);
		return u.n[KVD_RES_MEMORY];
	}
	kvd_store_stats(sh->st, &ss);
	return ss.bytes + ss.fixed_bytes + ss.local_bytes;
}

/* Whether x may give way in pass 0 (resident: its memory goes) or pass 1
 * (on disk or lost: only its bookkeeping goes).  One being written or read
 * would free nothing until its I/O ends; one an attach is using stays. */
static int may_go(const struct pub *x, uint32_t uid, int any, int pass)
{
	enum kvd_seq_state st = kvd_store_seq_state(x->snap);

	if (x->pinned || (!any && kvd_store_seq_uid(x->snap) != uid))
		return 0;
	return pass ? st == KVD_SEQ_DISK || st == KVD_SEQ_LOST : st == KVD_SEQ_RAM;
}

/* kvd_store_reclaim: snapshots give way, least recently used first, until
 * `need` bytes came back.  Their segments go only with their last holder:
 * a sequence that attached one keeps its own references, so no row of it
 * is lost, and what it shares does not come back. */
static uint64_t reclaim(void *arg, uint32_t uid, int any, uint64_t need)
{
	struct kvd_share *sh = arg;
	struct kvd_seqn **all;
	uint64_t most, before, now;
	size_t k = 0;
	unsigned n = 0;

	/* What all of them could give back, segments that attached sequences
	 * hold not counted: a request that cannot fit even then empties
	 * nobody's cache for nothing. */
	for (const struct pub *x = sh->lru_tail; x; x = x->lru_prev)
		k += may_go(x, uid, any, 0) || may_go(x, uid, any, 1);
	if (!k || !(all = malloc(k * sizeof *all)))
		return 0;
	k = 0;
	for (const struct pub *x = sh->lru_tail; x; x = x->lru_prev)
		if (may_go(x, uid, any, 0) || may_go(x, uid, any, 1))
			all[k++] = x->snap;
	most = kvd_store_freeable_set(all, k);
	free(all);
	if (most < need)
		return 0;
	now = before = mem_now(sh, uid, any);
	for (int pass = 0; pass < 2 && before - now < need; pass++) {
		for (struct pub *x = sh->lru_tail, *prev; x && before - now < need; x = prev) {
			prev = x->lru_prev;
			if (!may_go(x, uid, any, pass))
				continue;
			pub_drop(sh, x);
			n++;
			now = mem_now(sh, uid, any);
			now = now < before ? now : before;
		}
	}
	if (n)
		kvd_log(LOG_DEBUG, "share: %u snapshot(s) gave way for %llu bytes %s %u: %llu came back",
			n, (unsigned long long)need, any ? "under the memory limit, asked by uid" :
			"under memory_per_uid of uid", uid, (unsigned long long)(before - now));
	return before - now;
}

int kvd_share_create(struct kvd_store *st, struct kvd_tier *t, struct kvd_share **out)
{
	struct kvd_share *sh = calloc(1, sizeof *sh);

	if (!sh)
		return -ENOMEM;
	sh->st = st;
	sh->t = t;
	kvd_tier_on_pub(t, loaded, sh);
	kvd_store_set_reclaim(st, reclaim, sh);
	*out = sh;
	return 0;
}

void kvd_share_destroy(struct kvd_share *sh)
{
	if (!sh)
		return;
	kvd_store_set_reclaim(sh->st, NULL, NULL);
	while (sh->lru_head)
		pub_drop(sh, sh->lru_head);
	for (struct fetch *f = sh->fetches, *nf; f; f = nf) {
		nf = f->next;
		free(f);
	}
	for (struct ns_usage *u = sh->usage, *nx; u; u = nx) {
		nx = u->next;
		free(u);
	}
	free(sh);
}

/* The least recently used snapshot charged to uid, other than keep. */
static struct pub *lru_of_uid(const struct kvd_share *sh, uint32_t uid, const struct pub *keep)
{
	for (struct pub *x = sh->lru_tail; x; x = x->lru_prev)
		if (x != keep && kvd_store_seq_uid(x->snap) == uid)
			return x;
	return NULL;
}

/* Why q cannot be published at `tokens` now, or 0. */
static int check_publish(struct kvd_seqn *q, uint64_t tokens, char *msg, size_t msglen)
{
	const struct kvd_profile *p = kvd_store_seq_profile(q);
	uint32_t chunk = p->chunk_tokens;

	if (!tokens || !chunk || tokens % chunk) {
		say(msg, msglen, "%llu tokens: not a positive multiple of chunk_tokens %u",
		    (unsigned long long)tokens, chunk);
		return -EINVAL;
	}
	for (uint32_t l = 0; l < p->layers; l++) {
		if (!p->dense[l] && (!kvd_store_layer_mean(q, l) || kvd_store_attend_ready(q, l))) {
			say(msg, msglen, "layer %u is not prefilled", l);
			return -EBUSY;
		}
	}
	for (uint32_t l = 0; l < p->layers; l++) {
		uint64_t have = kvd_store_local_rows(q, l);

		if (!p->dense[l])
			have += kvd_store_layer_tokens(q, l);
		if (have != tokens) {
			say(msg, msglen, "layer %u holds %llu tokens (kvd's and LOCAL rows), not %llu",
			    l, (unsigned long long)have, (unsigned long long)tokens);
			return -EINVAL;
		}
	}
	return 0;
}

int kvd_share_publish(struct kvd_share *sh, uint32_t ns, struct kvd_seqn *q,
		      const uint8_t *key, uint64_t tokens, char *msg, size_t msglen)
{
	const struct kvd_profile *p = kvd_store_seq_profile(q);
	const uint32_t uid = kvd_store_seq_uid(q);
	struct kvd_seqn *snap;
	int rc;

	/* The rows kvd holds are resident, so their counts are known. */
	if ((rc = kvd_tier_want(sh->t, q, UINT32_MAX, msg, msglen)))
		return rc == -EINPROGRESS ? -EAGAIN : rc;
	if ((rc = check_publish(q, tokens, msg, msglen)))
		return rc;
	if (find(sh, ns, p->id, key))
		return 0;
	if (tokens > UINT32_MAX) {
		say(msg, msglen, "%llu tokens: at most %u can be published",
		    (unsigned long long)tokens, UINT32_MAX);
		return -EINVAL;
	}
	/* The budget counts the store's bytes; the wall behind it also the
	 * bookkeeping around them: ask for a little more than the fork. */
	rc = kvd_tier_room_uid(sh->t, uid, kvd_store_fork_bytes(q) + ROOM_SLACK, msg, msglen);
	if (rc == -EINPROGRESS) {
		say(msg, msglen, "making room for the snapshot: publish again");
		return -EAGAIN;
	}
	/* A snapshot is a fork with no owner.  At the uid's limits its older
	 * snapshots make way (they are a cache), a few at most: a publish that
	 * cannot fit anyway must not empty the uid's cache for nothing. */
	for (int dropped = 0;; dropped++) {
		struct pub *old;

		rc = kvd_store_seq_fork(sh->st, q, uid, kvd_store_seq_tenant(q), 0, &snap, msg,
					msglen);
		if (rc != -EDQUOT && rc != -ENOMEM && rc != -ENOSPC)
			break;
		if (dropped == KVD_SHARE_MAKE_WAY || !(old = lru_of_uid(sh, uid, NULL)))
			break;
		pub_drop(sh, old);
	}
	if (rc)
		return rc;
	kvd_store_seq_hide(snap, key, tokens);
	kvd_store_local_give(sh->st, q, snap, 1);
	if ((rc = pub_add(sh, ns, snap, key, tokens))) {
		kvd_tier_free(sh->t, snap);
		say(msg, msglen, "out of memory");
		return rc;
	}
	/* On the tier's LRU from now: a snapshot nobody attaches goes to disk
	 * before the sequences in use.  Under --persist it is written at once,
	 * so that a restart (even a crash) finds it. */
	(void)kvd_tier_want(sh->t, snap, UINT32_MAX, NULL, 0);
	(void)kvd_tier_write(sh->t, snap);
	return 0;
}


/* ---- the remote tier ------------------------------------------------------ */

static void ns_name(const struct kvd_share *sh, uint32_t ns, char *buf, size_t n)
{
	kvd_limits_ns_name(kvd_store_limits(sh->st), ns, buf, n);
}

/* A snapshot's file is written: send it once. */
static void written(void *arg, struct kvd_seqn *q, const char *path)
{
	struct kvd_share *sh = arg;
	char ns[KVD_REMOTE_NS_MAX];

	for (struct pub *x = sh->lru_head; x; x = x->lru_next) {
		if (x->snap != q)
			continue;
		if (x->sent)
			return;
		ns_name(sh, x->ns, ns, sizeof ns);
		if (kvd_remote_put(sh->rem, ns, x->key, x->tokens, path, KVD_REMOTE_FOR_SHARE, 0) == 0)
			x->sent = 1;
		return;
	}
}

void kvd_share_set_remote(struct kvd_share *sh, struct kvd_remote *rem)
{
	sh->rem = rem;
	kvd_tier_on_written(sh->t, rem ? written : NULL, sh);
}

static void fetch_unlink(struct kvd_share *sh, struct fetch *f)
{
	struct fetch **pp = &sh->fetches;

	while (*pp != f)
		pp = &(*pp)->next;
	*pp = f->next;
	sh->nfetch--;
	free(f);
}

void kvd_share_remote_done(struct kvd_share *sh, const struct kvd_remote_done *d)
{
	struct fetch *f;
	char ns[KVD_REMOTE_NS_MAX];
	int rc;

	for (f = sh->fetches; f && f->cookie != d->cookie; f = f->next)
		;
	if (!f)
		return;         /* given up on already */
	f->done_ns = kvd_now_ns();
	ns_name(sh, f->ns, ns, sizeof ns);
	if (d->rc == 0) {
		rc = kvd_tier_adopt(sh->t, d->dir, d->seq, f->tenant);
		if (rc)
			kvd_log(LOG_WARNING, "remote: prefix of namespace %s fetched as %016llx "
				"was refused: %s; a miss", ns, (unsigned long long)d->seq,
				kvd_strerror(rc));
		else if (!find(sh, f->ns, f->pid, d->key))
			kvd_log(LOG_WARNING, "remote: %016llx of namespace %s is not the prefix "
				"asked for; a miss", (unsigned long long)d->seq, ns);
		else
			kvd_log(LOG_INFO, "remote: prefix of namespace %s fetched: %016llx, "
				"%llu bytes (cluster %.0f ms, file %.0f ms)", ns,
				(unsigned long long)d->seq, (unsigned long long)d->bytes,
				d->fetch_ms, d->file_ms);
	} else if (d->rc == -KVD_EFORMAT) {
		kvd_log(LOG_WARNING, "remote: a prefix of namespace %s does not verify: %s; "
			"a miss", ns, d->msg);
	} else if (d->rc == -EFBIG) {
		kvd_log(LOG_WARNING, "remote: a prefix of namespace %s is too large for the uid that "
			"asked: %s; a miss", ns, d->msg);
	} else if (d->rc != -ENOENT && d->rc != -EEXIST) {
		kvd_log(LOG_WARNING, "remote: lookup for namespace %s failed: %s; a miss", ns,
			d->msg[0] ? d->msg : kvd_strerror(d->rc));
	}
}

static uint64_t min_nz(uint64_t a, uint64_t b)
{
	return !a || (b && b < a) ? b : a;
}

static uint64_t room(uint64_t limit, uint64_t used)
{
	return !limit ? 0 : limit > used ? limit - used : 1;
}

/* The most a lookup for uid may fetch: a prefix larger than the uid may
 * hold in memory, or than the spill room it has left (the fetched file is
 * charged to it), could never be attached by it, so the remote thread
 * refuses it from its manifest before it allocates or writes anything.
 * 0: no limits. */
static uint64_t fetch_cap(const struct kvd_share *sh, uint32_t uid)
{
	struct kvd_limits *l = kvd_store_limits(sh->st);
	struct kvd_limits_usage u, all;
	const struct kvd_limits_cfg *c;
	uint64_t cap = 0;

	if (!l)
		return 0;
	c = kvd_limits_cfg(l);
	kvd_limits_uid_usage(l, uid, &u);
	kvd_limits_total(l, &all);
	cap = min_nz(cap, c->per_uid[KVD_RES_MEMORY]);
	cap = min_nz(cap, c->cap[KVD_RES_MEMORY]);
	cap = min_nz(cap, room(c->per_uid[KVD_RES_SPILL], u.n[KVD_RES_SPILL]));
	cap = min_nz(cap, room(c->cap[KVD_RES_SPILL], all.n[KVD_RES_SPILL]));
	return cap;
}

/* Before a local answer that is shorter than the longest key: ask the
 * remote tier, once per (ns, profile, longest key) while its answer is
 * fresh.  -EAGAIN while it runs; 0 to go on with the local answer. */
static int remote_lookup(struct kvd_share *sh, uint32_t ns, const struct kvd_profile *p,
			 const uint8_t *keys, uint32_t nkeys, int best, uint32_t uid,
			 const char *tenant, char *msg, size_t msglen)
{
	const uint8_t *last = keys + (size_t)(nkeys - 1) * KVD_SHARE_KEY;
	uint64_t now = kvd_now_ns();
	unsigned of_ns = 0;
	char name[KVD_REMOTE_NS_MAX];
	struct fetch *f, *nf;

	for (f = sh->fetches; f; f = nf) {
		nf = f->next;
		if ((f->done_ns && now - f->done_ns > FETCH_KEEP_NS) ||
		    (!f->done_ns && now - f->t0 > FETCH_STALE_NS))
			fetch_unlink(sh, f);
	}
	for (f = sh->fetches; f; f = f->next) {
		if (f->ns == ns && f->pid == p->id && !memcmp(f->key, last, KVD_SHARE_KEY)) {
			if (f->done_ns)
				return 0;
			say(msg, msglen, "looking for the prefix in the remote tier: attach again");
			return -EAGAIN;
		}
		of_ns += f->ns == ns;
	}
	/* Past the bounds the remote tier is not asked: a miss, not a wait. */
	if (sh->nfetch >= FETCH_MAX || of_ns >= FETCH_NS_MAX || !(f = calloc(1, sizeof *f)))
		return 0;
	f->ns = ns;
	f->pid = p->id;
	memcpy(f->key, last, KVD_SHARE_KEY);
	f->cookie = ++sh->cookie;
	f->t0 = now;
	snprintf(f->tenant, sizeof f->tenant, "%s", tenant);
	ns_name(sh, ns, name, sizeof name);
	if (kvd_remote_get(sh->rem, name, keys + (size_t)(best + 1) * KVD_SHARE_KEY,
			   nkeys - (uint32_t)(best + 1), fetch_cap(sh, uid),
			   KVD_REMOTE_FOR_SHARE, f->cookie)) {
		free(f);
		return 0;
	}
	f->next = sh->fetches;
	sh->fetches = f;
	sh->nfetch++;
	say(msg, msglen, "looking for the prefix in the remote tier: attach again");
	return -EAGAIN;
}

int kvd_share_attach(struct kvd_share *sh, uint32_t ns, const struct kvd_profile *p,
		     const uint8_t *keys, uint32_t nkeys, uint32_t uid, const char *tenant,
		     uint64_t owner, struct kvd_seqn **out, uint64_t *tokens, char *msg,
		     size_t msglen)
{
	struct ns_usage *u = usage_of(sh, ns);
	uint64_t asked = (uint64_t)nkeys * p->chunk_tokens;
	int rc;

	*tokens = 0;
	if (nkeys > KVD_SHARE_MAX_KEYS) {
		say(msg, msglen, "%u keys, at most %u", nkeys, KVD_SHARE_MAX_KEYS);
		return -E2BIG;
	}
	if (sh->rem && nkeys) {
		int best = -1;

		for (uint32_t i = nkeys; i-- > 0 && best < 0;) {
			struct pub *x = find(sh, ns, p->id, keys + (size_t)i * KVD_SHARE_KEY);

			if (x && x->tokens == (uint64_t)(i + 1) * p->chunk_tokens)
				best = (int)i;
		}
		if (best < (int)nkeys - 1 &&
		    (rc = remote_lookup(sh, ns, p, keys, nkeys, best, uid, tenant, msg, msglen)))
			return rc;
	}
	for (uint32_t i = nkeys; i-- > 0;) {
		struct pub *x = find(sh, ns, p->id, keys + (size_t)i * KVD_SHARE_KEY);
		char why[160];

		/* Key i names i+1 chunks: a snapshot of another length under it
		 * is not this prefix (only a publisher that lied makes one). */
		if (!x || x->tokens != (uint64_t)(i + 1) * p->chunk_tokens)
			continue;
		/* Making room for it (its restore, the child's charges) may
		 * make snapshots give way: not this one. */
		x->pinned = 1;
		rc = kvd_tier_want(sh->t, x->snap, UINT32_MAX, why, sizeof why);
		x->pinned = 0;
		if (rc == -EINPROGRESS) {
			say(msg, msglen, "the prefix is being read back from disk: attach again");
			return -EAGAIN;
		}
		if (rc == -KVD_ELOST) {
			pub_drop(sh, x);
			continue;
		}
		if (rc) {
			say(msg, msglen, "%s", why);
			return rc;
		}
		/* The child is charged like a private copy: under the budget, the
		 * tier writes older sequences out first. */
		x->pinned = 1;
		rc = kvd_tier_room_uid(sh->t, uid, kvd_store_fork_bytes(x->snap) + ROOM_SLACK, msg,
				       msglen);
		if (rc == -EINPROGRESS)
			say(msg, msglen, "making room for the prefix: attach again");
		else if (!rc)
			rc = kvd_store_seq_fork(sh->st, x->snap, uid, tenant, owner, out, msg, msglen);
		x->pinned = 0;
		if (rc)
			return rc == -EINPROGRESS ? -EAGAIN : rc;
		kvd_store_local_give(sh->st, x->snap, *out, 0);
		lru_front(sh, x);
		x->attaches++;
		x->used_ns = kvd_now_ns();
		*tokens = x->tokens;
		if (u) {
			u->u.hit_tokens += x->tokens;
			u->u.miss_tokens += asked - x->tokens;
			u->u.saved_bytes += kvd_store_seq_bytes(x->snap);
		}
		return 0;
	}
	rc = kvd_store_seq_create_uid(sh->st, p, uid, tenant, owner, out, msg, msglen);
	if (!rc && u)
		u->u.miss_tokens += asked;
	return rc;
}

void kvd_share_each(const struct kvd_share *sh,
		    void (*fn)(void *arg, const struct kvd_share_usage *u), void *arg)
{
	for (const struct ns_usage *u = sh->usage; u; u = u->next) {
		struct kvd_share_usage v = u->u;

		for (const struct pub *x = sh->lru_head; x; x = x->lru_next)
			if (x->ns == v.ns)
				v.shared_bytes += kvd_store_seq_bytes(x->snap) +
						  kvd_store_local_bytes(x->snap);
		fn(arg, &v);
	}
}

void kvd_share_list(const struct kvd_share *sh,
		    void (*fn)(void *arg, const struct kvd_share_info *i), void *arg)
{
	uint64_t now = kvd_now_ns();

	for (const struct pub *x = sh->lru_head; x; x = x->lru_next) {
		struct kvd_share_info i = {
			.seq = kvd_store_seq_id(x->snap), .ns = x->ns, .uid = kvd_store_seq_uid(x->snap),
			.profile_id = x->pid, .tokens = x->tokens,
			.bytes = kvd_store_seq_bytes(x->snap) + kvd_store_local_bytes(x->snap),
			.freeable = kvd_store_seq_freeable(x->snap), .attaches = x->attaches,
			.idle_ns = now > x->used_ns ? now - x->used_ns : 0,
			.state = kvd_store_seq_state(x->snap),
		};

		memcpy(i.key, x->key, KVD_SHARE_KEY);
		fn(arg, &i);
	}
}

int kvd_share_drop_key(struct kvd_share *sh, const uint8_t *key, unsigned *n)
{
	unsigned busy = 0;

	*n = 0;
	for (struct pub *x = sh->lru_head, *nx; x; x = nx) {
		nx = x->lru_next;
		if (memcmp(x->key, key, KVD_SHARE_KEY))
			continue;
		if (x->pinned) {
			busy++;
			continue;
		}
		pub_drop(sh, x);
		(*n)++;
	}
	return *n || !busy ? 0 : -EBUSY;
}
