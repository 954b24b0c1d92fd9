//! Staging: copying each item into pooled staging buffers (small pieces packed together), off
//! the async runtime, and reading files into them.

use super::*;

impl Client {
    /// Copies `source` into staging buffers and hands each staged chunk to the uploaders.
    /// Returns the number of chunks.
    ///
    /// The copy runs on the caller's task (`block_in_place`), batches of `staging_threads` chunks
    /// split across scoped threads. Measured on 2 cores with uploads running: handing each copy to
    /// the blocking pool instead stalled the caller ~2.5x longer, because the copies then queued
    /// behind the uploaders' hashing; the caller's own thread is the one the trainer waits on.
    pub(super) async fn stage_copies(
        &self,
        file_index: usize,
        path: &RelPath,
        source: Lent<'_>,
        packer: &mut Packer<'_>,
        progress: &SaveProgress,
    ) -> Result<usize> {
        let (gate, chunks) = (packer.gate, packer.chunks);
        let pool = &self.inner.staging;
        let chunk_size = self.inner.config.chunk_size_bytes;
        let size = usize::try_from(source.len())
            .map_err(|_| Error::InvalidInput(format!("{path}: {} bytes do not fit in memory", source.len())))?;
        let threads = self.inner.config.staging_threads.max(1);
        let starts: Vec<usize> = (0..size).step_by(chunk_size).collect();
        let piece = |index: usize| (starts[index], (starts[index] + chunk_size).min(size) - starts[index]);
        let staging_error = |message| Error::InvalidInput(format!("staging {path}: {message}"));
        // Whole chunks get buffers of their own; a last piece smaller than a chunk is packed.
        let whole = if size % chunk_size == 0 { starts.len() } else { starts.len() - 1 };
        let mut next = 0;
        while next < whole {
            // One batch: every buffer free right now (at least one, waiting for it if need be), so
            // the copy leaves the async runtime once per batch rather than once per chunk.
            let first = next;
            let mut staged = vec![(piece(next), packer.buffer(pool).await?)];
            next += 1;
            while next < whole && staged.len() < MAX_COPY_BATCH {
                let Some(buf) = pool.try_acquire() else { break };
                staged.push((piece(next), buf));
                next += 1;
            }
            copy_blocking(source, &mut staged, threads).map_err(staging_error)?;
            for (offset, ((_, len), buf)) in staged.into_iter().enumerate() {
                progress.staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
                progress.copied_bytes.fetch_add(len as u64, Ordering::Relaxed);
                gate.send(chunks, StagedChunk { file: file_index, index: first + offset, data: buf.freeze() }).await?;
            }
        }
        if whole < starts.len() {
            let (offset, len) = piece(whole);
            let copy = |out: &mut [u8]| source.copy_into(offset, out);
            packer.add(pool, chunk_size, (file_index, whole, len), copy).await?.map_err(staging_error)?;
            progress.staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
            progress.copied_bytes.fetch_add(len as u64, Ordering::Relaxed);
        }
        Ok(starts.len())
    }
}

impl Client {
    /// Copies every item, then every lent file, into staging buffers and hands them to the
    /// uploaders.
    pub(super) async fn stage(
        &self,
        items: &[SaveItem],
        borrowed: &[(RelPath, Lent<'_>)],
        chunks: &mpsc::Sender<StagedChunk>,
        gate: &UploadGate,
        progress: &SaveProgress,
    ) -> Result<Vec<StagedFile>> {
        let pool = &self.inner.staging;
        let chunk_size = self.inner.config.chunk_size_bytes;
        let mut files = Vec::with_capacity(items.len());
        let mut packer = Packer { current: None, gate, chunks };
        for (file_index, item) in items.iter().enumerate() {
            match item {
                SaveItem::Directory { path } => {
                    files.push(StagedFile { path: path.clone(), size: 0, chunks: 0, kind: StagedKind::Directory })
                }
                SaveItem::Buffer { path, data } => {
                    let source = Lent::Bytes(data.as_ref());
                    let index = self.stage_copies(file_index, path, source, &mut packer, progress).await?;
                    files.push(StagedFile {
                        path: path.clone(),
                        size: data.len() as u64,
                        chunks: index,
                        kind: StagedKind::File { mode: 0 },
                    });
                }
                SaveItem::Shared { path, data } => {
                    let mut index = 0;
                    for start in (0..data.len()).step_by(chunk_size) {
                        let piece = data.slice(start..(start + chunk_size).min(data.len()));
                        progress.staged_bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
                        gate.send(chunks, StagedChunk { file: file_index, index, data: piece }).await?;
                        index += 1;
                    }
                    files.push(StagedFile {
                        path: path.clone(),
                        size: data.len() as u64,
                        chunks: index,
                        kind: StagedKind::File { mode: 0 },
                    });
                }
                SaveItem::File { path, source, mode } => {
                    let mut file = Some(open_regular(source)?);
                    let (mut index, mut size) = (0usize, 0u64);
                    loop {
                        let buf = packer.buffer(pool).await?;
                        let taken = file.take().expect("file is returned after each read");
                        let (returned, buf, read) = tokio::task::spawn_blocking(move || {
                            let mut buf = buf;
                            let read = read_full(&taken, &mut buf.buf_mut().full_mut()[..chunk_size]);
                            if let Ok(n) = read {
                                buf.buf_mut().set_len(n);
                            }
                            (taken, buf, read)
                        })
                        .await
                        .map_err(|e| Error::Cancelled(e.to_string()))?;
                        file = Some(returned);
                        let n = read.map_err(Error::io("read", source))?;
                        if n == 0 {
                            break;
                        }
                        size += n as u64;
                        progress.staged_bytes.fetch_add(n as u64, Ordering::Relaxed);
                        progress.copied_bytes.fetch_add(n as u64, Ordering::Relaxed);
                        let data = buf.freeze();
                        gate.send(chunks, StagedChunk { file: file_index, index, data }).await?;
                        index += 1;
                        if n < chunk_size {
                            break;
                        }
                    }
                    files.push(StagedFile {
                        path: path.clone(),
                        size,
                        chunks: index,
                        kind: StagedKind::File { mode: *mode },
                    });
                }
            }
        }
        for (path, source) in borrowed {
            let index = self.stage_copies(files.len(), path, *source, &mut packer, progress).await?;
            files.push(StagedFile {
                path: path.clone(),
                size: source.len(),
                chunks: index,
                kind: StagedKind::File { mode: 0 },
            });
        }
        packer.flush().await?;
        Ok(files)
    }
}

/// Pieces smaller than a chunk (a file's tail, a small file) share staging buffers: copied one
/// after another into the current buffer and handed to the uploaders as slices of it once it is
/// full or staging ends (the buffer returns to the pool when the last slice is uploaded). Without
/// this each would hold a whole chunk-sized buffer, and a model's hundreds of small tensors
/// (norms, biases) would exhaust staging long before its bytes do, making the trainer wait for
/// uploads.
pub(super) struct Packer<'a> {
    pub(super) current: Option<Packing>,
    pub(super) gate: &'a UploadGate,
    pub(super) chunks: &'a mpsc::Sender<StagedChunk>,
}

pub(super) struct Packing {
    pub(super) buf: starckpt_dataplane::buf::PooledBuf,
    pub(super) used: usize,
    /// (file, chunk index, start in the buffer, length)
    pub(super) pieces: Vec<(usize, usize, usize, usize)>,
}

impl Packer<'_> {
    /// A whole staging buffer for a whole chunk. If none is free, the packed buffer is handed to
    /// the uploaders first: it may be the one this would wait for.
    pub(super) async fn buffer(
        &mut self,
        pool: &starckpt_dataplane::buf::BufPool,
    ) -> Result<starckpt_dataplane::buf::PooledBuf> {
        if let Some(buf) = pool.try_acquire() {
            return Ok(buf);
        }
        self.flush().await?;
        Ok(self.gate.buffer(pool).await)
    }

    /// Copies a piece in with `copy`, starting a new buffer when the current one has no room.
    pub(super) async fn add(
        &mut self,
        pool: &starckpt_dataplane::buf::BufPool,
        chunk_size: usize,
        (file, index, len): (usize, usize, usize),
        copy: impl FnOnce(&mut [u8]) -> std::result::Result<(), String>,
    ) -> Result<std::result::Result<(), String>> {
        if self.current.as_ref().is_some_and(|p| p.used + len > chunk_size) {
            self.flush().await?;
        }
        if self.current.is_none() {
            self.current = Some(Packing { buf: self.gate.buffer(pool).await, used: 0, pieces: Vec::new() });
        }
        let packing = self.current.as_mut().expect("just set");
        let start = packing.used;
        // Off the async runtime, like every staging copy (a fill may be a device-to-host copy).
        if let Err(message) = off_runtime(|| copy(&mut packing.buf.buf_mut().full_mut()[start..start + len])) {
            return Ok(Err(message));
        }
        packing.pieces.push((file, index, start, len));
        packing.used += len;
        Ok(Ok(()))
    }

    /// Hands the current buffer's pieces to the uploaders.
    pub(super) async fn flush(&mut self) -> Result<()> {
        let Some(mut packing) = self.current.take() else { return Ok(()) };
        packing.buf.buf_mut().set_len(packing.used);
        let data = packing.buf.freeze();
        for (file, index, start, len) in packing.pieces {
            self.gate.send(self.chunks, StagedChunk { file, index, data: data.slice(start..start + len) }).await?;
        }
        Ok(())
    }
}

/// A function that fills `buffer` with a lent file's bytes from `offset` on (all of it), or says
/// why it could not.
pub type FillFn<'f> = dyn Fn(u64, &mut [u8]) -> std::result::Result<(), String> + Sync + 'f;

/// Bytes a save takes from the caller during the call ([`Client::save_lent`]).
#[derive(Clone, Copy)]
pub enum Lent<'a> {
    /// The caller's memory, copied into staging.
    Bytes(&'a [u8]),
    /// `size` bytes written by `fill(offset, buffer)` straight into each staging buffer in turn
    /// (buffers of one file may be filled from several threads, in any order): a device-to-host
    /// copy, say, which then needs no host copy of its own.
    Fill { size: u64, fill: &'a FillFn<'a> },
}

impl Lent<'_> {
    pub fn len(&self) -> u64 {
        match self {
            Lent::Bytes(data) => data.len() as u64,
            Lent::Fill { size, .. } => *size,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes bytes `[offset, offset + out.len())` of the source into `out`.
    pub(super) fn copy_into(&self, offset: usize, out: &mut [u8]) -> std::result::Result<(), String> {
        match self {
            Lent::Bytes(data) => {
                out.copy_from_slice(&data[offset..offset + out.len()]);
                Ok(())
            }
            Lent::Fill { fill, .. } => fill(offset as u64, out),
        }
    }
}

impl std::fmt::Debug for Lent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lent::Bytes(data) => write!(f, "Lent::Bytes({} bytes)", data.len()),
            Lent::Fill { size, .. } => write!(f, "Lent::Fill({size} bytes)"),
        }
    }
}

pub(super) fn as_lent<'a>(borrowed: &[(&'a str, &'a [u8])]) -> Vec<(&'a str, Lent<'a>)> {
    borrowed.iter().map(|(path, data)| (*path, Lent::Bytes(data))).collect()
}

/// Most chunks staged in one batch (1 GiB at 4 MiB chunks).
pub(super) const MAX_COPY_BATCH: usize = 256;

/// Queue slots for packed small pieces beyond one per staging buffer (a model's small tensors);
/// a save with more waits for uploads to drain them.
pub(super) const MAX_PACKED_PIECES: usize = 16 << 10;

/// Copies each `(offset, len)` piece of `source` into its buffer: the batch split into `threads`
/// runs of chunks, one per thread (the current one included), without stalling other tasks of a
/// multi-threaded runtime. The first failure of a fill is returned (after every run finished).
pub(super) fn copy_blocking(
    source: Lent<'_>,
    staged: &mut [((usize, usize), starckpt_dataplane::buf::PooledBuf)],
    threads: usize,
) -> std::result::Result<(), String> {
    let copy_run = |run: &mut [((usize, usize), starckpt_dataplane::buf::PooledBuf)]| {
        for ((offset, len), buf) in run {
            source.copy_into(*offset, &mut buf.buf_mut().full_mut()[..*len])?;
            buf.buf_mut().set_len(*len);
        }
        Ok::<(), String>(())
    };
    let per_thread = staged.len().div_ceil(threads.max(1)).max(1);
    let run = || {
        let mut runs = staged.chunks_mut(per_thread);
        let Some(own) = runs.next() else { return Ok(()) };
        std::thread::scope(|scope| {
            let others: Vec<_> = runs.map(|other| scope.spawn(move || copy_run(other))).collect();
            let mut result = copy_run(own);
            for other in others {
                let joined = other.join().unwrap_or_else(|_| Err("a staging copy thread panicked".into()));
                result = result.and(joined);
            }
            result
        })
    };
    off_runtime(run)
}

/// Opens a file item's source for staging, refusing anything but a regular file: a path replaced
/// by a FIFO or a device since it was listed must not hang or stream without end. (Non-blocking
/// open, so a FIFO without a writer does not block; reads of a regular file ignore the flag.)
pub(super) fn open_regular(source: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(source)
        .map_err(Error::io("open", source))?;
    let meta = file.metadata().map_err(Error::io("stat", source))?;
    if !meta.is_file() {
        return Err(Error::InvalidInput(format!("{} is not a regular file", source.display())));
    }
    // Blocking reads from here on (a network filesystem may honour the flag with EAGAIN).
    // SAFETY: F_GETFL/F_SETFL on a descriptor `file` owns.
    let cleared = unsafe {
        let flags = libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GETFL);
        flags >= 0 && libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(Error::io("fcntl", source)(std::io::Error::last_os_error()));
    }
    Ok(file)
}

pub(super) fn read_full(file: &std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut reader = file;
    let mut done = 0;
    while done < buf.len() {
        match reader.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

pub(super) enum StagedKind {
    File { mode: u32 },
    Directory,
}

pub(super) struct StagedFile {
    pub(super) path: RelPath,
    pub(super) size: u64,
    pub(super) chunks: usize,
    pub(super) kind: StagedKind,
}
