// SPDX-License-Identifier: MIT
//
// Unit tests for src/mover.h's inline helpers of the small-message path:
// move_out_small copies exactly the bytes asked for, own_dest_line (the
// hint that takes a receive buffer's line for writing before a send stores
// into it) changes no byte wherever it points, load_small / load_upto20
// (a small message's bytes into registers, for its completion) give exactly
// the bytes asked for and read none past them, store_small / store_upto20
// (those registers into a receive buffer) write exactly them, and
// copy_upto16, copy_17_to_64 and copy_upto64 copy exactly their bytes,
// also between overlapping ranges, as does move_one (move_out's one-buffer
// case, inline) at any length, with or without its last byte stored last.

#include "mover.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <vector>

namespace shmrdma {
namespace {

std::array<unsigned char, 256> pattern() {
  std::array<unsigned char, 256> a{};
  uint32_t x = 0x9e3779b9u;
  for (auto& b : a) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<unsigned char>(x >> 24);
  }
  return a;
}

TEST(OwnDestLine, ChangesNoByteAtAnyOffset) {
  alignas(64) std::array<unsigned char, 256> buf = pattern();
  const std::array<unsigned char, 256> want = buf;
  for (size_t off = 0; off < buf.size(); ++off) {
    own_dest_line(buf.data() + off);
    ASSERT_EQ(std::memcmp(buf.data(), want.data(), buf.size()), 0) << "at offset " << off;
  }
  // Bytes with every bit pattern: an OR of anything but 0 would show.
  for (unsigned v = 0; v < 256; ++v) {
    unsigned char b = static_cast<unsigned char>(v);
    own_dest_line(&b);
    ASSERT_EQ(b, v);
  }
}

TEST(MoveOutSmall, CopiesExactlyTheBytesAskedFor) {
  const std::array<unsigned char, 256> src = pattern();
  for (size_t len = 1; len <= 16; ++len)
    for (size_t off = 0; off < 16; ++off) {
      alignas(64) std::array<unsigned char, 64> dst;
      dst.fill(0xa5);
      ASSERT_TRUE(move_out_small(dst.data() + off, src.data() + 100, len)) << len << " at " << off;
      for (size_t i = 0; i < dst.size(); ++i) {
        const bool in = i >= off && i < off + len;
        ASSERT_EQ(dst[i], in ? src[100 + i - off] : 0xa5) << "len " << len << " off " << off << " byte " << i;
      }
    }
  // More than 16 bytes (other than 8 aligned), or overlapping: declined, nothing copied.
  alignas(64) std::array<unsigned char, 64> dst;
  dst.fill(0xa5);
  EXPECT_FALSE(move_out_small(dst.data(), src.data(), 17));
  EXPECT_FALSE(move_out_small(dst.data() + 4, dst.data(), 12));
  for (unsigned char b : dst) ASSERT_EQ(b, 0xa5);
}

// A page whose next page is inaccessible: an access past end() faults.
class GuardedPage {
 public:
  GuardedPage() {
    page_ = sysconf(_SC_PAGESIZE);
    void* m = mmap(nullptr, 2 * page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return;
    if (mprotect(static_cast<unsigned char*>(m) + page_, page_, PROT_NONE) != 0) {
      munmap(m, 2 * page_);
      return;
    }
    base_ = static_cast<unsigned char*>(m);
  }
  ~GuardedPage() {
    if (base_) munmap(base_, 2 * page_);
  }
  bool ok() const { return base_ != nullptr; }
  unsigned char* end() const { return base_ + page_; }

 private:
  long page_ = 0;
  unsigned char* base_ = nullptr;
};

// Every length from 1 to 20 bytes, ending right before a page nobody may
// read (PROT_NONE): a load past the message would fault the test. The bytes
// come back in place (0-7 in lo, 8-15 in hi, 16-19 in top), zero past len.
TEST(LoadUpto20, GivesTheBytesAndReadsNoneBeyond) {
  GuardedPage g;  // an access past the end faults
  ASSERT_TRUE(g.ok());
  const std::array<unsigned char, 256> pat = pattern();
  for (uint32_t len = 1; len <= 20; ++len) {
    unsigned char* s = g.end() - len;
    std::memcpy(s, pat.data(), len);
    uint64_t lo = ~0ull, hi = ~0ull;
    uint32_t top = ~0u;
    load_upto20(s, len, &lo, &hi, &top);
    unsigned char got[20];
    std::memcpy(got, &lo, 8);
    std::memcpy(got + 8, &hi, 8);
    std::memcpy(got + 16, &top, 4);
    for (uint32_t i = 0; i < 20; ++i) ASSERT_EQ(got[i], i < len ? pat[i] : 0) << "len " << len << " byte " << i;
    if (len <= 16) {
      uint64_t lo2 = ~0ull, hi2 = ~0ull;
      load_small(s, len, &lo2, &hi2);
      EXPECT_EQ(lo2, lo) << len;
      EXPECT_EQ(hi2, hi) << len;
    }
  }
}

// Every length from 1 to 20 bytes, from load_upto20's registers (and, up
// to 16, from load_small's through store_small), ending right before the
// inaccessible page (a store past the message faults) and after 8 canary
// bytes that must stay.
TEST(StoreUpto20, WritesTheBytesAndNoneBeyond) {
  GuardedPage g;  // an access past the end faults
  ASSERT_TRUE(g.ok());
  const std::array<unsigned char, 256> pat = pattern();
  for (uint32_t len = 1; len <= 20; ++len) {
    unsigned char* d = g.end() - len;
    for (int small = 0; small < (len <= 16 ? 2 : 1); ++small) {
      std::memset(d - 8, 0xee, 8 + len);
      uint64_t lo = 0, hi = 0;
      uint32_t top = 0;
      if (small) {
        load_small(pat.data(), len, &lo, &hi);
        store_small(d, len, lo, hi);
      } else {
        load_upto20(pat.data(), len, &lo, &hi, &top);
        store_upto20(d, len, lo, hi, top);
      }
      for (uint32_t i = 0; i < len; ++i) ASSERT_EQ(d[i], pat[i]) << "len " << len << " small " << small << " byte " << i;
      for (int i = 1; i <= 8; ++i) ASSERT_EQ(d[-i], 0xee) << "len " << len << " small " << small;
    }
  }
}

// Every length from 17 to 64 bytes, ending right before the inaccessible
// page and after 8 canary bytes; and as a move within one buffer, the
// destination 1 to 15 bytes before or after the source (every load comes
// before any store).
TEST(Copy17To64, CopiesExactlyTheBytesAndMayOverlap) {
  GuardedPage g;  // an access past the end faults
  ASSERT_TRUE(g.ok());
  const std::array<unsigned char, 256> pat = pattern();
  for (uint32_t n = 17; n <= 64; ++n) {
    unsigned char* d = g.end() - n;
    std::memset(d - 8, 0xee, 8 + n);
    copy_17_to_64(d, pat.data(), n);
    for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(d[i], pat[i]) << "n " << n << " byte " << i;
    for (int i = 1; i <= 8; ++i) ASSERT_EQ(d[-i], 0xee) << "n " << n;
    for (int shift = -15; shift <= 15; ++shift) {
      unsigned char* s = g.end() - 64 - 16;  // room for the destination either side
      std::memcpy(s, pat.data(), n);
      unsigned char* to = s + shift;
      copy_17_to_64(to, s, n);
      for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(to[i], pat[i]) << "n " << n << " shift " << shift << " byte " << i;
    }
  }
}

// copy_upto16 at every length 0-16 and copy_upto64 at every length 0-64:
// exactly the bytes, none before or past them (the copy ends at a guard
// page), and the same with the destination 1 to 15 bytes before or after
// the source (every load comes before any store): around the destination,
// only what the source's region held.
template <typename Copy>
void check_copy_upto(uint32_t max, Copy copy) {
  GuardedPage g;
  ASSERT_TRUE(g.ok());
  const std::array<unsigned char, 256> pat = pattern();
  for (uint32_t n = 0; n <= max; ++n) {
    unsigned char* d = g.end() - n;
    std::memset(d - 8, 0xee, 8 + n);
    copy(d, pat.data(), n);
    for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(d[i], pat[i]) << "max " << max << " n " << n << " byte " << i;
    for (int i = 1; i <= 8; ++i) ASSERT_EQ(d[-i], 0xee) << "max " << max << " n " << n;
    for (int shift = -15; shift <= 15; ++shift) {
      unsigned char* s = g.end() - 96;
      std::memset(s - 48, 0xee, 48 + 96);
      std::memcpy(s, pat.data(), n);
      unsigned char* to = s + shift;
      copy(to, s, n);
      for (int i = -16; i < static_cast<int>(n) + 16; ++i) {
        const int k = i + shift;  // that byte's place in the source's region
        const unsigned char want = i >= 0 && i < static_cast<int>(n) ? pat[i]
                                   : k >= 0 && k < static_cast<int>(n) ? pat[k]
                                                                       : 0xee;
        ASSERT_EQ(to[i], want) << "max " << max << " n " << n << " shift " << shift << " byte " << i;
      }
    }
  }
}

TEST(CopyUpto, CopiesExactlyTheBytesAndMayOverlap) {
  check_copy_upto(16, [](unsigned char* d, const unsigned char* s, uint32_t n) { copy_upto16(d, s, n); });
  check_copy_upto(64, [](unsigned char* d, const unsigned char* s, uint32_t n) { copy_upto64(d, s, n); });
}

// move_one and move_out's one-buffer case leave exactly memmove's bytes:
// lengths around each branch (copy_upto16, 17, memmove) and large ones,
// with and without last_byte_last, disjoint and overlapping (with
// last_byte_last only a destination below the source: above it, the
// source's last byte may be overwritten before it is read, as move_out says).
TEST(MoveOne, LeavesMemmovesBytes) {
  const std::array<unsigned char, 256> pat = pattern();
  std::vector<unsigned char> buf(3 * 70000), want;
  const size_t lens[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 18, 31, 64, 65, 255, 4096, 65536, 65537};
  for (size_t len : lens)
    for (int last = 0; last < 2; ++last)
      for (long shift : {-70000L, -9L, -1L, 1L, 9L, 70000L}) {
        if (last && shift > 0 && shift < static_cast<long>(len)) continue;  // see above
        for (size_t i = 0; i < buf.size(); ++i) buf[i] = pat[(i * 7) % pat.size()];
        unsigned char* src = buf.data() + 70000;
        unsigned char* dst = src + shift;
        if (dst + len > buf.data() + buf.size()) continue;
        want = buf;
        std::memmove(want.data() + (dst - buf.data()), want.data() + 70000, len);
        std::vector<unsigned char> before = buf;
        move_one(dst, src, len, last != 0);
        ASSERT_TRUE(buf == want) << "move_one len " << len << " last " << last << " shift " << shift;
        buf = before;
        const IoVec l{src, len}, r{dst, len};
        ASSERT_EQ(move_out(getpid(), true, &l, 1, &r, 1, last != 0), 0);
        ASSERT_TRUE(buf == want) << "move_out len " << len << " last " << last << " shift " << shift;
      }
  // Unequal lengths: EINVAL, nothing moved.
  std::vector<unsigned char> before = buf;
  const IoVec l{buf.data(), 10}, r{buf.data() + 100, 11};
  EXPECT_EQ(move_out(getpid(), true, &l, 1, &r, 1, true), EINVAL);
  EXPECT_TRUE(buf == before);
}

// Above kMovePiece a move goes in pieces when the ranges do not overlap,
// whole when they do (either direction), and move_in's lists too.
TEST(MoveBytes, MovesLargeRangesInPiecesOrWhole) {
  const std::array<unsigned char, 256> pat = pattern();
  const size_t big = 3 * kMovePiece + 5;
  std::vector<unsigned char> buf(3 * big), want;
  const size_t lens[] = {kMovePiece - 1, kMovePiece, kMovePiece + 1, 2 * kMovePiece, big};
  for (size_t len : lens)
    for (long shift : {-static_cast<long>(big), -4097L, -1L, 1L, 4097L, static_cast<long>(big)}) {
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = pat[(i * 7 + i / 251) % pat.size()];
      unsigned char* src = buf.data() + big;
      unsigned char* dst = src + shift;
      want = buf;
      std::memmove(want.data() + (dst - buf.data()), want.data() + big, len);
      std::vector<unsigned char> before = buf;
      move_bytes(dst, src, len);
      ASSERT_TRUE(buf == want) << "move_bytes len " << len << " shift " << shift;
      buf = before;
      move_one(dst, src, len, shift < 0 || shift >= static_cast<long>(len));
      ASSERT_TRUE(buf == want) << "move_one len " << len << " shift " << shift;
      buf = before;
      const IoVec l{dst, len}, r{src, len};
      ASSERT_EQ(move_in(getpid(), true, &l, 1, &r, 1), 0);
      ASSERT_TRUE(buf == want) << "move_in len " << len << " shift " << shift;
    }
}

}  // namespace
}  // namespace shmrdma
