//! The verbs seam: the few ibverbs operations the data plane uses, as traits.
//!
//! Everything above this file — registration bookkeeping, the work-request state machine,
//! completion handling, flow control, error paths — is written against [`Verbs`], [`MemoryRegion`]
//! and [`QueuePair`], so the same code runs over real hardware (`ibverbs.rs`, feature `rdma`) and
//! over the in-process software fabric (`soft.rs`) that tests use.
//!
//! Only what the data plane needs is here: reliable-connected queue pairs, one-sided RDMA READ and
//! WRITE, memory regions with local and remote keys, and a completion queue per queue pair. The
//! two-sided messages (requests, responses, connection setup) travel on the TCP data-plane
//! connection the queue pair belongs to, as 3FS does.

use std::time::Duration;

use thiserror::Error;

/// What a peer needs to connect a queue pair to ours; exchanged over the TCP data-plane
/// connection (OP_CONNECT).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// The port's GID (RoCE, or InfiniBand with a GRH).
    pub gid: [u8; 16],
    /// The port's LID (InfiniBand without a GRH; 0 on RoCE).
    pub lid: u16,
    pub qp_num: u32,
    /// First packet sequence number.
    pub psn: u32,
    /// Path MTU in bytes (256..=4096).
    pub mtu: u32,
    /// RDMA READs this side can have outstanding (as initiator and as responder): both sides use
    /// the smaller of the two, or the queue pair fails on the first READ past the peer's limit.
    pub rd_atomic: u8,
}

/// Remote access a memory region grants (local read and write are always granted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Access {
    pub remote_read: bool,
    pub remote_write: bool,
}

impl Access {
    pub const LOCAL: Access = Access { remote_read: false, remote_write: false };
    pub const REMOTE_READ: Access = Access { remote_read: true, remote_write: false };
    pub const REMOTE_WRITE: Access = Access { remote_read: false, remote_write: true };
}

/// A one-sided operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Remote memory into local memory.
    Read,
    /// Local memory into remote memory.
    Write,
}

/// One RDMA READ or WRITE between a local registered range and a remote one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned in the completion.
    pub id: u64,
    pub op: Op,
    pub local_addr: u64,
    pub lkey: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// A work completion's status (the subset of `ibv_wc_status` the data plane tells apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    /// The local range is outside the region its lkey names, or the lkey is unknown.
    LocalProtection,
    /// The remote range is outside the region its rkey names, the rkey is unknown, or the region
    /// does not grant the access.
    RemoteAccess,
    /// No answer from the peer: it is gone (its queue pair was destroyed, its host died).
    RetryExceeded,
    /// The queue pair entered the error state before this request ran.
    Flushed,
    /// Any other `ibv_wc_status` value.
    Other(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub id: u64,
    pub status: WcStatus,
    /// Bytes transferred (meaningful on success).
    pub bytes: u32,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum VerbsError {
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    #[error("{call} failed: {reason}")]
    Call { call: &'static str, reason: String },
    #[error("the send queue is full ({0} work requests outstanding)")]
    QueueFull(u32),
    #[error("the queue pair is not connected")]
    NotConnected,
    #[error("a region of {0} bytes cannot be registered")]
    BadRegion(usize),
}

impl VerbsError {
    /// An error of a failed libibverbs call, with its errno.
    pub fn call(call: &'static str, errno: i32) -> VerbsError {
        VerbsError::Call { call, reason: std::io::Error::from_raw_os_error(errno).to_string() }
    }
}

/// An opened RDMA device port with its protection domain.
pub trait Verbs: Send + Sync + 'static {
    /// The device's name (`mlx5_0`, `soft0`).
    fn name(&self) -> String;
    /// The port's address (what a queue pair's [`Endpoint`] carries too).
    fn gid(&self) -> [u8; 16];
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// The memory must stay allocated (and, for real devices, mapped at the same address) until
    /// the returned region is dropped: a device may read or write it until then.
    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<Box<dyn MemoryRegion>, VerbsError>;
    /// A reliable-connected queue pair with its own completion queue; at most `max_outstanding`
    /// work requests may be posted and not yet polled. The peer may READ or WRITE this side's
    /// regions only as `remote` allows (and as each region grants).
    fn create_qp(&self, max_outstanding: u32, remote: Access) -> Result<Box<dyn QueuePair>, VerbsError>;
}

/// A registered memory region; deregistered when dropped (after which its keys are refused).
pub trait MemoryRegion: Send + Sync {
    fn addr(&self) -> u64;
    fn len(&self) -> usize;
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether `[addr, addr + len)` lies inside this region.
    fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr() && addr.saturating_add(len as u64) <= self.addr() + self.len() as u64
    }
}

/// A reliable-connected queue pair and its completion queue.
pub trait QueuePair: Send + Sync {
    fn endpoint(&self) -> Endpoint;
    /// Connects to the peer's queue pair (INIT → RTR → RTS); work requests may be posted after.
    fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError>;
    /// Posts one work request. Its addresses are checked against registered regions by the
    /// device (a bad one completes with an error status), so this is safe to call.
    fn post(&self, request: &WorkRequest) -> Result<(), VerbsError>;
    /// Appends completions to `out`, waiting at most `timeout` for the first.
    fn poll(&self, out: &mut Vec<Completion>, timeout: Duration) -> Result<(), VerbsError>;
    /// Moves the queue pair to the error state: work requests not yet done complete as
    /// [`WcStatus::Flushed`], and the peer's further requests to it fail.
    fn fail(&self);
}
