// SPDX-License-Identifier: MIT
//
// Unit tests for src/mapped.h, the mapped data-mover tier: a registered range
// moves into a memfd in place and back when its last MR goes, several MRs
// share a region, a stale region is never matched, fork() gives the child a
// private copy, and a peer's view checks the memfd's identity.

#include "mapped.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <string>

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

TEST_F(Mapped, RegisteringAndDeregisteringFreshBuffersHoldsNoFdsAndNoMemory) {
  const int fds = open_fds();
  for (int i = 0; i < 5000; ++i) {
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

}  // namespace
}  // namespace shmrdma
