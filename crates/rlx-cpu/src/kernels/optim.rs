//! The training update on the host: gradient accumulation, the non-finite check, global-norm
//! clipping, and the optimizer rules in place over each parameter, as PyTorch defines them.
use rayon::prelude::*;
use rlx_runtime::{hyper_col as col, stat, OptimHyper, OptimRule};

/// One parameter's settings (a row of the optimizer's `hyper` table), widened to float64: the
/// table is float32, or float64 where a float64 parameter is trained (a float32 parameter then
/// narrows each value back, to the same float32 a float32 table holds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub lr: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub alpha: f64,
    pub lr_decay: f64,
    pub one_minus_alpha: f64,
    pub one_minus_dampening: f64,
    pub one_minus_beta1: f64,
    pub one_minus_beta2: f64,
}

impl Hyper {
    pub fn from_row<E: Copy + Into<f64>>(r: &[E]) -> Hyper {
        let v = |c: usize| r[c].into();
        Hyper {
            lr: v(col::LR),
            weight_decay: v(col::WEIGHT_DECAY),
            momentum: v(col::MOMENTUM),
            dampening: v(col::DAMPENING),
            nesterov: v(col::NESTEROV) != 0.0,
            beta1: v(col::BETA1),
            beta2: v(col::BETA2),
            eps: v(col::EPS),
            alpha: v(col::ALPHA),
            lr_decay: v(col::LR_DECAY),
            one_minus_alpha: v(col::ONE_MINUS_ALPHA),
            one_minus_dampening: v(col::ONE_MINUS_DAMPENING),
            one_minus_beta1: v(col::ONE_MINUS_BETA1),
            one_minus_beta2: v(col::ONE_MINUS_BETA2),
        }
    }

    /// The single set of settings a run may carry (no groups).
    pub fn from_run(h: &OptimHyper) -> Hyper {
        Hyper {
            lr: h.lr as f64,
            weight_decay: h.weight_decay as f64,
            momentum: h.momentum as f64,
            dampening: 0.0,
            nesterov: false,
            beta1: h.beta1 as f64,
            beta2: h.beta2 as f64,
            eps: h.eps as f64,
            alpha: 0.99,
            lr_decay: 0.0,
            one_minus_alpha: (1.0 - 0.99f64) as f32 as f64,
            one_minus_dampening: 1.0,
            one_minus_beta1: (1.0 - h.beta1 as f64) as f32 as f64,
            one_minus_beta2: (1.0 - h.beta2 as f64) as f32 as f64,
        }
    }
}

/// The element types the update runs on: float32 weights, and float64 weights (with float64
/// state) on the CPU.
pub trait Float:
    Copy
    + Send
    + Sync
    + PartialEq
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + std::ops::SubAssign
    + 'static
{
    const ONE: Self;
    /// A hyper-parameter (rounded once for float32) or a small count.
    fn of(x: f64) -> Self;
    /// The gradient scale (accumulation's 1/k times the clip factor) for this type: the
    /// float32 value as float32 computes it, the float64 one in double precision.
    fn scale(s: Scale) -> Self;
    fn sqrt(self) -> Self;
    fn powi(self, n: i32) -> Self;
    fn wide(self) -> f64;
}

impl Float for f32 {
    const ONE: f32 = 1.0;
    #[inline(always)]
    fn of(x: f64) -> f32 {
        x as f32
    }
    #[inline(always)]
    fn scale(s: Scale) -> f32 {
        s.single
    }
    #[inline(always)]
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn powi(self, n: i32) -> f32 {
        f32::powi(self, n)
    }
    #[inline(always)]
    fn wide(self) -> f64 {
        self as f64
    }
}

impl Float for f64 {
    const ONE: f64 = 1.0;
    #[inline(always)]
    fn of(x: f64) -> f64 {
        x
    }
    #[inline(always)]
    fn scale(s: Scale) -> f64 {
        s.double
    }
    #[inline(always)]
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn powi(self, n: i32) -> f64 {
        f64::powi(self, n)
    }
    #[inline(always)]
    fn wide(self) -> f64 {
        self
    }
}

/// The factor the gradients are scaled by before the update, computed in both precisions.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    pub single: f32,
    pub double: f64,
}

/// One parameter's memory for an update, in its element type.
pub struct ParamSlot<'a, T: Float = f32> {
    pub p: &'a mut [T],
    pub g: &'a [T],
    pub acc: Option<&'a mut [T]>,
    pub state: Vec<&'a mut [T]>,
    pub step: &'a mut i32,
    pub started: Option<&'a mut i32>,
    pub hyper: Hyper,
}

/// A parameter of either element type.
pub enum Slot<'a> {
    F32(ParamSlot<'a, f32>),
    F64(ParamSlot<'a, f64>),
}

/// Calls `$body` with `$s` bound to the typed slot inside a [`Slot`].
macro_rules! typed {
    ($slot:expr, $s:ident => $body:expr) => {
        match $slot {
            Slot::F32($s) => $body,
            Slot::F64($s) => $body,
        }
    };
}

/// Step options fixed at compile time.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// The global-norm limit (a float64 weight's update uses it unrounded, a float32 one
    /// rounded to float32, as before).
    pub clip: Option<f64>,
    pub accumulate: u32,
    pub skip_nonfinite: bool,
}

fn sum_sq<T: Float>(g: &[T]) -> f64 {
    g.iter().map(|&x| x.wide() * x.wide()).sum()
}

impl<T: Float> ParamSlot<'_, T> {
    /// The squared norm of the gradient the update uses (the accumulated one when there is one).
    fn grad_sq(&self, accumulated: bool) -> f64 {
        match (&self.acc, accumulated) {
            (Some(a), true) => sum_sq(a),
            _ => sum_sq(self.g),
        }
    }

    /// Adds this micro-step's gradient into the accumulation buffer (copies it at the first).
    fn accumulate(&mut self, first: bool) {
        let acc = self
            .acc
            .as_deref_mut()
            .expect("accumulation buffer planned");
        if first {
            acc.copy_from_slice(self.g);
        } else {
            acc.iter_mut().zip(self.g).for_each(|(a, &g)| *a += g);
        }
    }

    /// One update of `rule` from the gradient times `scale`, in pieces over the pool when
    /// `parallel`.
    fn apply(&mut self, rule: OptimRule, scale: Scale, parallel: bool) {
        *self.step += 1;
        let step = *self.step;
        let h = self.hyper;
        let scale = T::scale(scale);
        let g: &[T] = match &self.acc {
            Some(a) => a,
            None => self.g,
        };
        // Each piece's loop runs compiled for the CPU's instruction set (see `isa`).
        let run = |started: Option<&mut i32>, p: &mut [T], g: &[T], st: &mut [&mut [T]]| {
            crate::isa::dispatch(
                #[inline(always)]
                || update(rule, &h, step, started, p, g, scale, st),
            )
        };
        let n = self.p.len().min(g.len());
        if !parallel || n < 2 * UPDATE_PIECE || self.state.iter().any(|x| x.len() < n) {
            run(self.started.as_deref_mut(), self.p, g, &mut self.state);
            return;
        }
        // Every element's update is independent: pieces of the parameter (with the same pieces
        // of its gradient and state) run on the pool. Each piece sees the flag as it was; the
        // first piece's flag afterwards is the parameter's.
        let before = self.started.as_deref().copied();
        let mut states: Vec<_> = self
            .state
            .iter_mut()
            .map(|x| x[..n].chunks_mut(UPDATE_PIECE))
            .collect();
        let pieces: Vec<_> = self.p[..n]
            .chunks_mut(UPDATE_PIECE)
            .zip(g[..n].chunks(UPDATE_PIECE))
            .map(|(p, g)| {
                let st: Vec<&mut [T]> = states.iter_mut().filter_map(|c| c.next()).collect();
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
        if let (Some(f), Some(Some(v))) = (self.started.as_deref_mut(), after.first()) {
            *f = *v;
        }
    }
}

/// Runs the end of one training step over `params`; `stats` persists across runs
/// ([`rlx_runtime::stat`]).
pub fn train_update(
    rule: OptimRule,
    opts: Options,
    loss: f64,
    stats: &mut [f32],
    params: &mut [Slot<'_>],
) {
    let k = opts.accumulate.max(1);
    stats[stat::UPDATED] = 0.0;
    // The global norm costs a pass over every gradient: taken only when clipping or skipping.
    let need_norm = opts.clip.is_some() || opts.skip_nonfinite;
    let norm_sq = |params: &[Slot<'_>], accumulated: bool| -> f64 {
        params
            .iter()
            .map(|s| typed!(s, s => s.grad_sq(accumulated)))
            .sum()
    };
    let mut this_sq = None;
    if opts.skip_nonfinite {
        let sq = norm_sq(params, false);
        if !(loss.is_finite() && sq.is_finite()) {
            stats[stat::SKIPPED] += 1.0;
            return;
        }
        this_sq = Some(sq);
    }
    // With accumulation the update uses acc / k; `scale` folds the 1/k and the clip factor. The
    // float32 factor is computed in float32 (as it always was), the float64 one in float64.
    let mut scale = Scale {
        single: 1.0,
        double: 1.0,
    };
    if k > 1 {
        let micro = stats[stat::MICRO] as u32;
        for s in params.iter_mut() {
            typed!(s, s => s.accumulate(micro == 0));
        }
        if micro + 1 < k {
            stats[stat::MICRO] = (micro + 1) as f32;
            return;
        }
        stats[stat::MICRO] = 0.0;
        scale = Scale {
            single: 1.0 / k as f32,
            double: 1.0 / k as f64,
        };
    }
    if need_norm {
        let total: f64 = match this_sq {
            Some(sq) if k == 1 => sq,
            _ => norm_sq(params, true),
        };
        let wide = total.sqrt() * scale.double;
        let norm = (total.sqrt() * scale.single as f64) as f32;
        stats[stat::GRAD_NORM] = norm;
        // A float32 weight needs the norm finite in float32 too (as it always did).
        let has_single = params.iter().any(|s| matches!(s, Slot::F32(_)));
        if opts.skip_nonfinite && !(wide.is_finite() && (norm.is_finite() || !has_single)) {
            stats[stat::SKIPPED] += 1.0;
            return;
        }
        if let Some(c) = opts.clip {
            let coef = c as f32 / (norm + 1e-6);
            if coef < 1.0 {
                scale.single *= coef;
            }
            let coef = c / (wide + 1e-6);
            if coef < 1.0 {
                scale.double *= coef;
            }
        }
    } else {
        stats[stat::GRAD_NORM] = f32::NAN;
    }
    let total: usize = params.iter().map(|s| typed!(s, s => s.p.len())).sum();
    // Only on a worker of a pool (`crate::pool::run` puts every program run on one; a direct
    // caller elsewhere may be in a forked child, whose global pool is its parent's).
    let parallel = total >= PAR_UPDATE
        && rayon::current_thread_index().is_some()
        && rayon::current_num_threads() > 1;
    for s in params.iter_mut() {
        typed!(s, s => s.apply(rule, scale, parallel));
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
pub fn update<T: Float>(
    rule: OptimRule,
    h: &Hyper,
    step: i32,
    started: Option<&mut i32>,
    p: &mut [T],
    g: &[T],
    scale: T,
    state: &mut [&mut [T]],
) {
    let (lr, wd) = (T::of(h.lr), T::of(h.weight_decay));
    let zero = T::of(0.0);
    let n = p.len().min(g.len());
    let (p, g) = (&mut p[..n], &g[..n]);
    let grad = |i: usize, p: T| -> T {
        let gi = if scale == T::ONE { g[i] } else { g[i] * scale };
        if wd != zero {
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
            let (m, damp) = (T::of(h.momentum), T::of(h.one_minus_dampening));
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
            let bc1 = T::ONE - T::of(h.beta1).powi(t);
            let inv_bc2_sqrt = T::ONE / (T::ONE - T::of(h.beta2).powi(t)).sqrt();
            let step_size = lr / bc1;
            // Decoupled decay scales p first (AdamW); L2 decay adds wd * p to the gradient (Adam).
            let adamw = rule == OptimRule::AdamW;
            let decay = if adamw { T::ONE - lr * wd } else { T::ONE };
            let (b1, b2, eps) = (T::of(h.beta1), T::of(h.beta2), T::of(h.eps));
            let (c1, c2) = (T::of(h.one_minus_beta1), T::of(h.one_minus_beta2));
            let (m, v) = state.split_at_mut(1);
            let (m, v) = (&mut m[0][..n], &mut v[0][..n]);
            for i in 0..n {
                let pi = p[i] * decay;
                let gs = if scale == T::ONE { g[i] } else { g[i] * scale };
                let gi = if adamw || wd == zero {
                    gs
                } else {
                    gs + wd * pi
                };
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
            let (a, c, eps, m) = (
                T::of(h.alpha),
                T::of(h.one_minus_alpha),
                T::of(h.eps),
                T::of(h.momentum),
            );
            for i in 0..n {
                let gi = grad(i, p[i]);
                let s = a * sq[i] + c * gi * gi;
                sq[i] = s;
                let avg = s.sqrt() + eps;
                if m > zero {
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
            let clr = T::of(h.lr) / (T::ONE + T::of((step - 1) as f64) * T::of(h.lr_decay));
            for i in 0..n {
                let gi = grad(i, p[i]);
                let s = sum[i] + gi * gi;
                sum[i] = s;
                p[i] -= clr * (gi / (s.sqrt() + T::of(h.eps)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hyper(lr: f32) -> Hyper {
        Hyper {
            lr: lr as f64,
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
            let mut slots = [Slot::F32(ParamSlot {
                p: &mut p,
                g: &g,
                acc: Some(&mut acc),
                state: vec![&mut buf],
                step: &mut step,
                started: Some(&mut started),
                hyper: hyper(1.0),
            })];
            train_update(OptimRule::Sgd, opts, 0.5, &mut stats, &mut slots);
            assert_eq!(stats[stat::UPDATED], call as f32);
        }
        // Mean gradient (3, 4) has norm 5, clipped to norm 1: (0.6, 0.8).
        assert_eq!(stats[stat::GRAD_NORM], 5.0);
        assert!(
            (p[0] - 0.4).abs() < 1e-6 && (p[1] - 0.2).abs() < 1e-6,
            "{p:?}"
        );
        let mut slots = [Slot::F32(ParamSlot {
            p: &mut p,
            g: &g,
            acc: Some(&mut acc),
            state: vec![&mut buf],
            step: &mut step,
            started: Some(&mut started),
            hyper: hyper(1.0),
        })];
        train_update(OptimRule::Sgd, opts, f64::NAN, &mut stats, &mut slots);
        assert_eq!(stats[stat::SKIPPED], 1.0);
        assert_eq!(step, 1);
    }
}
