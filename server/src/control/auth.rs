//! Who may call the control plane, and whose jobs they reach: bearer tokens and tenants.
//!
//! A control plane started with `--tokens-file FILE` serves only calls that carry
//! `authorization: Bearer <token>` (`starckpt_proto::token`) of a token listed there. The file
//! has one token per line, by its hash; `#` starts a comment:
//!
//! ```text
//!   # who              token hash (starckpt_proto::token::hash, 64 hex digits)
//!   admin              5f0c…
//!   tenant acme        9b1e…
//! ```
//!
//! - A **tenant**'s token reaches that tenant's jobs alone. Its callers name jobs as always
//!   (`llama`); the control plane stores them as `acme/llama` ([`JobName`]) and answers with the
//!   short name, so two tenants may both have a `llama`, neither sees the other's jobs, and a
//!   checkpoint id of another tenant is answered as one that does not exist. Cluster-wide
//!   operations (garbage collection, re-replication, the tier) are refused (PERMISSION_DENIED).
//! - An **admin** token (an operator's) reaches every job, by its stored name (`acme/llama`;
//!   jobs made without tenants keep their plain names), and the cluster-wide operations.
//!
//! A call without a valid token is UNAUTHENTICATED; targets do not need one (they prove the
//! cluster key instead, `RegisterTargetRequest.proof`), which is why tokens require a cluster
//! key: without one, a process could register as a target and be handed clients' chunks.
//! The file is checked every [`RELOAD_EVERY`] and a change applied once two checks in a row see
//! the same contents (a rewrite caught halfway is not), so a token added or removed takes effect
//! within seconds, without a restart; a file that no longer parses, or is gone, is logged and the
//! tokens read before stay in force. A revoked token's holder keeps the data-plane capability it
//! was given until it expires (at most 5 minutes with tokens: `DataCapability`).
//!
//! Not covered: the data plane does not know tenants. A client's data capability reads and
//! writes any chunk whose hash it names, so deduplication crosses tenants, and a tenant can learn
//! whether someone stored content it already has (HAS); reading another tenant's chunk needs its
//! hash, which only that tenant's manifests hold. TLS is not built either: a token crosses the
//! network in the clear.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use starckpt_dataplane::sync::RwLockExt;
use starckpt_proto::{JobName, TenantName, token};
use tonic::Status;
use tonic::metadata::MetadataMap;

/// How often the tokens file is checked for changes.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// Whom a call comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// An admin token.
    Operator,
    /// Any caller of a control plane without tokens: an operator, except that it cannot start
    /// jobs in a tenant's namespace (which would become that tenant's once tokens are on).
    Anyone,
    Tenant(TenantName),
}

impl Caller {
    /// The stored name of the job the caller calls `name`.
    pub fn job(&self, name: &str) -> Result<JobName, Status> {
        let job = JobName::try_from(name).map_err(|e| Status::invalid_argument(e.to_string()))?;
        match self {
            Caller::Operator | Caller::Anyone => Ok(job),
            Caller::Tenant(tenant) => job.in_tenant(tenant).map_err(|e| Status::invalid_argument(e.to_string())),
        }
    }

    /// [`Caller::job`] for a call that may start the job (a lease, a checkpoint).
    pub fn new_job(&self, name: &str) -> Result<JobName, Status> {
        let job = self.job(name)?;
        if *self == Caller::Anyone && job.tenant().is_some() {
            return Err(Status::invalid_argument(format!(
                "{job} names a tenant's job: only an admin token of a control plane with bearer tokens may start one"
            )));
        }
        Ok(job)
    }

    /// Whether the caller reaches the job stored as `stored`.
    pub fn reaches(&self, stored: &str) -> bool {
        match self {
            Caller::Operator | Caller::Anyone => true,
            Caller::Tenant(tenant) => tenant.holds(stored),
        }
    }

    /// What the caller calls the job stored as `stored` (one it [`reaches`](Self::reaches)).
    pub fn shown(&self, stored: &str) -> String {
        match self {
            Caller::Operator | Caller::Anyone => stored.to_owned(),
            Caller::Tenant(tenant) => {
                stored.strip_prefix(tenant.as_str()).and_then(|s| s.strip_prefix('/')).unwrap_or(stored).to_owned()
            }
        }
    }

    /// `status` as the caller is told it: a tenant's job appears under its short name in the
    /// message too (the store's errors name jobs as stored).
    pub fn told(&self, status: Status) -> Status {
        match self {
            Caller::Operator | Caller::Anyone => status,
            Caller::Tenant(tenant) => {
                let message = status.message().replace(&format!("{tenant}/"), "");
                Status::new(status.code(), message)
            }
        }
    }

    /// The tenant whose namespace the caller's writes must stay in; None for an operator.
    pub fn namespace(&self) -> Option<TenantName> {
        match self {
            Caller::Operator | Caller::Anyone => None,
            Caller::Tenant(tenant) => Some(tenant.clone()),
        }
    }

    /// Refuses a tenant's call to `what`, a cluster-wide operation.
    pub fn must_operate(&self, what: &str) -> Result<(), Status> {
        match self {
            Caller::Operator | Caller::Anyone => Ok(()),
            Caller::Tenant(tenant) => Err(Status::permission_denied(format!(
                "{what} is an operator's: tenant {tenant}'s token may not (an admin token may)"
            ))),
        }
    }
}

/// The tokens of one reading of a tokens file, by hash.
#[derive(Debug, Default)]
pub struct TokenTable {
    callers: HashMap<[u8; 32], Caller>,
}

impl TokenTable {
    /// Parses a tokens file (module docs). Errors name the line.
    pub fn parse(text: &str) -> Result<TokenTable, String> {
        let mut callers = HashMap::new();
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            let line = line.split_once('#').map_or(line, |(before, _)| before);
            let words: Vec<&str> = line.split_whitespace().collect();
            let (caller, hash) = match words.as_slice() {
                [] => continue,
                ["admin", hash] => (Caller::Operator, *hash),
                ["tenant", name, hash] => {
                    let tenant = TenantName::try_from(*name).map_err(|e| format!("line {number}: {e}"))?;
                    (Caller::Tenant(tenant), *hash)
                }
                _ => {
                    return Err(format!(
                        "line {number}: expected `admin HASH` or `tenant NAME HASH` (HASH: 64 hex digits)"
                    ));
                }
            };
            let mut digest = [0u8; 32];
            hex::decode_to_slice(hash, &mut digest)
                .map_err(|_| format!("line {number}: the token hash is not 64 hex digits"))?;
            if let Some(earlier) = callers.insert(digest, caller.clone())
                && earlier != caller
            {
                return Err(format!("line {number}: this token hash is listed earlier for someone else"));
            }
        }
        Ok(TokenTable { callers })
    }

    /// The line of a tokens file that admits `token` as `caller`.
    pub fn line(caller: &Caller, token: &str) -> String {
        let hash = hex::encode(token::hash(token));
        match caller {
            Caller::Operator | Caller::Anyone => format!("admin {hash}"),
            Caller::Tenant(tenant) => format!("tenant {tenant} {hash}"),
        }
    }

    pub fn len(&self) -> usize {
        self.callers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.callers.is_empty()
    }

    fn caller(&self, token: &str) -> Option<&Caller> {
        self.callers.get(&token::hash(token))
    }
}

/// A tokens file and the tokens last read from it.
pub struct Tokens {
    path: PathBuf,
    state: RwLock<Reading>,
}

/// What [`Tokens`] has read.
struct Reading {
    table: Arc<TokenTable>,
    /// The contents `table` was parsed from.
    applied: blake3::Hash,
    /// Other contents seen at the last check, applied if the next check sees them again: a file
    /// being rewritten in place is not taken half-written.
    pending: Option<blake3::Hash>,
    /// Contents (or a read error's text) already reported as unusable: not logged again.
    reported: Option<blake3::Hash>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens").field("path", &self.path).finish_non_exhaustive()
    }
}

impl Tokens {
    /// Reads the tokens file at `path`; an unreadable or malformed file is an error (a control
    /// plane is not started with tokens it cannot read).
    pub fn load(path: &Path) -> Result<Tokens, String> {
        let text = std::fs::read(path).map_err(|e| format!("tokens file {}: {e}", path.display()))?;
        let table = parse(path, &text)?;
        if table.is_empty() {
            tracing::warn!(path = %path.display(), "the tokens file lists no token: every call will be refused");
        }
        let reading = Reading { table: Arc::new(table), applied: blake3::hash(&text), pending: None, reported: None };
        Ok(Tokens { path: path.to_owned(), state: RwLock::new(reading) })
    }

    /// Reads the file again and applies what changed once two checks in a row have seen the same
    /// contents (so a rewrite caught halfway is not applied). What cannot be read or parsed is
    /// logged once and changes nothing: the tokens read before stay in force.
    pub fn reload_if_changed(&self) {
        let text = std::fs::read(&self.path);
        let mut state = self.state.write_unpoisoned();
        let text = match text {
            Ok(text) => text,
            Err(error) => {
                let seen = blake3::hash(error.to_string().as_bytes());
                if state.reported != Some(seen) {
                    state.reported = Some(seen);
                    tracing::error!(path = %self.path.display(), %error, "cannot read the tokens file: keeping the tokens read before");
                }
                return;
            }
        };
        let seen = blake3::hash(&text);
        if seen == state.applied {
            state.pending = None;
            return;
        }
        if state.pending != Some(seen) {
            state.pending = Some(seen);
            return;
        }
        match parse(&self.path, &text) {
            Ok(table) => {
                tracing::info!(path = %self.path.display(), tokens = table.len(), "tokens file read again");
                *state = Reading { table: Arc::new(table), applied: seen, pending: None, reported: None };
            }
            Err(error) if state.reported != Some(seen) => {
                state.reported = Some(seen);
                tracing::error!(path = %self.path.display(), %error, "the tokens file does not parse: keeping the tokens read before");
            }
            Err(_) => {}
        }
    }

    /// The caller a request's metadata names.
    pub fn authenticate(&self, metadata: &MetadataMap) -> Result<Caller, Status> {
        let Some(value) = metadata.get(token::AUTHORIZATION) else {
            return Err(Status::unauthenticated(
                "this control plane serves only callers with a bearer token: set STARCKPT_TOKEN or STARCKPT_TOKEN_FILE",
            ));
        };
        // The scheme is case-insensitive (RFC 7235).
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(token::BEARER.trim()))
            .map(|(_, token)| token.trim())
            .ok_or_else(|| Status::unauthenticated("the authorization header is not `Bearer <token>`"))?;
        let table = Arc::clone(&self.state.read_unpoisoned().table);
        table.caller(token).cloned().ok_or_else(|| {
            Status::unauthenticated(
                "the bearer token is not one this control plane knows (revoked, or another cluster's)",
            )
        })
    }
}

fn parse(path: &Path, text: &[u8]) -> Result<TokenTable, String> {
    let text = std::str::from_utf8(text).map_err(|_| format!("tokens file {}: not UTF-8", path.display()))?;
    TokenTable::parse(text).map_err(|e| format!("tokens file {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataValue;

    fn with_token(token: &str) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        metadata.insert(token::AUTHORIZATION, MetadataValue::try_from(format!("Bearer {token}")).unwrap());
        metadata
    }

    #[test]
    fn tokens_name_their_callers_and_nothing_else_does() {
        let (admin, acme, other) = (token::generate(), token::generate(), token::generate());
        let acme_tenant = Caller::Tenant(TenantName::try_from("acme").unwrap());
        let text = format!(
            "# tokens\n{}\n\n  {}   # the acme team\n",
            TokenTable::line(&Caller::Operator, &admin),
            TokenTable::line(&acme_tenant, &acme)
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, &text).unwrap();
        let tokens = Tokens::load(&path).unwrap();
        assert_eq!(tokens.authenticate(&with_token(&admin)).unwrap(), Caller::Operator);
        assert_eq!(tokens.authenticate(&with_token(&acme)).unwrap(), acme_tenant);
        for refused in [with_token(&other), with_token(""), MetadataMap::new()] {
            assert_eq!(tokens.authenticate(&refused).unwrap_err().code(), tonic::Code::Unauthenticated);
        }
        let mut basic = MetadataMap::new();
        basic.insert(token::AUTHORIZATION, MetadataValue::try_from(format!("Basic {admin}")).unwrap());
        assert_eq!(tokens.authenticate(&basic).unwrap_err().code(), tonic::Code::Unauthenticated);

        let mut lower = MetadataMap::new();
        lower.insert(token::AUTHORIZATION, MetadataValue::try_from(format!("bearer  {acme} ")).unwrap());
        assert_eq!(tokens.authenticate(&lower).unwrap(), acme_tenant, "the scheme is case-insensitive");

        // Revoked by rewriting the file, once two checks saw the same contents (a rewrite in
        // progress is not taken); a broken rewrite keeps what was read before, as does a
        // missing file.
        std::fs::write(&path, TokenTable::line(&Caller::Operator, &admin)).unwrap();
        tokens.reload_if_changed();
        assert!(tokens.authenticate(&with_token(&acme)).is_ok(), "seen once: not yet applied");
        tokens.reload_if_changed();
        assert!(tokens.authenticate(&with_token(&acme)).is_err(), "revoked");
        std::fs::write(&path, "admin nothex\n").unwrap();
        tokens.reload_if_changed();
        tokens.reload_if_changed();
        assert_eq!(tokens.authenticate(&with_token(&admin)).unwrap(), Caller::Operator);
        std::fs::remove_file(&path).unwrap();
        tokens.reload_if_changed();
        tokens.reload_if_changed();
        assert_eq!(tokens.authenticate(&with_token(&admin)).unwrap(), Caller::Operator);
        // The same length and another hash (an in-place edit the file's times may not show).
        std::fs::write(&path, TokenTable::line(&Caller::Operator, &other)).unwrap();
        tokens.reload_if_changed();
        tokens.reload_if_changed();
        assert!(tokens.authenticate(&with_token(&admin)).is_err());
        assert_eq!(tokens.authenticate(&with_token(&other)).unwrap(), Caller::Operator);
    }

    #[test]
    fn malformed_files_name_the_line() {
        let hash = hex::encode(token::hash("x"));
        for (text, line) in [
            ("admin\n".to_owned(), "line 1"),
            (format!("# ok\nroot {hash}\n"), "line 2"),
            (format!("tenant {hash}\n"), "line 1"),
            (format!("tenant a/b {hash}\n"), "line 1"),
            (format!("admin {}\n", &hash[..10]), "line 1"),
            (format!("admin {hash}\ntenant t {hash}\n"), "line 2"),
        ] {
            let error = TokenTable::parse(&text).unwrap_err();
            assert!(error.starts_with(line), "{text:?}: {error}");
        }
        assert!(Tokens::load(Path::new("/nonexistent/tokens")).is_err());
    }

    #[test]
    fn a_tenant_reaches_its_own_jobs_by_their_short_names() {
        let acme = Caller::Tenant(TenantName::try_from("acme").unwrap());
        assert_eq!(acme.job("llama").unwrap().as_str(), "acme/llama");
        assert_eq!(acme.job("other/llama").unwrap_err().code(), tonic::Code::InvalidArgument);
        assert!(acme.reaches("acme/llama") && !acme.reaches("other/llama") && !acme.reaches("llama"));
        assert!(!acme.reaches("acmex/llama"));
        assert_eq!(acme.shown("acme/llama"), "llama");
        assert_eq!(acme.must_operate("gc").unwrap_err().code(), tonic::Code::PermissionDenied);
        assert_eq!(Caller::Operator.job("acme/llama").unwrap().as_str(), "acme/llama");
        assert_eq!(Caller::Operator.shown("acme/llama"), "acme/llama");
        Caller::Operator.must_operate("gc").unwrap();
        // Without tokens, anyone operates, but starts no job in a tenant's namespace.
        assert_eq!(Caller::Anyone.new_job("acme/llama").unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(Caller::Operator.new_job("acme/llama").unwrap().as_str(), "acme/llama");
        assert_eq!(Caller::Anyone.job("acme/llama").unwrap().as_str(), "acme/llama");
        Caller::Anyone.must_operate("gc").unwrap();
        let told = acme.told(Status::not_found("job acme/llama has no committed checkpoint"));
        assert_eq!((told.code(), told.message()), (tonic::Code::NotFound, "job llama has no committed checkpoint"));
    }
}
