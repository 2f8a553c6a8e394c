// The shared-memory transport's private helpers, shared by its parts:
// transport_post.cc (posting, progress, send completions, flushes),
// transport.cc (executing RC/UC/XRC work requests and the one-sided data
// movement), transport_take.cc (the receive-take protocol: a receive WQE of
// the target, taken so that it completes exactly once even when an
// initiator dies) and transport_ud.cc (UD and multicast).
#pragma once

#include <time.h>

#include <cstdint>

#include <infiniband/verbs.h>

#include "layout.h"

namespace shmrdma::transport {

inline uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// IB spec table 45: the RNR NAK timer field encoding, in microseconds.
// Longest RNR back-off (deliver): hardware's shortest RNR timer is 10 us.
constexpr uint64_t kRnrBackoffNs = 10'000;

inline uint64_t rnr_timer_us(uint32_t code) {
  static constexpr uint32_t kTable[32] = {655360, 10,    20,    30,    40,    60,    80,    120,   160,   240,   320,
                                          480,    640,   960,   1280,  1920,  2560,  3840,  5120,  7680,  10240, 15360,
                                          20480,  30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kTable[code & 31];
}

inline uint32_t wc_opcode(uint32_t wr_opcode) {
  switch (wr_opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: return IBV_WC_RDMA_WRITE;
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_SEND_WITH_INV: return IBV_WC_SEND;
    case IBV_WR_BIND_MW: return IBV_WC_BIND_MW;
    case IBV_WR_LOCAL_INV: return IBV_WC_LOCAL_INV;
    case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP: return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD: return IBV_WC_FETCH_ADD;
    default: return IBV_WC_SEND;
  }
}

inline bool is_atomic(uint32_t op) { return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD; }

inline bool consumes_recv(uint32_t op) {
  return op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE_WITH_IMM ||
         op == IBV_WR_SEND_WITH_INV;
}

// Operations the owner executes on its own objects (mw.cc).
inline bool is_local_op(uint32_t op) { return op == IBV_WR_BIND_MW || op == IBV_WR_LOCAL_INV; }


constexpr uint64_t kGrhBytes = 40;  // the GRH area ahead of a UD message

// A receive completion the owner writes itself (flush, abort).
inline layout::Cqe recv_status_cqe(uint64_t wr_id, uint32_t status, uint32_t qpn) {
  layout::Cqe c{};
  c.wr_id = wr_id;
  c.status = status;
  c.opcode = IBV_WC_RECV;
  c.qp_num = qpn;
  return c;
}

}  // namespace shmrdma::transport
