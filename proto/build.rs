//! Compiles the relay's gRPC contract (`proto/kv_relay/v1/relay.proto`) with the vendored
//! `protoc`, and writes the file descriptor set the relay serves for reflection.
//!
//! The contract is compiled twice: once for the messages, the client and the plain server, and
//! once more for the server the relay runs, whose Subscribe responses are
//! [`SubscribeOut`](crate::encoded::SubscribeOut) (a message, or one encoded once and shared by
//! every stream). Every other message of that server is the first compilation's.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The vendored protoc: builds need no system protobuf compiler.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let protos = ["proto/kv_relay/v1/relay.proto"];
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("kv_relay_descriptor.bin"))
        .compile_protos(&protos, &["proto"])?;
    let shared = out.join("shared");
    std::fs::create_dir_all(&shared)?;
    tonic_prost_build::configure()
        .out_dir(&shared)
        .build_client(false)
        .extern_path(".kv_relay.v1", "crate::pb")
        .extern_path(".kv_relay.v1.SubscribeResponse", "crate::encoded::SubscribeOut")
        .compile_protos(&protos, &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
