//! Init: the accessors, version and error strings; init errors with their exact messages, across
//! processes (settings that must agree on every rank); `init_rank` on CUDA without a GPU. (The
//! CUDA-only transport rules are unit tests in host/comm.rs.)
use crate::common::{self, child};
use crate::run_child;
use oxccl::bootstrap::get_unique_id;
use oxccl::{Comm, Device, Error, ResultCode};
use std::time::Duration;

#[test]
fn accessors_version_and_error_strings() {
    let comms = common::init_comms(&Device::cpus(3), None);
    for (r, c) in comms.iter().enumerate() {
        assert_eq!((c.count(), c.user_rank()), (3, r));
        let e = c.cu_device().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("invalid usage: rank {r} is on CPU-target device {r}, not on a CUDA device")
        );
    }
    // Cargo.toml's version 0.1.0, encoded as NCCL does: 0 × 10000 + 1 × 100 + 0.
    assert_eq!(oxccl::version(), 100);
    assert_eq!(oxccl::version_string(), "0.1.0");
    // ncclGetErrorString's texts.
    assert_eq!(
        Error::InvalidArgument("x".into()).error_string(),
        "invalid argument (run with NCCL_DEBUG=WARN for details)"
    );
    assert_eq!(oxccl::error_string_of(0), "no error");
    assert_eq!(oxccl::error_string(ResultCode::Timeout), "operation timed out");
}

/// The child processes of `init_errors_across_processes` and
/// `settings_that_decide_each_call_must_agree_across_ranks`: runs init_rank and prints the
/// outcome.
#[test]
#[ignore = "child process of the init error tests"]
fn child_init() {
    child::enter();
    let (rank, nranks, id) = child::rank();
    match Comm::init_rank(nranks, &id, rank, Device::Cpu(rank)) {
        Ok(c) => {
            c.destroy().unwrap();
            println!("INIT-OK");
        }
        Err(e) => println!("INIT-ERR {:?}: {e}", e.code()),
    }
}

/// Starts `extra.len()` ranks as processes, rank r with the environment `extra[r]`; returns
/// each rank's output line.
fn init_processes(extra: &[Vec<(&str, String)>]) -> Vec<String> {
    let id = {
        let _env = common::env::shared();
        child::hex(&get_unique_id().unwrap().to_bytes())
    };
    let n = extra.len();
    std::thread::scope(|s| {
        let hs: Vec<_> = extra
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let mut envs = vec![
                    ("OXCCL_CHILD_ID", id.clone()),
                    ("OXCCL_CHILD_RANK", r.to_string()),
                    ("OXCCL_CHILD_NRANKS", n.to_string()),
                ];
                envs.extend(e.iter().cloned());
                let entry = child_entry!(child_init);
                s.spawn(move || run_child(&entry, &envs, Duration::from_secs(60)))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                let (ok, out) = h.join().unwrap();
                assert!(ok, "{out}");
                out.lines()
                    .find_map(|l| l.find("INIT-").map(|i| l[i..].to_string()))
                    .unwrap_or_else(|| panic!("no INIT- line in {out}"))
            })
            .collect()
    })
}

#[test]
fn init_errors_across_processes() {
    // Ranks that disagree on NCCL_BUFFSIZE would write past each other's buffers: refused.
    let out = init_processes(&[
        vec![("NCCL_BUFFSIZE", "1048576".into())],
        vec![("NCCL_BUFFSIZE", "2097152".into())],
    ]);
    for (r, line) in out.iter().enumerate() {
        assert!(
            line.starts_with(&format!("INIT-ERR InvalidUsage: invalid usage: rank {r}: "))
                && line.contains(
                    "NCCL_BUFFSIZE differs across ranks: rank 0 has 1048576, rank 1 has 2097152 \
                     (also spelled OXCCL_BUFFSIZE; every rank must set the same value)"
                ),
            "rank {r}: {line}"
        );
    }
    // Control: the same environment everywhere works.
    let out = init_processes(&[vec![], vec![], vec![]]);
    assert_eq!(out, ["INIT-OK", "INIT-OK", "INIT-OK"]);
}

#[test]
fn settings_that_decide_each_call_must_agree_across_ranks() {
    // A rank planning another protocol, algorithm or channel count than its peers would wait for
    // them forever; FIFO sizes that differ with the same total would pass the size check and
    // corrupt: each is refused at init, on every rank, naming the variable and both values. The
    // same value spelled differently (list order, OXCCL_ spelling) agrees.
    let cases: [(&str, Vec<Vec<(&str, String)>>, &str); 5] = [
        (
            "NCCL_PROTO",
            vec![vec![("NCCL_PROTO", "LL".into())], vec![], vec![]],
            "NCCL_PROTO differs across ranks: rank 0 has {LL}, rank 1 has {LL,LL128,Simple}",
        ),
        (
            "NCCL_ALGO",
            vec![vec![], vec![], vec![("NCCL_ALGO", "ring".into())]],
            "NCCL_ALGO differs across ranks: rank 0 has {tree,ring}, rank 2 has {ring}",
        ),
        (
            "NCCL_MIN_NCHANNELS",
            vec![vec![], vec![("OXCCL_MIN_NCHANNELS", "2".into())], vec![]],
            "NCCL_MIN_NCHANNELS differs across ranks: rank 0 has unset, rank 1 has 2",
        ),
        (
            "NCCL_LL_BUFFSIZE with the same total",
            vec![
                vec![],
                vec![
                    ("NCCL_BUFFSIZE", format!("{}", 4194304 + 16384)),
                    ("NCCL_LL_BUFFSIZE", format!("{}", 524288 - 16384)),
                ],
                vec![],
            ],
            "NCCL_BUFFSIZE differs across ranks: rank 0 has 4194304, rank 1 has 4210688",
        ),
        (
            "OXCCL_TEST_INITIAL_STEP",
            vec![
                vec![("OXCCL_TEST_INITIAL_STEP", "4294967000".into())],
                vec![],
                vec![],
            ],
            "OXCCL_TEST_INITIAL_STEP differs across ranks: rank 0 has 4294967000, rank 1 has 0",
        ),
    ];
    for (what, envs, want) in cases {
        let out = init_processes(&envs);
        for (r, line) in out.iter().enumerate() {
            assert!(
                line.starts_with(&format!(
                    "INIT-ERR InvalidUsage: invalid usage: rank {r}: {want} "
                )),
                "{what}: rank {r}: {line}"
            );
        }
    }
    let same = vec![
        vec![("NCCL_PROTO", "Simple,LL".to_string())],
        vec![("OXCCL_PROTO", "ll,simple".to_string())],
    ];
    assert_eq!(init_processes(&same), ["INIT-OK", "INIT-OK"]);
}

#[test]
fn init_rank_on_cuda_without_a_gpu_is_no_cuda() {
    if Device::cuda_count() > 0 {
        skipped!(
            "SKIPPED: init_rank_on_cuda_without_a_gpu_is_no_cuda: a GPU is visible (this checks the error without one)"
        );
        return;
    }
    let _env = common::env::shared();
    let id = get_unique_id().unwrap();
    let e = Comm::init_rank(1, &id, 0, Device::Cuda(0)).unwrap_err();
    assert_eq!(e.code(), ResultCode::SystemError, "{e}");
    assert!(e.to_string().starts_with("no CUDA: "), "{e}");
}
