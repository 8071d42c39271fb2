/*
 * The host cost of the C entry points, on oxccl's CPU target (OXCCL_NCCL_TARGET=cpu): one
 * ncclCommInitAll of 2 ranks, then ITERS groups of (ncclGroupStart, one ncclAllReduce of count 0
 * per rank, ncclGroupEnd), and ITERS times the same two calls ungrouped. A call of count 0 is
 * checked and recorded and launches nothing, so what is timed is the library's own work per
 * call. The Rust side of the comparison is `benches/group_overhead.rs`, which builds and runs
 * this program:
 *
 *   group_overhead ITERS   ->   "grouped WALL CPU" and "plain WALL CPU" lines: ns per group of
 *                                2 calls, of wall time and of the thread's CPU time
 *
 * (The CPU time is what a machine shared with other work measures steadily.)
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "nccl.h"

#define NRANKS 2

#define NCCLCHECK(cmd)                                                                        \
  do {                                                                                        \
    ncclResult_t r_ = (cmd);                                                                  \
    if (r_ != ncclSuccess) {                                                                  \
      fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #cmd, (int)r_,       \
              ncclGetLastError(NULL));                                                        \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

static double now_ns(clockid_t clock) {
  struct timespec t;
  clock_gettime(clock, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static ncclComm_t comms[NRANKS];
static float buf[NRANKS][1];

static void one(int grouped) {
  if (grouped) NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NRANKS; r++)
    NCCLCHECK(ncclAllReduce(buf[r], buf[r], 0, ncclFloat, ncclSum, comms[r], NULL));
  if (grouped) NCCLCHECK(ncclGroupEnd());
}

int main(int argc, char** argv) {
  long iters = argc > 1 ? atol(argv[1]) : 300000;
  if (iters <= 0) {
    fprintf(stderr, "usage: %s [ITERS > 0]\n", argv[0]);
    return 2;
  }
  NCCLCHECK(ncclCommInitAll(comms, NRANKS, NULL));
  for (int grouped = 1; grouped >= 0; grouped--) {
    for (long i = 0; i < iters / 10; i++) one(grouped); /* warm-up */
    double t0 = now_ns(CLOCK_MONOTONIC), c0 = now_ns(CLOCK_THREAD_CPUTIME_ID);
    for (long i = 0; i < iters; i++) one(grouped);
    double t1 = now_ns(CLOCK_MONOTONIC), c1 = now_ns(CLOCK_THREAD_CPUTIME_ID);
    printf("%s %.1f %.1f\n", grouped ? "grouped" : "plain", (t1 - t0) / (double)iters, (c1 - c0) / (double)iters);
  }
  for (int r = 0; r < NRANKS; r++) NCCLCHECK(ncclCommDestroy(comms[r]));
  return 0;
}
