//! Blocking work (a copy, a hash) run from async code.

/// Runs blocking work (a copy) without stalling other tasks of a multi-threaded runtime.
pub fn off_runtime<R>(work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}
