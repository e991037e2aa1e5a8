//! The autocast rewrite of a forward graph (mixed precision, before autodiff): every float32
//! matmul reads its operands through casts to a low-precision dtype (bfloat16 or float16), so it
//! multiplies in that precision and sums in float32 (its result stays float32, see
//! `DType::is_low_precision`). Fused attention is marked to run its products in that dtype too
//! (`Op::Attention`'s `lowp`: PyTorch's autocast lists scaled-dot-product attention with the
//! matmuls), its softmax and its inputs and results staying float32. Everything else
//! (reductions, softmax, norms, losses, elementwise ops) stays float32, as PyTorch's autocast
//! keeps its "float32 list" in float32.
//! Autodiff of the rewritten graph then gives low-precision matmuls in the backward pass too
//! (the matmul VJP casts the incoming gradient), and the casts' VJPs hand float32 gradients to
//! the float32 parameters.
use crate::{DType, Error, Graph, NodeId, Op, Result};
use std::collections::HashMap;

/// `graph` with a cast to `to` in front of each operand of every float32 matmul (one cast per
/// source node, shared by all the matmuls that read it), and where each node of `graph` went
/// (`map[old] = new`). Inputs, params and outputs keep their names and order.
///
/// ```
/// use rlx_ir::{autocast, DType, Graph, Op, Shape};
///
/// let mut g = Graph::new();
/// let x = g.input("x", Shape::new([4, 3]), DType::F32)?;
/// let w = g.param("w", Shape::new([3, 2]), DType::F32)?;
/// let y = g.add(Op::MatMul { trans_a: false, trans_b: false }, &[x, w])?;
/// g.set_outputs(vec![y])?;
/// let (h, map) = autocast(&g, DType::BF16)?;
/// assert_eq!(h.outputs(), [map[y]]);
/// let out = h.node(h.outputs()[0]);
/// assert_eq!(out.dtype, DType::F32);
/// assert!(out.inputs.iter().all(|&i| h.node(i).dtype == DType::BF16));
/// # Ok::<(), rlx_ir::Error>(())
/// ```
pub fn autocast(graph: &Graph, to: DType) -> Result<(Graph, Vec<NodeId>)> {
    if !to.is_low_precision() {
        return Err(Error::dtype(
            "autocast",
            format!("computes in bfloat16 or float16, got {to}"),
        ));
    }
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(graph.len());
    let mut casts: HashMap<NodeId, NodeId> = HashMap::new();
    for node in graph.nodes() {
        let ins: Vec<NodeId> = node.inputs.iter().map(|&i| map[i]).collect();
        let new = match &node.op {
            Op::Input { name } => out.input(name, node.shape.clone(), node.dtype)?,
            Op::Param { name } => out.param(name, node.shape.clone(), node.dtype)?,
            Op::Const { .. } => out.push(node.op.clone(), vec![], node.shape.clone(), node.dtype),
            Op::MatMul { .. } if ins.iter().all(|&i| out.node(i).dtype == DType::F32) => {
                let mut low = Vec::with_capacity(2);
                for &i in &ins {
                    let c = match casts.get(&i) {
                        Some(&c) => c,
                        None => {
                            let c = out.add(Op::Cast { to }, &[i])?;
                            casts.insert(i, c);
                            c
                        }
                    };
                    low.push(c);
                }
                out.add(node.op.clone(), &low)?
            }
            Op::Attention {
                scale,
                causal,
                heads,
                lowp: None,
            } => out.add(
                Op::Attention {
                    scale: *scale,
                    causal: *causal,
                    heads: *heads,
                    lowp: Some(to),
                },
                &ins,
            )?,
            op => out.add(op.clone(), &ins)?,
        };
        map.push(new);
    }
    out.set_outputs(graph.outputs().iter().map(|&o| map[o]).collect())?;
    Ok((out, map))
}

#[cfg(test)]
mod tests {
    use super::autocast;
    use crate::{grad, DType, Graph, Op, ReduceOp, Shape};

    /// A two-layer MLP: which ops got casts, which stayed float32, and what autodiff makes.
    #[test]
    fn matmuls_get_shared_casts_and_the_rest_stays_float32() {
        let mm = Op::MatMul {
            trans_a: false,
            trans_b: false,
        };
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([8, 4]), DType::F32).unwrap();
        let w1 = g.param("w1", Shape::new([4, 5]), DType::F32).unwrap();
        let w2 = g.param("w2", Shape::new([5, 5]), DType::F32).unwrap();
        let h = g.add(mm.clone(), &[x, w1]).unwrap();
        let h = g.add(Op::Unary(crate::UnaryOp::Relu), &[h]).unwrap();
        let y = g.add(mm.clone(), &[h, w2]).unwrap();
        // w2 read twice: one cast.
        let y = g.add(mm.clone(), &[y, w2]).unwrap();
        let s = g.add(Op::Softmax { axis: 1 }, &[y]).unwrap();
        let loss = g
            .add(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![0, 1],
                    keepdims: false,
                },
                &[s],
            )
            .unwrap();
        g.set_outputs(vec![loss]).unwrap();
        let (a, map) = autocast(&g, DType::BF16).unwrap();
        assert_eq!(a.outputs(), [map[loss]]);
        let casts: Vec<_> = a
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::Cast { .. }))
            .collect();
        // x, w1, relu(h), w2, the second product: five sources, five casts.
        assert_eq!(casts.len(), 5);
        assert!(casts.iter().all(|n| n.dtype == DType::BF16));
        for n in a.nodes() {
            match n.op {
                Op::MatMul { .. } => {
                    assert_eq!(n.dtype, DType::F32);
                    assert!(n.inputs.iter().all(|&i| a.node(i).dtype == DType::BF16));
                }
                Op::Softmax { .. } | Op::Reduce { .. } | Op::Unary(_) => {
                    assert!(n.inputs.iter().all(|&i| a.node(i).dtype == DType::F32))
                }
                _ => {}
            }
        }
        assert_eq!(a.params().len(), 2);
        // The backward pass: every matmul reads bfloat16 operands (the gradient cast first),
        // and the parameters' gradients are float32.
        let l = a.outputs()[0];
        let ps: Vec<_> = a.params().iter().map(|p| p.0).collect();
        let b = grad(&a, l, &ps).unwrap();
        let mms: Vec<_> = b
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::MatMul { .. }))
            .collect();
        assert!(mms.len() >= 7, "3 forward + at least 4 backward products");
        for n in mms {
            assert!(n.inputs.iter().all(|&i| b.node(i).dtype == DType::BF16));
        }
        for &o in &b.outputs()[1..] {
            assert_eq!(b.node(o).dtype, DType::F32);
        }
        assert!(autocast(&g, DType::F32)
            .unwrap_err()
            .to_string()
            .contains("bfloat16 or float16, got float32"));
    }

    /// Attention keeps float32 inputs and result but is marked for low-precision products, and
    /// its gradient inherits the mark.
    #[test]
    fn attention_is_marked_for_low_precision_products() {
        let mut g = Graph::new();
        let qkv = g
            .input("qkv", Shape::new([2, 8, 3 * 4]), DType::F32)
            .unwrap();
        let w = g.param("w", Shape::new([2, 8, 3 * 4]), DType::F32).unwrap();
        let x = g.add(Op::Binary(crate::BinaryOp::Mul), &[qkv, w]).unwrap();
        let att = Op::Attention {
            scale: 0.5,
            causal: Some(0),
            heads: Some(2),
            lowp: None,
        };
        let o = g.add(att, &[x]).unwrap();
        let loss = g
            .add(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![0, 1, 2],
                    keepdims: false,
                },
                &[o],
            )
            .unwrap();
        g.set_outputs(vec![loss]).unwrap();
        for dt in [DType::BF16, DType::F16] {
            let (a, map) = autocast(&g, dt).unwrap();
            let n = a.node(map[o]);
            assert!(matches!(n.op, Op::Attention { lowp: Some(d), .. } if d == dt));
            assert_eq!(n.dtype, DType::F32);
            assert!(n.inputs.iter().all(|&i| a.node(i).dtype == DType::F32));
            let b = grad(&a, a.outputs()[0], &[a.params()[0].0]).unwrap();
            let grads: Vec<_> = b
                .nodes()
                .iter()
                .filter(|n| matches!(n.op, Op::AttentionGrad { .. }))
                .collect();
            assert_eq!(grads.len(), 1);
            assert!(matches!(grads[0].op, Op::AttentionGrad { lowp: Some(d), .. } if d == dt));
        }
    }
}
