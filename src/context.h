// The core of one open verbs context: its registry slot, its shared segment
// and the objects in it. Independent of libibverbs' private ABI; the provider
// translates ibv_* structs to these calls.
//
// Threading: control-path calls (create/modify/destroy) serialise on an
// internal mutex. Data-path calls (post_wq_recv, poll_cq) take no lock; the
// rings are lock-free.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "heap.h"
#include "layout.h"
#include "paths.h"
#include "registry.h"
#include "ring.h"
#include "segment.h"

namespace shmrdma {

// Values of ibv_wq_state / ibv_wq_attr_mask / ibv_wc_* that the core needs,
// kept numerically identical to verbs.h (checked by static_asserts in the
// provider) so the core does not depend on libibverbs headers.
enum class WqState : uint32_t { kReset = 0, kRdy = 1, kErr = 2, kUnknown = 3 };
inline constexpr uint32_t kWqAttrState = 1u << 0;
inline constexpr uint32_t kWqAttrCurrState = 1u << 1;
inline constexpr uint32_t kWqAttrFlags = 1u << 2;
inline constexpr uint32_t kWqAttrReserved = 1u << 3;
inline constexpr uint32_t kWcSuccess = 0;
inline constexpr uint32_t kWcWrFlushErr = 5;
inline constexpr uint32_t kWcOpRecv = 1u << 7;

struct CqInfo {
  uint32_t index;
  uint32_t capacity;
  Ring ring;
};

struct WqInfo {
  uint32_t index;
  uint32_t wq_num;
  uint32_t capacity;  // == max_wr handed back
  uint32_t max_sge;   // handed back
  uint32_t cq_index;
  Ring ring;
};

struct SgeIn {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

class LocalContext {
 public:
  // Default size of the heap that holds a context's rings. The file is
  // sparse: only pages that rings touch use memory.
  static constexpr uint64_t kDefaultHeapSize = uint64_t{512} << 20;

  // Attaches to the device's registry, registers this process and creates
  // its context segment. ENOENT when the device is not up.
  static int open(const DevicePaths& paths, uint64_t heap_size, std::unique_ptr<LocalContext>* out) noexcept;
  ~LocalContext();

  const layout::DeviceRecord& device() const noexcept { return registry_.device(); }
  Registry& registry() noexcept { return registry_; }
  const std::string& segment_path() const noexcept { return map_.path(); }

  // Protection domains.
  int create_pd(uint32_t* index) noexcept;
  int destroy_pd(uint32_t index) noexcept;  // EBUSY while objects use it

  // Completion queues. `cqe` is rounded up to a power of two.
  int create_cq(uint32_t cqe, CqInfo* out) noexcept;
  int destroy_cq(uint32_t index) noexcept;  // EBUSY while WQs/QPs use it
  // Pops up to `n` completions (single consumer: the caller serialises polls
  // of one CQ). Returns the number popped.
  int poll_cq(const CqInfo& cq, int n, layout::Cqe* out) noexcept;

  // Receive work queues (IBV_WQT_RQ).
  int create_wq(uint32_t pd, uint32_t cq, uint32_t max_wr, uint32_t max_sge, WqInfo* out) noexcept;
  // attr_mask: kWqAttr*. Returns 0 or EINVAL (bad mask, transition, or
  // current state mismatch); *state_out receives the state after the call.
  int modify_wq(uint32_t index, uint32_t attr_mask, WqState curr, WqState next, WqState* state_out) noexcept;
  int destroy_wq(uint32_t index) noexcept;  // EBUSY while in an indirection table
  // Posts one receive. EINVAL: too many SGEs or WQ in RESET; ENOMEM: full.
  int post_wq_recv(const WqInfo& wq, uint64_t wr_id, const SgeIn* sges, uint32_t num_sge) noexcept;
  WqState wq_state(uint32_t index) const noexcept;

  // Receive WQ indirection tables (RSS).
  int create_ind_table(uint32_t log_size, const uint32_t* wq_indices, uint32_t* index, uint32_t* ind_tbl_num) noexcept;
  int destroy_ind_table(uint32_t index) noexcept;

 private:
  LocalContext() = default;

  struct PdState { bool live = false; uint32_t refs = 0; };
  struct CqState { bool live = false; uint32_t refs = 0; uint64_t ring_off = 0, ring_bytes = 0; CqInfo info{}; };
  struct WqState_ {
    bool live = false;
    uint32_t refs = 0;
    uint32_t pd = 0, cq = 0;
    uint64_t ring_off = 0, ring_bytes = 0;
    WqInfo info{};
  };
  struct IndState { bool live = false; std::vector<uint32_t> wqs; uint64_t list_off = 0, list_bytes = 0; };

  layout::ContextHeader* header() const noexcept { return static_cast<layout::ContextHeader*>(map_.base()); }
  template <typename T> T* table(uint64_t off) const noexcept { return map_.at<T>(off); }
  int charge(layout::ObjKind k, uint32_t limit) noexcept;
  void uncharge(layout::ObjKind k) noexcept;
  uint64_t heap_alloc(uint64_t bytes) noexcept;
  void heap_free(uint64_t off, uint64_t bytes) noexcept;
  // Moves every posted WQE of a WQ in the error state to its CQ as a
  // flush-error completion.
  void flush_wq(const WqInfo& wq) noexcept;
  bool push_cqe(uint32_t cq_index, const layout::Cqe& cqe) noexcept;

  mutable std::mutex mu_;
  Registry registry_;
  Mapping map_;
  layout::ContextLayout layout_{};
  HeapAllocator heap_;
  uint32_t slot_ = 0, generation_ = 0;
  std::vector<PdState> pds_;
  std::vector<CqState> cqs_;
  std::vector<WqState_> wqs_;
  std::vector<IndState> inds_;
};

// Read-only view of another context's segment, for `shmrdma status`.
struct ContextObjects {
  uint32_t pds = 0, cqs = 0, wqs = 0, ind_tables = 0;
  struct Wq { uint32_t wq_num, state, capacity, max_sge, pd, cq; };
  std::vector<Wq> wq_list;
};
// Returns 0 and fills *out, or an errno (EPROTO for a segment that fails validation).
int inspect_context(const DevicePaths& paths, const ContextInfo& ctx, ContextObjects* out) noexcept;

}  // namespace shmrdma
