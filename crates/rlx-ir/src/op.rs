//! The operation set of the IR. Each op's shape rule lives in `infer.rs`, its VJP in `autodiff.rs`.
use crate::{DType, Shape};
use std::sync::Arc;

/// Elementwise functions of one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    Neg,
    Relu,
    Tanh,
    Sigmoid,
    Exp,
    Log,
    Sqrt,
    /// `x ** p` for a constant exponent.
    PowScalar(f32),
    /// GELU, exact form `x * Phi(x)` (erf).
    Gelu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// d/dx of `Gelu` (used by its VJP).
    GeluDeriv,
    /// d/dx of `GeluTanh` (used by its VJP).
    GeluTanhDeriv,
}

/// Elementwise functions of two broadcast tensors. Comparisons give float32 0/1 masks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    /// True division: int32 operands give a float32 quotient (as numpy and PyTorch give a float).
    Div,
    /// Floor division (Python's `//`): rounds toward -inf. Int32 division by zero is a run-time
    /// error; `i32::MIN // -1` wraps to `i32::MIN` (numpy's result).
    FloorDiv,
    /// Remainder with the divisor's sign (Python's `%`): `a - b * floor(a / b)`. Int32 by zero is
    /// a run-time error; float by zero is NaN.
    Mod,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

impl BinaryOp {
    pub fn is_comparison(self) -> bool {
        !matches!(
            self,
            BinaryOp::Add
                | BinaryOp::Sub
                | BinaryOp::Mul
                | BinaryOp::Div
                | BinaryOp::FloorDiv
                | BinaryOp::Mod
        )
    }
}

/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
}

/// One operation. Inputs are given by the node; attributes live here.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A value supplied on every call (or bound once as a resident input).
    Input {
        name: String,
    },
    /// A trainable weight, resident in the executable's parameter store.
    Param {
        name: String,
    },
    /// Constant data baked into the graph (little-endian f32, i32 or i64 values, the last as
    /// two words each).
    Const {
        data: Arc<Vec<u32>>,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `a @ b` over the last two dims, leading dims broadcast; `trans_*` transposes that operand.
    MatMul {
        trans_a: bool,
        trans_b: bool,
    },
    /// Reduce over `axes` (sorted, unique); `keepdims` keeps them as size 1.
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
        keepdims: bool,
    },
    /// Broadcasts the input up to `shape` (numpy rules).
    BroadcastTo {
        shape: Shape,
    },
    /// Sums a broadcast value back down to `shape` (the VJP of broadcasting).
    SumTo {
        shape: Shape,
    },
    /// Same data, new shape (element count preserved). Costs nothing: an alias in the arena.
    Reshape {
        shape: Shape,
    },
    /// Permutes dimensions: output dim `i` is input dim `perm[i]`.
    Transpose {
        perm: Vec<usize>,
    },
    Softmax {
        axis: usize,
    },
    LogSoftmax {
        axis: usize,
    },
    /// Mean softmax cross-entropy of logits `[N, C]` against int32 labels `[N]`; a scalar.
    /// Rows labelled -100 (PyTorch's default `ignore_index`) are left out of the sum and the
    /// count (NaN when every row is); other labels outside `[0, C)` are a run-time error.
    SoftmaxCrossEntropy,
    /// Gradient of `SoftmaxCrossEntropy` w.r.t. the logits: `(softmax - onehot) * g / N`
    /// (N: rows not labelled -100; those rows get 0).
    SoftmaxCrossEntropyGrad,
    /// Mean squared error of two same-shape tensors; a scalar.
    Mse,
    /// `cond != 0 ? a : b`, all three broadcast.
    Where,
    /// Element type conversion.
    Cast {
        to: DType,
    },
    /// Rows of `table` (first input, `[V, ...]`) picked by int32 `ids` (any shape): `[*ids, ...]`.
    Gather,
    /// The VJP of `Gather`: sums rows of `g` (`[*ids, ...]`) into a zero `[rows, ...]` by `ids`.
    /// Inputs: `(ids, g)`.
    ScatterAdd {
        rows: usize,
    },
    /// `(x - mean) / sqrt(var + eps)` over the last axis (layer norm without the affine part).
    Normalize {
        eps: f32,
    },
    /// The VJP of `Normalize` w.r.t. `x`. Inputs: `(x, g)`.
    NormalizeGrad {
        eps: f32,
    },
    /// `NormalizeGrad` plus a tensor of the same shape: inputs `(x, g, acc)`, output
    /// `normalize_grad(x, g) + acc` (made by `fuse` from a gradient sum, e.g. the residual
    /// stream's; no VJP).
    NormalizeGradAdd {
        eps: f32,
    },
    /// `x[..., start:end, ...]` along `axis`.
    Slice {
        axis: usize,
        start: usize,
        end: usize,
    },
    /// Zero padding along `axis`: `before` zeros, the input, `after` zeros.
    Pad {
        axis: usize,
        before: usize,
        after: usize,
    },
    /// Joins its inputs (any number, at least one) along `axis`.
    Concat {
        axis: usize,
    },
    /// Scaled dot-product attention, `softmax(q @ k^T * scale + mask) @ v`, per block of
    /// queries. A backend computes it block by block and never materialises the scores of more
    /// than one block. Layouts:
    /// - `heads: None`: inputs `q (..., L, E)`, `k (..., S, E)`, `v (..., S, Ev)` (the same
    ///   leading dims, no broadcasting); output `(..., L, Ev)`. One block per leading index.
    /// - `heads: Some(h)`: one input `qkv (B, T, 3*h*E)` holding q | k | v along the last axis,
    ///   each split into `h` heads of `E` (so head `j` of q is columns `j*E..(j+1)*E`, of k
    ///   `(h+j)*E..`, of v `(2h+j)*E..`); output `(B, T, h*E)` with head `j` in columns
    ///   `j*E..(j+1)*E`. One block per (b, head); L = S = T.
    ///
    /// `causal: Some(off)`: query `i` sees key `j` only when `j <= i + off` (PyTorch's
    /// `is_causal` is `off = 0`); a query that sees no key gives NaN (a softmax over nothing).
    ///
    /// `lowp: Some(bf16 | f16)` (set by the autocast rewrite, as PyTorch's autocast runs
    /// attention in its low precision): a backend may read the products' operands (q, k, v, the
    /// probabilities, and in the gradient `g` and the score gradients) rounded to that dtype,
    /// summing in float32; softmax, inputs and results stay float32. `None`: float32 throughout.
    Attention {
        scale: f32,
        causal: Option<i64>,
        heads: Option<usize>,
        lowp: Option<DType>,
    },
    /// The VJP of `Attention` (same attributes). Inputs `(q, k, v, out, g)` for `heads: None`,
    /// giving one flat float32 vector `[dq | dk | dv]` (each in its input's row-major order);
    /// `(qkv, out, g)` for `heads: Some(_)`, giving `d qkv` (the shape of `qkv`). `out` is the
    /// forward result; the scores are recomputed block by block.
    AttentionGrad {
        scale: f32,
        causal: Option<i64>,
        heads: Option<usize>,
        lowp: Option<DType>,
    },
    /// A matmul followed by an elementwise epilogue, `epilogue(a @ b, x1, .., xn)` (made by
    /// `fuse`, after autodiff; no VJP). Inputs `(a, b, x1, .., xn)`; `a @ b` is `MatMul` with
    /// the same flags, and its result, read in row-major order as `epilogue.shape` (same element
    /// count), is the expression's register 0; `x1..xn` are registers 1..n (each broadcast to
    /// `epilogue.shape`). The output has `epilogue.shape`. A backend may apply the epilogue to
    /// each block of the product while it is in cache; the product is never stored in the arena.
    MatMulEpilogue {
        trans_a: bool,
        trans_b: bool,
        epilogue: Arc<Fused>,
    },
    /// `SumTo { shape }` of a fused elementwise expression (made by `fuse`; no VJP): the
    /// expression (inputs as for `Fused`, result of `expr.shape`) is summed down to `shape`
    /// (numpy broadcasting in reverse) without being stored.
    FusedSumTo {
        expr: Arc<Fused>,
        shape: Shape,
    },
    /// A chain of float32 elementwise ops evaluated in one pass (made by `fuse`, after
    /// autodiff; it has no VJP).
    Fused(Arc<Fused>),
    /// Convolution patches (the GEMM lowering of `conv2d`): x `[N, C, H, W]` gives
    /// `[N, Ho*Wo, C*kh*kw]` where row `oy*Wo + ox`, column `(c*kh + i)*kw + j` holds
    /// `x[n, c, oy*sh - ph + i, ox*sw - pw + j]` (0 outside the input);
    /// `Ho = (H + 2*ph - kh) / sh + 1` (floor), likewise `Wo`. `[a, b]` pairs are (height, width).
    /// With `k_major` the patches of each image are transposed, `[N, C*kh*kw, Ho*Wo]`: a row per
    /// kernel tap, so a per-image GEMM `weight @ patches` writes NCHW directly and each row is a
    /// shifted copy of input rows.
    Im2Col {
        window: Window,
        k_major: bool,
    },
    /// The adjoint of `Im2Col` (the same `k_major` layout): sums the patches back into an image
    /// `[N, C, size[0], size[1]]` (positions in the padding are dropped).
    Col2Im {
        window: Window,
        size: [usize; 2],
        k_major: bool,
    },
    /// 2-D pooling of x `[N, C, H, W]` over `window` (output size as `Im2Col`'s). Max: padding
    /// counts as -inf; avg: the sum over the window divided by `kh*kw` (padding counts as zeros,
    /// PyTorch's `count_include_pad=True`).
    Pool2d {
        window: Window,
        max: bool,
    },
    /// The VJP of `Pool2d` w.r.t. x. Inputs `(x, g)`. Max: each window's `g` goes to the first
    /// maximal element of the window (row-major order, NaN counts as maximal, as PyTorch).
    Pool2dGrad {
        window: Window,
        max: bool,
    },
    /// Inverted dropout: `x * keep / (1 - p)` where `keep` is a pseudo-random 0/1 mask with
    /// P(keep) = 1 - p, a pure function of (the int32 `seed` input `[2]`, the element's flat
    /// index): see [`dropout_keep`]. Inputs `(x, seed)`. Its VJP is the same op on `g`.
    Dropout {
        p: f32,
    },
    /// `log(1 + x)`, accurate near 0.
    Log1p,
    /// The identity whose gradient is zero (nothing flows back through it).
    StopGradient,
}

/// The sliding window of a convolution or pooling: each `[a, b]` is (height, width).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl Window {
    /// The output size along each spatial dim for an input of `size`; `None` when the kernel
    /// does not fit into the padded input (or a stride is 0).
    pub fn out_size(&self, size: [usize; 2]) -> Option<[usize; 2]> {
        let mut out = [0; 2];
        for d in 0..2 {
            let padded = size[d] + 2 * self.padding[d];
            if self.stride[d] == 0 || self.kernel[d] == 0 || self.kernel[d] > padded {
                return None;
            }
            out[d] = (padded - self.kernel[d]) / self.stride[d] + 1;
        }
        Some(out)
    }
}

/// Whether dropout keeps element `index` for `seed` (the int32 pair given to `Op::Dropout`)
/// at drop probability `p`: a counter-based hash (splitmix64 finaliser of the seed words and
/// the index) turned into a uniform 24-bit value `u` in [0, 1); kept when `u >= p`. Every
/// backend computes exactly this, so masks agree across devices.
#[inline]
pub fn dropout_keep(seed: [i32; 2], index: u64, p: f32) -> bool {
    let mut z = ((seed[0] as u32 as u64) << 32 | seed[1] as u32 as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ index;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let u = (z >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
    u >= p
}

/// One step of a fused expression: it reads earlier registers and appends one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FusedStep {
    Unary(UnaryOp, u16),
    Binary(BinaryOp, u16, u16),
    /// `cond != 0 ? a : b` (cond a float32 mask).
    Where(u16, u16, u16),
}

/// A fused elementwise expression over float32 registers: registers `0..n_inputs` are the
/// inputs, each broadcast (numpy rules) to `shape`; each step appends one register; the last
/// one is the result.
#[derive(Clone, Debug, PartialEq)]
pub struct Fused {
    pub shape: Shape,
    pub n_inputs: usize,
    pub steps: Vec<FusedStep>,
}

impl std::fmt::Display for Fused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = |i: u16| format!("r{i}");
        let parts: Vec<String> = self
            .steps
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let out = self.n_inputs + k;
                match *s {
                    FusedStep::Unary(UnaryOp::PowScalar(p), a) => {
                        format!("r{out}=pow({},{p})", r(a))
                    }
                    FusedStep::Unary(u, a) => format!("r{out}={}({})", Op::Unary(u).name(), r(a)),
                    FusedStep::Binary(b, x, y) => {
                        format!("r{out}={}({},{})", Op::Binary(b).name(), r(x), r(y))
                    }
                    FusedStep::Where(c, x, y) => {
                        format!("r{out}=where({},{},{})", r(c), r(x), r(y))
                    }
                }
            })
            .collect();
        write!(f, "{}", parts.join("; "))
    }
}

impl Op {
    /// The name used in error messages and the Python API.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param { .. } => "param",
            Op::Const { .. } => "constant",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Relu => "relu",
                UnaryOp::Tanh => "tanh",
                UnaryOp::Sigmoid => "sigmoid",
                UnaryOp::Exp => "exp",
                UnaryOp::Log => "log",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::PowScalar(_) => "pow",
                UnaryOp::Gelu | UnaryOp::GeluTanh => "gelu",
                UnaryOp::GeluDeriv | UnaryOp::GeluTanhDeriv => "gelu_grad",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::FloorDiv => "floor_divide",
                BinaryOp::Mod => "remainder",
                BinaryOp::Lt => "less",
                BinaryOp::Le => "less_equal",
                BinaryOp::Gt => "greater",
                BinaryOp::Ge => "greater_equal",
                BinaryOp::Eq => "equal",
                BinaryOp::Ne => "not_equal",
            },
            Op::MatMul { .. } => "matmul",
            Op::Reduce { op, .. } => match op {
                ReduceOp::Sum => "sum",
                ReduceOp::Mean => "mean",
                ReduceOp::Max => "max",
            },
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::SumTo { .. } => "sum_to",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::SoftmaxCrossEntropy => "cross_entropy",
            Op::SoftmaxCrossEntropyGrad => "cross_entropy_grad",
            Op::Mse => "mse_loss",
            Op::Where => "where",
            Op::Cast { .. } => "cast",
            Op::Gather => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Normalize { .. } => "normalize",
            Op::NormalizeGrad { .. } => "normalize_grad",
            Op::NormalizeGradAdd { .. } => "normalize_grad_add",
            Op::Slice { .. } => "slice",
            Op::Pad { .. } => "pad",
            Op::Concat { .. } => "concat",
            Op::Fused(_) => "fused",
            Op::Im2Col { .. } => "im2col",
            Op::Col2Im { .. } => "col2im",
            Op::Pool2d { max: true, .. } => "max_pool2d",
            Op::Pool2d { max: false, .. } => "avg_pool2d",
            Op::Pool2dGrad { max: true, .. } => "max_pool2d_grad",
            Op::Pool2dGrad { max: false, .. } => "avg_pool2d_grad",
            Op::Dropout { .. } => "dropout",
            Op::Log1p => "log1p",
            Op::StopGradient => "stop_gradient",
            Op::MatMulEpilogue { .. } => "matmul_epilogue",
            Op::FusedSumTo { .. } => "fused_sum_to",
            Op::Attention { .. } => "attention",
            Op::AttentionGrad { .. } => "attention_grad",
        }
    }

    /// Number of inputs the op takes; `None` for any number of at least one (`Concat`).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Concat { .. } | Op::Fused(_) => return None,
            Op::MatMulEpilogue { epilogue, .. } => 1 + epilogue.n_inputs,
            Op::FusedSumTo { expr, .. } => expr.n_inputs,
            Op::Attention { heads, .. } => {
                if heads.is_some() {
                    1
                } else {
                    3
                }
            }
            Op::AttentionGrad { heads, .. } => {
                if heads.is_some() {
                    3
                } else {
                    5
                }
            }
            Op::Input { .. } | Op::Param { .. } | Op::Const { .. } => 0,
            Op::Binary(_)
            | Op::MatMul { .. }
            | Op::SoftmaxCrossEntropy
            | Op::Mse
            | Op::Gather
            | Op::ScatterAdd { .. }
            | Op::NormalizeGrad { .. }
            | Op::Pool2dGrad { .. }
            | Op::Dropout { .. } => 2,
            Op::SoftmaxCrossEntropyGrad | Op::Where | Op::NormalizeGradAdd { .. } => 3,
            _ => 1,
        })
    }

    /// True for ops whose output shares its input's storage.
    pub fn is_alias(&self) -> bool {
        matches!(self, Op::Reshape { .. })
    }
}
