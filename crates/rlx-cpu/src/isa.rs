//! Run-time choice of the instruction set the kernels run with. The crate is built for the
//! x86-64 baseline (so a wheel runs on any x86-64 CPU); on CPUs with AVX2 and FMA every kernel
//! call is compiled a second time with those features enabled and chosen once per process by
//! feature detection. `RLX_CPU_ISA=portable` forces the baseline code (`avx2` asks for the AVX2
//! code and falls back to the baseline where the CPU lacks it; unset or `auto` detects).
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

/// Work compiled once per instruction set. `run` must be `#[inline(always)]`, and so must what
/// it calls (the kernel entry points and their loops): LLVM then inlines all of it into each of
/// the two callers in [`dispatch`], so each caller's copy is compiled with its own features. (A
/// plain closure would not do: LLVM declines to inline a large closure into two callers.)
pub(crate) trait Kernel {
    type Out;
    fn run(self) -> Self::Out;
}

/// Any closure as a [`Kernel`]: its body gets the features only where LLVM inlines it, so this is
/// for small bodies (a row loop); whole instructions implement [`Kernel`] themselves.
pub(crate) struct Call<F>(pub F);

impl<R, F: FnOnce() -> R> Kernel for Call<F> {
    type Out = R;
    #[inline(always)]
    fn run(self) -> R {
        (self.0)()
    }
}

/// Runs `k` compiled for the chosen instruction set.
#[inline(always)]
pub(crate) fn dispatch<K: Kernel>(k: K) -> K::Out {
    #[cfg(target_arch = "x86_64")]
    if current() == Isa::Avx2Fma {
        // SAFETY: `current()` is `Avx2Fma` only after `avx2_fma_available()` returned true on
        // this CPU (in `choose` or `force`), which is the one requirement of calling code
        // compiled with `#[target_feature(enable = "avx2,fma")]`.
        return unsafe { with_avx2_fma(k) };
    }
    k.run()
}

/// Shorthand for dispatching a small closure.
#[inline(always)]
pub(crate) fn dispatch_fn<R>(f: impl FnOnce() -> R) -> R {
    dispatch(Call(f))
}

/// `k.run()` compiled with AVX2 and FMA enabled.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn with_avx2_fma<K: Kernel>(k: K) -> K::Out {
    k.run()
}
