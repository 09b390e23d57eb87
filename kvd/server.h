/* kvd_server: the daemon.
 *
 * Two threads own its state in turn under one lock (kvd/server_int.h):
 * the event loop (listening socket, control sockets, signals,
 * the watchdog timer, spill I/O results), which answers control requests,
 * and the executor (kvd/exec.c), which consumes every client's submission
 * ring in small units — one ATTEND record, one PREFILL or APPEND entry —
 * picked by fair share of executor time, with the ready ATTEND records of
 * several clients run as one pool job.  Attention and sealing run on the
 * worker pools; a long seal lets other clients' records run between its
 * slices.  So one client's big batch or prefill delays another's decode by
 * about one unit, and neither a batch nor a flood of control messages keeps
 * the loop, the watchdog or the other clients waiting.
 *
 * Untrusted input — control messages and everything in shared memory — is
 * copied once and checked before use (proto/ctl.c, kvd/wire.c).  What a client
 * may make kvd hold is counted per uid before it is allocated
 * (kvd/store/uidlimits.h): connections, sequences, profiles, bytes.  A bad request
 * gets an error reply or an error completion and the client stays; a client
 * that corrupts its ring indices or breaks the control protocol's framing is
 * disconnected, and its sequences, profiles, shared memory and fds are
 * released.  Other clients do not notice either.
 */
#ifndef KVD_SERVER_H
#define KVD_SERVER_H

#include <stdint.h>

struct kvd_config;
struct kvd_server;

/* Binds the socket, starts the workers.  0 or -errno (messages on stderr). */
int kvd_server_create(const struct kvd_config *cfg, struct kvd_server **out);
/* Runs until SIGTERM/SIGINT (a handler pokes an eventfd the loop polls), then
 * drains what is queued and returns 0. */
int kvd_server_run(struct kvd_server *s);
void kvd_server_destroy(struct kvd_server *s);

#endif
