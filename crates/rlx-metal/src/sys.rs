//! The Apple-facing part of the Metal backend: `crate::gpu::Gpu` on a Metal device (objc2-metal).
//! Shared-storage buffers (`contents` is the zero-copy host view, `gpuAddress` goes into launch
//! records), a library compiled from MSL source with one pipeline per kernel, one compute queue
//! (dispatches encoded with `setBytes` for the record and `useResource:usage:` for residency,
//! after an optional `encodeWaitForEvent`), and a separate blit queue whose copies signal an
//! `MTLSharedEvent`. Nothing above this module touches Metal.
//!
//! Type-checked for aarch64-apple-darwin in CI; it has not run on Apple hardware.
#![allow(unsafe_code)] // FFI module: Objective-C objects and raw record bytes
use crate::gpu::{BlitCopy, Dispatch, Gpu, GpuBuffer, GpuEvent, GpuLibrary, Submitted};
use crate::host::kernel_names;
use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2_foundation::{NSError, NSString};
use objc2_metal::{
    MTLBlitCommandEncoder, MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder,
    MTLCommandQueue, MTLCompileOptions, MTLComputeCommandEncoder, MTLComputePipelineState,
    MTLCreateSystemDefaultDevice, MTLDevice, MTLLibrary, MTLResourceOptions, MTLResourceUsage,
    MTLSharedEvent, MTLSize,
};
use rlx_ir::{Error, Result};
use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

fn ns_error(what: &str, e: &NSError) -> Error {
    Error::Device(format!("Metal: {what}: {}", e.localizedDescription()))
}

fn missing(what: &str) -> Error {
    Error::Device(format!("Metal: {what} returned nil"))
}

/// A shared-storage `MTLBuffer`.
pub struct SysBuffer {
    buf: Retained<ProtocolObject<dyn MTLBuffer>>,
    len: usize,
}

// SAFETY: Apple documents MTLBuffer as thread-safe to reference from any thread; access to its
// bytes follows the runtime's contract (one user at a time), not this type.
unsafe impl Send for SysBuffer {}
// SAFETY: as above.
unsafe impl Sync for SysBuffer {}

impl GpuBuffer for SysBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn contents(&self) -> NonNull<u8> {
        self.buf.contents().cast::<u8>()
    }
    fn gpu_address(&self) -> u64 {
        self.buf.gpuAddress()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An `MTLSharedEvent`.
pub struct SysEvent {
    ev: Retained<ProtocolObject<dyn MTLSharedEvent>>,
}

// SAFETY: shared events are designed to be signalled and waited on from any thread and queue.
unsafe impl Send for SysEvent {}
// SAFETY: as above.
unsafe impl Sync for SysEvent {}

impl GpuEvent for SysEvent {
    fn signaled_value(&self) -> u64 {
        self.ev.signaledValue()
    }
    fn wait_until(&self, value: u64, timeout_ms: u64) -> bool {
        self.ev.waitUntilSignaledValue_timeoutMS(value, timeout_ms)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A library and one compute pipeline per kernel, built once.
pub struct SysLibrary {
    pipelines: HashMap<String, Retained<ProtocolObject<dyn MTLComputePipelineState>>>,
}

// SAFETY: MTLComputePipelineState objects are immutable and documented as thread-safe.
unsafe impl Send for SysLibrary {}
// SAFETY: as above.
unsafe impl Sync for SysLibrary {}

impl GpuLibrary for SysLibrary {
    fn has(&self, kernel: &str) -> bool {
        self.pipelines.contains_key(kernel)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A committed command buffer and the buffers it must keep alive until it completed.
struct SysSubmitted {
    cb: Retained<ProtocolObject<dyn MTLCommandBuffer>>,
    _keep: Vec<Arc<dyn GpuBuffer>>,
}

// SAFETY: after commit the command buffer is only queried (wait, status, error), which Metal
// allows from any thread.
unsafe impl Send for SysSubmitted {}
// SAFETY: as above.
unsafe impl Sync for SysSubmitted {}

impl Submitted for SysSubmitted {
    fn finish(&self) -> Result<()> {
        self.cb.waitUntilCompleted();
        if self.cb.status() == MTLCommandBufferStatus::Error {
            return Err(match self.cb.error() {
                Some(e) => ns_error("command buffer failed", &e),
                None => Error::Device("Metal: command buffer failed".into()),
            });
        }
        Ok(())
    }
}

/// A Metal device with its compute queue and its blit (copy) queue.
pub struct MetalGpu {
    device: Retained<ProtocolObject<dyn MTLDevice>>,
    compute: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    blit: Retained<ProtocolObject<dyn MTLCommandQueue>>,
}

impl MetalGpu {
    /// The system's default Metal device; a `Device` error where there is none.
    pub fn system_default() -> Result<Self> {
        let device = MTLCreateSystemDefaultDevice()
            .ok_or_else(|| Error::Device("this Mac has no Metal device".into()))?;
        let compute = device
            .newCommandQueue()
            .ok_or_else(|| missing("newCommandQueue"))?;
        let blit = device
            .newCommandQueue()
            .ok_or_else(|| missing("newCommandQueue"))?;
        Ok(Self {
            device,
            compute,
            blit,
        })
    }
}

fn sys_buffer(b: &Arc<dyn GpuBuffer>) -> Result<&SysBuffer> {
    b.as_any()
        .downcast_ref::<SysBuffer>()
        .ok_or_else(|| Error::Internal("a foreign buffer on a Metal device".into()))
}

fn sys_event(e: &Arc<dyn GpuEvent>) -> Result<&SysEvent> {
    e.as_any()
        .downcast_ref::<SysEvent>()
        .ok_or_else(|| Error::Internal("a foreign event on a Metal device".into()))
}

impl Gpu for MetalGpu {
    fn name(&self) -> String {
        format!("metal ({})", self.device.name())
    }
    fn new_buffer(&self, bytes: usize) -> Result<Arc<dyn GpuBuffer>> {
        let buf = self
            .device
            .newBufferWithLength_options(
                bytes.max(1),
                MTLResourceOptions::StorageModeShared
                    | MTLResourceOptions::CPUCacheModeDefaultCache,
            )
            .ok_or_else(|| {
                Error::Device(format!(
                    "Metal: cannot allocate a shared buffer of {bytes} bytes"
                ))
            })?;
        Ok(Arc::new(SysBuffer { buf, len: bytes }))
    }
    fn new_event(&self) -> Result<Arc<dyn GpuEvent>> {
        let ev = self
            .device
            .newSharedEvent()
            .ok_or_else(|| missing("newSharedEvent"))?;
        Ok(Arc::new(SysEvent { ev }))
    }
    fn compile(&self, source: &str) -> Result<Arc<dyn GpuLibrary>> {
        // IEEE semantics (NaN checks, infinities) as the CPU kernels have: no fast math.
        let options = MTLCompileOptions::new();
        #[allow(deprecated)] // `mathMode` replaces it only from macOS 15
        options.setFastMathEnabled(false);
        let lib = self
            .device
            .newLibraryWithSource_options_error(&NSString::from_str(source), Some(&options))
            .map_err(|e| ns_error("kernel source does not compile", &e))?;
        let mut pipelines = HashMap::new();
        for name in kernel_names(source) {
            let f = lib
                .newFunctionWithName(&NSString::from_str(&name))
                .ok_or_else(|| Error::Device(format!("Metal: no function '{name}' in library")))?;
            let p = self
                .device
                .newComputePipelineStateWithFunction_error(&f)
                .map_err(|e| ns_error(&format!("pipeline for '{name}'"), &e))?;
            pipelines.insert(name, p);
        }
        Ok(Arc::new(SysLibrary { pipelines }))
    }
    fn compute(
        &self,
        wait: Option<(&Arc<dyn GpuEvent>, u64)>,
        dispatches: &[Dispatch<'_>],
        uses: &[Arc<dyn GpuBuffer>],
    ) -> Result<Box<dyn Submitted>> {
        let cb = self
            .compute
            .commandBuffer()
            .ok_or_else(|| missing("commandBuffer"))?;
        if let Some((event, value)) = wait {
            let ev = sys_event(event)?;
            cb.encodeWaitForEvent_value(ProtocolObject::from_ref(&*ev.ev), value);
        }
        let enc = cb
            .computeCommandEncoder()
            .ok_or_else(|| missing("computeCommandEncoder"))?;
        for b in uses {
            let b = sys_buffer(b)?;
            enc.useResource_usage(
                ProtocolObject::from_ref(&*b.buf),
                MTLResourceUsage::Read | MTLResourceUsage::Write,
            );
        }
        for d in dispatches {
            let Some(lib) = d.library.as_any().downcast_ref::<SysLibrary>() else {
                enc.endEncoding();
                return Err(Error::Internal(
                    "a foreign library on a Metal device".into(),
                ));
            };
            let Some(p) = lib.pipelines.get(d.kernel) else {
                enc.endEncoding();
                return Err(Error::Internal(format!("no kernel named '{}'", d.kernel)));
            };
            if d.threads == 0 {
                continue;
            }
            enc.setComputePipelineState(p);
            let record = NonNull::new(d.record.as_ptr() as *mut c_void)
                .ok_or_else(|| Error::Internal("empty launch record".into()))?;
            // SAFETY: setBytes copies `record.len()` bytes from a live slice into the command
            // stream at index 0, the index every kernel's record is declared at.
            unsafe { enc.setBytes_length_atIndex(record, d.record.len(), 0) };
            let width = p.maxTotalThreadsPerThreadgroup().clamp(1, 256);
            enc.dispatchThreads_threadsPerThreadgroup(
                MTLSize {
                    width: d.threads,
                    height: 1,
                    depth: 1,
                },
                MTLSize {
                    width,
                    height: 1,
                    depth: 1,
                },
            );
        }
        enc.endEncoding();
        cb.commit();
        Ok(Box::new(SysSubmitted {
            cb,
            _keep: uses.to_vec(),
        }))
    }
    fn blit(
        &self,
        copy: BlitCopy,
        event: &Arc<dyn GpuEvent>,
        value: u64,
    ) -> Result<Box<dyn Submitted>> {
        let ev = sys_event(event)?;
        let (src, dst) = (sys_buffer(&copy.src)?, sys_buffer(&copy.dst)?);
        let cb = self
            .blit
            .commandBuffer()
            .ok_or_else(|| missing("commandBuffer"))?;
        if copy.bytes > 0 {
            let enc = cb
                .blitCommandEncoder()
                .ok_or_else(|| missing("blitCommandEncoder"))?;
            // SAFETY: the copy engine checked both ranges against the buffers' sizes at issue,
            // and both buffers stay alive in the returned submission until it completed.
            unsafe {
                enc.copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size(
                    &src.buf,
                    copy.src_offset,
                    &dst.buf,
                    copy.dst_offset,
                    copy.bytes,
                )
            };
            enc.endEncoding();
        }
        cb.encodeSignalEvent_value(ProtocolObject::from_ref(&*ev.ev), value);
        cb.commit();
        Ok(Box::new(SysSubmitted {
            cb,
            _keep: vec![copy.src, copy.dst],
        }))
    }
}
