// SpinLock, and the step of its spin wait that BiasedLock's waits share.
#pragma once

#include <sched.h>

#include <atomic>

namespace shmrdma {

// One step of a wait that spins: a pause for the first 128 steps, then the
// CPU is yielded, so a holder that was preempted is not spun against forever.
inline void spin_pause(unsigned spins) noexcept {
  if (spins < 128)
    __builtin_ia32_pause();
  else
    ::sched_yield();
}

// A tiny test-and-test-and-set lock for per-QP send-side state (held for the
// duration of one post or one progress pass, never across a wait) and the
// provider's CQ poll lock (one poll, or start_poll to end_poll): only threads
// of this process. A waiter that spun for a while yields the CPU, so a holder
// that was preempted (or an application between start_poll and end_poll)
// is not spun against forever. Uncontended it costs one exchange and one
// store, a fraction of a pthread mutex.
class SpinLock {
 public:
  void lock() noexcept {
    if (!flag_.exchange(true, std::memory_order_acquire)) [[likely]]  // pairs with unlock's release
      return;
    lock_contended();
  }
  bool try_lock() noexcept { return !flag_.exchange(true, std::memory_order_acquire); }
  void unlock() noexcept { flag_.store(false, std::memory_order_release); }

 private:
  // Out of line: its loop and call would cost every holder registers.
  [[gnu::noinline, gnu::cold]] void lock_contended() noexcept {
    for (;;) {
      for (unsigned spins = 0; flag_.load(std::memory_order_relaxed); ++spins) spin_pause(spins);
      if (!flag_.exchange(true, std::memory_order_acquire)) return;
    }
  }
  std::atomic<bool> flag_{false};
};

}  // namespace shmrdma
