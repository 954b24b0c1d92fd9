//! Reading chunks (whole, ranges, into a caller's buffer), presence checks (`HAS`, which also
//! marks chunks used), and listings for the collector.

use super::*;

impl ChunkStore {
    /// A buffer to read a chunk file of `bytes` into. A read's buffer is held until its bytes
    /// have gone out to the reader, which a slow one (a restore over a thin link) can make last:
    /// reads hold at most half the pool, so writes always find buffers, and a read beyond that
    /// share, or one finding the pool taken by writes, gets a buffer of its own (the data plane
    /// bounds those by in-flight bytes): a read never waits for writes.
    pub(super) fn read_buffer(&self, bytes: usize) -> BoxedBuf {
        if bytes <= self.pool.buf_bytes()
            && let Ok(share) = Arc::clone(&self.read_share).try_acquire_owned()
            && let Some(buf) = self.pool.try_acquire()
        {
            Box::new(SharedRead { buf, _share: share })
        } else {
            Box::new(AlignedBuf::new(bytes))
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
    pub(super) async fn mark_used(&self, hashes: Vec<ChunkHash>) -> Result<Vec<bool>, ChunkStoreError> {
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

    pub(super) async fn list_pages(
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
}
