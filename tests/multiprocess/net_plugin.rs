//! NCCL network plugins (`NCCL_NET_PLUGIN`, `host/transport/plugin.rs`): two CPU-target ranks as
//! processes on two "hosts" (`OXCCL_HOSTID`) run AllReduce over the NET transport through the
//! test plugin `libnccl-net-oxtest.so` (tests/net-plugin: `ncclNetPlugin_v8` and `_v9` over TCP,
//! which refuses transfers of unregistered memory; oxccl uses the newer, v9), on every protocol,
//! with exact results, and through its v8-only build `libnccl-net-oxtestv8.so`; a plugin that is
//! not there, or a library without any `ncclNetPlugin_v*` symbol oxccl knows, falls back to the
//! socket network with an info message or a warning; `NCCL_NET` still picks the network by name.
//!
//! **How the plugin gets built.** `cargo test` does not build a workspace member's `cdylib` for
//! another package's test, so the first test that needs it runs `cargo build -p
//! oxccl-net-oxtest` itself (the `CARGO` that runs the tests) into its own target directory,
//! `<target>/net-plugin`: the crate has no dependencies, so that takes seconds, works on a fresh
//! clone and with `cargo test --test net_plugin`, and never waits on the lock of the target
//! directory `cargo test` itself holds. The library is then copied (by rename, so running ranks
//! keep their copy) to `<target>/net-plugin/lib/libnccl-net-oxtest.so`, the name
//! `NCCL_NET_PLUGIN=oxtest` asks the dynamic loader for; a second build with
//! `--no-default-features` (no v9 table) becomes `libnccl-net-oxtestv8.so`.
//!
//! Every test launches this binary again as child ranks (`child_rank`), each with its own
//! environment, and reads their logs.
use crate::common::child::{self, LineChild, log_to_stdout};
use crate::common::unique_id;
use oxccl::bootstrap::UniqueId;
use oxccl::{Comm, DataType, Device, RedOp};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The directory holding `libnccl-net-oxtest.so`, built once per test process.
fn plugin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // <target>/debug/deps/multiprocess-<hash> → <target>.
        let exe = std::env::current_exe().unwrap();
        let target = exe.ancestors().nth(3).expect("target directory").to_path_buf();
        let out = target.join("net-plugin");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let dir = out.join("lib");
        std::fs::create_dir_all(&dir).unwrap();
        for (features, name) in [
            (None, "libnccl-net-oxtest.so"),
            (Some("--no-default-features"), "libnccl-net-oxtestv8.so"),
        ] {
            let st = Command::new(&cargo)
                .args(["build", "--quiet", "-p", "oxccl-net-oxtest", "--target-dir"])
                .arg(&out)
                .args(features)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .unwrap_or_else(|e| panic!("running {cargo} build: {e}"));
            assert!(
                st.success(),
                "cargo build -p oxccl-net-oxtest {features:?} failed: {st}"
            );
            let built = out.join("debug").join("libnccl_net_oxtest.so");
            let tmp = dir.join(format!(".{name}.{}", std::process::id()));
            std::fs::copy(&built, &tmp).unwrap_or_else(|e| panic!("copying {}: {e}", built.display()));
            std::fs::rename(&tmp, dir.join(name)).unwrap();
        }
        dir
    })
}

/// AllReduce counts: one element, an odd count, and one spanning many FIFO steps with the small
/// buffers the tests use (NCCL_BUFFSIZE 64 KiB: 8 KiB slots).
const COUNTS: [usize; 3] = [1, 4099, 200_003];

/// Every child rank: AllReduce (i32 sum) for each of [`COUNTS`], checked exactly, then
/// `destroy` (which closes the network connections).
#[test]
#[ignore = "child process of the tests of this module"]
fn child_rank() {
    child::enter();
    log_to_stdout("oxccl::transport=info,oxccl::net=info,oxccl::proxy=error");
    let (rank, n, id) = child::rank();
    let comm = Comm::init_rank(n, &id, rank, Device::Cpu(rank)).expect("init_rank");
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    for count in COUNTS {
        // in[i] = (r+1)·1000 + i mod 977, so out[i] = 1000·n(n+1)/2 + n·(i mod 977).
        let input: Vec<u8> = (0..count)
            .flat_map(|i| ((rank as i32 + 1) * 1000 + (i % 977) as i32).to_ne_bytes())
            .collect();
        let want: Vec<u8> = (0..count)
            .flat_map(|i| (1000 * (n * (n + 1) / 2) as i32 + n as i32 * (i % 977) as i32).to_ne_bytes())
            .collect();
        let buf = dev.alloc(count * 4).unwrap();
        buf.write(0, &input).unwrap();
        comm.all_reduce(&buf, &buf, count, DataType::I32, RedOp::Sum, &stream)
            .expect("all_reduce");
        stream.synchronize().expect("synchronize");
        let got = buf.to_vec().unwrap();
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            got == want,
            "rank {rank}: AllReduce count {count}: first wrong byte at {first:?}"
        );
    }
    comm.destroy().expect("destroy");
    println!("PLUGIN-CHILD-OK rank {rank}");
}

/// Starts this test binary as rank `rank` of `nranks` with `env` (and no inherited `NCCL_` /
/// `OXCCL_` variables); its output is read line by line.
fn spawn_rank(rank: usize, nranks: usize, id: &UniqueId, env: &[(&str, String)]) -> LineChild {
    let mut cmd = child::command(&child_entry!(child_rank));
    child::rank_env(&mut cmd, rank, nranks, id)
        .env("OXCCL_BOOTSTRAP_TIMEOUT", "30")
        .env("OXCCL_HOSTID", format!("plugin-host-{rank}"))
        .env("NCCL_BUFFSIZE", "65536")
        .env("NCCL_LL_BUFFSIZE", "16384")
        .env("NCCL_LL128_BUFFSIZE", "65536");
    for (k, v) in env {
        cmd.env(k, v);
    }
    LineChild::start(&mut cmd)
}

/// Runs two ranks with `envs[r]`; both must pass; their outputs.
fn run_pair(envs: [Vec<(&str, String)>; 2]) -> Vec<String> {
    let id = unique_id();
    let mut ranks: Vec<LineChild> = envs
        .iter()
        .enumerate()
        .map(|(r, e)| spawn_rank(r, 2, &id, e))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut outs = Vec::new();
    for (r, rank) in ranks.iter_mut().enumerate() {
        let (ok, out) = rank.wait(deadline);
        assert!(
            ok && out.contains(&format!("PLUGIN-CHILD-OK rank {r}")),
            "rank {r} ({:?}): {out}",
            envs[r]
        );
        outs.push(out);
    }
    outs
}

/// The one line of `out` that contains `needle` (the first), or a failure showing `out`.
fn line_with<'a>(out: &'a str, needle: &str) -> &'a str {
    out.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?} in\n{out}"))
}

/// (messages, bytes, `regMr` calls) of each closed connection of `side` as the plugin reported
/// them (`NET/OxTest : send comm closed: N messages, B bytes, R registrations`).
fn plugin_traffic(out: &str, side: &str) -> Vec<(u64, u64, u64)> {
    let key = format!("NET/OxTest : {side} comm closed: ");
    out.lines()
        .filter_map(|l| l.split(key.as_str()).nth(1))
        .map(|t| {
            let w: Vec<&str> = t.split([' ', ',']).filter(|w| !w.is_empty()).collect();
            (
                w[0].parse().unwrap(),
                w[2].parse().unwrap(),
                w[4].parse().unwrap(),
            )
        })
        .collect()
}

#[test]
fn plugin_carries_all_reduce_on_every_protocol() {
    let dir = plugin_dir();
    let path = dir.join("libnccl-net-oxtest.so").to_str().unwrap().to_string();
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(v) if !v.is_empty() => format!("{}:{v}", dir.display()),
        _ => dir.display().to_string(),
    };
    for proto in ["Simple", "LL", "LL128"] {
        // Rank 0 names the plugin (found through LD_LIBRARY_PATH as libnccl-net-oxtest.so), rank 1
        // gives its path; with NCCL_NET unset the plugin is the first network, so both use it.
        let envs = [
            vec![
                ("NCCL_PROTO", proto.to_string()),
                ("NCCL_NET_PLUGIN", "oxtest".to_string()),
                ("LD_LIBRARY_PATH", ld.clone()),
            ],
            vec![
                ("NCCL_PROTO", proto.to_string()),
                ("NCCL_NET_PLUGIN", path.clone()),
            ],
        ];
        let outs = run_pair(envs);
        for (r, (out, lib)) in outs
            .iter()
            .zip(["libnccl-net-oxtest.so", path.as_str()])
            .enumerate()
        {
            let peer = 1 - r;
            // The plugin exports v8 and v9: the newer is used, for every request.
            let loaded = line_with(out, "NET/Plugin: Loaded net plugin OxTest (v9)");
            assert!(
                loaded.contains(" INFO ") && loaded.ends_with(&format!("from {lib}")),
                "{loaded}"
            );
            // The plugin's own log line, through the logger oxccl gave its init.
            line_with(out, "NET/OxTest : initialized (TCP on 127.0.0.1)");
            line_with(out, &format!("Channel 00 : {r} -> {peer} via NET/OxTest/0"));
            line_with(out, &format!("Channel 00 : {r} <- {peer} via NET/OxTest/0"));
            // The data went through the plugin: a ring AllReduce of 2 ranks sends and receives,
            // per rank, (n-1)/n of the buffer in its reduce-scatter and as much in its all-gather,
            // i.e. all 200_003 * 4 = 800_012 bytes of the largest count (more with LL/LL128 flags
            // and the 32-byte headers), spread over one connection per channel and direction.
            let (sent, recvd) = (plugin_traffic(out, "send"), plugin_traffic(out, "recv"));
            // Posts: every completed message, plus receives still posted at close (the next
            // header each connection waits for).
            let (v8, v9) = posts_by_version(out);
            let msgs: u64 = sent.iter().chain(&recvd).map(|c| c.0).sum();
            assert!(
                v8 == 0 && v9 >= msgs,
                "rank {r} {proto}: every request through v9: v8 {v8}, v9 {v9}, {msgs} messages"
            );
            assert!(
                !sent.is_empty() && sent.len() == recvd.len(),
                "rank {r} {proto}: {sent:?} {recvd:?}\n{out}"
            );
            for (what, conns) in [("sent", &sent), ("received", &recvd)] {
                let bytes: u64 = conns.iter().map(|c| c.1).sum();
                assert!(
                    bytes >= 800_012,
                    "rank {r} {proto}: {what} {bytes} bytes: {conns:?}"
                );
                assert!(
                    conns.iter().all(|c| c.0 > 0),
                    "rank {r} {proto}: an idle connection: {conns:?}"
                );
            }
            if proto == "Simple" {
                // Registrations: the connection's FIFO block once at setup (the NET transport's
                // regMr), and the copy buffer of the 32-byte headers once, at the first header;
                // Simple payloads are whole FIFO slots inside the block, so nothing else.
                assert!(
                    sent.iter().chain(&recvd).all(|c| c.2 == 2),
                    "rank {r}: regMr calls per connection: {sent:?} {recvd:?}"
                );
            }
            // The plugin refuses unregistered buffers, too many requests and leaked
            // registrations with a WARN: none may appear.
            for bad in [
                "without a registration",
                "registrations left",
                "NCCL_NET_MAX_REQUESTS",
                "WARN",
            ] {
                assert!(!out.contains(bad), "rank {r} {proto}: {bad:?} in\n{out}");
            }
        }
        eprintln!("net_plugin: {proto} ok");
    }
}

/// Requests posted through the plugin's v8 and v9 entry points, summed over the closed
/// connections (`..., v8 posts P8, v9 posts P9`).
fn posts_by_version(out: &str) -> (u64, u64) {
    let num = |l: &str, key: &str| -> u64 {
        l.split(key)
            .nth(1)
            .and_then(|t| t.split([',', ' ']).next())
            .map_or(0, |n| n.parse().unwrap())
    };
    out.lines()
        .filter(|l| l.contains("NET/OxTest : ") && l.contains(" comm closed: "))
        .fold((0, 0), |(a, b), l| {
            (a + num(l, "v8 posts "), b + num(l, "v9 posts "))
        })
}

#[test]
fn v8_only_plugin_is_used_through_v8() {
    // The v8-only build (no ncclNetPlugin_v9): loaded as v8, every request through the v8
    // entry points (int sizes), AllReduce exact.
    let path = plugin_dir()
        .join("libnccl-net-oxtestv8.so")
        .to_str()
        .unwrap()
        .to_string();
    let env = vec![
        ("NCCL_NET_PLUGIN", path.clone()),
        ("NCCL_PROTO", "Simple".to_string()),
    ];
    let outs = run_pair([env.clone(), env]);
    for (r, out) in outs.iter().enumerate() {
        let loaded = line_with(out, "NET/Plugin: Loaded net plugin OxTest (v8)");
        assert!(loaded.ends_with(&format!("from {path}")), "{loaded}");
        line_with(out, &format!("Channel 00 : {r} -> {} via NET/OxTest/0", 1 - r));
        let msgs: u64 = plugin_traffic(out, "send")
            .iter()
            .chain(&plugin_traffic(out, "recv"))
            .map(|c| c.0)
            .sum();
        assert!(
            msgs > 0,
            "rank {r}: no traffic
{out}"
        );
        // Posts: every completed message, plus receives still posted at close.
        let (v8, v9) = posts_by_version(out);
        assert!(
            v9 == 0 && v8 >= msgs,
            "rank {r}: every request through v8: v8 {v8}, v9 {v9}, {msgs} messages"
        );
    }
}

#[test]
fn missing_or_symbol_less_plugin_falls_back_to_sockets() {
    // Rank 0: no such library (an info message); rank 1: libm, a library without
    // ncclNetPlugin_v8 (a warning). Both use the socket network and get exact results.
    let envs = [
        vec![("NCCL_NET_PLUGIN", "doesnotexist".to_string())],
        vec![("NCCL_NET_PLUGIN", "libm.so.6".to_string())],
    ];
    let outs = run_pair(envs);
    let info = line_with(
        &outs[0],
        "NET/Plugin: Could not find: doesnotexist libnccl-net-doesnotexist.so; using the internal socket network",
    );
    assert!(info.contains(" INFO "), "{info}");
    let warn = line_with(
        &outs[1],
        "NET/Plugin: libm.so.6: no ncclNetPlugin_v10, ncclNetPlugin_v9 or ncclNetPlugin_v8 symbol",
    );
    assert!(
        warn.contains(" WARN ") && warn.ends_with("; using the internal socket network"),
        "{warn}"
    );
    for (r, out) in outs.iter().enumerate() {
        line_with(out, &format!("Channel 00 : {r} -> {} via NET/Socket/0", 1 - r));
        assert!(!out.contains("OxTest"), "rank {r}:\n{out}");
    }
}

#[test]
fn nccl_net_picks_socket_or_the_plugin_by_name() {
    // The plugin is loaded on both ranks; NCCL_NET=socket still selects the socket network, and
    // NCCL_NET=oxtest (any case, as NCCL's initNet) the plugin.
    let path = plugin_dir()
        .join("libnccl-net-oxtest.so")
        .to_str()
        .unwrap()
        .to_string();
    for (net, via) in [("socket", "NET/Socket/0"), ("oxtest", "NET/OxTest/0")] {
        let env = vec![
            ("NCCL_NET_PLUGIN", path.clone()),
            ("NCCL_NET", net.to_string()),
            ("NCCL_PROTO", "Simple".to_string()),
        ];
        let outs = run_pair([env.clone(), env]);
        for (r, out) in outs.iter().enumerate() {
            line_with(out, "NET/Plugin: Loaded net plugin OxTest (v9)");
            line_with(out, &format!("Channel 00 : {r} -> {} via {via}", 1 - r));
        }
    }
}
