//! The thin interface between the Metal backend and a GPU: shared-storage buffers, compute
//! work (kernel dispatches and compiled matrix-engine matmuls) on one queue, blit copies on
//! another, shared events. `sys` implements it with Metal
//! on Apple targets; `host` implements it in host memory (kernels compiled by the system C++
//! compiler) so that everything above it builds and is tested on Linux.
use rlx_ir::Result;
use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

/// A buffer the CPU and the GPU share (Metal: `MTLStorageModeShared`).
pub trait GpuBuffer: Send + Sync + Any {
    /// Size in bytes.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The host address of byte 0 (zero-copy: the very memory kernels read and write).
    fn contents(&self) -> NonNull<u8>;
    /// The address kernels use for byte 0 (Metal 3: `gpuAddress`; host: the host address).
    fn gpu_address(&self) -> u64;
    fn as_any(&self) -> &dyn Any;
}

/// A monotonically increasing counter the GPU signals and the host or GPU waits on
/// (Metal: `MTLSharedEvent`).
pub trait GpuEvent: Send + Sync + Any {
    fn signaled_value(&self) -> u64;
    /// Blocks until the value is at least `value`; false if `timeout_ms` passed first.
    fn wait_until(&self, value: u64, timeout_ms: u64) -> bool;
    /// Raises the value to `value` from the host (never lowers it): releases the waiters of a
    /// copy whose own signal will never come because its command buffer failed.
    fn signal(&self, value: u64);
    fn as_any(&self) -> &dyn Any;
}

/// Compiled kernels (Metal: an `MTLLibrary` and its pipelines).
pub trait GpuLibrary: Send + Sync + Any {
    /// Whether the library has a kernel of this name.
    fn has(&self, kernel: &str) -> bool;
    fn as_any(&self) -> &dyn Any;
}

/// One kernel launch: `threads` threads (1-D grid) of kernel `kernel` of `library`, each given
/// the launch record `record` (buffer index 0; GPU addresses inside it name the buffers).
pub struct Dispatch<'a> {
    pub library: &'a dyn GpuLibrary,
    pub kernel: &'a str,
    pub record: &'a [u8],
    pub threads: usize,
}

/// A matmul compiled for one [`crate::matmul::MatmulKey`] (Metal: an `MPSGraphExecutable`).
pub trait GpuMatmul: Send + Sync + Any {
    fn key(&self) -> crate::matmul::MatmulKey;
    fn as_any(&self) -> &dyn Any;
}

/// One engine matmul: `exe` over packed arrays at byte offsets of shared buffers (A, B and the
/// bias, where the key's epilogue has one, read; C written), each spanning
/// `exe.key().bytes()` (the bias `n` floats) from its offset.
pub struct MatmulCall<'a> {
    pub exe: &'a dyn GpuMatmul,
    pub a: (&'a Arc<dyn GpuBuffer>, usize),
    pub b: (&'a Arc<dyn GpuBuffer>, usize),
    pub c: (&'a Arc<dyn GpuBuffer>, usize),
    pub bias: Option<(&'a Arc<dyn GpuBuffer>, usize)>,
}

/// An attention compiled for one [`crate::attention::AttentionKey`] (Metal: an
/// `MPSGraphExecutable`).
pub trait GpuAttention: Send + Sync + Any {
    fn key(&self) -> crate::attention::AttentionKey;
    fn as_any(&self) -> &dyn Any;
}

/// One engine attention: `exe` over packed arrays at byte offsets of shared buffers, in the
/// order of `exe.key().shapes()` (its feeds read, then its results written), each spanning its
/// `exe.key().bytes()` from its offset.
pub struct AttentionCall<'a> {
    pub exe: &'a dyn GpuAttention,
    pub arrays: Vec<(&'a Arc<dyn GpuBuffer>, usize)>,
}

/// One item of a compute submission, run in order after the items before it.
pub enum Work<'a> {
    Kernel(Dispatch<'a>),
    Matmul(MatmulCall<'a>),
    Attention(AttentionCall<'a>),
}

impl Work<'_> {
    /// Whether the item is an engine encode (no compute encoder may be open around it).
    pub fn is_engine(&self) -> bool {
        !matches!(self, Work::Kernel(_))
    }
}

/// One blit copy between shared buffers.
pub struct BlitCopy {
    pub src: Arc<dyn GpuBuffer>,
    pub src_offset: usize,
    pub dst: Arc<dyn GpuBuffer>,
    pub dst_offset: usize,
    pub bytes: usize,
}

impl BlitCopy {
    /// Whether source and destination are overlapping bytes of one buffer: a Metal blit's
    /// result is undefined there, so the copy engine refuses such a copy (and the host
    /// stand-in refuses it too, so tests see what the engine let through).
    pub fn overlaps(&self) -> bool {
        let same = self.src.contents() == self.dst.contents();
        same && self.bytes > 0
            && self.src_offset < self.dst_offset + self.bytes
            && self.dst_offset < self.src_offset + self.bytes
    }
}

/// Work handed to a queue; `finish` blocks until it completed and reports its error.
pub trait Submitted: Send + Sync {
    fn finish(&self) -> Result<()>;
    /// Never blocks: `None` while it runs (or waits to), else what `finish` would return.
    fn poll(&self) -> Option<Result<()>>;
}

/// A device-side wait of a compute submission: its work does not start before `event` reached
/// `value`. `progress`, where given, is called on the host while the wait lasts (between
/// timeouts, where the implementation blocks on it): it raises the event itself once the copy
/// the value stands for failed, whose own signal then never comes.
pub struct EventWait<'a> {
    pub event: Arc<dyn GpuEvent>,
    pub value: u64,
    pub progress: Option<&'a (dyn Fn() + Sync)>,
}

/// A GPU as the backend sees it.
pub trait Gpu: Send + Sync {
    fn name(&self) -> String;
    fn new_buffer(&self, bytes: usize) -> Result<Arc<dyn GpuBuffer>>;
    fn new_event(&self) -> Result<Arc<dyn GpuEvent>>;
    /// Compiles kernel source written in the MSL subset of `crate::kernels` (the backend adds the
    /// dialect's prelude).
    fn compile(&self, source: &str) -> Result<Arc<dyn GpuLibrary>>;
    /// Compiles the matmul of `key` (Metal: an MPSGraph executable; the host GPU runs it with
    /// the GEMM kernel of `library`, the device's kernel library, which Metal does not use).
    fn matmul(
        &self,
        key: crate::matmul::MatmulKey,
        library: &Arc<dyn GpuLibrary>,
    ) -> Result<Arc<dyn GpuMatmul>>;
    /// Compiles the attention of `key` (Metal: an MPSGraph executable; the host GPU computes
    /// it with `crate::attention::reference`).
    fn attention(&self, key: crate::attention::AttentionKey) -> Result<Arc<dyn GpuAttention>>;
    /// Encodes `work` in order on the compute queue, after the queue waited (on the device)
    /// for every wait of `waits`, with `uses` made resident, commits, and returns the
    /// submission.
    fn compute(
        &self,
        waits: &[EventWait<'_>],
        work: &[Work<'_>],
        uses: &[Arc<dyn GpuBuffer>],
    ) -> Result<Box<dyn Submitted>>;
    /// Encodes `copy` on the blit queue followed by a signal of `event` to `value`, commits, and
    /// returns at once.
    fn blit(
        &self,
        copy: BlitCopy,
        event: &Arc<dyn GpuEvent>,
        value: u64,
    ) -> Result<Box<dyn Submitted>>;
}
