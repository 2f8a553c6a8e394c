// A host network interface as a RoCE device sees it, read with
// libnl-route-3. Only the `shmrdma` command and the daemon link this
// (library shmrdma_net): application processes (the provider) never use
// libnl, whose NL_AUTO_PROVIDE caches would fight libibverbs' own
// (docs/ARCHITECTURE.md, "The RoCE personality"). Netlink answers for the
// caller's network namespace.
#pragma once

#include <cstdint>
#include <string>

#include "gid_table.h"
#include "layout.h"

namespace shmrdma::net {

struct InterfaceState {
  uint32_t ifindex = 0;
  std::string name;
  uint8_t mac[6] = {};
  uint32_t mtu = 0;
  uint32_t flags = 0;       // IFF_* of the link
  bool up = false;          // IFF_UP
  bool carrier = false;     // IFF_LOWER_UP (rxe: netif_carrier_ok)
  bool ethernet = false;    // ARPHRD_ETHER (a MAC of 6 bytes)
  uint32_t speed_mbps = 0;  // ethtool; 0 when unknown
  InterfaceAddresses addrs;
};

// Reads one interface of this network namespace, by name (ifindex 0) or by
// index (name empty). 0, ENODEV (no such interface here) or another errno,
// with a sentence in *why.
int read_interface(const std::string& name, uint32_t ifindex, InterfaceState* out, std::string* why);

// The network namespace of this process: st_dev/st_ino of /proc/self/ns/net.
int netns_identity(uint64_t* dev, uint64_t* ino);

// The port record for an interface: link bits, MTU, speed, name, MAC and the
// GID table of `gid_layout`, placed into `previous` (the current table) so
// indices of GIDs that stay keep their place (gid_table.h place_gid_table).
// `present` false (the interface is gone): an empty table, link down.
PortNetView port_view(const InterfaceState& s, bool present, layout::GidLayout gid_layout,
                      const PortNetView& previous);

// True when the interface has an address that makes a routable GID (IPv4,
// or IPv6 other than link-local).
inline bool has_usable_address(const InterfaceState& s) { return !s.addrs.ipv4.empty() || !s.addrs.ipv6.empty(); }

}  // namespace shmrdma::net
