//! The MSL kernel sources and their launch records: the prelude (`msl/prelude.metal`: the
//! record `P` of `rlx_runtime::gpu_plan`, indexing, scalar helpers), the fixed library
//! (`msl/library.metal`), the fused kernels generated from expressions with the shared
//! `rlx_runtime::expr_source`, the per-dialect headers, and the byte layout of each record.
use crate::Dialect;
use rlx_ir::{Error, Fused, Result};
use rlx_runtime::expr_source;
use rlx_runtime::gpu_plan::{self, MAX_OPS, MAX_RANK, P};

/// Declarations every kernel source starts with (after the dialect's header).
pub const PRELUDE: &str = include_str!("msl/prelude.metal");
/// The fixed kernels, compiled once per device.
pub const LIBRARY: &str = include_str!("msl/library.metal");

/// The header of sources compiled by Metal: the standard library and the two atomics (the host
/// emulation's versions are in `msl/compat.h`).
pub const MSL_HEADER: &str = r#"#include <metal_stdlib>
using namespace metal;
inline void rx_atomic_add(device float* p, float v) {
    atomic_fetch_add_explicit((device atomic_float*)p, v, memory_order_relaxed);
}
// Records the first failure of a run (code, value) in the error word.
inline void rx_fail(device int* err, int code, int value) {
    int expected = 0;
    while (!atomic_compare_exchange_weak_explicit((device atomic_int*)err, &expected, code,
                                                  memory_order_relaxed, memory_order_relaxed)) {
        if (expected != 0) return;
    }
    err[1] = value;
}
"#;

/// How fused expressions are spelled in MSL (and in C++ through the compat header).
pub const EXPR: expr_source::Dialect = expr_source::Dialect {
    exp: "exp",
    log: "log",
    tanh: "tanh",
    sqrt: "sqrt",
    pow: "rx_pow",
    bits: "rx_bits",
};

/// `body` (kernels) with the prelude and the dialect's header.
pub fn source(dialect: Dialect, body: &str) -> String {
    match dialect {
        Dialect::Msl => format!("{MSL_HEADER}{PRELUDE}{body}"),
        Dialect::HostCxx => format!("{PRELUDE}{body}"),
    }
}

/// A kernel evaluating `f` element-wise: operands `0..n_inputs` are the inputs, operand
/// `n_inputs` the output (strides in the record, as every library kernel).
pub fn fused_kernel(name: &str, f: &Fused) -> String {
    let (body, last) = EXPR.body(f, |k| format!("F({k})[off(p, {k}, i)]"));
    let o = f.n_inputs;
    format!(
        "kernel void {name}(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {{\n    if ((long)i >= p.n) return;\n{body}    F({o})[off(p, {o}, i)] = {last};\n}}\n"
    )
}

/// The bytes of a launch record, laid out as `struct P` in `msl/prelude.metal` (no padding:
/// 8-byte fields first, then the 4-byte ones).
pub fn record(p: &P) -> Vec<u8> {
    let mut b = Vec::with_capacity(RECORD_BYTES);
    p.ptr.iter().for_each(|v| b.extend(v.to_ne_bytes()));
    b.extend(p.n.to_ne_bytes());
    b.extend(p.rank.to_ne_bytes());
    p.dims.iter().for_each(|v| b.extend(v.to_ne_bytes()));
    p.st.iter()
        .flatten()
        .for_each(|v| b.extend(v.to_ne_bytes()));
    p.iv.iter().for_each(|v| b.extend(v.to_ne_bytes()));
    p.fv.iter().for_each(|v| b.extend(v.to_ne_bytes()));
    p.mode.iter().for_each(|v| b.extend(v.to_ne_bytes()));
    b
}

/// Size of a launch record `P` in bytes (well under `setBytes`'s 4 KiB).
pub const RECORD_BYTES: usize =
    8 * (MAX_OPS + 2 + MAX_RANK + MAX_OPS * MAX_RANK + 8) + 4 * (8 + MAX_OPS);

/// Kernels run by one thread (serial sums); every other kernel runs one thread per element,
/// row or output: `p.n` threads.
pub const SERIAL: &[&str] = &[
    "rlx_mean_rows",
    "rlx_count_labels",
    "rlx_mse",
    "rlx_update_ctrl",
    "rlx_update_finish",
];

/// Elements one thread of `rlx_sumsq` sums (`RX_SUMSQ_CHUNK` in `msl/library.metal`).
pub const SUMSQ_CHUNK: usize = 1024;
/// Threads `rlx_update_multi` gives each chunk of the update table (`RX_UPDATE_LANES`).
pub const UPDATE_LANES: usize = 256;

/// Kernels of the library the plan may launch (the update's kernels only when the update runs
/// on the device, `crate::UpdateMode::Kernel`).
pub const NAMES: &[&str] = &[
    "rlx_copy32",
    "rlx_cast_f2i",
    "rlx_cast_i2f",
    "rlx_where32",
    "rlx_ibinary",
    "rlx_reduce",
    "rlx_reduce_rows",
    "rlx_softmax",
    "rlx_ce_rows",
    "rlx_mean_rows",
    "rlx_count_labels",
    "rlx_ce_grad",
    "rlx_mse",
    "rlx_gather",
    "rlx_scatter_add",
    "rlx_normalize",
    "rlx_normalize_grad",
    "rlx_im2col",
    "rlx_col2im",
    "rlx_pool2d",
    "rlx_pool2d_grad",
    "rlx_dropout",
    "rlx_log1p",
    "rlx_attention",
    "rlx_attention_grad",
    "rlx_zero32",
    "rlx_gemm_f32",
    "rlx_sumsq",
    "rlx_update_ctrl",
    "rlx_accumulate",
    "rlx_copy_unless_skipped",
    "rlx_update_multi",
    "rlx_update_finish",
];

fn count(op: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Unsupported {
        op: op.into(),
        msg: format!("{n} exceeds the Metal kernels' 32-bit sizes and grids"),
    })
}

/// One GEMM in the kernel's row-major terms: `c = a @ b`, `a` is `m x k` with element strides
/// `a_strides = (row, col)`, `b` is `k x n` likewise, `c` is `m x n` with row stride `c_row`;
/// `batch` products, the operands advancing by the `*_batch` element strides.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub a_strides: (usize, usize),
    pub b_strides: (usize, usize),
    pub c_row: usize,
    pub a_batch: usize,
    pub b_batch: usize,
    pub c_batch: usize,
}

impl Gemm {
    /// The plan's GEMM (BLAS column-major terms: `C = op(A) op(B)`, `C` is `m x n` with leading
    /// dimension `ldc`) as the kernel's row-major one: column-major `C` is row-major `C^T`
    /// (`n x m`, row stride `ldc`) `= op(B)^T op(A)^T`.
    pub fn from_plan(g: &gpu_plan::Gemm, a: u64, b: u64, c: u64) -> Gemm {
        // Row j, column q of op(B)^T is op(B)[q, j]; row q, column i of op(A)^T is op(A)[i, q].
        let a_strides = if g.tb { (1, g.ldb) } else { (g.ldb, 1) };
        let b_strides = if g.ta { (1, g.lda) } else { (g.lda, 1) };
        Gemm {
            a: b,
            b: a,
            c,
            m: g.n,
            n: g.m,
            k: g.k,
            batch: g.batch.max(1),
            a_strides,
            b_strides,
            c_row: g.ldc,
            a_batch: g.stride_b,
            b_batch: g.stride_a,
            c_batch: g.stride_c,
        }
    }

    /// The record and the number of threads (one per 4x4 tile of each product).
    pub fn record(&self) -> Result<(Vec<u8>, usize)> {
        let c = |v| count("matmul", v);
        let mut b = Vec::with_capacity(96);
        for v in [self.a, self.b, self.c] {
            b.extend(v.to_ne_bytes());
        }
        for v in [self.a_batch, self.b_batch, self.c_batch] {
            b.extend((v as u64).to_ne_bytes());
        }
        for v in [
            self.m,
            self.n,
            self.k,
            self.batch,
            self.a_strides.0,
            self.a_strides.1,
            self.b_strides.0,
            self.b_strides.1,
            self.c_row,
            0,
        ] {
            b.extend(c(v)?.to_ne_bytes());
        }
        let threads = self.m.div_ceil(4) * self.n.div_ceil(4) * self.batch;
        c(threads)?;
        Ok((b, threads))
    }
}

/// The threads a library or fused kernel launch of record `p` runs on.
pub fn threads(kernel: &str, p: &P) -> Result<usize> {
    if SERIAL.contains(&kernel) {
        return Ok(1);
    }
    let n = usize::try_from(p.n).unwrap_or(0);
    let n = match kernel {
        "rlx_sumsq" => n.div_ceil(SUMSQ_CHUNK),
        // one group of lanes per chunk of the table (iv[2] chunks)
        "rlx_update_multi" => usize::try_from(p.iv[2]).unwrap_or(0) * UPDATE_LANES,
        _ => n,
    };
    count(kernel, n)?;
    Ok(n)
}
