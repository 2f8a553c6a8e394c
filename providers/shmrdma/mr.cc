// Memory regions.
#include <cerrno>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

static_assert(kAccessLocalWrite == IBV_ACCESS_LOCAL_WRITE && kAccessRemoteWrite == IBV_ACCESS_REMOTE_WRITE &&
              kAccessRemoteRead == IBV_ACCESS_REMOTE_READ && kAccessRemoteAtomic == IBV_ACCESS_REMOTE_ATOMIC &&
              kAccessMwBind == IBV_ACCESS_MW_BIND && kAccessZeroBased == IBV_ACCESS_ZERO_BASED &&
              kAccessOnDemand == IBV_ACCESS_ON_DEMAND && kAccessHugetlb == IBV_ACCESS_HUGETLB &&
              kAccessOptionalFirst == IBV_ACCESS_OPTIONAL_FIRST);
static_assert(kRereg_ChangeTranslation == IBV_REREG_MR_CHANGE_TRANSLATION &&
              kRereg_ChangePd == IBV_REREG_MR_CHANGE_PD && kRereg_ChangeAccess == IBV_REREG_MR_CHANGE_ACCESS);

ibv_mr* reg_mr(ibv_pd* ibpd, void* addr, size_t length, uint64_t hca_va, int access) noexcept {
  auto* mr = new (std::nothrow) Mr{};
  if (!mr) {
    errno = ENOMEM;
    return nullptr;
  }
  uint64_t iova = (access & IBV_ACCESS_ZERO_BASED) ? 0 : hca_va;
  int rc = to_ctx(ibpd->context)->core->create_mr(to_pd(ibpd)->index, reinterpret_cast<uintptr_t>(addr), length, iova,
                                                 static_cast<uint32_t>(access), &mr->info);
  if (rc) {
    delete mr;
    errno = rc;
    return nullptr;
  }
  mr->vmr.ibv_mr.context = ibpd->context;
  mr->vmr.ibv_mr.pd = ibpd;
  mr->vmr.ibv_mr.addr = addr;
  mr->vmr.ibv_mr.length = length;
  mr->vmr.ibv_mr.handle = mr->info.index;
  mr->vmr.ibv_mr.lkey = mr->info.lkey;
  mr->vmr.ibv_mr.rkey = mr->info.rkey;
  mr->vmr.mr_type = IBV_MR_TYPE_MR;
  mr->vmr.access = access;
  return &mr->vmr.ibv_mr;
}

int dereg_mr(verbs_mr* vmr) noexcept {
  Mr* mr = to_mr(vmr);
  if (int rc = to_ctx(vmr->ibv_mr.context)->core->destroy_mr(mr->info.index)) return rc;
  delete mr;
  return 0;
}

int rereg_mr(verbs_mr* vmr, int flags, ibv_pd* pd, void* addr, size_t length, int access) noexcept {
  Mr* mr = to_mr(vmr);
  uint32_t pd_index = (flags & IBV_REREG_MR_CHANGE_PD) && pd ? to_pd(pd)->index : 0;
  if ((flags & IBV_REREG_MR_CHANGE_PD) && (!pd || pd->context != vmr->ibv_mr.context)) {
    errno = EINVAL;
    return IBV_REREG_MR_ERR_INPUT;
  }
  uint64_t va = reinterpret_cast<uintptr_t>(addr);
  int rc = to_ctx(vmr->ibv_mr.context)->core->rereg_mr(mr->info.index, static_cast<uint32_t>(flags), pd_index, va,
                                                       length, va, static_cast<uint32_t>(access), &mr->info);
  if (rc) {
    errno = rc;
    return IBV_REREG_MR_ERR_INPUT;
  }
  vmr->ibv_mr.lkey = mr->info.lkey;
  vmr->ibv_mr.rkey = mr->info.rkey;
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) vmr->access = access;
  return 0;
}

}  // namespace shmrdma::provider
