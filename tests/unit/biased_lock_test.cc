// BiasedLock (src/biased_lock.h): the thread that posts takes it without a
// locked instruction; any other thread revokes that for good and then takes
// it like a spin lock. What must hold: mutual exclusion across the owner's
// plain-store hold, a revocation that meets an owner inside its critical
// section, several contenders, and a fork child.
#include "biased_lock.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace shmrdma {
namespace {

// Biasing needs membarrier's private expedited command; a kernel without it
// (or a seccomp filter that refuses it) leaves every lock unbiased, which
// the tests that look at biased() cannot check.
bool kernel_biases() {
  BiasedLock probe;
  probe.lock_biasing();
  probe.unlock();
  return probe.biased();
}

// Each critical section checks that it is alone (entered == 0 on entry) and
// bumps a plain counter that only the lock protects.
struct Shared {
  BiasedLock lock;
  std::atomic<int> entered{0};
  std::atomic<int> overlaps{0};
  uint64_t count = 0;

  void section(bool biasing) {
    if (biasing)
      lock.lock_biasing();
    else
      lock.lock();
    if (entered.fetch_add(1, std::memory_order_relaxed) != 0) overlaps.fetch_add(1, std::memory_order_relaxed);
    count += 1;
    entered.fetch_sub(1, std::memory_order_relaxed);
    lock.unlock();
  }
};

TEST(BiasedLock, OnlyLockBiasingBiasesAFreshLock) {
  if (!kernel_biases()) GTEST_SKIP() << "membarrier(PRIVATE_EXPEDITED) unavailable: no lock is biased";
  BiasedLock l;
  l.lock();
  l.unlock();
  EXPECT_FALSE(l.biased()) << "lock() left a fresh lock fresh";
  l.lock_biasing();
  l.unlock();
  EXPECT_TRUE(l.biased());
  // The owner keeps it, whichever way it locks.
  l.lock();
  l.unlock();
  EXPECT_TRUE(l.biased());
}

TEST(BiasedLock, AnotherThreadRevokesForGood) {
  if (!kernel_biases()) GTEST_SKIP() << "membarrier(PRIVATE_EXPEDITED) unavailable: no lock is biased";
  BiasedLock l;
  l.lock_biasing();
  l.unlock();
  ASSERT_TRUE(l.biased());
  std::thread([&] {
    l.lock_biasing();  // not the owner: revokes, does not take the bias
    l.unlock();
  }).join();
  EXPECT_FALSE(l.biased());
  l.lock_biasing();  // the former owner now takes the spin lock, and it stays unbiased
  l.unlock();
  EXPECT_FALSE(l.biased());
}

// A revoker that arrives while the owner holds the lock with its plain
// store waits for the owner's unlock.
TEST(BiasedLock, RevocationWaitsForTheOwnersHold) {
  Shared s;
  s.section(true);  // biased to this thread (where the kernel allows it)
  s.lock.lock();
  std::atomic<bool> got{false};
  std::thread t([&] {
    s.lock.lock();
    got.store(true);
    s.lock.unlock();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(got.load()) << "a second thread entered while the owner held the lock";
  s.lock.unlock();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!got.load() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(got.load()) << "the waiter did not get the lock after the owner's unlock";
  t.join();
}

// The owner hammers the lock on its fast path while others arrive; one of
// them revokes in the middle of it. No two critical sections overlap and no
// increment is lost.
TEST(BiasedLock, MutualExclusionAcrossTheRevocation) {
  constexpr int kOwner = 200000, kOthers = 3, kEach = 50000;
  Shared s;
  s.section(true);
  std::atomic<bool> go{false};
  std::vector<std::thread> others;
  for (int i = 0; i < kOthers; ++i)
    others.emplace_back([&, i] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      for (int k = 0; k < kEach; ++k) s.section(i % 2 == 0);
    });
  for (int k = 0; k < kOwner; ++k) {
    if (k == kOwner / 10) go.store(true, std::memory_order_release);
    s.section(true);
  }
  for (auto& t : others) t.join();
  EXPECT_EQ(s.overlaps.load(), 0);
  EXPECT_EQ(s.count, uint64_t{1} + kOwner + uint64_t{kOthers} * kEach);
  EXPECT_FALSE(s.lock.biased());
}

// A fork child: its one thread is the owner (same thread pointer) and keeps
// the fast path; a thread it starts revokes (membarrier in the child) and
// exclusion holds there too.
TEST(BiasedLock, ForkChild) {
  Shared s;
  s.section(true);
  const bool biased = s.lock.biased();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int bad = 0;
    if (s.lock.biased() != biased) bad |= 1;
    std::thread t([&] {
      for (int k = 0; k < 50000; ++k) s.section(false);
    });
    for (int k = 0; k < 50000; ++k) s.section(true);
    t.join();
    if (s.overlaps.load() != 0) bad |= 2;
    if (s.count != 100001) bad |= 4;
    if (s.lock.biased()) bad |= 8;
    _exit(bad);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: bias changed by fork, 2: overlap, 4: lost increments, 8: still biased";
}

}  // namespace
}  // namespace shmrdma
