//! The training update on the host: gradient accumulation, the non-finite check, global-norm
//! clipping, and the optimizer rules in place over each parameter, as PyTorch defines them.
use rayon::prelude::*;
use rlx_runtime::{hyper_col as col, stat, OptimHyper, OptimRule};

/// One parameter's settings (a row of the optimizer's `hyper` table).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub lr: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub nesterov: bool,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub alpha: f32,
    pub lr_decay: f32,
    pub one_minus_alpha: f32,
    pub one_minus_dampening: f32,
    pub one_minus_beta1: f32,
    pub one_minus_beta2: f32,
}

impl Hyper {
    pub fn from_row(r: &[f32]) -> Hyper {
        Hyper {
            lr: r[col::LR],
            weight_decay: r[col::WEIGHT_DECAY],
            momentum: r[col::MOMENTUM],
            dampening: r[col::DAMPENING],
            nesterov: r[col::NESTEROV] != 0.0,
            beta1: r[col::BETA1],
            beta2: r[col::BETA2],
            eps: r[col::EPS],
            alpha: r[col::ALPHA],
            lr_decay: r[col::LR_DECAY],
            one_minus_alpha: r[col::ONE_MINUS_ALPHA],
            one_minus_dampening: r[col::ONE_MINUS_DAMPENING],
            one_minus_beta1: r[col::ONE_MINUS_BETA1],
            one_minus_beta2: r[col::ONE_MINUS_BETA2],
        }
    }

    /// The single set of settings a run may carry (no groups).
    pub fn from_run(h: &OptimHyper) -> Hyper {
        Hyper {
            lr: h.lr,
            weight_decay: h.weight_decay,
            momentum: h.momentum,
            dampening: 0.0,
            nesterov: false,
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            alpha: 0.99,
            lr_decay: 0.0,
            one_minus_alpha: (1.0 - 0.99f64) as f32,
            one_minus_dampening: 1.0,
            one_minus_beta1: (1.0 - h.beta1 as f64) as f32,
            one_minus_beta2: (1.0 - h.beta2 as f64) as f32,
        }
    }
}

/// One parameter's memory for an update.
pub struct ParamSlot<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub acc: Option<&'a mut [f32]>,
    pub state: Vec<&'a mut [f32]>,
    pub step: &'a mut i32,
    pub started: Option<&'a mut i32>,
    pub hyper: Hyper,
}

/// Step options fixed at compile time.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub clip: Option<f32>,
    pub accumulate: u32,
    pub skip_nonfinite: bool,
}

fn sum_sq(g: &[f32]) -> f64 {
    g.iter().map(|&x| (x as f64) * (x as f64)).sum()
}

/// Runs the end of one training step over `params`; `stats` persists across runs
/// ([`rlx_runtime::stat`]).
pub fn train_update(
    rule: OptimRule,
    opts: Options,
    loss: f32,
    stats: &mut [f32],
    params: &mut [ParamSlot<'_>],
) {
    let k = opts.accumulate.max(1);
    stats[stat::UPDATED] = 0.0;
    // The global norm costs a pass over every gradient: taken only when clipping or skipping.
    let need_norm = opts.clip.is_some() || opts.skip_nonfinite;
    let mut this_sq = None;
    if opts.skip_nonfinite {
        let sq: f64 = params.iter().map(|s| sum_sq(s.g)).sum();
        if !(loss.is_finite() && sq.is_finite()) {
            stats[stat::SKIPPED] += 1.0;
            return;
        }
        this_sq = Some(sq);
    }
    // With accumulation the update uses acc / k; `scale` folds the 1/k and the clip factor.
    let mut scale = 1.0f32;
    if k > 1 {
        let micro = stats[stat::MICRO] as u32;
        for s in params.iter_mut() {
            let acc = s.acc.as_deref_mut().expect("accumulation buffer planned");
            if micro == 0 {
                acc.copy_from_slice(s.g);
            } else {
                acc.iter_mut().zip(s.g).for_each(|(a, &g)| *a += g);
            }
        }
        if micro + 1 < k {
            stats[stat::MICRO] = (micro + 1) as f32;
            return;
        }
        stats[stat::MICRO] = 0.0;
        scale = 1.0 / k as f32;
    }
    if need_norm {
        let total: f64 = match this_sq {
            Some(sq) if k == 1 => sq,
            _ => params
                .iter()
                .map(|s| match &s.acc {
                    Some(a) => sum_sq(a),
                    None => sum_sq(s.g),
                })
                .sum(),
        };
        let norm = (total.sqrt() * scale as f64) as f32;
        stats[stat::GRAD_NORM] = norm;
        if opts.skip_nonfinite && !norm.is_finite() {
            stats[stat::SKIPPED] += 1.0;
            return;
        }
        if let Some(c) = opts.clip {
            let coef = c / (norm + 1e-6);
            if coef < 1.0 {
                scale *= coef;
            }
        }
    } else {
        stats[stat::GRAD_NORM] = f32::NAN;
    }
    let total: usize = params.iter().map(|s| s.p.len()).sum();
    // Only on a worker of a pool (`crate::pool::run` puts every program run on one; a direct
    // caller elsewhere may be in a forked child, whose global pool is its parent's).
    let parallel = total >= PAR_UPDATE
        && rayon::current_thread_index().is_some()
        && rayon::current_num_threads() > 1;
    for s in params.iter_mut() {
        *s.step += 1;
        let step = *s.step;
        let h = s.hyper;
        let g: &[f32] = match &s.acc {
            Some(a) => a,
            None => s.g,
        };
        // Each piece's loop runs compiled for the CPU's instruction set (see `isa`).
        let run = |started: Option<&mut i32>, p: &mut [f32], g: &[f32], st: &mut [&mut [f32]]| {
            crate::isa::dispatch(
                #[inline(always)]
                || update(rule, &h, step, started, p, g, scale, st),
            )
        };
        let n = s.p.len().min(g.len());
        if !parallel || n < 2 * UPDATE_PIECE || s.state.iter().any(|x| x.len() < n) {
            run(s.started.as_deref_mut(), s.p, g, &mut s.state);
            continue;
        }
        // Every element's update is independent: pieces of the parameter (with the same pieces
        // of its gradient and state) run on the pool. Each piece sees the flag as it was; the
        // first piece's flag afterwards is the parameter's.
        let before = s.started.as_deref().copied();
        let mut states: Vec<_> = s
            .state
            .iter_mut()
            .map(|x| x[..n].chunks_mut(UPDATE_PIECE))
            .collect();
        let pieces: Vec<_> = s.p[..n]
            .chunks_mut(UPDATE_PIECE)
            .zip(g[..n].chunks(UPDATE_PIECE))
            .map(|(p, g)| {
                let st: Vec<&mut [f32]> = states.iter_mut().filter_map(|c| c.next()).collect();
                (p, g, st)
            })
            .collect();
        let after: Vec<Option<i32>> = pieces
            .into_par_iter()
            .map(|(p, g, mut st)| {
                let mut flag = before;
                run(flag.as_mut(), p, g, &mut st);
                flag
            })
            .collect();
        if let (Some(f), Some(Some(v))) = (s.started.as_deref_mut(), after.first()) {
            *f = *v;
        }
    }
    stats[stat::UPDATED] = 1.0;
}

/// Parameter elements per step from which the update is shared between the threads (the digits
/// MLP's 85K, the tiny GPT's 0.8M), and the elements of one piece of a parameter.
const PAR_UPDATE: usize = 1 << 15;
const UPDATE_PIECE: usize = 8 * 1024;

/// Applies one update of `rule` to `p` from the gradient `g * scale`. `step` is this
/// parameter's 1-based update count, already incremented.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn update(
    rule: OptimRule,
    h: &Hyper,
    step: i32,
    started: Option<&mut i32>,
    p: &mut [f32],
    g: &[f32],
    scale: f32,
    state: &mut [&mut [f32]],
) {
    let (lr, wd) = (h.lr, h.weight_decay);
    let n = p.len().min(g.len());
    let (p, g) = (&mut p[..n], &g[..n]);
    let grad = |i: usize, p: f32| -> f32 {
        let gi = if scale == 1.0 { g[i] } else { g[i] * scale };
        if wd != 0.0 {
            gi + wd * p
        } else {
            gi
        }
    };
    match rule {
        OptimRule::Sgd => {
            let buf = &mut *state[0];
            if h.momentum == 0.0 {
                for (i, pi) in p.iter_mut().enumerate() {
                    let d = grad(i, *pi);
                    *pi -= lr * d;
                }
                return;
            }
            let started = started.expect("sgd keeps a started flag");
            let first = *started == 0;
            *started = 1;
            let (m, damp) = (h.momentum, h.one_minus_dampening);
            for i in 0..n {
                let d = grad(i, p[i]);
                let b = if first { d } else { m * buf[i] + damp * d };
                buf[i] = b;
                let d = if h.nesterov { d + m * b } else { b };
                p[i] -= lr * d;
            }
        }
        OptimRule::Adam | OptimRule::AdamW => {
            let t = step.max(1);
            let bc1 = 1.0 - h.beta1.powi(t);
            let inv_bc2_sqrt = 1.0 / (1.0 - h.beta2.powi(t)).sqrt();
            let step_size = lr / bc1;
            // Decoupled decay scales p first (AdamW); L2 decay adds wd * p to the gradient (Adam).
            let adamw = rule == OptimRule::AdamW;
            let decay = if adamw { 1.0 - lr * wd } else { 1.0 };
            let (b1, b2, eps) = (h.beta1, h.beta2, h.eps);
            let (c1, c2) = (h.one_minus_beta1, h.one_minus_beta2);
            let (m, v) = state.split_at_mut(1);
            let (m, v) = (&mut m[0][..n], &mut v[0][..n]);
            for i in 0..n {
                let pi = p[i] * decay;
                let gs = if scale == 1.0 { g[i] } else { g[i] * scale };
                let gi = if adamw || wd == 0.0 { gs } else { gs + wd * pi };
                let mi = b1 * m[i] + c1 * gi;
                let vi = b2 * v[i] + c2 * gi * gi;
                m[i] = mi;
                v[i] = vi;
                p[i] = pi - step_size * mi / (vi.sqrt() * inv_bc2_sqrt + eps);
            }
        }
        OptimRule::RmsProp => {
            let (sq, buf) = state.split_at_mut(1);
            let (sq, buf) = (&mut sq[0][..n], &mut buf[0][..n]);
            let (a, c, eps, m) = (h.alpha, h.one_minus_alpha, h.eps, h.momentum);
            for i in 0..n {
                let gi = grad(i, p[i]);
                let s = a * sq[i] + c * gi * gi;
                sq[i] = s;
                let avg = s.sqrt() + eps;
                if m > 0.0 {
                    let b = m * buf[i] + gi / avg;
                    buf[i] = b;
                    p[i] -= lr * b;
                } else {
                    p[i] -= lr * (gi / avg);
                }
            }
        }
        OptimRule::Adagrad => {
            let sum = &mut state[0][..n];
            let clr = lr / (1.0 + (step - 1) as f32 * h.lr_decay);
            for i in 0..n {
                let gi = grad(i, p[i]);
                let s = sum[i] + gi * gi;
                sum[i] = s;
                p[i] -= clr * (gi / (s.sqrt() + h.eps));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hyper(lr: f32) -> Hyper {
        Hyper {
            lr,
            weight_decay: 0.0,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            alpha: 0.99,
            lr_decay: 0.0,
            one_minus_alpha: 0.01,
            one_minus_dampening: 1.0,
            one_minus_beta1: 0.1,
            one_minus_beta2: 0.001,
        }
    }

    #[test]
    fn clipping_and_accumulation() {
        let (mut p, g) = (vec![1.0f32, 1.0], vec![3.0f32, 4.0]);
        let mut acc = vec![0.0f32; 2];
        let (mut step, mut started) = (0, 0);
        let mut buf = vec![0.0f32; 2];
        let mut stats = [0.0f32; stat::LEN];
        let opts = Options {
            clip: Some(1.0),
            accumulate: 2,
            skip_nonfinite: true,
        };
        for call in 0..2 {
            let mut slots = [ParamSlot {
                p: &mut p,
                g: &g,
                acc: Some(&mut acc),
                state: vec![&mut buf],
                step: &mut step,
                started: Some(&mut started),
                hyper: hyper(1.0),
            }];
            train_update(OptimRule::Sgd, opts, 0.5, &mut stats, &mut slots);
            assert_eq!(stats[stat::UPDATED], call as f32);
        }
        // Mean gradient (3, 4) has norm 5, clipped to norm 1: (0.6, 0.8).
        assert_eq!(stats[stat::GRAD_NORM], 5.0);
        assert!(
            (p[0] - 0.4).abs() < 1e-6 && (p[1] - 0.2).abs() < 1e-6,
            "{p:?}"
        );
        let mut slots = [ParamSlot {
            p: &mut p,
            g: &g,
            acc: Some(&mut acc),
            state: vec![&mut buf],
            step: &mut step,
            started: Some(&mut started),
            hyper: hyper(1.0),
        }];
        train_update(OptimRule::Sgd, opts, f32::NAN, &mut stats, &mut slots);
        assert_eq!(stats[stat::SKIPPED], 1.0);
        assert_eq!(step, 1);
    }
}
