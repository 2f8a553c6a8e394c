// The device directory of a state home (src/directory.h): home ids, LID
// resolution across devices, devices that go away or are recreated.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "device_setup.h"
#include "directory.h"
#include "registry.h"

namespace fs = std::filesystem;
using namespace shmrdma;

namespace {

class DirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shmrdma-ut-dir-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    home_ = tmpl;
    tag_ = std::to_string(::getpid());
  }
  void TearDown() override {
    std::string why;
    for (const auto& n : names_) device_down(home_, n, true, &why);
    fs::remove_all(home_);
  }
  std::string up(const std::string& base, uint32_t ports = 1) {
    const std::string name = base + tag_;
    UpResult r;
    std::string why;
    EXPECT_EQ(device_up(home_, name, ports, &r, &why), 0) << why;
    names_.push_back(name);
    return name;
  }
  Registry attach(const std::string& name) {
    Registry r;
    EXPECT_EQ(Registry::attach(device_paths(home_, name), &r), 0);
    return r;
  }
  std::string home_, tag_;
  std::vector<std::string> names_;
};

TEST_F(DirectoryTest, HomeIdsAreUniqueAndNonZero) {
  const std::string a = up("dA"), b = up("dB"), c = up("dC");
  const uint32_t ia = attach(a).device().home_id, ib = attach(b).device().home_id, ic = attach(c).device().home_id;
  EXPECT_NE(ia, 0u);
  EXPECT_NE(ib, 0u);
  EXPECT_NE(ic, 0u);
  EXPECT_NE(ia, ib);
  EXPECT_NE(ib, ic);
  EXPECT_NE(ia, ic);
  // A device brought down frees its id for the next one.
  std::string why;
  ASSERT_EQ(device_down(home_, b, true, &why), 0) << why;
  const std::string d = up("dD");
  EXPECT_EQ(attach(d).device().home_id, ib);
}

TEST_F(DirectoryTest, LidsResolveToTheirDeviceAndPort) {
  const std::string a = up("dA"), b = up("dB", 2);
  Registry ra = attach(a), rb = attach(b);
  DeviceDirectory dir;
  dir.init(home_, &ra);
  ASSERT_NE(dir.self(), nullptr);
  uint32_t port = 0;
  EXPECT_EQ(dir.by_lid(ra.device().ports[0].lid, &port), dir.self());
  EXPECT_EQ(port, 1u);
  HomeDevice* d = dir.by_lid(rb.device().ports[1].lid, &port);
  ASSERT_NE(d, nullptr);
  EXPECT_FALSE(d->self);
  EXPECT_EQ(port, 2u);
  EXPECT_EQ(d->home_id, rb.device().home_id);
  EXPECT_EQ(dir.by_id(rb.device().home_id), d);
  EXPECT_EQ(dir.by_lid(0, &port), nullptr);       // LID 0: no address
  EXPECT_EQ(dir.by_lid(0xc001, &port), nullptr);  // multicast: not a port
  EXPECT_EQ(dir.by_lid(0x7777, &port), nullptr);  // nobody's
}

TEST_F(DirectoryTest, ADeviceThatWentAwayOrWasRecreatedIsLookedUpAgain) {
  const std::string a = up("dA"), b = up("dB");
  Registry ra = attach(a);
  const uint16_t lid_b = attach(b).device().ports[0].lid;
  DeviceDirectory dir;
  dir.init(home_, &ra);
  uint32_t port = 0;
  HomeDevice* old = dir.by_lid(lid_b, &port);
  ASSERT_NE(old, nullptr);
  std::string why;
  ASSERT_EQ(device_down(home_, b, true, &why), 0) << why;
  ::usleep(20000);  // past the rescan interval
  dir.rescan(true);
  EXPECT_TRUE(old->gone.load());
  EXPECT_EQ(dir.by_lid(lid_b, &port), nullptr);
  // Up again under the same name: a new registry file, a new entry.
  UpResult r;
  ASSERT_EQ(device_up(home_, b, 1, &r, &why), 0) << why;
  dir.rescan(true);
  HomeDevice* now = dir.by_lid(attach(b).device().ports[0].lid, &port);
  ASSERT_NE(now, nullptr);
  EXPECT_NE(now, old);
  EXPECT_FALSE(now->gone.load());
}

}  // namespace
