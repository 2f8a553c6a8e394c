/* process_vm_writev / process_vm_readv (cross-memory attach, CMA) between
 * two processes pinned to two CPUs: the floor of a data path that moves
 * bytes with one CMA system call per operation.
 *
 *   pvm [CPU_A CPU_B]
 *
 * The parent (CPU_A) writes into / reads from a buffer of a forked child
 * (CPU_B) that sleeps in read(2) meanwhile. Prints:
 *
 *   pvm_write_lat_ns_8 310.5      ns per process_vm_writev call of 8 bytes
 *   pvm_read_lat_ns_8 305.2       ns per process_vm_readv call of 8 bytes
 *   pvm_write_GBps_65536 ...      GB/s (1e9 bytes/s) of back-to-back writes
 *   pvm_write_GBps_1048576 ...
 *   pvm_write_GBps_67108864 ...
 *
 * Each figure is the median of many short timed batches (latency: batches
 * of 200 calls; bandwidth: batches moving at least 1 MiB, and from 16 MiB
 * up one call per 1 MiB chunk of the buffer), so preemption
 * shows as outliers the median ignores.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe_util.h"

#define MAXSZ (64UL << 20)

static pid_t child;
static char *remote; /* same address in the child (allocated before fork) */
static char *local;

static void xfer_at(int write, size_t off, size_t size)
{
    struct iovec l = {local + off, size}, r = {remote + off, size};
    ssize_t n = write ? process_vm_writev(child, &l, 1, &r, 1, 0) : process_vm_readv(child, &l, 1, &r, 1, 0);
    if (n != (ssize_t)size) {
        fprintf(stderr, "process_vm_%s(%zu): %zd (%s)\n", write ? "writev" : "readv", size, n, strerror(errno));
        kill(child, SIGKILL);
        exit(1);
    }
}

static void xfer(int write, size_t size)
{
    xfer_at(write, 0, size);
}

static double lat_ns(int write, size_t size)
{
    enum { CALLS = 200, BATCHES = 301 };
    double ns[BATCHES];
    for (int i = 0; i < 1000; i++)
        xfer(write, size);
    for (int b = 0; b < BATCHES; b++) {
        double t0 = probe_now_s();
        for (int i = 0; i < CALLS; i++)
            xfer(write, size);
        ns[b] = (probe_now_s() - t0) / CALLS * 1e9;
    }
    qsort(ns, BATCHES, sizeof ns[0], probe_cmp_double);
    return ns[BATCHES / 2];
}

static double bw_gbps(size_t size)
{
    /* a sample is one timed batch of calls moving at least 1 MiB (one call
     * from 1 MiB up); the median sample, as for memcpy_bw */
    long per = size >= (1 << 20) ? 1 : (long)((1 << 20) / size);
    /* from 16 MiB up: one call per 1 MiB chunk, walking the whole buffer */
    size_t chunk = size >= (16 << 20) ? (1 << 20) : size;
    int samples = size >= (16 << 20) ? (int)(2 * (size / chunk)) : 101;
    double g[256];
    xfer(1, size);
    for (int b = 0; b < samples; b++) {
        size_t off = (size_t)b * chunk % size;
        double t0 = probe_now_s();
        for (long i = 0; i < per; i++)
            xfer_at(1, off, chunk);
        g[b] = (double)chunk * per / (probe_now_s() - t0) / 1e9;
    }
    qsort(g, (size_t)samples, sizeof g[0], probe_cmp_double);
    return g[samples / 2];
}

int main(int argc, char **argv)
{
    int cpu_a = argc > 1 ? atoi(argv[1]) : 0;
    int cpu_b = argc > 2 ? atoi(argv[2]) : 1;
    alarm(60);
    remote = mmap(NULL, MAXSZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    local = mmap(NULL, MAXSZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (remote == MAP_FAILED || local == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(local, 1, MAXSZ);
    int ready[2], done[2];
    if (pipe(ready) != 0 || pipe(done) != 0) {
        perror("pipe");
        return 1;
    }
    child = fork();
    if (child < 0) {
        perror("fork");
        return 1;
    }
    if (child == 0) {
        alarm(60);
        if (probe_pin(cpu_b) != 0) {
            perror("sched_setaffinity (child)");
            _exit(1);
        }
        memset(remote, 0, MAXSZ); /* the child's own pages, faulted in */
        char c = 1;
        if (write(ready[1], &c, 1) != 1)
            _exit(1);
        ssize_t r = read(done[0], &c, 1); /* sleep until the parent is done */
        (void)r;
        _exit(0);
    }
    if (probe_pin(cpu_a) != 0) {
        perror("sched_setaffinity (parent)");
        kill(child, SIGKILL);
        return 1;
    }
    char c;
    if (read(ready[0], &c, 1) != 1) {
        fprintf(stderr, "child did not start\n");
        return 1;
    }
    printf("pvm_write_lat_ns_8 %.1f\n", lat_ns(1, 8));
    printf("pvm_read_lat_ns_8 %.1f\n", lat_ns(0, 8));
    static const size_t sizes[] = {65536, 1048576, 67108864};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        printf("pvm_write_GBps_%zu %.3f\n", sizes[i], bw_gbps(sizes[i]));
    fflush(stdout);
    c = 0;
    if (write(done[1], &c, 1) != 1)
        kill(child, SIGKILL);
    int st;
    waitpid(child, &st, 0);
    return 0;
}
