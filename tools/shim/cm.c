/* RDMA CM for librdmacm under `shmrdma run` (issue 11): the shim side.
 *
 * librdmacm opens "/dev/infiniband/rdma_cm", checks with fstat that it is a
 * character device, and then issues every command as a plain write() of a
 * struct that starts with rdma_ucm_cmd_hdr and names, by pointer, where the
 * response goes (FACTS-ROCE-CM.md). Here:
 *  - open/open64/openat/openat64 (and the _FORTIFY_SOURCE __open*_2 forms) of
 *    exactly that path return a unix SOCK_SEQPACKET socket connected to the
 *    CM endpoint of the shmrdmad of this state home ($SHMRDMA_HOME) and
 *    network namespace, with the open's O_CLOEXEC / O_NONBLOCK. No daemon:
 *    ENOENT, what librdmacm reports without a kernel.
 *  - fstat & co. report such an fd as a character device.
 *  - write() on such an fd is a command (src/cm/cm_proto.h): validated as
 *    the kernel's ucma_write validates it, passed to the daemon with a reply
 *    socket, the response copied to the command's pointer (process_vm_writev
 *    on ourselves, so a bad pointer is EFAULT, not a crash).
 *  - Which fds are channels: g_keys[fd] (the daemon's key for the channel,
 *    0 for any other fd), set on open, propagated by dup/dup2/dup3/
 *    fcntl(F_DUPFD*), cleared by close. write() on any other fd costs one
 *    array load. fork() copies the table; librdmacm opens with O_CLOEXEC.
 *  - socket(AF_NETLINK, *, NETLINK_RDMA) fails with EPROTONOSUPPORT, what a
 *    kernel without RDMA answers: librdmacm's ABI probe then reads sysfs
 *    (our tree: no abi_version file, so ABI 4) and never makes a kernel
 *    that has the modules load them; libibverbs then reads the devices from
 *    sysfs ($SYSFS_PATH, our tree), as it must to see shmrdma devices at all.
 */
/* We define both open and open64 (fstat and fstat64, ...): no redirection. */
#undef _FILE_OFFSET_BITS
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netlink.h>
#include <poll.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <rdma/rdma_user_cm.h>

#include "cm_proto.h"

#define EXPORT __attribute__((visibility("default")))
#define CM_PATH "/dev/infiniband/rdma_cm"
#define MAX_FD 65536

static uint64_t g_keys[MAX_FD]; /* atomic access only */

static inline uint64_t key_of(int fd) {
  return (unsigned)fd < MAX_FD ? __atomic_load_n(&g_keys[fd], __ATOMIC_ACQUIRE) : 0;
}
static inline void set_key(int fd, uint64_t key) {
  if ((unsigned)fd < MAX_FD) __atomic_store_n(&g_keys[fd], key, __ATOMIC_RELEASE);
}

#define REAL(ret, name, ...)                                               \
  static ret (*real_##name)(__VA_ARGS__);                                  \
  static ret (*get_##name(void))(__VA_ARGS__) {                            \
    ret (*f)(__VA_ARGS__) = __atomic_load_n(&real_##name, __ATOMIC_ACQUIRE); \
    if (!f) {                                                              \
      f = (ret(*)(__VA_ARGS__))dlsym(RTLD_NEXT, #name);                    \
      __atomic_store_n(&real_##name, f, __ATOMIC_RELEASE);                 \
    }                                                                      \
    return f;                                                              \
  }

REAL(ssize_t, write, int, const void *, size_t)
REAL(int, open, const char *, int, ...)
REAL(int, open64, const char *, int, ...)
REAL(int, openat, int, const char *, int, ...)
REAL(int, openat64, int, const char *, int, ...)
REAL(int, __open_2, const char *, int)
REAL(int, __open64_2, const char *, int)
REAL(int, __openat_2, int, const char *, int)
REAL(int, __openat64_2, int, const char *, int)
REAL(int, close, int)
REAL(int, dup, int)
REAL(int, dup2, int, int)
REAL(int, dup3, int, int, int)
REAL(int, fcntl, int, int, ...)
REAL(int, fcntl64, int, int, ...)
REAL(int, fstat, int, struct stat *)
REAL(int, fstat64, int, struct stat64 *)
REAL(int, __fxstat, int, int, struct stat *)
REAL(int, __fxstat64, int, int, struct stat64 *)
REAL(int, fstatat, int, const char *, struct stat *, int)
REAL(int, fstatat64, int, const char *, struct stat64 *, int)
REAL(int, __fxstatat, int, int, const char *, struct stat *, int)
REAL(int, __fxstatat64, int, int, const char *, struct stat64 *, int)
REAL(int, statx, int, const char *, int, unsigned int, struct statx *)
REAL(int, socket, int, int, int)

__attribute__((constructor)) static void cm_shim_init(void) {
  (void)get_write();
  (void)get_close();
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Copies between our memory and memory the application named, without
 * faulting on a bad pointer (EFAULT, as the kernel's copy_*_user). */
static int copy_in(void *dst, uint64_t src, size_t n) {
  if (!n) return 0;
  struct iovec l = {dst, n}, r = {(void *)(uintptr_t)src, n};
  ssize_t got = process_vm_readv(getpid(), &l, 1, &r, 1, 0);
  if (got == (ssize_t)n) return 0;
  if (got < 0 && (errno == ENOSYS || errno == EPERM)) { /* seccomp: trust the pointer */
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return 0;
  }
  return EFAULT;
}
static int copy_out(uint64_t dst, const void *src, size_t n) {
  if (!n) return 0;
  struct iovec l = {(void *)src, n}, r = {(void *)(uintptr_t)dst, n};
  ssize_t put = process_vm_writev(getpid(), &l, 1, &r, 1, 0);
  if (put == (ssize_t)n) return 0;
  if (put < 0 && (errno == ENOSYS || errno == EPERM)) {
    memcpy((void *)(uintptr_t)dst, src, n);
    return 0;
  }
  return EFAULT;
}

/* Sends one request (with the reply socket) and waits for the reply. */
static int round_trip(int chan, const void *req, size_t req_len, struct shmrdma_cm_reply *rep, void *resp,
                      size_t resp_cap) {
  int sp[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) != 0) return errno;
  char cbuf[CMSG_SPACE(sizeof(int))];
  memset(cbuf, 0, sizeof cbuf);
  struct iovec iov = {(void *)req, req_len};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cbuf;
  mh.msg_controllen = sizeof cbuf;
  struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &sp[1], sizeof(int));
  const int64_t deadline = now_ms() + SHMRDMA_CM_REPLY_TIMEOUT_MS;
  int rc = 0;
  for (;;) {
    if (sendmsg(chan, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) break;
    if (errno != EAGAIN && errno != EINTR) {
      rc = (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) ? EIO : errno;
      break;
    }
    int64_t left = deadline - now_ms();
    if (left <= 0) {
      rc = ETIMEDOUT;
      break;
    }
    struct pollfd p = {chan, POLLOUT, 0};
    (void)poll(&p, 1, (int)left);
  }
  get_close()(sp[1]);
  if (rc) {
    get_close()(sp[0]);
    return rc;
  }
  char buf[sizeof(struct shmrdma_cm_reply) + SHMRDMA_CM_MAX_OUT];
  for (;;) {
    int64_t left = deadline - now_ms();
    if (left <= 0) {
      rc = ETIMEDOUT;
      break;
    }
    struct pollfd p = {sp[0], POLLIN, 0};
    int n = poll(&p, 1, (int)left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    ssize_t got = recv(sp[0], buf, sizeof buf, MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (got < (ssize_t)sizeof *rep) {
      rc = EIO; /* the daemon went away (0) or answered garbage */
      break;
    }
    memcpy(rep, buf, sizeof *rep);
    if (rep->magic != SHMRDMA_CM_MAGIC || rep->len > resp_cap || (size_t)got != sizeof *rep + rep->len) {
      rc = EIO;
      break;
    }
    if (rep->len) memcpy(resp, buf + sizeof *rep, rep->len);
    break;
  }
  get_close()(sp[0]);
  return rc;
}

static void drain_token(int fd) {
  char b;
  (void)recv(fd, &b, 1, MSG_DONTWAIT);
}

/* The CM endpoint of this home and network namespace (daemon_client.h). */
static int cm_endpoint(struct sockaddr_un *a) {
  const char *home = getenv("SHMRDMA_HOME");
  struct stat st;
  if (!home || !*home || get_fstatat()(AT_FDCWD, "/proc/self/ns/net", &st, 0) != 0) return ENOENT;
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  int n = snprintf(a->sun_path, sizeof a->sun_path, "%s/daemon/netns-%llu-%llu" SHMRDMA_CM_SOCK_SUFFIX, home,
                   (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
  return (n < 0 || (size_t)n >= sizeof a->sun_path) ? ENAMETOOLONG : 0;
}

static int open_channel(int flags) {
  struct sockaddr_un a;
  int rc = cm_endpoint(&a);
  if (rc) {
    errno = rc == ENAMETOOLONG ? ENAMETOOLONG : ENOENT;
    return -1;
  }
  int fd = get_socket()(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if ((unsigned)fd >= MAX_FD) {
    get_close()(fd);
    errno = EMFILE;
    return -1;
  }
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    get_close()(fd);
    errno = ENOENT; /* no daemon: as without a kernel */
    return -1;
  }
  struct shmrdma_cm_request req;
  memset(&req, 0, sizeof req);
  req.magic = SHMRDMA_CM_MAGIC;
  req.kind = SHMRDMA_CM_HELLO;
  struct shmrdma_cm_reply rep;
  rc = round_trip(fd, &req, sizeof req, &rep, NULL, 0);
  if (rc == 0 && (rep.err || !rep.key)) rc = rep.err ? rep.err : EIO;
  if (rc) {
    get_close()(fd);
    errno = ENOENT;
    return -1;
  }
  if (!(flags & O_CLOEXEC)) get_fcntl()(fd, F_SETFD, 0);
  if (flags & O_NONBLOCK) get_fcntl()(fd, F_SETFL, O_NONBLOCK);
  set_key(fd, rep.key);
  return fd;
}

static int is_cm_path(int dirfd, const char *path) {
  (void)dirfd;
  return path && strcmp(path, CM_PATH) == 0;
}

/* ------------------------------------------------------------ commands */

/* Where a command's response pointer is, or -1 (no response). */
static int response_offset(uint32_t cmd) {
  switch (cmd) {
    case RDMA_USER_CM_CMD_CREATE_ID:
      return offsetof(struct rdma_ucm_create_id, response);
    case RDMA_USER_CM_CMD_DESTROY_ID:
    case RDMA_USER_CM_CMD_QUERY_ROUTE:
    case RDMA_USER_CM_CMD_INIT_QP_ATTR:
    case RDMA_USER_CM_CMD_GET_EVENT:
    case RDMA_USER_CM_CMD_JOIN_IP_MCAST:
    case RDMA_USER_CM_CMD_LEAVE_MCAST:
    case RDMA_USER_CM_CMD_MIGRATE_ID:
    case RDMA_USER_CM_CMD_QUERY:
    case RDMA_USER_CM_CMD_JOIN_MCAST:
      return 0;
    default:
      return -1;
  }
}

/* How many bytes of the command the kernel's handler reads (its struct:
 * ucma copies sizeof(cmd) whatever hdr.in says, EFAULT when that memory is
 * not readable). CONNECT and ACCEPT take the ECE fields only when `in` has
 * them and need `in` up to `reserved` (EINVAL). 0: no handler (ENOSYS). */
static size_t cmd_len(uint32_t cmd, uint16_t in, int *err) {
  *err = 0;
  switch (cmd) {
    case RDMA_USER_CM_CMD_CREATE_ID: return sizeof(struct rdma_ucm_create_id);
    case RDMA_USER_CM_CMD_DESTROY_ID: return sizeof(struct rdma_ucm_destroy_id);
    case RDMA_USER_CM_CMD_BIND_IP: return sizeof(struct rdma_ucm_bind_ip);
    case RDMA_USER_CM_CMD_RESOLVE_IP: return sizeof(struct rdma_ucm_resolve_ip);
    case RDMA_USER_CM_CMD_RESOLVE_ROUTE: return sizeof(struct rdma_ucm_resolve_route);
    case RDMA_USER_CM_CMD_QUERY_ROUTE: return sizeof(struct rdma_ucm_query);
    case RDMA_USER_CM_CMD_CONNECT:
    case RDMA_USER_CM_CMD_ACCEPT: {
      const size_t full =
          cmd == RDMA_USER_CM_CMD_CONNECT ? sizeof(struct rdma_ucm_connect) : sizeof(struct rdma_ucm_accept);
      const size_t least = cmd == RDMA_USER_CM_CMD_CONNECT ? offsetof(struct rdma_ucm_connect, ece)
                                                           : offsetof(struct rdma_ucm_accept, ece);
      if (in < least) {
        *err = EINVAL;
        return 0;
      }
      return in < full ? in : full;
    }
    case RDMA_USER_CM_CMD_LISTEN: return sizeof(struct rdma_ucm_listen);
    case RDMA_USER_CM_CMD_REJECT: return sizeof(struct rdma_ucm_reject);
    case RDMA_USER_CM_CMD_DISCONNECT: return sizeof(struct rdma_ucm_disconnect);
    case RDMA_USER_CM_CMD_INIT_QP_ATTR: return sizeof(struct rdma_ucm_init_qp_attr);
    case RDMA_USER_CM_CMD_GET_EVENT: return sizeof(struct rdma_ucm_get_event);
    case RDMA_USER_CM_CMD_SET_OPTION: return sizeof(struct rdma_ucm_set_option);
    case RDMA_USER_CM_CMD_NOTIFY: return sizeof(struct rdma_ucm_notify);
    case RDMA_USER_CM_CMD_JOIN_IP_MCAST: return sizeof(struct rdma_ucm_join_ip_mcast);
    case RDMA_USER_CM_CMD_LEAVE_MCAST: return sizeof(struct rdma_ucm_destroy_id);
    case RDMA_USER_CM_CMD_MIGRATE_ID: return sizeof(struct rdma_ucm_migrate_id);
    case RDMA_USER_CM_CMD_QUERY: return sizeof(struct rdma_ucm_query);
    case RDMA_USER_CM_CMD_BIND: return sizeof(struct rdma_ucm_bind);
    case RDMA_USER_CM_CMD_RESOLVE_ADDR: return sizeof(struct rdma_ucm_resolve_addr);
    case RDMA_USER_CM_CMD_JOIN_MCAST: return sizeof(struct rdma_ucm_join_mcast);
    default:
      *err = ENOSYS; /* GET_OPTION */
      return 0;
  }
}
_Static_assert(sizeof(struct rdma_ucm_resolve_addr) <= SHMRDMA_CM_MAX_IN, "the longest command fits a request");

struct cm_req_buf {
  struct shmrdma_cm_request h;
  unsigned char body[SHMRDMA_CM_MAX_IN + SHMRDMA_CM_MAX_OPT];
};

static ssize_t cm_write(int fd, const void *buf, size_t len) {
  struct rdma_ucm_cmd_hdr hdr;
  if (len < sizeof hdr) {
    errno = EINVAL;
    return -1;
  }
  if (copy_in(&hdr, (uintptr_t)buf, sizeof hdr)) {
    errno = EFAULT;
    return -1;
  }
  if (hdr.cmd > RDMA_USER_CM_CMD_JOIN_MCAST || hdr.in + sizeof hdr > len) {
    errno = EINVAL;
    return -1;
  }
  int lerr;
  const size_t n = cmd_len(hdr.cmd, hdr.in, &lerr);
  if (lerr) {
    errno = lerr;
    return -1;
  }
  struct cm_req_buf r;
  memset(&r.h, 0, sizeof r.h);
  r.h.magic = SHMRDMA_CM_MAGIC;
  r.h.kind = SHMRDMA_CM_COMMAND;
  r.h.cmd = hdr.cmd;
  r.h.out = hdr.out;
  r.h.in = (uint16_t)n; /* what the kernel's handler copies (cmd_len) */
  if (copy_in(r.body, (uintptr_t)buf + sizeof hdr, r.h.in)) {
    errno = EFAULT;
    return -1;
  }
  uint64_t resp_ptr = 0;
  int off = response_offset(hdr.cmd);
  if (off >= 0 && (size_t)off + 8 <= r.h.in) memcpy(&resp_ptr, r.body + off, 8);
  int peer_fd = -1;
  if (hdr.cmd == RDMA_USER_CM_CMD_SET_OPTION && r.h.in >= sizeof(struct rdma_ucm_set_option)) {
    struct rdma_ucm_set_option so;
    memcpy(&so, r.body, sizeof so);
    if (so.optlen > SHMRDMA_CM_MAX_OPT) {
      errno = EINVAL;
      return -1;
    }
    if (copy_in(r.body + r.h.in, so.optval, so.optlen)) {
      errno = EFAULT;
      return -1;
    }
    r.h.optlen = so.optlen;
  }
  if (hdr.cmd == RDMA_USER_CM_CMD_MIGRATE_ID && r.h.in >= sizeof(struct rdma_ucm_migrate_id)) {
    struct rdma_ucm_migrate_id m;
    memcpy(&m, r.body, sizeof m);
    peer_fd = (int)m.fd;
    r.h.peer_key = key_of(peer_fd);
    if (!r.h.peer_key) {
      errno = get_fcntl()(peer_fd, F_GETFD) < 0 ? EBADF : EINVAL;
      return -1;
    }
  }
  const size_t req_len = sizeof r.h + r.h.in + r.h.optlen;
  unsigned char resp[SHMRDMA_CM_MAX_OUT];
  struct shmrdma_cm_reply rep;
  for (;;) {
    if (hdr.cmd == RDMA_USER_CM_CMD_GET_EVENT) {
      /* Wait until the channel has a token: an event is queued. */
      const int fl = get_fcntl()(fd, F_GETFL);
      if (fl < 0) {
        /* Another thread closed the channel since this call began (rping's
         * main thread destroys it while its CM thread comes back for the next
         * event). A kernel reader that had entered its read() holds the file
         * and waits for an event that will never come: do the same, rather
         * than fail the call (which such programs take as fatal). */
        for (;;)
          if (poll(NULL, 0, -1) < 0) return -1; /* EINTR */
      }
      const int nonblock = (fl & O_NONBLOCK) != 0;
      struct pollfd p = {fd, POLLIN, 0};
      int n = poll(&p, 1, nonblock ? 0 : -1);
      if (n < 0) return -1; /* EINTR */
      if (n == 0) {
        errno = EAGAIN;
        return -1;
      }
      if ((p.revents & (POLLHUP | POLLERR | POLLNVAL)) || !(p.revents & POLLIN)) {
        /* The daemon went away (its end closed: POLLHUP, with POLLIN for the EOF), or another thread closed the channel
         * (POLLNVAL): no event will ever come on this channel.
         * Block as the contract says (connections already set up go on:
         * their QPs do not need the daemon), or EAGAIN under O_NONBLOCK. */
        if (nonblock) {
          errno = EAGAIN;
          return -1;
        }
        for (;;)
          if (poll(NULL, 0, -1) < 0) return -1; /* EINTR */
      }
    }
    int rc = round_trip(fd, &r, req_len, &rep, resp, hdr.out < sizeof resp ? hdr.out : sizeof resp);
    if (rc) {
      errno = rc;
      return -1;
    }
    if (rep.flags & SHMRDMA_CM_REPLY_DRAIN) drain_token(fd);
    if (rep.flags & SHMRDMA_CM_REPLY_DRAIN_PEER) drain_token(peer_fd);
    if (rep.flags & SHMRDMA_CM_REPLY_EMPTY) continue;
    break;
  }
  if (rep.err) {
    errno = rep.err;
    return -1;
  }
  if (rep.len && copy_out(resp_ptr, resp, rep.len)) {
    errno = EFAULT;
    return -1;
  }
  return (ssize_t)len;
}

/* ------------------------------------------------------------ interposers */

EXPORT ssize_t write(int fd, const void *buf, size_t n) {
  if (__builtin_expect(key_of(fd) != 0, 0)) return cm_write(fd, buf, n);
  return get_write()(fd, buf, n);
}

static mode_t open_mode(int flags, va_list ap) {
  return (flags & O_CREAT) || (flags & __O_TMPFILE) == __O_TMPFILE ? (mode_t)va_arg(ap, int) : 0;
}

EXPORT int open(const char *path, int flags, ...) {
  if (is_cm_path(AT_FDCWD, path)) return open_channel(flags);
  va_list ap;
  va_start(ap, flags);
  mode_t m = open_mode(flags, ap);
  va_end(ap);
  return get_open()(path, flags, m);
}
EXPORT int open64(const char *path, int flags, ...) {
  if (is_cm_path(AT_FDCWD, path)) return open_channel(flags);
  va_list ap;
  va_start(ap, flags);
  mode_t m = open_mode(flags, ap);
  va_end(ap);
  return get_open64()(path, flags, m);
}
EXPORT int openat(int dirfd, const char *path, int flags, ...) {
  if (is_cm_path(dirfd, path)) return open_channel(flags);
  va_list ap;
  va_start(ap, flags);
  mode_t m = open_mode(flags, ap);
  va_end(ap);
  return get_openat()(dirfd, path, flags, m);
}
EXPORT int openat64(int dirfd, const char *path, int flags, ...) {
  if (is_cm_path(dirfd, path)) return open_channel(flags);
  va_list ap;
  va_start(ap, flags);
  mode_t m = open_mode(flags, ap);
  va_end(ap);
  return get_openat64()(dirfd, path, flags, m);
}
EXPORT int __open_2(const char *path, int flags) {
  return is_cm_path(AT_FDCWD, path) ? open_channel(flags) : get___open_2()(path, flags);
}
EXPORT int __open64_2(const char *path, int flags) {
  return is_cm_path(AT_FDCWD, path) ? open_channel(flags) : get___open64_2()(path, flags);
}
EXPORT int __openat_2(int dirfd, const char *path, int flags) {
  return is_cm_path(dirfd, path) ? open_channel(flags) : get___openat_2()(dirfd, path, flags);
}
EXPORT int __openat64_2(int dirfd, const char *path, int flags) {
  return is_cm_path(dirfd, path) ? open_channel(flags) : get___openat64_2()(dirfd, path, flags);
}

EXPORT int close(int fd) {
  set_key(fd, 0);
  return get_close()(fd);
}
EXPORT int dup(int fd) {
  int r = get_dup()(fd);
  if (r >= 0) set_key(r, key_of(fd));
  return r;
}
EXPORT int dup2(int fd, int to) {
  const uint64_t k = key_of(fd);
  int r = get_dup2()(fd, to);
  if (r >= 0 && r != fd) set_key(r, k);
  return r;
}
EXPORT int dup3(int fd, int to, int flags) {
  const uint64_t k = key_of(fd);
  int r = get_dup3()(fd, to, flags);
  if (r >= 0) set_key(r, k);
  return r;
}
static int fcntl_common(int (*f)(int, int, ...), int fd, int cmd, va_list ap) {
  switch (cmd) {
    case F_DUPFD:
    case F_DUPFD_CLOEXEC: {
      int arg = va_arg(ap, int);
      int r = f(fd, cmd, arg);
      if (r >= 0) set_key(r, key_of(fd));
      return r;
    }
    case F_GETFD:
    case F_GETFL:
    case F_GETOWN:
    case F_GETSIG:
    case F_GETLEASE:
    case F_GETPIPE_SZ:
    case F_GET_SEALS:
      return f(fd, cmd);
    default: {
      void *arg = va_arg(ap, void *); /* int or pointer: passed on as the ABI passes both */
      return f(fd, cmd, arg);
    }
  }
}
EXPORT int fcntl(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  int r = fcntl_common(get_fcntl(), fd, cmd, ap);
  va_end(ap);
  return r;
}
EXPORT int fcntl64(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  int r = fcntl_common(get_fcntl64() ? get_fcntl64() : get_fcntl(), fd, cmd, ap);
  va_end(ap);
  return r;
}

#define AS_CHARDEV(st) ((st)->st_mode = ((st)->st_mode & ~S_IFMT) | S_IFCHR, (st)->st_rdev = 0)
EXPORT int fstat(int fd, struct stat *st) {
  int r = get_fstat()(fd, st);
  if (r == 0 && key_of(fd)) AS_CHARDEV(st);
  return r;
}
EXPORT int fstat64(int fd, struct stat64 *st) {
  int r = get_fstat64()(fd, st);
  if (r == 0 && key_of(fd)) AS_CHARDEV(st);
  return r;
}
EXPORT int __fxstat(int ver, int fd, struct stat *st) {
  int r = get___fxstat()(ver, fd, st);
  if (r == 0 && key_of(fd)) AS_CHARDEV(st);
  return r;
}
EXPORT int __fxstat64(int ver, int fd, struct stat64 *st) {
  int r = get___fxstat64()(ver, fd, st);
  if (r == 0 && key_of(fd)) AS_CHARDEV(st);
  return r;
}
static int empty_path_on_channel(int dirfd, const char *path, int flags) {
  return (flags & AT_EMPTY_PATH) && path && !*path && key_of(dirfd);
}
EXPORT int fstatat(int dirfd, const char *path, struct stat *st, int flags) {
  int r = get_fstatat()(dirfd, path, st, flags);
  if (r == 0 && empty_path_on_channel(dirfd, path, flags)) AS_CHARDEV(st);
  return r;
}
EXPORT int fstatat64(int dirfd, const char *path, struct stat64 *st, int flags) {
  int r = get_fstatat64()(dirfd, path, st, flags);
  if (r == 0 && empty_path_on_channel(dirfd, path, flags)) AS_CHARDEV(st);
  return r;
}
EXPORT int __fxstatat(int ver, int dirfd, const char *path, struct stat *st, int flags) {
  int r = get___fxstatat()(ver, dirfd, path, st, flags);
  if (r == 0 && empty_path_on_channel(dirfd, path, flags)) AS_CHARDEV(st);
  return r;
}
EXPORT int __fxstatat64(int ver, int dirfd, const char *path, struct stat64 *st, int flags) {
  int r = get___fxstatat64()(ver, dirfd, path, st, flags);
  if (r == 0 && empty_path_on_channel(dirfd, path, flags)) AS_CHARDEV(st);
  return r;
}
EXPORT int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *st) {
  int r = get_statx()(dirfd, path, flags, mask, st);
  if (r == 0 && empty_path_on_channel(dirfd, path, flags)) {
    st->stx_mode = (uint16_t)((st->stx_mode & ~S_IFMT) | S_IFCHR);
    st->stx_rdev_major = st->stx_rdev_minor = 0;
  }
  return r;
}

EXPORT int socket(int domain, int type, int protocol) {
  if (domain == AF_NETLINK && protocol == NETLINK_RDMA) {
    errno = EPROTONOSUPPORT;
    return -1;
  }
  return get_socket()(domain, type, protocol);
}
