#include "net/netif.h"

// <net/if.h> before any <linux/...> header: then linux/if.h adds only what
// glibc lacks (IFF_LOWER_UP).
#include <net/if.h>
#include <linux/if.h>
#include <linux/ethtool.h>
#include <linux/if_arp.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <netlink/addr.h>
#include <netlink/cache.h>
#include <netlink/netlink.h>
#include <netlink/route/addr.h>
#include <netlink/route/link.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace shmrdma::net {

namespace {

struct SockDeleter {
  void operator()(nl_sock* s) const { nl_socket_free(s); }
};
struct LinkDeleter {
  void operator()(rtnl_link* l) const { rtnl_link_put(l); }
};
struct CacheDeleter {
  void operator()(nl_cache* c) const { nl_cache_free(c); }
};

// ethtool's speed; 0 when the driver does not know it.
uint32_t ethtool_speed(const std::string& name) {
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  ethtool_cmd cmd{};
  cmd.cmd = ETHTOOL_GSET;
  ifreq ifr{};
  std::snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", name.c_str());
  ifr.ifr_data = reinterpret_cast<char*>(&cmd);
  uint32_t speed = 0;
  if (::ioctl(fd, SIOCETHTOOL, &ifr) == 0) {
    speed = ethtool_cmd_speed(&cmd);
    if (speed == static_cast<uint32_t>(SPEED_UNKNOWN) || speed == 0xffff) speed = 0;
  }
  ::close(fd);
  return speed;
}

int nl_errno(int nle) {
  switch (-nle) {
    case NLE_OBJ_NOTFOUND:
    case NLE_NODEV:
      return ENODEV;
    case NLE_NOMEM:
      return ENOMEM;
    case NLE_PERM:
      return EPERM;
    default:
      return EIO;
  }
}

}  // namespace

int read_interface(const std::string& name, uint32_t ifindex, InterfaceState* out, std::string* why) {
  std::unique_ptr<nl_sock, SockDeleter> sock(nl_socket_alloc());
  if (!sock) {
    *why = "out of memory";
    return ENOMEM;
  }
  if (int rc = nl_connect(sock.get(), NETLINK_ROUTE); rc < 0) {
    *why = std::string("cannot open a route netlink socket: ") + nl_geterror(rc);
    return nl_errno(rc);
  }
  rtnl_link* raw = nullptr;
  int rc = rtnl_link_get_kernel(sock.get(), static_cast<int>(ifindex), ifindex ? nullptr : name.c_str(), &raw);
  std::unique_ptr<rtnl_link, LinkDeleter> link(raw);
  if (rc < 0 || !link) {
    const int err = rc < 0 ? nl_errno(rc) : ENODEV;
    if (err == ENODEV || rc == -NLE_INVAL || rc == -NLE_RANGE) {
      *why = ifindex ? "no network interface with index " + std::to_string(ifindex) + " in this network namespace"
                     : "no network interface '" + name + "' in this network namespace";
      return ENODEV;
    }
    *why = std::string("cannot read the interface: ") + nl_geterror(rc);
    return err;
  }
  InterfaceState s;
  s.ifindex = static_cast<uint32_t>(rtnl_link_get_ifindex(link.get()));
  if (const char* n = rtnl_link_get_name(link.get())) s.name = n;
  s.mtu = rtnl_link_get_mtu(link.get());
  s.flags = rtnl_link_get_flags(link.get());
  s.up = s.flags & IFF_UP;
  s.carrier = s.up && (s.flags & IFF_LOWER_UP);
  nl_addr* a = rtnl_link_get_addr(link.get());
  s.ethernet = rtnl_link_get_arptype(link.get()) == ARPHRD_ETHER && a && nl_addr_get_len(a) == 6;
  if (s.ethernet) std::memcpy(s.mac, nl_addr_get_binary_addr(a), 6);
  s.speed_mbps = ethtool_speed(s.name);

  nl_cache* cache_raw = nullptr;
  if ((rc = rtnl_addr_alloc_cache(sock.get(), &cache_raw)) < 0) {
    *why = std::string("cannot read the interface's addresses: ") + nl_geterror(rc);
    return nl_errno(rc);
  }
  std::unique_ptr<nl_cache, CacheDeleter> cache(cache_raw);
  for (nl_object* o = nl_cache_get_first(cache.get()); o; o = nl_cache_get_next(o)) {
    auto* ad = reinterpret_cast<rtnl_addr*>(o);
    if (static_cast<uint32_t>(rtnl_addr_get_ifindex(ad)) != s.ifindex) continue;
    nl_addr* local = rtnl_addr_get_local(ad);
    if (!local) continue;
    const int family = rtnl_addr_get_family(ad);
    const auto* bytes = static_cast<const uint8_t*>(nl_addr_get_binary_addr(local));
    if (family == AF_INET && nl_addr_get_len(local) == 4) {
      std::array<uint8_t, 4> v4{};
      std::memcpy(v4.data(), bytes, 4);
      s.addrs.ipv4.push_back(v4);
    } else if (family == AF_INET6 && nl_addr_get_len(local) == 16) {
      std::array<uint8_t, 16> v6{};
      std::memcpy(v6.data(), bytes, 16);
      if (v6[0] == 0xfe && (v6[1] & 0xc0) == 0x80) continue;  // link-local: GID[0] stands for it
      s.addrs.ipv6.push_back(v6);
    }
  }
  *out = std::move(s);
  return 0;
}

int netns_identity(uint64_t* dev, uint64_t* ino) {
  struct stat st{};
  if (::stat("/proc/self/ns/net", &st) != 0) return errno;
  *dev = st.st_dev;
  *ino = st.st_ino;
  return 0;
}

PortNetView port_view(const InterfaceState& s, bool present, layout::GidLayout gid_layout,
                      const PortNetView& previous) {
  PortNetView v = previous;
  if (!present) {
    v.link = 0;
    v.valid_mask = 0;
    for (auto& g : v.gids) g = GidEntry{};
    return v;
  }
  v.link = layout::kLinkPresent | (s.up ? layout::kLinkUp : 0) | (s.carrier ? layout::kLinkCarrier : 0);
  v.ifmtu = s.mtu;
  v.speed_mbps = s.speed_mbps;
  std::memset(v.ifname, 0, sizeof v.ifname);
  std::snprintf(v.ifname, sizeof v.ifname, "%s", s.name.c_str());
  std::memcpy(v.mac, s.mac, 6);
  place_gid_table(build_gid_table(gid_layout, s.mac, s.addrs), &v);
  return v;
}

}  // namespace shmrdma::net
