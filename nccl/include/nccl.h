/*
 * nccl.h: oxccl's C header for libnccl.so.2, the NCCL 2.28 host ABI implemented by oxccl
 * (crate `oxccl-nccl`, nccl/ in the oxccl repository). Written from the ABI's facts (type sizes,
 * enum values, struct layouts, function signatures), so that programs built against NCCL 2.28's
 * header run on oxccl and programs built against this header run on NCCL 2.28.
 *
 * What oxccl does differently is said next to each declaration; in short:
 *  - The device API's host calls (ncclDevCommCreate, ...) return ncclInvalidUsage ("not
 *    supported yet", see ncclGetLastError). ncclGroupSimulateEnd reports oxccl's tuning model. Buffer registrations and windows are recorded (oxccl needs none).
 *  - Non-blocking communicators (config.blocking = 0): ncclCommInitRankConfig and
 *    ncclCommInitRankScalable return ncclInProgress and the init completes in the background
 *    (poll ncclCommGetAsyncError); the communicator's calls return once their work is queued,
 *    never ncclInProgress.
 *  - Stream capture is not supported yet: a call on a stream being captured into a CUDA graph
 *    returns ncclInvalidUsage.
 *  - A call that made no progress for OXCCL_TIMEOUT seconds fails with 8 (NCCL 2.30's
 *    ncclTimeout; ncclGetErrorString(8) says "operation timed out").
 *
 * Every function also exists under its pncclX name (the profiling interface).
 */
#ifndef NCCL_H_
#define NCCL_H_

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#if CUDART_VERSION >= 11000
#include <cuda_bf16.h>
#endif

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 3
#define NCCL_SUFFIX ""

#define NCCL_VERSION_CODE 22803
#define NCCL_VERSION(X, Y, Z) \
  (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))

#ifdef __cplusplus
extern "C" {
#endif

#include <limits.h>
#include <stddef.h>

/* Opaque communicator handle. oxccl's values are not addresses: a destroyed or foreign handle
 * is detected and refused with ncclInvalidArgument. */
typedef struct ncclComm* ncclComm_t;
/* Opaque window handle (ncclCommWindowRegister). */
typedef struct ncclWindow_vidmem* ncclWindow_t;
#define NCCL_COMM_NULL NULL

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

/* Result codes. oxccl may also return 8 (NCCL 2.30's ncclTimeout), see above. */
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_UNDEF_FLOAT -1.0f

/* Window registration flags. */
#define NCCL_WIN_DEFAULT 0x00
#define NCCL_WIN_COLL_SYMMETRIC 0x01
#define NCCL_WIN_REQUIRED_ALIGNMENT 4096

/* CTA policy (ncclConfig_t.CTAPolicy). */
#define NCCL_CTA_POLICY_DEFAULT 0x00
#define NCCL_CTA_POLICY_EFFICIENCY 0x01
#define NCCL_CTA_POLICY_ZERO 0x02

/* ncclCommShrink flags. */
#define NCCL_SHRINK_DEFAULT 0x00
#define NCCL_SHRINK_ABORT 0x01

/* Communicator configuration (NCCL 2.28 layout: 80 bytes on LP64). Initialize it with
 * NCCL_CONFIG_INITIALIZER. oxccl reads it as NCCL does: `size` bytes (at most its own
 * sizeof) are copied, a magic other than 0xcafebeef is ncclInvalidArgument, fields newer than
 * `version` are reset to undefined, and the values are checked as NCCL checks them. oxccl then
 * uses none of them but `blocking` (accepted either way; see above): channel counts come from
 * NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS in the environment. */
typedef struct ncclConfig_v22800 {
  /* attributes that users should never touch. */
  size_t size;
  unsigned int magic;
  unsigned int version;
  /* attributes that users are able to customize. */
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
  int trafficClass;
  const char* commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
} ncclConfig_t;

#define NCCL_CONFIG_INITIALIZER {                                         \
  sizeof(ncclConfig_t),                           /* size */              \
  0xcafebeef,                                     /* magic */             \
  NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), /* version */         \
  NCCL_CONFIG_UNDEF_INT,                          /* blocking */          \
  NCCL_CONFIG_UNDEF_INT,                          /* cgaClusterSize */    \
  NCCL_CONFIG_UNDEF_INT,                          /* minCTAs */           \
  NCCL_CONFIG_UNDEF_INT,                          /* maxCTAs */           \
  NCCL_CONFIG_UNDEF_PTR,                          /* netName */           \
  NCCL_CONFIG_UNDEF_INT,                          /* splitShare */        \
  NCCL_CONFIG_UNDEF_INT,                          /* trafficClass */      \
  NCCL_CONFIG_UNDEF_PTR,                          /* commName */          \
  NCCL_CONFIG_UNDEF_INT,                          /* collnetEnable */     \
  NCCL_CONFIG_UNDEF_INT,                          /* CTAPolicy */         \
  NCCL_CONFIG_UNDEF_INT,                          /* shrinkShare */       \
  NCCL_CONFIG_UNDEF_INT,                          /* nvlsCTAs */          \
  NCCL_CONFIG_UNDEF_INT,                          /* nChannelsPerNetPeer */ \
  NCCL_CONFIG_UNDEF_INT,                          /* nvlinkCentricSched */ \
}

/* ncclGroupSimulateEnd's output: estimatedTime in microseconds (oxccl's tuning model). */
typedef struct ncclSimInfo_v22200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float estimatedTime;
} ncclSimInfo_t;

#define NCCL_SIM_INFO_INITIALIZER {                                       \
  sizeof(ncclSimInfo_t),                          /* size */              \
  0x74685283,                                     /* magic */             \
  NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), /* version */         \
  NCCL_UNDEF_FLOAT                                /* estimatedTime */     \
}

/* Device memory for NCCL buffers (oxccl: cuMemAlloc on the current device; ncclMemFree frees
 * only what ncclMemAlloc returned). */
ncclResult_t  ncclMemAlloc(void** ptr, size_t size);
ncclResult_t pncclMemAlloc(void** ptr, size_t size);
ncclResult_t  ncclMemFree(void* ptr);
ncclResult_t pncclMemFree(void* ptr);

/* NCCL_VERSION_CODE of the library: 22803. */
ncclResult_t  ncclGetVersion(int* version);
ncclResult_t pncclGetVersion(int* version);

/* A new unique id (128 bytes), to be given to every rank of a communicator. */
ncclResult_t  ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t pncclGetUniqueId(ncclUniqueId* uniqueId);

/* Creates rank `rank` of an `nranks`-rank communicator on the current CUDA device. Outside a
 * group it returns once every rank has joined (call it from a thread or process per rank).
 * Inside ncclGroupStart/ncclGroupEnd, *comm is set at once and the communicator is created at
 * the outermost ncclGroupEnd, together with the group's other inits (a thread each; when the
 * group holds every rank of the id, as one process group like ncclCommInitAll); calls on it
 * before that end are ncclInvalidUsage. config may be NULL (defaults). */
ncclResult_t  ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                     ncclConfig_t* config);
ncclResult_t pncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                     ncclConfig_t* config);
ncclResult_t  ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t pncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);

/* One communicator of ndev ranks, rank i on devlist[i] (devices 0..ndev-1 when devlist is
 * NULL), all in this process. Runs at once, also inside a group. */
ncclResult_t  ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);
ncclResult_t pncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);

/* As ncclCommInitRankConfig; oxccl's ranks meet through the first id (nId ids accepted). */
ncclResult_t  ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                       ncclUniqueId* commIds, ncclConfig_t* config);
ncclResult_t pncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                       ncclUniqueId* commIds, ncclConfig_t* config);

/* Finalize waits for the communicator's work and for its peers; destroy frees it. When one
 * thread holds several ranks of one communicator, each rank's finalize or destroy is carried out
 * once every rank of this process has asked for it (the last one's call does them all). */
ncclResult_t  ncclCommFinalize(ncclComm_t comm);
ncclResult_t pncclCommFinalize(ncclComm_t comm);
ncclResult_t  ncclCommDestroy(ncclComm_t comm);
ncclResult_t pncclCommDestroy(ncclComm_t comm);
ncclResult_t  ncclCommAbort(ncclComm_t comm);
ncclResult_t pncclCommAbort(ncclComm_t comm);

/* ncclCommRevoke (NCCL 2.28.9): stops the communicator's in-flight operations (their outputs
 * are undefined) and returns once none is left; afterwards only ncclCommSplit, ncclCommShrink,
 * ncclCommDestroy and ncclCommAbort are accepted. revokeFlags must be NCCL_REVOKE_DEFAULT. */
#define NCCL_REVOKE_DEFAULT 0x00
ncclResult_t  ncclCommRevoke(ncclComm_t comm, int revokeFlags);
ncclResult_t pncclCommRevoke(ncclComm_t comm, int revokeFlags);

/* ncclCommSplit: every rank calls it from a thread of its own, or inside a group (one thread may
 * split several ranks; the communicators are created at the group's end). NCCL_SPLIT_NOCOLOR
 * gives *newcomm = NULL. ncclCommShrink: every rank not excluded calls it, from a thread of its
 * own or inside a group (created at the group's end, as splits are). */
ncclResult_t  ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
ncclResult_t  ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
                             ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);
ncclResult_t pncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
                             ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);

/* The text of a result code. */
const char*  ncclGetErrorString(ncclResult_t result);
const char* pncclGetErrorString(ncclResult_t result);

/* The message of the calling thread's last failed call ("" if none); comm is not used. Valid
 * until the thread's next failed call. */
const char*  ncclGetLastError(ncclComm_t comm);
const char* pncclGetLastError(ncclComm_t comm);

/* No-op (oxccl reads NCCL_DEBUG once, at the first call). */
void  ncclResetDebugInit(void);
void pncclResetDebugInit(void);

/* ncclSuccess while healthy; ncclInProgress for a communicator whose init waits for its
 * group's end; else the error met outside any call. */
ncclResult_t  ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);

ncclResult_t  ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t pncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t  ncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t  ncclCommUserRank(const ncclComm_t comm, int* rank);
ncclResult_t pncclCommUserRank(const ncclComm_t comm, int* rank);

/* Buffer registration: accepted and recorded (oxccl needs none); the handle is for
 * ncclCommDeregister only. */
ncclResult_t  ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);
ncclResult_t pncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);
ncclResult_t  ncclCommDeregister(const ncclComm_t comm, void* handle);
ncclResult_t pncclCommDeregister(const ncclComm_t comm, void* handle);

/* Symmetric memory windows: recorded (winFlags checked); oxccl has no symmetric kernels, so
 * collectives on the buffer run as on any buffer. */
ncclResult_t  ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);
ncclResult_t pncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);
ncclResult_t  ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
ncclResult_t pncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);

/* Reduction operators. */
typedef enum { ncclNumOps_dummy = 5 } ncclRedOp_dummy_t;
typedef enum {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
  /* The number of built-in operators, and the first value of the operators that
   * ncclRedOpCreatePreMulSum returns. */
  ncclNumOps = 5,
  /* The largest valid value. */
  ncclMaxRedOp = 0x7fffffff >> (32 - 8 * sizeof(ncclRedOp_dummy_t))
} ncclRedOp_t;

/* Data types. The 8-bit floats move (broadcast, all-gather, send/receive, all-to-all, gather,
 * scatter) but oxccl does not reduce them yet (ncclInvalidUsage). */
typedef enum {
  ncclInt8 = 0, ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2, ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6, ncclHalf = 6,
  ncclFloat32 = 7, ncclFloat = 7,
  ncclFloat64 = 8, ncclDouble = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

/* Where a PreMulSum scalar lives. */
typedef enum {
  ncclScalarDevice = 0,        /* device memory, read when the collective runs */
  ncclScalarHostImmediate = 1  /* host memory, read before ncclRedOpCreatePreMulSum returns */
} ncclScalarResidence_t;

/* PreMulSum: each rank's input times its scalar, summed. The operator belongs to comm and
 * datatype. */
ncclResult_t  ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                       ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t pncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                       ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t  ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
ncclResult_t pncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);

/* Collectives: queued on `stream` (a cudaStream_t of the communicator's device; 0 is the legacy
 * default stream), they return at once. In place when sendbuff == recvbuff (AllGather: sendbuff
 * == recvbuff + rank * sendcount; ReduceScatter: recvbuff == sendbuff + rank * recvcount). */
ncclResult_t  ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                         ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                         ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t  ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                        cudaStream_t stream);
ncclResult_t pncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                        cudaStream_t stream);
ncclResult_t  ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                            int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                            int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t  ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t  ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream);
ncclResult_t pncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream);
ncclResult_t  ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                            ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                            ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);

/* All-to-all, gather and scatter, as groups of sends and receives (no in-place all-to-all). */
ncclResult_t  ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t  ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                         int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                         int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t  ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                          int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                          int root, ncclComm_t comm, cudaStream_t stream);

/* Point to point. Inside a group, launched together at the outermost ncclGroupEnd. */
ncclResult_t  ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                       ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                       ncclComm_t comm, cudaStream_t stream);
ncclResult_t  ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                       ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                       ncclComm_t comm, cudaStream_t stream);

/* Groups, per thread, nesting. ncclGroupEnd without ncclGroupStart is ncclInvalidUsage. */
ncclResult_t  ncclGroupStart(void);
ncclResult_t pncclGroupStart(void);
ncclResult_t  ncclGroupEnd(void);
ncclResult_t pncclGroupEnd(void);
/* Ends the group without running its collectives, sends and receives (they are dropped; its
 * inits, splits and shrinks are carried out) and sets simInfo->estimatedTime to the tuning
 * model's time of its collectives in microseconds: per communicator the sum of its calls' times,
 * the largest over the communicators (ranks run in parallel); 0 without collectives.
 * ncclInvalidArgument for a NULL simInfo or a wrong magic. */
ncclResult_t  ncclGroupSimulateEnd(ncclSimInfo_t* simInfo);
ncclResult_t pncclGroupSimulateEnd(ncclSimInfo_t* simInfo);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* NCCL_H_ */
