/* Helpers shared by kvbench's subcommands: clocks, medians and the memory
 * probes that give the engine's figures their floor. */
#ifndef KVD_BENCH_H
#define KVD_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "gpu-client/kvc.h"
#include "tests/integration/daemon.h"

struct kvd_pool;

double bench_now_ms(void);
double bench_median(double *x, int n);
/* A count option: 1..2^20, digits only.  0, or -1 for anything else. */
int bench_parse_u32(const char *s, uint32_t *out);          /* sorts x */

/* Streaming read bandwidth with every pool worker reading its own slice of
 * a `bytes` buffer; best of `reps`.  GB/s (1e9 bytes). */
double bench_stream_read_gbps(struct kvd_pool *pool, size_t bytes, int reps);

struct bench_sweep;

/* Random gathers of `row` byte rows from a `bytes` table (make it larger than
 * the last-level cache), prefetching ahead as the attention kernels do; best
 * of `reps`, each after a sweep when sw is not NULL.  GB/s of rows gathered. */
double bench_gather_gbps(struct kvd_pool *pool, size_t bytes, size_t row, int reps,
			 struct bench_sweep *sw);

/* The same probe, one gather at a time, for timing it between other reps:
 * bench_gather_once returns the GB/s of one pass (after a sweep when sw is
 * not NULL).  bench_gather_new returns NULL when out of memory. */
struct bench_gather;
struct bench_gather *bench_gather_new(struct kvd_pool *pool, size_t bytes, size_t row);
double bench_gather_once(struct bench_gather *g, struct bench_sweep *sw);
void bench_gather_free(struct bench_gather *g);

/* The largest CPU cache's size (sysfs, cpu0), or 64 MiB when sysfs does not
 * say.  A VM may report a shared LLC far above the socket's real one. */
size_t bench_llc_bytes(void);

/* Cold timing: decoding reads every layer from DRAM (a layer is far larger
 * than any cache), so a timed rep must not find the previous rep's rows
 * cached.  bench_sweep writes one word of every line of a buffer of twice
 * the LLC (64 MiB at least) with the pool's workers; call it before each
 * rep, outside the timed region. */
struct bench_sweep *bench_sweep_new(size_t llc_bytes);
void bench_sweep(struct kvd_pool *pool, struct bench_sweep *s);
size_t bench_sweep_bytes(const struct bench_sweep *s);
void bench_sweep_free(struct bench_sweep *s);

/* A "Field:  N kB" line of /proc/PID/status ("VmRSS:", "RssAnon:"), in
 * bytes.  0 or -errno / -ENOENT. */
int bench_proc_kib(pid_t pid, const char *field, uint64_t *bytes);

/* The CPU's model name from /proc/cpuinfo, or "unknown". */
const char *bench_cpu_name(void);

/* `kvbench ipc [--json] [--iters N]` (bench/ipc.c): ring vs socket round
 * trips between two processes.  argv holds the options (a leading "ipc" is
 * skipped).  0, or 1 on failure, 2 on bad usage. */
int bench_ipc_main(int argc, char **argv);

/* `kvbench gpu` (bench/gpu.c): CUDA kernels and kvd-decode, JSON lines; 77
 * without a CUDA device. */
int bench_gpu_main(int argc, char **argv);

/* `kvbench kern` (bench/kern.c): the int8 and bf16 row kernels of each ISA
 * variant, one core, cold. */
int bench_kern_main(int argc, char **argv);

/* `kvbench lsh` (bench/lsh.c): the candidate walk against the whole
 * sampled path, bf16 and int8, one core, cold. */
int bench_lsh_main(int argc, char **argv);

/* kvbench demo / serve (bench/serve.c). */
int bench_demo_main(int argc, char **argv);
int bench_serve_main(int argc, char **argv);

/* `kvbench decode` (bench/decode.c): the decode loop of a GPU worker against
 * a real kvd, a candidate configuration against MagicPIG K10 L150 bf16. */
int bench_decode_main(int argc, char **argv);

/* `kvbench load` (bench/load.c): many decoding clients with and without
 * noisy neighbours, against the in-process engine. */
int bench_load_main(int argc, char **argv);

/* `kvbench share` (bench/share.c): sequence fork against prefill, and kvd's
 * resident memory for a prompt shared by forks. */
int bench_share_main(int argc, char **argv);

/* `kvbench remote` (bench/remote.c): kvd's Redis Cluster client against
 * redis-benchmark, and a prefix restored from the cluster against a prefill. */
int bench_remote_main(int argc, char **argv);

#endif
