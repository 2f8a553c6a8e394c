// Memory windows. A window is an entry of the MR table (layout.h MrEntry,
// kind kKindMw1/kKindMw2), so its rkey lives in the key space peers already
// resolve: key_index(rkey) names the entry, and resolve_remote (transport.cc)
// accepts it like an MR's rkey while it is bound and valid.
//
// Binding (IBV_WR_BIND_MW, ibv_bind_mw) and local invalidation
// (IBV_WR_LOCAL_INV) are send WRs that the owner executes in order on its
// send queue (execute_bind, execute_local_inv). A peer's SEND_WITH_INV
// invalidates the target's window from the initiator (invalidate_remote_mw),
// with a CAS on the entry's mw_key: the owner's private state only records
// the key and the MR last bound; validity is always read from mw_key.
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>

#include "context.h"

namespace shmrdma {

namespace {

// A tag whose high byte is never 0xff: the low byte changes with every bind
// (ibv_inc_rkey), so the tag never reaches 0xffff (see MrEntry keys).
uint16_t mw_tag() {
  uint16_t t = 0;
  if (::getrandom(&t, sizeof t, 0) != sizeof t) t = static_cast<uint16_t>(::getpid() ^ reinterpret_cast<uintptr_t>(&t));
  return static_cast<uint16_t>(t & 0xfeff);
}

constexpr uint32_t kMwAccess = kAccessRemoteWrite | kAccessRemoteRead | kAccessRemoteAtomic;

template <typename F>
void mw_update(layout::MrEntry* e, F&& fill) {
  layout::mr_entry_update(e, std::forward<F>(fill));
}

}  // namespace

int LocalContext::create_mw(uint32_t pd, uint32_t type, MwInfo* out) noexcept {
  if (type != 1 && type != 2) return EINVAL;
  std::lock_guard lk(mu_);
  std::lock_guard wl(mw_mu_);
  if (pd >= pds_.size() || !pds_[pd].live) return EINVAL;
  uint32_t n = static_cast<uint32_t>(mrs_.size());
  uint32_t i = mr_hint_ % n, tries = 0;
  while (tries < n && mrs_[i].live) {
    i = (i + 1) % n;
    ++tries;
  }
  if (tries == n) return ENOMEM;
  try {
    mw_list_.reserve(mw_list_.size() + 1);
  } catch (...) {
    return ENOMEM;
  }
  if (int rc = charge(layout::kObjMr, limits::kMaxMr)) return rc;
  mr_hint_ = i + 1;
  MrState& s = mrs_[i];
  s = MrState{};
  s.live = true;
  s.pd = pd;
  s.kind = type == 1 ? layout::kKindMw1 : layout::kKindMw2;
  s.mw_key = (i << 16) | mw_tag();
  auto* e = table<layout::MrEntry>(layout_.mr_table) + i;
  mw_update(e, [&] {
    e->lkey = 0;
    e->rkey = 0;
    e->pd_index = pd;
    e->access = 0;
    e->iova = 0;
    e->length = 0;
    e->host_addr = 0;
    e->tier = layout::kTierCma;
    e->tier_why = layout::kTierWhyWindow;
    e->memfd = -1;
    e->map_start = e->map_len = e->map_id = 0;
    e->kind = s.kind;
    e->mw_qpn = 0;
    e->mw_key.store(s.mw_key, std::memory_order_relaxed);  // not valid until bound
  });
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  pds_[pd].refs += 1;
  mw_list_.push_back(i);
  *out = MwInfo{i, s.mw_key};
  return 0;
}

int LocalContext::destroy_mw(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  std::lock_guard wl(mw_mu_);
  if (index >= mrs_.size() || !mrs_[index].live || mrs_[index].kind == layout::kKindMr) return EINVAL;
  auto* e = table<layout::MrEntry>(layout_.mr_table) + index;
  mw_update(e, [&] { e->mw_key.store(mrs_[index].mw_key, std::memory_order_relaxed); });
  e->state.store(layout::kFree, std::memory_order_release);
  if (pds_[mrs_[index].pd].refs) pds_[mrs_[index].pd].refs -= 1;
  mrs_[index] = MrState{};
  for (size_t k = 0; k < mw_list_.size(); ++k)
    if (mw_list_[k] == index) {
      mw_list_[k] = mw_list_.back();
      mw_list_.pop_back();
      break;
    }
  uncharge(layout::kObjMr);
  return 0;
}

int LocalContext::mr_has_windows(uint32_t index) noexcept {
  for (uint32_t w : mw_list_) {
    MrState& s = mrs_[w];
    if (s.mw_mr != index) continue;
    auto* e = table<layout::MrEntry>(layout_.mr_table) + w;
    uint64_t k = e->mw_key.load(std::memory_order_acquire);
    if (k & layout::kMwValid) return EBUSY;
    s.mw_mr = layout::kNoIndex;  // invalidated by a peer since
  }
  return 0;
}

// IBA 10.6.7.3 / rxe_check_bind_mw: every failure completes with
// IBV_WC_MW_BIND_ERR (and the QP enters the error state).
uint32_t LocalContext::execute_bind(Qp* qp, const SendSlot* s) noexcept {
  std::lock_guard wl(mw_mu_);
  const uint32_t i = s->mw_index;
  if (i >= mrs_.size() || !mrs_[i].live || mrs_[i].kind == layout::kKindMr) return IBV_WC_MW_BIND_ERR;
  MrState& w = mrs_[i];
  auto* e = table<layout::MrEntry>(layout_.mr_table) + i;
  const bool type2 = w.kind == layout::kKindMw2;
  const bool valid = e->mw_key.load(std::memory_order_acquire) & layout::kMwValid;
  const bool unbind = s->mw_length == 0;
  // The bind's access names the remote rights the window grants; local write
  // in it (applications pass the MR's flags) grants nothing remote and is
  // ignored. ZERO_BASED makes the window's remote addresses offsets from its
  // start (type 2 only: o10-36.2.2). Anything else is not a window right.
  const bool zero_based = s->mw_access & kAccessZeroBased;
  const uint32_t mw_access = s->mw_access & ~(kAccessLocalWrite | kAccessZeroBased);
  if (mw_access & ~kMwAccess) return IBV_WC_MW_BIND_ERR;
  if (zero_based && !type2) return IBV_WC_MW_BIND_ERR;  // o10-36.2.2
  if (type2) {
    if (valid) return IBV_WC_MW_BIND_ERR;          // o10-37.2.30: invalidate first
    if (qp->pd != w.pd) return IBV_WC_MW_BIND_ERR;  // C10-72
    if (unbind || s->mw_mr == layout::kNoIndex) return IBV_WC_MW_BIND_ERR;
  }
  const MrState* m = nullptr;
  if (!unbind) {
    if (s->mw_mr >= mrs_.size()) return IBV_WC_MW_BIND_ERR;
    m = &mrs_[s->mw_mr];
    if (!m->live || m->kind != layout::kKindMr || m->lkey != s->mw_mr_lkey || m->pd != w.pd)
      return IBV_WC_MW_BIND_ERR;
    if (!(m->access & kAccessMwBind) || (m->access & kAccessZeroBased)) return IBV_WC_MW_BIND_ERR;  // C10-73
    if ((mw_access & (kAccessRemoteWrite | kAccessRemoteAtomic)) && !(m->access & kAccessLocalWrite))
      return IBV_WC_MW_BIND_ERR;  // C10-74
    const uint64_t a = s->mw_addr, len = s->mw_length;
    if (a < m->iova || len > m->length || a - m->iova > m->length - len) return IBV_WC_MW_BIND_ERR;  // C10-75
  }
  const uint32_t key = (w.mw_key & ~0xffu) | (s->rkey & 0xffu);
  mw_update(e, [&] {
    e->mw_key.store(w.mw_key, std::memory_order_relaxed);
    if (m) {
      const auto* me = table<layout::MrEntry>(layout_.mr_table) + s->mw_mr;
      e->pd_index = w.pd;
      e->access = mw_access;
      // Peers resolve host_addr + (remote address - iova) (transport.cc
      // resolve_remote): a zero-based window starts at remote address 0.
      e->iova = zero_based ? 0 : s->mw_addr;
      e->length = s->mw_length;
      e->host_addr = m->addr + (s->mw_addr - m->iova);
      e->tier = me->tier;
      e->tier_why = me->tier_why;
      e->memfd = me->memfd;
      e->map_start = me->map_start;
      e->map_len = me->map_len;
      e->map_id = me->map_id;
    } else {
      e->access = 0;
      e->iova = e->length = e->host_addr = 0;
      e->tier = layout::kTierCma;
      e->tier_why = layout::kTierWhyWindow;
      e->memfd = -1;
      e->map_start = e->map_len = e->map_id = 0;
    }
    e->mw_qpn = type2 ? qp->qpn : 0;
    e->mw_key.store(m ? (layout::kMwValid | key) : key, std::memory_order_relaxed);
  });
  w.mw_key = key;
  w.mw_mr = m ? s->mw_mr : layout::kNoIndex;
  return IBV_WC_SUCCESS;
}

// rxe: a key that names no valid type 2 window -> IBV_WC_LOC_QP_OP_ERR
// (MRs cannot be invalidated: shmrdma has no fast-registration MRs).
uint32_t LocalContext::execute_local_inv(const SendSlot* s) noexcept {
  std::lock_guard wl(mw_mu_);
  const uint32_t key = s->rkey, i = layout::key_index(key);
  if (i >= mrs_.size() || !mrs_[i].live || mrs_[i].kind != layout::kKindMw2) return IBV_WC_LOC_QP_OP_ERR;
  auto* e = table<layout::MrEntry>(layout_.mr_table) + i;
  uint64_t want = layout::kMwValid | key;
  if (!e->mw_key.compare_exchange_strong(want, key, std::memory_order_acq_rel)) return IBV_WC_LOC_QP_OP_ERR;
  mrs_[i].mw_mr = layout::kNoIndex;
  return IBV_WC_SUCCESS;
}

// The target's entry is untrusted: only the CAS on mw_key is written, and
// only when it holds exactly (kMwValid | rkey).
bool LocalContext::invalidate_remote_mw(Peer& peer, uint32_t pd, uint32_t rkey, bool check_only) noexcept {
  layout::MrEntry* e = peer.mr(layout::key_index(rkey));
  if (!e || e->state.load(std::memory_order_acquire) != layout::kLive) return false;
  if (e->kind != layout::kKindMw2 || e->pd_index != pd) return false;
  uint64_t want = layout::kMwValid | rkey;
  if (check_only) return e->mw_key.load(std::memory_order_acquire) == want;
  return e->mw_key.compare_exchange_strong(want, rkey, std::memory_order_acq_rel);
}

}  // namespace shmrdma
