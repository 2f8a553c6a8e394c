/* MPI ping-pong between ranks 0 and 1 (bench/run.py, "mpi" rows): half
 * round-trip latency and one-way streaming bandwidth at one message size.
 *
 *   mpirun -np 2 mpi_pingpong SIZE ITERS
 *
 * Each rank pins itself to the rank-th CPU it is allowed on (run mpirun under
 * `taskset -c A,B` with --bind-to none). Latency: ITERS round trips in 10
 * batches after a warm-up, the median batch's mean half round trip.
 * Bandwidth: rank 0 sends windows of 64 nonblocking messages, rank 1 answers
 * each window with a 1-byte message; the median of 10 batches. Prints
 *   mpi_pingpong bytes=S iters=N lat_us=L bw_GBps=B
 * Compiled by the harness with mpicc into bench/.build/ (skipped without it). */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_util.h"

enum { kBatches = 10, kWindow = 64 };

static void pin(int rank) {
  cpu_set_t set, one;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return;
  int seen = 0;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set) && seen++ == rank) {
      CPU_ZERO(&one);
      CPU_SET(c, &one);
      sched_setaffinity(0, sizeof one, &one);
      return;
    }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != 2 || argc < 3) {
    if (rank == 0) fprintf(stderr, "usage: mpirun -np 2 mpi_pingpong SIZE ITERS\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  pin(rank);
  size_t size = strtoull(argv[1], NULL, 0);
  long iters = strtol(argv[2], NULL, 0);
  if (iters < kBatches) iters = kBatches;
  char* buf = malloc(size ? size : 1);
  char ack = 0;
  memset(buf, rank + 1, size ? size : 1);
  const int peer = 1 - rank;
  long per = iters / kBatches;
  double lat[kBatches], bw[kBatches];
  for (long i = 0; i < per / 10 + 10; ++i) { /* warm-up */
    if (rank == 0) {
      MPI_Send(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
      MPI_Recv(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
      MPI_Recv(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Send(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
    }
  }
  for (int b = 0; b < kBatches; ++b) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (long i = 0; i < per; ++i) {
      if (rank == 0) {
        MPI_Send(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
        MPI_Recv(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
      }
    }
    lat[b] = (MPI_Wtime() - t0) / per / 2 * 1e6;
  }
  MPI_Request req[kWindow];
  long windows = per / kWindow + 1;
  for (int b = 0; b < kBatches; ++b) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (long w = 0; w < windows; ++w) {
      for (int k = 0; k < kWindow; ++k) {
        if (rank == 0)
          MPI_Isend(buf, (int)size, MPI_BYTE, peer, 1, MPI_COMM_WORLD, &req[k]);
        else
          MPI_Irecv(buf, (int)size, MPI_BYTE, peer, 1, MPI_COMM_WORLD, &req[k]);
      }
      MPI_Waitall(kWindow, req, MPI_STATUSES_IGNORE);
      if (rank == 0)
        MPI_Recv(&ack, 1, MPI_BYTE, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      else
        MPI_Send(&ack, 1, MPI_BYTE, peer, 2, MPI_COMM_WORLD);
    }
    double dt = MPI_Wtime() - t0;
    bw[b] = (double)size * kWindow * windows / dt / 1e9;
  }
  if (rank == 0) {
    qsort(lat, kBatches, sizeof lat[0], probe_cmp_double);
    qsort(bw, kBatches, sizeof bw[0], probe_cmp_double);
    printf("mpi_pingpong bytes=%zu iters=%ld lat_us=%.4f bw_GBps=%.4f\n", size, per * kBatches, lat[kBatches / 2],
           bw[kBatches / 2]);
  }
  free(buf);
  MPI_Finalize();
  return 0;
}
