/* A raw client for the integration tests: kvd's control protocol spoken by
 * hand (Hello, ProfileCreate/Open, SeqCreate, any request through
 * raw_call), so a test can send what libkvclient never would (a SeqCreate
 * whose parent is made up or being freed, a pipelined flood, Hellos over a
 * limit) and see kvd's answer as it comes.  Header-only, like daemon.h.
 *
 * The functions are static __attribute__((unused)) rather than static
 * inline: a test that uses part of them gets no -Wunused-function, and GCC
 * inlines them as it did when each test had its own static copies.  Marked
 * inline, they (raw_expect with them) get inlined into the tests, and -O2
 * then reports false -Wmaybe-uninitialized (an error under -Werror) on the
 * replies and ids that are filled in only when raw_expect() returns 0.
 *
 * Nothing here asserts: it runs in forked children and threads, where
 * cmocka's asserts must not be used.  Errors come back as a return value
 * (an Error's code, or a negative errno for the transport), with a message
 * in x->msg.  The ring of the region raw_hello maps is the caller's to
 * drive: the tests do that each their own way.
 */
#ifndef KVD_TEST_RAW_H
#define KVD_TEST_RAW_H

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "engine/err.h"
#include "proto/ctl.h"
#include "proto/kvd_ring.h"
#include "shm/shm.h"

#define RX_CAP  KVD_CTL_RX_MAX
#define CALL_MS 60000           /* control replies: generous for sanitizer builds */
#define RAW_RING_WAITS 3000     /* completions: 3000 waits of 100 ms at most */

struct raw {
	int fd;
	struct shm_region r;
	void *map;
	size_t size;
	int efd;
	uint64_t next;          /* the last request id */
	uint64_t ud;            /* the last ring user_data, for callers that count them */
	uint8_t *rx;
	int code;               /* the last reply's Error code (0: another body) */
	char msg[256];          /* its message, or what went wrong otherwise */
};

/* Connects to kvd's socket `sock` (a struct daemon's .sock); nonblock makes
 * the socket non-blocking (for callers that pipeline by hand).  0 or -errno;
 * raw_close() either way. */
static __attribute__((unused)) int raw_open(struct raw *x, const char *sock, int nonblock)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };

	memset(x, 0, sizeof *x);
	x->efd = -1;
	x->rx = malloc(KVD_CTL_RX_MAX);
	memcpy(a.sun_path, sock, strlen(sock) + 1);
	x->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);
	if (x->fd < 0 || !x->rx)
		return -errno;
	return connect(x->fd, (struct sockaddr *)&a, sizeof a) ? -errno : 0;
}

static __attribute__((unused)) void raw_close(struct raw *x)
{
	if (x->map)
		munmap(x->map, x->size);
	if (x->efd >= 0)
		close(x->efd);
	if (x->fd >= 0)
		close(x->fd);
	free(x->rx);
	memset(x, 0, sizeof *x);
	x->fd = x->efd = -1;
}

/* Sends rq and waits for its Response, of body want (0: any, an Error
 * included).  NULL with *err: -ETIMEDOUT, -EPIPE (kvd closed the
 * connection), -EBADMSG (the reply does not decode or is of another body),
 * an Error's code (with want), or the send's or receive's -errno; the
 * message in x->msg.
 * A reply that decodes sets x->code and x->msg afresh: its Error's, or 0
 * and "".  Stray fds that come when none are asked for are closed. */
static __attribute__((unused)) Kvd__Response *raw_call(struct raw *x, Kvd__Request *rq, int want,
							 int *fds, int *nfds, int *err)
{
	struct kvd_ctl_err e;
	int spare[KVD_CTL_MAX_FDS], nspare = KVD_CTL_MAX_FDS;
	Kvd__Response *r;

	if (!fds) {
		fds = spare;
		nfds = &nspare;
	}
	rq->id = ++x->next;
	r = kvd_ctl_call(x->fd, rq, (Kvd__Response__BodyCase)want, x->rx, CALL_MS, fds, nfds, &e);
	if (fds == spare)
		for (int i = 0; i < nspare; i++)
			close(spare[i]);
	x->code = 0;
	snprintf(x->msg, sizeof x->msg, "%s", r ? "" : e.msg);
	if (r && r->body_case == KVD__RESPONSE__BODY_ERROR) {
		x->code = r->error->code;
		snprintf(x->msg, sizeof x->msg, "%s", r->error->message);
	}
	if (r)
		return r;
	if (e.remote)
		x->code = e.code;
	/* a reply of another body, or one that does not decode */
	if (!e.remote && (e.code == -KVD_EFORMAT || e.code == -KVD_EPROTO ||
			  e.code == -EPROTONOSUPPORT))
		*err = -EBADMSG;
	else
		*err = e.code < 0 ? e.code : -EIO;
	return NULL;
}

/* Error code of a reply that should have been `want`: 0 when it was (the
 * reply in *out, or freed when out is NULL), the Error's code, or a
 * transport error (the message in x->msg). */
static __attribute__((unused)) int raw_expect(struct raw *x, Kvd__Request *rq, int want,
					      Kvd__Response **out)
{
	int err = 0;
	Kvd__Response *r;

	/* set on every path: the callers read *out after a 0, and -O2 cannot
	 * tell that raw_call() never fails with err 0 */
	if (out)
		*out = NULL;
	r = raw_call(x, rq, want, NULL, NULL, &err);
	if (!r)
		return err;
	if (out)
		*out = r;
	else
		kvd_ctl_free_response(r);
	return 0;
}

/* Hello as client `client` of `tenant`, and map the region: 0, an Error's
 * code, or a transport error. */
static __attribute__((unused)) int raw_hello(struct raw *x, const char *client, const char *tenant,
					     uint32_t slots, uint64_t slot_size)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__Hello h = KVD__HELLO__INIT;
	int fds[KVD_CTL_MAX_FDS], nfds = KVD_CTL_MAX_FDS, err = 0;
	Kvd__Response *r;

	h.version = KVD_CTL_VERSION;
	h.tenant = (char *)tenant;
	h.client_name = (char *)client;
	h.slots = slots;
	h.slot_size = slot_size;
	rq.body_case = KVD__REQUEST__BODY_HELLO;
	rq.hello = &h;
	r = raw_call(x, &rq, KVD__RESPONSE__BODY_HELLO, fds, &nfds, &err);
	if (!r)
		return err;
	if (nfds != 2) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		kvd_ctl_free_response(r);
		snprintf(x->msg, sizeof x->msg, "HelloReply with %d fds", nfds);
		return -EBADMSG;
	}
	x->size = r->hello->region_size;
	x->efd = fds[1];
	x->map = mmap(NULL, x->size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	close(fds[0]);
	kvd_ctl_free_response(r);
	if (x->map == MAP_FAILED) {
		x->map = NULL;
		return -errno;
	}
	return shm_region_attach(&x->r, x->map, x->size);
}

static __attribute__((unused)) int raw_profile_create(struct raw *x, Kvd__Profile *p,
						      uint32_t *id)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ProfileCreate pc = KVD__PROFILE_CREATE__INIT;
	Kvd__Response *r;
	int rc;

	pc.profile = p;
	rq.body_case = KVD__REQUEST__BODY_PROFILE_CREATE;
	rq.profile_create = &pc;
	rc = raw_expect(x, &rq, KVD__RESPONSE__BODY_PROFILE, &r);
	if (!rc) {
		*id = r->profile->profile_id;
		kvd_ctl_free_response(r);
	}
	return rc;
}

static __attribute__((unused)) int raw_profile_open(struct raw *x, const char *name, uint32_t *id)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ProfileOpen po = KVD__PROFILE_OPEN__INIT;
	Kvd__Response *r;
	int rc;

	po.name = (char *)name;
	rq.body_case = KVD__REQUEST__BODY_PROFILE_OPEN;
	rq.profile_open = &po;
	rc = raw_expect(x, &rq, KVD__RESPONSE__BODY_PROFILE, &r);
	if (!rc) {
		*id = r->profile->profile_id;
		kvd_ctl_free_response(r);
	}
	return rc;
}

/* SeqCreate; with parent != 0, a fork of parent. */
static __attribute__((unused)) int raw_seq_create(struct raw *x, uint32_t profile_id,
						  uint64_t parent, uint64_t *seq)
{
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__SeqCreate sc = KVD__SEQ_CREATE__INIT;
	Kvd__Response *r;
	int rc;

	sc.profile_id = profile_id;
	sc.parent = parent;
	rq.body_case = KVD__REQUEST__BODY_SEQ_CREATE;
	rq.seq_create = &sc;
	rc = raw_expect(x, &rq, KVD__RESPONSE__BODY_SEQ, &r);
	if (!rc) {
		*seq = r->seq->seq;
		kvd_ctl_free_response(r);
	}
	return rc;
}

/* One ring entry and its completion: 0 or the completion's res (its
 * message in x->msg); -ETIMEDOUT when none came. */
static __attribute__((unused)) int raw_ring(struct raw *x, struct kvd_sqe *e)
{
	uint64_t one = 1;
	void *p = shm_ring_reserve(&x->r.sq);

	if (!p)
		return -ENOSPC;
	e->user_data = ++x->ud;
	memcpy(p, e, sizeof *e);
	shm_ring_commit(&x->r.sq, 1);
	if (shm_ring_needs_kick(&x->r.sq) && write(x->efd, &one, 8) != 8)
		return -errno;
	for (int i = 0; i < RAW_RING_WAITS; i++) {
		int n = shm_ring_wait(&x->r.cq, 50000, 100000000ull, 0);

		if (n > 0) {
			struct kvd_cqe c;

			memcpy(&c, shm_ring_entry(&x->r.cq, 0), sizeof c);
			shm_ring_release(&x->r.cq, 1);
			if (c.user_data != e->user_data)
				return -EBADMSG;
			snprintf(x->msg, sizeof x->msg, "%s", c.res < 0 ? c.msg : "");
			return c.res;
		}
		if (n < 0 && n != -EINTR)
			return n;
	}
	return -ETIMEDOUT;
}

#endif
