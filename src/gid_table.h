// The GID table and link state of a port (layout::PortNet), as readers see
// it: a consistent private snapshot taken through the port's seqlock, and
// the rules that fill it from a network interface (rxe's and mlx5's GID
// layouts, rxe's MTU rule, the kernel's Ethernet speed mapping). Pure core:
// no libnl here (the command and the daemon read the interface with libnl and
// hand the result to these functions).
//
// Cost: read_port_net copies one port's record (64 + 16 * 24 bytes) with
// relaxed loads, no lock, no system call; cheap enough for a lookup per UD
// send. Everything read is untrusted (another process of the same uid can
// write the segment): types are checked, the name is NUL-terminated, retries
// are bounded.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "layout.h"

namespace shmrdma {

// One GID table entry: the 16 bytes as on the wire (network order) and its
// layout::GidType (kGidTypeIb, kGidTypeRoceV1, kGidTypeRoceV2 = IBV_GID_TYPE_*).
struct GidEntry {
  uint8_t gid[16];
  uint8_t type;
};

// gid_index_of's type filter: any type matches.
inline constexpr uint8_t kGidTypeAny = 0xff;

// A consistent copy of one port's PortNet (plus the port state of its
// PortRecord, read just before).
struct PortNetView {
  uint32_t seq = 0;         // the seqlock value the copy was taken at (even)
  uint32_t link = 0;        // layout::kLink* bits
  uint32_t ifmtu = 0;
  uint32_t speed_mbps = 0;
  char ifname[17] = {};     // NUL-terminated
  uint8_t mac[6] = {};
  uint8_t state = 0;        // ibv_port_state (PortRecord::state)
  uint32_t phys_state = 0;
  uint32_t active_mtu = 0;  // enum ibv_mtu
  uint32_t active_width = 0;
  uint32_t active_speed = 0;
  uint32_t valid_mask = 0;  // bit i: gids[i] holds a GID
  GidEntry gids[limits::kGidTableLen] = {};

  bool valid(uint32_t index) const noexcept { return index < limits::kGidTableLen && (valid_mask >> index) & 1; }
};

// Snapshot of port `port` (1-based) of a mapped registry whose validated
// num_ports is `num_ports`. 0; EINVAL for a port out of range; EAGAIN when a
// writer held the seqlock through every bounded retry (a few microseconds:
// a writer that died mid-update, repaired by the next `shmrdma up` or the
// daemon, or a live one preempted mid-update). Data paths treat EAGAIN as
// "not found now" (a UD drop, an RC retry); control paths use
// Registry::port_net_settled, which waits up to 100 ms.
int read_port_net(const layout::RegistrySegment& seg, uint32_t num_ports, uint32_t port, PortNetView* out) noexcept;

// The sequence value only (acquire): a caller that cached a lookup result
// together with view.seq knows it still holds while this returns the same
// value. 0 for a port out of range.
uint32_t port_net_seq(const layout::RegistrySegment& seg, uint32_t num_ports, uint32_t port) noexcept;

// Writes a port's record from `v` (v.seq is ignored; v.state goes to the
// port's PortRecord::state inside the seqlock's window, so a snapshot's
// state and link bits agree). The caller holds the registry lock: there is
// one writer at a time. Registry::update_port_net is the writer to use: it
// derives state, phys_state and MTU from the link first.
void write_port_net(layout::RegistrySegment& seg, uint32_t port, const PortNetView& v) noexcept;

// The lowest index whose entry holds `gid` with a type matching
// `type_filter` (a layout::GidType, or kGidTypeAny). The zero GID never
// matches.
bool gid_index_of(const PortNetView& v, const uint8_t gid[16], uint8_t type_filter, uint32_t* index) noexcept;

// ------------------------------------------------ filling it from an interface

// rxe's rule (rxe_set_mtu): the interface MTU minus 80 bytes of headers,
// rounded down to 256, 512, 1024, 2048 or 4096 (below 256: 256). Returns the
// enum ibv_mtu value (1500 -> IBV_MTU_1024, 9000 -> IBV_MTU_4096).
uint32_t rxe_active_mtu(uint32_t ifmtu) noexcept;

// The kernel's ib_get_eth_speed: an Ethernet speed in Mb/s to the IB
// (active_width, active_speed) encodings of ibv_port_attr. Unknown (0): 1X SDR.
void eth_speed_to_ib(uint32_t speed_mbps, uint32_t* width, uint32_t* speed) noexcept;

// fe80::/64 + the EUI-64 of the MAC (universal/local bit flipped, ff:fe in
// the middle): GID[0] of rxe, and the node GUID (the last 8 bytes).
void link_local_gid_from_mac(const uint8_t mac[6], uint8_t gid[16]) noexcept;
uint64_t guid_from_mac(const uint8_t mac[6]) noexcept;  // host order: the 8 EUI-64 bytes, first byte highest

// The addresses of an interface that make GIDs, in the order the kernel
// lists them. ipv6 excludes link-local addresses (fe80::/10 gives index 0).
struct InterfaceAddresses {
  std::vector<std::array<uint8_t, 4>> ipv4;
  std::vector<std::array<uint8_t, 16>> ipv6;
};

// The GID table the kernel's roce_gid_mgmt builds (at most kGidTableLen
// entries; what does not fit is left out):
//   rxe:  fe80::EUI-64 v2, then ::ffff:a.b.c.d v2 per IPv4 address, then each IPv6 address v2;
//   mlx5: the same GIDs, each as a v1 entry followed by a v2 entry.
std::vector<GidEntry> build_gid_table(layout::GidLayout gid_layout, const uint8_t mac[6],
                                      const InterfaceAddresses& addrs);
// The GIDs build_gid_table leaves out (the table holds kGidTableLen entries:
// fe80 + 15 addresses in the rxe layout, fe80 + 7 in mlx5's), in order;
// empty when everything fits. `shmrdma up` warns and the daemon logs them.
std::vector<std::array<uint8_t, 16>> gids_left_out(layout::GidLayout gid_layout, const uint8_t mac[6],
                                                   const InterfaceAddresses& addrs);
// "a, b, c" (gid_short_text of each).
std::string gids_text(const std::vector<std::array<uint8_t, 16>>& gids);

// Updates the table of *v to hold exactly `desired` (by GID and type) the
// way the kernel's GID cache does: entries still wanted keep their index,
// entries no longer wanted leave an empty slot, new ones take the lowest free
// slots in order. On an empty table this gives build_gid_table's order.
void place_gid_table(const std::vector<GidEntry>& desired, PortNetView* v) noexcept;

// ::ffff:a.b.c.d.
void ipv4_mapped_gid(const uint8_t ipv4[4], uint8_t gid[16]) noexcept;

// The full form libibverbs parses from sysfs (8 groups of 4 hex digits, no
// "::"), and the short textual form (inet_ntop) for people.
std::string gid_full_text(const uint8_t gid[16]);
std::string gid_short_text(const uint8_t gid[16]);
// "IB/RoCE v1" or "RoCE v2", as the kernel writes gid_attrs/types/N.
const char* gid_type_sysfs_name(uint8_t type) noexcept;

}  // namespace shmrdma
