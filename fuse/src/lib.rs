//! `starckpt mount MOUNTPOINT`: starckpt as a filesystem, for tools that only know files
//! (`torch.save`, `cp`, `tar`, `rsync`, a shell). It runs over the SDK: reads fetch verified chunks
//! from the targets, writes stream chunks to them; nothing is staged on local disk.
//!
//! ## Layout
//!
//! ```text
//! /ckpt/<job>/                       a job with committed checkpoints (or one `mkdir`ed here)
//! /ckpt/<job>/<name>/<files…>        a committed checkpoint, read-only, under the name it was
//!                                    written as (checkpoint-500, global_step500, iter_0000500,
//!                                    step-500); one saved with the SDK or CLI: its decimal step
//! /ckpt/<job>/<name>                 a committed one-file checkpoint (epoch=3-step=500.ckpt)
//! /ckpt/<job>/<file>                 a job file: a name with no step number (last.ckpt,
//!                                    model.safetensors, config.json, DeepSpeed's latest),
//!                                    kept at the control plane, read back as written
//! /ckpt/<job>/<anything>/            a checkpoint being written (a draft)
//! /ckpt/<job>/.starckpt/latest       the mount's own pointers, never listed (so `rm -r`, rsync and
//! /ckpt/<job>/.starckpt/<step>       framework listings never meet them): symlinks to ../<name>
//! ```
//!
//! A checkpoint's name is kept in its manifest's metadata (`starckpt.fuse.name`, and
//! `starckpt.fuse.kind`: file or dir), so every mount, and this one after a restart, lists it as
//! written. Its step is the **last number in its name** (`checkpoint-500` → 500). Pending and
//! aborted checkpoints are never listed. A draft is listed while a process that wrote into it is
//! running; one whose writers are all gone uncommitted (a trainer killed mid-save) is no longer
//! listed, so a framework resuming by listing (HF `get_last_checkpoint`) sees only complete
//! checkpoints, though its name still resolves (`mv` of a tree `cp` wrote; writing it again).
//!
//! ## Writing a checkpoint: how each framework finishes one
//!
//! | writer | what it does | what commits it |
//! |---|---|---|
//! | a tool, Orbax, 3FS-style | writes `x.tmp/`, renames it | the rename (`EBUSY` while a file in it is open for writing, `EEXIST` for a step committed already) |
//! | DCP `FileSystemWriter` (torchtitan, `dcp.save(sd, checkpoint_id=p)`) | writes `step-N/` in place, `.metadata.tmp` last, renamed to `.metadata` | `.metadata` at the top of the draft |
//! | Orbax | `commit_success.txt` last | that file |
//! | HF `Trainer` | `checkpoint-N/` in place: model, optimizer, scheduler, RNG, then `trainer_state.json` | `trainer_state.json` at the top of a `checkpoint-*` draft |
//! | DeepSpeed `save_checkpoint` | `global_stepN/` in place, then writes the file `latest` = `global_stepN` | the tracker file naming the draft |
//! | Megatron (legacy) | `iter_000000N/mp_rank_00/...`, then `latest_checkpointed_iteration.txt` = `N` | the tracker file naming the draft's step |
//! | `torch.save(sd, "/ckpt/job/model_5.pt")`, Lightning (a temporary file elsewhere, then `shutil.move`: copy, `copystat`) | one file in the job directory | its close (in `flush`, so `close()` reports a failure) |
//! | Lightning `save_last` (`last.ckpt`, `last-v1.ckpt`), HF `save_model()` into the output directory | a file with no step number in the job directory | nothing: a job file, kept (and replaced) at its close |
//!
//! A draft written in place by the mounts of several hosts (DCP on a multi-host job: each rank
//! writes its files through its host's mount, then the coordinator writes `.metadata`) is
//! committed by the mount that sees its marker, with the files every other mount recorded for a
//! draft of that name (their writer names differ: `--draft-writer`, default `<host>:<mount
//! point>`); two different files at one path are refused (`EIO`). The other mounts then show
//! the committed checkpoint in place of their draft once none of its files is open there.
//!
//! A one-file checkpoint under a temporary name (hidden, or ending `.tmp`, `.temp`, `.part`, `~`:
//! safetensors' `.tmpXXXXXX`, `os.replace(p + ".tmp", p)`) is committed by the rename to its final
//! name instead (at once if it was closed first, else at its close).
//!
//! A file written directly in the job directory whose name has **no step number** is a **job
//! file** (`fs/names.rs`): not a checkpoint, never `latest`, of any size, kept at the control
//! plane (`PutJobFile`) when it ends, so every mount and every restart reads it back; written
//! again (opened with `O_TRUNC`, or a rename over it) it is replaced whole at that end; `unlink`
//! deletes it. So is a file whose name's step is committed under another name (Lightning's
//! `epoch=0-step=5-v1.ckpt`; a trailing `-v<N>` version is never read as a step). A job file of
//! at most 64 KiB is also a **tracker** when its content (trimmed) names a draft, by name or by
//! step: that draft is committed first, with the tracker's content in its metadata.
//!
//! A file ends at a close by the process that opened it (or that process's clean exit with it
//! still open: `prog > /ckpt/job/step_5.out`; exit status 0 is taken at its word, even from a
//! program whose exit cut short a thread still writing), else once its last descriptor is
//! closed. It is given up instead when a process that wrote to it (its opener, or a child
//! writing through an inherited descriptor: `{ prog; } > f`) is killed or exits with a failure
//! status while holding it, when the mount cannot read how such a process stands, and when it
//! is written to after it ended through a descriptor still open elsewhere (a child still
//! writing, or a shell's `cmd >&2`). A file given up in a draft drops the whole draft (nothing of
//! it is committed; its name is free again); a one-file checkpoint is not committed, or, when
//! its close committed it already, is deleted again and the late write fails with `EIO`. A
//! draft committed stays committed: a late write to one of its files fails with `ENOTSUP`.
//!
//! ## Files being written
//!
//! What real writers do before they close a file works: `ftruncate` to pre-size, grow or shrink
//! (safetensors), writes at any offset and seeks back to patch a header (zip writers, HDF5),
//! reading back what was written (read-your-writes in a draft), renaming files and directories
//! inside a draft, `utime`/`chmod`/`chown` (`cp -a`, `rsync -a`, `tar -x`, `shutil.copy2`), and
//! opening a closed file of a draft again to write it. Bytes written in order stream to the
//! targets as they come (one chunk of staging memory per open file, from the SDK's bounded pool)
//! and are also copied to a local **spill area** (`--spill-dir`, default `$TMPDIR/starckpt-spill`;
//! `--spill-limit`, default 64 GiB; unlinked 0600 files), kept until the checkpoint commits. A
//! write out of order drops the stream, and the file is uploaded from its copy when it ends.
//! Past the spill limit a file written in order streams on without a copy (it can then not be
//! patched or read back: `ENOTSUP`); one that needs its copy gets `ENOSPC`. `fsync` returns
//! once every byte written so far is durable on the targets. A checkpoint must be committed
//! within the control plane's GC grace period (1 h by default) of its first bytes; past that
//! the commit fails with `EIO` rather than commit a hole.
//!
//! Drafts survive a restart of the mount: each draft's directories and the chunk lists of its
//! closed files are recorded at the control plane under the mount's writer name
//! (`--draft-writer`, default `<host>:<mount point>`, `fs/journal.rs`) before the close that
//! changed them returns (a close whose record cannot be made fails, `EIO`), and a mount started
//! again with the same writer name, on this host or another, lists them, so the framework's next
//! step commits them. Killing the mount commits nothing; a file still open then is lost (it
//! never ended). A record nobody puts again for the control plane's draft TTL (7 days by
//! default) is forgotten, and its chunks collected.
//!
//! ## Removing
//!
//! `rm -r`/`shutil.rmtree` of a committed checkpoint (HF `save_total_limit`) removes its files
//! and directories one by one: each is hidden from the remover's own view while it runs, and the
//! checkpoint is deleted at the control plane, whole, when its top directory is removed. Other
//! readers never see it half deleted; a remover that dies midway leaves it whole. Unlinking a
//! one-file checkpoint deletes it (Lightning's `save_top_k`). Times, owner and permission bits
//! set on a committed file are accepted and not kept; its bytes never change.
//!
//! ## What is refused, at once
//!
//! | operation                                        | errno     |
//! |--------------------------------------------------|-----------|
//! | write, truncate, create, mkdir in a committed checkpoint | `EROFS` |
//! | a rename to a name without a step number to commit | `EINVAL`  |
//! | writing into a kept job file without `O_TRUNC` (append, patch) | `ENOTSUP` |
//! | hard links, symlinks                             | `EPERM`   |
//! | a file directly in `/ckpt/` (outside a job)      | `EPERM`   |
//! | opening for writing from a process this mount's `/proc` does not show (another pid namespace, `hidepid`): whether it finished its file could not be told | `EACCES` |
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
//! open (`read.rs`). The mount asks for 16 MiB write requests and read-ahead of one chunk (4 MiB
//! by default): read requests then fall inside one chunk and are answered from it without a copy
//! (0.77x the SDK's read throughput with 16 MiB read requests, 0.81-0.95x with one-chunk ones).
//! The kernel grants at most `/proc/sys/fs/fuse/max_pages_limit` pages per request (256 = 1 MiB
//! by default): `echo 4096 > /proc/sys/fs/fuse/max_pages_limit` before mounting allows 16 MiB.

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
    let read_ahead_kb = fs::read_ahead_bytes(&client, &config) / 1024;
    let mut config = config;
    if config.draft_writer.is_none() {
        // By host and mount point: a mount started again at the same point finds its drafts.
        let point = mountpoint.canonicalize().unwrap_or_else(|_| mountpoint.to_path_buf());
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let host = if host.trim().is_empty() { "localhost" } else { host.trim() };
        let mut writer = format!("{host}:{}", point.display());
        // Within the bound on writer names, and unique still when cut (a hash of the whole).
        if writer.len() > starckpt_proto::draft::MAX_WRITER_BYTES {
            let hash = blake3::hash(writer.as_bytes()).to_hex();
            let mut keep = starckpt_proto::draft::MAX_WRITER_BYTES - 17;
            while !writer.is_char_boundary(keep) {
                keep -= 1;
            }
            writer = format!("{}~{}", &writer[..keep], &hash[..16]);
        }
        config.draft_writer = Some(writer);
    }
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
/// 128 KiB each; raising the mount's backing-device read-ahead lets them grow to a chunk
/// (`fs::read_ahead_bytes`; 2x the throughput, ../shared/MACHINE.md). Best effort: needs root.
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
