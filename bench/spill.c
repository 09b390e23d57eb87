/* kvbench spill: the spill engine against fio on the same directory.
 *
 *   kvbench spill [--json] [--dir DIR] [--bytes SIZE] [--seq-bytes SIZE]
 *                 [--block SIZE] [--qd N] [--seg-tokens N] [--layers N]
 *                 [--buffered] [--no-fio]
 *
 * Sequences of a Llama-3.1-8B-shaped profile (8 kv heads, head_dim 128,
 * K 10, L 150): per file a PROFILE extent, then per layer a LAYER extent and
 * SEG extents of --seg-tokens tokens (4096: about 28 MiB, real segments from
 * kvd_seg_build, so a restore runs the full table check), then END.
 *
 *   spill_gbps     every sequence submitted as a WRITE at once, until the
 *                  last is durable (CRCs, writes, fdatasync, rename, dir fsync)
 *   restore_gbps   every sequence read back at once, every extent verified
 *   ttf/first_layer/tta_ms   one READ alone: its first extent, the last
 *                  extent of layer 0, the whole file
 *   ttf/tta_busy_ms          the same READ submitted right behind WRITEs of
 *                  all the other sequences (reads go first)
 *   fio_*_gbps     fio, io_uring, same block size, queue depth, direct flag,
 *                  file count and sizes, registered buffers and files when
 *                  kvd had them (fio_fixedbufs): sequential write (fsync at
 *                  close), then read
 *
 * Files go to DIR/kvbench-spill.<pid>/, removed afterwards.  GB/s = 1e9 B/s.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "engine/attn.h"
#include "bench.h"
#include "engine/err.h"
#include "engine/lsh.h"
#include "engine/mem.h"
#include "engine/rng.h"
#include "kvd/store/sfmt.h"
#include "kvd/store/spill.h"
#include "kvd/store/store.h"

#define SP_MAXEXT 4096

struct opts {
	int json, buffered, fio;
	const char *dir;
	uint64_t bytes, seq_bytes;
	uint32_t block, qd, seg_tokens, layers;
};

struct seq {
	struct kvd_spill_buf *ext;
	unsigned n;
	unsigned last_l0;               /* index of layer 0's last extent */
	struct kvd_spill_job j;
	double t_submit, t_final, *t_ext;
};

static int usage(void)
{
	fprintf(stderr,
		"usage: kvbench spill [--json] [--dir DIR] [--bytes SIZE] [--seq-bytes SIZE]\n"
		"                     [--block SIZE] [--qd N] [--seg-tokens N] [--layers N]\n"
		"                     [--buffered] [--no-fio]\n"
		"  SIZE takes K, M, G (binary) suffixes; defaults: /var/tmp, 4G, 512M, 1M, 64,\n"
		"  4096 tokens per segment, 4 layers\n");
	return 2;
}

static int parse_size(const char *s, uint64_t *out)
{
	char *end;
	unsigned long long v = strtoull(s, &end, 10);
	int sh = 0;

	switch (*end) {
	case 'k': case 'K': sh = 10; end++; break;
	case 'm': case 'M': sh = 20; end++; break;
	case 'g': case 'G': sh = 30; end++; break;
	}
	if (end[0] == 'i' && end[1] == 'B')
		end += 2;
	if (end == s || *end || !v || v > (UINT64_MAX >> sh))
		return -1;
	*out = (uint64_t)v << sh;
	return 0;
}

static void *buf_alloc(uint64_t bytes)
{
	void *p = NULL;

	if (bytes >= KVD_MEM_HUGE)
		return kvd_mem_alloc(bytes);
	return posix_memalign(&p, 4096, bytes) ? NULL : p;
}

static void buf_free(void *p, uint64_t bytes)
{
	if (bytes >= KVD_MEM_HUGE)
		kvd_mem_free(p, bytes);
	else
		free(p);
}

static const char *fs_name(const char *dir)
{
	static char other[32];
	struct statfs fs;

	if (statfs(dir, &fs))
		return "unknown";
	switch ((unsigned long)fs.f_type) {
	case 0xEF53: return "ext4";
	case 0x58465342: return "xfs";
	case 0x9123683E: return "btrfs";
	case 0x01021994: return "tmpfs";
	case 0x2FC12FC1: return "zfs";
	case 0x794c7630: return "overlayfs";
	}
	snprintf(other, sizeof other, "0x%lx", (unsigned long)fs.f_type);
	return other;
}

/* ---- building sequences ------------------------------------------------- */

static struct kvd_profile prof = {
	.name = "llama-3.1-8b", .g = { 32, 8, 128, 10, 150, 2 }, .layers = 32, .sink = 4,
	.window = 64, .seg_tokens = 4096, .seal_tokens = 256, .seed = 1,
};

/* The next extent of s, its header filled (the spill engine seals it). */
static struct kvd_sfmt_hdr *ext_new(struct seq *s, const struct kvd_sfmt_file *f,
				    struct kvd_sfmt_ext e)
{
	unsigned i = s->n++;
	uint64_t bytes;
	struct kvd_sfmt_hdr *h;

	e.index = i;
	bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(f, &e));

	s->ext[i].bytes = bytes;
	s->ext[i].p = buf_alloc(bytes);
	if (!s->ext[i].p) {
		fprintf(stderr, "kvbench spill: out of memory\n");
		exit(1);
	}
	memset(s->ext[i].p, 0, bytes);
	h = s->ext[i].p;
	kvd_sfmt_hdr_fill(h, f, &e);
	return h;
}

/* One segment's payload, copied into every SEG extent. */
static void *seg_template(uint32_t n)
{
	const struct kvd_geom *g = &prof.g;
	size_t rows = (size_t)g->kv_heads * n * g->d, nc = (size_t)g->kv_heads * g->L * n;
	uint16_t *k = malloc(rows * 2), *v = malloc(rows * 2), *c = malloc(nc * 2);
	struct kvd_rng r = kvd_rng_make(42);
	struct kvd_seg *s;
	void *out;

	if (!k || !v || !c)
		return NULL;
	for (size_t i = 0; i < rows; i++) {
		k[i] = (uint16_t)(0x3c00 + kvd_rng_below(&r, 0x400));
		v[i] = (uint16_t)(0xbc00 + kvd_rng_below(&r, 0x400));
	}
	for (size_t i = 0; i < nc; i++)
		c[i] = (uint16_t)kvd_rng_below(&r, 1u << g->K);
	if (kvd_seg_build(g, n, k, v, c, NULL, &s))
		return NULL;
	out = malloc(kvd_seg_bytes(g, n));
	if (out)
		memcpy(out, s->mem, kvd_seg_bytes(g, n));
	kvd_seg_free(s);
	free(k);
	free(v);
	free(c);
	return out;
}

static void seq_build(struct seq *s, uint64_t seq, const struct opts *op, const void *tmpl,
		      unsigned nseg)
{
	uint32_t tail = 256;
	unsigned layers = op->layers < nseg ? op->layers : nseg;
	const struct kvd_sfmt_file f = { .p = &prof, .seq = seq, .gen = 1,
					 .profile_fp = kvd_sfmt_profile_fp(&prof), .tenant = "bench" };
	struct kvd_sfmt_hdr *h;

	s->ext = calloc(SP_MAXEXT, sizeof *s->ext);
	s->t_ext = calloc(SP_MAXEXT, sizeof *s->t_ext);
	h = ext_new(s, &f, (struct kvd_sfmt_ext){ .kind = KVD_SFMT_PROFILE });
	kvd_sfmt_profile_put(&prof, (char *)h + KVD_SFMT_PAGE);
	for (unsigned l = 0; l < layers; l++) {
		unsigned lo = l * nseg / layers, hi = (l + 1) * nseg / layers;
		uint64_t *w;

		h = ext_new(s, &f, (struct kvd_sfmt_ext){
			.kind = KVD_SFMT_LAYER, .layer = l, .n = tail,
			.flags = KVD_SFMT_LF_MEAN | KVD_SFMT_LF_SEALED,
			.tok_begin = (uint64_t)(hi - lo) * op->seg_tokens });
		w = (uint64_t *)((char *)h + KVD_SFMT_PAGE);
		for (uint64_t i = 0; i < h->payload_bytes / 8; i++)
			w[i] = (i ^ seq) * 0x9e3779b97f4a7c15ull;
		for (unsigned k = lo; k < hi; k++) {
			h = ext_new(s, &f, (struct kvd_sfmt_ext){
				.kind = KVD_SFMT_SEG, .layer = l, .n = op->seg_tokens,
				.tok_begin = (uint64_t)(k - lo) * op->seg_tokens });
			memcpy((char *)h + KVD_SFMT_PAGE, tmpl, h->payload_bytes);
		}
		if (l == 0)
			s->last_l0 = s->n - 1;
	}
	ext_new(s, &f, (struct kvd_sfmt_ext){ .kind = KVD_SFMT_END });
}

static uint64_t seq_total(const struct seq *s)
{
	uint64_t b = 0;

	for (unsigned i = 0; i < s->n; i++)
		b += s->ext[i].bytes;
	return b;
}

/* ---- running jobs ------------------------------------------------------- */

/* Reaps until `want` final results came; stamps every result. */
static int drive(struct kvd_spill *sp, unsigned want)
{
	unsigned got = 0;
	int bad = 0;

	while (got < want) {
		struct pollfd p = { .fd = kvd_spill_fd(sp), .events = POLLIN };
		struct kvd_spill_result res[64];
		unsigned n;

		if (poll(&p, 1, 600000) != 1) {
			fprintf(stderr, "kvbench spill: no result in 10 minutes\n");
			exit(1);
		}
		n = kvd_spill_reap(sp, res, 64);
		double now = bench_now_ms();

		for (unsigned i = 0; i < n; i++) {
			struct seq *s = res[i].job->user;

			if (!res[i].final) {
				s->t_ext[res[i].ext] = now;
				continue;
			}
			s->t_final = now;
			got++;
			if (res[i].job->res) {
				fprintf(stderr, "kvbench spill: seq %llu: %s: %s\n",
					(unsigned long long)res[i].job->seq,
					kvd_strerror(res[i].job->res), res[i].job->msg);
				bad = 1;
			}
		}
	}
	return bad;
}

static void submit(struct kvd_spill *sp, struct seq *s, int op, unsigned dir)
{
	s->j = (struct kvd_spill_job){ .op = op, .seq = ((struct kvd_sfmt_hdr *)s->ext[0].p)->seq,
				       .gen = 1, .dir = dir, .ext = s->ext, .next = s->n,
				       .user = s };
	s->t_submit = bench_now_ms();
	int rc = kvd_spill_submit(sp, &s->j);

	if (rc) {
		fprintf(stderr, "kvbench spill: submit: %s: %s\n", kvd_strerror(rc), s->j.msg);
		exit(1);
	}
}

/* Pages a buffered READ would find cached are dropped first (O_DIRECT
 * bypasses them anyway; tmpfs cannot drop them). */
static void drop_cache(const char *dir, struct seq *s, unsigned n)
{
	char path[4200];

	for (unsigned i = 0; i < n; i++) {
		int fd;

		snprintf(path, sizeof path, "%s/%016llx.kvs", dir, (unsigned long long)s[i].j.seq);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd >= 0) {
			posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
			close(fd);
		}
	}
}

/* ---- fio ---------------------------------------------------------------- */

/* bw_bytes of the "read" or "write" part of fio's JSON, in GB/s; < 0 if
 * fio failed. */
static double fio_run(const struct opts *op, const char *dir, const char *rw, unsigned nfiles,
		      int direct, int fixed)
{
	char cmd[5000], key[32], *out = NULL, *p;
	size_t len = 0, cap = 0;
	double bw = -1;
	FILE *f;

	snprintf(cmd, sizeof cmd,
		 "fio --name=kvbench-spill --directory='%s' --rw=%s --bs=%u --iodepth=%u "
		 "--ioengine=io_uring --direct=%d --nrfiles=%u --filesize=%llu "
		 "--file_service_type=roundrobin --fsync_on_close=1 --unlink=%d %s"
		 "--output-format=json 2>/dev/null",
		 dir, strcmp(rw, "read") ? "write" : "read", op->block, op->qd, direct, nfiles,
		 (unsigned long long)op->seq_bytes, !strcmp(rw, "read"),
		 fixed ? "--fixedbufs --registerfiles " : "");
	f = popen(cmd, "r");
	if (!f)
		return -1;
	for (;;) {
		if (len + 4096 + 1 > cap) {
			char *n = realloc(out, cap = cap ? 2 * cap : 65536);

			if (!n)
				break;
			out = n;
		}
		size_t got = fread(out + len, 1, 4096, f);

		if (!got)
			break;
		len += got;
	}
	if (pclose(f) == 0 && out) {
		out[len] = 0;
		snprintf(key, sizeof key, "\"%s\" : {", rw);
		p = strstr(out, key);
		p = p ? strstr(p, "\"bw_bytes\" : ") : NULL;
		if (p)
			bw = strtod(p + 13, NULL) / 1e9;
	}
	free(out);
	return bw;
}

static int have_fio(void)
{
	return system("fio --version >/dev/null 2>&1") == 0;
}

/* ---- main --------------------------------------------------------------- */

int bench_spill_main(int argc, char **argv)
{
	struct opts op = { .dir = "/var/tmp", .bytes = 4ull << 30, .seq_bytes = 512ull << 20,
			   .block = 1u << 20, .qd = 64, .seg_tokens = 4096, .layers = 4, .fio = 1 };
	char dir[4096];
	const char *dirs[1] = { dir };

	for (int i = 0; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		uint64_t x;

		if (!strcmp(a, "spill") && i == 0)
			continue;
		if (!strcmp(a, "--json")) {
			op.json = 1;
		} else if (!strcmp(a, "--buffered")) {
			op.buffered = 1;
		} else if (!strcmp(a, "--no-fio")) {
			op.fio = 0;
		} else if (!v) {
			return usage();
		} else {
			i++;
			if (!strcmp(a, "--dir"))
				op.dir = v;
			else if (!strcmp(a, "--bytes") && !parse_size(v, &x))
				op.bytes = x;
			else if (!strcmp(a, "--seq-bytes") && !parse_size(v, &x))
				op.seq_bytes = x;
			else if (!strcmp(a, "--block") && !parse_size(v, &x) && x % 4096 == 0 &&
				 x <= (1u << 30))
				op.block = (uint32_t)x;
			else if (!strcmp(a, "--qd"))
				op.qd = (uint32_t)atoi(v);
			else if (!strcmp(a, "--seg-tokens"))
				op.seg_tokens = (uint32_t)atoi(v);
			else if (!strcmp(a, "--layers"))
				op.layers = (uint32_t)atoi(v);
			else
				return usage();
		}
	}
	if (op.qd < 32 || op.qd > 4096 || op.seg_tokens < 1 || op.seg_tokens > KVD_SEG_MAX ||
	    !op.layers || op.bytes < op.seq_bytes)
		return usage();

	/* the profile's W, and a segment to copy */
	prof.dense = calloc(prof.layers, 1);
	prof.W = malloc((size_t)prof.g.d * prof.g.K * prof.g.L * sizeof(float));
	kvd_lsh_make_w(prof.seed, (int)prof.g.d, (int)prof.g.K, (int)prof.g.L, prof.W);
	void *tmpl = seg_template(op.seg_tokens);

	if (!prof.dense || !prof.W || !tmpl) {
		fprintf(stderr, "kvbench spill: cannot build a segment\n");
		return 1;
	}

	uint64_t seg_ext = kvd_sfmt_extent_bytes(kvd_seg_bytes(&prof.g, op.seg_tokens));
	unsigned nseq = (unsigned)(op.bytes / op.seq_bytes);
	unsigned nseg = op.seq_bytes > seg_ext ? (unsigned)(op.seq_bytes / seg_ext) : 1;

	if (nseg + 2 * op.layers + 2 > SP_MAXEXT || nseq < 1)
		return usage();
	snprintf(dir, sizeof dir, "%s/kvbench-spill.%d", op.dir, (int)getpid());

	struct kvd_spill_cfg cfg = { .dirs = { dirs[0] }, .ndirs = 1, .qd = op.qd,
				     .block = op.block, .buffered = op.buffered };
	struct kvd_spill_stats st;
	struct kvd_spill *sp;
	int rc = kvd_spill_create(&cfg, &sp);

	if (rc) {
		fprintf(stderr, "kvbench spill: %s: %s\n", dir, kvd_strerror(rc));
		return 1;
	}
	kvd_spill_stats(sp, &st);

	int direct = st.direct_mask & 1, bad = 0;
	struct seq *s = calloc(nseq, sizeof *s);
	uint64_t total = 0;

	for (unsigned i = 0; i < nseq; i++) {
		seq_build(&s[i], 0x5e90000 + i, &op, tmpl, nseg);
		total += seq_total(&s[i]);
	}
	if (!op.json)
		printf("kvbench spill: %u sequences of %.0f MiB (%u extents, SEG %.1f MiB) in %s "
		       "(%s, %s), block %u KiB, qd %u\n", nseq, seq_total(&s[0]) / 1048576.0,
		       s[0].n, seg_ext / 1048576.0, dir, fs_name(dir),
		       direct ? "O_DIRECT" : "buffered", op.block >> 10, op.qd);

	/* spill everything at once */
	double t0 = bench_now_ms();

	for (unsigned i = 0; i < nseq; i++)
		submit(sp, &s[i], KVD_SPILL_WRITE, 0);
	bad |= drive(sp, nseq);
	double spill_ms = bench_now_ms() - t0;

	/* restore everything at once */
	drop_cache(dir, s, nseq);
	t0 = bench_now_ms();
	for (unsigned i = 0; i < nseq; i++)
		submit(sp, &s[i], KVD_SPILL_READ, 0);
	bad |= drive(sp, nseq);
	double restore_ms = bench_now_ms() - t0;

	/* one restore alone */
	drop_cache(dir, s, 1);
	submit(sp, &s[0], KVD_SPILL_READ, 0);
	bad |= drive(sp, 1);
	double ttf = s[0].t_ext[0] - s[0].t_submit, tl0 = s[0].t_ext[s[0].last_l0] - s[0].t_submit;
	double tta = s[0].t_final - s[0].t_submit;
	double *tl = malloc(s[0].n * sizeof *tl);

	for (unsigned i = 0; i < s[0].n; i++)
		tl[i] = s[0].t_ext[i] - s[0].t_submit;

	/* the same restore behind a spill of everything else */
	double ttf_busy = -1, tta_busy = -1;

	if (nseq > 1) {
		for (unsigned i = 1; i < nseq; i++)
			submit(sp, &s[i], KVD_SPILL_WRITE, 0);
		drop_cache(dir, s, 1);
		submit(sp, &s[0], KVD_SPILL_READ, 0);
		bad |= drive(sp, nseq);
		ttf_busy = s[0].t_ext[0] - s[0].t_submit;
		tta_busy = s[0].t_final - s[0].t_submit;
	}
	kvd_spill_stats(sp, &st);
	kvd_spill_scan(sp, 0, NULL, NULL);      /* deletes the files */
	kvd_spill_destroy(sp);

	/* fio on the same directory, same shape */
	double fio_w = -1, fio_r = -1;

	if (op.fio && !have_fio()) {
		fprintf(stderr, "kvbench spill: fio is not installed (apt-get install fio); "
				"reporting kvd's numbers only\n");
		op.fio = 0;
	}
	/* Registered buffers and files as kvd had them: on some machines (this
	 * VM) they are worth 1.5x to reads. */
	int fixed = st.bufs_fixed > st.bufs_plain;

	if (op.fio) {
		op.seq_bytes = seq_total(&s[0]);        /* the files kvd wrote */
		fio_w = fio_run(&op, dir, "write", nseq, direct, fixed);
		if (fio_w < 0 && fixed) {
			fixed = 0;                      /* RLIMIT_MEMLOCK, say */
			fio_w = fio_run(&op, dir, "write", nseq, direct, fixed);
		}
		fio_r = fio_w > 0 ? fio_run(&op, dir, "read", nseq, direct, fixed) : -1;
		if (fio_w < 0 || fio_r < 0)
			fprintf(stderr, "kvbench spill: fio failed\n");
	}
	rmdir(dir);

	double spill_gbps = total / (spill_ms * 1e6), restore_gbps = total / (restore_ms * 1e6);
	char fw[32] = "null", fr[32] = "null", rw_[32] = "null", rr_[32] = "null";

	if (fio_w > 0) {
		snprintf(fw, sizeof fw, "%.3f", fio_w);
		snprintf(rw_, sizeof rw_, "%.3f", spill_gbps / fio_w);
	}
	if (fio_r > 0) {
		snprintf(fr, sizeof fr, "%.3f", fio_r);
		snprintf(rr_, sizeof rr_, "%.3f", restore_gbps / fio_r);
	}
	if (op.json) {
		printf("{\"bench\":\"spill\",\"fs\":\"%s\",\"direct\":%s,\"backend\":\"%s\","
		       "\"seqs\":%u,\"seq_bytes\":%llu,\"bytes\":%llu,\"extents_per_seq\":%u,"
		       "\"seg_tokens\":%u,\"seg_extent_bytes\":%llu,\"block\":%u,\"qd\":%u,"
		       "\"spill_gbps\":%.3f,\"restore_gbps\":%.3f,\"ttf_ms\":%.2f,"
		       "\"first_layer_ms\":%.2f,\"tta_ms\":%.2f,\"ttf_busy_ms\":%.2f,"
		       "\"tta_busy_ms\":%.2f,\"fio_write_gbps\":%s,\"fio_read_gbps\":%s,"
		       "\"spill_vs_fio\":%s,\"restore_vs_fio\":%s,\"fio_fixedbufs\":%s,"
		       "\"bufs_fixed\":%llu,"
		       "\"bufs_plain\":%llu,\"cpu\":\"%s\"}\n",
		       fs_name(op.dir), direct ? "true" : "false", st.backend, nseq,
		       (unsigned long long)seq_total(&s[0]), (unsigned long long)total, s[0].n,
		       op.seg_tokens, (unsigned long long)seg_ext, op.block, op.qd, spill_gbps,
		       restore_gbps, ttf, tl0, tta, ttf_busy, tta_busy, fw, fr, rw_, rr_,
		       op.fio ? fixed ? "true" : "false" : "null", (unsigned long long)st.bufs_fixed, (unsigned long long)st.bufs_plain,
		       bench_cpu_name());
		printf("{\"bench\":\"spill_timeline\",\"seq_bytes\":%llu,\"extents\":%u,"
		       "\"first_layer_ext\":%u,\"ext_ms\":[", (unsigned long long)seq_total(&s[0]),
		       s[0].n, s[0].last_l0);
		for (unsigned i = 0; i < s[0].n; i++)
			printf("%s%.2f", i ? "," : "", tl[i]);
		printf("]}\n");
	} else {
		printf("  spill   %7.3f GB/s  (%.0f ms)   fio write %s GB/s  ratio %s\n",
		       spill_gbps, spill_ms, fw, rw_);
		printf("  restore %7.3f GB/s  (%.0f ms)   fio read  %s GB/s  ratio %s\n",
		       restore_gbps, restore_ms, fr, rr_);
		printf("  one restore: first extent %.2f ms, layer 0 (%u extents) %.2f ms, "
		       "all %.2f ms\n", ttf, s[0].last_l0 + 1, tl0, tta);
		if (nseq > 1)
			printf("  behind %u spills: first extent %.2f ms, all %.2f ms\n", nseq - 1,
			       ttf_busy, tta_busy);
		printf("  buffers registered %llu, unregistered %llu; fio %s\n",
		       (unsigned long long)st.bufs_fixed, (unsigned long long)st.bufs_plain,
		       !op.fio ? "not run" : fixed ? "with --fixedbufs --registerfiles" :
		       "with plain buffers");
	}
	for (unsigned i = 0; i < nseq; i++) {
		for (unsigned e = 0; e < s[i].n; e++)
			buf_free(s[i].ext[e].p, s[i].ext[e].bytes);
		free(s[i].ext);
		free(s[i].t_ext);
	}
	free(s);
	free(tl);
	free(tmpl);
	free(prof.dense);
	free(prof.W);
	return bad;
}
