//! The fused elementwise kernel: evaluates an `Op::Fused` expression tile by tile, so every
//! intermediate lives in a cache-sized scratch tile and memory is read and written once.
use super::{elementwise, map_rows, math, Strided, PAR_MIN};
use rayon::prelude::*;
use rlx_ir::{BinaryOp, Fused, FusedStep, UnaryOp};
use std::cell::RefCell;

/// Elements per tile: a few registers of this size stay in L1/L2.
const TILE: usize = 512;
/// Inputs one expression may read (the fusion pass keeps to fewer).
const MAX_IN: usize = 32;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Where an input register's values come from within one tile.
#[derive(Clone, Copy)]
enum Src<'a> {
    Slice(&'a [f32]),
    Scalar(f32),
}

/// Evaluates `f` into `out`; `ins[i]` is input `i` with its shape (broadcast to `f.shape`).
pub fn fused(f: &Fused, ins: &[(&[f32], &[usize])], out: &mut [f32]) {
    assert!(
        ins.len() <= MAX_IN,
        "a fused expression reads at most {MAX_IN} inputs"
    );
    let od = f.shape.dims();
    let flat = ins
        .iter()
        .all(|(x, _)| x.len() == out.len() || x.len() == 1);
    if flat {
        let total = out.len();
        let tile = |(c, chunk): (usize, &mut [f32])| {
            let o0 = c * TILE;
            let mut srcs = [Src::Scalar(0.0); MAX_IN];
            for (s, (x, _)) in srcs.iter_mut().zip(ins) {
                *s = if x.len() != total {
                    Src::Scalar(x[0])
                } else {
                    Src::Slice(&x[o0..o0 + chunk.len()])
                };
            }
            with_scratch(f, |scratch| eval(f, &srcs[..ins.len()], chunk, scratch));
        };
        if out.len() >= PAR_MIN {
            out.par_chunks_mut(TILE).enumerate().for_each(tile);
        } else {
            out.chunks_mut(TILE).enumerate().for_each(tile);
        }
        return;
    }
    let strided: Vec<Strided> = ins.iter().map(|(_, d)| Strided::broadcast(d, od)).collect();
    let refs: Vec<&Strided> = strided.iter().collect();
    map_rows(out, od, &refs, |row, starts, steps| {
        // Inputs walked with a stride (rare: a transposed broadcast) are gathered per tile.
        let mut gathered: Vec<Vec<f32>> = Vec::new();
        if steps.iter().any(|&s| s > 1) {
            gathered.resize(ins.len(), Vec::new());
        }
        for t0 in (0..row.len()).step_by(TILE) {
            let len = TILE.min(row.len() - t0);
            for (i, (x, _)) in ins.iter().enumerate() {
                if steps[i] > 1 {
                    let at = starts[i] + t0 * steps[i];
                    gathered[i].clear();
                    gathered[i].extend((0..len).map(|j| x[at + j * steps[i]]));
                }
            }
            let mut srcs = [Src::Scalar(0.0); MAX_IN];
            for (i, (s, (x, _))) in srcs.iter_mut().zip(ins).enumerate() {
                let at = starts[i] + t0 * steps[i];
                *s = match steps[i] {
                    0 => Src::Scalar(x[at]),
                    1 => Src::Slice(&x[at..at + len]),
                    _ => Src::Slice(&gathered[i]),
                };
            }
            let chunk = &mut row[t0..t0 + len];
            with_scratch(f, |scratch| eval(f, &srcs[..ins.len()], chunk, scratch));
        }
    });
}

fn with_scratch(f: &Fused, body: impl FnOnce(&mut [f32])) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let need = f.steps.len() * TILE;
        if s.len() < need {
            s.resize(need, 0.0);
        }
        body(&mut s[..need]);
    });
}

/// One tile: each step writes its scratch register (the last writes `out`).
fn eval(f: &Fused, ins: &[Src], out: &mut [f32], scratch: &mut [f32]) {
    let n = out.len();
    let n_in = f.n_inputs;
    for (k, step) in f.steps.iter().enumerate() {
        let (done, rest) = scratch.split_at_mut(k * TILE);
        let reg = |r: u16| -> Src {
            let r = r as usize;
            if r < n_in {
                ins[r]
            } else {
                let j = (r - n_in) * TILE;
                Src::Slice(&done[j..j + n])
            }
        };
        let dst: &mut [f32] = if k + 1 == f.steps.len() {
            &mut *out
        } else {
            &mut rest[..n]
        };
        match *step {
            FusedStep::Unary(u, a) => unary(u, reg(a), dst),
            FusedStep::Binary(b, x, y) => binary(b, reg(x), reg(y), dst),
            FusedStep::Where(c, x, y) => {
                let (c, x, y) = (reg(c), reg(x), reg(y));
                for (j, o) in dst.iter_mut().enumerate() {
                    *o = if at(c, j) != 0.0 { at(x, j) } else { at(y, j) };
                }
            }
        }
    }
}

#[inline(always)]
fn at(s: Src, j: usize) -> f32 {
    match s {
        Src::Slice(v) => v[j],
        Src::Scalar(v) => v,
    }
}

/// `dst = f(a)` as one tight loop per op.
fn unary(op: UnaryOp, a: Src, dst: &mut [f32]) {
    #[inline(always)]
    fn map(a: Src, dst: &mut [f32], f: impl Fn(f32) -> f32) {
        crate::isa::dispatch(|| match a {
            Src::Slice(v) => dst.iter_mut().zip(v).for_each(|(o, &x)| *o = f(x)),
            Src::Scalar(x) => dst.fill(f(x)),
        })
    }
    match op {
        UnaryOp::Neg => map(a, dst, |x| -x),
        UnaryOp::Relu => map(a, dst, |x| if x < 0.0 { 0.0 } else { x }), // NaN stays NaN
        UnaryOp::Tanh => map(a, dst, math::tanh),
        UnaryOp::Sigmoid => map(a, dst, |x| 1.0 / (1.0 + math::exp(-x))),
        UnaryOp::Exp => map(a, dst, math::exp),
        UnaryOp::Log => map(a, dst, f32::ln),
        UnaryOp::Sqrt => map(a, dst, f32::sqrt),
        UnaryOp::Gelu => map(a, dst, elementwise::gelu),
        UnaryOp::GeluTanh => map(a, dst, |x| elementwise::gelu_tanh(x).0),
        UnaryOp::GeluDeriv => map(a, dst, elementwise::gelu_deriv),
        UnaryOp::GeluTanhDeriv => map(a, dst, |x| elementwise::gelu_tanh(x).1),
        UnaryOp::PowScalar(2.0) => map(a, dst, |x| x * x),
        UnaryOp::PowScalar(p) => map(a, dst, |x| x.powf(p)),
    }
}

/// `dst = a (op) b` as one tight loop per op and operand kind.
fn binary(op: BinaryOp, a: Src, b: Src, dst: &mut [f32]) {
    #[inline(always)]
    fn zip(a: Src, b: Src, dst: &mut [f32], f: impl Fn(f32, f32) -> f32) {
        crate::isa::dispatch(|| match (a, b) {
            (Src::Slice(x), Src::Slice(y)) => dst
                .iter_mut()
                .zip(x.iter().zip(y))
                .for_each(|(o, (&x, &y))| *o = f(x, y)),
            (Src::Slice(x), Src::Scalar(y)) => {
                dst.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, y))
            }
            (Src::Scalar(x), Src::Slice(y)) => {
                dst.iter_mut().zip(y).for_each(|(o, &y)| *o = f(x, y))
            }
            (Src::Scalar(x), Src::Scalar(y)) => dst.fill(f(x, y)),
        })
    }
    let mask = |v: bool| if v { 1.0 } else { 0.0 };
    match op {
        BinaryOp::Add => zip(a, b, dst, |x, y| x + y),
        BinaryOp::Sub => zip(a, b, dst, |x, y| x - y),
        BinaryOp::Mul => zip(a, b, dst, |x, y| x * y),
        BinaryOp::Div => zip(a, b, dst, |x, y| x / y),
        BinaryOp::FloorDiv => zip(a, b, dst, <f32 as elementwise::Num>::floor_div),
        BinaryOp::Mod => zip(a, b, dst, <f32 as elementwise::Num>::rem),
        BinaryOp::Lt => zip(a, b, dst, |x, y| mask(x < y)),
        BinaryOp::Le => zip(a, b, dst, |x, y| mask(x <= y)),
        BinaryOp::Gt => zip(a, b, dst, |x, y| mask(x > y)),
        BinaryOp::Ge => zip(a, b, dst, |x, y| mask(x >= y)),
        BinaryOp::Eq => zip(a, b, dst, |x, y| mask(x == y)),
        BinaryOp::Ne => zip(a, b, dst, |x, y| mask(x != y)),
    }
}
