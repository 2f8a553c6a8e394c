// SPDX-License-Identifier: MIT
//
// Unit tests for src/registry.h: context slots, device-wide accounting, QPN
// allocation, reclaiming dead processes (exited, reused pid, orphaned segment
// files) and the robust registry lock (a holder that dies does not block
// anyone).

#include "registry.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "proc.h"

namespace shmrdma {
namespace {

using layout::ContextSlot;
using layout::RegistrySegment;
namespace fs = std::filesystem;

struct Slot {
  uint32_t slot = 0, generation = 0;
  std::string segment;
};

bool write_all(int fd, const void* p, size_t n) { return ::write(fd, p, n) == static_cast<ssize_t>(n); }
bool read_all(int fd, void* p, size_t n) { return ::read(fd, p, n) == static_cast<ssize_t>(n); }

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shmrdma-ut-reg-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    home_ = tmpl;
    paths_ = device_paths(home_, "utreg0");
    fs::create_directories(paths_.device_dir);
    layout::DeviceRecord d{};
    std::snprintf(d.name, sizeof d.name, "%s", "utreg0");
    d.node_guid = 0x0200000000001200ull;
    d.sys_image_guid = d.node_guid;
    d.num_ports = 1;
    d.ports[0].lid = 7;
    d.ports[0].state = 4;
    d.ports[0].port_guid = d.node_guid + 1;
    record_ = d;
    ASSERT_EQ(Registry::create(paths_, d, &reg_), 0);
    ASSERT_TRUE(reg_.valid());
    // An independent view of the same file, for forging and inspecting.
    ASSERT_EQ(Mapping::attach(paths_.registry, layout::SegmentKind::kRegistry, layout::registry_size(), &raw_), 0);
  }
  void TearDown() override {
    raw_.reset();
    reg_ = Registry();
    fs::remove_all(home_);
  }

  RegistrySegment* seg() { return static_cast<RegistrySegment*>(raw_.base()); }
  Slot reg_context(Registry& r) {
    Slot s;
    EXPECT_EQ(r.register_context(&s.slot, &s.generation, &s.segment), 0);
    return s;
  }
  std::string seg_path(const std::string& name) { return paths_.device_dir + "/" + name; }
  void touch(const std::string& name) {
    int fd = ::open(seg_path(name).c_str(), O_CREAT | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }

  std::string home_;
  DevicePaths paths_;
  layout::DeviceRecord record_{};
  Registry reg_;
  Mapping raw_;
};

TEST_F(RegistryTest, CreateThenAttach) {
  EXPECT_EQ(reg_.device().node_guid, record_.node_guid);
  Registry again;
  EXPECT_EQ(Registry::create(paths_, record_, &again), EEXIST);
  EXPECT_FALSE(again.valid());
  Registry r;
  ASSERT_EQ(Registry::attach(paths_, &r), 0);
  EXPECT_TRUE(r.valid());
  EXPECT_STREQ(r.device().name, "utreg0");
  EXPECT_EQ(r.device().node_guid, record_.node_guid);
  EXPECT_EQ(r.device().num_ports, 1u);
  EXPECT_EQ(r.device().ports[0].lid, 7);
  EXPECT_EQ(r.paths().registry, paths_.registry);
  struct stat st{};
  ASSERT_EQ(::stat(paths_.registry.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), layout::registry_size());
}

TEST_F(RegistryTest, AttachRejections) {
  Registry r;
  EXPECT_EQ(Registry::attach(device_paths(home_, "nodev"), &r), ENOENT);
  DevicePaths other = paths_;
  other.name = "utreg1";  // the record names another device
  EXPECT_EQ(Registry::attach(other, &r), EPROTO);
  seg()->device.num_ports = 0;
  EXPECT_EQ(Registry::attach(paths_, &r), EPROTO);
  seg()->device.num_ports = limits::kMaxPorts + 1;
  EXPECT_EQ(Registry::attach(paths_, &r), EPROTO);
  seg()->device.num_ports = 1;
  // An unterminated name is cut, not read past its end.
  std::memset(seg()->device.name, 'a', sizeof seg()->device.name);
  EXPECT_EQ(Registry::attach(paths_, &r), EPROTO);
  EXPECT_FALSE(r.valid());
}

TEST_F(RegistryTest, RegisterFillsASlotWithOurIdentity) {
  Slot s = reg_context(reg_);
  ASSERT_LT(s.slot, limits::kMaxContexts);
  EXPECT_EQ(s.segment, "ctx-" + std::to_string(s.slot) + "-" + std::to_string(s.generation));
  const ContextSlot& cs = seg()->contexts[s.slot];
  EXPECT_EQ(cs.state.load(), layout::kLive);
  EXPECT_EQ(cs.pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(cs.start_time, process_start_time(::getpid()));
  EXPECT_NE(cs.start_time, 0u);
  EXPECT_EQ(cs.generation, s.generation);
  EXPECT_STREQ(cs.segment, s.segment.c_str());
  for (uint32_t k = 0; k < layout::kObjKinds; ++k) EXPECT_EQ(cs.held[k], 0u);

  auto live = reg_.live_contexts();
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].slot, s.slot);
  EXPECT_EQ(live[0].generation, s.generation);
  EXPECT_EQ(live[0].pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(live[0].start_time, process_start_time(::getpid()));
  EXPECT_EQ(live[0].segment, s.segment);
}

TEST_F(RegistryTest, UnregisterFreesAndReuseBumpsTheGeneration) {
  Slot a = reg_context(reg_);
  Slot b = reg_context(reg_);
  EXPECT_NE(a.slot, b.slot);
  EXPECT_NE(a.segment, b.segment);
  EXPECT_EQ(reg_.live_contexts().size(), 2u);
  reg_.unregister_context(a.slot, a.generation + 1);  // wrong generation: ignored
  EXPECT_EQ(reg_.live_contexts().size(), 2u);
  reg_.unregister_context(limits::kMaxContexts, 0);  // out of range: ignored
  reg_.unregister_context(a.slot, a.generation);
  auto live = reg_.live_contexts();
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].slot, b.slot);
  Slot c = reg_context(reg_);
  EXPECT_EQ(c.slot, a.slot) << "the first free slot is reused";
  EXPECT_EQ(c.generation, a.generation + 1);
  EXPECT_NE(c.segment, a.segment);
}

TEST_F(RegistryTest, AllSlotsInUse) {
  std::vector<Slot> all;
  for (uint32_t i = 0; i < limits::kMaxContexts; ++i) all.push_back(reg_context(reg_));
  uint32_t s, g;
  std::string name;
  EXPECT_EQ(reg_.register_context(&s, &g, &name), ENOMEM);
  reg_.unregister_context(all[17].slot, all[17].generation);
  EXPECT_EQ(reg_.register_context(&s, &g, &name), 0);
  EXPECT_EQ(s, all[17].slot);
}

TEST_F(RegistryTest, ChargeIsDeviceWideAcrossContexts) {
  Registry other;
  ASSERT_EQ(Registry::attach(paths_, &other), 0);
  Slot a = reg_context(reg_);
  Slot b = reg_context(other);
  constexpr uint32_t kLimit = 3;
  EXPECT_EQ(reg_.charge(a.slot, a.generation, layout::kObjCq, kLimit), 0);
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjCq, kLimit), 0);
  EXPECT_EQ(reg_.charge(a.slot, a.generation, layout::kObjCq, kLimit), 0);
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjCq, kLimit), ENOMEM);
  EXPECT_EQ(reg_.charge(a.slot, a.generation, layout::kObjCq, kLimit), ENOMEM);
  // Other kinds are counted separately.
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjPd, kLimit), 0);
  EXPECT_EQ(seg()->contexts[a.slot].held[layout::kObjCq], 2u);
  EXPECT_EQ(seg()->contexts[b.slot].held[layout::kObjCq], 1u);
  EXPECT_EQ(seg()->contexts[b.slot].held[layout::kObjPd], 1u);

  other.uncharge(b.slot, b.generation, layout::kObjCq);
  EXPECT_EQ(seg()->contexts[b.slot].held[layout::kObjCq], 0u);
  other.uncharge(b.slot, b.generation, layout::kObjCq);  // never below zero
  EXPECT_EQ(seg()->contexts[b.slot].held[layout::kObjCq], 0u);
  EXPECT_EQ(reg_.charge(a.slot, a.generation, layout::kObjCq, kLimit), 0);
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjCq, kLimit), ENOMEM);

  // What an unregistered context held no longer counts.
  auto live = reg_.live_contexts();
  auto it = std::find_if(live.begin(), live.end(), [&](const ContextInfo& c) { return c.slot == a.slot; });
  ASSERT_NE(it, live.end());
  EXPECT_EQ(it->held[layout::kObjCq], 3u);
  reg_.unregister_context(a.slot, a.generation);
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjCq, kLimit), 0);
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjCq, kLimit), 0);
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjCq, kLimit), 0);
  EXPECT_EQ(other.charge(b.slot, b.generation, layout::kObjCq, kLimit), ENOMEM);
}

TEST_F(RegistryTest, ChargeRejectsBadArgumentsAndStaleSlots) {
  Slot a = reg_context(reg_);
  EXPECT_EQ(reg_.charge(limits::kMaxContexts, a.generation, layout::kObjPd, 10), EINVAL);
  EXPECT_EQ(reg_.charge(a.slot, a.generation, layout::kObjKinds, 10), EINVAL);
  EXPECT_EQ(reg_.charge(a.slot, a.generation + 1, layout::kObjPd, 10), EIO);
  reg_.unregister_context(a.slot, a.generation);
  EXPECT_EQ(reg_.charge(a.slot, a.generation, layout::kObjPd, 10), EIO) << "a freed slot cannot be charged";
  // A stale uncharge does not touch the slot's new owner.
  Slot b = reg_context(reg_);
  ASSERT_EQ(b.slot, a.slot);
  ASSERT_EQ(reg_.charge(b.slot, b.generation, layout::kObjPd, 10), 0);
  reg_.uncharge(a.slot, a.generation, layout::kObjPd);
  EXPECT_EQ(seg()->contexts[b.slot].held[layout::kObjPd], 1u);
}

TEST_F(RegistryTest, QpnAllocationSkipsReservedNumbersAndWraps) {
  EXPECT_EQ(reg_.alloc_qpn(), limits::kFirstQpn);
  EXPECT_EQ(reg_.alloc_qpn(), limits::kFirstQpn + 1);
  Registry other;
  ASSERT_EQ(Registry::attach(paths_, &other), 0);
  EXPECT_EQ(other.alloc_qpn(), limits::kFirstQpn + 2) << "one counter per device";
  seg()->next_qpn.store(limits::kQpnMask - 1);
  EXPECT_EQ(reg_.alloc_qpn(), limits::kQpnMask - 1);
  EXPECT_EQ(reg_.alloc_qpn(), limits::kQpnMask);
  EXPECT_EQ(reg_.alloc_qpn(), limits::kFirstQpn) << "24-bit wrap skips 0..kFirstQpn-1";
  seg()->next_qpn.store(0xffffffffu);  // the 32-bit counter itself wraps
  uint32_t q = reg_.alloc_qpn();
  EXPECT_GE(q, limits::kFirstQpn);
  EXPECT_LE(q, limits::kQpnMask);
}

// Forks a child that registers a context (and creates its segment file),
// reports its slot and then either exits at once or waits for `release_fd`.
struct ChildContext {
  pid_t pid = -1;
  Slot slot;
  int release_fd = -1;  // close to let a waiting child exit
};

ChildContext fork_registered_child(const DevicePaths& paths, bool wait_for_release) {
  int up[2], down[2];
  if (::pipe(up) != 0 || ::pipe(down) != 0) return {};
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(up[0]);
    ::close(down[1]);
    Registry r;
    if (Registry::attach(paths, &r) != 0) ::_exit(2);
    uint32_t slot, gen;
    std::string name;
    if (r.register_context(&slot, &gen, &name) != 0) ::_exit(3);
    for (const std::string& f : {name, name + kAsyncSuffix}) {
      int fd = ::open((paths.device_dir + "/" + f).c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
      if (fd < 0) ::_exit(4);
      ::close(fd);
    }
    if (r.charge(slot, gen, layout::kObjPd, 100) != 0) ::_exit(5);
    uint32_t msg[2] = {slot, gen};
    if (!write_all(up[1], msg, sizeof msg)) ::_exit(6);
    if (wait_for_release) {
      char c;
      (void)::read(down[0], &c, 1);
    }
    ::_exit(0);  // no unregister: the process just dies
  }
  ::close(up[1]);
  ::close(down[0]);
  ChildContext c;
  c.pid = pid;
  uint32_t msg[2] = {~0u, ~0u};
  if (pid > 0 && read_all(up[0], msg, sizeof msg)) {
    c.slot.slot = msg[0];
    c.slot.generation = msg[1];
    c.slot.segment = "ctx-" + std::to_string(msg[0]) + "-" + std::to_string(msg[1]);
  }
  ::close(up[0]);
  c.release_fd = down[1];
  return c;
}

int reap(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_F(RegistryTest, ReclaimFreesTheSlotOfADeadProcess) {
  Slot mine = reg_context(reg_);
  touch(mine.segment);
  ChildContext c = fork_registered_child(paths_, false);
  ASSERT_GT(c.pid, 0);
  ::close(c.release_fd);
  ASSERT_EQ(reap(c.pid), 0);
  ASSERT_NE(c.slot.slot, ~0u);
  ASSERT_LT(c.slot.slot, limits::kMaxContexts);
  // Still marked live until someone reclaims it.
  EXPECT_EQ(seg()->contexts[c.slot.slot].state.load(), layout::kLive);
  EXPECT_EQ(seg()->contexts[c.slot.slot].pid, static_cast<uint32_t>(c.pid));
  ASSERT_TRUE(fs::exists(seg_path(c.slot.segment)));

  std::vector<ContextInfo> gone;
  EXPECT_EQ(reg_.reclaim_dead(&gone), 1);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].pid, static_cast<uint32_t>(c.pid));
  EXPECT_EQ(gone[0].slot, c.slot.slot);
  EXPECT_EQ(gone[0].generation, c.slot.generation);
  EXPECT_EQ(gone[0].segment, c.slot.segment);
  EXPECT_EQ(gone[0].held[layout::kObjPd], 1u);
  EXPECT_FALSE(fs::exists(seg_path(c.slot.segment))) << "the dead context's segment is removed";
  EXPECT_FALSE(fs::exists(seg_path(c.slot.segment + kAsyncSuffix))) << "and its async FIFO";
  EXPECT_EQ(seg()->contexts[c.slot.slot].state.load(), layout::kFree);
  EXPECT_EQ(reg_.charge(mine.slot, mine.generation, layout::kObjPd, 1), 0) << "its charges are gone";
  EXPECT_EQ(reg_.charge(mine.slot, mine.generation, layout::kObjPd, 1), ENOMEM);

  // Ours is untouched.
  EXPECT_TRUE(fs::exists(seg_path(mine.segment)));
  EXPECT_EQ(seg()->contexts[mine.slot].state.load(), layout::kLive);
  auto live = reg_.live_contexts();
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].slot, mine.slot);
  EXPECT_EQ(reg_.reclaim_dead(), 0) << "nothing left to reclaim";
}

TEST_F(RegistryTest, ChargeAtTheLimitReclaimsDeadContextsFirst) {
  Slot mine = reg_context(reg_);
  ChildContext c = fork_registered_child(paths_, false);  // holds one PD, then dies
  ASSERT_GT(c.pid, 0);
  ::close(c.release_fd);
  ASSERT_EQ(reap(c.pid), 0);
  ASSERT_LT(c.slot.slot, limits::kMaxContexts);
  ASSERT_EQ(seg()->contexts[c.slot.slot].held[layout::kObjPd], 1u);
  // The dead process's PD would reach the limit of 1; it must not count.
  EXPECT_EQ(reg_.charge(mine.slot, mine.generation, layout::kObjPd, 1), 0);
  EXPECT_EQ(seg()->contexts[c.slot.slot].state.load(), layout::kFree);
  EXPECT_FALSE(fs::exists(seg_path(c.slot.segment)));
  EXPECT_EQ(reg_.charge(mine.slot, mine.generation, layout::kObjPd, 1), ENOMEM) << "live charges still count";
  // The same for a forged reused pid.
  ContextSlot& s = seg()->contexts[201];
  s.pid = static_cast<uint32_t>(::getpid());
  s.start_time = process_start_time(::getpid()) + 7;
  s.generation = 1;
  std::snprintf(s.segment, sizeof s.segment, "ctx-201-1");
  s.held[layout::kObjCq] = 2;
  s.state.store(layout::kLive, std::memory_order_release);
  EXPECT_EQ(reg_.charge(mine.slot, mine.generation, layout::kObjCq, 2), 0);
  EXPECT_EQ(s.state.load(), layout::kFree);
}

TEST_F(RegistryTest, ReclaimDoesNotTouchLiveProcesses) {
  ChildContext c = fork_registered_child(paths_, true);
  ASSERT_GT(c.pid, 0);
  ASSERT_LT(c.slot.slot, limits::kMaxContexts);
  EXPECT_EQ(reg_.reclaim_dead(), 0);
  EXPECT_TRUE(fs::exists(seg_path(c.slot.segment)));
  auto live = reg_.live_contexts();
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].pid, static_cast<uint32_t>(c.pid));
  ::close(c.release_fd);
  ASSERT_EQ(reap(c.pid), 0);
  EXPECT_EQ(reg_.reclaim_dead(), 1);
  EXPECT_TRUE(reg_.live_contexts().empty());
}

TEST_F(RegistryTest, ZombieCountsAsDead) {
  ChildContext c = fork_registered_child(paths_, false);
  ASSERT_GT(c.pid, 0);
  ::close(c.release_fd);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOWAIT), 0);  // exited, not reaped
  EXPECT_EQ(reg_.reclaim_dead(), 1);
  ASSERT_EQ(reap(c.pid), 0);
}

TEST_F(RegistryTest, ReusedPidWithAnotherStartTimeCountsAsDead) {
  Slot mine = reg_context(reg_);
  // Forge a slot: our own (live) pid, but a start time that is not ours, as
  // if a dead context's pid had been reused by us.
  const uint32_t forged = 200;
  ASSERT_NE(mine.slot, forged);
  ContextSlot& s = seg()->contexts[forged];
  s.pid = static_cast<uint32_t>(::getpid());
  s.start_time = process_start_time(::getpid()) + 1000;
  s.generation = 5;
  std::snprintf(s.segment, sizeof s.segment, "ctx-%u-%u", forged, 5u);
  s.held[layout::kObjMr] = 4;
  s.state.store(layout::kLive, std::memory_order_release);
  touch("ctx-200-5");

  std::vector<ContextInfo> gone;
  EXPECT_EQ(reg_.reclaim_dead(&gone), 1);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].slot, forged);
  EXPECT_EQ(gone[0].pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(gone[0].held[layout::kObjMr], 4u);
  EXPECT_FALSE(fs::exists(seg_path("ctx-200-5")));
  EXPECT_EQ(s.state.load(), layout::kFree);
  EXPECT_EQ(seg()->contexts[mine.slot].state.load(), layout::kLive) << "the real one stays";
  EXPECT_EQ(reg_.charge(mine.slot, mine.generation, layout::kObjMr, 4), 0);
}

TEST_F(RegistryTest, ReclaimRemovesOrphanSegmentFilesOnly) {
  Slot mine = reg_context(reg_);
  touch(mine.segment);
  touch(mine.segment + kAsyncSuffix);
  touch("ctx-250-3");   // no live slot names it
  touch("ctx-250-3.async");
  touch(mine.segment + "0.async");  // a longer number that starts like ours
  touch("ctx-1-1.other");  // not a name we would write
  touch("ctx-17-1");    // neither
  touch("ctx-1x-1");    // not a name we would write: left alone
  touch("ctx-5");       // neither
  touch("notes");
  EXPECT_EQ(reg_.reclaim_dead(), 0) << "orphan files are not counted as contexts";
  EXPECT_FALSE(fs::exists(seg_path("ctx-250-3")));
  EXPECT_FALSE(fs::exists(seg_path("ctx-17-1")));
  EXPECT_FALSE(fs::exists(seg_path("ctx-250-3.async")));
  EXPECT_FALSE(fs::exists(seg_path(mine.segment + "0.async")));
  EXPECT_TRUE(fs::exists(seg_path(mine.segment)));
  EXPECT_TRUE(fs::exists(seg_path(mine.segment + kAsyncSuffix)));
  EXPECT_TRUE(fs::exists(seg_path("ctx-1-1.other")));
  EXPECT_TRUE(fs::exists(seg_path("ctx-1x-1")));
  EXPECT_TRUE(fs::exists(seg_path("ctx-5")));
  EXPECT_TRUE(fs::exists(seg_path("notes")));
  EXPECT_TRUE(fs::exists(paths_.registry));
}

TEST_F(RegistryTest, NameOfAFreedSlotIsAnOrphan) {
  Slot a = reg_context(reg_);
  touch(a.segment);
  reg_.unregister_context(a.slot, a.generation);  // file left behind
  EXPECT_EQ(reg_.reclaim_dead(), 0);
  EXPECT_FALSE(fs::exists(seg_path(a.segment)));
}

// Maps the registry file and takes its lock directly, as a process that dies
// inside a registry critical section would; never unlocks.
[[noreturn]] void lock_registry_and_die(const std::string& registry, int ready_fd, unsigned hold_ms) {
  int fd = ::open(registry.c_str(), O_RDWR);
  if (fd < 0) ::_exit(2);
  void* p = ::mmap(nullptr, layout::registry_size(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) ::_exit(3);
  auto* s = static_cast<RegistrySegment*>(p);
  if (pthread_mutex_lock(&s->lock) != 0) ::_exit(4);
  char c = 1;
  if (!write_all(ready_fd, &c, 1)) ::_exit(5);
  if (hold_ms) ::usleep(hold_ms * 1000);
  ::_exit(0);
}

TEST_F(RegistryTest, HolderThatDiedDoesNotBlockTheLock) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    lock_registry_and_die(paths_.registry, fds[1], 0);
  }
  ASSERT_GT(pid, 0);
  ::close(fds[1]);
  char c = 0;
  ASSERT_TRUE(read_all(fds[0], &c, 1)) << "child could not take the lock";
  ::close(fds[0]);
  ASSERT_EQ(reap(pid), 0);

  auto t0 = std::chrono::steady_clock::now();
  uint32_t slot, gen;
  std::string name;
  EXPECT_EQ(reg_.register_context(&slot, &gen, &name), 0);
  auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(dt, std::chrono::seconds(2)) << "the lock of a dead holder must be recovered, not timed out";
  // The mutex is consistent again: further calls work and do not wait.
  t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(reg_.charge(slot, gen, layout::kObjPd, 10), 0);
  EXPECT_EQ(reg_.live_contexts().size(), 1u);
  Registry other;
  ASSERT_EQ(Registry::attach(paths_, &other), 0);
  EXPECT_EQ(other.reclaim_dead(), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
}

TEST_F(RegistryTest, WaiterRecoversWhenTheHolderDies) {
  // A child that registered a context takes the lock, holds it for a while
  // and dies: our call waits for it, then recovers the lock and reclaims
  // the child's slot.
  ChildContext reg_child = fork_registered_child(paths_, false);
  ASSERT_GT(reg_child.pid, 0);
  ::close(reg_child.release_fd);
  ASSERT_EQ(reap(reg_child.pid), 0);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    lock_registry_and_die(paths_.registry, fds[1], 300);
  }
  ASSERT_GT(pid, 0);
  ::close(fds[1]);
  char c = 0;
  ASSERT_TRUE(read_all(fds[0], &c, 1));
  ::close(fds[0]);
  auto t0 = std::chrono::steady_clock::now();
  auto live = reg_.live_contexts();  // blocks until the holder dies
  auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(live.empty());
  EXPECT_GE(dt, std::chrono::milliseconds(100)) << "the lock was really held";
  EXPECT_LT(dt, std::chrono::seconds(3));
  EXPECT_EQ(seg()->contexts[reg_child.slot.slot].state.load(), layout::kFree);
  EXPECT_FALSE(fs::exists(seg_path(reg_child.slot.segment)));
  ASSERT_EQ(reap(pid), 0);
}

}  // namespace
}  // namespace shmrdma
