#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

static int max_level = LOG_INFO;

void kvd_log_level(int lvl)
{
	max_level = lvl;
}

int kvd_log_parse_level(const char *name)
{
	static const char *const names[] = {
		[LOG_ERR] = "error", [LOG_WARNING] = "warning", [LOG_NOTICE] = "notice",
		[LOG_INFO] = "info", [LOG_DEBUG] = "debug",
	};

	for (int i = 0; i <= LOG_DEBUG; i++)
		if (names[i] && !strcmp(names[i], name))
			return i;
	return -1;
}

void kvd_log(int level, const char *fmt, ...)
{
	char line[1024];
	va_list ap;

	if (level > max_level)
		return;
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	if (getenv("JOURNAL_STREAM")) {
		fprintf(stderr, "<%d>%s\n", level, line);
	} else {
		struct timespec ts;
		struct tm tm;
		char when[32];

		clock_gettime(CLOCK_REALTIME, &ts);
		gmtime_r(&ts.tv_sec, &tm);
		strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
		fprintf(stderr, "%s.%03ldZ kvd[%c] %s\n", when, ts.tv_nsec / 1000000,
			"EACEWNID"[level & 7], line);
	}
}

int kvd_log_open(const char *path)
{
	int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);

	if (fd < 0)
		return -errno;
	fflush(stderr);
	if (dup2(fd, STDERR_FILENO) < 0) {
		int e = -errno;

		close(fd);
		return e;
	}
	close(fd);
	return 0;
}
