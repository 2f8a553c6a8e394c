// The control plane of RoCE devices, as a user sees it (as root): two
// network namespaces joined by a veth pair, one state home shared by both,
// `shmrdma up --netdev` in each. Stock tools (ibv_devinfo, ibv_asyncwatch)
// and roce_probe (ibv_query_port / ibv_query_gid(_ex) / ibv_query_gid_table
// through the stock libibverbs) run inside the namespaces with
// `ip netns exec NS shmrdma run ...`.
//
// Every test makes its own namespaces and interfaces, named after the test
// process's pid, with addresses from 198.18.0.0/15, and removes them (and
// the daemons of its home) in TearDown, also when it fails. Without root or
// without `ip` the tests skip and say why.
#include <arpa/inet.h>
#include <dirent.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "home.h"
#include "netns.h"

namespace {

using harness::Child;
using harness::contains;
using harness::Result;
// sysfs values without their newline.
std::string slurp(const std::string& path) { return harness::slurp_trimmed(path); }
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The full form libibverbs parses from sysfs.
std::string full_gid(const std::string& text) {
  uint8_t g[16];
  if (inet_pton(AF_INET6, text.c_str(), g) != 1) return "bad:" + text;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", g[0], g[1],
                g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]);
  return buf;
}

size_t count_of(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// Polls `pred` every 20 ms for up to `ms`; how long it took, or -1.
long within(int ms, const std::function<bool()>& pred) {
  auto start = Clock::now();
  for (;;) {
    if (pred()) return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    if (Clock::now() - start > std::chrono::milliseconds(ms)) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

class RoceCtl : public harness::NetnsTest {
 protected:
  RoceCtl() : NetnsTest({"rt", "rt", "198.18"}) {}
  void SetUp() override {
    NetnsTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    probe_ = harness::getenv_str("ROCE_PROBE_BIN");
    ASSERT_FALSE(probe_.empty()) << "meson passes ROCE_PROBE_BIN";
    const harness::NetnsPair& n = net_pair_;
    bin_ = n.bin, home_ = n.home, ns_a_ = n.ns_a, ns_b_ = n.ns_b, if_a_ = n.if_a, if_b_ = n.if_b, net_ = n.net;
  }

  void ip(std::vector<std::string> args) {
    const std::string e = net_pair_.ip(std::move(args));
    ASSERT_EQ(e, "");
  }

  std::vector<std::string> in_ns(const std::string& ns, std::vector<std::string> args) {
    if (ns.empty()) return args;
    args.insert(args.begin(), {"ip", "netns", "exec", ns});
    return args;
  }
  Result shm(const std::string& ns, std::vector<std::string> args, int timeout_ms = 30000) {
    args.insert(args.begin(), {bin_, "--home", home_});
    return harness::run(in_ns(ns, args), timeout_ms);
  }
  Result probe(const std::string& ns, const std::string& dev) {
    return shm(ns, {"run", probe_, dev}, 10000);
  }
  nlohmann::json status(const std::string& ns) {
    Result r = shm(ns, {"status", "--json"});
    EXPECT_TRUE(r.ok()) << r.describe();
    try {
      return nlohmann::json::parse(r.out);
    } catch (...) {
      ADD_FAILURE() << "status --json is not JSON:\n" << r.out;
      return {};
    }
  }
  nlohmann::json device_json(const std::string& ns, const std::string& name) {
    for (const auto& d : status(ns).value("devices", nlohmann::json::array()))
      if (d.value("name", "") == name) return d;
    return {};
  }
  std::string link_field(const std::string& ns, const std::string& ifname, const std::string& key) {
    Result r = harness::run({"ip", "-n", ns, "-o", "link", "show", ifname});
    std::smatch m;
    if (key == "ifindex") {
      if (std::regex_search(r.out, m, std::regex("^(\\d+):"))) return m[1];
    } else if (std::regex_search(r.out, m, std::regex("link/ether ([0-9a-f:]+)"))) {
      return m[1];
    }
    return "";
  }
  std::string port_dir(const std::string& dev) { return home_ + "/sys/class/infiniband/" + dev + "/ports/1"; }
  // What a failed command must not leave behind.
  std::set<std::string> footprint() {
    std::set<std::string> s;
    for (const char* sub : {"/devices", "/sys/class/infiniband", "/sys/class/infiniband_verbs", "/daemon"}) {
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(home_ + sub, ec))
        if (e.path().extension() != ".log" && e.path().extension() != ".lock") s.insert(e.path().string());
    }
    return s;
  }
  void up_a() {
    Result r = shm(ns_a_, {"up", "--name", "roceA", "--netdev", if_a_});
    ASSERT_TRUE(r.ok()) << r.describe();
  }

  std::string bin_, probe_, home_, ns_a_, ns_b_, if_a_, if_b_, net_;
};

TEST_F(RoceCtl, DevicesInTwoNamespacesLookLikeRxe) {
  up_a();
  Result r = shm(ns_b_, {"up", "--name", "roceB", "--netdev", if_b_});
  ASSERT_TRUE(r.ok()) << r.describe();
  // An InfiniBand device in the same home, made outside both namespaces.
  r = shm("", {"up", "--name", "ibx0"});
  ASSERT_TRUE(r.ok()) << r.describe();

  struct Side {
    std::string ns, dev, ifname, addr;
  };
  for (const Side& s : {Side{ns_a_, "roceA", if_a_, net_ + "1"}, Side{ns_b_, "roceB", if_b_, net_ + "2"}}) {
    SCOPED_TRACE(s.dev);
    r = shm(s.ns, {"run", "ibv_devinfo", "-v", "-d", s.dev});
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_EQ(r.err, "") << "ibv_devinfo wrote to stderr";
    EXPECT_TRUE(std::regex_search(r.out, std::regex("link_layer:\\s+Ethernet"))) << r.out;
    EXPECT_TRUE(contains(r.out, "::ffff:" + s.addr + ", RoCE v2")) << r.out;
    EXPECT_TRUE(std::regex_search(r.out, std::regex("port_lid:\\s+0\\n"))) << r.out;
    EXPECT_TRUE(std::regex_search(r.out, std::regex("active_mtu:\\s+1024 \\(3\\)"))) << r.out;
    EXPECT_TRUE(std::regex_search(r.out, std::regex("max_mtu:\\s+4096 \\(5\\)"))) << r.out;
    EXPECT_TRUE(std::regex_search(r.out, std::regex("state:\\s+PORT_ACTIVE"))) << r.out;

    const std::string ifindex = link_field(s.ns, s.ifname, "ifindex");
    const std::string mac = link_field(s.ns, s.ifname, "mac");
    ASSERT_FALSE(ifindex.empty() || mac.empty());
    // EUI-64 of the MAC: universal/local bit flipped, ff:fe in the middle.
    unsigned m[6];
    ASSERT_EQ(std::sscanf(mac.c_str(), "%x:%x:%x:%x:%x:%x", &m[0], &m[1], &m[2], &m[3], &m[4], &m[5]), 6);
    char guid[32], ll[64];
    std::snprintf(guid, sizeof guid, "0x%02x%02x%02xfffe%02x%02x%02x", m[0] ^ 2, m[1], m[2], m[3], m[4], m[5]);
    // As the device prints it (inet_ntop): a MAC that begins 02:00 makes the
    // interface identifier's first group 0, which inet_ntop folds into the
    // "::" (fe80::5eff:fe77:f503 for 02:00:5e:77:f5:03).
    const unsigned char ll6[16] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, static_cast<unsigned char>(m[0] ^ 2),
                                   static_cast<unsigned char>(m[1]), static_cast<unsigned char>(m[2]), 0xff, 0xfe,
                                   static_cast<unsigned char>(m[3]), static_cast<unsigned char>(m[4]),
                                   static_cast<unsigned char>(m[5])};
    ASSERT_NE(inet_ntop(AF_INET6, ll6, ll, sizeof ll), nullptr);
    r = probe(s.ns, s.dev);
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_TRUE(contains(r.out, std::string("node_guid ") + guid)) << r.out;
    EXPECT_TRUE(contains(r.out, "link_layer=2 lid=0 sm_lid=0 lmc=0 gid_tbl_len=16 pkey_tbl_len=1")) << r.out;
    EXPECT_TRUE(contains(r.out, "state=4 phys_state=5 active_mtu=3 max_mtu=5")) << r.out;
    EXPECT_TRUE(contains(r.out, "width=1 speed=8")) << r.out;  // veth: 10 Gb/s, 1X FDR10 as the kernel maps it
    EXPECT_TRUE(contains(r.out, "pkey 0 0xffff")) << r.out;
    EXPECT_TRUE(contains(r.out, std::string("table 0 ") + ll + " type=2 ifindex=" + ifindex)) << r.out;
    EXPECT_TRUE(contains(r.out, "table 1 ::ffff:" + s.addr + " type=2 ifindex=" + ifindex)) << r.out;
    EXPECT_EQ(count_of(r.out, "\ntable "), 2u) << r.out;
    EXPECT_TRUE(contains(r.out, "gid_ex 1 ::ffff:" + s.addr + " type=2 ifindex=" + ifindex)) << r.out;
    EXPECT_TRUE(contains(r.out, "gid 7 ::\n")) << r.out;
    // The sysfs shape libibverbs and its consumers read.
    const std::string pd = port_dir(s.dev);
    EXPECT_EQ(slurp(pd + "/gids/1"), full_gid("::ffff:" + s.addr));
    EXPECT_EQ(slurp(pd + "/gids/9"), full_gid("::"));
    EXPECT_EQ(slurp(pd + "/gid_attrs/types/1"), "RoCE v2");
    EXPECT_EQ(slurp(pd + "/gid_attrs/types/15"), "IB/RoCE v1");
    EXPECT_EQ(slurp(pd + "/gid_attrs/ndevs/1"), s.ifname);
    EXPECT_EQ(slurp(pd + "/gid_attrs/ndevs/15"), "");
    EXPECT_EQ(slurp(pd + "/link_layer"), "Ethernet");
    EXPECT_EQ(slurp(pd + "/lid"), "0x0");
    EXPECT_TRUE(fs::is_directory(home_ + "/sys/class/infiniband/" + s.dev + "/device/net/" + s.ifname));
    // status: the binding, the table, the port and the daemon.
    nlohmann::json d = device_json(s.ns, s.dev);
    ASSERT_FALSE(d.is_null());
    EXPECT_EQ(d["link_layer"], "Ethernet");
    EXPECT_EQ(d["netdev"]["name"], s.ifname);
    EXPECT_EQ(d["netdev"]["netns_is_ours"], true);
    EXPECT_EQ(d["gid_layout"], "rxe");
    EXPECT_EQ(d["daemon"]["running"], true);
    EXPECT_EQ(d["ports"][0]["state"], "ACTIVE");
    EXPECT_EQ(d["ports"][0]["active_mtu"], 1024);
    EXPECT_EQ(d["ports"][0]["gids"][1]["gid"], "::ffff:" + s.addr);
    EXPECT_EQ(d["ports"][0]["gids"][1]["type"], "RoCE v2");
  }
  // Each namespace lists the InfiniBand device and its own RoCE device only
  // (the kernel's exclusive netns mode), in libibverbs and in SYSFS_PATH;
  // the host's namespace lists only the InfiniBand one; the IB one is still IB.
  struct View {
    std::string ns;
    std::vector<std::string> listed, hidden;
  };
  for (const View& v : {View{ns_a_, {"roceA", "ibx0"}, {"roceB"}}, View{ns_b_, {"roceB", "ibx0"}, {"roceA"}},
                        View{"", {"ibx0"}, {"roceA", "roceB"}}}) {
    SCOPED_TRACE(v.ns.empty() ? "the host's namespace" : v.ns);
    r = shm(v.ns, {"run", "ibv_devices"});
    ASSERT_TRUE(r.ok()) << r.describe();
    Result ls = shm(v.ns, {"run", "sh", "-c", "ls $SYSFS_PATH/class/infiniband; ls $SYSFS_PATH/class/infiniband_verbs"});
    ASSERT_TRUE(ls.ok()) << ls.describe();
    for (const auto& d : v.listed) {
      EXPECT_TRUE(contains(r.out, d)) << r.out;
      EXPECT_TRUE(contains(ls.out, d + "\n") && contains(ls.out, "shmrdma_" + d + "_")) << ls.out;
    }
    for (const auto& d : v.hidden) {
      EXPECT_FALSE(contains(r.out, d)) << r.out;
      EXPECT_FALSE(contains(ls.out, d)) << ls.out;
    }
  }
  r = shm(ns_a_, {"run", "ibv_devinfo", "-d", "roceB"});
  EXPECT_NE(r.exit_code, 0) << "roceB is not listed in " << ns_a_ << ": " << r.describe();
  r = shm(ns_a_, {"run", "ibv_devinfo", "-d", "ibx0"});
  EXPECT_TRUE(std::regex_search(r.out, std::regex("link_layer:\\s+InfiniBand"))) << r.out;
  // A device brought up later shows in a view made before (a shell that
  // took `shmrdma env` earlier), and goes when it goes down.
  Result env = shm(ns_a_, {"env"});
  ASSERT_TRUE(env.ok()) << env.describe();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(env.out, m, std::regex("export SYSFS_PATH='([^']+)'"))) << env.out;
  const std::string view = m[1];
  EXPECT_NE(view, home_ + "/sys") << "SYSFS_PATH is the home's whole tree";
  ASSERT_TRUE(shm("", {"up", "--name", "ibx1"}).ok());
  EXPECT_TRUE(fs::exists(view + "/class/infiniband/ibx1/node_guid")) << view;
  ASSERT_TRUE(shm("", {"down", "--name", "ibx1"}).ok());
  EXPECT_FALSE(fs::exists(view + "/class/infiniband/ibx1")) << view;
  // SHMRDMA_NETNS_MODE=shared: every device of the home, as the kernel's shared mode.
  r = harness::run(in_ns(ns_a_, {"env", "SHMRDMA_NETNS_MODE=shared", bin_, "--home", home_, "run", "ibv_devices"}));
  ASSERT_TRUE(r.ok()) << r.describe();
  for (const char* d : {"roceA", "roceB", "ibx0"}) EXPECT_TRUE(contains(r.out, d)) << r.out;
  // status lists every device of the home (it is not the verbs view), saying whose namespace.
  EXPECT_EQ(device_json("", "roceB")["netdev"]["netns_is_ours"], false);
}

TEST_F(RoceCtl, Mlx5LayoutHasV1V2Pairs) {
  Result r = shm(ns_a_, {"up", "--name", "roceM", "--netdev", if_a_, "--gid-layout", "mlx5"});
  ASSERT_TRUE(r.ok()) << r.describe();
  r = probe(ns_a_, "roceM");
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_TRUE(contains(r.out, "table 2 ::ffff:" + net_ + "1 type=1")) << r.out;
  EXPECT_TRUE(contains(r.out, "table 3 ::ffff:" + net_ + "1 type=2")) << r.out;
  EXPECT_EQ(slurp(port_dir("roceM") + "/gid_attrs/types/2"), "IB/RoCE v1");
  EXPECT_EQ(slurp(port_dir("roceM") + "/gid_attrs/types/3"), "RoCE v2");
  r = shm(ns_a_, {"run", "ibv_devinfo", "-v", "-d", "roceM"});
  // ibv_devinfo prints RoCE v1 GIDs in the raw form, v2 ones as addresses.
  EXPECT_TRUE(contains(r.out, full_gid("::ffff:" + net_ + "1") + ", RoCE v1")) << r.out;
  EXPECT_TRUE(contains(r.out, "::ffff:" + net_ + "1, RoCE v2")) << r.out;
}

// The GID table has kGidTableLen (16) entries: with 20 IPv4 addresses the
// first 15 (in the kernel's order) get GIDs after fe80, the rest are left
// out, `up` warns on stderr naming them and the daemon logs them; a removed
// address's slot goes to the next one left out, and nothing else moves.
TEST_F(RoceCtl, MoreAddressesThanTheTableHolds) {
  for (int i = 101; i <= 119; ++i) ip({"-n", ns_a_, "addr", "add", net_ + std::to_string(i) + "/24", "dev", if_a_});
  Result r = shm(ns_a_, {"up", "--name", "roceA", "--netdev", if_a_});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_TRUE(contains(r.err, "warning: the GID table has 16 entries")) << r.describe();
  for (int i = 115; i <= 119; ++i) EXPECT_TRUE(contains(r.err, "::ffff:" + net_ + std::to_string(i))) << r.err;
  EXPECT_FALSE(contains(r.err, "::ffff:" + net_ + "114")) << r.err;
  const std::string pd = port_dir("roceA");
  EXPECT_EQ(slurp(pd + "/gids/1"), full_gid("::ffff:" + net_ + "1"));
  for (int i = 2; i < 16; ++i)
    EXPECT_EQ(slurp(pd + "/gids/" + std::to_string(i)), full_gid("::ffff:" + net_ + std::to_string(99 + i)));
  EXPECT_FALSE(fs::exists(pd + "/gids/16"));
  Result d = shm(ns_a_, {"run", "ibv_devinfo", "-v", "-d", "roceA"});
  ASSERT_TRUE(d.ok()) << d.describe();
  EXPECT_TRUE(d.err.empty()) << d.err;
  EXPECT_TRUE(contains(d.out, "gid_tbl_len:\t\t16")) << d.out;
  EXPECT_EQ(count_of(d.out, ", RoCE v2"), 16u) << d.out;
  auto daemon_log = [&] {
    std::string all;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(home_ + "/daemon", ec))
      if (e.path().extension() == ".log") all += slurp(e.path().string());
    return all;
  };
  EXPECT_GE(within(3000, [&] { return contains(daemon_log(), "left out of it: ::ffff:" + net_ + "115"); }), 0)
      << daemon_log();
  // 198.18.x.105 (index 6) goes: its slot takes .115, the first one left out.
  ip({"-n", ns_a_, "addr", "del", net_ + "105/24", "dev", if_a_});
  EXPECT_GE(within(3000, [&] { return slurp(pd + "/gids/6") == full_gid("::ffff:" + net_ + "115"); }), 0)
      << slurp(pd + "/gids/6");
  EXPECT_EQ(slurp(pd + "/gids/5"), full_gid("::ffff:" + net_ + "104"));
  EXPECT_EQ(slurp(pd + "/gids/7"), full_gid("::ffff:" + net_ + "106"));
  EXPECT_GE(within(3000, [&] { return contains(daemon_log(), "left out of it: ::ffff:" + net_ + "116"); }), 0)
      << daemon_log();
  for (int i = 116; i <= 119; ++i) ip({"-n", ns_a_, "addr", "del", net_ + std::to_string(i) + "/24", "dev", if_a_});
  EXPECT_GE(within(3000, [&] { return contains(daemon_log(), "fits the GID table again"); }), 0) << daemon_log();
}

TEST_F(RoceCtl, FollowsTheInterfaceWithinASecond) {
  up_a();
  Child watch;
  ASSERT_TRUE(watch.start(in_ns(ns_a_, {bin_, "--home", home_, "run", "ibv_asyncwatch", "-d", "roceA"}), harness::kDialog)) << watch.output();
  net_pair_.also_kill(watch.pid());
  ASSERT_TRUE(watch.wait_line("roceA: async event FD", 20000)) << watch.errors();
  auto events = [&](const std::string& what) {
    while (watch.read_line(20)) {
    }
    return count_of(watch.output(), what);
  };
  const std::string pd = port_dir("roceA");
  const std::string ifindex = link_field(ns_a_, if_a_, "ifindex");
  auto probe_has = [&](const std::string& what) { return contains(probe(ns_a_, "roceA").out, what); };
  // Each change must show in sysfs, through libibverbs and as an event within 1 s.
  auto expect_within_1s = [&](const char* what, const std::function<bool()>& pred) {
    long ms = within(1000, pred);
    if (ms < 0) {
      const std::string log = device_json(ns_a_, "roceA")["daemon"].value("log", std::string());
      ADD_FAILURE() << what << " not seen within 1 s; ibv_asyncwatch printed:\n"
                    << watch.output() << "daemon log " << log << ":\n" << slurp(log);
    }
    return ms >= 0;
  };

  ip({"-n", ns_a_, "addr", "add", net_ + "9/24", "dev", if_a_});
  expect_within_1s("address added", [&] {
    return slurp(pd + "/gids/2") == full_gid("::ffff:" + net_ + "9") &&
           probe_has("table 2 ::ffff:" + net_ + "9 type=2 ifindex=" + ifindex) &&
           events("IBV_EVENT_GID_CHANGE (18), port 1") >= 1;
  });

  ip({"-n", ns_a_, "link", "set", if_a_, "mtu", "9000"});
  expect_within_1s("MTU 9000 (active_mtu 4096)", [&] { return probe_has("active_mtu=5 max_mtu=5"); });

  ip({"-n", ns_a_, "link", "set", if_a_, "down"});
  expect_within_1s("link down", [&] {
    return slurp(pd + "/state") == "1: DOWN" && slurp(pd + "/phys_state") == "3: Disabled" &&
           probe_has("state=1 phys_state=3") && events("IBV_EVENT_PORT_ERR (10), port 1") >= 1;
  });
  ip({"-n", ns_a_, "link", "set", if_a_, "up"});
  expect_within_1s("link up", [&] {
    return slurp(pd + "/state") == "4: ACTIVE" && probe_has("state=4 phys_state=5") &&
           events("IBV_EVENT_PORT_ACTIVE (9), port 1") >= 1;
  });

  // Carrier: the peer's end going down takes our carrier.
  ip({"-n", ns_b_, "link", "set", if_b_, "down"});
  expect_within_1s("carrier lost", [&] { return probe_has("state=1") && events("IBV_EVENT_PORT_ERR (10)") >= 2; });
  ip({"-n", ns_b_, "link", "set", if_b_, "up"});
  expect_within_1s("carrier back", [&] { return probe_has("state=4") && events("IBV_EVENT_PORT_ACTIVE (9)") >= 2; });

  ip({"-n", ns_a_, "addr", "del", net_ + "9/24", "dev", if_a_});
  expect_within_1s("address removed", [&] {
    std::string out = probe(ns_a_, "roceA").out;
    return slurp(pd + "/gids/2") == full_gid("::") && !contains(out, "::ffff:" + net_ + "9") &&
           contains(out, "table 1 ::ffff:" + net_ + "1 type=2") && events("IBV_EVENT_GID_CHANGE (18)") >= 2;
  });

  // Renamed: the netdev name follows (libibverbs resolves it in our namespace).
  const std::string renamed = "rtC" + std::to_string(::getpid());
  ip({"-n", ns_a_, "link", "set", if_a_, "down"});
  ip({"-n", ns_a_, "link", "set", if_a_, "name", renamed});
  ip({"-n", ns_a_, "link", "set", renamed, "up"});
  expect_within_1s("rename", [&] {
    return slurp(pd + "/gid_attrs/ndevs/1") == renamed &&
           fs::is_directory(home_ + "/sys/class/infiniband/roceA/device/net/" + renamed) &&
           probe_has("table 1 ::ffff:" + net_ + "1 type=2 ifindex=" + ifindex) && probe_has("state=4");
  });

  // Gone from our namespace (moved away): no GIDs, port down.
  const size_t gid_events = events("IBV_EVENT_GID_CHANGE (18)");
  ip({"-n", ns_a_, "link", "set", renamed, "netns", ns_b_});
  expect_within_1s("removal", [&] {
    std::string out = probe(ns_a_, "roceA").out;
    return contains(out, "state=1") && !contains(out, "\ntable ") && events("IBV_EVENT_GID_CHANGE (18)") > gid_events;
  });
  nlohmann::json d = device_json(ns_a_, "roceA");
  EXPECT_EQ(d["netdev"]["present"], false);
  const std::string log = slurp(d["daemon"]["log"]);
  EXPECT_TRUE(contains(log, "GID added: ::ffff:" + net_ + "9")) << log;
  EXPECT_TRUE(contains(log, "MTU 1500 -> 9000 (active_mtu 4096)")) << log;
  EXPECT_TRUE(contains(log, "renamed to " + renamed)) << log;
  EXPECT_TRUE(contains(log, "is gone")) << log;
}

TEST_F(RoceCtl, BadInputLeavesNothingBehind) {
  auto refused = [&](const std::string& ns, std::vector<std::string> args, const std::string& message) {
    const auto before = footprint();
    Result r = shm(ns, args);
    EXPECT_NE(r.exit_code, 0) << r.describe();
    EXPECT_TRUE(contains(r.err, message)) << "expected \"" << message << "\" in:\n" << r.describe();
    EXPECT_EQ(footprint(), before) << "a refused command left files behind";
  };
  refused(ns_a_, {"up", "--name", "roceX", "--netdev", "nosuch0"}, "no network interface 'nosuch0' in this network namespace");
  // vethB exists, but in the other namespace.
  refused(ns_a_, {"up", "--name", "roceX", "--netdev", if_b_}, "no network interface '" + if_b_ + "'");
  // An interface with only a link-local address.
  const std::string lz = "rtL" + std::to_string(::getpid()), lz2 = "rtM" + std::to_string(::getpid());
  ip({"-n", ns_a_, "link", "add", lz, "type", "veth", "peer", "name", lz2});
  ip({"-n", ns_a_, "link", "set", lz, "up"});
  ip({"-n", ns_a_, "link", "set", lz2, "up"});
  ASSERT_GE(within(5000, [&] { return contains(harness::run({"ip", "-n", ns_a_, "-6", "addr", "show", lz}).out, "fe80"); }), 0);
  refused(ns_a_, {"up", "--name", "roceX", "--netdev", lz}, "has no IPv4 or global IPv6 address");
  refused(ns_a_, {"up", "--name", "roceX", "--netdev", "lo"}, "not an Ethernet interface");
  refused(ns_a_, {"up", "--name", "roceX", "--netdev", if_a_, "--ports", "2"}, "one port");
  refused(ns_a_, {"up", "--name", "roceX", "--gid-layout", "mlx5"}, "--gid-layout needs --netdev");
  refused(ns_a_, {"up", "--name", "rxeX", "--netdev", if_a_}, "must not contain \"rxe\"");
  // Names already taken: by an InfiniBand device, by a RoCE device of another namespace.
  ASSERT_TRUE(shm("", {"up", "--name", "ibx0"}).ok());
  up_a();
  refused(ns_a_, {"up", "--name", "ibx0", "--netdev", if_a_}, "already taken by an InfiniBand device");
  refused(ns_b_, {"up", "--name", "roceA", "--netdev", if_b_},
          "already taken by a RoCE device bound to " + if_a_ + " of another network namespace");
  refused(ns_a_, {"up", "--name", "roceA", "--netdev", if_a_, "--gid-layout", "mlx5"}, "already up with the rxe GID layout");
  // Still what it was.
  nlohmann::json d = device_json(ns_a_, "roceA");
  EXPECT_EQ(d["netdev"]["name"], if_a_);
  EXPECT_EQ(device_json("", "ibx0")["link_layer"], "InfiniBand");
  // And `up` of the same binding again is fine (idempotent).
  Result r = shm(ns_a_, {"up", "--name", "roceA", "--netdev", if_a_});
  EXPECT_TRUE(r.ok()) << r.describe();
}

// Consumers that read /sys/class/infiniband directly (UCX's GID type
// detection) see our tree with `run --private-sys`; the host's /sys does not change.
TEST_F(RoceCtl, PrivateSysShowsTheTreeWhereUcxLooks) {
  up_a();
  const bool host_had = fs::exists("/sys/class/infiniband/roceA");
  Result r = shm(ns_a_, {"run", "--private-sys", "sh", "-c",
                         "cat /sys/class/infiniband/roceA/ports/1/gid_attrs/types/1 "
                         "/sys/class/infiniband/roceA/ports/1/gid_attrs/ndevs/1 /sys/class/net/" + if_a_ + "/mtu"});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.out, "RoCE v2\n" + if_a_ + "\n1500\n");
  EXPECT_EQ(fs::exists("/sys/class/infiniband/roceA"), host_had) << "the host's /sys changed";
  // The namespace's view there too: roceB of the other namespace is not listed.
  ASSERT_TRUE(shm(ns_b_, {"up", "--name", "roceB", "--netdev", if_b_}).ok());
  r = shm(ns_a_, {"run", "--private-sys", "ls", "/sys/class/infiniband"});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.out, "roceA\n");
}

// One request to the daemon's socket; the reply line ("" when none).
std::string talk(const std::string& sock, const std::string& bytes, bool wait_reply = true) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", sock.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return "connect failed";
  }
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string got;
  char buf[256];
  ssize_t n;
  while (wait_reply && (n = ::recv(fd, buf, sizeof buf, 0)) > 0) {
    got.append(buf, static_cast<size_t>(n));
    if (got.find('\n') != std::string::npos) break;
  }
  ::close(fd);
  if (auto nl = got.find('\n'); nl != std::string::npos) got.resize(nl);
  return got;
}

TEST_F(RoceCtl, DaemonIsSupervisedAndSurvivesBadInput) {
  up_a();
  nlohmann::json d = device_json(ns_a_, "roceA");
  ASSERT_EQ(d["daemon"]["running"], true) << d.dump(2);
  const int pid = d["daemon"]["pid"];
  const std::string sock = d["daemon"]["socket"];
  EXPECT_TRUE(contains(slurp(d["daemon"]["log"]), "following roceA")) << slurp(d["daemon"]["log"]);
  // Bad input: unknown requests, an endless line, a client that leaves at once.
  EXPECT_EQ(talk(sock, "bogus request\n"), "error unknown request");
  EXPECT_EQ(talk(sock, std::string(4000, 'x')), "error request too long");
  (void)talk(sock, "pi", false);
  EXPECT_EQ(talk(sock, std::string("\0\xff\n", 3)), "error unknown request");
  EXPECT_TRUE(contains(talk(sock, "ping\n"), "ok pid=" + std::to_string(pid))) << "the daemon did not survive";

  // Its death does not take the device down; `up` restarts it, and the
  // change it missed is in the table at once.
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_GE(within(3000, [&] { return device_json(ns_a_, "roceA")["daemon"]["running"] == false; }), 0);
  Result r = probe(ns_a_, "roceA");
  EXPECT_TRUE(r.ok() && contains(r.out, "state=4")) << r.describe();
  ip({"-n", ns_a_, "addr", "add", net_ + "7/24", "dev", if_a_});
  r = shm(ns_a_, {"up", "--name", "roceA", "--netdev", if_a_});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_TRUE(contains(r.out, "started shmrdmad")) << r.out;
  EXPECT_TRUE(contains(r.out, "::ffff:" + net_ + "7, RoCE v2")) << r.out;
  d = device_json(ns_a_, "roceA");
  ASSERT_EQ(d["daemon"]["running"], true);
  const int pid2 = d["daemon"]["pid"];
  EXPECT_NE(pid2, pid);
  // A second `up` finds it running.
  r = shm(ns_a_, {"up", "--name", "roceA", "--netdev", if_a_});
  EXPECT_FALSE(contains(r.out, "started shmrdmad")) << r.out;
  // `down` of the namespace's last RoCE device stops it.
  r = shm(ns_a_, {"down", "--name", "roceA"});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_TRUE(contains(r.out, "stopped shmrdmad")) << r.out;
  EXPECT_GE(within(3000, [&] { return ::kill(pid2, 0) != 0 || contains(slurp("/proc/" + std::to_string(pid2) + "/stat"), ") Z"); }), 0);
  EXPECT_FALSE(fs::exists(sock));
}

}  // namespace
