//! The MSL kernel library and its launch records: the kernel source (`msl/kernels.metal`), the
//! per-dialect preludes, and the byte layout of each kernel's record (64-bit GPU addresses and
//! 32-bit sizes, laid out as the MSL structs are).
use rlx_ir::{Error, Result};

/// The kernel library, without prelude.
pub const SOURCE: &str = include_str!("msl/kernels.metal");

/// The prelude for compiling [`SOURCE`] with Metal.
pub const MSL_PRELUDE: &str = "#include <metal_stdlib>\nusing namespace metal;\n";

/// Binary element-wise ops of `rlx_binary_f32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add = 0,
    Sub = 1,
    Mul = 2,
    Div = 3,
    Max = 4,
    Min = 5,
}

/// Unary element-wise ops of `rlx_unary_f32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    Neg = 0,
    Relu = 1,
    Exp = 2,
    Tanh = 3,
    Sigmoid = 4,
    Sqrt = 5,
    Abs = 6,
}

/// Builds a launch record field by field with C struct alignment.
#[derive(Default)]
pub struct Record(Vec<u8>);

impl Record {
    fn align(&mut self, a: usize) {
        while self.0.len() % a != 0 {
            self.0.push(0);
        }
    }
    pub fn addr(mut self, a: u64) -> Self {
        self.align(8);
        self.0.extend_from_slice(&a.to_ne_bytes());
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.align(4);
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    pub fn f32(mut self, v: f32) -> Self {
        self.align(4);
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    /// The record's bytes, padded to its alignment (8 when it holds an address).
    pub fn finish(mut self) -> Vec<u8> {
        self.align(8);
        self.0
    }
}

fn count(op: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Unsupported {
        op: op.into(),
        msg: format!("{n} elements exceed the Metal kernels' 32-bit sizes"),
    })
}

/// `out = a <op> b` over `n` f32 elements.
pub fn binary(op: BinaryOp, out: u64, a: u64, b: u64, n: usize) -> Result<Vec<u8>> {
    let n = count("binary", n)?;
    Ok(Record::default()
        .addr(out)
        .addr(a)
        .addr(b)
        .u32(n)
        .u32(op as u32)
        .finish())
}

/// `out = op(a)` over `n` f32 elements.
pub fn unary(op: UnaryOp, out: u64, a: u64, n: usize) -> Result<Vec<u8>> {
    let n = count("unary", n)?;
    Ok(Record::default()
        .addr(out)
        .addr(a)
        .u32(n)
        .u32(op as u32)
        .finish())
}

/// `out[..n] = value`.
pub fn fill(out: u64, value: f32, n: usize) -> Result<Vec<u8>> {
    let n = count("fill", n)?;
    Ok(Record::default().addr(out).f32(value).u32(n).finish())
}

/// `y += alpha * x` over `n` elements.
pub fn axpy(y: u64, x: u64, alpha: f32, n: usize) -> Result<Vec<u8>> {
    let n = count("axpy", n)?;
    Ok(Record::default().addr(y).addr(x).f32(alpha).u32(n).finish())
}

/// One GEMM: `c = alpha * a @ b + beta * c`, `a` is `m x k` with element strides
/// `a_strides = (row, col)`, `b` is `k x n` likewise, `c` is `m x n` with row stride `c_row`.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_strides: (usize, usize),
    pub b_strides: (usize, usize),
    pub c_row: usize,
    pub alpha: f32,
    pub beta: f32,
}

impl Gemm {
    /// The record and the number of threads (one per 4x4 tile of `c`).
    pub fn record(&self) -> Result<(Vec<u8>, usize)> {
        let c = |v| count("matmul", v);
        let rec = Record::default()
            .addr(self.a)
            .addr(self.b)
            .addr(self.c)
            .u32(c(self.m)?)
            .u32(c(self.n)?)
            .u32(c(self.k)?)
            .u32(c(self.a_strides.0)?)
            .u32(c(self.a_strides.1)?)
            .u32(c(self.b_strides.0)?)
            .u32(c(self.b_strides.1)?)
            .u32(c(self.c_row)?)
            .f32(self.alpha)
            .f32(self.beta)
            .finish();
        let threads = self.m.div_ceil(4) * self.n.div_ceil(4);
        c(threads)?;
        Ok((rec, threads))
    }
}
