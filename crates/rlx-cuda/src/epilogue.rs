//! Which steps of a CUDA plan run as one cuBLASLt product (see `lt.rs` for the calls):
//! - a GEMM into the product buffer and the fused launch after it, where that launch is
//!   `act(product + bias + residual)` with a bias vector over the product's columns, a residual
//!   of the product's shape and `act` ReLU or tanh-GELU, each optional: one product
//!   `d = act(a b + 1 * c + bias)`, the residual as cuBLASLt's `C`;
//! - a column sum (`rlx_reduce_rows`) of the `dY` that a later weight-gradient GEMM
//!   (`dY^T X`) reads: a bias gradient, written by that GEMM's BGRADB epilogue instead, for the
//!   pairs the lowering proved safe on the program's tensors (`Plan::bias_grads`);
//! - with `RLX_CUDA_LT=all`, every other GEMM too, with no epilogue.
//!
//! On by default (`all`, see [`LtMode::DEFAULT`]); `RLX_CUDA_LT=epilogue` keeps the plain GEMMs
//! on cuBLAS, `RLX_CUDA_LT=0` runs every product through plain cuBLAS.
//!
//! Only the plan is read here (no GPU): the choices are unit-tested in CI. A candidate that
//! cuBLASLt has no algorithm for keeps its original steps.
use crate::plan::{reads_row_vector, Gemm, Kernel, Loc, Plan, Step, PRODUCT};
use rlx_ir::{BinaryOp, DType, FusedStep, UnaryOp};

/// A product's epilogue, in cuBLASLt's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epi {
    None,
    Relu,
    GeluTanh,
    Bias,
    ReluBias,
    GeluTanhBias,
    /// The column sums of `B` over `k` (the bias gradient of a weight-gradient product).
    BiasGradB,
}

/// What cuBLASLt is asked for: the plan's GEMM, its epilogue, whether a residual comes in as
/// `C` (`beta = 1`), and the byte alignment of `A`, `B`, `C` and `D` (of their offsets, the
/// buffers being 256-byte aligned), which the algorithm may rely on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LtSpec {
    pub g: Gemm,
    pub epi: Epi,
    pub residual: bool,
    pub align: [usize; 4],
}

/// One cuBLASLt product standing for the plan steps `steps` (run where the first of them,
/// the GEMM, stood).
#[derive(Clone, Debug, PartialEq)]
pub struct LtStep {
    pub spec: LtSpec,
    /// `A`, `B`, `C` (the residual, or `D` where there is none) and `D`.
    pub ops: [Loc; 4],
    /// The bias read, or the bias gradient written.
    pub bias: Option<Loc>,
    /// The plan steps it replaces; the GEMM's first.
    pub steps: Vec<usize>,
}

/// Which GEMMs go through cuBLASLt (`RLX_CUDA_LT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LtMode {
    /// None: plain cuBLAS, every epilogue its own launch (`0`).
    Off,
    /// Products that absorb an epilogue or a bias gradient (`epilogue` or `1`).
    Epilogues,
    /// Those, and every other GEMM with no epilogue (`all`, the default: on an H100 every
    /// training test matches the CPU in each mode, and this one took the most device time off
    /// the tiny GPT's step, see BENCHMARKS.md).
    All,
}

impl LtMode {
    /// The mode `RLX_CUDA_LT` asks for ([`LtMode::DEFAULT`] when unset).
    pub fn from_env() -> std::result::Result<LtMode, String> {
        match std::env::var("RLX_CUDA_LT").as_deref().map(str::trim) {
            Err(_) | Ok("") => Ok(LtMode::DEFAULT),
            Ok("epilogue") | Ok("1") => Ok(LtMode::Epilogues),
            Ok("0") => Ok(LtMode::Off),
            Ok("all") => Ok(LtMode::All),
            Ok(other) => Err(format!("must be 0, epilogue (or 1) or all, got {other:?}")),
        }
    }

    pub const DEFAULT: LtMode = LtMode::All;
}

/// The largest power of two (up to 256) dividing `offset`.
fn align_of(offset: usize) -> usize {
    if offset == 0 {
        256
    } else {
        (1usize << offset.trailing_zeros()).min(256)
    }
}

/// The request for `g` over `ops`: every matrix of a batch starts at the operand's offset
/// plus a multiple of its batch stride, so both bound the alignment.
fn spec(g: Gemm, epi: Epi, residual: bool, ops: &[Loc; 4]) -> LtSpec {
    let esize = [g.dtype.size(), g.dtype.size(), 4, 4];
    let strides = [g.stride_a, g.stride_b, g.stride_c, g.stride_c];
    let mut align = [0; 4];
    for k in 0..4 {
        align[k] = align_of(ops[k].offset);
        if g.batch > 1 {
            align[k] = align[k].min(align_of(strides[k] * esize[k]));
        }
    }
    LtSpec {
        g,
        epi,
        residual,
        align,
    }
}

/// The forward epilogue of GEMM step `i` (its product in the product buffer) and the fused
/// launch `i + 1` reading it, where cuBLASLt can apply that launch's expression itself.
fn forward(plan: &Plan, i: usize) -> Option<LtStep> {
    let Step::Gemm { g, a, b, c } = &plan.steps[i] else {
        return None;
    };
    let Some(Step::Launch {
        kernel: Kernel::Fused(fi),
        p,
        operands,
        ..
    }) = plan.steps.get(i + 1)
    else {
        return None;
    };
    let f = &plan.fused[*fi];
    let product = Loc {
        buf: PRODUCT,
        offset: 0,
    };
    let loc = |slot: usize| operands.iter().find(|(s, _)| *s == slot).map(|(_, l)| *l);
    let out = f.n_inputs;
    let total = g.m * g.n * g.batch;
    if *c != product
        || loc(0) != Some(product)
        || p.n != total as i64
        || p.mode[0] != 1
        || p.mode[out] != 1
        || g.stride_c != g.m * g.n && g.batch > 1
        || g.ldc != g.m
    {
        return None;
    }
    // Walk the expression: adds onto the running value (register `cur`), then one activation.
    let (mut cur, mut bias, mut residual, mut act) = (0usize, None, None, None);
    for (k, s) in f.steps.iter().enumerate() {
        let reg = f.n_inputs + k;
        match *s {
            FusedStep::Binary(BinaryOp::Add, x, y) if act.is_none() => {
                let (x, y) = (x as usize, y as usize);
                let other = if x == cur {
                    y
                } else if y == cur {
                    x
                } else {
                    return None;
                };
                if other == 0 || other >= f.n_inputs {
                    return None;
                }
                if p.mode[other] == 1 && residual.is_none() {
                    residual = Some(loc(other)?);
                } else if reads_row_vector(p, other, g.m) && bias.is_none() {
                    bias = Some(loc(other)?);
                } else {
                    return None;
                }
                cur = reg;
            }
            FusedStep::Unary(u @ (UnaryOp::Relu | UnaryOp::GeluTanh), x)
                if x as usize == cur && act.is_none() =>
            {
                act = Some(u);
                cur = reg;
            }
            _ => return None,
        }
    }
    if cur + 1 != f.n_inputs + f.steps.len() || f.steps.is_empty() {
        return None;
    }
    let epi = match (bias.is_some(), act) {
        (false, None) => Epi::None,
        (false, Some(UnaryOp::Relu)) => Epi::Relu,
        (false, Some(_)) => Epi::GeluTanh,
        (true, None) => Epi::Bias,
        (true, Some(UnaryOp::Relu)) => Epi::ReluBias,
        (true, Some(_)) => Epi::GeluTanhBias,
    };
    let d = loc(out)?;
    let ops = [*a, *b, residual.unwrap_or(d), d];
    Some(LtStep {
        spec: spec(*g, epi, residual.is_some(), &ops),
        ops,
        bias,
        steps: vec![i, i + 1],
    })
}

/// The bias-gradient fold of the plan's pair `(j, i)` (see `Plan::bias_grads`, which proved
/// that the GEMM reads the summed tensor itself and that the sum's output may be written
/// late): the column sum `j` becomes GEMM `i`'s BGRADB epilogue where their shapes agree.
fn bias_grad(plan: &Plan, (j, i): (usize, usize)) -> Option<LtStep> {
    let Step::Launch {
        kernel: Kernel::Library("rlx_reduce_rows"),
        p,
        operands,
        ..
    } = &plan.steps[j]
    else {
        return None;
    };
    let (rows, n) = (
        usize::try_from(p.iv[0]).ok()?,
        usize::try_from(p.iv[1]).ok()?,
    );
    let x = operands.iter().find(|(s, _)| *s == 0)?.1;
    let db = operands.iter().find(|(s, _)| *s == 1)?.1;
    let Step::Gemm { g, a, b, c } = &plan.steps[i] else {
        return None;
    };
    let fits = p.fv[0] == 1.0 // a sum, not a mean
        && *b == x
        && g.dtype == DType::F32
        && g.tb
        && g.batch == 1
        && g.k == rows
        && g.n == n
        && g.ldb == n
        && c.buf != PRODUCT;
    let ops = [*a, *b, *c, *c];
    fits.then(|| LtStep {
        spec: spec(*g, Epi::BiasGradB, false, &ops),
        ops,
        bias: Some(db),
        steps: vec![i, j],
    })
}

/// The cuBLASLt candidates of `plan` under `mode`, each claiming its steps (no step in two).
/// Forward epilogues first, then bias gradients, then (with [`LtMode::All`]) the other GEMMs.
pub fn candidates(plan: &Plan, mode: LtMode) -> Vec<LtStep> {
    let mut out = Vec::new();
    if mode == LtMode::Off {
        return out;
    }
    let mut taken = vec![false; plan.steps.len()];
    let claim = |c: LtStep, taken: &mut Vec<bool>, out: &mut Vec<LtStep>| {
        if c.bias.is_some_and(|b| align_of(b.offset) < 16) {
            return; // a vector cuBLASLt may not read (or write) with 16-byte accesses
        }
        for &s in &c.steps {
            taken[s] = true;
        }
        out.push(c);
    };
    for i in 0..plan.steps.len() {
        if let Some(c) = forward(plan, i) {
            claim(c, &mut taken, &mut out);
        }
    }
    for &(j, i) in &plan.bias_grads {
        if taken[j] || taken[i] {
            continue;
        }
        if let Some(c) = bias_grad(plan, (j, i)) {
            claim(c, &mut taken, &mut out);
        }
    }
    if mode == LtMode::All {
        for (i, s) in plan.steps.iter().enumerate() {
            if let (Step::Gemm { g, a, b, c }, false) = (s, taken[i]) {
                let ops = [*a, *b, *c, *c];
                claim(
                    LtStep {
                        spec: spec(*g, Epi::None, false, &ops),
                        ops,
                        bias: None,
                        steps: vec![i],
                    },
                    &mut taken,
                    &mut out,
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{self, Target};
    use rlx_ir::{Fused, Op, Shape};
    use rlx_runtime::{Buf, Instr, Program, TRef};

    fn t(buf: u8, offset: usize, dims: &[usize]) -> TRef {
        let buf = [Buf::Arena, Buf::Params, Buf::State][buf as usize];
        TRef {
            buf,
            offset,
            shape: Shape::from(dims),
            dtype: DType::F32,
        }
    }

    fn lowered(instrs: Vec<Instr>) -> Plan {
        let program = Program { instrs };
        plan::plan(&program, &[1 << 20; 4], Target::CUDA).expect("plan")
    }

    fn epilogue(steps: Vec<FusedStep>, n_inputs: usize, dims: &[usize]) -> std::sync::Arc<Fused> {
        std::sync::Arc::new(Fused {
            shape: Shape::from(dims),
            n_inputs,
            steps,
        })
    }

    fn linear(epi: Vec<FusedStep>, extra: Vec<TRef>) -> Plan {
        let n_inputs = 1 + extra.len();
        let mut ins = vec![t(0, 0, &[8, 16]), t(1, 0, &[32, 16])];
        ins.extend(extra);
        lowered(vec![Instr::Op {
            op: Op::MatMulEpilogue {
                trans_a: false,
                trans_b: true,
                epilogue: epilogue(epi, n_inputs, &[8, 32]),
            },
            ins,
            out: t(0, 4096, &[8, 32]),
        }])
    }

    #[test]
    fn bias_relu_and_residual_epilogues_become_one_product() {
        use FusedStep::{Binary, Unary};
        let bias = t(1, 4096, &[32]);
        let resid = t(0, 8192, &[8, 32]);
        // relu(product + bias)
        let pl = linear(
            vec![Binary(BinaryOp::Add, 0, 1), Unary(UnaryOp::Relu, 2)],
            vec![bias.clone()],
        );
        let c = candidates(&pl, LtMode::Epilogues);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].spec.epi, c[0].spec.residual), (Epi::ReluBias, false));
        assert_eq!(c[0].steps, vec![0, 1]);
        assert_eq!(
            c[0].bias,
            Some(Loc {
                buf: 1,
                offset: 4096
            })
        );
        assert_eq!(
            c[0].ops[3],
            Loc {
                buf: 0,
                offset: 4096
            }
        );
        // residual + (product + bias), in either operand order
        let pl = linear(
            vec![Binary(BinaryOp::Add, 0, 2), Binary(BinaryOp::Add, 1, 3)],
            vec![resid.clone(), bias.clone()],
        );
        let c = candidates(&pl, LtMode::Epilogues);
        assert_eq!((c[0].spec.epi, c[0].spec.residual), (Epi::Bias, true));
        assert_eq!(
            c[0].ops[2],
            Loc {
                buf: 0,
                offset: 8192
            }
        );
        // tanh-GELU without a bias
        let pl = linear(vec![Unary(UnaryOp::GeluTanh, 0)], vec![]);
        assert_eq!(
            candidates(&pl, LtMode::Epilogues)[0].spec.epi,
            Epi::GeluTanh
        );
        // Off: nothing.
        assert!(candidates(&pl, LtMode::Off).is_empty());
    }

    #[test]
    fn other_epilogues_keep_their_launch() {
        use FusedStep::{Binary, Unary};
        let bias = t(1, 4096, &[32]);
        for (steps, extra) in [
            // exact GELU: cuBLASLt has only the tanh form
            (
                vec![Binary(BinaryOp::Add, 0, 1), Unary(UnaryOp::Gelu, 2)],
                vec![bias.clone()],
            ),
            // a product times something
            (vec![Binary(BinaryOp::Mul, 0, 1)], vec![bias.clone()]),
            // activation before the add
            (
                vec![Unary(UnaryOp::Relu, 0), Binary(BinaryOp::Add, 2, 1)],
                vec![bias.clone()],
            ),
            // a bias along the other axis (one value a row)
            (vec![Binary(BinaryOp::Add, 0, 1)], vec![t(1, 4096, &[8, 1])]),
            // the same vector added twice
            (
                vec![Binary(BinaryOp::Add, 0, 1), Binary(BinaryOp::Add, 2, 1)],
                vec![bias.clone()],
            ),
        ] {
            let pl = linear(steps, extra);
            assert!(candidates(&pl, LtMode::Epilogues).is_empty(), "{pl:?}");
        }
        // A plain GEMM only under All.
        let pl = lowered(vec![Instr::Op {
            op: Op::MatMul {
                trans_a: false,
                trans_b: false,
            },
            ins: vec![t(0, 0, &[8, 16]), t(0, 1024, &[16, 4])],
            out: t(0, 4096, &[8, 4]),
        }]);
        assert!(candidates(&pl, LtMode::Epilogues).is_empty());
        let c = candidates(&pl, LtMode::All);
        assert_eq!(
            (c.len(), c[0].spec.epi, c[0].steps.clone()),
            (1, Epi::None, vec![0])
        );
    }

    fn weight_grad(between: Option<Instr>) -> Plan {
        // db = sum_to(dY); [something]; dW = dY^T X
        let dy = t(0, 0, &[64, 32]);
        let mut instrs = vec![Instr::Op {
            op: Op::SumTo {
                shape: Shape::from(&[32usize][..]),
            },
            ins: vec![dy.clone()],
            out: t(2, 512, &[32]),
        }];
        instrs.extend(between);
        instrs.push(Instr::Op {
            op: Op::MatMul {
                trans_a: true,
                trans_b: false,
            },
            ins: vec![dy, t(0, 16384, &[64, 16])],
            out: t(0, 32768, &[32, 16]),
        });
        lowered(instrs)
    }

    #[test]
    fn a_bias_gradient_moves_into_the_weight_gradient_product() {
        let pl = weight_grad(None);
        let c = candidates(&pl, LtMode::Epilogues);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].spec.epi, Epi::BiasGradB);
        assert_eq!(
            c[0].bias,
            Some(Loc {
                buf: 2,
                offset: 512
            })
        );
        assert_eq!(c[0].steps, vec![1, 0]);
        assert_eq!(c[0].spec.align, [256, 256, 256, 256]);
        // Something unrelated in between: still moved.
        let neg = |src: TRef, dst: TRef| Instr::Op {
            op: Op::Unary(UnaryOp::Neg),
            ins: vec![src],
            out: dst,
        };
        let pl = weight_grad(Some(neg(t(0, 49152, &[8]), t(0, 53248, &[8]))));
        assert_eq!(candidates(&pl, LtMode::Epilogues).len(), 1);
        // The sum read in between: not moved.
        let pl = weight_grad(Some(neg(t(2, 512, &[32]), t(0, 53248, &[32]))));
        assert!(candidates(&pl, LtMode::Epilogues).is_empty());
        // A place inside the sum's output in between: not moved either.
        let pl = weight_grad(Some(neg(t(0, 49152, &[8]), t(2, 576, &[8]))));
        assert!(candidates(&pl, LtMode::Epilogues).is_empty());
        // A tensor that starts before the sum's output and runs into it: not moved.
        let pl = weight_grad(Some(neg(t(0, 49152, &[80]), t(2, 256, &[80]))));
        assert!(candidates(&pl, LtMode::Epilogues).is_empty());
        // Another tensor written where dY was (its slot reused) before the GEMM reads that
        // place: the GEMM's operand is not the summed dY, so nothing moves.
        let pl = weight_grad(Some(neg(t(0, 49152, &[64, 32]), t(0, 0, &[64, 32]))));
        assert!(pl.bias_grads.is_empty());
        assert!(candidates(&pl, LtMode::Epilogues).is_empty());
    }

    #[test]
    fn alignment_is_the_offsets_power_of_two() {
        assert_eq!(align_of(0), 256);
        assert_eq!(align_of(4096), 256);
        assert_eq!(align_of(64), 64);
        assert_eq!(align_of(4 * 3), 4);
    }
}
