// Peers: other contexts on the same device whose segments this context maps
// to consume their receive queues and produce into their completion queues.
//
// Everything read through a Peer is untrusted: geometry is recomputed
// privately, every table index is bounds-checked, every ring is validated
// against the segment before it is attached.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "layout.h"
#include "mapped.h"
#include "registry.h"
#include "ring.h"
#include "segment.h"

namespace shmrdma {

struct HomeDevice;  // directory.h

// The last ring a caller attached through Peer::ring, to skip validating
// the same geometry again (a QP's target receive queue and CQ). Keyed by the
// peer object's stamp (Peer::stamp, unique in the process; a Peer's mapping,
// slot and generation are set once when it is made, so the stamp implies
// them; an empty cache has 0, which no Peer has) and the untrusted values
// the view was built from that decide where its slots are: offset, capacity
// and stride. (bytes follows from capacity and stride in every ring that
// validates: Peer::ring requires bytes == Ring::bytes_for(capacity, stride).)
// Private to its user (the QP's send lock).
//
// A CQ's producers also keep here how far that ring is known to be free
// (cq_push.h push_slot, Ring::try_reserve_within): positions before `room`
// were given back by the consumer, for the ring of CQ entry room_entry in
// its epoch room_epoch (CqEntry::ring_epoch). A view validated afresh knows
// nothing (room_entry nullptr).
struct RingCache {
  uint64_t stamp = 0;  // the Peer the view points into
  uint64_t offset = 0;
  uint32_t capacity = 0, stride = 0;
  Ring ring;
  const void* room_entry = nullptr;
  uint32_t room_epoch = 0, room = 0;
};

// A number no other Peer object of this process has had (never 0): caches
// keyed by it cannot mistake a new Peer at a freed one's address for it.
inline uint64_t next_peer_stamp() noexcept {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

struct Peer {
  Peer() = default;
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  ~Peer();
  // A peer is named by (device, context slot): its device's registry holds
  // the slot, and the QPNs it hands out are unique only there.
  HomeDevice* device = nullptr;  // owned by the context's DeviceDirectory (outlives every Peer use)
  Registry* registry = nullptr;  // device's registry
  uint32_t home_id = 0;          // device's DeviceRecord::home_id
  uint32_t slot = 0;
  uint32_t generation = 0;
  const uint64_t stamp = next_peer_stamp();  // this object's identity (next_peer_stamp)
  pid_t pid = 0;
  uint64_t start_time = 0;
  bool self_process = false;  // the peer lives in this process: plain memcpy
  Mapping map;                // empty when the peer is this very context
  char* base = nullptr;       // segment base (ours or the mapping's)
  uint64_t size = 0;
  layout::ContextLayout layout{};
  std::string async_path;       // the peer's async event FIFO
  int async_fd = -1;            // opened on first use
  std::once_flag async_once_;
  PeerMappings mappings;        // the peer's mapped-tier MRs we mapped
  std::atomic<bool> premapped{false};  // premap_regions ran
  std::string segment_path;     // the peer's segment file; its channels are <segment_path>.chan<N>
  std::mutex chan_mu_;          // guards chan_fds_
  std::map<uint32_t, std::pair<uint32_t, int>> chan_fds_;  // number -> (CqEntry channel value, fd)

  // Maps the peer's live mapped-tier regions now, once per Peer (a QP
  // connecting to it: modify_qp to RTR), so that the first operations into
  // them do not pay for the mapping in the data path (best effort; peer.cc).
  void premap_regions() noexcept;
  // Raises an async event in the peer's context (best effort).
  void raise_async(uint32_t event_type, uint64_t token) noexcept;
  // Writes a token (channel.h) to the peer's completion channel named by a
  // CqEntry `channel` value (best effort; cq.cc). True when written.
  bool notify_channel(uint32_t channel, uint64_t token) noexcept;

  template <typename T>
  T* entry(uint64_t table, uint32_t index, uint32_t slots) const noexcept {
    if (index >= slots) return nullptr;
    return reinterpret_cast<T*>(base + table) + index;
  }
  layout::QpEntry* qp(uint32_t index) const noexcept {
    return entry<layout::QpEntry>(layout.qp_table, index, layout.qp_slots);
  }
  layout::CqEntry* cq(uint32_t index) const noexcept {
    return entry<layout::CqEntry>(layout.cq_table, index, layout.cq_slots);
  }
  layout::MrEntry* mr(uint32_t index) const noexcept {
    return entry<layout::MrEntry>(layout.mr_table, index, layout.mr_slots);
  }
  layout::SrqEntry* srq(uint32_t index) const noexcept {
    return entry<layout::SrqEntry>(layout.srq_table, index, layout.srq_slots);
  }
  // A ring described by untrusted values: attached only when the geometry
  // is valid and the whole ring lies inside this segment's heap.
  bool ring(uint64_t offset, uint64_t bytes, uint32_t capacity, uint32_t stride, Ring* out) const noexcept;
  // The same, answered from *cache when it holds this very ring (nullptr: no
  // cache): the cached view itself (*out is not written then) or, when it
  // does not, *out validated afresh (and cached). nullptr when the geometry
  // does not validate.
  Ring* ring(uint64_t offset, uint64_t bytes, uint32_t capacity, uint32_t stride, Ring* out,
             RingCache* cache) const noexcept {
    if (cache && cache->stamp == stamp && cache->offset == offset && cache->capacity == capacity &&
        cache->stride == stride) [[likely]]
      return &cache->ring;
    if (!ring(offset, bytes, capacity, stride, out)) return nullptr;
    if (cache) *cache = RingCache{stamp, offset, capacity, stride, *out};
    return out;
  }
  // Still the same process that we mapped (pid + start time)?
  bool alive() const noexcept;
};

class PeerCache {
 public:
  // Finds (maps on first use) the context in slot `slot` of device `dev`'s
  // registry (each HomeDevice has its own cache). `self` describes this
  // context so that a QP connected to its own context needs no second
  // mapping. Returns nullptr when the slot is free, the segment does not
  // validate, or the process is gone.
  std::shared_ptr<Peer> get(HomeDevice& dev, uint32_t slot, const Peer& self) noexcept;

 private:
  std::mutex mu_;
  std::map<uint32_t, std::shared_ptr<Peer>> peers_;
};

}  // namespace shmrdma
