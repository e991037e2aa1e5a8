//! Reductions (sum, mean, max over any axes; integer sums and maxima) and `sum_to`, the VJP of
//! broadcasting.
use super::elementwise::Int;
use super::PAR_MIN;
use rayon::prelude::*;
use rlx_ir::ReduceOp;

/// Reduces `x` (shape `xd`) over the sorted `axes`; `out` holds the kept dims in order.
#[inline(always)]
pub fn reduce(op: ReduceOp, x: &[f32], xd: &[usize], axes: &[usize], out: &mut [f32]) {
    match op {
        ReduceOp::Max => reduce_with(x, xd, axes, out, f32::NEG_INFINITY, super::math::nan_max),
        ReduceOp::Sum | ReduceOp::Mean => reduce_with(x, xd, axes, out, 0.0, |a, b| a + b),
    }
    if op == ReduceOp::Mean {
        let count: usize = axes.iter().map(|&a| xd[a]).product();
        // An empty axis gives 0 * inf = NaN, as numpy's mean does.
        let scale = 1.0 / count as f32;
        out.iter_mut().for_each(|v| *v *= scale);
    }
}

/// Sums (wrapping, as numpy's) or maxima of an integer tensor over the sorted `axes`; `out`
/// holds the kept dims in order.
pub fn reduce_int<T: Int>(op: ReduceOp, x: &[T], xd: &[usize], axes: &[usize], out: &mut [T]) {
    if op == ReduceOp::Max {
        walk(x, xd, axes, out, T::MIN, |a, b| a.max(b));
    } else {
        walk(x, xd, axes, out, T::ZERO, T::add);
    }
}

/// Sum, mean or max (NaN propagating) of a float64 tensor over the sorted `axes`.
pub fn reduce_f64(op: ReduceOp, x: &[f64], xd: &[usize], axes: &[usize], out: &mut [f64]) {
    if op == ReduceOp::Max {
        walk(x, xd, axes, out, f64::NEG_INFINITY, |a, b| {
            if a > b || a.is_nan() {
                a
            } else {
                b
            }
        });
        return;
    }
    walk(x, xd, axes, out, 0.0, |a, b| a + b);
    if op == ReduceOp::Mean {
        let count: usize = axes.iter().map(|&a| xd[a]).product();
        let scale = 1.0 / count as f64; // an empty axis gives NaN, as numpy's mean does
        out.iter_mut().for_each(|v| *v *= scale);
    }
}

/// `x` (shape `xd`) summed down to `od` (the VJP of broadcasting), in float64.
pub fn sum_to_f64(x: &[f64], xd: &[usize], out: &mut [f64], od: &[usize]) {
    let lead = xd.len() - od.len();
    let axes: Vec<usize> = (0..xd.len())
        .filter(|&d| d < lead || (od[d - lead] == 1 && xd[d] != 1))
        .collect();
    walk(x, xd, &axes, out, 0.0, |a, b| a + b);
}

/// Folds every element of `x` into the output element of its kept dims (the reduced ones
/// dropped), in one plain pass: the reductions of the dtypes with no vectorised kernels
/// (integers, float64).
fn walk<T: Copy>(
    x: &[T],
    xd: &[usize],
    axes: &[usize],
    out: &mut [T],
    init: T,
    combine: impl Fn(T, T) -> T,
) {
    out.iter_mut().for_each(|o| *o = init);
    let mut kept_stride = vec![0usize; xd.len()];
    let mut s = 1;
    for d in (0..xd.len()).rev() {
        if !axes.contains(&d) {
            kept_stride[d] = s;
            s *= xd[d];
        }
    }
    let mut idx = vec![0usize; xd.len()];
    for &v in x {
        let o = idx
            .iter()
            .zip(&kept_stride)
            .map(|(i, s)| i * s)
            .sum::<usize>();
        out[o] = combine(out[o], v);
        for d in (0..xd.len()).rev() {
            idx[d] += 1;
            if idx[d] < xd[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// One monomorphic reduction loop per combine function, so it inlines and vectorises.
#[inline(always)]
fn reduce_with<F: Fn(f32, f32) -> f32 + Copy + Sync + Send>(
    x: &[f32],
    xd: &[usize],
    axes: &[usize],
    out: &mut [f32],
    init: f32,
    combine: F,
) {
    let count: usize = axes.iter().map(|&a| xd[a]).product();
    let rank = xd.len();
    let is_suffix = axes
        .iter()
        .enumerate()
        .all(|(i, &a)| a == rank - axes.len() + i);
    let is_prefix = axes.iter().enumerate().all(|(i, &a)| a == i);
    if out.is_empty() {
        return;
    }
    if count == 0 {
        out.fill(init);
    } else if is_suffix {
        let row = |(o, r): (&mut f32, &[f32])| *o = fold_long(r, init, combine);
        if x.len() >= PAR_MIN && out.len() > 1 {
            out.par_iter_mut().zip(x.par_chunks(count)).for_each(|r| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || row(r),
                )
            });
        } else {
            crate::isa::dispatch(
                #[inline(always)]
                || out.iter_mut().zip(x.chunks(count)).for_each(row),
            );
        }
    } else if is_prefix {
        out.fill(init);
        let inner = out.len();
        // Rows are added in blocks of ROWS into a partial sum that is then added to the
        // total, so rounding error grows with count / ROWS + ROWS rather than with count.
        const ROWS: usize = 256;
        let accumulate = crate::isa::inlined(
            #[inline(always)]
            |o: &mut [f32], j0: usize| {
                let mut part = vec![init; o.len()];
                for block in (0..count).step_by(ROWS) {
                    part.fill(init);
                    for i in block..(block + ROWS).min(count) {
                        let src = &x[i * inner + j0..i * inner + j0 + o.len()];
                        part.iter_mut()
                            .zip(src)
                            .for_each(|(a, &v)| *a = combine(*a, v));
                    }
                    o.iter_mut()
                        .zip(&part)
                        .for_each(|(a, &v)| *a = combine(*a, v));
                }
            },
        );
        if x.len() >= PAR_MIN && inner >= 64 {
            let per = inner.div_ceil(rayon::current_num_threads() * 2).max(16);
            out.par_chunks_mut(per).enumerate().for_each(|(c, o)| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || accumulate(o, c * per),
                )
            });
        } else {
            crate::isa::dispatch(
                #[inline(always)]
                || accumulate(out, 0),
            );
        }
    } else if let Some((outer, kept, inner)) = middle(xd, axes) {
        // Reduced dims around one block of kept dims (bias gradients of NCHW tensors, batch
        // statistics): each kept element folds `outer` contiguous rows of `inner`.
        let one = crate::isa::inlined(
            #[inline(always)]
            |k: usize| -> f32 {
                let mut acc = init;
                for o in 0..outer {
                    let at = (o * kept + k) * inner;
                    acc = combine(acc, fold_long(&x[at..at + inner], init, combine));
                }
                acc
            },
        );
        if x.len() >= PAR_MIN && out.len() > 1 {
            out.par_iter_mut().enumerate().for_each(|(k, v)| {
                *v = crate::isa::dispatch(
                    #[inline(always)]
                    || one(k),
                )
            });
        } else {
            out.iter_mut().enumerate().for_each(|(k, v)| *v = one(k));
        }
    } else {
        crate::isa::dispatch(
            #[inline(always)]
            || general(x, xd, axes, out, init, combine),
        );
    }
}

/// `(outer, kept, inner)` sizes when the kept dims form one contiguous block with reduced dims
/// on both sides (size-1 dims ignored).
fn middle(xd: &[usize], axes: &[usize]) -> Option<(usize, usize, usize)> {
    let (mut outer, mut kept, mut inner) = (1, 1, 1);
    let mut phase = 0; // 0: leading reduced dims, 1: kept block, 2: trailing reduced dims
    for (d, &n) in xd.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let reduced = axes.contains(&d);
        match (phase, reduced) {
            (0, true) => outer *= n,
            (0, false) | (1, false) => {
                phase = 1;
                kept *= n;
            }
            (1, true) | (2, true) => {
                phase = 2;
                inner *= n;
            }
            _ => return None,
        }
    }
    (phase == 2 && outer > 1).then_some((outer, kept, inner))
}

/// Elements a single `fold_row` covers; longer rows are split in halves (pairwise summation).
const BLOCK: usize = 256;
/// Rows at least this long fold their halves on two workers.
const PAR_ROW: usize = 1 << 17;

/// Folds a row of any length: blocks of `BLOCK` with 8 accumulators each, the block results
/// combined pairwise, so a sum's rounding error grows with log(n), not n (16M values of 0.1
/// sum to within ~1e-7 relative, as numpy's pairwise sum). Long rows use two workers.
fn fold_long<F: Fn(f32, f32) -> f32 + Copy + Sync + Send>(r: &[f32], init: f32, combine: F) -> f32 {
    if r.len() <= BLOCK {
        // Dispatched here, at the leaves: the recursion itself is never inlined.
        return crate::isa::dispatch(
            #[inline(always)]
            || fold_row(r, init, combine),
        );
    }
    let mid = (r.len() / 2).div_ceil(8) * 8;
    let (a, b) = r.split_at(mid);
    let (x, y) = if r.len() >= PAR_ROW {
        rayon::join(
            || fold_long(a, init, combine),
            || fold_long(b, init, combine),
        )
    } else {
        (fold_long(a, init, combine), fold_long(b, init, combine))
    };
    combine(x, y)
}

/// Folds a contiguous row with 8 independent accumulators (so the loop vectorises).
#[inline(always)]
fn fold_row<F: Fn(f32, f32) -> f32>(r: &[f32], init: f32, combine: F) -> f32 {
    let mut acc = [init; 8];
    let chunks = r.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = combine(*a, v);
        }
    }
    let mut total = acc.iter().fold(init, |a, &b| combine(a, b));
    for &v in rest {
        total = combine(total, v);
    }
    total
}

/// Any axes: each output element walks its reduced sub-space with an odometer.
#[inline(always)]
fn general<F: Fn(f32, f32) -> f32>(
    x: &[f32],
    xd: &[usize],
    axes: &[usize],
    out: &mut [f32],
    init: f32,
    combine: F,
) {
    let strides = rlx_ir::Shape::from(xd).strides();
    let kept: Vec<usize> = (0..xd.len()).filter(|d| !axes.contains(d)).collect();
    let rd: Vec<usize> = axes.iter().map(|&a| xd[a]).collect();
    let rs: Vec<usize> = axes.iter().map(|&a| strides[a]).collect();
    for (o, v) in out.iter_mut().enumerate() {
        let mut rem = o;
        let mut base = 0;
        for &d in kept.iter().rev() {
            base += (rem % xd[d]) * strides[d];
            rem /= xd[d];
        }
        let mut idx = vec![0; rd.len()];
        let mut acc = init;
        'walk: loop {
            let off: usize = base + idx.iter().zip(&rs).map(|(i, s)| i * s).sum::<usize>();
            acc = combine(acc, x[off]);
            for d in (0..rd.len()).rev() {
                idx[d] += 1;
                if idx[d] < rd[d] {
                    continue 'walk;
                }
                idx[d] = 0;
            }
            break;
        }
        *v = acc;
    }
}

/// Sums `x` (shape `xd`) down to the broadcast-compatible shape `od`.
#[inline(always)]
pub fn sum_to(x: &[f32], xd: &[usize], out: &mut [f32], od: &[usize]) {
    let lead = xd.len() - od.len();
    let axes: Vec<usize> = (0..xd.len())
        .filter(|&d| d < lead || (od[d - lead] == 1 && xd[d] != 1))
        .collect();
    reduce(ReduceOp::Sum, x, xd, &axes, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_over_any_axes() {
        let x: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let mut out = vec![0.0; 4];
        reduce(ReduceOp::Sum, &x, &[2, 3, 4], &[0, 1], &mut out);
        assert_eq!(out, vec![60.0, 66.0, 72.0, 78.0]);
        let mut out = vec![0.0; 3];
        reduce(ReduceOp::Max, &x, &[2, 3, 4], &[0, 2], &mut out);
        assert_eq!(out, vec![15.0, 19.0, 23.0]);
        let mut out = vec![0.0; 2];
        reduce(ReduceOp::Mean, &x, &[2, 3, 4], &[1, 2], &mut out);
        assert_eq!(out, vec![5.5, 17.5]);
        let mut out = vec![0.0; 3];
        sum_to(&x, &[2, 3, 4], &mut out, &[3, 1]);
        assert_eq!(
            out,
            [60.0 + 0.0, 92.0, 124.0]
                .iter()
                .map(|v| v + 0.0)
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn middle_axis_reductions_match_the_general_walk() {
        let xd = [3, 4, 2, 5];
        let x: Vec<f32> = (0..120).map(|v| (v as f32 * 0.7).sin()).collect();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
            let mut fast = vec![0.0; 4];
            reduce(op, &x, &xd, &[0, 2, 3], &mut fast);
            let mut slow = vec![0.0; 4];
            let init = if op == ReduceOp::Max {
                f32::NEG_INFINITY
            } else {
                0.0
            };
            general(&x, &xd, &[0, 2, 3], &mut slow, init, |a, b| {
                if op == ReduceOp::Max {
                    a.max(b)
                } else {
                    a + b
                }
            });
            if op == ReduceOp::Mean {
                slow.iter_mut().for_each(|v| *v /= 30.0);
            }
            for (a, b) in fast.iter().zip(&slow) {
                assert!((a - b).abs() < 1e-5, "{op:?}: {fast:?} vs {slow:?}");
            }
        }
        assert_eq!(middle(&xd, &[0, 2, 3]), Some((3, 4, 10)));
        assert_eq!(middle(&xd, &[1, 3]), None);
    }

    #[test]
    fn long_sums_are_accurate_and_match_over_every_path() {
        // 16M values of 0.1: naive float32 accumulation is off by ~1e-2 relative.
        let n = 1 << 24;
        let x = vec![0.1f32; n];
        let exact = 0.1f32 as f64 * n as f64;
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let mut out = [0.0f32];
            reduce(op, &x, &[n], &[0], &mut out);
            let want = if op == ReduceOp::Sum {
                exact
            } else {
                exact / n as f64
            };
            let rel = ((out[0] as f64 - want) / want).abs();
            assert!(
                rel < 1e-6,
                "{op:?}: {} vs {want} (relative {rel:e})",
                out[0]
            );
        }
        // Leading-axis sums (bias gradients) block their rows.
        let rows = 1 << 16;
        let x = vec![0.1f32; rows * 4];
        let mut out = [0.0f32; 4];
        reduce(ReduceOp::Sum, &x, &[rows, 4], &[0], &mut out);
        let want = 0.1f32 as f64 * rows as f64;
        for v in out {
            assert!(((v as f64 - want) / want).abs() < 1e-5, "{v} vs {want}");
        }
        // Odd lengths around the block sizes agree with an f64 reference.
        for len in [0, 1, 7, 8, 9, 2047, 2048, 2049, 4097, 100_003] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32) * 0.01 - 0.5)
                .collect();
            let mut out = [0.0f32];
            reduce(ReduceOp::Sum, &x, &[len], &[0], &mut out);
            let want: f64 = x.iter().map(|&v| v as f64).sum();
            let scale: f64 = x.iter().map(|&v| (v as f64).abs()).sum();
            assert!(
                (out[0] as f64 - want).abs() <= 1e-6 * (1.0 + scale),
                "len {len}: {} vs {want}",
                out[0]
            );
            let mut mx = [0.0f32];
            reduce(ReduceOp::Max, &x, &[len], &[0], &mut mx);
            let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(mx[0], want, "max of len {len}");
        }
    }
}
