//! Choosing a target's queue depth (device operations in flight) by measuring its device.
//!
//! What a device wants cannot be read from sysfs reliably: these VMs' virtio disk reports
//! `rotational=1`, yet writes 4 MiB O_DIRECT blocks at 2.8 GiB/s with 8 in flight against 1.9
//! with one (../shared/MACHINE.md), and an NVMe array may want 32. So on its first start a
//! target run with `--queue-depth auto` (the CLI's default) puts chunks into a scratch chunk
//! store and gets them back through the real store (verification, O_DIRECT write, fdatasync,
//! rename, directory fsync; [`REQUESTS`] at once, as several clients would send them) at each
//! depth in [`LEVELS`]. For puts and for gets it takes the smallest depth within [`GOOD_ENOUGH`]
//! of the best (more in flight only adds latency), uses the larger of the two (one queue serves
//! both), and remembers it in `DIR/queue-depth`. Later starts read that file; delete it to
//! measure again, or pass `--queue-depth N`. The measurement moves [`FILES_PER_LEVEL`] chunks
//! each way per depth (1.5 GiB written at 4 MiB chunks, a few seconds on these disks) and
//! removes them.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use starckpt_proto::ChunkHash;

use super::engine::{EngineKind, open_engine};
use super::freepool::FreePoolConfig;
use super::store::ChunkStore;

/// Depths measured.
pub const LEVELS: [usize; 6] = [1, 2, 4, 8, 16, 32];
/// Chunk files written at each depth.
pub const FILES_PER_LEVEL: usize = 64;
/// The chosen depth is the smallest whose throughput is at least this share of the best.
pub const GOOD_ENOUGH: f64 = 0.9;
/// Where the choice is remembered, under the target's directory.
const FILE: &str = "queue-depth";

/// Throughput measured at each depth, and the depth chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// (depth, bytes per second) of writes, in [`LEVELS`] order.
    pub writes: Vec<(usize, f64)>,
    /// The same for reads.
    pub reads: Vec<(usize, f64)>,
    pub queue_depth: usize,
}

impl Calibration {
    /// For the log and `DIR/queue-depth`: "writes 1: 1.22 GB/s, ...; reads ...".
    fn describe(&self) -> String {
        let rates = |levels: &[(usize, f64)]| {
            levels.iter().map(|(depth, rate)| format!("{depth}: {:.2} GB/s", rate / 1e9)).collect::<Vec<_>>().join(", ")
        };
        format!("writes {}; reads {}", rates(&self.writes), rates(&self.reads))
    }
}

/// The smallest depth within [`GOOD_ENOUGH`] of the best throughput (1 if nothing was measured).
pub fn choose(levels: &[(usize, f64)]) -> usize {
    let best = levels.iter().map(|&(_, rate)| rate).fold(0.0, f64::max);
    levels.iter().filter(|&&(_, rate)| rate >= best * GOOD_ENOUGH).map(|&(depth, _)| depth).min().unwrap_or(1)
}

/// The queue depth remembered in `dir`, or measured now (and remembered) if there is none or the
/// file does not hold a valid depth. Refuses to measure when the scratch chunks would eat into
/// the `reserve` bytes the target keeps free.
pub async fn queue_depth(dir: &Path, kind: EngineKind, chunk_bytes: usize, reserve: u64) -> io::Result<usize> {
    let path = dir.join(FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => match parse(&text) {
            Some(depth) => return Ok(depth),
            None => tracing::warn!(file = %path.display(), "not a queue depth; measuring the device again"),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let needed = (FILES_PER_LEVEL * (chunk_bytes + super::store::HEADER_BYTES)) as u64 + (16 << 20) + reserve;
    let available = super::store::fs_available(dir)?;
    if available < needed {
        return Err(io::Error::other(format!("{available} bytes free; measuring needs {needed} (with the reserve)")));
    }
    tracing::info!(dir = %dir.display(), "measuring the device to choose a queue depth (once)");
    let calibration = measure(&dir.join("calibrating"), kind, chunk_bytes, FILES_PER_LEVEL).await?;
    let measured = calibration.describe();
    tracing::info!(queue_depth = calibration.queue_depth, %measured, "queue depth chosen");
    let text = format!(
        "{}\n# chosen by measuring puts and gets of {chunk_bytes}-byte chunks by device operations in \
         flight: {measured}\n",
        calibration.queue_depth,
    );
    let temp = dir.join(format!("{FILE}.tmp"));
    std::fs::write(&temp, text)?;
    std::fs::File::open(&temp)?.sync_all()?;
    std::fs::rename(&temp, &path)?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(calibration.queue_depth)
}

/// The depth on the file's first line, if it is one of 1..=256.
fn parse(text: &str) -> Option<usize> {
    text.lines().next()?.trim().parse().ok().filter(|depth| (1..=256).contains(depth))
}

/// Puts `files` chunks of `chunk_bytes` into a scratch chunk store under `scratch` at each depth
/// in [`LEVELS`] (a fresh engine of `kind` each time; [`REQUESTS`] at once, as several clients
/// would send them), gets them back, timing both, and removes the store.
pub async fn measure(scratch: &Path, kind: EngineKind, chunk_bytes: usize, files: usize) -> io::Result<Calibration> {
    let rate = |elapsed: std::time::Duration| (files * chunk_bytes) as f64 / elapsed.as_secs_f64().max(1e-9);
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    for depth in LEVELS {
        let _ = std::fs::remove_dir_all(scratch);
        let engine = open_engine(kind, depth)?;
        let store = ChunkStore::open(scratch, engine, chunk_bytes, REQUESTS).await.map_err(io::Error::other)?;
        // New files, as a target's first checkpoints write.
        store.set_free_pool(FreePoolConfig { max_bytes: 0, ..Default::default() }).await.map_err(io::Error::other)?;
        let store = Arc::new(store);
        let started = Instant::now();
        let hashes = run_requests(&store, chunk_bytes, files, None).await;
        writes.push((depth, rate(started.elapsed())));
        let started = Instant::now();
        let read = match hashes {
            Ok(hashes) => run_requests(&store, chunk_bytes, files, Some(hashes)).await.map(drop),
            Err(error) => Err(error),
        };
        reads.push((depth, rate(started.elapsed())));
        drop(store);
        let _ = std::fs::remove_dir_all(scratch);
        read?;
    }
    Ok(Calibration { queue_depth: choose(&writes).max(choose(&reads)), writes, reads })
}

/// Requests the measurement keeps in flight against the store.
/// As many as the deepest level, so every level can fill its queue.
const REQUESTS: usize = LEVELS[LEVELS.len() - 1];

/// Puts `files` distinct chunks (`hashes` None) or gets `hashes` back, [`REQUESTS`] at once.
async fn run_requests(
    store: &Arc<ChunkStore>,
    chunk_bytes: usize,
    files: usize,
    hashes: Option<Vec<ChunkHash>>,
) -> io::Result<Vec<ChunkHash>> {
    let mut tasks = tokio::task::JoinSet::new();
    let permits = Arc::new(tokio::sync::Semaphore::new(REQUESTS));
    for index in 0..files {
        let (store, permits) = (Arc::clone(store), Arc::clone(&permits));
        let hash = hashes.as_ref().map(|hashes| hashes[index]);
        tasks.spawn(async move {
            let _permit = permits.acquire_owned().await.map_err(io::Error::other)?;
            match hash {
                Some(hash) => store.get(hash, 0, 0).await.map(|_| hash).map_err(io::Error::other),
                None => {
                    let mut chunk = store.write_buffer(chunk_bytes).await;
                    // Bytes that neither compress nor repeat across chunks.
                    for (i, byte) in chunk.data_mut().iter_mut().enumerate() {
                        *byte = (i as u64 ^ (index as u64) << 40).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7];
                    }
                    let hash = ChunkHash::of(chunk.data());
                    store.put(hash, chunk).await.map(|_| hash).map_err(io::Error::other)
                }
            }
        });
    }
    let mut done = Vec::with_capacity(files);
    while let Some(result) = tasks.join_next().await {
        done.push(result.map_err(io::Error::other)??);
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chooses_the_smallest_depth_near_the_best() {
        let virtio = [(1, 1.9), (2, 2.3), (4, 2.6), (8, 2.8), (16, 2.75), (32, 2.7)];
        assert_eq!(choose(&virtio), 4, "2.6 is within 10% of 2.8");
        let flat = [(1, 1.5), (2, 1.52), (4, 1.49), (8, 1.5), (16, 1.51), (32, 1.5)];
        assert_eq!(choose(&flat), 1, "a device that gains nothing from depth gets 1");
        let nvme_array = [(1, 2.0), (2, 3.9), (4, 7.0), (8, 11.0), (16, 13.5), (32, 14.0)];
        assert_eq!(choose(&nvme_array), 16);
        assert_eq!(choose(&[]), 1);
    }

    #[test]
    fn parses_only_valid_depths() {
        assert_eq!(parse("8\n# measured ..."), Some(8));
        assert_eq!(parse(" 32 \n"), Some(32));
        for bad in ["", "0\n", "257\n", "eight\n", "-1\n", "\n8\n"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn measures_once_remembers_and_measures_again_over_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let chunk = 64 * 1024;
        for kind in [EngineKind::Uring, EngineKind::Std] {
            let calibration = measure(&dir.path().join("calibrating"), kind, chunk, 8).await.unwrap();
            for levels in [&calibration.writes, &calibration.reads] {
                assert_eq!(levels.iter().map(|l| l.0).collect::<Vec<_>>(), LEVELS);
                assert!(levels.iter().all(|&(_, rate)| rate > 0.0), "{calibration:?}");
            }
            let (writes, reads) = (choose(&calibration.writes), choose(&calibration.reads));
            assert_eq!(calibration.queue_depth, writes.max(reads));
            assert!(!dir.path().join("calibrating").exists(), "its store is removed");
        }

        // Remembered: a depth in the file is used as it is.
        std::fs::write(dir.path().join(FILE), "3\n").unwrap();
        assert_eq!(queue_depth(dir.path(), EngineKind::Std, chunk, 0).await.unwrap(), 3);
        // Garbage is measured over, and the result written down; not into the reserve.
        std::fs::write(dir.path().join(FILE), "lots\n").unwrap();
        let error = queue_depth(dir.path(), EngineKind::Std, chunk, u64::MAX / 2).await.unwrap_err();
        assert!(error.to_string().contains("measuring needs"), "{error}");
        let depth = queue_depth(dir.path(), EngineKind::Std, chunk, 0).await.unwrap();
        assert!(LEVELS.contains(&depth));
        let text = std::fs::read_to_string(dir.path().join(FILE)).unwrap();
        assert_eq!(parse(&text), Some(depth));
        assert!(text.contains("writes 1: ") && text.contains("; reads 1: "), "{text}");
    }
}
