// Address resolution, the one seam between an address (LID, later GID) and
// a device of the home, its port and, through the QPN, a QP in that
// device's registry (directory.h). RC/UC resolve their path at RTR, UD the
// address vector of each send (cached per QP while it does not change),
// multicast looks at every device's groups.
#include <time.h>

#include <cstring>

#include "context.h"

namespace shmrdma {

namespace {
uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}
}  // namespace

bool LocalContext::same_address(const AddressVector& a, const AddressVector& b) noexcept {
  return a.dlid == b.dlid && a.is_global == b.is_global && a.port_num == b.port_num &&
         a.sgid_index == b.sgid_index && (!a.is_global || std::memcmp(a.dgid, b.dgid, 16) == 0);
}

HomeDevice* LocalContext::resolve_address(const AddressVector& av, uint32_t* port) noexcept {
  *port = 0;
  return dir_.by_lid(av.dlid, port);
}

bool LocalContext::resolve_path(Qp* qp, bool now) noexcept {
  if (!now) {
    const uint64_t t = mono_ns();
    if (t - qp->resolve_retry_ns < 1'000'000) return qp->peer_dev != nullptr;
    qp->resolve_retry_ns = t;
  }
  const QpAttr& a = qp->attr;
  AddressVector av;
  av.dlid = a.dlid;
  av.is_global = a.is_global;
  av.port_num = a.port_num;
  av.sgid_index = a.grh.sgid_index;
  std::memcpy(av.dgid, a.grh.dgid.raw, 16);
  uint32_t port = 0;
  HomeDevice* d = resolve_address(av, &port);
  qp->peer_dev = d;
  qp->peer_port = port;
  // Published for peers that check whether we are connected to them.
  qp->shared->dest_device = d ? d->home_id : 0;
  return d != nullptr;
}

}  // namespace shmrdma
