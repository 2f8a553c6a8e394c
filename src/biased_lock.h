// A lock that one thread takes without a locked instruction: a QP's send
// queue lock, which the thread that posts to the QP takes on every post and
// others take rarely (poll_cq's progress pass, modify_qp, arm_cq and
// resize_cq of the CQs it completes into, a second posting thread); and a
// CQ's poll lock (the provider's Cq::poll_lock), which the thread that
// polls takes on every poll that finds something.
//
// Why: a locked instruction (the SpinLock's exchange) waits until every
// earlier store of the thread is visible. When the store before it went to
// a cache line another CPU was reading (a WRITE into a buffer the target
// polls, as ucx_perftest's put_bw responder does), that wait is a whole
// cache-line transfer per post; without it the store drains in the
// background like any other (bench/results/callgrind.md, bench/README.md).
//
// How (an asymmetric Dekker lock, the pattern of membarrier(2)'s man page):
// - The lock is "biased" to the thread that first took it (the owner). The
//   owner takes it with a plain store of its identity into owner_held_, a
//   compiler-only barrier, and a load of bias_: if bias_ still names it, it
//   holds the lock. No CPU fence: its store may still sit in its store
//   buffer while it runs the critical section.
// - Every other thread takes flag_, a SpinLock. Holding it, a thread that
//   finds the lock biased to another revokes the bias for good: it stores
//   kShared into bias_, calls membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED),
//   which puts a full memory barrier into every running thread of the
//   process, and waits until owner_held_ is clear. After the barrier, either the owner's store of
//   owner_held_ is visible (it holds or is about to back off: we wait for
//   its unlock), or its later load of bias_ sees kShared and it backs off
//   (clears owner_held_, takes flag_ like everyone else from then on).
// - bias_ changes only under flag_: kFresh -> the owner -> kShared (a
//   revocation). So one revocation per lock at most, one system call of
//   ~1 µs. Only lock_biasing biases a fresh lock to its caller (the post
//   verbs: the thread that posts, not the one that created or connected the
//   QP, becomes the owner); lock leaves a fresh lock fresh.
// - unlock tells the owner's fast hold (owner_held_ names the calling
//   thread, which only that thread can have stored) from a hold of flag_.
//
// Thread identity: the thread pointer (the TCB's address), unique among live
// threads. A thread that ends holds no lock; a new thread that gets its TCB
// becomes the owner in its place, which is as sound (the old one is gone).
// After fork the child's one thread is either the owner (same TCB) or
// revokes; the child inherits the membarrier registration (only exec clears
// it), and a revoker that is refused registers again.
//
// Biasing needs membarrier's private expedited command (Linux 4.14): where
// the kernel or a seccomp filter refuses it, no lock is ever biased and
// every thread takes flag_ (SHMRDMA_BIASED_LOCK=0 forces that).
#pragma once

#include <atomic>
#include <cstdint>

#include "spin_lock.h"

namespace shmrdma {

class BiasedLock {
 public:
  void lock() noexcept { lock_as(false); }
  void lock_biasing() noexcept { lock_as(true); }
  void unlock() noexcept {
    const uintptr_t self = reinterpret_cast<uintptr_t>(__builtin_thread_pointer());
    if (owner_held_.load(std::memory_order_relaxed) == self) [[likely]]
      owner_held_.store(0, std::memory_order_release);  // pairs with a revoker's acquire
    else
      flag_.unlock();
  }

  // The owner's lock without its slow path: true when the lock is biased to
  // this thread and now held by it (release with unlock); false, and not
  // held, otherwise (never biased yet, revoked, or another thread's).
  [[gnu::always_inline]] bool try_lock_owner() noexcept {
    const uintptr_t self = reinterpret_cast<uintptr_t>(__builtin_thread_pointer());
    if (bias_.load(std::memory_order_relaxed) != self) [[unlikely]]
      return false;
    owner_held_.store(self, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // as lock_as
    if (bias_.load(std::memory_order_acquire) == self) [[likely]]
      return true;
    owner_held_.store(0, std::memory_order_release);  // revoked meanwhile: back off
    return false;
  }

  // unlock after try_lock_owner returned true.
  [[gnu::always_inline]] void unlock_owner() noexcept { owner_held_.store(0, std::memory_order_release); }

  // Whether the lock is biased to a thread now (tests).
  bool biased() const noexcept {
    const uintptr_t b = bias_.load(std::memory_order_relaxed);
    return b != kFresh && b != kShared;
  }

 private:
  static constexpr uintptr_t kFresh = 0;   // never biased yet
  static constexpr uintptr_t kShared = 1;  // revoked: flag_ for everyone
  [[gnu::always_inline]] void lock_as(bool may_bias) noexcept {
    const uintptr_t self = reinterpret_cast<uintptr_t>(__builtin_thread_pointer());
    if (bias_.load(std::memory_order_relaxed) == self) [[likely]] {
      owner_held_.store(self, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // the compiler keeps the store before the load
      if (bias_.load(std::memory_order_acquire) == self) [[likely]]
        return;
      owner_held_.store(0, std::memory_order_release);  // revoked meanwhile: back off
    }
    lock_slow(self, may_bias);
  }
  [[gnu::noinline]] void lock_slow(uintptr_t self, bool may_bias) noexcept;

  std::atomic<uintptr_t> bias_{kFresh};
  std::atomic<uintptr_t> owner_held_{0};  // the owner's identity while it holds the lock that way
  SpinLock flag_;  // everyone but the owner (and the owner after a revocation)
};

// std::lock_guard for lock_biasing.
class BiasingGuard {
 public:
  explicit BiasingGuard(BiasedLock& l) noexcept : l_(l) { l_.lock_biasing(); }
  ~BiasingGuard() { l_.unlock(); }
  BiasingGuard(const BiasingGuard&) = delete;
  BiasingGuard& operator=(const BiasingGuard&) = delete;

 private:
  BiasedLock& l_;
};

}  // namespace shmrdma
