//! RDMA for the starckpt data plane (the 3FS model): a client registers its memory once; a PUT
//! names (address, rkey, length) and the target RDMA-READs the payload into its own registered,
//! aligned buffer, which it then writes to the device with O_DIRECT; a GET makes the target
//! RDMA-WRITE the chunk into a registered buffer of the client. Requests, responses and the
//! queue-pair setup travel on the TCP data-plane connection the queue pair belongs to.
//!
//! - [`verbs`]: the seam: [`Verbs`], [`MemoryRegion`], [`QueuePair`].
//! - [`soft`]: an in-process software fabric with verbs semantics (tests, machines without RDMA).
//! - `ibverbs` (feature `rdma`): the thin libibverbs layer (rdma-sys).
//! - [`QpDriver`]: bounded outstanding work requests, completions on a dedicated thread, timeouts.
//! - [`MemoryMap`]: registration bookkeeping: memory that lives as long as the map (a buffer
//!   pool's buffers) is registered once; any other memory for one request.

mod driver;
#[cfg(feature = "rdma")]
pub mod ibverbs;
pub mod soft;
pub mod verbs;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use driver::{QpDriver, RdmaError};
pub use verbs::{Access, Completion, Endpoint, MemoryRegion, Op, QueuePair, Verbs, VerbsError, WcStatus, WorkRequest};

/// Which device and port to use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSettings {
    /// The device's name (`mlx5_0`); None: the first one found.
    pub device: Option<String>,
    /// The port (1-based). Default 1.
    pub port: u8,
    /// The GID table index (RoCE v2 is often 1 or 3; see `show_gids`). Default 0.
    pub gid_index: u8,
    /// Largest path MTU to use, in bytes; None: the port's active MTU.
    pub mtu: Option<u32>,
}

impl Default for DeviceSettings {
    fn default() -> Self {
        DeviceSettings { device: None, port: 1, gid_index: 0, mtu: None }
    }
}

/// Whether `bytes` is a path MTU verbs know (256, 512, 1024, 2048 or 4096).
pub fn valid_mtu(bytes: u32) -> bool {
    (256..=4096).contains(&bytes) && bytes.is_power_of_two()
}

impl DeviceSettings {
    /// Settings from `STARCKPT_RDMA_DEVICE`, `STARCKPT_RDMA_PORT`, `STARCKPT_RDMA_GID_INDEX` and
    /// `STARCKPT_RDMA_MTU` (each optional; the defaults otherwise); a malformed value is an error.
    pub fn from_env() -> Result<DeviceSettings, String> {
        DeviceSettings::from_lookup(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<DeviceSettings, String> {
        fn parse<T: std::str::FromStr>(name: &str, value: Option<String>) -> Result<Option<T>, String> {
            value.map(|v| v.parse().map_err(|_| format!("{name}={v:?} is not a valid number"))).transpose()
        }
        let defaults = DeviceSettings::default();
        let port: u8 = parse("STARCKPT_RDMA_PORT", var("STARCKPT_RDMA_PORT"))?.unwrap_or(defaults.port);
        if port == 0 {
            return Err("STARCKPT_RDMA_PORT=0: ports are numbered from 1".into());
        }
        let mtu: Option<u32> = parse("STARCKPT_RDMA_MTU", var("STARCKPT_RDMA_MTU"))?;
        if let Some(mtu) = mtu
            && !valid_mtu(mtu)
        {
            return Err(format!("STARCKPT_RDMA_MTU={mtu}: one of 256, 512, 1024, 2048, 4096"));
        }
        Ok(DeviceSettings {
            device: var("STARCKPT_RDMA_DEVICE"),
            port,
            gid_index: parse("STARCKPT_RDMA_GID_INDEX", var("STARCKPT_RDMA_GID_INDEX"))?.unwrap_or(defaults.gid_index),
            mtu,
        })
    }
}

/// Opens an RDMA device, or says why there is none (no hardware, or a build without the `rdma`
/// feature). Callers fall back to TCP on an error.
pub fn open(settings: &DeviceSettings) -> Result<Arc<dyn Verbs>, VerbsError> {
    #[cfg(feature = "rdma")]
    {
        ibverbs::open(settings)
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = settings;
        Err(VerbsError::NoDevice("this build has no RDMA support (cargo feature `rdma`)".into()))
    }
}

/// A region a request may use: cached (memory that lives as long as its [`MemoryMap`]) or
/// registered for this request alone (deregistered on drop).
pub enum Registered {
    Cached(Arc<dyn MemoryRegion>),
    Once(Box<dyn MemoryRegion>),
}

impl Registered {
    pub fn region(&self) -> &dyn MemoryRegion {
        match self {
            Registered::Cached(region) => &**region,
            Registered::Once(region) => &**region,
        }
    }
}

/// Finds the long-lived buffer (base address, length) that contains an address, if any.
pub type StableMemory = Box<dyn Fn(*const u8) -> Option<(usize, usize)> + Send + Sync>;

/// Registration bookkeeping for one device and one kind of access.
///
/// Buffers that `stable` recognises (a pool's buffers, which live until the pool does; the
/// closure owns a handle of the pool) are registered once and cached by base address; other
/// memory is registered per request. Cached regions are dropped before `stable`, so before the
/// pool's memory.
pub struct MemoryMap {
    verbs: Arc<dyn Verbs>,
    access: Access,
    cache: Mutex<HashMap<usize, Arc<dyn MemoryRegion>>>,
    stable: StableMemory,
}

impl MemoryMap {
    pub fn new(verbs: Arc<dyn Verbs>, access: Access, stable: StableMemory) -> MemoryMap {
        MemoryMap { verbs, access, cache: Mutex::new(HashMap::new()), stable }
    }

    pub fn verbs(&self) -> &Arc<dyn Verbs> {
        &self.verbs
    }

    /// A region covering `len` bytes at `ptr`.
    ///
    /// # Safety
    /// Unless `ptr` lies in stable memory, the memory must stay valid while the returned
    /// [`Registered`] lives.
    pub unsafe fn register(&self, ptr: *const u8, len: usize) -> Result<Registered, VerbsError> {
        if let Some((base, base_len)) = (self.stable)(ptr).filter(|&(base, base_len)| {
            let at = ptr as usize;
            at >= base && at + len <= base + base_len
        }) {
            if let Some(region) = self.cache.lock().unwrap_or_else(|p| p.into_inner()).get(&base) {
                return Ok(Registered::Cached(Arc::clone(region)));
            }
            // Registered outside the lock (pinning megabytes takes a while on hardware); a racing
            // registration of the same buffer loses and is dropped.
            // SAFETY: stable memory outlives this map and so the cached region.
            let region: Arc<dyn MemoryRegion> =
                Arc::from(unsafe { self.verbs.register(base as *mut u8, base_len, self.access) }?);
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            let kept = cache.entry(base).or_insert(region);
            return Ok(Registered::Cached(Arc::clone(kept)));
        }
        // SAFETY: the caller keeps the memory valid while the registration lives.
        Ok(Registered::Once(unsafe { self.verbs.register(ptr.cast_mut(), len, self.access) }?))
    }

    /// Regions registered once and kept.
    pub fn cached(&self) -> usize {
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for MemoryMap {
    fn drop(&mut self) {
        // Regions before the memory `stable` keeps alive.
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_memory_is_registered_once_and_other_memory_per_request() {
        let device = soft::SoftDevice::new("m");
        let pool = Arc::new(vec![0u8; 64 * 1024]);
        let (base, len) = (pool.as_ptr() as usize, pool.len());
        let keep = Arc::clone(&pool);
        let map = MemoryMap::new(
            device.clone(),
            Access::REMOTE_READ,
            Box::new(move |p| {
                let _ = &keep;
                ((p as usize) >= base && (p as usize) < base + len).then_some((base, len))
            }),
        );
        let a = unsafe { map.register(pool.as_ptr().wrapping_add(4096), 4096) }.unwrap();
        let b = unsafe { map.register(pool.as_ptr().wrapping_add(8192), 8192) }.unwrap();
        assert!(matches!((&a, &b), (Registered::Cached(_), Registered::Cached(_))));
        assert_eq!(a.region().rkey(), b.region().rkey());
        assert_eq!(map.cached(), 1);
        let other = [1u8; 100];
        let once = unsafe { map.register(other.as_ptr(), other.len()) }.unwrap();
        assert!(matches!(once, Registered::Once(_)));
        assert_eq!(device.registered_regions(), 2);
        drop(once);
        assert_eq!(device.registered_regions(), 1);
        drop((a, b, map));
        assert_eq!(device.registered_regions(), 0);
    }

    #[test]
    fn settings_come_from_the_environment_and_bad_values_are_refused() {
        let lookup = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned())
        };
        assert_eq!(DeviceSettings::from_lookup(lookup(&[])), Ok(DeviceSettings::default()));
        let set = [
            ("STARCKPT_RDMA_DEVICE", "mlx5_1"),
            ("STARCKPT_RDMA_PORT", "2"),
            ("STARCKPT_RDMA_GID_INDEX", "3"),
            ("STARCKPT_RDMA_MTU", "1024"),
        ];
        let settings = DeviceSettings::from_lookup(lookup(Box::leak(Box::new(set)))).unwrap();
        assert_eq!(settings, DeviceSettings { device: Some("mlx5_1".into()), port: 2, gid_index: 3, mtu: Some(1024) });
        for bad in [
            &[("STARCKPT_RDMA_PORT", "0")][..],
            &[("STARCKPT_RDMA_PORT", "x")],
            &[("STARCKPT_RDMA_GID_INDEX", "300")],
            &[("STARCKPT_RDMA_MTU", "1500")],
        ] {
            let bad: &'static [(&str, &str)] = Box::leak(bad.to_vec().into_boxed_slice());
            assert!(DeviceSettings::from_lookup(lookup(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn without_the_feature_or_hardware_no_device_opens() {
        // This machine has no RDMA device (and the default build no ibverbs): a clear error, which
        // callers turn into TCP.
        let error = open(&DeviceSettings::default()).err().expect("no RDMA device here");
        assert!(matches!(error, VerbsError::NoDevice(_) | VerbsError::Call { .. }), "{error}");
    }
}
