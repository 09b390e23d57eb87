/* kvd_wire: the checks every ring entry goes through before kvd acts on it
 * (docs/PROTOCOL.md, "Checks").  The entry comes from shared memory a
 * hostile client writes, so each refusal is reached here with one crafted
 * entry that breaks exactly one rule, and must give the documented code and
 * a reason; the entries just inside every bound, and a good entry of each
 * op, must pass and decode to exactly the fields written.  fuzz_wire checks
 * that what passes is safe; this checks that every rule is there. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "proto/kvd_ring.h"
#include "kvd/store/store.h"
#include "kvd/wire.h"

#define NSLOTS 4
#define SLOT (1u << 20)
#define LAYERS 4
#define HQ 8
#define HKV 2
#define D 64
#define LT 12

static uint8_t dense[LAYERS] = { 1, 0, 0, 1 };    /* 0 and 3 stay on the GPU */

static const struct kvd_profile prof = {
	.g = { .q_heads = HQ, .kv_heads = HKV, .d = D, .K = 8, .L = LT, .c = 2 },
	.layers = LAYERS,
	.seg_tokens = 1024,
	.seal_tokens = 64,
	.dense = dense,
};

static uint64_t rows_len(uint32_t ntok, int mean)
{
	return kvd_rows_bytes(HKV, D, LT, ntok, mean);
}

static uint64_t att_in(uint32_t nseq)
{
	return nseq * kvd_attend_in_bytes(HQ, D, LT);
}

static uint64_t att_out(uint32_t nseq)
{
	return nseq * kvd_attend_out_bytes(HQ, D);
}

/* A good entry of each kind, the seeds of every crafted bad one. */
static struct kvd_sqe prefill(void)
{
	return (struct kvd_sqe){ .op = KVD_OP_PREFILL, .flags = KVD_RF_MEAN | KVD_RF_LAST,
				 .layer = 1, .slot = 2, .user_data = 0x1122334455667788ull,
				 .seq = 0x8877665544332211ull, .off = 128,
				 .len = (uint32_t)rows_len(100, 1), .ntok = 100 };
}

static struct kvd_sqe append(void)
{
	return (struct kvd_sqe){ .op = KVD_OP_APPEND, .layer = 2, .slot = NSLOTS - 1,
				 .user_data = 7, .seq = 42, .off = 0,
				 .len = (uint32_t)rows_len(3, 0), .ntok = 3 };
}

static struct kvd_sqe attend(void)
{
	return (struct kvd_sqe){ .op = KVD_OP_ATTEND, .layer = 2, .slot = 0, .user_data = 9,
				 .off = 64, .len = (uint32_t)att_in(5), .nseq = 5,
				 .out_off = 64 + (uint32_t)KVD_ALIGN64(att_in(5)),
				 .out_len = (uint32_t)att_out(5) };
}

/* kvd_wire_sqe on the bytes of e in an arena of NSLOTS slots of `slot`
 * bytes; the decoded copy in *out. */
static int sqe_in(const struct kvd_sqe *e, uint64_t slot, struct kvd_sqe *out, char *msg,
		  size_t msglen)
{
	uint8_t raw[KVD_RING_ENTRY];

	memcpy(raw, e, sizeof raw);
	return kvd_wire_sqe(raw, NSLOTS, slot, out, msg, msglen);
}

static int sqe(const struct kvd_sqe *e, struct kvd_sqe *out, char *msg, size_t msglen)
{
	return sqe_in(e, SLOT, out, msg, msglen);
}

/* e must be refused by kvd_wire_sqe with `code`, saying `why`. */
static void refused(const char *name, struct kvd_sqe e, int code, const char *why)
{
	struct kvd_sqe out;
	char msg[160];
	int rc;

	memset(msg, 0, sizeof msg);
	rc = sqe(&e, &out, msg, sizeof msg);
	if (rc != code)
		fail_msg("%s: kvd_wire_sqe gave %d (%s), expected %d", name, rc, msg, code);
	if (!strstr(msg, why))
		fail_msg("%s: reason \"%s\" does not say \"%s\"", name, msg, why);
}

/* e passes kvd_wire_sqe but kvd_wire_payload refuses it. */
static void refused_payload(const char *name, struct kvd_sqe e, int code, const char *why)
{
	struct kvd_sqe out;
	char msg[160];
	int rc;

	if ((rc = sqe(&e, &out, msg, sizeof msg)))
		fail_msg("%s: kvd_wire_sqe refused it first: %d (%s)", name, rc, msg);
	memset(msg, 0, sizeof msg);
	rc = kvd_wire_payload(&out, &prof, msg, sizeof msg);
	if (rc != code)
		fail_msg("%s: kvd_wire_payload gave %d (%s), expected %d", name, rc, msg, code);
	if (!strstr(msg, why))
		fail_msg("%s: reason \"%s\" does not say \"%s\"", name, msg, why);
}

/* e passes both checks in slots of `slot` bytes and decodes to exactly its
 * own bytes. */
static void accepted_in(const char *name, struct kvd_sqe e, uint64_t slot)
{
	struct kvd_sqe out;
	char msg[160] = "";
	int rc;

	memset(&out, 0xa5, sizeof out);
	if ((rc = sqe_in(&e, slot, &out, msg, sizeof msg)))
		fail_msg("%s: kvd_wire_sqe refused it: %d (%s)", name, rc, msg);
	if (memcmp(&out, &e, sizeof e))
		fail_msg("%s: the decoded entry differs from the one written", name);
	if ((rc = kvd_wire_payload(&out, &prof, msg, sizeof msg)))
		fail_msg("%s: kvd_wire_payload refused it: %d (%s)", name, rc, msg);
}

static void accepted(const char *name, struct kvd_sqe e)
{
	accepted_in(name, e, SLOT);
}

/* ---- kvd_wire_sqe ------------------------------------------------------- */

static void test_sqe_header_refusals(void **state)
{
	struct kvd_sqe e;

	e = prefill();
	e.op = KVD_OP_MAX;
	refused("op KVD_OP_MAX", e, -EINVAL, "unknown op");
	e.op = 0xff;
	refused("op 255", e, -EINVAL, "unknown op");

	e = prefill();
	e.flags |= 0x04;
	refused("PREFILL with an unknown flag", e, -EINVAL, "flags 0x7 not valid for op 1");
	e = append();
	e.flags = KVD_RF_MEAN;
	refused("APPEND with MEAN", e, -EINVAL, "not valid for op 2");
	e = append();
	e.flags = KVD_RF_LAST;
	refused("APPEND with LAST", e, -EINVAL, "not valid for op 2");
	e = attend();
	e.flags = KVD_RF_MEAN;
	refused("ATTEND with MEAN", e, -EINVAL, "not valid for op 3");
	e = (struct kvd_sqe){ .op = KVD_OP_NOP, .flags = 0x80 };
	refused("NOP with a flag", e, -EINVAL, "not valid for op 0");
	e = (struct kvd_sqe){ .op = KVD_OP_FREE, .seq = 1, .flags = KVD_RF_LAST };
	refused("FREE with a flag", e, -EINVAL, "not valid for op 4");

	for (int i = 0; i < 4; i++) {
		char name[32];

		snprintf(name, sizeof name, "_reserved[%d]", i);
		e = attend();
		e._reserved[i] = 1u << (8 * i);
		refused(name, e, -EINVAL, "reserved fields must be zero");
		/* the ops without a payload check them too */
		e = (struct kvd_sqe){ .op = KVD_OP_PREFETCH, .seq = 3 };
		e._reserved[i] = 0x80000000u;
		refused(name, e, -EINVAL, "reserved fields must be zero");
	}
}

static void test_sqe_range_refusals(void **state)
{
	struct kvd_sqe e;

	/* every op with a payload checks where it is */
	struct kvd_sqe (*const mk[])(void) = { prefill, append, attend };

	for (size_t i = 0; i < sizeof mk / sizeof mk[0]; i++) {
		e = mk[i]();
		e.slot = NSLOTS;
		refused("slot == nslots", e, -ERANGE, "slot 4 out of range (4 slots)");
		e.slot = UINT32_MAX;
		refused("slot 2^32-1", e, -ERANGE, "out of range");

		e = mk[i]();
		e.off += 32;
		refused("payload offset not 64-aligned", e, -EINVAL, "not 64-byte aligned");
		e.off += 31;
		refused("payload offset odd", e, -EINVAL, "not 64-byte aligned");

		e = mk[i]();
		e.off = (SLOT - e.len + 64) & ~63u;     /* aligned, ends past the slot */
		e.out_off = e.out_len = 0;
		refused("payload past the slot", e, -ERANGE, "past the slot's");
		/* 32-bit off + len wraps to a small number: must still be refused */
		e = mk[i]();
		e.off = 0xffffffc0u;
		e.len = 0x80u;
		refused("payload off + len wraps in 32 bits", e, -ERANGE, "past the slot's");
	}

	/* rows */
	e = prefill();
	e.ntok = KVD_WIRE_MAX_NTOK + 1;
	refused("PREFILL ntok above the maximum", e, -ERANGE, "ntok 65537 above 65536");
	e = append();
	e.ntok = UINT32_MAX;
	refused("APPEND ntok 2^32-1", e, -ERANGE, "above 65536");
	e = append();
	e.ntok = 0;
	e.len = 0;
	refused("APPEND of 0 tokens", e, -EINVAL, "APPEND of 0 tokens");
	e = prefill();
	e.nseq = 1;
	refused("PREFILL with nseq", e, -EINVAL, "must be zero for rows");
	e = append();
	e.out_off = 4096;
	refused("APPEND with out_off", e, -EINVAL, "must be zero for rows");
	e = prefill();
	e.out_len = 64;
	refused("PREFILL with out_len", e, -EINVAL, "must be zero for rows");

	/* ATTEND */
	e = attend();
	e.nseq = 0;
	refused("ATTEND of 0 sequences", e, -ERANGE, "nseq 0 not in 1..4096");
	e.nseq = KVD_WIRE_MAX_NSEQ + 1;
	refused("ATTEND above the batch maximum", e, -ERANGE, "nseq 4097 not in 1..4096");
	e = attend();
	e.ntok = 1;
	refused("ATTEND with ntok", e, -EINVAL, "ntok must be zero for ATTEND");
	e = attend();
	e.out_off += 8;
	refused("output offset not 64-aligned", e, -EINVAL, "output offset");
	e = attend();
	e.out_off = SLOT - 64;
	refused("output past the slot", e, -ERANGE, "output [");
	e = attend();
	e.out_off = 0xffffffc0u;
	e.out_len = 0x100u;
	refused("output out_off + out_len wraps in 32 bits", e, -ERANGE, "past the slot's");

	/* overlap, from either side and in full */
	e = attend();
	e.out_off = e.off + 64 * ((e.len / 64) - 1);
	refused("output starts inside the input", e, -EINVAL, "overlaps the input");
	e = attend();
	e.out_off = 0;
	e.out_len = e.off + 64;
	refused("output ends inside the input", e, -EINVAL, "overlaps the input");
	e = attend();
	e.out_off = 0;
	e.out_len = SLOT;
	refused("output covers the input", e, -EINVAL, "overlaps the input");
	e = attend();
	e.out_off = e.off;
	e.out_len = 64;
	refused("output inside the input", e, -EINVAL, "overlaps the input");
}

/* A refusal's message is cut to msglen and still terminated. */
static void test_sqe_message_fits(void **state)
{
	struct kvd_sqe e = attend(), out;
	char msg[8];

	e.slot = 123456;
	memset(msg, 'x', sizeof msg);
	assert_int_equal(kvd_wire_sqe(&e, NSLOTS, SLOT, &out, msg, sizeof msg), -ERANGE);
	assert_non_null(memchr(msg, 0, sizeof msg));
	assert_string_equal(msg, "slot 12");
}

/* ---- kvd_wire_payload --------------------------------------------------- */

static void test_payload_refusals(void **state)
{
	struct kvd_sqe e;

	/* rows: the layer, its kind, the exact size */
	e = prefill();
	e.layer = LAYERS;
	refused_payload("PREFILL layer == layers", e, -ERANGE, "layer 4 out of range (4 layers)");
	e = append();
	e.layer = UINT16_MAX;
	refused_payload("APPEND layer 65535", e, -ERANGE, "out of range");
	e = prefill();
	e.layer = 0;
	refused_payload("PREFILL into dense layer 0", e, -EINVAL, "layer 0 is dense");
	e = append();
	e.layer = 3;
	refused_payload("APPEND into dense layer 3", e, -EINVAL, "layer 3 is dense");
	e = prefill();
	e.len -= 1;
	refused_payload("PREFILL a byte short", e, -EBADMSG, "expected for 100 tokens");
	e = prefill();
	e.len += 64;
	refused_payload("PREFILL 64 bytes long", e, -EBADMSG, "expected for 100 tokens");
	e = prefill();
	e.flags &= (uint8_t)~KVD_RF_MEAN;       /* the size with a mean, flagged without */
	refused_payload("PREFILL sized for a mean it does not flag", e, -EBADMSG, "expected");
	e = append();
	e.len = (uint32_t)rows_len(3, 1);
	refused_payload("APPEND sized with a mean", e, -EBADMSG, "expected for 3 tokens");
	e = append();
	e.len = (uint32_t)rows_len(4, 0);
	refused_payload("APPEND sized for one token more", e, -EBADMSG, "expected for 3 tokens");

	/* ATTEND: the layer, its kind, the exact input, enough output */
	e = attend();
	e.layer = LAYERS;
	refused_payload("ATTEND layer == layers", e, -ERANGE, "layer 4 out of range");
	e = attend();
	e.layer = 0;
	refused_payload("ATTEND of dense layer 0", e, -EINVAL, "layer 0 is dense");
	e = attend();
	e.len = (uint32_t)att_in(4);
	refused_payload("ATTEND input of 4 records for 5", e, -EBADMSG,
			"expected for 5 sequences");
	e = attend();
	e.len += 64;
	e.out_off += 64;
	refused_payload("ATTEND input one line long", e, -EBADMSG, "expected for 5 sequences");
	e = attend();
	e.out_len -= 1;
	refused_payload("ATTEND output a byte short", e, -EBADMSG, "ATTEND output room");
	e = attend();
	e.out_len = 0;
	refused_payload("ATTEND without output room", e, -EBADMSG, "ATTEND output room 0 bytes");
}

/* ---- what passes -------------------------------------------------------- */

static void test_good_entries(void **state)
{
	struct kvd_sqe e;

	accepted("PREFILL MEAN|LAST", prefill());
	e = prefill();
	e.flags = KVD_RF_MEAN;
	accepted("PREFILL MEAN", e);
	e = prefill();
	e.flags = 0;
	e.len = (uint32_t)rows_len(100, 0);
	accepted("PREFILL without flags", e);
	e = prefill();
	e.flags = KVD_RF_LAST;
	e.ntok = 0;
	e.len = (uint32_t)rows_len(0, 0);
	accepted("PREFILL LAST of 0 tokens (seal what is staged)", e);
	accepted("APPEND", append());
	accepted("ATTEND", attend());
	accepted("NOP", (struct kvd_sqe){ .op = KVD_OP_NOP, .user_data = UINT64_MAX });
	accepted("FREE", (struct kvd_sqe){ .op = KVD_OP_FREE, .user_data = 5, .seq = 0xdeadbeefull });
	accepted("PREFETCH", (struct kvd_sqe){ .op = KVD_OP_PREFETCH, .user_data = 6, .seq = 77 });
}

/* Every bound is inclusive where the contract says so. */
static void test_bounds_accepted(void **state)
{
	struct kvd_sqe e;

	e = append();
	e.ntok = KVD_WIRE_MAX_NTOK;
	e.len = (uint32_t)rows_len(e.ntok, 0);
	e.off = 4096;
	e.slot = NSLOTS - 1;
	accepted_in("APPEND of 65536 tokens ending at the slot's end", e, 4096 + (uint64_t)e.len);
	{
		struct kvd_sqe out;
		char msg[160];

		assert_int_equal(sqe_in(&e, 4096 + (uint64_t)e.len - 1, &out, msg, sizeof msg),
				 -ERANGE);
	}

	e = attend();
	e.nseq = KVD_WIRE_MAX_NSEQ;
	e.off = 0;
	e.len = (uint32_t)att_in(e.nseq);
	e.out_off = (uint32_t)KVD_ALIGN64(e.len);      /* right after the input */
	e.out_len = (uint32_t)att_out(e.nseq);
	{
		struct kvd_sqe out;
		char msg[160];
		uint64_t slot = (uint64_t)e.out_off + e.out_len;

		/* the biggest batch fits a slot of exactly its size */
		assert_int_equal(kvd_wire_sqe(&e, 1, slot, &out, msg, sizeof msg), 0);
		assert_memory_equal(&out, &e, sizeof e);
		assert_int_equal(kvd_wire_payload(&out, &prof, msg, sizeof msg), 0);
		/* and not one a byte smaller */
		assert_int_equal(kvd_wire_sqe(&e, 1, slot - 1, &out, msg, sizeof msg), -ERANGE);
	}

	/* output before the input, touching it */
	e = attend();
	e.nseq = 1;
	e.out_off = 0;
	e.out_len = (uint32_t)att_out(1);
	e.off = (uint32_t)KVD_ALIGN64(e.out_len);
	e.len = (uint32_t)att_in(1);
	accepted("ATTEND output right before the input", e);
	/* more output room than needed is fine */
	e = attend();
	e.out_len = SLOT - e.out_off;
	accepted("ATTEND with output room to the slot's end", e);
	/* the last layer that is not dense, layer 2 of 4 */
	e = prefill();
	e.layer = LAYERS - 2;
	accepted("PREFILL into the last sparse layer", e);
}

/* The decode is a copy: what the client writes afterwards changes nothing. */
static void test_decode_is_a_copy(void **state)
{
	struct kvd_sqe e = attend(), out, want;
	char msg[160];

	want = e;
	assert_int_equal(kvd_wire_sqe(&e, NSLOTS, SLOT, &out, msg, sizeof msg), 0);
	memset(&e, 0xff, sizeof e);
	assert_memory_equal(&out, &want, sizeof out);
	assert_int_equal(kvd_wire_payload(&out, &prof, msg, sizeof msg), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_sqe_header_refusals),
		cmocka_unit_test(test_sqe_range_refusals),
		cmocka_unit_test(test_sqe_message_fits),
		cmocka_unit_test(test_payload_refusals),
		cmocka_unit_test(test_good_entries),
		cmocka_unit_test(test_bounds_accepted),
		cmocka_unit_test(test_decode_is_a_copy),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
