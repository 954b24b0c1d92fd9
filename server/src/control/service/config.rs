//! The control plane's settings ([`ControlConfig`]) and the message size bound.

use super::*;

/// Largest gRPC message either way. A rank's manifest is ~100 bytes per 4 MiB chunk, so 64 MiB
/// describes ~2.5 PB in one part: generous, but still a bound.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// Heartbeat period asked of targets. Default 1 s.
    pub heartbeat_interval: Duration,
    /// A target silent for this long is dead: placement skips it. Default 5 s (five missed
    /// heartbeats), short enough that a save started after a target died avoids it.
    pub liveness_timeout: Duration,
    /// A checkpoint still missing a rank's part this long after it was begun is aborted (its
    /// writers died without a new run taking over). Default 30 min: a TB-scale save at a few
    /// GB/s per rank takes minutes, and a stuck one should not linger for hours.
    pub pending_timeout: Duration,
    /// Garbage collection (see `gc.rs`). Default: grace 60 min (twice the pending timeout),
    /// 2,000 deletions per second.
    pub gc: GcConfig,
    /// Period of the background GC pass; None runs GC only on request (`starckpt gc`).
    /// Default 10 min.
    pub gc_interval: Option<Duration>,
    /// Re-replication of chunks whose copies were on lost targets (see `repair.rs`).
    pub repair: RepairConfig,
    /// Period of the background re-replication pass; None runs it only on request
    /// (`starckpt repair`). Default 1 min.
    pub repair_interval: Option<Duration>,
    /// Replication factor of jobs that did not set one (`starckpt replication`). Default 2: a
    /// committed checkpoint survives the loss of any one target. Capped, per save, by the number
    /// of live targets.
    pub default_replicas: u32,
    /// The object-store tier committed checkpoints are copied to (see `tier.rs`); None: no tier.
    pub tier: Option<Arc<Tier>>,
    pub tier_config: TierConfig,
    /// Period of the background tier pass (with a tier); None runs it only on request
    /// (`starckpt tier`). Default 1 min.
    pub tier_interval: Option<Duration>,
    /// Readers' `RecoverChunks` served at once (each works on up to `repair.chunks_at_once` of
    /// its chunks at a time, reading each and writing its copies: at most 4 × 8 chunks held), and
    /// how long one waits for its turn before it is answered ResourceExhausted (the reader asks
    /// again a few times; re-replication recovers the chunk anyway). Default 4 and 20 s (under
    /// the SDK's 30 s RPC timeout).
    pub recoveries_at_once: usize,
    /// See `recoveries_at_once`.
    pub recovery_wait: Duration,
    /// The key shared with the cluster's targets (`--cluster-key-file`), with which this control
    /// plane signs data-plane capabilities (`starckpt_proto::capability`): clients' through
    /// `DataCapability`, and its own for GC, re-replication and the tier. None: targets without a
    /// key serve everyone, and clients get an empty capability.
    pub cluster_key: Option<ClusterKey>,
    /// How long a capability lasts. Default 1 h; clients renew theirs at half that. With
    /// `tokens`, clients' last at most 5 minutes, so a revoked token's holder loses the data
    /// plane soon after the control plane.
    pub capability_lifetime: Duration,
    /// The bearer tokens callers must present (`--tokens-file`, `auth.rs`), which also decide
    /// whose jobs each reaches. None: every caller is an operator, as on a single-user cluster.
    /// Requires `cluster_key` (`run` refuses tokens without one).
    pub tokens: Option<Arc<Tokens>>,
    /// The certificate and key the gRPC port serves TLS with (`--tls-cert`, `--tls-key`;
    /// `tls.rs`), reloaded when they change. None: plaintext.
    pub tls: Option<Arc<ServerTls>>,
    /// Bytes of stored part manifests one page of `GetManifest` carries at most (at least one
    /// part): well under the 64 MiB message limit, whatever the checkpoint's size. Default 16 MiB.
    pub manifest_page_bytes: usize,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            heartbeat_interval: Duration::from_secs(1),
            liveness_timeout: Duration::from_secs(5),
            pending_timeout: Duration::from_secs(30 * 60),
            gc: GcConfig::default(),
            gc_interval: Some(Duration::from_secs(10 * 60)),
            default_replicas: 2,
            repair: RepairConfig::default(),
            repair_interval: Some(Duration::from_secs(60)),
            tier: None,
            tier_config: TierConfig::default(),
            tier_interval: Some(Duration::from_secs(60)),
            recoveries_at_once: 4,
            recovery_wait: Duration::from_secs(20),
            cluster_key: None,
            capability_lifetime: Duration::from_secs(60 * 60),
            tokens: None,
            tls: None,
            manifest_page_bytes: 16 << 20,
        }
    }
}
