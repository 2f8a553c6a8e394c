// Memory per idle RC QP, through the stock libibverbs (run under
// `shmrdma run`): creates N RC QPs with the queue sizes stock perftest asks
// for and prints the growth of this process's resident memory per QP. The
// resident set includes the pages of the shared context segment the QPs
// touched (their rings), since the segment is mapped here too.
//
// Output lines "<name> <value>":
//   qp_mem_bytes_write_bw  (ib_write_bw defaults: TX depth 128, RX 1, 1 SGE, no inline)
//   qp_mem_bytes_send_bw   (ib_send_bw defaults: TX depth 128, RX depth 512)
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

enum { kQps = 64 };

static long resident_bytes(void) {
  FILE* f = fopen("/proc/self/statm", "r");
  long size = 0, resident = 0;
  if (!f) return -1;
  if (fscanf(f, "%ld %ld", &size, &resident) != 2) resident = -1;
  fclose(f);
  return resident < 0 ? -1 : resident * sysconf(_SC_PAGESIZE);
}

static int measure(struct ibv_pd* pd, struct ibv_cq* cq, uint32_t send_wr, uint32_t recv_wr, const char* name) {
  struct ibv_qp* qps[kQps];
  struct ibv_qp_init_attr a = {0};
  a.send_cq = cq;
  a.recv_cq = cq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = send_wr;
  a.cap.max_recv_wr = recv_wr;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
  a.cap.max_inline_data = 0;
  // One QP first, so one-time costs (first use of the tables) are not counted.
  struct ibv_qp* warm = ibv_create_qp(pd, &a);
  if (!warm) {
    perror("ibv_create_qp");
    return 1;
  }
  long before = resident_bytes();
  int n = 0;
  for (; n < kQps; ++n) {
    qps[n] = ibv_create_qp(pd, &a);
    if (!qps[n]) {
      perror("ibv_create_qp");
      break;
    }
  }
  long after = resident_bytes();
  if (n == kQps && before > 0 && after > 0) printf("%s %ld\n", name, (after - before) / kQps);
  for (int i = 0; i < n; ++i) ibv_destroy_qp(qps[i]);
  ibv_destroy_qp(warm);
  return n == kQps ? 0 : 1;
}

int main(void) {
  int num = 0;
  struct ibv_device** list = ibv_get_device_list(&num);
  if (!list || num < 1) {
    fprintf(stderr, "no RDMA device (run under shmrdma run)\n");
    return 1;
  }
  struct ibv_context* ctx = ibv_open_device(list[0]);
  if (!ctx) {
    perror("ibv_open_device");
    return 1;
  }
  struct ibv_pd* pd = ibv_alloc_pd(ctx);
  struct ibv_cq* cq = pd ? ibv_create_cq(ctx, 4096, NULL, NULL, 0) : NULL;
  if (!cq) {
    perror("ibv_alloc_pd/ibv_create_cq");
    return 1;
  }
  int rc = measure(pd, cq, 128, 1, "qp_mem_bytes_write_bw");
  rc |= measure(pd, cq, 128, 512, "qp_mem_bytes_send_bw");
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  return rc;
}
