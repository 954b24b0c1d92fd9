//! The suite every [`MetaStore`] backend must pass (`sql/tests.rs` runs it on SQLite and
//! PostgreSQL).

use super::*;
use starckpt_proto::control as pb;

#[test]
fn replicas_are_listed_once_each_in_order_and_share_their_ids() {
    let mut ids = TargetIds::default();
    let (mut a, mut b) = (Replicas::default(), Replicas::default());
    for id in ["t2", "t1", "t2", "t3"] {
        a.add(id, &mut ids);
    }
    b.add("t1", &mut ids);
    assert_eq!(a.iter().collect::<Vec<_>>(), ["t1", "t2", "t3"]);
    assert!(a.contains("t3") && !a.contains("t4") && !a.contains("t"));
    assert!(Arc::ptr_eq(&a.0[0], &b.0[0]), "one copy of each id");
}

pub(crate) fn begin(job: &str, step: u64, world_size: u32, epoch: u64) -> BeginCheckpoint {
    BeginCheckpoint { job: JobName::try_from(job).unwrap(), step, world_size, epoch, begun_after_ms: 0 }
}

pub(crate) async fn lease(store: &dyn MetaStore, job: &str, run_id: &str) -> MetaResult<LeaseGrant> {
    let request = AcquireLease { job: JobName::try_from(job).unwrap(), run_id: run_id.into(), started_at_ms: 0 };
    store.acquire_lease(&request, 1).await
}

pub(crate) fn part(checkpoint_id: u64, rank: u32, path: &str, size: u64) -> CommitPart {
    let chunks = if size == 0 {
        vec![]
    } else {
        vec![pb::ChunkRef {
            hash: bytes::Bytes::from(vec![rank as u8; 32]),
            length_bytes: size,
            stored_length_bytes: size,
            codec: 0,
            replicas: vec!["t1".into()],
        }]
    };
    let manifest = pb::Manifest {
        files: vec![pb::FileEntry { path: path.into(), size_bytes: size, mode: 0o644, chunks }],
        directories: vec![],
        metadata: [("rank".to_string(), rank.to_string())].into_iter().collect(),
        chunk_key: Default::default(),
    };
    let manifest = Manifest::try_from(manifest).unwrap();
    // As if half of each part had deduplicated.
    let written_bytes = manifest.total_bytes() / 2;
    CommitPart { checkpoint_id, rank, written_bytes, manifest, namespace: None, cluster_key: None }
}

fn job(name: &str) -> JobName {
    JobName::try_from(name).unwrap()
}

pub async fn targets(store: &dyn MetaStore) {
    let registration = TargetRegistration {
        target_id: "t1".into(),
        data_address: "127.0.0.1:9000".parse().unwrap(),
        capacity_bytes: 100,
        used_bytes: 1,
        failure_domain: "rack-1".into(),
        rdma_device: "mlx5_0".into(),
    };
    assert!(matches!(store.heartbeat("t1", 1, 1, 1, 5).await, Err(MetaError::NotFound(_))));
    store.upsert_target(&registration, 10).await.unwrap();
    store
        .upsert_target(&TargetRegistration { data_address: "127.0.0.1:9001".parse().unwrap(), ..registration }, 20)
        .await
        .unwrap();
    store.heartbeat("t1", 200, 50, 7, 30).await.unwrap();
    let targets = store.list_targets().await.unwrap();
    assert_eq!(
        targets,
        vec![TargetRecord {
            target_id: "t1".into(),
            data_address: "127.0.0.1:9001".into(),
            capacity_bytes: 200,
            used_bytes: 50,
            chunk_count: 7,
            last_heartbeat_ms: 30,
            failure_domain: "rack-1".into(),
            rdma_device: "mlx5_0".into(),
        }]
    );
}

pub async fn multi_rank_commit(store: &dyn MetaStore) {
    let epoch = lease(store, "j", "run-a").await.unwrap().epoch;
    let first = store.begin_checkpoint(&begin("j", 100, 2, epoch), 1).await.unwrap();
    let joined = store.begin_checkpoint(&begin("j", 100, 2, epoch), 2).await.unwrap();
    assert_eq!(first.id, joined.id, "ranks of one run join one checkpoint");
    assert_eq!((first.state, first.epoch), (CheckpointState::Pending, epoch));
    assert!(matches!(
        store.begin_checkpoint(&begin("j", 100, 3, epoch), 2).await,
        Err(MetaError::FailedPrecondition(_))
    ));

    let after_one = store.commit_part(&part(first.id, 0, "r0.pt", 10), &|| 3, u64::MAX).await.unwrap();
    assert_eq!((after_one.state, after_one.parts_committed), (CheckpointState::Pending, 1));
    assert_eq!(store.latest(&job("j")).await.unwrap(), None, "not visible before every rank");
    // Idempotent re-commit, also with the chunks placed elsewhere; out-of-range rank; unknown
    // checkpoint.
    store.commit_part(&part(first.id, 0, "r0.pt", 10), &|| 4, u64::MAX).await.unwrap();
    let mut moved = part(first.id, 0, "r0.pt", 10);
    moved.manifest.files[0].chunks.iter_mut().for_each(|c| c.replicas = vec!["elsewhere".into()]);
    let same = store.commit_part(&moved, &|| 4, u64::MAX).await.unwrap();
    assert_eq!((same.state, same.parts_committed), (CheckpointState::Pending, 1));
    assert!(matches!(
        store.commit_part(&part(first.id, 2, "r2.pt", 1), &|| 4, u64::MAX).await,
        Err(MetaError::InvalidArgument(_))
    ));
    assert!(matches!(store.commit_part(&part(9999, 0, "x", 1), &|| 4, u64::MAX).await, Err(MetaError::NotFound(_))));

    let done = store.commit_part(&part(first.id, 1, "r1.pt", 5), &|| 5, u64::MAX).await.unwrap();
    assert_eq!(done.state, CheckpointState::Committed);
    assert_eq!((done.total_bytes, done.file_count, done.committed_at_ms), (15, 2, Some(5)));
    assert_eq!(done.written_bytes, 10 / 2 + 5 / 2);
    let latest = store.latest(&job("j")).await.unwrap().unwrap();
    assert_eq!((latest.step, latest.id), (100, first.id));
    // Committing again after the commit is still idempotent.
    assert_eq!(
        store.commit_part(&part(first.id, 1, "r1.pt", 5), &|| 6, u64::MAX).await.unwrap().state,
        CheckpointState::Committed
    );

    let (record, parts) = store.get_manifest(&job("j"), None).await.unwrap();
    assert_eq!(record.id, first.id);
    assert_eq!(parts.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(parts[1].1.files[0].path.as_str(), "r1.pt");
    assert_eq!(parts[0].1.metadata.get("rank").map(String::as_str), Some("0"));
}

/// A part sent again (its answer lost) after its checkpoint committed and was deleted is
/// answered with what became of the checkpoint; a different part is refused.
pub async fn resent_part_of_a_deleted_checkpoint(store: &dyn MetaStore) {
    let epoch = lease(store, "del", "run").await.unwrap().epoch;
    let first = store.begin_checkpoint(&begin("del", 1, 2, epoch), 1).await.unwrap();
    store.commit_part(&part(first.id, 0, "r0.pt", 10), &|| 2, u64::MAX).await.unwrap();
    let done = store.commit_part(&part(first.id, 1, "r1.pt", 5), &|| 3, u64::MAX).await.unwrap();
    assert_eq!(done.state, CheckpointState::Committed);
    store.delete_checkpoint(&job("del"), 1, None, 4).await.unwrap();
    for rank in [0, 1] {
        let path = format!("r{rank}.pt");
        let size = if rank == 0 { 10 } else { 5 };
        let again = store.commit_part(&part(first.id, rank, &path, size), &|| 5, u64::MAX).await.unwrap();
        assert_eq!((again.id, again.state, again.parts_committed), (first.id, CheckpointState::Deleted, 2));
    }
    let other = store.commit_part(&part(first.id, 0, "other.pt", 10), &|| 6, u64::MAX).await.unwrap_err();
    assert!(matches!(other, MetaError::FailedPrecondition(_)), "{other}");
    assert_eq!(store.latest(&job("del")).await.unwrap(), None);
}

/// A checkpoint's parts read a page at a time: a byte budget below one part still moves on one
/// part per page, and later pages name the checkpoint by id.
pub async fn manifest_pages(store: &dyn MetaStore) {
    let epoch = lease(store, "paged", "run-a").await.unwrap().epoch;
    let first = store.begin_checkpoint(&begin("paged", 100, 3, epoch), 1).await.unwrap();
    for rank in 0..3 {
        store.commit_part(&part(first.id, rank, &format!("r{rank}.pt"), 10), &|| 2, u64::MAX).await.unwrap();
    }
    let paged = job("paged");
    let page = |of, from, max| store.get_manifest_page(&paged, of, from, max);
    let first_page = page(ManifestOf::Step(Some(100)), 0, 1).await.unwrap();
    assert_eq!((first_page.record.id, first_page.parts.len(), first_page.next_rank), (first.id, 1, Some(1)));
    let mut ranks = vec![0];
    let mut next = first_page.next_rank;
    while let Some(from) = next {
        let later = page(ManifestOf::Checkpoint(first.id), from, 1).await.unwrap();
        ranks.extend(later.parts.iter().map(|(rank, _)| *rank));
        assert_eq!(later.parts[0].1.files[0].path.as_str(), format!("r{from}.pt"));
        next = later.next_rank;
    }
    assert_eq!(ranks, vec![0, 1, 2]);
    let whole = page(ManifestOf::Step(None), 0, 1 << 20).await.unwrap();
    assert_eq!((whole.parts.len(), whole.next_rank), (3, None));
    assert!(matches!(page(ManifestOf::Checkpoint(first.id), 3, 1).await, Err(MetaError::InvalidArgument(_))));
    assert!(matches!(page(ManifestOf::Checkpoint(first.id + 1), 0, 1).await, Err(MetaError::NotFound(_))));
    // A checkpoint deleted between pages is not read on from.
    store.delete_checkpoint(&job("paged"), 100, None, 7).await.unwrap();
    assert!(matches!(page(ManifestOf::Checkpoint(first.id), 1, 1).await, Err(MetaError::NotFound(_))));
}

/// Tenants' jobs live under `<tenant>/<name>`: the same name in two tenants is two jobs, and
/// a part committed for one tenant cannot land in another's checkpoint.
pub async fn tenant_namespaces(store: &dyn MetaStore) {
    let acme = starckpt_proto::TenantName::try_from("acme").unwrap();
    let other = starckpt_proto::TenantName::try_from("other").unwrap();
    let acme_epoch = lease(store, "acme/llama", "run").await.unwrap().epoch;
    let other_epoch = lease(store, "other/llama", "run").await.unwrap().epoch;
    let ours = store.begin_checkpoint(&begin("acme/llama", 1, 1, acme_epoch), 1).await.unwrap();
    let theirs = store.begin_checkpoint(&begin("other/llama", 1, 1, other_epoch), 1).await.unwrap();
    assert_ne!(ours.id, theirs.id, "one name in two tenants is two jobs");

    // A tenant's chunks are addressed with its key (starckpt_proto::address), derived from
    // the cluster key the control plane sets.
    let key = starckpt_proto::capability::ClusterKey::from_secret(b"conformance cluster key").unwrap();
    let keyed = |mut part: CommitPart, tenant: &starckpt_proto::TenantName| {
        part.manifest.addressing = starckpt_proto::Addressing::tenant(Some(&key), tenant);
        part.cluster_key = Some(key.clone());
        part
    };
    let as_other = CommitPart { namespace: Some(other.clone()), ..keyed(part(ours.id, 0, "f", 1), &acme) };
    assert!(matches!(store.commit_part(&as_other, &|| 2, u64::MAX).await, Err(MetaError::NotFound(_))));
    // Chunks addressed by plain BLAKE3, with another tenant's key, or with a key of another
    // cluster key would deduplicate across tenants, or be a key no one hands out now.
    let other_cluster = starckpt_proto::capability::ClusterKey::from_secret(b"another cluster's key").unwrap();
    let stale = CommitPart { cluster_key: Some(other_cluster), ..keyed(part(ours.id, 0, "f", 1), &acme) };
    let plain = CommitPart { cluster_key: Some(key.clone()), ..part(ours.id, 0, "f", 1) };
    for unkeyed in [plain, keyed(part(ours.id, 0, "f", 1), &other), stale] {
        let unkeyed = CommitPart { namespace: Some(acme.clone()), ..unkeyed };
        let refused = store.commit_part(&unkeyed, &|| 2, u64::MAX).await;
        assert!(matches!(&refused, Err(MetaError::InvalidArgument(m)) if m.contains("acme's")), "{refused:?}");
    }
    let as_acme = CommitPart { namespace: Some(acme.clone()), ..keyed(part(ours.id, 0, "f", 1), &acme) };
    assert_eq!(store.commit_part(&as_acme, &|| 2, u64::MAX).await.unwrap().state, CheckpointState::Committed);
    // An operator (no namespace) commits anywhere, addressed as the job's chunks are.
    assert_eq!(
        store.commit_part(&keyed(part(theirs.id, 0, "g", 2), &other), &|| 3, u64::MAX).await.unwrap().state,
        CheckpointState::Committed
    );

    assert_eq!(store.latest(&job("acme/llama")).await.unwrap().unwrap().id, ours.id);
    assert_eq!(store.latest(&job("other/llama")).await.unwrap().unwrap().id, theirs.id);
    assert_eq!(store.latest(&job("llama")).await.unwrap(), None, "outside every tenant: another job");
    let jobs: Vec<String> = store.list_jobs().await.unwrap().into_iter().map(|j| j.job).collect();
    assert!(jobs.contains(&"acme/llama".to_owned()) && jobs.contains(&"other/llama".to_owned()), "{jobs:?}");
}

pub async fn step_collisions(store: &dyn MetaStore) {
    let epoch = lease(store, "c", "run-1").await.unwrap().epoch;
    let committed = store.begin_checkpoint(&begin("c", 1, 1, epoch), 1).await.unwrap();
    store.commit_part(&part(committed.id, 0, "f", 1), &|| 2, u64::MAX).await.unwrap();
    assert!(matches!(store.begin_checkpoint(&begin("c", 1, 1, epoch), 3).await, Err(MetaError::AlreadyExists(_))));

    let active = store.begin_checkpoint(&begin("c", 2, 1, epoch), 3).await.unwrap();
    store.commit_part(&part(active.id, 0, "f", 1), &|| 4, u64::MAX).await.unwrap();
    let all = store.list_checkpoints(&job("c"), true).await.unwrap();
    assert_eq!(
        all.iter().map(|c| (c.step, c.state)).collect::<Vec<_>>(),
        vec![(1, CheckpointState::Committed), (2, CheckpointState::Committed)]
    );

    // Delete the latest: latest falls back; the step can be saved again.
    store.delete_checkpoint(&job("c"), 2, None, 7).await.unwrap();
    assert_eq!(store.latest(&job("c")).await.unwrap().unwrap().step, 1);
    assert!(matches!(store.get_manifest(&job("c"), Some(2)).await, Err(MetaError::NotFound(_))));
    assert!(matches!(store.delete_checkpoint(&job("c"), 2, None, 8).await, Err(MetaError::NotFound(_))));
    let again = store.begin_checkpoint(&begin("c", 2, 1, epoch), 9).await.unwrap();
    assert_ne!(again.id, active.id);
    // Its writer's abort of the first step 2 leaves the second alone.
    let refused = store.abort_pending(&job("c"), active.id, 9).await;
    assert!(matches!(&refused, Err(MetaError::FailedPrecondition(m)) if m.contains("deleted")), "{refused:?}");
    assert!(matches!(store.abort_pending(&job("nope"), again.id, 9).await, Err(MetaError::NotFound(_))));
    assert!(matches!(store.abort_pending(&job("c"), u64::MAX >> 1, 9).await, Err(MetaError::NotFound(_))));
    let doomed = store.begin_checkpoint(&begin("c", 5, 1, epoch), 9).await.unwrap();
    store.abort_pending(&job("c"), doomed.id, 9).await.unwrap();
    store.abort_pending(&job("c"), doomed.id, 10).await.expect("a second abort changes nothing");
    let pending = store.list_checkpoints(&job("c"), true).await.unwrap();
    let pending: Vec<_> = pending.iter().filter(|c| c.state == CheckpointState::Pending).map(|c| c.id).collect();
    assert_eq!(pending, [again.id]);
    assert_eq!(store.list_checkpoints(&job("c"), false).await.unwrap().len(), 2, "committed 1 and pending 2");
    assert_eq!(store.list_checkpoints(&job("c"), true).await.unwrap().len(), 4, "and the deleted 2, aborted 5");
    assert!(matches!(store.latest(&job("nope")).await, Ok(None)));
    assert!(matches!(store.get_manifest(&job("nope"), None).await, Err(MetaError::NotFound(_))));

    let jobs = store.list_jobs().await.unwrap();
    let c = jobs.iter().find(|j| j.job == "c").unwrap();
    assert_eq!((c.committed_checkpoints, c.latest_step, c.committed_bytes), (1, Some(1), 1));

    // A delete of the checkpoint seen earlier leaves a newer one at its step alone.
    let stale = store.delete_checkpoint(&job("c"), 2, Some(active.id), 11).await;
    assert!(matches!(stale, Err(MetaError::NotFound(_))), "{stale:?}");
    assert!(matches!(store.delete_checkpoint(&job("c"), 1, Some(again.id), 11).await, Err(MetaError::NotFound(_))));
    assert_eq!(store.latest(&job("c")).await.unwrap().unwrap().id, committed.id);
    store.delete_checkpoint(&job("c"), 1, Some(committed.id), 11).await.unwrap();
    assert_eq!(store.latest(&job("c")).await.unwrap(), None);
}

/// A relaunch reusing the run id of the launch before joins its pending checkpoint: a rank
/// that committed there, saving again, must not let the rest commit a checkpoint of two
/// launches' parts.
pub async fn two_writers_of_a_rank(store: &dyn MetaStore) {
    let epoch = lease(store, "w", "reused").await.unwrap().epoch;
    let old = store.begin_checkpoint(&begin("w", 5, 2, epoch), 1).await.unwrap();
    store.commit_part(&part(old.id, 0, "old-r0", 10), &|| 2, u64::MAX).await.unwrap();
    // Relaunched under the same run id: the same epoch, the same pending checkpoint.
    assert_eq!(lease(store, "w", "reused").await.unwrap().epoch, epoch);
    let joined = store.begin_checkpoint(&begin("w", 5, 2, epoch), 3).await.unwrap();
    assert_eq!(joined.id, old.id);
    let refused = store.commit_part(&part(old.id, 0, "new-r0", 10), &|| 4, u64::MAX).await;
    assert!(
        matches!(&refused, Err(MetaError::FailedPrecondition(m)) if m.contains("two writers") && m.contains("aborted")),
        "{refused:?}"
    );
    let late = store.commit_part(&part(old.id, 1, "new-r1", 10), &|| 5, u64::MAX).await;
    assert!(matches!(&late, Err(MetaError::FailedPrecondition(m)) if m.contains("aborted")), "{late:?}");
    assert_eq!(store.latest(&job("w")).await.unwrap(), None, "nothing mixed committed");
    // A committed checkpoint cannot be aborted: the second writer is refused, and told.
    let next = store.begin_checkpoint(&begin("w", 6, 1, epoch), 6).await.unwrap();
    store.commit_part(&part(next.id, 0, "a", 10), &|| 7, u64::MAX).await.unwrap();
    let refused = store.commit_part(&part(next.id, 0, "b", 10), &|| 8, u64::MAX).await;
    assert!(
        matches!(&refused, Err(MetaError::FailedPrecondition(m)) if m.contains("two writers") && !m.contains("aborted")),
        "{refused:?}"
    );
    assert_eq!(store.latest(&job("w")).await.unwrap().map(|c| c.id), Some(next.id));
}

pub async fn overlapping_parts(store: &dyn MetaStore) {
    let epoch = lease(store, "o", "run-a").await.unwrap().epoch;
    let states = || async {
        store.list_checkpoints(&job("o"), true).await.unwrap().iter().map(|c| (c.step, c.state)).collect::<Vec<_>>()
    };
    // The same file from two ranks: the last part finds it and aborts the checkpoint.
    let first = store.begin_checkpoint(&begin("o", 1, 2, epoch), 1).await.unwrap();
    store.commit_part(&part(first.id, 0, "model.pt", 10), &|| 2, u64::MAX).await.unwrap();
    let refused = store.commit_part(&part(first.id, 1, "model.pt", 10), &|| 3, u64::MAX).await;
    assert!(
        matches!(&refused, Err(MetaError::InvalidArgument(m)) if m.contains("ranks 0 and 1") && m.contains("aborted")),
        "{refused:?}"
    );
    assert_eq!(states().await, vec![(1, CheckpointState::Aborted)]);
    let again = store.commit_part(&part(first.id, 0, "model.pt", 10), &|| 3, u64::MAX).await;
    assert!(matches!(&again, Err(MetaError::FailedPrecondition(m)) if m.contains("aborted")), "{again:?}");
    // A file of one rank where another has a directory.
    let second = store.begin_checkpoint(&begin("o", 2, 2, epoch), 4).await.unwrap();
    store.commit_part(&part(second.id, 1, "a/b", 10), &|| 5, u64::MAX).await.unwrap();
    let refused = store.commit_part(&part(second.id, 0, "a", 10), &|| 6, u64::MAX).await;
    assert!(matches!(&refused, Err(MetaError::InvalidArgument(m)) if m.contains("directory")), "{refused:?}");
    // Files side by side in one directory commit.
    let third = store.begin_checkpoint(&begin("o", 3, 2, epoch), 7).await.unwrap();
    store.commit_part(&part(third.id, 0, "a/x", 10), &|| 8, u64::MAX).await.unwrap();
    assert_eq!(
        store.commit_part(&part(third.id, 1, "a/y", 10), &|| 9, u64::MAX).await.unwrap().state,
        CheckpointState::Committed
    );
    assert_eq!(
        states().await,
        vec![(1, CheckpointState::Aborted), (2, CheckpointState::Aborted), (3, CheckpointState::Committed)]
    );
    assert_eq!(store.latest(&job("o")).await.unwrap().map(|c| c.step), Some(3));
}

pub async fn runs_that_started_earlier_never_take_over(store: &dyn MetaStore) {
    let lease_at = |run: &'static str, started_at_ms: u64| async move {
        let request = AcquireLease { job: job("z"), run_id: run.into(), started_at_ms };
        store.acquire_lease(&request, started_at_ms + 1).await
    };
    // Run 1 started at 1000 and is preempted before its first save; run 2 replaces it.
    assert_eq!(lease_at("run-2", 2000).await.unwrap().epoch, 1);
    let pending = store.begin_checkpoint(&begin("z", 5, 1, 1), 2001).await.unwrap();
    // A process of run 1 still alive makes its first save: it must not take the job over (and
    // abort run 2's checkpoint), though the job never saw its run id.
    assert!(matches!(lease_at("run-1", 1000).await, Err(MetaError::Fenced(_))));
    let states: Vec<_> = store.list_checkpoints(&job("z"), true).await.unwrap().iter().map(|c| c.state).collect();
    assert_eq!(states, vec![CheckpointState::Pending]);
    store.commit_part(&part(pending.id, 0, "f", 1), &|| 2002, u64::MAX).await.unwrap();
    // Run 2's other ranks, whatever their own start, keep its epoch.
    assert_eq!(lease_at("run-2", 1500).await.unwrap().epoch, 1);
    // A run that started later takes over, as does one that does not say when it started.
    assert_eq!(lease_at("run-3", 3000).await.unwrap().epoch, 2);
    assert_eq!(lease_at("run-4", 0).await.unwrap().epoch, 3);
    // A holder that did not say when it started (an older client) orders nothing.
    assert_eq!(lease_at("run-0", 500).await.unwrap().epoch, 4);
    // Superseded run ids stay fenced, whenever they started.
    assert!(matches!(lease_at("run-3", 9000).await, Err(MetaError::Fenced(_))));
}

pub async fn fencing(store: &dyn MetaStore) {
    // Run 1, two ranks: rank 0 commits its part of step 10, rank 1 never does (preempted).
    let first = lease(store, "f", "run-1").await.unwrap();
    assert_eq!(first, LeaseGrant { epoch: 1, aborted_checkpoints: 0 });
    assert_eq!(lease(store, "f", "run-1").await.unwrap().epoch, 1, "every rank of a run gets the same epoch");
    let old = store.begin_checkpoint(&begin("f", 10, 2, 1), 1).await.unwrap();
    store.commit_part(&part(old.id, 0, "r0", 1), &|| 2, u64::MAX).await.unwrap();

    // The restarted run takes over: epoch 2, the half-written step 10 is aborted.
    let second = lease(store, "f", "run-2").await.unwrap();
    assert_eq!(second, LeaseGrant { epoch: 2, aborted_checkpoints: 1 });
    let states: Vec<_> = store.list_checkpoints(&job("f"), true).await.unwrap().iter().map(|c| c.state).collect();
    assert_eq!(states, vec![CheckpointState::Aborted]);

    // The zombie rank 1 of run 1 can neither commit, begin, nor take the lease back.
    assert!(matches!(store.commit_part(&part(old.id, 1, "r1", 1), &|| 3, u64::MAX).await, Err(MetaError::Fenced(_))));
    // Rank 0 sending its part again (an answer lost) hears it too, not "waiting for ranks".
    assert!(matches!(store.commit_part(&part(old.id, 0, "r0", 1), &|| 3, u64::MAX).await, Err(MetaError::Fenced(_))));
    assert!(matches!(store.begin_checkpoint(&begin("f", 11, 2, 1), 3).await, Err(MetaError::Fenced(_))));
    assert!(matches!(lease(store, "f", "run-1").await, Err(MetaError::Fenced(_))));
    assert!(matches!(store.begin_checkpoint(&begin("f", 11, 2, 7), 3).await, Err(MetaError::InvalidArgument(_))));
    assert!(matches!(store.begin_checkpoint(&begin("nolease", 1, 1, 1), 3).await, Err(MetaError::InvalidArgument(_))));

    // The new run saves step 10 again and commits it.
    let new = store.begin_checkpoint(&begin("f", 10, 2, 2), 4).await.unwrap();
    assert_ne!(new.id, old.id);
    store.commit_part(&part(new.id, 0, "r0", 1), &|| 5, u64::MAX).await.unwrap();
    let done = store.commit_part(&part(new.id, 1, "r1", 1), &|| 5, u64::MAX).await.unwrap();
    assert_eq!((done.state, done.epoch), (CheckpointState::Committed, 2));
    assert_eq!(store.latest(&job("f")).await.unwrap().unwrap().id, new.id);
    // Leases are per job.
    assert_eq!(lease(store, "other", "run-1").await.unwrap().epoch, 1);
}

pub async fn stale_pending_is_aborted(store: &dyn MetaStore) {
    let epoch = lease(store, "s", "run").await.unwrap().epoch;
    let stale = store.begin_checkpoint(&begin("s", 1, 2, epoch), 100).await.unwrap();
    store.commit_part(&part(stale.id, 0, "r0", 1), &|| 101, u64::MAX).await.unwrap();
    let fresh = store.begin_checkpoint(&begin("s", 2, 1, epoch), 500).await.unwrap();
    let aborted = store.abort_stale_pending(300, 600).await.unwrap();
    assert_eq!(aborted.iter().map(|c| c.id).collect::<Vec<_>>(), vec![stale.id]);
    assert!(matches!(
        store.commit_part(&part(stale.id, 1, "r1", 1), &|| 601, u64::MAX).await,
        Err(MetaError::FailedPrecondition(_))
    ));
    store.commit_part(&part(fresh.id, 0, "f", 1), &|| 602, u64::MAX).await.unwrap();
    assert_eq!(store.latest(&job("s")).await.unwrap().unwrap().step, 2);
    assert!(store.abort_stale_pending(1000, 1000).await.unwrap().is_empty(), "committed ones are never reaped");
}

async fn save(store: &dyn MetaStore, job: &str, step: u64, epoch: u64) -> u64 {
    let record = store.begin_checkpoint(&begin(job, step, 1, epoch), step).await.unwrap();
    store.commit_part(&part(record.id, 0, "f", 1), &|| step, u64::MAX).await.unwrap();
    record.id
}

fn steps(records: &[CheckpointRecord]) -> Vec<u64> {
    records.iter().map(|c| c.step).collect()
}

pub async fn replication(store: &dyn MetaStore) {
    assert_eq!(store.replication(&job("rep")).await.unwrap(), None);
    store.set_replication(&job("rep"), 3, 10).await.unwrap();
    store.set_replication(&job("other"), 1, 10).await.unwrap();
    assert_eq!(store.replication(&job("rep")).await.unwrap(), Some(3));
    store.set_replication(&job("rep"), 2, 20).await.unwrap();
    assert_eq!(store.replication(&job("rep")).await.unwrap(), Some(2));
    assert_eq!(store.replication(&job("other")).await.unwrap(), Some(1));
    for bad in [0, starckpt_proto::model::MAX_REPLICAS + 1] {
        assert!(matches!(store.set_replication(&job("rep"), bad, 30).await, Err(MetaError::InvalidArgument(_))));
    }
    assert_eq!(store.replication(&job("rep")).await.unwrap(), Some(2));
}

pub async fn retention_and_tags(store: &dyn MetaStore) {
    let epoch = lease(store, "r", "run").await.unwrap().epoch;
    assert_eq!(store.get_retention(&job("r")).await.unwrap(), RetentionPolicy::default());
    for step in 1..=6 {
        save(store, "r", step, epoch).await;
    }
    store.tag_checkpoint(&job("r"), 2, "best", false).await.unwrap();
    store.tag_checkpoint(&job("r"), 2, "best", false).await.unwrap();
    store.tag_checkpoint(&job("r"), 2, "epoch-1", false).await.unwrap();
    assert!(matches!(store.tag_checkpoint(&job("r"), 99, "x", false).await, Err(MetaError::NotFound(_))));
    assert!(matches!(store.tag_checkpoint(&job("r"), 2, "a,b", false).await, Err(MetaError::InvalidArgument(_))));

    // Keep the last 2 and every 3rd step; the tagged step 2 stays. Applied when set.
    let policy = RetentionPolicy { keep_last: 2, keep_every: 3 };
    let deleted = store.set_retention(&job("r"), policy, 10).await.unwrap();
    assert_eq!(deleted, vec![4, 1]);
    assert_eq!(store.get_retention(&job("r")).await.unwrap(), policy);
    let kept = store.list_checkpoints(&job("r"), false).await.unwrap();
    assert_eq!(steps(&kept), vec![2, 3, 5, 6]);
    assert_eq!(kept[0].tags, vec!["best".to_string(), "epoch-1".to_string()]);

    // Applied at commit: step 7 pushes step 5 out of the last two.
    save(store, "r", 7, epoch).await;
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![2, 3, 6, 7]);
    // Removing both tags lets retention take step 2.
    store.tag_checkpoint(&job("r"), 2, "best", true).await.unwrap();
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![2, 3, 6, 7]);
    store.tag_checkpoint(&job("r"), 2, "epoch-1", true).await.unwrap();
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![3, 6, 7]);
    // The removal sent again (its answer lost) finds the step deleted: done, not NotFound.
    store.tag_checkpoint(&job("r"), 2, "epoch-1", true).await.unwrap();
    assert!(matches!(store.tag_checkpoint(&job("r"), 2, "best", false).await, Err(MetaError::NotFound(_))));
    assert!(matches!(store.tag_checkpoint(&job("r"), 99, "best", true).await, Err(MetaError::NotFound(_))));
    let all = store.list_checkpoints(&job("r"), true).await.unwrap();
    assert_eq!(all.iter().filter(|c| c.state == CheckpointState::Deleted).count(), 4);

    // keep_every alone still keeps the latest; clearing the policy keeps everything again.
    store.set_retention(&job("r"), RetentionPolicy { keep_last: 0, keep_every: 100 }, 20).await.unwrap();
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![7]);
    store.set_retention(&job("r"), RetentionPolicy::default(), 21).await.unwrap();
    save(store, "r", 8, epoch).await;
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![7, 8]);
    // Other jobs are untouched by this job's policy.
    let other = lease(store, "r2", "run").await.unwrap().epoch;
    save(store, "r2", 1, other).await;
    save(store, "r2", 2, other).await;
    store.set_retention(&job("r"), RetentionPolicy { keep_last: 1, keep_every: 0 }, 22).await.unwrap();
    assert_eq!(store.list_checkpoints(&job("r2"), false).await.unwrap().len(), 2);
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![8]);
    // A commit never deletes the checkpoint it commits (the writer is told "committed"): a
    // lower step survives until the next commit.
    let lower = store.begin_checkpoint(&begin("r", 5, 1, epoch), 30).await.unwrap();
    let record = store.commit_part(&part(lower.id, 0, "f", 1), &|| 31, u64::MAX).await.unwrap();
    assert_eq!(record.state, CheckpointState::Committed);
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![5, 8]);
    save(store, "r", 9, epoch).await;
    assert_eq!(steps(&store.list_checkpoints(&job("r"), false).await.unwrap()), vec![9]);
}

pub async fn late_commit_is_refused(store: &dyn MetaStore) {
    let epoch = lease(store, "late", "run").await.unwrap().epoch;
    let record = store.begin_checkpoint(&begin("late", 1, 1, epoch), 100).await.unwrap();
    // Begun at 100; a commit that requires "begun after 150" is too late, even before the reaper.
    let error = store.commit_part(&part(record.id, 0, "f", 1), &|| 200, 50).await.unwrap_err();
    assert!(matches!(error, MetaError::FailedPrecondition(_)), "{error}");
    let all = store.list_checkpoints(&job("late"), true).await.unwrap();
    assert_eq!(all[0].state, CheckpointState::Aborted);
    assert_eq!(store.latest(&job("late")).await.unwrap(), None);
    // A timely one commits.
    let record = store.begin_checkpoint(&begin("late", 1, 1, epoch), 60_000).await.unwrap();
    store.commit_part(&part(record.id, 0, "f", 1), &|| 60_001, 59751).await.unwrap();
    assert_eq!(store.latest(&job("late")).await.unwrap().unwrap().id, record.id);
}

pub async fn expired_pending_is_not_joined(store: &dyn MetaStore) {
    let epoch = lease(store, "exp", "run").await.unwrap().epoch;
    let first = store.begin_checkpoint(&begin("exp", 1, 2, epoch), 100).await.unwrap();
    store.commit_part(&part(first.id, 0, "f", 1), &|| 110, u64::MAX).await.unwrap();
    // Within the pending timeout, a rank joins the checkpoint its peer began.
    let mut late = begin("exp", 1, 2, epoch);
    late.begun_after_ms = 100;
    assert_eq!(store.begin_checkpoint(&late, 200).await.unwrap().id, first.id);
    // Past it, the checkpoint can no longer commit: a begin aborts it and begins another
    // rather than hand out one whose commit is certain to be refused, before the reaper runs.
    late.begun_after_ms = 101;
    let second = store.begin_checkpoint(&late, 201).await.unwrap();
    assert_ne!(second.id, first.id);
    assert_eq!((second.state, second.parts_committed, second.created_at_ms), (CheckpointState::Pending, 0, 201));
    let all = store.list_checkpoints(&job("exp"), true).await.unwrap();
    let state = |id| all.iter().find(|c| c.id == id).map(|c| c.state);
    assert_eq!(state(first.id), Some(CheckpointState::Aborted));
    // The new one is joined as any other, and commits whole.
    assert_eq!(store.begin_checkpoint(&late, 202).await.unwrap().id, second.id);
    store.commit_part(&part(second.id, 0, "f", 1), &|| 203, 100).await.unwrap();
    let record = store.commit_part(&part(second.id, 1, "g", 1), &|| 204, 100).await.unwrap();
    assert_eq!(record.state, CheckpointState::Committed);
    assert_eq!(store.latest(&job("exp")).await.unwrap().unwrap().id, second.id);
}

fn part_with_hash(checkpoint_id: u64, rank: u32, byte: u8) -> CommitPart {
    let mut part = part(checkpoint_id, rank, "f", 1);
    part.manifest.files[0].chunks[0].hash = ChunkHash([byte; 32]);
    part
}

pub async fn live_chunks(store: &dyn MetaStore) {
    let epoch = lease(store, "g", "run").await.unwrap().epoch;
    let committed = store.begin_checkpoint(&begin("g", 1, 1, epoch), 1).await.unwrap();
    store.commit_part(&part_with_hash(committed.id, 0, 1), &|| 2, u64::MAX).await.unwrap();
    let deleted = store.begin_checkpoint(&begin("g", 2, 1, epoch), 3).await.unwrap();
    store.commit_part(&part_with_hash(deleted.id, 0, 2), &|| 4, u64::MAX).await.unwrap();
    store.delete_checkpoint(&job("g"), 2, None, 5).await.unwrap();
    // A pending checkpoint's committed parts are live; an aborted one's are not.
    let pending = store.begin_checkpoint(&begin("g", 3, 2, epoch), 6).await.unwrap();
    store.commit_part(&part_with_hash(pending.id, 0, 3), &|| 7, u64::MAX).await.unwrap();
    let aborted = store.begin_checkpoint(&begin("g", 4, 2, epoch), 8).await.unwrap();
    store.commit_part(&part_with_hash(aborted.id, 0, 4), &|| 9, u64::MAX).await.unwrap();
    store.delete_checkpoint(&job("g"), 4, None, 10).await.unwrap();
    let live = store.live_chunks().await.unwrap();
    assert_eq!(live, [ChunkHash([1; 32]), ChunkHash([3; 32])].into_iter().collect());
}

pub async fn drafts(store: &dyn MetaStore) {
    use starckpt_proto::draft::{MAX_DRAFTS_PER_JOB, MAX_DRAFTS_PER_WRITER};
    let key = |job_name: &str, name: &str, writer: &str| DraftKey {
        job: job(job_name),
        name: name.into(),
        writer: writer.into(),
    };
    let files = |paths: &[&str]| {
        let mut manifest = part(1, 7, paths[0], 10).manifest;
        for path in &paths[1..] {
            let mut more = part(1, 8, path, 5).manifest.files;
            manifest.files.append(&mut more);
        }
        manifest
    };
    let (a, b) = (key("dj", "step-1", "host-a:/ckpt"), key("dj", "step-1", "host-b:/ckpt"));
    assert_eq!(store.get_draft(&a).await.unwrap(), None);
    store.put_draft(&a, &files(&["x"]), 100).await.unwrap();
    store.put_draft(&a, &files(&["x", "sub/y"]), 200).await.unwrap();
    store.put_draft(&b, &files(&["z"]), 150).await.unwrap();
    let (stored, manifest) = store.get_draft(&a).await.unwrap().expect("recorded");
    assert_eq!(manifest, files(&["x", "sub/y"]), "the last record replaces the first");
    assert_eq!((stored.file_count, stored.total_bytes, stored.updated_at_ms), (2, 15, 200));
    let listed = store.drafts_of("host-a:/ckpt").await.unwrap();
    assert_eq!(listed, std::slice::from_ref(&stored), "one writer's drafts only");
    let writers: Vec<String> =
        store.drafts_named(&job("dj"), "step-1").await.unwrap().into_iter().map(|d| d.key.writer).collect();
    assert_eq!(writers, ["host-a:/ckpt", "host-b:/ckpt"], "every writer's record of one draft");
    assert!(store.drafts_named(&job("dj"), "step-2").await.unwrap().is_empty());
    assert!(store.live_chunks().await.unwrap().contains(&ChunkHash([8; 32])), "draft chunks are live");
    // Forgetting is per writer, once.
    assert!(store.drop_draft(&a).await.unwrap());
    assert!(!store.drop_draft(&a).await.unwrap());
    assert_eq!(store.get_draft(&a).await.unwrap(), None);
    assert!(store.get_draft(&b).await.unwrap().is_some());
    // Expiry forgets those not put again since.
    store.put_draft(&a, &files(&["x"]), 300).await.unwrap();
    let expired = store.expire_drafts(250).await.unwrap();
    assert_eq!(expired.iter().map(|d| d.key.clone()).collect::<Vec<_>>(), std::slice::from_ref(&b));
    assert!(store.get_draft(&a).await.unwrap().is_some());
    // Bounds: per job, then per writer; replacing a record is always allowed.
    for i in 1..MAX_DRAFTS_PER_JOB {
        store.put_draft(&key("dj", &format!("n{i}"), "many"), &files(&["f"]), 400).await.unwrap();
    }
    let full = store.put_draft(&key("dj", "one-more", "host-c"), &files(&["f"]), 400).await.unwrap_err();
    assert!(matches!(&full, MetaError::ResourceExhausted(m) if m.contains("dj")), "{full}");
    store.put_draft(&a, &files(&["x", "w"]), 500).await.unwrap();
    assert_eq!(MAX_DRAFTS_PER_WRITER, MAX_DRAFTS_PER_JOB);
    store.put_draft(&key("dj2", "n-last", "many"), &files(&["f"]), 400).await.unwrap();
    let full = store.put_draft(&key("dj3", "n", "many"), &files(&["f"]), 400).await.unwrap_err();
    assert!(matches!(&full, MetaError::ResourceExhausted(m) if m.contains("many")), "{full}");
    assert_eq!(store.expire_drafts(450).await.unwrap().len() as u64, MAX_DRAFTS_PER_WRITER);
    assert_eq!(store.drafts_of("many").await.unwrap(), []);
}

pub async fn job_files(store: &dyn MetaStore) {
    use starckpt_proto::draft::MAX_JOB_FILES_PER_JOB;
    let file = |name: &str, rank: u32, size: u64| part(1, rank, name, size).manifest;
    let jf = job("jf");
    assert_eq!(store.get_job_file(&jf, "last.ckpt").await.unwrap(), None);
    store.put_job_file(&jf, "last.ckpt", &file("last.ckpt", 21, 10), 100).await.unwrap();
    store.put_job_file(&jf, "latest", &file("latest", 22, 3), 110).await.unwrap();
    // A put replaces the file whole; the chunks of both puts' files are live until GC marks
    // again, and then only the new one's.
    store.put_job_file(&jf, "last.ckpt", &file("last.ckpt", 23, 20), 120).await.unwrap();
    let (stored, manifest) = store.get_job_file(&jf, "last.ckpt").await.unwrap().expect("put");
    assert_eq!(manifest, file("last.ckpt", 23, 20));
    assert_eq!((stored.name.as_str(), stored.size_bytes, stored.updated_at_ms), ("last.ckpt", 20, 120));
    let names: Vec<String> = store.job_files(&jf).await.unwrap().into_iter().map(|f| f.name).collect();
    assert_eq!(names, ["last.ckpt", "latest"]);
    assert!(store.job_files(&job("other")).await.unwrap().is_empty(), "per job");
    let live = store.live_chunks().await.unwrap();
    assert!(live.contains(&ChunkHash([23; 32])) && live.contains(&ChunkHash([22; 32])), "job files' chunks are live");
    assert!(!live.contains(&ChunkHash([21; 32])), "a replaced file's chunks are not");
    assert!(store.drop_job_file(&jf, "latest").await.unwrap());
    assert!(!store.drop_job_file(&jf, "latest").await.unwrap());
    assert!(!store.live_chunks().await.unwrap().contains(&ChunkHash([22; 32])));
    // Bounded per job; replacing one is always allowed.
    for i in 1..MAX_JOB_FILES_PER_JOB {
        store.put_job_file(&jf, &format!("f{i}"), &file(&format!("f{i}"), 24, 1), 130).await.unwrap();
    }
    let full = store.put_job_file(&jf, "one-more", &file("one-more", 24, 1), 140).await.unwrap_err();
    assert!(matches!(&full, MetaError::ResourceExhausted(m) if m.contains("jf")), "{full}");
    store.put_job_file(&jf, "last.ckpt", &file("last.ckpt", 25, 1), 150).await.unwrap();
    store.put_job_file(&job("jf2"), "last.ckpt", &file("last.ckpt", 25, 1), 150).await.unwrap();
}

pub async fn repair_passes(store: &dyn MetaStore) {
    assert_eq!(store.last_repair_pass().await.unwrap(), None);
    store.record_repair_pass(100, 7).await.unwrap();
    assert_eq!(store.last_repair_pass().await.unwrap(), Some((100, 7)));
    store.record_repair_pass(200, 0).await.unwrap();
    assert_eq!(store.last_repair_pass().await.unwrap(), Some((200, 0)));
    // A pass that finished earlier (a slow one of another control plane) is not the last.
    store.record_repair_pass(150, 9).await.unwrap();
    assert_eq!(store.last_repair_pass().await.unwrap(), Some((200, 0)));
    // Roles are held apart: leading one does not take another.
    let tiering = store.try_lead(Role::Tiering).await.unwrap().expect("nobody leads tiering");
    assert!(store.try_lead(Role::Repair).await.unwrap().is_some(), "tiering held re-replication");
    drop(tiering);
}

pub async fn tiering(store: &dyn MetaStore) {
    let epoch = lease(store, "tj", "run").await.unwrap().epoch;
    let mut ids = Vec::new();
    for step in [1, 2] {
        let record = store.begin_checkpoint(&begin("tj", step, 1, epoch), 1).await.unwrap();
        store.commit_part(&part(record.id, 0, "f", 1), &|| 2 + step, u64::MAX).await.unwrap();
        ids.push(record.id);
    }
    let pending = store.begin_checkpoint(&begin("tj", 3, 2, epoch), 9).await.unwrap();
    let untiered: Vec<u64> = store.untiered_checkpoints().await.unwrap().iter().map(|c| c.id).collect();
    assert_eq!(untiered, ids, "committed ones, oldest first; not the pending one ({})", pending.id);
    let fence = store.tier_sweeps().await.unwrap().fence().expect("no sweep ran yet");
    assert!(store.mark_tiered(ids[0], 50, fence).await.unwrap());
    assert!(store.mark_tiered(ids[0], 60, fence).await.unwrap());
    let untiered: Vec<u64> = store.untiered_checkpoints().await.unwrap().iter().map(|c| c.id).collect();
    assert_eq!(untiered, [ids[1]]);
    let listed = store.list_checkpoints(&job("tj"), false).await.unwrap();
    assert_eq!(listed.iter().map(|c| c.tiered_at_ms).collect::<Vec<_>>(), [Some(50), None, None]);
    // A sweep that begins after an upload looked at the tier fences that upload off; while
    // one runs (or after one died midway) nothing is marked.
    let sweep = store.begin_tier_sweep().await.unwrap();
    assert_eq!(store.tier_sweeps().await.unwrap().fence(), None);
    assert!(!store.mark_tiered(ids[1], 70, fence).await.unwrap());
    assert_eq!(store.begin_tier_sweep().await.unwrap(), sweep + 1, "a second, the first died");
    store.finish_tier_sweep(sweep + 1).await.unwrap();
    store.finish_tier_sweep(sweep).await.unwrap();
    let fence = store.tier_sweeps().await.unwrap().fence().expect("the last sweep finished");
    assert_eq!(fence, sweep + 1);
    assert!(store.mark_tiered(ids[1], 80, fence).await.unwrap());
    assert!(store.untiered_checkpoints().await.unwrap().is_empty());
    // Deleted tiered checkpoints are what a sweep is for; once swept they are forgotten.
    assert!(store.tiered_gone().await.unwrap().is_empty());
    store.delete_checkpoint(&job("tj"), 1, None, 90).await.unwrap();
    assert_eq!(store.tiered_gone().await.unwrap(), [ids[0]]);
    store.forget_tiered(&[ids[0]]).await.unwrap();
    assert!(store.tiered_gone().await.unwrap().is_empty());
    let leader = store.try_lead(Role::Tiering).await.unwrap();
    assert!(leader.is_some());
}

pub async fn control_plane_settings(store: &dyn MetaStore) {
    let member = |id: &str, pending_timeout_ms, gc_grace_ms| ControlPlaneMember {
        id: id.into(),
        listener: id.split('/').next().unwrap_or_default().into(),
        pending_timeout_ms,
        gc_grace_ms,
        security: ControlPlaneMember::security_of(None, false, false),
        tier: ControlPlaneMember::tier_of(None),
    };
    let join = |m: ControlPlaneMember, now, live_since, refuse| async move {
        store.join_control_planes(&m, now, live_since, refuse).await.unwrap()
    };
    assert_eq!(join(member("a", 600_000, 3_600_000), 1_000, 0, true).await, None);
    // Another with the same settings joins; one with others is refused, told why.
    assert_eq!(join(member("b", 600_000, 3_600_000), 2_000, 0, true).await, None);
    let refused = join(member("c", 300_000, 3_600_000), 3_000, 0, true).await.expect("refused");
    assert!(refused.contains("pending timeout of 600 s") && refused.contains("300 s"), "{refused}");
    // Refused, it was not recorded: a fourth with the first two's settings joins.
    assert_eq!(join(member("d", 600_000, 3_600_000), 3_000, 0, true).await, None);
    store.leave_control_planes("d").await.unwrap();
    // A running control plane that finds a conflict (one joined while it looked gone) still
    // records that it is alive, and hears of the conflict.
    assert!(join(member("a", 600_000, 7_200_000), 4_000, 0, false).await.is_some());
    store.leave_control_planes("b").await.unwrap();
    assert_eq!(join(member("e", 600_000, 7_200_000), 5_000, 0, true).await, None);
    // Control planes not seen since `live_since` bind nobody.
    assert_eq!(join(member("f", 300_000, 600_000), 100_000, 50_000, true).await, None);
    assert!(join(member("f", 300_000, 600_000), 100_000, 0, true).await.is_some());

    // A control plane killed before it could leave, restarted where it listened (so no
    // other process listens there) with other settings: its earlier run binds nobody and is
    // replaced. One listening elsewhere still binds, however similar its listener's name.
    let store_fresh = join(member("g:7700/1", 600_000, 3_600_000), 200_000, 0, true).await;
    assert!(store_fresh.is_some(), "e and f are still live here");
    for gone in ["a", "e", "f"] {
        store.leave_control_planes(gone).await.unwrap();
    }
    assert_eq!(join(member("g:7700/1", 600_000, 3_600_000), 200_000, 0, true).await, None);
    assert_eq!(join(member("g:770/1", 600_000, 3_600_000), 200_000, 0, true).await, None);
    let restarted = member("g:7700/2", 300_000, 600_000);
    let conflict = join(restarted.clone(), 201_000, 0, true).await.expect("g:770 binds it");
    assert!(conflict.contains("control plane g:770/1"), "{conflict}");
    store.leave_control_planes("g:770/1").await.unwrap();
    assert_eq!(join(restarted, 202_000, 0, true).await, None, "its earlier run is replaced");
    // Replaced, not just passed over: once the restarted one leaves, nothing binds.
    store.leave_control_planes("g:7700/2").await.unwrap();
    assert_eq!(join(member("h:1/1", 300_000, 600_000), 203_000, 0, true).await, None, "g:7700/1 is gone");

    // Another key, or tokens where the others have none: refused, told why. A member that
    // did not record its security (an older build) binds nobody, and is bound by nobody.
    let key = starckpt_proto::capability::ClusterKey::from_secret(b"0123456789abcdef").unwrap();
    let keyed = |id: &str, tokens| ControlPlaneMember {
        security: ControlPlaneMember::security_of(Some(&key), tokens, false),
        ..member(id, 300_000, 600_000)
    };
    let refused = join(keyed("i:1/1", false), 204_000, 0, true).await.expect("another key");
    assert!(refused.contains("no cluster key") && refused.contains(&key.fingerprint()), "{refused}");
    store.leave_control_planes("h:1/1").await.unwrap();
    assert_eq!(join(keyed("i:1/1", false), 205_000, 0, true).await, None);
    let refused = join(keyed("j:1/1", true), 205_000, 0, true).await.expect("tokens where i has none");
    assert!(refused.contains("bearer tokens required") && refused.contains("no bearer tokens"), "{refused}");
    let unknown = ControlPlaneMember { security: String::new(), ..member("k:1/1", 300_000, 600_000) };
    assert_eq!(join(unknown, 205_000, 0, true).await, None);
    assert_eq!(join(keyed("j:1/1", false), 205_000, 0, true).await, None, "k binds nobody");
    // TLS where the others serve plaintext (clients listing them all would reach one only).
    let tls = ControlPlaneMember {
        security: ControlPlaneMember::security_of(Some(&key), false, true),
        ..member("l:1/1", 300_000, 600_000)
    };
    let refused = join(tls, 205_000, 0, true).await.expect("TLS where j serves plaintext");
    assert!(refused.contains("no bearer tokens, TLS") && refused.contains("--tls-cert"), "{refused}");
    // Another tier, or a tier where the others have none; an older build's binds nobody.
    let tiered =
        |id: &str, url: Option<&str>| ControlPlaneMember { tier: ControlPlaneMember::tier_of(url), ..keyed(id, false) };
    let refused = join(tiered("m:1/1", Some("s3://b/x")), 206_000, 0, true).await.expect("a tier");
    assert!(refused.contains("tier s3://b/x") && refused.contains("no tier") && refused.contains("--tier"));
    let untold = ControlPlaneMember { tier: String::new(), ..keyed("n:1/1", false) };
    assert_eq!(join(untold, 206_000, 0, true).await, None);
    for gone in ["g:7700/1", "g:770/1", "h:1/1", "i:1/1", "j:1/1", "k:1/1"] {
        store.leave_control_planes(gone).await.unwrap();
    }
    assert_eq!(join(tiered("m:1/1", Some("s3://b/x")), 207_000, 0, true).await, None, "n binds nobody");
    let refused = join(tiered("o:1/1", Some("s3://b/y")), 207_000, 0, true).await.expect("another tier");
    assert!(refused.contains("tier s3://b/x") && refused.contains("tier s3://b/y"), "{refused}");
}

pub async fn importing(store: &dyn MetaStore) {
    let imported = ImportedCheckpoint {
        job: job("imp"),
        step: 7,
        epoch: 3,
        created_at_ms: 10,
        committed_at_ms: 20,
        written_bytes: 150,
        parts: (0..2).map(|rank| part(0, rank, &format!("r{rank}.bin"), 100).manifest).collect(),
    };
    let fence = store.tier_sweeps().await.unwrap().fence().unwrap();
    // A tier sweep that began after the tier was read refuses the import: its list of what to
    // keep does not have this checkpoint.
    let sweep = store.begin_tier_sweep().await.unwrap();
    assert!(matches!(store.import_checkpoint(&imported, 25, fence).await, Err(MetaError::FailedPrecondition(_))));
    store.finish_tier_sweep(sweep).await.unwrap();
    assert!(matches!(store.import_checkpoint(&imported, 25, fence).await, Err(MetaError::FailedPrecondition(_))));
    assert_eq!(store.latest(&job("imp")).await.unwrap(), None, "refused imports add nothing");
    let fence = store.tier_sweeps().await.unwrap().fence().unwrap();
    let record = store.import_checkpoint(&imported, 30, fence).await.unwrap().expect("imported");
    assert_eq!(
        (record.state, record.step, record.world_size, record.parts_committed),
        (CheckpointState::Committed, 7, 2, 2)
    );
    assert_eq!((record.total_bytes, record.file_count, record.written_bytes), (200, 2, 150));
    assert_eq!((record.created_at_ms, record.committed_at_ms, record.tiered_at_ms), (10, Some(20), None));
    // It is the job's latest, its manifests as they were; the next tier pass records it.
    assert_eq!(store.latest(&job("imp")).await.unwrap().map(|r| r.id), Some(record.id));
    let (_, parts) = store.get_manifest(&job("imp"), Some(7)).await.unwrap();
    assert_eq!(
        parts.iter().map(|(rank, m)| (*rank, m.clone())).collect::<Vec<_>>(),
        imported.parts.iter().cloned().enumerate().map(|(r, m)| (r as u32, m)).collect::<Vec<_>>()
    );
    assert!(store.untiered_checkpoints().await.unwrap().iter().any(|c| c.id == record.id));
    // Importing again, or over a step the job has: nothing.
    assert!(store.import_checkpoint(&imported, 40, fence).await.unwrap().is_none());
    // A new run of the job takes the lease and saves on from there.
    let epoch = lease(store, "imp", "new-run").await.unwrap().epoch;
    let begun = store.begin_checkpoint(&begin("imp", 8, 1, epoch), 50).await.unwrap();
    store.commit_part(&part(begun.id, 0, "x", 10), &|| 60, u64::MAX).await.unwrap();
    assert_eq!(store.latest(&job("imp")).await.unwrap().map(|r| r.step), Some(8));
    // No ranks: refused.
    let empty = ImportedCheckpoint { parts: vec![], step: 9, ..imported };
    assert!(matches!(store.import_checkpoint(&empty, 70, fence).await, Err(MetaError::InvalidArgument(_))));
}

pub async fn committed_chunks(store: &dyn MetaStore) {
    let epoch = lease(store, "cc", "run").await.unwrap().epoch;
    let other = lease(store, "cc2", "run").await.unwrap().epoch;
    store.set_replication(&job("cc2"), 3, 1).await.unwrap();
    let with = |checkpoint_id: u64, byte: u8, replicas: &[&str]| {
        let mut part = part_with_hash(checkpoint_id, 0, byte);
        part.manifest.files[0].chunks[0].replicas = replicas.iter().map(|r| r.to_string()).collect();
        part
    };
    let a = store.begin_checkpoint(&begin("cc", 1, 1, epoch), 1).await.unwrap();
    store.commit_part(&with(a.id, 1, &["t1", "t2"]), &|| 2, u64::MAX).await.unwrap();
    // The same chunk in another job, listed on another target, and a chunk of its own.
    let b = store.begin_checkpoint(&begin("cc2", 1, 1, other), 3).await.unwrap();
    store.commit_part(&with(b.id, 1, &["t3"]), &|| 4, u64::MAX).await.unwrap();
    let c = store.begin_checkpoint(&begin("cc2", 2, 1, other), 5).await.unwrap();
    store.commit_part(&with(c.id, 2, &["t1"]), &|| 6, u64::MAX).await.unwrap();
    // Pending and deleted checkpoints are not in the list.
    let pending = store.begin_checkpoint(&begin("cc", 2, 2, epoch), 7).await.unwrap();
    store.commit_part(&with(pending.id, 5, &["t1"]), &|| 8, u64::MAX).await.unwrap();
    let deleted = store.begin_checkpoint(&begin("cc", 3, 1, epoch), 9).await.unwrap();
    store.commit_part(&with(deleted.id, 6, &["t1"]), &|| 10, u64::MAX).await.unwrap();
    store.delete_checkpoint(&job("cc"), 3, None, 11).await.unwrap();

    let chunks = store.committed_chunks(2).await.unwrap();
    assert_eq!(chunks.len(), 2, "{chunks:?}");
    let shared = &chunks[&ChunkHash([1; 32])];
    assert_eq!(shared.replicas.iter().collect::<Vec<_>>(), ["t1", "t2", "t3"]);
    assert_eq!((shared.wanted, shared.length), (3, 1), "the highest factor of the jobs naming it");
    assert_eq!(chunks[&ChunkHash([2; 32])].wanted, 3);
    store.set_replication(&job("cc2"), 1, 12).await.unwrap();
    assert_eq!(store.committed_chunks(2).await.unwrap()[&ChunkHash([1; 32])].wanted, 2, "cc's default");
}

/// `stores`: one or more stores on the same database (control planes sharing it); rank `r`
/// commits through `stores[r % len]`.
pub async fn concurrent_last_parts(stores: &[std::sync::Arc<dyn MetaStore>]) {
    // Eight ranks commit at once: exactly one commit transition, all parts recorded.
    let store = &stores[0];
    let epoch = lease(store.as_ref(), "par", "run").await.unwrap().epoch;
    let record = store.begin_checkpoint(&begin("par", 1, 8, epoch), 1).await.unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|rank| {
            let store = std::sync::Arc::clone(&stores[rank as usize % stores.len()]);
            tokio::spawn(async move {
                store.commit_part(&part(record.id, rank, &format!("r{rank}"), 1), &|| 2, u64::MAX).await
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let latest = store.latest(&job("par")).await.unwrap().unwrap();
    assert_eq!((latest.parts_committed, latest.state, latest.total_bytes), (8, CheckpointState::Committed, 8));
}
