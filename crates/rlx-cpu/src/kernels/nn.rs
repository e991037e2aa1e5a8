//! Neural-network kernels: softmax / log-softmax over any axis, fused softmax cross-entropy, MSE.
use rlx_ir::{Error, Result};

/// Softmax (or log-softmax) of `x` along `axis`.
pub fn softmax(x: &[f32], xd: &[usize], axis: usize, log: bool, out: &mut [f32]) {
    let len = xd[axis];
    let inner: usize = xd[axis + 1..].iter().product();
    let outer: usize = xd[..axis].iter().product();
    if len == 0 || out.is_empty() {
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

fn softmax_row(row: &mut [f32], log: bool) {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let max = if max.is_finite() { max } else { 0.0 };
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        let e = (*v - max).exp();
        sum += e;
        if !log {
            *v = e;
        }
    }
    if log {
        let lse = max + sum.ln();
        row.iter_mut().for_each(|v| *v -= lse);
    } else {
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

fn check_label(y: i32, classes: usize) -> Result<usize> {
    if y < 0 || y as usize >= classes {
        return Err(Error::input("labels", format!("[cross_entropy] label {y} is out of range [0, {classes})")));
    }
    Ok(y as usize)
}

/// Mean over rows of `logsumexp(logits) - logits[label]`.
pub fn cross_entropy(logits: &[f32], ld: &[usize], labels: &[i32]) -> Result<f32> {
    let c = ld[1];
    let mut total = 0.0f64;
    for (row, &y) in logits.chunks(c).zip(labels) {
        let y = check_label(y, c)?;
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
        total += (max + sum.ln() - row[y]) as f64;
    }
    Ok((total / labels.len().max(1) as f64) as f32)
}

/// `(softmax(logits) - onehot(labels)) * g / N`.
pub fn cross_entropy_grad(logits: &[f32], ld: &[usize], labels: &[i32], g: f32, out: &mut [f32]) -> Result<()> {
    let c = ld[1];
    let scale = g / labels.len().max(1) as f32;
    for ((row, o), &y) in logits.chunks(c).zip(out.chunks_mut(c)).zip(labels) {
        let y = check_label(y, c)?;
        o.copy_from_slice(row);
        softmax_row(o, false);
        o[y] -= 1.0;
        o.iter_mut().for_each(|v| *v *= scale);
    }
    Ok(())
}

/// Mean of squared differences.
pub fn mse(p: &[f32], t: &[f32]) -> f32 {
    let s: f64 = p.iter().zip(t).map(|(&a, &b)| ((a - b) as f64).powi(2)).sum();
    (s / p.len().max(1) as f64) as f32
}
