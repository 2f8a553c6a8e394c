// Address handles: an ibv_ah holds its address vector; UD work requests
// carry a copy of it (qp.cc, qp_ex.cc).
#include <cerrno>
#include <cstring>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* attr) noexcept {
  if (!pd || !attr) {
    errno = EINVAL;
    return nullptr;
  }
  AddressVector av;
  av.dlid = attr->dlid;
  av.sl = attr->sl;
  av.is_global = attr->is_global ? 1 : 0;
  av.port_num = attr->port_num;
  if (av.is_global) {
    av.sgid_index = attr->grh.sgid_index;
    av.hop_limit = attr->grh.hop_limit;
    av.traffic_class = attr->grh.traffic_class;
    av.flow_label = attr->grh.flow_label;
    std::memcpy(av.dgid, attr->grh.dgid.raw, sizeof av.dgid);
  }
  auto* ah = new (std::nothrow) Ah{};
  if (!ah) {
    errno = ENOMEM;
    return nullptr;
  }
  if (int rc = to_ctx(pd->context)->core->create_ah(to_pd(pd)->index, av)) {
    delete ah;
    errno = rc;
    return nullptr;
  }
  ah->ibv.context = pd->context;
  ah->ibv.pd = pd;
  ah->ibv.handle = 0;
  ah->av = av;
  pd_hold(pd);
  return &ah->ibv;
}

int destroy_ah(ibv_ah* ibah) noexcept {
  Ah* ah = to_ah(ibah);
  if (int rc = to_ctx(ibah->context)->core->destroy_ah(to_pd(ibah->pd)->index)) return rc;
  pd_release(ibah->pd);
  delete ah;
  return 0;
}

}  // namespace shmrdma::provider
