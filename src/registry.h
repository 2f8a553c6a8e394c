// The registry segment of one device: identity, the table of open contexts
// (pid + start time), device-wide object accounting and QPN allocation.
// Control path only; every call takes the registry's robust process-shared
// lock with a timeout, so a dead or stuck holder cannot hang anyone forever.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "counters.h"
#include "layout.h"
#include "paths.h"
#include "segment.h"

namespace shmrdma {

// Suffix of a context's async event FIFO, next to its segment file.
inline constexpr const char* kAsyncSuffix = ".async";

struct ContextInfo {
  uint32_t slot;
  uint32_t generation;
  uint32_t pid;
  uint64_t start_time;
  std::string segment;  // file name in the device directory
  uint32_t held[layout::kObjKinds];
};

class Registry {
 public:
  Registry() = default;
  Registry(Registry&&) noexcept = default;
  Registry& operator=(Registry&&) noexcept = default;

  // Creates the registry file of a new device (EEXIST if there is one).
  static int create(const DevicePaths& paths, const layout::DeviceRecord& device, Registry* out) noexcept;
  // Attaches to an existing registry; ENOENT if the device is not up.
  static int attach(const DevicePaths& paths, Registry* out) noexcept;

  bool valid() const noexcept { return map_.base() != nullptr; }
  const DevicePaths& paths() const noexcept { return paths_; }
  // Validated private copy taken at attach.
  const layout::DeviceRecord& device() const noexcept { return device_; }

  // Allocates a context slot for this process. The segment file name is
  // chosen here (ctx-<slot>-<generation>) and returned in *segment.
  int register_context(uint32_t* slot, uint32_t* generation, std::string* segment) noexcept;
  // Frees the slot. `counts` (n ports, index port - 1): what the context
  // counted, added to the device's per-port totals in the same critical
  // section (counters.h).
  void unregister_context(uint32_t slot, uint32_t generation, const PortCounters* counts = nullptr,
                          uint32_t n = 0) noexcept;

  // The device's per-port counters (index port - 1, num_ports entries): the
  // totals of contexts that are gone + every live context's block and QP
  // records, summed under the registry lock (after reclaiming dead
  // contexts, which folds theirs). 0 or an errno; *unreadable counts live
  // contexts whose segment could not be read (their counts are missing).
  int read_counters(std::vector<PortCounters>* out, uint32_t* unreadable = nullptr) noexcept;

  // Device-wide accounting: ENOMEM when `limit` objects of `kind` exist.
  int charge(uint32_t slot, uint32_t generation, layout::ObjKind kind, uint32_t limit) noexcept;
  void uncharge(uint32_t slot, uint32_t generation, layout::ObjKind kind) noexcept;

  // Serialises RDMA atomics (see RegistrySegment::atomic_locks). 0 or errno.
  int lock_atomic(uint32_t stripe) noexcept;
  void unlock_atomic(uint32_t stripe) noexcept;

  // Lock-free read of one context slot (for finding a peer); false when the
  // slot is free. The copy may be torn if the slot is being reused: callers
  // verify the generation against the peer's segment header.
  bool context_slot(uint32_t slot, ContextInfo* out) noexcept;
  // Cheap check for a data path holding a peer: slot still live with this
  // generation (no copy, no syscall; the process may have died unreclaimed).
  bool slot_is(uint32_t slot, uint32_t generation) noexcept;

  // Multicast membership of UD QPs (IBA 10.5). attach: 0 (also when
  // already attached), ENOMEM (no group or member slot left). detach: 0 or
  // EINVAL (not attached). detach_qp drops the QP from every group.
  int mcast_attach(const uint8_t gid[16], uint16_t mlid, uint32_t slot, uint32_t generation, uint32_t qpn) noexcept;
  int mcast_detach(const uint8_t gid[16], uint16_t mlid, uint32_t slot, uint32_t generation, uint32_t qpn) noexcept;
  void mcast_detach_qp(uint32_t slot, uint32_t generation, uint32_t qpn) noexcept;
  // The live members of group (gid, mlid), at most `max`: how many. 0 when
  // there is no such group.
  uint32_t mcast_members(const uint8_t gid[16], uint16_t mlid, layout::McastMember* out, uint32_t max) noexcept;

  // A port's state (ibv_port_state), read live from the segment: `shmrdma
  // port` changes it. port is 1-based; 0 for an invalid port.
  uint8_t port_state(uint32_t port) const noexcept;
  int set_port_state(uint32_t port, uint8_t state) noexcept;

  // Next QP/WQ number (24 bits, never 0 or 1).
  uint32_t alloc_qpn() noexcept;

  // Frees the slots of dead processes and removes their segments and any
  // orphaned segment files. Returns how many contexts were reclaimed.
  int reclaim_dead(std::vector<ContextInfo>* reclaimed = nullptr) noexcept;

  // Live contexts (after reclaiming dead ones).
  std::vector<ContextInfo> live_contexts() noexcept;

 private:
  class Guard;
  int lock() noexcept;
  void unlock() noexcept;
  layout::RegistrySegment* seg() const noexcept { return static_cast<layout::RegistrySegment*>(map_.base()); }
  int reclaim_locked(std::vector<ContextInfo>* reclaimed) noexcept;
  bool member_live(const layout::McastMember& m) const noexcept;
  void add_totals(const PortCounters* counts, uint32_t n) noexcept;  // caller holds the lock
  layout::McastGroup* find_group(const uint8_t gid[16], uint16_t mlid) noexcept;

  Mapping map_;
  DevicePaths paths_;
  layout::DeviceRecord device_{};
};

}  // namespace shmrdma
