//! What a save takes: the items of one rank's part ([`SaveItem`], [`SavePart`]), and the files
//! under the paths given (`items_from_paths`).

use super::*;

/// One entry of a checkpoint part.
#[derive(Clone, Debug)]
pub enum SaveItem {
    /// A file on local disk, read at staging time.
    File { path: RelPath, source: PathBuf, mode: u32 },
    /// Bytes in memory, copied into staging buffers (the caller may reuse its memory once `save`
    /// returns).
    Buffer { path: RelPath, data: Bytes },
    /// Immutable bytes uploaded straight from the caller's memory: no staging copy at all. The
    /// save holds references to `data` until it is uploaded.
    Shared { path: RelPath, data: Bytes },
    /// A directory to recreate on restore even if empty.
    Directory { path: RelPath },
}

impl SaveItem {
    pub(super) fn path(&self) -> &RelPath {
        match self {
            SaveItem::File { path, .. }
            | SaveItem::Buffer { path, .. }
            | SaveItem::Shared { path, .. }
            | SaveItem::Directory { path } => path,
        }
    }
}

/// One rank's part of checkpoint (job, step).
#[derive(Clone, Debug)]
pub struct SavePart {
    pub job: String,
    pub step: u64,
    pub rank: u32,
    /// Ranks in this checkpoint; with more than one, every rank's client must have the same run
    /// id ([`crate::ClientConfig::run_id`]).
    pub world_size: u32,
    pub items: Vec<SaveItem>,
    pub metadata: BTreeMap<String, String>,
}

impl SavePart {
    pub fn new(job: impl Into<String>, step: u64) -> SavePart {
        SavePart { job: job.into(), step, rank: 0, world_size: 1, items: Vec::new(), metadata: BTreeMap::new() }
    }

    pub fn rank(mut self, rank: u32, world_size: u32) -> SavePart {
        self.rank = rank;
        self.world_size = world_size;
        self
    }

    pub fn buffer(mut self, path: &str, data: Bytes) -> Result<SavePart> {
        self.items.push(SaveItem::Buffer { path: RelPath::try_from(path)?, data });
        Ok(self)
    }

    /// Zero-copy: uploads `data` from the caller's memory without staging it.
    pub fn shared(mut self, path: &str, data: Bytes) -> Result<SavePart> {
        self.items.push(SaveItem::Shared { path: RelPath::try_from(path)?, data });
        Ok(self)
    }

    pub fn file(mut self, path: &str, source: impl Into<PathBuf>) -> Result<SavePart> {
        self.items.push(SaveItem::File { path: RelPath::try_from(path)?, source: source.into(), mode: 0 });
        Ok(self)
    }

    pub fn directory(mut self, path: &str) -> Result<SavePart> {
        self.items.push(SaveItem::Directory { path: RelPath::try_from(path)? });
        Ok(self)
    }

    pub fn items(mut self, items: Vec<SaveItem>) -> SavePart {
        self.items.extend(items);
        self
    }
}

/// Items for local paths: a file becomes one item named by its file name; a directory contributes
/// its whole tree with paths relative to it (empty directories included). Symlinks and special
/// files are refused rather than silently skipped. Names must be unique across `paths`.
pub fn items_from_paths(paths: &[PathBuf]) -> Result<Vec<SaveItem>> {
    use std::os::unix::fs::PermissionsExt;
    let mut items = Vec::new();
    for root in paths {
        let meta = std::fs::symlink_metadata(root).map_err(Error::io("stat", root))?;
        if meta.is_file() {
            let name = root
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| Error::InvalidInput(format!("{} has no UTF-8 file name", root.display())))?;
            items.push(SaveItem::File {
                path: RelPath::try_from(name)?,
                source: root.clone(),
                mode: meta.permissions().mode() & 0o7777,
            });
        } else if meta.is_dir() {
            walk(root, root, &mut items)?;
        } else {
            return Err(Error::InvalidInput(format!("{} is not a regular file or directory", root.display())));
        }
    }
    let mut seen = std::collections::HashSet::new();
    for item in &items {
        if !seen.insert(item.path().clone()) {
            return Err(Error::InvalidInput(format!("two inputs would both be saved as {}", item.path())));
        }
    }
    Ok(items)
}

pub(super) fn walk(root: &Path, dir: &Path, items: &mut Vec<SaveItem>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(Error::io("list", dir))?
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(Error::io("list", dir))?;
    entries.sort_by_key(|e| e.file_name());
    if entries.is_empty() && dir != root {
        items.push(SaveItem::Directory { path: relative(root, dir)? });
    }
    for entry in entries {
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path).map_err(Error::io("stat", &path))?;
        if meta.is_dir() {
            walk(root, &path, items)?;
        } else if meta.is_file() {
            items.push(SaveItem::File {
                path: relative(root, &path)?,
                source: path,
                mode: meta.permissions().mode() & 0o7777,
            });
        } else {
            return Err(Error::InvalidInput(format!(
                "{} is a symlink or special file; only regular files and directories can be saved",
                path.display()
            )));
        }
    }
    Ok(())
}

pub(super) fn relative(root: &Path, path: &Path) -> Result<RelPath> {
    let rel =
        path.strip_prefix(root).map_err(|_| Error::InvalidInput(format!("{} escapes its root", path.display())))?;
    let text = rel.to_str().ok_or_else(|| Error::InvalidInput(format!("{} is not UTF-8", path.display())))?;
    Ok(RelPath::try_from(text)?)
}
