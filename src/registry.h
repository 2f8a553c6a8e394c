// The registry segment of one device: identity, the table of open contexts
// (pid + start time), device-wide object accounting and QPN allocation.
// Control path only; every call takes the registry's robust process-shared
// lock with a timeout, so a dead or stuck holder cannot hang anyone forever.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "counters.h"
#include "gid_table.h"
#include "layout.h"
#include "paths.h"
#include "segment.h"

namespace shmrdma {

// Suffix of a context's async event FIFO, next to its segment file.
inline constexpr const char* kAsyncSuffix = ".async";

// What a writer of a port's record changed.
struct PortNetChange {
  bool gids = false;   // the GID table (IBV_EVENT_GID_CHANGE)
  bool state = false;  // the port state (IBV_EVENT_PORT_ACTIVE / IBV_EVENT_PORT_ERR)
  bool other = false;  // MTU, name, speed, MAC
  uint8_t new_state = 0;
};

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
  // `net` (one per port): the ports' GID tables and link state; without it
  // each port gets the IB table (GID[0] = fe80::/64 + port GUID).
  static int create(const DevicePaths& paths, const layout::DeviceRecord& device, Registry* out,
                    const std::vector<PortNetView>* net = nullptr) noexcept;
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
  // What contexts of other devices fold for our port `port` (counters.h):
  // added lock-free, from any process. read_foreign: those totals (index
  // port - 1, num_ports entries; not part of read_counters).
  void add_foreign(uint32_t port, const uint64_t counts[layout::kCounters]) noexcept;
  void read_foreign(PortCounters* out, uint32_t n) const noexcept;
  // Adds what our live contexts counted for the device `f` names (their
  // QP records' groups labelled for it) to out[0, nports).
  void sum_foreign(const ForeignFilter& f, uint32_t nports, PortCounters* out) noexcept;

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
  // port` and (RoCE) the interface's link change it. port is 1-based; 0 for
  // an invalid port.
  uint8_t port_state(uint32_t port) const noexcept;
  // `shmrdma port down|up`: holds the port down (kLinkAdminDown) or lets it
  // follow its link again (RoCE: ACTIVE only while the interface is up with
  // carrier). *change (optional) says what changed.
  int set_port_state(uint32_t port, uint8_t state, PortNetChange* change = nullptr) noexcept;

  // ---- GID table and link state (layout::PortNet, gid_table.h). Lock-free
  // readers: safe from any process and thread, at connect/AH-creation time
  // and per UD send alike (a copy of ~450 bytes, no system call).
  // The live record of a port: 0, EINVAL (no such port), EAGAIN (a writer
  // died mid-update and nobody repaired it yet).
  int port_net(uint32_t port, PortNetView* out) const noexcept;
  // port_net for control paths (query_port, sysfs, status, the daemon):
  // retries EAGAIN for up to 100 ms.
  int port_net_settled(uint32_t port, PortNetView* out) const noexcept;
  // Its seqlock value: unchanged since a snapshot means the snapshot still holds.
  uint32_t port_net_seq(uint32_t port) const noexcept;
  // Index of `gid` (type layout::GidType or kGidTypeAny) in the port's table.
  bool gid_index_of(uint32_t port, const uint8_t gid[16], uint8_t type_filter, uint32_t* index) const noexcept;
  // Writer (the command and the daemon): the interface as it is now (v.link
  // without kLinkAdminDown, ifmtu, speed_mbps, ifname, mac, the GID table).
  // Under the registry lock this keeps the admin bit, derives active_mtu,
  // width/speed, phys_state and the port state (PortRecord::state), and
  // publishes it all through the seqlock. *change (optional) says what
  // changed, so the caller rewrites sysfs and raises the events.
  int update_port_net(uint32_t port, const PortNetView& v, PortNetChange* change = nullptr) noexcept;
  // Before a device's files go (`shmrdma down`): empties every GID table and
  // takes the ports down, so that processes still mapping the old registry
  // (a cached GID lookup) stop matching it.
  void retire() noexcept;
  // The mapped segment (tests that damage it on purpose). Never null while
  // valid().
  const layout::RegistrySegment* segment() const noexcept { return seg(); }

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
  void write_net_locked(uint32_t port, PortNetView v, PortNetChange* change) noexcept;  // caller holds the lock

  Mapping map_;
  DevicePaths paths_;
  layout::DeviceRecord device_{};
};

}  // namespace shmrdma
