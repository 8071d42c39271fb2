//! A bad `NCCL_TOPO_FILE` fails communicator creation on the CPU target, naming the file, the
//! line and why (before, `node_ring_graph` logged it at debug level and silently kept rank
//! order); with `init_rank`, a bad file on one rank only fails every rank in bounded time, the
//! others with a remote error naming that rank ("error on every rank", as C-cases ask).
//!
//! Each case runs in a child process of this binary (`topo_child_entry`) with its own
//! environment, since the variable is process-wide.
use oxccl::bootstrap::{UniqueId, get_unique_id};
use oxccl::{Comm, Device};
use std::process::Command;
use std::time::{Duration, Instant};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Child body (a no-op in a normal run). `OXCCL_TEST_TOPO_ROLE` = `all`: `Comm::init_all` over
/// `OXCCL_TEST_TOPO_NRANKS` CPU ranks; `rank`: `Comm::init_rank` as rank `OXCCL_TEST_TOPO_RANK`.
/// Prints `INIT-OK` or `INIT-ERR <code>: <error>`.
#[test]
fn topo_child_entry() {
    let Ok(role) = std::env::var("OXCCL_TEST_TOPO_ROLE") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap();
    let n: usize = var("OXCCL_TEST_TOPO_NRANKS").parse().unwrap();
    let res = if role == "all" {
        Comm::init_all(&(0..n).map(Device::Cpu).collect::<Vec<_>>()).map(|c| c.len())
    } else {
        let rank: usize = var("OXCCL_TEST_TOPO_RANK").parse().unwrap();
        let id = UniqueId::from_bytes(&unhex(&var("OXCCL_TEST_TOPO_ID"))).unwrap();
        Comm::init_rank(n, &id, rank, Device::Cpu(rank)).map(|_| 1)
    };
    match res {
        Ok(_) => println!("INIT-OK"),
        Err(e) => println!("INIT-ERR {:?}: {e}", e.code()),
    }
}

/// Starts this binary as a child with `env`; returns it (stdout piped).
fn spawn(env: &[(&str, String)]) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "topo_child_entry", "--nocapture", "--test-threads=1"]);
    for (k, _) in std::env::vars() {
        if k.starts_with("NCCL_") || k.starts_with("OXCCL_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("OXCCL_BOOTSTRAP_TIMEOUT", "30");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// The child's `INIT-` line (it must exit by `deadline`).
fn outcome(child: std::process::Child, deadline: Instant) -> String {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = rx
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .unwrap_or_else(|_| panic!("child {pid} did not exit in time (hang)"))
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
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
            ("OXCCL_TEST_TOPO_ROLE", "all".into()),
            ("OXCCL_TEST_TOPO_NRANKS", "3".into()),
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
        ("OXCCL_TEST_TOPO_ROLE", "all".into()),
        ("OXCCL_TEST_TOPO_NRANKS", "4".into()),
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
    let id = get_unique_id().unwrap();
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut env = vec![
                ("OXCCL_TEST_TOPO_ROLE", "rank".to_string()),
                ("OXCCL_TEST_TOPO_NRANKS", n.to_string()),
                ("OXCCL_TEST_TOPO_RANK", r.to_string()),
                ("OXCCL_TEST_TOPO_ID", hex(&id.to_bytes())),
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
