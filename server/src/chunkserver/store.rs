//! The chunk store: content-addressed chunk files in a target's data directory.
//!
//! Back of the envelope: a 4 MiB chunk at ~1.5 GB/s O_DIRECT is ~2.8 ms of device time, an
//! fdatasync ~1 ms, a directory fsync ~1 ms (../shared/MACHINE.md), so per-chunk durability
//! costs ~30% at QD1 and overlaps away at QD4+. A 4 KiB header block costs 0.1% of space.
//!
//! ## Layout
//!
//! ```text
//! DIR/target.id                 this target's stable id (UUID), written once
//! DIR/chunks/ab/<hash hex>      one file per chunk, fanned out by the first hash byte
//! DIR/tmp/<hash hex>.<uuid>     writes in progress; removed at start-up
//! DIR/free/<uuid>               files of deleted chunks kept for reuse (`freepool.rs`)
//! ```
//!
//! ## Chunk file format
//!
//! ```text
//!  0         8        10      11        16              24              32               64        72     4096
//!  +---------+--------+-------+---------+---------------+---------------+----------------+---------+-- ... --+
//!  |"SCKCHUNK"| ver u16| codec | 0 x 5   | stored len u64| length u64    | BLAKE3 hash    | hdr sum | zeros   |
//!  +---------+--------+-------+---------+---------------+---------------+----------------+---------+-- ... --+
//!  | stored bytes (`stored len`), zero padded to a multiple of 4096                                          |
//!  +---------------------------------------------------------------------------------------------------------+
//! ```
//! All integers little-endian. `length` is the chunk's length, `stored len` that of the bytes on
//! disk after the codec (`codec` is a `starckpt.control.v1.Codec` value). `hdr sum` is the first 8
//! bytes of BLAKE3(bytes 0..64) in every version, so any build can tell a header it does not
//! understand (valid sum, unknown version: left alone) from a rotten one (removed). Version 1:
//! codec none. Version 2 (a compressed chunk) adds the BLAKE3 of the stored bytes at 72..104 and,
//! at 104..112, the first 8 bytes of BLAKE3(bytes 72..104). Version 3 (a tenant's chunk, whose
//! address is a keyed hash: `starckpt_proto::address`) is laid out as version 2 with any codec,
//! so the stored bytes' hash checks it without the tenant's key. A torn or rotted header is detected
//! before its lengths are trusted. The file is self-describing: a scrub or a recovery tool needs
//! nothing but the file.
//!
//! ## Write protocol and crash cases
//!
//! 1. The payload's BLAKE3 is checked against the hash it was sent under (reject on mismatch). A
//!    compressed payload is decoded first and the decoded bytes are checked: the content address
//!    stays honest whatever a client sends, so a chunk deduplicated against it is the real one.
//!    A tenant's chunk is checked against the content hash its PUT names, after the data plane
//!    checked that its address is the hash of that under the key the PUT carries.
//! 2. The header block and payload are written with O_DIRECT to `tmp/<hash>.<uuid>`, then
//!    fdatasync'd (the engine does both). When the free pool holds a file of exactly the chunk
//!    file's size, that file is overwritten in place instead (its fdatasync commits no metadata;
//!    `freepool.rs`).
//! 3. `renameat2(RENAME_NOREPLACE)` moves it to `chunks/ab/<hash>`; if the chunk appeared
//!    meanwhile (a concurrent put), the temp file is removed (a free file goes back to the pool)
//!    and the put reports it present.
//! 4. `chunks/ab/` is fsync'd, making the rename durable. Only then is the put acknowledged.
//!
//! ## Last use, and garbage collection's guard
//!
//! A chunk file's mtime is its last use: a put writes it, and a put that finds the chunk already
//! stored or a HAS that reports it present sets it to now. GC deletes only chunks unused for
//! longer than its grace period (`delete(.., Some(unused_for))`), checking the mtime and unlinking
//! under the same per-chunk lock that HAS and PUT take to refresh it. So a writer that was told
//! "present" (and will commit a manifest naming the chunk) has refreshed it first, and the chunk
//! outlives any sweep that could still race with that commit (see `server/src/control/gc.rs`).
//! A chunk's age is never taken as more than the time this store has been open, nor than the
//! time since the wall clock last jumped ([`UseClock`]): the mtime is not fsync'd (after a power
//! loss it can read older than the last use), and a clock stepped forward would make every chunk
//! look old. For a grace period after a start or a clock jump, nothing is old enough to collect.
//!
//! Crash before 3: a temp file, removed at the next start (or a free file, still free). Crash between 3 and 4: the chunk may or
//! may not survive power loss, but it was never acknowledged, so no manifest names it. Readers
//! never see a partial chunk because the final name only ever appears by an atomic rename of a
//! complete, synced file.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use starckpt_dataplane::buf::{ALIGN, AlignedBuf, BoxedBuf, BufPool, boxed_to_bytes, round_up};
use starckpt_proto::codec::{self, Codec};
use starckpt_proto::{ChunkHash, ChunkName};
use thiserror::Error;

use super::engine::{ExternalBuf, IoEngine};
use super::freepool::{FreePool, FreePoolConfig};

#[derive(Debug, Error)]
pub enum ChunkStoreError {
    #[error("chunk {hash}: the {codec} payload does not decode: {reason}")]
    Undecodable { hash: ChunkHash, codec: Codec, reason: String },
    #[error("payload hashes to {actual}, not to {expected} it was sent under")]
    HashMismatch { expected: ChunkHash, actual: ChunkHash },
    #[error("chunk {hash} not found")]
    NotFound { hash: ChunkHash },
    #[error("chunk {hash} is corrupt on disk: {reason}")]
    Corrupt { hash: ChunkHash, reason: String },
    #[error("range {offset}+{length} is outside chunk {hash} of {chunk_len} bytes")]
    BadRange { hash: ChunkHash, offset: u64, length: u64, chunk_len: u64 },
    #[error("no space left on the device while writing chunk {hash}")]
    NoSpace { hash: ChunkHash },
    #[error("target is full: {available} bytes free, {reserve} kept in reserve; chunk {hash} refused")]
    Full { hash: ChunkHash, available: u64, reserve: u64 },
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: io::Error },
}

/// Reads the copy of `hash` at `path` whole and checks it ([`ChunkStore::check_copy`]).
fn judge_copy(path: &Path, hash: ChunkHash) -> Result<Copy, ChunkStoreError> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ChunkStoreError::NotFound { hash }),
        Err(source) => return Err(ChunkStoreError::Io { op: "open", path: path.to_path_buf(), source }),
    };
    let meta = file.metadata().map_err(io_error("stat", path))?;
    let bad = |reason: String| Ok(Copy::Bad { inode: meta.ino(), reason });
    if meta.len() < HEADER_BYTES as u64 {
        return bad(format!("file is {} bytes", meta.len()));
    }
    let mut bytes = vec![0; HEADER_BYTES];
    file.read_exact(&mut bytes).map_err(io_error("read", path))?;
    // A header whose checksums hold but that says what this build cannot read was written by a
    // newer one (a downgrade): an error to report, never a bad copy to delete.
    if let Some(unknown) = unknown_to_this_build(&bytes) {
        return Err(ChunkStoreError::Io {
            op: "verify",
            path: path.to_path_buf(),
            source: io::Error::other(format!("{unknown} this build does not know")),
        });
    }
    let limit = (HEADER_BYTES + starckpt_proto::frame::MAX_PAYLOAD_BYTES as usize + 4096) as u64;
    if meta.len() > limit {
        return bad(format!("file is {} bytes", meta.len()));
    }
    bytes.reserve_exact(meta.len() as usize - HEADER_BYTES);
    file.read_to_end(&mut bytes).map_err(io_error("read", path))?;
    let header = match decode_header(&bytes, &hash) {
        Ok(header) => header,
        Err(ChunkStoreError::Corrupt { reason, .. }) => return bad(reason),
        Err(other) => return Err(other),
    };
    let length = header.stored_len;
    let Some(payload) = bytes.get(HEADER_BYTES..HEADER_BYTES + length as usize) else {
        return bad(format!("header says {length} bytes, file holds {}", bytes.len() - HEADER_BYTES));
    };
    // The stored bytes against their hash: a compressed copy was decoded and checked against the
    // content hash when it was written.
    let actual = ChunkHash::of(payload);
    if actual == header.stored_hash { Ok(Copy::Good { length }) } else { bad(format!("stored bytes hash to {actual}")) }
}

/// What a header with valid checksums names that this build cannot read: a format version, a
/// codec or a length beyond this build's largest chunk. `None` when the header is readable or
/// its checksums do not hold (then it is corrupt, not newer).
fn unknown_to_this_build(header: &[u8]) -> Option<&'static str> {
    if header[0..8] != MAGIC[..] || header[64..72] != header_sum(header) {
        return None;
    }
    let version = u16::from_le_bytes([header[8], header[9]]);
    if !FORMAT_VERSIONS.contains(&version) {
        return Some("a chunk format");
    }
    if version != FORMAT_VERSION && header[104..112] != sum8(&header[72..104]) {
        return None;
    }
    if Codec::from_wire(i32::from(header[10])).is_err() {
        return Some("a codec");
    }
    let length = u64::from_le_bytes(header[24..32].try_into().expect("8 bytes"));
    (length > u64::from(starckpt_proto::frame::MAX_PAYLOAD_BYTES)).then_some("a chunk length")
}

fn io_error(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> ChunkStoreError + use<> {
    let path = path.to_path_buf();
    move |source| ChunkStoreError::Io { op, path, source }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    AlreadyPresent,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub chunk_count: u64,
    /// Bytes of deleted chunks' files kept for reuse (not in `used_bytes`: a put can have them).
    pub free_pool_bytes: u64,
    /// Puts that overwrote a kept file instead of allocating a new one, since start.
    pub reused_files: u64,
    /// Chunk files read from the device for readers (GETs, and `--queue-depth auto`'s
    /// calibration), since start; a GET whose chunk did not fit a client's slot after all reads
    /// twice.
    pub chunk_reads: u64,
    /// Chunks read straight into a client's memory ([`ChunkStore::read_placed`]), since start.
    pub placed_reads: u64,
    /// Chunks written to the device straight from a client's memory
    /// ([`ChunkStore::placed_write`]), since start.
    pub placed_writes: u64,
    /// Chunk files written (made visible; not puts of chunks already present), since start.
    pub chunk_writes: u64,
}

/// What [`ChunkStore::check_copy`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Copy {
    Good {
        length: u64,
    },
    /// Not the chunk's bytes; `inode` names the file judged (see [`ChunkStore::remove_copy_if`]).
    Bad {
        inode: u64,
        reason: String,
    },
}

/// How a put's rename ended.
enum Renamed {
    Stored,
    Replaced { old_bytes: u64 },
    AlreadyPresent,
}

/// A pool buffer lent to a read, with its place in the reads' share of the pool.
struct SharedRead {
    buf: starckpt_dataplane::buf::PooledBuf,
    _share: tokio::sync::OwnedSemaphorePermit,
}

impl starckpt_dataplane::buf::IoBuf for SharedRead {
    fn aligned(&self) -> &AlignedBuf {
        self.buf.aligned()
    }
    fn aligned_mut(&mut self) -> &mut AlignedBuf {
        self.buf.aligned_mut()
    }
    fn pool_slot(&self) -> Option<starckpt_dataplane::buf::PoolSlot> {
        self.buf.pool_slot()
    }
}

/// Chunk bytes waiting to be stored: an aligned buffer whose first [`HEADER_BYTES`] are reserved
/// for the chunk header and whose data follows, so the payload can be received from the network
/// straight into its final on-disk position.
pub struct ChunkWrite {
    buf: BoxedBuf,
    data_len: usize,
    /// How the payload is encoded, and the chunk's length once decoded.
    codec: Codec,
    length: u64,
    /// BLAKE3 of the payload, when whoever filled it hashed it on the way ([`ChunkWrite::fill_hashed`]).
    data_hash: Option<ChunkHash>,
    /// The payload's whole blocks, when the device writes them from where they lie (memory a
    /// trusted client shares, [`ChunkStore::placed_write`]), and how to hash them there once it
    /// has; `buf` then holds the header and only the payload's last partial block.
    placed: Option<(ExternalBuf, PlacedHasher)>,
}

/// Hashes a placed write's whole blocks where they lie: a BLAKE3 hasher that has read them.
pub type PlacedHasher = Box<dyn FnOnce() -> io::Result<blake3::Hasher> + Send>;

impl ChunkWrite {
    /// The payload is `codec`-encoded and decodes to `length` bytes (default: not encoded).
    pub fn set_codec(&mut self, codec: Codec, length: u64) {
        (self.codec, self.length) = (codec, length);
    }

    /// The region the payload must be written into: all of it, or for a placed write only its
    /// bytes after the placed blocks.
    pub fn data_mut(&mut self) -> &mut [u8] {
        self.data_hash = None; // about to change
        let end = HEADER_BYTES + self.held_len();
        &mut self.buf.aligned_mut().full_mut()[HEADER_BYTES..end]
    }

    /// Fills the payload with `fill`, which returns the BLAKE3 of the bytes it wrote (a copy
    /// that hashes as it goes, `Region::read_at_hashed`): verifying the chunk then does not read
    /// them again. Not for a placed write (verified after the device wrote it).
    pub fn fill_hashed<E>(&mut self, fill: impl FnOnce(&mut [u8]) -> Result<ChunkHash, E>) -> Result<(), E> {
        let hash = fill(self.data_mut())?;
        self.data_hash = Some(hash);
        Ok(())
    }

    /// The payload held in the store's buffer: all of it, except for a placed write.
    pub fn data(&self) -> &[u8] {
        &self.buf.aligned().full()[HEADER_BYTES..HEADER_BYTES + self.held_len()]
    }

    /// The payload's length (placed blocks included).
    pub fn len(&self) -> usize {
        self.data_len
    }

    pub fn is_empty(&self) -> bool {
        self.data_len == 0
    }

    /// Bytes of the payload in the store's buffer.
    fn held_len(&self) -> usize {
        self.data_len - self.placed.as_ref().map_or(0, |(body, _)| body.len())
    }
}

/// One chunk in a [`ChunkStore::list`] page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListedChunk {
    pub hash: ChunkHash,
    /// Time since the chunk was last used (written, re-put, or reported present).
    pub unused_for: Duration,
}

pub struct ChunkStore {
    root: PathBuf,
    engine: Arc<dyn IoEngine>,
    /// Whether the device completes what the engine gives it ([`ChunkStore::io_stalled_for`]).
    io: Arc<super::engine::IoWatch>,
    pool: BufPool,
    /// Pool buffers reads may hold at once: half the pool ([`ChunkStore::read_buffer`]).
    read_share: Arc<tokio::sync::Semaphore>,
    chunk_count: AtomicU64,
    used_bytes: AtomicU64,
    /// [`StoreStats::chunk_reads`].
    chunk_reads: AtomicU64,
    /// [`StoreStats::placed_reads`].
    placed_reads: AtomicU64,
    /// [`StoreStats::placed_writes`].
    placed_writes: AtomicU64,
    /// [`StoreStats::chunk_writes`].
    chunk_writes: AtomicU64,
    use_locks: Arc<UseLocks>,
    clock: Arc<UseClock>,
    /// Free bytes the store never writes into (see [`ChunkStore::set_reserve`]).
    reserve_bytes: AtomicU64,
    /// The owning target's id, once known (requests naming another are refused).
    target_id: std::sync::OnceLock<String>,
    scrub_stats: super::scrub::ScrubStats,
    /// Bytes of compressed payloads being decoded to verify them (each needs its decoded length
    /// in memory for a moment): bounded, so many small compressed PUTs cannot claim gigabytes.
    decode_budget: Arc<tokio::sync::Semaphore>,
    free: Arc<FreePool>,
}

/// Decoded bytes in memory at once across verifications ([`ChunkStore`]'s `decode_budget`).
const DECODE_BUDGET_BYTES: u32 = 4 * starckpt_proto::frame::MAX_PAYLOAD_BYTES;

impl ChunkStore {
    /// Opens (creating if needed) the store under `root`: removes leftover temp files and counts
    /// the chunks present. `pool_buffers` buffers of one default chunk each are reused for I/O.
    pub async fn open(
        root: &Path,
        engine: Arc<dyn IoEngine>,
        chunk_size_bytes: usize,
        pool_buffers: usize,
    ) -> Result<ChunkStore, ChunkStoreError> {
        let root = root.to_path_buf();
        let scan_root = root.clone();
        let (count, used, free) = tokio::task::spawn_blocking(move || {
            let (count, used) = prepare_dir(&scan_root)?;
            let free_dir = scan_root.join("free");
            let preferred = round_up(HEADER_BYTES + chunk_size_bytes) as u64;
            let free = FreePool::open(free_dir.clone(), preferred).map_err(io_error("scan", &free_dir))?;
            // Default cap: a tenth of the filesystem.
            let max_bytes = fs_capacity(&scan_root).map_err(io_error("statvfs", &scan_root))? / 10;
            free.configure(FreePoolConfig { max_bytes, ..FreePoolConfig::default() })
                .map_err(io_error("unlink", &free_dir))?;
            Ok::<_, ChunkStoreError>((count, used, free))
        })
        .await
        .map_err(|e| ChunkStoreError::Io {
            op: "scan",
            path: root.clone(),
            source: io::Error::other(e),
        })??;
        let watched = super::engine::Watched::new(engine);
        let io = Arc::clone(watched.watch());
        Ok(ChunkStore {
            root,
            engine: Arc::new(watched),
            io,
            pool: BufPool::new(HEADER_BYTES + chunk_size_bytes, pool_buffers),
            read_share: Arc::new(tokio::sync::Semaphore::new((pool_buffers / 2).max(1))),
            chunk_count: AtomicU64::new(count),
            used_bytes: AtomicU64::new(used),
            chunk_reads: AtomicU64::new(0),
            placed_reads: AtomicU64::new(0),
            placed_writes: AtomicU64::new(0),
            chunk_writes: AtomicU64::new(0),
            use_locks: Arc::new(UseLocks::new()),
            clock: Arc::new(UseClock::new()),
            reserve_bytes: AtomicU64::new(0),
            target_id: std::sync::OnceLock::new(),
            scrub_stats: Default::default(),
            decode_budget: Arc::new(tokio::sync::Semaphore::new(DECODE_BUDGET_BYTES as usize)),
            free: Arc::new(free),
        })
    }

    /// Sets how many bytes of deleted chunks' files are kept for reuse, and after how long a
    /// recycled one may be overwritten (`freepool.rs`). Free files beyond a lowered cap are removed.
    pub async fn set_free_pool(&self, config: FreePoolConfig) -> Result<(), ChunkStoreError> {
        let free = Arc::clone(&self.free);
        let dir = free.dir().to_path_buf();
        tokio::task::spawn_blocking(move || free.configure(config))
            .await
            .map_err(|e| ChunkStoreError::Io { op: "unlink", path: dir.clone(), source: io::Error::other(e) })?
            .map_err(io_error("unlink", &dir))
    }

    /// The free pool's cap in bytes.
    pub fn free_pool_max(&self) -> u64 {
        self.free.max_bytes()
    }

    /// Writes free files of one default chunk file each (zeros; O_DIRECT, fdatasync'd) until the
    /// pool holds `bytes` or its cap, so the first checkpoints are written into reused files too.
    /// Stops early at the space reserve. One file at a time: it yields the device to puts.
    pub async fn preallocate(&self, bytes: u64) -> Result<u64, ChunkStoreError> {
        let file_bytes = self.pool.buf_bytes();
        let mut buf: BoxedBuf = Box::new(AlignedBuf::new(file_bytes));
        buf.aligned_mut().full_mut().fill(0);
        buf.aligned_mut().set_len(file_bytes);
        let mut written = 0;
        // Counted by what this call wrote: puts may take files as fast as they appear.
        while written + file_bytes as u64 <= bytes && self.free.bytes() + file_bytes as u64 <= self.free.max_bytes() {
            let available = fs_available(&self.root).map_err(io_error("statvfs", &self.root))?;
            if available < (file_bytes as u64).saturating_add(self.reserve_bytes.load(Ordering::Relaxed)) {
                tracing::warn!(written, "preallocation stopped at the space reserve");
                break;
            }
            let name = uuid::Uuid::new_v4().simple().to_string();
            let temp = self.root.join("tmp").join(&name);
            buf = match self.engine.write_new_file(temp.clone(), buf).await {
                Ok(buf) => buf,
                Err(source) => {
                    let _ = tokio::fs::remove_file(&temp).await;
                    return Err(ChunkStoreError::Io { op: "write", path: temp, source });
                }
            };
            let free_path = self.free.dir().join(&name);
            tokio::fs::rename(&temp, &free_path).await.map_err(io_error("rename", &temp))?;
            if !self.free.adopt(free_path.clone(), file_bytes as u64) {
                let _ = tokio::fs::remove_file(&free_path).await;
                break;
            }
            written += file_bytes as u64;
        }
        Ok(written)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// How long the device has had operations in flight without completing any (zero while it
    /// completes them, or is idle).
    pub fn io_stalled_for(&self) -> Duration {
        self.io.stalled_for()
    }

    pub fn engine(&self) -> &Arc<dyn IoEngine> {
        &self.engine
    }

    fn chunk_dir(&self, hash: &ChunkHash) -> PathBuf {
        self.root.join("chunks").join(format!("{:02x}", hash.0[0]))
    }

    /// Where `hash` lives on disk. Public for tests and tools that inspect the store.
    pub fn chunk_path(&self, hash: &ChunkHash) -> PathBuf {
        self.chunk_dir(hash).join(hash.to_hex())
    }

    /// The pool of reusable I/O buffers (their memory lives as long as the store: RDMA registers
    /// it once).
    pub fn buffer_pool(&self) -> &BufPool {
        &self.pool
    }

    /// Keeps `bytes` of the filesystem free: puts that would eat into them fail with
    /// [`ChunkStoreError::Full`] (a distinct NO_SPACE answer the client places elsewhere).
    pub fn set_reserve(&self, bytes: u64) {
        self.reserve_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Records the owning target's id (once; later calls are ignored).
    pub fn set_target_id(&self, id: &str) {
        let _ = self.target_id.set(id.to_owned());
    }

    pub fn target_id(&self) -> Option<&str> {
        self.target_id.get().map(String::as_str)
    }

    /// Counts chunk ages as if the store had been open `by` longer (tests of GC only).
    pub fn assume_uptime(&self, by: Duration) {
        self.clock.backdate(by);
    }

    /// What the scrubber found so far (`scrub.rs`).
    pub fn scrub_stats(&self) -> &super::scrub::ScrubStats {
        &self.scrub_stats
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            capacity_bytes: fs_capacity(&self.root).unwrap_or(0),
            used_bytes: self.used_bytes.load(Ordering::Relaxed),
            chunk_count: self.chunk_count.load(Ordering::Relaxed),
            free_pool_bytes: self.free.bytes(),
            reused_files: self.free.reused(),
            chunk_reads: self.chunk_reads.load(Ordering::Relaxed),
            placed_reads: self.placed_reads.load(Ordering::Relaxed),
            placed_writes: self.placed_writes.load(Ordering::Relaxed),
            chunk_writes: self.chunk_writes.load(Ordering::Relaxed),
        }
    }
}

/// A chunk (or a range of one) as read: `bytes` are `codec`-encoded (only a whole chunk is ever
/// returned encoded) and the chunk is `length` bytes decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkRead {
    pub bytes: Bytes,
    pub codec: Codec,
    pub length: u64,
}

/// A chunk [`ChunkStore::read_placed`] put into the caller's memory: its first `stored_len`
/// bytes hold the chunk as stored (encoded with `codec`), `length` bytes once decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub stored_len: u64,
    pub codec: Codec,
    pub length: u64,
}

/// Checks a payload against the chunk hash it was sent under, decoding it first when it is
/// compressed. Returns the BLAKE3 of the payload as it will be stored.
/// Checks a placed write once the device has written it: its blocks hashed where they lie (what
/// the device read, unless the client changed them since, which fails the check too) and its
/// last partial block from `head`, the store's buffer it was written from.
async fn verify_placed(
    hash: ChunkHash,
    head: BoxedBuf,
    held: usize,
    rehash: PlacedHasher,
) -> Result<(), ChunkStoreError> {
    let hashed = tokio::task::spawn_blocking(move || {
        let mut hasher = rehash()?;
        hasher.update(&head.aligned().full()[HEADER_BYTES..HEADER_BYTES + held]);
        Ok::<_, io::Error>(ChunkHash(*hasher.finalize().as_bytes()))
    })
    .await;
    let failed = |source| ChunkStoreError::Io { op: "verify", path: PathBuf::new(), source };
    match hashed {
        Ok(Ok(actual)) if actual == hash => Ok(()),
        Ok(Ok(actual)) => Err(ChunkStoreError::HashMismatch { expected: hash, actual }),
        Ok(Err(source)) => Err(failed(source)),
        Err(join) => Err(failed(io::Error::other(join))),
    }
}

fn verify_payload(hash: ChunkHash, chunk: &ChunkWrite) -> Result<ChunkHash, ChunkStoreError> {
    let max = u64::from(starckpt_proto::frame::MAX_PAYLOAD_BYTES);
    let stored_len = chunk.data_len as u64;
    // Placed writes are verified after the device wrote them (`ChunkStore::verify`).
    debug_assert!(chunk.placed.is_none(), "a placed write verified as a held one");
    let stored_hash = chunk.data_hash.unwrap_or_else(|| ChunkHash::of(chunk.data()));
    debug_assert_eq!(stored_hash, ChunkHash::of(chunk.data()), "a fill_hashed hash that does not match its bytes");
    let actual = match chunk.codec {
        Codec::None if chunk.length == stored_len && stored_len <= max => stored_hash,
        codec => {
            let undecodable = |reason: String| ChunkStoreError::Undecodable { hash, codec, reason };
            if chunk.length == 0 || chunk.length > max {
                return Err(undecodable(format!("decoded length {} is out of range", chunk.length)));
            }
            // Stored bigger than decoded would make every reader fetch more than the chunk.
            if codec == Codec::None || stored_len >= chunk.length {
                return Err(undecodable(format!("{stored_len} stored bytes for a {}-byte chunk", chunk.length)));
            }
            let decoded = codec::decompress(codec, chunk.data(), chunk.length as usize)
                .map_err(|e| undecodable(e.to_string()))?;
            ChunkHash::of(&decoded)
        }
    };
    if actual != hash {
        return Err(ChunkStoreError::HashMismatch { expected: hash, actual });
    }
    Ok(stored_hash)
}

mod clock;
mod delete;
mod format;
mod fsutil;
mod listing;
mod read;
mod write;

pub(crate) use clock::*;
pub(crate) use format::*;
pub(crate) use fsutil::*;
use listing::list_chunks;

#[cfg(test)]
mod conformance;
