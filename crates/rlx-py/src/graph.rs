//! `rlx._rlx.Graph`: builds an IR graph op by op; every call infers and checks types at once.
use crate::buffer::Bytes;
use crate::errors::{to_py, IntoPy};
use pyo3::prelude::*;
use rlx_ir::{BinaryOp, DType, Error, Graph, NodeId, Op, ReduceOp, Shape, UnaryOp, Window};

#[pyclass(name = "Graph", module = "rlx._rlx")]
#[derive(Clone, Default)]
pub struct PyGraph {
    pub graph: Graph,
}

pub fn parse_dtype(name: &str) -> Result<DType, Error> {
    DType::parse(name).ok_or_else(|| {
        Error::dtype(
            "dtype",
            format!(
                "unsupported dtype '{name}' (rlx has float32, float16, bfloat16, float64, \
                 int32, int64 and bool)"
            ),
        )
    })
}

impl PyGraph {
    fn add(&mut self, py: Python<'_>, op: Op, ins: &[NodeId]) -> PyResult<NodeId> {
        self.graph.add(op, ins).py_err(py)
    }

    fn shape_of(&self, py: Python<'_>, id: NodeId) -> PyResult<&Shape> {
        self.node_checked(id).map(|n| &n.shape).py_err(py)
    }

    fn node_checked(&self, id: NodeId) -> Result<&rlx_ir::Node, Error> {
        self.graph
            .nodes()
            .get(id)
            .ok_or_else(|| Error::Bounds(format!("node {id} does not exist in this graph")))
    }

    /// Normalises possibly negative axes for `op` on `shape`; `None` means every axis.
    fn axes(op: &str, shape: &Shape, axes: Option<Vec<i64>>) -> Result<Vec<usize>, Error> {
        let Some(axes) = axes else {
            return Ok((0..shape.rank()).collect());
        };
        let mut out = Vec::with_capacity(axes.len());
        for a in axes {
            let n = shape.axis(a).ok_or_else(|| {
                Error::shape(
                    op,
                    format!("axis {a} is out of range for a tensor of shape {shape}"),
                )
            })?;
            if out.contains(&n) {
                return Err(Error::shape(op, format!("axis {a} is repeated")));
            }
            out.push(n);
        }
        out.sort_unstable();
        Ok(out)
    }
}

#[pymethods]
impl PyGraph {
    #[new]
    fn new() -> PyGraph {
        PyGraph::default()
    }

    fn __len__(&self) -> usize {
        self.graph.len()
    }

    fn input(
        &mut self,
        py: Python<'_>,
        name: &str,
        shape: Vec<usize>,
        dtype: &str,
    ) -> PyResult<NodeId> {
        let dt = parse_dtype(dtype).py_err(py)?;
        self.graph.input(name, Shape(shape), dt).py_err(py)
    }

    fn param(
        &mut self,
        py: Python<'_>,
        name: &str,
        shape: Vec<usize>,
        dtype: &str,
    ) -> PyResult<NodeId> {
        let dt = parse_dtype(dtype).py_err(py)?;
        self.graph.param(name, Shape(shape), dt).py_err(py)
    }

    /// A constant from the little-endian bytes of a C-contiguous array.
    fn constant(
        &mut self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        shape: Vec<usize>,
        dtype: &str,
    ) -> PyResult<NodeId> {
        let dt = parse_dtype(dtype).py_err(py)?;
        let bytes = Bytes::get(data, "constant")?;
        let words: Vec<u32> = bytes
            .as_slice()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let r = match dt {
            DType::F32 => self.graph.constant_f32(
                &words.iter().map(|&w| f32::from_bits(w)).collect::<Vec<_>>(),
                Shape(shape),
            ),
            DType::I32 => self.graph.constant_i32(
                &words.iter().map(|&w| w as i32).collect::<Vec<_>>(),
                Shape(shape),
            ),
            DType::I64 => self.graph.constant_i64(
                &words
                    .chunks_exact(2)
                    .map(|w| (w[0] as u64 | (w[1] as u64) << 32) as i64)
                    .collect::<Vec<_>>(),
                Shape(shape),
            ),
            DType::F64 => self.graph.constant_f64(
                &words
                    .chunks_exact(2)
                    .map(|w| f64::from_bits(w[0] as u64 | (w[1] as u64) << 32))
                    .collect::<Vec<_>>(),
                Shape(shape),
            ),
            other => Err(Error::dtype(
                "constant",
                format!(
                    "constants are float32, float64, int32 or int64, got {other}; cast one with .astype('{other}')"
                ),
            )),
        };
        r.py_err(py)
    }

    fn unary(&mut self, py: Python<'_>, kind: &str, x: NodeId) -> PyResult<NodeId> {
        let u = match kind {
            "neg" => UnaryOp::Neg,
            "relu" => UnaryOp::Relu,
            "tanh" => UnaryOp::Tanh,
            "sigmoid" => UnaryOp::Sigmoid,
            "exp" => UnaryOp::Exp,
            "log" => UnaryOp::Log,
            "sqrt" => UnaryOp::Sqrt,
            "gelu" => UnaryOp::Gelu,
            "gelu_tanh" => UnaryOp::GeluTanh,
            "log1p" => return self.add(py, Op::Log1p, &[x]),
            "stop_gradient" => return self.add(py, Op::StopGradient, &[x]),
            k => {
                return Err(crate::errors::to_py(
                    py,
                    Error::unsupported(k, "unknown unary op"),
                ))
            }
        };
        self.add(py, Op::Unary(u), &[x])
    }

    fn pow(&mut self, py: Python<'_>, x: NodeId, p: f32) -> PyResult<NodeId> {
        self.add(py, Op::Unary(UnaryOp::PowScalar(p)), &[x])
    }

    fn binary(&mut self, py: Python<'_>, kind: &str, a: NodeId, b: NodeId) -> PyResult<NodeId> {
        let op = match kind {
            "add" => BinaryOp::Add,
            "sub" => BinaryOp::Sub,
            "mul" => BinaryOp::Mul,
            "div" => BinaryOp::Div,
            "floordiv" => BinaryOp::FloorDiv,
            "mod" => BinaryOp::Mod,
            "lt" => BinaryOp::Lt,
            "le" => BinaryOp::Le,
            "gt" => BinaryOp::Gt,
            "ge" => BinaryOp::Ge,
            "eq" => BinaryOp::Eq,
            "ne" => BinaryOp::Ne,
            k => {
                return Err(crate::errors::to_py(
                    py,
                    Error::unsupported(k, "unknown binary op"),
                ))
            }
        };
        self.add(py, Op::Binary(op), &[a, b])
    }

    #[pyo3(signature = (a, b, trans_a=false, trans_b=false))]
    fn matmul(
        &mut self,
        py: Python<'_>,
        a: NodeId,
        b: NodeId,
        trans_a: bool,
        trans_b: bool,
    ) -> PyResult<NodeId> {
        // A transposed operand (`x.T`) is read in place (see `Graph::matmul`).
        self.graph.matmul(a, b, trans_a, trans_b).py_err(py)
    }

    #[pyo3(signature = (kind, x, axes=None, keepdims=false))]
    fn reduce(
        &mut self,
        py: Python<'_>,
        kind: &str,
        x: NodeId,
        axes: Option<Vec<i64>>,
        keepdims: bool,
    ) -> PyResult<NodeId> {
        let op = match kind {
            "sum" => ReduceOp::Sum,
            "mean" => ReduceOp::Mean,
            "max" => ReduceOp::Max,
            k => {
                return Err(crate::errors::to_py(
                    py,
                    Error::unsupported(k, "unknown reduction"),
                ))
            }
        };
        let shape = self.shape_of(py, x)?.clone();
        let axes = Self::axes(kind, &shape, axes).py_err(py)?;
        self.add(py, Op::Reduce { op, axes, keepdims }, &[x])
    }

    fn broadcast_to(&mut self, py: Python<'_>, x: NodeId, shape: Vec<usize>) -> PyResult<NodeId> {
        self.add(
            py,
            Op::BroadcastTo {
                shape: Shape(shape),
            },
            &[x],
        )
    }

    /// Reshape; one dimension may be -1 (inferred).
    fn reshape(&mut self, py: Python<'_>, x: NodeId, shape: Vec<i64>) -> PyResult<NodeId> {
        let from = self.shape_of(py, x)?.clone();
        let known: i64 = shape.iter().filter(|&&d| d != -1).product();
        let holes = shape.iter().filter(|&&d| d == -1).count();
        let bad = shape.iter().any(|&d| d < -1)
            || holes > 1
            || (holes == 1 && (known == 0 || from.numel() as i64 % known != 0));
        if bad {
            let e = Error::shape(
                "reshape",
                format!(
                    "cannot reshape {from} ({} elements) to {shape:?}",
                    from.numel()
                ),
            );
            return Err(crate::errors::to_py(py, e));
        }
        let dims = shape
            .iter()
            .map(|&d| {
                if d == -1 {
                    from.numel() / known as usize
                } else {
                    d as usize
                }
            })
            .collect();
        self.add(py, Op::Reshape { shape: Shape(dims) }, &[x])
    }

    #[pyo3(signature = (x, perm=None))]
    fn transpose(&mut self, py: Python<'_>, x: NodeId, perm: Option<Vec<i64>>) -> PyResult<NodeId> {
        let shape = self.shape_of(py, x)?.clone();
        let perm: Vec<usize> = match perm {
            None => (0..shape.rank()).rev().collect(),
            Some(p) => {
                let mut out = Vec::with_capacity(p.len());
                for a in &p {
                    match shape.axis(*a) {
                        Some(n) => out.push(n),
                        None => {
                            let e = Error::shape(
                                "transpose",
                                format!("axes {p:?} are not a permutation for {shape}"),
                            );
                            return Err(crate::errors::to_py(py, e));
                        }
                    }
                }
                out
            }
        };
        self.add(py, Op::Transpose { perm }, &[x])
    }

    #[pyo3(signature = (x, axis=-1, log=false))]
    fn softmax(&mut self, py: Python<'_>, x: NodeId, axis: i64, log: bool) -> PyResult<NodeId> {
        let name = if log { "log_softmax" } else { "softmax" };
        let shape = self.shape_of(py, x)?.clone();
        let axis = Self::axes(name, &shape, Some(vec![axis])).py_err(py)?[0];
        let op = if log {
            Op::LogSoftmax { axis }
        } else {
            Op::Softmax { axis }
        };
        self.add(py, op, &[x])
    }

    fn cross_entropy(
        &mut self,
        py: Python<'_>,
        logits: NodeId,
        labels: NodeId,
    ) -> PyResult<NodeId> {
        self.add(py, Op::SoftmaxCrossEntropy, &[logits, labels])
    }

    fn mse(&mut self, py: Python<'_>, pred: NodeId, target: NodeId) -> PyResult<NodeId> {
        self.add(py, Op::Mse, &[pred, target])
    }

    #[pyo3(name = "where_")]
    fn where_op(&mut self, py: Python<'_>, cond: NodeId, a: NodeId, b: NodeId) -> PyResult<NodeId> {
        self.add(py, Op::Where, &[cond, a, b])
    }

    fn cast(&mut self, py: Python<'_>, x: NodeId, dtype: &str) -> PyResult<NodeId> {
        let to = parse_dtype(dtype).py_err(py)?;
        self.add(py, Op::Cast { to }, &[x])
    }

    /// Rows of `table` picked by int32 `ids`.
    fn gather(&mut self, py: Python<'_>, table: NodeId, ids: NodeId) -> PyResult<NodeId> {
        self.add(py, Op::Gather, &[table, ids])
    }

    /// `(x - mean) / sqrt(var + eps)` over the last axis.
    fn normalize(&mut self, py: Python<'_>, x: NodeId, eps: f32) -> PyResult<NodeId> {
        self.add(py, Op::Normalize { eps }, &[x])
    }

    /// Fused scaled-dot-product attention: `(q, k, v)` with `heads=None`, or one packed
    /// `(B, T, 3 * heads * head_dim)` q|k|v tensor with `heads` set (see `Op::Attention`).
    #[pyo3(signature = (ins, scale, causal=None, heads=None))]
    fn attention(
        &mut self,
        py: Python<'_>,
        ins: Vec<NodeId>,
        scale: f32,
        causal: Option<i64>,
        heads: Option<usize>,
    ) -> PyResult<NodeId> {
        self.add(
            py,
            Op::Attention {
                scale,
                causal,
                heads,
                lowp: None,
            },
            &ins,
        )
    }

    /// `x[start:end]` along `axis` (negative axis allowed; start/end already clamped).
    fn slice(
        &mut self,
        py: Python<'_>,
        x: NodeId,
        axis: i64,
        start: usize,
        end: usize,
    ) -> PyResult<NodeId> {
        let shape = self.shape_of(py, x)?.clone();
        let axis = Self::axes("slice", &shape, Some(vec![axis])).py_err(py)?[0];
        self.add(py, Op::Slice { axis, start, end }, &[x])
    }

    fn concat(&mut self, py: Python<'_>, xs: Vec<NodeId>, axis: i64) -> PyResult<NodeId> {
        let first = *xs
            .first()
            .ok_or_else(|| to_py(py, Error::shape("concat", "needs at least one tensor")))?;
        let shape = self.shape_of(py, first)?.clone();
        let axis = Self::axes("concat", &shape, Some(vec![axis])).py_err(py)?[0];
        self.add(py, Op::Concat { axis }, &xs)
    }

    /// A windowed op over an NCHW input: `"im2col"` (patches `[N, Ho*Wo, C*kh*kw]`),
    /// `"im2col_k"` (`[N, C*kh*kw, Ho*Wo]`), `"max_pool2d"` or `"avg_pool2d"`.
    fn window(
        &mut self,
        py: Python<'_>,
        kind: &str,
        x: NodeId,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> PyResult<NodeId> {
        let window = Window {
            kernel,
            stride,
            padding,
        };
        let op = match kind {
            "im2col" | "im2col_k" => Op::Im2Col {
                window,
                k_major: kind == "im2col_k",
            },
            "max_pool2d" => Op::Pool2d { window, max: true },
            "avg_pool2d" => Op::Pool2d { window, max: false },
            k => return Err(to_py(py, Error::unsupported(k, "unknown windowed op"))),
        };
        self.add(py, op, &[x])
    }

    /// Inverted dropout of `x` with drop probability `p`, the mask drawn from the int32 (2,)
    /// `seed` tensor.
    fn dropout(&mut self, py: Python<'_>, x: NodeId, seed: NodeId, p: f32) -> PyResult<NodeId> {
        self.add(py, Op::Dropout { p }, &[x, seed])
    }

    fn shape(&self, py: Python<'_>, id: NodeId) -> PyResult<Vec<usize>> {
        Ok(self.shape_of(py, id)?.0.clone())
    }

    fn dtype(&self, py: Python<'_>, id: NodeId) -> PyResult<&'static str> {
        self.node_checked(id).map(|n| n.dtype.name()).py_err(py)
    }

    fn set_outputs(&mut self, py: Python<'_>, outputs: Vec<NodeId>) -> PyResult<()> {
        self.graph.set_outputs(outputs).py_err(py)
    }

    fn outputs(&self) -> Vec<NodeId> {
        self.graph.outputs().to_vec()
    }

    /// `[(name, shape, dtype)]` of every input node.
    fn inputs(&self) -> Vec<(String, Vec<usize>, &'static str)> {
        self.named(self.graph.inputs())
    }

    /// `[(name, shape, dtype)]` of every param node.
    fn params(&self) -> Vec<(String, Vec<usize>, &'static str)> {
        self.named(self.graph.params())
    }

    /// Node id of the input or param called `name`.
    fn find(&self, name: &str) -> Option<NodeId> {
        self.graph
            .inputs()
            .into_iter()
            .chain(self.graph.params())
            .find(|(_, n)| *n == name)
            .map(|(id, _)| id)
    }

    /// The backward graph: outputs `[loss, d loss / d wrt...]`.
    fn grad(&self, py: Python<'_>, loss: NodeId, wrt: Vec<NodeId>) -> PyResult<PyGraph> {
        crate::errors::guard(|| rlx_ir::grad(&self.graph, loss, &wrt))
            .py_err(py)
            .map(|graph| PyGraph { graph })
    }

    /// The mixed-precision rewrite (`rlx_ir::autocast`): the new graph and, for each node id of
    /// this one, its id there.
    fn autocast(&self, py: Python<'_>, dtype: &str) -> PyResult<(PyGraph, Vec<NodeId>)> {
        let dt = parse_dtype(dtype).py_err(py)?;
        crate::errors::guard(|| rlx_ir::autocast(&self.graph, dt))
            .py_err(py)
            .map(|(graph, map)| (PyGraph { graph }, map))
    }

    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        self.graph.verify().py_err(py)
    }
}

impl PyGraph {
    fn named(&self, list: Vec<(NodeId, &str)>) -> Vec<(String, Vec<usize>, &'static str)> {
        list.into_iter()
            .map(|(id, name)| {
                let n = self.graph.node(id);
                (name.to_string(), n.shape.0.clone(), n.dtype.name())
            })
            .collect()
    }
}
