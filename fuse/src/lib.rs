//! `starckpt mount MOUNTPOINT`: starckpt as a filesystem, for tools that only know files
//! (`torch.save`, `cp`, `tar`, `rsync`, a shell). It runs over the SDK: reads fetch verified chunks
//! from the targets, writes stream chunks to them; nothing is staged on local disk.
//!
//! ## Layout
//!
//! ```text
//! /ckpt/<job>/                   a job with committed checkpoints (or one `mkdir`ed here)
//! /ckpt/<job>/<step>/<files…>    a committed checkpoint, read-only (<step> in decimal)
//! /ckpt/<job>/latest             symlink to the latest committed <step>
//! /ckpt/<job>/<anything>/        a checkpoint being written by this mount (a draft)
//! ```
//!
//! Pending and aborted checkpoints are never listed as steps.
//!
//! ## Writing a checkpoint
//!
//! - **A directory, committed by rename.** `mkdir /ckpt/job/step_100.tmp`, write files (and
//!   subdirectories) into it, close them, then `mv /ckpt/job/step_100.tmp /ckpt/job/step_100`: the
//!   rename commits the whole tree atomically as one checkpoint. The step is the **last number in
//!   the new name** (`step_100` → 100; a name without digits is `EINVAL`). Afterwards the tree is
//!   `/ckpt/job/100/`; this mount also keeps resolving the name it was committed under.
//!   Renaming while a file in it is still open for writing is `EBUSY`; a step that already has a
//!   committed checkpoint is `EEXIST`. This is the write-to-temp-then-rename convention of
//!   Orbax and 3FS.
//! - **A single file.** A file created directly in `/ckpt/<job>/` (`torch.save(sd,
//!   "/ckpt/job/step_100.pt")`) becomes a one-file checkpoint, step = the last number in its name,
//!   when it is closed (committed in `flush`, so `close()` reports a failure). It then also appears
//!   as `/ckpt/job/100/step_100.pt`.
//!
//! A file ends at a close by the process that opened it (or that process's clean exit with it
//! still open: `prog > /ckpt/job/step_5.out`; exit status 0 is taken at its word, even from a
//! program whose exit cut short a thread still writing), else once its last descriptor is
//! closed. It is
//! given up instead when a process that wrote to it (its opener, or a child writing through an
//! inherited descriptor: `{ prog; } > f`) is killed or exits with a failure status while holding
//! it, when the mount cannot read how such a process stands, and when it is written to after it
//! ended (through a descriptor still open elsewhere: a child still writing, or a shell's
//! `cmd >&2`, which closes one copy of its stdout and writes on through another). Given up, a
//! file in a draft fails the draft's rename (`EIO`); a one-file checkpoint is not committed, or,
//! when its close committed it already, is deleted again and the late write fails with `EIO`;
//! its name is free again either way. A draft the user renamed stays committed: a late write to
//! one of its files fails with `ENOTSUP`.
//!
//! Files are written sequentially: bytes go to a staging buffer and each full chunk is uploaded at
//! once (memory per open file: one chunk plus the uploads in flight, all from the SDK's bounded
//! staging pool). `fsync` returns once every byte written so far is durable on the targets. A
//! checkpoint must be committed within the control plane's GC grace period (1 h by default) of its
//! first bytes; past that, unreferenced chunks may have been collected and the commit fails with
//! `EIO` rather than commit a hole.
//!
//! ## What is refused, at once
//!
//! | operation                                        | errno     |
//! |--------------------------------------------------|-----------|
//! | write, truncate, chmod, create in a committed checkpoint | `EROFS` |
//! | a write not at the end of the file (random or sparse writes), truncating a file being written | `ENOTSUP` |
//! | reading a file of a draft before it is committed | `ENOTSUP` |
//! | hard links, symlinks                             | `EPERM`   |
//! | a file directly in `/ckpt/` (outside a job)      | `EPERM`   |
//! | a name without a step number where one is needed | `EINVAL`  |
//! | opening for writing from a process this mount's `/proc` does not show (another pid namespace, `hidepid`): whether it finished its file could not be told | `EACCES` |
//!
//! `rmdir /ckpt/job/<step>` (or unlinking a one-file checkpoint by its name) deletes that
//! checkpoint (its chunks are freed by GC). Killing the mount in the middle of a write commits
//! nothing: drafts live only in the mount process.
//!
//! ## Caching
//!
//! Job and checkpoint listings, and `latest`, are cached for 1 s (here and in the kernel), so a
//! checkpoint committed elsewhere appears within a second. A committed checkpoint's files never
//! change: their attributes are cached for 60 s and their pages kept across opens. Its inodes are
//! its own (they name the checkpoint's id): a step deleted and saved again (a rollback) is a new
//! checkpoint with new inodes, so no cached page of the old one is served for it; a path the
//! kernel still resolves to the old one's inode gets ESTALE, on which it looks the name up again.
//! A chunk read that failed is not kept: the next read of it on the same open file tries again.
//!
//! ## Performance
//!
//! Requests are served by several threads. Reads of committed files fetch whole chunks, verified,
//! and keep `read_ahead_chunks` (8) chunks in flight ahead of a sequential reader (one that reads
//! on from where its previous read ended); a random read (a loader reading tensors by offset)
//! fetches only the chunks it covers. The windows of all open files share one budget,
//! `read_ahead_budget` (256 MiB); a file not read for 2 s gives its window's share to one being
//! read. Past the budget a read fetches the chunks it covers, keeps the one it ended in (one per
//! open file) and reads nothing ahead, so the mount's memory stays bounded however many files are
//! open (`read.rs`). The mount asks
//! for 16 MiB requests; the kernel grants at most `/proc/sys/fs/fuse/max_pages_limit` pages (256 =
//! 1 MiB by default): `echo 4096 > /proc/sys/fs/fuse/max_pages_limit` before mounting allows 16 MiB.

pub mod fs;
mod read;
pub mod tree;

use std::io;
use std::path::{Path, PathBuf};

pub use fs::{CkptFs, MountConfig};
use starckpt_client::Client;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum MountError {
    #[error(
        "/dev/fuse is missing: load the fuse kernel module (modprobe fuse), or run the container with --device /dev/fuse --cap-add SYS_ADMIN"
    )]
    NoFuseDevice,
    #[error("mount point {0} does not exist or is not a directory")]
    NotADirectory(PathBuf),
    #[error("mount point {0} is already a mount point (busy); unmount it first with fusermount3 -u")]
    Busy(PathBuf),
    #[error("mounting on {path} needs root or the fusermount3 helper (install the fuse3 package): {source}")]
    Permission { path: PathBuf, source: io::Error },
    #[error("mount {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "/proc is not this process's pid namespace's (/proc/self is not pid {0}): the mount could not tell \
         which process closes a file; mount a matching /proc (a container with its own pid namespace needs its own /proc)"
    )]
    ForeignProc(u32),
}

/// A mounted filesystem; unmounts when dropped.
pub struct Mount {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
}

/// Whether `path` is a mount point of this mount namespace right now.
pub fn is_mount_point(path: &Path) -> bool {
    let Ok(canonical) = path.canonicalize() else { return false };
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    table.lines().any(|line| {
        // Field 5 is the mount point, with spaces and the like octal-escaped.
        line.split(' ').nth(4).is_some_and(|point| unescape(point) == canonical.as_os_str().to_string_lossy())
    })
}

fn unescape(field: &str) -> String {
    field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

/// Mounts starckpt at `mountpoint`, served by `threads` threads. `runtime` runs the SDK's I/O.
pub fn mount(
    client: Client,
    runtime: tokio::runtime::Handle,
    mountpoint: &Path,
    config: MountConfig,
    threads: usize,
) -> Result<Mount, MountError> {
    if !Path::new("/dev/fuse").exists() {
        return Err(MountError::NoFuseDevice);
    }
    if !mountpoint.is_dir() {
        return Err(MountError::NotADirectory(mountpoint.to_path_buf()));
    }
    if is_mount_point(mountpoint) {
        return Err(MountError::Busy(mountpoint.to_path_buf()));
    }
    // FUSE names requesters by pid in this process's pid namespace; judging a close reads them
    // in /proc (`fs/judge.rs`), which must then be that namespace's.
    if !proc_is_ours(Path::new("/proc")) {
        return Err(MountError::ForeignProc(std::process::id()));
    }
    let mut options = fuser::Config::default();
    options.mount_options = vec![
        fuser::MountOption::FSName("starckpt".into()),
        fuser::MountOption::Subtype("starckpt".into()),
        fuser::MountOption::NoAtime,
    ];
    options.n_threads = Some(threads.max(1));
    options.clone_fd = true;
    let read_ahead_kb = config.max_write / 1024;
    let fs = CkptFs::new(client, runtime, config);
    let session = fuser::spawn_mount(fs, mountpoint, &options).map_err(|source| {
        let path = mountpoint.to_path_buf();
        match source.kind() {
            io::ErrorKind::PermissionDenied | io::ErrorKind::NotFound => MountError::Permission { path, source },
            _ => MountError::Io { path, source },
        }
    })?;
    raise_read_ahead(mountpoint, read_ahead_kb);
    Ok(Mount { session: Some(session), mountpoint: mountpoint.to_path_buf() })
}

/// Whether the proc filesystem at `proc` shows this process's pid namespace.
fn proc_is_ours(proc: &Path) -> bool {
    std::fs::read_link(proc.join("self")).is_ok_and(|me| me.as_os_str() == std::process::id().to_string().as_str())
}

/// The kernel starts a FUSE mount's read-ahead at 128 KiB, so a sequential reader's requests are
/// 128 KiB each; raising the mount's backing-device read-ahead lets them grow to the negotiated
/// request size (2x the throughput, ../shared/MACHINE.md). Best effort: needs root.
fn raise_read_ahead(mountpoint: &Path, kb: u32) {
    let Some(device) = mount_device(mountpoint) else { return };
    let knob = PathBuf::from(format!("/sys/class/bdi/{device}/read_ahead_kb"));
    match std::fs::write(&knob, kb.to_string()) {
        Ok(()) => tracing::info!(read_ahead_kb = kb, "raised the mount's read-ahead"),
        Err(error) => tracing::info!(%error, knob = %knob.display(), "could not raise the mount's read-ahead"),
    }
}

/// The `major:minor` of the filesystem mounted at `path`.
fn mount_device(path: &Path) -> Option<String> {
    let canonical = path.canonicalize().ok()?;
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    table.lines().rev().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        (fields.get(4).map(|p| unescape(p)) == Some(canonical.to_string_lossy().into_owned()))
            .then(|| fields.get(2).map(|d| d.to_string()))
            .flatten()
    })
}

impl Mount {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// False once someone else unmounted it (`fusermount3 -u`, `umount`).
    pub fn is_mounted(&self) -> bool {
        is_mount_point(&self.mountpoint)
    }

    /// Unmounts (if still mounted) and waits for the request threads to finish.
    pub fn unmount(mut self) -> io::Result<()> {
        match self.session.take() {
            Some(session) if self.is_mounted() => session.umount_and_join(),
            Some(session) => session.join(),
            None => Ok(()),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            let _ = session.umount_and_join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_proc_of_this_pid_namespace_is_ours() {
        assert!(proc_is_ours(Path::new("/proc")));
        let foreign = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("1", foreign.path().join("self")).unwrap();
        assert!(!proc_is_ours(foreign.path()), "another namespace's /proc/self");
        assert!(!proc_is_ours(&foreign.path().join("none")), "no /proc");
    }
}
