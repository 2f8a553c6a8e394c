// roce_probe DEV: what a verbs program sees of a device's port 1, through
// the stock libibverbs only: ibv_query_port, ibv_query_pkey, ibv_query_gid
// (every index), ibv_query_gid_ex (every index) and ibv_query_gid_table.
// One line per fact, for roce_ctl_test to check. Exit 0, or 1 with the
// failing call on stderr.
#include <arpa/inet.h>
#include <endian.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace {

const char* gid_text(const uint8_t* raw, char* buf, size_t n) {
  return inet_ntop(AF_INET6, raw, buf, static_cast<socklen_t>(n)) ? buf : "?";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: roce_probe DEV\n");
    return 2;
  }
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) {
    std::perror("ibv_get_device_list");
    return 1;
  }
  ibv_device* dev = nullptr;
  for (int i = 0; i < n; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), argv[1]) == 0) dev = list[i];
  if (!dev) {
    std::fprintf(stderr, "no device %s\n", argv[1]);
    return 1;
  }
  ibv_context* ctx = ibv_open_device(dev);
  if (!ctx) {
    std::perror("ibv_open_device");
    return 1;
  }
  std::printf("node_guid 0x%016" PRIx64 "\n", be64toh(ibv_get_device_guid(dev)));
  ibv_port_attr pa{};
  if (int rc = ibv_query_port(ctx, 1, &pa)) {
    std::fprintf(stderr, "ibv_query_port: %s\n", std::strerror(rc));
    return 1;
  }
  std::printf("port state=%d phys_state=%u active_mtu=%d max_mtu=%d link_layer=%u lid=%u sm_lid=%u lmc=%u "
              "gid_tbl_len=%d pkey_tbl_len=%u width=%u speed=%u\n",
              pa.state, pa.phys_state, pa.active_mtu, pa.max_mtu, pa.link_layer, pa.lid, pa.sm_lid, pa.lmc,
              pa.gid_tbl_len, pa.pkey_tbl_len, pa.active_width, pa.active_speed);
  for (int i = 0; i < static_cast<int>(pa.pkey_tbl_len); ++i) {
    uint16_t pkey = 0;
    if (ibv_query_pkey(ctx, 1, i, &pkey)) {
      std::perror("ibv_query_pkey");
      return 1;
    }
    std::printf("pkey %d 0x%04x\n", i, be16toh(pkey));
  }
  char buf[64];
  for (int i = 0; i < pa.gid_tbl_len; ++i) {
    ibv_gid g{};
    if (ibv_query_gid(ctx, 1, i, &g)) {
      std::fprintf(stderr, "ibv_query_gid %d failed\n", i);
      return 1;
    }
    std::printf("gid %d %s\n", i, gid_text(g.raw, buf, sizeof buf));
    ibv_gid_entry e{};
    int rc = ibv_query_gid_ex(ctx, 1, static_cast<uint32_t>(i), &e, 0);
    if (rc == 0)
      std::printf("gid_ex %d %s type=%u ifindex=%u\n", i, gid_text(e.gid.raw, buf, sizeof buf), e.gid_type,
                  e.ndev_ifindex);
    else
      std::printf("gid_ex %d error=%d\n", i, rc);
  }
  ibv_gid_entry entries[64];
  ssize_t got = ibv_query_gid_table(ctx, entries, 64, 0);
  if (got < 0) {
    std::fprintf(stderr, "ibv_query_gid_table: %s\n", std::strerror(static_cast<int>(-got)));
    return 1;
  }
  for (ssize_t i = 0; i < got; ++i)
    std::printf("table %u %s type=%u ifindex=%u\n", entries[i].gid_index, gid_text(entries[i].gid.raw, buf, sizeof buf),
                entries[i].gid_type, entries[i].ndev_ifindex);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  return 0;
}
