/* kvd_npy: round trips, hand-made files of every accepted version and item
 * size, binary16 conversion of all 65536 values, and a table of malformed
 * headers that must each be refused. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/err.h"
#include "engine/npy.h"

static char dir[64];

static const char *tmp_path(const char *name)
{
	static char p[128];

	snprintf(p, sizeof(p), "%s/%s", dir, name);
	return p;
}

/* A file image: preamble of `version`, header text `h` taken as is (padding
 * is the caller's business), then `dlen` data bytes. */
static size_t image(unsigned char *buf, int version, const char *h, const void *data,
		    size_t dlen)
{
	size_t hl = strlen(h), off = version == 1 ? 10 : 12;

	memcpy(buf, "\x93NUMPY", 6);
	buf[6] = (unsigned char)version;
	buf[7] = 0;
	buf[8] = hl & 0xff;
	buf[9] = (hl >> 8) & 0xff;
	if (version != 1) {
		buf[10] = (hl >> 16) & 0xff;
		buf[11] = (hl >> 24) & 0xff;
	}
	memcpy(buf + off, h, hl);
	if (data)
		memcpy(buf + off + hl, data, dlen);
	else
		memset(buf + off + hl, 0, dlen);
	return off + hl + dlen;
}

static void write_file(const char *path, const void *buf, size_t n)
{
	FILE *f = fopen(path, "wb");

	assert_non_null(f);
	assert_int_equal(fwrite(buf, 1, n, f), n);
	assert_int_equal(fclose(f), 0);
}

static int setup(void **state)
{
	strcpy(dir, "/tmp/test_npy.XXXXXX");
	return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
	static const char *const names[] = { "a.npy", "b.npy", "h.npy", "t.npy", "e.npy",
					     "big.npy", "sub" };

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		remove(tmp_path(names[i]));
	return rmdir(dir);
}

static void test_round_trip(void **state)
{
	static const uint64_t shapes[][4] = { { 5 }, { 2, 3 }, { 2, 3, 4 }, { 1, 2, 1, 3 } };
	float src[24], *got;
	struct kvd_npy h;

	for (int i = 0; i < 24; i++)
		src[i] = (float)i * 0.37f - 3.0f;
	src[3] = INFINITY;
	src[4] = -0.0f;
	src[5] = NAN;
	src[6] = 0x1p-140f;
	for (int nd = 1; nd <= 4; nd++) {
		uint64_t cnt = 1;

		for (int i = 0; i < nd; i++)
			cnt *= shapes[nd - 1][i];
		assert_int_equal(kvd_npy_save(tmp_path("a.npy"), src, nd, shapes[nd - 1]), 0);
		got = NULL;
		assert_int_equal(kvd_npy_load(tmp_path("a.npy"), &h, &got), 0);
		assert_int_equal(h.ndim, nd);
		assert_int_equal(h.itemsize, 4);
		assert_int_equal(h.count, cnt);
		assert_int_equal(h.data_off % 64, 0);
		for (int i = 0; i < nd; i++)
			assert_int_equal(h.shape[i], shapes[nd - 1][i]);
		assert_memory_equal(got, src, cnt * sizeof(float));
		free(got);
	}
}

/* The writer's bytes are numpy's: the header text, its padding, 1.0. */
static void test_writer_layout(void **state)
{
	static const char want[] = "\x93NUMPY\x01\x00\x76\x00"
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
	static const uint64_t shape[] = { 2, 3 };
	static const float x[6] = { 1, 2, 3, 4, 5, 6 };
	unsigned char buf[256];
	struct kvd_npy h;
	FILE *f;
	size_t n;

	assert_int_equal(kvd_npy_save(tmp_path("a.npy"), x, 2, shape), 0);
	f = fopen(tmp_path("a.npy"), "rb");
	assert_non_null(f);
	n = fread(buf, 1, sizeof(buf), f);
	fclose(f);
	assert_int_equal(n, 128 + sizeof(x));
	assert_memory_equal(buf, want, sizeof(want) - 1);
	for (size_t i = sizeof(want) - 1; i < 127; i++)
		assert_int_equal(buf[i], ' ');
	assert_int_equal(buf[127], '\n');
	assert_memory_equal(buf + 128, x, sizeof(x));
	assert_int_equal(kvd_npy_parse(buf, n, &h), 0);
	assert_int_equal(h.data_off, 128);
}

static void test_versions(void **state)
{
	static const float x[3] = { 1.5f, -2.0f, 1e30f };
	unsigned char buf[512];
	struct kvd_npy h;
	float *got;
	size_t n;

	for (int v = 1; v <= 3; v++) {
		n = image(buf, v, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }\n",
			  x, sizeof(x));
		assert_int_equal(kvd_npy_parse(buf, n, &h), 0);
		assert_int_equal(h.data_off, n - sizeof(x));
		assert_int_equal(h.ndim, 1);
		assert_int_equal(h.shape[0], 3);
		write_file(tmp_path("h.npy"), buf, n);
		assert_int_equal(kvd_npy_load(tmp_path("h.npy"), &h, &got), 0);
		assert_memory_equal(got, x, sizeof(x));
		free(got);
	}
}

static void test_f16_values(void **state)
{
	static const struct {
		uint16_t h;
		float f;
	} tab[] = {
		{ 0x0000, 0.0f }, { 0x3c00, 1.0f }, { 0xc000, -2.0f }, { 0x3555, 0.333251953125f },
		{ 0x0001, 0x1p-24f }, { 0x8001, -0x1p-24f }, { 0x03ff, 1023 * 0x1p-24f },
		{ 0x0400, 0x1p-14f }, { 0x7bff, 65504.0f }, { 0x7c00, INFINITY },
		{ 0xfc00, -INFINITY },
	};
	static const uint16_t nans[] = { 0x7e00, 0x7c01, 0xfd00, 0x7fff };
	uint16_t data[16];
	unsigned char buf[512];
	struct kvd_npy h;
	float *got;
	size_t n, nt = sizeof(tab) / sizeof(tab[0]);

	for (size_t i = 0; i < nt; i++)
		data[i] = tab[i].h;
	data[nt] = 0x8000;
	memcpy(data + nt + 1, nans, sizeof(nans));
	n = image(buf, 3, "{'shape': (16,), 'fortran_order': False, 'descr': '<f2'}      \n",
		  data, sizeof(data));
	write_file(tmp_path("h.npy"), buf, n);
	assert_int_equal(kvd_npy_load(tmp_path("h.npy"), &h, &got), 0);
	assert_int_equal(h.itemsize, 2);
	for (size_t i = 0; i < nt; i++)
		assert_true(got[i] == tab[i].f);
	assert_true(got[nt] == 0.0f && signbit(got[nt]));
	assert_true(!signbit(got[0]));
	for (size_t i = 0; i < 4; i++)
		assert_true(isnan(got[nt + 1 + i]));
	assert_true(signbit(got[nt + 3]));
	free(got);
}

/* All 65536 binary16 values against the definition. */
static void test_f16_exhaustive(void **state)
{
	static uint16_t data[65536];
	static unsigned char buf[65536 * 2 + 256];
	struct kvd_npy h;
	float *got;
	size_t n;

	for (uint32_t i = 0; i < 65536; i++)
		data[i] = (uint16_t)i;
	n = image(buf, 1, "{\"descr\":\"<f2\",\"fortran_order\":False,\"shape\":(256,256)}\n",
		  data, sizeof(data));
	write_file(tmp_path("h.npy"), buf, n);
	assert_int_equal(kvd_npy_load(tmp_path("h.npy"), &h, &got), 0);
	assert_int_equal(h.count, 65536);
	for (uint32_t i = 0; i < 65536; i++) {
		int e = (i >> 10) & 31, m = i & 1023;
		double want = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY)
			    : ldexp(1024 + m, e - 25);

		if (i & 0x8000)
			want = -want;
		if (isnan(want))
			assert_true(isnan(got[i]));
		else
			assert_true((double)got[i] == want && !!signbit(got[i]) == !!(i & 0x8000));
	}
	free(got);
}

static void test_accepted_variants(void **state)
{
	static const char *const ok[] = {
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
		"{'shape': (2, 3), 'descr': '<f4', 'fortran_order': False}",
		"{\"fortran_order\":False,\"shape\":(2,3,),\"descr\":\"<f4\"}",
		" \t{ 'descr' : '<f4' ,\n'fortran_order' :\tFalse , 'shape' : ( 2 , 3 ) , }\r\n   ",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (6,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 2, 3)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (12,)}",
	};
	unsigned char buf[512];
	struct kvd_npy h;

	for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
		/* 24 data bytes plus 8 of trailing junk, which numpy ignores too. */
		size_t n = image(buf, 1, ok[i], NULL, 32);

		memset(&h, 0xff, sizeof(h));
		assert_int_equal(kvd_npy_parse(buf, n, &h), 0);
		assert_int_equal(h.count * h.itemsize, 24);
		assert_int_equal(h.data_off, n - 32);
	}
}

static void test_malformed_headers(void **state)
{
	static const char *const bad[] = {
		"",
		"{}",
		"   ",
		"{'fortran_order': False, 'shape': (4,), }",                     /* no descr */
		"{'descr': '<f4', 'shape': (4,), }",                             /* no fortran_order */
		"{'descr': '<f4', 'fortran_order': False, }",                    /* no shape */
		"{'descr': '<f4', 'fortran_order': True, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': 0, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': Falsey, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': false, 'shape': (4,), }",
		"{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
		"{'descr': '|u1', 'fortran_order': False, 'shape': (16,), }",
		"{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': 'f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4 ', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': <f4, 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (0,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 0), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4), }",      /* not a tuple */
		"{'descr': '<f4', 'fortran_order': False, 'shape': [4], }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': 4, }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (,4), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (-4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (+4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4.0,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (04,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4L,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (0x4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (1_0,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 4), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4, }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904,), }",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (9223372036854775808,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551616,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }",     /* 20 > 16 bytes */
		"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'extra': 1, }",
		"{'Descr': '<f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), } x",
		"x{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), ",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,)",
		"{'descr: '<f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4\", 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }'",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'x",
		"{'de\\scr': '<f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr' '<f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4' 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4',, 'fortran_order': False, 'shape': (4,), }",
		"{, 'descr': '<f4', 'fortran_order': False, 'shape': (4,), }",
		"{'descr': '<f4'; 'fortran_order': False, 'shape': (4,), }",
		"['descr', '<f4', 'fortran_order', False, 'shape', (4,)]",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }\x01",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }\xc3\xa9",
		"{'descr': '<f4',\f'fortran_order': False, 'shape': (4,), }",
	};
	unsigned char buf[512];
	struct kvd_npy h;

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		size_t n = image(buf, 1, bad[i], NULL, 16);

		if (kvd_npy_parse(buf, n, &h) != -KVD_EFORMAT)
			fail_msg("accepted bad header %zu: %s", i, bad[i]);
	}
}

/* A NUL inside the header, and preamble damage. */
static void test_malformed_preamble(void **state)
{
	static const char good[] = "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }\n";
	unsigned char buf[512], b2[512];
	struct kvd_npy h;
	size_t n = image(buf, 1, good, NULL, 16);

	assert_int_equal(kvd_npy_parse(buf, n, &h), 0);
#define BAD(mod, len)                                                   \
	do {                                                            \
		memcpy(b2, buf, n);                                     \
		mod;                                                    \
		assert_int_equal(kvd_npy_parse(b2, len, &h), -KVD_EFORMAT); \
	} while (0)
	BAD(b2[0] = 0x92, n);                   /* magic */
	BAD(b2[1] = 'n', n);
	BAD(b2[6] = 0, n);                      /* version 0.0 */
	BAD(b2[6] = 4, n);                      /* version 4.0 */
	BAD(b2[6] = 0xff, n);
	BAD(b2[7] = 1, n);                      /* version 1.1 */
	BAD(b2[9] = 1, n);                      /* header runs 256 bytes past the end */
	BAD(b2[8] = 0xff; b2[9] = 0xff, n);
	BAD(b2[8] = (unsigned char)(n - 10 + 1), n); /* header ends past the file */
	BAD(b2[8] = 0; b2[9] = 0, n);           /* empty header */
	BAD(b2[20] = 0, n);                     /* NUL in the header */
	BAD((void)0, n - 1);                    /* one data byte short */
	BAD((void)0, 10 + strlen(good));        /* no data at all */
	BAD((void)0, 9);                        /* preamble cut */
	BAD((void)0, 6);
	BAD((void)0, 0);
	/* Version 2 needs 12 preamble bytes and a 32-bit length. */
	n = image(buf, 2, good, NULL, 16);
	assert_int_equal(kvd_npy_parse(buf, n, &h), 0);
	BAD((void)0, 11);
	BAD(b2[11] = 0x80, n);                  /* 2 GiB header */
	BAD(b2[10] = 0x10, n);                  /* past the end, over the header cap */
#undef BAD
}

static void test_load_errors(void **state)
{
	static const char hdr[] = "{'descr': '<f4', 'fortran_order': False, 'shape': (100,), }\n";
	unsigned char buf[1024];
	struct kvd_npy h;
	float *got = NULL;
	size_t n;
	int fd;

	assert_int_equal(kvd_npy_load(tmp_path("none.npy"), &h, &got), -ENOENT);
	assert_int_equal(mkdir(tmp_path("sub"), 0700), 0);
	assert_int_equal(kvd_npy_load(tmp_path("sub"), &h, &got), -EINVAL);
	write_file(tmp_path("e.npy"), "", 0);
	assert_int_equal(kvd_npy_load(tmp_path("e.npy"), &h, &got), -KVD_EFORMAT);
	write_file(tmp_path("e.npy"), "\x93NUMPY\x01", 7);
	assert_int_equal(kvd_npy_load(tmp_path("e.npy"), &h, &got), -KVD_EFORMAT);
	/* Truncated: data shorter than the shape says. */
	n = image(buf, 1, hdr, NULL, 399);
	write_file(tmp_path("t.npy"), buf, n);
	assert_int_equal(kvd_npy_load(tmp_path("t.npy"), &h, &got), -KVD_EFORMAT);
	/* Header cut short by the end of the file. */
	write_file(tmp_path("t.npy"), buf, 30);
	assert_int_equal(kvd_npy_load(tmp_path("t.npy"), &h, &got), -KVD_EFORMAT);
	assert_null(got);

	/* A sparse file whose float32 image would exceed the load limit: refused
	 * before any allocation. */
	n = image(buf, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (17179869185,), }\n",
		  NULL, 0);
	fd = open(tmp_path("big.npy"), O_WRONLY | O_CREAT | O_TRUNC, 0600);
	assert_true(fd >= 0);
	assert_int_equal(write(fd, buf, n), (ssize_t)n);
	if (ftruncate(fd, (off_t)n + 2 * 17179869185ll) == 0) {
		close(fd);
		assert_int_equal(kvd_npy_load(tmp_path("big.npy"), &h, &got), -EFBIG);
	} else {
		close(fd);
		print_message("sparse 32 GiB file not possible here; EFBIG case skipped\n");
	}
	remove(tmp_path("big.npy"));
}

static void test_save_errors(void **state)
{
	static const uint64_t s0[] = { 2, 0 }, s5[] = { 1, 1, 1, 1, 1 };
	static const uint64_t sover[] = { 1ull << 32, 1ull << 32 };
	float x[2] = { 0 };

	assert_int_equal(kvd_npy_save(tmp_path("b.npy"), x, 0, s5), -EINVAL);
	assert_int_equal(kvd_npy_save(tmp_path("b.npy"), x, 5, s5), -EINVAL);
	assert_int_equal(kvd_npy_save(tmp_path("b.npy"), x, 2, s0), -EINVAL);
	assert_int_equal(kvd_npy_save(tmp_path("b.npy"), x, 2, sover), -EINVAL);
	assert_int_equal(kvd_npy_save(tmp_path("b.npy"), NULL, 1, s5), -EINVAL);
	assert_int_equal(kvd_npy_save("/nonexistent-kvd-dir/x.npy", x, 1, s5), -ENOENT);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_writer_layout),
		cmocka_unit_test(test_versions),
		cmocka_unit_test(test_f16_values),
		cmocka_unit_test(test_f16_exhaustive),
		cmocka_unit_test(test_accepted_variants),
		cmocka_unit_test(test_malformed_headers),
		cmocka_unit_test(test_malformed_preamble),
		cmocka_unit_test(test_load_errors),
		cmocka_unit_test(test_save_errors),
	};

	return cmocka_run_group_tests_name("npy", tests, setup, teardown);
}
