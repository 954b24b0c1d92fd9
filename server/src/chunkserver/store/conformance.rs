//! One suite, run against every I/O engine.
use super::*;
use crate::chunkserver::engine::{EngineKind, open_engine};

async fn store(kind: EngineKind, dir: &Path) -> ChunkStore {
    ChunkStore::open(dir, open_engine(kind, 4).unwrap(), 64 * 1024, 4).await.unwrap()
}

async fn put(store: &ChunkStore, data: &[u8]) -> (ChunkHash, PutOutcome) {
    let hash = ChunkHash::of(data);
    let mut write = store.write_buffer(data.len()).await;
    write.data_mut().copy_from_slice(data);
    (hash, store.put(hash, write).await.unwrap())
}

fn random(len: usize, seed: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut out = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut out);
    out
}

async fn round_trip_sizes(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    // Sizes around the alignment and the pool buffer size (64 KiB), including one-off buffers.
    for (i, len) in [1usize, 4095, 4096, 4097, 65536 - 4096, 65536, 300_001].into_iter().enumerate() {
        let data = random(len, i as u64);
        let (hash, outcome) = put(&store, &data).await;
        assert_eq!(outcome, PutOutcome::Stored);
        let ChunkRead { bytes, length: chunk_len, .. } = store.get(hash, 0, 0).await.unwrap();
        assert_eq!(chunk_len, len as u64);
        assert_eq!(&bytes[..], &data[..], "len {len}");
        let (third, rest) = (len / 3, len - len / 3);
        let tail = store.get(hash, third as u64, rest as u64).await.unwrap().bytes;
        assert_eq!(&tail[..], &data[third..], "len {len}");
    }
    assert_eq!(store.stats().chunk_count, 7);
}

async fn dedup_has_delete(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let data = random(10_000, 1);
    let (hash, first) = put(&store, &data).await;
    let (_, second) = put(&store, &data).await;
    assert_eq!((first, second), (PutOutcome::Stored, PutOutcome::AlreadyPresent));
    let other = ChunkHash::of(b"absent");
    assert_eq!(store.has(vec![hash, other]).await.unwrap(), vec![true, false]);
    assert!(store.stats().used_bytes >= 10_000);
    assert_eq!(store.delete(vec![hash, other], None).await.unwrap(), 1);
    assert_eq!(store.has(vec![hash]).await.unwrap(), vec![false]);
    assert!(matches!(store.get(hash, 0, 0).await, Err(ChunkStoreError::NotFound { .. })));
    assert_eq!(store.stats(), StoreStats { used_bytes: 0, chunk_count: 0, ..store.stats() });
}

async fn rejects_bad_input(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let mut write = store.write_buffer(5).await;
    write.data_mut().copy_from_slice(b"hello");
    let wrong = ChunkHash::of(b"world");
    assert!(matches!(store.put(wrong, write).await, Err(ChunkStoreError::HashMismatch { .. })));
    assert_eq!(store.has(vec![wrong]).await.unwrap(), vec![false]);
    let (hash, _) = put(&store, b"hello").await;
    assert!(matches!(store.get(hash, 3, 10).await, Err(ChunkStoreError::BadRange { .. })));
    assert!(matches!(store.get(hash, 6, 0).await, Err(ChunkStoreError::BadRange { .. })));
}

async fn detects_corruption_and_survives_restart(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let data = random(8192, 2);
    let hash = {
        let store = store(kind, dir.path()).await;
        put(&store, &data).await.0
    };
    // A leftover temp file from a crash is cleaned; the stored chunk is counted again.
    std::fs::write(dir.path().join("tmp").join("leftover"), b"partial").unwrap();
    let store = store(kind, dir.path()).await;
    assert_eq!(store.stats().chunk_count, 1);
    assert_eq!(std::fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
    assert_eq!(&store.get(hash, 0, 0).await.unwrap().bytes[..], &data[..]);
    // Rot in the header is caught by the header checksum.
    let path = store.chunk_path(&hash);
    let mut file = std::fs::read(&path).unwrap();
    file[20] ^= 0x40;
    std::fs::write(&path, &file).unwrap();
    assert!(matches!(store.get(hash, 0, 0).await, Err(ChunkStoreError::Corrupt { .. })));
    // A truncated file too.
    std::fs::write(&path, &file[..100]).unwrap();
    assert!(matches!(store.get(hash, 0, 0).await, Err(ChunkStoreError::Corrupt { .. })));
    // A well-formed header (valid checksum) claiming an absurd length is an error, not a panic.
    let mut crafted = vec![0u8; HEADER_BYTES + 4096];
    let absurd = StoredHeader {
        codec: Codec::None,
        stored_len: u64::MAX - 10,
        length: u64::MAX - 10,
        stored_hash: hash,
        keyed: false,
    };
    encode_header(&mut crafted[..HEADER_BYTES], &absurd, &hash);
    std::fs::write(&path, &crafted).unwrap();
    assert!(matches!(store.get(hash, 0, 0).await, Err(ChunkStoreError::Corrupt { .. })));
}

async fn concurrent_puts_of_one_chunk(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(store(kind, dir.path()).await);
    let data = Arc::new(random(50_000, 3));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (store, data) = (Arc::clone(&store), Arc::clone(&data));
            tokio::spawn(async move { put(&store, &data).await.1 })
        })
        .collect();
    let mut stored = 0;
    for task in tasks {
        if task.await.unwrap() == PutOutcome::Stored {
            stored += 1;
        }
    }
    assert_eq!(stored, 1, "exactly one writer creates the chunk");
    assert_eq!(store.stats().chunk_count, 1);
}

fn set_last_use(store: &ChunkStore, hash: &ChunkHash, ago: Duration) {
    let file = std::fs::File::options().write(true).open(store.chunk_path(hash)).unwrap();
    file.set_modified(SystemTime::now() - ago).unwrap();
}

async fn list_pages_and_guarded_delete(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let mut hashes = Vec::new();
    for seed in 0..5 {
        hashes.push(put(&store, &random(3000, 100 + seed)).await.0);
    }
    hashes.sort();
    std::fs::write(dir.path().join("chunks").join("00").join("not-a-chunk"), b"x").unwrap();
    // Pages in hash order, resumable after the last hash of the previous page.
    let (first, done) = store.list(None, 3).await.unwrap();
    assert!(!done);
    let (rest, done) = store.list(Some(first[2].hash), 3).await.unwrap();
    assert!(done);
    let listed: Vec<ChunkHash> = first.iter().chain(&rest).map(|c| c.hash).collect();
    assert_eq!(listed, hashes);

    let hour = Duration::from_secs(3600);
    for hash in &hashes {
        set_last_use(&store, hash, hour);
    }
    // A chunk is never older than the store's own uptime: nothing is collectable yet.
    let (capped, _) = store.list(None, 10).await.unwrap();
    assert!(capped.iter().all(|c| c.unused_for < Duration::from_secs(60)), "{capped:?}");
    assert_eq!(store.delete(hashes.clone(), Some(hour / 2)).await.unwrap(), 0);
    store.assume_uptime(2 * hour);
    let (all, _) = store.list(None, 10).await.unwrap();
    assert!(all.iter().all(|c| c.unused_for >= hour - Duration::from_secs(60)), "{all:?}");
    // HAS and a repeated PUT refresh a chunk's last use, so GC's guarded delete keeps it; an
    // audit's existence check does not.
    assert_eq!(store.has(vec![hashes[0]]).await.unwrap(), vec![true]);
    let gone = ChunkHash::of(b"never stored");
    assert_eq!(store.stored(vec![hashes[2], gone]).await.unwrap(), vec![true, false]);
    let mut again = store.write_buffer(3000).await;
    let data = (100..105).map(|seed| random(3000, seed)).find(|d| ChunkHash::of(d) == hashes[1]).unwrap();
    again.data_mut().copy_from_slice(&data);
    assert_eq!(store.put(hashes[1], again).await.unwrap(), PutOutcome::AlreadyPresent);
    let deleted = store.delete(hashes.clone(), Some(hour / 2)).await.unwrap();
    assert_eq!(deleted, 3);
    assert_eq!(store.has(hashes.clone()).await.unwrap(), vec![true, true, false, false, false]);
    assert_eq!(store.stats().chunk_count, 2);
    // Unguarded delete removes recently used chunks too.
    assert_eq!(store.delete(hashes.clone(), None).await.unwrap(), 2);
    assert_eq!(store.list(None, 10).await.unwrap(), (vec![], true));
}

async fn verify_and_repair_replace_only_bad_copies(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let data = random(100_000, 31);
    let (hash, _) = put(&store, &data).await;
    assert_eq!(store.check_copy(hash).await.unwrap(), Copy::Good { length: 100_000 });
    // A good copy is left alone by a repair.
    let mut write = store.write_buffer(data.len()).await;
    write.data_mut().copy_from_slice(&data);
    assert_eq!(store.repair(hash, write).await.unwrap(), PutOutcome::AlreadyPresent);
    // Rot in the payload (the header still names the chunk): verify catches it, a plain put
    // would not replace it, a repair does.
    let path = store.chunk_path(&hash);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[HEADER_BYTES + 5] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let Copy::Bad { inode, .. } = store.check_copy(hash).await.unwrap() else { panic!("rot not found") };
    // Good bytes written into that same file (as a chunk file reused from the free pool is)
    // before the scrub removes it: judged again under the lock, it stays.
    let rotten = bytes.clone();
    bytes[HEADER_BYTES + 5] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    assert!(!store.remove_copy_if(hash, inode).await.unwrap(), "a good copy was removed");
    assert_eq!(store.check_copy(hash).await.unwrap(), Copy::Good { length: 100_000 });
    std::fs::write(&path, &rotten).unwrap();
    let Copy::Bad { inode, .. } = store.check_copy(hash).await.unwrap() else { panic!("rot not found") };
    assert_eq!(put(&store, &data).await.1, PutOutcome::AlreadyPresent);
    let mut write = store.write_buffer(data.len()).await;
    write.data_mut().copy_from_slice(&data);
    assert_eq!(store.repair(hash, write).await.unwrap(), PutOutcome::Stored);
    assert_eq!(store.check_copy(hash).await.unwrap(), Copy::Good { length: 100_000 });
    assert_eq!(store.stats().chunk_count, 1);
    // The bad file is gone: removing "it" leaves the good copy that replaced it.
    assert!(!store.remove_copy_if(hash, inode).await.unwrap());
    assert_eq!(store.check_copy(hash).await.unwrap(), Copy::Good { length: 100_000 });
    // A file of a format this build does not know is an error, never judged bad.
    let good = std::fs::read(&path).unwrap();
    let mut newer = good.clone();
    newer[8] = 9;
    let sum = header_sum(&newer);
    newer[64..72].copy_from_slice(&sum);
    std::fs::write(&path, &newer).unwrap();
    assert!(matches!(store.check_copy(hash).await, Err(ChunkStoreError::Io { .. })));
    // So is a known format naming a codec or a length this build does not know.
    for (at, value) in [(10, 200u8), (31, 1)] {
        let mut newer = good.clone();
        newer[at] = value;
        let sum = header_sum(&newer);
        newer[64..72].copy_from_slice(&sum);
        std::fs::write(&path, &newer).unwrap();
        let refused = store.check_copy(hash).await;
        assert!(matches!(refused, Err(ChunkStoreError::Io { .. })), "byte {at}: {refused:?}");
    }
    // A header whose checksum does not hold is corrupt, whatever it says.
    let mut broken = good.clone();
    broken[10] = 200;
    std::fs::write(&path, &broken).unwrap();
    assert!(matches!(store.check_copy(hash).await, Ok(Copy::Bad { .. })));
    std::fs::write(&path, &good).unwrap();
    // A repair of a missing copy stores it; a payload that is not the chunk is refused.
    store.delete(vec![hash], None).await.unwrap();
    assert!(matches!(store.check_copy(hash).await, Err(ChunkStoreError::NotFound { .. })));
    let mut write = store.write_buffer(data.len()).await;
    write.data_mut().copy_from_slice(&random(100_000, 32));
    assert!(matches!(store.repair(hash, write).await, Err(ChunkStoreError::HashMismatch { .. })));
    let mut write = store.write_buffer(data.len()).await;
    write.data_mut().copy_from_slice(&data);
    assert_eq!(store.repair(hash, write).await.unwrap(), PutOutcome::Stored);
    assert_eq!(&store.get(hash, 0, 0).await.unwrap().bytes[..], &data[..]);
}

async fn packed_write(store: &ChunkStore, packed: &codec::Compressed, length: usize) -> ChunkWrite {
    let mut write = store.write_buffer(packed.bytes.len()).await;
    write.data_mut().copy_from_slice(&packed.bytes);
    write.set_codec(packed.codec, length as u64);
    write
}

/// A compressed chunk: decoded and checked on put, kept as sent (format version 2, with the
/// stored bytes' hash), returned encoded whole or decoded in ranges, scrubbed by the stored
/// hash, and survives a restart.
async fn compressed_chunks(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let data: Vec<u8> =
        (0..150_000u32).flat_map(|i| (((i % 512) as f32 * 1e-4).to_bits() >> 16).to_le_bytes()[..2].to_vec()).collect();
    let hash = ChunkHash::of(&data);
    let packed = codec::compress(&data, &codec::CompressConfig::default()).expect("compresses");
    assert_eq!(store.put(hash, packed_write(&store, &packed, data.len()).await).await.unwrap(), PutOutcome::Stored);
    let path = store.chunk_path(&hash);
    let file = std::fs::read(&path).unwrap();
    assert_eq!(u16::from_le_bytes([file[8], file[9]]), FORMAT_VERSION_STORED_HASH);
    assert_eq!(&file[HEADER_BYTES..HEADER_BYTES + packed.bytes.len()], &packed.bytes[..], "stored as sent");
    let whole = store.get(hash, 0, 0).await.unwrap();
    assert_eq!((whole.codec, whole.length, &whole.bytes[..]), (packed.codec, data.len() as u64, &packed.bytes[..]));
    let range = store.get(hash, 5, 1000).await.unwrap();
    assert_eq!((range.codec, &range.bytes[..]), (Codec::None, &data[5..1005]));
    assert_eq!(store.check_copy(hash).await.unwrap(), Copy::Good { length: packed.bytes.len() as u64 });
    drop(store);
    let store = self::store(kind, dir.path()).await;
    assert_eq!(store.get(hash, 0, 0).await.unwrap().bytes, whole.bytes, "survives a restart");

    // Rot in the stored bytes is found by the scrub's check; the codec byte is covered too.
    let mut rotten = file.clone();
    rotten[HEADER_BYTES + 10] ^= 0x10;
    std::fs::write(&path, &rotten).unwrap();
    assert!(matches!(store.check_copy(hash).await.unwrap(), Copy::Bad { .. }));
    let mut extension = file.clone();
    extension[80] ^= 0x01;
    std::fs::write(&path, &extension).unwrap();
    assert!(matches!(store.check_copy(hash).await.unwrap(), Copy::Bad { .. }), "the stored hash is covered");
    let mut recoded = file.clone();
    recoded[10] = Codec::Zstd.to_wire() as u8;
    std::fs::write(&path, &recoded).unwrap();
    assert!(matches!(store.check_copy(hash).await.unwrap(), Copy::Bad { .. }));
    assert!(matches!(store.get(hash, 0, 0).await, Err(ChunkStoreError::Corrupt { .. })));
    std::fs::write(&path, &file).unwrap();

    // A payload that decodes to other bytes, or claims another length, is refused.
    let other = ChunkHash::of(b"other");
    assert!(matches!(
        store.put(other, packed_write(&store, &packed, data.len()).await).await,
        Err(ChunkStoreError::HashMismatch { .. })
    ));
    let mut short = packed_write(&store, &packed, data.len()).await;
    short.set_codec(packed.codec, data.len() as u64 - 2);
    assert!(matches!(store.put(hash, short).await, Err(ChunkStoreError::Undecodable { .. })));
    assert!(store.chunk_path(&other).metadata().is_err());
    // Stored as large as decoded: refused (a reader would fetch more than the chunk).
    let mut bloated = store.write_buffer(data.len()).await;
    bloated.data_mut().copy_from_slice(&data);
    bloated.set_codec(Codec::Zstd, data.len() as u64);
    assert!(matches!(store.put(hash, bloated).await, Err(ChunkStoreError::Undecodable { .. })));
    // A reader that does not decode gets the chunk decoded.
    let plain = store.read(hash, 0, 0, false).await.unwrap();
    assert_eq!((plain.codec, &plain.bytes[..]), (Codec::None, &data[..]));
}

/// Memory outside the store (as a client's shared-memory slot is) that `read_placed` fills: the
/// buffer and a pointer to it, read back through the pointer as the device wrote it.
fn outside(len: usize) -> (Arc<AlignedBuf>, *mut u8) {
    let mut memory = AlignedBuf::new(len);
    let at = memory.as_mut_ptr();
    (Arc::new(memory), at)
}

fn placed_dest(memory: &Arc<AlignedBuf>, at: *mut u8) -> ExternalBuf {
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(memory) as _;
    // SAFETY: `memory` holds `capacity()` bytes at `at` while `owner` lives; read back only after.
    unsafe { ExternalBuf::new(at, memory.capacity(), owner) }.unwrap()
}

/// Whole chunks read from the device straight into outside memory: the stored bytes land there
/// (compressed ones as stored), one too big for it is left to `read`, and a missing, damaged or
/// short file is an error, not bytes.
async fn placed_reads(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let (memory, at) = outside(128 * 1024);
    for (i, len) in [1usize, 4095, 4096, 4097, 128 * 1024].into_iter().enumerate() {
        let data = random(len, 40 + i as u64);
        let (hash, _) = put(&store, &data).await;
        let placed = store.read_placed(hash, placed_dest(&memory, at)).await.unwrap();
        assert_eq!(placed, Some(Placed { stored_len: len as u64, codec: Codec::None, length: len as u64 }));
        // SAFETY: the read completed; `memory` is alive.
        assert_eq!(unsafe { std::slice::from_raw_parts(at, len) }, &data[..], "len {len}");
    }
    let big = random(128 * 1024 + 1, 49);
    let (big_hash, _) = put(&store, &big).await;
    assert_eq!(store.read_placed(big_hash, placed_dest(&memory, at)).await.unwrap(), None, "does not fit");
    assert_eq!(&store.get(big_hash, 0, 0).await.unwrap().bytes[..], &big[..]);

    let data: Vec<u8> = (0..60_000u32).flat_map(|i| ((i % 300) as u16).to_le_bytes()).collect();
    let hash = ChunkHash::of(&data);
    let packed = codec::compress(&data, &codec::CompressConfig::default()).expect("compresses");
    store.put(hash, packed_write(&store, &packed, data.len()).await).await.unwrap();
    let placed = store.read_placed(hash, placed_dest(&memory, at)).await.unwrap().unwrap();
    let stored = placed.stored_len as usize;
    assert_eq!((placed.codec, placed.length, stored), (packed.codec, data.len() as u64, packed.bytes.len()));
    // SAFETY: as above.
    assert_eq!(unsafe { std::slice::from_raw_parts(at, stored) }, &packed.bytes[..], "kept as stored");

    let absent = ChunkHash::of(b"absent");
    assert!(matches!(store.read_placed(absent, placed_dest(&memory, at)).await, Err(ChunkStoreError::NotFound { .. })));
    let data = random(20_000, 50);
    let (hash, _) = put(&store, &data).await;
    let path = store.chunk_path(&hash);
    let file = std::fs::read(&path).unwrap();
    std::fs::write(&path, &file[..HEADER_BYTES + 8192]).unwrap();
    let short = store.read_placed(hash, placed_dest(&memory, at)).await;
    assert!(matches!(short, Err(ChunkStoreError::Corrupt { .. })), "{short:?}");
    let mut renamed = file.clone();
    renamed[40] ^= 1;
    std::fs::write(&path, &renamed).unwrap();
    let other = store.read_placed(hash, placed_dest(&memory, at)).await;
    assert!(matches!(other, Err(ChunkStoreError::Corrupt { .. })), "{other:?}");
    std::fs::write(&path, &file[..100]).unwrap();
    let headless = store.read_placed(hash, placed_dest(&memory, at)).await;
    assert!(matches!(headless, Err(ChunkStoreError::Corrupt { .. })), "{headless:?}");

    // O_DIRECT needs aligned memory: anything else is refused before it reaches the device.
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(&memory) as _;
    // SAFETY: never used (refused).
    assert!(unsafe { ExternalBuf::new(at.add(512), 4096, Arc::clone(&owner)) }.is_err());
    assert!(unsafe { ExternalBuf::new(at, 4000, owner) }.is_err());
}

/// Memory outside the store holding `data`'s whole blocks (as a client's staging memory holds a
/// staged chunk), and a placed write of `data` from it whose verification hashes that memory
/// after `change_before_hash` has had its way with it (a client changing it meanwhile).
fn placed_chunk(data: &[u8], change_before_hash: impl FnOnce(*mut u8) + Send + 'static) -> ChunkWrite {
    let body_len = data.len() - data.len() % ALIGN;
    let (memory, at) = outside(body_len.max(ALIGN));
    // SAFETY: `memory` holds at least `body_len` bytes at `at`, not yet shared with the device.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, body_len) };
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(&memory) as _;
    // SAFETY: as in `placed_dest`; the device only reads it.
    let body = unsafe { ExternalBuf::new(at, body_len, owner) }.unwrap();
    let at = at as usize;
    let rehash: PlacedHasher = Box::new(move || {
        change_before_hash(at as *mut u8);
        // SAFETY: `memory` (moved here) holds `body_len` bytes at `at`; the device is done.
        let blocks = unsafe { std::slice::from_raw_parts(at as *const u8, body_len) };
        let mut hasher = blake3::Hasher::new();
        hasher.update(blocks);
        drop(memory);
        Ok(hasher)
    });
    let mut write = ChunkStore::placed_write(data.len(), body, rehash).unwrap();
    assert_eq!((write.len(), write.data().len()), (data.len(), data.len() - body_len));
    write.data_mut().copy_from_slice(&data[body_len..]);
    write
}

async fn put_placed(store: &ChunkStore, data: &[u8]) -> Result<PutOutcome, ChunkStoreError> {
    store.put(ChunkHash::of(data), placed_chunk(data, |_| {})).await
}

/// Chunks whose whole blocks the device writes from outside memory (a trusted client's staging
/// memory): stored byte for byte, header and zero-padded tail included, into new files and into
/// reused ones; refused, and nothing stored, when the memory changed before the check (what the
/// device wrote is then not known to be the chunk), or the payload claims an encoding.
async fn placed_writes(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    for (i, len) in [4096usize, 4097, 8191, 300_000, 300 * 1024].into_iter().enumerate() {
        let data = random(len, 60 + i as u64);
        assert_eq!(put_placed(&store, &data).await.unwrap(), PutOutcome::Stored, "len {len}");
        let hash = ChunkHash::of(&data);
        assert_eq!(&store.get(hash, 0, 0).await.unwrap().bytes[..], &data[..], "len {len}");
        assert_eq!(store.check_copy(hash).await.unwrap(), Copy::Good { length: len as u64 }, "len {len}");
        let file = std::fs::read(store.chunk_path(&hash)).unwrap();
        assert_eq!(file.len(), round_up(HEADER_BYTES + len), "len {len}");
        assert!(file[HEADER_BYTES + len..].iter().all(|&b| b == 0), "zero padding, len {len}");
        assert_eq!(put_placed(&store, &data).await.unwrap(), PutOutcome::AlreadyPresent);
    }
    assert_eq!(store.stats().placed_writes, 5);

    // Into a reused file (`freepool.rs`): overwritten in place, all of it.
    store.set_free_pool(FreePoolConfig { max_bytes: 1 << 20, reuse_after: Duration::ZERO }).await.unwrap();
    let old = random(60_000, 70);
    let (old_hash, _) = put(&store, &old).await;
    let file = inode(&store.chunk_path(&old_hash));
    store.delete(vec![old_hash], None).await.unwrap();
    let new = random(57_345, 71);
    assert_eq!(put_placed(&store, &new).await.unwrap(), PutOutcome::Stored);
    let hash = ChunkHash::of(&new);
    assert_eq!(inode(&store.chunk_path(&hash)), file, "reused");
    assert_eq!(&store.get(hash, 0, 0).await.unwrap().bytes[..], &new[..]);
    assert_eq!(store.check_copy(hash).await.unwrap(), Copy::Good { length: new.len() as u64 });

    // Memory the client changed (before, while or after the device read it, before the check):
    // refused, and nothing stored under the chunk's name; not counted as placed.
    let data = random(20_000, 72);
    let changed = placed_chunk(&data, |at| {
        // SAFETY: within the chunk's blocks, which the test's memory holds.
        unsafe { *at.add(5000) ^= 1 }
    });
    let refused = store.put(ChunkHash::of(&data), changed).await;
    assert!(matches!(refused, Err(ChunkStoreError::HashMismatch { .. })), "{refused:?}");
    assert!(store.chunk_path(&ChunkHash::of(&data)).metadata().is_err());
    assert_eq!(store.stats().placed_writes, 6);
    // Claimed to be encoded: refused before anything is written.
    let mut encoded = placed_chunk(&data[..16_384], |_| {});
    encoded.set_codec(Codec::Zstd, 40_000);
    let refused = store.put(ChunkHash::of(&data[..16_384]), encoded).await;
    assert!(matches!(refused, Err(ChunkStoreError::Undecodable { .. })), "{refused:?}");
    assert!(store.chunk_path(&ChunkHash::of(&data[..16_384])).metadata().is_err());
    // Placed blocks that are not whole blocks of the chunk: refused when the write is made.
    let (memory, at) = outside(16_384);
    let none = || -> PlacedHasher { Box::new(|| Ok(blake3::Hasher::new())) };
    assert!(ChunkStore::placed_write(16_384 + ALIGN, placed_dest(&memory, at), none()).is_err(), "a block short");
    assert!(ChunkStore::placed_write(16_383, placed_dest(&memory, at), none()).is_err(), "more than the chunk");
}

/// A tenant's chunks (`starckpt_proto::address`): stored under their keyed address, checked
/// against the content hash their name carries (held, compressed and placed writes alike), kept as
/// format version 3 with the stored bytes' hash, so the scrub checks them without the tenant's
/// key; the same bytes' plain chunk is another chunk.
async fn tenant_chunks(kind: EngineKind) {
    use starckpt_proto::{Addressing, ChunkName, TenantName};
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let acme = Addressing::tenant(None, &TenantName::try_from("acme").unwrap());
    let data = random(70_000, 80);
    let name = acme.name(ChunkHash::of(&data));
    let held = |bytes: &[u8]| {
        let bytes = bytes.to_vec();
        let store = &store;
        async move {
            let mut write = store.write_buffer(bytes.len()).await;
            write.data_mut().copy_from_slice(&bytes);
            write
        }
    };
    // Bytes that are not the named content: refused, nothing stored.
    let refused = store.put_named(&name, held(&random(70_000, 81)).await).await;
    assert!(matches!(refused, Err(ChunkStoreError::HashMismatch { .. })), "{refused:?}");
    assert!(store.chunk_path(&name.address).metadata().is_err());
    assert_eq!(store.put_named(&name, held(&data).await).await.unwrap(), PutOutcome::Stored);
    let path = store.chunk_path(&name.address);
    let file = std::fs::read(&path).unwrap();
    assert_eq!(u16::from_le_bytes([file[8], file[9]]), FORMAT_VERSION_KEYED);
    assert_eq!(&store.get(name.address, 0, 0).await.unwrap().bytes[..], &data[..]);
    assert_eq!(store.check_copy(name.address).await.unwrap(), Copy::Good { length: data.len() as u64 });
    assert_eq!(store.has(vec![name.address, name.content]).await.unwrap(), vec![true, false]);
    assert_eq!(store.put_named(&name, held(&data).await).await.unwrap(), PutOutcome::AlreadyPresent);
    assert_eq!(store.repair_named(&name, held(&data).await).await.unwrap(), PutOutcome::AlreadyPresent);
    // Rot is found by the stored hash, and read repair replaces the copy.
    let mut rotten = file.clone();
    rotten[HEADER_BYTES + 7] ^= 0x40;
    std::fs::write(&path, &rotten).unwrap();
    assert!(matches!(store.check_copy(name.address).await.unwrap(), Copy::Bad { .. }));
    assert_eq!(store.repair_named(&name, held(&data).await).await.unwrap(), PutOutcome::Stored);
    assert_eq!(std::fs::read(&path).unwrap(), file);
    drop(store);
    let store = self::store(kind, dir.path()).await;
    assert_eq!(&store.get(name.address, 0, 0).await.unwrap().bytes[..], &data[..], "survives a restart");
    // The plain chunk of the same bytes is another chunk, in format version 1.
    let (plain, _) = put(&store, &data).await;
    let file = std::fs::read(store.chunk_path(&plain)).unwrap();
    assert_eq!(u16::from_le_bytes([file[8], file[9]]), FORMAT_VERSION);

    // Compressed: decoded and checked against the content hash, kept encoded.
    let floats: Vec<u8> =
        (0..150_000u32).flat_map(|i| (((i % 512) as f32 * 1e-4).to_bits() >> 16).to_le_bytes()[..2].to_vec()).collect();
    let packed = codec::compress(&floats, &codec::CompressConfig::default()).expect("compresses");
    let name = acme.name(ChunkHash::of(&floats));
    let wrong = ChunkName { content: ChunkHash::of(&floats[1..]), ..name };
    let refused = store.put_named(&wrong, packed_write(&store, &packed, floats.len()).await).await;
    assert!(matches!(refused, Err(ChunkStoreError::HashMismatch { .. })), "{refused:?}");
    let stored = store.put_named(&name, packed_write(&store, &packed, floats.len()).await).await;
    assert_eq!(stored.unwrap(), PutOutcome::Stored);
    let file = std::fs::read(store.chunk_path(&name.address)).unwrap();
    assert_eq!(u16::from_le_bytes([file[8], file[9]]), FORMAT_VERSION_KEYED);
    let whole = store.get(name.address, 0, 0).await.unwrap();
    assert_eq!((whole.codec, &whole.bytes[..]), (packed.codec, &packed.bytes[..]));
    assert_eq!(&store.get(name.address, 5, 100).await.unwrap().bytes[..], &floats[5..105]);
    assert_eq!(store.check_copy(name.address).await.unwrap(), Copy::Good { length: packed.bytes.len() as u64 });

    // Placed: checked against the content hash once the device wrote it.
    let data = random(300_000, 82);
    let name = acme.name(ChunkHash::of(&data));
    let wrong = ChunkName { content: ChunkHash::of(b"else"), ..name };
    let refused = store.put_named(&wrong, placed_chunk(&data, |_| {})).await;
    assert!(matches!(refused, Err(ChunkStoreError::HashMismatch { .. })), "{refused:?}");
    assert!(store.chunk_path(&name.address).metadata().is_err());
    assert_eq!(store.put_named(&name, placed_chunk(&data, |_| {})).await.unwrap(), PutOutcome::Stored);
    assert_eq!(&store.get(name.address, 0, 0).await.unwrap().bytes[..], &data[..]);
    assert_eq!(store.check_copy(name.address).await.unwrap(), Copy::Good { length: data.len() as u64 });
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().ino()
}

async fn reuses_deleted_chunk_files(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let pool = |max_bytes, reuse_after| FreePoolConfig { max_bytes, reuse_after };
    store.set_free_pool(pool(1 << 20, Duration::ZERO)).await.unwrap();
    // A chunk file of 64 KiB (header + 60,000 bytes, padded), deleted: kept, not counted used.
    let a = random(60_000, 1);
    let (hash_a, _) = put(&store, &a).await;
    let file_a = inode(&store.chunk_path(&hash_a));
    assert_eq!(store.delete(vec![hash_a], None).await.unwrap(), 1);
    let stats = store.stats();
    assert_eq!((stats.used_bytes, stats.chunk_count, stats.free_pool_bytes), (0, 0, 65536));
    assert!(matches!(store.get(hash_a, 0, 0).await, Err(ChunkStoreError::NotFound { .. })));
    assert!(!store.has(vec![hash_a]).await.unwrap()[0]);

    // A chunk whose file has the same size overwrites that file: all of it, no old byte left.
    let b = random(61_000, 2);
    let (hash_b, outcome) = put(&store, &b).await;
    assert_eq!(outcome, PutOutcome::Stored);
    assert_eq!(inode(&store.chunk_path(&hash_b)), file_a);
    let stats = store.stats();
    assert_eq!((stats.used_bytes, stats.chunk_count, stats.free_pool_bytes, stats.reused_files), (65536, 1, 0, 1));
    assert_eq!(&store.get(hash_b, 0, 0).await.unwrap().bytes[..], &b[..]);
    assert_eq!(store.check_copy(hash_b).await.unwrap(), Copy::Good { length: 61_000 });
    // Another size gets a new file.
    let c = random(100, 3);
    let (hash_c, _) = put(&store, &c).await;
    assert_ne!(inode(&store.chunk_path(&hash_c)), file_a);

    // Not reused before the delay (a reader may still hold the file open).
    store.set_free_pool(pool(1 << 20, Duration::from_secs(3600))).await.unwrap();
    assert_eq!(store.delete(vec![hash_b], None).await.unwrap(), 1);
    let d = random(59_000, 4);
    let (hash_d, _) = put(&store, &d).await;
    assert_ne!(inode(&store.chunk_path(&hash_d)), file_a);
    assert_eq!(store.stats().free_pool_bytes, 65536);

    // After a restart every free file is reusable at once.
    drop(store);
    let store = self::store(kind, dir.path()).await;
    store.set_free_pool(pool(1 << 20, Duration::from_secs(3600))).await.unwrap();
    assert_eq!(store.stats().free_pool_bytes, 65536);
    assert_eq!(store.stats().chunk_count, 2);
    let e = random(60_500, 5);
    let (hash_e, _) = put(&store, &e).await;
    assert_eq!(inode(&store.chunk_path(&hash_e)), file_a);
    for (hash, data) in [(hash_c, &c), (hash_d, &d), (hash_e, &e)] {
        assert_eq!(&store.get(hash, 0, 0).await.unwrap().bytes[..], &data[..]);
        assert!(matches!(store.check_copy(hash).await.unwrap(), Copy::Good { .. }));
    }

    // The cap: beyond it deleted files are unlinked; lowering it drops free files.
    store.set_free_pool(pool(65536, Duration::ZERO)).await.unwrap();
    assert_eq!(store.delete(vec![hash_c, hash_d, hash_e], None).await.unwrap(), 3);
    // Each file displaces the older one (none is of the store's own chunk file size, 68 KiB
    // here, which an odd size would never displace): e's is kept.
    assert_eq!(store.stats().free_pool_bytes, 65536);
    store.set_free_pool(pool(0, Duration::ZERO)).await.unwrap();
    assert_eq!(store.stats().free_pool_bytes, 0);
    assert_eq!(std::fs::read_dir(dir.path().join("free")).unwrap().count(), 0);
}

async fn preallocates_free_files(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    // Files of one pool buffer: a header and a 64 KiB chunk here.
    let file = (HEADER_BYTES + 65536) as u64;
    store.set_free_pool(FreePoolConfig { max_bytes: 4 * file, reuse_after: Duration::from_secs(3600) }).await.unwrap();
    // Up to the cap.
    assert_eq!(store.preallocate(1 << 30).await.unwrap(), 4 * file);
    assert_eq!(store.stats().free_pool_bytes, 4 * file);
    assert_eq!(store.preallocate(1 << 30).await.unwrap(), 0, "already full");
    let free: Vec<u64> =
        std::fs::read_dir(dir.path().join("free")).unwrap().map(|entry| inode(&entry.unwrap().path())).collect();
    // Full-size chunks are written into them, and read back intact.
    for seed in 0..4 {
        let data = random(65536, seed);
        let (hash, outcome) = put(&store, &data).await;
        assert_eq!(outcome, PutOutcome::Stored);
        assert!(free.contains(&inode(&store.chunk_path(&hash))));
        assert_eq!(&store.get(hash, 0, 0).await.unwrap().bytes[..], &data[..]);
    }
    let stats = store.stats();
    assert_eq!((stats.free_pool_bytes, stats.reused_files, stats.chunk_count), (0, 4, 4));
}

/// Writes holding every pool buffer (slow uploads waiting on their payloads) do not hold up reads.
async fn reads_never_wait_for_writes(kind: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(kind, dir.path()).await;
    let data = random(10_000, 80);
    let (hash, _) = put(&store, &data).await;
    let mut held = Vec::new();
    while let Some(buf) = store.buffer_pool().try_acquire() {
        held.push(buf);
    }
    assert!(!held.is_empty());
    // A hang guard, not a timing: the read must not wait for a write to give a buffer back.
    let read = tokio::time::timeout(Duration::from_secs(60), store.get(hash, 0, 0)).await;
    assert_eq!(&read.expect("a read waited for the writes' buffers").unwrap().bytes[..], &data[..]);
}

macro_rules! suite {
    ($engine:ident, $kind:expr) => {
        mod $engine {
            use super::*;
            #[tokio::test]
            async fn round_trip() {
                round_trip_sizes($kind).await
            }
            #[tokio::test]
            async fn dedup() {
                dedup_has_delete($kind).await
            }
            #[tokio::test]
            async fn bad_input() {
                rejects_bad_input($kind).await
            }
            #[tokio::test]
            async fn corruption_and_restart() {
                detects_corruption_and_survives_restart($kind).await
            }
            #[tokio::test]
            async fn list_and_guarded_delete() {
                list_pages_and_guarded_delete($kind).await
            }
            #[tokio::test]
            async fn verify_and_repair() {
                verify_and_repair_replace_only_bad_copies($kind).await
            }
            #[tokio::test]
            async fn placed() {
                placed_reads($kind).await
            }
            #[tokio::test]
            async fn placed_write() {
                placed_writes($kind).await
            }
            #[tokio::test]
            async fn compressed() {
                compressed_chunks($kind).await
            }
            #[tokio::test]
            async fn tenants() {
                tenant_chunks($kind).await
            }
            #[tokio::test]
            async fn reuse_deleted_files() {
                reuses_deleted_chunk_files($kind).await
            }
            #[tokio::test]
            async fn preallocate() {
                preallocates_free_files($kind).await
            }
            #[tokio::test]
            async fn reads_beside_writes() {
                reads_never_wait_for_writes($kind).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_puts() {
                concurrent_puts_of_one_chunk($kind).await
            }
        }
    };
}
suite!(uring, EngineKind::Uring);
suite!(std_io, EngineKind::Std);

/// Where the kernel has a table of registered files for the ring to open into (5.19), the engine
/// uses it: the conformance suite's `uring` runs cover that path, `uring_without_registered_files`
/// the other.
#[tokio::test]
async fn uring_opens_files_into_the_ring_where_the_kernel_can() {
    use crate::chunkserver::engine::UringEngine;
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut numbers = release.trim().split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    let engine = UringEngine::start(4).unwrap();
    if version >= (5, 19) {
        assert!(engine.registered_files(), "kernel {release}");
    }
}

/// The io_uring engine opening files with a syscall (kernels without registered files, before
/// 5.19) rather than into the ring's file table: the same round trips, split reads and errors.
#[tokio::test]
async fn uring_without_registered_files() {
    use crate::chunkserver::engine::{FIXED_BUFFERS, UringEngine};
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(UringEngine::start_with(4, FIXED_BUFFERS, false).unwrap());
    assert!(!engine.registered_files());
    let store = ChunkStore::open(dir.path(), engine, 64 * 1024, 4).await.unwrap();
    for (i, len) in [1usize, 4097, 65536, 300_001].into_iter().enumerate() {
        let data = random(len, 60 + i as u64);
        let (hash, outcome) = put(&store, &data).await;
        assert_eq!(outcome, PutOutcome::Stored);
        assert_eq!(&store.get(hash, 0, 0).await.unwrap().bytes[..], &data[..]);
    }
    let (memory, at) = outside(64 * 1024);
    let data = random(5000, 70);
    let (hash, _) = put(&store, &data).await;
    assert!(store.read_placed(hash, placed_dest(&memory, at)).await.unwrap().is_some());
    // SAFETY: the read completed; `memory` is alive.
    assert_eq!(unsafe { std::slice::from_raw_parts(at, data.len()) }, &data[..]);
    assert!(matches!(store.get(ChunkHash::of(b"absent"), 0, 0).await, Err(ChunkStoreError::NotFound { .. })));
}

#[tokio::test]
async fn uring_registers_pool_buffers_once_and_moves_others_unregistered() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(EngineKind::Uring, dir.path()).await;
    // Pool-sized chunks (the pool has 4 buffers of 64 KiB) use fixed buffers; a chunk larger
    // than a pool buffer gets a one-off buffer, which is never registered.
    let mut stored = Vec::new();
    for seed in 0..12 {
        let data = random(60_000, seed);
        stored.push((put(&store, &data).await.0, data));
    }
    let registered = store.engine.fixed_buffers();
    assert!((1..=4).contains(&registered), "{registered} buffers registered");
    let big = random(300_001, 99);
    stored.push((put(&store, &big).await.0, big));
    for (hash, data) in &stored {
        assert_eq!(&store.read(*hash, 0, 0, false).await.unwrap().bytes[..], &data[..]);
    }
    assert_eq!(store.engine.fixed_buffers(), registered, "one-off buffers are not registered");
}

/// A fan-out directory that cannot be listed and a chunk file that cannot be stat'ed: a listing
/// others act on fails, the scrubber's listing leaves them out, reports each once, and goes on.
#[tokio::test]
async fn listing_past_unreadable_parts_of_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(EngineKind::Std, dir.path()).await;
    let mut hashes = Vec::new();
    for seed in 0..8 {
        hashes.push(put(&store, &random(3000, 200 + seed)).await.0);
    }
    // The first chunk's directory becomes a file: listing it fails (ENOTDIR).
    let chunks = dir.path().join("chunks");
    let bad_dir = chunks.join(format!("{:02x}", hashes[0].0[0]));
    let lost: Vec<ChunkHash> = hashes.iter().copied().filter(|h| h.0[0] == hashes[0].0[0]).collect();
    std::fs::rename(&bad_dir, dir.path().join("moved-aside")).unwrap();
    std::fs::write(&bad_dir, b"not a directory").unwrap();
    // A chunk name in another directory that loops on itself: stat'ing it fails (ELOOP).
    let byte = (0..=255u8).find(|b| *b != hashes[0].0[0]).unwrap();
    let mut looped = ChunkHash([byte; 32]);
    looped.0[1] = 0;
    let looped_path = chunks.join(format!("{byte:02x}")).join(looped.to_hex());
    std::os::unix::fs::symlink(&looped_path, &looped_path).unwrap();

    assert!(matches!(store.list(None, 100).await, Err(ChunkStoreError::Io { op: "list" | "stat", .. })));
    let (mut listed, mut errors, mut after) = (Vec::new(), Vec::new(), None);
    loop {
        let (page, complete, unreadable) = store.list_past_unreadable(after, 2).await.unwrap();
        after = page.last().map(|c| c.hash).or(after);
        listed.extend(page.into_iter().map(|c| c.hash));
        errors.extend(unreadable);
        if complete {
            break;
        }
    }
    let mut readable: Vec<ChunkHash> = hashes.iter().copied().filter(|h| !lost.contains(h)).collect();
    readable.sort();
    assert_eq!(listed, readable);
    let errors: Vec<(&str, PathBuf)> = errors
        .into_iter()
        .map(|e| match e {
            ChunkStoreError::Io { op, path, .. } => (op, path),
            other => panic!("{other}"),
        })
        .collect();
    let mut expected = vec![("list", bad_dir), ("stat", looped_path)];
    expected.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(errors, expected);
}
