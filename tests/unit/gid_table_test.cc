// SPDX-License-Identifier: MIT
//
// Unit tests for src/gid_table.h and DeviceDirectory::by_gid: the GID layouts
// (rxe, mlx5) built from an interface's addresses, the kernel-like placement
// that keeps indices when addresses come and go, rxe's MTU rule, the
// seqlocked PortNet record (consistent snapshots under a concurrent writer,
// bounded retries over a writer that died mid-update, untrusted contents),
// the Registry writer (port state from the link, admin down), and finding a
// device of a home by GID (new devices found, retired ones never matched).

#include "gid_table.h"

#include <arpa/inet.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "device_setup.h"
#include "directory.h"
#include "registry.h"

namespace shmrdma {
namespace {

namespace fs = std::filesystem;

std::array<uint8_t, 16> gid6(const char* text) {
  std::array<uint8_t, 16> g{};
  EXPECT_EQ(::inet_pton(AF_INET6, text, g.data()), 1) << text;
  return g;
}

const uint8_t kMac[6] = {0x52, 0x54, 0x00, 0x12, 0x34, 0x56};

TEST(GidTable, LinkLocalAndGuidAreTheEui64OfTheMac) {
  uint8_t g[16];
  link_local_gid_from_mac(kMac, g);
  EXPECT_EQ(gid_short_text(g), "fe80::5054:ff:fe12:3456");
  EXPECT_EQ(gid_full_text(g), "fe80:0000:0000:0000:5054:00ff:fe12:3456");
  EXPECT_EQ(guid_from_mac(kMac), 0x505400fffe123456ull);
}

TEST(GidTable, RxeLayoutIsV2LinkLocalThenIpv4ThenIpv6) {
  InterfaceAddresses a;
  a.ipv4.push_back({198, 18, 0, 1});
  a.ipv4.push_back({198, 18, 0, 2});
  a.ipv6.push_back(gid6("fe80::1"));  // link-local: index 0 stands for it
  a.ipv6.push_back(gid6("2001:db8::5"));
  auto t = build_gid_table(layout::kGidLayoutRxe, kMac, a);
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(gid_short_text(t[0].gid), "fe80::5054:ff:fe12:3456");
  EXPECT_EQ(gid_short_text(t[1].gid), "::ffff:198.18.0.1");
  EXPECT_EQ(gid_short_text(t[2].gid), "::ffff:198.18.0.2");
  EXPECT_EQ(gid_short_text(t[3].gid), "2001:db8::5");
  for (const auto& e : t) EXPECT_EQ(e.type, layout::kGidTypeRoceV2);
}

TEST(GidTable, Mlx5LayoutIsV1V2Pairs) {
  InterfaceAddresses a;
  a.ipv4.push_back({198, 18, 0, 1});
  auto t = build_gid_table(layout::kGidLayoutMlx5, kMac, a);
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].type, layout::kGidTypeRoceV1);
  EXPECT_EQ(t[1].type, layout::kGidTypeRoceV2);
  EXPECT_EQ(t[2].type, layout::kGidTypeRoceV1);
  EXPECT_EQ(t[3].type, layout::kGidTypeRoceV2);
  EXPECT_EQ(gid_short_text(t[3].gid), "::ffff:198.18.0.1");  // the index much software hard-codes
  EXPECT_EQ(std::memcmp(t[0].gid, t[1].gid, 16), 0);
}

TEST(GidTable, LayoutStopsAtTheTableLength) {
  InterfaceAddresses a;
  for (uint8_t i = 0; i < 40; ++i) a.ipv4.push_back({198, 18, 1, i});
  EXPECT_EQ(build_gid_table(layout::kGidLayoutRxe, kMac, a).size(), limits::kGidTableLen);
  EXPECT_EQ(build_gid_table(layout::kGidLayoutMlx5, kMac, a).size(), limits::kGidTableLen);
}

TEST(GidTable, PlacementKeepsIndicesAndReusesHoles) {
  InterfaceAddresses a;
  a.ipv4.push_back({198, 18, 0, 1});
  a.ipv4.push_back({198, 18, 0, 2});
  PortNetView v;
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, a), &v);
  EXPECT_EQ(v.valid_mask, 0x7u);
  // 198.18.0.1 goes: its slot (1) becomes a hole, 198.18.0.2 keeps index 2.
  a.ipv4.erase(a.ipv4.begin());
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, a), &v);
  EXPECT_EQ(v.valid_mask, 0x5u);
  EXPECT_EQ(gid_short_text(v.gids[2].gid), "::ffff:198.18.0.2");
  // A new address takes the lowest free slot.
  a.ipv4.push_back({198, 18, 0, 3});
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, a), &v);
  EXPECT_EQ(v.valid_mask, 0x7u);
  EXPECT_EQ(gid_short_text(v.gids[1].gid), "::ffff:198.18.0.3");
  uint32_t idx = 99;
  uint8_t want[16];
  const uint8_t ip[4] = {198, 18, 0, 2};
  ipv4_mapped_gid(ip, want);
  EXPECT_TRUE(gid_index_of(v, want, layout::kGidTypeRoceV2, &idx));
  EXPECT_EQ(idx, 2u);
  EXPECT_FALSE(gid_index_of(v, want, layout::kGidTypeRoceV1, &idx));
  EXPECT_TRUE(gid_index_of(v, want, kGidTypeAny, &idx));
  const uint8_t zero[16] = {};
  EXPECT_FALSE(gid_index_of(v, zero, kGidTypeAny, &idx));
}

TEST(GidTable, RxeMtuRule) {
  EXPECT_EQ(rxe_active_mtu(1500), 3u);  // IBV_MTU_1024
  EXPECT_EQ(rxe_active_mtu(9000), 5u);  // IBV_MTU_4096
  EXPECT_EQ(rxe_active_mtu(4176), 5u);
  EXPECT_EQ(rxe_active_mtu(4175), 4u);
  EXPECT_EQ(rxe_active_mtu(2128), 4u);
  EXPECT_EQ(rxe_active_mtu(1104), 3u);
  EXPECT_EQ(rxe_active_mtu(1103), 2u);
  EXPECT_EQ(rxe_active_mtu(68), 1u);
  EXPECT_EQ(rxe_active_mtu(0), 1u);
}

TEST(GidTable, EthernetSpeedMapping) {
  uint32_t w = 0, s = 0;
  eth_speed_to_ib(10000, &w, &s);  // veth
  EXPECT_EQ(w, 1u);
  EXPECT_EQ(s, 8u);  // 1X FDR10: 10 Gb/s
  eth_speed_to_ib(0, &w, &s);  // unknown: the kernel assumes 1000
  EXPECT_EQ(w, 1u);
  EXPECT_EQ(s, 1u);
  eth_speed_to_ib(100000, &w, &s);
  EXPECT_EQ(w, 2u);
  EXPECT_EQ(s, 32u);  // 4X EDR
}

// 20 IPv4 addresses: the table keeps its 16 entries (rxe: fe80 + 15
// addresses; mlx5: 8 GIDs as v1/v2 pairs), and gids_left_out names the rest.
TEST(GidTable, AddressesBeyondTheTableAreLeftOutInOrder) {
  InterfaceAddresses a;
  for (uint8_t i = 1; i <= 20; ++i) a.ipv4.push_back({198, 18, 0, i});
  auto t = build_gid_table(layout::kGidLayoutRxe, kMac, a);
  ASSERT_EQ(t.size(), limits::kGidTableLen);
  EXPECT_EQ(gid_short_text(t[15].gid), "::ffff:198.18.0.15");
  auto out = gids_left_out(layout::kGidLayoutRxe, kMac, a);
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(gids_text(out), "::ffff:198.18.0.16, ::ffff:198.18.0.17, ::ffff:198.18.0.18, ::ffff:198.18.0.19, "
                            "::ffff:198.18.0.20");
  t = build_gid_table(layout::kGidLayoutMlx5, kMac, a);
  ASSERT_EQ(t.size(), limits::kGidTableLen);
  EXPECT_EQ(gid_short_text(t[15].gid), "::ffff:198.18.0.7");
  EXPECT_EQ(gids_left_out(layout::kGidLayoutMlx5, kMac, a).size(), 13u);
  // Placement over a full table: the slot of a removed address goes to the
  // first one left out; every slot stays valid, nothing beyond the table.
  PortNetView v;
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, a), &v);
  EXPECT_EQ(v.valid_mask, 0xffffu);
  a.ipv4.erase(a.ipv4.begin() + 4);  // 198.18.0.5 (index 5)
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, a), &v);
  EXPECT_EQ(v.valid_mask, 0xffffu);
  EXPECT_EQ(gid_short_text(v.gids[5].gid), "::ffff:198.18.0.16");
  EXPECT_EQ(gid_short_text(v.gids[4].gid), "::ffff:198.18.0.4");
  EXPECT_EQ(gids_left_out(layout::kGidLayoutRxe, kMac, a).size(), 4u);
  a.ipv4.resize(3);
  EXPECT_TRUE(gids_left_out(layout::kGidLayoutRxe, kMac, a).empty());
}

class PortNetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shmrdma-ut-gid-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    home_ = tmpl;
  }
  void TearDown() override { fs::remove_all(home_); }

  // A RoCE-personality registry (what `shmrdma up --netdev` creates).
  void make_roce(const std::string& name, const std::vector<uint8_t>& last_octets, Registry* reg) {
    DevicePaths p = device_paths(home_, name);
    fs::create_directories(p.device_dir);
    layout::DeviceRecord d{};
    std::snprintf(d.name, sizeof d.name, "%s", name.c_str());
    d.node_guid = guid_from_mac(kMac);
    d.sys_image_guid = d.node_guid;
    d.num_ports = 1;
    d.ports[0].state = layout::kPortActive;
    d.ports[0].port_guid = d.node_guid;
    d.net.link_layer = layout::kLinkLayerEthernet;
    d.net.gid_layout = layout::kGidLayoutRxe;
    d.net.ifindex = 7;
    std::memcpy(d.net.mac, kMac, 6);
    std::snprintf(d.net.ifname, sizeof d.net.ifname, "%s", "veth-ut");
    InterfaceAddresses a;
    for (uint8_t o : last_octets) a.ipv4.push_back({198, 18, 0, o});
    std::vector<PortNetView> net(1);
    net[0].link = layout::kLinkPresent | layout::kLinkUp | layout::kLinkCarrier;
    net[0].ifmtu = 1500;
    net[0].speed_mbps = 10000;
    std::snprintf(net[0].ifname, sizeof net[0].ifname, "%s", "veth-ut");
    std::memcpy(net[0].mac, kMac, 6);
    place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, a), &net[0]);
    ASSERT_EQ(Registry::create(p, d, reg, &net), 0);
  }
  static void v4gid(uint8_t last, uint8_t gid[16]) {
    const uint8_t ip[4] = {198, 18, 0, last};
    ipv4_mapped_gid(ip, gid);
  }

  std::string home_;
};

TEST_F(PortNetTest, IbDeviceGetsGid0FromThePortGuid) {
  DevicePaths p = device_paths(home_, "utib0");
  fs::create_directories(p.device_dir);
  layout::DeviceRecord d{};
  std::snprintf(d.name, sizeof d.name, "%s", "utib0");
  d.num_ports = 1;
  d.ports[0].state = layout::kPortActive;
  d.ports[0].port_guid = 0x0211223344556601ull;
  Registry reg;
  ASSERT_EQ(Registry::create(p, d, &reg), 0);
  EXPECT_EQ(reg.device().net.link_layer, layout::kLinkLayerIb);
  PortNetView v;
  ASSERT_EQ(reg.port_net(1, &v), 0);
  EXPECT_EQ(v.valid_mask, 1u);
  EXPECT_EQ(v.gids[0].type, layout::kGidTypeIb);
  EXPECT_EQ(gid_short_text(v.gids[0].gid), "fe80::211:2233:4455:6601");
  EXPECT_EQ(v.state, layout::kPortActive);
  EXPECT_EQ(v.active_mtu, 5u);
  EXPECT_EQ(reg.port_net(2, &v), EINVAL);
  EXPECT_EQ(reg.port_net(0, &v), EINVAL);
  // `shmrdma port down|up` on IB.
  PortNetChange c;
  ASSERT_EQ(reg.set_port_state(1, layout::kPortDown, &c), 0);
  EXPECT_TRUE(c.state);
  EXPECT_EQ(reg.port_state(1), layout::kPortDown);
  ASSERT_EQ(reg.set_port_state(1, layout::kPortActive, &c), 0);
  EXPECT_EQ(reg.port_state(1), layout::kPortActive);
}

TEST_F(PortNetTest, RoceStateFollowsTheLinkAndTheAdminBit) {
  Registry reg;
  make_roce("utroce0", {1}, &reg);
  PortNetView v;
  ASSERT_EQ(reg.port_net(1, &v), 0);
  EXPECT_EQ(v.state, layout::kPortActive);
  EXPECT_EQ(v.phys_state, 5u);
  EXPECT_EQ(v.active_mtu, 3u);  // 1500 -> 1024
  EXPECT_STREQ(v.ifname, "veth-ut");
  // Carrier lost.
  PortNetView n = v;
  n.link = layout::kLinkPresent | layout::kLinkUp;
  PortNetChange c;
  ASSERT_EQ(reg.update_port_net(1, n, &c), 0);
  EXPECT_TRUE(c.state);
  EXPECT_FALSE(c.gids);
  EXPECT_EQ(reg.port_state(1), layout::kPortDown);
  ASSERT_EQ(reg.port_net(1, &v), 0);
  EXPECT_EQ(v.phys_state, 3u);
  // Back, with MTU 9000 and one more address.
  n.link = layout::kLinkPresent | layout::kLinkUp | layout::kLinkCarrier;
  n.ifmtu = 9000;
  InterfaceAddresses a;
  a.ipv4.push_back({198, 18, 0, 1});
  a.ipv4.push_back({198, 18, 0, 9});
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, a), &n);
  ASSERT_EQ(reg.update_port_net(1, n, &c), 0);
  EXPECT_TRUE(c.state && c.gids && c.other);
  ASSERT_EQ(reg.port_net(1, &v), 0);
  EXPECT_EQ(v.active_mtu, 5u);
  EXPECT_EQ(v.state, layout::kPortActive);
  uint8_t g[16];
  uint32_t idx = 0;
  v4gid(9, g);
  EXPECT_TRUE(reg.gid_index_of(1, g, layout::kGidTypeRoceV2, &idx));
  EXPECT_EQ(idx, 2u);
  // `shmrdma port down` holds it down; the daemon's updates keep the bit.
  ASSERT_EQ(reg.set_port_state(1, layout::kPortDown, &c), 0);
  ASSERT_EQ(reg.update_port_net(1, n, &c), 0);
  EXPECT_EQ(reg.port_state(1), layout::kPortDown);
  ASSERT_EQ(reg.set_port_state(1, layout::kPortActive, &c), 0);
  EXPECT_EQ(reg.port_state(1), layout::kPortActive);
}

TEST_F(PortNetTest, SnapshotsAreConsistentUnderAConcurrentWriter) {
  Registry reg;
  make_roce("utroce1", {1}, &reg);
  // The writer alternates between two tables whose entries all carry the
  // same last byte and MTUs that go with it; a torn snapshot mixes them.
  std::atomic<bool> stop{false};
  std::atomic<uint32_t> writes{0};
  std::thread writer([&] {
    for (uint32_t i = 0; !stop.load(std::memory_order_relaxed); ++i, writes.fetch_add(1)) {
      PortNetView n;
      n.link = layout::kLinkPresent | layout::kLinkUp | layout::kLinkCarrier;
      const uint8_t k = (i & 1) ? 0x11 : 0x22;
      n.ifmtu = (i & 1) ? 1500 : 9000;
      for (uint32_t s = 0; s < limits::kGidTableLen; ++s) {
        std::memset(n.gids[s].gid, k, 16);
        n.gids[s].type = layout::kGidTypeRoceV2;
        n.valid_mask |= 1u << s;
      }
      ASSERT_EQ(reg.update_port_net(1, n), 0);
    }
  });
  Registry reader;
  ASSERT_EQ(Registry::attach(device_paths(home_, "utroce1"), &reader), 0);
  // Until enough snapshots of the writer's tables were checked, at most 20 s
  // (a loaded machine may start the writer late).
  int checked = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((checked < 2000 || writes.load() < 100) && std::chrono::steady_clock::now() < deadline) {
    PortNetView v;
    int rc = reader.port_net(1, &v);
    if (rc == EAGAIN) continue;
    ASSERT_EQ(rc, 0);
    if (v.valid_mask != 0xffffu) continue;  // the table make_roce wrote
    const uint8_t k = v.gids[0].gid[0];
    ASSERT_TRUE(k == 0x11 || k == 0x22);
    ASSERT_EQ(v.ifmtu, k == 0x11 ? 1500u : 9000u);
    for (uint32_t s = 0; s < limits::kGidTableLen; ++s)
      for (int b = 0; b < 16; ++b) ASSERT_EQ(v.gids[s].gid[b], k);
    ++checked;
  }
  stop = true;
  writer.join();
  EXPECT_GT(checked, 0);
}

TEST_F(PortNetTest, DeadWriterAndGarbageAreBounded) {
  Registry reg;
  make_roce("utroce2", {1}, &reg);
  auto* seg = const_cast<layout::RegistrySegment*>(reg.segment());
  // A writer that died mid-update: readers give up (EAGAIN), never spin.
  const uint32_t s = seg->net[0].seq.load();
  seg->net[0].seq.store(s | 1);
  PortNetView v;
  EXPECT_EQ(reg.port_net(1, &v), EAGAIN);
  uint8_t g[16];
  v4gid(1, g);
  EXPECT_FALSE(reg.gid_index_of(1, g, kGidTypeAny, nullptr));
  // The next writer repairs it.
  ASSERT_EQ(reg.set_port_state(1, layout::kPortActive), 0);
  ASSERT_EQ(reg.port_net(1, &v), 0);
  // Garbage: an unknown GID type and a valid bit over a zero GID never match.
  seg->net[0].gids[1].attr.store(layout::kGidValid | 0x77);
  seg->net[0].gids[3].attr.store(layout::kGidValid | layout::kGidTypeRoceV2);
  seg->net[0].active_mtu.store(99);
  ASSERT_EQ(reg.port_net(1, &v), 0);
  EXPECT_FALSE(v.valid(1));
  EXPECT_FALSE(v.valid(3));
  EXPECT_EQ(v.active_mtu, 5u);
  EXPECT_FALSE(reg.gid_index_of(1, g, kGidTypeAny, nullptr));
}

// DeviceDirectory::by_gid (src/directory.h), what the data path uses: the
// own device is the one a context opened (utdirS here), the others of the
// home are found by GID, new ones after a rescan, retired ones never again.
TEST_F(PortNetTest, DirectoryFindsDevicesByGidAndForgetsRetiredOnes) {
  Registry self, a, b;
  make_roce("utdirS", {9}, &self);
  make_roce("utdirA", {1}, &a);
  DeviceDirectory dir;
  dir.init(home_, &self);
  ASSERT_NE(dir.self(), nullptr);
  uint8_t g1[16], g2[16], g3[16], g9[16];
  v4gid(1, g1);
  v4gid(2, g2);
  v4gid(3, g3);
  v4gid(9, g9);
  uint32_t port = 0, seq = 0, index = 0;
  HomeDevice* d = dir.by_gid(g9, layout::kGidTypeRoceV2, &port, &seq);
  ASSERT_NE(d, nullptr);
  EXPECT_TRUE(d->self);
  d = dir.by_gid(g1, layout::kGidTypeRoceV2, &port, &seq);
  ASSERT_NE(d, nullptr);
  EXPECT_FALSE(d->self);
  EXPECT_EQ(d->record().name, std::string("utdirA"));
  EXPECT_EQ(d->home_id, a.device().home_id);
  EXPECT_EQ(port, 1u);
  EXPECT_EQ(d->record().net.link_layer, layout::kLinkLayerEthernet);
  EXPECT_EQ(seq, d->registry->port_net_seq(1));
  ASSERT_TRUE(d->registry->gid_index_of(port, g1, layout::kGidTypeRoceV2, &index));
  EXPECT_EQ(index, 1u);
  EXPECT_EQ(dir.by_gid(g1, layout::kGidTypeRoceV1, &port, &seq), nullptr);  // rxe's layout is v2 only
  EXPECT_EQ(dir.by_gid(g2, kGidTypeAny, &port, &seq), nullptr);
  const uint8_t zero[16] = {};
  EXPECT_EQ(dir.by_gid(zero, kGidTypeAny, &port, &seq), nullptr);
  // A device that comes up later is found (a miss rescans, at most every 10 ms).
  make_roce("utdirB", {2}, &b);
  dir.rescan(true);
  d = dir.by_gid(g2, kGidTypeAny, &port, &seq);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->record().name, std::string("utdirB"));
  HomeDevice* held = d;
  // A GID added to B is found at once (no rescan needed: the table is live),
  // and the seq a cached match keeps tells it to look again.
  PortNetView v;
  ASSERT_EQ(b.port_net(1, &v), 0);
  const uint32_t old_seq = v.seq;
  InterfaceAddresses addrs;
  addrs.ipv4.push_back({198, 18, 0, 2});
  addrs.ipv4.push_back({198, 18, 0, 3});
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, addrs), &v);
  ASSERT_EQ(b.update_port_net(1, v), 0);
  EXPECT_NE(held->registry->port_net_seq(1), old_seq);
  d = dir.by_gid(g3, kGidTypeAny, &port, &seq);
  ASSERT_EQ(d, held);
  ASSERT_TRUE(d->registry->gid_index_of(port, g3, kGidTypeAny, &index));
  EXPECT_EQ(index, 2u);
  // `shmrdma down` of B: retired, then its files go; never matched again,
  // and the HomeDevice handed out stays valid memory.
  std::string why;
  ASSERT_EQ(device_down(home_, "utdirB", true, &why), 0) << why;
  EXPECT_EQ(dir.by_gid(g2, kGidTypeAny, &port, &seq), nullptr);
  EXPECT_EQ(dir.by_gid(g3, kGidTypeAny, &port, &seq), nullptr);
  EXPECT_EQ(held->registry->port_state(1), layout::kPortDown);
  dir.rescan(true);
  EXPECT_TRUE(held->gone.load());
  EXPECT_EQ(dir.by_id(b.device().home_id), nullptr);
  EXPECT_NE(dir.by_gid(g1, kGidTypeAny, &port, &seq), nullptr);
}

// Another process's directory sees a GID table update at once (the tables
// are read live from the shared registry, through the seqlock).
TEST_F(PortNetTest, AnotherProcessSeesTheUpdates) {
  Registry own, reg;
  make_roce("utroce3s", {8}, &own);
  make_roce("utroce3", {1}, &reg);
  int to_child[2], to_parent[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(to_parent), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Registry mine;
    int ok = Registry::attach(device_paths(home_, "utroce3s"), &mine) == 0;
    DeviceDirectory dir;
    dir.init(home_, &mine);
    char c = 0;
    uint8_t g[16];
    v4gid(5, g);
    uint32_t port = 0, seq = 0, index = 0;
    ok = ok && dir.by_gid(g, kGidTypeAny, &port, &seq) == nullptr;
    ok = ok && ::write(to_parent[1], "r", 1) == 1 && ::read(to_child[0], &c, 1) == 1;
    HomeDevice* d = ok ? dir.by_gid(g, layout::kGidTypeRoceV2, &port, &seq) : nullptr;
    ok = d && !d->self && d->record().name == std::string("utroce3") && port == 1;
    ok = ok && d->registry->gid_index_of(1, g, layout::kGidTypeRoceV2, &index) && index == 1;  // the hole of 198.18.0.1
    ::_exit(ok ? 0 : 1);
  }
  char c = 0;
  ASSERT_EQ(::read(to_parent[0], &c, 1), 1);
  PortNetView v;
  ASSERT_EQ(reg.port_net(1, &v), 0);
  InterfaceAddresses addrs;
  addrs.ipv4.push_back({198, 18, 0, 5});
  place_gid_table(build_gid_table(layout::kGidLayoutRxe, kMac, addrs), &v);
  ASSERT_EQ(reg.update_port_net(1, v), 0);
  ASSERT_EQ(::write(to_child[1], "g", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

}  // namespace
}  // namespace shmrdma
