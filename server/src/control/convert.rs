//! Domain values as the gRPC service answers them: errors as status codes, checkpoint records
//! as `CheckpointInfo`.

use starckpt_proto::control as pb;
use starckpt_proto::model::ModelError;
use tonic::Status;

use super::auth::Caller;
use super::store::{CheckpointRecord, CheckpointState, MetaError};

pub(crate) fn invalid(error: ModelError) -> Status {
    Status::invalid_argument(error.to_string())
}

pub(crate) fn meta_status(error: MetaError) -> Status {
    match error {
        MetaError::NotFound(m) => Status::not_found(m),
        MetaError::AlreadyExists(m) => Status::already_exists(m),
        MetaError::FailedPrecondition(m) => Status::failed_precondition(m),
        MetaError::InvalidArgument(m) => Status::invalid_argument(m),
        MetaError::ResourceExhausted(m) => Status::resource_exhausted(m),
        error @ MetaError::Fenced(_) => Status::aborted(error.to_string()),
        error if error.is_transient() => {
            tracing::warn!(%error, "metadata store unavailable");
            Status::unavailable(error.to_string())
        }
        error @ (MetaError::Corrupt(_) | MetaError::Backend(_)) => {
            tracing::error!(%error, "metadata store failure");
            Status::internal(error.to_string())
        }
    }
}

pub(crate) fn state_pb(state: CheckpointState) -> pb::CheckpointState {
    match state {
        CheckpointState::Pending => pb::CheckpointState::Pending,
        CheckpointState::Committed => pb::CheckpointState::Committed,
        CheckpointState::Aborted => pb::CheckpointState::Aborted,
        CheckpointState::Deleted => pb::CheckpointState::Deleted,
    }
}

/// `record` as the tier stores it and operators see it: under the job's stored name.
pub fn checkpoint_info(record: &CheckpointRecord) -> pb::CheckpointInfo {
    checkpoint_info_for(&Caller::Operator, record)
}

/// `record` as `caller` sees it: under the name the caller calls the job.
pub(crate) fn checkpoint_info_for(caller: &Caller, record: &CheckpointRecord) -> pb::CheckpointInfo {
    pb::CheckpointInfo {
        checkpoint_id: record.id,
        job: caller.shown(&record.job),
        step: record.step,
        state: state_pb(record.state) as i32,
        world_size: record.world_size,
        parts_committed: record.parts_committed,
        total_bytes: record.total_bytes,
        written_bytes: record.written_bytes,
        file_count: record.file_count,
        created_at_ms: record.created_at_ms,
        committed_at_ms: record.committed_at_ms.unwrap_or(0),
        epoch: record.epoch,
        tags: record.tags.clone(),
        tiered_at_ms: record.tiered_at_ms.unwrap_or(0),
    }
}
