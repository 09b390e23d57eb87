/* Each uid's fair share of the executor and of the loop (kvd/fair.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/clock.h"
#include "engine/log.h"
#include "fair.h"

/* A uid's control budget holds at most one second of its share. */
static int64_t burst_ns(const struct kvd_fairs *fs)
{
	return (int64_t)fs->ctl_pct * 10000000;
}

struct kvd_fair *kvd_fair_get(struct kvd_fairs *fs, uint32_t uid)
{
	struct kvd_fair *f = kvd_fair_find(fs, uid);

	if (!f && (f = calloc(1, sizeof *f))) {
		f->uid = uid;
		f->vtime = fs->uvclock;         /* a newcomer starts level, not ahead */
		f->ctl_budget_ns = burst_ns(fs);
		f->ctl_at_ns = kvd_now_ns();
		f->next = fs->list;
		fs->list = f;
	} else if (f && !f->refs) {
		fs->idle--;
	}
	if (f)
		f->refs++;
	return f;
}

struct kvd_fair *kvd_fair_find(struct kvd_fairs *fs, uint32_t uid)
{
	struct kvd_fair *f;

	for (f = fs->list; f && f->uid != uid; f = f->next)
		;
	return f;
}

int kvd_fair_refill(struct kvd_fairs *fs, struct kvd_fair *f, uint64_t now)
{
	if (now > f->ctl_at_ns) {
		int64_t add = (int64_t)((now - f->ctl_at_ns) * fs->ctl_pct / 100);

		f->ctl_budget_ns += add;
		if (f->ctl_budget_ns > burst_ns(fs))
			f->ctl_budget_ns = burst_ns(fs);
		f->ctl_at_ns = now;
	}
	return f->ctl_budget_ns > 0;
}

void kvd_fair_spent(struct kvd_fair *f, uint64_t ns)
{
	f->ctl_budget_ns -= (int64_t)ns;
	f->ctl_ns += ns;
}

/* Whether an entry without connections may go: nothing owed, nothing
 * waiting to be logged. */
static int paid_up(struct kvd_fairs *fs, struct kvd_fair *f, uint64_t now)
{
	kvd_fair_refill(fs, f, now);
	return f->ctl_budget_ns >= burst_ns(fs) && !f->log_quiet;
}

static void unlink_free(struct kvd_fair **pp)
{
	struct kvd_fair *f = *pp;

	*pp = f->next;
	free(f);
}

void kvd_fair_put(struct kvd_fairs *fs, struct kvd_fair *f)
{
	struct kvd_fair **pp = &fs->list;

	if (!f || --f->refs)
		return;
	if (!paid_up(fs, f, kvd_now_ns())) {
		fs->idle++;
		return;
	}
	while (*pp && *pp != f)
		pp = &(*pp)->next;
	if (*pp)
		unlink_free(pp);
}

void kvd_fair_gc(struct kvd_fairs *fs)
{
	uint64_t now = kvd_now_ns();

	for (struct kvd_fair **pp = &fs->list; *pp && fs->idle;) {
		struct kvd_fair *f = *pp;

		if (f->refs) {
			pp = &f->next;
			continue;
		}
		if (f->log_quiet && now - f->log_ns >= 1000000000u) {
			kvd_log(LOG_NOTICE, "uid %u: %u more line(s) about its connections "
				"not logged", f->uid, f->log_quiet);
			f->log_quiet = 0;
		}
		if (!paid_up(fs, f, now)) {
			pp = &f->next;
			continue;
		}
		fs->idle--;
		unlink_free(pp);
	}
}

void kvd_fair_destroy(struct kvd_fairs *fs)
{
	while (fs->list)
		unlink_free(&fs->list);
	fs->idle = 0;
}

void kvd_fair_log(struct kvd_fair *f, int level, const char *fmt, ...)
{
	uint64_t now = kvd_now_ns();
	char line[512];
	va_list ap;

	if (!f || now - f->log_ns >= 1000000000u) {
		if (f) {
			f->log_ns = now;
			f->log_lines = 0;
		}
	} else if (f->log_lines >= KVD_FAIR_LOG_LINES) {
		f->log_quiet++;
		return;
	}
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	if (f && f->log_quiet) {
		kvd_log(level, "%s (and %u more about uid %u not logged)", line, f->log_quiet,
			f->uid);
		f->log_quiet = 0;
	} else {
		kvd_log(level, "%s", line);
	}
	if (f)
		f->log_lines++;
}
