//! Serving a control plane ([`run`]): opening its store, joining the control planes that share
//! it, the clock check, and the periodic passes.

use super::*;
use starckpt_dataplane::sync::LockExt;

/// Opens the metadata store named by `url`: a SQLite path or `sqlite://` URL, or a
/// `postgres://` URL ([`crate::control::sql::SqlStore::open`]).
pub async fn open_store(url: &str) -> anyhow::Result<Arc<dyn MetaStore>> {
    let store = crate::control::sql::SqlStore::open(url)
        .await
        .map_err(|e| anyhow::anyhow!("open metadata store {}: {e}", redact_password(url)))?;
    Ok(Arc::new(store))
}

/// `url` without its password, for messages.
pub fn redact_password(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_owned(),
    }
}

/// Serves the control plane on `listener` until `shutdown` resolves.
pub async fn run(
    listener: TcpListener,
    store: Arc<dyn MetaStore>,
    config: ControlConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    config.gc.validate(config.pending_timeout).map_err(anyhow::Error::msg)?;
    if config.tokens.is_some() && config.cluster_key.is_none() {
        anyhow::bail!(
            "bearer tokens need a cluster key (--cluster-key-file): without one, any process could register \
             as a target and be sent the chunks of every tenant"
        );
    }
    let listening = listener_identity(listener.local_addr()?);
    let member = ControlPlaneMember {
        id: format!("{listening}/{}", uuid::Uuid::new_v4().simple()),
        listener: listening,
        pending_timeout_ms: config.pending_timeout.as_millis() as u64,
        gc_grace_ms: config.gc.grace.as_millis() as u64,
        security: ControlPlaneMember::security_of(
            config.cluster_key.as_ref(),
            config.tokens.is_some(),
            config.tls.is_some(),
        ),
        tier: ControlPlaneMember::tier_of(config.tier.as_ref().map(|tier| tier.url())),
    };
    // Where control planes may share the database (PostgreSQL), they must agree on settings and
    // on the time. SQLite is one host's: a control plane restarted with other settings (or on
    // another port) is the only one.
    let shared = match clock_check(&*store).await? {
        None => false,
        Some(skew) => {
            skew.map_err(anyhow::Error::msg)?;
            true
        }
    };
    if shared && let Some(conflict) = join(&*store, &member, true).await? {
        anyhow::bail!(conflict);
    }
    let reaper = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(reap_stale_pending(
        Arc::clone(&store),
        config.pending_timeout,
    )));
    let gc_interval = config.gc_interval;
    let repair_interval = config.repair_interval;
    let tier_interval = config.tier.as_ref().and(config.tier_interval);
    // Small files, but reads all the same: off the reactor's threads.
    let tokens = config.tokens.clone();
    let tokens =
        every_blocking(tokens.as_ref().map(|_| crate::control::auth::RELOAD_EVERY), "tokens file", move || {
            tokens.iter().for_each(|tokens| tokens.reload_if_changed())
        });
    let tls = config.tls.clone();
    let tls_reload = every_blocking(tls.as_ref().map(|_| crate::control::tls::RELOAD_EVERY), "TLS certificate", {
        let tls = tls.clone();
        move || tls.iter().for_each(|tls| tls.reload_if_changed())
    });
    if tls.is_none() && config.tokens.is_some() && !listener.local_addr()?.ip().is_loopback() {
        tracing::warn!(
            "bearer tokens travel in plaintext to this control plane: give it --tls-cert and --tls-key \
             unless the network is trusted"
        );
    }
    let service = ControlService::new(Arc::clone(&store), config);
    let collector = Arc::clone(&service.collector);
    // Alive: recorded every few seconds, whatever it finds. A conflict found now (one joined
    // while this one looked gone, the database out of reach for a minute) or a clock that has
    // drifted pauses garbage collection until it is gone.
    let membership = every(shared.then_some(MEMBER_REFRESH), "membership", {
        let (collector, member) = (Arc::clone(&collector), member.clone());
        move || {
            let (collector, member) = (Arc::clone(&collector), member.clone());
            async move { refresh_membership(&collector, &member).await }
        }
    });
    let periodic_repair = every(repair_interval, "re-replication", {
        let collector = Arc::clone(&collector);
        move || {
            let collector = Arc::clone(&collector);
            async move { collector.rereplicate(false).await.map(drop) }
        }
    });
    let periodic_tier = every(tier_interval, "object-store tier", {
        let collector = Arc::clone(&collector);
        move || {
            let collector = Arc::clone(&collector);
            async move { collector.tier(tier::Sweep::IfDeleted).await.map(drop) }
        }
    });
    let periodic_gc = every(gc_interval, "garbage collection", move || {
        let collector = Arc::clone(&collector);
        async move { collector.run(false).await.map(drop) }
    });
    let service = ControlServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tracing::info!(address = %listener.local_addr()?, tls = tls.is_some(), "control plane serving");
    let router = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(256)
        .layer(tower::layer::layer_fn(crate::telemetry::Metered))
        .add_service(service);
    let served = match tls {
        Some(tls) => router.serve_with_incoming_shutdown(tls.incoming(listener), shutdown).await,
        None => {
            router.serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), shutdown).await
        }
    };
    drop((membership, reaper, periodic_gc, periodic_repair, periodic_tier, tokens, tls_reload));
    if shared && let Err(error) = store.leave_control_planes(&member.id).await {
        tracing::warn!(%error, "could not remove this control plane from the database's list");
    }
    Ok(served?)
}

/// A control plane not seen for this long is gone: its settings no longer bind one starting.
pub(super) const MEMBER_LIVE: Duration = Duration::from_secs(60);
/// How often a control plane records that it is alive.
pub(super) const MEMBER_REFRESH: Duration = Duration::from_secs(10);
/// Most a control plane's clock may differ from its PostgreSQL server's. Control planes compare
/// times each other wrote (a commit's age against the pending timeout, which GC's grace exceeds by
/// at least 60 s, `gc.rs`): two within this of the database are within twice this of each other.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(10);

/// Records `member` among the database's control planes (unless `refuse` and a conflict); the
/// conflict, when a live one runs with other settings.
pub(super) async fn join(
    store: &dyn MetaStore,
    member: &ControlPlaneMember,
    refuse: bool,
) -> Result<Option<String>, MetaError> {
    let now = now_ms();
    let live_since = now.saturating_sub(MEMBER_LIVE.as_millis() as u64);
    store.join_control_planes(member, now, live_since, refuse).await
}

/// Records this control plane as alive, and pauses garbage collection while a live control plane
/// of the database runs with other settings or this host's clock is more than
/// [`MAX_CLOCK_SKEW`] off the database server's (resumes it once neither holds).
pub(super) async fn refresh_membership(collector: &Collector, member: &ControlPlaneMember) -> Result<(), MetaError> {
    let conflict = join(&*collector.store, member, false).await?;
    let skew = clock_check(&*collector.store).await?.and_then(Result::err);
    let why = conflict.or(skew);
    let mut paused = collector.gc_paused.lock_unpoisoned();
    match (&*paused, &why) {
        (None, Some(why)) => {
            tracing::error!(%why, "control planes sharing this database disagree: garbage collection paused")
        }
        (Some(_), None) => {
            tracing::info!("control planes sharing this database agree again: garbage collection resumed")
        }
        _ => {}
    }
    *paused = why;
    Ok(())
}

/// Where the database is shared across hosts (PostgreSQL): whether this host's clock is within
/// [`MAX_CLOCK_SKEW`] of the database server's (a host further off must not serve it). None for
/// one host's database (SQLite).
pub(super) async fn clock_check(store: &dyn MetaStore) -> Result<Option<Result<(), String>>, MetaError> {
    let before = now_ms();
    let Some(database) = store.database_clock_ms().await? else { return Ok(None) };
    let after = now_ms();
    Ok(Some(clock_skew(before / 2 + after / 2, database)))
}

/// Err when `local_ms` and `database_ms` (read at the same moment) differ by more than
/// [`MAX_CLOCK_SKEW`].
pub(super) fn clock_skew(local_ms: u64, database_ms: u64) -> Result<(), String> {
    let skew = local_ms.abs_diff(database_ms);
    if skew > MAX_CLOCK_SKEW.as_millis() as u64 {
        let side = if local_ms > database_ms { "ahead of" } else { "behind" };
        return Err(format!(
            "this host's clock is {:.1} s {side} the database server's; control planes sharing a database \
             compare times each other wrote, so each must be within {} s of it (run chrony or ntpd)",
            skew as f64 / 1000.0,
            MAX_CLOCK_SKEW.as_secs()
        ));
    }
    Ok(())
}

/// This host's name (the kernel's), for naming this control plane in the database.
pub(super) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Where this process listens, `address`, as only one process at a time can: the host's name
/// (for people), its kernel's boot id and this process's network namespace (which together tell
/// any two listeners apart, hosts and containers alike, whatever their names) and the address.
/// Where the boot id or namespace cannot be read, this process's own: nothing is taken for an
/// earlier run of it.
pub(super) fn listener_identity(address: std::net::SocketAddr) -> String {
    let boot = starckpt_dataplane::shm::host_id();
    let namespace = std::fs::read_link("/proc/self/ns/net").map(|ns| ns.to_string_lossy().into_owned());
    let place = match namespace {
        Ok(namespace) if !boot.is_empty() => format!("{boot} {namespace}"),
        _ => uuid::Uuid::new_v4().to_string(),
    };
    let unique = blake3::hash(place.as_bytes()).to_hex();
    format!("{} {address} {}", host_name(), &unique[..12])
}

/// Runs `pass` every `interval` (never when None) until the returned handle is dropped; a failed
/// pass is logged and the next one runs on time.
pub(super) fn every<F, Fut>(
    interval: Option<Duration>,
    what: &'static str,
    pass: F,
) -> tokio_util::task::AbortOnDropHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), MetaError>> + Send,
{
    tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        let Some(interval) = interval else { return };
        loop {
            tokio::time::sleep(interval).await;
            if let Err(error) = pass().await {
                tracing::error!(%error, "{what} pass failed");
            }
        }
    }))
}

/// [`every`] for a pass that blocks (reads a file), run on the blocking pool.
pub(super) fn every_blocking(
    interval: Option<Duration>,
    what: &'static str,
    pass: impl Fn() + Send + Sync + 'static,
) -> tokio_util::task::AbortOnDropHandle<()> {
    let pass = Arc::new(pass);
    every(interval, what, move || {
        let pass = Arc::clone(&pass);
        async move {
            let _ = tokio::task::spawn_blocking(move || pass()).await;
            Ok(())
        }
    })
}

/// Aborts checkpoints whose ranks never all committed within `timeout`, checking ten times per
/// timeout (at most once a second, at least once a minute).
pub(super) async fn reap_stale_pending(store: Arc<dyn MetaStore>, timeout: Duration) {
    let period = (timeout / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        tokio::time::sleep(period).await;
        let now = now_ms();
        match store.abort_stale_pending(now.saturating_sub(timeout.as_millis() as u64), now).await {
            Ok(aborted) => {
                for checkpoint in aborted {
                    tracing::warn!(
                        job = %checkpoint.job,
                        step = checkpoint.step,
                        parts = checkpoint.parts_committed,
                        world_size = checkpoint.world_size,
                        "aborted a checkpoint whose ranks did not all commit within {timeout:?}"
                    );
                }
            }
            Err(error) => tracing::error!(%error, "pending-checkpoint reaper failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_listener_is_known_by_its_whole_address_on_this_kernel_and_network() {
        let at = |address: &str| super::listener_identity(address.parse().unwrap());
        // The same place: the same identity (a restart there replaces its earlier run).
        assert_eq!(at("127.0.0.1:7700"), at("127.0.0.1:7700"));
        // Another port, another address on the same port (both can listen at once): another.
        assert_ne!(at("127.0.0.1:7700"), at("127.0.0.1:7701"));
        assert_ne!(at("127.0.0.1:7700"), at("127.0.0.2:7700"));
        assert_ne!(at("127.0.0.1:7700"), at("[::1]:7700"));
        assert!(at("10.1.2.3:7700").contains(" 10.1.2.3:7700 "), "{}", at("10.1.2.3:7700"));
    }

    #[test]
    fn clocks_apart_by_more_than_the_bound_are_refused() {
        let bound = super::MAX_CLOCK_SKEW.as_millis() as u64;
        assert!(super::clock_skew(1_000_000, 1_000_000 + bound).is_ok());
        assert!(super::clock_skew(1_000_000 + bound, 1_000_000).is_ok());
        let behind = super::clock_skew(1_000_000, 1_000_001 + bound).unwrap_err();
        assert!(behind.contains("behind"), "{behind}");
        let ahead = super::clock_skew(1_000_001 + bound, 1_000_000).unwrap_err();
        assert!(ahead.contains("ahead of"), "{ahead}");
    }
}
