//! TLS on the control plane's gRPC port (`starckpt server --tls-cert FILE --tls-key FILE`).
//!
//! Back of the envelope: a client keeps one connection to its control plane and makes a few
//! calls per save; a TLS 1.3 handshake costs ~1 ms of CPU (one ECDSA or RSA signature), once per
//! connection, and the calls carry kilobytes. TLS costs nothing a trainer notices, and keeps
//! bearer tokens and the data-plane capabilities the control plane hands out off the wire in the
//! clear.
//!
//! A control plane with a certificate serves TLS only (1.2 and 1.3, ALPN `h2`): a client that
//! dials it in plaintext fails its first call (clients: `starckpt_proto::tls`). The certificate
//! file holds the chain (the server's certificate first), the key file its private key (PKCS#8,
//! PKCS#1 or SEC1 PEM). Both are read again when they change, checked every
//! [`RELOAD_EVERY`], so a renewed certificate (cert-manager, certbot, a rotated secret) is served
//! to new connections without a restart; a pair that does not parse, or whose key is not the
//! certificate's (one file replaced and not yet the other), is logged and the previous pair stays
//! in force. Handshakes are bounded: [`MAX_HANDSHAKES`] at once, each within
//! [`HANDSHAKE_TIMEOUT`]; one that fails is logged with the peer (most often a client dialling
//! without TLS) and costs nothing else.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::Stream;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use starckpt_dataplane::sync::{LockExt, RwLockExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How often the certificate and key files are checked for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(10);
/// TLS handshakes in progress at once; connections past it wait in the kernel's accept queue.
pub const MAX_HANDSHAKES: usize = 256;
/// A peer that has not finished its handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections not yet taken by the gRPC server.
const ACCEPTED_QUEUE: usize = 64;

/// Where the certificate chain and its key are.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The control plane's TLS: the pair in force, and how to accept connections with it.
pub struct ServerTls {
    files: TlsFiles,
    current: Arc<Current>,
    acceptor: TlsAcceptor,
    /// Hash of the files' contents as last read: applied, or refused and already logged.
    seen: Mutex<blake3::Hash>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("files", &self.files).finish_non_exhaustive()
    }
}

/// The certificate served to every new handshake, swapped by a reload.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.read_unpoisoned()))
    }
}

impl ServerTls {
    /// Reads and checks the pair: an error says which file and why.
    pub fn load(files: TlsFiles) -> Result<Arc<ServerTls>, String> {
        let (seen, certified) = read_pair(&files)?;
        let current = Arc::new(Current(RwLock::new(certified)));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(config));
        Ok(Arc::new(ServerTls { files, current, acceptor, seen: Mutex::new(seen) }))
    }

    /// Reads the files again and serves the pair they hold now if it changed and is good (module
    /// docs); a bad one is logged once per change.
    pub fn reload_if_changed(&self) {
        let read = read_pair(&self.files);
        let hash = match &read {
            Ok((hash, _)) => *hash,
            // A file that cannot be read or parsed: the error names what changed.
            Err(error) => blake3::hash(error.as_bytes()),
        };
        let mut seen = self.seen.lock_unpoisoned();
        if *seen == hash {
            return;
        }
        *seen = hash;
        match read {
            Ok((_, certified)) => {
                *self.current.0.write_unpoisoned() = certified;
                tracing::info!(cert = %self.files.cert.display(), "serving the control plane's renewed TLS certificate");
            }
            Err(error) => {
                tracing::error!(%error, "the TLS certificate or key changed but cannot be used; still serving the previous one")
            }
        }
    }

    /// TLS connections accepted on `listener`, handshaken concurrently (bounded) so one slow peer
    /// holds up no other. Ends when the stream is dropped (the accepting task with it).
    pub fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
    ) -> impl Stream<Item = std::io::Result<TlsStream<TcpStream>>> {
        let (accepted_tx, accepted) = tokio::sync::mpsc::channel(ACCEPTED_QUEUE);
        let accepting = tokio::spawn(async move {
            let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
            loop {
                let Ok(permit) = Arc::clone(&handshakes).acquire_owned().await else { return };
                let (stream, peer) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(error) => {
                            // Out of descriptors, most often: wait rather than spin.
                            tracing::warn!(%error, "accepting a control-plane connection failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                    _ = accepted_tx.closed() => return,
                };
                let _ = stream.set_nodelay(true);
                let (acceptor, accepted_tx) = (self.acceptor.clone(), accepted_tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = accepted_tx.send(Ok(tls)).await;
                        }
                        Ok(Err(error)) => tracing::info!(
                            %peer, %error,
                            "TLS handshake failed (a client dialling without TLS? it needs https:// or STARCKPT_TLS_CA)"
                        ),
                        Err(_) => tracing::info!(%peer, "no TLS handshake within {HANDSHAKE_TIMEOUT:?}"),
                    }
                });
            }
        });
        let accepting = tokio_util::task::AbortOnDropHandle::new(accepting);
        futures::stream::unfold((accepted, accepting), |(mut accepted, accepting)| async move {
            accepted.recv().await.map(|stream| (stream, (accepted, accepting)))
        })
    }
}

/// The pair `files` name, checked, and the hash of the files' contents.
fn read_pair(files: &TlsFiles) -> Result<(blake3::Hash, Arc<CertifiedKey>), String> {
    let read = |path: &Path, what: &str| {
        std::fs::read(path).map_err(|e| format!("read the TLS {what} file {}: {e}", path.display()))
    };
    let (cert_pem, key_pem) = (read(&files.cert, "certificate")?, read(&files.key, "key")?);
    let mut hasher = blake3::Hasher::new();
    hasher.update(&(cert_pem.len() as u64).to_le_bytes()).update(&cert_pem).update(&key_pem);
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the TLS certificate file {}: {e}", files.cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "the TLS certificate file {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            files.cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| format!("the TLS key file {} holds no PEM private key: {e}", files.key.display()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| format!("the TLS key file {}: {e}", files.key.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| {
        format!(
            "the TLS key file {} does not hold the key of the certificate in {}: {e}",
            files.key.display(),
            files.cert.display()
        )
    })?;
    Ok((hasher.finalize(), Arc::new(certified)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for 127.0.0.1 and its key, as PEM.
    fn pair() -> (String, String) {
        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        (made.cert.pem(), made.signing_key.serialize_pem())
    }

    fn write(dir: &Path, cert: &str, key: &str) -> TlsFiles {
        let files = TlsFiles { cert: dir.join("cert.pem"), key: dir.join("key.pem") };
        std::fs::write(&files.cert, cert).unwrap();
        std::fs::write(&files.key, key).unwrap();
        files
    }

    fn served(tls: &ServerTls) -> Vec<u8> {
        tls.current.0.read().unwrap().end_entity_cert().unwrap().to_vec()
    }

    #[test]
    fn a_bad_pair_is_refused_with_the_file_and_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pair();
        let (_, other_key) = pair();
        let cases = [
            ("", key.as_str(), "holds no PEM certificate"),
            (cert.as_str(), "", "holds no PEM private key"),
            (cert.as_str(), other_key.as_str(), "does not hold the key of the certificate"),
        ];
        for (cert, key, why) in cases {
            let error = ServerTls::load(write(dir.path(), cert, key)).err().unwrap();
            assert!(error.contains(why) && error.contains(dir.path().to_str().unwrap()), "{error}");
        }
        let missing = TlsFiles { cert: dir.path().join("absent.pem"), key: dir.path().join("key.pem") };
        let error = ServerTls::load(missing).err().unwrap();
        assert!(error.contains("absent.pem"), "{error}");
        assert!(ServerTls::load(write(dir.path(), &cert, &key)).is_ok());
    }

    #[test]
    fn a_renewed_pair_is_served_and_a_bad_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pair();
        let files = write(dir.path(), &cert, &key);
        let tls = ServerTls::load(files.clone()).unwrap();
        let first = served(&tls);
        // The certificate replaced before its key: not applied, the old pair still served.
        let (renewed, renewed_key) = pair();
        std::fs::write(&files.cert, &renewed).unwrap();
        tls.reload_if_changed();
        assert_eq!(served(&tls), first);
        // Then the key: the renewed pair is served.
        std::fs::write(&files.key, &renewed_key).unwrap();
        tls.reload_if_changed();
        let second = served(&tls);
        assert_ne!(second, first);
        // A file half written: refused, the renewed pair stays.
        std::fs::write(&files.cert, &renewed[..renewed.len() / 2]).unwrap();
        tls.reload_if_changed();
        assert_eq!(served(&tls), second);
    }
}
