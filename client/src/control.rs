//! The control planes a client talks to, and failing over between them in the middle of a session.
//!
//! [`ClientConfig::server`] may name several control planes sharing one PostgreSQL database, or
//! one that a supervisor restarts. The client connects to the first that answers. Later, a call
//! whose control plane is gone (it refused the connection, the connection broke, or it did not
//! answer within [`ClientConfig::rpc_timeout`]) is sent again to the next control plane in the
//! list, round robin, until one answers or [`ClientConfig::failover_timeout`] has passed since the
//! first failure. The RPC timeout bounds a whole attempt, its answer's body included: a control
//! plane that sent the headers of an answer and then stalled (overloaded, or cut off by the
//! network) is a failed control plane, not a call waited on for ever. HTTP/2 and TCP keepalives
//! find a connection whose peer vanished without a word while no call is in flight. Between rounds over the whole list it waits, 100 ms doubling to 2 s, so a
//! control plane restarting in place is given time to come back.
//!
//! Sending a call twice is safe only if the control plane treats the second as the first. The
//! calls of a save are (`MetaStore` in `server/src/control/store.rs`): a run taking its lease again
//! gets the same epoch, a begin under the same epoch joins the pending checkpoint, an identical
//! part committed again is a no-op, even after the checkpoint committed. So a save survives a
//! control plane dying after its transaction committed but before it answered (the crash matrix's
//! `control.commit.reply`). Reads, tags and the replication factor are idempotent too. Deleting
//! a checkpoint is not (a second delete says NotFound), nor is setting retention (a second call
//! reports no deletions), nor a pass over the cluster (GC, re-replication, tiering, importing),
//! which runs on at the control plane when its caller gives up; these are sent again only when
//! the first attempt never reached a control plane ([`Resend::IfUnsent`], [`Resend::Pass`]). A
//! pass is waited for up to [`ClientConfig::pass_timeout`], any other call up to the RPC timeout.
//! Once failing over, no attempt runs past the failover deadline.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use starckpt_proto::control::control_client::ControlClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::sync::LockExt;
use crate::{ClientConfig, Error, Result};

/// Largest control-plane message either way (a checkpoint's manifests).
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Wait between rounds over every control plane: doubling from the first to the last.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How often an idle connection to a control plane is probed (HTTP/2 PING and TCP keepalive),
/// and how long a PING may go unanswered before the connection is dropped.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// A client of one control plane.
pub(crate) type Control = ControlClient<InterceptedService<Channel, Bearer>>;

/// Puts the client's bearer token (`starckpt_proto::token`), if it has one, on every call.
#[derive(Clone, Debug)]
pub(crate) struct Bearer(Option<MetadataValue<Ascii>>);

impl Bearer {
    /// The token `config` names (`ClientConfig::token`, else `token_file`), checked.
    pub(crate) fn from_config(config: &ClientConfig) -> Result<Bearer> {
        let token = match (&config.token, &config.token_file) {
            (Some(token), _) => token.trim().to_owned(),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(Error::io("read the token file", path))?;
                text.trim().to_owned()
            }
            (None, None) => return Ok(Bearer(None)),
        };
        starckpt_proto::token::check(&token).map_err(Error::InvalidInput)?;
        let value = format!("{}{token}", starckpt_proto::token::BEARER);
        let mut value = MetadataValue::try_from(value)
            .map_err(|_| Error::InvalidInput("the bearer token cannot travel in a header".into()))?;
        // Kept out of any trace of the request's headers.
        value.set_sensitive(true);
        Ok(Bearer(Some(value)))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert(starckpt_proto::token::AUTHORIZATION, value.clone());
        }
        Ok(request)
    }
}

/// Whether a failed call may be sent again (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resend {
    /// The control plane treats a repeat as the first: resend after any failure of the control
    /// plane or the connection to it.
    Idempotent,
    /// Resend only if the call never reached a control plane.
    IfUnsent,
    /// A pass over the cluster: like [`Resend::IfUnsent`], and waited for up to the pass timeout
    /// rather than the RPC timeout.
    Pass,
}

/// The cluster's control planes: the one in use, and the others to fail over to.
pub(crate) struct ControlPlanes {
    endpoints: Vec<(String, Endpoint)>,
    /// Index into `endpoints` of the control plane in use, and a client of it.
    current: Mutex<(usize, Control)>,
    failover_timeout: Duration,
    /// Bound each attempt, headers and body ([`ClientConfig::rpc_timeout`], and
    /// [`ClientConfig::pass_timeout`] for [`Resend::Pass`]).
    rpc_timeout: Duration,
    pass_timeout: Duration,
    bearer: Bearer,
}

impl ControlPlanes {
    /// Connects to the first of `config.server`'s control planes that accepts a connection.
    pub(crate) async fn connect(config: &ClientConfig) -> Result<ControlPlanes> {
        let bearer = Bearer::from_config(config)?;
        let tls = starckpt_proto::tls::ControlTls::from_optional_file(config.tls_ca.as_deref())
            .map_err(Error::InvalidInput)?;
        let urls = tls.urls(&config.server);
        if urls.is_empty() {
            return Err(Error::InvalidInput(format!("no control-plane address in {:?}", config.server)));
        }
        let mut endpoints = Vec::with_capacity(urls.len());
        for url in urls {
            let endpoint = tls
                .endpoint(&url)
                .map_err(Error::InvalidInput)?
                .connect_timeout(Duration::from_secs(5))
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true)
                .tcp_keepalive(Some(KEEPALIVE_INTERVAL));
            endpoints.push((url, endpoint));
        }
        let mut failures = Vec::new();
        for (index, (url, endpoint)) in endpoints.iter().enumerate() {
            match endpoint.connect().await {
                Ok(channel) => {
                    let current = Mutex::new((index, client(channel, &bearer)));
                    return Ok(ControlPlanes {
                        endpoints,
                        current,
                        failover_timeout: config.failover_timeout,
                        rpc_timeout: config.rpc_timeout,
                        pass_timeout: config.pass_timeout,
                        bearer,
                    });
                }
                Err(error) => {
                    tracing::warn!(%url, error = %error_chain(&error), "control plane unreachable; trying the next");
                    failures.push(format!("{url}: {}", error_chain(&error)));
                }
            }
        }
        Err(Error::Unreachable { address: config.server.clone(), message: failures.join("; ") })
    }

    /// Makes one call, `call(client, request)`, failing over to the next control plane while
    /// the failure allows it (`resend`, module docs) and the failover timeout has not passed.
    pub(crate) async fn call<Req, Resp, F, Fut>(
        &self,
        op: &'static str,
        resend: Resend,
        request: Req,
        call: F,
    ) -> std::result::Result<Resp, Status>
    where
        Req: Clone,
        F: Fn(Control, Req) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<Resp>, Status>>,
    {
        let mut deadline: Option<Instant> = None;
        let mut backoff = FIRST_BACKOFF;
        let mut failed = 0;
        loop {
            let (index, client) = self.in_use();
            // The whole answer, body included (a timeout of tonic's would cover its headers).
            let started = Instant::now();
            let timeout = if resend == Resend::Pass { self.pass_timeout } else { self.rpc_timeout };
            let attempt = tokio::time::timeout(timeout, call(client, request.clone()));
            // Once failing over, no attempt outlives the failover deadline, but for a pass: one
            // that reached a control plane runs its course there (it is never sent again), and
            // the pass timeout bounds it.
            let outcome = match deadline.filter(|_| resend != Resend::Pass) {
                None => attempt.await,
                Some(at) => match tokio::time::timeout_at(at.into(), attempt).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        return Err(Status::unavailable(format!(
                            "no control plane answered within {:?} of the first failure",
                            self.failover_timeout
                        )));
                    }
                },
            };
            let outcome = outcome.unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(format!(
                    "the control plane's answer did not arrive whole within {:?}",
                    started.elapsed()
                )))
            });
            let status = match outcome {
                Ok(response) => {
                    if failed > 0 {
                        tracing::info!(op, url = %self.endpoints[index].0, "control plane answered after failing over");
                    }
                    return Ok(response.into_inner());
                }
                Err(status) => status,
            };
            if !resendable(&status, resend) {
                return Err(hint_tls(status, &self.endpoints[index].0));
            }
            let now = Instant::now();
            let deadline = *deadline.get_or_insert(now + self.failover_timeout);
            if now >= deadline {
                return Err(hint_tls(status, &self.endpoints[index].0));
            }
            failed += 1;
            let next = self.fail_over(index);
            tracing::warn!(op, failed = %self.endpoints[index].0, next = %self.endpoints[next].0,
                error = %status.message(), "control plane did not answer; sending the call again");
            if failed % self.endpoints.len() == 0 {
                tokio::time::sleep(backoff.min(deadline - now)).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }

    fn in_use(&self) -> (usize, Control) {
        let current = self.current.lock_unpoisoned();
        (current.0, current.1.clone())
    }

    /// Moves from control plane `failed` to the next one (unless another call already moved on)
    /// and returns the one now in use. Its connection is made by the first call sent on it.
    fn fail_over(&self, failed: usize) -> usize {
        let mut current = self.current.lock_unpoisoned();
        if current.0 == failed {
            let next = (failed + 1) % self.endpoints.len();
            *current = (next, client(self.endpoints[next].1.connect_lazy(), &self.bearer));
        }
        current.0
    }
}

fn client(channel: Channel, bearer: &Bearer) -> Control {
    ControlClient::with_interceptor(channel, bearer.clone())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// `status` of a call to `url`, with a hint where it is what a control plane serving TLS answers
/// a client dialling in plaintext (its first frame is no TLS handshake: the HTTP/2 connection is
/// torn down).
fn hint_tls(status: Status, url: &str) -> Status {
    if url.starts_with("http://") && status.message().starts_with("h2 protocol error") {
        let message = format!(
            "{} (does the control plane at {url} serve TLS? then give its CA: --tls-ca or STARCKPT_TLS_CA)",
            status.message()
        );
        return Status::new(status.code(), message);
    }
    status
}

/// Whether a call that failed with `status` may be sent again under `resend`.
fn resendable(status: &Status, resend: Resend) -> bool {
    if never_sent(status) {
        return true;
    }
    match resend {
        Resend::IfUnsent | Resend::Pass => false,
        // What the control plane answers itself carries its own code (NotFound, Aborted, ...);
        // these come from the connection: refused or broken (Unavailable, or Unknown for a
        // stream cut short), or no answer within the RPC timeout (Cancelled, DeadlineExceeded).
        Resend::Idempotent => {
            matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded)
        }
    }
}

/// True when the call failed connecting, so no control plane saw it (tonic keeps the connect
/// error as the status's source).
fn never_sent(status: &Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<tonic::ConnectError>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// The error and its sources on one line (tonic's connect errors hide the cause in the chain).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // hyper and tonic often repeat their cause inside their own message.
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_of_the_control_plane_are_never_resent() {
        for code in
            [Code::NotFound, Code::AlreadyExists, Code::FailedPrecondition, Code::Aborted, Code::InvalidArgument]
        {
            let status = Status::new(code, "answer");
            assert!(!resendable(&status, Resend::Idempotent), "{code:?}");
            assert!(!resendable(&status, Resend::IfUnsent), "{code:?}");
        }
        let broken = Status::unavailable("connection reset");
        assert!(resendable(&broken, Resend::Idempotent));
        assert!(!resendable(&broken, Resend::IfUnsent), "it may have reached the control plane");
    }
}
