//! The mount's settings ([`MountConfig`]) and the read-ahead it asks of the kernel.

use super::*;

/// Tunables of a mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// How long job and checkpoint listings (and so `latest`) are cached, here and in the kernel.
    /// Default 1 s.
    pub listing_ttl: Duration,
    /// How long the kernel caches attributes of committed checkpoints' files (immutable).
    /// Default 60 s.
    pub committed_ttl: Duration,
    /// Chunks fetched ahead of a sequential reader. Default 8 (32 MiB at 4 MiB chunks): with
    /// 16 MiB kernel requests, about as many chunks in flight as the SDK's restore keeps.
    pub read_ahead_chunks: usize,
    /// Bytes the read-ahead windows of all open files together may hold. A read beyond it still
    /// fetches the chunks it covers, but keeps them only while it is served. Default 256 MiB.
    pub read_ahead_budget: u64,
    /// Manifests kept in memory. Default 64.
    pub cached_manifests: usize,
    /// Largest write request to negotiate; the kernel may allow less (see the crate docs on
    /// `max_pages_limit`). Default 16 MiB.
    pub max_write: u32,
    /// Where files being written keep their local copy until their checkpoint commits
    /// (`fs/spill.rs`). Default: the system's temporary directory (`$TMPDIR`, else `/tmp`):
    /// local disk on a training host, and never shared with another host.
    pub spill_dir: std::path::PathBuf,
    /// Bytes those copies may hold together. Default 64 GiB: a few ranks' shards of a large
    /// model being written at once; past it files written in order go on without a copy.
    pub spill_limit_bytes: u64,
    /// The name this mount records its drafts under at the control plane, so that they survive
    /// a restart of the mount (`fs/journal.rs`): a mount started again with the same name, on
    /// any host, gets them back. Default (None): `<host>:<mount point>`, set by [`crate::mount`].
    pub draft_writer: Option<String>,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            listing_ttl: Duration::from_secs(1),
            committed_ttl: Duration::from_secs(60),
            read_ahead_chunks: 8,
            read_ahead_budget: 256 << 20,
            cached_manifests: 64,
            max_write: 16 << 20,
            spill_dir: std::env::temp_dir().join("starckpt-spill"),
            spill_limit_bytes: 64 << 30,
            draft_writer: None,
        }
    }
}

/// The kernel's read-ahead requests for committed files: one chunk (at most the request size),
/// so that each request, aligned to chunk boundaries as chunks are of one size, is served from
/// one verified chunk without copying it (`read.rs`). Measured with `benches/fuse_vs_sdk.sh`
/// (1 GiB, 3 rounds, 2-core VM): 16 MiB requests spanning four chunks read at 0.77x the SDK's
/// throughput, one-chunk requests at 0.95x.
pub(crate) fn read_ahead_bytes(client: &Client, config: &MountConfig) -> u32 {
    u32::try_from(client.config().chunk_size_bytes)
        .unwrap_or(u32::MAX)
        .clamp(128 << 10, config.max_write.max(128 << 10))
}
