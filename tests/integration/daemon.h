/* Starting and stopping a real kvd for integration tests (header-only).
 * The daemon is the build's own: <dir of this test>/../kvd. */
#ifndef KVD_TEST_DAEMON_H
#define KVD_TEST_DAEMON_H

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
#include <time.h>
#include <unistd.h>

struct daemon {
	pid_t pid;
	char dir[64];
	char sock[108];
};

static inline void daemon_sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };

	nanosleep(&ts, NULL);
}

/* Starts build/kvd with up to four extra arguments (NULL ends them); they
 * come after the defaults, so they override them. */
static inline int daemon_start4(struct daemon *d, const char *a1, const char *a2,
				const char *a3, const char *a4)
{
	char exe[PATH_MAX], bin[PATH_MAX + 8];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);

	if (n <= 0)
		return -1;
	exe[n] = 0;
	*strrchr(exe, '/') = 0;
	snprintf(bin, sizeof bin, "%s/../kvd", exe);
	snprintf(d->dir, sizeof d->dir, "/tmp/kvd-test.XXXXXX");
	if (!mkdtemp(d->dir))
		return -1;
	snprintf(d->sock, sizeof d->sock, "%s/kvd.sock", d->dir);
	d->pid = fork();
	if (d->pid == 0) {
		/* A test that dies (an abort, a sanitizer report) takes its
		 * daemon along: an orphan would hold the test's output pipe open
		 * and hang whatever reads it. */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		/* No metrics endpoint unless a test asks (--metrics-listen
		 * among the extras, which come later and win): daemons of
		 * concurrent tests must not fight over the default port. */
		execl(bin, "kvd", "--foreground", "--socket", d->sock, "--threads", "2",
		      "--log-level", getenv("KVD_TEST_LOG") ? "debug" : "warning",
		      "--metrics-listen", "", a1, a2, a3, a4, (char *)NULL);
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
		if (waitpid(d->pid, NULL, WNOHANG) == d->pid)
			return -1;
		daemon_sleep_ms(20);
	}
	return -1;
}

static inline int daemon_start(struct daemon *d, const char *extra_flag)
{
	return daemon_start4(d, extra_flag, NULL, NULL, NULL);
}

/* SIGTERM and wait: returns the daemon's exit status (0 when it drained and
 * exited cleanly), or -1. */
static inline int daemon_stop(struct daemon *d)
{
	int st;

	if (d->pid <= 0)
		return -1;
	kill(d->pid, SIGTERM);
	if (waitpid(d->pid, &st, 0) != d->pid)
		return -1;
	d->pid = 0;
	rmdir(d->dir);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

#endif
