// Queue pairs: create/modify/query/destroy and the post verbs.
#include <endian.h>
#include <pthread.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

namespace {

// The enum fields as the integers they hold: callers leave the fields their
// mask does not name uninitialised (librdmacm's ibv_modify_qp to ERR passes
// only qp_state), and loading such garbage as an enum is undefined (UBSan).
template <class E>
uint32_t raw_enum(const E& e) {
  static_assert(sizeof(E) == sizeof(uint32_t));
  uint32_t v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

QpAttr to_core(const ibv_qp_attr& a) {
  QpAttr c;
  c.qp_state = raw_enum(a.qp_state);
  c.cur_qp_state = raw_enum(a.cur_qp_state);
  c.path_mtu = raw_enum(a.path_mtu);
  c.path_mig_state = raw_enum(a.path_mig_state);
  c.qkey = a.qkey;
  c.rq_psn = a.rq_psn;
  c.sq_psn = a.sq_psn;
  c.dest_qp_num = a.dest_qp_num;
  c.qp_access_flags = static_cast<uint32_t>(a.qp_access_flags);
  c.pkey_index = a.pkey_index;
  c.dlid = a.ah_attr.dlid;
  c.sl = a.ah_attr.sl;
  c.src_path_bits = a.ah_attr.src_path_bits;
  c.static_rate = a.ah_attr.static_rate;
  c.is_global = a.ah_attr.is_global;
  c.ah_port_num = a.ah_attr.port_num;
  c.grh = a.ah_attr.grh;
  c.en_sqd_async_notify = a.en_sqd_async_notify;
  c.sq_draining = a.sq_draining;
  c.max_rd_atomic = a.max_rd_atomic;
  c.max_dest_rd_atomic = a.max_dest_rd_atomic;
  c.min_rnr_timer = a.min_rnr_timer;
  c.port_num = a.port_num;
  c.timeout = a.timeout;
  c.retry_cnt = a.retry_cnt;
  c.rnr_retry = a.rnr_retry;
  return c;
}

void from_core(const QpAttr& c, const QpCaps& caps, ibv_qp_attr* a) {
  *a = ibv_qp_attr{};
  a->qp_state = static_cast<ibv_qp_state>(c.qp_state);
  a->cur_qp_state = static_cast<ibv_qp_state>(c.cur_qp_state);
  a->path_mtu = static_cast<ibv_mtu>(c.path_mtu ? c.path_mtu : uint32_t{IBV_MTU_4096});
  a->path_mig_state = static_cast<ibv_mig_state>(c.path_mig_state);
  a->qkey = c.qkey;
  a->rq_psn = c.rq_psn;
  a->sq_psn = c.sq_psn;
  a->dest_qp_num = c.dest_qp_num;
  a->qp_access_flags = static_cast<unsigned>(c.qp_access_flags);
  a->cap.max_send_wr = caps.max_send_wr;
  a->cap.max_recv_wr = caps.max_recv_wr;
  a->cap.max_send_sge = caps.max_send_sge;
  a->cap.max_recv_sge = caps.max_recv_sge;
  a->cap.max_inline_data = caps.max_inline_data;
  a->ah_attr.dlid = c.dlid;
  a->ah_attr.sl = c.sl;
  a->ah_attr.src_path_bits = c.src_path_bits;
  a->ah_attr.static_rate = c.static_rate;
  a->ah_attr.is_global = c.is_global;
  a->ah_attr.port_num = c.ah_port_num;
  a->ah_attr.grh = c.grh;
  a->pkey_index = c.pkey_index;
  a->en_sqd_async_notify = c.en_sqd_async_notify;
  a->sq_draining = c.sq_draining;
  a->max_rd_atomic = c.max_rd_atomic;
  a->max_dest_rd_atomic = c.max_dest_rd_atomic;
  a->min_rnr_timer = c.min_rnr_timer;
  a->port_num = c.port_num;
  a->timeout = c.timeout;
  a->retry_cnt = c.retry_cnt;
  a->rnr_retry = c.rnr_retry;
}

}  // namespace

namespace {

// A WR the core's post_send does not take (UD, XRC_SEND, windows, local
// invalidation, SEND_WITH_INV, errors): converted into a SendWr, queued with
// enqueue_send; the caller's progress() executes it.
int enqueue_general(ibv_qp* ibqp, LocalContext* core, Qp* cqp, const ibv_send_wr* wr) noexcept {
  SendWr w;
  w.wr_id = wr->wr_id;
  w.opcode = wr->opcode;
  w.send_flags = wr->send_flags;
  w.imm_data = wr->imm_data;
  if (wr->opcode == IBV_WR_ATOMIC_CMP_AND_SWP || wr->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    w.remote_addr = wr->wr.atomic.remote_addr;
    w.rkey = wr->wr.atomic.rkey;
    w.compare_add = wr->wr.atomic.compare_add;
    w.swap = wr->wr.atomic.swap;
  } else if (wr->opcode == IBV_WR_BIND_MW) {
    // Type 2 only: type 1 windows are bound with ibv_bind_mw.
    if (!wr->bind_mw.mw || wr->bind_mw.mw->type != IBV_MW_TYPE_2 ||
        fill_bind(ibqp, wr->bind_mw.mw, wr->bind_mw.rkey, wr->bind_mw.bind_info, &w) != 0)
      return EINVAL;
  } else if (wr->opcode == IBV_WR_LOCAL_INV) {
    w.rkey = wr->invalidate_rkey;
  } else if (wr->opcode == IBV_WR_SEND_WITH_INV) {
    w.imm_data = wr->invalidate_rkey;  // the union: host order
  } else if (ibqp->qp_type == IBV_QPT_UD) {
    // wr.ud: the AH's address vector, copied into the WQE by the core.
    w.av = wr->wr.ud.ah ? &to_ah(wr->wr.ud.ah)->av : nullptr;
    w.remote_qpn = wr->wr.ud.remote_qpn;
    w.remote_qkey = wr->wr.ud.remote_qkey;
  } else {
    w.remote_addr = wr->wr.rdma.remote_addr;
    w.rkey = wr->wr.rdma.rkey;
  }
  if (ibqp->qp_type == IBV_QPT_XRC_SEND) w.xrc_srqn = wr->qp_type.xrc.remote_srqn;  // the target's XRC SRQ
  if (wr->num_sge < 0) return EINVAL;
  w.num_sge = static_cast<uint32_t>(wr->num_sge);
  w.sg_list = wr->sg_list;
  return core->enqueue_send(cqp, w);
}

}  // namespace

// post_send_list's general (arg: the ibv_qp), and the leaves' (shmrdma.cc
// gives it to each context: LocalContext::set_leaf_general).
int general_post(void* arg, const ibv_send_wr* wr) noexcept {
  auto* ibqp = static_cast<ibv_qp*>(arg);
  return enqueue_general(ibqp, to_ctx(ibqp->context)->core, to_qp(ibqp)->core, wr);
}

// RC and UC WRITE/SEND/READ/atomics go straight from the ibv_send_wr into the
// send slot and execute within the call (LocalContext::post_send_list); the
// rest is converted here (enqueue_general) and executed by progress() after
// the list.
//
// A single WRITE, SEND, READ or atomic is offered to LocalContext::write_leaf,
// send_leaf, srq_send_leaf, read_leaf or atomic_leaf first: a tail call (each finishes
// the post, what it declines included), so no frame of ours stays between
// ibv_post_send and the leaf. A list goes through the same leaves WR by WR
// (post_leaf_list), the rest from the first they do not take through
// post_send_list.
int post_send(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  Qp* qp = to_qp(ibqp)->core;
  LocalContext* core = to_ctx(ibqp->context)->core;
  if (wr && !wr->next) [[likely]] {
    const uint8_t off = qp->leaf_off.load(std::memory_order_relaxed);  // Qp::leaf_off
    if (wr->opcode == IBV_WR_RDMA_WRITE && !(off & Qp::kLeafQueued)) return core->write_leaf(qp, wr, bad_wr);
    if (wr->opcode == IBV_WR_SEND || wr->opcode == IBV_WR_SEND_WITH_IMM) {
      if (!off) return core->send_leaf(qp, wr, bad_wr);
      if (off == Qp::kLeafSrq) return core->srq_send_leaf(qp, wr, bad_wr);
    }
    if (wr->opcode == IBV_WR_RDMA_READ && !(off & Qp::kLeafQueued)) return core->read_leaf(qp, wr, bad_wr);
    if ((wr->opcode == IBV_WR_ATOMIC_CMP_AND_SWP || wr->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) &&
        !(off & Qp::kLeafQueued))
      return core->atomic_leaf(qp, wr, bad_wr);
    return core->post_send_list(qp, wr, bad_wr, general_post, ibqp);
  }
  return core->post_leaf_list(qp, wr, bad_wr);  // a list: each WR a leaf takes, then the rest
}

// The whole list in one call into the core, the SGEs as the application
// passed them (SgeIn has ibv_sge's layout: recv_queue.h, src/qp.cc).
int post_recv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  return to_ctx(ibqp->context)->core->post_recv_list(to_qp(ibqp)->core, wr, bad_wr);
}

namespace {

// xrcd: the domain of an XRC_RECV QP (which has no PD, CQs or queues).
// XRC_SEND has a PD and a send CQ only.
ibv_qp* create(ibv_context* ibctx, ibv_pd* pd, const ibv_qp_init_attr& attr, void* qp_context,
               ibv_xrcd* xrcd = nullptr) noexcept {
  const bool xrc_recv = attr.qp_type == IBV_QPT_XRC_RECV, xrc_send = attr.qp_type == IBV_QPT_XRC_SEND;
  if (xrc_recv) {
    if (!xrcd || xrcd->context != ibctx) {
      errno = EINVAL;
      return nullptr;
    }
    pd = nullptr;
  } else if (!pd || !attr.send_cq || pd->context != ibctx || attr.send_cq->context != ibctx ||
             (!xrc_send && (!attr.recv_cq || attr.recv_cq->context != ibctx))) {
    errno = EINVAL;
    return nullptr;
  }
  if ((xrc_recv || xrc_send) && attr.srq) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr.srq && attr.srq->context != ibctx) {  // an SRQ of another context (the core checks the PD)
    errno = EINVAL;
    return nullptr;
  }
  QpCreateArgs a;
  a.qp_type = attr.qp_type;
  a.srq = attr.srq ? to_srq(attr.srq)->info.index : layout::kNoIndex;
  a.pd = pd ? to_pd(pd)->index : layout::kNoIndex;
  a.send_cq = xrc_recv ? layout::kNoIndex : to_cq(attr.send_cq)->info.index;
  a.recv_cq = (xrc_recv || xrc_send) ? layout::kNoIndex : to_cq(attr.recv_cq)->info.index;
  a.xrcd = xrc_recv ? to_xrcd(xrcd)->index : layout::kNoIndex;
  a.sq_sig_all = attr.sq_sig_all != 0;
  a.caps.max_send_wr = attr.cap.max_send_wr;
  a.caps.max_recv_wr = attr.cap.max_recv_wr;
  a.caps.max_send_sge = attr.cap.max_send_sge;
  a.caps.max_recv_sge = attr.cap.max_recv_sge;
  a.caps.max_inline_data = attr.cap.max_inline_data;
  auto* qp = new (std::nothrow) QpObj{};
  if (!qp) {
    errno = ENOMEM;
    return nullptr;
  }
  if (int rc = to_ctx(ibctx)->core->create_qp(a, &qp->core)) {
    delete qp;
    errno = rc;
    return nullptr;
  }
  ibv_qp& q = qp->vqp.qp;
  qp->core->user = &q;
  q.context = ibctx;
  q.qp_context = qp_context;
  q.pd = pd;
  q.send_cq = xrc_recv ? nullptr : attr.send_cq;
  q.recv_cq = (xrc_recv || xrc_send) ? nullptr : attr.recv_cq;
  if (xrc_recv) {
    qp->xrcd = a.xrcd;
    qp->vqp.comp_mask |= VERBS_QP_XRCD;
    qp->vqp.xrcd = reinterpret_cast<verbs_xrcd*>(xrcd);
  }
  q.srq = attr.srq;
  q.handle = qp->core->index;
  q.qp_num = qp->core->qpn;
  q.state = IBV_QPS_RESET;
  q.qp_type = attr.qp_type;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  q.events_completed = 0;
  pd_hold(pd);
  return &q;
}

void write_caps(const QpCaps& c, ibv_qp_cap* cap) {
  cap->max_send_wr = c.max_send_wr;
  cap->max_recv_wr = c.max_recv_wr;
  cap->max_send_sge = c.max_send_sge;
  cap->max_recv_sge = c.max_recv_sge;
  cap->max_inline_data = c.max_inline_data;
}

}  // namespace

ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) noexcept {
  if (!attr || !pd) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_qp* q = create(pd->context, pd, *attr, attr->qp_context);
  if (q) write_caps(to_qp(q)->core->caps, &attr->cap);
  return q;
}

ibv_qp* create_qp_ex(ibv_context* ibctx, ibv_qp_init_attr_ex* attr) noexcept {
  if (!attr) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr->comp_mask & ~uint32_t{IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_XRCD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS}) {
    errno = EOPNOTSUPP;  // create flags and RSS come later
    return nullptr;
  }
  const bool qp_ex = attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  if (qp_ex && attr->qp_type != IBV_QPT_RC && attr->qp_type != IBV_QPT_UC && attr->qp_type != IBV_QPT_UD &&
      attr->qp_type != IBV_QPT_XRC_SEND) {
    errno = EOPNOTSUPP;  // the ibv_qp_ex send API exists for RC, UC, UD and XRC_SEND
    return nullptr;
  }
  ibv_xrcd* xrcd = nullptr;
  if (attr->qp_type == IBV_QPT_XRC_RECV) {
    // The receive side of XRC: a domain, no PD (ibv_create_qp_ex(3)).
    if (!(attr->comp_mask & IBV_QP_INIT_ATTR_XRCD) || !attr->xrcd) {
      errno = EINVAL;
      return nullptr;
    }
    xrcd = attr->xrcd;
  } else if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD)) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_qp_init_attr a{};
  a.qp_context = attr->qp_context;
  a.send_cq = attr->send_cq;
  a.recv_cq = attr->recv_cq;
  a.srq = attr->srq;
  a.cap = attr->cap;
  a.qp_type = attr->qp_type;
  a.sq_sig_all = attr->sq_sig_all;
  if (qp_ex && attr->pd && attr->pd->context == ibctx) {
    // Validate the send ops before creating anything (qp_ex.cc).
    if (int rc = init_qp_ex(nullptr, attr->qp_type, attr->send_ops_flags)) {
      errno = rc;
      return nullptr;
    }
  }
  ibv_qp* q = create(ibctx, xrcd ? nullptr : attr->pd, a, attr->qp_context, xrcd);
  if (q && qp_ex) {
    if (int rc = init_qp_ex(to_qp(q), attr->qp_type, attr->send_ops_flags)) {
      (void)destroy_qp(q);
      errno = rc;
      return nullptr;
    }
  }
  if (q) write_caps(to_qp(q)->core->caps, &attr->cap);
  return q;
}

int modify_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int attr_mask) noexcept {
  if (!attr || attr_mask < 0) return EINVAL;
  QpObj* qp = to_qp(ibqp);
  int rc = to_ctx(ibqp->context)->core->modify_qp(qp->core, to_core(*attr), static_cast<uint32_t>(attr_mask));
  if (rc == 0 && (attr_mask & IBV_QP_STATE)) ibqp->state = attr->qp_state;
  return rc;
}

int query_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int, ibv_qp_init_attr* init_attr) noexcept {
  if (!attr) return EINVAL;
  QpObj* qp = to_qp(ibqp);
  QpAttr c;
  to_ctx(ibqp->context)->core->query_qp(qp->core, &c);
  from_core(c, qp->core->caps, attr);
  if (init_attr) {
    *init_attr = ibv_qp_init_attr{};
    init_attr->qp_context = ibqp->qp_context;
    init_attr->send_cq = ibqp->send_cq;
    init_attr->recv_cq = ibqp->recv_cq;
    init_attr->srq = ibqp->srq;
    write_caps(qp->core->caps, &init_attr->cap);
    init_attr->qp_type = ibqp->qp_type;
    init_attr->sq_sig_all = qp->core->sq_sig_all;
  }
  ibqp->state = attr->qp_state;
  return 0;
}

int attach_mcast(ibv_qp* ibqp, const ibv_gid* gid, uint16_t lid) noexcept {
  if (!gid) return EINVAL;
  return to_ctx(ibqp->context)->core->attach_mcast(to_qp(ibqp)->core, gid->raw, lid);
}

int detach_mcast(ibv_qp* ibqp, const ibv_gid* gid, uint16_t lid) noexcept {
  if (!gid) return EINVAL;
  return to_ctx(ibqp->context)->core->detach_mcast(to_qp(ibqp)->core, gid->raw, lid);
}

int destroy_qp(ibv_qp* ibqp) noexcept {
  QpObj* qp = to_qp(ibqp);
  Qp* core_qp = qp->core;
  if (core_qp->user == ibqp && core_qp->handles > 1) core_qp->user = nullptr;  // another handle outlives this one
  if (int rc = to_ctx(ibqp->context)->core->destroy_qp(core_qp, qp->xrcd)) return rc;
  free_qp_ex(qp);  // qp_ex.cc
  pd_release(ibqp->pd);
  delete qp;
  return 0;
}


}  // namespace shmrdma::provider
