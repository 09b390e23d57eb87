/* kvd_server: the daemon's event loop.
 *
 * One thread owns all state (clients, profiles, sequences) and runs an epoll
 * loop over the listening socket, the clients' control sockets, their SQ
 * eventfds, a signal eventfd and the watchdog timer; between events it polls every
 * attached client's submission ring, round-robin, a bounded number of
 * entries per client per round, so one busy client cannot starve the rest.
 * Attention and segment sealing run on the worker pool while the loop waits.
 *
 * Untrusted input — control messages and everything in shared memory — is
 * checked before use (kvd/ctl.c, kvd/wire.c).  A bad request gets an error
 * reply or an error completion and the client stays; a client that corrupts
 * its ring indices or breaks the control protocol's framing is disconnected,
 * and its sequences, shared memory and fds are released.  Other clients do
 * not notice either.
 */
#ifndef KVD_SERVER_H
#define KVD_SERVER_H

#include <stdint.h>

struct kvd_config;
struct kvd_server;

struct kvd_server_stats {
	uint32_t clients, sequences, profiles, slots_in_use;
	uint64_t bytes, requests, errors, disconnects, mapped_bytes;
};

/* Binds the socket, starts the workers.  0 or -errno (messages on stderr). */
int kvd_server_create(const struct kvd_config *cfg, struct kvd_server **out);
/* Runs until SIGTERM/SIGINT (a handler pokes an eventfd the loop polls), then
 * drains what is queued and returns 0. */
int kvd_server_run(struct kvd_server *s);
void kvd_server_destroy(struct kvd_server *s);
void kvd_server_stats(const struct kvd_server *s, struct kvd_server_stats *st);

#endif
