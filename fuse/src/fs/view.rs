//! What the mount shows: the control plane's listings (cached for `listing_ttl`), each node's
//! attributes, how a name resolves in a directory, and a directory's listing.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use fuser::{Errno, FileAttr, FileType, Generation, INodeNo, ReplyEntry};
use starckpt_client::CheckpointInfo;
use starckpt_proto::JobName;

use super::names::{JobEntry, META_DIR};
use super::write::Draft;
use super::{CkptFs, Node, errno, time_of};
use crate::read::Reader;
use crate::tree::{Child, StepTree, join, parse_step_name, split, step_name};
use starckpt_client::sync::LockExt;

impl CkptFs {
    // ---- control-plane views, cached for `listing_ttl` ----

    pub(super) fn jobs(&self) -> Result<Vec<String>, Errno> {
        if let Some((at, jobs)) = &self.state().jobs
            && at.elapsed() < self.config.listing_ttl
        {
            return Ok(jobs.clone());
        }
        let jobs: Vec<String> = self
            .block_on(self.client.list_jobs())
            .map_err(|e| errno("list jobs", "/", &e))?
            .into_iter()
            .filter(|j| j.committed_checkpoints > 0)
            // An admin token lists tenants' jobs as `<tenant>/<name>`, which is no file name:
            // such a mount shows the jobs outside every tenant (a tenant's token mounts its own).
            .filter(|j| !j.job.contains('/'))
            .map(|j| j.job)
            .collect();
        self.state().jobs = Some((Instant::now(), jobs.clone()));
        Ok(jobs)
    }

    /// Committed checkpoints of `job`, by step.
    pub(super) fn steps(&self, job: &str) -> Result<Vec<CheckpointInfo>, Errno> {
        if let Some((at, steps)) = self.state().steps.get(job)
            && at.elapsed() < self.config.listing_ttl
        {
            return Ok(steps.clone());
        }
        let steps: Vec<CheckpointInfo> = self
            .block_on(self.client.list_checkpoints(job, false))
            .map_err(|e| errno("list checkpoints", job, &e))?
            .into_iter()
            .filter(|c| c.state == starckpt_client::CheckpointState::Committed as i32)
            .collect();
        self.state().steps.insert(job.to_owned(), (Instant::now(), steps.clone()));
        Ok(steps)
    }

    pub(super) fn forget_listings(&self, job: &str) {
        let mut state = self.state();
        state.jobs = None;
        state.steps.remove(job);
    }

    pub(super) fn step_info(&self, job: &str, step: u64) -> Result<Option<CheckpointInfo>, Errno> {
        Ok(self.steps(job)?.into_iter().find(|c| c.step == step))
    }

    pub(super) fn tree(&self, job: &str, step: u64) -> Result<Arc<StepTree>, Errno> {
        let cached = self.state().trees.get(&(job.to_owned(), step)).cloned();
        if let Some(tree) = cached {
            // The step may have been deleted and written again elsewhere: same step, new id.
            let current = self.step_info(job, step)?.map(|c| c.checkpoint_id);
            if current == Some(tree.manifest.info.checkpoint_id) {
                return Ok(tree);
            }
        }
        let manifest = self
            .block_on(self.client.manifest(job, Some(step)))
            .map_err(|e| errno("get manifest", &format!("{job}/{step}"), &e))?;
        let tree = Arc::new(StepTree::new(manifest));
        let mut state = self.state();
        if state.trees.len() >= self.config.cached_manifests.max(1) {
            // Manifests are immutable; dropping any one only costs a re-fetch.
            if let Some(key) = state.trees.keys().next().cloned() {
                state.trees.remove(&key);
            }
        }
        state.trees.insert((job.to_owned(), step), Arc::clone(&tree));
        Ok(tree)
    }

    /// The tree of checkpoint `checkpoint` at `job`/`step`: ESTALE if the step is now another
    /// checkpoint (deleted and saved again), ENOENT if it is gone.
    pub(super) fn tree_at(&self, job: &str, step: u64, checkpoint: u64) -> Result<Arc<StepTree>, Errno> {
        let tree = self.tree(job, step)?;
        if tree.manifest.info.checkpoint_id != checkpoint {
            return Err(Errno::ESTALE);
        }
        Ok(tree)
    }

    // ---- attributes ----

    pub(super) fn attr(&self, ino: u64, kind: FileType, size: u64, perm: u16, time: SystemTime) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: time,
            mtime: time,
            ctime: time,
            crtime: time,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 1 << 20,
            flags: 0,
        }
    }

    /// Attributes of `node` and how long the kernel may cache them.
    pub(super) fn node_attr(&self, ino: u64, node: &Node) -> Result<(FileAttr, Duration), Errno> {
        let dynamic = self.config.listing_ttl;
        Ok(match node {
            Node::Root | Node::Job(_) => (self.attr(ino, FileType::Directory, 0, 0o755, self.mounted_at), dynamic),
            Node::Meta(_) => (self.attr(ino, FileType::Directory, 0, 0o555, self.mounted_at), dynamic),
            Node::Pointer { job, step } => {
                let target = self.pointer(job, *step)?;
                (self.attr(ino, FileType::Symlink, target.len() as u64, 0o777, self.mounted_at), dynamic)
            }
            Node::JobFile { job, name } => {
                // Being written again through this inode (opened with O_TRUNC): as written so far.
                let writing = {
                    let state = self.state();
                    state.single_files.get(&(job.clone(), name.clone())).and_then(|id| state.files.get(id).cloned())
                };
                if let Some(file) = writing {
                    let size = file.size.load(Ordering::Relaxed);
                    return Ok((self.attr(ino, FileType::RegularFile, size, 0o644, file.created), Duration::ZERO));
                }
                let entry = self.job_files(job)?.remove(name).ok_or(Errno::ENOENT)?;
                let time = match &entry {
                    JobEntry::Kept(info) => time_of(info.updated_at_ms),
                    JobEntry::Recorded(_) => self.mounted_at,
                };
                (self.attr(ino, FileType::RegularFile, entry.size(), 0o644, time), Duration::ZERO)
            }
            Node::StepDir { job, step, checkpoint, dir } => {
                let info = self.step_info(job, *step)?.ok_or(Errno::ENOENT)?;
                if info.checkpoint_id != *checkpoint {
                    return Err(Errno::ESTALE);
                }
                if !dir.is_empty()
                    && (!self.tree_at(job, *step, *checkpoint)?.dirs.contains_key(dir)
                        || self.removed(*checkpoint, dir))
                {
                    return Err(Errno::ENOENT);
                }
                (
                    self.attr(ino, FileType::Directory, 0, 0o555, time_of(info.committed_at_ms)),
                    self.config.committed_ttl,
                )
            }
            Node::StepFile { job, step, checkpoint, index } => {
                let tree = self.tree_at(job, *step, *checkpoint)?;
                let file = tree.manifest.files.get(*index).ok_or(Errno::ENOENT)?;
                if self.removed(*checkpoint, file.path.as_str()) {
                    return Err(Errno::ENOENT);
                }
                let perm = if file.mode == 0 { 0o444 } else { (file.mode & 0o555) as u16 };
                let time = time_of(tree.manifest.info.committed_at_ms);
                (self.attr(ino, FileType::RegularFile, file.size_bytes, perm, time), self.config.committed_ttl)
            }
            Node::DraftDir { .. } => (self.attr(ino, FileType::Directory, 0, 0o755, self.mounted_at), dynamic),
            Node::DraftFile { file } => {
                let file = self.state().files.get(file).cloned().ok_or(Errno::ENOENT)?;
                let mode = file.mode.load(Ordering::Relaxed) as u16;
                let mtime = file.mtime.lock_unpoisoned().unwrap_or(file.created);
                let mut attr =
                    self.attr(ino, FileType::RegularFile, file.size.load(Ordering::Relaxed), mode, file.created);
                attr.mtime = mtime;
                (attr, Duration::ZERO)
            }
        })
    }

    pub(super) fn reply_entry(&self, node: Node, reply: ReplyEntry) {
        // Attributes first: a lookup is counted only when the kernel is told about the inode.
        match self.node_attr(0, &node) {
            Ok((mut attr, ttl)) => {
                attr.ino = INodeNo(self.remember(node));
                reply.entry(&ttl, &attr, Generation(0));
            }
            Err(e) => reply.error(e),
        }
    }

    // ---- name resolution ----

    pub(super) fn resolve(&self, parent: &Node, name: &str) -> Result<Node, Errno> {
        match parent {
            Node::Root => {
                if JobName::try_from(name).is_err() {
                    return Err(Errno::ENOENT);
                }
                if self.state().local_jobs.contains(name) || self.jobs()?.iter().any(|j| j == name) {
                    Ok(Node::Job(name.to_owned()))
                } else {
                    Err(Errno::ENOENT)
                }
            }
            Node::Job(job) => {
                let key = (job.clone(), name.to_owned());
                let draft = self.state().draft_names.get(&key).copied();
                if let Some(draft) = draft
                    && !self.committed_elsewhere(job, name, draft)
                {
                    return Ok(Node::DraftDir { draft, path: String::new() });
                }
                {
                    let state = self.state();
                    if let Some(file) = state.single_files.get(&key) {
                        return Ok(Node::DraftFile { file: *file });
                    }
                }
                if name == META_DIR {
                    return Ok(Node::Meta(job.clone()));
                }
                if let Some(named) = self.named_as(job, name)? {
                    let (step, checkpoint) = (named.info.step, named.info.checkpoint_id);
                    let job = job.clone();
                    return Ok(if named.label.file {
                        Node::StepFile { job, step, checkpoint, index: 0 }
                    } else {
                        Node::StepDir { job, step, checkpoint, dir: String::new() }
                    });
                }
                if self.job_files(job)?.contains_key(name) {
                    return Ok(Node::JobFile { job: job.clone(), name: name.to_owned() });
                }
                Err(Errno::ENOENT)
            }
            Node::Meta(job) => {
                let step = if name == "latest" { None } else { Some(parse_step_name(name).ok_or(Errno::ENOENT)?) };
                self.pointer(job, step)?;
                Ok(Node::Pointer { job: job.clone(), step })
            }
            Node::StepDir { job, step, checkpoint, dir } => {
                let (job, step, checkpoint) = (job.clone(), *step, *checkpoint);
                if self.removed(checkpoint, &join(dir, name)) {
                    return Err(Errno::ENOENT);
                }
                match self.tree_at(&job, step, checkpoint)?.child(dir, name) {
                    Some(Child::Dir) => Ok(Node::StepDir { job, step, checkpoint, dir: join(dir, name) }),
                    Some(Child::File(index)) => Ok(Node::StepFile { job, step, checkpoint, index: *index }),
                    None => Err(Errno::ENOENT),
                }
            }
            Node::DraftDir { draft, path } => {
                let (job, draft_name) = {
                    let state = self.state();
                    let draft_state = state.drafts.get(draft).ok_or(Errno::ENOENT)?;
                    let full = join(path, name);
                    if draft_state.dirs.contains(&full) {
                        return Ok(Node::DraftDir { draft: *draft, path: full });
                    } else if let Some(file) = draft_state.files.get(&full) {
                        return Ok(Node::DraftFile { file: *file });
                    }
                    (draft_state.job.clone(), draft_state.name.clone())
                };
                // A name this mount did not write: another writer's mount may have committed the
                // draft with its own files (the kernel still knows the directory as the draft's).
                if self.committed_elsewhere(&job, &draft_name, *draft)
                    && let Ok(Some(named)) = self.named_as(&job, &draft_name)
                {
                    let (step, checkpoint) = (named.info.step, named.info.checkpoint_id);
                    return self.resolve(&Node::StepDir { job, step, checkpoint, dir: path.clone() }, name);
                }
                Err(Errno::ENOENT)
            }
            Node::Pointer { .. } | Node::JobFile { .. } | Node::StepFile { .. } | Node::DraftFile { .. } => {
                Err(Errno::ENOTDIR)
            }
        }
    }

    /// Whether `name` is taken in job directory `job`.
    pub(super) fn job_name_taken(&self, job: &str, name: &str) -> Result<bool, Errno> {
        match self.resolve(&Node::Job(job.to_owned()), name) {
            Ok(_) => Ok(true),
            Err(e) if e == Errno::ENOENT => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(super) fn listing(&self, ino: u64, node: &Node) -> Result<Vec<(u64, FileType, String)>, Errno> {
        let mut entries = vec![(ino, FileType::Directory, ".".to_owned()), (1, FileType::Directory, "..".to_owned())];
        let mut push = |node: Node, kind: FileType, name: String| {
            let ino = self.listing_ino(&node);
            entries.push((ino, kind, name));
        };
        match node {
            Node::Root => {
                let mut jobs: BTreeSet<String> = self.jobs()?.into_iter().collect();
                jobs.extend(self.state().local_jobs.iter().cloned());
                for job in jobs {
                    push(Node::Job(job.clone()), FileType::Directory, job);
                }
            }
            Node::Job(job) => {
                let job_files = self.job_files(job)?;
                let named = self.named(job)?;
                let committed: HashSet<String> = named.iter().map(|n| n.label.name.clone()).collect();
                for named in named {
                    let (step, checkpoint, job) = (named.info.step, named.info.checkpoint_id, job.clone());
                    let name = named.label.name.clone();
                    if named.label.file {
                        push(Node::StepFile { job, step, checkpoint, index: 0 }, FileType::RegularFile, name);
                    } else {
                        push(Node::StepDir { job, step, checkpoint, dir: String::new() }, FileType::Directory, name);
                    }
                }
                let pick = |map: &HashMap<(String, String), u64>| -> Vec<(String, u64)> {
                    map.iter().filter(|((j, _), _)| j == job).map(|((_, n), id)| (n.clone(), *id)).collect()
                };
                let (drafts, singles) = {
                    let state = self.state();
                    let mut drafts = pick(&state.draft_names);
                    // A draft no process that wrote it is still writing (one killed midway) is
                    // not listed: see `Draft::writers`.
                    drafts.retain(|(_, id)| state.drafts.get(id).is_some_and(Draft::attended));
                    (drafts, pick(&state.single_files))
                };
                for (name, draft) in drafts {
                    // Committed by another writer's mount: listed above, as committed.
                    if committed.contains(&name) && self.committed_elsewhere(job, &name, draft) {
                        continue;
                    }
                    push(Node::DraftDir { draft, path: String::new() }, FileType::Directory, name);
                }
                let writing: HashSet<&String> = singles.iter().map(|(name, _)| name).collect();
                for name in job_files.into_keys().filter(|name| !writing.contains(name)) {
                    push(Node::JobFile { job: job.clone(), name: name.clone() }, FileType::RegularFile, name);
                }
                for (name, file) in singles {
                    push(Node::DraftFile { file }, FileType::RegularFile, name);
                }
            }
            Node::Meta(job) => {
                let steps = self.steps(job)?;
                if !steps.is_empty() {
                    push(Node::Pointer { job: job.clone(), step: None }, FileType::Symlink, "latest".into());
                }
                for info in steps {
                    let node = Node::Pointer { job: job.clone(), step: Some(info.step) };
                    push(node, FileType::Symlink, step_name(info.step));
                }
            }
            Node::StepDir { job, step, checkpoint, dir } => {
                let tree = self.tree_at(job, *step, *checkpoint)?;
                let (step, checkpoint) = (*step, *checkpoint);
                for (name, child) in tree.dirs.get(dir).ok_or(Errno::ENOENT)? {
                    if self.removed(checkpoint, &join(dir, name)) {
                        continue;
                    }
                    match child {
                        Child::Dir => {
                            let node = Node::StepDir { job: job.clone(), step, checkpoint, dir: join(dir, name) };
                            push(node, FileType::Directory, name.clone());
                        }
                        Child::File(index) => {
                            let node = Node::StepFile { job: job.clone(), step, checkpoint, index: *index };
                            push(node, FileType::RegularFile, name.clone());
                        }
                    }
                }
            }
            Node::DraftDir { draft, path } => {
                let children: Vec<(Node, FileType, String)> = {
                    let state = self.state();
                    let d = state.drafts.get(draft).ok_or(Errno::ENOENT)?;
                    let dirs = d.dirs.iter().filter(|p| !p.is_empty() && split(p).0 == path).map(|p| {
                        (Node::DraftDir { draft: *draft, path: p.clone() }, FileType::Directory, split(p).1.to_owned())
                    });
                    let files =
                        d.files.iter().filter(|(p, _)| split(p).0 == path).map(|(p, id)| {
                            (Node::DraftFile { file: *id }, FileType::RegularFile, split(p).1.to_owned())
                        });
                    dirs.chain(files).collect()
                };
                for (node, kind, name) in children {
                    push(node, kind, name);
                }
            }
            _ => return Err(Errno::ENOTDIR),
        }
        Ok(entries)
    }

    /// Where `<job>/.starckpt/latest` (`step` None) or `<job>/.starckpt/<step>` points.
    pub(super) fn pointer(&self, job: &str, step: Option<u64>) -> Result<String, Errno> {
        let step = match step {
            Some(step) => step,
            None => self.steps(job)?.iter().map(|c| c.step).max().ok_or(Errno::ENOENT)?,
        };
        let name = self.name_of_step(job, step)?.ok_or(Errno::ENOENT)?;
        Ok(format!("../{name}"))
    }

    pub(super) fn open_reader(
        &self,
        job: &str,
        step: u64,
        checkpoint: u64,
        index: usize,
    ) -> Result<Arc<Reader>, Errno> {
        let tree = self.tree_at(job, step, checkpoint)?;
        self.reads.open(Arc::clone(&tree.manifest), index).ok_or(Errno::ENOENT)
    }
}
