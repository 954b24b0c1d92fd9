//! Restore: manifest → parallel chunk reads → BLAKE3 verification → files or caller buffers.
//!
//! No byte reaches a file before its chunk's hash is verified. A restore into a directory is
//! built in a hidden sibling directory and renamed into place only when complete, so a failed or
//! interrupted restore never leaves a half-written checkpoint where the trainer will look.
//!
//! Reads into the caller's memory (`read_into`, `read_range_into`) fetch each whole chunk
//! straight into its place: shared memory and RDMA copy it there out of their slot (one copy on
//! the client instead of two and an allocation), and it is verified where it lies before the
//! call returns. A read that fails leaves the buffer's contents unspecified.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use futures::StreamExt;
use starckpt_proto::ChunkHash;
use starckpt_proto::control::{self as pb};
use starckpt_proto::model::{ChunkRef, FileEntry, Manifest};
use starckpt_proto::{Addressing, ChunkName, JobName, RelPath};

use crate::transport::{ChunkTransport, Fetched, Payload, TransportError};
use crate::{CheckpointInfo, Client, Error, Result, TargetInfo};
use starckpt_proto::data::ErrorCode;

mod files;
mod manifest;
mod read;

pub use files::*;
pub use manifest::*;
pub use read::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_on_targets_down_or_unreachable_are_tried_last() {
        let target = |id: &str, state: pb::TargetState| {
            (id.to_owned(), TargetInfo { target_id: id.into(), state: state as i32, ..Default::default() })
        };
        let targets: HashMap<String, TargetInfo> = [
            target("dead", pb::TargetState::Dead),
            target("alive", pb::TargetState::Alive),
            target("silent", pb::TargetState::Alive),
            target("suspect", pb::TargetState::Suspect),
        ]
        .into_iter()
        .collect();
        let replicas: Vec<String> =
            ["dead", "silent", "unknown", "suspect", "alive"].iter().map(|s| s.to_string()).collect();
        let order = replica_order(&targets, &replicas, |id| id == "silent");
        assert_eq!(order, ["alive", "dead", "unknown", "suspect", "silent"]);
        // Nothing known against any: as listed.
        let order = replica_order(&HashMap::new(), &replicas, |_| false);
        assert_eq!(order, ["dead", "silent", "unknown", "suspect", "alive"]);
    }

    #[test]
    fn a_lock_counts_only_on_the_file_still_at_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        let file = std::fs::File::create(&path).unwrap();
        assert!(is_at(&file, &path));
        std::fs::remove_file(&path).unwrap();
        assert!(!is_at(&file, &path), "unlinked");
        std::fs::File::create(&path).unwrap();
        assert!(!is_at(&file, &path), "replaced");
    }

    #[test]
    fn a_part_without_a_manifest_is_refused() {
        let info = CheckpointInfo { job: "j".into(), step: 3, world_size: 2, ..Default::default() };
        let part = |rank, manifest| pb::RankManifest { rank, manifest };
        let response = pb::GetManifestResponse {
            checkpoint: Some(info),
            parts: vec![part(0, Some(pb::Manifest::default())), part(1, None)],
            ..Default::default()
        };
        let error = CheckpointManifest::from_response(response).unwrap_err();
        assert!(error.to_string().contains("rank 1 has no manifest"), "{error}");
    }
}
