//! Writing chunks: the write buffers, verifying a chunk against its name, the durable write
//! protocol (a new file or a pooled one, fdatasync, atomic rename, directory fsync), space checks,
//! and repairs.

use super::*;

impl ChunkStore {
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
    pub(super) async fn verify(
        &self,
        hash: ChunkHash,
        chunk: ChunkWrite,
    ) -> Result<(ChunkWrite, ChunkHash), ChunkStoreError> {
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
    pub(super) async fn store_copy(
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
    pub(super) async fn check_space(&self, hash: ChunkHash, needed: u64, reserve: u64) -> Result<(), ChunkStoreError> {
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

    /// fsyncs the fan-out directories holding `hashes`, each once.
    pub(super) async fn sync_chunk_dirs(
        &self,
        hashes: impl IntoIterator<Item = ChunkHash>,
    ) -> Result<(), ChunkStoreError> {
        let dirs: std::collections::BTreeSet<PathBuf> = hashes.into_iter().map(|h| self.chunk_dir(&h)).collect();
        for dir in dirs {
            self.engine.sync_dir(dir.clone()).await.map_err(io_error("fsync", &dir))?;
        }
        Ok(())
    }
}
