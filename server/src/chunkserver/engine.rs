//! I/O engines: how a target moves aligned buffers to and from its device.
//!
//! Two engines implement [`IoEngine`], chosen by config (`--io-engine`):
//! - [`UringEngine`]: one dedicated thread per device owning an io_uring; writes and reads are
//!   submitted as O_DIRECT operations, a write is followed by an fdatasync on the same ring.
//!   Buffers of a [`starckpt_dataplane::buf::BufPool`] (the store's I/O buffers) are registered with
//!   the ring once, on first use, and then moved with WRITE_FIXED/READ_FIXED: the kernel pins
//!   their pages once instead of on every operation (fio, 4 MiB O_DIRECT writes at QD8 on these
//!   VMs: system CPU 1-2% of a core instead of 8-12%). Files are registered too, at no syscall
//!   of their own: the ring opens each chunk file (OPENAT with an auto-allocated direct
//!   descriptor, Linux 5.19) into its table of registered files, the transfer and sync name it by
//!   index, and a CLOSE gives the entry back; opens and closes leave the ring's thread (an open
//!   that creates a file runs on io_uring's workers), and no descriptor enters the process's
//!   table. Older kernels open with a syscall on the ring's thread (`start_with`). On these VMs:
//!   4 MiB puts into new files 1.30 GiB/s against 1.10 opened by syscall, gets level
//!   (`cargo bench -p starckpt-benches -- store_`; the disk's own noise is of that order).
//!   A split read ([`IoEngine::read_file_split`]) is one vectored READV: a chunk's header into a
//!   small buffer, its bytes into memory outside the pools ([`ExternalBuf`], a same-host client's
//!   shared-memory slot), pinned for that operation only.
//! - [`StdEngine`]: the same operations with ordinary blocking syscalls (still O_DIRECT) on
//!   tokio's blocking pool, bounded by a semaphore. For systems where io_uring is unavailable,
//!   such as Docker's default seccomp profile.
//!
//! Both run the same conformance suite (`chunkserver::store` tests).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use starckpt_dataplane::buf::{BoxedBuf, PoolSlot};
use tokio::sync::{Semaphore, mpsc, oneshot};

mod direct;
mod std_engine;
mod uring;
mod watch;

pub use direct::*;
pub use std_engine::*;
pub use uring::*;
pub use watch::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Uring,
    Std,
    /// io_uring where this process may use it, else std ([`resolve`]).
    Auto,
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "uring" | "io_uring" | "io-uring" => Ok(EngineKind::Uring),
            "std" => Ok(EngineKind::Std),
            "auto" => Ok(EngineKind::Auto),
            other => Err(format!("unknown I/O engine {other:?} (expected uring, std or auto)")),
        }
    }
}

/// Durable file I/O on aligned buffers. Every buffer's capacity is a multiple of 4096 and the
/// engine always transfers whole buffers, as O_DIRECT requires.
#[async_trait]
pub trait IoEngine: Send + Sync + 'static {
    /// Creates `path` (which must not exist), writes the buffer's meaningful bytes rounded up to
    /// a multiple of 4096 (the tail is the buffer's zero padding) at offset 0 and fdatasyncs.
    /// The buffer comes back for reuse.
    async fn write_new_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf>;
    /// The same into an existing file, overwritten in place from offset 0 (a reused chunk file,
    /// `freepool.rs`: its blocks are already allocated, so the fdatasync commits no metadata).
    async fn overwrite_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf>;
    /// Reads `path` from offset 0 into `buf` up to its capacity or end of file; sets `buf.len()`
    /// to the bytes read.
    async fn read_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf>;
    /// Reads `path` from offset 0 in one vectored read: its first `head.capacity()` bytes into
    /// `head` (whose length is set to what it got), the rest into `tail` up to `tail`'s length or
    /// the end of the file. Returns `head` and how many bytes went into `tail`. (A chunk whose
    /// header stays here while its bytes go straight into a client's shared memory.)
    async fn read_file_split(&self, path: PathBuf, head: BoxedBuf, tail: ExternalBuf) -> io::Result<(BoxedBuf, usize)>;
    /// Writes `path` (created, which it must not exist, when `create`; otherwise overwritten in
    /// place) from offset 0 in one vectored write: `head`'s first `split` bytes (a multiple of
    /// 4096), then `body`, then the rest of `head`'s meaningful bytes rounded up to a multiple of
    /// 4096 (its zero padding); then fdatasyncs. `head` comes back. (A chunk whose whole blocks go
    /// to the device straight from a client's shared memory, while its header and last partial
    /// block are in a small buffer here.)
    async fn write_file_split(
        &self,
        path: PathBuf,
        create: bool,
        head: BoxedBuf,
        split: usize,
        body: ExternalBuf,
    ) -> io::Result<BoxedBuf>;
    /// fsyncs a directory, making renames and unlinks in it durable.
    async fn sync_dir(&self, path: PathBuf) -> io::Result<()>;
    fn kind(&self) -> EngineKind;
    /// Buffers registered with the device queue so far (io_uring fixed buffers).
    fn fixed_buffers(&self) -> usize {
        0
    }
}

pub fn open_engine(kind: EngineKind, queue_depth: usize) -> io::Result<Arc<dyn IoEngine>> {
    Ok(match resolve(kind) {
        EngineKind::Uring => Arc::new(UringEngine::start(queue_depth)?),
        EngineKind::Std | EngineKind::Auto => Arc::new(StdEngine::new(queue_depth)),
    })
}

/// The engine `kind` stands for here: [`EngineKind::Auto`] is io_uring if this process may set up
/// a ring, else std, with a warning. A container's default seccomp profile (Docker's, Podman's)
/// answers io_uring_setup with ENOSYS, `kernel.io_uring_disabled` with EPERM; any other failure
/// (out of memory, locked-memory limits) is left for the real start to report.
pub fn resolve(kind: EngineKind) -> EngineKind {
    if kind != EngineKind::Auto {
        return kind;
    }
    match io_uring::IoUring::new(2) {
        Err(error) if uring_refused(&error) => {
            tracing::warn!(
                %error,
                "io_uring is not allowed here (a container's seccomp profile, or kernel.io_uring_disabled): \
                 blocking O_DIRECT I/O instead, which needs a thread per operation in flight; docker/README.md \
                 says how to allow io_uring"
            );
            EngineKind::Std
        }
        _ => EngineKind::Uring,
    }
}

/// Whether a ring's setup failed because the kernel refuses io_uring to this process.
fn uring_refused(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ENOSYS | libc::EPERM | libc::EACCES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_io_uring_where_allowed_and_std_where_refused() {
        assert_eq!(resolve(EngineKind::Std), EngineKind::Std);
        assert_eq!(resolve(EngineKind::Uring), EngineKind::Uring);
        // This host lets tests set up rings (the store's conformance suite runs on io_uring).
        assert_eq!(resolve(EngineKind::Auto), EngineKind::Uring);
        assert_eq!(open_engine(EngineKind::Auto, 4).unwrap().kind(), EngineKind::Uring);
        for refused in [libc::ENOSYS, libc::EPERM, libc::EACCES] {
            assert!(uring_refused(&io::Error::from_raw_os_error(refused)), "{refused}");
        }
        for other in [libc::ENOMEM, libc::EINVAL, libc::EMFILE] {
            assert!(!uring_refused(&io::Error::from_raw_os_error(other)), "{other}");
        }
        assert_eq!("auto".parse::<EngineKind>(), Ok(EngineKind::Auto));
        assert!("aio".parse::<EngineKind>().unwrap_err().contains("auto"));
    }
}
