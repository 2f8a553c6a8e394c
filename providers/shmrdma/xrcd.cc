// XRC domains (ibv_open_xrcd / ibv_close_xrcd) and ibv_open_qp. The domain
// itself (identity, sharing between processes, O_CREAT/O_EXCL) is the
// core's: src/xrcd.cc.
#include <fcntl.h>
#include <pthread.h>

#include <cerrno>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

ibv_xrcd* open_xrcd(ibv_context* ibctx, ibv_xrcd_init_attr* attr) noexcept {
  // Like the kernel command: both the descriptor and the flags are required
  // (fd -1: a private domain).
  if (!attr || (attr->comp_mask & ~uint32_t{IBV_XRCD_INIT_ATTR_RESERVED - 1})) {
    errno = attr ? EOPNOTSUPP : EINVAL;
    return nullptr;
  }
  if (!(attr->comp_mask & IBV_XRCD_INIT_ATTR_FD) || !(attr->comp_mask & IBV_XRCD_INIT_ATTR_OFLAGS)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* x = new (std::nothrow) Xrcd{};
  if (!x) {
    errno = ENOMEM;
    return nullptr;
  }
  if (int rc = to_ctx(ibctx)->core->open_xrcd(attr->fd, static_cast<uint32_t>(attr->oflags), &x->index)) {
    delete x;
    errno = rc;
    return nullptr;
  }
  x->vxrcd.xrcd.context = ibctx;
  x->vxrcd.comp_mask = 0;
  x->vxrcd.handle = x->index;
  return &x->vxrcd.xrcd;
}

int close_xrcd(ibv_xrcd* ibxrcd) noexcept {
  if (!ibxrcd) return EINVAL;
  Xrcd* x = to_xrcd(ibxrcd);
  if (int rc = to_ctx(ibxrcd->context)->core->close_xrcd(x->index)) return rc;  // EBUSY while SRQs/QPs use it
  delete x;
  return 0;
}

ibv_qp* open_qp(ibv_context* ibctx, ibv_qp_open_attr* attr) noexcept {
  if (!attr || (attr->comp_mask & ~uint32_t{IBV_QP_OPEN_ATTR_RESERVED - 1})) {
    errno = attr ? EOPNOTSUPP : EINVAL;
    return nullptr;
  }
  constexpr uint32_t kNeed = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  if ((attr->comp_mask & kNeed) != kNeed || !attr->xrcd || attr->xrcd->context != ibctx ||
      attr->qp_type != IBV_QPT_XRC_RECV) {
    errno = EINVAL;
    return nullptr;
  }
  auto* qp = new (std::nothrow) QpObj{};
  if (!qp) {
    errno = ENOMEM;
    return nullptr;
  }
  Xrcd* x = to_xrcd(attr->xrcd);
  if (int rc = to_ctx(ibctx)->core->open_qp(attr->qp_num, x->index, &qp->core)) {
    delete qp;
    errno = rc;
    return nullptr;
  }
  qp->xrcd = x->index;
  ibv_qp& q = qp->vqp.qp;
  q.context = ibctx;
  q.qp_context = (attr->comp_mask & IBV_QP_OPEN_ATTR_CONTEXT) ? attr->qp_context : nullptr;
  q.handle = qp->core->index;
  q.qp_num = qp->core->qpn;
  q.state = static_cast<ibv_qp_state>(qp->core->state());
  q.qp_type = IBV_QPT_XRC_RECV;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  q.events_completed = 0;
  qp->vqp.comp_mask |= VERBS_QP_XRCD;
  qp->vqp.xrcd = &x->vxrcd;
  return &q;
}

}  // namespace shmrdma::provider
