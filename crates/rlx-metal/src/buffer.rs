//! The backend's device buffer: one shared-storage GPU buffer seen by the runtime as a
//! `DeviceBuffer` whose `host_ptr` is the memory kernels compute on (zero-copy numpy views),
//! and the fences of the blit copies in flight over its bytes: `read`, `write` and `copy_from`
//! wait (on the host) for the copies whose ranges they touch (`host_ptr` users order their own
//! accesses, as the runtime's contract says).
#![allow(unsafe_code)] // host access to the shared allocation
use crate::copy::Engine;
use crate::gpu::GpuBuffer;
use rlx_ir::Result;
use rlx_runtime::backend::check_range;
use rlx_runtime::DeviceBuffer;
use std::any::Any;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// A blit copy in flight over bytes `start..end` of a buffer: copy `seq` of `engine`.
struct Fence {
    engine: Weak<Engine>,
    seq: u64,
    start: usize,
    end: usize,
}

/// A shared buffer (arena, store or staging) of the Metal backend.
pub struct MetalBuffer {
    pub(crate) gpu: Arc<dyn GpuBuffer>,
    fences: Mutex<Vec<Fence>>,
}

impl MetalBuffer {
    pub fn new(gpu: Arc<dyn GpuBuffer>) -> Self {
        Self {
            gpu,
            fences: Mutex::new(Vec::new()),
        }
    }
    fn fences(&self) -> std::sync::MutexGuard<'_, Vec<Fence>> {
        self.fences.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Records that copy `seq` of `engine` reads or writes `bytes` bytes from `offset` (and
    /// forgets the fences of copies that completed).
    pub(crate) fn fence(&self, engine: &Arc<Engine>, seq: u64, offset: usize, bytes: usize) {
        let mut f = self.fences();
        f.retain(|f| f.engine.upgrade().is_some_and(|e| !e.reached(f.seq)));
        f.push(Fence {
            engine: Arc::downgrade(engine),
            seq,
            start: offset,
            end: offset + bytes,
        });
    }
    /// Waits (on the host) for the copies in flight over bytes `offset..offset + len`. A copy's
    /// own failure is reported at the waits on its token, not here.
    pub fn settle(&self, offset: usize, len: usize) {
        let end = offset.saturating_add(len);
        let hit: Vec<(Arc<Engine>, u64)> = {
            let mut f = self.fences();
            let mut hit = Vec::new();
            f.retain(|f| match f.engine.upgrade() {
                None => false,
                Some(e) if e.reached(f.seq) => false,
                Some(e) if f.start < end && offset < f.end => {
                    hit.push((e, f.seq));
                    false
                }
                Some(_) => true,
            });
            hit
        };
        for (engine, seq) in hit {
            engine.wait_seq(seq);
        }
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
        self.settle(offset, data.len());
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
        self.settle(offset, out.len());
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
        self.settle(offset, len);
        if let Some(s) = src.as_any().downcast_ref::<MetalBuffer>() {
            s.settle(src_offset, len);
        }
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
