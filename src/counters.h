// Per-port counters: where they are kept, how they are folded, how they are
// summed. The layout (Counter, QpCounterRecord, ContextCounters, the
// registry's port_counters) is in layout.h; the data-path hooks in count.h.
//
// Design. The data path costs ~100 ns per message, so counting must not add
// an atomic read-modify-write, a lock or a system call there:
//  - Each QP has a counter record in its owner's segment (a table of its own,
//    indexed like the QP table, cache-line aligned), written only by the
//    owner while it holds the QP's send lock: every transport.cc hook runs
//    under it (progress -> execute / execute_ud / deliver, complete_send).
//    So an update is a relaxed load and a relaxed store (two plain movs) on
//    a line nobody else writes, while readers in other processes may load it
//    at any time (atomics: no torn values).
//  - The initiator executes both ends, so it counts both: group kGroupLocal
//    for its own port, group kGroupRemote for the port the destination lives
//    on. A group counts for one port at a time; a message for another port
//    (UD address handles to several ports, multicast members on different
//    ports) first folds the group into the context's per-port block (rare
//    path, under a private lock, fetch_add, seqlock for readers).
//  - Destroying a QP folds its record into that block. Closing a context
//    folds the context's totals into the registry's per-port totals (under
//    the registry lock, in the same critical section that frees the slot);
//    reclaiming a dead process's context does the same from its segment
//    before the file is removed. So nothing is lost and nothing is counted
//    twice by a reader that sums under the registry lock:
//      registry totals + every live context's block + its QP records.
//  - A destination on another device of the home (RC/UC/UD peers found by
//    LID or GID there, the pod-to-pod case) is counted for that device's
//    port: the group is labelled foreign_label(home_id, port) + device_tag
//    (layout.h QpCounterRecord), its folds go to that device's
//    RegistrySegment::foreign_counters (fetch_add, rare path), and a reader
//    of that device adds foreign_counters and the matching groups of every
//    live context of the other devices (add_foreign_counters). Counts still
//    in the records of a sender killed with SIGKILL are lost for the other
//    device (its reclaim folds only its own device's ports).
// Counts read from another process's segment are untrusted numbers: port
// values outside the device's ports are skipped, the record count is
// clamped to the table, and nothing read is used to index memory otherwise.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "layout.h"

namespace shmrdma {

// Counts of one port, summed.
struct PortCounters {
  uint64_t v[layout::kCounters] = {};
  PortCounters& operator+=(const PortCounters& o) noexcept {
    for (uint32_t i = 0; i < layout::kCounters; ++i) v[i] += o.v[i];
    return *this;
  }
};

// A counter as tools show it: sysfs file name and value.
struct NamedCounter {
  std::string name;
  uint64_t value;
};
// ports/N/counters (IB PortCounters names; port_*_data in 4-octet units).
std::vector<NamedCounter> ib_counters(const PortCounters& c);
// ports/N/hw_counters (rxe's names, then ours).
std::vector<NamedCounter> hw_counters(const PortCounters& c);

// Labels of a group (QpCounterRecord::port): 1..kMaxPorts a port of the own
// device; foreign_label(home_id, port) port `port` of device home_id of the
// home, with the tag of that device's incarnation (a recreated device may
// reuse the home id).
inline constexpr uint32_t foreign_label(uint32_t home_id, uint32_t port) { return home_id << 8 | (port & 0xff); }
inline constexpr bool is_foreign_label(uint32_t label) { return label > 0xff; }
inline constexpr uint32_t label_home_id(uint32_t label) { return label >> 8; }
inline constexpr uint32_t label_port(uint32_t label) { return label & 0xff; }
inline uint32_t device_tag(const layout::DeviceRecord& d) noexcept {
  const uint64_t t = d.created_unix_ns;
  const uint32_t v = static_cast<uint32_t>(t ^ (t >> 32));
  return v ? v : 1;
}

// A label no device has: group() returns nothing for it.
inline constexpr uint32_t kNotCounted = 0;

struct HomeDevice;
class DeviceDirectory;

// The private counting state of one QP (in Qp; touched under its send lock).
struct QpCounting {
  layout::QpCounterRecord* rec = nullptr;
  uint8_t port = 1;        // the QP's port (group kGroupLocal)
  uint8_t mtu_shift = 12;  // log2 of the path MTU (UD: 4096)
  uint8_t dlid_port = 0;   // the port of ours the path's DLID names (0: none)
  // RC/UC/XRC (group kGroupRemote): the label of the destination's port
  // (the port the path's DLID names, or a foreign label), for the peer
  // device rdev it was made for (count::sent relabels when Qp::peer_dev
  // changes: paths resolved later, on the data path).
  uint32_t rport = 1, rtag = 0;
  const HomeDevice* rdev = nullptr;
  uint64_t rnr_wait = 0;   // start of the RNR wait whose NAKs are counted
  uint64_t rnr_naks = 0;   // NAKs counted in that wait
  // count::sent_rc's groups (kGroupLocal for port, kGroupRemote for rport
  // and rtag) once group() returned both for them; cleared by relabel and
  // when Qp::peer_dev changes (Qp::set_peer_dev), so that count::fast_groups
  // need not compare rdev.
  // Only this QP's send side switches its record's labels (RC/UC count in
  // these two alone), so they stay the groups group() would return.
  std::atomic<uint64_t>* fast_local = nullptr;
  std::atomic<uint64_t>* fast_remote = nullptr;
};

// One context's side of the counters: its block and its QP records.
class CounterSink {
 public:
  // dir: the context's directory (foreign folds find their device there).
  void attach(layout::ContextCounters* block, layout::QpCounterRecord* records, uint32_t slots,
              const layout::DeviceRecord& dev, DeviceDirectory* dir) noexcept;
  uint32_t nports() const noexcept { return nports_; }
  // The port whose LID is `lid`, 0 for none.
  uint32_t lid_port(uint16_t lid) const noexcept {
    for (uint32_t p = 0; p < nports_; ++p)
      if (lids_[p] == lid) return p + 1;
    return 0;
  }
  // The counters of group g of record r, counting for `label` (a port of
  // ours, or a foreign label with its device's `tag`; folded first when the
  // group counted for another); nullptr for an invalid label.
  std::atomic<uint64_t>* group(layout::QpCounterRecord* r, uint32_t g, uint32_t label, uint32_t tag = 0) noexcept {
    if (r->port[g].load(std::memory_order_relaxed) == label &&
        (!is_foreign_label(label) || r->tag[g].load(std::memory_order_relaxed) == tag)) [[likely]]
      return r->v[g];
    return switch_port(r, g, label, tag);
  }
  // create_qp: the (zeroed) record of QP table index `index`.
  layout::QpCounterRecord* claim(uint32_t index) noexcept;
  // destroy_qp: folds the record into the block and zeroes it.
  void fold_record(layout::QpCounterRecord* r) noexcept;
  // Close: folds every group counting for another device into that
  // device's foreign_counters; the home ids of the devices folded into.
  std::vector<uint32_t> fold_foreign() noexcept;
  // Everything this context counted for its own device (close): block +
  // records (foreign groups excluded).
  std::vector<PortCounters> totals() const noexcept;

 private:
  std::atomic<uint64_t>* switch_port(layout::QpCounterRecord* r, uint32_t g, uint32_t label, uint32_t tag) noexcept;
  void fold_group_locked(layout::QpCounterRecord* r, uint32_t g) noexcept;
  DeviceDirectory* dir_ = nullptr;
  layout::ContextCounters* block_ = nullptr;
  layout::QpCounterRecord* records_ = nullptr;
  uint32_t slots_ = 0, nports_ = 0;
  uint16_t lids_[limits::kMaxPorts] = {};
  std::mutex mu_;  // folds (the seqlock's writer side)
};

// The groups of another device's context that count for device `home_id`
// (tag: its device_tag): what sum_context_counters adds with a filter.
struct ForeignFilter {
  uint32_t home_id = 0, tag = 0;
};
// Adds one context's counts (its block and records [0, qp_hwm), ports
// outside [1, nports] skipped) to out[0, nports). The seqlock is retried a
// bounded number of times (a dead owner may have left it odd).
// With `foreign`: only the records' groups labelled for that device (by
// port of that device), the block not at all (it holds the owner's ports).
void sum_context_counters(const layout::ContextCounters* block, const layout::QpCounterRecord* records,
                          uint32_t slots, uint32_t nports, PortCounters* out,
                          const ForeignFilter* foreign = nullptr) noexcept;
// Maps the context segment `path` (owner pid `pid`), checks its geometry and
// adds its counts (those for `foreign` only, when given). 0, or an errno
// (EPROTO: the segment does not validate).
int sum_context_file(const std::string& path, uint32_t pid, uint32_t nports, PortCounters* out,
                     const ForeignFilter* foreign = nullptr) noexcept;

class Registry;
// Adds to out[0, ports of x) what the contexts of the other devices of x's
// home counted for x's ports: x's foreign_counters and the foreign groups
// of their live contexts' QP records (a snapshot: retried while a fold
// moves counts between the two). Control path (maps every other device's
// registry and contexts).
void add_foreign_counters(Registry& x, std::vector<PortCounters>* out) noexcept;

}  // namespace shmrdma
