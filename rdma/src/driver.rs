//! The work-request state machine above [`QueuePair`]: bounded outstanding requests, completions
//! polled on a dedicated thread and delivered to the awaiting task, timeouts, and teardown that
//! never frees memory a device may still touch.
//!
//! A request's life: a permit of the queue pair's bound is taken, a waiter is recorded under a
//! fresh id, the request is posted; the completion thread finds its completion and hands it, with
//! the memory the request used (`keep`), back to the waiter. `keep` (the buffers, their
//! registrations) is owned by the driver from post to completion: a caller that stops waiting
//! (a cancelled task) never frees memory under an in-flight transfer; it is dropped when the
//! completion (or the flush of a failed queue pair) arrives.
//!
//! A request that does not complete within the timeout fails the queue pair (everything still
//! posted is flushed) and the caller gets [`RdmaError::Timeout`]. Any failed completion leaves the
//! queue pair in the error state, as on hardware: the driver refuses further requests and its
//! owner tears the connection down.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::verbs::{Completion, QueuePair, VerbsError, WcStatus, WorkRequest};

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RdmaError {
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error("the transfer failed: {0:?}")]
    Completion(WcStatus),
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    #[error("the queue pair failed earlier; the connection must be rebuilt")]
    Failed,
}

type Waiter = Box<dyn FnOnce(Completion) + Send>;
type Waiters = Arc<Mutex<Option<HashMap<u64, Waiter>>>>;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A connected queue pair with its completion thread.
pub struct QpDriver {
    qp: Arc<dyn QueuePair>,
    waiters: Waiters,
    permits: Arc<Semaphore>,
    next_id: AtomicU64,
    failed: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    timeout: Duration,
}

/// How long teardown waits for a failed queue pair to flush its requests before it gives up on
/// them (and leaks their memory rather than free it under a device).
const FLUSH_WAIT: Duration = Duration::from_secs(5);

impl QpDriver {
    /// Drives `qp` (already connected): at most `max_outstanding` requests in flight (more wait),
    /// each failing after `timeout`.
    pub fn new(qp: Box<dyn QueuePair>, max_outstanding: u32, timeout: Duration) -> Arc<QpDriver> {
        let qp: Arc<dyn QueuePair> = Arc::from(qp);
        let waiters: Waiters = Arc::new(Mutex::new(Some(HashMap::new())));
        let failed = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (poll_qp, poll_waiters, poll_failed, poll_stop) =
            (Arc::clone(&qp), Arc::clone(&waiters), Arc::clone(&failed), Arc::clone(&stop));
        let spawned = std::thread::Builder::new()
            .name("rdma-completions".into())
            .spawn(move || completion_loop(&*poll_qp, &poll_waiters, &poll_failed, &poll_stop));
        if let Err(error) = spawned {
            tracing::warn!(%error, "no RDMA completion thread; the queue pair is unusable");
            failed.store(true, Ordering::SeqCst);
        }
        Arc::new(QpDriver {
            qp,
            waiters,
            permits: Arc::new(Semaphore::new(max_outstanding.max(1) as usize)),
            next_id: AtomicU64::new(1),
            failed,
            stop,
            timeout,
        })
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Fails the queue pair: requests in flight are flushed, later ones refused.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.qp.fail();
    }

    /// Posts `request` (its id is assigned here) and waits for its completion. `keep` is the memory
    /// the request reads or writes; it is returned once the device is done with it.
    pub async fn execute<K: Send + 'static>(&self, mut request: WorkRequest, keep: K) -> Result<K, RdmaError> {
        if self.is_failed() {
            return Err(RdmaError::Failed);
        }
        let permit: OwnedSemaphorePermit =
            Arc::clone(&self.permits).acquire_owned().await.map_err(|_| RdmaError::Failed)?;
        request.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel::<(Completion, K)>();
        let waiter: Waiter = Box::new(move |completion| {
            drop(permit);
            let _ = reply.send((completion, keep));
        });
        match lock(&self.waiters).as_mut() {
            Some(map) => map.insert(request.id, waiter),
            None => return Err(RdmaError::Failed),
        };
        if let Err(error) = self.qp.post(&request) {
            // Never posted: nothing touches `keep`; drop it with the waiter.
            lock(&self.waiters).as_mut().and_then(|m| m.remove(&request.id));
            return Err(error.into());
        }
        let mut answer = answer;
        let (completion, keep) = match tokio::time::timeout(self.timeout, &mut answer).await {
            Ok(Ok(done)) => done,
            Ok(Err(_)) => return Err(RdmaError::Failed),
            Err(_) => {
                self.fail();
                // The flush hands `keep` back (or the completion thread leaks it if the device
                // never flushes); either way it is not freed under the device.
                let _ = tokio::time::timeout(FLUSH_WAIT, answer).await;
                return Err(RdmaError::Timeout(self.timeout));
            }
        };
        match completion.status {
            WcStatus::Success => Ok(keep),
            status => {
                self.failed.store(true, Ordering::SeqCst);
                Err(RdmaError::Completion(status))
            }
        }
    }
}

impl Drop for QpDriver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.qp.fail();
    }
}

fn completion_loop(qp: &dyn QueuePair, waiters: &Waiters, failed: &AtomicBool, stop: &AtomicBool) {
    let mut completions = Vec::new();
    let mut stopping_since = None;
    let mut poll_failed = false;
    loop {
        if let Err(error) = qp.poll(&mut completions, Duration::from_millis(20)) {
            if !poll_failed {
                tracing::warn!(%error, "polling RDMA completions failed; failing the queue pair");
                poll_failed = true;
                failed.store(true, Ordering::SeqCst);
                qp.fail();
            }
            // The queue pair is failed and its owner tears it down; poll slowly until then.
            stop.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
        }
        for completion in completions.drain(..) {
            let waiter = lock(waiters).as_mut().and_then(|m| m.remove(&completion.id));
            if let Some(waiter) = waiter {
                waiter(completion);
            }
        }
        if stop.load(Ordering::SeqCst) {
            let started = *stopping_since.get_or_insert_with(std::time::Instant::now);
            let idle = lock(waiters).as_ref().is_none_or(HashMap::is_empty);
            if idle || started.elapsed() > FLUSH_WAIT {
                // Requests the device never completed keep their memory forever (leaked, not
                // freed under a device that may still write it).
                if let Some(left) = lock(waiters).take() {
                    if !left.is_empty() {
                        tracing::error!(requests = left.len(), "RDMA requests never completed; leaking their buffers");
                    }
                    std::mem::forget(left);
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::SoftDevice;
    use crate::verbs::{Access, Op, Verbs};

    fn connected(client: &SoftDevice, target: &SoftDevice) -> (Box<dyn QueuePair>, Box<dyn QueuePair>) {
        let (c, t) = (client.create_qp(8, Access::REMOTE_READ).unwrap(), target.create_qp(8, Access::LOCAL).unwrap());
        c.connect(&t.endpoint()).unwrap();
        t.connect(&c.endpoint()).unwrap();
        (c, t)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_reads_share_a_bounded_queue() {
        let (client, target) = (SoftDevice::new("c"), SoftDevice::new("t"));
        let (_c, t) = connected(&client, &target);
        let driver = QpDriver::new(t, 2, Duration::from_secs(5));
        let mut source: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
        let far = unsafe { client.register(source.as_mut_ptr(), source.len(), Access::REMOTE_READ) }.unwrap();
        let mut tasks = Vec::new();
        for i in 0..16u64 {
            let driver = Arc::clone(&driver);
            let (addr, rkey) = (far.addr() + i * 4096, far.rkey());
            let target = Arc::clone(&target);
            tasks.push(tokio::spawn(async move {
                let mut sink = vec![0u8; 4096];
                let near = unsafe { target.register(sink.as_mut_ptr(), 4096, Access::LOCAL) }.unwrap();
                let request = WorkRequest {
                    id: 0,
                    op: Op::Read,
                    local_addr: near.addr(),
                    lkey: near.lkey(),
                    len: 4096,
                    remote_addr: addr,
                    rkey,
                };
                let near = driver.execute(request, near).await.unwrap();
                drop(near);
                sink
            }));
        }
        for (i, task) in tasks.into_iter().enumerate() {
            assert_eq!(task.await.unwrap(), &source[i * 4096..(i + 1) * 4096]);
        }
        drop(far);
        assert_eq!(target.registered_regions(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_request_times_out_fails_the_queue_pair_and_keeps_its_memory_until_flushed() {
        let (client, target) = (SoftDevice::new("c"), SoftDevice::new("t"));
        let (_c, t) = connected(&client, &target);
        let driver = QpDriver::new(t, 4, Duration::from_millis(100));
        let mut source = vec![5u8; 4096];
        let far = unsafe { client.register(source.as_mut_ptr(), 4096, Access::REMOTE_READ) }.unwrap();
        let mut sink = vec![0u8; 4096];
        let near = unsafe { target.register(sink.as_mut_ptr(), 4096, Access::LOCAL) }.unwrap();
        let request = WorkRequest {
            id: 0,
            op: Op::Read,
            local_addr: near.addr(),
            lkey: near.lkey(),
            len: 4096,
            remote_addr: far.addr(),
            rkey: far.rkey(),
        };
        target.stall();
        let dropped = Arc::new(AtomicBool::new(false));
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let result = driver.execute(request, Flag(Arc::clone(&dropped))).await;
        assert_eq!(result.err(), Some(RdmaError::Timeout(Duration::from_millis(100))));
        // The flush returned the memory (dropped here, after the device let go of it).
        assert!(dropped.load(Ordering::SeqCst));
        assert!(driver.is_failed());
        assert_eq!(driver.execute(request, ()).await.err(), Some(RdmaError::Failed));
        target.resume();
        assert!(sink.iter().all(|&b| b == 0));

        // A bad rkey fails its request and the queue pair.
        let (_c, t) = connected(&client, &target);
        let driver = QpDriver::new(t, 4, Duration::from_secs(5));
        let bad = WorkRequest { rkey: far.rkey() ^ 0xffff, ..request };
        assert_eq!(driver.execute(bad, ()).await.err(), Some(RdmaError::Completion(WcStatus::RemoteAccess)));
        assert!(driver.is_failed());
    }
}
