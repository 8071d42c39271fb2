//! A bad `NCCL_TOPO_FILE` fails communicator creation on the CPU target, naming the file, the
//! line and why (before, `node_ring_graph` logged it at debug level and silently kept rank
//! order); with `init_rank`, a bad file on one rank only fails every rank in bounded time, the
//! others with a remote error naming that rank ("error on every rank", as C-cases ask).
//!
//! Each case runs in a child process of this binary (`child_init`) with its own environment,
//! since the variable is process-wide.
use crate::common::child;
use oxccl::bootstrap::get_unique_id;
use oxccl::{Comm, Device};
use std::time::{Duration, Instant};

/// The child of every case. `OXCCL_CHILD_ROLE` = `all`: `Comm::init_all` over
/// `OXCCL_CHILD_NRANKS` CPU ranks; `rank`: `Comm::init_rank` as rank `OXCCL_CHILD_RANK` of
/// `OXCCL_CHILD_NRANKS` ([`child::rank`]). Prints `INIT-OK` or `INIT-ERR <code>: <error>`.
#[test]
#[ignore = "child process of the tests of this module"]
fn child_init() {
    child::enter();
    let role = child::env_var("OXCCL_CHILD_ROLE");
    let res = if role == "all" {
        let n: usize = child::env_parse("OXCCL_CHILD_NRANKS");
        Comm::init_all(&(0..n).map(Device::Cpu).collect::<Vec<_>>()).map(|c| c.len())
    } else {
        let (rank, n, id) = child::rank();
        Comm::init_rank(n, &id, rank, Device::Cpu(rank)).map(|_| 1)
    };
    match res {
        Ok(_) => println!("INIT-OK"),
        Err(e) => println!("INIT-ERR {:?}: {e}", e.code()),
    }
}

/// Starts a [`child_init`] with `env` and a 30 s bootstrap timeout.
fn spawn(env: &[(&str, String)]) -> std::process::Child {
    let mut cmd = child::command(&child_entry!(child_init));
    cmd.env("OXCCL_BOOTSTRAP_TIMEOUT", "30");
    for (k, v) in env {
        cmd.env(k, v);
    }
    child::spawn(&mut cmd)
}

/// The child's `INIT-` line (it must run its entry and exit by `deadline`).
fn outcome(c: std::process::Child, deadline: Instant) -> String {
    let pid = c.id();
    let (ok, text) = child::wait_with_deadline(c, deadline);
    assert!(ok, "child {pid} failed or did not exit in time (hang):\n{text}");
    text.lines()
        .find_map(|l| l.find("INIT-").map(|i| l[i..].to_string()))
        .unwrap_or_else(|| panic!("child {pid}: no INIT- line in\n{text}"))
}

fn write_tmp(name: &str, text: &str) -> String {
    let p = std::env::temp_dir().join(format!("oxccl-topo-errors-{}-{name}", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn bad_topo_file_fails_init_all_naming_file_line_and_reason() {
    let garbage = write_tmp("garbage.xml", "hello world\n");
    // The second <pci> (line 3) has no busid.
    let nobus = write_tmp(
        "nobus.xml",
        "<system version=\"1\">\n  <cpu numaid=\"0\" affinity=\"ff\" arch=\"x86_64\" vendor=\"GenuineIntel\" familyid=\"6\" modelid=\"106\">\n    <pci class=\"0x030200\"><gpu dev=\"0\" sm=\"80\" rank=\"0\" gdr=\"1\"/></pci>\n  </cpu>\n</system>\n",
    );
    let missing = format!("{garbage}.does-not-exist");
    // Expected messages: Xml::parse / Xml::from_file's wording (host/topo/xml.rs), as the
    // `oxccl topo` subcommand prints them for the same files.
    let cases = [
        (
            garbage.clone(),
            format!(
                "INIT-ERR InvalidArgument: invalid argument: {garbage}:1: malformed topology XML: unknown token at 1:1"
            ),
        ),
        (
            nobus.clone(),
            format!(
                "INIT-ERR InvalidArgument: invalid argument: {nobus}:3: <pci>: attribute \"busid\" is missing"
            ),
        ),
        (
            missing.clone(),
            format!(
                "INIT-ERR SystemError: system error: cannot read topology file {missing}: No such file or directory (os error 2)"
            ),
        ),
    ];
    for (file, want) in cases {
        let child = spawn(&[
            ("OXCCL_CHILD_ROLE", "all".into()),
            ("OXCCL_CHILD_NRANKS", "3".into()),
            ("NCCL_TOPO_FILE", file.clone()),
        ]);
        assert_eq!(
            outcome(child, Instant::now() + Duration::from_secs(60)),
            want,
            "{file}"
        );
    }
    // Control: a valid fixture initializes.
    let good = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/topo/nvlink-mesh-4gpu-topo.xml"
    );
    let child = spawn(&[
        ("OXCCL_CHILD_ROLE", "all".into()),
        ("OXCCL_CHILD_NRANKS", "4".into()),
        ("NCCL_TOPO_FILE", good.into()),
    ]);
    assert_eq!(
        outcome(child, Instant::now() + Duration::from_secs(60)),
        "INIT-OK"
    );
    let _ = std::fs::remove_file(garbage);
    let _ = std::fs::remove_file(nobus);
}

/// Starts `n` `init_rank` children on one host, `extra` added to rank 1's environment; their
/// `INIT-` lines, within 20 s (under the children's 30 s bootstrap timeout).
fn init_rank_with_rank1(n: usize, extra: (&'static str, String)) -> Vec<String> {
    let id = {
        let _env = crate::common::env::shared();
        get_unique_id().unwrap()
    };
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut env = vec![
                ("OXCCL_CHILD_ROLE", "rank".to_string()),
                ("OXCCL_CHILD_NRANKS", n.to_string()),
                ("OXCCL_CHILD_RANK", r.to_string()),
                ("OXCCL_CHILD_ID", child::hex(&id.to_bytes())),
                ("OXCCL_HOSTID", "one-host".to_string()),
            ];
            if r == 1 {
                env.push(extra.clone());
            }
            spawn(&env)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    children.into_iter().map(|c| outcome(c, deadline)).collect()
}

#[test]
fn bad_topo_file_on_one_rank_fails_every_rank() {
    let garbage = write_tmp("garbage1.xml", "hello world\n");
    let got = init_rank_with_rank1(3, ("NCCL_TOPO_FILE", garbage.clone()));
    let bad = format!("invalid argument: {garbage}:1: malformed topology XML: unknown token at 1:1");
    assert_eq!(
        got,
        [
            format!(
                "INIT-ERR RemoteError: remote error: rank 0: rank 1 cannot build its ring graph from its topology: {bad}"
            ),
            format!("INIT-ERR InvalidArgument: {bad}"),
            format!(
                "INIT-ERR RemoteError: remote error: rank 2: rank 1 cannot build its ring graph from its topology: {bad}"
            ),
        ]
    );
    let _ = std::fs::remove_file(garbage);
}

#[test]
fn repeated_gpu_bus_id_is_refused_naming_the_line() {
    // The 4-GPU NVLink mesh fixture with its third GPU's <pci> (line 17) given the second GPU's
    // bus id. Before, it built a second GPU node with the same bus id (the first took every
    // <nvlink> to it: `oxccl topo` showed 1 ring channel over PHB instead of the mesh's NVLink
    // rings) and init used it silently.
    let mesh = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/topo/nvlink-mesh-4gpu-topo.xml"
    ))
    .unwrap();
    let edit = |line: usize, from: &str, to: &str| -> String {
        mesh.lines()
            .enumerate()
            .map(|(i, l)| {
                if i + 1 == line {
                    l.replace(from, to)
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let dup_bus = edit(17, "0000:47:00.0", "0000:0f:00.0");
    let err = oxccl::topo::System::from_xml_str(&dup_bus, "dupbus.xml").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument: dupbus.xml:17: <pci>: GPU busid=\"0000:0f:00.0\" is listed twice (each GPU once)"
    );
    // Control: the fixture itself builds with its 4 GPUs.
    let sys = oxccl::topo::System::from_xml_str(&mesh, "mesh.xml").unwrap();
    assert_eq!(sys.count(oxccl::topo::NodeType::Gpu), 4);
}

#[test]
fn bad_setting_on_one_rank_fails_every_rank_at_once() {
    // NCCL_MAX_NCHANNELS=0 on rank 1 only. Before, rank 1 failed before joining the bootstrap:
    // rank 0 got "bootstrap: waiting for the root ... connection closed by the peer" and rank 2
    // waited out the 30 s bootstrap timeout ("ring predecessor rank 1 did not connect").
    let start = Instant::now();
    let got = init_rank_with_rank1(3, ("NCCL_MAX_NCHANNELS", "0".into()));
    let bad = "invalid argument: NCCL_MAX_NCHANNELS=0 is out of range (accepted: 1..=64)";
    assert_eq!(
        got,
        [
            format!(
                "INIT-ERR RemoteError: remote error: rank 0: rank 1 cannot initialize (its settings or device): {bad}"
            ),
            format!("INIT-ERR InvalidArgument: {bad}"),
            format!(
                "INIT-ERR RemoteError: remote error: rank 2: rank 1 cannot initialize (its settings or device): {bad}"
            ),
        ]
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
}
