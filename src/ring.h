// SPDX-License-Identifier: MIT
//
// ring.h - bounded MPMC ring in shared memory (Vyukov-style, per-slot
// sequence numbers) used for receive queues, shared receive queues and
// completion queues of the shmrdma software RDMA device.
//
// ---------------------------------------------------------------------------
// TRUST BOUNDARY
// ---------------------------------------------------------------------------
// Two kinds of memory are involved and they are trusted very differently:
//
//   * RingShared and the slot array live in a shared memory segment that is
//     mapped by several processes. Any of those processes may be buggy,
//     hostile or may have crashed half-way through an operation, so EVERY
//     byte there is UNTRUSTED: the indices, the sequence numbers and the
//     payloads.
//   * Ring (the "view") lives in private memory. It holds the ring geometry
//     (capacity, mask, stride, pointers) copied from the caller's trusted,
//     already validated description. Geometry is never read back from shared
//     memory.
//
// Consequences, which every function below upholds:
//   * every index read from shared memory is masked with the PRIVATE mask
//     before it is used to address a slot, so no operation can touch memory
//     outside the slot array, whatever a peer writes;
//   * every loop is bounded (at most kMaxAttempts iterations); an operation
//     that cannot make progress reports RingStatus::contended instead of
//     spinning, so a peer cannot hang us by scribbling on the ring;
//   * a corrupted sequence number or index can make operations fail (full,
//     empty, contended) or hand out a slot whose payload is garbage or is
//     being written concurrently by someone else. Callers must therefore
//     treat payload bytes as untrusted input: copy them to private memory
//     once (try_pop does this) and validate the copy, never re-read shared
//     bytes after validating them.
//
// Persistent `contended` on an otherwise idle ring means the shared state is
// corrupted; callers may choose to move the owning queue to an error state.
//
// ---------------------------------------------------------------------------
// WHO MAY CALL WHAT
// ---------------------------------------------------------------------------
//   * Ring::format   - the OWNER of the segment only, before the ring is made
//                      visible to anybody else (publication must go through a
//                      synchronising mechanism: fd passing, a mutex, an
//                      acquire/release flag in the segment header, ...).
//   * Ring::attach   - any process, with geometry it obtained from a trusted
//                      source (its own records or a validated handshake).
//   * producer side  - try_reserve / publish / try_push: any number of
//                      producers concurrently (MPMC-safe).
//                      try_reserve_sp: only when the caller guarantees that it
//                      is the ONLY producer at this moment (e.g. a receive
//                      queue's owner holding its local post mutex). Must not
//                      run concurrently with try_reserve/try_push.
//   * consumer side  - try_claim / release / try_pop: any number of consumers
//                      concurrently (e.g. peers taking receive WQEs).
//                      try_claim_sc: only when the caller is the ONLY consumer
//                      (e.g. the completion queue owner holding its poll lock).
//                      Must not run concurrently with try_claim/try_pop.
//                      try_claim_announced / release_cas: consumers that
//                      may die while they hold a slot; claimed_unreleased +
//                      release_cas: whoever adopts such a slot. A ring where
//                      slots may be adopted releases with release_cas only.
//   * peek_ready / size_approx / capacity - anybody, any time (advisory).
//
// A reserved slot must eventually be published, and a claimed slot released;
// until then the ring stalls at that slot (this is what makes in-place,
// zero-copy access possible). If a peer dies while holding a slot the ring
// stays stalled at that position: recovery is the job of the queue layer
// (skip_unpublished_sc for producers; claimed_unreleased + release_cas for
// consumers that announced their claims).
//
// ---------------------------------------------------------------------------
// ALGORITHM AND MEMORY ORDERING
// ---------------------------------------------------------------------------
// Positions are free-running u32 counters; slot index = pos & mask. Slot i's
// `seq` encodes its state for the lap in which position `pos` maps to it:
//     seq == pos                 -> free, a producer at `pos` may fill it
//     seq == pos + 1             -> full, a consumer at `pos` may take it
//     seq == pos + capacity      -> released, free for position pos+capacity
// Distances are computed as int32 differences so u32 wrap-around (indices
// crossing 2^32) is harmless as long as capacity is far below 2^31.
//
// The producer/consumer indices are only "ticket dispensers": exclusivity of
// a slot comes from the atomicity of the CAS (or, in the single-side fast
// paths, from the caller's exclusivity), and all data visibility is carried
// by the per-slot `seq`. That is why every index operation is relaxed and
// only `seq` uses acquire/release. The pairs are:
//
//   R1  publish():        seq.store(pos + 1, release)
//       - makes the producer's payload writes visible to the consumer.
//   A1  try_claim*():     seq.load(acquire)            pairs with R1
//   R2  release():        seq.store(pos + capacity, release)
//       - orders the consumer's payload reads before the next-lap producer's
//         payload writes (no consumer can read a half-overwritten slot).
//   A2  try_reserve*():   seq.load(acquire)            pairs with R2
//                         (for the very first lap it pairs with whatever
//                         mechanism published the formatted ring)
//
// Everything else is memory_order_relaxed, each with a comment saying why.
// ---------------------------------------------------------------------------
#pragma once

#include <atomic>
#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>

namespace shmrdma {

// Cache line size assumed for the shared layout. Fixed (not
// std::hardware_destructive_interference_size) because the layout is an ABI
// shared by separately compiled processes and must not depend on -mtune.
inline constexpr std::size_t kRingCacheLine = 64;

// Smallest power of two >= v, with total, documented behaviour at the edges:
//   round_up_pow2(0)            == 1  (1 is the smallest power of two; a
//                                      request for "nothing" still has to be
//                                      clamped to a real capacity by the
//                                      caller, see Ring::capacity_for)
//   round_up_pow2(v > 2^31)     == 0  (no u32 power of two is >= v; 0 is
//                                      never a valid capacity, so the error
//                                      propagates instead of silently
//                                      wrapping - std::bit_ceil would be UB)
constexpr uint32_t round_up_pow2(uint32_t v) noexcept {
  if (v <= 1) return 1;
  if (v > (uint32_t{1} << 31)) return 0;
  return std::bit_ceil(v);
}

// ---------------------------------------------------------------------------
// Shared-memory layout (ABI between processes)
// ---------------------------------------------------------------------------

// Ring header in shared memory. The two indices are written by different
// parties (producers vs consumers), so each gets its own cache line to avoid
// false sharing between them.
struct RingShared {
  alignas(kRingCacheLine) std::atomic<uint32_t> producer_pos;
  alignas(kRingCacheLine) std::atomic<uint32_t> consumer_pos;
};

// Start of every slot. `reserved` keeps the payload 8-byte aligned so WQEs /
// CQEs containing u64 fields can be accessed in place; nobody reads it, and
// only Ring::own_line writes it (0).
struct RingSlotHeader {
  std::atomic<uint32_t> seq;
  uint32_t reserved;
};

inline constexpr std::size_t kRingSlotHeaderBytes = sizeof(RingSlotHeader);

static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "cross-process rings need lock-free atomics: a lock-based "
              "std::atomic uses a process-local lock table, which does not "
              "synchronise with other processes mapping the same memory");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  alignof(std::atomic<uint32_t>) == alignof(uint32_t),
              "std::atomic<uint32_t> must have the representation of a plain "
              "uint32_t so every process agrees on the shared layout");
static_assert(std::is_standard_layout_v<RingShared>,
              "RingShared is a cross-process ABI: it must be standard-layout "
              "so offsetof is meaningful and the layout is predictable");
static_assert(std::is_trivially_destructible_v<RingShared>,
              "shared memory is unmapped, never destroyed: RingShared must "
              "not need a destructor");
static_assert(alignof(RingShared) == kRingCacheLine,
              "RingShared must be cache-line aligned so its index lines are "
              "not shared with neighbouring data");
static_assert(offsetof(RingShared, producer_pos) == 0,
              "shared ABI: producer index is at offset 0");
static_assert(offsetof(RingShared, consumer_pos) == kRingCacheLine,
              "shared ABI: consumer index must be on its own cache line "
              "(no false sharing between producers and consumers)");
static_assert(sizeof(RingShared) == 2 * kRingCacheLine,
              "shared ABI: RingShared is exactly two cache lines, so slots "
              "placed right after it stay cache-line aligned");
static_assert(std::is_standard_layout_v<RingSlotHeader>,
              "RingSlotHeader is a cross-process ABI and must be "
              "standard-layout");
static_assert(std::is_trivially_destructible_v<RingSlotHeader>,
              "slot headers live in shared memory and are never destroyed");
static_assert(offsetof(RingSlotHeader, seq) == 0,
              "shared ABI: every slot begins with its sequence number");
static_assert(sizeof(RingSlotHeader) == 8 && alignof(RingSlotHeader) == 4,
              "shared ABI: slot header is 8 bytes, payload starts at offset "
              "8 and is therefore 8-byte aligned");

// ---------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------

enum class RingStatus : uint8_t {
  ok,
  full,       // producer side: the next slot is not yet released
  empty,      // consumer side: the next slot is not yet published
  contended,  // gave up after kMaxAttempts (heavy contention or corruption)
  invalid,    // bad argument (e.g. length larger than the payload)
  abandoned,  // try_push_cas: the consumer skipped our slot before we published
};

// A reserved (producer) or claimed (consumer) slot. `payload` points into
// shared memory and has Ring::payload_size() bytes; `pos` is the ring
// position and is what publish()/release() need.
struct RingHandle {
  std::byte* payload = nullptr;
  uint32_t pos = 0;
};

struct [[nodiscard]] RingResult {
  RingStatus status = RingStatus::invalid;
  RingHandle handle{};
  constexpr explicit operator bool() const noexcept {
    return status == RingStatus::ok;
  }
};

// ---------------------------------------------------------------------------
// Private view
// ---------------------------------------------------------------------------

class Ring {
 public:
  // Capacity 1 is not supported: with a single slot "published for pos"
  // (seq == pos+1) and "free for pos+1" (seq == pos+1) are indistinguishable.
  static constexpr uint32_t kMinCapacity = 2;
  // Keeps the signed distance arithmetic far from ambiguity (needs
  // capacity < 2^31) and bounds a ring's shared footprint.
  static constexpr uint32_t kMaxCapacity = uint32_t{1} << 24;
  // Slot stride: any multiple of 64 in [kMinStride, kMaxStride]; it need NOT
  // be a power of two (slot address is computed by multiplication).
  static constexpr uint32_t kMinStride = kRingCacheLine;
  static constexpr uint32_t kMaxStride = uint32_t{1} << 16;
  // Upper bound on loop iterations of a single try_* call.
  static constexpr unsigned kMaxAttempts = 128;

  static constexpr bool valid_geometry(uint32_t capacity,
                                       uint32_t stride) noexcept {
    return capacity >= kMinCapacity && capacity <= kMaxCapacity &&
           (capacity & (capacity - 1)) == 0 && stride >= kMinStride &&
           stride <= kMaxStride && stride % kRingCacheLine == 0;
  }

  // Capacity to use for a request of `requested` entries: rounded up to a
  // power of two and at least kMinCapacity; 0 if it would exceed kMaxCapacity.
  static constexpr uint32_t capacity_for(uint32_t requested) noexcept {
    const uint32_t c =
        round_up_pow2(requested < kMinCapacity ? kMinCapacity : requested);
    return (c == 0 || c > kMaxCapacity) ? 0 : c;
  }

  // Bytes of the slot array alone (for slots placed anywhere); 0 if the
  // geometry is invalid. Cannot overflow: <= 2^24 * 2^16 = 2^40.
  static constexpr std::size_t slot_bytes_for(uint32_t capacity,
                                              uint32_t stride) noexcept {
    if (!valid_geometry(capacity, stride)) return 0;
    return std::size_t{capacity} * std::size_t{stride};
  }

  // Bytes for the contiguous layout [RingShared][slots...] (see slots_after);
  // 0 if the geometry is invalid.
  static constexpr std::size_t bytes_for(uint32_t capacity,
                                         uint32_t stride) noexcept {
    const std::size_t s = slot_bytes_for(capacity, stride);
    return s == 0 ? 0 : sizeof(RingShared) + s;
  }

  // Slot array location in the contiguous layout.
  static std::byte* slots_after(RingShared* shared) noexcept {
    return reinterpret_cast<std::byte*>(shared) + sizeof(RingShared);
  }

  // Initialise a new ring. OWNER ONLY, before the ring is visible to anyone
  // else. `shared` and `slots` must be 64-byte aligned and `slots` must
  // provide slot_bytes_for(capacity, stride) bytes. `initial_pos` lets tests
  // start the free-running indices anywhere (e.g. just below 2^32); normal
  // users leave it at 0. Returns nullopt on invalid arguments.
  static std::optional<Ring> format(RingShared* shared, void* slots,
                                    uint32_t capacity, uint32_t stride,
                                    uint32_t initial_pos = 0) noexcept {
    if (!valid_arguments(shared, slots, capacity, stride)) return std::nullopt;
    Ring r(shared, slots, capacity, stride);
    // Relaxed: nobody else can see the ring yet; the caller's publication
    // mechanism provides the happens-before edge towards other parties.
    std::construct_at(shared);
    shared->producer_pos.store(initial_pos, std::memory_order_relaxed);
    shared->consumer_pos.store(initial_pos, std::memory_order_relaxed);
    // Position initial_pos + k (k < capacity) is the first-lap position of
    // slot (initial_pos + k) & mask, and "free for pos" means seq == pos.
    for (uint32_t k = 0; k < capacity; ++k) {
      const uint32_t pos = initial_pos + k;
      RingSlotHeader* h = std::construct_at(
          reinterpret_cast<RingSlotHeader*>(r.slot_addr(pos)));
      h->seq.store(pos, std::memory_order_relaxed);  // see above
    }
    return r;
  }

  // View of an existing ring. Geometry comes from the caller's TRUSTED
  // private records, never from shared memory. Only cheap sanity checks are
  // done here; returns nullopt if they fail.
  static std::optional<Ring> attach(RingShared* shared, void* slots,
                                    uint32_t capacity,
                                    uint32_t stride) noexcept {
    if (!valid_arguments(shared, slots, capacity, stride)) return std::nullopt;
    return Ring(shared, slots, capacity, stride);
  }

  // A detached view; only assignment and attached() are meaningful on it.
  Ring() noexcept = default;

  bool attached() const noexcept { return shared_ != nullptr; }
  uint32_t capacity() const noexcept { return capacity_; }
  uint32_t stride() const noexcept { return stride_; }
  std::size_t payload_size() const noexcept {
    return attached() ? stride_ - kRingSlotHeaderBytes : 0;
  }

  // ---------------------------------------------------------------- producer

  // Reserve the next slot for writing (MPMC-safe). On success write up to
  // payload_size() bytes at handle.payload, then publish(handle).
  RingResult try_reserve() const noexcept {
    assert(attached());
    // Relaxed: the index is only a hint of where to look; whether the slot
    // is really free is decided by its seq (A2) and the CAS below.
    uint32_t pos = shared_->producer_pos.load(std::memory_order_relaxed);
    for (unsigned attempt = 0; attempt < kMaxAttempts; ++attempt) {
      RingSlotHeader* h = header(pos);
      // A2 pairs with R2: the previous lap's consumer has finished reading
      // before we may overwrite the payload.
      const uint32_t seq = h->seq.load(std::memory_order_acquire);
      const int32_t dist = distance(seq, pos);
      if (dist == 0) {
        // Relaxed (success and failure): the CAS only hands out the ticket;
        // RMW atomicity makes it unique, data ordering is carried by seq.
        // On failure `pos` is refreshed with the current index.
        if (shared_->producer_pos.compare_exchange_weak(
                pos, pos + 1, std::memory_order_relaxed,
                std::memory_order_relaxed)) {
          return {RingStatus::ok, handle_at(h, pos)};
        }
      } else if (dist < 0) {
        // The slot still holds an item of the previous lap.
        return {RingStatus::full, {}};
      } else {
        // Another producer already took `pos`; catch up. Relaxed: hint only.
        pos = shared_->producer_pos.load(std::memory_order_relaxed);
      }
    }
    return {RingStatus::contended, {}};
  }

  // Single-producer fast path: no CAS. The caller guarantees no other
  // producer (of either kind) runs concurrently on this ring.
  RingResult try_reserve_sp() noexcept {
    assert(attached());
    // Relaxed: we are the only writer of producer_pos, so coherence gives us
    // our own last store (or whatever an earlier, externally synchronised
    // producer stored).
    const uint32_t pos = shared_->producer_pos.load(std::memory_order_relaxed);
    RingSlotHeader* h = header(pos);
    // A2 pairs with R2 (see try_reserve).
    const uint32_t seq = h->seq.load(std::memory_order_acquire);
    const int32_t dist = distance(seq, pos);
    if (dist == 0) {
      // Relaxed: consumers never read producer_pos for correctness (only
      // size_approx does, advisorily); publication is via seq (R1).
      shared_->producer_pos.store(pos + 1, std::memory_order_relaxed);
      return {RingStatus::ok, handle_at(h, pos)};
    }
    if (dist < 0) return {RingStatus::full, {}};
    // Slot is ahead of the only producer: exclusivity was violated or the
    // shared state is corrupted. Report it like unresolvable contention.
    return {RingStatus::contended, {}};
  }

  // Make a reserved slot visible to consumers.
  void publish(RingHandle h) noexcept {
    assert(attached());
    // R1: payload writes happen-before a consumer's A1 that reads pos + 1.
    header(h.pos)->seq.store(h.pos + 1, std::memory_order_release);
  }

  // Copy `len` bytes into the next slot (MPMC-safe).
  RingStatus try_push(const void* src, std::size_t len) noexcept {
    if (len > payload_size() || (src == nullptr && len != 0))
      return RingStatus::invalid;
    const RingResult r = try_reserve();
    if (!r) return r.status;
    if (len != 0) std::memcpy(r.handle.payload, src, len);
    publish(r.handle);
    return RingStatus::ok;
  }

  // Like try_push, for a ring whose single consumer may give up a slot a
  // producer reserved and never published (skip_unpublished_sc: the
  // producer died). Publication is a CAS on seq, so a producer that was only
  // slow learns that its slot was skipped (abandoned) and pushes again.
  RingStatus try_push_cas(const void* src, std::size_t len) const noexcept {
    if (len > payload_size() || (src == nullptr && len != 0))
      return RingStatus::invalid;
    const RingResult r = try_reserve();
    if (!r) return r.status;
    if (len != 0) std::memcpy(r.handle.payload, src, len);
    return publish_cas(r.handle);
  }

  // try_push_cas of an item of exactly N bytes that fits every slot a valid
  // geometry has (N <= kMinStride - header: a CQE, layout.h), written by
  // fill(payload) straight into the reserved slot: no length check, and the
  // producer builds its item there instead of copying it from a local one.
  // Its publication is seq_cst (on x86 the same lock cmpxchg as release):
  // a caller's seq_cst load after it is ordered after it without a fence
  // (the CQ producers' P4, cq_push.h). A fill that takes two arguments
  // also gets the reserved position: fill(payload, pos).
  template <std::size_t N, typename Fill>
  [[gnu::always_inline]] RingStatus try_push_cas_with(Fill&& fill) const noexcept {
    return fill_and_publish<N>(try_reserve(), fill);
  }

  // try_reserve for a producer that remembers how far this ring is known to
  // be free: *room, a position before which every slot was given back by
  // the consumer. A position in [*room - capacity, *room) is reserved
  // without reading its slot, whose line the consumer is polling, so the
  // producer's first touch of that line is the write of its item: one
  // cache-line transfer per push instead of two (the slot read shared, then
  // taken for writing). Otherwise *room is learnt again from consumer_pos,
  // which the single consumer stores (release) after it gave a slot back
  // (release_sc, skip_unpublished_sc): every position before consumer_pos +
  // capacity is free, and the acquire orders the consumer's reads of those
  // slots before our writes (as A2 does). A consumer_pos that is not at
  // most one lap behind the producers' position (untrusted), or by which
  // the ring is full, teaches nothing: then try_reserve reads the slot. The
  // caller keeps *room for this ring alone (the CQ producers: per entry and
  // ring epoch, cq_push.h push_slot).
  RingResult try_reserve_within(uint32_t* room) const noexcept {
    assert(attached());
    uint32_t pos = shared_->producer_pos.load(std::memory_order_relaxed);
    for (unsigned attempt = 0; attempt < kMaxAttempts; ++attempt) {
      if (*room - pos - 1 >= capacity_) {  // pos is not in [*room - capacity, *room)
        const uint32_t c = shared_->consumer_pos.load(std::memory_order_acquire);
        if (pos - c >= capacity_) return try_reserve();
        *room = c + capacity_;
      }
      // Relaxed, as try_reserve's: the CAS hands out the ticket.
      if (shared_->producer_pos.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed,
                                                      std::memory_order_relaxed))
        return {RingStatus::ok, handle_at(header(pos), pos)};
    }
    return {RingStatus::contended, {}};
  }

  // try_push_cas_with, reserving with try_reserve_within(room).
  template <std::size_t N, typename Fill>
  [[gnu::always_inline]] RingStatus try_push_cas_within(uint32_t* room, Fill&& fill) const noexcept {
    return fill_and_publish<N>(try_reserve_within(room), fill);
  }

  // The rest of both: fill the slot r reserved (r.status when none), then
  // publish it with the CAS.
  template <std::size_t N, typename Fill>
  [[gnu::always_inline]] RingStatus fill_and_publish(const RingResult& r, Fill& fill) const noexcept {
    static_assert(N <= kMinStride - kRingSlotHeaderBytes, "every valid slot holds it");
    assert(attached());
    if (!r) return r.status;
    if constexpr (std::is_invocable_v<Fill&, std::byte*, uint32_t>)
      fill(r.handle.payload, r.handle.pos);
    else
      fill(r.handle.payload);
    return publish_cas<std::memory_order_seq_cst>(r.handle);
  }

  // ---------------------------------------------------------------- consumer

  // Single consumer of a try_push_cas ring: when the next slot was reserved
  // by a producer (producer_pos is past it) but is not published, give it up
  // - mark it released for the next lap - and move on. The caller decides
  // when a slot has waited long enough. true when a slot was skipped.
  // before(pos) runs right before the slot is given up (its CAS), so that
  // whoever sees the slot given up also sees what before() wrote; a skip
  // that then fails was not one.
  template <typename Before>
  bool skip_unpublished_sc(Before&& before) noexcept {
    if (!head_reserved_unpublished()) return false;  // published, or nobody reserved it: just empty
    const uint32_t pos = shared_->consumer_pos.load(std::memory_order_relaxed);  // ours alone to move
    before(pos);
    // R2: the slot goes to the next lap; a late publisher's CAS fails.
    uint32_t seq = pos;
    if (!header(pos)->seq.compare_exchange_strong(seq, pos + capacity_, std::memory_order_acq_rel,
                                                  std::memory_order_relaxed))
      return false;
    shared_->consumer_pos.store(pos + 1, std::memory_order_relaxed);
    return true;
  }
  // Whether the single consumer's next slot is reserved by a producer
  // (producer_pos is past it) and not published: what skip_unpublished_sc
  // gives up. Advisory.
  bool head_reserved_unpublished() const noexcept {
    assert(attached());
    const uint32_t pos = shared_->consumer_pos.load(std::memory_order_relaxed);
    if (header(pos)->seq.load(std::memory_order_acquire) != pos) return false;  // published (or not ours to judge)
    return distance(shared_->producer_pos.load(std::memory_order_relaxed), pos) > 0;
  }
  // Where position pos's slot stands for that position: 0 published and not
  // taken, < 0 not published (free or reserved), > 0 given back (taken and
  // released, or given up by skip_unpublished_sc) or in a later lap.
  // Advisory.
  int32_t lap_of(uint32_t pos) const noexcept {
    assert(attached());
    return distance(header(pos)->seq.load(std::memory_order_acquire), pos + 1);
  }

  // Address of the slot for position pos (masked like every access), for
  // cache hints only: nothing may be read through it without the protocol.
  const void* slot_address(uint32_t pos) const noexcept { return slot_addr(pos); }

  // Where producers stand (a hint: the next slot a producer will fill).
  uint32_t producer_position() const noexcept {
    return shared_->producer_pos.load(std::memory_order_relaxed);
  }

  // Where the single consumer stands (to tell a stall from progress).
  uint32_t consumer_position() const noexcept {
    return shared_->consumer_pos.load(std::memory_order_relaxed);
  }

  // Claim the next published slot (MPMC-safe). On success read the payload
  // at handle.payload (untrusted bytes!), then release(handle).
  RingResult try_claim() noexcept {
    // Relaxed CAS: ticket only (see try_reserve).
    return claim([](uint32_t) {}, std::memory_order_relaxed);
  }

  // try_claim for a consumer that leaves a trace of what it claims (a
  // receive take, transport.cc): announce(pos) runs before every CAS attempt
  // on consumer_pos, so if the consumer dies the last position it announced
  // is the only one it may have claimed. Such a slot is given back with
  // release_cas, never release: whoever finds the consumer dead may adopt it
  // (claimed_unreleased + release_cas) and the loser of the CAS learns it.
  template <typename F>
  RingResult try_claim_announced(F&& announce) noexcept {
    // Release on success: the announcement is visible to whoever sees
    // consumer_pos past pos (claimed_unreleased).
    return claim(announce, std::memory_order_release);
  }

  // Claims exactly position pos (MPMC-safe): only when the consumer
  // position is pos and its slot is published for pos, so a stash of staged
  // receives (transport_staged.cc) takes exactly the WQEs promised. Release
  // the handle with release_cas (the ring's WQEs may be adopted).
  RingResult try_claim_at(uint32_t pos) noexcept {
    assert(attached());
    RingSlotHeader* h = header(pos);
    if (h->seq.load(std::memory_order_acquire) != pos + 1) return {RingStatus::empty, {}};  // A1 pairs with R1
    uint32_t expect = pos;
    if (!shared_->consumer_pos.compare_exchange_strong(expect, pos + 1, std::memory_order_release,
                                                       std::memory_order_relaxed))
      return {RingStatus::contended, {}};
    return {RingStatus::ok, handle_at(h, pos)};
  }

  // try_claim_at for a consumer that no other consumer of positions up to
  // pos races with (their claims of later positions are CASes that read
  // what this stores): a plain store of the consumer position.
  RingResult try_claim_at_sc(uint32_t pos) noexcept {
    assert(attached());
    const RingSlotHeader* hdr = header(pos);
    if (hdr->seq.load(std::memory_order_acquire) != pos + 1 ||  // A1 pairs with R1
        shared_->consumer_pos.load(std::memory_order_relaxed) != pos)
      return {RingStatus::empty, {}};
    shared_->consumer_pos.store(pos + 1, std::memory_order_release);
    return {RingStatus::ok, handle_at(hdr, pos)};
  }

  // Whether position pos's slot is published for pos (full, or claimed and
  // not yet released), with its handle: the payload may be read (untrusted)
  // without claiming it. Advisory.
  bool published_at(uint32_t pos, RingHandle* h) const noexcept {
    assert(attached());
    const RingSlotHeader* hdr = header(pos);
    if (hdr->seq.load(std::memory_order_acquire) != pos + 1) return false;  // A1 pairs with R1
    *h = handle_at(hdr, pos);
    return true;
  }

  // Whether position pos is claimed and not released: its slot's seq is
  // pos + 1 (published for pos) and the consumer position is past pos (a
  // consumer took it). On true *h is its handle: the payload may be read
  // (untrusted) and the slot given back with release_cas, whose success is
  // the ownership decision. Anybody, any time; the answer is advisory. A seq
  // is pos + 1 only between the claim and the release of that lap, so a
  // slot found claimed at pos twice stayed claimed in between (up to the
  // 2^32 wrap of positions).
  bool claimed_unreleased(uint32_t pos, RingHandle* h) const noexcept {
    assert(attached());
    // A1 pairs with R1: the producer's payload is visible to the reader.
    const RingSlotHeader* hdr = header(pos);
    if (hdr->seq.load(std::memory_order_acquire) != pos + 1) return false;
    // Acquire pairs with the release of try_claim_announced's CAS.
    const int32_t d = distance(shared_->consumer_pos.load(std::memory_order_acquire), pos);
    if (d <= 0 || static_cast<uint32_t>(d) > capacity_) return false;  // not claimed (or nonsense)
    *h = handle_at(hdr, pos);
    return true;
  }

  // Single-consumer fast path: no CAS. The caller guarantees no other
  // consumer (of either kind) runs concurrently on this ring.
  RingResult try_claim_sc() noexcept {
    assert(attached());
    // Relaxed: sole writer of consumer_pos (see try_reserve_sp).
    const uint32_t pos = shared_->consumer_pos.load(std::memory_order_relaxed);
    RingSlotHeader* h = header(pos);
    // A1 pairs with R1 (see try_claim).
    const uint32_t seq = h->seq.load(std::memory_order_acquire);
    const int32_t dist = distance(seq, pos + 1);
    if (dist == 0) {
      // Relaxed: producers never read consumer_pos for correctness; the slot
      // is handed back to them by seq (R2).
      shared_->consumer_pos.store(pos + 1, std::memory_order_relaxed);
      return {RingStatus::ok, handle_at(h, pos)};
    }
    if (dist < 0) return {RingStatus::empty, {}};
    return {RingStatus::contended, {}};  // corrupted or exclusivity violated
  }

  // The single consumer's path without a handle (the CQ poller, which keeps
  // its position privately, so a peer that scribbles on consumer_pos cannot
  // move it): a cursor of the position and its slot's header, formed once by
  // slot_header and then moved along by next_header, so taking a slot
  // computes no address. published_for says whether the slot is published
  // for pos; the caller then reads the payload (untrusted) and gives the
  // slot back with release_sc, which also stores consumer_pos (for advisory
  // readers and recovery; it is never read back on this path).
  RingSlotHeader* slot_header(uint32_t pos) const noexcept { return header(pos); }
  // Starts bringing slot header h's cache line into this core's cache for
  // writing, ahead of a claim and release_cas of that slot: a store of 0 to
  // the header's `reserved` word, which nobody reads, so it changes nothing
  // the protocol can see. The store does not wait for the line (it waits in
  // the store buffer while the line comes), unlike an RMW on seq. A prefetch
  // does not do it: the build's generic x86-64 has no PREFETCHW, and on the
  // AMD EPYC VM we measure on PREFETCHW brought the line shared all the same,
  // so the release_cas still waited a cache-line hand-off for the ring
  // owner's copy (the one it kept from writing the WQE) to go.
  static void own_line(RingSlotHeader* h) noexcept {
    std::atomic_ref<uint32_t>(h->reserved).store(0, std::memory_order_relaxed);
  }
  // The header of the slot a handle names (its payload follows the header:
  // handle()), without the multiplication.
  static RingSlotHeader* slot_header_of(RingHandle h) noexcept {
    return reinterpret_cast<RingSlotHeader*>(h.payload - kRingSlotHeaderBytes);
  }
  // header(pos + 1) from h == header(pos), without the multiplication: still
  // inside the slot array, since the next slot is h + stride unless pos + 1
  // wraps to slot 0.
  RingSlotHeader* next_header(RingSlotHeader* h, uint32_t pos) const noexcept {
    return ((pos + 1) & mask_) != 0 ? reinterpret_cast<RingSlotHeader*>(reinterpret_cast<std::byte*>(h) + stride_)
                                    : reinterpret_cast<RingSlotHeader*>(slots_);
  }
  static bool published_for(const RingSlotHeader* h, uint32_t pos) noexcept {
    return h->seq.load(std::memory_order_acquire) == pos + 1;  // A1 pairs with R1
  }
  void release_sc(RingSlotHeader* h, uint32_t pos) const noexcept {
    h->seq.store(pos + capacity_, std::memory_order_release);  // R2, as release()
    // After the slot went back, for advisory readers and recovery
    // (skip_unpublished_sc, which starts from it); release: free on x86.
    shared_->consumer_pos.store(pos + 1, std::memory_order_release);
  }

  // Give a claimed slot back to producers.
  void release(RingHandle h) const noexcept {
    assert(attached());
    // R2: our payload reads happen-before a next-lap producer's A2.
    header(h.pos)->seq.store(h.pos + capacity_, std::memory_order_release);
  }

  // Give a claimed slot back with a CAS (pos + 1 -> pos + capacity): true
  // when this caller released it, false when it was no longer claimed at
  // h.pos (someone adopted it: see try_claim_announced). The payload read
  // before a successful release_cas belongs to this caller alone.
  bool release_cas(RingHandle h) noexcept {
    assert(attached());
    assert(h.payload == handle(h.pos).payload);
    uint32_t expect = h.pos + 1;
    // R2 on success (release); acquire so a failed caller sees why.
    return slot_header_of(h)->seq.compare_exchange_strong(expect, h.pos + capacity_, std::memory_order_acq_rel,
                                                          std::memory_order_acquire);
  }

  // Copy `len` bytes out of the next slot into private memory (MPMC-safe).
  RingStatus try_pop(void* dst, std::size_t len) noexcept {
    if (len > payload_size() || (dst == nullptr && len != 0))
      return RingStatus::invalid;
    const RingResult r = try_claim();
    if (!r) return r.status;
    if (len != 0) std::memcpy(dst, r.handle.payload, len);
    release(r.handle);
    return RingStatus::ok;
  }

  // ---------------------------------------------------------------- advisory

  // Whether the next slot is published, without claiming it. Advisory: by
  // the time the caller acts, another consumer may have taken it.
  bool peek_ready() const noexcept {
    assert(attached());
    // Relaxed (both): no payload is accessed on the strength of this answer;
    // an actual claim re-checks seq with acquire (A1).
    const uint32_t pos = shared_->consumer_pos.load(std::memory_order_relaxed);
    return header(pos)->seq.load(std::memory_order_relaxed) == pos + 1;
  }

  // peek_ready for a consumer that knows its position (the single consumer,
  // from its own private copy): reads the slot's seq alone, so an empty
  // poll touches one line of shared memory. Advisory, like peek_ready: a
  // stale position answers false.
  bool ready_at(uint32_t pos) const noexcept {
    assert(attached());
    // Relaxed: no payload is accessed on the strength of this answer.
    return header(pos)->seq.load(std::memory_order_relaxed) == pos + 1;
  }

  // Number of reserved-but-not-claimed positions, clamped to [0, capacity]
  // (indices are untrusted and the two loads are not a snapshot).
  uint32_t size_approx() const noexcept {
    assert(attached());
    // Relaxed: advisory value, no data is accessed because of it. Consumer
    // first so that, in a healthy ring, the difference is rarely negative.
    const uint32_t cons = shared_->consumer_pos.load(std::memory_order_relaxed);
    const uint32_t prod = shared_->producer_pos.load(std::memory_order_relaxed);
    const int32_t d = distance(prod, cons);
    if (d <= 0) return 0;
    return static_cast<uint32_t>(d) > capacity_ ? capacity_
                                                : static_cast<uint32_t>(d);
  }

 private:
  Ring(RingShared* shared, void* slots, uint32_t capacity,
       uint32_t stride) noexcept
      : shared_(shared),
        slots_(static_cast<std::byte*>(slots)),
        capacity_(capacity),
        mask_(capacity - 1),
        stride_(stride) {}

  // The MPMC claim loop of try_claim and try_claim_announced: announce(pos)
  // runs before every CAS on consumer_pos, which uses `success` as its order
  // on success (relaxed on failure: the refreshed position is a hint).
  template <typename F>
  RingResult claim(F&& announce, std::memory_order success) noexcept {
    assert(attached());
    // Relaxed: hint only, decided by seq (A1) and the CAS.
    uint32_t pos = shared_->consumer_pos.load(std::memory_order_relaxed);
    for (unsigned attempt = 0; attempt < kMaxAttempts; ++attempt) {
      RingSlotHeader* h = header(pos);
      // A1 pairs with R1: the producer's payload writes are visible.
      const uint32_t seq = h->seq.load(std::memory_order_acquire);
      const int32_t dist = distance(seq, pos + 1);
      if (dist == 0) {
        announce(pos);
        if (shared_->consumer_pos.compare_exchange_weak(pos, pos + 1, success, std::memory_order_relaxed)) {
          return {RingStatus::ok, handle_at(h, pos)};
        }
      } else if (dist < 0) {
        // Not yet published for this lap.
        return {RingStatus::empty, {}};
      } else {
        // Another consumer already took `pos`. Relaxed: hint only.
        pos = shared_->consumer_pos.load(std::memory_order_relaxed);
      }
    }
    return {RingStatus::contended, {}};
  }

  // The CAS publication of try_push_cas: seq pos -> pos + 1 on the slot of
  // h, a handle try_reserve gave (payload is its slot's address + the header,
  // so the header is found without forming the address again).
  // Order: release (R1), or seq_cst where the caller needs it.
  template <std::memory_order Order = std::memory_order_release>
  RingStatus publish_cas(RingHandle h) const noexcept {
    static_assert(Order == std::memory_order_release || Order == std::memory_order_seq_cst);
    auto* hdr = reinterpret_cast<RingSlotHeader*>(h.payload - kRingSlotHeaderBytes);
    uint32_t expect = h.pos;
    // R1 on success; the failure value is not used for data.
    if (hdr->seq.compare_exchange_strong(expect, h.pos + 1, Order, std::memory_order_relaxed))
      return RingStatus::ok;
    return RingStatus::abandoned;
  }

  static bool valid_arguments(const RingShared* shared, const void* slots,
                              uint32_t capacity, uint32_t stride) noexcept {
    return shared != nullptr && slots != nullptr &&
           reinterpret_cast<uintptr_t>(shared) % kRingCacheLine == 0 &&
           reinterpret_cast<uintptr_t>(slots) % kRingCacheLine == 0 &&
           valid_geometry(capacity, stride);
  }

  // Signed distance a - b on the u32 circle (two's complement conversion,
  // well defined since C++20).
  static constexpr int32_t distance(uint32_t a, uint32_t b) noexcept {
    return static_cast<int32_t>(a - b);
  }

  // The only place a slot address is formed: the position (possibly read
  // from untrusted memory) is masked with the PRIVATE mask, and multiplied
  // by the PRIVATE stride, so the result is always inside the slot array.
  std::byte* slot_addr(uint32_t pos) const noexcept {
    return slots_ + std::size_t{pos & mask_} * stride_;
  }
  RingSlotHeader* header(uint32_t pos) const noexcept {
    return reinterpret_cast<RingSlotHeader*>(slot_addr(pos));
  }
  RingHandle handle(uint32_t pos) const noexcept {
    return {slot_addr(pos) + kRingSlotHeaderBytes, pos};
  }
  // handle(pos) from its slot's header h == header(pos), formed before an
  // acquire load (after one the compiler reads the geometry again).
  static RingHandle handle_at(const RingSlotHeader* h, uint32_t pos) noexcept {
    return {const_cast<std::byte*>(reinterpret_cast<const std::byte*>(h)) + kRingSlotHeaderBytes, pos};
  }

  RingShared* shared_ = nullptr;
  std::byte* slots_ = nullptr;
  uint32_t capacity_ = 0;
  uint32_t mask_ = 0;
  uint32_t stride_ = 0;
};

static_assert(uint64_t{Ring::kMaxCapacity} * Ring::kMaxStride +
                      sizeof(RingShared) <=
                  std::numeric_limits<std::size_t>::max(),
              "bytes_for() must not overflow size_t for any valid geometry");
static_assert(Ring::kMaxCapacity < (uint32_t{1} << 30),
              "the int32 distance between a position and a sequence number "
              "spans up to 2*capacity; it must stay far from 2^31 to be "
              "unambiguous across u32 wrap-around");

}  // namespace shmrdma
