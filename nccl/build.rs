//! Gives the shared library NCCL's SONAME, so programs linked against it (or against NCCL)
//! load it as `libnccl.so.2`.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rerun-if-changed=build.rs");
}
