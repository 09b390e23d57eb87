#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "engine/mem.h"
#include "engine/pool.h"
#include "engine/rng.h"

double bench_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

double bench_median(double *x, int n)
{
	qsort(x, (size_t)n, sizeof *x, cmp_d);
	return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

struct mem_job {
	const uint64_t *buf;
	size_t words, row_words, nrows;
	const uint32_t *idx;
	size_t nidx;
	unsigned nw;
	uint64_t sink[64 * 8];          /* one cache line per worker */
};

static void stream_task(void *arg, uint32_t t, unsigned w)
{
	struct mem_job *j = arg;
	size_t per = j->words / j->nw, lo = t * per, hi = lo + per;
	uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;

	for (size_t i = lo; i + 8 <= hi; i += 8) {
		a0 += j->buf[i];
		a1 += j->buf[i + 1];
		a2 += j->buf[i + 2];
		a3 += j->buf[i + 3];
		a4 += j->buf[i + 4];
		a5 += j->buf[i + 5];
		a6 += j->buf[i + 6];
		a7 += j->buf[i + 7];
	}
	j->sink[(t % 64) * 8] += a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7;
}

/* As the kernels prefetch, into L2: bf16 rows two tiles ahead (kern_walk.h),
 * int8 rows four (kern_i8_512.h; the probe itself measured the same with
 * either on Zen 5: it does no work between rows and runs at the misses a
 * core keeps in flight). */
#define GATHER_AHEAD (j->row_words * 8 <= 128 ? 64 : 32)

static void gather_task(void *arg, uint32_t t, unsigned w)
{
	struct mem_job *j = arg;
	size_t per = j->nidx / j->nw, lo = t * per, hi = lo + per;
	uint64_t acc = 0;

	for (size_t i = lo; i < hi; i++) {
		if (i + GATHER_AHEAD < hi) {
			const char *p = (const char *)(j->buf + j->idx[i + GATHER_AHEAD] * j->row_words);

			for (size_t c = 0; c < j->row_words * 8; c += 64)
				__builtin_prefetch(p + c, 0, 2);
		}
		const uint64_t *r = j->buf + j->idx[i] * j->row_words;

		for (size_t e = 0; e < j->row_words; e++)
			acc += r[e];
	}
	j->sink[(t % 64) * 8] += acc;
}

static uint64_t *big_buffer(size_t bytes)
{
	/* The same allocator as segments: the probes measure the memory the
	 * kernels read, huge pages included. */
	uint64_t *b = kvd_mem_alloc(bytes);

	if (!b) {
		fprintf(stderr, "kvbench: cannot allocate %zu MB for the memory probe\n", bytes >> 20);
		exit(1);
	}
	/* Touch every page so the probe measures DRAM, not page faults. */
	for (size_t i = 0; i < bytes / 8; i++)
		b[i] = i * 0x9e3779b97f4a7c15ull;
	return b;
}

double bench_stream_read_gbps(struct kvd_pool *pool, size_t bytes, int reps)
{
	struct mem_job *j = calloc(1, sizeof *j);
	double best = 0;

	j->buf = big_buffer(bytes);
	j->words = bytes / 8;
	j->nw = kvd_pool_size(pool);
	for (int r = 0; r < reps; r++) {
		double t = bench_now_ms();

		kvd_pool_run(pool, j->nw, stream_task, j);
		double gbps = (double)(j->words / j->nw * j->nw * 8) / ((bench_now_ms() - t) * 1e6);

		best = gbps > best ? gbps : best;
	}
	kvd_mem_free((void *)j->buf, bytes);
	free(j);
	return best;
}

struct bench_gather {
	struct kvd_pool *pool;
	struct mem_job j;
	size_t bytes, row;
};

struct bench_gather *bench_gather_new(struct kvd_pool *pool, size_t bytes, size_t row)
{
	struct bench_gather *g = calloc(1, sizeof *g);
	struct kvd_rng rng = kvd_rng_make(42);
	uint32_t *idx;

	if (!g)
		return NULL;
	g->pool = pool;
	g->bytes = bytes;
	g->row = row;
	g->j.buf = big_buffer(bytes);
	g->j.row_words = row / 8;
	g->j.nrows = bytes / row;
	g->j.nw = kvd_pool_size(pool);
	g->j.nidx = g->j.nrows / 2;
	idx = malloc(g->j.nidx * sizeof *idx);
	if (!g->j.buf || !idx) {
		free(idx);
		g->j.idx = NULL;
		bench_gather_free(g);
		return NULL;
	}
	for (size_t i = 0; i < g->j.nidx; i++)
		idx[i] = kvd_rng_below(&rng, (uint32_t)g->j.nrows);
	g->j.idx = idx;
	return g;
}

double bench_gather_once(struct bench_gather *g, struct bench_sweep *sw)
{
	double t;

	if (sw)
		bench_sweep(g->pool, sw);
	t = bench_now_ms();
	kvd_pool_run(g->pool, g->j.nw, gather_task, &g->j);
	return (double)(g->j.nidx / g->j.nw * g->j.nw * g->row) / ((bench_now_ms() - t) * 1e6);
}

void bench_gather_free(struct bench_gather *g)
{
	if (!g)
		return;
	free((void *)g->j.idx);
	if (g->j.buf)
		kvd_mem_free((void *)g->j.buf, g->bytes);
	free(g);
}

double bench_gather_gbps(struct kvd_pool *pool, size_t bytes, size_t row, int reps,
			 struct bench_sweep *sw)
{
	struct bench_gather *g = bench_gather_new(pool, bytes, row);
	double best = 0;

	if (!g)
		return 0;
	for (int r = 0; r < reps; r++) {
		double gbps = bench_gather_once(g, sw);

		best = gbps > best ? gbps : best;
	}
	bench_gather_free(g);
	return best;
}

size_t bench_llc_bytes(void)
{
	size_t best = 0;

	for (int i = 0; i < 16; i++) {
		char path[96], buf[64], unit = 0;
		unsigned long long v;
		FILE *f;

		snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
		if (!(f = fopen(path, "r")))
			continue;
		if (fgets(buf, sizeof buf, f) && sscanf(buf, "%llu%c", &v, &unit) >= 1) {
			v *= unit == 'K' ? 1ull << 10 : unit == 'M' ? 1ull << 20 : unit == 'G' ? 1ull << 30 : 1;
			best = v > best ? (size_t)v : best;
		}
		fclose(f);
	}
	return best ? best : (size_t)64 << 20;
}

struct bench_sweep {
	uint64_t *buf;
	size_t bytes;
	unsigned nw;
};

static void sweep_task(void *arg, uint32_t t, unsigned w)
{
	struct bench_sweep *s = arg;
	size_t lines = s->bytes / 64, per = lines / s->nw, lo = t * per;
	size_t hi = t + 1 == s->nw ? lines : lo + per;

	/* a write per line: the line is ours and dirty, whatever was cached
	 * before (the engine's rows included) is out */
	for (size_t i = lo; i < hi; i++)
		s->buf[i * 8]++;
}

struct bench_sweep *bench_sweep_new(size_t llc)
{
	struct bench_sweep *s = calloc(1, sizeof *s);

	if (!s)
		return NULL;
	s->bytes = 2 * llc < ((size_t)64 << 20) ? (size_t)64 << 20 : 2 * llc;
	s->buf = big_buffer(s->bytes);
	return s;
}

void bench_sweep(struct kvd_pool *pool, struct bench_sweep *s)
{
	s->nw = kvd_pool_size(pool);
	kvd_pool_run(pool, s->nw, sweep_task, s);
}

size_t bench_sweep_bytes(const struct bench_sweep *s)
{
	return s->bytes;
}

void bench_sweep_free(struct bench_sweep *s)
{
	if (!s)
		return;
	kvd_mem_free(s->buf, s->bytes);
	free(s);
}

const char *bench_cpu_name(void)
{
	static char name[128] = "unknown";
	char line[256];
	FILE *f = fopen("/proc/cpuinfo", "r");

	if (!f)
		return name;
	while (fgets(line, sizeof line, f)) {
		char *c = strchr(line, ':');

		if (strncmp(line, "model name", 10) == 0 && c) {
			snprintf(name, sizeof name, "%s", c + 2);
			name[strcspn(name, "\n")] = 0;
			break;
		}
	}
	fclose(f);
	return name;
}

int bench_parse_u32(const char *s, uint32_t *out)
{
	char *end;
	unsigned long v = strtoul(s, &end, 10);

	if (!*s || *end || v == 0 || v > 1u << 20)
		return -1;
	*out = (uint32_t)v;
	return 0;
}

int bench_proc_kib(pid_t pid, const char *field, uint64_t *bytes)
{
	char path[64], line[256];
	size_t fl = strlen(field);
	unsigned long long kb;
	FILE *f;
	int rc = -ENOENT;

	snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
	if (!(f = fopen(path, "r")))
		return -errno;
	while (fgets(line, sizeof line, f)) {
		if (strncmp(line, field, fl))
			continue;
		if (sscanf(line + fl, "%llu", &kb) == 1) {
			*bytes = (uint64_t)kb << 10;
			rc = 0;
		}
		break;
	}
	fclose(f);
	return rc;
}
