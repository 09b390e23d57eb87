/* kvd: the daemon.  Configuration from a file and flags (kvd/config.h),
 * then the server's event loop until SIGTERM. */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>

#include "config.h"
#include "engine/err.h"
#include "engine/log.h"
#include "server.h"

int main(int argc, char **argv)
{
	struct kvd_config cfg;
	struct kvd_server *s;
	char err[512];
	int rc;

	/* Blocks from 128 KiB up (staging, tails, small segments, write-back
	 * copies) are mappings of their own, given back to the kernel when
	 * freed.  glibc's default raises that threshold to the largest block
	 * freed so far (up to 32 MiB), and later blocks of that size come from
	 * an arena that keeps their pages after free: 22 segments built under
	 * a 48 MiB budget then held 22 MiB more than they were charged.  Set
	 * before any thread exists; a sanitizer's allocator ignores it. */
	mallopt(M_MMAP_THRESHOLD, 128 << 10);
	kvd_config_defaults(&cfg);
	rc = kvd_config_parse_args(&cfg, argc, argv, err, sizeof err);
	if (rc == KVD_CONFIG_HELP) {
		kvd_config_usage(stdout, argv[0]);
		return 0;
	}
	if (rc < 0) {
		fprintf(stderr, "kvd: %s\n", err);
		return 2;
	}
	kvd_log_level(cfg.log_level);
	if (cfg.log_path[0] && (rc = kvd_log_open(cfg.log_path))) {
		fprintf(stderr, "kvd: cannot open log file %s: %s\n", cfg.log_path, kvd_strerror(rc));
		return 1;
	}
	rc = kvd_server_create(&cfg, &s);
	if (rc) {
		kvd_log(LOG_ERR, "cannot start: %s", kvd_strerror(rc));
		return 1;
	}
	rc = kvd_server_run(s);
	kvd_server_destroy(s);
	return rc ? 1 : 0;
}
