//! The C program `tests/c/cpu_target.c`, compiled here with the system C compiler (`CC`, or
//! `cc`) against oxccl's `nccl.h` and linked with `-lnccl` to the library this test run built,
//! run on the CPU target (`OXCCL_NCCL_TARGET=cpu`): ranks as processes and as threads, every
//! collective, sends and receives, all-to-all, split, grouped and non-blocking inits, a
//! simulated group, a 2.27-sized config, argument errors (the program's header comment lists
//! its checks). Without a C compiler the test prints why it skipped.
use crate::common::lib_path;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A scratch directory of this test, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_c_program_runs_on_the_cpu_target() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    if Command::new(&cc)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        println!("SKIPPED: a_c_program_runs_on_the_cpu_target: no C compiler ({cc} cannot be run)");
        return;
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_path();
    assert!(lib.exists(), "{} is missing", lib.display());
    let scratch = Scratch(std::env::temp_dir().join(format!("oxccl-c-cpu-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).unwrap();
    // The linker resolves -lnccl through libnccl.so; the program then asks for the SONAME.
    for name in ["libnccl.so", "libnccl.so.2"] {
        std::os::unix::fs::symlink(&lib, scratch.0.join(name)).unwrap();
    }
    let exe = scratch.0.join("cpu_target");
    let out = Command::new(&cc)
        .args(["-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror"])
        // oxccl's header first; the CUDA stand-ins only where no toolkit header comes earlier.
        .arg("-I")
        .arg(here.join("include"))
        .arg("-I")
        .arg(here.join("tests/c/cuda_stub"))
        .arg("-o")
        .arg(&exe)
        .arg(here.join("tests/c/cpu_target.c"))
        .arg("-L")
        .arg(&scratch.0)
        .args(["-lnccl", "-lpthread"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cc} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Output to files, not pipes: a program printing more than a pipe holds must not stall.
    let (out_path, err_path) = (scratch.0.join("stdout"), scratch.0.join("stderr"));
    let mut child = Command::new(&exe)
        .env("OXCCL_NCCL_TARGET", "cpu")
        .env("LD_LIBRARY_PATH", &scratch.0)
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = child.wait().unwrap();
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    assert!(
        status.success() && stdout.lines().last() == Some("C-CPU OK"),
        "the C program ({status:?}):\n{stdout}\n{}",
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
}
