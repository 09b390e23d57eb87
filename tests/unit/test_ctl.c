/* kvd_ctl: every Request and Response through a SOCK_SEQPACKET socketpair
 * (fds passed with SCM_RIGHTS and checked to work), and the decoders'
 * refusals: versions, bodies, strings, every profile field, ids, every
 * prefix of valid messages, random bytes, oversize datagrams. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/attn.h"
#include "proto/ctl.h"
#include "engine/err.h"
#include "engine/lsh.h"
#include "engine/model.h"

static int sp[2];

static int sock_setup(void **state)
{
	(void)state;
	return socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp);
}

static int sock_teardown(void **state)
{
	(void)state;
	close(sp[0]);
	close(sp[1]);
	return 0;
}

static int count_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;

	assert_non_null(d);
	while ((e = readdir(d)))
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

static uint32_t dense2[] = { 0, 1 };

static void good_profile(Kvd__Profile *p)
{
	kvd__profile__init(p);
	p->name = "llama-3-8b";
	p->layers = 32;
	p->q_heads = 32;
	p->kv_heads = 8;
	p->head_dim = 128;
	p->k_bits = 10;
	p->tables = 150;
	p->min_collisions = 2;
	p->sink_tokens = 4;
	p->window_tokens = 64;
	p->n_dense_layers = 2;
	p->dense_layers = dense2;
	p->seed = 42;
}

/* A request of each kind, filled with valid values. */
struct reqs {
	Kvd__Hello hello;
	Kvd__Profile prof;
	Kvd__ProfileCreate pc;
	Kvd__ProfileOpen po;
	Kvd__SeqCreate sc;
	Kvd__SeqFree sf;
	Kvd__SeqStatsReq ss;
	Kvd__ServerStatsReq st;
	Kvd__Request r[7];
};

static uint8_t key[] = { 1, 2, 3, 0, 255 };

static void make_reqs(struct reqs *q)
{
	kvd__hello__init(&q->hello);
	q->hello.version = KVD_CTL_VERSION;
	q->hello.tenant = "team-a";
	q->hello.client_name = "vllm worker 3";
	q->hello.poll = 1;
	q->hello.slots = 32;
	q->hello.slot_size = 8 << 20;
	good_profile(&q->prof);
	kvd__profile_create__init(&q->pc);
	q->pc.profile = &q->prof;
	kvd__profile_open__init(&q->po);
	q->po.name = "llama-3-8b";
	kvd__seq_create__init(&q->sc);
	q->sc.profile_id = 3;
	q->sc.content_key.data = key;
	q->sc.content_key.len = sizeof(key);
	q->sc.parent = 0;
	kvd__seq_free__init(&q->sf);
	q->sf.seq = 77;
	kvd__seq_stats_req__init(&q->ss);
	q->ss.seq = 78;
	kvd__server_stats_req__init(&q->st);
	for (int i = 0; i < 7; i++) {
		kvd__request__init(&q->r[i]);
		q->r[i].id = 100 + (uint64_t)i;
	}
	q->r[0].body_case = KVD__REQUEST__BODY_HELLO;
	q->r[0].hello = &q->hello;
	q->r[1].body_case = KVD__REQUEST__BODY_PROFILE_CREATE;
	q->r[1].profile_create = &q->pc;
	q->r[2].body_case = KVD__REQUEST__BODY_PROFILE_OPEN;
	q->r[2].profile_open = &q->po;
	q->r[3].body_case = KVD__REQUEST__BODY_SEQ_CREATE;
	q->r[3].seq_create = &q->sc;
	q->r[4].body_case = KVD__REQUEST__BODY_SEQ_FREE;
	q->r[4].seq_free = &q->sf;
	q->r[5].body_case = KVD__REQUEST__BODY_SEQ_STATS;
	q->r[5].seq_stats = &q->ss;
	q->r[6].body_case = KVD__REQUEST__BODY_SERVER_STATS;
	q->r[6].server_stats = &q->st;
}

/* Sends r over the socketpair and decodes what arrives. */
static Kvd__Request *via_socket(const Kvd__Request *r, struct kvd_ctl_err *e)
{
	static uint8_t buf[KVD_CTL_REQ_MAX];
	int n;

	assert_int_equal(kvd_ctl_send(sp[0], &r->base, NULL, 0), 0);
	n = kvd_ctl_recv(sp[1], buf, sizeof(buf), NULL, NULL);
	assert_true(n > 0);
	return kvd_ctl_decode_request(buf, (size_t)n, e);
}

static Kvd__Request *decode_packed(const Kvd__Request *r, struct kvd_ctl_err *e)
{
	uint8_t buf[8192];
	size_t n = kvd__request__get_packed_size(r);

	assert_true(n <= sizeof(buf));
	kvd__request__pack(r, buf);
	return kvd_ctl_decode_request(buf, n, e);
}

/* Decode must refuse r with code and a message containing `what`. */
static void refused(const Kvd__Request *r, int code, const char *what)
{
	struct kvd_ctl_err e;
	Kvd__Request *d = decode_packed(r, &e);

	if (d || e.code != code || !strstr(e.msg, what))
		print_error("expected %d '%s', got %p %d '%s'\n", code, what, (void *)d, e.code, e.msg);
	assert_null(d);
	assert_int_equal(e.code, code);
	assert_non_null(strstr(e.msg, what));
	assert_int_equal(e.id, r->id);
}

static void test_requests_round_trip(void **state)
{
	struct reqs q;
	struct kvd_ctl_err e;
	Kvd__Request *d;

	make_reqs(&q);
	for (int i = 0; i < 7; i++) {
		d = via_socket(&q.r[i], &e);
		if (!d)
			print_error("request %d: %s\n", i, e.msg);
		assert_non_null(d);
		assert_int_equal(e.code, 0);
		assert_int_equal(d->id, 100 + i);
		assert_int_equal(d->body_case, q.r[i].body_case);
		switch (d->body_case) {
		case KVD__REQUEST__BODY_HELLO:
			assert_int_equal(d->hello->version, 1);
			assert_string_equal(d->hello->tenant, "team-a");
			assert_string_equal(d->hello->client_name, "vllm worker 3");
			assert_true(d->hello->poll);
			assert_int_equal(d->hello->slots, 32);
			assert_int_equal(d->hello->slot_size, 8 << 20);
			break;
		case KVD__REQUEST__BODY_PROFILE_CREATE:
			assert_true(kvd_ctl_profile_equal(d->profile_create->profile, &q.prof));
			assert_string_equal(d->profile_create->profile->name, "llama-3-8b");
			assert_int_equal(d->profile_create->profile->n_dense_layers, 2);
			assert_int_equal(d->profile_create->profile->dense_layers[1], 1);
			assert_int_equal(d->profile_create->profile->seed, 42);
			break;
		case KVD__REQUEST__BODY_PROFILE_OPEN:
			assert_string_equal(d->profile_open->name, "llama-3-8b");
			break;
		case KVD__REQUEST__BODY_SEQ_CREATE:
			assert_int_equal(d->seq_create->profile_id, 3);
			assert_int_equal(d->seq_create->content_key.len, sizeof(key));
			assert_memory_equal(d->seq_create->content_key.data, key, sizeof(key));
			break;
		case KVD__REQUEST__BODY_SEQ_FREE:
			assert_int_equal(d->seq_free->seq, 77);
			break;
		case KVD__REQUEST__BODY_SEQ_STATS:
			assert_int_equal(d->seq_stats->seq, 78);
			break;
		case KVD__REQUEST__BODY_SERVER_STATS:
			break;
		default:
			fail();
		}
		assert_string_not_equal(kvd_ctl_request_name(d->body_case), "unknown");
		kvd_ctl_free_request(d);
	}
	assert_string_equal(kvd_ctl_request_name(KVD__REQUEST__BODY__NOT_SET), "none");
	assert_string_equal(kvd_ctl_request_name((Kvd__Request__BodyCase)99), "unknown");
}

/* Responses, with the HelloReply's two fds: a memfd and an eventfd, used
 * through the received copies. */
static void test_responses_round_trip(void **state)
{
	static uint8_t buf[KVD_CTL_MAX];
	static float W[128 * 10 * 150];
	Kvd__Response r[8];
	Kvd__Error er = KVD__ERROR__INIT;
	Kvd__HelloReply hr = KVD__HELLO_REPLY__INIT;
	Kvd__ProfileReply pr = KVD__PROFILE_REPLY__INIT;
	Kvd__Profile prof;
	Kvd__SeqReply sr = KVD__SEQ_REPLY__INIT;
	Kvd__SeqStats ss = KVD__SEQ_STATS__INIT;
	Kvd__ServerStats st = KVD__SERVER_STATS__INIT;
	Kvd__Ok ok = KVD__OK__INIT;
	struct kvd_ctl_err e;
	int memfd, evfd, fds[KVD_CTL_MAX_FDS], nfds, n, before = count_fds();
	char txt[8] = { 0 };
	uint64_t one = 1, got = 0;

	memfd = memfd_create("ctl-test", MFD_CLOEXEC);
	evfd = eventfd(0, EFD_CLOEXEC);
	assert_true(memfd >= 0 && evfd >= 0);
	assert_int_equal(write(memfd, "region", 6), 6);

	good_profile(&prof);
	kvd_ctl_profile_defaults(&prof);
	/* Small enough to travel inline on default sysctls. */
	prof.head_dim = 16;
	prof.k_bits = 8;
	prof.tables = 16;
	prof.kv_dtype = KVD_KV_INT8;
	prof.estimator = KVD_EST_ADAPTIVE;
	kvd_lsh_make_w(prof.seed, 16, 8, 16, W);

	for (int i = 0; i < 8; i++) {
		kvd__response__init(&r[i]);
		r[i].id = 200 + (uint64_t)i;
	}
	er.code = -KVD_EGEOM;
	er.message = "profile head_dim 24 is not a multiple of 16";
	r[0].body_case = KVD__RESPONSE__BODY_ERROR;
	r[0].error = &er;
	hr.version = KVD_CTL_VERSION;
	hr.client_id = 9;
	hr.region_size = 1 << 20;
	hr.pid = 1234;
	r[1].body_case = KVD__RESPONSE__BODY_HELLO;
	r[1].hello = &hr;
	pr.profile_id = 5;
	pr.profile = &prof;
	pr.w.data = (uint8_t *)W;
	pr.w.len = 16 * 8 * 16 * 4;
	r[2].body_case = KVD__RESPONSE__BODY_PROFILE;
	r[2].profile = &pr;
	sr.seq = 11;
	r[3].body_case = KVD__RESPONSE__BODY_SEQ;
	r[3].seq = &sr;
	ss.seq = 11;
	ss.profile_id = 5;
	ss.tokens = 70000;
	ss.segments = 2;
	ss.bytes = 123456789;
	r[4].body_case = KVD__RESPONSE__BODY_SEQ_STATS;
	r[4].seq_stats = &ss;
	st.clients = 3;
	st.disconnects = 1;
	st.mapped_bytes = 1ull << 33;
	r[5].body_case = KVD__RESPONSE__BODY_SERVER_STATS;
	r[5].server_stats = &st;
	r[6].body_case = KVD__RESPONSE__BODY_OK;
	r[6].ok = &ok;
	r[7] = r[2];                    /* the ProfileReply again, w left to the seed */
	r[7].id = 207;

	for (int i = 0; i < 8; i++) {
		Kvd__Response *d;
		int send_fds[2] = { memfd, evfd };

		if (i == 7)
			pr.w.len = 0;
		assert_int_equal(kvd_ctl_send(sp[1], &r[i].base, send_fds, i == 1 ? 2 : 0), 0);
		nfds = KVD_CTL_MAX_FDS;
		n = kvd_ctl_recv(sp[0], buf, sizeof(buf), fds, &nfds);
		assert_true(n > 0);
		assert_int_equal(nfds, i == 1 ? 2 : 0);
		d = kvd_ctl_decode_response(buf, (size_t)n, 200 + (uint64_t)i, &e);
		if (!d)
			print_error("response %d: %s\n", i, e.msg);
		assert_non_null(d);
		assert_int_equal(d->body_case, r[i].body_case);
		switch (i) {
		case 0:
			assert_int_equal(d->error->code, -KVD_EGEOM);
			assert_string_equal(d->error->message, er.message);
			break;
		case 1:
			assert_int_equal(d->hello->client_id, 9);
			assert_int_equal(d->hello->region_size, 1 << 20);
			assert_int_equal(d->hello->pid, 1234);
			/* The received fds are new descriptors for the same files. */
			assert_true(fds[0] != memfd && fds[1] != evfd);
			assert_int_equal(pread(fds[0], txt, 6, 0), 6);
			assert_string_equal(txt, "region");
			assert_int_equal(write(fds[1], &one, 8), 8);
			assert_int_equal(read(evfd, &got, 8), 8);
			assert_int_equal(got, 1);
			assert_true(fcntl(fds[0], F_GETFD) & FD_CLOEXEC);
			close(fds[0]);
			close(fds[1]);
			break;
		case 2:
		case 7: {
			static float W2[16 * 8 * 16];

			assert_int_equal(d->profile->profile_id, 5);
			assert_true(kvd_ctl_profile_equal(d->profile->profile, &prof));
			assert_int_equal(d->profile->profile->kv_dtype, KVD_KV_INT8);
			assert_int_equal(d->profile->profile->estimator, KVD_EST_ADAPTIVE);
			assert_int_equal(d->profile->w.len, i == 2 ? sizeof(float) * 16 * 8 * 16 : 0);
			assert_int_equal(kvd_ctl_profile_w(d->profile, W2), 0);
			assert_memory_equal(W2, W, sizeof(W2));
			break;
		}
		case 3:
			assert_int_equal(d->seq->seq, 11);
			break;
		case 4:
			assert_int_equal(d->seq_stats->tokens, 70000);
			assert_int_equal(d->seq_stats->bytes, 123456789);
			break;
		case 5:
			assert_int_equal(d->server_stats->clients, 3);
			assert_int_equal(d->server_stats->mapped_bytes, 1ull << 33);
			break;
		}
		kvd_ctl_free_response(d);
	}
	close(memfd);
	close(evfd);
	assert_int_equal(count_fds(), before);
}

static void test_send_error_ok(void **state)
{
	uint8_t buf[1024];
	struct kvd_ctl_err e;
	Kvd__Response *d;
	int n;

	assert_int_equal(kvd_ctl_send_error(sp[1], 5, -EINVAL, "bad %s\x01\n%d", "value", 3), 0);
	n = kvd_ctl_recv(sp[0], buf, sizeof(buf), NULL, NULL);
	d = kvd_ctl_decode_response(buf, (size_t)n, 5, &e);
	assert_non_null(d);
	assert_int_equal(d->error->code, -EINVAL);
	assert_string_equal(d->error->message, "bad value??3");
	kvd_ctl_free_response(d);

	/* A positive or out-of-range code is never sent as such. */
	assert_int_equal(kvd_ctl_send_error(sp[1], 6, 22, "x"), 0);
	n = kvd_ctl_recv(sp[0], buf, sizeof(buf), NULL, NULL);
	d = kvd_ctl_decode_response(buf, (size_t)n, 6, &e);
	assert_non_null(d);
	assert_int_equal(d->error->code, -KVD_EPROTO);
	kvd_ctl_free_response(d);

	/* Long messages are cut, not refused. */
	assert_int_equal(kvd_ctl_send_error(sp[1], 7, -ENOMEM, "%0500d", 1), 0);
	n = kvd_ctl_recv(sp[0], buf, sizeof(buf), NULL, NULL);
	d = kvd_ctl_decode_response(buf, (size_t)n, 7, &e);
	assert_non_null(d);
	assert_int_equal(strlen(d->error->message), KVD_CTL_MSG_MAX - 1);
	kvd_ctl_free_response(d);

	assert_int_equal(kvd_ctl_send_ok(sp[1], 8), 0);
	n = kvd_ctl_recv(sp[0], buf, sizeof(buf), NULL, NULL);
	d = kvd_ctl_decode_response(buf, (size_t)n, 8, &e);
	assert_non_null(d);
	assert_int_equal(d->body_case, KVD__RESPONSE__BODY_OK);
	kvd_ctl_free_response(d);
}

/* The next datagram on sp[0]: the id of an Ok{id} (want), -1 when none
 * is waiting, less when another. */
static int next_ok(int want)
{
	uint8_t buf[1024];
	struct kvd_ctl_err e;
	Kvd__Response *d;
	int n = (int)recv(sp[0], buf, sizeof buf, MSG_DONTWAIT), id;

	if (n <= 0)
		return -1;
	d = kvd_ctl_decode_response(buf, (size_t)n, (uint64_t)want, &e);
	if (!d)
		return -2;
	id = d->body_case == KVD__RESPONSE__BODY_OK ? (int)d->id : -3;
	kvd_ctl_free_response(d);
	return id;
}

/* A failed test_defer leaves nothing kept for the next test's sp[1]. */
static int defer_teardown(void **state)
{
	(void)kvd_ctl_flush();
	return sock_teardown(state);
}

/* Deferred replies are kept until flushed, in order; a send the deferral
 * does not keep (fds, or another fd) sends the kept ones first or is
 * not held; after the flush nothing is kept. */
static void test_defer(void **state)
{
	int efd = eventfd(0, EFD_CLOEXEC), fds[2];
	Kvd__Response r = KVD__RESPONSE__INIT;
	Kvd__Ok ok = KVD__OK__INIT;
	uint8_t buf[1024];

	(void)state;
	assert_true(efd >= 0);
	assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds), 0);
	kvd_ctl_defer(sp[1]);
	assert_int_equal(kvd_ctl_send_ok(sp[1], 1), 0);
	assert_int_equal(kvd_ctl_send_ok(sp[1], 2), 0);
	assert_int_equal(kvd_ctl_deferred(), 2);
	assert_int_equal(next_ok(1), -1);                /* nothing sent yet */
	assert_int_equal(kvd_ctl_send_ok(fds[1], 9), 0);   /* another fd: at once */
	assert_true(recv(fds[0], buf, sizeof buf, MSG_DONTWAIT) > 0);
	/* one with an fd goes at once, after the kept */
	r.id = 3;
	r.body_case = KVD__RESPONSE__BODY_OK;
	r.ok = &ok;
	assert_int_equal(kvd_ctl_send(sp[1], &r.base, &efd, 1), 0);
	assert_int_equal(kvd_ctl_deferred(), 0);
	assert_int_equal(next_ok(1), 1);
	assert_int_equal(next_ok(2), 2);
	int got[1], ngot = 1;

	assert_true(kvd_ctl_recv(sp[0], buf, sizeof buf, got, &ngot) > 0);
	assert_int_equal(ngot, 1);
	close(got[0]);
	assert_int_equal(kvd_ctl_send_ok(sp[1], 4), 0);
	assert_int_equal(next_ok(1), -1);
	assert_int_equal(kvd_ctl_flush(), 0);
	assert_int_equal(next_ok(4), 4);
	/* stopped: the next one goes at once */
	assert_int_equal(kvd_ctl_send_ok(sp[1], 5), 0);
	assert_int_equal(next_ok(5), 5);
	/* no fd is no fd, deferring or not */
	kvd_ctl_defer(-1);
	assert_int_equal(kvd_ctl_send_ok(-1, 7), -EBADF);
	assert_int_equal(kvd_ctl_flush(), 0);
	/* a peer gone: the flush says so */
	kvd_ctl_defer(fds[1]);
	assert_int_equal(kvd_ctl_send_ok(fds[1], 6), 0);
	close(fds[0]);
	assert_int_equal(kvd_ctl_flush(), -EPIPE);
	close(fds[1]);
	close(efd);
}

static void test_version(void **state)
{
	struct reqs q;

	make_reqs(&q);
	q.hello.version = 2;
	refused(&q.r[0], -EPROTONOSUPPORT, "protocol version 2 not supported, kvd speaks 1");
	q.hello.version = 0;
	refused(&q.r[0], -EPROTONOSUPPORT, "version");
}

static void test_no_body_and_unknown_fields(void **state)
{
	Kvd__Request r = KVD__REQUEST__INIT;
	struct reqs q;
	struct kvd_ctl_err e;
	uint8_t buf[256];
	size_t n;
	Kvd__Request *d;
	/* field 100, varint 5; then field 99 (a body type this version does not
	 * know), length-delimited, empty. */
	static const uint8_t unknown_field[] = { 0xa0, 0x06, 0x05 };
	static const uint8_t unknown_body[] = { 0x9a, 0x06, 0x00 };

	r.id = 9;
	refused(&r, -EOPNOTSUPP, "no body");

	make_reqs(&q);
	n = kvd__request__pack(&q.r[4], buf);
	memcpy(buf + n, unknown_field, sizeof(unknown_field));
	d = kvd_ctl_decode_request(buf, n + sizeof(unknown_field), &e);
	assert_non_null(d);             /* ignored: proto3 */
	assert_int_equal(d->seq_free->seq, 77);
	kvd_ctl_free_request(d);

	n = kvd__request__pack(&r, buf);
	memcpy(buf + n, unknown_body, sizeof(unknown_body));
	d = kvd_ctl_decode_request(buf, n + sizeof(unknown_body), &e);
	assert_null(d);
	assert_int_equal(e.code, -EOPNOTSUPP);
	assert_int_equal(e.id, 9);

	/* The empty datagram is a valid protobuf of nothing: no body. */
	d = kvd_ctl_decode_request(buf, 0, &e);
	assert_null(d);
	assert_int_equal(e.code, -EOPNOTSUPP);
}

static void test_strings(void **state)
{
	char long_name[KVD_CTL_NAME_MAX + 2];
	char max_name[KVD_CTL_NAME_MAX + 1];
	uint8_t big_key[KVD_CTL_KEY_MAX + 1] = { 0 };
	struct kvd_ctl_err e;
	Kvd__Request *d;
	struct reqs q;

	memset(long_name, 'a', sizeof(long_name) - 1);
	long_name[sizeof(long_name) - 1] = 0;
	memset(max_name, 'b', sizeof(max_name) - 1);
	max_name[sizeof(max_name) - 1] = 0;

	make_reqs(&q);
	q.hello.tenant = max_name;
	q.hello.client_name = "";
	d = decode_packed(&q.r[0], &e);
	assert_non_null(d);             /* 64 bytes fit; empty names are allowed */
	kvd_ctl_free_request(d);

	q.hello.tenant = long_name;
	refused(&q.r[0], -EINVAL, "tenant");
	q.hello.tenant = "a\x01";
	refused(&q.r[0], -EINVAL, "tenant \"a\\x01\": byte 1 (0x01) is not printable");
	q.hello.tenant = "ok";
	q.hello.client_name = long_name;
	refused(&q.r[0], -EINVAL, "client_name");
	q.hello.client_name = "tab\there";
	refused(&q.r[0], -EINVAL, "client_name");

	q.prof.name = long_name;
	refused(&q.r[1], -EINVAL, "profile name");
	q.prof.name = "";
	refused(&q.r[1], -EINVAL, "profile name is empty");
	q.prof.name = "caf\xc3\xa9";    /* valid UTF-8, not ASCII */
	d = decode_packed(&q.r[1], &e);
	assert_null(d);
	assert_true(e.code == -EINVAL || e.code == -KVD_EFORMAT);

	q.po.name = long_name;
	refused(&q.r[2], -EINVAL, "profile_open name");
	q.po.name = "";
	refused(&q.r[2], -EINVAL, "profile_open name is empty");

	q.sc.content_key.data = big_key;
	q.sc.content_key.len = sizeof(big_key);
	refused(&q.r[3], -EINVAL, "content_key");
	q.sc.content_key.len = KVD_CTL_KEY_MAX;
	d = decode_packed(&q.r[3], &e);
	assert_non_null(d);
	kvd_ctl_free_request(d);
}

static void test_ids_and_arena(void **state)
{
	struct reqs q;
	struct kvd_ctl_err e;
	Kvd__Request *d;

	make_reqs(&q);
	q.sc.profile_id = 0;
	refused(&q.r[3], -EINVAL, "profile_id");
	q.sf.seq = 0;
	refused(&q.r[4], -EINVAL, "seq_free seq");
	q.ss.seq = 0;
	refused(&q.r[5], -EINVAL, "seq_stats seq");
	q.pc.profile = NULL;
	refused(&q.r[1], -EINVAL, "without a profile");

	q.hello.slots = KVD_CTL_SLOTS_MAX + 1;
	refused(&q.r[0], -EINVAL, "slots 1025");
	q.hello.slots = 0;
	q.hello.slot_size = 4096 * 3;
	refused(&q.r[0], -EINVAL, "slot_size 12288");
	q.hello.slot_size = (64 << 10) + 1;
	refused(&q.r[0], -EINVAL, "slot_size");
	q.hello.slot_size = KVD_CTL_SLOT_MAX + 4096;
	refused(&q.r[0], -EINVAL, "slot_size");
	q.hello.slots = 1024;
	q.hello.slot_size = KVD_CTL_SLOT_MAX;
	refused(&q.r[0], -EINVAL, "slots 1024 x slot_size");
	q.hello.slots = 64;             /* 64 x 256 MiB = 16 GiB: the limit */
	d = decode_packed(&q.r[0], &e);
	assert_non_null(d);
	kvd_ctl_free_request(d);
	q.hello.slots = 0;
	q.hello.slot_size = 0;          /* both defaults */
	d = decode_packed(&q.r[0], &e);
	assert_non_null(d);
	kvd_ctl_free_request(d);

	assert_int_equal(kvd_ctl_check_arena(16, 4 << 20, NULL), 0);
	assert_int_equal(kvd_ctl_check_arena(0, 4 << 20, &e), -EINVAL);
	assert_non_null(strstr(e.msg, "slots 0"));
	assert_int_equal(kvd_ctl_check_arena(1, 0, &e), -EINVAL);
	assert_non_null(strstr(e.msg, "slot_size 0"));
}

/* Each profile field out of range, one at a time. */
static void test_profile_fields(void **state)
{
	static const struct {
		size_t off;
		uint32_t v;
		int code;
		const char *what;
	} bad[] = {
#define F(f, v, c, w) { offsetof(Kvd__Profile, f), v, c, w }
		F(layers, 0, -EINVAL, "layers 0"),
		F(layers, 1025, -EINVAL, "layers 1025"),
		F(q_heads, 0, -KVD_EGEOM, "q_heads 0"),
		F(q_heads, 4096, -KVD_EGEOM, "q_heads 4096 out of range"),
		F(q_heads, 36, -KVD_EGEOM, "kv_heads 8 does not divide q_heads 36"),
		F(kv_heads, 0, -KVD_EGEOM, "kv_heads 0"),
		F(kv_heads, 5, -KVD_EGEOM, "kv_heads 5"),
		F(kv_heads, 1, -KVD_EGEOM, "q_heads / kv_heads = 32 / 1"),
		F(head_dim, 0, -KVD_EGEOM, "head_dim 0"),
		F(head_dim, 24, -KVD_EGEOM, "head_dim 24"),
		F(head_dim, 8, -KVD_EGEOM, "head_dim 8"),
		F(head_dim, 272, -KVD_EGEOM, "head_dim 272"),
		F(k_bits, 0, -KVD_EGEOM, "k_bits 0"),
		F(k_bits, 17, -KVD_EGEOM, "k_bits 17"),
		F(tables, 0, -KVD_EGEOM, "tables 0"),
		F(tables, 1025, -KVD_EGEOM, "tables 1025"),
		F(min_collisions, 0, -KVD_EGEOM, "min_collisions 0"),
		F(min_collisions, 3, -KVD_EGEOM, "min_collisions 3"),
		F(sink_tokens, 65537, -EINVAL, "sink_tokens 65537"),
		F(window_tokens, 70000, -EINVAL, "window_tokens 70000"),
		F(segment_tokens, 3000, -EINVAL, "segment_tokens 3000"),
		F(segment_tokens, 128, -EINVAL, "segment_tokens 128"),
		F(segment_tokens, 131072, -EINVAL, "segment_tokens 131072"),
		F(seal_tokens, 8, -EINVAL, "seal_tokens 8"),
		F(seal_tokens, 40000, -EINVAL, "seal_tokens 40000"),
		F(kv_dtype, 2, -EINVAL, "profile kv_dtype 2 is not 0 (bf16) or 1 (int8)"),
		F(kv_dtype, UINT32_MAX, -EINVAL, "kv_dtype 4294967295"),
		F(estimator, 5, -EINVAL,
		  "profile estimator 5 is not 0 (magicpig), 1 (hybrid), 2 (adaptive), 3 (hybrid_cv) or 4 (hybrid_lcv)"),
		F(estimator, UINT32_MAX, -EINVAL, "estimator 4294967295"),
#undef F
	};
	struct reqs q;
	struct kvd_ctl_err e;
	Kvd__Request *d;
	struct kvd_geom g;

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		make_reqs(&q);
		memcpy((char *)&q.prof + bad[i].off, &bad[i].v, sizeof(uint32_t));
		refused(&q.r[1], bad[i].code, bad[i].what);
		/* The same checks guard a ProfileReply on the client side. */
		assert_int_equal(kvd_ctl_check_profile(&q.prof, 0, NULL), bad[i].code);
	}

	/* The edges that pass. */
	make_reqs(&q);
	q.prof.layers = 1024;
	q.prof.q_heads = 256;
	q.prof.kv_heads = 16;
	q.prof.head_dim = 256;
	q.prof.k_bits = 16;
	q.prof.tables = 1024;
	q.prof.min_collisions = 1;
	q.prof.sink_tokens = 65536;
	q.prof.window_tokens = 0;
	q.prof.segment_tokens = 256;
	q.prof.seal_tokens = 256;
	q.prof.kv_dtype = KVD__KV_DTYPE__KV_DTYPE_INT8;
	q.prof.estimator = KVD__ESTIMATOR__ESTIMATOR_ADAPTIVE;
	d = decode_packed(&q.r[1], &e);
	if (!d)
		print_error("%s\n", e.msg);
	assert_non_null(d);
	assert_int_equal(kvd_ctl_profile_to_geom(d->profile_create->profile, &g), 0);
	assert_int_equal(g.q_heads, 256);
	assert_int_equal(g.kv_heads, 16);
	assert_int_equal(g.d, 256);
	assert_int_equal(g.K, 16);
	assert_int_equal(g.L, 1024);
	assert_int_equal(g.c, 1);
	assert_int_equal(g.kv_dtype, KVD_KV_INT8);
	assert_int_equal(d->profile_create->profile->kv_dtype, KVD_KV_INT8);
	assert_int_equal(d->profile_create->profile->estimator, KVD_EST_ADAPTIVE);
	kvd_ctl_free_request(d);
	/* left out, it is bf16 (0) and magicpig (0) */
	make_reqs(&q);
	d = decode_packed(&q.r[1], &e);
	assert_non_null(d);
	memset(&g, 0xff, sizeof g);
	assert_int_equal(kvd_ctl_profile_to_geom(d->profile_create->profile, &g), 0);
	assert_int_equal(g.kv_dtype, KVD_KV_BF16);
	assert_int_equal(d->profile_create->profile->estimator, KVD_EST_MAGICPIG);
	kvd_ctl_free_request(d);

	/* A reply must carry the defaults filled in. */
	make_reqs(&q);
	assert_int_equal(kvd_ctl_check_profile(&q.prof, 0, NULL), 0);
	assert_int_equal(kvd_ctl_check_profile(&q.prof, 1, &e), -EINVAL);
	assert_non_null(strstr(e.msg, "segment_tokens 0"));
	q.prof.segment_tokens = 65536;
	assert_int_equal(kvd_ctl_check_profile(&q.prof, 1, &e), -EINVAL);
	assert_non_null(strstr(e.msg, "seal_tokens 0"));
}

static void test_dense_layers(void **state)
{
	uint32_t dup[] = { 3, 5, 3 }, high[] = { 0, 32 }, many[33], all[32];
	struct reqs q;
	struct kvd_ctl_err e;
	Kvd__Request *d;

	make_reqs(&q);
	q.prof.dense_layers = dup;
	q.prof.n_dense_layers = 3;
	refused(&q.r[1], -EINVAL, "dense_layers[2] = 3: listed twice");
	q.prof.dense_layers = high;
	q.prof.n_dense_layers = 2;
	refused(&q.r[1], -EINVAL, "dense_layers[1] = 32: not below layers 32");
	for (int i = 0; i < 33; i++)
		many[i] = (uint32_t)i % 32;
	q.prof.dense_layers = many;
	q.prof.n_dense_layers = 33;
	refused(&q.r[1], -EINVAL, "33 dense_layers");
	for (int i = 0; i < 32; i++)
		all[i] = 31 - (uint32_t)i;
	q.prof.dense_layers = all;
	q.prof.n_dense_layers = 32;
	d = decode_packed(&q.r[1], &e);
	assert_non_null(d);             /* every layer dense: odd, legal */
	kvd_ctl_free_request(d);
}

static void test_profile_helpers(void **state)
{
	Kvd__Profile a, b;
	uint32_t rev[] = { 1, 0 }, other[] = { 2, 0 };

	good_profile(&a);
	good_profile(&b);
	assert_true(kvd_ctl_profile_equal(&a, &b));
	kvd_ctl_profile_defaults(&b);
	assert_int_equal(b.segment_tokens, KVD_CTL_SEG_DEFAULT);
	assert_int_equal(b.seal_tokens, KVD_CTL_SEAL_DEFAULT);
	assert_true(kvd_ctl_profile_equal(&a, &b));     /* 0 means the default */
	b.dense_layers = rev;
	assert_true(kvd_ctl_profile_equal(&a, &b));     /* a set */
	b.dense_layers = other;
	assert_false(kvd_ctl_profile_equal(&a, &b));
	b.dense_layers = dense2;
	b.seed = 43;
	assert_false(kvd_ctl_profile_equal(&a, &b));
	b.seed = 42;
	b.kv_dtype = KVD_KV_INT8;               /* same shape, other storage */
	assert_false(kvd_ctl_profile_equal(&a, &b));
	a.kv_dtype = KVD_KV_INT8;
	assert_true(kvd_ctl_profile_equal(&a, &b));
	a.kv_dtype = 0;
	b.kv_dtype = 0;
	b.estimator = KVD_EST_HYBRID;           /* same shape and storage, other estimator */
	assert_false(kvd_ctl_profile_equal(&a, &b));
	a.estimator = KVD_EST_HYBRID;
	assert_true(kvd_ctl_profile_equal(&a, &b));
	a.estimator = 0;
	b.estimator = 0;
	b.name = "other";
	assert_false(kvd_ctl_profile_equal(&a, &b));

	good_profile(&a);
	a.segment_tokens = 512;
	kvd_ctl_profile_defaults(&a);
	assert_int_equal(a.segment_tokens, 512);
	assert_int_equal(a.seal_tokens, 512);           /* never above the segment */
	assert_int_equal(kvd_ctl_check_profile(&a, 1, NULL), 0);
	a.seal_tokens = 100;
	kvd_ctl_profile_defaults(&a);
	assert_int_equal(a.seal_tokens, 100);
}

/* The converter: every field there and back, nothing filled in on the way. */
static void test_profile_convert(void **state)
{
	Kvd__Profile a, b = KVD__PROFILE__INIT;
	struct kvd_model m, n;

	(void)state;
	good_profile(&a);
	a.kv_dtype = KVD_KV_INT8;
	a.estimator = KVD_EST_ADAPTIVE;
	a.segment_tokens = 4096;
	a.seal_tokens = 512;
	a.chunk_tokens = 128;
	/* every field of a differs from its default, and m starts as garbage:
	 * a field that either direction drops makes b differ from a */
	memset(&m, 0xa5, sizeof m);
	assert_int_equal(kvd_ctl_profile_get(&a, &m), 0);
	assert_string_equal(m.name, "llama-3-8b");
	assert_int_equal(m.sink, 4);
	assert_int_equal(m.window, 64);
	assert_int_equal(m.g.d, 128);
	kvd_ctl_profile_put(&m, dense2, 2, &b);
	assert_true(kvd_ctl_profile_equal(&a, &b));
	assert_int_equal(b.chunk_tokens, 128);
	assert_ptr_equal(b.name, m.name);
	assert_ptr_equal(b.dense_layers, dense2);
	memset(&n, 0, sizeof n);
	assert_int_equal(kvd_ctl_profile_get(&b, &n), 0);
	assert_memory_equal(&m.g, &n.g, sizeof m.g);
	assert_int_equal(n.seed, m.seed);

	/* 0 stays 0 (the defaults are kvd_ctl_profile_defaults'), a bad
	 * geometry says so */
	good_profile(&a);
	a.head_dim = 17;
	assert_int_equal(kvd_ctl_profile_get(&a, &m), -KVD_EGEOM);
	assert_int_equal(m.seg_tokens, 0);
	assert_int_equal(m.chunk_tokens, 0);
}

/* kvd_ctl_call on a socketpair, sp[1] playing kvd. */
static void test_call(void **state)
{
	static uint8_t rx[KVD_CTL_RX_MAX];
	Kvd__Request rq = KVD__REQUEST__INIT;
	Kvd__ServerStatsReq sr = KVD__SERVER_STATS_REQ__INIT;
	struct kvd_ctl_err e;
	Kvd__Response *r;
	uint8_t buf[4096];

	(void)state;
	rq.body_case = KVD__REQUEST__BODY_SERVER_STATS;
	rq.server_stats = &sr;

	/* any body: an Error is a Response */
	rq.id = 1;
	assert_int_equal(kvd_ctl_send_error(sp[1], 1, -ENOENT, "no such"), 0);
	r = kvd_ctl_call(sp[0], &rq, 0, rx, 1000, NULL, NULL, &e);
	assert_non_null(r);
	assert_int_equal(r->body_case, KVD__RESPONSE__BODY_ERROR);
	kvd_ctl_free_response(r);
	assert_true(kvd_ctl_recv(sp[1], buf, sizeof buf, NULL, NULL) > 0);

	/* with a body wanted: the Error's code, message and id, marked kvd's */
	rq.id = 2;
	assert_int_equal(kvd_ctl_send_error(sp[1], 2, -ENOENT, "no such"), 0);
	assert_null(kvd_ctl_call(sp[0], &rq, KVD__RESPONSE__BODY_SERVER_STATS, rx, 1000, NULL, NULL,
				 &e));
	assert_int_equal(e.code, -ENOENT);
	assert_true(e.remote);
	assert_int_equal(e.id, 2);
	assert_string_equal(e.msg, "no such");
	assert_true(kvd_ctl_recv(sp[1], buf, sizeof buf, NULL, NULL) > 0);

	/* another body: -KVD_EPROTO, not kvd's */
	rq.id = 3;
	assert_int_equal(kvd_ctl_send_ok(sp[1], 3), 0);
	assert_null(kvd_ctl_call(sp[0], &rq, KVD__RESPONSE__BODY_SERVER_STATS, rx, 1000, NULL, NULL,
				 &e));
	assert_int_equal(e.code, -KVD_EPROTO);
	assert_false(e.remote);
	assert_true(kvd_ctl_recv(sp[1], buf, sizeof buf, NULL, NULL) > 0);

	/* an answer to another request does not decode */
	rq.id = 4;
	assert_int_equal(kvd_ctl_send_ok(sp[1], 99), 0);
	assert_null(kvd_ctl_call(sp[0], &rq, 0, rx, 1000, NULL, NULL, &e));
	assert_int_equal(e.code, -KVD_EPROTO);
	assert_non_null(strstr(e.msg, "does not decode"));
	assert_true(kvd_ctl_recv(sp[1], buf, sizeof buf, NULL, NULL) > 0);

	/* no answer */
	rq.id = 5;
	assert_null(kvd_ctl_call(sp[0], &rq, 0, rx, 10, NULL, NULL, &e));
	assert_int_equal(e.code, -ETIMEDOUT);
	assert_true(kvd_ctl_recv(sp[1], buf, sizeof buf, NULL, NULL) > 0);

	/* kvd's reason, queued before it closed, even though the send fails */
	assert_int_equal(kvd_ctl_send_error(sp[1], 0, -EDQUOT, "connections_per_uid"), 0);
	close(sp[1]);
	sp[1] = -1;
	rq.id = 6;
	assert_null(kvd_ctl_call(sp[0], &rq, KVD__RESPONSE__BODY_SERVER_STATS, rx, 1000, NULL, NULL,
				 &e));
	assert_int_equal(e.code, -EDQUOT);
	assert_true(e.remote);
	assert_int_equal(e.id, 0);

	/* then nothing: closed */
	rq.id = 7;
	assert_null(kvd_ctl_call(sp[0], &rq, 0, rx, 1000, NULL, NULL, &e));
	assert_int_equal(e.code, -EPIPE);
}

/* Every prefix of every valid message decodes validly or is refused with a
 * code and a message; libFuzzer does the rest (tests/fuzz/fuzz_ctl.c). */
static void test_prefixes(void **state)
{
	static uint32_t dense[1024];
	struct reqs q;
	uint8_t buf[8192];
	int ok = 0, no = 0;

	make_reqs(&q);
	for (int i = 0; i < 1024; i++)
		dense[i] = 1023 - (uint32_t)i;
	q.prof.layers = 1024;
	q.prof.dense_layers = dense;
	q.prof.n_dense_layers = 1024;
	for (int i = 0; i < 7; i++) {
		size_t n = kvd__request__pack(&q.r[i], buf);

		for (size_t k = 0; k <= n; k++) {
			struct kvd_ctl_err e;
			Kvd__Request *d = kvd_ctl_decode_request(buf, k, &e);

			if (d) {
				assert_int_equal(e.code, 0);
				ok++;
				kvd_ctl_free_request(d);
			} else {
				assert_true(e.code < 0);
				assert_true(e.msg[0] != 0);
				no++;
			}
			if (k == n)
				assert_non_null(d);
		}
	}
	assert_true(ok >= 7 && no > 7);
}

/* The admin requests (kvctl) and the control-only Hello: each field checked,
 * the refusal naming it; what passes decodes to what was sent. */
static void test_admin_requests(void **state)
{
	Kvd__Request r = KVD__REQUEST__INIT;
	Kvd__Hello h = KVD__HELLO__INIT;
	Kvd__ClientsReq cr = KVD__CLIENTS_REQ__INIT;
	Kvd__SeqListReq sl = KVD__SEQ_LIST_REQ__INIT;
	Kvd__SeqAdmin sa = KVD__SEQ_ADMIN__INIT;
	Kvd__ProfilesReq pr = KVD__PROFILES_REQ__INIT;
	Kvd__LimitsReq lq = KVD__LIMITS_REQ__INIT;
	Kvd__DrainReq dr = KVD__DRAIN_REQ__INIT;
	Kvd__SharesReq shr = KVD__SHARES_REQ__INIT;
	Kvd__ShareDrop sd = KVD__SHARE_DROP__INIT;
	uint8_t ckey[KVD_CTL_CONTENT_KEY + 1] = { 0 };
	struct kvd_ctl_err e;
	Kvd__Request *d;

	r.id = 21;
	h.version = KVD_CTL_VERSION;
	h.control = 1;
	r.body_case = KVD__REQUEST__BODY_HELLO;
	r.hello = &h;
	h.slots = 2;
	refused(&r, -EINVAL, "control");
	h.slots = 0;
	h.slot_size = 1 << 20;
	refused(&r, -EINVAL, "control");
	h.slot_size = 0;
	h.poll = 1;
	refused(&r, -EINVAL, "poll 1");
	h.poll = 0;
	d = decode_packed(&r, &e);
	assert_non_null(d);
	assert_true(d->hello->control);
	kvd_ctl_free_request(d);

	r.body_case = KVD__REQUEST__BODY_CLIENTS;
	r.clients = &cr;
	cr.limit = KVD_CTL_LIST_MAX + 1;
	refused(&r, -EINVAL, "clients limit 257");
	cr.limit = KVD_CTL_LIST_MAX;
	cr.after = UINT64_MAX;
	d = decode_packed(&r, &e);
	assert_non_null(d);
	assert_int_equal(d->clients->after, UINT64_MAX);
	kvd_ctl_free_request(d);

	r.body_case = KVD__REQUEST__BODY_SEQ_LIST;
	r.seq_list = &sl;
	sl.uid = 1000;
	refused(&r, -EINVAL, "uid 1000 without filter_uid");
	sl.filter_uid = 1;
	sl.limit = 1u << 31;
	refused(&r, -EINVAL, "seq_list limit");
	sl.limit = 0;
	d = decode_packed(&r, &e);
	assert_non_null(d);
	assert_int_equal(d->seq_list->uid, 1000);
	kvd_ctl_free_request(d);

	r.body_case = KVD__REQUEST__BODY_SEQ_ADMIN;
	r.seq_admin = &sa;
	sa.op = KVD__SEQ_ADMIN_OP__SEQ_ADMIN_FREE;
	refused(&r, -EINVAL, "seq_admin seq is 0");
	sa.seq = 5;
	sa.op = 0;
	refused(&r, -EINVAL, "seq_admin op 0");
	sa.op = 4;
	refused(&r, -EINVAL, "seq_admin op 4");
	for (uint32_t op = 1; op <= 3; op++) {
		sa.op = op;
		d = decode_packed(&r, &e);
		assert_non_null(d);
		kvd_ctl_free_request(d);
	}

	r.body_case = KVD__REQUEST__BODY_PROFILES;
	r.profiles = &pr;
	pr.limit = UINT32_MAX;
	refused(&r, -EINVAL, "profiles limit");

	r.body_case = KVD__REQUEST__BODY_LIMITS;
	r.limits = &lq;
	d = decode_packed(&r, &e);
	assert_non_null(d);
	assert_string_equal(kvd_ctl_request_name(d->body_case), "limits");
	kvd_ctl_free_request(d);
	r.body_case = KVD__REQUEST__BODY_DRAIN;
	r.drain = &dr;
	d = decode_packed(&r, &e);
	assert_non_null(d);
	assert_string_equal(kvd_ctl_request_name(d->body_case), "drain");
	kvd_ctl_free_request(d);

	r.body_case = KVD__REQUEST__BODY_SHARES;
	r.shares = &shr;
	shr.limit = KVD_CTL_LIST_MAX + 1;
	refused(&r, -EINVAL, "shares limit");
	shr.limit = KVD_CTL_LIST_MAX;
	d = decode_packed(&r, &e);
	assert_non_null(d);
	assert_string_equal(kvd_ctl_request_name(d->body_case), "shares");
	kvd_ctl_free_request(d);
	r.body_case = KVD__REQUEST__BODY_SHARE_DROP;
	r.share_drop = &sd;
	refused(&r, -EINVAL, "share_drop key of 0 bytes");
	sd.key.data = ckey;
	sd.key.len = KVD_CTL_CONTENT_KEY + 1;
	refused(&r, -EINVAL, "share_drop key of 17 bytes");
	sd.key.len = KVD_CTL_CONTENT_KEY;
	d = decode_packed(&r, &e);
	assert_non_null(d);
	assert_string_equal(kvd_ctl_request_name(d->body_case), "share_drop");
	kvd_ctl_free_request(d);
}

/* Replies to admin requests, as a client's decoder sees them. */
static void test_admin_responses(void **state)
{
	Kvd__Response r = KVD__RESPONSE__INIT;
	Kvd__HelloReply h = KVD__HELLO_REPLY__INIT;
	Kvd__SeqInfo si = KVD__SEQ_INFO__INIT, *sip = &si;
	Kvd__SeqList sl = KVD__SEQ_LIST__INIT;
	Kvd__ClientInfo ci = KVD__CLIENT_INFO__INIT, *cp = &ci;
	Kvd__ClientList cl = KVD__CLIENT_LIST__INIT;
	struct kvd_ctl_err e;
	uint8_t buf[4096];
	size_t n;
	Kvd__Response *d;
	char tenant[] = "t\x01x";

	r.id = 3;
	r.body_case = KVD__RESPONSE__BODY_HELLO;
	r.hello = &h;
	h.version = KVD_CTL_VERSION;
	h.client_id = 1;
	h.control = 1;
	h.region_size = 4096;
	n = kvd__response__pack(&r, buf);
	assert_null(kvd_ctl_decode_response(buf, n, 3, &e));
	assert_int_equal(e.code, -KVD_EPROTO);
	h.region_size = 0;
	n = kvd__response__pack(&r, buf);
	d = kvd_ctl_decode_response(buf, n, 3, &e);
	assert_non_null(d);
	kvd_ctl_free_response(d);
	h.control = 0;
	n = kvd__response__pack(&r, buf);
	assert_null(kvd_ctl_decode_response(buf, n, 3, &e));   /* a data Hello needs a region */

	r.body_case = KVD__RESPONSE__BODY_SEQ_LIST;
	r.seq_list = &sl;
	sl.n_seqs = 1;
	sl.seqs = &sip;
	n = kvd__response__pack(&r, buf);
	assert_null(kvd_ctl_decode_response(buf, n, 3, &e));   /* seq 0 */
	si.seq = 7;
	si.state = 5;
	n = kvd__response__pack(&r, buf);
	assert_null(kvd_ctl_decode_response(buf, n, 3, &e));   /* unknown state */
	si.state = 2;
	si.tenant = tenant;
	n = kvd__response__pack(&r, buf);
	d = kvd_ctl_decode_response(buf, n, 3, &e);
	assert_non_null(d);
	assert_string_equal(d->seq_list->seqs[0]->tenant, "t?x");     /* made printable */
	kvd_ctl_free_response(d);

	r.body_case = KVD__RESPONSE__BODY_CLIENT_LIST;
	r.client_list = &cl;
	cl.n_clients = 1;
	cl.clients = &cp;
	n = kvd__response__pack(&r, buf);
	assert_null(kvd_ctl_decode_response(buf, n, 3, &e));   /* client_id 0 */
	ci.client_id = 2;
	n = kvd__response__pack(&r, buf);
	d = kvd_ctl_decode_response(buf, n, 3, &e);
	assert_non_null(d);
	assert_string_equal(d->client_list->clients[0]->name, "");
	kvd_ctl_free_response(d);

	{
		Kvd__ShareInfo shi = KVD__SHARE_INFO__INIT, *shp = &shi;
		Kvd__ShareList shl = KVD__SHARE_LIST__INIT;
		uint8_t ckey[KVD_CTL_CONTENT_KEY] = { 1 };

		r.body_case = KVD__RESPONSE__BODY_SHARE_LIST;
		r.share_list = &shl;
		shl.n_shares = 1;
		shl.shares = &shp;
		shi.seq = 9;
		n = kvd__response__pack(&r, buf);
		assert_null(kvd_ctl_decode_response(buf, n, 3, &e));   /* no key */
		shi.key.data = ckey;
		shi.key.len = sizeof ckey;
		shi.state = 5;
		n = kvd__response__pack(&r, buf);
		assert_null(kvd_ctl_decode_response(buf, n, 3, &e));   /* unknown state */
		shi.state = 0;
		shi.seq = 0;
		n = kvd__response__pack(&r, buf);
		assert_null(kvd_ctl_decode_response(buf, n, 3, &e));   /* seq 0 */
		shi.seq = 9;
		n = kvd__response__pack(&r, buf);
		d = kvd_ctl_decode_response(buf, n, 3, &e);
		assert_non_null(d);
		assert_int_equal(d->share_list->shares[0]->key.len, KVD_CTL_CONTENT_KEY);
		kvd_ctl_free_response(d);
	}
}

static void test_garbage(void **state)
{
	uint64_t x = 0x9e3779b97f4a7c15ull;
	uint8_t buf[512];

	for (int it = 0; it < 20000; it++) {
		struct kvd_ctl_err e;
		size_t n;
		Kvd__Request *d;
		Kvd__Response *r;

		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		n = x % sizeof(buf);
		for (size_t i = 0; i < n; i++) {
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
			buf[i] = (uint8_t)x;
		}
		d = kvd_ctl_decode_request(buf, n, &e);
		assert_true(d ? e.code == 0 : e.code < 0);
		kvd_ctl_free_request(d);
		r = kvd_ctl_decode_response(buf, n, x & 3, &e);
		assert_true(r ? e.code == 0 : e.code < 0);
		kvd_ctl_free_response(r);
	}
	assert_null(kvd_ctl_decode_request("\xff\xff\xff", 3, NULL));
}

/* What a client must not take from kvd. */
static void test_response_checks(void **state)
{
	static float W[16 * 8 * 16];
	Kvd__Response r = KVD__RESPONSE__INIT;
	Kvd__Error er = KVD__ERROR__INIT;
	Kvd__HelloReply hr = KVD__HELLO_REPLY__INIT;
	Kvd__ProfileReply pr = KVD__PROFILE_REPLY__INIT;
	Kvd__SeqReply sr = KVD__SEQ_REPLY__INIT;
	Kvd__Profile prof;
	struct kvd_ctl_err e;
	uint8_t buf[1 << 16];
	size_t n;
	Kvd__Response *d;
	char msg[] = "bad \x1b[31m red";

#define DECODE(want) (n = kvd__response__pack(&r, buf), kvd_ctl_decode_response(buf, n, want, &e))
	r.id = 4;
	d = DECODE(4);
	assert_null(d);
	assert_int_equal(e.code, -KVD_EPROTO);
	assert_non_null(strstr(e.msg, "no body"));

	r.body_case = KVD__RESPONSE__BODY_ERROR;
	r.error = &er;
	er.code = -ENOENT;
	er.message = msg;
	d = DECODE(5);
	assert_null(d);
	assert_non_null(strstr(e.msg, "response id 4, expected 5"));
	r.id = 0;                       /* kvd could not read the request's id */
	d = DECODE(5);
	assert_non_null(d);
	assert_string_equal(d->error->message, "bad ?[31m red");
	kvd_ctl_free_response(d);
	er.code = 3;
	d = DECODE(0);
	assert_null(d);
	assert_non_null(strstr(e.msg, "error code 3"));
	er.code = -KVD_ELAST;
	d = DECODE(0);
	assert_null(d);
	er.code = -(KVD_ELAST - 1);
	d = DECODE(0);
	assert_non_null(d);
	kvd_ctl_free_response(d);

	r.id = 1;
	r.body_case = KVD__RESPONSE__BODY_HELLO;
	r.hello = &hr;
	hr.version = 2;
	hr.client_id = 1;
	hr.region_size = 1 << 20;
	d = DECODE(1);
	assert_null(d);
	assert_int_equal(e.code, -EPROTONOSUPPORT);
	assert_non_null(strstr(e.msg, "version 2"));
	hr.version = 1;
	hr.client_id = 0;
	d = DECODE(1);
	assert_null(d);
	assert_non_null(strstr(e.msg, "client_id"));
	hr.client_id = 1;
	hr.region_size = 4097;
	d = DECODE(1);
	assert_null(d);
	assert_non_null(strstr(e.msg, "region_size 4097"));
	hr.region_size = KVD_CTL_REGION_MAX + 4096;
	d = DECODE(1);
	assert_null(d);
	hr.region_size = 0;
	d = DECODE(1);
	assert_null(d);

	good_profile(&prof);
	prof.head_dim = 16;
	prof.k_bits = 8;
	prof.tables = 16;
	r.body_case = KVD__RESPONSE__BODY_PROFILE;
	r.profile = &pr;
	pr.profile_id = 1;
	pr.profile = &prof;
	pr.w.data = (uint8_t *)W;
	pr.w.len = sizeof(W);
	d = DECODE(1);
	assert_null(d);                 /* defaults not filled in */
	assert_non_null(strstr(e.msg, "profile reply: profile segment_tokens 0"));
	kvd_ctl_profile_defaults(&prof);
	pr.w.len = sizeof(W) - 4;
	d = DECODE(1);
	assert_null(d);
	assert_non_null(strstr(e.msg, "w of 8188 bytes, expected 8192"));
	pr.w.len = sizeof(W);
	pr.profile_id = 0;
	d = DECODE(1);
	assert_null(d);
	assert_non_null(strstr(e.msg, "profile_id is 0"));
	pr.profile_id = 1;
	prof.head_dim = 20;
	d = DECODE(1);
	assert_null(d);
	assert_int_equal(e.code, -KVD_EPROTO);
	assert_non_null(strstr(e.msg, "head_dim 20"));
	prof.head_dim = 16;
	prof.kv_dtype = 9;
	d = DECODE(1);
	assert_null(d);
	assert_int_equal(e.code, -KVD_EPROTO);
	assert_non_null(strstr(e.msg, "kv_dtype 9"));
	prof.kv_dtype = KVD_KV_INT8;
	d = DECODE(1);
	assert_non_null(d);
	assert_int_equal(d->profile->profile->kv_dtype, KVD_KV_INT8);
	kvd_ctl_free_response(d);
	prof.kv_dtype = 0;
	prof.estimator = KVD_EST_MAX + 1;
	d = DECODE(1);
	assert_null(d);
	assert_int_equal(e.code, -KVD_EPROTO);
	assert_non_null(strstr(e.msg, "estimator 5"));
	prof.estimator = KVD_EST_HYBRID;
	d = DECODE(1);
	assert_non_null(d);
	assert_int_equal(d->profile->profile->estimator, KVD_EST_HYBRID);
	kvd_ctl_free_response(d);
	prof.estimator = 0;
	pr.profile = NULL;
	d = DECODE(1);
	assert_null(d);
	assert_non_null(strstr(e.msg, "without a profile"));

	r.body_case = KVD__RESPONSE__BODY_SEQ;
	r.seq = &sr;
	d = DECODE(1);
	assert_null(d);
	assert_non_null(strstr(e.msg, "seq reply seq is 0"));
	sr.seq = 1;
	d = DECODE(1);
	assert_non_null(d);
	kvd_ctl_free_response(d);
#undef DECODE
}

static void test_recv_limits(void **state)
{
	static uint8_t big[8192];
	uint8_t buf[256];
	struct reqs q;
	int fds[4], nfds, before = count_fds(), n, pass[2];
	struct iovec iov = { big, sizeof(big) };
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int))];
	} cb;
	struct msghdr mh = { 0 };
	struct cmsghdr *c;

	/* A datagram above cap: -EMSGSIZE, and it is gone. */
	assert_int_equal(send(sp[0], big, sizeof(big), 0), (ssize_t)sizeof(big));
	assert_int_equal(kvd_ctl_recv(sp[1], buf, sizeof(buf), NULL, NULL), -EMSGSIZE);

	/* The same with an fd attached: the fd is closed, not leaked. */
	pass[0] = eventfd(0, EFD_CLOEXEC);
	mh.msg_iov = &iov;
	mh.msg_iovlen = 1;
	mh.msg_control = cb.b;
	mh.msg_controllen = sizeof(cb.b);
	c = CMSG_FIRSTHDR(&mh);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &pass[0], sizeof(int));
	assert_int_equal(sendmsg(sp[0], &mh, 0), (ssize_t)sizeof(big));
	nfds = 4;
	assert_int_equal(kvd_ctl_recv(sp[1], buf, sizeof(buf), fds, &nfds), -EMSGSIZE);
	assert_int_equal(nfds, 0);

	/* More fds than the caller has room for, or fds nobody asked for. */
	make_reqs(&q);
	pass[1] = eventfd(0, EFD_CLOEXEC);
	assert_int_equal(kvd_ctl_send(sp[0], &q.r[6].base, pass, 2), 0);
	nfds = 1;
	assert_int_equal(kvd_ctl_recv(sp[1], buf, sizeof(buf), fds, &nfds), -EMSGSIZE);
	assert_int_equal(kvd_ctl_send(sp[0], &q.r[6].base, pass, 1), 0);
	assert_int_equal(kvd_ctl_recv(sp[1], buf, sizeof(buf), NULL, NULL), -EMSGSIZE);
	close(pass[0]);
	close(pass[1]);
	assert_int_equal(count_fds(), before);

	/* The connection carries on. */
	assert_int_equal(kvd_ctl_send(sp[0], &q.r[6].base, NULL, 0), 0);
	n = kvd_ctl_recv(sp[1], buf, sizeof(buf), NULL, NULL);
	assert_true(n > 0);

	/* Sender-side limits. */
	assert_int_equal(kvd_ctl_send(sp[0], &q.r[6].base, pass, KVD_CTL_MAX_FDS + 1), -EINVAL);
	assert_int_equal(kvd_ctl_send(sp[0], &q.r[6].base, NULL, 1), -EINVAL);
	{
		Kvd__Request empty = KVD__REQUEST__INIT;

		assert_int_equal(kvd_ctl_send(sp[0], &empty.base, NULL, 0), -EMSGSIZE);
	}

	/* Non-blocking, nothing queued. */
	fcntl(sp[1], F_SETFL, O_NONBLOCK);
	assert_int_equal(kvd_ctl_recv(sp[1], buf, sizeof(buf), NULL, NULL), -EAGAIN);
}

/* Orderly EOF, a gone peer (EPIPE, no SIGPIPE: the test would die), and the
 * kernel's ceiling on one datagram, which W at the largest geometry is far
 * above: the sender gets -EMSGSIZE, the reason ProfileReply.w may be empty. */
static void test_eof_epipe_ceiling(void **state)
{
	static float W[256 * 16 * 1024];
	Kvd__Response r = KVD__RESPONSE__INIT;
	Kvd__ProfileReply pr = KVD__PROFILE_REPLY__INIT;
	Kvd__Profile prof;
	uint8_t buf[64];
	int s[2];

	assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, s), 0);
	good_profile(&prof);
	prof.head_dim = 256;
	prof.k_bits = 16;
	prof.tables = 1024;
	kvd_ctl_profile_defaults(&prof);
	pr.profile_id = 1;
	pr.profile = &prof;
	pr.w.data = (uint8_t *)W;
	pr.w.len = sizeof(W);
	r.id = 1;
	r.body_case = KVD__RESPONSE__BODY_PROFILE;
	r.profile = &pr;
	assert_true(kvd__response__get_packed_size(&r) <= KVD_CTL_MAX);
	assert_int_equal(kvd_ctl_send(s[0], &r.base, NULL, 0), -EMSGSIZE);

	close(s[0]);
	assert_int_equal(kvd_ctl_recv(s[1], buf, sizeof(buf), NULL, NULL), 0);
	assert_int_equal(kvd_ctl_send_ok(s[1], 1), -EPIPE);
	close(s[1]);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_requests_round_trip, sock_setup, sock_teardown),
		cmocka_unit_test_setup_teardown(test_responses_round_trip, sock_setup, sock_teardown),
		cmocka_unit_test_setup_teardown(test_send_error_ok, sock_setup, sock_teardown),
		cmocka_unit_test_setup_teardown(test_defer, sock_setup, defer_teardown),
		cmocka_unit_test(test_version),
		cmocka_unit_test(test_no_body_and_unknown_fields),
		cmocka_unit_test(test_strings),
		cmocka_unit_test(test_ids_and_arena),
		cmocka_unit_test(test_profile_fields),
		cmocka_unit_test(test_dense_layers),
		cmocka_unit_test(test_profile_helpers),
		cmocka_unit_test(test_profile_convert),
		cmocka_unit_test_setup_teardown(test_call, sock_setup, sock_teardown),
		cmocka_unit_test(test_prefixes),
		cmocka_unit_test(test_admin_requests),
		cmocka_unit_test(test_admin_responses),
		cmocka_unit_test(test_garbage),
		cmocka_unit_test(test_response_checks),
		cmocka_unit_test_setup_teardown(test_recv_limits, sock_setup, sock_teardown),
		cmocka_unit_test(test_eof_epipe_ceiling),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
