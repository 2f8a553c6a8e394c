// Shared receive queues across processes, every process started through
// `shmrdma run`: two client processes send to two server QPs that share one
// SRQ in a third process, which checks every byte and receives the SRQ limit
// event its peers' consumption raised; and the stock ibv_srq_pingpong.
#include <unistd.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"

HARNESS_TEST_ENVIRONMENT(.tag = "srqtest");

namespace {

using harness::Child;
using harness::Home;

constexpr int kTimeoutMs = 30000;

std::string peer_bin() { return harness::getenv_str("SRQ_PEER_BIN"); }

class SrqMultiProcess : public ::testing::Test {
 protected:
  void SetUp() override { HARNESS_REQUIRE_DEVICE(); }
};

// Two clients, MSGS messages each, into two QPs on one SRQ of a server
// whose SRQ limit is armed at LIMIT (2 * MSGS posted); `small`: the small
// shapes (srq_peer's header).
void two_clients_to_one_srq(int msgs, int limit, bool small) {
  ASSERT_FALSE(peer_bin().empty()) << "SRQ_PEER_BIN is not set";
  std::vector<std::string> sargs{peer_bin(), "server", "2", std::to_string(msgs), std::to_string(limit)};
  if (small) sargs.push_back("small");
  Child server;
  ASSERT_TRUE(server.start(Home::get().run_argv(sargs), {.stdin_pipe = true})) << server.output();
  auto sl = server.wait_line("SERVER ", kTimeoutMs);
  ASSERT_TRUE(sl.has_value()) << "no SERVER line:\n" << server.output();
  std::istringstream in(*sl);
  std::string word;
  uint32_t lid = 0, sq[2] = {0, 0};
  in >> word >> lid >> sq[0] >> sq[1];
  ASSERT_TRUE(in) << *sl;

  Child clients[2];
  uint32_t cq[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> cargs{peer_bin(), "client", std::to_string(i), std::to_string(sq[i]),
                                   std::to_string(lid), std::to_string(msgs)};
    if (small) cargs.push_back("small");
    ASSERT_TRUE(clients[i].start(Home::get().run_argv(cargs), {.stdin_pipe = true})) << clients[i].output();
    auto cl = clients[i].wait_line("CLIENT ", kTimeoutMs);
    ASSERT_TRUE(cl.has_value()) << "no CLIENT line:\n" << clients[i].output();
    cq[i] = static_cast<uint32_t>(std::stoul(cl->substr(7)));
  }
  ASSERT_TRUE(server.write_line("CONNECT " + std::to_string(cq[0]) + " " + std::to_string(cq[1])));
  ASSERT_TRUE(server.wait_line("READY", kTimeoutMs).has_value()) << server.output();
  for (auto& c : clients) ASSERT_TRUE(c.write_line("GO"));

  const std::string sent = "SENT " + std::to_string(msgs) + " OK";
  for (int i = 0; i < 2; ++i) {
    clients[i].close_stdin();
    harness::Result r = clients[i].wait(kTimeoutMs);
    EXPECT_TRUE(r.ok()) << "client " << i << ": " << r.describe();
    EXPECT_NE(clients[i].output().find(sent), std::string::npos) << clients[i].output();
  }
  server.close_stdin();
  harness::Result sr = server.wait(kTimeoutMs);
  EXPECT_TRUE(sr.ok()) << "server: " << sr.describe();
  EXPECT_NE(server.output().find("LIMIT_EVENT"), std::string::npos) << server.output();
  EXPECT_NE(server.output().find("RECV " + std::to_string(2 * msgs) + " OK"), std::string::npos) << server.output();
}

TEST_F(SrqMultiProcess, TwoClientsToTwoQpsOnOneSrqInAnotherProcess) {
  two_clients_to_one_srq(20, 36, false);  // 40 posted: the 5th consumption goes below
}

// The same with messages of 8 to 16 bytes in every shape the SRQ SEND leaf
// takes (one SGE of an MR, one inline SGE, two inline SGEs; SEND and
// SEND_WITH_IMM; signaled and not), so the limit event, the order per QP,
// the immediate data and every byte come through that path.
TEST_F(SrqMultiProcess, SmallSendsOfEveryLeafShapeIntoOneSrq) {
  two_clients_to_one_srq(60, 116, true);
}

// The stock example: 16 QPs on one SRQ on the server side.
TEST_F(SrqMultiProcess, StockIbvSrqPingpong) {
  if (::access("/usr/bin/ibv_srq_pingpong", X_OK) != 0 && ::access("/usr/local/bin/ibv_srq_pingpong", X_OK) != 0)
    GTEST_SKIP() << "ibv_srq_pingpong is not installed (ibverbs-utils)";
  const std::string port = std::to_string(24000 + ::getpid() % 4000);
  Child server;
  ASSERT_TRUE(server.start(Home::get().run_argv({"ibv_srq_pingpong", "-g", "0", "-n", "200", "-p", port})))
      << server.output();
  std::unique_ptr<Child> client;
  harness::Result cr;
  bool client_ok = false;
  for (int attempt = 0; attempt < 20 && !client_ok; ++attempt) {
    // The server's output is block-buffered (a pipe), so nothing tells when
    // it listens: retry a client that came too early.
    std::this_thread::sleep_for(harness::Ms(200));
    client = std::make_unique<Child>();
    ASSERT_TRUE(client->start(Home::get().run_argv({"ibv_srq_pingpong", "-g", "0", "-n", "200", "-p", port,
                                                    "localhost"})))
        << client->output();
    cr = client->wait(kTimeoutMs);
    client_ok = cr.ok();
    if (!client_ok && client->output().find("Couldn't connect") == std::string::npos) break;
  }
  EXPECT_TRUE(client_ok) << "client: " << cr.describe();
  harness::Result sr = server.wait(kTimeoutMs);
  EXPECT_TRUE(sr.ok()) << "server: " << sr.describe();
  for (Child* c : {&server, client.get()}) {
    EXPECT_NE(c->output().find("200 iters in"), std::string::npos) << c->output();
    EXPECT_EQ(c->output().find("Failed"), std::string::npos) << c->output();
  }
}

}  // namespace
