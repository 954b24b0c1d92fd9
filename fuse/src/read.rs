//! Reads of committed files: whole chunks fetched (and verified) by the SDK, with a read-ahead
//! window per open file, the windows of all open files bounded together by one budget of bytes.
//!
//! Past the budget a read still fetches the chunks it covers; it keeps the one it ended in
//! (the next sequential read most likely starts there: without it, 1 MiB kernel requests would
//! fetch a 4 MiB chunk four times) and drops the rest. So the mount holds at most the budget, plus
//! one chunk per open file, plus the chunks of the reads being served. A window whose file has not
//! been read for [`IDLE`] gives its budget to a reader that wants it (a data loader holding many
//! shards open reads a few at a time).

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use fuser::Errno;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use starckpt_client::sync::LockExt;
use starckpt_client::{CheckpointManifest, Client};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

type ChunkFuture = Shared<BoxFuture<'static, Result<Bytes, String>>>;

/// A file not read for this long gives up its window's budget when another reader wants it.
const IDLE: Duration = Duration::from_secs(2);

/// The budget counts in units of this many bytes (a semaphore's permits are counted in `u32`).
const UNIT: u64 = 1 << 10;

/// A chunk in an open file's window: being fetched or fetched. `held` is its share of the mount's
/// budget; a chunk without one (the budget was spent) serves the read that needed it and is not
/// kept.
struct Slot {
    chunk: ChunkFuture,
    held: Option<OwnedSemaphorePermit>,
}

/// An open file of a committed checkpoint, with its read-ahead window.
pub(crate) struct Reader {
    manifest: Arc<CheckpointManifest>,
    index: usize,
    /// Offset of each chunk in the file, and the file size at the end.
    starts: Vec<u64>,
    window: Mutex<BTreeMap<usize, Slot>>,
    /// The last chunk the previous read needed (usize::MAX before the first): a read that starts
    /// there or in the next chunk is sequential, and only those read ahead.
    last_read: AtomicUsize,
    /// When it was last read, in ms since [`Reads::epoch`].
    touched: AtomicU64,
}

/// The mount's reads: where chunks come from, and the budget their windows share.
pub(crate) struct Reads {
    client: Client,
    runtime: tokio::runtime::Handle,
    read_ahead_chunks: usize,
    /// Bytes (in [`UNIT`]s) all open files' windows may keep, fetched or in flight.
    budget: Arc<Semaphore>,
    /// Every open file's reader, for taking budget back from idle ones.
    readers: Mutex<Vec<Weak<Reader>>>,
    epoch: Instant,
    /// When idle windows were last looked for (ms since `epoch`): at most every 100 ms.
    reclaimed: AtomicU64,
}

impl Reads {
    pub(crate) fn new(client: Client, runtime: tokio::runtime::Handle, read_ahead_chunks: usize, budget: u64) -> Reads {
        let units = usize::try_from(budget / UNIT).unwrap_or(usize::MAX).min(Semaphore::MAX_PERMITS);
        Reads {
            client,
            runtime,
            read_ahead_chunks,
            budget: Arc::new(Semaphore::new(units)),
            readers: Mutex::new(Vec::new()),
            epoch: Instant::now(),
            reclaimed: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A reader of file `index` of `manifest`, or None when there is no such file.
    pub(crate) fn open(&self, manifest: Arc<CheckpointManifest>, index: usize) -> Option<Arc<Reader>> {
        let file = manifest.files.get(index)?;
        let mut starts = Vec::with_capacity(file.chunks.len() + 1);
        let mut offset = 0;
        for chunk in &file.chunks {
            starts.push(offset);
            offset += chunk.length_bytes;
        }
        starts.push(offset);
        let reader = Arc::new(Reader {
            manifest,
            index,
            starts,
            window: Mutex::new(BTreeMap::new()),
            last_read: AtomicUsize::new(usize::MAX),
            touched: AtomicU64::new(self.now_ms()),
        });
        let mut readers = self.readers.lock_unpoisoned();
        readers.retain(|r| r.strong_count() > 0);
        readers.push(Arc::downgrade(&reader));
        Some(reader)
    }

    /// Bytes `offset..offset + size` of `reader`'s file (fewer at its end).
    pub(crate) fn read(&self, reader: &Reader, offset: u64, size: u32) -> Result<Bytes, Errno> {
        let file_size = *reader.starts.last().unwrap_or(&0);
        if offset >= file_size || size == 0 {
            return Ok(Bytes::new());
        }
        let end = (offset + u64::from(size)).min(file_size);
        // starts[i] <= offset < starts[i + 1]
        let first = reader.starts.partition_point(|s| *s <= offset) - 1;
        let last = reader.starts.partition_point(|s| *s < end) - 1;
        let chunk_count = reader.starts.len() - 1;
        // Sequential: from the start, where the previous read ended (its last chunk or the next),
        // or in what was read ahead (the kernel's own read-ahead requests may arrive out of order
        // and span several chunks). A random read (a loader reading tensors by offset) fetches
        // what it covers and nothing more.
        let previous = reader.last_read.swap(last, Ordering::Relaxed);
        reader.touched.store(self.now_ms(), Ordering::Relaxed);
        let wanted: Vec<(usize, ChunkFuture)> = {
            let mut window = reader.window.lock_unpoisoned();
            let sequential = offset == 0
                || first == previous
                || Some(first) == previous.checked_add(1)
                || window.contains_key(&first);
            // Drop what the reader has passed or jumped away from (its budget with it).
            let ahead = (last + self.read_ahead_chunks).min(chunk_count - 1);
            window.retain(|index, _| *index >= first && *index <= ahead);
            // What this read needs is fetched whatever the budget; read-ahead only within it.
            for index in first..=last {
                if let Entry::Vacant(slot) = window.entry(index) {
                    let held = self.reserve(reader, index);
                    slot.insert(Slot { chunk: self.fetch(reader, index), held });
                }
            }
            if sequential {
                for index in last + 1..=ahead {
                    if let Entry::Vacant(slot) = window.entry(index) {
                        let Some(held) = self.reserve(reader, index) else { break };
                        slot.insert(Slot { chunk: self.fetch(reader, index), held: Some(held) });
                    }
                }
            }
            (first..=last).map(|index| (index, window[&index].chunk.clone())).collect()
        };
        let result = self.assemble(reader, &wanted, offset, end);
        // Chunks fetched past the budget served this read only, but for the one it ended in (the
        // next sequential read starts there); one that failed is not kept either, so the next
        // read of it on this handle tries again.
        let ends_inside = end < reader.starts[last + 1];
        let mut window = reader.window.lock_unpoisoned();
        for (index, chunk) in &wanted {
            let keep = window.get(index).is_some_and(|slot| {
                !slot.chunk.ptr_eq(chunk)
                    || (result.is_ok() && (slot.held.is_some() || (*index == last && ends_inside)))
            });
            if !keep {
                window.remove(index);
            }
        }
        result
    }

    /// This chunk's share of the budget, if the budget has it (after taking back what idle
    /// windows hold, if it did not).
    fn reserve(&self, reader: &Reader, index: usize) -> Option<OwnedSemaphorePermit> {
        let units = u32::try_from((reader.starts[index + 1] - reader.starts[index]).div_ceil(UNIT)).ok()?;
        if let Ok(permit) = Arc::clone(&self.budget).try_acquire_many_owned(units) {
            return Some(permit);
        }
        self.reclaim(reader);
        Arc::clone(&self.budget).try_acquire_many_owned(units).ok()
    }

    /// Empties the windows of files not read for [`IDLE`] (other than `asking`'s), giving their
    /// budget back; at most every 100 ms. Windows busy right now are skipped (never waited for:
    /// the caller holds its own window's lock).
    fn reclaim(&self, asking: &Reader) {
        let now = self.now_ms();
        let last = self.reclaimed.load(Ordering::Relaxed);
        if now < last + 100 || self.reclaimed.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err()
        {
            return;
        }
        let idle = IDLE.as_millis() as u64;
        let readers = self.readers.lock_unpoisoned();
        for reader in readers.iter().filter_map(Weak::upgrade) {
            if std::ptr::eq(Arc::as_ptr(&reader), asking) || now < reader.touched.load(Ordering::Relaxed) + idle {
                continue;
            }
            if let Ok(mut window) = reader.window.try_lock() {
                window.retain(|_, slot| slot.held.is_none());
            }
        }
    }

    fn assemble(
        &self,
        reader: &Reader,
        wanted: &[(usize, ChunkFuture)],
        offset: u64,
        end: u64,
    ) -> Result<Bytes, Errno> {
        let mut out = BytesMut::with_capacity(if wanted.len() > 1 { (end - offset) as usize } else { 0 });
        for (index, future) in wanted {
            let data = self.runtime.block_on(future.clone()).map_err(|message| {
                tracing::warn!(op = "read", %message, "chunk read failed");
                Errno::EIO
            })?;
            let start = reader.starts[*index];
            if data.len() as u64 != reader.starts[index + 1] - start {
                tracing::warn!(op = "read", index, got = data.len(), "chunk of unexpected length");
                return Err(Errno::EIO);
            }
            let from = offset.saturating_sub(start) as usize;
            let to = (end - start).min(data.len() as u64) as usize;
            if wanted.len() == 1 {
                // Within one chunk (requests as large as a chunk and aligned to it): its bytes
                // as they are, not copied.
                return Ok(data.slice(from..to));
            }
            out.extend_from_slice(&data[from..to]);
        }
        Ok(out.freeze())
    }

    fn fetch(&self, reader: &Reader, index: usize) -> ChunkFuture {
        let (client, manifest, file) = (self.client.clone(), Arc::clone(&reader.manifest), reader.index);
        let task = self.runtime.spawn(async move {
            let chunk = &manifest.files[file].chunks[index];
            client.read_chunk(&manifest, chunk).await.map_err(|e| e.to_string())
        });
        async move { task.await.map_err(|e| e.to_string()).and_then(|r| r) }.boxed().shared()
    }
}
