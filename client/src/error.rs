//! Errors of the client SDK. Each names what failed: the job and step, the file, the chunk, the
//! target and its address.

use std::path::PathBuf;

use starckpt_proto::{ChunkHash, ModelError};
use thiserror::Error;

use crate::transport::TransportError;

#[derive(Debug, Error)]
pub enum Error {
    #[error("control plane at {address} is unreachable: {message}")]
    Unreachable { address: String, message: String },
    #[error("{op}: {message}")]
    NotFound { op: &'static str, message: String },
    #[error("{op}: {message}")]
    AlreadyExists { op: &'static str, message: String },
    #[error("{op}: {message}")]
    Rejected { op: &'static str, message: String },
    /// This writer's run was superseded by a newer run of the job (it is a zombie of a preempted
    /// run); it can no longer begin or commit checkpoints of that job.
    #[error("{op}: {message}")]
    Fenced { op: &'static str, message: String },
    /// The control plane did not accept this client's bearer token (none, unknown or revoked:
    /// UNAUTHENTICATED), or the token's tenant may not make this call (PERMISSION_DENIED).
    #[error("{op}: {message}")]
    Denied { op: &'static str, message: String },
    #[error("{op} failed at the control plane: {status}")]
    Control { op: &'static str, status: Box<tonic::Status> },
    #[error("target {target_id} ({address}): {source}")]
    Target { target_id: String, address: String, source: TransportError },
    /// The bytes a target returned are not the chunk: `found` says how (they hash to another
    /// value, or a compressed copy does not decode).
    #[error("chunk {hash} from target {target_id} ({address}) failed its BLAKE3 check ({found})")]
    Checksum { hash: ChunkHash, found: String, target_id: String, address: String },
    /// A chunk source other than the cluster (`ChunkSource`) could not give the chunk.
    #[error("chunk {hash} from {from}: {message}")]
    Source { hash: ChunkHash, from: String, message: String },
    #[error(
        "no replica of chunk {hash} could be read, nor recovered through the control plane: {last} \
         (`starckpt repair` copies it back from an object-store tier; with the cluster gone, a checkpoint \
         copied to a tier restores with `starckpt restore --from-tier URL`)"
    )]
    ChunkUnavailable { hash: ChunkHash, last: Box<Error> },
    /// The checkpoint being read was deleted meanwhile (`starckpt delete`, retention), and a
    /// chunk of it was collected with it.
    #[error(
        "{job} step {step} (checkpoint {checkpoint_id}) was deleted while it was being read, and its chunk \
         {hash} collected ({said}); read a checkpoint committed now (`starckpt restore --latest`)"
    )]
    Deleted { job: String, step: u64, checkpoint_id: u64, hash: ChunkHash, said: String },
    #[error("no storage target accepted chunk {hash}: {last}")]
    NoTarget { hash: ChunkHash, last: Box<Error> },
    /// Fewer targets than the replication factor accepted a chunk.
    #[error("chunk {hash} is stored on {stored} of the {wanted} targets it needs: {last}")]
    Underreplicated { hash: ChunkHash, stored: usize, wanted: usize, last: Box<Error> },
    /// A name, path or manifest failed validation.
    #[error("{0}")]
    Invalid(#[from] ModelError),
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    InvalidInput(String),
    /// A save or restore stopped before it finished (its task was dropped or stopped).
    #[error("cancelled: {0}")]
    Cancelled(String),
}

impl Error {
    pub(crate) fn from_status(op: &'static str, address: &str, status: tonic::Status) -> Error {
        use tonic::Code;
        let message = status.message().to_owned();
        match status.code() {
            Code::NotFound => Error::NotFound { op, message },
            Code::AlreadyExists => Error::AlreadyExists { op, message },
            Code::InvalidArgument | Code::FailedPrecondition => Error::Rejected { op, message },
            Code::Aborted => Error::Fenced { op, message },
            Code::Unauthenticated | Code::PermissionDenied => Error::Denied { op, message },
            Code::Unavailable | Code::DeadlineExceeded => Error::Unreachable { address: address.to_owned(), message },
            _ => Error::Control { op, status: Box::new(status) },
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    /// True for a checksum failure anywhere in the chain (for callers that branch on corruption).
    pub fn is_checksum(&self) -> bool {
        match self {
            Error::Checksum { .. } => true,
            Error::ChunkUnavailable { last, .. } => last.is_checksum(),
            _ => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
