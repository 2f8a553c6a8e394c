// SPDX-License-Identifier: MIT
//
// Unit tests for src/segment.h: creating (O_EXCL, 0600), publishing and
// attaching shared segments, and every reason an attach must refuse a file.

#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "proc.h"

namespace shmrdma {
namespace {

using layout::SegmentHeader;
using layout::SegmentKind;

constexpr uint64_t kSize = 4 * 4096;

class SegmentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shmrdma-ut-seg-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/seg";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Raw access to the file, independent of Mapping.
  struct RawHeader {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t kind;
    uint64_t layout_size;
    uint32_t ready;
    uint32_t owner_pid;
    uint64_t owner_start_time;
  };
  static_assert(sizeof(RawHeader) == sizeof(SegmentHeader));
  static_assert(offsetof(RawHeader, ready) == offsetof(SegmentHeader, ready));
  static_assert(offsetof(RawHeader, owner_start_time) == offsetof(SegmentHeader, owner_start_time));
  RawHeader read_header() {
    RawHeader h{};
    int fd = ::open(path_.c_str(), O_RDONLY);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::pread(fd, &h, sizeof h, 0), static_cast<ssize_t>(sizeof h));
    ::close(fd);
    return h;
  }
  template <typename T>
  void poke(uint64_t off, T v) {
    int fd = ::open(path_.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, &v, sizeof v, static_cast<off_t>(off)), static_cast<ssize_t>(sizeof v));
    ::close(fd);
  }
  // Creates and publishes a segment, then drops the creator's mapping.
  void make_published(SegmentKind kind = SegmentKind::kContext) {
    Mapping m;
    ASSERT_EQ(Mapping::create(path_, kSize, kind, &m), 0);
    m.publish();
  }
  int attach(SegmentKind kind = SegmentKind::kContext, uint64_t expected = 0) {
    Mapping m;
    int rc = Mapping::attach(path_, kind, expected, &m);
    // A refused attach leaves the output untouched.
    if (rc) {
      EXPECT_EQ(m.base(), nullptr);
    }
    return rc;
  }

  std::string dir_, path_;
};

TEST_F(SegmentTest, CreateFillsTheHeader) {
  Mapping m;
  ASSERT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &m), 0);
  ASSERT_NE(m.base(), nullptr);
  EXPECT_EQ(m.size(), kSize);
  EXPECT_EQ(m.path(), path_);
  EXPECT_GE(m.fd(), 0);
  RawHeader h = read_header();
  EXPECT_EQ(h.magic, layout::kMagic);
  EXPECT_EQ(h.layout_version, layout::kLayoutVersion);
  EXPECT_EQ(h.kind, static_cast<uint32_t>(SegmentKind::kContext));
  EXPECT_EQ(h.layout_size, kSize);
  EXPECT_EQ(h.ready, 0u) << "not ready before publish()";
  EXPECT_EQ(h.owner_pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(h.owner_start_time, process_start_time(::getpid()));
  struct stat st{};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kSize);
  m.publish();
  EXPECT_EQ(read_header().ready, layout::kReadyMagic);
}

TEST_F(SegmentTest, CreateIsExclusive) {
  Mapping a, b;
  ASSERT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &a), 0);
  EXPECT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &b), EEXIST);
  EXPECT_EQ(b.base(), nullptr);
  // The loser did not damage the winner's file.
  struct stat st{};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kSize);
  EXPECT_EQ(read_header().magic, layout::kMagic);
}

TEST_F(SegmentTest, CreateRefusesAnExistingFileOrSymlink) {
  std::string target = dir_ + "/target";
  ASSERT_EQ(::symlink(target.c_str(), path_.c_str()), 0);
  Mapping m;
  EXPECT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &m), EEXIST);
  EXPECT_FALSE(std::filesystem::exists(target)) << "create must not follow a symlink";
}

TEST_F(SegmentTest, CreateMode0600) {
  mode_t old = ::umask(0);  // the file must be 0600 by itself, not thanks to the umask
  Mapping m;
  int rc = Mapping::create(path_, kSize, SegmentKind::kContext, &m);
  ::umask(old);
  ASSERT_EQ(rc, 0);
  struct stat st{};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(SegmentTest, CreateInAMissingDirectoryFails) {
  Mapping m;
  EXPECT_EQ(Mapping::create(dir_ + "/nope/seg", kSize, SegmentKind::kContext, &m), ENOENT);
}

TEST_F(SegmentTest, AttachAfterPublishSeesTheCreatorsData) {
  Mapping c;
  ASSERT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &c), 0);
  for (uint64_t i = 0; i < 1024; ++i) c.at<uint32_t>(4096)[i] = static_cast<uint32_t>(i * 2654435761u);
  *c.at<uint64_t>(kSize - 8) = 0x1122334455667788ull;
  c.publish();
  Mapping a;
  ASSERT_EQ(Mapping::attach(path_, SegmentKind::kContext, kSize, &a), 0);
  ASSERT_NE(a.base(), nullptr);
  EXPECT_NE(a.base(), c.base());
  EXPECT_EQ(a.size(), kSize);
  for (uint64_t i = 0; i < 1024; ++i) ASSERT_EQ(a.at<uint32_t>(4096)[i], static_cast<uint32_t>(i * 2654435761u));
  EXPECT_EQ(*a.at<uint64_t>(kSize - 8), 0x1122334455667788ull);
  // Shared both ways.
  *a.at<uint64_t>(8192) = 42;
  EXPECT_EQ(*c.at<uint64_t>(8192), 42u);
  // expected_size 0 accepts whatever size header and file agree on.
  Mapping b;
  EXPECT_EQ(Mapping::attach(path_, SegmentKind::kContext, 0, &b), 0);
  EXPECT_EQ(b.size(), kSize);
}

TEST_F(SegmentTest, AttachSurvivesTheCreatorsUnmap) {
  make_published(SegmentKind::kRegistry);
  EXPECT_EQ(attach(SegmentKind::kRegistry, kSize), 0);
}

TEST_F(SegmentTest, AttachMissingFile) { EXPECT_EQ(attach(), ENOENT); }

TEST_F(SegmentTest, AttachNotYetPublished) {
  Mapping c;
  ASSERT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &c), 0);
  EXPECT_EQ(attach(), EAGAIN);
  c.publish();
  EXPECT_EQ(attach(), 0);
  // A wrong ready value is "not ready" too.
  poke<uint32_t>(offsetof(SegmentHeader, ready), layout::kReadyMagic ^ 1);
  EXPECT_EQ(attach(), EAGAIN);
}

TEST_F(SegmentTest, AttachRejectsWrongMagic) {
  make_published();
  poke<uint64_t>(offsetof(SegmentHeader, magic), layout::kMagic ^ 0x100);
  EXPECT_EQ(attach(), EPROTO);
}

TEST_F(SegmentTest, AttachRejectsWrongVersion) {
  make_published();
  poke<uint32_t>(offsetof(SegmentHeader, layout_version), layout::kLayoutVersion + 1);
  EXPECT_EQ(attach(), EPROTO);
}

TEST_F(SegmentTest, AttachRejectsWrongKind) {
  make_published(SegmentKind::kContext);
  EXPECT_EQ(attach(SegmentKind::kRegistry), EPROTO);
  EXPECT_EQ(attach(SegmentKind::kContext), 0);
  poke<uint32_t>(offsetof(SegmentHeader, kind), 77);
  EXPECT_EQ(attach(SegmentKind::kContext), EPROTO);
}

TEST_F(SegmentTest, AttachRejectsHeaderSizeMismatch) {
  make_published();
  poke<uint64_t>(offsetof(SegmentHeader, layout_size), kSize + 4096);
  EXPECT_EQ(attach(), EPROTO);
  poke<uint64_t>(offsetof(SegmentHeader, layout_size), kSize - 4096);
  EXPECT_EQ(attach(), EPROTO);
}

TEST_F(SegmentTest, AttachRejectsAGrownFile) {
  make_published();
  ASSERT_EQ(::truncate(path_.c_str(), kSize + 4096), 0);
  EXPECT_EQ(attach(), EPROTO);
}

TEST_F(SegmentTest, AttachRejectsExpectedSizeMismatch) {
  make_published();
  EXPECT_EQ(attach(SegmentKind::kContext, kSize * 2), EPROTO);
  EXPECT_EQ(attach(SegmentKind::kContext, kSize - 4096), EPROTO);
  EXPECT_EQ(attach(SegmentKind::kContext, kSize), 0);
}

TEST_F(SegmentTest, AttachRejectsTruncatedFiles) {
  make_published();
  ASSERT_EQ(::truncate(path_.c_str(), kSize / 2), 0);  // header intact, body cut
  EXPECT_EQ(attach(), EPROTO);
  EXPECT_EQ(attach(SegmentKind::kContext, kSize), EPROTO);
  ASSERT_EQ(::truncate(path_.c_str(), sizeof(SegmentHeader) - 1), 0);  // not even a header
  EXPECT_EQ(attach(), EPROTO);
  // An empty file is one whose creator has not sized it yet: not ready.
  ASSERT_EQ(::truncate(path_.c_str(), 0), 0);
  EXPECT_EQ(attach(), EAGAIN);
}

TEST_F(SegmentTest, AttachRejectsNonRegularFilesAndSymlinks) {
  make_published();
  std::string link = dir_ + "/link";
  ASSERT_EQ(::symlink(path_.c_str(), link.c_str()), 0);
  Mapping m;
  EXPECT_NE(Mapping::attach(link, SegmentKind::kContext, 0, &m), 0);
  EXPECT_EQ(m.base(), nullptr);
  EXPECT_NE(Mapping::attach(dir_, SegmentKind::kContext, 0, &m), 0);
  EXPECT_EQ(m.base(), nullptr);
}

TEST_F(SegmentTest, MoveAndReset) {
  Mapping a;
  ASSERT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &a), 0);
  void* base = a.base();
  Mapping b(std::move(a));
  EXPECT_EQ(a.base(), nullptr);
  EXPECT_EQ(a.fd(), -1);
  EXPECT_EQ(b.base(), base);
  EXPECT_EQ(b.path(), path_);
  b.reset();
  EXPECT_EQ(b.base(), nullptr);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_TRUE(b.path().empty());
  EXPECT_TRUE(std::filesystem::exists(path_)) << "reset unmaps, it does not unlink";
}

TEST_F(SegmentTest, Contains) {
  Mapping a;
  ASSERT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &a), 0);
  EXPECT_TRUE(a.contains(0, kSize));
  EXPECT_TRUE(a.contains(kSize, 0));
  EXPECT_FALSE(a.contains(1, kSize));
  EXPECT_FALSE(a.contains(kSize + 1, 0));
  EXPECT_FALSE(a.contains(8, UINT64_MAX));  // no overflow
}

TEST_F(SegmentTest, DiscardZeroesWholePagesOnly) {
  Mapping a;
  ASSERT_EQ(Mapping::create(path_, kSize, SegmentKind::kContext, &a), 0);
  std::memset(a.at<char>(4096), 0xab, 2 * 4096);
  a.discard(4096 + 64, 4096);  // covers no whole page: nothing happens
  EXPECT_EQ(*a.at<unsigned char>(4096 + 64), 0xab);
  a.discard(4096 - 64, 4096 + 128);  // covers exactly the page at 4096
  EXPECT_EQ(*a.at<unsigned char>(4096), 0);
  EXPECT_EQ(*a.at<unsigned char>(2 * 4096 - 1), 0);
  EXPECT_EQ(*a.at<unsigned char>(2 * 4096), 0xab) << "the partial page after it is kept";
  EXPECT_EQ(a.header()->magic, layout::kMagic) << "the header page is kept";
  a.discard(kSize - 4096, 8192);  // out of range: ignored, no crash
}

TEST_F(SegmentTest, WriteAndReadSmallFiles) {
  std::string f = dir_ + "/small";
  ASSERT_EQ(write_file_atomic(f, "hello\n", 0444), 0);
  struct stat st{};
  ASSERT_EQ(::stat(f.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0444u);
  std::string s;
  ASSERT_EQ(read_small_file(f, &s), 0);
  EXPECT_EQ(s, "hello");
  // Replacing a read-only file works (rename), and leaves no temp file.
  ASSERT_EQ(write_file_atomic(f, "again", 0644), 0);
  ASSERT_EQ(read_small_file(f, &s), 0);
  EXPECT_EQ(s, "again");
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator(dir_)) n += e.path().filename() != "small";
  EXPECT_EQ(n, 0);
  EXPECT_EQ(read_small_file(dir_ + "/missing", &s), ENOENT);
  EXPECT_EQ(write_file_atomic(dir_ + "/no/such/dir", "x"), ENOENT);
}

}  // namespace
}  // namespace shmrdma
