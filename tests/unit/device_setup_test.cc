// SPDX-License-Identifier: MIT
//
// Unit tests for src/device_setup.h: bringing devices up (the sysfs tree
// libibverbs reads, the registry, the device node when root), repairing and
// re-using an existing device, name validation, bringing devices down and
// listing them.

#include "device_setup.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "context.h"

namespace shmrdma {
namespace {

namespace fs = std::filesystem;

std::string unique_name() {
  static std::atomic<int> n{0};
  return "ut" + std::to_string(::getpid()) + "d" + std::to_string(n++);
}

std::string slurp(const std::string& path) {
  std::string s;
  int rc = read_small_file(path, &s);
  return rc ? "<" + std::string(std::strerror(rc)) + ">" : s;
}

class DeviceSetupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shmrdma-ut-dev-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    home_ = tmpl;
  }
  void TearDown() override {
    std::string why;
    for (const auto& n : names_) device_down(home_, n, true, &why);
    fs::remove_all(home_);
  }
  // A fresh device name, brought down (and its /dev node removed) at the end.
  std::string fresh() {
    names_.push_back(unique_name());
    return names_.back();
  }
  int up(const std::string& name, uint32_t ports = 1, UpResult* res = nullptr) {
    UpResult r;
    std::string why;
    int rc = device_up(home_, name, ports, res ? res : &r, &why);
    EXPECT_EQ(rc == 0, why.empty()) << why;
    return rc;
  }
  layout::DeviceRecord record(const std::string& name) {
    Registry r;
    EXPECT_EQ(Registry::attach(device_paths(home_, name), &r), 0);
    return r.valid() ? r.device() : layout::DeviceRecord{};
  }

  std::string home_;
  std::vector<std::string> names_;
};

TEST_F(DeviceSetupTest, UpCreatesTheSysfsTree) {
  std::string name = fresh();
  UpResult res;
  ASSERT_EQ(up(name, 1, &res), 0);
  EXPECT_TRUE(res.created);
  EXPECT_EQ(res.reclaimed, 0);
  DevicePaths p = device_paths(home_, name);
  const std::string verbs = p.sysfs_root + "/class/infiniband_verbs";
  // The uverbs name carries a hash of the home (the node in /dev is
  // machine-wide): shmrdma_<name>_<8 hex digits>.
  const std::string prefix = "shmrdma_" + name + "_";
  ASSERT_EQ(p.uverbs_name.size(), prefix.size() + 8) << p.uverbs_name;
  EXPECT_EQ(p.uverbs_name.substr(0, prefix.size()), prefix);
  EXPECT_EQ(p.uverbs_name.find_first_not_of("0123456789abcdef", prefix.size()), std::string::npos);
  EXPECT_EQ(p.uverbs_dir, verbs + "/" + p.uverbs_name);
  EXPECT_EQ(p.cdev, "/dev/infiniband/" + p.uverbs_name);
  EXPECT_TRUE(fs::is_directory(p.uverbs_dir));
  EXPECT_EQ(p.ibdev_dir, p.sysfs_root + "/class/infiniband/" + name);

  EXPECT_EQ(slurp(verbs + "/abi_version"), "6");
  EXPECT_EQ(slurp(p.uverbs_dir + "/ibdev"), name);
  EXPECT_EQ(slurp(p.uverbs_dir + "/dev"), "1:7");
  EXPECT_EQ(slurp(p.uverbs_dir + "/abi_version"), "1");
  EXPECT_EQ(slurp(p.ibdev_dir + "/node_type"), "1: CA");
  EXPECT_EQ(slurp(p.ibdev_dir + "/device/modalias"), "shmrdma:" + name);
  EXPECT_EQ(slurp(p.ibdev_dir + "/" + kHomeFile), home_);

  layout::DeviceRecord d = record(name);
  EXPECT_STREQ(d.name, name.c_str());
  EXPECT_EQ(d.num_ports, 1u);
  EXPECT_NE(d.node_guid, 0u);
  EXPECT_EQ(d.node_guid >> 56, 0x02u) << "locally administered EUI-64";
  EXPECT_EQ(d.node_guid & 0xff, 0u) << "low byte left for port numbers";
  EXPECT_EQ(slurp(p.ibdev_dir + "/node_guid"), guid_string(d.node_guid));
  EXPECT_EQ(slurp(p.ibdev_dir + "/sys_image_guid"), guid_string(d.sys_image_guid));

  const std::string port = p.ibdev_dir + "/ports/1";
  EXPECT_EQ(slurp(port + "/state"), "4: ACTIVE");
  EXPECT_EQ(slurp(port + "/lid"), "0x1");
  EXPECT_EQ(d.ports[0].lid, 1);
  EXPECT_EQ(slurp(port + "/link_layer"), "InfiniBand");
  EXPECT_EQ(slurp(port + "/rate"), "200 Gb/sec (4X HDR)");
  EXPECT_EQ(slurp(port + "/pkeys/0"), "0xffff");
  EXPECT_EQ(d.ports[0].port_guid, d.node_guid + 1);
  std::string g = guid_string(d.ports[0].port_guid);
  EXPECT_EQ(slurp(port + "/gids/0"), "fe80:0000:0000:0000:" + g);
  EXPECT_EQ(slurp(port + "/gids/1"), "0000:0000:0000:0000:0000:0000:0000:0000");
  EXPECT_EQ(slurp(port + "/gids/" + std::to_string(limits::kGidTableLen - 1)),
            "0000:0000:0000:0000:0000:0000:0000:0000");
  EXPECT_FALSE(fs::exists(port + "/gids/" + std::to_string(limits::kGidTableLen)));
  EXPECT_FALSE(fs::exists(p.ibdev_dir + "/ports/2"));

  // Files end with a newline, as sysfs attributes do.
  std::string raw;
  {
    FILE* f = std::fopen((port + "/state").c_str(), "r");
    ASSERT_NE(f, nullptr);
    char buf[64] = {};
    size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    raw.assign(buf, n);
  }
  EXPECT_EQ(raw, "4: ACTIVE\n");

  EXPECT_TRUE(fs::exists(p.registry));
  struct stat st{};
  ASSERT_EQ(::stat(p.device_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u) << "segments are private to the user";
}

TEST_F(DeviceSetupTest, UpCreatesTheDeviceNodeWhenRoot) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root";
  std::string name = fresh();
  UpResult res;
  ASSERT_EQ(up(name, 1, &res), 0);
  DevicePaths p = device_paths(home_, name);
  EXPECT_EQ(p.cdev, "/dev/infiniband/" + p.uverbs_name);
  struct stat st{};
  ASSERT_EQ(::stat(p.cdev.c_str(), &st), 0) << res.cdev_hint;
  EXPECT_TRUE(res.cdev_ready);
  EXPECT_TRUE(res.cdev_hint.empty());
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(major(st.st_rdev), 1u);
  EXPECT_EQ(minor(st.st_rdev), 7u);
  EXPECT_EQ(st.st_mode & 0777, 0666u);
  // A wrong node is replaced.
  ASSERT_EQ(::unlink(p.cdev.c_str()), 0);
  ASSERT_EQ(::mknod(p.cdev.c_str(), S_IFCHR | 0600, makedev(1, 3)), 0);
  UpResult again;
  ASSERT_EQ(up(name, 0, &again), 0);
  EXPECT_TRUE(again.cdev_ready);
  ASSERT_EQ(::stat(p.cdev.c_str(), &st), 0);
  EXPECT_EQ(minor(st.st_rdev), 7u);
  std::string why;
  ASSERT_EQ(device_down(home_, name, false, &why), 0) << why;
  EXPECT_FALSE(fs::exists(p.cdev)) << "down removes the node";
}

TEST_F(DeviceSetupTest, SameNameUnderTwoHomesDoesNotShareTheNode) {
  std::string name = fresh();
  char tmpl[] = "/tmp/shmrdma-ut-dev2-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string home2 = tmpl;
  DevicePaths p1 = device_paths(home_, name), p2 = device_paths(home2, name);
  EXPECT_NE(p1.uverbs_name, p2.uverbs_name);
  EXPECT_NE(p1.cdev, p2.cdev);
  EXPECT_EQ(device_paths(home_, name).uverbs_name, p1.uverbs_name) << "stable";
  ASSERT_EQ(up(name), 0);
  UpResult r2;
  std::string why;
  ASSERT_EQ(device_up(home2, name, 1, &r2, &why), 0) << why;
  // Bringing one down leaves the other's node and tree alone.
  ASSERT_EQ(device_down(home2, name, false, &why), 0) << why;
  EXPECT_FALSE(fs::exists(p2.registry));
  EXPECT_TRUE(fs::exists(p1.registry));
  if (::geteuid() == 0) {
    EXPECT_FALSE(fs::exists(p2.cdev));
    EXPECT_TRUE(fs::exists(p1.cdev));
  }
  fs::remove_all(home2);
}

TEST_F(DeviceSetupTest, StaleUverbsEntriesOfTheSameDeviceAreRemoved) {
  std::string name = fresh();
  DevicePaths p = device_paths(home_, name);
  // An entry of an older layout naming the same ibdev, and one of another device.
  std::string verbs = p.sysfs_root + "/class/infiniband_verbs";
  fs::create_directories(verbs + "/shmrdma_" + name);
  ASSERT_EQ(write_file_atomic(verbs + "/shmrdma_" + name + "/ibdev", name + "\n"), 0);
  fs::create_directories(verbs + "/uverbs_other");
  ASSERT_EQ(write_file_atomic(verbs + "/uverbs_other/ibdev", "other\n"), 0);
  ASSERT_EQ(up(name), 0);
  EXPECT_FALSE(fs::exists(verbs + "/shmrdma_" + name)) << "libibverbs would list the device twice";
  EXPECT_TRUE(fs::exists(verbs + "/uverbs_other/ibdev"));
  EXPECT_TRUE(fs::exists(p.uverbs_dir + "/ibdev"));
}

TEST_F(DeviceSetupTest, UpIsIdempotentAndRepairs) {
  std::string name = fresh();
  ASSERT_EQ(up(name), 0);
  DevicePaths p = device_paths(home_, name);
  std::string guid = slurp(p.ibdev_dir + "/node_guid");
  uint64_t created_ns = record(name).created_unix_ns;

  UpResult res;
  ASSERT_EQ(up(name, 1, &res), 0);
  EXPECT_FALSE(res.created);
  EXPECT_EQ(slurp(p.ibdev_dir + "/node_guid"), guid) << "same identity";
  EXPECT_EQ(record(name).created_unix_ns, created_ns) << "the registry was kept";

  // ports 0: whatever the device has.
  ASSERT_EQ(up(name, 0, &res), 0);
  EXPECT_FALSE(res.created);

  // Deleted sysfs files come back with the same contents.
  ASSERT_TRUE(fs::remove(p.ibdev_dir + "/node_guid"));
  ASSERT_TRUE(fs::remove(p.ibdev_dir + "/ports/1/lid"));
  ASSERT_TRUE(fs::remove(p.uverbs_dir + "/ibdev"));
  ASSERT_GT(fs::remove_all(p.ibdev_dir + "/ports/1/gids"), 0u);
  ASSERT_EQ(up(name, 0, &res), 0);
  EXPECT_FALSE(res.created);
  EXPECT_EQ(slurp(p.ibdev_dir + "/node_guid"), guid);
  EXPECT_EQ(slurp(p.ibdev_dir + "/ports/1/lid"), "0x1");
  EXPECT_EQ(slurp(p.uverbs_dir + "/ibdev"), name);
  EXPECT_EQ(slurp(p.ibdev_dir + "/ports/1/gids/0"), "fe80:0000:0000:0000:" + guid_string(record(name).ports[0].port_guid));
}

// Regression: device_up used to treat a registry that failed to attach with
// EAGAIN (not yet published) or EPROTO (size still 0 right after the O_EXCL
// create) as left over by a dead creator and unlink it. With several
// processes bringing the same device up at once, callers failed ("cannot
// create the registry") and the sysfs tree written by one process could
// disagree with the registry created by another.
TEST_F(DeviceSetupTest, ConcurrentUpOfOneDeviceAgrees) {
  std::string name = fresh();
  DevicePaths p = device_paths(home_, name);
  int failed_calls = 0, mismatches = 0;
  for (int round = 0; round < 8; ++round) {
    int go[2];
    ASSERT_EQ(::pipe(go), 0);
    std::vector<pid_t> kids;
    for (int k = 0; k < 4; ++k) {
      pid_t pid = ::fork();
      if (pid == 0) {
        ::close(go[1]);
        char c;
        (void)::read(go[0], &c, 1);  // all start together
        UpResult r;
        std::string why;
        ::_exit(device_up(home_, name, 1, &r, &why) == 0 ? 0 : 1);
      }
      ASSERT_GT(pid, 0);
      kids.push_back(pid);
    }
    ::close(go[0]);
    ::usleep(2000);
    ::close(go[1]);
    for (pid_t pid : kids) {
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      failed_calls += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    Registry r;
    ASSERT_EQ(Registry::attach(p, &r), 0) << "round " << round;
    const layout::DeviceRecord& d = r.device();
    if (slurp(p.ibdev_dir + "/node_guid") != guid_string(d.node_guid) ||
        slurp(p.ibdev_dir + "/ports/1/gids/0") != "fe80:0000:0000:0000:" + guid_string(d.ports[0].port_guid))
      ++mismatches;
    std::string why;
    ASSERT_EQ(device_down(home_, name, true, &why), 0) << why;
  }
  EXPECT_EQ(failed_calls, 0) << "concurrent device_up calls failed";
  EXPECT_EQ(mismatches, 0) << "rounds where sysfs and the registry disagree on the node GUID";
}

TEST_F(DeviceSetupTest, UpWithAnotherPortCountIsRefused) {
  std::string name = fresh();
  ASSERT_EQ(up(name, 2), 0);
  UpResult res;
  std::string why;
  EXPECT_EQ(device_up(home_, name, 1, &res, &why), EEXIST);
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(record(name).num_ports, 2u);
  EXPECT_EQ(device_up(home_, name, limits::kMaxPorts + 1, &res, &why), EINVAL);
}

TEST_F(DeviceSetupTest, UpReplacesAnUnusableRegistry) {
  std::string name = fresh();
  ASSERT_EQ(up(name), 0);
  DevicePaths p = device_paths(home_, name);
  ASSERT_EQ(::truncate(p.registry.c_str(), 100), 0);  // no longer a valid registry
  UpResult res;
  ASSERT_EQ(up(name, 1, &res), 0);
  EXPECT_TRUE(res.created);
  Registry r;
  EXPECT_EQ(Registry::attach(p, &r), 0);
}

TEST_F(DeviceSetupTest, UpReclaimsDeadContexts) {
  std::string name = fresh();
  ASSERT_EQ(up(name), 0);
  DevicePaths p = device_paths(home_, name);
  // Forge a context of a process that no longer exists.
  Mapping raw;
  ASSERT_EQ(Mapping::attach(p.registry, layout::SegmentKind::kRegistry, layout::registry_size(), &raw), 0);
  auto* seg = static_cast<layout::RegistrySegment*>(raw.base());
  seg->contexts[3].pid = static_cast<uint32_t>(::getpid());
  seg->contexts[3].start_time = 1;  // not ours
  std::snprintf(seg->contexts[3].segment, sizeof seg->contexts[3].segment, "ctx-3-1");
  seg->contexts[3].state.store(layout::kLive);
  UpResult res;
  ASSERT_EQ(up(name, 0, &res), 0);
  EXPECT_EQ(res.reclaimed, 1);
  EXPECT_EQ(seg->contexts[3].state.load(), layout::kFree);
}

TEST_F(DeviceSetupTest, TwoDevicesGetDistinctLidsAndGuids) {
  std::string a = fresh(), b = fresh(), c = fresh();
  ASSERT_EQ(up(a, 2), 0);
  ASSERT_EQ(up(b, 1), 0);
  ASSERT_EQ(up(c, 3), 0);
  std::set<uint16_t> lids;
  std::set<uint64_t> guids;
  int ports = 0;
  for (const auto& n : {a, b, c}) {
    layout::DeviceRecord d = record(n);
    guids.insert(d.node_guid);
    for (uint32_t i = 0; i < d.num_ports; ++i) {
      ++ports;
      EXPECT_NE(d.ports[i].lid, 0) << n;
      EXPECT_LT(d.ports[i].lid, 0xc000) << "unicast LID";
      lids.insert(d.ports[i].lid);
      guids.insert(d.ports[i].port_guid);
      char lid[16];
      std::snprintf(lid, sizeof lid, "0x%x", d.ports[i].lid);
      EXPECT_EQ(slurp(device_paths(home_, n).ibdev_dir + "/ports/" + std::to_string(i + 1) + "/lid"), lid);
    }
  }
  EXPECT_EQ(ports, 6);
  EXPECT_EQ(lids.size(), 6u) << "every port of every device has its own LID";
  EXPECT_EQ(guids.size(), 3u + 6u) << "node and port GUIDs are all distinct";
  // A device brought down gives its LIDs back only for new devices; existing
  // ones keep theirs.
  uint16_t b_lid = record(b).ports[0].lid;
  std::string why;
  ASSERT_EQ(device_down(home_, a, false, &why), 0) << why;
  ASSERT_EQ(up(b, 0), 0);
  EXPECT_EQ(record(b).ports[0].lid, b_lid);
}

TEST_F(DeviceSetupTest, InvalidNamesAreRejected) {
  std::string long_name(40, 'a');
  for (const std::string& n : {std::string(), std::string("a/b"), std::string("myrxe0"), std::string("rxe"),
                               long_name, std::string(32, 'b'), std::string("-x"), std::string("a b"),
                               std::string(".."), std::string("a.b")}) {
    UpResult res;
    std::string why;
    EXPECT_EQ(device_up(home_, n, 1, &res, &why), EINVAL) << "'" << n << "'";
    EXPECT_FALSE(why.empty()) << "'" << n << "'";
  }
  EXPECT_FALSE(fs::exists(home_ + "/devices/a")) << "nothing created for a/b";
  EXPECT_TRUE(list_devices(home_).empty());
  // The limits themselves are fine.
  std::string name31 = fresh();
  name31.resize(31, 'z');
  names_.back() = name31;
  EXPECT_EQ(up(name31), 0);
}

TEST_F(DeviceSetupTest, DownRefusesWhileAContextIsOpen) {
  std::string name = fresh();
  ASSERT_EQ(up(name), 0);
  DevicePaths p = device_paths(home_, name);
  std::unique_ptr<LocalContext> ctx;
  ASSERT_EQ(LocalContext::open(p, 1 << 20, &ctx), 0);
  std::string why;
  EXPECT_EQ(device_down(home_, name, false, &why), EBUSY);
  EXPECT_NE(why.find(std::to_string(::getpid())), std::string::npos) << why;
  EXPECT_TRUE(fs::exists(p.registry));
  EXPECT_TRUE(fs::exists(p.ibdev_dir));

  why.clear();
  EXPECT_EQ(device_down(home_, name, true, &why), 0) << why;
  EXPECT_FALSE(fs::exists(p.uverbs_dir));
  EXPECT_FALSE(fs::exists(p.ibdev_dir));
  EXPECT_FALSE(fs::exists(p.device_dir));
  EXPECT_FALSE(fs::exists(p.cdev));
  EXPECT_TRUE(list_devices(home_).empty());
  ctx.reset();  // closing after a forced down must not crash
  // Down of a device that is not up.
  EXPECT_EQ(device_down(home_, name, false, &why), ENOENT);
}

TEST_F(DeviceSetupTest, DownIgnoresContextsOfDeadProcesses) {
  std::string name = fresh();
  ASSERT_EQ(up(name), 0);
  DevicePaths p = device_paths(home_, name);
  pid_t pid = ::fork();
  if (pid == 0) {
    std::unique_ptr<LocalContext> ctx;
    if (LocalContext::open(p, 1 << 20, &ctx) != 0) ::_exit(1);
    ::_exit(0);  // dies without closing it
  }
  ASSERT_GT(pid, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  size_t files = 0;
  for (auto& e : fs::directory_iterator(p.device_dir)) files += e.path().filename().string().rfind("ctx-", 0) == 0;
  EXPECT_GE(files, 1u) << "the dead context left its segment behind";
  std::string why;
  EXPECT_EQ(device_down(home_, name, false, &why), 0) << why;
  EXPECT_FALSE(fs::exists(p.device_dir));
}

TEST_F(DeviceSetupTest, DownSucceedsOnceContextsAreClosed) {
  std::string name = fresh();
  ASSERT_EQ(up(name), 0);
  DevicePaths p = device_paths(home_, name);
  {
    std::unique_ptr<LocalContext> ctx;
    ASSERT_EQ(LocalContext::open(p, 1 << 20, &ctx), 0);
  }
  std::string why;
  EXPECT_EQ(device_down(home_, name, false, &why), 0) << why;
  EXPECT_FALSE(fs::exists(p.ibdev_dir));
  EXPECT_FALSE(fs::exists(p.device_dir));
  // The shared parts of the tree stay for other devices.
  EXPECT_TRUE(fs::exists(p.sysfs_root + "/class/infiniband_verbs/abi_version"));
  // It can come back up, with a new identity.
  UpResult res;
  ASSERT_EQ(up(name, 1, &res), 0);
  EXPECT_TRUE(res.created);
}

TEST_F(DeviceSetupTest, DownOfOneDeviceLeavesOthers) {
  std::string a = fresh(), b = fresh();
  ASSERT_EQ(up(a), 0);
  ASSERT_EQ(up(b), 0);
  std::string why;
  ASSERT_EQ(device_down(home_, a, false, &why), 0) << why;
  DevicePaths pb = device_paths(home_, b);
  EXPECT_TRUE(fs::exists(pb.registry));
  EXPECT_EQ(slurp(pb.uverbs_dir + "/ibdev"), b);
  EXPECT_EQ(slurp(pb.ibdev_dir + "/node_type"), "1: CA");
  EXPECT_EQ(list_devices(home_), std::vector<std::string>{b});
}

// Each network namespace's view (what `shmrdma run` gives as SYSFS_PATH)
// links every InfiniBand device and the RoCE devices bound to that namespace
// only; `up` and `down` keep the views that exist current.
TEST_F(DeviceSetupTest, NetnsViewsListTheirNamespacesDevices) {
  const std::string ib = fresh(), roce = fresh();
  ASSERT_EQ(up(ib), 0);
  RoceSpec spec;
  spec.binding = layout::NetBinding{};
  spec.binding.link_layer = layout::kLinkLayerEthernet;
  spec.binding.gid_layout = layout::kGidLayoutRxe;
  spec.binding.netns_dev = 3;
  spec.binding.netns_ino = 4026530001;
  spec.binding.ifindex = 7;
  const uint8_t mac[6] = {0x02, 0, 0, 0, 0, 0x42};
  std::memcpy(spec.binding.mac, mac, 6);
  std::snprintf(spec.binding.ifname, sizeof spec.binding.ifname, "vethX");
  UpResult r;
  std::string why;
  ASSERT_EQ(device_up(home_, roce, 0, &r, &why, &spec), 0) << why;
  auto listed = [&](uint64_t dev, uint64_t ino) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(netns_view_root(home_, dev, ino) + "/class/infiniband"))
      names.insert(e.path().filename().string());
    return names;
  };
  ASSERT_EQ(sync_netns_view(home_, 3, 4026530001, &why), 0) << why;
  ASSERT_EQ(sync_netns_view(home_, 3, 4026530002, &why), 0) << why;
  EXPECT_EQ(listed(3, 4026530001), (std::set<std::string>{ib, roce}));
  EXPECT_EQ(listed(3, 4026530002), std::set<std::string>{ib});
  // The links lead to the live tree, uverbs entries included, as libibverbs reads it.
  const std::string own = netns_view_root(home_, 3, 4026530001);
  const DevicePaths pr = device_paths(home_, roce);
  EXPECT_EQ(slurp(own + "/class/infiniband_verbs/abi_version"), "6");
  EXPECT_EQ(slurp(own + "/class/infiniband_verbs/" + pr.uverbs_name + "/ibdev"), roce);
  EXPECT_EQ(slurp(own + "/class/infiniband/" + roce + "/ports/1/link_layer"), "Ethernet");
  EXPECT_FALSE(fs::exists(netns_view_root(home_, 3, 4026530002) + "/class/infiniband_verbs/" + pr.uverbs_name));
  // A device that comes up shows in every view (IB), one that goes down leaves them.
  const std::string ib2 = fresh();
  ASSERT_EQ(up(ib2), 0);
  EXPECT_EQ(listed(3, 4026530002), (std::set<std::string>{ib, ib2}));
  ASSERT_EQ(device_down(home_, roce, true, &why), 0) << why;
  EXPECT_EQ(listed(3, 4026530001), (std::set<std::string>{ib, ib2}));
  std::error_code ec;
  EXPECT_FALSE(fs::is_symlink(own + "/class/infiniband_verbs/" + pr.uverbs_name, ec)) << "a link to a device gone";
  EXPECT_TRUE(visible_in_netns(layout::NetBinding{}, 1, 2)) << "an InfiniBand device is listed everywhere";
}

TEST_F(DeviceSetupTest, ListDevices) {
  EXPECT_TRUE(list_devices(home_).empty());
  EXPECT_TRUE(list_devices(home_ + "/missing").empty());
  std::string a = fresh(), b = fresh();
  ASSERT_EQ(up(b), 0);
  ASSERT_EQ(up(a), 0);
  std::vector<std::string> want{a, b};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(list_devices(home_), want);
  // Directories without a registry, or with names that are not device
  // names, are not devices.
    fs::create_directories(home_ + "/devices/empty");
  fs::create_directories(home_ + "/devices/myrxe0");
  std::ofstream(home_ + "/devices/myrxe0/registry") << "x";
  fs::create_directories(home_ + "/devices/.hidden");
  std::ofstream(home_ + "/devices/.hidden/registry") << "x";
  EXPECT_EQ(list_devices(home_), want);
}

TEST_F(DeviceSetupTest, GuidString) {
  EXPECT_EQ(guid_string(0), "0000:0000:0000:0000");
  EXPECT_EQ(guid_string(0x0211223344556600ull), "0211:2233:4455:6600");
  EXPECT_EQ(guid_string(~0ull), "ffff:ffff:ffff:ffff");
}

TEST_F(DeviceSetupTest, ValidDeviceName) {
  std::string why;
  EXPECT_TRUE(valid_device_name("shm0", &why));
  EXPECT_TRUE(valid_device_name("a_b-C9", nullptr));
  EXPECT_FALSE(valid_device_name("", &why));
  EXPECT_FALSE(why.empty());
  EXPECT_FALSE(valid_device_name("xrxe", nullptr));
  EXPECT_FALSE(valid_device_name("-a", nullptr));
  EXPECT_FALSE(valid_device_name(std::string(32, 'a'), nullptr));
  EXPECT_TRUE(valid_device_name(std::string(31, 'a'), nullptr));
}

}  // namespace
}  // namespace shmrdma
