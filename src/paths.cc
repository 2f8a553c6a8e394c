#include "paths.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace shmrdma {

std::string state_home() {
  if (const char* h = std::getenv("SHMRDMA_HOME"); h && *h) return h;
  if (::geteuid() == 0) return "/run/shmrdma";
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x && *x) return std::string(x) + "/shmrdma";
  return "/tmp/shmrdma-" + std::to_string(::getuid());
}

DevicePaths device_paths(const std::string& home, const std::string& name) {
  DevicePaths p;
  p.home = home;
  p.name = name;
  p.sysfs_root = home + "/sys";
  // The device node lives in the machine-wide /dev/infiniband: its name
  // carries a hash of the home so devices of different homes (users, test
  // runs) never share or remove each other's node.
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char c : home) h = (h ^ c) * 16777619u;
  char tag[16];
  std::snprintf(tag, sizeof tag, "%08x", h);
  p.uverbs_name = "shmrdma_" + name + "_" + tag;
  p.uverbs_dir = p.sysfs_root + "/class/infiniband_verbs/" + p.uverbs_name;
  p.ibdev_dir = p.sysfs_root + "/class/infiniband/" + name;
  p.device_dir = home + "/devices/" + name;
  p.registry = p.device_dir + "/registry";
  p.cdev = "/dev/infiniband/" + p.uverbs_name;
  return p;
}

bool valid_device_name(const std::string& name, std::string* why) {
  auto fail = [&](const char* msg) {
    if (why) *why = msg;
    return false;
  };
  if (name.empty() || name.size() > 31) return fail("must be 1 to 31 characters long");
  if (name[0] == '-') return fail("must not start with '-'");
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-';
    if (!ok) return fail("may only contain letters, digits, '_' and '-'");
  }
  if (name.find("rxe") != std::string::npos)
    return fail("must not contain \"rxe\" (the rxe provider would claim it)");
  return true;
}

}  // namespace shmrdma
