//! Every call into the CUDA driver, NVRTC and cuBLAS (through cudarc's dynamically loaded
//! bindings): finding the libraries, the per-device context and stream, device memory, module
//! loading, launches, events and GEMMs. The crate's other FFI: `lt.rs` (cuBLASLt) and `nccl.rs`.
//!
//! cudarc panics when a library it needs cannot be loaded, so [`probe`] finds (and loads) every
//! library with a plain `dlopen` first; nothing here touches a cudarc function before it passed.
use cudarc::cublas::sys as blas;
use cudarc::driver::{result as cu, sys};
use rlx_ir::{DType, Error, Result};
use rlx_runtime::backend::check_range;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) fn dev_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("[cuda] {what} failed: {e:?}"))
}

static PACKAGE_DIRS: Mutex<Vec<std::path::PathBuf>> = Mutex::new(Vec::new());

pub fn add_package_dirs(dirs: Vec<std::path::PathBuf>) {
    PACKAGE_DIRS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(dirs);
}

/// Directories searched for the NVRTC and cuBLAS libraries, in order: `RLX_CUDA_LIB_DIR`
/// (colon-separated), the CUDA toolkit, and the `nvidia-*` pip packages' folders of every
/// `site-packages` on `PYTHONPATH`, in the interpreter's `sys.path` (see [`add_package_dirs`]),
/// or next to the running executable.
fn lib_dirs() -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = Vec::new();
    if let Ok(v) = std::env::var("RLX_CUDA_LIB_DIR") {
        dirs.extend(v.split(':').filter(|s| !s.is_empty()).map(Into::into));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            dirs.push(std::path::Path::new(&v).join("lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    let mut sites: Vec<std::path::PathBuf> = PACKAGE_DIRS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    if let Ok(v) = std::env::var("PYTHONPATH") {
        sites.extend(v.split(':').filter(|s| !s.is_empty()).map(Into::into));
    }
    if let Ok(exe) = std::env::current_exe() {
        // <prefix>/bin/python3 -> <prefix>/lib/python3.*/site-packages
        if let Some(prefix) = exe.parent().and_then(|b| b.parent()) {
            if let Ok(rd) = std::fs::read_dir(prefix.join("lib")) {
                for e in rd.flatten() {
                    sites.push(e.path().join("site-packages"));
                }
            }
        }
    }
    for site in sites {
        let nv = site.join("nvidia");
        for sub in [
            "cu13/lib",
            "cublas/lib",
            "cuda_nvrtc/lib",
            "nccl/lib",
            "cu13/lib64",
            "nvjitlink/lib",
        ] {
            dirs.push(nv.join(sub));
        }
    }
    dirs
}

/// Loads `names` (first found wins) from the search directories, then by plain name; the handle
/// is kept for the process, so cudarc's own lookup by soname finds the same library.
pub(crate) fn preload(names: &[&str]) -> bool {
    static KEPT: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());
    let try_load = |path: &std::ffi::OsStr| -> bool {
        // SAFETY: loading a vendor library runs its initialisers, which are designed for
        // dlopen; the handle is kept for the process so nothing it registered goes away.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => {
                KEPT.lock().unwrap_or_else(|p| p.into_inner()).push(lib);
                true
            }
            Err(_) => false,
        }
    };
    for dir in lib_dirs() {
        for n in names {
            let p = dir.join(n);
            if p.exists() && try_load(p.as_os_str()) {
                return true;
            }
        }
    }
    names.iter().any(|n| try_load(std::ffi::OsStr::new(n)))
}

/// Why CUDA cannot be used here, or `Ok` once the driver, NVRTC and cuBLAS are loaded and the
/// driver is initialised. Checked once per process.
pub fn probe() -> std::result::Result<(), String> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries `dlopen` on candidate names.
            if !preload(&["libcuda.so.1", "libcuda.so"]) || !unsafe { sys::is_culib_present() } {
                return Err("no NVIDIA driver found (libcuda.so.1 could not be loaded)".into());
            }
            cu::init().map_err(|e| format!("the NVIDIA driver did not initialise: {e:?}"))?;
            let n = cu::device::get_count().map_err(|e| format!("cannot count GPUs: {e:?}"))?;
            if n == 0 {
                return Err("the NVIDIA driver is loaded but found no GPU".into());
            }
            if !nvrtc_available() {
                return Err("NVRTC (libnvrtc.so.13) was not found; install the CUDA 13 \
                            toolkit or the nvidia-cuda-nvrtc wheel, or set RLX_CUDA_LIB_DIR"
                    .into());
            }
            // SAFETY: as above, a dlopen probe.
            let cublas = preload(&["libcublas.so.13", "libcublas.so"])
                && unsafe { blas::is_culib_present() };
            if !cublas {
                return Err(
                    "cuBLAS (libcublas.so.13) was not found; install the CUDA 13 \
                            toolkit or the nvidia-cublas wheel, or set RLX_CUDA_LIB_DIR"
                        .into(),
                );
            }
            Ok(())
        })
        .clone()
}

/// Whether NVRTC loads (no driver or GPU needed): the library, and its builtins next to it.
pub fn nvrtc_available() -> bool {
    static NVRTC: OnceLock<bool> = OnceLock::new();
    *NVRTC.get_or_init(|| {
        let found = preload(&["libnvrtc.so.13", "libnvrtc.so"]);
        // NVRTC opens its builtins by name at the first compile; loaded here, they are found.
        preload(&["libnvrtc-builtins.so.13.0", "libnvrtc-builtins.so.13"]);
        // SAFETY: a dlopen probe.
        found && unsafe { cudarc::nvrtc::sys::is_culib_present() }
    })
}

/// Compiles CUDA C to PTX for `arch` (`"sm_90"`) where NVRTC loads (see [`nvrtc_available`]).
#[cfg(test)]
pub fn compile_only(source: &str, arch: &str) -> Result<String> {
    if !nvrtc_available() {
        return Err(Error::Device("NVRTC was not found".into()));
    }
    compile_ptx(source, arch)
}

/// Number of GPUs, 0 where CUDA is unusable.
pub fn device_count() -> usize {
    if probe().is_err() {
        return 0;
    }
    cu::device::get_count().map_or(0, |n| n.max(0) as usize)
}

/// A loaded module and its functions by name.
pub struct Module {
    module: sys::CUmodule,
    funcs: Mutex<HashMap<String, Func>>,
}

/// A kernel handle.
#[derive(Clone, Copy)]
pub struct Func(sys::CUfunction);

// SAFETY: module and function handles are plain driver handles, valid in every thread of the
// process once the owning context is current (each entry point below makes it current).
unsafe impl Send for Module {}
unsafe impl Sync for Module {}
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

/// One GPU: its primary context, the compute stream, the cuBLAS handle, and module caches.
pub struct Device {
    pub ordinal: usize,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    blas: Mutex<blas::cublasHandle_t>,
    /// cuBLASLt, made at the first fused-epilogue product (see `lt.rs`, [`Device::lt`]).
    lt: OnceLock<Option<crate::lt::Handle>>,
    /// `sm_XY` of the device.
    pub arch: String,
    pub name: String,
    modules: Mutex<HashMap<u64, Arc<Module>>>,
    /// Serialises runs and the stream's copies (the cuBLAS handle, launch order, and no copy
    /// landing inside a graph capture).
    pub run_lock: Mutex<()>,
}

// SAFETY: the context, stream and cuBLAS handle are driver handles usable from any thread once
// the context is current; the cuBLAS handle is only used under its mutex.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// The device `ordinal`, made once per process.
    pub fn get(ordinal: usize) -> Result<Arc<Device>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();
        probe().map_err(|why| Error::Device(format!("CUDA is not available: {why}")))?;
        let count = device_count();
        if ordinal >= count {
            return Err(Error::Device(format!(
                "device 'cuda:{ordinal}' does not exist: {count} GPU(s) found"
            )));
        }
        let mut map = DEVICES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(Device::open(ordinal)?);
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<Device> {
        let dev = cu::device::get(ordinal as i32).map_err(|e| dev_err("cuDeviceGet", e))?;
        // SAFETY: `dev` is a valid device handle; the primary context is retained for the
        // process (never released: the device lives in a process-wide registry).
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| dev_err("retain", e))?;
        // SAFETY: `ctx` was just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| dev_err("set context", e))?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| dev_err("stream create", e))?;
        let attr = |a| {
            // SAFETY: a valid device and attribute.
            unsafe { cu::device::get_attribute(dev, a) }.map_err(|e| dev_err("attribute", e))
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let name = cu::device::get_name(dev).unwrap_or_else(|_| "GPU".into());
        let mut handle = std::ptr::null_mut();
        // SAFETY: cuBLAS writes a new handle into `handle`; the stream belongs to this context.
        unsafe {
            check_blas(blas::cublasCreate_v2(&mut handle), "cublasCreate")?;
            check_blas(
                blas::cublasSetStream_v2(handle, stream as blas::cudaStream_t),
                "cublasSetStream",
            )?;
            // float32 stays float32: TF32 only where a user opts in (RLX_CUDA_TF32=1).
            let mode = if std::env::var("RLX_CUDA_TF32").is_ok_and(|v| v == "1") {
                blas::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
            } else {
                blas::cublasMath_t::CUBLAS_DEFAULT_MATH
            };
            check_blas(blas::cublasSetMathMode(handle, mode), "cublasSetMathMode")?;
            // A workspace of its own, so GEMMs allocate nothing while a run is captured.
            let ws_bytes = 32 << 20;
            let ws = cu::malloc_sync(ws_bytes).map_err(|e| dev_err("cuBLAS workspace", e))?;
            check_blas(
                blas::cublasSetWorkspace_v2(handle, ws as *mut c_void, ws_bytes),
                "cublasSetWorkspace",
            )?;
        }
        Ok(Device {
            ordinal,
            ctx,
            stream,
            blas: Mutex::new(handle),
            lt: OnceLock::new(),
            arch: format!("sm_{major}{minor}"),
            name,
            modules: Mutex::new(HashMap::new()),
            run_lock: Mutex::new(()),
        })
    }

    /// The compute stream (for collectives ordered with the runs).
    pub(crate) fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// The device's cuBLASLt handle, made at the first use (with a workspace of its own, kept
    /// for the process); `None` where libcublasLt (shipped beside cuBLAS) does not load or the
    /// workspace cannot be allocated.
    pub fn lt(&self) -> Option<&crate::lt::Handle> {
        self.lt
            .get_or_init(|| {
                if !preload(&["libcublasLt.so.13", "libcublasLt.so"]) || self.bind().is_err() {
                    return None;
                }
                // SAFETY: a plain device allocation, kept for the process as the device is.
                let ws = unsafe { cu::malloc_sync(crate::lt::WORKSPACE) }.ok()?;
                crate::lt::Handle::new(ws)
            })
            .as_ref()
    }

    /// Queues the cuBLASLt product `m` on the compute stream (see `lt::Handle::run`).
    pub fn lt_matmul(&self, m: &crate::lt::Matmul, ops: [u64; 4], bias: u64) -> Result<()> {
        let h = self
            .lt()
            .ok_or_else(|| Error::Internal("a cuBLASLt product without cuBLASLt".into()))?;
        h.run(m, ops, bias, self.stream)
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the process.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| dev_err("set context", e))
    }

    /// A zeroed allocation of `bytes` (address 0 for none).
    pub fn alloc(&self, bytes: usize) -> Result<u64> {
        if bytes == 0 {
            return Ok(0);
        }
        self.bind()?;
        // SAFETY: a plain device allocation (never managed memory), zeroed before use.
        unsafe {
            let p = cu::malloc_sync(bytes).map_err(|e| {
                Error::Device(format!("[cuda] cannot allocate {bytes} bytes: {e:?}"))
            })?;
            cu::memset_d8_sync(p, 0, bytes).map_err(|e| dev_err("memset", e))?;
            Ok(p)
        }
    }

    /// Frees an allocation made by [`Device::alloc`].
    pub fn free(&self, ptr: u64) {
        if ptr != 0 && self.bind().is_ok() {
            // SAFETY: `ptr` came from `alloc` and is freed once (by its owner's drop).
            let _ = unsafe { cu::free_sync(ptr) };
        }
    }

    /// Host -> device, ordered on the compute stream, complete on return.
    pub fn write(&self, dst: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        // Not while a run is being captured on this stream.
        let _run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.write_holding_run_lock(dst, data)
    }

    /// [`Device::write`] for a caller that holds `run_lock` (a run, before it queues or
    /// captures anything).
    pub fn write_holding_run_lock(&self, dst: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller checked `dst..dst+len` lies inside one allocation; `data` lives
        // until the stream is synchronised below.
        unsafe {
            cu::memcpy_htod_async(dst, data, self.stream).map_err(|e| dev_err("copy to GPU", e))?;
            cu::stream::synchronize(self.stream).map_err(|e| dev_err("synchronize", e))
        }
    }

    /// Device -> host, ordered on the compute stream, complete on return.
    pub fn read(&self, src: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // Not while a run is being captured on this stream.
        let _run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.bind()?;
        // SAFETY: the caller checked the range; `out` lives until the synchronisation.
        unsafe {
            cu::memcpy_dtoh_async(out, src, self.stream).map_err(|e| dev_err("copy to host", e))?;
            cu::stream::synchronize(self.stream).map_err(|e| dev_err("synchronize", e))
        }
    }

    /// Device -> device on the compute stream, complete on return.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // Not while a run is being captured on this stream.
        let _run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.bind()?;
        // SAFETY: the caller checked both ranges.
        unsafe {
            cu::memcpy_dtod_async(dst, src, bytes, self.stream)
                .map_err(|e| dev_err("device copy", e))?;
            cu::stream::synchronize(self.stream).map_err(|e| dev_err("synchronize", e))
        }
    }

    /// Queues a fill of `bytes` zero bytes at `dst` on the compute stream.
    pub fn memset_async(&self, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the plan checked the range.
        unsafe { cu::memset_d8_async(dst, 0, bytes, self.stream) }.map_err(|e| dev_err("memset", e))
    }

    /// Queues a host -> device copy whose source must stay alive until the next `sync`.
    ///
    /// # Safety
    /// `data` must not be freed or changed before [`Device::sync`] returns.
    pub unsafe fn write_async(&self, dst: u64, data: &[u8]) -> Result<()> {
        // SAFETY: the caller's contract keeps `data` alive; the plan checked the range.
        unsafe { cu::memcpy_htod_async(dst, data, self.stream) }
            .map_err(|e| dev_err("copy to GPU", e))
    }

    /// Records a timing event on the compute stream (the profiler's marks).
    pub fn timing(&self) -> Result<Event> {
        let e = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| dev_err("event create", e))?;
        // SAFETY: a fresh event recorded on the live compute stream.
        unsafe { cu::event::record(e, self.stream) }.map_err(|e| dev_err("event record", e))?;
        Ok(Event(e))
    }

    /// Waits for everything queued on the compute stream.
    pub fn sync(&self) -> Result<()> {
        // SAFETY: the stream lives as long as the device.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(|e| dev_err("synchronize", e))
    }

    /// The module compiled from `source` (cached in the process and on disk by source hash and
    /// architecture).
    pub fn module(&self, source: &str) -> Result<Arc<Module>> {
        let key = crate::source::hash(source) ^ crate::source::hash(&self.arch);
        if let Some(m) = self
            .modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(m.clone());
        }
        let ptx = crate::cache::ptx(source, &self.arch, key, compile_ptx)?;
        self.bind()?;
        let image = CString::new(ptx).map_err(|_| Error::Internal("PTX holds a NUL".into()))?;
        // SAFETY: `image` is NUL-terminated PTX text produced by NVRTC.
        let module = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(|e| dev_err("loading a kernel module", e))?;
        let m = Arc::new(Module {
            module,
            funcs: Mutex::new(HashMap::new()),
        });
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, m.clone());
        Ok(m)
    }

    /// Queues one launch of `f` with the launch record `p` (copied by the driver at launch).
    pub fn launch(&self, f: Func, grid: u32, block: u32, p: &mut crate::plan::P) -> Result<()> {
        let mut args = [p as *mut crate::plan::P as *mut c_void];
        // SAFETY: every kernel takes exactly one argument of type `P` (same layout: see
        // `plan::P`); the plan checked every operand range against its buffer, and the buffers
        // outlive the run, which synchronises before returning.
        unsafe { cu::launch_kernel(f.0, (grid, 1, 1), (block, 1, 1), 0, self.stream, &mut args) }
            .map_err(|e| dev_err("kernel launch", e))
    }

    /// Queues a column-major strided-batched GEMM (see `plan::Gemm`): SGEMM for float32
    /// operands; for bfloat16/float16 ones a tensor-core GEMM summing in float32 into a
    /// float32 `C`.
    pub fn gemm(&self, g: &crate::plan::Gemm, a: u64, b: u64, c: u64) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let h = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        let ab = operand_type(g.dtype)?;
        if g.dtype != DType::F32 {
            // SAFETY: as for the SGEMM below; A and B hold 2-byte elements of type `ab` (the
            // plan's offsets and strides count in them), C float32, alpha/beta float32 as the
            // float32 compute type requires.
            return unsafe {
                check_blas(
                    blas::cublasGemmStridedBatchedEx(
                        *h,
                        op(g.ta),
                        op(g.tb),
                        g.m as i32,
                        g.n as i32,
                        g.k as i32,
                        &alpha as *const f32 as *const c_void,
                        a as *const c_void,
                        ab,
                        g.lda as i32,
                        g.stride_a as i64,
                        b as *const c_void,
                        ab,
                        g.ldb as i32,
                        g.stride_b as i64,
                        &beta as *const f32 as *const c_void,
                        c as *mut c_void,
                        blas::cudaDataType::CUDA_R_32F,
                        g.ldc as i32,
                        g.stride_c as i64,
                        g.batch as i32,
                        blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    ),
                    "cublasGemmStridedBatchedEx",
                )
            };
        }
        // SAFETY: the plan checked that every matrix of every batch lies inside its buffer
        // (leading dimensions and strides as given); the handle is used under its lock.
        unsafe {
            check_blas(
                blas::cublasSgemmStridedBatched(
                    *h,
                    op(g.ta),
                    op(g.tb),
                    g.m as i32,
                    g.n as i32,
                    g.k as i32,
                    &alpha,
                    a as *const f32,
                    g.lda as i32,
                    g.stride_a as i64,
                    b as *const f32,
                    g.ldb as i32,
                    g.stride_b as i64,
                    &beta,
                    c as *mut f32,
                    g.ldc as i32,
                    g.stride_c as i64,
                    g.batch as i32,
                ),
                "cublasSgemmStridedBatched",
            )
        }
    }
}

/// cuBLAS's transpose flag.
fn op(t: bool) -> blas::cublasOperation_t {
    if t {
        blas::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas::cublasOperation_t::CUBLAS_OP_N
    }
}

/// cuBLAS's type of a product's `A` and `B` operands in `dtype`.
fn operand_type(dtype: DType) -> Result<blas::cudaDataType> {
    match dtype {
        DType::F32 => Ok(blas::cudaDataType::CUDA_R_32F),
        DType::BF16 => Ok(blas::cudaDataType::CUDA_R_16BF),
        DType::F16 => Ok(blas::cudaDataType::CUDA_R_16F),
        d => Err(Error::unsupported(
            "matmul",
            format!("the cuda backend has no {d} matrix product"),
        )),
    }
}

impl Device {
    /// Queues a column-major pointer-array batched GEMM (`plan::Step::GemmGrid`): `g` without
    /// its strides, the `g.batch` addresses of each operand's matrices in device memory at
    /// `a`, `b` and `c`; float32 or bfloat16/float16 operands summing in float32 into
    /// float32 `C`.
    pub fn gemm_grid(&self, g: &crate::plan::Gemm, [a, b, c]: [u64; 3]) -> Result<()> {
        let ab = operand_type(g.dtype)?;
        // float32 stays float32 unless TF32 was asked for, as the handle's math mode says.
        let compute =
            if g.dtype == DType::F32 && std::env::var("RLX_CUDA_TF32").is_ok_and(|v| v == "1") {
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
            } else {
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F
            };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let h = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `a`, `b` and `c` hold `g.batch` device addresses each (written by the
        // program before its run, from the plan's grids of matrices inside their tensors);
        // the handle is used under its lock; alpha/beta are float32 as the compute type asks.
        unsafe {
            check_blas(
                blas::cublasGemmBatchedEx(
                    *h,
                    op(g.ta),
                    op(g.tb),
                    g.m as i32,
                    g.n as i32,
                    g.k as i32,
                    &alpha as *const f32 as *const c_void,
                    a as *const *const c_void,
                    ab,
                    g.lda as i32,
                    b as *const *const c_void,
                    ab,
                    g.ldb as i32,
                    &beta as *const f32 as *const c_void,
                    c as *const *mut c_void,
                    blas::cudaDataType::CUDA_R_32F,
                    g.ldc as i32,
                    g.batch as i32,
                    compute,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                ),
                "cublasGemmBatchedEx",
            )
        }
    }
}

impl Module {
    pub fn func(&self, name: &str) -> Result<Func> {
        let mut funcs = self.funcs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = funcs.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name).map_err(|_| Error::Internal("kernel name".into()))?;
        // SAFETY: the module is loaded and never unloaded while `self` lives.
        let f = unsafe { cu::module::get_function(self.module, cname) }
            .map_err(|e| dev_err(&format!("finding kernel {name}"), e))?;
        funcs.insert(name.to_string(), Func(f));
        Ok(Func(f))
    }
}

fn check_blas(s: blas::cublasStatus_t, what: &str) -> Result<()> {
    if s == blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Device(format!("[cuda] {what} failed: {s:?}")))
    }
}

/// NVRTC: CUDA C -> PTX for `arch`.
fn compile_ptx(source: &str, arch: &str) -> Result<String> {
    use cudarc::nvrtc::result as rtc;
    let src = CString::new(source).map_err(|_| Error::Internal("source holds a NUL".into()))?;
    let prog = rtc::create_program(&src, None).map_err(|e| dev_err("nvrtcCreateProgram", e))?;
    let opts = [
        format!("--gpu-architecture=compute_{}", &arch[3..]),
        "-std=c++17".to_string(),
    ];
    // SAFETY: `prog` is a live program, destroyed below on every path.
    unsafe {
        let r = rtc::compile_program(prog, &opts);
        let out = match r {
            Ok(()) => rtc::get_ptx(prog)
                .map(|v| {
                    let bytes: Vec<u8> = v
                        .iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8)
                        .collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .map_err(|e| dev_err("nvrtcGetPTX", e)),
            Err(e) => {
                let log = rtc::get_program_log(prog)
                    .map(|v| {
                        let bytes: Vec<u8> = v
                            .iter()
                            .take_while(|&&c| c != 0)
                            .map(|&c| c as u8)
                            .collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(Error::Internal(format!(
                    "[cuda] NVRTC failed ({e:?}): {log}"
                )))
            }
        };
        let _ = rtc::destroy_program(prog);
        out
    }
}

/// An event on a stream (the copy engine's completion marks).
pub struct Event(sys::CUevent);

// SAFETY: events are driver handles usable from any thread with the context current.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn wait(&self) -> Result<()> {
        // SAFETY: the event is live until dropped.
        unsafe { cu::event::synchronize(self.0) }.map_err(|e| dev_err("event wait", e))
    }

    /// Whether the work before the event has completed (`Err` if it failed), without blocking.
    pub fn done(&self) -> Result<bool> {
        // SAFETY: the event is live until dropped.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(dev_err("event query", e)),
        }
    }
}

impl Device {
    /// Makes the compute stream wait (on the device) for `event`: work queued after this call
    /// starts once the event's work is done.
    pub fn stream_wait(&self, event: &Event) -> Result<()> {
        let _run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.bind()?;
        // SAFETY: the stream and the event are live.
        unsafe {
            cu::stream::wait_event(
                self.stream,
                event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| dev_err("stream wait", e))
    }
}

impl Event {
    /// Milliseconds between two timing events recorded on one stream (both complete).
    pub fn ms_since(&self, start: &Event) -> Result<f32> {
        // SAFETY: both events are live and were created with timing (see `Device::timing`).
        unsafe { cu::event::elapsed(start.0, self.0) }.map_err(|e| dev_err("event time", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        let _ = unsafe { cu::event::destroy(self.0) };
    }
}

/// A stream of its own (the copy engine's).
pub struct Stream {
    dev: Arc<Device>,
    s: sys::CUstream,
}

// SAFETY: a driver handle usable from any thread with the context current.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(dev: Arc<Device>) -> Result<Stream> {
        dev.bind()?;
        let s = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| dev_err("stream create", e))?;
        Ok(Stream { dev, s })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Queues a host -> device copy and returns the event marking its completion.
    ///
    /// # Safety
    /// `data` must stay alive and unchanged until the returned event has completed.
    pub unsafe fn copy_from_host(&self, dst: u64, data: &[u8]) -> Result<Event> {
        self.dev.bind()?;
        if !data.is_empty() {
            // SAFETY: the caller keeps `data` alive; the caller checked the range.
            unsafe { cu::memcpy_htod_async(dst, data, self.s) }
                .map_err(|e| dev_err("copy to GPU", e))?;
        }
        self.mark()
    }

    /// Queues a device -> device copy and returns the event marking its completion.
    pub fn copy_on_device(&self, dst: u64, src: u64, bytes: usize) -> Result<Event> {
        self.dev.bind()?;
        if bytes > 0 {
            // SAFETY: the caller checked both ranges.
            unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.s) }
                .map_err(|e| dev_err("device copy", e))?;
        }
        self.mark()
    }

    fn mark(&self) -> Result<Event> {
        let e = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| dev_err("event create", e))?;
        // SAFETY: a fresh event recorded on this live stream.
        unsafe { cu::event::record(e, self.s) }.map_err(|e| dev_err("event record", e))?;
        Ok(Event(e))
    }

    pub fn sync(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: the stream is live.
        unsafe { cu::stream::synchronize(self.s) }.map_err(|e| dev_err("synchronize", e))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: the stream is destroyed once, after its work is done.
            unsafe {
                let _ = cu::stream::synchronize(self.s);
                let _ = cu::stream::destroy(self.s);
            }
        }
    }
}

/// An instantiated CUDA graph (a captured run).
pub struct GraphExec {
    dev: Arc<Device>,
    exec: sys::CUgraphExec,
}

// SAFETY: a driver handle usable from any thread with the context current; launched only under
// the device's run lock.
unsafe impl Send for GraphExec {}
unsafe impl Sync for GraphExec {}

impl Drop for GraphExec {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: destroyed once; no launch of it is pending (runs synchronise).
            let _ = unsafe { cu::graph::exec_destroy(self.exec) };
        }
    }
}

impl Device {
    /// Starts recording the compute stream's work on this thread (instead of running it).
    pub fn begin_capture(&self) -> Result<()> {
        // SAFETY: the stream is live; thread-local mode leaves other threads' calls alone.
        unsafe {
            cu::stream::begin_capture(
                self.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| dev_err("begin capture", e))
    }

    /// Ends a capture and instantiates what was recorded (ending it also when `ok` is false).
    pub fn end_capture(self: &Arc<Self>, ok: bool) -> Result<GraphExec> {
        // SAFETY: a capture was begun on this stream by this thread.
        let graph = unsafe { cu::stream::end_capture(self.stream) }
            .map_err(|e| dev_err("end capture", e))?;
        if !ok {
            // SAFETY: the graph was just made and is destroyed once.
            let _ = unsafe { cu::graph::destroy(graph) };
            return Err(Error::Device("[cuda] capture abandoned".into()));
        }
        // SAFETY: `graph` is a complete captured graph; it is destroyed after instantiation.
        let exec = unsafe {
            let r = cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0));
            let _ = cu::graph::destroy(graph);
            r
        }
        .map_err(|e| dev_err("graph instantiate", e))?;
        Ok(GraphExec {
            dev: self.clone(),
            exec,
        })
    }

    /// Queues one replay of a captured run.
    pub fn launch_graph(&self, g: &GraphExec) -> Result<()> {
        // SAFETY: the graph belongs to this device; its buffers are the ones it was captured
        // with (the caller compares base addresses) and outlive the run.
        unsafe { cu::graph::launch(g.exec, self.stream) }.map_err(|e| dev_err("graph launch", e))
    }
}

/// Page-locked host memory (so a copy from it can be captured in a graph and read at replay).
pub struct Pinned {
    dev: Arc<Device>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain host memory; writes happen under the owning program's `&mut self`.
unsafe impl Send for Pinned {}

impl Pinned {
    pub fn new(dev: Arc<Device>, len: usize) -> Result<Pinned> {
        dev.bind()?;
        // SAFETY: a fresh page-locked allocation of `len` bytes, zeroed below, freed on drop.
        let ptr = unsafe { cu::malloc_host(len.max(1), 0) }
            .map_err(|e| dev_err("pinned allocation", e))? as *mut u8;
        // SAFETY: `ptr` points to at least `len` writable bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Pinned { dev, ptr, len })
    }

    /// Overwrites the first bytes. The caller orders this with the copies that read it.
    pub fn set(&mut self, data: &[u8]) {
        let n = data.len().min(self.len);
        // SAFETY: `n` bytes fit; `&mut self` excludes other writers.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, n) };
    }

    /// Queues a copy of all of it to `dst` on the compute stream (capturable).
    pub fn copy_to(&self, dst: u64) -> Result<()> {
        self.copy_range_to(0, self.len, dst)
    }

    /// Bytes `pos..pos + data.len()` (clamped to the allocation) become `data`. The caller
    /// orders this with the copies that read them.
    pub fn set_at(&mut self, pos: usize, data: &[u8]) {
        let n = data.len().min(self.len.saturating_sub(pos));
        // SAFETY: `pos + n <= len`; `&mut self` excludes other writers.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(pos), n) };
    }

    /// Bytes `pos..pos + out.len()` (clamped to the allocation), as the last synchronised copy
    /// left them.
    pub fn get_at(&self, pos: usize, out: &mut [u8]) {
        let n = out.len().min(self.len.saturating_sub(pos));
        // SAFETY: `pos + n <= len`, initialised (zeroed at allocation).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(pos), out.as_mut_ptr(), n) };
    }

    /// Queues a copy of bytes `pos..pos + len` to `dst` on the compute stream (capturable).
    pub fn copy_range_to(&self, pos: usize, len: usize, dst: u64) -> Result<()> {
        check_range("pinned copy", pos, len, self.len)?;
        // SAFETY: the range lies in the allocation, which lives as long as `self`, and the
        // program holding `self` outlives its runs.
        let src = unsafe { std::slice::from_raw_parts(self.ptr.add(pos), len) };
        // SAFETY: the caller checked the destination range.
        unsafe { cu::memcpy_htod_async(dst, src, self.dev.stream) }
            .map_err(|e| dev_err("copy to GPU", e))
    }
}

impl Pinned {
    /// Queues a copy of `len` bytes at `src` into this memory on the compute stream (capturable).
    pub fn copy_from(&mut self, src: u64) -> Result<()> {
        self.copy_range_from(0, self.len, src)
    }

    /// Queues a copy of `len` bytes at `src` into bytes `pos..pos + len` on the compute stream
    /// (capturable).
    pub fn copy_range_from(&mut self, pos: usize, len: usize, src: u64) -> Result<()> {
        check_range("pinned copy", pos, len, self.len)?;
        // SAFETY: the range lies in the allocation; `&mut self` excludes other users.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(pos), len) };
        // SAFETY: the caller checked the source range and synchronises before reading.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.dev.stream) }
            .map_err(|e| dev_err("copy to host", e))
    }

    /// The bytes, as the last synchronised copy left them.
    pub fn get(&self) -> Vec<u8> {
        // SAFETY: `len` initialised bytes (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: allocated by `malloc_host`, freed once.
            let _ = unsafe { cu::free_host(self.ptr as *mut c_void) };
        }
    }
}
