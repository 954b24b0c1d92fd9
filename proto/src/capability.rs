//! Data-plane capabilities: what a target asks of a request before it serves it, when its cluster
//! has a key.
//!
//! The control planes and the targets of a cluster share a secret (`--cluster-key-file`). With
//! it a control plane signs capabilities: clients get `READ | WRITE` ones from the
//! `DataCapability` call (the SDK renews them at half their life), and the control plane's own
//! garbage collection, re-replication and tier uploads carry `ADMIN` ones. A target with the key
//! serves a request only if its `Auth.capability` is signed with that key, unexpired, and grants
//! the request's right: GET, HAS, STAT and CONNECT need READ; PUT needs WRITE; DELETE and LIST
//! (which enumerates every chunk it holds) need ADMIN. So a peer that can reach a target's port
//! cannot delete chunks or list them, and one without a capability from the control plane cannot
//! read or write either. A target without a key serves everyone (one trusted host; it says so
//! when it starts).
//!
//! Wire form, 42 bytes: version (1), rights (bits), expiry in milliseconds since the Unix epoch
//! (u64, little-endian), then BLAKE3 in keyed mode over those 10 bytes. The key is derived from
//! the secret file's contents with BLAKE3's key derivation, so any secret of 16 bytes or more
//! will do (`head -c 32 /dev/urandom > cluster.key`). Clocks of control planes and targets must
//! agree within [`CLOCK_SKEW`].

use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

const VERSION: u8 = 1;
const SIGNED_BYTES: usize = 10;
/// Length of a capability on the wire.
pub const CAPABILITY_BYTES: usize = SIGNED_BYTES + blake3::OUT_LEN;
/// How far a target's clock may run ahead of the control plane's before a fresh capability looks
/// expired to it.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);
/// The shortest secret accepted as a cluster key.
pub const MIN_SECRET_BYTES: usize = 16;
const KEY_CONTEXT: &str = "starckpt 2026-12-01 data-plane capability key";

/// What a capability lets its bearer do on a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rights(u8);

impl Rights {
    /// GET, HAS, STAT, CONNECT.
    pub const READ: Rights = Rights(1);
    /// PUT.
    pub const WRITE: Rights = Rights(2);
    /// DELETE and LIST.
    pub const ADMIN: Rights = Rights(4);
    /// What a client gets.
    pub const CLIENT: Rights = Rights(1 | 2);
    /// What the control plane gives itself.
    pub const ALL: Rights = Rights(1 | 2 | 4);

    pub fn contains(self, other: Rights) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn bits(self) -> u8 {
        self.0
    }
}

impl std::fmt::Display for Rights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = [(Rights::READ, "read"), (Rights::WRITE, "write"), (Rights::ADMIN, "admin")]
            .into_iter()
            .filter(|(right, _)| self.contains(*right))
            .map(|(_, name)| name)
            .collect();
        if names.is_empty() { f.write_str("nothing") } else { f.write_str(&names.join("+")) }
    }
}

/// Why a target refused a capability.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CapabilityError {
    #[error("the request carries no capability, and this target requires one (its cluster has a key)")]
    Missing,
    #[error("the capability is malformed ({0})")]
    Malformed(String),
    #[error("the capability is not signed with this target's cluster key")]
    BadSignature,
    #[error("the capability expired {0:?} ago")]
    Expired(Duration),
    #[error("the capability grants {granted}, and the request needs {needed}")]
    Lacks { needed: Rights, granted: Rights },
}

/// The secret a cluster's control planes and targets share.
#[derive(Clone)]
pub struct ClusterKey([u8; blake3::KEY_LEN]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// The key derived from `secret` (surrounding whitespace ignored, so a hex line works).
    pub fn from_secret(secret: &[u8]) -> Result<ClusterKey, String> {
        let secret = secret.trim_ascii();
        if secret.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "a cluster key needs a secret of at least {MIN_SECRET_BYTES} bytes, this one has {}",
                secret.len()
            ));
        }
        Ok(ClusterKey(blake3::derive_key(KEY_CONTEXT, secret)))
    }

    /// The key in the secret file at `path`.
    pub fn from_file(path: &std::path::Path) -> Result<ClusterKey, String> {
        let secret = std::fs::read(path).map_err(|e| format!("reading cluster key {}: {e}", path.display()))?;
        ClusterKey::from_secret(&secret).map_err(|e| format!("cluster key {}: {e}", path.display()))
    }

    /// A fresh random secret, as hex (what `starckpt dev` writes to its key file).
    pub fn generate_secret() -> String {
        use rand::RngCore;
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        hex::encode(secret)
    }

    /// A capability granting `rights` until `expires`.
    pub fn mint(&self, rights: Rights, expires: SystemTime) -> Bytes {
        let mut token = Vec::with_capacity(CAPABILITY_BYTES);
        token.push(VERSION);
        token.push(rights.0);
        token.extend_from_slice(&unix_ms(expires).to_le_bytes());
        let mac = blake3::keyed_hash(&self.0, &token);
        token.extend_from_slice(mac.as_bytes());
        Bytes::from(token)
    }

    /// Checks that `token` is signed with this key, unexpired at `now` (allowing [`CLOCK_SKEW`]),
    /// and grants `needed`.
    pub fn verify(&self, token: &[u8], needed: Rights, now: SystemTime) -> Result<(), CapabilityError> {
        if token.is_empty() {
            return Err(CapabilityError::Missing);
        }
        if token.len() != CAPABILITY_BYTES {
            return Err(CapabilityError::Malformed(format!("{} bytes, not {CAPABILITY_BYTES}", token.len())));
        }
        if token[0] != VERSION {
            return Err(CapabilityError::Malformed(format!("version {}", token[0])));
        }
        let (signed, mac) = token.split_at(SIGNED_BYTES);
        let mac: [u8; blake3::OUT_LEN] = mac.try_into().map_err(|_| CapabilityError::Malformed("short".into()))?;
        // blake3::Hash compares in constant time.
        if blake3::keyed_hash(&self.0, signed) != blake3::Hash::from(mac) {
            return Err(CapabilityError::BadSignature);
        }
        let granted = Rights(signed[1]);
        let expires = u64::from_le_bytes(signed[2..SIGNED_BYTES].try_into().expect("8 bytes"));
        let late = unix_ms(now).saturating_sub(expires.saturating_add(CLOCK_SKEW.as_millis() as u64));
        if late > 0 {
            return Err(CapabilityError::Expired(Duration::from_millis(late)));
        }
        if !granted.contains(needed) {
            return Err(CapabilityError::Lacks { needed, granted });
        }
        Ok(())
    }
}

/// Milliseconds since the Unix epoch (0 before it).
pub fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A capability and when it expires, as the control plane hands it out (empty: the cluster has no
/// key).
pub type Renewal = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(Bytes, SystemTime), String>> + Send>>;

/// Asks for a fresh capability (a client: the control plane's `DataCapability`).
pub type Renew = Box<dyn Fn() -> Renewal + Send + Sync>;

/// The capability a sender attaches to its data-plane requests, shared by all its transports:
/// none; minted here with the cluster key (a control plane's own); or asked for with [`Renew`]
/// (a client's, from the control plane). Both kinds are renewed when a request finds less than
/// half their life left, so a sender idle for days still sends a valid one.
#[derive(Clone, Default)]
pub struct Credentials(Option<Arc<Source>>);

enum Source {
    Minted { key: ClusterKey, rights: Rights, lifetime: Duration, current: Mutex<Held> },
    Asked { renew: Renew, current: RwLock<Held>, renewing: tokio::sync::Mutex<()> },
}

/// A capability, when it was obtained and when it expires; after a failed renewal, when to try
/// again.
#[derive(Clone)]
struct Held {
    capability: Bytes,
    obtained: SystemTime,
    expires: SystemTime,
    retry_at: SystemTime,
}

impl Held {
    const NONE: Held =
        Held { capability: Bytes::new(), obtained: UNIX_EPOCH, expires: UNIX_EPOCH, retry_at: UNIX_EPOCH };

    /// Less than half its life left (or none yet), and no failed renewal asking to wait.
    fn due(&self, now: SystemTime) -> bool {
        let half_life = self.expires.duration_since(self.obtained).unwrap_or_default() / 2;
        now >= self.obtained + half_life && now >= self.retry_at
    }
}

/// How long a sender whose cluster has no key waits before it asks again (a key may be added), and
/// one whose renewal failed before it tries again.
const ASK_AGAIN: Duration = Duration::from_secs(30);
/// How long a request waits for a renewal while the capability held is still good this long.
const STILL_GOOD: Duration = Duration::from_secs(2);

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.as_deref() {
            None => f.write_str("Credentials(none)"),
            Some(Source::Asked { .. }) => f.write_str("Credentials(asked for)"),
            Some(Source::Minted { rights, .. }) => write!(f, "Credentials(minted {rights})"),
        }
    }
}

impl Credentials {
    /// Credentials minting their own capabilities with `key`, each valid for `lifetime`.
    pub fn minted(key: ClusterKey, rights: Rights, lifetime: Duration) -> Credentials {
        Credentials(Some(Arc::new(Source::Minted { key, rights, lifetime, current: Mutex::new(Held::NONE) })))
    }

    /// Credentials that ask `renew` for their capability when a request first needs one, and
    /// again at half its life.
    pub fn asked(renew: Renew) -> Credentials {
        let current = RwLock::new(Held::NONE);
        Credentials(Some(Arc::new(Source::Asked { renew, current, renewing: tokio::sync::Mutex::new(()) })))
    }

    /// The capability to send now (empty: none), renewed first if it is due. A renewal that fails
    /// leaves the one held (a target says so if it has expired) and is tried again after
    /// [`ASK_AGAIN`].
    pub async fn fresh(&self) -> Bytes {
        let now = SystemTime::now();
        match self.0.as_deref() {
            None => Bytes::new(),
            Some(Source::Minted { key, rights, lifetime, current }) => {
                let mut current = current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if current.due(now) {
                    let expires = now + *lifetime;
                    *current = Held { capability: key.mint(*rights, expires), obtained: now, expires, retry_at: now };
                }
                current.capability.clone()
            }
            Some(Source::Asked { renew, current, renewing }) => {
                let read =
                    |current: &RwLock<Held>| current.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
                let held = read(current);
                if !held.due(now) {
                    return held.capability;
                }
                // One renewal at a time; the others wait for it and take what it got.
                let _renewing = renewing.lock().await;
                let held = read(current);
                if !held.due(SystemTime::now()) {
                    return held.capability;
                }
                // While the held one is still good, a control plane slow to answer does not hold
                // up the request: it is asked again later.
                let renewed = if held.expires > SystemTime::now() + STILL_GOOD {
                    tokio::time::timeout(STILL_GOOD, renew()).await.unwrap_or_else(|_| Err("no answer in time".into()))
                } else {
                    renew().await
                };
                let now = SystemTime::now();
                let next = match renewed {
                    Ok((capability, _)) if capability.is_empty() => {
                        Held { capability, obtained: now, expires: now, retry_at: now + ASK_AGAIN }
                    }
                    Ok((capability, expires)) => Held { capability, obtained: now, expires, retry_at: now },
                    Err(error) => {
                        tracing::warn!(%error, "could not renew the data-plane capability; keeping the one held");
                        Held { retry_at: now + ASK_AGAIN, ..held }
                    }
                };
                let capability = next.capability.clone();
                *current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = next;
                capability
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(secret: &str) -> ClusterKey {
        ClusterKey::from_secret(secret.as_bytes()).unwrap()
    }

    #[test]
    fn a_capability_grants_its_rights_until_it_expires() {
        let key = key("0123456789abcdef0123");
        let now = SystemTime::now();
        let client = key.mint(Rights::CLIENT, now + Duration::from_secs(3600));
        assert_eq!(client.len(), CAPABILITY_BYTES);
        assert_eq!(key.verify(&client, Rights::READ, now), Ok(()));
        assert_eq!(key.verify(&client, Rights::WRITE, now), Ok(()));
        assert_eq!(
            key.verify(&client, Rights::ADMIN, now),
            Err(CapabilityError::Lacks { needed: Rights::ADMIN, granted: Rights::CLIENT })
        );
        let admin = key.mint(Rights::ALL, now + Duration::from_secs(1));
        assert_eq!(key.verify(&admin, Rights::ADMIN, now), Ok(()));
        // Within the clock skew, then past it.
        assert_eq!(key.verify(&admin, Rights::ADMIN, now + Duration::from_secs(30)), Ok(()));
        let late = now + Duration::from_secs(1) + CLOCK_SKEW + Duration::from_secs(5);
        assert!(matches!(key.verify(&admin, Rights::ADMIN, late), Err(CapabilityError::Expired(_))));
    }

    #[test]
    fn forged_altered_and_foreign_capabilities_are_refused() {
        let (ours, theirs) = (key("0123456789abcdef0123"), key("another secret of ours"));
        let now = SystemTime::now();
        let expires = now + Duration::from_secs(60);
        assert_eq!(
            ours.verify(&theirs.mint(Rights::ALL, expires), Rights::READ, now),
            Err(CapabilityError::BadSignature)
        );
        // Raising its own rights or expiry breaks the signature.
        let mut raised = ours.mint(Rights::CLIENT, expires).to_vec();
        raised[1] = Rights::ALL.bits();
        assert_eq!(ours.verify(&raised, Rights::ADMIN, now), Err(CapabilityError::BadSignature));
        let mut extended = ours.mint(Rights::CLIENT, expires).to_vec();
        extended[9] = 0x7f;
        assert_eq!(ours.verify(&extended, Rights::READ, now), Err(CapabilityError::BadSignature));
        assert_eq!(ours.verify(b"", Rights::READ, now), Err(CapabilityError::Missing));
        assert!(matches!(ours.verify(&[1u8; 41], Rights::READ, now), Err(CapabilityError::Malformed(_))));
        let mut version = ours.mint(Rights::CLIENT, expires).to_vec();
        version[0] = 2;
        assert!(matches!(ours.verify(&version, Rights::READ, now), Err(CapabilityError::Malformed(_))));
    }

    #[test]
    fn keys_come_from_secrets_long_enough() {
        assert!(ClusterKey::from_secret(b"  short \n").is_err());
        let secret = ClusterKey::generate_secret();
        assert_eq!(secret.len(), 64);
        // Whitespace around a secret (a trailing newline) does not change the key.
        let (a, b) = (key(&secret), key(&format!("{secret}\n")));
        let now = SystemTime::now();
        assert_eq!(b.verify(&a.mint(Rights::READ, now + Duration::from_secs(9)), Rights::READ, now), Ok(()));
    }

    #[tokio::test]
    async fn credentials_renew_at_half_life_and_keep_what_they_hold_when_renewal_fails() {
        let key = key("0123456789abcdef0123");
        let minted = Credentials::minted(key.clone(), Rights::ALL, Duration::from_millis(200));
        let first = minted.fresh().await;
        assert_eq!(key.verify(&first, Rights::ADMIN, SystemTime::now()), Ok(()));
        assert_eq!(minted.fresh().await, first, "reused while more than half its life is left");
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_ne!(minted.fresh().await, first, "renewed past half its life");
        assert!(Credentials::default().fresh().await.is_empty());

        // Asked for: once per half life, not per request; a failed renewal keeps the old one.
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (counter, signer) = (Arc::clone(&asked), key.clone());
        let credentials = Credentials::asked(Box::new(move || {
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let expires = SystemTime::now() + Duration::from_millis(200);
            let capability = signer.mint(Rights::CLIENT, expires);
            Box::pin(async move { if n < 2 { Ok((capability, expires)) } else { Err("control plane down".into()) } })
        }));
        let got = credentials.fresh().await;
        assert_eq!(key.verify(&got, Rights::WRITE, SystemTime::now()), Ok(()));
        assert_eq!(credentials.fresh().await, got);
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(150)).await;
        let renewed = credentials.fresh().await;
        assert_ne!(renewed, got);
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(credentials.fresh().await, renewed, "a failed renewal keeps what is held");
        assert_eq!(credentials.fresh().await, renewed);
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 3, "and waits before it asks again");
    }
}
