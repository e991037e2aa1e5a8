//! Host memory: the aligned arena allocation and the typed slices kernels see. All `unsafe` of
//! the CPU backend lives here.
use rlx_runtime::backend::check_range;
use rlx_runtime::{DeviceBuffer, Error, Result, TRef};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// One zeroed, 64-byte-aligned host allocation that never moves while it exists.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain bytes with no thread affinity; concurrent access is serialised by
// the runtime's locks (runs, writes) and, for numpy views, is the user's to order, as with any
// shared host array.
unsafe impl Send for CpuBuffer {}
// SAFETY: as above.
unsafe impl Sync for CpuBuffer {}

impl CpuBuffer {
    pub fn zeroed(len: usize) -> Result<CpuBuffer> {
        if len == 0 {
            return Ok(CpuBuffer {
                ptr: NonNull::new(dangling()).expect("dangling() is non-null"),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(len, crate::ALIGN)
            .map_err(|_| Error::Device(format!("cannot allocate {len} bytes on the cpu")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::Device(format!("out of memory allocating {len} bytes")))?;
        Ok(CpuBuffer { ptr, len })
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe {
                dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, crate::ALIGN),
                )
            }
        }
    }
}

impl DeviceBuffer for CpuBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range("write", offset, data.len(), self.len)?;
        // SAFETY: the range is inside the allocation (checked above); `data` is a separate slice
        // (callers never pass a view of this buffer's own range).
        unsafe { std::ptr::copy(data.as_ptr(), self.base().add(offset), data.len()) };
        Ok(())
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("read", offset, out.len(), self.len)?;
        // SAFETY: the range is inside the allocation (checked above).
        unsafe { std::ptr::copy(self.base().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
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
        let Some(from) = src.as_any().downcast_ref::<CpuBuffer>() else {
            let mut tmp = vec![0; len];
            src.read(src_offset, &mut tmp)?;
            return self.write(offset, &tmp);
        };
        // SAFETY: both ranges are inside their allocations (checked above); `ptr::copy` allows
        // the ranges to overlap (same buffer).
        unsafe { std::ptr::copy(from.base().add(src_offset), self.base().add(offset), len) };
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// An address aligned for every element type (`ALIGN` bytes) and non-null, for zero-length
/// allocations and the empty slices into them; never dereferenced. (`[u8; N]` has alignment 1.)
fn dangling() -> *mut u8 {
    #[repr(align(64))]
    struct Aligned;
    const _: () = assert!(std::mem::align_of::<Aligned>() == crate::ALIGN);
    NonNull::<Aligned>::dangling().cast::<u8>().as_ptr()
}

/// The base addresses and lengths of the buffers one run works on.
pub struct Bases {
    bufs: Vec<(*mut u8, usize)>,
}

impl Bases {
    pub fn new(buffers: &[&dyn rlx_runtime::DeviceBuffer], expected: &[usize]) -> Result<Bases> {
        let mut bufs = Vec::with_capacity(buffers.len());
        for (i, b) in buffers.iter().enumerate() {
            let Some(cpu) = b.as_any().downcast_ref::<CpuBuffer>() else {
                if b.is_empty() {
                    // An absent buffer: no tensor has bytes in it, but empty tensors may still
                    // point at it, and an empty slice needs an aligned, non-null pointer.
                    bufs.push((dangling(), 0));
                    continue;
                }
                return Err(Error::Device(
                    "the cpu backend was given a buffer of another device".into(),
                ));
            };
            if expected.get(i).is_some_and(|&e| e != cpu.len) {
                return Err(Error::Device(format!(
                    "buffer {i} changed size since the program was compiled"
                )));
            }
            bufs.push((cpu.base(), cpu.len));
        }
        if bufs.len() < expected.iter().filter(|&&l| l > 0).count() {
            return Err(Error::Device(
                "the program needs more buffers than it was given".into(),
            ));
        }
        Ok(Bases { bufs })
    }

    fn ptr(&self, t: &TRef) -> *mut u8 {
        let (base, len) = self.bufs[t.buf as usize];
        debug_assert!(t.offset + t.bytes() <= len);
        // SAFETY: `CpuProgram::new` checked every TRef lies inside its buffer, and `Bases::new`
        // checked the buffers have the lengths the program was checked against.
        unsafe { base.add(t.offset) }
    }

    /// Read-only elements of `t`.
    ///
    /// # Safety
    /// No `&mut` slice overlapping `t` may be alive. `CpuProgram::new` guarantees that an
    /// instruction's output never overlaps its inputs; kernels take all inputs first, then the output.
    pub unsafe fn get<T: Elem>(&self, t: &TRef) -> &[T] {
        // SAFETY: in bounds (see `ptr`), aligned (offsets are multiples of 64, elements are 4
        // bytes), initialised (buffers are zeroed at allocation), no aliasing `&mut` (caller).
        unsafe { std::slice::from_raw_parts(self.ptr(t) as *const T, t.numel()) }
    }

    /// Writable elements of `t`.
    ///
    /// # Safety
    /// No other slice overlapping `t` may be alive while the result is.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get_mut<T: Elem>(&self, t: &TRef) -> &mut [T] {
        // SAFETY: as in `get`, and the caller guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(t) as *mut T, t.numel()) }
    }
}

/// Element types a kernel may view arena bytes as: 4-byte plain data, any bit pattern valid.
pub trait Elem: Copy + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for i32 {}

/// Whether two references' byte ranges overlap (same buffer only).
pub fn overlaps(a: &TRef, b: &TRef) -> bool {
    a.buf == b.buf && a.offset < b.offset + b.bytes() && b.offset < a.offset + a.bytes()
}
