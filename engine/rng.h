/* The one random number generator of kvd: counter-based, so any element of a
 * stream can be computed on its own (the CUDA side makes the same projection
 * matrix element by element).  Specified exactly, because W, the synthetic
 * workloads and every figure in docs/ depend on it:
 *
 *   mix64(z)        splitmix64's finaliser: z ^= z>>30; z *= 0xbf58476d1ce4e5b9;
 *                   z ^= z>>27; z *= 0x94d049bb133111eb; z ^= z>>31
 *   bits(seed, j)   mix64(seed + (j+1) * 0x9e3779b97f4a7c15)   (the j-th output of
 *                   splitmix64 started at state `seed`)
 *   uniform(seed,j) (bits(seed,j) >> 11) * 2^-53                 in [0, 1)
 *   normal(seed,i)  Box-Muller on the pair j = 2i, 2i+1, in double:
 *                   sqrt(-2 ln(1 - uniform(seed,2i))) * cos(2 pi uniform(seed,2i+1))
 *
 * struct kvd_rng is a (seed, counter) pair walking that stream; normal() uses
 * two counter steps.  No global state; not thread-safe per object.
 */
#ifndef KVD_RNG_H
#define KVD_RNG_H

#include <math.h>
#include <stdint.h>

#define KVD_RNG_GOLDEN 0x9e3779b97f4a7c15ull

static inline uint64_t kvd_mix64(uint64_t z)
{
	z ^= z >> 30;
	z *= 0xbf58476d1ce4e5b9ull;
	z ^= z >> 27;
	z *= 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static inline uint64_t kvd_rng_bits_at(uint64_t seed, uint64_t j)
{
	return kvd_mix64(seed + (j + 1) * KVD_RNG_GOLDEN);
}

static inline double kvd_rng_uniform_at(uint64_t seed, uint64_t j)
{
	return (double)(kvd_rng_bits_at(seed, j) >> 11) * 0x1p-53;
}

static inline double kvd_rng_normal_at(uint64_t seed, uint64_t i)
{
	double u1 = kvd_rng_uniform_at(seed, 2 * i);
	double u2 = kvd_rng_uniform_at(seed, 2 * i + 1);

	return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

struct kvd_rng {
	uint64_t seed;
	uint64_t ctr;
};

static inline struct kvd_rng kvd_rng_make(uint64_t seed)
{
	return (struct kvd_rng){ seed, 0 };
}

/* An independent stream derived from this one's seed and a label. */
static inline struct kvd_rng kvd_rng_fork(const struct kvd_rng *r, uint64_t label)
{
	return kvd_rng_make(kvd_mix64(r->seed ^ kvd_mix64(label + KVD_RNG_GOLDEN)));
}

static inline uint64_t kvd_rng_bits(struct kvd_rng *r)
{
	return kvd_rng_bits_at(r->seed, r->ctr++);
}

static inline double kvd_rng_uniform(struct kvd_rng *r)
{
	return kvd_rng_uniform_at(r->seed, r->ctr++);
}

/* Uniform integer in [0, n), n > 0 (multiply-shift; bias below 2^-32 for n < 2^32). */
static inline uint32_t kvd_rng_below(struct kvd_rng *r, uint32_t n)
{
	return (uint32_t)(((kvd_rng_bits(r) >> 32) * (uint64_t)n) >> 32);
}

static inline double kvd_rng_normal(struct kvd_rng *r)
{
	uint64_t c = r->ctr;

	/* Keep pairs aligned so normal() draws equal normal_at(seed, ctr/2). */
	c += c & 1;
	r->ctr = c + 2;
	return kvd_rng_normal_at(r->seed, c / 2);
}

#endif
