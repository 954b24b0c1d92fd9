//! [`AutoTransport`], what the SDK uses: asks a target over TCP (STAT, in the background, so
//! no request waits for it) for its shared-memory endpoint, host and RDMA device. On the same host
//! it attaches shared memory; elsewhere, when both sides have RDMA, it sets up an RDMA connection
//! (`rdma.rs`, `shm.rs`). It uses TCP until then, when neither applies, when the setup fails
//! (tried again later), and for any request that fails to connect over the faster transport.

use std::sync::Mutex;

use crate::shm::{self, Region};

use super::*;
use crate::sync::LockExt;

/// Shared memory to a target on this host, TCP otherwise (module docs).
///
/// Whether the target is local is found out in the background. The first requests wait for that
/// answer (a STAT's round trip, and the attach of a region on the same host) for at most
/// [`FIRST_PROBE_WAIT`]: a client started after a preemption otherwise sends its first
/// restore's chunks over TCP while shared memory comes up, queued on one connection long enough
/// to look like a sick target to the read's patience. Past that wait, and after a probe failed
/// (the target is down or slow; asked again after [`PROBE_RETRY`]), requests go over TCP.
pub struct AutoTransport {
    tcp: Arc<TcpTransport>,
    probe: Arc<Probe>,
}

/// How long after a failed probe (the target did not answer, or the attach failed) the next one
/// may start.
const PROBE_RETRY: Duration = Duration::from_secs(10);

/// How long requests wait for a transport's first probe to decide: a few round trips on a
/// network, well under a second; a target that does not answer STAT that fast is not waited for.
const FIRST_PROBE_WAIT: Duration = Duration::from_millis(250);

struct Probe {
    tcp: Arc<TcpTransport>,
    target_id: String,
    config: TcpConfig,
    shm_config: ShmConfig,
    slot_bytes: usize,
    /// The client's staging region, shared with targets on this host.
    staging: Option<Arc<Region>>,
    rdma: Option<Arc<RdmaClient>>,
    /// What the last probe decided: the faster transport set up, or None for TCP. Cleared when
    /// the faster transport fails (the target changed, the link broke): asked again later.
    decided: Mutex<Option<Option<Arc<dyn ChunkTransport>>>>,
    running: std::sync::atomic::AtomicBool,
    /// When the transport was made: requests wait for the first probe until [`FIRST_PROBE_WAIT`]
    /// after it.
    created: std::time::Instant,
    retry_at: Mutex<Option<std::time::Instant>>,
    finished: tokio::sync::Notify,
}

impl Probe {
    fn decision(&self) -> Option<Option<Arc<dyn ChunkTransport>>> {
        self.decided.lock_unpoisoned().clone()
    }

    /// The faster transport failed: back to TCP, and ask the target again after [`PROBE_RETRY`]
    /// (not at once: a broken path must not cost every request a failed attempt).
    fn demote(&self, failed: &Arc<dyn ChunkTransport>) {
        let mut decided = self.decided.lock_unpoisoned();
        if let Some(Some(current)) = decided.as_ref()
            && Arc::ptr_eq(current, failed)
        {
            *decided = None;
            *self.retry_at.lock_unpoisoned() = Some(std::time::Instant::now() + PROBE_RETRY);
        }
    }

    /// Starts a probe unless one is running, the answer is known, or the last one failed recently.
    fn start(self: &Arc<Self>) {
        if !(self.shm_config.enabled || self.rdma.is_some()) || self.decision().is_some() {
            return;
        }
        if self.retry_at.lock_unpoisoned().is_some_and(|at| std::time::Instant::now() < at) {
            return;
        }
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        // A probe may have finished (or the transport been demoted) between the checks above and
        // winning `running`: check again, now that no other probe can start.
        let retry_later = self.retry_at.lock_unpoisoned().is_some_and(|at| std::time::Instant::now() < at);
        if self.decision().is_some() || retry_later {
            self.running.store(false, Ordering::Release);
            self.finished.notify_waiters();
            return;
        }
        let probe = Arc::clone(self);
        tokio::spawn(async move {
            match probe.ask().await {
                Ok(decision) => {
                    *probe.decided.lock_unpoisoned() = Some(decision);
                }
                Err(error) => {
                    tracing::debug!(target = %probe.target_id, %error, "no shared memory with the target yet");
                    *probe.retry_at.lock_unpoisoned() = Some(std::time::Instant::now() + PROBE_RETRY);
                }
            }
            probe.running.store(false, Ordering::Release);
            probe.finished.notify_waiters();
        });
    }

    /// The target's answer: shared memory, attached, if it is on this host and serves it; else an
    /// RDMA connection if both sides have RDMA; else None (TCP).
    async fn ask(&self) -> Result<Option<Arc<dyn ChunkTransport>>, TransportError> {
        let stat = self.tcp.stat().await?;
        let here = shm::host_id();
        let local = stat.shm.filter(|e| self.shm_config.enabled && !here.is_empty() && e.host_id == here);
        let Some(endpoint) = local else {
            return match (&self.rdma, &stat.rdma_device) {
                (Some(rdma), Some(device)) => self.connect_rdma(rdma, device).await,
                _ => Ok(None),
            };
        };
        let attached = ShmTransport::connect(
            endpoint.socket.clone(),
            Some(&self.target_id),
            self.config.clone(),
            self.shm_config.slots,
            self.slot_bytes,
            self.staging.clone(),
        )
        .await;
        match attached {
            Ok(transport) => {
                tracing::debug!(target = %self.target_id, socket = %endpoint.socket.display(), "using shared memory");
                Ok(Some(Arc::new(transport)))
            }
            Err(error) => {
                tracing::info!(target = %self.target_id, %error, "shared memory unavailable; using TCP for now");
                Err(error)
            }
        }
    }

    async fn connect_rdma(
        &self,
        rdma: &Arc<RdmaClient>,
        device: &str,
    ) -> Result<Option<Arc<dyn ChunkTransport>>, TransportError> {
        let address = self.tcp.address();
        match RdmaTransport::connect(address, Some(&self.target_id), self.config.clone(), Arc::clone(rdma)).await {
            Ok(transport) => {
                tracing::debug!(target = %self.target_id, local = %rdma.device(), remote = %device, "using RDMA");
                Ok(Some(Arc::new(transport)))
            }
            Err(error) => {
                tracing::info!(target = %self.target_id, %error, "RDMA unavailable; using TCP for now");
                Err(error)
            }
        }
    }
}

impl AutoTransport {
    /// `slot_bytes`: the largest payload that goes through shared memory (the client's chunk
    /// size); larger ones travel inline. `rdma`: this client's RDMA device, if it has one.
    pub fn new(
        address: SocketAddr,
        target_id: &str,
        config: TcpConfig,
        shm_config: ShmConfig,
        slot_bytes: usize,
        staging: Option<Arc<Region>>,
        rdma: Option<Arc<RdmaClient>>,
    ) -> AutoTransport {
        let tcp = Arc::new(TcpTransport::for_target(address, target_id, config.clone()));
        let probe = Arc::new(Probe {
            tcp: Arc::clone(&tcp),
            target_id: target_id.to_owned(),
            config,
            shm_config,
            slot_bytes,
            staging,
            rdma,
            decided: Mutex::new(None),
            running: std::sync::atomic::AtomicBool::new(false),
            created: std::time::Instant::now(),
            retry_at: Mutex::new(None),
            finished: tokio::sync::Notify::new(),
        });
        AutoTransport { tcp, probe }
    }

    /// The transport to use now (module docs); starts a probe if the answer is not known yet, and
    /// waits for the first one ([`FIRST_PROBE_WAIT`]).
    async fn chosen(&self) -> Arc<dyn ChunkTransport> {
        let waited = self.probe.created.elapsed();
        if self.probe.decision().is_none() && waited < FIRST_PROBE_WAIT {
            let _ = tokio::time::timeout(FIRST_PROBE_WAIT - waited, self.settle()).await;
        }
        match self.probe.decision() {
            Some(Some(fast)) => fast,
            Some(None) => Arc::clone(&self.tcp) as Arc<dyn ChunkTransport>,
            None => {
                self.probe.start();
                Arc::clone(&self.tcp) as Arc<dyn ChunkTransport>
            }
        }
    }

    /// Runs `op` on the chosen transport; a shared-memory or RDMA failure to connect is retried
    /// on TCP.
    async fn run<T, F>(&self, op: impl Fn(Arc<dyn ChunkTransport>) -> F) -> Result<T, TransportError>
    where
        F: std::future::Future<Output = Result<T, TransportError>>,
    {
        let sent = std::time::Instant::now();
        match self.run_once(&op).await {
            Err(error) if self.asks_again(&error, sent) => self.run_once(&op).await,
            other => other,
        }
    }

    /// Whether a request sent at `sent` that the target refused (UNAUTHORIZED) is sent again:
    /// once, with a fresh capability (the cluster's key changed, or it got one, since the held
    /// one was asked for).
    fn asks_again(&self, error: &TransportError, sent: std::time::Instant) -> bool {
        matches!(error, TransportError::Remote { code: ErrorCode::Unauthorized, .. })
            && self.probe.config.credentials.invalidate(sent)
    }

    /// [`ChunkTransport::get_into`] on the chosen transport, on TCP if that fails to connect.
    async fn get_into_once(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        let chosen = self.chosen().await;
        match chosen.get_into(hash, dest).await {
            Err(error) if self.falls_back(&chosen, &error) => self.tcp.get_into(hash, dest).await,
            other => other,
        }
    }

    async fn run_once<T, F>(&self, op: &impl Fn(Arc<dyn ChunkTransport>) -> F) -> Result<T, TransportError>
    where
        F: std::future::Future<Output = Result<T, TransportError>>,
    {
        let chosen = self.chosen().await;
        match op(Arc::clone(&chosen)).await {
            Err(error) if self.falls_back(&chosen, &error) => {
                op(Arc::clone(&self.tcp) as Arc<dyn ChunkTransport>).await
            }
            other => other,
        }
    }

    /// Whether a request that failed with `error` on `chosen` is retried over TCP: a
    /// shared-memory or RDMA failure to connect is (and demotes that transport for a while).
    fn falls_back(&self, chosen: &Arc<dyn ChunkTransport>, error: &TransportError) -> bool {
        let kind = chosen.kind();
        if kind == "tcp" || !error.is_connection() {
            return false;
        }
        tracing::warn!(target = %self.probe.target_id, %error, "{kind} request failed; retrying over TCP");
        self.probe.demote(chosen);
        true
    }
}

#[async_trait]
impl ChunkTransport for AutoTransport {
    async fn put_named(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        self.run(|t| {
            let payload = payload.clone();
            async move { t.put_named(name, payload, repair).await }
        })
        .await
    }

    async fn get(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        self.run(|t| async move { t.get(hash, offset, length).await }).await
    }

    async fn get_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        let sent = std::time::Instant::now();
        match self.get_into_once(hash, dest).await {
            Err(error) if self.asks_again(&error, sent) => self.get_into_once(hash, dest).await,
            other => other,
        }
    }

    async fn has(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError> {
        self.run(|t| async move { t.has(hashes).await }).await
    }

    async fn stored(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError> {
        self.run(|t| async move { t.stored(hashes).await }).await
    }

    async fn delete(&self, hashes: &[ChunkHash], unused_for: Option<Duration>) -> Result<u64, TransportError> {
        self.run(|t| async move { t.delete(hashes, unused_for).await }).await
    }

    async fn list(&self, after: Option<ChunkHash>, limit: u32) -> Result<ChunkPage, TransportError> {
        self.run(|t| async move { t.list(after, limit).await }).await
    }

    async fn stat(&self) -> Result<TargetStat, TransportError> {
        self.run(|t| async move { t.stat().await }).await
    }

    fn kind(&self) -> &'static str {
        match self.probe.decision() {
            Some(Some(fast)) => fast.kind(),
            _ => "tcp",
        }
    }

    async fn settle(&self) {
        let deadline = self.probe.config.connect_timeout + self.probe.config.deadline.allowance;
        let _ = tokio::time::timeout(deadline, async {
            loop {
                let finished = self.probe.finished.notified();
                self.probe.start();
                if self.probe.decision().is_some() || !self.probe.running.load(Ordering::Acquire) {
                    return;
                }
                finished.await;
            }
        })
        .await;
    }
}
