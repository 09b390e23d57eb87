/* kvd_config: the daemon's settings, from an INI file (libinih) and the
 * command line.  Used by kvd/main.c only, before any thread starts (getopt
 * state is global).
 *
 * Precedence, lowest first: built-in defaults (kvd_config_defaults), then
 * the file named by --config (no file is read without it), then every other
 * flag, wherever it stands on the command line relative to --config.
 *
 * The file (systemd/kvd.conf is the commented example):
 *
 *   [server]     socket = PATH         --socket PATH     (< 108 bytes)
 *                threads = N           --threads N       (0: one per online CPU; <= 1024)
 *                admin_group = GROUP                     (name or gid: its members see
 *                                                         and manage every uid; none)
 *   [memory]     limit = SIZE | N%     --mem-limit SIZE  (0: unlimited; else >= 1 MiB)
 *                high = N%             --mem-high N%     (of limit: start spilling; 90%)
 *                low = N%              --mem-low N%      (of limit: spill down to; 80%)
 *   [spill]      dir = PATH[:PATH...]  --spill-dir PATH  (repeatable; none: no spill)
 *                limit = SIZE          --spill-limit SIZE (bytes on disk; 0: no cap)
 *                queue_depth = N                         (io_uring ops in flight, 32..4096)
 *                block = SIZE                            (bytes per op, 4K multiple <= 64M)
 *                direct = yes|no                         (O_DIRECT where the fs allows)
 *                persist = yes|no      --persist         (keep files, reload at start)
 *                fault = SPEC          --spill-fault SPEC (tests: fake I/O backend)
 *   [transport]  slots = N                               (default arena slots per client)
 *                slot_size = SIZE                        (bytes per slot)
 *                ring_entries = N                        (SQ entries: power of two)
 *                spin_us = N                             (spin before sleeping, <= 1 s)
 *   [limits]     connections = N                         (clients at once; 1024)
 *                connections_per_uid = N                 (of one uid; 256)
 *                sequences = N                           (all uids; 65536)
 *                sequences_per_uid = N                   (16384)
 *                profiles = N                            (all namespaces; 256)
 *                profiles_per_uid = N                    (created by one uid; 16)
 *                memory_per_uid = SIZE | N%              (N% of [memory] limit; 100%)
 *                spill_per_uid = SIZE | N%               (N% of [spill] limit; 100%)
 *                remote_per_uid = SIZE | N%              (N% of [remote] limit; 100%)
 *                shm = SIZE                              (all clients' shared memory; 64G)
 *                shm_per_uid = SIZE                      (of one uid's connections; 16G)
 *                control_cpu_per_uid = N%                (of one core: a uid's control
 *                                                          requests on kvd's loop; 50%)
 *   [sharing]    groups = UID,UID[,...] [UID,UID ...]    (uids sharing profiles; none)
 *   [remote]     seeds = HOST:PORT[,HOST:PORT...]        (a Redis Cluster; none: no
 *                                                          remote tier; needs [spill] dir)
 *                prefix = NAME                           (of every key; "kvd")
 *                connect_timeout_ms = N                  (500)
 *                timeout_ms = N                          (per reply; 2000)
 *                retry_ms = N                            (failover waits; 5000)
 *                replicas = N                            (WAIT for N replicas; 0)
 *                wait_timeout_ms = N                     (1000)
 *                chunk = SIZE                            (bytes per value; 4M)
 *                limit = SIZE                            (bytes of evicted sequences'
 *                                                          copies; 0: no cap)
 *                evicted = BOOL                          (evicted sequences' files go
 *                                                          there too, and local files
 *                                                          of those make spill room; no)
 *   [metrics]    listen = HOST:PORT    --metrics-listen ADDR (Prometheus text at
 *                                                          http://ADDR/metrics; "" = off;
 *                                                          default 127.0.0.1:9464; IPv6
 *                                                          as [::1]:9464)
 *                request_timeout_ms = N                  (an HTTP connection's life
 *                                                          from accept, whatever the
 *                                                          peer sends; 100..600000;
 *                                                          10000)
 *   [log]        level = error|warning|notice|info|debug   --log-level LEVEL
 *                file = PATH           --log-file PATH   (absolute; "" = stderr;
 *                                                          SIGHUP reopens it)
 *
 * SIZE is a decimal number with an optional binary suffix K, M, G, T (also
 * KiB, MiB, GiB, TiB; lower case accepted).  N% is a whole percentage
 * (1..100) of physical memory, resolved when parsed ([memory] limit), or of
 * the global limit, resolved at use (memory_per_uid, spill_per_uid).
 * Counts are 1..KVD_CONFIG_COUNT_MAX; a per-uid value above its global one
 * is an error.  Every value is
 * checked: a number is digits only, every range is enforced, an unknown
 * section or key, a key outside a section, a key given twice and a line
 * longer than the parser's limit are errors.  Messages name file:line (or the
 * flag), the key and the value.  On error the struct is left unchanged.
 */
#ifndef KVD_CONFIG_H
#define KVD_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "kvd/store/uidlimits.h"

#define KVD_CONFIG_SPILL_DIRS   16      /* == KVD_SPILL_DIRS_MAX */

struct kvd_config {
	char socket_path[108];          /* sizeof(sun_path); default /run/kvd/kvd.sock */
	int admin_group;                /* [server] admin_group set: admin_gid is valid */
	uint32_t admin_gid;
	unsigned threads;               /* 0: one worker per online CPU */
	uint64_t mem_limit;             /* bytes; 0: unlimited.  Default 75% of RAM */
	int foreground;                 /* --foreground: kvd never forks anyway; kept for scripts */
	char config_path[4096];         /* the file loaded, "" for none */
	int log_level;                  /* syslog's LOG_ERR .. LOG_DEBUG; default LOG_INFO */
	char log_path[4096];            /* "" : stderr as it is */
	uint32_t slots;                 /* per client when Hello asks for 0; default 16 */
	uint64_t slot_size;             /* per client when Hello asks for 0; default 4 MiB */
	uint32_t sq_entries;            /* default 256 */
	uint64_t spin_ns;               /* default 50 us */
	uint32_t mem_high, mem_low;     /* % of mem_limit; default 90, 80 */
	char spill_dir[KVD_CONFIG_SPILL_DIRS][256];
	unsigned spill_ndirs;
	uint64_t spill_limit;           /* bytes on disk; 0: no cap */
	uint32_t spill_qd;              /* default 64 */
	uint32_t spill_block;           /* default 1 MiB */
	int spill_buffered;             /* direct = no */
	int persist;
	int spill_fault_on;             /* spill_fault names the fake backend's faults */
	char spill_fault[256];
	/* [limits] */
	uint32_t connections, connections_per_uid;
	uint32_t sequences, sequences_per_uid;
	uint32_t profiles, profiles_per_uid;
	uint64_t memory_per_uid;        /* bytes, when memory_per_uid_pct is 0 */
	uint32_t memory_per_uid_pct;    /* % of mem_limit; default 100 */
	uint64_t spill_per_uid;         /* bytes, when spill_per_uid_pct is 0 */
	uint32_t spill_per_uid_pct;     /* % of spill_limit; default 100 */
	uint64_t shm, shm_per_uid;      /* bytes of clients' shared-memory regions */
	uint32_t control_cpu_pct;       /* % of one core per uid on the loop; default 50 */
	/* [sharing] groups: share_uid[i] is in group share_group[i] */
	uint32_t share_uid[KVD_LIMITS_SHARE_MAX];
	uint32_t share_group[KVD_LIMITS_SHARE_MAX];
	unsigned nshare, ngroups;
	/* [metrics] listen: "HOST:PORT" of the Prometheus endpoint, "" off */
	char metrics_listen[64];
	uint32_t metrics_request_ms;    /* [metrics] request_timeout_ms; default 10000 */
	char remote_seeds[512];         /* [remote] seeds; "": no remote tier */
	char remote_prefix[64];         /* default "kvd" */
	uint32_t remote_connect_ms;     /* default 500 */
	uint32_t remote_timeout_ms;     /* per reply; default 2000 */
	uint32_t remote_retry_ms;       /* failover; default 5000 */
	uint32_t remote_replicas;       /* WAIT for; default 0 */
	uint32_t remote_wait_ms;        /* default 1000 */
	uint32_t remote_chunk;          /* bytes per value; default 4 MiB */
	int remote_evicted;             /* [remote] evicted; default 0 */
	uint64_t remote_limit;          /* [remote] limit: bytes of those copies; 0: no cap */
	uint64_t remote_per_uid;        /* bytes, when remote_per_uid_pct is 0 */
	uint32_t remote_per_uid_pct;    /* % of remote_limit; default 100 */
	int metrics_listen_set;         /* given by the file or a flag, not the default */
};

#define KVD_CONFIG_SOCKET       "/run/kvd/kvd.sock"
#define KVD_CONFIG_METRICS      "127.0.0.1:9464"
#define KVD_CONFIG_THREADS_MAX  1024u
#define KVD_CONFIG_MEM_MIN      (1ull << 20)    /* smaller non-zero limits are typos */
#define KVD_CONFIG_RING_MIN     16u
#define KVD_CONFIG_RING_MAX     65536u
#define KVD_CONFIG_SPIN_US_MAX  1000000u
#define KVD_CONFIG_COUNT_MAX    16777216u       /* [limits] counts */

/* kvd_config_parse_args() returns this for --help: print kvd_config_usage()
 * and exit 0. */
#define KVD_CONFIG_HELP 1

/* The defaults above.  mem_limit is 75% of physical memory: kvd's memory
 * grows with its clients' contexts, and a daemon that takes the whole
 * machine gets OOM-killed along with its clients. */
void kvd_config_defaults(struct kvd_config *c);

/* Applies the INI file at path on top of *c and records it in
 * c->config_path.  0, or -errno (the file cannot be read) / -EINVAL (a bad
 * line or value) with a message in err[0..errlen). */
int kvd_config_load_file(struct kvd_config *c, const char *path, char *err, size_t errlen);

/* Parses argv (argv[0] is the program) on top of *c: --config first (the
 * file is loaded), then the other flags.  Flags: --socket PATH, --threads N,
 * --mem-limit SIZE, --log-level LEVEL, --foreground (-f), --config PATH (-c),
 * --help (-h).  Positional arguments are refused.  0, KVD_CONFIG_HELP, or
 * -errno / -EINVAL with a message in err. */
int kvd_config_parse_args(struct kvd_config *c, int argc, char **argv, char *err,
			  size_t errlen);

/* The cross-field checks (the arena of slots x slot_size), which
 * load_file and parse_args also run.  0 or -EINVAL with a message. */
int kvd_config_check(const struct kvd_config *c, char *err, size_t errlen);

void kvd_config_usage(FILE *f, const char *argv0);

/* memory_per_uid / spill_per_uid in bytes (a percentage resolved against
 * the global limit); 0: no per-uid cap. */
uint64_t kvd_config_memory_per_uid(const struct kvd_config *c);
uint64_t kvd_config_spill_per_uid(const struct kvd_config *c);
uint64_t kvd_config_remote_per_uid(const struct kvd_config *c);
/* The caps and sharing groups for kvd_limits_create(): counts from
 * [limits], memory from [memory] limit and memory_per_uid, spill from
 * [spill] limit and spill_per_uid. */
void kvd_config_limits(const struct kvd_config *c, struct kvd_limits_cfg *out);
/* The profile namespace of uid: uid itself when it is in no [sharing]
 * group; KVD_NS_GROUP | i (0x80000000 + i) for the i-th group (0-based, in
 * file order); KVD_NS_NONE for a uid >= 0x80000000 in no group (Linux
 * tools never allocate those; see uidlimits.h).  Group values cannot collide
 * with a real uid's namespace because groups refuse such uids. */
uint32_t kvd_config_namespace(const struct kvd_config *c, uint32_t uid);

/* "info" for LOG_INFO, ...; "?" for anything else. */
const char *kvd_config_level_name(int level);

#endif
