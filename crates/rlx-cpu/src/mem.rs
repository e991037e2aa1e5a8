//! Host memory: the aligned arena allocation, its race-free byte copies, and the typed slices
//! kernels see. Most of the CPU backend's `unsafe` is here (the rest: `isa.rs` calls
//! target-feature code, `exec.rs` takes the slices of each instruction, `kernels/matmul.rs`
//! calls the GEMM).
use rlx_runtime::backend::check_range;
use rlx_runtime::{DeviceBuffer, Error, Result, TRef};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

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

// Byte copies in and out of a `CpuBuffer`. The buffer's bytes are read and written only as
// aligned `AtomicU64` words with relaxed ordering (a plain 8-byte move on x86 and ARM), so two
// copies that overlap from two threads give some interleaving of words, never undefined
// behaviour; one width only, because mixed-size atomic accesses that race are not allowed
// either. A word only partly inside a copy's range is merged with a compare-exchange, so the
// bytes outside the range are left exactly as they were. Every allocation is padded to whole
// words (`CpuBuffer::zeroed`), so an edge word never reaches past it.

const WORD: usize = 8;

/// The word holding byte `p`, and `p`'s index within it.
fn word_of(p: *const u8) -> (*mut u64, usize) {
    let at = p as usize % WORD;
    (p.wrapping_sub(at) as *mut u64, at)
}

/// Writes `bytes` at byte `at` of the word `w`, leaving its other bytes as they are.
///
/// # Safety
/// `w` is an aligned word inside a live `CpuBuffer` allocation; `at + bytes.len() <= 8`.
unsafe fn merge_into_word(w: *mut u64, at: usize, bytes: &[u8]) {
    // SAFETY: aligned and live (caller); every concurrent access through `&CpuBuffer` is an
    // `AtomicU64` access, and kernels' plain accesses are excluded by `Compiled::run`'s contract.
    let word = unsafe { AtomicU64::from_ptr(w) };
    let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
        let mut b = old.to_ne_bytes();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        Some(u64::from_ne_bytes(b))
    });
}

/// Splits the byte range `p..p + len` into a head (bytes before the first word boundary), the
/// number of whole words, and a tail, each at most partly covering one word.
fn split_words(p: *const u8, len: usize) -> (usize, usize, usize) {
    let head = ((WORD - p as usize % WORD) % WORD).min(len);
    let words = (len - head) / WORD;
    (head, words, len - head - words * WORD)
}

/// Copies `src` into the buffer bytes at `dst`.
///
/// # Safety
/// `dst..dst + src.len()` lies inside one live `CpuBuffer` allocation.
unsafe fn store_bytes(dst: *mut u8, src: &[u8]) {
    let (head, words, tail) = split_words(dst, src.len());
    if head > 0 {
        let (w, at) = word_of(dst);
        // SAFETY: the word holds a byte of the range, so it lies in the padded allocation.
        unsafe { merge_into_word(w, at, &src[..head]) };
    }
    let first = dst.wrapping_add(head) as *mut u64;
    for (i, c) in src[head..head + words * WORD]
        .chunks_exact(WORD)
        .enumerate()
    {
        let v = u64::from_ne_bytes(c.try_into().expect("one word"));
        // SAFETY: an aligned word wholly inside the range (caller); every concurrent access
        // through `&CpuBuffer` is an `AtomicU64` access, and kernels' plain accesses are
        // excluded by `Compiled::run`'s contract.
        unsafe { AtomicU64::from_ptr(first.add(i)) }.store(v, Ordering::Relaxed);
    }
    if tail > 0 {
        let at = head + words * WORD;
        // SAFETY: as for the head; `dst + at` is word-aligned.
        unsafe { merge_into_word(dst.add(at) as *mut u64, 0, &src[at..]) };
    }
}

/// Copies the buffer bytes at `src` into `out`.
///
/// # Safety
/// `src..src + out.len()` lies inside one live `CpuBuffer` allocation.
unsafe fn load_bytes(src: *const u8, out: &mut [u8]) {
    let len = out.len();
    let (head, words, tail) = split_words(src, len);
    // SAFETY (each `load_word` below): an aligned word holding a byte of the range, so inside
    // the padded allocation.
    if head > 0 {
        let (w, at) = word_of(src);
        let v = unsafe { load_word(w) };
        out[..head].copy_from_slice(&v.to_ne_bytes()[at..at + head]);
    }
    let first = src.wrapping_add(head) as *mut u64;
    for (i, c) in out[head..head + words * WORD]
        .chunks_exact_mut(WORD)
        .enumerate()
    {
        // SAFETY: as above.
        c.copy_from_slice(&unsafe { load_word(first.add(i)) }.to_ne_bytes());
    }
    if tail > 0 {
        let at = head + words * WORD;
        // SAFETY: as above; `src + at` is word-aligned.
        let v = unsafe { load_word(src.add(at) as *mut u64) };
        out[at..].copy_from_slice(&v.to_ne_bytes()[..tail]);
    }
}

/// Reads one buffer word.
///
/// # Safety
/// `w` is an aligned word inside a live `CpuBuffer` allocation.
unsafe fn load_word(w: *mut u64) -> u64 {
    // SAFETY: aligned and live (caller); every concurrent access through `&CpuBuffer` is an
    // `AtomicU64` access, and kernels' plain accesses are excluded by `Compiled::run`'s contract.
    unsafe { AtomicU64::from_ptr(w) }.load(Ordering::Relaxed)
}

/// Copies `len` buffer bytes from `src` to `dst`, as `memmove` (the ranges may overlap), through
/// a small bounce buffer: each chunk is read whole before it is written, and chunks go in the
/// direction that never overwrites source bytes not yet read.
///
/// # Safety
/// Both ranges lie inside live `CpuBuffer` allocations.
unsafe fn move_bytes(src: *const u8, dst: *mut u8, len: usize) {
    const CHUNK: usize = 4096;
    let mut tmp = [0u8; CHUNK];
    let mut one = |at: usize| {
        let n = CHUNK.min(len - at);
        // SAFETY: both sub-ranges lie inside their allocations (caller).
        unsafe {
            load_bytes(src.add(at), &mut tmp[..n]);
            store_bytes(dst.add(at), &tmp[..n]);
        }
    };
    let starts = (0..len).step_by(CHUNK);
    if (dst as usize) < (src as usize) {
        starts.for_each(&mut one);
    } else {
        starts.rev().for_each(&mut one);
    }
}

/// The allocated size for `len` bytes: whole words, so that edge words stay inside.
fn padded(len: usize) -> usize {
    len.div_ceil(WORD) * WORD
}

impl CpuBuffer {
    pub fn zeroed(len: usize) -> Result<CpuBuffer> {
        if len == 0 {
            return Ok(CpuBuffer {
                ptr: NonNull::new(dangling()).expect("dangling() is non-null"),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(padded(len), crate::ALIGN)
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
                    Layout::from_size_align_unchecked(padded(self.len), crate::ALIGN),
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

// SAFETY: `Bases` is a table of base addresses; it hands out slices only through the unsafe
// `get`/`get_mut`, whose callers guarantee that no `&mut` slice aliases another live slice. Two
// threads use one `Bases` only for the two instructions of a `schedule::Step::Both`, which the
// schedule pairs only where neither writes a byte the other touches.
unsafe impl Sync for Bases {}

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
        // SAFETY: in bounds (see `ptr`), aligned (offsets are multiples of 64, elements are at
        // most 8 bytes), initialised (buffers are zeroed at allocation), no aliasing `&mut` (caller).
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

/// Element types a kernel may view arena bytes as: plain data of 1, 2, 4 or 8 bytes (at most
/// 8-byte aligned), any bit pattern valid. float16 and bfloat16 are viewed as `u16`, bool as
/// `u8` (kernels write only 0 or 1 there).
pub trait Elem: Copy + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for i32 {}
impl Elem for f64 {}
impl Elem for i64 {}
impl Elem for u8 {}
impl Elem for u16 {}
impl Elem for u32 {}
impl Elem for u64 {}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(len: usize) -> (CpuBuffer, Vec<u8>) {
        let b = CpuBuffer::zeroed(len).unwrap();
        let model: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        b.write(0, &model).unwrap();
        (b, model)
    }

    fn contents(b: &CpuBuffer) -> Vec<u8> {
        let mut out = vec![0; b.len()];
        b.read(0, &mut out).unwrap();
        out
    }

    /// Every alignment of start and end (head, whole words, tail) against a plain byte model:
    /// the bytes in range change, the ones around them do not.
    #[test]
    fn word_copies_touch_exactly_their_range() {
        for len in [1usize, 7, 8, 9, 23, 61] {
            for offset in 0..=13.min(len) {
                for n in 0..=(len - offset).min(20) {
                    let (b, mut model) = filled(len);
                    let data: Vec<u8> = (0..n).map(|i| 200 - i as u8).collect();
                    b.write(offset, &data).unwrap();
                    model[offset..offset + n].copy_from_slice(&data);
                    assert_eq!(contents(&b), model, "write len {len} at {offset} n {n}");
                    let mut part = vec![0; n];
                    b.read(offset, &mut part).unwrap();
                    assert_eq!(part, &model[offset..offset + n], "read at {offset} n {n}");
                }
            }
        }
    }

    /// Overlapping moves in both directions, across the bounce buffer's chunk size, as memmove.
    #[test]
    fn overlapping_moves_are_memmove() {
        let len = 3 * 4096 + 37;
        for (src, dst, n) in [
            (0, 3, 9000),
            (3, 0, 9000),
            (5, 4101, 8000),
            (4101, 5, 8000),
            (1, 2, len - 2),
        ] {
            let (b, mut model) = filled(len);
            b.copy_from(dst, &b, src, n).unwrap();
            model.copy_within(src..src + n, dst);
            assert_eq!(contents(&b), model, "move {src} -> {dst}, {n} bytes");
        }
        // between two buffers
        let (a, model) = filled(100);
        let c = CpuBuffer::zeroed(100).unwrap();
        c.copy_from(3, &a, 10, 61).unwrap();
        let mut want = vec![0; 100];
        want[3..64].copy_from_slice(&model[10..71]);
        assert_eq!(contents(&c), want);
    }
}
