/* Helpers shared by kvbench's subcommands: clocks, medians and the memory
 * probes that give the engine's figures their floor. */
#ifndef KVD_BENCH_H
#define KVD_BENCH_H

#include <stddef.h>

struct kvd_pool;

double bench_now_ms(void);
double bench_median(double *x, int n);          /* sorts x */

/* Streaming read bandwidth with every pool worker reading its own slice of
 * a `bytes` buffer; best of `reps`.  GB/s (1e9 bytes). */
double bench_stream_read_gbps(struct kvd_pool *pool, size_t bytes, int reps);

/* Random gathers of `row` byte rows from a `bytes` table (make it larger than
 * the last-level cache), prefetching ahead as the attention kernels do; best
 * of `reps`.  GB/s of rows gathered. */
double bench_gather_gbps(struct kvd_pool *pool, size_t bytes, size_t row, int reps);

/* The CPU's model name from /proc/cpuinfo, or "unknown". */
const char *bench_cpu_name(void);

/* `kvbench ipc [--json] [--iters N]` (bench/ipc.c): ring vs socket round
 * trips between two processes.  argv holds the options (a leading "ipc" is
 * skipped).  0, or 1 on failure, 2 on bad usage. */
int bench_ipc_main(int argc, char **argv);

/* `kvbench gpu` (bench/gpu.c): CUDA kernels and kvd-decode, JSON lines; 77
 * without a CUDA device. */
int bench_gpu_main(int argc, char **argv);

/* kvbench demo / serve (bench/serve.c). */
int bench_demo_main(int argc, char **argv);
int bench_serve_main(int argc, char **argv);

#endif
