/* kvd_log: structured-enough logs on stderr.  Under systemd (JOURNAL_STREAM
 * set) each line carries a "<N>" priority prefix that journald understands;
 * otherwise a timestamp.  Only the edges (main, the server) log. */
#ifndef KVD_LOG_H
#define KVD_LOG_H

#include <syslog.h>

void kvd_log_level(int max_level);      /* LOG_ERR .. LOG_DEBUG; default LOG_INFO */
int kvd_log_parse_level(const char *name);  /* "error".."debug", or -1 */
void kvd_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Points stderr at `path` (appending, created 0640); called at start and on
 * SIGHUP so a rotated log is reopened.  0 or -errno (stderr unchanged). */
int kvd_log_open(const char *path);

#endif
