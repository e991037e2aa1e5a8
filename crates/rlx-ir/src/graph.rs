//! The graph: an append-only list of nodes (insertion order is topological order) plus its outputs.
use crate::{infer, DType, Error, Node, NodeId, Op, Result, Shape};
use std::sync::Arc;

/// The most bytes one tensor may take (2^48: far beyond any machine, far below overflow).
pub const MAX_TENSOR_BYTES: usize = 1 << 48;

/// Refuses shapes whose byte size overflows or exceeds [`MAX_TENSOR_BYTES`].
fn check_size(what: &str, shape: &Shape, dtype: DType) -> Result<()> {
    let bytes = shape
        .0
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
    match bytes {
        Some(b) if b <= MAX_TENSOR_BYTES => Ok(()),
        _ => Err(Error::shape(
            what,
            format!("a {dtype} tensor of shape {shape} is too large to allocate"),
        )),
    }
}

/// An SSA dataflow graph. Nodes only refer to earlier nodes, so index order is a valid schedule.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    nodes: Vec<Node>,
    outputs: Vec<NodeId>,
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id]
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn outputs(&self) -> &[NodeId] {
        &self.outputs
    }

    /// Adds a named input. Names must be unique among inputs and params.
    pub fn input(&mut self, name: &str, shape: Shape, dtype: DType) -> Result<NodeId> {
        self.check_new_name(name)?;
        check_size(name, &shape, dtype)?;
        Ok(self.push(Op::Input { name: name.into() }, vec![], shape, dtype))
    }

    /// Adds a named trainable parameter.
    pub fn param(&mut self, name: &str, shape: Shape, dtype: DType) -> Result<NodeId> {
        self.check_new_name(name)?;
        check_size(name, &shape, dtype)?;
        Ok(self.push(Op::Param { name: name.into() }, vec![], shape, dtype))
    }

    /// Adds an f32 constant of the given shape.
    pub fn constant_f32(&mut self, values: &[f32], shape: Shape) -> Result<NodeId> {
        self.constant_bits(
            values.iter().map(|v| v.to_bits()).collect(),
            shape,
            DType::F32,
        )
    }

    /// Adds an i32 constant of the given shape.
    pub fn constant_i32(&mut self, values: &[i32], shape: Shape) -> Result<NodeId> {
        self.constant_bits(
            values.iter().map(|&v| v as u32).collect(),
            shape,
            DType::I32,
        )
    }

    /// Adds an i64 constant of the given shape (two little-endian words a value).
    pub fn constant_i64(&mut self, values: &[i64], shape: Shape) -> Result<NodeId> {
        self.constant_bits(
            values
                .iter()
                .flat_map(|&v| [v as u32, (v >> 32) as u32])
                .collect(),
            shape,
            DType::I64,
        )
    }

    /// Adds an f64 constant of the given shape (two little-endian words a value).
    pub fn constant_f64(&mut self, values: &[f64], shape: Shape) -> Result<NodeId> {
        self.constant_bits(
            values
                .iter()
                .flat_map(|v| [v.to_bits() as u32, (v.to_bits() >> 32) as u32])
                .collect(),
            shape,
            DType::F64,
        )
    }

    /// A scalar f32 constant.
    pub fn scalar(&mut self, v: f32) -> NodeId {
        self.push(
            Op::Const {
                data: Arc::new(vec![v.to_bits()]),
            },
            vec![],
            Shape::scalar(),
            DType::F32,
        )
    }

    fn constant_bits(&mut self, bits: Vec<u32>, shape: Shape, dtype: DType) -> Result<NodeId> {
        let words = dtype.size() / 4;
        if bits.len() != shape.numel() * words {
            return Err(Error::shape(
                "constant",
                format!("{} values given for shape {shape}", bits.len() / words),
            ));
        }
        Ok(self.push(
            Op::Const {
                data: Arc::new(bits),
            },
            vec![],
            shape,
            dtype,
        ))
    }

    /// Appends an op, inferring and checking its output shape and dtype.
    pub fn add(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId> {
        if matches!(op, Op::Input { .. } | Op::Param { .. } | Op::Const { .. }) {
            return Err(Error::Graph(format!(
                "[{}] use the dedicated constructor",
                op.name()
            )));
        }
        let arity_ok = match op.arity() {
            Some(n) => inputs.len() == n,
            None => !inputs.is_empty(),
        };
        if !arity_ok {
            return Err(Error::Graph(format!(
                "[{}] takes {} inputs, got {}",
                op.name(),
                op.arity()
                    .map_or("at least 1".to_string(), |n| n.to_string()),
                inputs.len()
            )));
        }
        if let Some(&bad) = inputs.iter().find(|&&i| i >= self.nodes.len()) {
            return Err(Error::Bounds(format!(
                "[{}] input node {bad} does not exist",
                op.name()
            )));
        }
        let ins: Vec<&Node> = inputs.iter().map(|&i| &self.nodes[i]).collect();
        let (shape, dtype) = match infer::infer(&op, &ins) {
            Ok(r) => r,
            Err(e) => return self.add_widened(op, inputs, e),
        };
        check_size(op.name(), &shape, dtype)?;
        Ok(self.push(op, inputs.to_vec(), shape, dtype))
    }

    /// A matrix product `op(a) @ op(b)` (`trans_a`/`trans_b` transpose the last two axes). An
    /// operand that is itself a transpose of its last two axes (`x.T` of a matrix,
    /// `x.swapaxes(-1, -2)`) is read in place with the flag flipped instead, so no transposed
    /// copy is made in the forward pass nor in the products autodiff derives from this one.
    /// Errors (and the float32 widening of low-precision operands) are those of the product as
    /// written.
    ///
    /// ```
    /// use rlx_ir::{DType, Graph, Op, Shape};
    ///
    /// let mut g = Graph::new();
    /// let x = g.input("x", Shape::new([4, 3]), DType::F32)?;
    /// let w = g.input("w", Shape::new([5, 3]), DType::F32)?;
    /// let wt = g.add(Op::Transpose { perm: vec![1, 0] }, &[w])?;
    /// let y = g.matmul(x, wt, false, false)?;
    /// assert_eq!(g.node(y).op, Op::MatMul { trans_a: false, trans_b: true });
    /// assert_eq!(g.node(y).inputs, [x, w]);
    /// assert_eq!(g.node(y).shape, Shape::new([4, 5]));
    /// # Ok::<(), rlx_ir::Error>(())
    /// ```
    pub fn matmul(&mut self, a: NodeId, b: NodeId, trans_a: bool, trans_b: bool) -> Result<NodeId> {
        let written = Op::MatMul { trans_a, trans_b };
        let fits = match (self.nodes.get(a), self.nodes.get(b)) {
            (Some(x), Some(y)) => infer::infer(&written, &[x, y]).is_ok(),
            _ => false,
        };
        if !fits {
            return self.add(written, &[a, b]);
        }
        let (a, trans_a) = self
            .swapped_last_two(a)
            .map_or((a, trans_a), |x| (x, !trans_a));
        let (b, trans_b) = self
            .swapped_last_two(b)
            .map_or((b, trans_b), |x| (x, !trans_b));
        self.add(Op::MatMul { trans_a, trans_b }, &[a, b])
    }

    /// The input of `id` when `id` is a transpose of its last two axes only.
    fn swapped_last_two(&self, id: NodeId) -> Option<NodeId> {
        let n = &self.nodes[id];
        let Op::Transpose { perm } = &n.op else {
            return None;
        };
        let r = perm.len();
        let swap = r >= 2
            && perm[..r - 2].iter().enumerate().all(|(i, &p)| p == i)
            && perm[r - 2] == r - 1
            && perm[r - 1] == r - 2;
        swap.then(|| n.inputs[0])
    }

    /// An op with bfloat16 / float16 operands that has no kernel for them computes in float32,
    /// as PyTorch's CPU kernels do: those operands are cast to float32, the op runs, and a float
    /// result is rounded back to the low dtype when every float operand had that one dtype
    /// (else it stays float32, numpy's promotion of mixed float dtypes; a comparison's mask
    /// stays float32 too). Ops that take low
    /// dtypes as they are (data movement, casts, the mixed-precision matmul) never come here.
    /// `error` (infer's answer for the operands as given) is returned when no operand is of a
    /// low dtype; float64, int64 and bool operands are never widened.
    fn add_widened(&mut self, op: Op, inputs: &[NodeId], error: Error) -> Result<NodeId> {
        let dts: Vec<DType> = inputs.iter().map(|&i| self.nodes[i].dtype).collect();
        if !dts.iter().any(|d| d.is_low_precision()) {
            return Err(error);
        }
        let floats: Vec<DType> = dts.iter().copied().filter(|d| d.is_float()).collect();
        // A comparison's float32 mask stays float32 (its sums count exactly).
        let mask = matches!(op, Op::Binary(b) if b.is_comparison());
        let back = (!mask && floats.iter().all(|&d| d == floats[0])).then_some(floats[0]);
        // A failed op leaves the graph as it was (no stray casts).
        let before = self.nodes.len();
        let widened = (|| {
            let mut wide = Vec::with_capacity(inputs.len());
            for (&i, d) in inputs.iter().zip(&dts) {
                wide.push(if d.is_low_precision() {
                    self.add(Op::Cast { to: DType::F32 }, &[i])?
                } else {
                    i
                });
            }
            let out = self.add(op, &wide)?;
            match back {
                Some(low) if self.nodes[out].dtype == DType::F32 => {
                    self.add(Op::Cast { to: low }, &[out])
                }
                _ => Ok(out),
            }
        })();
        match widened {
            Ok(id) => Ok(id),
            Err(e) => {
                self.nodes.truncate(before);
                // A dtype the widening cannot help (float64 beside float16, say) is reported
                // with the operands as given; any other error (a shape) is the op's own.
                Err(if matches!(e, Error::DType { .. }) {
                    error
                } else {
                    e
                })
            }
        }
    }

    /// Marks a node as a graph output (in order).
    pub fn set_outputs(&mut self, outputs: Vec<NodeId>) -> Result<()> {
        if let Some(&bad) = outputs.iter().find(|&&i| i >= self.nodes.len()) {
            return Err(Error::Bounds(format!("output node {bad} does not exist")));
        }
        self.outputs = outputs;
        Ok(())
    }

    /// Ids and names of every input node, in insertion order.
    pub fn inputs(&self) -> Vec<(NodeId, &str)> {
        self.named(|op| match op {
            Op::Input { name } => Some(name),
            _ => None,
        })
    }

    /// Ids and names of every param node, in insertion order.
    pub fn params(&self) -> Vec<(NodeId, &str)> {
        self.named(|op| match op {
            Op::Param { name } => Some(name),
            _ => None,
        })
    }

    fn named<'a>(&'a self, f: impl Fn(&'a Op) -> Option<&'a String>) -> Vec<(NodeId, &'a str)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| f(&n.op).map(|s| (i, s.as_str())))
            .collect()
    }

    fn check_new_name(&self, name: &str) -> Result<()> {
        let taken = self.nodes.iter().any(|n| match &n.op {
            Op::Input { name: m } | Op::Param { name: m } => m == name,
            _ => false,
        });
        if taken {
            return Err(Error::Graph(format!(
                "the name '{name}' is already used in this graph"
            )));
        }
        Ok(())
    }

    pub(crate) fn push(
        &mut self,
        op: Op,
        inputs: Vec<NodeId>,
        shape: Shape,
        dtype: DType,
    ) -> NodeId {
        self.nodes.push(Node {
            op,
            inputs,
            shape,
            dtype,
        });
        self.nodes.len() - 1
    }

    /// Re-checks every node: inputs precede it and its recorded type matches inference.
    pub fn verify(&self) -> Result<()> {
        for (id, n) in self.nodes.iter().enumerate() {
            if n.inputs.iter().any(|&i| i >= id) {
                return Err(Error::Graph(format!(
                    "[{}] node {id} uses a later node",
                    n.op.name()
                )));
            }
            if n.op.arity() != Some(0) {
                let ins: Vec<&Node> = n.inputs.iter().map(|&i| &self.nodes[i]).collect();
                let (shape, dtype) = infer::infer(&n.op, &ins)?;
                if shape != n.shape || dtype != n.dtype {
                    return Err(Error::Graph(format!(
                        "[{}] node {id} records {} {} but infers {} {}",
                        n.op.name(),
                        n.shape,
                        n.dtype,
                        shape,
                        dtype
                    )));
                }
            }
        }
        Ok(())
    }

    /// For every node, whether some output depends on it.
    pub fn live_mask(&self) -> Vec<bool> {
        let mut live = vec![false; self.nodes.len()];
        for &o in &self.outputs {
            live[o] = true;
        }
        for id in (0..self.nodes.len()).rev() {
            if live[id] {
                for &i in &self.nodes[id].inputs {
                    live[i] = true;
                }
            }
        }
        live
    }
}
