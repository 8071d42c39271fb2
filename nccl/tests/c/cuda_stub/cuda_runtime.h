/* The part of CUDA's cuda_runtime.h that nccl.h needs (cudaStream_t, CUDART_VERSION), for
 * building C programs against oxccl's nccl.h on machines without a CUDA toolkit: the CPU-target
 * test (tests/c/cpu_target.c, OXCCL_NCCL_TARGET=cpu) passes NULL streams and host buffers. A
 * program that calls the CUDA runtime needs the real header. */
#ifndef OXCCL_CUDA_RUNTIME_STUB_H_
#define OXCCL_CUDA_RUNTIME_STUB_H_
#define CUDART_VERSION 12000
typedef struct CUstream_st* cudaStream_t;
#endif
