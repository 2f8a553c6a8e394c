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

// Address handles: the address vector lives with the application's ibv_ah
// (the provider copies it into every UD WQE); the core checks it, charges
// the device-wide AH count and holds the PD (dealloc_pd: EBUSY).
int LocalContext::create_ah(uint32_t pd, const AddressVector& av) noexcept {
  std::lock_guard lk(mu_);
  if (pd >= pds_.size() || !pds_[pd].live) return EINVAL;
  const layout::DeviceRecord& dev = registry_.device();
  if (av.port_num < 1 || av.port_num > dev.num_ports) return EINVAL;
  if (av.sl > 15) return EINVAL;
  if (av.is_global && av.sgid_index >= limits::kGidTableLen) return EINVAL;
  // RoCE: GRH mandatory, sgid_index a valid entry of our port (address.cc).
  if (int rc = check_ethernet_av(av.port_num, av.is_global, av.sgid_index)) return rc;
  if (!av.is_global && av.dlid == 0) return EINVAL;  // LID 0 is reserved: without a GRH there is no address
  if (int rc = charge(layout::kObjAh, limits::kMaxAh)) return rc;
  pds_[pd].refs += 1;
  return 0;
}

int LocalContext::destroy_ah(uint32_t pd) noexcept {
  std::lock_guard lk(mu_);
  if (pd >= pds_.size() || !pds_[pd].live || pds_[pd].refs == 0) return EINVAL;
  pds_[pd].refs -= 1;
  uncharge(layout::kObjAh);
  return 0;
}

}  // namespace shmrdma
