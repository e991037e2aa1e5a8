//! Reverse-mode autodiff: appends the VJP of every op on the path to the loss; outputs `[loss, grads...]`.
use crate::{BinaryOp, DType, Error, Graph, NodeId, Op, ReduceOp, Result, Shape, UnaryOp};

/// Builds the backward graph of `graph` for the scalar `loss` w.r.t. the nodes `wrt`.
///
/// The result holds every forward node (same ids) followed by the backward nodes; its outputs are
/// `[loss, d loss / d wrt[0], ...]`. A `wrt` node the loss does not depend on gets a zero gradient.
///
/// ```
/// use rlx_ir::{grad, BinaryOp, DType, Graph, Op, ReduceOp, Shape};
///
/// // loss = sum(w * x): d loss / d w = x.
/// let mut g = Graph::new();
/// let x = g.input("x", Shape::new([4]), DType::F32)?;
/// let w = g.param("w", Shape::new([4]), DType::F32)?;
/// let wx = g.add(Op::Binary(BinaryOp::Mul), &[w, x])?;
/// let sum = Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdims: false };
/// let loss = g.add(sum, &[wx])?;
/// let bw = grad(&g, loss, &[w])?;
/// assert_eq!(bw.outputs().len(), 2);
/// assert_eq!(bw.node(bw.outputs()[1]).shape, Shape::new([4]));
/// // Bad graphs are refused when built, with the op and shapes in the message.
/// let y = g.input("y", Shape::new([3]), DType::F32)?;
/// let bad = g.add(Op::Binary(BinaryOp::Add), &[x, y]);
/// assert!(bad.unwrap_err().to_string().starts_with("[add]"));
/// # Ok::<(), rlx_ir::Error>(())
/// ```
pub fn grad(graph: &Graph, loss: NodeId, wrt: &[NodeId]) -> Result<Graph> {
    let l = graph
        .nodes()
        .get(loss)
        .ok_or_else(|| Error::Bounds(format!("loss node {loss} does not exist")))?;
    if l.shape.rank() != 0 || !matches!(l.dtype, DType::F32 | DType::F64) {
        return Err(Error::shape(
            "grad",
            format!(
                "the loss must be a float32 (or float64) scalar, got {} {}",
                l.dtype, l.shape
            ),
        ));
    }
    for &w in wrt {
        let n = graph
            .nodes()
            .get(w)
            .ok_or_else(|| Error::Bounds(format!("wrt node {w} does not exist")))?;
        if !matches!(n.dtype, DType::F32 | DType::F64) {
            return Err(Error::dtype(
                "grad",
                format!("cannot differentiate w.r.t. {} node {w}", n.dtype),
            ));
        }
    }
    let n = graph.len();
    // Forward: which nodes depend on some wrt node. Backward: which nodes the loss depends on.
    let mut depends = vec![false; n];
    for &w in wrt {
        depends[w] = true;
    }
    for id in 0..n {
        if graph.node(id).inputs.iter().any(|&i| depends[i]) && differentiable(&graph.node(id).op) {
            depends[id] = true;
        }
    }
    let mut g = graph.clone();
    let mut grads: Vec<Option<NodeId>> = vec![None; n];
    // Gradients arriving through slices of a node, joined once into one concat (instead of a
    // zero-padded copy per slice summed together) when the node is reached.
    let mut sliced: Vec<Vec<(usize, usize, NodeId)>> = vec![Vec::new(); n];
    grads[loss] = Some(lit(&mut g, 1.0, l.dtype));
    for id in (0..=loss).rev() {
        let parts = std::mem::take(&mut sliced[id]);
        if !parts.is_empty() {
            let joined = join_slices(&mut g, &graph.node(id).shape, parts)?;
            grads[id] = Some(match grads[id] {
                None => joined,
                Some(prev) => g.add(Op::Binary(BinaryOp::Add), &[prev, joined])?,
            });
        }
        let Some(gy) = grads[id] else { continue };
        if !depends[id] {
            continue;
        }
        let node = graph.node(id).clone();
        if let Op::Slice { axis, start, .. } = node.op {
            if depends[node.inputs[0]] {
                sliced[node.inputs[0]].push((axis, start, gy));
            }
            continue;
        }
        let contribs = vjp(&mut g, id, gy, &node.op, &node.inputs)?;
        for (input, gi) in node.inputs.iter().zip(contribs) {
            let Some(gi) = gi else { continue };
            if !depends[*input] {
                continue;
            }
            grads[*input] = Some(match grads[*input] {
                None => gi,
                Some(prev) => g.add(Op::Binary(BinaryOp::Add), &[prev, gi])?,
            });
        }
    }
    let mut outputs = vec![loss];
    for &w in wrt {
        let gw = match grads[w] {
            Some(gw) => gw,
            None => {
                let z = lit(&mut g, 0.0, graph.node(w).dtype);
                g.add(
                    Op::BroadcastTo {
                        shape: graph.node(w).shape.clone(),
                    },
                    &[z],
                )?
            }
        };
        outputs.push(gw);
    }
    g.set_outputs(outputs)?;
    Ok(g)
}

/// The gradient of a tensor of shape `shape` read through slices `(axis, start, grad)`: one
/// concat (zeros filling the gaps) when the slices share an axis and do not overlap, else the
/// sum of zero-padded slices.
fn join_slices(
    g: &mut Graph,
    shape: &Shape,
    mut parts: Vec<(usize, usize, NodeId)>,
) -> Result<NodeId> {
    parts.sort_by_key(|&(axis, start, _)| (axis, start));
    let len = |g: &Graph, axis: usize, id: NodeId| g.node(id).shape.0[axis];
    let axis = parts[0].0;
    let disjoint = parts.iter().all(|p| p.0 == axis)
        && parts
            .windows(2)
            .all(|w| w[0].1 + len(g, axis, w[0].2) <= w[1].1);
    if !disjoint {
        let mut total: Option<NodeId> = None;
        for (axis, start, gi) in parts {
            let after = shape.0[axis] - start - len(g, axis, gi);
            let padded = g.add(
                Op::Pad {
                    axis,
                    before: start,
                    after,
                },
                &[gi],
            )?;
            total = Some(match total {
                None => padded,
                Some(t) => g.add(Op::Binary(BinaryOp::Add), &[t, padded])?,
            });
        }
        return Ok(total.expect("at least one slice"));
    }
    let mut pieces = Vec::new();
    let mut at = 0;
    let dtype = g.node(parts[0].2).dtype;
    let zeros = |g: &mut Graph, n: usize| -> Result<NodeId> {
        let mut s = shape.clone();
        s.0[axis] = n;
        let z = lit(g, 0.0, dtype);
        g.add(Op::BroadcastTo { shape: s }, &[z])
    };
    for (_, start, gi) in parts {
        if start > at {
            pieces.push(zeros(g, start - at)?);
        }
        at = start + len(g, axis, gi);
        pieces.push(gi);
    }
    if at < shape.0[axis] {
        pieces.push(zeros(g, shape.0[axis] - at)?);
    }
    if pieces.len() == 1 {
        return Ok(pieces[0]);
    }
    g.add(Op::Concat { axis }, &pieces)
}

fn differentiable(op: &Op) -> bool {
    match op {
        // Floor division is piecewise constant: a zero gradient almost everywhere.
        Op::Binary(b) => !b.is_comparison() && *b != BinaryOp::FloorDiv,
        // Gradients flow between float dtypes only; nothing flows to integers or bools.
        Op::Cast { to } => to.is_float(),
        Op::StopGradient => false,
        _ => true,
    }
}

/// The gradient contribution to each input of node `y` given its upstream gradient `gy`.
fn vjp(
    g: &mut Graph,
    y: NodeId,
    gy: NodeId,
    op: &Op,
    ins: &[NodeId],
) -> Result<Vec<Option<NodeId>>> {
    use BinaryOp::*;
    let shape = |g: &Graph, id: NodeId| g.node(id).shape.clone();
    // Constants take the gradient's float dtype (float32, or float64).
    let dt = g.node(gy).dtype;
    Ok(match op {
        Op::Input { .. } | Op::Param { .. } | Op::Const { .. } => vec![],
        Op::Fused(_)
        | Op::MatMulEpilogue { .. }
        | Op::FusedSumTo { .. }
        | Op::NormalizeGradAdd { .. } => {
            return Err(Error::Graph(
                "[fused] fused expressions are made after differentiation and have no gradient"
                    .into(),
            ))
        }
        Op::Unary(u) => {
            let x = ins[0];
            let d = match u {
                UnaryOp::Neg => g.add(Op::Unary(UnaryOp::Neg), &[gy])?,
                UnaryOp::Relu => {
                    // Zero where the output is <= 0, else `gy`: at NaN (neither) the gradient
                    // passes through, as PyTorch's `threshold_backward`; a mask product would
                    // give 0.
                    let zero = lit(g, 0.0, dt);
                    let off = g.add(Op::Binary(Le), &[y, zero])?;
                    g.add(Op::Where, &[off, zero, gy])?
                }
                UnaryOp::Tanh => {
                    let one = lit(g, 1.0, dt);
                    let y2 = g.add(Op::Binary(Mul), &[y, y])?;
                    let d = g.add(Op::Binary(Sub), &[one, y2])?;
                    g.add(Op::Binary(Mul), &[gy, d])?
                }
                UnaryOp::Sigmoid => {
                    let one = lit(g, 1.0, dt);
                    let om = g.add(Op::Binary(Sub), &[one, y])?;
                    let d = g.add(Op::Binary(Mul), &[y, om])?;
                    g.add(Op::Binary(Mul), &[gy, d])?
                }
                UnaryOp::Exp => g.add(Op::Binary(Mul), &[gy, y])?,
                UnaryOp::Log => g.add(Op::Binary(Div), &[gy, x])?,
                UnaryOp::Sqrt => {
                    let half = lit(g, 0.5, dt);
                    let h = g.add(Op::Binary(Div), &[half, y])?;
                    g.add(Op::Binary(Mul), &[gy, h])?
                }
                UnaryOp::PowScalar(p) => {
                    let c = lit(g, *p as f64, dt);
                    // x ** 1 is x itself (a power kernel per element costs a `powf` call).
                    let xp = if *p == 2.0 {
                        x
                    } else {
                        g.add(Op::Unary(UnaryOp::PowScalar(p - 1.0)), &[x])?
                    };
                    let d = g.add(Op::Binary(Mul), &[xp, c])?;
                    g.add(Op::Binary(Mul), &[gy, d])?
                }
                UnaryOp::Gelu | UnaryOp::GeluTanh => {
                    let deriv = if *u == UnaryOp::Gelu {
                        UnaryOp::GeluDeriv
                    } else {
                        UnaryOp::GeluTanhDeriv
                    };
                    let d = g.add(Op::Unary(deriv), &[x])?;
                    g.add(Op::Binary(Mul), &[gy, d])?
                }
                UnaryOp::GeluDeriv | UnaryOp::GeluTanhDeriv => {
                    return Err(Error::unsupported(
                        "gelu_grad",
                        "second derivatives are not supported",
                    ))
                }
            };
            vec![Some(d)]
        }
        Op::Binary(b) => {
            let (a, bb) = (ins[0], ins[1]);
            let (da, db) = match b {
                Add => (gy, gy),
                Sub => (gy, g.add(Op::Unary(UnaryOp::Neg), &[gy])?),
                Mul => (
                    g.add(Op::Binary(Mul), &[gy, bb])?,
                    g.add(Op::Binary(Mul), &[gy, a])?,
                ),
                Div => {
                    let da = g.add(Op::Binary(Div), &[gy, bb])?;
                    let t = g.add(Op::Binary(Mul), &[da, y])?;
                    (da, g.add(Op::Unary(UnaryOp::Neg), &[t])?)
                }
                // a % b = a - b * floor(a / b): d/da = 1, d/db = -floor(a / b) (PyTorch's rule).
                Mod => {
                    let q = g.add(Op::Binary(FloorDiv), &[a, bb])?;
                    let t = g.add(Op::Binary(Mul), &[gy, q])?;
                    (gy, g.add(Op::Unary(UnaryOp::Neg), &[t])?)
                }
                _ => return Ok(vec![None, None]),
            };
            let (sa, sb) = (shape(g, a), shape(g, bb));
            vec![Some(sum_to(g, da, &sa)?), Some(sum_to(g, db, &sb)?)]
        }
        Op::MatMul { trans_a, trans_b } => {
            let (a, b) = (ins[0], ins[1]);
            let (ta, tb) = (*trans_a, *trans_b);
            // A mixed-precision product's gradients are mixed-precision products too: the
            // float32 `gy` is cast to the operands' dtype, and the float32 results flow back
            // (the VJP of the cast that made an operand passes a float32 gradient on as is).
            let low = g.node(a).dtype;
            let gy = if low.is_low_precision() {
                g.add(Op::Cast { to: low }, &[gy])?
            } else {
                gy
            };
            let (sa, sb) = (shape(g, a), shape(g, b));
            // Each gradient is summed over broadcast batch dims as soon as it is made: the
            // unsummed product dies before the other gradient's product is computed (less
            // memory live at once), and the other product sits next to what consumes it (a
            // convolution's patches gradient and its `col2im`, which the CPU runs as a pair).
            let da = if ta {
                g.add(
                    Op::MatMul {
                        trans_a: tb,
                        trans_b: true,
                    },
                    &[b, gy],
                )?
            } else {
                g.add(
                    Op::MatMul {
                        trans_a: false,
                        trans_b: !tb,
                    },
                    &[gy, b],
                )?
            };
            let da = sum_to(g, da, &sa)?;
            let db = if tb {
                g.add(
                    Op::MatMul {
                        trans_a: true,
                        trans_b: ta,
                    },
                    &[gy, a],
                )?
            } else {
                g.add(
                    Op::MatMul {
                        trans_a: !ta,
                        trans_b: false,
                    },
                    &[a, gy],
                )?
            };
            vec![Some(da), Some(sum_to(g, db, &sb)?)]
        }
        Op::Reduce {
            op: r,
            axes,
            keepdims,
        } => {
            let x = ins[0];
            let xs = shape(g, x);
            let kept = crate::infer::reduced_shape(&xs, axes, true);
            let gk = reshape(g, gy, &kept, *keepdims)?;
            let d = match r {
                ReduceOp::Sum => g.add(Op::BroadcastTo { shape: xs.clone() }, &[gk])?,
                ReduceOp::Mean => {
                    let count: usize = axes.iter().map(|&a| xs.0[a]).product();
                    let c = lit(g, 1.0 / count.max(1) as f64, dt);
                    let s = g.add(Op::Binary(Mul), &[gk, c])?;
                    g.add(Op::BroadcastTo { shape: xs.clone() }, &[s])?
                }
                ReduceOp::Max => {
                    // Ties share the gradient equally.
                    let yk = reshape(g, y, &kept, *keepdims)?;
                    let mut mask = g.add(Op::Binary(Eq), &[x, yk])?;
                    if dt == DType::F64 {
                        // Comparisons give float32 masks.
                        mask = g.add(Op::Cast { to: DType::F64 }, &[mask])?;
                    }
                    let count = g.add(
                        Op::Reduce {
                            op: ReduceOp::Sum,
                            axes: axes.clone(),
                            keepdims: true,
                        },
                        &[mask],
                    )?;
                    let share = g.add(Op::Binary(Div), &[gk, count])?;
                    g.add(Op::Binary(Mul), &[mask, share])?
                }
            };
            vec![Some(d)]
        }
        Op::BroadcastTo { .. } => {
            let xs = shape(g, ins[0]);
            vec![Some(sum_to(g, gy, &xs)?)]
        }
        Op::SumTo { .. } => {
            let xs = shape(g, ins[0]);
            vec![Some(g.add(Op::BroadcastTo { shape: xs }, &[gy])?)]
        }
        Op::Reshape { .. } => {
            let xs = shape(g, ins[0]);
            vec![Some(g.add(Op::Reshape { shape: xs }, &[gy])?)]
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(g.add(Op::Transpose { perm: inv }, &[gy])?)]
        }
        Op::Softmax { axis } => {
            let gyy = g.add(Op::Binary(Mul), &[gy, y])?;
            let s = g.add(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![*axis],
                    keepdims: true,
                },
                &[gyy],
            )?;
            let d = g.add(Op::Binary(Sub), &[gy, s])?;
            vec![Some(g.add(Op::Binary(Mul), &[y, d])?)]
        }
        Op::LogSoftmax { axis } => {
            let p = g.add(Op::Unary(UnaryOp::Exp), &[y])?;
            let s = g.add(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![*axis],
                    keepdims: true,
                },
                &[gy],
            )?;
            let ps = g.add(Op::Binary(Mul), &[p, s])?;
            vec![Some(g.add(Op::Binary(Sub), &[gy, ps])?)]
        }
        Op::SoftmaxCrossEntropy => {
            vec![
                Some(g.add(Op::SoftmaxCrossEntropyGrad, &[ins[0], ins[1], gy])?),
                None,
            ]
        }
        Op::Mse => {
            let n = shape(g, ins[0]).numel().max(1);
            let c = lit(g, 2.0 / n as f64, dt);
            let scale = g.add(Op::Binary(Mul), &[gy, c])?;
            let d = g.add(Op::Binary(Sub), &[ins[0], ins[1]])?;
            let dp = g.add(Op::Binary(Mul), &[d, scale])?;
            let dt = g.add(Op::Unary(UnaryOp::Neg), &[dp])?;
            vec![Some(dp), Some(dt)]
        }
        Op::Where => {
            let zero = lit(g, 0.0, dt);
            let da = g.add(Op::Where, &[ins[0], gy, zero])?;
            let db = g.add(Op::Where, &[ins[0], zero, gy])?;
            let (sa, sb) = (shape(g, ins[1]), shape(g, ins[2]));
            vec![None, Some(sum_to(g, da, &sa)?), Some(sum_to(g, db, &sb)?)]
        }
        Op::Cast { .. } => {
            // Back to the input's dtype (a float: `differentiable` stops at casts to integers,
            // and only float nodes depend on the float32 `wrt`).
            let from = g.node(ins[0]).dtype;
            if !from.is_float() {
                vec![None]
            } else if g.node(gy).dtype == from {
                vec![Some(gy)]
            } else {
                vec![Some(g.add(Op::Cast { to: from }, &[gy])?)]
            }
        }
        Op::Gather => {
            let rows = shape(g, ins[0]).0[0];
            vec![Some(g.add(Op::ScatterAdd { rows }, &[ins[1], gy])?), None]
        }
        Op::ScatterAdd { .. } => vec![None, Some(g.add(Op::Gather, &[gy, ins[0]])?)],
        Op::Normalize { eps } => vec![Some(g.add(Op::NormalizeGrad { eps: *eps }, &[ins[0], gy])?)],
        Op::Slice { .. } => {
            unreachable!("`grad` joins the gradients of slices itself (join_slices)")
        }
        Op::Pad { axis, before, .. } => {
            let n = shape(g, ins[0]).0[*axis];
            vec![Some(g.add(
                Op::Slice {
                    axis: *axis,
                    start: *before,
                    end: before + n,
                },
                &[gy],
            )?)]
        }
        Op::Concat { axis } => {
            let mut start = 0;
            let mut out = Vec::with_capacity(ins.len());
            for &i in ins {
                let n = shape(g, i).0[*axis];
                out.push(Some(g.add(
                    Op::Slice {
                        axis: *axis,
                        start,
                        end: start + n,
                    },
                    &[gy],
                )?));
                start += n;
            }
            out
        }
        Op::Attention {
            scale,
            causal,
            heads,
            lowp,
        } => {
            let attrs = Op::AttentionGrad {
                scale: *scale,
                causal: *causal,
                heads: *heads,
                lowp: *lowp,
            };
            let mut args = ins.to_vec();
            args.extend([y, gy]);
            let d = g.add(attrs, &args)?;
            if heads.is_some() {
                return Ok(vec![Some(d)]);
            }
            // The flat [dq | dk | dv], cut and reshaped back to each input.
            let mut start = 0;
            let mut out = Vec::with_capacity(3);
            for &i in ins {
                let s = shape(g, i);
                let end = start + s.numel();
                let piece = g.add(
                    Op::Slice {
                        axis: 0,
                        start,
                        end,
                    },
                    &[d],
                )?;
                out.push(Some(g.add(Op::Reshape { shape: s }, &[piece])?));
                start = end;
            }
            out
        }
        Op::NormalizeGrad { .. } | Op::SoftmaxCrossEntropyGrad | Op::AttentionGrad { .. } => {
            return Err(Error::unsupported(
                op.name(),
                "second derivatives are not supported",
            ))
        }
        Op::Im2Col { window, k_major } => {
            let xs = shape(g, ins[0]);
            let size = [xs.0[2], xs.0[3]];
            let (window, k_major) = (*window, *k_major);
            vec![Some(g.add(
                Op::Col2Im {
                    window,
                    size,
                    k_major,
                },
                &[gy],
            )?)]
        }
        Op::Col2Im {
            window, k_major, ..
        } => vec![Some(g.add(
            Op::Im2Col {
                window: *window,
                k_major: *k_major,
            },
            &[gy],
        )?)],
        Op::Pool2d { window, max } => vec![Some(g.add(
            Op::Pool2dGrad {
                window: *window,
                max: *max,
            },
            &[ins[0], gy],
        )?)],
        Op::Pool2dGrad { max: false, .. } => {
            // Linear in g: its adjoint is the average pool itself; x only gives the shape.
            let Op::Pool2dGrad { window, .. } = op else {
                unreachable!()
            };
            vec![
                None,
                Some(g.add(
                    Op::Pool2d {
                        window: *window,
                        max: false,
                    },
                    &[gy],
                )?),
            ]
        }
        Op::Pool2dGrad { max: true, .. } => {
            return Err(Error::unsupported(
                "max_pool2d_grad",
                "second derivatives are not supported",
            ))
        }
        // The mask depends only on the seed: dropout is linear in x, its own adjoint.
        Op::Dropout { p } => vec![Some(g.add(Op::Dropout { p: *p }, &[gy, ins[1]])?), None],
        Op::Log1p => {
            let one = lit(g, 1.0, dt);
            let d = g.add(Op::Binary(Add), &[ins[0], one])?;
            vec![Some(g.add(Op::Binary(Div), &[gy, d])?)]
        }
        Op::StopGradient => vec![None],
    })
}

/// A scalar constant `v` of float dtype `dtype` (float64 for float64 gradients, else
/// float32: low-precision gradients are widened by `Graph::add` as any operand is).
fn lit(g: &mut Graph, v: f64, dtype: DType) -> NodeId {
    if dtype == DType::F64 {
        g.constant_f64(&[v], Shape::scalar())
            .expect("one value for a scalar")
    } else {
        g.scalar(v as f32)
    }
}

fn sum_to(g: &mut Graph, x: NodeId, shape: &Shape) -> Result<NodeId> {
    if &g.node(x).shape == shape {
        return Ok(x);
    }
    g.add(
        Op::SumTo {
            shape: shape.clone(),
        },
        &[x],
    )
}

/// Re-inserts reduced axes as size 1 when the reduction dropped them.
fn reshape(g: &mut Graph, x: NodeId, kept: &Shape, keepdims: bool) -> Result<NodeId> {
    if keepdims || &g.node(x).shape == kept {
        return Ok(x);
    }
    g.add(
        Op::Reshape {
            shape: kept.clone(),
        },
        &[x],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cast's gradient is cast back to the input's float dtype; none flows to an integer.
    #[test]
    fn cast_gradients_go_back_to_the_input_dtype() {
        let mut g = Graph::new();
        let x = g.param("x", Shape::new([3]), DType::F32).unwrap();
        let h = g.add(Op::Cast { to: DType::BF16 }, &[x]).unwrap();
        let y = g.add(Op::Cast { to: DType::F32 }, &[h]).unwrap();
        let i = g.add(Op::Cast { to: DType::I64 }, &[x]).unwrap();
        let f = g.add(Op::Cast { to: DType::F32 }, &[i]).unwrap();
        let s = g.add(Op::Binary(BinaryOp::Add), &[y, f]).unwrap();
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![0],
            keepdims: false,
        };
        let loss = g.add(sum, &[s]).unwrap();
        let bw = grad(&g, loss, &[x]).unwrap();
        bw.verify().unwrap();
        let dx = bw.node(bw.outputs()[1]);
        assert_eq!(dx.dtype, DType::F32);
        // dx = cast_f32(cast_bf16(gy)): the path through int64 adds nothing.
        assert!(matches!(dx.op, Op::Cast { to: DType::F32 }), "{:?}", dx.op);
        let inner = bw.node(dx.inputs[0]);
        assert!(
            matches!(inner.op, Op::Cast { to: DType::BF16 }),
            "{:?}",
            inner.op
        );
    }

    /// Slices of one tensor get one concat for their gradient, with zeros in the gaps.
    #[test]
    fn slice_gradients_are_joined_into_one_concat() {
        let mut g = Graph::new();
        let x = g.param("x", Shape::new([6, 2]), DType::F32).unwrap();
        let a = g
            .add(
                Op::Slice {
                    axis: 0,
                    start: 0,
                    end: 2,
                },
                &[x],
            )
            .unwrap();
        let b = g
            .add(
                Op::Slice {
                    axis: 0,
                    start: 3,
                    end: 5,
                },
                &[x],
            )
            .unwrap();
        let ab = g.add(Op::Binary(BinaryOp::Mul), &[a, b]).unwrap();
        let loss = g
            .add(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![0, 1],
                    keepdims: false,
                },
                &[ab],
            )
            .unwrap();
        let bw = grad(&g, loss, &[x]).unwrap();
        let dx = bw.outputs()[1];
        assert!(
            matches!(bw.node(dx).op, Op::Concat { axis: 0 }),
            "{:?}",
            bw.node(dx).op
        );
        assert_eq!(
            bw.node(dx).inputs.len(),
            4,
            "pieces: dx[0:2], zeros, dx[3:5], zeros"
        );
        assert_eq!(bw.node(dx).shape, Shape::new([6, 2]));
        assert!(!bw.nodes()[g.len()..]
            .iter()
            .any(|n| matches!(n.op, Op::Pad { .. })));
    }
}
