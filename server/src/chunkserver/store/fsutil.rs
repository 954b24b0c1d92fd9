//! Filesystem helpers: capacity, no-replace renames, times, the chunk directories.

use super::*;

pub(crate) fn statvfs(path: &Path) -> io::Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is NUL-terminated and stat is a valid out-pointer.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat)
}

/// Total bytes of the filesystem holding `path`.
pub(crate) fn fs_capacity(path: &Path) -> io::Result<u64> {
    statvfs(path).map(|stat| stat.f_blocks * stat.f_frsize)
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
pub(crate) fn fs_available(path: &Path) -> io::Result<u64> {
    statvfs(path).map(|stat| stat.f_bavail * stat.f_frsize)
}

pub(crate) fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let from = std::ffi::CString::new(from.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let to = std::ffi::CString::new(to.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: both paths are NUL-terminated C strings that outlive the call.
    let rc =
        unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_NOREPLACE) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Sets a file's mtime to now; false if it does not exist.
pub(crate) fn touch(path: &Path) -> io::Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let now = libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW };
    let times = [now, now];
    // SAFETY: c_path is NUL-terminated and times points at two timespecs, as utimensat requires.
    if unsafe { libc::utimensat(libc::AT_FDCWD, c_path.as_ptr(), times.as_ptr(), 0) } == 0 {
        return Ok(true);
    }
    let error = io::Error::last_os_error();
    if error.kind() == io::ErrorKind::NotFound { Ok(false) } else { Err(error) }
}

/// Creates the layout, clears `tmp/`, and counts chunks and their bytes.
pub(crate) fn prepare_dir(root: &Path) -> Result<(u64, u64), ChunkStoreError> {
    let chunks = root.join("chunks");
    let tmp = root.join("tmp");
    for dir in [root, &chunks, &tmp] {
        std::fs::create_dir_all(dir).map_err(io_error("mkdir", dir))?;
    }
    for entry in std::fs::read_dir(&tmp).map_err(io_error("list", &tmp))? {
        let path = entry.map_err(io_error("list", &tmp))?.path();
        std::fs::remove_file(&path).map_err(io_error("unlink", &path))?;
    }
    let (mut count, mut used) = (0u64, 0u64);
    for byte in 0..=255u8 {
        let dir = chunks.join(format!("{byte:02x}"));
        std::fs::create_dir_all(&dir).map_err(io_error("mkdir", &dir))?;
        // Renames out of it that a killed delete did not sync are made durable before the free
        // pool reuses their files (`FreePool::open`).
        std::fs::File::open(&dir).and_then(|d| d.sync_all()).map_err(io_error("fsync", &dir))?;
        for entry in std::fs::read_dir(&dir).map_err(io_error("list", &dir))? {
            let entry = entry.map_err(io_error("list", &dir))?;
            count += 1;
            used += entry.metadata().map_err(io_error("stat", &entry.path()))?.len();
        }
    }
    Ok((count, used))
}
