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
  if (int rc = to_ctx(ibpd->context)->core->destroy_pd(pd->index)) return rc;
  delete pd;
  return 0;
}

}  // namespace shmrdma::provider
