//! Shape and dtype inference: one rule per op, each failure naming the op, shapes and dtypes.
use crate::{BinaryOp, DType, Error, Node, Op, ReduceOp, Result, Shape};

/// Infers the output shape and dtype of `op` applied to `ins`.
pub fn infer(op: &Op, ins: &[&Node]) -> Result<(Shape, DType)> {
    let name = op.name();
    // Operand `i` must be float32: int32 is a plain mismatch, the other dtypes have no kernels
    // yet (the message lists every operand's dtype and says how to cast).
    let float = |i: usize| -> Result<()> {
        match ins[i].dtype {
            DType::F32 => Ok(()),
            DType::I32 => Err(Error::dtype(
                name,
                format!("expects float32, got {}", ins[i].dtype),
            )),
            _ => Err(unsupported(name, ins)),
        }
    };
    // Operand `i` of an op with float64 kernels (CPU): float32, or float64 beside a float64
    // operand 0; the op's float dtype is returned.
    let real = |i: usize| -> Result<DType> {
        match (ins[i].dtype, ins[0].dtype) {
            (DType::F64, DType::F64) => Ok(DType::F64),
            (DType::F64, _) | (_, DType::F64) => Err(unsupported(name, ins)),
            _ => float(i).map(|()| DType::F32),
        }
    };
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::Const { .. } => Err(Error::Graph(format!(
            "[{name}] has no inputs to infer from"
        ))),
        Op::Unary(_) => Ok((ins[0].shape.clone(), real(0)?)),
        Op::Binary(b) => {
            if ins
                .iter()
                .any(|x| !matches!(x.dtype, DType::F32 | DType::F64 | DType::I32 | DType::I64))
            {
                return Err(unsupported(name, ins));
            }
            if ins[0].dtype != ins[1].dtype {
                return Err(Error::dtype(
                    name,
                    format!(
                        "operands have different dtypes: {} and {}",
                        ins[0].dtype, ins[1].dtype
                    ),
                ));
            }
            let shape = broadcast(name, &ins[0].shape, &ins[1].shape)?;
            // Comparisons give masks; true division of integers gives a float quotient.
            let int_div = *b == BinaryOp::Div && !ins[0].dtype.is_float();
            let dtype = if b.is_comparison() || int_div {
                DType::F32
            } else {
                ins[0].dtype
            };
            Ok((shape, dtype))
        }
        Op::MatMul { trans_a, trans_b } => matmul(ins[0], ins[1], *trans_a, *trans_b),
        Op::Reduce {
            op: r,
            axes,
            keepdims,
        } => {
            // Integers sum and take maxima in their own dtype (no mean: it is not an integer).
            let int = matches!(ins[0].dtype, DType::I32 | DType::I64) && *r != ReduceOp::Mean;
            if !int {
                real(0)?;
            }
            let s = &ins[0].shape;
            check_axes(name, s, axes)?;
            if *r == ReduceOp::Max && axes.iter().any(|&a| s.0[a] == 0) {
                return Err(Error::shape(
                    name,
                    format!("cannot take the max over an empty axis of {s}"),
                ));
            }
            Ok((reduced_shape(s, axes, *keepdims), ins[0].dtype))
        }
        Op::BroadcastTo { shape } => {
            let b = broadcast(name, &ins[0].shape, shape)?;
            if &b != shape {
                return Err(Error::shape(
                    name,
                    format!("cannot broadcast {} to {shape}", ins[0].shape),
                ));
            }
            Ok((shape.clone(), ins[0].dtype))
        }
        Op::SumTo { shape } => {
            let dtype = real(0)?;
            let b = broadcast(name, &ins[0].shape, shape)?;
            if b != ins[0].shape {
                return Err(Error::shape(
                    name,
                    format!("cannot sum {} down to {shape}", ins[0].shape),
                ));
            }
            Ok((shape.clone(), dtype))
        }
        Op::Reshape { shape } => {
            if shape.numel() != ins[0].shape.numel() {
                return Err(Error::shape(
                    name,
                    format!(
                        "cannot reshape {} ({} elements) to {shape}",
                        ins[0].shape,
                        ins[0].shape.numel()
                    ),
                ));
            }
            Ok((shape.clone(), ins[0].dtype))
        }
        Op::Transpose { perm } => {
            let s = &ins[0].shape;
            let mut seen = vec![false; s.rank()];
            let valid = perm.len() == s.rank()
                && perm
                    .iter()
                    .all(|&p| p < s.rank() && !std::mem::replace(&mut seen[p], true));
            if !valid {
                return Err(Error::shape(
                    name,
                    format!("axes {perm:?} are not a permutation for {s}"),
                ));
            }
            Ok((Shape(perm.iter().map(|&p| s.0[p]).collect()), ins[0].dtype))
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let dtype = real(0)?;
            check_axes(name, &ins[0].shape, &[*axis])?;
            Ok((ins[0].shape.clone(), dtype))
        }
        Op::SoftmaxCrossEntropy | Op::SoftmaxCrossEntropyGrad => {
            let dtype = real(0)?;
            let (l, y) = (&ins[0].shape, &ins[1].shape);
            if ins[1].dtype == DType::I64 {
                return Err(Error::dtype(
                    name,
                    "labels must be int32 class ids, got int64; cast them with .astype('int32') \
                     (rlx.nn.functional.cross_entropy does so for you)",
                ));
            }
            if ins[1].dtype != DType::I32 {
                return Err(Error::dtype(
                    name,
                    format!("labels must be int32 class ids, got {}", ins[1].dtype),
                ));
            }
            if l.rank() != 2 || y.rank() != 1 || l.0[0] != y.0[0] {
                return Err(Error::shape(
                    name,
                    format!("expects logits (N, C) and labels (N,), got logits {l} and labels {y}"),
                ));
            }
            if l.0[1] == 0 {
                return Err(Error::shape(name, format!("logits {l} have no classes")));
            }
            if matches!(op, Op::SoftmaxCrossEntropyGrad) {
                real(2)?;
                if ins[2].shape.rank() != 0 {
                    return Err(Error::shape(
                        name,
                        format!("upstream gradient must be a scalar, got {}", ins[2].shape),
                    ));
                }
                return Ok((l.clone(), dtype));
            }
            Ok((Shape::scalar(), dtype))
        }
        Op::Mse => {
            let dtype = real(0)?;
            real(1)?;
            if ins[0].shape != ins[1].shape {
                return Err(Error::shape(
                    name,
                    format!(
                        "prediction {} and target {} must have the same shape",
                        ins[0].shape, ins[1].shape
                    ),
                ));
            }
            Ok((Shape::scalar(), dtype))
        }
        Op::Fused(f) => {
            let shapes: Vec<&Shape> = ins.iter().map(|x| &x.shape).collect();
            for i in 0..ins.len() {
                float(i)?;
            }
            fused(name, f, &shapes)?;
            Ok((f.shape.clone(), DType::F32))
        }
        Op::FusedSumTo { expr, shape } => {
            let shapes: Vec<&Shape> = ins.iter().map(|x| &x.shape).collect();
            for i in 0..ins.len() {
                float(i)?;
            }
            fused(name, expr, &shapes)?;
            if broadcast(name, &expr.shape, shape)? != expr.shape {
                return Err(Error::shape(
                    name,
                    format!("cannot sum {} down to {shape}", expr.shape),
                ));
            }
            Ok((shape.clone(), DType::F32))
        }
        Op::MatMulEpilogue {
            trans_a,
            trans_b,
            epilogue,
        } => {
            let (mm, _) = matmul(ins[0], ins[1], *trans_a, *trans_b)?;
            if mm.numel() != epilogue.shape.numel() {
                return Err(Error::shape(
                    name,
                    format!(
                        "the product {mm} and the epilogue's shape {} differ in size",
                        epilogue.shape
                    ),
                ));
            }
            for i in 2..ins.len() {
                float(i)?;
            }
            let mut shapes: Vec<&Shape> = vec![&epilogue.shape];
            shapes.extend(ins[2..].iter().map(|x| &x.shape));
            fused(name, epilogue, &shapes)?;
            Ok((epilogue.shape.clone(), DType::F32))
        }
        Op::Attention { heads, .. } | Op::AttentionGrad { heads, .. } => {
            for i in 0..ins.len() {
                float(i)?;
            }
            let grad = matches!(op, Op::AttentionGrad { .. });
            let out = attention(name, ins, *heads)?;
            if grad {
                // `out` and `g` follow the inputs.
                let k = if heads.is_some() { 1 } else { 3 };
                for (what, x) in [("out", ins[k]), ("g", ins[k + 1])] {
                    if x.shape != out {
                        return Err(Error::shape(
                            name,
                            format!("{what} is {} but the attention output is {out}", x.shape),
                        ));
                    }
                }
                if heads.is_some() {
                    return Ok((ins[0].shape.clone(), DType::F32));
                }
                let n: usize = ins[..3].iter().map(|x| x.shape.numel()).sum();
                return Ok((Shape::new([n]), DType::F32));
            }
            Ok((out, DType::F32))
        }
        Op::Where => {
            if !matches!(
                ins[0].dtype,
                DType::F32 | DType::F64 | DType::I32 | DType::I64 | DType::Bool
            ) {
                return Err(unsupported(name, ins));
            }
            if ins[1].dtype != ins[2].dtype {
                return Err(Error::dtype(
                    name,
                    format!(
                        "branches have different dtypes: {} and {}",
                        ins[1].dtype, ins[2].dtype
                    ),
                ));
            }
            let s = broadcast(name, &ins[0].shape, &ins[1].shape)?;
            Ok((broadcast(name, &s, &ins[2].shape)?, ins[1].dtype))
        }
        Op::Cast { to } => Ok((ins[0].shape.clone(), *to)),
        Op::Gather => {
            let dtype = real(0)?;
            if ins[1].dtype == DType::I64 {
                return Err(Error::dtype(
                    name,
                    "ids must be int32, got int64; cast them with .astype('int32') (rlx's \
                     embedding and gather functions do so for you)",
                ));
            }
            if ins[1].dtype != DType::I32 {
                return Err(Error::dtype(
                    name,
                    format!("ids must be int32, got {}", ins[1].dtype),
                ));
            }
            if ins[0].shape.rank() < 1 {
                return Err(Error::shape(
                    name,
                    format!("the table must have at least 1 dim, got {}", ins[0].shape),
                ));
            }
            let mut out = ins[1].shape.0.clone();
            out.extend_from_slice(&ins[0].shape.0[1..]);
            Ok((Shape(out), dtype))
        }
        Op::ScatterAdd { rows } => {
            // The gradient rows' dtype (float32, or float64 on the CPU).
            let dtype = match ins[1].dtype {
                DType::F64 => DType::F64,
                _ => float(1).map(|()| DType::F32)?,
            };
            if ins[0].dtype != DType::I32 {
                return Err(Error::dtype(
                    name,
                    format!("ids must be int32, got {}", ins[0].dtype),
                ));
            }
            let (ids, g) = (&ins[0].shape, &ins[1].shape);
            if g.rank() < ids.rank() || g.0[..ids.rank()] != ids.0[..] {
                return Err(Error::shape(
                    name,
                    format!("gradient {g} does not start with the ids shape {ids}"),
                ));
            }
            let mut out = vec![*rows];
            out.extend_from_slice(&g.0[ids.rank()..]);
            Ok((Shape(out), dtype))
        }
        Op::Normalize { .. } | Op::NormalizeGrad { .. } | Op::NormalizeGradAdd { .. } => {
            let dtype = real(0)?;
            let s = &ins[0].shape;
            if s.rank() < 1 || s.0[s.rank() - 1] == 0 {
                return Err(Error::shape(
                    name,
                    format!("needs a non-empty last axis, got {s}"),
                ));
            }
            for (i, x) in ins.iter().enumerate().skip(1) {
                real(i)?;
                if x.shape != *s {
                    let what = if i == 1 { "gradient" } else { "addend" };
                    return Err(Error::shape(
                        name,
                        format!("{what} {} must match input {s}", x.shape),
                    ));
                }
            }
            Ok((s.clone(), dtype))
        }
        Op::Slice { axis, start, end } => {
            let s = &ins[0].shape;
            check_axes(name, s, &[*axis])?;
            if start > end || *end > s.0[*axis] {
                return Err(Error::shape(
                    name,
                    format!("[{start}:{end}] is out of range for axis {axis} of {s}"),
                ));
            }
            let mut out = s.0.clone();
            out[*axis] = end - start;
            Ok((Shape(out), ins[0].dtype))
        }
        Op::Pad {
            axis,
            before,
            after,
        } => {
            let s = &ins[0].shape;
            check_axes(name, s, &[*axis])?;
            let mut out = s.0.clone();
            out[*axis] += before + after;
            Ok((Shape(out), ins[0].dtype))
        }
        Op::Concat { axis } => {
            let first = &ins[0].shape;
            check_axes(name, first, &[*axis])?;
            let mut total = 0;
            for n in ins {
                let s = &n.shape;
                let fits = s.rank() == first.rank()
                    && s.0
                        .iter()
                        .zip(&first.0)
                        .enumerate()
                        .all(|(d, (a, b))| d == *axis || a == b);
                if !fits {
                    return Err(Error::shape(
                        name,
                        format!("cannot join {s} to {first} along axis {axis}"),
                    ));
                }
                if n.dtype != ins[0].dtype {
                    return Err(Error::dtype(
                        name,
                        format!(
                            "inputs have different dtypes: {} and {}",
                            n.dtype, ins[0].dtype
                        ),
                    ));
                }
                total += s.0[*axis];
            }
            let mut out = first.0.clone();
            out[*axis] = total;
            Ok((Shape(out), ins[0].dtype))
        }
        Op::Im2Col { window: w, k_major } => {
            let dtype = real(0)?;
            let (n, c, o) = windowed(name, &ins[0].shape, w)?;
            let k = c * w.kernel[0] * w.kernel[1];
            let (rows, cols) = if *k_major {
                (k, o[0] * o[1])
            } else {
                (o[0] * o[1], k)
            };
            Ok((Shape(vec![n, rows, cols]), dtype))
        }
        Op::Col2Im {
            window: w,
            size,
            k_major,
        } => {
            let dtype = real(0)?;
            let s = &ins[0].shape;
            let kk = w.kernel[0] * w.kernel[1];
            let o = w.out_size(*size);
            // The patch axis and the position axis of the patches.
            let (kx, px) = if *k_major { (1, 2) } else { (2, 1) };
            let fits = s.rank() == 3
                && kk > 0
                && s.0[kx] % kk == 0
                && o.is_some_and(|o| o[0] * o[1] == s.0[px]);
            if !fits {
                return Err(Error::shape(
                    name,
                    format!(
                        "patches {s} do not fit kernel {:?}, stride {:?}, padding {:?} over an image of {:?}",
                        w.kernel, w.stride, w.padding, size
                    ),
                ));
            }
            Ok((Shape(vec![s.0[0], s.0[kx] / kk, size[0], size[1]]), dtype))
        }
        Op::Pool2d { window: w, .. } | Op::Pool2dGrad { window: w, .. } => {
            let dtype = real(0)?;
            let (n, c, o) = windowed(name, &ins[0].shape, w)?;
            if ins.len() == 2 {
                real(1)?;
                let want = Shape(vec![n, c, o[0], o[1]]);
                if ins[1].shape != want {
                    return Err(Error::shape(
                        name,
                        format!(
                            "gradient {} must have the pooled shape {want}",
                            ins[1].shape
                        ),
                    ));
                }
                return Ok((ins[0].shape.clone(), dtype));
            }
            Ok((Shape(vec![n, c, o[0], o[1]]), dtype))
        }
        Op::Dropout { p } => {
            let dtype = real(0)?;
            if !(0.0..1.0).contains(p) {
                return Err(Error::input(
                    "p",
                    format!("[dropout] p must be in [0, 1), got {p}"),
                ));
            }
            if ins[1].dtype != DType::I32 || ins[1].shape != Shape(vec![2]) {
                return Err(Error::dtype(
                    name,
                    format!(
                        "the seed must be int32 of shape (2,), got {} {}",
                        ins[1].dtype, ins[1].shape
                    ),
                ));
            }
            Ok((ins[0].shape.clone(), dtype))
        }
        Op::Log1p | Op::StopGradient => Ok((ins[0].shape.clone(), real(0)?)),
    }
}

/// `(N, C, [Ho, Wo])` of a windowed op over an NCHW input, or a clear error.
fn windowed(op: &str, s: &Shape, w: &crate::Window) -> Result<(usize, usize, [usize; 2])> {
    if s.rank() != 4 {
        return Err(Error::shape(
            op,
            format!("expects an input of rank 4 (N, C, H, W), got {s}"),
        ));
    }
    let o = w.out_size([s.0[2], s.0[3]]).ok_or_else(|| {
        Error::shape(
            op,
            format!(
                "kernel {:?} (stride {:?}, padding {:?}) does not fit the input {s}: the kernel is larger than the padded input, or a size is 0",
                w.kernel, w.stride, w.padding
            ),
        )
    })?;
    Ok((s.0[0], s.0[1], o))
}

/// Checks a fused expression against its input shapes (registers `0..n_inputs`).
fn fused(name: &str, f: &crate::Fused, ins: &[&Shape]) -> Result<()> {
    if ins.len() != f.n_inputs {
        return Err(Error::Graph(format!(
            "[{name}] expects {} expression inputs, got {}",
            f.n_inputs,
            ins.len()
        )));
    }
    for (i, x) in ins.iter().enumerate() {
        if broadcast(name, x, &f.shape)? != f.shape {
            return Err(Error::shape(
                name,
                format!("input {i} of shape {x} does not broadcast to {}", f.shape),
            ));
        }
    }
    for (k, step) in f.steps.iter().enumerate() {
        let defined = (f.n_inputs + k) as u16;
        let regs: &[u16] = match step {
            crate::FusedStep::Unary(_, a) => &[*a],
            crate::FusedStep::Binary(_, a, b) => &[*a, *b],
            crate::FusedStep::Where(c, a, b) => &[*c, *a, *b],
        };
        if regs.iter().any(|&r| r >= defined) {
            return Err(Error::Graph(format!(
                "[{name}] step {k} reads a register not yet defined"
            )));
        }
    }
    if f.steps.is_empty() {
        return Err(Error::Graph(format!("[{name}] an expression needs a step")));
    }
    Ok(())
}

/// The output shape of `Attention` for its (first) inputs; see `Op::Attention` for layouts.
fn attention(name: &str, ins: &[&Node], heads: Option<usize>) -> Result<Shape> {
    if let Some(h) = heads {
        let s = &ins[0].shape;
        if s.rank() != 3 || h == 0 || s.0[1] == 0 || s.0[2] == 0 || s.0[2] % (3 * h) != 0 {
            return Err(Error::shape(
                name,
                format!(
                    "packed q|k|v must be (B, T, 3 * {h} * head_dim) with T, head_dim >= 1, got {s}"
                ),
            ));
        }
        return Ok(Shape::new([s.0[0], s.0[1], s.0[2] / 3]));
    }
    let (q, k, v) = (&ins[0].shape, &ins[1].shape, &ins[2].shape);
    let r = q.rank();
    if r < 2 || k.rank() != r || v.rank() != r {
        return Err(Error::shape(
            name,
            format!("q, k, v must all be (..., T, d) of one rank >= 2, got {q}, {k}, {v}"),
        ));
    }
    if q.0[..r - 2] != k.0[..r - 2] || q.0[..r - 2] != v.0[..r - 2] {
        return Err(Error::shape(
            name,
            format!("q, k, v must have the same leading dims, got {q}, {k}, {v}"),
        ));
    }
    if q.0[r - 1] != k.0[r - 1] || k.0[r - 2] != v.0[r - 2] {
        return Err(Error::shape(
            name,
            format!("q (..., L, E), k (..., S, E), v (..., S, Ev) do not fit: {q}, {k}, {v}"),
        ));
    }
    if q.0[r - 2] == 0 || q.0[r - 1] == 0 || k.0[r - 2] == 0 || v.0[r - 1] == 0 {
        return Err(Error::shape(
            name,
            format!("L, S, E and Ev must be at least 1, got q {q}, k {k}, v {v}"),
        ));
    }
    let mut out = q.0.clone();
    out[r - 1] = v.0[r - 1];
    Ok(Shape(out))
}

fn broadcast(op: &str, a: &Shape, b: &Shape) -> Result<Shape> {
    Shape::broadcast(a, b)
        .ok_or_else(|| Error::shape(op, format!("shapes {a} and {b} do not broadcast")))
}

fn check_axes(op: &str, s: &Shape, axes: &[usize]) -> Result<()> {
    let sorted = axes.windows(2).all(|w| w[0] < w[1]);
    if !sorted || axes.iter().any(|&a| a >= s.rank()) {
        return Err(Error::shape(
            op,
            format!("axes {axes:?} are invalid for a tensor of shape {s}"),
        ));
    }
    Ok(())
}

/// The shape left after reducing `axes` of `s`.
pub fn reduced_shape(s: &Shape, axes: &[usize], keepdims: bool) -> Shape {
    let mut out = Vec::with_capacity(s.rank());
    for (i, &d) in s.0.iter().enumerate() {
        if !axes.contains(&i) {
            out.push(d);
        } else if keepdims {
            out.push(1);
        }
    }
    Shape(out)
}

/// The error for an op given dtypes it has no kernel for yet (float16, bfloat16, float64,
/// int64, bool), naming the op and every operand's dtype.
fn unsupported(name: &str, ins: &[&Node]) -> Error {
    let dts: Vec<DType> = ins.iter().map(|x| x.dtype).collect();
    Error::dtype(name, DType::not_supported(&dts))
}

fn matmul(a: &Node, b: &Node, ta: bool, tb: bool) -> Result<(Shape, DType)> {
    let (sa, sb) = (&a.shape, &b.shape);
    // bfloat16 and float16 pairs are the mixed-precision matmul: low-precision products summed
    // in float32, with a float32 result (see `DType::is_low_precision`).
    let lowp = a.dtype == b.dtype && a.dtype.is_low_precision();
    // float64 pairs multiply in float64 (CPU).
    let wide = a.dtype == DType::F64 && b.dtype == DType::F64;
    if !lowp
        && !wide
        && [a.dtype, b.dtype]
            .iter()
            .any(|d| !matches!(d, DType::F32 | DType::I32))
    {
        return Err(unsupported("matmul", &[a, b]));
    }
    if !lowp && !wide && (a.dtype != DType::F32 || b.dtype != DType::F32) {
        return Err(Error::dtype(
            "matmul",
            format!("expects float32 operands, got {} and {}", a.dtype, b.dtype),
        ));
    }
    if sa.rank() < 2 || sb.rank() < 2 {
        return Err(Error::shape(
            "matmul",
            format!("operands need at least 2 dims, got {sa} and {sb}"),
        ));
    }
    let (m, ka) = mat_dims(sa, ta);
    let (kb, n) = mat_dims(sb, tb);
    if ka != kb {
        return Err(Error::shape(
            "matmul",
            format!("inner dimensions differ: {sa} @ {sb} ({ka} vs {kb})"),
        ));
    }
    let batch_a = Shape(sa.0[..sa.rank() - 2].to_vec());
    let batch_b = Shape(sb.0[..sb.rank() - 2].to_vec());
    let batch = Shape::broadcast(&batch_a, &batch_b).ok_or_else(|| {
        Error::shape(
            "matmul",
            format!("batch dimensions of {sa} and {sb} do not broadcast"),
        )
    })?;
    let mut out = batch.0;
    out.extend([m, n]);
    Ok((Shape(out), if wide { DType::F64 } else { DType::F32 }))
}

/// (rows, cols) of the matrix part of `s`, after an optional transpose.
pub fn mat_dims(s: &Shape, trans: bool) -> (usize, usize) {
    let (r, c) = (s.0[s.rank() - 2], s.0[s.rank() - 1]);
    if trans {
        (c, r)
    } else {
        (r, c)
    }
}

#[cfg(test)]
mod tests {
    use crate::{BinaryOp, DType, Error, Graph, Op, Shape};

    #[test]
    fn matmul_errors_name_the_shapes() {
        let mut g = Graph::new();
        let a = g.input("a", Shape::new([3, 4]), DType::F32).unwrap();
        let b = g.input("b", Shape::new([5, 6]), DType::F32).unwrap();
        let e = g
            .add(
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                &[a, b],
            )
            .unwrap_err();
        assert!(matches!(e, Error::Shape { .. }));
        let msg = e.to_string();
        assert!(
            msg.starts_with("[matmul]") && msg.contains("(3, 4)") && msg.contains("(5, 6)"),
            "{msg}"
        );
    }

    #[test]
    fn batched_matmul_broadcasts_leading_dims() {
        let mut g = Graph::new();
        let a = g.input("a", Shape::new([2, 3, 4]), DType::F32).unwrap();
        let b = g.input("b", Shape::new([4, 5]), DType::F32).unwrap();
        let c = g
            .add(
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                &[a, b],
            )
            .unwrap();
        assert_eq!(g.node(c).shape, Shape::new([2, 3, 5]));
        let d = g
            .add(
                Op::MatMul {
                    trans_a: true,
                    trans_b: false,
                },
                &[a, a],
            )
            .unwrap();
        assert_eq!(g.node(d).shape, Shape::new([2, 4, 4]));
    }

    #[test]
    fn int_division_gives_float_and_floor_division_keeps_int() {
        let mut g = Graph::new();
        let a = g.input("a", Shape::new([3]), DType::I32).unwrap();
        let b = g.input("b", Shape::new([2, 1]), DType::I32).unwrap();
        let d = g.add(Op::Binary(BinaryOp::Div), &[a, b]).unwrap();
        assert_eq!(
            (g.node(d).shape.clone(), g.node(d).dtype),
            (Shape::new([2, 3]), DType::F32)
        );
        for op in [BinaryOp::FloorDiv, BinaryOp::Mod] {
            let q = g.add(Op::Binary(op), &[a, b]).unwrap();
            assert_eq!(g.node(q).dtype, DType::I32);
        }
    }

    #[test]
    fn new_dtypes_move_and_cast_but_do_not_compute() {
        let mut g = Graph::new();
        let h = g.input("h", Shape::new([2, 3]), DType::F16).unwrap();
        let m = g.input("m", Shape::new([2, 1]), DType::Bool).unwrap();
        let t = g.add(Op::Transpose { perm: vec![1, 0] }, &[h]).unwrap();
        assert_eq!(g.node(t).dtype, DType::F16);
        let c = g.add(Op::Concat { axis: 0 }, &[h, h]).unwrap();
        assert_eq!(g.node(c).shape, Shape::new([4, 3]));
        let w = g.add(Op::Where, &[m, h, h]).unwrap();
        assert_eq!(g.node(w).dtype, DType::F16);
        let f = g.add(Op::Cast { to: DType::F32 }, &[h]).unwrap();
        assert_eq!(g.node(f).dtype, DType::F32);
        let mm = Op::MatMul {
            trans_a: false,
            trans_b: true,
        };
        // A low-precision pair is the mixed-precision matmul (float32 result); a mixed pair
        // widens the low operand (`Graph::add`): float32.
        let p = g.add(mm.clone(), &[h, h]).unwrap();
        assert_eq!(
            (&g.node(p).shape, g.node(p).dtype),
            (&Shape::new([2, 2]), DType::F32)
        );
        let p = g.add(mm.clone(), &[h, f]).unwrap();
        assert_eq!(g.node(p).dtype, DType::F32);
        // float16 + float16 computes in float32 and rounds back; a comparison stays a float32
        // mask.
        let s = g.add(Op::Binary(BinaryOp::Add), &[h, h]).unwrap();
        assert_eq!(g.node(s).dtype, DType::F16);
        assert!(matches!(g.node(s).op, Op::Cast { to: DType::F16 }));
        let c = g.add(Op::Binary(BinaryOp::Lt), &[h, h]).unwrap();
        assert_eq!(g.node(c).dtype, DType::F32);
        // A widened op that still fails reports the operands as given.
        let d = g.input("d", Shape::new([2, 2]), DType::F64).unwrap();
        let n = g.nodes().len();
        let e = g.add(mm, &[h, d]).unwrap_err();
        assert!(matches!(e, Error::DType { .. }));
        assert_eq!(
            e.to_string(),
            "[matmul] float16 x float64 is not supported yet; cast to float32 with .astype('float32')"
        );
        assert_eq!(g.nodes().len(), n, "no stray casts");
        let i = g.input("i", Shape::new([2]), DType::I64).unwrap();
        // int64 has elementwise kernels (wrapping, as int32's) and sums; not float ops.
        let p = g.add(Op::Binary(BinaryOp::Mul), &[i, i]).unwrap();
        assert_eq!(g.node(p).dtype, DType::I64);
        let q = g.add(Op::Binary(BinaryOp::Div), &[i, i]).unwrap();
        assert_eq!(g.node(q).dtype, DType::F32);
        let sum = Op::Reduce {
            op: crate::ReduceOp::Sum,
            axes: vec![0],
            keepdims: false,
        };
        let total = g.add(sum, &[i]).unwrap();
        assert_eq!(g.node(total).dtype, DType::I64);
        let mean = Op::Reduce {
            op: crate::ReduceOp::Mean,
            axes: vec![0],
            keepdims: false,
        };
        assert!(g.add(mean, &[i]).is_err());
        let e = g.add(Op::Unary(crate::UnaryOp::Exp), &[i]).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("cast to float32 with .astype('float32')"),
            "{e}"
        );
        let x = g.input("x", Shape::new([2, 3]), DType::F32).unwrap();
        let e = g.add(Op::SoftmaxCrossEntropy, &[x, i]).unwrap_err();
        assert!(
            e.to_string()
                .contains("got int64; cast them with .astype('int32')"),
            "{e}"
        );
    }

    #[test]
    fn dtype_mismatch_is_a_dtype_error() {
        let mut g = Graph::new();
        let a = g.input("a", Shape::new([3]), DType::F32).unwrap();
        let b = g.input("b", Shape::new([3]), DType::I32).unwrap();
        let e = g.add(Op::Binary(BinaryOp::Add), &[a, b]).unwrap_err();
        assert!(matches!(e, Error::DType { .. }), "{e}");
        let e = g.add(Op::SoftmaxCrossEntropy, &[a, a]).unwrap_err();
        assert!(e.to_string().contains("int32"), "{e}");
    }
}
