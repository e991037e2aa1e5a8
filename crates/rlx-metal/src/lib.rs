//! rlx-metal: the Metal backend (Apple silicon): shared-storage buffers, the MSL kernel library
//! with its launch records, programs lowered by the plan the GPU backends share
//! (`rlx_runtime::gpu_plan`) with their large matmuls on a compiled matrix engine (MPSGraph on
//! Apple, `matmul` decides), the training update as one multi-tensor kernel or in place on the
//! host over the unified memory, and the blit copy engine ordered by shared events — all above
//! a thin GPU interface
//! (`gpu`) that Metal implements on Apple targets (`sys`) and host memory plus the system C++
//! compiler implements elsewhere (`host`, for tests).
pub mod attention;
pub mod backend;
pub mod buffer;
pub mod caps;
pub mod copy;
pub mod gpu;
pub mod host;
pub mod kernels;
pub mod matmul;
pub mod program;
#[cfg(target_vendor = "apple")]
pub mod sys;

pub use backend::{HostUpdate, MetalBackend, MetalOptions, UpdateMode};
pub use buffer::MetalBuffer;
pub use copy::MetalCopyEngine;

use attention::AttentionKey;
use gpu::{Dispatch, EventWait, Gpu, GpuAttention, GpuEvent, GpuLibrary, GpuMatmul, Work};
use matmul::MatmulKey;
use rlx_ir::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Which prelude the kernel source is compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// Metal Shading Language on a Metal device.
    Msl,
    /// C++17 on the host through `msl/compat.h` (the compat header is added by `host`).
    HostCxx,
}

/// Compiled fused-kernel sources of a device, by the hash of their source.
type FusedCache = Mutex<HashMap<u64, Arc<dyn GpuLibrary>>>;
/// Compiled engine matmuls of a device, by key.
type MatmulCache = Mutex<HashMap<MatmulKey, Arc<dyn GpuMatmul>>>;
/// Compiled engine attentions of a device, by key.
type AttentionCache = Mutex<HashMap<AttentionKey, Arc<dyn GpuAttention>>>;

/// One GPU with the kernel library compiled for it (once, at creation) and the fused kernels
/// compiled so far (once per distinct source), and the engine matmuls compiled so far (once per
/// key).
#[derive(Clone)]
pub struct MetalDevice {
    gpu: Arc<dyn Gpu>,
    dialect: Dialect,
    library: Arc<dyn GpuLibrary>,
    fused: Arc<FusedCache>,
    matmuls: Arc<MatmulCache>,
    attentions: Arc<AttentionCache>,
    /// Device-side waits of this device's copy engines, taken by the next compute submission.
    waits: Arc<copy::DeviceWaits>,
}

impl MetalDevice {
    /// Compiles the kernel library for `gpu`.
    pub fn new(gpu: Arc<dyn Gpu>, dialect: Dialect) -> Result<Self> {
        let library = gpu.compile(&kernels::source(dialect, kernels::LIBRARY))?;
        Ok(Self {
            gpu,
            dialect,
            library,
            fused: Arc::default(),
            matmuls: Arc::default(),
            attentions: Arc::default(),
            waits: Arc::default(),
        })
    }

    /// The fixed kernel library.
    pub fn library(&self) -> &Arc<dyn GpuLibrary> {
        &self.library
    }

    /// A library of kernels `body` (with the prelude), compiled once per distinct source.
    pub fn compile_cached(&self, body: &str) -> Result<Arc<dyn GpuLibrary>> {
        let key = rlx_runtime::expr_source::hash(body);
        let mut cache = self.fused.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lib) = cache.get(&key) {
            return Ok(lib.clone());
        }
        let lib = self.gpu.compile(&kernels::source(self.dialect, body))?;
        cache.insert(key, lib.clone());
        Ok(lib)
    }

    /// The engine matmul of `key`, compiled once per key.
    pub fn matmul(&self, key: MatmulKey) -> Result<Arc<dyn GpuMatmul>> {
        let mut cache = self.matmuls.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = cache.get(&key) {
            return Ok(m.clone());
        }
        let m = self.gpu.matmul(key, &self.library)?;
        cache.insert(key, m.clone());
        Ok(m)
    }

    /// The engine attention of `key`, compiled once per key.
    pub fn attention(&self, key: AttentionKey) -> Result<Arc<dyn GpuAttention>> {
        let mut cache = self.attentions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = cache.get(&key) {
            return Ok(a.clone());
        }
        let a = self.gpu.attention(key)?;
        cache.insert(key, a.clone());
        Ok(a)
    }

    /// How many distinct engine attentions this device compiled.
    pub fn attentions_compiled(&self) -> usize {
        self.attentions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// How many distinct engine matmuls this device compiled.
    pub fn matmuls_compiled(&self) -> usize {
        self.matmuls.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The keys of the engine matmuls this device compiled.
    pub fn matmul_keys(&self) -> Vec<MatmulKey> {
        let cache = self.matmuls.lock().unwrap_or_else(|p| p.into_inner());
        cache.keys().copied().collect()
    }

    /// The host-emulated device (Linux tests); a `Device` error without a C++ compiler.
    pub fn host() -> Result<Self> {
        Self::new(Arc::new(host::HostGpu::new()?), Dialect::HostCxx)
    }

    /// The system's default Metal device.
    #[cfg(target_vendor = "apple")]
    pub fn system() -> Result<Self> {
        Self::new(Arc::new(sys::MetalGpu::system_default()?), Dialect::Msl)
    }

    pub fn name(&self) -> String {
        self.gpu.name()
    }

    /// A zeroed shared buffer of `bytes` bytes.
    pub fn alloc(&self, bytes: usize) -> Result<Arc<MetalBuffer>> {
        Ok(Arc::new(MetalBuffer::new(self.gpu.new_buffer(bytes)?)))
    }

    /// A copy engine on this device's blit queue (its device-side waits order this device's
    /// next compute submission).
    pub fn copy_engine(&self) -> Result<Arc<MetalCopyEngine>> {
        Ok(Arc::new(MetalCopyEngine::new(
            self.gpu.clone(),
            self.waits.clone(),
        )?))
    }

    /// How many device-side waits (`AsyncCopy::wait_on_device`) the next compute submission
    /// will encode.
    pub fn pending_device_waits(&self) -> usize {
        self.waits.len()
    }

    /// Runs `dispatches` in order on the compute queue (after the device-side wait `wait`, if
    /// given, and those the copy engines recorded) with `uses` resident, and blocks until they
    /// completed.
    pub fn run(
        &self,
        wait: Option<(&Arc<dyn GpuEvent>, u64)>,
        dispatches: &[Dispatch<'_>],
        uses: &[&MetalBuffer],
    ) -> Result<()> {
        let work: Vec<Work<'_>> = dispatches
            .iter()
            .map(|d| {
                Work::Kernel(Dispatch {
                    library: d.library,
                    kernel: d.kernel,
                    record: d.record,
                    threads: d.threads,
                })
            })
            .collect();
        self.run_work(wait, &work, uses)
    }

    /// Runs `work` (kernels, engine matmuls and attentions) in order on the compute queue, as
    /// `run`: the submission first waits on the device for `wait` and for every wait the copy
    /// engines recorded since the last submission; a failure of such a copy is reported here.
    /// (An explicit `wait` is the caller's to keep live: nothing here watches its copy.)
    ///
    /// The recorded waits belong to the device, not to a caller: whichever submission comes
    /// next (from any thread) takes them. A failed copy releases the submission that waited
    /// for it (its event is raised from the host), so that work runs on bytes the copy never
    /// wrote, an in-step update included, and the copy's error is returned after it.
    pub fn run_work(
        &self,
        wait: Option<(&Arc<dyn GpuEvent>, u64)>,
        work: &[Work<'_>],
        uses: &[&MetalBuffer],
    ) -> Result<()> {
        let copies = self.waits.take();
        let waited = copy::wait_events(&copies);
        let progress: Vec<_> = waited
            .iter()
            .map(|w| {
                move || {
                    w.progress();
                }
            })
            .collect();
        let mut waits: Vec<EventWait<'_>> = waited
            .iter()
            .zip(&progress)
            .map(|(w, p)| {
                let (event, value) = w.event();
                EventWait {
                    event,
                    value,
                    progress: Some(p as &(dyn Fn() + Sync)),
                }
            })
            .collect();
        waits.extend(wait.map(|(e, v)| EventWait {
            event: e.clone(),
            value: v,
            progress: None,
        }));
        let uses: Vec<_> = uses.iter().map(|b| b.gpu().clone()).collect();
        let ran = self.gpu.compute(&waits, work, &uses).and_then(|s| {
            if waited.is_empty() {
                return s.finish();
            }
            // While the device waits for the copies, look after them on the host: a failed
            // copy's signal never comes, and `progress` raises its event instead.
            loop {
                if waited.iter().all(|w| w.progress()) {
                    return s.finish();
                }
                if let Some(r) = s.poll() {
                    return r;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        });
        let copied = copy::settle(&copies);
        ran.and(copied)
    }
}

#[cfg(test)]
mod tests;
