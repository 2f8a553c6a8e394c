// SPDX-License-Identifier: MIT
//
// Unit tests for src/mover.h's inline helpers of the small-message path:
// move_out_small copies exactly the bytes asked for, and own_dest_line (the
// hint that takes a receive buffer's line for writing before a send stores
// into it) changes no byte wherever it points.

#include "mover.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>

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

}  // namespace
}  // namespace shmrdma
