// Protection domains.
#include <cerrno>
#include <cstdlib>
#include <new>

#include "provider.h"

namespace shmrdma::provider {

ibv_pd* alloc_pd(ibv_context* ibctx) noexcept {
  Context* ctx = to_ctx(ibctx);
  auto* pd = new (std::nothrow) Pd{};
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  if (int rc = ctx->core->create_pd(&pd->index)) {
    delete pd;
    errno = rc;
    return nullptr;
  }
  pd->ibv.context = ibctx;
  pd->ibv.handle = pd->index;
  return &pd->ibv;
}

int dealloc_pd(ibv_pd* ibpd) noexcept {
  Pd* pd = to_pd(ibpd);
  if (pd->parent) {  // a parent domain: its PD stays
    if (pd->users.load(std::memory_order_acquire)) return EBUSY;  // objects created with it
    pd->parent->parents.fetch_sub(1, std::memory_order_acq_rel);
    delete pd;
    return 0;
  }
  if (pd->parents.load(std::memory_order_acquire)) return EBUSY;  // parent domains use it
  if (int rc = to_ctx(ibpd->context)->core->destroy_pd(pd->index)) return rc;
  delete pd;
  return 0;
}

// ibv_alloc_parent_domain(3). A parent domain groups a PD and the
// application's pd_context; objects created with it are objects of its PD.
// Thread domains do not exist here (ibv_alloc_td is not supported), so td
// must be NULL. The alloc/free callbacks would place queue memory, but every
// queue of this device is a ring in the context's shared segment, which
// peers map: memory from the application cannot be a queue. A parent domain
// with callbacks is therefore refused with EOPNOTSUPP rather than accepted
// and ignored.
ibv_pd* alloc_parent_domain(ibv_context* ibctx, ibv_parent_domain_init_attr* attr) noexcept {
  constexpr uint32_t kKnown = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
  if (!attr || !attr->pd || attr->pd->context != ibctx || (attr->comp_mask & ~kKnown) || attr->td) {
    errno = EINVAL;
    return nullptr;
  }
  Pd* base = to_pd(attr->pd);
  if (base->parent) {  // a parent domain of a parent domain
    errno = EINVAL;
    return nullptr;
  }
  if ((attr->comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS) && (attr->alloc || attr->free)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  auto* pd = new (std::nothrow) Pd{};
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  pd->index = base->index;
  pd->parent = base;
  if (attr->comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT) pd->pd_context = attr->pd_context;
  pd->ibv.context = ibctx;
  pd->ibv.handle = base->ibv.handle;
  base->parents.fetch_add(1, std::memory_order_acq_rel);
  return &pd->ibv;
}

}  // namespace shmrdma::provider
