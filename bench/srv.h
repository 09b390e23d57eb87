/* What kvbench's scenes against a real kvd share (bench/srv.c): starting the
 * daemon, the model they load, and the child processes that play its
 * clients.  Below serve.c, prefix.c, load.c, decode.c, remote.c and share.c,
 * which all use it and not each other's helpers. */
#ifndef KVD_BENCH_SRV_H
#define KVD_BENCH_SRV_H

#include <stddef.h>
#include <stdint.h>

#include "gpu-client/kvc.h"

struct daemon;

/* Starts the kvd next to kvbench with the tests' harness
 * (tests/integration/daemon.h), in a temporary run directory with a written
 * configuration (memory, extra: more INI text, or NULL), and waits for its
 * socket.  daemon_stop() stops it: SIGTERM, wait, clean up; kvd's exit
 * status. */
int srv_start_conf(struct daemon *s, const char *memory, const char *extra);
/* The same with [server] threads = threads (0: kvd's default, one per online
 * CPU). */
int srv_start_threads(struct daemon *s, unsigned threads, const char *memory, const char *extra);
/* Llama-3.1-8B geometry (32 q / 8 kv heads, d = 128, K = 10, L = 150, c = 2,
 * 4 sinks, 64-token window); `layers` != 32: that many layers, all sparse. */
struct kvc_model llama(uint32_t layers);
/* MAP_SHARED anonymous memory that forked children write and the parent reads. */
void *shared_mem(size_t bytes);
/* Forks n children, child i running kid(i, arg) (0: success); waits for all.
 * 1 if any failed (or a fork did). */
int run_clients(uint32_t n, int (*kid)(uint32_t i, void *arg), void *arg);
/* The same, the parent running mid(arg) between the children's start and its
 * wait for them (it measures while they wait on a barrier); mid is not run
 * when a fork failed. */
int run_clients_mid(uint32_t n, int (*kid)(uint32_t i, void *arg), void (*mid)(void *arg),
		    void *arg);

#endif
