/* Cache-line ping-pong between two processes pinned to two CPUs.
 *
 *   pingpong [CPU_A CPU_B [ROUND_TRIPS [BATCHES]]]
 *
 * One cache line in MAP_SHARED|MAP_ANONYMOUS memory, shared by a parent
 * (on CPU_A) and a forked child (on CPU_B). The parent stores an odd
 * value, the child waits for it and stores the next even value, and so on:
 * every store moves the line to the other core once. Prints, in ns, the
 * half round trip (one one-way hand-off of the line) as the median and the
 * minimum over BATCHES batches of ROUND_TRIPS round trips each (small
 * batches, so that a batch hit by preemption on a busy or noisy machine
 * is an outlier that the median ignores, not a bias in every figure):
 *
 *   cacheline_halfrtt_ns_median 41.2
 *   cacheline_halfrtt_ns_min 39.8
 *
 * This is the hardware floor of any shared-memory signal between the two
 * cores (a doorbell, a CQE, a perftest "last byte changed" poll).
 */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe_util.h"

struct shared {
    _Alignas(64) _Atomic uint64_t line; /* the ping-pong line */
    _Alignas(64) _Atomic uint64_t stop;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

int main(int argc, char **argv)
{
    int cpu_a = argc > 1 ? atoi(argv[1]) : 0;
    int cpu_b = argc > 2 ? atoi(argv[2]) : 1;
    long rts = argc > 3 ? atol(argv[3]) : 100;
    int batches = argc > 4 ? atoi(argv[4]) : 2000;
    if (rts < 1 || batches < 1 || batches > 1000000) {
        fprintf(stderr, "usage: pingpong [CPU_A CPU_B [ROUND_TRIPS [BATCHES]]]\n");
        return 2;
    }
    alarm(30); /* never hang: a stuck peer kills us */

    struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    atomic_store(&sh->line, 0);
    atomic_store(&sh->stop, 0);

    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 1;
    }
    if (child == 0) {
        alarm(30);
        if (probe_pin(cpu_b) != 0) {
            perror("sched_setaffinity (child)");
            _exit(1);
        }
        uint64_t expect = 1;
        for (;;) {
            uint64_t v;
            while ((v = atomic_load_explicit(&sh->line, memory_order_acquire)) != expect) {
                if (atomic_load_explicit(&sh->stop, memory_order_relaxed))
                    _exit(0);
                cpu_relax();
            }
            atomic_store_explicit(&sh->line, expect + 1, memory_order_release);
            expect += 2;
        }
    }
    if (probe_pin(cpu_a) != 0) {
        perror("sched_setaffinity (parent)");
        kill(child, SIGKILL);
        return 1;
    }

    double *half = calloc((size_t)batches, sizeof *half);
    uint64_t v = 0;
    /* warm-up batches, not counted */
    for (int b = -10; b < batches; b++) {
        double t0 = probe_now_ns();
        for (long i = 0; i < rts; i++) {
            atomic_store_explicit(&sh->line, v + 1, memory_order_release);
            while (atomic_load_explicit(&sh->line, memory_order_acquire) != v + 2)
                cpu_relax();
            v += 2;
        }
        double t1 = probe_now_ns();
        if (b >= 0)
            half[b] = (t1 - t0) / (2.0 * rts);
    }
    atomic_store(&sh->stop, 1);
    int status = 0;
    waitpid(child, &status, 0);

    qsort(half, (size_t)batches, sizeof *half, probe_cmp_double);
    printf("cacheline_halfrtt_ns_median %.2f\n", half[batches / 2]);
    printf("cacheline_halfrtt_ns_min %.2f\n", half[0]);
    return 0;
}
