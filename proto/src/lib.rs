pub mod encoded;
pub mod hash;

/// The relay's gRPC contract (`kv_relay.v1`), generated from `proto/kv_relay/v1/relay.proto`:
/// messages, the `Relay` client and server, and the descriptor set served for reflection.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("kv_relay.v1");

    /// The encoded `FileDescriptorSet` of the contract, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kv_relay_descriptor");
}
