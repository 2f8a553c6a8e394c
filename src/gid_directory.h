// Every device of a state home, found by GID: "which local device and port
// holds this destination GID?" (RoCE addressing: RC/UC paths at RTR, address
// handles, every UD send). Devices of other network namespaces that share
// the home are found alike: the registry is a file of the home, whoever
// created it.
//
// Cost and safety. A hit reads each device's ports through their seqlocks
// (gid_table.h read_port_net: relaxed loads, no lock, no system call) under
// the directory's private mutex; cheap enough per UD send. A miss rescans
// <home>/devices (readdir + stat, attaching new registries) at most every
// kRescanInterval, so a GID that no device holds costs a scan only now and
// then. A device brought down is retired by `shmrdma down` before its files
// go (Registry::retire empties its tables), so a mapping kept here never
// matches a device that is gone; the rescan then drops it. Registries are
// kept mapped until the directory is destroyed, so the Registry pointer of a
// match stays valid for the directory's life (check GidMatch::seq against
// Registry::port_net_seq to know whether a cached match still holds).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gid_table.h"
#include "registry.h"

namespace shmrdma {

struct GidMatch {
  Registry* registry = nullptr;  // owned by the directory, valid for its life
  uint32_t port = 0;             // 1-based
  uint32_t gid_index = 0;
  uint8_t type = 0;              // layout::GidType of the entry
  uint8_t link_layer = 0;        // layout::LinkLayer of the device
  uint8_t port_state = 0;        // ibv_port_state at the lookup
  uint32_t seq = 0;              // the port's seqlock value at the lookup
};

class GidDirectory {
 public:
  static constexpr uint64_t kRescanIntervalNs = 20'000'000;  // 20 ms

  explicit GidDirectory(std::string home) : home_(std::move(home)) {}
  GidDirectory(const GidDirectory&) = delete;
  GidDirectory& operator=(const GidDirectory&) = delete;

  // The first device (in name order), port and index whose table holds
  // `gid` with a type matching `type_filter` (layout::GidType or
  // kGidTypeAny). The zero GID never matches. Thread-safe, noexcept.
  bool lookup(const uint8_t gid[16], uint8_t type_filter, GidMatch* out) noexcept;
  // Rescans the home now (a device known to have come up).
  void refresh() noexcept;
  const std::string& home() const noexcept { return home_; }

 private:
  struct Device {
    std::string name;
    std::unique_ptr<Registry> registry;
    dev_t st_dev = 0;
    ino_t st_ino = 0;
  };
  bool find_locked(const uint8_t gid[16], uint8_t type_filter, GidMatch* out) noexcept;
  void rescan_locked() noexcept;

  std::string home_;
  std::mutex mu_;
  std::vector<Device> live_;     // sorted by name
  std::vector<Device> retired_;  // gone or replaced; kept mapped (pointers handed out stay valid)
  uint64_t last_scan_ns_ = 0;
  bool scanned_ = false;
};

}  // namespace shmrdma
