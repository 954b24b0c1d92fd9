//! Drafts kept across restarts of the mount, at the control plane: each draft's directories and
//! the chunk lists of its closed files are recorded there (`PutDraft`, `proto/src/draft.rs`)
//! under this mount's writer name (`--draft-writer`, default `<host>:<mount point>`) before the
//! close that changed them returns, so that a mount killed, upgraded or moved in the middle of a
//! save comes back (started again with the same writer name, on any host) with every file that
//! was closed in it, and the framework's next step (its `.metadata`, its tracker file, the
//! rename) commits them. The control plane keeps the record's chunks from GC while it lives, and
//! forgets a record not put again within its draft TTL (7 days by default).
//!
//! The record is a part's manifest, validated the same way when read back. Records of one mount
//! are put one at a time, each the whole draft as it is, so the last one the control plane has
//! is the newest. A close whose record cannot be put (the control plane unreachable past the
//! client's failover timeout) fails with `EIO`: the file would not survive a restart, and a
//! framework told its save failed does not rely on it.
//!
//! A file still open when the mount died is not in the record: its bytes up to then are on the
//! targets but it never ended, so it is lost, as it would be on a local disk without a close.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use starckpt_client::StreamedFile;
use starckpt_proto::model::{FileEntry, Manifest};
use starckpt_proto::{Addressing, RelPath};

use super::write::{Draft, DraftFile};
use super::{CkptFs, errno};
use fuser::Errno;

/// A draft's record: its closed files and its directories.
fn manifest_of(dirs: &BTreeSet<String>, files: &BTreeMap<String, StreamedFile>) -> Manifest {
    Manifest {
        files: files
            .iter()
            .filter_map(|(path, file)| {
                Some(FileEntry {
                    path: RelPath::try_from(path.as_str()).ok()?,
                    size_bytes: file.size,
                    mode: file.mode,
                    chunks: file.chunks.clone(),
                })
            })
            .collect(),
        directories: dirs.iter().filter(|d| !d.is_empty()).filter_map(|d| RelPath::try_from(d.as_str()).ok()).collect(),
        metadata: Default::default(),
        addressing: files.values().next().map(|f| f.addressing).unwrap_or_else(Addressing::plain),
    }
}

/// The files a record lists, as closed files of a draft.
fn files_of(manifest: Manifest) -> Vec<StreamedFile> {
    let addressing = manifest.addressing;
    manifest
        .files
        .into_iter()
        .map(|f| StreamedFile {
            path: f.path,
            size: f.size_bytes,
            mode: f.mode,
            chunks: f.chunks,
            written_bytes: 0,
            addressing,
        })
        .collect()
}

impl CkptFs {
    /// Records draft `draft` at the control plane as it is now, if this mount has a writer name.
    pub(super) async fn record_draft(&self, draft: u64) -> Result<(), Errno> {
        let Some(writer) = &self.config.draft_writer else { return Ok(()) };
        // One record at a time, snapshot taken under the turn: the last put is the newest state.
        let _turn = self.recording.lock().await;
        let Some((job, name, manifest)) = self
            .state()
            .drafts
            .get(&draft)
            .map(|d| (d.job.clone(), d.name.clone(), manifest_of(&d.dirs, &d.journaled)))
        else {
            return Ok(());
        };
        self.client.put_draft(&job, &name, writer, &manifest).await.map_err(|e| {
            tracing::error!(
                %job, draft = %name, %writer,
                "the draft could not be recorded at the control plane: it would not survive a restart of the mount: {e}"
            );
            errno("record draft", &format!("{job}/{name}"), &e)
        })
    }

    /// [`Self::record_draft`] from a request handler (outside the runtime).
    pub(super) fn journal_draft(&self, draft: u64) -> Result<(), Errno> {
        self.block_on(self.record_draft(draft))
    }

    /// Notes that `path` of draft `draft` was closed as `done`, and records the draft.
    pub(super) async fn journal_closed(&self, draft: u64, path: &str, done: &StreamedFile) -> Result<(), Errno> {
        if let Some(d) = self.state().drafts.get_mut(&draft) {
            d.journaled.insert(path.to_owned(), done.clone());
        }
        self.record_draft(draft).await
    }

    /// Forgets this mount's record of draft `name` of `job` (committed, dropped or removed). A
    /// failure is logged: the record then lives until the control plane's draft TTL.
    pub(super) async fn forget_draft_async(&self, job: &str, name: &str) {
        let Some(writer) = &self.config.draft_writer else { return };
        let _turn = self.recording.lock().await;
        if let Err(e) = self.client.drop_draft(job, name, writer).await {
            tracing::error!(%job, draft = %name, %writer, "the draft's record could not be dropped at the control plane (it expires with the draft TTL): {e}");
        }
    }

    /// [`Self::forget_draft_async`] from a request handler (outside the runtime).
    pub(super) fn forget_draft(&self, job: &str, name: &str) {
        self.block_on(self.forget_draft_async(job, name))
    }

    /// Merges into a draft about to commit (`files`, `dirs`) what other writers recorded of
    /// draft `name` of `job`: the mounts of other hosts whose ranks wrote into the same directory
    /// in place (DCP: every rank writes its files, then the coordinator writes `.metadata`).
    /// Two writers' different files at one path are refused (`EIO`), never one picked. The
    /// writers merged, whose records go once the commit is done.
    pub(super) fn other_writers(
        &self,
        job: &str,
        name: &str,
        files: &mut Vec<StreamedFile>,
        dirs: &mut BTreeSet<String>,
    ) -> Result<Vec<String>, Errno> {
        let Some(writer) = &self.config.draft_writer else { return Ok(Vec::new()) };
        let what = format!("{job}/{name}");
        let listed = self.block_on(self.client.draft_writers(job, name)).map_err(|e| errno("commit", &what, &e))?;
        let mut merged = Vec::new();
        for other in listed.into_iter().filter(|d| &d.writer != writer) {
            let Some(manifest) =
                self.block_on(self.client.draft(job, name, &other.writer)).map_err(|e| errno("commit", &what, &e))?
            else {
                continue;
            };
            dirs.extend(manifest.directories.iter().map(|d| d.to_string()));
            for file in files_of(manifest) {
                match files.iter().find(|f| f.path == file.path) {
                    Some(mine) if mine.chunks == file.chunks && mine.size == file.size => {}
                    Some(_) => {
                        tracing::error!(
                            %job, draft = %name, path = %file.path, other = %other.writer,
                            "two writers wrote different files at one path of this checkpoint: it is not committed"
                        );
                        return Err(Errno::EIO);
                    }
                    None => files.push(file),
                }
            }
            tracing::info!(%job, draft = %name, other = %other.writer, files = other.file_count, "committing with the files another writer recorded");
            merged.push(other.writer);
        }
        Ok(merged)
    }

    /// Drops the records of draft `name` of `job` that `writers` made (merged into its commit).
    pub(super) fn drop_other_writers(&self, job: &str, name: &str, writers: &[String]) {
        for writer in writers {
            if let Err(e) = self.block_on(self.client.drop_draft(job, name, writer)) {
                tracing::error!(%job, draft = %name, %writer, "a committed draft's record could not be dropped (it expires with the draft TTL): {e}");
            }
        }
    }

    /// A draft of this mount that another writer's mount committed (`job`'s checkpoint named
    /// `name`, merging this mount's record): once none of its files is open here, it is the
    /// committed checkpoint here too. True if it was.
    pub(super) fn committed_elsewhere(&self, job: &str, name: &str, draft: u64) -> bool {
        let begun_ms = {
            let state = self.state();
            let Some(d) = state.drafts.get(&draft) else { return false };
            let busy = d.committing
                || d.files.values().any(|f| {
                    state.files.get(f).is_some_and(|f| f.open_handles.load(std::sync::atomic::Ordering::Relaxed) > 0)
                });
            if busy {
                return false;
            }
            d.begun_ms
        };
        // Judged by the cached listing; a job that cannot be listed now leaves the draft as it is.
        let Ok(Some(named)) = self.named_as(job, name) else { return false };
        if named.label.file || named.info.committed_at_ms < begun_ms {
            return false;
        }
        tracing::info!(%job, draft = %name, step = named.info.step, "this draft was committed by another writer's mount");
        self.became_committed(draft, job, named.info.step, named.info.checkpoint_id);
        self.forget_draft(job, name);
        true
    }

    /// The drafts this writer recorded in an earlier run, back with their closed files. Called
    /// before the mount serves requests; a record that cannot be read is left at the control
    /// plane and said so.
    pub(super) async fn restore_drafts(&self) {
        let Some(writer) = &self.config.draft_writer else { return };
        let listed = match self.client.drafts(writer).await {
            Ok(listed) => listed,
            Err(e) => {
                tracing::error!(%writer, "the drafts of an earlier run of this mount could not be listed: they are not shown: {e}");
                return;
            }
        };
        for info in listed {
            let manifest = match self.client.draft(&info.job, &info.name, writer).await {
                Ok(Some(manifest)) => manifest,
                Ok(None) => continue,
                Err(e) => {
                    tracing::error!(job = %info.job, draft = %info.name, "a recorded draft cannot be read, and is left out: {e}");
                    continue;
                }
            };
            let mut dirs: BTreeSet<String> = manifest.directories.iter().map(|d| d.to_string()).collect();
            dirs.insert(String::new());
            let mut state = self.state();
            if state.draft_names.contains_key(&(info.job.clone(), info.name.clone())) {
                continue;
            }
            let id = state.next_draft;
            state.next_draft += 1;
            let mut files = BTreeMap::new();
            let mut journaled = BTreeMap::new();
            for done in files_of(manifest) {
                let file_id = state.next_draft;
                state.next_draft += 1;
                let path = done.path.to_string();
                state.files.insert(file_id, Arc::new(DraftFile::closed(&info.job, id, done.clone())));
                files.insert(path.clone(), file_id);
                journaled.insert(path, done);
            }
            tracing::info!(job = %info.job, draft = %info.name, files = files.len(), "a draft recorded by an earlier run of this mount is back");
            state.local_jobs.insert(info.job.clone());
            state.draft_names.insert((info.job.clone(), info.name.clone()), id);
            state.drafts.insert(
                id,
                Draft {
                    job: info.job,
                    name: info.name,
                    dirs,
                    files,
                    committing: false,
                    writers: Vec::new(),
                    journaled,
                    begun_ms: info.updated_at_ms,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starckpt_proto::ChunkHash;
    use starckpt_proto::model::{ChunkRef, Codec};

    fn streamed(path: &str, len: u64) -> StreamedFile {
        let chunk = ChunkRef {
            hash: ChunkHash::of(path.as_bytes()),
            length_bytes: len,
            stored_length_bytes: len,
            codec: Codec::None,
            replicas: vec!["t1".into()],
        };
        StreamedFile {
            path: RelPath::try_from(path).unwrap(),
            size: len,
            mode: 0o640,
            chunks: vec![chunk],
            written_bytes: len,
            addressing: Addressing::plain(),
        }
    }

    #[test]
    fn a_record_gives_back_the_files_and_directories_it_was_made_of() {
        let dirs: BTreeSet<String> = ["".into(), "sub".into(), "sub/empty".into()].into_iter().collect();
        let files: BTreeMap<String, StreamedFile> =
            [("sub/a".to_owned(), streamed("sub/a", 10)), ("b".to_owned(), streamed("b", 3))].into_iter().collect();
        let manifest = manifest_of(&dirs, &files);
        let wire = starckpt_proto::control::Manifest::from(&manifest);
        let back = Manifest::try_from(wire).unwrap();
        let dirs_back: Vec<String> = back.directories.iter().map(|d| d.to_string()).collect();
        assert_eq!(dirs_back, ["sub", "sub/empty"]);
        let files_back = files_of(back);
        let paths: Vec<&str> = files_back.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["b", "sub/a"]);
        assert_eq!((files_back[1].size, files_back[1].mode), (10, 0o640));
        assert_eq!(files_back[1].chunks, files["sub/a"].chunks);
    }
}
