//! TLS on the control plane's gRPC port, as its clients (the SDK, targets, the CLI) dial it.
//!
//! A control plane run with `--tls-cert` and `--tls-key` serves gRPC over TLS only
//! (`server/src/control/tls.rs`). Its clients dial it:
//!
//! - as `https://host:port`, verifying its certificate against the CA file they were given
//!   (`STARCKPT_TLS_CA`, `--tls-ca`) or, without one, against the system's trust store;
//! - as `host:port` (no scheme) over TLS when they were given a CA file, in plaintext otherwise;
//! - as `http://host:port` in plaintext, whatever they were given.
//!
//! The certificate must chain to the CA and name the host as dialled (a DNS name, or an IP
//! address among its subject alternative names). A CA file is the usual case: a cluster's own CA,
//! which its control planes' certificates chain to, trusted for this and nothing else. Bearer
//! tokens and the data-plane capabilities the control plane hands out travel inside the TLS
//! session; the data plane's frames (capabilities included) do not (ARCHITECTURE.md).
//!
//! ```
//! use starckpt_proto::tls::ControlTls;
//! let plain = ControlTls::default();
//! assert_eq!(plain.urls("a:7070, https://b:7070"), ["http://a:7070", "https://b:7070"]);
//! ```

use std::path::Path;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

/// What a client trusts on the control plane's port (module docs). The default trusts no CA file:
/// plaintext, unless an address says `https://`.
#[derive(Clone, Debug, Default)]
pub struct ControlTls {
    /// PEM certificates of the CA(s), checked to hold at least one.
    ca_pem: Option<Vec<u8>>,
}

impl ControlTls {
    /// Trusts the CA certificate(s) in the PEM file at `path` (and, for control planes dialled
    /// through it, nothing else). A file that cannot be read or holds no certificate is an error.
    pub fn from_ca_file(path: &Path) -> Result<ControlTls, String> {
        let pem = std::fs::read(path).map_err(|e| format!("read the TLS CA file {}: {e}", path.display()))?;
        ControlTls::from_ca_pem(pem).map_err(|e| format!("the TLS CA file {}: {e}", path.display()))
    }

    /// As [`ControlTls::from_ca_file`], for the file's contents.
    pub fn from_ca_pem(pem: Vec<u8>) -> Result<ControlTls, String> {
        let mut count = 0;
        for certificate in CertificateDer::pem_slice_iter(&pem) {
            certificate.map_err(|e| format!("not a PEM certificate: {e}"))?;
            count += 1;
        }
        if count == 0 {
            return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
        }
        Ok(ControlTls { ca_pem: Some(pem) })
    }

    /// `from_ca_file` of `path` where there is one; the default otherwise.
    pub fn from_optional_file(path: Option<&Path>) -> Result<ControlTls, String> {
        path.map_or_else(|| Ok(ControlTls::default()), ControlTls::from_ca_file)
    }

    /// Whether a CA file was given, which makes addresses without a scheme TLS.
    pub fn has_ca(&self) -> bool {
        self.ca_pem.is_some()
    }

    /// The URL to dial for a control-plane address given as `host:port` or as a URL.
    pub fn url(&self, address: &str) -> String {
        if address.starts_with("http://") || address.starts_with("https://") {
            address.to_owned()
        } else if self.has_ca() {
            format!("https://{address}")
        } else {
            format!("http://{address}")
        }
    }

    /// The URLs of a comma-separated list of control-plane addresses (control planes sharing one
    /// PostgreSQL database: any of them serves the cluster), in the order given; empty entries are
    /// dropped.
    pub fn urls(&self, addresses: &str) -> Vec<String> {
        addresses.split(',').map(str::trim).filter(|a| !a.is_empty()).map(|a| self.url(a)).collect()
    }

    /// An endpoint for `url` (one of [`ControlTls::urls`]): over TLS, trusting the CA file or
    /// else the system's roots, when it is `https://`.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, String> {
        let endpoint =
            Endpoint::from_shared(url.to_owned()).map_err(|e| format!("bad control-plane address {url:?}: {e}"))?;
        if !url.starts_with("https://") {
            return Ok(endpoint);
        }
        let config = match &self.ca_pem {
            Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        endpoint.tls_config(config).map_err(|e| format!("TLS for {url}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOT_A_CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n";

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        assert!(ControlTls::from_ca_pem(b"".to_vec()).unwrap_err().contains("no PEM certificate"));
        assert!(ControlTls::from_ca_pem(b"hello".to_vec()).unwrap_err().contains("no PEM certificate"));
        assert!(ControlTls::from_ca_pem(NOT_A_CERTIFICATE.as_bytes().to_vec()).is_err());
        let missing = ControlTls::from_ca_file(Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");
    }

    #[test]
    fn addresses_without_a_scheme_are_tls_with_a_ca() {
        // A syntactically valid certificate is enough here: nothing is dialled.
        let pem = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let tls = ControlTls::from_ca_pem(pem.as_bytes().to_vec()).unwrap();
        assert_eq!(tls.urls("a:1,,http://b:2 , https://c:3"), ["https://a:1", "http://b:2", "https://c:3"]);
        assert_eq!(ControlTls::default().urls(" a:1 ,https://c:3"), ["http://a:1", "https://c:3"]);
        assert!(tls.endpoint("https://a:1").is_ok());
        assert!(ControlTls::default().endpoint("https://a:1").is_ok(), "the system's roots");
        assert!(ControlTls::default().endpoint("http://a b").is_err());
    }
}
