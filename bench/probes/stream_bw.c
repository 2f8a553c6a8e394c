/* stream_bw: what the provider's data path moves per second when the loop
 * around it costs next to nothing: one process posts RDMA WRITEs, or SENDs
 * into another process's posted receives, as fast as the send queue takes
 * them, and nothing else. It is perftest's ib_write_bw / ib_send_bw without
 * perftest's per-message bookkeeping, so that the 64 KiB rows can tell what
 * the provider costs from what the tool costs (each message there pays both
 * before the next copy starts).
 *
 *   stream_bw TARGET_CPU INITIATOR_CPU [SIZE...]   (default sizes: 65536 1048576)
 *
 * Run under `shmrdma run` (it opens the first device). The target is a
 * child process (forked before either side opens the device), the
 * initiator the parent; they swap QP numbers, LIDs and their buffers' keys
 * over a pipe. One RC QP each, perftest's queue depths (TX 128, RX 512),
 * every 64th WR signaled and its completion polled before the next, as
 * perftest's cq_mod does. The target reposts each receive it polls (a SEND
 * that finds none waits in the initiator's RNR back-off, as under perftest).
 * For each size and each of WRITE and SEND: batches of at least 4 MiB and
 * 64 messages are timed (three untimed first), the median batch is printed
 * as GB/s (1e9 B/s, each byte counted once):
 *
 *   stream_write_GBps_65536 121.3
 *   stream_send_GBps_65536 113.0
 *
 * Its own placement, measured beside the streams: the cache-line hand-off
 * between the two processes (probes/pingpong's loop on one shared line, a
 * median over batches of round trips, half a round trip) before the
 * streams and after them; the larger of the two, so that a run is near
 * only when both were:
 *
 *   stream_handoff_ns_median 31.0
 *
 * The bytes are checked: the last WRITE and the last SEND of every size
 * carry a pattern that the target compares byte for byte. Exit status 0
 * when everything did as it should, 1 otherwise (a line on stderr says
 * what). Every wait is bounded (alarm).
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "probe_util.h"

#define DIE(...)                                       \
    do {                                               \
        fprintf(stderr, "stream_bw: " __VA_ARGS__);    \
        fputc('\n', stderr);                           \
        exit(1);                                       \
    } while (0)

#include "probe_verbs.h" /* after DIE, which it uses */

enum { kSqDepth = 128, kRqDepth = 512, kSignalEvery = 64, kSamples = 101, kWarmup = 3, kMaxSizes = 8, kPollBatch = 16,
       kHandoffTrips = 100, kHandoffBatches = 201 };

struct side {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    unsigned char *buf;
};

struct wire {  /* what each side tells the other */
    uint32_t qpn, rkey;
    uint16_t lid;
    uint64_t addr;
};

struct plan {  /* initiator -> target, before each (op, size) */
    int op;  /* 0 write, 1 send, 2 the hand-off again, -1 done */
    size_t size;
    long messages;
};

static void xwrite(int fd, const void *p, size_t n)
{
    if (write(fd, p, n) != (ssize_t)n) DIE("pipe write");
}

static void xread(int fd, void *p, size_t n)
{
    if (read(fd, p, n) != (ssize_t)n) DIE("pipe read (the other side died?)");
}

static void open_side(struct side *s, size_t len)
{
    int num = 0;
    struct ibv_device **devs = ibv_get_device_list(&num);
    if (!devs || num < 1) DIE("no device (run under `shmrdma run`)");
    s->ctx = ibv_open_device(devs[0]);
    ibv_free_device_list(devs);
    if (!s->ctx) DIE("ibv_open_device");
    s->pd = ibv_alloc_pd(s->ctx);
    s->cq = ibv_create_cq(s->ctx, kSqDepth + kRqDepth, NULL, NULL, 0);
    s->buf = aligned_alloc(4096, len);
    if (!s->pd || !s->cq || !s->buf) DIE("pd/cq/buffer");
    memset(s->buf, 0, len);
    s->mr = ibv_reg_mr(s->pd, s->buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!s->mr) DIE("ibv_reg_mr");
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = s->cq;
    ia.recv_cq = s->cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = kSqDepth;
    ia.cap.max_recv_wr = kRqDepth;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    s->qp = ibv_create_qp(s->pd, &ia);
    if (!s->qp) DIE("ibv_create_qp");
}

/* Either end: its side opened (a buffer of len bytes), what it is sent to
 * the other end and the other end's read back (a pipe holds the few bytes
 * each end writes first, so both ends do it in the same order), its QP
 * taken to RTS towards the other's. The other end's description. */
static struct wire connect_side(struct side *s, size_t len, int in, int out)
{
    open_side(s, len);
    struct ibv_port_attr port;
    if (ibv_query_port(s->ctx, 1, &port)) DIE("ibv_query_port");
    struct wire me = {s->qp->qp_num, s->mr->rkey, port.lid, (uint64_t)(uintptr_t)s->buf}, peer;
    xwrite(out, &me, sizeof me);
    xread(in, &peer, sizeof peer);
    probe_rc_to_rts(s->qp, peer.qpn, peer.lid, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);
    return peer;
}

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The hand-off: the parent (initiator) stores odd counts into *line, the
 * child answers each with the next even one; both spin with a pause. The
 * parent gets the median half round trip in ns, the child 0. */
static double handoff(volatile long *line, int parent)
{
    double half[kHandoffBatches];
    long i = 0;
    for (int b = -10; b < kHandoffBatches; ++b) {
        const double t0 = probe_now_ns();
        for (int k = 0; k < kHandoffTrips; ++k, ++i) {
            if (parent) {
                *line = 2 * i + 1;
                while (*line != 2 * i + 2) relax();
            } else {
                while (*line != 2 * i + 1) relax();
                *line = 2 * i + 2;
            }
        }
        if (b >= 0) half[b] = (probe_now_ns() - t0) / (2.0 * kHandoffTrips);
    }
    if (!parent) return 0;
    qsort(half, kHandoffBatches, sizeof half[0], probe_cmp_double);
    return half[kHandoffBatches / 2];
}

/* The child's part of a hand-off, once the parent is told to start (the
 * line reset first, so the parent's first count is the one it waits for). */
static void answer_handoff(volatile long *line, int out)
{
    *line = 0;
    xwrite(out, "h", 1);
    handoff(line, 0);
}

/* The byte the check pattern has at offset i of message m. */
static unsigned char pattern(long m, size_t i)
{
    return (unsigned char)(m * 131 + i * 7 + (i >> 12));
}

static void check_pattern(const unsigned char *p, size_t size, long m, const char *what)
{
    for (size_t i = 0; i < size; ++i)
        if (p[i] != pattern(m, i)) DIE("%s of %zu bytes: byte %zu is %u, not %u", what, size, i, p[i], pattern(m, i));
}

/* n (1 to kPollBatch) receives of size bytes, in one list (one call). */
static void post_recv(struct side *s, size_t size, int n)
{
    struct ibv_sge sge = {(uintptr_t)s->buf, (uint32_t)size, s->mr->lkey};
    struct ibv_recv_wr wr[kPollBatch], *bad = NULL;
    memset(wr, 0, sizeof wr);
    for (int k = 0; k < n; ++k) {
        wr[k].sg_list = &sge;
        wr[k].num_sge = 1;
        wr[k].next = k + 1 < n ? &wr[k + 1] : NULL;
    }
    if (ibv_post_recv(s->qp, wr, &bad)) DIE("ibv_post_recv");
}

/* The target: for each plan, receive (send) or just wait (write), then say
 * done over the pipe once the last message's bytes were checked. */
static void target(int cpu, int in, int out, size_t max, volatile long *line)
{
    if (probe_pin(cpu)) DIE("pin %d", cpu);
    answer_handoff(line, out);
    struct side s;
    connect_side(&s, max, in, out);
    xwrite(out, "r", 1);
    for (;;) {
        struct plan p;
        xread(in, &p, sizeof p);
        if (p.op < 0) break;
        if (p.op == 2) {
            answer_handoff(line, out);
            continue;
        }
        if (p.op == 1) {
            long posted = 0, got = 0;
            for (; posted < kRqDepth && posted < p.messages; ++posted) post_recv(&s, p.size, 1);
            xwrite(out, "r", 1);
            struct ibv_wc wc[kPollBatch];
            while (got < p.messages) {
                int n = ibv_poll_cq(s.cq, kPollBatch, wc);
                if (n < 0) DIE("ibv_poll_cq");
                for (int k = 0; k < n; ++k)
                    if (wc[k].status != IBV_WC_SUCCESS || wc[k].opcode != IBV_WC_RECV || wc[k].byte_len != p.size)
                        DIE("receive completion: status %d opcode %d byte_len %u", wc[k].status, wc[k].opcode,
                            wc[k].byte_len);
                got += n;
                const int more = p.messages - posted < n ? (int)(p.messages - posted) : n;
                if (more > 0) post_recv(&s, p.size, more), posted += more;
            }
            check_pattern(s.buf, p.size, p.messages - 1, "the last SEND");
        } else {
            xwrite(out, "r", 1);
            char done;
            xread(in, &done, 1); /* the initiator's last WRITE completed */
            check_pattern(s.buf, p.size, p.messages - 1, "the last WRITE");
        }
        xwrite(out, "d", 1);
    }
    exit(0);
}

static void wait_signaled(struct ibv_cq *cq, enum ibv_wc_opcode op)
{
    struct ibv_wc wc;
    int n;
    while ((n = ibv_poll_cq(cq, 1, &wc)) == 0) {
    }
    if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.opcode != op)
        DIE("send completion: status %d opcode %d", n < 0 ? -1 : (int)wc.status, n < 0 ? -1 : (int)wc.opcode);
}

/* One (op, size): the median batch rate, in GB/s. */
static double stream(struct side *s, const struct wire *peer, int in, int out, int op, size_t size)
{
    long per = (long)((4u << 20) / size);
    per = (per + kSignalEvery - 1) / kSignalEvery * kSignalEvery;
    if (per < kSignalEvery) per = kSignalEvery;
    const long messages = per * (kWarmup + kSamples);
    struct plan p = {op, size, messages};
    xwrite(out, &p, sizeof p);
    char c;
    xread(in, &c, 1); /* receives posted */
    struct ibv_sge sge = {(uintptr_t)s->buf, (uint32_t)size, s->mr->lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op ? IBV_WR_SEND : IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = peer->addr;
    wr.wr.rdma.rkey = peer->rkey;
    const enum ibv_wc_opcode done = op ? IBV_WC_SEND : IBV_WC_RDMA_WRITE;
    double gbps[kSamples];
    long m = 0;
    for (int b = -kWarmup; b < kSamples; ++b) {
        if (b == kSamples - 1) /* the last batch carries the pattern the target checks */
            for (size_t i = 0; i < size; ++i) s->buf[i] = pattern(messages - 1, i);
        const double t0 = probe_now_s();
        for (long k = 0; k < per; ++k, ++m) {
            wr.send_flags = (m + 1) % kSignalEvery == 0 ? IBV_SEND_SIGNALED : 0;
            if (ibv_post_send(s->qp, &wr, &bad)) DIE("ibv_post_send");
            if (wr.send_flags) wait_signaled(s->cq, done);
        }
        if (b >= 0) gbps[b] = (double)size * per / (probe_now_s() - t0) / 1e9;
    }
    if (!op) xwrite(out, "w", 1);
    xread(in, &c, 1); /* checked */
    qsort(gbps, kSamples, sizeof gbps[0], probe_cmp_double);
    return gbps[kSamples / 2];
}

int main(int argc, char **argv)
{
    if (argc < 3) DIE("usage: stream_bw TARGET_CPU INITIATOR_CPU [SIZE...]");
    size_t sizes[kMaxSizes] = {65536, 1048576};
    int nsizes = 2;
    if (argc > 3) {
        nsizes = 0;
        for (int i = 3; i < argc && nsizes < kMaxSizes; ++i) {
            long v = atol(argv[i]);
            if (v < 1 || v > (1 << 30)) DIE("size %s", argv[i]);
            sizes[nsizes++] = (size_t)v;
        }
    }
    size_t max = 4096;
    for (int i = 0; i < nsizes; ++i)
        if (sizes[i] > max) max = sizes[i];
    max = (max + 4095) & ~(size_t)4095;
    int to_target[2], to_initiator[2];
    if (pipe(to_target) || pipe(to_initiator)) DIE("pipe");
    /* one line both processes see, for the hand-off */
    volatile long *line = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (line == MAP_FAILED) DIE("mmap");
    alarm(120); /* every wait below is bounded by this (inherited by the child) */
    pid_t child = fork();
    if (child < 0) DIE("fork");
    if (child == 0) {
        close(to_target[1]);
        close(to_initiator[0]);
        target(atoi(argv[1]), to_target[0], to_initiator[1], max, line);
    }
    close(to_target[0]);
    close(to_initiator[1]);
    const int in = to_initiator[0], out = to_target[1];
    if (probe_pin(atoi(argv[2]))) DIE("pin %s", argv[2]);
    char c;
    xread(in, &c, 1); /* the child waits for the first count */
    const double before = handoff(line, 1);
    struct side s;
    const struct wire peer = connect_side(&s, max, in, out);
    xread(in, &c, 1); /* the target's QP is ready too */
    for (int i = 0; i < nsizes; ++i)
        for (int op = 0; op < 2; ++op) {
            double v = stream(&s, &peer, in, out, op, sizes[i]);
            printf("stream_%s_GBps_%zu %.1f\n", op ? "send" : "write", sizes[i], v);
            fflush(stdout);
        }
    struct plan again = {2, 0, 0};
    xwrite(out, &again, sizeof again);
    xread(in, &c, 1);
    const double after = handoff(line, 1);
    printf("stream_handoff_ns_median %.2f\n", before > after ? before : after);
    struct plan end = {-1, 0, 0};
    xwrite(out, &end, sizeof end);
    int status = 0;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        DIE("the target failed");
    return 0;
}
