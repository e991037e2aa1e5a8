//! `rlx_runtime::Backend` for a Metal device: shared-storage allocations and the blit copy
//! engine are real; compiling programs is not done yet and refuses with `UnsupportedError`.
use crate::MetalDevice;
use rlx_ir::{Error, Result};
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
    fn compile(&self, _program: &Program, _buffer_lens: &[usize]) -> Result<Box<dyn Compiled>> {
        Err(Error::Unsupported {
            op: "metal".into(),
            msg: "the Metal backend cannot run programs yet (its buffers, kernels and copy \
                  engine exist; lowering programs to them does not); use device='cpu'"
                .into(),
        })
    }
    fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
        Ok(self.device.copy_engine()?)
    }
}
