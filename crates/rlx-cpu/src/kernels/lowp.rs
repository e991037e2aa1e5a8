//! Matrix products of bfloat16 or float16 operands, accumulated and returned in float32 (the
//! mixed-precision matmul). By default the operands are widened to float32, exactly (F16C for
//! float16), and the float32 GEMM runs. bfloat16 may instead run the AVX512-BF16 kernel
//! (`crate::bf16dot`, opt-in): operands packed into bfloat16 pairs, tiles of `MR x NR` float32
//! sums. Both give the same exact products, summed in another order.
use super::cast;
use super::matmul::{matmul as matmul_f32, products};
use crate::bf16dot::{self, Kernel, MR, NR};
use rayon::prelude::*;

/// Row blocks of this many rows are the unit of parallel work of the bfloat16 kernel.
const MC: usize = 4 * MR;

/// The low-precision operands of one product (both the same dtype).
#[derive(Clone, Copy)]
pub enum Lowp<'a> {
    BF16(&'a [u16], &'a [u16]),
    F16(&'a [u16], &'a [u16]),
}

/// `out = op(a) @ op(b)` (float32) for bfloat16 or float16 `a`, `b`; shapes, transposes and
/// batch broadcasting as `matmul::matmul`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    ops: Lowp,
    ad: &[usize],
    ta: bool,
    bd: &[usize],
    tb: bool,
    out: &mut [f32],
    od: &[usize],
) {
    let (a, b, bf16) = match ops {
        Lowp::BF16(a, b) => match bf16dot::kernel() {
            Some(kern) => return bf16_matmul(kern, a, ad, ta, b, bd, tb, out, od),
            None => (a, b, true),
        },
        Lowp::F16(a, b) => (a, b, false),
    };
    let src = |x| {
        if bf16 {
            cast::Src::BF16(x)
        } else {
            cast::Src::F16(x)
        }
    };
    // The widened operands live in per-thread buffers kept between calls (a fresh allocation
    // of a few MB per product costs its page faults every time).
    let widened = |wa: &mut Vec<f32>, wb: &mut Vec<f32>, out: &mut [f32]| {
        wa.resize(a.len(), 0.0);
        wb.resize(b.len(), 0.0);
        cast::cast(src(a), cast::Dst::F32(wa));
        cast::cast(src(b), cast::Dst::F32(wb));
        matmul_f32(wa, ad, ta, wb, bd, tb, out, od)
    };
    WIDE.with(|w| match w.try_borrow_mut() {
        Ok(mut w) => {
            let (wa, wb) = &mut *w;
            widened(wa, wb, out)
        }
        // Re-entered on this thread (a worker waiting in a parallel loop ran another product's
        // task): fresh buffers.
        Err(_) => widened(&mut Vec::new(), &mut Vec::new(), out),
    })
}

thread_local! {
    static WIDE: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

/// A strided bfloat16 matrix: element (i, j) at `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [u16],
    off: usize,
    rs: usize,
    cs: usize,
}

#[allow(clippy::too_many_arguments)]
fn bf16_matmul(
    kern: Kernel,
    a: &[u16],
    ad: &[usize],
    ta: bool,
    b: &[u16],
    bd: &[usize],
    tb: bool,
    out: &mut [f32],
    od: &[usize],
) {
    products(ad, ta, bd, tb, out, od, |g, o, a_off, b_off, m, par| {
        let av = View {
            data: a,
            off: a_off,
            rs: g.a_rs,
            cs: g.a_cs,
        };
        let bv = View {
            data: b,
            off: b_off,
            rs: g.b_rs,
            cs: g.b_cs,
        };
        let bp = pack_b(bv, g.k, g.n);
        gemm(kern, o, m, g.n, g.k, av, &bp, par);
    });
}

/// Packs `live <= width` lanes (from `lane0`) of a strided bfloat16 matrix into `out`: `kp`
/// steps of `width` pairs, `out[p * width + l]` holding elements `2p` (low half) and `2p + 1`
/// (high half) along k of lane `l`; lanes past `live` and the element past an odd `k` stay
/// zero (`out` comes zeroed). Lane `l`, k-index `c` is `data[off + l * ls + c * ks]`.
#[allow(clippy::too_many_arguments)]
fn pack_pairs(
    data: &[u16],
    off: usize,
    ls: usize,
    ks: usize,
    lane0: usize,
    live: usize,
    k: usize,
    width: usize,
    out: &mut [u32],
) {
    let pairs = k / 2;
    if ks == 1 {
        // Each lane's k elements are contiguous: read lane by lane.
        for l in 0..live {
            let base = off + (lane0 + l) * ls;
            let src = &data[base..base + k];
            for (p, two) in src.chunks_exact(2).enumerate() {
                out[p * width + l] = two[0] as u32 | (two[1] as u32) << 16;
            }
            if k % 2 == 1 {
                out[pairs * width + l] = src[k - 1] as u32;
            }
        }
    } else if ls == 1 {
        // Lanes are contiguous: read two k-rows at a time.
        for p in 0..k.div_ceil(2) {
            let r0 = off + 2 * p * ks + lane0;
            let lo = &data[r0..r0 + live];
            let o = &mut out[p * width..p * width + live];
            if 2 * p + 1 < k {
                let hi = &data[r0 + ks..r0 + ks + live];
                for ((v, &a), &b) in o.iter_mut().zip(lo).zip(hi) {
                    *v = a as u32 | (b as u32) << 16;
                }
            } else {
                for (v, &a) in o.iter_mut().zip(lo) {
                    *v = a as u32;
                }
            }
        }
    } else {
        for p in 0..k.div_ceil(2) {
            for l in 0..live {
                let at = |c: usize| data[off + (lane0 + l) * ls + c * ks] as u32;
                let hi = if 2 * p + 1 < k { at(2 * p + 1) } else { 0 };
                out[p * width + l] = at(2 * p) | hi << 16;
            }
        }
    }
}

/// `b` (`k x n`) packed for the kernel: `n / NR` (rounded up) panels of `kp = k / 2` (rounded
/// up) steps of `NR` pairs (see `pack_pairs`: the lanes are `b`'s columns).
fn pack_b(b: View, k: usize, n: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let mut out = vec![0u32; n.div_ceil(NR) * kp * NR];
    for (q, panel) in out.chunks_mut(kp * NR).enumerate() {
        let live = NR.min(n - q * NR);
        pack_pairs(b.data, b.off, b.cs, b.rs, q * NR, live, k, NR, panel);
    }
    out
}

/// Rows `r0..r0 + rows` of `a` (`rows <= MC`) packed for the kernel: tiles of `MR` rows, each
/// `kp` steps of `MR` pairs (see `pack_pairs`: the lanes are `a`'s rows).
fn pack_a(a: View, r0: usize, rows: usize, k: usize, buf: &mut Vec<u32>) {
    let kp = k.div_ceil(2);
    buf.clear();
    buf.resize(rows.div_ceil(MR) * kp * MR, 0);
    for (t, tile) in buf.chunks_mut(kp * MR).enumerate() {
        let live = MR.min(rows - t * MR);
        pack_pairs(a.data, a.off, a.rs, a.cs, r0 + t * MR, live, k, MR, tile);
    }
}

/// `out (m x n, row-major) = a (m x k) @ b`, `b` packed by `pack_b`; row blocks of `MC` rows
/// run in parallel when `parallel`.
#[allow(clippy::too_many_arguments)]
fn gemm(
    kern: Kernel,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    a: View,
    bp: &[u32],
    parallel: bool,
) {
    let kp = k.div_ceil(2);
    let block = |(blk, o): (usize, &mut [f32])| {
        let r0 = blk * MC;
        let rows = o.len() / n;
        let mut ap = Vec::new();
        pack_a(a, r0, rows, k, &mut ap);
        let mut tile = [0.0f32; MR * NR];
        for (q, panel) in bp.chunks(kp * NR).enumerate() {
            let cols = NR.min(n - q * NR);
            for (t, at) in ap.chunks(kp * MR).enumerate() {
                kern.tile(kp, at, panel, &mut tile);
                let live = MR.min(rows - t * MR);
                for r in 0..live {
                    let row = (t * MR + r) * n + q * NR;
                    o[row..row + cols].copy_from_slice(&tile[r * NR..r * NR + cols]);
                }
            }
        }
    };
    let out = &mut out[..m * n];
    if parallel {
        out.par_chunks_mut(MC * n).enumerate().for_each(block);
    } else {
        out.chunks_mut(MC * n).enumerate().for_each(block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> u16 {
        cast::f32_to_bf16(x)
    }

    /// Every shape and transpose on both paths against a float64 product of the same bfloat16
    /// values (their products are exact in float32; only the summation order differs).
    #[test]
    fn both_paths_match_float64_for_odd_shapes_and_transposes() {
        let shapes = [
            (1, 1, 1),
            (7, 33, 65),
            (65, 130, 7),
            (33, 1, 130),
            (130, 65, 33),
        ];
        for kernel in [false, true] {
            if kernel && !bf16dot::available() {
                continue;
            }
            bf16dot::force(kernel);
            for &(m, k, n) in &shapes {
                let av: Vec<f32> = (0..m * k).map(|v| (v as f32 * 0.37).sin()).collect();
                let bv: Vec<f32> = (0..k * n).map(|v| (v as f32 * 0.11).cos()).collect();
                let a16: Vec<u16> = av.iter().map(|&x| bf16(x)).collect();
                let b16: Vec<u16> = bv.iter().map(|&x| bf16(x)).collect();
                let ar: Vec<f64> = a16.iter().map(|&h| cast::bf16_to_f32(h) as f64).collect();
                let br: Vec<f64> = b16.iter().map(|&h| cast::bf16_to_f32(h) as f64).collect();
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let at: Vec<u16> = if ta {
                        (0..k * m).map(|i| a16[(i % m) * k + i / m]).collect()
                    } else {
                        a16.clone()
                    };
                    let bt: Vec<u16> = if tb {
                        (0..n * k).map(|i| b16[(i % k) * n + i / k]).collect()
                    } else {
                        b16.clone()
                    };
                    let ad = if ta { [k, m] } else { [m, k] };
                    let bd = if tb { [n, k] } else { [k, n] };
                    let mut out = vec![f32::NAN; m * n];
                    matmul(Lowp::BF16(&at, &bt), &ad, ta, &bd, tb, &mut out, &[m, n]);
                    for i in 0..m {
                        for j in 0..n {
                            let want: f64 = (0..k).map(|p| ar[i * k + p] * br[p * n + j]).sum();
                            let got = out[i * n + j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + k as f64),
                                "kernel={kernel} {m}x{k}x{n} ta={ta} tb={tb} ({i},{j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
        bf16dot::force(false);
    }

    #[test]
    fn batched_with_a_broadcast_operand_matches_per_batch_products() {
        let (m, k, n) = (9, 17, 40);
        let a: Vec<u16> = (0..3 * m * k)
            .map(|v| bf16((v as f32 * 0.3).sin()))
            .collect();
        let b: Vec<u16> = (0..k * n).map(|v| bf16((v as f32 * 0.7).cos())).collect();
        let mut out = vec![0.0; 3 * m * n];
        matmul(
            Lowp::BF16(&a, &b),
            &[3, m, k],
            false,
            &[1, k, n],
            false,
            &mut out,
            &[3, m, n],
        );
        for bi in 0..3 {
            let mut one = vec![0.0; m * n];
            let a1 = &a[bi * m * k..(bi + 1) * m * k];
            matmul(
                Lowp::BF16(a1, &b),
                &[m, k],
                false,
                &[k, n],
                false,
                &mut one,
                &[m, n],
            );
            assert_eq!(&out[bi * m * n..(bi + 1) * m * n], &one[..]);
        }
        // float16 widens: exact products of exactly representable values.
        let h: Vec<u16> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .map(|&x| cast::f32_to_f16(x))
            .collect();
        let mut o = vec![0.0; 4];
        matmul(
            Lowp::F16(&h, &h),
            &[2, 2],
            false,
            &[2, 2],
            false,
            &mut o,
            &[2, 2],
        );
        assert_eq!(o, [7.0, 10.0, 15.0, 22.0]);
    }
}
