/* kvd_client: the client registry and the state lock (daemon insides, not
 * an API).
 *
 * What the loop (server.c), the executor (exec.c) and the control handlers
 * (control.c, admin.c) all need of the clients, below all three: the state
 * lock they take turns on, a client's own sequences, the kick of a client
 * that broke the protocol, and its uid's control budget at its socket.
 * The table is struct kvd_server's clients list (server_int.h); clients are
 * made and dropped only by the loop, so a pointer held on the loop thread
 * stays valid across kvd_loop_breathe.  All of it under the state lock but
 * kvd_state_lock itself.
 */
#ifndef KVD_CLIENTS_H
#define KVD_CLIENTS_H

#include <stdint.h>

struct client;
struct kvd_seqn;
struct kvd_server;

/* The loop's side of the state lock. */
void kvd_state_lock(struct kvd_server *s);
void kvd_state_unlock(struct kvd_server *s);
/* The loop's turn is bounded in time, not only in count: once it has held
 * the lock for KVD_LOOP_HOLD_NS, the executor gets one pass (the loop waits
 * for it at most KVD_LOOP_WAIT_NS) before the loop goes on.  Called between
 * requests, events and accepts; whatever the caller holds must stay valid
 * without the lock (clients are freed only by the loop). */
#define KVD_LOOP_HOLD_NS 1000000ull
#define KVD_LOOP_WAIT_NS 2000000ull
void kvd_loop_breathe(struct kvd_server *s);

/* A protocol violation: c is marked dead and the loop reaps it.  Either
 * thread. */
void kvd_client_kick(struct kvd_server *s, struct client *c, const char *why);
/* c's own sequence seq (NULL when it is not, or not c's). */
struct kvd_seqn *kvd_client_seq(struct kvd_server *s, struct client *c, uint64_t seq);

/* Control-plane CPU per uid: whether c's uid may have another control
 * request handled now (refilling its budget first); when not, c's socket
 * leaves the poll set until the budget refills and kvd_client_resume polls
 * it again, so a flood costs kvd nothing but what the budget allows and
 * loses nothing.  Loop thread.  (The time spent: kvd_fair_spent.) */
int kvd_client_admit(struct kvd_server *s, struct client *c);
void kvd_client_resume(struct kvd_server *s);

/* A refusal at a limit, logged at most once a second (a client retrying in
 * a loop must not flood the log), with a count of those not logged.  Loop
 * thread only. */
void kvd_log_refusal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
