//! [`Verbs`] over libibverbs (rdma-sys): the thin FFI layer, feature `rdma`.
//!
//! Only resource lifetimes, the RC queue-pair state transitions and the translation of work
//! requests and completions live here; every decision is made above, in code the software fabric
//! tests. Not exercised on hardware in this project's CI (no RDMA devices there): see
//! `docs/rdma.md` for how to run the suite on a machine that has one.

use std::ffi::CStr;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::*;

use crate::DeviceSettings;
use crate::verbs::{
    Access, Completion, Endpoint, MemoryRegion, Op, QueuePair, Verbs, VerbsError, WcStatus, WorkRequest,
};

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// An opened device, its protection domain and the port in use.
struct Context {
    context: NonNull<ibv_context>,
    pd: NonNull<ibv_pd>,
}

// SAFETY: libibverbs objects may be used from any thread (the library locks internally).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: created by ibv_alloc_pd / ibv_open_device, destroyed once, after every region and
        // queue pair (they hold an Arc of this context).
        unsafe {
            ibv_dealloc_pd(self.pd.as_ptr());
            ibv_close_device(self.context.as_ptr());
        }
    }
}

/// An ibverbs device port.
pub struct IbDevice {
    name: String,
    context: Arc<Context>,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    mtu: ibv_mtu::Type,
    /// Outstanding RDMA READs per queue pair, both directions (the device's limits, at most 16).
    max_rd_atomic: u8,
}

/// `IBV_LINK_LAYER_ETHERNET` (a C define bindgen does not carry): RoCE, addressed by GID.
const LINK_LAYER_ETHERNET: u8 = 2;

/// Opens the device named in `settings` (or the first one) and queries its port.
pub fn open(settings: &DeviceSettings) -> Result<Arc<dyn Verbs>, VerbsError> {
    let mut count = 0;
    // SAFETY: plain libibverbs calls; the list is freed below and the context outlives it.
    unsafe {
        let list = ibv_get_device_list(&mut count);
        if list.is_null() {
            let errno = errno();
            return Err(VerbsError::NoDevice(format!(
                "ibv_get_device_list: {}",
                std::io::Error::from_raw_os_error(errno)
            )));
        }
        let devices = std::slice::from_raw_parts(list, usize::try_from(count).unwrap_or(0));
        let mut names = Vec::new();
        let mut chosen = None;
        for &device in devices {
            let name = CStr::from_ptr(ibv_get_device_name(device)).to_string_lossy().into_owned();
            if chosen.is_none() && settings.device.as_deref().is_none_or(|wanted| wanted == name) {
                chosen = Some((device, name.clone()));
            }
            names.push(name);
        }
        let opened = chosen.map(|(device, name)| (ibv_open_device(device), name));
        ibv_free_device_list(list);
        let Some((context, name)) = opened else {
            let wanted = settings.device.as_deref().unwrap_or("any");
            return Err(VerbsError::NoDevice(format!("{wanted} not among {names:?}")));
        };
        let context = NonNull::new(context).ok_or_else(|| VerbsError::call("ibv_open_device", errno()))?;
        let pd = match NonNull::new(ibv_alloc_pd(context.as_ptr())) {
            Some(pd) => pd,
            None => {
                let error = VerbsError::call("ibv_alloc_pd", errno());
                ibv_close_device(context.as_ptr());
                return Err(error);
            }
        };
        let context = Arc::new(Context { context, pd });
        let mut port: ibv_port_attr = std::mem::zeroed();
        let rc = ___ibv_query_port(context.context.as_ptr(), settings.port, &mut port);
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_port", rc));
        }
        if port.state != ibv_port_state::IBV_PORT_ACTIVE && port.state != ibv_port_state::IBV_PORT_ACTIVE_DEFER {
            return Err(VerbsError::NoDevice(format!("{name} port {} is not active", settings.port)));
        }
        let mut gid: ibv_gid = std::mem::zeroed();
        if ibv_query_gid(context.context.as_ptr(), settings.port, i32::from(settings.gid_index), &mut gid) != 0 {
            return Err(VerbsError::call("ibv_query_gid", errno()));
        }
        if port.link_layer == LINK_LAYER_ETHERNET && gid.raw == [0; 16] {
            let index = settings.gid_index;
            return Err(VerbsError::NoDevice(format!("{name} GID index {index} has no address (see show_gids)")));
        }
        let mut device: ibv_device_attr = std::mem::zeroed();
        let rc = ibv_query_device(context.context.as_ptr(), &mut device);
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_device", rc));
        }
        let max_rd_atomic = device.max_qp_rd_atom.min(device.max_qp_init_rd_atom).clamp(1, 16) as u8;
        let mtu = settings.mtu.map_or(port.active_mtu, mtu_enum).min(port.active_mtu);
        Ok(Arc::new(IbDevice {
            name,
            context,
            port: settings.port,
            gid_index: settings.gid_index,
            gid: gid.raw,
            lid: port.lid,
            mtu,
            max_rd_atomic,
        }))
    }
}

fn mtu_enum(bytes: u32) -> ibv_mtu::Type {
    match bytes {
        0..=256 => ibv_mtu::IBV_MTU_256,
        257..=512 => ibv_mtu::IBV_MTU_512,
        513..=1024 => ibv_mtu::IBV_MTU_1024,
        1025..=2048 => ibv_mtu::IBV_MTU_2048,
        _ => ibv_mtu::IBV_MTU_4096,
    }
}

fn mtu_bytes(mtu: ibv_mtu::Type) -> u32 {
    128 << mtu.clamp(1, 5)
}

/// Verbs access flags: local write where the device writes the memory (a local READ target, or
/// remote write, which requires it), not for memory only read remotely (which may be read-only).
fn access_flags(access: Access) -> u32 {
    let mut flags = 0;
    if access.remote_write || !access.remote_read {
        flags |= ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if access.remote_read {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    if access.remote_write {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    }
    flags
}

impl Verbs for IbDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn gid(&self) -> [u8; 16] {
        self.gid
    }

    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<Box<dyn MemoryRegion>, VerbsError> {
        if len == 0 || addr.is_null() {
            return Err(VerbsError::BadRegion(len));
        }
        let flags = access_flags(access) as i32;
        // SAFETY: the caller keeps the memory valid until the region is dropped.
        let mr = unsafe { ibv_reg_mr(self.context.pd.as_ptr(), addr.cast(), len, flags) };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::call("ibv_reg_mr", errno()))?;
        Ok(Box::new(IbRegion { mr, _context: Arc::clone(&self.context) }))
    }

    fn create_qp(&self, max_outstanding: u32, remote: Access) -> Result<Box<dyn QueuePair>, VerbsError> {
        let depth = max_outstanding.max(1);
        // SAFETY: plain libibverbs calls on live objects; partial results are destroyed on error.
        unsafe {
            let ctx = self.context.context.as_ptr();
            let channel = NonNull::new(ibv_create_comp_channel(ctx))
                .ok_or_else(|| VerbsError::call("ibv_create_comp_channel", errno()))?;
            let cq = ibv_create_cq(ctx, depth as i32, ptr::null_mut(), channel.as_ptr(), 0);
            let Some(cq) = NonNull::new(cq) else {
                let error = VerbsError::call("ibv_create_cq", errno());
                ibv_destroy_comp_channel(channel.as_ptr());
                return Err(error);
            };
            let rc = ibv_req_notify_cq(cq.as_ptr(), 0);
            if rc != 0 {
                ibv_destroy_cq(cq.as_ptr());
                ibv_destroy_comp_channel(channel.as_ptr());
                return Err(VerbsError::call("ibv_req_notify_cq", rc));
            }
            let mut init: ibv_qp_init_attr = std::mem::zeroed();
            init.send_cq = cq.as_ptr();
            init.recv_cq = cq.as_ptr();
            init.cap =
                ibv_qp_cap { max_send_wr: depth, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
            init.qp_type = ibv_qp_type::IBV_QPT_RC;
            init.sq_sig_all = 1;
            let qp = ibv_create_qp(self.context.pd.as_ptr(), &mut init);
            let Some(qp) = NonNull::new(qp) else {
                let error = VerbsError::call("ibv_create_qp", errno());
                ibv_destroy_cq(cq.as_ptr());
                ibv_destroy_comp_channel(channel.as_ptr());
                return Err(error);
            };
            let qp = IbQp {
                qp,
                cq,
                channel,
                device: self.endpoint_template(),
                psn: random_psn(),
                port: self.port,
                gid_index: self.gid_index,
                mtu: self.mtu,
                max_rd_atomic: self.max_rd_atomic,
                _context: Arc::clone(&self.context),
            };
            qp.to_init(remote)?;
            Ok(Box::new(qp))
        }
    }
}

impl IbDevice {
    fn endpoint_template(&self) -> Endpoint {
        Endpoint {
            gid: self.gid,
            lid: self.lid,
            qp_num: 0,
            psn: 0,
            mtu: mtu_bytes(self.mtu),
            rd_atomic: self.max_rd_atomic,
        }
    }
}

struct IbRegion {
    mr: NonNull<ibv_mr>,
    _context: Arc<Context>,
}

// SAFETY: see Context.
unsafe impl Send for IbRegion {}
unsafe impl Sync for IbRegion {}

impl MemoryRegion for IbRegion {
    fn addr(&self) -> u64 {
        // SAFETY: the region is live until drop.
        unsafe { (*self.mr.as_ptr()).addr as u64 }
    }
    fn len(&self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).length }
    }
    fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Drop for IbRegion {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr, deregistered once.
        unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

struct IbQp {
    qp: NonNull<ibv_qp>,
    cq: NonNull<ibv_cq>,
    /// Wakes the completion thread (no busy polling).
    channel: NonNull<ibv_comp_channel>,
    device: Endpoint,
    psn: u32,
    port: u8,
    gid_index: u8,
    mtu: ibv_mtu::Type,
    max_rd_atomic: u8,
    _context: Arc<Context>,
}

/// A random 24-bit first packet sequence number (a reused QP number never matches stale packets).
fn random_psn() -> u32 {
    let mut bytes = [0u8; 4];
    // SAFETY: writes at most 4 bytes into `bytes`.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    let entropy = if got == 4 {
        u32::from_le_bytes(bytes)
    } else {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.subsec_nanos())
    };
    entropy & 0xff_ffff
}

// SAFETY: see Context; posting and polling are thread-safe in libibverbs.
unsafe impl Send for IbQp {}
unsafe impl Sync for IbQp {}

impl IbQp {
    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, call: &'static str) -> Result<(), VerbsError> {
        // SAFETY: a live queue pair and a fully initialised attribute struct.
        let rc = unsafe { ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32) };
        if rc != 0 { Err(VerbsError::call(call, rc)) } else { Ok(()) }
    }

    /// RESET → INIT, granting the peer `remote` access to memory of this side.
    fn to_init(&self, remote: Access) -> Result<(), VerbsError> {
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.port_num = self.port;
        attr.pkey_index = 0;
        let mut flags = 0;
        if remote.remote_read {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        if remote.remote_write {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        attr.qp_access_flags = flags;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut attr, mask, "ibv_modify_qp(INIT)")
    }
}

impl IbQp {
    /// Appends every completion ready now; returns how many.
    fn drain(&self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        // SAFETY: zeroed ibv_wc entries are plain data the provider overwrites.
        let mut entries: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        let mut total = 0;
        loop {
            // SAFETY: a live completion queue and room for 16 entries.
            let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), entries.len() as i32, entries.as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::Call { call: "ibv_poll_cq", reason: format!("returned {n}") });
            }
            for wc in &entries[..n as usize] {
                let status = match wc.status {
                    ibv_wc_status::IBV_WC_SUCCESS => WcStatus::Success,
                    ibv_wc_status::IBV_WC_LOC_PROT_ERR | ibv_wc_status::IBV_WC_LOC_LEN_ERR => WcStatus::LocalProtection,
                    ibv_wc_status::IBV_WC_REM_ACCESS_ERR | ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => {
                        WcStatus::RemoteAccess
                    }
                    ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => {
                        WcStatus::RetryExceeded
                    }
                    ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
                    other => WcStatus::Other(other),
                };
                out.push(Completion { id: wc.wr_id, status, bytes: wc.byte_len });
            }
            total += n as usize;
            if (n as usize) < entries.len() {
                return Ok(total);
            }
        }
    }
}

impl QueuePair for IbQp {
    fn endpoint(&self) -> Endpoint {
        // SAFETY: a live queue pair.
        let qp_num = unsafe { (*self.qp.as_ptr()).qp_num };
        Endpoint { qp_num, psn: self.psn, ..self.device }
    }

    fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = self.mtu.min(mtu_enum(remote.mtu));
        attr.dest_qp_num = remote.qp_num;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = self.max_rd_atomic.min(remote.rd_atomic.max(1));
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = self.port;
        if remote.gid != [0; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = self.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTR)")?;

        // SAFETY: as above.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = self.psn;
        attr.timeout = 14; // 4.096 µs × 2^14 ≈ 67 ms per retry
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.max_rd_atomic = self.max_rd_atomic.min(remote.rd_atomic.max(1));
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTS)")
    }

    fn post(&self, request: &WorkRequest) -> Result<(), VerbsError> {
        let mut sge = ibv_sge { addr: request.local_addr, length: request.len, lkey: request.lkey };
        // SAFETY: zeroed is a valid ibv_send_wr; the fields set below are the ones an RDMA READ or
        // WRITE reads. The sge lives across the call (the provider copies it into the queue).
        unsafe {
            let mut wr: ibv_send_wr = std::mem::zeroed();
            wr.wr_id = request.id;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = match request.op {
                Op::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
                Op::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            };
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.wr.rdma.remote_addr = request.remote_addr;
            wr.wr.rdma.rkey = request.rkey;
            let mut bad = ptr::null_mut();
            match ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) {
                0 => Ok(()),
                libc::ENOMEM => Err(VerbsError::QueueFull(0)),
                rc => Err(VerbsError::call("ibv_post_send", rc)),
            }
        }
    }

    fn poll(&self, out: &mut Vec<Completion>, timeout: Duration) -> Result<(), VerbsError> {
        if self.drain(out)? > 0 {
            return Ok(());
        }
        // Sleep on the completion channel until the armed queue fires, or the timeout.
        // SAFETY: the channel's fd is open while the queue pair lives.
        let fd = unsafe { (*self.channel.as_ptr()).fd };
        let mut pollfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pollfd, 1, millis) };
        if ready < 0 {
            let errno = errno();
            return if errno == libc::EINTR { Ok(()) } else { Err(VerbsError::call("poll", errno)) };
        }
        if ready > 0 && pollfd.revents & libc::POLLIN == 0 {
            // POLLERR/POLLHUP: the device is gone; reading an event would block forever.
            return Err(VerbsError::Call {
                call: "poll",
                reason: format!("completion channel revents {:#x}", pollfd.revents),
            });
        }
        if ready > 0 {
            let (mut cq, mut context) = (ptr::null_mut(), ptr::null_mut());
            // SAFETY: the channel is readable, so this does not block; the event is acked once and
            // the queue re-armed before draining (a completion in between is found by the drain).
            unsafe {
                if ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut context) != 0 {
                    return Err(VerbsError::call("ibv_get_cq_event", errno()));
                }
                ibv_ack_cq_events(cq, 1);
                let rc = ibv_req_notify_cq(self.cq.as_ptr(), 0);
                if rc != 0 {
                    return Err(VerbsError::call("ibv_req_notify_cq", rc));
                }
            }
        }
        self.drain(out).map(|_| ())
    }

    fn fail(&self) {
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        let _ = self.modify(&mut attr, ibv_qp_attr_mask::IBV_QP_STATE, "ibv_modify_qp(ERR)");
    }
}

impl Drop for IbQp {
    fn drop(&mut self) {
        // SAFETY: created in create_qp, destroyed once, queue pair before its completion queue.
        unsafe {
            ibv_destroy_qp(self.qp.as_ptr());
            ibv_destroy_cq(self.cq.as_ptr());
            ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}
