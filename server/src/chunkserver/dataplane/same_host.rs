//! Same-host clients: the shared-memory regions they attach (`starckpt_dataplane::shm`), whose
//! memory the target may read and write in place, and which peers are trusted to have chunks
//! written straight from their staging memory.

use std::sync::Arc;

use starckpt_dataplane::buf::ALIGN;
use starckpt_dataplane::shm::{self, Attach, Region, StagingFile};
use starckpt_proto::ChunkHash;
use starckpt_proto::capability::Rights;
use starckpt_proto::codec::Codec;
use starckpt_proto::data;
use starckpt_proto::frame::{self};
use tokio::net::UnixListener;
use tracing::{debug, info};

use crate::chunkserver::engine::ExternalBuf;
use crate::chunkserver::store::{ChunkStore, ChunkStoreError};

use super::Served;
use super::requests::{check_auth, check_capability, store_error};

/// A Unix socket on which same-host clients attach shared memory ([`starckpt_dataplane::shm`]).
pub struct ShmListener {
    pub listener: UnixListener,
    /// Its path, as advertised to clients in STAT responses.
    pub path: std::path::PathBuf,
    /// Whether whole-chunk GETs are read from the device straight into the client's slot (no
    /// copy here) rather than read into the target's buffer and copied there. None: where
    /// shared memory gets transparent huge pages (`shm::shared_huge_pages`). Into 4 KiB shared
    /// pages a read is one segment per page, and the virtual disks this was measured on serve
    /// that far slower than the copy costs (restore 1.5-1.7x the O_DIRECT read, against 1.2-1.3x
    /// with the copy and 1.16-1.18x placed into huge pages; docs/performance.md).
    pub placed_reads: Option<bool>,
    /// Whether a PUT of a staged chunk from a client running as this target's user (or as root)
    /// is written to the device straight from the client's staging memory (no copy; the client
    /// could rewrite the chunk files anyway, `starckpt_dataplane::shm`'s docs) rather than copied
    /// out of it first. Default true. Other clients' chunks are always copied.
    pub placed_writes: bool,
}

impl ShmListener {
    pub fn new(listener: UnixListener, path: std::path::PathBuf) -> ShmListener {
        ShmListener { listener, path, placed_reads: None, placed_writes: true }
    }
}

/// A region a client shared, split into slots, and its staging memory if it shared that too.
pub(super) struct Slots {
    pub(super) region: Region,
    pub(super) attach: Attach,
    /// The client's staging region, read with `pread` (`shm::StagingFile`).
    pub(super) staging: Option<StagingFile>,
    /// The staging region mapped read-only, when the client is trusted with placed writes
    /// ([`ShmListener::placed_writes`]).
    pub(super) staging_mapped: Option<Arc<Region>>,
    /// A placed write on this connection failed to reach the device: its chunks are copied from
    /// then on (the device or filesystem may refuse to write from the client's memory where it
    /// writes from the target's).
    pub(super) placed_failed: std::sync::atomic::AtomicBool,
    /// Whole-chunk GETs are read from the device straight into their slot ([`get_placed`]).
    pub(super) placed_reads: bool,
    /// Its share of [`DataPlaneLimits::max_shm_region_bytes`], held while it is mapped.
    pub(super) _room: tokio::sync::OwnedSemaphorePermit,
}

/// The unit [`DataPlaneLimits::max_shm_region_bytes`] is counted in.
pub(super) const SHM_PAGE: usize = 4096;

impl Slots {
    /// The byte offset of 1-based slot `slot` if `len` bytes fit in it.
    pub(super) fn offset(&self, slot: u32, len: u64) -> Result<usize, String> {
        if slot == 0 || slot > self.attach.slots {
            return Err(format!("slot {slot} is outside 1..={}", self.attach.slots));
        }
        if len > u64::from(self.attach.slot_bytes) {
            return Err(format!("{len} bytes do not fit a slot of {}", self.attach.slot_bytes));
        }
        Ok((slot - 1) as usize * self.attach.slot_bytes as usize)
    }

    /// Whether a staged chunk of `len` bytes at `offset` is written from where it lies: the
    /// client is trusted with it, the payload is stored as sent (the store decodes only its own
    /// memory), and it holds whole blocks from an aligned offset (O_DIRECT).
    pub(super) fn placeable(&self, offset: usize, len: usize, codec: i32) -> bool {
        self.staging_mapped.is_some()
            && !self.placed_failed.load(std::sync::atomic::Ordering::Relaxed)
            && codec == Codec::None.to_wire()
            && offset.is_multiple_of(ALIGN)
            && len >= ALIGN
    }

    /// A chunk whose whole blocks are `len` bytes at `offset` of the mapped staging region
    /// ([`ChunkStore::placed_write`]); None if the region is not mapped (or the range is unfit).
    pub(super) fn placed(&self, offset: usize, len: usize) -> Option<crate::chunkserver::store::ChunkWrite> {
        let mapped = self.staging_mapped.as_ref()?;
        let body = len - len % ALIGN;
        if offset.checked_add(len)? > mapped.len() {
            return None;
        }
        let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(mapped) as _;
        // SAFETY: within the mapping (checked), which `owner` keeps mapped; nothing here makes
        // Rust references to it while the device reads it.
        let blocks = unsafe { ExternalBuf::new(mapped.base().add(offset), body, owner) }.ok()?;
        let hashed = Arc::clone(mapped);
        ChunkStore::placed_write(len, blocks, Box::new(move || hashed.hash_in_place(offset, body))).ok()
    }

    /// `range` of the staging region as (offset, length), if it lies within it and is no larger
    /// than a payload may be.
    pub(super) fn staged(&self, range: &data::StagingRange) -> Result<(usize, usize), String> {
        let Some(staging) = &self.staging else {
            return Err("a staging range named on a connection without a staging region".into());
        };
        if range.length == 0 || range.length > u64::from(frame::MAX_PAYLOAD_BYTES) {
            return Err(format!("a staging range of {} bytes", range.length));
        }
        match range.offset.checked_add(range.length) {
            Some(end) if end <= staging.len() => Ok((range.offset as usize, range.length as usize)),
            _ => Err(format!(
                "{} bytes at {} are outside the {}-byte staging region",
                range.length,
                range.offset,
                staging.len()
            )),
        }
    }
}

/// The shared-memory handshake: the client's region, mapped, or why not.
pub(super) async fn attach(stream: &tokio::net::UnixStream, served: &Served) -> std::io::Result<Arc<Slots>> {
    let (placed_reads, placed_writes) = (served.placed_reads, served.placed_writes);
    let attached = shm::recv_attach(stream).await?;
    let attach = attached.attach;
    // Before anything is mapped or counted against the shared budget.
    if let Err(refused) = check_capability(served, &attached.capability, Rights::READ) {
        // Best effort, as for busy: a closed connection is a refusal too.
        let _ = write_all_unix(stream, shm::ATTACH_UNAUTHORIZED).await;
        return Err(std::io::Error::other(format!("an attach without a capability it accepts: {refused}")));
    }
    if attach.region_bytes() as u64 > served.limits.max_shm_region_bytes {
        // Never room for it: refused (the connection closed), not busy.
        return Err(std::io::Error::other(format!(
            "a region of {} bytes exceeds max_shm_region_bytes",
            attach.region_bytes()
        )));
    }
    let pages = u32::try_from(attach.region_bytes().div_ceil(SHM_PAGE)).unwrap_or(u32::MAX);
    let Ok(room) = Arc::clone(&served.shm_regions).try_acquire_many_owned(pages) else {
        // Best effort: the client reads a closed connection as a refusal, and goes over TCP too.
        let _ = write_all_unix(stream, shm::ATTACH_BUSY).await;
        return Err(std::io::Error::other(format!(
            "no room for another {} bytes of slots (max_shm_region_bytes)",
            attach.region_bytes()
        )));
    };
    let region = Region::attach(attached.slots, attach.region_bytes())?;
    let staging = match attached.staging {
        Some(fd) => Some(StagingFile::attach(fd, attach.staging_bytes)?),
        None => None,
    };
    let staging_mapped = match &staging {
        Some(staging) if placed_writes && trusted_peer(stream) => match staging.map() {
            Ok(mapped) => Some(Arc::new(mapped)),
            Err(error) => {
                info!(%error, "could not map a client's staging region; its chunks are copied out of it");
                None
            }
        },
        _ => None,
    };
    write_all_unix(stream, shm::ATTACH_OK).await?;
    debug!(
        slots = attach.slots,
        slot_bytes = attach.slot_bytes,
        staging_bytes = attach.staging_bytes,
        "shared-memory client attached"
    );
    let placed_failed = std::sync::atomic::AtomicBool::new(false);
    let slots = Arc::new(Slots { region, attach, staging, staging_mapped, placed_failed, placed_reads, _room: room });
    if placed_reads {
        // Huge pages for the slots where this mapping faults them in first (the device's reads):
        // a read into them is a few contiguous segments rather than one per 4 KiB page. And
        // faulted in now, off the runtime, rather than by the first read into each slot on the
        // ring's thread (which would stall every other client's I/O meanwhile). The memory is
        // the client's region, which it sized (within the attach's limits).
        let mapped = Arc::clone(&slots);
        let populated = tokio::task::spawn_blocking(move || {
            let (at, len) = (mapped.region.base().cast::<libc::c_void>(), mapped.region.len());
            // SAFETY: advice on exactly this mapping, which `mapped` keeps mapped.
            unsafe {
                libc::madvise(at, len, libc::MADV_HUGEPAGE);
                libc::madvise(at, len, libc::MADV_POPULATE_WRITE)
            }
        })
        .await;
        if !matches!(populated, Ok(0)) {
            debug!("could not fault the client's slots in at attach; the first reads into them will");
        }
    }
    Ok(slots)
}

/// Writes all of `bytes` to `stream` (which is still whole: not split into halves yet).
async fn write_all_unix(stream: &tokio::net::UnixStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        stream.writable().await?;
        match stream.try_write(&bytes[written..]) {
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether the process at the other end of `stream` could rewrite this target's chunk files
/// itself, so its staged chunks need no protective copy ([`ShmListener::placed_writes`]): it runs
/// as this one's effective user or as root, and sees the same files (same mount namespace; a
/// container's root does not, and may not write them).
fn trusted_peer(stream: &tokio::net::UnixStream) -> bool {
    let Ok(peer) = stream.peer_cred() else { return false };
    // SAFETY: geteuid cannot fail and touches no memory.
    let own = unsafe { libc::geteuid() };
    // A peer in a pid namespace this one cannot see has no pid here (None, or 0).
    let peer_pid = peer.pid().filter(|&pid| pid > 0);
    trusted_uid(peer.uid(), own) && peer_pid.is_some_and(|pid| same_mount_namespace(pid as u32))
}

/// A peer running as `peer` may write the files of a target running as `own`.
fn trusted_uid(peer: u32, own: u32) -> bool {
    peer == 0 || peer == own
}

/// Whether process `pid` sees the files this one sees. Not told (gone, or its namespace hidden
/// from this process): no.
fn same_mount_namespace(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let namespace = |path: &str| std::fs::metadata(path).map(|m| (m.dev(), m.ino())).ok();
    namespace("/proc/self/ns/mnt").is_some_and(|own| namespace(&format!("/proc/{pid}/ns/mnt")) == Some(own))
}
/// A whole-chunk GET from a client on this host, read from the device straight into the slot it
/// named: no copy on the target, and no bytes held here (so nothing charged to the in-flight
/// budget). None when the GET takes the ordinary path: a range, a request that path answers with
/// an error, a chunk larger than the slot, a compressed one the client does not decode, or an I/O
/// error (the device may refuse to read into the client's memory where it reads into the
/// target's: a memory limit on pinning it, a filesystem without O_DIRECT into shared memory).
pub(super) async fn get_placed(
    served: &Served,
    slots: &Arc<Slots>,
    request: &data::GetRequest,
) -> Option<data::Response> {
    let store = &served.store;
    if request.offset != 0 || request.length != 0 || check_auth(served, &request.auth, Rights::READ).is_err() {
        return None;
    }
    let hash = ChunkHash::try_from(&request.hash[..]).ok()?;
    let offset = slots.offset(request.shm_slot, 0).ok()?;
    let len = slots.attach.slot_bytes as usize;
    if offset.checked_add(len)? > slots.region.len() {
        return None;
    }
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(slots) as _;
    // SAFETY: the slot lies within the mapping (checked); `owner` keeps the mapping (its `Slots`)
    // alive until the engine drops the buffer, and the region is only ever accessed by raw copies.
    let dest = unsafe { ExternalBuf::new(slots.region.base().add(offset), len, owner) }.ok()?;
    match store.read_placed(hash, dest).await {
        Ok(Some(placed)) if placed.codec == Codec::None || request.accept_encoded => Some(data::Response {
            chunk_length_bytes: placed.length,
            codec: placed.codec.to_wire(),
            shm_length: placed.stored_len,
            ..Default::default()
        }),
        Ok(_) => None,
        Err(error @ ChunkStoreError::Io { .. }) => {
            debug!(%error, "a GET read into the client's slot failed; reading it into the target's buffer");
            None
        }
        Err(error) => Some(store_error(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_peers_that_could_write_the_chunk_files_are_trusted_with_placed_writes() {
        assert!(trusted_uid(1000, 1000) && trusted_uid(0, 1000) && trusted_uid(0, 0));
        assert!(!trusted_uid(1001, 1000) && !trusted_uid(1000, 0) && !trusted_uid(65534, 0));
        // Read from the socket: a peer of this process is this process's user.
        let (ours, _theirs) = tokio::net::UnixStream::pair().unwrap();
        assert!(trusted_peer(&ours));
    }

    /// A peer of the same user in a mount namespace of its own (a container's root) does not see
    /// this target's files: its staged chunks are copied.
    #[tokio::test]
    async fn a_peer_in_another_mount_namespace_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        // unshare(1) needs CAP_SYS_ADMIN: the test runs as root (as CI does) or not at all.
        // SAFETY: geteuid cannot fail and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root for unshare -m");
            return;
        }
        let connect = |isolated: bool| {
            let script = format!(
                "import socket, time\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\ntime.sleep(30)",
                path.to_str().unwrap()
            );
            let mut command = std::process::Command::new(if isolated { "unshare" } else { "python3" });
            if isolated {
                command.args(["-m", "--", "python3"]);
            }
            command.args(["-c", &script]).spawn().unwrap()
        };
        for isolated in [false, true] {
            let mut peer = connect(isolated);
            let (stream, _) =
                tokio::time::timeout(std::time::Duration::from_secs(30), listener.accept()).await.unwrap().unwrap();
            let trusted = trusted_peer(&stream);
            let _ = peer.kill();
            let _ = peer.wait();
            assert_eq!(trusted, !isolated, "isolated: {isolated}");
        }
    }
}
