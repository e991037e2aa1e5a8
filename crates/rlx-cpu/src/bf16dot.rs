//! The AVX512-BF16 micro-kernel of the bfloat16 GEMM (`kernels/lowp.rs` packs the operands and
//! drives it): `vdpbf16ps` multiplies pairs of bfloat16 values and adds both products to float32
//! accumulators. Whether it runs is decided here, once per process: only when the CPU has
//! AVX512F and AVX512-BF16 (run-time detection) and `RLX_CPU_BF16=avx512bf16` asks for it (or
//! [`force`]). It is opt-in because on the Sapphire Rapids-class Xeon it was measured on it ran
//! at about half the rate of the float32 GEMM on widened operands (the portable path, see
//! BENCHMARKS.md): there `vdpbf16ps` does not outpace two 512-bit float32 FMA ports. CPUs with
//! one 512-bit FMA port may gain from it. `RLX_CPU_ISA=portable` turns
//! it off too. The `unsafe` of calling target-feature code and of its vector loads and stores
//! lives only in this file.
use std::sync::atomic::{AtomicU8, Ordering};

/// Rows of one micro-tile.
pub const MR: usize = 8;
/// Columns of one micro-tile (two vectors of 16 float32).
pub const NR: usize = 32;

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
static CHOSEN: AtomicU8 = AtomicU8::new(UNSET);

/// Whether this CPU has AVX512F and AVX512-BF16.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether bfloat16 GEMMs use the AVX512-BF16 kernel in this process (else they widen the
/// operands to float32 and run the float32 GEMM: the same products, summed in another order).
pub fn in_use() -> bool {
    match CHOSEN.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let is = |var: &str, value: &str| {
                std::env::var(var).is_ok_and(|v| v.eq_ignore_ascii_case(value))
            };
            let on =
                available() && is("RLX_CPU_BF16", "avx512bf16") && !is("RLX_CPU_ISA", "portable");
            let _ = CHOSEN.compare_exchange(
                UNSET,
                if on { ON } else { OFF },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            CHOSEN.load(Ordering::Relaxed) == ON
        }
    }
}

/// Makes later bfloat16 GEMMs use the AVX512-BF16 kernel (`true`, when the CPU has it) or the
/// portable path; returns whether the kernel is now in use.
pub fn force(use_kernel: bool) -> bool {
    let on = use_kernel && available();
    CHOSEN.store(if on { ON } else { OFF }, Ordering::Relaxed);
    on
}

/// The name of the bfloat16 GEMM path in use: `"avx512bf16"` or `"portable"`.
pub fn path_name() -> &'static str {
    if in_use() {
        "avx512bf16"
    } else {
        "portable"
    }
}

/// Proof that the AVX512-BF16 kernel may run on this CPU (made only by [`kernel`]), so one
/// product decides its path once even while another thread calls [`force`].
#[derive(Clone, Copy)]
pub struct Kernel(());

/// The kernel, when it is in use in this process.
pub fn kernel() -> Option<Kernel> {
    in_use().then_some(Kernel(()))
}

impl Kernel {
    /// `tile = A_tile @ B_panel` for one `MR x NR` tile: `a` holds `kp` steps of `MR` pairs
    /// (step `p`, row `r` at `p * MR + r`: the bfloat16 bits of columns `2p` (low half) and
    /// `2p + 1` (high half) of row `r`); `b` holds `kp` steps of `NR` pairs (column `j` at
    /// `p * NR + j`, the same halves for rows `2p`, `2p + 1`). The tile is row-major, `NR`
    /// floats a row, float32 sums of the products.
    #[allow(unused_variables)]
    pub fn tile(self, kp: usize, a: &[u32], b: &[u32], out: &mut [f32; MR * NR]) {
        assert!(a.len() >= kp * MR && b.len() >= kp * NR);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Kernel` exists only when `in_use()` was true, which needs `available()`
        // to have found AVX512F and AVX512-BF16 on this CPU; the assert bounds every load
        // inside `a` and `b`.
        unsafe {
            hw::tile(kp, a, b, out)
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AVX512-BF16 outside x86-64");
    }
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX512F and AVX512-BF16; `a.len() >= kp * MR`, `b.len() >= kp * NR`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn tile(kp: usize, a: &[u32], b: &[u32], out: &mut [f32; MR * NR]) {
        let mut acc = [_mm512_setzero_ps(); 2 * MR];
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        for p in 0..kp {
            // SAFETY: `p < kp`, so `p * NR + 16 + 16 <= kp * NR <= b.len()` and
            // `p * MR + r < kp * MR <= a.len()`; the loads are the unaligned forms. The casts
            // reinterpret 512 bits of pairs as the bfloat16 vector type (same size, any bits
            // are valid).
            unsafe {
                let b0: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(pb.add(p * NR) as *const _));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(pb.add(p * NR + 16) as *const _));
                for r in 0..MR {
                    let x: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*pa.add(p * MR + r) as i32));
                    acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], x, b0);
                    acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], x, b1);
                }
            }
        }
        let po = out.as_mut_ptr();
        for (i, v) in acc.iter().enumerate() {
            // SAFETY: `i < 2 * MR`, so the 16 floats at `i * 16` lie inside the `MR * NR` tile.
            unsafe { _mm512_storeu_ps(po.add(i * 16), *v) };
        }
    }
}
