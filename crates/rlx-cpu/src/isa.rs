//! Run-time choice of the instruction set the kernels run with. The crate is built for the
//! x86-64 baseline (so a wheel runs on any x86-64 CPU); every kernel loop is compiled twice more,
//! with AVX2 and FMA enabled and with AVX-512F on top (512-bit vectors: half the instructions
//! for the same work, which made exp and GELU twice as fast even on a CPU that splits them into
//! two 256-bit halves), and one of the three is chosen once per process by feature detection.
//! `RLX_CPU_ISA=portable` forces the baseline code and `RLX_CPU_ISA=avx2` the AVX2 code (where
//! the CPU has it); any other value (or none) takes the widest the CPU has. Tests compare them
//! bit for bit (`tests/isa.rs`, `tests/test_cpu_isa.py`).
//!
//! Every version runs the same Rust source, and Rust never fuses `a * b + c` into an FMA or
//! reorders a floating-point sum on its own, so they give bit-identical results. Where a kernel
//! asks for a fused multiply-add (`mul_add`, in `kernels::math`), the AVX2 and AVX-512 copies
//! use the instruction and the portable copy the C library's `fmaf`, both rounded once, exactly,
//! so the bits still agree. The `unsafe` of calling target-feature code lives only in this file.
use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction set a kernel call runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// The target's baseline (x86-64: SSE2); what every other architecture uses.
    Portable,
    /// x86-64 with AVX2 and FMA (every x86 server and desktop CPU since about 2015).
    Avx2Fma,
    /// [`Isa::Avx2Fma`] and AVX-512F (Intel server CPUs since 2017, AMD since Zen 4).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2Fma => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether this set includes AVX2 and FMA (true for [`Isa::Avx512`] too).
    pub fn has_avx2(self) -> bool {
        self != Isa::Portable
    }
}

const UNSET: u8 = 0;
const PORTABLE: u8 = 1;
const AVX2_FMA: u8 = 2;
const AVX512: u8 = 3;

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

/// Whether this CPU has AVX-512F as well as AVX2 and FMA.
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_fma_available() && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn code(isa: Isa) -> u8 {
    match isa {
        Isa::Portable => PORTABLE,
        Isa::Avx2Fma => AVX2_FMA,
        Isa::Avx512 => AVX512,
    }
}

/// The instruction set kernels run with in this process.
#[inline]
pub fn current() -> Isa {
    match CHOSEN.load(Ordering::Relaxed) {
        PORTABLE => Isa::Portable,
        AVX2_FMA => Isa::Avx2Fma,
        AVX512 => Isa::Avx512,
        _ => choose(),
    }
}

#[cold]
fn choose() -> Isa {
    let wanted = std::env::var("RLX_CPU_ISA")
        .unwrap_or_default()
        .to_ascii_lowercase();
    let isa = if wanted == "portable" || !avx2_fma_available() {
        Isa::Portable
    } else if wanted == "avx2" || !avx512_available() {
        Isa::Avx2Fma
    } else {
        Isa::Avx512
    };
    // Another thread may have chosen first; both read the same environment and CPU, but a
    // `force` wins over detection, so keep whatever is stored by then.
    match CHOSEN.compare_exchange(UNSET, code(isa), Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => isa,
        Err(_) => current(),
    }
}

/// Makes every later kernel call in this process use `isa` (tests and benchmarks compare the
/// three). Asking for a set the CPU lacks keeps the portable code and returns `false`.
pub fn force(isa: Isa) -> bool {
    let ok = match isa {
        Isa::Portable => true,
        Isa::Avx2Fma => avx2_fma_available(),
        Isa::Avx512 => avx512_available(),
    };
    CHOSEN.store(
        code(if ok { isa } else { Isa::Portable }),
        Ordering::Relaxed,
    );
    ok
}

/// Runs `f` compiled for the chosen instruction set: `f` is inlined into one of three callers,
/// compiled for the baseline, with AVX2 and FMA, and with AVX-512F too. Kernels call this around each loop (a row loop, a chunk of
/// a parallel loop), not around a whole instruction: LLVM inlines a loop-sized closure into both
/// callers, but not an instruction's worth of code, which would then run the baseline code only.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match current() {
        // SAFETY: `current()` is `Avx512` only after `avx512_available()` returned true on this
        // CPU (in `choose` or `force`), which is the one requirement of calling code compiled
        // with `#[target_feature(enable = "avx512f,avx2,fma")]`.
        Isa::Avx512 => return unsafe { with_avx512(f) },
        // SAFETY: `current()` is `Avx2Fma` only after `avx2_fma_available()` returned true on
        // this CPU (in `choose` or `force`), which is the one requirement of calling code
        // compiled with `#[target_feature(enable = "avx2,fma")]`.
        Isa::Avx2Fma => return unsafe { with_avx2_fma(f) },
        Isa::Portable => {}
    }
    f()
}

/// `f()` compiled with AVX-512F (and AVX2 and FMA) enabled.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
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
