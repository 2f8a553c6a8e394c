#include "verbs.h"

#include <fcntl.h>
#include <poll.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "process.h"

namespace harness {

ibv_context* open_shm0(std::string* why) {
  const char* env = std::getenv("DP_DEVICE");
  const std::string name = env && *env ? env : "shm0";
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) {
    *why = std::string("ibv_get_device_list: ") + std::strerror(errno);
    return nullptr;
  }
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n && !ctx; ++i)
    if (name == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
  if (!ctx) *why = name + " not found among " + std::to_string(n) + " device(s), or ibv_open_device failed";
  ibv_free_device_list(list);
  return ctx;
}

uint16_t port_lid(ibv_context* ctx) {
  ibv_port_attr pa{};
  if (ibv_query_port(ctx, 1, &pa)) return 0;
  return pa.lid;
}

ibv_qp* create_qp(ibv_pd* pd, ibv_cq* cq, ibv_qp_type type, uint32_t max_send_wr, uint32_t max_recv_wr,
                  uint32_t max_sge, uint32_t max_inline_data) {
  ibv_qp_init_attr ia{};
  ia.send_cq = cq;
  ia.recv_cq = cq;
  ia.qp_type = type;
  ia.cap.max_send_wr = max_send_wr;
  ia.cap.max_recv_wr = max_recv_wr;
  ia.cap.max_send_sge = max_sge;
  ia.cap.max_recv_sge = max_sge;
  ia.cap.max_inline_data = max_inline_data;
  return ibv_create_qp(pd, &ia);
}

int qp_to_init(ibv_qp* qp, int access) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = static_cast<unsigned>(access);
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

int qp_to_rtr(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid, uint8_t min_rnr_timer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = dest_qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = min_rnr_timer;
  a.ah_attr.dlid = dlid;
  a.ah_attr.port_num = 1;
  return ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

int qp_to_rts(ibv_qp* qp, uint8_t rnr_retry, uint8_t timeout, uint8_t retry_cnt) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  a.timeout = timeout;
  a.retry_cnt = retry_cnt;
  a.rnr_retry = rnr_retry;
  a.max_rd_atomic = 16;
  return ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_MAX_QP_RD_ATOMIC);
}

int qp_to_err(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

int qp_to_reset(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RESET;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

int connect_qp(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid, int access) {
  if (int rc = qp_to_init(qp, access)) return rc;
  if (int rc = qp_to_rtr(qp, dest_qpn, dlid)) return rc;
  return qp_to_rts(qp);
}

int qp_state(ibv_qp* qp) {
  ibv_qp_attr a{};
  ibv_qp_init_attr ia{};
  if (ibv_query_qp(qp, &a, IBV_QP_STATE, &ia)) return -1;
  return a.qp_state;
}

const char* qp_state_name(int s) {
  switch (s) {
    case IBV_QPS_RESET: return "RESET";
    case IBV_QPS_INIT: return "INIT";
    case IBV_QPS_RTR: return "RTR";
    case IBV_QPS_RTS: return "RTS";
    case IBV_QPS_SQD: return "SQD";
    case IBV_QPS_SQE: return "SQE";
    case IBV_QPS_ERR: return "ERR";
    default: return "?";
  }
}

bool poll_one(ibv_cq* cq, ibv_wc* wc, int timeout_ms) {
  auto deadline = Clock::now() + Ms(timeout_ms);
  for (uint64_t spins = 0;; ++spins) {
    int n = ibv_poll_cq(cq, 1, wc);
    if (n == 1) return true;
    if (n < 0) {
      std::memset(wc, 0, sizeof *wc);
      wc->status = static_cast<ibv_wc_status>(-1);
      return true;
    }
    if (Clock::now() >= deadline) return false;
    if (spins % 64 == 63) std::this_thread::yield();
  }
}

int poll_status(ibv_cq* cq, ibv_wc* out, int timeout_ms) {
  ibv_wc wc{};
  if (!poll_one(cq, &wc, timeout_ms)) return -1;
  if (out) *out = wc;
  return wc.status;
}

int poll_n(ibv_cq* cq, ibv_wc* wc, int n, int timeout_ms) {
  auto deadline = Clock::now() + Ms(timeout_ms);
  int got = 0;
  while (got < n) {
    int k = ibv_poll_cq(cq, n - got, wc + got);
    if (k < 0) return got;
    got += k;
    if (got < n) {
      if (Clock::now() >= deadline) break;
      if (k == 0) std::this_thread::yield();
    }
  }
  return got;
}

std::string wc_str(const ibv_wc& wc) {
  return std::string("{wr_id ") + std::to_string(wc.wr_id) + ", status " + ibv_wc_status_str(wc.status) + " (" +
         std::to_string(static_cast<int>(wc.status)) + "), opcode " + std::to_string(wc.opcode) + ", byte_len " +
         std::to_string(wc.byte_len) + ", wc_flags " + std::to_string(wc.wc_flags) + ", qp_num " +
         std::to_string(wc.qp_num) + "}";
}

bool next_async_event(ibv_context* ctx, ibv_async_event* ev, int timeout_ms) {
  int fl = ::fcntl(ctx->async_fd, F_GETFL);
  if (!(fl & O_NONBLOCK)) ::fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
  auto deadline = Clock::now() + Ms(timeout_ms);
  for (;;) {
    if (ibv_get_async_event(ctx, ev) == 0) {
      ibv_ack_async_event(ev);
      return true;
    }
    int left = ms_left(deadline);
    if (left == 0) return false;
    pollfd p{ctx->async_fd, POLLIN, 0};
    (void)::poll(&p, 1, left);
  }
}

int bind_mw_type1(ibv_qp* qp, ibv_cq* cq, ibv_mw* mw, ibv_mr* mr, uint8_t* addr, size_t len, unsigned access) {
  ibv_mw_bind b{};
  b.wr_id = 11;
  b.send_flags = IBV_SEND_SIGNALED;
  b.bind_info.mr = mr;
  b.bind_info.addr = reinterpret_cast<uintptr_t>(addr);
  b.bind_info.length = len;
  b.bind_info.mw_access_flags = access;
  if (int rc = ibv_bind_mw(qp, mw, &b)) return 1000 + rc;
  ibv_wc wc{};
  int st = poll_status(cq, &wc);
  if (st == IBV_WC_SUCCESS && (wc.opcode != IBV_WC_BIND_MW || wc.wr_id != 11)) return 2000;
  return st;
}

int bind_mw_type2(ibv_qp* qp, ibv_cq* cq, ibv_mw* mw, ibv_mr* mr, uint32_t rkey, uint8_t* addr, size_t len,
                  unsigned access) {
  ibv_send_wr wr{};
  wr.wr_id = 12;
  wr.opcode = IBV_WR_BIND_MW;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.bind_mw.mw = mw;
  wr.bind_mw.rkey = rkey;
  wr.bind_mw.bind_info.mr = mr;
  wr.bind_mw.bind_info.addr = reinterpret_cast<uintptr_t>(addr);
  wr.bind_mw.bind_info.length = len;
  wr.bind_mw.bind_info.mw_access_flags = access;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp, &wr, &bad)) return 1000 + rc;
  ibv_wc wc{};
  int st = poll_status(cq, &wc);
  if (st == IBV_WC_SUCCESS && (wc.opcode != IBV_WC_BIND_MW || wc.wr_id != 12)) return 2000;
  return st;
}

void all_at_once(uint32_t n, const std::function<void(uint32_t)>& body) {
  std::atomic<uint32_t> up{0};
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (uint32_t t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      up.fetch_add(1);
      while (up.load() < n) std::this_thread::yield();  // 2 CPUs: let the others start
      body(t);
    });
  for (auto& th : threads) th.join();
}

}  // namespace harness
