// SPDX-License-Identifier: MIT
//
// Unit tests for src/proc.h: a process is its pid plus its start time; a
// zombie or a reaped process is dead, and so is a live pid whose start time
// differs (a reused pid).

#include "proc.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

namespace shmrdma {
namespace {

// Field 3 of /proc/<pid>/stat, or 0 when the process does not exist.
char proc_state(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto p = s.rfind(')');
  if (p == std::string::npos || p + 2 >= s.size()) return 0;
  return s[p + 2];
}

// A child that blocks until the returned write end is closed or written.
struct Child {
  pid_t pid = -1;
  int wake_fd = -1;
};

Child spawn_waiting_child() {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[1]);
    char c;
    while (::read(fds[0], &c, 1) < 0 && errno == EINTR) {
    }
    ::_exit(0);
  }
  ::close(fds[0]);
  return {pid, fds[1]};
}

TEST(Proc, StartTimeOfSelfIsKnown) {
  uint64_t st = process_start_time(::getpid());
  EXPECT_NE(st, 0u);
  EXPECT_EQ(process_start_time(::getpid()), st);  // stable
  // Our parent started no later than we did.
  uint64_t parent = process_start_time(::getppid());
  if (parent) {
    EXPECT_LE(parent, st);
  }
}

TEST(Proc, StartTimeOfInvalidPidsIsZero) {
  EXPECT_EQ(process_start_time(0), 0u);
  EXPECT_EQ(process_start_time(-1), 0u);
  EXPECT_EQ(process_start_time(0x7ffffffe), 0u);  // above pid_max
}

TEST(Proc, SelfIsAlive) {
  uint64_t st = process_start_time(::getpid());
  EXPECT_TRUE(process_alive(::getpid(), st));
  ProcessId me = self_process();
  EXPECT_EQ(me.pid, ::getpid());
  EXPECT_EQ(me.start_time, st);
  EXPECT_TRUE(process_alive(me.pid, me.start_time));
}

TEST(Proc, WrongStartTimeCountsAsDead) {
  uint64_t st = process_start_time(::getpid());
  EXPECT_FALSE(process_alive(::getpid(), st + 1));
  EXPECT_FALSE(process_alive(::getpid(), st - 1));
  EXPECT_FALSE(process_alive(::getpid(), 0));
}

TEST(Proc, InvalidPidsAreDead) {
  EXPECT_FALSE(process_alive(0, 0));
  EXPECT_FALSE(process_alive(-1, 0));
  EXPECT_FALSE(process_alive(0x7ffffffe, 1));
}

TEST(Proc, ProcessNameWithParenthesesAndSpaces) {
  // comm may contain ") " which must not confuse the parser. PR_SET_NAME
  // renames the calling thread; gtest runs tests on the main thread, whose
  // comm is what /proc/<pid>/stat shows.
  char old[17] = {};
  ASSERT_EQ(::prctl(PR_GET_NAME, old), 0);
  ASSERT_EQ(::prctl(PR_SET_NAME, "a) b ) Z 1 2"), 0);
  uint64_t st = process_start_time(::getpid());
  bool alive = process_alive(::getpid(), st);
  ::prctl(PR_SET_NAME, old);
  EXPECT_EQ(st, self_process().start_time);
  EXPECT_TRUE(alive);
}

TEST(Proc, ChildLifecycle) {
  Child c = spawn_waiting_child();
  ASSERT_GT(c.pid, 0);
  uint64_t st = process_start_time(c.pid);
  ASSERT_NE(st, 0u);
  EXPECT_GE(st, process_start_time(::getpid()));
  EXPECT_TRUE(process_alive(c.pid, st));
  EXPECT_FALSE(process_alive(c.pid, st + 1));

  // Let it exit, but do not reap it yet: wait for the zombie.
  ::close(c.wake_fd);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOWAIT), 0);
  EXPECT_EQ(proc_state(c.pid), 'Z') << "the child should be a zombie now";
  EXPECT_FALSE(process_alive(c.pid, st)) << "a zombie never touches shared memory again";

  // Reaped: gone altogether.
  ASSERT_EQ(::waitpid(c.pid, nullptr, 0), c.pid);
  EXPECT_FALSE(process_alive(c.pid, st));
  EXPECT_EQ(process_start_time(c.pid), 0u);
}

TEST(Proc, SelfProcessIsRefreshedAfterFork) {
  ProcessId parent = self_process();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ProcessId me = self_process();
    uint64_t ok = me.pid == ::getpid() && me.pid != parent.pid && me.start_time == process_start_time(::getpid()) &&
                  process_alive(me.pid, me.start_time);
    ssize_t n = ::write(fds[1], &ok, sizeof ok);
    ::_exit(n == sizeof ok ? 0 : 1);
  }
  ASSERT_GT(pid, 0);
  ::close(fds[1]);
  uint64_t ok = 0;
  EXPECT_EQ(::read(fds[0], &ok, sizeof ok), static_cast<ssize_t>(sizeof ok));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(ok, 1u);
  EXPECT_EQ(self_process().pid, parent.pid);
}

}  // namespace
}  // namespace shmrdma
