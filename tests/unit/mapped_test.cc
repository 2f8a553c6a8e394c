// SPDX-License-Identifier: MIT
//
// Unit tests for src/mapped.h, the mapped data-mover tier: a registered range
// moves into a memfd in place and back when its last MR goes, several MRs
// share a region, a stale region is never matched, fork() gives the child a
// private copy, a peer's view checks the memfd's identity, and the moved range
// and a peer's view have their page tables filled (no fault per page later).

#include "mapped.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "layout.h"

namespace shmrdma {
namespace {

const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));

// The /proc/self/maps line that contains addr ("" when none).
std::string maps_line(uint64_t addr) {
  std::ifstream f("/proc/self/maps");
  std::string line;
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && addr >= lo && addr < hi) return line;
  }
  return "";
}

bool is_memfd(uint64_t addr) { return maps_line(addr).find("/memfd:shmrdma-mr") != std::string::npos; }

// How many of the n pages from addr have a page table entry (present, or
// swapped: /proc/self/pagemap bits 63 and 62); -1 when pagemap is unreadable.
int mapped_pages(const void* addr, uint64_t n) {
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  int got = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t e = 0;
    const off_t off = static_cast<off_t>((reinterpret_cast<uint64_t>(addr) / kPage + i) * 8);
    if (::pread(fd, &e, sizeof e, off) != static_cast<ssize_t>(sizeof e)) {
      ::close(fd);
      return -1;
    }
    if (e >> 62) ++got;
  }
  ::close(fd);
  return got;
}

int open_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = d ? ::readdir(d) : nullptr)
    if (e->d_name[0] != '.') ++n;
  if (d) ::closedir(d);
  return n;
}

class Mapped : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = static_cast<uint8_t*>(::mmap(nullptr, 4 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    ASSERT_NE(base_, MAP_FAILED);
    for (uint64_t i = 0; i < 4 * kPage; ++i) base_[i] = static_cast<uint8_t>(i * 7 + 3);
    SharedRegion probe;
    if (!share_region(addr(kPage), 16, &probe))
      GTEST_SKIP() << "the mapped tier is off here (sanitizer runtime threads, or SHMRDMA_MAPPED=0)";
    release_region(probe);
  }
  void TearDown() override {
    if (base_ != MAP_FAILED) ::munmap(base_, 4 * kPage);
  }
  uint64_t addr(uint64_t off) const { return reinterpret_cast<uint64_t>(base_) + off; }
  bool intact() const {
    for (uint64_t i = 0; i < 4 * kPage; ++i)
      if (base_[i] != static_cast<uint8_t>(i * 7 + 3)) return false;
    return true;
  }
  uint8_t* base_ = static_cast<uint8_t*>(MAP_FAILED);
};

TEST_F(Mapped, ShareMovesPagesInPlaceAndTheLastReleaseMovesThemBack) {
  SharedRegion r;
  ASSERT_TRUE(share_region(addr(100), 5000, &r));
  EXPECT_EQ(r.start, addr(0));
  EXPECT_EQ(r.len, 2 * kPage);
  EXPECT_GE(r.memfd, 0);
  EXPECT_NE(r.id, 0u);
  EXPECT_TRUE(is_memfd(addr(0)));
  EXPECT_TRUE(is_memfd(addr(kPage)));
  EXPECT_FALSE(is_memfd(addr(2 * kPage)));
  EXPECT_TRUE(intact());

  // A second MR inside the region shares it.
  SharedRegion r2;
  ASSERT_TRUE(share_region(addr(kPage + 8), 64, &r2));
  EXPECT_EQ(r2.memfd, r.memfd);
  EXPECT_EQ(r2.id, r.id);
  EXPECT_EQ(r2.start, r.start);

  release_region(r2);
  EXPECT_TRUE(is_memfd(addr(0))) << "one MR still holds the region";
  EXPECT_GE(::fcntl(r.memfd, F_GETFD), 0);
  release_region(r);
  EXPECT_FALSE(is_memfd(addr(0))) << maps_line(addr(0));
  EXPECT_EQ(::fcntl(r.memfd, F_GETFD), -1) << "the memfd is closed with the last MR";
  EXPECT_TRUE(intact());
  // Private again: it can be shared anew, as a new region.
  SharedRegion r3;
  ASSERT_TRUE(share_region(addr(0), kPage, &r3));
  EXPECT_NE(r3.id, r.id);
  release_region(r3);
}

TEST_F(Mapped, ARangeOverlappingASharedRegionIsNotMovedAgain) {
  SharedRegion r;
  ASSERT_TRUE(share_region(addr(0), kPage, &r));
  SharedRegion r2;
  // Spans the shared page and a private one: neither private anonymous nor
  // one region; the MR takes the CMA tier.
  EXPECT_FALSE(share_region(addr(kPage - 8), 16, &r2));
  release_region(r);
  EXPECT_TRUE(intact());
}

TEST_F(Mapped, AStaleRegionAtAReusedAddressIsNeverMatched) {
  SharedRegion r;
  ASSERT_TRUE(share_region(addr(0), kPage, &r));
  // The application unmaps the memory and gets new memory at the same address.
  void* again = ::mmap(base_, kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  ASSERT_EQ(again, static_cast<void*>(base_));
  base_[0] = 0x5a;
  SharedRegion r2;
  ASSERT_TRUE(share_region(addr(0), kPage, &r2));
  EXPECT_NE(r2.id, r.id);
  EXPECT_EQ(base_[0], 0x5a);
  release_region(r);  // the old region's memory is gone: nothing to move back
  EXPECT_TRUE(is_memfd(addr(0)));
  EXPECT_EQ(base_[0], 0x5a);
  release_region(r2);
  EXPECT_FALSE(is_memfd(addr(0)));
  EXPECT_EQ(base_[0], 0x5a);
}

TEST_F(Mapped, ForkGivesTheChildAPrivateCopyAndThePeerViewStaysTheParents) {
  SharedRegion r;
  ASSERT_TRUE(share_region(addr(0), 2 * kPage, &r));
  PeerMappings views;
  auto view = views.get(::getpid(), r.memfd, r.id, r.start, r.len);
  ASSERT_TRUE(view);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child's pages are private: its writes stay its own, even in the
    // neighbour bytes of the registered range, and it holds no memfd.
    bool ok = !is_memfd(addr(0)) && ::fcntl(r.memfd, F_GETFD) == -1 && base_[5] == static_cast<uint8_t>(5 * 7 + 3);
    std::memset(base_, 0x99, 2 * kPage);
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(intact()) << "the child's writes reached the parent";
  // The parent still shares its pages with a peer's view.
  view->base[7] = 0x42;
  EXPECT_EQ(base_[7], 0x42);
  base_[7] = static_cast<uint8_t>(7 * 7 + 3);
  release_region(r);
  EXPECT_TRUE(intact());
}

// The child's copy is the memory as it was at fork(): a store the parent
// makes right after fork() returns never shows in it (the snapshot is taken
// before the fork, not by the child afterwards).
TEST_F(Mapped, TheChildsCopyIsTakenAtForkNotAfter) {
  SharedRegion r;
  ASSERT_TRUE(share_region(addr(0), 2 * kPage, &r));
  for (int round = 0; round < 20; ++round) {
    base_[9] = 0x11;
    int go[2];
    ASSERT_EQ(::pipe(go), 0);
    pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      char c;
      bool ok = ::read(go[0], &c, 1) == 1 && base_[9] == 0x11;
      ::_exit(ok ? 0 : 1);
    }
    base_[9] = 0x22;  // at once, while the child may still be in its fork handler
    ASSERT_EQ(::write(go[1], "x", 1), 1);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ::close(go[0]);
    ::close(go[1]);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "round " << round << ": the child saw a store "
                                                                  "its parent made after fork()";
  }
  base_[9] = static_cast<uint8_t>(9 * 7 + 3);
  release_region(r);
  EXPECT_TRUE(intact());
}

TEST_F(Mapped, APeerViewChecksTheMemfdIdentity) {
  SharedRegion r;
  ASSERT_TRUE(share_region(addr(0), kPage, &r));
  PeerMappings views;
  EXPECT_FALSE(views.get(::getpid(), r.memfd, r.id + 1, r.start, r.len)) << "another memfd under the same number";
  EXPECT_FALSE(views.get(::getpid(), r.memfd, r.id, r.start, r.len + kPage)) << "longer than the memfd";
  auto v = views.get(::getpid(), r.memfd, r.id, r.start, r.len);
  ASSERT_TRUE(v);
  EXPECT_EQ(std::memcmp(v->base, base_, kPage), 0);
  release_region(r);
}

// A view never finds its pages gone (a load or store through it would raise
// SIGBUS in the peer): a region's memfd cannot be shrunk, and a file that
// could be is not mapped.
TEST_F(Mapped, APeerViewIsOnlyOfAFileThatCannotShrink) {
  SharedRegion r;
  ASSERT_TRUE(share_region(addr(0), kPage, &r));
  EXPECT_NE(::ftruncate(r.memfd, 0), 0) << "the owner (or a hostile peer holding its fd) shrank a region's memfd";
  EXPECT_EQ(errno, EPERM);
  struct stat st{};
  ASSERT_EQ(::fstat(r.memfd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), r.len);
  release_region(r);

  const int fd = ::memfd_create("shmrdma-mr", MFD_CLOEXEC);  // as a hostile owner might advertise
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, kPage), 0);
  ASSERT_EQ(::fstat(fd, &st), 0);
  PeerMappings views;
  EXPECT_FALSE(views.get(::getpid(), fd, static_cast<uint64_t>(st.st_ino), 0, kPage))
      << "a view of a memfd its owner may truncate under it";
  ::close(fd);
}

// A peer's view of a region (up to 64 MiB) comes with its page table filled,
// and so does the range itself after a move with other threads running (the
// frozen move maps the memfd over it afresh): the first stores into either
// take no fault per page.
TEST_F(Mapped, AMovedRangeAndAPeersViewHaveTheirPagesMapped) {
  constexpr uint64_t kPages = 16;
  void* p = ::mmap(nullptr, kPages * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 5, kPages * kPage);
  std::atomic<bool> stop{false};
  std::thread t([&] {  // another thread: the frozen move
    while (!stop.load()) std::this_thread::yield();
  });
  SharedRegion r;
  uint16_t why = 0;
  const bool shared = share_region(reinterpret_cast<uint64_t>(p), kPages * kPage, &r, &why);
  stop = true;
  t.join();
  if (!shared) {
    ::munmap(p, kPages * kPage);
    GTEST_SKIP() << "no userfaultfd here for a multi-threaded move (TierWhy " << why << ")";
  }
  ASSERT_TRUE(is_memfd(reinterpret_cast<uint64_t>(p)));
  const int own = mapped_pages(p, kPages);
  if (own < 0) GTEST_SKIP() << "/proc/self/pagemap is not readable here";
  EXPECT_EQ(own, static_cast<int>(kPages)) << "the moved range";
  PeerMappings views;
  auto v = views.get(::getpid(), r.memfd, r.id, r.start, r.len);
  ASSERT_TRUE(v);
  EXPECT_EQ(mapped_pages(v->base, kPages), static_cast<int>(kPages)) << "the peer's view";
  for (uint64_t i = 0; i < kPages * kPage; ++i) ASSERT_EQ(v->base[i], 5) << "byte " << i;
  v.reset();
  release_region(r);
  ::munmap(p, kPages * kPage);
}

TEST_F(Mapped, RegisteringAndDeregisteringFreshBuffersHoldsNoFdsAndNoMemory) {
  const int fds = open_fds();
  for (int i = 0; i < 2000; ++i) {  // each a move on a helper thread (mapped.cc): keep it quick under sanitizers
    void* p = ::mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(p, MAP_FAILED);
    static_cast<uint8_t*>(p)[0] = 1;
    SharedRegion r;
    ASSERT_TRUE(share_region(reinterpret_cast<uint64_t>(p), kPage, &r)) << "round " << i;
    release_region(r);
    ASSERT_EQ(::munmap(p, kPage), 0);
  }
  EXPECT_EQ(open_fds(), fds);
}

// Other threads store into the range, and make system calls that write into
// it, all the time while it moves in and back out: every store survives and no system call
// fails (they wait on the userfaultfd while the pages move). Each writer
// stores 1, 2, 3... into its own words in turn (v into word v mod its word
// count), slowly enough that a lap lasts longer than the move, and stops
// right after it: a store lost in the move stays visible as an older value.
// (A copy-then-remap move without the freeze loses about a thousand stores a
// round here.)
TEST_F(Mapped, OtherThreadsStoringIntoTheRangeWhileItMovesLoseNothing) {
  constexpr uint64_t kLen = 1u << 20;
  constexpr int kRounds = 8;
  constexpr uint64_t kWriters = 2;
  constexpr uint64_t kWords = kLen / 8 / (kWriters + 1);  // per writer; the last column is the pipe reader's
  for (int round = 0; round < kRounds; ++round) {
    auto* p = static_cast<uint64_t*>(::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    ASSERT_NE(p, MAP_FAILED);
    std::memset(p, 0, kLen);
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> last[kWriters + 1] = {};
    std::atomic<int> sys_errors{0};
    std::vector<std::thread> ts;
    for (uint64_t w = 0; w < kWriters; ++w)
      ts.emplace_back([&, w] {
        for (uint64_t v = 1; !stop.load(std::memory_order_relaxed); ++v) {
          reinterpret_cast<volatile uint64_t*>(p)[(v % kWords) * (kWriters + 1) + w] = v;
          last[w].store(v, std::memory_order_release);
          for (int k = 0; k < 40; ++k) __builtin_ia32_pause();
        }
      });
    // The kernel writes into the range for this one: read() from a pipe.
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    ts.emplace_back([&] {
      for (uint64_t v = 1; !stop.load(std::memory_order_relaxed); ++v) {
        uint64_t* slot = p + (v % kWords) * (kWriters + 1) + kWriters;
        if (::write(fds[1], &v, 8) != 8 || ::read(fds[0], slot, 8) != 8 || *slot != v) sys_errors.fetch_add(1);
        last[kWriters].store(v, std::memory_order_release);
      }
    });
    while (last[0].load() < 3 || last[1].load() < 3 || last[kWriters].load() < 3) std::this_thread::yield();
    SharedRegion r;
    uint16_t why = 0;
    const bool shared = share_region(reinterpret_cast<uint64_t>(p) + 64, kLen - 128, &r, &why);
    const bool was_memfd = is_memfd(reinterpret_cast<uint64_t>(p));
    // And back to private memory, the writers still running.
    if (shared) release_region(r);
    stop = true;
    for (auto& t : ts) t.join();
    ::close(fds[0]);
    ::close(fds[1]);
    ASSERT_TRUE(shared) << "a multi-threaded process got the CMA tier (why " << why << ")";
    EXPECT_TRUE(was_memfd);
    EXPECT_FALSE(is_memfd(reinterpret_cast<uint64_t>(p))) << "the last release moves the range back";
    EXPECT_EQ(sys_errors.load(), 0) << "a read() into the moving range failed";
    uint64_t lost = 0, first = 0, want_first = 0;
    for (uint64_t w = 0; w < kWriters; ++w) {
      const uint64_t l = last[w].load();
      ASSERT_LT(l, 50 * kWords) << "the writers ran too fast for the check";
      for (uint64_t j = 0; j < kWords; ++j) {
        const uint64_t want = l >= j ? l - (l - j) % kWords : 0;  // the last v <= l with v mod kWords == j
        const uint64_t i = j * (kWriters + 1) + w;
        if (p[i] != want && lost++ == 0) first = i, want_first = want;
      }
    }
    EXPECT_EQ(lost, 0u) << "round " << round << ": " << lost << " stores lost; word " << first << " holds " << p[first]
                        << ", its writer stored " << want_first << " there";
    ::munmap(p, kLen);
    if (lost || sys_errors.load()) break;
  }
}

// Without a userfaultfd (SHMRDMA_MAPPED=single stands for a kernel that
// refuses one) a multi-threaded process keeps the CMA tier and says why.
TEST_F(Mapped, WithoutUserfaultfdAMultiThreadedProcessGetsTheCmaTierAndSaysWhy) {
  std::atomic<bool> stop{false};
  std::thread t([&] {
    while (!stop.load()) std::this_thread::yield();
  });
  ::setenv("SHMRDMA_MAPPED", "single", 1);
  SharedRegion r;
  uint16_t why = 0;
  bool shared = share_region(addr(0), kPage, &r, &why);
  ::unsetenv("SHMRDMA_MAPPED");
  stop = true;
  t.join();
  EXPECT_FALSE(shared);
  EXPECT_EQ(why, layout::kTierWhyThreads);
  EXPECT_FALSE(is_memfd(addr(0)));
  EXPECT_TRUE(intact());
  // Single-threaded again: the plain move still works.
  ::setenv("SHMRDMA_MAPPED", "single", 1);
  shared = share_region(addr(0), kPage, &r, &why);
  ::unsetenv("SHMRDMA_MAPPED");
  if (shared) {  // the test runner may keep threads of its own
    EXPECT_TRUE(is_memfd(addr(0)));
    release_region(r);
  }
  EXPECT_TRUE(intact());
}

// Memory on the calling thread's own stack is never moved (the thread would
// wait for itself): the CMA tier, at once.
TEST_F(Mapped, TheCallingThreadsStackIsNeverMoved) {
  bool shared = true;
  uint16_t why = 0;
  std::thread t([&] {
    alignas(64) volatile uint8_t buf[256];
    for (auto& b : buf) b = 1;
    SharedRegion r;
    shared = share_region(reinterpret_cast<uint64_t>(&buf[0]), sizeof buf, &r, &why);
    if (shared) release_region(r);
  });
  t.join();
  EXPECT_FALSE(shared);
  EXPECT_EQ(why, layout::kTierWhyMemory);
}

}  // namespace
}  // namespace shmrdma
