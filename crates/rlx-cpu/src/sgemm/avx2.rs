//! The AVX2 + FMA micro-kernel: a 6 x 16 tile of C in 12 ymm accumulators; per depth index two
//! vector loads of the packed B panel and 6 broadcasts of A (packed, or rows read in place) feed
//! 12 FMAs. Edge tiles run the same loop on the zero-padded panels; a tile narrower than 16
//! columns stores through `vmaskmovps`, whole tiles through plain stores.
//! Also the 8 x 8 transpose that packing uses for transposed operands. The `unsafe` of the
//! target-feature code and of its raw loads and stores lives only here.
use super::{ASrc, Micro};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

const MR: usize = 6;
const NR: usize = 16;

/// Whether this CPU has AVX2 and FMA.
pub fn available() -> bool {
    crate::isa::avx2_fma_available()
}

/// The AVX2 + FMA kernel.
pub struct Kernel;

impl Micro for Kernel {
    const MR: usize = MR;
    const NR: usize = NR;
    const COLS_IN_PLACE: bool = false;

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
        // SAFETY: the caller guarantees AVX2 + FMA and the validity of `c` (the trait's
        // contract).
        unsafe {
            block(kc, mc, nc, a, pb, c, rs, beta)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (a, c);
            unreachable!(
                "the AVX2 GEMM kernel runs only on x86-64 ({kc} {mc} {nc} {pb:?} {rs} {beta})"
            )
        }
    }
}

/// See [`Micro::block`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
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
    // One packed B panel stays in L1 while the tiles of A rows pass by (from L2): with both
    // cores busy, streaming all of B from L2 for every A tile was the limit.
    for q in 0..panels {
        let cols = NR.min(nc - q * NR);
        for t in 0..tiles {
            let rows = MR.min(mc - t * MR);
            let b = pb[q * NR * kc..].as_ptr();
            // SAFETY: AVX2 and FMA are enabled here; the panels hold `kc` depth indices each
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
#[target_feature(enable = "avx2,fma")]
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
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // Where each row's A(i, 0) is and how far one depth index moves it: fixed per row, so the
    // loop addresses every broadcast as base + p * step (no pointer chain through the rows).
    let (base, step): ([*const f32; R], usize) = match A {
        ROWS => (std::array::from_fn(|i| a.wrapping_add(i * ars)), 1),
        COLS => (std::array::from_fn(|i| a.wrapping_add(i)), ars),
        _ => (std::array::from_fn(|i| a.wrapping_add(i)), MR),
    };
    for p in 0..kc {
        // SAFETY: `a` holds every `A(i, p)` for `i < MR`, `p < kc`, and `b` `kc * NR` floats
        // (the caller's contract).
        unsafe {
            let b0 = _mm256_loadu_ps(b.add(p * NR));
            let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
            for (row, at) in acc.iter_mut().zip(base) {
                let x = _mm256_set1_ps(*at.add(p * step));
                row[0] = _mm256_fmadd_ps(x, b0, row[0]);
                row[1] = _mm256_fmadd_ps(x, b1, row[1]);
            }
        }
    }
    let vb = _mm256_set1_ps(beta);
    if cols == NR {
        // A whole tile's width: plain loads and stores (masked ones are microcoded and slow on
        // some CPUs, AMD's Zen 2/3 among them: about a tenth of a 128-deep tile's time).
        for (i, row) in acc.iter().enumerate().take(rows) {
            // SAFETY: row `i < rows` of the tile and its `NR` columns are valid (the caller's
            // contract).
            unsafe {
                let r = c.add(i * rs);
                let (mut x0, mut x1) = (row[0], row[1]);
                if beta != 0.0 {
                    x0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(r), x0);
                    x1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(r.add(8)), x1);
                }
                _mm256_storeu_ps(r, x0);
                _mm256_storeu_ps(r.add(8), x1);
            }
        }
        return;
    }
    // Lane j of a mask is all ones when j < n.
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mask = |n: usize| _mm256_cmpgt_epi32(_mm256_set1_epi32(n.min(8) as i32), lanes);
    let (m0, m1) = (mask(cols), mask(cols.saturating_sub(8)));
    for (i, row) in acc.iter().enumerate().take(rows) {
        // SAFETY: row `i < rows` of the tile and its columns `< cols` are valid (the
        // caller's contract); masked-off lanes are neither read nor written.
        unsafe {
            let r = c.add(i * rs);
            let (mut x0, mut x1) = (row[0], row[1]);
            if beta != 0.0 {
                x0 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(r, m0), x0);
                x1 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(r.wrapping_add(8), m1), x1);
            }
            _mm256_maskstore_ps(r, m0, x0);
            _mm256_maskstore_ps(r.wrapping_add(8), m1, x1);
        }
    }
}

/// `dst[q * dstride + l] = src[l * sstride + q]` for `l, q < 8`: an 8 x 8 block transposed in
/// registers. Panics unless both slices hold the block; runs only where AVX2 is available
/// (callers check [`available`]; elsewhere it panics).
pub fn transpose8(src: &[f32], sstride: usize, dst: &mut [f32], dstride: usize) {
    assert!(src.len() > 7 * sstride + 7 && dst.len() > 7 * dstride + 7 && available());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 was detected just above; the assert proves the 8 rows of 8 read and the 8
    // rows of 8 written lie inside the slices.
    unsafe {
        transpose8_avx2(src.as_ptr(), sstride, dst.as_mut_ptr(), dstride)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8_avx2(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
    // SAFETY: the caller proved rows 0..8 of 8 floats at `src + l * ss` and `dst + q * ds`
    // are in bounds.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|l| _mm256_loadu_ps(src.add(l * ss)));
        // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves swapped.
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let o = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (q, v) in o.iter().enumerate() {
            _mm256_storeu_ps(dst.add(q * ds), *v);
        }
    }
}
