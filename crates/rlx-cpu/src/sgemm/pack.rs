//! Packing of GEMM operands into the panel layout the micro-kernels read: an A panel is `mr`
//! rows of a kc-deep slice stored column by column (the `mr` values of one depth index next to
//! each other), a B panel is `nr` columns stored row by row. Rows or columns past the matrix
//! are zeros, so edge tiles run the full kernel and only their stores are masked. Any strides
//! are read: the contiguous cases copy runs, a transposed operand is read row by row into a
//! small tile and written out transposed.
use super::View;

/// Packs rows `[i, i + rows)` x depth `[p0, p0 + kc)` of A into `dst` (`mr * kc` floats).
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn a_panel(
    dst: &mut [f32],
    a: &[f32],
    av: View,
    i: usize,
    rows: usize,
    p0: usize,
    kc: usize,
    mr: usize,
) {
    // Element (r, p) of the panel is A[i + r, p0 + p] = a[base + r * rs + p * cs].
    let base = av.off + i * av.rs + p0 * av.cs;
    match mr {
        14 => panel::<14>(dst, a, base, av.rs, av.cs, rows, kc),
        6 => panel::<6>(dst, a, base, av.rs, av.cs, rows, kc),
        _ => unreachable!("no A panel of {mr} rows"),
    }
}

/// Packs depth `[p0, p0 + kc)` x columns `[j, j + cols)` of B into `dst` (`nr * kc` floats).
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn b_panel(
    dst: &mut [f32],
    b: &[f32],
    bv: View,
    p0: usize,
    kc: usize,
    j: usize,
    cols: usize,
    nr: usize,
) {
    // Element (c, p) of the panel is B[p0 + p, j + c] = b[base + c * cs + p * rs].
    let base = bv.off + p0 * bv.rs + j * bv.cs;
    match nr {
        32 => panel::<32>(dst, b, base, bv.cs, bv.rs, cols, kc),
        16 => panel::<16>(dst, b, base, bv.cs, bv.rs, cols, kc),
        _ => unreachable!("no B panel of {nr} columns"),
    }
}

/// Packs depth `[p0, p0 + kc)` x columns `[j0, j0 + nc)` of a row-major B (`bv.cs == 1`) into
/// `nc.div_ceil(nr)` panels of `nr * kc` floats, reading each row of B once, in order. Columns
/// past `nc` in the last panel are zeros.
#[allow(clippy::too_many_arguments)]
pub fn b_rows(
    dst: &mut [f32],
    b: &[f32],
    bv: View,
    p0: usize,
    kc: usize,
    j0: usize,
    nc: usize,
    nr: usize,
) {
    debug_assert_eq!(bv.cs, 1);
    let panels = nc.div_ceil(nr);
    let dst = &mut dst[..panels * nr * kc];
    let tail = nc - (panels - 1) * nr;
    if tail < nr {
        dst[(panels - 1) * nr * kc..].fill(0.0);
    }
    for p in 0..kc {
        let row = &b[bv.off + (p0 + p) * bv.rs + j0..][..nc];
        for (q, run) in row.chunks(nr).enumerate() {
            let at = q * nr * kc + p * nr;
            dst[at..at + run.len()].copy_from_slice(run);
        }
    }
}

/// `dst[p * W + r] = src[base + r * rstep + p * pstep]` for `r < lanes`, zero for
/// `lanes <= r < W`, `p < kc`.
#[inline]
fn panel<const W: usize>(
    dst: &mut [f32],
    src: &[f32],
    base: usize,
    rstep: usize,
    pstep: usize,
    lanes: usize,
    kc: usize,
) {
    let dst = &mut dst[..W * kc];
    if lanes < W {
        dst.fill(0.0);
    }
    if rstep == 1 && lanes == W {
        // Each depth index is a contiguous run of W values.
        for (p, d) in dst.chunks_exact_mut(W).enumerate() {
            let s = base + p * pstep;
            let run: &[f32; W] = src[s..s + W].try_into().unwrap();
            d.copy_from_slice(run);
        }
    } else if rstep == 1 {
        for (p, d) in dst.chunks_exact_mut(W).enumerate() {
            let s = base + p * pstep;
            d[..lanes].copy_from_slice(&src[s..s + lanes]);
        }
    } else if pstep == 1 {
        // Each lane is a contiguous run along the depth: transpose blocks of 8 lanes x 8
        // depth indices (with AVX2 where the CPU has it), the rest one by one.
        let (full_p, full_r) = (kc / 8 * 8, lanes / 8 * 8);
        let simd = super::avx2::available();
        for p in (0..full_p).step_by(8) {
            let d = &mut dst[p * W..(p + 8) * W];
            for r in (0..full_r).step_by(8) {
                let s = base + r * rstep + p;
                if simd {
                    super::avx2::transpose8(&src[s..], rstep, &mut d[r..], W);
                } else {
                    for (q, row) in d.chunks_exact_mut(W).enumerate() {
                        for (l, x) in row[r..r + 8].iter_mut().enumerate() {
                            *x = src[s + l * rstep + q];
                        }
                    }
                }
            }
            for r in full_r..lanes {
                let s = base + r * rstep + p;
                let run: &[f32; 8] = src[s..s + 8].try_into().unwrap();
                for (q, &v) in run.iter().enumerate() {
                    d[q * W + r] = v;
                }
            }
        }
        for p in full_p..kc {
            for r in 0..lanes {
                dst[p * W + r] = src[base + r * rstep + p];
            }
        }
    } else {
        for p in 0..kc {
            for r in 0..lanes {
                dst[p * W + r] = src[base + r * rstep + p * pstep];
            }
        }
    }
}
