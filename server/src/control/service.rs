//! The tonic service: converts requests into validated domain types, calls the [`MetaStore`],
//! and maps its errors to gRPC status codes.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use starckpt_dataplane::transport::{ChunkTransport, Credentials, Deadline, TcpConfig};
use starckpt_proto::capability::{ClusterKey, Rights};
use starckpt_proto::control::control_server::{Control, ControlServer};
use starckpt_proto::control::{self as pb};
use starckpt_proto::model::{
    AcquireLease, BeginCheckpoint, CommitPart, Manifest, TargetRegistration, validate_target_id,
};
use starckpt_proto::{Addressing, ChunkHash, JobName};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::auth::{Caller, Tokens};
use super::gc::{self, GcConfig, GcReport};
use super::repair::{self, RepairConfig, RepairReport};
use super::store::{
    CheckpointState, CommittedChunk, ControlPlaneMember, Leadership, ManifestOf, ManifestPage, MetaError, MetaStore,
    RetentionPolicy, Role, TargetIds, TargetRecord, fault, now_ms,
};
use super::tier::{self, Tier, TierConfig, TierReport};
use super::tls::ServerTls;

pub use starckpt_proto::control::MAX_RECOVER_CHUNKS;

mod collector;
mod config;
mod drafts;
mod startup;

pub use super::convert::checkpoint_info;
use super::convert::*;
pub(crate) use super::convert::{invalid, meta_status};
use collector::*;
pub use config::{ControlConfig, MAX_MESSAGE_BYTES};
pub use startup::{MAX_CLOCK_SKEW, open_store, redact_password, run};

pub struct ControlService {
    pub(super) store: Arc<dyn MetaStore>,
    config: ControlConfig,
    collector: Arc<Collector>,
    /// [`ControlService::checkpoint_chunks`]' recent answers: ((job, step, id), when, index).
    chunk_indexes: tokio::sync::Mutex<Vec<CachedIndex>>,
}

/// Every chunk a committed checkpoint names, with the targets its manifests list and the copies
/// it should have.
type ChunkIndex = HashMap<ChunkHash, CommittedChunk>;

/// ((job, step, checkpoint id), when it was read, its index).
type CachedIndex = ((String, u64, u64), std::time::Instant, Arc<ChunkIndex>);

/// How long a checkpoint's [`ChunkIndex`] is kept, and how many are.
const CHUNK_INDEX_TTL: Duration = Duration::from_secs(60);
const CHUNK_INDEXES_KEPT: usize = 4;

impl ControlService {
    /// Who sent `request`: the caller its bearer token names (`auth.rs`), or an operator where
    /// this control plane has no tokens.
    fn caller<T>(&self, request: &Request<T>) -> Result<Caller, Status> {
        match &self.config.tokens {
            None => Ok(Caller::Anyone),
            Some(tokens) => tokens.authenticate(request.metadata()),
        }
    }

    /// With a cluster key: refuses a registration or heartbeat of `target_id` whose sender does
    /// not prove it holds the key (`RegisterTargetRequest.proof`, bound to `scope`).
    fn check_target_proof(&self, target_id: &str, scope: &str, proof: &[u8]) -> Result<(), Status> {
        let Some(key) = &self.config.cluster_key else { return Ok(()) };
        key.verify(proof, Rights::TARGET, Some(scope), std::time::SystemTime::now()).map_err(|refused| {
            tracing::warn!(%target_id, %refused, "refused a target without proof of the cluster key");
            Status::permission_denied(format!(
                "target {target_id} did not prove it holds this cluster's key ({refused}): start it with the \
                 control plane's --cluster-key-file"
            ))
        })
    }
}

/// Credentials signing `rights` with `config`'s cluster key, if it has one, each capability for
/// one target and [`OWN_CAPABILITY_LIFETIME`] (at most): minting costs nothing, and one seen on
/// the wire is soon useless.
fn minted(config: &ControlConfig, rights: Rights) -> Credentials {
    let lifetime = config.capability_lifetime.min(OWN_CAPABILITY_LIFETIME);
    config.cluster_key.clone().map(|key| Credentials::minted(key, rights, lifetime)).unwrap_or_default()
}

/// Longest life of a client's capability on a control plane with bearer tokens: what a revoked
/// token's holder can still do on the data plane (the SDK renews at half of it).
const TOKEN_CAPABILITY_LIFETIME: Duration = Duration::from_secs(5 * 60);

/// How long the control plane's own capabilities last.
const OWN_CAPABILITY_LIFETIME: Duration = Duration::from_secs(120);

impl ControlService {
    pub fn new(store: Arc<dyn MetaStore>, config: ControlConfig) -> ControlService {
        let collector = Arc::new(Collector {
            store: Arc::clone(&store),
            config: config.clone(),
            running: Default::default(),
            repairing: Default::default(),
            tiering: Default::default(),
            recovering: Arc::new(tokio::sync::Semaphore::new(config.recoveries_at_once)),
            transports: Default::default(),
            unreachable: Default::default(),
            collecting: minted(&config, Rights::ALL),
            copying: minted(&config, Rights::CLIENT),
            gc_paused: Default::default(),
            heard: Heard::default(),
            reports: Default::default(),
        });
        ControlService { store, config, collector, chunk_indexes: Default::default() }
    }

    /// The chunks of committed checkpoint `id`, (job, step), for `RecoverChunks`: a restore that
    /// lost its copies asks once per chunk, so the index is kept a while rather than decoded from
    /// the manifests per call. NotFound when (job, step) is not that checkpoint, or it is no
    /// longer committed (deleted since it was indexed: its chunks are not to be brought back).
    async fn checkpoint_chunks(&self, job: &JobName, step: u64, id: u64) -> Result<Arc<ChunkIndex>, Status> {
        let key = (job.to_string(), step, id);
        let mut cached = self.chunk_indexes.lock().await;
        cached.retain(|(_, at, _)| at.elapsed() < CHUNK_INDEX_TTL);
        if let Some((_, _, index)) = cached.iter().find(|(cached, _, _)| *cached == key) {
            let index = Arc::clone(index);
            drop(cached);
            // Still committed? One part read (the page holds at least one), none decoded again.
            return match self.store.get_manifest_page(job, ManifestOf::Checkpoint(id), 0, 1).await {
                Ok(_) => Ok(index),
                Err(gone) => {
                    self.chunk_indexes.lock().await.retain(|(cached, _, _)| *cached != key);
                    Err(meta_status(gone))
                }
            };
        }
        let (record, parts) = self.store.get_manifest(job, Some(step)).await.map_err(meta_status)?;
        if record.id != id {
            return Err(Status::not_found(format!("{job} step {step} is checkpoint {} now, not {id}", record.id)));
        }
        let wanted = self.store.replication(job).await.map_err(meta_status)?.unwrap_or(self.config.default_replicas);
        let (mut index, mut ids) = (ChunkIndex::new(), TargetIds::default());
        for (_, manifest) in &parts {
            CommittedChunk::index(&mut index, manifest, wanted, &mut ids);
        }
        let index = Arc::new(index);
        if cached.len() >= CHUNK_INDEXES_KEPT {
            cached.remove(0);
        }
        cached.push((key, std::time::Instant::now(), Arc::clone(&index)));
        Ok(index)
    }

    /// How the chunks of `job` are addressed: with its tenant's key, derived from the cluster
    /// key (starckpt_proto::address).
    pub(super) fn job_addressing(&self, job: &JobName) -> Addressing {
        Addressing::of_job(self.config.cluster_key.as_ref(), job)
    }

    /// A target as listed: its state from its heartbeats, suspect also while a client's report
    /// of its silence stands ([`super::silence`]).
    fn target_info(&self, record: &TargetRecord, now: u64) -> pb::TargetInfo {
        let mut info = self.target_info_heard(record, now);
        if info.state == pb::TargetState::Alive as i32 && self.collector.reports.silent(&record.target_id, now) {
            info.state = pb::TargetState::Suspect as i32;
        }
        info
    }

    /// Every target the chunks of `manifests` are on, as listed (a reader's map of where to go).
    pub(super) async fn targets_named(
        &self,
        caller: &Caller,
        manifests: impl Iterator<Item = &Manifest>,
    ) -> Result<Vec<pb::TargetInfo>, Status> {
        let named: HashSet<&str> = manifests
            .flat_map(|m| m.files.iter())
            .flat_map(|f| f.chunks.iter())
            .flat_map(|c| c.replicas.iter().map(String::as_str))
            .collect();
        let now = now_ms();
        let targets = self.collector.list_targets().await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(targets.iter().filter(|t| named.contains(t.target_id.as_str())).map(|t| self.target_info(t, now)).collect())
    }

    /// A target, its state from its heartbeats alone.
    fn target_info_heard(&self, record: &TargetRecord, now: u64) -> pb::TargetInfo {
        let age = now.saturating_sub(record.last_heartbeat_ms);
        let state = if !is_alive(record, now, self.config.liveness_timeout) {
            pb::TargetState::Dead
        } else if age > 2 * self.config.heartbeat_interval.as_millis() as u64 {
            pb::TargetState::Suspect
        } else {
            pb::TargetState::Alive
        };
        pb::TargetInfo {
            target_id: record.target_id.clone(),
            data_address: record.data_address.clone(),
            capacity_bytes: record.capacity_bytes,
            used_bytes: record.used_bytes,
            chunk_count: record.chunk_count,
            state: state as i32,
            heartbeat_age_ms: age,
            failure_domain: record.failure_domain.clone(),
            rdma_device: record.rdma_device.clone(),
        }
    }
}
#[tonic::async_trait]
impl Control for ControlService {
    async fn register_target(
        &self,
        request: Request<pb::RegisterTargetRequest>,
    ) -> Result<Response<pb::RegisterTargetResponse>, Status> {
        let request = request.into_inner();
        let scope = starckpt_proto::capability::registration_scope(&request.target_id, &request.data_address);
        self.check_target_proof(&request.target_id, &scope, &request.proof)?;
        let registration = TargetRegistration::try_from(request).map_err(invalid)?;
        let now = now_ms();
        self.store.upsert_target(&registration, now).await.map_err(meta_status)?;
        self.collector.heard.written(&registration.target_id, now);
        tracing::info!(target_id = %registration.target_id, address = %registration.data_address, "target registered");
        Ok(Response::new(pb::RegisterTargetResponse {
            heartbeat_interval_ms: self.config.heartbeat_interval.as_millis() as u64,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let request = request.into_inner();
        validate_target_id(&request.target_id).map_err(invalid)?;
        self.check_target_proof(&request.target_id, &request.target_id, &request.proof)?;
        let now = now_ms();
        let heard = &self.collector.heard;
        heard.arrived(&request.target_id, now);
        starckpt_dataplane::faults::delay("control.heartbeat.record").await;
        let written = self
            .store
            .heartbeat(&request.target_id, request.capacity_bytes, request.used_bytes, request.chunk_count, now)
            .await;
        match written {
            Ok(()) => heard.written(&request.target_id, now),
            // Not registered (any more): it registers again, and is known from then on.
            Err(MetaError::NotFound(_)) => heard.forget(&request.target_id),
            Err(_) => {}
        }
        written.map_err(meta_status)?;
        Ok(Response::new(pb::HeartbeatResponse {}))
    }

    async fn list_targets(
        &self,
        request: Request<pb::ListTargetsRequest>,
    ) -> Result<Response<pb::ListTargetsResponse>, Status> {
        // Any caller: the targets' addresses are what every writer is sent (BeginCheckpoint).
        self.caller(&request)?;
        let now = now_ms();
        let targets = self.collector.list_targets().await.map_err(meta_status)?;
        // The cluster's last pass, whichever control plane ran it.
        let last = self.store.last_repair_pass().await.map_err(meta_status)?;
        Ok(Response::new(pb::ListTargetsResponse {
            targets: targets.iter().map(|t| self.target_info(t, now)).collect(),
            under_replicated_chunks: last.map(|(_, short)| short),
            repair_pass_age_ms: last.map_or(0, |(at, _)| now.saturating_sub(at)),
        }))
    }

    async fn acquire_lease(
        &self,
        request: Request<pb::AcquireLeaseRequest>,
    ) -> Result<Response<pb::AcquireLeaseResponse>, Status> {
        let caller = self.caller(&request)?;
        let mut request = AcquireLease::try_from(request.into_inner()).map_err(invalid)?;
        request.job = caller.new_job(request.job.as_str())?;
        let grant = self.store.acquire_lease(&request, now_ms()).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::AcquireLeaseResponse {
            epoch: grant.epoch,
            aborted_checkpoints: grant.aborted_checkpoints,
        }))
    }

    async fn begin_checkpoint(
        &self,
        request: Request<pb::BeginCheckpointRequest>,
    ) -> Result<Response<pb::BeginCheckpointResponse>, Status> {
        let caller = self.caller(&request)?;
        let mut request = BeginCheckpoint::try_from(request.into_inner()).map_err(invalid)?;
        request.job = caller.new_job(request.job.as_str())?;
        let now = now_ms();
        request.begun_after_ms = now.saturating_sub(self.config.pending_timeout.as_millis() as u64);
        let listed = self.collector.list_targets().await.map_err(|e| caller.told(meta_status(e)))?;
        let wanted = self.store.replication(&request.job).await.map_err(|e| caller.told(meta_status(e)))?;
        let wanted = wanted.unwrap_or(self.config.default_replicas);
        let heard = listed.iter().map(|t| self.target_info_heard(t, now)).collect();
        let placement = self.collector.reports.place(heard, wanted as usize, now);
        if placement.is_empty() {
            return Err(Status::failed_precondition("no live storage targets: start one with `starckpt target`"));
        }
        let replicas = wanted.clamp(1, placement.len() as u32);
        if replicas < wanted {
            tracing::warn!(
                job = %request.job,
                wanted,
                live_targets = placement.len(),
                "fewer live targets than the job's replication factor: this checkpoint gets {replicas} copies per chunk"
            );
        }
        let record = self.store.begin_checkpoint(&request, now).await.map_err(|e| caller.told(meta_status(e)))?;
        fault("control.begin.reply").map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::BeginCheckpointResponse {
            checkpoint_id: record.id,
            placement,
            replicas,
            chunk_key: self.job_addressing(&request.job).to_wire(),
        }))
    }

    async fn commit_part(
        &self,
        request: Request<pb::CommitPartRequest>,
    ) -> Result<Response<pb::CommitPartResponse>, Status> {
        let caller = self.caller(&request)?;
        let mut part = CommitPart::try_from(request.into_inner()).map_err(invalid)?;
        part.namespace = caller.namespace();
        part.cluster_key = self.config.cluster_key.clone();
        // Every replica must name a registered target, or restore could not find the chunk.
        let known: HashSet<String> = self
            .store
            .list_targets()
            .await
            .map_err(|e| caller.told(meta_status(e)))?
            .into_iter()
            .map(|t| t.target_id)
            .collect();
        for file in &part.manifest.files {
            for chunk in &file.chunks {
                if let Some(unknown) = chunk.replicas.iter().find(|r| !known.contains(*r)) {
                    return Err(Status::invalid_argument(format!(
                        "file {} chunk {} names unknown target {unknown}",
                        file.path, chunk.hash
                    )));
                }
            }
        }
        fault("control.commit.record").map_err(|e| caller.told(meta_status(e)))?;
        // The time the store judged the commit by (read with its writer lock held).
        let judged_at = std::sync::atomic::AtomicU64::new(0);
        let clock = || {
            let now = now_ms();
            judged_at.store(now, std::sync::atomic::Ordering::Relaxed);
            now
        };
        let timeout = self.config.pending_timeout.as_millis() as u64;
        let record = self.store.commit_part(&part, &clock, timeout).await.map_err(|e| caller.told(meta_status(e)))?;
        fault("control.commit.reply").map_err(|e| caller.told(meta_status(e)))?;
        // The part that committed it (an identical part sent again answers the same, and is not
        // counted twice: it committed nothing).
        let now = judged_at.load(std::sync::atomic::Ordering::Relaxed);
        if record.state == CheckpointState::Committed && record.committed_at_ms == Some(now) {
            tracing::info!(job = %record.job, step = record.step, bytes = record.total_bytes, "checkpoint committed");
            metrics::counter!("starckpt_control_checkpoints_committed_total").increment(1);
            metrics::counter!("starckpt_control_committed_bytes_total").increment(record.total_bytes);
        }
        Ok(Response::new(pb::CommitPartResponse {
            state: state_pb(record.state) as i32,
            parts_committed: record.parts_committed,
            world_size: record.world_size,
        }))
    }

    async fn latest(&self, request: Request<pb::LatestRequest>) -> Result<Response<pb::LatestResponse>, Status> {
        let caller = self.caller(&request)?;
        let job = caller.job(&request.into_inner().job)?;
        let record = self.store.latest(&job).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::LatestResponse { checkpoint: record.map(|r| checkpoint_info_for(&caller, &r)) }))
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        let caller = self.caller(&request)?;
        let jobs = self.store.list_jobs().await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::ListJobsResponse {
            jobs: jobs
                .into_iter()
                .filter(|j| caller.reaches(&j.job))
                .map(|j| pb::JobInfo {
                    job: caller.shown(&j.job),
                    committed_checkpoints: j.committed_checkpoints,
                    latest_step: j.latest_step,
                    committed_bytes: j.committed_bytes,
                })
                .collect(),
        }))
    }

    async fn list_checkpoints(
        &self,
        request: Request<pb::ListCheckpointsRequest>,
    ) -> Result<Response<pb::ListCheckpointsResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let job = caller.job(&request.job)?;
        let records = self
            .store
            .list_checkpoints(&job, request.include_inactive)
            .await
            .map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::ListCheckpointsResponse {
            checkpoints: records.iter().map(|r| checkpoint_info_for(&caller, r)).collect(),
        }))
    }

    async fn get_manifest(
        &self,
        request: Request<pb::GetManifestRequest>,
    ) -> Result<Response<pb::GetManifestResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let job = caller.job(&request.job)?;
        // A reader that pages gets pages of at most `manifest_page_bytes`; one that does not,
        // every part at once (up to the message size limit).
        let of = match request.checkpoint_id {
            Some(id) => ManifestOf::Checkpoint(id),
            None => ManifestOf::Step(request.step),
        };
        let page_bytes = if request.from_rank.is_some() { self.config.manifest_page_bytes } else { usize::MAX };
        let ManifestPage { record, parts, next_rank } = self
            .store
            .get_manifest_page(&job, of, request.from_rank.unwrap_or(0), page_bytes)
            .await
            .map_err(|e| caller.told(meta_status(e)))?;
        let targets = self.targets_named(&caller, parts.iter().map(|(_, m)| m)).await?;
        Ok(Response::new(pb::GetManifestResponse {
            checkpoint: Some(checkpoint_info_for(&caller, &record)),
            parts: parts
                .iter()
                .map(|(rank, manifest)| pb::RankManifest { rank: *rank, manifest: Some(pb::Manifest::from(manifest)) })
                .collect(),
            targets,
            next_rank,
        }))
    }

    async fn delete_checkpoint(
        &self,
        request: Request<pb::DeleteCheckpointRequest>,
    ) -> Result<Response<pb::DeleteCheckpointResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let job = caller.job(&request.job)?;
        if request.pending_checkpoint_id != 0 {
            let id = request.pending_checkpoint_id;
            self.store.abort_pending(&job, id, now_ms()).await.map_err(|e| caller.told(meta_status(e)))?;
            tracing::info!(%job, step = request.step, checkpoint = id, "pending checkpoint aborted by its writer");
            return Ok(Response::new(pb::DeleteCheckpointResponse {}));
        }
        let only = Some(request.checkpoint_id).filter(|&id| id != 0);
        self.store
            .delete_checkpoint(&job, request.step, only, now_ms())
            .await
            .map_err(|e| caller.told(meta_status(e)))?;
        tracing::info!(%job, step = request.step, "checkpoint deleted");
        Ok(Response::new(pb::DeleteCheckpointResponse {}))
    }

    async fn set_retention(
        &self,
        request: Request<pb::SetRetentionRequest>,
    ) -> Result<Response<pb::SetRetentionResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let job = caller.job(&request.job)?;
        let policy = request.policy.ok_or_else(|| Status::invalid_argument("policy is required"))?;
        let policy = RetentionPolicy { keep_last: policy.keep_last, keep_every: policy.keep_every };
        let deleted_steps =
            self.store.set_retention(&job, policy, now_ms()).await.map_err(|e| caller.told(meta_status(e)))?;
        tracing::info!(%job, ?policy, ?deleted_steps, "retention policy set");
        Ok(Response::new(pb::SetRetentionResponse { deleted_steps }))
    }

    async fn get_retention(
        &self,
        request: Request<pb::GetRetentionRequest>,
    ) -> Result<Response<pb::GetRetentionResponse>, Status> {
        let caller = self.caller(&request)?;
        let job = caller.job(&request.into_inner().job)?;
        let policy = self.store.get_retention(&job).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::GetRetentionResponse {
            policy: Some(pb::RetentionPolicy { keep_last: policy.keep_last, keep_every: policy.keep_every }),
        }))
    }

    async fn set_replication(
        &self,
        request: Request<pb::SetReplicationRequest>,
    ) -> Result<Response<pb::SetReplicationResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let job = caller.job(&request.job)?;
        self.store.set_replication(&job, request.replicas, now_ms()).await.map_err(|e| caller.told(meta_status(e)))?;
        tracing::info!(%job, replicas = request.replicas, "replication factor set");
        Ok(Response::new(pb::SetReplicationResponse {}))
    }

    async fn tag_checkpoint(
        &self,
        request: Request<pb::TagCheckpointRequest>,
    ) -> Result<Response<pb::TagCheckpointResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let job = caller.job(&request.job)?;
        starckpt_proto::model::validate_tag(&request.tag).map_err(invalid)?;
        self.store
            .tag_checkpoint(&job, request.step, &request.tag, request.remove)
            .await
            .map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::TagCheckpointResponse {}))
    }

    async fn collect_garbage(
        &self,
        request: Request<pb::CollectGarbageRequest>,
    ) -> Result<Response<pb::CollectGarbageResponse>, Status> {
        self.caller(&request)?.must_operate("garbage collection")?;
        let collector = Arc::clone(&self.collector);
        let report = detached("garbage collection", async move { collector.run(true).await })
            .await?
            .map_err(meta_status)?
            .ok_or_else(|| Status::internal("the garbage-collection pass did not run"))?;
        Ok(Response::new(pb::CollectGarbageResponse {
            live_chunks: report.live_chunks,
            targets_swept: report.targets_swept,
            target_errors: report.target_errors,
            targets_skipped: report.targets_skipped,
            chunks_listed: report.chunks_listed,
            chunks_deleted: report.chunks_deleted,
            chunks_in_grace: report.chunks_in_grace,
            duration_ms: report.duration.as_millis() as u64,
        }))
    }

    async fn rereplicate(
        &self,
        request: Request<pb::RereplicateRequest>,
    ) -> Result<Response<pb::RereplicateResponse>, Status> {
        self.caller(&request)?.must_operate("re-replication")?;
        Ok(Response::new(self.rereplicate_now().await?))
    }

    async fn chunk_addressing(
        &self,
        request: Request<pb::ChunkAddressingRequest>,
    ) -> Result<Response<pb::ChunkAddressingResponse>, Status> {
        let caller = self.caller(&request)?;
        let job = caller.new_job(&request.into_inner().job)?;
        Ok(Response::new(pb::ChunkAddressingResponse { chunk_key: self.job_addressing(&job).to_wire() }))
    }

    async fn data_capability(
        &self,
        request: Request<pb::DataCapabilityRequest>,
    ) -> Result<Response<pb::DataCapabilityResponse>, Status> {
        self.caller(&request)?;
        let Some(key) = &self.config.cluster_key else {
            return Ok(Response::new(pb::DataCapabilityResponse::default()));
        };
        // With tokens, a revoked token's capability must not outlive it by long.
        let lifetime = match self.config.tokens {
            Some(_) => self.config.capability_lifetime.min(TOKEN_CAPABILITY_LIFETIME),
            None => self.config.capability_lifetime,
        };
        let expires = std::time::SystemTime::now() + lifetime;
        Ok(Response::new(pb::DataCapabilityResponse {
            capability: key.mint(Rights::CLIENT, expires, None),
            expires_unix_ms: starckpt_proto::capability::unix_ms(expires),
            lifetime_ms: u64::try_from(lifetime.as_millis()).unwrap_or(u64::MAX),
        }))
    }

    async fn recover_chunks(
        &self,
        request: Request<pb::RecoverChunksRequest>,
    ) -> Result<Response<pb::RecoverChunksResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let job = caller.job(&request.job)?;
        if request.hashes.len() > MAX_RECOVER_CHUNKS {
            return Err(Status::invalid_argument(format!(
                "{} chunks exceed the limit of {MAX_RECOVER_CHUNKS} per call",
                request.hashes.len()
            )));
        }
        // The turn first: what waits for it holds no manifest.
        let recovering = Arc::clone(&self.collector.recovering);
        let turn = tokio::time::timeout(self.config.recovery_wait, recovering.acquire_owned()).await;
        let Ok(Ok(turn)) = turn else {
            // Not Unavailable: that would read as this control plane being down.
            return Err(Status::resource_exhausted("busy recovering other readers' chunks; try again shortly"));
        };
        let named =
            self.checkpoint_chunks(&job, request.step, request.checkpoint_id).await.map_err(|e| caller.told(e))?;
        let mut chunks = Vec::with_capacity(request.hashes.len());
        for hash in &request.hashes {
            let hash = ChunkHash::try_from(&hash[..]).map_err(|e| Status::invalid_argument(e.to_string()))?;
            let chunk = named.get(&hash).ok_or_else(|| {
                caller
                    .told(Status::invalid_argument(format!("chunk {hash} is not part of {job} step {}", request.step)))
            })?;
            chunks.push((hash, chunk.clone()));
        }
        drop(named);
        let collector = Arc::clone(&self.collector);
        let recovery = async move {
            let _turn = turn;
            collector.recover(&chunks).await
        };
        let recovered = detached("recovery", recovery).await?.map_err(|e| caller.told(meta_status(e)))?;
        metrics::counter!("starckpt_control_recovered_chunks_total")
            .increment(recovered.chunks.iter().filter(|r| **r).count() as u64);
        if recovered.from_tier > 0 {
            tracing::info!(%job, step = request.step, from_tier = recovered.from_tier, "a reader's chunks were read back from the tier");
        }
        Ok(Response::new(pb::RecoverChunksResponse { recovered: recovered.chunks, from_tier: recovered.from_tier }))
    }

    async fn import_tier(
        &self,
        request: Request<pb::ImportTierRequest>,
    ) -> Result<Response<pb::ImportTierResponse>, Status> {
        self.caller(&request)?.must_operate("importing the tier")?;
        let job = request.into_inner().job;
        let job = match job.is_empty() {
            true => None,
            false => Some(JobName::try_from(job.as_str()).map_err(|e| Status::invalid_argument(e.to_string()))?),
        };
        self.collector.the_tier().map_err(meta_status)?;
        let collector = Arc::clone(&self.collector);
        let import = async move {
            // GC's turn, as a pass takes it: no pass may mark before the import commits and sweep
            // after (its mark would not hold the imported checkpoints' chunks, `gc.rs`).
            let _one_at_a_time = collector.running.lock().await;
            let _leadership = collector.lead(Role::Gc, true).await?;
            tier::import(collector.store.as_ref(), collector.the_tier()?, job).await
        };
        let report = detached("import from the tier", import).await?.map_err(meta_status)?;
        Ok(Response::new(pb::ImportTierResponse {
            imported: report.imported.iter().map(checkpoint_info).collect(),
            present: report.present,
            errors: report.errors,
        }))
    }

    async fn put_draft(&self, request: Request<pb::PutDraftRequest>) -> Result<Response<pb::PutDraftResponse>, Status> {
        let caller = self.caller(&request)?;
        self.put_draft_as(&caller, request.into_inner()).await
    }

    async fn list_drafts(
        &self,
        request: Request<pb::ListDraftsRequest>,
    ) -> Result<Response<pb::ListDraftsResponse>, Status> {
        let caller = self.caller(&request)?;
        self.list_drafts_as(&caller, request.into_inner()).await
    }

    async fn get_draft(&self, request: Request<pb::GetDraftRequest>) -> Result<Response<pb::GetDraftResponse>, Status> {
        let caller = self.caller(&request)?;
        self.get_draft_as(&caller, request.into_inner()).await
    }

    async fn drop_draft(
        &self,
        request: Request<pb::DropDraftRequest>,
    ) -> Result<Response<pb::DropDraftResponse>, Status> {
        let caller = self.caller(&request)?;
        self.drop_draft_as(&caller, request.into_inner()).await
    }

    async fn put_job_file(
        &self,
        request: Request<pb::PutJobFileRequest>,
    ) -> Result<Response<pb::PutJobFileResponse>, Status> {
        let caller = self.caller(&request)?;
        self.put_job_file_as(&caller, request.into_inner()).await
    }

    async fn list_job_files(
        &self,
        request: Request<pb::ListJobFilesRequest>,
    ) -> Result<Response<pb::ListJobFilesResponse>, Status> {
        let caller = self.caller(&request)?;
        self.list_job_files_as(&caller, request.into_inner()).await
    }

    async fn get_job_file(
        &self,
        request: Request<pb::GetJobFileRequest>,
    ) -> Result<Response<pb::GetJobFileResponse>, Status> {
        let caller = self.caller(&request)?;
        self.get_job_file_as(&caller, request.into_inner()).await
    }

    async fn drop_job_file(
        &self,
        request: Request<pb::DropJobFileRequest>,
    ) -> Result<Response<pb::DropJobFileResponse>, Status> {
        let caller = self.caller(&request)?;
        self.drop_job_file_as(&caller, request.into_inner()).await
    }

    async fn report_silent_targets(
        &self,
        request: Request<pb::ReportSilentTargetsRequest>,
    ) -> Result<Response<pb::ReportSilentTargetsResponse>, Status> {
        // Any caller: what a report can do is bounded (`silence.rs`), and every writer meets the
        // targets it reports.
        self.caller(&request)?;
        let reported = request.into_inner().target_ids;
        if reported.len() > super::silence::MAX_REPORTED {
            return Err(Status::invalid_argument(format!(
                "{} targets reported, at most {}",
                reported.len(),
                super::silence::MAX_REPORTED
            )));
        }
        let now = now_ms();
        let targets = self.collector.list_targets().await.map_err(meta_status)?;
        let registered = targets.iter().map(|t| t.target_id.as_str());
        for id in self.collector.reports.record(&reported, registered, now) {
            tracing::warn!(target = %id, "a client reports a target silent: left out of new placements for a while");
        }
        Ok(Response::new(pb::ReportSilentTargetsResponse {
            targets: targets.iter().map(|t| self.target_info(t, now)).collect(),
        }))
    }

    async fn tier(&self, request: Request<pb::TierRequest>) -> Result<Response<pb::TierResponse>, Status> {
        self.caller(&request)?.must_operate("a tier pass")?;
        let collector = Arc::clone(&self.collector);
        let report = detached("tier pass", async move { collector.tier(tier::Sweep::Always).await })
            .await?
            .map_err(meta_status)?;
        Ok(Response::new(pb::TierResponse {
            ran: report.ran,
            swept: report.swept,
            checkpoints_tiered: report.checkpoints_tiered,
            checkpoints_behind: report.checkpoints_behind,
            chunks_uploaded: report.chunks_uploaded,
            bytes_uploaded: report.bytes_uploaded,
            chunks_present: report.chunks_present,
            chunks_deleted: report.chunks_deleted,
            manifests_deleted: report.manifests_deleted,
            errors: report.errors,
            duration_ms: report.duration.as_millis() as u64,
        }))
    }
}

/// Runs `work` in a task of its own and waits for it: a caller giving up (its RPC timed out, it
/// went away) stops the waiting, not a pass over the cluster half done, nor chunks half copied
/// back for a reader (whose retry then finds them).
async fn detached<T: Send + 'static>(what: &str, work: impl Future<Output = T> + Send + 'static) -> Result<T, Status> {
    tokio::spawn(work).await.map_err(|e| Status::internal(format!("{what}: {e}")))
}

impl ControlService {
    async fn rereplicate_now(&self) -> Result<pb::RereplicateResponse, Status> {
        let collector = Arc::clone(&self.collector);
        let pass = async move { collector.rereplicate(true).await };
        let report = detached("re-replication", pass)
            .await?
            .map_err(meta_status)?
            .ok_or_else(|| Status::internal("the re-replication pass did not run"))?;
        Ok(pb::RereplicateResponse {
            chunks: report.chunks,
            under_replicated: report.under_replicated,
            copies_made: report.copies_made,
            still_under_replicated: report.still_under_replicated,
            unreadable: report.unreadable,
            from_tier: report.from_tier,
            errors: report.errors,
            duration_ms: report.duration.as_millis() as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::startup::{join, refresh_membership};
    use super::*;

    /// A recovery that does not get its turn in time is told the control plane is busy
    /// (ResourceExhausted, which the SDK asks again after), not that it is down (Unavailable,
    /// which would move the SDK to another control plane).
    #[tokio::test]
    async fn a_recovery_that_waits_too_long_is_told_busy() {
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(dir.path().join("meta.db").to_str().unwrap()).await.unwrap();
        let config =
            ControlConfig { recoveries_at_once: 0, recovery_wait: Duration::from_millis(50), ..Default::default() };
        let service = ControlService::new(store, config);
        let request = pb::RecoverChunksRequest { job: "j".into(), step: 1, checkpoint_id: 1, hashes: vec![] };
        let status = service.recover_chunks(Request::new(request)).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
    }

    /// Control planes sharing PostgreSQL re-replicate (and collect garbage) one at a time: a periodic pass finds
    /// another running and is skipped, an operator's waits its turn, and every control plane
    /// reports the cluster's last pass, whichever ran it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control_planes_sharing_a_database_re_replicate_one_at_a_time() {
        let Some(url) = crate::testing::fresh_postgres_database("re-replicate one at a time").await.unwrap() else {
            return;
        };
        let (first, second) = (open_store(&url).await.unwrap(), open_store(&url).await.unwrap());
        let (first, second) = (
            ControlService::new(first, ControlConfig::default()),
            ControlService::new(second, ControlConfig::default()),
        );
        async fn under(service: &ControlService) -> Option<u64> {
            let request = Request::new(pb::ListTargetsRequest {});
            service.list_targets(request).await.unwrap().into_inner().under_replicated_chunks
        }
        assert_eq!(under(&second).await, None, "no pass yet");

        let report =
            one_at_a_time(&first, &second, Role::Repair, |c, wait| async move { c.rereplicate(wait).await }).await;
        assert_eq!(report.map(|r| r.still_under_replicated), Some(0));
        assert_eq!(under(&first).await, Some(0), "the other control plane's pass is the cluster's");
        // Garbage collection likewise.
        let report = one_at_a_time(&first, &second, Role::Gc, |c, wait| async move { c.run(wait).await }).await;
        assert!(report.is_some());
    }

    /// A control plane that finds another of its database running with other settings (one that
    /// joined while it looked gone) pauses garbage collection, an operator's pass included, and
    /// resumes it once the other has left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control_planes_that_disagree_pause_garbage_collection() {
        let Some(url) = crate::testing::fresh_postgres_database("disagreeing control planes").await.unwrap() else {
            return;
        };
        let store = open_store(&url).await.unwrap();
        let service = ControlService::new(Arc::clone(&store), ControlConfig::default());
        let member = |id: &str, pending_timeout_ms| ControlPlaneMember {
            id: format!("{id}/1"),
            listener: id.into(),
            pending_timeout_ms,
            gc_grace_ms: 600_000,
            security: String::new(),
            tier: String::new(),
        };
        let (this, other) = (member("this", 300_000), member("other", 500_000));
        assert_eq!(join(&*store, &this, true).await.unwrap(), None);
        refresh_membership(&service.collector, &this).await.unwrap();
        assert!(service.collector.run(true).await.unwrap().is_some(), "one control plane collects");

        // The other accepts commits later than this one's grace allows for.
        assert!(join(&*store, &other, false).await.unwrap().is_some());
        refresh_membership(&service.collector, &this).await.unwrap();
        let paused = service.collector.run(true).await.unwrap_err();
        assert!(matches!(&paused, MetaError::FailedPrecondition(m) if m.contains("paused")), "{paused}");

        store.leave_control_planes(&other.id).await.unwrap();
        refresh_membership(&service.collector, &this).await.unwrap();
        assert!(service.collector.run(true).await.unwrap().is_some(), "resumed once they agree");
    }

    /// With `role` held through `holder`'s database, `pass` on `other`'s collector is skipped
    /// unless it waits, and then runs once the role is let go; its report.
    async fn one_at_a_time<T, F, Fut>(holder: &ControlService, other: &ControlService, role: Role, pass: F) -> Option<T>
    where
        T: Send + 'static,
        F: Fn(Arc<Collector>, bool) -> Fut,
        Fut: Future<Output = Result<Option<T>, MetaError>> + Send + 'static,
    {
        let held = holder.store.try_lead(role).await.unwrap().expect("nobody holds the role yet");
        assert!(pass(Arc::clone(&other.collector), false).await.unwrap().is_none(), "ran beside another pass");
        let waiting = tokio::spawn(pass(Arc::clone(&other.collector), true));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiting.is_finished(), "an operator's pass ran beside another");
        drop(held);
        tokio::time::timeout(Duration::from_secs(30), waiting).await.unwrap().unwrap().unwrap()
    }
}
