//! How long a data-plane request may take: [`Deadline`], by the bytes it moves.

use bytes::Bytes;
use starckpt_proto::frame::{self, Opcode};
use std::time::Duration;

/// How long a data-plane request may go unanswered: a fixed allowance plus its bytes, and the
/// bytes queued ahead of it on its connection, at a floor throughput. A storage host that loses
/// power or hangs does not close its connections, it stops answering; one idle timeout for all
/// requests (it was 120 s) either waits minutes for it or fails large chunks on a healthy one.
///
/// At the defaults a 4 MiB chunk alone on its connection has 5.25 s, one behind 31 others (the
/// most a connection carries) 13 s, and a 64 MiB chunk 9 s: against ~10 ms for a durable 4 MiB
/// write on NVMe, or 40 ms to send it over a 1 Gbit/s link, a host silent that long is treated
/// as gone and its copies go elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    /// The fixed part of every request's deadline. Default 5 s: what a healthy host may spend
    /// apart from moving the bytes: a device sync (ms), a few TCP retransmissions of a lost
    /// segment (200 ms minimum RTO, doubled each time: three in a row take 1.4 s), a pause of a
    /// busy process.
    pub allowance: Duration,
    /// The slowest a request's bytes may move. Default 16 MiB/s: 1/60 of one NVMe device, 1/8 of
    /// a 1 Gbit/s link. A target slower than that for a whole chunk delays a checkpoint more than
    /// sending the chunk to another target does.
    pub floor_bytes_per_sec: u64,
}

impl Default for Deadline {
    fn default() -> Self {
        Deadline { allowance: Duration::from_secs(5), floor_bytes_per_sec: 16 << 20 }
    }
}

impl Deadline {
    /// The deadline of a request moving `bytes` (either way) with nothing queued ahead of it.
    pub fn for_bytes(&self, bytes: u64) -> Duration {
        self.allowance + self.moving(bytes)
    }

    /// Time to move `bytes` at the floor throughput.
    pub(crate) fn moving(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.floor_bytes_per_sec.max(1) as f64)
    }

    /// The longest a frame of the largest payload may take to go out, and a response's payload
    /// to come in once begun: past it, the peer stopped reading (or sending) mid-frame.
    pub fn frame(&self) -> Duration {
        self.for_bytes(u64::from(frame::MAX_PAYLOAD_BYTES))
    }
}

/// The size assumed for a GET whose chunk's length the caller does not know, in its deadline:
/// the default chunk size.
pub(crate) const GET_BYTES_ASSUMED: u64 = 4 << 20;

/// The bytes a request moves, either way, for its deadline: a PUT's payload, a GET's chunk
/// (assumed [`GET_BYTES_ASSUMED`] long), nothing for the rest.
pub(crate) fn request_bytes(opcode: Opcode, payload: Option<&Bytes>) -> u64 {
    match (opcode, payload) {
        (_, Some(payload)) => payload.len() as u64,
        (Opcode::Get, None) => GET_BYTES_ASSUMED,
        _ => 0,
    }
}
