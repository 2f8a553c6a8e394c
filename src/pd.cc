// Protection domains of a context.
#include <cerrno>

#include "context.h"

namespace shmrdma {

int LocalContext::create_pd(uint32_t* index) noexcept {
  std::lock_guard lk(mu_);
  uint32_t i = 0;
  while (i < pds_.size() && pds_[i].live) ++i;
  if (i == pds_.size()) return ENOMEM;
  if (int rc = charge(layout::kObjPd, limits::kMaxPd)) return rc;
  auto* e = table<layout::PdEntry>(layout_.pd_table) + i;
  e->generation += 1;
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  pds_[i] = PdState{true, 0};
  *index = i;
  return 0;
}

int LocalContext::destroy_pd(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  if (index >= pds_.size() || !pds_[index].live) return EINVAL;
  if (pds_[index].refs) return EBUSY;
  table<layout::PdEntry>(layout_.pd_table)[index].state.store(layout::kFree, std::memory_order_release);
  pds_[index] = PdState{};
  uncharge(layout::kObjPd);
  return 0;
}

}  // namespace shmrdma
