// Completion queues and completion events through the public verbs API and
// `shmrdma run`: the ibv_cq_ex poll API, resize_cq, destroy_cq EBUSY,
// completion channels (the preloaded shim) with events produced by a peer
// process, solicited-only arming, the RNR wake-up of a blocked initiator, a
// resize while a peer produces, and cleanup of a dead process's channel FIFO.
// Every verbs program is events_helper, run as a separate process.
#include <signal.h>

#include <filesystem>
#include <sstream>

#include "home.h"

HARNESS_TEST_ENVIRONMENT(.tag = "itest", .root_only = false);

namespace {

using harness::Child;
using harness::Home;

constexpr int kStepMs = 15'000;

std::string helper() { return harness::getenv_str("EVENTS_HELPER_BIN"); }

// `shmrdma --home H run events_helper ARGS...`
std::vector<std::string> run_helper(std::vector<std::string> args) {
  std::vector<std::string> v = {harness::Home::bin(), "--home", Home::get().path(), "run", helper()};
  v.insert(v.end(), args.begin(), args.end());
  return v;
}

// Sends a command and returns the next line, failing the test on timeout.
std::string ask(Child& c, const std::string& cmd, int timeout_ms = kStepMs) {
  EXPECT_TRUE(c.write_line(cmd)) << "cannot write to the helper: " << cmd;
  auto l = c.read_line(timeout_ms);
  if (!l) {
    ADD_FAILURE() << "no answer to `" << cmd << "` within " << timeout_ms << " ms; output so far:\n"
                  << c.output() << "\nstderr:\n" << c.errors();
    return "";
  }
  return *l;
}

// A blocked ibv_get_cq_event retries waiting sends every
// SHMRDMA_RETRY_POLL_MS (2 ms by default): an initiator started with this
// long a period gets its send through within a test step only when the
// receiver's post wakes it.
const std::string kNoRetryTimer = "SHMRDMA_RETRY_POLL_MS=3600000";

// Two connected nodes (interactive events_helper processes).
struct Pair {
  Child a, b;
  // a_env: VAR=VALUE for A (run under env(1)); b_srq: B's receives come
  // from an SRQ.
  bool start(const std::string& a_env = "", bool b_srq = false) {
    std::vector<std::string> av = run_helper({"node"}), bv = run_helper(b_srq ? std::vector<std::string>{"node", "srq"}
                                                                                 : std::vector<std::string>{"node"});
    if (!a_env.empty()) av.insert(av.begin(), {"env", a_env});
    if (!a.start(av, harness::kDialog) || !b.start(bv, harness::kDialog)) {
      ADD_FAILURE() << a.output() << b.output();
      return false;
    }
    auto aa = a.wait_line("ADDR ", kStepMs), ba = b.wait_line("ADDR ", kStepMs);
    if (!aa || !ba) {
      ADD_FAILURE() << "no ADDR line\nA: " << a.output() << a.errors() << "\nB: " << b.output()
                    << b.errors();
      return false;
    }
    return ask(a, "CONNECT " + ba->substr(5)) == "OK connected" && ask(b, "CONNECT " + aa->substr(5)) == "OK connected";
  }
  void quit() {
    EXPECT_EQ(ask(a, "QUIT"), "BYE");
    EXPECT_EQ(ask(b, "QUIT"), "BYE");
    auto ra = a.wait(kStepMs), rb = b.wait(kStepMs);
    EXPECT_TRUE(ra.ok()) << ra.describe();
    EXPECT_TRUE(rb.ok()) << rb.describe();
  }
};

void expect_helper_ok(const std::string& mode, const std::string& want) {
  harness::Result r = harness::run(run_helper({mode}), 60'000);
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find(want), std::string::npos) << r.describe();
}

TEST(Events, EnvPreloadsTheShim) {
  HARNESS_REQUIRE_DEVICE();
  harness::Result r = Home::get().shmrdma({"env"});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("export LD_PRELOAD="), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("libshmrdma-shim.so"), std::string::npos) << r.out;
  // Prepended to what is there, which is kept.
  const std::string other = "/lib/x86_64-linux-gnu/libm.so.6";
  if (!std::filesystem::exists(other)) GTEST_SKIP() << other << " does not exist";
  r = harness::run({"sh", "-c", "LD_PRELOAD=" + other + " ASAN_OPTIONS=verify_asan_link_order=0 \"$0\" --home \"$1\" env", harness::Home::bin(),
                  Home::get().path()});
  ASSERT_TRUE(r.ok()) << r.describe();
  auto shim = r.out.find("libshmrdma-shim.so"), libm = r.out.find(other);
  ASSERT_NE(shim, std::string::npos) << r.out;
  ASSERT_NE(libm, std::string::npos) << r.out;
  EXPECT_LT(shim, libm) << r.out;
}

TEST(Events, CqExPollApiOnLoopbackPair) {
  HARNESS_REQUIRE_DEVICE();
  expect_helper_ok("loopback-ex", "OK loopback-ex");
}

TEST(Events, ResizeKeepsCompletionsAndRejectsTooSmall) {
  HARNESS_REQUIRE_DEVICE();
  expect_helper_ok("resize", "OK resize");
}

TEST(Events, OwnSendCompletionsOrderOverrunResizeEventsThreads) {
  HARNESS_REQUIRE_DEVICE();
  expect_helper_ok("own-sends", "OK own-sends");
}

TEST(Events, DestroyCqBusyAndChannelRefcounts) {
  HARNESS_REQUIRE_DEVICE();
  expect_helper_ok("busy", "OK busy");
}

TEST(Events, WithoutTheShimChannelsFailCleanly) {
  HARNESS_REQUIRE_DEVICE();
  harness::Result r = harness::run({"env", "-u", "LD_PRELOAD", helper(), "no-shim"}, 60'000);
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("OK no-shim"), std::string::npos) << r.describe();
}

TEST(Events, EventForACompletionFromAPeer) {
  HARNESS_REQUIRE_DEVICE();
  Pair p;
  ASSERT_TRUE(p.start());
  ASSERT_EQ(ask(p.a, "RECV 8"), "OK posted 8");
  ASSERT_EQ(ask(p.a, "ARM recv 0"), "OK armed recv 0");
  ASSERT_EQ(ask(p.b, "SEND 1"), "OK sent 1");
  EXPECT_EQ(ask(p.a, "EVENT"), "EVENT recv");
  EXPECT_EQ(ask(p.a, "POLL recv 1"), "POLLED 0");
  // Not armed any more: the next completion raises nothing.
  ASSERT_EQ(ask(p.b, "SEND 1"), "OK sent 1");
  EXPECT_EQ(ask(p.a, "POLL recv 1"), "POLLED 1");
  EXPECT_EQ(ask(p.a, "NOEVENT 300"), "OK no event");
  // Armed again: the first completion after the arming fires.
  ASSERT_EQ(ask(p.a, "ARM recv 0"), "OK armed recv 0");
  EXPECT_EQ(ask(p.a, "NOEVENT 100"), "OK no event");
  ASSERT_EQ(ask(p.b, "SEND 2"), "OK sent 2");
  EXPECT_EQ(ask(p.a, "EVENT"), "EVENT recv");
  EXPECT_EQ(ask(p.a, "POLL recv 2"), "POLLED 2 3");
  EXPECT_EQ(ask(p.a, "NOEVENT 200"), "OK no event");  // one event per arming
  p.quit();
}

TEST(Events, SolicitedOnly) {
  HARNESS_REQUIRE_DEVICE();
  Pair p;
  ASSERT_TRUE(p.start());
  ASSERT_EQ(ask(p.a, "RECV 8"), "OK posted 8");
  ASSERT_EQ(ask(p.a, "ARM recv 1"), "OK armed recv 1");
  ASSERT_EQ(ask(p.b, "SEND 2"), "OK sent 2");
  EXPECT_EQ(ask(p.a, "POLL recv 2"), "POLLED 0 1");
  EXPECT_EQ(ask(p.a, "NOEVENT 300"), "OK no event");  // unsolicited: still armed, no event
  ASSERT_EQ(ask(p.b, "SEND 1 sol"), "OK sent 1");
  EXPECT_EQ(ask(p.a, "EVENT"), "EVENT recv");
  EXPECT_EQ(ask(p.a, "POLL recv 1"), "POLLED 2");
  // "Next completion" arming after "solicited" also fires for unsolicited ones.
  ASSERT_EQ(ask(p.a, "ARM recv 1"), "OK armed recv 1");
  ASSERT_EQ(ask(p.a, "ARM recv 0"), "OK armed recv 0");
  ASSERT_EQ(ask(p.b, "SEND 1"), "OK sent 1");
  EXPECT_EQ(ask(p.a, "EVENT"), "EVENT recv");
  EXPECT_EQ(ask(p.a, "POLL recv 1"), "POLLED 3");
  p.quit();
}

TEST(Events, EventForALocalSendCompletion) {
  HARNESS_REQUIRE_DEVICE();
  Pair p;
  ASSERT_TRUE(p.start());
  ASSERT_EQ(ask(p.b, "RECV 4"), "OK posted 4");
  ASSERT_EQ(ask(p.a, "ARM send 0"), "OK armed send 0");
  ASSERT_EQ(ask(p.a, "SEND 1 sig"), "OK sent 1");
  EXPECT_EQ(ask(p.a, "EVENT"), "EVENT send");
  EXPECT_EQ(ask(p.a, "POLL send 1"), "POLLED 0");
  EXPECT_EQ(ask(p.b, "POLL recv 1"), "POLLED 0");
  p.quit();
}

// An initiator blocked in ibv_get_cq_event while its send waits for the
// receiver (RNR) is woken when the receiver posts a receive (into the QP's
// receive queue, or into the SRQ the QP takes its receives from). The
// initiator's retry timer is off (kNoRetryTimer): only the wake-up gets the
// send through.
void blocked_initiator_wakes(bool srq) {
  Pair p;
  ASSERT_TRUE(p.start(kNoRetryTimer, srq));
  ASSERT_EQ(ask(p.a, "ARM send 0"), "OK armed send 0");
  ASSERT_EQ(ask(p.a, "SEND 1 sig"), "OK sent 1");  // B has no receive posted
  ASSERT_TRUE(p.a.write_line("EVENT"));
  EXPECT_FALSE(p.a.read_line(400)) << "an event before the receiver posted: " << p.a.output();
  ASSERT_EQ(ask(p.b, "RECV 1"), "OK posted 1");
  auto l = p.a.read_line(kStepMs);
  ASSERT_TRUE(l) << "the initiator was not woken: " << p.a.output() << p.a.errors();
  EXPECT_EQ(*l, "EVENT send");
  EXPECT_EQ(ask(p.a, "POLL send 1"), "POLLED 0");
  EXPECT_EQ(ask(p.b, "POLL recv 1"), "POLLED 0");
  // Ping-pong: A waits for B's reply on its receive CQ while its own send
  // still waits for B's receive; B's post wakes A, whose send then executes.
  ASSERT_EQ(ask(p.a, "RECV 1"), "OK posted 1");
  ASSERT_EQ(ask(p.a, "ARM recv 0"), "OK armed recv 0");
  ASSERT_EQ(ask(p.a, "SEND 1"), "OK sent 1");
  ASSERT_TRUE(p.a.write_line("EVENT"));
  ASSERT_EQ(ask(p.b, "ARM recv 0"), "OK armed recv 0");
  ASSERT_EQ(ask(p.b, "RECV 1"), "OK posted 1");
  EXPECT_EQ(ask(p.b, "EVENT"), "EVENT recv");
  EXPECT_EQ(ask(p.b, "POLL recv 1"), "POLLED 1");
  ASSERT_EQ(ask(p.b, "SEND 1"), "OK sent 1");
  l = p.a.read_line(kStepMs);
  ASSERT_TRUE(l) << "A did not get the reply's event: " << p.a.output() << p.a.errors();
  EXPECT_EQ(*l, "EVENT recv");
  EXPECT_EQ(ask(p.a, "POLL recv 1"), "POLLED 0");
  p.quit();
}

TEST(Events, BlockedInitiatorWakesWhenTheReceiverPosts) {
  HARNESS_REQUIRE_DEVICE();
  blocked_initiator_wakes(false);
}

TEST(Events, BlockedInitiatorWakesWhenTheReceiverPostsToItsSrq) {
  HARNESS_REQUIRE_DEVICE();
  blocked_initiator_wakes(true);
}

TEST(Events, ResizeWhileAPeerProduces) {
  HARNESS_REQUIRE_DEVICE();
  constexpr int kMessages = 20000;
  Child owner, sender;
  ASSERT_TRUE(owner.start(run_helper({"stress-owner", std::to_string(kMessages)}), harness::kDialog)) << owner.output();
  ASSERT_TRUE(sender.start(run_helper({"stress-sender", std::to_string(kMessages)}), harness::kDialog)) << sender.output();
  auto oa = owner.wait_line("ADDR ", kStepMs), sa = sender.wait_line("ADDR ", kStepMs);
  ASSERT_TRUE(oa && sa) << owner.output() << owner.errors() << sender.output()
                        << sender.errors();
  ASSERT_TRUE(owner.write_line("CONNECT " + sa->substr(5)));
  ASSERT_TRUE(owner.wait_line("READY", kStepMs)) << owner.output() << owner.errors();
  ASSERT_TRUE(sender.write_line("CONNECT " + oa->substr(5)));
  auto done = owner.wait_line("RECEIVED ", 80'000);
  ASSERT_TRUE(done) << "owner: " << owner.output() << owner.errors()
                    << "\nsender: " << sender.output() << sender.errors();
  std::istringstream in(done->substr(9));
  long got = 0;
  std::string word;
  int resizes = 0;
  in >> got >> word >> resizes;
  EXPECT_EQ(got, kMessages);
  EXPECT_GT(resizes, 10) << *done;
  auto so = sender.wait(kStepMs), ro = owner.wait(kStepMs);
  EXPECT_TRUE(so.ok()) << so.describe();
  EXPECT_TRUE(ro.ok()) << ro.describe();
}

// The FIFO of a channel whose process died is removed by the next registry
// operation that reclaims (here `shmrdma status`).
TEST(Events, DeadProcessChannelFifoIsReclaimed) {
  HARNESS_REQUIRE_DEVICE();
  Child c;
  ASSERT_TRUE(c.start(run_helper({"node"}), harness::kDialog)) << c.output();
  ASSERT_TRUE(c.wait_line("ADDR ", kStepMs)) << c.output() << c.errors();
  auto chan_files = [] {
    std::vector<std::string> out;
    for (const auto& f : harness::Home::get().ctx_files())
      if (f.find(".chan") != std::string::npos) out.push_back(f);
    return out;
  };
  EXPECT_EQ(chan_files().size(), 1u);
  c.kill(SIGKILL);
  Home::get().status();
  EXPECT_TRUE(chan_files().empty());
  EXPECT_TRUE(harness::Home::get().ctx_files().empty());
}

}  // namespace
