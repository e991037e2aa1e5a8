//! Optimizer updates, in place over the parameter, with PyTorch's rules.
use rlx_runtime::{OptimHyper, OptimRule};

/// Applies one update. `step` is the 1-based step count (already incremented for this step).
pub fn update(rule: OptimRule, h: &OptimHyper, step: i32, p: &mut [f32], g: &[f32], state: &mut [&mut [f32]]) {
    let (lr, wd) = (h.lr, h.weight_decay);
    match rule {
        OptimRule::Sgd { momentum: false } => {
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= lr * (g + wd * *p);
            }
        }
        OptimRule::Sgd { momentum: true } => {
            let buf = &mut *state[0];
            let first = step <= 1;
            for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                let d = g + wd * *p;
                *b = if first { d } else { h.momentum * *b + d };
                *p -= lr * *b;
            }
        }
        OptimRule::Adam | OptimRule::AdamW => {
            let t = step.max(1);
            let bc1 = 1.0 - h.beta1.powi(t);
            let bc2_sqrt = (1.0 - h.beta2.powi(t)).sqrt();
            let step_size = lr / bc1;
            let decoupled = rule == OptimRule::AdamW;
            let (m, v) = state.split_at_mut(1);
            let (m, v) = (&mut *m[0], &mut *v[0]);
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = if decoupled {
                    *p *= 1.0 - lr * wd;
                    g
                } else {
                    g + wd * *p
                };
                *m = h.beta1 * *m + (1.0 - h.beta1) * g;
                *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
                let denom = v.sqrt() / bc2_sqrt + h.eps;
                *p -= step_size * *m / denom;
            }
        }
    }
}
