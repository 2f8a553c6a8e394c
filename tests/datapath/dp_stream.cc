// Bidirectional streams between two processes over several RC QPs that
// share one CQ per process, optionally with several threads posting and
// polling at once: every message is checked byte for byte, in order, with
// its opcode, length and immediate data.
//
// As a gtest (no arguments) it starts two workers of this executable through
// `shmrdma run`, connected by a socketpair on fd 3:
//
//   dp_stream --worker a|b --qps N --threads T --ms M --seed S
//
// Each side sends on every QP, for M ms, a sequence of messages derived from
// (seed, side, QP, message number): SEND, SEND_WITH_IMM or
// RDMA_WRITE_WITH_IMM (into a slot of the peer's write area), 0 B .. 64 KiB.
// The receiver knows the same sequence, so it checks each receive
// completion (opcode, byte_len, imm = message number), the payload (in the
// receive buffer or the write slot) and the guard bytes after it. Thread t
// posts the sends of the QPs q with q % T == t; every thread polls the
// shared CQ and reposts receives.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMaxQps = 8;
constexpr uint32_t kSlot = 64u << 10;  // largest message
constexpr uint32_t kRecv = 16;         // receives kept posted per QP
constexpr uint32_t kSrc = 32;          // source slots per QP
constexpr uint32_t kOut = 16;          // sends outstanding per QP (< kSrc)
constexpr uint32_t kWslots = 32;       // write-target slots per QP (> kRecv)
constexpr uint32_t kGuard = 64;
constexpr uint8_t kCanary = 0xC3;

uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}
inline uint64_t pword(uint64_t key, uint64_t w) { return fmix64(key ^ (w * 0x9e3779b97f4a7c15ULL + 1)); }
void pfill(uint8_t* d, uint64_t len, uint64_t key) {
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    uint64_t w = pword(key, i / 8);
    std::memcpy(d + i, &w, 8);
  }
  if (i < len) {
    uint64_t w = pword(key, i / 8);
    std::memcpy(d + i, &w, len - i);
  }
}
int64_t pcheck(const uint8_t* d, uint64_t len, uint64_t key) {
  for (uint64_t i = 0; i < len; i += 8) {
    uint64_t w = pword(key, i / 8), n = std::min<uint64_t>(8, len - i);
    if (std::memcmp(d + i, &w, n) != 0) {
      const auto* wb = reinterpret_cast<const uint8_t*>(&w);
      for (uint64_t j = 0; j < n; ++j)
        if (d[i + j] != wb[j]) return static_cast<int64_t>(i + j);
    }
  }
  return -1;
}

enum Kind { kSendK, kSendImmK, kWriteImmK };
struct Msg {
  Kind kind;
  uint32_t len;
  uint64_t key;
};
Msg message(uint64_t seed, int side, uint32_t qp, uint64_t k) {
  uint64_t key = fmix64(seed * 0x9e3779b97f4a7c15ULL ^ (uint64_t(side) << 60) ^ (uint64_t(qp) << 48) ^ (k + 1));
  uint64_t r = fmix64(key ^ 0x1234567);
  Msg m;
  m.kind = static_cast<Kind>(r % 3);
  uint64_t c = (r >> 8) % 4;
  m.len = c == 0 ? static_cast<uint32_t>((r >> 16) % 65) : static_cast<uint32_t>((r >> 16) % (kSlot + 1));
  m.key = key;
  return m;
}

struct Hello {
  uint32_t magic = 0x44505354;
  uint32_t nqps = 0;
  uint16_t lid = 0;
  uint16_t pad = 0;
  uint32_t rkey = 0;
  uint32_t qpn[kMaxQps] = {};
  uint64_t warea[kMaxQps] = {};
};

struct QpState {
  ibv_qp* qp = nullptr;
  std::mutex mu;  // rx and tx bookkeeping (completions come from any thread)
  uint64_t tx_next = 0, tx_done = 0, rx_next = 0;
  uint64_t recv_seq = 0;  // receives posted (message k consumes the k-th)
  // Receives are re-posted only in message order (after every earlier message
  // was checked), so a sender can never be more than kRecv messages ahead of
  // the last checked one, whatever order threads finish their checks in.
  uint64_t checked_upto = 0;
  bool checked[64] = {};
  uint32_t slot_of[64] = {};
  uint8_t* src = nullptr;    // kSrc slots
  uint8_t* rbuf = nullptr;   // kRecv slots of kSlot + kGuard
  uint8_t* warea = nullptr;  // kWslots slots of kSlot + kGuard (the peer writes here)
  uint64_t peer_warea = 0;
  uint64_t peer_total = UINT64_MAX;  // messages the peer sent on this QP (after DONE)
};

int run_worker(const std::string& name, uint32_t nqps, uint32_t nthreads, uint64_t ms, uint64_t seed) {
  const int side = name == "a" ? 0 : 1;
  if (nqps < 1 || nqps > kMaxQps || nthreads < 1) die("bad arguments");
  std::string why;
  ibv_context* ctx = harness::open_shm0(&why);
  if (!ctx) die("%s", why.c_str());
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = pd ? ibv_create_cq(ctx, 8192, nullptr, nullptr, 0) : nullptr;
  if (!cq) die("pd/cq: %s", std::strerror(errno));
  const size_t per_qp = size_t{kSrc} * kSlot + size_t{kRecv + kWslots} * (kSlot + kGuard);
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, per_qp * nqps)) die("alloc");
  std::memset(mem, kCanary, per_qp * nqps);
  ibv_mr* mr = ibv_reg_mr(pd, mem, per_qp * nqps,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!mr) die("ibv_reg_mr: %s", std::strerror(errno));
  std::vector<QpState> q(nqps);
  Hello me;
  me.nqps = nqps;
  me.lid = harness::port_lid(ctx);
  me.rkey = mr->rkey;
  for (uint32_t i = 0; i < nqps; ++i) {
    q[i].qp = harness::create_qp(pd, cq, IBV_QPT_RC, kOut, kRecv);
    if (!q[i].qp) die("ibv_create_qp: %s", std::strerror(errno));
    uint8_t* base = static_cast<uint8_t*>(mem) + i * per_qp;
    q[i].src = base;
    q[i].rbuf = base + size_t{kSrc} * kSlot;
    q[i].warea = q[i].rbuf + size_t{kRecv} * (kSlot + kGuard);
    me.qpn[i] = q[i].qp->qp_num;
    me.warea[i] = reinterpret_cast<uintptr_t>(q[i].warea);
  }
  Hello peer;
  if (!harness::write_all(harness::kCtlFd, &me, sizeof me)) die("hello");
  if (!harness::read_all(harness::kCtlFd, &peer, sizeof peer, 30000) || peer.magic != me.magic || peer.nqps != nqps)
    die("no hello");
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  for (uint32_t i = 0; i < nqps; ++i) {
    q[i].peer_warea = peer.warea[i];
    if (harness::qp_to_init(q[i].qp, access) || harness::qp_to_rtr(q[i].qp, peer.qpn[i], peer.lid) || harness::qp_to_rts(q[i].qp))
      die("connect QP %u", i);
  }
  // wr_id of a receive: QP (8 bits) | slot (8 bits) | posting sequence (48 bits).
  auto post_recv = [&](uint32_t i, uint32_t slot) {
    uint8_t* b = q[i].rbuf + size_t{slot} * (kSlot + kGuard);
    std::memset(b, kCanary, kSlot + kGuard);
    ibv_sge s{reinterpret_cast<uintptr_t>(b), kSlot, mr->lkey};
    std::lock_guard lk(q[i].mu);  // the sequence number and the ring order agree
    ibv_recv_wr wr{};
    wr.wr_id = (uint64_t{i} << 56) | (uint64_t{slot} << 48) | q[i].recv_seq++;
    wr.sg_list = &s;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(q[i].qp, &wr, &bad)) die("ibv_post_recv QP %u: %s", i, std::strerror(rc));
  };
  for (uint32_t i = 0; i < nqps; ++i)
    for (uint32_t s = 0; s < kRecv; ++s) post_recv(i, s);
  // Both sides have their receives posted before anyone sends.
  char tok = 'R', got = 0;
  if (!harness::write_all(harness::kCtlFd, &tok, 1) || !harness::read_all(harness::kCtlFd, &got, 1, 30000)) die("sync");

  std::atomic<uint64_t> rx_msgs{0}, rx_bytes{0}, tx_msgs{0};
  std::atomic<bool> sending{true}, stop{false};
  std::atomic<uint32_t> stopped_threads{0};  // worker threads that will post no more sends
  std::mutex poll_mu;  // one poller at a time, so completion order is checked in CQ order
  std::atomic<int64_t> last_progress_ms{0};
  const auto t0 = Clock::now();
  auto now_ms = [&] { return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count(); };

  // Order checks run under poll_mu, in CQ order; the payload checks after.
  struct Got {
    ibv_wc wc;
    uint32_t qp;
    uint64_t k;
  };
  auto order = [&](const ibv_wc& wc, Got* g) {
    if (wc.status != IBV_WC_SUCCESS) die("completion %s", harness::wc_str(wc).c_str());
    const bool recv = wc.opcode & IBV_WC_RECV;
    uint32_t i = static_cast<uint32_t>(recv ? wc.wr_id >> 56 : wc.wr_id >> 32);
    if (i >= nqps) die("completion with a bad wr_id: %s", harness::wc_str(wc).c_str());
    QpState& s = q[i];
    if (wc.qp_num != s.qp->qp_num) die("QP %u: completion qp_num %u, expected %u", i, wc.qp_num, s.qp->qp_num);
    std::lock_guard lk(s.mu);
    if (!recv) {
      uint64_t k = wc.wr_id & 0xffffffff;
      if (k != (s.tx_done & 0xffffffff))
        die("QP %u: send completion for message %" PRIu64 ", expected %" PRIu64 " (out of order)", i, k, s.tx_done);
      g->k = s.tx_done++;
    } else {
      uint64_t k = wc.wr_id & ((uint64_t{1} << 48) - 1);
      if (k != s.rx_next)
        die("QP %u: receive completion for the receive posted as number %" PRIu64 ", expected %" PRIu64
            " (receives consumed out of order)",
            i, k, s.rx_next);
      g->k = s.rx_next++;
    }
    g->wc = wc;
    g->qp = i;
  };
  auto handle = [&](const Got& g) {
    const ibv_wc& wc = g.wc;
    const uint32_t i = g.qp;
    const uint64_t k = g.k;
    last_progress_ms = now_ms();
    if (!(wc.opcode & IBV_WC_RECV)) {
      Msg m = message(seed, side, i, k);
      int want = m.kind == kWriteImmK ? IBV_WC_RDMA_WRITE : IBV_WC_SEND;
      if (wc.opcode != want) die("QP %u: send completion opcode %d, expected %d", i, wc.opcode, want);
      return;
    }
    uint32_t slot = static_cast<uint32_t>((wc.wr_id >> 48) & 0xff);
    Msg m = message(seed, 1 - side, i, k);
    int want = m.kind == kWriteImmK ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
    const char* kn = m.kind == kSendK ? "SEND" : m.kind == kSendImmK ? "SEND_WITH_IMM" : "RDMA_WRITE_WITH_IMM";
    if (wc.opcode != want) die("QP %u message %" PRIu64 " (%s): opcode %d, expected %d", i, k, kn, wc.opcode, want);
    if (wc.byte_len != m.len)
      die("QP %u message %" PRIu64 " (%s): byte_len %u, expected %u", i, k, kn, wc.byte_len, m.len);
    bool imm = wc.wc_flags & IBV_WC_WITH_IMM;
    if (imm != (m.kind != kSendK)) die("QP %u message %" PRIu64 " (%s): WITH_IMM flag %d", i, k, kn, int(imm));
    if (imm && ntohl(wc.imm_data) != static_cast<uint32_t>(k))
      die("QP %u message %" PRIu64 " (%s): imm %u (messages out of order?)", i, k, kn, ntohl(wc.imm_data));
    uint8_t* rb = q[i].rbuf + size_t{slot} * (kSlot + kGuard);
    uint8_t* w = q[i].warea + (k % kWslots) * (kSlot + kGuard);
    const uint8_t* data = m.kind == kWriteImmK ? w : rb;
    if (int64_t b = pcheck(data, m.len, m.key); b >= 0)
      die("QP %u message %" PRIu64 " (%s, %u bytes): byte %" PRId64 " is 0x%02x", i, k, kn, m.len, b, data[b]);
    // Guards: past the message in the receive buffer (all of it for a
    // WRITE_WITH_IMM), and past the end of the write slot.
    uint32_t used = m.kind == kWriteImmK ? 0 : m.len;
    for (uint32_t j = used; j < std::min<uint32_t>(used + kGuard, kSlot + kGuard); ++j)
      if (rb[j] != kCanary) die("QP %u message %" PRIu64 " (%s): receive buffer byte %u overwritten", i, k, kn, j);
    for (uint32_t j = kSlot; j < kSlot + kGuard; ++j)
      if (w[j] != kCanary) die("QP %u message %" PRIu64 ": the guard after write slot %" PRIu64 " was overwritten", i, k, k % kWslots);
    rx_msgs.fetch_add(1, std::memory_order_relaxed);
    rx_bytes.fetch_add(m.len, std::memory_order_relaxed);
    uint32_t repost[64];
    uint32_t nrepost = 0;
    {
      std::lock_guard lk(q[i].mu);
      QpState& s = q[i];
      s.checked[k % 64] = true;
      s.slot_of[k % 64] = slot;
      while (s.checked_upto < s.rx_next && s.checked[s.checked_upto % 64]) {
        s.checked[s.checked_upto % 64] = false;
        repost[nrepost++] = s.slot_of[s.checked_upto % 64];
        ++s.checked_upto;
      }
    }
    for (uint32_t j = 0; j < nrepost; ++j) post_recv(i, repost[j]);
  };

  auto poll_some = [&]() -> int {
    ibv_wc wc[16];
    Got got[16];
    int n;
    {
      std::lock_guard lk(poll_mu);
      n = ibv_poll_cq(cq, 16, wc);
      if (n < 0) die("ibv_poll_cq %d", n);
      for (int j = 0; j < n; ++j) order(wc[j], &got[j]);
    }
    for (int j = 0; j < n; ++j) handle(got[j]);
    return n;
  };

  auto post_send = [&](uint32_t i) -> bool {
    QpState& s = q[i];
    uint64_t k;
    {
      std::lock_guard lk(s.mu);
      if (s.tx_next - s.tx_done >= kOut) return false;
      k = s.tx_next++;
    }
    Msg m = message(seed, side, i, k);
    uint8_t* src = s.src + (k % kSrc) * kSlot;
    pfill(src, m.len, m.key);
    ibv_sge sg{reinterpret_cast<uintptr_t>(src), m.len, mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = (uint64_t{i} << 32) | (k & 0xffffffff);
    wr.sg_list = &sg;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.opcode = m.kind == kSendK ? IBV_WR_SEND : m.kind == kSendImmK ? IBV_WR_SEND_WITH_IMM : IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(static_cast<uint32_t>(k));
    wr.wr.rdma.remote_addr = s.peer_warea + (k % kWslots) * (kSlot + kGuard);
    wr.wr.rdma.rkey = peer.rkey;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(s.qp, &wr, &bad)) die("QP %u: ibv_post_send message %" PRIu64 ": %s", i, k, std::strerror(rc));
    tx_msgs.fetch_add(1, std::memory_order_relaxed);
    return true;
  };

  auto worker = [&](uint32_t t) {
    bool mine = true;
    while (!stop.load(std::memory_order_relaxed)) {
      if (mine && !sending.load()) {
        mine = false;
        stopped_threads.fetch_add(1);
      }
      if (mine)
        for (uint32_t i = t; i < nqps; i += nthreads) post_send(i);
      if (poll_some() == 0) std::this_thread::yield();
    }
  };
  std::vector<std::thread> threads;
  for (uint32_t t = 1; t < nthreads; ++t) threads.emplace_back(worker, t);

  // Thread 0 also runs the control channel: stream for `ms`, then exchange
  // the message counts and wait until everything sent arrived both ways.
  harness::LineReader ctl(harness::kCtlFd);
  bool sent_done = false, sent_bye = false, got_bye = false;
  for (;;) {
    if (sending)
      for (uint32_t i = 0; i < nqps; i += nthreads) post_send(i);
    if (poll_some() == 0) std::this_thread::yield();
    int64_t t = now_ms();
    if (t - last_progress_ms.load() > 30000 && t > 30000) {
      std::string st;
      for (uint32_t i = 0; i < nqps; ++i) {
        std::lock_guard lk(q[i].mu);
        st += " QP" + std::to_string(i) + " tx " + std::to_string(q[i].tx_done) + "/" + std::to_string(q[i].tx_next) +
              " rx " + std::to_string(q[i].rx_next) + "/" +
              (q[i].peer_total == UINT64_MAX ? std::string("?") : std::to_string(q[i].peer_total)) + " (" +
              harness::qp_state_name(harness::qp_state(q[i].qp)) + ")";
      }
      die("no completion for 30 s:%s", st.c_str());
    }
    if (sending && static_cast<uint64_t>(t) > ms) sending = false;
    if (!sending && !sent_done && stopped_threads.load() == nthreads - 1) {
      bool all = true;
      for (uint32_t i = 0; i < nqps; ++i) {
        std::lock_guard lk(q[i].mu);
        all &= q[i].tx_done == q[i].tx_next;
      }
      if (all) {
        std::string l = "DONE";
        for (uint32_t i = 0; i < nqps; ++i) l += " " + std::to_string(q[i].tx_next);
        ctl.send_line(l);
        sent_done = true;
      }
    }
    std::string line;
    int r = ctl.poll_line(&line, 0);
    if (r < 0) die("the peer closed the control channel");
    if (r == 1 && line.rfind("DONE", 0) == 0) {
      const char* p = line.c_str() + 4;
      for (uint32_t i = 0; i < nqps; ++i) {
        char* end = nullptr;
        uint64_t v = std::strtoull(p, &end, 10);
        p = end;
        std::lock_guard lk(q[i].mu);
        q[i].peer_total = v;
      }
    } else if (r == 1 && line == "BYE") {
      got_bye = true;
    }
    if (sent_done && !sent_bye) {
      bool all = true;
      for (uint32_t i = 0; i < nqps; ++i) {
        std::lock_guard lk(q[i].mu);
        if (q[i].rx_next > q[i].peer_total) die("QP %u: more messages arrived than the peer sent", i);
        all &= q[i].rx_next == q[i].peer_total;
      }
      if (all) {
        ctl.send_line("BYE");
        sent_bye = true;
      }
    }
    if (sent_bye && got_bye) break;
  }
  stop = true;
  for (auto& th : threads) th.join();
  ibv_wc extra;
  if (ibv_poll_cq(cq, 1, &extra) != 0) die("an extra completion at the end: %s", harness::wc_str(extra).c_str());
  for (auto& s : q)
    if (ibv_destroy_qp(s.qp)) die("ibv_destroy_qp");
  if (ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx)) die("teardown");
  std::free(mem);
  std::printf("STREAM OK side=%s qps=%u threads=%u tx=%" PRIu64 " rx=%" PRIu64 " rx_bytes=%" PRIu64 "\n", name.c_str(),
              nqps, nthreads, tx_msgs.load(), rx_msgs.load(), rx_bytes.load());
  return 0;
}

// ---------------------------------------------------------------------------

struct Variant {
  const char* name;
  uint32_t qps, threads;
  bool mapped;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class Stream : public ::testing::TestWithParam<Variant> {};

TEST_P(Stream, BothDirectionsEveryByteInOrder) {
  HARNESS_REQUIRE_DEVICE();
  const Variant v = GetParam();
  auto& home = harness::Home::get();
  const uint64_t ms = std::strtoull(harness::getenv_str("DP_STREAM_MS").empty() ? "4000" : std::getenv("DP_STREAM_MS"),
                                    nullptr, 10);
  const std::string seed = "7";
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string exe = harness::self_exe();
  auto args = [&](const char* side) {
    return home.run_argv({exe, "--worker", side, "--qps", std::to_string(v.qps), "--threads",
                          std::to_string(v.threads), "--ms", std::to_string(ms), "--seed", seed});
  };
  if (!v.mapped) ::setenv("SHMRDMA_MAPPED", "0", 1);
  harness::Child a, b;
  bool started = a.start(args("a"), {.fd3 = sv[0]}) && b.start(args("b"), {.fd3 = sv[1]});
  if (!v.mapped) ::unsetenv("SHMRDMA_MAPPED");
  ::close(sv[0]);
  ::close(sv[1]);
  ASSERT_TRUE(started) << a.output() << b.output();
  auto deadline = harness::Clock::now() + std::chrono::milliseconds(ms + 60000);
  while (!a.exited() && !b.exited() && harness::Clock::now() < deadline) {
    a.drain(0);
    b.drain(20);
  }
  harness::Result ra = a.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(35)));
  harness::Result rb = b.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(5)));
  std::printf("--- a ---\n%s--- b ---\n%s", ra.out.c_str(), rb.out.c_str());
  EXPECT_TRUE(ra.ok()) << "a: " << ra.describe();
  EXPECT_TRUE(rb.ok()) << "b: " << rb.describe();
  nlohmann::json st = home.status();
  for (const auto& d : st["devices"]) EXPECT_TRUE(d["processes"].empty()) << st.dump(2);
}

INSTANTIATE_TEST_SUITE_P(Variants, Stream,
                         ::testing::Values(Variant{"qp1", 1, 1, true}, Variant{"qp4", 4, 1, true},
                                           Variant{"qp4_threads3", 4, 3, true},
                                           Variant{"qp4_threads3_cma", 4, 3, false}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.name); });

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::string name = argv[2];
    uint32_t qps = 1, threads = 1;
    uint64_t ms = 3000, seed = 1;
    for (int i = 3; i + 1 < argc; i += 2) {
      std::string k = argv[i];
      uint64_t v = std::strtoull(argv[i + 1], nullptr, 10);
      if (k == "--qps") qps = static_cast<uint32_t>(v);
      if (k == "--threads") threads = static_cast<uint32_t>(v);
      if (k == "--ms") ms = v;
      if (k == "--seed") seed = v;
    }
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    return run_worker(name, qps, threads, ms, seed);
  }
  return harness::run_tests_as_root(argc, argv);
}
