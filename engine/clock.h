/* kvd_now_ns: the one clock for intervals, deadlines and rates everywhere
 * (the daemon, the rings, the pools).  CLOCK_MONOTONIC: it never jumps
 * with the wall clock, and condition variables that wait against it set
 * the same clock (pthread_condattr_setclock).  Inline: it is read on every
 * unit, spin and request, and a vDSO call is all it costs. */
#ifndef KVD_CLOCK_H
#define KVD_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t kvd_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
