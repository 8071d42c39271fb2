//! Point-to-point sends and receives and groups, checked exactly on the CPU target (every run):
//! each rank's received bytes, the guard bytes around every output (poisoned before the call),
//! out of place and with the receive in the send's buffer, as a thread per rank and as one thread
//! driving every rank inside one group (NCCL's one thread per process), over every transport
//! between the ranks of one `init_all` (P2P, SHM, NET); sizes that differ between a send and its
//! receive; calls matched in issue order, many on one connection in one group and grouped
//! differently on the two sides; all-to-all-shaped groups; the rank itself as peer; the argument
//! errors. GPU runs are in `gpu_collectives`.
use crate::common;

use common::env::{Env, Staged};
use common::{BACK, FRONT, sentinel};
use oxccl::{Comm, DataType, Device, DeviceBuffer, Error, Stream};

const VARS: &[&str] = &[
    "P2P_DISABLE",
    "SHM_DISABLE",
    "NCHANNELS_PER_PEER",
    "BUFFSIZE",
    "LL_BUFFSIZE",
    "NET",
    "P2P_LL_THRESHOLD",
    "TEST_INITIAL_STEP",
];

/// The byte `i` that rank `from` sends to rank `to` in message `msg`.
fn byte(from: usize, to: usize, msg: usize, i: usize) -> u8 {
    ((i as u32).wrapping_mul(131) ^ (from as u32 * 37 + to as u32 * 11 + msg as u32 * 101)) as u8
}

fn payload(from: usize, to: usize, msg: usize, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| byte(from, to, msg, i)).collect()
}

/// A buffer of `bytes` data bytes between guards, the guards and data poisoned with `salt`'s
/// sentinel (`data` written when given).
fn guarded(dev: Device, bytes: usize, salt: u8, data: Option<&[u8]>) -> DeviceBuffer {
    let b = dev.alloc(FRONT + bytes + BACK).unwrap();
    b.write(0, &sentinel(FRONT + bytes + BACK, salt)).unwrap();
    if let Some(d) = data {
        b.write(FRONT, d).unwrap();
    }
    b
}

/// Checks `b`'s data against `want` (its first `want.len()` bytes) and every other byte against
/// the sentinel of `salt`; the message names `what`.
fn check(b: &DeviceBuffer, bytes: usize, salt: u8, want: &[u8], what: &str) {
    let got = b.to_vec().unwrap();
    let poison = sentinel(FRONT + bytes + BACK, salt);
    let mut wrong = 0;
    let mut first = None;
    for (i, (&g, &p)) in got.iter().zip(&poison).enumerate() {
        let expect = if i >= FRONT && i < FRONT + want.len() { want[i - FRONT] } else { p };
        if g != expect {
            wrong += 1;
            first.get_or_insert(i);
        }
    }
    assert_eq!(wrong, 0, "{what}: {wrong} wrong bytes, first at byte {first:?} (data at {FRONT}..{})", FRONT + want.len());
}

/// Every rank sends `count` elements of `dtype` to rank + `shift` and receives from rank −
/// `shift`, inside one group per rank thread; exact results and guards.
fn shifted_exchange(comms: &[Comm], count: usize, dtype: DataType, shift: usize, what: &str) {
    let n = comms.len();
    let bytes = count * dtype.size();
    // Every rank sets up its buffers before any launches (ranks sharing a GPU: an allocation or
    // a synchronous copy waits for the kernels of the whole device, a peer's spinning one too).
    let ready = std::sync::Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let (to, from) = ((r + shift) % n, (r + n - shift % n) % n);
        let s = guarded(dev, bytes, 1, Some(&payload(r, to, 0, bytes)));
        let d = guarded(dev, bytes, 2, None);
        let stream = dev.new_stream().unwrap();
        ready.wait();
        oxccl::group(|| -> oxccl::Result<()> {
            c.send(s.slice(FRONT, bytes)?, count, dtype, to, &stream)?;
            c.recv(d.slice(FRONT, bytes)?, count, dtype, from, &stream)
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        stream.synchronize().unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        check(&d, bytes, 2, &payload(from, r, 0, bytes), &format!("{what}: rank {r} from {from}, {count} × {dtype}"));
        check(&s, bytes, 1, &payload(r, to, 0, bytes), &format!("{what}: rank {r}'s send buffer"));
    });
}

/// All-to-all from sends and receives in one group per rank: rank `r` sends block `p` of its
/// input to rank `p` and receives rank `p`'s block `r` into its block `p`.
fn all_to_all(comms: &[Comm], block: usize, what: &str) {
    let n = comms.len();
    let ready = std::sync::Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let input: Vec<u8> = (0..n).flat_map(|p| payload(r, p, 0, block)).collect();
        let s = guarded(dev, n * block, 3, Some(&input));
        let d = guarded(dev, n * block, 4, None);
        let stream = dev.new_stream().unwrap();
        ready.wait();
        oxccl::group_start().unwrap();
        for p in 0..n {
            c.send(s.slice(FRONT + p * block, block).unwrap(), block, DataType::U8, p, &stream).unwrap();
            c.recv(d.slice(FRONT + p * block, block).unwrap(), block, DataType::U8, p, &stream).unwrap();
        }
        oxccl::group_end().unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        stream.synchronize().unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        let want: Vec<u8> = (0..n).flat_map(|p| payload(p, r, 0, block)).collect();
        check(&d, n * block, 4, &want, &format!("{what}: rank {r}, {n} ranks × {block} bytes"));
    });
}

#[test]
fn shifted_exchanges_are_exact_for_every_size_and_rank_count() {
    let _env = Staged::clean(VARS);
    for n in [2usize, 3, 5] {
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        for (count, dtype) in [(0, DataType::F32), (1, DataType::U8), (3, DataType::F16), (1025, DataType::F32), (4099, DataType::F8E5M2), ((1 << 18) + 3, DataType::F64)] {
            for shift in 1..n {
                shifted_exchange(&comms, count, dtype, shift, &format!("{n} ranks, shift {shift}"));
            }
        }
    }
}

#[test]
fn all_to_all_groups_over_p2p_shm_and_net() {
    for (vars, name) in [
        (&[][..], "P2P"),
        (&[("NCCL_P2P_DISABLE", "1")][..], "SHM"),
        (&[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")][..], "NET"),
    ] {
        let env = Staged::clean(VARS);
        env.set(vars);
        let n = if name == "NET" { 3 } else { 4 };
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        for block in [0usize, 5, 4096 + 7, 600_000] {
            all_to_all(&comms, block, name);
        }
    }
}

/// A send's data goes over LL up to `NCCL_P2P_LL_THRESHOLD` bytes and over Simple above, the
/// sender's choice told by its header: exact with thresholds 0 (every send on Simple), NCCL's
/// 16384 and 1 MiB, over P2P, SHM and NET, with the smallest LL FIFO (512 data bytes a step)
/// and the connections starting 40 steps below the LL flag's wrap, so header and data steps
/// cross it and its cleaning steps (which write whole slots).
#[test]
fn sends_take_ll_up_to_the_threshold_and_stay_exact_across_the_ll_flag_wrap() {
    let start = ((1u64 << 31) - 1 - 40).to_string();
    for (transport, vars) in [
        ("P2P", &[][..]),
        ("SHM", &[("NCCL_P2P_DISABLE", "1")][..]),
        ("NET", &[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")][..]),
    ] {
        for threshold in ["0", "16384", "1048576"] {
            let env = Staged::clean(VARS);
            let mut all = vars.to_vec();
            all.extend([
                ("NCCL_P2P_LL_THRESHOLD", threshold),
                ("OXCCL_TEST_INITIAL_STEP", start.as_str()),
                ("NCCL_LL_BUFFSIZE", "8192"),
            ]);
            env.set(&all);
            let comms = common::init_all(&Device::cpus(3)).unwrap();
            let what = |bytes: usize| format!("{transport}, threshold {threshold}, {bytes} bytes");
            for bytes in [1usize, 17, 16384, 16385, 100_000] {
                for shift in 1..3 {
                    shifted_exchange(&comms, bytes, DataType::U8, shift, &what(bytes));
                }
            }
            for _ in 0..30 {
                shifted_exchange(&comms, 24, DataType::U8, 1, &what(24));
            }
        }
    }
}

#[test]
fn several_channels_per_peer_split_a_transfer_and_keep_it_exact() {
    let env = Staged::clean(VARS);
    env.set(&[("NCCL_NCHANNELS_PER_PEER", "3")]);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    for count in [1usize, 47, 100_003] {
        shifted_exchange(&comms, count, DataType::U8, 1, "3 channels per peer");
    }
    all_to_all(&comms, 33_333, "3 channels per peer");
}

/// Per CPU rank of `n`, an all-to-all's guarded send buffer (block `p` of `block` bytes:
/// [`payload`] for rank `p`; guards salt 5) and receive buffer (poisoned, salt 6).
fn all_to_all_buffers(n: usize, block: usize) -> Vec<(DeviceBuffer, DeviceBuffer)> {
    (0..n)
        .map(|r| {
            let input: Vec<u8> = (0..n).flat_map(|p| payload(r, p, 0, block)).collect();
            (guarded(Device::Cpu(r), n * block, 5, Some(&input)), guarded(Device::Cpu(r), n * block, 6, None))
        })
        .collect()
}

/// NCCL's one thread per process: one thread issues every rank's calls inside one group; the
/// launches wait for nothing on the host, so no rank's call can hold back another's.
#[test]
fn one_thread_drives_every_rank_inside_one_group() {
    let _env = Env::clean(VARS);
    let n = 4;
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let block = 70_001;
    let streams = common::streams(&comms);
    let bufs = all_to_all_buffers(n, block);
    oxccl::group(|| {
        for (r, c) in comms.iter().enumerate() {
            for p in 0..n {
                c.send(bufs[r].0.slice(FRONT + p * block, block).unwrap(), block, DataType::U8, p, &streams[r]).unwrap();
                c.recv(bufs[r].1.slice(FRONT + p * block, block).unwrap(), block, DataType::U8, p, &streams[r]).unwrap();
            }
        }
    })
    .unwrap();
    common::sync_all(&streams, "one thread, all ranks");
    for r in 0..n {
        let want: Vec<u8> = (0..n).flat_map(|p| payload(p, r, 0, block)).collect();
        check(&bufs[r].1, n * block, 6, &want, &format!("rank {r}"));
    }
}

/// Sends between one pair in one direction match their receives in issue order, within a
/// group (several launches) and across calls outside groups.
#[test]
fn sends_match_receives_in_issue_order() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let sizes = [5usize, 70_000, 0, 1];
    for grouped in [true, false] {
        common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let peer = 1 - r;
            let bufs: Vec<DeviceBuffer> = sizes
                .iter()
                .enumerate()
                .map(|(m, &b)| if r == 0 { guarded(dev, b, 7, Some(&payload(0, 1, m, b))) } else { guarded(dev, b, 8, None) })
                .collect();
            if grouped {
                oxccl::group_start().unwrap();
            }
            for (b, &bytes) in bufs.iter().zip(&sizes) {
                let s = b.slice(FRONT, bytes).unwrap();
                if r == 0 {
                    c.send(s, bytes, DataType::U8, peer, &stream).unwrap();
                } else {
                    c.recv(s, bytes, DataType::U8, peer, &stream).unwrap();
                }
            }
            if grouped {
                oxccl::group_end().unwrap();
            }
            stream.synchronize().unwrap();
            if r == 1 {
                for (m, (b, &bytes)) in bufs.iter().zip(&sizes).enumerate() {
                    check(b, bytes, 8, &payload(0, 1, m, bytes), &format!("message {m}, grouped {grouped}"));
                }
            }
        });
    }
}

/// A receive of another size than the send: at most the receive's size is written (guards
/// intact), the stream's synchronize names both sizes, and the pair stays usable — sends on LL
/// (up to 16384 bytes) and on Simple, also where the receive's size is on the other side of
/// that threshold.
#[test]
fn a_size_mismatch_is_an_error_naming_both_sizes_and_writes_nothing_past_the_output() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    for (sent, expected) in [(1000usize, 600usize), (600, 1000), (0, 16), (20_000, 600), (600, 20_000), (70_000, 50_001)] {
        let errs = common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let (s, d) = (guarded(dev, sent, 9, Some(&payload(0, 1, 0, sent))), guarded(dev, expected, 10, None));
            if r == 0 {
                c.send(s.slice(FRONT, sent).unwrap(), sent, DataType::U8, 1, &stream).unwrap();
            } else {
                c.recv(d.slice(FRONT, expected).unwrap(), expected, DataType::U8, 0, &stream).unwrap();
            }
            let e = stream.synchronize().err();
            if r == 1 {
                let n = sent.min(expected);
                check(&d, expected, 10, &payload(0, 1, 0, sent)[..n], &format!("sent {sent}, expected {expected}"));
            }
            e
        });
        assert!(errs[0].is_none(), "the sender: {:?}", errs[0]);
        let e = errs[1].as_ref().unwrap_or_else(|| panic!("sent {sent}, expected {expected}: no error"));
        let msg = e.to_string();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(
            msg.contains(&format!("expected {expected} bytes")) && msg.contains(&format!("sent {sent} bytes")) && msg.contains("rank 0"),
            "{msg}"
        );
        shifted_exchange(&comms, 77, DataType::U8, 1, "after a mismatch");
    }
}

/// The rank itself as peer: a copy, out of place and in place (send == recv), in a group.
#[test]
fn sending_to_itself_copies_also_in_place() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let c = &comms[0];
    let stream = c.device().new_stream().unwrap();
    let bytes = 10_001;
    let s = guarded(c.device(), bytes, 11, Some(&payload(0, 0, 0, bytes)));
    let d = guarded(c.device(), bytes, 12, None);
    oxccl::group(|| {
        c.send(s.slice(FRONT, bytes).unwrap(), bytes, DataType::U8, 0, &stream).unwrap();
        c.recv(d.slice(FRONT, bytes).unwrap(), bytes, DataType::U8, 0, &stream).unwrap();
        c.send(s.slice(FRONT, bytes).unwrap(), bytes, DataType::U8, 0, &stream).unwrap();
        c.recv(s.slice(FRONT, bytes).unwrap(), bytes, DataType::U8, 0, &stream).unwrap();
    })
    .unwrap();
    stream.synchronize().unwrap();
    check(&d, bytes, 12, &payload(0, 0, 0, bytes), "out of place");
    check(&s, bytes, 11, &payload(0, 0, 0, bytes), "in place");
    // Without its receive in the same group, a send to itself could never complete.
    let e = c.send(s.slice(FRONT, bytes).unwrap(), bytes, DataType::U8, 0, &stream).unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)) && e.to_string().contains("receive(s) from itself"), "{e}");
}

#[test]
fn bad_peers_counts_and_groups_are_refused_naming_the_argument() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let c = &comms[1];
    let stream: Stream = c.device().new_stream().unwrap();
    let b = c.device().alloc(64).unwrap();
    let e = c.send(&b, 4, DataType::F32, 2, &stream).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("peer 2") && e.to_string().contains("0..=1"), "{e}");
    let e = c.recv(&b, 17, DataType::F32, 0, &stream).unwrap_err();
    assert!(e.to_string().contains("recvbuff holds 64 bytes") && e.to_string().contains("needs 68"), "{e}");
    let other = Device::Cpu(0).alloc(64).unwrap();
    let e = c.send(&other, 1, DataType::U8, 0, &stream).unwrap_err();
    assert!(e.to_string().contains("sendbuff is on"), "{e}");
    let e = oxccl::group_end().unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "{e}");
    // An unmatched send to itself fails the group at its end, before anything is launched.
    oxccl::group_start().unwrap();
    c.recv(&b, 1, DataType::U8, 0, &stream).unwrap();
    c.send(&b, 1, DataType::U8, 1, &stream).unwrap();
    let e = oxccl::group_end().unwrap_err();
    assert!(e.to_string().contains("send(s) to itself"), "{e}");
    assert_eq!(oxccl::group::group_depth(), 0);
}

/// On GPUs (two, or one shared by two ranks): shifted exchanges and all-to-all over P2P and SHM,
/// and a size mismatch reported by `get_async_error` naming both sizes.
#[test]
fn gpu_send_recv_and_all_to_all_over_p2p_and_shm() {
    let test = "gpu_send_recv_and_all_to_all_over_p2p_and_shm";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let dog = common::Watchdog::new(test, std::time::Duration::from_secs(60));
    for (vars, name) in [(&[][..], "P2P"), (&[("NCCL_P2P_DISABLE", "1")][..], "SHM")] {
        let env = Env::clean(VARS);
        env.set(vars);
        let comms = Comm::init_all(&devices).unwrap_or_else(|e| panic!("{name}: {e}"));
        drop(env);
        for (count, dtype) in [(0, DataType::F32), (1, DataType::U8), (3, DataType::F16), (1025, DataType::F32), ((1 << 22) + 3, DataType::F32)] {
            dog.step(format!("{name}: shifted exchange of {count} × {dtype}"));
            shifted_exchange(&comms, count, dtype, 1, name);
        }
        for block in [0usize, 5, 4096 + 7, 3_000_000] {
            dog.step(format!("{name}: all-to-all of {block} bytes"));
            all_to_all(&comms, block, name);
        }
        dog.step(format!("{name}: size mismatch"));
        let ready = std::sync::Barrier::new(2);
        let errs = common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let (sent, expected) = (1000usize, 4000usize);
            let (s, d) = (guarded(dev, sent, 9, Some(&payload(0, 1, 0, sent))), guarded(dev, expected, 10, None));
            ready.wait();
            if r == 0 {
                c.send(s.slice(FRONT, sent).unwrap(), sent, DataType::U8, 1, &stream).unwrap();
            } else {
                c.recv(d.slice(FRONT, expected).unwrap(), expected, DataType::U8, 0, &stream).unwrap();
            }
            stream.synchronize().unwrap();
            if r == 1 {
                check(&d, expected, 10, &payload(0, 1, 0, sent), &format!("{name}: sent {sent}, expected {expected}"));
            }
            c.get_async_error().err()
        });
        assert!(errs[0].is_none(), "{name}: the sender: {:?}", errs[0]);
        let msg = errs[1].as_ref().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("expected 4000 bytes") && msg.contains("sent 1000 bytes"), "{name}: {msg:?}");
        assert!(comms[1].get_async_error().is_ok(), "{name}: reported once");
    }
    drop(dog);
}

/// On GPUs (two, or one shared by two ranks), over P2P and SHM: every send's data on Simple
/// (`NCCL_P2P_LL_THRESHOLD=0`) and on LL up to 1 MiB, sizes around NCCL's 16384 threshold, and
/// 7 and 20 calls per connection in one group (one launch; launch rounds with 8 channels per
/// peer), LL and Simple sends in turn on one connection: exact, guards intact.
#[test]
fn gpu_sends_on_ll_and_simple_and_many_per_connection_exact() {
    let test = "gpu_sends_on_ll_and_simple_and_many_per_connection_exact";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let dog = common::Watchdog::new(test, std::time::Duration::from_secs(90));
    for (vars, name) in [(&[][..], "P2P"), (&[("NCCL_P2P_DISABLE", "1")][..], "SHM")] {
        for threshold in ["0", "1048576"] {
            let env = Env::clean(VARS);
            let mut all = vars.to_vec();
            all.push(("NCCL_P2P_LL_THRESHOLD", threshold));
            env.set(&all);
            let comms = Comm::init_all(&devices).unwrap_or_else(|e| panic!("{name}: {e}"));
            drop(env);
            let what = format!("{name}, threshold {threshold}");
            for bytes in [1usize, 16384, 16385, 100_000] {
                dog.step(format!("{what}: shifted exchange of {bytes} bytes"));
                shifted_exchange(&comms, bytes, DataType::U8, 1, &what);
            }
            for msgs in [7, 20] {
                dog.step(format!("{what}: {msgs} calls per connection"));
                many_calls_per_connection(&comms, msgs, &what);
            }
        }
    }
    drop(dog);
}

/// `all_to_all`, `all_to_all_v`, `gather`, `scatter` and `all_gather_v` (built from grouped
/// sends and receives) on 1 to 4 ranks: exact blocks, guards intact, in place where allowed.
#[test]
fn all_to_all_gather_scatter_and_v_variants_are_exact() {
    let _env = Env::clean(VARS);
    for n in 1..=4usize {
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        let count = 1001usize;
        let dt = DataType::F32;
        let b = count * dt.size();
        // AllToAll.
        common::on_threads(n, |r| {
            let c = &comms[r];
            let dev = c.device();
            let input: Vec<u8> = (0..n).flat_map(|p| payload(r, p, 1, b)).collect();
            let (s, d) = (guarded(dev, n * b, 13, Some(&input)), guarded(dev, n * b, 14, None));
            let stream = dev.new_stream().unwrap();
            c.all_to_all(s.slice(FRONT, n * b).unwrap(), d.slice(FRONT, n * b).unwrap(), count, dt, &stream).unwrap();
            stream.synchronize().unwrap();
            let want: Vec<u8> = (0..n).flat_map(|p| payload(p, r, 1, b)).collect();
            check(&d, n * b, 14, &want, &format!("all_to_all, rank {r} of {n}"));
            let e = c.all_to_all(s.slice(FRONT, n * b).unwrap(), s.slice(FRONT, n * b).unwrap(), count, dt, &stream).unwrap_err();
            assert!(e.to_string().contains("overlaps"), "{e}");
        });
        // AllToAllV of fp8 E4M3: rank r sends (r + p + 1) × 10 elements (bytes) to p, packed.
        let size = |from: usize, to: usize| (from + to + 1) * 10;
        common::on_threads(n, |r| {
            let c = &comms[r];
            let dev = c.device();
            let scounts: Vec<usize> = (0..n).map(|p| size(r, p)).collect();
            let rcounts: Vec<usize> = (0..n).map(|p| size(p, r)).collect();
            let disp = |v: &[usize]| v.iter().scan(0, |a, &x| { let d = *a; *a += x; Some(d) }).collect::<Vec<_>>();
            let (sd, rd) = (disp(&scounts), disp(&rcounts));
            let (st, rt) = (scounts.iter().sum::<usize>(), rcounts.iter().sum::<usize>());
            let input: Vec<u8> = (0..n).flat_map(|p| payload(r, p, 2, size(r, p))).collect();
            let (s, d) = (guarded(dev, st, 15, Some(&input)), guarded(dev, rt, 16, None));
            let stream = dev.new_stream().unwrap();
            c.all_to_all_v(s.slice(FRONT, st).unwrap(), &scounts, &sd, d.slice(FRONT, rt).unwrap(), &rcounts, &rd, DataType::F8E4M3, &stream)
                .unwrap();
            stream.synchronize().unwrap();
            let want: Vec<u8> = (0..n).flat_map(|p| payload(p, r, 2, size(p, r))).collect();
            check(&d, rt, 16, &want, &format!("all_to_all_v, rank {r} of {n}"));
        });
        for root in [0, n - 1] {
            // Gather, in place on the root.
            common::on_threads(n, |r| {
                let c = &comms[r];
                let dev = c.device();
                let d = guarded(dev, n * b, 17, (r == root).then(|| payload(r, root, 3, n * b)).as_deref());
                let mine = payload(r, root, 4, b);
                d.write(FRONT + r * b, &mine).unwrap();
                let stream = dev.new_stream().unwrap();
                let recv = (r == root).then(|| d.slice(FRONT, n * b).unwrap());
                c.gather(d.slice(FRONT + r * b, b).unwrap(), recv, count, dt, root, &stream).unwrap();
                stream.synchronize().unwrap();
                if r == root {
                    let want: Vec<u8> = (0..n).flat_map(|p| payload(p, root, 4, b)).collect();
                    check(&d, n * b, 17, &want, &format!("gather to {root}, {n} ranks"));
                }
            });
            // Scatter, out of place.
            common::on_threads(n, |r| {
                let c = &comms[r];
                let dev = c.device();
                let input: Vec<u8> = (0..n).flat_map(|p| payload(root, p, 5, b)).collect();
                let s = guarded(dev, n * b, 18, Some(&input));
                let d = guarded(dev, b, 19, None);
                let stream = dev.new_stream().unwrap();
                let send = (r == root).then(|| s.slice(FRONT, n * b).unwrap());
                c.scatter(send, d.slice(FRONT, b).unwrap(), count, dt, root, &stream).unwrap();
                stream.synchronize().unwrap();
                check(&d, b, 19, &payload(root, r, 5, b), &format!("scatter from {root}, rank {r} of {n}"));
            });
        }
        // AllGatherV of fp8 E5M2: rank p contributes (p + 1) × 7 elements (bytes).
        common::on_threads(n, |r| {
            let c = &comms[r];
            let dev = c.device();
            let counts: Vec<usize> = (0..n).map(|p| (p + 1) * 7).collect();
            let displs: Vec<usize> = (0..n).map(|p| counts[..p].iter().sum()).collect();
            let total: usize = counts.iter().sum();
            let s = guarded(dev, counts[r], 20, Some(&payload(r, 0, 6, counts[r])));
            let d = guarded(dev, total, 21, None);
            let stream = dev.new_stream().unwrap();
            c.all_gather_v(s.slice(FRONT, counts[r]).unwrap(), d.slice(FRONT, total).unwrap(), &counts, &displs, DataType::F8E5M2, &stream).unwrap();
            stream.synchronize().unwrap();
            let want: Vec<u8> = (0..n).flat_map(|p| payload(p, 0, 6, counts[p])).collect();
            check(&d, total, 21, &want, &format!("all_gather_v, rank {r} of {n}"));
        });
    }
}

/// A count above 2^31 elements (2 GiB + 17 bytes of u8) between two GPU ranks, exact at both
/// ends and at the boundary.
#[test]
fn gpu_send_recv_of_more_than_2_pow_31_elements() {
    let test = "gpu_send_recv_of_more_than_2_pow_31_elements";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let _dog = common::Watchdog::new(test, std::time::Duration::from_secs(120));
    let env = Env::clean(VARS);
    let comms = Comm::init_all(&devices).unwrap();
    drop(env);
    let count = (1usize << 31) + 17;
    let pattern = |i: usize| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) as u8;
    let chunk = 1 << 26;
    let bufs: Vec<DeviceBuffer> = comms
        .iter()
        .map(|c| {
            let b = c.device().alloc(count).unwrap();
            if c.rank() == 0 {
                for at in (0..count).step_by(chunk) {
                    let n = chunk.min(count - at);
                    b.write(at, &(at..at + n).map(pattern).collect::<Vec<_>>()).unwrap();
                }
            } else {
                b.fill(0).unwrap();
            }
            b
        })
        .collect();
    let streams = common::streams(&comms);
    oxccl::group(|| {
        comms[0].send(&bufs[0], count, DataType::U8, 1, &streams[0]).unwrap();
        comms[1].recv(&bufs[1], count, DataType::U8, 0, &streams[1]).unwrap();
    })
    .unwrap();
    common::sync_all(&streams, test);
    let mut wrong = 0usize;
    let mut got = vec![0u8; chunk];
    for at in (0..count).step_by(chunk) {
        let n = chunk.min(count - at);
        bufs[1].read(at, &mut got[..n]).unwrap();
        wrong += (0..n).filter(|&i| got[i] != pattern(at + i)).count();
    }
    assert_eq!(wrong, 0, "{wrong} of {count} bytes wrong");
    assert!(comms[1].get_async_error().is_ok());
}

/// `reduce_scatter_v`: rank `p` gets the sum over ranks of everyone's slice `p` (slices of
/// different sizes, one empty), out of place and in place (its own slice of its input), 1 to 4
/// ranks; guards intact.
#[test]
fn reduce_scatter_v_sums_each_ranks_slice() {
    let _env = Env::clean(VARS);
    for n in 1..=4usize {
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        let counts: Vec<usize> = (0..n).map(|p| if p == 1 { 0 } else { 1000 * p + 7 }).collect();
        let displs: Vec<usize> = (0..n).map(|p| counts[..p].iter().sum()).collect();
        let total: usize = counts.iter().sum();
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        for in_place in [false, true] {
            common::on_threads(n, |r| {
                let c = &comms[r];
                let dev = c.device();
                let input: Vec<f32> = (0..total).map(|k| ((r + 1) * (k % 1000 + 1)) as f32).collect();
                let s = guarded(dev, total * 4, 22, Some(&f32s(&input)));
                let d = guarded(dev, counts[r] * 4, 23, None);
                let stream = dev.new_stream().unwrap();
                let out = if in_place { s.slice(FRONT + displs[r] * 4, counts[r] * 4).unwrap() } else { d.slice(FRONT, counts[r] * 4).unwrap() };
                c.reduce_scatter_v(s.slice(FRONT, total * 4).unwrap(), out, &counts, &displs, DataType::F32, oxccl::RedOp::Sum, &stream)
                    .unwrap();
                stream.synchronize().unwrap();
                let sum = (n * (n + 1) / 2) as f32;
                let want: Vec<f32> = (0..counts[r]).map(|i| sum * (((displs[r] + i) % 1000) + 1) as f32).collect();
                if in_place {
                    let mut all = input.clone();
                    all[displs[r]..displs[r] + counts[r]].copy_from_slice(&want);
                    check(&s, total * 4, 22, &f32s(&all), &format!("reduce_scatter_v in place, rank {r} of {n}"));
                } else {
                    check(&d, counts[r] * 4, 23, &f32s(&want), &format!("reduce_scatter_v, rank {r} of {n}"));
                }
            });
        }
    }
}

/// A group whose sends and receives need more blocks than one launch holds (10 ranks, 8 peer
/// channels per peer: 9 peers × 2 directions × 8 = 144 > 128) fails at its end naming the limit,
/// with nothing launched: no receive buffer is written (`group_collectives` checks that the
/// group's collectives do not run either).
#[test]
fn a_group_too_large_for_one_launch_fails_with_nothing_launched() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_NCHANNELS_PER_PEER", "8")]);
    let n = 10;
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let block = 64;
    let streams = common::streams(&comms);
    let bufs = all_to_all_buffers(n, block);
    oxccl::group_start().unwrap();
    for (r, c) in comms.iter().enumerate() {
        for p in 0..n {
            c.send(bufs[r].0.slice(FRONT + p * block, block).unwrap(), block, DataType::U8, p, &streams[r]).unwrap();
            c.recv(bufs[r].1.slice(FRONT + p * block, block).unwrap(), block, DataType::U8, p, &streams[r]).unwrap();
        }
    }
    let e = oxccl::group_end().unwrap_err();
    assert!(matches!(e, oxccl::Error::InvalidUsage(_)), "{e}");
    let m = e.to_string();
    assert!(m.contains("need 144 thread blocks in one launch, more than the 128") && m.contains("nothing was launched"), "{m}");
    assert_eq!(oxccl::group::group_depth(), 0);
    common::sync_all(&streams, "a refused group");
    let poison = sentinel(FRONT + n * block + BACK, 6);
    for (r, (_, recv)) in bufs.iter().enumerate() {
        check(recv, n * block, 6, &poison[FRONT..FRONT + n * block], &format!("rank {r}: untouched"));
    }
}

/// The size of message `msg` from rank `from` to rank `to` in [`many_calls_per_connection`]:
/// on LL (up to 16384 bytes: at, just below and far below the threshold, and empty) and on
/// Simple (just above and far above), in an order that differs per pair.
fn many_size(from: usize, to: usize, msg: usize) -> usize {
    const SIZES: [usize; 7] = [16384, 16385, 1, 0, 70_000, 5000, 16];
    SIZES[(msg + 2 * from + to) % SIZES.len()]
}

/// Every rank sends `msgs` messages to every other rank and receives theirs, all in one group
/// per rank thread, sends and receives interleaved (their order alternating per message): many
/// calls on each connection, LL and Simple ones in turn. Each received buffer exact, its guards
/// and every send buffer intact.
fn many_calls_per_connection(comms: &[Comm], msgs: usize, what: &str) {
    let n = comms.len();
    let ready = std::sync::Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
        // (peer, msg) → (send buffer, receive buffer).
        let bufs: Vec<Vec<(DeviceBuffer, DeviceBuffer)>> = peers
            .iter()
            .map(|&p| {
                (0..msgs)
                    .map(|m| {
                        let (sb, rb) = (many_size(r, p, m), many_size(p, r, m));
                        (guarded(dev, sb, 24, Some(&payload(r, p, m, sb))), guarded(dev, rb, 25, None))
                    })
                    .collect()
            })
            .collect();
        let stream = dev.new_stream().unwrap();
        ready.wait();
        oxccl::group(|| -> oxccl::Result<()> {
            for m in 0..msgs {
                for (k, &p) in peers.iter().enumerate() {
                    let (s, d) = &bufs[k][m];
                    let (sb, rb) = (many_size(r, p, m), many_size(p, r, m));
                    if (m + k) % 2 == 0 {
                        c.send(s.slice(FRONT, sb)?, sb, DataType::U8, p, &stream)?;
                        c.recv(d.slice(FRONT, rb)?, rb, DataType::U8, p, &stream)?;
                    } else {
                        c.recv(d.slice(FRONT, rb)?, rb, DataType::U8, p, &stream)?;
                        c.send(s.slice(FRONT, sb)?, sb, DataType::U8, p, &stream)?;
                    }
                }
            }
            Ok(())
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        stream.synchronize().unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        for (k, &p) in peers.iter().enumerate() {
            for m in 0..msgs {
                let (s, d) = &bufs[k][m];
                let (sb, rb) = (many_size(r, p, m), many_size(p, r, m));
                check(d, rb, 25, &payload(p, r, m, rb), &format!("{what}: rank {r}, message {m} of {msgs} from {p} ({rb} bytes)"));
                check(s, sb, 24, &payload(r, p, m, sb), &format!("{what}: rank {r}'s send buffer of message {m} to {p}"));
            }
        }
    });
}

/// Many sends and receives on one connection in one group: each connection's calls run on one
/// block one after the other (one launch for 7 messages per connection; launch rounds for 20,
/// whose works exceed one launch with 2 channels per peer), LL and Simple sends in turn sharing
/// the connection's steps; exact over P2P, SHM and NET, with 1 and 2 channels per peer, with the
/// smallest LL FIFO and the connections starting just below the LL flag's wrap.
#[test]
fn many_calls_on_one_connection_in_one_group_are_exact_on_ll_and_simple() {
    let start = ((1u64 << 31) - 1 - 20).to_string();
    for (transport, vars) in [
        ("P2P", &[][..]),
        ("SHM", &[("NCCL_P2P_DISABLE", "1")][..]),
        ("NET", &[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")][..]),
    ] {
        for per_peer in ["1", "2"] {
            let env = Staged::clean(VARS);
            let mut all = vars.to_vec();
            all.extend([
                ("NCCL_NCHANNELS_PER_PEER", per_peer),
                ("OXCCL_TEST_INITIAL_STEP", start.as_str()),
                ("NCCL_LL_BUFFSIZE", "8192"),
            ]);
            env.set(&all);
            let comms = common::init_all(&Device::cpus(3)).unwrap();
            for msgs in [7, 20] {
                many_calls_per_connection(&comms, msgs, &format!("{transport}, {per_peer} channel(s) per peer, {msgs} messages"));
            }
        }
    }
}

/// Calls grouped differently on the two sides still match in issue order: rank 0 issues its 6
/// sends to rank 1 as one group (one block per connection running them in turn), rank 1
/// receives them one call at a time, then in groups of 2 and 4, and the other way around.
#[test]
fn a_group_of_sends_matches_receives_grouped_otherwise() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let sizes = [16384usize, 3, 16385, 0, 200_000, 777];
    for (sender, splits) in [(0usize, &[1usize, 1, 1, 1, 1, 1][..]), (1, &[2, 4][..]), (0, &[6][..]), (1, &[5, 1][..])] {
        common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let peer = 1 - r;
            let bufs: Vec<DeviceBuffer> = sizes
                .iter()
                .enumerate()
                .map(|(m, &b)| if r == sender { guarded(dev, b, 26, Some(&payload(sender, peer, m, b))) } else { guarded(dev, b, 27, None) })
                .collect();
            let call = |m: usize| {
                let s = bufs[m].slice(FRONT, sizes[m]).unwrap();
                if r == sender {
                    c.send(s, sizes[m], DataType::U8, peer, &stream).unwrap();
                } else {
                    c.recv(s, sizes[m], DataType::U8, peer, &stream).unwrap();
                }
            };
            if r == sender {
                oxccl::group(|| (0..sizes.len()).for_each(call)).unwrap();
            } else {
                let mut m = 0;
                for &k in splits {
                    oxccl::group(|| (m..m + k).for_each(call)).unwrap();
                    m += k;
                }
            }
            stream.synchronize().unwrap_or_else(|e| panic!("rank {r}, sender {sender}, splits {splits:?}: {e}"));
            if r != sender {
                for (m, &b) in sizes.iter().enumerate() {
                    check(&bufs[m], b, 27, &payload(sender, r, m, b), &format!("sender {sender}, splits {splits:?}: message {m}"));
                }
            }
        });
    }
}

/// Inside one group of five calls on one connection, a receive shorter than its send (20000
/// bytes on Simple into 600) and one longer (600 bytes on LL into 20000): each writes what it
/// holds of the sent bytes and nothing past its output, the calls after them are exact, the
/// synchronize names both sizes of a mismatch, and the pair stays usable — with 1 and 2
/// channels per peer.
#[test]
fn size_mismatches_inside_a_group_leave_the_other_calls_exact() {
    let sent = [1000usize, 20_000, 600, 16384, 70_000];
    let expected = [1000usize, 600, 20_000, 16384, 70_000];
    for per_peer in ["1", "2"] {
        let env = Env::clean(VARS);
        env.set(&[("NCCL_NCHANNELS_PER_PEER", per_peer)]);
        let comms = Comm::init_all(&Device::cpus(2)).unwrap();
        drop(env);
        let errs = common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let bufs: Vec<DeviceBuffer> = (0..sent.len())
                .map(|m| if r == 0 { guarded(dev, sent[m], 28, Some(&payload(0, 1, m, sent[m]))) } else { guarded(dev, expected[m], 29, None) })
                .collect();
            oxccl::group(|| {
                for (m, b) in bufs.iter().enumerate() {
                    if r == 0 {
                        c.send(b.slice(FRONT, sent[m]).unwrap(), sent[m], DataType::U8, 1, &stream).unwrap();
                    } else {
                        c.recv(b.slice(FRONT, expected[m]).unwrap(), expected[m], DataType::U8, 0, &stream).unwrap();
                    }
                }
            })
            .unwrap();
            let e = stream.synchronize().err();
            if r == 1 {
                for m in 0..sent.len() {
                    let k = sent[m].min(expected[m]);
                    check(&bufs[m], expected[m], 29, &payload(0, 1, m, sent[m])[..k], &format!("{per_peer} per peer: message {m}, sent {}, expected {}", sent[m], expected[m]));
                }
            }
            e
        });
        assert!(errs[0].is_none(), "{per_peer} per peer: the sender: {:?}", errs[0]);
        let e = errs[1].as_ref().unwrap_or_else(|| panic!("{per_peer} per peer: no error"));
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let msg = e.to_string();
        let names = |s: usize, x: usize| msg.contains(&format!("expected {x} bytes but rank 0 sent {s} bytes"));
        assert!(names(20_000, 600) || names(600, 20_000), "{per_peer} per peer: {msg}");
        assert!(comms[1].get_async_error().is_ok(), "{per_peer} per peer: reported once");
        shifted_exchange(&comms, 16384, DataType::U8, 1, "after the mismatches");
        shifted_exchange(&comms, 16385, DataType::U8, 1, "after the mismatches");
    }
}
