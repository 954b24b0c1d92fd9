//! Slots of a memory region shared with a target (a sealed memfd, an RDMA-registered buffer),
//! lent to one request at a time.
//!
//! A slot is reused only after the target answered the request that used it. A request abandoned
//! before its answer (a timeout, a cancelled save) may still have its slot read or written by the
//! target, so its connection is closed instead (requests waiting for a slot of it fail and retry
//! on a fresh connection), and the region is dropped with the connection.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use starckpt_proto::data::{self, ErrorCode};
use starckpt_proto::frame::Opcode;
use tokio::sync::Semaphore;

use starckpt_proto::ChunkHash;

use super::{
    Connection, Fetched, FrameTransport, Place, TcpConfig, TransportError, checked, get_header, get_landing,
    get_payload, land_slot, once_more,
};
use crate::sync::LockExt;

pub(crate) struct SlotPool {
    slot_bytes: usize,
    free: Mutex<Vec<u32>>,
    available: Semaphore,
}

impl SlotPool {
    pub(crate) fn new(slots: u32, slot_bytes: usize) -> SlotPool {
        SlotPool { slot_bytes, free: Mutex::new((0..slots).rev().collect()), available: Semaphore::new(slots as usize) }
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Returns a slot no peer can touch any more.
    pub(crate) fn release(&self, index: u32) {
        self.free.lock_unpoisoned().push(index);
        self.available.add_permits(1);
    }
}

/// A connection and the region whose slots it lends. Fields drop in order: the connection
/// first, the region last.
pub(crate) struct Slotted<R> {
    pub(crate) frames: Connection,
    pub(crate) slots: SlotPool,
    pub(crate) region: R,
}

impl<R: Send + Sync + 'static> SlotHost for Slotted<R> {
    fn slot_pool(&self) -> &SlotPool {
        &self.slots
    }

    fn frames(&self) -> &Connection {
        &self.frames
    }
}

/// A connection that lends slots of its region.
pub(crate) trait SlotHost: Send + Sync + 'static {
    fn slot_pool(&self) -> &SlotPool;
    /// The connection that closes when a slot is abandoned.
    fn frames(&self) -> &Connection;
    /// A request abandoned slot `index` while the target may still use it. By default the slot is
    /// never reused: the connection goes, and requests waiting for one of its slots fail (and
    /// retry on a fresh connection) instead of waiting for a permit that will not come back.
    fn abandon(&self, index: u32) {
        let _ = index;
        self.slot_pool().available.close();
        self.frames().close("a request was abandoned while the target may still use its slot");
    }
}

/// A slot in use; returned to its connection only once the target answered (module docs).
pub(crate) struct Slot<H: SlotHost> {
    host: Arc<H>,
    index: u32,
    answered: bool,
}

impl<H: SlotHost> Slot<H> {
    /// Waits for a free slot of `host`.
    pub(crate) async fn lend(host: &Arc<H>) -> Result<Slot<H>, TransportError> {
        let pool = host.slot_pool();
        let permit = pool
            .available
            .acquire()
            .await
            .map_err(|_| TransportError::Connection("the connection holding the slots closed".into()))?;
        permit.forget();
        let index = pool.free.lock_unpoisoned().pop();
        let index = index.ok_or_else(|| TransportError::Protocol("no free slot behind a permit".into()))?;
        Ok(Slot { host: Arc::clone(host), index, answered: false })
    }

    /// The slot's byte offset in the region.
    pub(crate) fn offset(&self) -> usize {
        self.index as usize * self.host.slot_pool().slot_bytes
    }

    /// The 1-based number frames carry.
    pub(crate) fn number(&self) -> u32 {
        self.index + 1
    }

    /// Records how the request that used the slot ended: the target is done with the slot once it
    /// answered (even with an error), not when the request timed out or lost its connection.
    pub(crate) fn settle<T>(&mut self, result: &Result<T, TransportError>) {
        self.answered = !matches!(result, Err(TransportError::Timeout(_) | TransportError::Connection(_)));
    }
}

impl<H: SlotHost> Drop for Slot<H> {
    fn drop(&mut self) {
        if self.answered {
            self.host.slot_pool().release(self.index);
        } else {
            self.host.abandon(self.index);
        }
    }
}

/// A transport over one connection with a shared region (shared memory, RDMA): dialled on first
/// use, dialled again once it died.
#[async_trait]
pub(crate) trait Dialled: FrameTransport + Send + Sync {
    type Conn: SlotHost;
    fn current(&self) -> &tokio::sync::Mutex<Option<Arc<Self::Conn>>>;
    fn timeouts(&self) -> &TcpConfig;
    /// What is being set up, for errors ("shared-memory attach").
    fn setup(&self) -> &'static str;
    /// Opens a fresh connection with its region.
    async fn open(&self) -> Result<Self::Conn, TransportError>;
    /// Where a GET asks the target to put its bytes: `slot` of `connection`'s region.
    fn slot_place(&self, connection: &Self::Conn, slot: &Slot<Self::Conn>) -> Place;
    /// Bytes the target says it put into the slot (0: they came in the frame).
    fn slot_length(response: &data::Response) -> u64;
    /// Copies `dest.len()` bytes at `offset` of the region out into `dest`, hashing them as it
    /// goes (`crate::buf::fill_hashed`); returns the hash of `dest` as copied.
    fn copy_out(connection: &Self::Conn, offset: usize, dest: &mut [u8]) -> Result<ChunkHash, TransportError>;
    /// Copies `len` bytes at `offset` of the region into fresh bytes (not zeroed first).
    fn copy_fresh(connection: &Self::Conn, offset: usize, len: usize) -> Result<Bytes, TransportError>;

    /// One GET whose bytes the target puts into a slot; they land in `dest` or in a fresh
    /// payload ([`super::land_slot`]).
    async fn get_once(
        &self,
        hash: ChunkHash,
        offset: u64,
        length: u64,
        dest: Option<&mut [u8]>,
    ) -> Result<Fetched, TransportError> {
        let connection = self.connection().await?;
        let dest = match dest {
            // Bigger than a slot: in the frame, read from the stream straight into place (asking
            // for a slot would have the target fill it, find the chunk larger, and read it again).
            Some(dest) if dest.len() > connection.slot_pool().slot_bytes() && offset == 0 && length == 0 => {
                let header = get_header(self, hash, 0, 0, Place::Inline).await;
                let timeout = self.timeouts().deadline.for_bytes(dest.len() as u64);
                return get_landing(connection.frames(), header, dest, timeout).await;
            }
            dest => dest,
        };
        let mut slot = Slot::lend(&connection).await?;
        let header = get_header(self, hash, offset, length, self.slot_place(&connection, &slot)).await;
        let result = self.call_on(&connection, Opcode::Get, header, None).await;
        slot.settle(&result);
        let (response, inline) = result?;
        let len = Self::slot_length(&response);
        if len == 0 {
            // Too big for a slot (or empty): it came in the frame.
            return get_payload(&response, inline).map(Fetched::Payload);
        }
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > connection.slot_pool().slot_bytes() || !inline.is_empty() {
            return Err(TransportError::Protocol(format!("GET answered {len} bytes in a slot")));
        }
        let offset = slot.offset();
        land_slot(
            &response,
            len,
            dest,
            |dest| Self::copy_out(&connection, offset, dest),
            || Self::copy_fresh(&connection, offset, len),
        )
    }

    /// [`Dialled::get_once`], once more on a fresh connection if its connection broke.
    async fn get_slot(
        &self,
        hash: ChunkHash,
        offset: u64,
        length: u64,
        mut dest: Option<&mut [u8]>,
    ) -> Result<Fetched, TransportError> {
        match self.get_once(hash, offset, length, dest.as_deref_mut()).await {
            Err(TransportError::Connection(_)) => self.get_once(hash, offset, length, dest).await,
            other => other,
        }
    }

    /// The live connection, dialled if there is none.
    async fn connection(&self) -> Result<Arc<Self::Conn>, TransportError> {
        let mut current = self.current().lock().await;
        if let Some(connection) = current.as_ref().filter(|c| c.frames().is_alive()) {
            return Ok(Arc::clone(connection));
        }
        let deadline = self.timeouts().connect_timeout + self.timeouts().deadline.allowance;
        let opened = tokio::time::timeout(deadline, self.open())
            .await
            .map_err(|_| TransportError::Connect(format!("{} timed out after {deadline:?}", self.setup())))??;
        let connection = Arc::new(opened);
        *current = Some(Arc::clone(&connection));
        Ok(connection)
    }

    /// One request on `connection`, its response checked. A transfer the target reports failed
    /// (its RDMA queue pair is in error) closes the connection and counts as a connection error.
    async fn call_on(
        &self,
        connection: &Self::Conn,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError> {
        let frames = connection.frames();
        let timeout = self.timeouts().deadline.for_bytes(super::request_bytes(opcode, payload.as_ref()));
        let (response, payload) = frames.call(opcode, header, payload, timeout).await?;
        match checked(response, payload) {
            Err(TransportError::Remote { code: ErrorCode::TransferFailed, message }) => {
                frames.close(&message);
                Err(TransportError::Connection(format!("transfer failed: {message}")))
            }
            other => other,
        }
    }

    /// A frame with no payload outside it, retried once on a fresh connection.
    async fn call_frame(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError> {
        once_more(|| async {
            let connection = self.connection().await?;
            self.call_on(&connection, opcode, header.clone(), payload.clone()).await
        })
        .await
    }
}
