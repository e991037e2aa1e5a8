//! Runs a lowered program on the host: checks every range once, then dispatches each instruction.
use crate::kernels;
use crate::mem::Bases;
use crate::schedule::Step;
use rlx_ir::{BinaryOp, DType, Error, Op, Result};
use rlx_runtime::{Compiled, DeviceBuffer, Instr, OptimHyper, Program, TRef};

pub struct CpuProgram {
    instrs: Vec<Instr>,
    /// The order the instructions run in, some in pairs (`schedule`).
    steps: Vec<Step>,
    /// A copy of a paired convolution's image where the pair's output reuses its memory.
    snapshot: Vec<f32>,
    lens: Vec<usize>,
    /// With `RLX_PROFILE=1`: seconds and calls per instruction kind, printed when dropped.
    profile: Option<rlx_runtime::profile::Profile>,
}

impl Drop for CpuProgram {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            let has_update = self.instrs.iter().any(|i| matches!(i, Instr::Update(_)));
            let title = format!(
                "rlx profile ({} program of {} instructions)",
                if has_update { "training" } else { "inference" },
                self.instrs.len()
            );
            eprint!("{}", rlx_runtime::profile::render(&title, p));
        }
    }
}

fn profile_key(instr: &Instr) -> String {
    match instr {
        Instr::Op { op, ins, out } => {
            let shapes: Vec<String> = ins.iter().map(|t| t.shape.to_string()).collect();
            format!("{} {}->{}", op.name(), shapes.join(","), out.shape)
        }
        Instr::Update(plan) => format!("update {:?}", plan.rule),
    }
}

impl CpuProgram {
    /// Checks that every tensor lies inside its buffer and that no instruction's output overlaps
    /// one of its inputs — the invariants `mem::Bases` relies on to hand out slices.
    pub fn new(program: &Program, lens: &[usize]) -> Result<CpuProgram> {
        rlx_runtime::validate::validate(program, lens, "cpu")?;
        let profile = rlx_runtime::profile::requested().then(Default::default);
        Ok(CpuProgram {
            instrs: program.instrs.clone(),
            steps: crate::schedule::schedule(&program.instrs, crate::pool::thread_count()),
            snapshot: Vec::new(),
            lens: lens.to_vec(),
            profile,
        })
    }
}

impl Compiled for CpuProgram {
    unsafe fn run(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&OptimHyper>,
    ) -> Result<()> {
        // Where kernels' parallel loops find live threads (see `pool`: a forked child gets a
        // pool of its own).
        crate::pool::run(|| self.run_on_pool(buffers, hyper))
    }
}

impl CpuProgram {
    fn run_on_pool(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&OptimHyper>,
    ) -> Result<()> {
        let b = &Bases::new(buffers, &self.lens)?;
        for &step in &self.steps {
            let t0 = self.profile.is_some().then(std::time::Instant::now);
            match step {
                Step::One(i) => match &self.instrs[i] {
                    // SAFETY (for every `get`/`get_mut` below): `CpuProgram::new` proved each
                    // output is disjoint from the instruction's inputs, and only one `&mut` is
                    // taken per instruction.
                    Instr::Op { op, ins, out } => unsafe { run_op(b, op, ins, out)? },
                    // SAFETY: `CpuProgram::new` proved the update's written tensors disjoint
                    // from each other and from everything it reads.
                    Instr::Update(plan) => unsafe { crate::train::run(b, plan, hyper)? },
                },
                Step::Both { first, second } => {
                    let instrs = &self.instrs;
                    let one = |i: usize| match &instrs[i] {
                        // SAFETY: as for `Step::One`, and `schedule` paired the two only where
                        // neither writes a byte the other reads or writes.
                        Instr::Op { op, ins, out } => {
                            crate::sgemm::on_own_core(|| unsafe { run_op(b, op, ins, out) })
                        }
                        Instr::Update(_) => Err(Error::Internal("a paired update".into())),
                    };
                    let (x, y) = rayon::join(|| one(first), || one(second));
                    x?;
                    y?;
                }
                // SAFETY: as for `Step::One`, and `schedule` formed the pair only where the
                // two instructions' tensors allow it (see `run_pair`).
                _ => unsafe { run_pair(b, &self.instrs, step, &mut self.snapshot)? },
            }
            if let (Some(t0), Some(p)) = (t0, self.profile.as_mut()) {
                let keys: Vec<String> = step
                    .instrs()
                    .iter()
                    .map(|&i| profile_key(&self.instrs[i]))
                    .collect();
                let key = keys.join(" + ");
                rlx_runtime::profile::add(p, key, t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(())
    }
}

/// Runs a pair of instructions of the schedule together (`kernels::conv_gemm`); a pair whose
/// epilogue cannot be split by image runs as its two instructions.
///
/// # Safety
/// Each instruction's output must be disjoint from its inputs (checked by `CpuProgram::new`),
/// and the pair one that `schedule` formed: the patches overlap no other input of the product,
/// and a `col2im`'s output overlaps neither input of its product.
unsafe fn run_pair(b: &Bases, instrs: &[Instr], step: Step, snapshot: &mut Vec<f32>) -> Result<()> {
    let parts = |i: usize| match &instrs[i] {
        Instr::Op { op, ins, out } => Ok((op, &ins[..], out)),
        Instr::Update(_) => Err(Error::Internal("a paired update".into())),
    };
    match step {
        Step::Im2ColMatMul {
            im2col,
            matmul,
            snapshot: copy,
        } => {
            let (Op::Im2Col { window, .. }, [x], cols) = parts(im2col)? else {
                return Err(Error::Internal("a pair without its im2col".into()));
            };
            let (mm, ins, out) = parts(matmul)?;
            // SAFETY: inputs are read only; the image and the product's inputs other than the
            // patches are disjoint from the patches (checked by `CpuProgram::new` and
            // `schedule`), and the output is disjoint from every input of the product.
            let (xs, w) = unsafe { (b.get::<f32>(x), b.get::<f32>(&ins[0])) };
            let xs: &[f32] = if copy {
                // The output reuses the image's memory: read the image from a copy.
                snapshot.clear();
                snapshot.extend_from_slice(xs);
                snapshot
            } else {
                xs
            };
            let extra: Vec<(&[f32], &[usize])> = ins[2..]
                .iter()
                .map(|t| (unsafe { b.get::<f32>(t) }, t.shape.dims()))
                .collect();
            let epilogue = match mm {
                Op::MatMulEpilogue { epilogue, .. } => Some((&**epilogue, &extra[..])),
                _ => None,
            };
            let (pc, po) = unsafe { (b.get_mut::<f32>(cols), b.get_mut::<f32>(out)) };
            let xd = x.shape.dims();
            if !kernels::conv_gemm::im2col_matmul(
                xs,
                xd,
                window,
                pc,
                w,
                ins[0].shape.dims(),
                epilogue,
                po,
            ) {
                unsafe {
                    run_op(b, parts(im2col)?.0, std::slice::from_ref(x), cols)?;
                    run_op(b, mm, ins, out)?;
                }
            }
        }
        Step::MatMulCol2Im { matmul, col2im } => {
            let (Op::MatMul { trans_a, .. }, [w, dy], cols) = parts(matmul)? else {
                return Err(Error::Internal("a pair without its matmul".into()));
            };
            let (Op::Col2Im { window, .. }, _, dx) = parts(col2im)? else {
                return Err(Error::Internal("a pair without its col2im".into()));
            };
            // SAFETY: `w` and `dy` are read only; the patches and the image are disjoint from
            // them and from each other (checked by `CpuProgram::new` and `schedule`).
            unsafe {
                kernels::conv_gemm::matmul_col2im(
                    b.get::<f32>(w),
                    w.shape.dims(),
                    *trans_a,
                    b.get::<f32>(dy),
                    b.get_mut::<f32>(cols),
                    window,
                    dx.shape.dims(),
                    b.get_mut::<f32>(dx),
                )
            }
        }
        Step::One(_) | Step::Both { .. } => unreachable!("not a pair run here"),
    }
    Ok(())
}

/// Runs `$body` with `$T` the unsigned integer type of `$dt`'s element size: data movement
/// copies elements as plain bits, so one instance per size serves every dtype.
macro_rules! by_size {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt.size() {
            1 => {
                type $T = u8;
                $body
            }
            2 => {
                type $T = u16;
                $body
            }
            4 => {
                type $T = u32;
                $body
            }
            _ => {
                type $T = u64;
                $body
            }
        }
    };
}

/// The bfloat16 or float16 operands of a matmul (`None` for float32 ones).
///
/// # Safety
/// As `run_op`: the operands are only read and no output of the instruction overlaps them.
unsafe fn lowp_operands<'a>(
    b: &'a Bases,
    op: &Op,
    ins: &[TRef],
) -> Result<Option<kernels::lowp::Lowp<'a>>> {
    use kernels::lowp::Lowp;
    // SAFETY: the caller's contract (inputs are read-only and disjoint from the output).
    let bits = |i: usize| unsafe { b.get::<u16>(&ins[i]) };
    Ok(match (ins[0].dtype, ins[1].dtype) {
        (DType::F32, DType::F32) => None,
        (DType::BF16, DType::BF16) => Some(Lowp::BF16(bits(0), bits(1))),
        (DType::F16, DType::F16) => Some(Lowp::F16(bits(0), bits(1))),
        (x, y) => {
            return Err(Error::Internal(format!(
                "[{}] reached the cpu kernel with {x} x {y} operands",
                op.name()
            )))
        }
    })
}

fn last(dims: &[usize]) -> usize {
    dims.last().copied().unwrap_or(1)
}

/// A binary op of two integer tensors of type `T`: wrapping arithmetic, floor division and
/// remainder (a zero divisor is an error), a float32 quotient for `/`, float32 masks for
/// comparisons.
///
/// # Safety
/// As [`run_op`].
unsafe fn int_binary<T: kernels::elementwise::Int + crate::mem::Elem>(
    b: &Bases,
    op: &Op,
    bop: BinaryOp,
    ins: &[TRef],
    out: &TRef,
) -> Result<()> {
    use kernels::elementwise;
    let (a, c) = (&ins[0], &ins[1]);
    let (ash, csh, od) = (a.shape.dims(), c.shape.dims(), out.shape.dims());
    // SAFETY: the contract of `run_op` (inputs read, `out` disjoint from them).
    unsafe {
        let (x, y) = (b.get::<T>(a), b.get::<T>(c));
        if bop == BinaryOp::Div {
            elementwise::int_true_div(x, ash, y, csh, od, b.get_mut::<f32>(out));
        } else if bop.is_comparison() {
            elementwise::compare_into(bop, x, ash, y, csh, od, b.get_mut::<f32>(out));
        } else {
            let divides = matches!(bop, BinaryOp::FloorDiv | BinaryOp::Mod);
            if divides && out.numel() > 0 && elementwise::has_zero(y) {
                return Err(Error::Graph(format!(
                    "[{}] integer division by zero (the {} divisor {} holds a 0)",
                    op.name(),
                    c.dtype,
                    c.shape
                )));
            }
            elementwise::binary(bop, x, ash, y, csh, od, b.get_mut::<T>(out));
        }
    }
    Ok(())
}

/// The ops that compute in float64 (`kernels::wide` and the generic binary and reduction
/// kernels); `None` for any other op or dtype, which `run_op` runs.
///
/// # Safety
/// As [`run_op`].
unsafe fn run_f64(b: &Bases, op: &Op, ins: &[TRef], out: &TRef) -> Option<Result<()>> {
    use kernels::{conv, elementwise, nn, reduce, wide};
    // A scatter-add's first operand is its int32 ids: its gradient rows give the dtype.
    if let Op::ScatterAdd { rows } = op {
        if ins.get(1)?.dtype != DType::F64 {
            return None;
        }
        // SAFETY: as below.
        let (ids, g) = unsafe { (b.get::<i32>(&ins[0]), b.get::<f64>(&ins[1])) };
        return Some(nn::scatter_add(ids, g, *rows, unsafe {
            b.get_mut::<f64>(out)
        }));
    }
    if ins.first()?.dtype != DType::F64 {
        return None;
    }
    // SAFETY: inputs are only read, and `out` overlaps none of them (the caller's contract).
    let x: Vec<&[f64]> = ins
        .iter()
        .map(|t| match t.dtype {
            DType::F64 => unsafe { b.get::<f64>(t) },
            _ => &[],
        })
        .collect();
    let sh = |i: usize| ins[i].shape.dims();
    let od = out.shape.dims();
    // SAFETY: as above; `out` is written once, by one kernel.
    let o = || unsafe { b.get_mut::<f64>(out) };
    let labels = || unsafe { b.get::<i32>(&ins[1]) };
    let width = |d: &[usize]| d.last().copied().unwrap_or(1);
    match op {
        Op::Unary(u) => wide::unary(*u, x[0], o()),
        Op::Binary(bop) if bop.is_comparison() => {
            // SAFETY: as above (the mask is float32).
            let mask = unsafe { b.get_mut::<f32>(out) };
            elementwise::compare_into(*bop, x[0], sh(0), x[1], sh(1), od, mask)
        }
        Op::Binary(bop) => elementwise::binary(*bop, x[0], sh(0), x[1], sh(1), od, o()),
        Op::MatMul { trans_a, trans_b } => {
            wide::matmul(x[0], sh(0), *trans_a, x[1], sh(1), *trans_b, o(), od)
        }
        Op::Reduce { op: r, axes, .. } => reduce::reduce_f64(*r, x[0], sh(0), axes, o()),
        Op::SumTo { .. } => reduce::sum_to_f64(x[0], sh(0), o(), od),
        Op::Softmax { axis } => wide::softmax(x[0], sh(0), *axis, false, o()),
        Op::LogSoftmax { axis } => wide::softmax(x[0], sh(0), *axis, true, o()),
        Op::SoftmaxCrossEntropy => match wide::cross_entropy(x[0], sh(0), labels()) {
            Ok(v) => o()[0] = v,
            Err(e) => return Some(Err(e)),
        },
        Op::SoftmaxCrossEntropyGrad => {
            let g = x[2][0];
            if let Err(e) = wide::cross_entropy_grad(x[0], sh(0), labels(), g, o()) {
                return Some(Err(e));
            }
        }
        Op::Mse => o()[0] = wide::mse(x[0], x[1]),
        Op::Im2Col { window, k_major } => conv::patches(*k_major, x[0], sh(0), window, o()),
        Op::Col2Im {
            window, k_major, ..
        } => conv::unpatch(*k_major, x[0], window, od, o()),
        Op::Pool2d { window, max } => conv::pool2d(x[0], sh(0), window, *max, o()),
        Op::Pool2dGrad { window, max } => conv::pool2d_grad(x[0], sh(0), x[1], window, *max, o()),
        Op::Gather => {
            // SAFETY: as above (the ids are int32).
            let ids = unsafe { b.get::<i32>(&ins[1]) };
            if let Err(e) = nn::gather(x[0], sh(0)[0], ids, o()) {
                return Some(Err(e));
            }
        }
        Op::Dropout { p } => {
            // SAFETY: as above (the seed is int32).
            let s = unsafe { b.get::<i32>(&ins[1]) };
            conv::dropout(x[0], [s[0], s[1]], *p, o())
        }
        Op::Log1p => o().iter_mut().zip(x[0]).for_each(|(o, v)| *o = v.ln_1p()),
        Op::StopGradient => o().copy_from_slice(x[0]),
        Op::Normalize { eps } => wide::normalize(x[0], width(sh(0)), *eps as f64, o()),
        Op::NormalizeGrad { eps } => {
            wide::normalize_grad_add(x[0], x[1], None, width(sh(0)), *eps as f64, o())
        }
        Op::NormalizeGradAdd { eps } => {
            wide::normalize_grad_add(x[0], x[1], Some(x[2]), width(sh(0)), *eps as f64, o())
        }
        _ => return None,
    }
    Some(Ok(()))
}

/// A `where` condition of another dtype as the float32 0/1 mask the select kernel takes.
fn nonzero<T: Copy + PartialEq + Default>(x: &[T]) -> Vec<f32> {
    x.iter()
        .map(|&v| (v != T::default()) as i32 as f32)
        .collect()
}

/// # Safety
/// `out` must not overlap any of `ins` (checked by `CpuProgram::new`).
unsafe fn run_op(b: &Bases, op: &Op, ins: &[TRef], out: &TRef) -> Result<()> {
    use kernels::*;
    // SAFETY: the contract of `run_op`.
    if let Some(done) = unsafe { run_f64(b, op, ins, out) } {
        return done;
    }
    // The float32 inputs, taken once, read-only. (No closure that hides a `get`: the one
    // unsafe step is here, and `f(i)` only indexes slices already taken.)
    let floats: Vec<&[f32]> = ins
        .iter()
        .map(|t| match t.dtype {
            // SAFETY: inputs are only read, and `CpuProgram::new` proved `out` overlaps none of
            // them (the caller's contract), so no `&mut` aliases these slices.
            DType::F32 => unsafe { b.get::<f32>(t) },
            _ => &[],
        })
        .collect();
    let f = |i: usize| floats[i];
    let sh = |i: usize| ins[i].shape.dims();
    let od = out.shape.dims();
    match op {
        Op::Unary(u) => elementwise::unary(*u, f(0), unsafe { b.get_mut(out) }),
        Op::Fused(e) => {
            let srcs: Vec<(&[f32], &[usize])> = (0..ins.len()).map(|i| (f(i), sh(i))).collect();
            fused::fused(e, &srcs, unsafe { b.get_mut(out) })
        }
        Op::FusedSumTo { expr, .. } => {
            let srcs: Vec<(&[f32], &[usize])> = (0..ins.len()).map(|i| (f(i), sh(i))).collect();
            fused::fused_sum_to(expr, &srcs, unsafe { b.get_mut(out) }, od)
        }
        Op::MatMulEpilogue {
            trans_a,
            trans_b,
            epilogue,
        } => {
            let xs: Vec<(&[f32], &[usize])> = (2..ins.len()).map(|i| (f(i), sh(i))).collect();
            // SAFETY: the contract of `run_op`.
            if let Some(ops) = unsafe { lowp_operands(b, op, ins)? } {
                fused::matmul_epilogue_lowp(
                    epilogue,
                    ops,
                    sh(0),
                    *trans_a,
                    sh(1),
                    *trans_b,
                    &xs,
                    unsafe { b.get_mut(out) },
                );
                return Ok(());
            }
            fused::matmul_epilogue(
                epilogue,
                f(0),
                sh(0),
                *trans_a,
                f(1),
                sh(1),
                *trans_b,
                &xs,
                unsafe { b.get_mut(out) },
            )
        }
        // `lowp` is not used: this backend computes attention in float32 throughout (at least
        // as accurate as the low-precision products it allows).
        Op::Attention {
            scale,
            causal,
            heads,
            ..
        }
        | Op::AttentionGrad {
            scale,
            causal,
            heads,
            ..
        } => {
            let n = if heads.is_some() { 1 } else { 3 };
            let shapes: Vec<&[usize]> = (0..n).map(sh).collect();
            let geo = attention::Geometry::new(&shapes, *heads, *scale, *causal);
            if matches!(op, Op::Attention { .. }) {
                attention::forward(&geo, &floats, unsafe { b.get_mut(out) })
            } else {
                attention::backward(&geo, &floats, unsafe { b.get_mut(out) })
            }
        }
        Op::Binary(bop) => unsafe {
            match (ins[0].dtype, bop.is_comparison()) {
                (DType::F32, _) => {
                    elementwise::binary(*bop, f(0), sh(0), f(1), sh(1), od, b.get_mut(out))
                }
                (DType::I32, _) => int_binary::<i32>(b, op, *bop, ins, out)?,
                (DType::I64, _) => int_binary::<i64>(b, op, *bop, ins, out)?,
                (dt, _) => {
                    return Err(Error::Internal(format!(
                        "[{}] reached the cpu kernel with {dt} operands",
                        op.name()
                    )))
                }
            }
        },
        // SAFETY: the contract of `run_op`.
        Op::MatMul { trans_a, trans_b } => match unsafe { lowp_operands(b, op, ins)? } {
            None => matmul::matmul(
                f(0),
                sh(0),
                *trans_a,
                f(1),
                sh(1),
                *trans_b,
                unsafe { b.get_mut(out) },
                od,
            ),
            Some(ops) => lowp::matmul(
                ops,
                sh(0),
                *trans_a,
                sh(1),
                *trans_b,
                unsafe { b.get_mut(out) },
                od,
            ),
        },
        Op::Reduce { op: r, axes, .. } => match ins[0].dtype {
            DType::I32 => unsafe {
                reduce::reduce_int(*r, b.get::<i32>(&ins[0]), sh(0), axes, b.get_mut(out))
            },
            DType::I64 => unsafe {
                reduce::reduce_int(*r, b.get::<i64>(&ins[0]), sh(0), axes, b.get_mut(out))
            },
            _ => reduce::reduce(*r, f(0), sh(0), axes, unsafe { b.get_mut(out) }),
        },
        Op::SumTo { .. } => reduce::sum_to(f(0), sh(0), unsafe { b.get_mut(out) }, od),
        Op::Transpose { perm } if out.dtype == DType::F32 && layout::swaps_last_two(perm) => {
            let d = sh(0);
            let r = d.len();
            layout::transpose_last_two(f(0), d[r - 2], d[r - 1], unsafe { b.get_mut(out) })
        }
        Op::BroadcastTo { .. } | Op::Transpose { .. } => {
            let src = match op {
                Op::Transpose { perm } => Strided::permuted(sh(0), perm),
                _ => Strided::broadcast(sh(0), od),
            };
            by_size!(out.dtype, T => unsafe {
                layout::gather(b.get::<T>(&ins[0]), &src, od, b.get_mut::<T>(out))
            })
        }
        Op::Softmax { axis } => nn::softmax(f(0), sh(0), *axis, false, unsafe { b.get_mut(out) }),
        Op::LogSoftmax { axis } => nn::softmax(f(0), sh(0), *axis, true, unsafe { b.get_mut(out) }),
        Op::SoftmaxCrossEntropy => {
            let loss = nn::cross_entropy(f(0), sh(0), unsafe { b.get::<i32>(&ins[1]) })?;
            unsafe { b.get_mut::<f32>(out)[0] = loss };
        }
        Op::SoftmaxCrossEntropyGrad => {
            let g = f(2)[0];
            nn::cross_entropy_grad(f(0), sh(0), unsafe { b.get::<i32>(&ins[1]) }, g, unsafe {
                b.get_mut(out)
            })?
        }
        Op::Mse => unsafe { b.get_mut::<f32>(out)[0] = nn::mse(f(0), f(1)) },
        Op::Where => {
            let cond: Vec<f32>;
            let c = match ins[0].dtype {
                DType::F32 => f(0),
                DType::I32 => {
                    cond = nonzero(unsafe { b.get::<i32>(&ins[0]) });
                    &cond
                }
                DType::F64 => {
                    cond = nonzero(unsafe { b.get::<f64>(&ins[0]) });
                    &cond
                }
                DType::I64 => {
                    cond = nonzero(unsafe { b.get::<i64>(&ins[0]) });
                    &cond
                }
                DType::Bool => {
                    cond = nonzero(unsafe { b.get::<u8>(&ins[0]) });
                    &cond
                }
                dt => {
                    return Err(Error::Internal(format!(
                        "[where] reached the cpu kernel with a {dt} condition"
                    )))
                }
            };
            by_size!(out.dtype, T => unsafe {
                elementwise::select(
                    c,
                    sh(0),
                    b.get::<T>(&ins[1]),
                    sh(1),
                    b.get::<T>(&ins[2]),
                    sh(2),
                    od,
                    b.get_mut::<T>(out),
                )
            })
        }
        Op::Cast { .. } => unsafe {
            use cast::{Dst, Src};
            let x = &ins[0];
            let src = match x.dtype {
                DType::F32 => Src::F32(b.get(x)),
                DType::I32 => Src::I32(b.get(x)),
                DType::F16 => Src::F16(b.get(x)),
                DType::BF16 => Src::BF16(b.get(x)),
                DType::F64 => Src::F64(b.get(x)),
                DType::I64 => Src::I64(b.get(x)),
                DType::Bool => Src::Bool(b.get(x)),
            };
            let dst = match out.dtype {
                DType::F32 => Dst::F32(b.get_mut(out)),
                DType::I32 => Dst::I32(b.get_mut(out)),
                DType::F16 => Dst::F16(b.get_mut(out)),
                DType::BF16 => Dst::BF16(b.get_mut(out)),
                DType::F64 => Dst::F64(b.get_mut(out)),
                DType::I64 => Dst::I64(b.get_mut(out)),
                DType::Bool => Dst::Bool(b.get_mut(out)),
            };
            cast::cast(src, dst)
        },
        Op::Gather => nn::gather(f(0), sh(0)[0], unsafe { b.get::<i32>(&ins[1]) }, unsafe {
            b.get_mut(out)
        })?,
        Op::ScatterAdd { rows } => {
            nn::scatter_add(unsafe { b.get::<i32>(&ins[0]) }, f(1), *rows, unsafe {
                b.get_mut(out)
            })?
        }
        Op::Normalize { eps } => nn::normalize(f(0), last(sh(0)), *eps, unsafe { b.get_mut(out) }),
        Op::NormalizeGrad { eps } => {
            nn::normalize_grad(f(0), f(1), last(sh(0)), *eps, unsafe { b.get_mut(out) })
        }
        Op::NormalizeGradAdd { eps } => {
            let acc = Some(f(2));
            nn::normalize_grad_add(f(0), f(1), acc, last(sh(0)), *eps, unsafe {
                b.get_mut(out)
            })
        }
        Op::Slice { axis, start, .. } => by_size!(out.dtype, T => unsafe {
            layout::slice(b.get::<T>(&ins[0]), sh(0), *axis, *start, b.get_mut::<T>(out))
        }),
        Op::Pad { axis, before, .. } => by_size!(out.dtype, T => unsafe {
            layout::pad(b.get::<T>(&ins[0]), sh(0), *axis, *before, od, b.get_mut::<T>(out))
        }),
        Op::Concat { axis } => by_size!(out.dtype, T => unsafe {
            let parts: Vec<(&[T], &[usize])> = ins
                .iter()
                .map(|t| (b.get::<T>(t), t.shape.dims()))
                .collect();
            layout::concat(&parts, *axis, od, b.get_mut::<T>(out))
        }),
        Op::Im2Col { window, k_major } => {
            conv::patches(*k_major, f(0), sh(0), window, unsafe { b.get_mut(out) })
        }
        Op::Col2Im {
            window, k_major, ..
        } => conv::unpatch(*k_major, f(0), window, od, unsafe { b.get_mut(out) }),
        Op::Pool2d { window, max } => {
            conv::pool2d(f(0), sh(0), window, *max, unsafe { b.get_mut(out) })
        }
        Op::Pool2dGrad { window, max } => {
            conv::pool2d_grad(f(0), sh(0), f(1), window, *max, unsafe { b.get_mut(out) })
        }
        Op::Dropout { p } => {
            let s = unsafe { b.get::<i32>(&ins[1]) };
            conv::dropout(f(0), [s[0], s[1]], *p, unsafe { b.get_mut(out) })
        }
        Op::Log1p => conv::log1p(f(0), unsafe { b.get_mut(out) }),
        Op::StopGradient => unsafe { b.get_mut::<f32>(out).copy_from_slice(f(0)) },
        Op::Input { .. } | Op::Param { .. } | Op::Const { .. } | Op::Reshape { .. } => {
            return Err(Error::Internal(format!("[{}] is not a kernel", op.name())))
        }
    }
    Ok(())
}
