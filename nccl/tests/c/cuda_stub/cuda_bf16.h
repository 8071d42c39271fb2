/* Empty stand-in for CUDA's cuda_bf16.h (see cuda_runtime.h here): nccl.h includes it but
 * declares nothing that needs it. */
