//! Prometheus metrics: what an operator scrapes (`--metrics-listen ADDR`, `GET /metrics`).
//!
//! The `metrics` facade records; `metrics-exporter-prometheus` serves them. One exporter per
//! process: `starckpt dev` runs a control plane and its targets in one, so target series carry a
//! `target` label. Names follow `starckpt_<subsystem>_<what>_{bytes,seconds,total}`:
//!
//! | series | kind | what |
//! |---|---|---|
//! | `starckpt_control_requests_total{method,code}` | counter | gRPC calls answered, by method and status code |
//! | `starckpt_control_request_seconds{method}` | histogram | their latency |
//! | `starckpt_control_checkpoints_committed_total` | counter | checkpoints that committed (their last part came in) |
//! | `starckpt_control_committed_bytes_total` | counter | bytes of those checkpoints |
//! | `starckpt_control_gc_chunks_deleted_total` | counter | chunks garbage collection deleted |
//! | `starckpt_control_repair_copies_total` | counter | copies re-replication made |
//! | `starckpt_control_under_replicated_chunks` | gauge | chunks still short of copies after the last pass |
//! | `starckpt_control_tier_uploaded_bytes_total` | counter | bytes the tier passes uploaded |
//! | `starckpt_control_recovered_chunks_total` | counter | chunks recovered for readers (`RecoverChunks`) |
//! | `starckpt_target_capacity_bytes`, `_used_bytes`, `_chunks` | gauges | the device, per target |
//! | `starckpt_target_free_pool_bytes` | gauge | deleted chunks' files kept for reuse |
//! | `starckpt_target_chunk_writes_total`, `_chunk_reads_total` | counters | chunks written (new) and read from the device |
//! | `starckpt_target_placed_writes_total`, `_placed_reads_total` | counters | of those, straight from/into a same-host client's memory |
//! | `starckpt_target_scrub_verified_chunks_total`, `_scrub_corrupt_removed_total` | counters | the scrubber |
//! | `starckpt_target_requests_total{op,code}` | counter | data-plane requests answered, by operation (`put`, `get`, `has`, …) and response code |
//! | `starckpt_target_request_seconds{op}` | histogram | their latency, from the request's header to its response written |
//! | `starckpt_target_refused_total{reason}` | counter | data-plane requests refused for their capability (`unauthorized`) |
//!
//! Target series are published with every heartbeat (each second), from the store's own
//! counters.

use std::net::SocketAddr;
use std::time::Instant;

use metrics_exporter_prometheus::PrometheusBuilder;
use tonic::codegen::{BoxFuture, Context, Poll, Service, http};

/// Serves every series of this process at `http://ADDR/metrics`. Call once, inside the tokio
/// runtime; a second call fails (one recorder per process).
pub fn serve(address: SocketAddr) -> anyhow::Result<()> {
    PrometheusBuilder::new()
        .with_http_listener(address)
        // Seconds: from a cached `Latest` (sub-millisecond) to a commit behind a busy database.
        .set_buckets(&[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0])
        .map_err(|e| anyhow::anyhow!("metrics buckets: {e}"))?
        .install()
        .map_err(|e| anyhow::anyhow!("serve metrics on {address}: {e}"))?;
    tracing::info!(%address, "metrics served at /metrics");
    Ok(())
}

/// A tower layer for the control plane's gRPC server: counts and times every call by method and
/// status. A call that fails has its status in the response headers (gRPC's trailers-only form);
/// one that succeeds carries none there.
#[derive(Clone)]
pub struct Metered<S>(pub S);

impl<S, B, RB> Service<http::Request<B>> for Metered<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.uri().path().rsplit('/').next().unwrap_or_default().to_owned();
        let started = Instant::now();
        let answer = self.0.call(request);
        Box::pin(async move {
            let answer = answer.await;
            let code = match &answer {
                Ok(response) => match response.headers().get("grpc-status").and_then(|v| v.to_str().ok()) {
                    None | Some("0") => "OK".to_owned(),
                    Some(code) => format!("{:?}", tonic::Code::from_bytes(code.as_bytes())),
                },
                Err(_) => "transport".to_owned(),
            };
            metrics::counter!("starckpt_control_requests_total", "method" => method.clone(), "code" => code)
                .increment(1);
            metrics::histogram!("starckpt_control_request_seconds", "method" => method)
                .record(started.elapsed().as_secs_f64());
            answer
        })
    }
}

/// Records a data-plane request whose response was written: counted by operation and response
/// code, timed from its header to its response on the socket.
pub fn answered(target: &str, opcode: starckpt_proto::frame::Opcode, code: i32, started: Instant) {
    let code = starckpt_proto::data::ErrorCode::try_from(code).map_or("UNKNOWN", |code| code.as_str_name());
    let op = opcode.name();
    metrics::counter!("starckpt_target_requests_total", "target" => target.to_owned(), "op" => op, "code" => code)
        .increment(1);
    metrics::histogram!("starckpt_target_request_seconds", "target" => target.to_owned(), "op" => op)
        .record(started.elapsed().as_secs_f64());
}

/// Publishes a target's counters (`target_id`'s store and scrubber) as its series.
pub fn publish_target(
    target_id: &str,
    stats: &crate::chunkserver::store::StoreStats,
    scrub: &crate::chunkserver::scrub::ScrubStats,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let target = target_id.to_owned();
    let gauge = |name: &'static str, value: u64| metrics::gauge!(name, "target" => target.clone()).set(value as f64);
    gauge("starckpt_target_capacity_bytes", stats.capacity_bytes);
    gauge("starckpt_target_used_bytes", stats.used_bytes);
    gauge("starckpt_target_chunks", stats.chunk_count);
    gauge("starckpt_target_free_pool_bytes", stats.free_pool_bytes);
    let counter = |name: &'static str, value: u64| metrics::counter!(name, "target" => target.clone()).absolute(value);
    counter("starckpt_target_chunk_writes_total", stats.chunk_writes);
    counter("starckpt_target_chunk_reads_total", stats.chunk_reads);
    counter("starckpt_target_placed_writes_total", stats.placed_writes);
    counter("starckpt_target_placed_reads_total", stats.placed_reads);
    counter("starckpt_target_scrub_verified_chunks_total", scrub.verified_chunks.load(Relaxed));
    counter("starckpt_target_scrub_corrupt_removed_total", scrub.corrupt_removed.load(Relaxed));
}
