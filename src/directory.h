// The device directory of a state home: every device under
// $SHMRDMA_HOME/devices/<name>/, as one context sees them. This is the seam
// of address resolution (LID or GID -> device, port; QPN -> QP in that
// device's registry) used by RC/UC RTR, UD sends and multicast alike.
//
// A QPN is unique only within one device's registry, so peers are named by
// (device, context slot). Other devices' registries are attached on demand
// (Registry::attach validates them like any untrusted segment), cached per
// context, and looked at again when a lookup misses or a device went away
// or was recreated (its registry file is another inode, or its name left
// the directory). Entries are never freed while the context lives: Peers
// and QPs keep plain pointers to them (a device that went away keeps its
// old mapping, which is still valid memory, until the context closes).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "layout.h"
#include "peer.h"
#include "registry.h"

namespace shmrdma {

// One device of the home.
struct HomeDevice {
  HomeDevice() = default;
  HomeDevice(const HomeDevice&) = delete;
  HomeDevice& operator=(const HomeDevice&) = delete;
  uint32_t home_id = 0;
  bool self = false;          // the context's own device
  Registry* registry = nullptr;  // &owned, or the context's own registry
  Registry owned;
  PeerCache peers;            // contexts of this device we map
  dev_t file_dev = 0;         // the registry file we attached (st_dev, st_ino)
  ino_t file_ino = 0;
  std::atomic<bool> gone{false};  // removed or recreated: look it up again
  const layout::DeviceRecord& record() const noexcept { return registry->device(); }
};

class DeviceDirectory {
 public:
  // `own` is the context's registry (it outlives the directory); nullptr
  // for a process with no device of its own (shmrdmad): lookups by GID then
  // search every device of the home (by LID and id need an own device).
  void init(const std::string& home, Registry* own) noexcept;
  HomeDevice* self() const noexcept { return self_.get(); }
  uint32_t self_id() const noexcept { return self_id_; }

  // The device and port (1-based) whose LID is `lid` (unicast), the own
  // device first; nullptr when no device of the home has it.
  HomeDevice* by_lid(uint16_t lid, uint32_t* port) noexcept;
  // RoCE: the Ethernet device and port whose GID table holds `gid` with a
  // type matching `type` (layout::GidType or kGidTypeAny), the own device
  // first; *seq: that port's GID table seqlock value when it was found (the
  // match holds while Registry::port_net_seq returns it). The zero GID never
  // matches. nullptr when no device of the home holds it.
  HomeDevice* by_gid(const uint8_t gid[16], uint8_t type, uint32_t* port, uint32_t* seq) noexcept;
  // The device with this home id (nullptr: none, or gone).
  HomeDevice* by_id(uint32_t home_id) noexcept;
  // Every device currently known (after a rescan when `rescan`).
  std::vector<HomeDevice*> all(bool rescan) noexcept;
  // A context (slot, generation) of device home_id still live there? The
  // own device is asked without locks; others through the directory.
  bool context_live(uint32_t home_id, uint32_t slot, uint32_t generation, ContextInfo* info) noexcept;

  // Looks at the home again (new, removed and recreated devices). Lookups
  // that miss call it themselves, at most every kMinRescanNs unless forced.
  void rescan(bool force) noexcept;

 private:
  static constexpr uint64_t kMinRescanNs = 10'000'000;  // a miss on a data path rescans at most every 10 ms
  HomeDevice* find_lid_locked(uint16_t lid, uint32_t* port) noexcept;
  static bool gid_on(HomeDevice& d, const uint8_t gid[16], uint8_t type, uint32_t* port, uint32_t* seq) noexcept;
  void rescan_locked(bool force) noexcept;

  std::string home_;
  std::shared_ptr<HomeDevice> self_;
  uint32_t self_id_ = 0;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<HomeDevice>> by_name_;  // current devices (own included)
  std::vector<std::shared_ptr<HomeDevice>> retired_;           // gone, still referenced maybe
  uint64_t last_scan_ns_ = 0;
};

// A home id for a new device `name` of `home`: the smallest one no other
// device there uses (0 when all are taken).
uint32_t choose_home_id(const std::string& home, const std::string& name) noexcept;

}  // namespace shmrdma
