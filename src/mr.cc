// Memory regions. The owner keeps the authoritative copy in private memory
// (local SGEs are checked against it); the shared MrEntry lets peers check
// rkeys and find the bytes for remote access.
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "context.h"
#include "mapped.h"

namespace shmrdma {

namespace {

constexpr uint32_t kKnownAccess = kAccessLocalWrite | kAccessRemoteWrite | kAccessRemoteRead | kAccessRemoteAtomic |
                                  kAccessMwBind | kAccessZeroBased | kAccessOnDemand | kAccessHugetlb;
constexpr uint64_t kMaxMrSize = uint64_t{1} << 40;

uint16_t random_tag() {
  uint16_t t = 0;
  if (::getrandom(&t, sizeof t, 0) != sizeof t) t = static_cast<uint16_t>(::getpid() ^ reinterpret_cast<uintptr_t>(&t));
  return t == 0xffff ? 0x7fff : t;  // 0xffff would let key+1 carry into the index
}

int check_access(uint32_t access) {
  uint32_t mandatory = access & (kAccessOptionalFirst - 1);
  if (mandatory & ~kKnownAccess) return EINVAL;
  if ((access & (kAccessRemoteWrite | kAccessRemoteAtomic)) && !(access & kAccessLocalWrite)) return EINVAL;
  return 0;
}

// Registration pins nothing here, but the range must be mapped now, as an
// HCA's registration would fail with EFAULT on unmapped memory.
int check_mapped(uint64_t addr, uint64_t length) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t start = addr & ~(page - 1);
  uint64_t end = (addr + length + page - 1) & ~(page - 1);
  std::vector<unsigned char> vec;
  constexpr uint64_t kChunkPages = 1u << 16;
  try {
    vec.resize(kChunkPages);
  } catch (...) {
    return ENOMEM;
  }
  for (uint64_t p = start; p < end; p += kChunkPages * page) {
    uint64_t n = std::min<uint64_t>(end - p, kChunkPages * page);
    if (::mincore(reinterpret_cast<void*>(p), n, vec.data()) != 0) return errno == ENOMEM ? EFAULT : errno;
  }
  return 0;
}

// Records the data-mover tier of an MR (mapped.h) for peers: the shared
// region it holds (share_region), or nullptr for the CMA tier with the reason
// in `why` (layout::TierWhy).
void publish_tier(layout::MrEntry* e, const SharedRegion* r, uint16_t why) {
  e->tier_why = r ? uint16_t{layout::kTierWhyNone} : why;
  if (r) {
    e->tier = layout::kTierMapped;
    e->memfd = r->memfd;
    e->map_start = r->start;
    e->map_len = r->len;
    e->map_id = r->id;
  } else {
    e->tier = layout::kTierCma;
    e->memfd = -1;
    e->map_start = 0;
    e->map_len = 0;
    e->map_id = 0;
  }
}

}  // namespace

int LocalContext::create_mr(uint32_t pd, uint64_t addr, uint64_t length, uint64_t iova, uint32_t access,
                            MrInfo* out) noexcept {
  if (int rc = check_access(access)) return rc;
  // On-demand paging: nothing needs to be mapped now, memory mapped later is
  // covered; such MRs stay in the CMA tier, whose process_vm_readv/writev
  // fail with EFAULT on unmapped pages (an access error, never a fault).
  // Implicit ODP (ibv_reg_mr(pd, NULL, SIZE_MAX, ON_DEMAND)) covers the
  // whole address space: addr = iova = 0, length 2^64 - 1.
  const bool odp = access & kAccessOnDemand;
  const bool implicit = odp && addr == 0 && iova == 0 && length == ~uint64_t{0};
  if (!implicit) {
    if (length == 0 || length > kMaxMrSize || addr + length < addr || iova + length < iova) return EINVAL;
    if (addr == 0) return EFAULT;
    if (!odp)
      if (int rc = check_mapped(addr, length)) return rc;
  }
  std::lock_guard lk(mu_);
  std::lock_guard wl(mw_mu_);  // execute_bind reads MR state
  if (pd >= pds_.size() || !pds_[pd].live) return EINVAL;
  uint32_t n = static_cast<uint32_t>(mrs_.size());
  uint32_t i = mr_hint_ % n, tries = 0;
  while (tries < n && mrs_[i].live) {
    i = (i + 1) % n;
    ++tries;
  }
  if (tries == n) return ENOMEM;
  if (int rc = charge(layout::kObjMr, limits::kMaxMr)) return rc;
  mr_hint_ = i + 1;
  MrState& s = mrs_[i];
  s.live = true;
  s.pd = pd;
  s.access = access;
  s.addr = addr;
  s.length = length;
  s.iova = iova;
  s.kind = layout::kKindMr;
  s.lkey = (i << 16) | random_tag();
  s.rkey = (i << 16) | random_tag();
  s.fast_match = (access & kAccessOnDemand) ? 0 : mr_fast_match(pd, s.lkey);
  auto* e = table<layout::MrEntry>(layout_.mr_table) + i;
  SharedRegion region;
  uint16_t why = layout::kTierWhyOdp;  // on-demand paging: CMA only (unmapped pages are access errors)
  const bool shared = !odp && share_region(addr, length, &region, &why);
  layout::mr_entry_update(e, [&] {
    e->kind = layout::kKindMr;
    e->mw_qpn = 0;
    e->mw_key.store(0, std::memory_order_relaxed);
    e->lkey = s.lkey;
    e->rkey = s.rkey;
    e->pd_index = pd;
    e->access = access;
    e->iova = iova;
    e->length = length;
    e->host_addr = addr;
    publish_tier(e, shared ? &region : nullptr, why);
  });
  s.region = shared ? region : SharedRegion{};
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  pds_[pd].refs += 1;
  *out = MrInfo{i, s.lkey, s.rkey};
  return 0;
}

int LocalContext::rereg_mr(uint32_t index, uint32_t flags, uint32_t pd, uint64_t addr, uint64_t length,
                           uint64_t iova, uint32_t access, MrInfo* out) noexcept {
  if (flags == 0 || (flags & ~(kRereg_ChangeTranslation | kRereg_ChangePd | kRereg_ChangeAccess))) return EINVAL;
  std::lock_guard lk(mu_);
  std::lock_guard wl(mw_mu_);  // execute_bind reads MR state
  if (index >= mrs_.size() || !mrs_[index].live || mrs_[index].kind != layout::kKindMr) return EINVAL;
  if (int rc = mr_has_windows(index)) return rc;
  MrState next = mrs_[index];
  if (flags & kRereg_ChangeAccess) {
    if (int rc = check_access(access)) return rc;
    // On-demand paging is chosen at registration (its tier and range).
    if ((access ^ next.access) & kAccessOnDemand) return EINVAL;
    next.access = access;
  }
  if ((flags & kRereg_ChangeTranslation) && (next.access & kAccessOnDemand)) return EINVAL;
  if (flags & kRereg_ChangePd) {
    if (pd >= pds_.size() || !pds_[pd].live) return EINVAL;
    next.pd = pd;
  }
  if (flags & kRereg_ChangeTranslation) {
    if (length == 0 || length > kMaxMrSize || addr + length < addr || addr == 0) return EINVAL;
    if (int rc = check_mapped(addr, length)) return rc;
    next.addr = addr;
    next.length = length;
    next.iova = iova;
  }
  // The keys stay (as an HCA's re-registration keeps its memory key): a peer
  // holding the rkey sees the new access, PD and translation with its very
  // next operation (the seqlock of mr_entry_update: never half of them).
  auto* e = table<layout::MrEntry>(layout_.mr_table) + index;
  // The new range first, then the old one goes: a region both share stays.
  SharedRegion region;
  uint16_t why = layout::kTierWhyNone;
  const bool shared =
      (flags & kRereg_ChangeTranslation) && share_region(next.addr, next.length, &region, &why);
  layout::mr_entry_update(e, [&] {
    e->pd_index = next.pd;
    e->access = next.access;
    e->iova = next.iova;
    e->length = next.length;
    e->host_addr = next.addr;
    if (flags & kRereg_ChangeTranslation) publish_tier(e, shared ? &region : nullptr, why);
  });
  if (flags & kRereg_ChangeTranslation) {
    if (mrs_[index].region.memfd >= 0) release_region(mrs_[index].region);
    next.region = shared ? region : SharedRegion{};
  }
  if (next.pd != mrs_[index].pd) {
    pds_[mrs_[index].pd].refs -= 1;
    pds_[next.pd].refs += 1;
  }
  next.fast_match = (next.access & kAccessOnDemand) ? 0 : mr_fast_match(next.pd, next.lkey);
  mrs_[index] = next;
  *out = MrInfo{index, next.lkey, next.rkey};
  return 0;
}

int LocalContext::destroy_mr(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  std::lock_guard wl(mw_mu_);  // execute_bind reads MR state
  if (index >= mrs_.size() || !mrs_[index].live || mrs_[index].kind != layout::kKindMr) return EINVAL;
  if (int rc = mr_has_windows(index)) return rc;  // IBA 10.6.7.2.6: windows bound to it
  table<layout::MrEntry>(layout_.mr_table)[index].state.store(layout::kFree, std::memory_order_release);
  if (pds_[mrs_[index].pd].refs) pds_[mrs_[index].pd].refs -= 1;
  if (mrs_[index].region.memfd >= 0) release_region(mrs_[index].region);
  mrs_[index] = MrState{};
  uncharge(layout::kObjMr);
  return 0;
}

bool LocalContext::local_range_mapped(uint64_t addr, uint64_t len) const noexcept {
  return len == 0 || (addr + len >= addr && check_mapped(addr, len) == 0);
}

int LocalContext::advise_mr(uint32_t pd, uint32_t advice, uint32_t flags, const uint64_t* addrs,
                            const uint32_t* lengths, const uint32_t* lkeys, uint32_t n) noexcept {
  if (advice > kAdvisePrefetchNoFault) return EOPNOTSUPP;  // ENOTSUP: not an advice we know
  if (flags & ~kAdviseFlagFlush) return EINVAL;
  if (n == 0 || !addrs || !lengths || !lkeys) return EINVAL;
  std::vector<uint64_t> host;
  try {
    host.resize(n);
  } catch (...) {
    return ENOMEM;
  }
  {
    std::lock_guard lk(mu_);
    if (pd >= pds_.size() || !pds_[pd].live) return EINVAL;
    for (uint32_t k = 0; k < n; ++k) {
      const uint32_t i = layout::key_index(lkeys[k]);
      if (i >= mrs_.size() || !mrs_[i].live || mrs_[i].lkey != lkeys[k]) return EFAULT;  // no such lkey
      const MrState& m = mrs_[i];
      if (m.kind != layout::kKindMr || !(m.access & kAccessOnDemand)) return EINVAL;  // not an ODP MR
      if (m.pd != pd) return EPERM;  // outside the caller's scope
      if (advice == kAdvisePrefetchWrite && !(m.access & kAccessLocalWrite)) return EPERM;
      const uint64_t a = addrs[k], len = lengths[k];
      if (a < m.iova || len > m.length || a - m.iova > m.length - len) return EFAULT;
      host[k] = m.addr + (a - m.iova);
    }
  }
  // Prefetching makes the pages present (MADV_POPULATE_*: faults them in,
  // EFAULT where nothing is mapped). The device sees every present page, so
  // NO_FAULT has nothing left to do. Every advice completes before we
  // return, which is what IBV_ADVISE_MR_FLAG_FLUSH asks.
  if (advice == kAdvisePrefetchNoFault) return 0;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  for (uint32_t k = 0; k < n; ++k) {
    if (lengths[k] == 0) continue;
    if (host[k] + lengths[k] < host[k]) return EFAULT;
    const uint64_t start = host[k] & ~(page - 1), end = (host[k] + lengths[k] + page - 1) & ~(page - 1);
#ifndef MADV_POPULATE_READ
    constexpr int MADV_POPULATE_READ = 22, MADV_POPULATE_WRITE = 23;
#endif
    const int how = advice == kAdvisePrefetchWrite ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
    if (::madvise(reinterpret_cast<void*>(start), end - start, how) != 0) {
      if (errno == EINVAL) {  // a kernel before 5.14: best effort, the range must still be mapped
        if (int rc = check_mapped(host[k], lengths[k])) return rc;
        continue;
      }
      return (errno == ENOMEM || errno == EFAULT || errno == EPERM) ? EFAULT : errno;
    }
  }
  return 0;
}

}  // namespace shmrdma
