// Completion queues of a context: a ring of Cqe in the context segment. Many
// producers (this process and peers), one consumer (this process's poller).
#include <algorithm>
#include <cerrno>
#include <cstring>

#include "async.h"
#include "context.h"

namespace shmrdma {

namespace {
constexpr uint32_t kCqeStride =
    static_cast<uint32_t>(layout::align_up(kRingSlotHeaderBytes + sizeof(layout::Cqe), layout::kCacheLine));
}  // namespace

int LocalContext::create_cq(uint32_t cqe, CqInfo* out) noexcept {
  if (cqe < 1 || cqe > limits::kMaxCqe) return EINVAL;
  uint32_t capacity = Ring::capacity_for(cqe);
  if (capacity == 0 || capacity > limits::kMaxCqe) return EINVAL;
  std::lock_guard lk(mu_);
  uint32_t i = 0;
  while (i < cqs_.size() && cqs_[i].live) ++i;
  if (i == cqs_.size()) return ENOMEM;
  uint64_t bytes = Ring::bytes_for(capacity, kCqeStride);
  uint64_t off = heap_alloc(bytes);
  if (!off) return ENOMEM;
  auto* rs = map_.at<RingShared>(off);
  auto ring = Ring::format(rs, Ring::slots_after(rs), capacity, kCqeStride);
  if (!ring) {
    heap_free(off, bytes);
    return EINVAL;
  }
  if (int rc = charge(layout::kObjCq, limits::kMaxCq)) {
    heap_free(off, bytes);
    return rc;
  }
  auto* e = table<layout::CqEntry>(layout_.cq_table) + i;
  e->generation += 1;
  e->capacity = capacity;
  e->slot_stride = kCqeStride;
  e->ring_offset = off;
  e->ring_bytes = bytes;
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  CqState& s = cqs_[i];
  s = CqState{};
  s.live = true;
  s.ring_off = off;
  s.ring_bytes = bytes;
  s.info = CqInfo{i, capacity, *ring};
  *out = s.info;
  return 0;
}

int LocalContext::destroy_cq(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  if (index >= cqs_.size() || !cqs_[index].live) return EINVAL;
  if (cqs_[index].refs) return EBUSY;
  table<layout::CqEntry>(layout_.cq_table)[index].state.store(layout::kFree, std::memory_order_release);
  heap_free(cqs_[index].ring_off, cqs_[index].ring_bytes);
  cqs_[index] = CqState{};
  uncharge(layout::kObjCq);
  return 0;
}

bool LocalContext::push_cqe(uint32_t cq_index, const layout::Cqe& cqe) noexcept {
  if (cq_index >= cqs_.size() || !cqs_[cq_index].live) return false;
  Ring ring = cqs_[cq_index].info.ring;
  for (int i = 0; i < 4; ++i) {
    RingStatus st = ring.try_push(&cqe, sizeof cqe);
    if (st == RingStatus::ok) return true;
    if (st != RingStatus::contended) break;
  }
  // The CQ has overrun: the completion is lost and the application learns it
  // from an IBV_EVENT_CQ_ERR, once.
  if (!cqs_[cq_index].overrun_reported.exchange(true, std::memory_order_relaxed)) {
    uint32_t gen = table<layout::CqEntry>(layout_.cq_table)[cq_index].generation;
    raise_async(IBV_EVENT_CQ_ERR, async_token(AsyncKind::kCq, cq_index, gen));
  }
  return false;
}

int LocalContext::poll_cq(const CqInfo& cq, int n, layout::Cqe* out) noexcept {
  Ring ring = cq.ring;
  int got = 0;
  while (got < n) {
    RingResult r = ring.try_claim_sc();
    if (!r) break;
    std::memcpy(&out[got], r.handle.payload, sizeof(layout::Cqe));
    ring.release(r.handle);
    ++got;
  }
  return got;
}

}  // namespace shmrdma
