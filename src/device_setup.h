// Bringing a device up and down: the sysfs tree libibverbs reads, the
// registry segment and the character device node.
#pragma once

#include <string>
#include <vector>

#include "paths.h"
#include "registry.h"

namespace shmrdma {

struct UpResult {
  bool created = false;        // false: the device was already up
  bool cdev_ready = false;     // /dev/infiniband/<uverbs> exists and is right
  std::string cdev_hint;       // what to run as root when it is not
  int reclaimed = 0;           // dead contexts cleaned up
};

// A RoCE device: the interface it is bound to (read by the caller, with
// libnl: src/net/netif.h) and the first record of its port.
struct RoceSpec {
  layout::NetBinding binding;  // link_layer kLinkLayerEthernet, gid_layout, ifindex, mac, ifname, netns
  PortNetView port;            // link state and GID table now
};

// Creates the device or, when it is already up, repairs what is missing
// (sysfs files, device node) and reclaims dead contexts. ports == 0 means
// "1 for a new device, whatever it has for an existing one". `roce`: a RoCE
// device bound to that interface (one port); an existing device of that name
// must be the same binding (same namespace and ifindex), else EEXIST, and
// its port record is refreshed from roce->port. Returns 0 or errno and an
// explanation in *why.
int device_up(const std::string& home, const std::string& name, uint32_t ports, UpResult* out, std::string* why,
              const RoceSpec* roce = nullptr);

// A port's record changed (the daemon saw the interface change, or `up`
// refreshed it): publishes it (Registry::update_port_net), rewrites the
// sysfs files that follow it, then raises IBV_EVENT_GID_CHANGE when the GID
// table changed and IBV_EVENT_PORT_ACTIVE / IBV_EVENT_PORT_ERR when the port
// state did, in every open context. *change (optional) says what changed.
int apply_port_net(Registry& reg, uint32_t port, const PortNetView& v, PortNetChange* change, std::string* why);

// Rewrites the whole sysfs tree of a device from its registry.
int rewrite_sysfs(Registry& reg, std::string* why);

// Removes a device. EBUSY (with the live pids in *why) while contexts are
// open, unless force.
int device_down(const std::string& home, const std::string& name, bool force, std::string* why);

// Takes a port down or up (ibv_port_state in the registry, the sysfs state
// files) and raises IBV_EVENT_PORT_ERR / IBV_EVENT_PORT_ACTIVE in every open
// context of the device. *notified: how many contexts got the event.
int port_set_state(const std::string& home, const std::string& name, uint32_t port, bool active, int* notified,
                   std::string* why);

// Writes a port event (IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR,
// IBV_EVENT_GID_CHANGE; the port number is the element, as the kernel's) into
// the async FIFO of every open context of the device. Returns how many got it.
int raise_port_event(Registry& reg, uint32_t port, uint32_t event_type);

// The counter files of the sysfs tree (ports/N/counters, ports/N/hw_counters)
// are a snapshot: this reads the device's counters (Registry::read_counters)
// and rewrites them (each file atomically). `shmrdma status`, `shmrdma
// counters`, `shmrdma port`, `shmrdma up` and every context close call it.
// *out (optional) receives the counters. 0 or errno.
int refresh_counters(Registry& reg, std::vector<PortCounters>* out);

// The per-network-namespace view (what `shmrdma run` and `env` give
// programs as SYSFS_PATH): <home>/netns/<dev>-<ino>/class/infiniband{,_verbs}
// hold symbolic links to the devices of the home's sysfs tree that a program
// in that namespace sees, as the kernel's exclusive netns mode shows a
// namespace only its own devices: every InfiniBand device (bound to no
// interface) and the RoCE devices bound to an interface of that namespace.
// The links point into <home>/sys, so every file stays live.
std::string netns_view_root(const std::string& home, uint64_t netns_dev, uint64_t netns_ino);

// Whether a device of this binding is listed in the view of namespace (dev, ino).
bool visible_in_netns(const layout::NetBinding& b, uint64_t netns_dev, uint64_t netns_ino);

// Makes or updates the view of namespace (dev, ino): links for the devices
// it shows, none for the others. 0 or errno (and a sentence in *why).
int sync_netns_view(const std::string& home, uint64_t netns_dev, uint64_t netns_ino, std::string* why);

// Updates every view that exists under <home>/netns (device_up and
// device_down call it, so a program that read SYSFS_PATH before sees a
// device brought up or down later).
void sync_netns_views(const std::string& home);

// Names of the devices under `home` (those with a registry file).
std::vector<std::string> list_devices(const std::string& home);

// The node GUID "xxxx:xxxx:xxxx:xxxx" form used in sysfs.
std::string guid_string(uint64_t guid);

}  // namespace shmrdma
