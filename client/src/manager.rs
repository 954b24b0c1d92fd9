//! Periodic checkpointing and preemption handling for trainers that do not want to manage saves
//! themselves.
//!
//! ```no_run
//! # async fn train(client: starckpt_client::Client) -> starckpt_client::Result<()> {
//! use std::time::Duration;
//! use starckpt_client::{CheckpointManager, CheckpointPolicy, IfBusy, SavePart};
//!
//! use starckpt_client::RetentionPolicy;
//! let policy = CheckpointPolicy {
//!     every_steps: Some(100),
//!     every: Some(Duration::from_secs(600)),
//!     if_busy: IfBusy::Skip,
//!     retention: Some(RetentionPolicy { keep_last: 3, keep_every: 1000 }),
//! };
//! let mut manager = CheckpointManager::new(client, "llama", policy);
//! let preempted = starckpt_client::preemption_signal()?;
//! for step in 1.. {
//!     // ... one training step ...
//!     let state = |part: SavePart| part.buffer("model.bin", bytes::Bytes::from_static(b"weights"));
//!     if *preempted.borrow() {
//!         let report = manager.save_final(step, state, Duration::from_secs(30)).await;
//!         println!("preempted at step {step}: {report:?}");
//!         break;
//!     }
//!     manager.maybe_save(step, state).await?;
//! }
//! # Ok(()) }
//! ```

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::{Client, Error, Result, RetentionPolicy, SaveHandle, SavePart};

/// What to do when a save is due while the previous one is still uploading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfBusy {
    /// Block until the previous save has committed, then save.
    Wait,
    /// Skip this save; a later step will be saved instead.
    Skip,
}

/// When a [`CheckpointManager`] saves: every `every_steps` steps or every `every` of wall time,
/// whichever comes first (either may be unset; the first call always saves).
#[derive(Clone, Debug)]
pub struct CheckpointPolicy {
    pub every_steps: Option<u64>,
    pub every: Option<Duration>,
    pub if_busy: IfBusy,
    /// The job's retention policy, set on the control plane before the first save (None leaves
    /// the job's current policy alone).
    pub retention: Option<RetentionPolicy>,
}

/// How a final save on preemption ended.
#[derive(Debug)]
pub enum FinalReport {
    /// The checkpoint of this step is committed and will be `latest` on restart.
    Committed {
        step: u64,
    },
    /// This rank's part is in; other ranks still have to commit theirs.
    PartCommitted {
        step: u64,
    },
    /// The deadline passed before the save committed; the restart resumes from the previous one.
    TimedOut {
        step: u64,
    },
    Failed {
        step: u64,
        error: Error,
    },
}

/// The policy's memory of the last save: decides when the next one is due.
#[derive(Clone, Debug)]
struct Schedule {
    policy: CheckpointPolicy,
    last: Option<(u64, Instant)>,
}

impl Schedule {
    fn due(&self, step: u64) -> bool {
        let Some((last_step, last_at)) = self.last else { return true };
        let by_steps = self.policy.every_steps.is_some_and(|k| step >= last_step.saturating_add(k.max(1)));
        let by_time = self.policy.every.is_some_and(|t| last_at.elapsed() >= t);
        by_steps || by_time
    }

    fn record(&mut self, step: u64) {
        self.last = Some((step, Instant::now()));
    }
}

pub struct CheckpointManager {
    client: Client,
    job: String,
    schedule: Schedule,
    in_flight: Option<(u64, SaveHandle)>,
    retention_set: bool,
}

impl CheckpointManager {
    pub fn new(client: Client, job: impl Into<String>, policy: CheckpointPolicy) -> CheckpointManager {
        let schedule = Schedule { policy, last: None };
        CheckpointManager { client, job: job.into(), schedule, in_flight: None, retention_set: false }
    }

    /// Whether the policy calls for a save at `step` now.
    pub fn due(&self, step: u64) -> bool {
        self.schedule.due(step)
    }

    /// The save started most recently and not yet reaped by [`CheckpointManager::finish`].
    pub fn in_flight(&self) -> Option<&SaveHandle> {
        self.in_flight.as_ref().map(|(_, handle)| handle)
    }

    /// Saves `step` if the policy says so. `fill` adds the state to the part. Returns true if a
    /// save was started; with [`IfBusy::Skip`], a due save is skipped while the previous one
    /// uploads. An earlier save that failed is reported here, so failures are never silent.
    pub async fn maybe_save(&mut self, step: u64, fill: impl FnOnce(SavePart) -> Result<SavePart>) -> Result<bool> {
        if !self.due(step) {
            return Ok(false);
        }
        if let Some((previous, handle)) = self.in_flight.take() {
            if handle.is_finished() {
                handle.wait().await.map_err(|error| {
                    tracing::error!(%error, step = previous, "checkpoint failed");
                    error
                })?;
            } else {
                self.in_flight = Some((previous, handle));
            }
        }
        self.apply_retention().await?;
        let part = fill(SavePart::new(&self.job, step))?;
        let started = match self.schedule.policy.if_busy {
            IfBusy::Wait => {
                if let Some((_, handle)) = self.in_flight.take() {
                    handle.wait().await?;
                }
                Some(self.client.save(part).await?)
            }
            IfBusy::Skip => self.client.try_save(part).await?,
        };
        match started {
            Some(handle) => {
                self.schedule.record(step);
                // A previous save still recorded here finished between the checks above and now
                // (its upload slot was free): reap it so its error is not lost.
                let previous = self.in_flight.replace((step, handle));
                if let Some((previous_step, old)) = previous {
                    old.wait().await.map_err(|error| {
                        tracing::error!(%error, step = previous_step, "checkpoint failed");
                        error
                    })?;
                }
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Sets the policy's retention on the job, once.
    async fn apply_retention(&mut self) -> Result<()> {
        if let (false, Some(retention)) = (self.retention_set, self.schedule.policy.retention) {
            let deleted = self.client.set_retention(&self.job, retention).await?;
            tracing::info!(job = %self.job, ?retention, ?deleted, "retention policy set");
        }
        self.retention_set = true;
        Ok(())
    }

    /// Waits up to `deadline` for the in-flight save and reports how it ended; None if no save
    /// was in flight.
    pub async fn finish(&mut self, deadline: Duration) -> Option<FinalReport> {
        let (step, handle) = self.in_flight.take()?;
        Some(match tokio::time::timeout(deadline, handle.wait()).await {
            Ok(Ok(outcome)) if outcome.committed() => FinalReport::Committed { step },
            Ok(Ok(_)) => FinalReport::PartCommitted { step },
            Ok(Err(error)) => FinalReport::Failed { step, error },
            Err(_) => FinalReport::TimedOut { step },
        })
    }

    /// On preemption: takes a final save of `step` (after the in-flight one, if any) and waits up
    /// to `deadline` in all for it to commit.
    pub async fn save_final(
        &mut self,
        step: u64,
        fill: impl FnOnce(SavePart) -> Result<SavePart>,
        deadline: Duration,
    ) -> FinalReport {
        let until = Instant::now() + deadline;
        if self.in_flight.as_ref().is_some_and(|(in_flight, _)| *in_flight == step) {
            // This step is already being saved: see it through.
            return self.finish(deadline).await.unwrap_or(FinalReport::TimedOut { step });
        }
        if let Some(report) = self.finish(deadline).await
            && let FinalReport::TimedOut { .. } = report
        {
            return FinalReport::TimedOut { step };
        }
        let part = match fill(SavePart::new(&self.job, step)) {
            Ok(part) => part,
            Err(error) => return FinalReport::Failed { step, error },
        };
        let started = tokio::time::timeout_at(until, self.client.save(part)).await;
        match started {
            Ok(Ok(handle)) => {
                self.in_flight = Some((step, handle));
                self.schedule.record(step);
                self.finish(until.saturating_duration_since(Instant::now()))
                    .await
                    .unwrap_or(FinalReport::TimedOut { step })
            }
            // Saved and committed earlier: nothing more to do.
            Ok(Err(Error::AlreadyExists { .. })) => FinalReport::Committed { step },
            Ok(Err(error)) => FinalReport::Failed { step, error },
            Err(_) => FinalReport::TimedOut { step },
        }
    }
}

/// A flag that turns true on SIGTERM or SIGINT (what schedulers send before killing a preempted
/// job). Installing it replaces the default action of those signals for this process.
pub fn preemption_signal() -> Result<watch::Receiver<bool>> {
    use tokio::signal::unix::{SignalKind, signal};
    let io = |e| Error::Io { op: "install signal handler", path: "SIGTERM/SIGINT".into(), source: e };
    let mut term = signal(SignalKind::terminate()).map_err(io)?;
    let mut int = signal(SignalKind::interrupt()).map_err(io)?;
    let (flag, receiver) = watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("preemption signal received; finishing the checkpoint");
        let _ = flag.send(true);
    });
    Ok(receiver)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn due_by_steps_or_time_whichever_first() {
        let policy = CheckpointPolicy {
            every_steps: Some(10),
            every: Some(Duration::from_secs(60)),
            if_busy: IfBusy::Skip,
            retention: None,
        };
        let mut schedule = Schedule { policy, last: None };
        assert!(schedule.due(1), "the first call always saves");
        schedule.record(1);
        assert!(!schedule.due(5));
        assert!(schedule.due(11), "ten steps later");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(schedule.due(2), "a minute later, whatever the step");
        schedule.record(2);
        assert!(!schedule.due(3));

        let steps_only = CheckpointPolicy { every_steps: Some(3), every: None, if_busy: IfBusy::Wait, retention: None };
        let mut schedule = Schedule { policy: steps_only, last: None };
        schedule.record(0);
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(!schedule.due(2), "no time trigger configured");
        assert!(schedule.due(3));
    }
}
