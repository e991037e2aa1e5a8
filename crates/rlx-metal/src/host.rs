//! A host-memory implementation of [`crate::gpu::Gpu`] for Linux tests: buffers are aligned host
//! allocations, kernels are the MSL sources compiled by the system C++ compiler through
//! `msl/compat.h` into a shared library loaded with `dlopen`, a dispatch calls the kernel once per
//! thread index on the caller's thread, an engine matmul runs the GEMM kernel on a record rebuilt
//! from its key alone (so the engine's decisions are checked by the numbers), and the blit queue
//! is a worker thread that copies in issue order and then signals the event. A compute
//! submission's device-side waits block the compute "queue" (the caller's thread) until their
//! event values are reached, before any of its work runs. Tests can hold the blit queue
//! (`hold_blits`) and see the waits each submission encoded (`last_waits`). Not a performance
//! path: it runs the same kernels and the same queue/event ordering as the device does.
#![allow(unsafe_code)] // FFI module: raw allocations and dlopen'ed kernels
use crate::attention::AttentionKey;
use crate::gpu::{
    BlitCopy, EventWait, Gpu, GpuAttention, GpuBuffer, GpuEvent, GpuLibrary, GpuMatmul, Submitted,
    Work,
};
use crate::matmul::MatmulKey;
use rlx_ir::{Error, Result};
use std::alloc::Layout;
use std::any::Any;
use std::ffi::{c_void, CStr, CString};
use std::process::Command;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// The compatibility header that lets MSL kernel sources compile as C++.
pub const COMPAT_H: &str = include_str!("msl/compat.h");

/// The C++ compiler the host kernels are built with: `$RLX_CXX`, `$CXX`, else the first of
/// `c++`, `g++`, `clang++` that runs; `None` when there is none.
pub fn cxx() -> Option<String> {
    let mut names: Vec<String> = Vec::new();
    for var in ["RLX_CXX", "CXX"] {
        if let Ok(v) = std::env::var(var) {
            if !v.is_empty() {
                names.push(v);
            }
        }
    }
    names.extend(["c++", "g++", "clang++"].map(String::from));
    names.into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

const ALIGN: usize = 256;

/// A zeroed, 256-byte-aligned host allocation standing in for a shared `MTLBuffer`.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the allocation is owned by this value; concurrent access to its bytes is governed by
// the same contract as a real shared buffer (the runtime's locks), not by this type.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; the type itself holds no interior state besides the pointer.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn layout(len: usize) -> Result<Layout> {
        Layout::from_size_align(len.max(1), ALIGN)
            .map_err(|e| Error::Device(format!("cannot allocate {len} bytes: {e}")))
    }
    fn new(len: usize) -> Result<Self> {
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| Error::Device(format!("out of host memory allocating {len} bytes")))?;
        Ok(Self { ptr, len })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Ok(layout) = Self::layout(self.len) {
            // SAFETY: allocated in `new` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

impl GpuBuffer for HostBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn contents(&self) -> NonNull<u8> {
        self.ptr
    }
    fn gpu_address(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A shared event: a counter behind a mutex, waited on with a condition variable.
#[derive(Default)]
pub struct HostEvent {
    value: Mutex<u64>,
    changed: Condvar,
}

impl GpuEvent for HostEvent {
    fn signal(&self, value: u64) {
        let mut v = self.value.lock().unwrap_or_else(|p| p.into_inner());
        if value > *v {
            *v = value;
        }
        self.changed.notify_all();
    }
    fn signaled_value(&self) -> u64 {
        *self.value.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn wait_until(&self, value: u64, timeout_ms: u64) -> bool {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let mut v = self.value.lock().unwrap_or_else(|p| p.into_inner());
        while *v < value {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            v = self
                .changed
                .wait_timeout(v, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Kernels compiled to a shared library (a `dlopen` handle, closed on drop).
pub struct HostLibrary {
    handle: NonNull<c_void>,
    names: Vec<String>,
}

// SAFETY: a dlopen handle may be used and closed from any thread.
unsafe impl Send for HostLibrary {}
// SAFETY: as above; `dlsym` is thread-safe.
unsafe impl Sync for HostLibrary {}

type KernelFn = unsafe extern "C" fn(*const u64, u32);

impl HostLibrary {
    fn open(path: &std::path::Path, names: Vec<String>) -> Result<Self> {
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::Device(format!("bad library path {path:?}")))?;
        // SAFETY: `c` is a NUL-terminated path; the library is our kernel build, whose only
        // initialisers are the C++ runtime's.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        let handle = NonNull::new(handle).ok_or_else(|| {
            Error::Device(format!("cannot load host kernels {path:?}: {}", dl_error()))
        })?;
        Ok(Self { handle, names })
    }
    fn kernel(&self, name: &str) -> Result<KernelFn> {
        let c = CString::new(name).map_err(|_| Error::Internal(format!("kernel name {name:?}")))?;
        // SAFETY: a live handle and a NUL-terminated name.
        let sym = unsafe { libc::dlsym(self.handle.as_ptr(), c.as_ptr()) };
        if sym.is_null() {
            return Err(Error::Internal(format!("kernel '{name}': {}", dl_error())));
        }
        // SAFETY: every kernel has the signature `extern "C" void k(const Record&, uint)` (the
        // compat header's `kernel`), which is this function pointer type.
        Ok(unsafe { std::mem::transmute::<*mut c_void, KernelFn>(sym) })
    }
}

impl Drop for HostLibrary {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and no kernel of it runs any more (dispatches
        // borrow the library).
        unsafe { libc::dlclose(self.handle.as_ptr()) };
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl GpuLibrary for HostLibrary {
    fn has(&self, kernel: &str) -> bool {
        self.names.iter().any(|n| n == kernel)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The kernel names a source defines (`kernel void NAME(`).
pub fn kernel_names(source: &str) -> Vec<String> {
    source
        .split("kernel void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .collect()
}

struct Done(Mutex<Option<Result<()>>>, Condvar);

impl Done {
    fn new() -> Arc<Self> {
        Arc::new(Done(Mutex::new(None), Condvar::new()))
    }
    fn set(&self, r: Result<()>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        self.1.notify_all();
    }
}

struct HostSubmitted(Arc<Done>);

impl Submitted for HostSubmitted {
    fn finish(&self) -> Result<()> {
        let mut g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        while g.is_none() {
            g = self.0 .1.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.clone().unwrap_or(Ok(()))
    }
    fn poll(&self) -> Option<Result<()>> {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A compiled engine matmul of the host GPU: its key and the library whose GEMM kernel runs it.
pub struct HostMatmul {
    key: MatmulKey,
    library: Arc<dyn GpuLibrary>,
}

impl GpuMatmul for HostMatmul {
    fn key(&self) -> MatmulKey {
        self.key
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A compiled engine attention of the host GPU: its key (computed by
/// `crate::attention::reference` from the key alone).
pub struct HostAttention {
    key: AttentionKey,
}

impl GpuAttention for HostAttention {
    fn key(&self) -> AttentionKey {
        self.key
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The floats of `bytes` bytes of `buf` from `off`, checked to lie inside it.
fn floats_at((buf, off): (&Arc<dyn GpuBuffer>, usize), bytes: usize) -> Result<*mut f32> {
    if off.checked_add(bytes).is_none_or(|end| end > buf.len()) || off / 4 * 4 != off {
        return Err(Error::Internal(format!(
            "engine array of {bytes} bytes at {off} past a buffer of {} (or misaligned)",
            buf.len()
        )));
    }
    // SAFETY: in bounds (checked above).
    Ok(unsafe { buf.contents().as_ptr().add(off) }.cast::<f32>())
}

/// Runs `threads` threads of `kernel` of `library` on the calling thread, one after another.
fn dispatch(library: &dyn GpuLibrary, kernel: &str, record: &[u8], threads: usize) -> Result<()> {
    let lib = library
        .as_any()
        .downcast_ref::<HostLibrary>()
        .ok_or_else(|| Error::Internal("a foreign library on the host GPU".into()))?;
    if !lib.has(kernel) {
        return Err(Error::Internal(format!("no kernel named '{kernel}'")));
    }
    let threads = u32::try_from(threads).map_err(|_| Error::Unsupported {
        op: kernel.into(),
        msg: format!("{threads} threads exceed a 32-bit grid"),
    })?;
    // The record is copied to an aligned block, as setBytes gives the kernel.
    let mut rec = vec![0u64; record.len().div_ceil(8)];
    // SAFETY: `rec` has at least `record.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(record.as_ptr(), rec.as_mut_ptr().cast::<u8>(), record.len())
    };
    let f = lib.kernel(kernel)?;
    for t in 0..threads {
        // SAFETY: the record's addresses were built by the caller from live buffers and the
        // kernel bounds-checks its thread index against the record's sizes.
        unsafe { f(rec.as_ptr(), t) };
    }
    Ok(())
}

/// A queued copy: the copy, the event and value it signals, its completion, and whether it is
/// to fail (an injected failure: nothing copied, no signal, as a command buffer that errors).
type BlitJob = (BlitCopy, Arc<dyn GpuEvent>, u64, Arc<Done>, bool);

/// Whether the blit queue is held (tests: a copy that has not run yet, for as long as needed).
#[derive(Default)]
struct Gate {
    held: Mutex<bool>,
    changed: Condvar,
}

impl Gate {
    fn set(&self, held: bool) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = held;
        self.changed.notify_all();
    }
    fn pass(&self) {
        let mut h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        while *h {
            h = self.changed.wait(h).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// One device-side wait of a compute submission: the value waited for, and whether the event
/// had already reached it when the submission was made (false: the queue really waited).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordedWait {
    pub value: u64,
    pub reached_at_submit: bool,
}

/// The host GPU: a compute "queue" on the caller's thread and a blit queue on a worker thread.
pub struct HostGpu {
    cxx: String,
    blits: Mutex<mpsc::Sender<BlitJob>>,
    worker: Mutex<Option<thread::JoinHandle<()>>>,
    gate: Arc<Gate>,
    last_waits: Mutex<Vec<RecordedWait>>,
    /// How many of the next blits fail.
    failing: AtomicU64,
}

static LIB_SEQ: AtomicU64 = AtomicU64::new(0);

impl HostGpu {
    /// A host GPU whose kernels are compiled by `cxx()`; a `Device` error when there is no C++
    /// compiler.
    pub fn new() -> Result<Self> {
        let cxx = cxx().ok_or_else(|| {
            Error::Device(
                "the host-emulated Metal device needs a C++ compiler (c++, g++ or clang++; or set \
                 RLX_CXX)"
                    .into(),
            )
        })?;
        let (tx, rx) = mpsc::channel::<BlitJob>();
        let gate = Arc::new(Gate::default());
        let held = gate.clone();
        let worker = thread::Builder::new()
            .name("rlx-metal-host-blit".into())
            .spawn(move || {
                for (copy, event, value, done, fail) in rx {
                    held.pass();
                    if fail {
                        done.set(Err(Error::Device(
                            "host blit queue: injected command buffer failure".into(),
                        )));
                        continue;
                    }
                    // SAFETY: the engine checked both ranges at issue and keeps both buffers
                    // alive (they are in `copy`) until this job is done; `blit` refused a copy
                    // whose ranges overlap (as Metal does not define one).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            copy.src.contents().as_ptr().add(copy.src_offset),
                            copy.dst.contents().as_ptr().add(copy.dst_offset),
                            copy.bytes,
                        );
                    }
                    drop(copy);
                    done.set(Ok(()));
                    event.signal(value);
                }
            })
            .map_err(|e| Error::Device(format!("cannot start the host blit queue: {e}")))?;
        Ok(Self {
            cxx,
            blits: Mutex::new(tx),
            worker: Mutex::new(Some(worker)),
            gate,
            last_waits: Mutex::default(),
            failing: AtomicU64::new(0),
        })
    }

    /// Holds the blit queue (`true`: copies issued stay queued, not run) or lets it go on.
    pub fn hold_blits(&self, hold: bool) {
        self.gate.set(hold);
    }

    /// Makes the next `n` blits fail as a command buffer that errors does: nothing is copied,
    /// the event is not signalled, the submission reports an error.
    pub fn fail_next_blits(&self, n: u64) {
        self.failing.store(n, Ordering::SeqCst);
    }

    /// The device-side waits of the last compute submission, in the order it encoded them.
    pub fn last_waits(&self) -> Vec<RecordedWait> {
        self.last_waits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for HostGpu {
    fn drop(&mut self) {
        self.gate.set(false);
        // Closing the channel ends the worker after the queued copies.
        let (tx, _) = mpsc::channel();
        *self.blits.lock().unwrap_or_else(|p| p.into_inner()) = tx;
        if let Some(w) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = w.join();
        }
    }
}

impl Gpu for HostGpu {
    fn name(&self) -> String {
        "metal (host emulation)".into()
    }
    fn new_buffer(&self, bytes: usize) -> Result<Arc<dyn GpuBuffer>> {
        Ok(Arc::new(HostBuffer::new(bytes)?))
    }
    fn new_event(&self) -> Result<Arc<dyn GpuEvent>> {
        Ok(Arc::new(HostEvent::default()))
    }
    fn compile(&self, source: &str) -> Result<Arc<dyn GpuLibrary>> {
        let dir = std::env::temp_dir().join(format!(
            "rlx-metal-host-{}-{}",
            std::process::id(),
            LIB_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let io = |e: std::io::Error| Error::Device(format!("host kernel build in {dir:?}: {e}"));
        std::fs::create_dir_all(&dir).map_err(io)?;
        let src = dir.join("kernels.cpp");
        let so = dir.join("kernels.so");
        std::fs::write(
            &src,
            format!("{COMPAT_H}\n#line 1 \"kernels.metal\"\n{source}"),
        )
        .map_err(io)?;
        let out = Command::new(&self.cxx)
            .args([
                "-std=c++17",
                "-O2",
                "-shared",
                "-fPIC",
                "-Wno-attributes",
                "-o",
            ])
            .arg(&so)
            .arg(&src)
            .output()
            .map_err(io)?;
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(Error::Device(format!(
                "kernel source does not compile ({}):\n{}",
                self.cxx,
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let lib = HostLibrary::open(&so, kernel_names(source));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(Arc::new(lib?))
    }
    fn matmul(&self, key: MatmulKey, library: &Arc<dyn GpuLibrary>) -> Result<Arc<dyn GpuMatmul>> {
        if !library.has("rlx_gemm_f32") {
            return Err(Error::Internal(
                "the host matmul needs the library's GEMM kernel".into(),
            ));
        }
        Ok(Arc::new(HostMatmul {
            key,
            library: library.clone(),
        }))
    }
    fn attention(&self, key: AttentionKey) -> Result<Arc<dyn GpuAttention>> {
        Ok(Arc::new(HostAttention { key }))
    }
    fn compute(
        &self,
        waits: &[EventWait<'_>],
        work: &[Work<'_>],
        _uses: &[Arc<dyn GpuBuffer>],
    ) -> Result<Box<dyn Submitted>> {
        let recorded = waits
            .iter()
            .map(|w| RecordedWait {
                value: w.value,
                reached_at_submit: w.event.signaled_value() >= w.value,
            })
            .collect();
        *self.last_waits.lock().unwrap_or_else(|p| p.into_inner()) = recorded;
        for w in waits {
            if w.event.as_any().downcast_ref::<HostEvent>().is_none() {
                return Err(Error::Internal("a foreign event on the host GPU".into()));
            }
            // The device-side wait: this queue does not start the work before the value (the
            // caller's thread is the queue here, so it also runs the host's `progress`).
            while !w.event.wait_until(w.value, 20) {
                if let Some(p) = w.progress {
                    p();
                }
            }
        }
        for w in work {
            match w {
                Work::Kernel(d) => dispatch(d.library, d.kernel, d.record, d.threads)?,
                Work::Attention(call) => {
                    let att = call
                        .exe
                        .as_any()
                        .downcast_ref::<HostAttention>()
                        .ok_or_else(|| {
                            Error::Internal("a foreign attention on the host GPU".into())
                        })?;
                    let key = att.key;
                    let bytes = key.bytes();
                    if call.arrays.len() != bytes.len() {
                        return Err(Error::Internal(format!(
                            "an engine attention of {} arrays, not {}",
                            call.arrays.len(),
                            bytes.len()
                        )));
                    }
                    let mut feeds = Vec::with_capacity(key.feeds());
                    for (&at, &n) in call.arrays.iter().zip(&bytes).take(key.feeds()) {
                        let p = floats_at(at, n)?;
                        // SAFETY: `n` bytes from `p` lie inside a live buffer (checked).
                        feeds.push(unsafe { std::slice::from_raw_parts(p, n / 4) }.to_vec());
                    }
                    let feeds: Vec<&[f32]> = feeds.iter().map(Vec::as_slice).collect();
                    let mut results: Vec<Vec<f32>> = bytes[key.feeds()..]
                        .iter()
                        .map(|n| vec![0f32; n / 4])
                        .collect();
                    crate::attention::reference(&key, &feeds, &mut results);
                    for (&at, r) in call.arrays[key.feeds()..].iter().zip(&results) {
                        let o = floats_at(at, r.len() * 4)?;
                        // SAFETY: as above; no other reference to these bytes is live.
                        unsafe { std::ptr::copy_nonoverlapping(r.as_ptr(), o, r.len()) };
                    }
                }
                Work::Matmul(call) => {
                    let mm = call
                        .exe
                        .as_any()
                        .downcast_ref::<HostMatmul>()
                        .ok_or_else(|| {
                            Error::Internal("a foreign matmul on the host GPU".into())
                        })?;
                    // The same product from the key alone, on the GEMM kernel.
                    let [ab, bb, cb] = mm.key.bytes();
                    let at = |(buf, off): (&Arc<dyn GpuBuffer>, usize), bytes: usize| {
                        if off + bytes > buf.len() {
                            return Err(Error::Internal(format!(
                                "engine array of {bytes} bytes at {off} past a buffer of {}",
                                buf.len()
                            )));
                        }
                        Ok(buf.gpu_address() + off as u64)
                    };
                    let g = mm
                        .key
                        .as_gemm(at(call.a, ab)?, at(call.b, bb)?, at(call.c, cb)?);
                    let (record, threads) = g.record()?;
                    dispatch(mm.library.as_ref(), "rlx_gemm_f32", &record, threads)?;
                    let e = mm.key.epilogue;
                    if !e.is_none() {
                        let n = mm.key.n;
                        let bias = match (e.bias, call.bias) {
                            (true, Some(b)) => Some(at(b, n * 4)? as usize as *const f32),
                            (false, None) => None,
                            _ => {
                                return Err(Error::Internal(
                                    "an engine matmul's bias does not match its key".into(),
                                ))
                            }
                        };
                        let c = at(call.c, cb)? as usize as *mut f32;
                        for i in 0..cb / 4 {
                            // SAFETY: C spans `cb` bytes and the bias `n` floats inside their
                            // buffers (checked by `at`); the GEMM above has completed.
                            unsafe {
                                let mut v = *c.add(i);
                                if let Some(b) = bias {
                                    v += *b.add(i % n);
                                }
                                if let Some(act) = e.act {
                                    v = act.apply(v);
                                }
                                *c.add(i) = v;
                            }
                        }
                    }
                }
            }
        }
        let done = Done::new();
        done.set(Ok(()));
        Ok(Box::new(HostSubmitted(done)))
    }
    fn blit(
        &self,
        copy: BlitCopy,
        event: &Arc<dyn GpuEvent>,
        value: u64,
    ) -> Result<Box<dyn Submitted>> {
        if event.as_any().downcast_ref::<HostEvent>().is_none() {
            return Err(Error::Internal("a foreign event on the host GPU".into()));
        }
        // Not hidden by a memmove here: Metal leaves such a blit undefined.
        if copy.overlaps() {
            return Err(Error::Internal(
                "a blit between overlapping ranges of one buffer (undefined on Metal)".into(),
            ));
        }
        let fail = self
            .failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let done = Done::new();
        self.blits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((copy, event.clone(), value, done.clone(), fail))
            .map_err(|_| Error::Device("the host blit queue has stopped".into()))?;
        Ok(Box::new(HostSubmitted(done)))
    }
}
