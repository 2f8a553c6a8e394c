// XRC domains (ibv_open_xrcd / ibv_close_xrcd) and ibv_open_qp.
//
// A domain is named by the file behind the descriptor it is opened with:
// its (st_dev, st_ino) is the domain key recorded in every XRC SRQ and
// XRC_RECV QP entry, so any process that opens the same file is in the same
// domain; the initiator compares the keys of the SRQ and the XRC_RECV QP.
// fd -1 makes a private domain (kXrcdPrivateDev and a key unique to this
// context).
//
// Whether a domain is open anywhere ("exists", for O_CREAT / O_EXCL) is
// tracked with flock(2) on our own open file description of that file
// (/proc/self/fd/<fd>): every context holding the domain open holds a shared
// lock; a process that dies drops it. An exclusive try-lock that succeeds
// means nobody has the domain open. When the file cannot be reopened for
// reading the domain is not tracked: it then counts as open nowhere, so
// O_CREAT opens it and an open without O_CREAT fails with ENOENT unless this
// context already has it open.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <new>

#include "context.h"

namespace shmrdma {

int LocalContext::open_xrcd(int fd, uint32_t oflags, uint32_t* index) noexcept {
  if (oflags & ~uint32_t{O_CREAT | O_EXCL}) return EINVAL;
  uint64_t dev = layout::kXrcdPrivateDev, ino = 0;
  int lock_fd = -1;
  std::lock_guard lk(mu_);
  if (xrcds_.empty()) {
    try {
      xrcds_.resize(limits::kMaxSrq);
    } catch (const std::bad_alloc&) {
      return ENOMEM;
    }
  }
  uint32_t i = 0;
  while (i < xrcds_.size() && xrcds_[i].live) ++i;
  if (i == xrcds_.size()) return ENOMEM;
  if (fd == -1) {
    ino = (uint64_t{slot_ & 0xff} << 56) | (uint64_t{generation_ & 0xffffff} << 32) | (xrcd_private_next_++ & 0xffffffff);
  } else {
    struct stat st{};
    if (fd < 0 || ::fstat(fd, &st) != 0) return EBADF;
    dev = static_cast<uint64_t>(st.st_dev);
    ino = static_cast<uint64_t>(st.st_ino);
    bool here = false;  // this context has it open already
    for (const XrcdState& x : xrcds_) here |= x.live && x.dev == dev && x.ino == ino;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    lock_fd = ::open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    struct stat ls{};
    if (lock_fd >= 0 && (::fstat(lock_fd, &ls) != 0 || ls.st_dev != st.st_dev || ls.st_ino != st.st_ino)) {
      ::close(lock_fd);
      lock_fd = -1;
    }
    bool elsewhere = false;  // another context holds it open
    if (lock_fd >= 0 && !here) {
      if (::flock(lock_fd, LOCK_EX | LOCK_NB) == 0) {
        elsewhere = false;
      } else {
        elsewhere = errno == EWOULDBLOCK;
      }
    }
    const bool exists = here || elsewhere;
    if (exists && (oflags & O_EXCL)) {
      if (lock_fd >= 0) ::close(lock_fd);
      return EINVAL;  // the kernel's answer to O_EXCL on an existing XRCD
    }
    if (!exists && !(oflags & O_CREAT)) {
      if (lock_fd >= 0) ::close(lock_fd);
      return ENOENT;
    }
    // Hold a shared lock while the domain is open (downgrades our exclusive
    // try-lock; bounded: LOCK_NB, a failure only weakens the tracking).
    if (lock_fd >= 0) (void)::flock(lock_fd, LOCK_SH | LOCK_NB);
  }
  XrcdState& x = xrcds_[i];
  x = XrcdState{};
  x.live = true;
  x.dev = dev;
  x.ino = ino;
  x.lock_fd = lock_fd;
  *index = i;
  return 0;
}

int LocalContext::close_xrcd(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  if (index >= xrcds_.size() || !xrcds_[index].live) return EINVAL;
  if (xrcds_[index].refs) return EBUSY;
  if (xrcds_[index].lock_fd >= 0) ::close(xrcds_[index].lock_fd);  // drops our shared lock
  xrcds_[index] = XrcdState{};
  return 0;
}

int LocalContext::open_qp(uint32_t qpn, uint32_t xrcd, Qp** out) noexcept {
  std::lock_guard lk(mu_);
  if (xrcd >= xrcds_.size() || !xrcds_[xrcd].live) return EINVAL;
  const XrcdState& x = xrcds_[xrcd];
  if (layout::qpn_slot(qpn) != slot_) {
    // An XRC_RECV QP of another context: only its owner writes its entry.
    return EOPNOTSUPP;
  }
  uint32_t i = layout::qpn_index(qpn);
  if (i >= qps_.size() || !qps_[i]) return EINVAL;
  Qp* qp = qps_[i].get();
  if (qp->qpn != qpn || qp->qp_type != IBV_QPT_XRC_RECV || qp->shared->xrcd_dev != x.dev ||
      qp->shared->xrcd_ino != x.ino)
    return EINVAL;
  qp->handles += 1;
  xrcds_[xrcd].refs += 1;  // this handle uses the domain it was opened through
  *out = qp;
  return 0;
}

}  // namespace shmrdma
