//! Matrix multiplication through rlx's GEMM (`crate::sgemm`: run-time dispatched AVX-512 / AVX2
//! kernels, the `gemm` crate elsewhere), strided so transposed operands are never copied;
//! batches broadcast like numpy.
use super::Strided;
pub use crate::sgemm::View;
use rayon::prelude::*;

/// Below this many multiply-adds one GEMM runs on one thread: splitting costs more than the
/// second core gains. Measured with the pool kept awake for the run (`crate::pool`): the digits
/// MLP's 64x256x256 products (4.2M) are faster split (step 0.44 -> 0.36 ms on two cores), a
/// threshold of 1M made the tiny GPT's step slower (25 -> 29 ms).
pub const PAR_FLOPS: usize = 64 * 256 * 256;

/// In a batch of products, below this many multiply-adds per product the products are shared
/// between the threads whole rather than each split (the CIFAR CNN's per-image weight-gradient
/// products, ~4.7M each, are faster that way).
pub(super) const PAR_FLOPS_BATCHED: usize = 128 * 256 * 256;

/// A row-major matrix view: element (i, j) is at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

/// `out = op(a) @ op(b)` where `op` transposes the last two dims when asked.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    a: &[f32],
    ad: &[usize],
    ta: bool,
    b: &[f32],
    bd: &[usize],
    tb: bool,
    out: &mut [f32],
    od: &[usize],
) {
    products(ad, ta, bd, tb, out, od, |g, o, a_off, b_off, m, par| {
        let am = Mat {
            data: &a[a_off..],
            rs: g.a_rs,
            cs: g.a_cs,
        };
        let bm = Mat {
            data: &b[b_off..],
            rs: g.b_rs,
            cs: g.b_cs,
        };
        gemm_into(o, m, g.n, g.k, am, bm, par);
    });
}

/// What every product of one batched matmul shares: `n`, `k` and the element strides of
/// `op(a)` (m x k) and `op(b)` (k x n) inside one matrix of the stack.
pub(super) struct Geometry {
    pub n: usize,
    pub k: usize,
    pub a_rs: usize,
    pub a_cs: usize,
    pub b_rs: usize,
    pub b_cs: usize,
}

/// Splits `op(a) @ op(b)` (dims `ad`, `bd`, batches broadcast like numpy into `od`) into 2-D
/// products and runs `gemm(geometry, out_rows, a_offset, b_offset, m, parallel)` for each: one
/// tall product where a stack of row-major matrices meets one shared matrix, else one per
/// batch (in parallel over batches when each is small). Empty outputs do nothing; `k == 0`
/// gives zeros. Shared by the float32 and the low-precision matmuls.
#[allow(clippy::too_many_arguments)]
pub(super) fn products(
    ad: &[usize],
    ta: bool,
    bd: &[usize],
    tb: bool,
    out: &mut [f32],
    od: &[usize],
    gemm: impl Fn(&Geometry, &mut [f32], usize, usize, usize, bool) + Sync,
) {
    let (ra, ca) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (rb, cb) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
    let n = if tb { rb } else { cb };
    let (a_rs, a_cs) = if ta { (1, ca) } else { (ca, 1) };
    let (b_rs, b_cs) = if tb { (1, cb) } else { (cb, 1) };
    if out.is_empty() {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    let g = Geometry {
        n,
        k,
        a_rs,
        a_cs,
        b_rs,
        b_cs,
    };
    let ob = &od[..od.len() - 2];
    let batch: usize = ob.iter().product();
    let a_batch: usize = ad[..ad.len() - 2].iter().product();
    let b_batch: usize = bd[..bd.len() - 2].iter().product();
    // A stack of row-major matrices times one shared matrix is one tall GEMM.
    if b_batch == 1 && !ta && a_batch == batch {
        return gemm(&g, out, 0, 0, batch * m, batch * m * n * k >= PAR_FLOPS);
    }
    let sa = Strided::broadcast(&ad[..ad.len() - 2], ob);
    let sb = Strided::broadcast(&bd[..bd.len() - 2], ob);
    let offset = |s: &Strided, mut i: usize, size: usize| {
        let mut off = 0;
        for d in (0..ob.len()).rev() {
            off += (i % ob[d]) * s.strides[d];
            i /= ob[d];
        }
        off * size
    };
    let one = |(bi, o): (usize, &mut [f32]), par: bool| {
        gemm(
            &g,
            o,
            offset(&sa, bi, ra * ca),
            offset(&sb, bi, rb * cb),
            m,
            par,
        )
    };
    let limit = if batch == 1 {
        PAR_FLOPS
    } else {
        PAR_FLOPS_BATCHED
    };
    let big = m * n * k >= limit;
    if big || batch == 1 {
        out.chunks_mut(m * n).enumerate().for_each(|c| one(c, big));
    } else {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|c| one(c, false));
    }
}

/// `out (m x n, row-major) = a (m x k) @ b (k x n)`.
fn gemm_into(out: &mut [f32], m: usize, n: usize, k: usize, a: Mat, b: Mat, parallel: bool) {
    crate::sgemm::sgemm(
        m,
        n,
        k,
        out,
        View::rows(0, n),
        0.0,
        a.data,
        View {
            off: 0,
            rs: a.rs,
            cs: a.cs,
        },
        b.data,
        View {
            off: 0,
            rs: b.rs,
            cs: b.cs,
        },
        parallel,
    );
}

/// `out[o] = beta * out[o] + a[av] (m x k) @ b[bv] (k x n)` on one thread, every operand a
/// strided view (so transposes and column blocks of packed tensors are read in place). With
/// `beta == 0` the old contents of `out` are not read.
#[allow(clippy::too_many_arguments)]
pub fn gemm_view(
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    o: View,
    beta: f32,
    a: &[f32],
    av: View,
    b: &[f32],
    bv: View,
) {
    crate::sgemm::sgemm(m, n, k, out, o, beta, a, av, b, bv, false);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn transpose(x: &[f32], r: usize, c: usize) -> Vec<f32> {
        (0..c)
            .flat_map(|j| (0..r).map(move |i| x[i * c + j]))
            .collect()
    }

    #[test]
    fn all_transpose_flags_and_batches_match_naive() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|v| (v as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|v| (v as f32 * 0.11).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let aa = if ta { transpose(&a, m, k) } else { a.clone() };
            let bb = if tb { transpose(&b, k, n) } else { b.clone() };
            let ad = if ta { [k, m] } else { [m, k] };
            let bd = if tb { [n, k] } else { [k, n] };
            let mut out = vec![0.0; m * n];
            matmul(&aa, &ad, ta, &bb, &bd, tb, &mut out, &[m, n]);
            for (x, y) in out.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "{ta} {tb}");
            }
        }
        // Batched with a broadcast right operand, and with both batched.
        let a2: Vec<f32> = a.iter().chain(&a).map(|v| v * 2.0).collect();
        let mut out = vec![0.0; 2 * m * n];
        matmul(
            &a2,
            &[2, m, k],
            false,
            &b,
            &[k, n],
            false,
            &mut out,
            &[2, m, n],
        );
        let mut out2 = vec![0.0; 2 * m * n];
        let b2: Vec<f32> = b.iter().chain(&b).copied().collect();
        matmul(
            &a2,
            &[2, m, k],
            false,
            &b2,
            &[2, k, n],
            false,
            &mut out2,
            &[2, m, n],
        );
        for i in 0..2 * m * n {
            assert!((out[i] - 2.0 * want[i % (m * n)]).abs() < 1e-5);
            assert!((out2[i] - out[i]).abs() < 1e-5);
        }
    }
}
