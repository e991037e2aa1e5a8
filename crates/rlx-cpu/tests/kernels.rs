//! Every CPU kernel against a naive f64 reference, through the public graph API: odd sizes,
//! empty and size-1 dims, lengths around the 8-wide vector loops' tails (0, 1, 7, 8, 9, 17, 33),
//! broadcasting, and the special values (NaN, ±inf) numpy propagates.
mod common;

use common::*;
use rlx_ir::{BinaryOp, DType, Op, ReduceOp, Shape, UnaryOp};

const LENGTHS: [usize; 7] = [0, 1, 7, 8, 9, 17, 33];

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

/// erf by its Taylor series (accurate in f64 for |x| <= 4; saturated beyond).
fn erf(x: f64) -> f64 {
    if x.abs() > 4.0 {
        return x.signum();
    }
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn unary_kernels_match_f64_at_every_tail_length() {
    use UnaryOp::*;
    type Ref = (UnaryOp, fn(f64) -> f64);
    let refs: [Ref; 10] = [
        (Neg, |x| -x),
        (Relu, |x| x.max(0.0)),
        (Tanh, f64::tanh),
        (Sigmoid, |x| 1.0 / (1.0 + (-x).exp())),
        (Exp, f64::exp),
        (Log, |x| x.abs().ln()),
        (Sqrt, |x| x.abs().sqrt()),
        (PowScalar(3.0), |x| x.powi(3)),
        (Gelu, gelu),
        (GeluTanh, |x| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        }),
    ];
    for (u, f) in refs {
        for n in LENGTHS {
            let mut x: Vec<f32> = data(n, n as u64).iter().map(|v| v * 6.0).collect();
            if matches!(u, Log | Sqrt) {
                x.iter_mut().for_each(|v| *v = v.abs());
            }
            let got = eval(Op::Unary(u), &[Value::F32(vec![n], x.clone())]);
            let want: Vec<f64> = x.iter().map(|&v| f(v as f64)).collect();
            // The vectorisable exp/erf/tanh are within a few ulp (erf: 5e-7 absolute).
            assert_close(&got, &want, 2e-6, 2e-6, &format!("{u:?} n={n}"));
        }
    }
}

#[test]
fn unary_special_values() {
    let x = vec![
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -200.0,
        200.0,
        0.0,
    ];
    let exp = eval(Op::Unary(UnaryOp::Exp), &[Value::F32(vec![6], x.clone())]);
    assert!(exp[0].is_nan());
    assert_eq!(&exp[1..], &[f32::INFINITY, 0.0, 0.0, f32::INFINITY, 1.0]);
    let tanh = eval(Op::Unary(UnaryOp::Tanh), &[Value::F32(vec![6], x.clone())]);
    assert!(tanh[0].is_nan());
    assert_eq!(&tanh[1..], &[1.0, -1.0, -1.0, 1.0, 0.0]);
    let relu = eval(Op::Unary(UnaryOp::Relu), &[Value::F32(vec![6], x)]);
    assert!(relu[0].is_nan(), "relu keeps NaN");
}

/// `a (op) b` with numpy broadcasting, in f64.
fn broadcast_ref(a: &Value, b: &Value, f: impl Fn(f64, f64) -> f64) -> (Vec<usize>, Vec<f64>) {
    let (sa, sb) = (a.shape(), b.shape());
    let out = Shape::broadcast(&sa, &sb).expect("broadcastable");
    let get = |v: &Value, i: usize| match v {
        Value::F32(_, x) => x[i] as f64,
        Value::I32(_, x) => x[i] as f64,
    };
    let vals = (0..out.numel())
        .map(|i| {
            let idx = unravel(i, out.dims());
            f(
                get(a, broadcast_index(&idx, sa.dims())),
                get(b, broadcast_index(&idx, sb.dims())),
            )
        })
        .collect();
    (out.dims().to_vec(), vals)
}

const SHAPES: [(&[usize], &[usize]); 9] = [
    (&[9], &[9]),
    (&[33], &[1]),
    (&[1], &[17]),
    (&[0, 3], &[3]),
    (&[2, 0], &[1]),
    (&[1, 1], &[5, 1, 7]),
    (&[3, 1, 9], &[1, 4, 1]),
    (&[4, 7], &[4, 1]),
    (&[2, 3, 5], &[2, 3, 5]),
];

#[test]
fn binary_kernels_broadcast_like_numpy() {
    use BinaryOp::*;
    type Ref = (BinaryOp, fn(f64, f64) -> f64);
    let ops: [Ref; 10] = [
        (Add, |a, b| a + b),
        (Sub, |a, b| a - b),
        (Mul, |a, b| a * b),
        (Div, |a, b| a / b),
        (Lt, |a, b| (a < b) as i32 as f64),
        (Le, |a, b| (a <= b) as i32 as f64),
        (Gt, |a, b| (a > b) as i32 as f64),
        (Ge, |a, b| (a >= b) as i32 as f64),
        (Eq, |a, b| (a == b) as i32 as f64),
        (Ne, |a, b| (a != b) as i32 as f64),
    ];
    for (sa, sb) in SHAPES {
        let a = rand(sa, 1);
        // b shares some values with a so equality is exercised.
        let mut b = rand(sb, 2);
        if let (Value::F32(_, bx), Value::F32(_, ax)) = (&mut b, &a) {
            for (i, v) in bx.iter_mut().enumerate().step_by(2) {
                if let Some(&w) = ax.get(i) {
                    *v = w;
                }
            }
        }
        for (op, f) in ops {
            let (_, want) = broadcast_ref(&a, &b, f);
            let got = eval(Op::Binary(op), &[a.clone(), b.clone()]);
            assert_close(&got, &want, 1e-6, 1e-6, &format!("{op:?} {sa:?} {sb:?}"));
            let got = eval(Op::Binary(op), &[b.clone(), a.clone()]);
            let (_, want) = broadcast_ref(&b, &a, f);
            assert_close(&got, &want, 1e-6, 1e-6, &format!("{op:?} {sb:?} {sa:?}"));
        }
    }
}

#[test]
fn int32_arithmetic_wraps_and_divides_truly() {
    let a = Value::I32(vec![5], vec![7, -7, i32::MAX, 9, 0]);
    let b = Value::I32(vec![5], vec![2, 2, 1, 0, 0]);
    let as_i32 = |v: Vec<f32>| -> Vec<i32> { v.iter().map(|x| x.to_bits() as i32).collect() };
    // `/` on int32 is true division into float32, as numpy's and PyTorch's.
    let q = eval(Op::Binary(BinaryOp::Div), &[a.clone(), b.clone()]);
    assert_eq!(&q[..4], &[3.5, -3.5, i32::MAX as f32, f32::INFINITY]);
    assert!(q[4].is_nan());
    assert_eq!(
        as_i32(eval(Op::Binary(BinaryOp::Add), &[a.clone(), b.clone()])),
        vec![9, -5, i32::MIN, 9, 0]
    );
    // Comparisons of int32 operands give float32 masks.
    assert_eq!(
        eval(Op::Binary(BinaryOp::Gt), &[a, b]),
        vec![1.0, 0.0, 1.0, 1.0, 0.0]
    );
}

fn reduce_ref(x: &[f32], dims: &[usize], axes: &[usize], op: ReduceOp) -> Vec<f64> {
    let kept: Vec<usize> = (0..dims.len()).filter(|d| !axes.contains(d)).collect();
    let out_dims: Vec<usize> = kept.iter().map(|&d| dims[d]).collect();
    let n_out: usize = out_dims.iter().product();
    let count: usize = axes.iter().map(|&a| dims[a]).product();
    let mut acc = vec![
        if op == ReduceOp::Max {
            f64::NEG_INFINITY
        } else {
            0.0
        };
        n_out
    ];
    for (i, &v) in x.iter().enumerate() {
        let idx = unravel(i, dims);
        let o = kept.iter().fold(0, |o, &d| o * dims[d] + idx[d]);
        acc[o] = match op {
            ReduceOp::Max => acc[o].max(v as f64),
            _ => acc[o] + v as f64,
        };
    }
    if op == ReduceOp::Mean {
        acc.iter_mut().for_each(|a| *a /= count as f64);
    }
    acc
}

#[test]
fn reductions_over_every_axis_set() {
    let shapes: [&[usize]; 6] = [&[9], &[1, 33], &[3, 1, 7], &[2, 0, 3], &[4, 9, 2], &[17, 3]];
    for dims in shapes {
        let x = data(dims.iter().product(), 3);
        let rank = dims.len();
        for mask in 1u32..(1 << rank) {
            let axes: Vec<usize> = (0..rank).filter(|d| mask & (1 << d) != 0).collect();
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                if op == ReduceOp::Max && axes.iter().any(|&a| dims[a] == 0) {
                    continue; // refused at graph building (tested in rlx-ir)
                }
                for keepdims in [false, true] {
                    let r = Op::Reduce {
                        op,
                        axes: axes.clone(),
                        keepdims,
                    };
                    let got = eval(r, &[Value::F32(dims.to_vec(), x.clone())]);
                    let want = reduce_ref(&x, dims, &axes, op);
                    // Mean over an empty axis is 0/0 = NaN, as in numpy.
                    assert_close(
                        &got,
                        &want,
                        1e-5,
                        1e-5,
                        &format!("{op:?} {dims:?} {axes:?}"),
                    );
                }
            }
        }
    }
}

fn softmax_rows(x: &[f32], len: usize, log: bool) -> Vec<f64> {
    x.chunks(len.max(1))
        .flat_map(|r| {
            let m = r.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let z: f64 = r.iter().map(|&v| (v as f64 - m).exp()).sum();
            r.iter()
                .map(move |&v| {
                    if log {
                        v as f64 - m - z.ln()
                    } else {
                        (v as f64 - m).exp() / z
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn softmax_and_log_softmax_rows_of_every_tail_length() {
    for len in [1, 7, 8, 9, 17, 33] {
        let x: Vec<f32> = data(3 * len, 4).iter().map(|v| v * 8.0).collect();
        for log in [false, true] {
            let op = if log {
                Op::LogSoftmax { axis: 1 }
            } else {
                Op::Softmax { axis: 1 }
            };
            let got = eval(op, &[Value::F32(vec![3, len], x.clone())]);
            let want = softmax_rows(&x, len, log);
            assert_close(&got, &want, 1e-6, 1e-5, &format!("log={log} len={len}"));
        }
    }
    // Along a leading axis: the same as the rows of the transpose.
    let x = data(4 * 5, 5);
    let got = eval(
        Op::Softmax { axis: 0 },
        &[Value::F32(vec![4, 5], x.clone())],
    );
    let xt: Vec<f32> = (0..20).map(|i| x[(i % 4) * 5 + i / 4]).collect();
    let want_t = softmax_rows(&xt, 4, false);
    let want: Vec<f64> = (0..20).map(|i| want_t[(i % 5) * 4 + i / 5]).collect();
    assert_close(&got, &want, 1e-6, 1e-5, "softmax axis 0");
    // A row with -inf entries: they get probability 0.
    let got = eval(
        Op::Softmax { axis: 0 },
        &[Value::F32(vec![3], vec![f32::NEG_INFINITY, 0.0, 0.0])],
    );
    assert_eq!(got, vec![0.0, 0.5, 0.5]);
}

#[test]
fn cross_entropy_and_its_gradient() {
    for c in [1, 7, 9] {
        let logits = data(5 * c, 6);
        let labels: Vec<i32> = (0..5).map(|i| (i * 3 % c) as i32).collect();
        let lv = Value::F32(vec![5, c], logits.clone());
        let yv = Value::I32(vec![5], labels.clone());
        let got = eval(Op::SoftmaxCrossEntropy, &[lv.clone(), yv.clone()]);
        let logp = softmax_rows(&logits, c, true);
        let want: f64 = -(0..5)
            .map(|r| logp[r * c + labels[r] as usize])
            .sum::<f64>()
            / 5.0;
        assert_close(&got, &[want], 1e-6, 1e-5, &format!("cross_entropy c={c}"));
        let g = Value::F32(vec![], vec![2.0]);
        let got = eval(Op::SoftmaxCrossEntropyGrad, &[lv, yv, g]);
        let p = softmax_rows(&logits, c, false);
        let want: Vec<f64> = (0..5 * c)
            .map(|i| 2.0 * (p[i] - ((i % c) as i32 == labels[i / c]) as i32 as f64) / 5.0)
            .collect();
        assert_close(
            &got,
            &want,
            1e-6,
            1e-5,
            &format!("cross_entropy_grad c={c}"),
        );
    }
}

#[test]
fn normalize_rows_of_every_tail_length() {
    for width in [1, 7, 8, 9, 33] {
        let x = data(3 * width, 7);
        let got = eval(
            Op::Normalize { eps: 1e-5 },
            &[Value::F32(vec![3, width], x.clone())],
        );
        let want: Vec<f64> = x
            .chunks(width)
            .flat_map(|r| {
                let n = r.len() as f64;
                let m = r.iter().map(|&v| v as f64).sum::<f64>() / n;
                let var = r.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / n;
                r.iter()
                    .map(move |&v| (v as f64 - m) / (var + 1e-5).sqrt())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_close(&got, &want, 2e-5, 1e-5, &format!("normalize width={width}"));
    }
}

#[test]
fn matmul_odd_and_empty_sizes() {
    for (m, k, n) in [
        (1, 1, 1),
        (3, 7, 5),
        (9, 1, 2),
        (2, 0, 3),
        (0, 4, 3),
        (17, 9, 33),
    ] {
        let a = data(m * k, 8);
        let b = data(k * n, 9);
        let got = eval(
            Op::MatMul {
                trans_a: false,
                trans_b: false,
            },
            &[
                Value::F32(vec![m, k], a.clone()),
                Value::F32(vec![k, n], b.clone()),
            ],
        );
        let want: Vec<f64> = (0..m * n)
            .map(|i| {
                (0..k)
                    .map(|p| a[(i / n) * k + p] as f64 * b[p * n + i % n] as f64)
                    .sum()
            })
            .collect();
        assert_close(&got, &want, 1e-5, 1e-5, &format!("matmul {m}x{k}x{n}"));
    }
}

#[test]
fn layout_kernels() {
    let x = data(3 * 5 * 2, 10);
    let xv = Value::F32(vec![3, 5, 2], x.clone());
    let at = |i: usize, j: usize, l: usize| x[(i * 5 + j) * 2 + l] as f64;
    // transpose (2, 0, 1): out[l][i][j] = x[i][j][l]
    let got = eval(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        std::slice::from_ref(&xv),
    );
    let want: Vec<f64> = (0..30)
        .map(|o| {
            let (l, i, j) = (o / 15, (o / 5) % 3, o % 5);
            at(i, j, l)
        })
        .collect();
    assert_close(&got, &want, 0.0, 0.0, "transpose");
    // slice axis 1, [1, 4)
    let got = eval(
        Op::Slice {
            axis: 1,
            start: 1,
            end: 4,
        },
        std::slice::from_ref(&xv),
    );
    let want: Vec<f64> = (0..18).map(|o| at(o / 6, 1 + (o / 2) % 3, o % 2)).collect();
    assert_close(&got, &want, 0.0, 0.0, "slice");
    // pad axis 2 by (1, 2): width 5
    let got = eval(
        Op::Pad {
            axis: 2,
            before: 1,
            after: 2,
        },
        std::slice::from_ref(&xv),
    );
    let want: Vec<f64> = (0..75)
        .map(|o| {
            let (i, j, l) = (o / 25, (o / 5) % 5, o % 5);
            if (1..3).contains(&l) {
                at(i, j, l - 1)
            } else {
                0.0
            }
        })
        .collect();
    assert_close(&got, &want, 0.0, 0.0, "pad");
    // concat along axis 1 with a size-1 part and an empty part
    let y = data(3 * 2, 11);
    let got = eval(
        Op::Concat { axis: 1 },
        &[
            xv.clone(),
            Value::F32(vec![3, 1, 2], y[..6].to_vec()),
            Value::F32(vec![3, 0, 2], vec![]),
        ],
    );
    let want: Vec<f64> = (0..36)
        .map(|o| {
            let (i, j, l) = (o / 12, (o / 2) % 6, o % 2);
            if j < 5 {
                at(i, j, l)
            } else {
                y[i * 2 + l] as f64
            }
        })
        .collect();
    assert_close(&got, &want, 0.0, 0.0, "concat");
    // broadcast_to, and sum_to back
    let b = eval(
        Op::BroadcastTo {
            shape: Shape::new([2, 3, 5, 2]),
        },
        std::slice::from_ref(&xv),
    );
    let want: Vec<f64> = (0..60).map(|o| x[o % 30] as f64).collect();
    assert_close(&b, &want, 0.0, 0.0, "broadcast_to");
    let s = eval(
        Op::SumTo {
            shape: Shape::new([1, 5, 1]),
        },
        &[xv],
    );
    let want: Vec<f64> = (0..5)
        .map(|j| {
            (0..3)
                .flat_map(|i| (0..2).map(move |l| (i, l)))
                .map(|(i, l)| at(i, j, l))
                .sum()
        })
        .collect();
    assert_close(&s, &want, 1e-6, 1e-6, "sum_to");
}

#[test]
fn gather_scatter_where_cast() {
    let table = data(4 * 9, 12);
    let ids = vec![3, 0, 3, 2, 1];
    let got = eval(
        Op::Gather,
        &[
            Value::F32(vec![4, 9], table.clone()),
            Value::I32(vec![5], ids.clone()),
        ],
    );
    let want: Vec<f64> = (0..45)
        .map(|o| table[ids[o / 9] as usize * 9 + o % 9] as f64)
        .collect();
    assert_close(&got, &want, 0.0, 0.0, "gather");
    let g = data(5 * 9, 13);
    let got = eval(
        Op::ScatterAdd { rows: 4 },
        &[
            Value::I32(vec![5], ids.clone()),
            Value::F32(vec![5, 9], g.clone()),
        ],
    );
    let mut want = vec![0.0f64; 36];
    for (r, &id) in ids.iter().enumerate() {
        for c in 0..9 {
            want[id as usize * 9 + c] += g[r * 9 + c] as f64;
        }
    }
    assert_close(&got, &want, 1e-6, 1e-6, "scatter_add");
    // where(cond (3, 1), a (1, 7), b scalar)
    let cond = Value::F32(vec![3, 1], vec![1.0, 0.0, -2.0]);
    let a = data(7, 14);
    let got = eval(
        Op::Where,
        &[
            cond,
            Value::F32(vec![1, 7], a.clone()),
            Value::F32(vec![], vec![9.0]),
        ],
    );
    let want: Vec<f64> = (0..21)
        .map(|o| if o / 7 == 1 { 9.0 } else { a[o % 7] as f64 })
        .collect();
    assert_close(&got, &want, 0.0, 0.0, "where");
    let x = vec![1.7, -1.7, 0.2, 2.5e9];
    let got = eval(Op::Cast { to: DType::I32 }, &[Value::F32(vec![4], x)]);
    let ints: Vec<i32> = got.iter().map(|v| v.to_bits() as i32).collect();
    assert_eq!(
        ints,
        vec![1, -1, 0, i32::MAX],
        "float -> int truncates and saturates"
    );
}
