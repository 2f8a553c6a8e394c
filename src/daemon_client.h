// The per-(state home, network namespace) daemon `shmrdmad` (daemon/): where
// its files are and how to talk to it. No libnl here: this is the client
// side, used by the command (and, later, by RDMA CM in application
// processes).
//
// Files, all in <home>/daemon/ (mode 0700), named after the network
// namespace the daemon serves (st_dev/st_ino of its /proc/self/ns/net):
//   netns-<dev>-<ino>.lock  held (flock) by the running daemon: one per namespace
//   netns-<dev>-<ino>.pid   "<pid> <start time>" of the running daemon
//   netns-<dev>-<ino>.sock  its control socket (unix stream, same uid only)
//   netns-<dev>-<ino>.log   its log
// Protocol: one request line, one reply line ("ok ..." or "error ...").
// Requests: "ping" (reply "ok pid=<pid> devices=<n>"), "refresh" (re-read
// every interface now; reply after the records and events are out), "stop".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shmrdma {

struct DaemonPaths {
  std::string dir, lock, pid, sock, log;
  uint64_t netns_dev = 0, netns_ino = 0;
};

DaemonPaths daemon_paths(const std::string& home, uint64_t netns_dev, uint64_t netns_ino);

// This process's network namespace (st_dev/st_ino of /proc/self/ns/net). 0 or errno.
int current_netns(uint64_t* dev, uint64_t* ino) noexcept;

// Sends one request and reads the reply line (without the newline), within
// timeout_ms. 0, or an errno (ENOENT / ECONNREFUSED: no daemon; ETIMEDOUT).
int daemon_request(const DaemonPaths& d, const std::string& request, std::string* reply, int timeout_ms) noexcept;

// The pid of the daemon named by d.pid when that process is alive, else 0.
int daemon_pid(const DaemonPaths& d) noexcept;

// Every daemon that has files in <home>/daemon/ (alive or not).
std::vector<DaemonPaths> list_daemons(const std::string& home);

}  // namespace shmrdma
