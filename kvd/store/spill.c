/* The spill engine: one thread that owns a kvd_iob and runs the jobs.
 *
 * Who touches what:
 *   sp->lock   the pending FIFO, the list of every job not yet final (so
 *              kvd_spill_cancel can find it), the result queue, the stats
 *              snapshot.
 *   atomics    run->cancel, sp->stop (set by the loop, polled by the engine),
 *              sp->disk (the engine, and kvd_spill_scan before any job).
 *   the engine everything else in a run and the ops; nobody else.
 *
 * A job's out fields are written by the engine before its final result is
 * queued under sp->lock, and read by the loop after kvd_spill_reap took the
 * lock: that is the only hand-over, so progress results carry the extent
 * index rather than updating j->done on the way.
 *
 * The thread never waits on the disk: opens, fallocate, fsyncs, rename and
 * unlink go through the ring like the data (on ext4 any of them can sleep
 * for a journal commit, tens of ms behind a write burst), so a restore keeps
 * moving while files are created.  What it does itself is CPU work: CRCs
 * when sealing a WRITE's extent, checks when verifying a READ's.
 *
 * Scheduling: READ jobs (and UNLINKs) are admitted and issued before WRITE
 * jobs, and while one runs WRITEs keep to a quarter of the queue; jobs of
 * one kind take turns op by op.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "engine/err.h"
#include "engine/mem.h"
#include "engine/pool.h"
#include "iob.h"
#include "engine/log.h"
#include "spill.h"

#define PAGE            KVD_SFMT_PAGE
#define SP_READS        8       /* READ and UNLINK jobs running at once */
#define SP_WRITES       4       /* WRITE jobs running at once */
#define SP_EXT_MAX      (1u << 20)
#define SP_AGAIN_MAX    1000    /* -EAGAIN / no progress in a row on one op */
#define SP_NICE         5       /* the thread's niceness above kvd's bulk (sp_main) */
#define SP_NAME         32
#define TMPFS_MAGIC     0x01021994
#define BUF_NONE        (-2)    /* extent not registered yet (-1: unregistered) */

enum { OP_READ, OP_WRITE, OP_SYNC, OP_DIRSYNC, OP_OPEN, OP_ALLOC, OP_RENAME, OP_UNLINK };

/* WRITE:  OPEN ALLOC IO SYNC REN DIR DONE
 * READ:   OPEN IO DONE
 * UNLINK: UNL DONE
 * Each xQ state waits for a free op to issue its operation, then becomes x
 * (the next value) until the completion moves it on. */
enum {
	RS_OPENQ, RS_OPEN, RS_ALLOCQ, RS_ALLOC, RS_IO, RS_SYNCQ, RS_SYNC, RS_RENQ, RS_REN,
	RS_DIRQ, RS_DIR, RS_UNLQ, RS_UNL, RS_DONE
};

/* A stopped WRITE's file is unlinked through the ring before it ends. */
enum { CLEAN_NO, CLEAN_NEED, CLEAN_BUSY, CLEAN_DONE };

struct sp_run;

struct sp_op {
	struct sp_run *r;
	struct sp_op *next;             /* the free list or the retry list */
	char *p;
	uint64_t off;                   /* in the file */
	uint32_t len;
	int kind;
	unsigned ext, again;
};

struct sp_run {
	struct kvd_spill_job *j;
	struct sp_run *prev, *next;     /* sp->runs (lock) */
	struct sp_run *qnext;           /* sp->pend (lock), then the engine's queues */
	atomic_int cancel;

	/* engine thread only */
	int state, fd, f, created, renamed, held, clean, err;
	unsigned dir, iext, vnext, inflight;
	uint64_t ioff, total, left_all, disk_bytes, old_bytes;
	uint64_t *base, *left;          /* [next]: file offset, bytes not yet moved */
	int *buf;                       /* [next]: iob buffer handle, -1, BUF_NONE */
	char name[SP_NAME];             /* <seq>.kvs */
	char tmp[SP_NAME + 4];          /* <seq>.kvs.tmp */
	char msg[sizeof ((struct kvd_spill_job *)0)->msg];
};

struct kvd_spill {
	struct kvd_spill_cfg cfg;
	char *dir[KVD_SPILL_DIRS_MAX];
	int dirfd[KVD_SPILL_DIRS_MAX], dirf[KVD_SPILL_DIRS_MAX];
	int direct[KVD_SPILL_DIRS_MAX], prealloc[KVD_SPILL_DIRS_MAX];
	struct kvd_iob *io;
	pthread_t th;
	int wfd, rfd;                   /* wakes the engine; results waiting */
	atomic_uint_fast64_t disk;
	atomic_int stop;

	pthread_mutex_t lock;
	struct sp_run *runs;
	struct sp_run *pend, **pend_tail;
	struct kvd_spill_result *res;   /* a ring of res_cap, res_n from res_head */
	unsigned res_head, res_n, res_cap;
	size_t res_commit;              /* results promised to submitted jobs, <= res_cap */
	struct kvd_spill_stats st;

	/* engine thread only */
	struct sp_op *ops, *ofree, *retry, **retry_tail;
	struct sp_run *rq, **rq_tail, *wq, **wq_tail;
	struct sp_run *act_r[SP_READS], *act_w[SP_WRITES];
	unsigned nact_r, nact_w, rr_r, rr_w, rr_v, rr_dir;
	uint64_t reserved;              /* extent bytes of running WRITEs */
	unsigned wflight;               /* ops of WRITEs outstanding */
	uint64_t shorts, agains;
	int warned_buf, warned_submit, submit_err;
};

static int run_stopped(const struct kvd_spill *sp, struct sp_run *r)
{
	return r->err || atomic_load_explicit(&r->cancel, memory_order_relaxed) ||
	       atomic_load_explicit(&sp->stop, memory_order_relaxed);
}

static void wake(int fd)
{
	uint64_t one = 1;

	/* Cannot fail but for a counter near 2^64. */
	if (write(fd, &one, sizeof one) < 0) {
	}
}

static void fail(struct sp_run *r, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(struct sp_run *r, int err, const char *fmt, ...)
{
	va_list ap;

	if (r->err)
		return;
	r->err = err;
	va_start(ap, fmt);
	vsnprintf(r->msg, sizeof r->msg, fmt, ap);
	va_end(ap);
}

/* ---- results ------------------------------------------------------------ */

/* Room for n more results, promised at submit so posting never fails. */
static int res_reserve(struct kvd_spill *sp, size_t n)
{
	size_t want = sp->res_commit + n;

	if (want > UINT32_MAX / 2)
		return -ENOMEM;
	if (want > sp->res_cap) {
		unsigned cap = sp->res_cap ? sp->res_cap : 64;
		struct kvd_spill_result *nr;

		while (cap < want)
			cap *= 2;
		nr = malloc(cap * sizeof *nr);
		if (!nr)
			return -ENOMEM;
		for (unsigned i = 0; i < sp->res_n; i++)
			nr[i] = sp->res[(sp->res_head + i) % sp->res_cap];
		free(sp->res);
		sp->res = nr;
		sp->res_head = 0;
		sp->res_cap = cap;
	}
	sp->res_commit = want;
	return 0;
}

static void stats_snap(struct kvd_spill *sp)
{
	struct kvd_iob_stats is;

	kvd_iob_stats(sp->io, &is);
	sp->st.reads = is.reads;
	sp->st.writes = is.writes;
	sp->st.fsyncs = is.fsyncs;
	sp->st.bufs_fixed = is.bufs_fixed;
	sp->st.bufs_plain = is.bufs_plain;
	sp->st.files_fixed = is.files_fixed;
	sp->st.files_plain = is.files_plain;
	sp->st.faults = is.faults;
	sp->st.short_ops = sp->shorts;
	sp->st.retries = sp->agains;
}

/* Under sp->lock; the eventfd is written under it too, so it is readable
 * exactly while the queue is not empty, as kvd_spill_reap leaves it. */
static void post_locked(struct kvd_spill *sp, struct kvd_spill_job *j, int final, unsigned ext)
{
	struct kvd_spill_result *o = &sp->res[(sp->res_head + sp->res_n++) % sp->res_cap];

	o->job = j;
	o->final = final;
	o->ext = ext;
	stats_snap(sp);
	wake(sp->rfd);
}

static void post_progress(struct kvd_spill *sp, struct sp_run *r, unsigned ext)
{
	pthread_mutex_lock(&sp->lock);
	post_locked(sp, r->j, 0, ext);
	pthread_mutex_unlock(&sp->lock);
}

unsigned kvd_spill_reap(struct kvd_spill *sp, struct kvd_spill_result *out, unsigned max)
{
	uint64_t cnt;
	unsigned n = 0;

	if (!max)
		return 0;
	pthread_mutex_lock(&sp->lock);
	if (read(sp->rfd, &cnt, sizeof cnt) < 0) {
		/* EAGAIN: nothing was signalled */
	}
	while (n < max && sp->res_n) {
		out[n++] = sp->res[sp->res_head];
		sp->res_head = (sp->res_head + 1) % sp->res_cap;
		sp->res_n--;
	}
	sp->res_commit -= n;
	if (sp->res_n)
		wake(sp->rfd);
	pthread_mutex_unlock(&sp->lock);
	return n;
}

int kvd_spill_fd(const struct kvd_spill *sp)
{
	return sp->rfd;
}

uint64_t kvd_spill_disk_bytes(const struct kvd_spill *sp)
{
	return atomic_load(&((struct kvd_spill *)sp)->disk);
}

void kvd_spill_stats(struct kvd_spill *sp, struct kvd_spill_stats *out)
{
	pthread_mutex_lock(&sp->lock);
	*out = sp->st;
	pthread_mutex_unlock(&sp->lock);
}

void kvd_spill_disk_add(struct kvd_spill *sp, uint64_t bytes)
{
	atomic_fetch_add(&sp->disk, bytes);
}

static void disk_sub(struct kvd_spill *sp, uint64_t b)
{
	uint64_t cur = atomic_load(&sp->disk);

	while (!atomic_compare_exchange_weak(&sp->disk, &cur, cur > b ? cur - b : 0))
		;
}

/* ---- finishing a job ---------------------------------------------------- */

static void run_free(struct sp_run *r)
{
	free(r->base);
	free(r->left);
	free(r->buf);
	free(r);
}

/* Releases what the job holds, fills its out fields and posts its final
 * result; the run is gone afterwards.  Nothing of it is outstanding, and a
 * stopped WRITE's file is gone already. */
static void finish(struct kvd_spill *sp, struct sp_run *r)
{
	struct kvd_spill_job *j = r->j;
	int ok = r->state == RS_DONE && !r->err;
	int res = ok ? 0 : r->err ? r->err : -ECANCELED;

	if (r->buf)
		for (unsigned i = 0; i < j->next; i++)
			kvd_iob_buf_del(sp->io, r->buf[i]);
	if (r->f >= 0)
		kvd_iob_file_del(sp->io, r->f);
	if (r->fd >= 0)
		close(r->fd);
	if (r->held)
		sp->reserved -= r->total;
	if (j->op == KVD_SPILL_WRITE && ok)
		atomic_fetch_add(&sp->disk, r->disk_bytes);
	j->res = res;
	j->done = j->op == KVD_SPILL_READ ? r->vnext : 0;
	if (j->op == KVD_SPILL_WRITE && ok) {
		j->wdir = r->dir;
		j->disk_bytes = r->disk_bytes;
	}
	if (res == -ECANCELED && !r->err)
		snprintf(r->msg, sizeof r->msg, "cancelled");
	memcpy(j->msg, res ? r->msg : "", res ? sizeof j->msg : 1);

	pthread_mutex_lock(&sp->lock);
	if (r->prev)
		r->prev->next = r->next;
	else
		sp->runs = r->next;
	if (r->next)
		r->next->prev = r->prev;
	/* The READ's unused promises go back. */
	if (j->op == KVD_SPILL_READ)
		sp->res_commit -= j->next - r->vnext;
	post_locked(sp, j, 1, 0);
	pthread_mutex_unlock(&sp->lock);
	run_free(r);
}

/* ---- starting a job ----------------------------------------------------- */

static int run_arrays(struct sp_run *r)
{
	const struct kvd_spill_job *j = r->j;
	uint64_t off = 0;

	r->base = malloc(j->next * sizeof *r->base);
	r->left = malloc(j->next * sizeof *r->left);
	r->buf = malloc(j->next * sizeof *r->buf);
	if (!r->base || !r->left || !r->buf) {
		free(r->base);
		free(r->left);
		free(r->buf);
		r->base = r->left = NULL;
		r->buf = NULL;
		return -ENOMEM;
	}
	for (unsigned i = 0; i < j->next; i++) {
		r->base[i] = off;
		r->left[i] = j->ext[i].bytes;
		r->buf[i] = BUF_NONE;
		off += j->ext[i].bytes;
	}
	r->total = r->left_all = off;
	return 0;
}

/* Round robin over the directories whose file system has room for `bytes`. */
static int pick_dir(struct kvd_spill *sp, uint64_t bytes)
{
	for (unsigned k = 0; k < sp->cfg.ndirs; k++) {
		unsigned d = (sp->rr_dir + k) % sp->cfg.ndirs;
		struct statvfs vs;

		if (fstatvfs(sp->dirfd[d], &vs) == 0 &&
		    (uint64_t)vs.f_bavail * vs.f_frsize < bytes + (1u << 20))
			continue;
		sp->rr_dir = d + 1;
		return (int)d;
	}
	return -1;
}

static void start_write(struct kvd_spill *sp, struct sp_run *r)
{
	int d, rc;

	if ((rc = run_arrays(r))) {
		fail(r, rc, "out of memory");
		return;
	}
	if (sp->cfg.limit &&
	    atomic_load(&sp->disk) + sp->reserved + r->total > sp->cfg.limit) {
		fail(r, -ENOSPC, "spill limit: %llu on disk + %llu would pass %llu",
		     (unsigned long long)(atomic_load(&sp->disk) + sp->reserved),
		     (unsigned long long)r->total, (unsigned long long)sp->cfg.limit);
		return;
	}
	d = pick_dir(sp, r->total);
	if (d < 0) {
		fail(r, -ENOSPC, "no spill directory has room for %llu bytes",
		     (unsigned long long)r->total);
		return;
	}
	sp->reserved += r->total;
	r->held = 1;
	r->dir = (unsigned)d;
	r->state = RS_OPENQ;
}

static void start_read(struct kvd_spill *sp, struct sp_run *r)
{
	int rc = run_arrays(r);

	if (rc) {
		fail(r, rc, "out of memory");
		return;
	}
	r->dir = r->j->dir;
	r->state = RS_OPENQ;
}

static void start_unlink(struct kvd_spill *sp, struct sp_run *r)
{
	struct stat st;

	r->dir = r->j->dir;
	if (fstatat(sp->dirfd[r->dir], r->name, &st, 0) == 0)
		r->disk_bytes = (uint64_t)st.st_blocks * 512;
	r->state = RS_UNLQ;
}

/* Pending jobs into the engine's queues, READs and UNLINKs ahead of WRITEs. */
static void take_pending(struct kvd_spill *sp)
{
	struct sp_run *r, *nx;

	pthread_mutex_lock(&sp->lock);
	r = sp->pend;
	sp->pend = NULL;
	sp->pend_tail = &sp->pend;
	pthread_mutex_unlock(&sp->lock);
	for (; r; r = nx) {
		nx = r->qnext;
		r->qnext = NULL;
		if (r->j->op == KVD_SPILL_WRITE) {
			*sp->wq_tail = r;
			sp->wq_tail = &r->qnext;
		} else {
			*sp->rq_tail = r;
			sp->rq_tail = &r->qnext;
		}
	}
}

/* Queued jobs that were cancelled end now, whatever is running. */
static int drop_cancelled(struct kvd_spill *sp, struct sp_run **q, struct sp_run ***tail)
{
	struct sp_run **pp = q;
	int any = 0;

	while (*pp) {
		struct sp_run *r = *pp;

		if (run_stopped(sp, r)) {
			*pp = r->qnext;
			finish(sp, r);
			any = 1;
		} else {
			pp = &r->qnext;
		}
	}
	*tail = pp;
	return any;
}

static int admit(struct kvd_spill *sp)
{
	int any = drop_cancelled(sp, &sp->rq, &sp->rq_tail) |
		  drop_cancelled(sp, &sp->wq, &sp->wq_tail);
	struct sp_run *r;

	while ((r = sp->rq) && sp->nact_r < SP_READS) {
		sp->rq = r->qnext;
		if (!sp->rq)
			sp->rq_tail = &sp->rq;
		if (r->j->op == KVD_SPILL_UNLINK)
			start_unlink(sp, r);
		else
			start_read(sp, r);
		sp->act_r[sp->nact_r++] = r;
		any = 1;
	}
	while ((r = sp->wq) && sp->nact_w < SP_WRITES) {
		sp->wq = r->qnext;
		if (!sp->wq)
			sp->wq_tail = &sp->wq;
		start_write(sp, r);
		sp->act_w[sp->nact_w++] = r;
		any = 1;
	}
	return any;
}

/* ---- issuing ------------------------------------------------------------ */

static int queue_op(struct kvd_spill *sp, struct sp_op *op)
{
	struct sp_run *r = op->r;
	uint64_t user = (uint64_t)(op - sp->ops);
	int dfd = sp->dirfd[r->dir];
	unsigned i = op->ext;

	switch (op->kind) {
	case OP_READ:
		return kvd_iob_read(sp->io, r->f, r->buf[i], op->p, op->len, op->off, user);
	case OP_WRITE:
		return kvd_iob_write(sp->io, r->f, r->buf[i], op->p, op->len, op->off, user);
	case OP_SYNC:
		return kvd_iob_fsync(sp->io, r->f, 1, user);
	case OP_DIRSYNC:
		return kvd_iob_fsync(sp->io, sp->dirf[r->dir], 0, user);
	case OP_ALLOC:
		return kvd_iob_fallocate(sp->io, r->f, r->total, user);
	case OP_RENAME:
		return kvd_iob_renameat(sp->io, dfd, r->tmp, r->name, user);
	case OP_UNLINK:
		return kvd_iob_unlinkat(sp->io, dfd, r->j->op == KVD_SPILL_WRITE && !r->renamed ?
					r->tmp : r->name, user);
	default:
		if (r->j->op == KVD_SPILL_WRITE)
			return kvd_iob_openat(sp->io, dfd, r->tmp, O_CREAT | O_TRUNC | O_WRONLY |
					      O_CLOEXEC | (sp->direct[r->dir] ? O_DIRECT : 0),
					      0640, user);
		return kvd_iob_openat(sp->io, dfd, r->name,
				      O_RDONLY | O_CLOEXEC | (sp->direct[r->dir] ? O_DIRECT : 0),
				      0, user);
	}
}

static void op_put(struct kvd_spill *sp, struct sp_op *op)
{
	sp->wflight -= op->r->j->op == KVD_SPILL_WRITE;
	op->r->inflight--;
	op->r = NULL;
	op->next = sp->ofree;
	sp->ofree = op;
}

/* The operation a state waits to issue, or -1. */
static int state_op(int state)
{
	switch (state) {
	case RS_OPENQ: return OP_OPEN;
	case RS_ALLOCQ: return OP_ALLOC;
	case RS_SYNCQ: return OP_SYNC;
	case RS_RENQ: return OP_RENAME;
	case RS_DIRQ: return OP_DIRSYNC;
	case RS_UNLQ: return OP_UNLINK;
	}
	return -1;
}

/* First touch of extent i: seal it (a WRITE's CRCs, on this thread, while
 * the ring works on earlier extents) and register it for as long as its
 * operations run. */
static void ext_open(struct kvd_spill *sp, struct sp_run *r, unsigned i)
{
	const struct kvd_spill_buf *b = &r->j->ext[i];

	if (r->j->op == KVD_SPILL_WRITE) {
		if (b->fill) {
			if (b->hdr)
				memcpy(b->p, b->hdr, PAGE);
			b->fill(b->fill_arg, (char *)b->p + PAGE);
		}
		kvd_sfmt_seal(b->p, (char *)b->p + PAGE);
	} else {
		/* Registering pins the pages and would fault them all in at
		 * once, holding the mmap lock throughout (kvd_mem_populate). */
		kvd_mem_populate(b->p, b->bytes);
	}
	r->buf[i] = kvd_iob_buf_add(sp->io, b->p, b->bytes);
	if (r->buf[i] < 0 && !sp->warned_buf) {
		struct kvd_iob_stats is;

		kvd_iob_stats(sp->io, &is);
		sp->warned_buf = 1;
		kvd_log(LOG_NOTICE, "spill: buffer registration failed (%s%s); "
			"using unregistered buffers where it fails", kvd_strerror(is.buf_err),
			is.buf_err == -ENOMEM ? ", RLIMIT_MEMLOCK?" : "");
	}
}

/* One operation of run r, if it has one to give and an op is free. */
static int issue_one(struct kvd_spill *sp, struct sp_run *r)
{
	const struct kvd_spill_job *j = r->j;
	struct sp_op *op = sp->ofree, *nx;
	int kind;

	if (!op)
		return 0;
	nx = op->next;                  /* the literals below clear it */
	if (r->clean == CLEAN_NEED) {
		*op = (struct sp_op){ .r = r, .kind = OP_UNLINK };
	} else if (run_stopped(sp, r)) {
		return 0;
	} else if ((kind = state_op(r->state)) >= 0) {
		*op = (struct sp_op){ .r = r, .kind = kind };
	} else if (r->state == RS_IO && r->iext < j->next) {
		unsigned i = r->iext;
		const struct kvd_spill_buf *b = &j->ext[i];
		uint64_t len = b->bytes - r->ioff;

		if (r->buf[i] == BUF_NONE)
			ext_open(sp, r, i);
		if (len > sp->cfg.block)
			len = sp->cfg.block;
		*op = (struct sp_op){ .r = r, .kind = j->op == KVD_SPILL_WRITE ? OP_WRITE : OP_READ,
				      .ext = i, .len = (uint32_t)len, .p = (char *)b->p + r->ioff,
				      .off = r->base[i] + r->ioff };
	} else {
		return 0;
	}
	if (queue_op(sp, op)) {
		op->r = NULL;
		op->next = nx;
		return 0;
	}
	sp->ofree = nx;
	r->inflight++;
	sp->wflight += j->op == KVD_SPILL_WRITE;
	if (r->clean == CLEAN_NEED)
		r->clean = CLEAN_BUSY;
	else if (op->kind != OP_READ && op->kind != OP_WRITE)
		r->state++;
	else if ((r->ioff += op->len) == j->ext[r->iext].bytes) {
		r->iext++;
		r->ioff = 0;
	}
	return 1;
}

/* Rounds over the running jobs of one kind, one op each per round, while
 * fewer than `cap` ops of that kind are in flight. */
static int issue_class(struct kvd_spill *sp, struct sp_run **act, unsigned n, unsigned *rr,
		       const unsigned *flight, unsigned cap)
{
	int any = 0, round;

	if (!n)
		return 0;
	do {
		round = 0;
		for (unsigned k = 0; k < n && sp->ofree && *flight < cap; k++)
			round |= issue_one(sp, act[(*rr + k) % n]);
		any |= round;
	} while (round && sp->ofree && *flight < cap);
	*rr = (*rr + 1) % n;
	return any;
}

static int issue(struct kvd_spill *sp)
{
	int any = 0, rc;

	/* Remainders of short transfers and retries first: they hold ops. */
	while (sp->retry) {
		struct sp_op *op = sp->retry;

		sp->retry = op->next;
		if (!sp->retry)
			sp->retry_tail = &sp->retry;
		if (run_stopped(sp, op->r)) {
			op_put(sp, op);
		} else if (queue_op(sp, op)) {
			op->next = sp->retry;   /* the ring is full: later */
			sp->retry = op;
			if (!op->next)
				sp->retry_tail = &op->next;
			break;
		}
		any = 1;
	}
	/* While a READ runs, WRITEs keep to a quarter of the queue: the device
	 * serves roughly in order, and every write in flight is time a restore
	 * waits. */
	unsigned wcap = sp->nact_r ? sp->cfg.qd / 4 : sp->cfg.qd, none = 0;

	any |= issue_class(sp, sp->act_r, sp->nact_r, &sp->rr_r, &none, 1);
	any |= issue_class(sp, sp->act_w, sp->nact_w, &sp->rr_w, &sp->wflight, wcap);
	rc = kvd_iob_submit(sp->io);
	sp->submit_err = rc;
	if (rc && rc != -EAGAIN && rc != -EBUSY && rc != -EINTR && !sp->warned_submit) {
		kvd_log(LOG_ERR, "spill: io_uring_submit: %s", kvd_strerror(rc));
		sp->warned_submit = 1;
	}
	return any;
}

/* ---- completions -------------------------------------------------------- */

static void retry_op(struct kvd_spill *sp, struct sp_op *op)
{
	op->next = NULL;
	*sp->retry_tail = op;
	sp->retry_tail = &op->next;
}

static void opened(struct kvd_spill *sp, struct sp_run *r, int fd)
{
	const char *path = r->j->op == KVD_SPILL_WRITE ? r->tmp : r->name;
	struct stat st;

	if (fd < 0) {
		fail(r, fd, "open %s/%s: %s", sp->dir[r->dir], path, kvd_strerror(fd));
		return;
	}
	r->fd = fd;
	r->created = r->j->op == KVD_SPILL_WRITE;
	if (run_stopped(sp, r))
		return;
	if (r->j->op == KVD_SPILL_READ && fstat(fd, &st) == 0 && (uint64_t)st.st_size < r->total) {
		fail(r, -KVD_ELOST, "file truncated: %llu bytes, want %llu",
		     (unsigned long long)st.st_size, (unsigned long long)r->total);
		return;
	}
	r->f = kvd_iob_file_add(sp->io, fd);
	if (r->f < 0) {
		fail(r, r->f, "no file slot");
		return;
	}
	/* Allocating up front keeps O_DIRECT writes from extending the file
	 * (which ext4 serialises) and finds a full disk before any write.  Not
	 * on tmpfs, where it would zero every page the writes then fill. */
	r->state = r->j->op == KVD_SPILL_WRITE && sp->prealloc[r->dir] ? RS_ALLOCQ : RS_IO;
}

static void synced(struct kvd_spill *sp, struct sp_run *r)
{
	struct stat st;

	if (fstat(r->fd, &st) < 0) {
		fail(r, -errno, "fstat: %s", strerror(errno));
		return;
	}
	r->disk_bytes = (uint64_t)st.st_blocks * 512;
	/* An older file of this sequence is about to be replaced. */
	if (fstatat(sp->dirfd[r->dir], r->name, &st, 0) == 0)
		r->old_bytes = (uint64_t)st.st_blocks * 512;
	r->state = RS_RENQ;
}

/* Completion of anything but data. */
static void complete_meta(struct kvd_spill *sp, struct sp_op *op, int res)
{
	struct sp_run *r = op->r;

	switch (op->kind) {
	case OP_OPEN:
		opened(sp, r, res);
		return;
	case OP_ALLOC:
		if (res < 0 && res != -EOPNOTSUPP && res != -ENOSYS)
			fail(r, res, "fallocate %llu: %s", (unsigned long long)r->total,
			     kvd_strerror(res));
		else
			r->state = RS_IO;
		return;
	case OP_SYNC:
	case OP_DIRSYNC:
		/* Never retried: after a failed fsync the page cache may say the
		 * data is clean when the disk does not have it. */
		if (res < 0)
			fail(r, -EIO, "%s: %s", op->kind == OP_SYNC ? "fdatasync" : "fsync dir",
			     kvd_strerror(res));
		else if (op->kind == OP_SYNC)
			synced(sp, r);
		else
			r->state = RS_DONE;
		return;
	case OP_RENAME:
		if (res < 0) {
			fail(r, res, "rename %s: %s", r->tmp, kvd_strerror(res));
			return;
		}
		r->renamed = 1;
		disk_sub(sp, r->old_bytes);
		r->state = RS_DIRQ;
		return;
	case OP_UNLINK:
		if (r->clean == CLEAN_BUSY) {
			r->clean = CLEAN_DONE;  /* what else could be done */
		} else if (res < 0) {
			fail(r, res, "unlink %s/%s: %s", sp->dir[r->dir], r->name, kvd_strerror(res));
		} else {
			disk_sub(sp, r->disk_bytes);
			r->state = RS_DONE;
		}
		return;
	}
}

static void complete(struct kvd_spill *sp, const struct kvd_iob_cqe *c)
{
	struct sp_op *op = &sp->ops[c->user];
	struct sp_run *r = op->r;
	const char *what = op->kind == OP_READ ? "read" : "write";
	int res = c->res;

	if (op->kind != OP_READ && op->kind != OP_WRITE) {
		complete_meta(sp, op, res);
		op_put(sp, op);
		return;
	}
	if (res == -EAGAIN || res == -EINTR || (res == 0 && op->kind == OP_WRITE)) {
		sp->agains++;
		if (++op->again > SP_AGAIN_MAX) {
			fail(r, -EIO, "%s at %llu: no progress", what, (unsigned long long)op->off);
		} else if (!run_stopped(sp, r)) {
			retry_op(sp, op);
			return;
		}
		op_put(sp, op);
		return;
	}
	if (res < 0) {
		fail(r, res, "%s at %llu: %s", what, (unsigned long long)op->off, kvd_strerror(res));
		op_put(sp, op);
		return;
	}
	if (res == 0) {
		fail(r, -KVD_ELOST, "file truncated at %llu", (unsigned long long)op->off);
		op_put(sp, op);
		return;
	}
	if ((uint32_t)res > op->len)
		res = (int)op->len;     /* never, but the counts below must not wrap */
	op->again = 0;
	r->left[op->ext] -= (uint64_t)res;
	r->left_all -= (uint64_t)res;
	if ((uint32_t)res < op->len) {
		sp->shorts++;
		op->p += res;
		op->off += (uint64_t)res;
		op->len -= (uint32_t)res;
		if (!run_stopped(sp, r)) {
			retry_op(sp, op);
			return;
		}
	}
	if (!r->left[op->ext]) {
		/* Nothing of this extent is in flight any more. */
		kvd_iob_buf_del(sp->io, r->buf[op->ext]);
		r->buf[op->ext] = -1;
	}
	if (op->kind == OP_WRITE && !r->left_all)
		r->state = RS_SYNCQ;
	op_put(sp, op);
}

static int reap(struct kvd_spill *sp)
{
	struct kvd_iob_cqe c[64];
	unsigned n, total = 0;

	while ((n = kvd_iob_reap(sp->io, c, 64))) {
		for (unsigned i = 0; i < n; i++)
			complete(sp, &c[i]);
		total += n;
	}
	return total > 0;
}

/* ---- verifying ---------------------------------------------------------- */

static void verify_one(struct kvd_spill *sp, struct sp_run *r)
{
	const struct kvd_spill_job *j = r->j;
	unsigned i = r->vnext;
	const struct kvd_spill_buf *b = &j->ext[i];
	struct kvd_sfmt_hdr h;
	char m[80];
	int rc;

	rc = kvd_sfmt_check_hdr(b->p, b->bytes, &h, m, sizeof m);
	if (rc) {
		fail(r, -KVD_ELOST, "extent %u: %s", i, m);
		return;
	}
	if (h.seq != j->seq || h.gen != j->gen || h.index != i || h.extent_bytes != b->bytes) {
		fail(r, -KVD_ELOST, "extent %u: header has seq %llx gen %llu index %u bytes %llu",
		     i, (unsigned long long)h.seq, (unsigned long long)h.gen, h.index,
		     (unsigned long long)h.extent_bytes);
		return;
	}
	rc = kvd_sfmt_check_payload(&h, (char *)b->p + PAGE, m, sizeof m);
	if (rc) {
		fail(r, -KVD_ELOST, "extent %u: %s", i, m);
		return;
	}
	if (b->drain)
		b->drain(b->fill_arg, b->p);
	r->vnext++;
	post_progress(sp, r, i);
	if (r->vnext == j->next)
		r->state = RS_DONE;
}

/* One extent per pass (7 ms for a 28 MiB SEG), the jobs taking turns, so
 * the ring is refilled between checks. */
static int verify(struct kvd_spill *sp)
{
	for (unsigned k = 0; k < sp->nact_r; k++) {
		struct sp_run *r = sp->act_r[(sp->rr_v + k) % sp->nact_r];

		if (r->j->op == KVD_SPILL_READ && r->state == RS_IO && !run_stopped(sp, r) &&
		    r->vnext < r->j->next && !r->left[r->vnext]) {
			verify_one(sp, r);
			sp->rr_v = (sp->rr_v + k + 1) % sp->nact_r;
			return 1;
		}
	}
	return 0;
}

static int finish_idle(struct kvd_spill *sp, struct sp_run **act, unsigned *n)
{
	int any = 0;

	for (unsigned k = 0; k < *n;) {
		struct sp_run *r = act[k];

		if (r->inflight || (r->state != RS_DONE && !run_stopped(sp, r))) {
			k++;
			continue;
		}
		if (r->state != RS_DONE && r->created && r->clean == CLEAN_NO) {
			r->clean = CLEAN_NEED;  /* a stopped WRITE leaves no file */
			any = 1;
		}
		if (r->clean == CLEAN_NEED || r->clean == CLEAN_BUSY) {
			k++;
			continue;
		}
		act[k] = act[--*n];
		finish(sp, r);
		any = 1;
	}
	return any;
}

/* ---- the thread --------------------------------------------------------- */

static void *sp_main(void *arg)
{
	struct kvd_spill *sp = arg;

	/* A little below the workers' bulk work (kvd_pool_bulk_nice): its
	 * CRCs and tail copies are hundreds of MB a write-back or restore,
	 * and on a machine with few cores a worker woken for a decode's
	 * ATTEND should not queue behind them (a victim's p99 in kvbench
	 * stall's evict_restore, 2.9 -> 1.4-1.5 ms on 2 cores).  Not much
	 * below: a restore is waited for too.  Relative to the bulk niceness
	 * of the thread it was born with, kvd's: under a unit's Nice=-10 a
	 * plain +5 would rank it above the workers' bulk and every user's
	 * process. */
	kvd_pool_thread_below_bulk(SP_NICE);

	for (;;) {
		uint64_t cnt;
		int any;

		/* Drained before looking: whatever is signalled from here on
		 * makes the poll below return at once. */
		if (read(sp->wfd, &cnt, sizeof cnt) < 0) {
		}
		take_pending(sp);
		any = reap(sp);
		any |= admit(sp);
		any |= issue(sp);
		any |= verify(sp);
		any |= finish_idle(sp, sp->act_r, &sp->nact_r);
		any |= finish_idle(sp, sp->act_w, &sp->nact_w);
		if (atomic_load(&sp->stop) && !sp->nact_r && !sp->nact_w && !sp->rq && !sp->wq) {
			pthread_mutex_lock(&sp->lock);
			int empty = !sp->pend;

			pthread_mutex_unlock(&sp->lock);
			if (empty)
				break;
			continue;
		}
		if (!any) {
			struct pollfd p = { .fd = sp->wfd, .events = POLLIN };

			/* A submit the kernel refused (-EAGAIN) is tried again soon. */
			poll(&p, 1, sp->submit_err ? 1 : -1);
		}
	}
	return NULL;
}

/* ---- submit / cancel ---------------------------------------------------- */

static int bad_job(struct kvd_spill_job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad_job(struct kvd_spill_job *j, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(j->msg, sizeof j->msg, fmt, ap);
	va_end(ap);
	j->res = -EINVAL;
	return -EINVAL;
}

static int check_job(const struct kvd_spill *sp, struct kvd_spill_job *j)
{
	if (j->op != KVD_SPILL_WRITE && j->op != KVD_SPILL_READ && j->op != KVD_SPILL_UNLINK)
		return bad_job(j, "unknown op %d", j->op);
	if (j->op != KVD_SPILL_WRITE && j->dir >= sp->cfg.ndirs)
		return bad_job(j, "dir %u of %u", j->dir, sp->cfg.ndirs);
	if (j->op == KVD_SPILL_UNLINK)
		return 0;
	if (!j->ext || !j->next || j->next > SP_EXT_MAX)
		return bad_job(j, "%u extents", j->ext ? j->next : 0);
	for (unsigned i = 0; i < j->next; i++) {
		const struct kvd_spill_buf *b = &j->ext[i];

		if (!b->p || (uintptr_t)b->p % PAGE || b->bytes < PAGE || b->bytes % PAGE)
			return bad_job(j, "extent %u: buffer not 4 KiB aligned and sized", i);
		if (j->op == KVD_SPILL_WRITE) {
			const struct kvd_sfmt_hdr *h = b->fill && b->hdr ? b->hdr : b->p;

			if (h->seq != j->seq || h->gen != j->gen || h->index != i)
				return bad_job(j, "extent %u: header seq/gen/index differ from the job",
					       i);
			if (h->payload_bytes > b->bytes - PAGE ||
			    kvd_sfmt_extent_bytes(h->payload_bytes) != b->bytes)
				return bad_job(j, "extent %u: %llu bytes, header wants %llu", i,
					       (unsigned long long)b->bytes,
					       (unsigned long long)(h->payload_bytes + PAGE));
		}
	}
	return 0;
}

int kvd_spill_submit(struct kvd_spill *sp, struct kvd_spill_job *j)
{
	struct sp_run *r;
	int rc = check_job(sp, j);

	if (rc)
		return rc;
	r = calloc(1, sizeof *r);
	if (!r)
		return -ENOMEM;
	r->j = j;
	r->fd = r->f = -1;
	snprintf(r->name, sizeof r->name, "%016llx.kvs", (unsigned long long)j->seq);
	snprintf(r->tmp, sizeof r->tmp, "%s.tmp", r->name);
	atomic_init(&r->cancel, 0);
	pthread_mutex_lock(&sp->lock);
	rc = res_reserve(sp, 1 + (j->op == KVD_SPILL_READ ? j->next : 0));
	if (rc) {
		pthread_mutex_unlock(&sp->lock);
		free(r);
		return rc;
	}
	r->next = sp->runs;
	if (sp->runs)
		sp->runs->prev = r;
	sp->runs = r;
	*sp->pend_tail = r;
	sp->pend_tail = &r->qnext;
	pthread_mutex_unlock(&sp->lock);
	wake(sp->wfd);
	return 0;
}

void kvd_spill_cancel(struct kvd_spill *sp, struct kvd_spill_job *j)
{
	pthread_mutex_lock(&sp->lock);
	for (struct sp_run *r = sp->runs; r; r = r->next)
		if (r->j == j)
			atomic_store(&r->cancel, 1);
	pthread_mutex_unlock(&sp->lock);
	wake(sp->wfd);
}

/* ---- create / destroy --------------------------------------------------- */

static int mkdirs(const char *path)
{
	char buf[4096];
	size_t n = strlen(path);

	if (n >= sizeof buf)
		return -ENAMETOOLONG;
	memcpy(buf, path, n + 1);
	for (char *s = buf + 1; *s; s++) {
		if (*s != '/')
			continue;
		*s = 0;
		if (mkdir(buf, 0750) < 0 && errno != EEXIST)
			return -errno;
		*s = '/';
	}
	if (mkdir(buf, 0750) < 0 && errno != EEXIST)
		return -errno;
	return 0;
}

/* 1: O_DIRECT works here, 0: it does not (tmpfs and others refuse it with
 * EINVAL, at open or at the first write), or -errno: not writable at all. */
static int probe_direct(int dfd, int want)
{
	static const char name[] = ".kvd-probe.tmp";
	void *page = NULL;
	int fd, rc = 0;

	if (want) {
		fd = openat(dfd, name, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC | O_DIRECT, 0600);
		if (fd >= 0) {
			if (posix_memalign(&page, PAGE, PAGE)) {
				rc = -ENOMEM;
			} else {
				memset(page, 0, PAGE);
				rc = pwrite(fd, page, PAGE, 0) == PAGE ? 1 : errno == EINVAL ? 0 : -errno;
				free(page);
			}
			close(fd);
			unlinkat(dfd, name, 0);
			if (rc)
				return rc;
		} else if (errno != EINVAL) {
			return -errno;
		}
	}
	fd = openat(dfd, name, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	close(fd);
	unlinkat(dfd, name, 0);
	return 0;
}

__attribute__((cold))
int kvd_spill_create(const struct kvd_spill_cfg *cfg, struct kvd_spill **out)
{
	struct kvd_spill *sp;
	struct statfs fs;
	char msg[160];
	sigset_t all, old;
	int rc;

	if (!cfg->ndirs || cfg->ndirs > KVD_SPILL_DIRS_MAX) {
		fprintf(stderr, "kvd_spill: %u directories (1 to %d)\n", cfg->ndirs,
			KVD_SPILL_DIRS_MAX);
		return -EINVAL;
	}
	if ((cfg->qd && (cfg->qd < 32 || cfg->qd > 4096)) ||
	    (cfg->block && (cfg->block % PAGE || cfg->block > (1u << 30)))) {
		fprintf(stderr, "kvd_spill: qd %u (32 to 4096) or block %u (4 KiB multiple, "
			"<= 1 GiB) out of range\n", cfg->qd, cfg->block);
		return -EINVAL;
	}
	sp = calloc(1, sizeof *sp);
	if (!sp)
		return -ENOMEM;
	sp->cfg = *cfg;
	sp->cfg.fault = NULL;
	if (!sp->cfg.qd)
		sp->cfg.qd = 64;
	if (!sp->cfg.block)
		sp->cfg.block = 1u << 20;
	sp->wfd = sp->rfd = -1;
	for (unsigned d = 0; d < KVD_SPILL_DIRS_MAX; d++)
		sp->dirfd[d] = sp->dirf[d] = -1;
	atomic_init(&sp->disk, 0);
	atomic_init(&sp->stop, 0);
	pthread_mutex_init(&sp->lock, NULL);
	sp->pend_tail = &sp->pend;
	sp->rq_tail = &sp->rq;
	sp->wq_tail = &sp->wq;
	sp->retry_tail = &sp->retry;

	for (unsigned d = 0; d < cfg->ndirs; d++) {
		sp->dir[d] = strdup(cfg->dirs[d] ? cfg->dirs[d] : "");
		if (!sp->dir[d]) {
			rc = -ENOMEM;
			goto fail;
		}
		sp->cfg.dirs[d] = sp->dir[d];
		rc = mkdirs(sp->dir[d]);
		if (!rc) {
			sp->dirfd[d] = open(sp->dir[d], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
			rc = sp->dirfd[d] < 0 ? -errno : 0;
		}
		if (!rc)
			rc = probe_direct(sp->dirfd[d], !cfg->buffered);
		if (rc < 0) {
			fprintf(stderr, "kvd_spill: %s: %s\n", sp->dir[d], kvd_strerror(rc));
			goto fail;
		}
		sp->direct[d] = rc;
		sp->prealloc[d] = fstatfs(sp->dirfd[d], &fs) || fs.f_type != TMPFS_MAGIC;
		if (!rc && !cfg->buffered)
			kvd_log(LOG_NOTICE, "spill: %s does not take O_DIRECT; using buffered I/O",
				sp->dir[d]);
		if (rc)
			sp->st.direct_mask |= 1u << d;
	}

	unsigned nbufs = sp->cfg.qd + SP_READS + SP_WRITES + 16;

	rc = kvd_iob_create(cfg->fault, sp->cfg.qd, SP_READS + SP_WRITES + cfg->ndirs,
			    nbufs, &sp->io, msg, sizeof msg);
	if (rc && !cfg->fault) {
		/* No io_uring here (seccomp, io_uring_disabled, an old kernel's
		 * RLIMIT_MEMLOCK): the synchronous backend is slower but gives
		 * the same results. */
		kvd_log(LOG_WARNING, "spill: %s; falling back to synchronous I/O", msg);
		rc = kvd_iob_create("", sp->cfg.qd, SP_READS + SP_WRITES + cfg->ndirs, nbufs,
				    &sp->io, msg, sizeof msg);
	}
	if (rc) {
		fprintf(stderr, "kvd_spill: %s\n", msg);
		goto fail;
	}
	snprintf(sp->st.backend, sizeof sp->st.backend, "%s", kvd_iob_name(sp->io));
	for (unsigned d = 0; d < cfg->ndirs; d++)
		sp->dirf[d] = kvd_iob_file_add(sp->io, sp->dirfd[d]);
	sp->ops = calloc(sp->cfg.qd, sizeof *sp->ops);
	sp->wfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	sp->rfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (!sp->ops || sp->wfd < 0 || sp->rfd < 0) {
		rc = sp->ops ? -errno : -ENOMEM;
		fprintf(stderr, "kvd_spill: %s\n", kvd_strerror(rc));
		goto fail;
	}
	for (unsigned i = 0; i < sp->cfg.qd; i++) {
		sp->ops[i].next = sp->ofree;
		sp->ofree = &sp->ops[i];
	}
	/* Completions wake the thread through the same eventfd as new jobs. */
	rc = kvd_iob_notify(sp->io, sp->wfd);
	if (rc) {
		fprintf(stderr, "kvd_spill: io_uring_register_eventfd: %s\n", kvd_strerror(rc));
		goto fail;
	}
	/* The thread takes no signals: the daemon's handlers run on its loop. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	rc = -pthread_create(&sp->th, NULL, sp_main, sp);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		fprintf(stderr, "kvd_spill: pthread_create: %s\n", kvd_strerror(rc));
		goto fail;
	}
	pthread_setname_np(sp->th, "kvd-spill");
	*out = sp;
	return 0;
fail:
	kvd_iob_destroy(sp->io);
	for (unsigned d = 0; d < KVD_SPILL_DIRS_MAX; d++) {
		if (sp->dirfd[d] >= 0)
			close(sp->dirfd[d]);
		free(sp->dir[d]);
	}
	if (sp->wfd >= 0)
		close(sp->wfd);
	if (sp->rfd >= 0)
		close(sp->rfd);
	free(sp->ops);
	pthread_mutex_destroy(&sp->lock);
	free(sp);
	return rc;
}

__attribute__((cold))
void kvd_spill_destroy(struct kvd_spill *sp)
{
	if (!sp)
		return;
	atomic_store(&sp->stop, 1);
	wake(sp->wfd);
	pthread_join(sp->th, NULL);
	kvd_iob_destroy(sp->io);
	for (unsigned d = 0; d < sp->cfg.ndirs; d++) {
		close(sp->dirfd[d]);
		free(sp->dir[d]);
	}
	close(sp->wfd);
	close(sp->rfd);
	free(sp->ops);
	free(sp->res);
	pthread_mutex_destroy(&sp->lock);
	free(sp);
}

/* ---- start-up scan ------------------------------------------------------ */

#define SP_QUARANTINE   "quarantine"

ssize_t (*kvd_spill_scan_pread)(int fd, void *buf, size_t n, off_t off) = pread;

static int has_suffix(const char *s, const char *suf)
{
	size_t n = strlen(s), m = strlen(suf);

	return n >= m && !strcmp(s + n - m, suf);
}

/* "<16 hex digits>.kvs" followed by tail exactly (what the engine names its
 * files, "" or ".tmp"): 1 and *seq, or 0 for a name kvd never writes. */
static int our_name(const char *nm, const char *tail, uint64_t *seq)
{
	uint64_t v = 0;

	for (int i = 0; i < 16; i++) {
		int c = nm[i];
		int x = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;

		if (x < 0)
			return 0;
		v = v << 4 | (uint64_t)x;
	}
	if (strncmp(nm + 16, ".kvs", 4) || strcmp(nm + 20, tail))
		return 0;
	*seq = v;
	return 1;
}

/* Reads and checks one file's headers; 0 when complete, else -KVD_EFORMAT
 * (the file is bad) or -errno (the reading failed) with the reason in msg.
 * *hdr, *profile: malloc'd, the caller frees. */
static int scan_file(int fd, uint64_t seq, struct kvd_sfmt_hdr **hdr, unsigned *n,
		     void **profile, char *msg, size_t msglen)
{
	struct kvd_sfmt_hdr h, *hs = NULL;
	unsigned cap = 0, cnt = 0;
	char page[PAGE], m[80];
	struct stat st;
	uint64_t off = 0;
	int rc;

	*hdr = NULL;
	*profile = NULL;
	if (fstat(fd, &st) < 0) {
		snprintf(msg, msglen, "fstat: %s", strerror(errno));
		return -errno;
	}
	for (;;) {
		ssize_t got;

		if (off + PAGE > (uint64_t)st.st_size) {
			snprintf(msg, msglen, "extent %u missing (%s)", cnt,
				 cnt ? "no END" : "empty file");
			rc = -KVD_EFORMAT;
			goto out;
		}
		got = kvd_spill_scan_pread(fd, page, PAGE, (off_t)off);
		if (got != PAGE) {
			rc = got < 0 ? -errno : -KVD_EFORMAT;
			snprintf(msg, msglen, "read at %llu: %s", (unsigned long long)off,
				 got < 0 ? strerror(errno) : "short");
			goto out;
		}
		rc = kvd_sfmt_check_hdr(page, PAGE, &h, m, sizeof m);
		if (rc) {
			snprintf(msg, msglen, "extent %u: %s", cnt, m);
			goto out;
		}
		rc = -KVD_EFORMAT;
		if (cnt == 0 && (h.kind != KVD_SFMT_PROFILE || h.seq != seq)) {
			snprintf(msg, msglen, "extent 0 is not the PROFILE of seq %016llx",
				 (unsigned long long)seq);
			goto out;
		}
		if (cnt && (h.seq != hs[0].seq || h.gen != hs[0].gen || h.kind == KVD_SFMT_PROFILE)) {
			snprintf(msg, msglen, "extent %u: seq, gen or kind out of place", cnt);
			goto out;
		}
		if (h.index != cnt || off + h.extent_bytes > (uint64_t)st.st_size) {
			snprintf(msg, msglen, "extent %u: index %u, or past the end of the file", cnt,
				 h.index);
			goto out;
		}
		if (h.kind == KVD_SFMT_END && h.n != cnt) {
			snprintf(msg, msglen, "END counts %u extents, the file has %u", h.n, cnt);
			goto out;
		}
		if (cnt == cap) {
			struct kvd_sfmt_hdr *nh = realloc(hs, (cap = cap ? 2 * cap : 64) * sizeof *hs);

			if (!nh) {
				rc = -ENOMEM;
				snprintf(msg, msglen, "out of memory");
				goto out;
			}
			hs = nh;
		}
		hs[cnt++] = h;
		if (cnt == 1) {
			*profile = malloc(h.payload_bytes ? h.payload_bytes : 1);
			if (!*profile) {
				rc = -ENOMEM;
				snprintf(msg, msglen, "out of memory");
				goto out;
			}
			got = kvd_spill_scan_pread(fd, *profile, h.payload_bytes, (off_t)(off + PAGE));
			if (got < 0 || (uint64_t)got != h.payload_bytes) {
				rc = got < 0 ? -errno : -KVD_EFORMAT;
				snprintf(msg, msglen, "profile: %s", got < 0 ? strerror(errno) : "short");
				goto out;
			}
			rc = kvd_sfmt_check_payload(&h, *profile, m, sizeof m);
			if (rc) {
				snprintf(msg, msglen, "profile: %s", m);
				goto out;
			}
		}
		off += h.extent_bytes;
		if (h.kind == KVD_SFMT_END)
			break;
	}
	rc = 0;
	*n = cnt;
out:
	*hdr = hs;
	return rc;
}

/* Moves a bad file into <dir>/quarantine/ (0700, made on first use) rather
 * than deleting it: a header that fails its checks may be one flipped bit in
 * hours of prefill, or a kvd bug, and either way an operator wants to see it.
 * A name already there gets ".1", ".2"... so nothing quarantined is lost.
 * If the move fails the file stays where it is, to be judged again next
 * start. */
static void quarantine(struct kvd_spill *sp, unsigned d, const char *nm, const char *why)
{
	int dfd = sp->dirfd[d];
	char to[sizeof SP_QUARANTINE + 256 + 8];
	struct stat st;
	int rc = 0;

	if (mkdirat(dfd, SP_QUARANTINE, 0700) < 0 && errno != EEXIST)
		rc = -errno;
	for (unsigned i = 0; !rc; i++) {
		if (i == 0)
			snprintf(to, sizeof to, SP_QUARANTINE "/%s", nm);
		else
			snprintf(to, sizeof to, SP_QUARANTINE "/%s.%u", nm, i);
		if (fstatat(dfd, to, &st, AT_SYMLINK_NOFOLLOW) < 0) {
			rc = errno == ENOENT ? 0 : -errno;
			break;
		}
		if (i == 1000)
			rc = -EEXIST;
	}
	if (!rc && renameat(dfd, nm, dfd, to) < 0)
		rc = -errno;
	if (rc)
		kvd_log(LOG_WARNING, "spill: %s/%s: %s; cannot move it to %s/: %s, left in place",
			sp->dir[d], nm, why, SP_QUARANTINE, strerror(-rc));
	else
		kvd_log(LOG_WARNING, "spill: %s/%s: %s; moved to %s/%s", sp->dir[d], nm, why,
			sp->dir[d], to);
}

/* One file of directory d: read its headers, hand them to fn, act on its
 * answer (kvd_spill_scan's rules).  0 when the file was kept. */
static int scan_one(struct kvd_spill *sp, unsigned d, const char *nm, uint64_t seq,
		    kvd_spill_scan_fn fn, void *arg)
{
	int dfd = sp->dirfd[d];
	struct kvd_sfmt_hdr *hdr;
	void *profile;
	char msg[160];
	unsigned n = 0;
	int fd, rc;

	fd = openat(dfd, nm, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		rc = -errno;
		kvd_log(LOG_WARNING, "spill: %s/%s: %s; left alone", sp->dir[d], nm, strerror(errno));
		return rc;
	}
	rc = scan_file(fd, seq, &hdr, &n, &profile, msg, sizeof msg);
	if (rc == 0) {
		struct stat st;
		uint64_t bytes = fstat(fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;

		rc = fn ? fn(arg, d, hdr, n, profile, hdr[0].payload_bytes, bytes) : 0;
		if (rc == 0) {
			atomic_fetch_add(&sp->disk, bytes);
		} else if (rc > 0) {
			unlinkat(dfd, nm, 0);
		} else if (rc <= -KVD_EBASE) {
			quarantine(sp, d, nm, "refused at load");
		} else {
			kvd_log(LOG_WARNING, "spill: %s/%s: load: %s; left in place, "
				"not loaded this run", sp->dir[d], nm, kvd_strerror(rc));
		}
	} else if (rc <= -KVD_EBASE) {
		/* The bytes themselves are wrong: reading it again will not
		 * help. */
		quarantine(sp, d, nm, msg);
	} else {
		/* EIO, ENOMEM, EINTR...: the disk or the machine had a bad
		 * moment; the file may be fine.  It stays for the next start,
		 * unknown to the engine until then. */
		kvd_log(LOG_WARNING, "spill: %s/%s: %s; left in place, not loaded this run",
			sp->dir[d], nm, msg);
	}
	free(hdr);
	free(profile);
	close(fd);
	return rc ? (rc > 0 ? -ENOENT : rc) : 0;
}

int kvd_spill_scan_one(struct kvd_spill *sp, unsigned dir, uint64_t seq, kvd_spill_scan_fn fn,
		       void *arg)
{
	char nm[32];

	if (dir >= sp->cfg.ndirs)
		return -EINVAL;
	snprintf(nm, sizeof nm, "%016llx.kvs", (unsigned long long)seq);
	return scan_one(sp, dir, nm, seq, fn, arg);
}

const char *kvd_spill_dir(const struct kvd_spill *sp, unsigned dir)
{
	return dir < sp->cfg.ndirs ? sp->dir[dir] : NULL;
}

int kvd_spill_scan(struct kvd_spill *sp, int keep, kvd_spill_scan_fn fn, void *arg)
{
	int kept = 0;

	for (unsigned d = 0; d < sp->cfg.ndirs; d++) {
		int dfd = sp->dirfd[d], lfd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		DIR *dp = lfd >= 0 ? fdopendir(lfd) : NULL;
		struct dirent *de;

		if (!dp) {
			int rc = -errno;

			if (lfd >= 0)
				close(lfd);
			return rc;
		}
		/* Only names the engine writes are touched; quarantine/ and
		 * anything else in the directory is left alone in both modes. */
		while ((de = readdir(dp))) {
			const char *nm = de->d_name;
			uint64_t seq;

			/* A writer that died before its rename: never a complete
			 * file, so nothing to keep (likewise create's probe). */
			if (our_name(nm, ".tmp", &seq) || !strcmp(nm, ".kvd-probe.tmp")) {
				unlinkat(dfd, nm, 0);
				continue;
			}
			if (!our_name(nm, "", &seq)) {
				if (has_suffix(nm, ".kvs"))
					kvd_log(LOG_NOTICE, "spill: %s/%s: not a spill file name; left alone",
						sp->dir[d], nm);
				continue;
			}
			if (!keep) {
				unlinkat(dfd, nm, 0);
				continue;
			}
			if (scan_one(sp, d, nm, seq, fn, arg) == 0)
				kept++;
		}
		closedir(dp);
	}
	return kept;
}
