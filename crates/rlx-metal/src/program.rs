//! Lowering a runtime `Program` to Metal kernel launches, for the instructions the kernel library
//! covers so far: float32 element-wise unary ops (neg, relu, tanh, sigmoid, exp, sqrt), binary
//! ops (add, sub, mul, div) on operands of one shape, and matmuls (transposes as strides, batches
//! as one GEMM launch each, a rank-2 `b` shared by every batch). Any other instruction is
//! refused at compile with `UnsupportedError` naming it. Checks at compile, as every backend's:
//! each tensor inside its buffer, no output overlapping an operand.
use crate::kernels::{self, BinaryOp as KBin, Gemm, UnaryOp as KUn};
use crate::{MetalBuffer, MetalDevice};
use rlx_ir::{BinaryOp, DType, Error, Op, Result, UnaryOp};
use rlx_runtime::{Compiled, DeviceBuffer, Instr, OptimHyper, Program, TRef};

enum Step {
    Unary(KUn, TRef, TRef),
    Binary(KBin, TRef, TRef, TRef),
    /// `batch` GEMMs; per batch the operands advance by these byte strides (0: shared).
    Gemm {
        a: TRef,
        b: TRef,
        out: TRef,
        shape: Gemm,
        batch: usize,
        a_step: usize,
        b_step: usize,
    },
}

/// A program lowered to kernel launches.
pub struct MetalProgram {
    device: MetalDevice,
    steps: Vec<Step>,
    lens: Vec<usize>,
}

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        op: "metal".into(),
        msg: format!("the Metal backend has no kernel for {what} yet"),
    }
}

fn lower(op: &Op, ins: &[TRef], out: &TRef) -> Result<Step> {
    let name = op.name();
    if ins.iter().chain([out]).any(|t| t.dtype != DType::F32) {
        return Err(unsupported(format!(
            "'{name}' on dtype {:?} (only float32 element-wise kernels so far)",
            ins.iter().map(|t| t.dtype).collect::<Vec<_>>()
        )));
    }
    if let (Op::MatMul { trans_a, trans_b }, [a, b]) = (op, ins) {
        return lower_matmul(*trans_a, *trans_b, a, b, out);
    }
    if ins.iter().any(|t| t.shape != out.shape) {
        return Err(unsupported(format!("'{name}' with broadcasting")));
    }
    match (op, ins) {
        (Op::Unary(u), [x]) => {
            let k = match u {
                UnaryOp::Neg => KUn::Neg,
                UnaryOp::Relu => KUn::Relu,
                UnaryOp::Tanh => KUn::Tanh,
                UnaryOp::Sigmoid => KUn::Sigmoid,
                UnaryOp::Exp => KUn::Exp,
                UnaryOp::Sqrt => KUn::Sqrt,
                _ => return Err(unsupported(format!("'{name}'"))),
            };
            Ok(Step::Unary(k, x.clone(), out.clone()))
        }
        (Op::Binary(b), [x, y]) => {
            let k = match b {
                BinaryOp::Add => KBin::Add,
                BinaryOp::Sub => KBin::Sub,
                BinaryOp::Mul => KBin::Mul,
                BinaryOp::Div => KBin::Div,
                _ => return Err(unsupported(format!("'{name}'"))),
            };
            Ok(Step::Binary(k, x.clone(), y.clone(), out.clone()))
        }
        _ => Err(unsupported(format!("'{name}'"))),
    }
}

/// `a @ b` over the last two dims; leading dims equal to the output's, or absent on `b` (one
/// matrix shared by every batch). Broadcasting of other leading dims is refused.
fn lower_matmul(ta: bool, tb: bool, a: &TRef, b: &TRef, out: &TRef) -> Result<Step> {
    let (ad, bd, od) = (a.shape.dims(), b.shape.dims(), out.shape.dims());
    if ad.len() < 2 || bd.len() < 2 || od.len() < 2 {
        return Err(unsupported("'matmul' of operands below rank 2".into()));
    }
    let (ra, ca) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (rb, cb) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
    let n = if tb { rb } else { cb };
    let lead = &od[..od.len() - 2];
    let shared_b = bd.len() == 2;
    if &ad[..ad.len() - 2] != lead || !(shared_b || &bd[..bd.len() - 2] == lead) {
        return Err(unsupported(format!(
            "'matmul' broadcasting leading dims ({} @ {} -> {})",
            a.shape, b.shape, out.shape
        )));
    }
    let shape = Gemm {
        a: 0,
        b: 0,
        c: 0,
        m,
        n,
        k,
        a_strides: if ta { (1, ca) } else { (ca, 1) },
        b_strides: if tb { (1, cb) } else { (cb, 1) },
        c_row: n,
        alpha: 1.0,
        beta: 0.0,
    };
    Ok(Step::Gemm {
        a: a.clone(),
        b: b.clone(),
        out: out.clone(),
        shape,
        batch: lead.iter().product(),
        a_step: ra * ca * 4,
        b_step: if shared_b { 0 } else { rb * cb * 4 },
    })
}

impl MetalProgram {
    pub fn new(device: MetalDevice, program: &Program, lens: &[usize]) -> Result<Self> {
        rlx_runtime::validate::validate(program, lens, "metal")?;
        let mut steps = Vec::new();
        for instr in &program.instrs {
            let Instr::Op { op, ins, out } = instr else {
                return Err(unsupported("the training update".into()));
            };
            steps.push(lower(op, ins, out)?);
        }
        Ok(Self {
            device,
            steps,
            lens: lens.to_vec(),
        })
    }
}

impl Compiled for MetalProgram {
    #[allow(unsafe_code)] // implements the trait's contract; nothing unsafe is done here
    unsafe fn run(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        _hyper: Option<&OptimHyper>,
    ) -> Result<()> {
        let mut metal: Vec<Option<&MetalBuffer>> = Vec::new();
        for (i, b) in buffers.iter().enumerate() {
            let m = b.as_any().downcast_ref::<MetalBuffer>();
            if m.is_some() && self.lens.get(i).is_some_and(|&l| l > b.len()) {
                return Err(Error::Internal(format!(
                    "buffer {i} has {} bytes, the program was compiled for {}",
                    b.len(),
                    self.lens[i]
                )));
            }
            metal.push(m);
        }
        let addr = |t: &TRef| -> Result<u64> {
            metal
                .get(t.buf as usize)
                .copied()
                .flatten()
                .ok_or_else(|| Error::Internal(format!("no Metal buffer for {:?}", t.buf)))?
                .address(t.offset)
        };
        let mut records = Vec::new();
        for s in &self.steps {
            records.push(match s {
                Step::Unary(k, x, o) => (
                    "rlx_unary_f32",
                    kernels::unary(*k, addr(o)?, addr(x)?, o.shape.numel())?,
                    o.shape.numel(),
                ),
                Step::Binary(k, x, y, o) => (
                    "rlx_binary_f32",
                    kernels::binary(*k, addr(o)?, addr(x)?, addr(y)?, o.shape.numel())?,
                    o.shape.numel(),
                ),
                Step::Gemm {
                    a,
                    b,
                    out,
                    shape,
                    batch,
                    a_step,
                    b_step,
                } => {
                    let (a0, b0, c0) = (addr(a)?, addr(b)?, addr(out)?);
                    let c_step = (shape.m * shape.n * 4) as u64;
                    for i in 0..*batch as u64 {
                        let g = Gemm {
                            a: a0 + i * *a_step as u64,
                            b: b0 + i * *b_step as u64,
                            c: c0 + i * c_step,
                            ..*shape
                        };
                        let (record, threads) = g.record()?;
                        records.push(("rlx_gemm_f32", record, threads));
                    }
                    continue;
                }
            });
        }
        let dispatches: Vec<_> = records
            .iter()
            .map(|(kernel, record, threads)| crate::gpu::Dispatch {
                kernel,
                record,
                threads: *threads,
            })
            .collect();
        let uses: Vec<&MetalBuffer> = metal.iter().flatten().copied().collect();
        self.device.run(None, &dispatches, &uses)
    }
}
