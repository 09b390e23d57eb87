/* Starting and stopping the build's own kvd: the one harness of the
 * integration tests and of kvbench (bench/serve.c, bench/load.c), so the
 * benchmarks measure a daemon started exactly as the tests start it.
 * Header-only (static), so neither side links anything for it.
 *
 * The daemon runs in a temporary directory of its own (its socket, and a
 * configuration file when the caller writes one there), in the foreground,
 * dies with the thread that started it, and is stopped with SIGTERM.
 */
#ifndef KVD_TEST_DAEMON_H
#define KVD_TEST_DAEMON_H

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

struct daemon {
	pid_t pid;
	int nice;               /* kvd's niceness (a unit's Nice=); 0: the caller's */
	char dir[64];
	char sock[108];
};

static inline void daemon_sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };

	nanosleep(&ts, NULL);
}

/* utime + stime of process pid, every thread: clock ticks
 * (sysconf(_SC_CLK_TCK) a second), or -1. */
static inline long long daemon_cpu_ticks(pid_t pid)
{
	char path[64], buf[2048], *p;
	unsigned long long ut, st;
	FILE *f;
	size_t n;

	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	p = strrchr(buf, ')');  /* comm may hold blanks and parentheses */
	if (!p)
		return -1;
	/* after ") ": state(3) ppid pgrp session tty tpgid flags minflt
	 * cminflt majflt cmajflt utime(14) stime(15) */
	if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
		return -1;
	return (long long)(ut + st);
}

/* Makes d's run directory from tmpl (a mkdtemp() template) and names the
 * socket in it; nothing runs yet. */
static inline int daemon_mkdir(struct daemon *d, const char *tmpl)
{
	d->pid = 0;
	d->nice = 0;
	snprintf(d->dir, sizeof d->dir, "%s", tmpl);
	if (!mkdtemp(d->dir))
		return -1;
	snprintf(d->sock, sizeof d->sock, "%s/kvd.sock", d->dir);
	return 0;
}

/* Runs `kvd --foreground ARGS...` (args: NULL-terminated, at most 16), kvd
 * being `rel` from the running program's directory (build/tests/test_x:
 * "../kvd"; build/kvbench: "kvd"), and waits until its socket answers: 0,
 * or -1 when it exited or did not answer within 10 s. */
static inline int daemon_spawn(struct daemon *d, const char *rel, const char *const *args)
{
	char exe[PATH_MAX], bin[PATH_MAX + 16];
	const char *argv[19] = { "kvd", "--foreground" };
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	unsigned k = 2;

	if (n <= 0)
		return -1;
	exe[n] = 0;
	*strrchr(exe, '/') = 0;
	snprintf(bin, sizeof bin, "%s/%s", exe, rel);
	for (; args && *args && k < 18; args++)
		argv[k++] = *args;
	d->pid = fork();
	if (d->pid < 0)
		return -1;
	if (d->pid == 0) {
		char pid[16];

		/* Whoever started it dies (a test's abort, a sanitizer report,
		 * kvbench interrupted): the daemon goes too.  An orphan would
		 * hold the caller's output pipe open and hang whatever reads
		 * it. */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		/* A watchdog interval in the environment is for kvd: name its
		 * pid, as systemd does. */
		if (getenv("WATCHDOG_USEC")) {
			snprintf(pid, sizeof pid, "%d", (int)getpid());
			setenv("WATCHDOG_PID", pid, 1);
		}
		if (d->nice && setpriority(PRIO_PROCESS, 0, d->nice))
			perror("kvd: setpriority");
		execv(bin, (char *const *)argv);
		perror("exec kvd");
		_exit(127);
	}
	for (int i = 0; i < 500; i++) {         /* up to 10 s, for sanitizer builds */
		struct sockaddr_un a = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0), ok;

		memcpy(a.sun_path, d->sock, strlen(d->sock) + 1);
		ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
		close(fd);
		if (ok)
			return 0;
		if (waitpid(d->pid, NULL, WNOHANG) == d->pid) {
			d->pid = 0;
			return -1;
		}
		daemon_sleep_ms(20);
	}
	return -1;
}

/* The tests' daemon: build/kvd at niceness `nice` (0: the caller's) with up
 * to four extra arguments (NULL ends them); they come after the defaults,
 * so they override them. */
static inline int daemon_start_nice(struct daemon *d, int nice, const char *a1, const char *a2,
				    const char *a3, const char *a4)
{
	if (daemon_mkdir(d, "/tmp/kvd-test.XXXXXX"))
		return -1;
	d->nice = nice;

	/* No metrics endpoint unless a test asks (--metrics-listen among the
	 * extras, which come later and win): daemons of concurrent tests
	 * must not fight over the default port. */
	const char *args[] = { "--socket", d->sock, "--threads", "2",
			       "--log-level", getenv("KVD_TEST_LOG") ? "debug" : "warning",
			       "--metrics-listen", "", a1, a2, a3, a4, NULL };

	return daemon_spawn(d, "../kvd", args);
}

static inline int daemon_start4(struct daemon *d, const char *a1, const char *a2,
				const char *a3, const char *a4)
{
	return daemon_start_nice(d, 0, a1, a2, a3, a4);
}

static inline int daemon_start(struct daemon *d, const char *extra_flag)
{
	return daemon_start4(d, extra_flag, NULL, NULL, NULL);
}

/* SIGTERM and wait; removes the run directory (and a kvd.conf written
 * there).  Returns the daemon's exit status (0 when it drained and exited
 * cleanly), or -1. */
static inline int daemon_stop(struct daemon *d)
{
	char conf[sizeof d->dir + 16];
	int st;

	if (d->pid <= 0)
		return -1;
	kill(d->pid, SIGTERM);
	if (waitpid(d->pid, &st, 0) != d->pid)
		return -1;
	d->pid = 0;
	snprintf(conf, sizeof conf, "%s/kvd.conf", d->dir);
	unlink(conf);
	rmdir(d->dir);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Removes dir and everything below it (a test's spill directory). */
static inline void daemon_rm_tree(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	char p[400];

	if (!d)
		return;
	while ((e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		if ((size_t)snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= sizeof p)
			continue;
		if (unlink(p) && errno == EISDIR)
			daemon_rm_tree(p);
	}
	closedir(d);
	rmdir(dir);
}

#endif
