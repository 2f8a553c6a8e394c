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

// The private counting state of one QP (in Qp; touched under its send lock).
// A port number no device has: group() returns nothing for it (rport of a
// destination on another device of the home, which is not counted here).
inline constexpr uint8_t kNotCounted = 0xff;

struct QpCounting {
  layout::QpCounterRecord* rec = nullptr;
  uint8_t port = 1;        // the QP's port (group kGroupLocal)
  uint8_t rport = 1;       // RC/UC/XRC: the port the path's DLID names (group kGroupRemote)
  uint8_t mtu_shift = 12;  // log2 of the path MTU (UD: 4096)
  uint64_t rnr_wait = 0;   // start of the RNR wait whose NAKs are counted
  uint64_t rnr_naks = 0;   // NAKs counted in that wait
};

// One context's side of the counters: its block and its QP records.
class CounterSink {
 public:
  void attach(layout::ContextCounters* block, layout::QpCounterRecord* records, uint32_t slots,
              const layout::DeviceRecord& dev) noexcept;
  uint32_t nports() const noexcept { return nports_; }
  // The port whose LID is `lid`, 0 for none.
  uint32_t lid_port(uint16_t lid) const noexcept {
    for (uint32_t p = 0; p < nports_; ++p)
      if (lids_[p] == lid) return p + 1;
    return 0;
  }
  // The counters of group g of record r, counting for `port` (folded first
  // when the group counted for another port); nullptr for an invalid port.
  std::atomic<uint64_t>* group(layout::QpCounterRecord* r, uint32_t g, uint32_t port) noexcept {
    if (r->port[g].load(std::memory_order_relaxed) == port) [[likely]]
      return r->v[g];
    return switch_port(r, g, port);
  }
  // create_qp: the (zeroed) record of QP table index `index`.
  layout::QpCounterRecord* claim(uint32_t index) noexcept;
  // destroy_qp: folds the record into the block and zeroes it.
  void fold_record(layout::QpCounterRecord* r) noexcept;
  // Everything this context counted (close): block + records.
  std::vector<PortCounters> totals() const noexcept;

 private:
  std::atomic<uint64_t>* switch_port(layout::QpCounterRecord* r, uint32_t g, uint32_t port) noexcept;
  void fold_group_locked(layout::QpCounterRecord* r, uint32_t g) noexcept;
  layout::ContextCounters* block_ = nullptr;
  layout::QpCounterRecord* records_ = nullptr;
  uint32_t slots_ = 0, nports_ = 0;
  uint16_t lids_[limits::kMaxPorts] = {};
  std::mutex mu_;  // folds (the seqlock's writer side)
};

// Adds one context's counts (its block and records [0, qp_hwm), ports
// outside [1, nports] skipped) to out[0, nports). The seqlock is retried a
// bounded number of times (a dead owner may have left it odd).
void sum_context_counters(const layout::ContextCounters* block, const layout::QpCounterRecord* records,
                          uint32_t slots, uint32_t nports, PortCounters* out) noexcept;
// Maps the context segment `path` (owner pid `pid`), checks its geometry and
// adds its counts. 0, or an errno (EPROTO: the segment does not validate).
int sum_context_file(const std::string& path, uint32_t pid, uint32_t nports, PortCounters* out) noexcept;

}  // namespace shmrdma
