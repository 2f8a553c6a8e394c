// Device identity through the stock libibverbs: what the device list, the
// device/port queries and the GID/P_Key tables report for shm0, in this
// process and through the stock tools ibv_devinfo and ibv_devices.
#include <endian.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <infiniband/verbs.h>

#include <cstring>
#include <string>

#include "home.h"

HARNESS_TEST_ENVIRONMENT(.tag = "itest", .root_only = false);

namespace {

using harness::Home;
using harness::Result;

class Device : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    int n = 0;
    list_ = ibv_get_device_list(&n);
    ASSERT_NE(list_, nullptr) << "ibv_get_device_list: " << std::strerror(errno);
    num_ = n;
    for (int i = 0; i < n; ++i)
      if (std::strcmp(ibv_get_device_name(list_[i]), "shm0") == 0) dev_ = list_[i];
    ASSERT_NE(dev_, nullptr) << "shm0 not in the device list";
    ctx_ = ibv_open_device(dev_);
    ASSERT_NE(ctx_, nullptr) << "ibv_open_device(shm0): " << std::strerror(errno);
  }
  void TearDown() override {
    if (ctx_) { EXPECT_EQ(ibv_close_device(ctx_), 0); }
    if (list_) ibv_free_device_list(list_);
  }

  ibv_device** list_ = nullptr;
  int num_ = 0;
  ibv_device* dev_ = nullptr;
  ibv_context* ctx_ = nullptr;
};

TEST_F(Device, ListHoldsExactlyShm0) {
  ASSERT_EQ(num_, 1);
  EXPECT_STREQ(ibv_get_device_name(list_[0]), "shm0");
  EXPECT_EQ(list_[1], nullptr) << "the list must be NULL-terminated";
  EXPECT_EQ(dev_->node_type, IBV_NODE_CA);
  EXPECT_EQ(dev_->transport_type, IBV_TRANSPORT_IB);
}

TEST_F(Device, GuidIsNonZeroAndMatchesQueryDevice) {
  __be64 guid = ibv_get_device_guid(dev_);
  EXPECT_NE(guid, 0u);
  ibv_device_attr a{};
  ASSERT_EQ(ibv_query_device(ctx_, &a), 0);
  EXPECT_EQ(a.node_guid, guid) << std::hex << "node_guid " << be64toh(a.node_guid) << " vs device guid "
                               << be64toh(guid);
  EXPECT_NE(a.sys_image_guid, 0u);
}

TEST_F(Device, QueryDeviceEx) {
  ibv_device_attr_ex ax{};
  ASSERT_EQ(ibv_query_device_ex(ctx_, nullptr, &ax), 0);
  const ibv_device_attr& a = ax.orig_attr;
  for (uint32_t hw_vendor : {0x02c9u, 0x15b3u, 0x8086u, 0x1425u})
    EXPECT_NE(a.vendor_id, hw_vendor) << "vendor_id of a real hardware vendor: tools would take vendor paths";
  EXPECT_EQ(a.phys_port_cnt, 1);
  EXPECT_GE(a.max_qp_rd_atom, 1);
  EXPECT_GE(a.max_pd, 1);
  EXPECT_GE(a.max_cq, 1);
  EXPECT_GE(a.max_cqe, 1);
  EXPECT_GE(a.max_qp_wr, 1);
  EXPECT_GE(a.max_sge, 1);
  EXPECT_GE(ax.max_wq_type_rq, 1u);
  EXPECT_GE(ax.rss_caps.max_rwq_indirection_table_size, 1u);
  EXPECT_GE(ax.rss_caps.max_rwq_indirection_tables, 1u);
  EXPECT_EQ(ax.phys_port_cnt_ex, 1u);

  // The extended query agrees with the plain one.
  ibv_device_attr plain{};
  ASSERT_EQ(ibv_query_device(ctx_, &plain), 0);
  EXPECT_EQ(plain.node_guid, a.node_guid);
  EXPECT_EQ(plain.vendor_id, a.vendor_id);
  EXPECT_EQ(plain.max_qp_wr, a.max_qp_wr);
  EXPECT_EQ(plain.max_sge, a.max_sge);
  EXPECT_EQ(plain.max_cqe, a.max_cqe);
  EXPECT_EQ(plain.phys_port_cnt, a.phys_port_cnt);

  // Unknown input comp_mask bits are refused.
  ibv_query_device_ex_input in{};
  in.comp_mask = 1;
  EXPECT_NE(ibv_query_device_ex(ctx_, &in, &ax), 0);
}

TEST_F(Device, Port1IsActiveInfiniBand) {
  ibv_port_attr p{};
  ASSERT_EQ(ibv_query_port(ctx_, 1, &p), 0);
  EXPECT_EQ(p.state, IBV_PORT_ACTIVE);
  EXPECT_NE(p.lid, 0);
  EXPECT_EQ(p.link_layer, IBV_LINK_LAYER_INFINIBAND);
  EXPECT_EQ(p.active_mtu, IBV_MTU_4096);
  EXPECT_GE(p.max_mtu, p.active_mtu);
  // 4X HDR (200 Gb/s): the speed the device moves data at (src/registry.cc).
  EXPECT_EQ(p.active_width, 2);   // 4X
  EXPECT_EQ(p.active_speed, 64);  // HDR
  EXPECT_GT(p.gid_tbl_len, 0);
  EXPECT_GT(p.pkey_tbl_len, 0);
}

TEST_F(Device, Port2DoesNotExist) {
  ibv_port_attr p{};
  EXPECT_NE(ibv_query_port(ctx_, 2, &p), 0);
  EXPECT_NE(ibv_query_port(ctx_, 0, &p), 0);
}

TEST_F(Device, Gid0IsLinkLocal) {
  ibv_gid g{};
  ASSERT_EQ(ibv_query_gid(ctx_, 1, 0, &g), 0);
  EXPECT_EQ(be64toh(g.global.subnet_prefix), 0xfe80000000000000ull)
      << std::hex << "subnet prefix " << be64toh(g.global.subnet_prefix);
  EXPECT_NE(g.global.interface_id, 0u);
}

TEST_F(Device, Pkey0IsDefault) {
  __be16 pkey = 0;
  ASSERT_EQ(ibv_query_pkey(ctx_, 1, 0, &pkey), 0);
  EXPECT_EQ(be16toh(pkey), 0xffff);
}

TEST_F(Device, GidAndPkeyTablesEndWhereThePortSays) {
  ibv_port_attr p{};
  ASSERT_EQ(ibv_query_port(ctx_, 1, &p), 0);
  ibv_gid g{};
  EXPECT_EQ(ibv_query_gid(ctx_, 1, p.gid_tbl_len - 1, &g), 0) << "last GID index " << p.gid_tbl_len - 1;
  EXPECT_NE(ibv_query_gid(ctx_, 1, p.gid_tbl_len, &g), 0) << "GID index " << p.gid_tbl_len << " is past the table";
  EXPECT_NE(ibv_query_gid(ctx_, 2, 0, &g), 0) << "port 2 does not exist";
  __be16 pkey = 0;
  EXPECT_NE(ibv_query_pkey(ctx_, 1, p.pkey_tbl_len, &pkey), 0) << "P_Key index past the table";
}

TEST_F(Device, AsyncFdAndCompVectors) {
  EXPECT_GE(ctx_->async_fd, 0);
  EXPECT_NE(::fcntl(ctx_->async_fd, F_GETFD), -1) << "async_fd is not an open descriptor";
  EXPECT_GE(ctx_->num_comp_vectors, 1);
}

TEST_F(Device, StatusListsThisProcess) {
  nlohmann::json st = Home::get().status();
  nlohmann::json p = Home::find_process(st, ::getpid());
  ASSERT_FALSE(p.is_null()) << st.dump(2);
  ASSERT_TRUE(p.contains("objects"));
  EXPECT_EQ(p["objects"].value("pd", -1), 0);
  // The port reported by status is the one verbs see.
  ibv_port_attr pa{};
  ASSERT_EQ(ibv_query_port(ctx_, 1, &pa), 0);
  const auto& dev = st["devices"][0];
  EXPECT_EQ(dev["ports"][0].value("lid", -1), pa.lid);
}

// ---------------------------------------------------------- stock tools

class StockTools : public ::testing::Test {
 protected:
  void SetUp() override { HARNESS_REQUIRE_DEVICE(); }
};

TEST_F(StockTools, IbvDevinfoVerbose) {
  Result r = Home::get().shmrdma({"run", "ibv_devinfo", "-v"});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.err, "") << "ibv_devinfo -v wrote to stderr";
  EXPECT_NE(r.out.find("shm0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("PORT_ACTIVE"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("GID[  0]:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fe80:0000:0000:0000:"), std::string::npos) << r.out;
}

TEST_F(StockTools, IbvDevices) {
  Result r = Home::get().shmrdma({"run", "ibv_devices"});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.err, "") << "ibv_devices wrote to stderr";
  EXPECT_NE(r.out.find("shm0"), std::string::npos) << r.out;
}

// `shmrdma run [--] PROGRAM [ARGS...]` must hand PROGRAM its arguments
// verbatim: same order, options included, nothing added.
TEST_F(StockTools, RunPassesArgumentsVerbatim) {
  struct Case {
    std::vector<std::string> args;  // after `run`
    std::string want;               // printf output
  };
  for (const Case& c : {
           Case{{"--", "printf", "[%s]", "a", "--pd", "1"}, "[a][--pd][1]"},
           Case{{"printf", "[%s]", "a", "--pd", "1"}, "[a][--pd][1]"},
           Case{{"--", "printf", "[%s]"}, "[]"},
           Case{{"--", "printf", "[%s]", "-v", "x", "-d", "shm0"}, "[-v][x][-d][shm0]"},
           Case{{"printf", "[%s]", "--", "x"}, "[--][x]"},
       }) {
    std::vector<std::string> args = {"run"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    std::string shown;
    for (const auto& a : args) shown += " " + a;
    Result r = Home::get().shmrdma(args);
    EXPECT_TRUE(r.ok()) << "shmrdma" << shown << ": " << r.describe();
    EXPECT_EQ(r.out, c.want) << "shmrdma" << shown;
  }
}

TEST_F(StockTools, RunSetsTheEnvironment) {
  Result r = Home::get().shmrdma({"run", "--", "sh", "-c", "printf '%s|%s|%s' \"$SHMRDMA_HOME\" \"$SYSFS_PATH\" \"$RDMAV_DRIVERS\""});
  ASSERT_TRUE(r.ok()) << r.describe();
  // SYSFS_PATH: this network namespace's view of the home (st_dev-st_ino of /proc/self/ns/net).
  struct stat ns{};
  ASSERT_EQ(::stat("/proc/self/ns/net", &ns), 0);
  const std::string view = Home::get().path() + "/netns/" + std::to_string(ns.st_dev) + "-" + std::to_string(ns.st_ino);
  EXPECT_EQ(r.out, Home::get().path() + "|" + view + "|" + harness::getenv_str("RDMAV_DRIVERS"));
}

TEST_F(StockTools, RunWithoutProgramFails) {
  Result r = Home::get().shmrdma({"run"});
  EXPECT_TRUE(r.started && !r.timed_out);
  EXPECT_NE(r.exit_code, 0) << r.describe();
  Result missing = Home::get().shmrdma({"run", "--", "/nonexistent/program"});
  EXPECT_NE(missing.exit_code, 0) << missing.describe();
  EXPECT_NE(missing.err.find("/nonexistent/program"), std::string::npos) << missing.describe();
}

TEST_F(StockTools, IbvDevinfoWithDashDash) {
  Result r = Home::get().shmrdma({"run", "--", "ibv_devinfo", "-d", "shm0"});
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("hca_id:\tshm0"), std::string::npos) << r.out;
}

}  // namespace
