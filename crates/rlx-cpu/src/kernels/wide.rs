//! float64 kernels: the ops that compute in float64 on the CPU (elementwise math, the matrix
//! product, softmax and its losses, normalisation), as plain loops in float64 throughout. The
//! float64 binary ops, comparisons and reductions share the generic kernels of
//! `elementwise.rs` and `reduce.rs`. float64 is for accuracy (gradient checks, scientific
//! work), so these favour clear, exact code over speed.
use super::nn::{counted, IGNORE_LABEL};
use super::Strided;
use crate::sgemm::{fallback, View};
use rlx_ir::{Result, UnaryOp};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `op(x)` elementwise (the float64 forms of `elementwise::unary`).
pub fn unary(op: UnaryOp, x: &[f64], out: &mut [f64]) {
    let f: fn(f64, f64) -> f64 = match op {
        UnaryOp::Neg => |x, _| -x,
        UnaryOp::Relu => |x, _| if x < 0.0 { 0.0 } else { x }, // NaN stays NaN
        UnaryOp::Tanh => |x, _| x.tanh(),
        UnaryOp::Sigmoid => |x, _| 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Exp => |x, _| x.exp(),
        UnaryOp::Log => |x, _| x.ln(),
        UnaryOp::Sqrt => |x, _| x.sqrt(),
        UnaryOp::PowScalar(_) => |x, p| x.powf(p),
        UnaryOp::Gelu => |x, _| 0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)),
        UnaryOp::GeluDeriv => |x, _| {
            0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
                + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
        },
        UnaryOp::GeluTanh => |x, _| gelu_tanh(x).0,
        UnaryOp::GeluTanhDeriv => |x, _| gelu_tanh(x).1,
    };
    let p = match op {
        UnaryOp::PowScalar(p) => p as f64,
        _ => 0.0,
    };
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = f(v, p));
}

/// The tanh approximation of GELU and its derivative.
fn gelu_tanh(x: f64) -> (f64, f64) {
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let t = u.tanh();
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * x * x);
    (
        0.5 * x * (1.0 + t),
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
    )
}

/// `out = op(a) @ op(b)` over the last two dims, leading dims broadcast (numpy's rules), each
/// product through the `gemm` crate's float64 kernel.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    a: &[f64],
    ad: &[usize],
    ta: bool,
    b: &[f64],
    bd: &[usize],
    tb: bool,
    out: &mut [f64],
    od: &[usize],
) {
    let r = od.len();
    let (m, n) = (od[r - 2], od[r - 1]);
    let (ra, ca) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (rb, cb) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let k = if ta { ra } else { ca };
    if out.is_empty() {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    // Element (i, j) of op(a) sits at i * rs + j * cs inside its matrix.
    let view = |t: bool, cols: usize, off: usize| {
        let v = View::rows(off, cols);
        if t {
            v.t()
        } else {
            v
        }
    };
    let batch = &od[..r - 2];
    let (sa, sb) = (
        Strided::broadcast(&ad[..ad.len() - 2], batch),
        Strided::broadcast(&bd[..bd.len() - 2], batch),
    );
    // The matrix of each operand that output matrix `i` reads.
    let matrix = |s: &Strided, mut i: usize| {
        let mut at = 0;
        for d in (0..batch.len()).rev() {
            at += (i % batch[d]) * s.strides[d];
            i /= batch[d];
        }
        at
    };
    let parallel = m * n * k >= 64 * 64 * 64;
    for (i, o) in out.chunks_mut(m * n).enumerate() {
        let (ai, bi) = (matrix(&sa, i), matrix(&sb, i));
        fallback::gemm(
            m,
            n,
            k,
            o,
            View::rows(0, n),
            0.0,
            a,
            view(ta, ca, ai * ra * ca),
            b,
            view(tb, cb, bi * rb * cb),
            parallel,
        );
    }
}

/// Softmax (or log-softmax) of `x` along `axis`.
pub fn softmax(x: &[f64], xd: &[usize], axis: usize, log: bool, out: &mut [f64]) {
    let len = xd[axis];
    let inner: usize = xd[axis + 1..].iter().product();
    let outer: usize = xd[..axis].iter().product();
    let mut row = vec![0.0f64; len];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| o * len * inner + j * inner + i;
            for (j, v) in row.iter_mut().enumerate() {
                *v = x[at(j)];
            }
            softmax_row(&mut row, log);
            for (j, v) in row.iter().enumerate() {
                out[at(j)] = *v;
            }
        }
    }
}

/// The largest value of a row (NaN if any is NaN).
fn row_max(row: &[f64]) -> f64 {
    row.iter().fold(
        f64::NEG_INFINITY,
        |m, &v| {
            if m > v || m.is_nan() {
                m
            } else {
                v
            }
        },
    )
}

fn softmax_row(row: &mut [f64], log: bool) {
    let max = row_max(row);
    let sum: f64 = row.iter().map(|&v| (v - max).exp()).sum();
    if log {
        let lse = max + sum.ln();
        row.iter_mut().for_each(|v| *v -= lse);
    } else {
        row.iter_mut().for_each(|v| *v = (*v - max).exp() / sum);
    }
}

/// Mean over the rows not labelled [`IGNORE_LABEL`] of `logsumexp(logits) - logits[label]`
/// (NaN when every row is ignored).
pub fn cross_entropy(logits: &[f64], ld: &[usize], labels: &[i32]) -> Result<f64> {
    let c = ld[1];
    let n = counted(labels, c)?;
    let mut total = 0.0;
    for (row, &y) in logits.chunks(c).zip(labels) {
        if y != IGNORE_LABEL {
            let max = row_max(row);
            let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f64>().ln();
            total += lse - row[y as usize];
        }
    }
    Ok(if n == 0 { f64::NAN } else { total / n as f64 })
}

/// `(softmax(logits) - onehot(labels)) * g / N`; ignored rows get 0.
pub fn cross_entropy_grad(
    logits: &[f64],
    ld: &[usize],
    labels: &[i32],
    g: f64,
    out: &mut [f64],
) -> Result<()> {
    let c = ld[1];
    let scale = g / counted(labels, c)?.max(1) as f64;
    for ((row, o), &y) in logits.chunks(c).zip(out.chunks_mut(c)).zip(labels) {
        if y == IGNORE_LABEL {
            o.fill(0.0);
            continue;
        }
        o.copy_from_slice(row);
        softmax_row(o, false);
        o[y as usize] -= 1.0;
        o.iter_mut().for_each(|v| *v *= scale);
    }
    Ok(())
}

/// Mean of squared differences (NaN for no elements).
pub fn mse(p: &[f64], t: &[f64]) -> f64 {
    let s: f64 = p.iter().zip(t).map(|(&a, &b)| (a - b) * (a - b)).sum();
    s / p.len() as f64
}

/// Mean and `1 / sqrt(var + eps)` of a row (two passes).
fn row_stats(row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// `(x - mean) * rstd` per row of the last axis.
pub fn normalize(x: &[f64], width: usize, eps: f64, out: &mut [f64]) {
    for (row, o) in x.chunks(width).zip(out.chunks_mut(width)) {
        let (mean, rstd) = row_stats(row, eps);
        row.iter()
            .zip(o.iter_mut())
            .for_each(|(v, o)| *o = (v - mean) * rstd);
    }
}

/// `rstd * (g - mean(g) - xhat * mean(g * xhat))` per row, plus `acc` where given.
pub fn normalize_grad_add(
    x: &[f64],
    g: &[f64],
    acc: Option<&[f64]>,
    width: usize,
    eps: f64,
    out: &mut [f64],
) {
    let n = width as f64;
    for (i, ((row, gr), o)) in x
        .chunks(width)
        .zip(g.chunks(width))
        .zip(out.chunks_mut(width))
        .enumerate()
    {
        let (mean, rstd) = row_stats(row, eps);
        let mg = gr.iter().sum::<f64>() / n;
        let mgx = row
            .iter()
            .zip(gr)
            .map(|(v, gv)| gv * (v - mean) * rstd)
            .sum::<f64>()
            / n;
        for ((v, gv), o) in row.iter().zip(gr).zip(o.iter_mut()) {
            *o = rstd * (gv - mg - (v - mean) * rstd * mgx);
        }
        if let Some(acc) = acc {
            let a = &acc[i * width..(i + 1) * width];
            o.iter_mut().zip(a).for_each(|(o, a)| *o += a);
        }
    }
}
