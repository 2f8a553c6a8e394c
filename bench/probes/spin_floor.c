/* The floor of a latency loop that waits by spinning on a byte its peer
 * stores, for two processes pinned to two CPUs.
 *
 *   spin_floor [CPU_A CPU_B [ROUND_TRIPS [BATCHES]]]
 *
 * perftest's ib_write_lat loop with a plain store in place of the post: each
 * side spins on the last byte of its own buffer until it holds the count it
 * waits for, stores the next count into its own send buffer and then into
 * the last byte of the peer's buffer (the bytes the RDMA WRITE would move),
 * and spins again. Two lines, each written by one side and polled by the
 * other, on separate pages (the two processes' buffers); the spin reads the
 * byte and a second local word per turn without a pause, as
 * run_iter_lat_write's `while (*poll_buf != (char)rcnt && state !=
 * END_STATE);` does. The same loop with a pause in the spin (a waiter that
 * backs off, as UCX's put_lat's does between its progress calls) is
 * measured too. On two cores that poll so hard the line moves back and
 * forth while its writer waits for it, and the hand-off costs well above
 * probes/pingpong's single line: this, not pingpong's figure, is what
 * ib_write_lat's own loop costs with a provider that takes no time at all.
 *
 * Prints, in ns, the half round trip as the median (and the minimum) over
 * BATCHES batches of ROUND_TRIPS round trips each, first of the same loop on
 * one line with a pause (probes/pingpong's hand-off, measured here too so
 * that the two figures after it can be told near or far by it):
 *
 *   spin2_handoff_ns_median 30.2
 *   spin2_halfrtt_ns_median 74.1      (no pause: perftest's loop)
 *   spin2_halfrtt_ns_min 70.2
 *   spin2_pause_halfrtt_ns_median 48.0 (with a pause)
 *   spin2_pause_halfrtt_ns_min 45.3
 */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe_util.h"

#define PAGE 4096

struct side {
    volatile char *poll;  /* the last byte of its own buffer: the peer stores here */
    volatile char *post;  /* its send buffer's byte (stored before the "WRITE") */
    volatile char *peer;  /* the last byte of the peer's buffer */
    volatile int *state;  /* perftest's user_param->state, read on every turn */
};

static inline void relax(int pause)
{
#if defined(__x86_64__) || defined(__i386__)
    if (pause)
        __builtin_ia32_pause();
#else
    (void)pause;
#endif
}

/* One side's turn: wait for count `want`, then send `next`. */
static inline void wait_for(const struct side *s, char want, int pause)
{
    while (*s->poll != want && *s->state == 0)
        relax(pause);
}

static inline void send(const struct side *s, char next)
{
    *s->post = next;
    *s->peer = next;
}

/* The median and minimum of one loop; -1 on failure. one_line: both sides
 * poll and store the same byte (probes/pingpong's single line). */
static int measure(char *mem, int cpu_a, int cpu_b, long rts, int batches, int pause, int one_line, double *med,
                   double *min)
{
    /* Four pages: A's buffer, B's buffer, A's state, B's state. */
    for (int i = 0; i < 4 * PAGE; i++)
        mem[i] = 0;
    struct side a = {mem + PAGE - 1, mem + 64, mem + 2 * PAGE - 1, (volatile int *)(mem + 2 * PAGE)};
    struct side b = {mem + 2 * PAGE - 1, mem + PAGE + 64, mem + PAGE - 1, (volatile int *)(mem + 3 * PAGE)};
    if (one_line) {
        a.peer = b.poll = a.poll;
        b.peer = a.poll;
    }
    long total = (long)(batches + 10) * rts;

    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return -1;
    }
    if (child == 0) {
        alarm(30);
        if (probe_pin(cpu_b) != 0) {
            perror("sched_setaffinity (child)");
            _exit(1);
        }
        /* B answers each count: waits for odd 2k+1, sends 2k+2 (as chars). */
        for (long i = 0; i < total; i++) {
            wait_for(&b, (char)(2 * i + 1), pause);
            if (*b.state)
                _exit(1);
            send(&b, (char)(2 * i + 2));
        }
        _exit(0);
    }
    if (probe_pin(cpu_a) != 0) {
        perror("sched_setaffinity (parent)");
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        return -1;
    }
    double *half = calloc((size_t)batches, sizeof *half);
    if (!half) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        return -1;
    }
    long i = 0;
    for (int bt = -10; bt < batches; bt++) { /* ten warm-up batches, not counted */
        double t0 = probe_now_ns();
        for (long k = 0; k < rts; k++, i++) {
            send(&a, (char)(2 * i + 1));
            wait_for(&a, (char)(2 * i + 2), pause);
        }
        double t1 = probe_now_ns();
        if (bt >= 0)
            half[bt] = (t1 - t0) / (2.0 * rts);
    }
    int status = 0;
    waitpid(child, &status, 0);
    qsort(half, (size_t)batches, sizeof *half, probe_cmp_double);
    *med = half[batches / 2];
    *min = half[0];
    free(half);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    int cpu_a = argc > 1 ? atoi(argv[1]) : 0;
    int cpu_b = argc > 2 ? atoi(argv[2]) : 1;
    long rts = argc > 3 ? atol(argv[3]) : 100;
    int batches = argc > 4 ? atoi(argv[4]) : 500;
    if (rts < 1 || batches < 1 || batches > 1000000) {
        fprintf(stderr, "usage: spin_floor [CPU_A CPU_B [ROUND_TRIPS [BATCHES]]]\n");
        return 2;
    }
    alarm(30); /* never hang: a stuck peer kills us */
    char *mem = mmap(NULL, 4 * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    double med, min;
    if (measure(mem, cpu_a, cpu_b, rts, batches, 1, 1, &med, &min) != 0)
        return 1;
    printf("spin2_handoff_ns_median %.2f\n", med);
    if (measure(mem, cpu_a, cpu_b, rts, batches, 0, 0, &med, &min) != 0)
        return 1;
    printf("spin2_halfrtt_ns_median %.2f\n", med);
    printf("spin2_halfrtt_ns_min %.2f\n", min);
    if (measure(mem, cpu_a, cpu_b, rts, batches, 1, 0, &med, &min) != 0)
        return 1;
    printf("spin2_pause_halfrtt_ns_median %.2f\n", med);
    printf("spin2_pause_halfrtt_ns_min %.2f\n", min);
    return 0;
}
