/* libshmrdma-shim.so: completion channels for shmrdma under libibverbs 44.
 *
 * libibverbs 44 implements ibv_create_comp_channel, ibv_destroy_comp_channel
 * and ibv_get_cq_event itself, with kernel commands and a read of a kernel
 * event descriptor (a struct ibv_cq pointer) from channel->fd; there are no
 * provider ops for them. This library, preloaded by `shmrdma run` (and
 * exported by `shmrdma env`), defines the three symbols with libibverbs'
 * symbol versions, so the application's references resolve here first:
 *
 *  - for a context opened by the shmrdma plugin it asks the plugin (found
 *    among the loaded objects and reached through dlopen RTLD_NOLOAD and its
 *    one exported symbol, shim_abi.h) to make the channel's FIFO, to forget
 *    it, and to wait for an event. The plugin never trusts the bytes peers
 *    write into the FIFO: they are tokens it translates through its private
 *    tables (src/channel.h).
 *  - for any other context it calls the real libibverbs functions
 *    (dlvsym RTLD_NEXT with the same versions).
 *
 * Memory ownership follows libibverbs: the channel is malloc()ed by create
 * and freed by destroy; destroy fails with EBUSY while CQs use the channel
 * (channel->refcnt, which libibverbs maintains under context->mutex when it
 * creates and destroys CQs).
 */
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <link.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shim_abi.h"

#define EXPORT __attribute__((visibility("default")))

static const struct shmrdma_shim_ops *g_ops;  /* set once found */
static unsigned long long g_adds_seen = ~0ull; /* dlpi_adds when we last looked */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

struct find_state {
  unsigned long long adds;
  char path[4096];
};


static int find_plugin(struct dl_phdr_info *info, size_t size, void *data) {
  struct find_state *st = data;
  const size_t m = strlen(SHMRDMA_PLUGIN_FILE);
  (void)size;
  if (!info->dlpi_name) return 0;
  size_t n = strlen(info->dlpi_name);
  if (n > m && n < sizeof st->path && info->dlpi_name[n - m - 1] == '/' &&
      strcmp(info->dlpi_name + n - m, SHMRDMA_PLUGIN_FILE) == 0) {
    memcpy(st->path, info->dlpi_name, n + 1);
    return 1;
  }
  return 0;
}

static int read_adds(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  *(unsigned long long *)data = info->dlpi_adds;
  return 1;
}

/* The plugin's ops, or NULL when the plugin is not loaded in this process.
 * A miss is remembered until the set of loaded objects changes. */
static const struct shmrdma_shim_ops *plugin_ops(void) {
  const struct shmrdma_shim_ops *ops = __atomic_load_n(&g_ops, __ATOMIC_ACQUIRE);
  if (ops) return ops;
  pthread_mutex_lock(&g_mu);
  if (!g_ops) {
    unsigned long long adds = 0;
    dl_iterate_phdr(read_adds, &adds);
    if (adds != g_adds_seen) {
      struct find_state st;
      st.adds = adds;
      st.path[0] = '\0';
      dl_iterate_phdr(find_plugin, &st);
      if (st.path[0]) {
        void *h = dlopen(st.path, RTLD_NOW | RTLD_NOLOAD); /* kept: the plugin stays loaded */
        shmrdma_shim_ops_fn fn = h ? (shmrdma_shim_ops_fn)dlsym(h, SHMRDMA_SHIM_OPS_SYMBOL) : NULL;
        const struct shmrdma_shim_ops *o = fn ? fn(SHMRDMA_SHIM_ABI) : NULL;
        if (o && o->abi == SHMRDMA_SHIM_ABI && o->size >= sizeof *o) __atomic_store_n(&g_ops, o, __ATOMIC_RELEASE);
      }
      g_adds_seen = adds;
    }
  }
  ops = g_ops;
  pthread_mutex_unlock(&g_mu);
  return ops;
}

static const struct shmrdma_shim_ops *ours(struct ibv_context *ctx) {
  if (!ctx) return NULL;
  const struct shmrdma_shim_ops *o = plugin_ops();
  return (o && o->owns_context(ctx)) ? o : NULL;
}

/* The real libibverbs function `name`@`version`, looked up once. */
static void *real(void **cache, const char *name, const char *version) {
  void *f = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
  if (!f) {
    f = dlvsym(RTLD_NEXT, name, version);
    __atomic_store_n(cache, f, __ATOMIC_RELEASE);
  }
  return f;
}

EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context) {
  const struct shmrdma_shim_ops *o = ours(context);
  if (!o) {
    static void *cache;
    struct ibv_comp_channel *(*fn)(struct ibv_context *) =
        (struct ibv_comp_channel * (*)(struct ibv_context *)) real(&cache, "ibv_create_comp_channel", "IBVERBS_1.0");
    if (!fn) {
      errno = ENOSYS;
      return NULL;
    }
    return fn(context);
  }
  struct ibv_comp_channel *ch = malloc(sizeof *ch);
  if (!ch) {
    errno = ENOMEM;
    return NULL;
  }
  int fd = -1;
  int rc = o->create_channel(context, &fd);
  if (rc) {
    free(ch);
    errno = rc;
    return NULL;
  }
  ch->context = context;
  ch->fd = fd;
  ch->refcnt = 0;
  return ch;
}

EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *channel) {
  const struct shmrdma_shim_ops *o = channel ? ours(channel->context) : NULL;
  if (!o) {
    static void *cache;
    int (*fn)(struct ibv_comp_channel *) =
        (int (*)(struct ibv_comp_channel *))real(&cache, "ibv_destroy_comp_channel", "IBVERBS_1.0");
    return fn ? fn(channel) : ENOSYS;
  }
  struct ibv_context *context = channel->context;
  pthread_mutex_lock(&context->mutex);
  int rc = EBUSY;
  if (!channel->refcnt) {
    rc = o->destroy_channel(context, channel->fd);
    if (rc == 0) {
      close(channel->fd);
      free(channel);
    }
  }
  pthread_mutex_unlock(&context->mutex);
  return rc;
}

EXPORT int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context) {
  const struct shmrdma_shim_ops *o = channel ? ours(channel->context) : NULL;
  if (!o) {
    static void *cache;
    int (*fn)(struct ibv_comp_channel *, struct ibv_cq **, void **) =
        (int (*)(struct ibv_comp_channel *, struct ibv_cq **, void **))real(&cache, "ibv_get_cq_event", "IBVERBS_1.1");
    if (!fn) {
      errno = ENOSYS;
      return -1;
    }
    return fn(channel, cq, cq_context);
  }
  int rc = o->get_cq_event(channel, cq, cq_context);
  if (rc) {
    errno = rc;
    return -1;
  }
  return 0;
}
