//! Optimizer updates, in place over the parameter, with PyTorch's rules.
use rlx_runtime::{OptimHyper, OptimRule};

/// Applies one update. `step` is the 1-based step count (already incremented for this step).
#[inline(always)]
pub fn update(
    rule: OptimRule,
    h: &OptimHyper,
    step: i32,
    p: &mut [f32],
    g: &[f32],
    state: &mut [&mut [f32]],
) {
    let (lr, wd) = (h.lr, h.weight_decay);
    match rule {
        OptimRule::Sgd { momentum: false } => crate::isa::dispatch(|| {
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= lr * (g + wd * *p);
            }
        }),
        OptimRule::Sgd { momentum: true } => {
            let buf = &mut *state[0];
            let first = step <= 1;
            crate::isa::dispatch(|| {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                    let d = g + wd * *p;
                    *b = if first { d } else { h.momentum * *b + d };
                    *p -= lr * *b;
                }
            });
        }
        OptimRule::Adam | OptimRule::AdamW => {
            let t = step.max(1);
            let bc1 = 1.0 - h.beta1.powi(t);
            let inv_bc2_sqrt = 1.0 / (1.0 - h.beta2.powi(t)).sqrt();
            let step_size = lr / bc1;
            // Decoupled decay scales p first (AdamW); L2 decay adds wd * p to the gradient (Adam).
            let (decay, l2) = if rule == OptimRule::AdamW {
                (1.0 - lr * wd, 0.0)
            } else {
                (1.0, wd)
            };
            let (b1, b2, eps) = (h.beta1, h.beta2, h.eps);
            let (m, v) = state.split_at_mut(1);
            let (m, v) = (&mut *m[0], &mut *v[0]);
            let n = p.len().min(g.len()).min(m.len()).min(v.len());
            let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
            crate::isa::dispatch(|| {
                for i in 0..n {
                    let pi = p[i] * decay;
                    let gi = g[i] + l2 * pi;
                    let mi = b1 * m[i] + (1.0 - b1) * gi;
                    let vi = b2 * v[i] + (1.0 - b2) * gi * gi;
                    m[i] = mi;
                    v[i] = vi;
                    p[i] = pi - step_size * mi / (vi.sqrt() * inv_bc2_sqrt + eps);
                }
            });
        }
    }
}
