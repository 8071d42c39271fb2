//! The bootstrap layer (host/bootstrap): unique ids, the root, the ring, allgather, barrier and
//! point-to-point messages, with ranks as threads and (once) as child processes. CPU only,
//! loopback only (interfaces chosen through `BootstrapConfig`, never the environment, except in
//! the child processes, which get their own environment); every test is bounded by the
//! bootstrap timeout. CASES.md C31 (no matching interface) and C33 (refused root) are here too;
//! their environment-variable spellings are in tests/bootstrap_env.rs.
use oxccl::ResultCode;
use oxccl::bootstrap::{
    Bootstrap, BootstrapConfig, UNIQUE_ID_BYTES, UniqueId, get_unique_id_with, list_interfaces,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Loopback only, 30 s bound on every step (a hang fails the test instead of blocking CI).
/// Also installs a log subscriber (`OXCCL_LOG=oxccl::bootstrap=debug` shows the bootstrap's
/// log lines with `--nocapture`).
fn lo() -> BootstrapConfig {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OXCCL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    BootstrapConfig {
        timeout: Duration::from_secs(30),
        ifname: Some("=lo".into()),
        ..Default::default()
    }
}

/// Runs `f(rank's bootstrap)` on `n` threads after init; returns the results by rank.
fn run<T: Send + 'static>(
    id: UniqueId,
    n: usize,
    cfg: &BootstrapConfig,
    f: impl Fn(Bootstrap) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let (f, cfg) = (f.clone(), cfg.clone());
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .stack_size(256 << 10)
                .spawn(move || {
                    let bs = Bootstrap::init_with(&id, r, n, &cfg)
                        .unwrap_or_else(|e| panic!("rank {r}: init: {e}"));
                    assert_eq!((bs.rank(), bs.nranks(), bs.addrs().len()), (r, n, n));
                    f(bs)
                })
                .unwrap()
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect()
}

/// Rank r's blob in call `call`: distinct per rank and call, lengths differ per rank.
fn blob(r: usize, n: usize, call: usize) -> Vec<u8> {
    let len = (r * 7 + call) % 23;
    let mut v = format!("call {call} rank {r} of {n}:").into_bytes();
    v.extend((0..len).map(|i| (r * 31 + i * 3 + call) as u8));
    v
}

fn allgather_ranks(n: usize) {
    let t = Instant::now();
    let id = get_unique_id_with(&lo()).unwrap();
    assert!(id.root_addr().ip().is_loopback());
    let results = run(id, n, &lo(), move |bs| {
        let r = bs.rank();
        let mut got = Vec::new();
        for call in 0..3 {
            got.push(bs.allgather(&blob(r, n, call)).unwrap());
        }
        // Equal lengths: a u64 per rank.
        let eq = bs.allgather(&(r as u64 * 1000 + 7).to_le_bytes()).unwrap();
        (got, eq)
    });
    for (r, (got, eq)) in results.iter().enumerate() {
        for (call, all) in got.iter().enumerate() {
            let expect: Vec<Vec<u8>> = (0..n).map(|q| blob(q, n, call)).collect();
            assert_eq!(all, &expect, "rank {r} call {call}");
        }
        let expect: Vec<Vec<u8>> = (0..n)
            .map(|q| (q as u64 * 1000 + 7).to_le_bytes().to_vec())
            .collect();
        assert_eq!(eq, &expect, "rank {r} equal-length call");
    }
    eprintln!(
        "allgather with {n} ranks: {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
}

#[test]
fn allgather_1_rank() {
    allgather_ranks(1);
}

#[test]
fn allgather_2_ranks() {
    allgather_ranks(2);
}

#[test]
fn allgather_3_ranks() {
    allgather_ranks(3);
}

#[test]
fn allgather_8_ranks() {
    allgather_ranks(8);
}

#[test]
fn allgather_64_ranks() {
    allgather_ranks(64);
}

/// Blobs far larger than the socket buffers (and one empty), so that a ring step that wrote
/// before reading would deadlock.
#[test]
fn allgather_large_blobs() {
    let n = 3;
    let size = |r: usize| [0, (1 << 20) + 7, 3 << 20][r];
    let data = move |r: usize| {
        (0..size(r))
            .map(|i| (i * (r + 1) % 251) as u8)
            .collect::<Vec<u8>>()
    };
    let id = get_unique_id_with(&lo()).unwrap();
    let res = run(id, n, &lo(), move |bs| bs.allgather(&data(bs.rank())).unwrap());
    for (r, all) in res.iter().enumerate() {
        for (q, b) in all.iter().enumerate() {
            assert!(
                b == &data(q),
                "rank {r}: blob of rank {q} differs ({} bytes)",
                b.len()
            );
        }
    }
}

/// Nobody leaves a barrier before everybody has entered it, round after round.
#[test]
fn barrier() {
    let n = 5;
    let rounds = 4;
    let entered: Arc<Vec<AtomicUsize>> = Arc::new((0..rounds).map(|_| AtomicUsize::new(0)).collect());
    let id = get_unique_id_with(&lo()).unwrap();
    let e = entered.clone();
    run(id, n, &lo(), move |bs| {
        for round in 0..rounds {
            // Stagger arrivals: the last rank comes late.
            std::thread::sleep(Duration::from_millis(
                (bs.rank() as u64 * 7 + round as u64 * 3) % 40,
            ));
            e[round].fetch_add(1, Ordering::SeqCst);
            bs.barrier().unwrap();
            assert_eq!(
                e[round].load(Ordering::SeqCst),
                n,
                "rank {} left barrier {round} early",
                bs.rank()
            );
        }
    });
}

fn msg(src: usize, dst: usize, tag: u32, k: usize) -> Vec<u8> {
    let mut v = format!("{src}->{dst} tag {tag} #{k}").into_bytes();
    v.resize(v.len() + (src * 5 + dst * 3 + tag as usize) % 40, b'.');
    v
}

/// Every rank sends to every rank (itself included), several tags, two messages per tag (which
/// must arrive in order); receivers take them in a different order than they were sent. Then a
/// 4 MiB message and an empty one.
#[test]
fn send_recv_pairs() {
    let n = 5;
    let tags = [0u32, 7, 0xdead_beef];
    let big = |k: usize| (0..(4 << 20)).map(|i| (i * 13 + k) as u8).collect::<Vec<u8>>();
    let id = get_unique_id_with(&lo()).unwrap();
    run(id, n, &lo(), move |bs| {
        let me = bs.rank();
        for dst in (0..n).map(|k| (me + k) % n) {
            for &tag in &tags {
                for k in 0..2 {
                    bs.send(dst, tag, &msg(me, dst, tag, k)).unwrap();
                }
            }
        }
        for src in (0..n).rev() {
            for &tag in tags.iter().rev() {
                for k in 0..2 {
                    let got = bs.recv(src, tag).unwrap();
                    assert_eq!(got, msg(src, me, tag, k), "rank {me} from {src} tag {tag} #{k}");
                }
            }
        }
        if me == 0 {
            bs.send(n - 1, 99, &big(1)).unwrap();
            bs.send(1, 98, &[]).unwrap();
        }
        if me == n - 1 {
            assert!(bs.recv(0, 99).unwrap() == big(1));
        }
        if me == 1 {
            assert!(bs.recv(0, 98).unwrap().is_empty());
        }
        bs.barrier().unwrap();
    });
}

/// Writes bytes laid out as the bootstrap wire header (host/bootstrap/socket.rs documents it).
fn header(kind: u16, secret: u64, rank: u32, nranks: u32, tag: u32, len: u64) -> Vec<u8> {
    let mut b = b"OXBS".to_vec();
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&secret.to_le_bytes());
    b.extend_from_slice(&rank.to_le_bytes());
    b.extend_from_slice(&nranks.to_le_bytes());
    b.extend_from_slice(&tag.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b
}

/// Connections that must be dropped: junk, a foreign secret, bogus lengths, a wrong kind, half a
/// header, and one that stays silent (kept open by the caller).
fn junk_connections(addr: SocketAddr, secret: u64, nranks: u32) -> Vec<TcpStream> {
    let sends: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        vec![0xff; 40],
        header(1, secret ^ 1, 0, nranks, 0, 28),
        header(1, secret, 0, nranks, 0, u64::MAX),
        header(1, secret, 0, nranks, 0, 1 << 40),
        header(5, secret, 0, nranks, 0, (1 << 30) + 1),
        header(9, secret, 0, nranks, 0, 0),
        header(1, secret, 0, nranks, 0, 28)[..20].to_vec(),
    ];
    let mut keep = Vec::new();
    for s in sends {
        let mut c = TcpStream::connect(addr).unwrap();
        let _ = c.write_all(&s);
        keep.push(c);
    }
    keep.push(TcpStream::connect(addr).unwrap()); // silent
    keep
}

/// Junk sent to the root before the real ranks register is dropped; init still completes, and
/// quickly (no stall on the silent connection). Same for junk sent to a rank's listener after
/// init: point-to-point messages still work.
#[test]
fn junk_connections_are_dropped() {
    let n = 3;
    let id = get_unique_id_with(&lo()).unwrap();
    let keep = junk_connections(id.root_addr(), id.secret(), n as u32);
    let t = Instant::now();
    let secret = id.secret();
    run(id, n, &lo(), move |bs| {
        let me = bs.rank();
        bs.barrier().unwrap();
        let mut keep2 = Vec::new();
        if me == 0 {
            keep2 = junk_connections(bs.addrs()[1], secret, n as u32);
            // A point-to-point message from a rank that does not exist, and one for another nranks.
            for h in [
                header(5, secret, 7, n as u32, 1, 3),
                header(5, secret, 0, 9, 1, 3),
            ] {
                let mut c = TcpStream::connect(bs.addrs()[1]).unwrap();
                c.write_all(&h).unwrap();
                c.write_all(b"bad").unwrap();
                keep2.push(c);
            }
        }
        bs.barrier().unwrap();
        bs.send((me + 1) % n, 5, &[me as u8; 3]).unwrap();
        assert_eq!(
            bs.recv((me + n - 1) % n, 5).unwrap(),
            vec![((me + n - 1) % n) as u8; 3]
        );
        bs.barrier().unwrap();
        drop(keep2);
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "init took {:?} with junk around",
        t.elapsed()
    );
    drop(keep);
}

/// A well-formed registration that the root must answer with an error (ranks disagree on
/// nranks): both ranks fail with InvalidUsage naming nranks, in bounded time.
#[test]
fn nranks_mismatch_fails_everyone() {
    let id = get_unique_id_with(&lo()).unwrap();
    let t = Instant::now();
    let a = std::thread::spawn(move || Bootstrap::init_with(&id, 0, 2, &lo()).map(|_| ()));
    std::thread::sleep(Duration::from_millis(100));
    let b = std::thread::spawn(move || Bootstrap::init_with(&id, 1, 3, &lo()).map(|_| ()));
    for (who, h) in [("rank 0 of 2", a), ("rank 1 of 3", b)] {
        let e = h.join().unwrap().expect_err(who);
        assert_eq!(e.code(), ResultCode::InvalidUsage, "{who}: {e}");
        assert!(e.to_string().contains("nranks"), "{who}: {e}");
    }
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// An id from a `host:port` (NCCL_COMM_ID): rank 0's init starts the root; rank 1 starts first and
/// retries its connection until the root listens.
#[test]
fn comm_id_root_started_by_rank0() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let id = UniqueId::from_comm_id(&format!("127.0.0.1:{port}")).unwrap();
    assert!(id.root_on_rank0());
    let cfg = lo();
    let c1 = cfg.clone();
    let r1 = std::thread::spawn(move || {
        let bs = Bootstrap::init_with(&id, 1, 2, &c1).unwrap();
        bs.allgather(b"one").unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    let bs = Bootstrap::init_with(&id, 0, 2, &cfg).unwrap();
    let all = bs.allgather(b"zero").unwrap();
    assert_eq!(all, vec![b"zero".to_vec(), b"one".to_vec()]);
    assert_eq!(r1.join().unwrap(), all);
}

/// C33: the id points at a closed port on 127.0.0.1; with a 5 s timeout, init fails within the
/// timeout plus slack, naming addr:port and the OS reason, after retrying (not at once).
#[test]
fn c33_refused_root() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let id = UniqueId::from_bytes(
        &UniqueId::from_comm_id(&format!("127.0.0.1:{port}"))
            .unwrap()
            .to_bytes(),
    )
    .unwrap();
    let cfg = BootstrapConfig {
        timeout: Duration::from_secs(5),
        ..lo()
    };
    let t = Instant::now();
    let e = Bootstrap::init_with(&id, 1, 2, &cfg).unwrap_err();
    let took = t.elapsed();
    let m = e.to_string();
    eprintln!("C33 after {took:?}: {m}");
    assert!(
        matches!(e.code(), ResultCode::RemoteError | ResultCode::SystemError),
        "{m}"
    );
    assert!(m.contains(&format!("127.0.0.1:{port}")), "{m}");
    assert!(m.contains("Connection refused"), "{m}");
    assert!(
        took >= Duration::from_millis(4500) && took < Duration::from_secs(7),
        "took {took:?}"
    );
}

/// C31: NCCL_SOCKET_IFNAME values that match nothing (prefix, exact, and a `^` list excluding
/// every interface) fail get_unique_id and init with InvalidUsage naming the variable, the value
/// and "no matching interface".
#[test]
fn c31_no_matching_interface() {
    let names: Vec<String> = list_interfaces().unwrap().into_iter().map(|i| i.name).collect();
    let all = format!("^{}", names.join(","));
    let good = get_unique_id_with(&lo()).unwrap();
    for value in ["nosuchif0", "=nosuchif0", all.as_str()] {
        let cfg = BootstrapConfig {
            ifname: Some(value.into()),
            ..lo()
        };
        let t = Instant::now();
        let e1 = get_unique_id_with(&cfg).unwrap_err();
        let e2 = Bootstrap::init_with(&good, 0, 2, &cfg).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        for e in [e1, e2] {
            let m = e.to_string();
            assert_eq!(e.code(), ResultCode::InvalidUsage, "{m}");
            assert!(
                m.contains("NCCL_SOCKET_IFNAME") && m.contains(value) && m.contains("no matching interface"),
                "{m}"
            );
        }
    }
}

#[test]
fn corrupt_id_is_invalid_argument() {
    let id = get_unique_id_with(&lo()).unwrap();
    let bytes = id.to_bytes();
    assert_eq!(bytes.len(), UNIQUE_ID_BYTES);
    assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    assert_eq!(UniqueId::from_bytes(&bytes).unwrap(), id);
    let mut flipped = bytes;
    flipped[20] ^= 1;
    let mut cases = vec![
        flipped.to_vec(),
        vec![0u8; 128],
        bytes[..100].to_vec(),
        vec![0xab; 128],
    ];
    let mut long = bytes.to_vec();
    long.push(0);
    cases.push(long);
    for c in cases {
        let e = UniqueId::from_bytes(&c).unwrap_err();
        assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
        assert!(e.to_string().contains("unique id"), "{e}");
    }
}

#[test]
fn rank_and_nranks_out_of_range() {
    let id = get_unique_id_with(&lo()).unwrap();
    let cases = [
        (2usize, 2usize, "rank 2", "0..2"),
        (5, 3, "rank 5", "0..3"),
        (0, 0, "nranks 0", "1..="),
    ];
    for (rank, nranks, what, range) in cases {
        let e = Bootstrap::init_with(&id, rank, nranks, &lo()).unwrap_err();
        let m = e.to_string();
        assert_eq!(e.code(), ResultCode::InvalidArgument, "{m}");
        assert!(m.contains(what) && m.contains(range), "{m}");
    }
    // Peers out of range, once there is a bootstrap.
    let id = get_unique_id_with(&lo()).unwrap();
    let bs = Bootstrap::init_with(&id, 0, 1, &lo()).unwrap();
    for e in [bs.send(1, 0, b"x").unwrap_err(), bs.recv(3, 0).unwrap_err()] {
        assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
        assert!(
            e.to_string().contains("peer") && e.to_string().contains("0..1"),
            "{e}"
        );
    }
    // A receive with nothing coming times out (short timeout for this check).
    let id = get_unique_id_with(&lo()).unwrap();
    let cfg = BootstrapConfig {
        timeout: Duration::from_millis(300),
        ..lo()
    };
    let bs = Bootstrap::init_with(&id, 0, 1, &cfg).unwrap();
    let e = bs.recv(0, 1).unwrap_err();
    assert_eq!(e.code(), ResultCode::Timeout, "{e}");
}

const CHILD_ID: &str = "OXCCL_TEST_BOOTSTRAP_ID";
const CHILD_RANK: &str = "OXCCL_TEST_BOOTSTRAP_RANK";
const CHILD_NRANKS: &str = "OXCCL_TEST_BOOTSTRAP_NRANKS";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The body of one child process of `four_processes` (a no-op in a normal test run): init from
/// the environment (`Bootstrap::init`), allgather, check, send/recv around the ring.
#[test]
fn child_process_rank() {
    let Ok(id_hex) = std::env::var(CHILD_ID) else {
        return;
    };
    let rank: usize = std::env::var(CHILD_RANK).unwrap().parse().unwrap();
    let n: usize = std::env::var(CHILD_NRANKS).unwrap().parse().unwrap();
    let id = UniqueId::from_bytes(&unhex(&id_hex)).unwrap();
    let bs = Bootstrap::init(&id, rank, n).unwrap();
    assert_eq!(bs.timeout(), Duration::from_secs(20));
    let all = bs.allgather(&blob(rank, n, 0)).unwrap();
    assert_eq!(all, (0..n).map(|q| blob(q, n, 0)).collect::<Vec<_>>());
    let pid = std::process::id();
    let pids = bs.allgather(&pid.to_le_bytes()).unwrap();
    let mut distinct: Vec<_> = pids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), n, "ranks should be distinct processes");
    bs.send((rank + 1) % n, 3, &pids[rank]).unwrap();
    assert_eq!(bs.recv((rank + n - 1) % n, 3).unwrap(), pids[(rank + n - 1) % n]);
    bs.barrier().unwrap();
}

/// Four ranks as four processes (this test binary, filtered to `child_process_rank`), the id
/// passed in hex through the environment; all must exit 0 within 60 s.
#[test]
fn four_processes() {
    let n = 4;
    let id = get_unique_id_with(&lo()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..n)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args(["child_process_rank", "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD_ID, hex(&id.to_bytes()))
                .env(CHILD_RANK, r.to_string())
                .env(CHILD_NRANKS, n.to_string())
                .env("OXCCL_SOCKET_IFNAME", "=lo")
                .env("OXCCL_BOOTSTRAP_TIMEOUT", "20")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for v in [
                "NCCL_COMM_ID",
                "OXCCL_COMM_ID",
                "NCCL_BOOTSTRAP_TIMEOUT",
                "NCCL_SOCKET_IFNAME",
            ] {
                c.env_remove(v);
            }
            c.spawn().unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut codes = vec![None; n];
    while codes.iter().any(Option::is_none) && Instant::now() < deadline {
        for (r, c) in children.iter_mut().enumerate() {
            if codes[r].is_none() {
                codes[r] = c.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut report = String::new();
    for (r, c) in children.iter_mut().enumerate() {
        if codes[r].is_none() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut out = String::new();
        let _ = c.stdout.take().map(|mut s| s.read_to_string(&mut out));
        let _ = c.stderr.take().map(|mut s| s.read_to_string(&mut out));
        // The filter must have run exactly the child test (an empty filter would pass vacuously).
        if codes[r].is_none_or(|s| !s.success()) || !out.contains("test result: ok. 1 passed") {
            report += &format!("rank {r}: {:?}\n{out}\n", codes[r]);
        }
    }
    assert!(report.is_empty(), "child processes failed:\n{report}");
}
