//! Uploading staged chunks: hashing and placing each, HAS then PUT on every copy's target, copies
//! hedged on a lagging target, at most so many bytes in flight ([`UploadGate`]).

use super::*;

/// Holds the uploaders back until staging is done or has to wait for a buffer (module docs).
pub(super) struct UploadGate(pub(super) tokio::sync::watch::Sender<bool>, pub(super) Arc<SaveProgress>);

impl UploadGate {
    pub(super) fn open(&self) {
        self.0.send_replace(true);
    }

    /// A staging buffer; if none is free, lets the uploads start (they return buffers) and waits.
    pub(super) async fn buffer(&self, pool: &starckpt_dataplane::buf::BufPool) -> starckpt_dataplane::buf::PooledBuf {
        match pool.try_acquire() {
            Some(buf) => buf,
            None => {
                // Counted before the gate opens: the uploads then know not to wait for staging.
                self.1.staging_waits.fetch_add(1, Ordering::Release);
                self.open();
                pool.acquire().await
            }
        }
    }

    /// Queues a staged chunk; if the queue is full, lets the uploads start and waits.
    pub(super) async fn send(&self, chunks: &mpsc::Sender<StagedChunk>, chunk: StagedChunk) -> Result<()> {
        let closed = || Error::Cancelled("upload stopped".into());
        match chunks.try_send(chunk) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(chunk)) => {
                self.1.staging_waits.fetch_add(1, Ordering::Release);
                self.open();
                chunks.send(chunk).await.map_err(|_| closed())
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(closed()),
        }
    }
}

pub(super) struct StagedChunk {
    pub(super) file: usize,
    pub(super) index: usize,
    /// A staging buffer frozen (it returns to the pool when dropped) or a slice of shared bytes.
    pub(super) data: Bytes,
}

/// The targets a save places chunks on, in the order the control plane offered them.
#[derive(Clone)]
pub(crate) struct Placement {
    pub(crate) ids: Vec<String>,
    pub(crate) transports: Vec<Arc<dyn ChunkTransport>>,
    pub(crate) addresses: Vec<String>,
    /// Each target's failure domain (its own id when unlabelled).
    pub(crate) domains: Vec<String>,
    /// Copies of each chunk to make (at most the number of targets).
    pub(crate) replicas: usize,
    /// How the job's chunks are addressed (`starckpt_proto::address`).
    pub(crate) addressing: Addressing,
}

pub(super) type ChunkRefs = std::collections::HashMap<(usize, usize), ChunkRef>;

pub(super) async fn upload_all(
    client: Client,
    receiver: mpsc::Receiver<StagedChunk>,
    mut gate: tokio::sync::watch::Receiver<bool>,
    host: Option<PathBuf>,
    placement: Placement,
    progress: Arc<SaveProgress>,
    concurrency: usize,
) -> Result<ChunkRefs> {
    let placement = Arc::new(placement);
    // A long save hears, every TARGETS_REFRESH, which targets the control plane found silent
    // since it began (heartbeats stopped, or another client's report), and places no more copies
    // there while others will do.
    let watcher = tokio::spawn({
        let client = client.clone();
        async move {
            let mut every = tokio::time::interval(TARGETS_REFRESH);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                every.tick().await;
                if let Err(error) = client.refresh_targets().await {
                    tracing::debug!(%error, "could not refresh the targets' states during a save");
                }
            }
        }
    });
    let _watching = AbortOnDrop(watcher.abort_handle());
    // A dropped gate (staging failed) also lets the queue drain. Opened because staging is done
    // (not because it ran out of buffers, which only these uploads give back), the uploads wait
    // for the host's other saves to stage too (`host_staging.rs`).
    let staged = gate.wait_for(|open| *open).await.is_ok();
    if staged
        && progress.staging_waits.load(Ordering::Acquire) == 0
        && let Some(path) = &host
    {
        crate::host_staging::wait_for_others(path).await;
    }
    let mut receiver = receiver;
    let staged = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx));
    let mut uploads = staged
        .map(|chunk| {
            let (client, placement, progress) = (client.clone(), Arc::clone(&placement), Arc::clone(&progress));
            async move {
                let (file, index) = (chunk.file, chunk.index);
                upload_one(&client, chunk.data, &placement, &progress).await.map(|chunk_ref| ((file, index), chunk_ref))
            }
        })
        .buffer_unordered(concurrency);
    let mut refs = ChunkRefs::new();
    while let Some(result) = uploads.next().await {
        let (key, chunk_ref) = result?;
        refs.insert(key, chunk_ref);
    }
    Ok(refs)
}

/// How often a save still uploading asks the control plane how the targets stand: one request
/// per saving client per period, only from saves that take longer than it.
pub(super) const TARGETS_REFRESH: std::time::Duration = std::time::Duration::from_secs(5);

/// Aborts a task when dropped.
pub(super) struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A copy lagging its chunk's first finished copy by this factor of that copy's time gets a
/// hedge: the same copy started on the next candidate target.
pub(super) const HEDGE_FACTOR: u32 = 4;
/// ... and by at least this long: below it, differences are queueing noise, not a sick target.
pub(super) const HEDGE_AFTER_MIN: std::time::Duration = std::time::Duration::from_millis(500);

/// Hashes one staged chunk and makes it durable on `placement.replicas` distinct targets: the
/// first ones in rendezvous order (targets this client recently found silent last), skipping
/// targets in a failure domain that already holds a copy while other domains remain. A target
/// that is unreachable, full, or misses its request's deadline is skipped for the next
/// candidate; the manifest records where each copy really is. Fails unless every copy is made.
///
/// Hedging: once one copy of the chunk is durable, a copy still running [`HEDGE_FACTOR`] times
/// longer (at least [`HEDGE_AFTER_MIN`]) is started on the next candidate as well, once per
/// chunk, and its target is tried last by this client's next chunks for a while (a silent host
/// would otherwise cost each chunk placed there its full deadline). The extra traffic is at most
/// one copy per lagging copy, and stops once the lagging target ranks last. Each copy runs in a
/// task of its own, to its deadline even when the chunk no longer waits for it: a request given
/// up keeps the memory it lent the target until the target can no longer touch it, and its
/// outcome still tells this client whether the target answers.
pub(crate) async fn upload_one(
    client: &Client,
    data: Bytes,
    placement: &Arc<Placement>,
    progress: &SaveProgress,
) -> Result<ChunkRef> {
    let length = data.len() as u64;
    let hashed = data.clone();
    let content = tokio::task::spawn_blocking(move || ChunkHash::of(&hashed))
        .await
        .map_err(|e| Error::Cancelled(e.to_string()))?;
    let name = placement.addressing.name(content);
    let hash = name.address;
    let chunk =
        Arc::new(ChunkBytes { data, compression: client.config().compression, payload: tokio::sync::OnceCell::new() });
    progress.chunks.fetch_add(1, Ordering::Relaxed);
    let ids: Vec<&str> = placement.ids.iter().map(String::as_str).collect();
    // Rendezvous order, but targets this client recently found silent or unreachable last: a
    // host that stopped answering costs a save one deadline, not one per chunk.
    let targets = &client.inner.targets;
    let (mut order, silent): (Vec<usize>, Vec<usize>) =
        rank_targets(&hash, &ids).into_iter().partition(|&i| !targets.unreachable(&placement.ids[i]));
    order.extend(silent);
    let wanted = placement.replicas.clamp(1, order.len().max(1));
    let mut stored: Vec<usize> = Vec::with_capacity(wanted);
    let mut running: Vec<usize> = Vec::with_capacity(wanted);
    let mut tried = vec![false; placement.ids.len()];
    // The next candidate: untried, in a domain without a copy (made or being made) first.
    let next = |tried: &[bool], stored: &[usize], running: &[usize]| {
        let used: std::collections::HashSet<&str> =
            stored.iter().chain(running).map(|&i| placement.domains[i].as_str()).collect();
        let untried = || order.iter().copied().filter(|&i| !tried[i]);
        untried().find(|&i| !used.contains(placement.domains[i].as_str())).or_else(|| untried().next())
    };
    let launch = |index: usize| {
        let (client, placement, chunk) = (client.clone(), Arc::clone(placement), Arc::clone(&chunk));
        let task = tokio::spawn(async move {
            let started = std::time::Instant::now();
            let outcome = store_on(&client, &placement, index, &name, &chunk).await;
            let reached = !matches!(&outcome, Err(Error::Target { source, .. }) if source.is_connection());
            client.reached(&placement.ids[index], reached);
            (outcome, started.elapsed())
        });
        async move { (index, task.await) }
    };
    let mut copies = futures::stream::FuturesUnordered::new();
    let mut hedge_at: Option<tokio::time::Instant> = None;
    let mut hedged = false;
    let mut uploaded = false;
    let mut last_error = None;
    while stored.len() < wanted {
        while stored.len() + running.len() < wanted {
            let Some(index) = next(&tried, &stored, &running) else { break };
            tried[index] = true;
            running.push(index);
            copies.push(launch(index));
        }
        let finished = match hedge_at.filter(|_| !hedged && !running.is_empty()) {
            Some(at) => match tokio::time::timeout_at(at, copies.next()).await {
                Ok(finished) => finished,
                Err(_) => {
                    hedged = true;
                    for lagging in running.clone() {
                        let Some(index) = next(&tried, &stored, &running) else { break };
                        tracing::info!(
                            chunk = %hash, lagging = %placement.ids[lagging], hedge = %placement.ids[index],
                            "a copy lags its sibling; starting it on another target too"
                        );
                        client.reached(&placement.ids[lagging], false);
                        tried[index] = true;
                        running.push(index);
                        copies.push(launch(index));
                    }
                    continue;
                }
            },
            None => copies.next().await,
        };
        let Some((index, joined)) = finished else { break };
        running.retain(|&i| i != index);
        let (outcome, took) = joined.map_err(|e| Error::Cancelled(e.to_string()))?;
        match outcome {
            Ok(already_present) => {
                uploaded |= !already_present;
                stored.push(index);
                let lag = (took * HEDGE_FACTOR).max(HEDGE_AFTER_MIN);
                hedge_at.get_or_insert(tokio::time::Instant::now() + lag);
            }
            Err(error) => {
                let Error::Target { source, .. } = &error else { return Err(error) };
                let retry_elsewhere = source.is_connection()
                    || matches!(
                        source,
                        TransportError::Remote {
                            code: starckpt_proto::data::ErrorCode::NoSpace
                                | starckpt_proto::data::ErrorCode::Busy
                                | starckpt_proto::data::ErrorCode::Internal
                                // A target set up with another cluster's key.
                                | starckpt_proto::data::ErrorCode::Unauthorized,
                            ..
                        }
                    );
                if !retry_elsewhere {
                    return Err(error);
                }
                tracing::warn!(%error, chunk = %hash, "target failed; placing the copy on the next candidate");
                last_error = Some(error);
            }
        }
    }
    if stored.len() < wanted {
        let last = last_error.unwrap_or_else(|| Error::InvalidInput("no live targets were offered".into()));
        return Err(if stored.is_empty() {
            Error::NoTarget { hash, last: Box::new(last) }
        } else {
            Error::Underreplicated { hash, stored: stored.len(), wanted, last: Box::new(last) }
        });
    }
    // Counted once per chunk, whatever the replication: `done_bytes` compares with the save's size.
    // The stored form, if a copy was sent (a chunk every target had is never encoded).
    let (codec, stored_length) = chunk.payload.get().map_or((Codec::None, length), |p| (p.codec, p.bytes.len() as u64));
    if uploaded {
        progress.uploaded_bytes.fetch_add(length, Ordering::Relaxed);
        progress.stored_bytes.fetch_add(stored_length, Ordering::Relaxed);
    } else {
        progress.deduplicated_chunks.fetch_add(1, Ordering::Relaxed);
        progress.deduplicated_bytes.fetch_add(length, Ordering::Relaxed);
    }
    Ok(ChunkRef {
        hash,
        length_bytes: length,
        stored_length_bytes: stored_length,
        codec,
        replicas: stored.iter().map(|&i| placement.ids[i].clone()).collect(),
    })
}

/// A chunk's bytes and their stored form, made on first need (a chunk every target already holds
/// is never compressed) and shared by all its copies.
pub(super) struct ChunkBytes {
    pub(super) data: Bytes,
    pub(super) compression: Option<CompressConfig>,
    pub(super) payload: tokio::sync::OnceCell<Payload>,
}

impl ChunkBytes {
    pub(super) async fn payload(&self) -> Result<Payload, TransportError> {
        let encode = || async {
            let Some(config) = self.compression else { return Ok(Payload::raw(self.data.clone())) };
            let data = self.data.clone();
            tokio::task::spawn_blocking(move || match codec::compress(&data, &config) {
                Some(compressed) => {
                    Payload { length: data.len() as u64, codec: compressed.codec, bytes: Bytes::from(compressed.bytes) }
                }
                None => Payload::raw(data),
            })
            .await
            // Not a connection problem: no other target would do better.
            .map_err(|e| TransportError::Protocol(format!("compression task failed: {e}")))
        };
        self.payload.get_or_try_init(encode).await.cloned()
    }
}

/// Makes the chunk durable on target `index` of the placement (HAS, then PUT if missing),
/// following the target to a new address once if it moved. Ok(true): it was there already.
pub(super) async fn store_on(
    client: &Client,
    placement: &Placement,
    index: usize,
    name: &ChunkName,
    chunk: &ChunkBytes,
) -> Result<bool> {
    let store = |transport: Arc<dyn ChunkTransport>| async move {
        crate::faults::point("client.put").map_err(|e| TransportError::Connection(e.to_string()))?;
        if transport.has(&[name.address]).await?.first() == Some(&true) {
            return Ok::<bool, TransportError>(true);
        }
        transport.put_named(name, chunk.payload().await?, false).await
    };
    let mut address = placement.addresses[index].clone();
    let mut outcome = store(Arc::clone(&placement.transports[index])).await;
    // A target that did not answer in time has not moved: asking again would wait once more.
    if let Err(error) = &outcome
        && error.is_connection()
        && !matches!(error, TransportError::Timeout(_))
        && let Some((moved, transport)) = client.refreshed_transport(&placement.ids[index], &address).await
    {
        address = moved;
        outcome = store(transport).await;
    }
    outcome.map_err(|source| Error::Target { target_id: placement.ids[index].clone(), address, source })
}

/// The addressing a control plane's answer describes (its `chunk_key`).
pub(crate) fn addressing_from(key: &[u8]) -> Result<Addressing> {
    Addressing::from_wire(key).map_err(|e| Error::InvalidInput(format!("the control plane's chunk addressing: {e}")))
}
