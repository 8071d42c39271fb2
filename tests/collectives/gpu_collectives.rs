//! The correctness matrix of the `matrix` tests on local GPUs: Broadcast (every root), Reduce
//! (every root; non-root ranks pass no receive buffer), AllGather, ReduceScatter and AllReduce ×
//! every protocol of `common::PROTOS` (forced with `NCCL_PROTO`; each call's `Comm::last_choice`
//! must show it) × every DataType × every RedOp (the reducing collectives) × out-of-place/in-place
//! × the full count set {0, 1, 2, 3, 7, 1023, 1025, 65536+3, 2^20+3} for every dtype × op, on 1 and
//! 2 GPUs (and on all of them when more than 2 are visible), and on 2 ranks sharing the GPU when
//! only one is visible. Checks as in `common::run_collective`: exact expected values from
//! `oxccl::perf::check`, guard bytes around every buffer, poisoned outputs, unchanged inputs and
//! non-root outputs, AllReduce results bitwise identical on every rank. On one GPU every collective
//! is a copy and no protocol runs, so the 1-GPU matrices run once, unforced.
//!
//! Without enough GPUs (CI), each test prints `SKIPPED: <test>: <reason>` to stderr and returns.
//! GPU tests in this binary take a lock so two communicators never spin on the same GPUs at once.
use crate::common;

use oxccl::transport::TransportKind;
use oxccl::{Device, Func, Proto};

/// Every count of the CPU matrix, the large one for every dtype × op.
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 16) + 3, (1 << 20) + 3];

fn run(func: Func, devices: &[Device], test: &str) {
    let protos = common::protos();
    common::run_collective(
        test,
        devices,
        &common::Matrix {
            func,
            counts: COUNTS,
            extra_counts: &[],
            extra_pairs: &[],
            protos: Some(&protos),
            only: None,
        },
    );
}

fn matrix(func: Func, nranks: usize, test: &str) {
    let Some(devices) = common::gpus_or_skip(test, nranks) else {
        return;
    };
    let _gpu = common::gpu_lock();
    run(func, &devices, test);
}

/// Two ranks sharing GPU 0 when it is the only GPU (`OXCCL_ALLOW_SHARED_DEVICE=1`), so a 1-GPU
/// machine runs every protocol of the matrix too; with 2 or more GPUs `*_2_gpus` covers it.
fn matrix_shared_gpu(func: Func, test: &str) {
    match Device::cuda_count() {
        0 => {
            let _ = common::gpus_or_skip(test, 1); // prints why
        }
        1 => {
            let Some(devices) = common::two_ranks_or_skip(test) else {
                return;
            };
            let _gpu = common::gpu_lock();
            run(func, &devices, test);
        }
        n => skipped!("SKIPPED: {test}: {n} GPUs visible; the *_2_gpus test runs this matrix"),
    }
}

/// All GPUs when more than 2 are visible (1 and 2 have their own tests).
fn matrix_all_gpus(func: Func, test: &str) {
    if Device::cuda_count() <= 2 {
        // Prints why: no GPU, or fewer than 3 (1 and 2 GPUs run in the tests above).
        let _ = common::gpus_or_skip(test, 3);
        return;
    }
    let _gpu = common::gpu_lock();
    run(func, &Device::all_cuda(), test);
}

macro_rules! gpu_tests {
    ($($func:ident: $one:ident, $two:ident, $shared:ident, $all:ident;)*) => {$(
        #[test]
        fn $one() {
            matrix(Func::$func, 1, stringify!($one));
        }
        #[test]
        fn $two() {
            matrix(Func::$func, 2, stringify!($two));
        }
        #[test]
        fn $shared() {
            matrix_shared_gpu(Func::$func, stringify!($shared));
        }
        #[test]
        fn $all() {
            matrix_all_gpus(Func::$func, stringify!($all));
        }
    )*};
}

gpu_tests! {
    Broadcast: broadcast_1_gpu, broadcast_2_gpus, broadcast_2_ranks_1_gpu, broadcast_all_gpus;
    Reduce: reduce_1_gpu, reduce_2_gpus, reduce_2_ranks_1_gpu, reduce_all_gpus;
    AllGather: all_gather_1_gpu, all_gather_2_gpus, all_gather_2_ranks_1_gpu, all_gather_all_gpus;
    ReduceScatter: reduce_scatter_1_gpu, reduce_scatter_2_gpus, reduce_scatter_2_ranks_1_gpu,
        reduce_scatter_all_gpus;
    AllReduce: all_reduce_1_gpu, all_reduce_2_gpus, all_reduce_2_ranks_1_gpu, all_reduce_all_gpus;
}

/// `NCCL_P2P_DISABLE=1` on `init_all`: every pair of ranks uses SHM (connection memory in
/// `/dev/shm`, registered with CUDA), as ranks in separate processes would, without direct
/// pointers; LL128 is off (128-byte lines can arrive torn through host memory), so
/// `NCCL_PROTO=LL128` is refused naming it, and every collective is exact on LL and Simple (the
/// `run_collective` checks). 2 GPUs, or 2 ranks sharing GPU 0.
#[test]
fn init_all_with_p2p_disabled_uses_shm() {
    let test = "init_all_with_p2p_disabled_uses_shm";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    // The GPU lock first, then the environment's (the order every GPU test takes them in).
    let _gpu = common::gpu_lock();
    let env = common::env::Env::clean(&["P2P_DISABLE", "P2P_LEVEL", "SHM_DISABLE", "PROTO", "ALGO"]);
    env.set(&[("NCCL_P2P_DISABLE", "1")]);
    let comms = common::init_all(&devices).expect("NCCL_P2P_DISABLE=1: SHM between the ranks");
    for c in &comms {
        assert_eq!(c.transport_to(1 - c.rank()), Some(TransportKind::Shm), "rank {}", c.rank());
        assert!(!c.direct_pointer(), "rank {}: no direct pointers over SHM", c.rank());
    }
    for count in [1, 1025, 1 << 20] {
        for in_place in [false, true] {
            for c in common::all_reduce_f32(&comms, count, in_place) {
                assert_ne!(c.proto, Proto::Ll128, "count {count}: LL128 through host memory");
            }
        }
    }
    drop(comms);
    env.set(&[("NCCL_P2P_DISABLE", "1"), ("NCCL_PROTO", "LL128")]);
    let e = common::init_all(&devices).err().expect("LL128 alone cannot run over SHM");
    assert!(matches!(e, oxccl::Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("LL128 cannot run on this communicator"), "{e}");
    env.set(&[("NCCL_P2P_DISABLE", "1")]);
    for func in [Func::Broadcast, Func::Reduce, Func::AllGather, Func::ReduceScatter, Func::AllReduce] {
        common::run_collective(
            &format!("{test} {func:?}"),
            &devices,
            &common::Matrix {
                func,
                counts: &[0, 1, 3, 1025, (1 << 16) + 3, (1 << 20) + 3],
                extra_counts: &[],
                extra_pairs: &[],
                protos: Some(&["LL", "Simple"]),
                only: None,
            },
        );
    }
}

/// `NCCL_P2P_LEVEL` on `init_all` between two GPUs: `LOC` (P2P only within one GPU) forbids
/// P2P, so the pair uses SHM (as NCCL's `p2pCanConnect` refusal); `SYS` (any path) allows it.
/// AllReduce exact both ways.
#[test]
fn init_all_honours_p2p_level() {
    let Some(devices) = common::gpus_or_skip("init_all_honours_p2p_level", 2) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let env = common::env::Env::clean(&["P2P_LEVEL", "P2P_DISABLE", "SHM_DISABLE", "PROTO", "ALGO"]);
    for (level, want) in [("LOC", TransportKind::Shm), ("SYS", TransportKind::P2p)] {
        env.set(&[("NCCL_P2P_LEVEL", level)]);
        let comms = common::init_all(&devices[..2]).expect("init_all under NCCL_P2P_LEVEL");
        assert_eq!(comms[0].transport_to(1), Some(want), "NCCL_P2P_LEVEL={level}");
        assert_eq!(comms[1].transport_to(0), Some(want), "NCCL_P2P_LEVEL={level}");
        for in_place in [false, true] {
            common::all_reduce_f32(&comms, 1000, in_place);
        }
    }
}

/// Two ranks for the launch-order tests: 2 GPUs when there are, else 2 ranks sharing GPU 0, else
/// (CI) 2 CPU-target ranks, so the same sequence runs everywhere; `None` never (the CPU target is
/// always there).
fn two_ranks_any() -> Vec<Device> {
    if Device::cuda_count() == 0 {
        eprintln!(
            "note: no CUDA ({}); running on 2 CPU-target ranks",
            common::no_gpu_reason()
        );
        return Device::cpus(2);
    }
    common::two_ranks_or_skip("two_ranks_any").unwrap_or_else(|| Device::cpus(2))
}

/// Little-endian bytes of `count` int64 values `f(i)`.
fn i64_bytes(count: usize, f: impl Fn(usize) -> i64) -> Vec<u8> {
    (0..count).flat_map(|i| f(i).to_le_bytes()).collect()
}

/// One rank issues five collectives back to back, each needing a kernel module not loaded yet
/// (int64 max / uint64 entries: no other test of this binary uses them first when run alone),
/// while its peer starts 300 ms later. Loading a module can wait for every kernel of the context,
/// and the first rank's AllReduce kernel spins until the peer's arrives: the library must let the
/// peer launch before it loads (otherwise this deadlocked on one shared GPU). Results are exact on
/// both ranks; a watchdog fails the test after 60 s without progress.
#[test]
fn calls_queued_back_to_back_load_their_kernels_without_deadlock() {
    let devices = two_ranks_any();
    let _gpu = common::gpu_lock();
    calls_queued_back_to_back(&devices);
}

/// The sequence of [`calls_queued_back_to_back_load_their_kernels_without_deadlock`] on
/// `devices` (the caller holds the GPU lock).
fn calls_queued_back_to_back(devices: &[Device]) {
    use oxccl::{DataType, RedOp};
    let dog = common::Watchdog::new("calls_queued_back_to_back", std::time::Duration::from_secs(60));
    let comms = common::init_comms(devices, None);
    let count = 4099usize;
    // Every rank allocates and writes its buffers before any rank's first call: those are
    // context-wide synchronizations, which would wait for a peer's kernel already spinning for
    // this rank (the rule of `Comm::init_all` for ranks sharing a GPU).
    let set_up = std::sync::Barrier::new(comms.len());
    let results: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| {
                let dog = &dog;
                let set_up = &set_up;
                s.spawn(move || {
                    let r = c.rank();
                    let dev = c.device();
                    dog.rank_step(r, "queued: allocating and writing its input");
                    let stream = dev.new_stream().unwrap();
                    let input = dev.alloc(2 * count * 8).unwrap();
                    input
                        .write(
                            0,
                            &i64_bytes(2 * count, |i| (i as i64 * 7 + r as i64) % 1000 - 500),
                        )
                        .unwrap();
                    let outs: Vec<_> = (0..5).map(|_| dev.alloc(2 * count * 8).unwrap()).collect();
                    dog.rank_step(r, "queued: waiting for every rank's buffers");
                    set_up.wait();
                    if r == 1 {
                        std::thread::sleep(std::time::Duration::from_millis(300));
                    }
                    let send = input.slice(0, count * 8).unwrap();
                    dog.rank_step(r, "queued: AllReduce int64 max");
                    c.all_reduce(send, &outs[0], count, DataType::I64, RedOp::Max, &stream)
                        .unwrap();
                    dog.rank_step(r, "queued: Broadcast uint64");
                    c.broadcast(Some(send), &outs[1], count, DataType::U64, 1, &stream)
                        .unwrap();
                    dog.rank_step(r, "queued: Reduce int64 max");
                    c.reduce(
                        send,
                        Some(outs[2].as_slice()),
                        count,
                        DataType::I64,
                        RedOp::Max,
                        0,
                        &stream,
                    )
                    .unwrap();
                    dog.rank_step(r, "queued: AllGather int64");
                    c.all_gather(send, &outs[3], count, DataType::I64, &stream)
                        .unwrap();
                    dog.rank_step(r, "queued: ReduceScatter int64 max");
                    c.reduce_scatter(&input, &outs[4], count, DataType::I64, RedOp::Max, &stream)
                        .unwrap();
                    dog.rank_step(r, "queued: synchronizing its stream");
                    stream.synchronize().unwrap();
                    outs.iter()
                        .map(|o| {
                            let mut v = vec![0u8; 2 * count * 8];
                            o.read(0, &mut v).unwrap();
                            v
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    dog.step("checking");
    let input = |r: usize, i: usize| (i as i64 * 7 + r as i64) % 1000 - 500;
    let max = |i: usize| input(0, i).max(input(1, i));
    for (r, outs) in results.iter().enumerate() {
        let want_ar = i64_bytes(count, max);
        assert_eq!(&outs[0][..count * 8], &want_ar[..], "rank {r}: AllReduce max");
        assert_eq!(
            &outs[1][..count * 8],
            &i64_bytes(count, |i| input(1, i))[..],
            "rank {r}: Broadcast"
        );
        if r == 0 {
            assert_eq!(&outs[2][..count * 8], &want_ar[..], "rank 0: Reduce max");
        }
        let gathered: Vec<u8> = (0..2)
            .flat_map(|k| i64_bytes(count, move |i| input(k, i)))
            .collect();
        assert_eq!(&outs[3][..], &gathered[..], "rank {r}: AllGather");
        assert_eq!(
            &outs[4][..count * 8],
            &i64_bytes(count, |i| max(r * count + i))[..],
            "rank {r}: ReduceScatter"
        );
    }
}

/// Which stream each call of [`small_calls_in_lockstep`] runs on.
#[derive(Clone, Copy, Debug)]
enum StreamUse {
    /// A stream created for the call and dropped after it.
    FreshPerCall,
    /// One stream per rank, created before the first call.
    OnePerRank,
}

/// Small calls in lockstep: every rank of `devices` on its own thread takes a stream ([`StreamUse`]),
/// allocates and fills its buffers, meets its peer at a barrier, calls an f16 or bf16 sum
/// AllReduce on LL or LL128 with a small odd count, synchronizes, meets again, reads back and
/// drops the buffers; 21 calls × 5 sequences. Every result is exact on every rank; a watchdog
/// fails the test after 30 s without progress, naming where each rank stopped.
fn small_calls_in_lockstep(devices: &[Device], streams: StreamUse) {
    use oxccl::{DataType, RedOp};
    let devices = devices.to_vec();
    let _gpu = common::gpu_lock();
    let dog = common::Watchdog::new("small_calls_in_lockstep", std::time::Duration::from_secs(30));
    const COUNTS: [usize; 10] = [1, 2, 3, 5, 7, 15, 17, 127, 129, 4095];
    for (proto_i, proto) in ["LL", "LL128", "LL", "LL128", "LL"].iter().enumerate() {
        let comms = common::init_comms(&devices, Some(proto));
        let n = comms.len();
        let barrier = std::sync::Barrier::new(n);
        std::thread::scope(|s| {
            for c in &comms {
                let (barrier, dog) = (&barrier, &dog);
                s.spawn(move || {
                    let r = c.rank();
                    let dev = c.device();
                    let own = dev.new_stream().unwrap();
                    for call in 0..21usize {
                        let dtype = if (call + proto_i) % 3 == 0 {
                            DataType::Bf16
                        } else {
                            DataType::F16
                        };
                        let count = COUNTS[(call * 7 + proto_i) % COUNTS.len()];
                        let at = format!(
                            "{streams:?}: sequence {proto_i} ({proto}) call {call}: {dtype} count {count}"
                        );
                        dog.rank_step(r, format!("{at}: preparing"));
                        let fresh;
                        let stream = match streams {
                            StreamUse::FreshPerCall => {
                                fresh = dev.new_stream().unwrap();
                                &fresh
                            }
                            StreamUse::OnePerRank => &own,
                        };
                        let send = dev.alloc(count * 2).unwrap();
                        let recv = dev.alloc(count * 2).unwrap();
                        // Small integers are exact in both types: rank r sends (i % 13) + r + 1.
                        let val = |r: usize, i: usize| ((i % 13) + r + 1) as f32;
                        let enc = |x: f32| match dtype {
                            DataType::F16 => half::f16::from_f32(x).to_bits(),
                            _ => half::bf16::from_f32(x).to_bits(),
                        };
                        let bytes: Vec<u8> = (0..count).flat_map(|i| enc(val(r, i)).to_le_bytes()).collect();
                        send.write(0, &bytes).unwrap();
                        barrier.wait();
                        dog.rank_step(r, format!("{at}: in all_reduce"));
                        c.all_reduce(&send, &recv, count, dtype, RedOp::Sum, stream)
                            .unwrap();
                        dog.rank_step(r, format!("{at}: synchronizing its stream"));
                        stream.synchronize().unwrap();
                        dog.rank_step(r, format!("{at}: done"));
                        barrier.wait();
                        let mut got = vec![0u8; count * 2];
                        recv.read(0, &mut got).unwrap();
                        let want: Vec<u8> = (0..count)
                            .flat_map(|i| enc((0..n).map(|k| val(k, i)).sum()).to_le_bytes())
                            .collect();
                        assert_eq!(got, want, "rank {r}, {proto}, call {call}: {dtype} count {count}");
                    }
                });
            }
        });
    }
}

/// [`small_calls_in_lockstep`] on 3 CPU-target ranks, a fresh stream per call.
#[test]
fn a_fresh_stream_per_call_completes_every_call_cpu() {
    small_calls_in_lockstep(&Device::cpus(3), StreamUse::FreshPerCall);
}

/// [`small_calls_in_lockstep`] on 2 GPUs, or 2 ranks sharing GPU 0, one stream per rank.
#[test]
fn one_stream_per_rank_completes_every_call_gpu() {
    let Some(devices) = common::two_ranks_or_skip("one_stream_per_rank_completes_every_call_gpu") else {
        return;
    };
    small_calls_in_lockstep(&devices, StreamUse::OnePerRank);
}

/// [`small_calls_in_lockstep`] on 2 GPUs, or 2 ranks sharing GPU 0, a fresh stream per call.
/// Such streams often share a hardware queue; this hung before completion markers were untimed.
#[test]
fn a_fresh_stream_per_call_completes_every_call_gpu() {
    let Some(devices) = common::two_ranks_or_skip("a_fresh_stream_per_call_completes_every_call_gpu") else {
        return;
    };
    small_calls_in_lockstep(&devices, StreamUse::FreshPerCall);
}

/// Every rank of `devices` on its own thread queues 40 f32 sum AllReduces of 1000 elements back to
/// back on one stream (rank 1 starts 100 ms late, so the others run ahead), then synchronizes;
/// the last result is exact on every rank.
fn calls_back_to_back(devices: &[Device]) {
    use oxccl::{DataType, RedOp};
    let _gpu = common::gpu_lock();
    let dog = common::Watchdog::new("calls_back_to_back", std::time::Duration::from_secs(30));
    let comms = common::init_comms(devices, None);
    let n = comms.len();
    let count = 1000usize;
    let val = |r: usize, i: usize| ((i % 29) + 2 * r) as f32;
    // Buffers of every rank first: see `calls_queued_back_to_back`.
    let set_up = std::sync::Barrier::new(n);
    std::thread::scope(|s| {
        for c in &comms {
            let dog = &dog;
            let set_up = &set_up;
            s.spawn(move || {
                let r = c.rank();
                let dev = c.device();
                let stream = dev.new_stream().unwrap();
                let send = dev.alloc(count * 4).unwrap();
                let recv = dev.alloc(count * 4).unwrap();
                let bytes: Vec<u8> = (0..count).flat_map(|i| val(r, i).to_le_bytes()).collect();
                send.write(0, &bytes).unwrap();
                set_up.wait();
                if r == 1 {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                for call in 0..40 {
                    dog.rank_step(r, format!("back to back: queueing call {call}"));
                    c.all_reduce(&send, &recv, count, DataType::F32, RedOp::Sum, &stream)
                        .unwrap();
                }
                dog.rank_step(r, "back to back: synchronizing its stream");
                stream.synchronize().unwrap();
                let mut got = vec![0u8; count * 4];
                recv.read(0, &mut got).unwrap();
                let want: Vec<u8> = (0..count)
                    .flat_map(|i| (0..n).map(|k| val(k, i)).sum::<f32>().to_le_bytes())
                    .collect();
                assert_eq!(got, want, "rank {r}: the last of 40 back-to-back AllReduces");
            });
        }
    });
}

/// The child process of [`calls_complete_with_every_stream_on_one_hardware_queue_gpu`]: runs
/// [`calls_queued_back_to_back`] on 2 ranks sharing GPU 0 (first, so its kernel modules load
/// lazily), then [`small_calls_in_lockstep`] with both stream uses and [`calls_back_to_back`] on 3
/// ranks sharing GPU 0, and on GPUs 0 and 1 when there are two.
#[test]
#[ignore = "child process of calls_complete_with_every_stream_on_one_hardware_queue_gpu"]
fn child_one_hardware_queue() {
    common::child::enter();
    // First, while no kernel module is loaded yet: two ranks sharing GPU 0 queue calls whose
    // modules each load lazily, one rank 300 ms late.
    calls_queued_back_to_back(&[Device::Cuda(0), Device::Cuda(0)]);
    println!("queued done");
    let mut groups = vec![vec![Device::Cuda(0); 3]];
    if Device::cuda_count() >= 2 {
        groups.push(vec![Device::Cuda(0), Device::Cuda(1)]);
    }
    for devices in &groups {
        for streams in [StreamUse::OnePerRank, StreamUse::FreshPerCall] {
            small_calls_in_lockstep(devices, streams);
            println!(
                "lockstep done: {} ranks on {devices:?}, {streams:?}",
                devices.len()
            );
        }
        calls_back_to_back(devices);
        println!("back to back done: {} ranks on {devices:?}", devices.len());
    }
}

/// With `CUDA_DEVICE_MAX_CONNECTIONS=1` every stream of the process shares one hardware queue,
/// so anything the library queues behind one rank's kernel that waits for that kernel to end
/// would keep a rank sharing the GPU from starting: the sequences of [`child_one_hardware_queue`]
/// (3 ranks on one GPU; 2 GPUs too when present) must all complete in a child process (the
/// variable is read at CUDA's initialisation). Before completion markers were untimed, the first
/// lockstep call deadlocked (2 of 2 runs on an H200). The back-to-back calls check that a rank
/// sharing its GPU waits for its peers' launches before queueing its next kernel.
#[test]
fn calls_complete_with_every_stream_on_one_hardware_queue_gpu() {
    let test = "calls_complete_with_every_stream_on_one_hardware_queue_gpu";
    if common::gpus_or_skip(test, 1).is_none() {
        return;
    }
    let _gpu = common::gpu_lock();
    let mut cmd = common::child::command_with(
        &child_entry!(child_one_hardware_queue),
        [
            ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
            ("OXCCL_ALLOW_SHARED_DEVICE", "1"),
            ("OXCCL_TEST_STALL_S", "20"),
        ],
    );
    let (ok, out) = common::child::run(&mut cmd, std::time::Duration::from_secs(240));
    assert!(ok, "{test}: the child failed:\n{out}");
    let want = if Device::cuda_count() >= 2 { 4 } else { 2 };
    // The first line shares libtest's "test ... " line (the child's output is not captured).
    let done = out.matches("lockstep done:").count();
    assert_eq!(done, want, "{test}: sequences completed in the child:\n{out}");
    assert_eq!(
        out.matches("queued done").count(),
        1,
        "{test}: the queued calls in the child:\n{out}"
    );
    let done = out.matches("back to back done:").count();
    assert_eq!(
        done,
        want / 2,
        "{test}: back-to-back runs completed in the child:\n{out}"
    );
}

/// Every collective and a group of a send and a receive captured into CUDA graphs on two ranks
/// sharing a GPU, replayed three times with new inputs and calls issued outside the graphs in
/// between, exact on both ranks with guards (`common::capture`); one graph per call, each
/// replay synchronized on both ranks before the next (a rank's multi-kernel graph could hold
/// back its peer's kernel on a hardware queue they share). Then one graph of all the calls on
/// 1 MiB per rank, when the ranks have GPUs of their own.
#[test]
fn captured_calls_replay_exactly_gpu() {
    let test = "captured_calls_replay_exactly_gpu";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let comms = common::init_comms(&devices, None);
    for count in [1, 1031, 262_147] {
        common::capture::capture_and_replay(test, &comms, count, 3, common::capture::Graphs::PerCall);
    }
    if devices[0] != devices[1] {
        common::capture::capture_and_replay(test, &comms, 1 << 18, 3, common::capture::Graphs::One);
    }
}
