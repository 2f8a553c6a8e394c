// Helper program of srq_mp_test (public verbs API only), run through
// `shmrdma run`:
//
//   srq_peer server NQPS MSGS LIMIT
//     creates one SRQ with NQPS*MSGS receives posted and NQPS RC QPs on it,
//     prints "SERVER <lid> <qpn>...", reads "CONNECT <client qpn>..." (QP i
//     connects to client i), arms the SRQ limit at LIMIT, prints "READY",
//     receives NQPS*MSGS messages checking every byte, QP numbers and the
//     per-QP order, then waits for IBV_EVENT_SRQ_LIMIT_REACHED on the SRQ
//     (exactly one), prints "RECV <n> OK" and exits 0.
//   srq_peer client ID SERVER_QPN LID MSGS
//     creates one RC QP, prints "CLIENT <qpn>", connects to SERVER_QPN,
//     waits for "GO" on stdin, sends MSGS messages, prints "SENT <n> OK".
//
// Message n of client ID: bytes [0..4) = ID, [4..8) = n, then the pattern
// byte(ID, n, k); its length is msg_len(n).
//
// With a trailing "small" (both sides), every message is 8 to 64 bytes
// (small_len(n)), the shapes of the provider's SRQ SEND leaf: by n % 3 one
// SGE of the MR, one inline SGE, or two inline SGEs (the first 8 bytes, then
// the rest from another buffer, as UCX's active messages post them); every
// fourth (n % 4 == 3) is a SEND_WITH_IMM carrying htonl(n), which the server
// checks, and every other message is unsignaled.
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "verbs.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kSlot = 256;
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

uint32_t msg_len(uint32_t n) { return 8 + (n * 37) % (kSlot - 8); }
uint32_t small_len(uint32_t n) { return 8 + (n * 7) % 57; }
bool with_imm(uint32_t n) { return n % 4 == 3; }
uint8_t pattern(uint32_t id, uint32_t n, uint32_t k) { return static_cast<uint8_t>(id * 31 + n * 7 + k * 3 + 1); }

[[noreturn]] void die(const std::string& what) {
  std::printf("FAIL %s (errno %d: %s)\n", what.c_str(), errno, std::strerror(errno));
  std::fflush(stdout);
  std::exit(1);
}

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

ibv_context* open_shm0() {
  std::string why;
  ibv_context* ctx = harness::open_shm0(&why);
  if (!ctx) die(why);
  return ctx;
}

void connect(ibv_qp* qp, uint32_t dest, uint16_t lid) {
  if (int rc = harness::connect_qp(qp, dest, lid, kAccess)) {
    errno = rc;
    die("connect (INIT, RTR, RTS)");
  }
}

std::string read_line() {
  std::string l;
  if (!std::getline(std::cin, l)) die("stdin closed");
  return l;
}

bool wait_event(ibv_context* ctx, ibv_async_event* ev, int timeout_ms) {
  int fl = ::fcntl(ctx->async_fd, F_GETFL);
  ::fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    if (ibv_get_async_event(ctx, ev) == 0) {
      ibv_ack_async_event(ev);
      return true;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{ctx->async_fd, POLLIN, 0};
    (void)::poll(&p, 1, static_cast<int>(left));
  }
}

int server(int nqps, uint32_t msgs, uint32_t limit, bool small) {
  ibv_context* ctx = open_shm0();
  ibv_port_attr pa{};
  if (ibv_query_port(ctx, 1, &pa)) die("query_port");
  ibv_pd* pd = ibv_alloc_pd(ctx);
  uint32_t total = static_cast<uint32_t>(nqps) * msgs;
  ibv_cq* cq = ibv_create_cq(ctx, static_cast<int>(total * 2), nullptr, nullptr, 0);
  std::vector<uint8_t> buf(size_t{total} * kSlot, 0);
  ibv_mr* mr = pd ? ibv_reg_mr(pd, buf.data(), buf.size(), kAccess) : nullptr;
  if (!pd || !cq || !mr) die("pd/cq/mr");
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = total;
  sa.attr.max_sge = 1;
  ibv_srq* srq = ibv_create_srq(pd, &sa);
  if (!srq) die("create_srq");
  for (uint32_t i = 0; i < total; ++i) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf.data() + size_t{i} * kSlot), kSlot, mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_srq_recv(srq, &wr, &bad)) die("post_srq_recv");
  }
  std::vector<ibv_qp*> qps;
  std::string line = "SERVER " + std::to_string(pa.lid);
  for (int i = 0; i < nqps; ++i) {
    ibv_qp_init_attr qa{};
    qa.send_cq = cq;
    qa.recv_cq = cq;
    qa.srq = srq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = 4;
    qa.cap.max_send_sge = 1;
    ibv_qp* qp = ibv_create_qp(pd, &qa);
    if (!qp) die("create_qp on the SRQ");
    qps.push_back(qp);
    line += ' ';  // appended piecewise: `" " + std::to_string(n)` trips GCC 12's -Wrestrict at -O3
    line += std::to_string(qp->qp_num);
  }
  say(line);
  std::istringstream in(read_line());
  std::string word;
  in >> word;
  if (word != "CONNECT") die("expected CONNECT");
  std::vector<uint32_t> clients(nqps);
  for (int i = 0; i < nqps; ++i) {
    if (!(in >> clients[i])) die("CONNECT: too few QP numbers");
    connect(qps[i], clients[i], pa.lid);
  }
  ibv_srq_attr la{};
  la.srq_limit = limit;
  if (ibv_modify_srq(srq, &la, IBV_SRQ_LIMIT)) die("arm the limit");
  say("READY");

  std::vector<uint32_t> next_seq(nqps, 0);
  uint32_t got = 0;
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (got < total) {
    ibv_wc wc[16];
    int k = ibv_poll_cq(cq, 16, wc);
    if (k < 0) die("poll_cq");
    if (k == 0 && Clock::now() > deadline) die("timed out after " + std::to_string(got) + " receives");
    for (int j = 0; j < k; ++j) {
      const ibv_wc& w = wc[j];
      if (w.status != IBV_WC_SUCCESS) die(std::string("completion status ") + ibv_wc_status_str(w.status));
      if (w.opcode != IBV_WC_RECV) die("unexpected opcode " + std::to_string(w.opcode));
      const bool imm = (w.wc_flags & IBV_WC_WITH_IMM) != 0;
      int q = -1;
      for (int i = 0; i < nqps; ++i)
        if (qps[i]->qp_num == w.qp_num) q = i;
      if (q < 0) die("completion for an unknown QP " + std::to_string(w.qp_num));
      if (w.src_qp != clients[q]) die("src_qp " + std::to_string(w.src_qp) + " is not the peer of QP " + std::to_string(q));
      if (w.wr_id >= total) die("bad wr_id");
      const uint8_t* p = buf.data() + w.wr_id * kSlot;
      uint32_t id, n;
      std::memcpy(&id, p, 4);
      std::memcpy(&n, p + 4, 4);
      if (id != static_cast<uint32_t>(q)) die("message of client " + std::to_string(id) + " on QP " + std::to_string(q));
      if (n != next_seq[q]) die("QP " + std::to_string(q) + ": message " + std::to_string(n) + " out of order");
      next_seq[q] += 1;
      if (w.byte_len != (small ? small_len(n) : msg_len(n))) die("byte_len " + std::to_string(w.byte_len));
      if (imm != (small && with_imm(n))) die("message " + std::to_string(n) + ": IBV_WC_WITH_IMM is wrong");
      if (imm && w.imm_data != htonl(n)) die("message " + std::to_string(n) + ": imm_data " + std::to_string(w.imm_data));
      for (uint32_t b = 8; b < w.byte_len; ++b)
        if (p[b] != pattern(id, n, b)) die("data mismatch at byte " + std::to_string(b) + " of message " + std::to_string(n));
      ++got;
    }
  }
  ibv_async_event ev{};
  if (!wait_event(ctx, &ev, 10000)) die("no SRQ limit event");
  if (ev.event_type != IBV_EVENT_SRQ_LIMIT_REACHED) die(std::string("event ") + ibv_event_type_str(ev.event_type));
  if (ev.element.srq != srq) die("the limit event names another SRQ");
  ibv_srq_attr q{};
  if (ibv_query_srq(srq, &q) || q.srq_limit != 0) die("the limit is still armed after the event");
  say("LIMIT_EVENT");
  if (wait_event(ctx, &ev, 300)) die(std::string("a second event: ") + ibv_event_type_str(ev.event_type));
  say("RECV " + std::to_string(got) + " OK");
  for (auto* qp : qps) ibv_destroy_qp(qp);
  if (ibv_destroy_srq(srq)) die("destroy_srq");
  ibv_dereg_mr(mr);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  return 0;
}

int client(uint32_t id, uint32_t server_qpn, uint16_t lid, uint32_t msgs, bool small) {
  ibv_context* ctx = open_shm0();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  std::vector<uint8_t> buf(size_t{msgs} * kSlot, 0);
  ibv_mr* mr = pd ? ibv_reg_mr(pd, buf.data(), buf.size(), kAccess) : nullptr;
  if (!pd || !cq || !mr) die("pd/cq/mr");
  ibv_qp* qp = harness::create_qp(pd, cq, IBV_QPT_RC, 16, 1, 2, 64);  // two SGEs, 64 inline bytes
  if (!qp) die("create_qp");
  say("CLIENT " + std::to_string(qp->qp_num));
  connect(qp, server_qpn, lid);
  if (read_line() != "GO") die("expected GO");
  for (uint32_t n = 0; n < msgs; ++n) {
    uint8_t* p = buf.data() + size_t{n} * kSlot;
    std::memcpy(p, &id, 4);
    std::memcpy(p + 4, &n, 4);
    for (uint32_t b = 8; b < kSlot; ++b) p[b] = pattern(id, n, b);
    ibv_sge sge[2] = {{reinterpret_cast<uint64_t>(p), small ? small_len(n) : msg_len(n), mr->lkey}, {}};
    ibv_send_wr wr{};
    wr.wr_id = n;
    wr.sg_list = sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    uint8_t rest[56];
    if (small) {
      if (n % 3 != 0) wr.send_flags |= IBV_SEND_INLINE;
      if (n % 3 == 2) {
        // The payload after the first 8 bytes from a buffer of its own.
        sge[0].length = 8;
        std::memcpy(rest, p + 8, small_len(n) - 8);
        sge[1] = {reinterpret_cast<uint64_t>(rest), small_len(n) - 8, 0};
        wr.num_sge = 2;
      }
      if (with_imm(n)) {
        wr.opcode = IBV_WR_SEND_WITH_IMM;
        wr.imm_data = htonl(n);
      }
      // Every other one unsignaled (the last one signaled).
      if (n % 2 == 1 && n + 1 < msgs) wr.send_flags &= ~IBV_SEND_SIGNALED;
    }
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp, &wr, &bad)) die("post_send");
    if (small && n % 3 == 2) std::memset(rest, 0, sizeof rest);  // inline: the bytes went with the post
    if (!(wr.send_flags & IBV_SEND_SIGNALED)) continue;
    ibv_wc wc{};
    auto deadline = Clock::now() + std::chrono::seconds(20);
    int k = 0;
    while ((k = ibv_poll_cq(cq, 1, &wc)) == 0)
      if (Clock::now() > deadline) die("send completion timed out");
    if (k < 0 || wc.status != IBV_WC_SUCCESS || wc.wr_id != n)
      die(std::string("send completion: ") + ibv_wc_status_str(wc.status));
  }
  say("SENT " + std::to_string(msgs) + " OK");
  ibv_destroy_qp(qp);
  ibv_dereg_mr(mr);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  const bool small = !a.empty() && a.back() == "small";
  if (small) a.pop_back();
  if (a.size() == 4 && a[0] == "server")
    return server(std::atoi(a[1].c_str()), static_cast<uint32_t>(std::atoi(a[2].c_str())),
                  static_cast<uint32_t>(std::atoi(a[3].c_str())), small);
  if (a.size() == 5 && a[0] == "client")
    return client(static_cast<uint32_t>(std::atoi(a[1].c_str())), static_cast<uint32_t>(std::strtoul(a[2].c_str(), nullptr, 0)),
                  static_cast<uint16_t>(std::atoi(a[3].c_str())), static_cast<uint32_t>(std::atoi(a[4].c_str())), small);
  std::fprintf(stderr, "usage: srq_peer server NQPS MSGS LIMIT [small] | client ID SERVER_QPN LID MSGS [small]\n");
  return 2;
}
