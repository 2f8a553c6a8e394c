// Receive work queues and RSS indirection tables.
#include <cerrno>
#include <cstring>
#include <new>
#include <vector>

#include "provider.h"

namespace shmrdma::provider {

static_assert(static_cast<uint32_t>(WqState::kReset) == IBV_WQS_RESET &&
              static_cast<uint32_t>(WqState::kRdy) == IBV_WQS_RDY &&
              static_cast<uint32_t>(WqState::kErr) == IBV_WQS_ERR &&
              static_cast<uint32_t>(WqState::kUnknown) == IBV_WQS_UNKNOWN);
static_assert(kWqAttrState == IBV_WQ_ATTR_STATE && kWqAttrCurrState == IBV_WQ_ATTR_CURR_STATE &&
              kWqAttrFlags == IBV_WQ_ATTR_FLAGS && kWqAttrReserved == IBV_WQ_ATTR_RESERVED);

namespace {

int post_wq_recv(ibv_wq* ibwq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  Wq* wq = to_wq(ibwq);
  LocalContext* core = to_ctx(ibwq->context)->core;
  BiasingGuard producers(wq->post_lock);
  for (; wr; wr = wr->next) {
    int rc = 0;
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > wq->info.max_sge || (wr->num_sge && !wr->sg_list)) {
      rc = EINVAL;
    } else {
      // The SGEs as posted (SgeIn has ibv_sge's layout: recv_queue.h).
      rc = core->post_wq_recv(wq->info, wr->wr_id, reinterpret_cast<const SgeIn*>(wr->sg_list),
                               static_cast<uint32_t>(wr->num_sge));
    }
    if (rc) {
      if (bad_wr) *bad_wr = wr;
      return rc;
    }
  }
  return 0;
}

}  // namespace

ibv_wq* create_wq(ibv_context* ibctx, ibv_wq_init_attr* attr) noexcept {
  if (!attr || !attr->pd || !attr->cq || attr->pd->context != ibctx || attr->cq->context != ibctx) {
    errno = EINVAL;
    return nullptr;
  }
  uint32_t wq_type = 0;  // read as an integer: the caller may pass any value
  std::memcpy(&wq_type, &attr->wq_type, sizeof wq_type);
  if (wq_type != IBV_WQT_RQ) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr->comp_mask & ~uint32_t{IBV_WQ_INIT_ATTR_RESERVED - 1}) {
    errno = EINVAL;
    return nullptr;
  }
  if ((attr->comp_mask & IBV_WQ_INIT_ATTR_FLAGS) && attr->create_flags) {
    errno = EOPNOTSUPP;  // VLAN stripping, FCS scatter, ... are Ethernet features we do not have
    return nullptr;
  }
  auto* wq = new (std::nothrow) Wq{};
  if (!wq) {
    errno = ENOMEM;
    return nullptr;
  }
  int rc = to_ctx(ibctx)->core->create_wq(to_pd(attr->pd)->index, to_cq(attr->cq)->info.index, attr->max_wr,
                                          attr->max_sge, &wq->info);
  if (rc) {
    delete wq;
    errno = rc;
    return nullptr;
  }
  attr->max_wr = wq->info.capacity;
  attr->max_sge = wq->info.max_sge;
  wq->ibv.context = ibctx;
  wq->ibv.pd = attr->pd;
  wq->ibv.cq = attr->cq;
  wq->ibv.wq_num = wq->info.wq_num;
  wq->ibv.handle = wq->info.index;
  wq->ibv.state = IBV_WQS_RESET;
  wq->ibv.wq_type = IBV_WQT_RQ;
  wq->ibv.post_recv = post_wq_recv;
  pd_hold(attr->pd);
  return &wq->ibv;
}

int modify_wq(ibv_wq* ibwq, ibv_wq_attr* attr) noexcept {
  if (!attr) return EINVAL;
  Wq* wq = to_wq(ibwq);
  WqState now = WqState::kUnknown;
  uint32_t cur = 0, next = 0;  // read as integers: the caller may pass any value
  std::memcpy(&cur, &attr->curr_wq_state, sizeof cur);
  std::memcpy(&next, &attr->wq_state, sizeof next);
  int rc = to_ctx(ibwq->context)->core->modify_wq(wq->info.index, attr->attr_mask, static_cast<WqState>(cur),
                                                  static_cast<WqState>(next), &now);
  if (rc) return rc;
  ibwq->state = static_cast<ibv_wq_state>(now);
  return 0;
}

int destroy_wq(ibv_wq* ibwq) noexcept {
  Wq* wq = to_wq(ibwq);
  if (int rc = to_ctx(ibwq->context)->core->destroy_wq(wq->info.index)) return rc;
  pd_release(ibwq->pd);
  delete wq;
  return 0;
}

ibv_rwq_ind_table* create_rwq_ind_table(ibv_context* ibctx, ibv_rwq_ind_table_init_attr* attr) noexcept {
  if (!attr || !attr->ind_tbl || attr->log_ind_tbl_size > limits::kMaxLogIndTblSize ||
      (attr->comp_mask & ~uint32_t{IBV_CREATE_IND_TABLE_RESERVED - 1})) {
    errno = EINVAL;
    return nullptr;
  }
  uint32_t n = 1u << attr->log_ind_tbl_size;
  uint32_t idx[limits::kMaxRwqIndTableSize];
  for (uint32_t k = 0; k < n; ++k) {
    ibv_wq* w = attr->ind_tbl[k];
    if (!w || w->context != ibctx) {  // WQs of another context cannot be grouped here
      errno = EINVAL;
      return nullptr;
    }
    idx[k] = to_wq(w)->info.index;
  }
  auto* t = new (std::nothrow) IndTable{};
  if (!t) {
    errno = ENOMEM;
    return nullptr;
  }
  uint32_t num = 0;
  if (int rc = to_ctx(ibctx)->core->create_ind_table(attr->log_ind_tbl_size, idx, &t->index, &num)) {
    delete t;
    errno = rc;
    return nullptr;
  }
  t->ibv.context = ibctx;
  t->ibv.ind_tbl_handle = static_cast<int>(t->index);
  t->ibv.ind_tbl_num = static_cast<int>(num);
  return &t->ibv;
}

int destroy_rwq_ind_table(ibv_rwq_ind_table* ibt) noexcept {
  IndTable* t = to_ind(ibt);
  if (int rc = to_ctx(ibt->context)->core->destroy_ind_table(t->index)) return rc;
  delete t;
  return 0;
}

}  // namespace shmrdma::provider
