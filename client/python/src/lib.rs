//! `starckpt._native`: the Rust client SDK exposed to Python.
//!
//! This layer is thin on purpose: it moves bytes between Python buffers and the SDK with the GIL
//! released, and turns SDK errors into the exception classes of `starckpt.errors`. Everything
//! about Python values (nested state, dtypes, torch) lives in the pure-Python package.
//!
//! One tokio runtime serves the process. A process forked from one that used it gets a fresh
//! runtime (the parent's worker threads do not exist in the child), and a client created before
//! the fork refuses to work in the child rather than hang.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyTimeoutError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyType};
use starckpt_client as sdk;
use starckpt_client::sync::LockExt;
use starckpt_proto::codec;
use tokio::runtime::Runtime;
use tokio::sync::watch;

/// How often a blocking wait wakes up to let Python handle signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

static RUNTIME: Mutex<Option<(u32, &'static Runtime)>> = Mutex::new(None);

/// This process's runtime, made on first use (and again in a forked child). Called with the GIL
/// held (the token says so): `os.fork` needs the GIL too, so no process is forked while another
/// thread holds `RUNTIME`'s lock, and a child never inherits it held.
fn runtime(_gil: Python<'_>) -> PyResult<&'static Runtime> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock_unpoisoned();
    if let Some((owner, runtime)) = *slot
        && owner == pid
    {
        return Ok(runtime);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("starckpt-sdk")
        .enable_all()
        .build()
        .map_err(|e| raise("StarckptError", format!("cannot start the SDK runtime: {e}")))?;
    // Lives as long as the process: clients and save handles hold tasks on it. (A runtime
    // inherited from a parent by fork is leaked too; dropping it would join threads that the
    // child does not have.)
    let runtime: &'static Runtime = Box::leak(Box::new(runtime));
    *slot = Some((pid, runtime));
    Ok(runtime)
}

/// Runs the future `make` returns on the SDK runtime with the GIL released, taking the GIL back
/// every [`SIGNAL_POLL`] to let Python raise KeyboardInterrupt. `deadline` bounds the wait
/// (TimeoutError after it). The future is made and polled on this thread, so it need not be
/// `Send`.
fn block_on<T: Send, F: Future<Output = T>>(
    py: Python<'_>,
    deadline: Option<Instant>,
    make: impl FnOnce() -> F + Send,
) -> PyResult<T> {
    thread_local! {
        static IN_CALL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    /// Clears the flag however the call ends.
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            IN_CALL.with(|flag| flag.set(false));
        }
    }
    if IN_CALL.with(|flag| flag.replace(true)) {
        // A Python signal handler (run while this thread waits in a call) called starckpt: the
        // inner call could wait forever on the outer one (one save uploads at a time).
        return Err(raise(
            "StarckptError",
            "a starckpt call was made while another one is in progress on this thread (from a signal \
             handler?): have the handler set a flag and save from the training loop"
                .into(),
        ));
    }
    let _leave = Leave;
    let runtime = runtime(py)?;
    py.detach(|| {
        runtime.block_on(async {
            let mut future = std::pin::pin!(make());
            loop {
                let slice = match deadline {
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(PyTimeoutError::new_err("timed out"));
                        }
                        left.min(SIGNAL_POLL)
                    }
                    None => SIGNAL_POLL,
                };
                if let Ok(value) = tokio::time::timeout(slice, future.as_mut()).await {
                    return Ok(value);
                }
                // Outside the runtime's context (a handler may call into Python code that starts
                // one), and not at all while the interpreter is finalizing.
                tokio::task::block_in_place(|| Python::try_attach(|py| py.check_signals()).unwrap_or(Ok(())))?;
            }
        })
    })
}

/// The `starckpt.errors` class for an SDK error.
fn error_class(err: &sdk::Error) -> &'static str {
    use sdk::Error as E;
    match err {
        E::Unreachable { .. } => "ConnectionError",
        // The checkpoint read is gone: what a reader of a step that is not there hears.
        E::NotFound { .. } | E::Deleted { .. } => "NotFoundError",
        E::AlreadyExists { .. } => "AlreadyExistsError",
        E::Rejected { .. } => "RejectedError",
        E::Fenced { .. } => "FencedError",
        E::Denied { .. } => "DeniedError",
        E::Control { .. } => "StarckptError",
        E::Target { source, .. } if source.is_connection() => "ConnectionError",
        E::Target { .. } => "TargetError",
        E::Checksum { .. } => "ChecksumError",
        E::ChunkUnavailable { .. } if err.is_checksum() => "ChecksumError",
        E::ChunkUnavailable { .. } | E::NoTarget { .. } | E::Underreplicated { .. } | E::Source { .. } => {
            "UnavailableError"
        }
        E::Invalid(_) | E::InvalidInput(_) => "InvalidInputError",
        E::Io { .. } => "StarckptIOError",
        E::Cancelled(_) => "CancelledError",
    }
}

/// An exception of class `starckpt.errors.<class>`.
fn raise(class: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let class = py
            .import("starckpt.errors")
            .and_then(|module| module.getattr(class))
            .and_then(|class| class.cast_into::<PyType>().map_err(PyErr::from));
        match class {
            Ok(class) => PyErr::from_type(class, message),
            Err(import_error) => import_error,
        }
    })
}

fn py_err(err: sdk::Error) -> PyErr {
    raise(error_class(&err), err.to_string())
}

/// A file of a save, as the caller gave it.
enum Source {
    Buffer(PyUntypedBuffer),
    Fill { size: u64, fill: Py<PyAny> },
}

/// A [`Source`] as it crosses into GIL-free code: a buffer's address and length, or a fill.
enum Span<'a> {
    Bytes(usize, usize),
    Fill(u64, &'a sdk::FillFn<'a>),
}

/// A staging buffer lent to a fill function: writable through the buffer protocol, with its
/// exports counted so that one still held when the fill returns is caught, and closed after the
/// fill (no new exports) so that keeping the object itself reaches nothing.
#[pyclass(module = "starckpt._native", frozen)]
struct StagingView {
    address: usize,
    len: usize,
    exports: AtomicUsize,
    open: AtomicBool,
}

#[pymethods]
impl StagingView {
    /// # Safety
    /// Called by Python with a `Py_buffer` to fill.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut pyo3::ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let this = slf.get();
        if !this.open.load(Ordering::Acquire) {
            return Err(PyBufferError::new_err("this staging buffer was handed back; it cannot be used any more"));
        }
        let len = pyo3::ffi::Py_ssize_t::try_from(this.len).map_err(|_| PyBufferError::new_err("too large"))?;
        // SAFETY: `view` is the caller's Py_buffer; the memory is valid while the view is open
        // (the fill call), and an export still held after that fails the save (see `call_fill`).
        let filled =
            unsafe { pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), this.address as *mut c_void, len, 0, flags) };
        if filled != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        this.exports.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// # Safety
    /// Called by Python when an export ends.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

/// Calls `fill(offset, view)` with a [`StagingView`] of `out`, then closes the view. A fill that
/// still holds an export of it (an array built on it) or a reference to it fails the save: the
/// staging buffer goes back to the pool, and an array on it could still write there. (Some
/// arrays keep the object and end their export at once, `torch.frombuffer`'s among them, so the
/// object's own references are counted too.) Fills are the package's own functions, which keep
/// neither.
fn call_fill(py: Python<'_>, fill: &Py<PyAny>, offset: u64, out: &mut [u8]) -> PyResult<()> {
    let view = Bound::new(
        py,
        StagingView {
            address: out.as_mut_ptr() as usize,
            len: out.len(),
            exports: AtomicUsize::new(0),
            open: AtomicBool::new(true),
        },
    )?;
    let called = fill.bind(py).call1((offset, &view)).map(drop);
    view.get().open.store(false, Ordering::Release);
    called?;
    match view.get().exports.load(Ordering::Acquire) {
        0 => {}
        held => {
            return Err(raise(
                "InvalidInputError",
                format!("a fill function kept {held} export(s) of its staging buffer; it must not keep any"),
            ));
        }
    }
    // `view` is this function's reference; any other is the fill's.
    // SAFETY: `view` is a live object; reading its count with the GIL held.
    match unsafe { pyo3::ffi::Py_REFCNT(view.as_ptr()) } {
        1 => Ok(()),
        refs => Err(raise(
            "InvalidInputError",
            format!("a fill function kept {} reference(s) to its staging buffer; it must not keep any", refs - 1),
        )),
    }
}

/// Fails if `pid` (the creator of an object) is not this process.
fn same_process(pid: u32, what: &str) -> PyResult<()> {
    if pid == std::process::id() {
        Ok(())
    } else {
        Err(raise(
            "StarckptError",
            format!("this {what} was created in process {pid} and cannot be used after fork; create a new one"),
        ))
    }
}

fn checkpoint_dict<'py>(py: Python<'py>, info: &sdk::CheckpointInfo) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    let state = match info.state() {
        sdk::CheckpointState::Pending => "pending",
        sdk::CheckpointState::Committed => "committed",
        sdk::CheckpointState::Aborted => "aborted",
        sdk::CheckpointState::Deleted => "deleted",
        sdk::CheckpointState::Unspecified => "unknown",
    };
    dict.set_item("job", &info.job)?;
    dict.set_item("step", info.step)?;
    dict.set_item("state", state)?;
    dict.set_item("world_size", info.world_size)?;
    dict.set_item("parts_committed", info.parts_committed)?;
    dict.set_item("total_bytes", info.total_bytes)?;
    dict.set_item("written_bytes", info.written_bytes)?;
    dict.set_item("file_count", info.file_count)?;
    dict.set_item("created_at_ms", info.created_at_ms)?;
    dict.set_item("committed_at_ms", info.committed_at_ms)?;
    dict.set_item("epoch", info.epoch)?;
    dict.set_item("tags", info.tags.clone())?;
    Ok(dict)
}

/// A value made in one process whose drop is skipped in a process forked from it: dropping an
/// SDK object wakes tasks of the parent's runtime, whose threads (and any lock they held at the
/// fork) do not exist in the child, so a child that exits normally could hang. Leaked instead.
struct ProcessLocal<T> {
    value: std::mem::ManuallyDrop<T>,
    pid: u32,
}

impl<T> ProcessLocal<T> {
    fn new(value: T) -> ProcessLocal<T> {
        ProcessLocal { value: std::mem::ManuallyDrop::new(value), pid: std::process::id() }
    }
}

impl<T> std::ops::Deref for ProcessLocal<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Drop for ProcessLocal<T> {
    fn drop(&mut self) {
        if self.pid == std::process::id() {
            // SAFETY: dropped once, here; the value is not used after.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.value) };
        }
    }
}

/// A connection to a starckpt cluster (one per process and server, shared by the Python layer).
#[pyclass(module = "starckpt._native", frozen)]
struct NativeClient {
    client: ProcessLocal<sdk::Client>,
    pid: u32,
}

impl NativeClient {
    fn client(&self) -> PyResult<&sdk::Client> {
        same_process(self.pid, "client")?;
        Ok(&self.client)
    }
}

#[pymethods]
impl NativeClient {
    #[new]
    #[pyo3(signature = (server, *, staging_bytes=None, chunk_size_bytes=None, run_id=None, compress_level=None, token=None, tls_ca=None))]
    // Python's keyword arguments: the constructor's API.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        server: String,
        staging_bytes: Option<usize>,
        chunk_size_bytes: Option<usize>,
        run_id: Option<String>,
        compress_level: Option<i32>,
        token: Option<String>,
        tls_ca: Option<std::path::PathBuf>,
    ) -> PyResult<NativeClient> {
        let mut config = sdk::ClientConfig::new(server);
        if token.is_some() {
            config.token = token;
        }
        if tls_ca.is_some() {
            config.tls_ca = tls_ca;
        }
        config.compression = compress_config(compress_level)?;
        if let Some(bytes) = staging_bytes {
            config.staging_bytes = bytes;
        }
        if let Some(bytes) = chunk_size_bytes {
            config.chunk_size_bytes = bytes;
        }
        if run_id.is_some() {
            config.run_id = run_id;
        }
        let client = block_on(py, None, || sdk::Client::connect(config))?.map_err(py_err)?;
        Ok(NativeClient { client: ProcessLocal::new(client), pid: std::process::id() })
    }

    /// Allocates and pre-faults up to `bytes` of staging memory ([`sdk::Client::warm_staging`]),
    /// on a thread of its own unless `wait` (then with the GIL released).
    #[pyo3(signature = (bytes, wait=false))]
    fn warm_staging(&self, py: Python<'_>, bytes: usize, wait: bool) -> PyResult<()> {
        let client = self.client()?.clone();
        if wait {
            py.detach(|| client.warm_staging(bytes));
            return Ok(());
        }
        std::thread::Builder::new()
            .name("starckpt-warm".into())
            .spawn(move || client.warm_staging(bytes))
            .map(drop)
            .map_err(|e| raise("StarckptError", format!("cannot start the warming thread: {e}")))
    }

    #[getter]
    fn staging_allocated_bytes(&self) -> PyResult<usize> {
        Ok(self.client()?.staging_allocated_bytes())
    }

    #[getter]
    fn run_id(&self) -> PyResult<String> {
        Ok(self.client()?.run_id().to_owned())
    }

    #[getter]
    fn server(&self) -> PyResult<String> {
        Ok(self.client()?.config().server.clone())
    }

    /// This run's writer-lease epoch for `job`, taken on first use.
    fn lease(&self, py: Python<'_>, job: String) -> PyResult<u64> {
        let client = self.client()?;
        block_on(py, None, || client.lease(&job))?.map_err(py_err)
    }

    /// The highest committed step of `job`, or None.
    fn latest(&self, py: Python<'_>, job: String) -> PyResult<Option<u64>> {
        let client = self.client()?;
        Ok(block_on(py, None, || client.latest(&job))?.map_err(py_err)?.map(|info| info.step))
    }

    #[pyo3(signature = (job, include_inactive=false))]
    fn list<'py>(&self, py: Python<'py>, job: String, include_inactive: bool) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let client = self.client()?;
        let checkpoints = block_on(py, None, || client.list_checkpoints(&job, include_inactive))?.map_err(py_err)?;
        checkpoints.iter().map(|info| checkpoint_dict(py, info)).collect()
    }

    fn delete(&self, py: Python<'_>, job: String, step: u64) -> PyResult<()> {
        let client = self.client()?;
        block_on(py, None, || client.delete(&job, step))?.map_err(py_err)
    }

    /// Saves one rank's part: each `(path, source)` becomes a file, taken during this call (the
    /// caller may then change its memory). A source is a buffer (copied into staging), or a pair
    /// `(size, fill)` where `fill(offset, view)` writes bytes `[offset, offset + len(view))` of
    /// the file into the writable memoryview `view` of a staging buffer and must not keep it (a
    /// device-to-host copy straight into staging). Returns None if `skip_if_busy` and this
    /// client's previous save is still uploading.
    #[pyo3(signature = (job, step, files, *, rank=0, world_size=1, metadata=BTreeMap::new(), skip_if_busy=false))]
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        py: Python<'_>,
        job: String,
        step: u64,
        files: Vec<(String, Bound<'_, PyAny>)>,
        rank: u32,
        world_size: u32,
        metadata: BTreeMap<String, String>,
        skip_if_busy: bool,
    ) -> PyResult<Option<SaveHandle>> {
        let client = self.client()?;
        let mut lent = Vec::with_capacity(files.len());
        for (path, object) in files {
            let source = match PyUntypedBuffer::get(&object) {
                Ok(buffer) if buffer.is_c_contiguous() => Source::Buffer(buffer),
                Ok(_) => return Err(raise("InvalidInputError", format!("{path}: the buffer is not C-contiguous"))),
                Err(not_a_buffer) => match object.extract::<(u64, Bound<'_, PyAny>)>() {
                    Ok((size, fill)) if fill.is_callable() => Source::Fill { size, fill: fill.unbind() },
                    _ => {
                        return Err(raise(
                            "InvalidInputError",
                            format!("{path}: neither a buffer nor a (size, fill) pair: {not_a_buffer}"),
                        ));
                    }
                },
            };
            lent.push((path, source));
        }
        // A fill's Python exception, raised in place of the save's error it causes.
        let fill_error: Mutex<Option<PyErr>> = Mutex::new(None);
        let fills: Vec<Box<sdk::FillFn<'_>>> = lent
            .iter()
            .filter_map(|(_, source)| match source {
                Source::Fill { fill, .. } => Some(fill),
                Source::Buffer(_) => None,
            })
            .map(|fill| {
                let fill_error = &fill_error;
                Box::new(move |offset: u64, out: &mut [u8]| {
                    Python::attach(|py| call_fill(py, fill, offset, out)).map_err(|e| {
                        let message = e.to_string();
                        fill_error.lock_unpoisoned().get_or_insert(e);
                        message
                    })
                }) as Box<sdk::FillFn<'_>>
            })
            .collect();
        // Buffer addresses cross into the GIL-free closure as integers; the buffers above stay
        // acquired (their exporters cannot free or resize the memory) until this returns.
        let mut next_fill = fills.iter();
        let spans: Vec<(&str, Span<'_>)> = lent
            .iter()
            .map(|(path, source)| {
                let span = match source {
                    Source::Buffer(buffer) => Span::Bytes(buffer.buf_ptr() as usize, buffer.len_bytes()),
                    Source::Fill { size, .. } => Span::Fill(*size, &**next_fill.next().expect("one fill per source")),
                };
                (path.as_str(), span)
            })
            .collect();
        let mut part = sdk::SavePart::new(job, step).rank(rank, world_size);
        part.metadata = metadata;
        let handle = block_on(py, None, move || async move {
            let sources: Vec<(&str, sdk::Lent<'_>)> = spans
                .iter()
                .map(|&(path, ref span)| {
                    let source = match *span {
                        Span::Bytes(_, 0) => sdk::Lent::Bytes(&[]),
                        // SAFETY: the buffer export (held in `lent`) keeps `len` bytes at
                        // `address` valid and unmoved for the duration of this call.
                        Span::Bytes(address, len) => {
                            sdk::Lent::Bytes(unsafe { std::slice::from_raw_parts(address as *const u8, len) })
                        }
                        Span::Fill(size, fill) => sdk::Lent::Fill { size, fill },
                    };
                    (path, source)
                })
                .collect();
            if skip_if_busy {
                client.try_save_lent(part, &sources).await
            } else {
                client.save_lent(part, &sources).await.map(Some)
            }
        })?;
        drop(fills);
        drop(lent);
        let handle = match handle {
            Ok(handle) => handle,
            Err(err) => {
                return Err(fill_error.into_inner().unwrap_or_else(|p| p.into_inner()).unwrap_or_else(|| py_err(err)));
            }
        };
        let Some(handle) = handle else { return Ok(None) };
        Ok(Some(SaveHandle::spawn(handle, runtime(py)?)))
    }

    /// The committed manifest of (job, step), or of the latest committed step.
    #[pyo3(signature = (job, step=None))]
    fn manifest(&self, py: Python<'_>, job: String, step: Option<u64>) -> PyResult<Manifest> {
        let client = self.client()?;
        let manifest = block_on(py, None, || client.manifest(&job, step))?.map_err(py_err)?;
        Ok(Manifest {
            client: ProcessLocal::new(client.clone()),
            manifest: ProcessLocal::new(Arc::new(manifest)),
            pid: self.pid,
        })
    }

    /// Restores (job, step), or the latest committed step, into the directory `to` (which must be
    /// empty or absent unless `force`). Returns (files, bytes). The latest deleted while it is
    /// restored (a newer one committed, and retention let it go) is given up for the new latest.
    #[pyo3(signature = (job, to, step=None, force=false))]
    fn restore(
        &self,
        py: Python<'_>,
        job: String,
        to: PathBuf,
        step: Option<u64>,
        force: bool,
    ) -> PyResult<(usize, u64)> {
        let client = self.client()?;
        let deleted = |error: &sdk::Error| matches!(error, sdk::Error::Deleted { .. });
        let outcome = block_on(py, None, || {
            client.with_manifest(&job, step, deleted, |manifest| {
                let (client, to) = (&client, &to);
                async move { client.restore(&manifest, to, sdk::RestoreOptions { force }).await }
            })
        })?
        .map_err(py_err)?;
        Ok((outcome.files, outcome.bytes))
    }
}

/// A committed checkpoint's files, readable into caller buffers.
#[pyclass(module = "starckpt._native", frozen)]
struct Manifest {
    client: ProcessLocal<sdk::Client>,
    manifest: ProcessLocal<Arc<sdk::CheckpointManifest>>,
    pid: u32,
}

#[pymethods]
impl Manifest {
    #[getter]
    fn job(&self) -> String {
        self.manifest.info.job.clone()
    }

    #[getter]
    fn step(&self) -> u64 {
        self.manifest.info.step
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.manifest.info.world_size
    }

    #[getter]
    fn total_bytes(&self) -> u64 {
        self.manifest.total_bytes()
    }

    /// (path, size in bytes) of every file, all ranks merged.
    fn files(&self) -> Vec<(String, u64)> {
        self.manifest.files.iter().map(|f| (f.path.to_string(), f.size_bytes)).collect()
    }

    /// Each rank's metadata: a list of (rank, {key: value}).
    fn metadata(&self) -> Vec<(u32, BTreeMap<String, String>)> {
        self.manifest.metadata.clone()
    }

    /// The size of `path` in bytes, or None if the checkpoint has no such file.
    fn size(&self, path: &str) -> Option<u64> {
        self.manifest.file(path).map(|f| f.size_bytes)
    }

    /// Fills each writable, C-contiguous `buffer` with the verified bytes of `path` from
    /// `offset` on (as many bytes as the buffer holds), `files_at_once` files in flight, which
    /// share the client's `restore_concurrency` chunks in flight out among them.
    #[pyo3(signature = (reads, files_at_once=8))]
    fn read_many(
        &self,
        py: Python<'_>,
        reads: Vec<(String, Bound<'_, PyAny>, u64)>,
        files_at_once: usize,
    ) -> PyResult<()> {
        use futures::StreamExt;
        same_process(self.pid, "manifest")?;
        let mut lent = Vec::with_capacity(reads.len());
        for (path, object, offset) in reads {
            let buffer = PyUntypedBuffer::get(&object)?;
            if buffer.readonly() || !buffer.is_c_contiguous() {
                return Err(raise(
                    "InvalidInputError",
                    format!("{path}: the target buffer must be writable and C-contiguous"),
                ));
            }
            lent.push((path, offset, buffer));
        }
        let spans: Vec<(&str, u64, usize, usize)> = lent
            .iter()
            .map(|(path, offset, buffer)| (path.as_str(), *offset, buffer.buf_ptr() as usize, buffer.len_bytes()))
            .collect();
        let mut ranges: Vec<(usize, usize, &str)> =
            spans.iter().filter(|s| s.3 > 0).map(|&(path, _, address, len)| (address, address + len, path)).collect();
        ranges.sort_unstable();
        if let Some(pair) = ranges.windows(2).find(|pair| pair[1].0 < pair[0].1) {
            return Err(raise("InvalidInputError", format!("the buffers for {} and {} overlap", pair[0].2, pair[1].2)));
        }
        let files_at_once = files_at_once.max(1);
        let per_file = self.client.config().restore_concurrency.div_ceil(files_at_once);
        let result = block_on(py, None, move || async move {
            let mut reads = futures::stream::iter(spans.into_iter().map(|(path, offset, address, len)| {
                let target: &mut [u8] = if len == 0 {
                    &mut []
                } else {
                    // SAFETY: the writable exports held in `lent` keep `len` bytes at `address` valid
                    // until this returns, and the buffers were checked not to overlap above.
                    unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) }
                };
                self.client.read_range_into_with(&self.manifest, path, offset, target, per_file)
            }))
            .buffer_unordered(files_at_once);
            while let Some(result) = reads.next().await {
                result?;
            }
            Ok::<_, sdk::Error>(())
        })?;
        drop(lent);
        result.map_err(py_err)
    }

    /// The verified bytes of `path` (from `offset`, `length` bytes or to the end).
    #[pyo3(signature = (path, offset=0, length=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        path: String,
        offset: u64,
        length: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        same_process(self.pid, "manifest")?;
        let size = self.manifest.file(&path).map_or(0, |f| f.size_bytes);
        let length = length.unwrap_or(size.saturating_sub(offset));
        let data =
            block_on(py, None, || self.client.read_range(&self.manifest, &path, offset, length))?.map_err(py_err)?;
        Ok(PyBytes::new(py, &data))
    }
}

type Finished = Option<Result<sdk::SaveOutcome, (&'static str, String)>>;

/// A save whose bytes are staged; its upload and commit run in the background.
#[pyclass(module = "starckpt._native", frozen)]
struct SaveHandle {
    #[pyo3(get)]
    checkpoint_id: u64,
    #[pyo3(get)]
    total_bytes: u64,
    progress: Arc<sdk::SaveProgress>,
    finished: ProcessLocal<watch::Receiver<Finished>>,
    pid: u32,
}

impl SaveHandle {
    fn spawn(handle: sdk::SaveHandle, runtime: &Runtime) -> SaveHandle {
        let (tx, finished) = watch::channel(None);
        let progress = Arc::clone(handle.progress());
        let (checkpoint_id, total_bytes) = (handle.checkpoint_id, handle.total_bytes);
        runtime.spawn(async move {
            let outcome = handle.wait().await.map_err(|e| (error_class(&e), e.to_string()));
            tx.send_replace(Some(outcome));
        });
        SaveHandle {
            checkpoint_id,
            total_bytes,
            progress,
            finished: ProcessLocal::new(finished),
            pid: std::process::id(),
        }
    }
}

#[pymethods]
impl SaveHandle {
    /// True once the upload and commit have finished, successfully or not.
    fn done(&self) -> PyResult<bool> {
        same_process(self.pid, "save handle")?;
        Ok(self.finished.borrow().is_some())
    }

    /// Live counters: staged, copied, uploaded and deduplicated bytes, chunks.
    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = &self.progress;
        let dict = PyDict::new(py);
        dict.set_item("total_bytes", self.total_bytes)?;
        dict.set_item("staged_bytes", p.staged_bytes.load(Ordering::Relaxed))?;
        dict.set_item("copied_bytes", p.copied_bytes.load(Ordering::Relaxed))?;
        dict.set_item("uploaded_bytes", p.uploaded_bytes.load(Ordering::Relaxed))?;
        dict.set_item("stored_bytes", p.stored_bytes.load(Ordering::Relaxed))?;
        dict.set_item("deduplicated_bytes", p.deduplicated_bytes.load(Ordering::Relaxed))?;
        dict.set_item("done_bytes", p.done_bytes())?;
        dict.set_item("chunks", p.chunks.load(Ordering::Relaxed))?;
        dict.set_item("deduplicated_chunks", p.deduplicated_chunks.load(Ordering::Relaxed))?;
        Ok(dict)
    }

    /// Waits for the commit (at most `timeout` seconds: TimeoutError after) and returns the
    /// outcome, or raises the save's error. May be called again after either.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        same_process(self.pid, "save handle")?;
        let deadline = match timeout {
            Some(t) if t == f64::INFINITY => None,
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(raise("InvalidInputError", format!("timeout must be a non-negative number, not {t}")));
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t.min(1e9))),
            None => None,
        };
        if self.finished.borrow().is_none() {
            let mut finished = self.finished.clone();
            let waited =
                block_on(py, deadline, move || async move { finished.wait_for(Option::is_some).await.map(|_| ()) });
            match waited {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(raise("CancelledError", "the save's task ended without a result".into())),
                Err(e) if e.is_instance_of::<PyTimeoutError>(py) => {
                    return Err(PyTimeoutError::new_err(format!(
                        "save of checkpoint {} not committed within {:.3} s",
                        self.checkpoint_id,
                        timeout.unwrap_or_default()
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        let finished = self.finished.borrow();
        match finished.as_ref() {
            Some(Ok(outcome)) => {
                let dict = PyDict::new(py);
                let (committed, parts, world) = match outcome.state {
                    sdk::CommitState::Committed => (true, None, None),
                    sdk::CommitState::WaitingForRanks { parts_committed, world_size } => {
                        (false, Some(parts_committed), Some(world_size))
                    }
                };
                dict.set_item("checkpoint_id", outcome.checkpoint_id)?;
                dict.set_item("job", &outcome.job)?;
                dict.set_item("step", outcome.step)?;
                dict.set_item("committed", committed)?;
                dict.set_item("parts_committed", parts)?;
                dict.set_item("world_size", world)?;
                dict.set_item("epoch", outcome.epoch)?;
                dict.set_item("total_bytes", outcome.total_bytes)?;
                dict.set_item("uploaded_bytes", outcome.uploaded_bytes)?;
                dict.set_item("chunks", outcome.chunks)?;
                dict.set_item("deduplicated_chunks", outcome.deduplicated_chunks)?;
                Ok(dict)
            }
            Some(Err((class, message))) => Err(raise(class, message.clone())),
            None => Err(raise("CancelledError", "the save has no result".into())),
        }
    }
}

fn compress_config(level: Option<i32>) -> PyResult<Option<codec::CompressConfig>> {
    match level {
        None => Ok(None),
        Some(level @ 1..=19) => Ok(Some(codec::CompressConfig { level, ..Default::default() })),
        Some(level) => Err(raise("InvalidInputError", format!("compression level {level} is outside 1..=19"))),
    }
}

/// Encodes one chunk as a client with `compress=level` would: `(codec name, stored bytes)`, or
/// None when no codec shrinks it enough to pay (it would be stored as it is).
#[pyfunction]
#[pyo3(signature = (data, level=1))]
fn compress_chunk<'py>(py: Python<'py>, data: &[u8], level: i32) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
    let config = compress_config(Some(level))?.expect("a level was given");
    let packed = py.detach(|| codec::compress(data, &config));
    Ok(packed.map(|p| (p.codec.name().to_owned(), PyBytes::new(py, &p.bytes))))
}

/// Decodes what [`compress_chunk`] returned (`length`: the chunk's length).
#[pyfunction]
fn decompress_chunk<'py>(py: Python<'py>, codec: &str, data: &[u8], length: usize) -> PyResult<Bound<'py, PyBytes>> {
    let codec =
        codec::Codec::from_name(codec).ok_or_else(|| raise("InvalidInputError", format!("unknown codec {codec:?}")))?;
    let decoded =
        py.detach(|| codec::decompress(codec, data, length)).map_err(|e| raise("InvalidInputError", e.to_string()))?;
    Ok(PyBytes::new(py, &decoded))
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(compress_chunk, module)?)?;
    module.add_function(wrap_pyfunction!(decompress_chunk, module)?)?;
    module.add_class::<NativeClient>()?;
    module.add_class::<Manifest>()?;
    module.add_class::<SaveHandle>()?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
