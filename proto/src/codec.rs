//! Chunk codecs: lossless, per chunk, chosen by what the bytes are.
//!
//! A chunk's content address is always the BLAKE3 of its *uncompressed* bytes, so a chunk
//! deduplicates across codecs and every reader verifies the bytes it hands out, end to end. A
//! codec only changes what travels and what lies on the device.
//!
//! Model state is mostly floating point, where the bytes of one value are not alike: the exponent
//! (8 bits in bf16 and fp32) takes few distinct values in a tensor, the low mantissa bits are
//! noise. Plain zstd over interleaved bytes finds little; split into planes — every value's
//! exponent byte together, then each mantissa byte — the exponent plane compresses 2-3x and the
//! noise planes are stored as they are (the idea of ZipNN, Hershcovitch et al. 2024). Before the
//! split each value is rotated left by one bit, so the sign moves to the bottom and the exponent
//! fills the top byte exactly:
//!
//! ```text
//!  bf16  s eeeeeeee mmmmmmm            → eeeeeeee | mmmmmmm s           planes: [e] [m]
//!  fp32  s eeeeeeee mmmmmmm m{16}      → eeeeeeee | mmmmmmmm | m{8} | m{7} s   planes: [e] [m] [m] [m]
//! ```
//!
//! [`compress`] picks the element width (2 bytes, 4 bytes, or plain zstd) from a sample of the
//! chunk, compresses each plane that pays on its sample, and gives up — the chunk is stored as it
//! is — when the whole does not shrink by [`CompressConfig::min_ratio`]. Incompressible chunks
//! (random data, already-compressed files) cost one sample's compression, not a full pass.
//!
//! ## Stored formats
//!
//! - [`Codec::Zstd`]: one zstd frame of the whole chunk.
//!
//! A compressed plane (or a `Zstd` chunk) is one standard zstd frame, made either with matching
//! at the configured level or literal-only (entropy coding alone, better on exponent planes);
//! the sample decides which, per plane. Decoding does not need to know.
//! - [`Codec::Planes16`] / [`Codec::Planes32`] (element width `w` = 2 / 4): a table of `w`
//!   entries `(mode u8: 0 raw, 1 zstd; stored length u32 LE)`, then the planes' bytes in order,
//!   then the `len % w` trailing bytes of the chunk as they are. Plane `p` holds byte `w-1-p` of
//!   every rotated value (most significant first), `len / w` bytes uncompressed.
//!
//! Decoding checks every length against the chunk length it was given before trusting it: a
//! stored payload that does not decode to exactly that many bytes is an error, never a panic or
//! an over-read (the caller then verifies the hash).

use std::cell::RefCell;

use thiserror::Error;

/// How a chunk's bytes are stored. The wire value is the `starckpt.control.v1.Codec` enum, used
/// both in manifests and in data-plane frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Codec {
    #[default]
    None,
    Zstd,
    Planes16,
    Planes32,
}

impl Codec {
    pub const ALL: [Codec; 4] = [Codec::None, Codec::Zstd, Codec::Planes16, Codec::Planes32];

    pub fn to_wire(self) -> i32 {
        use crate::control::Codec as Pb;
        match self {
            Codec::None => Pb::None as i32,
            Codec::Zstd => Pb::Zstd as i32,
            Codec::Planes16 => Pb::ZstdPlanes16 as i32,
            Codec::Planes32 => Pb::ZstdPlanes32 as i32,
        }
    }

    pub fn from_wire(value: i32) -> Result<Codec, CodecError> {
        use crate::control::Codec as Pb;
        match Pb::try_from(value) {
            Ok(Pb::None) => Ok(Codec::None),
            Ok(Pb::Zstd) => Ok(Codec::Zstd),
            Ok(Pb::ZstdPlanes16) => Ok(Codec::Planes16),
            Ok(Pb::ZstdPlanes32) => Ok(Codec::Planes32),
            Err(_) => Err(CodecError::Unknown(value)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Zstd => "zstd",
            Codec::Planes16 => "zstd-planes16",
            Codec::Planes32 => "zstd-planes32",
        }
    }

    pub fn from_name(name: &str) -> Option<Codec> {
        Codec::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Element width of a plane codec.
    fn width(self) -> Option<usize> {
        match self {
            Codec::Planes16 => Some(2),
            Codec::Planes32 => Some(4),
            Codec::None | Codec::Zstd => None,
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CodecError {
    #[error("unknown codec {0}")]
    Unknown(i32),
    #[error("{codec} payload is malformed: {reason}")]
    Malformed { codec: Codec, reason: String },
}

fn malformed(codec: Codec, reason: impl Into<String>) -> CodecError {
    CodecError::Malformed { codec, reason: reason.into() }
}

/// When compression is worth it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompressConfig {
    /// zstd level. Default 1: on model state the ratio comes from the exponent planes, where
    /// higher levels gain < 1% and cost 2x the time.
    pub level: i32,
    /// A chunk (and a plane) is compressed only if it shrinks by at least this factor
    /// (uncompressed / stored). Default 1.05.
    pub min_ratio: f64,
}

impl Default for CompressConfig {
    fn default() -> Self {
        CompressConfig { level: 1, min_ratio: 1.05 }
    }
}

/// A chunk's stored form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compressed {
    pub codec: Codec,
    pub bytes: Vec<u8>,
}

/// Bytes sampled (from the middle of the chunk) to choose a codec and which planes to compress.
const SAMPLE_BYTES: usize = 128 * 1024;
/// Chunks smaller than this are not worth a codec.
const MIN_CHUNK_BYTES: usize = 4096;
const TABLE_ENTRY_BYTES: usize = 5;

thread_local! {
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static LITERALS: RefCell<Option<LiteralsCtx>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// zstd of `data` at `level` into `out` (appended), with this thread's reusable context.
fn zstd_into(data: &[u8], level: i32, out: &mut Vec<u8>) -> std::io::Result<usize> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|(l, _)| *l != level) {
            *slot = Some((level, zstd::bulk::Compressor::new(level)?));
        }
        let (_, compressor) = slot.as_mut().expect("set above");
        let start = out.len();
        out.resize(start + zstd::zstd_safe::compress_bound(data.len()), 0);
        let written = compressor.compress_to_buffer(data, &mut out[start..])?;
        out.truncate(start + written);
        Ok(written)
    })
}

/// A zstd compression context for literal-only frames (the safe wrapper does not expose
/// `ZSTD_compressSequences`).
struct LiteralsCtx(std::ptr::NonNull<zstd_sys::ZSTD_CCtx>);

impl Drop for LiteralsCtx {
    fn drop(&mut self) {
        // SAFETY: the context was created by ZSTD_createCCtx and is freed once, here.
        unsafe { zstd_sys::ZSTD_freeCCtx(self.0.as_ptr()) };
    }
}

use zstd::zstd_safe::zstd_sys;

/// A standard zstd frame of `data` (appended to `out`) in which every byte is a literal: no
/// matches, only zstd's per-block Huffman coding. On a plane of float exponents — a skewed byte
/// distribution with little repetition — it comes within ~1% of the order-0 entropy, where LZ
/// matching pays more for match headers than it saves (all-MiniLM-L6-v2 in bf16: exponent plane
/// 7.9 MB with level-1 matching, 7.5 MB literal-only). Any zstd decoder reads it.
fn literals_into(data: &[u8], level: i32, out: &mut Vec<u8>) -> std::io::Result<usize> {
    LITERALS.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            // SAFETY: plain constructor; null is checked.
            let ctx = std::ptr::NonNull::new(unsafe { zstd_sys::ZSTD_createCCtx() })
                .ok_or_else(|| std::io::Error::other("ZSTD_createCCtx failed"))?;
            *slot = Some(LiteralsCtx(ctx));
        }
        let ctx = slot.as_ref().expect("set above").0.as_ptr();
        let start = out.len();
        out.resize(start + zstd::zstd_safe::compress_bound(data.len()), 0);
        let capacity = out.len() - start;
        let empty: [zstd_sys::ZSTD_Sequence; 0] = [];
        // SAFETY: `ctx` is a live context owned by this thread; `out[start..]` is writable for
        // `capacity` bytes and `data` readable for its length; with no sequences, zstd reads the
        // whole source as literals (ZSTD_compressSequences' documented behaviour).
        let written = unsafe {
            let status =
                zstd_sys::ZSTD_CCtx_setParameter(ctx, zstd_sys::ZSTD_cParameter::ZSTD_c_compressionLevel, level);
            if zstd_sys::ZSTD_isError(status) != 0 {
                status
            } else {
                zstd_sys::ZSTD_compressSequences(
                    ctx,
                    out[start..].as_mut_ptr().cast(),
                    capacity,
                    empty.as_ptr(),
                    0,
                    data.as_ptr().cast(),
                    data.len(),
                )
            }
        };
        // SAFETY: ZSTD_isError and ZSTD_getErrorName take any size_t.
        if unsafe { zstd_sys::ZSTD_isError(written) } != 0 {
            out.truncate(start);
            let name = unsafe { std::ffi::CStr::from_ptr(zstd_sys::ZSTD_getErrorName(written)) };
            return Err(std::io::Error::other(format!("zstd: {}", name.to_string_lossy())));
        }
        out.truncate(start + written);
        Ok(written)
    })
}

/// How a plane is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PlaneMode {
    Raw,
    /// zstd with matching, at the configured level.
    Matched,
    /// zstd, literals only ([`literals_into`]).
    Literals,
}

fn encode_plane(mode: PlaneMode, plane: &[u8], level: i32, out: &mut Vec<u8>) -> std::io::Result<usize> {
    match mode {
        PlaneMode::Raw => {
            out.extend_from_slice(plane);
            Ok(plane.len())
        }
        PlaneMode::Matched => zstd_into(plane, level, out),
        PlaneMode::Literals => literals_into(plane, level, out),
    }
}

/// zstd-decompresses `data` into `out`, which it must fill exactly.
fn unzstd_into(codec: Codec, data: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new().map_err(|e| malformed(codec, e.to_string()))?);
        }
        let decompressor = slot.as_mut().expect("set above");
        let written = decompressor.decompress_to_buffer(data, out).map_err(|e| malformed(codec, e.to_string()))?;
        if written != out.len() {
            return Err(malformed(codec, format!("a zstd frame decoded to {written} bytes, expected {}", out.len())));
        }
        Ok(())
    })
}

/// Splits `data` (whole elements only) into `width` planes of rotated values, most significant
/// byte first, written back to back into `out` (which must be `data.len()` long).
fn split_planes(width: usize, data: &[u8], out: &mut [u8]) {
    let n = data.len() / width;
    debug_assert_eq!(out.len(), n * width);
    match width {
        2 => {
            let (high, low) = out.split_at_mut(n);
            for (i, value) in data.chunks_exact(2).enumerate() {
                let v = u16::from_le_bytes([value[0], value[1]]).rotate_left(1);
                high[i] = (v >> 8) as u8;
                low[i] = v as u8;
            }
        }
        4 => {
            let (p0, rest) = out.split_at_mut(n);
            let (p1, rest) = rest.split_at_mut(n);
            let (p2, p3) = rest.split_at_mut(n);
            for (i, value) in data.chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([value[0], value[1], value[2], value[3]]).rotate_left(1);
                let b = v.to_be_bytes();
                (p0[i], p1[i], p2[i], p3[i]) = (b[0], b[1], b[2], b[3]);
            }
        }
        _ => unreachable!("plane widths are 2 and 4"),
    }
}

/// Inverse of [`split_planes`].
fn join_planes(width: usize, planes: &[u8], out: &mut [u8]) {
    let n = planes.len() / width;
    match width {
        2 => {
            let (high, low) = planes.split_at(n);
            for (i, value) in out.chunks_exact_mut(2).enumerate() {
                let v = (u16::from(high[i]) << 8 | u16::from(low[i])).rotate_right(1);
                value.copy_from_slice(&v.to_le_bytes());
            }
        }
        4 => {
            let (p0, rest) = planes.split_at(n);
            let (p1, rest) = rest.split_at(n);
            let (p2, p3) = rest.split_at(n);
            for (i, value) in out.chunks_exact_mut(4).enumerate() {
                let v = u32::from_be_bytes([p0[i], p1[i], p2[i], p3[i]]).rotate_right(1);
                value.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => unreachable!("plane widths are 2 and 4"),
    }
}

/// What a codec would make of a sample: its stored size, and how to store each plane.
struct Trial {
    codec: Codec,
    stored: usize,
    modes: Vec<PlaneMode>,
}

/// A plane is compressed if that saves this much (uncompressed / stored), even when the chunk as a
/// whole must save [`CompressConfig::min_ratio`]: the high mantissa byte of trained fp32 weights
/// saves ~2% (all-MiniLM-L6-v2), a fifth of what the fp32 chunk saves beyond its exponents.
const PLANE_MIN_RATIO: f64 = 1.01;

/// The smallest way to store `plane`: matched or literal-only zstd, or raw when neither shrinks
/// it by `min_ratio`. Returns the mode and its size.
fn best_mode(plane: &[u8], level: i32, min_ratio: f64) -> std::io::Result<(PlaneMode, usize)> {
    let mut scratch = Vec::new();
    let mut best = (PlaneMode::Raw, plane.len());
    for mode in [PlaneMode::Literals, PlaneMode::Matched] {
        scratch.clear();
        let size = encode_plane(mode, plane, level, &mut scratch)?;
        if (plane.len() as f64) >= size as f64 * min_ratio && size < best.1 {
            best = (mode, size);
        }
    }
    Ok(best)
}

fn trial(codec: Codec, sample: &[u8], config: &CompressConfig) -> std::io::Result<Trial> {
    let Some(width) = codec.width() else {
        let (mode, stored) = best_mode(sample, config.level, config.min_ratio)?;
        return Ok(Trial { codec, stored, modes: vec![mode] });
    };
    let whole = sample.len() / width * width;
    let mut planes = vec![0u8; whole];
    split_planes(width, &sample[..whole], &mut planes);
    let plane_len = whole / width;
    let (mut stored, mut modes) = (0, Vec::with_capacity(width));
    for plane in planes.chunks_exact(plane_len.max(1)) {
        let (mode, size) = best_mode(plane, config.level, PLANE_MIN_RATIO.min(config.min_ratio))?;
        modes.push(mode);
        stored += size;
    }
    Ok(Trial { codec, stored, modes })
}

/// The chunk's stored form, or None when no codec shrinks it by `config.min_ratio` (store it as
/// it is). CPU-bound: call off the async runtime.
pub fn compress(data: &[u8], config: &CompressConfig) -> Option<Compressed> {
    if data.len() < MIN_CHUNK_BYTES {
        return None;
    }
    let sample = if data.len() <= SAMPLE_BYTES {
        data
    } else {
        let start = (data.len() / 2 - SAMPLE_BYTES / 2) & !7;
        &data[start..start + SAMPLE_BYTES]
    };
    let best = [Codec::Planes16, Codec::Planes32, Codec::Zstd]
        .into_iter()
        .filter_map(|codec| trial(codec, sample, config).ok())
        .min_by_key(|t| t.stored)?;
    if (sample.len() as f64) < best.stored as f64 * config.min_ratio {
        return None;
    }
    let bytes = match best.codec.width() {
        None => {
            let mut out = Vec::new();
            encode_plane(best.modes[0], data, config.level, &mut out).ok()?;
            out
        }
        Some(width) => encode_planes(width, data, &best.modes, config.level).ok()?,
    };
    ((data.len() as f64) >= bytes.len() as f64 * config.min_ratio).then_some(Compressed { codec: best.codec, bytes })
}

fn encode_planes(width: usize, data: &[u8], modes: &[PlaneMode], level: i32) -> std::io::Result<Vec<u8>> {
    let whole = data.len() / width * width;
    let plane_len = whole / width;
    let mut planes = vec![0u8; whole];
    split_planes(width, &data[..whole], &mut planes);
    let table = width * TABLE_ENTRY_BYTES;
    let mut out = vec![0u8; table];
    out.reserve(data.len());
    for (p, plane) in planes.chunks_exact(plane_len.max(1)).take(width).enumerate() {
        let start = out.len();
        let mode = if modes[p] == PlaneMode::Raw {
            out.extend_from_slice(plane);
            0
        } else {
            encode_plane(modes[p], plane, level, &mut out)?;
            // A plane that the sample judged wrongly is stored raw after all.
            if out.len() - start >= plane.len() {
                out.truncate(start);
                out.extend_from_slice(plane);
                0
            } else {
                1
            }
        };
        let len = u32::try_from(out.len() - start).map_err(std::io::Error::other)?;
        out[p * TABLE_ENTRY_BYTES] = mode;
        out[p * TABLE_ENTRY_BYTES + 1..(p + 1) * TABLE_ENTRY_BYTES].copy_from_slice(&len.to_le_bytes());
    }
    out.extend_from_slice(&data[whole..]);
    Ok(out)
}

/// Decodes `stored` (of `codec`) into `out`, which must be the chunk's uncompressed length and is
/// filled exactly. Malformed input is an error whatever its bytes.
pub fn decompress_into(codec: Codec, stored: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    let Some(width) = codec.width() else {
        return match codec {
            Codec::None if stored.len() == out.len() => {
                out.copy_from_slice(stored);
                Ok(())
            }
            Codec::None => Err(malformed(codec, format!("{} bytes for a {}-byte chunk", stored.len(), out.len()))),
            _ => unzstd_into(codec, stored, out),
        };
    };
    let whole = out.len() / width * width;
    let (plane_len, tail) = (whole / width, out.len() - whole);
    let table = width * TABLE_ENTRY_BYTES;
    if stored.len() < table + tail {
        return Err(malformed(codec, format!("{} bytes cannot hold the plane table and tail", stored.len())));
    }
    let (body, tail_bytes) = stored.split_at(stored.len() - tail);
    let mut planes = vec![0u8; whole];
    let mut at = table;
    for p in 0..width {
        let entry = &body[p * TABLE_ENTRY_BYTES..(p + 1) * TABLE_ENTRY_BYTES];
        let len = u32::from_le_bytes([entry[1], entry[2], entry[3], entry[4]]) as usize;
        let Some(bytes) = at.checked_add(len).and_then(|end| body.get(at..end)) else {
            return Err(malformed(codec, format!("plane {p} claims {len} bytes past the end")));
        };
        let dest = &mut planes[p * plane_len..(p + 1) * plane_len];
        match entry[0] {
            0 if len == plane_len => dest.copy_from_slice(bytes),
            0 => return Err(malformed(codec, format!("raw plane {p} is {len} bytes, expected {plane_len}"))),
            1 => unzstd_into(codec, bytes, dest)?,
            mode => return Err(malformed(codec, format!("plane {p} has unknown mode {mode}"))),
        }
        at += len;
    }
    if at != body.len() {
        return Err(malformed(codec, format!("{} bytes after the last plane", body.len() - at)));
    }
    join_planes(width, &planes, &mut out[..whole]);
    out[whole..].copy_from_slice(tail_bytes);
    Ok(())
}

/// [`decompress_into`] a new buffer of `length` bytes.
pub fn decompress(codec: Codec, stored: &[u8], length: usize) -> Result<Vec<u8>, CodecError> {
    if length > crate::frame::MAX_PAYLOAD_BYTES as usize {
        return Err(malformed(codec, format!("a {length}-byte chunk exceeds the chunk size limit")));
    }
    let mut out = vec![0u8; length];
    decompress_into(codec, stored, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};

    /// Values like a trained layer's: normal-ish around 0 with a small spread.
    fn floats(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| (rng.random::<f32>() - 0.5) * 0.04 + (rng.random::<f32>() - 0.5) * 0.01).collect()
    }

    fn fp32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn bf16_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
    }

    fn round_trip(data: &[u8]) -> Option<Compressed> {
        let compressed = compress(data, &CompressConfig::default());
        if let Some(c) = &compressed {
            assert_eq!(decompress(c.codec, &c.bytes, data.len()).unwrap(), data, "{}", c.codec);
        }
        compressed
    }

    #[test]
    fn float_planes_are_chosen_and_round_trip() {
        // Odd lengths leave a tail that is not a whole element.
        for extra in [0usize, 1, 3] {
            let mut bf16 = bf16_bytes(&floats(300_000, 1));
            bf16.extend(std::iter::repeat_n(7u8, extra));
            let c = round_trip(&bf16).expect("bf16 weights compress");
            // Either plane width isolates bf16 exponents (a 4-byte element is two bf16 values).
            assert!(matches!(c.codec, Codec::Planes16 | Codec::Planes32), "{}", c.codec);
            let plain = zstd::bulk::compress(&bf16, 1).unwrap();
            assert!(c.bytes.len() < plain.len(), "planes beat plain zstd: {} vs {}", c.bytes.len(), plain.len());
            assert!(c.bytes.len() * 10 < bf16.len() * 8, "bf16 ratio {}", bf16.len() as f64 / c.bytes.len() as f64);

            let mut fp32 = fp32_bytes(&floats(300_000, 2));
            fp32.extend(std::iter::repeat_n(9u8, extra));
            let c = round_trip(&fp32).expect("fp32 weights compress");
            assert_eq!(c.codec, Codec::Planes32);
        }
    }

    #[test]
    fn text_compresses_and_noise_is_left_alone() {
        let text: Vec<u8> = (0..200_000u32).flat_map(|i| format!("step {i} loss {}\n", i % 97).into_bytes()).collect();
        let c = round_trip(&text).unwrap();
        assert!(c.bytes.len() * 3 < text.len(), "text compresses 3x with {}", c.codec);
        let mut noise = vec![0u8; 1 << 20];
        rand::rngs::StdRng::seed_from_u64(3).fill_bytes(&mut noise);
        assert_eq!(round_trip(&noise), None);
        assert_eq!(round_trip(&[0u8; 100]), None, "below the minimum chunk size");
    }

    #[test]
    fn a_plane_of_noise_is_stored_raw() {
        // fp32 values whose low mantissa bytes are random: planes 2 and 3 must be raw (mode 0).
        let c = round_trip(&fp32_bytes(&floats(100_000, 4))).unwrap();
        let modes: Vec<u8> = (0..4).map(|p| c.bytes[p * TABLE_ENTRY_BYTES]).collect();
        assert_eq!(modes[0], 1, "the exponent plane compresses");
        assert_eq!(&modes[2..], &[0, 0], "noise planes stay raw");
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        let data = bf16_bytes(&floats(50_000, 5));
        let good = compress(&data, &CompressConfig::default()).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let mut out = vec![0u8; data.len()];
        // Truncations, bit flips, wrong lengths, and every codec over the others' bytes.
        for cut in [0, 1, 4, 9, good.bytes.len() / 2, good.bytes.len() - 1] {
            assert!(decompress_into(good.codec, &good.bytes[..cut], &mut out).is_err(), "cut {cut}");
        }
        for _ in 0..200 {
            let mut bad = good.bytes.clone();
            let at = rng.random_range(0..bad.len());
            bad[at] ^= 1 << rng.random_range(0..8);
            // Either an error or some bytes; the hash check catches the rest. Never a panic.
            let _ = decompress_into(good.codec, &bad, &mut out);
        }
        for codec in Codec::ALL {
            let _ = decompress_into(codec, &good.bytes, &mut out);
            assert!(decompress_into(codec, &good.bytes, &mut vec![0u8; data.len() + 1]).is_err());
        }
        let mut table_lies = good.bytes.clone();
        table_lies[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decompress_into(good.codec, &table_lies, &mut out).is_err());
        assert_eq!(Codec::from_wire(77), Err(CodecError::Unknown(77)));
        for codec in Codec::ALL {
            assert_eq!(Codec::from_wire(codec.to_wire()), Ok(codec));
        }
    }
}
