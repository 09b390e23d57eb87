/* kvd_iob: asynchronous file I/O for the spill engine, with two backends
 * behind one small interface.
 *
 *   uring  io_uring (liburing): a ring of `qd` entries, a sparse table of
 *          registered files and one of registered buffers.  A file or
 *          buffer that cannot be registered (no slot left, RLIMIT_MEMLOCK,
 *          memory the kernel will not pin) is used unregistered: the caller
 *          gets a handle either way and only the counters tell the
 *          difference.
 *   fake   the same operations done synchronously with pread / pwrite /
 *          fdatasync on the real fds, each completing at once into the
 *          completion queue, with faults injected from a spec (grammar in
 *          kvd_iob_fault_parse).  For tests.
 *
 * The caller queues operations (kvd_iob_read / _write / _fsync), pushes them
 * with kvd_iob_submit() and collects completions with kvd_iob_reap(), which
 * never blocks.  It keeps at most `qd` operations outstanding (queued but not
 * reaped); the completion queue is sized so that it can never overflow then.
 * A completion carries the caller's user word and res as the kernel gives
 * it: bytes moved (possibly short) or -errno; finishing short transfers and
 * retrying is the caller's business.  With kvd_iob_notify(), an eventfd is
 * signalled for every completion, so the caller can sleep on it.
 *
 * A buffer or file must stay valid, and registered, until every operation
 * that names it has been reaped.  Not thread-safe: one thread owns a kvd_iob.
 */
#ifndef KVD_IOB_H
#define KVD_IOB_H

#include <stddef.h>
#include <stdint.h>

struct kvd_iob;

struct kvd_iob_cqe {
	uint64_t user;
	int res;                        /* bytes moved, or -errno */
};

/* Counters since create. */
struct kvd_iob_stats {
	uint64_t reads, writes, fsyncs;         /* operations queued */
	uint64_t meta;                          /* fallocate, openat, renameat, unlinkat */
	uint64_t bufs_fixed, bufs_plain;        /* kvd_iob_buf_add: registered / not */
	uint64_t files_fixed, files_plain;      /* kvd_iob_file_add: registered / not */
	uint64_t faults;                        /* fake: faults injected */
	int buf_err;                            /* the last registration error (-errno) */
};

/* fault == NULL: io_uring.  Else the fake backend with the faults of the spec
 * (see kvd_iob_fault_parse; "" for none).  nfiles, nbufs: table sizes.
 * 0 or -errno (-EINVAL for a bad spec), with a reason in msg. */
int kvd_iob_create(const char *fault, unsigned qd, unsigned nfiles, unsigned nbufs,
		   struct kvd_iob **out, char *msg, size_t msglen);
void kvd_iob_destroy(struct kvd_iob *io);
const char *kvd_iob_name(const struct kvd_iob *io);     /* "io_uring" or "fake" */

/* Checks a fault spec: comma-separated kind@N (the N-th operation of that
 * kind, from 0) or kind@* (every one).  Kinds and the operations they count:
 *   enospc, eio-write, torn   writes (torn: reports success, writes half)
 *   eio-read, corrupt         reads (corrupt: flips a byte after reading)
 *   short                     reads and writes (moves half)
 *   fsync                     fsyncs (fails -EIO, syncs nothing)
 * 0 or -EINVAL with the reason in msg. */
int kvd_iob_fault_parse(const char *spec, char *msg, size_t msglen);

/* Signal eventfd efd for every completion from now on (-1: stop).  0 or -errno. */
int kvd_iob_notify(struct kvd_iob *io, int efd);

/* A handle for fd (not owned: close it after kvd_iob_file_del), or -EMFILE
 * when the table is full. */
int kvd_iob_file_add(struct kvd_iob *io, int fd);
void kvd_iob_file_del(struct kvd_iob *io, int f);

/* A handle >= 0 for a registered buffer, or -1: use it unregistered (pass -1
 * as b).  Never fails otherwise. */
int kvd_iob_buf_add(struct kvd_iob *io, void *p, size_t len);
void kvd_iob_buf_del(struct kvd_iob *io, int b);

/* Queue one operation on file handle f, with buffer handle b (or -1) that
 * covers [p, p + len).  0, or -EBUSY when `qd` operations are outstanding. */
int kvd_iob_read(struct kvd_iob *io, int f, int b, void *p, uint32_t len, uint64_t off,
		 uint64_t user);
int kvd_iob_write(struct kvd_iob *io, int f, int b, const void *p, uint32_t len, uint64_t off,
		  uint64_t user);
int kvd_iob_fsync(struct kvd_iob *io, int f, int datasync, uint64_t user);
/* fallocate(mode 0) of [0, len) on file handle f: 0 or -errno. */
int kvd_iob_fallocate(struct kvd_iob *io, int f, uint64_t len, uint64_t user);
/* Metadata through the ring, so the caller never sleeps on a journal: dfd is
 * a plain directory fd, paths stay valid until the completion is reaped.
 * openat completes with the new fd (or -errno), the others with 0. */
int kvd_iob_openat(struct kvd_iob *io, int dfd, const char *path, int flags, unsigned mode,
		   uint64_t user);
int kvd_iob_renameat(struct kvd_iob *io, int dfd, const char *from, const char *to,
		     uint64_t user);
int kvd_iob_unlinkat(struct kvd_iob *io, int dfd, const char *path, uint64_t user);

/* Hands what is queued to the kernel.  0 or -errno. */
int kvd_iob_submit(struct kvd_iob *io);
/* Up to max completions; never blocks. */
unsigned kvd_iob_reap(struct kvd_iob *io, struct kvd_iob_cqe *out, unsigned max);

void kvd_iob_stats(const struct kvd_iob *io, struct kvd_iob_stats *out);

#endif
