//! Builds `gpu/` for `nvptx64-nvidia-cuda` into one PTX module and hands it to the host library
//! (`oxccl::kernels`: one deflated PTX module per kernel entry point, included from `OUT_DIR`).
//!
//! A nested `cargo rustc` compiles `oxccl-gpu` as a cdylib with `-Zbuild-std=core` and the `ptx`
//! profile (fat LTO, `panic = "abort"`), in its own target directory so it never waits on the outer
//! build's lock. rustc then calls `tools/ptx-link.sh` as its linker, which turns the LTO'd bitcode
//! into PTX with the toolchain's `llvm-tools` (the registry ships no nvptx `rust-std` and no
//! `llvm-bitcode-linker`). The module targets `sm_70` / PTX ISA 7.0, so the driver JITs it on
//! Volta and every later GPU. A kernel compile error fails this build with rustc's own message.
use std::env;
use std::path::PathBuf;
use std::process::Command;

#[path = "build/ptx_split.rs"]
mod ptx_split;

const PTX_CPU: &str = "sm_70";

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=gpu");
    println!("cargo:rerun-if-changed=tools/ptx-link.sh");
    println!("cargo:rerun-if-changed=build/ptx_split.rs");
    println!("cargo:rerun-if-changed=Cargo.toml");
    println!("cargo:rerun-if-changed=rust-toolchain.toml");
    println!("cargo:rerun-if-env-changed=OXCCL_SKIP_PTX");
    println!("cargo:rerun-if-env-changed=OXCCL_ONLY_FUNCS");
    println!("cargo:rerun-if-env-changed=OXCCL_BUILD_UNROLL");
    println!("cargo:rerun-if-env-changed=OXCCL_BUILD_LL128_UNROLL");
    println!("cargo:rerun-if-env-changed=OXCCL_BUILD_SIMPLE_SYNC");

    let index = out.join("ptx_modules.rs");
    if env::var_os("OXCCL_SKIP_PTX").is_some() {
        // Escape hatch for tooling that only type-checks the host crate (e.g. docs builds).
        std::fs::write(
            &index,
            "pub static PTX_MODULES: &[(&str, &[u8])] = &[];\npub const PTX_BYTES: usize = 0;\n",
        )
        .expect("write empty PTX index");
        println!("cargo:warning=OXCCL_SKIP_PTX set: the library embeds no GPU kernels");
        return;
    }

    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let sysroot = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .expect("run rustc --print sysroot");
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    let host = env::var("HOST").expect("cargo sets HOST");
    let llvm_bin = PathBuf::from(&sysroot)
        .join("lib/rustlib")
        .join(&host)
        .join("bin");
    if !llvm_bin.join("llvm-link").exists() {
        panic!(
            "oxccl: llvm-tools not found in {} — the toolchain must come from rust-toolchain.toml \
             (run `rustup toolchain install` in the repository)",
            llvm_bin.display()
        );
    }

    // One nvptx build for every profile of the outer build (debug, release, test): its own
    // target directory beside the profiles' (`OUT_DIR` is `<target>/<profile>/build/<pkg>/out`),
    // so `cargo test` after `cargo build --release` reuses the kernels instead of rebuilding
    // them, and cargo's own fingerprints decide whether anything under gpu/ changed.
    let target_dir = out
        .ancestors()
        .nth(4)
        .map_or_else(|| out.join("gpu-target"), |t| t.join("oxccl-ptx"));
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    // The outer build's settings must not leak into the nvptx build.
    for (k, _) in env::vars_os() {
        let k = k.to_string_lossy().to_string();
        if k.starts_with("CARGO_") && k != "CARGO_HOME"
            || k == "RUSTFLAGS"
            || k == "RUSTC_WRAPPER"
            || k == "RUSTC_WORKSPACE_WRAPPER"
            || k.starts_with("CARGO_ENCODED")
        {
            cmd.env_remove(&k);
        }
    }
    cmd.current_dir(&root)
        .env("OXCCL_LLVM_BIN", &llvm_bin)
        .env("CARGO_TARGET_DIR", &target_dir)
        .args([
            "rustc",
            "-p",
            "oxccl-gpu",
            "--profile",
            "ptx",
            "--target",
            "nvptx64-nvidia-cuda",
        ])
        .args(["-Zbuild-std=core", "--crate-type", "cdylib", "--"])
        .arg(format!("-Ctarget-cpu={PTX_CPU}"))
        .arg(format!("-Clinker={}", root.join("tools/ptx-link.sh").display()));
    let status = cmd.status().expect("run the nested cargo for the nvptx kernels");
    if !status.success() {
        panic!(
            "oxccl: building the GPU kernels (gpu/) for nvptx64-nvidia-cuda failed; rustc's message is above"
        );
    }
    let built = target_dir.join("nvptx64-nvidia-cuda/ptx/deps/oxccl_gpu.ptx");
    let ptx = std::fs::read_to_string(&built).unwrap_or_else(|e| panic!("read {}: {e}", built.display()));
    let modules = ptx_split::split_ptx(&ptx).unwrap_or_else(|e| panic!("splitting the PTX module: {e}"));
    // Modules are stored deflated (PTX text shrinks ~10x), so binaries stay small enough to carry.
    let mut rs = String::from(
        "/// (kernel entry point, deflated PTX module holding it), generated by build.rs.\npub static PTX_MODULES: &[(&str, &[u8])] = &[\n",
    );
    for (name, text) in &modules {
        let file = out.join(format!("{name}.ptx.z"));
        let packed = miniz_oxide::deflate::compress_to_vec(text.as_bytes(), 6);
        std::fs::write(&file, packed).unwrap_or_else(|e| panic!("write {}: {e}", file.display()));
        rs.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            file.display().to_string()
        ));
    }
    rs.push_str(&format!(
        "];\n/// Size of the linked PTX before splitting, in bytes.\npub const PTX_BYTES: usize = {};\n",
        ptx.len()
    ));
    std::fs::write(&index, rs).expect("write the PTX module index");
}
