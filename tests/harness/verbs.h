// Small helpers over the public libibverbs API shared by the tests: open the
// device, move RC QPs through INIT/RTR/RTS, poll and wait for async events
// with deadlines.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <functional>
#include <string>

namespace harness {

// Opens shm0, or the device named by $DP_DEVICE (the tests that place one
// worker of a pair on a second device of the same home set it for that
// worker only: Home::up_device, start_on).
ibv_context* open_shm0(std::string* why);

uint16_t port_lid(ibv_context* ctx);

int qp_to_init(ibv_qp* qp, int access);
int qp_to_rtr(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid, uint8_t min_rnr_timer = 1);
int qp_to_rts(ibv_qp* qp, uint8_t rnr_retry = 7, uint8_t timeout = 14, uint8_t retry_cnt = 7);
int qp_to_err(ibv_qp* qp);
int qp_to_reset(ibv_qp* qp);
// INIT -> RTR -> RTS towards `dest_qpn`; 0 or the first error.
int connect_qp(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid, int access);

// ibv_create_qp of a QP whose send and receive CQ is `cq`, with max_sge
// scatter/gather entries each way and max_inline_data bytes of inline data.
ibv_qp* create_qp(ibv_pd* pd, ibv_cq* cq, ibv_qp_type type, uint32_t max_send_wr, uint32_t max_recv_wr,
                  uint32_t max_sge = 1, uint32_t max_inline_data = 0);

// The QP's state (ibv_query_qp), -1 on error.
int qp_state(ibv_qp* qp);
const char* qp_state_name(int s);

// Polls one completion, up to timeout_ms. False on timeout; a negative
// ibv_poll_cq result is reported in wc->status as -1 cast.
bool poll_one(ibv_cq* cq, ibv_wc* wc, int timeout_ms = 5000);

// Runs body(0) .. body(n - 1) on n threads that start together (each spins
// until all are up) and joins them: posts that race one another.
void all_at_once(uint32_t n, const std::function<void(uint32_t)>& body);

// Polls one completion: its status, or -1 on timeout (*out gets it).
int poll_status(ibv_cq* cq, ibv_wc* out = nullptr, int timeout_ms = 5000);

// Polls until `n` completions arrived or the deadline; returns how many.
int poll_n(ibv_cq* cq, ibv_wc* wc, int n, int timeout_ms = 10000);

std::string wc_str(const ibv_wc& wc);

// Binds a memory window over [addr, addr+len) of `mr` and polls the bind's
// completion on `cq`: type 1 through ibv_bind_mw (wr_id 11), type 2 through
// an IBV_WR_BIND_MW work request with `rkey` (wr_id 12). Returns the
// completion status, 1000 + the errno of a failed post, 2000 for a
// completion of another opcode or wr_id, -1 on timeout.
int bind_mw_type1(ibv_qp* qp, ibv_cq* cq, ibv_mw* mw, ibv_mr* mr, uint8_t* addr, size_t len, unsigned access);
int bind_mw_type2(ibv_qp* qp, ibv_cq* cq, ibv_mw* mw, ibv_mr* mr, uint32_t rkey, uint8_t* addr, size_t len,
                  unsigned access);

// Waits up to timeout_ms for an async event (non-blocking async_fd + poll).
// The event is acknowledged before returning.
bool next_async_event(ibv_context* ctx, ibv_async_event* ev, int timeout_ms);

}  // namespace harness
