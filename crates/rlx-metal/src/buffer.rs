//! The backend's device buffer: one shared-storage GPU buffer seen by the runtime as a
//! `DeviceBuffer` whose `host_ptr` is the memory kernels compute on (zero-copy numpy views).
#![allow(unsafe_code)] // host access to the shared allocation
use crate::gpu::GpuBuffer;
use rlx_ir::Result;
use rlx_runtime::backend::check_range;
use rlx_runtime::DeviceBuffer;
use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

/// A shared buffer (arena, store or staging) of the Metal backend.
pub struct MetalBuffer {
    pub(crate) gpu: Arc<dyn GpuBuffer>,
}

impl MetalBuffer {
    pub fn new(gpu: Arc<dyn GpuBuffer>) -> Self {
        Self { gpu }
    }
    /// The GPU buffer underneath.
    pub fn gpu(&self) -> &Arc<dyn GpuBuffer> {
        &self.gpu
    }
    /// The GPU address of byte `offset` (checked to lie inside the buffer).
    pub fn address(&self, offset: usize) -> Result<u64> {
        check_range("metal address", offset, 0, self.gpu.len())?;
        Ok(self.gpu.gpu_address() + offset as u64)
    }
}

impl DeviceBuffer for MetalBuffer {
    fn len(&self) -> usize {
        self.gpu.len()
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.gpu.contents())
    }
    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range("metal write", offset, data.len(), self.len())?;
        // SAFETY: the range was checked; the caller keeps the runtime's contract that nothing
        // else accesses these bytes meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.gpu.contents().as_ptr().add(offset),
                data.len(),
            )
        };
        Ok(())
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("metal read", offset, out.len(), self.len())?;
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.gpu.contents().as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }
    fn copy_from(
        &self,
        offset: usize,
        src: &dyn DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range("metal copy", offset, len, self.len())?;
        check_range("metal copy source", src_offset, len, src.len())?;
        match src.host_ptr() {
            // SAFETY: both ranges were checked; `copy` allows the two to overlap (same buffer).
            Some(p) => unsafe {
                std::ptr::copy(
                    p.as_ptr().add(src_offset),
                    self.gpu.contents().as_ptr().add(offset),
                    len,
                )
            },
            None => {
                let mut tmp = vec![0; len];
                src.read(src_offset, &mut tmp)?;
                self.write(offset, &tmp)?;
            }
        }
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
