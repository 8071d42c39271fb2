// hw-queue-probe: which stream operations queued behind a spinning kernel keep a kernel of
// another stream from starting when the two streams share a GPU hardware queue. This is the
// situation of two ranks sharing a GPU (OXCCL_ALLOW_SHARED_DEVICE=1): rank 0's kernel spins until
// rank 1's kernel runs. `waiter` (on stream 0) spins up to 300 ms for a flag that `setter` (on
// stream 1) sets; between the two launches one operation is queued:
//   none     nothing
//   event    an untimed event recorded on stream 0 (cudaEventDisableTiming)
//   tevent   a timing event recorded on stream 0
//   tevent1  a timing event recorded on stream 1
//   kernel   another kernel on stream 0
//   memcpy   a device-to-device copy on stream 0
// and the probe counts waiters that timed out. Build and run on a GPU machine:
//   nvcc -O2 -o hw-queue-probe tools/hw-queue-probe.cu
//   CUDA_DEVICE_MAX_CONNECTIONS=1 ./hw-queue-probe tevent 10 0 1   # mode, iterations, fresh streams each iteration (0/1), waiter blocks
// With CUDA_DEVICE_MAX_CONNECTIONS=1 every stream shares one hardware queue. The first iteration
// may time out in every mode (the first launch of `setter` loads its module). Results on an H200
// are in docs/benchmarks.md.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
__device__ unsigned long long now() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__global__ void waiter(volatile int* flag, int* res) {
  unsigned long long t0 = now();
  while (*flag == 0) { if (now() - t0 > 300000000ull) { *res = 1; return; } }
  *res = 0;
}
__global__ void setter(volatile int* flag) { *flag = 1; __threadfence_system(); }
__global__ void noop() {}
int main(int argc, char** argv) {
  const char* mode = argv[1]; int iters = atoi(argv[2]); int fresh = atoi(argv[3]);
  int *flag, *res; cudaMalloc(&flag, 4); cudaMallocManaged(&res, 4);
  cudaStream_t s0, s1; cudaEvent_t e, te; cudaEventCreateWithFlags(&e, cudaEventDisableTiming); cudaEventCreate(&te);
  int blocks = argc > 4 ? atoi(argv[4]) : 1;
  int *scratch; cudaMalloc(&scratch, 1<<20);
  cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  int hangs = 0;
  for (int i = 0; i < iters; i++) {
    if (fresh) { cudaStreamDestroy(s0); cudaStreamDestroy(s1);
      cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking); }
    cudaMemset(flag, 0, 4); *res = 2; cudaDeviceSynchronize();
    waiter<<<blocks, 32, 0, s0>>>(flag, res);
    if (!strcmp(mode, "event")) cudaEventRecord(e, s0);
    if (!strcmp(mode, "tevent")) cudaEventRecord(te, s0);
    if (!strcmp(mode, "tevent1")) cudaEventRecord(te, s1);
    if (!strcmp(mode, "kernel")) noop<<<1, 32, 0, s0>>>();
    if (!strcmp(mode, "memcpy")) cudaMemcpyAsync(scratch, scratch + 1024, 4096, cudaMemcpyDeviceToDevice, s0);
    setter<<<1, 1, 0, s1>>>(flag);
    cudaDeviceSynchronize();
    if (*res != 0) hangs++;
  }
  printf("blocks=%d mode=%-9s fresh=%d MAXCONN=%s: %d of %d waiters timed out (err %s)\n", blocks, mode, fresh,
         getenv("CUDA_DEVICE_MAX_CONNECTIONS") ? getenv("CUDA_DEVICE_MAX_CONNECTIONS") : "default", hangs, iters,
         cudaGetErrorString(cudaGetLastError()));
  return 0;
}
