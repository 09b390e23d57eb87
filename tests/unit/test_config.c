/* kvd_config: defaults, a good file, every bad key and value (the message
 * must name the file, the line and the key), size suffixes, flags over the
 * file, bad flags.  A refused file or command line changes nothing. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/config.h"

static char dir[64];
static char path[128];

static uint64_t phys(void)
{
	return (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
}

static const char *write_conf(const char *text)
{
	FILE *f;

	snprintf(path, sizeof(path), "%s/kvd.conf", dir);
	f = fopen(path, "w");
	assert_non_null(f);
	fputs(text, f);
	fclose(f);
	return path;
}

static int setup(void **state)
{
	(void)state;
	snprintf(dir, sizeof(dir), "/tmp/kvd-test-config-XXXXXX");
	return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	unlink(path);
	rmdir(dir);
	return 0;
}

static void test_defaults(void **state)
{
	struct kvd_config c;
	char err[256];

	kvd_config_defaults(&c);
	assert_string_equal(c.socket_path, "/run/kvd/kvd.sock");
	assert_int_equal(c.threads, 0);
	assert_int_equal(c.mem_limit, phys() / 100 * 75);
	assert_int_equal(c.foreground, 0);
	assert_string_equal(c.config_path, "");
	assert_int_equal(c.log_level, LOG_INFO);
	assert_int_equal(c.slots, 16);
	assert_int_equal(c.slot_size, 4 << 20);
	assert_int_equal(c.sq_entries, 256);
	assert_int_equal(c.spin_ns, 50000);
	assert_int_equal(kvd_config_check(&c, err, sizeof(err)), 0);
	assert_string_equal(kvd_config_level_name(c.log_level), "info");
	assert_string_equal(kvd_config_level_name(99), "?");
}

static void test_good_file(void **state)
{
	struct kvd_config c;
	char err[256] = "";

	kvd_config_defaults(&c);
	write_conf("\xEF\xBB\xBF# kvd test config\n"
		   "; another comment\n"
		   "\n"
		   "[server]\n"
		   "  socket = /tmp/kvd-test.sock\n"
		   "\tthreads = 6   ; inline comment\n"
		   "[memory]\n"
		   "limit = 3G\n"
		   "[transport]\n"
		   "slots=8\n"
		   "slot_size = 16MiB\n"
		   "ring_entries = 1024\n"
		   "spin_us = 0\n"
		   "[log]\n"
		   "level = debug\n");
	if (kvd_config_load_file(&c, path, err, sizeof(err)))
		print_error("%s\n", err);
	assert_string_equal(c.socket_path, "/tmp/kvd-test.sock");
	assert_int_equal(c.threads, 6);
	assert_int_equal(c.mem_limit, 3ull << 30);
	assert_int_equal(c.slots, 8);
	assert_int_equal(c.slot_size, 16 << 20);
	assert_int_equal(c.sq_entries, 1024);
	assert_int_equal(c.spin_ns, 0);
	assert_int_equal(c.log_level, LOG_DEBUG);
	assert_string_equal(c.config_path, path);

	/* An empty file is a valid file; sections may repeat. */
	kvd_config_defaults(&c);
	write_conf("");
	assert_int_equal(kvd_config_load_file(&c, path, err, sizeof(err)), 0);
	write_conf("[server]\nthreads = 2\n[log]\nlevel = warn\n[server]\nsocket = /a\n");
	assert_int_equal(kvd_config_load_file(&c, path, err, sizeof(err)), 0);
	assert_int_equal(c.threads, 2);
	assert_int_equal(c.log_level, LOG_WARNING);
	assert_string_equal(c.socket_path, "/a");
}

/* Each must be refused, the message containing every string in want. */
static void test_bad_files(void **state)
{
	static char long_line[400], long_sock[300];
	static const struct {
		const char *text;
		const char *want[3];
	} bad[] = {
		{ "[server]\nthreads = abc\n", { "kvd.conf:2:", "threads", "'abc': not a whole number" } },
		{ "[server]\nthreads = -1\n", { ":2:", "threads", "'-1'" } },
		{ "[server]\nthreads = +1\n", { ":2:", "threads", "'+1'" } },
		{ "[server]\nthreads = 0x10\n", { "threads", "'0x10'" } },
		{ "[server]\nthreads = 4x\n", { "threads", "'4x'" } },
		{ "[server]\nthreads =\n", { "threads", "''" } },
		{ "[server]\nthreads = 1025\n", { "threads", "above 1024" } },
		{ "[server]\nthreads = 99999999999999999999999\n", { "threads", "not a whole number" } },
		{ "[server]\nsocket =\n", { "socket", "empty path" } },
		{ "\n\n[memory]\nlimit = 12Q\n", { "kvd.conf:4:", "limit", "'12Q'" } },
		{ "[memory]\nlimit = 0%\n", { "limit", "percentage" } },
		{ "[log]\nfile = kvd.log\n", { ":2:", "file", "absolute" } },
		{ "[memory]\nlimit = 101%\n", { "limit", "percentage" } },
		{ "[memory]\nlimit = 1.5%\n", { "limit", "percentage" } },
		{ "[memory]\nlimit = %\n", { "limit", "percentage" } },
		{ "[memory]\nlimit = 512\n", { "limit", "below 1 MiB" } },
		{ "[memory]\nlimit = 99999999999T\n", { "limit", "too large" } },
		{ "[memory]\nlimit = 4 M\n", { "limit", "'4 M'" } },
		{ "[memory]\nlimit = 1KB\n", { "limit", "suffix" } },
		{ "[memory]\nlimit = 1.5G\n", { "limit", "'1.5G'" } },
		{ "[transport]\nslots = 0\n", { "slots", "at least one" } },
		{ "[transport]\nslots = 1025\n", { "slots", "above 1024" } },
		{ "[transport]\nslot_size = 1000\n", { "slot_size", "multiple of 4096" } },
		{ "[transport]\nslot_size = 4097K\n", { "slot_size", "'4097K'" } },
		{ "[transport]\nslot_size = 512M\n", { "slot_size", "'512M'" } },
		{ "[transport]\nslot_size = 32K\n", { "slot_size", "'32K'" } },
		{ "[transport]\nslots = 1024\nslot_size = 256M\n", { "kvd.conf", "slots 1024 x slot_size" } },
		{ "[transport]\nring_entries = 100\n", { "ring_entries", "power of two" } },
		{ "[transport]\nring_entries = 8\n", { "ring_entries", "power of two" } },
		{ "[transport]\nring_entries = 131072\n", { "ring_entries", "above 65536" } },
		{ "[transport]\nspin_us = 2000000\n", { "spin_us", "above 1000000" } },
		{ "[log]\nlevel = loud\n", { "level", "'loud'" } },
		{ "[log]\nlevel = INFO\n", { "level", "'INFO'" } },
		{ "[server]\nthread = 4\n", { "kvd.conf:2:", "thread", "unknown key" } },
		{ "[server]\nslots = 4\n", { "slots", "unknown key" } },
		{ "[servr]\nthreads = 4\n", { "kvd.conf:1:", "unknown section [servr]" } },
		{ "[server]\nthreads = 4\n[foo]\n", { "kvd.conf:3:", "unknown section [foo]" } },
		{ "threads = 4\n", { "kvd.conf:1:", "threads", "outside a section" } },
		{ "[server]\nthreads = 1\n\nthreads = 2\n", { "kvd.conf:4:", "threads given twice", "line 2" } },
		{ "[server]\nthreads\n", { "kvd.conf:2:", "syntax error" } },
		{ "[server\nthreads = 2\n", { "kvd.conf:1:", "syntax error" } },
		{ "[server]\nthreads = \x01\n", { "threads", "'\\x01'" } },
		{ long_line, { "kvd.conf:2:", "longer than" } },
		{ long_sock, { "kvd.conf:2:", "socket", "at most 107" } },
	};
	struct kvd_config c, before;
	char err[512];

	memset(long_line, 0, sizeof(long_line));
	strcpy(long_line, "[server]\n# ");
	memset(long_line + strlen(long_line), 'x', 300);
	strcat(long_line, "\nthreads = 4\n");
	strcpy(long_sock, "[server]\nsocket = /");
	memset(long_sock + strlen(long_sock), 's', 150);
	strcat(long_sock, "\n");

	kvd_config_defaults(&before);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc;

		c = before;
		err[0] = 0;
		write_conf(bad[i].text);
		rc = kvd_config_load_file(&c, path, err, sizeof(err));
		for (int k = 0; k < 3 && bad[i].want[k]; k++) {
			if (!strstr(err, bad[i].want[k]))
				print_error("case %zu: want '%s' in '%s' (rc %d)\n", i, bad[i].want[k], err, rc);
			assert_non_null(strstr(err, bad[i].want[k]));
		}
		assert_int_equal(rc, -EINVAL);
		assert_memory_equal(&c, &before, sizeof(c));    /* untouched */
	}

	c = before;
	snprintf(path, sizeof(path), "%s/missing.conf", dir);
	assert_int_equal(kvd_config_load_file(&c, path, err, sizeof(err)), -ENOENT);
	assert_non_null(strstr(err, "missing.conf"));
	assert_int_equal(kvd_config_load_file(&c, dir, err, sizeof(err)) < 0, 1);
}

static int flag_mem(const char *v, uint64_t *out, char *err, size_t n)
{
	struct kvd_config c;
	char *argv[] = { "kvd", "--mem-limit", (char *)v, NULL };
	int rc;

	kvd_config_defaults(&c);
	rc = kvd_config_parse_args(&c, 3, argv, err, n);
	*out = c.mem_limit;
	return rc;
}

static void test_sizes(void **state)
{
	static const struct {
		const char *v;
		uint64_t want;
	} good[] = {
		{ "0", 0 }, { "1048576", 1 << 20 }, { "1M", 1 << 20 }, { "2MiB", 2 << 20 },
		{ "3m", 3 << 20 }, { "4096K", 4 << 20 }, { "4096k", 4 << 20 }, { "1G", 1ull << 30 },
		{ "5GiB", 5ull << 30 }, { "1T", 1ull << 40 }, { "2t", 2ull << 40 },
		{ "16777215T", 16777215ull << 40 },
	};
	static const char *const bad[] = {
		"", "M", "1KB", "1Mi", "1MB", "1 G", " 1G", "1G ", "-1G", "1.5G", "1e9", "1P",
		"0x100000", "16777216T", "18446744073709551616", "1%%", "50%x", "1000%",
	};
	char err[256];
	uint64_t v;

	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
		if (flag_mem(good[i].v, &v, err, sizeof(err)))
			print_error("'%s': %s\n", good[i].v, err);
		assert_int_equal(v, good[i].want);
	}
	assert_int_equal(flag_mem("50%", &v, err, sizeof(err)), 0);
	assert_int_equal(v, phys() / 100 * 50);
	assert_int_equal(flag_mem("100%", &v, err, sizeof(err)), 0);
	assert_int_equal(v, phys() / 100 * 100);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = 0;
		if (flag_mem(bad[i], &v, err, sizeof(err)) != -EINVAL || !strstr(err, "--mem-limit"))
			print_error("'%s' accepted or badly refused: '%s'\n", bad[i], err);
		assert_non_null(strstr(err, "--mem-limit"));
	}
}

static void test_flags_over_file(void **state)
{
	struct kvd_config c;
	char err[256] = "";
	char conf[160];
	/* The file comes after --threads on the command line and still loses. */
	char *argv[] = { "kvd", "--threads", "8", "-f", "--config", conf,
			 "--socket=/flag.sock", NULL };

	write_conf("[server]\nthreads = 4\nsocket = /file.sock\n[log]\nlevel = debug\n"
		   "[transport]\nspin_us = 7\n");
	snprintf(conf, sizeof(conf), "%s", path);
	kvd_config_defaults(&c);
	if (kvd_config_parse_args(&c, 7, argv, err, sizeof(err)))
		print_error("%s\n", err);
	assert_int_equal(c.threads, 8);
	assert_string_equal(c.socket_path, "/flag.sock");
	assert_int_equal(c.log_level, LOG_DEBUG);       /* from the file */
	assert_int_equal(c.spin_ns, 7000);
	assert_int_equal(c.foreground, 1);
	assert_string_equal(c.config_path, path);

	/* No --config: no file, defaults plus flags.  Parsing twice works
	 * (getopt's state is reset). */
	{
		char *a2[] = { "kvd", "--log-level", "error", "--mem-limit", "2G", NULL };

		kvd_config_defaults(&c);
		assert_int_equal(kvd_config_parse_args(&c, 5, a2, err, sizeof(err)), 0);
		assert_int_equal(c.log_level, LOG_ERR);
		assert_int_equal(c.mem_limit, 2ull << 30);
		assert_string_equal(c.config_path, "");
		assert_int_equal(kvd_config_parse_args(&c, 5, a2, err, sizeof(err)), 0);
	}
	{
		char *a3[] = { "kvd", NULL };

		kvd_config_defaults(&c);
		assert_int_equal(kvd_config_parse_args(&c, 1, a3, err, sizeof(err)), 0);
		assert_string_equal(c.socket_path, "/run/kvd/kvd.sock");
	}
}

static void test_bad_flags(void **state)
{
	static const struct {
		int rc;
		const char *want;
		const char *argv[6];
	} bad[] = {
		{ -EINVAL, "unknown option '--bogus'", { "kvd", "--bogus" } },
		{ -EINVAL, "unknown option '-x'", { "kvd", "-x" } },
		{ -EINVAL, "unknown option '--threads-x'", { "kvd", "--threads-x", "3" } },
		{ -EINVAL, "option '--threads' needs a value", { "kvd", "--threads" } },
		{ -EINVAL, "option '-c' needs a value", { "kvd", "-c" } },
		{ -EINVAL, "unexpected argument 'extra'", { "kvd", "-f", "extra" } },
		{ -EINVAL, "--threads 'abc': not a whole number", { "kvd", "--threads", "abc" } },
		{ -EINVAL, "--threads '2000': above 1024", { "kvd", "--threads=2000" } },
		{ -EINVAL, "--log-level 'loud'", { "kvd", "--log-level", "loud" } },
		{ -EINVAL, "--socket ''", { "kvd", "--socket", "" } },
		{ -EINVAL, "--config given twice", { "kvd", "-c", "/a", "--config", "/b" } },
		{ -ENOENT, "/nonexistent/kvd.conf", { "kvd", "--config", "/nonexistent/kvd.conf" } },
		{ -EINVAL, "unknown option '--bogus'", { "kvd", "--help", "--bogus" } },
		{ KVD_CONFIG_HELP, "", { "kvd", "--threads", "abc", "--help" } },
		{ KVD_CONFIG_HELP, "", { "kvd", "-h" } },
	};
	struct kvd_config c, before;
	char err[256];

	kvd_config_defaults(&before);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char *argv[6];
		int argc = 0, rc;

		while (bad[i].argv[argc]) {
			argv[argc] = (char *)bad[i].argv[argc];
			argc++;
		}
		argv[argc] = NULL;
		c = before;
		err[0] = 0;
		rc = kvd_config_parse_args(&c, argc, argv, err, sizeof(err));
		if (rc != bad[i].rc || !strstr(err, bad[i].want))
			print_error("case %zu: rc %d, want %d '%s', got '%s'\n", i, rc, bad[i].rc,
				    bad[i].want, err);
		assert_int_equal(rc, bad[i].rc);
		assert_non_null(strstr(err, bad[i].want));
		assert_memory_equal(&c, &before, sizeof(c));
	}

	/* A bad file named by --config: its message, and nothing applied. */
	{
		char conf[160];
		char *argv[] = { "kvd", "--threads", "3", "--config", conf, NULL };

		write_conf("[server]\nthreads = 2\nbogus = 1\n");
		snprintf(conf, sizeof(conf), "%s", path);
		c = before;
		assert_int_equal(kvd_config_parse_args(&c, 5, argv, err, sizeof(err)), -EINVAL);
		assert_non_null(strstr(err, "kvd.conf:3: [server] bogus: unknown key"));
		assert_memory_equal(&c, &before, sizeof(c));
	}
}

/* The example shipped with the unit (systemd/kvd.conf) is a valid file,
 * also with every key uncommented (tests run from the repository root). */
static void test_example_file(void **state)
{
	struct kvd_config c, d;
	char err[256] = "", line[512];
	FILE *in = fopen("systemd/kvd.conf", "r"), *out;

	if (!in) {
		printf("SKIP: systemd/kvd.conf not found (run from the repository root)\n");
		skip();
	}
	kvd_config_defaults(&c);
	d = c;
	if (kvd_config_load_file(&c, "systemd/kvd.conf", err, sizeof(err)))
		print_error("%s\n", err);
	assert_string_equal(c.config_path, "systemd/kvd.conf");
	memset(c.config_path, 0, sizeof(c.config_path));
	assert_memory_equal(&c, &d, sizeof(c));

	snprintf(path, sizeof(path), "%s/kvd.conf", dir);
	out = fopen(path, "w");
	assert_non_null(out);
	while (fgets(line, sizeof(line), in))
		fputs(line[0] == '#' && line[1] != ' ' && line[1] != '\n' ? line + 1 : line, out);
	fclose(in);
	fclose(out);
	if (kvd_config_load_file(&c, path, err, sizeof(err)))
		print_error("%s\n", err);
	memset(c.config_path, 0, sizeof(c.config_path));
	assert_int_equal(c.metrics_listen_set, 1);
	c.metrics_listen_set = 0;       /* given, not defaulted: the same address */
	/* The commented values are the defaults. */
	assert_memory_equal(&c, &d, sizeof(c));
}

static void test_log_file(void **state)
{
	struct kvd_config c;
	char err[512];
	char *argv[] = { "kvd", "--log-file", "/var/log/kvd/kvd.log", NULL };

	kvd_config_defaults(&c);
	assert_string_equal(c.log_path, "");
	assert_int_equal(kvd_config_load_file(&c, write_conf("[log]\nfile = /tmp/a.log\n"), err,
					      sizeof err), 0);
	assert_string_equal(c.log_path, "/tmp/a.log");
	optind = 0;
	assert_int_equal(kvd_config_parse_args(&c, 3, argv, err, sizeof err), 0);
	assert_string_equal(c.log_path, "/var/log/kvd/kvd.log");
}

/* The memory watermarks and the spill tier: file lists, repeatable flags
 * that replace the file's list, bare --persist, and the cross checks. */
static void test_spill_keys(void **state)
{
	struct kvd_config c;
	char err[256] = "", conf[160];

	write_conf("[memory]\nhigh = 95%\nlow = 60%\n[spill]\ndir = /a:/b/c\nlimit = 3G\n"
		   "queue_depth = 128\nblock = 256K\ndirect = no\npersist = yes\n");
	snprintf(conf, sizeof conf, "%s", path);
	{
		char *a[] = { "kvd", "--config", conf, NULL };

		kvd_config_defaults(&c);
		if (kvd_config_parse_args(&c, 3, a, err, sizeof err))
			print_error("%s\n", err);
		assert_int_equal(c.mem_high, 95);
		assert_int_equal(c.mem_low, 60);
		assert_int_equal(c.spill_ndirs, 2);
		assert_string_equal(c.spill_dir[0], "/a");
		assert_string_equal(c.spill_dir[1], "/b/c");
		assert_int_equal(c.spill_limit, 3ull << 30);
		assert_int_equal(c.spill_qd, 128);
		assert_int_equal(c.spill_block, 256u << 10);
		assert_int_equal(c.spill_buffered, 1);
		assert_int_equal(c.persist, 1);
		assert_int_equal(c.spill_fault_on, 0);
	}
	{
		char *a[] = { "kvd", "--spill-dir", "/x", "--config", conf, "--spill-dir", "/y",
			      "--spill-fault", "eio-read@*", NULL };

		kvd_config_defaults(&c);
		assert_int_equal(kvd_config_parse_args(&c, 9, a, err, sizeof err), 0);
		assert_int_equal(c.spill_ndirs, 2);
		assert_string_equal(c.spill_dir[0], "/x");
		assert_string_equal(c.spill_dir[1], "/y");
		assert_int_equal(c.spill_fault_on, 1);
		assert_string_equal(c.spill_fault, "eio-read@*");
	}
	{
		char *a[] = { "kvd", "--persist", "--spill-dir", "/s", NULL };

		kvd_config_defaults(&c);
		assert_int_equal(kvd_config_parse_args(&c, 4, a, err, sizeof err), 0);
		assert_int_equal(c.persist, 1);
	}
	static const struct {
		const char *flag, *value, *why;
	} bad[] = {
		{ "--spill-dir", "relative/dir", "absolute" },
		{ "--mem-high", "50%", "below high" },  /* low 80% >= high 50% */
		{ "--mem-low", "0%", "percentage" },
		{ "--mem-high", "90", "percentage" },
		{ "--spill-limit", "12Q", "suffix" },
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		char *a[] = { "kvd", (char *)bad[i].flag, (char *)bad[i].value, NULL };

		kvd_config_defaults(&c);
		err[0] = 0;
		assert_int_equal(kvd_config_parse_args(&c, 3, a, err, sizeof err), -EINVAL);
		if (!strstr(err, bad[i].why))
			fail_msg("%s %s: '%s' lacks '%s'", bad[i].flag, bad[i].value, err, bad[i].why);
	}
	{
		char *a[] = { "kvd", "--persist", NULL };

		kvd_config_defaults(&c);
		assert_int_equal(kvd_config_parse_args(&c, 2, a, err, sizeof err), -EINVAL);
		assert_non_null(strstr(err, "spill directory"));
	}
	write_conf("[spill]\ndirect = maybe\n");
	assert_int_equal(kvd_config_load_file(&c, path, err, sizeof err), -EINVAL);
	assert_non_null(strstr(err, "yes or no"));
}

/* [limits] and [sharing]: defaults, every key with good and bad values,
 * ranges, per-uid values above the global refused, percentages resolved
 * against the global limit, and the namespaces of sharing groups. */
static void test_limits_keys(void **state)
{
	struct kvd_config c, before;
	struct kvd_limits_cfg lc;
	char err[512] = "";

	kvd_config_defaults(&c);
	assert_int_equal(c.connections, 1024);
	assert_int_equal(c.connections_per_uid, 256);
	assert_int_equal(c.control_cpu_pct, 20);
	assert_int_equal(c.sequences, 65536);
	assert_int_equal(c.sequences_per_uid, 16384);
	assert_int_equal(c.profiles, 256);
	assert_int_equal(c.profiles_per_uid, 16);
	assert_int_equal(kvd_config_memory_per_uid(&c), c.mem_limit);
	assert_int_equal(kvd_config_spill_per_uid(&c), 0);     /* 100% of no spill limit */
	assert_int_equal(c.nshare, 0);
	assert_int_equal(kvd_config_namespace(&c, 1000), 1000);
	assert_int_equal(kvd_config_namespace(&c, 0), 0);
	assert_int_equal(kvd_config_namespace(&c, 0x80000000u), KVD_NS_NONE);
	kvd_config_limits(&c, &lc);
	assert_int_equal(lc.cap[KVD_RES_MEMORY], c.mem_limit);
	assert_int_equal(lc.per_uid[KVD_RES_MEMORY], 0);        /* 100%: no separate cap */
	assert_int_equal(lc.cap[KVD_RES_SEQUENCES], 65536);
	assert_int_equal(lc.cap[KVD_RES_SHM], 64ull << 30);
	assert_int_equal(lc.per_uid[KVD_RES_SHM], 16ull << 30);

	write_conf("[memory]\nlimit = 8G\n[spill]\nlimit = 100G\n"
		   "[limits]\nconnections = 64\nconnections_per_uid = 8\nsequences = 1000\n"
		   "sequences_per_uid = 1000\nprofiles = 16777216\nprofiles_per_uid = 1\n"
		   "memory_per_uid = 25%\nspill_per_uid = 10G\nshm = 8G\nshm_per_uid = 512M\n"
		   "control_cpu_per_uid = 7%\n"
		   "[sharing]\ngroups =  1000,1001\t2000,2001,2002   \n");
	kvd_config_defaults(&c);
	if (kvd_config_load_file(&c, path, err, sizeof err))
		print_error("%s\n", err);
	assert_int_equal(c.connections, 64);
	assert_int_equal(c.connections_per_uid, 8);
	assert_int_equal(c.sequences, 1000);
	assert_int_equal(c.sequences_per_uid, 1000);
	assert_int_equal(c.profiles, 16777216);
	assert_int_equal(c.profiles_per_uid, 1);
	assert_int_equal(c.control_cpu_pct, 7);
	assert_int_equal(kvd_config_memory_per_uid(&c), (8ull << 30) / 100 * 25);
	assert_int_equal(kvd_config_spill_per_uid(&c), 10ull << 30);
	assert_int_equal(c.nshare, 5);
	assert_int_equal(c.ngroups, 2);
	assert_int_equal(kvd_config_namespace(&c, 1000), KVD_NS_GROUP | 0);
	assert_int_equal(kvd_config_namespace(&c, 1001), KVD_NS_GROUP | 0);
	assert_int_equal(kvd_config_namespace(&c, 2002), KVD_NS_GROUP | 1);
	assert_int_equal(kvd_config_namespace(&c, 1002), 1002);
	kvd_config_limits(&c, &lc);
	assert_int_equal(lc.cap[KVD_RES_CONNECTIONS], 64);
	assert_int_equal(lc.per_uid[KVD_RES_CONNECTIONS], 8);
	assert_int_equal(lc.cap[KVD_RES_MEMORY], 8ull << 30);
	assert_int_equal(lc.per_uid[KVD_RES_MEMORY], (8ull << 30) / 100 * 25);
	assert_int_equal(lc.cap[KVD_RES_SPILL], 100ull << 30);
	assert_int_equal(lc.per_uid[KVD_RES_SPILL], 10ull << 30);
	assert_int_equal(lc.cap[KVD_RES_SHM], 8ull << 30);
	assert_int_equal(lc.per_uid[KVD_RES_SHM], 512ull << 20);
	assert_int_equal(lc.nshare, 5);
	assert_int_equal(kvd_limits_cfg_namespace(&lc, 2000), KVD_NS_GROUP | 1);
	/* a percentage follows the limit set after it (here by a flag) */
	{
		char conf[160];
		char *a[] = { "kvd", "--config", conf, "--mem-limit", "4G", NULL };

		snprintf(conf, sizeof conf, "%s", path);
		kvd_config_defaults(&c);
		assert_int_equal(kvd_config_parse_args(&c, 5, a, err, sizeof err), 0);
		assert_int_equal(kvd_config_memory_per_uid(&c), (4ull << 30) / 100 * 25);
	}
	/* sizes of memory_per_uid: bytes; the group list can be emptied */
	write_conf("[memory]\nlimit = 1G\n[limits]\nmemory_per_uid = 512M\n[sharing]\ngroups =\n");
	kvd_config_defaults(&c);
	assert_int_equal(kvd_config_load_file(&c, path, err, sizeof err), 0);
	assert_int_equal(kvd_config_memory_per_uid(&c), 512ull << 20);
	assert_int_equal(c.nshare, 0);

	static const struct {
		const char *text;
		const char *want[3];
	} bad[] = {
		{ "[limits]\nconnections = 0\n", { "kvd.conf:2:", "connections", "at least 1" } },
		{ "[limits]\nconnections = -1\n", { ":2:", "connections", "not a whole number" } },
		{ "[limits]\nconnections = 16777217\n", { "connections", "above 16777216" } },
		{ "[limits]\nconnections = 1k\n", { "connections", "'1k'" } },
		{ "[limits]\nconnections_per_uid = 0\n", { "connections_per_uid", "at least 1" } },
		{ "[limits]\nconnections_per_uid = 2000\n",
		  { "kvd.conf", "connections_per_uid 2000 is above connections 1024" } },
		{ "[limits]\nconnections = 10\n", { "connections_per_uid 256 is above connections 10" } },
		{ "[limits]\nsequences = x\n", { "sequences", "not a whole number" } },
		{ "[limits]\nsequences = 99999999999\n", { "sequences", "above" } },
		{ "[limits]\nsequences_per_uid = 70000\n",
		  { "sequences_per_uid 70000 is above sequences 65536" } },
		{ "[limits]\nsequences_per_uid = 0\n", { "sequences_per_uid", "at least 1" } },
		{ "[limits]\nprofiles = 0\n", { "profiles", "at least 1" } },
		{ "[limits]\nprofiles = 8\n", { "profiles_per_uid 16 is above profiles 8" } },
		{ "[limits]\nprofiles_per_uid = 257\n", { "profiles_per_uid 257 is above profiles 256" } },
		{ "[limits]\nprofiles_per_uid = 1.5\n", { "profiles_per_uid", "'1.5'" } },
		{ "[limits]\nmemory_per_uid = 0\n", { "memory_per_uid", "below 1 MiB" } },
		{ "[limits]\nmemory_per_uid = 0%\n", { "memory_per_uid", "percentage" } },
		{ "[limits]\nmemory_per_uid = 101%\n", { "memory_per_uid", "percentage" } },
		{ "[limits]\nmemory_per_uid = 12Q\n", { "memory_per_uid", "suffix" } },
		{ "[memory]\nlimit = 1G\n[limits]\nmemory_per_uid = 2G\n",
		  { "memory_per_uid", "above [memory] limit" } },
		{ "[limits]\nspill_per_uid = 100\n", { "spill_per_uid", "below 1 MiB" } },
		{ "[limits]\nspill_per_uid = 50\n%\n", { "kvd.conf" } },
		{ "[spill]\nlimit = 1G\n[limits]\nspill_per_uid = 2G\n",
		  { "spill_per_uid", "above [spill] limit" } },
		{ "[limits]\nsequences = 10\nsequences = 10\n", { "kvd.conf:3:", "given twice" } },
		{ "[limits]\nshm = 100K\n", { "kvd.conf:2:", "shm", "below 1 MiB" } },
		{ "[limits]\nshm_per_uid = 50%\n", { "shm_per_uid", "'50%'" } },
		{ "[limits]\ncontrol_cpu_per_uid = 0%\n", { "control_cpu_per_uid", "at least 1%" } },
		{ "[limits]\ncontrol_cpu_per_uid = 101%\n", { "control_cpu_per_uid", "'101%'" } },
		{ "[limits]\ncontrol_cpu_per_uid = 50\n", { "control_cpu_per_uid", "N% of one core" } },
		{ "[limits]\ncontrol_cpu_per_uid = x%\n", { "control_cpu_per_uid", "'x%'" } },
		{ "[limits]\nshm = 1G\n", { "shm_per_uid 17179869184 bytes is above shm" } },
		{ "[limits]\nthreads = 4\n", { "threads", "unknown key" } },
		{ "[sharing]\ngroups = 1000\n", { "kvd.conf:2:", "groups", "one uid" } },
		{ "[sharing]\ngroups = 1000, 1001\n", { "groups", "empty uid" } },
		{ "[sharing]\ngroups = 1000,,1001\n", { "groups", "empty uid" } },
		{ "[sharing]\ngroups = 1000,abc\n", { "groups", "'abc' is not a number" } },
		{ "[sharing]\ngroups = 1000,2147483648\n", { "groups", "below 2147483648" } },
		{ "[sharing]\ngroups = 1000,1001 1001,1002\n", { "uid 1001 is in two groups" } },
		{ "[sharing]\ngroups = 1000,1000\n", { "uid 1000 is in its group twice" } },
		{ "[sharing]\ngroups = 1,2\ngroups = 3,4\n", { "kvd.conf:3:", "given twice" } },
		{ "[sharing]\nuids = 1,2\n", { "uids", "unknown key" } },
	};
	kvd_config_defaults(&before);
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		int rc;

		c = before;
		err[0] = 0;
		write_conf(bad[i].text);
		rc = kvd_config_load_file(&c, path, err, sizeof err);
		for (int k = 0; k < 3 && bad[i].want[k]; k++) {
			if (!strstr(err, bad[i].want[k]))
				print_error("case %zu: want '%s' in '%s' (rc %d)\n", i, bad[i].want[k], err, rc);
			assert_non_null(strstr(err, bad[i].want[k]));
		}
		assert_int_equal(rc, -EINVAL);
		assert_memory_equal(&c, &before, sizeof c);
	}
	/* many small groups (a line holds at most libinih's ~200 bytes) */
	{
		char text[4096] = "[sharing]\ngroups =";

		for (int g = 0; g < 30; g++)
			snprintf(text + strlen(text), sizeof text - strlen(text), " %d,%d", 2 * g, 2 * g + 1);
		strcat(text, "\n");
		write_conf(text);
		c = before;
		if (kvd_config_load_file(&c, path, err, sizeof err))
			fail_msg("%s", err);
		assert_int_equal(c.ngroups, 30);
		assert_int_equal(kvd_config_namespace(&c, 59), KVD_NS_GROUP | 29);
		assert_int_equal(kvd_config_namespace(&c, 0), KVD_NS_GROUP | 0);
	}
}

/* [metrics] listen / --metrics-listen: default on loopback, "" off, IPv4 or
 * [IPv6] with a port, anything else refused with the key in the message. */
static void test_metrics_listen(void **state)
{
	struct kvd_config c;
	char err[512];
	char *off[] = { "kvd", "--metrics-listen", "", NULL };
	char *v6[] = { "kvd", "--metrics-listen", "[::1]:0", NULL };
	char *bad_flag[] = { "kvd", "--metrics-listen", "localhost:9464", NULL };
	static const char *const bad[] = {
		"[metrics]\nlisten = 127.0.0.1\n",            /* no port */
		"[metrics]\nlisten = 127.0.0.1:65536\n",      /* port out of range */
		"[metrics]\nlisten = 127.0.0.1:-1\n",
		"[metrics]\nlisten = 127.0.0.1:94x\n",
		"[metrics]\nlisten = 256.0.0.1:9464\n",
		"[metrics]\nlisten = ::1:9464\n",              /* IPv6 without brackets */
		"[metrics]\nlisten = localhost:9464\n",        /* names are not resolved */
		"[metrics]\nport = 9464\n",                    /* unknown key */
		"[metrics]\nrequest_timeout_ms = 99\n",        /* below 100 */
		"[metrics]\nrequest_timeout_ms = 600001\n",
		"[metrics]\nrequest_timeout_ms = 1s\n",
	};

	kvd_config_defaults(&c);
	assert_string_equal(c.metrics_listen, "127.0.0.1:9464");
	assert_int_equal(c.metrics_listen_set, 0);
	assert_int_equal(c.metrics_request_ms, 10000);
	assert_int_equal(kvd_config_load_file(&c, write_conf("[metrics]\nrequest_timeout_ms = "
							     "100\n"), err, sizeof err), 0);
	assert_int_equal(c.metrics_request_ms, 100);
	assert_int_equal(c.metrics_listen_set, 0);
	assert_int_equal(kvd_config_load_file(&c, write_conf("[metrics]\nlisten = 0.0.0.0:9100\n"),
					      err, sizeof err), 0);
	assert_string_equal(c.metrics_listen, "0.0.0.0:9100");
	assert_int_equal(c.metrics_listen_set, 1);
	assert_int_equal(kvd_config_load_file(&c, write_conf("[metrics]\nlisten =\n"), err,
					      sizeof err), 0);
	assert_string_equal(c.metrics_listen, "");
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		struct kvd_config d;

		kvd_config_defaults(&d);
		assert_int_equal(kvd_config_load_file(&d, write_conf(bad[i]), err, sizeof err), -EINVAL);
		assert_non_null(strstr(err, "[metrics]"));
		assert_string_equal(d.metrics_listen, "127.0.0.1:9464");        /* unchanged */
		assert_int_equal(d.metrics_request_ms, 10000);
	}
	kvd_config_defaults(&c);
	optind = 0;
	assert_int_equal(kvd_config_parse_args(&c, 3, v6, err, sizeof err), 0);
	assert_string_equal(c.metrics_listen, "[::1]:0");
	optind = 0;
	assert_int_equal(kvd_config_parse_args(&c, 3, off, err, sizeof err), 0);
	assert_string_equal(c.metrics_listen, "");
	optind = 0;
	assert_int_equal(kvd_config_parse_args(&c, 3, bad_flag, err, sizeof err), -EINVAL);
	assert_non_null(strstr(err, "--metrics-listen"));
}

static void test_usage(void **state)
{
	char *buf = NULL;
	size_t n = 0;
	FILE *f = open_memstream(&buf, &n);

	kvd_config_usage(f, "kvd");
	fclose(f);
	assert_non_null(strstr(buf, "usage: kvd"));
	assert_non_null(strstr(buf, "--config"));
	assert_non_null(strstr(buf, "--mem-limit"));
	free(buf);
}

/* [remote]: defaults, every key, bad values, and the rule that it needs a
 * spill directory; the namespace names its keys carry. */
static void test_remote_keys(void **state)
{
	struct kvd_config c, before;
	char err[512] = "", name[32];

	kvd_config_defaults(&c);
	assert_string_equal(c.remote_seeds, "");
	assert_string_equal(c.remote_prefix, "kvd");
	assert_int_equal(c.remote_timeout_ms, 2000);
	assert_int_equal(c.remote_retry_ms, 5000);
	assert_int_equal(c.remote_replicas, 0);
	assert_int_equal(c.remote_chunk, 4u << 20);
	assert_int_equal(c.remote_evicted, 0);
	assert_int_equal(c.remote_limit, 0);
	assert_int_equal(kvd_config_remote_per_uid(&c), 0);
	write_conf("[spill]\ndir = /tmp/x\n[remote]\nseeds = 127.0.0.1:7000,[::1]:7001\n"
		   "prefix = kv.d-1\nconnect_timeout_ms = 100\ntimeout_ms = 300\nretry_ms = 0\n"
		   "replicas = 2\nwait_timeout_ms = 50\nchunk = 1M\nevicted = yes\nlimit = 1G\n"
		   "[limits]\nremote_per_uid = 25%\n");
	if (kvd_config_load_file(&c, path, err, sizeof err))
		fail_msg("%s", err);
	assert_string_equal(c.remote_seeds, "127.0.0.1:7000,[::1]:7001");
	assert_string_equal(c.remote_prefix, "kv.d-1");
	assert_int_equal(c.remote_connect_ms, 100);
	assert_int_equal(c.remote_timeout_ms, 300);
	assert_int_equal(c.remote_retry_ms, 0);
	assert_int_equal(c.remote_replicas, 2);
	assert_int_equal(c.remote_wait_ms, 50);
	assert_int_equal(c.remote_chunk, 1u << 20);
	assert_int_equal(c.remote_evicted, 1);
	assert_int_equal(c.remote_limit, 1ull << 30);
	assert_int_equal(kvd_config_remote_per_uid(&c), (1ull << 30) / 100 * 25);

	struct kvd_limits_cfg rl;

	kvd_config_limits(&c, &rl);
	assert_int_equal(rl.cap[KVD_RES_REMOTE], 1ull << 30);
	assert_int_equal(rl.per_uid[KVD_RES_REMOTE], (1ull << 30) / 100 * 25);

	const struct {
		const char *text;
		const char *want[2];
	} bad[] = {
		{ "[remote]\nseeds = 127.0.0.1:7000\n", { "[remote] needs a spill directory" } },
		{ "[remote]\nprefix = a{b}\n", { "prefix", "no braces" } },
		{ "[remote]\nprefix =\n", { "prefix", "1.." } },
		{ "[remote]\nchunk = 1K\n", { "chunk", "4K..512M" } },
		{ "[remote]\nchunk = 1G\n", { "chunk", "4K..512M" } },
		{ "[remote]\nreplicas = 17\n", { "replicas" } },
		{ "[remote]\ntimeout_ms = -1\n", { "timeout_ms" } },
		{ "[remote]\nhosts = a\n", { "hosts", "unknown key" } },
		{ "[remote]\nevicted = maybe\n", { "evicted" } },
		{ "[remote]\nlimit = lots\n", { "limit" } },
		{ "[remote]\nlimit = 1G\n[limits]\nremote_per_uid = 2G\n",
		  { "remote_per_uid", "above [remote] limit" } },
		{ "[limits]\nremote_per_uid = 101%\n", { "remote_per_uid" } },
	};
	kvd_config_defaults(&before);
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		c = before;
		err[0] = 0;
		write_conf(bad[i].text);
		assert_int_equal(kvd_config_load_file(&c, path, err, sizeof err), -EINVAL);
		for (int k = 0; k < 2 && bad[i].want[k]; k++) {
			if (!strstr(err, bad[i].want[k]))
				print_error("case %zu: want '%s' in '%s'\n", i, bad[i].want[k], err);
			assert_non_null(strstr(err, bad[i].want[k]));
		}
	}

	/* Namespace names: a uid's own, and a group's by its smallest uid. */
	struct kvd_limits_cfg lc = { .nshare = 3, .share_uid = { 2001, 1000, 3000 },
				     .share_group = { 0, 0, 1 } };
	struct kvd_limits *l;

	kvd_limits_ns_name(NULL, 1000, name, sizeof name);
	assert_string_equal(name, "u1000");
	assert_int_equal(kvd_limits_create(&lc, &l), 0);
	kvd_limits_ns_name(l, kvd_limits_namespace(l, 2001), name, sizeof name);
	assert_string_equal(name, "g1000");
	kvd_limits_ns_name(l, kvd_limits_namespace(l, 3000), name, sizeof name);
	assert_string_equal(name, "g3000");
	kvd_limits_ns_name(l, kvd_limits_namespace(l, 42), name, sizeof name);
	assert_string_equal(name, "u42");
	kvd_limits_destroy(l);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_defaults),
		cmocka_unit_test(test_good_file),
		cmocka_unit_test(test_bad_files),
		cmocka_unit_test(test_sizes),
		cmocka_unit_test(test_flags_over_file),
		cmocka_unit_test(test_bad_flags),
		cmocka_unit_test(test_example_file),
		cmocka_unit_test(test_log_file),
		cmocka_unit_test(test_spill_keys),
		cmocka_unit_test(test_limits_keys),
		cmocka_unit_test(test_remote_keys),
		cmocka_unit_test(test_metrics_listen),
		cmocka_unit_test(test_usage),
	};

	return cmocka_run_group_tests(tests, setup, teardown);
}
