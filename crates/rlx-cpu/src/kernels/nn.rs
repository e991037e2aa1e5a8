//! Neural-network kernels: softmax / log-softmax over any axis, fused softmax cross-entropy, MSE,
//! embedding gather / scatter-add, and normalisation over the last axis with its VJP.
use super::{math, PAR_MIN};
use rayon::prelude::*;
use rlx_ir::{Error, Result};

/// Softmax (or log-softmax) of `x` along `axis`.
#[inline(always)]
pub fn softmax(x: &[f32], xd: &[usize], axis: usize, log: bool, out: &mut [f32]) {
    let len = xd[axis];
    let inner: usize = xd[axis + 1..].iter().product();
    let outer: usize = xd[..axis].iter().product();
    if len == 0 || out.is_empty() {
        return;
    }
    if inner == 1 {
        // The usual case: contiguous rows, in place in the output, rows split across threads.
        let row = crate::isa::inlined(
            #[inline(always)]
            |(o, r): (&mut [f32], &[f32])| {
                o.copy_from_slice(r);
                softmax_row(o, log);
            },
        );
        if out.len() >= PAR_MIN {
            out.par_chunks_mut(len)
                .zip(x.par_chunks(len))
                .for_each(|r| {
                    crate::isa::dispatch(
                        #[inline(always)]
                        || row(r),
                    )
                });
        } else {
            crate::isa::dispatch(
                #[inline(always)]
                || {
                    for r in 0..out.len() / len {
                        row((&mut out[r * len..][..len], &x[r * len..][..len]));
                    }
                },
            );
        }
        return;
    }
    let mut buf = vec![0.0f32; len];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| o * len * inner + j * inner + i;
            for (j, v) in buf.iter_mut().enumerate() {
                *v = x[at(j)];
            }
            softmax_row(&mut buf, log);
            for (j, v) in buf.iter().enumerate() {
                out[at(j)] = *v;
            }
        }
    }
}

/// Softmax (or log-softmax) of one row, in place.
#[inline(always)]
fn softmax_row(row: &mut [f32], log: bool) {
    let max = math::max(row);
    // All -inf: shift by 0 (0/0 = NaN, as numpy). +inf or NaN: propagate to NaN, as numpy.
    let max = if max == f32::NEG_INFINITY { 0.0 } else { max };
    if log {
        let lse = max + logsumexp_shifted(row, max).ln();
        for v in row.iter_mut() {
            *v -= lse;
        }
    } else {
        for v in row.iter_mut() {
            *v = math::exp(*v - max);
        }
        let inv = 1.0 / math::sum(row);
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// `sum(exp(row - max))` without writing the row: blocks of the row go through a stack buffer,
/// so `exp` runs as one vectorisable loop (8 scalar accumulators each calling it did not
/// vectorise).
#[inline(always)]
fn logsumexp_shifted(row: &[f32], max: f32) -> f32 {
    let mut buf = [0.0f32; 64];
    let mut total = 0.0f32;
    for block in row.chunks(64) {
        let b = &mut buf[..block.len()];
        for j in 0..b.len() {
            b[j] = math::exp(block[j] - max);
        }
        total += math::sum(b);
    }
    total
}

/// The label of rows that `cross_entropy` leaves out (PyTorch's default `ignore_index`).
pub const IGNORE_LABEL: i32 = -100;

fn check_label(y: i32, classes: usize) -> Result<usize> {
    if y < 0 || y as usize >= classes {
        return Err(Error::input(
            "labels",
            format!("[cross_entropy] label {y} is out of range [0, {classes}) (and is not the ignored label {IGNORE_LABEL})"),
        ));
    }
    Ok(y as usize)
}

/// The rows counted by the mean: labels in range; ignored rows skipped; others an error.
pub(super) fn counted(labels: &[i32], classes: usize) -> Result<usize> {
    let mut n = 0;
    for &y in labels {
        if y != IGNORE_LABEL {
            check_label(y, classes)?;
            n += 1;
        }
    }
    Ok(n)
}

/// Mean over rows (those whose label is not [`IGNORE_LABEL`]) of
/// `logsumexp(logits) - logits[label]`.
#[inline(always)]
pub fn cross_entropy(logits: &[f32], ld: &[usize], labels: &[i32]) -> Result<f32> {
    let c = ld[1];
    let n = counted(labels, c)?;
    let row_loss = crate::isa::inlined(
        #[inline(always)]
        |(row, &y): (&[f32], &i32)| -> f64 {
            if y == IGNORE_LABEL {
                return 0.0;
            }
            let max = math::max(row);
            (max + logsumexp_shifted(row, max).ln() - row[y as usize]) as f64
        },
    );
    let total: f64 = if logits.len() >= PAR_MIN {
        logits
            .par_chunks(c)
            .zip(labels.par_iter())
            .map(|r| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || row_loss(r),
                )
            })
            .sum()
    } else {
        crate::isa::dispatch(
            #[inline(always)]
            || {
                let mut total = -0.0f64;
                for (r, y) in labels.iter().enumerate() {
                    total += row_loss((&logits[r * c..][..c], y));
                }
                total
            },
        )
    };
    if n == 0 {
        return Ok(f32::NAN); // the mean over no rows, as numpy and PyTorch give
    }
    Ok((total / n as f64) as f32)
}

/// `(softmax(logits) - onehot(labels)) * g / N` (N: the rows not ignored; ignored rows get 0).
#[inline(always)]
pub fn cross_entropy_grad(
    logits: &[f32],
    ld: &[usize],
    labels: &[i32],
    g: f32,
    out: &mut [f32],
) -> Result<()> {
    let c = ld[1];
    let n = counted(labels, c)?;
    let scale = g / n.max(1) as f32;
    let row = crate::isa::inlined(
        #[inline(always)]
        |((row, o), &y): ((&[f32], &mut [f32]), &i32)| {
            if y == IGNORE_LABEL {
                o.fill(0.0);
                return;
            }
            o.copy_from_slice(row);
            softmax_row(o, false);
            o[y as usize] -= 1.0;
            for v in o.iter_mut() {
                *v *= scale;
            }
        },
    );
    if out.len() >= PAR_MIN {
        logits
            .par_chunks(c)
            .zip(out.par_chunks_mut(c))
            .zip(labels.par_iter())
            .for_each(|r| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || row(r),
                )
            });
    } else {
        crate::isa::dispatch(
            #[inline(always)]
            || {
                for (r, y) in labels.iter().enumerate() {
                    row(((&logits[r * c..][..c], &mut out[r * c..][..c]), y));
                }
            },
        );
    }
    Ok(())
}

/// Mean of squared differences (NaN for no elements, as a mean over nothing is).
#[inline(always)]
pub fn mse(p: &[f32], t: &[f32]) -> f32 {
    if p.is_empty() {
        return f32::NAN;
    }
    let s: f64 = p
        .iter()
        .zip(t)
        .map(|(&a, &b)| ((a - b) as f64).powi(2))
        .sum();
    (s / p.len() as f64) as f32
}

fn check_id(id: i32, rows: usize) -> Result<usize> {
    if id < 0 || id as usize >= rows {
        return Err(Error::input(
            "ids",
            format!("[gather] id {id} is out of range [0, {rows})"),
        ));
    }
    Ok(id as usize)
}

/// `out[i] = table[ids[i]]` (rows of `width` elements).
#[inline(always)]
pub fn gather<T: Copy>(table: &[T], rows: usize, ids: &[i32], out: &mut [T]) -> Result<()> {
    let width = table.len().checked_div(rows).unwrap_or(0);
    for (o, &id) in out.chunks_mut(width.max(1)).zip(ids) {
        let r = check_id(id, rows)?;
        o.copy_from_slice(&table[r * width..(r + 1) * width]);
    }
    Ok(())
}

/// `out = 0; out[ids[i]] += g[i]`.
#[inline(always)]
pub fn scatter_add<T: Copy + Default + std::ops::AddAssign>(
    ids: &[i32],
    g: &[T],
    rows: usize,
    out: &mut [T],
) -> Result<()> {
    let width = out.len().checked_div(rows).unwrap_or(0);
    out.fill(T::default());
    for (gi, &id) in g.chunks(width.max(1)).zip(ids) {
        let r = check_id(id, rows)?;
        out[r * width..(r + 1) * width]
            .iter_mut()
            .zip(gi)
            .for_each(|(o, &v)| *o += v);
    }
    Ok(())
}

/// Mean and 1/sqrt(var + eps) of one row. The row kernels below are index loops over slices of
/// one length, not iterator chains: a `Zip`'s `fold` was left out of line, compiled for the
/// baseline (SSE2, one float at a time in the sums), so layer norms ran at ~1.4 ns an element
/// whatever the CPU.
#[inline(always)]
fn row_stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = math::sum(row) / n;
    let mut acc = [0.0f32; 8];
    let whole = row.len() / 8 * 8;
    for c in row.chunks_exact(8) {
        let c: &[f32; 8] = c.try_into().expect("chunks of 8");
        for l in 0..8 {
            let d = c[l] - mean;
            acc[l] += d * d;
        }
    }
    let mut rest = 0.0f32;
    for &v in &row[whole..] {
        rest += (v - mean) * (v - mean);
    }
    let mut total = 0.0f32;
    for a in acc {
        total += a;
    }
    let var = (total + rest) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Below this many elements a layer norm (forward or backward) runs on one thread. Its rows
/// cost up to 1 ns an element (up to six passes, three of them sums: the tiny GPT's 131K element
/// gradient took 120 us on one Zen 3 core), several times an elementwise kernel's, so it
/// splits at an eighth of [`PAR_MIN`] (about 30 us of work against a few us for the split).
const NORM_PAR_MIN: usize = PAR_MIN / 8;

/// Elements of the rows one parallel task of a layer norm takes (whole rows, at least one).
const NORM_TASK: usize = 4096;

/// Runs `block(first_row, x_rows, out_rows)` over blocks of whole rows of `width`, in parallel
/// when there are at least [`NORM_PAR_MIN`] elements; each block's loop is compiled for the
/// CPU's instruction set.
fn by_row_blocks<'a>(
    x: &'a [f32],
    out: &mut [f32],
    width: usize,
    block: impl Fn(usize, &'a [f32], &mut [f32]) + Sync,
) {
    if width == 0 || out.is_empty() {
        return;
    }
    let rows = (NORM_TASK / width).max(1);
    let run = |(b, (xb, ob)): (usize, (&'a [f32], &mut [f32]))| {
        crate::isa::dispatch(
            #[inline(always)]
            || block(b * rows, xb, ob),
        )
    };
    if out.len() >= NORM_PAR_MIN {
        x.par_chunks(rows * width)
            .zip(out.par_chunks_mut(rows * width))
            .enumerate()
            .for_each(run);
    } else {
        run((0, (x, out)));
    }
}

/// `(x - mean) * rstd` per row of the last axis.
#[inline(always)]
pub fn normalize(x: &[f32], width: usize, eps: f32, out: &mut [f32]) {
    by_row_blocks(
        x,
        out,
        width,
        #[inline(always)]
        |_, xb, ob| {
            for r in 0..xb.len() / width {
                let row = &xb[r * width..][..width];
                let o = &mut ob[r * width..][..width];
                let (mean, rstd) = row_stats(row, eps);
                for j in 0..width {
                    o[j] = (row[j] - mean) * rstd;
                }
            }
        },
    );
}

/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` per row.
#[inline(always)]
pub fn normalize_grad(x: &[f32], g: &[f32], width: usize, eps: f32, out: &mut [f32]) {
    normalize_grad_add(x, g, None, width, eps, out)
}

/// `normalize_grad(x, g) + acc` (`acc` of the same shape) in one pass: each row's result gets
/// `acc` added while it is in cache (the fusion pass's `NormalizeGradAdd`).
pub fn normalize_grad_add(
    x: &[f32],
    g: &[f32],
    acc: Option<&[f32]>,
    width: usize,
    eps: f32,
    out: &mut [f32],
) {
    let n = width as f32;
    by_row_blocks(
        x,
        out,
        width,
        #[inline(always)]
        |first, xb, ob| {
            for r in 0..xb.len() / width {
                let at = (first + r) * width;
                let row = &xb[r * width..][..width];
                let gr = &g[at..][..width];
                let o = &mut ob[r * width..][..width];
                let (mean, rstd) = row_stats(row, eps);
                // o holds xhat * g first, to sum it vectorised.
                for j in 0..width {
                    o[j] = gr[j] * (row[j] - mean) * rstd;
                }
                let (mg, mgx) = (math::sum(gr) / n, math::sum(o) / n);
                for j in 0..width {
                    o[j] = rstd * (gr[j] - mg - (row[j] - mean) * rstd * mgx);
                }
                if let Some(acc) = acc {
                    let a = &acc[at..][..width];
                    for j in 0..width {
                        o[j] += a[j];
                    }
                }
            }
        },
    );
}
