//! What the hardware and the usual alternative do with the same bytes on the same disk, measured
//! in the same run as starckpt so a figure is read as a ratio (these machines vary ±30% run to
//! run): a memcpy into touched memory (the floor of the trainer's stall), dd-style O_DIRECT
//! sequential write+fsync and read (the device's limits), and buffered write+fsync of one file
//! (what `torch.save` to a local filesystem does).

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use rand::{RngCore, SeedableRng};

/// The median of three copies of `state` into memory already touched: the machine's real copy
/// speed, which the staging copy should approach.
pub fn memcpy(state: &[Bytes]) -> Duration {
    let total: usize = state.iter().map(|t| t.len()).sum();
    let mut target = vec![1u8; total];
    let mut times = [Duration::ZERO; 3];
    for time in &mut times {
        let started = Instant::now();
        let mut offset = 0;
        for tensor in state {
            target[offset..offset + tensor.len()].copy_from_slice(tensor);
            offset += tensor.len();
        }
        *time = started.elapsed();
    }
    std::hint::black_box(&target);
    times.sort_unstable();
    times[1]
}

/// Removes a baseline's file however its measurement ends (it may be gigabytes).
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

pub struct Direct {
    pub write: Duration,
    pub read: Duration,
}

/// O_DIRECT sequential write of `total` bytes in 16 MiB blocks, fsync'd, then O_DIRECT read of
/// them back, in `dir` (the file is removed).
pub fn direct(total: u64, dir: &Path) -> anyhow::Result<Direct> {
    let block = 16 << 20;
    let mut buf = starckpt_proto::buf::AlignedBuf::new(block);
    rand::rngs::SmallRng::seed_from_u64(7).fill_bytes(buf.full_mut());
    buf.set_len(block);
    let path = dir.join(".starckpt-baseline-odirect.bin");
    let _remove = RemoveOnDrop(&path);
    let blocks = (total as usize).div_ceil(block);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .with_context(|| format!("open {} with O_DIRECT", path.display()))?;
    let started = Instant::now();
    for i in 0..blocks {
        file.write_all_at(buf.as_ref(), (i * block) as u64).with_context(|| format!("write {}", path.display()))?;
    }
    file.sync_all()?;
    let write = started.elapsed();
    drop(file);
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path)?;
    let started = Instant::now();
    for i in 0..blocks {
        file.read_exact_at(buf.full_mut(), (i * block) as u64).with_context(|| format!("read {}", path.display()))?;
    }
    let read = started.elapsed();
    Ok(Direct { write, read })
}

/// Buffered write of `state` into one file, then fsync: `torch.save(state, path)` followed by the
/// fsync that makes it a checkpoint (the file is removed).
pub fn buffered_fsync(state: &[Bytes], dir: &Path) -> anyhow::Result<Duration> {
    use std::io::Write;
    let path = dir.join(".starckpt-baseline-buffered.bin");
    let _remove = RemoveOnDrop(&path);
    let started = Instant::now();
    let mut file = std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))?;
    for tensor in state {
        file.write_all(tensor).with_context(|| format!("write {}", path.display()))?;
    }
    file.sync_all()?;
    Ok(started.elapsed())
}

/// CPU seconds (user + system) this process has used so far.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass; RUSAGE_SELF is always valid.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// `a` over `b`.
pub fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-9)
}
