//! Micro-benchmarks of the data path's parts, each reported as throughput so it reads against the
//! machine's limits (../shared/MACHINE.md: BLAKE3 ~2.7 GB/s per core, O_DIRECT write ~1.5 GB/s):
//!
//! - `hash`: a chunk's BLAKE3 at several chunk sizes, and a tenant's chunk address (the keyed
//!   hash of that) of a 4 MiB chunk;
//! - `chunk_and_hash`: a 64 MiB staged buffer cut into 4 MiB chunks and hashed, on one thread and
//!   on two (the client hashes chunks concurrently);
//! - `compress` / `decompress`: the chunk codec on 4 MiB chunks of bf16 weights, fp32 Adam state
//!   (synthetic, like `starckpt bench`'s) and random bytes (the sample rejects them: the cost of
//!   trying); `benches/compression_vs_zipnn.py` compares it with ZipNN on real weights;
//! - `frame`: the data-plane frame codec, header alone and a whole PUT frame of 4 MiB through an
//!   in-memory pipe (writer and reader);
//! - `store_put` / `store_get`: the target's chunk store with each I/O engine (io_uring and
//!   blocking std I/O, both O_DIRECT), durable puts of 4 MiB chunks (into new files, and into
//!   deleted chunks' files: the free pool) and verified-header gets.
//!
//! `cargo bench -p starckpt-benches` (add `-- hash` to run one group).
#![allow(clippy::unwrap_used, clippy::expect_used)] // benchmarks: a failure is a bug to see

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rand::{RngCore, SeedableRng};
use starckpt_proto::frame::{FIXED_HEADER_BYTES, FrameHeader, Opcode, read_frame_head, write_frame};
use starckpt_proto::{Addressing, ChunkHash, TenantName};
use starckpt_server::chunkserver::EngineKind;
use starckpt_server::chunkserver::engine::{FIXED_BUFFERS, IoEngine, UringEngine, open_engine};
use starckpt_server::chunkserver::freepool::FreePoolConfig;
use starckpt_server::chunkserver::store::ChunkStore;
use tokio::io::AsyncReadExt;

const CHUNK: usize = 4 << 20;

fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut out);
    out
}

fn hash(c: &mut Criterion) {
    let mut group = c.benchmark_group("hash");
    for size in [64 << 10, 1 << 20, CHUNK] {
        let data = random(size, 1);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::from_parameter(size), &data, |b, data| {
            b.iter(|| ChunkHash::of(black_box(data)));
        });
    }
    // A tenant's chunk address (starckpt_proto::address): the plain hash, then the tenant key's
    // hash of it; against `hash/4194304`, the cost of keeping deduplication within tenants.
    let data = random(CHUNK, 1);
    let acme = Addressing::tenant(None, &TenantName::try_from("acme").unwrap());
    group.bench_with_input(BenchmarkId::new("tenant", CHUNK), &data, |b, data| {
        b.iter(|| acme.address(&ChunkHash::of(black_box(data))));
    });
    group.finish();
}

fn chunk_and_hash(c: &mut Criterion) {
    let staged = random(64 << 20, 2);
    let mut group = c.benchmark_group("chunk_and_hash");
    group.throughput(Throughput::Bytes(staged.len() as u64));
    group.sample_size(20);
    for threads in [1usize, 2] {
        group.bench_with_input(BenchmarkId::new("threads", threads), &threads, |b, &threads| {
            b.iter(|| {
                let chunks: Vec<&[u8]> = staged.chunks(CHUNK).collect();
                let per_thread = chunks.len().div_ceil(threads);
                std::thread::scope(|scope| {
                    let workers: Vec<_> = chunks
                        .chunks(per_thread)
                        .map(|mine| scope.spawn(move || mine.iter().map(|c| ChunkHash::of(c)).collect::<Vec<_>>()))
                        .collect();
                    workers.into_iter().flat_map(|w| w.join().unwrap()).collect::<Vec<_>>()
                })
            });
        });
    }
    group.finish();
}

/// 4 MiB of float bytes like a layer's: bf16 weights, or fp32 weights/moments.
fn floats(bf16: bool, seed: u64) -> Vec<u8> {
    use rand::Rng;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(CHUNK);
    while out.len() < CHUNK {
        // Sum of uniforms: roughly normal, sigma ~0.02.
        let value = (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * 0.035;
        if bf16 {
            out.extend_from_slice(&((value.to_bits() >> 16) as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    out
}

fn compression(c: &mut Criterion) {
    use starckpt_proto::codec::{CompressConfig, compress, decompress_into};
    let config = CompressConfig::default();
    let inputs = [("bf16", floats(true, 5)), ("fp32", floats(false, 6)), ("random", random(CHUNK, 7))];
    let mut group = c.benchmark_group("compress");
    group.throughput(Throughput::Bytes(CHUNK as u64));
    for (name, data) in &inputs {
        group.bench_with_input(BenchmarkId::from_parameter(name), data, |b, data| {
            b.iter(|| compress(black_box(data), &config));
        });
    }
    group.finish();
    let mut group = c.benchmark_group("decompress");
    group.throughput(Throughput::Bytes(CHUNK as u64));
    for (name, data) in &inputs[..2] {
        let packed = compress(data, &config).expect("floats compress");
        let mut out = vec![0u8; CHUNK];
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| decompress_into(packed.codec, black_box(&packed.bytes), &mut out).unwrap());
        });
    }
    group.finish();
}

fn frame(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut group = c.benchmark_group("frame");
    let header = FrameHeader { opcode: Opcode::Put, request_id: 42, header_len: 70, payload_len: CHUNK as u32 };
    group.throughput(Throughput::Elements(1));
    group.bench_function("header_encode_decode", |b| {
        b.iter(|| {
            let bytes: [u8; FIXED_HEADER_BYTES] = black_box(&header).encode();
            FrameHeader::decode(black_box(&bytes)).unwrap()
        });
    });
    let payload = Bytes::from(random(CHUNK, 3));
    let prost_header = vec![7u8; 70];
    group.throughput(Throughput::Bytes(CHUNK as u64));
    group.bench_function("put_frame_4MiB_through_a_pipe", |b| {
        b.to_async(&runtime).iter(|| {
            let (payload, prost_header) = (payload.clone(), prost_header.clone());
            async move {
                let (mut writer, mut reader) = tokio::io::duplex(1 << 20);
                let send = tokio::spawn(async move {
                    write_frame(&mut writer, Opcode::Put, 1, &prost_header, &[payload]).await.unwrap();
                });
                let (head, _) = read_frame_head(&mut reader).await.unwrap();
                let mut body = vec![0u8; head.payload_len as usize];
                reader.read_exact(&mut body).await.unwrap();
                send.await.unwrap();
                body
            }
        });
    });
    group.finish();
}

/// The engines compared: io_uring with the store's buffers registered (fixed) and its files opened
/// by the ring into its file table, the same with files opened by a syscall (`UringOpened`, as
/// before Linux 5.19), without fixed buffers (every operation pins its buffer), and blocking std
/// I/O; each chunk into a new file. And io_uring writing chunks into the files of deleted ones (the
/// free pool: `UringReused`, puts only).
const ENGINES: [&str; 5] = ["Uring", "UringOpened", "UringReused", "UringUnfixed", "Std"];

/// A store on the machine's disk (TMPDIR), with `engine` (one of [`ENGINES`]).
fn open_store(runtime: &tokio::runtime::Runtime, engine: &str) -> (tempfile::TempDir, Arc<ChunkStore>) {
    let dir = tempfile::tempdir().unwrap();
    let reuse = engine == "UringReused";
    let store = runtime.block_on(async {
        let engine: Arc<dyn IoEngine> = match engine {
            "Uring" | "UringReused" => open_engine(EngineKind::Uring, 16).unwrap(),
            "UringOpened" => Arc::new(UringEngine::start_with(16, FIXED_BUFFERS, false).unwrap()),
            "UringUnfixed" => Arc::new(UringEngine::start_with(16, 0, true).unwrap()),
            _ => open_engine(EngineKind::Std, 16).unwrap(),
        };
        let store = ChunkStore::open(dir.path(), engine, CHUNK, 16).await.unwrap();
        // Each sample's chunks are deleted after it: into the free pool for the next sample's
        // to overwrite, or unlinked (every put allocates a new file).
        let max_bytes = if reuse { 4 << 30 } else { 0 };
        store.set_free_pool(FreePoolConfig { max_bytes, reuse_after: Duration::ZERO }).await.unwrap();
        store
    });
    (dir, Arc::new(store))
}

fn store(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let data = random(CHUNK, 4);
    let mut group = c.benchmark_group("store_put");
    group.throughput(Throughput::Bytes(CHUNK as u64));
    group.sample_size(10).measurement_time(Duration::from_secs(8));
    for engine in ENGINES {
        let (_dir, store) = open_store(&runtime, engine);
        let mut counter = 0u64;
        group.bench_function(engine, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    // Distinct chunks (a counter in the first bytes), each a durable new file; 4 in
                    // flight, as a target serves several writers.
                    let mut chunks = Vec::with_capacity(iters as usize);
                    for _ in 0..iters {
                        counter += 1;
                        let mut chunk = data.clone();
                        chunk[..8].copy_from_slice(&counter.to_le_bytes());
                        chunks.push(chunk);
                    }
                    let hashes: Vec<ChunkHash> = chunks.iter().map(|c| ChunkHash::of(c)).collect();
                    let started = Instant::now();
                    let mut pending = spawn_puts(&store, &chunks, &hashes);
                    while let Some(result) = pending.join_next().await {
                        result.unwrap();
                    }
                    let elapsed = started.elapsed();
                    // Untimed: free the disk for the next sample.
                    store.delete(hashes, None).await.unwrap();
                    elapsed
                })
            });
        });
    }
    group.finish();

    let mut group = c.benchmark_group("store_get");
    group.throughput(Throughput::Bytes(CHUNK as u64));
    group.sample_size(10).measurement_time(Duration::from_secs(8));
    for engine in ENGINES.into_iter().filter(|&e| e != "UringReused") {
        let (_dir, store) = open_store(&runtime, engine);
        let hashes: Vec<ChunkHash> = runtime.block_on(async {
            let mut hashes = Vec::new();
            for i in 0..32u64 {
                let mut chunk = data.clone();
                chunk[..8].copy_from_slice(&i.to_le_bytes());
                let hash = ChunkHash::of(&chunk);
                let mut write = store.write_buffer(chunk.len()).await;
                write.data_mut().copy_from_slice(&chunk);
                store.put(hash, write).await.unwrap();
                hashes.push(hash);
            }
            hashes
        });
        let mut next = 0;
        group.bench_function(engine, |b| {
            b.to_async(&runtime).iter(|| {
                next = (next + 1) % hashes.len();
                let (store, hash) = (Arc::clone(&store), hashes[next]);
                async move { store.get(hash, 0, 0).await.unwrap() }
            });
        });
    }
    group.finish();
}

/// Puts `chunks` with at most 4 in flight.
fn spawn_puts(store: &Arc<ChunkStore>, chunks: &[Vec<u8>], hashes: &[ChunkHash]) -> tokio::task::JoinSet<()> {
    let mut set = tokio::task::JoinSet::new();
    let permits = Arc::new(tokio::sync::Semaphore::new(4));
    for (chunk, hash) in chunks.iter().zip(hashes) {
        let (store, chunk, hash, permits) = (Arc::clone(store), chunk.clone(), *hash, Arc::clone(&permits));
        set.spawn(async move {
            let _permit = permits.acquire_owned().await.unwrap();
            let mut write = store.write_buffer(chunk.len()).await;
            write.data_mut().copy_from_slice(&chunk);
            store.put(hash, write).await.unwrap();
        });
    }
    set
}

criterion_group!(benches, hash, chunk_and_hash, compression, frame, store);
criterion_main!(benches);
