/* kvd_ctl: the control plane's codec and socket I/O, shared by the daemon
 * and the client library.  One kvd.Request (proto/kvd.proto) per
 * SOCK_SEQPACKET datagram from the client, one kvd.Response per Request,
 * matched by id; docs/PROTOCOL.md is the prose version.
 *
 * protobuf-c's unpack bounds-checks the wire format; the decoders here
 * check the meaning: every field a hostile peer could set is range-checked
 * before the caller sees the message, and a refusal says which field and
 * which value.  The daemon never trusts a Request, the client never trusts a
 * Response.
 *
 * Conventions the checks enforce (both sides rely on them):
 *  - ids chosen by kvd (profile_id, seq, client_id) are never 0: 0 means
 *    "none" (SeqCreate.parent) and is refused where an id is required;
 *  - request ids are the client's; kvd echoes them.  A request too broken
 *    to yield an id is answered with an Error of id 0, which a client takes
 *    as the answer to its one outstanding request;
 *  - unknown fields are ignored (proto3): a newer peer may add optional
 *    fields without bumping the version.  An unknown request type arrives
 *    as a Request with no body and is refused with -EOPNOTSUPP;
 *  - names (tenant, client_name, profile name) are at most
 *    KVD_CTL_NAME_MAX bytes of printable ASCII (0x20..0x7e).
 *
 * Everything is thread-safe: no state beyond the arguments (and one
 * thread-local, kvd_ctl_sent_code).
 */
#ifndef KVD_CTL_H
#define KVD_CTL_H

#include <stddef.h>
#include <stdint.h>

#include "kvd.pb-c.h"

struct kvd_geom;
struct kvd_model;

#define KVD_CTL_VERSION     1u          /* == KVD__VERSION__VERSION_CURRENT */

/* Largest datagram the protocol allows: a ProfileReply carrying W at the
 * largest geometry (head_dim 256, K 16, L 1024: 16 MiB) plus the profile
 * (dense_layers <= 1024 varints of <= 2 bytes, a 64-byte name, scalars)
 * and framing, well under 4 KiB.  Linux itself carries far less in one
 * SOCK_SEQPACKET datagram (about 208 KiB with default sysctls, about 4 MiB at
 * most however SO_SNDBUF is raised): kvd_ctl_send() then fails with
 * -EMSGSIZE.  That is why ProfileReply.w may be empty (kvd_ctl_profile_w). */
#define KVD_CTL_MAX         ((16u << 20) + 4096u)
/* Largest Request: the biggest valid one (a ProfileCreate with 1024 dense
 * layers) is about 3 KiB; the rest is room for unknown fields.  The daemon's
 * receive buffer. */
#define KVD_CTL_REQ_MAX     (64u << 10)
/* ProfileReply.w inline only up to this: the reply then fits in one datagram
 * with default sysctls.  Above it kvd sends w empty. */
#define KVD_CTL_W_INLINE_MAX (128u << 10)
#define KVD_CTL_MAX_FDS     4           /* fds one message may carry (HelloReply: 2) */

/* A profile's limits here and below are the store's too (kvd/store/store.h,
 * KVD_NAME_MAX and KVD_PROFILE_*, which tests/unit/test_sfmt.c holds equal
 * to these): the store checks a profile read back from disk without the
 * codec. */
#define KVD_CTL_NAME_MAX    64          /* tenant, client_name, profile name */
#define KVD_CTL_KEY_MAX     64          /* SeqCreate.content_key */
#define KVD_CTL_MSG_MAX     256         /* Error.message, NUL included */
#define KVD_CTL_LAYERS_MAX  1024
#define KVD_CTL_TOKENS_MAX  65536u      /* sink_tokens, window_tokens */
#define KVD_CTL_SEG_MIN     256u        /* segment_tokens: power of two in [MIN, KVD_SEG_MAX] */
#define KVD_CTL_SEG_DEFAULT 32768u
#define KVD_CTL_SEAL_MIN    16u         /* seal_tokens in [MIN, segment_tokens] */
#define KVD_CTL_SEAL_DEFAULT 1024u      /* or segment_tokens when smaller */
#define KVD_CTL_SLOTS_MAX   1024u
#define KVD_CTL_SLOT_MIN    (64ull << 10)       /* slot_size: multiple of 4096 */
#define KVD_CTL_SLOT_MAX    (256ull << 20)
#define KVD_CTL_ARENA_MAX   (16ull << 30)       /* slots * slot_size */
#define KVD_CTL_REGION_MAX  (KVD_CTL_ARENA_MAX + (1ull << 30))      /* arena + rings */
/* Rows in one admin listing reply (ClientList, SeqList, ProfileList,
 * ShareList, LimitsReply.uids): a longer listing pages.  The largest row (a ClientInfo
 * with two 64-byte strings) is under 300 bytes, so a page stays under
 * 80 KiB, well inside one datagram and a client's 192 KiB buffer. */
#define KVD_CTL_LIST_MAX    256u
#define KVD_CTL_LIMIT_ROWS  16u         /* LimitsReply.rows */

/* Why a decode or check failed. */
struct kvd_ctl_err {
	int code;                       /* -errno or -KVD_E*; 0: no error */
	uint64_t id;                    /* the message's id when it unpacked, else 0 */
	char msg[KVD_CTL_MSG_MAX];      /* names the field and the bad value */
	int remote;                     /* kvd_ctl_call: code and msg are an Error kvd sent */
};

/* ---- socket I/O --------------------------------------------------------- */

/* Packs msg and sends it as one datagram, with fds[0..nfds) as SCM_RIGHTS
 * when nfds > 0 (the fds stay the caller's).  MSG_NOSIGNAL: a gone peer is
 * -EPIPE, never SIGPIPE.  Retries EINTR.  0, -EMSGSIZE (packed size 0 or
 * above KVD_CTL_MAX, or more than the socket carries), -EINVAL (nfds out of
 * [0, KVD_CTL_MAX_FDS]), -ENOMEM, or sendmsg's -errno (-EAGAIN on a
 * non-blocking socket whose peer's queue is full). */
int kvd_ctl_send(int fd, const ProtobufCMessage *msg, const int *fds, int nfds);
/* Deferred replies.  After kvd_ctl_defer(fd), this thread's kvd_ctl_send()
 * to fd of a message up to KVD_CTL_DEFER_BYTES, with no fds, is packed and
 * kept (0 returned, or -ENOMEM) instead of sent; anything else to fd sends
 * the kept ones first, in order, then itself, so its -EMSGSIZE is still
 * the caller's to handle.  kvd_ctl_flush() sends what is kept, in order,
 * and stops deferring: 0, or the first failure's -errno (the rest are
 * dropped: the caller drops the connection).  kvd's loop defers what it
 * answers under its state lock and sends after letting go of it: a reply
 * wakes its client, which may take the loop's CPU, and the lock with it,
 * for milliseconds on a busy machine. */
#define KVD_CTL_DEFER_BYTES (64u << 10)
void kvd_ctl_defer(int fd);
unsigned kvd_ctl_deferred(void);
int kvd_ctl_flush(void);
/* The Error code of the last Response this thread sent (0: not an Error),
 * sent or not: the daemon counts control results by it (kvd/metrics.h). */
extern _Thread_local int kvd_ctl_sent_code;

/* Receives one datagram into buf[0..cap).  *nfds is in: the room in fds
 * (fds and nfds may be NULL: no room), out: how many fds arrived (close-on-
 * exec, now the caller's).  Returns the datagram's length (> 0), 0 on
 * orderly EOF (kvd_ctl_send never sends an empty datagram, so 0 is never a
 * message), or -errno: -EMSGSIZE when the datagram or its fds did not fit
 * (it is consumed, every fd that came with it closed, *nfds = 0), -EAGAIN
 * on a non-blocking socket with nothing queued.  Retries EINTR.  cap is
 * clamped to INT_MAX. */
int kvd_ctl_recv(int fd, void *buf, size_t cap, int *fds, int *nfds);

/* Sends Response{id, Error{code, message}}; the message is formatted, cut to
 * KVD_CTL_MSG_MAX - 1 bytes, and bytes outside printable ASCII become '?'.
 * code is -errno or -KVD_E*, in [-(KVD_ELAST - 1), -1] (what a client's
 * decoder accepts); anything else is sent as -KVD_EPROTO.  Returns as
 * kvd_ctl_send(). */
int kvd_ctl_send_error(int fd, uint64_t id, int code, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* Sends Response{id, Ok{}}. */
int kvd_ctl_send_ok(int fd, uint64_t id);

/* ---- a client's request ------------------------------------------------ */

/* A client's receive buffer: any reply kvd sends (a ProfileReply with W
 * inline up to KVD_CTL_W_INLINE_MAX, a full page of a listing). */
#define KVD_CTL_RX_MAX      (KVD_CTL_W_INLINE_MAX + (64u << 10))

/* One request and its answer, the round trip libkvclient, kvctl and the
 * tests share: sends rq (rq->id is the caller's), waits at most timeout_ms
 * (-1: for ever) for a datagram, receives it into rx (KVD_CTL_RX_MAX bytes)
 * with fds as kvd_ctl_recv() (fds and nfds may be NULL), and decodes it as
 * kvd_ctl_decode_response(.., rq->id, ..).  want 0 takes any body, an Error
 * included; otherwise a reply of another body is refused.  A send that finds
 * kvd gone (-EPIPE, -ECONNRESET) still reads what kvd queued before it
 * closed: a refused connection's reason, an Error of id 0.
 * Returns the Response (kvd_ctl_free_response()), or NULL with *err filled
 * (err->msg says which step, fds received are closed and *nfds is 0):
 * -ETIMEDOUT, -EPIPE (kvd closed the connection without an answer), the
 * send's or the receive's -errno, the decoder's code, and with want != 0
 * -KVD_EPROTO for a reply of another body or, err->remote set, an Error's
 * own code and message (err->id: the Error's id, 0 for a refused
 * connection). */
Kvd__Response *kvd_ctl_call(int fd, Kvd__Request *rq, Kvd__Response__BodyCase want, void *rx,
			    int timeout_ms, int *fds, int *nfds, struct kvd_ctl_err *err);

/* ---- decoding ----------------------------------------------------------- */

/* Unpacks and validates a Request (the daemon's side).  NULL on failure with
 * *err filled (err may be NULL): -EMSGSIZE (len above KVD_CTL_REQ_MAX),
 * -KVD_EFORMAT (not a kvd.Request), -EOPNOTSUPP (no body: an
 * unknown request type), -EPROTONOSUPPORT (Hello.version is not
 * KVD_CTL_VERSION: "protocol version N not supported, kvd speaks 1"),
 * -KVD_EGEOM (a Profile's heads, head_dim, K, L or c), -EINVAL (any other
 * field, kv_dtype and estimator included).  err->id is the request's id
 * whenever it unpacked, so the reply can carry it.  What is checked, per
 * body:
 *   Hello          version; tenant, client_name; slots <= KVD_CTL_SLOTS_MAX;
 *                  slot_size 0 or a multiple of 4096 in [SLOT_MIN, SLOT_MAX];
 *                  both set: slots * slot_size <= KVD_CTL_ARENA_MAX (kvd
 *                  re-checks with its defaults filled in: kvd_ctl_check_arena)
 *   ProfileCreate  a profile, kvd_ctl_check_profile(p, 0)
 *   ProfileOpen    name non-empty
 *   SeqCreate      profile_id != 0, content_key <= KVD_CTL_KEY_MAX bytes;
 *                  attach_keys: at most KVD_CTL_ATTACH_KEYS_MAX of
 *                  KVD_CTL_CONTENT_KEY bytes each, not with parent
 *   SeqPublish     seq != 0, key of KVD_CTL_CONTENT_KEY bytes
 *   SeqFree, SeqStatsReq  seq != 0
 *   ServerStatsReq nothing
 *   Hello.control  slots, slot_size and poll all 0
 *   ClientsReq, ProfilesReq  limit <= KVD_CTL_LIST_MAX
 *   SeqListReq     limit <= KVD_CTL_LIST_MAX; uid 0 unless filter_uid
 *   SeqAdmin       seq != 0; op SHOW, EVICT or FREE
 *   LimitsReq, DrainReq  nothing
 *   SharesReq      limit <= KVD_CTL_LIST_MAX
 *   ShareDrop      key of KVD_CTL_CONTENT_KEY bytes
 * The Request is the caller's: kvd_ctl_free_request(). */
Kvd__Request *kvd_ctl_decode_request(const void *buf, size_t len, struct kvd_ctl_err *err);
void kvd_ctl_free_request(Kvd__Request *r);

/* Unpacks and validates a Response (the client's side) to request want_id.
 * NULL on failure with *err filled: -EMSGSIZE (len above KVD_CTL_MAX),
 * -KVD_EFORMAT (not a kvd.Response),
 * -EPROTONOSUPPORT (HelloReply.version), -KVD_EPROTO (anything else the
 * daemon must not send).  Checked:
 *   id             == want_id, or 0 on an Error (see above)
 *   body           set (a body this version does not know: -KVD_EPROTO)
 *   Error          code in [-(KVD_ELAST - 1), -1]; message is cut to
 *                  KVD_CTL_MSG_MAX - 1 bytes and made printable in place
 *   HelloReply     version, client_id != 0, region_size a multiple of 4096
 *                  in [4096, KVD_CTL_REGION_MAX]
 *   ProfileReply   profile_id != 0, kvd_ctl_check_profile(p, 1), w empty or
 *                  exactly head_dim * K * L * 4 bytes
 *   SeqReply       seq != 0
 *   HelloReply.control  region_size 0 (and no fds: the caller's check)
 *   ClientList, SeqList, ProfileList  at most KVD_CTL_LIST_MAX rows, none
 *                  missing, ids != 0; strings (tenant, names) cut to
 *                  KVD_CTL_NAME_MAX bytes and made printable in place
 *   SeqInfo        seq != 0, strings as above
 *   ProfileInfo    kvd_ctl_check_profile(p, 1), n_dense <= layers
 *   LimitsReply    at most KVD_CTL_LIMIT_ROWS rows, KVD_CTL_LIST_MAX uids
 *   ShareList      at most KVD_CTL_LIST_MAX rows, none missing, seq != 0,
 *                  keys of KVD_CTL_CONTENT_KEY bytes, state as SeqInfo's
 * The fds of a HelloReply are not the decoder's business: the caller checks
 * that exactly two came with it.  A successful decode may still be an Error:
 * look at body_case.  kvd_ctl_free_response() frees it. */
Kvd__Response *kvd_ctl_decode_response(const void *buf, size_t len, uint64_t want_id,
				       struct kvd_ctl_err *err);
void kvd_ctl_free_response(Kvd__Response *r);

/* ---- profiles ----------------------------------------------------------- */

/* 0, or -KVD_EGEOM / -EINVAL with *err filled (err may be NULL).  name:
 * 1..KVD_CTL_NAME_MAX printable bytes; layers 1..KVD_CTL_LAYERS_MAX; the
 * geometry as kvd_geom_check() (q_heads <= KVD_QHEADS_MAX); kv_dtype
 * KVD_KV_BF16 or KVD_KV_INT8 (0, the default, is bf16); estimator at most
 * KVD_EST_MAX (0, the default, is magicpig; engine/attn.h); sink_tokens,
 * window_tokens <= KVD_CTL_TOKENS_MAX; dense_layers: each < layers, no
 * duplicates; segment_tokens a power of two in [KVD_CTL_SEG_MIN,
 * KVD_SEG_MAX]; seal_tokens in [KVD_CTL_SEAL_MIN, segment_tokens].  Unless
 * `filled`, segment_tokens and seal_tokens may also be 0 (the defaults). */
int kvd_ctl_check_profile(const Kvd__Profile *p, int filled, struct kvd_ctl_err *err);

/* The content-key chunk of a profile that names none: KVD_CTL_CHUNK_DEFAULT
 * tokens when that divides seal, else the largest divisor of seal below it.
 * A chunk_tokens that is not 0 must divide seal_tokens. */
#define KVD_CTL_CHUNK_DEFAULT 256u
/* Prefix sharing: a content key's bytes (XXH3-128) and the most keys one
 * attach names (kvd/store/share.h has the same two). */
#define KVD_CTL_CONTENT_KEY 16
#define KVD_CTL_ATTACH_KEYS_MAX 2048
uint32_t kvd_ctl_chunk_default(uint32_t seal);

/* Fills in the defaults: segment_tokens 0 -> KVD_CTL_SEG_DEFAULT, seal_tokens
 * 0 -> min(KVD_CTL_SEAL_DEFAULT, segment_tokens), chunk_tokens 0 ->
 * kvd_ctl_chunk_default(seal_tokens).  Changes nothing else. */
void kvd_ctl_profile_defaults(Kvd__Profile *p);

/* 1 when a and b describe the same profile: every field equal once the
 * defaults are filled in, dense_layers compared as sets.  Both must have
 * passed kvd_ctl_check_profile().  ProfileCreate of an existing name opens
 * it when this holds and is refused (-EEXIST) when it does not. */
int kvd_ctl_profile_equal(const Kvd__Profile *a, const Kvd__Profile *b);

/* The geometry of a profile, kv_dtype included; returns kvd_geom_check(g). */
int kvd_ctl_profile_to_geom(const Kvd__Profile *p, struct kvd_geom *g);

/* The one converter between the wire's Profile and its C form (engine/model.h),
 * which the daemon and libkvclient both keep; dense layers are the caller's.
 * _get copies every field as it is (no defaults: kvd_ctl_profile_defaults()
 * first for that) and returns kvd_ctl_profile_to_geom()'s result.  _put
 * fills m from p, m->name pointing into p and m->dense_layers at dense[0..n):
 * both must outlive m. */
int kvd_ctl_profile_get(const Kvd__Profile *m, struct kvd_model *p);
void kvd_ctl_profile_put(const struct kvd_model *p, const uint32_t *dense, size_t n,
			 Kvd__Profile *m);

/* W (head_dim * K * L floats, lsh.h's layout) of a decoded ProfileReply:
 * copied from w, or, when w is empty, made from the profile's seed with
 * kvd_lsh_make_w() — the same numbers by definition.  0 or -KVD_EPROTO
 * (w of the wrong size: not a decoded reply). */
int kvd_ctl_profile_w(const Kvd__ProfileReply *r, float *W);

/* Hello's arena, with the defaults already filled in: slots in
 * [1, KVD_CTL_SLOTS_MAX], slot_size a multiple of 4096 in [KVD_CTL_SLOT_MIN,
 * KVD_CTL_SLOT_MAX], slots * slot_size <= KVD_CTL_ARENA_MAX.  0 or -EINVAL
 * with *err filled (err may be NULL). */
int kvd_ctl_check_arena(uint64_t slots, uint64_t slot_size, struct kvd_ctl_err *err);

/* "hello", "profile_create", ...: a request's body for logs; "none" when
 * unset, "unknown" for anything else. */
const char *kvd_ctl_request_name(Kvd__Request__BodyCase c);

#endif
