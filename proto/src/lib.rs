//! Wire contracts of starckpt.
//!
//! - [`control`]: the control-plane gRPC service (tonic), generated from `proto/control.proto`.
//! - [`data`]: the prost headers of data-plane frames, generated from `proto/dataplane.proto`.
//! - [`address`]: chunk addresses: plain BLAKE3, or keyed per tenant so deduplication never
//!   crosses tenants.
//! - [`capability`]: data-plane capabilities the control plane signs and targets check, and the
//!   proof of the cluster key targets register with.
//! - [`codec`]: chunk codecs (zstd, zstd over float byte planes) and their stored formats.
//! - [`frame`]: the data-plane frame format (fixed binary header, prost header, raw payload),
//!   with hard size limits and async read/write helpers.
//! - [`tls`]: TLS on the control plane's gRPC port, as its clients dial it.
//! - [`token`]: bearer tokens, how callers of the control plane say who they are.
//! - [`model`]: domain types validated on receipt (`TryFrom`), so malformed input never reaches
//!   server or client logic.
//!
//! ```
//! use starckpt_proto::frame::{FrameHeader, Opcode, FIXED_HEADER_BYTES};
//! let header = FrameHeader { opcode: Opcode::Put, request_id: 7, header_len: 40, payload_len: 4096 };
//! let bytes = header.encode();
//! assert_eq!(bytes.len(), FIXED_HEADER_BYTES);
//! assert_eq!(FrameHeader::decode(&bytes).unwrap(), header);
//! ```

pub mod address;
pub mod capability;
pub mod codec;
pub mod draft;
pub mod frame;
pub mod model;
pub mod tls;
pub mod token;

/// Control-plane gRPC messages and service.
pub mod control {
    tonic::include_proto!("starckpt.control.v1");

    /// Most chunks one `RecoverChunks` call may name.
    pub const MAX_RECOVER_CHUNKS: usize = 64;
}

/// Data-plane frame headers.
pub mod data {
    tonic::include_proto!("starckpt.data.v1");
}

pub use address::{Addressing, ChunkKey, ChunkName};
pub use model::{ChunkHash, JobName, ModelError, RelPath, TenantName};
