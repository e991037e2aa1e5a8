//! rlx-cuda: the CUDA backend. Device memory is plain allocations (never managed memory), every
//! instruction is a CUDA C kernel compiled by NVRTC for the device's architecture (cached in the
//! process and on disk), matmuls go through cuBLAS at fixed arena offsets (through cuBLASLt
//! where a bias, activation, residual or bias gradient joins the product: `epilogue.rs`), and
//! copies run on a stream of their own.
//!
//! The CUDA libraries are loaded at run time (no CUDA SDK is needed to build): [`available`]
//! says why CUDA cannot be used where it cannot, and [`CudaBackend::new`] fails with that reason
//! instead of panicking. Where `unsafe` lives: `driver.rs`, `lt.rs` and `nccl.rs` (every FFI call, each
//! with a `// SAFETY:` note), plus `exec.rs` implementing the `unsafe` `Compiled::run` and `copy.rs`
//! keeping a host source alive for an asynchronous copy.
//!
//! Environment: `RLX_CUDA_LIB_DIR` adds folders searched for `libnvrtc.so.13` and
//! `libcublas.so.13` (the toolkit and the `nvidia-*` pip packages are searched already);
//! `RLX_CUDA_CACHE` sets (or with `0` turns off) the PTX disk cache; `RLX_CUDA_TF32=1` lets
//! cuBLAS use TF32 tensor cores for float32 matmuls (off by default: float32 stays exact);
//! `RLX_CUDA_LT=epilogue` runs a product with its bias / activation / residual / bias-gradient
//! neighbours as one cuBLASLt call, `=all` sends every other product through cuBLASLt too
//! (the default; `0`: plain cuBLAS, each epilogue a launch of its own); `RLX_CUDA_TUNE=1` times
//! the heuristic's first few algorithms for each cuBLASLt product once per process and keeps
//! the fastest (else the heuristic's first runs).
#![warn(unsafe_op_in_unsafe_fn)]

mod cache;
mod copy;
mod driver;
pub mod epilogue;
mod exec;
mod lt;
mod mem;
pub mod nccl;
/// The lowering, shared with the Metal backend.
pub use rlx_runtime::gpu_plan as plan;
pub mod source;
mod tune;

use rlx_ir::{Error, Result};
use rlx_runtime::{Backend, Compiled, CopyEngine, DeviceBuffer, Program};
use std::sync::Arc;

pub use copy::CudaCopyEngine;
pub use mem::CudaBuffer;

/// Planned tensors start on 256-byte boundaries (what cuBLAS and vector loads like best).
pub const ALIGN: usize = 256;

/// `Ok(number of GPUs)` where the driver, NVRTC and cuBLAS load and a GPU is present, else why
/// not. Probing never panics and is done once per process.
pub fn available() -> std::result::Result<usize, String> {
    driver::probe()?;
    Ok(driver::device_count())
}

/// One GPU. Cheap to clone; every backend of one device shares its context, stream and caches.
#[derive(Clone)]
pub struct CudaBackend {
    dev: Arc<driver::Device>,
}

impl CudaBackend {
    /// The backend of GPU `ordinal`, or a `Device` error saying why it cannot be used.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        Ok(CudaBackend {
            dev: driver::Device::get(ordinal)?,
        })
    }

    /// The GPU's name and architecture (`"NVIDIA H200 (sm_90)"`).
    pub fn describe(&self) -> String {
        format!("{} ({})", self.dev.name, self.dev.arch)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal)
    }

    fn alignment(&self) -> usize {
        ALIGN
    }

    fn alloc(&self, bytes: usize) -> Result<Arc<dyn DeviceBuffer>> {
        Ok(Arc::new(CudaBuffer::zeroed(self.dev.clone(), bytes)?))
    }

    fn compile(&self, program: &Program, buffer_lens: &[usize]) -> Result<Box<dyn Compiled>> {
        Ok(Box::new(exec::CudaProgram::new(
            self.dev.clone(),
            program,
            buffer_lens,
        )?))
    }

    fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
        let stream = driver::Stream::new(self.dev.clone())?;
        Ok(Arc::new(CudaCopyEngine::new(stream)))
    }

    /// Integers are int32 in the kernels; bool and int64 edges are cast (`rlx_cast_b2i`,
    /// `rlx_cast_i2b`, `rlx_cast_i2l`).
    fn narrows_integers(&self) -> bool {
        true
    }
}

/// Adds folders holding Python packages (an interpreter's `sys.path`): their `nvidia/*/lib`
/// folders are searched for NVRTC and cuBLAS. Takes effect if called before the first probe.
pub fn add_package_dirs(dirs: Vec<std::path::PathBuf>) {
    driver::add_package_dirs(dirs)
}

/// The error a `device="cuda"` request gets where CUDA cannot be used.
pub fn unavailable(device: &str) -> Error {
    match available() {
        Err(why) => Error::Device(format!("device '{device}' is not available: {why}")),
        Ok(n) => Error::Device(format!(
            "device '{device}' is not available: {n} GPU(s) found"
        )),
    }
}
