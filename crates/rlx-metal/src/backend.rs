//! `rlx_runtime::Backend` for a Metal device: shared-storage allocations, the blit copy engine,
//! and programs run by `crate::program` (every instruction the CPU backend runs; the training
//! update on the host, by the function the backend is given).
use crate::MetalDevice;
use rlx_ir::Result;
use rlx_runtime::{Backend, Compiled, CopyEngine, DeviceBuffer, OptimHyper, Program, UpdatePlan};
use std::sync::Arc;

/// Runs a training update in place on the host over host-visible buffers, checking it first
/// against buffers of the given lengths: `rlx_cpu::host_update`, passed in by whoever builds
/// the backend (rlx-metal does not depend on the CPU backend, whose x86_64 build needs a newer
/// Rust than rlx-metal's 1.85).
///
/// # Safety (of calling it)
/// As `Compiled::run`: nothing else touches the buffers' bytes during the call.
pub type HostUpdate =
    unsafe fn(&[&dyn DeviceBuffer], &[usize], &UpdatePlan, Option<&OptimHyper>) -> Result<()>;

/// The Metal backend over one device (real, or host-emulated in tests).
pub struct MetalBackend {
    device: MetalDevice,
    host_update: HostUpdate,
}

impl MetalBackend {
    pub fn new(device: MetalDevice, host_update: HostUpdate) -> Self {
        Self {
            device,
            host_update,
        }
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
            self.host_update,
        )?))
    }
    fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
        Ok(self.device.copy_engine()?)
    }
}
