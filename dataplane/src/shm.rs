//! Same-host shared memory for the data plane: a sealed memfd that a client maps and passes to a
//! target over a Unix socket, so chunk payloads are handed over in memory instead of being copied
//! through socket buffers (the idea of 3FS's USRBIO).
//!
//! ## Attach handshake (on a fresh Unix-socket connection, before any frame)
//!
//! ```text
//!  client ──► "SCKSHM03" | slots u32 LE | slot bytes u32 LE | staging bytes u64 LE | capability
//!             (the rest of the message, at most 256 bytes), with the slot memfd and, when
//!             staging bytes > 0, the staging memfd (SCM_RIGHTS)
//!  target ──► 8 bytes: "SCKSHMOK" (then frames as on TCP), "SCKSHMBZ" (no room now), "SCKSHMNO"
//!             (the capability does not let it in), or it closes the connection
//! ```
//!
//! A client without a capability (its cluster has no key) sends the older messages, which
//! targets without a key accept too: version 2, 24 bytes ("SCKSHM02" | slots | slot bytes |
//! staging bytes), or, without a staging region, version 1, 16 bytes ("SCKSHM01" | slots | slot
//! bytes, one memfd). A target whose cluster has a key admits an attach only with a capability
//! granting READ (as for CONNECT, `capability.rs`): the regions it maps count against its
//! `max_shm_region_bytes`, which a local process without one must not be able to use up. The
//! frames that follow carry their own capabilities, checked as on TCP.
//!
//! The slot region is `slots × slot bytes`, split into slots of `slot bytes` each (a multiple of
//! 4096). A frame names a slot (1-based; 0 means "payload inline, as on TCP") and a length: a
//! PUT's payload lies in its slot; a GET's response is written into the slot its request named.
//!
//! The staging region is the client's staging memory itself (`buf::BufPool::shared`): the
//! buffers a save copies the caller's bytes into. A PUT may name a range of it (offset, length),
//! so a staged chunk reaches the target without being copied into a slot first. The target does
//! not map it: it reads the named range with `pread` ([`StagingFile`]), so a client cannot make it
//! spend address space or memory on a large sparse file (reading a hole yields zeros without
//! allocating), and the client seals it against writes by anyone but its own mapping
//! (`F_SEAL_FUTURE_WRITE`), so a target cannot change staged bytes before the client hashes them.
//!
//! Except for a client the target trusts with its chunks anyway: one running as the target's
//! user (or as root) could rewrite the chunk files themselves. For it the target maps the staging
//! region read-only ([`StagingFile::map`]) and writes a staged chunk to its device straight from
//! there, then hashes it in place ([`Region::hash_in_place`]) before storing it under its name:
//! no copy. Changes the client made before or while the device read the bytes show in that hash
//! (its SDK refills a staging buffer whose PUT it gave up on); what the client could do beyond
//! that to its staging memory mid-write it could do to the chunk files themselves.
//!
//! ## Why a target can trust the mapping
//!
//! The client creates the memfd with sealing allowed and seals it against shrinking and growing
//! before sending it; [`Region::attach`] refuses a descriptor without those seals or smaller than
//! it claims. Without the seals, a client truncating the file would make the target's next access
//! fault with SIGBUS. The client can still write the slot while the target reads it: the target
//! copies the payload into its own buffer first and verifies the hash of that copy, so a torn read
//! is a hash mismatch, never stored data.

use std::io;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// An attach with a capability (version 3).
pub const ATTACH_MAGIC_V3: &[u8; 8] = b"SCKSHM03";
/// An attach without one, with a staging region (version 2).
pub const ATTACH_MAGIC: &[u8; 8] = b"SCKSHM02";
/// The first version's magic: slots only, no staging region.
pub const ATTACH_MAGIC_V1: &[u8; 8] = b"SCKSHM01";
pub const ATTACH_OK: &[u8; 8] = b"SCKSHMOK";
/// The target's answer to an attach it has no room for now (it shares as much memory as it
/// allows): the client goes over TCP meanwhile and asks again later.
pub const ATTACH_BUSY: &[u8; 8] = b"SCKSHMBZ";
/// The target's answer to an attach whose capability it does not accept (missing, forged,
/// expired, for another target): the client renews its capability and goes over TCP meanwhile.
pub const ATTACH_UNAUTHORIZED: &[u8; 8] = b"SCKSHMNO";
/// An attach message without its capability (version 2 or 3).
pub const ATTACH_BYTES: usize = 24;
/// Longest capability an attach may carry.
pub const MAX_ATTACH_CAPABILITY_BYTES: usize = 256;
const ATTACH_BYTES_V1: usize = 16;
/// Most slots one connection may share.
pub const MAX_SLOTS: u32 = 256;
/// Largest slot region one connection may share (the target maps it; the memory is the client's).
pub const MAX_REGION_BYTES: usize = 1 << 30;
/// Largest staging region a client may share. The target reads it with `pread` (it maps
/// nothing), so this bounds only what PUT offsets may name.
pub const MAX_STAGING_BYTES: u64 = 1 << 40;

/// The geometry a client proposes when attaching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attach {
    pub slots: u32,
    pub slot_bytes: u32,
    /// Bytes of the staging region sent with the slots (0: none).
    pub staging_bytes: u64,
}

impl Attach {
    pub fn region_bytes(&self) -> usize {
        self.slots as usize * self.slot_bytes as usize
    }

    /// The attach message carrying `capability`: version 3 with one; without one (a cluster
    /// without a key), version 1 (16 bytes) without a staging region, so a target that predates
    /// staging regions still attaches the slots, and version 2 (24 bytes) with one.
    pub fn encode(&self, capability: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ATTACH_BYTES + capability.len());
        out.extend_from_slice(match (capability.is_empty(), self.staging_bytes > 0) {
            (false, _) => ATTACH_MAGIC_V3,
            (true, true) => ATTACH_MAGIC,
            (true, false) => ATTACH_MAGIC_V1,
        });
        out.extend_from_slice(&self.slots.to_le_bytes());
        out.extend_from_slice(&self.slot_bytes.to_le_bytes());
        if self.staging_bytes > 0 || !capability.is_empty() {
            out.extend_from_slice(&self.staging_bytes.to_le_bytes());
        }
        out.extend_from_slice(capability);
        out
    }

    /// Checks the magic and the geometry's bounds; returns the geometry and the capability
    /// (empty for a version-1 or version-2 message).
    pub fn decode(bytes: &[u8]) -> Result<(Attach, &[u8]), String> {
        let word = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let mut capability = &[][..];
        let attach = match bytes.len() {
            len if len > ATTACH_BYTES && &bytes[..8] == ATTACH_MAGIC_V3 => {
                capability = &bytes[ATTACH_BYTES..];
                if capability.len() > MAX_ATTACH_CAPABILITY_BYTES {
                    return Err(format!(
                        "a capability of {} bytes is over {MAX_ATTACH_CAPABILITY_BYTES}",
                        capability.len()
                    ));
                }
                Attach {
                    slots: word(8),
                    slot_bytes: word(12),
                    staging_bytes: u64::from(word(16)) | (u64::from(word(20)) << 32),
                }
            }
            ATTACH_BYTES if &bytes[..8] == ATTACH_MAGIC => Attach {
                slots: word(8),
                slot_bytes: word(12),
                staging_bytes: u64::from(word(16)) | (u64::from(word(20)) << 32),
            },
            ATTACH_BYTES_V1 if &bytes[..8] == ATTACH_MAGIC_V1 => {
                Attach { slots: word(8), slot_bytes: word(12), staging_bytes: 0 }
            }
            _ => return Err("not a starckpt shared-memory attach".into()),
        };
        if attach.staging_bytes > MAX_STAGING_BYTES || !attach.staging_bytes.is_multiple_of(4096) {
            return Err(format!(
                "a staging region of {} bytes is not a multiple of 4096 up to {MAX_STAGING_BYTES}",
                attach.staging_bytes
            ));
        }
        let max_slot = starckpt_proto::frame::MAX_PAYLOAD_BYTES as usize;
        if attach.slots == 0 || attach.slots > MAX_SLOTS {
            return Err(format!("{} slots is outside 1..={MAX_SLOTS}", attach.slots));
        }
        if attach.slot_bytes == 0 || !attach.slot_bytes.is_multiple_of(4096) || attach.slot_bytes as usize > max_slot {
            return Err(format!("slot size {} is not a multiple of 4096 up to {max_slot}", attach.slot_bytes));
        }
        if attach.region_bytes() > MAX_REGION_BYTES {
            return Err(format!("{} bytes exceed the region limit of {MAX_REGION_BYTES}", attach.region_bytes()));
        }
        Ok((attach, capability))
    }
}

/// A mapped shared-memory region (a sealed memfd).
pub struct Region {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
    /// False for a region mapped read-only ([`Region::attach_read_only`]): writes are refused.
    writable: bool,
}

// SAFETY: the region is plain bytes shared with another process; every access goes through the
// bounds-checked copies below, which tolerate concurrent writers (see the module docs).
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// A new region of `len` bytes (a positive multiple of 4096), sealed against resizing.
    pub fn create(name: &str, len: usize) -> io::Result<Region> {
        Region::create_sealed(name, len, SealFlag::empty())
    }

    /// A new region only this mapping may write ([`Region::create`], then sealed with
    /// `F_SEAL_FUTURE_WRITE`: no `write` and no new writable mapping, by this process or any
    /// process it passes the descriptor to). For staging memory a target reads.
    pub fn create_private_writes(name: &str, len: usize) -> io::Result<Region> {
        Region::create_sealed(name, len, SealFlag::F_SEAL_FUTURE_WRITE)
    }

    fn create_sealed(name: &str, len: usize, after_mapping: SealFlag) -> io::Result<Region> {
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
        nix::unistd::ftruncate(&fd, i64::try_from(len).map_err(io::Error::other)?)?;
        fcntl(&fd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW))?;
        let region = Region::map(fd, len, true)?;
        // After the mapping: a write seal applies to mappings made after it.
        fcntl(&region.fd, FcntlArg::F_ADD_SEALS(after_mapping | SealFlag::F_SEAL_SEAL))?;
        // Huge pages where the kernel allows them for shared memory (`shmem_enabled` advise or
        // above; advice only). A child forked later does not inherit the mapping: it would share,
        // not copy, the parent's in-flight bytes.
        // SAFETY: the range is exactly this mapping.
        unsafe {
            libc::madvise(region.ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE);
            libc::madvise(region.ptr.as_ptr().cast(), len, libc::MADV_DONTFORK);
        }
        Ok(region)
    }

    /// Maps a region received from a client, after checking that it is sealed against shrinking
    /// and holds at least `len` bytes.
    pub fn attach(fd: OwnedFd, len: usize) -> io::Result<Region> {
        check_received(&fd, len as u64, SealFlag::empty())?;
        Region::map(fd, len, true)
    }

    /// Maps a region read-only (this process created `fd` and only reads through this mapping).
    pub fn map_read_only(fd: OwnedFd, len: usize) -> io::Result<Region> {
        Region::map(fd, len, false)
    }

    fn map(fd: OwnedFd, len: usize, writable: bool) -> io::Result<Region> {
        let length = NonZeroUsize::new(len).ok_or_else(|| io::Error::other("empty region"))?;
        let protection = if writable { ProtFlags::PROT_READ | ProtFlags::PROT_WRITE } else { ProtFlags::PROT_READ };
        // SAFETY: a fresh shared mapping of a file we hold; unmapped in Drop, never aliased as a
        // Rust reference (only raw copies touch it).
        let ptr = unsafe { mmap(None, length, protection, MapFlags::MAP_SHARED, &fd, 0) }?;
        Ok(Region { fd, ptr: ptr.cast(), len, writable })
    }

    /// The mapping's first byte (for carving buffers out of a region this process created).
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The offset of `len` bytes at `ptr` in this mapping, if they lie wholly within it.
    pub fn offset_of(&self, ptr: *const u8, len: usize) -> Option<usize> {
        let offset = (ptr as usize).checked_sub(self.ptr.as_ptr() as usize)?;
        (offset.checked_add(len)? <= self.len).then_some(offset)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(&self, offset: usize, len: usize) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(io::Error::other(format!("{len} bytes at {offset} are outside the {}-byte region", self.len))),
        }
    }

    fn check_writable(&self, offset: usize, len: usize) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::other("the region is mapped read-only"));
        }
        self.check(offset, len)
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> io::Result<()> {
        self.check_writable(offset, src.len())?;
        // SAFETY: in bounds (checked); the region never overlaps Rust-owned memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        crate::buf::copies::record(src.len());
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the region. Another process may be writing
    /// them: the copy is then torn, and the caller's hash check must reject it.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: in bounds (checked); the region never overlaps Rust-owned memory.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        crate::buf::copies::record(dst.len());
        Ok(())
    }

    /// A BLAKE3 hasher that has read `len` bytes at `offset` where they lie (no copy). Bytes
    /// another process changes meanwhile are hashed as found: only for memory whose writer is
    /// trusted (module docs), hashed after whatever else read it (a device write), so that a
    /// change before or during that read shows as another hash.
    pub fn hash_in_place(&self, offset: usize, len: usize) -> io::Result<blake3::Hasher> {
        self.check(offset, len)?;
        let mut hasher = blake3::Hasher::new();
        // SAFETY: in bounds (checked) and mapped while `self` lives. The bytes are plain data: a
        // concurrent writer (trusted not to be one) could only make the hash differ.
        hasher.update(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) });
        Ok(hasher)
    }

    /// [`Region::read_at`], hashing the copy as it is made: each piece is hashed (BLAKE3) right
    /// after it is copied, while it is still in the CPU's cache, so the hash does not read the
    /// bytes from memory a second time. The hash is of `dst` as copied (never of the region,
    /// which another process may change meanwhile).
    pub fn read_at_hashed(&self, offset: usize, dst: &mut [u8]) -> io::Result<starckpt_proto::ChunkHash> {
        self.check(offset, dst.len())?;
        crate::buf::fill_hashed(dst, |at, piece| {
            // SAFETY: in bounds (checked for the whole range); the region never overlaps Rust-owned
            // memory.
            unsafe {
                std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset + at), piece.as_mut_ptr(), piece.len())
            };
            Ok(())
        })
    }

    /// [`Region::read_at`] into fresh `Bytes` (not zeroed first).
    pub fn read_bytes(&self, offset: usize, len: usize) -> io::Result<bytes::Bytes> {
        self.check(offset, len)?;
        let mut out = bytes::BytesMut::with_capacity(len);
        // SAFETY: in bounds (checked); `out` has room for `len` bytes, all written before set_len.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.spare_capacity_mut().as_mut_ptr().cast(),
                len,
            );
            out.set_len(len);
        }
        crate::buf::copies::record(len);
        Ok(out.freeze())
    }

    /// Zeroes `len` bytes at `offset`.
    pub fn zero(&self, offset: usize, len: usize) -> io::Result<()> {
        self.check_writable(offset, len)?;
        // SAFETY: in bounds (checked).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len) };
        Ok(())
    }
}

/// Whether shared memory gets transparent huge pages (2 MiB) where a mapping asks for them
/// (`MADV_HUGEPAGE`): the kernel's `shmem_enabled` mode for 2 MiB pages (Linux 6.11 and later:
/// `hugepages-2048kB/shmem_enabled`, unless `inherit`), else the global one, is `always`,
/// `within_size`, `advise` or `force` (not `never` or `deny`, nor unknown).
pub fn shared_huge_pages() -> bool {
    let mode = |path: &str| std::fs::read_to_string(path).ok().and_then(|modes| selected_mode(&modes));
    let per_size = mode("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled");
    let mode = match per_size.as_deref() {
        None | Some("inherit") => mode("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        Some(_) => per_size,
    };
    huge_pages_mode(mode.as_deref())
}

/// The selected mode of a `shmem_enabled` file: "always within_size [advise] never deny force".
fn selected_mode(modes: &str) -> Option<String> {
    modes.split_whitespace().find_map(|mode| Some(mode.strip_prefix('[')?.strip_suffix(']')?.to_owned()))
}

/// Whether a `shmem_enabled` mode gives huge pages to a mapping that asks.
fn huge_pages_mode(mode: Option<&str>) -> bool {
    matches!(mode, Some("always" | "within_size" | "advise" | "force"))
}

/// Checks a memfd received from a client: sealed against resizing (and with `also` besides), not
/// hugetlb, at least `len` bytes.
fn check_received(fd: &OwnedFd, len: u64, also: SealFlag) -> io::Result<()> {
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS).map_err(|e| io::Error::other(format!("not a sealed memfd: {e}")))?;
    let required = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | also;
    if !SealFlag::from_bits_truncate(seals).contains(required) {
        return Err(io::Error::other(format!("the memfd lacks the seals {required:?}")));
    }
    // A hugetlb file faults with SIGBUS when the huge-page pool runs dry, seals or not.
    if nix::sys::statfs::fstatfs(fd)?.filesystem_type() == nix::sys::statfs::HUGETLBFS_MAGIC {
        return Err(io::Error::other("a hugetlb memfd is refused"));
    }
    let size = nix::sys::stat::fstat(fd)?.st_size;
    if u64::try_from(size).map_or(true, |size| size < len) {
        return Err(io::Error::other(format!("the memfd holds {size} bytes, fewer than {len}")));
    }
    Ok(())
}

/// A client's staging memory as a target holds it: the memfd, read with `pread`, never mapped
/// (module docs). Sealed against resizing and against writes other than the client's own
/// mapping's.
pub struct StagingFile {
    file: std::fs::File,
    len: u64,
}

impl StagingFile {
    pub fn attach(fd: OwnedFd, len: u64) -> io::Result<StagingFile> {
        check_received(&fd, len, SealFlag::F_SEAL_FUTURE_WRITE)?;
        Ok(StagingFile { file: fd.into(), len })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maps the whole region read-only, for a trusted client (module docs), with huge-page advice
    /// (the client's pages may be huge: mapped as such, a device write of a chunk is a few
    /// segments, not one per 4 KiB page). Pages are faulted in as the target reads them.
    pub fn map(&self) -> io::Result<Region> {
        let len = usize::try_from(self.len).map_err(io::Error::other)?;
        let region = Region::map(self.file.as_fd().try_clone_to_owned()?, len, false)?;
        // SAFETY: advice on exactly this mapping.
        unsafe { libc::madvise(region.ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        Ok(region)
    }

    /// Reads `dst.len()` bytes at `offset` into `dst`, hashing each piece (BLAKE3) right after it
    /// arrives, while it is in the CPU's cache: the hash is of `dst` as read. The client may be
    /// changing the bytes meanwhile: the caller's hash check then refuses them.
    pub fn read_at_hashed(&self, offset: u64, dst: &mut [u8]) -> io::Result<starckpt_proto::ChunkHash> {
        match offset.checked_add(dst.len() as u64) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(io::Error::other(format!(
                    "{} bytes at {offset} are outside the {}-byte staging region",
                    dst.len(),
                    self.len
                )));
            }
        }
        crate::buf::fill_hashed(dst, |at, piece| self.file.read_exact_at(piece, offset + at as u64))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length and not used after this.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

/// Sends the attach message, with `capability` (empty: none), the slot region's descriptor and,
/// when `attach.staging_bytes` is not 0, the staging region's.
pub async fn send_attach(
    stream: &UnixStream,
    attach: Attach,
    capability: &[u8],
    fd: BorrowedFd<'_>,
    staging: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    if staging.is_some() != (attach.staging_bytes > 0) {
        return Err(io::Error::other("a staging region needs both its size and its descriptor"));
    }
    let message = attach.encode(capability);
    let fds: Vec<_> = std::iter::once(fd).chain(staging).map(|fd| fd.as_raw_fd()).collect();
    let message = &message[..];
    let sent = stream
        .async_io(Interest::WRITABLE, || {
            let cmsgs = [ControlMessage::ScmRights(&fds)];
            sendmsg::<()>(stream.as_raw_fd(), &[io::IoSlice::new(message)], &cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                .map_err(io::Error::from)
        })
        .await?;
    if sent != message.len() {
        return Err(io::Error::other(format!("sent {sent} of {} attach bytes", message.len())));
    }
    Ok(())
}

/// What a client attached: the slot region's descriptor and the staging region's, if any.
#[derive(Debug)]
pub struct Attached {
    pub attach: Attach,
    /// Empty where the client sent none.
    pub capability: Vec<u8>,
    pub slots: OwnedFd,
    pub staging: Option<OwnedFd>,
}

/// Receives an attach message and the descriptors that came with it.
pub async fn recv_attach(stream: &UnixStream) -> io::Result<Attached> {
    let mut message = [0u8; ATTACH_BYTES + MAX_ATTACH_CAPABILITY_BYTES];
    let (received, fds) = stream
        .async_io(Interest::READABLE, || {
            // Room for the most descriptors one message can carry (SCM_MAX_FD): the control data
            // is never truncated, so every descriptor a client sends is received, owned and (if
            // not wanted) closed, never leaked.
            let mut space = nix::cmsg_space!([std::os::fd::RawFd; 253]);
            let mut iov = [io::IoSliceMut::new(&mut message)];
            let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
                .map_err(io::Error::from)?;
            let mut fds = Vec::new();
            for cmsg in msg.cmsgs().map_err(io::Error::from)? {
                if let ControlMessageOwned::ScmRights(received) = cmsg {
                    // SAFETY: descriptors just received are ours to own (and close).
                    fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
            Ok((msg.bytes, fds))
        })
        .await?;
    let (attach, capability) = Attach::decode(&message[..received]).map_err(io::Error::other)?;
    let capability = capability.to_vec();
    let wanted = 1 + usize::from(attach.staging_bytes > 0);
    if fds.len() != wanted {
        return Err(io::Error::other(format!("attach with {} descriptors, not {wanted}", fds.len())));
    }
    let mut fds = fds.into_iter();
    Ok(Attached { attach, capability, slots: fds.next().expect("counted"), staging: fds.next() })
}

/// This host's identity for deciding whether a target is local: the kernel's boot id (processes
/// that see the same one run on the same kernel, so a memfd can pass between them).
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|id| id.trim().to_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_for_shared_memory_follow_the_selected_mode() {
        for (modes, huge) in [
            ("always within_size [advise] never deny force\n", true),
            ("[always] within_size advise never deny force", true),
            ("always within_size advise [never] deny force\n", false),
            ("always within_size advise never [deny] force", false),
            ("always within_size advise never deny force", false),
            ("", false),
            ("always [inherit] within_size advise never", false),
        ] {
            assert_eq!(huge_pages_mode(selected_mode(modes).as_deref()), huge, "{modes:?}");
        }
    }

    #[test]
    fn attach_geometry_is_bounded() {
        let good = Attach { slots: 8, slot_bytes: 4 << 20, staging_bytes: 3 << 40 >> 2 };
        let none: &[u8] = &[];
        assert_eq!(Attach::decode(&good.encode(none)), Ok((good, none)));
        let geometry = |slots, slot_bytes| Attach { slots, slot_bytes, staging_bytes: 0 };
        for bad in [
            geometry(0, 4096),
            geometry(MAX_SLOTS + 1, 4096),
            geometry(1, 4095),
            geometry(1, 0),
            geometry(1, 128 << 20),
            geometry(64, 64 << 20),
            Attach { staging_bytes: 4097, ..good },
            Attach { staging_bytes: MAX_STAGING_BYTES + 4096, ..good },
        ] {
            assert!(Attach::decode(&bad.encode(none)).is_err(), "{bad:?}");
            assert!(Attach::decode(&bad.encode(b"cap")).is_err(), "{bad:?} with a capability");
        }
        let mut wrong = good.encode(none);
        wrong[0] = b'X';
        assert!(Attach::decode(&wrong).is_err());
        assert!(Attach::decode(&good.encode(none)[..20]).is_err(), "truncated");
        // Without a staging region the message is version 1 (16 bytes), which older targets take.
        let slots_only = Attach { staging_bytes: 0, ..good };
        let mut v1 = slots_only.encode(none);
        assert_eq!((v1.len(), &v1[..8]), (16, &ATTACH_MAGIC_V1[..]));
        assert_eq!(Attach::decode(&v1), Ok((slots_only, none)));
        v1[..8].copy_from_slice(ATTACH_MAGIC);
        assert!(Attach::decode(&v1).is_err(), "a 16-byte message with the version-2 magic");
        let mut v2_without_staging = good.encode(none);
        v2_without_staging[16..].fill(0);
        assert_eq!(Attach::decode(&v2_without_staging), Ok((slots_only, none)));

        // With a capability, version 3 whether or not there is a staging region; bounded.
        let capability = [9u8; 43];
        for attach in [good, slots_only] {
            let v3 = attach.encode(&capability);
            assert_eq!((v3.len(), &v3[..8]), (ATTACH_BYTES + 43, &ATTACH_MAGIC_V3[..]));
            assert_eq!(Attach::decode(&v3), Ok((attach, &capability[..])));
        }
        let mut empty_v3 = good.encode(none);
        empty_v3[..8].copy_from_slice(ATTACH_MAGIC_V3);
        assert!(Attach::decode(&empty_v3).is_err(), "version 3 without its capability");
        let longest = [1u8; MAX_ATTACH_CAPABILITY_BYTES];
        assert!(Attach::decode(&good.encode(&longest)).is_ok());
        assert!(Attach::decode(&good.encode(&[1u8; MAX_ATTACH_CAPABILITY_BYTES + 1])).is_err());
        let mut v2_with_more = good.encode(none);
        v2_with_more.extend_from_slice(&capability);
        assert!(Attach::decode(&v2_with_more).is_err(), "a capability after a version-2 magic");
    }

    #[test]
    fn regions_are_sealed_shared_and_bounds_checked() {
        let region = Region::create("test", 8192).unwrap();
        region.write_at(4000, b"hello").unwrap();
        assert!(region.write_at(8190, b"abc").is_err());
        assert!(region.read_at(usize::MAX, &mut [0u8; 2]).is_err());
        // The same memory through a second mapping of the same descriptor, as a target sees it.
        let other = Region::attach(region.fd().try_clone_to_owned().unwrap(), 8192).unwrap();
        let mut got = [0u8; 5];
        other.read_at(4000, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        // More than the file holds, or a file without seals, is refused.
        assert!(Region::attach(region.fd().try_clone_to_owned().unwrap(), 16384).is_err());
        let unsealed = memfd_create("unsealed", MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&unsealed, 8192).unwrap();
        assert!(Region::attach(unsealed, 8192).is_err());
        // A read-only mapping reads what the creator wrote and refuses writes.
        let read_only = Region::map_read_only(region.fd().try_clone_to_owned().unwrap(), 8192).unwrap();
        read_only.read_at(4000, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        assert!(read_only.write_at(0, b"x").is_err());
        assert!(read_only.zero(0, 1).is_err());
        assert_eq!(region.offset_of(region.base().wrapping_add(4096), 4096), Some(4096));
        assert_eq!(region.offset_of(region.base().wrapping_add(4096), 4097), None);
        assert_eq!(region.offset_of(got.as_ptr(), 1), None);
        // A hashed copy hashes what it copied, across pieces.
        let big = Region::create("big", 512 << 10).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 251) as u8).collect();
        big.write_at(8192, &data).unwrap();
        let mut copy = vec![0u8; data.len()];
        assert_eq!(big.read_at_hashed(8192, &mut copy).unwrap(), starckpt_proto::ChunkHash::of(&data));
        assert_eq!(copy, data);
        assert!(big.read_at_hashed(300_000, &mut copy).is_err());
    }

    #[test]
    fn staging_files_are_read_not_mapped_and_sealed_against_other_writers() {
        let staging = Region::create_private_writes("staging", 1 << 20).unwrap();
        let data: Vec<u8> = (0..600_000u32).map(|i| (i * 7 % 253) as u8).collect();
        staging.write_at(4096, &data).unwrap(); // its own mapping still writes
        let received = || staging.fd().try_clone_to_owned().unwrap();
        // Nobody else may write it: not through the descriptor, not through a new mapping.
        assert!(nix::unistd::write(staging.fd(), b"x").is_err());
        assert!(Region::attach(received(), 1 << 20).is_err(), "a writable mapping of a write-sealed memfd");
        let file = StagingFile::attach(received(), 1 << 20).unwrap();
        let mut copy = vec![0u8; data.len()];
        assert_eq!(file.read_at_hashed(4096, &mut copy).unwrap(), starckpt_proto::ChunkHash::of(&data));
        assert_eq!(copy, data);
        assert!(file.read_at_hashed((1 << 20) - 4096, &mut copy).is_err(), "past the end");
        assert!(file.read_at_hashed(u64::MAX - 10, &mut copy).is_err(), "overflowing");
        // Bigger than it is, or not sealed against writes (a slot region), is refused.
        assert!(StagingFile::attach(received(), 2 << 20).is_err());
        let slots = Region::create("slots", 8192).unwrap();
        assert!(StagingFile::attach(slots.fd().try_clone_to_owned().unwrap(), 8192).is_err());
        // A sparse region: reading a hole yields zeros.
        let sparse = Region::create_private_writes("sparse", 64 << 20).unwrap();
        let file = StagingFile::attach(sparse.fd().try_clone_to_owned().unwrap(), 64 << 20).unwrap();
        let mut hole = vec![1u8; 1 << 20];
        file.read_at_hashed(32 << 20, &mut hole).unwrap();
        assert!(hole.iter().all(|&b| b == 0));
        // A hugetlb memfd, even sealed (creating one needs no huge pages; mapping it would).
        let huge = memfd_create("huge", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING | MFdFlags::MFD_HUGETLB);
        if let Ok(huge) = huge {
            let _ = fcntl(&huge, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW));
            let refused = Region::attach(huge, 8192).err().expect("a hugetlb memfd was attached");
            assert!(refused.to_string().contains("hugetlb"), "{refused}");
        }
        assert!(!host_id().is_empty());
    }
}
