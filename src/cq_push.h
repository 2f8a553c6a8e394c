// The common push of a CQE into a CQ ring (cq.cc's producer protocol, P1-P4,
// for the case that needs nothing more than its fast steps), inline in
// push_cqe and push_peer_cqe (cq.cc) and in deliver's receive completion
// (transport_take.cc), so the common push calls nothing.
#pragma once

#include <emmintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "layout.h"
#include "peer.h"
#include "ring.h"

namespace shmrdma::cqpush {

// Whether *cache holds the validated view of CQ entry e's ring in peer's
// segment: the same Peer object (its stamp: the same mapping of the same
// context), and the ring at the same offset with the same capacity (read
// once each here, after P1). A resize allocates the new ring while the old
// one is still allocated, so a different ring of the same capacity at the
// same offset has the same geometry (the stride of every CQ is kCqeStride,
// the size follows from both): the cached view is exactly its view. A peer
// that scribbles on its own CqEntry can at most make its completions land in
// a ring its poller does not read; the cached view stays inside the mapping
// it was validated against.
[[gnu::always_inline]] inline bool cache_holds(const RingCache* cache, const Peer& peer,
                                               const layout::CqEntry* e) noexcept {
  return cache && cache->stamp == peer.stamp && cache->offset == e->ring_offset && cache->capacity == e->capacity;
}

enum class Fast { kFallback, kPushed, kArmed };

// Whether an armed CQ (notify mode m, untrusted) fires for a CQE that is
// solicited or an error (`qualifies`): the test of cq.cc qualifies, after
// the one compare that decides the common case (an unarmed CQ,
// kNotifyNone == 0).
[[gnu::always_inline]] inline bool armed_for(uint32_t m, bool qualifies) noexcept {
  static_assert(layout::kNotifyNone == 0);
  if (m == layout::kNotifyNone) [[likely]]
    return false;
  return m == layout::kNotifyNext || (m == layout::kNotifySolicited && qualifies);
}

// P1 and the checks after it, push_common_with's first half, for a
// producer that pushes one CQE or several in a row (send_leaf_run: a list's
// SENDs into one CQ): true when it counted itself in (then push_entered,
// once or more, and leave: P3); false, nothing counted, when the entry is
// not live, a resize or destroy is in progress, the CQ keeps timestamps or
// *cache does not hold its ring. The state is looked at before P1 too, so a
// producer does not count itself into the entry of a CQ that is gone. While
// counted in, the ring stays the one the cache holds (a resize or destroy
// waits for producers to be 0), so the checks hold for every push.
[[gnu::always_inline]] inline bool enter(const Peer& peer, layout::CqEntry* e, const RingCache* cache) noexcept {
  if (!e || e->state.load(std::memory_order_acquire) != layout::kLive) [[unlikely]]  // A1 pairs with R1
    return false;
  e->producers.fetch_add(1, std::memory_order_seq_cst);  // P1
  if (e->resizing.load(std::memory_order_seq_cst) != 0 || e->state.load(std::memory_order_seq_cst) != layout::kLive ||
      (e->flags & layout::kCqTimestamp) || !cache_holds(cache, peer, e)) [[unlikely]] {
    e->producers.fetch_sub(1, std::memory_order_release);
    return false;
  }
  return true;
}
[[gnu::always_inline]] inline void leave(layout::CqEntry* e) noexcept {
  e->producers.fetch_sub(1, std::memory_order_release);  // P3
}

// P4 without take_notify's fence, after a publication (P2): the publication
// was a seq_cst CAS and this load is seq_cst, so against arm_cq's notify
// CAS, fence and later poll either this load sees the arming or that poll
// sees the CQE (in the single total order S of C++20 [atomics.order]: the
// CAS precedes this load; a load that missed the arming precedes arm_cq's
// fence, which precedes a CAS its poll missed). On x86 one locked
// instruction less.
[[gnu::always_inline]] inline Fast published(const layout::CqEntry* e, bool qualifies) noexcept {
  if (armed_for(e->notify.load(std::memory_order_seq_cst), qualifies)) [[unlikely]]
    return Fast::kArmed;
  return Fast::kPushed;
}

// P2 for a producer counted in: fill writes the CQE into the slot it
// reserved, then the slot is published. The reservation uses what *cache
// knows of the ring's free slots (Ring::try_reserve_within), which holds
// for this entry's ring in this epoch: counted in, with no resize running,
// the epoch cannot move (the owner moves it only while no producer is in).
template <typename Fill>
[[gnu::always_inline]] inline RingStatus push_slot(const layout::CqEntry* e, RingCache* cache, Fill&& fill) noexcept {
  const uint32_t epoch = e->ring_epoch;
  if (cache->room_entry != e || cache->room_epoch != epoch) [[unlikely]] {
    cache->room_entry = e;
    cache->room_epoch = epoch;
    cache->room = cache->ring.producer_position();  // nothing known: the reservation asks the consumer's position
  }
  return cache->ring.try_push_cas_within<sizeof(layout::Cqe)>(&cache->room, fill);
}

// One push of a producer that entered (P2, then P4): fill(payload) writes
// the CQE (sizeof(layout::Cqe) bytes) into the reserved slot. kFallback:
// nothing was published (no free slot at the first try, or the poller gave
// the slot up: push_shared_cqe does it all).
template <typename Fill>
[[gnu::always_inline]] inline Fast push_entered(const layout::CqEntry* e, RingCache* cache, bool qualifies,
                                                Fill&& fill) noexcept {
  if (push_slot(e, cache, fill) != RingStatus::ok) [[unlikely]]  // P2
    return Fast::kFallback;
  return published(e, qualifies);
}

// P1-P4 of the producer protocol (cq.cc), unchanged, for a push into CQ entry
// e (nullptr: none) that needs nothing more than their fast steps: the entry
// live, no resize or destroy in progress, the ring geometry the one the
// caller's cache validated, no timestamp, a free slot at the first try
// (enter's checks). Anything else undoes P1 before anything was written
// (kFallback) and the caller runs push_shared_cqe, which does it all.
// kArmed: the CQ is armed for this CQE and the caller fires it
// (fire_notify). fill(payload) writes the CQE (sizeof(layout::Cqe) bytes)
// into the reserved slot; `qualifies`: it is solicited or an error
// (armed_for).
template <typename Fill>
[[gnu::always_inline]] inline Fast push_common_with(const Peer& peer, layout::CqEntry* e, RingCache* cache,
                                                    bool qualifies, Fill&& fill) noexcept {
  if (!enter(peer, e, cache)) [[unlikely]]
    return Fast::kFallback;
  const RingStatus st = push_slot(e, cache, fill);  // P2
  leave(e);                                         // P3
  if (st != RingStatus::ok) [[unlikely]]
    return Fast::kFallback;  // nothing was published: push_shared_cqe tries again
  return published(e, qualifies);
}

// A CQE's 56 bytes into its slot in three 16-byte moves and one of 8: GCC
// expands a memcpy of this size into `rep movsl`, whose start-up costs tens
// of cycles, right before the publication the poller waits for.
[[gnu::always_inline]] inline void copy_cqe(std::byte* d, const layout::Cqe& c) noexcept {
  static_assert(sizeof(layout::Cqe) == 3 * 16 + 8);
  const auto* s = reinterpret_cast<const std::byte*>(&c);
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
  uint64_t t;
  std::memcpy(&t, s + 48, 8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), a);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), b);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), x);
  std::memcpy(d + 48, &t, 8);
}

// Where the holder of a completing receive record notes the CQ slot it
// reserved for the receive completion, before the slot is published
// (layout.h QpEntry::rx_take_cq; the owner reads it when the holder died:
// recv_completion_delivered). A push without one passes nullptr.
struct CqNote {
  std::atomic<uint64_t>* where;
  uint32_t record;  // the record's completing value
  void note(uint32_t pos) const noexcept {
    // Relaxed: the publication that follows (a seq_cst CAS) releases it.
    where->store(uint64_t{record} << 32 | pos, std::memory_order_relaxed);
  }
};

// push_common_with for a CQE the caller has built, which `qualifies` (see
// push_common_with) or not; before() runs in the reserved slot's fill,
// right before the CQE is copied in (srq_send_leaf writes the message's
// bytes there, and knows its CQE is no error).
// With a CqNote (not nullptr), the reserved slot's position is noted first.
template <typename Before>
[[gnu::always_inline]] inline Fast push_built(const Peer& peer, layout::CqEntry* e, const layout::Cqe& cqe,
                                              RingCache* cache, bool qualifies, Before&& before,
                                              const CqNote* note = nullptr) noexcept {
  return push_common_with(peer, e, cache, qualifies,
                          [&](std::byte* payload, uint32_t pos) __attribute__((always_inline)) {
                            if (note) note->note(pos);
                            before();
                            copy_cqe(payload, cqe);
                          });
}
template <typename Before>
[[gnu::always_inline]] inline Fast push_common(const Peer& peer, layout::CqEntry* e, const layout::Cqe& cqe,
                                               RingCache* cache, Before&& before,
                                               const CqNote* note = nullptr) noexcept {
  return push_built(peer, e, cqe, cache, (cqe.flags & layout::kCqeSolicited) || layout::error_cqe(cqe), before,
                    note);
}
[[gnu::always_inline]] inline Fast push_common(const Peer& peer, layout::CqEntry* e, const layout::Cqe& cqe,
                                               RingCache* cache, const CqNote* note = nullptr) noexcept {
  return push_common(peer, e, cqe, cache, [] {}, note);
}

}  // namespace shmrdma::cqpush
