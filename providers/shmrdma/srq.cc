// Shared receive queues (IBV_SRQT_BASIC and IBV_SRQT_XRC): create/modify/
// query/destroy, the post verb and the SRQ number (with which a peer's XRC
// send names the SRQ). Tag-matching SRQs are not supported.
#include <pthread.h>

#include <cerrno>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

namespace {

// xrcd: an XRC SRQ of that domain, completing to `cq`.
ibv_srq* create(ibv_context* ibctx, ibv_pd* pd, ibv_srq_attr* attr, void* srq_context, ibv_cq* cq,
                ibv_xrcd* xrcd = nullptr) noexcept {
  if (!pd || !attr || pd->context != ibctx) {
    errno = EINVAL;
    return nullptr;
  }
  // attr->srq_limit is irrelevant at creation (ibv_create_srq(3)): an SRQ
  // starts unarmed; ibv_modify_srq(IBV_SRQ_LIMIT) arms it.
  auto* srq = new (std::nothrow) Srq{};
  if (!srq) {
    errno = ENOMEM;
    return nullptr;
  }
  LocalContext* core = to_ctx(ibctx)->core;
  int rc = xrcd ? core->create_srq(to_pd(pd)->index, attr->max_wr, attr->max_sge, to_xrcd(xrcd)->index,
                                   to_cq(cq)->info.index, &srq->info)
                : core->create_srq(to_pd(pd)->index, attr->max_wr, attr->max_sge, &srq->info);
  if (rc) {
    delete srq;
    errno = rc;
    return nullptr;
  }
  attr->max_wr = srq->info.capacity;
  attr->max_sge = srq->info.max_sge;
  ibv_srq& s = srq->vsrq.srq;
  s.context = ibctx;
  s.srq_context = srq_context;
  s.pd = pd;
  s.handle = srq->info.index;
  s.events_completed = 0;
  pthread_mutex_init(&s.mutex, nullptr);
  pthread_cond_init(&s.cond, nullptr);
  srq->vsrq.srq_type = xrcd ? IBV_SRQT_XRC : IBV_SRQT_BASIC;
  srq->vsrq.xrcd = reinterpret_cast<verbs_xrcd*>(xrcd);
  srq->vsrq.cq = cq;
  srq->vsrq.srq_num = srq->info.srq_num;
  core->set_srq_user(srq->info.index, &s);
  pd_hold(pd);
  return &s;
}

}  // namespace

ibv_srq* create_srq(ibv_pd* pd, ibv_srq_init_attr* attr) noexcept {
  if (!pd || !attr) {
    errno = EINVAL;
    return nullptr;
  }
  return create(pd->context, pd, &attr->attr, attr->srq_context, nullptr);
}

ibv_srq* create_srq_ex(ibv_context* ibctx, ibv_srq_init_attr_ex* attr) noexcept {
  if (!attr || (attr->comp_mask & ~uint32_t{IBV_SRQ_INIT_ATTR_RESERVED - 1})) {
    errno = EINVAL;
    return nullptr;
  }
  const bool xrc = (attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && attr->srq_type == IBV_SRQT_XRC;
  if ((attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && attr->srq_type != IBV_SRQT_BASIC && !xrc) {
    // Tag matching needs hardware we do not model.
    errno = attr->srq_type == IBV_SRQT_TM ? EOPNOTSUPP : EINVAL;
    return nullptr;
  }
  if (attr->comp_mask & IBV_SRQ_INIT_ATTR_TM) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (xrc) {
    // An XRC SRQ: its domain and the CQ its receives complete to are
    // required (ibv_create_srq_ex(3)), and a PD for its receive buffers.
    if (!(attr->comp_mask & IBV_SRQ_INIT_ATTR_XRCD) || !attr->xrcd || attr->xrcd->context != ibctx ||
        !(attr->comp_mask & IBV_SRQ_INIT_ATTR_CQ) || !attr->cq || attr->cq->context != ibctx ||
        !(attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) || !attr->pd) {
      errno = EINVAL;
      return nullptr;
    }
    return create(ibctx, attr->pd, &attr->attr, attr->srq_context, attr->cq, attr->xrcd);
  }
  if (!(attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) || !attr->pd) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_cq* cq = nullptr;
  if (attr->comp_mask & IBV_SRQ_INIT_ATTR_CQ) {
    // Only XRC SRQs complete to their own CQ; for a basic SRQ it is
    // recorded and otherwise unused, but it must be ours.
    if (attr->cq && attr->cq->context != ibctx) {
      errno = EINVAL;
      return nullptr;
    }
    cq = attr->cq;
  }
  return create(ibctx, attr->pd, &attr->attr, attr->srq_context, cq);
}

int modify_srq(ibv_srq* ibsrq, ibv_srq_attr* attr, int mask) noexcept {
  if (!ibsrq || !attr || mask < 0) return EINVAL;
  Srq* srq = to_srq(ibsrq);
  return to_ctx(ibsrq->context)->core->modify_srq(srq->info.index, static_cast<uint32_t>(mask), attr->max_wr,
                                                  attr->srq_limit);
}

int query_srq(ibv_srq* ibsrq, ibv_srq_attr* attr) noexcept {
  if (!ibsrq || !attr) return EINVAL;
  Srq* srq = to_srq(ibsrq);
  uint32_t max_wr = 0, max_sge = 0, limit = 0;
  if (int rc = to_ctx(ibsrq->context)->core->query_srq(srq->info.index, &max_wr, &max_sge, &limit)) return rc;
  attr->max_wr = max_wr;
  attr->max_sge = max_sge;
  attr->srq_limit = limit;
  return 0;
}

int destroy_srq(ibv_srq* ibsrq) noexcept {
  if (!ibsrq) return EINVAL;
  Srq* srq = to_srq(ibsrq);
  if (int rc = to_ctx(ibsrq->context)->core->destroy_srq(srq->info.index)) return rc;
  pthread_cond_destroy(&ibsrq->cond);
  pthread_mutex_destroy(&ibsrq->mutex);
  pd_release(ibsrq->pd);
  delete srq;
  return 0;
}

int post_srq_recv(ibv_srq* ibsrq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  Srq* srq = to_srq(ibsrq);
  LocalContext* core = to_ctx(ibsrq->context)->core;
  int rc = 0;
  bool posted = false;
  {
    BiasingGuard producers(srq->post_lock);
    for (; wr; wr = wr->next) {
      if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > srq->info.max_sge || (wr->num_sge && !wr->sg_list)) {
        rc = EINVAL;
      } else {
        // The SGEs as posted (SgeIn has ibv_sge's layout: recv_queue.h).
        rc = core->post_srq_recv(srq->info, wr->wr_id, reinterpret_cast<const SgeIn*>(wr->sg_list),
                                 static_cast<uint32_t>(wr->num_sge));
      }
      if (rc) {
        if (bad_wr) *bad_wr = wr;
        break;
      }
      posted = true;
    }
  }
  if (posted) core->srq_posted(srq->info);  // a sender may wait for these receives (RNR)
  return rc;
}

int get_srq_num(ibv_srq* ibsrq, uint32_t* srq_num) noexcept {
  if (!ibsrq || !srq_num) return EINVAL;
  *srq_num = to_srq(ibsrq)->info.srq_num;
  return 0;
}

}  // namespace shmrdma::provider
