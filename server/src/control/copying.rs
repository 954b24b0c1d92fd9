//! What the control plane's passes share to copy chunks between targets (re-replication,
//! recoveries, the tier): the live targets and their transports, a verified read of a chunk,
//! why a copy failed, and the pace copies go at.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use starckpt_dataplane::transport::{ChunkTransport, Credentials, Payload, TcpConfig, TcpTransport};
use starckpt_proto::{Addressing, ChunkHash, ChunkName};

use super::store::TargetRecord;

/// A target the pass may read from or write to.
pub(crate) struct Live {
    pub id: String,
    pub domain: String,
    pub transport: Arc<dyn ChunkTransport>,
}

/// The live ones of `targets` (those with an address), each with a TCP transport.
pub(crate) fn live_targets(targets: &[(TargetRecord, Option<SocketAddr>)], credentials: &Credentials) -> Vec<Live> {
    live_targets_with(targets, |id, address| tcp_to(id, address, credentials))
}

/// A TCP transport to the target `id` at `address`, with one connection.
pub(crate) fn tcp_to(id: &str, address: SocketAddr, credentials: &Credentials) -> Arc<dyn ChunkTransport> {
    let config = TcpConfig { connections_per_target: 1, credentials: credentials.clone(), ..TcpConfig::default() };
    tcp_with(id, address, config)
}

/// A TCP transport to the target `id` at `address`, configured.
pub(crate) fn tcp_with(id: &str, address: SocketAddr, config: TcpConfig) -> Arc<dyn ChunkTransport> {
    Arc::new(TcpTransport::for_target(address, id, config))
}

/// [`live_targets`], with the transport `transport(id, address)` gives.
pub(crate) fn live_targets_with(
    targets: &[(TargetRecord, Option<SocketAddr>)],
    mut transport: impl FnMut(&str, SocketAddr) -> Arc<dyn ChunkTransport>,
) -> Vec<Live> {
    targets
        .iter()
        .filter_map(|(t, address)| {
            let address = (*address)?;
            Some(Live {
                id: t.target_id.clone(),
                domain: if t.failure_domain.is_empty() { t.target_id.clone() } else { t.failure_domain.clone() },
                transport: transport(&t.target_id, address),
            })
        })
        .collect()
}

/// Why no verified copy came from a target.
pub(crate) enum CopyError {
    /// It could not be read (the target lacks it, or failed).
    Unreadable(String),
    /// The target did not answer in time, or could not be reached: its other copies are better
    /// read elsewhere for now.
    Unanswered(String),
    /// It was read and is not the chunk: the target's copy wants repairing.
    Corrupt(String),
}

/// `hash`'s copy on `target`, verified: as stored (to pass on: a compressed copy stays
/// compressed) and decoded.
pub(crate) async fn read_verified(
    target: &Live,
    addressing: &Addressing,
    hash: ChunkHash,
    length: u64,
) -> Result<(Payload, Bytes, ChunkName), CopyError> {
    let payload = target.transport.get(hash, 0, 0).await.map_err(|e| match e.is_connection() {
        true => CopyError::Unanswered(e.to_string()),
        false => CopyError::Unreadable(e.to_string()),
    })?;
    let (checked, addressing) = (payload.clone(), *addressing);
    match tokio::task::spawn_blocking(move || checked.verified(&addressing, hash, length)).await {
        Ok(Ok((data, name))) => Ok((payload, data, name)),
        Ok(Err(found)) => Err(CopyError::Corrupt(found)),
        Err(join) => Err(CopyError::Unreadable(join.to_string())),
    }
}

/// Spaces work out to `per_second` units (copies, bytes), from the first unit on (scans before
/// it earn no burst): [`Pace::admit`] waits until the units `spent` so far are due.
pub(crate) struct Pace {
    pub per_second: u64,
    pub first: Option<Instant>,
    pub spent: u64,
}

impl Pace {
    pub fn new(per_second: u64) -> Pace {
        Pace { per_second, first: None, spent: 0 }
    }

    pub async fn admit(&mut self) {
        let first = *self.first.get_or_insert_with(Instant::now);
        let due = Duration::from_secs_f64(self.spent as f64 / self.per_second.max(1) as f64);
        if let Some(wait) = due.checked_sub(first.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}
