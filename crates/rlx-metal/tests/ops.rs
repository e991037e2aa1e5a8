//! Every instruction kind the CPU backend runs, on the Metal backend over the host-emulated
//! device (MSL kernels compiled by the system C++ compiler), against the CPU backend's results
//! on the same graph and inputs; and the failures kernels flag (bad id, bad label, integer
//! division by zero), which must read as the CPU backend's errors. Skipped, with a message,
//! where there is no C++ compiler.
use rlx_ir::{BinaryOp, DType, Graph, NodeId, Op, ReduceOp, Shape, UnaryOp, Window};
use rlx_runtime::{Backend, Executable, Store};
use std::sync::{Arc, OnceLock};

fn metal() -> Option<Arc<dyn Backend>> {
    static DEV: OnceLock<Option<rlx_metal::MetalDevice>> = OnceLock::new();
    let dev = DEV.get_or_init(|| {
        rlx_metal::host::cxx()?;
        Some(rlx_metal::MetalDevice::host().expect("host-emulated Metal device"))
    });
    match dev {
        Some(d) => Some(Arc::new(rlx_metal::MetalBackend::new(
            d.clone(),
            rlx_cpu::host_update,
        ))),
        None => {
            eprintln!("SKIPPED: no C++ compiler to build the MSL kernels for the host");
            None
        }
    }
}

/// An input: name, dims, and float32 or int32 values.
enum Data {
    F(Vec<f32>),
    I(Vec<i32>),
}

struct Case {
    inputs: Vec<(&'static str, Vec<usize>, Data)>,
}

fn floats(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(7);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

impl Case {
    fn new() -> Case {
        Case { inputs: Vec::new() }
    }
    fn f(mut self, name: &'static str, dims: &[usize]) -> Case {
        let n = dims.iter().product();
        let seed = self.inputs.len() as u32 * 31 + n as u32;
        self.inputs
            .push((name, dims.to_vec(), Data::F(floats(n, seed))));
        self
    }
    fn i(mut self, name: &'static str, dims: &[usize], v: Vec<i32>) -> Case {
        self.inputs.push((name, dims.to_vec(), Data::I(v)));
        self
    }

    /// Builds the graph with `body` (given the input nodes), runs it on `backend`.
    fn run_on(
        &self,
        backend: Arc<dyn Backend>,
        body: &dyn Fn(&mut Graph, &[NodeId]) -> Vec<NodeId>,
    ) -> rlx_ir::Result<Vec<Vec<u8>>> {
        let mut g = Graph::new();
        let mut ids = Vec::new();
        for (name, dims, d) in &self.inputs {
            let dt = match d {
                Data::F(_) => DType::F32,
                Data::I(_) => DType::I32,
            };
            ids.push(g.input(name, Shape::new(dims.clone()), dt)?);
        }
        let outs = body(&mut g, &ids);
        let n = outs.len();
        g.set_outputs(outs)?;
        let params = Arc::new(Store::new(backend.as_ref(), &[])?);
        let exe = Executable::new(backend, &g, params, None)?;
        let bytes: Vec<(&str, Vec<u8>)> = self
            .inputs
            .iter()
            .map(|(name, _, d)| {
                let b = match d {
                    Data::F(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    Data::I(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                };
                (*name, b)
            })
            .collect();
        // Only the inputs the outputs depend on are the function's.
        let used = exe.input_names();
        let feeds: Vec<(&str, &[u8])> = bytes
            .iter()
            .filter(|(n, _)| used.iter().any(|u| u == n))
            .map(|(n, b)| (*n, b.as_slice()))
            .collect();
        let read: Vec<usize> = (0..n).collect();
        exe.run(&feeds, None, &read)
    }

    /// Runs on both backends; float outputs must agree within float32 tolerance, int outputs
    /// exactly (`ints` lists the int32 outputs).
    fn check(
        &self,
        what: &str,
        ints: &[usize],
        body: impl Fn(&mut Graph, &[NodeId]) -> Vec<NodeId>,
    ) {
        let Some(m) = metal() else { return };
        let want = self
            .run_on(Arc::new(rlx_cpu::CpuBackend), &body)
            .unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
        let got = self
            .run_on(m, &body)
            .unwrap_or_else(|e| panic!("{what} on metal: {e}"));
        assert_eq!(got.len(), want.len(), "{what}: outputs");
        for (o, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "{what}: output {o} bytes");
            for (i, (gc, wc)) in g.chunks(4).zip(w.chunks(4)).enumerate() {
                let b = |c: &[u8]| [c[0], c[1], c[2], c[3]];
                if ints.contains(&o) {
                    let (gv, wv) = (i32::from_le_bytes(b(gc)), i32::from_le_bytes(b(wc)));
                    assert_eq!(gv, wv, "{what}: output {o}[{i}]");
                } else {
                    let (gv, wv) = (f32::from_le_bytes(b(gc)), f32::from_le_bytes(b(wc)));
                    let ok = (gv.is_nan() && wv.is_nan())
                        || gv == wv
                        || (gv - wv).abs() <= 1e-5 + 2e-5 * wv.abs();
                    assert!(ok, "{what}: output {o}[{i}]: metal {gv}, cpu {wv}");
                }
            }
        }
        assert!(
            want.iter().flatten().any(|&b| b != 0),
            "{what}: every output is all zero (the comparison proves nothing)"
        );
    }

    /// Both backends fail, with the same message.
    fn check_error(
        &self,
        what: &str,
        body: impl Fn(&mut Graph, &[NodeId]) -> Vec<NodeId>,
    ) -> String {
        let Some(m) = metal() else {
            return String::new();
        };
        let want = self
            .run_on(Arc::new(rlx_cpu::CpuBackend), &body)
            .err()
            .unwrap_or_else(|| panic!("{what}: the cpu run succeeded"));
        let got = self
            .run_on(m, &body)
            .err()
            .unwrap_or_else(|| panic!("{what}: the metal run succeeded"));
        assert_eq!(got.to_string(), want.to_string(), "{what}");
        got.to_string()
    }
}

fn op(g: &mut Graph, op: Op, ins: &[NodeId]) -> NodeId {
    g.add(op, ins).unwrap()
}

#[test]
fn unary_and_binary_with_broadcasting() {
    let c = Case::new().f("a", &[3, 4, 5]).f("b", &[4, 1]).f("s", &[]);
    use UnaryOp as U;
    for u in [
        U::Neg,
        U::Relu,
        U::Tanh,
        U::Sigmoid,
        U::Exp,
        U::Gelu,
        U::GeluTanh,
        U::GeluDeriv,
        U::GeluTanhDeriv,
        U::PowScalar(2.0),
        U::PowScalar(3.0),
        U::PowScalar(-1.5),
    ] {
        c.check(&format!("{u:?}"), &[], |g, x| {
            vec![op(g, Op::Unary(u), &[x[0]])]
        });
    }
    // log and sqrt of positive values
    c.check("log/sqrt", &[], |g, x| {
        let e = op(g, Op::Unary(U::Exp), &[x[0]]);
        vec![
            op(g, Op::Unary(U::Log), &[e]),
            op(g, Op::Unary(U::Sqrt), &[e]),
        ]
    });
    use BinaryOp as B;
    for b in [
        B::Add,
        B::Sub,
        B::Mul,
        B::Div,
        B::FloorDiv,
        B::Mod,
        B::Lt,
        B::Le,
        B::Gt,
        B::Ge,
        B::Eq,
        B::Ne,
    ] {
        c.check(&format!("{b:?}"), &[], |g, x| {
            vec![
                op(g, Op::Binary(b), &[x[0], x[1]]),
                op(g, Op::Binary(b), &[x[2], x[0]]),
                op(g, Op::Binary(b), &[x[1], x[1]]),
            ]
        });
    }
    c.check("log1p/stop_gradient", &[], |g, x| {
        let e = op(g, Op::Unary(U::Exp), &[x[0]]);
        vec![op(g, Op::Log1p, &[e]), op(g, Op::StopGradient, &[x[0]])]
    });
}

#[test]
fn int32_arithmetic_comparisons_casts_and_where() {
    let a: Vec<i32> = (0..12).map(|i| i * 7 - 40).collect();
    let b: Vec<i32> = vec![3, -5, 5, 7];
    let c = Case::new()
        .i("a", &[3, 4], a)
        .i("b", &[4], b)
        .f("x", &[3, 4])
        .f("y", &[4]);
    use BinaryOp as B;
    for bop in [B::Add, B::Sub, B::Mul, B::FloorDiv, B::Mod] {
        c.check(&format!("int {bop:?}"), &[0], |g, x| {
            vec![op(g, Op::Binary(bop), &[x[0], x[1]])]
        });
    }
    for bop in [B::Div, B::Lt, B::Le, B::Gt, B::Ge, B::Eq, B::Ne] {
        c.check(&format!("int {bop:?}"), &[], |g, x| {
            vec![op(g, Op::Binary(bop), &[x[0], x[1]])]
        });
    }
    c.check("casts", &[0], |g, x| {
        let s = op(g, Op::Binary(B::Mul), &[x[2], x[2]]);
        vec![
            op(g, Op::Cast { to: DType::I32 }, &[s]),
            op(g, Op::Cast { to: DType::F32 }, &[x[0]]),
        ]
    });
    c.check("where", &[1], |g, x| {
        let cond = op(g, Op::Binary(B::Gt), &[x[2], x[3]]);
        vec![
            op(g, Op::Where, &[cond, x[2], x[3]]),
            op(g, Op::Where, &[x[1], x[0], x[1]]),
        ]
    });
    let zero = Case::new()
        .i("a", &[4], vec![1, 2, 3, 4])
        .i("b", &[4], vec![1, 0, 2, 2]);
    let msg = zero.check_error("floor_divide by zero", |g, x| {
        vec![op(g, Op::Binary(B::FloorDiv), &[x[0], x[1]])]
    });
    assert!(msg.is_empty() || msg.contains("division by zero"), "{msg}");
}

#[test]
fn layout_ops() {
    let c = Case::new()
        .f("a", &[2, 3, 4])
        .f("b", &[2, 2, 4])
        .i("k", &[2, 3], (0..6).collect());
    c.check("transpose", &[1], |g, x| {
        vec![
            op(
                g,
                Op::Transpose {
                    perm: vec![2, 0, 1],
                },
                &[x[0]],
            ),
            op(g, Op::Transpose { perm: vec![1, 0] }, &[x[2]]),
        ]
    });
    c.check("broadcast", &[], |g, x| {
        vec![op(
            g,
            Op::BroadcastTo {
                shape: Shape::new([5, 2, 3, 4]),
            },
            &[x[0]],
        )]
    });
    c.check("slice/pad/concat", &[], |g, x| {
        vec![
            op(
                g,
                Op::Slice {
                    axis: 1,
                    start: 1,
                    end: 3,
                },
                &[x[0]],
            ),
            op(
                g,
                Op::Pad {
                    axis: 2,
                    before: 2,
                    after: 1,
                },
                &[x[0]],
            ),
            op(g, Op::Concat { axis: 1 }, &[x[0], x[1]]),
        ]
    });
}

#[test]
fn reductions_softmax_and_losses() {
    let c = Case::new().f("a", &[3, 70, 5]).f("t", &[3, 70, 5]);
    for r in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
        for axes in [vec![0], vec![1], vec![2], vec![0, 2], vec![0, 1]] {
            c.check(&format!("{r:?} {axes:?}"), &[], |g, x| {
                vec![op(
                    g,
                    Op::Reduce {
                        op: r,
                        axes: axes.clone(),
                        keepdims: false,
                    },
                    &[x[0]],
                )]
            });
        }
    }
    c.check("sum_to", &[], |g, x| {
        vec![op(
            g,
            Op::SumTo {
                shape: Shape::new([70, 1]),
            },
            &[x[0]],
        )]
    });
    for axis in [0, 1, 2] {
        c.check(&format!("softmax {axis}"), &[], |g, x| {
            vec![
                op(g, Op::Softmax { axis }, &[x[0]]),
                op(g, Op::LogSoftmax { axis }, &[x[0]]),
            ]
        });
    }
    c.check("mse", &[], |g, x| vec![op(g, Op::Mse, &[x[0], x[1]])]);
    let labels = vec![3, -100, 0, 9, 4, 1];
    let ce = Case::new()
        .f("z", &[6, 10])
        .i("y", &[6], labels)
        .f("g", &[]);
    ce.check("cross_entropy", &[], |g, x| {
        vec![
            op(g, Op::SoftmaxCrossEntropy, &[x[0], x[1]]),
            op(g, Op::SoftmaxCrossEntropyGrad, &[x[0], x[1], x[2]]),
        ]
    });
    let bad = Case::new().f("z", &[2, 10]).i("y", &[2], vec![3, 10]);
    let msg = bad.check_error("bad label", |g, x| {
        vec![op(g, Op::SoftmaxCrossEntropy, &[x[0], x[1]])]
    });
    assert!(msg.is_empty() || msg.contains("label 10"), "{msg}");
}

#[test]
fn embedding_gather_scatter_and_normalization() {
    let ids = vec![4, 0, 4, 2, 1, 4];
    let c = Case::new()
        .f("w", &[5, 8])
        .i("ids", &[6], ids)
        .f("d", &[6, 8]);
    c.check("gather/scatter_add", &[], |g, x| {
        vec![
            op(g, Op::Gather, &[x[0], x[1]]),
            op(g, Op::ScatterAdd { rows: 5 }, &[x[1], x[2]]),
        ]
    });
    let bad = Case::new().f("w", &[5, 8]).i("ids", &[2], vec![1, 5]);
    let msg = bad.check_error("bad id", |g, x| vec![op(g, Op::Gather, &[x[0], x[1]])]);
    assert!(msg.is_empty() || msg.contains("id 5"), "{msg}");
    let n = Case::new()
        .f("x", &[4, 3, 16])
        .f("g", &[4, 3, 16])
        .f("acc", &[4, 3, 16]);
    n.check("normalize", &[], |g, x| {
        vec![
            op(g, Op::Normalize { eps: 1e-5 }, &[x[0]]),
            op(g, Op::NormalizeGrad { eps: 1e-5 }, &[x[0], x[1]]),
            op(g, Op::NormalizeGradAdd { eps: 1e-5 }, &[x[0], x[1], x[2]]),
        ]
    });
}

#[test]
fn matmuls_attention_and_convolution_windows() {
    let c = Case::new()
        .f("a", &[2, 3, 5, 4])
        .f("b", &[3, 4, 6])
        .f("c", &[4, 6]);
    c.check("matmul broadcast", &[], |g, x| {
        vec![
            op(
                g,
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                &[x[0], x[1]],
            ),
            op(
                g,
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                &[x[0], x[2]],
            ),
            op(
                g,
                Op::MatMul {
                    trans_a: true,
                    trans_b: false,
                },
                &[x[0], x[0]],
            ),
        ]
    });
    let att = Case::new()
        .f("q", &[2, 5, 8])
        .f("k", &[2, 7, 8])
        .f("v", &[2, 7, 6])
        .f("go", &[2, 5, 6]);
    for causal in [None, Some(2)] {
        att.check(&format!("attention causal {causal:?}"), &[], |g, x| {
            let at = Op::Attention {
                scale: 0.35,
                causal,
                heads: None,
                lowp: None,
            };
            let o = op(g, at, &[x[0], x[1], x[2]]);
            let gr = Op::AttentionGrad {
                scale: 0.35,
                causal,
                heads: None,
                lowp: None,
            };
            vec![o, op(g, gr, &[x[0], x[1], x[2], o, x[3]])]
        });
    }
    let packed = Case::new().f("qkv", &[2, 5, 24]).f("go", &[2, 5, 8]);
    packed.check("packed attention", &[], |g, x| {
        let at = Op::Attention {
            scale: 0.5,
            causal: Some(0),
            heads: Some(2),
            lowp: None,
        };
        let o = op(g, at, &[x[0]]);
        let gr = Op::AttentionGrad {
            scale: 0.5,
            causal: Some(0),
            heads: Some(2),
            lowp: None,
        };
        vec![o, op(g, gr, &[x[0], o, x[1]])]
    });
    let w = Window {
        kernel: [3, 2],
        stride: [2, 1],
        padding: [1, 1],
    };
    let img = Case::new().f("x", &[2, 3, 7, 6]);
    img.check("im2col/col2im/pool", &[], |g, x| {
        // Patches in both layouts, each summed back into the image.
        let mut outs = Vec::new();
        for k_major in [false, true] {
            let cols = op(g, Op::Im2Col { window: w, k_major }, &[x[0]]);
            let size = [7, 6];
            let back = op(
                g,
                Op::Col2Im {
                    window: w,
                    size,
                    k_major,
                },
                &[cols],
            );
            outs.extend([cols, back]);
        }
        let mx = op(
            g,
            Op::Pool2d {
                window: w,
                max: true,
            },
            &[x[0]],
        );
        let avg = op(
            g,
            Op::Pool2d {
                window: w,
                max: false,
            },
            &[x[0]],
        );
        let gmx = op(
            g,
            Op::Pool2dGrad {
                window: w,
                max: true,
            },
            &[x[0], mx],
        );
        let gavg = op(
            g,
            Op::Pool2dGrad {
                window: w,
                max: false,
            },
            &[x[0], avg],
        );
        outs.extend([mx, avg, gmx, gavg]);
        outs
    });
}
