//! Chunk addresses, and why deduplication never crosses tenants.
//!
//! A chunk of a job outside every tenant's namespace is addressed by the BLAKE3 of its bytes. A
//! chunk of a tenant's job is addressed by BLAKE3 in keyed mode, keyed with the tenant's chunk
//! key, of that plain BLAKE3: `address = keyed_hash(K_t, blake3(bytes))`. Two tenants storing the
//! same bytes therefore store two chunks, and a tenant's HAS or GET can only find its own: with a
//! cluster key, `K_t` is derived from it ([`Addressing::tenant`]), so no one without the key (a
//! target, a control plane, the tenant's own clients, who get `K_t` from the control plane) can
//! compute another tenant's addresses, to probe for content or to read it.
//!
//! Hashing stays plain BLAKE3 everywhere bytes are hashed (as they are copied, received or
//! decoded); only the comparison with the expected address goes through [`Addressing::address`],
//! one 32-byte keyed hash. A PUT of a tenant's chunk names the tenant and the plain BLAKE3 of the
//! chunk's bytes ([`ChunkName`]): the target derives `K_t` itself, checks the address, then checks
//! the bytes against the plain hash as it does for any chunk, so a chunk's address always binds
//! its bytes whoever sends them. Without a cluster key (one trusted host) `K_t` is derived from
//! the tenant's name alone: deduplication still stays within a tenant, but addresses are not
//! secret.

use std::sync::Arc;

use crate::capability::ClusterKey;
use crate::{ChunkHash, TenantName};

const KEY_CONTEXT: &str = "starckpt 2026-12-03 tenant chunk address key";

/// How the chunks of one job are addressed: plain BLAKE3, or keyed with a tenant's chunk key.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Addressing(Option<Arc<Keyed>>);

#[derive(PartialEq, Eq)]
struct Keyed {
    tenant: Arc<str>,
    key: [u8; blake3::KEY_LEN],
}

impl std::fmt::Debug for Addressing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            None => f.write_str("Addressing::Plain"),
            Some(keyed) => write!(f, "Addressing::Tenant({})", keyed.tenant),
        }
    }
}

impl Addressing {
    /// Plain BLAKE3: jobs outside every tenant's namespace.
    pub fn plain() -> Addressing {
        Addressing(None)
    }

    /// The addressing of `tenant`'s chunks in a cluster with key `cluster` (or none).
    pub fn tenant(cluster: Option<&ClusterKey>, tenant: &TenantName) -> Addressing {
        let mut material = Vec::with_capacity(blake3::KEY_LEN + tenant.as_str().len());
        if let Some(cluster) = cluster {
            material.extend_from_slice(cluster.chunk_key_material());
        }
        material.extend_from_slice(tenant.as_str().as_bytes());
        let key = blake3::derive_key(KEY_CONTEXT, &material);
        Addressing(Some(Arc::new(Keyed { tenant: tenant.as_str().into(), key })))
    }

    /// The addressing of the job named `job` (as stored): its tenant's, or plain.
    pub fn of_job(cluster: Option<&ClusterKey>, job: &crate::JobName) -> Addressing {
        match job.tenant().map(TenantName::try_from) {
            Some(Ok(tenant)) => Addressing::tenant(cluster, &tenant),
            _ => Addressing::plain(),
        }
    }

    /// From what the control plane hands a client: the tenant (empty: plain) and its key.
    pub fn from_wire(tenant: &str, key: &[u8]) -> Result<Addressing, crate::ModelError> {
        if tenant.is_empty() {
            return match key.is_empty() {
                true => Ok(Addressing::plain()),
                false => Err(crate::model::field("chunk key", "a key without a tenant")),
            };
        }
        let tenant = TenantName::try_from(tenant)?;
        let key: [u8; blake3::KEY_LEN] = key
            .try_into()
            .map_err(|_| crate::model::field("chunk key", format!("{} bytes, expected 32", key.len())))?;
        Ok(Addressing(Some(Arc::new(Keyed { tenant: tenant.as_str().into(), key }))))
    }

    /// The tenant whose key addresses these chunks; None for plain BLAKE3.
    pub fn tenant_name(&self) -> Option<&str> {
        self.0.as_ref().map(|keyed| &*keyed.tenant)
    }

    /// The key, to hand a client (empty for plain BLAKE3).
    pub fn key_bytes(&self) -> &[u8] {
        self.0.as_ref().map_or(&[], |keyed| &keyed.key[..])
    }

    /// The address of the chunk whose bytes' plain BLAKE3 is `content`.
    pub fn address(&self, content: &ChunkHash) -> ChunkHash {
        match &self.0 {
            None => *content,
            Some(keyed) => ChunkHash(*blake3::keyed_hash(&keyed.key, &content.0).as_bytes()),
        }
    }

    /// The name a PUT of the chunk whose bytes hash to `content` carries.
    pub fn name(&self, content: ChunkHash) -> ChunkName {
        ChunkName { address: self.address(&content), content, tenant: self.0.as_ref().map(|k| Arc::clone(&k.tenant)) }
    }
}

/// A chunk as a PUT names it: its address, the plain BLAKE3 of its bytes and, for a tenant's
/// chunk, the tenant whose key the address is keyed with. A plain chunk's address is its content
/// hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkName {
    pub address: ChunkHash,
    pub content: ChunkHash,
    pub tenant: Option<Arc<str>>,
}

impl ChunkName {
    /// A chunk addressed by plain BLAKE3.
    pub fn plain(hash: ChunkHash) -> ChunkName {
        ChunkName { address: hash, content: hash, tenant: None }
    }

    /// Checks a PUT's name on a target of a cluster with key `cluster` (or none): a tenant's
    /// address must be its key's hash of the content hash. Returns the name, or why not.
    pub fn checked(
        address: ChunkHash,
        tenant: &str,
        content: &[u8],
        cluster: Option<&ClusterKey>,
    ) -> Result<ChunkName, String> {
        if tenant.is_empty() {
            if !content.is_empty() && content != address.0 {
                return Err("a chunk outside every tenant's namespace is addressed by its content hash".into());
            }
            return Ok(ChunkName::plain(address));
        }
        let tenant = TenantName::try_from(tenant).map_err(|e| e.to_string())?;
        let content = ChunkHash::try_from(content).map_err(|e| format!("content hash: {e}"))?;
        let name = Addressing::tenant(cluster, &tenant).name(content);
        if name.address != address {
            return Err(format!(
                "address {address} is not tenant {tenant}'s address of content {content} under this cluster's key"
            ));
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
        // The key a client is handed gives the same addresses.
        let handed = Addressing::from_wire("acme", acme.key_bytes()).unwrap();
        assert_eq!(handed, acme);
        assert_eq!(Addressing::from_wire("", &[]).unwrap(), Addressing::plain());
        assert!(Addressing::from_wire("acme", &[1; 16]).is_err());
        assert!(Addressing::from_wire("", &[1; 32]).is_err());
        assert!(Addressing::from_wire("no/slash", &[1; 32]).is_err());
        let job = crate::JobName::try_from("acme/llama").unwrap();
        assert_eq!(Addressing::of_job(Some(&key), &job), acme);
        assert_eq!(Addressing::of_job(Some(&key), &crate::JobName::try_from("llama").unwrap()), Addressing::plain());
    }

    #[test]
    fn a_target_accepts_only_names_whose_address_binds_the_content() {
        let key = ClusterKey::from_secret(b"0123456789abcdef0123").unwrap();
        let content = ChunkHash::of(b"bytes");
        let name = Addressing::tenant(Some(&key), &tenant("acme")).name(content);
        let checked = ChunkName::checked(name.address, "acme", &content.0, Some(&key)).unwrap();
        assert_eq!(checked, name);
        // Another tenant, another key, another content, a plain name with a content hash.
        assert!(ChunkName::checked(name.address, "other", &content.0, Some(&key)).is_err());
        assert!(ChunkName::checked(name.address, "acme", &content.0, None).is_err());
        assert!(ChunkName::checked(name.address, "acme", &ChunkHash::of(b"other").0, Some(&key)).is_err());
        assert!(ChunkName::checked(name.address, "acme", &[0; 5], Some(&key)).is_err());
        assert!(ChunkName::checked(name.address, "", &content.0, Some(&key)).is_err());
        assert_eq!(ChunkName::checked(content, "", &[], Some(&key)).unwrap(), ChunkName::plain(content));
        assert_eq!(ChunkName::checked(content, "", &content.0, None).unwrap(), ChunkName::plain(content));
    }
}
