//! Restoring into a directory: built in a hidden sibling, renamed into place when complete,
//! under a lock on the destination.

use super::*;

impl Client {
    /// Restores every file and directory of the checkpoint under `to`, which must not exist or be
    /// empty (unless `options.force`). Chunks are fetched in parallel and verified before they
    /// are written; the tree appears at `to` only once complete ([`restore_from`]).
    pub async fn restore(
        &self,
        manifest: &CheckpointManifest,
        to: &Path,
        options: RestoreOptions,
    ) -> Result<RestoreOutcome> {
        self.restore_with_progress(manifest, to, options, Arc::new(RestoreProgress::default())).await
    }

    pub async fn restore_with_progress(
        &self,
        manifest: &CheckpointManifest,
        to: &Path,
        options: RestoreOptions,
        progress: Arc<RestoreProgress>,
    ) -> Result<RestoreOutcome> {
        restore_from(self, manifest, to, options, &progress, self.inner.config.restore_concurrency).await
    }
}

#[derive(Clone, Debug, Default)]
pub struct RestoreOptions {
    /// Replace a non-empty destination directory.
    pub force: bool,
}

#[derive(Debug, Default)]
pub struct RestoreProgress {
    pub verified_bytes: AtomicU64,
}

#[derive(Clone, Debug)]
pub struct RestoreOutcome {
    pub files: usize,
    pub bytes: u64,
}

/// Removes a directory tree when dropped.
pub(super) struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The name prefix of a restore's unfinished tree beside destination `name`.
pub(super) fn partial_prefix(name: &str) -> String {
    format!(".{name}.starckpt-partial-")
}

/// The name prefix of the tree a `--force` restore moved aside (file systems without the atomic
/// exchange). Never removed by a later restore: one that failed to move it back says it is kept
/// there.
pub(super) fn replaced_prefix(name: &str) -> String {
    format!(".{name}.starckpt-replaced-")
}

/// A restore's unfinished tree, beside its destination: removed when dropped unless it was
/// placed, then the destination's lock is let go. Held by the restore and by the blocking task
/// making the tree, so both go when the last of them does: removed while that task still ran,
/// the tree would be made again by it, and let go of, the destination would be open to another
/// restore while this one's task still wrote beside it.
pub(super) struct Unfinished {
    pub(super) tree: PathBuf,
    pub(super) placed: AtomicBool,
    pub(super) _lock: DestinationLock,
}

impl Unfinished {
    /// Whether the restore that made it has been dropped (only the task making the tree holds
    /// it now).
    pub(super) fn abandoned(self: &Arc<Self>) -> bool {
        Arc::strong_count(self) == 1
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.placed.load(Ordering::Relaxed) {
            let _ = std::fs::remove_dir_all(&self.tree);
        }
    }
}

/// Held while a restore into one destination runs: an exclusive lock on a file beside it
/// (`.NAME.starckpt-restore.lock`, removed when the restore ends). Taking it removes unfinished
/// trees a restore into the same destination left when it was killed (SIGKILL, power loss),
/// which nothing else can be writing while the lock is held.
pub(super) struct DestinationLock {
    pub(super) path: PathBuf,
    pub(super) _file: std::fs::File,
}

impl DestinationLock {
    pub(super) fn take(parent: &Path, name: &str, to: &Path) -> Result<DestinationLock> {
        let path = parent.join(format!(".{name}.starckpt-restore.lock"));
        let mut tries = 0;
        let file = loop {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(Error::io("create", &path))?;
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(Error::InvalidInput(format!("another restore into {} is running", to.display())));
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(Error::io("lock", &path)(e)),
            }
            // A restore that ended unlinks its lock file before closing it: one that opened the
            // file before the unlink and locked it after the close holds a lock no later restore
            // sees. Only the file still at the path counts.
            if is_at(&file, &path) {
                break file;
            }
            tries += 1;
            if tries == 100 {
                return Err(Error::InvalidInput(format!(
                    "the lock file {} keeps being replaced: is another restore into {} starting and ending?",
                    path.display(),
                    to.display()
                )));
            }
        };
        let (partial, replaced) = (partial_prefix(name), replaced_prefix(name));
        for entry in std::fs::read_dir(parent).map_err(Error::io("list", parent))? {
            let entry = entry.map_err(Error::io("list", parent))?;
            let Some(file_name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            if file_name.starts_with(&partial) {
                tracing::info!(path = %entry.path().display(), "removing what an interrupted restore left");
                std::fs::remove_dir_all(entry.path()).map_err(Error::io("remove", &entry.path()))?;
            } else if file_name.starts_with(&replaced) {
                tracing::warn!(
                    path = %entry.path().display(),
                    "an earlier restore left the tree it replaced here; remove it once it is not needed"
                );
            }
        }
        Ok(DestinationLock { path, _file: file })
    }
}

impl Drop for DestinationLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a restore that opened it meanwhile fails to lock it (and
        // says another is running) rather than locking a file no one else will see.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Restores every file and directory of the checkpoint under `to` from `source`, `concurrency`
/// chunks at a time; see [`Client::restore`]. `to` must not exist or be empty unless
/// `options.force`; the tree is built beside it, made durable, and renamed (or swapped) into
/// place, so `to` never holds a partial restore.
pub async fn restore_from(
    source: &impl ChunkSource,
    manifest: &CheckpointManifest,
    to: &Path,
    options: RestoreOptions,
    progress: &RestoreProgress,
    concurrency: usize,
) -> Result<RestoreOutcome> {
    let to = &destination(to)?;
    let existing = match std::fs::read_dir(to) {
        Ok(mut entries) => Some(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io("list", to)(e)),
    };
    if existing == Some(true) && !options.force {
        return Err(Error::InvalidInput(format!(
            "{} is not empty; restore into an empty directory or pass --force to replace it",
            to.display()
        )));
    }
    let name = to
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::InvalidInput(format!("{} has no directory name", to.display())))?;
    let parent = match to.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(Error::io("create", &parent))?;
    let lock = DestinationLock::take(&parent, name, to)?;
    let staging = parent.join(format!("{}{}", partial_prefix(name), uuid::Uuid::new_v4().simple()));
    // Removed on every way out (errors, a dropped future) unless it became the destination.
    let unfinished = Arc::new(Unfinished { tree: staging.clone(), placed: AtomicBool::new(false), _lock: lock });
    crate::faults::point("client.restore.begin").map_err(Error::io("restore", to))?;
    restore_into(source, manifest, &unfinished, progress, concurrency).await?;
    if existing == Some(true) {
        // Swap atomically: `to` is always either the old tree or the complete new one. The old
        // tree ends up at the staging name, which is removed when `unfinished` goes.
        // The fault point plays a file system without the exchange.
        let unsupported = |_| std::io::Error::from_raw_os_error(libc::EINVAL);
        match crate::faults::point("client.restore.exchange").map_err(unsupported).and_then(|()| exchange(&staging, to))
        {
            Ok(()) => {}
            // A file system without the exchange (NFS, some FUSE ones): the old tree is moved
            // aside first, so `to` is briefly missing, but never partial.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) => {
                let aside = parent.join(format!("{}{}", replaced_prefix(name), uuid::Uuid::new_v4().simple()));
                std::fs::rename(to, &aside).map_err(Error::io("move aside", to))?;
                let old = RemoveOnDrop(aside.clone());
                let placed =
                    crate::faults::point("client.restore.into_place").and_then(|()| std::fs::rename(&staging, to));
                if let Err(e) = placed {
                    // A failed restore leaves the destination as it found it: the old tree goes
                    // back, or, if even that fails, stays where it is, and the error says where.
                    std::mem::forget(old);
                    let back =
                        crate::faults::point("client.restore.move_back").and_then(|()| std::fs::rename(&aside, to));
                    let e = match back {
                        Ok(()) => e,
                        Err(back) => std::io::Error::new(
                            e.kind(),
                            format!("{e}; the tree it held is kept at {} (moving it back: {back})", aside.display()),
                        ),
                    };
                    return Err(Error::io("rename into place", to)(e));
                }
            }
            Err(e) => return Err(Error::io("swap into place", to)(e)),
        }
    } else {
        // Missing or empty: a rename replaces an empty directory atomically.
        std::fs::rename(&staging, to).map_err(Error::io("rename into place", to))?;
        unfinished.placed.store(true, Ordering::Relaxed);
    }
    std::fs::File::open(&parent).and_then(|d| d.sync_all()).map_err(Error::io("fsync", &parent))?;
    Ok(RestoreOutcome { files: manifest.files.len(), bytes: manifest.total_bytes() })
}

/// The directory a restore puts its tree at: `to`, or where `to` leads if it is a symbolic
/// link (the link stays; the tree it points to is what is replaced). A destination a rename
/// cannot replace, a mount point, is refused here, before anything is fetched.
pub(super) fn destination(to: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let to = match std::fs::symlink_metadata(to) {
        Ok(meta) if meta.file_type().is_symlink() => std::fs::canonicalize(to).map_err(|e| {
            Error::InvalidInput(format!(
                "{} is a symbolic link that does not lead to a directory ({e}); create where it points, or \
                 restore elsewhere",
                to.display()
            ))
        })?,
        Ok(_) => to.to_path_buf(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(to.to_path_buf()),
        Err(e) => return Err(Error::io("stat", to)(e)),
    };
    let parent = match to.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let device = |path: &Path| std::fs::metadata(path).map(|m| m.dev()).map_err(Error::io("stat", path));
    if device(&to)? != device(parent)? {
        return Err(Error::InvalidInput(format!(
            "{} is a mount point: a restore builds its tree beside the destination and renames it into \
             place, which cannot replace a mount point; restore into a directory inside it (e.g. {})",
            to.display(),
            to.join("ckpt").display()
        )));
    }
    Ok(to)
}

pub(super) async fn restore_into(
    source: &impl ChunkSource,
    manifest: &CheckpointManifest,
    unfinished: &Arc<Unfinished>,
    progress: &RestoreProgress,
    concurrency: usize,
) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    // The tree is made off the runtime (a checkpoint may have a million files): a signal that
    // stops the restore is noticed meanwhile. The task holds the unfinished tree, so a restore
    // dropped meanwhile removes it only once the task has ended, which it does early then.
    let held = Arc::clone(unfinished);
    let root = unfinished.tree.as_path();
    let directories: Vec<PathBuf> = manifest.directories.iter().map(|dir| dir.under(root)).collect();
    let sized: Vec<(PathBuf, u64)> =
        manifest.files.iter().map(|file| (file.path.under(root), file.size_bytes)).collect();
    let (dirs, paths) = tokio::task::spawn_blocking(move || {
        let root = held.tree.as_path();
        let abandoned = || held.abandoned().then(|| Error::Cancelled("the restore was stopped".to_owned()));
        std::fs::create_dir(root).map_err(Error::io("create", root))?;
        crate::faults::point("client.restore.tree").map_err(Error::io("create", root))?;
        let mut dirs = std::collections::BTreeSet::from([root.to_path_buf()]);
        for path in directories {
            if let Some(stopped) = abandoned() {
                return Err(stopped);
            }
            std::fs::create_dir_all(&path).map_err(Error::io("create", &path))?;
            dirs.extend(path.ancestors().take_while(|p| p.starts_with(root)).map(Path::to_path_buf));
        }
        // Files are created up front and opened again per chunk write, so a checkpoint with
        // more files than the descriptor limit still restores.
        let mut paths = Vec::with_capacity(sized.len());
        for (path, size) in sized {
            if let Some(stopped) = abandoned() {
                return Err(stopped);
            }
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(Error::io("create", parent))?;
                dirs.extend(parent.ancestors().take_while(|p| p.starts_with(root)).map(Path::to_path_buf));
            }
            // Each path once (the manifest says so), into a fresh tree: a file found there
            // already is another path the file system takes for the same name (a
            // case-insensitive one: `A` and `a`), which would get both files' bytes; an error
            // instead.
            let handle = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(Error::io("create", &path))?;
            handle.set_len(size).map_err(Error::io("size", &path))?;
            paths.push(Arc::new(path));
        }
        Ok::<_, Error>((dirs, paths))
    })
    .await
    .map_err(|e| Error::Cancelled(e.to_string()))??;
    let work = manifest.files.iter().zip(&paths).flat_map(|(file, path)| {
        let mut offset = 0u64;
        file.chunks.iter().map(move |chunk| {
            let start = offset;
            offset += chunk.length_bytes;
            (chunk, start, Arc::clone(path))
        })
    });
    let mut writes = futures::stream::iter(work.map(|(chunk, start, path)| async move {
        let data = source.read_chunk(manifest, chunk).await?;
        let len = data.len() as u64;
        tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(path.as_ref())
                .map_err(Error::io("open", path.as_ref()))?;
            file.write_all_at(&data, start).map_err(Error::io("write", path.as_ref()))
        })
        .await
        .map_err(|e| Error::Cancelled(e.to_string()))??;
        progress.verified_bytes.fetch_add(len, Ordering::Relaxed);
        Ok::<(), Error>(())
    }))
    .buffer_unordered(concurrency.max(1));
    while let Some(result) = writes.next().await {
        result?;
    }
    drop(writes);
    // Durable before it is renamed into place: a crash must not leave a restore that looks
    // complete but has holes. Saved modes are applied last, through the descriptor that syncs
    // the file: a file saved read-only (or write-only) could not be opened again to write (or
    // to sync) its bytes once it has its mode, unless by root. Permission bits only: a manifest
    // does not make setuid, setgid or sticky files.
    let modes: Vec<u32> = manifest.files.iter().map(|file| file.mode & 0o777).collect();
    tokio::task::spawn_blocking(move || {
        for (path, mode) in paths.iter().map(|p| p.as_path()).zip(modes) {
            let file = std::fs::OpenOptions::new().write(true).open(path).map_err(Error::io("open", path))?;
            if mode != 0 {
                file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(Error::io("chmod", path))?;
            }
            file.sync_all().map_err(Error::io("fsync", path))?;
        }
        for path in &dirs {
            std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(Error::io("fsync", path))?;
        }
        Ok::<(), Error>(())
    })
    .await
    .map_err(|e| Error::Cancelled(e.to_string()))??;
    Ok(())
}
