/* libkvclient's transport.  See kvt.h. */
#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "engine/attn.h"
#include "proto/ctl.h"
#include "engine/err.h"
#include "engine/model.h"
#include "proto/kvd_ring.h"
#include "kvt.h"
#include "engine/seg.h"
#include "shm/shm.h"

#define NOP_TAG UINT64_MAX

enum { SLOT_FREE, SLOT_FIRE, SLOT_OWNED };

struct slot {
	uint8_t state, done;
	int32_t res;
	char msg[48];
};

struct kvt {
	int fd, efd, memfd;
	uint64_t next_id;
	void *map;
	size_t map_size;
	struct shm_region r;
	int poll;
	uint64_t spin_ns;
	struct slot *slot;
	uint32_t fire_inflight;
	int fire_err;
	char fire_msg[64];
	int nop_done;
	/* profile */
	int have_profile;
	uint32_t profile_id;
	/* as kvd made it; chunk_tokens 0: a kvd without sharing */
	struct kvd_model pm;
	struct kvc_model m;             /* the same, for kvc_model_of */
	uint32_t *dense_list;
	uint8_t *dense;
	float *W;
	void *rx;
	char err[256];
};

int kvt_fail(struct kvt *t, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(t->err, sizeof t->err, fmt, ap);
	va_end(ap);
	return code;
}

const char *kvt_error(const struct kvt *t)
{
	return t->err;
}

/* ---- control plane ----------------------------------------------------- */

/* One request and its answer of body want: the response (caller frees) or
 * NULL with *rc and t->err set (an Error too). */
static Kvd__Response *call(struct kvt *t, Kvd__Request *rq, Kvd__Response__BodyCase want,
			   int *fds, int *nfds, int *rc)
{
	struct kvd_ctl_err e;
	Kvd__Response *r;

	rq->id = ++t->next_id;
	r = kvd_ctl_call(t->fd, rq, want, t->rx, -1, fds, nfds, &e);
	*rc = r ? 0 : kvt_fail(t, e.code, "kvd: %s", e.msg);
	return r;
}

struct kvt *kvt_new(void)
{
	struct kvt *t = calloc(1, sizeof *t);

	if (!t)
		return NULL;
	t->fd = t->efd = t->memfd = -1;
	t->rx = malloc(KVD_CTL_RX_MAX);
	if (!t->rx) {
		free(t);
		return NULL;
	}
	return t;
}

int kvt_connect(struct kvt *t, const struct kvc_opts *o)
{
	const char *path = o && o->socket_path ? o->socket_path : "/run/kvd/kvd.sock";
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__Hello h = KVD__HELLO__INIT;
	Kvd__Response *r;
	int fds[KVD_CTL_MAX_FDS], nfds = KVD_CTL_MAX_FDS, rc;

	t->poll = o ? o->poll : 0;
	t->spin_ns = o && o->spin_ns ? o->spin_ns : 50000;
	if (strlen(path) >= sizeof a.sun_path)
		return kvt_fail(t, -ENAMETOOLONG, "socket path too long: %s", path);
	memcpy(a.sun_path, path, strlen(path) + 1);
	t->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (t->fd < 0 || connect(t->fd, (struct sockaddr *)&a, sizeof a))
		return kvt_fail(t, -errno, "connect %s: %s", path, strerror(errno));

	h.version = KVD_CTL_VERSION;
	h.tenant = (char *)(o && o->tenant ? o->tenant : "default");
	h.client_name = (char *)(o && o->name ? o->name : "kvc");
	h.poll = t->poll;
	h.slots = o ? o->slots : 0;
	h.slot_size = o ? o->slot_size : 0;
	rq.body_case = KVD__REQUEST__BODY_HELLO;
	rq.hello = &h;
	r = call(t, &rq, KVD__RESPONSE__BODY_HELLO, fds, &nfds, &rc);
	if (!r)
		return rc;
	if (nfds != 2) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		kvd_ctl_free_response(r);
		return kvt_fail(t, -KVD_EPROTO, "kvd answered hello without its region");
	}
	t->memfd = fds[0];
	t->efd = fds[1];
	t->map_size = r->hello->region_size;
	kvd_ctl_free_response(r);
	t->map = mmap(NULL, t->map_size, PROT_READ | PROT_WRITE, MAP_SHARED, t->memfd, 0);
	if (t->map == MAP_FAILED) {
		t->map = NULL;
		return kvt_fail(t, -errno, "mmap of the shared region: %s", strerror(errno));
	}
	rc = shm_region_attach(&t->r, t->map, t->map_size);
	if (rc)
		return kvt_fail(t, rc, "shared region refused: %s", kvd_strerror(rc));
	t->slot = calloc(t->r.geo.nslots, sizeof *t->slot);
	if (!t->slot)
		return kvt_fail(t, -ENOMEM, "out of memory");
	return 0;
}

void kvt_close(struct kvt *t)
{
	if (!t)
		return;
	if (t->map)
		munmap(t->map, t->map_size);
	if (t->memfd >= 0)
		close(t->memfd);
	if (t->efd >= 0)
		close(t->efd);
	if (t->fd >= 0)
		close(t->fd);
	free(t->slot);
	free(t->dense_list);
	free(t->dense);
	free(t->W);
	free(t->rx);
	free(t);
}

void *kvt_map(const struct kvt *t, size_t *size)
{
	*size = t->map_size;
	return t->map;
}

/* kvc.h's numbers are the wire's and the engine's. */
static_assert((int)KVC_KV_BF16 == (int)KVD_KV_BF16 && (int)KVC_KV_INT8 == (int)KVD_KV_INT8,
	      "kvc_kv_dtype");

static_assert((int)KVC_EST_MAGICPIG == (int)KVD_EST_MAGICPIG &&
	      (int)KVC_EST_HYBRID == (int)KVD_EST_HYBRID &&
	      (int)KVC_EST_ADAPTIVE == (int)KVD_EST_ADAPTIVE &&
	      (int)KVC_EST_HYBRID_CV == (int)KVD_EST_HYBRID_CV &&
	      (int)KVC_EST_HYBRID_LCV == (int)KVD_EST_HYBRID_LCV, "kvc_estimator");

static const char *dtype_name(uint32_t dt)
{
	const char *s = kvd_kv_dtype_name(dt);

	return s ? s : "unknown";
}

static const char *est_name(uint32_t est)
{
	const char *s = kvd_estimator_name(est);

	return s ? s : "unknown";
}

int kvt_profile(struct kvt *t, const struct kvc_model *m)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ProfileCreate pc = KVD__PROFILE_CREATE__INIT;
	Kvd__Profile p = KVD__PROFILE__INIT;
	/* kvc.h's struct in the codec's C form: its own names are the ABI */
	const struct kvd_model want = {
		.g = { m->q_heads, m->kv_heads, m->head_dim, m->K, m->L, m->c, m->kv_dtype },
		.layers = m->layers, .sink = m->sink, .window = m->window,
		.seg_tokens = m->segment_tokens, .seal_tokens = m->seal_tokens, .seed = m->seed,
		.estimator = m->estimator,
	};
	const struct kvd_model *pm = &t->pm;
	Kvd__Response *r;
	int rc;

	if (t->have_profile)
		return kvt_fail(t, -EALREADY, "this connection already has a profile");
	kvd_ctl_profile_put(&want, m->dense_layers, m->n_dense, &p);
	p.name = (char *)m->name;       /* as it is, however long: kvd checks it */
	pc.profile = &p;
	rq.body_case = KVD__REQUEST__BODY_PROFILE_CREATE;
	rq.profile_create = &pc;
	r = call(t, &rq, KVD__RESPONSE__BODY_PROFILE, NULL, NULL, &rc);
	if (!r)
		return rc;

	const Kvd__Profile *got = r->profile->profile;

	/* proto3 drops a field the peer does not know: an older kvd would
	 * answer bf16 to an int8 request, silently. */
	if (got->kv_dtype != m->kv_dtype) {
		rc = kvt_fail(t, -EOPNOTSUPP, "kvd made profile '%s' kv_dtype %s, not %s as asked "
			      "(a kvd without kv_dtype?)", got->name, dtype_name(got->kv_dtype),
			      dtype_name(m->kv_dtype));
		kvd_ctl_free_response(r);
		return rc;
	}
	if (got->estimator != m->estimator) {
		rc = kvt_fail(t, -EOPNOTSUPP, "kvd made profile '%s' estimator %s, not %s as asked "
			      "(a kvd without estimator?)", got->name, est_name(got->estimator),
			      est_name(m->estimator));
		kvd_ctl_free_response(r);
		return rc;
	}
	t->profile_id = r->profile->profile_id;
	kvd_ctl_profile_get(got, &t->pm);
	t->m = (struct kvc_model){
		.name = pm->name, .layers = pm->layers, .q_heads = pm->g.q_heads,
		.kv_heads = pm->g.kv_heads, .head_dim = pm->g.d, .K = pm->g.K, .L = pm->g.L,
		.c = pm->g.c, .sink = pm->sink, .window = pm->window, .estimator = pm->estimator,
		.n_dense = (uint32_t)got->n_dense_layers, .kv_dtype = pm->g.kv_dtype,
		.seed = pm->seed, .segment_tokens = pm->seg_tokens, .seal_tokens = pm->seal_tokens,
	};
	t->dense_list = malloc((got->n_dense_layers + 1) * sizeof *t->dense_list);
	t->dense = calloc(got->layers, 1);
	t->W = malloc((size_t)pm->g.d * pm->g.K * pm->g.L * sizeof *t->W);
	if (!t->dense_list || !t->dense || !t->W) {
		kvd_ctl_free_response(r);
		return kvt_fail(t, -ENOMEM, "out of memory");
	}
	for (size_t i = 0; i < got->n_dense_layers; i++) {
		t->dense_list[i] = got->dense_layers[i];
		t->dense[got->dense_layers[i]] = 1;
	}
	t->m.dense_layers = t->dense_list;
	rc = kvd_ctl_profile_w(r->profile, t->W);
	kvd_ctl_free_response(r);
	if (rc)
		return kvt_fail(t, rc, "projection matrix from kvd unusable");
	t->have_profile = 1;
	return 0;
}

const struct kvc_model *kvt_model(const struct kvt *t)
{
	return t->have_profile ? &t->m : NULL;
}

const struct kvd_geom *kvt_geom(const struct kvt *t) { return &t->pm.g; }
const float *kvt_w(const struct kvt *t) { return t->W; }
int kvt_dense(const struct kvt *t, uint32_t layer) { return t->dense[layer]; }

/* ---- rings ------------------------------------------------------------- */

/* Takes what the completion ring holds; with `block`, waits for at least one
 * completion first.  0 or a negative code. */
static int reap(struct kvt *t, int block)
{
	int n = shm_ring_ready(&t->r.cq);

	while (n == 0 && block) {
		/* Wake up now and then to see whether kvd is still there: a
		 * daemon that died leaves the control socket hung up, and
		 * nothing else would ever end this wait. */
		n = shm_ring_wait(&t->r.cq, t->spin_ns, 200000000ull, t->poll);
		if (n == -EINTR)
			n = 0;
		if (n == 0) {
			struct pollfd pf = { .fd = t->fd, .events = POLLRDHUP };

			if (poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR)))
				return kvt_fail(t, -ECONNRESET, "kvd went away");
		}
	}
	if (n < 0)
		return kvt_fail(t, n, "completion ring corrupted");
	for (int i = 0; i < n; i++) {
		struct kvd_cqe e;

		memcpy(&e, shm_ring_entry(&t->r.cq, (uint32_t)i), sizeof e);
		e.msg[sizeof e.msg - 1] = 0;
		if (e.user_data == NOP_TAG) {
			t->nop_done = 1;
			continue;
		}
		if (e.user_data >= t->r.geo.nslots)
			continue;       /* not ours: kvd never does this */
		struct slot *sl = &t->slot[e.user_data];

		sl->done = 1;
		sl->res = e.res;
		memcpy(sl->msg, e.msg, sizeof sl->msg);
		if (sl->state == SLOT_FIRE) {
			if (e.res < 0 && !t->fire_err) {
				t->fire_err = e.res;
				snprintf(t->fire_msg, sizeof t->fire_msg, "%s", e.msg);
			}
			sl->state = SLOT_FREE;
			t->fire_inflight--;
		}
	}
	shm_ring_release(&t->r.cq, (uint32_t)n);
	return 0;
}

int kvt_submit(struct kvt *t, const struct kvd_sqe *e)
{
	void *p;
	int rc;

	while (!(p = shm_ring_reserve(&t->r.sq))) {
		if (shm_ring_broken(&t->r.sq))
			return kvt_fail(t, -EPROTO, "submission ring corrupted");
		if ((rc = reap(t, 1)))
			return rc;
	}
	memcpy(p, e, sizeof *e);
	shm_ring_commit(&t->r.sq, 1);
	if (shm_ring_needs_kick(&t->r.sq)) {
		uint64_t one = 1;

		if (write(t->efd, &one, sizeof one) < 0 && errno != EAGAIN)
			return kvt_fail(t, -errno, "kick kvd: %s", strerror(errno));
	}
	return 0;
}

int kvt_slot_get(struct kvt *t, int fire)
{
	uint8_t state = fire ? SLOT_FIRE : SLOT_OWNED;

	for (;;) {
		for (uint32_t i = 0; i < t->r.geo.nslots; i++) {
			if (t->slot[i].state == SLOT_FREE) {
				t->slot[i] = (struct slot){ .state = state };
				if (state == SLOT_FIRE)
					t->fire_inflight++;
				return (int)i;
			}
		}
		int rc = reap(t, 1);

		if (rc)
			return rc;
	}
}

void kvt_slot_put(struct kvt *t, uint32_t i)
{
	if (t->slot[i].state == SLOT_FIRE)
		t->fire_inflight--;     /* taken back before it was submitted */
	t->slot[i].state = SLOT_FREE;
}

static int wait_slot(struct kvt *t, uint32_t i)
{
	while (!t->slot[i].done) {
		int rc = reap(t, 1);

		if (rc)
			return rc;
	}
	return 0;
}

int kvt_wait_slot(struct kvt *t, uint32_t i, int32_t *res, const char **msg)
{
	int rc = wait_slot(t, i);

	*res = t->slot[i].res;
	*msg = t->slot[i].msg;
	return rc;
}

int kvt_drain(struct kvt *t, const char *what)
{
	int rc;

	while (t->fire_inflight)
		if ((rc = reap(t, 1)))
			return rc;
	if (t->fire_err) {
		rc = t->fire_err;
		t->fire_err = 0;
		return kvt_fail(t, rc, "%s: kvd: %s", what, t->fire_msg);
	}
	return 0;
}

uint32_t kvt_nslots(const struct kvt *t) { return t->r.geo.nslots; }
uint64_t kvt_slot_size(const struct kvt *t) { return t->r.geo.slot_size; }
void *kvt_slot(const struct kvt *t, uint32_t i) { return shm_slot(&t->r, i); }

int kvt_nop(struct kvt *t)
{
	struct kvd_sqe e = { .op = KVD_OP_NOP, .user_data = NOP_TAG };
	int rc;

	t->nop_done = 0;
	if ((rc = kvt_submit(t, &e)))
		return rc;
	while (!t->nop_done)
		if ((rc = reap(t, 1)))
			return rc;
	return 0;
}

int kvt_prefetch(struct kvt *t, uint64_t id)
{
	int slot = kvt_slot_get(t, 0), rc;

	if (slot < 0)
		return slot;
	struct kvd_sqe e = { .op = KVD_OP_PREFETCH, .seq = id, .user_data = (uint64_t)slot };

	if ((rc = kvt_submit(t, &e)) || (rc = wait_slot(t, (uint32_t)slot))) {
		t->slot[slot].state = SLOT_FREE;
		return rc;
	}
	rc = t->slot[slot].res;
	t->slot[slot].state = SLOT_FREE;
	return rc < 0 ? kvt_fail(t, rc, "prefetch: kvd: %s", t->slot[slot].msg) : 0;
}

/* ---- sequences and stats ------------------------------------------------ */

int kvt_seq_create(struct kvt *t, uint64_t *id)
{
	return kvt_seq_fork(t, 0, id);
}

int kvt_seq_fork(struct kvt *t, uint64_t parent, uint64_t *id)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqCreate sc = KVD__SEQ_CREATE__INIT;
	Kvd__Response *r;
	int rc;

	if (!t->have_profile)
		return kvt_fail(t, -EINVAL, "no profile yet");
	sc.profile_id = t->profile_id;
	sc.parent = parent;
	rq.body_case = KVD__REQUEST__BODY_SEQ_CREATE;
	rq.seq_create = &sc;
	r = call(t, &rq, KVD__RESPONSE__BODY_SEQ, NULL, NULL, &rc);
	if (!r)
		return rc;
	*id = r->seq->seq;
	kvd_ctl_free_response(r);
	return 0;
}

int kvt_seq_attach(struct kvt *t, const uint8_t *keys, uint32_t nkeys, uint64_t *id,
		   uint64_t *tokens, uint32_t *local_rows)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqCreate sc = KVD__SEQ_CREATE__INIT;
	ProtobufCBinaryData *kb;
	Kvd__Response *r;
	int rc;

	if (!t->have_profile)
		return kvt_fail(t, -EINVAL, "no profile yet");
	if (!nkeys) {
		*tokens = 0;
		memset(local_rows, 0, t->m.layers * sizeof *local_rows);
		return kvt_seq_create(t, id);
	}
	if (nkeys > KVD_CTL_ATTACH_KEYS_MAX)
		return kvt_fail(t, -E2BIG, "attach of %u keys: at most %u", nkeys,
				KVD_CTL_ATTACH_KEYS_MAX);
	if (!(kb = malloc(nkeys * sizeof *kb)))
		return kvt_fail(t, -ENOMEM, "out of memory");
	for (uint32_t i = 0; i < nkeys; i++)
		kb[i] = (ProtobufCBinaryData){ KVD_CTL_CONTENT_KEY,
					       (uint8_t *)keys + (size_t)i * KVD_CTL_CONTENT_KEY };
	sc.profile_id = t->profile_id;
	sc.n_attach_keys = nkeys;
	sc.attach_keys = kb;
	rq.body_case = KVD__REQUEST__BODY_SEQ_CREATE;
	rq.seq_create = &sc;
	r = call(t, &rq, KVD__RESPONSE__BODY_SEQ, NULL, NULL, &rc);
	free(kb);
	if (!r)
		return rc;
	if (r->seq->tokens && r->seq->n_local_rows != t->m.layers) {
		kvd_ctl_free_response(r);
		return kvt_fail(t, -KVD_EPROTO, "unexpected reply");
	}
	*id = r->seq->seq;
	*tokens = r->seq->tokens;
	for (uint32_t l = 0; l < t->m.layers; l++)
		local_rows[l] = *tokens ? r->seq->local_rows[l] : 0;
	kvd_ctl_free_response(r);
	return 0;
}

int kvt_seq_publish(struct kvt *t, uint64_t id, const uint8_t *key, uint64_t tokens)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqPublish sp = KVD__SEQ_PUBLISH__INIT;
	Kvd__Response *r;
	int rc;

	/* The LOCAL rows must have landed before kvd counts them. */
	if ((rc = kvt_drain(t, "publish")))
		return rc;
	sp.seq = id;
	sp.key = (ProtobufCBinaryData){ KVD_CTL_CONTENT_KEY, (uint8_t *)key };
	sp.tokens = tokens;
	rq.body_case = KVD__REQUEST__BODY_SEQ_PUBLISH;
	rq.seq_publish = &sp;
	/* -EAGAIN: kvd is making room (writing sequences out, restores in
	 * flight, entries that began to wait first). */
	for (int tries = 0;; tries++) {
		r = call(t, &rq, KVD__RESPONSE__BODY_OK, NULL, NULL, &rc);
		kvd_ctl_free_response(r);
		if (rc != -EAGAIN || tries >= 30000)
			return rc;
		nanosleep(&(struct timespec){ 0, 1000000 }, NULL);
	}
}

uint32_t kvt_chunk_tokens(const struct kvt *t)
{
	return t->have_profile ? t->pm.chunk_tokens : 0;
}

int kvt_local_put(struct kvt *t, uint64_t id, uint32_t layer, const uint16_t *k,
		  const uint16_t *v, uint32_t n, uint32_t stride)
{
	const uint32_t H = t->pm.g.kv_heads, d = t->pm.g.d;
	uint32_t per = kvd_local_fit(H, d, kvt_slot_size(t));
	int rc;

	if (!per)
		return kvt_fail(t, -EMSGSIZE, "slots too small for one row");
	for (uint32_t r0 = 0; r0 < n; r0 += per) {
		uint32_t cnt = n - r0 < per ? n - r0 : per;
		const struct kvd_local_layout lay = kvd_local_layout(H, d, cnt, 0);
		int slot = kvt_slot_get(t, 1);

		if (slot < 0)
			return slot;
		char *base = kvt_slot(t, (uint32_t)slot);

		for (size_t h = 0; h < H; h++) {
			memcpy(base + lay.k + h * cnt * d * 2, k + (h * stride + r0) * d,
			       (size_t)cnt * d * 2);
			memcpy(base + lay.v + h * cnt * d * 2, v + (h * stride + r0) * d,
			       (size_t)cnt * d * 2);
		}
		struct kvd_sqe e = {
			.op = KVD_OP_LOCAL, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
			.user_data = (uint64_t)slot, .seq = id, .len = (uint32_t)lay.bytes,
			.ntok = cnt, .row0 = r0,
		};

		if ((rc = kvt_submit(t, &e)))
			return rc;
	}
	return 0;
}

/* One LOCAL get of rows [r0, r0 + cnt) into a slot of its own. */
static int local_get_submit(struct kvt *t, uint64_t id, uint32_t layer, uint32_t r0,
			    uint32_t cnt, int mean, int *slot)
{
	const struct kvd_local_layout lay = kvd_local_layout(t->pm.g.kv_heads, t->pm.g.d, cnt, mean);
	int rc;

	if ((*slot = kvt_slot_get(t, 0)) < 0)
		return *slot;
	struct kvd_sqe e = {
		.op = KVD_OP_LOCAL, .flags = (uint8_t)(KVD_LF_GET | (mean ? KVD_LF_MEAN : 0)),
		.layer = (uint16_t)layer, .slot = (uint32_t)*slot, .user_data = (uint64_t)*slot,
		.seq = id, .ntok = cnt, .row0 = r0, .out_len = (uint32_t)lay.bytes,
	};

	if ((rc = kvt_submit(t, &e)))
		kvt_slot_put(t, (uint32_t)*slot);
	return rc;
}

int kvt_local_get(struct kvt *t, uint64_t id, uint32_t layer, float *mean, uint16_t *k,
		  uint16_t *v, uint32_t n, uint32_t stride)
{
	const uint32_t H = t->pm.g.kv_heads, d = t->pm.g.d;
	uint32_t per = kvd_local_fit(H, d, kvt_slot_size(t));
	/* Several gets in flight: kvd fills one slot while this side copies
	 * another out.  One slot stays free for whoever else needs one. */
	uint32_t depth = t->r.geo.nslots > 2 ? t->r.geo.nslots - 1 : 1;
	uint32_t nchunk, sent = 0, got = 0;
	int slots[64], rc = 0;

	if (!per)
		return kvt_fail(t, -EMSGSIZE, "slots too small for one row");
	nchunk = (n + per - 1) / per;
	depth = depth < 64 ? depth : 64;
	while (got < nchunk) {
		while (!rc && sent < nchunk && sent - got < depth) {
			uint32_t r0 = sent * per, cnt = n - r0 < per ? n - r0 : per;

			rc = local_get_submit(t, id, layer, r0, cnt, r0 == 0 && mean, &slots[sent % 64]);
			if (!rc)
				sent++;
		}
		if (got == sent)
			return rc;
		uint32_t r0 = got * per, cnt = n - r0 < per ? n - r0 : per;
		int slot = slots[got % 64], want_mean = r0 == 0 && mean;
		const struct kvd_local_layout lay = kvd_local_layout(H, d, cnt, want_mean);
		int32_t res;
		const char *msg;
		int wrc = kvt_wait_slot(t, (uint32_t)slot, &res, &msg);

		if (!wrc && res < 0)
			wrc = kvt_fail(t, res, "attach: rows of layer %u: kvd: %s", layer, msg);
		if (!wrc) {
			const char *base = kvt_slot(t, (uint32_t)slot);

			if (want_mean)
				memcpy(mean, base, (size_t)H * d * sizeof *mean);
			for (size_t h = 0; h < H; h++) {
				memcpy(k + (h * stride + r0) * d, base + lay.k + h * cnt * d * 2,
				       (size_t)cnt * d * 2);
				memcpy(v + (h * stride + r0) * d, base + lay.v + h * cnt * d * 2,
				       (size_t)cnt * d * 2);
			}
		}
		/* An owned slot goes back only once kvd is done with it. */
		if (wrc == 0 || t->slot[slot].done)
			kvt_slot_put(t, (uint32_t)slot);
		got++;
		rc = rc ? rc : wrc;
		if (rc && got < sent)
			continue;       /* collect what is in flight before failing */
	}
	return rc;
}

int kvt_seq_free(struct kvt *t, uint64_t id)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqFree sf = KVD__SEQ_FREE__INIT;
	Kvd__Response *r;
	int rc;

	sf.seq = id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_FREE;
	rq.seq_free = &sf;
	r = call(t, &rq, KVD__RESPONSE__BODY_OK, NULL, NULL, &rc);
	kvd_ctl_free_response(r);
	return rc;
}

int kvt_seq_open(struct kvt *t, uint64_t id, uint64_t *tokens)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqOpen so = KVD__SEQ_OPEN__INIT;
	Kvd__Response *r;
	int rc;

	if (!t->have_profile)
		return kvt_fail(t, -EINVAL, "no profile yet");
	so.seq = id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_OPEN;
	rq.seq_open = &so;
	r = call(t, &rq, KVD__RESPONSE__BODY_SEQ, NULL, NULL, &rc);
	if (!r)
		return rc;
	if (r->seq->profile_id != t->profile_id) {
		kvd_ctl_free_response(r);
		return kvt_fail(t, -EINVAL, "sequence %llu was written with another profile",
				(unsigned long long)id);
	}
	*tokens = r->seq->tokens;
	kvd_ctl_free_response(r);
	return 0;
}

int kvt_seq_evict(struct kvt *t, uint64_t id)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqEvict se = KVD__SEQ_EVICT__INIT;
	Kvd__Response *r;
	int rc;

	/* Rows still in flight belong to the data being written out. */
	if ((rc = kvt_drain(t, "evict")))
		return rc;
	se.seq = id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_EVICT;
	rq.seq_evict = &se;
	r = call(t, &rq, KVD__RESPONSE__BODY_OK, NULL, NULL, &rc);
	kvd_ctl_free_response(r);
	return rc;
}

/* ServerStatsReq: the reply (free it with kvd_ctl_free_response), or NULL
 * with *rc. */
static Kvd__Response *server_stats(struct kvt *t, int *rc)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;

	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	return call(t, &rq, KVD__RESPONSE__BODY_SERVER_STATS, NULL, NULL, rc);
}

int kvt_server_stats(struct kvt *t, struct kvc_stats *st)
{
	int rc;
	Kvd__Response *r = server_stats(t, &rc);

	if (!r)
		return rc;
	const Kvd__ServerStats *m = r->server_stats;

	*st = (struct kvc_stats){
		.clients = m->clients, .sequences = m->sequences, .profiles = m->profiles,
		.slots_in_use = m->slots_in_use, .bytes = m->bytes, .requests = m->requests,
		.errors = m->errors, .disconnects = m->disconnects, .mapped_bytes = m->mapped_bytes,
		.mem_limit = m->mem_limit, .mem_high = m->mem_high, .mem_low = m->mem_low,
		.reserved_bytes = m->reserved_bytes, .disk_bytes = m->disk_bytes,
		.on_disk = m->on_disk, .spills = m->spills, .restores = m->restores,
		.drops = m->drops, .spill_errors = m->spill_errors, .lost = m->lost,
		.spill_bytes = m->spill_bytes, .restore_bytes = m->restore_bytes,
		.used_bytes = m->used_bytes, .refused = m->refused,
	};
	kvd_ctl_free_response(r);
	return 0;
}

int kvt_share_stats(struct kvt *t, struct kvc_share_stats *st)
{
	int rc;
	Kvd__Response *r = server_stats(t, &rc);

	if (!r)
		return rc;
	memset(st, 0, sizeof *st);
	for (size_t i = 0; i < r->server_stats->n_share; i++) {
		const Kvd__ShareUsage *u = r->server_stats->share[i];

		st->published += u->published;
		st->published_tokens += u->published_tokens;
		st->hit_tokens += u->hit_tokens;
		st->miss_tokens += u->miss_tokens;
		st->shared_bytes += u->shared_bytes;
		st->saved_bytes += u->saved_bytes;
	}
	kvd_ctl_free_response(r);
	return 0;
}

int kvt_seq_stats(struct kvt *t, uint64_t id, struct kvc_seq_stats *st)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqStatsReq sr = KVD__SEQ_STATS_REQ__INIT;
	Kvd__Response *r;
	int rc;

	sr.seq = id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_STATS;
	rq.seq_stats = &sr;
	r = call(t, &rq, KVD__RESPONSE__BODY_SEQ_STATS, NULL, NULL, &rc);
	if (!r)
		return rc;
	st->tokens = r->seq_stats->tokens;
	st->bytes = r->seq_stats->bytes;
	st->segments = r->seq_stats->segments;
	st->state = r->seq_stats->state;
	st->durable = r->seq_stats->durable;
	st->disk_bytes = r->seq_stats->disk_bytes;
	st->ready_layers = r->seq_stats->ready_layers;
	kvd_ctl_free_response(r);
	return 0;
}
