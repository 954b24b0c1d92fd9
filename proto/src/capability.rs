//! Data-plane capabilities: what a target asks of a request before it serves it, when its cluster
//! has a key.
//!
//! The control planes and the targets of a cluster share a secret (`--cluster-key-file`). With
//! it a control plane signs capabilities: clients get READ+WRITE ones, valid on any target, from
//! the `DataCapability` call (the SDK renews them at half their life); the control plane's own
//! requests carry ones bound to the target they go to: READ+WRITE for re-replication, the tier
//! and recoveries, and ADMIN too for garbage collection. A target with the key serves a request
//! only if its `Auth.capability` is signed with that key, unexpired, bound to no target or to
//! this one, and grants the request's right: GET, HAS, STAT, CONNECT and a shared-memory attach
//! (`shm.rs`) need READ; PUT needs
//! WRITE; DELETE and LIST (which enumerates every chunk it holds) need ADMIN. Targets prove they
//! hold the key when they register and heartbeat (a capability with the TARGET right bound to
//! their own id), so a process that is not one cannot pose as a target and collect the control
//! plane's capabilities, nor take over a real target's id. A target without a key serves
//! everyone (one trusted host; it says so when it starts).
//!
//! Wire form, 43 bytes: version (1), rights (bits), scope (0: any target; 1: the target whose id
//! the MAC covers), expiry in milliseconds since the Unix epoch (u64, little-endian), then BLAKE3
//! in keyed mode over those 11 bytes followed, for scope 1, by the target's id. The key is derived
//! from the secret file's contents with BLAKE3's key derivation, so any secret of 16 bytes or more
//! will do (`head -c 32 /dev/urandom > cluster.key`). A capability is accepted until
//! [`CLOCK_SKEW`] past its expiry, so the clocks of control planes and targets must agree within
//! that.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

const VERSION: u8 = 1;
const SIGNED_BYTES: usize = 11;
/// Length of a capability on the wire.
pub const CAPABILITY_BYTES: usize = SIGNED_BYTES + blake3::OUT_LEN;
/// How long past its expiry a capability is still accepted: how far the clock of a target (or a
/// control plane checking a target's proof) may run ahead of the signer's.
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
    /// Registering and heartbeating as the target the capability is bound to (at the control
    /// plane, not a target).
    pub const TARGET: Rights = Rights(8);
    /// What a client gets, and what the control plane's copies (re-replication, tier,
    /// recoveries) carry.
    pub const CLIENT: Rights = Rights(1 | 2);
    /// What the control plane's garbage collection carries.
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
        let names: Vec<&str> =
            [(Rights::READ, "read"), (Rights::WRITE, "write"), (Rights::ADMIN, "admin"), (Rights::TARGET, "target")]
                .into_iter()
                .filter(|(right, _)| self.contains(*right))
                .map(|(_, name)| name)
                .collect();
        if names.is_empty() { f.write_str("nothing") } else { f.write_str(&names.join("+")) }
    }
}

/// Why a capability was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CapabilityError {
    #[error("the request carries no capability, and this cluster requires one (it has a key)")]
    Missing,
    #[error("the capability is malformed ({0})")]
    Malformed(String),
    #[error("the capability is not signed with this cluster's key, or is bound to another target")]
    BadSignature,
    #[error("the capability expired {0:?} ago")]
    Expired(Duration),
    #[error("the capability grants {granted}, and the request needs {needed}")]
    Lacks { needed: Rights, granted: Rights },
}

/// The secret a cluster's control planes and targets share.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterKey([u8; blake3::KEY_LEN]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// The key derived from `secret` (surrounding ASCII whitespace ignored, so a hex line with
    /// its newline works).
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

    /// A short name of this key that says nothing of it: control planes sharing a database
    /// compare theirs (a cluster's are all one key, or targets refuse some of its capabilities).
    pub fn fingerprint(&self) -> String {
        hex::encode(&blake3::keyed_hash(&self.0, b"starckpt cluster key fingerprint").as_bytes()[..8])
    }

    /// What tenants' chunk keys are derived from (`crate::address`): this key, which only
    /// holders of the cluster's secret can compute.
    pub(crate) fn chunk_key_material(&self) -> &[u8] {
        &self.0
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

    fn mac(&self, signed: &[u8], target: Option<&str>) -> blake3::Hash {
        let mut hasher = blake3::Hasher::new_keyed(&self.0);
        hasher.update(signed);
        if let Some(target) = target {
            hasher.update(target.as_bytes());
        }
        hasher.finalize()
    }

    /// A capability granting `rights` until `expires`, on the target `target` only, or on any.
    pub fn mint(&self, rights: Rights, expires: SystemTime, target: Option<&str>) -> Bytes {
        let mut token = Vec::with_capacity(CAPABILITY_BYTES);
        token.push(VERSION);
        token.push(rights.0);
        token.push(u8::from(target.is_some()));
        token.extend_from_slice(&unix_ms(expires).to_le_bytes());
        let mac = self.mac(&token, target);
        token.extend_from_slice(mac.as_bytes());
        Bytes::from(token)
    }

    /// Checks that `token` is signed with this key, bound to no target or to `target` (the
    /// verifier's own id; a target that has none yet accepts only unbound ones), unexpired at
    /// `now` (allowing [`CLOCK_SKEW`]), and grants `needed`.
    pub fn verify(
        &self,
        token: &[u8],
        needed: Rights,
        target: Option<&str>,
        now: SystemTime,
    ) -> Result<(), CapabilityError> {
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
        let bound = match signed[2] {
            0 => None,
            1 => Some(target.ok_or(CapabilityError::BadSignature)?),
            scope => return Err(CapabilityError::Malformed(format!("scope {scope}"))),
        };
        let mac: [u8; blake3::OUT_LEN] = mac.try_into().map_err(|_| CapabilityError::Malformed("short".into()))?;
        // blake3::Hash compares in constant time.
        if self.mac(signed, bound) != blake3::Hash::from(mac) {
            return Err(CapabilityError::BadSignature);
        }
        let granted = Rights(signed[1]);
        let expires = u64::from_le_bytes(signed[3..SIGNED_BYTES].try_into().expect("8 bytes"));
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

/// What a target's registration proof is bound to: its id and the address it registers, so a
/// proof seen on the wire cannot register the target at another address (a heartbeat's proof is
/// bound to the id alone: a heartbeat moves nothing).
pub fn registration_scope(target_id: &str, data_address: &str) -> String {
    format!("{target_id}\0{data_address}")
}

/// Milliseconds since the Unix epoch (0 before it).
pub fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A capability and how long it lasts from when it was asked for, as the control plane hands
/// it out (empty: the cluster has no key).
pub type Renewal = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(Bytes, Duration), String>> + Send>>;

/// Asks for a fresh capability (a client: the control plane's `DataCapability`).
pub type Renew = Box<dyn Fn() -> Renewal + Send + Sync>;

/// The capability a sender attaches to its data-plane requests, shared by all its transports:
/// none; minted here with the cluster key, per target (a control plane's own); or asked for with
/// [`Renew`] (a client's, from the control plane). Both kinds are renewed when a request finds
/// less than half their life left, so a sender idle for days still sends a valid one.
#[derive(Clone, Default)]
pub struct Credentials(Option<Arc<Source>>);

enum Source {
    /// Held per target id.
    Minted {
        key: ClusterKey,
        rights: Rights,
        lifetime: Duration,
        current: Mutex<HashMap<String, Held>>,
    },
    Asked {
        renew: Renew,
        current: RwLock<Held>,
        renewing: tokio::sync::Mutex<()>,
    },
}

/// A capability, when it was obtained and when it is to be renewed, by the holder's monotonic
/// clock (a capability's life is relative; the wall clocks of holder and signer need not agree).
#[derive(Clone)]
struct Held {
    capability: Bytes,
    /// None: never obtained (nothing held, or every ask so far failed).
    obtained: Option<Instant>,
    /// Half its life after `obtained`; after a failed renewal, when to try again; for a cluster
    /// without a key, never (until a target refuses a request: [`Credentials::invalidate`]).
    /// None: now.
    renew_at: Option<Instant>,
    /// When targets stop accepting it.
    expires: Option<Instant>,
}

impl Held {
    const NONE: Held = Held { capability: Bytes::new(), obtained: None, renew_at: None, expires: None };

    fn new(capability: Bytes, now: Instant, lifetime: Duration) -> Held {
        Held { capability, obtained: Some(now), renew_at: Some(now + lifetime / 2), expires: Some(now + lifetime) }
    }

    fn due(&self, now: Instant) -> bool {
        self.renew_at.is_none_or(|at| now >= at)
    }

    /// Still accepted for at least `margin` after `now`.
    fn good_for(&self, now: Instant, margin: Duration) -> bool {
        !self.capability.is_empty() && self.expires.is_some_and(|at| at > now + margin)
    }
}

/// How long a sender waits before it tries a failed renewal again.
const ASK_AGAIN: Duration = Duration::from_secs(30);
/// How long a request waits for a renewal while the capability held is still good this long.
const STILL_GOOD: Duration = Duration::from_secs(2);
/// Far enough never to come.
const NEVER: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

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
    /// Credentials minting their own capabilities with `key`, each bound to the target it is
    /// sent to and valid for `lifetime`.
    pub fn minted(key: ClusterKey, rights: Rights, lifetime: Duration) -> Credentials {
        Credentials(Some(Arc::new(Source::Minted { key, rights, lifetime, current: Mutex::new(HashMap::new()) })))
    }

    /// Credentials that ask `renew` for their capability when a request first needs one, and
    /// again at half its life.
    pub fn asked(renew: Renew) -> Credentials {
        let current = RwLock::new(Held::NONE);
        Credentials(Some(Arc::new(Source::Asked { renew, current, renewing: tokio::sync::Mutex::new(()) })))
    }

    /// The capability to send to `target` now (empty: none), renewed first if it is due. Minted
    /// ones need the target's id. A renewal asked for while the held capability is still good
    /// waits at most [`STILL_GOOD`]; one that fails leaves the held one (a target says so if it
    /// has expired) and is tried again after [`ASK_AGAIN`].
    pub async fn fresh(&self, target: Option<&str>) -> Bytes {
        let now = Instant::now();
        match self.0.as_deref() {
            None => Bytes::new(),
            Some(Source::Minted { key, rights, lifetime, current }) => {
                let Some(target) = target else { return Bytes::new() };
                let mut current = current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if current.get(target).is_none_or(|held| held.due(now)) {
                    let capability = key.mint(*rights, SystemTime::now() + *lifetime, Some(target));
                    current.insert(target.to_owned(), Held::new(capability, now, *lifetime));
                }
                current[target].capability.clone()
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
                if !held.due(Instant::now()) {
                    return held.capability;
                }
                // While the held one is still good, a control plane slow to answer does not hold
                // up the request: it is asked again later.
                let renewed = if held.good_for(Instant::now(), STILL_GOOD) {
                    tokio::time::timeout(STILL_GOOD, renew()).await.unwrap_or_else(|_| Err("no answer in time".into()))
                } else {
                    renew().await
                };
                let now = Instant::now();
                let next = match renewed {
                    // No key: nothing to renew until a target asks for a capability.
                    Ok((capability, _)) if capability.is_empty() => {
                        let never = now.checked_add(NEVER).unwrap_or(now + ASK_AGAIN);
                        Held { obtained: Some(now), renew_at: Some(never), ..Held::NONE }
                    }
                    Ok((capability, lifetime)) => Held::new(capability, now, lifetime),
                    Err(error) => {
                        tracing::warn!(%error, "could not renew the data-plane capability; keeping the one held");
                        Held { renew_at: Some(now + ASK_AGAIN), ..held }
                    }
                };
                let capability = next.capability.clone();
                *current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = next;
                capability
            }
        }
    }

    /// After a target refused the capability of a request sent at `sent` (UNAUTHORIZED): an
    /// asked-for capability obtained before then is forgotten, so the next request asks for a
    /// fresh one (one obtained since is already that). True if the request is worth sending once
    /// more: not for minted credentials, nor while every ask has failed (that waits
    /// [`ASK_AGAIN`]).
    pub fn invalidate(&self, sent: Instant) -> bool {
        let Some(Source::Asked { current, .. }) = self.0.as_deref() else { return false };
        let mut held = current.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        match held.obtained {
            None => false,
            Some(obtained) if obtained <= sent => {
                *held = Held::NONE;
                true
            }
            Some(_) => true,
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
        let client = key.mint(Rights::CLIENT, now + Duration::from_secs(3600), None);
        assert_eq!(client.len(), CAPABILITY_BYTES);
        assert_eq!(key.verify(&client, Rights::READ, Some("t1"), now), Ok(()));
        assert_eq!(key.verify(&client, Rights::WRITE, None, now), Ok(()));
        assert_eq!(
            key.verify(&client, Rights::ADMIN, Some("t1"), now),
            Err(CapabilityError::Lacks { needed: Rights::ADMIN, granted: Rights::CLIENT })
        );
        let admin = key.mint(Rights::ALL, now + Duration::from_secs(1), Some("t1"));
        assert_eq!(key.verify(&admin, Rights::ADMIN, Some("t1"), now), Ok(()));
        // Within the clock skew, then past it.
        assert_eq!(key.verify(&admin, Rights::ADMIN, Some("t1"), now + Duration::from_secs(30)), Ok(()));
        let late = now + Duration::from_secs(1) + CLOCK_SKEW + Duration::from_secs(5);
        assert!(matches!(key.verify(&admin, Rights::ADMIN, Some("t1"), late), Err(CapabilityError::Expired(_))));
    }

    #[test]
    fn a_bound_capability_works_on_its_target_only() {
        let key = key("0123456789abcdef0123");
        let now = SystemTime::now();
        let for_t1 = key.mint(Rights::ALL, now + Duration::from_secs(60), Some("t1"));
        assert_eq!(key.verify(&for_t1, Rights::ADMIN, Some("t1"), now), Ok(()));
        assert_eq!(key.verify(&for_t1, Rights::READ, Some("t2"), now), Err(CapabilityError::BadSignature));
        assert_eq!(key.verify(&for_t1, Rights::READ, None, now), Err(CapabilityError::BadSignature));
        // Unbinding it breaks the signature.
        let mut unbound = for_t1.to_vec();
        unbound[2] = 0;
        assert_eq!(key.verify(&unbound, Rights::READ, Some("t2"), now), Err(CapabilityError::BadSignature));
    }

    #[test]
    fn forged_altered_and_foreign_capabilities_are_refused() {
        let (ours, theirs) = (key("0123456789abcdef0123"), key("another secret of ours"));
        let now = SystemTime::now();
        let expires = now + Duration::from_secs(60);
        let verify = |token: &[u8], needed| ours.verify(token, needed, Some("t"), now);
        assert_eq!(verify(&theirs.mint(Rights::ALL, expires, None), Rights::READ), Err(CapabilityError::BadSignature));
        // Raising its own rights or expiry breaks the signature.
        let mut raised = ours.mint(Rights::CLIENT, expires, None).to_vec();
        raised[1] = Rights::ALL.bits();
        assert_eq!(verify(&raised, Rights::ADMIN), Err(CapabilityError::BadSignature));
        let mut extended = ours.mint(Rights::CLIENT, expires, None).to_vec();
        extended[10] = 0x7f;
        assert_eq!(verify(&extended, Rights::READ), Err(CapabilityError::BadSignature));
        assert_eq!(verify(b"", Rights::READ), Err(CapabilityError::Missing));
        assert!(matches!(verify(&[1u8; 42], Rights::READ), Err(CapabilityError::Malformed(_))));
        for (at, value) in [(0, 2u8), (2, 7u8)] {
            let mut bad = ours.mint(Rights::CLIENT, expires, None).to_vec();
            bad[at] = value;
            assert!(matches!(verify(&bad, Rights::READ), Err(CapabilityError::Malformed(_))), "byte {at}");
        }
    }

    #[test]
    fn keys_come_from_secrets_long_enough() {
        assert!(ClusterKey::from_secret(b"  short \n").is_err());
        let secret = ClusterKey::generate_secret();
        assert_eq!(secret.len(), 64);
        // Whitespace around a secret (a trailing newline) does not change the key.
        let (a, b) = (key(&secret), key(&format!("{secret}\n")));
        let now = SystemTime::now();
        let token = a.mint(Rights::READ, now + Duration::from_secs(9), None);
        assert_eq!(b.verify(&token, Rights::READ, None, now), Ok(()));
    }

    /// Lifetime of the capabilities of the two tests below, long enough that a busy machine does
    /// not take half of it between two calls meant to fall in the first half.
    const LIFETIME: Duration = Duration::from_secs(4);
    const PAST_HALF_LIFE: Duration = Duration::from_millis(2500);

    #[tokio::test]
    async fn minted_credentials_are_per_target_and_renew_at_half_life() {
        let key = key("0123456789abcdef0123");
        let minted = Credentials::minted(key.clone(), Rights::ALL, LIFETIME);
        assert!(minted.fresh(None).await.is_empty(), "minted ones are for a named target");
        let first = minted.fresh(Some("t1")).await;
        assert_eq!(key.verify(&first, Rights::ADMIN, Some("t1"), SystemTime::now()), Ok(()));
        assert_eq!(minted.fresh(Some("t1")).await, first, "reused while more than half its life is left");
        let other = minted.fresh(Some("t2")).await;
        assert_eq!(key.verify(&other, Rights::ADMIN, Some("t2"), SystemTime::now()), Ok(()));
        tokio::time::sleep(PAST_HALF_LIFE).await;
        assert_ne!(minted.fresh(Some("t1")).await, first, "renewed past half its life");
        assert!(Credentials::default().fresh(Some("t1")).await.is_empty());
        assert!(!minted.invalidate(Instant::now()));
    }

    /// Credentials asking a counter-keeping `answer(n)` for the n-th capability.
    fn asking(
        answer: impl Fn(usize) -> Result<(Bytes, Duration), String> + Send + Sync + 'static,
    ) -> (Credentials, Arc<std::sync::atomic::AtomicUsize>) {
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&asked);
        let credentials = Credentials::asked(Box::new(move || {
            let answer = answer(counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
            Box::pin(async move { answer })
        }));
        (credentials, asked)
    }

    #[tokio::test]
    async fn asked_credentials_renew_at_half_life_and_keep_what_they_hold_when_renewal_fails() {
        let key = key("0123456789abcdef0123");
        let signer = key.clone();
        let (credentials, asked) = asking(move |n| {
            let capability = signer.mint(Rights::CLIENT, SystemTime::now() + LIFETIME, None);
            if n < 2 { Ok((capability, LIFETIME)) } else { Err("control plane down".into()) }
        });
        let count = || asked.load(std::sync::atomic::Ordering::SeqCst);
        let got = credentials.fresh(None).await;
        assert_eq!(key.verify(&got, Rights::WRITE, None, SystemTime::now()), Ok(()));
        assert_eq!(credentials.fresh(Some("any")).await, got);
        assert_eq!(count(), 1);
        tokio::time::sleep(PAST_HALF_LIFE).await;
        let renewed = credentials.fresh(None).await;
        assert_ne!(renewed, got);
        assert_eq!(count(), 2);
        tokio::time::sleep(PAST_HALF_LIFE).await;
        assert_eq!(credentials.fresh(None).await, renewed, "a failed renewal keeps what is held");
        assert_eq!(credentials.fresh(None).await, renewed);
        assert_eq!(count(), 3, "and waits before it asks again");
    }

    #[tokio::test]
    async fn with_the_control_plane_down_requests_do_not_wait_for_it_one_after_another() {
        let (credentials, asked) = asking(|_| Err("control plane down".into()));
        let count = || asked.load(std::sync::atomic::Ordering::SeqCst);
        assert!(credentials.fresh(None).await.is_empty());
        assert_eq!(count(), 1);
        // The refusal that follows sends nothing again, and nothing is asked before ASK_AGAIN.
        assert!(!credentials.invalidate(Instant::now()));
        assert!(credentials.fresh(None).await.is_empty());
        assert_eq!(count(), 1);
    }

    #[tokio::test]
    async fn without_a_key_nothing_is_asked_again_until_a_target_refuses() {
        let (credentials, asked) = asking(|_| Ok((Bytes::new(), Duration::ZERO)));
        let count = || asked.load(std::sync::atomic::Ordering::SeqCst);
        assert!(credentials.fresh(None).await.is_empty());
        assert!(credentials.fresh(None).await.is_empty());
        assert_eq!(count(), 1);
        // A target refused a request (a key was added since): asked again, once, however many
        // requests sent before the new answer were refused.
        let sent = Instant::now();
        assert!(credentials.invalidate(sent));
        assert!(credentials.fresh(None).await.is_empty());
        assert_eq!(count(), 2);
        assert!(credentials.invalidate(sent), "sent again, with what was asked for since");
        assert!(credentials.fresh(None).await.is_empty());
        assert_eq!(count(), 2, "a refusal of the old one does not throw away the new one");
    }
}
