//! Domain types, validated on receipt.
//!
//! Every request that crosses a process boundary is converted from its prost form into one of
//! these with `TryFrom` before any logic sees it; the conversion is the single place that decides
//! what is well-formed. The server maps a [`ModelError`] to `INVALID_ARGUMENT`.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use thiserror::Error;

use crate::control as pb;
use crate::frame::MAX_PAYLOAD_BYTES;

/// Longest job name. Job names become directory names under the FUSE mount and keys in the
/// metadata store.
pub const MAX_JOB_NAME_BYTES: usize = 128;
/// Longest relative path inside a checkpoint (Linux PATH_MAX).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest component of such a path (Linux NAME_MAX).
pub const MAX_NAME_BYTES: usize = 255;
/// Most ranks in one checkpoint.
pub const MAX_WORLD_SIZE: u32 = 1 << 20;
/// Most files in one rank's manifest. A rank with more should archive them first.
pub const MAX_FILES_PER_PART: usize = 1_000_000;
/// Largest encoded manifest of one checkpoint, all ranks together (each rank's part travels in
/// one CommitPart, under the 64 MiB gRPC message limit; readers page through the parts:
/// `GetManifestRequest`). It bounds what a reader, and the control plane checking the last
/// part against the others, hold in memory: at ~80 bytes per 4 MiB chunk, 512 MiB describes
/// ~25 TiB; larger checkpoints need larger chunks.
pub const MAX_CHECKPOINT_MANIFEST_BYTES: u64 = 512 << 20;
/// Largest encoded manifest of one rank's part. A reader gets at least one part per page of
/// GetManifest, with the checkpoint's record and the target list, all under the 64 MiB gRPC
/// message limit: a part close to that limit would commit, and then never be read back.
pub const MAX_PART_MANIFEST_BYTES: usize = 60 << 20;
/// Longest run id (the name all ranks of one training run share).
pub const MAX_RUN_ID_BYTES: usize = 256;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ModelError {
    #[error("invalid job name {name:?}: {reason}")]
    JobName { name: String, reason: &'static str },
    #[error("invalid path {path:?}: {reason}")]
    Path { path: String, reason: &'static str },
    #[error("invalid chunk hash: expected 32 bytes, got {len}")]
    HashLength { len: usize },
    #[error("invalid chunk hash {text:?}: expected 64 hex digits")]
    HashText { text: String },
    #[error("invalid {field}: {reason}")]
    Field { field: &'static str, reason: String },
    #[error("file {path:?}: {reason}")]
    File { path: String, reason: String },
}

pub(crate) fn field(field: &'static str, reason: impl Into<String>) -> ModelError {
    ModelError::Field { field, reason: reason.into() }
}

/// A chunk's address: the BLAKE3 hash of its uncompressed bytes, or for a tenant's chunk a keyed
/// hash of that ([`crate::address`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash(pub [u8; 32]);

impl ChunkHash {
    pub fn of(data: &[u8]) -> ChunkHash {
        ChunkHash(*blake3::hash(data).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(text: &str) -> Result<ChunkHash, ModelError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out)
            .map_err(|_| ModelError::HashText { text: text.chars().take(80).collect() })?;
        Ok(ChunkHash(out))
    }

    pub fn to_bytes(self) -> bytes::Bytes {
        bytes::Bytes::copy_from_slice(&self.0)
    }
}

impl TryFrom<&[u8]> for ChunkHash {
    type Error = ModelError;
    fn try_from(value: &[u8]) -> Result<Self, Self::Error> {
        let array: [u8; 32] = value.try_into().map_err(|_| ModelError::HashLength { len: value.len() })?;
        Ok(ChunkHash(array))
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({})", &self.to_hex()[..16])
    }
}

/// A job name: 1..=128 bytes of `[A-Za-z0-9._-]`, not starting with `.` (so it can never be `.`,
/// `..` or a hidden directory under the mount); inside a tenant's namespace, `<tenant>/<name>`
/// (see [`TenantName`]). A tenant's callers name their jobs without the tenant part: the control
/// plane adds it (and strips it from what it answers), so tenants never see each other's jobs and
/// may use the same names. `/` appears in no other name, so the qualified form is unambiguous.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobName(String);

impl JobName {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tenant whose namespace holds the job; None for a job outside every tenant's (a
    /// cluster without bearer tokens, or one an operator made).
    pub fn tenant(&self) -> Option<&str> {
        tenant_of(&self.0)
    }

    /// The name without its tenant part: what the tenant's own callers call it.
    pub fn local(&self) -> &str {
        self.0.split_once('/').map_or(&self.0, |(_, name)| name)
    }

    /// This job, named by a caller of `tenant`, in that tenant's namespace. A caller of a tenant
    /// cannot name a job of another (or one outside every tenant's).
    pub fn in_tenant(&self, tenant: &TenantName) -> Result<JobName, ModelError> {
        if self.tenant().is_some() {
            return Err(ModelError::JobName {
                name: self.0.clone(),
                reason: "a tenant's callers name their jobs without a tenant part",
            });
        }
        Ok(JobName(format!("{}/{}", tenant.0, self.0)))
    }
}

/// The tenant part of job name `name`, if it has one.
fn tenant_of(name: &str) -> Option<&str> {
    name.split_once('/').map(|(tenant, _)| tenant)
}

/// Why `name` is not a plain name of at most `max` bytes (job and tenant names share the rule);
/// `too_long` says the limit.
fn plain_name_error(name: &str, max: usize, too_long: &'static str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("empty");
    }
    if name.len() > max {
        return Some(too_long);
    }
    if name.starts_with('.') {
        return Some("starts with '.'");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
        return Some("only letters, digits, '.', '_' and '-' are allowed");
    }
    None
}

impl TryFrom<&str> for JobName {
    type Error = ModelError;
    fn try_from(name: &str) -> Result<Self, Self::Error> {
        let reject = |reason| Err(ModelError::JobName { name: name.chars().take(200).collect(), reason });
        let (tenant, local) = match name.split_once('/') {
            Some((tenant, local)) => (Some(tenant), local),
            None => (None, name),
        };
        if let Some(tenant) = tenant
            && let Some(reason) = plain_name_error(tenant, MAX_TENANT_NAME_BYTES, "")
        {
            return reject(match reason {
                "empty" => "empty tenant part",
                _ => "its tenant part is not a tenant name",
            });
        }
        if let Some(reason) = plain_name_error(local, MAX_JOB_NAME_BYTES, "longer than 128 bytes") {
            return reject(reason);
        }
        Ok(JobName(name.to_owned()))
    }
}

/// Longest tenant name.
pub const MAX_TENANT_NAME_BYTES: usize = 64;

/// A tenant: whose jobs a bearer token reaches (`server/src/control/auth.rs`). 1..=64 bytes of
/// `[A-Za-z0-9._-]`, not starting with `.`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantName(String);

impl TenantName {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the job named `job` (as stored: `<tenant>/<name>`) is in this tenant's namespace.
    pub fn holds(&self, job: &str) -> bool {
        tenant_of(job) == Some(self.0.as_str())
    }
}

impl TryFrom<&str> for TenantName {
    type Error = ModelError;
    fn try_from(name: &str) -> Result<Self, Self::Error> {
        match plain_name_error(name, MAX_TENANT_NAME_BYTES, "longer than 64 bytes") {
            Some(reason) => {
                Err(field("tenant name", format!("{:?}: {reason}", name.chars().take(100).collect::<String>())))
            }
            None => Ok(TenantName(name.to_owned())),
        }
    }
}

impl fmt::Display for TenantName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for JobName {
    type Error = ModelError;
    fn try_from(name: String) -> Result<Self, Self::Error> {
        JobName::try_from(name.as_str())
    }
}

impl fmt::Display for JobName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Longest checkpoint tag.
pub const MAX_TAG_BYTES: usize = 64;

/// Checks a checkpoint tag: 1 to 64 of letters, digits, '.', '_' and '-'.
pub fn validate_tag(tag: &str) -> Result<(), ModelError> {
    if tag.is_empty() || tag.len() > MAX_TAG_BYTES {
        return Err(field(
            "tag",
            format!("{:?} must be 1 to {MAX_TAG_BYTES} bytes", tag.chars().take(80).collect::<String>()),
        ));
    }
    if !tag.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
        return Err(field("tag", format!("{tag:?}: only letters, digits, '.', '_' and '-' are allowed")));
    }
    Ok(())
}

/// A relative path inside a checkpoint: '/'-separated, every component non-empty and not `.` or
/// `..`, no NUL, not absolute. Joining it under any directory stays inside that directory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelPath(String);

impl RelPath {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn components(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }

    /// This path under `root`. Safe by construction: no component can climb out.
    pub fn under(&self, root: &std::path::Path) -> std::path::PathBuf {
        let mut out = root.to_path_buf();
        for component in self.components() {
            out.push(component);
        }
        out
    }
}

impl TryFrom<&str> for RelPath {
    type Error = ModelError;
    fn try_from(path: &str) -> Result<Self, Self::Error> {
        let reject = |reason| Err(ModelError::Path { path: path.chars().take(200).collect(), reason });
        if path.is_empty() {
            return reject("empty");
        }
        if path.len() > MAX_PATH_BYTES {
            return reject("longer than 4096 bytes");
        }
        if path.starts_with('/') {
            return reject("absolute");
        }
        if path.contains('\0') {
            return reject("contains NUL");
        }
        for component in path.split('/') {
            match component {
                "" => return reject("empty component"),
                "." | ".." => return reject("contains '.' or '..'"),
                // No file system restores a longer name (NAME_MAX): such a checkpoint would
                // commit and then never restore.
                _ if component.len() > MAX_NAME_BYTES => return reject("has a component longer than 255 bytes"),
                _ => {}
            }
        }
        Ok(RelPath(path.to_owned()))
    }
}

impl TryFrom<String> for RelPath {
    type Error = ModelError;
    fn try_from(path: String) -> Result<Self, Self::Error> {
        RelPath::try_from(path.as_str())
    }
}

impl fmt::Display for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

pub use crate::codec::Codec;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkRef {
    pub hash: ChunkHash,
    pub length_bytes: u64,
    pub stored_length_bytes: u64,
    pub codec: Codec,
    /// Target ids, preferred first; never empty.
    pub replicas: Vec<String>,
}

impl TryFrom<pb::ChunkRef> for ChunkRef {
    type Error = ModelError;
    fn try_from(chunk: pb::ChunkRef) -> Result<Self, Self::Error> {
        let hash = ChunkHash::try_from(&chunk.hash[..])?;
        let codec = Codec::from_wire(chunk.codec).map_err(|e| field("chunk codec", e.to_string()))?;
        if chunk.length_bytes == 0 || chunk.length_bytes > u64::from(MAX_PAYLOAD_BYTES) {
            return Err(field("chunk length", format!("{} is outside 1..={MAX_PAYLOAD_BYTES}", chunk.length_bytes)));
        }
        if codec == Codec::None && chunk.stored_length_bytes != chunk.length_bytes {
            return Err(field("chunk stored length", "must equal length for an uncompressed chunk"));
        }
        if chunk.stored_length_bytes == 0 || chunk.stored_length_bytes > u64::from(MAX_PAYLOAD_BYTES) {
            return Err(field(
                "chunk stored length",
                format!("{} is outside 1..={MAX_PAYLOAD_BYTES}", chunk.stored_length_bytes),
            ));
        }
        if chunk.replicas.is_empty() {
            return Err(field("chunk replicas", format!("chunk {hash} names no target")));
        }
        if chunk.replicas.iter().any(|r| r.is_empty() || r.len() > 64) {
            return Err(field("chunk replicas", "target id must be 1..=64 bytes"));
        }
        Ok(ChunkRef {
            hash,
            length_bytes: chunk.length_bytes,
            stored_length_bytes: chunk.stored_length_bytes,
            codec,
            replicas: chunk.replicas,
        })
    }
}

impl From<&ChunkRef> for pb::ChunkRef {
    fn from(chunk: &ChunkRef) -> Self {
        pb::ChunkRef {
            hash: chunk.hash.to_bytes(),
            length_bytes: chunk.length_bytes,
            stored_length_bytes: chunk.stored_length_bytes,
            codec: chunk.codec.to_wire(),
            replicas: chunk.replicas.clone(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    pub path: RelPath,
    pub size_bytes: u64,
    pub mode: u32,
    pub chunks: Vec<ChunkRef>,
}

impl FileEntry {
    /// Chunks overlapping `[offset, offset + length)`, each with the chunk's start offset in the
    /// file.
    pub fn chunks_in_range(&self, offset: u64, length: u64) -> impl Iterator<Item = (u64, &ChunkRef)> {
        let end = offset.saturating_add(length);
        let mut start = 0u64;
        self.chunks.iter().filter_map(move |chunk| {
            let chunk_start = start;
            start += chunk.length_bytes;
            (chunk_start < end && start > offset).then_some((chunk_start, chunk))
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Manifest {
    pub files: Vec<FileEntry>,
    pub directories: Vec<RelPath>,
    pub metadata: BTreeMap<String, String>,
    /// How the chunks are addressed ([`crate::address`]): the key they were written with.
    pub addressing: crate::Addressing,
}

impl Manifest {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size_bytes).sum()
    }

    pub fn file(&self, path: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.path.as_str() == path)
    }

    /// Whether `other` holds the same bytes under the same names: equal but for where chunks
    /// were placed and how they are stored (replicas, codec), which a save retried after a lost
    /// answer may choose anew.
    pub fn same_content(&self, other: &Manifest) -> bool {
        let chunk = |c: &ChunkRef| (c.hash, c.length_bytes);
        let file =
            |f: &FileEntry| (f.path.clone(), f.size_bytes, f.mode, f.chunks.iter().map(chunk).collect::<Vec<_>>());
        self.directories == other.directories
            && self.metadata == other.metadata
            && self.addressing == other.addressing
            && self.files.len() == other.files.len()
            && self.files.iter().map(file).eq(other.files.iter().map(file))
    }
}

impl TryFrom<pb::Manifest> for Manifest {
    type Error = ModelError;
    fn try_from(manifest: pb::Manifest) -> Result<Self, Self::Error> {
        if manifest.files.len() > MAX_FILES_PER_PART {
            return Err(field(
                "manifest",
                format!("{} files exceed the limit of {MAX_FILES_PER_PART}", manifest.files.len()),
            ));
        }
        let mut seen = HashSet::new();
        let mut files = Vec::with_capacity(manifest.files.len());
        for file in manifest.files {
            let path = RelPath::try_from(file.path)?;
            if !seen.insert(path.clone()) {
                return Err(ModelError::File { path: path.0, reason: "listed twice".into() });
            }
            let chunks = file.chunks.into_iter().map(ChunkRef::try_from).collect::<Result<Vec<_>, _>>()?;
            let sum = chunks.iter().try_fold(0u64, |acc, c| acc.checked_add(c.length_bytes));
            if sum != Some(file.size_bytes) {
                return Err(ModelError::File {
                    path: path.0,
                    reason: format!("chunk lengths sum to {sum:?}, size says {}", file.size_bytes),
                });
            }
            if file.mode > 0o7777 {
                return Err(ModelError::File {
                    path: path.0,
                    reason: format!("mode {:o} is not a permission mask", file.mode),
                });
            }
            files.push(FileEntry { path, size_bytes: file.size_bytes, mode: file.mode, chunks });
        }
        let directories = manifest.directories.into_iter().map(RelPath::try_from).collect::<Result<Vec<_>, _>>()?;
        for dir in &directories {
            if seen.contains(dir) {
                return Err(ModelError::File { path: dir.0.clone(), reason: "is both a file and a directory".into() });
            }
        }
        let addressing = crate::Addressing::from_wire(&manifest.chunk_key)?;
        Ok(Manifest { files, directories, metadata: manifest.metadata.into_iter().collect(), addressing })
    }
}

/// Checks that the parts of one checkpoint (each rank's manifest, with its rank) describe one tree
/// that can be restored: no file in two parts, no file where another part (or the same one) has a
/// directory, listed or implied by a path beneath it (`a` and `a/b`). Ranks write disjoint
/// files; a checkpoint whose parts overlap could be committed but never restored.
pub fn check_disjoint<'a>(parts: impl IntoIterator<Item = (u32, &'a Manifest)>) -> Result<(), ModelError> {
    // Every path, with the rank that names it and whether it is a file, in tree order (compared
    // component by component): a path's descendants come right after its equals, so each check
    // looks at neighbours alone. Memory is one entry per path and time n log n comparisons,
    // whatever the paths' depth: recording every ancestor of every path instead let a manifest
    // of deep paths (`d/d/d/...`, 2,000 levels) cost gigabytes and minutes.
    let mut paths: Vec<(&str, u32, bool)> = Vec::new();
    for (rank, manifest) in parts {
        paths.extend(manifest.files.iter().map(|file| (file.path.as_str(), rank, true)));
        paths.extend(manifest.directories.iter().map(|dir| (dir.as_str(), rank, false)));
    }
    paths.sort_by(|a, b| a.0.split('/').cmp(b.0.split('/')));
    let conflict = |path: &str, reason: String| Err(ModelError::File { path: path.into(), reason });
    let mut start = 0;
    while start < paths.len() {
        let path = paths[start].0;
        let end = start + paths[start..].iter().take_while(|entry| entry.0 == path).count();
        let same = &paths[start..end];
        let mut files = same.iter().filter(|entry| entry.2).map(|entry| entry.1);
        if let Some(rank) = files.next() {
            if let Some(other) = files.next() {
                return conflict(path, format!("is in the parts of ranks {rank} and {other}"));
            }
            // A directory: listed by some part, or implied by a path beneath it.
            let listed = same.iter().find(|entry| !entry.2);
            let beneath = paths.get(end).filter(|next| {
                next.0.len() > path.len() && next.0.starts_with(path) && next.0.as_bytes()[path.len()] == b'/'
            });
            if let Some(&(_, other, _)) = listed.or(beneath) {
                let reason =
                    format!("is a file in the part of rank {rank} and a directory in the part of rank {other}");
                return conflict(path, reason);
            }
        }
        start = end;
    }
    Ok(())
}

impl From<&Manifest> for pb::Manifest {
    fn from(manifest: &Manifest) -> Self {
        pb::Manifest {
            files: manifest
                .files
                .iter()
                .map(|f| pb::FileEntry {
                    path: f.path.0.clone(),
                    size_bytes: f.size_bytes,
                    mode: f.mode,
                    chunks: f.chunks.iter().map(pb::ChunkRef::from).collect(),
                })
                .collect(),
            directories: manifest.directories.iter().map(|d| d.0.clone()).collect(),
            metadata: manifest.metadata.clone().into_iter().collect(),
            chunk_key: manifest.addressing.to_wire(),
        }
    }
}

/// A validated BeginCheckpoint request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BeginCheckpoint {
    pub job: JobName,
    pub step: u64,
    pub world_size: u32,
    pub epoch: u64,
    /// Set by the control plane, not the caller: a pending checkpoint begun before this (past the
    /// pending timeout, so it can no longer commit) is not joined but aborted, and a new one
    /// begun. 0 joins any.
    pub begun_after_ms: u64,
}

impl TryFrom<pb::BeginCheckpointRequest> for BeginCheckpoint {
    type Error = ModelError;
    fn try_from(request: pb::BeginCheckpointRequest) -> Result<Self, Self::Error> {
        if request.world_size == 0 || request.world_size > MAX_WORLD_SIZE {
            return Err(field("world_size", format!("{} is outside 1..={MAX_WORLD_SIZE}", request.world_size)));
        }
        if i64::try_from(request.step).is_err() {
            return Err(field("step", "must fit in a signed 64-bit integer"));
        }
        if request.epoch == 0 || i64::try_from(request.epoch).is_err() {
            return Err(field("epoch", "missing or out of range (take a lease with AcquireLease first)"));
        }
        Ok(BeginCheckpoint {
            job: JobName::try_from(request.job)?,
            step: request.step,
            world_size: request.world_size,
            epoch: request.epoch,
            begun_after_ms: 0,
        })
    }
}

/// A validated AcquireLease request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcquireLease {
    pub job: JobName,
    pub run_id: String,
    /// When the asking process started (Unix ms); 0: not said.
    pub started_at_ms: u64,
}

impl TryFrom<pb::AcquireLeaseRequest> for AcquireLease {
    type Error = ModelError;
    fn try_from(request: pb::AcquireLeaseRequest) -> Result<Self, Self::Error> {
        if request.run_id.is_empty() || request.run_id.len() > MAX_RUN_ID_BYTES || request.run_id.contains('\0') {
            return Err(field("run_id", format!("must be 1..={MAX_RUN_ID_BYTES} bytes without NUL")));
        }
        Ok(AcquireLease {
            job: JobName::try_from(request.job)?,
            run_id: request.run_id,
            started_at_ms: request.started_at_ms,
        })
    }
}

/// A part's manifest (or a draft's) validated, no larger encoded than a reader can fetch.
pub fn part_manifest(manifest: Option<pb::Manifest>) -> Result<Manifest, ModelError> {
    let manifest = manifest.ok_or_else(|| field("manifest", "missing"))?;
    let encoded = prost::Message::encoded_len(&manifest);
    if encoded > MAX_PART_MANIFEST_BYTES {
        return Err(field(
            "manifest",
            format!(
                "{encoded} bytes encoded, over the {MAX_PART_MANIFEST_BYTES} a part may have (a reader could never \
                 fetch it): save fewer files per rank, or use larger chunks"
            ),
        ));
    }
    Manifest::try_from(manifest)
}

/// A validated CommitPart request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitPart {
    pub checkpoint_id: u64,
    pub rank: u32,
    pub manifest: Manifest,
    /// Bytes the writer actually uploaded for this part (≤ the manifest's total).
    pub written_bytes: u64,
    /// The tenant the committer acts for, set by the control plane from its bearer token (never
    /// from the request): the checkpoint must be one of that tenant's jobs, or the part is refused
    /// as if the checkpoint did not exist. None: an operator's, or a cluster without tokens.
    pub namespace: Option<TenantName>,
    /// The cluster's key, set by the control plane (never from the request): a tenant's job's
    /// part must address its chunks with the tenant's key derived from it ([`crate::address`]).
    pub cluster_key: Option<crate::capability::ClusterKey>,
}

impl TryFrom<pb::CommitPartRequest> for CommitPart {
    type Error = ModelError;
    fn try_from(request: pb::CommitPartRequest) -> Result<Self, Self::Error> {
        let manifest = part_manifest(request.manifest)?;
        if i64::try_from(request.checkpoint_id).is_err() {
            return Err(field("checkpoint_id", "out of range"));
        }
        if request.written_bytes > manifest.total_bytes() {
            return Err(field(
                "written_bytes",
                format!("{} exceeds the part's {} bytes", request.written_bytes, manifest.total_bytes()),
            ));
        }
        Ok(CommitPart {
            checkpoint_id: request.checkpoint_id,
            rank: request.rank,
            manifest,
            written_bytes: request.written_bytes,
            namespace: None,
            cluster_key: None,
        })
    }
}

/// A validated target registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetRegistration {
    pub target_id: String,
    pub data_address: std::net::SocketAddr,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    /// Empty: a failure domain of its own.
    pub failure_domain: String,
    /// Empty: no RDMA.
    pub rdma_device: String,
}

/// Most replicas of a chunk a job may ask for.
pub const MAX_REPLICAS: u32 = 16;

impl TryFrom<pb::RegisterTargetRequest> for TargetRegistration {
    type Error = ModelError;
    fn try_from(request: pb::RegisterTargetRequest) -> Result<Self, Self::Error> {
        validate_target_id(&request.target_id)?;
        let data_address = request
            .data_address
            .parse()
            .map_err(|_| field("data_address", format!("{:?} is not host:port", request.data_address)))?;
        let domain = &request.failure_domain;
        if domain.len() > 128 || domain.chars().any(char::is_control) {
            return Err(field(
                "failure_domain",
                format!("{domain:?} is not a label of at most 128 printable characters"),
            ));
        }
        let device = &request.rdma_device;
        if device.len() > 64 || device.chars().any(char::is_control) {
            return Err(field("rdma_device", format!("{device:?} is not a name of at most 64 printable characters")));
        }
        Ok(TargetRegistration {
            target_id: request.target_id,
            data_address,
            capacity_bytes: request.capacity_bytes,
            used_bytes: request.used_bytes,
            failure_domain: request.failure_domain,
            rdma_device: request.rdma_device,
        })
    }
}

pub fn validate_target_id(id: &str) -> Result<(), ModelError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return Err(field("target_id", format!("{id:?} must be 1..=64 of [A-Za-z0-9-]")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn registrations_are_checked() {
        let good = pb::RegisterTargetRequest {
            target_id: "t-1".into(),
            data_address: "10.0.0.1:7071".into(),
            capacity_bytes: 1,
            used_bytes: 0,
            failure_domain: "rack-2".into(),
            rdma_device: "mlx5_0".into(),
            proof: Default::default(),
        };
        let registration = super::TargetRegistration::try_from(good.clone()).unwrap();
        assert_eq!((registration.failure_domain.as_str(), registration.rdma_device.as_str()), ("rack-2", "mlx5_0"));
        let bad = [
            pb::RegisterTargetRequest { data_address: "nowhere".into(), ..good.clone() },
            pb::RegisterTargetRequest { failure_domain: "a\nb".into(), ..good.clone() },
            pb::RegisterTargetRequest { rdma_device: "x".repeat(65), ..good.clone() },
            pb::RegisterTargetRequest { rdma_device: "mlx5\0".into(), ..good.clone() },
        ];
        for request in bad {
            assert!(super::TargetRegistration::try_from(request.clone()).is_err(), "{request:?}");
        }
    }

    use super::*;

    fn chunk(len: u64) -> pb::ChunkRef {
        pb::ChunkRef {
            hash: bytes::Bytes::from(vec![7u8; 32]),
            length_bytes: len,
            stored_length_bytes: len,
            codec: 0,
            replicas: vec!["t1".into()],
        }
    }

    fn file(path: &str, sizes: &[u64]) -> pb::FileEntry {
        pb::FileEntry {
            path: path.into(),
            size_bytes: sizes.iter().sum(),
            mode: 0o644,
            chunks: sizes.iter().map(|s| chunk(*s)).collect(),
        }
    }

    #[test]
    fn paths() {
        let (longest, too_long) = ("n".repeat(MAX_NAME_BYTES), "n".repeat(MAX_NAME_BYTES + 1));
        let deep = format!("{longest}/{longest}");
        for good in ["a", "a/b/c.pt", "rank0/optim.pt", "..a", "a..", ".hidden", &longest, &deep] {
            assert!(RelPath::try_from(good).is_ok(), "{good}");
        }
        let nested = format!("a/{too_long}/b");
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a/./b", "a/", ".", "a\0b", &too_long, &nested] {
            assert!(RelPath::try_from(bad).is_err(), "{bad:?}");
        }
        let root = std::path::Path::new("/restore");
        assert_eq!(RelPath::try_from("a/b").unwrap().under(root), std::path::Path::new("/restore/a/b"));
    }

    #[test]
    fn job_names() {
        for good in ["llama-70b", "a", "run_1.v2"] {
            assert!(JobName::try_from(good).is_ok());
        }
        for bad in ["", ".", "..", ".x", "a b", &"x".repeat(129), "a/b/c", "/a", "a/", ".t/a", "t/.a", "t u/a"] {
            assert!(JobName::try_from(bad).is_err(), "{bad:?}");
        }
        assert!(JobName::try_from(format!("{}/a", "t".repeat(65)).as_str()).is_err());
        let plain = JobName::try_from("llama").unwrap();
        assert_eq!((plain.tenant(), plain.local()), (None, "llama"));
        let acme = TenantName::try_from("acme").unwrap();
        let qualified = plain.in_tenant(&acme).unwrap();
        assert_eq!(qualified.as_str(), "acme/llama");
        assert_eq!((qualified.tenant(), qualified.local()), (Some("acme"), "llama"));
        assert!(acme.holds(qualified.as_str()) && !acme.holds(plain.as_str()));
        assert!(!TenantName::try_from("acmex").unwrap().holds(qualified.as_str()));
        assert_eq!(JobName::try_from("acme/llama").unwrap(), qualified);
        assert!(qualified.in_tenant(&acme).is_err(), "a tenant cannot name another tenant's job");
        for bad in ["", ".a", "a/b", "a b", &"t".repeat(65)] {
            assert!(TenantName::try_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn manifest_validation() {
        let ok = pb::Manifest {
            files: vec![file("a/b", &[10, 5]), file("empty", &[])],
            directories: vec!["d".into()],
            metadata: Default::default(),
            chunk_key: vec![9u8; 32].into(),
        };
        let manifest = Manifest::try_from(ok.clone()).unwrap();
        assert_eq!(manifest.total_bytes(), 15);
        assert!(manifest.addressing.is_keyed());
        assert_eq!(pb::Manifest::from(&manifest), ok);
        let plain = pb::Manifest { chunk_key: Default::default(), ..ok.clone() };
        assert_eq!(Manifest::try_from(plain).unwrap().addressing, crate::Addressing::plain());
        let bad = pb::Manifest { chunk_key: vec![9u8; 31].into(), ..ok.clone() };
        assert!(Manifest::try_from(bad).is_err());

        let mut bad = ok.clone();
        bad.files[0].size_bytes = 16;
        assert!(matches!(Manifest::try_from(bad), Err(ModelError::File { .. })));
        let mut bad = ok.clone();
        bad.files.push(file("a/b", &[1]));
        assert!(Manifest::try_from(bad).is_err());
        let mut bad = ok.clone();
        bad.files[0].path = "../escape".into();
        assert!(matches!(Manifest::try_from(bad), Err(ModelError::Path { .. })));
        let mut bad = ok.clone();
        bad.files[0].chunks[0].hash = bytes::Bytes::from_static(b"short");
        assert!(matches!(Manifest::try_from(bad), Err(ModelError::HashLength { len: 5 })));
        let mut bad = ok.clone();
        bad.files[0].chunks[0].replicas.clear();
        assert!(Manifest::try_from(bad).is_err());
        let mut bad = ok.clone();
        bad.files[0].chunks[0].codec = 9;
        assert!(Manifest::try_from(bad).is_err());
        let mut bad = ok;
        bad.directories.push("a/b".into());
        assert!(Manifest::try_from(bad).is_err());
    }

    #[test]
    fn parts_of_one_checkpoint_must_not_overlap() {
        let part = |files: &[&str], dirs: &[&str]| {
            Manifest::try_from(pb::Manifest {
                files: files.iter().map(|path| file(path, &[1])).collect(),
                directories: dirs.iter().map(|d| d.to_string()).collect(),
                ..Default::default()
            })
            .unwrap()
        };
        let check = |parts: &[Manifest]| check_disjoint(parts.iter().enumerate().map(|(rank, m)| (rank as u32, m)));
        let reason = |parts: &[Manifest]| match check(parts) {
            Err(ModelError::File { path, reason }) => format!("{path}: {reason}"),
            other => panic!("{other:?}"),
        };
        // Disjoint files, shared directories, a directory listed by one and implied by another.
        let good = [part(&["m/r0.pt", "x"], &["logs"]), part(&["m/r1.pt"], &["m", "logs"]), part(&[], &[])];
        check(&good).unwrap();
        assert_eq!(
            reason(&[part(&["m/w.pt"], &[]), part(&["m/w.pt"], &[])]),
            "m/w.pt: is in the parts of ranks 0 and 1"
        );
        // A file where a later or an earlier part (or its own) has a directory.
        for parts in [
            [part(&["a"], &[]), part(&["a/b"], &[])],
            [part(&["a/b/c"], &[]), part(&["a"], &[])],
            [part(&["a"], &[]), part(&[], &["a"])],
            [part(&["a", "a/b"], &[]), part(&[], &[])],
        ] {
            assert!(reason(&parts).starts_with("a: is a file in the part of rank"), "{}", reason(&parts));
        }
        // Neighbours in byte order are not neighbours in the tree: `a.txt` and `a-1` sort between
        // `a` and `a/b` byte by byte.
        let parts = [part(&["a", "a.txt", "a-1"], &[]), part(&["a/b"], &[])];
        assert_eq!(reason(&parts), "a: is a file in the part of rank 0 and a directory in the part of rank 1");
        check(&[part(&["a.txt", "a-1", "a/b"], &[]), part(&["a0", "b"], &["a"])]).unwrap();

        // Deep paths cost their length, not their length squared: 400 files 2,000 levels deep,
        // then one of them a directory of another part.
        let deep = |i: usize| format!("f{i}/{}x", "d/".repeat(2000));
        let files: Vec<String> = (0..400).map(deep).collect();
        let many = part(&files.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
        check(std::slice::from_ref(&many)).unwrap();
        let beneath = format!("{}/y", deep(399));
        let parts = [many, part(&[&beneath], &[])];
        assert_eq!(
            reason(&parts),
            format!("{}: is a file in the part of rank 0 and a directory in the part of rank 1", deep(399))
        );
    }

    #[test]
    fn chunk_ranges() {
        let manifest =
            Manifest::try_from(pb::Manifest { files: vec![file("f", &[10, 10, 5])], ..Default::default() }).unwrap();
        let f = &manifest.files[0];
        let starts: Vec<u64> = f.chunks_in_range(5, 10).map(|(s, _)| s).collect();
        assert_eq!(starts, vec![0, 10]);
        let starts: Vec<u64> = f.chunks_in_range(20, 100).map(|(s, _)| s).collect();
        assert_eq!(starts, vec![20]);
        assert_eq!(f.chunks_in_range(25, 1).count(), 0);
    }

    #[test]
    fn commit_part_validation() {
        let manifest = pb::Manifest { files: vec![file("f", &[10, 5])], ..Default::default() };
        let ok = pb::CommitPartRequest { checkpoint_id: 1, rank: 0, manifest: Some(manifest), written_bytes: 15 };
        assert_eq!(CommitPart::try_from(ok.clone()).unwrap().written_bytes, 15);
        assert!(CommitPart::try_from(pb::CommitPartRequest { written_bytes: 16, ..ok.clone() }).is_err());
        assert!(CommitPart::try_from(pb::CommitPartRequest { manifest: None, ..ok.clone() }).is_err());
        assert!(CommitPart::try_from(pb::CommitPartRequest { checkpoint_id: u64::MAX, ..ok }).is_err());
        // A part over the size a reader can fetch: ~17k files with ~3.8 KB paths.
        let dir = vec!["d".repeat(250); 15].join("/");
        let files = (0..17_000).map(|i| file(&format!("{dir}/{i}"), &[])).collect();
        let huge = pb::Manifest { files, ..Default::default() };
        assert!(prost::Message::encoded_len(&huge) > MAX_PART_MANIFEST_BYTES);
        let refused = CommitPart::try_from(pb::CommitPartRequest {
            checkpoint_id: 1,
            rank: 0,
            manifest: Some(huge),
            written_bytes: 0,
        })
        .unwrap_err();
        assert!(refused.to_string().contains("a reader could never fetch it"), "{refused}");
    }

    #[test]
    fn begin_and_lease_validation() {
        let ok = pb::BeginCheckpointRequest { job: "j".into(), step: 1, world_size: 2, epoch: 1 };
        assert!(BeginCheckpoint::try_from(ok.clone()).is_ok());
        assert!(BeginCheckpoint::try_from(pb::BeginCheckpointRequest { world_size: 0, ..ok.clone() }).is_err());
        assert!(BeginCheckpoint::try_from(pb::BeginCheckpointRequest { step: u64::MAX, ..ok.clone() }).is_err());
        assert!(BeginCheckpoint::try_from(pb::BeginCheckpointRequest { epoch: 0, ..ok }).is_err());
        let lease = pb::AcquireLeaseRequest { job: "j".into(), run_id: "run-1/0".into(), started_at_ms: 0 };
        assert!(AcquireLease::try_from(lease.clone()).is_ok());
        assert!(AcquireLease::try_from(pb::AcquireLeaseRequest { run_id: String::new(), ..lease.clone() }).is_err());
        assert!(AcquireLease::try_from(pb::AcquireLeaseRequest { run_id: "x".repeat(257), ..lease.clone() }).is_err());
        assert!(AcquireLease::try_from(pb::AcquireLeaseRequest { job: "../j".into(), ..lease }).is_err());
    }
}

#[cfg(test)]
mod robustness {
    use prost::Message;

    use super::*;

    /// Arbitrary bytes decoded as a manifest and validated never panic.
    #[test]
    fn arbitrary_manifest_bytes() {
        let valid = pb::Manifest {
            files: vec![pb::FileEntry {
                path: "a/b".into(),
                size_bytes: 3,
                mode: 0o644,
                chunks: vec![pb::ChunkRef {
                    hash: bytes::Bytes::from(vec![1u8; 32]),
                    length_bytes: 3,
                    stored_length_bytes: 3,
                    codec: 0,
                    replicas: vec!["t".into()],
                }],
            }],
            directories: vec!["d".into()],
            metadata: Default::default(),
            chunk_key: vec![3u8; 32].into(),
        }
        .encode_to_vec();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..50_000 {
            // Mutate a valid encoding: flip, truncate or extend, then decode and validate.
            let mut bytes = valid.clone();
            for _ in 0..(next() % 4 + 1) {
                let at = (next() as usize) % bytes.len();
                bytes[at] ^= next() as u8;
            }
            bytes.truncate((next() as usize) % (bytes.len() + 1));
            if let Ok(message) = pb::Manifest::decode(&bytes[..]) {
                let _ = Manifest::try_from(message);
            }
        }
    }
}
