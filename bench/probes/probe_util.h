/* What the floor probes share: pinning to one CPU, a monotonic clock, and
 * the comparison qsort needs for a median. Each probe is one C file that
 * bench/run.py compiles on its own (cc -O2 probe.c), and this header sits
 * beside them. */
#ifndef SHMRDMA_BENCH_PROBE_UTIL_H
#define SHMRDMA_BENCH_PROBE_UTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sched.h>
#include <time.h>

/* Pins the calling process (or thread) to one CPU; 0 on success. */
static inline int probe_pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set);
}

/* CLOCK_MONOTONIC, in nanoseconds and in seconds. */
static inline double probe_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static inline double probe_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* qsort's comparison of two doubles, ascending. */
static inline int probe_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
