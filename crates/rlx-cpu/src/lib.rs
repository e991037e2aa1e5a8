//! rlx-cpu: the CPU backend. Host memory is unified memory, so every buffer is host-visible.
#![warn(unsafe_op_in_unsafe_fn)]

mod copy;
mod exec;
mod kernels;
mod mem;
mod pool;
mod train;

use rlx_runtime::{Backend, Compiled, CopyEngine, DeviceBuffer, Program, Result};
use std::sync::Arc;

pub use copy::CpuCopyEngine;
pub use mem::CpuBuffer;
pub use pool::thread_count;

/// Planned tensors start on cache-line multiples that also suit AVX-512 loads.
pub const ALIGN: usize = 64;

/// The CPU backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn alignment(&self) -> usize {
        ALIGN
    }

    fn alloc(&self, bytes: usize) -> Result<Arc<dyn DeviceBuffer>> {
        Ok(Arc::new(CpuBuffer::zeroed(bytes)?))
    }

    fn compile(&self, program: &Program, buffer_lens: &[usize]) -> Result<Box<dyn Compiled>> {
        Ok(Box::new(exec::CpuProgram::new(program, buffer_lens)?))
    }

    fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
        Ok(Arc::new(CpuCopyEngine::new()?))
    }
}
