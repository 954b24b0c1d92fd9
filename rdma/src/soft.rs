//! An in-process software fabric with verbs semantics, for machines without RDMA hardware.
//!
//! These VMs have no RDMA devices and cannot get any (no InfiniBand in the kernel, so no
//! soft-RoCE; ../shared/MACHINE.md). [`SoftDevice`] implements [`Verbs`] so that every layer
//! above the FFI runs and is tested here, with the semantics that matter to it:
//!
//! - memory regions with keys and bounds: a key is valid from registration until its region is
//!   dropped; an lkey only within its own device (protection domain), an rkey only for the access
//!   its region grants; an access past a region's end fails;
//! - RDMA READ and WRITE copy between registered regions of two connected queue pairs;
//! - a completion queue per queue pair, with statuses for a bad lkey (local protection), a bad
//!   rkey or range (remote access), a vanished peer (retry exceeded) and flushed requests;
//! - a queue pair grants its peer remote read and/or write (as `ibv_modify_qp`'s access flags do);
//! - a failed request moves its queue pair to the error state (as on a real RC queue pair): later
//!   requests complete as flushed;
//! - bounded outstanding requests (posting past the bound fails, as `ibv_post_send` does).
//!
//! All devices of a process share one fabric, so a client and a target in one process (tests,
//! `DevCluster`) can connect. [`SoftDevice::stall`] holds requests unexecuted, to test timeouts
//! and a peer dying mid-transfer.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, RwLock, Weak};
use std::time::Duration;

use crate::verbs::{
    Access, Completion, Endpoint, MemoryRegion, Op, QueuePair, Verbs, VerbsError, WcStatus, WorkRequest,
};

struct RegionEntry {
    device: u64,
    addr: u64,
    len: usize,
    access: Access,
}

/// A queue pair's address on the fabric: (GID, QP number).
type QpAddress = ([u8; 16], u32);

struct Fabric {
    /// Registered regions by key (lkey = rkey here). Transfers hold the read lock while they copy,
    /// so a region cannot be deregistered (and its memory freed) under a copy.
    regions: RwLock<HashMap<u32, RegionEntry>>,
    queue_pairs: Mutex<HashMap<QpAddress, Weak<QpShared>>>,
    next_key: AtomicU32,
    next_qp: AtomicU32,
    next_device: AtomicU64,
}

static FABRIC: LazyLock<Fabric> = LazyLock::new(|| Fabric {
    regions: RwLock::new(HashMap::new()),
    queue_pairs: Mutex::new(HashMap::new()),
    next_key: AtomicU32::new(0x100),
    next_qp: AtomicU32::new(0x10),
    next_device: AtomicU64::new(1),
});

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A device on the in-process software fabric.
pub struct SoftDevice {
    id: u64,
    name: String,
    gid: [u8; 16],
    stalled: Arc<AtomicBool>,
    queue_pairs: Mutex<Vec<Weak<QpShared>>>,
}

impl SoftDevice {
    pub fn new(name: &str) -> Arc<SoftDevice> {
        let id = FABRIC.next_device.fetch_add(1, Ordering::Relaxed);
        // A link-local IPv6-style GID, unique within the process.
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[8..].copy_from_slice(&id.to_be_bytes());
        Arc::new(SoftDevice {
            id,
            name: name.to_owned(),
            gid,
            stalled: Arc::new(AtomicBool::new(false)),
            queue_pairs: Mutex::new(Vec::new()),
        })
    }

    /// While stalled, this device's queue pairs accept work requests but do not run them (a hung
    /// link); [`SoftDevice::resume`] runs them.
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }

    pub fn resume(&self) {
        self.stalled.store(false, Ordering::SeqCst);
        let queue_pairs: Vec<_> = lock(&self.queue_pairs).iter().filter_map(Weak::upgrade).collect();
        for qp in queue_pairs {
            qp.run_pending();
        }
    }

    /// Registered regions of this device (for leak checks in tests).
    pub fn registered_regions(&self) -> usize {
        FABRIC.regions.read().unwrap_or_else(|p| p.into_inner()).values().filter(|r| r.device == self.id).count()
    }
}

impl Verbs for SoftDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn gid(&self) -> [u8; 16] {
        self.gid
    }

    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<Box<dyn MemoryRegion>, VerbsError> {
        if len == 0 || addr.is_null() || u32::try_from(len).is_err() {
            return Err(VerbsError::BadRegion(len));
        }
        let key = FABRIC.next_key.fetch_add(1, Ordering::Relaxed);
        let entry = RegionEntry { device: self.id, addr: addr as u64, len, access };
        FABRIC.regions.write().unwrap_or_else(|p| p.into_inner()).insert(key, entry);
        Ok(Box::new(SoftRegion { key, addr: addr as u64, len }))
    }

    fn create_qp(&self, max_outstanding: u32, remote: Access) -> Result<Box<dyn QueuePair>, VerbsError> {
        let qp_num = FABRIC.next_qp.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(QpShared {
            device: self.id,
            gid: self.gid,
            qp_num,
            max_outstanding: max_outstanding.max(1),
            remote,
            stalled: Arc::clone(&self.stalled),
            state: Mutex::new(QpState { remote: None, failed: false, outstanding: 0, pending: VecDeque::new() }),
            completions: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
        });
        lock(&FABRIC.queue_pairs).insert((self.gid, qp_num), Arc::downgrade(&shared));
        let mut mine = lock(&self.queue_pairs);
        mine.retain(|w| w.strong_count() > 0);
        mine.push(Arc::downgrade(&shared));
        Ok(Box::new(SoftQp { shared }))
    }
}

struct SoftRegion {
    key: u32,
    addr: u64,
    len: usize,
}

impl MemoryRegion for SoftRegion {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for SoftRegion {
    fn drop(&mut self) {
        FABRIC.regions.write().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
    }
}

struct QpState {
    remote: Option<Endpoint>,
    failed: bool,
    /// Posted and not yet polled.
    outstanding: u32,
    /// Posted while the device was stalled.
    pending: VecDeque<WorkRequest>,
}

struct QpShared {
    device: u64,
    gid: [u8; 16],
    qp_num: u32,
    max_outstanding: u32,
    /// What the peer may do to this side's regions through this queue pair.
    remote: Access,
    stalled: Arc<AtomicBool>,
    state: Mutex<QpState>,
    completions: Mutex<VecDeque<Completion>>,
    ready: Condvar,
}

impl QpShared {
    fn complete(&self, completion: Completion) {
        lock(&self.completions).push_back(completion);
        self.ready.notify_all();
    }

    /// Whether this queue pair is connected to `(gid, qp_num)` and working.
    fn accepts_from(&self, gid: [u8; 16], qp_num: u32) -> bool {
        let state = lock(&self.state);
        !state.failed && state.remote.is_some_and(|r| r.gid == gid && r.qp_num == qp_num)
    }

    fn run_pending(&self) {
        loop {
            let request = {
                let mut state = lock(&self.state);
                if self.stalled.load(Ordering::SeqCst) {
                    return;
                }
                match state.pending.pop_front() {
                    Some(request) => request,
                    None => return,
                }
            };
            self.execute(&request);
        }
    }

    /// Runs one request and completes it.
    fn execute(&self, request: &WorkRequest) {
        let (remote, failed) = {
            let state = lock(&self.state);
            (state.remote, state.failed)
        };
        let status = match remote {
            _ if failed => WcStatus::Flushed,
            None => WcStatus::Flushed,
            Some(remote) => self.transfer(request, &remote),
        };
        if status != WcStatus::Success && status != WcStatus::Flushed {
            self.fail_state();
        }
        let bytes = if status == WcStatus::Success { request.len } else { 0 };
        self.complete(Completion { id: request.id, status, bytes });
    }

    fn transfer(&self, request: &WorkRequest, remote: &Endpoint) -> WcStatus {
        // Under the regions' read lock, which a destroyed queue pair waits for (see `SoftQp`'s
        // drop): once its destruction returns, no transfer through it touches memory.
        let regions = FABRIC.regions.read().unwrap_or_else(|p| p.into_inner());
        let peer = lock(&FABRIC.queue_pairs).get(&(remote.gid, remote.qp_num)).and_then(Weak::upgrade);
        let Some(peer) = peer.filter(|p| p.accepts_from(self.gid, self.qp_num)) else {
            return WcStatus::RetryExceeded;
        };
        let len = request.len as usize;
        let inside = |entry: &RegionEntry, addr: u64| {
            addr >= entry.addr && addr.saturating_add(len as u64) <= entry.addr + entry.len as u64
        };
        match regions.get(&request.lkey) {
            Some(local) if local.device == self.device && inside(local, request.local_addr) => {}
            _ => return WcStatus::LocalProtection,
        }
        let granted = |access: Access| match request.op {
            Op::Read => access.remote_read,
            Op::Write => access.remote_write,
        };
        if !granted(peer.remote) {
            return WcStatus::RemoteAccess;
        }
        match regions.get(&request.rkey) {
            Some(far) if far.device == peer.device && granted(far.access) && inside(far, request.remote_addr) => {}
            _ => return WcStatus::RemoteAccess,
        }
        let (from, to) = match request.op {
            Op::Read => (request.remote_addr, request.local_addr),
            Op::Write => (request.local_addr, request.remote_addr),
        };
        // SAFETY: both ranges lie inside regions registered now (checked above, under the read
        // lock that deregistration must wait for), whose owners promised the memory stays valid
        // while registered. The peer may write its memory concurrently, as with real RDMA: the
        // bytes are opaque here and the data plane verifies what it receives.
        unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) };
        WcStatus::Success
    }

    fn fail_state(&self) {
        let flushed: Vec<WorkRequest> = {
            let mut state = lock(&self.state);
            state.failed = true;
            state.pending.drain(..).collect()
        };
        for request in flushed {
            self.complete(Completion { id: request.id, status: WcStatus::Flushed, bytes: 0 });
        }
    }
}

struct SoftQp {
    shared: Arc<QpShared>,
}

impl QueuePair for SoftQp {
    fn endpoint(&self) -> Endpoint {
        Endpoint { gid: self.shared.gid, lid: 0, qp_num: self.shared.qp_num, psn: 0, mtu: 4096, rd_atomic: 16 }
    }

    fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        let mut state = lock(&self.shared.state);
        if state.remote.is_some() || state.failed {
            return Err(VerbsError::Call { call: "ibv_modify_qp", reason: "already connected".into() });
        }
        state.remote = Some(*remote);
        Ok(())
    }

    fn post(&self, request: &WorkRequest) -> Result<(), VerbsError> {
        {
            let mut state = lock(&self.shared.state);
            if state.remote.is_none() && !state.failed {
                return Err(VerbsError::NotConnected);
            }
            if state.outstanding >= self.shared.max_outstanding {
                return Err(VerbsError::QueueFull(state.outstanding));
            }
            state.outstanding += 1;
            if self.shared.stalled.load(Ordering::SeqCst) && !state.failed {
                state.pending.push_back(*request);
                return Ok(());
            }
        }
        self.shared.execute(request);
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, timeout: Duration) -> Result<(), VerbsError> {
        let mut completions = lock(&self.shared.completions);
        if completions.is_empty() {
            completions = self.shared.ready.wait_timeout(completions, timeout).unwrap_or_else(|p| p.into_inner()).0;
        }
        let drained = completions.len();
        out.extend(completions.drain(..));
        drop(completions);
        let mut state = lock(&self.shared.state);
        state.outstanding = state.outstanding.saturating_sub(drained as u32);
        Ok(())
    }

    fn fail(&self) {
        self.shared.fail_state();
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        self.shared.fail_state();
        lock(&FABRIC.queue_pairs).remove(&(self.shared.gid, self.shared.qp_num));
        // Waits out transfers through this queue pair that began before it failed.
        drop(FABRIC.regions.write().unwrap_or_else(|p| p.into_inner()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANY: Access = Access { remote_read: true, remote_write: true };

    fn pair(a: &SoftDevice, b: &SoftDevice) -> (Box<dyn QueuePair>, Box<dyn QueuePair>) {
        let (qa, qb) = (a.create_qp(4, ANY).unwrap(), b.create_qp(4, ANY).unwrap());
        qa.connect(&qb.endpoint()).unwrap();
        qb.connect(&qa.endpoint()).unwrap();
        (qa, qb)
    }

    fn one(qp: &dyn QueuePair) -> Completion {
        let mut out = Vec::new();
        qp.poll(&mut out, Duration::from_secs(1)).unwrap();
        assert_eq!(out.len(), 1, "{out:?}");
        out[0]
    }

    fn read(local: &dyn MemoryRegion, at: u64, remote: &dyn MemoryRegion, from: u64, len: u32) -> WorkRequest {
        WorkRequest {
            id: 7,
            op: Op::Read,
            local_addr: local.addr() + at,
            lkey: local.lkey(),
            len,
            remote_addr: remote.addr() + from,
            rkey: remote.rkey(),
        }
    }

    #[test]
    fn reads_and_writes_move_bytes_between_registered_regions() {
        let (client, target) = (SoftDevice::new("c"), SoftDevice::new("t"));
        let (qc, qt) = pair(&client, &target);
        let mut source: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let mut sink = vec![0u8; 8192];
        let far = unsafe { client.register(source.as_mut_ptr(), source.len(), Access::REMOTE_READ) }.unwrap();
        let near = unsafe { target.register(sink.as_mut_ptr(), sink.len(), Access::LOCAL) }.unwrap();
        qt.post(&read(&*near, 100, &*far, 1000, 4000)).unwrap();
        assert_eq!(one(&*qt), Completion { id: 7, status: WcStatus::Success, bytes: 4000 });
        assert_eq!(&sink[100..4100], &source[1000..5000]);

        // A WRITE needs remote-write access: the read-only region refuses it, and the queue pair
        // fails; its next request is flushed.
        let write = WorkRequest { op: Op::Write, ..read(&*near, 0, &*far, 0, 16) };
        qt.post(&write).unwrap();
        assert_eq!(one(&*qt).status, WcStatus::RemoteAccess);
        qt.post(&read(&*near, 0, &*far, 0, 16)).unwrap();
        assert_eq!(one(&*qt).status, WcStatus::Flushed);
        drop(qc);
    }

    #[test]
    fn bad_keys_and_ranges_fail_without_touching_memory() {
        let (client, target) = (SoftDevice::new("c"), SoftDevice::new("t"));
        let mut source = vec![1u8; 4096];
        let mut sink = vec![0u8; 4096];
        let far = unsafe { client.register(source.as_mut_ptr(), 4096, Access::REMOTE_READ) }.unwrap();
        let near = unsafe { target.register(sink.as_mut_ptr(), 4096, Access::LOCAL) }.unwrap();
        let cases = [
            (read(&*near, 0, &*far, 1, 4096), WcStatus::RemoteAccess),
            (read(&*near, 1, &*far, 0, 4096), WcStatus::LocalProtection),
            (WorkRequest { rkey: far.rkey() + 1000, ..read(&*near, 0, &*far, 0, 8) }, WcStatus::RemoteAccess),
            // The target's own key is no rkey of the client's device, and vice versa.
            (WorkRequest { rkey: near.rkey(), ..read(&*near, 0, &*far, 0, 8) }, WcStatus::RemoteAccess),
            (WorkRequest { lkey: far.lkey(), ..read(&*near, 0, &*far, 0, 8) }, WcStatus::LocalProtection),
        ];
        for (request, status) in cases {
            let (_qc, qt) = pair(&client, &target);
            qt.post(&request).unwrap();
            assert_eq!(one(&*qt).status, status, "{request:?}");
        }
        assert!(sink.iter().all(|&b| b == 0));

        // A deregistered region's key is refused.
        let (_qc, qt) = pair(&client, &target);
        let request = read(&*near, 0, &*far, 0, 8);
        drop(far);
        qt.post(&request).unwrap();
        assert_eq!(one(&*qt).status, WcStatus::RemoteAccess);
        assert_eq!(client.registered_regions(), 0);
    }

    #[test]
    fn a_vanished_peer_and_a_stalled_link_fail_requests_cleanly() {
        let (client, target) = (SoftDevice::new("c"), SoftDevice::new("t"));
        let mut source = vec![1u8; 4096];
        let mut sink = vec![0u8; 4096];
        let far = unsafe { client.register(source.as_mut_ptr(), 4096, Access::REMOTE_READ) }.unwrap();
        let near = unsafe { target.register(sink.as_mut_ptr(), 4096, Access::LOCAL) }.unwrap();
        let (qc, qt) = pair(&client, &target);
        drop(qc);
        qt.post(&read(&*near, 0, &*far, 0, 8)).unwrap();
        assert_eq!(one(&*qt).status, WcStatus::RetryExceeded);

        // Outstanding requests are bounded; a stalled request is flushed when its queue pair fails.
        let (_qc, qt) = pair(&client, &target);
        target.stall();
        for _ in 0..4 {
            qt.post(&read(&*near, 0, &*far, 0, 8)).unwrap();
        }
        assert_eq!(qt.post(&read(&*near, 0, &*far, 0, 8)), Err(VerbsError::QueueFull(4)));
        let mut out = Vec::new();
        qt.poll(&mut out, Duration::from_millis(10)).unwrap();
        assert!(out.is_empty());
        qt.fail();
        qt.poll(&mut out, Duration::from_secs(1)).unwrap();
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(|c| c.status == WcStatus::Flushed));
        target.resume();
        assert!(sink.iter().all(|&b| b == 0));

        let unconnected = target.create_qp(1, ANY).unwrap();
        assert_eq!(unconnected.post(&read(&*near, 0, &*far, 0, 8)), Err(VerbsError::NotConnected));

        // A peer whose queue pair grants no remote read refuses READs of its memory.
        let (qc, qt) = (client.create_qp(4, Access::LOCAL).unwrap(), target.create_qp(4, ANY).unwrap());
        qc.connect(&qt.endpoint()).unwrap();
        qt.connect(&qc.endpoint()).unwrap();
        qt.post(&read(&*near, 0, &*far, 0, 8)).unwrap();
        assert_eq!(one(&*qt).status, WcStatus::RemoteAccess);
    }
}
