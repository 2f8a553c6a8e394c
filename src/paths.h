// Where a device lives on disk. Everything of one user's devices is below one
// state directory ("home"):
//   <home>/sys/...                 the sysfs tree libibverbs reads (SYSFS_PATH)
//   <home>/devices/<name>/registry the device's registry segment
//   <home>/devices/<name>/ctx-*    one segment per open verbs context
// and the character device node is /dev/infiniband/shmrdma_<name>_<hash of home>.
#pragma once

#include <string>

namespace shmrdma {

// $SHMRDMA_HOME, else /run/shmrdma for root, else $XDG_RUNTIME_DIR/shmrdma,
// else /tmp/shmrdma-<uid>.
std::string state_home();

struct DevicePaths {
  std::string home;
  std::string name;          // ibdev name, e.g. "shm0"
  std::string sysfs_root;    // <home>/sys
  std::string uverbs_name;   // shmrdma_<name>_<hash>: sysfs class/infiniband_verbs entry
  std::string uverbs_dir;    // <sysfs_root>/class/infiniband_verbs/<uverbs_name>
  std::string ibdev_dir;     // <sysfs_root>/class/infiniband/<name>
  std::string device_dir;    // <home>/devices/<name>
  std::string registry;      // <device_dir>/registry
  std::string cdev;          // /dev/infiniband/<uverbs_name>
};

DevicePaths device_paths(const std::string& home, const std::string& name);

// A device name is 1..31 characters of [A-Za-z0-9_-], must not contain "rxe"
// (the rxe provider claims any such name) and must not start with '-'.
bool valid_device_name(const std::string& name, std::string* why);

// The file below the ibdev sysfs directory that holds the state home;
// it is how the plugin finds its registry from what libibverbs tells it.
inline constexpr const char* kHomeFile = "shmrdma_home";

}  // namespace shmrdma
