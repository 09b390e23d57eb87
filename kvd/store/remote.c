/* kvd_remote: published prefixes in a Redis Cluster (remote.h). */
#include "remote.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/err.h"
#include "sfmt.h"

#define JOBS_MAX 256                    /* queued; more are refused (-EBUSY) */
#define PUTS_MAX 128                    /* of them uploads and deletes: lookups always find room */
#define PUTS_NS_MAX 16                  /* ... of one namespace: no uid fills the queue */
#define STEM_MAX 128                    /* bytes of a stem: prefix 63, ns 23, key 32 */
#define KEY_MAX 160                     /* bytes of a key name: a stem and a suffix */

static const char MAGIC[8] = "KVDRMT1";

_Static_assert(sizeof(struct kvd_remote_manifest) == 56, "manifest layout");

enum { J_PUT, J_GET, J_DEL };

struct job {
	struct job *next;
	int kind;
	char ns[KVD_REMOTE_NS_MAX];
	uint8_t key[16];                /* PUT, DEL */
	uint64_t tokens;
	char *path;
	uint8_t *keys;                  /* GET */
	uint32_t nkeys;
	uint64_t max_bytes;
	int who;
	uint64_t cookie;
};

struct done {
	struct done *next;
	struct kvd_remote_done d;
};

struct kvd_remote {
	struct kvd_remote_cfg cfg;
	char prefix[64], dir[4096];
	struct kvd_rcl *rcl;            /* the thread's alone */
	pthread_t th;
	int efd;
	pthread_mutex_t lock;           /* guards everything below */
	pthread_cond_t cv;
	struct job *head, **tail;       /* uploads and deletes, in order */
	struct job *ghead, **gtail;     /* lookups: they run first, someone waits on each */
	unsigned queued, puts;
	struct { char ns[KVD_REMOTE_NS_MAX]; unsigned n; } wns[PUTS_MAX];      /* puts by ns */
	struct done *dhead, **dtail;
	int stop;
	struct kvd_remote_stats st;
	struct kvd_rcl_stats rs;        /* copied out by the thread after each job */
};

int kvd_remote_stem(const char *prefix, const char *ns, const uint8_t *key, char *buf, size_t n)
{
	char hex[33];

	for (int i = 0; i < 16; i++)
		snprintf(hex + 2 * i, 3, "%02x", key[i]);
	int k = snprintf(buf, n, "%s:{%s:%s}", prefix, ns, hex);

	return k < 0 || (size_t)k >= n ? -ENAMETOOLONG : k;
}

static void count(struct kvd_remote *r, uint64_t *field, uint64_t v)
{
	pthread_mutex_lock(&r->lock);
	*field += v;
	pthread_mutex_unlock(&r->lock);
}

static int read_file(const char *path, void **buf, uint64_t *len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	struct stat st;
	int rc = 0;

	*buf = NULL;
	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) < 0) {
		rc = -errno;
		goto out;
	}
	if (!(*buf = malloc(st.st_size ? (size_t)st.st_size : 1))) {
		rc = -ENOMEM;
		goto out;
	}
	for (uint64_t off = 0; off < (uint64_t)st.st_size;) {
		ssize_t k = pread(fd, (char *)*buf + off, (size_t)st.st_size - off, (off_t)off);

		if (k <= 0) {
			rc = k < 0 ? -errno : -EIO;
			goto out;
		}
		off += (uint64_t)k;
	}
	*len = (uint64_t)st.st_size;
out:
	if (rc) {
		free(*buf);
		*buf = NULL;
	}
	close(fd);
	return rc;
}

static void post(struct kvd_remote *r, const struct kvd_remote_done *d);

/* Chunks first, the manifest last, in one pipeline on the shard of the tag;
 * with a cookie, the result is reported (which file generation went). */
static void do_put(struct kvd_remote *r, struct job *j)
{
	struct kvd_remote_done d = { .op = KVD_REMOTE_PUT, .who = j->who, .cookie = j->cookie };
	struct kvd_sfmt_hdr h;
	char stem[STEM_MAX], *msg = d.msg;
	const size_t msglen = sizeof d.msg;
	uint64_t len = 0;
	void *buf;
	int rc = read_file(j->path, &buf, &len);

	if (rc) {
		/* A sequence dropped or rewritten since: its file went with it. */
		count(r, &r->st.put_errors, 1);
		snprintf(msg, msglen, "%.100s: %s", j->path, strerror(-rc));
		goto report;
	}
	if (kvd_sfmt_check_hdr(buf, len, &h, msg, msglen) == 0) {
		d.seq = h.seq;
		d.gen = h.gen;
	}
	d.bytes = len;
	uint32_t cb = r->cfg.chunk_bytes, nch = (uint32_t)((len + cb - 1) / cb);
	struct kvd_remote_manifest m = { .chunks = nch, .chunk_bytes = cb, .bytes = len,
					 .tokens = j->tokens,
					 .crc = kvd_sfmt_crc32c(buf, len) };
	struct kvd_rcl_op *ops = calloc(nch + 1, sizeof *ops);
	char (*names)[KEY_MAX] = calloc(nch + 1, KEY_MAX);

	memcpy(m.magic, MAGIC, sizeof m.magic);
	memcpy(m.key, j->key, 16);
	if (!ops || !names || kvd_remote_stem(r->prefix, j->ns, j->key, stem, sizeof stem) < 0) {
		count(r, &r->st.put_errors, 1);
		rc = -ENOMEM;
		goto out;
	}
	for (uint32_t i = 0; i <= nch; i++) {
		uint64_t off = (uint64_t)i * cb;

		ops[i].kind = KVD_RCL_SET;
		if (i < nch) {
			snprintf(names[i], KEY_MAX, "%s:%" PRIu32, stem, i);
			ops[i].val = (char *)buf + off;
			ops[i].vlen = len - off < cb ? len - off : cb;
		} else {
			snprintf(names[i], KEY_MAX, "%s:m", stem);
			ops[i].val = &m;
			ops[i].vlen = sizeof m;
		}
		ops[i].key = names[i];
		ops[i].klen = strlen(names[i]);
	}
	rc = kvd_rcl_run(r->rcl, ops, nch + 1, msg, msglen);
	for (uint32_t i = 0; !rc && i <= nch; i++)
		rc = ops[i].rc;
	if (rc) {
		count(r, &r->st.put_errors, 1);
		goto out;
	}
	pthread_mutex_lock(&r->lock);
	r->st.puts++;
	r->st.put_bytes += len;
	pthread_mutex_unlock(&r->lock);
	if (r->cfg.replicas) {
		int acks = kvd_rcl_wait(r->rcl, names[nch], strlen(names[nch]), r->cfg.replicas,
					r->cfg.wait_ms, msg, msglen);

		d.durable = acks >= (int)r->cfg.replicas;
		count(r, d.durable ? &r->st.durable : &r->st.not_durable, 1);
	}
out:
	free(names);
	free(ops);
	free(buf);
report:
	d.rc = rc;
	if (j->cookie)
		post(r, &d);
}

/* The manifest first, then every chunk it names, in pipelines of at most
 * DEL_BATCH keys: a reader that finds no manifest finds nothing. */
#define DEL_BATCH 256
static void do_del(struct kvd_remote *r, struct job *j)
{
	char stem[STEM_MAX], msg[160], mname[KEY_MAX];
	char (*names)[KEY_MAX] = calloc(DEL_BATCH, KEY_MAX);
	struct kvd_rcl_op mo = { .kind = KVD_RCL_GET }, *ops = calloc(DEL_BATCH, sizeof *ops);
	struct kvd_remote_manifest m;
	uint64_t n = 0;
	int rc;

	if (!names || !ops || kvd_remote_stem(r->prefix, j->ns, j->key, stem, sizeof stem) < 0)
		goto out;
	snprintf(mname, sizeof mname, "%s:m", stem);
	mo.key = mname;
	mo.klen = strlen(mname);
	if (kvd_rcl_run(r->rcl, &mo, 1, msg, sizeof msg) || mo.rc)
		goto out;       /* nothing there, or the cluster is away */
	if (mo.len == sizeof m) {
		memcpy(&m, mo.data, sizeof m);
		if (!memcmp(m.magic, MAGIC, sizeof MAGIC) && m.chunk_bytes &&
		    m.chunks == (m.bytes + m.chunk_bytes - 1) / m.chunk_bytes)
			n = m.chunks;
	}
	ops[0] = (struct kvd_rcl_op){ .kind = KVD_RCL_DEL, .key = mname, .klen = strlen(mname) };
	rc = kvd_rcl_run(r->rcl, ops, 1, msg, sizeof msg);
	for (uint64_t c = 0; !rc && c < n; c += DEL_BATCH) {
		uint32_t k = n - c < DEL_BATCH ? (uint32_t)(n - c) : DEL_BATCH;

		for (uint32_t i = 0; i < k; i++) {
			snprintf(names[i], KEY_MAX, "%s:%" PRIu64, stem, c + i);
			ops[i] = (struct kvd_rcl_op){ .kind = KVD_RCL_DEL, .key = names[i],
						      .klen = strlen(names[i]) };
		}
		rc = kvd_rcl_run(r->rcl, ops, k, msg, sizeof msg);
	}
	if (!rc)
		count(r, &r->st.dels, 1);
out:
	free(mo.data);
	free(names);
	free(ops);
}

static void post(struct kvd_remote *r, const struct kvd_remote_done *d)
{
	struct done *x = malloc(sizeof *x);
	uint64_t one = 1;

	if (!x)
		return;         /* the attach that waits for it gives up in time */
	x->d = *d;
	x->next = NULL;
	pthread_mutex_lock(&r->lock);
	*r->dtail = x;
	r->dtail = &x->next;
	if (write(r->efd, &one, sizeof one) < 0) {
		/* eventfd: only EAGAIN at 2^64-2, never here */
	}
	pthread_mutex_unlock(&r->lock);
}

/* The longest key present: EXISTS of every manifest, one pipeline. */
static int find_longest(struct kvd_remote *r, struct job *j, struct kvd_remote_done *d)
{
	struct kvd_rcl_op *ops = calloc(j->nkeys, sizeof *ops);
	char (*names)[KEY_MAX] = calloc(j->nkeys, KEY_MAX);
	int rc = -ENOMEM, found = -1;

	if (!ops || !names)
		goto out;
	for (uint32_t i = 0; i < j->nkeys; i++) {
		char stem[STEM_MAX];

		if ((rc = kvd_remote_stem(r->prefix, j->ns, j->keys + 16 * (size_t)i, stem,
					  sizeof stem)) < 0)
			goto out;
		snprintf(names[i], KEY_MAX, "%s:m", stem);
		ops[i] = (struct kvd_rcl_op){ .kind = KVD_RCL_EXISTS, .key = names[i],
					      .klen = strlen(names[i]) };
	}
	if ((rc = kvd_rcl_run(r->rcl, ops, j->nkeys, d->msg, sizeof d->msg)))
		goto out;
	for (uint32_t i = 0; i < j->nkeys; i++)
		if (ops[i].rc == 0)
			found = (int)i;
		else if (ops[i].rc != -ENOENT && found < 0)
			rc = ops[i].rc;
	rc = found >= 0 ? found : rc ? rc : -ENOENT;
out:
	free(names);
	free(ops);
	return rc;
}

static int corrupt(struct kvd_remote_done *d, const char *why, const char *stem)
{
	snprintf(d->msg, sizeof d->msg, "%.100s: %.50s", stem, why);
	return -KVD_EFORMAT;
}

/* Fetches prefix i of j into *buf: the manifest, then every chunk. */
static int fetch(struct kvd_remote *r, struct job *j, uint32_t i, void **buf, uint64_t *len,
		 struct kvd_remote_done *d)
{
	char stem[STEM_MAX], (*names)[KEY_MAX] = NULL;
	struct kvd_rcl_op mo = { .kind = KVD_RCL_GET }, *ops = NULL;
	struct kvd_remote_manifest m;
	int rc;

	*buf = NULL;
	if ((rc = kvd_remote_stem(r->prefix, j->ns, j->keys + 16 * (size_t)i, stem, sizeof stem)) < 0)
		return rc;
	char mname[KEY_MAX];

	snprintf(mname, sizeof mname, "%s:m", stem);
	mo.key = mname;
	mo.klen = strlen(mname);
	if ((rc = kvd_rcl_run(r->rcl, &mo, 1, d->msg, sizeof d->msg)))
		return rc;
	if (mo.rc) {
		free(mo.data);
		return mo.rc;   /* gone since EXISTS: a miss */
	}
	if (mo.len != sizeof m) {
		free(mo.data);
		return corrupt(d, "manifest of the wrong size", stem);
	}
	memcpy(&m, mo.data, sizeof m);
	free(mo.data);
	if (memcmp(m.magic, MAGIC, sizeof MAGIC) || memcmp(m.key, j->keys + 16 * (size_t)i, 16) ||
	    !m.chunk_bytes || !m.bytes || m.bytes > r->cfg.max_bytes ||
	    m.chunks != (m.bytes + m.chunk_bytes - 1) / m.chunk_bytes)
		return corrupt(d, "manifest does not verify", stem);
	if (j->max_bytes && m.bytes > j->max_bytes) {
		snprintf(d->msg, sizeof d->msg, "%.60s: %" PRIu64 " bytes, more than the "
			 "requester may hold (%" PRIu64 ")", stem, m.bytes, j->max_bytes);
		return -EFBIG;
	}
	ops = calloc(m.chunks, sizeof *ops);
	names = calloc(m.chunks, KEY_MAX);
	if (!ops || !names || !(*buf = malloc(m.bytes))) {
		rc = -ENOMEM;
		goto out;
	}
	/* Each chunk straight into its place in the file: no copy. */
	for (uint32_t c = 0; c < m.chunks; c++) {
		uint64_t off = (uint64_t)c * m.chunk_bytes;

		snprintf(names[c], KEY_MAX, "%s:%" PRIu32, stem, c);
		ops[c] = (struct kvd_rcl_op){ .kind = KVD_RCL_GET, .key = names[c],
					      .klen = strlen(names[c]), .dst = (char *)*buf + off,
					      .cap = m.bytes - off < m.chunk_bytes ? m.bytes - off
										   : m.chunk_bytes };
	}
	if ((rc = kvd_rcl_run(r->rcl, ops, m.chunks, d->msg, sizeof d->msg)))
		goto out;
	for (uint32_t c = 0; c < m.chunks; c++) {
		uint64_t off = (uint64_t)c * m.chunk_bytes;
		uint64_t want = m.bytes - off < m.chunk_bytes ? m.bytes - off : m.chunk_bytes;

		if (ops[c].rc == -ENOENT) {
			rc = corrupt(d, "a chunk is missing (partial)", stem);
			goto out;
		}
		if (ops[c].rc) {
			rc = ops[c].rc;
			goto out;
		}
		if (ops[c].data || ops[c].len != want) {
			rc = corrupt(d, "a chunk has the wrong size", stem);
			goto out;
		}
	}
	if (kvd_sfmt_crc32c(*buf, m.bytes) != m.crc) {
		rc = corrupt(d, "CRC32C of the file does not match its manifest", stem);
		goto out;
	}
	*len = m.bytes;
out:
	for (uint32_t c = 0; ops && c < m.chunks; c++)
		free(ops[c].data);
	free(ops);
	free(names);
	if (rc) {
		free(*buf);
		*buf = NULL;
	}
	return rc;
}

/* The file goes in under its own sequence's name, as the spill engine names
 * files, through a temporary name: never a partial .kvs. */
static int store_file(struct kvd_remote *r, const void *buf, uint64_t len,
		      struct kvd_remote_done *d)
{
	struct kvd_sfmt_hdr h;
	char path[4200], tmp[4210];
	int fd, rc = 0;

	if (kvd_sfmt_check_hdr(buf, len, &h, d->msg, sizeof d->msg))
		return -KVD_EFORMAT;
	d->seq = h.seq;
	snprintf(path, sizeof path, "%s/%016" PRIx64 ".kvs", r->dir, h.seq);
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	if (access(path, F_OK) == 0)
		return -EEXIST;
	if ((fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0)
		return -errno;
	for (uint64_t off = 0; off < len;) {
		ssize_t k = pwrite(fd, (const char *)buf + off, len - off, (off_t)off);

		if (k <= 0) {
			rc = k < 0 ? -errno : -EIO;
			break;
		}
		off += (uint64_t)k;
	}
	close(fd);
	if (!rc && rename(tmp, path) < 0)
		rc = -errno;
	if (rc) {
		unlink(tmp);
		snprintf(d->msg, sizeof d->msg, "%.100s: %.50s", path, strerror(-rc));
	}
	return rc;
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void do_get(struct kvd_remote *r, struct job *j)
{
	struct kvd_remote_done d = { .op = KVD_REMOTE_GET, .who = j->who, .cookie = j->cookie };
	double t0 = now_ms(), t1;
	uint64_t len = 0;
	void *buf = NULL;
	int rc = find_longest(r, j, &d);

	d.dir = r->cfg.dir_index;
	if (rc >= 0) {
		d.index = (uint32_t)rc;
		memcpy(d.key, j->keys + 16 * (size_t)d.index, 16);
		rc = fetch(r, j, d.index, &buf, &len, &d);
		t1 = now_ms();
		d.fetch_ms = t1 - t0;
		if (!rc)
			rc = store_file(r, buf, len, &d);
		d.file_ms = now_ms() - t1;
		free(buf);
	}
	d.rc = rc;
	d.bytes = len;
	pthread_mutex_lock(&r->lock);
	r->st.gets++;
	if (rc == 0 || rc == -EEXIST) {
		r->st.hits++;
		r->st.get_bytes += len;
	} else if (rc == -ENOENT) {
		r->st.misses++;
	} else if (rc == -KVD_EFORMAT) {
		r->st.corrupt++;
	} else if (rc == -EFBIG) {
		r->st.too_big++;
	} else {
		r->st.get_errors++;
	}
	pthread_mutex_unlock(&r->lock);
	post(r, &d);
}

/* Queued writes of namespace ns, counted up or down; the new count, or
 * UINT_MAX when the table is full (it cannot be: an entry per write). */
static unsigned wns_add(struct kvd_remote *r, const char *ns, int d)
{
	int free_i = -1;

	for (int i = 0; i < PUTS_MAX; i++) {
		if (r->wns[i].n && !strcmp(r->wns[i].ns, ns))
			return r->wns[i].n += (unsigned)d;
		if (!r->wns[i].n && free_i < 0)
			free_i = i;
	}
	if (d <= 0 || free_i < 0)
		return d <= 0 ? 0 : UINT_MAX;
	snprintf(r->wns[free_i].ns, sizeof r->wns[free_i].ns, "%s", ns);
	return r->wns[free_i].n = (unsigned)d;
}

static unsigned wns_get(const struct kvd_remote *r, const char *ns)
{
	for (int i = 0; i < PUTS_MAX; i++)
		if (r->wns[i].n && !strcmp(r->wns[i].ns, ns))
			return r->wns[i].n;
	return 0;
}

static void *run(void *arg)
{
	struct kvd_remote *r = arg;

	pthread_mutex_lock(&r->lock);
	for (;;) {
		while (!r->head && !r->ghead && !r->stop)
			pthread_cond_wait(&r->cv, &r->lock);
		if (r->stop)
			break;
		struct job *j;

		if ((j = r->ghead)) {
			if (!(r->ghead = j->next))
				r->gtail = &r->ghead;
		} else {
			j = r->head;
			if (!(r->head = j->next))
				r->tail = &r->head;
		}
		pthread_mutex_unlock(&r->lock);
		int put = j->kind != J_GET;
		char ns[KVD_REMOTE_NS_MAX];

		memcpy(ns, j->ns, sizeof ns);
		if (j->kind == J_PUT)
			do_put(r, j);
		else if (j->kind == J_DEL)
			do_del(r, j);
		else
			do_get(r, j);
		free(j->path);
		free(j->keys);
		free(j);
		pthread_mutex_lock(&r->lock);
		r->queued--;
		r->puts -= put;
		if (put)
			wns_add(r, ns, -1);
		kvd_rcl_stats(r->rcl, &r->rs);
	}
	pthread_mutex_unlock(&r->lock);
	return NULL;
}

int kvd_remote_create(const struct kvd_remote_cfg *cfg, struct kvd_remote **out, char *msg,
		      size_t msglen)
{
	struct kvd_remote *r = calloc(1, sizeof *r);
	const char *pfx = cfg->prefix ? cfg->prefix : "kvd";
	int rc;

	if (!r)
		return -ENOMEM;
	if (!pfx[0] || strpbrk(pfx, "{}") || strlen(pfx) >= sizeof r->prefix || !cfg->dir ||
	    strlen(cfg->dir) >= sizeof r->dir) {
		snprintf(msg, msglen, "remote: prefix must be 1..63 bytes without braces, and a "
			 "spill directory is needed");
		free(r);
		return -EINVAL;
	}
	r->cfg = *cfg;
	snprintf(r->prefix, sizeof r->prefix, "%s", pfx);
	snprintf(r->dir, sizeof r->dir, "%s", cfg->dir);
	r->cfg.prefix = r->prefix;
	r->cfg.dir = r->dir;
	if (!r->cfg.chunk_bytes)
		r->cfg.chunk_bytes = 4u << 20;
	if (!r->cfg.wait_ms)
		r->cfg.wait_ms = 1000;
	if (!r->cfg.max_bytes)
		r->cfg.max_bytes = 64ull << 30;
	r->tail = &r->head;
	r->gtail = &r->ghead;
	r->dtail = &r->dhead;
	if ((rc = kvd_rcl_create(&cfg->rcl, &r->rcl, msg, msglen))) {
		free(r);
		return rc;
	}
	if ((r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
		rc = -errno;
		kvd_rcl_destroy(r->rcl);
		free(r);
		return rc;
	}
	pthread_mutex_init(&r->lock, NULL);
	pthread_cond_init(&r->cv, NULL);
	if ((rc = -pthread_create(&r->th, NULL, run, r))) {
		close(r->efd);
		kvd_rcl_destroy(r->rcl);
		free(r);
		return rc;
	}
	*out = r;
	return 0;
}

void kvd_remote_destroy(struct kvd_remote *r)
{
	if (!r)
		return;
	pthread_mutex_lock(&r->lock);
	r->stop = 1;
	pthread_cond_signal(&r->cv);
	pthread_mutex_unlock(&r->lock);
	pthread_join(r->th, NULL);
	for (struct job *j = r->head, *n; j; j = n) {
		n = j->next;
		free(j->path);
		free(j->keys);
		free(j);
	}
	for (struct job *j = r->ghead, *n; j; j = n) {
		n = j->next;
		free(j->keys);
		free(j);
	}
	for (struct done *x = r->dhead, *n; x; x = n) {
		n = x->next;
		free(x);
	}
	kvd_rcl_destroy(r->rcl);
	close(r->efd);
	pthread_cond_destroy(&r->cv);
	pthread_mutex_destroy(&r->lock);
	free(r);
}

int kvd_remote_fd(const struct kvd_remote *r)
{
	return r->efd;
}

int kvd_remote_flush(struct kvd_remote *r, unsigned ms)
{
	for (unsigned waited = 0;; waited += 10) {
		pthread_mutex_lock(&r->lock);
		unsigned left = r->queued;

		pthread_mutex_unlock(&r->lock);
		if (!left)
			return 0;
		if (waited >= ms)
			return -ETIMEDOUT;
		nanosleep(&(struct timespec){ .tv_nsec = 10 * 1000000 }, NULL);
	}
}

static int queue(struct kvd_remote *r, struct job *j)
{
	pthread_mutex_lock(&r->lock);
	int put = j->kind != J_GET;

	if (r->queued >= JOBS_MAX ||
	    (put && (r->puts >= PUTS_MAX || wns_get(r, j->ns) >= PUTS_NS_MAX))) {
		pthread_mutex_unlock(&r->lock);
		return -EBUSY;
	}
	r->queued++;
	r->puts += put;
	j->next = NULL;
	if (put) {
		wns_add(r, j->ns, 1);
		*r->tail = j;
		r->tail = &j->next;
	} else {
		*r->gtail = j;
		r->gtail = &j->next;
	}
	pthread_cond_signal(&r->cv);
	pthread_mutex_unlock(&r->lock);
	return 0;
}

int kvd_remote_del(struct kvd_remote *r, const char *ns, const uint8_t *key)
{
	struct job *j = calloc(1, sizeof *j);
	int rc;

	if (!j)
		return -ENOMEM;
	j->kind = J_DEL;
	snprintf(j->ns, sizeof j->ns, "%s", ns);
	memcpy(j->key, key, 16);
	if ((rc = queue(r, j)))
		free(j);
	return rc;
}

int kvd_remote_put(struct kvd_remote *r, const char *ns, const uint8_t *key, uint64_t tokens,
		   const char *path, int who, uint64_t cookie)
{
	struct job *j = calloc(1, sizeof *j);
	int rc;

	if (!j || !(j->path = strdup(path))) {
		free(j);
		return -ENOMEM;
	}
	j->kind = J_PUT;
	snprintf(j->ns, sizeof j->ns, "%s", ns);
	memcpy(j->key, key, 16);
	j->tokens = tokens;
	j->who = who;
	j->cookie = cookie;
	if ((rc = queue(r, j))) {
		free(j->path);
		free(j);
		count(r, &r->st.put_errors, 1);
	}
	return rc;
}

int kvd_remote_get(struct kvd_remote *r, const char *ns, const uint8_t *keys, uint32_t nkeys,
		   uint64_t max_bytes, int who, uint64_t cookie)
{
	struct job *j = calloc(1, sizeof *j);
	int rc;

	if (!j || !nkeys || !(j->keys = malloc(16 * (size_t)nkeys))) {
		free(j);
		return nkeys ? -ENOMEM : -EINVAL;
	}
	j->kind = J_GET;
	snprintf(j->ns, sizeof j->ns, "%s", ns);
	memcpy(j->keys, keys, 16 * (size_t)nkeys);
	j->nkeys = nkeys;
	j->max_bytes = max_bytes;
	j->who = who;
	j->cookie = cookie;
	if ((rc = queue(r, j))) {
		free(j->keys);
		free(j);
	}
	return rc;
}

unsigned kvd_remote_poll(struct kvd_remote *r,
			 void (*fn)(void *arg, const struct kvd_remote_done *d), void *arg)
{
	struct done *list;
	uint64_t v;
	unsigned n = 0;

	if (read(r->efd, &v, sizeof v) < 0) {
		/* EAGAIN: nothing new; what is queued is reaped below anyway */
	}
	pthread_mutex_lock(&r->lock);
	list = r->dhead;
	r->dhead = NULL;
	r->dtail = &r->dhead;
	pthread_mutex_unlock(&r->lock);
	for (struct done *x = list, *nx; x; x = nx) {
		nx = x->next;
		fn(arg, &x->d);
		free(x);
		n++;
	}
	return n;
}

void kvd_remote_stats(struct kvd_remote *r, struct kvd_remote_stats *st)
{
	pthread_mutex_lock(&r->lock);
	*st = r->st;
	st->queued = r->queued;
	st->rcl = r->rs;
	pthread_mutex_unlock(&r->lock);
}
