/* NumPy .npy files.  The header is untrusted: it is parsed by a strict
 * recogniser for the one dict numpy writes, never by anything general, and
 * every length is checked before it is used.
 *
 * Accepted header, as numpy itself would read it: a Python dict literal with
 * exactly the keys 'descr', 'fortran_order' and 'shape' in any order, quoted
 * with ' or " (no escapes), 'descr' one of '<f4' '<f2', 'fortran_order'
 * False, 'shape' a tuple of 1..4 decimal integers >= 1 ("(5,)", "(2, 3)",
 * "(2, 3,)"), an optional trailing comma, blanks (space, tab, CR, LF)
 * anywhere between tokens and after the closing brace.  Nothing else.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "npy.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "npy.c reads and writes little-endian data in place"
#endif

#define MAGIC        "\x93NUMPY"
#define MAGIC_LEN    6
/* numpy itself refuses headers over 10000 bytes; anything near this is an
 * attack, and load() must not allocate what a hostile length asks for. */
#define MAX_HEADER   (1u << 20)
/* A trace of one layer is a few hundred MB; refuse what cannot be a trace
 * before malloc, which may overcommit, says yes to it. */
#define MAX_LOAD     (64ull << 30)
#define ALIGN        64         /* numpy's ARRAY_ALIGN: data offset multiple */
#define CHUNK        (1u << 16)

struct cur {
	const char *p, *end;
};

static int is_blank(char c)
{
	return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static void skip_blank(struct cur *c)
{
	while (c->p < c->end && is_blank(*c->p))
		c->p++;
}

static int eat(struct cur *c, char ch)
{
	skip_blank(c);
	if (c->p == c->end || *c->p != ch)
		return 0;
	c->p++;
	return 1;
}

static int peek(struct cur *c, char ch)
{
	skip_blank(c);
	return c->p < c->end && *c->p == ch;
}

/* A quoted string without escapes; *s points into the header. */
static int string(struct cur *c, const char **s, size_t *n)
{
	char q;

	skip_blank(c);
	if (c->p == c->end || (*c->p != '\'' && *c->p != '"'))
		return 0;
	q = *c->p++;
	*s = c->p;
	while (c->p < c->end && *c->p != q) {
		if (*c->p == '\\' || *c->p == '\n' || *c->p == '\r')
			return 0;
		c->p++;
	}
	if (c->p == c->end)
		return 0;
	*n = (size_t)(c->p - *s);
	c->p++;
	return 1;
}

static int is_ident(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
	       c == '_';
}

static int word(struct cur *c, const char *w)
{
	size_t n = strlen(w);

	skip_blank(c);
	if ((size_t)(c->end - c->p) < n || memcmp(c->p, w, n) != 0)
		return 0;
	if (c->p + n < c->end && is_ident(c->p[n]))
		return 0;
	c->p += n;
	return 1;
}

/* A Python decimal literal: no sign, no leading zero, no '_'. */
static int uint_lit(struct cur *c, uint64_t *v)
{
	uint64_t x = 0;
	const char *s;

	skip_blank(c);
	s = c->p;
	while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
		if (__builtin_mul_overflow(x, 10, &x) ||
		    __builtin_add_overflow(x, (uint64_t)(*c->p - '0'), &x))
			return 0;
		c->p++;
	}
	if (c->p == s || (*s == '0' && c->p - s > 1))
		return 0;
	if (c->p < c->end && is_ident(*c->p))
		return 0;
	*v = x;
	return 1;
}

/* "(a,)", "(a, b)" or "(a, b,)": Python needs the comma of a 1-tuple, and
 * numpy wants a tuple, so "(a)" is refused like "()". */
static int shape(struct cur *c, struct kvd_npy *h)
{
	if (!eat(c, '('))
		return 0;
	for (;;) {
		uint64_t x;

		if (h->ndim == KVD_NPY_MAXDIM || !uint_lit(c, &x) || x == 0)
			return 0;
		h->shape[h->ndim++] = x;
		if (eat(c, ',')) {
			if (peek(c, ')'))
				break;
		} else if (peek(c, ')') && h->ndim > 1) {
			break;
		} else {
			return 0;
		}
	}
	return eat(c, ')');
}

enum { K_DESCR = 1, K_FORTRAN = 2, K_SHAPE = 4, K_ALL = 7 };

static int entry(struct cur *c, struct kvd_npy *h, unsigned *seen)
{
	const char *k, *v;
	size_t kn, vn;
	unsigned bit;

	if (!string(c, &k, &kn) || !eat(c, ':'))
		return 0;
	if (kn == 5 && memcmp(k, "descr", 5) == 0)
		bit = K_DESCR;
	else if (kn == 13 && memcmp(k, "fortran_order", 13) == 0)
		bit = K_FORTRAN;
	else if (kn == 5 && memcmp(k, "shape", 5) == 0)
		bit = K_SHAPE;
	else
		return 0;
	if (*seen & bit)
		return 0;
	*seen |= bit;

	switch (bit) {
	case K_DESCR:
		if (!string(c, &v, &vn) || vn != 3 || memcmp(v, "<f", 2) != 0)
			return 0;
		if (v[2] == '4')
			h->itemsize = 4;
		else if (v[2] == '2')
			h->itemsize = 2;
		else
			return 0;
		return 1;
	case K_FORTRAN:
		return word(c, "False");
	default:
		return shape(c, h);
	}
}

static int dict(struct cur *c, struct kvd_npy *h)
{
	unsigned seen = 0;

	if (!eat(c, '{'))
		return 0;
	while (!peek(c, '}')) {
		if (!entry(c, h, &seen))
			return 0;
		if (!eat(c, ',') && !peek(c, '}'))
			return 0;
	}
	c->p++;
	skip_blank(c);
	return seen == K_ALL && c->p == c->end;
}

/* The preamble: data offset and header bounds, from the first 12 bytes. */
static int preamble(const unsigned char *b, size_t have, size_t *hoff, size_t *doff)
{
	size_t hlen;

	if (have < MAGIC_LEN + 4 || memcmp(b, MAGIC, MAGIC_LEN) != 0 || b[7] != 0)
		return -KVD_EFORMAT;
	switch (b[6]) {
	case 1:
		hlen = b[8] | (size_t)b[9] << 8;
		*hoff = 10;
		break;
	case 2:
	case 3:
		if (have < 12)
			return -KVD_EFORMAT;
		hlen = b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24;
		*hoff = 12;
		break;
	default:
		return -KVD_EFORMAT;
	}
	if (hlen > MAX_HEADER)
		return -KVD_EFORMAT;
	*doff = *hoff + hlen;
	return 0;
}

/* buf holds the first `have` bytes (at least the header) of a file of
 * `total` bytes. */
static int parse(const void *buf, size_t have, size_t total, struct kvd_npy *out)
{
	const unsigned char *b = buf;
	struct kvd_npy h = { 0 };
	struct cur c;
	size_t hoff, doff;
	uint64_t bytes;

	if (preamble(b, have, &hoff, &doff) || doff > have || have > total)
		return -KVD_EFORMAT;
	/* Printable ASCII and blanks only: no NUL or UTF-8 to trip on. */
	for (size_t i = hoff; i < doff; i++)
		if ((b[i] < 0x20 || b[i] > 0x7e) && !is_blank((char)b[i]))
			return -KVD_EFORMAT;
	c.p = (const char *)b + hoff;
	c.end = (const char *)b + doff;
	if (!dict(&c, &h))
		return -KVD_EFORMAT;

	h.count = 1;
	for (int i = 0; i < h.ndim; i++)
		if (__builtin_mul_overflow(h.count, h.shape[i], &h.count))
			return -KVD_EFORMAT;
	if (__builtin_mul_overflow(h.count, (uint64_t)h.itemsize, &bytes) ||
	    bytes > total - doff)
		return -KVD_EFORMAT;
	h.data_off = doff;
	*out = h;
	return 0;
}

int kvd_npy_parse(const void *buf, size_t len, struct kvd_npy *out)
{
	return parse(buf, len, len, out);
}

/* IEEE binary16 -> binary32, exact: subnormals scaled, inf kept, NaN quieted
 * with its payload kept. */
static float half_to_float(uint16_t x)
{
	uint32_t sign = (uint32_t)(x & 0x8000) << 16, e = (x >> 10) & 0x1f, m = x & 0x3ff;
	uint32_t u;
	float f;

	if (e == 0) {
		f = (float)m * 0x1p-24f;
		return sign ? -f : f;
	}
	if (e == 31)
		u = sign | 0x7f800000u | (m ? 0x400000u | m << 13 : 0);
	else
		u = sign | (e + 112) << 23 | m << 13;
	memcpy(&f, &u, sizeof(f));
	return f;
}

/* 0, -errno, or -KVD_EFORMAT when the file ends early (it shrank). */
static int read_at(int fd, void *buf, size_t n, uint64_t off)
{
	char *p = buf;

	while (n) {
		ssize_t r = pread(fd, p, n > (1u << 30) ? (1u << 30) : n, (off_t)off);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (r == 0)
			return -KVD_EFORMAT;
		p += r;
		n -= (size_t)r;
		off += (uint64_t)r;
	}
	return 0;
}

static int load_fd(int fd, struct kvd_npy *hdr, float **data)
{
	unsigned char pre[12], *head;
	struct kvd_npy h;
	struct stat st;
	size_t hoff, doff, have;
	uint64_t out_bytes;
	float *f;
	int rc;

	if (fstat(fd, &st))
		return -errno;
	if (!S_ISREG(st.st_mode))
		return -EINVAL;
	have = st.st_size < (off_t)sizeof(pre) ? (size_t)st.st_size : sizeof(pre);
	rc = read_at(fd, pre, have, 0);
	if (rc)
		return rc;
	rc = preamble(pre, have, &hoff, &doff);
	if (rc)
		return rc;
	if ((uint64_t)doff > (uint64_t)st.st_size)
		return -KVD_EFORMAT;
	head = malloc(doff);
	if (!head)
		return -ENOMEM;
	rc = read_at(fd, head, doff, 0);
	if (!rc)
		rc = parse(head, doff, (size_t)st.st_size, &h);
	free(head);
	if (rc)
		return rc;

	if (__builtin_mul_overflow(h.count, (uint64_t)sizeof(float), &out_bytes) ||
	    out_bytes > MAX_LOAD)
		return -EFBIG;
	f = malloc(out_bytes ? out_bytes : 1);
	if (!f)
		return -ENOMEM;
	if (h.itemsize == 4) {
		rc = read_at(fd, f, out_bytes, h.data_off);
	} else {
		uint16_t *buf = malloc(CHUNK * sizeof(uint16_t));

		rc = buf ? 0 : -ENOMEM;
		for (uint64_t i = 0; !rc && i < h.count; i += CHUNK) {
			size_t n = h.count - i < CHUNK ? (size_t)(h.count - i) : CHUNK;

			rc = read_at(fd, buf, n * sizeof(uint16_t), h.data_off + i * 2);
			for (size_t j = 0; !rc && j < n; j++)
				f[i + j] = half_to_float(buf[j]);
		}
		free(buf);
	}
	if (rc) {
		free(f);
		return rc;
	}
	*hdr = h;
	*data = f;
	return 0;
}

int kvd_npy_load(const char *path, struct kvd_npy *hdr, float **data)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	int rc;

	if (fd < 0)
		return -errno;
	rc = load_fd(fd, hdr, data);
	close(fd);
	return rc;
}

static int write_all(int fd, const void *buf, size_t n)
{
	const char *p = buf;

	while (n) {
		ssize_t r = write(fd, p, n > (1u << 30) ? (1u << 30) : n);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		p += r;
		n -= (size_t)r;
	}
	return 0;
}

int kvd_npy_save(const char *path, const float *data, int ndim, const uint64_t *shape)
{
	char head[512];
	uint64_t count = 1, bytes;
	int len, fd, rc;

	if (ndim < 1 || ndim > KVD_NPY_MAXDIM || !shape || !data)
		return -EINVAL;
	for (int i = 0; i < ndim; i++)
		if (shape[i] == 0 || __builtin_mul_overflow(count, shape[i], &count))
			return -EINVAL;
	if (__builtin_mul_overflow(count, (uint64_t)sizeof(float), &bytes) || bytes > SIZE_MAX)
		return -EINVAL;

	/* numpy's own layout: magic, version 1.0, u16 header length, the dict,
	 * blanks and '\n' so that the data starts on a 64-byte boundary. */
	memcpy(head, MAGIC "\x01\x00", MAGIC_LEN + 2);
	len = 10;
	len += snprintf(head + len, sizeof(head) - len,
			"{'descr': '<f4', 'fortran_order': False, 'shape': (");
	for (int i = 0; i < ndim; i++)
		len += snprintf(head + len, sizeof(head) - len, i ? ", %llu" : "%llu",
				(unsigned long long)shape[i]);
	len += snprintf(head + len, sizeof(head) - len, "%s), }", ndim == 1 ? "," : "");
	while ((len + 1) % ALIGN)
		head[len++] = ' ';
	head[len++] = '\n';
	head[8] = (char)((len - 10) & 0xff);
	head[9] = (char)((len - 10) >> 8);

	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -errno;
	rc = write_all(fd, head, (size_t)len);
	if (!rc)
		rc = write_all(fd, data, (size_t)bytes);
	if (close(fd) && !rc)
		rc = -errno;
	/* A truncated file would later read as malformed: better none. */
	if (rc)
		unlink(path);
	return rc;
}
