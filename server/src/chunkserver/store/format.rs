//! The on-disk format of a chunk file: a fixed header (magic, version, codec, lengths, the
//! chunk's hash) with its checksum, then the stored bytes.

use super::*;

pub const HEADER_BYTES: usize = 4096;
pub(crate) const MAGIC: &[u8; 8] = b"SCKCHUNK";
/// Uncompressed chunks.
pub(crate) const FORMAT_VERSION: u16 = 1;
/// Compressed chunks: the header also holds the BLAKE3 of the stored bytes.
pub(crate) const FORMAT_VERSION_STORED_HASH: u16 = 2;
/// A tenant's chunks (`starckpt_proto::address`), compressed or not: laid out as version 2, but
/// the address is a keyed hash, so only the stored bytes' hash can check them.
pub(crate) const FORMAT_VERSION_KEYED: u16 = 3;
pub(crate) const FORMAT_VERSIONS: [u16; 3] = [FORMAT_VERSION, FORMAT_VERSION_STORED_HASH, FORMAT_VERSION_KEYED];

/// The first 8 bytes of BLAKE3(`bytes`): the header's checksums (module docs).
pub(crate) fn sum8(bytes: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&blake3::hash(bytes).as_bytes()[..8]);
    out
}

pub(crate) fn header_sum(header: &[u8]) -> [u8; 8] {
    sum8(&header[..64])
}

/// What a chunk file's header says about the bytes after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StoredHeader {
    pub(crate) codec: Codec,
    pub(crate) stored_len: u64,
    /// The chunk's length once decoded.
    pub(crate) length: u64,
    /// BLAKE3 of the stored bytes (the content hash for an uncompressed chunk).
    pub(crate) stored_hash: ChunkHash,
    /// The chunk is a tenant's: its address is not its content hash.
    pub(crate) keyed: bool,
}

impl StoredHeader {
    /// Checks that the `held` bytes read after the header hold the stored bytes it names.
    pub(crate) fn check_held(&self, hash: &ChunkHash, held: usize) -> Result<(), ChunkStoreError> {
        if self.stored_len > held as u64 {
            let reason = format!("header says {} bytes, file holds {held}", self.stored_len);
            return Err(ChunkStoreError::Corrupt { hash: *hash, reason });
        }
        Ok(())
    }
}

pub(crate) fn encode_header(header: &mut [u8], fields: &StoredHeader, hash: &ChunkHash) {
    let version = match (fields.keyed, fields.codec) {
        (true, _) => FORMAT_VERSION_KEYED,
        (false, Codec::None) => FORMAT_VERSION,
        (false, _) => FORMAT_VERSION_STORED_HASH,
    };
    header.fill(0);
    header[0..8].copy_from_slice(MAGIC);
    header[8..10].copy_from_slice(&version.to_le_bytes());
    header[10] = fields.codec.to_wire() as u8;
    header[16..24].copy_from_slice(&fields.stored_len.to_le_bytes());
    header[24..32].copy_from_slice(&fields.length.to_le_bytes());
    header[32..64].copy_from_slice(&hash.0);
    if version != FORMAT_VERSION {
        header[72..104].copy_from_slice(&fields.stored_hash.0);
        let extension = sum8(&header[72..104]);
        header[104..112].copy_from_slice(&extension);
    }
    let sum = header_sum(header);
    header[64..72].copy_from_slice(&sum);
}

/// Checks a chunk file's header and returns what it says.
pub(crate) fn decode_header(file: &[u8], hash: &ChunkHash) -> Result<StoredHeader, ChunkStoreError> {
    let corrupt = |reason: &str| Err(ChunkStoreError::Corrupt { hash: *hash, reason: reason.to_owned() });
    if file.len() < HEADER_BYTES {
        return corrupt("shorter than its header");
    }
    if &file[0..8] != MAGIC {
        return corrupt("bad magic");
    }
    let version = u16::from_le_bytes([file[8], file[9]]);
    if file[64..72] != header_sum(file) {
        return corrupt("header checksum mismatch");
    }
    if !FORMAT_VERSIONS.contains(&version) {
        return corrupt("unknown format version");
    }
    if version != FORMAT_VERSION && file[104..112] != sum8(&file[72..104]) {
        return corrupt("header extension checksum mismatch");
    }
    if file[32..64] != hash.0 {
        return corrupt("header names a different chunk");
    }
    let word = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().expect("8 bytes"));
    let (stored_len, length) = (word(16), word(24));
    let codec = match Codec::from_wire(i32::from(file[10])) {
        Ok(codec) if version == FORMAT_VERSION_KEYED || (codec == Codec::None) == (version == FORMAT_VERSION) => codec,
        _ => return corrupt("codec does not match the format version"),
    };
    if codec == Codec::None && stored_len != length {
        return corrupt("an uncompressed chunk's lengths differ");
    }
    if length > u64::from(starckpt_proto::frame::MAX_PAYLOAD_BYTES) {
        return corrupt("length out of range");
    }
    let stored_hash = if version == FORMAT_VERSION {
        *hash
    } else {
        ChunkHash::try_from(&file[72..104])
            .map_err(|e| ChunkStoreError::Corrupt { hash: *hash, reason: e.to_string() })?
    };
    Ok(StoredHeader { codec, stored_len, length, stored_hash, keyed: version == FORMAT_VERSION_KEYED })
}
