/* memcpy bandwidth of one core, the floor of any one-copy data path.
 *
 *   memcpy_bw [CPU [SIZE...]]      (default sizes: 4096 65536 1048576 67108864)
 *
 * For each size: a source and a destination buffer of that size (touched
 * first, so no page faults are timed), copied over and over; each sample
 * times a batch of at least 256 KiB (one copy from 256 KiB up; from 16 MiB
 * up, one 1 MiB chunk of the copy). Prints the
 * median sample, as bytes copied per second (each byte counted once, not
 * once read and once written), in GB/s (1e9 bytes/s). A median of short
 * samples, like perftest's t_typical, is what the copy costs when the core
 * is not taken away: on a loaded machine a whole-run average would mostly
 * measure the scheduler.
 *
 *   memcpy_GBps_65536 21.40
 *
 * 64 KiB stays in L2, 1 MiB in L2/L3, 64 MiB goes to DRAM.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "probe_util.h"

/* through a volatile pointer, so the compiler cannot drop or shorten copies */
static void *(*volatile copy)(void *, const void *, size_t) = memcpy;

static double bench(size_t size)
{
    char *src = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *dst = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED || dst == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    memset(src, 1, size);
    memset(dst, 2, size);
    /* a sample is one timed batch of copies of at least 256 KiB (one copy
     * for 256 KiB and up): long enough for the clock, short enough that
     * most samples see no preemption */
    long per = size >= (256 << 10) ? 1 : (long)((256 << 10) / size);
    /* from 16 MiB up a sample is one 1 MiB chunk of a whole-buffer copy
     * (the buffer is walked in order, so this still streams from DRAM) */
    size_t chunk = size >= (16 << 20) ? (1 << 20) : size;
    int samples = size >= (16 << 20) ? (int)(3 * (size / chunk)) : 301;
    double *gbps = calloc((size_t)samples, sizeof *gbps);
    for (int w = 0; w < 3; w++) /* warm-up */
        for (long i = 0; i < per; i++)
            copy(dst, src, size);
    for (int b = 0; b < samples; b++) {
        size_t off = (size_t)b * chunk % size;
        double t1 = probe_now_s();
        for (long i = 0; i < per; i++)
            copy(dst + off, src + off, chunk);
        double dt = probe_now_s() - t1;
        gbps[b] = (double)chunk * per / dt / 1e9;
    }
    munmap(src, size);
    munmap(dst, size);
    qsort(gbps, (size_t)samples, sizeof gbps[0], probe_cmp_double);
    double m = gbps[samples / 2];
    free(gbps);
    return m;
}

int main(int argc, char **argv)
{
    int cpu = argc > 1 ? atoi(argv[1]) : 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
        perror("sched_setaffinity");
        return 1;
    }
    alarm(60);
    static const size_t def[] = {4096, 65536, 1048576, 67108864};
    if (argc > 2) {
        for (int i = 2; i < argc; i++) {
            size_t s = strtoull(argv[i], NULL, 0);
            printf("memcpy_GBps_%zu %.3f\n", s, bench(s));
        }
    } else {
        for (size_t i = 0; i < sizeof def / sizeof def[0]; i++)
            printf("memcpy_GBps_%zu %.3f\n", def[i], bench(def[i]));
    }
    return 0;
}
