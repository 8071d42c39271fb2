//! What the bootstrap refuses, in bounded time: junk connections (dropped, init goes on), ranks
//! that disagree on nranks, a root that refuses connections (C33), interfaces that match nothing
//! (C31), corrupt unique ids, ranks and peers out of range, receives with nothing coming.
use crate::{lo, run};
use oxccl::ResultCode;
use oxccl::bootstrap::{
    Bootstrap, BootstrapConfig, UNIQUE_ID_BYTES, UniqueId, get_unique_id_with, list_interfaces,
};
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

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

/// C33: the id points at a closed port on 127.0.0.1; with a 5 s timeout, init fails within the
/// timeout plus slack, naming addr:port and the OS reason, after retrying (not at once).
#[test]
fn c33_refused_root() {
    // Held, never listened on, for the whole test: no other test's root can be given the port.
    let closed = crate::common::port::ReservedPort::new();
    let port = closed.port();
    let id = UniqueId::from_bytes(
        &UniqueId::from_comm_id(&closed.addr())
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

/// What C33 and the `NCCL_COMM_ID` tests rely on: while a `ReservedPort` lives, 2,000 binds of
/// port 0 held at once never return its port, a connection to it is refused, and a listener
/// asking for exactly that port (as the bootstrap root does) still binds it.
#[test]
fn reserved_port_is_refused_and_never_handed_out() {
    let reserved = crate::common::port::ReservedPort::new();
    let held: Vec<TcpListener> = (0..2000)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    for l in &held {
        assert_ne!(l.local_addr().unwrap().port(), reserved.port());
    }
    drop(held);
    let e = TcpStream::connect(reserved.addr()).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    let root = TcpListener::bind(reserved.addr()).unwrap();
    let _peer = TcpStream::connect(reserved.addr()).unwrap();
    let (_conn, _) = root.accept().unwrap();
}
