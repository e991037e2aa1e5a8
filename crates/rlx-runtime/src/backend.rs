//! The seam every backend implements: buffers, compiling a program, running it.
//!
//! Everything above this file (lowering, executables, Python) is device-neutral. A backend owns
//! allocation, kernels and their choice, launch geometry, batching and synchronisation.
use crate::{Program, Result};
use std::any::Any;
use std::sync::Arc;

/// A device backend (CPU, CUDA, Metal).
pub trait Backend: Send + Sync {
    /// The device name as users write it (`"cpu"`, `"cuda:0"`).
    fn name(&self) -> String;
    /// Byte alignment of every planned tensor (at least 64).
    fn alignment(&self) -> usize;
    /// One zero-filled device allocation of `bytes`.
    fn alloc(&self, bytes: usize) -> Result<Arc<dyn DeviceBuffer>>;
    /// Prepares `program` to run over buffers of the given lengths (indexed by [`crate::Buf`]).
    fn compile(&self, program: &Program, buffer_lens: &[usize]) -> Result<Box<dyn Compiled>>;
    /// A copy engine for host->device and device->device copies off the caller's thread.
    fn copy_engine(&self) -> Result<Arc<CopyEngine>>;
    /// Whether this backend may run node `b` of `graph` at the same time as node `a`, the
    /// computing node just before it, which `b` does not read (the CPU runs two independent
    /// products side by side, one a core). The memory planner then keeps `a`'s inputs live
    /// until `b` is done. By default nodes run one after another.
    fn runs_together(&self, graph: &rlx_ir::Graph, a: rlx_ir::NodeId, b: rlx_ir::NodeId) -> bool {
        let _ = (graph, a, b);
        false
    }
    /// Whether this backend computes integers in int32 only: programs compiled for it get
    /// [`rlx_ir::narrow::narrow_integers`] first, so int64 and bool tensors appear only at
    /// their edges (inputs, outputs), in casts from and to int32. The GPU backends do.
    fn narrows_integers(&self) -> bool {
        false
    }
}

/// Bytes on the host that a copy reads; the engine holds the value until the copy is done.
pub trait HostBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// Where a copy reads from.
#[derive(Clone)]
pub enum CopySrc {
    Host(Arc<dyn HostBytes>),
    Device {
        buffer: Arc<dyn DeviceBuffer>,
        offset: usize,
    },
}

/// Where a copy writes to.
#[derive(Clone)]
pub struct CopyDst {
    pub buffer: Arc<dyn DeviceBuffer>,
    pub offset: usize,
}

/// The copy engine every backend provides.
pub type CopyEngine = dyn rlx_ir::AsyncCopy<Src = CopySrc, Dst = CopyDst>;

/// Checks a copy's source and destination ranges (what `issue` must do before anything else).
pub fn check_copy(src: &CopySrc, dst: &CopyDst, bytes: usize) -> Result<()> {
    match src {
        CopySrc::Host(h) => check_range("copy source", 0, bytes, h.bytes().len())?,
        CopySrc::Device { buffer, offset } => {
            check_range("copy source", *offset, bytes, buffer.len())?
        }
    }
    check_range("copy destination", dst.offset, bytes, dst.buffer.len())
}

/// One device allocation, shared between threads (`Arc`) with writes through `&self`.
///
/// `write`, `read` and `copy_from` are safe, so an implementation must make them race-free with
/// each other: two overlapping calls from two threads may interleave their bytes, but never cause
/// undefined behaviour (the CPU backend copies with atomic byte accesses; a GPU backend orders
/// them on its queue). What they may race with is a running program, whose kernels touch the
/// memory directly: that is excluded by the contract of the `unsafe` [`Compiled::run`].
pub trait DeviceBuffer: Send + Sync + Any {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The host address of byte 0 where the host can see this memory (CPU, Metal shared storage).
    /// Reading or writing through it is `unsafe`: the caller must order its accesses with runs
    /// and copies (zero-copy numpy views leave that to the user, as any shared host array does).
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>>;
    /// The device address of byte 0 and the device's ordinal, where the memory is a GPU's
    /// (CUDA): what a DLPack export hands to other frameworks. `None` elsewhere.
    fn device_ptr(&self) -> Option<(u64, usize)> {
        None
    }
    /// Copies `data` into the buffer at `offset` (bounds-checked).
    fn write(&self, offset: usize, data: &[u8]) -> Result<()>;
    /// Copies bytes at `offset` into `out` (bounds-checked).
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Copies `len` bytes from `src` at `src_offset` to `offset` here (bounds-checked). The
    /// default stages through the host; backends override it with a direct copy.
    fn copy_from(
        &self,
        offset: usize,
        src: &dyn DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        let mut tmp = vec![0; len];
        src.read(src_offset, &mut tmp)?;
        self.write(offset, &tmp)
    }
    fn as_any(&self) -> &dyn Any;
}

/// A program prepared for one backend.
pub trait Compiled: Send {
    /// Runs every instruction in order over `buffers` (indexed by [`crate::Buf`]).
    ///
    /// # Safety
    /// Until it returns, nothing else may access the bytes the program reads or writes in
    /// `buffers`: no other run over them (of this or any other program), no `write`, `read` or
    /// `copy_from` of those bytes, no copy-engine copy into them, and no access through
    /// `host_ptr`. The bytes of a buffer the program does not touch (the other half of a staging
    /// buffer) may be used meanwhile. [`crate::Executable`] guarantees this with its locks: its
    /// own mutex (arena, staging), the weight store's and the optimizer state's run locks, and
    /// waiting for a staged batch's copy before running on it.
    #[allow(unsafe_code)] // declares the contract; the runtime's one call upholds it
    unsafe fn run(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&crate::OptimHyper>,
    ) -> Result<()>;

    /// Device bytes this program keeps besides the buffers it is given (scratch, product
    /// buffers); reported as `workspace_bytes` by [`crate::Executable::memory`].
    fn workspace_bytes(&self) -> usize {
        0
    }

    /// [`Compiled::run`] with the host copies of one step around it: every `writes` entry is
    /// copied into its buffer before the run, every `reads` entry filled from its buffer after
    /// it. The default does exactly that with the buffers' `write` and `read`; a GPU backend
    /// folds the copies into the run's own submission (one wait instead of one per copy).
    ///
    /// # Safety
    /// As for [`Compiled::run`]. The copies' ranges are checked.
    #[allow(unsafe_code)] // same contract as `run`
    unsafe fn run_io(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&crate::OptimHyper>,
        writes: &[HostWrite<'_>],
        reads: &mut [HostRead<'_>],
    ) -> Result<()> {
        for w in writes {
            io_buffer(buffers, w.buf)?.write(w.offset, w.data)?;
        }
        // SAFETY: the caller upholds `run`'s contract for this call.
        unsafe { self.run(buffers, hyper)? };
        for r in reads.iter_mut() {
            io_buffer(buffers, r.buf)?.read(r.offset, r.out)?;
        }
        Ok(())
    }
}

/// Host bytes copied into buffer `buf` (an index into a run's buffers) at `offset` before a run.
pub struct HostWrite<'a> {
    pub buf: usize,
    pub offset: usize,
    pub data: &'a [u8],
}

/// Bytes of buffer `buf` at `offset` copied into `out` after a run.
pub struct HostRead<'a> {
    pub buf: usize,
    pub offset: usize,
    pub out: &'a mut [u8],
}

/// The run's buffer `buf` for a host copy, or a bounds error.
pub fn io_buffer<'b>(buffers: &[&'b dyn DeviceBuffer], buf: usize) -> Result<&'b dyn DeviceBuffer> {
    buffers.get(buf).copied().ok_or_else(|| {
        crate::Error::Bounds(format!(
            "[host copy] buffer {buf} is not one of the run's {} buffers",
            buffers.len()
        ))
    })
}

/// Checks that `offset..offset+len` lies inside a buffer of `size` bytes.
pub fn check_range(what: &str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(crate::Error::Bounds(format!(
            "[{what}] bytes {offset}..{} are outside a buffer of {size} bytes",
            offset.saturating_add(len)
        ))),
    }
}
