//! The NET transport on the CPU target: ranks as processes on different "hosts" (`OXCCL_HOSTID`,
//! and real network namespaces with a veth pair) run every collective over the socket network
//! and the proxy thread with exact results, on each protocol; SHM stays in use between ranks of
//! one host unless `NCCL_SHM_DISABLE=1`; a rank killed mid-collective gives the others an error in
//! bounded time (case C29).
//!
//! Every test here launches this binary again as child ranks (`child_rank`), each with its own
//! environment, and reads their output.
use crate::common::child::{self, LineChild, log_to_stdout};
use crate::common::{self, unique_id};
use oxccl::bootstrap::UniqueId;
use oxccl::{Comm, DataType, Device, Error, RedOp};
use std::process::Command;
use std::time::{Duration, Instant};

/// Element counts: one element, an odd count, and one spanning many FIFO steps with the small
/// buffers the tests use (NCCL_BUFFSIZE 64 KiB: 8 KiB slots).
const COUNTS: [usize; 3] = [1, 4099, 200_003];

fn ne<T: Copy>(v: &[T], f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

/// Runs AllReduce, Broadcast, AllGather, ReduceScatter and Reduce on `comm` for every count of
/// [`COUNTS`] and checks each result exactly; returns the failures found.
fn run_collectives(comm: &Comm) -> Result<Vec<String>, Error> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream()?;
    let mut bad = Vec::new();
    let mut check = |what: String, got: Vec<u8>, want: Vec<u8>| {
        if got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            bad.push(format!(
                "rank {r}: {what}: first wrong byte at {first:?} (lengths {} / {})",
                got.len(),
                want.len()
            ));
        }
    };
    for count in COUNTS {
        // AllReduce, i32 sum: in[i] = (r+1)·1000 + i mod 977, so out[i] = 1000·n(n+1)/2 + n·(i mod 977).
        let input: Vec<i32> = (0..count)
            .map(|i| (r as i32 + 1) * 1000 + (i % 977) as i32)
            .collect();
        let want: Vec<i32> = (0..count)
            .map(|i| 1000 * (n * (n + 1) / 2) as i32 + n as i32 * (i % 977) as i32)
            .collect();
        let buf = dev.alloc(count * 4)?;
        buf.write(0, &ne(&input, |x: i32| x.to_ne_bytes().to_vec()))?;
        comm.all_reduce(&buf, &buf, count, DataType::I32, RedOp::Sum, &stream)?;
        stream.synchronize()?;
        if let Some(c) = comm.last_choice() {
            println!("CHOICE AllReduce count {count} proto {:?}", c.proto);
        }
        check(
            format!("AllReduce count {count}"),
            buf.to_vec()?,
            ne(&want, |x: i32| x.to_ne_bytes().to_vec()),
        );

        // Broadcast from the last rank, u8: out[i] = (31·i + root) mod 256 everywhere.
        let root = n - 1;
        let want: Vec<u8> = (0..count).map(|i| (i * 31 + root) as u8).collect();
        let out = dev.alloc(count)?;
        let src = dev.alloc(count)?;
        src.write(0, &want)?;
        let send = (r == root).then(|| (&src).into());
        comm.broadcast(send, &out, count, DataType::U8, root, &stream)?;
        stream.synchronize()?;
        check(format!("Broadcast count {count}"), out.to_vec()?, want);

        // AllGather, u32: rank q contributes q·1_000_003 + i, so out[k] = (k / count)·1_000_003 + k mod count.
        let send = dev.alloc(count * 4)?;
        send.write(
            0,
            &ne(&(0..count).collect::<Vec<_>>(), |i| {
                ((r * 1_000_003 + i) as u32).to_ne_bytes().to_vec()
            }),
        )?;
        let recv = dev.alloc(count * 4 * n)?;
        comm.all_gather(&send, &recv, count, DataType::U32, &stream)?;
        stream.synchronize()?;
        let want = ne(&(0..count * n).collect::<Vec<_>>(), |k| {
            (((k / count) * 1_000_003 + k % count) as u32)
                .to_ne_bytes()
                .to_vec()
        });
        check(format!("AllGather count {count}"), recv.to_vec()?, want);

        // ReduceScatter, f32 max: rank q's in[j] = (7j + 13q) mod 1009, so rank r's out[i] is
        // the max over q of (7(r·count + i) + 13q) mod 1009 (small integers: exact in f32).
        let val = |j: usize, q: usize| ((7 * j + 13 * q) % 1009) as f32;
        let send = dev.alloc(count * n * 4)?;
        send.write(
            0,
            &ne(&(0..count * n).collect::<Vec<_>>(), |j| {
                val(j, r).to_ne_bytes().to_vec()
            }),
        )?;
        let recv = dev.alloc(count * 4)?;
        comm.reduce_scatter(&send, &recv, count, DataType::F32, RedOp::Max, &stream)?;
        stream.synchronize()?;
        let want = ne(&(0..count).collect::<Vec<_>>(), |i| {
            (0..n)
                .map(|q| val(r * count + i, q))
                .fold(f32::MIN, f32::max)
                .to_ne_bytes()
                .to_vec()
        });
        check(format!("ReduceScatter count {count}"), recv.to_vec()?, want);

        // Reduce to rank 1 (rank 0 with one rank), i64 min: in[i] = ((i·2654435761) xor q) mod
        // 100000 − 50000; the root's out[i] is the min over q; other ranks' recv is never written.
        let root = 1 % n;
        let val = |i: usize, q: usize| ((i as i64 * 2_654_435_761) ^ q as i64) % 100_000 - 50_000;
        let send = dev.alloc(count * 8)?;
        send.write(
            0,
            &ne(&(0..count).collect::<Vec<_>>(), |i| {
                val(i, r).to_ne_bytes().to_vec()
            }),
        )?;
        let recv = dev.alloc(count * 8)?;
        recv.write(0, &vec![0x5a; count * 8])?;
        comm.reduce(
            &send,
            (r == root).then(|| (&recv).into()),
            count,
            DataType::I64,
            RedOp::Min,
            root,
            &stream,
        )?;
        stream.synchronize()?;
        let want = if r == root {
            ne(&(0..count).collect::<Vec<_>>(), |i| {
                (0..n).map(|q| val(i, q)).min().unwrap().to_ne_bytes().to_vec()
            })
        } else {
            vec![0x5a; count * 8]
        };
        check(format!("Reduce count {count}"), recv.to_vec()?, want);
    }
    Ok(bad)
}

/// Every child rank. `OXCCL_CHILD_ROLE`: `init` prints `INIT-OK rank R` or
/// `INIT-ERR rank R <code>: <error>`; `coll` runs [`run_collectives`]; `loop` runs AllReduce
/// until an error arrives. The id is `OXCCL_CHILD_ID`, else `NCCL_COMM_ID`.
#[test]
#[ignore = "child process of the tests of this module"]
fn child_rank() {
    child::enter();
    let role = child::env_var("OXCCL_CHILD_ROLE");
    log_to_stdout("oxccl::transport=info,oxccl::net=debug,oxccl::proxy=error");
    let rank: usize = child::env_parse("OXCCL_CHILD_RANK");
    let nranks: usize = child::env_parse("OXCCL_CHILD_NRANKS");
    let id = match std::env::var("OXCCL_CHILD_ID") {
        Ok(_) => child::env_id("OXCCL_CHILD_ID"),
        Err(_) => UniqueId::from_comm_id(&child::env_var("NCCL_COMM_ID")).unwrap(),
    };
    let init = Comm::init_rank(nranks, &id, rank, Device::Cpu(rank));
    if role == "init" {
        match init {
            Ok(comm) => {
                comm.destroy().expect("destroy");
                println!("INIT-OK rank {rank}");
            }
            Err(e) => println!("INIT-ERR rank {rank} {:?}: {e}", e.code()),
        }
        return;
    }
    let comm = init.expect("init_rank");
    match role.as_str() {
        "coll" => {
            for c in 0..comm.nchannels() as usize {
                println!("RING {c} {:?}", comm.ring(c).expect("ring"));
            }
            let bad = run_collectives(&comm).expect("collectives");
            assert!(bad.is_empty(), "{}", bad.join("\n"));
            comm.destroy().expect("destroy");
            println!("NET-CHILD-OK rank {rank}");
        }
        "loop" => {
            let count = 1 << 18;
            let dev = comm.device();
            let stream = dev.new_stream().unwrap();
            let buf = dev.alloc(count * 4).unwrap();
            let mut iters = 0u64;
            let err = loop {
                if let Err(e) = comm.all_reduce(&buf, &buf, count, DataType::F32, RedOp::Sum, &stream) {
                    break e;
                }
                if let Err(e) = stream.synchronize() {
                    break e;
                }
                iters += 1;
                if iters == 1 {
                    println!("LOOPING rank {rank}");
                }
            };
            println!("GOT-ERROR {:?} after {iters} iterations: {err}", err.code());
            // No abort: only the proxies of the ranks tell each other (as across real hosts).
            drop(comm);
            println!("CHILD-EXITED rank {rank}");
        }
        r => panic!("unknown role {r}"),
    }
}

/// Starts this test binary as rank `rank` of `nranks` in role `role`, with `env` (and no inherited
/// `NCCL_` / `OXCCL_` variables), optionally inside network namespace `netns`; its output is read
/// line by line.
fn spawn_rank(
    role: &str,
    rank: usize,
    nranks: usize,
    id: Option<&UniqueId>,
    env: &[(&str, String)],
    netns: Option<&str>,
) -> LineChild {
    match netns {
        Some(ns) => spawn_rank_wrapped(role, rank, nranks, id, env, &["ip", "netns", "exec", ns]),
        None => spawn_rank_wrapped(role, rank, nranks, id, env, &[]),
    }
}

/// As [`spawn_rank`], run through the command `wrap` (empty: directly), which must end by
/// executing the program and arguments it is given.
fn spawn_rank_wrapped(
    role: &str,
    rank: usize,
    nranks: usize,
    id: Option<&UniqueId>,
    env: &[(&str, String)],
    wrap: &[&str],
) -> LineChild {
    let mut cmd = child::wrapped(wrap, &child_entry!(child_rank));
    cmd.env("OXCCL_CHILD_ROLE", role)
        .env("OXCCL_CHILD_RANK", rank.to_string())
        .env("OXCCL_CHILD_NRANKS", nranks.to_string())
        .env("OXCCL_BOOTSTRAP_TIMEOUT", "30");
    if let Some(id) = id {
        cmd.env("OXCCL_CHILD_ID", child::hex(&id.to_bytes()));
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    LineChild::start(&mut cmd)
}

/// Runs one group of child ranks (`envs[r]` for rank `r`) through [`run_collectives`]; every rank
/// must pass and print the `expect` lines given for it.
fn run_group(
    envs: &[Vec<(&str, String)>],
    expect: &[Vec<String>],
    netns: &[Option<&str>],
    id: Option<&UniqueId>,
) -> Vec<String> {
    let n = envs.len();
    let mut ranks: Vec<LineChild> = (0..n)
        .map(|r| spawn_rank("coll", r, n, id, &envs[r], netns[r]))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut outs = Vec::new();
    for (r, rank) in ranks.iter_mut().enumerate() {
        let (ok, out) = rank.wait(deadline);
        assert!(
            ok && out.contains(&format!("NET-CHILD-OK rank {r}")),
            "rank {r} ({:?}): {out}",
            envs[r]
        );
        for line in &expect[r] {
            assert!(
                out.contains(line.as_str()),
                "rank {r} ({:?}): no {line:?} in\n{out}",
                envs[r]
            );
        }
        outs.push(out);
    }
    outs
}

#[test]
fn collectives_across_hosts_every_protocol() {
    // Ranks 0, 1 on host A (SHM between them); ranks 2, 3 on host B with NCCL_SHM_DISABLE=1
    // (NET between them too); 1 → 2 and 3 → 0 cross hosts (NET). Small buffers: many FIFO steps.
    // "auto": no NCCL_PROTO, so the tuner's choice changes with the size and the protocols mix on
    // the same connections, one collective after another.
    for proto in ["Simple", "LL", "LL128", "auto"] {
        let id = unique_id();
        let mut common = vec![
            ("NCCL_BUFFSIZE", "65536".to_string()),
            ("NCCL_LL_BUFFSIZE", "16384".to_string()),
            ("NCCL_LL128_BUFFSIZE", "65536".to_string()),
        ];
        if proto != "auto" {
            common.push(("NCCL_PROTO", proto.to_string()));
        }
        let envs: Vec<Vec<(&str, String)>> = (0..4)
            .map(|r| {
                let mut e = common.clone();
                e.push((
                    "OXCCL_HOSTID",
                    if r < 2 { "host-a" } else { "host-b" }.to_string(),
                ));
                if r >= 2 {
                    e.push(("NCCL_SHM_DISABLE", "1".to_string()));
                }
                e
            })
            .collect();
        let via = |a: usize, b: usize, t: &str| format!("Channel 00 : {a} -> {b} via {t}");
        let expect = vec![
            vec![via(0, 1, "SHM")],
            vec![via(1, 2, "NET/Socket/0")],
            vec![via(2, 3, "NET/Socket/0")],
            vec![via(3, 0, "NET/Socket/0")],
        ];
        let outs = run_group(&envs, &expect, &[None; 4], Some(&id));
        let mut used: Vec<&str> = outs[0]
            .lines()
            .filter_map(|l| l.split(" proto ").nth(1).filter(|_| l.starts_with("CHOICE")))
            .collect();
        used.sort_unstable();
        used.dedup();
        if proto == "auto" {
            assert!(used.len() >= 2, "one protocol for every size: {used:?}");
        } else {
            assert_eq!(
                used,
                [proto.replace("LL128", "Ll128").replace("LL", "Ll").as_str()]
            );
        }
        eprintln!("collectives_across_hosts: {proto} ok (AllReduce used {used:?})");
    }
}

#[test]
fn per_channel_rings_across_hosts_mix_transports() {
    // Two hosts of four ranks, each given the NVLink-mesh fixture (its searched rings differ per
    // channel: common::topo::MESH_RINGS): every channel's ring runs through host A in that
    // channel's order, crosses to host B over NET, runs through B in the same order and comes
    // back over NET, so a rank's NET peers differ per channel (e.g. rank 4 receives from rank 3
    // on channel 0 and from rank 2 on channel 2). Before, such rings fell back to rank order.
    use common::topo::MESH_RINGS;
    let topo = common::topo::fixture("nvlink-mesh-4gpu-topo.xml");
    for proto in ["Simple", "LL", "LL128"] {
        let envs: Vec<Vec<(&str, String)>> = (0..8)
            .map(|r| {
                vec![
                    (
                        "OXCCL_HOSTID",
                        if r < 4 { "host-a" } else { "host-b" }.to_string(),
                    ),
                    ("NCCL_TOPO_FILE", topo.display().to_string()),
                    ("NCCL_MAX_NCHANNELS", "6".to_string()),
                    ("NCCL_MIN_NCHANNELS", "6".to_string()),
                    ("NCCL_BUFFSIZE", "65536".to_string()),
                    ("NCCL_LL_BUFFSIZE", "16384".to_string()),
                    ("NCCL_LL128_BUFFSIZE", "65536".to_string()),
                    ("NCCL_PROTO", proto.to_string()),
                    ("NCCL_ALGO", "ring".to_string()),
                ]
            })
            .collect();
        // Channel c's ring: MESH_RINGS[c] on host A, then the same order on host B (ranks + 4).
        let ring = |c: usize| -> Vec<usize> {
            MESH_RINGS[c]
                .iter()
                .chain(MESH_RINGS[c].iter())
                .enumerate()
                .map(|(i, &g)| if i < 4 { g } else { g + 4 })
                .collect()
        };
        let expect: Vec<Vec<String>> = (0..8)
            .map(|r| {
                (0..6)
                    .map(|c| {
                        let g = ring(c);
                        let i = g.iter().position(|&x| x == r).unwrap();
                        let rotated: Vec<usize> = g[i..].iter().chain(&g[..i]).copied().collect();
                        format!("RING {c} {rotated:?}")
                    })
                    .chain((0..6).filter_map(|c| {
                        let g = ring(c);
                        let i = g.iter().position(|&x| x == r).unwrap();
                        let next = g[(i + 1) % 8];
                        let via = if (next < 4) == (r < 4) {
                            "SHM"
                        } else {
                            "NET/Socket/0"
                        };
                        Some(format!("Channel {c:02} : {r} -> {next} via {via}"))
                    }))
                    .collect()
            })
            .collect();
        let id = unique_id();
        run_group(&envs, &expect, &[None; 8], Some(&id));
        eprintln!("per_channel_rings_across_hosts: {proto} ok");
    }
}

#[test]
fn two_ranks_one_net_peer_and_unknown_net_name() {
    // Two ranks on two hosts: each rank's only neighbour is on the other host, both directions
    // over NET on the same pair of blocks; the default buffer sizes (512 KiB Simple slots).
    let id = unique_id();
    let envs: Vec<Vec<(&str, String)>> = (0..2)
        .map(|r| {
            vec![
                ("OXCCL_HOSTID", format!("solo-{r}")),
                ("NCCL_NET", "socket".to_string()),
            ]
        })
        .collect();
    let expect = vec![
        vec!["Channel 01 : 0 -> 1 via NET/Socket/0".to_string()],
        vec!["Channel 01 : 1 <- 0 via NET/Socket/0".to_string()],
    ];
    run_group(&envs, &expect, &[None; 2], Some(&id));

    // NCCL_NET naming a network that does not exist fails init on every rank with its own
    // InvalidArgument naming the choices (wanted_net's message).
    let unknown = "invalid argument: NCCL_NET=\"IB\": no network of that name (available: Socket)";
    let out = init_outcomes(&[
        vec![("OXCCL_HOSTID", "h0".into()), ("NCCL_NET", "IB".into())],
        vec![("OXCCL_HOSTID", "h1".into()), ("NCCL_NET", "IB".into())],
    ]);
    assert_eq!(
        out,
        [
            format!("INIT-ERR rank 0 InvalidArgument: {unknown}"),
            format!("INIT-ERR rank 1 InvalidArgument: {unknown}"),
        ]
    );
    // Only rank 1 names it: rank 1 fails on its own check; rank 0 gets a remote error naming
    // rank 1 and its error (connect_net all-gathers every rank's checks before going on).
    let out = init_outcomes(&[
        vec![("OXCCL_HOSTID", "h0".into())],
        vec![("OXCCL_HOSTID", "h1".into()), ("NCCL_NET", "IB".into())],
    ]);
    assert_eq!(
        out,
        [
            format!(
                "INIT-ERR rank 0 RemoteError: remote error: rank 0: rank 1 cannot set up its transports: {unknown}"
            ),
            format!("INIT-ERR rank 1 InvalidArgument: {unknown}"),
        ]
    );
}

#[test]
fn p2p_level_loc_and_shm_disabled_use_net_on_one_host() {
    // Two ranks of one host with NCCL_P2P_LEVEL=LOC and NCCL_SHM_DISABLE=1: NET both ways, and
    // every collective exact. On GPUs the P2P level keeps two distinct GPUs off P2P and SHM is
    // off, so NCCL uses NET; init once chose NET there while its NET setup chose again from its
    // own peer info (without the level) and found them disagreeing. CPU-target ranks never use
    // P2P, so here the level changes nothing: the test pins the outcome the GPU case must share.
    let id = unique_id();
    let envs: Vec<Vec<(&str, String)>> = (0..2)
        .map(|_| {
            vec![
                ("OXCCL_HOSTID", "one-host".to_string()),
                ("NCCL_P2P_LEVEL", "LOC".to_string()),
                ("NCCL_SHM_DISABLE", "1".to_string()),
                ("NCCL_BUFFSIZE", "65536".to_string()),
            ]
        })
        .collect();
    let expect = vec![
        vec!["Channel 00 : 0 -> 1 via NET/Socket/0".to_string()],
        vec!["Channel 00 : 1 -> 0 via NET/Socket/0".to_string()],
    ];
    run_group(&envs, &expect, &[None; 2], Some(&id));
}

#[test]
fn parallel_socket_streams_across_hosts() {
    // Two ranks on two hosts, NET both ways, each connection with NCCL_SOCKET_NTHREADS=2 ×
    // NCCL_NSOCKS_PERTHREAD=3 = 6 data sockets; default buffers, so Simple steps are 512 KiB and
    // split into 6 chunks of 87382 bytes (above the 64 KiB minimum). Every collective exact.
    let id = unique_id();
    let envs: Vec<Vec<(&str, String)>> = (0..2)
        .map(|r| {
            vec![
                ("OXCCL_HOSTID", format!("streams-{r}")),
                ("NCCL_SOCKET_NTHREADS", "2".to_string()),
                ("NCCL_NSOCKS_PERTHREAD", "3".to_string()),
                ("NCCL_PROTO", "Simple".to_string()),
            ]
        })
        .collect();
    let expect = vec![
        vec!["Channel 00 : 0 -> 1 via NET/Socket/0".to_string()],
        vec!["Channel 00 : 1 -> 0 via NET/Socket/0".to_string()],
    ];
    let outs = run_group(&envs, &expect, &[None; 2], Some(&id));
    // Each connection logs its traffic per data socket when it closes ("data sockets [a, b, c,
    // d, e, f] bytes"): 6 sockets, and on some connection every one of them carried data.
    for (r, out) in outs.iter().enumerate() {
        let lists: Vec<Vec<u64>> = out
            .lines()
            .filter_map(|l| l.split("data sockets [").nth(1)?.split(']').next())
            .map(|l| l.split(", ").map(|x| x.parse().unwrap()).collect())
            .collect();
        assert!(!lists.is_empty(), "rank {r}: no traffic lines in\n{out}");
        assert!(lists.iter().all(|l| l.len() == 6), "rank {r}: {lists:?}");
        assert!(
            lists.iter().any(|l| l.iter().all(|&b| b > 0)),
            "rank {r}: no connection used all 6 data sockets: {lists:?}"
        );
    }
    // A bad value on rank 1 fails its init with an InvalidArgument naming the variable and its
    // range; rank 0 gets a remote error naming rank 1 and that message.
    let out = init_outcomes(&[
        vec![("OXCCL_HOSTID", "h0".into())],
        vec![
            ("OXCCL_HOSTID", "h1".into()),
            ("NCCL_NSOCKS_PERTHREAD", "65".into()),
        ],
    ]);
    let bad = "invalid argument: NCCL_NSOCKS_PERTHREAD=65 is out of range (accepted: 1..=64)";
    assert_eq!(
        out,
        [
            format!(
                "INIT-ERR rank 0 RemoteError: remote error: rank 0: rank 1 cannot open its network for the NET \
                 transport: {bad}"
            ),
            format!("INIT-ERR rank 1 InvalidArgument: {bad}"),
        ]
    );
}

/// Runs `envs.len()` child ranks through `Comm::init_rank` only (`envs[r]` for rank r); returns
/// each rank's `INIT-` line. Every child must exit successfully within 60 s.
fn init_outcomes(envs: &[Vec<(&str, String)>]) -> Vec<String> {
    let id = unique_id();
    let n = envs.len();
    let mut ranks: Vec<LineChild> = (0..n)
        .map(|r| spawn_rank("init", r, n, Some(&id), &envs[r], None))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    ranks
        .iter_mut()
        .enumerate()
        .map(|(r, rank)| {
            let (ok, out) = rank.wait(deadline);
            assert!(ok, "rank {r} ({:?}): {out}", envs[r]);
            // The first output line follows libtest's "test net_child_entry ... ".
            out.lines()
                .find_map(|l| l.find("INIT-").map(|i| &l[i..]))
                .unwrap_or_else(|| panic!("rank {r}: no INIT- line in\n{out}"))
                .to_string()
        })
        .collect()
}

#[test]
fn transport_setup_error_on_one_rank_fails_every_rank_naming_it() {
    // Three ranks on one host (SHM ring): rank 1's NCCL_SHM_DISABLE is not 0 or 1. Before the
    // all-gather of transport checks, rank 1 failed alone and unlinked its connection memory,
    // so its neighbours failed opening it ("No such file") or waited for the bootstrap.
    let bad = "invalid argument: NCCL_SHM_DISABLE=\"yes\" is not 0 or 1 (accepted: 0, 1)";
    let envs: Vec<Vec<(&str, String)>> = (0..3)
        .map(|r| {
            let mut e = vec![("OXCCL_HOSTID", "one-host".to_string())];
            if r == 1 {
                e.push(("NCCL_SHM_DISABLE", "yes".into()));
            }
            e
        })
        .collect();
    assert_eq!(
        init_outcomes(&envs),
        [
            format!(
                "INIT-ERR rank 0 RemoteError: remote error: rank 0: rank 1 cannot set up its transports: {bad}"
            ),
            format!("INIT-ERR rank 1 InvalidArgument: {bad}"),
            format!(
                "INIT-ERR rank 2 RemoteError: remote error: rank 2: rank 1 cannot set up its transports: {bad}"
            ),
        ]
    );
    // Control: the same three ranks without the bad value initialize.
    let envs: Vec<Vec<(&str, String)>> = (0..3)
        .map(|_| vec![("OXCCL_HOSTID", "one-host".to_string())])
        .collect();
    assert_eq!(
        init_outcomes(&envs),
        ["INIT-OK rank 0", "INIT-OK rank 1", "INIT-OK rank 2"]
    );
}

/// Starts one "loop" child rank per entry of `envs` (rank r with `envs[r]`) on one unique id and
/// waits (at most 120 s) until every one has finished an AllReduce.
fn looping_ranks(envs: &[Vec<(&str, String)>]) -> Vec<LineChild> {
    let id = unique_id();
    let n = envs.len();
    let mut ranks: Vec<LineChild> = envs
        .iter()
        .enumerate()
        .map(|(r, env)| spawn_rank("loop", r, n, Some(&id), env, None))
        .collect();
    let t = Instant::now();
    while !(0..n).all(|r| ranks[r].has("LOOPING")) {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "ranks never all looped:\n{}",
            (0..n)
                .map(|r| ranks[r].text())
                .collect::<Vec<_>>()
                .join("\n---\n")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    ranks
}

/// A rank dies on a ring that mixes SHM and NET: hosts h0 = {0, 1} and h1 = {2, 3}, so the ring
/// is 0 -SHM-> 1 -NET-> 2 -SHM-> 3 -NET-> 0, and rank 2 is killed while every rank loops
/// AllReduce without ever calling abort or get_async_error. Only rank 1's proxy sees the death
/// (its NET send to rank 2 fails); rank 0 (waiting on rank 1 through SHM) and rank 3 (waiting on
/// rank 2 through SHM) have no NET connection with the dead rank. A failed NET connection raises
/// the abort flags of every rank of its host, so rank 0 stops too, its proxy closes its NET
/// receive from rank 3, and rank 3's proxy then raises host h1. Every survivor must report a
/// remote error and exit within 30 s of the kill (before: ranks 0 and 3 waited forever).
#[test]
fn killed_rank_on_a_mixed_shm_net_ring_stops_every_survivor() {
    let n = 4;
    let mut ranks = looping_ranks(
        &(0..n)
            .map(|r| {
                vec![
                    ("OXCCL_HOSTID", format!("mixed-h{}", r / 2)),
                    ("NCCL_PROTO", "Simple".into()),
                ]
            })
            .collect::<Vec<_>>(),
    );
    for r in 0..n {
        let via = if r % 2 == 0 { "SHM" } else { "NET" };
        let line = format!("Channel 00 : {r} -> {} via {via}", (r + 1) % n);
        assert!(ranks[r].has(&line), "rank {r}: no {line:?}:\n{}", ranks[r].text());
    }
    kill_and_check_survivors(&mut ranks, 2, "mixed ring", |_, line| {
        line.starts_with("GOT-ERROR RemoteError after ") && line.contains("aborted")
    });
}

/// Kills rank `victim` of `ranks` (all looping AllReduce), then waits (30 s from the kill) for
/// every other rank to exit successfully after printing a `GOT-ERROR` line that `ok_line(rank,
/// line)` accepts and `CHILD-EXITED rank R`.
fn kill_and_check_survivors(
    ranks: &mut [LineChild],
    victim: usize,
    what: &str,
    ok_line: impl Fn(usize, &str) -> bool,
) {
    ranks[victim].child.kill().unwrap();
    let _ = ranks[victim].child.wait();
    let killed = Instant::now();
    for (r, rank) in ranks.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let (ok, out) = rank.wait(killed + Duration::from_secs(30));
        assert!(ok, "{what}: rank {r}: {out}");
        let line = out
            .lines()
            .find_map(|l| l.find("GOT-ERROR").map(|i| &l[i..]))
            .unwrap_or_default();
        assert!(ok_line(r, line), "{what}: rank {r}: {line}\n{out}");
        assert!(
            out.contains(&format!("CHILD-EXITED rank {r}")),
            "{what}: rank {r}: {out}"
        );
        eprintln!("{what}: rank {r}: {line}");
    }
    eprintln!(
        "{what}: survivors exited {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    );
}

/// A rank's process dies on a one-host ring (SHM only, no NET and so no proxy to notice): the
/// survivors loop AllReduce and never poll get_async_error, so only oxccl's peer-liveness watch
/// (`liveness.rs`: the host's rank processes checked every 100 ms) can stop their kernels. Every
/// survivor must get a remote error naming the dead rank and exit within 30 s (before: it spun
/// forever in its stream synchronize).
#[test]
fn killed_rank_on_one_host_stops_shm_survivors() {
    let n = 3;
    let mut ranks = looping_ranks(
        &(0..n)
            .map(|_| {
                vec![
                    ("OXCCL_HOSTID", "one-shm-host".to_string()),
                    ("NCCL_PROTO", "Simple".into()),
                ]
            })
            .collect::<Vec<_>>(),
    );
    kill_and_check_survivors(&mut ranks, 1, "one host", |r, line| {
        line.starts_with("GOT-ERROR RemoteError after ")
            && crate::common::without_comm_ids(line).ends_with(&format!(
                ": remote error: rank {r} of communicator <id>: rank 1 of this communicator aborted; abort or destroy this rank too"
            ))
    });
}

#[test]
fn killed_rank_gives_the_others_an_error_c29() {
    // Four ranks on four hosts, all NET; rank 1 is killed while every rank loops AllReduce. Its
    // ring neighbours see their connection with it end (rank 2 receives from it, rank 0 sends to
    // it); a proxy whose connection fails raises its abort flag and closes its other
    // connections, so the failure travels around the ring both ways: no rank relies on shared
    // memory. Each must report an error and exit within 30 s of the kill. The trees' NET
    // connections (four hosts) carry the failure too.
    //
    // Which peer a rank names is the peer of the first connection that failed at that rank, and
    // that is timing: rank 2 may see rank 3 close (0 -> 3 -> 2, once rank 0 noticed) before it
    // reads the end of rank 1's stream, notably on a loaded machine. What holds always: each
    // survivor names one of its NET peers (ring neighbours or tree peers), exactly as its proxy
    // logged the failed connection, and a rank named by a survivor failed before it, so
    // following the names from any survivor ends at rank 1 (without a cycle).
    let n = 4;
    let mut ranks = looping_ranks(
        &(0..n)
            .map(|r| vec![("OXCCL_HOSTID", format!("k{r}")), ("NCCL_PROTO", "Simple".into())])
            .collect::<Vec<_>>(),
    );
    ranks[1].child.kill().unwrap();
    let _ = ranks[1].child.wait();
    let killed = Instant::now();
    let mut named = [None; 4];
    for r in [0, 2, 3] {
        let (ok, out) = ranks[r].wait(killed + Duration::from_secs(30));
        assert!(ok, "rank {r}: {out}");
        assert!(out.contains(&format!("CHILD-EXITED rank {r}")), "rank {r}: {out}");
        let line = out
            .lines()
            .find_map(|l| l.find("GOT-ERROR").map(|i| &l[i..]))
            .unwrap_or_default();
        eprintln!("killed_rank: rank {r}: {line}");
        // The message get_async_error builds from the rank the proxy recorded (comm.rs).
        let msg = |p: usize| {
            format!(
                ": remote error: rank {r} of communicator <id>: rank {p} of this communicator aborted; abort or destroy this rank too"
            )
        };
        // A NET peer: a ring neighbour, or a tree peer (four hosts: the double binary tree
        // connects ranks beyond the ring's neighbours, also over NET).
        let p = (0..n)
            .filter(|&p| p != r)
            .find(|&p| line.starts_with("GOT-ERROR RemoteError after ") && crate::common::without_comm_ids(line).ends_with(&msg(p)))
            .unwrap_or_else(|| panic!("rank {r}: not a remote error naming a peer: {line}\n{out}"));
        // The proxy's one error line names the same peer, on a connection with it: a receive
        // from it or a send to it (proxy.rs, CommOps::progress).
        let failed: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("; aborting the communicator"))
            .collect();
        let conns = [
            format!("rank {r}: NET receive from rank {p} (channel "),
            format!("rank {r}: NET send to rank {p} (channel "),
        ];
        assert!(
            failed.len() == 1 && conns.iter().any(|c| failed[0].contains(c.as_str())),
            "rank {r} named rank {p}; its proxy logged {failed:?}\n{out}"
        );
        named[r] = Some(p);
    }
    // Every chain of names ends at the killed rank within n - 1 steps.
    for start in [0, 2, 3] {
        let mut at = start;
        for _ in 0..n - 1 {
            if at == 1 {
                break;
            }
            at = named[at].unwrap();
        }
        assert_eq!(at, 1, "names from rank {start} do not lead to rank 1: {named:?}");
    }
    eprintln!(
        "killed_rank: survivors exited {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    );
}

#[test]
fn hosts_with_their_own_dev_shm() {
    // Real hosts do not share /dev/shm. Each rank here runs in its own mount namespace with a
    // private tmpfs on /dev/shm, as on two machines: each host's ranks share an abort page of
    // their own (before, every rank opened rank 0's page and init failed off rank 0's host with
    // "opening a peer's /dev/shm/oxccl-...-abort: No such file or directory").
    let wrap = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount -t tmpfs -o size=256m oxccl-test /dev/shm && exec \"$0\" \"$@\"",
    ];
    let probe = Command::new(wrap[0])
        .args(&wrap[1..])
        .args(["test", "-w", "/dev/shm"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED: hosts_with_their_own_dev_shm: cannot mount a private /dev/shm ({probe:?})");
        return;
    }
    // Two ranks on two hosts, each with its own /dev/shm: every collective of run_collectives
    // exact, over NET both ways.
    let id = unique_id();
    let mut ranks: Vec<LineChild> = (0..2)
        .map(|r| {
            let env = [
                ("OXCCL_HOSTID", format!("shm-host-{r}")),
                ("NCCL_BUFFSIZE", "65536".to_string()),
            ];
            spawn_rank_wrapped("coll", r, 2, Some(&id), &env, &wrap)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    for (r, rank) in ranks.iter_mut().enumerate() {
        let (ok, out) = rank.wait(deadline);
        assert!(
            ok && out.contains(&format!("NET-CHILD-OK rank {r}")),
            "rank {r}: {out}"
        );
        let next = 1 - r;
        assert!(
            out.contains(&format!("Channel 00 : {r} -> {next} via NET/Socket/0")),
            "rank {r}: {out}"
        );
    }
}

/// Network namespaces of one test, deleted on drop (also when the test fails).
struct Netns {
    names: Vec<String>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Deletes namespaces left by earlier runs of this test whose process is gone.
fn remove_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if let Some(rest) = name.strip_prefix("oxnt")
            && let Some(pid) = rest.get(..rest.len().saturating_sub(1))
            && let Ok(pid) = pid.parse::<u32>()
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

#[test]
fn two_hosts_in_network_namespaces() {
    remove_stale_namespaces();
    let pid = std::process::id();
    let (na, nb) = (format!("oxnt{pid}a"), format!("oxnt{pid}b"));
    let (va, vb) = (format!("oxv{pid}a"), format!("oxv{pid}b"));
    if let Err(e) = ip(&["netns", "add", &na]) {
        eprintln!("SKIPPED: two_hosts_in_network_namespaces: cannot create a network namespace ({e})");
        return;
    }
    let mut ns = Netns {
        names: vec![na.clone()],
    };
    ip(&["netns", "add", &nb]).expect("second namespace");
    ns.names.push(nb.clone());
    // One subnet per run: 10.77.S.0/24, host A at .1, host B at .2.
    let s = pid % 250 + 1;
    let (aa, ab) = (format!("10.77.{s}.1"), format!("10.77.{s}.2"));
    let (cidr_a, cidr_b) = (format!("{aa}/24"), format!("{ab}/24"));
    let setup = [
        vec![
            "link",
            "add",
            va.as_str(),
            "netns",
            na.as_str(),
            "type",
            "veth",
            "peer",
            "name",
            vb.as_str(),
            "netns",
            nb.as_str(),
        ],
        vec![
            "-n",
            na.as_str(),
            "addr",
            "add",
            cidr_a.as_str(),
            "dev",
            va.as_str(),
        ],
        vec![
            "-n",
            nb.as_str(),
            "addr",
            "add",
            cidr_b.as_str(),
            "dev",
            vb.as_str(),
        ],
        vec!["-n", na.as_str(), "link", "set", va.as_str(), "up"],
        vec!["-n", nb.as_str(), "link", "set", vb.as_str(), "up"],
        vec!["-n", na.as_str(), "link", "set", "lo", "up"],
        vec!["-n", nb.as_str(), "link", "set", "lo", "up"],
    ];
    for args in &setup {
        let args: Vec<&str> = args.iter().map(|a| a.as_ref()).collect();
        if let Err(e) = ip(&args) {
            eprintln!("SKIPPED: two_hosts_in_network_namespaces: veth setup failed ({e})");
            return;
        }
    }
    if let Err(e) = ip(&["netns", "exec", &na, "true"]) {
        eprintln!("SKIPPED: two_hosts_in_network_namespaces: cannot run a process in a namespace ({e})");
        return;
    }
    // Ranks 0, 1 on host A (SHM between them), ranks 2, 3 on host B; the root on rank 0's address.
    let comm_id = format!("{aa}:{}", 20000 + pid % 20000);
    for proto in ["Simple", "LL"] {
        let envs: Vec<Vec<(&str, String)>> = (0..4)
            .map(|r| {
                let (host, ifname) = if r < 2 { ("ns-a", &va) } else { ("ns-b", &vb) };
                vec![
                    ("OXCCL_HOSTID", host.to_string()),
                    ("NCCL_SOCKET_IFNAME", format!("={ifname}")),
                    ("NCCL_COMM_ID", comm_id.clone()),
                    ("NCCL_PROTO", proto.to_string()),
                    ("NCCL_BUFFSIZE", "65536".to_string()),
                ]
            })
            .collect();
        let expect: Vec<Vec<String>> = (0..4)
            .map(|r| {
                let ifname = if r < 2 { &va } else { &vb };
                let next = (r + 1) % 4;
                let t = if r % 2 == 0 { "SHM" } else { "NET/Socket/0" };
                vec![
                    format!("Channel 00 : {r} -> {next} via {t}"),
                    format!("iface={ifname}"),
                ]
            })
            .collect();
        let netns = [
            Some(na.as_str()),
            Some(na.as_str()),
            Some(nb.as_str()),
            Some(nb.as_str()),
        ];
        run_group(&envs, &expect, &netns, None);
        eprintln!("two_hosts_in_network_namespaces: {proto} ok");
    }
    drop(ns);
}
