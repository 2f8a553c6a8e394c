/* The protocol between the shim (tools/shim/cm.c, in application processes)
 * and shmrdmad's RDMA CM service (daemon/cm.cc). Plain C: the shim is C.
 *
 * A CM channel is a unix SOCK_SEQPACKET connection to
 * <home>/daemon/netns-<dev>-<ino>.cm (src/daemon_client.h). The shim writes
 * one request message per command, with the write end of a fresh reply
 * socket pair attached (SCM_RIGHTS); the daemon answers there, once. The
 * channel's receive side carries only event tokens: one byte is readable
 * exactly while the channel's event queue is non-empty (the daemon sends a
 * token when the queue becomes non-empty; the reply that empties it carries
 * SHMRDMA_CM_REPLY_DRAIN and the shim then reads that token). So
 * poll/epoll/select on the application's fd are the kernel's readiness.
 *
 * The daemon trusts nothing in a request: lengths are checked against the
 * message, ids against the channel that sent them.
 */
#ifndef SHMRDMA_CM_PROTO_H
#define SHMRDMA_CM_PROTO_H

#include <stdint.h>

#define SHMRDMA_CM_MAGIC 0x434d5331u /* "CMS1" */
#define SHMRDMA_CM_SOCK_SUFFIX ".cm"
#define SHMRDMA_CM_MAD_SUFFIX ".mad"
#define SHMRDMA_CM_MAX_IN 1024   /* command bytes after rdma_ucm_cmd_hdr */
#define SHMRDMA_CM_MAX_OPT 1024  /* SET_OPTION optval bytes */
#define SHMRDMA_CM_MAX_OUT 4096  /* response bytes */
#define SHMRDMA_CM_REPLY_TIMEOUT_MS 10000

enum shmrdma_cm_kind {
  SHMRDMA_CM_HELLO = 1,   /* first request of a channel: reply .key names it */
  SHMRDMA_CM_COMMAND = 2, /* a ucma command */
};

struct shmrdma_cm_request {
  uint32_t magic;
  uint32_t kind;
  uint32_t cmd;      /* rdma_ucm_cmd_hdr as the application wrote it */
  uint16_t in;       /* command bytes that follow (at most SHMRDMA_CM_MAX_IN) */
  uint16_t out;      /* room at the command's response pointer */
  uint64_t peer_key; /* MIGRATE_ID: the key of the channel named by its fd */
  uint32_t optlen;   /* SET_OPTION: optval bytes after the command bytes */
  uint32_t reserved;
};

enum {
  SHMRDMA_CM_REPLY_DRAIN = 1,      /* read one token from this channel */
  SHMRDMA_CM_REPLY_DRAIN_PEER = 2, /* MIGRATE_ID: read one token from the old channel */
  SHMRDMA_CM_REPLY_EMPTY = 4,      /* GET_EVENT found no event (another thread took it): wait again */
};

struct shmrdma_cm_reply {
  uint32_t magic;
  int32_t err;   /* 0 or a positive errno */
  uint32_t flags;
  uint32_t len;  /* response bytes that follow (at most the request's `out`) */
  uint64_t key;  /* HELLO: the channel's key */
};

#endif
