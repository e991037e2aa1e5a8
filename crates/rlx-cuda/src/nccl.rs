//! NCCL collectives for data-parallel CUDA ranks (one process per GPU): the communicator, made
//! from a unique id that rank 0 creates and the launcher hands to every rank, and the two
//! collectives a data-parallel step needs, in place over device buffers (the arena's gradient
//! region, the weight store), ordered on the device's compute stream. A collective waits for
//! its completion with a timeout: a rank that never joins makes the others abort the
//! communicator and fail with a `Device` error instead of hanging. The FFI lives here, each call
//! with its `// SAFETY:` note; the library (`libnccl.so.2`) is loaded at run time.
use crate::driver::{self, dev_err, Device};
use cudarc::driver::sys as cu_sys;
use cudarc::nccl::sys as nccl;
use rlx_ir::{Error, Result};
use rlx_runtime::backend::check_range;
use rlx_runtime::DeviceBuffer;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// `Ok` where CUDA is usable and `libnccl.so.2` loads, else why not. Checked once.
pub fn available() -> std::result::Result<(), String> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            driver::probe()?;
            // SAFETY: a dlopen probe by candidate names.
            if driver::preload(&["libnccl.so.2", "libnccl.so"])
                && unsafe { nccl::is_culib_present() }
            {
                Ok(())
            } else {
                Err(
                    "NCCL (libnccl.so.2) was not found; install the nvidia-nccl wheel or \
                     NCCL itself, or set RLX_CUDA_LIB_DIR"
                        .into(),
                )
            }
        })
        .clone()
}

fn check(r: nccl::ncclResult_t, what: &str) -> Result<()> {
    if r == nccl::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for any result code.
    let msg = unsafe { std::ffi::CStr::from_ptr(nccl::ncclGetErrorString(r)) };
    Err(Error::Device(format!(
        "[nccl] {what} failed: {} ({r:?})",
        msg.to_string_lossy()
    )))
}

/// A new unique id (made by one rank, given to all of them).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    available().map_err(|why| Error::Device(format!("NCCL is not available: {why}")))?;
    let mut id = nccl::ncclUniqueId {
        internal: [0; ID_BYTES],
    };
    // SAFETY: NCCL writes the id into `id`.
    check(unsafe { nccl::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's communicator, on one GPU.
pub struct Comm {
    comm: nccl::ncclComm_t,
    dev: Arc<Device>,
    pub rank: usize,
    pub size: usize,
    timeout: Duration,
    /// Set once a timed-out collective aborted the communicator (it is then unusable).
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every call here holds the device's run lock.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Joins the communicator of `size` ranks named by `id` as `rank`, on GPU `ordinal`. Blocks
    /// until every rank has joined (NCCL's own rendezvous).
    pub fn new(
        ordinal: usize,
        id: &[u8],
        size: usize,
        rank: usize,
        timeout: Duration,
    ) -> Result<Comm> {
        available().map_err(|why| Error::Device(format!("NCCL is not available: {why}")))?;
        if id.len() != ID_BYTES || size == 0 || rank >= size || size > i32::MAX as usize {
            return Err(Error::Input {
                name: "nccl".into(),
                msg: format!(
                    "needs a {ID_BYTES}-byte unique id and 0 <= rank < size, got {} bytes, \
                     rank {rank}, size {size}",
                    id.len()
                ),
            });
        }
        let dev = Device::get(ordinal)?;
        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
        for (d, s) in internal.iter_mut().zip(id) {
            *d = *s as std::ffi::c_char;
        }
        let mut comm = std::ptr::null_mut();
        // Not under the run lock: joining waits for the other ranks (NCCL's own rendezvous,
        // without a timeout; the launcher's abort ends a job whose rank failed before joining).
        dev.bind()?;
        // SAFETY: NCCL writes a new communicator into `comm`; the device's context is current,
        // so NCCL uses this GPU.
        check(
            unsafe {
                nccl::ncclCommInitRank(
                    &mut comm,
                    size as i32,
                    nccl::ncclUniqueId { internal },
                    rank as i32,
                )
            },
            "ncclCommInitRank",
        )?;
        Ok(Comm {
            comm,
            dev: dev.clone(),
            rank,
            size,
            timeout,
            aborted: AtomicBool::new(false),
        })
    }

    /// The device address of `bytes` float32 bytes at `offset` of `buf`, checked.
    fn at(&self, buf: &dyn DeviceBuffer, offset: usize, bytes: usize) -> Result<u64> {
        check_range("nccl", offset, bytes, buf.len())?;
        if !offset.is_multiple_of(4) || !bytes.is_multiple_of(4) {
            return Err(Error::Input {
                name: "nccl".into(),
                msg: format!(
                    "collectives move whole float32 elements: offset {offset} and {bytes} bytes \
                     must be multiples of 4"
                ),
            });
        }
        match buf.device_ptr() {
            Some((ptr, ord)) if ord == self.dev.ordinal => Ok(ptr + offset as u64),
            Some((_, ord)) => Err(Error::Input {
                name: "nccl".into(),
                msg: format!(
                    "a collective over cuda:{ord} memory on a communicator of cuda:{}",
                    self.dev.ordinal
                ),
            }),
            None => Err(Error::Input {
                name: "nccl".into(),
                msg: "collectives need GPU memory".into(),
            }),
        }
    }

    /// Replaces `bytes` float32 bytes at `offset` of `buf` by their mean over the ranks.
    pub fn all_reduce_mean(
        &self,
        buf: &dyn DeviceBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<()> {
        let p = self.at(buf, offset, bytes)?;
        self.collective("all-reduce", |stream| {
            // SAFETY: in place over `bytes / 4` floats the check above found inside `buf`,
            // which the caller keeps alive until this returns (it waits for completion).
            unsafe {
                nccl::ncclAllReduce(
                    p as *const _,
                    p as *mut _,
                    bytes / 4,
                    nccl::ncclDataType_t::ncclFloat32,
                    nccl::ncclRedOp_t::ncclAvg,
                    self.comm,
                    stream,
                )
            }
        })
    }

    /// Overwrites `bytes` bytes at `offset` of `buf` with rank `root`'s.
    pub fn broadcast(
        &self,
        buf: &dyn DeviceBuffer,
        offset: usize,
        bytes: usize,
        root: usize,
    ) -> Result<()> {
        if root >= self.size {
            return Err(Error::Input {
                name: "nccl".into(),
                msg: format!("broadcast root {root} of {} ranks", self.size),
            });
        }
        let p = self.at(buf, offset, bytes)?;
        self.collective("broadcast", |stream| {
            // SAFETY: as for the all-reduce.
            unsafe {
                nccl::ncclBroadcast(
                    p as *const _,
                    p as *mut _,
                    bytes / 4,
                    nccl::ncclDataType_t::ncclFloat32,
                    root as i32,
                    self.comm,
                    stream,
                )
            }
        })
    }

    /// Queues one collective on the compute stream, then waits for it within the timeout;
    /// past it, the communicator is aborted (the other ranks' collectives fail too).
    fn collective(
        &self,
        what: &str,
        issue: impl FnOnce(nccl::cudaStream_t) -> nccl::ncclResult_t,
    ) -> Result<()> {
        let _run = self.dev.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::Device(format!(
                "[nccl] {what}: the communicator was aborted after an earlier timeout"
            )));
        }
        self.dev.bind()?;
        let stream = self.dev.stream();
        check(issue(stream as nccl::cudaStream_t), what)?;
        let start = Instant::now();
        loop {
            // SAFETY: a query of this device's stream.
            match unsafe { cu_sys::cuStreamQuery(stream) } {
                cu_sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cu_sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(dev_err(what, e)),
            }
            if start.elapsed() > self.timeout {
                // SAFETY: aborting frees the communicator's resources and fails its pending
                // work; `self.comm` is not used for collectives again (every later call fails).
                unsafe { nccl::ncclCommAbort(self.comm) };
                self.aborted.store(true, Ordering::Release);
                return Err(Error::Device(format!(
                    "[nccl] {what} did not complete within {:.0} s (a rank did not join?); \
                     the communicator was aborted",
                    self.timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Acquire) {
            return; // abort already freed it
        }
        let _run = self.dev.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self.dev.bind();
        // SAFETY: the communicator was made by `ncclCommInitRank` and is destroyed once.
        unsafe { nccl::ncclCommDestroy(self.comm) };
    }
}
