//! The data-plane frame format.
//!
//! Chunk bytes never travel over gRPC. Clients and targets speak this framed protocol on their own
//! TCP connections (and, in later transports, over shared memory and RDMA with the same headers).
//! A connection carries many requests at once: each request has an id chosen by the client, and
//! responses come back in any order carrying the same id.
//!
//! ```text
//!  0        4     5        6          8                  16            20             24
//!  +--------+-----+--------+----------+------------------+-------------+--------------+
//!  | magic  | ver | opcode | flags    | request id       | header len  | payload len  |
//!  | "SCKD" | u8  | u8     | u16 = 0  | u64 LE           | u32 LE      | u32 LE       |
//!  +--------+-----+--------+----------+------------------+-------------+--------------+
//!  | header: `header len` bytes, a prost message chosen by the opcode (dataplane.proto)  |
//!  +-------------------------------------------------------------------------------------+
//!  | payload: `payload len` raw bytes (chunk data for PUT requests and GET responses)     |
//!  +-------------------------------------------------------------------------------------+
//! ```
//!
//! Requests use opcodes 1..=5; a response uses the request's opcode with bit 0x80 set and carries a
//! [`crate::data::Response`] header. Limits are hard: a frame whose header says more than
//! [`MAX_HEADER_BYTES`] or [`MAX_PAYLOAD_BYTES`] is rejected before a byte of it is buffered, so a
//! peer cannot make the receiver allocate unbounded memory. Unknown magic, version, opcode or
//! non-zero flags are protocol errors: the receiver answers (when it can) and closes the
//! connection, because after a bad fixed header it can no longer find the next frame boundary.

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const MAGIC: [u8; 4] = *b"SCKD";
pub const VERSION: u8 = 1;
pub const FIXED_HEADER_BYTES: usize = 24;
/// Largest prost header. A HAS or DELETE batch of 1,000 hashes is ~34 KiB.
pub const MAX_HEADER_BYTES: u32 = 256 * 1024;
/// Largest payload: the largest chunk. Chunks default to 4 MiB; 64 MiB leaves room for users who
/// raise the chunk size for very large tensors, and bounds what one frame can make a peer buffer.
pub const MAX_PAYLOAD_BYTES: u32 = 64 * 1024 * 1024;
/// Largest batch of hashes in one HAS or DELETE request.
pub const MAX_BATCH_HASHES: usize = 4096;
/// Most entries one OP_LIST page carries (16,384 × 40 bytes = 640 KiB of payload).
pub const MAX_LIST_ENTRIES: u32 = 16_384;
/// Bytes per OP_LIST entry: a 32-byte hash and a u64 little-endian age in milliseconds.
pub const LIST_ENTRY_BYTES: usize = 40;

const RESPONSE_BIT: u8 = 0x80;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Opcode {
    Put,
    Get,
    Has,
    Delete,
    Stat,
    List,
    /// Sets up RDMA for the connection (rdma/src/lib.rs).
    Connect,
    PutResponse,
    GetResponse,
    HasResponse,
    DeleteResponse,
    StatResponse,
    ListResponse,
    ConnectResponse,
}

impl Opcode {
    pub fn to_u8(self) -> u8 {
        match self {
            Opcode::Put => 1,
            Opcode::Get => 2,
            Opcode::Has => 3,
            Opcode::Delete => 4,
            Opcode::Stat => 5,
            Opcode::List => 6,
            Opcode::Connect => 7,
            Opcode::PutResponse => 1 | RESPONSE_BIT,
            Opcode::GetResponse => 2 | RESPONSE_BIT,
            Opcode::HasResponse => 3 | RESPONSE_BIT,
            Opcode::DeleteResponse => 4 | RESPONSE_BIT,
            Opcode::StatResponse => 5 | RESPONSE_BIT,
            Opcode::ListResponse => 6 | RESPONSE_BIT,
            Opcode::ConnectResponse => 7 | RESPONSE_BIT,
        }
    }

    pub fn from_u8(value: u8) -> Option<Opcode> {
        Some(match value {
            1 => Opcode::Put,
            2 => Opcode::Get,
            3 => Opcode::Has,
            4 => Opcode::Delete,
            5 => Opcode::Stat,
            6 => Opcode::List,
            7 => Opcode::Connect,
            0x81 => Opcode::PutResponse,
            0x82 => Opcode::GetResponse,
            0x83 => Opcode::HasResponse,
            0x84 => Opcode::DeleteResponse,
            0x85 => Opcode::StatResponse,
            0x86 => Opcode::ListResponse,
            0x87 => Opcode::ConnectResponse,
            _ => return None,
        })
    }

    pub fn is_response(self) -> bool {
        self.to_u8() & RESPONSE_BIT != 0
    }

    /// The operation's name, a request's and its response's alike (`put`, `get`, …), as metrics
    /// label it.
    pub fn name(self) -> &'static str {
        match self {
            Opcode::Put | Opcode::PutResponse => "put",
            Opcode::Get | Opcode::GetResponse => "get",
            Opcode::Has | Opcode::HasResponse => "has",
            Opcode::Delete | Opcode::DeleteResponse => "delete",
            Opcode::Stat | Opcode::StatResponse => "stat",
            Opcode::List | Opcode::ListResponse => "list",
            Opcode::Connect | Opcode::ConnectResponse => "connect",
        }
    }

    /// The response opcode answering this request opcode (identity for responses).
    pub fn response(self) -> Opcode {
        Opcode::from_u8(self.to_u8() | RESPONSE_BIT).unwrap_or(self)
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("bad magic {found:02x?} (not a starckpt data-plane peer?)")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported protocol version {found} (this build speaks {VERSION})")]
    BadVersion { found: u8 },
    #[error("unknown opcode {found:#04x}")]
    BadOpcode { found: u8 },
    #[error("reserved flags {found:#06x} must be zero")]
    BadFlags { found: u16 },
    #[error("header of {len} bytes exceeds the limit of {MAX_HEADER_BYTES}")]
    HeaderTooLarge { len: u32 },
    #[error("payload of {len} bytes exceeds the limit of {MAX_PAYLOAD_BYTES}")]
    PayloadTooLarge { len: u32 },
}

/// The fixed 24-byte header of every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub opcode: Opcode,
    pub request_id: u64,
    pub header_len: u32,
    pub payload_len: u32,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; FIXED_HEADER_BYTES] {
        let mut out = [0u8; FIXED_HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.opcode.to_u8();
        out[6..8].copy_from_slice(&0u16.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.header_len.to_le_bytes());
        out[20..24].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Parses and checks a fixed header. Every field is validated, including the size limits, so
    /// the caller can size its buffers from the result.
    pub fn decode(bytes: &[u8; FIXED_HEADER_BYTES]) -> Result<FrameHeader, FrameError> {
        let magic: [u8; 4] = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        if bytes[4] != VERSION {
            return Err(FrameError::BadVersion { found: bytes[4] });
        }
        let opcode = Opcode::from_u8(bytes[5]).ok_or(FrameError::BadOpcode { found: bytes[5] })?;
        let flags = u16::from_le_bytes([bytes[6], bytes[7]]);
        if flags != 0 {
            return Err(FrameError::BadFlags { found: flags });
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[8..16]);
        let header_len = u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
        let payload_len = u32::from_le_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]);
        if header_len > MAX_HEADER_BYTES {
            return Err(FrameError::HeaderTooLarge { len: header_len });
        }
        if payload_len > MAX_PAYLOAD_BYTES {
            return Err(FrameError::PayloadTooLarge { len: payload_len });
        }
        Ok(FrameHeader { opcode, request_id: u64::from_le_bytes(id), header_len, payload_len })
    }
}

/// Errors of reading a frame from a stream.
#[derive(Debug, Error)]
pub enum ReadFrameError {
    #[error("connection closed")]
    Closed,
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads one fixed header and the prost header bytes that follow it. The payload is left on the
/// stream for the caller, which knows where it should land (an aligned buffer for a PUT).
/// Returns [`ReadFrameError::Closed`] on a clean end of stream between frames.
pub async fn read_frame_head<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<(FrameHeader, bytes::Bytes), ReadFrameError> {
    let header = read_fixed_header(reader).await?;
    let prost_header = read_message_header(reader, &header).await?;
    Ok((header, prost_header))
}

/// The first half of [`read_frame_head`]: the fixed header, decoded. A server waits for it as
/// long as a connection may idle, and for the rest of the frame only a frame's time.
pub async fn read_fixed_header<R: AsyncRead + Unpin>(reader: &mut R) -> Result<FrameHeader, ReadFrameError> {
    let mut fixed = [0u8; FIXED_HEADER_BYTES];
    let mut filled = 0;
    while filled < FIXED_HEADER_BYTES {
        let n = reader.read(&mut fixed[filled..]).await?;
        if n == 0 {
            return if filled == 0 {
                Err(ReadFrameError::Closed)
            } else {
                Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into())
            };
        }
        filled += n;
    }
    Ok(FrameHeader::decode(&fixed)?)
}

/// The second half of [`read_frame_head`]: the prost header `header` announces.
pub async fn read_message_header<R: AsyncRead + Unpin>(
    reader: &mut R,
    header: &FrameHeader,
) -> Result<bytes::Bytes, ReadFrameError> {
    let mut prost_header = vec![0u8; header.header_len as usize];
    reader.read_exact(&mut prost_header).await?;
    Ok(bytes::Bytes::from(prost_header))
}

/// Writes one frame: fixed header, prost header, then the payload pieces in order, without
/// concatenating them.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    opcode: Opcode,
    request_id: u64,
    prost_header: &[u8],
    payload: &[bytes::Bytes],
) -> std::io::Result<()> {
    let payload_len: usize = payload.iter().map(|p| p.len()).sum();
    write_frame_head(writer, opcode, request_id, prost_header, payload_len).await?;
    for piece in payload {
        writer.write_all(piece).await?;
    }
    Ok(())
}

/// Writes a frame's fixed header and prost header, announcing `payload_len` bytes of payload,
/// which the caller writes next (`crate::zerocopy` sends them by other means than `writer`).
pub async fn write_frame_head<W: AsyncWrite + Unpin>(
    writer: &mut W,
    opcode: Opcode,
    request_id: u64,
    prost_header: &[u8],
    payload_len: usize,
) -> std::io::Result<()> {
    let header_len = u32::try_from(prost_header.len())
        .ok()
        .filter(|len| *len <= MAX_HEADER_BYTES)
        .ok_or_else(|| std::io::Error::other("frame header exceeds MAX_HEADER_BYTES"))?;
    let payload_len = u32::try_from(payload_len)
        .ok()
        .filter(|len| *len <= MAX_PAYLOAD_BYTES)
        .ok_or_else(|| std::io::Error::other("frame payload exceeds MAX_PAYLOAD_BYTES"))?;
    let fixed = FrameHeader { opcode, request_id, header_len, payload_len }.encode();
    writer.write_all(&fixed).await?;
    writer.write_all(prost_header).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> FrameHeader {
        FrameHeader { opcode: Opcode::Get, request_id: u64::MAX - 3, header_len: 99, payload_len: 0 }
    }

    #[test]
    fn round_trip_every_opcode() {
        for code in 0..=255u8 {
            if let Some(opcode) = Opcode::from_u8(code) {
                assert_eq!(opcode.to_u8(), code);
                let header = FrameHeader { opcode, ..sample() };
                assert_eq!(FrameHeader::decode(&header.encode()), Ok(header));
            }
        }
        assert_eq!(Opcode::Put.response(), Opcode::PutResponse);
        assert!(Opcode::StatResponse.is_response());
        assert!(!Opcode::Delete.is_response());
    }

    #[test]
    fn rejects_each_bad_field() {
        let good = sample().encode();
        let mut bad = good;
        bad[0] = b'X';
        assert!(matches!(FrameHeader::decode(&bad), Err(FrameError::BadMagic { .. })));
        let mut bad = good;
        bad[4] = 2;
        assert_eq!(FrameHeader::decode(&bad), Err(FrameError::BadVersion { found: 2 }));
        let mut bad = good;
        bad[5] = 0x42;
        assert_eq!(FrameHeader::decode(&bad), Err(FrameError::BadOpcode { found: 0x42 }));
        let mut bad = good;
        bad[6] = 1;
        assert_eq!(FrameHeader::decode(&bad), Err(FrameError::BadFlags { found: 1 }));
        let big = FrameHeader { header_len: MAX_HEADER_BYTES + 1, ..sample() }.encode();
        assert!(matches!(FrameHeader::decode(&big), Err(FrameError::HeaderTooLarge { .. })));
        let big = FrameHeader { payload_len: u32::MAX, ..sample() }.encode();
        assert!(matches!(FrameHeader::decode(&big), Err(FrameError::PayloadTooLarge { .. })));
    }

    #[tokio::test]
    async fn stream_round_trip_and_clean_close() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let payload = [bytes::Bytes::from_static(b"hello "), bytes::Bytes::from_static(b"world")];
        write_frame(&mut a, Opcode::Put, 9, b"hdr", &payload).await.unwrap();
        drop(a);
        let (header, prost_header) = read_frame_head(&mut b).await.unwrap();
        assert_eq!(header.opcode, Opcode::Put);
        assert_eq!(header.request_id, 9);
        assert_eq!(&prost_header[..], b"hdr");
        let mut body = vec![0u8; header.payload_len as usize];
        b.read_exact(&mut body).await.unwrap();
        assert_eq!(body, b"hello world");
        assert!(matches!(read_frame_head(&mut b).await, Err(ReadFrameError::Closed)));
    }

    #[tokio::test]
    async fn truncated_fixed_header_is_an_error_not_a_close() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&MAGIC).await.unwrap();
        drop(a);
        assert!(matches!(read_frame_head(&mut b).await, Err(ReadFrameError::Io(_))));
    }
}

#[cfg(test)]
mod robustness {
    use super::*;

    /// Decoding arbitrary bytes never panics: every input is a header or an error.
    #[test]
    fn arbitrary_fixed_headers() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..200_000 {
            let mut bytes = [0u8; FIXED_HEADER_BYTES];
            for byte in bytes.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *byte = state as u8;
            }
            // Half the rounds start from a valid prefix so the later fields are exercised too.
            if round % 2 == 0 {
                bytes[..4].copy_from_slice(&MAGIC);
                bytes[4] = VERSION;
            }
            if let Ok(header) = FrameHeader::decode(&bytes) {
                assert!(header.header_len <= MAX_HEADER_BYTES && header.payload_len <= MAX_PAYLOAD_BYTES);
                assert_eq!(header.encode(), bytes);
            }
        }
    }
}
