//! Reading chunks: from their replicas in order (a silent one left after a patience), verified,
//! into the caller's memory or as bytes; recoveries from the control plane; byte ranges and
//! whole files; and [`ChunkSource`], what a restore reads from.

use super::*;

impl Client {
    /// Reads one chunk from its replicas in order, verifying its hash; the first verified copy
    /// wins. Errors name the chunk and each target that failed.
    pub async fn read_chunk(&self, manifest: &CheckpointManifest, chunk: &ChunkRef) -> Result<Bytes> {
        self.fetch_chunk(manifest, chunk, None)
            .await?
            .ok_or_else(|| Error::Cancelled(format!("chunk {} was read into no buffer", chunk.hash)))
    }

    /// [`Client::read_chunk`] into `dest` (exactly the chunk's length): shared memory and RDMA
    /// place the bytes there straight from their slot, and they are verified where they lie. If
    /// every copy fails, `dest` holds unverified bytes and the error says so.
    pub async fn read_chunk_into(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        dest: &mut [u8],
    ) -> Result<()> {
        if dest.len() as u64 != chunk.length_bytes {
            return Err(Error::InvalidInput(format!(
                "chunk {} is {} bytes, buffer is {}",
                chunk.hash,
                chunk.length_bytes,
                dest.len()
            )));
        }
        self.fetch_chunk(manifest, chunk, Some(dest)).await.map(drop)
    }

    /// The replica loop of [`Client::read_chunk`] and [`Client::read_chunk_into`]: with `dest`,
    /// the verified chunk ends up there (`Ok(None)`), otherwise it is returned. A chunk no target
    /// could provide is handed to the control plane to recover (from a live target it did not
    /// know of, or from the object-store tier: [`Client::recover_chunks`]), then read once more.
    pub(super) async fn fetch_chunk(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        mut dest: Option<&mut [u8]>,
    ) -> Result<Option<Bytes>> {
        let error = match self.fetch_listed(manifest, chunk, dest.as_deref_mut()).await {
            Err(error @ (Error::ChunkUnavailable { .. } | Error::Target { .. } | Error::Checksum { .. })) => error,
            done => return done,
        };
        // Batched with other readers' chunks of this checkpoint (`recovery.rs`).
        match self.recover_chunk(manifest, chunk.hash).await {
            Ok(true) => {
                tracing::info!(chunk = %chunk.hash, "the control plane recovered a chunk no target had; reading it again");
                self.fetch_listed(manifest, chunk, dest).await
            }
            Ok(false) => Err(error),
            // Deleted since this reader fetched its manifest: no copy is to be had, and no
            // repair brings one back.
            Err(crate::recovery::Unanswered::Gone(said)) => Err(Error::Deleted {
                job: manifest.info.job.clone(),
                step: manifest.info.step,
                checkpoint_id: manifest.info.checkpoint_id,
                hash: chunk.hash,
                said,
            }),
            Err(recovering) => {
                tracing::warn!(chunk = %chunk.hash, error = %recovering, "the control plane could not recover a chunk");
                Err(error)
            }
        }
    }

    /// Asks the control plane to bring back copies of `hashes` (chunks of `manifest`'s checkpoint)
    /// on live targets, from a copy on another live target or from the object-store tier. Returns,
    /// per hash, whether a live target holds a verified copy now.
    pub async fn recover_chunks(&self, manifest: &CheckpointManifest, hashes: &[ChunkHash]) -> Result<Vec<bool>> {
        let info = &manifest.info;
        self.recover_chunks_of(&info.job, info.step, info.checkpoint_id, hashes).await
    }

    /// [`Client::recover_chunks`] for the checkpoint (`job`, `step`, `checkpoint_id`).
    pub(crate) async fn recover_chunks_of(
        &self,
        job: &str,
        step: u64,
        checkpoint_id: u64,
        hashes: &[ChunkHash],
    ) -> Result<Vec<bool>> {
        let request = pb::RecoverChunksRequest {
            job: job.to_owned(),
            step,
            checkpoint_id,
            hashes: hashes.iter().map(|hash| hash.to_bytes()).collect(),
        };
        let response =
            self.rpc("recover chunks", crate::Resend::Idempotent, request, |mut c, r| async move {
                c.recover_chunks(r).await
            })
            .await?;
        Ok(response.recovered)
    }

    /// One round of [`Client::fetch_chunk`]: the listed replicas, then live targets in the
    /// chunk's rendezvous order.
    pub(super) async fn fetch_listed(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        mut dest: Option<&mut [u8]>,
    ) -> Result<Option<Bytes>> {
        let mut last = None;
        // Replicas that answered with bad bytes or without the chunk: repaired once a good copy
        // is found.
        let mut damaged: Vec<&TargetInfo> = Vec::new();
        let order = replica_order(&manifest.targets, &chunk.replicas, |id| self.inner.targets.unreachable(id));
        let copies = order.len();
        for (attempt_index, target_id) in order.into_iter().enumerate() {
            let Some(target) = manifest.targets.get(target_id) else {
                last = Some(Error::InvalidInput(format!("chunk {} names unknown target {target_id}", chunk.hash)));
                continue;
            };
            let attempt = async {
                let mut address = target.data_address.clone();
                let mut transport = self.transport(target_id, &address)?;
                let mut fetched = fetch_from(&*transport, chunk, dest.as_deref_mut()).await;
                if let Err(error) = &fetched
                    && error.is_connection()
                    && let Some((moved, moved_transport)) = self.refreshed_transport(target_id, &address).await
                {
                    (address, transport) = (moved, moved_transport);
                    fetched = fetch_from(&*transport, chunk, dest.as_deref_mut()).await;
                }
                self.reached(target_id, !fetched.as_ref().is_err_and(TransportError::is_connection));
                let fetched = fetched.map_err(|source| Error::Target {
                    target_id: target_id.to_owned(),
                    address: address.clone(),
                    source,
                })?;
                // Bytes placed in `dest` were hashed as the transport copied them there.
                let checked = match fetched {
                    Fetched::Payload(payload) => {
                        verify(&manifest.addressing, chunk, payload).await?.map(|(data, name)| (Some(data), name))
                    }
                    Fetched::Placed(hash) if dest.is_none() => Err(format!("placed in no buffer ({hash})")),
                    Fetched::Placed(hash) => match manifest.addressing.name(hash) {
                        name if name.address == chunk.hash => Ok((None, name)),
                        name => Err(format!("got {}", name.address)),
                    },
                };
                checked.map_err(|found| Error::Checksum {
                    hash: chunk.hash,
                    found,
                    target_id: target_id.to_owned(),
                    address,
                })
            };
            // Another replica is there to read: one that does not answer within a few times
            // this client's usual read time is left for it (and tried last by the next reads),
            // rather than waited on for its whole deadline.
            let started = std::time::Instant::now();
            let patience = self.inner.targets.read_patience();
            let outcome = if attempt_index + 1 < copies {
                match tokio::time::timeout(patience, attempt).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        tracing::warn!(
                            chunk = %chunk.hash, target = %target_id, ?patience,
                            "a replica did not answer in time; reading the next replica"
                        );
                        self.reached(target_id, false);
                        last = Some(Error::Target {
                            target_id: target_id.to_owned(),
                            address: target.data_address.clone(),
                            source: TransportError::Timeout(patience),
                        });
                        continue;
                    }
                }
            } else {
                attempt.await
            };
            match outcome {
                Ok((data, name)) => {
                    self.inner.targets.read_took(started.elapsed());
                    let data = settle_chunk(data, dest.as_deref_mut());
                    if !damaged.is_empty() {
                        let good =
                            data.clone().unwrap_or_else(|| Bytes::copy_from_slice(dest.as_deref().unwrap_or(&[])));
                        for target in damaged {
                            self.repair_copy(target, name, good.clone());
                        }
                    }
                    return Ok(data);
                }
                Err(error) => {
                    let bad_copy = match &error {
                        Error::Checksum { .. } => true,
                        Error::Target { source: TransportError::Remote { code, .. }, .. } => {
                            matches!(code, ErrorCode::NotFound | ErrorCode::Corrupt)
                        }
                        _ => false,
                    };
                    if bad_copy {
                        damaged.push(target);
                    }
                    // Handled here by trying the next replica; the last failure is returned instead.
                    if attempt_index + 1 < chunk.replicas.len() {
                        tracing::warn!(%error, "replica read failed; trying the next replica");
                    }
                    last = Some(error);
                }
            }
        }
        // None of the listed copies: the control plane's re-replication puts lost copies on other
        // live targets, in the chunk's rendezvous order; look there.
        if let Some((data, name)) = self.read_elsewhere(manifest, chunk).await {
            for target in damaged {
                self.repair_copy(target, name, data.clone());
            }
            return Ok(settle_chunk(Some(data), dest));
        }
        let last = last.unwrap_or_else(|| Error::InvalidInput(format!("chunk {} has no replicas", chunk.hash)));
        // With a single replica the underlying error is the clearest message, unless it is that
        // the replica names a target unknown here (a cluster rebuilt around a tier's copy): the
        // control plane may still recover the chunk, so it is unavailable like any other.
        if chunk.replicas.len() == 1 && !matches!(last, Error::InvalidInput(_)) {
            Err(last)
        } else {
            Err(Error::ChunkUnavailable { hash: chunk.hash, last: Box::new(last) })
        }
    }

    /// A verified copy of `chunk` from a live target its manifest does not list, trying them in
    /// the chunk's rendezvous order (where re-replication puts new copies). None if none has one.
    pub(super) async fn read_elsewhere(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
    ) -> Option<(Bytes, ChunkName)> {
        let live: Vec<TargetInfo> = match self.targets().await {
            Ok(targets) => targets
                .into_iter()
                .filter(|t| t.state == pb::TargetState::Alive as i32 && !chunk.replicas.contains(&t.target_id))
                .collect(),
            Err(error) => {
                tracing::warn!(%error, "could not list targets to look for another copy");
                return None;
            }
        };
        let ids: Vec<&str> = live.iter().map(|t| t.target_id.as_str()).collect();
        for index in crate::placement::rank_targets(&chunk.hash, &ids) {
            let target = &live[index];
            let Ok(transport) = self.transport(&target.target_id, &target.data_address) else { continue };
            let Ok(payload) = transport.get(chunk.hash, 0, 0).await else { continue };
            if let Ok(Ok(verified)) = verify(&manifest.addressing, chunk, payload).await {
                tracing::info!(chunk = %chunk.hash, target = %target.target_id, "read a copy the manifest does not list");
                return Some(verified);
            }
        }
        None
    }

    /// Read repair, in the background: sends `data` (verified as the chunk `name`) to a target
    /// whose copy was bad or missing; it replaces its copy unless that verifies now. Bounded: when
    /// [`crate::REPAIRS_IN_FLIGHT`] repairs are queued or running, this one is skipped (logged).
    pub(super) fn repair_copy(&self, target: &TargetInfo, name: ChunkName, data: Bytes) {
        let hash = name.address;
        let Ok(permit) = Arc::clone(&self.inner.repairs).try_acquire_owned() else {
            tracing::warn!(chunk = %hash, target = %target.target_id, "read repair skipped: too many in flight");
            return;
        };
        let transport = match self.transport(&target.target_id, &target.data_address) {
            Ok(transport) => transport,
            Err(error) => return tracing::warn!(%error, "read repair skipped"),
        };
        let target_id = target.target_id.clone();
        let running = Arc::clone(&self.inner.repairs_running);
        tokio::spawn(async move {
            let _permit = permit;
            let Ok(_running) = running.acquire_owned().await else { return };
            match transport.put_named(&name, Payload::raw(data), true).await {
                Ok(false) => tracing::info!(chunk = %hash, target = %target_id, "read repair rewrote a bad copy"),
                Ok(true) => tracing::info!(chunk = %hash, target = %target_id, "read repair: the copy verifies now"),
                Err(error) => tracing::warn!(%error, chunk = %hash, target = %target_id, "read repair failed"),
            }
        });
    }

    /// `length` bytes of `path` starting at `offset`, verified. Whole chunks are fetched (a chunk
    /// can only be verified whole) and the range is cut from them.
    pub async fn read_range(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<Bytes> {
        // Checked before allocating: a bad length must be an error, not an abort.
        let size = manifest.require(path)?.size_bytes;
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::InvalidInput(format!("range {offset}+{length} is outside {path} ({size} bytes)")));
        }
        let length = usize::try_from(length)
            .map_err(|_| Error::InvalidInput(format!("range {offset}+{length} does not fit in memory")))?;
        // An allocation the system refuses (larger than memory) is an error, not an abort.
        let mut out = Vec::new();
        out.try_reserve_exact(length).map_err(|_| {
            Error::InvalidInput(format!(
                "{length} bytes of {path} do not fit in memory: read it in ranges, or into a buffer of yours"
            ))
        })?;
        out.resize(length, 0);
        self.read_range_into(manifest, path, offset, &mut out).await?;
        Ok(Bytes::from(out))
    }

    /// Fills `target` with the verified bytes of `path` from `offset` on (`target.len()` bytes),
    /// fetching up to `restore_concurrency` chunks at once and copying each straight into place.
    pub async fn read_range_into(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        offset: u64,
        target: &mut [u8],
    ) -> Result<()> {
        let concurrency = self.inner.config.restore_concurrency;
        self.read_range_into_with(manifest, path, offset, target, concurrency).await
    }

    /// [`Client::read_range_into`] with at most `concurrency` chunks in flight: callers reading
    /// several ranges at once share the client's `restore_concurrency` out among them.
    pub async fn read_range_into_with(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        offset: u64,
        target: &mut [u8],
        concurrency: usize,
    ) -> Result<()> {
        let file = manifest.require(path)?;
        let length = target.len() as u64;
        let end = offset.checked_add(length).filter(|end| *end <= file.size_bytes).ok_or_else(|| {
            Error::InvalidInput(format!("range {offset}+{length} is outside {path} ({} bytes)", file.size_bytes))
        })?;
        // Each chunk gets the part of `target` it fills (chunks come in file order), so they are
        // fetched concurrently straight into place. A loop rather than a stream of closures: the
        // future stays provably Send, so callers can spawn it.
        let mut chunks = file.chunks_in_range(offset, length);
        let mut unfilled: &mut [u8] = target;
        let mut fetched = futures::stream::FuturesUnordered::new();
        loop {
            while fetched.len() < concurrency.max(1) {
                let Some((start, chunk)) = chunks.next() else { break };
                let from = offset.saturating_sub(start);
                let to = (end - start).min(chunk.length_bytes);
                let (part, rest) = std::mem::take(&mut unfilled).split_at_mut(to.saturating_sub(from) as usize);
                unfilled = rest;
                fetched.push(self.read_chunk_part(manifest, chunk, from as usize, part));
            }
            match fetched.next().await {
                Some(result) => result?,
                None => return Ok(()),
            }
        }
    }

    /// Fills `part` with `chunk`'s verified bytes from `from` on: in place when `part` is the
    /// whole chunk, through a whole-chunk read otherwise (a chunk is verified whole).
    pub(super) async fn read_chunk_part(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        from: usize,
        part: &mut [u8],
    ) -> Result<()> {
        if from == 0 && part.len() as u64 == chunk.length_bytes {
            return self.read_chunk_into(manifest, chunk, part).await;
        }
        let data = self.read_chunk(manifest, chunk).await?;
        part.copy_from_slice(&data[from..from + part.len()]);
        starckpt_dataplane::buf::copies::record(part.len());
        Ok(())
    }

    /// A whole file, verified.
    pub async fn read_file(&self, manifest: &CheckpointManifest, path: &str) -> Result<Bytes> {
        let size = manifest.file(path).map(|f| f.size_bytes).unwrap_or(0);
        self.read_range(manifest, path, 0, size).await
    }

    /// Streams the verified contents of `path` to `out`, in order, fetching up to
    /// `restore_concurrency` chunks ahead. Returns the bytes written.
    pub async fn copy_file_to<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        out: &mut W,
    ) -> Result<u64> {
        use tokio::io::AsyncWriteExt;
        let file = manifest.require(path)?;
        let mut fetched = futures::stream::iter(file.chunks.iter().map(|chunk| self.read_chunk(manifest, chunk)))
            .buffered(self.inner.config.restore_concurrency.max(1));
        let mut written = 0;
        while let Some(data) = fetched.next().await {
            let data = data?;
            out.write_all(&data).await.map_err(Error::io("write", "output"))?;
            written += data.len() as u64;
        }
        out.flush().await.map_err(Error::io("write", "output"))?;
        Ok(written)
    }

    /// Fills `target` (exactly the file's size) with the verified contents of `path`.
    pub async fn read_into(&self, manifest: &CheckpointManifest, path: &str, target: &mut [u8]) -> Result<()> {
        let size = manifest.file(path).map_or(target.len() as u64, |f| f.size_bytes);
        if target.len() as u64 != size {
            return Err(Error::InvalidInput(format!("{path} is {size} bytes, buffer is {}", target.len())));
        }
        self.read_range_into(manifest, path, 0, target).await
    }
}

/// Decodes a fetched copy of `chunk` and checks it against the manifest, off the runtime: the
/// chunk's bytes and its name (what read repair stores them under), or `Err(what was wrong)`.
/// The outer error is only a cancelled task.
pub(super) async fn verify(
    addressing: &Addressing,
    chunk: &ChunkRef,
    payload: Payload,
) -> Result<std::result::Result<(Bytes, ChunkName), String>> {
    let (hash, length, addressing) = (chunk.hash, chunk.length_bytes, *addressing);
    tokio::task::spawn_blocking(move || payload.verified(&addressing, hash, length))
        .await
        .map_err(|e| Error::Cancelled(e.to_string()))
}

/// One GET of a whole chunk: into `dest` when there is one and the transport can put it there.
pub(super) async fn fetch_from(
    transport: &dyn ChunkTransport,
    chunk: &ChunkRef,
    dest: Option<&mut [u8]>,
) -> std::result::Result<Fetched, TransportError> {
    match dest {
        Some(dest) => transport.get_into(chunk.hash, dest).await,
        None => transport.get(chunk.hash, 0, 0).await.map(Fetched::Payload),
    }
}

/// A verified chunk: copied into `dest` when there is one and it came as bytes (`None` then).
pub(super) fn settle_chunk(data: Option<Bytes>, dest: Option<&mut [u8]>) -> Option<Bytes> {
    match (data, dest) {
        (Some(data), Some(dest)) => {
            dest.copy_from_slice(&data);
            starckpt_dataplane::buf::copies::record(data.len());
            None
        }
        (data, _) => data,
    }
}

/// The order to try a chunk's `replicas` in: copies on targets the control plane last saw alive
/// and this client has not failed to reach lately first, then the rest; as listed otherwise. A
/// target that is down then costs a restore one timeout, not one per chunk it holds.
pub(super) fn replica_order<'a>(
    targets: &HashMap<String, TargetInfo>,
    replicas: &'a [String],
    unreachable: impl Fn(&str) -> bool,
) -> Vec<&'a str> {
    let mut order: Vec<&str> = replicas.iter().map(String::as_str).collect();
    order.sort_by_cached_key(|id| {
        let alive = targets.get(*id).is_some_and(|t| t.state == pb::TargetState::Alive as i32);
        (unreachable(id), !alive)
    });
    order
}

/// Whether `file` is the file at `path` (not one unlinked, or replaced, since it was opened).
pub(super) fn is_at(file: &std::fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(open), Ok(named)) => (open.dev(), open.ino()) == (named.dev(), named.ino()),
        _ => false,
    }
}

/// Atomically exchanges two paths (renameat2 RENAME_EXCHANGE).
pub(super) fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(a.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let b = std::ffi::CString::new(b.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: both are NUL-terminated paths that outlive the call.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Where a restore reads a checkpoint's chunks: the cluster's targets ([`Client`]), or the
/// object-store tier when the cluster is gone (`starckpt restore --from-tier`).
pub trait ChunkSource: Sync {
    /// The chunk's bytes, verified against its hash; an error names the chunk and the source.
    fn read_chunk(&self, manifest: &CheckpointManifest, chunk: &ChunkRef)
    -> impl Future<Output = Result<Bytes>> + Send;
}

impl ChunkSource for Client {
    fn read_chunk(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
    ) -> impl Future<Output = Result<Bytes>> + Send {
        Client::read_chunk(self, manifest, chunk)
    }
}
