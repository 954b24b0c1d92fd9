//! Clients' evidence of silent targets (`ReportSilentTargets`).
//!
//! A storage host that stops answering is found by the first client whose request to it misses
//! its deadline, often seconds before its heartbeats stop reaching the control plane, and
//! sometimes never (a partition between clients and targets that spares the control plane).
//! Such a client reports the target; the control plane then shows it suspect for
//! [`REPORTED_FOR`] after the last report and leaves it out of new placements, so other clients
//! avoid it without each paying a deadline (or a hedge) to find out.
//!
//! A report is evidence, not proof, and any caller may make one: a report never takes away the
//! last targets a placement needs (see [`Reports::place`]), and it lapses on its own. Reports
//! are kept by this control plane only (not in the database): another control plane sharing
//! the database learns of the silence from its own reporters, or from the heartbeats.

use std::collections::HashMap;
use std::time::Duration;

use starckpt_dataplane::sync::LockExt;
use starckpt_proto::control as pb;

/// How long a reported target shows suspect after its last report. Long enough to cover a save
/// (clients re-report while they still find it silent), short enough that a host that comes back
/// is placed again within the minute.
pub const REPORTED_FOR: Duration = Duration::from_secs(30);
/// Most target ids one report may name.
pub const MAX_REPORTED: usize = 1024;

/// When each target was last reported silent (ms since the epoch). Only registered targets are
/// recorded, so the map holds at most one entry per target.
#[derive(Default)]
pub(super) struct Reports(std::sync::Mutex<HashMap<String, u64>>);

impl Reports {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.0.lock_unpoisoned()
    }

    /// Records `reported` (those of them in `registered`) as silent at `now`. Returns those not
    /// reported already (to log once, not per report).
    pub(super) fn record<'a>(
        &self,
        reported: &[String],
        registered: impl Iterator<Item = &'a str>,
        now: u64,
    ) -> Vec<String> {
        let registered: std::collections::HashSet<&str> = registered.collect();
        let mut reports = self.lock();
        reports.retain(|_, at| now.saturating_sub(*at) < REPORTED_FOR.as_millis() as u64);
        let mut new = Vec::new();
        for id in reported.iter().filter(|id| registered.contains(id.as_str())) {
            if reports.insert(id.clone(), now).is_none() {
                new.push(id.clone());
            }
        }
        new
    }

    /// Whether `target` was reported silent within [`REPORTED_FOR`] of `now`.
    pub(super) fn silent(&self, target: &str, now: u64) -> bool {
        self.lock().get(target).is_some_and(|&at| now.saturating_sub(at) < REPORTED_FOR.as_millis() as u64)
    }

    /// A placement from `targets` (each as listed, its state from heartbeats alone) needing
    /// `replicas` copies per chunk: the alive targets no client reported silent, and, where those
    /// are fewer than `replicas`, reported ones too (a report never leaves a checkpoint fewer
    /// copies than it could have). Reported targets placed anyway are listed as alive: the
    /// client finds out for itself.
    pub(super) fn place(&self, targets: Vec<pb::TargetInfo>, replicas: usize, now: u64) -> Vec<pb::TargetInfo> {
        let alive = targets.into_iter().filter(|t| t.state == pb::TargetState::Alive as i32);
        let (mut placed, reported): (Vec<_>, Vec<_>) = alive.partition(|t| !self.silent(&t.target_id, now));
        let short = replicas.saturating_sub(placed.len());
        placed.extend(reported.into_iter().take(short));
        placed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(id: &str, state: pb::TargetState) -> pb::TargetInfo {
        pb::TargetInfo { target_id: id.into(), state: state as i32, ..Default::default() }
    }

    #[test]
    fn reports_lapse_ignore_unknown_targets_and_never_starve_a_placement() {
        let reports = Reports::default();
        let registered = ["a", "b", "c"];
        assert_eq!(reports.record(&["a".into(), "zz".into()], registered.iter().copied(), 1_000), ["a"]);
        assert!(reports.record(&["a".into()], registered.iter().copied(), 1_000).is_empty(), "logged once");
        assert!(reports.silent("a", 1_000) && !reports.silent("zz", 1_000) && !reports.silent("b", 1_000));
        assert!(!reports.silent("a", 1_000 + REPORTED_FOR.as_millis() as u64), "a report lapses");
        assert_eq!(reports.lock().len(), 1, "only registered targets are recorded");

        let all = || {
            vec![
                target("a", pb::TargetState::Alive),
                target("b", pb::TargetState::Alive),
                target("c", pb::TargetState::Dead),
            ]
        };
        let ids = |placed: Vec<pb::TargetInfo>| placed.into_iter().map(|t| t.target_id).collect::<Vec<_>>();
        assert_eq!(ids(reports.place(all(), 1, 1_000)), ["b"], "a reported target is left out");
        assert_eq!(ids(reports.place(all(), 2, 1_000)), ["b", "a"], "but not below the copies a chunk needs");
        reports.record(&["b".into()], registered.iter().copied(), 1_001);
        assert_eq!(ids(reports.place(all(), 2, 1_001)), ["a", "b"], "every target reported: all placed");
        assert!(reports.place(all(), 2, 1_001).iter().all(|t| t.target_id != "c"), "a dead target never");
    }
}
