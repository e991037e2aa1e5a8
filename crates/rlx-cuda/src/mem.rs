//! Device memory: one plain allocation per buffer (arena, weight store, optimizer state, staging),
//! read and written through the device's stream.
use crate::driver::Device;
use rlx_ir::{Error, Result};
use rlx_runtime::backend::check_range;
use rlx_runtime::DeviceBuffer;
use std::sync::Arc;

/// A zero-initialised device allocation. Not host-visible: `host_ptr` is `None`, so the Python
/// layer hands out copies instead of views.
pub struct CudaBuffer {
    dev: Arc<Device>,
    ptr: u64,
    len: usize,
}

impl CudaBuffer {
    pub fn zeroed(dev: Arc<Device>, len: usize) -> Result<CudaBuffer> {
        let ptr = dev.alloc(len)?;
        Ok(CudaBuffer { dev, ptr, len })
    }

    /// The device address of byte 0 (0 for an empty buffer).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The CUDA buffer behind `b`, if it is one.
    pub fn of(b: &dyn DeviceBuffer) -> Option<&CudaBuffer> {
        b.as_any().downcast_ref::<CudaBuffer>()
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        self.dev.free(self.ptr);
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        None
    }

    fn device_ptr(&self) -> Option<(u64, usize)> {
        Some((self.ptr, self.dev.ordinal))
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range("write", offset, data.len(), self.len)?;
        self.dev.write(self.ptr + offset as u64, data)
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("read", offset, out.len(), self.len)?;
        self.dev.read(self.ptr + offset as u64, out)
    }

    fn copy_from(
        &self,
        offset: usize,
        src: &dyn DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range("copy destination", offset, len, self.len)?;
        check_range("copy source", src_offset, len, src.len())?;
        match CudaBuffer::of(src) {
            Some(s) if s.dev.ordinal == self.dev.ordinal => {
                self.dev
                    .copy(self.ptr + offset as u64, s.ptr + src_offset as u64, len)
            }
            Some(_) => Err(Error::Device(
                "copies between two GPUs go through the host: read, then write".into(),
            )),
            None => {
                let mut tmp = vec![0; len];
                src.read(src_offset, &mut tmp)?;
                self.write(offset, &tmp)
            }
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
