//! Host memory: the aligned arena allocation, its race-free byte copies, and the typed slices
//! kernels see. Most of the CPU backend's `unsafe` is here (the rest: `isa.rs` calls
//! target-feature code, `exec.rs` takes the slices of each instruction, `kernels/matmul.rs`
//! calls the GEMM).
use rlx_runtime::backend::check_range;
use rlx_runtime::{DeviceBuffer, Error, Result, TRef};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

/// One zeroed, 64-byte-aligned host allocation that never moves while it exists.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain bytes with no thread affinity. Through `&self`, `write`, `read` and
// `copy_from` touch the bytes only with atomic byte accesses, so they never race with each
// other; kernels touch them only inside `Compiled::run`, which is `unsafe` and whose caller
// promises that nothing else touches those bytes meanwhile (the runtime's locks); numpy views
// (through `host_ptr`) are the user's to order, as with any shared host array.
unsafe impl Send for CpuBuffer {}
// SAFETY: as above.
unsafe impl Sync for CpuBuffer {}

// Byte copies in and out of a `CpuBuffer`. Each buffer byte is read or written as an `AtomicU8`
// with relaxed ordering (a plain byte move on x86 and ARM), so two copies that overlap from two
// threads give some interleaving of bytes, never undefined behaviour. One width only: mixed-size
// atomic accesses that race are not allowed either.

/// Copies `src` into the buffer bytes at `dst`.
///
/// # Safety
/// `dst..dst + src.len()` lies inside one live `CpuBuffer` allocation.
unsafe fn store_bytes(dst: *mut u8, src: &[u8]) {
    for (i, &v) in src.iter().enumerate() {
        // SAFETY: in bounds (caller); any address is aligned for `AtomicU8`; every concurrent
        // access through `&CpuBuffer` is atomic, and kernels' plain accesses are excluded by
        // `Compiled::run`'s contract.
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(v, Ordering::Relaxed);
    }
}

/// Copies the buffer bytes at `src` into `out`.
///
/// # Safety
/// `src..src + out.len()` lies inside one live `CpuBuffer` allocation.
unsafe fn load_bytes(src: *const u8, out: &mut [u8]) {
    for (i, o) in out.iter_mut().enumerate() {
        // SAFETY: as in `store_bytes`.
        *o = unsafe { AtomicU8::from_ptr(src.add(i) as *mut u8) }.load(Ordering::Relaxed);
    }
}

/// Copies `len` buffer bytes from `src` to `dst`, as `memmove` (the ranges may overlap).
///
/// # Safety
/// Both ranges lie inside live `CpuBuffer` allocations.
unsafe fn move_bytes(src: *const u8, dst: *mut u8, len: usize) {
    let one = |i: usize| {
        // SAFETY: as in `store_bytes`, for both addresses.
        unsafe {
            let v = AtomicU8::from_ptr(src.add(i) as *mut u8).load(Ordering::Relaxed);
            AtomicU8::from_ptr(dst.add(i)).store(v, Ordering::Relaxed);
        }
    };
    if (dst as usize) < (src as usize) {
        (0..len).for_each(one);
    } else {
        (0..len).rev().for_each(one);
    }
}

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
        // SAFETY: the range is inside the allocation (checked above).
        unsafe { store_bytes(self.base().add(offset), data) };
        Ok(())
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("read", offset, out.len(), self.len)?;
        // SAFETY: the range is inside the allocation (checked above).
        unsafe { load_bytes(self.base().add(offset), out) };
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
        // SAFETY: both ranges are inside their allocations (checked above); `move_bytes` allows
        // them to overlap (same buffer).
        unsafe { move_bytes(from.base().add(src_offset), self.base().add(offset), len) };
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
            if b.is_empty() {
                // An absent buffer: no tensor has bytes in it, but empty tensors may still
                // point at it, and an empty slice needs an aligned, non-null pointer.
                bufs.push((dangling(), 0));
                continue;
            }
            // The CPU backend's own buffers, or any other host-visible one (the Metal backend's
            // shared-storage arena: the host-side update runs these kernels over it).
            let base = match b.as_any().downcast_ref::<CpuBuffer>() {
                Some(cpu) => cpu.base(),
                None => match b.host_ptr() {
                    Some(p) if p.as_ptr().cast::<f32>().is_aligned() => p.as_ptr(),
                    _ => {
                        return Err(Error::Device(
                            "the cpu kernels were given a buffer the host cannot address".into(),
                        ))
                    }
                },
            };
            if expected.get(i).is_some_and(|&e| e != b.len()) {
                return Err(Error::Device(format!(
                    "buffer {i} changed size since the program was compiled"
                )));
            }
            bufs.push((base, b.len()));
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
