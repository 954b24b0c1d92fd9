//! Drafts kept across restarts of the mount: each draft's directories and the chunk lists of its
//! closed files, written to a journal file on local disk whenever they change, so that a mount
//! killed (or upgraded) in the middle of a save comes back with every file that was closed in
//! it, and the framework's next step (its `.metadata`, its tracker file, the rename) commits them.
//!
//! One file per draft, named by the hash of its job and name, holding a prost-encoded
//! `starckpt.control.v1.Manifest` (the same message a rank commits, validated the same way when
//! read back): its files and directories, the job and draft name in its metadata, and the key
//! the chunks are addressed with. The key is a tenant's secret, so the directory is 0700 and the
//! files 0600. Each write is durable before the request that caused it is answered: a temporary
//! file, fsync, rename over the old one, fsync of the directory.
//!
//! A file still open when the mount died is not in the journal: its bytes up to then are on the
//! targets but it never ended, so it is lost, as it would be on a local disk without a close.
//! Chunks of a draft are kept by the targets only for the control plane's GC grace period (1 h by
//! default) from their upload; a draft committed later fails its commit (`EIO`) rather than
//! commit a hole.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use prost::Message;
use starckpt_client::StreamedFile;
use starckpt_proto::control as pb;
use starckpt_proto::model::{FileEntry, Manifest};
use starckpt_proto::{Addressing, RelPath};

const JOB_KEY: &str = "starckpt.fuse.draft.job";
const NAME_KEY: &str = "starckpt.fuse.draft.name";
/// Largest journal file read back (a draft of very many files).
const MAX_JOURNAL_BYTES: u64 = 256 << 20;

/// A draft as the journal keeps it.
#[derive(Debug)]
pub(super) struct Kept {
    pub(super) job: String,
    pub(super) name: String,
    pub(super) dirs: BTreeSet<String>,
    pub(super) files: Vec<StreamedFile>,
}

pub(super) struct Journal {
    dir: PathBuf,
    /// One writer at a time, so the last snapshot written is the newest.
    writing: std::sync::Mutex<()>,
}

impl Journal {
    pub(super) fn open(dir: &Path) -> io::Result<Journal> {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        Ok(Journal { dir: dir.to_path_buf(), writing: std::sync::Mutex::new(()) })
    }

    fn path(&self, job: &str, name: &str) -> PathBuf {
        // Names are any bytes a file name may hold: the journal's file is named by a hash.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&(job, name), &mut hasher);
        let hash = std::hash::Hasher::finish(&hasher);
        self.dir.join(format!("draft-{hash:016x}.pb"))
    }

    /// Records draft `name` of `job` as it is now: durable once this returns.
    pub(super) fn record(
        &self,
        job: &str,
        name: &str,
        dirs: &BTreeSet<String>,
        files: &BTreeMap<String, StreamedFile>,
    ) -> io::Result<()> {
        let addressing = files.values().next().map(|f| f.addressing).unwrap_or_else(Addressing::plain);
        let manifest = Manifest {
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
            directories: dirs
                .iter()
                .filter(|d| !d.is_empty())
                .filter_map(|d| RelPath::try_from(d.as_str()).ok())
                .collect(),
            metadata: [(JOB_KEY.to_owned(), job.to_owned()), (NAME_KEY.to_owned(), name.to_owned())]
                .into_iter()
                .collect(),
            addressing,
        };
        let bytes = pb::Manifest::from(&manifest).encode_to_vec();
        let _writing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        let path = self.path(job, name);
        let temporary = path.with_extension("tmp");
        let mut file =
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&temporary)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, &path)?;
        std::fs::File::open(&self.dir)?.sync_all()
    }

    /// Forgets draft `name` of `job` (committed, dropped or removed).
    pub(super) fn forget(&self, job: &str, name: &str) {
        let _writing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        match std::fs::remove_file(self.path(job, name)) {
            Ok(()) => {
                let _ = std::fs::File::open(&self.dir).and_then(|d| d.sync_all());
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::error!(job, draft = name, "forgetting a draft in the journal: {e}"),
        }
    }

    /// Every draft kept; a journal file that cannot be read is left where it is and said so.
    pub(super) fn load(&self) -> Vec<Kept> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        let mut kept = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "pb") {
                continue;
            }
            match read(&path) {
                Ok(draft) => kept.push(draft),
                Err(e) => {
                    tracing::error!(path = %path.display(), "a draft in the journal cannot be read, and is left out: {e}")
                }
            }
        }
        kept
    }
}

fn read(path: &Path) -> Result<Kept, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    if file.metadata().map_err(|e| e.to_string())?.len() > MAX_JOURNAL_BYTES {
        return Err(format!("larger than {MAX_JOURNAL_BYTES} bytes"));
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let message = pb::Manifest::decode(&bytes[..]).map_err(|e| e.to_string())?;
    let manifest = Manifest::try_from(message).map_err(|e| e.to_string())?;
    let job = manifest.metadata.get(JOB_KEY).cloned().ok_or("no job")?;
    let name = manifest.metadata.get(NAME_KEY).cloned().ok_or("no draft name")?;
    starckpt_proto::JobName::try_from(job.as_str()).map_err(|e| e.to_string())?;
    RelPath::try_from(name.as_str()).map_err(|e| e.to_string())?;
    let mut dirs: BTreeSet<String> = manifest.directories.iter().map(|d| d.to_string()).collect();
    dirs.insert(String::new());
    let files = manifest
        .files
        .into_iter()
        .map(|f| StreamedFile {
            path: f.path,
            size: f.size_bytes,
            mode: f.mode,
            chunks: f.chunks,
            written_bytes: 0,
            addressing: manifest.addressing,
        })
        .collect();
    Ok(Kept { job, name, dirs, files })
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
    fn drafts_come_back_as_recorded_and_go_when_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(&dir.path().join("j")).unwrap();
        let dirs: BTreeSet<String> = ["".into(), "sub".into(), "sub/empty".into()].into_iter().collect();
        let files: BTreeMap<String, StreamedFile> =
            [("sub/a".to_owned(), streamed("sub/a", 10)), ("b".to_owned(), streamed("b", 3))].into_iter().collect();
        journal.record("job", "step-5", &dirs, &files).unwrap();
        journal.record("job", "other-6", &BTreeSet::new(), &BTreeMap::new()).unwrap();
        let mut kept = journal.load();
        kept.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(kept.len(), 2);
        assert_eq!((kept[1].job.as_str(), kept[1].name.as_str()), ("job", "step-5"));
        assert_eq!(kept[1].dirs, dirs);
        let paths: Vec<&str> = kept[1].files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["b", "sub/a"]);
        assert_eq!((kept[1].files[1].size, kept[1].files[1].mode), (10, 0o640));
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join("j")), 0o700);
        assert_eq!(mode(&journal.path("job", "step-5")), 0o600);
        journal.forget("job", "step-5");
        assert_eq!(journal.load().len(), 1);
    }

    #[test]
    fn a_damaged_journal_file_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        std::fs::write(dir.path().join("draft-0.pb"), b"\xff\xff not a manifest").unwrap();
        // A manifest naming a path that escapes its directory.
        let bad = pb::Manifest {
            files: vec![pb::FileEntry { path: "../x".into(), ..Default::default() }],
            metadata: [(JOB_KEY.to_owned(), "j".to_owned()), (NAME_KEY.to_owned(), "n".to_owned())]
                .into_iter()
                .collect(),
            ..Default::default()
        };
        std::fs::write(dir.path().join("draft-1.pb"), bad.encode_to_vec()).unwrap();
        assert!(journal.load().is_empty());
    }
}
