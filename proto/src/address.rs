//! Chunk addresses, and why deduplication never crosses tenants.
//!
//! A chunk of a job outside every tenant's namespace is addressed by the BLAKE3 of its bytes. A
//! chunk of a tenant's job is addressed by BLAKE3 in keyed mode, keyed with the tenant's chunk
//! key, of that plain BLAKE3: `address = keyed_hash(K_t, blake3(bytes))`. Two tenants storing the
//! same bytes therefore store two chunks, and a tenant's HAS or GET can only find its own: with a
//! cluster key, `K_t` is derived from it ([`Addressing::tenant`]), so no one without that key or
//! `K_t` (which the control plane hands the tenant's clients) can compute a tenant's addresses, to
//! probe for content or to read it.
//!
//! Each manifest records the key its chunks are addressed with, so a checkpoint stays readable
//! whatever becomes of the cluster key (a re-key, a cluster rebuilt from the tier under another
//! one): `K_t` reveals nothing the manifest does not, since the manifest lists every address. New
//! checkpoints use the key derived now; after a re-key, a tenant's chunks are stored once more.
//!
//! Hashing stays plain BLAKE3 everywhere bytes are hashed (as they are copied, received or
//! decoded); only the comparison with an address goes through [`Addressing::address`], one
//! 32-byte keyed hash. A PUT of a tenant's chunk carries the key and the plain BLAKE3 of the
//! chunk's bytes ([`ChunkName`]): the target checks that the address is that key's hash of that
//! content hash, then the bytes against the content hash as for any chunk. An address therefore
//! always binds its bytes, whoever sends them: storing other bytes under an address would take a
//! key that hashes their content to it. Without a cluster key (one trusted host) `K_t` is derived
//! from the tenant's name alone: deduplication still stays within a tenant, but addresses are not
//! secret.

use crate::capability::ClusterKey;
use crate::{ChunkHash, TenantName};

const KEY_CONTEXT: &str = "starckpt 2026-12-03 tenant chunk address key";

/// A tenant's chunk key.
pub type ChunkKey = [u8; blake3::KEY_LEN];

/// How the chunks of one checkpoint are addressed: plain BLAKE3, or keyed with a tenant's chunk
/// key.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Addressing(Option<ChunkKey>);

impl std::fmt::Debug for Addressing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            None => f.write_str("Addressing::Plain"),
            // A name that says nothing of the key.
            Some(key) => {
                let id = blake3::keyed_hash(key, b"starckpt chunk key id");
                write!(f, "Addressing::Keyed({})", hex::encode(&id.as_bytes()[..4]))
            }
        }
    }
}

impl Addressing {
    /// Plain BLAKE3: jobs outside every tenant's namespace.
    pub fn plain() -> Addressing {
        Addressing(None)
    }

    /// The addressing of `tenant`'s new chunks in a cluster with key `cluster` (or none).
    pub fn tenant(cluster: Option<&ClusterKey>, tenant: &TenantName) -> Addressing {
        let mut material = Vec::with_capacity(blake3::KEY_LEN + tenant.as_str().len());
        if let Some(cluster) = cluster {
            material.extend_from_slice(cluster.chunk_key_material());
        }
        material.extend_from_slice(tenant.as_str().as_bytes());
        Addressing(Some(blake3::derive_key(KEY_CONTEXT, &material)))
    }

    /// The addressing of the new chunks of the job named `job` (as stored): its tenant's, or
    /// plain.
    pub fn of_job(cluster: Option<&ClusterKey>, job: &crate::JobName) -> Addressing {
        match job.tenant().map(TenantName::try_from) {
            Some(Ok(tenant)) => Addressing::tenant(cluster, &tenant),
            _ => Addressing::plain(),
        }
    }

    /// From the wire: a 32-byte key, or nothing for plain BLAKE3.
    pub fn from_wire(key: &[u8]) -> Result<Addressing, crate::ModelError> {
        match key.len() {
            0 => Ok(Addressing::plain()),
            _ => key
                .try_into()
                .map(|key| Addressing(Some(key)))
                .map_err(|_| crate::model::field("chunk key", format!("{} bytes, expected 32", key.len()))),
        }
    }

    /// The key, as the wire carries it (empty for plain BLAKE3).
    pub fn to_wire(&self) -> bytes::Bytes {
        self.0.map_or_else(bytes::Bytes::new, |key| bytes::Bytes::copy_from_slice(&key))
    }

    /// Whether addresses are keyed (a tenant's chunks).
    pub fn is_keyed(&self) -> bool {
        self.0.is_some()
    }

    /// The address of the chunk whose bytes' plain BLAKE3 is `content`.
    pub fn address(&self, content: &ChunkHash) -> ChunkHash {
        match &self.0 {
            None => *content,
            Some(key) => ChunkHash(*blake3::keyed_hash(key, &content.0).as_bytes()),
        }
    }

    /// The name a PUT of the chunk whose bytes hash to `content` carries.
    pub fn name(&self, content: ChunkHash) -> ChunkName {
        ChunkName { address: self.address(&content), content, addressing: *self }
    }
}

/// A chunk as a PUT names it: its address, the plain BLAKE3 of its bytes, and how the one is
/// made from the other. A plain chunk's address is its content hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkName {
    pub address: ChunkHash,
    pub content: ChunkHash,
    pub addressing: Addressing,
}

impl ChunkName {
    /// A chunk addressed by plain BLAKE3.
    pub fn plain(hash: ChunkHash) -> ChunkName {
        ChunkName { address: hash, content: hash, addressing: Addressing::plain() }
    }

    /// Checks a PUT's name (its address, key and content hash as received): the address must be
    /// the key's hash of the content hash, or for a plain chunk the content hash itself.
    pub fn checked(address: ChunkHash, key: &[u8], content: &[u8]) -> Result<ChunkName, String> {
        let addressing = Addressing::from_wire(key).map_err(|e| e.to_string())?;
        if !addressing.is_keyed() {
            if !content.is_empty() && content != address.0 {
                return Err("a chunk without a key is addressed by its content hash".into());
            }
            return Ok(ChunkName::plain(address));
        }
        let content = ChunkHash::try_from(content).map_err(|e| format!("content hash: {e}"))?;
        let name = addressing.name(content);
        if name.address != address {
            return Err(format!("address {address} is not the key's hash of content {content}"));
        }
        Ok(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str) -> TenantName {
        TenantName::try_from(name).unwrap()
    }

    #[test]
    fn tenants_address_the_same_bytes_apart_and_plain_stays_blake3() {
        let content = ChunkHash::of(b"the same weights");
        let key = ClusterKey::from_secret(b"0123456789abcdef0123").unwrap();
        let acme = Addressing::tenant(Some(&key), &tenant("acme"));
        let other = Addressing::tenant(Some(&key), &tenant("other"));
        assert_eq!(Addressing::plain().address(&content), content);
        assert_ne!(acme.address(&content), content);
        assert_ne!(acme.address(&content), other.address(&content));
        // Without the cluster key, another key: addresses depend on the secret.
        assert_ne!(Addressing::tenant(None, &tenant("acme")).address(&content), acme.address(&content));
        let another = ClusterKey::from_secret(b"another secret, 16+ bytes").unwrap();
        assert_ne!(Addressing::tenant(Some(&another), &tenant("acme")).address(&content), acme.address(&content));
        // The key as the wire carries it gives the same addresses.
        assert_eq!(Addressing::from_wire(&acme.to_wire()).unwrap(), acme);
        assert_eq!(Addressing::from_wire(&[]).unwrap(), Addressing::plain());
        assert!(Addressing::plain().to_wire().is_empty());
        assert!(Addressing::from_wire(&[1; 16]).is_err());
        let job = crate::JobName::try_from("acme/llama").unwrap();
        assert_eq!(Addressing::of_job(Some(&key), &job), acme);
        assert_eq!(Addressing::of_job(Some(&key), &crate::JobName::try_from("llama").unwrap()), Addressing::plain());
        // Debug names a key without showing it.
        let shown = format!("{acme:?}");
        assert!(shown.starts_with("Addressing::Keyed(") && !shown.contains(&hex::encode(acme.to_wire())), "{shown}");
    }

    #[test]
    fn a_target_accepts_only_names_whose_address_binds_the_content() {
        let key = ClusterKey::from_secret(b"0123456789abcdef0123").unwrap();
        let acme = Addressing::tenant(Some(&key), &tenant("acme"));
        let other = Addressing::tenant(Some(&key), &tenant("other"));
        let content = ChunkHash::of(b"bytes");
        let name = acme.name(content);
        assert_eq!(ChunkName::checked(name.address, &acme.to_wire(), &content.0).unwrap(), name);
        // Another key, another content, a short key or content hash, no key.
        assert!(ChunkName::checked(name.address, &other.to_wire(), &content.0).is_err());
        assert!(ChunkName::checked(name.address, &acme.to_wire(), &ChunkHash::of(b"other").0).is_err());
        assert!(ChunkName::checked(name.address, &acme.to_wire(), &[0; 5]).is_err());
        assert!(ChunkName::checked(name.address, &[7; 31], &content.0).is_err());
        assert!(ChunkName::checked(name.address, &[], &content.0).is_err());
        assert_eq!(ChunkName::checked(content, &[], &[]).unwrap(), ChunkName::plain(content));
        assert_eq!(ChunkName::checked(content, &[], &content.0).unwrap(), ChunkName::plain(content));
    }
}
