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
                || out.chunks_mut(len).zip(x.chunks(len)).for_each(row),
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
        row.iter_mut().for_each(|v| *v -= lse);
    } else {
        row.iter_mut().for_each(|v| *v = math::exp(*v - max));
        let inv = 1.0 / math::sum(row);
        row.iter_mut().for_each(|v| *v *= inv);
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
        b.iter_mut()
            .zip(block)
            .for_each(|(e, &v)| *e = math::exp(v - max));
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
            || logits.chunks(c).zip(labels).map(row_loss).sum(),
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
            o.iter_mut().for_each(|v| *v *= scale);
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
                logits
                    .chunks(c)
                    .zip(out.chunks_mut(c))
                    .zip(labels)
                    .for_each(row)
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

/// Mean and 1/sqrt(var + eps) of one row.
#[inline(always)]
fn row_stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = math::sum(row) / n;
    let mut acc = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let rest: f32 = chunks
        .remainder()
        .iter()
        .map(|v| (v - mean) * (v - mean))
        .sum();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += (v - mean) * (v - mean);
        }
    }
    let var = (acc.iter().sum::<f32>() + rest) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// `(x - mean) * rstd` per row of the last axis.
#[inline(always)]
pub fn normalize(x: &[f32], width: usize, eps: f32, out: &mut [f32]) {
    let row = crate::isa::inlined(
        #[inline(always)]
        |(row, o): (&[f32], &mut [f32])| {
            let (mean, rstd) = row_stats(row, eps);
            row.iter()
                .zip(o.iter_mut())
                .for_each(|(v, o)| *o = (v - mean) * rstd);
        },
    );
    if out.len() >= PAR_MIN {
        x.par_chunks(width)
            .zip(out.par_chunks_mut(width))
            .for_each(|r| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || row(r),
                )
            });
    } else {
        crate::isa::dispatch(
            #[inline(always)]
            || x.chunks(width).zip(out.chunks_mut(width)).for_each(row),
        );
    }
}

/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` per row.
#[inline(always)]
pub fn normalize_grad(x: &[f32], g: &[f32], width: usize, eps: f32, out: &mut [f32]) {
    normalize_grad_add(x, g, None, width, eps, out)
}

/// One row of `normalize_grad_add`: its index, the row of `x` and of `g`, and its output.
type Row<'a, 'b> = (usize, ((&'a [f32], &'a [f32]), &'b mut [f32]));

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
    let row = crate::isa::inlined(
        #[inline(always)]
        |(i, ((row, gr), o)): Row| {
            let (mean, rstd) = row_stats(row, eps);
            // o holds xhat * g first, to sum it vectorised.
            for ((v, gv), o) in row.iter().zip(gr).zip(o.iter_mut()) {
                *o = gv * (v - mean) * rstd;
            }
            let (mg, mgx) = (math::sum(gr) / n, math::sum(o) / n);
            for ((v, gv), o) in row.iter().zip(gr).zip(o.iter_mut()) {
                *o = rstd * (gv - mg - (v - mean) * rstd * mgx);
            }
            if let Some(acc) = acc {
                let a = &acc[i * width..(i + 1) * width];
                o.iter_mut().zip(a).for_each(|(o, a)| *o += a);
            }
        },
    );
    if out.len() >= PAR_MIN {
        x.par_chunks(width)
            .zip(g.par_chunks(width))
            .zip(out.par_chunks_mut(width))
            .enumerate()
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
                x.chunks(width)
                    .zip(g.chunks(width))
                    .zip(out.chunks_mut(width))
                    .enumerate()
                    .for_each(row)
            },
        );
    }
}
