// Memory regions.
#include <cerrno>
#include <new>
#include <vector>

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
  pd_hold(ibpd);
  return &mr->vmr.ibv_mr;
}

int dereg_mr(verbs_mr* vmr) noexcept {
  Mr* mr = to_mr(vmr);
  if (int rc = to_ctx(vmr->ibv_mr.context)->core->destroy_mr(mr->info.index)) return rc;
  if (mr->dm) mr->dm->mrs.fetch_sub(1, std::memory_order_acq_rel);
  pd_release(vmr->ibv_mr.pd);
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
  if (mr->dm && (flags & IBV_REREG_MR_CHANGE_TRANSLATION)) {  // a DM MR stays on its device memory
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
  if (flags & IBV_REREG_MR_CHANGE_PD) {  // libibverbs sets mr->pd = pd after we return
    pd_hold(pd);
    pd_release(vmr->ibv_mr.pd);
  }
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) vmr->access = access;
  return 0;
}

static_assert(kAdvisePrefetch == IBV_ADVISE_MR_ADVICE_PREFETCH &&
              kAdvisePrefetchWrite == IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE &&
              kAdvisePrefetchNoFault == IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT &&
              kAdviseFlagFlush == IB_UVERBS_ADVISE_MR_FLAG_FLUSH);

// ibv_advise_mr (core: LocalContext::advise_mr).
int advise_mr(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list, uint32_t num_sge) noexcept {
  if (!pd || !sg_list || num_sge == 0) return EINVAL;
  std::vector<uint64_t> addrs;
  std::vector<uint32_t> lengths, lkeys;
  try {
    addrs.resize(num_sge);
    lengths.resize(num_sge);
    lkeys.resize(num_sge);
  } catch (...) {
    return ENOMEM;
  }
  for (uint32_t k = 0; k < num_sge; ++k) {
    addrs[k] = sg_list[k].addr;
    lengths[k] = sg_list[k].length;
    lkeys[k] = sg_list[k].lkey;
  }
  return to_ctx(pd->context)->core->advise_mr(to_pd(pd)->index, static_cast<uint32_t>(advice), flags, addrs.data(),
                                              lengths.data(), lkeys.data(), num_sge);
}

// Memory windows (core: src/mw.cc).
ibv_mw* alloc_mw(ibv_pd* ibpd, ibv_mw_type type) noexcept {
  if (!ibpd || (type != IBV_MW_TYPE_1 && type != IBV_MW_TYPE_2)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* mw = new (std::nothrow) Mw{};
  if (!mw) {
    errno = ENOMEM;
    return nullptr;
  }
  MwInfo info{};
  if (int rc = to_ctx(ibpd->context)->core->create_mw(to_pd(ibpd)->index, static_cast<uint32_t>(type), &info)) {
    delete mw;
    errno = rc;
    return nullptr;
  }
  mw->index = info.index;
  mw->ibv.context = ibpd->context;
  mw->ibv.pd = ibpd;
  mw->ibv.rkey = info.rkey;
  mw->ibv.handle = info.index;
  mw->ibv.type = type;
  pd_hold(ibpd);
  return &mw->ibv;
}

int dealloc_mw(ibv_mw* ibmw) noexcept {
  Mw* mw = to_mw(ibmw);
  if (int rc = to_ctx(ibmw->context)->core->destroy_mw(mw->index)) return rc;
  pd_release(ibmw->pd);
  delete mw;
  return 0;
}

int fill_bind(ibv_qp* qp, ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info& info, SendWr* w) noexcept {
  if (!mw || mw->context != qp->context || (info.mr && info.mr->context != qp->context)) return EINVAL;
  w->opcode = IBV_WR_BIND_MW;
  w->rkey = rkey;
  w->mw_index = to_mw(mw)->index;
  w->mw_mr = info.mr ? to_mr(reinterpret_cast<verbs_mr*>(info.mr))->info.index : layout::kNoIndex;
  w->mw_mr_lkey = info.mr ? info.mr->lkey : 0;
  w->mw_addr = info.addr;
  w->mw_length = info.length;
  w->mw_access = info.mw_access_flags;
  return 0;
}

// ibv_bind_mw (type 1). libibverbs' inline wrapper has checked the type,
// that a bind without MR has no range and that the MR is in the window's
// PD. As rxe does, the bind is a send WR with the next key (ibv_inc_rkey),
// which is in mw->rkey when we return (the application undoes it when the
// bind completes in error).
int bind_mw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* bind) noexcept {
  if (!qp || !mw || !bind || mw->type != IBV_MW_TYPE_1) return EINVAL;
  if (bind->bind_info.mw_access_flags & IBV_ACCESS_ZERO_BASED) return EINVAL;
  SendWr w;
  w.wr_id = bind->wr_id;
  w.send_flags = bind->send_flags;
  if (int rc = fill_bind(qp, mw, ibv_inc_rkey(mw->rkey), bind->bind_info, &w)) return rc;
  LocalContext* core = to_ctx(qp->context)->core;
  if (int rc = core->enqueue_send(to_qp(qp)->core, w)) return rc;
  mw->rkey = w.rkey;
  core->progress(to_qp(qp)->core);
  return 0;
}

}  // namespace shmrdma::provider
