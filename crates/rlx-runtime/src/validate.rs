//! The checks every backend makes of a program when it compiles it: each tensor lies inside its
//! buffer, no instruction writes over one of its own operands (nor two of its outputs over each
//! other), and the kernel set has each op for its operands' dtypes. Kernels then rely on these
//! (the CPU backend hands out slices on the strength of them).
use crate::backend::check_range;
use crate::{Error, Instr, Program, Result, TRef, UpdatePlan};
use rlx_ir::{DType, Op};

/// Whether two tensors share a byte (an empty tensor shares none).
pub fn overlaps(a: &TRef, b: &TRef) -> bool {
    a.buf == b.buf
        && a.bytes() > 0
        && b.bytes() > 0
        && a.offset < b.offset + b.bytes()
        && b.offset < a.offset + a.bytes()
}

impl UpdatePlan {
    /// The tensors the update reads and those it writes. Two parameters may share one gradient
    /// tensor, so reads may overlap each other.
    pub fn operands(&self) -> (Vec<&TRef>, Vec<&TRef>) {
        let mut reads = vec![&self.loss];
        let mut writes = vec![&self.stats];
        reads.extend(self.hyper.iter());
        for p in &self.params {
            reads.push(&p.grad);
            writes.push(&p.param);
            writes.extend(p.acc.iter());
            writes.extend(p.state.iter());
            writes.push(&p.step);
            writes.extend(p.started.iter());
        }
        for (src, dst) in &self.buffer_updates {
            reads.push(src);
            writes.push(dst);
        }
        (reads, writes)
    }
}

impl UpdatePlan {
    /// The update's kernels view each parameter's gradient, state and accumulation buffer as
    /// the parameter's dtype (float32 or float64), the counters as int32, the statistics as
    /// float32 and the hyper table as float32 or float64: a plan that says otherwise is refused.
    pub fn check_dtypes(&self) -> Result<()> {
        let bad = |what: &str, t: &TRef, want: DType| {
            Err(Error::Internal(format!(
                "optimizer update: {what} is {} {}, expected {want}",
                t.dtype, t.shape
            )))
        };
        if !matches!(self.loss.dtype, DType::F32 | DType::F64) {
            return bad("the loss", &self.loss, DType::F32);
        }
        if self.stats.dtype != DType::F32 {
            return bad("the statistics", &self.stats, DType::F32);
        }
        if let Some(h) = self
            .hyper
            .as_ref()
            .filter(|h| !matches!(h.dtype, DType::F32 | DType::F64))
        {
            return bad("the hyper table", h, DType::F32);
        }
        for (src, dst) in &self.buffer_updates {
            if src.dtype != dst.dtype || src.shape != dst.shape {
                return bad("a buffer update's source", src, dst.dtype);
            }
        }
        for p in &self.params {
            let want = p.param.dtype;
            if !want.is_trainable() {
                return bad("a parameter", &p.param, DType::F32);
            }
            for t in [&p.grad].into_iter().chain(&p.acc).chain(&p.state) {
                if t.dtype != want {
                    return bad("a parameter's gradient or state", t, want);
                }
            }
            for t in [&p.step].into_iter().chain(&p.started) {
                if t.dtype != DType::I32 {
                    return bad("a step counter", t, DType::I32);
                }
            }
        }
        Ok(())
    }
}

impl Instr {
    /// The tensors the instruction reads and those it writes.
    pub fn operands(&self) -> (Vec<&TRef>, Vec<&TRef>) {
        match self {
            Instr::Op { ins, out, .. } => (ins.iter().collect(), vec![out]),
            Instr::Update(plan) => plan.operands(),
        }
    }
}

/// Whether the kernel set (the same on every backend) has `op` for these operand dtypes.
pub fn has_kernel(op: &Op, ins: &[TRef], out: &TRef) -> bool {
    let all_f32 = ins.iter().all(|t| t.dtype == DType::F32) && out.dtype == DType::F32;
    let int = |t: &TRef| matches!(t.dtype, DType::I32 | DType::I64);
    // The CPU's float64 kernels (a GPU plan then refuses every float64 tensor in `dtypes`).
    let f64_op = matches!(
        op,
        Op::Unary(_)
            | Op::MatMul { .. }
            | Op::Reduce { .. }
            | Op::SumTo { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::Mse
            | Op::Log1p
            | Op::StopGradient
            | Op::Normalize { .. }
            | Op::NormalizeGrad { .. }
            | Op::NormalizeGradAdd { .. }
            | Op::Im2Col { .. }
            | Op::Col2Im { .. }
            | Op::Pool2d { .. }
            | Op::Pool2dGrad { .. }
    );
    if ins.first().is_some_and(|t| t.dtype == DType::F64) {
        let all = ins.iter().chain([out]).all(|t| t.dtype == DType::F64);
        return match op {
            Op::Binary(b) if b.is_comparison() => ins.iter().all(|t| t.dtype == DType::F64),
            Op::Binary(_) => all,
            Op::SoftmaxCrossEntropy | Op::SoftmaxCrossEntropyGrad => {
                ins[1].dtype == DType::I32
                    && ins
                        .iter()
                        .chain([out])
                        .filter(|t| t.dtype != DType::I32)
                        .all(|t| t.dtype == DType::F64)
            }
            Op::Gather | Op::Dropout { .. } => {
                ins[1].dtype == DType::I32 && out.dtype == DType::F64
            }
            Op::Where | Op::BroadcastTo { .. } | Op::Transpose { .. } | Op::Cast { .. } => true,
            Op::Slice { .. } | Op::Pad { .. } | Op::Concat { .. } => true,
            _ => f64_op && all,
        };
    }
    match op {
        Op::Binary(_) => ins.iter().all(|t| t.dtype == DType::F32 || int(t)),
        // Integer sums and maxima keep the dtype (a GPU plan refuses them by name).
        Op::Reduce { .. } if int(&ins[0]) => out.dtype == ins[0].dtype,
        // Data movement works on every dtype (by element size).
        Op::BroadcastTo { .. }
        | Op::Transpose { .. }
        | Op::Cast { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::Concat { .. } => true,
        Op::Gather => ins[0].dtype == DType::F32 && ins[1].dtype == DType::I32,
        Op::ScatterAdd { .. } => {
            ins[0].dtype == DType::I32
                && matches!(ins[1].dtype, DType::F32 | DType::F64)
                && out.dtype == ins[1].dtype
        }
        Op::Where => {
            (matches!(ins[0].dtype, DType::F32 | DType::F64 | DType::Bool) || int(&ins[0]))
                && ins[1].dtype == out.dtype
        }
        Op::SoftmaxCrossEntropy | Op::SoftmaxCrossEntropyGrad => ins[1].dtype == DType::I32,
        Op::Dropout { .. } => ins[0].dtype == DType::F32 && ins[1].dtype == DType::I32,
        // The mixed-precision matmul: two bfloat16 (or two float16) operands, float32 result
        // (a backend whose memory cannot hold those dtypes refuses them in `dtypes` first).
        Op::MatMul { .. } | Op::MatMulEpilogue { .. }
            if ins[0].dtype == ins[1].dtype && ins[0].dtype.is_low_precision() =>
        {
            ins[2..].iter().all(|t| t.dtype == DType::F32) && out.dtype == DType::F32
        }
        _ => all_f32,
    }
}

/// Refuses a program that holds a tensor of a dtype outside `allowed`, for a backend whose
/// kernels (even data movement and casts) cover fewer dtypes than the CPU's.
pub fn dtypes(program: &Program, backend: &str, allowed: &[DType]) -> Result<()> {
    for instr in &program.instrs {
        let (reads, writes) = instr.operands();
        if let Some(t) = reads
            .iter()
            .chain(&writes)
            .find(|t| !allowed.contains(&t.dtype))
        {
            let what = match instr {
                Instr::Op { op, .. } => op.name(),
                Instr::Update(_) => "optimizer update",
            };
            let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
            let names = match names.split_last() {
                Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
                _ => names.join(""),
            };
            return Err(Error::dtype(
                what,
                format!(
                    "the {backend} backend supports only {} tensors so far, this program holds a {} tensor {}; \
                     run it on the cpu or cast with .astype('float32')",
                    names,
                    t.dtype,
                    t.shape
                ),
            ));
        }
    }
    Ok(())
}

/// Runs every check over buffers of `lens` bytes (indexed by [`crate::Buf`]); `backend` names
/// the backend in the error for a missing kernel.
pub fn validate(program: &Program, lens: &[usize], backend: &str) -> Result<()> {
    for instr in &program.instrs {
        if let Instr::Op { op, ins, out } = instr {
            if !has_kernel(op, ins, out) {
                let dts: Vec<&str> = ins.iter().map(|t| t.dtype.name()).collect();
                return Err(Error::unsupported(
                    op.name(),
                    format!("the {backend} backend has no kernel for dtypes {dts:?}"),
                ));
            }
        }
        if let Instr::Update(plan) = instr {
            plan.check_dtypes()?;
        }
        let (reads, writes) = instr.operands();
        for t in reads.iter().chain(&writes) {
            let len = lens.get(t.buf as usize).copied().unwrap_or(0);
            check_range("program", t.offset, t.bytes(), len)?;
        }
        for (i, w) in writes.iter().enumerate() {
            let clash = reads.iter().any(|r| overlaps(w, r))
                || writes[i + 1..].iter().any(|o| overlaps(w, o));
            if clash {
                return Err(Error::Internal(format!(
                    "an instruction writes over its own operand: {instr:?}"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Buf, OptimRule, UpdateParam};
    use rlx_ir::Shape;

    fn t(offset: usize, dims: &[usize], dtype: DType) -> TRef {
        TRef {
            buf: Buf::Arena,
            offset,
            shape: Shape::new(dims.to_vec()),
            dtype,
        }
    }

    fn plan(param: DType, grad: DType, state: DType) -> UpdatePlan {
        UpdatePlan {
            rule: OptimRule::Adam,
            params: vec![UpdateParam {
                param: t(0, &[4], param),
                grad: t(64, &[4], grad),
                acc: None,
                state: vec![t(128, &[4], state), t(192, &[4], state)],
                step: t(256, &[], DType::I32),
                started: None,
                row: 0,
            }],
            hyper: Some(t(320, &[1, crate::hyper_col::LEN], DType::F64)),
            loss: t(448, &[], DType::F64),
            stats: t(512, &[crate::stat::LEN], DType::F32),
            clip: None,
            accumulate: 1,
            skip_nonfinite: false,
            buffer_updates: vec![],
        }
    }

    #[test]
    fn an_update_views_each_parameter_in_its_own_dtype() {
        plan(DType::F32, DType::F32, DType::F32)
            .check_dtypes()
            .unwrap();
        plan(DType::F64, DType::F64, DType::F64)
            .check_dtypes()
            .unwrap();
        // The CPU kernel would read 8-byte elements from a 4-byte tensor: refused.
        for (p, g, s) in [
            (DType::F64, DType::F32, DType::F64),
            (DType::F64, DType::F64, DType::F32),
            (DType::BF16, DType::BF16, DType::BF16),
        ] {
            let e = plan(p, g, s).check_dtypes().unwrap_err().to_string();
            assert!(e.contains("optimizer update"), "{e}");
        }
        let mut bad = plan(DType::F32, DType::F32, DType::F32);
        bad.params[0].step.dtype = DType::F32;
        assert!(bad
            .check_dtypes()
            .unwrap_err()
            .to_string()
            .contains("step counter"));
    }
}
