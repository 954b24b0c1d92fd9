//! Deleting chunks: the collector's guarded deletes, and removing a copy found bad.

use super::*;

impl ChunkStore {
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
}
