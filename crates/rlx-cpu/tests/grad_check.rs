//! Finite-difference gradient checks for every differentiable op, through the whole Rust stack:
//! graph -> autodiff -> lowering -> CPU backend. Each case builds `loss = sum(op(...) * w)` with a
//! fixed pseudo-random `w` and compares d loss / d input (every float input) with central
//! differences of the forward loss.
mod common;

use common::*;
use rlx_ir::{grad, BinaryOp, DType, Error, Graph, NodeId, Op, ReduceOp, Result, Shape, UnaryOp};

const H: f32 = 1e-2;

fn check(name: &str, values: &[Value], build: impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId>) {
    let mut g = Graph::new();
    let ids = inputs(&mut g, values);
    let y = build(&mut g, &ids).unwrap_or_else(|e| panic!("{name}: {e}"));
    let ys = g.node(y).shape.clone();
    let loss = if ys.rank() == 0 {
        y
    } else {
        let w = g.constant_f32(&data(ys.numel(), 7), ys.clone()).unwrap();
        let p = g.add(Op::Binary(BinaryOp::Mul), &[y, w]).unwrap();
        let all = (0..ys.rank()).collect();
        g.add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: all,
                keepdims: false,
            },
            &[p],
        )
        .unwrap()
    };
    let wrt: Vec<usize> = (0..values.len())
        .filter(|&i| values[i].dtype() == DType::F32)
        .collect();
    let wrt_ids: Vec<NodeId> = wrt.iter().map(|&i| ids[i]).collect();
    let bw = grad(&g, loss, &wrt_ids).unwrap_or_else(|e| panic!("{name}: {e}"));
    let grads = run(&compile(&bw), values, 1 + wrt.len());
    g.set_outputs(vec![loss]).unwrap();
    let fwd = compile(&g);
    let loss_at = |i: usize, j: usize, d: f32| {
        let mut v = values.to_vec();
        if let Value::F32(_, x) = &mut v[i] {
            x[j] += d;
        }
        run(&fwd, &v, 1)[0][0] as f64
    };
    for (k, &i) in wrt.iter().enumerate() {
        let n = values[i].shape().numel();
        let picks: Vec<usize> = if n <= 40 {
            (0..n).collect()
        } else {
            (0..40).map(|j| j * n / 40).collect()
        };
        for j in picks {
            let fd = (loss_at(i, j, H) - loss_at(i, j, -H)) / (2.0 * H as f64);
            let an = grads[1 + k][j] as f64;
            assert!(
                (fd - an).abs() <= 1e-2 + 1e-2 * an.abs().max(fd.abs()),
                "{name}: d loss / d a{i}[{j}]: autodiff {an}, finite differences {fd}"
            );
        }
    }
}

fn op1(op: Op) -> impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId> {
    move |g, ids| g.add(op.clone(), ids)
}

/// A float input with values in `[0.5, 1.4)` (for log, sqrt, fractional powers, divisors).
fn positive(shape: &[usize], seed: u64) -> Value {
    let n = shape.iter().product();
    Value::F32(
        shape.to_vec(),
        data(n, seed).iter().map(|v| v.abs() + 0.4).collect(),
    )
}

#[test]
fn unary_ops() {
    use UnaryOp::*;
    for u in [
        Neg,
        Relu,
        Tanh,
        Sigmoid,
        Exp,
        Gelu,
        GeluTanh,
        PowScalar(2.0),
        PowScalar(3.0),
    ] {
        check(&format!("{u:?}"), &[rand(&[3, 5], 1)], op1(Op::Unary(u)));
    }
    for u in [Log, Sqrt, PowScalar(0.5), PowScalar(-1.5)] {
        check(
            &format!("{u:?}"),
            &[positive(&[2, 7], 2)],
            op1(Op::Unary(u)),
        );
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    use BinaryOp::*;
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[3, 4], &[3, 4]),
        (&[2, 3, 4], &[3, 1]),
        (&[1], &[2, 3]),
        (&[4, 1], &[1, 5]),
    ];
    for (sa, sb) in shapes {
        for b in [Add, Sub, Mul] {
            check(
                &format!("{b:?} {sa:?} {sb:?}"),
                &[rand(sa, 3), rand(sb, 4)],
                op1(Op::Binary(b)),
            );
        }
        check(
            &format!("Div {sa:?} {sb:?}"),
            &[rand(sa, 3), positive(sb, 4)],
            op1(Op::Binary(Div)),
        );
        // a % b = a - b * floor(a / b): smooth away from the jumps at multiples of b.
        check(
            &format!("Mod {sa:?} {sb:?}"),
            &[rand(sa, 3), positive(sb, 4)],
            op1(Op::Binary(Mod)),
        );
    }
}

#[test]
fn comparisons_select_through_where() {
    // where(a < b, a, b) = min(a, b): the gradient flows to the smaller operand only.
    for cmp in [BinaryOp::Lt, BinaryOp::Ge, BinaryOp::Ne] {
        check(
            &format!("where {cmp:?}"),
            &[rand(&[3, 4], 5), rand(&[4], 6)],
            move |g, ids| {
                let c = g.add(Op::Binary(cmp), ids)?;
                g.add(Op::Where, &[c, ids[0], ids[1]])
            },
        );
    }
}

#[test]
fn matmul_all_transposes_and_batches() {
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let a = if ta { [4, 3] } else { [3, 4] };
        let b = if tb { [5, 4] } else { [4, 5] };
        let op = Op::MatMul {
            trans_a: ta,
            trans_b: tb,
        };
        check(
            &format!("matmul {ta} {tb}"),
            &[rand(&a, 7), rand(&b, 8)],
            op1(op),
        );
    }
    let mm = Op::MatMul {
        trans_a: false,
        trans_b: false,
    };
    check(
        "matmul batched x shared",
        &[rand(&[2, 3, 4], 9), rand(&[4, 2], 10)],
        op1(mm.clone()),
    );
    check(
        "matmul broadcast batches",
        &[rand(&[2, 1, 3, 4], 11), rand(&[3, 4, 2], 12)],
        op1(mm),
    );
}

#[test]
fn reductions() {
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
        for axes in [vec![0], vec![1], vec![2], vec![0, 2], vec![0, 1, 2]] {
            for keepdims in [false, true] {
                let r = Op::Reduce {
                    op,
                    axes: axes.clone(),
                    keepdims,
                };
                check(
                    &format!("{op:?} {axes:?} {keepdims}"),
                    &[rand(&[2, 3, 5], 13)],
                    op1(r),
                );
            }
        }
    }
}

#[test]
fn layout_ops() {
    let x = rand(&[2, 3, 4], 14);
    let cases: Vec<(&str, Value, Op)> = vec![
        (
            "broadcast_to",
            rand(&[3, 1], 15),
            Op::BroadcastTo {
                shape: Shape::new([2, 3, 4]),
            },
        ),
        (
            "sum_to",
            x.clone(),
            Op::SumTo {
                shape: Shape::new([3, 1]),
            },
        ),
        (
            "reshape",
            x.clone(),
            Op::Reshape {
                shape: Shape::new([4, 6]),
            },
        ),
        (
            "transpose",
            x.clone(),
            Op::Transpose {
                perm: vec![2, 0, 1],
            },
        ),
        (
            "slice",
            x.clone(),
            Op::Slice {
                axis: 2,
                start: 1,
                end: 3,
            },
        ),
        (
            "pad",
            x.clone(),
            Op::Pad {
                axis: 1,
                before: 2,
                after: 1,
            },
        ),
        ("cast", x, Op::Cast { to: DType::F32 }),
    ];
    for (name, v, op) in cases {
        check(name, &[v], op1(op));
    }
    check(
        "concat",
        &[rand(&[2, 3], 16), rand(&[2, 1], 17), rand(&[2, 2], 18)],
        op1(Op::Concat { axis: 1 }),
    );
    check(
        "concat axis 0",
        &[rand(&[1, 3], 19), rand(&[2, 3], 20)],
        op1(Op::Concat { axis: 0 }),
    );
    // A path through int32 carries no gradient: y = x + float(int(x)) has dy/dx = 1.
    // (Values in ±[0.05, 0.5): truncation gives 0 on both sides of every finite difference.)
    let half = Value::F32(vec![3, 4], data(12, 21).iter().map(|v| v * 0.5).collect());
    check("cast to int32 and back", &[half], |g, ids| {
        let i = g.add(Op::Cast { to: DType::I32 }, ids)?;
        let f = g.add(Op::Cast { to: DType::F32 }, &[i])?;
        g.add(Op::Binary(BinaryOp::Add), &[ids[0], f])
    });
}

#[test]
fn softmax_family_and_losses() {
    for axis in [0, 1] {
        check(
            &format!("softmax {axis}"),
            &[rand(&[3, 5], 22)],
            op1(Op::Softmax { axis }),
        );
        check(
            &format!("log_softmax {axis}"),
            &[rand(&[3, 5], 23)],
            op1(Op::LogSoftmax { axis }),
        );
    }
    check(
        "softmax middle axis",
        &[rand(&[2, 3, 4], 24)],
        op1(Op::Softmax { axis: 1 }),
    );
    check(
        "cross_entropy",
        &[rand(&[4, 5], 25), Value::I32(vec![4], vec![0, 4, 2, 2])],
        op1(Op::SoftmaxCrossEntropy),
    );
    check("mse", &[rand(&[3, 4], 26), rand(&[3, 4], 27)], op1(Op::Mse));
}

#[test]
fn embedding_and_normalization() {
    check(
        "gather (repeated ids)",
        &[
            rand(&[5, 3], 28),
            Value::I32(vec![2, 3], vec![4, 0, 4, 1, 1, 4]),
        ],
        op1(Op::Gather),
    );
    check(
        "scatter_add",
        &[Value::I32(vec![4], vec![2, 0, 2, 4]), rand(&[4, 3], 29)],
        op1(Op::ScatterAdd { rows: 5 }),
    );
    for width in [1, 7, 9] {
        check(
            &format!("normalize width {width}"),
            &[rand(&[3, width], 30)],
            op1(Op::Normalize { eps: 1e-5 }),
        );
    }
}

#[test]
fn second_derivatives_are_refused_clearly() {
    let mut g = Graph::new();
    let x = g.input("x", Shape::new([2, 3]), DType::F32).unwrap();
    let gy = g.input("gy", Shape::new([2, 3]), DType::F32).unwrap();
    let dx = g.add(Op::NormalizeGrad { eps: 1e-5 }, &[x, gy]).unwrap();
    let s = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![0, 1],
                keepdims: false,
            },
            &[dx],
        )
        .unwrap();
    match grad(&g, s, &[x]) {
        Err(Error::Unsupported { op, msg }) => {
            assert_eq!(op, "normalize_grad");
            assert!(msg.contains("second derivatives"), "{msg}");
        }
        other => panic!("expected an unsupported error, got {other:?}"),
    }
}

/// Distinct values 0.1 apart in a scrambled order (no near-ties for max pooling's argmax).
fn spread(shape: &[usize]) -> Value {
    let n: usize = shape.iter().product();
    Value::F32(
        shape.to_vec(),
        (0..n).map(|i| ((i * 37) % n) as f32 * 0.1 - 1.0).collect(),
    )
}

#[test]
fn vision_ops() {
    let w = |k: usize, s: usize, p: usize| rlx_ir::Window {
        kernel: [k, k],
        stride: [s, s],
        padding: [p, p],
    };
    // The last two on a 4 x 1 image: kernel taps that miss every column.
    for (k, s, p, [h, wd]) in [
        (3, 1, 1, [5, 6]),
        (3, 2, 1, [5, 6]),
        (2, 2, 0, [5, 6]),
        (1, 1, 0, [5, 6]),
        (5, 1, 2, [5, 6]),
        (5, 1, 2, [4, 1]),
        (5, 2, 2, [4, 1]),
    ] {
        let window = w(k, s, p);
        let [oh, ow] = window.out_size([h, wd]).unwrap();
        for k_major in [false, true] {
            check(
                &format!("im2col k{k} s{s} p{p} {h}x{wd} k_major={k_major}"),
                &[rand(&[2, 3, h, wd], 40)],
                op1(Op::Im2Col { window, k_major }),
            );
            let patches = if k_major {
                [2, 3 * k * k, oh * ow]
            } else {
                [2, oh * ow, 3 * k * k]
            };
            check(
                &format!("col2im k{k} s{s} p{p} {h}x{wd} k_major={k_major}"),
                &[rand(&patches, 41)],
                op1(Op::Col2Im {
                    window,
                    size: [h, wd],
                    k_major,
                }),
            );
        }
    }
    for (k, s, p) in [(2, 2, 0), (3, 2, 1), (3, 1, 1)] {
        for max in [true, false] {
            check(
                &format!("pool max={max} k{k} s{s} p{p}"),
                &[spread(&[2, 3, 5, 6])],
                op1(Op::Pool2d {
                    window: w(k, s, p),
                    max,
                }),
            );
        }
        let [oh, ow] = w(k, s, p).out_size([5, 6]).unwrap();
        check(
            &format!("avg pool grad k{k} s{s} p{p}"),
            &[rand(&[1, 2, 5, 6], 42), rand(&[1, 2, oh, ow], 43)],
            op1(Op::Pool2dGrad {
                window: w(k, s, p),
                max: false,
            }),
        );
    }
    check(
        "dropout",
        &[rand(&[4, 50], 44), Value::I32(vec![2], vec![3, 9])],
        op1(Op::Dropout { p: 0.3 }),
    );
    check("log1p", &[positive(&[3, 4], 45)], op1(Op::Log1p));
}

#[test]
fn stop_gradient_passes_values_and_no_gradient() {
    let mut g = Graph::new();
    let x = g.input("a0", Shape::new([3]), DType::F32).unwrap();
    let s = g.add(Op::StopGradient, &[x]).unwrap();
    let p = g.add(Op::Binary(BinaryOp::Mul), &[x, s]).unwrap();
    let loss = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![0],
                keepdims: false,
            },
            &[p],
        )
        .unwrap();
    let bw = grad(&g, loss, &[x]).unwrap();
    let v = Value::F32(vec![3], vec![1.0, -2.0, 3.0]);
    let out = run(&compile(&bw), &[v], 2);
    assert_eq!(out[0], vec![14.0]);
    assert_eq!(
        out[1],
        vec![1.0, -2.0, 3.0],
        "d/dx x * c = c: nothing flows through c"
    );
}
