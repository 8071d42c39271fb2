//! Exchanges among ranks as threads of this process: allgather of blobs of every size, barriers,
//! point-to-point messages by tag, a root started by rank 0 from an NCCL_COMM_ID-style id, and
//! four ranks as processes of this binary.
use crate::common::child;
use crate::{blob, lo, run};
use oxccl::bootstrap::{Bootstrap, UniqueId, get_unique_id_with};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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

/// An id from a `host:port` (NCCL_COMM_ID): rank 0's init starts the root; rank 1 starts first and
/// retries its connection until the root listens.
#[test]
fn comm_id_root_started_by_rank0() {
    // Held until rank 0's root binds it: rank 1's early connections can reach no other root.
    let port = crate::common::port::ReservedPort::new();
    let id = UniqueId::from_comm_id(&port.addr()).unwrap();
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

/// One child process of `four_processes`: init from its environment (`Bootstrap::init`),
/// allgather, check, send/recv around the ring.
#[test]
#[ignore = "child process of four_processes"]
fn child_rank() {
    child::enter();
    let (rank, n, id) = child::rank();
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

/// Four ranks as four processes (this test binary running `child_rank`), the id passed in hex
/// through the environment; all must run their entry and exit 0 within 60 s.
#[test]
fn four_processes() {
    let n = 4;
    let id = get_unique_id_with(&lo()).unwrap();
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut c = child::command(&child_entry!(child_rank));
            child::rank_env(&mut c, r, n, &id)
                .env("OXCCL_SOCKET_IFNAME", "=lo")
                .env("OXCCL_BOOTSTRAP_TIMEOUT", "20");
            child::spawn(&mut c)
        })
        .collect();
    let outs = child::wait_all(children, Instant::now() + Duration::from_secs(60));
    let report: String = outs
        .iter()
        .enumerate()
        .filter(|(_, (ok, _))| !ok)
        .map(|(r, (_, out))| format!("rank {r}:\n{out}\n"))
        .collect();
    assert!(report.is_empty(), "child processes failed:\n{report}");
}
