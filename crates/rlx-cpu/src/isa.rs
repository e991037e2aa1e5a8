//! Run-time choice of the instruction set the kernels run with. The crate is built for the
//! x86-64 baseline (so a wheel runs on any x86-64 CPU); every kernel loop is compiled a second
//! time with AVX2 and FMA enabled, and one of the two is chosen once per process by feature
//! detection. `RLX_CPU_ISA=portable` forces the baseline code; any other value (or none) detects,
//! so `avx2` on a CPU without it runs the baseline. Tests compare the two bit for bit
//! (`tests/isa.rs`, `tests/test_cpu_isa.py`).
//!
//! Both versions run the same Rust source, and Rust never fuses `a * b + c` into an FMA on its
//! own, so they give bit-identical results. The `unsafe` of calling target-feature code lives
//! only in this file.
use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction set a kernel call runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// The target's baseline (x86-64: SSE2); what every other architecture uses.
    Portable,
    /// x86-64 with AVX2 and FMA (every x86 server and desktop CPU since about 2015).
    Avx2Fma,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2Fma => "avx2",
        }
    }
}

const UNSET: u8 = 0;
const PORTABLE: u8 = 1;
const AVX2_FMA: u8 = 2;

/// The choice, made once (from the environment and the CPU) and then read on every kernel call.
static CHOSEN: AtomicU8 = AtomicU8::new(UNSET);

/// Whether this CPU has AVX2 and FMA.
pub fn avx2_fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The instruction set kernels run with in this process.
#[inline]
pub fn current() -> Isa {
    match CHOSEN.load(Ordering::Relaxed) {
        PORTABLE => Isa::Portable,
        AVX2_FMA => Isa::Avx2Fma,
        _ => choose(),
    }
}

#[cold]
fn choose() -> Isa {
    let wanted = std::env::var("RLX_CPU_ISA").unwrap_or_default();
    let isa = if wanted.eq_ignore_ascii_case("portable") || !avx2_fma_available() {
        Isa::Portable
    } else {
        Isa::Avx2Fma
    };
    // Another thread may have chosen first; both read the same environment and CPU, but a
    // `force` wins over detection, so keep whatever is stored by then.
    let code = if isa == Isa::Avx2Fma {
        AVX2_FMA
    } else {
        PORTABLE
    };
    match CHOSEN.compare_exchange(UNSET, code, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => isa,
        Err(_) => current(),
    }
}

/// Makes every later kernel call in this process use `isa` (tests and benchmarks compare the
/// two). Asking for AVX2 on a CPU without it keeps the portable code and returns `false`.
pub fn force(isa: Isa) -> bool {
    let ok = isa == Isa::Portable || avx2_fma_available();
    let code = if ok && isa == Isa::Avx2Fma {
        AVX2_FMA
    } else {
        PORTABLE
    };
    CHOSEN.store(code, Ordering::Relaxed);
    ok
}

/// Runs `f` compiled for the chosen instruction set: `f` is inlined into one of two callers, one
/// of them compiled with AVX2 and FMA. Kernels call this around each loop (a row loop, a chunk of
/// a parallel loop), not around a whole instruction: LLVM inlines a loop-sized closure into both
/// callers, but not an instruction's worth of code, which would then run the baseline code only.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if current() == Isa::Avx2Fma {
        // SAFETY: `current()` is `Avx2Fma` only after `avx2_fma_available()` returned true on
        // this CPU (in `choose` or `force`), which is the one requirement of calling code
        // compiled with `#[target_feature(enable = "avx2,fma")]`.
        return unsafe { with_avx2_fma(f) };
    }
    f()
}

/// `f()` compiled with AVX2 and FMA enabled.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn with_avx2_fma<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Returns `f` unchanged. Lets a kernel name a closure marked `#[inline(always)]` (the attribute
/// is accepted on a closure in argument position, not on a `let`), so that the closure is inlined
/// into the AVX2 copy made by [`dispatch`] rather than called as baseline code from it.
#[inline(always)]
pub(crate) fn inlined<F>(f: F) -> F {
    f
}
