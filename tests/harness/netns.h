// Two network namespaces joined by a veth pair, with one state home shared
// by both: the setting of the RoCE and RDMA CM tests (as root). Names carry
// the test process's pid (namespaces, interfaces) or come from mkdtemp (the
// home); addresses are .1 and .2 of a /24 in 198.18.0.0/15 picked by the pid.
// Everything made is removed by remove() (the fixture's TearDown), also when
// the test failed, and, when the test is killed by meson's timeout (SIGTERM)
// or ^C, by a shell that the signal handler execs.
#pragma once

#include <sys/types.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "process.h"

namespace harness {

// The whole file ("" when unreadable).
std::string slurp(const std::string& path);
// slurp without the trailing newlines.
std::string slurp_trimmed(const std::string& path);
bool contains(const std::string& hay, const std::string& needle);

struct NetnsOptions {
  std::string tag = "ns";        // namespaces shmrdma-<tag><pid>a / b, home /tmp/shmrdma-<tag>-XXXXXX
  std::string if_prefix = "ns";  // interfaces <if_prefix>A<pid>, <if_prefix>B<pid>
  std::string net16 = "198.18";  // the /24 is <net16>.<1 + pid % 250>.
};

class NetnsPair {
 public:
  NetnsPair() = default;
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;
  ~NetnsPair() { remove(); }

  // Makes the home, both namespaces (lo up), the veth pair (up, net_+"1" in
  // ns_a, net_+"2" in ns_b) and installs the signal cleanup. "" or what failed.
  std::string make(const NetnsOptions& o, const std::string& shmrdma_bin);
  // Devices down (--force, from each namespace and the host's), the home's
  // daemons and the children named by also_kill() killed, the namespaces
  // deleted, the home removed. Idempotent.
  void remove();
  bool made() const { return made_; }
  // A child of the test the signal cleanup (and remove()) kills first.
  void also_kill(pid_t pid);

  // `ip ARGS...` on the host; "" or what failed.
  std::string ip(std::vector<std::string> args) const;
  // ARGS inside namespace ns (the host's when ns is empty).
  std::vector<std::string> in_ns(const std::string& ns, std::vector<std::string> args) const;
  // `shmrdma --home HOME ARGS...` inside namespace ns.
  std::vector<std::string> shm_cmd(const std::string& ns, std::vector<std::string> args) const;
  Result shm(const std::string& ns, std::vector<std::string> args, int timeout_ms = 30000) const;
  // `shmrdma --home HOME run -- PROGRAM...` inside namespace ns.
  std::vector<std::string> app(const std::string& ns, std::vector<std::string> args) const;
  // The pids in the home's daemon pid files.
  std::vector<pid_t> daemon_pids() const;
  // Every daemon log of the home, each after a "--- path" line.
  std::string daemon_logs() const;

  std::string bin, home, ns_a, ns_b, if_a, if_b, net, a, b;

 private:
  void write_cleanup();

  bool made_ = false;
  std::vector<pid_t> kill_first_;
};

// The fixture: skips without root or `ip`, makes the pair in SetUp (the
// tests' own setup follows in the derived SetUp), removes it in TearDown
// (printing the daemons' logs when the test failed).
class NetnsTest : public ::testing::Test {
 protected:
  explicit NetnsTest(NetnsOptions o) : options_(std::move(o)) {}
  void SetUp() override;
  void TearDown() override;

  NetnsPair net_pair_;

 private:
  NetnsOptions options_;
};

}  // namespace harness
