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

/// O_DIRECT reads of whole files, `in_flight` at once (a thread each, a page-aligned buffer
/// each), claimed in the order given. Given a checkpoint's chunk files in restore order, it is
/// the store's on-disk layout read raw: beside starckpt's restore of the same chunks it separates
/// what the layout costs (many chunk-sized files, not one contiguous file) from what starckpt adds
/// (the transport, verification, copies).
pub fn direct_read_files(files: &[std::path::PathBuf], in_flight: usize) -> anyhow::Result<Duration> {
    use starckpt_dataplane::buf::{AlignedBuf, round_up};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut largest = 0;
    for file in files {
        largest = largest.max(std::fs::metadata(file).with_context(|| format!("stat {}", file.display()))?.len());
    }
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        let readers: Vec<_> = (0..in_flight.max(1))
            .map(|_| {
                scope.spawn(|| -> anyhow::Result<()> {
                    let mut buf = AlignedBuf::new(round_up(largest as usize));
                    while let Some(path) = files.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let file = std::fs::OpenOptions::new()
                            .read(true)
                            .custom_flags(libc::O_DIRECT)
                            .open(path)
                            .with_context(|| format!("open {} with O_DIRECT", path.display()))?;
                        // Chunk files are whole blocks; O_DIRECT reads whole blocks in any case.
                        let len = round_up(file.metadata()?.len() as usize);
                        file.read_exact_at(&mut buf.full_mut()[..len], 0)
                            .with_context(|| format!("read {}", path.display()))?;
                    }
                    Ok(())
                })
            })
            .collect();
        readers.into_iter().try_for_each(|reader| reader.join().map_err(|_| anyhow::anyhow!("a reader panicked"))?)
    })?;
    Ok(started.elapsed())
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
/// them back, from and into one 16 MiB buffer, in `dir` (the file is removed).
pub fn direct(total: u64, dir: &Path) -> anyhow::Result<Direct> {
    direct_from(total, dir, false)
}

/// [`direct`] from and into touched memory that holds all `total` bytes, each block in its own
/// place, as a save's staging and a restore's tensors hold them. On some hosts a device reads
/// from, or writes into, a small buffer used again and again much faster than memory as large as
/// the data (a virtual disk's host copies through memory it has in cache; a NIC or drive reaches
/// the CPU's cache), so this is the limit a save and a restore of `total` bytes are held to there.
pub fn direct_all(total: u64, dir: &Path) -> anyhow::Result<Direct> {
    direct_from(total, dir, true)
}

fn direct_from(total: u64, dir: &Path, whole: bool) -> anyhow::Result<Direct> {
    use starckpt_dataplane::buf::AlignedBuf;
    let block = 16 << 20;
    let blocks = (total as usize).div_ceil(block);
    let mut buf = AlignedBuf::new(if whole { blocks * block } else { block });
    let mut random = rand::rngs::SmallRng::seed_from_u64(7);
    for place in buf.full_mut().chunks_exact_mut(block) {
        random.fill_bytes(place);
    }
    // Where block `i` is in `buf`.
    let place = |i: usize| if whole { i * block } else { 0 };
    let path = dir.join(".starckpt-baseline-odirect.bin");
    let _remove = RemoveOnDrop(&path);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .with_context(|| format!("open {} with O_DIRECT", path.display()))?;
    let started = Instant::now();
    for i in 0..blocks {
        let at = place(i);
        file.write_all_at(&buf.full_mut()[at..at + block], (i * block) as u64)
            .with_context(|| format!("write {}", path.display()))?;
    }
    file.sync_all()?;
    let write = started.elapsed();
    drop(file);
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path)?;
    let started = Instant::now();
    for i in 0..blocks {
        let at = place(i);
        file.read_exact_at(&mut buf.full_mut()[at..at + block], (i * block) as u64)
            .with_context(|| format!("read {}", path.display()))?;
    }
    Ok(Direct { write, read: started.elapsed() })
}

/// The same bytes through one loopback TCP connection into an O_DIRECT file, then back out of it
/// over another: `nc | dd oflag=direct` and `dd iflag=direct | nc` with the disk and the socket
/// overlapped (two 16 MiB blocks in turn), sent in 1 MiB writes. The least a TCP data plane on
/// this host must do, with no hashing, chunking or metadata: the transport's limit beside the
/// disk's, for the phases of a run whose chunks travel over TCP (the file is removed). Each
/// direction's time comes with the CPU seconds both ends took.
pub fn tcp_direct(total: u64, dir: &Path) -> anyhow::Result<[Timed; 2]> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let block = 16 << 20;
    let blocks = (total as usize).div_ceil(block);
    let path = dir.join(".starckpt-baseline-tcp.bin");
    let _remove = RemoveOnDrop(&path);
    let open = |write: bool| {
        std::fs::OpenOptions::new()
            .read(!write)
            .write(write)
            .create(write)
            .truncate(write)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .with_context(|| format!("open {} with O_DIRECT", path.display()))
    };
    let listener = TcpListener::bind("127.0.0.1:0").context("listen on loopback")?;
    let send = |socket: &mut TcpStream, bytes: &[u8]| -> anyhow::Result<()> {
        bytes.chunks(1 << 20).try_for_each(|piece| socket.write_all(piece)).context("send over loopback")
    };

    // Sent from memory, received and written to the device.
    let file = open(true)?;
    let write = over_loopback(
        &listener,
        |mut sender| {
            let mut source = vec![0u8; block];
            rand::rngs::SmallRng::seed_from_u64(7).fill_bytes(&mut source);
            (0..blocks).try_for_each(|_| send(&mut sender, &source))
        },
        |socket| {
            overlapped(
                blocks,
                block,
                |_, buf| socket.read_exact(buf).context("receive over loopback"),
                |index, buf| file.write_all_at(buf, (index * block) as u64).context("write the baseline file"),
            )?;
            Ok(file.sync_all()?)
        },
    )?;
    drop(file);

    // Read from the device and sent, received into memory.
    let file = open(false)?;
    let read = over_loopback(
        &listener,
        |mut receiver| {
            let mut into = vec![1u8; block];
            (0..blocks).try_for_each(|_| receiver.read_exact(&mut into).context("receive over loopback"))
        },
        |socket| {
            overlapped(
                blocks,
                block,
                |index, buf| file.read_exact_at(buf, (index * block) as u64).context("read the baseline file"),
                |_, buf| send(socket, buf),
            )
        },
    )?;
    Ok([write, read])
}

/// Runs the two ends of one loopback connection to `listener` at once, `peer` on a thread of its
/// own and `here` on this one, and times them with the CPU seconds both took (this process's).
/// The connection is made before it is accepted (the kernel queues it), so neither end waits for
/// a peer that failed to start; the end that fails closes its socket, which ends the other.
fn over_loopback(
    listener: &std::net::TcpListener,
    peer: impl FnOnce(std::net::TcpStream) -> anyhow::Result<()> + Send,
    here: impl FnOnce(&mut std::net::TcpStream) -> anyhow::Result<()>,
) -> anyhow::Result<Timed> {
    let (started, cpu) = (Instant::now(), cpu_seconds());
    let client = std::net::TcpStream::connect(listener.local_addr()?).context("connect over loopback")?;
    let (mut socket, _) = listener.accept().context("accept on loopback")?;
    std::thread::scope(|scope| {
        let peer = scope.spawn(move || peer(client));
        let here = here(&mut socket);
        drop(socket);
        let peer = peer.join().map_err(|_| anyhow::anyhow!("the other end panicked"))?;
        here.and(peer)
    })?;
    Ok(Timed { wall: started.elapsed(), cpu: cpu_seconds() - cpu, disk_busy: None })
}

/// Moves `blocks` blocks of `block` bytes from `fill` to `drain`, block `i` into and out of one
/// of two page-aligned buffers, the drain of one block overlapping the fill of the next.
fn overlapped(
    blocks: usize,
    block: usize,
    mut fill: impl FnMut(usize, &mut [u8]) -> anyhow::Result<()>,
    mut drain: impl FnMut(usize, &[u8]) -> anyhow::Result<()> + Send,
) -> anyhow::Result<()> {
    use starckpt_dataplane::buf::AlignedBuf;
    let (full_tx, full) = std::sync::mpsc::sync_channel::<(usize, AlignedBuf)>(1);
    let (free_tx, free) = std::sync::mpsc::sync_channel::<AlignedBuf>(2);
    for _ in 0..2 {
        let mut buf = AlignedBuf::new(block);
        buf.full_mut().fill(1);
        buf.set_len(block);
        free_tx.send(buf)?;
    }
    std::thread::scope(|scope| {
        let drainer = scope.spawn(move || -> anyhow::Result<()> {
            for (index, buf) in full {
                drain(index, buf.as_ref())?;
                // The filler may be gone (it failed): its error is the one reported.
                let _ = free_tx.send(buf);
            }
            Ok(())
        });
        let filled = (0..blocks).try_for_each(|index| {
            let mut buf = free.recv().context("the drain stopped")?;
            fill(index, buf.as_mut())?;
            full_tx.send((index, buf)).context("the drain stopped")
        });
        drop(full_tx);
        let drained = drainer.join().map_err(|_| anyhow::anyhow!("the drain panicked"))?;
        drained.and(filled)
    })
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

/// What a phase cost: its wall time, this process's CPU seconds, and how long the data disk was
/// busy meanwhile (None where the disk's activity cannot be read).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    pub wall: Duration,
    pub cpu: f64,
    pub disk_busy: Option<Duration>,
}

impl Timed {
    /// A baseline's time, which measures nothing else.
    pub fn wall(wall: Duration) -> Timed {
        Timed { wall, cpu: 0.0, disk_busy: None }
    }

    /// Cores kept busy on average: CPU seconds per wall second.
    pub fn cores(&self) -> f64 {
        self.cpu / self.wall.as_secs_f64().max(1e-9)
    }

    /// The share of the phase the disk had requests in flight (1.0: busy throughout).
    pub fn disk_share(&self) -> Option<f64> {
        self.disk_busy.map(|busy| (busy.as_secs_f64() / self.wall.as_secs_f64().max(1e-9)).min(1.0))
    }
}

/// The clocks a phase is read against, to tell what bounded it: wall time, this process's CPU
/// time, and the busy time (`io_ticks` in `/proc/diskstats`) of the block device that holds the
/// data directory, which the targets and the baselines write to. Busy means some I/O was in
/// flight: a single disk busy throughout is saturated, a RAID or device-mapper volume (several
/// disks behind one device) need not be.
pub struct Meter {
    /// The device's name in `/proc/diskstats`; None for a filesystem on no block device (tmpfs).
    disk: Option<String>,
}

/// One reading of a [`Meter`].
pub struct Reading {
    at: Instant,
    cpu: f64,
    disk_ms: Option<u64>,
}

impl Meter {
    pub fn for_dir(dir: &Path) -> Meter {
        use std::os::unix::fs::MetadataExt;
        let disk = std::fs::metadata(dir).ok().and_then(|m| {
            let dev = m.dev();
            let (major, minor) = (libc::major(dev), libc::minor(dev));
            // The sysfs link's last component is the device (or partition) name.
            let link = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}")).ok()?;
            Some(link.file_name()?.to_string_lossy().into_owned())
        });
        let meter = Meter { disk };
        match meter.disk_ms() {
            Some(_) => meter,
            None => Meter { disk: None },
        }
    }

    /// The disk measured, if any.
    pub fn disk(&self) -> Option<&str> {
        self.disk.as_deref()
    }

    pub fn read(&self) -> Reading {
        Reading { at: Instant::now(), cpu: cpu_seconds(), disk_ms: self.disk_ms() }
    }

    /// The cost of the phase since `start`.
    pub fn since(&self, start: &Reading) -> Timed {
        let now = self.read();
        Timed {
            wall: now.at - start.at,
            cpu: now.cpu - start.cpu,
            disk_busy: start.disk_ms.zip(now.disk_ms).map(|(a, b)| Duration::from_millis(b.saturating_sub(a))),
        }
    }

    /// Flushes dirty data and waits (at most 10 s) until the disk has been idle for 100 ms, so
    /// that one measurement's aftermath does not land in the next: removing a baseline's 2 GB
    /// file on a filesystem mounted with `discard` keeps the disk busy discarding for a while.
    pub fn settle(&self) {
        // SAFETY: sync() takes no arguments and cannot fail.
        unsafe { libc::sync() };
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut last, mut idle_since) = (self.disk_ms(), Instant::now());
        while self.disk.is_some() && Instant::now() < deadline && idle_since.elapsed() < Duration::from_millis(100) {
            std::thread::sleep(Duration::from_millis(10));
            let now = self.disk_ms();
            if now != last {
                (last, idle_since) = (now, Instant::now());
            }
        }
    }

    /// Milliseconds the disk has spent with I/O in flight since boot.
    fn disk_ms(&self) -> Option<u64> {
        io_ticks(&std::fs::read_to_string("/proc/diskstats").ok()?, self.disk.as_deref()?)
    }
}

/// Device `name`'s `io_ticks` (milliseconds with I/O in flight) in `/proc/diskstats` text: the
/// tenth statistic, after major, minor and name (Documentation/admin-guide/iostats.rst).
fn io_ticks(diskstats: &str, name: &str) -> Option<u64> {
    let line = diskstats.lines().find(|line| line.split_whitespace().nth(2) == Some(name))?;
    line.split_whitespace().nth(12)?.parse().ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_ticks_is_the_tenth_statistic_of_the_named_device() {
        let stats = "\
 253       0 vda 5631 2048 512834 2103 81764 10922 30148762 219337 0 64516 221440 0 0 0 0 1034 1000
 253       1 vda1 5571 2048 510170 2091 81764 10922 30148762 219337 0 64504 221428 0 0 0 0 0 0
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
";
        assert_eq!(io_ticks(stats, "vda"), Some(64516));
        assert_eq!(io_ticks(stats, "vda1"), Some(64504));
        assert_eq!(io_ticks(stats, "loop0"), Some(0));
        assert_eq!(io_ticks(stats, "vdb"), None);
        assert_eq!(io_ticks(" 253 0 short 1 2 3", "short"), None);
    }

    #[test]
    fn a_directory_on_no_block_device_measures_no_disk() {
        let meter = Meter::for_dir(Path::new("/proc"));
        assert_eq!(meter.disk(), None);
        let start = meter.read();
        std::thread::sleep(Duration::from_millis(5));
        let timed = meter.since(&start);
        assert!(timed.wall >= Duration::from_millis(5));
        assert_eq!((timed.disk_busy, timed.disk_share()), (None, None));
    }
}
