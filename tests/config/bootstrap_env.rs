//! The bootstrap's environment variables: OXCCL_/NCCL_BOOTSTRAP_TIMEOUT, NCCL_SOCKET_IFNAME
//! (CASES.md C31), NCCL_COMM_ID (rank 0 starts the root), and C33 (refused root, timeout 5 s)
//! through the environment. Environment variables are process-global, so everything runs
//! serially in one #[test] holding `common::env::Env`, and the variables are restored afterwards
//! (even on failure). Loopback only.
use crate::common;

use common::env::Env;
use oxccl::ResultCode;
use oxccl::bootstrap::{Bootstrap, BootstrapConfig, get_unique_id, get_unique_id_with, list_interfaces};
use std::time::{Duration, Instant};

/// Every variable this test touches (both spellings).
const VARS: &[&str] = &["BOOTSTRAP_TIMEOUT", "SOCKET_IFNAME", "COMM_ID"];

fn expect_err(
    r: oxccl::Result<impl std::fmt::Debug>,
    code: ResultCode,
    needles: &[&str],
    what: &str,
) -> String {
    let e = r.expect_err(what);
    let m = e.to_string();
    assert_eq!(e.code(), code, "{what}: {m}");
    for n in needles {
        assert!(m.contains(n), "{what}: message lacks {n:?}: {m}");
    }
    m
}

#[test]
fn bootstrap_environment() {
    let env = Env::clean(VARS);
    let lo = BootstrapConfig {
        ifname: Some("=lo".into()),
        timeout: Duration::from_secs(30),
        ..Default::default()
    };

    // Defaults.
    let c = BootstrapConfig::from_env().unwrap();
    assert_eq!(c, BootstrapConfig::default());
    assert_eq!(c.timeout, Duration::from_secs(120));

    // OXCCL_/NCCL_BOOTSTRAP_TIMEOUT: seconds; bad values name the variable.
    env.set(&[("NCCL_BOOTSTRAP_TIMEOUT", "7")]);
    assert_eq!(
        BootstrapConfig::from_env().unwrap().timeout,
        Duration::from_secs(7)
    );
    env.set(&[
        ("NCCL_BOOTSTRAP_TIMEOUT", "7"),
        ("OXCCL_BOOTSTRAP_TIMEOUT", "0.25"),
    ]);
    assert_eq!(
        BootstrapConfig::from_env().unwrap().timeout,
        Duration::from_millis(250)
    );
    for bad in ["abc", "", "0", "-3", "1e9", "nan"] {
        env.set(&[("OXCCL_BOOTSTRAP_TIMEOUT", bad)]);
        let what = format!("OXCCL_BOOTSTRAP_TIMEOUT={bad:?}");
        expect_err(
            BootstrapConfig::from_env(),
            ResultCode::InvalidArgument,
            &["OXCCL_BOOTSTRAP_TIMEOUT"],
            &what,
        );
        expect_err(
            get_unique_id(),
            ResultCode::InvalidArgument,
            &["OXCCL_BOOTSTRAP_TIMEOUT"],
            &what,
        );
    }

    // C31 through the environment: get_unique_id and init both fail, naming variable and value.
    let names: Vec<String> = list_interfaces().unwrap().into_iter().map(|i| i.name).collect();
    let all = format!("^{}", names.join(","));
    let good = get_unique_id_with(&lo).unwrap();
    for var in ["NCCL_SOCKET_IFNAME", "OXCCL_SOCKET_IFNAME"] {
        for value in ["nosuchif0", "=nosuchif0", all.as_str()] {
            env.set(&[(var, value), ("OXCCL_BOOTSTRAP_TIMEOUT", "5")]);
            let what = format!("C31 {var}={value}");
            let t = Instant::now();
            let needles = [var, value, "no matching interface"];
            let m = expect_err(get_unique_id(), ResultCode::InvalidUsage, &needles, &what);
            expect_err(
                Bootstrap::init(&good, 1, 2),
                ResultCode::InvalidUsage,
                &needles,
                &what,
            );
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "{what}: took {:?}",
                t.elapsed()
            );
            if value == "nosuchif0" && var == "NCCL_SOCKET_IFNAME" {
                eprintln!("C31: {m}");
            }
        }
    }

    // C33 through the environment: OXCCL_BOOTSTRAP_TIMEOUT=5, the id points at a closed port.
    // Held, never listened on, until the test ends: no other test's root can be given the port.
    let closed = crate::common::port::ReservedPort::new();
    let addr = closed.addr();
    env.set(&[
        ("NCCL_COMM_ID", &addr),
        ("OXCCL_BOOTSTRAP_TIMEOUT", "5"),
        ("NCCL_SOCKET_IFNAME", "lo"),
    ]);
    let id = get_unique_id().unwrap();
    assert!(id.root_on_rank0());
    env.set(&[("OXCCL_BOOTSTRAP_TIMEOUT", "5"), ("NCCL_SOCKET_IFNAME", "lo")]);
    let t = Instant::now();
    let m = expect_err(
        Bootstrap::init(&id, 1, 2),
        ResultCode::RemoteError,
        &[&addr, "Connection refused"],
        "C33",
    );
    let took = t.elapsed();
    eprintln!("C33 after {took:?}: {m}");
    assert!(
        took >= Duration::from_millis(4500) && took < Duration::from_secs(7),
        "C33 took {took:?}"
    );

    // NCCL_COMM_ID: every process computes the same id; rank 0's init starts the root.
    // Held until the ranks end; rank 0's root binds it (SO_REUSEADDR), no other root can.
    let reserved = crate::common::port::ReservedPort::new();
    let addr = reserved.addr();
    env.set(&[
        ("NCCL_COMM_ID", &addr),
        ("NCCL_SOCKET_IFNAME", "lo"),
        ("OXCCL_BOOTSTRAP_TIMEOUT", "30"),
    ]);
    let id = get_unique_id().unwrap();
    assert_eq!(get_unique_id().unwrap(), id);
    assert_eq!(id.root_addr().to_string(), addr);
    let ranks: Vec<_> = (0..3)
        .map(|r| {
            std::thread::spawn(move || {
                let bs = Bootstrap::init(&id, r, 3).unwrap();
                bs.allgather(&[r as u8; 2]).unwrap()
            })
        })
        .collect();
    for h in ranks {
        assert_eq!(h.join().unwrap(), vec![vec![0u8; 2], vec![1; 2], vec![2; 2]]);
    }
    for bad in ["nohost", "127.0.0.1:0", "[::1:80", "127.0.0.1:http"] {
        env.set(&[("OXCCL_COMM_ID", bad)]);
        expect_err(
            get_unique_id(),
            ResultCode::InvalidArgument,
            &["OXCCL_COMM_ID"],
            bad,
        );
    }
    drop(env);
}
