// The ibv_qp_ex post-send API (ibv_wr_start / ibv_wr_* / ibv_wr_complete)
// for RC, UC, UD and XRC_SEND QPs created with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.
//
// A batch is private to the QP until wr_complete: builders append WQEs (with
// the wr_id and wr_flags the application set in the ibv_qp_ex at builder
// time) and setters attach their data; nothing reaches the send queue
// before wr_complete, which hands the WQEs in order to the core
// (enqueue_send, then progress). The first error - a builder's or setter's
// remembered error, or the core refusing a WQE - stops the batch there: that
// WQE and everything after it are not posted, and wr_complete returns the
// error. wr_abort discards the batch.
//
// Inline data is copied into the batch when the setter is called (the
// application may reuse its buffer at once); SGEs are only recorded.
//
// Threading: wr_start takes the QP's batch lock and wr_complete/wr_abort
// release it, so batches of different threads on one QP serialise; the
// builders and setters are called by the thread that called wr_start.
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "provider.h"

namespace shmrdma::provider {

namespace {

constexpr uint64_t kSupportedOps = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
                                   IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
                                   IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
                                   IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_SEND_WITH_INV;

struct PendingWr {
  SendWr wr;              // sg_list is filled in at wr_complete
  uint32_t sge_begin = 0;  // into WrBatch::sges
  uint32_t sge_count = 0;
  uint32_t inl_begin = 0;  // into WrBatch::inl
  uint32_t inl_len = 0;
  bool inl = false;
  int err = 0;            // remembered builder/setter error
};

}  // namespace

struct WrBatch {
  uint64_t ops = 0;  // IBV_QP_EX_WITH_* the QP was created with
  std::mutex lock;   // held from wr_start to wr_complete / wr_abort
  std::atomic<std::thread::id> owner{};
  std::vector<PendingWr> wrs;
  std::vector<ibv_sge> sges;
  std::vector<uint8_t> inl;
  int err = 0;          // an error not tied to one WQE (a setter without a builder)
  size_t err_at = 0;    // ... and where in the batch it happened

  void clear() noexcept {
    wrs.clear();
    sges.clear();
    inl.clear();
    err = 0;
    err_at = 0;
  }
};

namespace {

QpObj* obj(ibv_qp_ex* qx) noexcept { return reinterpret_cast<QpObj*>(qx); }

// The batch when the calling thread has one open, else nullptr.
WrBatch* open_batch(ibv_qp_ex* qx) noexcept {
  WrBatch* b = obj(qx)->batch;
  if (!b || b->owner.load(std::memory_order_relaxed) != std::this_thread::get_id()) return nullptr;
  return b;
}

void note_batch_error(WrBatch* b, int err) noexcept {
  if (!b->err) {
    b->err = err;
    b->err_at = b->wrs.size();
  }
}

// Appends a WQE of `opcode` (needs `op_flag` among the QP's send ops).
PendingWr* build(ibv_qp_ex* qx, uint32_t opcode, uint64_t op_flag) noexcept {
  WrBatch* b = open_batch(qx);
  if (!b) return nullptr;
  try {
    b->wrs.emplace_back();
  } catch (const std::bad_alloc&) {
    note_batch_error(b, ENOMEM);
    return nullptr;
  }
  PendingWr& w = b->wrs.back();
  w.wr.wr_id = qx->wr_id;
  w.wr.send_flags = qx->wr_flags & ~uint32_t{IBV_SEND_INLINE};  // inline comes from the inline setters
  w.wr.opcode = opcode;
  if (!(b->ops & op_flag)) w.err = EINVAL;  // not among the send ops the QP was created with
  return &w;
}

// The WQE the setters apply to: the last one built.
PendingWr* current(ibv_qp_ex* qx, WrBatch** out) noexcept {
  WrBatch* b = open_batch(qx);
  *out = b;
  if (!b) return nullptr;
  if (b->wrs.empty()) {
    note_batch_error(b, EINVAL);  // a setter before any builder
    return nullptr;
  }
  return &b->wrs.back();
}

void wr_start(ibv_qp_ex* qx) noexcept {
  WrBatch* b = obj(qx)->batch;
  if (!b) return;
  if (b->owner.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
    b->clear();  // a second wr_start without complete/abort starts over
    return;
  }
  b->lock.lock();
  b->owner.store(std::this_thread::get_id(), std::memory_order_relaxed);
  b->clear();
}

void end_batch(WrBatch* b) noexcept {
  b->clear();
  b->owner.store(std::thread::id{}, std::memory_order_relaxed);
  b->lock.unlock();
}

int wr_complete(ibv_qp_ex* qx) noexcept {
  WrBatch* b = open_batch(qx);
  if (!b) return EINVAL;  // no wr_start on this thread
  QpObj* qp = obj(qx);
  LocalContext* core = to_ctx(qx->qp_base.context)->core;
  int rc = 0;
  size_t posted = 0;
  for (size_t i = 0; i < b->wrs.size(); ++i) {
    if (b->err && i >= b->err_at) break;
    PendingWr& w = b->wrs[i];
    if (w.err) {
      rc = w.err;
      break;
    }
    ibv_sge inline_sge;
    if (w.inl) {
      inline_sge = ibv_sge{reinterpret_cast<uint64_t>(b->inl.data() + w.inl_begin), w.inl_len, 0};
      w.wr.send_flags |= IBV_SEND_INLINE;
      w.wr.num_sge = w.inl_len ? 1 : 0;
      w.wr.sg_list = &inline_sge;
    } else {
      w.wr.num_sge = w.sge_count;
      w.wr.sg_list = w.sge_count ? b->sges.data() + w.sge_begin : nullptr;
    }
    rc = core->enqueue_send(qp->core, w.wr);
    if (rc) break;
    ++posted;
  }
  if (!rc && b->err) rc = b->err;
  end_batch(b);
  if (posted) core->progress(qp->core);
  return rc;
}

void wr_abort(ibv_qp_ex* qx) noexcept {
  WrBatch* b = open_batch(qx);
  if (b) end_batch(b);
}

// ---------------------------------------------------------------- builders

void wr_rdma_write(ibv_qp_ex* qx, uint32_t rkey, uint64_t remote_addr) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_RDMA_WRITE, IBV_QP_EX_WITH_RDMA_WRITE)) {
    w->wr.rkey = rkey;
    w->wr.remote_addr = remote_addr;
  }
}

void wr_rdma_write_imm(ibv_qp_ex* qx, uint32_t rkey, uint64_t remote_addr, __be32 imm) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM)) {
    w->wr.rkey = rkey;
    w->wr.remote_addr = remote_addr;
    w->wr.imm_data = imm;
  }
}

void wr_send(ibv_qp_ex* qx) noexcept { (void)build(qx, IBV_WR_SEND, IBV_QP_EX_WITH_SEND); }

void wr_send_imm(ibv_qp_ex* qx, __be32 imm) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_SEND_WITH_IMM, IBV_QP_EX_WITH_SEND_WITH_IMM)) w->wr.imm_data = imm;
}

void wr_rdma_read(ibv_qp_ex* qx, uint32_t rkey, uint64_t remote_addr) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_RDMA_READ, IBV_QP_EX_WITH_RDMA_READ)) {
    w->wr.rkey = rkey;
    w->wr.remote_addr = remote_addr;
  }
}

void wr_atomic_cmp_swp(ibv_qp_ex* qx, uint32_t rkey, uint64_t remote_addr, uint64_t compare, uint64_t swap) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP)) {
    w->wr.rkey = rkey;
    w->wr.remote_addr = remote_addr;
    w->wr.compare_add = compare;
    w->wr.swap = swap;
  }
}

void wr_atomic_fetch_add(ibv_qp_ex* qx, uint32_t rkey, uint64_t remote_addr, uint64_t add) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)) {
    w->wr.rkey = rkey;
    w->wr.remote_addr = remote_addr;
    w->wr.compare_add = add;
  }
}

// Builders of operations shmrdma does not implement: the WQE fails.
void unsupported(ibv_qp_ex* qx) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_SEND, 0)) w->err = EOPNOTSUPP;
}
// Memory windows: type 2 binds (type 1 windows are bound with ibv_bind_mw),
// local invalidation, SEND with invalidate (the rkey in the receiver's
// completion).
void wr_bind_mw(ibv_qp_ex* qx, ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info* info) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_BIND_MW, IBV_QP_EX_WITH_BIND_MW)) {
    if (!mw || !info || mw->type != IBV_MW_TYPE_2 || fill_bind(&obj(qx)->vqp.qp, mw, rkey, *info, &w->wr) != 0) {
      if (!w->err) w->err = EINVAL;
    }
  }
}
void wr_local_inv(ibv_qp_ex* qx, uint32_t invalidate_rkey) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_LOCAL_INV, IBV_QP_EX_WITH_LOCAL_INV)) w->wr.rkey = invalidate_rkey;
}
void wr_send_inv(ibv_qp_ex* qx, uint32_t invalidate_rkey) noexcept {
  if (PendingWr* w = build(qx, IBV_WR_SEND_WITH_INV, IBV_QP_EX_WITH_SEND_WITH_INV)) w->wr.imm_data = invalidate_rkey;
}
void wr_send_tso(ibv_qp_ex* qx, void*, uint16_t, uint16_t) noexcept { unsupported(qx); }
void wr_atomic_write(ibv_qp_ex* qx, uint32_t, uint64_t, const void*) noexcept { unsupported(qx); }
// The destination of a UD WQE (the AH must live until wr_complete); on
// other transports the WQE fails.
void wr_set_ud_addr(ibv_qp_ex* qx, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) noexcept {
  WrBatch* b;
  PendingWr* w = current(qx, &b);
  if (!w) return;
  if (obj(qx)->vqp.qp.qp_type != IBV_QPT_UD || !ah) {
    w->err = EINVAL;
    return;
  }
  w->wr.av = &to_ah(ah)->av;
  w->wr.remote_qpn = remote_qpn;
  w->wr.remote_qkey = remote_qkey;
}
// XRC_SEND: the SRQ at the target that the WQE is for.
void wr_set_xrc_srqn(ibv_qp_ex* qx, uint32_t remote_srqn) noexcept {
  WrBatch* b;
  PendingWr* w = current(qx, &b);
  if (!w) return;
  if (obj(qx)->vqp.qp.qp_type != IBV_QPT_XRC_SEND) {
    w->err = EINVAL;
    return;
  }
  w->wr.xrc_srqn = remote_srqn;
}

// ----------------------------------------------------------------- setters

bool reads_into_local(uint32_t op) {
  return op == IBV_WR_RDMA_READ || op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

void set_sges(ibv_qp_ex* qx, size_t n, const ibv_sge* list) noexcept {
  WrBatch* b;
  PendingWr* w = current(qx, &b);
  if (!w) return;
  if (n > obj(qx)->core->caps.max_send_sge || (n && !list)) {
    if (!w->err) w->err = EINVAL;
    return;
  }
  try {
    w->sge_begin = static_cast<uint32_t>(b->sges.size());
    b->sges.insert(b->sges.end(), list, list + n);
  } catch (const std::bad_alloc&) {
    if (!w->err) w->err = ENOMEM;
    return;
  }
  w->sge_count = static_cast<uint32_t>(n);
  w->inl = false;
  w->inl_len = 0;
}

void wr_set_sge(ibv_qp_ex* qx, uint32_t lkey, uint64_t addr, uint32_t length) noexcept {
  ibv_sge s{addr, length, lkey};
  set_sges(qx, 1, &s);
}

void wr_set_sge_list(ibv_qp_ex* qx, size_t num_sge, const ibv_sge* sg_list) noexcept {
  set_sges(qx, num_sge, sg_list);
}

void set_inline(ibv_qp_ex* qx, size_t n, const ibv_data_buf* bufs) noexcept {
  WrBatch* b;
  PendingWr* w = current(qx, &b);
  if (!w) return;
  if (reads_into_local(w->wr.opcode) || (n && !bufs)) {  // inline data is for operations that send data
    if (!w->err) w->err = EINVAL;
    return;
  }
  uint64_t total = 0;
  for (size_t k = 0; k < n; ++k) {
    if (bufs[k].length && !bufs[k].addr) {
      if (!w->err) w->err = EINVAL;
      return;
    }
    total += bufs[k].length;
  }
  if (total > obj(qx)->core->caps.max_inline_data) {
    if (!w->err) w->err = EINVAL;
    return;
  }
  try {
    w->inl_begin = static_cast<uint32_t>(b->inl.size());
    for (size_t k = 0; k < n; ++k) {
      auto* p = static_cast<const uint8_t*>(bufs[k].addr);
      b->inl.insert(b->inl.end(), p, p + bufs[k].length);
    }
  } catch (const std::bad_alloc&) {
    if (!w->err) w->err = ENOMEM;
    return;
  }
  w->inl = true;
  w->inl_len = static_cast<uint32_t>(total);
  w->sge_count = 0;
}

void wr_set_inline_data(ibv_qp_ex* qx, void* addr, size_t length) noexcept {
  ibv_data_buf d{addr, length};
  set_inline(qx, 1, &d);
}

void wr_set_inline_data_list(ibv_qp_ex* qx, size_t num_buf, const ibv_data_buf* buf_list) noexcept {
  set_inline(qx, num_buf, buf_list);
}

}  // namespace

int init_qp_ex(QpObj* qp, uint32_t qp_type, uint64_t send_ops_flags) noexcept {
  if (send_ops_flags & ~kSupportedOps) return EOPNOTSUPP;  // TSO, atomic write...
  // What each transport can do (IBA table 4).
  constexpr uint64_t kUcOps = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |
                              IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV |
                              IBV_QP_EX_WITH_SEND_WITH_INV;
  constexpr uint64_t kUdOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
  if (qp_type == IBV_QPT_UC && (send_ops_flags & ~kUcOps)) return EOPNOTSUPP;
  if (qp_type == IBV_QPT_UD && (send_ops_flags & ~kUdOps)) return EOPNOTSUPP;
  if (!qp) return 0;                                        // validation only
  auto* b = new (std::nothrow) WrBatch();
  if (!b) return ENOMEM;
  b->ops = send_ops_flags;
  qp->batch = b;
  ibv_qp_ex& x = qp->vqp.qp_ex;
  x.comp_mask = 0;
  x.wr_id = 0;
  x.wr_flags = 0;
  x.wr_atomic_cmp_swp = wr_atomic_cmp_swp;
  x.wr_atomic_fetch_add = wr_atomic_fetch_add;
  x.wr_bind_mw = wr_bind_mw;
  x.wr_local_inv = wr_local_inv;
  x.wr_rdma_read = wr_rdma_read;
  x.wr_rdma_write = wr_rdma_write;
  x.wr_rdma_write_imm = wr_rdma_write_imm;
  x.wr_send = wr_send;
  x.wr_send_imm = wr_send_imm;
  x.wr_send_inv = wr_send_inv;
  x.wr_send_tso = wr_send_tso;
  x.wr_set_ud_addr = wr_set_ud_addr;
  x.wr_set_xrc_srqn = wr_set_xrc_srqn;
  x.wr_set_inline_data = wr_set_inline_data;
  x.wr_set_inline_data_list = wr_set_inline_data_list;
  x.wr_set_sge = wr_set_sge;
  x.wr_set_sge_list = wr_set_sge_list;
  x.wr_start = wr_start;
  x.wr_complete = wr_complete;
  x.wr_abort = wr_abort;
  x.wr_atomic_write = wr_atomic_write;
  qp->vqp.comp_mask |= VERBS_QP_EX;  // ibv_qp_to_qp_ex() checks it
  return 0;
}

void free_qp_ex(QpObj* qp) noexcept {
  delete qp->batch;
  qp->batch = nullptr;
}

}  // namespace shmrdma::provider
