//! Page-aligned, pre-faulted byte buffers and a bounded pool of them.
//!
//! O_DIRECT needs buffers aligned to the logical block size (we use 4096, the page size), and
//! these VMs pay dearly for touching fresh memory (0.38 GB/s first touch against 13.5 GB/s into
//! touched memory, ../shared/MACHINE.md). So buffers are allocated once, touched at creation,
//! and reused through a [`BufPool`] whose capacity bounds the memory a process can pin. The same
//! buffers carry bytes from the socket (or the caller's memory) to the device without copies.

use std::alloc::{Layout, alloc, dealloc};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::shm::Region;
use crate::sync::LockExt;

/// Payload bytes copied in user space on the data path, between a client's staging buffers (or
/// the reader's) and a target's device buffers: every such copy site records itself here, so a
/// test can count the copies each transport makes (`client/tests/copies.rs`). Two relaxed atomic
/// adds per copy of up to a chunk: free beside the copy.
pub mod copies {
    use std::sync::atomic::{AtomicU64, Ordering};

    static COPIES: AtomicU64 = AtomicU64::new(0);
    static BYTES: AtomicU64 = AtomicU64::new(0);

    /// A copy of `bytes` payload bytes happened.
    pub fn record(bytes: usize) {
        COPIES.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// (copies, bytes copied) in this process so far.
    pub fn snapshot() -> (u64, u64) {
        (COPIES.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed))
    }
}

/// Fills `dst` piece by piece with `fill(offset in dst, piece)` (a copy out of shared memory, a
/// read), hashing (BLAKE3) each piece right after it is filled, while it is in the CPU's cache, so
/// the hash does not read the bytes from memory again; counts the copy. Returns the hash of `dst`
/// as filled.
pub fn fill_hashed<E>(
    dst: &mut [u8],
    mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
) -> Result<starckpt_proto::ChunkHash, E> {
    let mut hasher = blake3::Hasher::new();
    for (index, piece) in dst.chunks_mut(HASHED_PIECE).enumerate() {
        fill(index * HASHED_PIECE, piece)?;
        hasher.update(piece);
    }
    copies::record(dst.len());
    Ok(starckpt_proto::ChunkHash(*hasher.finalize().as_bytes()))
}

/// Reads `dst.len()` bytes of `reader` (a socket) into `dst` piece by piece, hashing (BLAKE3) each
/// piece right after the kernel copied it in, while it is in the CPU's cache, as [`fill_hashed`]
/// does for user-space copies. Returns the hash of `dst` as read. The kernel's copy out of the
/// socket buffer is not a user-space copy and is not counted. Cancel-safe only in that a dropped
/// read leaves `dst` partly filled and the stream mid-payload: the caller owns both.
pub async fn read_hashed<R: tokio::io::AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    dst: &mut [u8],
) -> std::io::Result<starckpt_proto::ChunkHash> {
    use tokio::io::AsyncReadExt;
    let mut hasher = blake3::Hasher::new();
    for piece in dst.chunks_mut(HASHED_PIECE) {
        reader.read_exact(piece).await?;
        hasher.update(piece);
    }
    Ok(starckpt_proto::ChunkHash(*hasher.finalize().as_bytes()))
}

/// Bytes [`fill_hashed`] and [`read_hashed`] fill, then hash while they are still in a core's L2
/// cache.
const HASHED_PIECE: usize = 256 << 10;

/// Alignment of every buffer: the page size, which satisfies O_DIRECT on every Linux block device.
pub const ALIGN: usize = 4096;

pub fn round_up(len: usize) -> usize {
    len.div_ceil(ALIGN) * ALIGN
}

/// Buffers of at least this size are aligned to it and advised to use transparent huge pages.
const HUGE_PAGE: usize = 2 << 20;

fn layout_for(capacity: usize) -> Layout {
    let align = if capacity >= HUGE_PAGE { HUGE_PAGE } else { ALIGN };
    Layout::from_size_align(capacity, align).expect("capacity fits isize")
}

/// An owned, [`ALIGN`]-aligned buffer whose capacity is a multiple of [`ALIGN`]: a heap allocation
/// of its own, or a range of a pool's shared region ([`BufPool::shared`]) that the pool lends to
/// one buffer at a time. `len` marks how many leading bytes are meaningful.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
    /// The shared region this buffer is carved from ([`BufPool::shared`]); None: a heap
    /// allocation of its own.
    arena: Option<Arc<Region>>,
}

// SAFETY: AlignedBuf owns its memory exclusively within this process, like Vec<u8> (a shared
// region's range is lent to one buffer at a time; other processes can only read it, see
// `Region::create_private_writes`).
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `capacity` bytes (rounded up to [`ALIGN`]), every page touched
    /// so later writes into it run at memory speed.
    pub fn new(capacity: usize) -> AlignedBuf {
        let capacity = round_up(capacity.max(1));
        let layout = layout_for(capacity);
        // Not `alloc_zeroed`: for an over-aligned layout it zeroes (and so faults in, with 4 KiB
        // pages) the memory before the huge-page advice below could apply.
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        let buf = AlignedBuf { ptr, len: 0, capacity, arena: None };
        if layout.align() == HUGE_PAGE {
            // Transparent huge pages are `madvise` on these VMs: first touch runs at 6.8 GB/s with
            // them against 0.6 GB/s with 4 KiB pages (../shared/MACHINE.md). Advice only: a kernel
            // without THP ignores it.
            // SAFETY: the range is exactly this allocation.
            unsafe { libc::madvise(buf.ptr.as_ptr().cast(), capacity, libc::MADV_HUGEPAGE) };
        }
        // Zero every byte now: the contents are defined (the allocator may return memory it used
        // before) and every page is faulted in here rather than on the hot path.
        // SAFETY: the allocation is `capacity` bytes.
        unsafe { std::ptr::write_bytes(buf.ptr.as_ptr(), 0, capacity) };
        buf
    }

    /// The `capacity` bytes at `offset` of `arena` as a buffer, every page touched.
    fn carve(arena: &Arc<Region>, offset: usize, capacity: usize) -> AlignedBuf {
        assert!(
            offset.is_multiple_of(ALIGN) && capacity.is_multiple_of(ALIGN) && offset + capacity <= arena.len(),
            "a buffer of {capacity} bytes at {offset} outside the {}-byte arena",
            arena.len()
        );
        // SAFETY: in bounds (asserted); the pool lends each range to one buffer at a time.
        let ptr = NonNull::new(unsafe { arena.base().add(offset) }).expect("a mapping is never at 0");
        let buf = AlignedBuf { ptr, len: 0, capacity, arena: Some(Arc::clone(arena)) };
        // Touched (the memfd's pages allocated) now, not on the hot path.
        // SAFETY: the range lies in the writable mapping `arena` holds.
        unsafe { std::ptr::write_bytes(buf.ptr.as_ptr(), 0, capacity) };
        buf
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the meaningful length. Panics if `len` exceeds the capacity (a caller bug, never input).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity, "AlignedBuf::set_len({len}) beyond capacity {}", self.capacity);
        self.len = len;
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The whole capacity, for filling.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `capacity` bytes, initialised (zeroed) at creation.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity) }
    }

    pub fn full(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.capacity) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.full()[..self.len]
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.full_mut()[..len]
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.arena.is_some() {
            return; // the region's mapping goes with its last handle
        }
        let layout = layout_for(self.capacity);
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf {{ len: {}, capacity: {} }}", self.len, self.capacity)
    }
}

/// A buffer's identity within its pool, for registering it with a device once (io_uring fixed
/// buffers): unique per pool (`pool`) and stable for the pool's life (`index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolSlot {
    pub pool: u64,
    pub index: u32,
}

static NEXT_POOL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

struct PoolInner {
    id: u64,
    buf_bytes: usize,
    max_buffers: usize,
    /// Buffers allocated so far (lent out or free); never exceeds `max_buffers`.
    created: std::sync::atomic::AtomicUsize,
    /// The next buffer's index (creation order), reserved before the buffer is made.
    next_index: std::sync::atomic::AtomicU32,
    /// Free buffers with their index in the pool.
    free: Mutex<Vec<(AlignedBuf, u32)>>,
    permits: Arc<Semaphore>,
    /// Start addresses of the buffers created, sorted: a pool's buffers live as long as the pool,
    /// so memory registered for RDMA once stays valid ([`BufPool::buffer_containing`]).
    bases: Mutex<Vec<usize>>,
    /// The shared region the buffers are carved from ([`BufPool::shared`]), buffer `i` at
    /// `i × buf_bytes`.
    arena: Option<Arc<Region>>,
}

impl PoolInner {
    /// A new buffer and its index (creation order).
    fn create(&self) -> (AlignedBuf, u32) {
        // Reserved first, so the buffer (touched page by page, which takes a while) is made
        // without holding the lock; an arena's range is the index's alone.
        let index = self.next_index.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let buf = match &self.arena {
            Some(arena) => AlignedBuf::carve(arena, index as usize * self.buf_bytes, self.buf_bytes),
            None => AlignedBuf::new(self.buf_bytes),
        };
        let mut bases = self.bases.lock_unpoisoned();
        let at = bases.partition_point(|&b| b < buf.as_ptr() as usize);
        bases.insert(at, buf.as_ptr() as usize);
        (buf, index)
    }
}

/// A bounded pool of equal-sized [`AlignedBuf`]s. At most `max_buffers` exist at once; `acquire`
/// waits when all are lent out, which is how a slow consumer pushes back on a fast producer.
/// Buffers are created lazily, then kept and reused.
#[derive(Clone)]
pub struct BufPool {
    inner: Arc<PoolInner>,
}

impl BufPool {
    pub fn new(buf_bytes: usize, max_buffers: usize) -> BufPool {
        BufPool::with_arena(buf_bytes, max_buffers, None)
    }

    /// A pool whose buffers are carved out of one sealed memfd ([`Region`]), so another process
    /// on this host that maps it ([`BufPool::arena`], passed at a shared-memory attach) can read
    /// them where they lie. The memfd's pages are allocated as buffers are created, as with
    /// [`BufPool::new`].
    pub fn shared(name: &str, buf_bytes: usize, max_buffers: usize) -> std::io::Result<BufPool> {
        let bytes = round_up(buf_bytes.max(1))
            .checked_mul(max_buffers.max(1))
            .ok_or_else(|| std::io::Error::other("the staging arena's size overflows"))?;
        let arena = Region::create_private_writes(name, bytes)?;
        Ok(BufPool::with_arena(buf_bytes, max_buffers, Some(Arc::new(arena))))
    }

    fn with_arena(buf_bytes: usize, max_buffers: usize, arena: Option<Arc<Region>>) -> BufPool {
        BufPool {
            inner: Arc::new(PoolInner {
                id: NEXT_POOL_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                buf_bytes: round_up(buf_bytes.max(1)),
                max_buffers: max_buffers.max(1),
                created: std::sync::atomic::AtomicUsize::new(0),
                next_index: std::sync::atomic::AtomicU32::new(0),
                free: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(max_buffers.max(1))),
                bases: Mutex::new(Vec::new()),
                arena,
            }),
        }
    }

    /// The shared region the buffers live in, for a pool made by [`BufPool::shared`].
    pub fn arena(&self) -> Option<&Arc<Region>> {
        self.inner.arena.as_ref()
    }

    /// Capacity of each buffer.
    pub fn buf_bytes(&self) -> usize {
        self.inner.buf_bytes
    }

    /// Most buffers that can exist at once.
    pub fn max_buffers(&self) -> usize {
        self.inner.max_buffers
    }

    /// Buffers allocated (and touched) so far, lent out or free.
    pub fn allocated(&self) -> usize {
        self.inner.created.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Allocates and touches up to `count` more buffers now (never past the pool's bound), so the
    /// first save does not pay for page faults.
    pub fn prefill(&self, count: usize) {
        use std::sync::atomic::Ordering;
        for _ in 0..count {
            // Holding a permit while allocating keeps (lent + being prefilled) within the bound, so
            // a concurrent acquire that finds no free buffer may safely allocate one.
            let Ok(_permit) = Arc::clone(&self.inner.permits).try_acquire_owned() else { break };
            let reserved = self.inner.created.fetch_update(Ordering::AcqRel, Ordering::Acquire, |created| {
                (created < self.inner.max_buffers).then_some(created + 1)
            });
            if reserved.is_err() {
                break;
            }
            let created = self.inner.create();
            self.lock_free().push(created);
        }
    }

    /// The buffer of this pool that holds address `ptr`: its start and capacity. Such memory stays
    /// allocated (lent out or free) until the last handle of the pool is dropped.
    pub fn buffer_containing(&self, ptr: *const u8) -> Option<(usize, usize)> {
        let at = ptr as usize;
        let bases = self.inner.bases.lock_unpoisoned();
        let index = bases.partition_point(|&b| b <= at).checked_sub(1)?;
        let base = bases[index];
        (at < base + self.inner.buf_bytes).then_some((base, self.inner.buf_bytes))
    }

    fn lock_free(&self) -> std::sync::MutexGuard<'_, Vec<(AlignedBuf, u32)>> {
        // A panic while holding this lock cannot leave the Vec inconsistent; keep going.
        self.inner.free.lock_unpoisoned()
    }

    pub async fn acquire(&self) -> PooledBuf {
        let permit = Arc::clone(&self.inner.permits).acquire_owned().await.expect("pool semaphore is never closed");
        self.take(permit)
    }

    /// A buffer if one is available right now.
    pub fn try_acquire(&self) -> Option<PooledBuf> {
        let permit = Arc::clone(&self.inner.permits).try_acquire_owned().ok()?;
        Some(self.take(permit))
    }

    fn take(&self, permit: OwnedSemaphorePermit) -> PooledBuf {
        // Holding a permit guarantees a free buffer exists or fewer than max_buffers were created.
        let (buf, index) = self.lock_free().pop().unwrap_or_else(|| {
            self.inner.created.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            self.inner.create()
        });
        PooledBuf { buf: Some(buf), index, pool: Arc::clone(&self.inner), _permit: permit }
    }
}

/// A buffer on loan from a [`BufPool`]; returns to the pool when dropped (including when the
/// `bytes::Bytes` made from it with [`PooledBuf::freeze`] is dropped).
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    index: u32,
    pool: Arc<PoolInner>,
    _permit: OwnedSemaphorePermit,
}

impl PooledBuf {
    pub fn buf(&self) -> &AlignedBuf {
        self.buf.as_ref().expect("present until drop")
    }

    pub fn buf_mut(&mut self) -> &mut AlignedBuf {
        self.buf.as_mut().expect("present until drop")
    }

    /// Shares the meaningful bytes as `Bytes` without copying; the buffer goes back to the pool
    /// when the last clone is dropped.
    pub fn freeze(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        self.buf().as_ref()
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(mut buf) = self.buf.take() {
            buf.set_len(0);
            self.pool.free.lock_unpoisoned().push((buf, self.index));
        }
    }
}

/// A buffer an I/O engine can own while the kernel uses it: a plain [`AlignedBuf`] or one on loan
/// from a [`BufPool`]. Engines take and give back `Box<dyn IoBuf>` so both kinds travel the same
/// path.
pub trait IoBuf: Send + Sync + 'static {
    fn aligned(&self) -> &AlignedBuf;
    fn aligned_mut(&mut self) -> &mut AlignedBuf;
    /// The buffer's identity in its pool, if it lives as long as a pool does (only such memory
    /// may stay registered with a device).
    fn pool_slot(&self) -> Option<PoolSlot> {
        None
    }
}

pub type BoxedBuf = Box<dyn IoBuf>;

impl IoBuf for AlignedBuf {
    fn aligned(&self) -> &AlignedBuf {
        self
    }
    fn aligned_mut(&mut self) -> &mut AlignedBuf {
        self
    }
}

impl IoBuf for PooledBuf {
    fn aligned(&self) -> &AlignedBuf {
        self.buf()
    }
    fn aligned_mut(&mut self) -> &mut AlignedBuf {
        self.buf_mut()
    }
    fn pool_slot(&self) -> Option<PoolSlot> {
        Some(PoolSlot { pool: self.pool.id, index: self.index })
    }
}

/// Shares `range` of a boxed buffer's meaningful bytes as `Bytes`, without copying.
pub fn boxed_to_bytes(buf: BoxedBuf, range: std::ops::Range<usize>) -> bytes::Bytes {
    struct Owner(BoxedBuf);
    impl AsRef<[u8]> for Owner {
        fn as_ref(&self) -> &[u8] {
            self.0.aligned().as_ref()
        }
    }
    bytes::Bytes::from_owner(Owner(buf)).slice(range)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_huge_page_aligned() {
        let buf = AlignedBuf::new(4 << 20);
        assert_eq!(buf.as_ptr() as usize % (2 << 20), 0);
        assert!(buf.full().iter().all(|b| *b == 0));
    }

    #[test]
    fn aligned_and_rounded() {
        let mut buf = AlignedBuf::new(5000);
        assert_eq!(buf.capacity(), 8192);
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        buf.full_mut()[..3].copy_from_slice(b"abc");
        buf.set_len(3);
        assert_eq!(buf.as_ref(), b"abc");
    }

    #[tokio::test]
    async fn pool_bounds_and_reuses() {
        let pool = BufPool::new(4096, 2);
        let a = pool.acquire().await;
        let ptr = a.buf().as_ptr();
        let _b = pool.acquire().await;
        assert!(pool.try_acquire().is_none(), "third buffer must wait");
        let bytes = a.freeze();
        assert!(pool.try_acquire().is_none(), "still lent out as Bytes");
        drop(bytes);
        let c = pool.try_acquire().expect("returned to pool");
        assert_eq!(c.buf().as_ptr(), ptr, "reused, not reallocated");
        drop((c, _b));
        pool.prefill(10);
        assert_eq!(pool.inner.created.load(std::sync::atomic::Ordering::Relaxed), 2, "prefill respects the bound");
    }

    #[tokio::test]
    async fn a_shared_pool_carves_its_buffers_out_of_one_region() {
        let pool = BufPool::shared("test-staging", 5000, 3).unwrap();
        let arena = Arc::clone(pool.arena().unwrap());
        assert_eq!(arena.len(), 3 * 8192);
        let mut bufs = Vec::new();
        for _ in 0..3 {
            let mut buf = pool.acquire().await;
            buf.buf_mut().full_mut()[..5].copy_from_slice(b"bytes");
            buf.buf_mut().set_len(5);
            bufs.push(buf);
        }
        assert!(pool.try_acquire().is_none(), "bounded like any pool");
        let mut offsets: Vec<usize> = bufs.iter().map(|b| arena.offset_of(b.buf().as_ptr(), 8192).unwrap()).collect();
        offsets.sort();
        assert_eq!(offsets, [0, 8192, 16384], "each buffer its own range");
        // Another mapping of the region (a target's) sees the bytes where they lie.
        let other = crate::shm::StagingFile::attach(arena.fd().try_clone_to_owned().unwrap(), arena.len() as u64);
        let mut seen = [0u8; 5];
        other.unwrap().read_at_hashed(offsets[1] as u64, &mut seen).unwrap();
        assert_eq!(&seen, b"bytes");
        // Buffers outlive the pool handle (the region with them), then are reused, not re-carved.
        let first = bufs.remove(0).freeze();
        drop(pool.clone());
        assert_eq!(&first[..], b"bytes");
        drop(first);
        let again = pool.acquire().await;
        assert!(arena.offset_of(again.buf().as_ptr(), 8192).is_some());
        assert_eq!(pool.allocated(), 3);
    }

    #[tokio::test]
    async fn a_pool_knows_which_buffer_holds_an_address() {
        let pool = BufPool::new(8192, 3);
        pool.prefill(1);
        let (a, b) = (pool.acquire().await, pool.acquire().await);
        for buf in [&a, &b] {
            let base = buf.buf().as_ptr();
            assert_eq!(pool.buffer_containing(base), Some((base as usize, 8192)));
            assert_eq!(pool.buffer_containing(base.wrapping_add(8191)), Some((base as usize, 8192)));
        }
        let other = AlignedBuf::new(8192);
        assert_eq!(pool.buffer_containing(other.as_ptr()), None);
        assert_eq!(pool.buffer_containing(std::ptr::null()), None);
    }
}
