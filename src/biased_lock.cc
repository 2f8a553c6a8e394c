// BiasedLock's slow path: flag_, biasing a fresh lock, revoking a bias
// (biased_lock.h says why and how).
#include "biased_lock.h"

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace shmrdma {

namespace {

int membarrier(int cmd) noexcept { return static_cast<int>(::syscall(__NR_membarrier, cmd, 0, 0)); }

// -1 not asked yet; 0 no lock of this process is biased; 1 registered for
// MEMBARRIER_CMD_PRIVATE_EXPEDITED, locks may be biased. Asked once (a fork
// child keeps the answer and the registration).
std::atomic<int> g_biasing{-1};

bool biasing_allowed() noexcept {
  int r = g_biasing.load(std::memory_order_relaxed);
  if (r >= 0) [[likely]]
    return r == 1;
  bool ok = false;
  const char* env = std::getenv("SHMRDMA_BIASED_LOCK");
  if (!env || std::strcmp(env, "0") != 0) {
    const int q = membarrier(MEMBARRIER_CMD_QUERY);
    ok = q > 0 && (q & MEMBARRIER_CMD_PRIVATE_EXPEDITED) && (q & MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) &&
         membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
  }
  // Racing first callers store the same answer (registering twice is harmless).
  g_biasing.store(ok ? 1 : 0, std::memory_order_relaxed);
  return ok;
}

// A full memory barrier in every running thread of this process (the ones
// not running pass one when they are switched in). A process whose locks
// are biased registered (biasing_allowed); a fork child inherits that, and
// one that was refused registers again. Should the kernel still refuse,
// the caller waits a millisecond instead: an owner's store leaves its store
// buffer within nanoseconds, but no architecture promises a bound, so it
// says so once.
void heavy_barrier() noexcept {
  if (membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) [[likely]]
    return;
  if (errno == EPERM && membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 &&
      membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0)
    return;
  static std::atomic<bool> said{false};
  if (!said.exchange(true, std::memory_order_relaxed))
    std::fprintf(stderr, "shmrdma: membarrier(PRIVATE_EXPEDITED) failed (%s): revoking a lock's bias "
                 "by waiting instead\n", std::strerror(errno));
  timespec ts{0, 1000000};
  ::nanosleep(&ts, nullptr);
}

}  // namespace

void BiasedLock::lock_slow(uintptr_t self, bool may_bias) noexcept {
  flag_.lock();
  // Holding flag_: bias_ changes only under it.
  const uintptr_t b = bias_.load(std::memory_order_relaxed);
  if (b == kShared || b == self) return;  // self: a former thread of our TCB biased it; we hold flag_
  if (b == kFresh) {
    if (may_bias) bias_.store(biasing_allowed() ? self : kShared, std::memory_order_relaxed);
    return;
  }
  // Biased to another thread: revoke, then wait for its hold, if any, to end.
  bias_.store(kShared, std::memory_order_relaxed);
  heavy_barrier();
  for (unsigned spins = 0; owner_held_.load(std::memory_order_acquire) != 0; ++spins) spin_pause(spins);
}

}  // namespace shmrdma
