// A verbs program for the completion-queue and completion-event tests.
// Public libibverbs API only. Every run has a watchdog (alarm) so it never
// hangs a test; failures print "FAIL: ..." and exit 1.
//
//   events_helper loopback-ex   ibv_create_cq_ex + the ibv_cq_ex poll API on a
//                               QP pair connected to each other
//   events_helper resize        ibv_resize_cq keeps queued completions, rejects too small
//   events_helper busy          destroy_cq EBUSY, channel refcounts
//   events_helper own-sends     our own send completions (the CQ's private FIFO):
//                               order, overrun, resize, events, threads, the
//                               claim switching under traffic, arming races
//   events_helper no-shim       without the shim: no channel, no CQ on a fake channel
//   events_helper node          interactive (commands on stdin, see run_node)
//   events_helper stress-owner  receives N messages while resizing its CQ
//   events_helper stress-sender sends N messages
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <sched.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

[[noreturn]] void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fputs("FAIL: ", stdout);
  std::vfprintf(stdout, fmt, ap);
  std::fputs("\n", stdout);
  va_end(ap);
  std::fflush(stdout);
  std::exit(1);
}

#define CHECK(cond, ...)        \
  do {                          \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

void say(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stdout, fmt, ap);
  std::fputs("\n", stdout);
  va_end(ap);
  std::fflush(stdout);
}

ibv_context* open_device() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  CHECK(list && n > 0, "no RDMA device (errno %d)", errno);
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n && !ctx; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "shm0") == 0) ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  CHECK(ctx, "cannot open shm0 (errno %d)", errno);
  return ctx;
}

// MR buffers: whole pages of their own (registration may work on whole
// pages; nothing else shares them).
char* alloc_buf(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(p != MAP_FAILED, "mmap %zu", bytes);
  return static_cast<char*>(p);
}

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

struct Addr {
  uint16_t lid = 0;
  uint32_t qpn = 0;
};

uint16_t port_lid(ibv_context* ctx) {
  ibv_port_attr pa{};
  CHECK(ibv_query_port(ctx, 1, &pa) == 0, "query_port");
  return pa.lid;
}

// srq: the QP takes its receives from it (no receive queue of its own).
ibv_qp* make_qp(ibv_pd* pd, ibv_cq* scq, ibv_cq* rcq, uint32_t send_wr = 64, uint32_t recv_wr = 256,
                ibv_srq* srq = nullptr) {
  ibv_qp_init_attr a{};
  a.send_cq = scq;
  a.recv_cq = rcq;
  a.srq = srq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = send_wr;
  a.cap.max_recv_wr = srq ? 0 : recv_wr;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = srq ? 0 : 1;
  ibv_qp* qp = ibv_create_qp(pd, &a);
  CHECK(qp, "create_qp (errno %d)", errno);
  return qp;
}

void connect_qp(ibv_qp* qp, Addr remote) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = kAccess;
  CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0, "INIT");
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = remote.qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 1;
  a.ah_attr.dlid = remote.lid;
  a.ah_attr.port_num = 1;
  CHECK(ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
        "RTR");
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;  // wait for receives forever
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  CHECK(ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                          IBV_QP_MAX_QP_RD_ATOMIC) == 0,
        "RTS");
}

// Into the QP's receive queue, or into srq when there is one.
void post_recv(ibv_qp* qp, ibv_mr* mr, uint64_t wr_id, uint32_t len = 64, ibv_srq* srq = nullptr) {
  ibv_sge sge{reinterpret_cast<uint64_t>(mr->addr), len, mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (srq) CHECK(ibv_post_srq_recv(srq, &wr, &bad) == 0, "post_srq_recv");
  else CHECK(ibv_post_recv(qp, &wr, &bad) == 0, "post_recv");
}

void post_send(ibv_qp* qp, ibv_mr* mr, uint64_t wr_id, uint32_t len, unsigned flags, bool imm = false,
               uint32_t imm_value = 0) {
  ibv_sge sge{reinterpret_cast<uint64_t>(mr->addr), len, mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
  wr.send_flags = flags;
  wr.imm_data = htobe32(imm_value);
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp, &wr, &bad);
  CHECK(rc == 0, "post_send: %d", rc);
}

// Polls until `n` completions arrived (bounded by the watchdog).
std::vector<ibv_wc> poll_n(ibv_cq* cq, int n) {
  std::vector<ibv_wc> out;
  for (long spins = 0; static_cast<int>(out.size()) < n; ++spins) {
    ibv_wc wc[16];
    int k = ibv_poll_cq(cq, std::min(16, n - static_cast<int>(out.size())), wc);
    CHECK(k >= 0, "poll_cq: %d", k);
    out.insert(out.end(), wc, wc + k);
    if (k == 0 && spins > 1000) usleep(100);
  }
  return out;
}

// ------------------------------------------------------------ loopback-ex

void loopback_ex() {
  ibv_context* ctx = open_device();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  CHECK(pd, "alloc_pd");

  // Unsupported fields fail cleanly with EOPNOTSUPP (callers fall back);
  // a parent domain that is not one is EINVAL (timestamps and parent domains
  // are tested in tests/datapath/dp_contract.cc).
  ibv_cq_init_attr_ex bad{};
  bad.cqe = 16;
  bad.wc_flags = IBV_WC_EX_WITH_CVLAN;
  errno = 0;
  CHECK(!ibv_create_cq_ex(ctx, &bad) && errno == EOPNOTSUPP, "CVLAN: expected EOPNOTSUPP, errno %d", errno);
  bad.wc_flags = IBV_WC_STANDARD_FLAGS;
  bad.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  errno = 0;
  CHECK(!ibv_create_cq_ex(ctx, &bad) && errno == EINVAL, "no parent domain: expected EINVAL, errno %d", errno);

  int cookie = 0;
  ibv_cq_init_attr_ex ca{};
  ca.cqe = 32;
  ca.cq_context = &cookie;
  ca.wc_flags = IBV_WC_STANDARD_FLAGS;
  ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
  ca.flags = IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN;  // what UCX asks for
  ibv_cq_ex* cqx = ibv_create_cq_ex(ctx, &ca);
  CHECK(cqx, "create_cq_ex (errno %d)", errno);
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  CHECK(cq->cqe >= 32 && cq->cq_context == &cookie && cq->context == ctx, "cq fields: cqe %d", cq->cqe);

  ibv_poll_cq_attr pattr{};
  CHECK(ibv_start_poll(cqx, &pattr) == ENOENT, "start_poll on an empty CQ must be ENOENT");

  char* buf = alloc_buf(8192);
  ibv_mr* mr = ibv_reg_mr(pd, buf, 8192, kAccess);
  CHECK(mr, "reg_mr");
  ibv_qp* a = make_qp(pd, cq, cq);
  ibv_qp* b = make_qp(pd, cq, cq);
  uint16_t lid = port_lid(ctx);
  connect_qp(a, {lid, b->qp_num});
  connect_qp(b, {lid, a->qp_num});

  for (int i = 0; i < 3; ++i) post_recv(b, mr, 100 + i);
  post_send(a, mr, 1, 10, IBV_SEND_SIGNALED, true, 0xabcd0001);
  post_send(a, mr, 2, 20, IBV_SEND_SIGNALED);
  post_send(a, mr, 3, 30, IBV_SEND_SIGNALED, true, 0xabcd0003);

  // 6 completions: 3 sends (wr_id 1..3) and 3 receives (100..102).
  int sends = 0, recvs = 0;
  bool started = false;
  for (int spins = 0; sends + recvs < 6; ++spins) {
    int rc = started ? ibv_next_poll(cqx) : ibv_start_poll(cqx, &pattr);
    if (rc == ENOENT) {
      if (started) ibv_end_poll(cqx);
      started = false;
      CHECK(spins < 1000000, "completions missing: %d sends %d recvs", sends, recvs);
      continue;
    }
    CHECK(rc == 0, "start/next_poll: %d", rc);
    started = true;
    CHECK(cqx->status == IBV_WC_SUCCESS, "status %d", cqx->status);
    ibv_wc_opcode op = ibv_wc_read_opcode(cqx);
    if (op == IBV_WC_SEND) {
      CHECK(cqx->wr_id == static_cast<uint64_t>(1 + sends), "send wr_id %llu", (unsigned long long)cqx->wr_id);
      CHECK(ibv_wc_read_qp_num(cqx) == a->qp_num, "send qp_num");
      ++sends;
    } else {
      CHECK(op == IBV_WC_RECV, "opcode %d", op);
      const int i = recvs++;
      CHECK(cqx->wr_id == static_cast<uint64_t>(100 + i), "recv wr_id %llu", (unsigned long long)cqx->wr_id);
      CHECK(ibv_wc_read_byte_len(cqx) == static_cast<uint32_t>(10 * (i + 1)), "byte_len %u", ibv_wc_read_byte_len(cqx));
      CHECK(ibv_wc_read_qp_num(cqx) == b->qp_num, "recv qp_num");
      CHECK(ibv_wc_read_src_qp(cqx) == a->qp_num, "src_qp");
      CHECK(ibv_wc_read_slid(cqx) == lid, "slid %u", ibv_wc_read_slid(cqx));
      CHECK(ibv_wc_read_sl(cqx) == 0 && ibv_wc_read_dlid_path_bits(cqx) == 0, "sl / dlid_path_bits");
      CHECK(ibv_wc_read_vendor_err(cqx) == 0, "vendor_err");
      unsigned flags = ibv_wc_read_wc_flags(cqx);
      if (i == 1) {
        CHECK(!(flags & IBV_WC_WITH_IMM), "no immediate expected");
      } else {
        CHECK(flags & IBV_WC_WITH_IMM, "immediate expected");
        CHECK(be32toh(ibv_wc_read_imm_data(cqx)) == (i == 0 ? 0xabcd0001u : 0xabcd0003u), "imm_data");
      }
    }
  }
  if (started) ibv_end_poll(cqx);
  CHECK(ibv_start_poll(cqx, &pattr) == ENOENT, "CQ should be empty");

  // The legacy poll works on an extended CQ too.
  post_recv(b, mr, 200);
  post_send(a, mr, 4, 1, 0);  // unsignaled: only the receive completes
  std::vector<ibv_wc> w = poll_n(cq, 1);
  CHECK(w[0].wr_id == 200 && w[0].opcode == IBV_WC_RECV && w[0].byte_len == 1, "legacy poll on cq_ex");

  CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
  CHECK(ibv_destroy_cq(cq) == 0, "destroy_cq");
  CHECK(ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0, "teardown");
  CHECK(ibv_close_device(ctx) == 0, "close");
  say("OK loopback-ex");
}

// ------------------------------------------------------------------ resize

void resize() {
  ibv_context* ctx = open_device();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* scq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  ibv_cq* rcq = ibv_create_cq(ctx, 8, nullptr, nullptr, 0);
  CHECK(pd && scq && rcq, "setup");
  CHECK(rcq->cqe == 8, "cqe %d", rcq->cqe);
  char* buf = alloc_buf(4096);
  ibv_mr* mr = ibv_reg_mr(pd, buf, 4096, kAccess);
  ibv_qp* a = make_qp(pd, scq, scq);
  ibv_qp* b = make_qp(pd, rcq, rcq);
  uint16_t lid = port_lid(ctx);
  connect_qp(a, {lid, b->qp_num});
  connect_qp(b, {lid, a->qp_num});

  for (int i = 0; i < 6; ++i) post_recv(b, mr, i);
  for (int i = 0; i < 6; ++i) post_send(a, mr, i, 8, 0);
  // The receives completed synchronously (loopback): 6 are queued in rcq.
  CHECK(ibv_resize_cq(rcq, 4) == EINVAL, "resize below the queued count must be EINVAL");
  CHECK(ibv_resize_cq(rcq, 0) == EINVAL, "resize to 0 must be EINVAL");
  CHECK(ibv_resize_cq(rcq, 100) == 0, "resize up");
  CHECK(rcq->cqe >= 100, "cqe after resize %d", rcq->cqe);
  std::vector<ibv_wc> w = poll_n(rcq, 3);
  for (int i = 0; i < 3; ++i) CHECK(w[i].wr_id == static_cast<uint64_t>(i), "order after resize up");
  CHECK(ibv_resize_cq(rcq, 2) == EINVAL, "3 queued, 2 slots: EINVAL");
  CHECK(ibv_resize_cq(rcq, 3) == 0, "resize down to exactly what is queued (rounded up)");
  CHECK(rcq->cqe >= 3 && rcq->cqe < 100, "cqe after resize down %d", rcq->cqe);
  // More completions arrive in the resized CQ after the moved ones.
  post_recv(b, mr, 6);
  post_send(a, mr, 6, 8, 0);
  w = poll_n(rcq, 4);
  for (int i = 0; i < 4; ++i) CHECK(w[i].wr_id == static_cast<uint64_t>(3 + i), "order after resize down: %llu",
                                    (unsigned long long)w[i].wr_id);
  ibv_wc extra;
  CHECK(ibv_poll_cq(rcq, 1, &extra) == 0, "CQ should be empty");
  CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
  CHECK(ibv_destroy_cq(rcq) == 0 && ibv_destroy_cq(scq) == 0, "destroy_cq");
  ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  say("OK resize");
}

// -------------------------------------------------------------------- busy

void busy() {
  ibv_context* ctx = open_device();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
  CHECK(ch, "create_comp_channel (errno %d): is the shim preloaded?", errno);
  CHECK(ch->context == ctx && ch->fd >= 0, "channel fields");
  ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, ch, 0);
  CHECK(cq && cq->channel == ch, "create_cq with channel (errno %d)", errno);
  ibv_qp* qp = make_qp(pd, cq, cq);
  CHECK(ibv_destroy_cq(cq) == EBUSY, "destroy_cq while a QP uses it must be EBUSY");
  CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "destroy_comp_channel while a CQ uses it must be EBUSY");
  CHECK(ibv_destroy_qp(qp) == 0, "destroy_qp");
  CHECK(ibv_destroy_cq(cq) == 0, "destroy_cq");
  // A second CQ on the same channel, then both gone: the channel goes too.
  ibv_cq* c1 = ibv_create_cq(ctx, 4, nullptr, ch, 0);
  ibv_cq* c2 = ibv_create_cq(ctx, 4, nullptr, ch, 0);
  CHECK(c1 && c2, "two CQs on one channel");
  CHECK(ibv_destroy_cq(c1) == 0, "destroy c1");
  CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "c2 still uses the channel");
  CHECK(ibv_destroy_cq(c2) == 0, "destroy c2");
  CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy_comp_channel after its CQs");
  // A channel of another context is refused.
  ibv_context* other = open_device();
  ibv_comp_channel* och = ibv_create_comp_channel(other);
  CHECK(och, "second context's channel");
  errno = 0;
  CHECK(!ibv_create_cq(ctx, 4, nullptr, och, 0) && errno == EINVAL, "foreign channel: EINVAL (errno %d)", errno);
  CHECK(ibv_destroy_comp_channel(och) == 0, "destroy other channel");
  ibv_close_device(other);
  ibv_dealloc_pd(pd);
  CHECK(ibv_close_device(ctx) == 0, "close");
  say("OK busy");
}

// ----------------------------------------------------------------- no-shim

void no_shim() {
  ibv_context* ctx = open_device();
  errno = 0;
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
  CHECK(!ch, "ibv_create_comp_channel must fail without the shim");
  say("create_comp_channel failed: errno %d (%s)", errno, std::strerror(errno));
  int p[2];
  CHECK(pipe(p) == 0, "pipe");
  ibv_comp_channel fake{ctx, p[0], 0};
  errno = 0;
  ibv_cq* cq = ibv_create_cq(ctx, 8, nullptr, &fake, 0);
  CHECK(!cq && errno == EINVAL, "create_cq with a channel that is not ours must fail with EINVAL (errno %d)", errno);
  CHECK(fake.refcnt == 0, "refcnt touched");
  // The CQ path without a channel is unaffected.
  cq = ibv_create_cq(ctx, 8, nullptr, nullptr, 0);
  CHECK(cq && ibv_req_notify_cq(cq, 0) == 0 && ibv_destroy_cq(cq) == 0, "plain CQ");
  CHECK(ibv_close_device(ctx) == 0, "close");
  say("OK no-shim");
}

// -------------------------------------------------------------------- node

// Interactive endpoint. Prints "ADDR <lid> <qpn>", then executes commands:
//   CONNECT lid qpn            connect the QP
//   RECV n                     post n receives
//   ARM send|recv 0|1          ibv_req_notify_cq (1: solicited only)
//   SEND n [sol] [sig]         post n sends (IBV_SEND_SOLICITED / SIGNALED)
//   EVENT                      ibv_get_cq_event (blocking), ack, print "EVENT send|recv"
//   NOEVENT ms                 the channel must stay unreadable for ms
//   POLL send|recv n           poll until n completions, print their wr_ids
//   QUIT                       tear down and exit
// Answers "OK ..." or a result line; anything wrong: "FAIL: ..." and exit 1.
// with_srq: the QP's receives come from a basic SRQ (RECV posts there).
void run_node(bool with_srq) {
  ibv_context* ctx = open_device();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
  CHECK(pd && ch, "setup (errno %d)", errno);
  static int send_tag, recv_tag;
  ibv_cq* scq = ibv_create_cq(ctx, 256, &send_tag, ch, 0);
  ibv_cq* rcq = ibv_create_cq(ctx, 256, &recv_tag, ch, 0);
  CHECK(scq && rcq, "create_cq (errno %d)", errno);
  char* buf = alloc_buf(65536);
  ibv_mr* mr = ibv_reg_mr(pd, buf, 65536, kAccess);
  ibv_srq* srq = nullptr;
  if (with_srq) {
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = 256;
    sa.attr.max_sge = 1;
    srq = ibv_create_srq(pd, &sa);
    CHECK(srq, "create_srq (errno %d)", errno);
  }
  ibv_qp* qp = make_qp(pd, scq, rcq, 64, 256, srq);
  say("ADDR %u %u", port_lid(ctx), qp->qp_num);
  uint64_t next_recv = 0, next_send = 0;
  unsigned unacked_send = 0, unacked_recv = 0;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "CONNECT") {
      Addr r;
      in >> r.lid >> r.qpn;
      connect_qp(qp, r);
      say("OK connected");
    } else if (cmd == "RECV") {
      int n = 0;
      in >> n;
      for (int i = 0; i < n; ++i) post_recv(qp, mr, next_recv++, 4096, srq);
      say("OK posted %d", n);
    } else if (cmd == "ARM") {
      std::string which;
      int sol = 0;
      in >> which >> sol;
      CHECK(ibv_req_notify_cq(which == "send" ? scq : rcq, sol) == 0, "req_notify_cq");
      say("OK armed %s %d", which.c_str(), sol);
    } else if (cmd == "SEND") {
      int n = 0;
      in >> n;
      unsigned flags = 0;
      std::string f;
      while (in >> f) {
        if (f == "sol") flags |= IBV_SEND_SOLICITED;
        if (f == "sig") flags |= IBV_SEND_SIGNALED;
      }
      for (int i = 0; i < n; ++i) post_send(qp, mr, next_send++, 32, flags);
      say("OK sent %d", n);
    } else if (cmd == "EVENT") {
      ibv_cq* cq = nullptr;
      void* cq_ctx = nullptr;
      CHECK(ibv_get_cq_event(ch, &cq, &cq_ctx) == 0, "get_cq_event (errno %d)", errno);
      CHECK(cq == scq || cq == rcq, "event for an unknown CQ %p", static_cast<void*>(cq));
      CHECK(cq_ctx == (cq == scq ? static_cast<void*>(&send_tag) : static_cast<void*>(&recv_tag)), "cq_context");
      (cq == scq ? unacked_send : unacked_recv) += 1;
      ibv_ack_cq_events(cq, 1);
      (cq == scq ? unacked_send : unacked_recv) -= 1;
      say("EVENT %s", cq == scq ? "send" : "recv");
    } else if (cmd == "NOEVENT") {
      int ms = 0;
      in >> ms;
      pollfd p{ch->fd, POLLIN, 0};
      int k = poll(&p, 1, ms);
      CHECK(k == 0, "the channel became readable (poll %d)", k);
      say("OK no event");
    } else if (cmd == "POLL") {
      std::string which;
      int n = 0;
      in >> which >> n;
      std::vector<ibv_wc> w = poll_n(which == "send" ? scq : rcq, n);
      std::string ids;
      for (auto& c : w) {
        CHECK(c.status == IBV_WC_SUCCESS, "completion status %d (%s)", c.status, ibv_wc_status_str(c.status));
        ids += ' ';  // appended piecewise: `" " + std::to_string(n)` trips GCC 12's -Wrestrict at -O3
        ids += std::to_string(c.wr_id);
      }
      say("POLLED%s", ids.c_str());
    } else if (cmd == "QUIT") {
      CHECK(ibv_destroy_qp(qp) == 0, "destroy_qp");
      CHECK(!srq || ibv_destroy_srq(srq) == 0, "destroy_srq");
      CHECK(ibv_destroy_cq(scq) == 0 && ibv_destroy_cq(rcq) == 0, "destroy_cq");
      CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy_comp_channel");
      ibv_dereg_mr(mr);
      ibv_dealloc_pd(pd);
      CHECK(ibv_close_device(ctx) == 0, "close");
      say("BYE");
      return;
    } else if (!cmd.empty()) {
      fail("unknown command %s", cmd.c_str());
    }
  }
  fail("stdin closed");
}

// ------------------------------------------------------------------ stress

// Reads "CONNECT lid qpn" from stdin.
Addr read_connect() {
  std::string line, cmd;
  CHECK(std::getline(std::cin, line), "stdin closed");
  std::istringstream in(line);
  Addr r;
  in >> cmd >> r.lid >> r.qpn;
  CHECK(cmd == "CONNECT", "expected CONNECT, got %s", line.c_str());
  return r;
}

// Receives n messages on a CQ it keeps resizing while the peer produces
// into it. Checks that every completion arrives, in order, successful.
void stress_owner(int n) {
  ibv_context* ctx = open_device();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* scq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
  ibv_cq* rcq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  char* buf = alloc_buf(4096);
  ibv_mr* mr = ibv_reg_mr(pd, buf, 4096, kAccess);
  ibv_qp* qp = make_qp(pd, scq, rcq, 16, 64);
  say("ADDR %u %u", port_lid(ctx), qp->qp_num);
  connect_qp(qp, read_connect());
  constexpr int kPosted = 48;  // never more outstanding than the smallest CQ size
  uint64_t next_post = 0, expect = 0;
  for (; next_post < kPosted; ++next_post) post_recv(qp, mr, next_post);
  say("READY");
  const int sizes[] = {64, 4096, 128, 1024, 64, 512};
  int resizes = 0, rejected = 0, polls = 0;
  while (expect < static_cast<uint64_t>(n)) {
    ibv_wc wc[8];
    int k = ibv_poll_cq(rcq, 8, wc);
    CHECK(k >= 0, "poll_cq %d", k);
    for (int i = 0; i < k; ++i) {
      CHECK(wc[i].status == IBV_WC_SUCCESS, "status %s", ibv_wc_status_str(wc[i].status));
      CHECK(wc[i].wr_id == expect, "completion %llu out of order, expected %llu", (unsigned long long)wc[i].wr_id,
            (unsigned long long)expect);
      ++expect;
      if (next_post < static_cast<uint64_t>(n)) post_recv(qp, mr, next_post++);
    }
    if (++polls % 7 == 0) {
      // Never below what can be outstanding (kPosted), so EINVAL is a bug.
      int rc = ibv_resize_cq(rcq, sizes[(resizes + rejected) % 6]);
      CHECK(rc == 0 || rc == EBUSY, "resize_cq: %d", rc);
      ++(rc == 0 ? resizes : rejected);
      CHECK(rcq->cqe >= kPosted, "cqe %d", rcq->cqe);
    }
  }
  say("RECEIVED %llu resizes %d rejected %d", (unsigned long long)expect, resizes, rejected);
  ibv_destroy_qp(qp);
  ibv_destroy_cq(rcq);
  ibv_destroy_cq(scq);
  ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
}

void stress_sender(int n) {
  ibv_context* ctx = open_device();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  char* buf = alloc_buf(4096);
  ibv_mr* mr = ibv_reg_mr(pd, buf, 4096, kAccess);
  ibv_qp* qp = make_qp(pd, cq, cq, 64, 1);
  say("ADDR %u %u", port_lid(ctx), qp->qp_num);
  connect_qp(qp, read_connect());
  int in_flight = 0;
  for (int i = 0; i < n; ++i) {
    bool sig = i % 16 == 15 || i == n - 1;
    post_send(qp, mr, i, 16, sig ? IBV_SEND_SIGNALED : 0);
    in_flight += 1;
    if (sig) {
      poll_n(cq, 1);  // retires the 16 before it
      in_flight = 0;
    }
  }
  say("DONE %d", n);
  ibv_destroy_qp(qp);
  ibv_destroy_cq(cq);
  ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
}

// ------------------------------------------------------------- own-sends
//
// Our own send completions, which a CQ keeps apart from the shared ring
// (src/local_cq.h), on loopback pairs in one context: per-QP order with the
// flushes of a move to ERR behind still unpolled successes, send and receive
// completions of one CQ both delivered, an overrun from own sends alone,
// resize with own completions pending, a channel woken by an own send
// completion (also by a list's, each WR of it once; a solicited-only
// arming, by an error completion), two
// posting threads on two QPs of one CQ with a third polling, the order of a
// receive success, the send error after it and the flushes it causes, the
// claim's switch between one and several producers under traffic, and
// arming against a completion another thread makes.

void post_write(ibv_qp* qp, ibv_mr* mr, uint64_t wr_id, uint32_t rkey, uint64_t raddr, unsigned flags = IBV_SEND_SIGNALED) {
  ibv_sge sge{reinterpret_cast<uint64_t>(mr->addr), 8, mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = flags;
  wr.wr.rdma.rkey = rkey;
  wr.wr.rdma.remote_addr = raddr;
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp, &wr, &bad);
  CHECK(rc == 0, "post_send (write %llu): %d", static_cast<unsigned long long>(wr_id), rc);
}

// Two QPs of ctx connected to each other: a completes into acq, b into bcq.
std::pair<ibv_qp*, ibv_qp*> loop_pair(ibv_context* ctx, ibv_pd* pd, ibv_cq* acq, ibv_cq* bcq, uint32_t send_wr = 64) {
  ibv_qp* a = make_qp(pd, acq, acq, send_wr);
  ibv_qp* b = make_qp(pd, bcq, bcq, send_wr);
  const uint16_t lid = port_lid(ctx);
  connect_qp(a, Addr{lid, b->qp_num});
  connect_qp(b, Addr{lid, a->qp_num});
  return {a, b};
}

bool readable(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, ms) == 1;
}

void own_sends() {
  ibv_context* ctx = open_device();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  CHECK(pd, "alloc_pd");
  char* buf = alloc_buf(1 << 16);
  ibv_mr* mr = ibv_reg_mr(pd, buf, 1 << 16, kAccess);
  CHECK(mr, "reg_mr");
  const uint64_t raddr = reinterpret_cast<uint64_t>(buf) + 4096;

  // 1. Order: successes, then the flushes of a move to ERR, all unpolled;
  // the receive completions of the same CQ (b's, pushed by the initiator a
  // into the shared ring, and the flushes of a's receives) come out too,
  // each queue in its order.
  {
    ibv_cq* cq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq, "create_cq");
    auto [a, b] = loop_pair(ctx, pd, cq, cq);
    post_recv(b, mr, 500);
    post_recv(b, mr, 501);
    for (uint64_t i = 1; i <= 4; ++i) post_write(a, mr, i, mr->rkey, raddr);
    post_send(a, mr, 5, 8, IBV_SEND_SIGNALED);
    post_send(a, mr, 6, 8, IBV_SEND_SIGNALED);
    for (uint64_t i = 7; i <= 9; ++i) post_send(a, mr, i, 8, IBV_SEND_SIGNALED);  // b has no receive: they wait
    post_recv(a, mr, 600);
    post_recv(a, mr, 601);
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_ERR;
    CHECK(ibv_modify_qp(a, &at, IBV_QP_STATE) == 0, "a to ERR");
    std::vector<ibv_wc> got;
    while (got.size() < 13) {
      std::vector<ibv_wc> w = poll_n(cq, 3 < 13 - static_cast<int>(got.size()) ? 3 : 13 - static_cast<int>(got.size()));
      got.insert(got.end(), w.begin(), w.end());
    }
    ibv_wc extra;
    CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "a 14th completion: wr_id %llu", static_cast<unsigned long long>(extra.wr_id));
    uint64_t next_send = 1, next_brecv = 500, next_arecv = 600;
    for (const ibv_wc& w : got) {
      if (w.qp_num == a->qp_num && w.wr_id < 100) {
        CHECK(w.wr_id == next_send, "a's send completions out of order: %llu, expected %llu",
              static_cast<unsigned long long>(w.wr_id), static_cast<unsigned long long>(next_send));
        const bool ok = w.wr_id <= 6;
        CHECK(ok ? w.status == IBV_WC_SUCCESS : w.status == IBV_WC_WR_FLUSH_ERR, "send %llu: status %d",
              static_cast<unsigned long long>(w.wr_id), w.status);
        if (ok) CHECK(w.opcode == (w.wr_id <= 4 ? IBV_WC_RDMA_WRITE : IBV_WC_SEND), "send %llu: opcode %d",
                      static_cast<unsigned long long>(w.wr_id), w.opcode);
        ++next_send;
      } else if (w.qp_num == b->qp_num) {
        CHECK(w.wr_id == next_brecv && w.status == IBV_WC_SUCCESS && w.opcode == IBV_WC_RECV && w.byte_len == 8,
              "b's receive %llu: status %d opcode %d", static_cast<unsigned long long>(w.wr_id), w.status, w.opcode);
        ++next_brecv;
      } else {
        CHECK(w.qp_num == a->qp_num && w.wr_id == next_arecv && w.status == IBV_WC_WR_FLUSH_ERR,
              "a's receive flush %llu: status %d", static_cast<unsigned long long>(w.wr_id), w.status);
        ++next_arecv;
      }
    }
    CHECK(next_send == 10 && next_brecv == 502 && next_arecv == 602, "missing completions: %llu %llu %llu",
          static_cast<unsigned long long>(next_send), static_cast<unsigned long long>(next_brecv),
          static_cast<unsigned long long>(next_arecv));
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0, "destroy 1");
    say("own-sends: order ok");
  }

  // 2. Overrun by own send completions alone: IBV_EVENT_CQ_ERR, and the CQ
  // holds exactly its capacity, the first ones, in order.
  {
    ibv_cq* cq = ibv_create_cq(ctx, 4, nullptr, nullptr, 0);
    ibv_cq* other = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq && other, "create_cq");
    const int cap = cq->cqe;
    auto [a, b] = loop_pair(ctx, pd, cq, other);
    for (int i = 0; i < cap + 3; ++i) post_write(a, mr, static_cast<uint64_t>(i), mr->rkey, raddr);
    CHECK(readable(ctx->async_fd, 5000), "no async event after the overrun");
    ibv_async_event ev{};
    CHECK(ibv_get_async_event(ctx, &ev) == 0, "get_async_event");
    CHECK(ev.event_type == IBV_EVENT_CQ_ERR && ev.element.cq == cq, "async event %d, expected CQ_ERR", ev.event_type);
    ibv_ack_async_event(&ev);
    std::vector<ibv_wc> w = poll_n(cq, cap);
    for (int i = 0; i < cap; ++i)
      CHECK(w[i].wr_id == static_cast<uint64_t>(i) && w[i].status == IBV_WC_SUCCESS, "overrun: %d-th is %llu status %d", i,
            static_cast<unsigned long long>(w[i].wr_id), w[i].status);
    ibv_wc extra;
    CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "more than the capacity (%d) after an overrun", cap);
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(other) == 0,
          "destroy 2");
    say("own-sends: overrun ok");
  }

  // 3. Resize with own completions pending: too small is EINVAL and keeps
  // them; larger keeps them in order and takes more than the old capacity.
  {
    ibv_cq* cq = ibv_create_cq(ctx, 8, nullptr, nullptr, 0);
    ibv_cq* other = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq && other, "create_cq");
    const int cap = cq->cqe;
    auto [a, b] = loop_pair(ctx, pd, cq, other);
    const int first = cap - 2;
    for (int i = 0; i < first; ++i) post_write(a, mr, static_cast<uint64_t>(i), mr->rkey, raddr);
    CHECK(ibv_resize_cq(cq, 2) == EINVAL, "resize below what is held: expected EINVAL");
    CHECK(ibv_resize_cq(cq, 4 * cap) == 0, "resize up");
    CHECK(cq->cqe >= 4 * cap, "cqe %d after resize", cq->cqe);
    const int total = 3 * cap;
    for (int i = first; i < total; ++i) post_write(a, mr, static_cast<uint64_t>(i), mr->rkey, raddr);
    std::vector<ibv_wc> w = poll_n(cq, total);
    for (int i = 0; i < total; ++i)
      CHECK(w[i].wr_id == static_cast<uint64_t>(i) && w[i].status == IBV_WC_SUCCESS, "resize: %d-th is %llu status %d",
            i, static_cast<unsigned long long>(w[i].wr_id), w[i].status);
    CHECK(ibv_resize_cq(cq, 2) == 0 && cq->cqe >= 2, "shrink when empty");
    post_write(a, mr, 99, mr->rkey, raddr);
    w = poll_n(cq, 1);
    CHECK(w[0].wr_id == 99 && w[0].status == IBV_WC_SUCCESS, "after the shrink: %llu",
          static_cast<unsigned long long>(w[0].wr_id));
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(other) == 0,
          "destroy 3");
    say("own-sends: resize ok");
  }

  // 4. A channel woken by an own send completion; a solicited-only arming
  // ignores a successful one and fires for an error completion.
  {
    ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
    CHECK(ch, "create_comp_channel (errno %d)", errno);
    ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, ch, 0);
    ibv_cq* other = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq && other, "create_cq");
    auto [a, b] = loop_pair(ctx, pd, cq, other);
    CHECK(ibv_req_notify_cq(cq, 0) == 0, "arm");
    post_write(a, mr, 1, mr->rkey, raddr);
    CHECK(readable(ch->fd, 5000), "no event for an own send completion");
    ibv_cq* ecq = nullptr;
    void* ectx = nullptr;
    CHECK(ibv_get_cq_event(ch, &ecq, &ectx) == 0 && ecq == cq, "get_cq_event");
    std::vector<ibv_wc> w = poll_n(cq, 1);
    CHECK(w[0].wr_id == 1 && w[0].status == IBV_WC_SUCCESS, "armed: %llu", static_cast<unsigned long long>(w[0].wr_id));
    // A list into the armed CQ, once the caches are warm (the second WRITE),
    // so that the leaves take it WR by WR: its first WR fires the event, and
    // every WR runs once, in order (the list goes on after the one that
    // fired it).
    post_write(a, mr, 10, mr->rkey, raddr);
    w = poll_n(cq, 1);
    CHECK(w[0].wr_id == 10 && w[0].status == IBV_WC_SUCCESS, "warm: %llu", static_cast<unsigned long long>(w[0].wr_id));
    CHECK(ibv_req_notify_cq(cq, 0) == 0, "arm for the list");
    {
      ibv_sge sg[4];
      ibv_send_wr wl[4]{};
      for (int k = 0; k < 4; ++k) {
        sg[k] = {reinterpret_cast<uint64_t>(mr->addr) + 64 + 8 * k, 8, mr->lkey};
        wl[k].wr_id = 20 + k;
        wl[k].sg_list = &sg[k];
        wl[k].num_sge = 1;
        wl[k].opcode = IBV_WR_RDMA_WRITE;
        wl[k].send_flags = IBV_SEND_SIGNALED;
        wl[k].wr.rdma.rkey = mr->rkey;
        wl[k].wr.rdma.remote_addr = raddr + 8 * k;
        wl[k].next = k < 3 ? &wl[k + 1] : nullptr;
      }
      ibv_send_wr* bad = nullptr;
      CHECK(ibv_post_send(a, wl, &bad) == 0, "post_send of a list of 4");
    }
    CHECK(readable(ch->fd, 5000), "no event for a list's own send completion");
    CHECK(ibv_get_cq_event(ch, &ecq, &ectx) == 0 && ecq == cq, "get_cq_event (list)");
    w = poll_n(cq, 4);
    for (int k = 0; k < 4; ++k)
      CHECK(w[k].wr_id == static_cast<uint64_t>(20 + k) && w[k].status == IBV_WC_SUCCESS, "list: %llu at %d",
            static_cast<unsigned long long>(w[k].wr_id), k);
    {
      ibv_wc extra;
      CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "a WR of the list ran twice: %llu",
            static_cast<unsigned long long>(extra.wr_id));
    }
    CHECK(!readable(ch->fd, 100), "a second event for the list without arming again");
    CHECK(ibv_req_notify_cq(cq, 1) == 0, "arm solicited-only");
    post_write(a, mr, 2, mr->rkey, raddr);
    w = poll_n(cq, 1);
    CHECK(w[0].wr_id == 2, "solicited-only: %llu", static_cast<unsigned long long>(w[0].wr_id));
    CHECK(!readable(ch->fd, 300), "a solicited-only arming fired for a successful send completion");
    post_write(a, mr, 3, mr->rkey ^ 0x5a5a00, raddr);  // no such rkey: an error completion
    CHECK(readable(ch->fd, 5000), "no solicited-only event for an error send completion");
    CHECK(ibv_get_cq_event(ch, &ecq, &ectx) == 0 && ecq == cq, "get_cq_event 2");
    w = poll_n(cq, 1);
    CHECK(w[0].wr_id == 3 && w[0].status != IBV_WC_SUCCESS, "error completion: %llu status %d",
          static_cast<unsigned long long>(w[0].wr_id), w[0].status);
    ibv_ack_cq_events(cq, 3);
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(other) == 0,
          "destroy 4");
    CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy channel");
    say("own-sends: channel ok");
  }

  // 5. Two threads post on two QPs into one CQ while a third polls: every
  // completion arrives once, each QP's in order. A poster keeps at most
  // kWindow completions unpolled, so the CQ never overruns.
  {
    constexpr uint64_t kPerQp = 20000;
    constexpr uint64_t kWindow = 48;
    ibv_cq* cq = ibv_create_cq(ctx, 256, nullptr, nullptr, 0);
    ibv_cq* other = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq && other, "create_cq");
    auto [a0, b0] = loop_pair(ctx, pd, cq, other);
    auto [a1, b1] = loop_pair(ctx, pd, cq, other);
    ibv_qp* qps[2] = {a0, a1};
    std::atomic<uint64_t> polled[2] = {0, 0};
    auto poster = [&](int q) {
      for (uint64_t i = 0; i < kPerQp; ++i) {
        while (i - polled[q].load(std::memory_order_acquire) >= kWindow) sched_yield();
        post_write(qps[q], mr, (uint64_t{static_cast<unsigned>(q)} << 32) | i, mr->rkey, raddr + 8 * q);
      }
    };
    bool order_ok = true;
    uint64_t bad = 0;
    auto poller = [&] {
      uint64_t next[2] = {0, 0};
      while (next[0] < kPerQp || next[1] < kPerQp) {
        ibv_wc w[16];
        const int k = ibv_poll_cq(cq, 16, w);
        if (k < 0) {
          order_ok = false;
          return;
        }
        for (int j = 0; j < k; ++j) {
          const uint64_t q = w[j].wr_id >> 32, i = w[j].wr_id & 0xffffffffu;
          if (q > 1 || i != next[q] || w[j].status != IBV_WC_SUCCESS || w[j].qp_num != qps[q]->qp_num) {
            order_ok = false;
            bad = w[j].wr_id;
            return;
          }
          next[q] += 1;
          polled[q].store(next[q], std::memory_order_release);
        }
        if (k == 0) sched_yield();
      }
    };
    std::thread p(poller), t0(poster, 0), t1(poster, 1);
    t0.join();
    t1.join();
    p.join();
    CHECK(order_ok, "threads: completion out of order or wrong: wr_id %llx", static_cast<unsigned long long>(bad));
    ibv_wc extra;
    CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "threads: a completion too many");
    for (ibv_qp* q : {a0, b0, a1, b1}) CHECK(ibv_destroy_qp(q) == 0, "destroy qp 5");
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(other) == 0, "destroy 5");
    say("own-sends: threads ok");
  }

  // 6. Error order. A receive that completed before its QP's error comes
  // out ahead of it, although the receive completion sits in the CQ's
  // shared ring and the error in its FIFO of own completions; the receive
  // flushes the error causes come after it. Polled one at a time and four
  // at a time (the provider's two poll paths).
  for (const int batch : {1, 4}) {
    ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
    ibv_cq* other = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq && other, "create_cq");
    auto [a, b] = loop_pair(ctx, pd, cq, other);
    for (uint64_t i = 700; i <= 702; ++i) post_recv(a, mr, i);
    post_send(b, mr, 800, 8, IBV_SEND_SIGNALED);  // into a's receive 700
    std::vector<ibv_wc> w = poll_n(other, 1);
    CHECK(w[0].wr_id == 800 && w[0].status == IBV_WC_SUCCESS, "b's send: %llu status %d",
          static_cast<unsigned long long>(w[0].wr_id), w[0].status);
    post_write(a, mr, 1, mr->rkey ^ 0x5a5a00, raddr);  // no such rkey: a's error, then a's receives flushed
    std::vector<ibv_wc> got;
    while (got.size() < 4) {
      w = poll_n(cq, std::min<int>(batch, 4 - static_cast<int>(got.size())));
      got.insert(got.end(), w.begin(), w.end());
    }
    ibv_wc extra;
    CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "error order: a 5th completion: wr_id %llu",
          static_cast<unsigned long long>(extra.wr_id));
    const uint64_t want[4] = {700, 1, 701, 702};
    for (int i = 0; i < 4; ++i)
      CHECK(got[i].wr_id == want[i], "error order (poll %d at a time): completion %d is wr_id %llu status %d, expected %llu",
            batch, i, static_cast<unsigned long long>(got[i].wr_id), got[i].status,
            static_cast<unsigned long long>(want[i]));
    CHECK(got[0].status == IBV_WC_SUCCESS && got[0].opcode == IBV_WC_RECV && got[0].byte_len == 8,
          "error order: the receive: status %d opcode %d len %u", got[0].status, got[0].opcode, got[0].byte_len);
    CHECK(got[1].status == IBV_WC_REM_ACCESS_ERR, "error order: the write: status %d, expected REM_ACCESS_ERR",
          got[1].status);
    CHECK(got[2].status == IBV_WC_WR_FLUSH_ERR && got[3].status == IBV_WC_WR_FLUSH_ERR,
          "error order: the flushes: status %d %d", got[2].status, got[3].status);
    for (const ibv_wc& c : got) CHECK(c.qp_num == a->qp_num, "error order: qp_num %u", c.qp_num);
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(other) == 0,
          "destroy 6");
  }
  say("own-sends: error order ok");

  // 7. The claim's mode changes under traffic (local_cq.h: one producer
  // claims with a plain store, several with a CAS): a0 keeps posting into cq
  // while, round after round, another QP of cq is created (one producer ->
  // two while a0 posts), posts, and is destroyed again (two -> one while a0
  // posts). Every completion arrives once, each QP's in order.
  {
    constexpr int kRounds = 8;
    constexpr uint64_t kPerRound = 4000;
    constexpr uint64_t kWindow = 48;
    ibv_cq* cq = ibv_create_cq(ctx, 256, nullptr, nullptr, 0);
    ibv_cq* other = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq && other, "create_cq");
    auto pair0 = loop_pair(ctx, pd, cq, other);
    ibv_qp* a0 = pair0.first;
    std::atomic<uint32_t> qpn[kRounds + 1];
    std::atomic<uint64_t> polled[kRounds + 1];
    for (int r = 0; r <= kRounds; ++r) {
      qpn[r].store(0, std::memory_order_relaxed);
      polled[r].store(0, std::memory_order_relaxed);
    }
    qpn[0].store(a0->qp_num, std::memory_order_relaxed);
    std::atomic<bool> stop{false}, a0_done{false}, failed{false};
    std::atomic<uint64_t> posted0{0}, bad{0};
    // Waits until polled[q] reaches at least `want` (false: the poller failed).
    auto wait_polled = [&](int q, uint64_t want) {
      while (polled[q].load(std::memory_order_acquire) < want)
        if (failed.load(std::memory_order_relaxed)) return false;
        else sched_yield();
      return true;
    };
    auto poster0 = [&] {
      uint64_t i = 0;
      while (!stop.load(std::memory_order_acquire)) {
        if (i >= kWindow && !wait_polled(0, i - kWindow + 1)) break;
        post_write(a0, mr, i, mr->rkey, raddr);
        posted0.store(++i, std::memory_order_release);
      }
      a0_done.store(true, std::memory_order_release);
    };
    auto poller = [&] {
      uint64_t next[kRounds + 1] = {};
      for (;;) {
        ibv_wc w[16];
        const int k = ibv_poll_cq(cq, 16, w);
        for (int j = 0; j < k; ++j) {
          const uint64_t q = w[j].wr_id >> 32, i = w[j].wr_id & 0xffffffffu;
          if (q > kRounds || i != next[q] || w[j].status != IBV_WC_SUCCESS ||
              w[j].qp_num != qpn[q].load(std::memory_order_acquire)) {
            bad.store(w[j].wr_id | (uint64_t{w[j].status} << 56), std::memory_order_relaxed);
            failed.store(true, std::memory_order_release);
            return;
          }
          next[q] += 1;
          polled[q].store(next[q], std::memory_order_release);
        }
        if (k < 0) {
          failed.store(true, std::memory_order_release);
          return;
        }
        if (k == 0) {
          if (a0_done.load(std::memory_order_acquire) && next[0] == posted0.load(std::memory_order_acquire)) return;
          sched_yield();
        }
      }
    };
    std::thread p(poller), t0(poster0);
    bool ok = true;
    for (int r = 1; r <= kRounds && ok; ++r) {
      // a0 is posting (some of its completions arrive) when the second QP appears.
      ok = wait_polled(0, polled[0].load(std::memory_order_relaxed) + 100);
      if (!ok) break;
      auto pr = loop_pair(ctx, pd, cq, other);
      ibv_qp* a = pr.first;
      qpn[r].store(a->qp_num, std::memory_order_release);
      for (uint64_t i = 0; i < kPerRound && ok; ++i) {
        if (i >= kWindow) ok = wait_polled(r, i - kWindow + 1);
        if (ok) post_write(a, mr, (uint64_t{static_cast<unsigned>(r)} << 32) | i, mr->rkey, raddr + 8);
      }
      ok = ok && wait_polled(r, kPerRound);
      // One producer again while a0 still posts.
      CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(pr.second) == 0, "destroy qp 6, round %d", r);
    }
    stop.store(true, std::memory_order_release);
    t0.join();
    p.join();
    CHECK(ok && !failed.load(), "switch: completion out of order, wrong or missing: wr_id %llx (posted %llu of a0)",
          static_cast<unsigned long long>(bad.load()), static_cast<unsigned long long>(posted0.load()));
    ibv_wc extra;
    CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "switch: a completion too many");
    CHECK(ibv_destroy_qp(a0) == 0 && ibv_destroy_qp(pair0.second) == 0, "destroy qp 6");
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(other) == 0, "destroy 6");
    say("own-sends: producer switch ok (a0 posted %llu)", static_cast<unsigned long long>(posted0.load()));
  }

  // 8. Arming against a completion another thread makes (the producer reads
  // notify without a fence; arm_cq takes the producers' locks): one QP
  // completes into the armed CQ (the plain claim), then two (the CAS), and a
  // poster thread posts one signaled WRITE per round, alternating QPs. Even rounds: it posts right after
  // ibv_req_notify_cq returned, so the event must come. Odd rounds: it posts
  // while the CQ is being armed, so either the poll right after arming finds
  // the completion or the event must come.
  auto arm_races = [&](int nqps) {
    constexpr int kArmRounds = 10000;
    ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
    CHECK(ch, "create_comp_channel (errno %d)", errno);
    ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, ch, 0);
    ibv_cq* other = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    CHECK(cq && other, "create_cq");
    std::vector<std::pair<ibv_qp*, ibv_qp*>> prs;
    for (int q = 0; q < nqps; ++q) prs.push_back(loop_pair(ctx, pd, cq, other));
    std::atomic<int> go{-1}, done{-1};
    auto spin_until = [](std::atomic<int>& v, int want) {
      for (unsigned k = 0; v.load(std::memory_order_acquire) < want; ++k)
        if (k < 20000) __builtin_ia32_pause();
        else sched_yield();  // the machine is busy: let the other thread run
    };
    std::thread poster([&] {
      for (int r = 0; r < kArmRounds; ++r) {
        spin_until(go, r);
        post_write(prs[r % nqps].first, mr, static_cast<uint64_t>(r), mr->rkey, raddr + 8 * (r % nqps));
        done.store(r, std::memory_order_release);
      }
    });
    int events = 0, raced_polled = 0, head = 0;
    auto take_event = [&](int r) {
      ibv_cq* ecq = nullptr;
      void* ectx = nullptr;
      CHECK(ibv_get_cq_event(ch, &ecq, &ectx) == 0 && ecq == cq, "arm round %d: get_cq_event", r);
      ibv_ack_cq_events(cq, 1);
      ++events;
    };
    for (int r = 0; r < kArmRounds; ++r) {
      const bool raced = r & 1;
      if (raced) {
        go.store(r, std::memory_order_release);
        // A head start that follows the boundary between "the poll after
        // arming found it" and "it did not" (longer when it did not, shorter
        // when it did), with some jitter: the posts land around the arming
        // whatever the machine's speed and load.
        for (int k = head + (r * 37) % 17 - 8; k > 0; --k) __builtin_ia32_pause();
      }
      CHECK(ibv_req_notify_cq(cq, 0) == 0, "arm round %d", r);
      if (!raced) go.store(r, std::memory_order_release);
      bool got = false;
      if (raced) {
        ibv_wc w;
        const int k = ibv_poll_cq(cq, 1, &w);
        CHECK(k >= 0, "arm round %d: poll %d", r, k);
        if (k == 0) head = std::min(4096, head + 2);
        if (k == 1) {
          CHECK(w.wr_id == static_cast<uint64_t>(r) && w.status == IBV_WC_SUCCESS, "arm round %d: polled %llu", r,
                static_cast<unsigned long long>(w.wr_id));
          got = true;
          ++raced_polled;
          head = std::max(0, head - 2);
        }
      }
      if (!got) {
        CHECK(readable(ch->fd, 5000), "arm round %d (%s): no event for an own send completion after arming", r,
              raced ? "posted while arming, not polled after" : "posted after arming");
        take_event(r);
        std::vector<ibv_wc> w = poll_n(cq, 1);
        CHECK(w[0].wr_id == static_cast<uint64_t>(r) && w[0].status == IBV_WC_SUCCESS, "arm round %d: %llu", r,
              static_cast<unsigned long long>(w[0].wr_id));
      }
      // The post returned: any event it fired is in the channel.
      spin_until(done, r);
      if (got && readable(ch->fd, 0)) take_event(r);
      CHECK(!readable(ch->fd, 0), "arm round %d: a second event", r);
    }
    poster.join();
    ibv_wc extra;
    CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "arm: a completion too many");
    for (auto& pr : prs) CHECK(ibv_destroy_qp(pr.first) == 0 && ibv_destroy_qp(pr.second) == 0, "destroy qp 7");
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(other) == 0, "destroy 7");
    CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy channel 7");
    say("own-sends: arming races with %d QP(s) ok (%d events, %d of %d raced rounds polled first, head start %d)",
        nqps, events, raced_polled, kArmRounds / 2, head);
  };
  arm_races(1);
  arm_races(2);

  CHECK(ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0, "teardown");
  say("OK own-sends");
}

}  // namespace

int main(int argc, char** argv) {
  alarm(90);  // watchdog: never hang a test
  if (argc < 2) fail("usage: events_helper MODE");
  std::string mode = argv[1];
  if (mode == "loopback-ex") loopback_ex();
  else if (mode == "resize") resize();
  else if (mode == "busy") busy();
  else if (mode == "own-sends") own_sends();
  else if (mode == "no-shim") no_shim();
  else if (mode == "node") run_node(argc > 2 && std::string(argv[2]) == "srq");
  else if (mode == "stress-owner" && argc > 2) stress_owner(std::atoi(argv[2]));
  else if (mode == "stress-sender" && argc > 2) stress_sender(std::atoi(argv[2]));
  else fail("unknown mode %s", mode.c_str());
  return 0;
}
