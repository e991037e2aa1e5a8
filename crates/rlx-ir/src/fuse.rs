//! The fusion pass: chains of float32 elementwise ops become one `Op::Fused` node each.
//!
//! Runs after autodiff and before planning. A value that only elementwise ops of the same shape
//! consume need not exist in memory: each consumer's expression recomputes it from its inputs.
//! Only the values something else needs (a matmul, a reduction, a graph output, a consumer of
//! another shape) are materialised, each by one fused node, so intermediates get no arena slot
//! and a chain costs one pass over memory instead of one per op.
//!
//! A value read by several expressions is recomputed in each only when it is cheap (add, mul,
//! relu, ...); an expensive one (exp, tanh, gelu, ...) read twice is materialised once.
//!
//! Reshapes do not stop a chain: an expression runs over the flat index of its result, so a
//! value of the same size read through a reshape is the same values in the same order. Inputs
//! of the full size are reshaped (an alias) to the result's shape; a smaller broadcast input is
//! allowed where the dims it spans end both shapes alike (a bias over the last dim).
use crate::{BinaryOp, DType, Fused, FusedStep, Graph, NodeId, Op, UnaryOp};
use std::collections::{BTreeSet, HashMap};

/// Steps one fused expression may hold; past it, inputs are materialised instead.
const MAX_STEPS: usize = 48;
/// Distinct inputs one fused expression may read.
const MAX_INPUTS: usize = 12;

/// Whether fusion is on: set `RLX_FUSION=0` to compile every op as its own instruction.
pub fn enabled() -> bool {
    std::env::var("RLX_FUSION").map_or(true, |v| v.trim() != "0")
}

/// An elementwise float32 op the fused kernels evaluate.
fn elementwise(g: &Graph, id: NodeId) -> bool {
    let n = g.node(id);
    let f32_ins = n.inputs.iter().all(|&i| g.node(i).dtype == DType::F32);
    n.dtype == DType::F32 && f32_ins && matches!(n.op, Op::Unary(_) | Op::Binary(_) | Op::Where)
}

/// A float32 `SumTo`, which may sum an expression without storing it.
fn sums(g: &Graph, id: NodeId) -> bool {
    let n = g.node(id);
    matches!(n.op, Op::SumTo { .. }) && n.dtype == DType::F32
}

/// Cheap enough to compute again in every expression that reads it.
fn cheap(op: &Op) -> bool {
    match op {
        Op::Binary(_) | Op::Where => true,
        Op::Unary(u) => matches!(u, UnaryOp::Neg | UnaryOp::Relu | UnaryOp::PowScalar(_)),
        _ => false,
    }
}

/// Returns `graph` with its elementwise chains fused. Inputs, parameters and outputs keep their
/// order and names, so callers may use either graph's `inputs()`, `params()` and outputs alike.
pub fn fuse(graph: &Graph) -> Graph {
    let n = graph.len();
    let live = graph.live_mask();
    let mut consumers: Vec<Vec<NodeId>> = vec![Vec::new(); n];
    for (id, node) in graph.nodes().iter().enumerate() {
        if live[id] {
            for &i in &node.inputs {
                // Ids arrive in increasing order, so a repeated input is the last entry.
                if consumers[i].last() != Some(&id) {
                    consumers[i].push(id);
                }
            }
        }
    }
    let mut is_output = vec![false; n];
    for &o in graph.outputs() {
        is_output[o] = true;
    }
    // Consumers seen through reshapes (None when a reshape on the way is an output).
    let through = |p: NodeId| -> Option<Vec<NodeId>> {
        let mut found = Vec::new();
        let mut stack = vec![p];
        while let Some(q) = stack.pop() {
            for &c in &consumers[q] {
                if graph.node(c).op.is_alias() {
                    if is_output[c] {
                        return None;
                    }
                    stack.push(c);
                } else {
                    found.push(c);
                }
            }
        }
        Some(found)
    };
    // `inline[p]`: p is never materialised; every consumer's expression computes it.
    let inline: Vec<bool> = (0..n)
        .map(|p| {
            let node = graph.node(p);
            if !live[p] || !elementwise(graph, p) || is_output[p] {
                return false;
            }
            let Some(cs) = through(p) else {
                return false;
            };
            // Summed directly (not through a reshape): the sum's expression computes it.
            let summed = cs.len() == 1 && sums(graph, cs[0]) && graph.node(cs[0]).inputs[0] == p;
            !cs.is_empty()
                && (summed
                    || cs.iter().all(|&c| {
                        elementwise(graph, c) && graph.node(c).shape.numel() == node.shape.numel()
                    }))
                && (cs.len() == 1 || cheap(&node.op))
        })
        .collect();
    // Materialised elementwise nodes, each the root of one expression. Processed from the last
    // down, so a root added because an expression grew too large is still handled.
    // A sum whose input is computed inline is the root of that input's expression.
    let summed_root = |id: NodeId| sums(graph, id) && inline[graph.node(id).inputs[0]];
    let mut roots: BTreeSet<NodeId> = (0..n)
        .filter(|&id| live[id] && ((elementwise(graph, id) && !inline[id]) || summed_root(id)))
        .collect();
    let mut pending: std::collections::BinaryHeap<NodeId> = roots.iter().copied().collect();
    let mut exprs: HashMap<NodeId, Expr> = HashMap::new();
    while let Some(root) = pending.pop() {
        if exprs.contains_key(&root) {
            continue;
        }
        let (expr, spilled) = if summed_root(root) {
            let (mut e, spilled) = build(graph, graph.node(root).inputs[0], &inline, &roots);
            e.sum_to = Some(graph.node(root).shape.clone());
            (e, spilled)
        } else {
            build(graph, root, &inline, &roots)
        };
        for s in spilled {
            if roots.insert(s) {
                pending.push(s);
            }
        }
        exprs.insert(root, expr);
    }
    // Matmul epilogues: an expression that reads a matmul product nothing else reads computes
    // the product itself, so the product never takes an arena slot.
    let mut readers: HashMap<NodeId, usize> = HashMap::new();
    for e in exprs.values() {
        for &i in &e.inputs {
            *readers.entry(unalias(graph, i)).or_default() += 1;
        }
    }
    let mut absorbed = vec![false; n];
    for e in exprs.values_mut().filter(|e| e.sum_to.is_none()) {
        let root = *e.nodes.last().expect("an expression computes its root");
        e.epilogue_of = e.inputs.iter().position(|&i| {
            let m = unalias(graph, i);
            let node = graph.node(m);
            matches!(node.op, Op::MatMul { .. })
                && node.dtype == DType::F32
                && !is_output[m]
                && !absorbed[m]
                && readers[&m] == 1
                && node.shape.numel() == e.fused.shape.numel()
                && through(m).is_some_and(|cs| cs.iter().all(|c| *c == root || e.nodes.contains(c)))
        });
        if let Some(k) = e.epilogue_of {
            absorbed[unalias(graph, e.inputs[k])] = true;
            continue;
        }
        // `a + normalize_grad(x, g)`, both of the sum's shape: one `NormalizeGradAdd`.
        let one_add = e.fused.n_inputs == 2
            && matches!(e.fused.steps[..], [FusedStep::Binary(BinaryOp::Add, 0, 1)]);
        if one_add
            && e.inputs
                .iter()
                .all(|&i| graph.node(i).shape == e.fused.shape)
        {
            e.norm_grad_of = e.inputs.iter().position(|&i| {
                matches!(graph.node(i).op, Op::NormalizeGrad { .. })
                    && !is_output[i]
                    && !absorbed[i]
                    && readers[&i] == 1
                    && consumers[i] == [root]
            });
            if let Some(k) = e.norm_grad_of {
                absorbed[e.inputs[k]] = true;
            }
        }
    }
    emit(graph, &live, &inline, &absorbed, &exprs)
}

/// One expression: the fused program, the nodes its inputs come from, the nodes it computes
/// (the root last), and the input that is a matmul it absorbs as its prologue, if any.
struct Expr {
    fused: Fused,
    inputs: Vec<NodeId>,
    nodes: Vec<NodeId>,
    epilogue_of: Option<usize>,
    /// The input that is a `NormalizeGrad` this expression (one add) absorbs, if any.
    norm_grad_of: Option<usize>,
    /// `Some(shape)`: the expression is summed down to `shape` (a `SumTo` root).
    sum_to: Option<crate::Shape>,
}

/// The node a chain of reshapes starting at `id` reads.
fn unalias(graph: &Graph, mut id: NodeId) -> NodeId {
    while graph.node(id).op.is_alias() {
        id = graph.node(id).inputs[0];
    }
    id
}

/// Whether an input of shape `arg`, broadcast to `shape`, gives the same flat values as when
/// broadcast to `root` (same element count as `shape`).
fn reads_alike(arg: &crate::Shape, shape: &crate::Shape, root: &crate::Shape) -> bool {
    let (a, s, r) = (arg.dims(), shape.dims(), root.dims());
    arg.numel() == 1
        || arg.numel() == shape.numel()
        || (a.len() <= s.len()
            && a.len() <= r.len()
            && s[s.len() - a.len()..] == r[r.len() - a.len()..])
}

/// The expression computing `root`: inline nodes are expanded, everything else is an input.
/// Returns it with the inline nodes that had to become inputs (and so roots) to keep it small.
fn build(
    graph: &Graph,
    root: NodeId,
    inline: &[bool],
    roots: &BTreeSet<NodeId>,
) -> (Expr, Vec<NodeId>) {
    struct Builder<'g> {
        graph: &'g Graph,
        root: NodeId,
        inline: &'g [bool],
        roots: &'g BTreeSet<NodeId>,
        inputs: Vec<NodeId>,
        steps: Vec<(NodeId, FusedStep)>,
        /// Nodes chosen for expansion so far (steps are pushed only after their inputs).
        planned: usize,
        spilled: Vec<NodeId>,
    }
    enum Reg {
        Input(usize),
        Step(usize),
    }
    impl Builder<'_> {
        fn find(&self, id: NodeId) -> Option<Reg> {
            if let Some(k) = self.steps.iter().position(|(n, _)| *n == id) {
                return Some(Reg::Step(k));
            }
            self.inputs.iter().position(|&i| i == id).map(Reg::Input)
        }
        /// Register of `id`, as an index into inputs or steps (resolved at the end).
        fn visit(&mut self, id: NodeId, top: bool) -> Reg {
            // A reshape of a value computed here is that value (same flat order).
            let source = unalias(self.graph, id);
            let id = if source != id && self.inline[source] && !self.roots.contains(&source) {
                source
            } else {
                id
            };
            if let Some(r) = self.find(id) {
                return r;
            }
            let node = self.graph.node(id);
            let root_shape = &self.graph.node(self.root).shape;
            // A float32 broadcast is read as its smaller source, broadcast by the expression
            // itself (so it is never materialised when every reader does this).
            if let (Op::BroadcastTo { .. }, false) = (&node.op, top) {
                let src = node.inputs[0];
                let from = &self.graph.node(src).shape;
                if node.dtype == DType::F32
                    && from.rank() <= node.shape.rank().min(root_shape.rank())
                    && reads_alike(from, &node.shape, root_shape)
                {
                    if let Some(r) = self.find(src) {
                        return r;
                    }
                    self.inputs.push(src);
                    return Reg::Input(self.inputs.len() - 1);
                }
            }
            let args_fit = node
                .inputs
                .iter()
                .all(|&a| reads_alike(&self.graph.node(a).shape, &node.shape, root_shape));
            let expand = top
                || (self.inline[id]
                    && !self.roots.contains(&id)
                    && args_fit
                    && self.planned < MAX_STEPS
                    && self.inputs.len() + node.inputs.len() <= MAX_INPUTS);
            if !expand {
                if self.inline[id] && !self.roots.contains(&id) {
                    self.spilled.push(id);
                }
                self.inputs.push(id);
                return Reg::Input(self.inputs.len() - 1);
            }
            self.planned += 1;
            let args: Vec<Reg> = node.inputs.iter().map(|&i| self.visit(i, false)).collect();
            let r = |reg: &Reg| -> u16 {
                match reg {
                    Reg::Input(i) => *i as u16,
                    Reg::Step(k) => (1000 + *k) as u16, // placeholder, renumbered below
                }
            };
            let step = match &node.op {
                Op::Unary(u) => FusedStep::Unary(*u, r(&args[0])),
                Op::Binary(b) => FusedStep::Binary(*b, r(&args[0]), r(&args[1])),
                Op::Where => FusedStep::Where(r(&args[0]), r(&args[1]), r(&args[2])),
                other => unreachable!("not elementwise: {}", other.name()),
            };
            self.steps.push((id, step));
            Reg::Step(self.steps.len() - 1)
        }
    }
    let mut b = Builder {
        graph,
        root,
        inline,
        roots,
        inputs: Vec::new(),
        steps: Vec::new(),
        planned: 0,
        spilled: Vec::new(),
    };
    b.visit(root, true);
    // Placeholders: inputs are 0..n_inputs at the time of their step; renumber now that the
    // number of inputs is final (a step reads input i as i, step k as n_inputs + k).
    let n_in = b.inputs.len();
    let fix = |r: u16| -> u16 {
        if r >= 1000 {
            (n_in + (r as usize - 1000)) as u16
        } else {
            r
        }
    };
    let steps = b
        .steps
        .iter()
        .map(|(_, s)| match *s {
            FusedStep::Unary(u, a) => FusedStep::Unary(u, fix(a)),
            FusedStep::Binary(o, x, y) => FusedStep::Binary(o, fix(x), fix(y)),
            FusedStep::Where(c, x, y) => FusedStep::Where(fix(c), fix(x), fix(y)),
        })
        .collect();
    let fused = Fused {
        shape: graph.node(root).shape.clone(),
        n_inputs: n_in,
        steps,
    };
    let nodes = b.steps.iter().map(|(n, _)| *n).collect();
    (
        Expr {
            fused,
            inputs: b.inputs,
            nodes,
            epilogue_of: None,
            norm_grad_of: None,
            sum_to: None,
        },
        b.spilled,
    )
}

/// The new graph: nodes in the old order, inline ones dropped, roots replaced by their
/// expression (or kept as they were when the expression is just that one op).
fn emit(
    graph: &Graph,
    live: &[bool],
    inline: &[bool],
    absorbed: &[bool],
    exprs: &HashMap<NodeId, Expr>,
) -> Graph {
    let mut out = Graph::new();
    let mut map: Vec<Option<NodeId>> = vec![None; graph.len()];
    for (id, node) in graph.nodes().iter().enumerate() {
        let keep_leaf = matches!(node.op, Op::Input { .. } | Op::Param { .. });
        if !live[id] && !keep_leaf {
            continue;
        }
        if (inline[id] && !exprs.contains_key(&id)) || absorbed[id] {
            continue;
        }
        // A reshape of a value that only exists inside expressions.
        if node.op.is_alias() && map[unalias(graph, id)].is_none() {
            continue;
        }
        let mapped = |i: &NodeId| map[*i].expect("inputs are emitted first");
        let new = match exprs.get(&id) {
            Some(e)
                if e.fused.steps.len() > 1
                    || e.inputs.iter().any(|i| !node.inputs.contains(i))
                    || e.epilogue_of.is_some()
                    || e.norm_grad_of.is_some()
                    || e.sum_to.is_some()
                    || needs_reshape(graph, &e.fused, &e.inputs) =>
            {
                let fused = &e.fused;
                let mut ins: Vec<NodeId> = Vec::with_capacity(e.inputs.len() + 1);
                for (k, i) in e.inputs.iter().enumerate() {
                    if Some(k) == e.epilogue_of || Some(k) == e.norm_grad_of {
                        continue;
                    }
                    let x = graph.node(*i);
                    ins.push(
                        if x.shape != fused.shape && x.shape.numel() == fused.shape.numel() {
                            out.push(
                                Op::Reshape {
                                    shape: fused.shape.clone(),
                                },
                                vec![mapped(i)],
                                fused.shape.clone(),
                                x.dtype,
                            )
                        } else {
                            mapped(i)
                        },
                    );
                }
                if let Some(k) = e.norm_grad_of {
                    let ng = graph.node(e.inputs[k]);
                    let Op::NormalizeGrad { eps } = ng.op else {
                        unreachable!("absorbed as a normalize_grad")
                    };
                    let other = mapped(&e.inputs[1 - k]);
                    let new = out.push(
                        Op::NormalizeGradAdd { eps },
                        vec![mapped(&ng.inputs[0]), mapped(&ng.inputs[1]), other],
                        node.shape.clone(),
                        DType::F32,
                    );
                    map[id] = Some(new);
                    continue;
                }
                match (e.epilogue_of, &e.sum_to) {
                    (_, Some(shape)) => out.push(
                        Op::FusedSumTo {
                            expr: std::sync::Arc::new(fused.clone()),
                            shape: shape.clone(),
                        },
                        ins,
                        node.shape.clone(),
                        DType::F32,
                    ),
                    (None, None) => out.push(
                        Op::Fused(std::sync::Arc::new(fused.clone())),
                        ins,
                        node.shape.clone(),
                        DType::F32,
                    ),
                    (Some(k), None) => {
                        let mm = graph.node(unalias(graph, e.inputs[k]));
                        let Op::MatMul { trans_a, trans_b } = mm.op else {
                            unreachable!("an epilogue reads a matmul")
                        };
                        let mut all = vec![mapped(&mm.inputs[0]), mapped(&mm.inputs[1])];
                        all.extend(ins);
                        out.push(
                            Op::MatMulEpilogue {
                                trans_a,
                                trans_b,
                                epilogue: std::sync::Arc::new(product_first(fused, k)),
                            },
                            all,
                            node.shape.clone(),
                            DType::F32,
                        )
                    }
                }
            }
            _ => out.push(
                node.op.clone(),
                node.inputs.iter().map(mapped).collect(),
                node.shape.clone(),
                node.dtype,
            ),
        };
        map[id] = Some(new);
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|&o| map[o].expect("outputs are emitted"))
        .collect();
    out.set_outputs(outputs).expect("outputs exist");
    out
}

/// `f` with input register `k` moved to register 0 (the matmul product of an epilogue).
fn product_first(f: &Fused, k: usize) -> Fused {
    let k = k as u16;
    let r = |x: u16| -> u16 {
        if x == k {
            0
        } else if x < k {
            x + 1
        } else {
            x
        }
    };
    let steps = f
        .steps
        .iter()
        .map(|s| match *s {
            FusedStep::Unary(u, a) => FusedStep::Unary(u, r(a)),
            FusedStep::Binary(o, a, b) => FusedStep::Binary(o, r(a), r(b)),
            FusedStep::Where(c, a, b) => FusedStep::Where(r(c), r(a), r(b)),
        })
        .collect();
    Fused {
        shape: f.shape.clone(),
        n_inputs: f.n_inputs,
        steps,
    }
}

/// A one-step expression reading a full-size input of another shape (through a reshape) is
/// still emitted fused: the original op would read that input with its own shape.
fn needs_reshape(graph: &Graph, fused: &Fused, ins: &[NodeId]) -> bool {
    ins.iter().any(|&i| {
        let s = &graph.node(i).shape;
        s != &fused.shape && s.numel() == fused.shape.numel()
    })
}

/// Counts the fused nodes of a graph (matmul epilogues included) and the elementwise ops they
/// replaced (for reports and tests).
pub fn summary(graph: &Graph) -> (usize, usize) {
    graph
        .nodes()
        .iter()
        .filter_map(|n| match &n.op {
            Op::Fused(f) => Some(f.steps.len()),
            Op::MatMulEpilogue { epilogue, .. } => Some(epilogue.steps.len()),
            Op::FusedSumTo { expr, .. } => Some(expr.steps.len()),
            _ => None,
        })
        .fold((0, 0), |(k, s), steps| (k + 1, s + steps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinaryOp, Shape};

    fn chain() -> (Graph, NodeId) {
        // y = gelu(x @ w + b) ; z = y * 2 ; out = sum(z) and x + b materialised for another use
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([4, 8]), DType::F32).unwrap();
        let w = g.param("w", Shape::new([8, 8]), DType::F32).unwrap();
        let b = g.param("b", Shape::new([8]), DType::F32).unwrap();
        let two = g.constant_f32(&[2.0], Shape::scalar()).unwrap();
        let mm = g
            .add(
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                &[x, w],
            )
            .unwrap();
        let pre = g.add(Op::Binary(BinaryOp::Add), &[mm, b]).unwrap();
        let act = g.add(Op::Unary(UnaryOp::Gelu), &[pre]).unwrap();
        let d = g.add(Op::Unary(UnaryOp::GeluDeriv), &[pre]).unwrap();
        let z = g.add(Op::Binary(BinaryOp::Mul), &[act, two]).unwrap();
        let z2 = g.add(Op::Binary(BinaryOp::Mul), &[z, d]).unwrap();
        let s = g
            .add(
                Op::Reduce {
                    op: crate::ReduceOp::Sum,
                    axes: vec![0, 1],
                    keepdims: false,
                },
                &[z2],
            )
            .unwrap();
        g.set_outputs(vec![s]).unwrap();
        (g, s)
    }

    /// A per-channel value broadcast to NCHW (as the VJP of a mean makes it) is read by the
    /// expressions as the small tensor: the broadcast is never materialised. One whose source
    /// has more dims than the expression (read by a rank-5 product reshaped into it) stays a
    /// broadcast.
    #[test]
    fn broadcasts_are_read_as_their_source() {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([2, 3, 4, 4]), DType::F32).unwrap();
        let c = g.input("c", Shape::new([1, 3, 1, 1]), DType::F32).unwrap();
        let s = g
            .input("s", Shape::new([1, 1, 1, 1, 1]), DType::F32)
            .unwrap();
        let wide = |g: &mut Graph, v, dims: &[usize]| {
            g.add(
                Op::BroadcastTo {
                    shape: Shape::new(dims.to_vec()),
                },
                &[v],
            )
            .unwrap()
        };
        let cb = wide(&mut g, c, &[2, 3, 4, 4]);
        let y = g.add(Op::Binary(BinaryOp::Mul), &[x, cb]).unwrap();
        let z = g.add(Op::Binary(BinaryOp::Sub), &[y, cb]).unwrap();
        // x * (1,1,1,1,1) broadcast to rank 5, reshaped into the rank-4 expression.
        let reshape = |g: &mut Graph, v, dims: &[usize]| {
            g.add(
                Op::Reshape {
                    shape: Shape::new(dims.to_vec()),
                },
                &[v],
            )
            .unwrap()
        };
        let x5 = reshape(&mut g, x, &[1, 2, 3, 4, 4]);
        let sb = wide(&mut g, s, &[1, 2, 3, 4, 4]);
        let e5 = g.add(Op::Binary(BinaryOp::Mul), &[x5, sb]).unwrap();
        let er = reshape(&mut g, e5, &[2, 3, 4, 4]);
        let out = g.add(Op::Binary(BinaryOp::Add), &[z, er]).unwrap();
        g.set_outputs(vec![out]).unwrap();
        let f = fuse(&g);
        f.verify().unwrap();
        let live = f.live_mask();
        let broadcasts: Vec<&Shape> = f
            .nodes()
            .iter()
            .enumerate()
            .filter(|(i, n)| live[*i] && matches!(n.op, Op::BroadcastTo { .. }))
            .map(|(_, n)| &n.shape)
            .collect();
        assert_eq!(broadcasts, [&Shape::new([1, 2, 3, 4, 4])]);
        let fused = f
            .nodes()
            .iter()
            .find_map(|n| match &n.op {
                Op::Fused(e) => Some((e.steps.len(), n.inputs.clone())),
                _ => None,
            })
            .expect("one fused node");
        assert_eq!(fused.0, 4);
        assert!(fused.1.contains(&c), "reads c itself: {:?}", fused.1);
    }

    #[test]
    fn a_chain_becomes_one_fused_node_and_names_are_kept() {
        let (g, _) = chain();
        let f = fuse(&g);
        f.verify().unwrap();
        let ops: Vec<String> = f
            .nodes()
            .iter()
            .map(|n| match &n.op {
                Op::Fused(e) => format!("fused[{e}]"),
                o => o.name().to_string(),
            })
            .collect();
        assert_eq!(summary(&f), (1, 5), "{ops:?}");
        assert_eq!(
            f.inputs().iter().map(|(_, n)| *n).collect::<Vec<_>>(),
            vec!["x"]
        );
        assert_eq!(
            f.params().iter().map(|(_, n)| *n).collect::<Vec<_>>(),
            vec!["w", "b"]
        );
        // The pre-activation is cheap, so gelu and its derivative both recompute it: it is
        // never materialised.
        assert!(!f.nodes().iter().any(|n| n.op == Op::Binary(BinaryOp::Add)));
    }

    #[test]
    fn a_matmul_read_elsewhere_is_not_absorbed() {
        // relu(x @ w + b), with the product also an output: it must exist, so no epilogue.
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([4, 8]), DType::F32).unwrap();
        let w = g.param("w", Shape::new([8, 3]), DType::F32).unwrap();
        let b = g.param("b", Shape::new([3]), DType::F32).unwrap();
        let mm = g
            .add(
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                &[x, w],
            )
            .unwrap();
        let pre = g.add(Op::Binary(BinaryOp::Add), &[mm, b]).unwrap();
        let act = g.add(Op::Unary(UnaryOp::Relu), &[pre]).unwrap();
        g.set_outputs(vec![act, mm]).unwrap();
        let f = fuse(&g);
        f.verify().unwrap();
        assert!(f.nodes().iter().any(|n| matches!(n.op, Op::MatMul { .. })));
        assert!(!f
            .nodes()
            .iter()
            .any(|n| matches!(n.op, Op::MatMulEpilogue { .. })));
        // Without the extra output it is absorbed, with the operand order of the product
        // first: r0 = x @ w, r1 = b.
        g.set_outputs(vec![act]).unwrap();
        let f = fuse(&g);
        let epi = f
            .nodes()
            .iter()
            .find_map(|n| match &n.op {
                Op::MatMulEpilogue { epilogue, .. } => Some((epilogue.clone(), n.inputs.clone())),
                _ => None,
            })
            .expect("an epilogue");
        assert_eq!(epi.0.to_string(), "r2=add(r0,r1); r3=relu(r2)");
        assert_eq!(epi.1.len(), 3);
    }

    #[test]
    fn outputs_and_expensive_shared_values_are_materialised() {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([16]), DType::F32).unwrap();
        let e = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let a = g.add(Op::Binary(BinaryOp::Add), &[e, x]).unwrap();
        let m = g.add(Op::Binary(BinaryOp::Mul), &[e, a]).unwrap();
        let t = g.add(Op::Unary(UnaryOp::Tanh), &[m]).unwrap();
        g.set_outputs(vec![t, a]).unwrap();
        let f = fuse(&g);
        f.verify().unwrap();
        // exp is read twice and is expensive: materialised; `a` is an output: materialised;
        // tanh(e * a) is one expression.
        assert!(f.nodes().iter().any(|n| n.op == Op::Unary(UnaryOp::Exp)));
        assert_eq!(f.outputs().len(), 2);
        assert_eq!(summary(&f), (1, 2));
    }

    #[test]
    fn long_chains_are_split_and_stay_correct_in_structure() {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([3, 5]), DType::F32).unwrap();
        let b = g.input("b", Shape::new([5]), DType::F32).unwrap();
        let mut h = x;
        for i in 0..200 {
            let op = if i % 2 == 0 {
                Op::Binary(BinaryOp::Add)
            } else {
                Op::Binary(BinaryOp::Mul)
            };
            h = g.add(op, &[h, b]).unwrap();
            h = g.add(Op::Unary(UnaryOp::Tanh), &[h]).unwrap();
        }
        g.set_outputs(vec![h]).unwrap();
        let f = fuse(&g);
        f.verify().unwrap();
        let (k, steps) = summary(&f);
        assert_eq!(steps, 400);
        assert!(k >= 400 / MAX_STEPS, "{k} expressions");
        assert!(f.nodes().iter().all(|n| match &n.op {
            Op::Fused(e) => e.steps.len() <= MAX_STEPS && e.n_inputs <= MAX_INPUTS,
            _ => true,
        }));
    }

    #[test]
    fn chains_continue_through_reshapes() {
        // (x @ w + b).reshape(2, 4, 6) -> gelu -> * y, then summed.
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([8, 5]), DType::F32).unwrap();
        let y = g.input("y", Shape::new([2, 4, 6]), DType::F32).unwrap();
        let w = g.param("w", Shape::new([5, 6]), DType::F32).unwrap();
        let b = g.param("b", Shape::new([6]), DType::F32).unwrap();
        let mm = g
            .add(
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                &[x, w],
            )
            .unwrap();
        let pre = g.add(Op::Binary(BinaryOp::Add), &[mm, b]).unwrap();
        let r = g
            .add(
                Op::Reshape {
                    shape: Shape::new([2, 4, 6]),
                },
                &[pre],
            )
            .unwrap();
        let act = g.add(Op::Unary(UnaryOp::Gelu), &[r]).unwrap();
        let z = g.add(Op::Binary(BinaryOp::Mul), &[act, y]).unwrap();
        let s = g
            .add(
                Op::Reduce {
                    op: crate::ReduceOp::Sum,
                    axes: vec![0, 1, 2],
                    keepdims: false,
                },
                &[z],
            )
            .unwrap();
        g.set_outputs(vec![s]).unwrap();
        let f = fuse(&g);
        f.verify().unwrap();
        assert_eq!(summary(&f), (1, 3));
        // The matmul result, read through a reshape, is the epilogue's product (register 0);
        // the bias broadcasts over the last dim in both shapes.
        let fused = f
            .nodes()
            .iter()
            .find(|n| matches!(n.op, Op::MatMulEpilogue { .. }))
            .unwrap();
        assert_eq!(fused.shape, Shape::new([2, 4, 6]));
        assert!(!f.nodes().iter().any(|n| matches!(n.op, Op::MatMul { .. })));
        // A bias over a leading dim does not read alike through the reshape: not fused there.
        assert!(!reads_alike(
            &Shape::new([8, 1]),
            &Shape::new([8, 6]),
            &Shape::new([2, 4, 6])
        ));
        assert!(reads_alike(
            &Shape::new([6]),
            &Shape::new([8, 6]),
            &Shape::new([2, 4, 6])
        ));
    }
}
