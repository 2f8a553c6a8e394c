// Private objects of the shmrdma plugin and the ops each file provides.
// Every ibv_* object handed to libibverbs is the first member of one of these
// structs; to_*() downcasts are the only casts between them.
#pragma once

#include <cstddef>
#include <memory>
#include <atomic>
#include <mutex>
#include <vector>

#include "context.h"
#include "pabi.h"

namespace shmrdma::provider {

struct Context {
  verbs_context vctx;  // must be first: libibverbs allocates this struct for us
  LocalContext* core;
  // Device memory this context holds (dm.cc), at most limits::kMaxDmSize.
  // libibverbs zero-allocates the struct: no constructor runs.
  std::atomic<uint64_t> dm_bytes;
};
static_assert(offsetof(Context, vctx) == 0);

struct Pd {
  ibv_pd ibv;
  uint32_t index;  // the core's PD (a parent domain's: its PD's)
  // A parent domain (pd.cc) is a Pd too, so every object created with it
  // uses its PD's index unchanged; `parent` is that PD (nullptr for a PD).
  Pd* parent = nullptr;
  void* pd_context = nullptr;
  std::atomic<uint32_t> parents{0};  // parent domains over this PD: dealloc_pd is EBUSY
  std::atomic<uint32_t> users{0};    // a parent domain's objects: its dealloc_pd is EBUSY
};
// Objects created with a parent domain count on it (a PD's own objects are
// counted by the core).
inline void pd_hold(ibv_pd* p) noexcept {
  if (p && reinterpret_cast<struct Pd*>(p)->parent) reinterpret_cast<struct Pd*>(p)->users.fetch_add(1);
}
inline void pd_release(ibv_pd* p) noexcept {
  if (p && reinterpret_cast<struct Pd*>(p)->parent) reinterpret_cast<struct Pd*>(p)->users.fetch_sub(1);
}
ibv_pd* alloc_parent_domain(ibv_context*, ibv_parent_domain_init_attr*) noexcept;

struct Cq {
  verbs_cq vcq;
  CqInfo info;
  // A CQ ring has one consumer: pollers of one CQ serialise here (and
  // resize). Biased to the thread that polls (biased_lock.h), whose poll
  // then takes it without a locked instruction; its fast paths
  // (try_lock_owner) fall back to poll_contended.
  BiasedLock poll_lock;
  ibv_wc cur{};          // ibv_cq_ex: the completion between start_poll/next_poll and the reads
  uint64_t cur_ts = 0;   // its completion timestamp (device clock: CLOCK_MONOTONIC ns)
  uint64_t last_ts = 0;  // the latest handed out: a CQ's stamps never go back (under poll_lock)
  uint32_t events_reported = 0;  // completion events handed out (under vcq.cq.mutex); destroy waits for their acks
  // Polls of this CQ (a racy count is fine): it spaces out the locked empty
  // polls that watch for a dead producer and the looks for dead peers.
  std::atomic<uint32_t> polls{0};
  // Whether our own send completions may wait in the CQ's private FIFO
  // (LocalCq::ready points here; local_cq.h says when it is 0). The empty
  // poll tests it with the context's qps_pending_ (progress_idle).
  std::atomic<uint32_t> local_ready{0};
  // The context's completions_taken at this CQ's last 1024th poll (cq.cc
  // yield_if_starved; racy, fine).
  std::atomic<uint32_t> yield_taken{0};
  // Where the next completion will be, written under poll_lock after every
  // poll (set_next in cq.cc): the consumer position, kept privately (an
  // empty poll reads no shared index), and the header of its slot, whose
  // sequence word reads next_pos + 1 once that slot is published. Read
  // without the lock by the empty poll (advisory: a stale pair sends it to
  // the locked poll, or misses a completion that the next poll finds); under
  // the lock they are the consumer's cursor (LocalContext::poll_cq_wc). The
  // slot of a ring resize_cq replaced stays mapped (the context's heap)
  // until the context closes.
  std::atomic<uint32_t> next_pos{0};
  std::atomic<RingSlotHeader*> next_slot{nullptr};
  ibv_pd* parent_domain = nullptr;  // ibv_create_cq_ex with IBV_CQ_INIT_ATTR_MASK_PD
};

struct Wq {
  ibv_wq ibv;
  WqInfo info;
  // Every post to this WQ holds it (post_wq_recv): the core's ring then has
  // one producer at a time (LocalContext::post_wq_recv).
  BiasedLock post_lock;
};

struct Dm;
struct Mr {
  verbs_mr vmr;
  MrInfo info;
  Dm* dm = nullptr;  // ibv_reg_dm_mr: the device memory it covers
};

// Device memory (dm.cc): a page-aligned private mapping of this process that
// the application reaches only through ibv_memcpy_to/from_dm and MRs
// registered with ibv_reg_dm_mr (zero-based).
struct Dm {
  ibv_dm ibv;
  uint8_t* base = nullptr;  // aligned as log_align_req asked
  uint64_t length = 0;      // what was asked for
  void* map = nullptr;      // the whole mapping
  size_t map_len = 0;
  uint64_t charged = 0;     // bytes counted in Context::dm_bytes
  std::atomic<uint32_t> mrs{0};  // MRs on it: ibv_free_dm is EBUSY while any exists
};
inline Dm* to_dm(ibv_dm* d) noexcept { return reinterpret_cast<Dm*>(d); }
// dm.cc
ibv_dm* alloc_dm(ibv_context*, ibv_alloc_dm_attr*) noexcept;
int free_dm(ibv_dm*) noexcept;
ibv_mr* reg_dm_mr(ibv_pd*, ibv_dm*, uint64_t, size_t, unsigned int) noexcept;

// A memory window (mr.cc): index of its entry in the core's MR table.
struct Mw {
  ibv_mw ibv;
  uint32_t index;
};
inline Mw* to_mw(ibv_mw* m) noexcept { return reinterpret_cast<Mw*>(m); }

struct QpObj {
  verbs_qp vqp;
  Qp* core;
  uint32_t xrcd = layout::kNoIndex;  // XRC_RECV: the domain this handle came through
  struct WrBatch* batch = nullptr;  // qp_ex.cc, with the ibv_qp_ex API only
};

struct Ah {
  ibv_ah ibv;
  AddressVector av;
};
inline Ah* to_ah(ibv_ah* a) noexcept { return reinterpret_cast<Ah*>(a); }
// ah.cc
ibv_ah* create_ah(ibv_pd*, ibv_ah_attr*) noexcept;
int destroy_ah(ibv_ah*) noexcept;

struct IndTable {
  ibv_rwq_ind_table ibv;
  uint32_t index;
};

struct Srq {
  verbs_srq vsrq;  // vsrq.srq is what the application holds
  SrqInfo info;
  // Every post_srq_recv holds it: the ring's producers one at a time
  // (LocalContext::post_srq_recv reserves without a CAS).
  BiasedLock post_lock;
};

// An XRC domain handle (xrcd.cc): index into the core's domain table.
struct Xrcd {
  verbs_xrcd vxrcd;
  uint32_t index;
};
inline Xrcd* to_xrcd(ibv_xrcd* x) noexcept { return reinterpret_cast<Xrcd*>(x); }
// xrcd.cc
ibv_xrcd* open_xrcd(ibv_context*, ibv_xrcd_init_attr*) noexcept;
int close_xrcd(ibv_xrcd*) noexcept;
ibv_qp* open_qp(ibv_context*, ibv_qp_open_attr*) noexcept;
inline Srq* to_srq(ibv_srq* s) noexcept { return reinterpret_cast<Srq*>(s); }
// srq.cc
ibv_srq* create_srq(ibv_pd*, ibv_srq_init_attr*) noexcept;
ibv_srq* create_srq_ex(ibv_context*, ibv_srq_init_attr_ex*) noexcept;
int modify_srq(ibv_srq*, ibv_srq_attr*, int) noexcept;
int query_srq(ibv_srq*, ibv_srq_attr*) noexcept;
int destroy_srq(ibv_srq*) noexcept;
int post_srq_recv(ibv_srq*, ibv_recv_wr*, ibv_recv_wr**) noexcept;
int get_srq_num(ibv_srq*, uint32_t*) noexcept;
// qp_ex.cc: the ibv_qp_ex post-send API (ibv_wr_*) of a QP created with
// IBV_QP_INIT_ATTR_SEND_OPS_FLAGS. The batch lives behind QpObj::batch.
struct WrBatch;
int init_qp_ex(struct QpObj* qp, uint32_t qp_type, uint64_t send_ops_flags) noexcept;
void free_qp_ex(struct QpObj* qp) noexcept;

inline Context* to_ctx(ibv_context* c) noexcept {
  return reinterpret_cast<Context*>(reinterpret_cast<char*>(c) - offsetof(verbs_context, context));
}
inline Pd* to_pd(ibv_pd* p) noexcept { return reinterpret_cast<Pd*>(p); }
inline Cq* to_cq(ibv_cq* c) noexcept { return reinterpret_cast<Cq*>(c); }
inline Wq* to_wq(ibv_wq* w) noexcept { return reinterpret_cast<Wq*>(w); }
inline Mr* to_mr(verbs_mr* m) noexcept { return reinterpret_cast<Mr*>(m); }
inline QpObj* to_qp(ibv_qp* q) noexcept { return reinterpret_cast<QpObj*>(q); }
inline IndTable* to_ind(ibv_rwq_ind_table* t) noexcept { return reinterpret_cast<IndTable*>(t); }

// device.cc
int query_device_ex(ibv_context*, const ibv_query_device_ex_input*, ibv_device_attr_ex*, size_t) noexcept;
int query_port(ibv_context*, uint8_t, ibv_port_attr*) noexcept;
int query_rt_values(ibv_context*, ibv_values_ex*) noexcept;
// pd.cc
ibv_pd* alloc_pd(ibv_context*) noexcept;
int dealloc_pd(ibv_pd*) noexcept;
// cq.cc
ibv_cq* create_cq(ibv_context*, int, ibv_comp_channel*, int) noexcept;
int destroy_cq(ibv_cq*) noexcept;
int poll_cq(ibv_cq*, int, ibv_wc*) noexcept;
ibv_cq_ex* create_cq_ex(ibv_context*, ibv_cq_init_attr_ex*) noexcept;
int resize_cq(ibv_cq*, int) noexcept;
int req_notify_cq(ibv_cq*, int) noexcept;
void cq_event(ibv_cq*) noexcept;
// mr.cc
ibv_mr* reg_mr(ibv_pd*, void*, size_t, uint64_t, int) noexcept;
int dereg_mr(verbs_mr*) noexcept;
int rereg_mr(verbs_mr*, int, ibv_pd*, void*, size_t, int) noexcept;
int advise_mr(ibv_pd*, ibv_advise_mr_advice, uint32_t, ibv_sge*, uint32_t) noexcept;
ibv_mw* alloc_mw(ibv_pd*, ibv_mw_type) noexcept;
int dealloc_mw(ibv_mw*) noexcept;
int bind_mw(ibv_qp*, ibv_mw*, ibv_mw_bind*) noexcept;
// The fields of an IBV_WR_BIND_MW WQE (mr.cc): EINVAL for objects of
// another context.
int fill_bind(ibv_qp* qp, ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info& info, SendWr* w) noexcept;
// qp.cc
ibv_qp* create_qp(ibv_pd*, ibv_qp_init_attr*) noexcept;
ibv_qp* create_qp_ex(ibv_context*, ibv_qp_init_attr_ex*) noexcept;
int modify_qp(ibv_qp*, ibv_qp_attr*, int) noexcept;
int query_qp(ibv_qp*, ibv_qp_attr*, int, ibv_qp_init_attr*) noexcept;
int destroy_qp(ibv_qp*) noexcept;
int attach_mcast(ibv_qp*, const ibv_gid*, uint16_t) noexcept;
int detach_mcast(ibv_qp*, const ibv_gid*, uint16_t) noexcept;
int post_send(ibv_qp*, ibv_send_wr*, ibv_send_wr**) noexcept;
// What post_send_list does not take itself, converted and queued (qp.cc).
int general_post(void* arg, const ibv_send_wr* wr) noexcept;
int post_recv(ibv_qp*, ibv_recv_wr*, ibv_recv_wr**) noexcept;
// wq.cc
ibv_wq* create_wq(ibv_context*, ibv_wq_init_attr*) noexcept;
int modify_wq(ibv_wq*, ibv_wq_attr*) noexcept;
int destroy_wq(ibv_wq*) noexcept;
ibv_rwq_ind_table* create_rwq_ind_table(ibv_context*, ibv_rwq_ind_table_init_attr*) noexcept;
int destroy_rwq_ind_table(ibv_rwq_ind_table*) noexcept;

}  // namespace shmrdma::provider
