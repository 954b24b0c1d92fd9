//! [`StdEngine`]: the engine operations as blocking syscalls (still O_DIRECT) on tokio's
//! blocking pool, bounded by a semaphore; for hosts without io_uring.

use super::*;

/// Blocking std I/O on tokio's blocking pool.
pub struct StdEngine {
    permits: Arc<Semaphore>,
}

impl StdEngine {
    pub fn new(queue_depth: usize) -> StdEngine {
        StdEngine { permits: Arc::new(Semaphore::new(queue_depth.max(1))) }
    }

    pub(super) async fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let _permit = self.permits.acquire().await.map_err(io::Error::other)?;
        tokio::task::spawn_blocking(job).await.map_err(io::Error::other)?
    }
}

#[async_trait]
impl IoEngine for StdEngine {
    async fn write_new_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        self.run(move || write_synced(create_direct(&path)?, buf)).await
    }

    async fn overwrite_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        self.run(move || write_synced(open_direct_write(&path)?, buf)).await
    }

    async fn read_file(&self, path: PathBuf, mut buf: BoxedBuf) -> io::Result<BoxedBuf> {
        self.run(move || {
            let file = open_direct_read(&path)?;
            let mut done = 0;
            while done < buf.aligned().capacity() {
                let n = file.read_at(&mut buf.aligned_mut().full_mut()[done..], done as u64)?;
                if n == 0 {
                    break;
                }
                done += n;
            }
            buf.aligned_mut().set_len(done);
            Ok(buf)
        })
        .await
    }

    async fn read_file_split(
        &self,
        path: PathBuf,
        mut head: BoxedBuf,
        tail: ExternalBuf,
    ) -> io::Result<(BoxedBuf, usize)> {
        self.run(move || {
            let file = open_direct_read(&path)?;
            let head_len = head.aligned().capacity();
            let done = transfer_split(&file, false, &mut head, (head_len, head_len), &tail)?;
            head.aligned_mut().set_len(done.min(head_len));
            Ok((head, done.saturating_sub(head_len)))
        })
        .await
    }

    async fn write_file_split(
        &self,
        path: PathBuf,
        create: bool,
        mut head: BoxedBuf,
        split: usize,
        body: ExternalBuf,
    ) -> io::Result<BoxedBuf> {
        self.run(move || {
            let file = if create { create_direct(&path)? } else { open_direct_write(&path)? };
            let end = write_len(&head);
            transfer_split(&file, true, &mut head, (split, end), &body)?;
            file.sync_data()?;
            Ok(head)
        })
        .await
    }

    async fn sync_dir(&self, path: PathBuf) -> io::Result<()> {
        self.run(move || File::open(&path)?.sync_all()).await
    }

    fn kind(&self) -> EngineKind {
        EngineKind::Std
    }
}
