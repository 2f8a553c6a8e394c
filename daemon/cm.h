// shmrdmad's RDMA CM service (issue 11): the authority behind the ucma
// commands the shim forwards from librdmacm (src/cm/cm_proto.h), and the
// connection manager that talks IB CM (src/cm/wire.h) with the CM services of
// the other daemons of the home (and with itself, for peers in the same
// network namespace) over path-named unix datagram sockets.
//
// One CmService per daemon, driven by the daemon's poll loop: add_fds()
// appends its descriptors, handle() consumes their revents, timeout_ms()
// says when its next timer (a retransmission) is due. Single-threaded.
#pragma once

#include <poll.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "daemon_client.h"

namespace shmrdma {

class CmService {
 public:
  using Logger = std::function<void(const std::string&)>;
  CmService(std::string home, DaemonPaths paths, Logger log);
  ~CmService();
  CmService(const CmService&) = delete;
  CmService& operator=(const CmService&) = delete;

  // Binds <sock minus .sock>.cm (SOCK_SEQPACKET) and .mad (SOCK_DGRAM). 0 or errno.
  int setup(std::string* why);
  void add_fds(std::vector<pollfd>* fds);
  // `fds` points at what add_fds appended (n entries).
  void handle(const pollfd* fds, size_t n);
  // Milliseconds until the next timer, or -1.
  int timeout_ms() const;
  // Open channels (the daemon stays while there are any).
  size_t channels() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The CM socket paths of the daemon named by `d` (its .sock with another suffix).
std::string cm_channel_path(const DaemonPaths& d);
std::string cm_mad_path(const DaemonPaths& d);

}  // namespace shmrdma
