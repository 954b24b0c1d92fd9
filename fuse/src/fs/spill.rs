//! The spill area: a local copy of each file being written through the mount, kept until its
//! checkpoint commits, so that what real writers do to a file before they close it works:
//! pre-sizing it with `ftruncate` (safetensors), seeking back to patch a header (zip writers,
//! HDF5), writing out of order, and reading back what they wrote (read-your-writes in a draft).
//!
//! While a file is written in order, its bytes go to the targets as they come (the stream) *and*
//! here; the first write that is not at the stream's head (or a truncation below it) drops the
//! stream, and the file is uploaded from this copy when it ends. Each copy is an unlinked file
//! (`O_TMPFILE`, mode 0600) in the spill directory, so a crash leaves nothing behind and no other
//! user can open it by name. Space is charged by the highest offset a file reaches; past
//! [`MountConfig::spill_limit_bytes`](super::MountConfig) a file written in order keeps
//! streaming without its copy (it then cannot be patched or read back: `ENOTSUP`), and one that
//! needs its copy fails with `ENOSPC`.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The spill directory and what its copies hold, shared by every file of a mount.
pub(crate) struct Spills {
    dir: PathBuf,
    limit_bytes: u64,
    used_bytes: AtomicU64,
}

impl Spills {
    pub(crate) fn new(dir: PathBuf, limit_bytes: u64) -> Arc<Spills> {
        Arc::new(Spills { dir, limit_bytes, used_bytes: AtomicU64::new(0) })
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes charged to every copy now.
    #[cfg(test)]
    pub(crate) fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Relaxed)
    }

    fn charge(&self, bytes: u64) -> bool {
        self.used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit_bytes)
            })
            .is_ok()
    }

    fn refund(&self, bytes: u64) {
        self.used_bytes.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// One file's local copy.
pub(crate) struct Spill {
    file: File,
    /// Bytes charged to [`Spills`]: the highest end of the file so far.
    charged_bytes: u64,
    spills: Arc<Spills>,
}

/// Why a copy could not take a write.
#[derive(Debug)]
pub(crate) enum SpillError {
    /// The spill area is full.
    Full,
    Io(io::Error),
}

impl Spill {
    /// A new, empty copy in the spill directory.
    pub(crate) fn new(spills: &Arc<Spills>) -> io::Result<Spill> {
        std::fs::create_dir_all(spills.dir())?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(spills.dir())
            .or_else(|_| {
                // A filesystem without O_TMPFILE: a named file, unlinked at once.
                let path = spills.dir().join(format!(".starckpt-spill-{}-{}", std::process::id(), unique()));
                let file =
                    std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
                std::fs::remove_file(&path)?;
                Ok::<File, io::Error>(file)
            })?;
        Ok(Spill { file, charged_bytes: 0, spills: Arc::clone(spills) })
    }

    /// Charges the copy for reaching `end` bytes.
    fn reserve(&mut self, end: u64) -> Result<(), SpillError> {
        if end > self.charged_bytes {
            if !self.spills.charge(end - self.charged_bytes) {
                return Err(SpillError::Full);
            }
            self.charged_bytes = end;
        }
        Ok(())
    }

    pub(crate) fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), SpillError> {
        self.reserve(offset + data.len() as u64)?;
        self.file.write_all_at(data, offset).map_err(SpillError::Io)
    }

    /// Makes the copy `len` bytes long (zeros past what was written).
    pub(crate) fn set_len(&mut self, len: u64) -> Result<(), SpillError> {
        self.reserve(len)?;
        self.file.set_len(len).map_err(SpillError::Io)
    }

    /// Up to `len` bytes from `offset`, no further than `size` (the file's length).
    pub(crate) fn read_at(&self, offset: u64, len: u32, size: u64) -> io::Result<Vec<u8>> {
        let end = size.min(offset.saturating_add(u64::from(len)));
        let mut data = vec![0; end.saturating_sub(offset) as usize];
        // Past the copy's own end (a file pre-sized while its copy was short) reads as zeros.
        let mut filled = 0;
        while filled < data.len() {
            match self.file.read_at(&mut data[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(data)
    }
}

impl Drop for Spill {
    fn drop(&mut self) {
        self.spills.refund(self.charged_bytes);
    }
}

fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_takes_writes_anywhere_and_is_charged_by_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let spills = Spills::new(dir.path().to_path_buf(), 1 << 20);
        let mut spill = Spill::new(&spills).unwrap();
        spill.write_at(10, b"world").unwrap();
        spill.write_at(0, b"hello").unwrap();
        assert_eq!(spill.read_at(0, 100, 15).unwrap(), b"hello\0\0\0\0\0world");
        assert_eq!(spills.used_bytes(), 15);
        // Pre-sized past what was written: zeros, within the file's size only.
        spill.set_len(20).unwrap();
        assert_eq!(spill.read_at(14, 100, 20).unwrap(), b"d\0\0\0\0\0");
        assert_eq!(spill.read_at(25, 100, 20).unwrap(), b"");
        // Nothing named is left in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        drop(spill);
        assert_eq!(spills.used_bytes(), 0);
    }

    #[test]
    fn a_full_spill_area_refuses_what_goes_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let spills = Spills::new(dir.path().to_path_buf(), 100);
        let mut first = Spill::new(&spills).unwrap();
        first.write_at(0, &[1; 60]).unwrap();
        let mut second = Spill::new(&spills).unwrap();
        assert!(matches!(second.write_at(0, &[2; 50]), Err(SpillError::Full)));
        second.write_at(0, &[2; 40]).unwrap();
        drop(first);
        second.write_at(40, &[2; 50]).unwrap();
        assert_eq!(spills.used_bytes(), 90);
    }
}
