//! The AVX-512F micro-kernel: a 14 x 32 tile of C in 28 zmm accumulators; per depth index two
//! vector loads of the packed B panel and 14 broadcasts of the packed A panel feed 28 FMAs.
//! Edge tiles (fewer rows or columns) run the same loop on the zero-padded panels and store
//! through AVX-512 masks. The `unsafe` of the target-feature code and of its raw loads and
//! stores lives only here (and in `avx2.rs` for the AVX2 kernel).
use super::{ASrc, Micro};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

const MR: usize = 14;
const NR: usize = 32;

/// Whether this CPU has AVX-512F.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The AVX-512F kernel.
pub struct Kernel;

impl Micro for Kernel {
    const MR: usize = MR;
    const NR: usize = NR;
    const COLS_IN_PLACE: bool = true;

    unsafe fn block(
        kc: usize,
        mc: usize,
        nc: usize,
        a: ASrc,
        pb: &[f32],
        c: *mut f32,
        rs: usize,
        beta: f32,
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller guarantees AVX-512F and the validity of `c` (the trait's contract).
        unsafe {
            block(kc, mc, nc, a, pb, c, rs, beta)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (a, c);
            unreachable!(
                "the AVX-512 GEMM kernel runs only on x86-64 ({kc} {mc} {nc} {pb:?} {rs} {beta})"
            )
        }
    }
}

/// See [`Micro::block`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn block(
    kc: usize,
    mc: usize,
    nc: usize,
    a: ASrc,
    pb: &[f32],
    c: *mut f32,
    rs: usize,
    beta: f32,
) {
    let (tiles, panels) = (mc.div_ceil(MR), nc.div_ceil(NR));
    assert!(pb.len() >= panels * NR * kc);
    match a {
        ASrc::Packed(pa) => assert!(pa.len() >= tiles * MR * kc),
        ASrc::Rows(ra, ars) => assert!(mc / MR * MR == mc && (mc - 1) * ars + kc <= ra.len()),
        ASrc::Cols(ca, acs) => assert!(mc / MR * MR == mc && (kc - 1) * acs + mc <= ca.len()),
    }
    // One tile of A rows stays in L1 while the packed B panels stream by from L2.
    for t in 0..tiles {
        let rows = MR.min(mc - t * MR);
        for q in 0..panels {
            let cols = NR.min(nc - q * NR);
            let b = pb[q * NR * kc..].as_ptr();
            // SAFETY: AVX-512F is enabled here; the panels hold `kc` depth indices each
            // (asserted above); C's rows `t * MR + i < mc` and columns `q * NR + j < nc` are
            // valid by the caller's contract.
            unsafe {
                let c = c.add(t * MR * rs + q * NR);
                match a {
                    ASrc::Packed(pa) => {
                        let pa = pa[t * MR * kc..].as_ptr();
                        // A short edge tile computes only the rows it has (rounded up).
                        match rows {
                            1 => tile::<PACKED, 1>(kc, pa, 0, b, c, rs, beta, rows, cols),
                            2 => tile::<PACKED, 2>(kc, pa, 0, b, c, rs, beta, rows, cols),
                            3 | 4 => tile::<PACKED, 4>(kc, pa, 0, b, c, rs, beta, rows, cols),
                            5 | 6 => tile::<PACKED, 6>(kc, pa, 0, b, c, rs, beta, rows, cols),
                            7 | 8 => tile::<PACKED, 8>(kc, pa, 0, b, c, rs, beta, rows, cols),
                            9 | 10 => tile::<PACKED, 10>(kc, pa, 0, b, c, rs, beta, rows, cols),
                            11 | 12 => tile::<PACKED, 12>(kc, pa, 0, b, c, rs, beta, rows, cols),
                            _ => tile::<PACKED, MR>(kc, pa, 0, b, c, rs, beta, rows, cols),
                        }
                    }
                    ASrc::Rows(ra, ars) => {
                        let ra = ra[t * MR * ars..].as_ptr();
                        tile::<ROWS, MR>(kc, ra, ars, b, c, rs, beta, rows, cols)
                    }
                    ASrc::Cols(ca, acs) => {
                        let ca = ca[t * MR..].as_ptr();
                        tile::<COLS, MR>(kc, ca, acs, b, c, rs, beta, rows, cols)
                    }
                }
            };
        }
    }
}

/// How [`tile`] reads A: a packed panel, or a whole tile of row- or column-major A in place.
#[cfg(target_arch = "x86_64")]
const PACKED: u8 = 0;
#[cfg(target_arch = "x86_64")]
const ROWS: u8 = 1;
#[cfg(target_arch = "x86_64")]
const COLS: u8 = 2;

/// One register tile: `C[i, j] = beta * C[i, j] + sum_p A(i, p) * b[p * NR + j]` for
/// `i < rows <= R` (the tile computes `R <= MR` rows), `j < cols`, where `A(i, p)` is `a[p * MR + i]` (`PACKED`), `a[i * s + p]`
/// (`ROWS`) or `a[p * s + i]` (`COLS`); with `beta == 0` C is not read.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile<const A: u8, const R: usize>(
    kc: usize,
    a: *const f32,
    ars: usize,
    b: *const f32,
    c: *mut f32,
    rs: usize,
    beta: f32,
    rows: usize,
    cols: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for p in 0..kc {
        // SAFETY: `a` holds every `A(i, p)` for `i < MR`, `p < kc`, and `b` `kc * NR` floats
        // (the caller's contract).
        unsafe {
            let b0 = _mm512_loadu_ps(b.add(p * NR));
            let b1 = _mm512_loadu_ps(b.add(p * NR + 16));
            for (i, row) in acc.iter_mut().enumerate() {
                let at = match A {
                    ROWS => i * ars + p,
                    COLS => p * ars + i,
                    _ => p * MR + i,
                };
                let x = _mm512_set1_ps(*a.add(at));
                row[0] = _mm512_fmadd_ps(x, b0, row[0]);
                row[1] = _mm512_fmadd_ps(x, b1, row[1]);
            }
        }
    }
    let mask = |n: usize| -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    };
    let (m0, m1) = (mask(cols), mask(cols.saturating_sub(16)));
    let vb = _mm512_set1_ps(beta);
    for (i, row) in acc.iter().enumerate() {
        if i < rows {
            // SAFETY: row `i < rows` of the tile and its columns `< cols` are valid (the
            // caller's contract); masked-off lanes are neither read nor written.
            unsafe {
                let r = c.add(i * rs);
                let (mut x0, mut x1) = (row[0], row[1]);
                if beta != 0.0 {
                    x0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, r), x0);
                    x1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, r.wrapping_add(16)), x1);
                }
                _mm512_mask_storeu_ps(r, m0, x0);
                _mm512_mask_storeu_ps(r.wrapping_add(16), m1, x1);
            }
        }
    }
}
