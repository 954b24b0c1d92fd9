//! The RDMA fields of data-plane frames (see `starckpt_rdma` for the protocol), converted and
//! checked on receipt: an endpoint or buffer a peer sends is validated here, once.

pub use starckpt_rdma::Endpoint;

use starckpt_proto::data;
use starckpt_proto::frame::MAX_PAYLOAD_BYTES;

pub fn endpoint_to_wire(endpoint: &Endpoint) -> data::RdmaEndpoint {
    data::RdmaEndpoint {
        gid: bytes::Bytes::copy_from_slice(&endpoint.gid),
        lid: u32::from(endpoint.lid),
        qp_num: endpoint.qp_num,
        psn: endpoint.psn,
        mtu: endpoint.mtu,
        rd_atomic: u32::from(endpoint.rd_atomic),
    }
}

pub fn endpoint_from_wire(wire: &data::RdmaEndpoint) -> Result<Endpoint, String> {
    let gid: [u8; 16] = wire.gid[..].try_into().map_err(|_| format!("a GID of {} bytes", wire.gid.len()))?;
    let lid = u16::try_from(wire.lid).map_err(|_| format!("LID {} is out of range", wire.lid))?;
    // Queue-pair numbers and packet sequence numbers are 24-bit.
    if wire.qp_num == 0 || wire.qp_num >= 1 << 24 || wire.psn >= 1 << 24 {
        return Err(format!("queue pair {} / psn {} out of range", wire.qp_num, wire.psn));
    }
    if !starckpt_rdma::valid_mtu(wire.mtu) {
        return Err(format!("path MTU {} is not one of 256..=4096", wire.mtu));
    }
    let rd_atomic = u8::try_from(wire.rd_atomic)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{} outstanding RDMA READs (1..=255)", wire.rd_atomic))?;
    Ok(Endpoint { gid, lid, qp_num: wire.qp_num, psn: wire.psn, mtu: wire.mtu, rd_atomic })
}

/// A client buffer named in a request: `length` bytes at `addr` under `rkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteBuffer {
    pub addr: u64,
    pub rkey: u32,
    pub len: u32,
}

impl RemoteBuffer {
    pub fn to_wire(self) -> data::RemoteBuffer {
        data::RemoteBuffer { addr: self.addr, rkey: self.rkey, length: u64::from(self.len) }
    }

    /// Checks a received buffer: 1..=MAX_PAYLOAD_BYTES bytes that do not wrap the address space.
    pub fn from_wire(wire: &data::RemoteBuffer) -> Result<RemoteBuffer, String> {
        let len = u32::try_from(wire.length)
            .ok()
            .filter(|&len| len > 0 && len <= MAX_PAYLOAD_BYTES)
            .ok_or_else(|| format!("a remote buffer of {} bytes (1..={MAX_PAYLOAD_BYTES})", wire.length))?;
        if wire.addr.checked_add(u64::from(len)).is_none() {
            return Err(format!("a remote buffer at {:#x} wraps the address space", wire.addr));
        }
        Ok(RemoteBuffer { addr: wire.addr, rkey: wire.rkey, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip_and_bad_ones_are_refused() {
        let endpoint = Endpoint { gid: [7; 16], lid: 3, qp_num: 0x1234, psn: 99, mtu: 4096, rd_atomic: 16 };
        assert_eq!(endpoint_from_wire(&endpoint_to_wire(&endpoint)), Ok(endpoint));
        let good = endpoint_to_wire(&endpoint);
        let bad = [
            data::RdmaEndpoint { gid: bytes::Bytes::from_static(&[1; 15]), ..good.clone() },
            data::RdmaEndpoint { lid: 70_000, ..good.clone() },
            data::RdmaEndpoint { qp_num: 0, ..good.clone() },
            data::RdmaEndpoint { qp_num: 1 << 24, ..good.clone() },
            data::RdmaEndpoint { mtu: 1500, ..good.clone() },
            data::RdmaEndpoint { mtu: 8192, ..good.clone() },
            data::RdmaEndpoint { rd_atomic: 0, ..good.clone() },
            data::RdmaEndpoint { rd_atomic: 256, ..good.clone() },
        ];
        for wire in bad {
            assert!(endpoint_from_wire(&wire).is_err(), "{wire:?}");
        }
    }

    #[test]
    fn remote_buffers_are_bounded() {
        let ok = data::RemoteBuffer { addr: 4096, rkey: 5, length: 100 };
        assert_eq!(RemoteBuffer::from_wire(&ok), Ok(RemoteBuffer { addr: 4096, rkey: 5, len: 100 }));
        for length in [0, u64::from(MAX_PAYLOAD_BYTES) + 1, u64::MAX] {
            assert!(RemoteBuffer::from_wire(&data::RemoteBuffer { length, ..ok }).is_err());
        }
        assert!(RemoteBuffer::from_wire(&data::RemoteBuffer { addr: u64::MAX - 10, ..ok }).is_err());
    }
}
