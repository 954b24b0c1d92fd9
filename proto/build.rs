//! Generates the control-plane service and the data-plane header messages.
//!
//! protoc comes from the `protoc-bin-vendored` crate unless `PROTOC` is set, so a fresh machine
//! builds without installing anything.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing reads the environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        // Bytes fields decode as `bytes::Bytes`, sharing the receive buffer instead of copying.
        .bytes(".")
        .compile_protos(&["proto/control.proto", "proto/dataplane.proto"], &["proto"])?;
    Ok(())
}
