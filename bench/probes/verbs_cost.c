/* verbs_cost: a fixed number of one kind of verb call, for instruction
 * counts under callgrind (bench/callgrind.py --verbs), one process, two RC
 * QPs connected to each other over the first port of the first device (the
 * target is this process: the data moves with memcpy, as in the mapped
 * tier between processes).
 *
 *   verbs_cost MODE N
 *
 * MODE: empty      N polls of an empty CQ
 *       write      N signaled 8-byte RDMA WRITEs, each followed by the poll
 *                  that returns its completion
 *       write_unsig N unsignaled 8-byte WRITEs (one signaled every 64th, as
 *                  perftest's cq_mod does, whose completion is polled)
 *       write_inline N unsignaled inline 8-byte WRITEs (idem)
 *       send       N signaled 8-byte SENDs into receives posted beforehand
 *                  in batches, each followed by the polls of its send and
 *                  receive completions
 *       read       N signaled 8-byte RDMA READs, each followed by the poll
 *                  that returns its completion
 *       read_unsig N unsignaled 8-byte READs (one signaled every 64th, as
 *                  perftest's cq_mod does, whose completion is polled)
 *       fadd       N signaled 8-byte fetch-and-adds, each followed by the
 *                  poll that returns its completion (the MR and the QPs
 *                  grant remote atomics in this mode only)
 *       recv       N ibv_post_recv calls of one WR of one SGE; every 64th
 *                  is followed by 64 SENDs that consume them (their polls)
 *       recv16     N ibv_post_recv calls of a list of 16 WRs of one SGE
 *                  each; every 4th is followed by 64 SENDs that consume them
 *       srq_answer N 17-byte inline SENDs of two SGEs (8 + 9 bytes, as UCX's
 *                  am_short carries Open MPI's 8-byte message) into a QP
 *                  with an SRQ, unsignaled (1 in 64 signaled, as UCX's
 *                  moderation), each after the poll of the previous one's
 *                  receive completion (so each is an answer, as in a
 *                  ping-pong: its bytes go into the receive buffer)
 *       srq_stream N 16-byte inline SENDs of two SGEs (8 + 8 bytes, UCX's
 *                  am_bw of 8 bytes) into a QP with an SRQ, 1 in 64
 *                  signaled, 64 in a row before their receive completions
 *                  are polled (a stream: the bytes travel in the
 *                  completion; the first after those polls is an answer)
 * Exit status 0 when every call did what it should (checked), else 1.
 */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DIE(...) do { fprintf(stderr, "verbs_cost: " __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)

#include "probe_verbs.h"

static void poll_one(struct ibv_cq *cq, enum ibv_wc_opcode op) {
  struct ibv_wc wc;
  for (long spins = 0;; ++spins) {
    int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) DIE("poll_cq");
    if (n == 1) break;
    if (spins > 100000000L) DIE("no completion");
  }
  if (wc.status != IBV_WC_SUCCESS || wc.opcode != op) DIE("completion status %d opcode %d", wc.status, wc.opcode);
}

/* 64 SENDs (the 64th signaled) that consume the 64 receives posted on qp[1],
 * and the polls of their completions. */
static void consume64(struct ibv_qp *qp, struct ibv_cq *scq, struct ibv_cq *rcq, struct ibv_sge *sge) {
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.sg_list = sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  for (int k = 0; k < 64; ++k) {
    wr.send_flags = k == 63 ? IBV_SEND_SIGNALED : 0;
    if (ibv_post_send(qp, &wr, &bad)) DIE("post_send");
  }
  poll_one(scq, IBV_WC_SEND);
  for (int k = 0; k < 64; ++k) poll_one(rcq, IBV_WC_RECV);
}

int main(int argc, char **argv) {
  if (argc != 3) DIE("usage: verbs_cost empty|write|write_unsig|write_inline|send|read|read_unsig|fadd|recv|recv16|srq_answer|srq_stream N");
  const char *mode = argv[1];
  long n = atol(argv[2]);
  const int atomic = strcmp(mode, "fadd") == 0;
  int num = 0;
  struct ibv_device **devs = ibv_get_device_list(&num);
  if (!devs || num < 1) DIE("no device");
  struct ibv_context *ctx = ibv_open_device(devs[0]);
  if (!ctx) DIE("open");
  struct ibv_port_attr port;
  if (ibv_query_port(ctx, 1, &port)) DIE("query_port");
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  static char buf[2][4096] __attribute__((aligned(4096)));
  struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof buf,
                                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                                     (atomic ? IBV_ACCESS_REMOTE_ATOMIC : 0));
  struct ibv_cq *cq[2] = {ibv_create_cq(ctx, 256, NULL, NULL, 0), ibv_create_cq(ctx, 256, NULL, NULL, 0)};
  if (!pd || !mr || !cq[0] || !cq[1]) DIE("pd/mr/cq");
  const int stream = strcmp(mode, "srq_stream") == 0;
  const int srq_mode = stream || strcmp(mode, "srq_answer") == 0;
  struct ibv_srq *srq = NULL;
  if (srq_mode) {
    struct ibv_srq_init_attr sa;
    memset(&sa, 0, sizeof sa);
    sa.attr.max_wr = 256;
    sa.attr.max_sge = 1;
    srq = ibv_create_srq(pd, &sa);
    if (!srq) DIE("create_srq");
  }
  struct ibv_qp *qp[2];
  for (int i = 0; i < 2; ++i) {
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = cq[i];
    ia.recv_cq = cq[i];
    ia.srq = i == 1 ? srq : NULL;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 128;
    ia.cap.max_recv_wr = srq && i == 1 ? 0 : 128;
    ia.cap.max_send_sge = 2;
    ia.cap.max_recv_sge = 1;
    ia.cap.max_inline_data = 64;
    qp[i] = ibv_create_qp(pd, &ia);
    if (!qp[i]) DIE("create_qp");
  }
  const unsigned access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE |
                          (atomic ? IBV_ACCESS_REMOTE_ATOMIC : 0);
  probe_rc_to_rts(qp[0], qp[1]->qp_num, port.lid, access);
  probe_rc_to_rts(qp[1], qp[0]->qp_num, port.lid, access);

  struct ibv_sge sge = {(uintptr_t)buf[0], 8, mr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = (uintptr_t)buf[1];
  wr.wr.rdma.rkey = mr->rkey;
  struct ibv_sge rsge = {(uintptr_t)buf[1], 64, mr->lkey};
  struct ibv_recv_wr rwr, *rbad = NULL;
  memset(&rwr, 0, sizeof rwr);
  rwr.sg_list = &rsge;
  rwr.num_sge = 1;

  if (strcmp(mode, "empty") == 0) {
    struct ibv_wc wc;
    for (long i = 0; i < n; ++i)
      if (ibv_poll_cq(cq[0], 1, &wc) != 0) DIE("not empty");
  } else if (strncmp(mode, "write", 5) == 0) {
    const int unsig = strcmp(mode, "write") != 0;
    wr.opcode = IBV_WR_RDMA_WRITE;
    for (long i = 0; i < n; ++i) {
      buf[0][0] = (char)i;
      wr.wr_id = (uint64_t)i;
      const int signaled = !unsig || i % 64 == 63;
      wr.send_flags = (signaled ? IBV_SEND_SIGNALED : 0) | (strcmp(mode, "write_inline") == 0 ? IBV_SEND_INLINE : 0);
      if (ibv_post_send(qp[0], &wr, &bad)) DIE("post_send");
      if (signaled) poll_one(cq[0], IBV_WC_RDMA_WRITE);
    }
    if (n && buf[1][0] != (char)(n - 1)) DIE("data");
  } else if (strcmp(mode, "send") == 0) {
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    for (long i = 0; i < n; ++i) {
      if (i % 64 == 0)
        for (int k = 0; k < 64; ++k)
          if (ibv_post_recv(qp[1], &rwr, &rbad)) DIE("post_recv");
      buf[0][0] = (char)i;
      wr.wr_id = (uint64_t)i;
      if (ibv_post_send(qp[0], &wr, &bad)) DIE("post_send");
      poll_one(cq[0], IBV_WC_SEND);
      poll_one(cq[1], IBV_WC_RECV);
      if (buf[1][0] != (char)i) DIE("data");
    }
  } else if (strncmp(mode, "read", 4) == 0) {
    const int unsig = strcmp(mode, "read") != 0;
    wr.opcode = IBV_WR_RDMA_READ;
    for (long i = 0; i < n; ++i) {
      buf[1][0] = (char)i;
      wr.wr_id = (uint64_t)i;
      const int signaled = !unsig || i % 64 == 63;
      wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
      if (ibv_post_send(qp[0], &wr, &bad)) DIE("post_send");
      if (signaled) poll_one(cq[0], IBV_WC_RDMA_READ);
      if (!unsig && buf[0][0] != (char)i) DIE("data");
    }
    if (n && buf[0][0] != (char)(n - 1)) DIE("data");
  } else if (atomic) {
    uint64_t *word = (uint64_t *)(void *)buf[1], *old = (uint64_t *)(void *)buf[0];
    *word = 0;
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.atomic.remote_addr = (uintptr_t)buf[1];
    wr.wr.atomic.rkey = mr->rkey;
    wr.wr.atomic.compare_add = 1;
    for (long i = 0; i < n; ++i) {
      wr.wr_id = (uint64_t)i;
      if (ibv_post_send(qp[0], &wr, &bad)) DIE("post_send");
      poll_one(cq[0], IBV_WC_FETCH_ADD);
      if (*old != (uint64_t)i) DIE("fetch-and-add returned %llu, not %ld", (unsigned long long)*old, i);
    }
    if (*word != (uint64_t)n) DIE("data");
  } else if (strncmp(mode, "recv", 4) == 0) {
    const int list = strcmp(mode, "recv16") == 0 ? 16 : 1;
    if (list == 1 && strcmp(mode, "recv") != 0) DIE("unknown mode %s", mode);
    struct ibv_recv_wr rl[16];
    for (int k = 0; k < list; ++k) {
      rl[k] = rwr;
      rl[k].next = k + 1 < list ? &rl[k + 1] : NULL;
    }
    for (long i = 0; i < n; ++i) {
      for (int k = 0; k < list; ++k) rl[k].wr_id = (uint64_t)(i * list + k);
      if (ibv_post_recv(qp[1], rl, &rbad)) DIE("post_recv");
      if ((i + 1) * list % 64 == 0) consume64(qp[0], cq[0], cq[1], &sge);
    }
  } else if (srq_mode) {
    /* UCX's am_short: an 8-byte header and the payload, inline */
    static const char hdr[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    char payload[9] = {0};
    const uint32_t plen = stream ? 8 : 9;
    struct ibv_sge two[2] = {{(uintptr_t)hdr, 8, 0}, {(uintptr_t)payload, plen, 0}};
    struct ibv_recv_wr sr[64];
    struct ibv_sge ssge[64];
    for (int k = 0; k < 64; ++k) {
      ssge[k] = (struct ibv_sge){(uintptr_t)buf[1] + 64 * (uint64_t)k, 64, mr->lkey};
      memset(&sr[k], 0, sizeof sr[k]);
      sr[k].sg_list = &ssge[k];
      sr[k].num_sge = 1;
      sr[k].next = k + 1 < 64 ? &sr[k + 1] : NULL;
    }
    struct ibv_recv_wr *sbad = NULL;
    if (ibv_post_srq_recv(srq, sr, &sbad)) DIE("post_srq_recv");
    wr.opcode = IBV_WR_SEND;
    wr.sg_list = two;
    wr.num_sge = 2;
    for (long i = 0; i < n; ++i) {
      payload[0] = (char)i;
      wr.wr_id = (uint64_t)i;
      const int signaled = i % 64 == 63;
      wr.send_flags = IBV_SEND_INLINE | (signaled ? IBV_SEND_SIGNALED : 0);
      if (ibv_post_send(qp[0], &wr, &bad)) DIE("post_send");
      if (!stream) {
        poll_one(cq[1], IBV_WC_RECV);
        if (buf[1][64 * (i % 64) + 8] != (char)i || memcmp(buf[1] + 64 * (i % 64), hdr, 8) != 0) DIE("data");
      }
      if (signaled) {
        poll_one(cq[0], IBV_WC_SEND);
        for (int k = 0; stream && k < 64; ++k) {
          poll_one(cq[1], IBV_WC_RECV);
          if (buf[1][64 * k + 8] != (char)(i - 63 + k) || memcmp(buf[1] + 64 * k, hdr, 8) != 0) DIE("data");
        }
        if (ibv_post_srq_recv(srq, sr, &sbad)) DIE("post_srq_recv");  /* the 64 just consumed, again */
      }
    }
  } else {
    DIE("unknown mode %s", mode);
  }
  ibv_destroy_qp(qp[0]);
  ibv_destroy_qp(qp[1]);
  if (srq) ibv_destroy_srq(srq);
  ibv_destroy_cq(cq[0]);
  ibv_destroy_cq(cq[1]);
  ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(devs);
  return 0;
}
