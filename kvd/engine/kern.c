#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern.h"

static int supported(const struct kvd_kern *k)
{
	__builtin_cpu_init();
	if (k == &kvd_kern_scalar)
		return 1;
	if (k == &kvd_kern_avx2)
		return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
	if (k == &kvd_kern_avx512)
		return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
		       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
	if (k == &kvd_kern_avx512bf16)
		return supported(&kvd_kern_avx512) && __builtin_cpu_supports("avx512bf16");
	return 0;
}

/* In order of preference.  avx512bf16 comes after avx512: on Sapphire Rapids
 * VDPBF16PS issues once per ~2 cycles against two FMAs per cycle, so its qk
 * (two dot products per 32 elements to keep q's precision) ran at ~65% of
 * the f32 one; KVD_ISA=avx512bf16 still selects it. */
static const struct kvd_kern *const all[] = {
	&kvd_kern_avx512, &kvd_kern_avx512bf16, &kvd_kern_avx2, &kvd_kern_scalar,
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
