// Small SENDs whose bytes travel in the receive completion (staged
// receives: the receiver takes its WQE when it polls), between two processes
// through `shmrdma run`, every byte checked, with the guarantees of
// hardware, where the receive completion is written when the message arrives:
//   - order: small (staged), zero-length, large and immediate-data SENDs
//     mixed, posted back to back: the receives complete in posting order
//     with their bytes, lengths and immediates, and nothing is written past
//     a message's end; the sends all succeed;
//   - flush: messages the sender completed before the receiver's QP entered
//     the error state complete successfully (with their bytes) before the
//     flushed receives, which then follow in posting order;
//   - reset: the same across a RESET: those messages still complete, the
//     other receives are gone, and the reconnected pair carries new ones;
//   - short: a receive buffer shorter than the message fails both sides as
//     on the wire (the sender's REM_INV_REQ_ERR, the receiver's LOC_LEN_ERR);
//   - destroy: a QP destroyed with staged completions in its CQ: the CQ
//     hands out nothing that is not a real completion, and a new QP carries
//     traffic at once;
//   - sizes: every length from 1 to 17 bytes, from a registered buffer and
//     inline, with and without immediate data (the sender's smallest SENDs
//     take their own path, up to 16 bytes); the last one solicited into the
//     receiver's CQ armed for solicited events, whose channel gets the event.
// Each runs again with SHMRDMA_STAGED_SEND=0 (every SEND takes the WQE
// itself), and again with each command's SENDs posted as one list (the
// sender's list of small SENDs opens the target once for several), which
// must give the same results.
//
// As a gtest it starts `dp_staged --worker owner|peer` connected by a
// socketpair on fd 3. The owner receives; the peer sends on command:
//   postall K | reap K | burst K | one LEN | sizes FIRST K | reconnect |
//   newqp QPN | quit
#include <arpa/inet.h>
#include <poll.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;
using harness::Hello;

constexpr size_t kSlot = 4096;
constexpr int kMaxMsgs = 16;
constexpr size_t kLen = kSlot * kMaxMsgs;
constexpr int kQpAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
constexpr uint8_t kCanary = 0xEE;
// Message i: kSizes[i % 10] bytes; every third one carries immediate data.
constexpr uint32_t kSizes[10] = {1, 8, 17, 20, 0, 21, 100, 4096, 2, 20};

uint32_t msg_len(int i) { return kSizes[i % 10]; }
bool msg_imm(int i) { return i % 3 == 2; }
uint32_t msg_imm_value(int i) { return htonl(0x1000u + static_cast<uint32_t>(i)); }
uint8_t pattern(int i, size_t j) { return static_cast<uint8_t>(i * 31 + j * 7 + 1); }
// The sizes scenario's message i: 1 to 65 bytes (the sender's leaf takes
// 1-64: up to 16 in the completion, 17-64 into the buffer), inline in every
// other round of 65 (up to the QP's max_inline_data, 64); the last of a
// command's messages is solicited.
constexpr int kSizesMax = 65;
uint32_t size_len(int i) { return 1 + static_cast<uint32_t>(i % kSizesMax); }
bool size_inline(int i) { return (i / kSizesMax) % 2 == 1 && size_len(i) <= 64; }

bool connect_qp(ibv_qp* qp, const Hello& peer) {
  return harness::connect_qp(qp, peer.qpn, peer.lid, kQpAccess) == 0;
}

bool reconnect(ibv_qp* qp, const Hello& peer) { return harness::qp_to_reset(qp) == 0 && connect_qp(qp, peer); }

// ------------------------------------------------------------------ peer

int run_peer() {
  std::string why;
  ibv_context* ctx = harness::open_shm0(&why);
  if (!ctx) die("%s", why.c_str());
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = pd ? ibv_create_cq(ctx, 64, nullptr, nullptr, 0) : nullptr;
  if (!cq) die("pd/cq");
  ibv_qp_init_attr ia{};
  ia.send_cq = ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = kMaxMsgs;
  ia.cap.max_recv_wr = 4;
  ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
  ia.cap.max_inline_data = 64;
  ibv_qp* qp = ibv_create_qp(pd, &ia);
  if (!qp) die("ibv_create_qp");
  uint8_t* buf = harness::map_buf(kLen);
  ibv_mr* mr = ibv_reg_mr(pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE);
  if (!mr) die("ibv_reg_mr");
  Hello owner = harness::exchange_hello(ctx, qp);
  if (!connect_qp(qp, owner)) die("connect");
  harness::LineReader ctl(harness::kCtlFd);
  // With DP_STAGED_LIST a command's SENDs are posted as one list (post
  // gathers them, post_list posts them), else one by one.
  const bool as_list = std::getenv("DP_STAGED_LIST") != nullptr;
  ibv_sge sges[kMaxMsgs];
  ibv_send_wr wrs[kMaxMsgs];
  int listed = 0;
  auto post = [&](int i, uint32_t len, unsigned flags = 0) {
    uint8_t* p = buf + static_cast<size_t>(i % kMaxMsgs) * kSlot;
    for (size_t j = 0; j < len; ++j) p[j] = pattern(i, j);
    if (listed == kMaxMsgs) die("more than %d SENDs in one list", kMaxMsgs);
    ibv_sge& s = sges[listed];
    ibv_send_wr& wr = wrs[listed];
    s = {reinterpret_cast<uintptr_t>(p), len, mr->lkey};
    wr = {};
    wr.wr_id = static_cast<uint64_t>(i);
    wr.opcode = msg_imm(i) ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    wr.imm_data = msg_imm_value(i);
    wr.send_flags = IBV_SEND_SIGNALED | flags;
    wr.sg_list = &s;
    wr.num_sge = 1;
    if (listed) wrs[listed - 1].next = &wr;
    ++listed;
    if (as_list) return 0;
    listed = 0;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(qp, &wr, &bad);
  };
  // The gathered list, if any: 0 when ibv_post_send took all of it.
  auto post_list = [&]() {
    if (!listed) return 0;
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(qp, wrs, &bad);
    listed = 0;
    return rc;
  };
  // Polls k send completions: 0 when each succeeded in order, else the
  // first bad status (or 2000 for a wrong wr_id).
  auto reap = [&](int k, int first = 0) {
    int first_bad = 0;
    for (int i = first; i < first + k; ++i) {
      ibv_wc wc{};
      int st = harness::poll_status(cq, &wc, 10000);
      if (st == IBV_WC_SUCCESS && (wc.wr_id != static_cast<uint64_t>(i) || wc.opcode != IBV_WC_SEND)) st = 2000;
      if (st != IBV_WC_SUCCESS && !first_bad) first_bad = st;
      if (st == -1) break;  // none within the timeout
    }
    return first_bad;
  };
  std::string line;
  for (;;) {
    if (ctl.poll_line(&line, 60000) != 1) die("no command");
    std::istringstream in(line);
    std::string cmd;
    int k = 0;
    in >> cmd >> k;
    if (cmd == "quit") break;
    int st = 0;
    if (cmd == "postall" || cmd == "burst") {
      if (k < 0 || k > kMaxMsgs) die("bad command %s", line.c_str());
      for (int i = 0; i < k && !st; ++i) st = post(i, msg_len(i)) ? 1000 : 0;
      if (!st) st = post_list() ? 1000 : 0;
      if (!st && cmd == "burst") st = reap(k);
    } else if (cmd == "reap") {
      st = reap(k);
    } else if (cmd == "one") {  // message 0's pattern, k bytes
      st = post(0, static_cast<uint32_t>(k)) || post_list() ? 1000 : reap(1);
    } else if (cmd == "sizes") {  // messages k .. k+n-1 of the sizes scenario
      int n = 0;
      in >> n;
      if (k < 0 || n < 1 || n > kMaxMsgs) die("bad command %s", line.c_str());
      for (int i = k; i < k + n && !st; ++i) {
        const unsigned flags = (size_inline(i) ? IBV_SEND_INLINE : 0) | (i == k + n - 1 ? IBV_SEND_SOLICITED : 0);
        st = post(i, size_len(i), flags) ? 1000 : 0;
      }
      if (!st) st = post_list() ? 1000 : 0;
      if (!st) st = reap(n, k);
    } else if (cmd == "reconnect") {
      st = reconnect(qp, owner) ? 0 : 1;
    } else if (cmd == "newqp") {
      in.clear();
      std::istringstream(line.substr(6)) >> owner.qpn;
      st = reconnect(qp, owner) ? 0 : 1;
    } else {
      die("unknown command %s", line.c_str());
    }
    if (!ctl.send_line(std::to_string(st))) die("reply");
  }
  if (ibv_destroy_qp(qp) || ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
    die("teardown");
  ::munmap(buf, kLen);
  std::printf("PEER done\n");
  return 0;
}

// ----------------------------------------------------------------- owner

struct Owner {
  ibv_context* ctx = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  uint8_t* buf = nullptr;
  ibv_mr* mr = nullptr;
  Hello peer;
  harness::LineReader ctl{harness::kCtlFd};

  int cmd(const std::string& c) {
    if (!ctl.send_line(c)) die("send %s", c.c_str());
    std::string r;
    if (ctl.poll_line(&r, 30000) != 1) die("no reply to %s", c.c_str());
    return std::atoi(r.c_str());
  }
  // Receive k into slot k (canaries first), wr_id 100 + k.
  void post_recv(int k, uint32_t len = kSlot) {
    uint8_t* p = buf + static_cast<size_t>(k) * kSlot;
    std::memset(p, kCanary, kSlot);
    ibv_sge s{reinterpret_cast<uintptr_t>(p), len, mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = 100u + static_cast<uint64_t>(k);
    wr.sg_list = &s;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    REQUIRE(ibv_post_recv(qp, &wr, &bad) == 0, "ibv_post_recv %d", k);
  }
  // The next completion is message i's in receive slot k, intact (len: its
  // length, msg_len(i) unless given).
  void expect_msg(const char* what, int i, int k, uint32_t len = UINT32_MAX) {
    ibv_wc wc{};
    if (!harness::poll_one(cq, &wc, 5000)) {
      CHECK(false, "%s: no completion for message %d (receive %d)", what, i, k);
      return;
    }
    if (len == UINT32_MAX) len = msg_len(i);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.wr_id == 100u + static_cast<uint64_t>(k) &&
              wc.byte_len == len && wc.qp_num == qp->qp_num && wc.src_qp == peer.qpn,
          "%s: message %d into receive %d: %s", what, i, k, harness::wc_str(wc).c_str());
    CHECK(static_cast<bool>(wc.wc_flags & IBV_WC_WITH_IMM) == msg_imm(i) &&
              (!msg_imm(i) || wc.imm_data == msg_imm_value(i)),
          "%s: message %d: immediate data: %s", what, i, harness::wc_str(wc).c_str());
    const uint8_t* p = buf + static_cast<size_t>(k) * kSlot;
    size_t bad = len;
    for (size_t j = 0; j < len && bad == len; ++j)
      if (p[j] != pattern(i, j)) bad = j;
    CHECK(bad == len, "%s: message %d: byte %zu of %u is 0x%02x, expected 0x%02x", what, i, bad, len,
          bad < len ? p[bad] : 0, bad < len ? pattern(i, bad) : 0);
    CHECK(len == kSlot || p[len] == kCanary, "%s: message %d: byte %u past its end was written", what, i, len);
  }
  void expect_flush(const char* what, int k) {
    ibv_wc wc{};
    if (!harness::poll_one(cq, &wc, 5000)) {
      CHECK(false, "%s: no flush of receive %d", what, k);
      return;
    }
    CHECK(wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == 100u + static_cast<uint64_t>(k), "%s: receive %d: %s",
          what, k, harness::wc_str(wc).c_str());
  }
  void expect_none(const char* what) {
    ibv_wc wc{};
    CHECK(!harness::poll_one(cq, &wc, 200), "%s: unexpected completion %s", what, harness::wc_str(wc).c_str());
  }
  void reconnect_both(const char* what) {
    REQUIRE(reconnect(qp, peer), "%s: reconnect", what);
    REQUIRE(cmd("reconnect") == 0, "%s: the peer's reconnect", what);
  }
};

void order(Owner& o) {
  for (int k = 0; k < kMaxMsgs; ++k) o.post_recv(k);
  CHECK(o.cmd("postall 12") == 0, "order: posts");
  for (int i = 0; i < 12; ++i) o.expect_msg("order", i, i);
  CHECK(o.cmd("reap 12") == 0, "order: every send succeeds, in order");
  o.expect_none("order");
  // Four receives remain: the pair carries on.
  CHECK(o.cmd("burst 4") == 0, "order: a second burst");
  for (int i = 0; i < 4; ++i) o.expect_msg("order, second burst", i, 12 + i);
  o.expect_none("order, second burst");
}

// Messages 0-3 (1, 8, 17, 20 bytes: all small) are received, not polled.
void flush(Owner& o) {
  for (int k = 0; k < 8; ++k) o.post_recv(k);
  CHECK(o.cmd("burst 4") == 0, "flush: the sends succeed before the receiver polls");
  REQUIRE(harness::qp_to_err(o.qp) == 0, "flush: to ERR");
  for (int i = 0; i < 4; ++i) o.expect_msg("flush: received before the error", i, i);
  for (int k = 4; k < 8; ++k) o.expect_flush("flush", k);
  o.expect_none("flush");
  o.reconnect_both("flush");
  for (int k = 0; k < 4; ++k) o.post_recv(k);
  CHECK(o.cmd("burst 4") == 0, "flush: after reconnecting");
  for (int i = 0; i < 4; ++i) o.expect_msg("flush: after reconnecting", i, i);
  o.expect_none("flush: after reconnecting");
}

void reset(Owner& o) {
  for (int k = 0; k < 8; ++k) o.post_recv(k);
  CHECK(o.cmd("burst 4") == 0, "reset: the sends succeed before the receiver polls");
  REQUIRE(reconnect(o.qp, o.peer), "reset: RESET and reconnect");
  for (int i = 0; i < 4; ++i) o.expect_msg("reset: received before the reset", i, i);
  o.expect_none("reset: the other receives went with the reset");
  REQUIRE(o.cmd("reconnect") == 0, "reset: the peer's reconnect");
  for (int k = 8; k < 12; ++k) o.post_recv(k);
  CHECK(o.cmd("burst 4") == 0, "reset: after reconnecting");
  for (int i = 0; i < 4; ++i) o.expect_msg("reset: after reconnecting", i, 8 + i);
  o.expect_none("reset: after reconnecting");
}

void short_buffer(Owner& o) {
  o.post_recv(0, 4);
  CHECK(o.cmd("one 10") == IBV_WC_REM_INV_REQ_ERR, "short: the sender's status");
  ibv_wc wc{};
  CHECK(harness::poll_one(o.cq, &wc, 5000) && wc.status == IBV_WC_LOC_LEN_ERR && wc.wr_id == 100,
        "short: the receiver's completion: %s", harness::wc_str(wc).c_str());
  while (harness::poll_one(o.cq, &wc, 200)) {
  }
  o.reconnect_both("short");
  o.post_recv(1);
  CHECK(o.cmd("burst 1") == 0, "short: after reconnecting");
  o.expect_msg("short: after reconnecting", 0, 1);
}

void destroy(Owner& o) {
  for (int k = 0; k < 4; ++k) o.post_recv(k);
  CHECK(o.cmd("burst 2") == 0, "destroy: the sends succeed before the receiver polls");
  REQUIRE(ibv_destroy_qp(o.qp) == 0, "destroy: ibv_destroy_qp");
  // The receives of a destroyed QP are gone; whatever the CQ still hands
  // out must be a real completion of them.
  ibv_wc wc{};
  while (harness::poll_one(o.cq, &wc, 200))
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.wr_id >= 100 && wc.wr_id < 102,
          "destroy: %s", harness::wc_str(wc).c_str());
  o.qp = harness::create_qp(o.pd, o.cq, IBV_QPT_RC, 4, kMaxMsgs);
  REQUIRE(o.qp && connect_qp(o.qp, o.peer), "destroy: a new QP");
  REQUIRE(o.cmd("newqp " + std::to_string(o.qp->qp_num)) == 0, "destroy: the peer connects to it");
  for (int k = 4; k < 8; ++k) o.post_recv(k);
  CHECK(o.cmd("burst 4") == 0, "destroy: the new QP");
  for (int i = 0; i < 4; ++i) o.expect_msg("destroy: the new QP", i, 4 + i);
  o.expect_none("destroy: the new QP");
}

// Lengths 1-65 (the sender's leaf takes 1-64), registered and inline, in
// rounds of 16 receives; each round's last message is solicited into the CQ
// armed for solicited events only, and the channel gets exactly one event.
void sizes(Owner& o) {
  constexpr int kRound = kMaxMsgs;
  for (int first = 0; first < 2 * kSizesMax; first += kRound) {
    for (int k = 0; k < kRound; ++k) o.post_recv(k);
    REQUIRE(ibv_req_notify_cq(o.cq, 1) == 0, "sizes: arm");
    CHECK(o.cmd("sizes " + std::to_string(first) + " " + std::to_string(kRound)) == 0, "sizes %d: the sends", first);
    pollfd pfd{o.channel->fd, POLLIN, 0};
    CHECK(::poll(&pfd, 1, 5000) == 1, "sizes %d: no event for the solicited message", first);
    ibv_cq* ecq = nullptr;
    void* ectx = nullptr;
    if (pfd.revents & POLLIN) {
      CHECK(ibv_get_cq_event(o.channel, &ecq, &ectx) == 0 && ecq == o.cq, "sizes %d: the event", first);
      if (ecq) ibv_ack_cq_events(ecq, 1);
    }
    for (int k = 0; k < kRound; ++k) o.expect_msg("sizes", first + k, k, size_len(first + k));
    o.expect_none("sizes");
  }
  pollfd pfd{o.channel->fd, POLLIN, 0};
  CHECK(::poll(&pfd, 1, 100) == 0, "sizes: one event per arming");
}

int run_owner() {
  Owner o;
  std::string why;
  o.ctx = harness::open_shm0(&why);
  if (!o.ctx) die("%s", why.c_str());
  o.pd = ibv_alloc_pd(o.ctx);
  o.channel = ibv_create_comp_channel(o.ctx);
  o.cq = o.pd && o.channel ? ibv_create_cq(o.ctx, 64, nullptr, o.channel, 0) : nullptr;
  if (!o.cq) die("pd/cq");
  o.qp = harness::create_qp(o.pd, o.cq, IBV_QPT_RC, 4, kMaxMsgs);
  if (!o.qp) die("create_qp");
  o.buf = harness::map_buf(kLen);
  o.mr = ibv_reg_mr(o.pd, o.buf, kLen, IBV_ACCESS_LOCAL_WRITE);
  if (!o.mr) die("ibv_reg_mr");
  o.peer = harness::exchange_hello(o.ctx, o.qp);
  if (!connect_qp(o.qp, o.peer)) die("connect");
  const std::string sel = std::getenv("DP_STAGED_ONLY") ? std::getenv("DP_STAGED_ONLY") : "";
  if (sel == "order") order(o);
  if (sel == "flush") flush(o);
  if (sel == "reset") reset(o);
  if (sel == "short") short_buffer(o);
  if (sel == "destroy") destroy(o);
  if (sel == "sizes") sizes(o);
  CHECK(o.ctl.send_line("quit"), "quit");
  CHECK(ibv_destroy_qp(o.qp) == 0 && ibv_dereg_mr(o.mr) == 0 && ibv_destroy_cq(o.cq) == 0, "destroy");
  CHECK(ibv_destroy_comp_channel(o.channel) == 0, "channel");
  CHECK(ibv_dealloc_pd(o.pd) == 0 && ibv_close_device(o.ctx) == 0, "close");
  ::munmap(o.buf, kLen);
  std::printf("OWNER done: %d failure(s)\n", harness::check_failures);
  return harness::check_failures ? 1 : 0;
}

// How the peer sends: staged one by one, unstaged (SHMRDMA_STAGED_SEND=0),
// or staged with each command's SENDs in one list (a list's SENDs share one
// opening of the target: send_leaf_run).
enum Mode { kStaged, kUnstaged, kStagedList };

class Staged : public ::testing::TestWithParam<std::tuple<const char*, Mode>> {};

TEST_P(Staged, Pair) {
  HARNESS_REQUIRE_DEVICE();
  ::setenv("DP_STAGED_ONLY", std::get<0>(GetParam()), 1);
  const Mode m = std::get<1>(GetParam());
  if (m == kUnstaged)
    ::setenv("SHMRDMA_STAGED_SEND", "0", 1);
  else
    ::unsetenv("SHMRDMA_STAGED_SEND");
  if (m == kStagedList)
    ::setenv("DP_STAGED_LIST", "1", 1);
  else
    ::unsetenv("DP_STAGED_LIST");
  harness::Result o = harness::run_worker_pair({}, 60);
  ::unsetenv("SHMRDMA_STAGED_SEND");
  ::unsetenv("DP_STAGED_LIST");
  EXPECT_NE(o.out.find("OWNER done: 0 failure(s)"), std::string::npos) << o.out;
}

INSTANTIATE_TEST_SUITE_P(Scenarios, Staged,
                         ::testing::Combine(::testing::Values("order", "flush", "reset", "short", "destroy", "sizes"),
                                            ::testing::Values(kStaged, kUnstaged, kStagedList)),
                         [](const auto& info) {
                           const Mode m = std::get<1>(info.param);
                           return std::string(std::get<0>(info.param)) +
                                  (m == kStaged ? "_staged" : m == kUnstaged ? "_unstaged" : "_staged_list");
                         });

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dpstaged");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    return std::string(argv[2]) == "owner" ? run_owner() : run_peer();
  }
  return harness::run_tests_as_root(argc, argv);
}
