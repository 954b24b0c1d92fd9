//! The save's calls to the control plane: begin, the job's chunk addressing, commit of the part,
//! and where the chunks go.

use super::*;

impl Client {
    /// Begins (or, for another rank of this run, joins) checkpoint `step` of `job` under this
    /// run's lease, whose epoch it returns too. Sent again after a lost reply, it joins the
    /// checkpoint the first one began.
    pub(crate) async fn begin(
        &self,
        job: &JobName,
        step: u64,
        world_size: u32,
    ) -> Result<(u64, pb::BeginCheckpointResponse)> {
        let epoch = self.lease(job.as_str()).await?;
        let request = pb::BeginCheckpointRequest { job: job.to_string(), step, world_size, epoch };
        let begun = self
            .rpc("begin checkpoint", crate::Resend::Idempotent, request, |mut c, r| async move {
                c.begin_checkpoint(r).await
            })
            .await?;
        Ok((epoch, begun))
    }

    /// How the chunks of the job named `job` are addressed, as its control plane says (for
    /// writers that upload before they begin a checkpoint).
    pub(crate) async fn chunk_addressing(&self, job: &JobName) -> Result<Addressing> {
        let request = pb::ChunkAddressingRequest { job: job.to_string() };
        let response = self
            .rpc("chunk addressing", crate::Resend::Idempotent, request, |mut c, r| async move {
                c.chunk_addressing(r).await
            })
            .await?;
        addressing_from(&response.chunk_key)
    }

    /// Sends one rank's manifest; says whether that completed the checkpoint.
    pub(crate) async fn commit_manifest(
        &self,
        checkpoint_id: u64,
        rank: u32,
        manifest: &Manifest,
        written_bytes: u64,
    ) -> Result<CommitState> {
        let injected = |e: std::io::Error| tonic::Status::unavailable(e.to_string());
        crate::faults::point("client.commit").map_err(injected).map_err(self.status("commit part"))?;
        // Sent again after a lost reply, it commits nothing twice: an identical part is a no-op.
        let request =
            pb::CommitPartRequest { checkpoint_id, rank, manifest: Some(pb::Manifest::from(manifest)), written_bytes };
        let response = self
            .rpc("commit part", crate::Resend::Idempotent, request, |mut c, r| async move { c.commit_part(r).await })
            .await?;
        crate::faults::point("client.commit.reply").map_err(injected).map_err(self.status("commit part"))?;
        match pb::CheckpointState::try_from(response.state) {
            Ok(pb::CheckpointState::Committed) => Ok(CommitState::Committed),
            // This part, sent again after its answer was lost, had committed the checkpoint (or
            // been in it when another rank's did); it has been deleted since.
            Ok(pb::CheckpointState::Deleted) => {
                tracing::warn!(checkpoint_id, rank, "checkpoint committed, and deleted since (retention or rm)");
                Ok(CommitState::Committed)
            }
            Ok(pb::CheckpointState::Pending) => Ok(CommitState::WaitingForRanks {
                parts_committed: response.parts_committed,
                world_size: response.world_size,
            }),
            // The control plane refuses a part of an ended checkpoint; an answer saying so anyway
            // is no save waiting for ranks.
            _ => Err(Error::Rejected {
                op: "commit part",
                message: format!("checkpoint {checkpoint_id} answered state {} to a committed part", response.state),
            }),
        }
    }

    pub(crate) fn placement(
        &self,
        targets: &[pb::TargetInfo],
        replicas: u32,
        addressing: Addressing,
    ) -> Result<Placement> {
        let mut placement = Placement {
            addressing,
            ids: vec![],
            transports: vec![],
            addresses: vec![],
            domains: vec![],
            replicas: (replicas as usize).clamp(1, targets.len().max(1)),
        };
        for target in targets {
            placement.transports.push(self.transport(&target.target_id, &target.data_address)?);
            placement.ids.push(target.target_id.clone());
            placement.addresses.push(target.data_address.clone());
            let domain = if target.failure_domain.is_empty() { &target.target_id } else { &target.failure_domain };
            placement.domains.push(domain.clone());
        }
        Ok(placement)
    }
}
