/* libkvclient, CPU backend.  See kvc.h. */
#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "attn.h"
#include "bf16.h"
#include "ctl.h"
#include "err.h"
#include "kvc.h"
#include "kvd_ring.h"
#include "kvg.h"
#include "lsh.h"
#include "prep.h"
#include "shm.h"
#include "wire.h"

#define APPEND_BATCH 32         /* window evictions sent to kvd together */
#define RX_MAX (KVD_CTL_W_INLINE_MAX + 65536)
#define NOP_TAG UINT64_MAX

enum { SLOT_FREE, SLOT_FIRE, SLOT_OWNED };

struct kvc_layer {
	float *mean;                    /* [H][d]; NULL: dense layer or not prefilled */
	uint16_t *k, *v;                /* [H][cap][d]: sinks, then recent tokens */
	uint32_t n, cap, nsink;
	int prefilled;
};

struct kvc_seq {
	uint64_t id;
	int reopened;                   /* kvc_seq_open: no local part, kvd's alone */
	struct kvc_layer *ly;
	struct kvg_seq *gs;             /* CUDA backend (kvg_cuda.c), else NULL */
};

struct slot {
	uint8_t state, done;
	int32_t res;
	char msg[48];
};

struct kvc {
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
	struct kvc_model m;
	char mname[KVD_CTL_NAME_MAX + 1];
	uint32_t *dense_list;
	uint8_t *dense;
	float *W;
	struct kvd_geom g;
	const struct kvd_kern *kk;
	void *rx;
	struct kvg *gpu;                /* CUDA backend (kvg_cuda.c), else NULL */
	char err[256];
};

static int fail(struct kvc *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int fail(struct kvc *c, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->err, sizeof c->err, fmt, ap);
	va_end(ap);
	return code;
}

const char *kvc_last_error(const struct kvc *c)
{
	return c->err;
}

/* ---- control plane ----------------------------------------------------- */

/* One request, one response.  Returns the response (caller frees) or NULL
 * with *rc and c->err set; an Error response becomes NULL too. */
static Kvd__Response *call(struct kvc *c, Kvd__Request *rq, int *fds, int *nfds, int *rc)
{
	struct kvd_ctl_err e;
	Kvd__Response *r;
	int n, want = nfds ? *nfds : 0;

	rq->id = ++c->next_id;
	*rc = kvd_ctl_send(c->fd, &rq->base, NULL, 0);
	if (*rc) {
		fail(c, *rc, "send %s: %s", kvd_ctl_request_name(rq->body_case), kvd_strerror(*rc));
		return NULL;
	}
	if (nfds)
		*nfds = want;
	n = kvd_ctl_recv(c->fd, c->rx, RX_MAX, fds, nfds);
	if (n <= 0) {
		*rc = n ? n : -ECONNRESET;
		fail(c, *rc, "kvd: %s", n ? kvd_strerror(n) : "connection closed");
		return NULL;
	}
	r = kvd_ctl_decode_response(c->rx, (size_t)n, rq->id, &e);
	if (!r) {
		*rc = e.code;
		fail(c, *rc, "bad reply from kvd: %s", e.msg);
		return NULL;
	}
	if (r->body_case == KVD__RESPONSE__BODY_ERROR) {
		*rc = r->error->code;
		fail(c, *rc, "kvd: %s", r->error->message);
		kvd_ctl_free_response(r);
		return NULL;
	}
	*rc = 0;
	return r;
}

int kvc_connect(const struct kvc_opts *o, struct kvc **out)
{
	const char *path = o && o->socket_path ? o->socket_path : "/run/kvd/kvd.sock";
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct kvc *c = calloc(1, sizeof *c);
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__Hello h = KVD__HELLO__INIT;
	Kvd__Response *r;
	int fds[KVD_CTL_MAX_FDS], nfds = KVD_CTL_MAX_FDS, rc, backend;

	if (!c)
		return -ENOMEM;
	c->fd = c->efd = c->memfd = -1;
	c->rx = malloc(RX_MAX);
	c->kk = kvd_kern_get();
	c->poll = o ? o->poll : 0;
	c->spin_ns = o && o->spin_ns ? o->spin_ns : 50000;
	*out = c;                       /* so kvc_last_error works on failure */
	if (!c->rx)
		return fail(c, -ENOMEM, "out of memory");
	if ((backend = kvg_choose(o, c->err, sizeof c->err)) < 0)
		return backend;
	if (strlen(path) >= sizeof a.sun_path)
		return fail(c, -ENAMETOOLONG, "socket path too long: %s", path);
	memcpy(a.sun_path, path, strlen(path) + 1);
	c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&a, sizeof a))
		return fail(c, -errno, "connect %s: %s", path, strerror(errno));

	h.version = KVD_CTL_VERSION;
	h.tenant = (char *)(o && o->tenant ? o->tenant : "default");
	h.client_name = (char *)(o && o->name ? o->name : "kvc");
	h.poll = c->poll;
	h.slots = o ? o->slots : 0;
	h.slot_size = o ? o->slot_size : 0;
	rq.body_case = KVD__REQUEST__BODY_HELLO;
	rq.hello = &h;
	r = call(c, &rq, fds, &nfds, &rc);
	if (!r) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		return rc;
	}
	if (r->body_case != KVD__RESPONSE__BODY_HELLO || nfds != 2) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		kvd_ctl_free_response(r);
		return fail(c, -KVD_EPROTO, "kvd answered hello without its region");
	}
	c->memfd = fds[0];
	c->efd = fds[1];
	c->map_size = r->hello->region_size;
	kvd_ctl_free_response(r);
	c->map = mmap(NULL, c->map_size, PROT_READ | PROT_WRITE, MAP_SHARED, c->memfd, 0);
	if (c->map == MAP_FAILED) {
		c->map = NULL;
		return fail(c, -errno, "mmap of the shared region: %s", strerror(errno));
	}
	rc = shm_region_attach(&c->r, c->map, c->map_size);
	if (rc)
		return fail(c, rc, "shared region refused: %s", kvd_strerror(rc));
	c->slot = calloc(c->r.geo.nslots, sizeof *c->slot);
	if (!c->slot)
		return fail(c, -ENOMEM, "out of memory");
	if (backend == KVC_BACKEND_CUDA)
		return kvg_open(c, o, c->map, c->map_size, &c->gpu);
	return 0;
}

static void free_layers(struct kvc *c, struct kvc_seq *s)
{
	for (uint32_t l = 0; s->ly && l < c->m.layers; l++) {
		free(s->ly[l].mean);
		free(s->ly[l].k);
		free(s->ly[l].v);
	}
	free(s->ly);
}

void kvc_close(struct kvc *c)
{
	if (!c)
		return;
	kvg_close(c->gpu);              /* unregisters the region: before munmap */
	if (c->map)
		munmap(c->map, c->map_size);
	if (c->memfd >= 0)
		close(c->memfd);
	if (c->efd >= 0)
		close(c->efd);
	if (c->fd >= 0)
		close(c->fd);
	free(c->slot);
	free(c->dense_list);
	free(c->dense);
	free(c->W);
	free(c->rx);
	free(c);
}

/* kvc.h's numbers are the wire's and the engine's. */
static_assert((int)KVC_KV_BF16 == (int)KVD_KV_BF16 && (int)KVC_KV_INT8 == (int)KVD_KV_INT8,
	      "kvc_kv_dtype");

static const char *dtype_name(uint32_t dt)
{
	const char *s = kvd_kv_dtype_name(dt);

	return s ? s : "unknown";
}

int kvc_profile(struct kvc *c, const struct kvc_model *m)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ProfileCreate pc = KVD__PROFILE_CREATE__INIT;
	Kvd__Profile p = KVD__PROFILE__INIT;
	Kvd__Response *r;
	int rc;

	if (c->have_profile)
		return fail(c, -EALREADY, "this connection already has a profile");
	p.name = (char *)m->name;
	p.layers = m->layers;
	p.q_heads = m->q_heads;
	p.kv_heads = m->kv_heads;
	p.head_dim = m->head_dim;
	p.k_bits = m->K;
	p.tables = m->L;
	p.min_collisions = m->c;
	p.kv_dtype = m->kv_dtype;
	p.sink_tokens = m->sink;
	p.window_tokens = m->window;
	p.n_dense_layers = m->n_dense;
	p.dense_layers = (uint32_t *)m->dense_layers;
	p.seed = m->seed;
	p.segment_tokens = m->segment_tokens;
	p.seal_tokens = m->seal_tokens;
	pc.profile = &p;
	rq.body_case = KVD__REQUEST__BODY_PROFILE_CREATE;
	rq.profile_create = &pc;
	r = call(c, &rq, NULL, NULL, &rc);
	if (!r)
		return rc;
	if (r->body_case != KVD__RESPONSE__BODY_PROFILE) {
		kvd_ctl_free_response(r);
		return fail(c, -KVD_EPROTO, "kvd answered a profile request with something else");
	}

	const Kvd__Profile *got = r->profile->profile;

	/* proto3 drops a field the peer does not know: an older kvd would
	 * answer bf16 to an int8 request, silently. */
	if (got->kv_dtype != m->kv_dtype) {
		rc = fail(c, -EOPNOTSUPP, "kvd made profile '%s' kv_dtype %s, not %s as asked "
			  "(a kvd without kv_dtype?)", got->name, dtype_name(got->kv_dtype),
			  dtype_name(m->kv_dtype));
		kvd_ctl_free_response(r);
		return rc;
	}
	c->profile_id = r->profile->profile_id;
	snprintf(c->mname, sizeof c->mname, "%s", got->name);
	c->m = (struct kvc_model){
		.name = c->mname, .layers = got->layers, .q_heads = got->q_heads,
		.kv_heads = got->kv_heads, .head_dim = got->head_dim, .K = got->k_bits,
		.L = got->tables, .c = got->min_collisions, .sink = got->sink_tokens,
		.window = got->window_tokens, .n_dense = (uint32_t)got->n_dense_layers,
		.kv_dtype = got->kv_dtype,
		.seed = got->seed, .segment_tokens = got->segment_tokens,
		.seal_tokens = got->seal_tokens,
	};
	kvd_ctl_profile_to_geom(got, &c->g);
	c->dense_list = malloc((got->n_dense_layers + 1) * sizeof *c->dense_list);
	c->dense = calloc(got->layers, 1);
	c->W = malloc((size_t)c->g.d * c->g.K * c->g.L * sizeof *c->W);
	if (!c->dense_list || !c->dense || !c->W) {
		kvd_ctl_free_response(r);
		return fail(c, -ENOMEM, "out of memory");
	}
	for (size_t i = 0; i < got->n_dense_layers; i++) {
		c->dense_list[i] = got->dense_layers[i];
		c->dense[got->dense_layers[i]] = 1;
	}
	c->m.dense_layers = c->dense_list;
	rc = kvd_ctl_profile_w(r->profile, c->W);
	kvd_ctl_free_response(r);
	if (rc)
		return fail(c, rc, "projection matrix from kvd unusable");
	c->have_profile = 1;
	return c->gpu ? kvg_profile(c, c->gpu) : 0;
}

const struct kvc_model *kvc_model_of(const struct kvc *c)
{
	return c->have_profile ? &c->m : NULL;
}

const float *kvc_w(const struct kvc *c)
{
	return c->W;
}

/* ---- rings ------------------------------------------------------------- */

/* Takes what the completion ring holds; with `block`, waits for at least one
 * completion first.  0 or a negative code. */
static int reap(struct kvc *c, int block)
{
	int n = shm_ring_ready(&c->r.cq);

	while (n == 0 && block) {
		/* Wake up now and then to see whether kvd is still there: a
		 * daemon that died leaves the control socket hung up, and
		 * nothing else would ever end this wait. */
		n = shm_ring_wait(&c->r.cq, c->spin_ns, 200000000ull, c->poll);
		if (n == -EINTR)
			n = 0;
		if (n == 0) {
			struct pollfd pf = { .fd = c->fd, .events = POLLRDHUP };

			if (poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR)))
				return fail(c, -ECONNRESET, "kvd went away");
		}
	}
	if (n < 0)
		return fail(c, n, "completion ring corrupted");
	for (int i = 0; i < n; i++) {
		struct kvd_cqe e;

		memcpy(&e, shm_ring_entry(&c->r.cq, (uint32_t)i), sizeof e);
		e.msg[sizeof e.msg - 1] = 0;
		if (e.user_data == NOP_TAG) {
			c->nop_done = 1;
			continue;
		}
		if (e.user_data >= c->r.geo.nslots)
			continue;       /* not ours: kvd never does this */
		struct slot *sl = &c->slot[e.user_data];

		sl->done = 1;
		sl->res = e.res;
		memcpy(sl->msg, e.msg, sizeof sl->msg);
		if (sl->state == SLOT_FIRE) {
			if (e.res < 0 && !c->fire_err) {
				c->fire_err = e.res;
				snprintf(c->fire_msg, sizeof c->fire_msg, "%s", e.msg);
			}
			sl->state = SLOT_FREE;
			c->fire_inflight--;
		}
	}
	shm_ring_release(&c->r.cq, (uint32_t)n);
	return 0;
}

static int submit(struct kvc *c, const struct kvd_sqe *e)
{
	void *p;
	int rc;

	while (!(p = shm_ring_reserve(&c->r.sq))) {
		if (shm_ring_broken(&c->r.sq))
			return fail(c, -EPROTO, "submission ring corrupted");
		if ((rc = reap(c, 1)))
			return rc;
	}
	memcpy(p, e, sizeof *e);
	shm_ring_commit(&c->r.sq, 1);
	if (shm_ring_needs_kick(&c->r.sq)) {
		uint64_t one = 1;

		if (write(c->efd, &one, sizeof one) < 0 && errno != EAGAIN)
			return fail(c, -errno, "kick kvd: %s", strerror(errno));
	}
	return 0;
}

/* A free slot, waiting for completions when all are in use. */
static int slot_get(struct kvc *c, int state)
{
	for (;;) {
		for (uint32_t i = 0; i < c->r.geo.nslots; i++) {
			if (c->slot[i].state == SLOT_FREE) {
				c->slot[i] = (struct slot){ .state = (uint8_t)state };
				if (state == SLOT_FIRE)
					c->fire_inflight++;
				return (int)i;
			}
		}
		int rc = reap(c, 1);

		if (rc)
			return rc;
	}
}

static int wait_slot(struct kvc *c, int i)
{
	while (!c->slot[i].done) {
		int rc = reap(c, 1);

		if (rc)
			return rc;
	}
	return 0;
}

static int drain_fire(struct kvc *c, const char *what)
{
	int rc;

	while (c->fire_inflight)
		if ((rc = reap(c, 1)))
			return rc;
	if (c->fire_err) {
		rc = c->fire_err;
		c->fire_err = 0;
		return fail(c, rc, "%s: kvd: %s", what, c->fire_msg);
	}
	return 0;
}

int kvc_nop(struct kvc *c)
{
	struct kvd_sqe e = { .op = KVD_OP_NOP, .user_data = NOP_TAG };
	int rc;

	c->nop_done = 0;
	if ((rc = submit(c, &e)))
		return rc;
	while (!c->nop_done)
		if ((rc = reap(c, 1)))
			return rc;
	return 0;
}

/* ---- sequences --------------------------------------------------------- */

int kvc_seq_create(struct kvc *c, struct kvc_seq **out)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqCreate sc = KVD__SEQ_CREATE__INIT;
	Kvd__Response *r;
	struct kvc_seq *s;
	int rc;

	if (!c->have_profile)
		return fail(c, -EINVAL, "no profile yet");
	sc.profile_id = c->profile_id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_CREATE;
	rq.seq_create = &sc;
	r = call(c, &rq, NULL, NULL, &rc);
	if (!r)
		return rc;
	s = calloc(1, sizeof *s);
	if (s)
		s->ly = calloc(c->m.layers, sizeof *s->ly);
	if (!s || !s->ly || r->body_case != KVD__RESPONSE__BODY_SEQ) {
		free(s ? s->ly : NULL);
		free(s);
		kvd_ctl_free_response(r);
		return fail(c, -ENOMEM, "out of memory");
	}
	s->id = r->seq->seq;
	kvd_ctl_free_response(r);
	*out = s;
	return 0;
}

uint64_t kvc_seq_id(const struct kvc_seq *s)
{
	return s->id;
}

int kvc_seq_free(struct kvc *c, struct kvc_seq *s)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqFree sf = KVD__SEQ_FREE__INIT;
	Kvd__Response *r;
	int rc;

	sf.seq = s->id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_FREE;
	rq.seq_free = &sf;
	r = call(c, &rq, NULL, NULL, &rc);
	kvd_ctl_free_response(r);
	if (c->gpu)
		kvg_seq_free(c, c->gpu, s->gs);
	free_layers(c, s);
	free(s);
	return rc;
}

static int local_reserve(struct kvc *c, struct kvc_layer *l, uint32_t need)
{
	size_t H = c->g.kv_heads, d = c->g.d;
	uint32_t cap = l->cap ? l->cap : 64;

	if (need <= l->cap)
		return 0;
	while (cap < need)
		cap *= 2;
	uint16_t *nk = malloc(H * cap * d * 2), *nv = malloc(H * cap * d * 2);

	if (!nk || !nv) {
		free(nk);
		free(nv);
		return fail(c, -ENOMEM, "out of memory");
	}
	for (size_t h = 0; h < H && l->n; h++) {
		memcpy(nk + h * cap * d, l->k + h * l->cap * d, (size_t)l->n * d * 2);
		memcpy(nv + h * cap * d, l->v + h * l->cap * d, (size_t)l->n * d * 2);
	}
	free(l->k);
	free(l->v);
	l->k = nk;
	l->v = nv;
	l->cap = cap;
	return 0;
}

/* Appends tokens [t0, t0+cnt) of k, v ([H][n][d]) to the local rows,
 * centered with l->mean (NULL: as they are) and rounded to bf16 the same way
 * kvd_prep_rows rounds what goes to kvd. */
static int local_put(struct kvc *c, struct kvc_layer *l, const float *k, const float *v,
		     uint32_t n, uint32_t t0, uint32_t cnt)
{
	size_t H = c->g.kv_heads, d = c->g.d;
	int rc = local_reserve(c, l, l->n + cnt);

	if (rc)
		return rc;
	for (size_t h = 0; h < H; h++) {
		const float *m = l->mean ? l->mean + h * d : NULL;

		for (uint32_t i = 0; i < cnt; i++) {
			const float *kr = k + (h * n + t0 + i) * d, *vr = v + (h * n + t0 + i) * d;
			uint16_t *kd = l->k + (h * l->cap + l->n + i) * d;
			uint16_t *vd = l->v + (h * l->cap + l->n + i) * d;

			for (size_t e = 0; e < d; e++) {
				kd[e] = kvd_f32_to_bf16(m ? kr[e] - m[e] : kr[e]);
				vd[e] = kvd_f32_to_bf16(vr[e]);
			}
		}
	}
	l->n += cnt;
	return 0;
}

/* Largest number of tokens whose rows fit one slot. */
static uint32_t chunk_tokens(const struct kvc *c)
{
	uint32_t lo = 0, hi = KVD_WIRE_MAX_NTOK;

	while (lo < hi) {
		uint32_t mid = (lo + hi + 1) / 2;

		if (kvd_rows_bytes(c->g.kv_heads, c->g.d, c->g.L, mid, 1) <= c->r.geo.slot_size)
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

int kvc_prefill(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k,
		const float *v, uint32_t n)
{
	const uint32_t H = c->g.kv_heads, d = c->g.d, L = c->g.L;
	struct kvc_layer *l;
	uint32_t chunk, lo, hi;
	float *x;
	int rc;

	if (c->gpu)
		return kvg_prefill_host(c, s, layer, k, v, n);
	if (!c->have_profile || layer >= c->m.layers)
		return fail(c, -EINVAL, "layer %u out of range", layer);
	l = &s->ly[layer];
	if (l->prefilled)
		return fail(c, -EALREADY, "layer %u already prefilled", layer);
	l->prefilled = 1;
	if (c->dense[layer])
		return local_put(c, l, k, v, n, 0, n);

	l->nsink = n < c->m.sink ? n : c->m.sink;
	lo = l->nsink;
	hi = n - lo > c->m.window ? n - c->m.window : lo;
	l->mean = malloc((size_t)H * d * sizeof *l->mean);
	if (!l->mean)
		return fail(c, -ENOMEM, "out of memory");
	kvd_prep_mean(k, H, d, n, lo, hi, l->mean);
	if ((rc = local_put(c, l, k, v, n, 0, lo)) || (rc = local_put(c, l, k, v, n, hi, n - hi)))
		return rc;

	chunk = chunk_tokens(c);
	if (chunk == 0)
		return fail(c, -EMSGSIZE, "slots of %llu bytes hold no token",
			    (unsigned long long)c->r.geo.slot_size);
	x = malloc((size_t)chunk * d * sizeof *x);
	if (!x)
		return fail(c, -ENOMEM, "out of memory");
	for (uint32_t t = lo; t < hi || t == lo; t += chunk) {
		uint32_t cnt = hi - t < chunk ? hi - t : chunk;
		int first = t == lo, last = t + cnt >= hi;
		int slot = slot_get(c, SLOT_FIRE);

		if (slot < 0) {
			free(x);
			return slot;
		}
		char *base = shm_slot(&c->r, (uint32_t)slot);
		uint64_t mb = first ? KVD_ALIGN64((uint64_t)H * d * 4) : 0;
		uint64_t rb = KVD_ALIGN64((uint64_t)H * cnt * d * 2);
		struct kvd_sqe e = {
			.op = KVD_OP_PREFILL, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
			.user_data = (uint64_t)slot, .seq = s->id,
			.len = (uint32_t)kvd_rows_bytes(H, d, L, cnt, first), .ntok = cnt,
			.flags = (uint8_t)((first ? KVD_RF_MEAN : 0) | (last ? KVD_RF_LAST : 0)),
		};

		if (first)
			memcpy(base, l->mean, (size_t)H * d * sizeof(float));
		/* Rows go straight into the slot: the arena is the only copy. */
		kvd_prep_rows(&c->g, c->W, l->mean, k, v, n, t, cnt, (uint16_t *)(base + mb),
			      (uint16_t *)(base + mb + rb), (uint16_t *)(base + mb + 2 * rb), x);
		if ((rc = submit(c, &e))) {
			free(x);
			return rc;
		}
		if (last)
			break;
	}
	free(x);
	return drain_fire(c, "prefill");
}

/* Sends the oldest `cnt` recent rows of a sparse layer to kvd. */
static int evict(struct kvc *c, struct kvc_seq *s, uint32_t layer, uint32_t cnt)
{
	struct kvc_layer *l = &s->ly[layer];
	const uint32_t H = c->g.kv_heads, d = c->g.d, L = c->g.L;
	int slot = slot_get(c, SLOT_FIRE);
	float *x;
	int rc;

	if (slot < 0)
		return slot;
	if (kvd_rows_bytes(H, d, L, cnt, 0) > c->r.geo.slot_size)
		return fail(c, -EMSGSIZE, "slots too small for %u appended tokens", cnt);
	x = malloc((size_t)cnt * d * sizeof *x);
	if (!x)
		return fail(c, -ENOMEM, "out of memory");

	char *base = shm_slot(&c->r, (uint32_t)slot);
	uint64_t rb = KVD_ALIGN64((uint64_t)H * cnt * d * 2);
	uint16_t *kb = (uint16_t *)base, *vb = (uint16_t *)(base + rb);
	uint16_t *codes = (uint16_t *)(base + 2 * rb);

	for (uint32_t h = 0; h < H; h++) {
		const uint16_t *src_k = l->k + ((size_t)h * l->cap + l->nsink) * d;
		const uint16_t *src_v = l->v + ((size_t)h * l->cap + l->nsink) * d;

		memcpy(kb + (size_t)h * cnt * d, src_k, (size_t)cnt * d * 2);
		memcpy(vb + (size_t)h * cnt * d, src_v, (size_t)cnt * d * 2);
		kvd_bf16_to_f32_n(x, src_k, (size_t)cnt * d);
		kvd_lsh_hash(c->W, (int)d, (int)c->g.K, (int)L, x, d, cnt,
			     codes + (size_t)h * L * cnt, cnt);
		/* the window slides down over the evicted rows */
		memmove(l->k + ((size_t)h * l->cap + l->nsink) * d, src_k + (size_t)cnt * d,
			(size_t)(l->n - l->nsink - cnt) * d * 2);
		memmove(l->v + ((size_t)h * l->cap + l->nsink) * d, src_v + (size_t)cnt * d,
			(size_t)(l->n - l->nsink - cnt) * d * 2);
	}
	free(x);
	l->n -= cnt;

	struct kvd_sqe e = {
		.op = KVD_OP_APPEND, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
		.user_data = (uint64_t)slot, .seq = s->id,
		.len = (uint32_t)kvd_rows_bytes(H, d, L, cnt, 0), .ntok = cnt,
	};

	if ((rc = submit(c, &e)))
		return rc;
	return drain_fire(c, "append");
}

int kvc_append(struct kvc *c, struct kvc_seq *s, uint32_t layer, const float *k, const float *v)
{
	struct kvc_layer *l;
	int rc;

	if (c->gpu)
		return kvg_append_host(c, s, layer, k, v);
	if (!c->have_profile || layer >= c->m.layers)
		return fail(c, -EINVAL, "layer %u out of range", layer);
	l = &s->ly[layer];
	if (s->reopened)
		return fail(c, -EINVAL, "sequence %llu was reopened: its window did not survive, "
			    "so it can be attended but not extended", (unsigned long long)s->id);
	if (!l->prefilled)
		return fail(c, -EINVAL, "layer %u: append before prefill", layer);
	if ((rc = local_put(c, l, k, v, 1, 0, 1)))
		return rc;
	if (!c->dense[layer] && l->n - l->nsink >= c->m.window + APPEND_BATCH)
		return evict(c, s, layer, APPEND_BATCH);
	return 0;
}

/* ---- attention --------------------------------------------------------- */

struct batch {
	int slot;
	uint32_t first, nseq;
};

/* Submits kvd's part for seqs[0..nseq) in as many slots as it takes. */
static int attend_submit(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs,
			 uint32_t nseq, const float *q, struct batch *b, uint32_t *nb)
{
	const uint32_t Hq = c->g.q_heads, d = c->g.d, L = c->g.L;
	uint64_t in = kvd_attend_in_bytes(Hq, d, L), out = kvd_attend_out_bytes(Hq, d);
	uint64_t per = c->r.geo.slot_size / (in + out);
	int rc;

	if (per == 0)
		return fail(c, -EMSGSIZE, "slots too small for one query");
	*nb = 0;
	for (uint32_t i = 0; i < nseq; i += (uint32_t)per) {
		uint32_t cnt = nseq - i < per ? nseq - i : (uint32_t)per;
		int slot = slot_get(c, SLOT_OWNED);

		if (slot < 0)
			return slot;
		char *base = shm_slot(&c->r, (uint32_t)slot);

		for (uint32_t j = 0; j < cnt; j++) {
			char *rec = base + j * in;
			const float *qs = q + (size_t)(i + j) * Hq * d;

			memset(rec, 0, 64);
			memcpy(rec, &seqs[i + j]->id, sizeof(uint64_t));
			memcpy(rec + 64, qs, (size_t)Hq * d * sizeof(float));
			kvd_prep_query_codes(&c->g, c->W, qs,
					     (uint16_t *)(rec + 64 + KVD_ALIGN64((uint64_t)Hq * d * 4)));
		}
		struct kvd_sqe e = {
			.op = KVD_OP_ATTEND, .layer = (uint16_t)layer, .slot = (uint32_t)slot,
			.user_data = (uint64_t)slot, .len = (uint32_t)(cnt * in), .nseq = cnt,
			.out_off = (uint32_t)KVD_ALIGN64(cnt * in), .out_len = (uint32_t)(cnt * out),
		};

		b[*nb] = (struct batch){ slot, i, cnt };
		++*nb;
		if ((rc = submit(c, &e)))
			return rc;
	}
	return 0;
}

/* Waits for batch b and hands its (o, lse) per sequence to fn. */
static int attend_collect(struct kvc *c, const struct batch *b, float *o, float *lse, int merge)
{
	const uint32_t Hq = c->g.q_heads, d = c->g.d, G = kvd_geom_group(&c->g);
	int rc = wait_slot(c, b->slot);
	struct slot *sl = &c->slot[b->slot];

	if (rc)
		return rc;
	if (sl->res < 0) {
		rc = sl->res;
		sl->state = SLOT_FREE;
		return fail(c, rc, "attend: kvd: %s", sl->msg);
	}
	const char *base = shm_slot(&c->r, (uint32_t)b->slot);
	uint64_t in = kvd_attend_in_bytes(Hq, d, c->g.L), out = kvd_attend_out_bytes(Hq, d);
	const char *res = base + KVD_ALIGN64(b->nseq * in);

	for (uint32_t j = 0; j < b->nseq; j++) {
		const float *ko = (const float *)(res + j * out);
		const float *kl = (const float *)(res + j * out + KVD_ALIGN64((uint64_t)Hq * d * 4));
		float *oo = o + (size_t)(b->first + j) * Hq * d, *ll = lse + (size_t)(b->first + j) * Hq;

		if (merge) {
			for (uint32_t h = 0; h < Hq; h += G)
				kvd_attn_merge(oo + (size_t)h * d, ll + h, ko + (size_t)h * d, kl + h,
					       (int)G, (int)d);
		} else {
			memcpy(oo, ko, (size_t)Hq * d * sizeof(float));
			memcpy(ll, kl, (size_t)Hq * sizeof(float));
		}
	}
	sl->state = SLOT_FREE;
	return 0;
}

/* The client's exact part: every local row of every sequence. */
static void attend_local(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs,
			 uint32_t nseq, const float *q, float *o, float *lse)
{
	const uint32_t Hq = c->g.q_heads, d = c->g.d, G = kvd_geom_group(&c->g);
	float s[KVD_ATTN_DENSE_SCRATCH];

	for (uint32_t i = 0; i < nseq; i++) {
		const struct kvc_layer *l = &seqs[i]->ly[layer];

		for (uint32_t h = 0; h < c->g.kv_heads; h++) {
			size_t qo = ((size_t)i * Hq + (size_t)h * G) * d;

			kvd_attn_dense(c->kk, q + qo, (int)G, (int)d, l->k ? l->k + (size_t)h * l->cap * d : NULL,
				       l->v ? l->v + (size_t)h * l->cap * d : NULL, l->n, o + qo,
				       lse + (size_t)i * Hq + (size_t)h * G, s);
		}
	}
}

static int attend(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		  const float *q, float *o, float *lse, int kvd_only)
{
	struct batch *b;
	uint32_t nb = 0;
	float *lbuf = NULL;
	int rc = 0;

	if (c->gpu)
		return kvg_attend_host(c, layer, seqs, nseq, q, o, lse, kvd_only);
	if (!c->have_profile || layer >= c->m.layers)
		return fail(c, -EINVAL, "layer %u out of range", layer);
	for (uint32_t i = 0; i < nseq; i++)
		if (!seqs[i]->ly[layer].prefilled)
			return fail(c, -EINVAL, "layer %u of sequence %u not prefilled", layer, i);
	if (!lse) {
		lbuf = malloc((size_t)nseq * c->g.q_heads * sizeof *lbuf);
		if (!lbuf)
			return fail(c, -ENOMEM, "out of memory");
		lse = lbuf;
	}
	if (c->dense[layer]) {
		if (kvd_only)
			rc = fail(c, -EINVAL, "layer %u is dense: kvd holds nothing", layer);
		else
			attend_local(c, layer, seqs, nseq, q, o, lse);
		free(lbuf);
		return rc;
	}
	b = malloc((nseq + 1) * sizeof *b);
	if (!b) {
		free(lbuf);
		return fail(c, -ENOMEM, "out of memory");
	}
	rc = attend_submit(c, layer, seqs, nseq, q, b, &nb);
	/* kvd works on its part while we do ours. */
	if (!rc && !kvd_only)
		attend_local(c, layer, seqs, nseq, q, o, lse);
	for (uint32_t i = 0; i < nb; i++) {
		int r2 = attend_collect(c, &b[i], o, lse, !kvd_only);

		rc = rc ? rc : r2;
	}
	free(b);
	free(lbuf);
	return rc;
}

int kvc_attend(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
	       const float *q, float *o, float *lse)
{
	return attend(c, layer, seqs, nseq, q, o, lse, 0);
}

int kvc_attend_kvd(struct kvc *c, uint32_t layer, struct kvc_seq *const *seqs, uint32_t nseq,
		   const float *q, float *o, float *lse)
{
	return attend(c, layer, seqs, nseq, q, o, lse, 1);
}

/* ---- stats ------------------------------------------------------------- */

int kvc_server_stats(struct kvc *c, struct kvc_stats *st)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	Kvd__Response *r;
	int rc;

	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;
	r = call(c, &rq, NULL, NULL, &rc);
	if (!r)
		return rc;
	if (r->body_case != KVD__RESPONSE__BODY_SERVER_STATS) {
		kvd_ctl_free_response(r);
		return fail(c, -KVD_EPROTO, "unexpected reply");
	}
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

int kvc_seq_stats(struct kvc *c, const struct kvc_seq *s, struct kvc_seq_stats *st)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqStatsReq sr = KVD__SEQ_STATS_REQ__INIT;
	Kvd__Response *r;
	int rc;

	sr.seq = s->id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_STATS;
	rq.seq_stats = &sr;
	r = call(c, &rq, NULL, NULL, &rc);
	if (!r)
		return rc;
	if (r->body_case != KVD__RESPONSE__BODY_SEQ_STATS) {
		kvd_ctl_free_response(r);
		return fail(c, -KVD_EPROTO, "unexpected reply");
	}
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

/* ---- tiers ------------------------------------------------------------- */

int kvc_seq_open(struct kvc *c, uint64_t id, struct kvc_seq **out, uint64_t *tokens)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqOpen so = KVD__SEQ_OPEN__INIT;
	Kvd__Response *r;
	struct kvc_seq *s;
	int rc;

	if (!c->have_profile)
		return fail(c, -EINVAL, "no profile yet");
	so.seq = id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_OPEN;
	rq.seq_open = &so;
	r = call(c, &rq, NULL, NULL, &rc);
	if (!r)
		return rc;
	if (r->body_case != KVD__RESPONSE__BODY_SEQ) {
		kvd_ctl_free_response(r);
		return fail(c, -KVD_EPROTO, "unexpected reply");
	}
	if (r->seq->profile_id != c->profile_id) {
		kvd_ctl_free_response(r);
		return fail(c, -EINVAL, "sequence %llu was written with another profile",
			    (unsigned long long)id);
	}
	s = calloc(1, sizeof *s);
	if (s)
		s->ly = calloc(c->m.layers, sizeof *s->ly);
	if (!s || !s->ly) {
		free(s ? s->ly : NULL);
		free(s);
		kvd_ctl_free_response(r);
		return fail(c, -ENOMEM, "out of memory");
	}
	s->id = r->seq->seq;
	s->reopened = 1;
	for (uint32_t l = 0; l < c->m.layers; l++)
		s->ly[l].prefilled = 1;
	if (tokens)
		*tokens = r->seq->tokens;
	kvd_ctl_free_response(r);
	*out = s;
	return 0;
}

int kvc_seq_evict(struct kvc *c, struct kvc_seq *s)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqEvict se = KVD__SEQ_EVICT__INIT;
	Kvd__Response *r;
	int rc;

	/* Rows still in flight belong to the data being written out. */
	if ((rc = drain_fire(c, "evict")))
		return rc;
	se.seq = s->id;
	rq.body_case = KVD__REQUEST__BODY_SEQ_EVICT;
	rq.seq_evict = &se;
	r = call(c, &rq, NULL, NULL, &rc);
	kvd_ctl_free_response(r);
	return rc;
}

int kvc_prefetch(struct kvc *c, struct kvc_seq *s)
{
	int slot = slot_get(c, SLOT_OWNED), rc;

	if (slot < 0)
		return slot;
	struct kvd_sqe e = { .op = KVD_OP_PREFETCH, .seq = s->id, .user_data = (uint64_t)slot };

	if ((rc = submit(c, &e)) || (rc = wait_slot(c, slot))) {
		c->slot[slot].state = SLOT_FREE;
		return rc;
	}
	rc = c->slot[slot].res;
	c->slot[slot].state = SLOT_FREE;
	return rc < 0 ? fail(c, rc, "prefetch: kvd: %s", c->slot[slot].msg) : 0;
}

/* ---- for the CUDA backend (kvg.h) ---------------------------------------- */

int kvc_backend(const struct kvc *c)
{
	return c->gpu ? KVC_BACKEND_CUDA : KVC_BACKEND_CPU;
}

int kvci_fail(struct kvc *c, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->err, sizeof c->err, fmt, ap);
	va_end(ap);
	return code;
}

struct kvg *kvci_gpu(const struct kvc *c) { return c->gpu; }
int kvci_profiled(const struct kvc *c) { return c->have_profile; }
const struct kvd_geom *kvci_geom(const struct kvc *c) { return &c->g; }
int kvci_dense(const struct kvc *c, uint32_t layer) { return c->dense[layer]; }
struct kvg_seq **kvci_seq_gpu(struct kvc_seq *s) { return &s->gs; }
uint32_t kvci_nslots(const struct kvc *c) { return c->r.geo.nslots; }
uint64_t kvci_slot_size(const struct kvc *c) { return c->r.geo.slot_size; }
void *kvci_slot(const struct kvc *c, uint32_t i) { return shm_slot(&c->r, i); }
int kvci_slot_get(struct kvc *c, int fire) { return slot_get(c, fire ? SLOT_FIRE : SLOT_OWNED); }
int kvci_submit(struct kvc *c, const struct kvd_sqe *e) { return submit(c, e); }
int kvci_drain(struct kvc *c, const char *what) { return drain_fire(c, what); }

void kvci_slot_put(struct kvc *c, uint32_t i)
{
	if (c->slot[i].state == SLOT_FIRE)
		c->fire_inflight--;     /* taken back before it was submitted */
	c->slot[i].state = SLOT_FREE;
}

int kvci_wait_slot(struct kvc *c, uint32_t i, int32_t *res, const char **msg)
{
	int rc = wait_slot(c, (int)i);

	*res = c->slot[i].res;
	*msg = c->slot[i].msg;
	return rc;
}
