//! Environment parameters (CASES.md C12): bad values are rejected at init with InvalidArgument
//! naming the variable; odd values are rounded and still give exact results. Environment
//! variables are process-global, so everything runs serially in one #[test] holding
//! `common::env::Env`, and the variables are restored afterwards (even on failure). A second test
//! checks the helpers' staged variables (`common::env::Staged`), which the long collective tests use.

use crate::common;

use common::env::Env;

use oxccl::perf::check;
use oxccl::{Comm, DataType, Device, Func, RedOp, ResultCode};
use std::time::{Duration, Instant};

/// Every variable these tests touch, and every other one `Params` reads (so the defaults are
/// the defaults whatever the run sets), both spellings.
const VARS: &[&str] = &[
    "BUFFSIZE",
    "NTHREADS",
    "MAX_NCHANNELS",
    "MIN_NCHANNELS",
    "ALLOW_SHARED_DEVICE",
    "LL_BUFFSIZE",
    "LL128_BUFFSIZE",
    "TEST_INITIAL_STEP",
    "P2P_LEVEL",
    "P2P_DIRECT_DISABLE",
    "CPU_NTHREADS",
    "CPU_TEAM",
    "TIMEOUT",
    "FLIGHT_RECORDER_SIZE",
    "FLIGHT_RECORDER_DUMP",
    "NCHANNELS_PER_PEER",
    "P2P_LL_THRESHOLD",
    "CHECK_CALLS",
];

const COUNT: usize = 1_000_003;
const SEED: u64 = 0xC12;

/// Per rank count: the inputs of `check::fill_input` (f32 sum) and the expected result.
struct Data {
    n: usize,
    inputs: Vec<Vec<u8>>,
    expected: Vec<u8>,
}

fn data(n: usize) -> Data {
    let inputs = (0..n)
        .map(|r| check::fill_input(Func::AllReduce, DataType::F32, RedOp::Sum, r, n, SEED, COUNT).unwrap())
        .collect();
    let expected = check::expected(Func::AllReduce, DataType::F32, RedOp::Sum, n, SEED, COUNT).unwrap();
    Data { n, inputs, expected }
}

/// Init must fail with InvalidArgument naming `var`.
fn expect_rejected(devices: &[Device], var: &str, what: &str) {
    match Comm::init_all(devices) {
        Ok(_) => panic!("{what}: init_all succeeded; expected InvalidArgument naming {var}"),
        Err(e) => {
            let msg = e.to_string();
            assert_eq!(e.code(), ResultCode::InvalidArgument, "{what}: {msg}");
            assert!(msg.contains(var), "{what}: message does not name {var}: {msg}");
        }
    }
}

/// Creates communicators under the current environment, checks the parameters through
/// `check_params`, and runs AllReduce f32 sum of COUNT elements out of place: first rank r
/// contributing r+1 (n(n+1)/2 everywhere, as C12 states it), then nccl-tests data, exactly.
/// Returns the channels the last call used.
fn exact(devices: &[Device], d: &Data, what: &str, check_params: &dyn Fn(&oxccl::params::Params)) -> u32 {
    assert_eq!(devices.len(), d.n);
    let n = d.n;
    let t = Instant::now();
    let comms = Comm::init_all(devices).unwrap_or_else(|e| panic!("{what}: init_all: {e}"));
    for c in &comms {
        check_params(c.params());
    }
    let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    let bytes = COUNT * 4;
    let send: Vec<_> = comms.iter().map(|c| c.device().alloc(bytes).unwrap()).collect();
    let recv: Vec<_> = comms
        .iter()
        .map(|c| c.device().alloc(bytes + 64).unwrap())
        .collect();
    let run = |label: &str, inputs: &dyn Fn(usize) -> Vec<u8>, expected: &[u8]| {
        for r in 0..n {
            send[r].write(0, &inputs(r)).unwrap();
            recv[r].fill(0xFF).unwrap();
        }
        for (r, c) in comms.iter().enumerate() {
            c.all_reduce(
                &send[r],
                recv[r].slice(0, bytes).unwrap(),
                COUNT,
                DataType::F32,
                RedOp::Sum,
                &streams[r],
            )
            .unwrap_or_else(|e| panic!("{what} ({label}): rank {r}: {e}"));
        }
        for (r, s) in streams.iter().enumerate() {
            s.synchronize()
                .unwrap_or_else(|e| panic!("{what} ({label}): rank {r}: synchronize: {e}"));
        }
        for r in 0..n {
            let got = recv[r].to_vec().unwrap();
            let (data, guard) = got.split_at(bytes);
            let wrong = if data == expected {
                0
            } else {
                check::count_wrong(DataType::F32, RedOp::Sum, data, expected, n)
            };
            if wrong > 0 {
                let i = check::first_wrong(DataType::F32, RedOp::Sum, data, expected, n).unwrap_or(0);
                panic!(
                    "{what} ({label}) nranks={n}: rank {r}: {wrong} of {COUNT} elements wrong; first at {i}: got {}, expected {}",
                    check::format_elem(DataType::F32, &data[4 * i..]),
                    check::format_elem(DataType::F32, &expected[4 * i..])
                );
            }
            assert!(
                guard.iter().all(|&b| b == 0xFF),
                "{what} ({label}) nranks={n}: rank {r}: bytes after the result were written"
            );
        }
    };
    let tri = ((n * (n + 1) / 2) as f32).to_le_bytes();
    let tri: Vec<u8> = (0..COUNT).flat_map(|_| tri).collect();
    run(
        "rank r gives r+1",
        &|r| ((r + 1) as f32).to_le_bytes().repeat(COUNT),
        &tri,
    );
    run("nccl-tests data", &|r| d.inputs[r].clone(), &d.expected);
    let nch = comms[0].last_choice().map(|c| c.nchannels).unwrap_or(0);
    eprintln!(
        "env_params: {what} nranks={n}: exact ({} channels) in {:.2?}",
        nch,
        t.elapsed()
    );
    nch
}

#[test]
fn env_params_serial() {
    let env = Env::clean(VARS);
    let dog = common::Watchdog::new("env_params_serial", Duration::from_secs(300));
    let t0 = Instant::now();
    let d2 = data(2);
    let d4 = data(4);
    let cpu = |n| Device::cpus(n);
    let gpus = Device::cuda_count();
    let gpu_data = if gpus >= 2 { Some(data(gpus)) } else { None };
    if gpus < 2 {
        let why = if gpus == 0 {
            format!("no CUDA driver/GPU visible ({})", common::no_gpu_reason())
        } else {
            format!("needs 2 GPUs, {gpus} visible")
        };
        skipped!("SKIPPED: env_params_serial (GPU runs): {why}");
    }
    // Runs `exact` on 2 and 4 CPU ranks and, when there are 2 or more, on every GPU.
    let all = |what: &str, p: &dyn Fn(&oxccl::params::Params)| {
        dog.step(what.to_string());
        exact(&cpu(2), &d2, what, p);
        exact(&cpu(4), &d4, what, p);
        if let Some(g) = &gpu_data {
            let _l = common::gpu_lock();
            exact(&Device::all_cuda(), g, &format!("{what} (GPU)"), p);
        }
    };

    // Defaults.
    env.set(&[]);
    all("defaults", &|p| assert_eq!(*p, oxccl::params::Params::default()));

    // Malformed and out-of-range values: rejected at init, naming the variable.
    for bad in ["abc", "0", "-1", "1", "", "4k", "99999999999999999999"] {
        env.set(&[("NCCL_BUFFSIZE", bad)]);
        expect_rejected(&cpu(2), "NCCL_BUFFSIZE", &format!("NCCL_BUFFSIZE={bad:?}"));
    }
    for bad in ["abc", "0", "32", "2048", "-64"] {
        env.set(&[("NCCL_NTHREADS", bad)]);
        expect_rejected(&cpu(2), "NCCL_NTHREADS", &format!("NCCL_NTHREADS={bad:?}"));
    }
    let too_many = (oxccl_gpu::abi::MAX_CHANNELS + 1).to_string();
    for bad in ["abc", "0", too_many.as_str()] {
        env.set(&[("NCCL_MAX_NCHANNELS", bad)]);
        expect_rejected(
            &cpu(2),
            "NCCL_MAX_NCHANNELS",
            &format!("NCCL_MAX_NCHANNELS={bad:?}"),
        );
        env.set(&[("NCCL_MIN_NCHANNELS", bad)]);
        expect_rejected(
            &cpu(2),
            "NCCL_MIN_NCHANNELS",
            &format!("NCCL_MIN_NCHANNELS={bad:?}"),
        );
    }
    // The OXCCL_ spelling wins over NCCL_ (and is the one named).
    env.set(&[("NCCL_BUFFSIZE", "1000000"), ("OXCCL_BUFFSIZE", "abc")]);
    expect_rejected(
        &cpu(2),
        "OXCCL_BUFFSIZE",
        "OXCCL_BUFFSIZE=abc over a valid NCCL_BUFFSIZE",
    );
    if gpus >= 1 {
        env.set(&[("NCCL_BUFFSIZE", "abc")]);
        expect_rejected(&[Device::Cuda(0)], "NCCL_BUFFSIZE", "NCCL_BUFFSIZE=abc on a GPU");
    }

    // Values that are rounded: exact results.
    env.set(&[("NCCL_BUFFSIZE", "1000000")]);
    all("NCCL_BUFFSIZE=1000000", &|p| {
        assert_eq!(
            p.buffsize, 999_936,
            "NCCL_BUFFSIZE=1000000 should round down to a multiple of FIFO_STEPS × 16"
        )
    });
    env.set(&[("OXCCL_BUFFSIZE", "8192"), ("NCCL_BUFFSIZE", "abc")]);
    all("OXCCL_BUFFSIZE=8192 (the minimum) over NCCL_BUFFSIZE=abc", &|p| {
        assert_eq!(p.buffsize, 8192)
    });
    env.set(&[("NCCL_BUFFSIZE", "123457")]);
    all("NCCL_BUFFSIZE=123457", &|p| {
        assert_eq!(p.buffsize, 123457 / 128 * 128, "rounding of 123457")
    });
    for (v, want) in [("480", 480), ("64", 64), ("100", 96)] {
        env.set(&[("NCCL_NTHREADS", v)]);
        all(&format!("NCCL_NTHREADS={v}"), &|p| {
            assert_eq!(p.nthreads, want, "NCCL_NTHREADS={v}")
        });
    }
    env.set(&[("NCCL_NTHREADS", "480"), ("NCCL_BUFFSIZE", "1000000")]);
    all("NCCL_NTHREADS=480 NCCL_BUFFSIZE=1000000", &|p| {
        assert_eq!((p.nthreads, p.buffsize), (480, 999_936))
    });

    // Channel limits show in the plan.
    env.set(&[("NCCL_MAX_NCHANNELS", "1")]);
    dog.step("NCCL_MAX_NCHANNELS=1");
    assert_eq!(
        exact(&cpu(2), &d2, "NCCL_MAX_NCHANNELS=1", &|p| assert_eq!(
            p.max_nchannels,
            Some(1)
        )),
        1
    );
    env.set(&[("OXCCL_MAX_NCHANNELS", "3")]);
    dog.step("OXCCL_MAX_NCHANNELS=3");
    assert_eq!(
        exact(&cpu(4), &d4, "OXCCL_MAX_NCHANNELS=3", &|p| assert_eq!(
            p.max_nchannels,
            Some(3)
        )),
        3
    );

    // Sharing a device on purpose (testing only) is allowed when asked for.
    env.set(&[("OXCCL_ALLOW_SHARED_DEVICE", "1")]);
    dog.step("OXCCL_ALLOW_SHARED_DEVICE=1");
    exact(
        &[Device::Cpu(0), Device::Cpu(0)],
        &d2,
        "OXCCL_ALLOW_SHARED_DEVICE=1 with Cpu(0) twice",
        &|_| {},
    );
    env.set(&[("OXCCL_ALLOW_SHARED_DEVICE", "0")]);
    let e = Comm::init_all(&[Device::Cpu(0), Device::Cpu(0)])
        .err()
        .expect("OXCCL_ALLOW_SHARED_DEVICE=0 still allowed a shared device");
    assert_eq!(e.code(), ResultCode::InvalidUsage, "{e}");

    // The largest accepted value (last: on a GPU whose kernels cannot launch 1024 threads it must
    // still be either rejected at init or rounded, never fail later, as C12 requires).
    env.set(&[("NCCL_NTHREADS", "1024")]);
    all("NCCL_NTHREADS=1024", &|p| {
        assert!(
            (64..=1024).contains(&p.nthreads) && p.nthreads % 32 == 0,
            "NCCL_NTHREADS=1024 gave nthreads {}",
            p.nthreads
        )
    });

    drop(dog);
    drop(env);
    eprintln!("env_params_serial: {:.2?}", t0.elapsed());
}

/// The test helpers' staged variables (`common::env::Staged`): set while a helper holds the
/// environment lock (`common::env::shared`), the value found before back afterwards, also for a
/// name both cleared and set (saved twice, restored last saved first).
#[test]
fn staged_variables_are_set_only_while_a_helper_holds_the_lock() {
    use common::env::{Staged, set_for_the_process, shared};
    let read = || {
        let _hold = shared();
        std::env::var("OXCCL_STAGED_PROBE").ok()
    };
    set_for_the_process("OXCCL_STAGED_PROBE", "before");
    let staged = Staged::clean(&["STAGED_PROBE"]);
    assert_eq!(read(), None, "cleared while held");
    staged.set(&[("OXCCL_STAGED_PROBE", "staged")]);
    for _ in 0..2 {
        assert_eq!(read().as_deref(), Some("staged"), "set while held");
    }
    drop(staged);
    assert_eq!(read().as_deref(), Some("before"), "restored after every hold");
}
