#include "context.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "async.h"
#include "device_setup.h"
#include "mapped.h"
#include "proc.h"

namespace shmrdma {

int LocalContext::open(const DevicePaths& paths, uint64_t heap_size, std::unique_ptr<LocalContext>* out) noexcept {
  std::unique_ptr<LocalContext> c(new (std::nothrow) LocalContext());
  if (!c) return ENOMEM;
  int rc = Registry::attach(paths, &c->registry_);
  if (rc) return rc;
  c->dir_.init(paths.home, &c->registry_);
  if (!c->dir_.self()) return ENOMEM;
  std::string segment;
  rc = c->registry_.register_context(&c->slot_, &c->generation_, &segment);
  if (rc) return rc;
  c->layout_ = layout::compute_context_layout(heap_size);
  rc = Mapping::create(paths.device_dir + "/" + segment, c->layout_.total_size, layout::SegmentKind::kContext, &c->map_);
  if (rc) {
    c->registry_.unregister_context(c->slot_, c->generation_);
    return rc;
  }
  try {
    c->pds_.resize(c->layout_.pd_slots);
    c->cqs_.resize(c->layout_.cq_slots);
    c->wqs_.resize(c->layout_.wq_slots);
    c->inds_.resize(c->layout_.ind_slots);
    c->mrs_.resize(c->layout_.mr_slots);
    c->mr_slots_ = static_cast<uint32_t>(c->mrs_.size());
    c->qps_.resize(c->layout_.qp_slots);
    c->live_qps_.reserve(c->layout_.qp_slots);
    c->staged_rx_.reset(new StagedRx[c->layout_.qp_slots]);
    // SHMRDMA_STAGED_SEND=0: SENDs take the receiver's WQE themselves, as
    // into a QP with an SRQ (to compare, and to test that path).
    const char* staged = std::getenv("SHMRDMA_STAGED_SEND");
    c->staged_send_ = !(staged && std::strcmp(staged, "0") == 0);
  } catch (const std::bad_alloc&) {
    return ENOMEM;  // the destructor removes the segment and the slot
  }
  layout::ContextHeader* h = c->header();
  h->slot_index = c->slot_;
  h->slot_generation = c->generation_;
  h->pd_slots = c->layout_.pd_slots;
  h->cq_slots = c->layout_.cq_slots;
  h->wq_slots = c->layout_.wq_slots;
  h->ind_slots = c->layout_.ind_slots;
  h->pd_table = c->layout_.pd_table;
  h->cq_table = c->layout_.cq_table;
  h->wq_table = c->layout_.wq_table;
  h->ind_table = c->layout_.ind_table;
  h->mr_slots = c->layout_.mr_slots;
  h->qp_slots = c->layout_.qp_slots;
  h->srq_slots = c->layout_.srq_slots;
  h->mr_table = c->layout_.mr_table;
  h->qp_table = c->layout_.qp_table;
  h->srq_table = c->layout_.srq_table;
  h->heap_offset = c->layout_.heap_offset;
  h->heap_size = c->layout_.heap_size;
  h->counters = c->layout_.counters;
  h->qp_counters = c->layout_.qp_counters;
  c->cnt_.attach(c->map_.at<layout::ContextCounters>(c->layout_.counters),
                 c->map_.at<layout::QpCounterRecord>(c->layout_.qp_counters), c->layout_.qp_slots,
                 c->registry_.device(), &c->dir_);
  // Tables start zeroed (a new file reads as zeros): every entry is kFree.
  c->heap_.reset(c->layout_.heap_offset, c->layout_.heap_size);
  rc = create_async_fifo(c->map_.path() + kAsyncSuffix, &c->async_read_fd_, &c->async_write_fd_);
  if (rc) return rc;  // the destructor removes the segment and the slot
  c->self_peer_.async_path = c->map_.path() + kAsyncSuffix;
  c->self_peer_.segment_path = c->map_.path();
  c->self_peer_.device = c->dir_.self();
  c->self_peer_.registry = &c->registry_;
  c->self_peer_.home_id = c->dir_.self_id();
  c->self_peer_.slot = c->slot_;
  c->self_peer_.generation = c->generation_;
  c->holder_word_ = layout::holder_word(layout::make_holder(c->dir_.self_id(), c->slot_), c->generation_);
  c->self_peer_.pid = self_process().pid;
  c->self_peer_.start_time = self_process().start_time;
  c->self_peer_.self_process = true;
  c->self_peer_.base = static_cast<char*>(c->map_.base());
  c->self_peer_.size = c->map_.size();
  c->self_peer_.layout = c->layout_;
  c->map_.publish();
  c->counting_ = true;
  *out = std::move(c);
  return 0;
}

LocalContext::~LocalContext() {
  stop_progress();   // first: the progress thread runs progress_pending on this context
  close_channels();  // cq.cc: channel FIFOs the application did not destroy
  for (const CqState& c : cqs_)
    if (c.live) LocalCq::destroy(c.info.local);  // CQs the application did not destroy
  for (const XrcdState& x : xrcds_)
    if (x.live && x.lock_fd >= 0) ::close(x.lock_fd);  // XRC domains the application did not close
  for (const MrState& m : mrs_)
    if (m.live && m.region.memfd >= 0) release_region(m.region);  // MRs the application did not deregister
  if (async_read_fd_ >= 0) ::close(async_read_fd_);
  if (async_write_fd_ >= 0) ::close(async_write_fd_);
  // What this context counted goes into the registry's per-port totals in
  // the critical section that frees the slot (counters.h), before the
  // segment goes: a reader summing under the registry lock sees it exactly once.
  const bool counted = counting_ && registry_.valid();
  std::vector<uint32_t> foreign;
  if (registry_.valid()) {
    std::vector<PortCounters> totals;
    if (counting_) {
      foreign = cnt_.fold_foreign();  // what we counted for other devices of the home goes to them
      totals = cnt_.totals();
    }
    registry_.unregister_context(slot_, generation_, totals.data(), static_cast<uint32_t>(totals.size()));
  }
  if (map_.base()) {
    std::string path = map_.path();
    map_.reset();
    ::unlink(path.c_str());
    ::unlink((path + kAsyncSuffix).c_str());
  }
  if (counted) (void)refresh_counters(registry_, nullptr);  // the sysfs snapshot (device_setup.cc)
  for (uint32_t id : foreign)  // and theirs
    if (HomeDevice* d = dir_.by_id(id); d && !d->self) (void)refresh_counters(*d->registry, nullptr);
}

int LocalContext::charge(layout::ObjKind k, uint32_t limit) noexcept {
  return registry_.charge(slot_, generation_, k, limit);
}

void LocalContext::uncharge(layout::ObjKind k) noexcept { registry_.uncharge(slot_, generation_, k); }

uint64_t LocalContext::heap_alloc(uint64_t bytes) noexcept {
  uint64_t align = bytes >= layout::kPageSize ? layout::kPageSize : layout::kCacheLine;
  return heap_.allocate(bytes, align);
}

int LocalContext::alloc_ring(uint32_t capacity, uint32_t stride, Ring* ring, uint64_t* off,
                             uint64_t* bytes) noexcept {
  uint64_t n = Ring::bytes_for(capacity, stride);
  if (n == 0) return EINVAL;
  uint64_t o = heap_alloc(n);
  if (!o) return ENOMEM;
  auto* rs = map_.at<RingShared>(o);
  auto r = Ring::format(rs, Ring::slots_after(rs), capacity, stride);
  if (!r) {
    heap_free(o, n);
    return EINVAL;
  }
  *ring = *r;
  *off = o;
  *bytes = n;
  return 0;
}

void LocalContext::heap_free(uint64_t off, uint64_t bytes) noexcept {
  // Give the pages back before the range can be reused, so a destroyed
  // queue's memory does not stay charged to tmpfs, then zero what remains
  // (partial pages) so a new ring never sees stale slots.
  map_.discard(off, bytes);
  std::memset(map_.at<char>(off), 0, bytes);
  heap_.release(off, bytes);
}

int LocalContext::take_async_read_fd() noexcept {
  int fd = async_read_fd_;
  async_read_fd_ = -1;
  return fd;
}

void LocalContext::raise_async(uint32_t event_type, uint64_t token) noexcept {
  (void)write_async_event(async_write_fd_, event_type, token);
}

void LocalContext::set_cq_user(uint32_t index, void* user) noexcept {
  std::lock_guard lk(mu_);
  if (index < cqs_.size() && cqs_[index].live) cqs_[index].user = user;
}

void* LocalContext::resolve_async(uint64_t token) noexcept {
  uint32_t index = token_index(token), gen = token_generation(token);
  std::lock_guard lk(mu_);
  switch (token_kind(token)) {
    case AsyncKind::kQp:
      if (index < qps_.size() && qps_[index] && (qps_[index]->shared->generation & 0xffffff) == gen)
        return qps_[index]->user;
      return nullptr;
    case AsyncKind::kCq:
      if (index < cqs_.size() && cqs_[index].live &&
          (table<layout::CqEntry>(layout_.cq_table)[index].generation & 0xffffff) == gen)
        return cqs_[index].user;
      return nullptr;
    case AsyncKind::kSrq:
      return srq_user(index, gen);  // srq.cc
    default:
      return nullptr;
  }
}

// ------------------------------------------------------------- inspection

int inspect_context(const DevicePaths& paths, const ContextInfo& ctx, ContextObjects* out) noexcept {
  Mapping m;
  int rc = Mapping::attach(paths.device_dir + "/" + ctx.segment, layout::SegmentKind::kContext, 0, &m);
  if (rc) return rc;
  auto* h = static_cast<layout::ContextHeader*>(m.base());
  // Geometry comes from our own computation, never from the header: the
  // header must agree with it or the segment is rejected.
  layout::ContextLayout l = layout::compute_context_layout(m.size() - layout::compute_context_layout(0).total_size);
  if (h->pd_table != l.pd_table || h->cq_table != l.cq_table || h->wq_table != l.wq_table ||
      h->ind_table != l.ind_table || h->pd_slots != l.pd_slots || h->cq_slots != l.cq_slots ||
      h->wq_slots != l.wq_slots || h->ind_slots != l.ind_slots || h->mr_table != l.mr_table ||
      h->qp_table != l.qp_table || h->srq_table != l.srq_table || h->mr_slots != l.mr_slots ||
      h->qp_slots != l.qp_slots || h->srq_slots != l.srq_slots || l.total_size != m.size() ||
      h->hdr.owner_pid != ctx.pid)
    return EPROTO;
  ContextObjects o;
  try {
    auto* pds = m.at<layout::PdEntry>(l.pd_table);
    for (uint32_t i = 0; i < l.pd_slots; ++i)
      o.pds += pds[i].state.load(std::memory_order_acquire) == layout::kLive;  // A1 pairs with R1
    auto* cqs = m.at<layout::CqEntry>(l.cq_table);
    for (uint32_t i = 0; i < l.cq_slots; ++i)
      o.cqs += cqs[i].state.load(std::memory_order_acquire) == layout::kLive;
    auto* inds = m.at<layout::IndTableEntry>(l.ind_table);
    for (uint32_t i = 0; i < l.ind_slots; ++i)
      o.ind_tables += inds[i].state.load(std::memory_order_acquire) == layout::kLive;
    auto* wqs = m.at<layout::WqEntry>(l.wq_table);
    for (uint32_t i = 0; i < l.wq_slots; ++i) {
      if (wqs[i].state.load(std::memory_order_acquire) != layout::kLive) continue;
      ++o.wqs;
      o.wq_list.push_back({wqs[i].wq_num & limits::kQpnMask,
                           std::min<uint32_t>(wqs[i].wq_state.load(std::memory_order_relaxed), 3),
                           wqs[i].capacity, wqs[i].max_sge, wqs[i].pd_index, wqs[i].cq_index});
    }
    auto* qps = m.at<layout::QpEntry>(l.qp_table);
    for (uint32_t i = 0; i < l.qp_slots; ++i) o.qps += qps[i].state.load(std::memory_order_acquire) == layout::kLive;
    auto* srqs = m.at<layout::SrqEntry>(l.srq_table);
    for (uint32_t i = 0; i < l.srq_slots; ++i)
      o.srqs += srqs[i].state.load(std::memory_order_acquire) == layout::kLive;
    // Memory windows are entries of the MR table too (layout.h MrEntry kind).
    auto* mrs = m.at<layout::MrEntry>(l.mr_table);
    for (uint32_t i = 0; i < l.mr_slots; ++i) {
      if (mrs[i].state.load(std::memory_order_acquire) != layout::kLive) continue;
      if (std::atomic_ref<uint32_t>(mrs[i].kind).load(std::memory_order_relaxed) == layout::kKindMr) {
        ++o.mrs;
        o.mr_list.push_back({i, std::atomic_ref<uint32_t>(mrs[i].rkey).load(std::memory_order_relaxed),
                             std::atomic_ref<uint64_t>(mrs[i].length).load(std::memory_order_relaxed),
                             std::atomic_ref<uint16_t>(mrs[i].tier).load(std::memory_order_relaxed),
                             std::atomic_ref<uint16_t>(mrs[i].tier_why).load(std::memory_order_relaxed)});
      } else {
        ++o.mws;
      }
    }
  } catch (const std::bad_alloc&) {
    return ENOMEM;
  }
  *out = std::move(o);
  return 0;
}

}  // namespace shmrdma
