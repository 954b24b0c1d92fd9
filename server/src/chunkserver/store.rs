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

pub const HEADER_BYTES: usize = 4096;
const MAGIC: &[u8; 8] = b"SCKCHUNK";
/// Uncompressed chunks.
const FORMAT_VERSION: u16 = 1;
/// Compressed chunks: the header also holds the BLAKE3 of the stored bytes.
const FORMAT_VERSION_STORED_HASH: u16 = 2;
/// A tenant's chunks (`starckpt_proto::address`), compressed or not: laid out as version 2, but
/// the address is a keyed hash, so only the stored bytes' hash can check them.
const FORMAT_VERSION_KEYED: u16 = 3;
const FORMAT_VERSIONS: [u16; 3] = [FORMAT_VERSION, FORMAT_VERSION_STORED_HASH, FORMAT_VERSION_KEYED];

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

/// Stripes of the per-chunk "last use" lock (see the module docs).
const USE_LOCK_STRIPES: usize = 64;

/// Serialises refreshing a chunk's last use (HAS, PUT) with GC's check-and-unlink of that chunk.
struct UseLocks(Vec<Mutex<()>>);

impl UseLocks {
    fn new() -> UseLocks {
        UseLocks((0..USE_LOCK_STRIPES).map(|_| Mutex::new(())).collect())
    }

    fn lock(&self, hash: &ChunkHash) -> MutexGuard<'_, ()> {
        // The guarded data is (); a poisoned stripe is still a valid lock.
        self.0[hash.0[1] as usize % USE_LOCK_STRIPES].lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Caps chunk ages by what this process has itself observed (module docs): the time since the
/// store opened or since the wall clock last jumped against the monotonic clock.
pub struct UseClock {
    /// (monotonic, wall) at the last baseline.
    baseline: Mutex<(std::time::Instant, SystemTime)>,
}

/// A wall clock that moved this far from the monotonic one has jumped.
const CLOCK_JUMP: Duration = Duration::from_secs(1);

impl UseClock {
    fn new() -> UseClock {
        UseClock { baseline: Mutex::new((std::time::Instant::now(), SystemTime::now())) }
    }

    /// Moves the baseline `by` into the past (`TargetConfig::assumed_uptime`).
    fn backdate(&self, by: Duration) {
        let mut baseline = self.baseline.lock().unwrap_or_else(|p| p.into_inner());
        if let (Some(monotonic), Some(wall)) = (baseline.0.checked_sub(by), baseline.1.checked_sub(by)) {
            *baseline = (monotonic, wall);
        }
    }

    /// The longest a chunk can have gone unused as far as this process can tell.
    pub fn age_cap(&self) -> Duration {
        let mut baseline = self.baseline.lock().unwrap_or_else(|p| p.into_inner());
        let monotonic = baseline.0.elapsed();
        let wall = SystemTime::now().duration_since(baseline.1).unwrap_or(Duration::ZERO);
        let drift = wall.abs_diff(monotonic);
        if drift > CLOCK_JUMP || SystemTime::now() < baseline.1 {
            tracing::warn!(?drift, "the wall clock jumped; chunk ages restart from now");
            *baseline = (std::time::Instant::now(), SystemTime::now());
            return Duration::ZERO;
        }
        monotonic
    }

    /// Time since `last_use`, capped.
    fn unused_for(&self, last_use: SystemTime) -> Duration {
        SystemTime::now().duration_since(last_use).unwrap_or_default().min(self.age_cap())
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

    /// A buffer for a chunk of `data_len` bytes: from the pool when it fits (waiting if all are
    /// in use), otherwise a one-off allocation (the data plane bounds those by in-flight bytes).
    pub async fn write_buffer(&self, data_len: usize) -> ChunkWrite {
        let needed = HEADER_BYTES + data_len;
        let buf: BoxedBuf = if needed <= self.pool.buf_bytes() {
            Box::new(self.pool.acquire().await)
        } else {
            Box::new(AlignedBuf::new(needed))
        };
        let mut write =
            ChunkWrite { buf, data_len, codec: Codec::None, length: data_len as u64, data_hash: None, placed: None };
        // Pooled buffers are reused: clear the padding after the data so old bytes never reach disk.
        let padded = round_up(needed);
        write.buf.aligned_mut().full_mut()[needed..padded].fill(0);
        write
    }

    /// A chunk of `data_len` bytes whose whole blocks, `body` (its first `body.len()` bytes, a
    /// multiple of 4096, in memory a trusted client shares), the device writes from where they
    /// lie: no pool buffer and no copy. The rest, under one block, is filled into a small buffer
    /// of the store's that also holds the header ([`ChunkWrite::data_mut`]). The chunk is
    /// verified after the device has written it, before it is renamed into place: `rehash`
    /// hashes the blocks where they lie then, so bytes the client changed before or while the
    /// device read them are refused, never stored under a hash they do not have. Only for
    /// payloads stored as sent (`Codec::None`): the store decodes only memory it owns.
    pub fn placed_write(data_len: usize, body: ExternalBuf, rehash: PlacedHasher) -> io::Result<ChunkWrite> {
        let rest = data_len.checked_sub(body.len()).filter(|&rest| rest < ALIGN);
        let Some(rest) = rest else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} placed bytes for a {data_len}-byte chunk", body.len()),
            ));
        };
        let mut buf: BoxedBuf = Box::new(AlignedBuf::new(HEADER_BYTES + round_up(rest)));
        // The padding after the payload reaches the disk: zeros, never old heap bytes.
        buf.aligned_mut().full_mut().fill(0);
        let length = data_len as u64;
        Ok(ChunkWrite { buf, data_len, codec: Codec::None, length, data_hash: None, placed: Some((body, rehash)) })
    }

    /// A buffer to read a chunk file of `bytes` into. A read's buffer is held until its bytes
    /// have gone out to the reader, which a slow one (a restore over a thin link) can make last:
    /// reads hold at most half the pool, so writes always find buffers, and a read beyond that
    /// share, or one finding the pool taken by writes, gets a buffer of its own (the data plane
    /// bounds those by in-flight bytes): a read never waits for writes.
    fn read_buffer(&self, bytes: usize) -> BoxedBuf {
        if bytes <= self.pool.buf_bytes()
            && let Ok(share) = Arc::clone(&self.read_share).try_acquire_owned()
            && let Some(buf) = self.pool.try_acquire()
        {
            Box::new(SharedRead { buf, _share: share })
        } else {
            Box::new(AlignedBuf::new(bytes))
        }
    }

    /// Verifies and durably stores a chunk. Acknowledge the client only after this returns Ok.
    pub async fn put(&self, hash: ChunkHash, chunk: ChunkWrite) -> Result<PutOutcome, ChunkStoreError> {
        self.put_named(&ChunkName::plain(hash), chunk).await
    }

    /// Stores a chunk under `name.address`, its payload checked against `name.content` (the
    /// caller checked that the address binds the content: [`ChunkName::checked`]).
    pub async fn put_named(&self, name: &ChunkName, chunk: ChunkWrite) -> Result<PutOutcome, ChunkStoreError> {
        let (chunk, stored_hash) = self.verify(name.content, chunk).await?;
        self.store_copy(name, chunk, stored_hash, None).await
    }

    /// Checks a payload against the chunk hash it was sent under ([`verify_payload`]), off the
    /// runtime and within the decode budget. Returns the chunk and the BLAKE3 of its stored bytes.
    async fn verify(&self, hash: ChunkHash, chunk: ChunkWrite) -> Result<(ChunkWrite, ChunkHash), ChunkStoreError> {
        if chunk.placed.is_some() {
            if chunk.codec != Codec::None || chunk.length != chunk.data_len as u64 {
                let reason = "an encoded payload is never placed: it is decoded from the store's own memory".into();
                return Err(ChunkStoreError::Undecodable { hash, codec: chunk.codec, reason });
            }
            // Verified once the device has written it (`store_copy`); stored as sent, so the
            // stored bytes' hash is the chunk's.
            return Ok((chunk, hash));
        }
        if chunk.codec == Codec::None && chunk.data_hash.is_some() {
            // Hashed as it was copied: a comparison, no work for the blocking pool.
            let verified = verify_payload(hash, &chunk);
            return Ok((chunk, verified?));
        }
        let _budget = match chunk.codec {
            Codec::None => None,
            // verify_payload refuses lengths beyond MAX_PAYLOAD_BYTES before decoding.
            _ => Some(
                Arc::clone(&self.decode_budget)
                    .acquire_many_owned(
                        chunk.length.clamp(1, u64::from(starckpt_proto::frame::MAX_PAYLOAD_BYTES)) as u32
                    )
                    .await
                    .map_err(|_| ChunkStoreError::Io {
                        op: "verify",
                        path: self.root.clone(),
                        source: io::Error::other("closed"),
                    })?,
            ),
        };
        let (chunk, verified) = tokio::task::spawn_blocking(move || {
            let verified = verify_payload(hash, &chunk);
            (chunk, verified)
        })
        .await
        .map_err(|e| ChunkStoreError::Io {
            op: "verify",
            path: self.root.clone(),
            source: io::Error::other(e),
        })?;
        Ok((chunk, verified?))
    }

    /// `put`, or with `replacing: Some(inode)`, a put that atomically replaces the file at the
    /// chunk's path if it is still that inode (a copy found bad): the path never lacks a copy.
    async fn store_copy(
        &self,
        name: &ChunkName,
        mut chunk: ChunkWrite,
        stored_hash: ChunkHash,
        replacing: Option<u64>,
    ) -> Result<PutOutcome, ChunkStoreError> {
        let hash = name.address;
        let final_path = self.chunk_path(&hash);
        if replacing.is_none() && self.mark_used(vec![hash]).await? == [true] {
            // A concurrent put may have renamed it in but not yet made the rename durable.
            self.sync_chunk_dirs([hash]).await?;
            return Ok(PutOutcome::AlreadyPresent);
        }
        let data_len = chunk.data_len;
        let (codec, length) = (chunk.codec, chunk.length);
        encode_header(
            &mut chunk.buf.aligned_mut().full_mut()[..HEADER_BYTES],
            &StoredHeader { codec, stored_len: data_len as u64, length, stored_hash, keyed: name.content != hash },
            &hash,
        );
        let held = chunk.held_len();
        let placed = chunk.placed.take();
        chunk.buf.aligned_mut().set_len(HEADER_BYTES + held);
        let file_bytes = round_up(HEADER_BYTES + data_len) as u64;
        let reused = self.free.take(file_bytes);
        // Refuse before the device is truly full: a full filesystem fails its own metadata
        // writes (renames, directory syncs), and the writer should go to another target now.
        // Free files are given up first; a reused one needs no new space.
        let reserve = self.reserve_bytes.load(Ordering::Relaxed);
        if reused.is_none() && (reserve > 0 || self.free.bytes() > 0) {
            self.check_space(hash, file_bytes.saturating_add(reserve), reserve).await?;
        }

        let temp_path = match &reused {
            Some(free) => free.path().to_path_buf(),
            None => self.root.join("tmp").join(format!("{}.{}", hash.to_hex(), uuid::Uuid::new_v4().simple())),
        };
        let written = match starckpt_dataplane::faults::point("target.store.write") {
            Err(injected) => Err(injected),
            Ok(()) => match placed {
                // The header first, then the placed blocks, then the last partial block.
                Some((body, rehash)) => match starckpt_dataplane::faults::point("target.store.write_placed") {
                    Err(injected) => Err(injected),
                    Ok(()) => {
                        let create = reused.is_none();
                        let written =
                            self.engine.write_file_split(temp_path.clone(), create, chunk.buf, HEADER_BYTES, body);
                        written.await.map(|head| Some((head, rehash)))
                    }
                },
                None if reused.is_some() => {
                    self.engine.overwrite_file(temp_path.clone(), chunk.buf).await.map(|_| None)
                }
                None => self.engine.write_new_file(temp_path.clone(), chunk.buf).await.map(|_| None),
            },
        };
        let failed = match written {
            Ok(None) => None,
            Ok(Some((head, rehash))) => match verify_placed(name.content, head, held, rehash).await {
                Ok(()) => {
                    self.placed_writes.fetch_add(1, Ordering::Relaxed);
                    None
                }
                Err(error) => Some(error),
            },
            Err(source) if source.raw_os_error() == Some(libc::ENOSPC) => Some(ChunkStoreError::NoSpace { hash }),
            Err(source) => Some(ChunkStoreError::Io { op: "write", path: temp_path.clone(), source }),
        };
        if let Some(error) = failed {
            // A reused file that failed its write may sit on bad blocks: it is not kept.
            match reused {
                Some(free) => free.discard(),
                None => drop(tokio::fs::remove_file(&temp_path).await),
            }
            return Err(error);
        }
        // The rename and, when the chunk is already there, the refresh of its last use happen
        // under its use lock, so GC cannot unlink it between "exists" and "refreshed".
        let renamed = {
            let (from, to, locks) = (temp_path.clone(), final_path.clone(), self.use_locks.clone());
            tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::MetadataExt;
                starckpt_dataplane::faults::point("target.store.rename")?;
                let _guard = locks.lock(&hash);
                if let Some(inode) = replacing {
                    match std::fs::metadata(&to) {
                        // Still the bad copy: swap the good one in, in one rename.
                        Ok(meta) if meta.ino() == inode => {
                            return std::fs::rename(&from, &to).map(|()| Renamed::Replaced { old_bytes: meta.len() });
                        }
                        // Someone else replaced it already.
                        Ok(_) => return touch(&to).map(|_| Renamed::AlreadyPresent),
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(e),
                    }
                }
                match rename_noreplace(&from, &to) {
                    Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                        touch(&to).map(|_| Renamed::AlreadyPresent)
                    }
                    other => other.map(|()| Renamed::Stored),
                }
            })
            .await
            .map_err(|e| ChunkStoreError::Io {
                op: "rename",
                path: final_path.clone(),
                source: io::Error::other(e),
            })?
        };
        let replaced = match renamed {
            Ok(Renamed::Stored) => None,
            Ok(Renamed::Replaced { old_bytes }) => Some(old_bytes),
            Ok(Renamed::AlreadyPresent) => {
                match reused {
                    Some(free) => free.put_back(),
                    None => drop(tokio::fs::remove_file(&temp_path).await),
                }
                self.sync_chunk_dirs([hash]).await?;
                return Ok(PutOutcome::AlreadyPresent);
            }
            Err(source) => {
                match reused {
                    Some(free) => free.discard(),
                    None => drop(tokio::fs::remove_file(&temp_path).await),
                }
                return Err(ChunkStoreError::Io { op: "rename", path: final_path, source });
            }
        };
        // Renamed to its chunk name: no longer the free pool's.
        if let Some(free) = reused {
            free.used();
        }
        let dir = self.chunk_dir(&hash);
        let synced = match starckpt_dataplane::faults::point("target.store.sync_dir") {
            Ok(()) => self.engine.sync_dir(dir.clone()).await,
            Err(injected) => Err(injected),
        };
        if let Err(source) = synced {
            // Not acknowledged. The file stays: it is complete and its data synced, and a
            // concurrent HAS may already have reported it present (HAS syncs the directory itself
            // before saying so), so removing it here could pull it from under that writer.
            return Err(ChunkStoreError::Io { op: "fsync", path: dir, source });
        }
        match replaced {
            None => {
                self.chunk_count.fetch_add(1, Ordering::Relaxed);
                self.used_bytes.fetch_add(file_bytes, Ordering::Relaxed);
            }
            Some(old_bytes) => {
                self.used_bytes.fetch_add(file_bytes, Ordering::Relaxed);
                self.used_bytes.fetch_sub(old_bytes.min(self.used_bytes.load(Ordering::Relaxed)), Ordering::Relaxed);
            }
        }
        self.chunk_writes.fetch_add(1, Ordering::Relaxed);
        Ok(PutOutcome::Stored)
    }

    /// Fails with [`ChunkStoreError::Full`] unless `needed` bytes are available, unlinking free
    /// files first when they would make the difference.
    async fn check_space(&self, hash: ChunkHash, needed: u64, reserve: u64) -> Result<(), ChunkStoreError> {
        let (root, free) = (self.root.clone(), Arc::clone(&self.free));
        tokio::task::spawn_blocking(move || {
            let mut available = fs_available(&root).map_err(io_error("statvfs", &root))?;
            if available < needed && free.bytes() > 0 {
                let dir = free.dir().to_path_buf();
                free.release(needed - available).map_err(io_error("unlink", &dir))?;
                available = fs_available(&root).map_err(io_error("statvfs", &root))?;
            }
            if available < needed {
                return Err(ChunkStoreError::Full { hash, available, reserve });
            }
            Ok(())
        })
        .await
        .map_err(|e| ChunkStoreError::Io {
            op: "statvfs",
            path: self.root.clone(),
            source: io::Error::other(e),
        })?
    }

    /// Reads the stored copy of `hash` whole (outside the I/O buffer pool, which the caller may
    /// be holding a buffer of) and checks it: header, length and payload hash. NotFound if absent;
    /// an I/O error, or a header of a format this build does not know, is an error, never `Bad`
    /// (nothing may delete what it cannot judge).
    pub async fn check_copy(&self, hash: ChunkHash) -> Result<Copy, ChunkStoreError> {
        let path = self.chunk_path(&hash);
        tokio::task::spawn_blocking(move || judge_copy(&path, hash)).await.map_err(|e| ChunkStoreError::Io {
            op: "verify",
            path: self.chunk_path(&hash),
            source: io::Error::other(e),
        })?
    }

    /// Removes the copy of `hash` if it is still the file `inode` (one found bad) and still bad,
    /// judged again under the chunk's use lock: a good copy that replaced it meanwhile stays, even
    /// one written into the same inode (a chunk file reused from the free pool). Returns whether it
    /// removed it.
    pub async fn remove_copy_if(&self, hash: ChunkHash, inode: u64) -> Result<bool, ChunkStoreError> {
        let (path, locks) = (self.chunk_path(&hash), self.use_locks.clone());
        let removed = tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::MetadataExt;
            let _guard = locks.lock(&hash);
            let meta = match std::fs::metadata(&path) {
                Ok(meta) if meta.ino() == inode => meta,
                Ok(_) => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(io_error("unlink", &path)(e)),
            };
            match judge_copy(&path, hash) {
                Ok(Copy::Bad { inode: judged, .. }) if judged == inode => {}
                Ok(_) | Err(ChunkStoreError::NotFound { .. }) => return Ok(None),
                Err(error) => return Err(error),
            }
            starckpt_dataplane::faults::point("target.remove_bad")
                .and_then(|()| std::fs::remove_file(&path))
                .map(|()| Some(meta.len()))
                .map_err(io_error("unlink", &path))
        })
        .await
        .map_err(|e| ChunkStoreError::Io {
            op: "unlink",
            path: self.chunk_path(&hash),
            source: io::Error::other(e),
        })??;
        if let Some(bytes) = removed {
            self.chunk_count.fetch_sub(1, Ordering::Relaxed);
            self.used_bytes.fetch_sub(bytes.min(self.used_bytes.load(Ordering::Relaxed)), Ordering::Relaxed);
        }
        Ok(removed.is_some())
    }

    /// Read repair: stores `chunk` unless a copy of `hash` is present *and checks out*. A copy
    /// that fails (bit rot, a torn or truncated file) is replaced in one rename, so the path is
    /// never without a copy and a good copy someone else wrote meanwhile is kept.
    pub async fn repair(&self, hash: ChunkHash, chunk: ChunkWrite) -> Result<PutOutcome, ChunkStoreError> {
        self.repair_named(&ChunkName::plain(hash), chunk).await
    }

    /// [`ChunkStore::repair`] of a chunk named as [`ChunkStore::put_named`]'s.
    pub async fn repair_named(&self, name: &ChunkName, chunk: ChunkWrite) -> Result<PutOutcome, ChunkStoreError> {
        let hash = name.address;
        let (chunk, stored_hash) = self.verify(name.content, chunk).await?;
        match self.check_copy(hash).await {
            Ok(Copy::Good { .. }) => {
                self.mark_used(vec![hash]).await?;
                self.sync_chunk_dirs([hash]).await?;
                Ok(PutOutcome::AlreadyPresent)
            }
            Ok(Copy::Bad { inode, reason }) => {
                tracing::warn!(chunk = %hash, %reason, "replacing a corrupt copy (read repair)");
                self.store_copy(name, chunk, stored_hash, Some(inode)).await
            }
            Err(ChunkStoreError::NotFound { .. }) => self.store_copy(name, chunk, stored_hash, None).await,
            Err(other) => Err(other),
        }
    }

    /// Bytes a read of `hash` will buffer (its file size), for admission control; None if absent.
    pub async fn file_len(&self, hash: &ChunkHash) -> Option<u64> {
        tokio::fs::metadata(self.chunk_path(hash)).await.ok().map(|m| m.len())
    }

    /// Reads `length` bytes at `offset` of a chunk (`length` 0: to the end). The header is
    /// checked; the payload hash is verified by the reader end to end (the client), so the target
    /// does not hash every read a second time. A whole compressed chunk is returned as stored
    /// (the reader decodes it); a range of one is decoded here and returned plain.
    pub async fn get(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<ChunkRead, ChunkStoreError> {
        self.read(hash, offset, length, true).await
    }

    /// [`ChunkStore::get`]; with `encoded` false, a whole compressed chunk is decoded too (for a
    /// reader that does not decode).
    pub async fn read(
        &self,
        hash: ChunkHash,
        offset: u64,
        length: u64,
        encoded: bool,
    ) -> Result<ChunkRead, ChunkStoreError> {
        let path = self.chunk_path(&hash);
        let file_len = match tokio::fs::metadata(&path).await {
            Ok(meta) => meta.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ChunkStoreError::NotFound { hash }),
            Err(source) => return Err(ChunkStoreError::Io { op: "stat", path, source }),
        };
        let file_len = usize::try_from(file_len).unwrap_or(usize::MAX);
        if file_len < HEADER_BYTES || file_len > HEADER_BYTES + starckpt_proto::frame::MAX_PAYLOAD_BYTES as usize + 4096
        {
            return Err(ChunkStoreError::Corrupt { hash, reason: format!("file is {file_len} bytes") });
        }
        let buf = self.read_buffer(round_up(file_len));
        let buf = match self.engine.read_file(path.clone(), buf).await {
            Ok(buf) => buf,
            // Collected (or repaired) between the stat and the open.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ChunkStoreError::NotFound { hash }),
            Err(source) => return Err(ChunkStoreError::Io { op: "read", path, source }),
        };
        self.chunk_reads.fetch_add(1, Ordering::Relaxed);
        let read = buf.aligned().as_ref();
        let header = decode_header(read, &hash)?;
        let stored_len = header.stored_len;
        header.check_held(&hash, read.len() - HEADER_BYTES)?;
        let chunk_len = header.length;
        let end = if length == 0 { chunk_len } else { offset.saturating_add(length) };
        if offset > chunk_len || end > chunk_len || offset > end {
            return Err(ChunkStoreError::BadRange { hash, offset, length, chunk_len });
        }
        let stored = HEADER_BYTES..HEADER_BYTES + stored_len as usize;
        if header.codec == Codec::None {
            let range = HEADER_BYTES + offset as usize..HEADER_BYTES + end as usize;
            return Ok(ChunkRead { bytes: boxed_to_bytes(buf, range), codec: Codec::None, length: chunk_len });
        }
        if encoded && offset == 0 && end == chunk_len {
            return Ok(ChunkRead { bytes: boxed_to_bytes(buf, stored), codec: header.codec, length: chunk_len });
        }
        let _budget =
            Arc::clone(&self.decode_budget).acquire_many_owned(chunk_len.max(1) as u32).await.map_err(|_| {
                ChunkStoreError::Io { op: "decode", path: path.clone(), source: io::Error::other("closed") }
            })?;
        let codec = header.codec;
        let decoded = tokio::task::spawn_blocking(move || {
            let decoded = codec::decompress(codec, &buf.aligned().as_ref()[stored], chunk_len as usize)?;
            // Only the range is kept while the response waits to be written.
            starckpt_dataplane::buf::copies::record((end - offset) as usize);
            Ok::<_, codec::CodecError>(Bytes::copy_from_slice(&decoded[offset as usize..end as usize]))
        })
        .await
        .map_err(|e| ChunkStoreError::Io { op: "decode", path, source: io::Error::other(e) })?;
        let bytes = decoded.map_err(|e| ChunkStoreError::Corrupt { hash, reason: e.to_string() })?;
        Ok(ChunkRead { bytes, codec: Codec::None, length: chunk_len })
    }

    /// Reads a whole chunk from the device straight into `dest` (a client's shared-memory slot):
    /// the header into a small buffer of the store's, the stored bytes (as stored: compressed
    /// ones stay compressed) into `dest`, with no copy through the target's memory. Ok(None) when
    /// the chunk does not fit `dest` ([`ChunkStore::read`] serves it then). The header is checked
    /// as `read` checks it; the payload is verified by the reader, as with [`ChunkStore::get`].
    pub async fn read_placed(&self, hash: ChunkHash, dest: ExternalBuf) -> Result<Option<Placed>, ChunkStoreError> {
        let path = self.chunk_path(&hash);
        let room = dest.len() as u64;
        let head: BoxedBuf = Box::new(AlignedBuf::new(HEADER_BYTES));
        let (head, placed) = match self.engine.read_file_split(path.clone(), head, dest).await {
            Ok(read) => read,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ChunkStoreError::NotFound { hash }),
            Err(source) => return Err(ChunkStoreError::Io { op: "read", path, source }),
        };
        self.chunk_reads.fetch_add(1, Ordering::Relaxed);
        let header = decode_header(head.aligned().as_ref(), &hash)?;
        if header.stored_len > room {
            return Ok(None);
        }
        header.check_held(&hash, placed)?;
        self.placed_reads.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Placed { stored_len: header.stored_len, codec: header.codec, length: header.length }))
    }

    /// Which chunks are stored. A chunk reported present is durable: its directory is fsync'd
    /// first, because a concurrent put may have renamed it in without yet syncing the rename,
    /// and a writer that deduplicates against it will commit a checkpoint naming it.
    /// A chunk reported present has had its last use refreshed (module docs), so GC keeps it.
    pub async fn has(&self, hashes: Vec<ChunkHash>) -> Result<Vec<bool>, ChunkStoreError> {
        let present = self.mark_used(hashes.clone()).await?;
        self.sync_chunk_dirs(hashes.iter().zip(&present).filter(|(_, p)| **p).map(|(h, _)| *h)).await?;
        Ok(present)
    }

    /// Which chunks are stored, and nothing more (an audit's question, OP_HAS `existence_only`):
    /// no directory fsync and no last-use refresh, unlike [`ChunkStore::has`].
    pub async fn stored(&self, hashes: Vec<ChunkHash>) -> Result<Vec<bool>, ChunkStoreError> {
        let paths: Vec<PathBuf> = hashes.iter().map(|h| self.chunk_path(h)).collect();
        let root = self.root.clone();
        tokio::task::spawn_blocking(move || {
            paths.iter().map(|path| path.try_exists().map_err(io_error("stat", path))).collect()
        })
        .await
        .map_err(|e| ChunkStoreError::Io { op: "stat", path: root, source: io::Error::other(e) })?
    }

    /// Sets each present chunk's last use to now, under its use lock; false for absent ones.
    async fn mark_used(&self, hashes: Vec<ChunkHash>) -> Result<Vec<bool>, ChunkStoreError> {
        let paths: Vec<PathBuf> = hashes.iter().map(|h| self.chunk_path(h)).collect();
        let (root, locks) = (self.root.clone(), self.use_locks.clone());
        tokio::task::spawn_blocking(move || {
            hashes
                .iter()
                .zip(&paths)
                .map(|(hash, path)| {
                    let _guard = locks.lock(hash);
                    touch(path).map_err(io_error("touch", path))
                })
                .collect::<Result<Vec<bool>, ChunkStoreError>>()
        })
        .await
        .map_err(|e| ChunkStoreError::Io { op: "touch", path: root, source: io::Error::other(e) })?
    }

    /// One page of stored chunks in ascending hash order, starting after `after`, at most `limit`
    /// long; the flag is true when no chunks follow (false: there may be more). Fails on the
    /// first part of the store it cannot read: a listing others act on (GC, re-replication) is
    /// whole or nothing.
    pub async fn list(
        &self,
        after: Option<ChunkHash>,
        limit: usize,
    ) -> Result<(Vec<ListedChunk>, bool), ChunkStoreError> {
        let (page, complete, _) = self.list_pages(after, limit, false).await?;
        Ok((page, complete))
    }

    /// [`ChunkStore::list`] past what cannot be read: a fan-out directory that cannot be listed,
    /// or a chunk file that cannot be stat'ed, is left out and its error returned beside the page,
    /// so a caller that goes through every chunk (the scrubber) gets past a bad spot instead of
    /// stopping there pass after pass.
    pub async fn list_past_unreadable(
        &self,
        after: Option<ChunkHash>,
        limit: usize,
    ) -> Result<(Vec<ListedChunk>, bool, Vec<ChunkStoreError>), ChunkStoreError> {
        self.list_pages(after, limit, true).await
    }

    async fn list_pages(
        &self,
        after: Option<ChunkHash>,
        limit: usize,
        skip_unreadable: bool,
    ) -> Result<(Vec<ListedChunk>, bool, Vec<ChunkStoreError>), ChunkStoreError> {
        let (chunks, clock) = (self.root.join("chunks"), Arc::clone(&self.clock));
        tokio::task::spawn_blocking(move || {
            let mut unreadable = Vec::new();
            let mut skip = |error| {
                if !skip_unreadable {
                    return Err(error);
                }
                unreadable.push(error);
                Ok(())
            };
            let (page, complete) = list_chunks(&chunks, &clock, after, limit, &mut skip)?;
            Ok((page, complete, unreadable))
        })
        .await
        .map_err(|e| ChunkStoreError::Io { op: "list", path: PathBuf::new(), source: io::Error::other(e) })?
    }

    /// fsyncs the fan-out directories holding `hashes`, each once.
    async fn sync_chunk_dirs(&self, hashes: impl IntoIterator<Item = ChunkHash>) -> Result<(), ChunkStoreError> {
        let dirs: std::collections::BTreeSet<PathBuf> = hashes.into_iter().map(|h| self.chunk_dir(&h)).collect();
        for dir in dirs {
            self.engine.sync_dir(dir.clone()).await.map_err(io_error("fsync", &dir))?;
        }
        Ok(())
    }

    /// Deletes chunks; missing ones are skipped. With `unused_for`, only chunks whose last use is
    /// at least that long ago (GC's guard, module docs). Returns how many were removed.
    pub async fn delete(&self, hashes: Vec<ChunkHash>, unused_for: Option<Duration>) -> Result<u64, ChunkStoreError> {
        let paths: Vec<PathBuf> = hashes.iter().map(|h| self.chunk_path(h)).collect();
        let (root, locks, clock) = (self.root.clone(), self.use_locks.clone(), Arc::clone(&self.clock));
        let free = Arc::clone(&self.free);
        // Stops at the first error, but what it removed before is still counted and synced.
        let (removed, failed) = tokio::task::spawn_blocking(move || {
            let mut removed: Vec<(ChunkHash, u64)> = Vec::new();
            for (hash, path) in hashes.iter().zip(&paths) {
                let _guard = locks.lock(hash);
                let meta = match std::fs::metadata(path) {
                    Ok(meta) => meta,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(source) => {
                        return (removed, Some(ChunkStoreError::Io { op: "stat", path: path.clone(), source }));
                    }
                };
                if let Some(unused_for) = unused_for {
                    match meta.modified() {
                        Ok(last_use) if clock.unused_for(last_use) < unused_for => continue,
                        Ok(_) => {}
                        Err(source) => {
                            return (removed, Some(ChunkStoreError::Io { op: "stat", path: path.clone(), source }));
                        }
                    }
                }
                // Kept for reuse when the pool has room (`freepool.rs`), unlinked otherwise.
                let unlinked = starckpt_dataplane::faults::point("target.delete.unlink").and_then(|()| {
                    match free.recycle(path, meta.len())? {
                        true => Ok(()),
                        false => std::fs::remove_file(path),
                    }
                });
                match unlinked {
                    Ok(()) => removed.push((*hash, meta.len())),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(source) => {
                        return (removed, Some(ChunkStoreError::Io { op: "unlink", path: path.clone(), source }));
                    }
                }
            }
            (removed, None)
        })
        .await
        .map_err(|e| ChunkStoreError::Io { op: "unlink", path: root, source: io::Error::other(e) })?;
        for (_, len) in &removed {
            self.chunk_count.fetch_sub(1, Ordering::Relaxed);
            self.used_bytes.fetch_sub(*len, Ordering::Relaxed);
        }
        let count = removed.len() as u64;
        self.sync_chunk_dirs(removed.into_iter().map(|(hash, _)| hash)).await?;
        match failed {
            Some(error) => Err(error),
            None => Ok(count),
        }
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

fn statvfs(path: &Path) -> io::Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is NUL-terminated and stat is a valid out-pointer.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat)
}

/// Total bytes of the filesystem holding `path`.
fn fs_capacity(path: &Path) -> io::Result<u64> {
    statvfs(path).map(|stat| stat.f_blocks * stat.f_frsize)
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
pub(crate) fn fs_available(path: &Path) -> io::Result<u64> {
    statvfs(path).map(|stat| stat.f_bavail * stat.f_frsize)
}

fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let from = std::ffi::CString::new(from.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let to = std::ffi::CString::new(to.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: both paths are NUL-terminated C strings that outlive the call.
    let rc =
        unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_NOREPLACE) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Sets a file's mtime to now; false if it does not exist.
fn touch(path: &Path) -> io::Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let now = libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW };
    let times = [now, now];
    // SAFETY: c_path is NUL-terminated and times points at two timespecs, as utimensat requires.
    if unsafe { libc::utimensat(libc::AT_FDCWD, c_path.as_ptr(), times.as_ptr(), 0) } == 0 {
        return Ok(true);
    }
    let error = io::Error::last_os_error();
    if error.kind() == io::ErrorKind::NotFound { Ok(false) } else { Err(error) }
}

/// Creates the layout, clears `tmp/`, and counts chunks and their bytes.
fn prepare_dir(root: &Path) -> Result<(u64, u64), ChunkStoreError> {
    let chunks = root.join("chunks");
    let tmp = root.join("tmp");
    for dir in [root, &chunks, &tmp] {
        std::fs::create_dir_all(dir).map_err(io_error("mkdir", dir))?;
    }
    for entry in std::fs::read_dir(&tmp).map_err(io_error("list", &tmp))? {
        let path = entry.map_err(io_error("list", &tmp))?.path();
        std::fs::remove_file(&path).map_err(io_error("unlink", &path))?;
    }
    let (mut count, mut used) = (0u64, 0u64);
    for byte in 0..=255u8 {
        let dir = chunks.join(format!("{byte:02x}"));
        std::fs::create_dir_all(&dir).map_err(io_error("mkdir", &dir))?;
        // Renames out of it that a killed delete did not sync are made durable before the free
        // pool reuses their files (`FreePool::open`).
        std::fs::File::open(&dir).and_then(|d| d.sync_all()).map_err(io_error("fsync", &dir))?;
        for entry in std::fs::read_dir(&dir).map_err(io_error("list", &dir))? {
            let entry = entry.map_err(io_error("list", &dir))?;
            count += 1;
            used += entry.metadata().map_err(io_error("stat", &entry.path()))?.len();
        }
    }
    Ok((count, used))
}

/// The first 8 bytes of BLAKE3(`bytes`): the header's checksums (module docs).
fn sum8(bytes: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&blake3::hash(bytes).as_bytes()[..8]);
    out
}

fn header_sum(header: &[u8]) -> [u8; 8] {
    sum8(&header[..64])
}

/// What a chunk file's header says about the bytes after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StoredHeader {
    codec: Codec,
    stored_len: u64,
    /// The chunk's length once decoded.
    length: u64,
    /// BLAKE3 of the stored bytes (the content hash for an uncompressed chunk).
    stored_hash: ChunkHash,
    /// The chunk is a tenant's: its address is not its content hash.
    keyed: bool,
}

impl StoredHeader {
    /// Checks that the `held` bytes read after the header hold the stored bytes it names.
    fn check_held(&self, hash: &ChunkHash, held: usize) -> Result<(), ChunkStoreError> {
        if self.stored_len > held as u64 {
            let reason = format!("header says {} bytes, file holds {held}", self.stored_len);
            return Err(ChunkStoreError::Corrupt { hash: *hash, reason });
        }
        Ok(())
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

fn encode_header(header: &mut [u8], fields: &StoredHeader, hash: &ChunkHash) {
    let version = match (fields.keyed, fields.codec) {
        (true, _) => FORMAT_VERSION_KEYED,
        (false, Codec::None) => FORMAT_VERSION,
        (false, _) => FORMAT_VERSION_STORED_HASH,
    };
    header.fill(0);
    header[0..8].copy_from_slice(MAGIC);
    header[8..10].copy_from_slice(&version.to_le_bytes());
    header[10] = fields.codec.to_wire() as u8;
    header[16..24].copy_from_slice(&fields.stored_len.to_le_bytes());
    header[24..32].copy_from_slice(&fields.length.to_le_bytes());
    header[32..64].copy_from_slice(&hash.0);
    if version != FORMAT_VERSION {
        header[72..104].copy_from_slice(&fields.stored_hash.0);
        let extension = sum8(&header[72..104]);
        header[104..112].copy_from_slice(&extension);
    }
    let sum = header_sum(header);
    header[64..72].copy_from_slice(&sum);
}

/// Checks a chunk file's header and returns what it says.
fn decode_header(file: &[u8], hash: &ChunkHash) -> Result<StoredHeader, ChunkStoreError> {
    let corrupt = |reason: &str| Err(ChunkStoreError::Corrupt { hash: *hash, reason: reason.to_owned() });
    if file.len() < HEADER_BYTES {
        return corrupt("shorter than its header");
    }
    if &file[0..8] != MAGIC {
        return corrupt("bad magic");
    }
    let version = u16::from_le_bytes([file[8], file[9]]);
    if file[64..72] != header_sum(file) {
        return corrupt("header checksum mismatch");
    }
    if !FORMAT_VERSIONS.contains(&version) {
        return corrupt("unknown format version");
    }
    if version != FORMAT_VERSION && file[104..112] != sum8(&file[72..104]) {
        return corrupt("header extension checksum mismatch");
    }
    if file[32..64] != hash.0 {
        return corrupt("header names a different chunk");
    }
    let word = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().expect("8 bytes"));
    let (stored_len, length) = (word(16), word(24));
    let codec = match Codec::from_wire(i32::from(file[10])) {
        Ok(codec) if version == FORMAT_VERSION_KEYED || (codec == Codec::None) == (version == FORMAT_VERSION) => codec,
        _ => return corrupt("codec does not match the format version"),
    };
    if codec == Codec::None && stored_len != length {
        return corrupt("an uncompressed chunk's lengths differ");
    }
    if length > u64::from(starckpt_proto::frame::MAX_PAYLOAD_BYTES) {
        return corrupt("length out of range");
    }
    let stored_hash = if version == FORMAT_VERSION {
        *hash
    } else {
        ChunkHash::try_from(&file[72..104])
            .map_err(|e| ChunkStoreError::Corrupt { hash: *hash, reason: e.to_string() })?
    };
    Ok(StoredHeader { codec, stored_len, length, stored_hash, keyed: version == FORMAT_VERSION_KEYED })
}

mod listing;
use listing::list_chunks;

#[cfg(test)]
mod conformance;
