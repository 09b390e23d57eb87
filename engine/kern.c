#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"

#if defined(__linux__) && !defined(KVD_KERN_EMU)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

/* AMX-TILE and AMX-INT8: CPUID leaf 7 EDX bits 24 and 25 (read directly:
 * clang's __builtin_cpu_supports does not know them). */
static int amx_cpu(void)
{
	unsigned a, b, c, d;

	return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 3) == 3;
}

/* Linux hands out AMX's 8 KiB of tile state only on request, once per
 * process (kernel 5.16 or later); a tile instruction before it faults. */
static int amx_granted(void)
{
	static _Atomic int granted;     /* 0 unknown, 1 yes, -1 no */
	int g = granted;

	if (g == 0) {
		g = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
			    18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
		granted = g;
	}
	return g > 0;
}
#endif

/* tests/simd builds the AVX-512 files on SIMDe and this file with
 * KVD_KERN_EMU, where every variant "runs" (make check-avx512-emu). */
#ifdef KVD_KERN_EMU
#define cpu_has(feature) 1
#else
#define cpu_has(feature) __builtin_cpu_supports(feature)
#endif

static int supported(const struct kvd_kern *k)
{
	__builtin_cpu_init();
	if (k == &kvd_kern_scalar)
		return 1;
	if (k == &kvd_kern_avx2)
		return cpu_has("avx2") && cpu_has("fma");
	if (k == &kvd_kern_avx512)
		return cpu_has("avx512f") && cpu_has("avx512bw") &&
		       cpu_has("avx512vl") && cpu_has("avx512dq");
	if (k == &kvd_kern_avx512bf16)
		return supported(&kvd_kern_avx512) && cpu_has("avx512bf16");
	if (k == &kvd_kern_avx512vnni)
		return supported(&kvd_kern_avx512) && cpu_has("avx512vnni");
#if defined(__linux__) && !defined(KVD_KERN_EMU)
	if (k == &kvd_kern_avx512amx)
		return supported(&kvd_kern_avx512vnni) && amx_cpu() && amx_granted();
#endif
	return 0;
}

/* In order of preference.  avx512amx first where the CPU and kernel allow
 * it: it is avx512vnni except for int8 rows read in order (exact attention
 * over int8 segments: requests without tables, the dense baseline), where
 * on an Emerald Rapids VM (kvbench kern, one core, G = 4 over 98304 rows)
 * qk8 + pv8 took 0.68-0.78 of avx512vnni's time cold and 0.58-0.68 warm.
 * Then avx512vnni: it is avx512 with VPDPWSSD in
 * the int8 kernels, which on Sapphire Rapids (kvbench kern, one core, cold)
 * gathered int8 rows in 0.91 of avx512's time and 0.63 of avx2's, and took
 * dense G = 4 to 0.62 of avx2's.  avx512bf16 comes after avx512: on
 * Sapphire Rapids VDPBF16PS issues once per ~2 cycles against two FMAs per
 * cycle, so its qk (two dot products per 32 elements to keep q's
 * precision) ran at ~65% of the f32 one; KVD_ISA=avx512bf16 still selects
 * it. */
static const struct kvd_kern *const all[] = {
#if defined(__linux__) && !defined(KVD_KERN_EMU)
	&kvd_kern_avx512amx,
#endif
	&kvd_kern_avx512vnni, &kvd_kern_avx512, &kvd_kern_avx512bf16, &kvd_kern_avx2, &kvd_kern_scalar,
};

const struct kvd_kern *kvd_kern_by_name(const char *name)
{
	for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
		if (strcmp(all[i]->name, name) == 0)
			return supported(all[i]) ? all[i] : NULL;
	return NULL;
}

static const struct kvd_kern *pick(void)
{
	const char *want = getenv("KVD_ISA");

	if (want && *want) {
		const struct kvd_kern *k = kvd_kern_by_name(want);

		if (k)
			return k;
		fprintf(stderr, "kvd: KVD_ISA=%s is unknown or unsupported here; using the best available\n",
			want);
	}
	for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
		if (supported(all[i]))
			return all[i];
	return &kvd_kern_scalar;
}

const struct kvd_kern *kvd_kern_get(void)
{
	/* Racing first calls compute the same answer; the store is atomic. */
	static const struct kvd_kern *_Atomic chosen;
	const struct kvd_kern *k = chosen;

	if (!k) {
		k = pick();
		chosen = k;
	}
	return k;
}

/* No libm calls (fmaxf and rintf per element were a tenth of int8 dense
 * attention), and rounding half away from zero; kvd_q16_avx2 does the same
 * in vectors, bit for bit (test_kern). */
static void q16_scalar(const float *q, int G, int d, int16_t *q16, float *qscale)
{
	for (int g = 0; g < G; g++) {
		const float *qg = q + (size_t)g * d;
		int16_t *o = q16 + (size_t)g * d;
		float mx = 0.0f;
		int bad = 0;

		for (int e = 0; e < d; e++) {
			float a = fabsf(qg[e]);

			mx = a > mx ? a : mx;
			bad |= !(a <= FLT_MAX);         /* NaN or infinite */
		}
		if (bad || mx == 0.0f) {
			memset(o, 0, (size_t)d * sizeof *o);
			qscale[g] = bad ? NAN : 0.0f;
			continue;
		}
		float inv = 32767.0f / mx;

		for (int e = 0; e < d; e++) {
			/* |v| <= 32767 (1 + 2^-22): the sum stays below 32768 */
			float v = qg[e] * inv;
			int r = (int)(v + (v >= 0.0f ? 0.5f : -0.5f));

			o[e] = (int16_t)(r > 32767 ? 32767 : r < -32767 ? -32767 : r);
		}
		qscale[g] = mx / 32767.0f;
	}
}

void kvd_q16(const float *q, int G, int d, int16_t *q16, float *qscale)
{
	if (kvd_kern_get() != &kvd_kern_scalar)         /* AVX2 at least */
		kvd_q16_avx2(q, G, d, q16, qscale);
	else
		q16_scalar(q, G, d, q16, qscale);
}

void kvd_q16_ref(const float *q, int G, int d, int16_t *q16, float *qscale)
{
	q16_scalar(q, G, d, q16, qscale);
}
