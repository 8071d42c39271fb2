/*
 * oxccl's libnccl.so.2 driven by a C program, on one GPU (for the GPU machine; run.sh builds and
 * runs it). One process creates 2 ranks on GPU 0 the way nccl-tests does (ncclGroupStart, one
 * ncclCommInitRank per rank, ncclGroupEnd; OXCCL_ALLOW_SHARED_DEVICE=1 lets two ranks share the
 * GPU), then checks exact results of:
 *   1. ncclAllReduce (float, sum), out of place and in place;
 *   2. ncclSend/ncclRecv between the ranks, both directions, in one group;
 *   3. ncclAlltoAll;
 *   4. an ncclAllReduce group and a Send/Recv group captured into a CUDA graph per rank
 *      (cudaStreamBeginCapture, thread-local mode, one thread capturing both ranks' streams),
 *      replayed three times with new inputs written between the replays;
 *   5. the caller's current context after calls, grouped and not, with the primary context
 *      current and with none (NCCL gives the caller back the device it found);
 * and prints "C-ABI OK" (exit 0) or what was wrong (exit 1).
 *
 * Rules for two ranks sharing one GPU (README: OXCCL_ALLOW_SHARED_DEVICE): each rank's kernel
 * waits for the other's, so every rank gets its own non-blocking stream (on the legacy default
 * stream the second kernel would queue behind the first forever), every call is issued on both
 * ranks before the next call on either, and memory is allocated and copied only while no
 * collective is in flight (after both streams are synchronized).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>
#include <cuda_runtime.h>

#include "nccl.h"

#define NRANKS 2
#define AR_COUNT (1 << 20)  /* floats per rank: 4 MiB */
#define P2P_COUNT (1 << 18) /* floats per direction: 1 MiB */
#define A2A_COUNT (1 << 16) /* floats per rank pair: 256 KiB */

static int failures = 0;

#define CUDACHECK(cmd)                                                                        \
  do {                                                                                        \
    cudaError_t e_ = (cmd);                                                                   \
    if (e_ != cudaSuccess) {                                                                  \
      printf("C-ABI FAILED: %s:%d: %s: %s\n", __FILE__, __LINE__, #cmd, cudaGetErrorString(e_)); \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

#define CUCHECK(cmd)                                                                          \
  do {                                                                                        \
    CUresult e_ = (cmd);                                                                      \
    if (e_ != CUDA_SUCCESS) {                                                                 \
      printf("C-ABI FAILED: %s:%d: %s returned %d\n", __FILE__, __LINE__, #cmd, (int)e_);       \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

#define NCCLCHECK(cmd)                                                                        \
  do {                                                                                        \
    ncclResult_t r_ = (cmd);                                                                  \
    if (r_ != ncclSuccess) {                                                                  \
      printf("C-ABI FAILED: %s:%d: %s returned %d (%s): %s\n", __FILE__, __LINE__, #cmd, (int)r_, \
             ncclGetErrorString(r_), ncclGetLastError(NULL));                                 \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

/* Compares n floats of got with want; reports the first few mismatches under `what`. */
static void check(const char* what, int rank, const float* got, const float* want, size_t n) {
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) {
    if (got[i] != want[i]) {
      if (wrong < 3) {
        printf("%s: rank %d element %zu is %g, expected %g\n", what, rank, i, (double)got[i], (double)want[i]);
      }
      wrong++;
    }
  }
  if (wrong) {
    printf("%s: rank %d: %zu of %zu elements wrong\n", what, rank, wrong, n);
    failures++;
  }
}

static float* device_copy(const float* host, size_t n) {
  float* d = NULL;
  CUDACHECK(cudaMalloc((void**)&d, n * sizeof(float)));
  CUDACHECK(cudaMemcpy(d, host, n * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

static float* device_fill(size_t n, unsigned char byte) {
  float* d = NULL;
  CUDACHECK(cudaMalloc((void**)&d, n * sizeof(float)));
  CUDACHECK(cudaMemset(d, byte, n * sizeof(float)));
  return d;
}

static void to_host(float* host, const float* dev, size_t n) {
  CUDACHECK(cudaMemcpy(host, dev, n * sizeof(float), cudaMemcpyDeviceToHost));
}

/* Progress, so that a run that hangs shows where. */
static void step(const char* what) {
  printf("... %s\n", what);
  fflush(stdout);
}

static void sync_all(cudaStream_t* streams) {
  for (int r = 0; r < NRANKS; r++) CUDACHECK(cudaStreamSynchronize(streams[r]));
}

int main(void) {
  /* Two ranks on one GPU are oxccl's testing mode (NCCL refuses them). */
  setenv("OXCCL_ALLOW_SHARED_DEVICE", "1", 0);

  int version = 0;
  NCCLCHECK(ncclGetVersion(&version));
  printf("ncclGetVersion: %d (header: %d)\n", version, NCCL_VERSION_CODE);
  if (version != NCCL_VERSION_CODE) {
    printf("version mismatch\n");
    failures++;
  }
  if (ncclGroupEnd() != ncclInvalidUsage) {
    printf("ncclGroupEnd without ncclGroupStart did not return ncclInvalidUsage\n");
    failures++;
  }

  CUDACHECK(cudaSetDevice(0));
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));

  ncclComm_t comms[NRANKS];
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NRANKS; r++) {
    CUDACHECK(cudaSetDevice(0));
    NCCLCHECK(ncclCommInitRank(&comms[r], NRANKS, id, r));
  }
  NCCLCHECK(ncclGroupEnd());
  step("2 ranks created on GPU 0 (ncclGroupStart, 2 x ncclCommInitRank, ncclGroupEnd)");

  for (int r = 0; r < NRANKS; r++) {
    int count = -1, rank = -1, dev = -1;
    NCCLCHECK(ncclCommCount(comms[r], &count));
    NCCLCHECK(ncclCommUserRank(comms[r], &rank));
    NCCLCHECK(ncclCommCuDevice(comms[r], &dev));
    if (count != NRANKS || rank != r || dev != 0) {
      printf("rank %d: ncclCommCount %d, ncclCommUserRank %d, ncclCommCuDevice %d\n", r, count, rank, dev);
      failures++;
    }
  }

  cudaStream_t streams[NRANKS];
  for (int r = 0; r < NRANKS; r++) CUDACHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));

  /* Every buffer is made before the first collective. Values are small integers: every float
   * sum is exact in any order. */
  float* host = (float*)malloc(AR_COUNT * sizeof(float));
  float* want = (float*)malloc(AR_COUNT * sizeof(float));
  if (!host || !want) {
    printf("C-ABI FAILED: out of host memory\n");
    return 1;
  }
  float *ar_send[NRANKS], *ar_recv[NRANKS], *ar_inplace[NRANKS];
  float *p2p_send[NRANKS], *p2p_recv[NRANKS], *a2a_send[NRANKS], *a2a_recv[NRANKS];
  for (int r = 0; r < NRANKS; r++) {
    for (size_t i = 0; i < AR_COUNT; i++) host[i] = (float)((r + 1) * (int)(i % 1000));
    ar_send[r] = device_copy(host, AR_COUNT);
    ar_recv[r] = device_fill(AR_COUNT, 0xff); /* NaN until written */
    for (size_t i = 0; i < AR_COUNT; i++) host[i] = (float)(r + (int)(i % 777));
    ar_inplace[r] = device_copy(host, AR_COUNT);
    for (size_t i = 0; i < P2P_COUNT; i++) host[i] = (float)(10000 * (r + 1) + (int)(i % 5000));
    p2p_send[r] = device_copy(host, P2P_COUNT);
    p2p_recv[r] = device_fill(P2P_COUNT, 0xff);
    for (int p = 0; p < NRANKS; p++)
      for (size_t i = 0; i < A2A_COUNT; i++) host[p * A2A_COUNT + i] = (float)(100 * r + 10 * p + (int)(i % 7));
    a2a_send[r] = device_copy(host, (size_t)NRANKS * A2A_COUNT);
    a2a_recv[r] = device_fill((size_t)NRANKS * A2A_COUNT, 0xff);
  }

  /* The fills and copies above ran on the legacy default stream, which the ranks' non-blocking
   * streams do not wait for. */
  CUDACHECK(cudaDeviceSynchronize());

  /* 1. AllReduce, out of place then in place, both ranks' calls in one group. */
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NRANKS; r++)
    NCCLCHECK(ncclAllReduce(ar_send[r], ar_recv[r], AR_COUNT, ncclFloat, ncclSum, comms[r], streams[r]));
  NCCLCHECK(ncclGroupEnd());
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NRANKS; r++)
    NCCLCHECK(ncclAllReduce(ar_inplace[r], ar_inplace[r], AR_COUNT, ncclFloat, ncclSum, comms[r], streams[r]));
  NCCLCHECK(ncclGroupEnd());
  sync_all(streams);
  step("ncclAllReduce done");
  for (int r = 0; r < NRANKS; r++) {
    for (size_t i = 0; i < AR_COUNT; i++) want[i] = (float)(3 * (int)(i % 1000));
    to_host(host, ar_recv[r], AR_COUNT);
    check("ncclAllReduce", r, host, want, AR_COUNT);
    for (size_t i = 0; i < AR_COUNT; i++) want[i] = (float)(1 + 2 * (int)(i % 777));
    to_host(host, ar_inplace[r], AR_COUNT);
    check("ncclAllReduce (in place)", r, host, want, AR_COUNT);
  }

  /* 2. Send/Recv: each rank sends to the other and receives from it, in one group. */
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NRANKS; r++) {
    int peer = 1 - r;
    NCCLCHECK(ncclSend(p2p_send[r], P2P_COUNT, ncclFloat, peer, comms[r], streams[r]));
    NCCLCHECK(ncclRecv(p2p_recv[r], P2P_COUNT, ncclFloat, peer, comms[r], streams[r]));
  }
  NCCLCHECK(ncclGroupEnd());
  sync_all(streams);
  step("ncclSend/ncclRecv done");
  for (int r = 0; r < NRANKS; r++) {
    int peer = 1 - r;
    for (size_t i = 0; i < P2P_COUNT; i++) want[i] = (float)(10000 * (peer + 1) + (int)(i % 5000));
    to_host(host, p2p_recv[r], P2P_COUNT);
    check("ncclSend/ncclRecv", r, host, want, P2P_COUNT);
  }

  /* 3. AlltoAll: block p of rank r's input goes to rank p, into block r. */
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NRANKS; r++)
    NCCLCHECK(ncclAlltoAll(a2a_send[r], a2a_recv[r], A2A_COUNT, ncclFloat, comms[r], streams[r]));
  NCCLCHECK(ncclGroupEnd());
  sync_all(streams);
  step("ncclAlltoAll done");
  for (int r = 0; r < NRANKS; r++) {
    for (int p = 0; p < NRANKS; p++)
      for (size_t i = 0; i < A2A_COUNT; i++) want[p * A2A_COUNT + i] = (float)(100 * p + 10 * r + (int)(i % 7));
    to_host(host, a2a_recv[r], (size_t)NRANKS * A2A_COUNT);
    check("ncclAlltoAll", r, host, want, (size_t)NRANKS * A2A_COUNT);
  }

  /* 4. CUDA graphs: both ranks' calls captured on their streams, nothing run at the capture;
   * each replay reads the inputs written before it. A graph holds one rank's two kernels, so
   * the ranks' replays are synchronized one call at a time (two ranks share the GPU: a rank's
   * second kernel waiting behind its first could hold back the peer's first on a shared
   * hardware queue) — one graph per rank and call. */
  {
    cudaGraph_t graphs[2][NRANKS];
    cudaGraphExec_t execs[2][NRANKS];
    for (int call = 0; call < 2; call++) {
      for (int r = 0; r < NRANKS; r++)
        CUDACHECK(cudaStreamBeginCapture(streams[r], cudaStreamCaptureModeThreadLocal));
      NCCLCHECK(ncclGroupStart());
      for (int r = 0; r < NRANKS; r++) {
        if (call == 0) {
          NCCLCHECK(ncclAllReduce(ar_send[r], ar_recv[r], AR_COUNT, ncclFloat, ncclSum, comms[r], streams[r]));
        } else {
          NCCLCHECK(ncclSend(p2p_send[r], P2P_COUNT, ncclFloat, 1 - r, comms[r], streams[r]));
          NCCLCHECK(ncclRecv(p2p_recv[r], P2P_COUNT, ncclFloat, 1 - r, comms[r], streams[r]));
        }
      }
      NCCLCHECK(ncclGroupEnd());
      /* Every capture ends before any graph is instantiated: while a stream of this thread
       * captures in thread-local mode, CUDA refuses cudaGraphInstantiate on it. */
      for (int r = 0; r < NRANKS; r++) CUDACHECK(cudaStreamEndCapture(streams[r], &graphs[call][r]));
      for (int r = 0; r < NRANKS; r++) CUDACHECK(cudaGraphInstantiate(&execs[call][r], graphs[call][r], 0));
    }
    sync_all(streams);
    step("ncclAllReduce and ncclSend/ncclRecv captured");
    for (int k = 1; k <= 3; k++) {
      for (int r = 0; r < NRANKS; r++) {
        for (size_t i = 0; i < AR_COUNT; i++) host[i] = (float)((r + 1) * k + (int)(i % 300));
        CUDACHECK(cudaMemcpy(ar_send[r], host, AR_COUNT * sizeof(float), cudaMemcpyHostToDevice));
        for (size_t i = 0; i < P2P_COUNT; i++) host[i] = (float)(1000 * k + 10 * r + (int)(i % 50));
        CUDACHECK(cudaMemcpy(p2p_send[r], host, P2P_COUNT * sizeof(float), cudaMemcpyHostToDevice));
        CUDACHECK(cudaMemset(ar_recv[r], 0xff, AR_COUNT * sizeof(float)));
        CUDACHECK(cudaMemset(p2p_recv[r], 0xff, P2P_COUNT * sizeof(float)));
      }
      CUDACHECK(cudaDeviceSynchronize());
      for (int call = 0; call < 2; call++) {
        for (int r = 0; r < NRANKS; r++) CUDACHECK(cudaGraphLaunch(execs[call][r], streams[r]));
        sync_all(streams);
      }
      for (int r = 0; r < NRANKS; r++) {
        for (size_t i = 0; i < AR_COUNT; i++) want[i] = (float)(3 * k + 2 * (int)(i % 300));
        to_host(host, ar_recv[r], AR_COUNT);
        check("ncclAllReduce (CUDA graph replay)", r, host, want, AR_COUNT);
        for (size_t i = 0; i < P2P_COUNT; i++) want[i] = (float)(1000 * k + 10 * (1 - r) + (int)(i % 50));
        to_host(host, p2p_recv[r], P2P_COUNT);
        check("ncclSend/ncclRecv (CUDA graph replay)", r, host, want, P2P_COUNT);
      }
    }
    step("CUDA graphs replayed");
    for (int call = 0; call < 2; call++)
      for (int r = 0; r < NRANKS; r++) {
        CUDACHECK(cudaGraphExecDestroy(execs[call][r]));
        CUDACHECK(cudaGraphDestroy(graphs[call][r]));
      }
  }

  for (int r = 0; r < NRANKS; r++) {
    ncclResult_t async = ncclInternalError;
    NCCLCHECK(ncclCommGetAsyncError(comms[r], &async));
    if (async != ncclSuccess) {
      printf("rank %d: ncclCommGetAsyncError: %d (%s): %s\n", r, (int)async, ncclGetErrorString(async),
             ncclGetLastError(NULL));
      failures++;
    }
  }

  /* 5. The caller's current context: oxccl makes the communicator's context current to launch,
   * and every call gives the caller's back, whether it was the same one or none at all. */
  {
    CUcontext primary = NULL, now = NULL;
    CUCHECK(cuCtxGetCurrent(&primary));
    for (int round = 0; round < 2; round++) {
      CUcontext before = round == 0 ? primary : NULL;
      const char* which = round == 0 ? "the primary context" : "no context";
      /* Inputs of this round (section 4 left others), outputs poisoned. */
      for (int r = 0; r < NRANKS; r++) {
        for (size_t i = 0; i < AR_COUNT; i++) host[i] = (float)((r + 1) * (round + 5) + (int)(i % 400));
        CUDACHECK(cudaMemcpy(ar_send[r], host, AR_COUNT * sizeof(float), cudaMemcpyHostToDevice));
        CUDACHECK(cudaMemset(ar_recv[r], 0xff, AR_COUNT * sizeof(float)));
      }
      CUDACHECK(cudaDeviceSynchronize());
      CUCHECK(cuCtxSetCurrent(before));
      for (int r = 0; r < NRANKS; r++)
        NCCLCHECK(ncclAllReduce(ar_send[r], ar_recv[r], AR_COUNT, ncclFloat, ncclSum, comms[r], streams[r]));
      CUCHECK(cuCtxGetCurrent(&now));
      if (now != before) {
        printf("ncclAllReduce with %s current left context %p current\n", which, (void*)now);
        failures++;
      }
      NCCLCHECK(ncclGroupStart());
      for (int r = 0; r < NRANKS; r++)
        NCCLCHECK(ncclAllReduce(ar_send[r], ar_recv[r], AR_COUNT, ncclFloat, ncclSum, comms[r], streams[r]));
      NCCLCHECK(ncclGroupEnd());
      CUCHECK(cuCtxGetCurrent(&now));
      if (now != before) {
        printf("a group of ncclAllReduce with %s current left context %p current\n", which, (void*)now);
        failures++;
      }
      CUCHECK(cuCtxSetCurrent(primary));
      sync_all(streams);
      for (size_t i = 0; i < AR_COUNT; i++) want[i] = (float)(3 * (round + 5) + 2 * (int)(i % 400));
      for (int r = 0; r < NRANKS; r++) {
        to_host(host, ar_recv[r], AR_COUNT);
        check("ncclAllReduce (context kept)", r, host, want, AR_COUNT);
      }
    }
    step("the caller's current context kept (the primary one, and none; grouped and not)");
  }

  for (int r = 0; r < NRANKS; r++) NCCLCHECK(ncclCommDestroy(comms[r]));
  step("communicators destroyed");
  for (int r = 0; r < NRANKS; r++) {
    CUDACHECK(cudaFree(ar_send[r]));
    CUDACHECK(cudaFree(ar_recv[r]));
    CUDACHECK(cudaFree(ar_inplace[r]));
    CUDACHECK(cudaFree(p2p_send[r]));
    CUDACHECK(cudaFree(p2p_recv[r]));
    CUDACHECK(cudaFree(a2a_send[r]));
    CUDACHECK(cudaFree(a2a_recv[r]));
    CUDACHECK(cudaStreamDestroy(streams[r]));
  }
  free(host);
  free(want);

  if (failures) {
    printf("C-ABI FAILED: %d check(s) wrong\n", failures);
    return 1;
  }
  printf("C-ABI OK\n");
  return 0;
}
