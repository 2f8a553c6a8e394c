// A peer process dies (SIGKILL) in the middle of a stream: the survivor's
// outstanding work requests must all complete, in error, within 10 s; its
// QP must be in ERR; nothing may hang; and the dead process's context must
// be reclaimed (`shmrdma up` / `status --json` no longer list it, its ctx-*
// file is gone).
//
// As a gtest (no arguments) it starts two workers of this executable
// through `shmrdma run`, connected by a socketpair on fd 3:
//
//   dp_fault --worker a|b --mode send|write|read|mixed|bigsend|rnr|smalllist --idle 0|1
//
// Both workers stream to each other (all WRs signaled; receives kept
// posted). In mode rnr the idle worker posts no receive and sends nothing,
// so the survivor's SEND waits for a receiver (rnr_retry 7, transport
// timeout 0 = wait forever): only the peer's death can end it.
//
// Worker output: READY, STREAMING (after 200 good completions) or WAITING
// (rnr), then on the survivor "SURVIVOR ..." once every outstanding WR has
// completed, or "FAIL: ..." (exit 1). The survivor then waits for SIGUSR1,
// destroys everything, prints CLEAN and exits 0.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;

using Clock = std::chrono::steady_clock;

constexpr size_t kBufLen = 4u << 20;
constexpr uint32_t kRecvs = 32;
constexpr uint32_t kMaxOutstanding = 32;
constexpr uint32_t kMsg = 64u << 10;
constexpr uint32_t kBigMsg = 4u << 20;     // mode bigsend

struct Hello {
  uint32_t magic = 0x44504654;
  uint32_t qpn = 0;
  uint16_t lid = 0;
  uint16_t pad = 0;
  uint32_t rkey = 0;
  uint64_t addr = 0;
};

int run_worker(const std::string& name, const std::string& mode, bool idle) {
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  sigprocmask(SIG_BLOCK, &usr1, nullptr);

  std::string why;
  ibv_context* ctx = harness::open_shm0(&why);
  if (!ctx) die("%s: %s", name.c_str(), why.c_str());
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = pd ? ibv_create_cq(ctx, 1024, nullptr, nullptr, 0) : nullptr;
  if (!cq) die("%s: pd/cq: %s", name.c_str(), std::strerror(errno));
  ibv_qp* qp = harness::create_qp(pd, cq, IBV_QPT_RC, kMaxOutstanding, kRecvs);
  if (!qp) die("%s: ibv_create_qp: %s", name.c_str(), std::strerror(errno));
  void* mem = nullptr;
  const size_t kRecvSlot = mode == "bigsend" ? kBigMsg : kMsg;  // receive buffer size
  const size_t mem_len = kBufLen + kRecvs * kRecvSlot;
  if (posix_memalign(&mem, 4096, mem_len)) die("alloc");
  std::memset(mem, 0x5a, kBufLen);                 // what we send / what the peer reads and writes
  std::memset(static_cast<char*>(mem) + kBufLen, 0x11, mem_len - kBufLen);  // receive buffers
  auto* buf = static_cast<uint8_t*>(mem);  // [0, kBufLen): sources and remote target; then receive buffers
  ibv_mr* mr = ibv_reg_mr(pd, buf, mem_len,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!mr) die("%s: ibv_reg_mr: %s", name.c_str(), std::strerror(errno));

  Hello me, peer;
  me.qpn = qp->qp_num;
  me.lid = harness::port_lid(ctx);
  me.rkey = mr->rkey;
  me.addr = reinterpret_cast<uintptr_t>(buf);
  if (!harness::write_all(harness::kCtlFd, &me, sizeof me)) die("%s: send hello", name.c_str());
  if (!harness::read_all(harness::kCtlFd, &peer, sizeof peer, 30000) || peer.magic != me.magic)
    die("%s: no hello", name.c_str());
  const bool rnr = mode == "rnr";
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (int rc = harness::qp_to_init(qp, access)) die("INIT: %s", std::strerror(rc));
  if (int rc = harness::qp_to_rtr(qp, peer.qpn, peer.lid, 1)) die("RTR: %s", std::strerror(rc));
  // rnr: transport timeout 0 (never) and rnr_retry 7 (forever).
  if (int rc = harness::qp_to_rts(qp, 7, rnr ? 0 : 14, 7)) die("RTS: %s", std::strerror(rc));
  // Both sides are connected before either sends.
  char token = 'R', got = 0;
  if (!harness::write_all(harness::kCtlFd, &token, 1) || !harness::read_all(harness::kCtlFd, &got, 1, 30000))
    die("%s: the peer did not connect", name.c_str());
  std::printf("READY %s pid %d qpn %u\n", name.c_str(), ::getpid(), qp->qp_num);

  uint64_t recv_posted = 0, sends_outstanding = 0, next_id = 1, good = 0;
  std::set<uint64_t> recv_ids;  // posted receives without a completion
  auto post_recv = [&]() {
    ibv_sge s{reinterpret_cast<uintptr_t>(buf + kBufLen + (recv_posted % kRecvs) * kRecvSlot),
              static_cast<uint32_t>(kRecvSlot), mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = 1ull << 63 | recv_posted;
    wr.sg_list = &s;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    // Mark the slot before posting, so a receive that was written to can be told apart.
    std::memset(buf + kBufLen + (recv_posted % kRecvs) * kRecvSlot, 0x11, 64);
    if (int rc = ibv_post_recv(qp, &wr, &bad)) die("%s: ibv_post_recv: %s", name.c_str(), std::strerror(rc));
    recv_ids.insert(recv_posted);
    ++recv_posted;
  };
  uint64_t recv_outstanding = 0;
  if (!(rnr && idle))
    for (uint32_t i = 0; i < kRecvs; ++i) post_recv(), ++recv_outstanding;

  // Mode smalllist: lists of kList small SENDs (8 to 40 bytes, every other
  // one with immediate data), each SEND's bytes in its receive completion or
  // moved within the push: the peer dies with its run of a list's SENDs
  // open on our QP (its take record reserved, counted into our CQ).
  constexpr uint32_t kList = 8;
  const uint32_t batch = mode == "smalllist" ? kList : 1;
  auto post_list = [&]() -> int {
    ibv_sge sg[kList];
    ibv_send_wr wr[kList]{};
    for (uint32_t k = 0; k < kList; ++k) {
      const uint64_t id = next_id++;
      sg[k] = {reinterpret_cast<uintptr_t>(buf + (id % 32) * 64), static_cast<uint32_t>(8 + (id % 5) * 8), mr->lkey};
      wr[k].wr_id = id;
      wr[k].opcode = id % 2 ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
      wr[k].imm_data = htonl(static_cast<uint32_t>(id));
      wr[k].sg_list = &sg[k];
      wr[k].num_sge = 1;
      wr[k].send_flags = IBV_SEND_SIGNALED;
      wr[k].next = k + 1 < kList ? &wr[k + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(qp, wr, &bad);
    // What precedes *bad_wr was posted (and completes).
    sends_outstanding += rc ? static_cast<uint64_t>(bad - wr) : kList;
    return rc;
  };
  auto post_send = [&]() -> int {
    if (batch > 1) return post_list();
    uint64_t id = next_id++;
    ibv_wr_opcode op = IBV_WR_SEND;
    uint32_t len = 4096;
    if (mode == "write") op = IBV_WR_RDMA_WRITE, len = kMsg;
    if (mode == "read") op = IBV_WR_RDMA_READ, len = kMsg;
    if (mode == "mixed") {
      static const ibv_wr_opcode ops[] = {IBV_WR_SEND, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_SEND_WITH_IMM};
      op = ops[id % 4];
      len = op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM ? 8192 : kMsg;
    }
    if (mode == "bigsend") len = kBigMsg;
    uint64_t off = len == kBigMsg ? 0 : (id % 32) * kMsg;
    ibv_sge s{reinterpret_cast<uintptr_t>(buf + off), len, mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = id;
    wr.opcode = op;
    wr.sg_list = &s;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(static_cast<uint32_t>(id));
    wr.wr.rdma.remote_addr = peer.addr + off;
    wr.wr.rdma.rkey = peer.rkey;
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(qp, &wr, &bad);
    if (rc == 0) ++sends_outstanding;
    return rc;
  };

  // Stream until the first error completion; from then on every completion
  // must be a flush, and every outstanding WR (sends and posted receives)
  // must have completed within 10 s.
  bool announced = false;
  auto last_completion = Clock::now();
  auto give_up = Clock::now() + std::chrono::seconds(90);
  ibv_wc first_err{};
  bool have_err = false;
  uint64_t outstanding_at_error = 0, recv_at_error = 0, flushed_sends = 0, flushed_recvs = 0;
  Clock::time_point t_err;
  for (;;) {
    if (!have_err && Clock::now() > give_up)
      die("%s: no error completion within 90 s (was the peer killed?)", name.c_str());
    if (have_err && sends_outstanding == 0 && recv_outstanding == 0) break;
    if (have_err && Clock::now() > t_err + std::chrono::seconds(10)) {
      for (uint64_t id : recv_ids) {
        const uint8_t* b = buf + kBufLen + (id % kRecvs) * kRecvSlot;
        std::printf("%s: receive %" PRIu64 " has no completion; its buffer %s\n", name.c_str(), id,
                    b[0] == 0x5a ? "holds data of the peer (the peer had claimed it and was copying into it when it died)"
                                 : "is untouched");
      }
      die("%s: 10 s after the first error (%s) %" PRIu64 " sends and %" PRIu64 " receives are still outstanding (QP %s)",
          name.c_str(), harness::wc_str(first_err).c_str(), sends_outstanding, recv_outstanding,
          harness::qp_state_name(harness::qp_state(qp)));
    }
    if (!have_err && !(rnr && idle)) {
      while (sends_outstanding + batch <= (rnr ? 4u : kMaxOutstanding)) {
        if (int rc = post_send()) die("%s: ibv_post_send while streaming: %s", name.c_str(), std::strerror(rc));
      }
    }
    ibv_wc wc[16];
    int n = ibv_poll_cq(cq, 16, wc);
    if (n < 0) die("%s: ibv_poll_cq %d", name.c_str(), n);
    for (int i = 0; i < n; ++i) {
      last_completion = Clock::now();
      const bool is_recv = wc[i].wr_id >> 63;
      if (is_recv) --recv_outstanding, recv_ids.erase(wc[i].wr_id & ~(1ull << 63));
      else --sends_outstanding;
      if (wc[i].status == IBV_WC_SUCCESS) {
        if (have_err)
          die("%s: a %s completed successfully after the error completion %s: %s", name.c_str(),
              is_recv ? "receive" : "send", harness::wc_str(first_err).c_str(), harness::wc_str(wc[i]).c_str());
        ++good;
        if (is_recv && batch > 1) {
          // A small SEND of the peer's lists: its length (8 + (id % 5) * 8,
          // id in the immediate data of the odd ones), its bytes, and the
          // rest of the buffer's marked 64 bytes untouched.
          const uint64_t idx = wc[i].wr_id & ~(1ull << 63);
          const uint8_t* b = buf + kBufLen + (idx % kRecvs) * kRecvSlot;
          const bool imm = wc[i].wc_flags & IBV_WC_WITH_IMM;
          const uint32_t id = ntohl(wc[i].imm_data);
          bool ok = wc[i].opcode == IBV_WC_RECV && wc[i].byte_len >= 8 && wc[i].byte_len <= 40 &&
                    wc[i].byte_len % 8 == 0 && (!imm || (id % 2 == 1 && wc[i].byte_len == 8 + (id % 5) * 8));
          for (uint32_t j = 0; ok && j < 64; ++j) ok = b[j] == (j < wc[i].byte_len ? 0x5a : 0x11);
          if (!ok) die("%s: a small SEND arrived wrong: %s", name.c_str(), harness::wc_str(wc[i]).c_str());
        }
        if (is_recv) post_recv(), ++recv_outstanding;
        continue;
      }
      if (!have_err) {
        first_err = wc[i];
        have_err = true;
        t_err = Clock::now();
        outstanding_at_error = sends_outstanding + (is_recv ? 0 : 1);
        recv_at_error = recv_outstanding + (is_recv ? 1 : 0);
        // A send fails with RETRY_EXC_ERR (the transport gave up on the
        // dead peer) or is flushed; a receive can only be flushed.
        bool ok = is_recv ? wc[i].status == IBV_WC_WR_FLUSH_ERR
                          : (wc[i].status == IBV_WC_RETRY_EXC_ERR || wc[i].status == IBV_WC_WR_FLUSH_ERR);
        if (!ok)
          die("%s: first error completion (%s) %s; expected RETRY_EXC_ERR or WR_FLUSH_ERR", name.c_str(),
              is_recv ? "receive" : "send", harness::wc_str(wc[i]).c_str());
      } else if (wc[i].status != IBV_WC_WR_FLUSH_ERR) {
        die("%s: after the first error (%s) a %s completed with %s", name.c_str(), ibv_wc_status_str(first_err.status),
            is_recv ? "receive" : "send", harness::wc_str(wc[i]).c_str());
      }
      if (wc[i].status == IBV_WC_WR_FLUSH_ERR) (is_recv ? flushed_recvs : flushed_sends) += 1;
    }
    if (!announced && !rnr && good >= 200) {
      std::printf("STREAMING %s\n", name.c_str());
      announced = true;
    }
    if (!announced && rnr && idle) {
      std::printf("IDLE %s\n", name.c_str());
      announced = true;
    }
    if (!announced && rnr && !idle && sends_outstanding > 0 &&
        Clock::now() - last_completion > std::chrono::milliseconds(300)) {
      std::printf("WAITING %s (%" PRIu64 " sends wait for a receiver)\n", name.c_str(), sends_outstanding);
      announced = true;
    }
    if (n == 0) std::this_thread::yield();
  }
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t_err).count();
  int state = harness::qp_state(qp);
  if (state != IBV_QPS_ERR) die("%s: QP state %s after the error, expected ERR", name.c_str(), harness::qp_state_name(state));
  // A WR posted now is flushed too.
  if (int rc = post_send()) die("%s: ibv_post_send in ERR: %s", name.c_str(), std::strerror(rc));
  ibv_wc wc{};
  if (!harness::poll_one(cq, &wc, 5000)) die("%s: no completion for a WR posted in ERR", name.c_str());
  if (wc.status != IBV_WC_WR_FLUSH_ERR) die("%s: WR posted in ERR: %s", name.c_str(), harness::wc_str(wc).c_str());
  std::printf("SURVIVOR %s first=%s(%s) good=%" PRIu64 " outstanding_at_error=%" PRIu64 " flushed_sends=%" PRIu64
              " recv_at_error=%" PRIu64 " flushed_recvs=%" PRIu64 " drain_ms=%.1f\n",
              name.c_str(), (first_err.wr_id >> 63) ? "receive" : "send", ibv_wc_status_str(first_err.status), good, outstanding_at_error, flushed_sends,
              recv_at_error, flushed_recvs, ms);

  // Hold the context until the driver has checked the registry.
  timespec ts{60, 0};
  if (sigtimedwait(&usr1, nullptr, &ts) != SIGUSR1) die("%s: no SIGUSR1 within 60 s", name.c_str());
  if (ibv_destroy_qp(qp) || ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
    die("%s: teardown failed", name.c_str());
  std::free(mem);
  std::printf("CLEAN %s\n", name.c_str());
  return 0;
}

// ---------------------------------------------------------------------------
// The gtest driver

class Fault : public ::testing::TestWithParam<std::string> {};

void kill_round(const std::string& mode) {
  auto& home = harness::Home::get();
  const bool rnr = mode == "rnr";
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string exe = harness::self_exe();
  harness::Child survivor, victim;
  ASSERT_TRUE(survivor.start(home.run_argv({exe, "--worker", "a", "--mode", mode, "--idle", "0"}), {.fd3 = sv[0]}))
      << survivor.output();
  ASSERT_TRUE(victim.start(home.run_argv({exe, "--worker", "b", "--mode", mode, "--idle", rnr ? "1" : "0"}), {.fd3 = sv[1]}))
      << victim.output();
  ::close(sv[0]);
  ::close(sv[1]);
  auto dump = [&] { return "--- survivor ---\n" + survivor.output() + "--- victim ---\n" + victim.output(); };

  auto t0 = harness::Clock::now();
  ASSERT_TRUE(survivor.wait_output(rnr ? "WAITING" : "STREAMING", t0 + std::chrono::seconds(60)))
      << "the survivor did not start streaming\n" << dump();
  ASSERT_TRUE(victim.wait_output(rnr ? "IDLE" : "STREAMING", t0 + std::chrono::seconds(60)))
      << "the victim did not start\n" << dump();
  const pid_t vpid = victim.pid(), spid = survivor.pid();

  // The victim's context slot, hence its segment file.
  nlohmann::json st = home.status();
  nlohmann::json ve = harness::Home::find_process(st, vpid);
  ASSERT_FALSE(ve.is_null()) << "status does not list the victim pid " << vpid << ":\n" << st.dump(2);
  const std::string vprefix = "ctx-" + std::to_string(ve.value("context_slot", -1)) + "-";
  bool found = false;
  for (const auto& f : home.ctx_files()) found |= f.rfind(vprefix, 0) == 0;
  ASSERT_TRUE(found) << "no " << vprefix << "* file for the victim";

  // Mid-stream: SIGKILL (and reap, as a parent would).
  auto t_kill = harness::Clock::now();
  victim.kill(SIGKILL);
  bool reported = survivor.wait_output("SURVIVOR", t_kill + std::chrono::seconds(10));
  double ms = std::chrono::duration<double, std::milli>(harness::Clock::now() - t_kill).count();
  if (!reported) {
    // Let the survivor print its own diagnosis (it gives up 10 s after its
    // first error completion), then stop it.
    survivor.wait_output("FAIL", harness::Clock::now() + std::chrono::seconds(5));
    survivor.drain(100);
    std::string out = dump();
    survivor.kill();
    FAIL() << "10 s after the peer was killed the survivor's WRs have not all completed (or it failed):\n" << out;
  }
  std::printf("survivor reported %.0f ms after the kill\n%s", ms, dump().c_str());
  EXPECT_EQ(survivor.output().find("FAIL"), std::string::npos) << dump();

  // Reclaim: `shmrdma up`, then status no longer lists the victim and its
  // segment is gone; the survivor is still listed.
  harness::Result up = home.shmrdma({"up"});
  EXPECT_TRUE(up.ok()) << up.describe();
  st = home.status();
  EXPECT_TRUE(harness::Home::find_process(st, vpid).is_null())
      << "status still lists the killed pid " << vpid << " after shmrdma up:\n" << st.dump(2);
  EXPECT_FALSE(harness::Home::find_process(st, spid).is_null()) << "the survivor is not listed:\n" << st.dump(2);
  for (const auto& f : home.ctx_files())
    EXPECT_NE(f.rfind(vprefix, 0), 0u) << "the killed process's segment " << f << " remains";

  // The survivor tears down cleanly.
  survivor.signal(SIGUSR1);
  harness::Result s = survivor.wait(harness::Clock::now() + std::chrono::seconds(20));
  EXPECT_TRUE(s.ok()) << s.describe();
  EXPECT_NE(s.out.find("CLEAN"), std::string::npos) << s.out;
  st = home.status();
  for (const auto& d : st["devices"]) EXPECT_TRUE(d["processes"].empty()) << st.dump(2);
  EXPECT_TRUE(home.ctx_files().empty()) << "ctx-* files remain after both processes ended";
}

TEST_P(Fault, PeerKilledMidStream) {
  HARNESS_REQUIRE_DEVICE();
  // The peer dies at a random point of its work; bigsend repeats the kill to
  // hit the window inside a SEND more surely, and
  // smalllist repeats it to kill the peer inside a run of a list's SENDs
  // more surely.
  const int rounds = GetParam() == "bigsend" ? 5 : GetParam() == "smalllist" ? 3 : 1;
  for (int r = 0; r < rounds && !HasFailure(); ++r) {
    SCOPED_TRACE("round " + std::to_string(r + 1) + " of " + std::to_string(rounds));
    kill_round(GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, Fault, ::testing::Values("send", "write", "read", "mixed", "bigsend", "rnr", "smalllist"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::string name = argv[2], mode = "send";
    bool idle = false;
    for (int i = 3; i + 1 < argc; i += 2) {
      std::string k = argv[i];
      if (k == "--mode") mode = argv[i + 1];
      if (k == "--idle") idle = std::string(argv[i + 1]) == "1";
    }
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    return run_worker(name, mode, idle);
  }
  return harness::run_tests_as_root(argc, argv);
}
