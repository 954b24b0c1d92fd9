//! O_DIRECT files and buffers outside the pools ([`ExternalBuf`]): opening, split transfers,
//! synced writes; shared by both engines.

use super::*;

/// Memory outside the store's pools that a read fills (a client's shared-memory slot): `len`
/// bytes at `ptr`, both multiples of 4096 as O_DIRECT requires, kept mapped by `owner` until the
/// engine has dropped this (after the device is done with them). A read writes into it; a write
/// only reads it (it may be mapped read-only then).
pub struct ExternalBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    _owner: Arc<dyn std::any::Any + Send + Sync>,
}

// SAFETY: memory `owner` keeps mapped; only the device (and the owner's raw copies) touch it.
unsafe impl Send for ExternalBuf {}

impl ExternalBuf {
    /// # Safety
    /// `len` bytes at `ptr` must stay mapped (writable, if it is read into) while `owner` lives, and no Rust
    /// reference to them may exist (another process may use them too: only raw copies, as
    /// `starckpt_dataplane::shm::Region` makes).
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> io::Result<ExternalBuf> {
        let aligned = |n: usize| n.is_multiple_of(starckpt_dataplane::buf::ALIGN);
        match std::ptr::NonNull::new(ptr) {
            Some(ptr) if len > 0 && aligned(ptr.as_ptr() as usize) && aligned(len) => {
                Ok(ExternalBuf { ptr, len, _owner: owner })
            }
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{len} bytes at {ptr:?} are not aligned"))),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The iovecs of a split transfer, whose pieces lie in file order `head[..split]`, `ext`,
/// `head[split..end]`, with the first `done` bytes skipped; returns how many of `iovecs` are in
/// use. (A split read has `split == end ==` `head`'s capacity; a `split` past `end` is `end`.)
pub(super) fn split_iovecs(
    head: &mut BoxedBuf,
    (split, end): (usize, usize),
    ext: &ExternalBuf,
    done: usize,
    iovecs: &mut [libc::iovec; 3],
) -> usize {
    let head = head.aligned_mut();
    debug_assert!(end <= head.capacity());
    let split = split.min(end);
    let base = head.as_mut_ptr();
    // SAFETY: `split <= capacity`: within the buffer, or one past its end.
    let after = unsafe { base.add(split) };
    let pieces = [(base, split), (ext.ptr.as_ptr(), ext.len), (after, end - split)];
    let (mut skip, mut count) = (done, 0);
    for (ptr, len) in pieces {
        if skip >= len {
            skip -= len;
            continue;
        }
        // SAFETY: `skip < len`: within the piece.
        iovecs[count] = libc::iovec { iov_base: unsafe { ptr.add(skip) }.cast(), iov_len: len - skip };
        (skip, count) = (0, count + 1);
    }
    count
}

/// Runs a split transfer ([`split_iovecs`]) on `file` with `preadv` or `pwritev` until it is
/// done or (reading) the file ends; returns the bytes transferred.
pub(super) fn transfer_split(
    file: &File,
    write: bool,
    head: &mut BoxedBuf,
    bounds: (usize, usize),
    ext: &ExternalBuf,
) -> io::Result<usize> {
    let total = bounds.1 + ext.len;
    let mut done = 0;
    let mut iovecs = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 3];
    while done < total {
        let count = split_iovecs(head, bounds, ext, done, &mut iovecs) as i32;
        let (fd, iov, at) = (file.as_raw_fd(), iovecs.as_ptr(), done as libc::off_t);
        // SAFETY: the iovecs cover `head` and `ext`, both alive and unaliased for the call.
        let n = unsafe { if write { libc::pwritev(fd, iov, count, at) } else { libc::preadv(fd, iov, count, at) } };
        match n {
            0 if write => return Err(io::Error::new(io::ErrorKind::WriteZero, "device accepted no bytes")),
            0 => break,
            n if n < 0 => {
                let error = io::Error::last_os_error();
                if error.kind() != io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
            n => done += n as usize,
        }
    }
    Ok(done)
}

/// Bytes an O_DIRECT write of `buf` transfers: its length rounded up to the alignment.
pub(super) fn write_len(buf: &BoxedBuf) -> usize {
    starckpt_dataplane::buf::round_up(buf.aligned().len())
}

pub(super) fn create_direct(path: &Path) -> io::Result<File> {
    OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_DIRECT).open(path)
}

pub(super) fn open_direct_write(path: &Path) -> io::Result<File> {
    OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(path)
}

pub(super) fn open_direct_read(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)
}

/// Writes the buffer at offset 0 of `file` and fdatasyncs it.
pub(super) fn write_synced(file: File, buf: BoxedBuf) -> io::Result<BoxedBuf> {
    file.write_all_at(&buf.aligned().full()[..write_len(&buf)], 0)?;
    file.sync_data()?;
    Ok(buf)
}
