#include "gid_table.h"

#include <arpa/inet.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>

#include <cstdio>
#include <cstring>

namespace shmrdma {

using layout::GidSlot;
using layout::PortNet;

namespace {

// Bounded: a reader never spins on a writer that died holding the seqlock.
// A live writer holds it for well under a microsecond, unless it is
// preempted right then: the yields give it the CPU back. A few microseconds
// in all, whatever the load (a sched_yield on a busy machine can cost a
// time slice, so there are few of them).
constexpr int kSeqSpins = 64;
constexpr int kSeqYields = 8;

uint64_t load_word(const std::atomic<uint64_t>& w) { return w.load(std::memory_order_relaxed); }

void bytes_from_words(const std::atomic<uint64_t>* w, uint8_t* out, size_t n) {
  for (size_t i = 0; i * 8 < n; ++i) {
    uint64_t v = load_word(w[i]);
    std::memcpy(out + i * 8, &v, std::min<size_t>(8, n - i * 8));
  }
}

void words_from_bytes(std::atomic<uint64_t>* w, const uint8_t* in, size_t n) {
  for (size_t i = 0; i * 8 < n; ++i) {
    uint64_t v = 0;
    std::memcpy(&v, in + i * 8, std::min<size_t>(8, n - i * 8));
    w[i].store(v, std::memory_order_relaxed);
  }
}

bool is_zero(const uint8_t gid[16]) {
  for (int i = 0; i < 16; ++i)
    if (gid[i]) return false;
  return true;
}

// One attempt: the fields with relaxed loads between the two seq reads.
bool try_read(const PortNet& n, PortNetView* v) {
  const uint32_t s1 = n.seq.load(std::memory_order_acquire);  // pairs with W1 of write_port_net
  if (s1 & 1) return false;
  v->seq = s1;
  v->link = n.link.load(std::memory_order_relaxed);
  v->ifmtu = n.ifmtu.load(std::memory_order_relaxed);
  v->speed_mbps = n.speed_mbps.load(std::memory_order_relaxed);
  uint8_t name[16];
  bytes_from_words(n.ifname, name, sizeof name);
  std::memcpy(v->ifname, name, sizeof name);
  v->ifname[16] = '\0';
  uint64_t mac = n.mac.load(std::memory_order_relaxed);
  std::memcpy(v->mac, &mac, 6);
  v->phys_state = n.phys_state.load(std::memory_order_relaxed);
  v->active_mtu = n.active_mtu.load(std::memory_order_relaxed);
  v->active_width = n.active_width.load(std::memory_order_relaxed);
  v->active_speed = n.active_speed.load(std::memory_order_relaxed);
  v->valid_mask = 0;
  for (uint32_t i = 0; i < limits::kGidTableLen; ++i) {
    const GidSlot& g = n.gids[i];
    const uint32_t attr = g.attr.load(std::memory_order_relaxed);
    bytes_from_words(g.gid, v->gids[i].gid, 16);
    const uint8_t type = static_cast<uint8_t>(attr & 0xff);
    const bool ok = (attr & layout::kGidValid) && type <= layout::kGidTypeRoceV2 && !is_zero(v->gids[i].gid);
    v->gids[i].type = ok ? type : uint8_t{layout::kGidTypeIb};
    if (ok) v->valid_mask |= 1u << i;
    else std::memset(v->gids[i].gid, 0, 16);
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // pairs with W0 of write_port_net
  return n.seq.load(std::memory_order_relaxed) == s1;
}

}  // namespace

int read_port_net(const layout::RegistrySegment& seg, uint32_t num_ports, uint32_t port, PortNetView* out) noexcept {
  if (port < 1 || port > num_ports || port > limits::kMaxPorts) return EINVAL;
  const PortNet& n = seg.net[port - 1];
  PortNetView v;
  for (int i = 0; i < kSeqSpins + kSeqYields; ++i) {
    // The port state lives in PortRecord (one byte, its own writer rules).
    v.state = std::atomic_ref<uint8_t>(const_cast<uint8_t&>(seg.device.ports[port - 1].state))
                  .load(std::memory_order_relaxed);
    if (v.state != layout::kPortDown && v.state != layout::kPortActive) v.state = layout::kPortDown;  // untrusted
    if (try_read(n, &v)) {
      // Untrusted values of the record itself.
      if (v.active_mtu < 1 || v.active_mtu > 5) v.active_mtu = 5;  // IBV_MTU_256..IBV_MTU_4096
      if (v.phys_state > 7) v.phys_state = 3;
      *out = v;
      return 0;
    }
    if (i >= kSeqSpins) sched_yield();
  }
  return EAGAIN;
}

uint32_t port_net_seq(const layout::RegistrySegment& seg, uint32_t num_ports, uint32_t port) noexcept {
  if (port < 1 || port > num_ports || port > limits::kMaxPorts) return 0;
  return seg.net[port - 1].seq.load(std::memory_order_acquire);
}

void write_port_net(layout::RegistrySegment& seg, uint32_t port, const PortNetView& v) noexcept {
  if (port < 1 || port > limits::kMaxPorts) return;
  PortNet& n = seg.net[port - 1];
  // A writer that died mid-update left seq odd: start from the next even value.
  const uint32_t s = n.seq.load(std::memory_order_relaxed) | 1u;
  n.seq.store(s, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // W0: readers that see a field below see seq odd
  n.link.store(v.link, std::memory_order_relaxed);
  n.ifmtu.store(v.ifmtu, std::memory_order_relaxed);
  n.speed_mbps.store(v.speed_mbps, std::memory_order_relaxed);
  uint8_t name[16] = {};
  std::memcpy(name, v.ifname, std::min(sizeof name, ::strnlen(v.ifname, sizeof v.ifname)));
  words_from_bytes(n.ifname, name, sizeof name);
  uint64_t mac = 0;
  std::memcpy(&mac, v.mac, 6);
  n.mac.store(mac, std::memory_order_relaxed);
  n.phys_state.store(v.phys_state, std::memory_order_relaxed);
  n.active_mtu.store(v.active_mtu, std::memory_order_relaxed);
  n.active_width.store(v.active_width, std::memory_order_relaxed);
  n.active_speed.store(v.active_speed, std::memory_order_relaxed);
  std::atomic_ref<uint8_t>(seg.device.ports[port - 1].state).store(v.state, std::memory_order_relaxed);
  for (uint32_t i = 0; i < limits::kGidTableLen; ++i) {
    GidSlot& g = n.gids[i];
    const bool ok = v.valid(i) && !is_zero(v.gids[i].gid);
    uint8_t zero[16] = {};
    words_from_bytes(g.gid, ok ? v.gids[i].gid : zero, 16);
    g.attr.store(ok ? (layout::kGidValid | v.gids[i].type) : 0, std::memory_order_relaxed);
  }
  n.seq.store(s + 1, std::memory_order_release);  // W1
}

bool gid_index_of(const PortNetView& v, const uint8_t gid[16], uint8_t type_filter, uint32_t* index) noexcept {
  if (is_zero(gid)) return false;
  for (uint32_t i = 0; i < limits::kGidTableLen; ++i) {
    if (!v.valid(i)) continue;
    if (type_filter != kGidTypeAny && v.gids[i].type != type_filter) continue;
    if (std::memcmp(v.gids[i].gid, gid, 16) == 0) {
      if (index) *index = i;
      return true;
    }
  }
  return false;
}

uint32_t rxe_active_mtu(uint32_t ifmtu) noexcept {
  const uint32_t room = ifmtu > 80 ? ifmtu - 80 : 0;
  if (room >= 4096) return 5;  // IBV_MTU_4096
  if (room >= 2048) return 4;
  if (room >= 1024) return 3;
  if (room >= 512) return 2;
  return 1;  // IBV_MTU_256
}

void eth_speed_to_ib(uint32_t speed_mbps, uint32_t* width, uint32_t* speed) noexcept {
  // ibv_port_attr encodings: width 1X = 1, 2X = 16, 4X = 2; speed SDR = 1,
  // DDR = 2, FDR10 = 8, EDR = 32, HDR = 64.
  const uint32_t mbps = speed_mbps ? speed_mbps : 1000;  // the kernel's default for an unknown speed
  if (mbps <= 1000) *width = 1, *speed = 1;
  else if (mbps <= 10000) *width = 1, *speed = 8;
  else if (mbps <= 20000) *width = 2, *speed = 2;
  else if (mbps <= 25000) *width = 1, *speed = 32;
  else if (mbps <= 40000) *width = 2, *speed = 8;
  else if (mbps <= 50000) *width = 16, *speed = 32;
  else if (mbps <= 100000) *width = 2, *speed = 32;
  else *width = 2, *speed = 64;
}

void link_local_gid_from_mac(const uint8_t mac[6], uint8_t gid[16]) noexcept {
  std::memset(gid, 0, 16);
  gid[0] = 0xfe;
  gid[1] = 0x80;
  gid[8] = mac[0] ^ 0x02;
  gid[9] = mac[1];
  gid[10] = mac[2];
  gid[11] = 0xff;
  gid[12] = 0xfe;
  gid[13] = mac[3];
  gid[14] = mac[4];
  gid[15] = mac[5];
}

uint64_t guid_from_mac(const uint8_t mac[6]) noexcept {
  uint8_t gid[16];
  link_local_gid_from_mac(mac, gid);
  uint64_t g = 0;
  for (int i = 8; i < 16; ++i) g = g << 8 | gid[i];
  return g;
}

void ipv4_mapped_gid(const uint8_t ipv4[4], uint8_t gid[16]) noexcept {
  std::memset(gid, 0, 16);
  gid[10] = 0xff;
  gid[11] = 0xff;
  std::memcpy(gid + 12, ipv4, 4);
}

namespace {

// Every GID the interface's addresses make, in table order.
std::vector<std::array<uint8_t, 16>> gid_candidates(const uint8_t mac[6], const InterfaceAddresses& addrs) {
  std::vector<std::array<uint8_t, 16>> gids;
  std::array<uint8_t, 16> g{};
  link_local_gid_from_mac(mac, g.data());
  gids.push_back(g);
  for (const auto& a : addrs.ipv4) {
    ipv4_mapped_gid(a.data(), g.data());
    gids.push_back(g);
  }
  for (const auto& a : addrs.ipv6) {
    if (a[0] == 0xfe && (a[1] & 0xc0) == 0x80) continue;  // link-local: index 0 stands for it
    if (is_zero(a.data())) continue;
    gids.push_back(a);
  }
  return gids;
}

// How many GIDs fit: each takes two entries in the mlx5 layout.
size_t gids_that_fit(layout::GidLayout gid_layout) {
  return gid_layout == layout::kGidLayoutMlx5 ? limits::kGidTableLen / 2 : limits::kGidTableLen;
}

}  // namespace

std::vector<std::array<uint8_t, 16>> gids_left_out(layout::GidLayout gid_layout, const uint8_t mac[6],
                                                   const InterfaceAddresses& addrs) {
  std::vector<std::array<uint8_t, 16>> gids = gid_candidates(mac, addrs);
  const size_t fit = gids_that_fit(gid_layout);
  if (gids.size() <= fit) return {};
  return {gids.begin() + static_cast<std::ptrdiff_t>(fit), gids.end()};
}

std::string gids_text(const std::vector<std::array<uint8_t, 16>>& gids) {
  std::string out;
  for (const auto& g : gids) out += (out.empty() ? "" : ", ") + gid_short_text(g.data());
  return out;
}

std::vector<GidEntry> build_gid_table(layout::GidLayout gid_layout, const uint8_t mac[6],
                                      const InterfaceAddresses& addrs) {
  const std::vector<std::array<uint8_t, 16>> gids = gid_candidates(mac, addrs);
  std::vector<GidEntry> out;
  for (const auto& gid : gids) {
    GidEntry e{};
    std::memcpy(e.gid, gid.data(), 16);
    if (gid_layout == layout::kGidLayoutMlx5) {
      if (out.size() + 2 > limits::kGidTableLen) break;
      e.type = layout::kGidTypeRoceV1;
      out.push_back(e);
    }
    if (out.size() + 1 > limits::kGidTableLen) break;
    e.type = layout::kGidTypeRoceV2;
    out.push_back(e);
  }
  return out;
}

void place_gid_table(const std::vector<GidEntry>& desired, PortNetView* v) noexcept {
  auto same = [](const GidEntry& a, const GidEntry& b) { return a.type == b.type && !std::memcmp(a.gid, b.gid, 16); };
  // Entries that are no longer wanted leave a hole, as in the kernel's GID cache.
  for (uint32_t i = 0; i < limits::kGidTableLen; ++i) {
    if (!v->valid(i)) continue;
    bool wanted = false;
    for (const GidEntry& d : desired) wanted = wanted || same(d, v->gids[i]);
    if (!wanted) {
      v->valid_mask &= ~(1u << i);
      v->gids[i] = GidEntry{};
    }
  }
  for (const GidEntry& d : desired) {
    bool present = false;
    for (uint32_t i = 0; i < limits::kGidTableLen && !present; ++i) present = v->valid(i) && same(d, v->gids[i]);
    if (present || is_zero(d.gid)) continue;
    for (uint32_t i = 0; i < limits::kGidTableLen; ++i) {
      if (v->valid(i)) continue;
      v->gids[i] = d;
      v->valid_mask |= 1u << i;
      break;
    }
  }
}

std::string gid_full_text(const uint8_t gid[16]) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", gid[0],
                gid[1], gid[2], gid[3], gid[4], gid[5], gid[6], gid[7], gid[8], gid[9], gid[10], gid[11], gid[12],
                gid[13], gid[14], gid[15]);
  return buf;
}

std::string gid_short_text(const uint8_t gid[16]) {
  char buf[INET6_ADDRSTRLEN];
  if (!::inet_ntop(AF_INET6, gid, buf, sizeof buf)) return gid_full_text(gid);
  return buf;
}

const char* gid_type_sysfs_name(uint8_t type) noexcept {
  return type == layout::kGidTypeRoceV2 ? "RoCE v2" : "IB/RoCE v1";
}

}  // namespace shmrdma
