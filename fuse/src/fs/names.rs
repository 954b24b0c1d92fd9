//! What a job directory shows: each committed checkpoint under the name it was written as, the
//! tracker files frameworks write beside their checkpoints, the mount's own pointers under
//! `.starckpt/`, and checkpoints being removed file by file (`rm -r`, `shutil.rmtree`).
//!
//! A checkpoint's name and kind are kept in its manifest's metadata ([`NAME_KEY`], [`KIND_KEY`]),
//! so every mount, and this one after a restart, lists it as it was written. Tracker files
//! (`latest`, `latest_checkpointed_iteration.txt`: a name with no step number) are kept the same
//! way: the content that committed a checkpoint is in that checkpoint's metadata
//! ([`TRACKER_KEY_PREFIX`]), and a tracker reads as the content recorded by the newest committed
//! checkpoint that carries it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use fuser::Errno;
use futures::StreamExt;
use starckpt_client::CheckpointInfo;

use super::{CkptFs, Handle, NAME_KEY};
use crate::tree::{step_name, step_of};

/// Metadata key: "file" for a one-file checkpoint (a file created in the job directory), "dir"
/// for a directory.
pub const KIND_KEY: &str = "starckpt.fuse.kind";
/// Metadata key prefix: `<prefix><tracker file name>` is the content of a tracker file whose
/// write committed the checkpoint.
pub const TRACKER_KEY_PREFIX: &str = "starckpt.fuse.tracker.";
/// The mount's own directory in each job: `latest` and `<step>` symlinks. Never listed (so
/// `rm -r`, `rsync` and framework listings never meet it), always resolvable.
pub const META_DIR: &str = ".starckpt";
/// Largest tracker file: they hold a name or a number.
pub const MAX_JOB_FILE_BYTES: usize = 64 << 10;
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

/// A tracker file written through this mount, not (yet) recorded with a checkpoint.
#[derive(Default)]
pub(super) struct JobFile {
    pub(super) content: Mutex<Vec<u8>>,
    /// Written since it was last published ([`CkptFs::publish_job_file`]).
    pub(super) dirty: AtomicBool,
}

impl JobFile {
    fn content(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.content.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn read_at(&self, offset: u64, len: u32) -> Vec<u8> {
        let content = self.content();
        let start = (offset as usize).min(content.len());
        let end = start.saturating_add(len as usize).min(content.len());
        content[start..end].to_vec()
    }

    pub(super) fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let end = offset as usize + data.len();
        if end > MAX_JOB_FILE_BYTES {
            tracing::warn!(end, "a file with no step number in a job directory is a tracker file, at most 64 KiB");
            return Err(Errno::EFBIG);
        }
        let mut content = self.content();
        if content.len() < end {
            content.resize(end, 0);
        }
        content[offset as usize..end].copy_from_slice(data);
        self.dirty.store(true, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn size(&self) -> u64 {
        self.content().len() as u64
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

    /// Tracker files of `job` and their contents: as written through this mount since, else as
    /// the newest committed checkpoint carrying each recorded it.
    pub(super) fn trackers(&self, job: &str) -> Result<BTreeMap<String, Vec<u8>>, Errno> {
        let mut named = self.named(job)?;
        named.sort_by_key(|n| n.info.step);
        let mut trackers = BTreeMap::new();
        for n in &named {
            for (name, content) in &n.label.trackers {
                trackers.insert(name.clone(), content.clone().into_bytes());
            }
        }
        let state = self.state();
        for ((j, name), file) in &state.job_files {
            if j == job {
                trackers.insert(name.clone(), file.content().clone());
            }
        }
        Ok(trackers)
    }

    /// Opens tracker file `name` of `job` (created by `create` or already there).
    pub(super) fn open_job_file(&self, job: &str, name: &str, write: bool, truncate: bool) -> Result<u64, Errno> {
        let key = (job.to_owned(), name.to_owned());
        let existing = self.state().job_files.get(&key).cloned();
        let file = match existing {
            Some(file) => file,
            None => {
                let content = self.trackers(job)?.remove(name).ok_or(Errno::ENOENT)?;
                let file = Arc::new(JobFile { content: Mutex::new(content), dirty: AtomicBool::new(false) });
                if !write {
                    return Ok(self.add_handle(Handle::JobFile(file)));
                }
                Arc::clone(self.state().job_files.entry(key).or_insert(file))
            }
        };
        if truncate {
            file.content().clear();
            file.dirty.store(true, Ordering::Relaxed);
        }
        Ok(self.add_handle(Handle::JobFile(file)))
    }

    /// A new, empty tracker file `name` of `job`.
    pub(super) fn create_job_file(&self, job: &str, name: &str) -> u64 {
        let file = Arc::new(JobFile::default());
        self.state().job_files.insert((job.to_owned(), name.to_owned()), Arc::clone(&file));
        self.add_handle(Handle::JobFile(file))
    }

    pub(super) fn truncate_job_file(&self, job: &str, name: &str, size: u64) -> Result<(), Errno> {
        let file = self.state().job_files.get(&(job.to_owned(), name.to_owned())).cloned().ok_or(Errno::EROFS)?;
        if size as usize > MAX_JOB_FILE_BYTES {
            return Err(Errno::EFBIG);
        }
        file.content().resize(size as usize, 0);
        file.dirty.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// A tracker file closed after a write: its content names the checkpoint it completes (a
    /// draft's name, DeepSpeed's `latest`, or its step, Megatron's
    /// `latest_checkpointed_iteration.txt`), which is committed now with the tracker's content
    /// in its metadata. One that names no draft is kept by this mount only, and said so.
    pub(super) fn publish_job_file(&self, job: &str, name: &str, file: &Arc<JobFile>) -> Result<(), Errno> {
        if !file.dirty.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        let content = String::from_utf8_lossy(&file.content()).into_owned();
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
        let Some((draft, draft_name)) = draft else {
            let known = self.named_as(job, named)?.is_some()
                || named
                    .parse::<u64>()
                    .is_ok_and(|step| self.steps(job).is_ok_and(|s| s.iter().any(|c| c.step == step)));
            tracing::warn!(
                job,
                tracker = name,
                content = named,
                "a tracker file names {}: its content is kept by this mount only, until it names a checkpoint being written",
                if known { "a checkpoint committed already" } else { "no checkpoint of the job" }
            );
            return Ok(());
        };
        let step = step_of(&draft_name).ok_or(Errno::EINVAL)?;
        let metadata = [(format!("{TRACKER_KEY_PREFIX}{name}"), content.clone())].into_iter().collect();
        tracing::info!(job, tracker = name, checkpoint = %draft_name, "a tracker file names a checkpoint being written: committing it");
        if let Err(e) = self.commit_draft(draft, step, &draft_name, metadata) {
            file.dirty.store(true, Ordering::Relaxed);
            return Err(e);
        }
        // Recorded with the checkpoint: read from there from now on (every mount sees it).
        let mut state = self.state();
        let key = (job.to_owned(), name.to_owned());
        if state.job_files.get(&key).is_some_and(|f| Arc::ptr_eq(f, file)) && !file.dirty.load(Ordering::Relaxed) {
            state.job_files.remove(&key);
        }
        Ok(())
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
    fn job_files_are_bounded() {
        let file = JobFile::default();
        file.write_at(0, b"global_step5").unwrap();
        file.write_at(6, b"STEP").unwrap();
        assert_eq!(file.read_at(0, 100), b"globalSTEPp5");
        assert_eq!(file.read_at(20, 100), b"");
        assert_eq!(file.write_at(MAX_JOB_FILE_BYTES as u64, b"x"), Err(Errno::EFBIG));
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
