#include "worker.h"

#include <sys/mman.h>

#include <cstdarg>
#include <cstdlib>

#include "verbs.h"
#include "wire.h"

namespace harness {

void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stdout, "FAIL: ");
  std::vfprintf(stdout, fmt, ap);
  std::fprintf(stdout, "\n");
  std::fflush(stdout);
  va_end(ap);
  std::_Exit(1);
}

uint64_t fnv(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

uint8_t* map_buf(size_t len) {
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap of %zu bytes failed", len);
  return static_cast<uint8_t*>(p);
}

Hello exchange_hello(ibv_context* ctx, ibv_qp* qp) {
  Hello me{qp->qp_num, port_lid(ctx), 0}, peer{};
  if (!write_all(kCtlFd, &me, sizeof me) || !read_all(kCtlFd, &peer, sizeof peer, 30000)) die("hello exchange");
  return peer;
}

}  // namespace harness
