/* kvd_spill: the spill engine.  Writes sequences' files to NVMe and reads
 * them back, on a thread of its own, so the event loop keeps serving while
 * gigabytes move.
 *
 * The loop submits jobs; the engine posts results to a queue and makes
 * kvd_spill_fd() readable.  Every buffer a job names belongs to the engine
 * from kvd_spill_submit() until the job's final result has been reaped, also
 * after kvd_spill_cancel(): no buffer is freed while an SQE may still
 * reference it.
 *
 * I/O: io_uring (liburing) with registered buffers (the job's extents are
 * registered while the job runs) and registered files, O_DIRECT where the
 * file system accepts it (buffered otherwise, decided per directory at
 * create), extents split into `block`-sized operations with up to `qd` in
 * flight, every CQE reaped even after an error, short transfers completed,
 * -EAGAIN/-EINTR retried.  With cfg.fault set, a fake backend replaces
 * io_uring: the same engine over synchronous pread/pwrite that injects the
 * faults listed (tests only).
 *
 * Files: <dir>/<seq as 16 hex digits>.kvs.  A WRITE goes to
 * <name>.kvs.tmp, fdatasync()s it, renames it over <name>.kvs and fsync()s the
 * directory: a file is under its final name only once it is durable.  A
 * failed fsync is final: the file is deleted and the job fails -EIO (never
 * retried and trusted).  A WRITE that would take the bytes on disk of all
 * directories (st_blocks, not file sizes) over cfg.limit fails -ENOSPC
 * before writing anything.
 *
 * A READ reads the extents in file order, checks each (kvd_sfmt_check_hdr
 * against the expected seq/gen/index/size, kvd_sfmt_check_payload) on the
 * engine thread, and posts a progress result for each verified extent in
 * order, so layer 0 can be served before the last layer lands.
 *
 * Jobs run concurrently (up to 8 READ/UNLINK and 4 WRITE; more wait in
 * order), READs ahead of WRITEs.  Jobs naming the same seq must not overlap:
 * submit the next once the previous one's final result is reaped.  The
 * engine thread never blocks on the disk (opens, fallocate, fsyncs, rename
 * and unlink go through the ring too).
 */
#ifndef KVD_SPILL_H
#define KVD_SPILL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "sfmt.h"

#define KVD_SPILL_DIRS_MAX 16

struct kvd_spill_cfg {
	const char *dirs[KVD_SPILL_DIRS_MAX];
	unsigned ndirs;
	uint64_t limit;                 /* bytes on disk over all dirs; 0: none */
	unsigned qd;                    /* operations in flight; >= 32 (0: 64) */
	uint32_t block;                 /* bytes per operation, multiple of 4096 (0: 1 MiB) */
	int buffered;                   /* 1: never O_DIRECT */
	const char *fault;              /* NULL: io_uring.  Else the fake backend and
					 * its faults, e.g. "" (none) or
					 * "enospc@2,eio-read@0,short@*,torn@1,corrupt@3,fsync@0":
					 * kind@N hits the N-th (from 0) operation of that
					 * kind, kind@* every one.  Kinds: enospc, eio-write
					 * (writes), eio-read, corrupt (one byte flipped after a
					 * read), short (reads and writes move half, the engine
					 * must finish), torn (a write reports success but puts
					 * only its first half on disk), fsync (fdatasync fails
					 * EIO). */
};

enum kvd_spill_op { KVD_SPILL_WRITE = 1, KVD_SPILL_READ, KVD_SPILL_UNLINK };

struct kvd_spill_buf {
	void *p;                        /* 4096-aligned: header page, then payload */
	uint64_t bytes;                 /* extent_bytes: a multiple of 4096 */
	/* WRITE, optional: called on the engine's thread, before the extent is
	 * sealed, to write its payload: the copy a caller would otherwise make
	 * under its own lock.  fill_arg stays valid until the result is
	 * reaped. */
	void (*fill)(void *fill_arg, void *payload);
	/* WRITE with fill, optional: the extent's header page, kept elsewhere
	 * until the engine copies it to p just before the fill, so that the
	 * caller need not touch p at all (a fresh buffer's first page fault). */
	const void *hdr;
	/* READ, optional: called on the engine's thread once the extent
	 * verified (header and CRC), before its progress is posted, with the
	 * header page: the copy out of it a caller would otherwise make under
	 * its own lock.  Gets fill_arg. */
	void (*drain)(void *fill_arg, void *page);
	void *fill_arg;
};

struct kvd_spill_job {
	/* in */
	int op;                         /* enum kvd_spill_op */
	uint64_t seq, gen;
	unsigned dir;                   /* READ, UNLINK: where the file is */
	struct kvd_spill_buf *ext;      /* WRITE: the extents in file order, headers
					 * filled but not sealed (the engine seals them:
					 * CRCs on its thread).  READ: one buffer per
					 * extent, sized from the headers */
	unsigned next;                  /* WRITE, READ: extents in ext */
	void *user;
	/* out, valid when reaped */
	int res;                        /* 0, -ENOSPC, -EIO, -KVD_ELOST (READ: an extent
					 * that does not verify), -ECANCELED, -errno */
	unsigned done;                  /* READ: extents verified (set with the final
					 * result; progress results carry `ext`) */
	unsigned wdir;                  /* WRITE: the directory it went to */
	uint64_t disk_bytes;            /* WRITE: the file's bytes on disk */
	char msg[96];                   /* why, when res < 0 */
};

struct kvd_spill;

/* Checks every directory (creates it if missing, probes O_DIRECT), starts the
 * thread.  0 or -errno with a message on stderr. */
int kvd_spill_create(const struct kvd_spill_cfg *cfg, struct kvd_spill **out);
/* Cancels what is queued, waits for what is in flight, stops the thread.
 * Results not reaped are dropped. */
void kvd_spill_destroy(struct kvd_spill *sp);

/* An eventfd, readable while results wait to be reaped. */
int kvd_spill_fd(const struct kvd_spill *sp);

/* Queues a job; 0, -EINVAL (malformed job: j->msg says why) or -ENOMEM.
 * A WRITE's headers must carry the job's seq and gen, index i in ext[i], and
 * a payload_bytes that makes ext[i].bytes. */
int kvd_spill_submit(struct kvd_spill *sp, struct kvd_spill_job *j);
/* Asks a queued or running job to stop; it still posts its final result
 * (res -ECANCELED unless it finished first), after every operation it had in
 * flight completed and, for a WRITE, its file was deleted.  A job that
 * already ended, or is unknown, is left alone. */
void kvd_spill_cancel(struct kvd_spill *sp, struct kvd_spill_job *j);

struct kvd_spill_result {
	struct kvd_spill_job *job;
	int final;                      /* 0: READ progress, extent `ext` verified */
	unsigned ext;
};
/* Up to max results, oldest first; never blocks.  Progress results of a job
 * come in extent order and before its final result. */
unsigned kvd_spill_reap(struct kvd_spill *sp, struct kvd_spill_result *out, unsigned max);

/* Bytes on disk of the complete files the engine knows of. */
uint64_t kvd_spill_disk_bytes(const struct kvd_spill *sp);
/* A file of `bytes` that someone else put in a directory (the remote tier's
 * fetch) is now the engine's to count, as if it had written it. */
void kvd_spill_disk_add(struct kvd_spill *sp, uint64_t bytes);

/* Counters since create, as of the latest result posted. */
struct kvd_spill_stats {
	uint64_t reads, writes, fsyncs;         /* operations issued (fsyncs: files and dirs) */
	uint64_t short_ops, retries;            /* short transfers finished, -EAGAIN/-EINTR */
	uint64_t bufs_fixed, bufs_plain;        /* extents registered / not (RLIMIT_MEMLOCK..) */
	uint64_t files_fixed, files_plain;
	uint64_t faults;                        /* fake backend: faults injected */
	uint32_t direct_mask;                   /* bit d: directory d uses O_DIRECT */
	char backend[16];                       /* "io_uring", or "fake" */
};
void kvd_spill_stats(struct kvd_spill *sp, struct kvd_spill_stats *out);

/* Start-up, before any job: lists the directories and judges each file by
 * its name.  Only names the engine writes are touched; anything else,
 * quarantine/ included, is left alone (a "*.kvs" name that is not ours gets a
 * log line).
 *  - <seq>.kvs.tmp (a writer that died before its rename, so never a complete
 *    file) is deleted, in both modes.
 *  - keep = 0 (no --persist): every <seq>.kvs is deleted too.
 *  - keep = 1: each <seq>.kvs file's headers are read and checked
 *    (kvd_sfmt_check_hdr, one seq and gen, indices in order, ending in END;
 *    the PROFILE extent's payload too).  fn gets the complete ones (hdr[0] is
 *    the PROFILE extent's header: profile, profile_bytes; hdr and profile
 *    live for the call only).  A file that fails a check (bad magic, CRC,
 *    header, truncated: a -KVD_E* code) is moved to <dir>/quarantine/ (0700,
 *    made when first needed; a name already there gets ".N"), never deleted:
 *    if the move fails it stays where it is.  A file whose reading failed
 *    (-errno: EIO, ENOMEM, EINTR...) stays where it is, is skipped for this
 *    run and not counted, and is judged again at the next start.  Each case
 *    logs one line naming the file and the reason.
 * fn's return: 0 keeps the file (the engine counts it toward its bytes on
 * disk); > 0 deletes it; a -KVD_E* code quarantines it (the file is bad);
 * another negative (-ENOMEM...) leaves it in place, skipped this run.
 * Returns the number of files kept, or -errno when a directory cannot be
 * listed. */
typedef int (*kvd_spill_scan_fn)(void *arg, unsigned dir, const struct kvd_sfmt_hdr *hdr,
				 unsigned n, const void *profile, uint64_t profile_bytes,
				 uint64_t disk_bytes);
int kvd_spill_scan(struct kvd_spill *sp, int keep, kvd_spill_scan_fn fn, void *arg);

/* kvd_spill_scan for one file, <dir>/<seq>.kvs, put there by someone else
 * (the remote tier): 0 when fn kept it, else negative (the file was
 * deleted, quarantined or left, by fn's answer as above). */
int kvd_spill_scan_one(struct kvd_spill *sp, unsigned dir, uint64_t seq, kvd_spill_scan_fn fn,
		       void *arg);
/* The path of spill directory dir, or NULL. */
const char *kvd_spill_dir(const struct kvd_spill *sp, unsigned dir);

/* Tests only: what kvd_spill_scan reads with (pread by default), so a test
 * can fail a read the way a disk does; the scan reads synchronously, outside
 * the fake backend.  Set it only while no scan runs. */
extern ssize_t (*kvd_spill_scan_pread)(int fd, void *buf, size_t n, off_t off);

#endif
