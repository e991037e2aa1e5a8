//! What the rlx-cpu integration tests share: the backend, byte conversions, deterministic test
//! data, running a graph, and tolerance checks against f64 references.
#![allow(dead_code)] // each test file uses its own subset

use rlx_ir::{DType, Graph, NodeId, Op, Shape};
use rlx_runtime::{Backend, Executable, Store};
use std::sync::Arc;

pub fn backend() -> Arc<dyn Backend> {
    Arc::new(rlx_cpu::CpuBackend)
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `n` deterministic values in `±[0.1, 1.0)` (away from 0, where relu and friends have kinks).
pub fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            let v = 0.1 + 0.9 * u;
            if s & 1 == 0 {
                v
            } else {
                -v
            }
        })
        .collect()
}

/// A graph input's value.
#[derive(Clone, Debug)]
pub enum Value {
    F32(Vec<usize>, Vec<f32>),
    I32(Vec<usize>, Vec<i32>),
}

impl Value {
    pub fn shape(&self) -> Shape {
        match self {
            Value::F32(s, _) | Value::I32(s, _) => Shape::new(s.clone()),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Value::F32(..) => DType::F32,
            Value::I32(..) => DType::I32,
        }
    }
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            Value::F32(_, v) => f32_bytes(v),
            Value::I32(_, v) => i32_bytes(v),
        }
    }
}

/// A float input of `shape` filled with `data(.., seed)`.
pub fn rand(shape: &[usize], seed: u64) -> Value {
    Value::F32(shape.to_vec(), data(shape.iter().product(), seed))
}

/// Adds the inputs `a0, a1, ...` for `values` and returns their ids.
pub fn inputs(g: &mut Graph, values: &[Value]) -> Vec<NodeId> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| g.input(&format!("a{i}"), v.shape(), v.dtype()).unwrap())
        .collect()
}

/// Compiles `g` (no parameters) for the CPU.
pub fn compile(g: &Graph) -> Executable {
    let params = Arc::new(Store::new(backend().as_ref(), &[]).unwrap());
    Executable::new(backend(), g, params, None).unwrap()
}

/// Runs `exe` with `a0, a1, ...` = `values` and returns every output as f32.
pub fn run(exe: &Executable, values: &[Value], n_outputs: usize) -> Vec<Vec<f32>> {
    let names: Vec<String> = (0..values.len()).map(|i| format!("a{i}")).collect();
    let bytes: Vec<Vec<u8>> = values.iter().map(Value::bytes).collect();
    let feeds: Vec<(&str, &[u8])> = names
        .iter()
        .zip(&bytes)
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    let read: Vec<usize> = (0..n_outputs).collect();
    exe.run(&feeds, None, &read)
        .unwrap()
        .iter()
        .map(|b| to_f32(b))
        .collect()
}

/// Builds `op(inputs)` with the given values, runs it once and returns the output as f32.
pub fn eval(op: Op, values: &[Value]) -> Vec<f32> {
    let mut g = Graph::new();
    let ids = inputs(&mut g, values);
    let y = g.add(op, &ids).unwrap();
    g.set_outputs(vec![y]).unwrap();
    run(&compile(&g), values, 1).remove(0)
}

/// Element-by-element `|got - want| <= atol + rtol * |want|`, NaNs matching NaNs.
pub fn assert_close(got: &[f32], want: &[f64], atol: f64, rtol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        if w.is_infinite() {
            assert_eq!(g as f64, w, "{what}[{i}]");
            continue;
        }
        assert!(
            (g as f64 - w).abs() <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// Row-major strides of `dims`.
pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * dims[d + 1];
    }
    s
}

/// The multi-index of flat position `i` in `dims`.
pub fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

/// The flat position in `src` (numpy broadcasting, right-aligned) read at output index `idx`.
pub fn broadcast_index(idx: &[usize], src: &[usize]) -> usize {
    let lead = idx.len() - src.len();
    let st = strides(src);
    (0..src.len())
        .map(|d| {
            if src[d] == 1 {
                0
            } else {
                idx[lead + d] * st[d]
            }
        })
        .sum()
}
