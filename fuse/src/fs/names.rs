//! What a job directory shows: each committed checkpoint under the name it was written as, the
//! job files frameworks write beside their checkpoints, the mount's own pointers under
//! `.starckpt/`, and checkpoints being removed file by file (`rm -r`, `shutil.rmtree`).
//!
//! A checkpoint's name and kind are kept in its manifest's metadata ([`NAME_KEY`], [`KIND_KEY`]),
//! so every mount, and this one after a restart, lists it as it was written.
//!
//! A file written directly in the job directory whose name has no step number is a **job file**
//! (Lightning's `last.ckpt`, a model saved at the top of the output directory, DeepSpeed's
//! `latest`): kept at the control plane (`PutJobFile`), replaced whole when it is written again,
//! deleted by `unlink`. One of at most [`MAX_TRACKER_BYTES`] is also a **tracker** if its content
//! names a checkpoint being written (DeepSpeed's `latest` = `global_step500`, Megatron's
//! `latest_checkpointed_iteration.txt` = `500`): that checkpoint is committed first, with the
//! tracker's content in its metadata ([`TRACKER_KEY_PREFIX`]). Trackers committed before job files
//! were kept still read as the newest committed checkpoint carrying one recorded them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use fuser::Errno;
use futures::StreamExt;
use starckpt_client::{CheckpointInfo, JobFileInfo};

use super::write::{DraftFile, Writer};
use super::{CkptFs, Handle, NAME_KEY, errno};
use crate::tree::{step_name, step_of, temporary};

/// Metadata key: "file" for a one-file checkpoint (a file created in the job directory), "dir"
/// for a directory.
pub const KIND_KEY: &str = "starckpt.fuse.kind";
/// Metadata key prefix: `<prefix><tracker file name>` is the content of a tracker file whose
/// write committed the checkpoint.
pub const TRACKER_KEY_PREFIX: &str = "starckpt.fuse.tracker.";
/// The mount's own directory in each job: `latest` and `<step>` symlinks. Never listed (so
/// `rm -r`, `rsync` and framework listings never meet it), always resolvable.
pub const META_DIR: &str = ".starckpt";
/// Largest job file read as a tracker: they hold a name or a number.
pub const MAX_TRACKER_BYTES: u64 = 64 << 10;
/// Checkpoints whose names are kept in memory (a few hundred bytes each).
const MAX_LABELS: usize = 100_000;
/// Manifests fetched at once to learn names when a job with many checkpoints is first listed.
const LABEL_FETCHES: usize = 16;

/// How a committed checkpoint shows in its job directory.
#[derive(Debug)]
pub(super) struct Label {
    pub(super) name: String,
    /// A one-file checkpoint: shown as the file itself.
    pub(super) file: bool,
    /// Tracker file name → the content its write committed this checkpoint with.
    pub(super) trackers: BTreeMap<String, String>,
}

/// A committed checkpoint and its label.
#[derive(Clone)]
pub(super) struct Named {
    pub(super) info: CheckpointInfo,
    pub(super) label: Arc<Label>,
}

/// A job file as the job directory shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum JobEntry {
    /// Kept at the control plane: its size.
    Kept(JobFileInfo),
    /// A tracker's content as a committed checkpoint recorded it (before job files were kept).
    Recorded(Arc<Vec<u8>>),
}

impl JobEntry {
    pub(super) fn size(&self) -> u64 {
        match self {
            JobEntry::Kept(info) => info.size_bytes,
            JobEntry::Recorded(content) => content.len() as u64,
        }
    }
}

/// Files and directories of a committed checkpoint that a process removing it (file by file,
/// as `rm -r` does) has removed so far: hidden from this mount's views while that process lives.
/// The checkpoint itself goes only when its top directory is removed, in one step at the control
/// plane; a remover that dies midway leaves it whole.
pub(super) struct Removal {
    pub(super) remover: u32,
    process: Process,
    pub(super) paths: HashSet<String>,
}

impl Removal {
    pub(super) fn new(remover: u32) -> Option<Removal> {
        Some(Removal { remover, process: Process::of(remover)?, paths: HashSet::new() })
    }

    pub(super) fn live(&self) -> bool {
        self.process.live()
    }
}

/// A process, told apart from a later one given the same pid by its start time
/// (`/proc/<pid>/stat` field 22).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Process {
    pid: u32,
    started: u64,
}

impl Process {
    /// The process of thread `tid`.
    pub(super) fn of(tid: u32) -> Option<Process> {
        let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
        let pid = status.lines().find_map(|line| line.strip_prefix("Tgid:"))?.trim().parse().ok()?;
        Some(Process { pid, started: start_time(pid)? })
    }

    /// Still running (a zombie has ended).
    pub(super) fn live(&self) -> bool {
        start_time(self.pid) == Some(self.started) && !zombie(self.pid)
    }
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next().map(|s| s == "Z")))
        .unwrap_or(true)
}

fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn label_of(
    info: &CheckpointInfo,
    metadata: Option<&BTreeMap<String, String>>,
    files: &[String],
    dirs: usize,
) -> Label {
    let empty = BTreeMap::new();
    let metadata = metadata.unwrap_or(&empty);
    let name = metadata.get(NAME_KEY).cloned().unwrap_or_else(|| step_name(info.step));
    let file = match metadata.get(KIND_KEY).map(String::as_str) {
        Some(kind) => kind == "file",
        // Committed before kinds were recorded: a one-file checkpoint is named as its only file.
        None => metadata.contains_key(NAME_KEY) && dirs == 0 && files == [name.clone()],
    };
    let trackers = metadata
        .iter()
        .filter_map(|(key, value)| Some((key.strip_prefix(TRACKER_KEY_PREFIX)?.to_owned(), value.clone())))
        .collect();
    Label { name, file, trackers }
}

impl CkptFs {
    /// The committed checkpoints of `job` with their names, by step.
    pub(super) fn named(&self, job: &str) -> Result<Vec<Named>, Errno> {
        let steps = self.steps(job)?;
        let missing: Vec<CheckpointInfo> = {
            let state = self.state();
            steps.iter().filter(|info| !state.labels.contains_key(&info.checkpoint_id)).cloned().collect()
        };
        if !missing.is_empty() {
            let fetched: Vec<(u64, Label)> = self.block_on(async {
                futures::stream::iter(missing)
                    .map(|info| async move {
                        let manifest = self.client.manifest(job, Some(info.step)).await.ok()?;
                        // The step was saved again since the listing: the next listing has it.
                        if manifest.info.checkpoint_id != info.checkpoint_id {
                            return None;
                        }
                        let files: Vec<String> = manifest.files.iter().take(2).map(|f| f.path.to_string()).collect();
                        let metadata = manifest.metadata.first().map(|(_, m)| m);
                        Some((info.checkpoint_id, label_of(&info, metadata, &files, manifest.directories.len())))
                    })
                    .buffer_unordered(LABEL_FETCHES)
                    .filter_map(|found| async move { found })
                    .collect()
                    .await
            });
            let mut state = self.state();
            if state.labels.len() + fetched.len() > MAX_LABELS {
                state.labels.clear();
            }
            for (id, label) in fetched {
                state.labels.insert(id, Arc::new(label));
            }
        }
        let state = self.state();
        Ok(steps
            .into_iter()
            .filter_map(|info| {
                let label = Arc::clone(state.labels.get(&info.checkpoint_id)?);
                Some(Named { info, label })
            })
            .collect())
    }

    /// The committed checkpoint of `job` named `name`.
    pub(super) fn named_as(&self, job: &str, name: &str) -> Result<Option<Named>, Errno> {
        Ok(self.named(job)?.into_iter().find(|n| n.label.name == name))
    }

    /// The name the committed checkpoint at `step` of `job` shows under.
    pub(super) fn name_of_step(&self, job: &str, step: u64) -> Result<Option<String>, Errno> {
        Ok(self.named(job)?.into_iter().find(|n| n.info.step == step).map(|n| n.label.name.clone()))
    }

    /// The job files of `job` (cached for `listing_ttl`), with the trackers committed
    /// checkpoints recorded under names no job file has.
    pub(super) fn job_files(&self, job: &str) -> Result<BTreeMap<String, JobEntry>, Errno> {
        let mut named = self.named(job)?;
        named.sort_by_key(|n| n.info.step);
        let mut files = BTreeMap::new();
        for n in &named {
            for (name, content) in &n.label.trackers {
                files.insert(name.clone(), JobEntry::Recorded(Arc::new(content.clone().into_bytes())));
            }
        }
        let cached = self.state().job_files.get(job).filter(|(at, _)| at.elapsed() < self.config.listing_ttl).cloned();
        let kept = match cached {
            Some((_, kept)) => kept,
            None => {
                let kept =
                    Arc::new(self.block_on(self.client.job_files(job)).map_err(|e| errno("list job files", job, &e))?);
                self.state().job_files.insert(job.to_owned(), (Instant::now(), Arc::clone(&kept)));
                kept
            }
        };
        for info in kept.iter() {
            files.insert(info.name.clone(), JobEntry::Kept(info.clone()));
        }
        Ok(files)
    }

    /// Opens job file `name` of `job` to read it.
    pub(super) fn open_job_file(&self, job: &str, name: &str) -> Result<Handle, Errno> {
        match self.job_files(job)?.remove(name).ok_or(Errno::ENOENT)? {
            JobEntry::Recorded(content) => Ok(Handle::Content(content)),
            JobEntry::Kept(_) => {
                let manifest = self
                    .block_on(self.client.job_file(job, name))
                    .map_err(|e| errno("get job file", &format!("{job}/{name}"), &e))?
                    .ok_or(Errno::ENOENT)?;
                Ok(Handle::Read(self.reads.open(Arc::new(manifest), 0).ok_or(Errno::ENOENT)?))
            }
        }
    }

    /// Deletes job file `name` of `job`. A tracker only a committed checkpoint recorded is that
    /// checkpoint's (EROFS).
    pub(super) fn remove_job_file(&self, job: &str, name: &str) -> Result<(), Errno> {
        let dropped = self
            .block_on(self.client.drop_job_file(job, name))
            .map_err(|e| errno("drop job file", &format!("{job}/{name}"), &e))?;
        self.state().job_files.remove(job);
        match dropped {
            true => Ok(()),
            false if self.job_files(job)?.contains_key(name) => Err(Errno::EROFS),
            false => Err(Errno::ENOENT),
        }
    }

    /// A file ended directly in a job directory under a final name that is a job file's
    /// ([`Self::is_job_file_name`]): kept as a job file, replacing the one of its name. One small
    /// enough to be a tracker that names a checkpoint being written commits that checkpoint
    /// first, so a reader that follows the tracker finds it committed. Nothing to do for a file
    /// of a draft, one unlinked, or one under a temporary name.
    pub(super) fn keep_job_file(&self, file: &Arc<DraftFile>) -> Result<(), Errno> {
        let path = file.path();
        if file.draft.is_some() || file.abandoned.load(std::sync::atomic::Ordering::Relaxed) || temporary(&path) {
            return Ok(());
        }
        let done = self.block_on(async {
            match &*file.writer.lock().await {
                Writer::Done(done) => Some(done.clone()),
                _ => None,
            }
        });
        let Some(done) = done else { return Ok(()) };
        if done.size <= MAX_TRACKER_BYTES
            && let Ok(content) = file.read_at(0, done.size as u32)
        {
            self.tracker_commits(&file.job, &path, &String::from_utf8_lossy(&content))?;
        }
        self.block_on(self.client.put_job_file(&file.job, &path, done))
            .map_err(|e| errno("put job file", &format!("{}/{path}", file.job), &e))?;
        self.block_on(async { *file.writer.lock().await = Writer::Committed(None) });
        file.drop_spill();
        self.kept_single(file);
        Ok(())
    }

    /// Whether a file ending directly in job directory `job` as `name` is a job file rather
    /// than a one-file checkpoint: its name has no step number, or its step is committed under
    /// another name.
    pub(super) fn is_job_file_name(&self, job: &str, name: &str) -> Result<bool, Errno> {
        let Some(step) = step_of(name) else { return Ok(true) };
        Ok(self.name_of_step(job, step)?.is_some_and(|taken| taken != name))
    }

    /// A tracker file ended: its content names the checkpoint it completes (a draft's name,
    /// DeepSpeed's `latest`, or its step, Megatron's `latest_checkpointed_iteration.txt`),
    /// which is committed now with the tracker's content in its metadata.
    fn tracker_commits(&self, job: &str, name: &str, content: &str) -> Result<(), Errno> {
        let named = content.trim();
        if named.is_empty() {
            return Ok(());
        }
        let draft = {
            let state = self.state();
            let in_job = || state.drafts.iter().filter(|(_, d)| d.job == job && !d.committing);
            let by_name = in_job().find(|(_, d)| d.name == named).map(|(id, d)| (*id, d.name.clone()));
            by_name.or_else(|| {
                let step: u64 = named.parse().ok()?;
                let mut matching = in_job().filter(|(_, d)| step_of(&d.name) == Some(step));
                let (id, d) = matching.next()?;
                // Two drafts of that step: which one it names cannot be told.
                matching.next().is_none().then(|| (*id, d.name.clone()))
            })
        };
        let Some((draft, draft_name)) = draft else { return Ok(()) };
        let step = step_of(&draft_name).ok_or(Errno::EINVAL)?;
        let metadata = [(format!("{TRACKER_KEY_PREFIX}{name}"), content.to_owned())].into_iter().collect();
        tracing::info!(job, tracker = name, checkpoint = %draft_name, "a tracker file names a checkpoint being written: committing it");
        self.commit_draft(draft, step, &draft_name, metadata)
    }

    /// Whether `path` (or a directory above it) of committed checkpoint `checkpoint` was removed
    /// by a process still removing it.
    pub(super) fn removed(&self, checkpoint: u64, path: &str) -> bool {
        let mut state = self.state();
        let Some(removal) = state.removals.get(&checkpoint) else { return false };
        if !removal.live() {
            tracing::warn!(
                checkpoint,
                remover = removal.remover,
                "a removal stopped midway: the checkpoint is whole again"
            );
            state.removals.remove(&checkpoint);
            return false;
        }
        let mut at = path;
        loop {
            if removal.paths.contains(at) {
                return true;
            }
            match at.rsplit_once('/') {
                Some((parent, _)) => at = parent,
                None => return false,
            }
        }
    }

    /// Notes that process `remover` removed `path` of checkpoint `checkpoint`.
    pub(super) fn note_removed(&self, checkpoint: u64, remover: u32, path: String) -> Result<(), Errno> {
        let mut state = self.state();
        let removals: &mut HashMap<u64, Removal> = &mut state.removals;
        if let Some(removal) = removals.get(&checkpoint)
            && removal.remover != remover
            && removal.live()
        {
            // Two removers of one checkpoint: the second waits for the first to finish.
            return Err(Errno::EBUSY);
        }
        let removal = match removals.get_mut(&checkpoint) {
            Some(removal) if removal.remover == remover => removal,
            _ => {
                removals.insert(checkpoint, Removal::new(remover).ok_or(Errno::EACCES)?);
                removals.get_mut(&checkpoint).ok_or(Errno::EIO)?
            }
        };
        removal.paths.insert(path);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(step: u64) -> CheckpointInfo {
        CheckpointInfo { step, checkpoint_id: 7, ..Default::default() }
    }

    #[test]
    fn labels_from_metadata() {
        let meta = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let sdk = label_of(&info(5), None, &["a".into(), "b".into()], 0);
        assert_eq!((sdk.name.as_str(), sdk.file), ("5", false));
        let dir = label_of(&info(5), Some(&meta(&[(NAME_KEY, "checkpoint-5"), (KIND_KEY, "dir")])), &["x".into()], 0);
        assert_eq!((dir.name.as_str(), dir.file), ("checkpoint-5", false));
        let file = label_of(&info(3), Some(&meta(&[(NAME_KEY, "epoch=0-step=3.ckpt"), (KIND_KEY, "file")])), &[], 0);
        assert!(file.file);
        // Older one-file checkpoints: named as their only file.
        let old = label_of(&info(2), Some(&meta(&[(NAME_KEY, "m_2.pt")])), &["m_2.pt".into()], 0);
        assert!(old.file);
        let tracked = label_of(
            &info(500),
            Some(&meta(&[(NAME_KEY, "global_step500"), (&format!("{TRACKER_KEY_PREFIX}latest"), "global_step500")])),
            &[],
            0,
        );
        assert_eq!(tracked.trackers.get("latest").map(String::as_str), Some("global_step500"));
    }

    #[test]
    fn a_removal_lasts_while_its_remover_lives() {
        let me = Removal::new(std::process::id()).unwrap();
        assert!(me.live());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = Removal::new(child.id());
        child.wait().unwrap();
        assert!(gone.is_none_or(|removal| !removal.live()));
    }
}
