// ibv_query_device(_ex) and ibv_query_port. Every limit comes from
// device_limits.h, where the same numbers are enforced.
#include <endian.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "provider.h"

namespace shmrdma::provider {

constexpr uint64_t kDeviceClockKhz = 1000000;  // CLOCK_MONOTONIC ns: a 1 GHz clock

int query_device_ex(ibv_context* ibctx, const ibv_query_device_ex_input* input, ibv_device_attr_ex* attr,
                    size_t attr_size) noexcept {
  if (!attr || attr_size < sizeof(ibv_device_attr)) return EINVAL;
  if (input && input->comp_mask) return EINVAL;
  const layout::DeviceRecord& dev = to_ctx(ibctx)->core->device();
  ibv_device_attr_ex a{};
  ibv_device_attr& o = a.orig_attr;
  std::snprintf(o.fw_ver, sizeof o.fw_ver, "%s", "0.1.0");
  o.node_guid = htobe64(dev.node_guid);
  o.sys_image_guid = htobe64(dev.sys_image_guid);
  o.max_mr_size = uint64_t{1} << 40;
  o.page_size_cap = 4096;
  o.vendor_id = limits::kVendorId;
  o.vendor_part_id = limits::kVendorPartId;
  o.hw_ver = limits::kHwVer;
  o.max_qp = limits::kMaxQp;
  o.max_qp_wr = limits::kMaxQpWr;
  // What shmrdma implements: XRC domains/SRQs/QPs, receiver-not-ready waiting,
  // memory windows of type 1 and 2B (src/mw.cc).
  o.device_cap_flags = IBV_DEVICE_XRC | IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_MEM_WINDOW |
                       IBV_DEVICE_MEM_WINDOW_TYPE_2B;
  o.max_sge = limits::kMaxSge;
  o.max_sge_rd = limits::kMaxSge;
  o.max_cq = limits::kMaxCq;
  o.max_cqe = limits::kMaxCqe;
  o.max_mr = limits::kMaxMr;
  o.max_pd = limits::kMaxPd;
  o.max_qp_rd_atom = 16;
  o.max_ee_rd_atom = 0;
  o.max_res_rd_atom = 16 * limits::kMaxQp;
  o.max_qp_init_rd_atom = 16;
  o.max_ee_init_rd_atom = 0;
  o.atomic_cap = IBV_ATOMIC_HCA;  // atomic with respect to every other RDMA atomic on the device
  o.max_ee = 0;
  o.max_rdd = 0;
  o.max_mw = limits::kMaxMr;  // windows take entries of the MR table
  o.max_raw_ipv6_qp = 0;
  o.max_raw_ethy_qp = 0;
  o.max_mcast_grp = static_cast<int>(limits::kMaxMcastGroups);
  o.max_mcast_qp_attach = static_cast<int>(limits::kMaxMcastQpAttach);
  o.max_total_mcast_qp_attach = static_cast<int>(limits::kMaxMcastGroups * limits::kMaxMcastQpAttach);
  o.max_ah = limits::kMaxAh;
  o.max_fmr = 0;
  o.max_map_per_fmr = 0;
  o.max_srq = limits::kMaxSrq;
  o.max_srq_wr = limits::kMaxSrqWr;
  o.max_srq_sge = limits::kMaxSrqSge;
  o.max_pkeys = limits::kPkeyTableLen;
  o.local_ca_ack_delay = 15;
  o.phys_port_cnt = static_cast<uint8_t>(dev.num_ports);
  a.comp_mask = 0;
  a.device_cap_flags_ex = o.device_cap_flags;
  a.rss_caps.supported_qpts = 0;  // indirection tables exist; RSS QPs over them do not yet
  a.rss_caps.max_rwq_indirection_tables = limits::kMaxRwqIndTables;
  a.rss_caps.max_rwq_indirection_table_size = limits::kMaxRwqIndTableSize;
  a.max_wq_type_rq = limits::kMaxWq;
  a.phys_port_cnt_ex = dev.num_ports;
  // Completion timestamps: the device clock is CLOCK_MONOTONIC in ns (1 GHz),
  // all 64 bits (cq.cc; ibv_query_rt_values_ex reads it).
  a.hca_core_clock = kDeviceClockKhz;
  a.completion_timestamp_mask = ~uint64_t{0};
  a.max_dm_size = limits::kMaxDmSize;  // per context (dm.cc)
  // On-demand paging (src/mr.cc): explicit and implicit ODP MRs, reached by
  // every operation of every transport through CMA (an unmapped page is an
  // access error, never a fault).
  a.odp_caps.general_caps = IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT;
  const uint32_t all = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ |
                       IBV_ODP_SUPPORT_ATOMIC | IBV_ODP_SUPPORT_SRQ_RECV;
  a.odp_caps.per_transport_caps.rc_odp_caps = all;
  a.odp_caps.per_transport_caps.uc_odp_caps = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
                                              IBV_ODP_SUPPORT_SRQ_RECV;
  a.odp_caps.per_transport_caps.ud_odp_caps = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_SRQ_RECV;
  a.xrc_odp_caps = all;
  // Callers built against older headers pass a smaller struct: never write
  // past what they gave us.
  std::memcpy(attr, &a, std::min(attr_size, sizeof a));
  return 0;
}

// ibv_query_rt_values_ex: the device clock now (raw_clock in cycles, which
// are ns; tv_sec 0, as mlx5 reports it). comp_mask says what was filled.
int query_rt_values(ibv_context*, ibv_values_ex* values) noexcept {
  if (!values) return EINVAL;
  uint32_t done = 0;
  if (values->comp_mask & IBV_VALUES_MASK_RAW_CLOCK) {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    values->raw_clock.tv_sec = 0;
    values->raw_clock.tv_nsec = static_cast<long>(ts.tv_sec) * 1000000000L + ts.tv_nsec;
    done |= IBV_VALUES_MASK_RAW_CLOCK;
  }
  values->comp_mask = done;
  return 0;
}

int query_port(ibv_context* ibctx, uint8_t port_num, ibv_port_attr* attr) noexcept {
  LocalContext* core = to_ctx(ibctx)->core;
  const layout::DeviceRecord& dev = core->device();
  if (!attr || port_num < 1 || port_num > dev.num_ports) return EINVAL;
  const layout::PortRecord& p = dev.ports[port_num - 1];
  // The live record: state, MTU and rate follow the interface on RoCE.
  PortNetView v;
  if (int rc = core->registry().port_net_settled(port_num, &v); rc) return rc;
  const bool eth = dev.net.link_layer == layout::kLinkLayerEthernet;
  *attr = ibv_port_attr{};
  attr->state = static_cast<ibv_port_state>(v.state);
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = static_cast<ibv_mtu>(v.active_mtu);
  attr->gid_tbl_len = limits::kGidTableLen;
  attr->port_cap_flags = eth ? IBV_PORT_CM_SUP : 0;  // rxe's
  attr->max_msg_sz = limits::kMaxMsgSz;
  attr->bad_pkey_cntr = 0;
  attr->qkey_viol_cntr = 0;
  attr->pkey_tbl_len = limits::kPkeyTableLen;
  // RoCE has no LIDs and no subnet manager (rxe: lid, sm_lid, lmc 0).
  attr->lid = eth ? 0 : p.lid;
  attr->sm_lid = eth ? 0 : 1;
  attr->lmc = 0;
  attr->max_vl_num = 1;        // VL0 only
  attr->sm_sl = 0;
  attr->subnet_timeout = eth ? 0 : 18;
  attr->init_type_reply = 0;
  attr->active_width = static_cast<uint8_t>(v.active_width);
  attr->active_speed = static_cast<uint8_t>(v.active_speed);
  attr->phys_state = static_cast<uint8_t>(v.phys_state);
  attr->link_layer = eth ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
  attr->flags = 0;
  attr->port_cap_flags2 = 0;
  return 0;
}

}  // namespace shmrdma::provider
