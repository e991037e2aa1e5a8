//! The integer narrowing of a graph, for backends whose kernels compute integers in int32 only
//! (the GPU backends): every int64 and bool tensor inside the program becomes an int32 one
//! (bools as 0/1), so the ops between the program's edges need no int64 or bool kernels.
//! Only the edges keep their dtypes:
//! - an int64 input is declared int32 (fed arrays are range-checked into it by the front end,
//!   never wrapped); a bool input stays bool and is cast to int32 once;
//! - an int64 or bool output is cast back from int32 at the end, so callers read the dtype
//!   they traced;
//! - int64 constants must fit in int32 (an error naming the value otherwise).
//!
//! Integer arithmetic inside the program is then int32 arithmetic (wrapping where int64 would
//! not); float-to-integer casts saturate at int32's range.
use crate::{BinaryOp, DType, Error, Graph, NodeId, Op, Result, Shape};
use std::collections::HashMap;

/// `graph` with its int64 and bool tensors computed as int32 (see the module comment), and
/// where each node of `graph` went (`map[old] = new`). Inputs, params and outputs keep their
/// names, order and (outputs) dtypes. `backend` names the backend in errors. A graph without
/// int64 or bool tensors comes back unchanged.
///
/// ```
/// use rlx_ir::{narrow::narrow_integers, BinaryOp, DType, Graph, Op, Shape};
///
/// let mut g = Graph::new();
/// let ids = g.input("ids", Shape::new([4]), DType::I64)?;
/// let twice = g.add(Op::Binary(BinaryOp::Add), &[ids, ids])?;
/// g.set_outputs(vec![twice])?;
/// let (h, map) = narrow_integers(&g, "cuda")?;
/// assert_eq!(h.node(map[ids]).dtype, DType::I32); // fed arrays are checked into int32
/// let out = h.node(h.outputs()[0]);
/// assert_eq!(out.dtype, DType::I64); // cast back at the end
/// assert_eq!(h.node(out.inputs[0]).dtype, DType::I32);
/// # Ok::<(), rlx_ir::Error>(())
/// ```
pub fn narrow_integers(graph: &Graph, backend: &str) -> Result<(Graph, Vec<NodeId>)> {
    let wide = |d: DType| matches!(d, DType::I64 | DType::Bool);
    // Only what the outputs need is narrowed (and refused): an unused int64 buffer of the model
    // or constant stays as it is, never lowered.
    let live = graph.live_mask();
    let needed = |id: NodeId| live[id];
    if !graph
        .nodes()
        .iter()
        .enumerate()
        .any(|(id, n)| needed(id) && wide(n.dtype))
    {
        return Ok((graph.clone(), (0..graph.len()).collect()));
    }
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(graph.len());
    for (id, node) in graph.nodes().iter().enumerate() {
        if !needed(id) {
            // Inputs and parameters keep their places (and dtypes); the rest is dropped.
            let kept = match &node.op {
                Op::Input { name } => out.input(name, node.shape.clone(), node.dtype)?,
                Op::Param { name } => out.param(name, node.shape.clone(), node.dtype)?,
                _ => NodeId::MAX,
            };
            map.push(kept);
            continue;
        }
        let ins: Vec<NodeId> = node.inputs.iter().map(|&i| map[i]).collect();
        let new = match (&node.op, node.dtype) {
            (Op::Input { name }, DType::I64) => out.input(name, node.shape.clone(), DType::I32)?,
            (Op::Input { name }, DType::Bool) => {
                let b = out.input(name, node.shape.clone(), DType::Bool)?;
                out.add(Op::Cast { to: DType::I32 }, &[b])?
            }
            (Op::Input { name }, d) => out.input(name, node.shape.clone(), d)?,
            (Op::Param { name }, DType::Bool) => {
                let b = out.param(name, node.shape.clone(), DType::Bool)?;
                out.add(Op::Cast { to: DType::I32 }, &[b])?
            }
            (Op::Param { name }, DType::I64) => {
                return Err(Error::dtype(
                    name,
                    format!(
                        "is an int64 parameter or buffer {}: the {backend} backend computes \
                         integers in int32; store it as int32 (or float32), or run on the cpu",
                        node.shape
                    ),
                ))
            }
            (Op::Param { name }, d) => out.param(name, node.shape.clone(), d)?,
            (Op::Const { data }, DType::I64) => {
                let mut values = Vec::with_capacity(node.shape.numel());
                for w in data.chunks_exact(2) {
                    let v = (w[0] as u64 | (w[1] as u64) << 32) as i64;
                    values.push(i32::try_from(v).map_err(|_| {
                        Error::dtype(
                            "constant",
                            format!(
                                "int64 value {v} does not fit in int32, the integers the \
                                 {backend} backend computes in; run this program on the cpu"
                            ),
                        )
                    })?);
                }
                out.constant_i32(&values, node.shape.clone())?
            }
            (Op::Const { .. }, _) => {
                out.push(node.op.clone(), vec![], node.shape.clone(), node.dtype)
            }
            (Op::Cast { to: DType::Bool }, _) => {
                let src = graph.node(node.inputs[0]).dtype;
                if src == DType::Bool {
                    ins[0] // already 0/1
                } else {
                    nonzero(&mut out, ins[0])?
                }
            }
            (Op::Cast { to }, _) if wide(*to) || wide(graph.node(node.inputs[0]).dtype) => {
                // int64 targets become int32 ones; a cast to the dtype a narrowed source has
                // now (int32) is no cast at all; a narrowed source goes to bfloat16/float16
                // through float32 (the casts the GPU backends have).
                let to = if wide(*to) { DType::I32 } else { *to };
                let mut src = ins[0];
                if to.is_low_precision() && out.node(src).dtype == DType::I32 {
                    src = out.add(Op::Cast { to: DType::F32 }, &[src])?;
                }
                if out.node(src).dtype == to {
                    src
                } else {
                    out.add(Op::Cast { to }, &[src])?
                }
            }
            (op, _) => out.add(op.clone(), &ins)?,
        };
        map.push(new);
    }
    // Outputs read in the dtypes the caller traced: one cast back per narrowed output node.
    let mut back: HashMap<NodeId, NodeId> = HashMap::new();
    let mut outputs = Vec::with_capacity(graph.outputs().len());
    for &o in graph.outputs() {
        let (want, have) = (graph.node(o).dtype, map[o]);
        let id = if out.node(have).dtype == want {
            have
        } else {
            match back.get(&o) {
                Some(&c) => c,
                None => {
                    let c = out.add(Op::Cast { to: want }, &[have])?;
                    back.insert(o, c);
                    c
                }
            }
        };
        outputs.push(id);
    }
    out.set_outputs(outputs)?;
    Ok((out, map))
}

/// `x != 0` as int32 0/1 (NaN counts as non-zero, as numpy's `astype(bool)` has it).
/// Low-precision values compare as float32 (the same zeros and NaNs).
fn nonzero(out: &mut Graph, x: NodeId) -> Result<NodeId> {
    let mut x = x;
    let mut dtype = out.node(x).dtype;
    if dtype.is_low_precision() {
        x = out.add(Op::Cast { to: DType::F32 }, &[x])?;
        dtype = DType::F32;
    }
    let zero = match dtype {
        DType::I32 => out.constant_i32(&[0], Shape::scalar())?,
        DType::F64 => out.constant_f64(&[0.0], Shape::scalar())?,
        _ => out.scalar(0.0),
    };
    let mask = out.add(Op::Binary(BinaryOp::Ne), &[x, zero])?; // float32 0/1
    out.add(Op::Cast { to: DType::I32 }, &[mask])
}

#[cfg(test)]
mod tests {
    use super::narrow_integers;
    use crate::{BinaryOp, DType, Graph, Op, ReduceOp, Shape};

    fn bin(g: &mut Graph, b: BinaryOp, x: usize, y: usize) -> usize {
        g.add(Op::Binary(b), &[x, y]).unwrap()
    }

    /// Only the edges keep int64 and bool: every other node of the narrowed graph is int32 or
    /// float, the inputs and outputs keep their names, order and (outputs) dtypes.
    #[test]
    fn only_the_edges_keep_int64_and_bool() {
        let mut g = Graph::new();
        let ids = g.input("ids", Shape::new([2, 3]), DType::I64).unwrap();
        let m = g.input("m", Shape::new([2, 3]), DType::Bool).unwrap();
        let x = g.input("x", Shape::new([2, 3]), DType::F32).unwrap();
        let k = g.constant_i64(&[7], Shape::scalar()).unwrap();
        let big = bin(&mut g, BinaryOp::Mul, ids, k);
        let pos = g.add(Op::Cast { to: DType::Bool }, &[x]).unwrap();
        let both = g.add(Op::Cast { to: DType::I64 }, &[pos]).unwrap();
        let mi = g.add(Op::Cast { to: DType::I64 }, &[m]).unwrap();
        let both = bin(&mut g, BinaryOp::Mul, both, mi);
        let sel = g.add(Op::Where, &[m, big, both]).unwrap();
        let sum = g
            .add(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![1],
                    keepdims: false,
                },
                &[sel],
            )
            .unwrap();
        let mf = g.add(Op::Cast { to: DType::F32 }, &[m]).unwrap();
        g.set_outputs(vec![sum, pos, mf, sel, sum]).unwrap();
        let (h, map) = narrow_integers(&g, "cuda").unwrap();
        let names: Vec<_> = h.inputs().iter().map(|(_, n)| n.to_string()).collect();
        assert_eq!(names, ["ids", "m", "x"]);
        assert_eq!(h.node(h.inputs()[0].0).dtype, DType::I32);
        assert_eq!(h.node(h.inputs()[1].0).dtype, DType::Bool);
        let dts: Vec<_> = h.outputs().iter().map(|&o| h.node(o).dtype).collect();
        assert_eq!(
            dts,
            [DType::I64, DType::Bool, DType::F32, DType::I64, DType::I64]
        );
        // The repeated output shares its cast.
        assert_eq!(h.outputs()[0], h.outputs()[4]);
        for (id, n) in h.nodes().iter().enumerate() {
            let edge = h.inputs().iter().any(|&(i, _)| i == id) || h.outputs().contains(&id);
            if !edge {
                assert!(!matches!(n.dtype, DType::I64 | DType::Bool), "{n:?}");
            }
        }
        assert_eq!(h.node(map[sum]).dtype, DType::I32);
    }

    /// An int64 buffer or constant the outputs do not use is left alone (not refused), and
    /// the parameter list keeps its order and dtypes.
    #[test]
    fn unused_int64_buffers_and_constants_are_left_alone() {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([2]), DType::F32).unwrap();
        let p = g
            .param("position_ids", Shape::new([6]), DType::I64)
            .unwrap();
        let k = g.constant_i64(&[1 << 40], Shape::scalar()).unwrap();
        let _dead = bin(&mut g, BinaryOp::Add, p, k);
        let m = g.input("m", Shape::new([2]), DType::Bool).unwrap();
        let y = g.add(Op::Where, &[m, x, x]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let (h, _) = narrow_integers(&g, "cuda").unwrap();
        let params: Vec<_> = h
            .params()
            .iter()
            .map(|&(i, n)| (n.to_string(), h.node(i).dtype))
            .collect();
        assert_eq!(params, [("position_ids".to_string(), DType::I64)]);
        let inputs: Vec<_> = h.inputs().iter().map(|&(_, n)| n.to_string()).collect();
        assert_eq!(inputs, ["x", "m"]);
    }

    /// bool and int64 values cast to bfloat16 or float16 go through float32.
    #[test]
    fn casts_to_low_precision_go_through_float32() {
        let mut g = Graph::new();
        let i = g.input("i", Shape::new([3]), DType::I64).unwrap();
        let h = g.add(Op::Cast { to: DType::BF16 }, &[i]).unwrap();
        g.set_outputs(vec![h]).unwrap();
        let (n, _) = narrow_integers(&g, "cuda").unwrap();
        let out = n.node(n.outputs()[0]);
        assert_eq!(out.dtype, DType::BF16);
        assert_eq!(n.node(out.inputs[0]).dtype, DType::F32);
    }

    #[test]
    fn a_graph_without_int64_or_bool_comes_back_as_it_was() {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([3]), DType::F32).unwrap();
        let y = g.add(Op::Unary(crate::UnaryOp::Relu), &[x]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let (h, map) = narrow_integers(&g, "cuda").unwrap();
        assert_eq!(h.len(), g.len());
        assert_eq!(map, [0, 1]);
    }

    #[test]
    fn int64_constants_beyond_int32_and_int64_params_are_refused_by_name() {
        let mut g = Graph::new();
        let i = g.input("i", Shape::new([2]), DType::I64).unwrap();
        let k = g.constant_i64(&[1 << 40], Shape::scalar()).unwrap();
        let y = bin(&mut g, BinaryOp::Add, i, k);
        g.set_outputs(vec![y]).unwrap();
        let e = narrow_integers(&g, "cuda").unwrap_err();
        assert!(matches!(e, crate::Error::DType { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("int64 value 1099511627776 does not fit in int32"),
            "{e}"
        );
        let mut g = Graph::new();
        let p = g.param("steps", Shape::new([1]), DType::I64).unwrap();
        g.set_outputs(vec![p]).unwrap();
        let e = narrow_integers(&g, "metal").unwrap_err().to_string();
        assert!(
            e.starts_with("[steps] is an int64 parameter or buffer (1,): the metal backend"),
            "{e}"
        );
    }
}
