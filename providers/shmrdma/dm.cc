// Device memory: ibv_alloc_dm / ibv_free_dm / ibv_memcpy_to_dm /
// ibv_memcpy_from_dm / ibv_reg_dm_mr. A software device has no memory of its
// own: DM is a private anonymous mapping of the allocating process, which
// the application reaches only through the memcpy calls and through MRs
// registered on it. Those are ordinary MRs of the core (zero-based: their
// iova 0 is dm_offset), so local SGEs and peers' rkeys reach DM exactly like
// other registered memory, in either data-mover tier.
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

namespace {

constexpr uint64_t kPage = 4096;

int memcpy_to_dm(ibv_dm* ibdm, uint64_t dm_offset, const void* host_addr, size_t length) noexcept {
  Dm* dm = to_dm(ibdm);
  if (dm_offset > dm->length || length > dm->length - dm_offset || (length && !host_addr)) return EINVAL;
  if (length) std::memcpy(dm->base + dm_offset, host_addr, length);
  return 0;
}

int memcpy_from_dm(void* host_addr, ibv_dm* ibdm, uint64_t dm_offset, size_t length) noexcept {
  Dm* dm = to_dm(ibdm);
  if (dm_offset > dm->length || length > dm->length - dm_offset || (length && !host_addr)) return EINVAL;
  if (length) std::memcpy(host_addr, dm->base + dm_offset, length);
  return 0;
}

}  // namespace

ibv_dm* alloc_dm(ibv_context* ibctx, ibv_alloc_dm_attr* attr) noexcept {
  if (!attr || attr->comp_mask || attr->length == 0 || attr->log_align_req > limits::kMaxDmLogAlign) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr->length > limits::kMaxDmSize) {
    errno = ENOMEM;
    return nullptr;
  }
  Context* ctx = to_ctx(ibctx);
  const uint64_t align = std::max<uint64_t>(kPage, uint64_t{1} << attr->log_align_req);
  const uint64_t charged = (attr->length + kPage - 1) & ~(kPage - 1);
  // The context's capacity: charge first, give back on any failure.
  uint64_t held = ctx->dm_bytes.load(std::memory_order_relaxed);
  do {
    if (charged > limits::kMaxDmSize - held) {
      errno = ENOMEM;
      return nullptr;
    }
  } while (!ctx->dm_bytes.compare_exchange_weak(held, held + charged, std::memory_order_relaxed));
  auto* dm = new (std::nothrow) Dm{};
  const size_t map_len = static_cast<size_t>(charged + align - kPage);
  void* map = dm ? ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) : MAP_FAILED;
  if (map == MAP_FAILED) {
    delete dm;
    ctx->dm_bytes.fetch_sub(charged, std::memory_order_relaxed);
    errno = ENOMEM;
    return nullptr;
  }
  const uintptr_t a = (reinterpret_cast<uintptr_t>(map) + align - 1) & ~uintptr_t(align - 1);
  dm->map = map;
  dm->map_len = map_len;
  dm->base = reinterpret_cast<uint8_t*>(a);
  dm->length = attr->length;
  dm->charged = charged;
  dm->ibv.context = ibctx;
  dm->ibv.memcpy_to_dm = memcpy_to_dm;
  dm->ibv.memcpy_from_dm = memcpy_from_dm;
  dm->ibv.comp_mask = 0;
  dm->ibv.handle = 0;  // ibv_import_dm is not supported (import_dm is not set)
  return &dm->ibv;
}

int free_dm(ibv_dm* ibdm) noexcept {
  Dm* dm = to_dm(ibdm);
  if (dm->mrs.load(std::memory_order_acquire)) return EBUSY;  // MRs still registered on it
  ::munmap(dm->map, dm->map_len);
  to_ctx(ibdm->context)->dm_bytes.fetch_sub(dm->charged, std::memory_order_relaxed);
  delete dm;
  return 0;
}

// ibv_reg_dm_mr(3): the MR is zero based (IBV_ACCESS_ZERO_BASED is required),
// its address 0 is dm_offset.
ibv_mr* reg_dm_mr(ibv_pd* pd, ibv_dm* ibdm, uint64_t dm_offset, size_t length, unsigned int access) noexcept {
  if (!pd || !ibdm || ibdm->context != pd->context || !(access & IBV_ACCESS_ZERO_BASED) ||
      (access & IBV_ACCESS_ON_DEMAND)) {
    errno = EINVAL;
    return nullptr;
  }
  Dm* dm = to_dm(ibdm);
  if (length == 0 || dm_offset > dm->length || length > dm->length - dm_offset) {
    errno = EINVAL;
    return nullptr;
  }
  dm->mrs.fetch_add(1, std::memory_order_acq_rel);
  ibv_mr* mr = reg_mr(pd, dm->base + dm_offset, length, 0, static_cast<int>(access));
  if (!mr) {
    const int e = errno;
    dm->mrs.fetch_sub(1, std::memory_order_acq_rel);
    errno = e;
    return nullptr;
  }
  to_mr(reinterpret_cast<verbs_mr*>(mr))->dm = dm;
  mr->addr = nullptr;  // zero based: the MR's addresses start at 0
  return mr;
}

}  // namespace shmrdma::provider
