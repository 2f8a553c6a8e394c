// wq_demo: a standalone program over the public libibverbs API that walks
// through the life of receive work queues on shm0.
//
//   opens shm0, allocates a PD, creates a CQ and a WQ (max_wr 100, max_sge 3,
//   handed back as 128 and 4), moves it RESET->RDY, posts 128 receives (the
//   129th fails with ENOMEM and *bad_wr pointing at it), creates 3 more WQs
//   and an indirection table over the 4, checks that PD, CQ and WQ refuse to
//   be destroyed while in use (EBUSY), then (with --hold) prints
//   "READY <pid>" and waits for a line on stdin or SIGTERM, then destroys
//   everything in reverse order and prints "OK".
//
// Exit status 0 on success; 1 with a message on stderr on any failed check.
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

[[noreturn]] void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "wq_demo: FAILED: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::exit(1);
}

// Blocks until a line (or EOF) arrives on stdin, or SIGTERM. SIGTERM is
// blocked and read from a signalfd, not caught by a handler: under TSan a
// handler runs only when the thread passes one of TSan's interception
// points, and a SIGTERM that arrived just before poll() blocked waited there
// for good (WqDemo.SigtermReleasesHold hung about one run in eight).
void hold() {
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  if (::sigprocmask(SIG_BLOCK, &term, nullptr) != 0) die("sigprocmask: %s", std::strerror(errno));
  const int sfd = ::signalfd(-1, &term, SFD_CLOEXEC);
  if (sfd < 0) die("signalfd: %s", std::strerror(errno));
  std::printf("READY %d\n", static_cast<int>(::getpid()));
  std::fflush(stdout);
  pollfd fds[2] = {{0, POLLIN, 0}, {sfd, POLLIN, 0}};
  for (;;) {
    int n = ::poll(fds, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die("poll: %s", std::strerror(errno));
    if (fds[1].revents) {  // SIGTERM
      signalfd_siginfo si;
      (void)!::read(sfd, &si, sizeof si);
      ::close(sfd);
      return;
    }
    if (fds[0].revents) {
      char c;
      ssize_t k = ::read(0, &c, 1);
      if (k <= 0 || c == '\n') {  // a full line, or EOF
        ::close(sfd);
        return;
      }
    }
  }
}

ibv_wq* make_wq(ibv_context* ctx, ibv_pd* pd, ibv_cq* cq, uint32_t max_wr, uint32_t max_sge, uint32_t want_wr,
                uint32_t want_sge) {
  ibv_wq_init_attr a{};
  a.wq_type = IBV_WQT_RQ;
  a.max_wr = max_wr;
  a.max_sge = max_sge;
  a.pd = pd;
  a.cq = cq;
  ibv_wq* wq = ibv_create_wq(ctx, &a);
  if (!wq) die("ibv_create_wq(max_wr %u, max_sge %u): %s", max_wr, max_sge, std::strerror(errno));
  if (a.max_wr != want_wr || a.max_sge != want_sge)
    die("ibv_create_wq(max_wr %u, max_sge %u) handed back max_wr %u, max_sge %u; expected %u, %u", max_wr, max_sge,
        a.max_wr, a.max_sge, want_wr, want_sge);
  if (wq->state != IBV_WQS_RESET) die("a new WQ is in state %d, expected RESET", wq->state);
  return wq;
}

}  // namespace

int main(int argc, char** argv) {
  bool hold_flag = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--hold") == 0) {
      hold_flag = true;
    } else {
      std::fprintf(stderr, "usage: wq_demo [--hold]\n");
      return 2;
    }
  }

  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (!list) die("ibv_get_device_list: %s", std::strerror(errno));
  ibv_device* dev = nullptr;
  for (int i = 0; i < num; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "shm0") == 0) dev = list[i];
  if (!dev) die("device shm0 not found among %d device(s) (run under `shmrdma run`)", num);
  ibv_context* ctx = ibv_open_device(dev);
  if (!ctx) die("ibv_open_device(shm0): %s", std::strerror(errno));
  ibv_free_device_list(list);

  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (!pd) die("ibv_alloc_pd: %s", std::strerror(errno));
  ibv_cq* cq = ibv_create_cq(ctx, 256, nullptr, nullptr, 0);
  if (!cq) die("ibv_create_cq(256): %s", std::strerror(errno));
  if (cq->cqe < 256) die("ibv_create_cq(256) gave cqe %d", cq->cqe);

  ibv_wq* wqs[4];
  wqs[0] = make_wq(ctx, pd, cq, 100, 3, 128, 4);

  ibv_wq_attr mod{};
  mod.attr_mask = IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_CURR_STATE;
  mod.curr_wq_state = IBV_WQS_RESET;
  mod.wq_state = IBV_WQS_RDY;
  if (int rc = ibv_modify_wq(wqs[0], &mod)) die("ibv_modify_wq RESET->RDY: %s", std::strerror(rc));
  if (wqs[0]->state != IBV_WQS_RDY) die("after RESET->RDY wq->state is %d", wqs[0]->state);

  // 128 receives: the first 64 one per call, the next 64 as one chain.
  static char buffers[129][64];
  ibv_sge sges[129];
  ibv_recv_wr wrs[129];
  for (int i = 0; i < 129; ++i) {
    sges[i] = ibv_sge{reinterpret_cast<uintptr_t>(buffers[i]), sizeof buffers[i], 0};
    wrs[i] = ibv_recv_wr{};
    wrs[i].wr_id = 0x1000 + static_cast<uint64_t>(i);
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
  }
  for (int i = 0; i < 64; ++i) {
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_wq_recv(wqs[0], &wrs[i], &bad)) die("ibv_post_wq_recv #%d: %s", i + 1, std::strerror(rc));
  }
  for (int i = 64; i < 127; ++i) wrs[i].next = &wrs[i + 1];
  {
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_wq_recv(wqs[0], &wrs[64], &bad))
      die("ibv_post_wq_recv of a chain of 64 (#65..#128): %s, bad_wr is #%ld", std::strerror(rc),
          bad ? static_cast<long>(bad - wrs) + 1 : -1L);
  }
  {
    ibv_recv_wr* bad = nullptr;
    int rc = ibv_post_wq_recv(wqs[0], &wrs[128], &bad);
    if (rc != ENOMEM) die("ibv_post_wq_recv #129 on a full WQ returned %d (%s), expected ENOMEM", rc, std::strerror(rc));
    if (bad != &wrs[128]) die("ibv_post_wq_recv #129: *bad_wr does not point at the failed WR");
  }

  for (int i = 1; i < 4; ++i) wqs[i] = make_wq(ctx, pd, cq, 16, 1, 16, 1);

  ibv_rwq_ind_table_init_attr ia{};
  ia.log_ind_tbl_size = 2;
  ia.ind_tbl = wqs;
  ibv_rwq_ind_table* ind = ibv_create_rwq_ind_table(ctx, &ia);
  if (!ind) die("ibv_create_rwq_ind_table(log size 2, 4 WQs): %s", std::strerror(errno));

  if (int rc = ibv_dealloc_pd(pd); rc != EBUSY)
    die("ibv_dealloc_pd while 4 WQs use the PD returned %d (%s), expected EBUSY", rc, std::strerror(rc));
  if (int rc = ibv_destroy_cq(cq); rc != EBUSY)
    die("ibv_destroy_cq while 4 WQs use the CQ returned %d (%s), expected EBUSY", rc, std::strerror(rc));
  if (int rc = ibv_destroy_wq(wqs[0]); rc != EBUSY)
    die("ibv_destroy_wq of a WQ in an indirection table returned %d (%s), expected EBUSY", rc, std::strerror(rc));

  if (hold_flag) hold();

  if (int rc = ibv_destroy_rwq_ind_table(ind)) die("ibv_destroy_rwq_ind_table: %s", std::strerror(rc));
  for (int i = 3; i >= 0; --i)
    if (int rc = ibv_destroy_wq(wqs[i])) die("ibv_destroy_wq(WQ %d): %s", i, std::strerror(rc));
  if (int rc = ibv_destroy_cq(cq)) die("ibv_destroy_cq: %s", std::strerror(rc));
  if (int rc = ibv_dealloc_pd(pd)) die("ibv_dealloc_pd: %s", std::strerror(rc));
  if (ibv_close_device(ctx) != 0) die("ibv_close_device: %s", std::strerror(errno));
  std::printf("OK\n");
  return 0;
}
