/* The private interface between libshmrdma-shim.so (tools/shim) and the
 * plugin. In libibverbs 44 ibv_create_comp_channel, ibv_destroy_comp_channel
 * and ibv_get_cq_event are kernel commands, not provider ops; the shim
 * (LD_PRELOADed by `shmrdma run`) interposes them and, for contexts of this
 * plugin, calls these functions. It finds them in the already loaded plugin
 * (dlopen RTLD_NOLOAD) through the one exported symbol below.
 *
 * Plain C: the shim is a C library with no dependency but libc. */
#ifndef SHMRDMA_SHIM_ABI_H
#define SHMRDMA_SHIM_ABI_H

#include <infiniband/verbs.h>
#include <stdint.h>

#define SHMRDMA_SHIM_ABI 1
#define SHMRDMA_SHIM_OPS_SYMBOL "shmrdma_shim_ops"
#define SHMRDMA_PLUGIN_FILE "libshmrdma-rdmav34.so"

#ifdef __cplusplus
extern "C" {
#endif

struct shmrdma_shim_ops {
  uint32_t abi;  /* SHMRDMA_SHIM_ABI */
  uint32_t size; /* sizeof(struct shmrdma_shim_ops) */
  /* 1 when ctx was opened by this plugin. */
  int (*owns_context)(struct ibv_context *ctx);
  /* Makes a completion channel's FIFO: 0 and its read end in *fd, or an errno. */
  int (*create_channel)(struct ibv_context *ctx, int *fd);
  /* Forgets the channel whose read end is fd (the caller closes fd): 0 or an errno. */
  int (*destroy_channel)(struct ibv_context *ctx, int fd);
  /* ibv_get_cq_event for a channel of ours: 0, or an errno for errno. */
  int (*get_cq_event)(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);
};

/* The exported entry point: the ops for `abi`, or NULL when not supported. */
typedef const struct shmrdma_shim_ops *(*shmrdma_shim_ops_fn)(uint32_t abi);

#ifdef __cplusplus
}
#endif

#endif /* SHMRDMA_SHIM_ABI_H */
