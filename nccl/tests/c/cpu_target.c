/*
 * oxccl's libnccl.so.2 driven by a C program on oxccl's CPU target (no GPU needed): with
 * OXCCL_NCCL_TARGET=cpu in the environment, rank r of a new communicator is CPU-target device r,
 * device buffers are host memory (malloc), the stream argument is ignored (pass NULL: each rank
 * queues its work on a stream of its own) and ncclCommFinalize waits for the rank's work, after
 * which the results are read. Built by the Rust test `c_program` (nccl/tests/abi/) with the
 * system C compiler against oxccl's nccl.h (cuda_stub/ stands in for the CUDA headers where no
 * toolkit is installed) and linked with -lnccl. Checks, each with exact values:
 *
 *   1. ranks as processes: NP copies of this program (re-executed with "rank R ID"), one
 *      ncclCommInitRank each, an AllReduce;
 *   2. ranks as threads: NT threads, one ncclCommInitRank each (one of them through a config of
 *      NCCL 2.27's size), every collective, a ring of ncclSend/ncclRecv in a group,
 *      ncclAlltoAll, ncclCommSplit (even and odd ranks), finalize, destroy; argument errors
 *      with their codes and ncclGetLastError's message;
 *   3. one thread creating NG ranks inside a group (nccl-tests' way), collectives inside a
 *      group, ncclGroupSimulateEnd (an estimate, nothing run);
 *   4. non-blocking inits (config.blocking = 0): ncclInProgress, then ncclSuccess by polling
 *      ncclCommGetAsyncError.
 *
 * Prints "C-CPU OK" and exits 0 when every check passed; otherwise prints what was wrong.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

#define NP 2   /* ranks as processes */
#define NT 3   /* ranks as threads */
#define NG 4   /* ranks created inside one group */
#define COUNT 1000

static int failures = 0;
static pthread_mutex_t report = PTHREAD_MUTEX_INITIALIZER;

#define FAIL(...)                          \
  do {                                     \
    pthread_mutex_lock(&report);           \
    printf("C-CPU FAILED: " __VA_ARGS__);  \
    printf("\n");                          \
    failures++;                            \
    pthread_mutex_unlock(&report);         \
  } while (0)

#define NCCLCHECK(cmd)                                                                        \
  do {                                                                                        \
    ncclResult_t r_ = (cmd);                                                                  \
    if (r_ != ncclSuccess) {                                                                  \
      printf("C-CPU FAILED: %s:%d: %s returned %d (%s): %s\n", __FILE__, __LINE__, #cmd,     \
             (int)r_, ncclGetErrorString(r_), ncclGetLastError(NULL));                        \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

/* Expects `cmd` to return `want` and the thread's last error to contain `word`. */
#define EXPECT_ERR(cmd, want, word)                                                           \
  do {                                                                                        \
    ncclResult_t r_ = (cmd);                                                                  \
    const char* m_ = ncclGetLastError(NULL);                                                  \
    if (r_ != (want) || strstr(m_, (word)) == NULL)                                           \
      FAIL("%s returned %d (wanted %d) with \"%s\" (wanted it to name \"%s\")", #cmd, (int)r_, \
           (int)(want), m_, (word));                                                          \
  } while (0)

static void check(const char* what, int rank, const float* got, const float* want, size_t n) {
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) {
    if (got[i] != want[i]) {
      if (wrong < 3) FAIL("%s: rank %d element %zu is %g, expected %g", what, rank, i, (double)got[i], (double)want[i]);
      wrong++;
    }
  }
  if (wrong) FAIL("%s: rank %d: %zu of %zu elements wrong", what, rank, wrong, n);
}

static float* floats(size_t n, float value) {
  float* p = malloc(n * sizeof(float));
  if (!p) {
    printf("C-CPU FAILED: out of memory\n");
    exit(1);
  }
  for (size_t i = 0; i < n; i++) p[i] = value;
  return p;
}

/* Rank r's input of the sums below: element i is (r + 1) * (i % 97). */
static float input(int r, size_t i) { return (float)((r + 1) * (int)(i % 97)); }

static void hex(const ncclUniqueId* id, char* out) {
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) sprintf(out + 2 * i, "%02x", (unsigned char)id->internal[i]);
}

static void unhex(const char* s, ncclUniqueId* id) {
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
    unsigned v = 0;
    sscanf(s + 2 * i, "%2x", &v);
    id->internal[i] = (char)v;
  }
}

/* 1. One rank as a process: an AllReduce over NP processes. */
static int process_rank(int rank, const char* idhex) {
  ncclUniqueId id;
  unhex(idhex, &id);
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitRank(&comm, NP, id, rank));
  float* send = floats(COUNT, 0);
  float* recv = floats(COUNT, -1);
  float* want = floats(COUNT, 0);
  for (size_t i = 0; i < COUNT; i++) {
    send[i] = input(rank, i);
    want[i] = (float)(NP * (NP + 1) / 2 * (int)(i % 97));
  }
  NCCLCHECK(ncclAllReduce(send, recv, COUNT, ncclFloat, ncclSum, comm, NULL));
  NCCLCHECK(ncclCommFinalize(comm));
  check("AllReduce across processes", rank, recv, want, COUNT);
  NCCLCHECK(ncclCommDestroy(comm));
  return failures ? 1 : 0;
}

static ncclUniqueId thread_id;

/* 2. One rank as a thread: every collective, a ring of sends and receives, all-to-all, a split,
 * and (on rank 0) argument errors. */
static void* thread_rank(void* arg) {
  int r = (int)(intptr_t)arg;
  ncclComm_t c;
  if (r == 1) {
    /* A caller built against NCCL 2.27: its config ends before nChannelsPerNetPeer. */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.size = offsetof(ncclConfig_t, nChannelsPerNetPeer);
    cfg.version = 22703;
    NCCLCHECK(ncclCommInitRankConfig(&c, NT, thread_id, r, &cfg));
  } else {
    NCCLCHECK(ncclCommInitRank(&c, NT, thread_id, r));
  }
  int n = 0, me = -1;
  NCCLCHECK(ncclCommCount(c, &n));
  NCCLCHECK(ncclCommUserRank(c, &me));
  if (n != NT || me != r) FAIL("rank %d: ncclCommCount %d, ncclCommUserRank %d", r, n, me);

  float* ar_send = floats(COUNT, 0);
  float* ar_recv = floats(COUNT, -1);
  float* bc = floats(COUNT, -1);
  float* red_recv = floats(COUNT, -1);
  float* ag_send = floats(COUNT, 0);
  float* ag_recv = floats(NT * COUNT, -1);
  float* rs_send = floats(NT * COUNT, 0);
  float* rs_recv = floats(COUNT, -1);
  float* p2p_send = floats(COUNT, (float)(100 + r));
  float* p2p_recv = floats(COUNT, -1);
  float* a2a_send = floats(NT * COUNT, 0);
  float* a2a_recv = floats(NT * COUNT, -1);
  float* split_recv = floats(COUNT, -1);
  for (size_t i = 0; i < COUNT; i++) {
    ar_send[i] = input(r, i);
    if (r == 1) bc[i] = (float)(7 * i);
    ag_send[i] = (float)(10000 * r + i);
  }
  for (size_t i = 0; i < NT * COUNT; i++) {
    rs_send[i] = input(r, i);
    a2a_send[i] = (float)(1000 * r + (int)(i / COUNT)); /* block j goes to rank j */
  }

  if (r == 0) {
    /* Argument errors: refused before anything is queued, named by ncclGetLastError. */
    EXPECT_ERR(ncclAllReduce(NULL, ar_recv, COUNT, ncclFloat, ncclSum, c, NULL), ncclInvalidArgument, "sendbuff");
    EXPECT_ERR(ncclBroadcast(bc, bc, COUNT, ncclFloat, 7, c, NULL), ncclInvalidArgument, "root");
    EXPECT_ERR(ncclAllReduce(ar_send, ar_recv, COUNT, (ncclDataType_t)99, ncclSum, c, NULL), ncclInvalidArgument, "99");
    EXPECT_ERR(ncclSend(p2p_send, COUNT, ncclFloat, NT, c, NULL), ncclInvalidArgument, "peer");
    EXPECT_ERR(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupStart");
    if (strcmp(ncclGetErrorString(ncclInvalidUsage), "invalid usage (run with NCCL_DEBUG=WARN for details)") != 0)
      FAIL("ncclGetErrorString(ncclInvalidUsage) is \"%s\"", ncclGetErrorString(ncclInvalidUsage));
  }

  NCCLCHECK(ncclAllReduce(ar_send, ar_recv, COUNT, ncclFloat, ncclSum, c, NULL));
  NCCLCHECK(ncclBroadcast(bc, bc, COUNT, ncclFloat, 1, c, NULL));
  NCCLCHECK(ncclReduce(ar_send, red_recv, COUNT, ncclFloat, ncclMax, 2, c, NULL));
  NCCLCHECK(ncclAllGather(ag_send, ag_recv, COUNT, ncclFloat, c, NULL));
  NCCLCHECK(ncclReduceScatter(rs_send, rs_recv, COUNT, ncclFloat, ncclSum, c, NULL));
  /* A ring: send to the next rank, receive from the previous one, in one group. */
  NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclSend(p2p_send, COUNT, ncclFloat, (r + 1) % NT, c, NULL));
  NCCLCHECK(ncclRecv(p2p_recv, COUNT, ncclFloat, (r + NT - 1) % NT, c, NULL));
  NCCLCHECK(ncclGroupEnd());
  NCCLCHECK(ncclAlltoAll(a2a_send, a2a_recv, COUNT, ncclFloat, c, NULL));
  /* Even and odd ranks: two communicators, ordered by descending key. */
  ncclComm_t sub;
  NCCLCHECK(ncclCommSplit(c, r % 2, -r, &sub, NULL));
  NCCLCHECK(ncclAllReduce(ar_send, split_recv, COUNT, ncclFloat, ncclSum, sub, NULL));
  NCCLCHECK(ncclCommFinalize(sub));
  NCCLCHECK(ncclCommFinalize(c));

  float* want = floats(NT * COUNT, 0);
  for (size_t i = 0; i < COUNT; i++) want[i] = (float)(NT * (NT + 1) / 2 * (int)(i % 97));
  check("AllReduce", r, ar_recv, want, COUNT);
  for (size_t i = 0; i < COUNT; i++) want[i] = (float)(7 * i);
  check("Broadcast (root 1, in place)", r, bc, want, COUNT);
  if (r == 2) {
    for (size_t i = 0; i < COUNT; i++) want[i] = input(NT - 1, i);
    check("Reduce (max, root 2)", r, red_recv, want, COUNT);
  }
  for (size_t i = 0; i < NT * COUNT; i++) want[i] = (float)(10000 * (int)(i / COUNT) + (int)(i % COUNT));
  check("AllGather", r, ag_recv, want, NT * COUNT);
  for (size_t i = 0; i < COUNT; i++) want[i] = (float)(NT * (NT + 1) / 2 * (int)((r * COUNT + i) % 97));
  check("ReduceScatter", r, rs_recv, want, COUNT);
  for (size_t i = 0; i < COUNT; i++) want[i] = (float)(100 + (r + NT - 1) % NT);
  check("Send/Recv ring", r, p2p_recv, want, COUNT);
  for (size_t i = 0; i < NT * COUNT; i++) want[i] = (float)(1000 * (int)(i / COUNT) + r); /* block j from rank j */
  check("AlltoAll", r, a2a_recv, want, NT * COUNT);
  /* Even ranks 0 and 2 sum (1 + 3) x; odd rank 1 alone has 2 x. */
  int k = r % 2 == 0 ? 4 : 2;
  for (size_t i = 0; i < COUNT; i++) want[i] = (float)(k * (int)(i % 97));
  check("AllReduce of the split", r, split_recv, want, COUNT);
  NCCLCHECK(ncclCommDestroy(sub));
  NCCLCHECK(ncclCommDestroy(c));
  free(want);
  return NULL;
}

/* 3. NG ranks created by one thread inside a group; collectives in groups; a simulated group. */
static void grouped(void) {
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));
  ncclComm_t comms[NG];
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NG; r++) NCCLCHECK(ncclCommInitRank(&comms[r], NG, id, r));
  NCCLCHECK(ncclGroupEnd());
  float* send[NG];
  float* recv[NG];
  float* untouched[NG];
  for (int r = 0; r < NG; r++) {
    send[r] = floats(COUNT, 0);
    recv[r] = floats(COUNT, -1);
    untouched[r] = floats(COUNT, -1);
    for (size_t i = 0; i < COUNT; i++) send[r][i] = input(r, i);
  }
  /* A simulated group runs nothing and estimates its collectives. */
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NG; r++) NCCLCHECK(ncclAllReduce(send[r], untouched[r], COUNT, ncclFloat, ncclSum, comms[r], NULL));
  NCCLCHECK(ncclGroupSimulateEnd(&sim));
  if (!(sim.estimatedTime > 0.0f)) FAIL("ncclGroupSimulateEnd: estimatedTime %g", (double)sim.estimatedTime);
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < NG; r++) NCCLCHECK(ncclAllReduce(send[r], recv[r], COUNT, ncclFloat, ncclSum, comms[r], NULL));
  NCCLCHECK(ncclGroupEnd());
  for (int r = 0; r < NG; r++) NCCLCHECK(ncclCommFinalize(comms[r]));
  float* want = floats(COUNT, 0);
  for (size_t i = 0; i < COUNT; i++) want[i] = (float)(NG * (NG + 1) / 2 * (int)(i % 97));
  float* none = floats(COUNT, -1);
  for (int r = 0; r < NG; r++) {
    check("AllReduce of a grouped init", r, recv[r], want, COUNT);
    check("a simulated AllReduce (must not run)", r, untouched[r], none, COUNT);
    NCCLCHECK(ncclCommDestroy(comms[r]));
  }
}

/* 4. Non-blocking inits from one thread: both return ncclInProgress and complete by polling. */
static void non_blocking(void) {
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));
  ncclComm_t comms[2];
  for (int r = 0; r < 2; r++) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t res = ncclCommInitRankConfig(&comms[r], 2, id, r, &cfg);
    if (res != ncclInProgress && res != ncclSuccess) FAIL("non-blocking init of rank %d returned %d", r, (int)res);
  }
  for (int r = 0; r < 2; r++) {
    ncclResult_t state = ncclInProgress;
    for (int spins = 0; state == ncclInProgress && spins < 20000; spins++) {
      NCCLCHECK(ncclCommGetAsyncError(comms[r], &state));
      if (state == ncclInProgress) usleep(1000);
    }
    if (state != ncclSuccess) {
      FAIL("non-blocking init of rank %d ended in state %d", r, (int)state);
      return;
    }
  }
  float* send[2];
  float* recv[2];
  for (int r = 0; r < 2; r++) {
    send[r] = floats(COUNT, 0);
    recv[r] = floats(COUNT, -1);
    for (size_t i = 0; i < COUNT; i++) send[r][i] = input(r, i);
    NCCLCHECK(ncclAllReduce(send[r], recv[r], COUNT, ncclFloat, ncclSum, comms[r], NULL));
  }
  float* want = floats(COUNT, 0);
  for (size_t i = 0; i < COUNT; i++) want[i] = (float)(3 * (int)(i % 97));
  for (int r = 0; r < 2; r++) NCCLCHECK(ncclCommFinalize(comms[r]));
  for (int r = 0; r < 2; r++) {
    check("AllReduce of non-blocking ranks", r, recv[r], want, COUNT);
    NCCLCHECK(ncclCommDestroy(comms[r]));
  }
}

int main(int argc, char** argv) {
  if (argc == 4 && strcmp(argv[1], "rank") == 0) return process_rank(atoi(argv[2]), argv[3]);
  int version = 0;
  NCCLCHECK(ncclGetVersion(&version));
  if (version != NCCL_VERSION_CODE) FAIL("ncclGetVersion %d, header %d", version, NCCL_VERSION_CODE);

  /* 1. Processes: this program again, one per rank (exec right after fork: nothing but exec
   * runs in the child before it). */
  ncclUniqueId pid_id;
  NCCLCHECK(ncclGetUniqueId(&pid_id));
  char idhex[2 * NCCL_UNIQUE_ID_BYTES + 1];
  hex(&pid_id, idhex);
  char ranks[NP][16];
  pid_t kids[NP];
  for (int r = 0; r < NP; r++) {
    snprintf(ranks[r], sizeof ranks[r], "%d", r);
    char* args[] = {argv[0], "rank", ranks[r], idhex, NULL};
    kids[r] = fork();
    if (kids[r] == 0) {
      execv("/proc/self/exe", args);
      _exit(127);
    }
    if (kids[r] < 0) FAIL("fork: rank %d", r);
  }
  for (int r = 0; r < NP; r++) {
    int status = 0;
    if (kids[r] > 0 && (waitpid(kids[r], &status, 0) != kids[r] || !WIFEXITED(status) || WEXITSTATUS(status) != 0))
      FAIL("process of rank %d ended with status %#x", r, status);
  }

  /* 2. Threads. */
  NCCLCHECK(ncclGetUniqueId(&thread_id));
  pthread_t threads[NT];
  for (int r = 0; r < NT; r++) pthread_create(&threads[r], NULL, thread_rank, (void*)(intptr_t)r);
  for (int r = 0; r < NT; r++) pthread_join(threads[r], NULL);

  /* 3 and 4. */
  grouped();
  non_blocking();

  if (failures) {
    printf("C-CPU FAILED: %d checks\n", failures);
    return 1;
  }
  printf("C-CPU OK\n");
  return 0;
}
