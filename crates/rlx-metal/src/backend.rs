//! `rlx_runtime::Backend` for a Metal device: shared-storage allocations, the blit copy engine,
//! and programs lowered by `crate::program` (element-wise float32 instructions so far; any other
//! instruction is refused at compile with `UnsupportedError`).
use crate::MetalDevice;
use rlx_ir::Result;
use rlx_runtime::{Backend, Compiled, CopyEngine, DeviceBuffer, Program};
use std::sync::Arc;

/// The Metal backend over one device (real, or host-emulated in tests).
pub struct MetalBackend {
    device: MetalDevice,
}

impl MetalBackend {
    pub fn new(device: MetalDevice) -> Self {
        Self { device }
    }
    pub fn device(&self) -> &MetalDevice {
        &self.device
    }
}

impl Backend for MetalBackend {
    fn name(&self) -> String {
        "metal".into()
    }
    fn alignment(&self) -> usize {
        256
    }
    fn alloc(&self, bytes: usize) -> Result<Arc<dyn DeviceBuffer>> {
        Ok(self.device.alloc(bytes)?)
    }
    fn compile(&self, program: &Program, buffer_lens: &[usize]) -> Result<Box<dyn Compiled>> {
        Ok(Box::new(crate::program::MetalProgram::new(
            self.device.clone(),
            program,
            buffer_lens,
        )?))
    }
    fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
        Ok(self.device.copy_engine()?)
    }
}
