//! Watching I/O for stalls: each operation in flight is timed, and an engine whose oldest
//! operation has waited too long reports it ([`IoWatch`]).

use super::*;

/// Whether a device still completes what it is given: the operations in flight through a
/// [`Watched`] engine, and when one last completed (or the first of a busy spell began). A device
/// that stops completing (a hung NVMe controller, a stuck mount) leaves the target process up and
/// answering; this is what lets it tell (`ChunkStore::io_stalled_for`), so the target stops
/// heartbeating and writers go elsewhere (`chunkserver/mod.rs`).
#[derive(Debug)]
pub struct IoWatch {
    origin: std::time::Instant,
    in_flight: std::sync::atomic::AtomicU64,
    /// Milliseconds after `origin`.
    progress_ms: std::sync::atomic::AtomicU64,
}

impl Default for IoWatch {
    fn default() -> Self {
        IoWatch { origin: std::time::Instant::now(), in_flight: Default::default(), progress_ms: Default::default() }
    }
}

impl IoWatch {
    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// How long operations have been in flight without any completing: zero when idle or when
    /// the device completes them.
    pub fn stalled_for(&self) -> std::time::Duration {
        use std::sync::atomic::Ordering;
        if self.in_flight.load(Ordering::Acquire) == 0 {
            return std::time::Duration::ZERO;
        }
        let since = self.now_ms().saturating_sub(self.progress_ms.load(Ordering::Acquire));
        std::time::Duration::from_millis(since)
    }

    /// Counts an operation in flight until the guard is dropped (its completion).
    pub(super) fn begin(&self) -> Operation<'_> {
        use std::sync::atomic::Ordering;
        let mut in_flight = self.in_flight.load(Ordering::Acquire);
        loop {
            // A busy spell starts the clock: an idle device has not stalled.
            if in_flight == 0 {
                self.progress_ms.store(self.now_ms(), Ordering::Release);
            }
            match self.in_flight.compare_exchange_weak(in_flight, in_flight + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Operation(self),
                Err(now) => in_flight = now,
            }
        }
    }
}

pub(super) struct Operation<'a>(&'a IoWatch);

impl Drop for Operation<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        self.0.progress_ms.store(self.0.now_ms(), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An engine whose operations an [`IoWatch`] follows. The fault point `target.io.hang` makes
/// every write hang for ever, as on a device that stopped completing.
pub struct Watched {
    inner: Arc<dyn IoEngine>,
    watch: Arc<IoWatch>,
}

impl Watched {
    pub fn new(inner: Arc<dyn IoEngine>) -> Watched {
        Watched { inner, watch: Arc::default() }
    }

    pub fn watch(&self) -> &Arc<IoWatch> {
        &self.watch
    }

    pub(super) async fn hang_if_told() {
        if starckpt_dataplane::faults::point("target.io.hang").is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[async_trait]
impl IoEngine for Watched {
    async fn write_new_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        let _op = self.watch.begin();
        Watched::hang_if_told().await;
        self.inner.write_new_file(path, buf).await
    }
    async fn overwrite_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        let _op = self.watch.begin();
        Watched::hang_if_told().await;
        self.inner.overwrite_file(path, buf).await
    }
    async fn read_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        let _op = self.watch.begin();
        self.inner.read_file(path, buf).await
    }
    async fn read_file_split(&self, path: PathBuf, head: BoxedBuf, tail: ExternalBuf) -> io::Result<(BoxedBuf, usize)> {
        let _op = self.watch.begin();
        self.inner.read_file_split(path, head, tail).await
    }
    async fn write_file_split(
        &self,
        path: PathBuf,
        create: bool,
        head: BoxedBuf,
        split: usize,
        body: ExternalBuf,
    ) -> io::Result<BoxedBuf> {
        let _op = self.watch.begin();
        Watched::hang_if_told().await;
        self.inner.write_file_split(path, create, head, split, body).await
    }
    async fn sync_dir(&self, path: PathBuf) -> io::Result<()> {
        let _op = self.watch.begin();
        self.inner.sync_dir(path).await
    }
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }
    fn fixed_buffers(&self) -> usize {
        self.inner.fixed_buffers()
    }
}
