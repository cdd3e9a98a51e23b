//! Compiles the relay's gRPC contract (`proto/kv_relay/v1/relay.proto`) with the vendored
//! `protoc`, and writes the file descriptor set the relay serves for reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The vendored protoc: builds need no system protobuf compiler.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("kv_relay_descriptor.bin"))
        .compile_protos(&["proto/kv_relay/v1/relay.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
