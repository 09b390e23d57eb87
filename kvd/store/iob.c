#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "iob.h"

enum {
	F_ENOSPC, F_EIO_WRITE, F_TORN,          /* count writes */
	F_EIO_READ, F_CORRUPT,                  /* count reads */
	F_SHORT,                                /* counts reads and writes */
	F_FSYNC,                                /* counts fsyncs */
	F_NKIND
};

static const char *const fault_name[F_NKIND] = {
	[F_ENOSPC] = "enospc", [F_EIO_WRITE] = "eio-write", [F_TORN] = "torn",
	[F_EIO_READ] = "eio-read", [F_CORRUPT] = "corrupt", [F_SHORT] = "short",
	[F_FSYNC] = "fsync",
};

#define FAULT_AT_MAX 32

struct fault {
	int all;                        /* kind@* */
	unsigned nat;
	uint64_t at[FAULT_AT_MAX];      /* kind@N */
};

struct iob_file {
	int fd;
	int used, fixed, direct;
};

struct iob_buf {
	char *p;                        /* NULL: slot free */
	size_t len;
};

struct kvd_iob {
	int fake;
	unsigned qd, outstanding;       /* queued or in flight, not reaped */
	unsigned nfiles, nbufs;
	struct iob_file *files;
	struct iob_buf *bufs;
	int files_tab, bufs_tab;        /* the kernel's sparse tables exist */
	int efd;
	struct kvd_iob_stats st;

	struct io_uring ring;

	/* fake: completions wait here until reaped; cq_mask + 1 >= qd */
	struct kvd_iob_cqe *cq;
	unsigned cq_head, cq_tail, cq_mask;
	struct fault fault[F_NKIND];
	uint64_t nread, nwrite, nrw, nsync;     /* operations of each count so far */
};

/* ---- fault specs -------------------------------------------------------- */

static int fault_parse(const char *spec, struct fault *f, char *msg, size_t msglen)
{
	const char *s = spec;

	memset(f, 0, F_NKIND * sizeof *f);
	if (!*s)
		return 0;
	for (;;) {
		const char *at = strchr(s, '@'), *end = strchr(s, ',');
		size_t klen;
		int k;

		if (!end)
			end = s + strlen(s);
		if (!at || at > end) {
			snprintf(msg, msglen, "fault '%.*s': want kind@N or kind@*", (int)(end - s), s);
			return -EINVAL;
		}
		klen = (size_t)(at - s);
		for (k = 0; k < F_NKIND; k++)
			if (strlen(fault_name[k]) == klen && !memcmp(s, fault_name[k], klen))
				break;
		if (k == F_NKIND) {
			snprintf(msg, msglen, "fault '%.*s': unknown kind (enospc, eio-write, "
				 "eio-read, corrupt, short, torn, fsync)", (int)klen, s);
			return -EINVAL;
		}
		if (end - at == 2 && at[1] == '*') {
			f[k].all = 1;
		} else {
			uint64_t n = 0;
			const char *d = at + 1;

			if (d == end) {
				snprintf(msg, msglen, "fault '%.*s': missing N", (int)(end - s), s);
				return -EINVAL;
			}
			for (; d < end; d++) {
				if (*d < '0' || *d > '9' || n > (UINT64_MAX - 9) / 10) {
					snprintf(msg, msglen, "fault '%.*s': N is not a number",
						 (int)(end - s), s);
					return -EINVAL;
				}
				n = n * 10 + (uint64_t)(*d - '0');
			}
			if (f[k].nat == FAULT_AT_MAX) {
				snprintf(msg, msglen, "fault %s: more than %d positions",
					 fault_name[k], FAULT_AT_MAX);
				return -EINVAL;
			}
			f[k].at[f[k].nat++] = n;
		}
		if (!*end)
			return 0;
		s = end + 1;
		if (!*s) {
			snprintf(msg, msglen, "fault spec '%s' ends in a comma", spec);
			return -EINVAL;
		}
	}
}

int kvd_iob_fault_parse(const char *spec, char *msg, size_t msglen)
{
	struct fault f[F_NKIND];

	return fault_parse(spec, f, msg, msglen);
}

static int hit(struct kvd_iob *io, int k, uint64_t n)
{
	const struct fault *f = &io->fault[k];

	for (unsigned i = 0; i < f->nat; i++)
		if (f->at[i] == n)
			goto yes;
	if (!f->all)
		return 0;
yes:
	io->st.faults++;
	return 1;
}

/* ---- create / destroy --------------------------------------------------- */

__attribute__((cold))
int kvd_iob_create(const char *fault, unsigned qd, unsigned nfiles, unsigned nbufs,
		   struct kvd_iob **out, char *msg, size_t msglen)
{
	struct kvd_iob *io = calloc(1, sizeof *io);
	int rc;

	if (!io)
		return -ENOMEM;
	io->qd = qd;
	io->nfiles = nfiles;
	io->nbufs = nbufs;
	io->efd = -1;
	io->files = calloc(nfiles ? nfiles : 1, sizeof *io->files);
	io->bufs = calloc(nbufs ? nbufs : 1, sizeof *io->bufs);
	if (!io->files || !io->bufs) {
		rc = -ENOMEM;
		goto fail;
	}
	if (fault) {
		io->fake = 1;
		rc = fault_parse(fault, io->fault, msg, msglen);
		if (rc)
			goto fail;
		for (io->cq_mask = 1; io->cq_mask < qd; io->cq_mask <<= 1)
			;
		io->cq = calloc(io->cq_mask, sizeof *io->cq);
		io->cq_mask--;
		if (!io->cq) {
			rc = -ENOMEM;
			goto fail;
		}
		io->files_tab = io->bufs_tab = 1;
		*out = io;
		return 0;
	}

	struct io_uring_params p = { .flags = IORING_SETUP_SUBMIT_ALL };

	/* The CQ gets twice the SQ's entries by default: with at most qd
	 * operations outstanding it cannot overflow. */
	rc = io_uring_queue_init_params(qd, &io->ring, &p);
	if (rc == -EINVAL) {
		memset(&p, 0, sizeof p);
		rc = io_uring_queue_init_params(qd, &io->ring, &p);
	}
	if (rc) {
		snprintf(msg, msglen, "io_uring_queue_init: %s", strerror(-rc));
		goto fail;
	}
	/* Without the tables everything still works, unregistered. */
	io->files_tab = nfiles && io_uring_register_files_sparse(&io->ring, nfiles) == 0;
	io->bufs_tab = nbufs && io_uring_register_buffers_sparse(&io->ring, nbufs) == 0;
	*out = io;
	return 0;
fail:
	free(io->files);
	free(io->bufs);
	free(io->cq);
	free(io);
	return rc;
}

__attribute__((cold))
void kvd_iob_destroy(struct kvd_iob *io)
{
	if (!io)
		return;
	if (!io->fake)
		io_uring_queue_exit(&io->ring);         /* drops the tables too */
	free(io->files);
	free(io->bufs);
	free(io->cq);
	free(io);
}

const char *kvd_iob_name(const struct kvd_iob *io)
{
	return io->fake ? "fake" : "io_uring";
}

int kvd_iob_notify(struct kvd_iob *io, int efd)
{
	int rc = 0;

	if (!io->fake) {
		if (io->efd >= 0)
			io_uring_unregister_eventfd(&io->ring);
		if (efd >= 0)
			rc = io_uring_register_eventfd(&io->ring, efd);
	}
	io->efd = rc ? -1 : efd;
	return rc;
}

void kvd_iob_stats(const struct kvd_iob *io, struct kvd_iob_stats *out)
{
	*out = io->st;
}

/* ---- files and buffers -------------------------------------------------- */

int kvd_iob_file_add(struct kvd_iob *io, int fd)
{
	unsigned i;

	for (i = 0; i < io->nfiles && io->files[i].used; i++)
		;
	if (i == io->nfiles)
		return -EMFILE;
	struct iob_file *f = &io->files[i];
	int fl = fcntl(fd, F_GETFL);

	f->fd = fd;
	f->used = 1;
	f->direct = fl >= 0 && (fl & O_DIRECT);
	f->fixed = io->files_tab &&
		   (io->fake || io_uring_register_files_update(&io->ring, i, &fd, 1) == 1);
	if (f->fixed)
		io->st.files_fixed++;
	else
		io->st.files_plain++;
	return (int)i;
}

void kvd_iob_file_del(struct kvd_iob *io, int f)
{
	struct iob_file *fl = &io->files[f];
	int none = -1;

	if (fl->fixed && !io->fake)
		io_uring_register_files_update(&io->ring, (unsigned)f, &none, 1);
	memset(fl, 0, sizeof *fl);
}

int kvd_iob_buf_add(struct kvd_iob *io, void *p, size_t len)
{
	struct iovec iov = { p, len };
	unsigned i;
	int rc;

	for (i = 0; i < io->nbufs && io->bufs[i].p; i++)
		;
	if (!io->bufs_tab || i == io->nbufs) {
		io->st.bufs_plain++;
		io->st.buf_err = io->bufs_tab ? -ENOBUFS : -EOPNOTSUPP;
		return -1;
	}
	/* Pins the pages (charged to RLIMIT_MEMLOCK without CAP_IPC_LOCK). */
	rc = io->fake ? 1 : io_uring_register_buffers_update_tag(&io->ring, i, &iov, NULL, 1);
	if (rc != 1) {
		io->st.bufs_plain++;
		io->st.buf_err = rc < 0 ? rc : -EIO;
		return -1;
	}
	io->bufs[i].p = p;
	io->bufs[i].len = len;
	io->st.bufs_fixed++;
	return (int)i;
}

void kvd_iob_buf_del(struct kvd_iob *io, int b)
{
	struct iovec iov = { NULL, 0 };

	if (b < 0)
		return;
	if (!io->fake)
		io_uring_register_buffers_update_tag(&io->ring, (unsigned)b, &iov, NULL, 1);
	io->bufs[b].p = NULL;
	io->bufs[b].len = 0;
}

/* ---- the fake backend --------------------------------------------------- */

static void fake_complete(struct kvd_iob *io, uint64_t user, int res)
{
	struct kvd_iob_cqe *c = &io->cq[io->cq_tail++ & io->cq_mask];
	uint64_t one = 1;

	c->user = user;
	c->res = res;
	if (io->efd >= 0 && write(io->efd, &one, sizeof one) < 0) {
		/* the counter cannot overflow at one per operation */
	}
}

/* Half of len, kept 4 KiB aligned on an O_DIRECT file (all of it when that
 * leaves nothing). */
static uint32_t half(const struct iob_file *f, uint32_t len)
{
	uint32_t h = f->direct ? (len / 2) & ~4095u : len / 2;

	return h ? h : len;
}

/* A fixed buffer must cover the range, as the kernel would insist. */
static int fake_buf_ok(const struct kvd_iob *io, int b, const void *p, uint32_t len)
{
	const char *c = p;

	return b < 0 || ((unsigned)b < io->nbufs && io->bufs[b].p && c >= io->bufs[b].p &&
			 c + len <= io->bufs[b].p + io->bufs[b].len);
}

static int fake_read(struct kvd_iob *io, const struct iob_file *f, int b, void *p, uint32_t len,
		     uint64_t off)
{
	uint64_t n = io->nread++, nrw = io->nrw++;
	ssize_t r;

	if (!fake_buf_ok(io, b, p, len))
		return -EFAULT;
	if (hit(io, F_EIO_READ, n))
		return -EIO;
	if (hit(io, F_SHORT, nrw))
		len = half(f, len);
	r = pread(f->fd, p, len, (off_t)off);
	if (r < 0)
		return -errno;
	if (r > 0 && hit(io, F_CORRUPT, n))
		((unsigned char *)p)[0] ^= 0x5a;
	return (int)r;
}

static int fake_write(struct kvd_iob *io, const struct iob_file *f, int b, const void *p,
		      uint32_t len, uint64_t off)
{
	uint64_t n = io->nwrite++, nrw = io->nrw++;
	uint32_t put = len;
	ssize_t r;

	if (!fake_buf_ok(io, b, p, len))
		return -EFAULT;
	if (hit(io, F_ENOSPC, n))
		return -ENOSPC;
	if (hit(io, F_EIO_WRITE, n))
		return -EIO;
	int torn = hit(io, F_TORN, n);

	if (torn || hit(io, F_SHORT, nrw))
		put = half(f, len);
	r = pwrite(f->fd, p, put, (off_t)off);
	if (r < 0)
		return -errno;
	return torn ? (int)len : (int)r;
}

static int fake_fsync(struct kvd_iob *io, const struct iob_file *f, int datasync)
{
	if (hit(io, F_FSYNC, io->nsync++))
		return -EIO;
	if ((datasync ? fdatasync(f->fd) : fsync(f->fd)) < 0)
		return -errno;
	return 0;
}

/* ---- operations --------------------------------------------------------- */

enum { OP_READ, OP_WRITE, OP_FSYNC, OP_FALLOC, OP_OPEN, OP_RENAME, OP_UNLINK };

struct iob_req {
	int op, f, b;                   /* f: file handle, or the dfd of metadata ops */
	void *p;
	uint32_t len;                   /* OP_FSYNC: datasync; OP_OPEN: mode */
	uint64_t off;                   /* OP_FALLOC: length; OP_OPEN: flags */
	const char *path, *path2;
};

static int fake_meta(const struct iob_req *q)
{
	int rc;

	switch (q->op) {
	case OP_OPEN:
		rc = openat(q->f, q->path, (int)q->off, (mode_t)q->len);
		break;
	case OP_RENAME:
		rc = renameat(q->f, q->path, q->f, q->path2);
		break;
	default:
		rc = unlinkat(q->f, q->path, 0);
		break;
	}
	return rc < 0 ? -errno : rc;
}

static int fake_run(struct kvd_iob *io, const struct iob_req *q)
{
	const struct iob_file *fl = q->op <= OP_FALLOC ? &io->files[q->f] : NULL;

	switch (q->op) {
	case OP_READ:
		return fake_read(io, fl, q->b, q->p, q->len, q->off);
	case OP_WRITE:
		return fake_write(io, fl, q->b, q->p, q->len, q->off);
	case OP_FSYNC:
		return fake_fsync(io, fl, (int)q->len);
	case OP_FALLOC:
		return fallocate(fl->fd, 0, 0, (off_t)q->off) < 0 ? -errno : 0;
	default:
		return fake_meta(q);
	}
}

static int queue(struct kvd_iob *io, const struct iob_req *q, uint64_t user)
{
	struct io_uring_sqe *sqe;

	if (io->outstanding >= io->qd)
		return -EBUSY;
	if (io->fake) {
		io->outstanding++;
		fake_complete(io, user, fake_run(io, q));
		return 0;
	}
	/* Cannot be NULL: the SQ has qd entries and at most qd are outstanding. */
	sqe = io_uring_get_sqe(&io->ring);
	if (!sqe)
		return -EBUSY;
	io->outstanding++;

	const struct iob_file *fl = q->op <= OP_FALLOC ? &io->files[q->f] : NULL;
	int fd = fl ? (fl->fixed ? q->f : fl->fd) : q->f;

	switch (q->op) {
	case OP_READ:
		if (q->b >= 0)
			io_uring_prep_read_fixed(sqe, fd, q->p, q->len, q->off, q->b);
		else
			io_uring_prep_read(sqe, fd, q->p, q->len, q->off);
		break;
	case OP_WRITE:
		if (q->b >= 0)
			io_uring_prep_write_fixed(sqe, fd, q->p, q->len, q->off, q->b);
		else
			io_uring_prep_write(sqe, fd, q->p, q->len, q->off);
		break;
	case OP_FSYNC:
		io_uring_prep_fsync(sqe, fd, q->len ? IORING_FSYNC_DATASYNC : 0);
		break;
	case OP_FALLOC:
		io_uring_prep_fallocate(sqe, fd, 0, 0, (off_t)q->off);
		break;
	case OP_OPEN:
		io_uring_prep_openat(sqe, fd, q->path, (int)q->off, (mode_t)q->len);
		break;
	case OP_RENAME:
		io_uring_prep_renameat(sqe, fd, q->path, fd, q->path2, 0);
		break;
	default:
		io_uring_prep_unlinkat(sqe, fd, q->path, 0);
		break;
	}
	if (fl && fl->fixed)
		sqe->flags |= IOSQE_FIXED_FILE;
	io_uring_sqe_set_data64(sqe, user);
	return 0;
}

int kvd_iob_read(struct kvd_iob *io, int f, int b, void *p, uint32_t len, uint64_t off,
		 uint64_t user)
{
	struct iob_req q = { .op = OP_READ, .f = f, .b = b, .p = p, .len = len, .off = off };
	int rc = queue(io, &q, user);

	io->st.reads += !rc;
	return rc;
}

int kvd_iob_write(struct kvd_iob *io, int f, int b, const void *p, uint32_t len, uint64_t off,
		  uint64_t user)
{
	struct iob_req q = { .op = OP_WRITE, .f = f, .b = b, .p = (void *)p, .len = len,
			     .off = off };
	int rc = queue(io, &q, user);

	io->st.writes += !rc;
	return rc;
}

int kvd_iob_fsync(struct kvd_iob *io, int f, int datasync, uint64_t user)
{
	struct iob_req q = { .op = OP_FSYNC, .f = f, .b = -1, .len = datasync != 0 };
	int rc = queue(io, &q, user);

	io->st.fsyncs += !rc;
	return rc;
}

static int meta(struct kvd_iob *io, const struct iob_req *q, uint64_t user)
{
	int rc = queue(io, q, user);

	io->st.meta += !rc;
	return rc;
}

int kvd_iob_fallocate(struct kvd_iob *io, int f, uint64_t len, uint64_t user)
{
	return meta(io, &(struct iob_req){ .op = OP_FALLOC, .f = f, .b = -1, .off = len }, user);
}

int kvd_iob_openat(struct kvd_iob *io, int dfd, const char *path, int flags, unsigned mode,
		   uint64_t user)
{
	return meta(io, &(struct iob_req){ .op = OP_OPEN, .f = dfd, .b = -1, .path = path,
					   .off = (uint64_t)(unsigned)flags, .len = mode }, user);
}

int kvd_iob_renameat(struct kvd_iob *io, int dfd, const char *from, const char *to,
		     uint64_t user)
{
	return meta(io, &(struct iob_req){ .op = OP_RENAME, .f = dfd, .b = -1, .path = from,
					   .path2 = to }, user);
}

int kvd_iob_unlinkat(struct kvd_iob *io, int dfd, const char *path, uint64_t user)
{
	return meta(io, &(struct iob_req){ .op = OP_UNLINK, .f = dfd, .b = -1, .path = path },
		    user);
}

int kvd_iob_submit(struct kvd_iob *io)
{
	if (io->fake)
		return 0;
	while (io_uring_sq_ready(&io->ring)) {
		int rc = io_uring_submit(&io->ring);

		if (rc == -EINTR)
			continue;
		if (rc < 0)
			return rc;
		if (rc == 0)
			return -EAGAIN;
	}
	return 0;
}

unsigned kvd_iob_reap(struct kvd_iob *io, struct kvd_iob_cqe *out, unsigned max)
{
	unsigned n = 0;

	if (io->fake) {
		while (n < max && io->cq_head != io->cq_tail)
			out[n++] = io->cq[io->cq_head++ & io->cq_mask];
		io->outstanding -= n;
		return n;
	}

	struct io_uring_cqe *cqe;
	unsigned head;

	io_uring_for_each_cqe(&io->ring, head, cqe) {
		if (n == max)
			break;
		out[n].user = io_uring_cqe_get_data64(cqe);
		out[n].res = cqe->res;
		n++;
	}
	io_uring_cq_advance(&io->ring, n);
	io->outstanding -= n;
	return n;
}
