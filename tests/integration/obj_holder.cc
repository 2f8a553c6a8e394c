// obj_holder: a helper program for the multi-process tests (public libibverbs
// API only). It opens shm0, creates the objects it is told to, reports them
// and holds them until told to let go.
//
//   obj_holder [--pd N] [--cq N] [--wq N] [--max-wr M] [--rdy] [--go]
//
//   --go     after opening the device print "OPEN <pid>" and wait for a line
//            on stdin before creating anything (so several holders can be
//            released at the same moment)
//   --rdy    move every WQ to RDY
//
// Every WQ uses the first PD and the first CQ. After creating everything it
// prints "READY <pid> <pd> <cq> <wq> <wq_num>..." and waits for a line on
// stdin (or EOF), then destroys everything and prints "OK". If an allocation
// fails it prints "FAIL <what> <errno>" and exits 3 (the objects it had are
// released by process exit). Other failures: message on stderr, exit 1.
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// What the program holds, in static storage: a failed allocation exits with
// everything still held (process exit releases it), and LeakSanitizer counts
// only memory no root reaches, whatever the compiler kept in registers.
ibv_context* ctx = nullptr;
std::vector<ibv_pd*> pds;
std::vector<ibv_cq*> cqs;
std::vector<ibv_wq*> wqs;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "obj_holder: FAILED: %s\n", msg.c_str());
  std::exit(1);
}

[[noreturn]] void alloc_failed(const char* what, int err) {
  std::printf("FAIL %s %d\n", what, err);
  std::fflush(stdout);
  std::fprintf(stderr, "obj_holder: %s: %s\n", what, std::strerror(err));
  std::exit(3);
}

void wait_line() {
  char c;
  for (;;) {
    ssize_t k = ::read(0, &c, 1);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0 || c == '\n') return;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int n_pd = 0, n_cq = 0, n_wq = 0;
  uint32_t max_wr = 8;
  bool go = false, rdy = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> long {
      if (i + 1 >= argc) die("missing value after " + a);
      return std::strtol(argv[++i], nullptr, 10);
    };
    if (a == "--pd") n_pd = static_cast<int>(next());
    else if (a == "--cq") n_cq = static_cast<int>(next());
    else if (a == "--wq") n_wq = static_cast<int>(next());
    else if (a == "--max-wr") max_wr = static_cast<uint32_t>(next());
    else if (a == "--go") go = true;
    else if (a == "--rdy") rdy = true;
    else die("unknown argument " + a);
  }
  if (n_wq > 0 && (n_pd < 1 || n_cq < 1)) die("--wq needs at least one PD and one CQ");

  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (!list) die(std::string("ibv_get_device_list: ") + std::strerror(errno));
  ibv_device* dev = nullptr;
  for (int i = 0; i < num; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "shm0") == 0) dev = list[i];
  if (!dev) die("device shm0 not found");
  ctx = ibv_open_device(dev);
  if (!ctx) die(std::string("ibv_open_device: ") + std::strerror(errno));
  ibv_free_device_list(list);

  if (go) {
    std::printf("OPEN %d\n", static_cast<int>(::getpid()));
    std::fflush(stdout);
    wait_line();
  }

  for (int i = 0; i < n_pd; ++i) {
    ibv_pd* pd = ibv_alloc_pd(ctx);
    if (!pd) alloc_failed("pd", errno);
    pds.push_back(pd);
  }
  for (int i = 0; i < n_cq; ++i) {
    ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
    if (!cq) alloc_failed("cq", errno);
    cqs.push_back(cq);
  }
  for (int i = 0; i < n_wq; ++i) {
    ibv_wq_init_attr a{};
    a.wq_type = IBV_WQT_RQ;
    a.max_wr = max_wr;
    a.max_sge = 1;
    a.pd = pds[0];
    a.cq = cqs[0];
    ibv_wq* wq = ibv_create_wq(ctx, &a);
    if (!wq) alloc_failed("wq", errno);
    wqs.push_back(wq);
    if (rdy) {
      ibv_wq_attr m{};
      m.attr_mask = IBV_WQ_ATTR_STATE;
      m.wq_state = IBV_WQS_RDY;
      if (int rc = ibv_modify_wq(wq, &m)) die(std::string("ibv_modify_wq RESET->RDY: ") + std::strerror(rc));
    }
  }

  std::printf("READY %d %zu %zu %zu", static_cast<int>(::getpid()), pds.size(), cqs.size(), wqs.size());
  for (ibv_wq* w : wqs) std::printf(" %u", w->wq_num);
  std::printf("\n");
  std::fflush(stdout);
  wait_line();

  for (auto it = wqs.rbegin(); it != wqs.rend(); ++it)
    if (int rc = ibv_destroy_wq(*it)) die(std::string("ibv_destroy_wq: ") + std::strerror(rc));
  for (ibv_cq* cq : cqs)
    if (int rc = ibv_destroy_cq(cq)) die(std::string("ibv_destroy_cq: ") + std::strerror(rc));
  for (ibv_pd* pd : pds)
    if (int rc = ibv_dealloc_pd(pd)) die(std::string("ibv_dealloc_pd: ") + std::strerror(rc));
  if (ibv_close_device(ctx) != 0) die(std::string("ibv_close_device: ") + std::strerror(errno));
  std::printf("OK\n");
  return 0;
}
