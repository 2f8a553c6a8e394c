// The plugin's entry points: registration with libibverbs, device matching,
// and opening/closing a context. The plugin never issues a kernel command:
// cmd_fd is /dev/full (or whatever the device node points at) and stays unused.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "paths.h"
#include "provider.h"
#include "segment.h"

namespace shmrdma::provider {
namespace {

// The `shmrdma up` command writes device/modalias = "shmrdma:<name>", so this
// matches our devices and nothing a kernel driver would create.
const verbs_match_ent kMatchTable[] = {
    {nullptr, {.modalias = "shmrdma:*"}, 0, 0, VERBS_MATCH_MODALIAS},
    {nullptr, {.modalias = nullptr}, 0, 0, VERBS_MATCH_SENTINEL},
};

struct Device {
  verbs_device vdev;
  // Reserve: see verbs_device in pabi.h.
  char reserved[256];
};

verbs_device* alloc_device(verbs_sysfs_dev*) noexcept {
  auto* d = static_cast<Device*>(std::calloc(1, sizeof(Device)));
  return d ? &d->vdev : nullptr;
}

void uninit_device(verbs_device* vdev) noexcept { std::free(reinterpret_cast<Device*>(vdev)); }

void free_context(ibv_context* ibctx) noexcept {
  Context* ctx = to_ctx(ibctx);
  delete ctx->core;
  verbs_uninit_context(&ctx->vctx);  // closes cmd_fd and async_fd
  std::free(ctx);
}

// libibverbs has turned the descriptor's element into a pointer; it is our
// token (async.h), translated here through private tables. A token that
// names nothing live (a corrupt or stale descriptor) becomes a harmless port
// event rather than a wild pointer the application would dereference.
void async_event(ibv_context* ibctx, ibv_async_event* event) noexcept {
  LocalContext* core = to_ctx(ibctx)->core;
  uint64_t token = 0;
  switch (event->event_type) {
    case IBV_EVENT_CQ_ERR:
      token = reinterpret_cast<uintptr_t>(event->element.cq);
      break;
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      token = reinterpret_cast<uintptr_t>(event->element.qp);
      break;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      token = reinterpret_cast<uintptr_t>(event->element.srq);
      break;
    case IBV_EVENT_WQ_FATAL:
      token = reinterpret_cast<uintptr_t>(event->element.wq);
      break;
    default:
      if (event->element.port_num < 1 || static_cast<uint32_t>(event->element.port_num) > core->device().num_ports)
        event->element.port_num = 1;
      return;
  }
  void* obj = core->resolve_async(token);
  if (!obj) {
    event->event_type = IBV_EVENT_PORT_ACTIVE;
    event->element.port_num = 1;
    return;
  }
  event->element.cq = static_cast<ibv_cq*>(obj);  // the union's members are all pointers
}

const verbs_context_ops kOps = [] {
  verbs_context_ops o{};
  o.alloc_pd = alloc_pd;
  o.alloc_parent_domain = alloc_parent_domain;  // pd.cc
  o.async_event = async_event;
  o.create_cq = create_cq;
  o.create_cq_ex = create_cq_ex;
  o.resize_cq = resize_cq;
  o.req_notify_cq = req_notify_cq;
  o.cq_event = cq_event;
  o.create_rwq_ind_table = create_rwq_ind_table;
  o.create_wq = create_wq;
  o.dealloc_pd = dealloc_pd;
  o.destroy_cq = destroy_cq;
  o.destroy_rwq_ind_table = destroy_rwq_ind_table;
  o.destroy_wq = destroy_wq;
  o.dereg_mr = dereg_mr;
  o.reg_mr = reg_mr;
  o.rereg_mr = rereg_mr;
  o.advise_mr = advise_mr;
  o.alloc_mw = alloc_mw;  // mr.cc: memory windows
  o.dealloc_mw = dealloc_mw;
  o.bind_mw = bind_mw;
  o.alloc_dm = alloc_dm;  // dm.cc: device memory
  o.free_dm = free_dm;
  o.reg_dm_mr = reg_dm_mr;
  o.create_qp = create_qp;
  o.create_qp_ex = create_qp_ex;
  o.modify_qp = modify_qp;
  o.query_qp = query_qp;
  o.destroy_qp = destroy_qp;
  o.post_send = post_send;
  o.post_recv = post_recv;
  o.free_context = free_context;
  o.modify_wq = modify_wq;
  o.poll_cq = poll_cq;
  o.query_device_ex = query_device_ex;
  o.query_rt_values = query_rt_values;
  o.query_port = query_port;
  o.create_srq = create_srq;  // srq.cc
  o.create_srq_ex = create_srq_ex;
  o.modify_srq = modify_srq;
  o.query_srq = query_srq;
  o.destroy_srq = destroy_srq;
  o.post_srq_recv = post_srq_recv;
  o.get_srq_num = get_srq_num;
  o.open_xrcd = open_xrcd;  // xrcd.cc
  o.close_xrcd = close_xrcd;
  o.open_qp = open_qp;
  o.create_ah = create_ah;  // ah.cc
  o.destroy_ah = destroy_ah;
  o.attach_mcast = attach_mcast;  // qp.cc
  o.detach_mcast = detach_mcast;
  return o;
}();

// The state home is recorded in the device's sysfs directory by `shmrdma up`,
// so a program finds its device wherever SYSFS_PATH points.
int locate_device(ibv_device* device, DevicePaths* out) noexcept {
  try {
    std::string home;
    int rc = read_small_file(std::string(device->ibdev_path) + "/" + kHomeFile, &home);
    if (rc) return rc;
    if (home.empty() || home[0] != '/') return EPROTO;
    std::string why;
    if (!valid_device_name(device->name, &why)) return EPROTO;
    *out = device_paths(home, device->name);
    return 0;
  } catch (...) {
    return ENOMEM;
  }
}

verbs_context* alloc_context(ibv_device* device, int cmd_fd, void*) noexcept {
  auto* ctx = static_cast<Context*>(_verbs_init_and_alloc_context(
      device, cmd_fd, sizeof(Context), reinterpret_cast<verbs_context*>(offsetof(Context, vctx)),
      0 /* RDMA_DRIVER_UNKNOWN */));
  if (!ctx) return nullptr;  // libibverbs closed cmd_fd
  ctx->core = nullptr;
  int rc = 0;
  DevicePaths paths;
  std::unique_ptr<LocalContext> core;
  if ((rc = locate_device(device, &paths)) != 0) goto fail;
  if ((rc = LocalContext::open(paths, LocalContext::kDefaultHeapSize, &core)) != 0) {
    if (rc == ENOENT)
      std::fprintf(stderr, "shmrdma: device %s is not up (run: shmrdma up --name %s)\n", device->name, device->name);
    goto fail;
  }
  // Async events arrive on the context's FIFO (see async.h); libibverbs
  // reads them from async_fd and closes it with the context.
  ctx->vctx.context.async_fd = core->take_async_read_fd();
  ctx->vctx.context.num_comp_vectors = limits::kNumCompVectors;
  core->set_leaf_general(general_post);
  ctx->core = core.release();
  verbs_set_ops(&ctx->vctx, &kOps);
  return &ctx->vctx;

fail:
  verbs_uninit_context(&ctx->vctx);
  std::free(ctx);
  errno = rc;
  return nullptr;
}

const verbs_device_ops kDeviceOps = {
    .name = "shmrdma",
    .match_min_abi_version = 1,
    .match_max_abi_version = 1,
    .match_table = kMatchTable,
    .static_providers = nullptr,
    .match_device = nullptr,
    .alloc_context = alloc_context,
    .import_context = nullptr,
    .alloc_device = alloc_device,
    .uninit_device = uninit_device,
};

__attribute__((constructor)) void register_driver() { verbs_register_driver_34(&kDeviceOps); }

}  // namespace
}  // namespace shmrdma::provider
