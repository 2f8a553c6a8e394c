// The poll of an SRQ SEND whose bytes came in its completion (layout.h
// SrqInlineCqe): inline here, so that the provider's poll (cq.cc
// poll_staged) takes it without the call into take_staged, and the core's
// (take_staged) the same way.
#pragma once

#include <cstring>

#include "context.h"
#include "mover.h"

namespace shmrdma {

// A small SEND into our QP's SRQ whose bytes came in its completion
// (layout.h SrqInlineCqe; srq_send_leaf took the WQE). The buffer it names
// is checked against our MRs as a receive buffer of the QP's PD (the
// initiator checked it in its copy of our MR table; it may have gone since,
// and the CQE is untrusted), then the bytes go in. A buffer that fails the
// check completes the WQE with IBV_WC_LOC_PROT_ERR and the QP enters the
// error state, as finish_staged's.
[[gnu::always_inline]] inline bool LocalContext::finish_srq_inline(const std::byte* payload, ibv_wc* w) noexcept {
  // The CQE's seven 8-byte words, each read once, and every field taken
  // from them in registers: a copy into a struct whose fields are then
  // loaded made GCC load the address (bytes 12-19) in one load across two
  // of the copy's stores, which waits for both to reach the cache.
  static_assert(offsetof(layout::SrqInlineCqe, addr_lo) == 12 && offsetof(layout::SrqInlineCqe, lkey) == 20 &&
                offsetof(layout::SrqInlineCqe, data4) == 24 && offsetof(layout::SrqInlineCqe, qp_num) == 28 &&
                offsetof(layout::SrqInlineCqe, src_qp_len) == 32 && offsetof(layout::SrqInlineCqe, data0) == 36 &&
                offsetof(layout::SrqInlineCqe, data1) == 40 && offsetof(layout::SrqInlineCqe, slid) == 42 &&
                offsetof(layout::SrqInlineCqe, data2) == 44 && offsetof(layout::SrqInlineCqe, flags) == 46 &&
                offsetof(layout::SrqInlineCqe, take_tag) == 47 && offsetof(layout::SrqInlineCqe, data3) == 48 &&
                sizeof(layout::SrqInlineCqe) == 56 && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
  uint64_t q[7];
  std::memcpy(q, payload, sizeof q);
  const uint32_t qp_num = static_cast<uint32_t>(q[3] >> 32);
  const uint32_t src_qp_len = static_cast<uint32_t>(q[4]);
  const uint8_t flags = static_cast<uint8_t>(q[5] >> 48);
  const uint32_t qi = layout::qpn_index(qp_num);
  if (qi >= layout_.qp_slots) return false;
  const uint64_t qp = staged_rx_[qi].srq_qp.load(std::memory_order_acquire);
  if (qp == 0 || static_cast<uint32_t>(qp) != (qp_num & limits::kQpnMask)) return false;  // not ours (any more)
  const uint32_t pd = static_cast<uint32_t>((qp & ~StagedRx::kSrqQpGone) >> 32);
  const bool imm = flags & layout::kCqeSrqImm;
  const uint32_t len = src_qp_len >> 24;
  const uint64_t addr = q[1] >> 32 | q[2] << 32;
  const uint32_t lkey = static_cast<uint32_t>(q[2] >> 32);
  uint32_t status = IBV_WC_SUCCESS;
  if (len > (imm ? layout::kSrqInlineMaxDataImm : layout::kSrqInlineMaxData)) {
    status = IBV_WC_LOC_LEN_ERR;  // (no initiator of ours sends that)
  } else if (len) {
    if (void* p = const_cast<void*>(resolve_local(lkey, pd, addr, len, kAccessLocalWrite))) {
      // Data bytes 0-3 (data0), 4-5 (data1), 6-7 (data2), 8-15 (data3),
      // 16-19 (data4).
      const uint64_t lo = q[4] >> 32 | (q[5] & 0xffff) << 32 | (q[5] >> 32 & 0xffff) << 48;
      store_upto20(static_cast<uint8_t*>(p), len, lo, q[6], static_cast<uint32_t>(q[3]));
    } else {
      status = IBV_WC_LOC_PROT_ERR;
    }
  }
  if (status != IBV_WC_SUCCESS) staged_responder_error(qi, qp_num & limits::kQpnMask);
  w->wr_id = q[0];
  w->status = static_cast<ibv_wc_status>(status);
  w->opcode = IBV_WC_RECV;
  w->vendor_err = 0;
  w->byte_len = status == IBV_WC_SUCCESS ? len : 0;
  w->imm_data = imm ? static_cast<uint32_t>(q[3]) : 0;  // data4 holds the immediate then
  w->qp_num = qp_num & limits::kQpnMask;
  w->src_qp = src_qp_len & limits::kQpnMask;
  w->wc_flags = imm ? IBV_WC_WITH_IMM : 0;
  w->pkey_index = 0;
  w->slid = static_cast<uint16_t>(q[5] >> 16);
  w->sl = 0;
  w->dlid_path_bits = 0;
  return true;
}

// Position p's slot h holds an SrqInlineCqe (take_cqe left it: its status,
// read once, is in *w): finished into *w and the slot given back. 1, or 0
// when it gives nothing to hand out.
[[gnu::always_inline]] inline int LocalContext::take_srq_inline(const Ring& ring, RingSlotHeader* h, uint32_t p,
                                                                ibv_wc* w) noexcept {
  const bool took = finish_srq_inline(reinterpret_cast<const std::byte*>(h) + kRingSlotHeaderBytes, w);
  ring.release_sc(h, p);
  return took ? 1 : 0;
}

}  // namespace shmrdma
