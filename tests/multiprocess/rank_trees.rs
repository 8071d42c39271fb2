//! Trees on `Comm::init_rank` communicators that span hosts: ranks as processes on "hosts"
//! (`OXCCL_HOSTID`) run tree AllReduce (`NCCL_ALGO=tree`) with its edges over SHM or P2P inside a
//! host and NET (the socket network and the proxy thread) between hosts, on each protocol, with
//! exact results in and out of place, guards untouched and every rank's result bitwise equal.
//!
//! The CPU-target tests run in CI. `tree_across_hosts_on_one_gpu` runs the CUDA kernels the same
//! way, every rank on GPU 0, on LL and Simple; `gpu_ll128_through_host_memory_is_refused_and_shm_chains_work`
//! checks that GPUs never run LL128 through host memory and runs SHM chains (both print SKIPPED
//! without a GPU).
//!
//! Every test launches this binary again as child ranks (`child_rank`).
use crate::common::child::{self, LineChild, log_to_stdout};
use crate::common::{self, unique_id};
use oxccl::perf::check;
use oxccl::{Comm, DataType, Device, Func, RedOp};
use std::time::{Duration, Instant};

/// Guard bytes before and after each output.
const GUARD: usize = 64;

/// Element counts: one element, an odd count, and spans of many FIFO steps with the small buffers
/// the tests use.
const COUNTS: [usize; 4] = [1, 1001, 40_000, 150_001];

/// A child rank: `init_rank` on the device `OXCCL_CHILD_DEVICE` names (`cpu`, the default, or
/// `cuda`: GPU 0), then tree AllReduce over `OXCCL_CHILD_DTYPES` (default: every dtype) ×
/// every op × [`COUNTS`] × out-of-place / in-place; prints `WRONG ...` per failure, a `DIGEST`
/// of every result (for the parent to compare across ranks) and `TREE-CHILD-OK rank R`.
#[test]
#[ignore = "child process of the tests of this module"]
fn child_rank() {
    child::enter();
    log_to_stdout("oxccl::init=info,oxccl::transport=info,oxccl::proxy=error");
    let (rank, nranks, id) = child::rank();
    let device = match std::env::var("OXCCL_CHILD_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        _ => Device::Cpu(rank),
    };
    let role = std::env::var("OXCCL_CHILD_ROLE").unwrap_or_default();
    let comm = match Comm::init_rank(nranks, &id, rank, device) {
        Ok(c) if role == "init" => {
            c.destroy().expect("destroy");
            println!("INIT-OK rank {rank}");
            println!("TREE-CHILD-OK rank {rank}");
            return;
        }
        Ok(c) => c,
        Err(e) if role == "init" => {
            println!("INIT-ERR rank {rank} {:?}: {e}", e.code());
            println!("TREE-CHILD-OK rank {rank}");
            return;
        }
        Err(e) => panic!("init_rank: {e}"),
    };
    println!("MEM {}", comm.device_memory_bytes());
    if std::env::var("OXCCL_CHILD_ROLE").as_deref() == Ok("c15") {
        // Case C15: AllReduce int32 count 4, rank r contributes r + 1.
        let stream = device.new_stream().unwrap();
        let buf = device.alloc(16).unwrap();
        buf.write(0, &((rank + 1) as i32).to_ne_bytes().repeat(4))
            .unwrap();
        comm.all_reduce(&buf, &buf, 4, DataType::I32, RedOp::Sum, &stream)
            .expect("all_reduce");
        stream.synchronize().expect("synchronize");
        let got: Vec<i32> = buf
            .to_vec()
            .unwrap()
            .chunks(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        println!("C15 {got:?} algo {:?}", comm.last_choice().map(|c| c.algo));
        comm.destroy().expect("destroy");
        println!("TREE-CHILD-OK rank {rank}");
        return;
    }
    if std::env::var("OXCCL_CHILD_ROLE").as_deref() == Ok("choice") {
        match comm.choice_for(Func::AllReduce, 1 << 20, DataType::F32) {
            Ok(c) => println!("CHOICE {:?}", c.map(|c| c.algo)),
            Err(e) => println!("CHOICE-ERR {e}"),
        }
        comm.destroy().expect("destroy");
        println!("TREE-CHILD-OK rank {rank}");
        return;
    }
    let dtypes: Vec<DataType> = match std::env::var("OXCCL_CHILD_DTYPES") {
        Ok(v) => v
            .split(',')
            .map(|d| {
                *DataType::ALL
                    .iter()
                    .find(|x| x.name() == d)
                    .unwrap_or_else(|| panic!("dtype {d}"))
            })
            .collect(),
        Err(_) => DataType::ALL.to_vec(),
    };
    let stream = device.new_stream().unwrap();
    let mut digest = 0xcbf2_9ce4_8422_2325u64;
    let mut wrong = 0usize;
    let mut calls = 0usize;
    let mut used: Vec<String> = Vec::new();
    for &dtype in &dtypes {
        for &op in RedOp::ALL {
            let size = dtype.size();
            let max = *COUNTS.iter().max().unwrap();
            let send = device.alloc(max * size + 2 * GUARD).unwrap();
            let recv = device.alloc(max * size + 2 * GUARD).unwrap();
            for count in COUNTS {
                let bytes = count * size;
                let seed = (calls as u64) << 8;
                let input = check::fill_input(Func::AllReduce, dtype, op, rank, nranks, seed, count).unwrap();
                let want = check::expected(Func::AllReduce, dtype, op, nranks, seed, count).unwrap();
                for in_place in [false, true] {
                    let guard = vec![0xa5u8; GUARD];
                    let poison = check::poison(dtype, count);
                    let mut s = guard.clone();
                    s.extend_from_slice(&input);
                    s.extend_from_slice(&guard);
                    send.write(0, &s).unwrap();
                    let out = if in_place { &send } else { &recv };
                    if !in_place {
                        let mut r = guard.clone();
                        r.extend_from_slice(&poison);
                        r.extend_from_slice(&guard);
                        recv.write(0, &r).unwrap();
                    }
                    let sv = send.slice(GUARD, bytes).unwrap();
                    let rv = out.slice(GUARD, bytes).unwrap();
                    comm.all_reduce(sv, rv, count, dtype, op, &stream)
                        .expect("all_reduce");
                    stream.synchronize().expect("synchronize");
                    calls += 1;
                    let choice = comm.last_choice().expect("choice");
                    let p = format!("{:?}", choice.proto);
                    if !used.contains(&p) {
                        used.push(p);
                    }
                    let all = out.to_vec().unwrap();
                    let got = &all[GUARD..GUARD + bytes];
                    let n = check::count_wrong(dtype, op, got, &want, nranks);
                    let guards_ok =
                        all[..GUARD] == guard[..] && all[GUARD + bytes..GUARD + bytes + GUARD] == guard[..];
                    if n > 0 || !guards_ok || format!("{:?}", choice.algo) != "Tree" {
                        wrong += 1;
                        println!(
                            "WRONG rank {rank} {dtype:?} {op:?} count {count} in_place {in_place}: {n} wrong, \
                             guards ok {guards_ok}, plan {choice:?}"
                        );
                    }
                    digest = got
                        .iter()
                        .fold(digest, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
                }
            }
        }
    }
    println!("DIGEST {digest:016x} calls {calls}");
    println!("PROTOS-USED {used:?}");
    comm.destroy().expect("destroy");
    assert_eq!(wrong, 0, "rank {rank}: {wrong} wrong calls");
    println!("TREE-CHILD-OK rank {rank}");
}

/// Runs `envs.len()` child ranks (`envs[r]` for rank `r`, plus `common`) on one unique id; every
/// rank must pass, print each of `expect[r]`'s lines, and report the same digest. Returns the
/// outputs.
fn run_ranks(common: &[(&str, String)], envs: &[Vec<(&str, String)>], expect: &[Vec<String>]) -> Vec<String> {
    let n = envs.len();
    let id = unique_id();
    let mut ranks: Vec<LineChild> = (0..n)
        .map(|r| {
            let mut cmd = child::command_with(
                &child_entry!(child_rank),
                common.iter().map(|(k, v)| (*k, v.as_str())),
            );
            child::rank_env(&mut cmd, r, n, &id).env("OXCCL_BOOTSTRAP_TIMEOUT", "60");
            for (k, v) in &envs[r] {
                cmd.env(k, v);
            }
            LineChild::start(&mut cmd)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut outs = Vec::new();
    for (r, rank) in ranks.iter_mut().enumerate() {
        let (ok, out) = rank.wait(deadline);
        assert!(
            ok && out.contains(&format!("TREE-CHILD-OK rank {r}")),
            "rank {r} ({:?}): {out}",
            envs[r]
        );
        for line in &expect[r] {
            assert!(out.contains(line.as_str()), "rank {r}: no {line:?} in\n{out}");
        }
        outs.push(out);
    }
    if std::env::var("OXCCL_TEST_TREE_SHOW").is_ok() {
        eprintln!("{}", outs.join("\n----\n"));
    }
    let role = |e: &[(&str, String)]| e.iter().any(|(k, _)| *k == "OXCCL_CHILD_ROLE");
    if role(common) || envs.iter().any(|e| role(e)) {
        return outs;
    }
    let digest = |o: &String| o.lines().find(|l| l.starts_with("DIGEST")).map(str::to_string);
    let d0 = digest(&outs[0]).expect("rank 0 digest");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(
            digest(o).as_deref(),
            Some(d0.as_str()),
            "rank {r}'s results differ from rank 0's"
        );
    }
    outs
}

/// Small FIFOs (many steps per call) and the protocol `proto`, tree forced.
fn small_fifos(proto: &str) -> Vec<(&'static str, String)> {
    vec![
        ("NCCL_ALGO", "tree".to_string()),
        ("NCCL_PROTO", proto.to_string()),
        ("NCCL_BUFFSIZE", "65536".to_string()),
        ("NCCL_LL_BUFFSIZE", "16384".to_string()),
        ("NCCL_LL128_BUFFSIZE", "65536".to_string()),
        ("NCCL_MAX_NCHANNELS", "2".to_string()),
    ]
}

fn host(h: &str) -> Vec<(&'static str, String)> {
    vec![("OXCCL_HOSTID", h.to_string())]
}

/// Four ranks on two hosts (0, 1 on host-a; 2, 3 on host-b), each also with `extra`.
fn two_hosts(extra: &[(&'static str, &str)]) -> Vec<Vec<(&'static str, String)>> {
    (0..4)
        .map(|r| {
            let mut e = host(if r < 2 { "host-a" } else { "host-b" });
            e.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
            e
        })
        .collect()
}

#[test]
fn tree_across_two_hosts_every_protocol() {
    // Hosts A (ranks 0, 1) and B (ranks 2, 3): chains 0-1 and 2-3 over SHM, 0 and 2 joined over
    // NET. Double binary tree of 2 nodes: tree 0 has node A at the root (0 → 2 down), tree 1
    // node B (2 → 0); channels 0 and 1 run one each.
    for proto in ["LL", "LL128", "Simple"] {
        let mut common = small_fifos(proto);
        common.push(("OXCCL_CHILD_DTYPES", "int32,float,half,int8".to_string()));
        let envs = two_hosts(&[]);
        let expect = vec![
            vec![
                "Trees [0] 1/2/-1->0->-1".to_string(),
                "Trees [1] 1/-1/-1->0->2".to_string(),
            ],
            vec![
                "Trees [0] -1/-1/-1->1->0".to_string(),
                "Trees [1] -1/-1/-1->1->0".to_string(),
            ],
            vec![
                "Trees [0] 3/-1/-1->2->0".to_string(),
                "Trees [1] 3/0/-1->2->-1".to_string(),
            ],
            vec![
                "Trees [0] -1/-1/-1->3->2".to_string(),
                "Trees [1] -1/-1/-1->3->2".to_string(),
            ],
        ];
        run_ranks(&common, &envs, &expect);
        eprintln!("tree_across_two_hosts: {proto} ok");
    }
}

#[test]
fn tree_with_three_children_and_net_inside_a_host() {
    // Four hosts of two ranks; host B with NCCL_SHM_DISABLE=1 (its chain uses NET too). The tree
    // pattern hook hangs both child nodes from the first rank of their parent node, which then
    // has three children: its chain's next rank and two ranks over NET (NCCL's
    // NCCL_TOPO_PATTERN_TREE; 4 nodes make a node with two child nodes).
    for proto in ["LL", "LL128", "Simple"] {
        let mut common = small_fifos(proto);
        common.push(("OXCCL_TEST_TREE_PATTERN", "tree".to_string()));
        common.push(("OXCCL_CHILD_DTYPES", "float,int64".to_string()));
        let envs: Vec<_> = (0..8)
            .map(|r| {
                let mut e = host(["host-a", "host-b", "host-c", "host-d"][r / 2]);
                if r / 2 == 1 {
                    e.push(("NCCL_SHM_DISABLE", "1".to_string()));
                }
                e
            })
            .collect();
        let outs = run_ranks(&common, &envs, &vec![Vec::new(); 8]);
        let three: Vec<&str> = outs
            .iter()
            .flat_map(|o| o.lines())
            .filter(|l| l.contains("Trees [") && !l.contains("/-1->"))
            .collect();
        assert!(
            !three.is_empty(),
            "no rank with three children:\n{}",
            outs.join("\n")
        );
        eprintln!("tree_with_three_children: {proto} ok ({three:?})");
    }
}

#[test]
fn ranks_excluding_the_tree_set_up_none() {
    // Two hosts, NCCL_ALGO=ring on every rank: no trees are set up (no tree FIFOs, no NET tree
    // connections), the ring runs. (NCCL_ALGO differing across ranks fails init naming it: the
    // `lifecycle` tests.)
    let envs = two_hosts(&[("OXCCL_CHILD_ROLE", "choice"), ("NCCL_ALGO", "ring")]);
    let expect = vec![vec!["CHOICE Some(Ring)".to_string()]; 4];
    let outs = run_ranks(&[], &envs, &expect);
    assert!(
        outs.iter().all(|o| !o.contains("Trees [")),
        "trees set up: {outs:?}"
    );
    // With every rank wanting trees, the same ranks hold more connection memory (tree FIFOs).
    let mem = |o: &String| -> u64 {
        o.lines()
            .find_map(|l| l.strip_prefix("MEM "))
            .and_then(|v| v.parse().ok())
            .expect("MEM line")
    };
    let envs_all = two_hosts(&[("OXCCL_CHILD_ROLE", "choice"), ("NCCL_ALGO", "tree")]);
    let with = run_ranks(&[], &envs_all, &vec![vec!["CHOICE Some(Tree)".to_string()]; 4]);
    for r in 0..4 {
        assert!(
            mem(&with[r]) > mem(&outs[r]),
            "rank {r}: {} vs {}",
            mem(&with[r]),
            mem(&outs[r])
        );
    }
}

#[test]
fn c15_unequal_ranks_per_host_tree_and_ring() {
    // Case C15: hosts with unequal rank counts (rank 0 on host A, ranks 1 and 2 on host B; and 7
    // + 8 ranks): init completes, the chains differ in length, and AllReduce int32 count 4 of
    // rank + 1 gives 1 + 2 + ... + n on every rank, on the tree (forced) and the ring.
    for (hosts, algo) in [(vec![1, 2], "tree"), (vec![1, 2], "ring"), (vec![7, 8], "tree")] {
        let n: usize = hosts.iter().sum();
        let envs: Vec<Vec<(&str, String)>> = (0..n)
            .map(|r| {
                let mut e = host(if r < hosts[0] { "host-a" } else { "host-b" });
                e.push(("OXCCL_CHILD_ROLE", "c15".to_string()));
                e.push(("NCCL_ALGO", algo.to_string()));
                e
            })
            .collect();
        let sum = (n * (n + 1) / 2) as i32;
        let want = format!(
            "C15 {:?} algo Some({})",
            [sum; 4],
            if algo == "tree" { "Tree" } else { "Ring" }
        );
        run_ranks(&[], &envs, &vec![vec![want]; n]);
        eprintln!("c15: {hosts:?} {algo} ok");
    }
}

#[test]
fn tree_across_hosts_on_one_gpu() {
    let Some(_) = common::gpus_or_skip("tree_across_hosts_on_one_gpu", 1) else {
        return;
    };
    // Four ranks on GPU 0 in two "hosts": chains over P2P/IPC on the one device, NET between the
    // hosts through pinned, device-mapped host memory.
    for proto in ["LL", "Simple"] {
        let mut common = small_fifos(proto);
        common.push(("OXCCL_CHILD_DEVICE", "cuda".to_string()));
        common.push(("OXCCL_ALLOW_SHARED_DEVICE", "1".to_string()));
        common.push((
            "OXCCL_CHILD_DTYPES",
            "float,half,bfloat16,int32,int8,double".to_string(),
        ));
        let envs = two_hosts(&[]);
        run_ranks(&common, &envs, &vec![Vec::new(); 4]);
        eprintln!("tree_across_hosts_on_one_gpu: {proto} ok");
    }
}

#[test]
fn gpu_ll128_through_host_memory_is_refused_and_shm_chains_work() {
    let Some(_) = common::gpus_or_skip("gpu_ll128_through_host_memory_is_refused_and_shm_chains_work", 1)
    else {
        return;
    };
    // LL128 through host memory is refused on GPUs, also when NCCL_PROTO names it: a 128-byte
    // line can land in two halves, the flag's first (forced, this test once saw 64 bytes of a
    // line wrong on H200). NCCL_PROTO=LL128 alone fails init on every rank naming it; with
    // another protocol allowed, LL128 is left out (the tuner never picks it).
    let mut common = small_fifos("LL128");
    common.push(("OXCCL_CHILD_DEVICE", "cuda".to_string()));
    common.push(("OXCCL_ALLOW_SHARED_DEVICE", "1".to_string()));
    common.push(("OXCCL_CHILD_ROLE", "init".to_string()));
    let envs = two_hosts(&[]);
    let want: Vec<Vec<String>> = (0..4)
        .map(|r| {
            vec![format!(
                "INIT-ERR rank {r} InvalidArgument: invalid argument: NCCL_PROTO=\"LL128\": LL128 cannot run \
                 on this communicator: its GPU connections go through host memory (SHM or NET)"
            )]
        })
        .collect();
    run_ranks(&common, &envs, &want);
    let mut common = small_fifos("LL128,LL");
    common.push(("OXCCL_CHILD_DEVICE", "cuda".to_string()));
    common.push(("OXCCL_ALLOW_SHARED_DEVICE", "1".to_string()));
    common.push(("OXCCL_CHILD_DTYPES", "float".to_string()));
    let outs = run_ranks(&common, &envs, &vec![Vec::new(); 4]);
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.contains("names LL128, which is off on this communicator"),
            "rank {r}: {o}"
        );
        assert!(o.contains("PROTOS-USED [\"Ll\"]"), "rank {r}: {o}");
    }
    // NCCL_P2P_DISABLE=1: the chains use SHM (registered /dev/shm segments) on CUDA.
    for proto in ["LL", "Simple"] {
        let mut common = small_fifos(proto);
        common.push(("OXCCL_CHILD_DEVICE", "cuda".to_string()));
        common.push(("OXCCL_ALLOW_SHARED_DEVICE", "1".to_string()));
        common.push(("NCCL_P2P_DISABLE", "1".to_string()));
        common.push(("OXCCL_CHILD_DTYPES", "float,int8".to_string()));
        let envs = two_hosts(&[]);
        let expect = vec![
            vec!["Channel 00 : 0 -> 1 via SHM".to_string()],
            vec![],
            vec![],
            vec![],
        ];
        run_ranks(&common, &envs, &expect);
        eprintln!("tree_across_hosts_on_one_gpu: SHM chains, {proto} ok");
    }
}
