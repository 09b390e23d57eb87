/* kvd_config: defaults, the INI file, the command line.  See config.h. */
#include <errno.h>
#include <stddef.h>
#include <getopt.h>
#include <grp.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <syslog.h>
#include <unistd.h>

#include <ini.h>

#include "config.h"
#include "proto/ctl.h"
#include "metrics.h"

__attribute__((format(printf, 3, 4)))
static int fail(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return -EINVAL;
}

/* A value for a message: escaped, cut after 64 bytes. */
static const char *show(char *out, size_t cap, const char *s)
{
	size_t o = 0, i;

	for (i = 0; s[i] && i < 64 && o + 5 < cap; i++) {
		unsigned char ch = (unsigned char)s[i];

		if (ch >= 0x20 && ch <= 0x7e && ch != '\'' && ch != '\\')
			out[o++] = (char)ch;
		else
			o += (size_t)snprintf(out + o, cap - o, "\\x%02x", ch);
	}
	out[o] = 0;
	if (s[i] && o + 4 < cap)
		strcat(out, "...");
	return out;
}

static uint64_t phys_bytes(void)
{
	long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);

	return pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
}

void kvd_config_defaults(struct kvd_config *c)
{
	memset(c, 0, sizeof(*c));
	strcpy(c->socket_path, KVD_CONFIG_SOCKET);
	c->threads = 0;
	c->mem_limit = phys_bytes() / 100 * 75;     /* as "limit = 75%" */
	c->log_level = LOG_INFO;
	c->slots = 16;
	c->slot_size = 4ull << 20;
	c->sq_entries = 256;
	c->spin_ns = 50000;
	c->mem_high = 90;
	c->mem_low = 80;
	c->spill_qd = 64;
	c->spill_block = 1u << 20;
	c->connections = 1024;
	c->connections_per_uid = 256;
	c->sequences = 65536;
	c->sequences_per_uid = 16384;
	c->profiles = 256;
	c->profiles_per_uid = 16;
	c->memory_per_uid_pct = 100;
	c->spill_per_uid_pct = 100;
	c->remote_per_uid_pct = 100;
	/* A default region (16 slots of 4 MiB) is 64 MiB: 16 GiB is 256 such
	 * connections of one uid, or one of the largest arena Hello allows. */
	c->shm = 64ull << 30;
	c->shm_per_uid = 16ull << 30;
	c->control_cpu_pct = 20;
	strcpy(c->metrics_listen, KVD_CONFIG_METRICS);
	c->metrics_request_ms = 10000;
	strcpy(c->remote_prefix, "kvd");
	c->remote_connect_ms = 500;
	c->remote_timeout_ms = 2000;
	c->remote_retry_ms = 5000;
	c->remote_wait_ms = 1000;
	c->remote_chunk = 4u << 20;
}

/* ---- values ------------------------------------------------------------- */

/* Digits only (no sign, no space, no hex), at least one, no overflow. */
static int parse_u64(const char **s, uint64_t *out)
{
	const char *p = *s;
	uint64_t v = 0;

	if (*p < '0' || *p > '9')
		return -1;
	for (; *p >= '0' && *p <= '9'; p++) {
		if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, (uint64_t)(*p - '0'), &v))
			return -1;
	}
	*s = p;
	*out = v;
	return 0;
}

static int parse_uint(const char *s, uint64_t max, uint64_t *out, char *why, size_t n)
{
	if (parse_u64(&s, out) || *s)
		return fail(why, n, "not a whole number");
	if (*out > max)
		return fail(why, n, "above %llu", (unsigned long long)max);
	return 0;
}

/* SIZE: digits, then nothing or K M G T (lower case too), optionally
 * followed by "iB".  Binary multiples. */
static int parse_size(const char *s, uint64_t *out, char *why, size_t n)
{
	static const char units[] = "KMGT";
	const char *u;
	uint64_t v;

	if (parse_u64(&s, &v))
		return fail(why, n, "not a size (digits, then K, M, G or T)");
	if (*s) {
		char ch = *s >= 'a' && *s <= 'z' ? (char)(*s - 'a' + 'A') : *s;

		u = strchr(units, ch);
		if (!u || !ch || (s[1] && strcmp(s + 1, "iB")))
			return fail(why, n, "unknown size suffix '%s' (K, M, G, T)", s);
		for (int i = 0; i <= u - units; i++) {
			if (__builtin_mul_overflow(v, 1024, &v))
				return fail(why, n, "too large");
		}
	}
	*out = v;
	return 0;
}

static int set_socket(struct kvd_config *c, const char *v, char *why, size_t n)
{
	size_t len = strlen(v);

	if (!len)
		return fail(why, n, "empty path");
	if (len >= sizeof(c->socket_path))
		return fail(why, n, "path of %zu bytes, a Unix socket's is at most %zu", len,
			    sizeof(c->socket_path) - 1);
	memcpy(c->socket_path, v, len + 1);
	return 0;
}

/* A group name or a numeric gid, resolved now (before any thread). */
static int set_admin_group(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (*v >= '0' && *v <= '9') {
		if (parse_uint(v, 0xfffffffeu, &x, why, n))
			return -EINVAL;
	} else {
		const struct group *g = getgrnam(v);

		if (!g)
			return fail(why, n, "no such group");
		x = g->gr_gid;
	}
	if (x == 0)
		return fail(why, n, "gid 0: root's group is no admin group (root is admin anyway)");
	c->admin_group = 1;
	c->admin_gid = (uint32_t)x;
	return 0;
}

static int set_threads(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_uint(v, KVD_CONFIG_THREADS_MAX, &x, why, n))
		return -EINVAL;
	c->threads = (unsigned)x;
	return 0;
}

static int parse_pct(const char *v, uint64_t *x, char *why, size_t n)
{
	size_t len = strlen(v);
	char num[16];

	if (!len || v[len - 1] != '%' || len - 1 >= sizeof(num))
		return fail(why, n, "not a percentage (1%%..100%%)");
	memcpy(num, v, len - 1);
	num[len - 1] = 0;
	if (parse_uint(num, 100, x, why, n) || *x == 0)
		return fail(why, n, "not a percentage (1%%..100%%)");
	return 0;
}

static int set_mem_limit(struct kvd_config *c, const char *v, char *why, size_t n)
{
	size_t len = strlen(v);
	uint64_t x, phys;

	if (len && v[len - 1] == '%') {
		if (parse_pct(v, &x, why, n))
			return -EINVAL;
		phys = phys_bytes();
		if (!phys)
			return fail(why, n, "physical memory size unknown: give bytes");
		c->mem_limit = phys / 100 * x;
		return 0;
	}
	if (parse_size(v, &x, why, n))
		return -EINVAL;
	if (x && x < KVD_CONFIG_MEM_MIN)
		return fail(why, n, "%llu bytes is below 1 MiB (a missing suffix? 0 means unlimited)",
			    (unsigned long long)x);
	c->mem_limit = x;
	return 0;
}

static int set_slots(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_uint(v, KVD_CTL_SLOTS_MAX, &x, why, n))
		return -EINVAL;
	if (!x)
		return fail(why, n, "at least one slot");
	c->slots = (uint32_t)x;
	return 0;
}

static int set_slot_size(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_size(v, &x, why, n))
		return -EINVAL;
	if (x % 4096 || x < KVD_CTL_SLOT_MIN || x > KVD_CTL_SLOT_MAX)
		return fail(why, n, "not a multiple of 4096 in [64K, 256M]");
	c->slot_size = x;
	return 0;
}

static int set_ring(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_uint(v, KVD_CONFIG_RING_MAX, &x, why, n))
		return -EINVAL;
	if (x < KVD_CONFIG_RING_MIN || (x & (x - 1)))
		return fail(why, n, "not a power of two in [%u, %u]", KVD_CONFIG_RING_MIN,
			    KVD_CONFIG_RING_MAX);
	c->sq_entries = (uint32_t)x;
	return 0;
}

static int set_spin(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_uint(v, KVD_CONFIG_SPIN_US_MAX, &x, why, n))
		return -EINVAL;
	c->spin_ns = x * 1000;
	return 0;
}

static int set_mem_high(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_pct(v, &x, why, n))
		return -EINVAL;
	c->mem_high = (uint32_t)x;
	return 0;
}

static int set_mem_low(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_pct(v, &x, why, n))
		return -EINVAL;
	c->mem_low = (uint32_t)x;
	return 0;
}

static int add_spill_dir(struct kvd_config *c, const char *v, size_t len, char *why, size_t n)
{
	if (!len || *v != '/')
		return fail(why, n, "a spill directory must be an absolute path");
	if (len >= sizeof c->spill_dir[0])
		return fail(why, n, "path longer than %zu bytes", sizeof c->spill_dir[0] - 1);
	if (c->spill_ndirs == KVD_CONFIG_SPILL_DIRS)
		return fail(why, n, "more than %d spill directories", KVD_CONFIG_SPILL_DIRS);
	memcpy(c->spill_dir[c->spill_ndirs], v, len);
	c->spill_dir[c->spill_ndirs++][len] = 0;
	return 0;
}

/* The file's `dir` is a colon-separated list that replaces the defaults;
 * each --spill-dir flag adds one (parse_args clears the file's list at the
 * first flag, so flags override the file as everywhere else). */
static int set_spill_dirs(struct kvd_config *c, const char *v, char *why, size_t n)
{
	c->spill_ndirs = 0;
	while (*v) {
		size_t len = strcspn(v, ":");

		if (add_spill_dir(c, v, len, why, n))
			return -EINVAL;
		v += len + (v[len] == ':');
	}
	return 0;
}

static int set_spill_dir_flag(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return add_spill_dir(c, v, strlen(v), why, n);
}

static int set_spill_limit(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return parse_size(v, &c->spill_limit, why, n) ? -EINVAL : 0;
}

static int set_spill_qd(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_uint(v, 4096, &x, why, n))
		return -EINVAL;
	if (x < 32)
		return fail(why, n, "below 32");
	c->spill_qd = (uint32_t)x;
	return 0;
}

static int set_spill_block(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_size(v, &x, why, n))
		return -EINVAL;
	if (!x || x % 4096 || x > (64u << 20))
		return fail(why, n, "not a multiple of 4096 in [4K, 64M]");
	c->spill_block = (uint32_t)x;
	return 0;
}

static int parse_bool(const char *v, int *out, char *why, size_t n)
{
	if (!strcmp(v, "yes") || !strcmp(v, "true") || !strcmp(v, "1"))
		*out = 1;
	else if (!strcmp(v, "no") || !strcmp(v, "false") || !strcmp(v, "0"))
		*out = 0;
	else
		return fail(why, n, "not yes or no");
	return 0;
}

static int set_direct(struct kvd_config *c, const char *v, char *why, size_t n)
{
	int x;

	if (parse_bool(v, &x, why, n))
		return -EINVAL;
	c->spill_buffered = !x;
	return 0;
}

static int set_persist(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return parse_bool(v, &c->persist, why, n) ? -EINVAL : 0;
}

static int set_spill_fault(struct kvd_config *c, const char *v, char *why, size_t n)
{
	if (strlen(v) >= sizeof c->spill_fault)
		return fail(why, n, "longer than %zu bytes", sizeof c->spill_fault - 1);
	snprintf(c->spill_fault, sizeof c->spill_fault, "%s", v);
	c->spill_fault_on = 1;
	return 0;
}

static int set_remote_seeds(struct kvd_config *c, const char *v, char *why, size_t n)
{
	if (strlen(v) >= sizeof c->remote_seeds)
		return fail(why, n, "longer than %zu bytes", sizeof c->remote_seeds - 1);
	snprintf(c->remote_seeds, sizeof c->remote_seeds, "%s", v);
	return 0;
}

static int set_remote_prefix(struct kvd_config *c, const char *v, char *why, size_t n)
{
	if (!*v || strlen(v) >= sizeof c->remote_prefix || strpbrk(v, "{} \t"))
		return fail(why, n, "1..%zu bytes, no braces or spaces", sizeof c->remote_prefix - 1);
	snprintf(c->remote_prefix, sizeof c->remote_prefix, "%s", v);
	return 0;
}

static int set_ms(uint32_t *out, const char *v, uint64_t max, char *why, size_t n)
{
	uint64_t x;

	if (parse_uint(v, max, &x, why, n))
		return -EINVAL;
	*out = (uint32_t)x;
	return 0;
}

static int set_remote_connect(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return set_ms(&c->remote_connect_ms, v, 600000, why, n);
}

static int set_remote_timeout(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return set_ms(&c->remote_timeout_ms, v, 600000, why, n);
}

static int set_remote_retry(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return set_ms(&c->remote_retry_ms, v, 600000, why, n);
}

static int set_remote_replicas(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return set_ms(&c->remote_replicas, v, 16, why, n);
}

static int set_remote_wait(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return set_ms(&c->remote_wait_ms, v, 600000, why, n);
}

static int set_remote_chunk(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_size(v, &x, why, n))
		return -EINVAL;
	if (x < 4096 || x > (512u << 20))
		return fail(why, n, "out of range 4K..512M (Redis takes values up to 512 MiB)");
	c->remote_chunk = (uint32_t)x;
	return 0;
}

static int set_remote_limit(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return parse_size(v, &c->remote_limit, why, n) ? -EINVAL : 0;
}

static int set_remote_evicted(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return parse_bool(v, &c->remote_evicted, why, n) ? -EINVAL : 0;
}

static const struct {
	const char *name;
	int level;
} levels[] = {
	{ "error", LOG_ERR }, { "warning", LOG_WARNING }, { "notice", LOG_NOTICE },
	{ "info", LOG_INFO }, { "debug", LOG_DEBUG }, { "err", LOG_ERR }, { "warn", LOG_WARNING },
};

static int set_level(struct kvd_config *c, const char *v, char *why, size_t n)
{
	for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++) {
		if (!strcmp(v, levels[i].name)) {
			c->log_level = levels[i].level;
			return 0;
		}
	}
	return fail(why, n, "not one of error, warning, notice, info, debug");
}

const char *kvd_config_level_name(int level)
{
	for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++) {
		if (levels[i].level == level)
			return levels[i].name;
	}
	return "?";
}

static int set_log_file(struct kvd_config *c, const char *v, char *why, size_t n)
{
	if (*v && *v != '/')
		return fail(why, n, "not an absolute path");
	if (strlen(v) >= sizeof c->log_path)
		return fail(why, n, "longer than %zu bytes", sizeof c->log_path - 1);
	snprintf(c->log_path, sizeof c->log_path, "%s", v);
	return 0;
}

/* [limits] counts: 1..KVD_CONFIG_COUNT_MAX. */
static int parse_count(const char *v, uint32_t *out, char *why, size_t n)
{
	uint64_t x;

	if (parse_uint(v, KVD_CONFIG_COUNT_MAX, &x, why, n))
		return -EINVAL;
	if (!x)
		return fail(why, n, "at least 1");
	*out = (uint32_t)x;
	return 0;
}

/* SIZE (at least 1 MiB: smaller is a typo, and 0 would mean no cap, above
 * the global) or N% of the global limit, resolved at use because the
 * global may be set later in the file or by a flag. */
static int parse_share(const char *v, uint64_t *bytes, uint32_t *pct, char *why, size_t n)
{
	size_t len = strlen(v);
	uint64_t x;

	if (len && v[len - 1] == '%') {
		if (parse_pct(v, &x, why, n))
			return -EINVAL;
		*pct = (uint32_t)x;
		*bytes = 0;
		return 0;
	}
	if (parse_size(v, &x, why, n))
		return -EINVAL;
	if (x < KVD_CONFIG_MEM_MIN)
		return fail(why, n, "%llu bytes is below 1 MiB (100%% for the whole limit)",
			    (unsigned long long)x);
	*bytes = x;
	*pct = 0;
	return 0;
}

static int set_memory_per_uid(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return parse_share(v, &c->memory_per_uid, &c->memory_per_uid_pct, why, n);
}

static int set_spill_per_uid(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return parse_share(v, &c->spill_per_uid, &c->spill_per_uid_pct, why, n);
}

static int set_remote_per_uid(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return parse_share(v, &c->remote_per_uid, &c->remote_per_uid_pct, why, n);
}

static int set_shm_bytes(uint64_t *out, const char *v, char *why, size_t n)
{
	uint64_t x;

	if (parse_size(v, &x, why, n))
		return -EINVAL;
	if (x < KVD_CONFIG_MEM_MIN)
		return fail(why, n, "%llu bytes is below 1 MiB", (unsigned long long)x);
	*out = x;
	return 0;
}

static int set_shm(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return set_shm_bytes(&c->shm, v, why, n);
}

static int set_shm_per_uid(struct kvd_config *c, const char *v, char *why, size_t n)
{
	return set_shm_bytes(&c->shm_per_uid, v, why, n);
}

/* N% (1..100): the share of one core a uid's control requests may take. */
static int set_control_cpu(struct kvd_config *c, const char *v, char *why, size_t n)
{
	size_t len = strlen(v);
	uint64_t x;
	char num[16];

	if (len < 2 || len >= sizeof num || v[len - 1] != '%')
		return fail(why, n, "want N%% of one core (1%%..100%%)");
	memcpy(num, v, len - 1);
	num[len - 1] = 0;
	if (parse_uint(num, 100, &x, why, n))
		return -EINVAL;
	if (!x)
		return fail(why, n, "at least 1%%");
	c->control_cpu_pct = (uint32_t)x;
	return 0;
}

/* "1000,1001 2000,2001": groups separated by spaces (or tabs), uids in a
 * group by commas; at least two uids a group, none in two groups, none at
 * or above KVD_NS_GROUP (those values name the groups' namespaces). */
static int set_groups(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint32_t uid[KVD_LIMITS_SHARE_MAX], grp[KVD_LIMITS_SHARE_MAX];
	unsigned nu = 0, ng = 0;

	for (;;) {
		unsigned first = nu;

		v += strspn(v, " \t");
		if (!*v)
			break;
		if (ng == KVD_LIMITS_GROUPS_MAX)
			return fail(why, n, "more than %d groups", KVD_LIMITS_GROUPS_MAX);
		for (;;) {
			char num[16];
			size_t len = strcspn(v, ", \t");
			uint64_t x;

			if (!len || len >= sizeof num)
				return fail(why, n, "group %u: %s", ng + 1,
					    len ? "uid too long" : "empty uid (no spaces inside a group)");
			memcpy(num, v, len);
			num[len] = 0;
			if (parse_uint(num, KVD_NS_GROUP - 1, &x, why, n))
				return fail(why, n, "group %u: uid '%s' is not a number below %u", ng + 1,
					    num, KVD_NS_GROUP);
			for (unsigned i = 0; i < nu; i++)
				if (uid[i] == x)
					return fail(why, n, "uid %llu is in %s", (unsigned long long)x,
						    grp[i] == ng ? "its group twice" : "two groups");
			if (nu == KVD_LIMITS_SHARE_MAX)
				return fail(why, n, "more than %d uids in groups", KVD_LIMITS_SHARE_MAX);
			uid[nu] = (uint32_t)x;
			grp[nu++] = ng;
			v += len;
			if (*v != ',')
				break;
			v++;
		}
		if (nu - first < 2)
			return fail(why, n, "group %u has one uid (a group shares between two or more)",
				    ng + 1);
		ng++;
	}
	memset(c->share_uid, 0, sizeof c->share_uid);
	memset(c->share_group, 0, sizeof c->share_group);
	memcpy(c->share_uid, uid, nu * sizeof *uid);
	memcpy(c->share_group, grp, nu * sizeof *grp);
	c->nshare = nu;
	c->ngroups = ng;
	return 0;
}

/* pct of whole; 100% is the whole exactly (whole / 100 * 100 may not be). */
static uint64_t pct_of(uint64_t whole, uint32_t pct)
{
	return pct >= 100 ? whole : whole / 100 * pct;
}

uint64_t kvd_config_memory_per_uid(const struct kvd_config *c)
{
	return c->memory_per_uid_pct ? pct_of(c->mem_limit, c->memory_per_uid_pct) : c->memory_per_uid;
}

uint64_t kvd_config_spill_per_uid(const struct kvd_config *c)
{
	return c->spill_per_uid_pct ? pct_of(c->spill_limit, c->spill_per_uid_pct) : c->spill_per_uid;
}

uint64_t kvd_config_remote_per_uid(const struct kvd_config *c)
{
	return c->remote_per_uid_pct ? pct_of(c->remote_limit, c->remote_per_uid_pct)
				     : c->remote_per_uid;
}

void kvd_config_limits(const struct kvd_config *c, struct kvd_limits_cfg *out)
{
	memset(out, 0, sizeof *out);
	out->cap[KVD_RES_CONNECTIONS] = c->connections;
	out->per_uid[KVD_RES_CONNECTIONS] = c->connections_per_uid;
	out->cap[KVD_RES_SEQUENCES] = c->sequences;
	out->per_uid[KVD_RES_SEQUENCES] = c->sequences_per_uid;
	out->cap[KVD_RES_PROFILES] = c->profiles;
	out->per_uid[KVD_RES_PROFILES] = c->profiles_per_uid;
	out->cap[KVD_RES_MEMORY] = c->mem_limit;
	out->per_uid[KVD_RES_MEMORY] = kvd_config_memory_per_uid(c);
	out->cap[KVD_RES_SHM] = c->shm;
	out->per_uid[KVD_RES_SHM] = c->shm_per_uid;
	out->cap[KVD_RES_SPILL] = c->spill_limit;
	out->per_uid[KVD_RES_SPILL] = kvd_config_spill_per_uid(c);
	/* 100% of the whole is no per-uid cap at all: one check fewer. */
	if (out->per_uid[KVD_RES_MEMORY] == out->cap[KVD_RES_MEMORY])
		out->per_uid[KVD_RES_MEMORY] = 0;
	if (out->per_uid[KVD_RES_SPILL] == out->cap[KVD_RES_SPILL])
		out->per_uid[KVD_RES_SPILL] = 0;
	out->cap[KVD_RES_REMOTE] = c->remote_limit;
	out->per_uid[KVD_RES_REMOTE] = kvd_config_remote_per_uid(c);
	if (out->per_uid[KVD_RES_REMOTE] == out->cap[KVD_RES_REMOTE])
		out->per_uid[KVD_RES_REMOTE] = 0;
	memcpy(out->share_uid, c->share_uid, sizeof out->share_uid);
	memcpy(out->share_group, c->share_group, sizeof out->share_group);
	out->nshare = c->nshare;
}

uint32_t kvd_config_namespace(const struct kvd_config *c, uint32_t uid)
{
	for (unsigned i = 0; i < c->nshare; i++)
		if (c->share_uid[i] == uid)
			return KVD_NS_GROUP | c->share_group[i];
	return uid & KVD_NS_GROUP ? KVD_NS_NONE : uid;
}

/* "" turns the endpoint off; anything else must parse as kvd_metrics_listen
 * takes it. */
static int set_metrics_listen(struct kvd_config *c, const char *v, char *why, size_t n)
{
	struct sockaddr_storage ss;
	socklen_t sl;

	if (strlen(v) >= sizeof c->metrics_listen)
		return fail(why, n, "longer than %zu bytes", sizeof c->metrics_listen - 1);
	if (*v && kvd_metrics_addr_parse(v, &ss, &sl))
		return fail(why, n, "not HOST:PORT (an IPv4 address or [IPv6], a port 0..65535; "
			    "empty: off)");
	snprintf(c->metrics_listen, sizeof c->metrics_listen, "%s", v);
	c->metrics_listen_set = 1;
	return 0;
}

static int set_metrics_request(struct kvd_config *c, const char *v, char *why, size_t n)
{
	uint32_t ms;

	if (set_ms(&ms, v, 600000, why, n))
		return -EINVAL;
	if (ms < 100)
		return fail(why, n, "below 100 (ms)");
	c->metrics_request_ms = ms;
	return 0;
}

typedef int (*setter)(struct kvd_config *c, const char *v, char *why, size_t n);

static const struct key {
	const char *section, *name;
	const char *flag;               /* the long option, or NULL: file only */
	setter set;
	setter set_flag;                /* when the flag differs from the key */
	int bare;                       /* the flag takes no value (means "yes") */
	size_t count;                   /* set NULL: a [limits] count at this offset */
} keys[] = {
	{ "server", "socket", "socket", set_socket, NULL, 0, 0 },
	{ "server", "threads", "threads", set_threads, NULL, 0, 0 },
	{ "server", "admin_group", NULL, set_admin_group, NULL, 0, 0 },
	{ "memory", "limit", "mem-limit", set_mem_limit, NULL, 0, 0 },
	{ "memory", "high", "mem-high", set_mem_high, NULL, 0, 0 },
	{ "memory", "low", "mem-low", set_mem_low, NULL, 0, 0 },
	{ "spill", "dir", "spill-dir", set_spill_dirs, set_spill_dir_flag, 0, 0 },
	{ "spill", "limit", "spill-limit", set_spill_limit, NULL, 0, 0 },
	{ "spill", "queue_depth", NULL, set_spill_qd, NULL, 0, 0 },
	{ "spill", "block", NULL, set_spill_block, NULL, 0, 0 },
	{ "spill", "direct", NULL, set_direct, NULL, 0, 0 },
	{ "spill", "persist", "persist", set_persist, NULL, 1, 0 },
	{ "spill", "fault", "spill-fault", set_spill_fault, NULL, 0, 0 },
	{ "transport", "slots", NULL, set_slots, NULL, 0, 0 },
	{ "transport", "slot_size", NULL, set_slot_size, NULL, 0, 0 },
	{ "transport", "ring_entries", NULL, set_ring, NULL, 0, 0 },
	{ "transport", "spin_us", NULL, set_spin, NULL, 0, 0 },
	{ "limits", "connections", NULL, NULL, NULL, 0, offsetof(struct kvd_config, connections) },
	{ "limits", "connections_per_uid", NULL, NULL, NULL, 0, offsetof(struct kvd_config, connections_per_uid) },
	{ "limits", "sequences", NULL, NULL, NULL, 0, offsetof(struct kvd_config, sequences) },
	{ "limits", "sequences_per_uid", NULL, NULL, NULL, 0, offsetof(struct kvd_config, sequences_per_uid) },
	{ "limits", "profiles", NULL, NULL, NULL, 0, offsetof(struct kvd_config, profiles) },
	{ "limits", "profiles_per_uid", NULL, NULL, NULL, 0, offsetof(struct kvd_config, profiles_per_uid) },
	{ "limits", "memory_per_uid", NULL, set_memory_per_uid, NULL, 0, 0 },
	{ "limits", "spill_per_uid", NULL, set_spill_per_uid, NULL, 0, 0 },
	{ "limits", "shm", NULL, set_shm, NULL, 0, 0 },
	{ "limits", "shm_per_uid", NULL, set_shm_per_uid, NULL, 0, 0 },
	{ "limits", "control_cpu_per_uid", NULL, set_control_cpu, NULL, 0, 0 },
	{ "sharing", "groups", NULL, set_groups, NULL, 0, 0 },
	{ "remote", "seeds", NULL, set_remote_seeds, NULL, 0, 0 },
	{ "remote", "prefix", NULL, set_remote_prefix, NULL, 0, 0 },
	{ "remote", "connect_timeout_ms", NULL, set_remote_connect, NULL, 0, 0 },
	{ "remote", "timeout_ms", NULL, set_remote_timeout, NULL, 0, 0 },
	{ "remote", "retry_ms", NULL, set_remote_retry, NULL, 0, 0 },
	{ "remote", "replicas", NULL, set_remote_replicas, NULL, 0, 0 },
	{ "remote", "wait_timeout_ms", NULL, set_remote_wait, NULL, 0, 0 },
	{ "remote", "chunk", NULL, set_remote_chunk, NULL, 0, 0 },
	{ "remote", "evicted", NULL, set_remote_evicted, NULL, 0, 0 },
	{ "remote", "limit", NULL, set_remote_limit, NULL, 0, 0 },
	{ "limits", "remote_per_uid", NULL, set_remote_per_uid, NULL, 0, 0 },
	{ "metrics", "listen", "metrics-listen", set_metrics_listen, NULL, 0, 0 },
	{ "metrics", "request_timeout_ms", NULL, set_metrics_request, NULL, 0, 0 },
	{ "log", "level", "log-level", set_level, NULL, 0, 0 },
	{ "log", "file", "log-file", set_log_file, NULL, 0, 0 },
};
#define NKEYS (sizeof(keys) / sizeof(keys[0]))

static int known_section(const char *s, size_t len)
{
	for (size_t i = 0; i < NKEYS; i++) {
		if (strlen(keys[i].section) == len && !memcmp(keys[i].section, s, len))
			return 1;
	}
	return 0;
}

/* [limits]: ranges (for a struct not made by the setters), and every
 * per-uid value at most its global one. */
static int check_limits(const struct kvd_config *c, char *err, size_t errlen)
{
	const struct {
		const char *name;
		uint32_t global, per_uid;
	} cnt[] = {
		{ "connections", c->connections, c->connections_per_uid },
		{ "sequences", c->sequences, c->sequences_per_uid },
		{ "profiles", c->profiles, c->profiles_per_uid },
	};

	for (size_t i = 0; i < sizeof cnt / sizeof cnt[0]; i++) {
		if (!cnt[i].global || cnt[i].global > KVD_CONFIG_COUNT_MAX || !cnt[i].per_uid)
			return fail(err, errlen, "[limits] %s %u / %s_per_uid %u out of range 1..%u",
				    cnt[i].name, cnt[i].global, cnt[i].name, cnt[i].per_uid,
				    KVD_CONFIG_COUNT_MAX);
		if (cnt[i].per_uid > cnt[i].global)
			return fail(err, errlen,
				    "[limits] %s_per_uid %u is above %s %u (lower it, or raise %s)",
				    cnt[i].name, cnt[i].per_uid, cnt[i].name, cnt[i].global, cnt[i].name);
	}
	if (c->control_cpu_pct < 1 || c->control_cpu_pct > 100)
		return fail(err, errlen, "[limits] control_cpu_per_uid %u%% out of range 1%%..100%%",
			    c->control_cpu_pct);
	if (c->shm_per_uid > c->shm)
		return fail(err, errlen, "[limits] shm_per_uid %llu bytes is above shm %llu "
			    "(lower it, or raise shm)", (unsigned long long)c->shm_per_uid,
			    (unsigned long long)c->shm);
	if (c->memory_per_uid_pct > 100 || c->spill_per_uid_pct > 100 ||
	    c->remote_per_uid_pct > 100 ||
	    (!c->memory_per_uid_pct && c->memory_per_uid < KVD_CONFIG_MEM_MIN) ||
	    (!c->spill_per_uid_pct && c->spill_per_uid < KVD_CONFIG_MEM_MIN) ||
	    (!c->remote_per_uid_pct && c->remote_per_uid < KVD_CONFIG_MEM_MIN))
		return fail(err, errlen, "[limits] memory_per_uid, spill_per_uid or remote_per_uid "
			    "out of range");
	if (!c->remote_per_uid_pct && c->remote_limit && c->remote_per_uid > c->remote_limit)
		return fail(err, errlen, "[limits] remote_per_uid %llu bytes is above [remote] limit "
			    "%llu", (unsigned long long)c->remote_per_uid,
			    (unsigned long long)c->remote_limit);
	if (!c->memory_per_uid_pct && c->mem_limit && c->memory_per_uid > c->mem_limit)
		return fail(err, errlen, "[limits] memory_per_uid %llu bytes is above [memory] limit %llu",
			    (unsigned long long)c->memory_per_uid, (unsigned long long)c->mem_limit);
	if (!c->spill_per_uid_pct && c->spill_limit && c->spill_per_uid > c->spill_limit)
		return fail(err, errlen, "[limits] spill_per_uid %llu bytes is above [spill] limit %llu",
			    (unsigned long long)c->spill_per_uid, (unsigned long long)c->spill_limit);
	if (c->nshare > KVD_LIMITS_SHARE_MAX || c->ngroups > KVD_LIMITS_GROUPS_MAX)
		return fail(err, errlen, "[sharing] groups out of range");
	return 0;
}

int kvd_config_check(const struct kvd_config *c, char *err, size_t errlen)
{
	struct kvd_ctl_err e;
	size_t len = strnlen(c->socket_path, sizeof(c->socket_path));

	if (!len || len == sizeof(c->socket_path))
		return fail(err, errlen, "socket path empty or not terminated");
	if (c->threads > KVD_CONFIG_THREADS_MAX)
		return fail(err, errlen, "threads %u above %u", c->threads, KVD_CONFIG_THREADS_MAX);
	if (c->mem_limit && c->mem_limit < KVD_CONFIG_MEM_MIN)
		return fail(err, errlen, "memory limit %llu below 1 MiB",
			    (unsigned long long)c->mem_limit);
	if (c->sq_entries < KVD_CONFIG_RING_MIN || c->sq_entries > KVD_CONFIG_RING_MAX ||
	    (c->sq_entries & (c->sq_entries - 1)))
		return fail(err, errlen, "ring_entries %u is not a power of two in [%u, %u]",
			    c->sq_entries, KVD_CONFIG_RING_MIN, KVD_CONFIG_RING_MAX);
	if (c->spin_ns > (uint64_t)KVD_CONFIG_SPIN_US_MAX * 1000)
		return fail(err, errlen, "spin of %llu ns above 1 s", (unsigned long long)c->spin_ns);
	if (c->log_level < LOG_ERR || c->log_level > LOG_DEBUG)
		return fail(err, errlen, "log level %d out of range", c->log_level);
	if (c->mem_low >= c->mem_high || c->mem_high > 100)
		return fail(err, errlen, "[memory] low %u%% must be below high %u%%", c->mem_low,
			    c->mem_high);
	if (c->persist && !c->spill_ndirs)
		return fail(err, errlen, "persist needs a spill directory");
	if (c->remote_seeds[0] && !c->spill_ndirs)
		return fail(err, errlen, "[remote] needs a spill directory (prefixes pass through it)");
	if (kvd_ctl_check_arena(c->slots, c->slot_size, &e))
		return fail(err, errlen, "[transport] %s", e.msg);
	return check_limits(c, err, errlen);
}

/* ---- the file ----------------------------------------------------------- */

struct ini_ctx {
	struct kvd_config *c;
	FILE *f;
	const char *path;
	unsigned line;                  /* of the line inih is working on */
	unsigned seen[NKEYS];           /* line each key was set on, 0: not yet */
	unsigned err_line;              /* of the first error we found, 0: none */
	char *err;
	size_t errlen;
};

__attribute__((format(printf, 2, 3)))
static void ctx_fail(struct ini_ctx *x, const char *fmt, ...)
{
	char m[512];
	va_list ap;

	if (x->err_line)
		return;                 /* the first error is the one to fix */
	va_start(ap, fmt);
	vsnprintf(m, sizeof(m), fmt, ap);
	va_end(ap);
	x->err_line = x->line;
	snprintf(x->err, x->errlen, "%s:%u: %s", x->path, x->line, m);
}

/* inih's line reader (fgets-like), with jobs inih cannot do: count lines
 * (this libinih is built without INI_HANDLER_LINENO), see section headers
 * (inih reports only keys, so an empty unknown section would pass) and
 * strip indentation (below).
 * A line too long for inih's buffer is an error, and its rest is swallowed
 * so inih's line count stays ours. */
static char *line_reader(char *str, int num, void *stream)
{
	struct ini_ctx *x = stream;
	char *s = fgets(str, num, x->f), *p;
	size_t len;

	if (!s)
		return NULL;
	x->line++;
	len = strlen(s);
	if ((len == 0 || s[len - 1] != '\n') && !feof(x->f)) {
		int ch;

		ctx_fail(x, "line longer than %d bytes (or a NUL byte in it)", num - 2);
		while ((ch = fgetc(x->f)) != EOF && ch != '\n')
			;
		s[0] = 0;
		return s;
	}
	p = s;
	if (x->line == 1 && !strncmp(p, "\xEF\xBB\xBF", 3))
		p += 3;
	p += strspn(p, " \t");
	/* inih would take an indented line for the continuation of the key
	 * above (INI_ALLOW_MULTILINE): values are one line here, and indenting
	 * keys is common, so inih never sees the indentation. */
	memmove(s, p, strlen(p) + 1);
	p = s;
	if (*p == '[') {
		char *end = strchr(p, ']'), v[300];

		/* A header inih cannot parse is its syntax error, reported below. */
		if (end && !known_section(p + 1, (size_t)(end - p - 1))) {
			*end = 0;
			ctx_fail(x, "unknown section [%s]", show(v, sizeof(v), p + 1));
			*end = ']';
		}
	}
	return s;
}

static int on_key(void *user, const char *section, const char *name, const char *value)
{
	struct ini_ctx *x = user;
	char why[200], v[300];

	if (!section[0]) {
		ctx_fail(x, "%s = '%s': key outside a section", name, show(v, sizeof(v), value));
		return 0;
	}
	for (size_t i = 0; i < NKEYS; i++) {
		if (strcmp(section, keys[i].section) || strcmp(name, keys[i].name))
			continue;
		if (x->seen[i]) {
			ctx_fail(x, "[%s] %s given twice (first on line %u)", section, name, x->seen[i]);
			return 0;
		}
		x->seen[i] = x->line;
		if (keys[i].set ? keys[i].set(x->c, value, why, sizeof(why))
				: parse_count(value, (uint32_t *)((char *)x->c + keys[i].count), why,
					      sizeof(why))) {
			ctx_fail(x, "[%s] %s = '%s': %s", section, name, show(v, sizeof(v), value), why);
			return 0;
		}
		return 1;
	}
	if (!known_section(section, strlen(section)))
		ctx_fail(x, "unknown section [%s]", section);
	else
		ctx_fail(x, "[%s] %s: unknown key", section, name);
	return 0;
}

int kvd_config_load_file(struct kvd_config *c, const char *path, char *err, size_t errlen)
{
	struct kvd_config tmp = *c;
	struct ini_ctx x = { .c = &tmp, .path = path, .err = err, .errlen = errlen };
	char dummy[1];
	int rc;

	if (!err || !errlen) {
		x.err = dummy;
		x.errlen = sizeof(dummy);
	}
	if (strlen(path) >= sizeof(c->config_path))
		return fail(err, errlen, "config path longer than %zu bytes", sizeof(c->config_path) - 1);
	x.f = fopen(path, "re");
	if (!x.f) {
		rc = -errno;
		fail(err, errlen, "%s: %s", path, strerror(-rc));
		return rc;
	}
	rc = ini_parse_stream(line_reader, &x, on_key, &x);
	if (ferror(x.f) && !x.err_line) {
		fclose(x.f);
		fail(err, errlen, "%s: read error", path);
		return -EIO;
	}
	fclose(x.f);
	if (rc > 0 && (!x.err_line || (unsigned)rc < x.err_line)) {
		/* inih's own: a line that is neither [section], key = value nor
		 * a comment.  Its line count is ours (one reader call a line). */
		x.err_line = 0;
		x.line = (unsigned)rc;
		ctx_fail(&x, "syntax error: expected [section], key = value or a comment");
	}
	if (rc < 0 && !x.err_line) {
		fail(err, errlen, "%s: out of memory", path);
		return -ENOMEM;
	}
	if (x.err_line)
		return -EINVAL;
	strcpy(tmp.config_path, path);
	rc = kvd_config_check(&tmp, x.err, x.errlen);
	if (rc) {
		char m[512];

		snprintf(m, sizeof(m), "%s", x.err);
		return fail(err, errlen, "%s: %s", path, m);
	}
	*c = tmp;
	return 0;
}

/* ---- the command line --------------------------------------------------- */

enum { OPT_FLAG = 256 };        /* OPT_FLAG + i: keys[i]'s flag */

int kvd_config_parse_args(struct kvd_config *c, int argc, char **argv, char *err,
			  size_t errlen)
{
	struct option opts[NKEYS + 4];
	struct kvd_config tmp = *c;
	const char *config = NULL;
	int n = 0, ch, help = 0, rc;

	for (size_t i = 0; i < NKEYS; i++) {
		if (keys[i].flag)
			opts[n++] = (struct option){ keys[i].flag,
						     keys[i].bare ? no_argument : required_argument,
						     NULL, OPT_FLAG + (int)i };
	}
	opts[n++] = (struct option){ "config", required_argument, NULL, 'c' };
	opts[n++] = (struct option){ "foreground", no_argument, NULL, 'f' };
	opts[n++] = (struct option){ "help", no_argument, NULL, 'h' };
	opts[n] = (struct option){ 0 };

	/* Pass 1: find --config (and --help, and every syntax error) before
	 * applying anything, so the file sits below every flag whatever
	 * their order.  "+": no permuting, stop at the first operand;
	 * ":": report a missing value apart from an unknown option. */
	opterr = 0;
	optind = 0;
	while ((ch = getopt_long(argc, argv, "+:c:fh", opts, NULL)) != -1) {
		switch (ch) {
		case 'c':
			if (config)
				return fail(err, errlen, "--config given twice");
			config = optarg;
			break;
		case 'h':
			help = 1;
			break;
		case ':':
			return fail(err, errlen, "option '%s' needs a value", argv[optind - 1]);
		case '?':
			if (optopt)
				return fail(err, errlen, "unknown option '-%c' (try --help)", optopt);
			return fail(err, errlen, "unknown option '%s' (try --help)", argv[optind - 1]);
		default:
			break;
		}
	}
	if (optind < argc)
		return fail(err, errlen, "unexpected argument '%s' (try --help)", argv[optind]);
	if (help)
		return KVD_CONFIG_HELP;
	if (config) {
		rc = kvd_config_load_file(&tmp, config, err, errlen);
		if (rc)
			return rc;
	}

	optind = 0;
	int dirs_from_flags = 0;

	while ((ch = getopt_long(argc, argv, "+:c:fh", opts, NULL)) != -1) {
		char why[200], v[300];
		const struct key *k;
		const char *arg = optarg;

		if (ch == 'f')
			tmp.foreground = 1;
		if (ch < OPT_FLAG)
			continue;
		k = &keys[ch - OPT_FLAG];
		if (k->set_flag == set_spill_dir_flag && !dirs_from_flags++)
			tmp.spill_ndirs = 0;
		if (k->bare)
			arg = "yes";
		if ((k->set_flag ? k->set_flag : k->set)(&tmp, arg, why, sizeof(why)))
			return fail(err, errlen, "--%s '%s': %s", k->flag, show(v, sizeof(v), arg), why);
	}
	rc = kvd_config_check(&tmp, err, errlen);
	if (rc)
		return rc;
	*c = tmp;
	return 0;
}

void kvd_config_usage(FILE *f, const char *argv0)
{
	fprintf(f,
		"usage: %s [options]\n"
		"  -c, --config PATH     read this INI file first (flags override it)\n"
		"  -f, --foreground      stay in the foreground (kvd never forks; for scripts)\n"
		"      --socket PATH     control socket (default " KVD_CONFIG_SOCKET ")\n"
		"      --threads N       worker threads (0: one per online CPU)\n"
		"      --mem-limit SIZE  memory budget: bytes with K/M/G/T, or N%% of RAM;\n"
		"                        0: unlimited (default 75%%)\n"
		"      --mem-high N%%    start spilling above N%% of the limit (default 90%%)\n"
		"      --mem-low N%%     spill down to N%% of the limit (default 80%%)\n"
		"      --spill-dir PATH  spill cold sequences here (repeatable; none: no spill)\n"
		"      --spill-limit SIZE  cap on bytes on disk over all spill dirs (0: none)\n"
		"      --persist         keep spilled sequences across restarts\n"
		"      --spill-fault SPEC  tests only: fake I/O backend injecting SPEC\n"
		"      --metrics-listen HOST:PORT  Prometheus endpoint (default " KVD_CONFIG_METRICS ";\n"
		"                        '' turns it off)\n"
		"      --log-level LEVEL error, warning, notice, info (default) or debug\n"
		"      --log-file PATH   append logs to PATH (SIGHUP reopens it) instead of stderr\n"
		"  -h, --help            this text\n",
		argv0);
}
