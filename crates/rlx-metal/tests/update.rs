//! The training update and the matrix engine on the Metal backend over the host-emulated device,
//! against the CPU backend: every optimizer rule as the device-side multi-tensor kernel
//! (`UpdateMode::Kernel`) and on the host (`UpdateMode::Host`), over parameters of odd sizes
//! (one spanning two chunks of the update table), for several steps with changing
//! hyper-parameters; clipping, accumulation and skipped non-finite steps; and a small MLP whose
//! matmuls (the first with its bias + tanh epilogue) run on the engine (`MatmulPolicy::ALL`: the host runs each through the GEMM kernel
//! rebuilt from its key) or on the MSL kernel. Skipped, with a message, where there is no C++
//! compiler.
use rlx_ir::{BinaryOp, DType, Graph, NodeId, Op, ReduceOp, Shape, UnaryOp};
use rlx_metal::matmul::{Activation, Epilogue, MatmulPolicy};
use rlx_metal::{MetalBackend, MetalDevice, MetalOptions, UpdateMode};
use rlx_runtime::{Backend, Executable, OptimHyper, OptimRule, OptimizerSetup, Store};
use std::sync::{Arc, OnceLock};

fn device() -> Option<MetalDevice> {
    static DEV: OnceLock<Option<MetalDevice>> = OnceLock::new();
    let dev = DEV.get_or_init(|| {
        rlx_metal::host::cxx()?;
        Some(MetalDevice::host().expect("host-emulated Metal device"))
    });
    if dev.is_none() {
        eprintln!("SKIPPED: no C++ compiler to build the MSL kernels for the host");
    }
    dev.clone()
}

fn metal(dev: &MetalDevice, update: UpdateMode, matmul: MatmulPolicy) -> Arc<dyn Backend> {
    Arc::new(MetalBackend::with_options(
        dev.clone(),
        rlx_cpu::host_update,
        MetalOptions {
            matmul,
            attention: matmul,
            update,
        },
    ))
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(99);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i} is {g}, the CPU backend has {w}"
        );
    }
}

/// Parameter sizes: odd, a 2-D one, and one spanning two chunks of the update table.
const SIZES: &[&[usize]] = &[&[1], &[3], &[5, 7], &[16_390]];

/// loss = sum_i sum(w_i * w_i * x_i): gradients 2 w_i x_i (each element its own).
fn quadratic(backend: &Arc<dyn Backend>, spec: &str, rule: OptimRule) -> (Executable, Arc<Store>) {
    let mut g = Graph::new();
    let mut loss: Option<NodeId> = None;
    let mut ws = Vec::new();
    let mut specs = Vec::new();
    for (i, dims) in SIZES.iter().enumerate() {
        let shape = Shape::new(dims.to_vec());
        let x = g
            .input(&format!("x{i}"), shape.clone(), DType::F32)
            .unwrap();
        let w = g
            .param(&format!("w{i}"), shape.clone(), DType::F32)
            .unwrap();
        let ww = g.add(Op::Binary(BinaryOp::Mul), &[w, w]).unwrap();
        let wwx = g.add(Op::Binary(BinaryOp::Mul), &[ww, x]).unwrap();
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            axes: (0..dims.len()).collect(),
            keepdims: false,
        };
        let s = g.add(sum, &[wwx]).unwrap();
        loss = Some(match loss {
            None => s,
            Some(l) => g.add(Op::Binary(BinaryOp::Add), &[l, s]).unwrap(),
        });
        ws.push(w);
        specs.push((format!("w{i}"), shape, DType::F32));
    }
    let bw = rlx_ir::grad(&g, loss.unwrap(), &ws).unwrap();
    let params = Arc::new(Store::new(backend.as_ref(), &specs).unwrap());
    for (i, dims) in SIZES.iter().enumerate() {
        let n: usize = dims.iter().product();
        let w0: Vec<f32> = data(n, 10 + i as u32).iter().map(|v| v + 0.1).collect();
        params.write(&format!("w{i}"), &f32s(&w0)).unwrap();
    }
    let state = Arc::new(Store::for_optimizer(backend.as_ref(), rule, &params, false).unwrap());
    let opt = OptimizerSetup::parse(spec, state).unwrap();
    let exe = Executable::new(backend.clone(), &bw, params.clone(), Some(opt)).unwrap();
    (exe, params)
}

/// Runs `steps` steps (lr and momentum change every step: nothing is frozen at compile) and
/// returns the parameters and the statistics after each.
fn train(
    backend: &Arc<dyn Backend>,
    spec: &str,
    rule: OptimRule,
    momentum: f32,
    feeds: &dyn Fn(usize) -> Vec<(String, Vec<f32>)>,
    steps: usize,
) -> Vec<(Vec<Vec<f32>>, Vec<f32>)> {
    let (exe, params) = quadratic(backend, spec, rule);
    let stats_at = exe.outputs().len() - 1;
    (0..steps)
        .map(|t| {
            let h = OptimHyper {
                lr: 0.05 / (1.0 + t as f32),
                momentum,
                weight_decay: 0.01,
                beta1: 0.85,
                beta2: 0.99,
                eps: 1e-6,
            };
            let owned = feeds(t);
            let f: Vec<(&str, &[u8])> = Vec::new();
            let bytes: Vec<(String, Vec<u8>)> =
                owned.iter().map(|(n, v)| (n.clone(), f32s(v))).collect();
            let mut f = f;
            for (n, b) in &bytes {
                f.push((n.as_str(), b.as_slice()));
            }
            let out = exe.run(&f, Some(&h), &[stats_at]).unwrap();
            let ps = (0..SIZES.len())
                .map(|i| floats(&params.read(&format!("w{i}")).unwrap()))
                .collect();
            (ps, floats(&out[0]))
        })
        .collect()
}

fn inputs(t: usize) -> Vec<(String, Vec<f32>)> {
    SIZES
        .iter()
        .enumerate()
        .map(|(i, dims)| {
            let n: usize = dims.iter().product();
            (format!("x{i}"), data(n, 100 * t as u32 + i as u32))
        })
        .collect()
}

fn compare(
    spec: &str,
    rule: OptimRule,
    momentum: f32,
    feeds: &dyn Fn(usize) -> Vec<(String, Vec<f32>)>,
) {
    let Some(dev) = device() else { return };
    let cpu: Arc<dyn Backend> = Arc::new(rlx_cpu::CpuBackend);
    let want = train(&cpu, spec, rule, momentum, feeds, 4);
    for mode in [UpdateMode::Kernel, UpdateMode::Host] {
        let got = train(
            &metal(&dev, mode, MatmulPolicy::default()),
            spec,
            rule,
            momentum,
            feeds,
            4,
        );
        for (t, ((gp, gs), (wp, ws))) in got.iter().zip(&want).enumerate() {
            for (i, (g, w)) in gp.iter().zip(wp).enumerate() {
                close(g, w, 2e-5, &format!("{spec} ({mode:?}) step {t} w{i}"));
            }
            // statistics: norm (NaN when not computed), skipped, micro-step, updated
            assert_eq!(gs[1..], ws[1..], "{spec} ({mode:?}) step {t} stats");
            if ws[0].is_nan() {
                assert!(gs[0].is_nan(), "{spec} ({mode:?}) step {t} norm {}", gs[0]);
            } else {
                close(&gs[..1], &ws[..1], 1e-5, &format!("{spec} ({mode:?}) norm"));
            }
        }
    }
}

#[test]
fn sgd_with_and_without_momentum_matches_the_cpu() {
    compare("sgd", OptimRule::Sgd, 0.0, &inputs);
    compare("sgd", OptimRule::Sgd, 0.9, &inputs);
}

#[test]
fn adam_and_adamw_match_the_cpu() {
    compare("adam", OptimRule::Adam, 0.0, &inputs);
    compare("adamw", OptimRule::AdamW, 0.0, &inputs);
}

#[test]
fn rmsprop_and_adagrad_match_the_cpu() {
    compare("rmsprop", OptimRule::RmsProp, 0.0, &inputs);
    compare("rmsprop", OptimRule::RmsProp, 0.5, &inputs);
    compare("adagrad", OptimRule::Adagrad, 0.0, &inputs);
}

#[test]
fn clipping_accumulation_and_skipped_steps_match_the_cpu() {
    compare(
        r#"{"rule": "adam", "clip": 0.5, "accumulate": 2}"#,
        OptimRule::Adam,
        0.0,
        &inputs,
    );
    // step 1's inputs hold a NaN (the loss and the gradient are NaN: the step is skipped)
    let nan_at_1 = |t: usize| {
        let mut f = inputs(t);
        if t == 1 {
            f[3].1[16_389] = f32::NAN;
        }
        f
    };
    compare(
        r#"{"rule": "sgd", "clip": 0.25, "skip_nonfinite": true}"#,
        OptimRule::Sgd,
        0.9,
        &nan_at_1,
    );
    // huge but finite gradients: the norm (about 1e30) overflows no float sum of squares
    let huge = |t: usize| {
        let mut f = inputs(t);
        f[2].1[4] = 1e30;
        f
    };
    compare(
        r#"{"rule": "sgd", "clip": 1.0, "skip_nonfinite": true}"#,
        OptimRule::Sgd,
        0.0,
        &huge,
    );
}

/// Values in [-0.5, 0.5): keeps the MLP's cubic products well-conditioned.
fn small(n: usize, seed: u32) -> Vec<f32> {
    data(n, seed).iter().map(|v| v * 0.5).collect()
}

/// A two-layer MLP step (forward and backward matmuls in every transpose combination, a
/// batched matmul) on the engine and on the MSL kernel, against the CPU backend.
#[test]
fn mlp_training_on_the_matrix_engine_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let build = |backend: &Arc<dyn Backend>| {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([2, 6, 10]), DType::F32).unwrap();
        let w1 = g.param("w1", Shape::new([10, 12]), DType::F32).unwrap();
        let w2 = g.param("w2", Shape::new([12, 4]), DType::F32).unwrap();
        let b1 = g.param("b1", Shape::new([12]), DType::F32).unwrap();
        let mm = Op::MatMul {
            trans_a: false,
            trans_b: false,
        };
        let h = g.add(mm.clone(), &[x, w1]).unwrap();
        let h = g.add(Op::Binary(BinaryOp::Add), &[h, b1]).unwrap();
        let h = g.add(Op::Unary(UnaryOp::Tanh), &[h]).unwrap();
        // a batched product of activations with themselves: h @ h^T per batch
        let hh = g
            .add(
                Op::MatMul {
                    trans_a: false,
                    trans_b: true,
                },
                &[h, h],
            )
            .unwrap();
        let h2 = g.add(mm.clone(), &[hh, h]).unwrap();
        let y = g.add(mm, &[h2, w2]).unwrap();
        let yy = g.add(Op::Binary(BinaryOp::Mul), &[y, y]).unwrap();
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![0, 1, 2],
            keepdims: false,
        };
        let loss = g.add(sum, &[yy]).unwrap();
        let bw = rlx_ir::grad(&g, loss, &[w1, w2, b1]).unwrap();
        let specs = [
            ("w1".to_string(), Shape::new([10, 12]), DType::F32),
            ("w2".to_string(), Shape::new([12, 4]), DType::F32),
            ("b1".to_string(), Shape::new([12]), DType::F32),
        ];
        let params = Arc::new(Store::new(backend.as_ref(), &specs).unwrap());
        params.write("w1", &f32s(&small(120, 1))).unwrap();
        params.write("w2", &f32s(&small(48, 2))).unwrap();
        params.write("b1", &f32s(&small(12, 3))).unwrap();
        let state = Arc::new(
            Store::for_optimizer(backend.as_ref(), OptimRule::Sgd, &params, false).unwrap(),
        );
        let opt = OptimizerSetup::new(OptimRule::Sgd, state);
        let exe = Executable::new(backend.clone(), &bw, params.clone(), Some(opt)).unwrap();
        let h = OptimHyper {
            lr: 1e-3,
            momentum: 0.0,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let mut out = Vec::new();
        for t in 0..3 {
            let r = exe
                .run(&[("x", &f32s(&small(120, 7 + t)))], Some(&h), &[0])
                .unwrap();
            out.push(floats(&r[0]));
            out.push(floats(&params.read("w1").unwrap()));
            out.push(floats(&params.read("w2").unwrap()));
            out.push(floats(&params.read("b1").unwrap()));
        }
        out
    };
    let cpu: Arc<dyn Backend> = Arc::new(rlx_cpu::CpuBackend);
    let want = build(&cpu);
    let before = dev.matmuls_compiled();
    for policy in [MatmulPolicy::ALL, MatmulPolicy::OFF] {
        let got = build(&metal(&dev, UpdateMode::Kernel, policy));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            close(g, w, 1e-4, &format!("{policy:?} output {i}"));
        }
    }
    // the engine compiled executables (once per shape key; the second policy compiled none),
    // the forward one with the fused bias + tanh epilogue
    assert!(dev.matmuls_compiled() > before);
    let fused = Epilogue {
        bias: true,
        act: Some(Activation::Tanh),
    };
    assert!(
        dev.matmul_keys().iter().any(|k| k.epilogue == fused),
        "{:?}",
        dev.matmul_keys()
    );
}
