/* The spill engine over real files in a temporary directory: round trips
 * through io_uring (registered and unregistered buffers, O_DIRECT and
 * buffered), every fault of the fake backend, the spill limit, cancel, many
 * jobs at once, and the start-up scan.  Every job's results are checked for
 * order (progress in extent order, then one final), and a failed job must
 * leave no file behind.  Runs under ASan and TSan in `make test`: buffers are
 * freed as soon as a job's final result is reaped. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/attn.h"
#include "engine/err.h"
#include "kvd/store/iob.h"
#include "engine/lsh.h"
#include "engine/rng.h"
#include "kvd/store/sfmt.h"
#include "kvd/store/spill.h"
#include "engine/pool.h"
#include "kvd/store/store.h"
#include "testutil.h"

#define MAXEXT 64
#define TMPFS_MAGIC_ 0x01021994

static char root[64];
static char dir0[96], dir1[96];
static struct kvd_profile prof;
static uint64_t prof_fp;
static int have_uring;                  /* else the engine runs synchronously */

/* ---- sequences ---------------------------------------------------------- */

struct seqb {
	uint64_t seq, gen;
	unsigned n;
	struct kvd_spill_buf ext[MAXEXT];
};

static void *xalign(uint64_t bytes)
{
	void *p = NULL;

	assert_int_equal(posix_memalign(&p, 4096, bytes), 0);
	memset(p, 0, bytes);
	return p;
}

/* The next extent of s, its header filled (the spill engine seals it). */
static struct kvd_sfmt_hdr *ext_new(struct seqb *s, struct kvd_sfmt_ext e)
{
	const struct kvd_sfmt_file f = { .p = &prof, .seq = s->seq, .gen = s->gen,
					 .profile_fp = prof_fp, .tenant = "acme" };
	unsigned i = s->n++;
	uint64_t bytes;

	assert_true(i < MAXEXT);
	e.index = i;
	bytes = kvd_sfmt_extent_bytes(kvd_sfmt_ext_payload(&f, &e));
	s->ext[i].bytes = bytes;
	s->ext[i].p = xalign(bytes);
	kvd_sfmt_hdr_fill(s->ext[i].p, &f, &e);
	return s->ext[i].p;
}

static void fill_random(void *p, uint64_t n, struct kvd_rng *r)
{
	uint8_t *b = p;

	for (uint64_t i = 0; i < n; i++)
		b[i] = (uint8_t)kvd_rng_bits(r);
}

/* PROFILE, then per layer a LAYER extent (tail of a size that varies) and
 * `segs` SEG extents of seg_n tokens each (built by kvd_seg_build), then END. */
static void seq_make(struct seqb *s, uint64_t seq, uint64_t gen, unsigned layers, unsigned segs,
		     uint32_t seg_n, uint64_t seed)
{
	struct kvd_rng r = kvd_rng_make(seed);
	const struct kvd_geom *g = &prof.g;
	struct kvd_sfmt_hdr *h;

	memset(s, 0, sizeof *s);
	s->seq = seq;
	s->gen = gen;
	h = ext_new(s, (struct kvd_sfmt_ext){ .kind = KVD_SFMT_PROFILE });
	kvd_sfmt_profile_put(&prof, (char *)h + KVD_SFMT_PAGE);
	for (unsigned l = 0; l < layers; l++) {
		uint32_t tn = 17 + 13 * l + (uint32_t)(seed % 7);

		h = ext_new(s, (struct kvd_sfmt_ext){
			.kind = KVD_SFMT_LAYER, .layer = l, .n = tn,
			.flags = KVD_SFMT_LF_MEAN | KVD_SFMT_LF_SEALED,
			.tok_begin = (uint64_t)segs * seg_n });
		fill_random((char *)h + KVD_SFMT_PAGE, h->payload_bytes, &r);
		for (unsigned k = 0; k < segs; k++) {
			size_t rows = (size_t)g->kv_heads * seg_n * g->d;
			size_t nc = (size_t)g->kv_heads * g->L * seg_n;
			uint16_t *kk = malloc(rows * 2), *vv = malloc(rows * 2), *cc = malloc(nc * 2);
			struct kvd_seg *sg;

			for (size_t i = 0; i < rows; i++) {
				kk[i] = (uint16_t)(0x3c00 + kvd_rng_below(&r, 0x400));
				vv[i] = (uint16_t)(0xbc00 + kvd_rng_below(&r, 0x400));
			}
			for (size_t i = 0; i < nc; i++)
				cc[i] = (uint16_t)kvd_rng_below(&r, 1u << g->K);
			assert_int_equal(kvd_seg_build(g, seg_n, kk, vv, cc, NULL, &sg), 0);
			h = ext_new(s, (struct kvd_sfmt_ext){
				.kind = KVD_SFMT_SEG, .layer = l, .n = seg_n,
				.tok_begin = (uint64_t)k * seg_n });
			memcpy((char *)h + KVD_SFMT_PAGE, sg->mem, kvd_seg_bytes(g, seg_n));
			kvd_seg_free(sg);
			free(kk);
			free(vv);
			free(cc);
		}
	}
	ext_new(s, (struct kvd_sfmt_ext){ .kind = KVD_SFMT_END });
}

/* PROFILE, `layers` LAYER extents of tn tail rows (about 10 MiB at 65536)
 * with cheap filler, END: a job that takes a while. */
static void seq_make_big(struct seqb *s, uint64_t seq, unsigned layers, uint32_t tn)
{
	struct kvd_sfmt_hdr *h;

	memset(s, 0, sizeof *s);
	s->seq = seq;
	s->gen = 1;
	h = ext_new(s, (struct kvd_sfmt_ext){ .kind = KVD_SFMT_PROFILE });
	kvd_sfmt_profile_put(&prof, (char *)h + KVD_SFMT_PAGE);
	for (unsigned l = 0; l < layers; l++) {
		uint64_t *w;

		h = ext_new(s, (struct kvd_sfmt_ext){ .kind = KVD_SFMT_LAYER, .layer = l, .n = tn });
		w = (uint64_t *)((char *)h + KVD_SFMT_PAGE);
		for (uint64_t i = 0; i < h->payload_bytes / 8; i++)
			w[i] = (i + l) * 0x9e3779b97f4a7c15ull;
	}
	ext_new(s, (struct kvd_sfmt_ext){ .kind = KVD_SFMT_END });
}

/* Buffers for reading s back, sized from its headers, full of junk. */
static void seq_blank(struct seqb *d, const struct seqb *s)
{
	*d = *s;
	for (unsigned i = 0; i < s->n; i++) {
		d->ext[i].p = xalign(s->ext[i].bytes);
		memset(d->ext[i].p, 0xee, s->ext[i].bytes);
	}
}

static void seq_free(struct seqb *s)
{
	for (unsigned i = 0; i < s->n; i++)
		free(s->ext[i].p);
	s->n = 0;
}

static void seq_equal(const struct seqb *a, const struct seqb *b)
{
	assert_int_equal(a->n, b->n);
	for (unsigned i = 0; i < a->n; i++) {
		assert_true(a->ext[i].bytes == b->ext[i].bytes);
		assert_memory_equal(a->ext[i].p, b->ext[i].p, a->ext[i].bytes);
	}
}

static uint64_t seq_bytes(const struct seqb *s)
{
	uint64_t b = 0;

	for (unsigned i = 0; i < s->n; i++)
		b += s->ext[i].bytes;
	return b;
}

/* ---- jobs --------------------------------------------------------------- */

struct track {
	struct kvd_spill_job j;
	struct seqb *bufs;
	unsigned progress;              /* progress results seen */
	int final, bad;
	int free_at_final;              /* free the buffers the moment it ends */
	unsigned order;                 /* its final result was the order-th */
};

static unsigned finals;

static void job_init(struct track *t, int op, struct seqb *s, unsigned dir)
{
	memset(t, 0, sizeof *t);
	t->j.op = op;
	t->j.seq = s->seq;
	t->j.gen = s->gen;
	t->j.dir = dir;
	t->j.ext = s->ext;
	t->j.next = s->n;
	t->j.user = t;
	t->bufs = s;
}

/* Reaps until `want` final results came; checks every job's order. */
static void drive(struct kvd_spill *sp, unsigned want)
{
	unsigned got = 0;

	while (got < want) {
		struct pollfd p = { .fd = kvd_spill_fd(sp), .events = POLLIN };
		struct kvd_spill_result res[16];
		unsigned n;

		assert_int_equal(poll(&p, 1, 120000), 1);
		n = kvd_spill_reap(sp, res, 16);
		for (unsigned i = 0; i < n; i++) {
			struct track *t = res[i].job->user;

			if (t->final)
				t->bad = 1;     /* anything after the final result */
			if (!res[i].final) {
				if (t->j.op != KVD_SPILL_READ || res[i].ext != t->progress)
					t->bad = 1;
				t->progress++;
				continue;
			}
			t->final = 1;
			t->order = finals++;
			got++;
			if (t->free_at_final && t->bufs)
				seq_free(t->bufs);
		}
	}
}

static void run1(struct kvd_spill *sp, struct track *t)
{
	assert_int_equal(kvd_spill_submit(sp, &t->j), 0);
	drive(sp, 1);
	assert_int_equal(t->bad, 0);
}

static struct kvd_spill *mk(const char *fault, uint64_t limit, uint32_t block, int ndirs)
{
	struct kvd_spill_cfg c = { .dirs = { dir0, dir1 }, .ndirs = (unsigned)ndirs, .limit = limit,
				   .qd = 32, .block = block, .fault = fault };
	struct kvd_spill *sp;

	assert_int_equal(kvd_spill_create(&c, &sp), 0);
	return sp;
}

/* Files in d with the given suffix. */
static int count_files(const char *d, const char *suffix)
{
	DIR *dp = opendir(d);
	struct dirent *de;
	int n = 0;

	assert_non_null(dp);
	while ((de = readdir(dp))) {
		size_t a = strlen(de->d_name), b = strlen(suffix);

		n += a > b && !strcmp(de->d_name + a - b, suffix);
	}
	closedir(dp);
	return n;
}

static int no_files(void)
{
	return count_files(dir0, ".kvs") + count_files(dir0, ".tmp") +
	       count_files(dir1, ".kvs") + count_files(dir1, ".tmp") == 0;
}

/* Empties d, and its quarantine/ (which the scan fills), and removes that. */
static void rm_all(const char *d)
{
	DIR *dp = opendir(d);
	struct dirent *de;
	char p[512];

	if (!dp)
		return;
	while ((de = readdir(dp))) {
		if (de->d_name[0] == '.' && (!de->d_name[1] || !strcmp(de->d_name, "..")))
			continue;
		snprintf(p, sizeof p, "%s/%s", d, de->d_name);
		if (unlink(p) && errno == EISDIR && !strcmp(de->d_name, "quarantine")) {
			rm_all(p);
			rmdir(p);
		}
	}
	closedir(dp);
}

static int setup(void **state)
{
	rm_all(dir0);
	rm_all(dir1);
	return 0;
}

/* ---- io_uring ----------------------------------------------------------- */

struct scan_seen {
	unsigned files, n[4];
	uint64_t seq[4], disk;
	int reject_seq;                 /* fn returns reject_rc (0: 1) for this seq */
	uint64_t reject;
	int reject_rc;
};

static int scan_fn(void *arg, unsigned dir, const struct kvd_sfmt_hdr *hdr, unsigned n,
		   const void *profile, uint64_t profile_bytes, uint64_t disk_bytes)
{
	struct scan_seen *s = arg;
	struct kvd_profile p;
	char m[128];

	if (s->reject_seq && hdr[0].seq == s->reject)
		return s->reject_rc ? s->reject_rc : 1;
	assert_true(s->files < 4);
	assert_int_equal(hdr[0].kind, KVD_SFMT_PROFILE);
	assert_int_equal(hdr[n - 1].kind, KVD_SFMT_END);
	assert_int_equal(kvd_sfmt_profile_get(profile, profile_bytes, &p, m, sizeof m), 0);
	assert_int_equal(p.g.K, prof.g.K);
	free(p.dense);
	free(p.W);
	s->seq[s->files] = hdr[0].seq;
	s->n[s->files++] = n;
	s->disk += disk_bytes;
	return 0;
}

static void test_uring_roundtrip(void **state)
{
	struct kvd_spill *sp = mk(NULL, 0, 64 << 10, 2);
	struct kvd_spill_stats st;
	struct seqb a, b, ra;
	struct track t;
	char path[256];
	int fd;

	seq_make(&a, 0xabc, 3, 2, 2, 300, 1);
	seq_make(&b, 0xdef, 1, 3, 1, 256, 2);
	assert_true(a.n == 8);

	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	assert_true(t.j.wdir < 2);
	assert_true(t.j.disk_bytes >= seq_bytes(&a));
	assert_true(kvd_spill_disk_bytes(sp) == t.j.disk_bytes);
	unsigned adir = t.j.wdir;
	uint64_t adisk = t.j.disk_bytes;

	assert_int_equal(count_files(adir ? dir1 : dir0, ".kvs"), 1);
	assert_int_equal(count_files(adir ? dir1 : dir0, ".tmp"), 0);

	/* round robin: the next file goes to the other directory */
	job_init(&t, KVD_SPILL_WRITE, &b, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	assert_int_equal(t.j.wdir, !adir);
	uint64_t bdisk = t.j.disk_bytes;

	seq_blank(&ra, &a);
	job_init(&t, KVD_SPILL_READ, &ra, adir);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	assert_int_equal(t.progress, a.n);
	assert_int_equal(t.j.done, a.n);
	seq_equal(&a, &ra);

	kvd_spill_stats(sp, &st);
	assert_string_equal(st.backend, have_uring ? "io_uring" : "fake");
	assert_true(st.reads >= seq_bytes(&a) / (64 << 10));
	assert_true(st.fsyncs == 4);    /* fdatasync and the directory, per file */
	assert_true(st.bufs_fixed + st.bufs_plain == 2u * a.n + b.n);
	printf("io_uring: O_DIRECT mask %x, buffers registered %llu, unregistered %llu, "
	       "files registered %llu\n", st.direct_mask, (unsigned long long)st.bufs_fixed,
	       (unsigned long long)st.bufs_plain, (unsigned long long)st.files_fixed);
	kvd_spill_destroy(sp);

	/* A restart: leftovers of a crashed write and a broken file. */
	snprintf(path, sizeof path, "%s/%016x.kvs.tmp", dir0, 0x77);
	fd = open(path, O_CREAT | O_WRONLY, 0600);
	assert_true(fd >= 0 && write(fd, "x", 1) == 1);
	close(fd);
	snprintf(path, sizeof path, "%s/%016x.kvs", dir1, 0x78);
	fd = open(path, O_CREAT | O_WRONLY, 0600);
	assert_true(fd >= 0 && write(fd, a.ext[0].p, 4096) == 4096);   /* seq differs, no END */
	close(fd);

	struct scan_seen seen = { 0 };

	sp = mk(NULL, 0, 0, 2);
	assert_int_equal(kvd_spill_scan(sp, 1, scan_fn, &seen), 2);
	assert_int_equal(seen.files, 2);
	assert_true(seen.seq[0] + seen.seq[1] == 0xabc + 0xdef);
	assert_int_equal(seen.n[0] + seen.n[1], a.n + b.n);
	assert_true(seen.disk == adisk + bdisk);
	assert_true(kvd_spill_disk_bytes(sp) == adisk + bdisk);
	assert_int_equal(count_files(dir0, ".tmp") + count_files(dir1, ".tmp"), 0);
	assert_int_equal(count_files(dir0, ".kvs") + count_files(dir1, ".kvs"), 2);
	kvd_spill_destroy(sp);

	/* fn refuses one: it is deleted, the other kept */
	memset(&seen, 0, sizeof seen);
	seen.reject_seq = 1;
	seen.reject = 0xdef;
	sp = mk(NULL, 0, 0, 2);
	assert_int_equal(kvd_spill_scan(sp, 1, scan_fn, &seen), 1);
	assert_true(kvd_spill_disk_bytes(sp) == adisk);
	assert_int_equal(count_files(dir0, ".kvs") + count_files(dir1, ".kvs"), 1);

	/* the kept file reads back through the new engine */
	seq_free(&ra);
	seq_blank(&ra, &a);
	job_init(&t, KVD_SPILL_READ, &ra, adir);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	seq_equal(&a, &ra);

	/* UNLINK takes it off the count */
	job_init(&t, KVD_SPILL_UNLINK, &ra, adir);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	assert_true(kvd_spill_disk_bytes(sp) == 0);
	assert_true(no_files());

	/* READ of a file that is not there fails and leaves nothing */
	job_init(&t, KVD_SPILL_READ, &ra, adir);
	run1(sp, &t);
	assert_int_equal(t.j.res, -ENOENT);
	assert_true(t.j.msg[0]);
	kvd_spill_destroy(sp);

	/* keep = 0 deletes everything */
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	sp = mk(NULL, 0, 0, 2);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	kvd_spill_destroy(sp);
	sp = mk(NULL, 0, 0, 2);
	assert_int_equal(kvd_spill_scan(sp, 0, scan_fn, &seen), 0);
	assert_true(no_files());
	kvd_spill_destroy(sp);

	seq_free(&a);
	seq_free(&b);
	seq_free(&ra);
}

/* A file that loses its tail, or a bit, is refused on READ. */
static void test_uring_truncated(void **state)
{
	struct kvd_spill *sp = mk(NULL, 0, 64 << 10, 1);
	struct seqb a, ra;
	struct track t;
	char path[256];

	seq_make(&a, 0x55, 1, 2, 1, 256, 5);
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	snprintf(path, sizeof path, "%s/%016x.kvs", dir0, 0x55);
	assert_int_equal(truncate(path, (off_t)(seq_bytes(&a) - 8192)), 0);
	seq_blank(&ra, &a);
	job_init(&t, KVD_SPILL_READ, &ra, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, -KVD_ELOST);
	assert_int_equal(t.progress, 0);
	printf("truncated: %s\n", t.j.msg);

	/* a flipped bit in a SEG payload: the extents before it come out */
	assert_int_equal(truncate(path, 0), 0);
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);

	int fd = open(path, O_RDWR);
	unsigned char c;
	off_t off = (off_t)(a.ext[0].bytes + a.ext[1].bytes + 4096 + 1000);

	assert_true(fd >= 0 && pread(fd, &c, 1, off) == 1);
	c ^= 1;
	assert_true(pwrite(fd, &c, 1, off) == 1);
	close(fd);
	job_init(&t, KVD_SPILL_READ, &ra, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, -KVD_ELOST);
	assert_int_equal(t.progress, 2);
	assert_int_equal(t.j.done, 2);
	printf("bit flip: %s\n", t.j.msg);
	kvd_spill_destroy(sp);

	/* The scan reads headers only: a payload's bit flip passes, a missing
	 * END does not. */
	struct scan_seen seen = { 0 };

	sp = mk(NULL, 0, 0, 1);
	assert_int_equal(kvd_spill_scan(sp, 1, scan_fn, &seen), 1);
	kvd_spill_destroy(sp);
	assert_int_equal(truncate(path, (off_t)(seq_bytes(&a) - 4096)), 0);
	sp = mk(NULL, 0, 0, 1);
	assert_int_equal(kvd_spill_scan(sp, 1, scan_fn, &seen), 0);
	assert_true(no_files());
	assert_true(kvd_spill_disk_bytes(sp) == 0);
	kvd_spill_destroy(sp);
	/* moved aside, not deleted */
	snprintf(path, sizeof path, "%s/quarantine/%016x.kvs", dir0, 0x55);
	assert_int_equal(access(path, F_OK), 0);
	seq_free(&a);
	seq_free(&ra);
}

/* ---- start-up scan: bad files are quarantined, unreadable ones kept ----- */

static ino_t eio_ino;                   /* reads of this file fail EIO */
static unsigned eio_hits;

static ssize_t eio_pread(int fd, void *buf, size_t n, off_t off)
{
	struct stat st;

	if (fstat(fd, &st) == 0 && st.st_ino == eio_ino) {
		eio_hits++;
		errno = EIO;
		return -1;
	}
	return pread(fd, buf, n, off);
}

static void flip(const char *d, uint64_t seq, off_t off)
{
	char path[256];
	unsigned char c;
	int fd;

	snprintf(path, sizeof path, "%s/%016llx.kvs", d, (unsigned long long)seq);
	fd = open(path, O_RDWR);
	assert_true(fd >= 0 && pread(fd, &c, 1, off) == 1);
	c ^= 0x10;
	assert_true(pwrite(fd, &c, 1, off) == 1);
	close(fd);
}

static int exists(const char *d, const char *name)
{
	char path[256];

	snprintf(path, sizeof path, "%s/%s", d, name);
	return access(path, F_OK) == 0;
}

static void test_scan_quarantine(void **state)
{
	struct kvd_spill *sp = mk(NULL, 0, 0, 1);
	struct seqb s[6], ra;
	struct track t;
	struct stat st;
	char q[128], path[256];
	int fd;

	/* good, header flipped, profile payload flipped, EIO, refused bad by
	 * fn, refused for want of memory by fn */
	for (unsigned i = 0; i < 6; i++) {
		seq_make(&s[i], 0x101 + i, 1, 2, 1, 256, 10 + i);
		job_init(&t, KVD_SPILL_WRITE, &s[i], 0);
		run1(sp, &t);
		assert_int_equal(t.j.res, 0);
	}
	kvd_spill_destroy(sp);
	flip(dir0, 0x102, (off_t)s[1].ext[0].bytes + 40);       /* extent 1's header */
	flip(dir0, 0x103, 4096 + 8);                            /* PROFILE payload */
	snprintf(path, sizeof path, "%s/%016x.kvs", dir0, 0x104);
	assert_int_equal(stat(path, &st), 0);
	eio_ino = st.st_ino;
	/* not ours: never deleted nor moved */
	snprintf(path, sizeof path, "%s/notes.kvs", dir0);
	fd = open(path, O_CREAT | O_WRONLY, 0600);
	assert_true(fd >= 0);
	close(fd);
	snprintf(path, sizeof path, "%s/other.tmp", dir0);
	fd = open(path, O_CREAT | O_WRONLY, 0600);
	assert_true(fd >= 0);
	close(fd);

	/* fn fails 0x106 for want of memory: it stays in place */
	struct scan_seen seen = { .reject_seq = 1, .reject = 0x106, .reject_rc = -ENOMEM };

	kvd_spill_scan_pread = eio_pread;
	sp = mk(NULL, 0, 0, 1);
	assert_int_equal(kvd_spill_scan(sp, 1, scan_fn, &seen), 2);     /* 101, 105 */
	kvd_spill_destroy(sp);
	kvd_spill_scan_pread = pread;
	assert_true(eio_hits > 0);
	assert_int_equal(seen.files, 2);
	snprintf(q, sizeof q, "%s/quarantine", dir0);
	assert_int_equal(stat(q, &st), 0);
	assert_true(S_ISDIR(st.st_mode) && (st.st_mode & 0777) == 0700);
	assert_true(exists(q, "0000000000000102.kvs") && !exists(dir0, "0000000000000102.kvs"));
	assert_true(exists(q, "0000000000000103.kvs") && !exists(dir0, "0000000000000103.kvs"));
	assert_true(exists(dir0, "0000000000000104.kvs") && !exists(q, "0000000000000104.kvs"));
	assert_true(exists(dir0, "0000000000000106.kvs") && !exists(q, "0000000000000106.kvs"));
	assert_true(exists(dir0, "notes.kvs") && exists(dir0, "other.tmp"));
	assert_int_equal(count_files(q, ".kvs"), 2);

	/* fn says bad: quarantined; the EIO file and the -ENOMEM one load now */
	memset(&seen, 0, sizeof seen);
	seen.reject_seq = 1;
	seen.reject = 0x105;
	seen.reject_rc = -KVD_EFORMAT;
	sp = mk(NULL, 0, 0, 1);
	assert_int_equal(kvd_spill_scan(sp, 1, scan_fn, &seen), 3);     /* 101, 104, 106 */
	assert_true(exists(q, "0000000000000105.kvs") && !exists(dir0, "0000000000000105.kvs"));

	/* the good file still reads back intact */
	seq_blank(&ra, &s[0]);
	job_init(&t, KVD_SPILL_READ, &ra, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	seq_equal(&s[0], &ra);
	kvd_spill_destroy(sp);

	/* the same name quarantined twice: both kept */
	job_init(&t, KVD_SPILL_WRITE, &s[1], 0);
	sp = mk(NULL, 0, 0, 1);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	kvd_spill_destroy(sp);
	flip(dir0, 0x102, 100);                                 /* PROFILE header */
	memset(&seen, 0, sizeof seen);
	sp = mk(NULL, 0, 0, 1);
	assert_int_equal(kvd_spill_scan(sp, 1, scan_fn, &seen), 3);
	kvd_spill_destroy(sp);
	assert_true(exists(q, "0000000000000102.kvs.1") && exists(q, "0000000000000102.kvs"));

	/* without --persist the directory is emptied of our files, but
	 * quarantine/ and names not ours stay */
	sp = mk(NULL, 0, 0, 1);
	assert_int_equal(kvd_spill_scan(sp, 0, NULL, NULL), 0);
	kvd_spill_destroy(sp);
	assert_int_equal(count_files(dir0, ".kvs"), 1);         /* notes.kvs */
	assert_true(exists(dir0, "other.tmp"));
	assert_int_equal(count_files(q, ".kvs"), 3);
	assert_true(exists(q, "0000000000000102.kvs.1"));

	for (unsigned i = 0; i < 6; i++)
		seq_free(&s[i]);
	seq_free(&ra);
}

static void roundtrip_in(const char *d, int buffered, uint32_t *direct_mask)
{
	struct kvd_spill_cfg c = { .dirs = { d }, .ndirs = 1, .qd = 32, .block = 32 << 10,
				   .buffered = buffered };
	struct kvd_spill_stats st;
	struct kvd_spill *sp;
	struct seqb a, ra;
	struct track t;

	assert_int_equal(kvd_spill_create(&c, &sp), 0);
	kvd_spill_stats(sp, &st);
	*direct_mask = st.direct_mask;
	seq_make(&a, 9, 9, 2, 1, 256, 9);
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	seq_blank(&ra, &a);
	job_init(&t, KVD_SPILL_READ, &ra, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	seq_equal(&a, &ra);
	assert_int_equal(kvd_spill_scan(sp, 0, NULL, NULL), 0);
	kvd_spill_destroy(sp);
	seq_free(&a);
	seq_free(&ra);
}

/* Buffered I/O: asked for, and on tmpfs, which refused O_DIRECT before
 * Linux 6.6 (the engine then falls back by itself). */
static void test_buffered(void **state)
{
	char d[] = "/dev/shm/kvd-spill-XXXXXX";
	struct statfs fs;
	uint32_t mask;

	roundtrip_in(dir0, 1, &mask);
	assert_int_equal(mask, 0);
	if (statfs("/dev/shm", &fs) || fs.f_type != TMPFS_MAGIC_ || !mkdtemp(d)) {
		printf("SKIP: no tmpfs at /dev/shm\n");
		return;
	}
	roundtrip_in(d, 0, &mask);
	printf("tmpfs: %s\n", mask ? "takes O_DIRECT" : "refuses O_DIRECT, buffered I/O");
	rmdir(d);
}

/* capget/capset by hand: only CAP_IPC_LOCK's effective bit changes. */
static int ipc_lock_effective(int on)
{
	struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct d[2];
	int was;

	if (syscall(SYS_capget, &h, d))
		return -1;
	was = !!(d[0].effective & (1u << CAP_IPC_LOCK));
	if (on)
		d[0].effective |= d[0].permitted & (1u << CAP_IPC_LOCK);
	else
		d[0].effective &= ~(1u << CAP_IPC_LOCK);
	if (syscall(SYS_capset, &h, d))
		return -1;
	return was;
}

/* Buffer registration refused (RLIMIT_MEMLOCK): the jobs still work,
 * unregistered, and the counters say so. */
static void test_memlock_fallback(void **state)
{
	struct rlimit old, low;
	struct kvd_spill_stats st;
	struct kvd_spill *sp;
	struct seqb a, ra;
	struct track t;
	int had;

	if (!have_uring) {
		printf("SKIP: no io_uring here\n");
		skip();
	}
	assert_int_equal(getrlimit(RLIMIT_MEMLOCK, &old), 0);
	had = ipc_lock_effective(0);        /* the ring is created without it */
	low = old;
	low.rlim_cur = 64 << 10;
	assert_int_equal(setrlimit(RLIMIT_MEMLOCK, &low), 0);
	sp = mk(NULL, 0, 64 << 10, 1);
	seq_make(&a, 0x31, 1, 1, 2, 1024, 3);       /* SEGs far above 64 KiB */
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	seq_blank(&ra, &a);
	job_init(&t, KVD_SPILL_READ, &ra, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	seq_equal(&a, &ra);
	kvd_spill_stats(sp, &st);
	printf("memlock 64 KiB: buffers registered %llu, unregistered %llu\n",
	       (unsigned long long)st.bufs_fixed, (unsigned long long)st.bufs_plain);
	/* Kernels that charge io_uring's rings to the user's locked memory
	 * (shared by every process of the uid) can refuse the ring itself at
	 * 64 KiB when other io_uring users run: the data still round-tripped
	 * (above), through the synchronous backend, but registration was
	 * never tried. */
	int fell_back = strcmp(st.backend, "io_uring") != 0;

	if (!fell_back)
		assert_true(st.bufs_plain >= 4);
	kvd_spill_destroy(sp);
	assert_int_equal(setrlimit(RLIMIT_MEMLOCK, &old), 0);
	if (had > 0)
		ipc_lock_effective(1);
	seq_free(&a);
	seq_free(&ra);
	if (fell_back) {
		printf("SKIP: the io_uring ring itself was refused at 64 KiB of memlock (%s)\n",
		       st.backend);
		skip();
	}
}

/* ---- the fake backend's faults ------------------------------------------ */

/* One WRITE with the fault spec; returns the job's res. */
static int write_with(const char *fault, struct seqb *a, struct kvd_spill_stats *st)
{
	struct kvd_spill *sp = mk(fault, 0, 16 << 10, 1);
	struct track t;

	job_init(&t, KVD_SPILL_WRITE, a, 0);
	run1(sp, &t);
	if (t.j.res)
		assert_true(t.j.msg[0]);
	if (st)
		kvd_spill_stats(sp, st);
	kvd_spill_destroy(sp);
	return t.j.res;
}

static int read_with(const char *fault, const struct seqb *a, struct track *t)
{
	struct kvd_spill *sp = mk(fault, 0, 16 << 10, 1);
	struct seqb *ra = malloc(sizeof *ra);

	seq_blank(ra, a);
	job_init(t, KVD_SPILL_READ, ra, 0);
	run1(sp, t);
	if (!t->j.res)
		seq_equal(a, ra);
	else
		assert_true(t->j.msg[0] && t->j.done < a->n && t->progress == t->j.done);
	kvd_spill_destroy(sp);
	seq_free(ra);
	free(ra);
	return t->j.res;
}

static void test_fake_write_faults(void **state)
{
	struct kvd_spill_stats st;
	struct seqb a;

	seq_make(&a, 0x10, 2, 2, 1, 256, 4);
	assert_int_equal(write_with("enospc@2", &a, &st), -ENOSPC);
	assert_true(no_files());
	assert_string_equal(st.backend, "fake");
	assert_true(st.faults == 1);
	assert_int_equal(write_with("eio-write@5", &a, NULL), -EIO);
	assert_true(no_files());
	assert_int_equal(write_with("eio-write@*", &a, NULL), -EIO);
	assert_true(no_files());

	/* a failed fdatasync fails the job at once: one fsync, never again */
	assert_int_equal(write_with("fsync@0", &a, &st), -EIO);
	assert_true(no_files());
	assert_true(st.fsyncs == 1);
	/* the directory's fsync failing also loses the file */
	assert_int_equal(write_with("fsync@1", &a, &st), -EIO);
	assert_true(no_files());
	assert_true(st.fsyncs == 2);

	/* nothing faulty: a clean write, read back by a clean engine */
	struct track t;

	assert_int_equal(write_with("", &a, &st), 0);
	assert_true(st.fsyncs == 2 && st.faults == 0);
	assert_int_equal(read_with("", &a, &t), 0);
	assert_int_equal(t.progress, a.n);
	setup(NULL);
	seq_free(&a);
}

static void test_fake_short(void **state)
{
	struct kvd_spill_stats st;
	struct track t;
	struct seqb a;

	seq_make(&a, 0x11, 2, 2, 2, 256, 6);
	assert_int_equal(write_with("short@*", &a, &st), 0);
	assert_true(st.short_ops > a.n);
	assert_int_equal(read_with("short@*", &a, &t), 0);
	assert_int_equal(t.progress, a.n);
	assert_int_equal(read_with("short@3,short@7", &a, &t), 0);
	setup(NULL);
	seq_free(&a);
}

/* A torn write looks fine until it is read: the READ refuses it and hands
 * out only the extents before the torn one. */
static void test_fake_torn(void **state)
{
	struct track t;
	struct seqb a;

	seq_make(&a, 0x12, 2, 2, 1, 256, 7);
	/* PROFILE and LAYER take one op each: write op 2 is the first of the SEG */
	assert_true(a.ext[0].bytes <= (16 << 10) && a.ext[1].bytes <= (16 << 10));
	assert_true(a.ext[2].bytes > (16 << 10));
	assert_int_equal(write_with("torn@2", &a, NULL), 0);
	assert_int_equal(count_files(dir0, ".kvs"), 1);
	assert_int_equal(read_with("", &a, &t), -KVD_ELOST);
	assert_int_equal(t.j.done, 2);
	printf("torn: %s\n", t.j.msg);
	setup(NULL);
	seq_free(&a);
}

static void test_fake_read_faults(void **state)
{
	struct track t;
	struct seqb a;

	seq_make(&a, 0x13, 2, 2, 1, 256, 8);
	assert_int_equal(write_with("", &a, NULL), 0);
	assert_int_equal(read_with("corrupt@0", &a, &t), -KVD_ELOST);
	assert_int_equal(t.j.done, 0);
	assert_int_equal(read_with("corrupt@4", &a, &t), -KVD_ELOST);
	assert_int_equal(read_with("eio-read@3", &a, &t), -EIO);
	assert_int_equal(read_with("eio-read@*", &a, &t), -EIO);
	assert_int_equal(t.j.done, 0);
	/* faults for writes leave reads alone */
	assert_int_equal(read_with("enospc@*,torn@*,eio-write@*,fsync@*", &a, &t), 0);
	setup(NULL);
	seq_free(&a);
}

/* A READ's drain hook runs once per extent that verified, with the header
 * page and payload as written, and never for one that did not. */
struct drained {
	const struct seqb *src;
	unsigned i, hits;
	int same;
};

static void drain_rec(void *arg, void *page)
{
	struct drained *d = arg;

	d->hits++;
	d->same = !memcmp(page, d->src->ext[d->i].p, d->src->ext[d->i].bytes);
}

static unsigned drained_read(const char *fault, const struct seqb *a, struct drained *d)
{
	struct kvd_spill *sp = mk(fault, 0, 16 << 10, 1);
	struct seqb ra;
	struct track t;
	unsigned hits = 0;

	seq_blank(&ra, a);
	for (unsigned i = 0; i < a->n; i++) {
		d[i] = (struct drained){ .src = a, .i = i };
		ra.ext[i].drain = drain_rec;
		ra.ext[i].fill_arg = &d[i];
	}
	job_init(&t, KVD_SPILL_READ, &ra, 0);
	run1(sp, &t);
	for (unsigned i = 0; i < a->n; i++) {
		assert_true(d[i].hits <= 1);
		assert_true(!d[i].hits || d[i].same);
		hits += d[i].hits;
	}
	assert_int_equal(hits, t.j.done);
	kvd_spill_destroy(sp);
	seq_free(&ra);
	return hits;
}

static void test_read_drain(void **state)
{
	struct seqb a;
	struct drained d[16];

	(void)state;
	seq_make(&a, 0x14, 2, 2, 1, 256, 9);
	assert_true(a.n <= 16);
	assert_int_equal(write_with("", &a, NULL), 0);
	assert_int_equal(drained_read("", &a, d), a.n);
	assert_int_equal(drained_read("corrupt@0", &a, d), 0);
	assert_true(drained_read("corrupt@4", &a, d) < a.n);   /* op 4: in a later extent */
	setup(NULL);
	seq_free(&a);
}

/* A WRITE whose buffers the caller never touched: the engine copies each
 * header page from hdr just before the fill writes the payload, and the
 * submit checks the header there.  The file equals one written from
 * ready buffers; without hdr the blank header page is refused. */
static void fill_copy(void *arg, void *payload)
{
	const struct kvd_spill_buf *src = arg;

	memcpy(payload, (const char *)src->p + KVD_SFMT_PAGE, src->bytes - KVD_SFMT_PAGE);
}

static void test_write_fill_hdr(void **state)
{
	struct seqb a, b;
	struct track t;
	struct kvd_spill *sp;

	(void)state;
	seq_make(&a, 0x15, 3, 2, 1, 256, 10);
	assert_int_equal(write_with("", &a, NULL), 0);          /* seals a in place */
	seq_blank(&b, &a);
	for (unsigned i = 0; i < a.n; i++)
		b.ext[i] = (struct kvd_spill_buf){ .p = b.ext[i].p, .bytes = a.ext[i].bytes,
						   .fill = fill_copy, .fill_arg = &a.ext[i] };
	sp = mk("", 0, 16 << 10, 1);
	job_init(&t, KVD_SPILL_WRITE, &b, 0);
	assert_int_equal(kvd_spill_submit(sp, &t.j), -EINVAL);  /* 0xee headers */
	kvd_spill_destroy(sp);
	for (unsigned i = 0; i < a.n; i++)
		b.ext[i].hdr = a.ext[i].p;
	assert_int_equal(write_with("", &b, NULL), 0);
	seq_equal(&a, &b);
	assert_int_equal(read_with("", &b, &t), 0);
	setup(NULL);
	seq_free(&a);
	seq_free(&b);
}

static void test_fault_specs(void **state)
{
	static const char *const bad[] = {
		"bogus@1", "enospc", "enospc@", "enospc@x", "enospc@1,", ",", "short@1*",
		"eio@1", "fsync@-1", "torn@*,", "corrupt@18446744073709551616",
	};
	static const char *const good[] = {
		"", "enospc@0", "eio-write@3,eio-read@*", "short@*,torn@1,corrupt@3,fsync@0",
	};
	struct kvd_spill_cfg c = { .dirs = { dir0 }, .ndirs = 1 };
	struct kvd_spill *sp;
	char msg[128];

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		msg[0] = 0;
		assert_int_equal(kvd_iob_fault_parse(bad[i], msg, sizeof msg), -EINVAL);
		assert_true(msg[0]);
	}
	for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
		assert_int_equal(kvd_iob_fault_parse(good[i], msg, sizeof msg), 0);
	c.fault = "enospc@1,nope@2";
	assert_int_equal(kvd_spill_create(&c, &sp), -EINVAL);
	c.fault = NULL;
	c.qd = 8;
	assert_int_equal(kvd_spill_create(&c, &sp), -EINVAL);
	c.qd = 0;
	c.block = 1000;
	assert_int_equal(kvd_spill_create(&c, &sp), -EINVAL);
}

static void test_bad_jobs(void **state)
{
	struct kvd_spill *sp = mk("", 0, 0, 1);
	struct track t;
	struct seqb a;

	seq_make(&a, 0x14, 1, 1, 1, 256, 9);
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	t.j.gen = 2;                            /* headers say 1 */
	assert_int_equal(kvd_spill_submit(sp, &t.j), -EINVAL);
	assert_true(t.j.msg[0]);
	job_init(&t, KVD_SPILL_READ, &a, 2);    /* one directory */
	assert_int_equal(kvd_spill_submit(sp, &t.j), -EINVAL);
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	a.ext[1].bytes += 4096;                 /* not what the header wants */
	assert_int_equal(kvd_spill_submit(sp, &t.j), -EINVAL);
	a.ext[1].bytes -= 4096;
	a.ext[1].p = (char *)a.ext[1].p + 64;
	assert_int_equal(kvd_spill_submit(sp, &t.j), -EINVAL);
	a.ext[1].p = (char *)a.ext[1].p - 64;
	t.j.op = 7;
	assert_int_equal(kvd_spill_submit(sp, &t.j), -EINVAL);
	kvd_spill_destroy(sp);
	assert_true(no_files());
	seq_free(&a);
}

/* ---- limit, cancel, many ------------------------------------------------ */

static void test_limit(void **state)
{
	struct kvd_spill_stats st;
	struct kvd_spill *sp;
	struct seqb a, b;
	struct track t;

	seq_make(&a, 0x20, 1, 2, 1, 256, 10);
	seq_make(&b, 0x21, 1, 2, 1, 256, 11);
	/* too big on its own: refused before anything is written */
	sp = mk(NULL, seq_bytes(&a) - 4096, 0, 2);
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, -ENOSPC);
	kvd_spill_stats(sp, &st);
	assert_true(st.writes == 0);
	assert_true(no_files());
	kvd_spill_destroy(sp);

	/* room for one: the second is refused, and fits after an UNLINK */
	sp = mk(NULL, seq_bytes(&a) + seq_bytes(&b) / 2, 0, 2);
	job_init(&t, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	unsigned adir = t.j.wdir;

	job_init(&t, KVD_SPILL_WRITE, &b, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, -ENOSPC);
	assert_int_equal(count_files(dir0, ".kvs") + count_files(dir1, ".kvs"), 1);
	job_init(&t, KVD_SPILL_UNLINK, &a, adir);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	job_init(&t, KVD_SPILL_WRITE, &b, 0);
	run1(sp, &t);
	assert_int_equal(t.j.res, 0);
	kvd_spill_destroy(sp);
	setup(NULL);
	seq_free(&a);
	seq_free(&b);
}

/* Big jobs with small operations, cancelled at once or after the first
 * result: each ends -ECANCELED (or 0 if it won the race) with no file left
 * by a cancelled WRITE, and its buffers are freed the moment it ends. */
static void test_cancel(void **state)
{
	struct kvd_spill *sp = mk(NULL, 0, 16 << 10, 2);
	struct seqb *w = calloc(6, sizeof *w), keep, *r = calloc(1, sizeof *r);
	struct track *t = calloc(6, sizeof *t), tr;
	int cancelled = 0;

	/* a file to read */
	seq_make(&keep, 0x40, 1, 4, 2, 1024, 12);
	job_init(&tr, KVD_SPILL_WRITE, &keep, 0);
	run1(sp, &tr);
	assert_int_equal(tr.j.res, 0);
	unsigned kdir = tr.j.wdir;

	/* six WRITEs (four run, two wait), every one cancelled */
	for (int i = 0; i < 6; i++) {
		seq_make_big(&w[i], 0x30 + (uint64_t)i, 4, 32768);
		job_init(&t[i], KVD_SPILL_WRITE, &w[i], 0);
		t[i].free_at_final = 1;
	}
	for (int i = 0; i < 6; i++)
		assert_int_equal(kvd_spill_submit(sp, &t[i].j), 0);
	for (int i = 5; i >= 0; i--)
		kvd_spill_cancel(sp, &t[i].j);
	drive(sp, 6);
	for (int i = 0; i < 6; i++) {
		assert_int_equal(t[i].bad, 0);
		assert_true(t[i].j.res == -ECANCELED || t[i].j.res == 0);
		cancelled += t[i].j.res == -ECANCELED;
		if (t[i].j.res == 0) {
			job_init(&tr, KVD_SPILL_UNLINK, &keep, t[i].j.wdir);
			tr.j.seq = 0x30 + (uint64_t)i;
			run1(sp, &tr);
		}
	}
	printf("cancel: %d of 6 WRITEs cancelled\n", cancelled);
	assert_true(cancelled >= 2);            /* the queued two at least */
	assert_int_equal(count_files(dir0, ".tmp") + count_files(dir1, ".tmp"), 0);
	assert_int_equal(count_files(dir0, ".kvs") + count_files(dir1, ".kvs"), 1);

	/* A WRITE cancelled while it runs: 40 MiB in 16 KiB operations. */
	struct kvd_spill_stats st0, st1;
	struct seqb big;

	seq_make_big(&big, 0x60, 4, 65536);
	job_init(&tr, KVD_SPILL_WRITE, &big, 0);
	kvd_spill_stats(sp, &st0);
	assert_int_equal(kvd_spill_submit(sp, &tr.j), 0);
	usleep(5000);
	kvd_spill_cancel(sp, &tr.j);
	drive(sp, 1);
	kvd_spill_stats(sp, &st1);
	printf("cancel running WRITE: res %d after %llu of %llu writes\n", tr.j.res,
	       (unsigned long long)(st1.writes - st0.writes),
	       (unsigned long long)(seq_bytes(&big) / (16 << 10)));
	assert_true(tr.j.res == -ECANCELED || tr.j.res == 0);
	assert_int_equal(count_files(dir0, ".tmp") + count_files(dir1, ".tmp"), 0);
	if (tr.j.res == -ECANCELED) {
		assert_int_equal(count_files(dir0, ".kvs") + count_files(dir1, ".kvs"), 1);
		job_init(&tr, KVD_SPILL_WRITE, &big, 0);
		run1(sp, &tr);
		assert_int_equal(tr.j.res, 0);
	}
	kdir = tr.j.wdir;

	/* READ cancelled before it starts, and after its first extent */
	for (int k = 0; k < 2; k++) {
		seq_blank(r, &big);
		job_init(&tr, KVD_SPILL_READ, r, kdir);
		tr.free_at_final = 1;
		assert_int_equal(kvd_spill_submit(sp, &tr.j), 0);
		if (k == 0) {
			kvd_spill_cancel(sp, &tr.j);
		} else {
			while (!tr.progress && !tr.final) {
				struct pollfd p = { .fd = kvd_spill_fd(sp), .events = POLLIN };
				struct kvd_spill_result res;

				assert_int_equal(poll(&p, 1, 60000), 1);
				if (kvd_spill_reap(sp, &res, 1)) {
					assert_true(res.job == &tr.j);
					if (res.final) {
						tr.final = 1;
						seq_free(r);
					} else {
						assert_int_equal(res.ext, tr.progress++);
					}
				}
			}
			kvd_spill_cancel(sp, &tr.j);
		}
		if (!tr.final)
			drive(sp, 1);
		assert_int_equal(tr.bad, 0);
		assert_true(tr.j.res == -ECANCELED || tr.j.res == 0);
		assert_int_equal(tr.j.done, tr.progress);
		printf("cancel READ %d: res %d after %u of %u extents\n", k, tr.j.res, tr.progress,
		       big.n);
	}
	seq_free(&big);
	/* cancelling what has ended, or was never submitted, does nothing */
	kvd_spill_cancel(sp, &tr.j);
	kvd_spill_cancel(sp, &t[0].j);

	/* destroy with jobs queued and running: they end, the files go */
	for (int i = 0; i < 3; i++) {
		seq_make(&w[i], 0x50 + (uint64_t)i, 1, 2, 2, 1024, 40 + (uint64_t)i);
		job_init(&t[i], KVD_SPILL_WRITE, &w[i], 0);
		assert_int_equal(kvd_spill_submit(sp, &t[i].j), 0);
	}
	kvd_spill_destroy(sp);
	for (int i = 0; i < 3; i++)
		seq_free(&w[i]);
	assert_int_equal(count_files(dir0, ".tmp") + count_files(dir1, ".tmp"), 0);
	setup(NULL);
	seq_free(&keep);
	free(w);
	free(r);
	free(t);
}

/* A READ submitted behind a burst of big WRITEs overtakes them. */
static void test_read_priority(void **state)
{
	enum { NW = 4 };
	struct kvd_spill *sp = mk(NULL, 0, 0, 1);
	struct seqb *w = calloc(NW, sizeof *w), a, ra;
	struct track *t = calloc(NW, sizeof *t), tr;
	unsigned last = 0;

	seq_make(&a, 0x70, 1, 2, 2, 1024, 50);
	job_init(&tr, KVD_SPILL_WRITE, &a, 0);
	run1(sp, &tr);
	assert_int_equal(tr.j.res, 0);
	for (int i = 0; i < NW; i++) {
		seq_make_big(&w[i], 0x80 + (uint64_t)i, 6, 65536);
		job_init(&t[i], KVD_SPILL_WRITE, &w[i], 0);
	}
	seq_blank(&ra, &a);
	job_init(&tr, KVD_SPILL_READ, &ra, 0);
	for (int i = 0; i < NW; i++)
		assert_int_equal(kvd_spill_submit(sp, &t[i].j), 0);
	assert_int_equal(kvd_spill_submit(sp, &tr.j), 0);
	drive(sp, NW + 1);
	assert_int_equal(tr.j.res, 0);
	seq_equal(&a, &ra);
	for (int i = 0; i < NW; i++) {
		assert_int_equal(t[i].j.res, 0);
		last = t[i].order > last ? t[i].order : last;
		seq_free(&w[i]);
	}
	unsigned first = tr.order;

	for (int i = 0; i < NW; i++)
		first = t[i].order < first ? t[i].order : first;
	printf("read priority: the READ behind %d WRITEs ended %u-th of %d\n", NW,
	       tr.order - first + 1, NW + 1);
	assert_true(tr.order < last);
	assert_int_equal(kvd_spill_scan(sp, 0, NULL, NULL), 0);
	kvd_spill_destroy(sp);
	seq_free(&a);
	seq_free(&ra);
	free(w);
	free(t);
}

/* 20 WRITEs then 20 READs, all submitted at once, with io_uring. */
static void test_many(void **state)
{
	enum { N = 20 };
	struct kvd_spill *sp = mk(NULL, 0, 32 << 10, 2);
	struct seqb *s = calloc(N, sizeof *s), *rb = calloc(N, sizeof *rb);
	struct track *t = calloc(N, sizeof *t);
	uint64_t disk = 0;

	for (int i = 0; i < N; i++) {
		seq_make(&s[i], 0x1000 + (uint64_t)i, (uint64_t)i, 1 + i % 3, i % 3, 256, 100 + (uint64_t)i);
		job_init(&t[i], KVD_SPILL_WRITE, &s[i], 0);
		assert_int_equal(kvd_spill_submit(sp, &t[i].j), 0);
	}
	drive(sp, N);
	for (int i = 0; i < N; i++) {
		assert_int_equal(t[i].bad, 0);
		assert_int_equal(t[i].j.res, 0);
		disk += t[i].j.disk_bytes;
	}
	assert_true(kvd_spill_disk_bytes(sp) == disk);
	for (int i = 0; i < N; i++) {
		unsigned dir = t[i].j.wdir;

		seq_blank(&rb[i], &s[i]);
		job_init(&t[i], KVD_SPILL_READ, &rb[i], dir);
		assert_int_equal(kvd_spill_submit(sp, &t[i].j), 0);
	}
	drive(sp, N);
	for (int i = 0; i < N; i++) {
		assert_int_equal(t[i].bad, 0);
		assert_int_equal(t[i].j.res, 0);
		assert_int_equal(t[i].progress, s[i].n);
		seq_equal(&s[i], &rb[i]);
		seq_free(&s[i]);
		seq_free(&rb[i]);
	}
	assert_int_equal(kvd_spill_scan(sp, 0, NULL, NULL), 0);
	kvd_spill_destroy(sp);
	free(s);
	free(rb);
	free(t);
}

/* The spill thread sits SP_NICE (5) above the bulk niceness of the thread
 * that made it (kvd_pool_bulk_nice): as root, made from a thread at -5 as
 * under the unit, at 5, not at 0, above the bulk it should sit below. */
static void test_nicer(void **state)
{
	int base, was = test_set_nice(-5, 2, &base);
	struct kvd_spill *sp = mk(NULL, 0, 32 << 10, 1);
	int want = kvd_pool_bulk_nice(base) + 5;

	(void)state;
	if (geteuid() == 0)
		assert_int_equal(want, 5);
	assert_int_equal(thread_nice("kvd-spill", base), want > 19 ? 19 : want);
	kvd_spill_destroy(sp);
	test_restore_nice(was);
}

/* ---- main --------------------------------------------------------------- */

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup(test_uring_roundtrip, setup),
		cmocka_unit_test_setup(test_uring_truncated, setup),
		cmocka_unit_test_setup(test_scan_quarantine, setup),
		cmocka_unit_test_setup(test_buffered, setup),
		cmocka_unit_test_setup(test_memlock_fallback, setup),
		cmocka_unit_test_setup(test_fake_write_faults, setup),
		cmocka_unit_test_setup(test_fake_short, setup),
		cmocka_unit_test_setup(test_fake_torn, setup),
		cmocka_unit_test_setup(test_fake_read_faults, setup),
		cmocka_unit_test_setup(test_read_drain, setup),
		cmocka_unit_test_setup(test_write_fill_hdr, setup),
		cmocka_unit_test_setup(test_fault_specs, setup),
		cmocka_unit_test_setup(test_bad_jobs, setup),
		cmocka_unit_test_setup(test_limit, setup),
		cmocka_unit_test_setup(test_cancel, setup),
		cmocka_unit_test_setup(test_read_priority, setup),
		cmocka_unit_test_setup(test_many, setup),
		cmocka_unit_test_setup(test_nicer, setup),
	};
	int rc;

	snprintf(root, sizeof root, "/tmp/kvd-spill-XXXXXX");
	if (!mkdtemp(root)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(dir0, sizeof dir0, "%s/d0", root);
	snprintf(dir1, sizeof dir1, "%s/d1", root);

	prof = (struct kvd_profile){ .name = "spilltest", .g = { 8, 2, 16, 4, 8, 2 }, .layers = 4,
				     .sink = 4, .window = 64, .seg_tokens = 1024,
				     .seal_tokens = 64, .seed = 7 };
	prof.dense = calloc(prof.layers, 1);
	prof.W = malloc((size_t)prof.g.d * prof.g.K * prof.g.L * sizeof(float));
	kvd_lsh_make_w(prof.seed, (int)prof.g.d, (int)prof.g.K, (int)prof.g.L, prof.W);
	prof_fp = kvd_sfmt_profile_fp(&prof);

	struct kvd_iob *io;
	char msg[128];

	have_uring = kvd_iob_create(NULL, 32, 1, 1, &io, msg, sizeof msg) == 0;
	if (have_uring)
		kvd_iob_destroy(io);
	else
		printf("no io_uring (%s): the engine falls back to synchronous I/O\n", msg);

	rc = cmocka_run_group_tests(tests, NULL, NULL);
	rm_all(dir0);
	rm_all(dir1);
	rmdir(dir0);
	rmdir(dir1);
	rmdir(root);
	free(prof.dense);
	free(prof.W);
	return rc;
}
