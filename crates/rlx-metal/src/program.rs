//! Lowering a runtime `Program` to Metal kernel launches, for the instructions the kernel library
//! covers so far: float32 element-wise unary ops (neg, relu, tanh, sigmoid, exp, sqrt) and binary
//! ops (add, sub, mul, div) on operands of one shape. Any other instruction is
//! refused at compile with `UnsupportedError` naming it. Checks at compile, as every backend's:
//! each tensor inside its buffer, no output overlapping an operand.
use crate::kernels::{self, BinaryOp as KBin, UnaryOp as KUn};
use crate::{MetalBuffer, MetalDevice};
use rlx_ir::{BinaryOp, DType, Error, Op, Result, UnaryOp};
use rlx_runtime::backend::check_range;
use rlx_runtime::{Compiled, DeviceBuffer, Instr, OptimHyper, Program, TRef};

enum Step {
    Unary(KUn, TRef, TRef),
    Binary(KBin, TRef, TRef, TRef),
}

/// A program lowered to kernel launches.
pub struct MetalProgram {
    device: MetalDevice,
    steps: Vec<Step>,
    lens: Vec<usize>,
}

fn overlaps(a: &TRef, b: &TRef) -> bool {
    a.buf == b.buf && a.offset < b.offset + b.bytes() && b.offset < a.offset + a.bytes()
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

impl MetalProgram {
    pub fn new(device: MetalDevice, program: &Program, lens: &[usize]) -> Result<Self> {
        let mut steps = Vec::new();
        for instr in &program.instrs {
            let Instr::Op { op, ins, out } = instr else {
                return Err(unsupported("the training update".into()));
            };
            for t in ins.iter().chain([out]) {
                let len = lens.get(t.buf as usize).copied().unwrap_or(0);
                check_range("program", t.offset, t.bytes(), len)?;
            }
            if out.bytes() > 0 && ins.iter().any(|i| overlaps(out, i)) {
                return Err(Error::Internal(format!(
                    "an instruction writes over its own operand: {instr:?}"
                )));
            }
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
