// A verbs program for the completion-queue and completion-event tests.
// Public libibverbs API only. Every run has a watchdog (alarm) so it never
// hangs a test; failures print "FAIL: ..." and exit 1.
//
//   events_helper loopback-ex   ibv_create_cq_ex + the ibv_cq_ex poll API on a
//                               QP pair connected to each other
//   events_helper resize        ibv_resize_cq keeps queued completions, rejects too small
//   events_helper busy          destroy_cq EBUSY, channel refcounts
//   events_helper no-shim       without the shim: no channel, no CQ on a fake channel
//   events_helper node          interactive (commands on stdin, see run_node)
//   events_helper stress-owner  receives N messages while resizing its CQ
//   events_helper stress-sender sends N messages
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
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

ibv_qp* make_qp(ibv_pd* pd, ibv_cq* scq, ibv_cq* rcq, uint32_t send_wr = 64, uint32_t recv_wr = 256) {
  ibv_qp_init_attr a{};
  a.send_cq = scq;
  a.recv_cq = rcq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = send_wr;
  a.cap.max_recv_wr = recv_wr;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
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

void post_recv(ibv_qp* qp, ibv_mr* mr, uint64_t wr_id, uint32_t len = 64) {
  ibv_sge sge{reinterpret_cast<uint64_t>(mr->addr), len, mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  CHECK(ibv_post_recv(qp, &wr, &bad) == 0, "post_recv");
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
void run_node() {
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
  ibv_qp* qp = make_qp(pd, scq, rcq);
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
      for (int i = 0; i < n; ++i) post_recv(qp, mr, next_recv++, 4096);
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

}  // namespace

int main(int argc, char** argv) {
  alarm(90);  // watchdog: never hang a test
  if (argc < 2) fail("usage: events_helper MODE");
  std::string mode = argv[1];
  if (mode == "loopback-ex") loopback_ex();
  else if (mode == "resize") resize();
  else if (mode == "busy") busy();
  else if (mode == "no-shim") no_shim();
  else if (mode == "node") run_node();
  else if (mode == "stress-owner" && argc > 2) stress_owner(std::atoi(argv[2]));
  else if (mode == "stress-sender" && argc > 2) stress_sender(std::atoi(argv[2]));
  else fail("unknown mode %s", mode.c_str());
  return 0;
}
