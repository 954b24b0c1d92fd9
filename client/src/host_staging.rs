//! Staging copies on one host go before uploads (`save.rs` module docs): a save holds a shared
//! `flock` on a host-wide file while it stages, and its uploads, once it has staged, wait until
//! no save on the host holds one. The ranks of a job on one host save at once; without this, the
//! first to finish its copy hashed and sent chunks while the others were still copying, on the
//! same cores and memory bandwidth: with 8 ranks on 2 cores, 40% of the stall's CPU samples were
//! BLAKE3 of early ranks' uploads.
//!
//! A lock held by a process is dropped by the kernel when it dies, so a killed trainer holds
//! nobody back; one staging for long (a fill source that hangs) holds others' uploads back for
//! [`MAX_WAIT`] at most. Only while uploads wait for staging (`upload_during_staging` off).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Longest an upload waits for other saves on the host to finish staging.
const MAX_WAIT: Duration = Duration::from_secs(30);

/// The host-wide file, where `/dev/shm` exists (each container has its own: the ranks of one
/// container coordinate).
pub(crate) fn default_path() -> Option<PathBuf> {
    Path::new("/dev/shm").is_dir().then(|| PathBuf::from("/dev/shm/starckpt-staging.lock"))
}

/// The file, created readable by every user if missing (a shared or exclusive `flock` needs
/// only a descriptor open for reading).
fn open(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match File::open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o666).open(path)
        }
        opened => opened,
    }
}

fn lock(file: &File, operation: libc::c_int) -> std::io::Result<()> {
    // SAFETY: flock on a descriptor `file` owns for the duration of the call.
    match unsafe { libc::flock(file.as_raw_fd(), operation) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// A save staging on this host: holds a shared lock until dropped.
pub(crate) struct Staging {
    _locked: File,
}

impl Staging {
    /// Takes the shared lock on `path` (it waits only while an upload checks the file: an
    /// instant). None if the file cannot be opened or locked: the save stages regardless.
    pub(crate) async fn begin(path: &Path) -> Option<Staging> {
        let path = path.to_path_buf();
        let locked = tokio::task::spawn_blocking(move || {
            let file = open(&path)?;
            lock(&file, libc::LOCK_SH).map(|()| file)
        })
        .await;
        match locked {
            Ok(Ok(file)) => Some(Staging { _locked: file }),
            Ok(Err(error)) => {
                tracing::debug!(%error, "no host-wide staging lock; uploads do not wait for other saves' staging");
                None
            }
            Err(_) => None,
        }
    }
}

/// Waits until no save on this host is staging (none holds the shared lock on `path`), or
/// [`MAX_WAIT`] has passed, polling without holding anything in between.
pub(crate) async fn wait_for_others(path: &Path) {
    let Ok(file) = open(path) else { return };
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        match lock(&file, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => {
                let _ = lock(&file, libc::LOCK_UN);
                return;
            }
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) && started.elapsed() < MAX_WAIT => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(10));
            }
            Err(error) => {
                tracing::debug!(%error, waited = ?started.elapsed(), "uploading without waiting further for other saves' staging");
                return;
            }
        }
    }
}
