//! The background side of a control plane: GC, re-replication, tier and recovery passes run one
//! at a time ([`Collector`]), and when targets were last heard ([`Heard`]).

use super::*;
use starckpt_dataplane::sync::LockExt;

/// Runs GC passes one at a time, for the RPC and the background task.
pub(super) struct Collector {
    pub(super) store: Arc<dyn MetaStore>,
    pub(super) config: ControlConfig,
    pub(super) running: tokio::sync::Mutex<()>,
    pub(super) repairing: tokio::sync::Mutex<()>,
    pub(super) tiering: tokio::sync::Mutex<()>,
    /// Readers' recoveries (`RecoverChunks`) served at once.
    pub(super) recovering: Arc<tokio::sync::Semaphore>,
    /// Transports to live targets for recoveries, kept between them (a restore that lost its
    /// targets asks once per chunk).
    pub(super) transports: std::sync::Mutex<HashMap<(String, std::net::SocketAddr), Arc<dyn ChunkTransport>>>,
    /// Targets a recovery found unreachable, and since when: later ones skip them a while.
    pub(super) unreachable: std::sync::Mutex<HashMap<String, std::time::Instant>>,
    /// What this control plane's own data-plane requests carry, signed with the cluster key per
    /// target (none without one): garbage collection's may delete and list; re-replication's, the
    /// tier's and recoveries' only read and write.
    pub(super) collecting: Credentials,
    pub(super) copying: Credentials,
    /// Why garbage collection is paused, while it is: the control planes sharing the database
    /// disagree on settings, or this host's clock has drifted from the database server's
    /// ([`refresh_membership`]). Either breaks the argument that GC never deletes a chunk a
    /// commit may still name (`gc.rs`).
    pub(super) gc_paused: std::sync::Mutex<Option<String>>,
    pub(super) heard: Heard,
    /// Targets clients reported silent ([`crate::control::silence`]).
    pub(super) reports: crate::control::silence::Reports,
}

/// When this control plane last heard each target it knows registered (ms since the epoch),
/// ahead of the database: a heartbeat counts from its arrival, not from when its write commits,
/// which a database busy with a storm of commits can hold back past the age that turns a target
/// suspect. Other control planes sharing the database see the written times. One entry per
/// target that ever heartbeated here (each needs the cluster key's proof).
#[derive(Default)]
pub(super) struct Heard(std::sync::Mutex<HashMap<String, u64>>);

impl Heard {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.0.lock_unpoisoned()
    }

    /// A heartbeat of `target` arrived at `at`: counted now if the target is known here.
    pub(super) fn arrived(&self, target: &str, at: u64) {
        if let Some(last) = self.lock().get_mut(target) {
            *last = (*last).max(at);
        }
    }

    /// `target`'s registration or heartbeat of `at` is written: known from now on.
    pub(super) fn written(&self, target: &str, at: u64) {
        let mut heard = self.lock();
        let last = heard.entry(target.to_owned()).or_insert(at);
        *last = (*last).max(at);
    }

    pub(super) fn forget(&self, target: &str) {
        self.lock().remove(target);
    }

    /// `targets` as listed, each last heard when its written heartbeat or one heard here says.
    pub(super) fn apply(&self, mut targets: Vec<TargetRecord>) -> Vec<TargetRecord> {
        let heard = self.lock();
        for target in &mut targets {
            if let Some(&at) = heard.get(&target.target_id) {
                target.last_heartbeat_ms = target.last_heartbeat_ms.max(at);
            }
        }
        targets
    }
}

/// How long recoveries skip a target one of them found unreachable.
pub(super) const UNREACHABLE_SKIPPED_FOR: Duration = Duration::from_secs(30);

impl Collector {
    /// Every registered target, last heard as [`Heard`] says.
    pub(super) async fn list_targets(&self) -> Result<Vec<TargetRecord>, MetaError> {
        Ok(self.heard.apply(self.store.list_targets().await?))
    }

    /// Every registered target, with its data address when it is alive.
    pub(super) async fn targets(
        &self,
        now: u64,
    ) -> Result<Vec<(TargetRecord, Option<std::net::SocketAddr>)>, MetaError> {
        Ok(self
            .list_targets()
            .await?
            .into_iter()
            .map(|target| {
                let address = is_alive(&target, now, self.config.liveness_timeout)
                    .then(|| target.data_address.parse().ok())
                    .flatten();
                (target, address)
            })
            .collect())
    }

    /// One garbage-collection pass, one at a time in the cluster ([`Role::Gc`]); None when
    /// another control plane is running one and `wait` is false.
    pub(super) async fn run(&self, wait: bool) -> Result<Option<GcReport>, MetaError> {
        let _one_at_a_time = self.running.lock().await;
        if let Some(why) = self.gc_paused.lock_unpoisoned().clone() {
            return Err(MetaError::FailedPrecondition(format!(
                "garbage collection is paused until control planes agree again: {why}"
            )));
        }
        let Some(_leadership) = self.lead(Role::Gc, wait).await? else {
            tracing::debug!("another control plane is collecting garbage; this pass is skipped");
            return Ok(None);
        };
        let targets = self.targets(now_ms()).await?;
        let report = gc::collect(self.store.as_ref(), targets, &self.collecting, &self.config.gc).await?;
        metrics::counter!("starckpt_control_gc_chunks_deleted_total").increment(report.chunks_deleted);
        Ok(Some(report))
    }

    /// Role `role` for a pass: taken at once, or None while another control plane of the
    /// database holds it; with `wait`, once that one lets it go (an operator's pass runs after
    /// the one in progress instead of being skipped).
    pub(super) async fn lead(&self, role: Role, wait: bool) -> Result<Option<Leadership>, MetaError> {
        let mut pause = Duration::from_millis(100);
        loop {
            if let Some(leadership) = self.store.try_lead(role).await? {
                return Ok(Some(leadership));
            }
            if !wait {
                return Ok(None);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// One re-replication pass: one at a time in the cluster (like GC, whose sweeps it must not
    /// race for disks, here; [`Role::Repair`] across control planes sharing a database). None
    /// when another control plane is running one and `wait` is false.
    pub(super) async fn rereplicate(&self, wait: bool) -> Result<Option<RepairReport>, MetaError> {
        let _one_at_a_time = self.repairing.lock().await;
        let Some(_leadership) = self.lead(Role::Repair, wait).await? else {
            tracing::debug!("another control plane is re-replicating; this pass is skipped");
            return Ok(None);
        };
        let now = now_ms();
        let targets = self.targets(now).await?;
        let tier = self.config.tier.as_deref();
        let report = repair::rereplicate(
            self.store.as_ref(),
            targets,
            &self.copying,
            now,
            self.config.default_replicas,
            &self.config.repair,
            tier,
        )
        .await?;
        metrics::counter!("starckpt_control_repair_copies_total").increment(report.copies_made);
        metrics::gauge!("starckpt_control_under_replicated_chunks").set(report.still_under_replicated as f64);
        // The pass is done whatever becomes of its record: its report is not lost to that.
        if let Err(error) = self.store.record_repair_pass(now_ms(), report.still_under_replicated).await {
            tracing::warn!(%error, "could not record the re-replication pass; status reports the one before");
        }
        Ok(Some(report))
    }

    /// Chunks a reader could get from no target it tried: found and verified, or copied again
    /// from a live target or the tier ([`repair::recover`]). The caller holds a `recovering` permit.
    pub(super) async fn recover(&self, chunks: &[(ChunkHash, CommittedChunk)]) -> Result<repair::Recovered, MetaError> {
        let targets = self.targets(now_ms()).await?;
        // Short timeouts: a reader waits on this.
        let tcp = TcpConfig {
            connections_per_target: 1,
            connect_timeout: Duration::from_secs(2),
            deadline: Deadline { allowance: Duration::from_secs(2), ..Deadline::default() },
            credentials: self.copying.clone(),
            ..TcpConfig::default()
        };
        let live = {
            let mut cached = self.transports.lock_unpoisoned();
            let live = crate::control::copying::live_targets_with(&targets, |id, address| {
                let transport = cached
                    .entry((id.to_owned(), address))
                    .or_insert_with(|| crate::control::copying::tcp_with(id, address, tcp.clone()));
                Arc::clone(transport)
            });
            // Only live targets' transports are kept.
            cached.retain(|(id, address), _| targets.iter().any(|(t, a)| t.target_id == *id && *a == Some(*address)));
            live
        };
        let skip: HashSet<String> = {
            let mut silent = self.unreachable.lock_unpoisoned();
            silent.retain(|_, since| since.elapsed() < UNREACHABLE_SKIPPED_FOR);
            silent.keys().cloned().collect()
        };
        let recovered = repair::recover(chunks, &live, self.config.tier.as_deref(), &self.config.repair, &skip).await;
        let mut silent = self.unreachable.lock_unpoisoned();
        for id in &recovered.unreachable {
            silent.insert(id.clone(), std::time::Instant::now());
        }
        Ok(recovered)
    }

    /// One tier pass (one at a time here; one at a time in the cluster, `tier.rs`).
    pub(super) async fn tier(&self, when: tier::Sweep) -> Result<TierReport, MetaError> {
        let tier = self.the_tier()?;
        let _one_at_a_time = self.tiering.lock().await;
        let targets = self.targets(now_ms()).await?;
        let report =
            tier::pass(self.store.as_ref(), tier, targets, &self.copying, &self.config.tier_config, when).await?;
        metrics::counter!("starckpt_control_tier_uploaded_bytes_total").increment(report.bytes_uploaded);
        Ok(report)
    }
}

impl Collector {
    pub(super) fn the_tier(&self) -> Result<&Tier, MetaError> {
        self.config.tier.as_deref().ok_or_else(|| {
            MetaError::FailedPrecondition(
                "this control plane has no object-store tier (starckpt server --tier URL)".into(),
            )
        })
    }
}

pub(super) fn is_alive(record: &TargetRecord, now: u64, liveness_timeout: Duration) -> bool {
    now.saturating_sub(record.last_heartbeat_ms) <= liveness_timeout.as_millis() as u64
}
