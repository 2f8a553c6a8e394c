// Completion queues.
#include <algorithm>
#include <cerrno>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

static_assert(kWcSuccess == IBV_WC_SUCCESS && kWcWrFlushErr == IBV_WC_WR_FLUSH_ERR && kWcOpRecv == IBV_WC_RECV,
              "the core's completion codes are libibverbs' values");

ibv_cq* create_cq(ibv_context* ibctx, int cqe, ibv_comp_channel* channel, int comp_vector) noexcept {
  if (cqe < 1 || static_cast<uint32_t>(cqe) > limits::kMaxCqe || comp_vector < 0 ||
      static_cast<uint32_t>(comp_vector) >= limits::kNumCompVectors) {
    errno = EINVAL;
    return nullptr;
  }
  if (channel) {
    // Completion events need the event path that comes with the data path.
    errno = EOPNOTSUPP;
    return nullptr;
  }
  auto* cq = new (std::nothrow) Cq{};
  if (!cq) {
    errno = ENOMEM;
    return nullptr;
  }
  if (int rc = to_ctx(ibctx)->core->create_cq(static_cast<uint32_t>(cqe), &cq->info)) {
    delete cq;
    errno = rc;
    return nullptr;
  }
  cq->vcq.cq.context = ibctx;
  cq->vcq.cq.cqe = static_cast<int>(cq->info.capacity);
  cq->vcq.cq.handle = cq->info.index;
  to_ctx(ibctx)->core->set_cq_user(cq->info.index, &cq->vcq.cq);
  return &cq->vcq.cq;
}

int destroy_cq(ibv_cq* ibcq) noexcept {
  Cq* cq = to_cq(ibcq);
  if (int rc = to_ctx(ibcq->context)->core->destroy_cq(cq->info.index)) return rc;
  delete cq;
  return 0;
}

int poll_cq(ibv_cq* ibcq, int num_entries, ibv_wc* wc) noexcept {
  if (num_entries < 0 || (num_entries > 0 && !wc)) return -EINVAL;
  Cq* cq = to_cq(ibcq);
  constexpr int kBatch = 16;
  layout::Cqe buf[kBatch];
  to_ctx(ibcq->context)->core->progress_all();  // queued sends waiting for a receiver, peers' error reports
  std::lock_guard lk(cq->poll_lock);
  int done = 0;
  while (done < num_entries) {
    int n = to_ctx(ibcq->context)->core->poll_cq(cq->info, std::min(kBatch, num_entries - done), buf);
    for (int i = 0; i < n; ++i) {
      // Completions may come from peers: clamp what we hand to the application.
      const layout::Cqe& c = buf[i];
      ibv_wc& w = wc[done + i];
      w = ibv_wc{};
      w.wr_id = c.wr_id;
      w.status = c.status <= IBV_WC_TM_RNDV_INCOMPLETE ? static_cast<ibv_wc_status>(c.status) : IBV_WC_GENERAL_ERR;
      w.opcode = static_cast<ibv_wc_opcode>(c.opcode);
      w.vendor_err = c.vendor_err;
      w.byte_len = c.byte_len;
      w.imm_data = c.imm_data;
      w.qp_num = c.qp_num & limits::kQpnMask;
      w.src_qp = c.src_qp & limits::kQpnMask;
      w.wc_flags = c.wc_flags;
      w.pkey_index = c.pkey_index;
      w.slid = c.slid;
      w.sl = c.sl & 0xf;
      w.dlid_path_bits = c.dlid_path_bits;
    }
    done += n;
    if (n < std::min(kBatch, num_entries - done + n)) break;
  }
  return done;
}

}  // namespace shmrdma::provider
