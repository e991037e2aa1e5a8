//! The conformance suite every backend runs: each check takes the backend and panics with a
//! message on failure. A backend's test file instantiates every check as its own `#[test]` with
//! [`conformance_tests!`](crate::conformance_tests) (see `rlx-cpu/tests/conformance.rs`).
use crate::{
    Backend, CopyDst, CopySrc, Executable, HostBytes, OptimHyper, OptimRule, OptimizerSetup, Store,
};
use crate::{Buf, Instr, Program, TRef};
use rlx_ir::{BinaryOp, DType, Graph, Op, ReduceOp, Shape, UnaryOp};
use std::sync::Arc;

pub use crate::conformance_vision::vision_ops_match_references;

pub(crate) fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(crate) fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `got` equals the float64 reference `want` within float32 tolerance (NaN where it is NaN).
pub(crate) fn close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || (*g as f64 - w).abs() <= 1e-5 + 1e-4 * w.abs();
        assert!(ok, "{what}[{i}]: got {g}, want {w}");
    }
}

/// [`close`] within `tol` (absolute and relative), for results computed in a lower precision.
fn close_within(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || (*g as f64 - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "{what}[{i}]: got {g}, want {w}");
    }
}

/// Defines one `#[test]` per conformance check, each on a backend made by `$make` (an expression
/// of type `Arc<dyn Backend>`, evaluated once per test). Use it once per backend, in a module of
/// its own when one test file covers several:
///
/// ```text
/// mod cpu {
///     rlx_runtime::conformance_tests!(std::sync::Arc::new(rlx_cpu::CpuBackend));
/// }
/// ```
#[macro_export]
macro_rules! conformance_tests {
    // The one list of checks, for both forms below.
    (@list $form:tt $make:expr) => {
        $crate::conformance_tests!($form $make;
            linear_softmax_training_step,
            training_step_options,
            resident_inputs,
            bad_feeds_change_nothing,
            copy_engine_contract,
            prefetch_consumes_batches_in_order,
            optimizer_rules_match_closed_form,
            compile_rejects_bad_programs,
            data_parallel_phases,
            vision_ops_match_references,
            fused_instructions_match_reference,
            mixed_precision_matches_reference,
            int64_and_bool_programs_match_reference,
        );
    };
    (maybe $make:expr; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                let made: ::std::result::Result<::std::sync::Arc<dyn $crate::Backend>, String> =
                    $make;
                match made {
                    Ok(backend) => $crate::conformance::$check(&backend),
                    Err(why) => eprintln!("SKIPPED {}: {why}", stringify!($check)),
                }
            }
        )*
    };
    (each $make:expr; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                let backend: ::std::sync::Arc<dyn $crate::Backend> = $make;
                $crate::conformance::$check(&backend);
            }
        )*
    };
    // For backends that may be absent: `$make` gives `Result<Arc<dyn Backend>, String>`, and
    // where it is `Err(why)` each test prints that it was skipped and why (CUDA, Metal).
    (skip_unless: $make:expr) => {
        $crate::conformance_tests!(@list maybe $make);
    };
    ($make:expr) => {
        $crate::conformance_tests!(@list each $make);
    };
}

/// FIFO completion, tokens covering earlier copies, idempotent waits, bounds checked at issue.
pub fn copy_engine_contract(backend: &Arc<dyn Backend>) {
    let engine = backend.copy_engine().unwrap();
    let dst = backend.alloc(64 * 16).unwrap();
    let mut tokens = Vec::new();
    for i in 0..16u8 {
        let src: Arc<dyn HostBytes> = Arc::new(vec![i; 64]);
        tokens.push(
            engine
                .issue(
                    CopySrc::Host(src),
                    CopyDst {
                        buffer: dst.clone(),
                        offset: i as usize * 64,
                    },
                    64,
                )
                .unwrap(),
        );
    }
    let last = tokens[15];
    engine.wait(last).unwrap();
    // Waiting twice, and on a token an earlier wait already covered, is fine.
    engine.wait(last).unwrap();
    engine.wait(tokens[0]).unwrap();
    let mut out = vec![0u8; 64 * 16];
    dst.read(0, &mut out).unwrap();
    assert!(
        out.chunks(64)
            .enumerate()
            .all(|(i, c)| c.iter().all(|&b| b == i as u8)),
        "copies landed out of order"
    );
    let src: Arc<dyn HostBytes> = Arc::new(vec![1u8; 64]);
    assert!(engine
        .issue(
            CopySrc::Host(src),
            CopyDst {
                buffer: dst.clone(),
                offset: 64 * 16 - 8
            },
            64
        )
        .is_err());
    let t = engine
        .issue(
            CopySrc::Device {
                buffer: dst.clone(),
                offset: 64,
            },
            CopyDst {
                buffer: dst.clone(),
                offset: 0,
            },
            64,
        )
        .unwrap();
    engine.wait(t).unwrap();
    dst.read(0, &mut out[..64]).unwrap();
    assert!(out[..64].iter().all(|&b| b == 1), "in-buffer copy");
    // A device-side wait orders the device's next work (a read, on the GPU's stream) after
    // the copy, on every backend; tokens of another engine or never issued are refused.
    for round in 0..3u8 {
        let src: Arc<dyn HostBytes> = Arc::new(vec![7 + round; 64]);
        let to = CopyDst {
            buffer: dst.clone(),
            offset: 128,
        };
        let t = engine.issue(CopySrc::Host(src), to, 64).unwrap();
        engine.wait_on_device(t).unwrap();
        dst.read(128, &mut out[..64]).unwrap();
        assert!(
            out[..64].iter().all(|&b| b == 7 + round),
            "a read after a device-side wait saw the old bytes"
        );
    }
    let foreign = rlx_ir::BarrierToken {
        engine: u64::MAX,
        seq: 1,
    };
    assert!(engine.wait_on_device(foreign).is_err());
    let unissued = rlx_ir::BarrierToken {
        engine: t.engine,
        seq: 1 << 40,
    };
    assert!(engine.wait_on_device(unissued).is_err());
    assert!(engine.wait(unissued).is_err());
}

/// y = 2x; two prefetched batches are consumed in order; a third prefetch is refused.
pub fn prefetch_consumes_batches_in_order(backend: &Arc<dyn Backend>) {
    let mut g = Graph::new();
    let x = g.input("x", Shape::new([4]), DType::F32).unwrap();
    let two = g.scalar(2.0);
    let y = g.add(Op::Binary(rlx_ir::BinaryOp::Mul), &[x, two]).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let params = Arc::new(Store::new(backend.as_ref(), &[]).unwrap());
    let exe = Executable::new(backend.clone(), &g, params, None).unwrap();
    let batch = |v: f32| f32s(&[v; 4]);
    let prefetch = |v: f32| exe.prefetch(&[("x", &batch(v))]);
    // The batch is a snapshot: the caller's bytes may change as soon as prefetch returns.
    let mut reused = batch(1.0);
    exe.prefetch(&[("x", &reused)]).unwrap();
    reused.fill(0);
    prefetch(2.0).unwrap();
    assert!(prefetch(3.0).is_err(), "a third prefetch while two wait");
    // Explicit feeds bypass the queue.
    close(
        &from_bytes(&exe.run(&[("x", &f32s(&[5.0; 4]))], None, &[0]).unwrap()[0]),
        &[10.0; 4],
        "explicit",
    );
    close(
        &from_bytes(&exe.run(&[], None, &[0]).unwrap()[0]),
        &[2.0; 4],
        "first prefetched batch",
    );
    prefetch(3.0).unwrap();
    close(
        &from_bytes(&exe.run(&[], None, &[0]).unwrap()[0]),
        &[4.0; 4],
        "second prefetched batch",
    );
    close(
        &from_bytes(&exe.run(&[], None, &[0]).unwrap()[0]),
        &[6.0; 4],
        "third prefetched batch",
    );
    assert!(
        exe.run(&[], None, &[0]).is_err(),
        "nothing prefetched and nothing given"
    );
}

/// logits = x @ w + b; loss = CE(logits, y); one SGD step. Checked against an f64 reference.
fn linear_model(backend: &Arc<dyn Backend>) -> (Executable, Arc<Store>) {
    let (exe, params, _) = linear_model_with(backend, "sgd", false);
    (exe, params)
}

/// The linear softmax model trained by the optimizer description `spec`
/// ([`OptimizerSetup::parse`]); with `hyper_table`, the state store holds per-parameter settings.
fn linear_model_with(
    backend: &Arc<dyn Backend>,
    spec: &str,
    hyper_table: bool,
) -> (Executable, Arc<Store>, Arc<Store>) {
    let mut g = Graph::new();
    let x = g.input("x", Shape::new([4, 3]), DType::F32).unwrap();
    let y = g.input("y", Shape::new([4]), DType::I32).unwrap();
    let w = g.param("w", Shape::new([3, 2]), DType::F32).unwrap();
    let b = g.param("b", Shape::new([2]), DType::F32).unwrap();
    let xw = g
        .add(
            Op::MatMul {
                trans_a: false,
                trans_b: false,
            },
            &[x, w],
        )
        .unwrap();
    let logits = g.add(Op::Binary(rlx_ir::BinaryOp::Add), &[xw, b]).unwrap();
    let loss = g.add(Op::SoftmaxCrossEntropy, &[logits, y]).unwrap();
    let bw = rlx_ir::grad(&g, loss, &[w, b]).unwrap();
    let specs = [
        ("w".to_string(), Shape::new([3, 2]), DType::F32),
        ("b".to_string(), Shape::new([2]), DType::F32),
    ];
    let params = Arc::new(Store::new(backend.as_ref(), &specs).unwrap());
    params.write("w", &f32s(&W0)).unwrap();
    params.write("b", &f32s(&B0)).unwrap();
    let state = Arc::new(
        Store::for_optimizer(backend.as_ref(), OptimRule::Sgd, &params, hyper_table).unwrap(),
    );
    let opt = OptimizerSetup::parse(spec, state.clone()).unwrap();
    (
        Executable::new(backend.clone(), &bw, params.clone(), Some(opt)).unwrap(),
        params,
        state,
    )
}

/// Loss and gradients of the linear softmax model at its initial weights, in f64.
fn reference() -> (f64, [f64; 6], [f64; 2]) {
    let (mut loss, mut gw, mut gb) = (0.0f64, [0.0f64; 6], [0.0f64; 2]);
    for r in 0..4 {
        let l: Vec<f64> = (0..2)
            .map(|j| {
                B0[j] as f64
                    + (0..3)
                        .map(|k| X[r * 3 + k] as f64 * W0[k * 2 + j] as f64)
                        .sum::<f64>()
            })
            .collect();
        let m = l[0].max(l[1]);
        let z: f64 = l.iter().map(|v| (v - m).exp()).sum();
        loss += (m + z.ln() - l[Y[r] as usize]) / 4.0;
        for j in 0..2 {
            let d = ((l[j] - m).exp() / z - if Y[r] as usize == j { 1.0 } else { 0.0 }) / 4.0;
            gb[j] += d;
            for k in 0..3 {
                gw[k * 2 + j] += X[r * 3 + k] as f64 * d;
            }
        }
    }
    (loss, gw, gb)
}

/// Gradient accumulation (update on every 2nd run with the mean), global-norm clipping, skipped
/// non-finite runs, per-parameter settings from the state store's table, and the statistics
/// output (`crate::stat`).
pub fn training_step_options(backend: &Arc<dyn Backend>) {
    let spec = r#"{"rule": "sgd", "clip": 0.05, "accumulate": 2, "skip_nonfinite": true}"#;
    let (exe, params, state) = linear_model_with(backend, spec, true);
    // Row per parameter: w trains with lr 0.5, b with lr 0 (a frozen group).
    let mut rows = vec![0.0f32; 2 * crate::hyper_col::LEN];
    rows[crate::hyper_col::LR] = 0.5;
    for r in 0..2 {
        rows[r * crate::hyper_col::LEN + crate::hyper_col::ONE_MINUS_DAMPENING] = 1.0;
    }
    state.write("hyper", &f32s(&rows)).unwrap();
    let stats_at = exe.outputs().len() - 1;
    let yb: Vec<u8> = Y.iter().flat_map(|v| v.to_le_bytes()).collect();
    let run = |x: &[f32]| {
        let out = exe
            .run(
                &[("x", &f32s(x)), ("y", &yb)],
                Some(&hyper(9.0)),
                &[stats_at],
            )
            .unwrap();
        from_bytes(&out[0])
    };
    let stats = run(&X);
    assert_eq!(
        stats[crate::stat::UPDATED],
        0.0,
        "first of two accumulated runs"
    );
    assert_eq!(stats[crate::stat::MICRO], 1.0);
    close(
        &from_bytes(&params.read("w").unwrap()),
        &W0.map(f64::from),
        "w before the update",
    );
    let stats = run(&X);
    assert_eq!(stats[crate::stat::UPDATED], 1.0, "second run updates");
    let (_, gw, gb) = reference();
    let norm = gw.iter().chain(&gb).map(|g| g * g).sum::<f64>().sqrt();
    close(
        &stats[crate::stat::GRAD_NORM..=crate::stat::GRAD_NORM],
        &[norm],
        "grad norm",
    );
    let coef = (0.05 / (norm + 1e-6)).min(1.0);
    let w1: Vec<f64> = W0
        .iter()
        .zip(&gw)
        .map(|(w, g)| *w as f64 - 0.5 * coef * g)
        .collect();
    close(
        &from_bytes(&params.read("w").unwrap()),
        &w1,
        "clipped update",
    );
    close(
        &from_bytes(&params.read("b").unwrap()),
        &B0.map(f64::from),
        "b (lr 0)",
    );
    let mut bad = X;
    bad[0] = f32::NAN;
    let stats = run(&bad);
    assert_eq!(stats[crate::stat::SKIPPED], 1.0, "a NaN run is skipped");
    assert_eq!(stats[crate::stat::MICRO], 0.0, "and not accumulated");
    close(
        &from_bytes(&params.read("w").unwrap()),
        &w1,
        "w after the skipped run",
    );
}

const W0: [f32; 6] = [0.1, -0.2, 0.3, 0.05, -0.4, 0.25];
const B0: [f32; 2] = [0.01, -0.02];
const X: [f32; 12] = [
    1.0, 2.0, -1.0, 0.5, 0.0, 1.5, -0.3, 0.7, 2.0, 1.1, -1.2, 0.4,
];
const Y: [i32; 4] = [0, 1, 1, 0];

fn hyper(lr: f32) -> OptimHyper {
    OptimHyper {
        lr,
        momentum: 0.0,
        weight_decay: 0.0,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    }
}

/// One SGD step of the linear softmax model: loss, gradients and the updated weight.
pub fn linear_softmax_training_step(backend: &Arc<dyn Backend>) {
    let (exe, params) = linear_model(backend);
    let yb: Vec<u8> = Y.iter().flat_map(|v| v.to_le_bytes()).collect();
    let out = exe
        .run(
            &[("x", &f32s(&X)), ("y", &yb)],
            Some(&hyper(0.5)),
            &[0, 1, 2],
        )
        .unwrap();
    let (loss, gw, gb) = reference();
    close(&from_bytes(&out[0]), &[loss], "loss");
    close(&from_bytes(&out[1]), &gw, "grad w");
    close(&from_bytes(&out[2]), &gb, "grad b");
    let w1: Vec<f64> = W0
        .iter()
        .zip(&gw)
        .map(|(w, g)| *w as f64 - 0.5 * g)
        .collect();
    close(&from_bytes(&params.read("w").unwrap()), &w1, "updated w");
    assert!(exe.memory().arena_bytes <= exe.memory().naive_bytes);
}

/// A data-parallel step: every gradient inside one arena region, in order; the gradients phase
/// leaves the weights alone; the update phase uses whatever the region holds then (as after an
/// all-reduce); phases are refused where they do not apply.
pub fn data_parallel_phases(backend: &Arc<dyn Backend>) {
    use crate::Phase;
    let (exe, params, _) =
        linear_model_with(backend, r#"{"rule": "sgd", "distributed": true}"#, false);
    let (start, bytes) = exe
        .grad_region()
        .expect("a data-parallel step has a gradient region");
    let (gw_at, gb_at) = (&exe.outputs()[1], &exe.outputs()[2]);
    assert!(gw_at.buf == Buf::Arena && gb_at.buf == Buf::Arena);
    assert!(start <= gw_at.offset && gw_at.offset + gw_at.bytes() <= gb_at.offset);
    assert!(gb_at.offset + gb_at.bytes() <= start + bytes);
    let yb: Vec<u8> = Y.iter().flat_map(|v| v.to_le_bytes()).collect();
    let feeds = [("x", f32s(&X)), ("y", yb)];
    let feeds: Vec<(&str, &[u8])> = feeds.iter().map(|(n, b)| (*n, b.as_slice())).collect();
    let out = exe
        .run_phase(&feeds, Some(&hyper(0.5)), &[0, 1, 2], Phase::Gradients)
        .unwrap();
    let (loss, gw, gb) = reference();
    close(&from_bytes(&out[0]), &[loss], "loss");
    close(&from_bytes(&out[1]), &gw, "grad w");
    close(&from_bytes(&out[2]), &gb, "grad b");
    close(
        &from_bytes(&params.read("w").unwrap()),
        &W0.map(f64::from),
        "w before the update",
    );
    // Stand in for an all-reduce: the region doubled in place.
    let mut region = vec![0; bytes];
    exe.arena().read(start, &mut region).unwrap();
    let doubled: Vec<f32> = from_bytes(&region).iter().map(|g| 2.0 * g).collect();
    exe.arena().write(start, &f32s(&doubled)).unwrap();
    let err = exe
        .run_phase(&feeds, Some(&hyper(0.5)), &[], Phase::Update)
        .unwrap_err();
    assert!(err.to_string().contains("takes no inputs"), "{err}");
    exe.run_phase(&[], Some(&hyper(0.5)), &[], Phase::Update)
        .unwrap();
    let w1: Vec<f64> = W0
        .iter()
        .zip(&gw)
        .map(|(w, g)| *w as f64 - 0.5 * 2.0 * g)
        .collect();
    close(
        &from_bytes(&params.read("w").unwrap()),
        &w1,
        "w updated from the region",
    );
    let (plain, _) = linear_model(backend);
    assert!(plain.grad_region().is_none());
    let err = plain
        .run_phase(&feeds, Some(&hyper(0.5)), &[], Phase::Gradients)
        .unwrap_err();
    assert!(err.to_string().contains("data-parallel"), "{err}");
}

/// Bound inputs: refused while unbound, read by later runs once bound, updated by `write_rows`.
pub fn resident_inputs(backend: &Arc<dyn Backend>) {
    let mut g = Graph::new();
    let cache = g.input("cache", Shape::new([4, 2]), DType::F32).unwrap();
    let s = g
        .add(
            Op::Reduce {
                op: rlx_ir::ReduceOp::Sum,
                axes: vec![0],
                keepdims: false,
            },
            &[cache],
        )
        .unwrap();
    g.set_outputs(vec![s]).unwrap();
    let params = Arc::new(Store::new(backend.as_ref(), &[]).unwrap());
    let exe = Executable::new(backend.clone(), &g, params, None).unwrap();
    assert!(
        exe.run(&[], None, &[0]).is_err(),
        "an unbound input must be given"
    );
    exe.bind("cache", &f32s(&[1.0; 8])).unwrap();
    close(
        &from_bytes(&exe.run(&[], None, &[0]).unwrap()[0]),
        &[4.0, 4.0],
        "bound sum",
    );
    exe.write_rows("cache", 0, 3, &f32s(&[10.0, 20.0])).unwrap();
    close(
        &from_bytes(&exe.run(&[], None, &[0]).unwrap()[0]),
        &[13.0, 23.0],
        "after write_rows",
    );
    assert!(
        exe.write_rows("cache", 0, 4, &f32s(&[1.0, 1.0])).is_err(),
        "writing past the end must fail"
    );
    exe.write_rows("cache", 1, 0, &f32s(&[0.0; 4])).unwrap();
    close(
        &from_bytes(&exe.run(&[], None, &[0]).unwrap()[0]),
        &[0.0, 23.0],
        "column write",
    );
}

/// Rejected feeds (a label out of range, a short input, an unknown name) change no weight.
pub fn bad_feeds_change_nothing(backend: &Arc<dyn Backend>) {
    let (exe, params) = linear_model(backend);
    let before = params.read("w").unwrap();
    let bad_labels: Vec<u8> = [0i32, 1, 7, 0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let x = f32s(&X);
    assert!(exe
        .run(&[("x", &x), ("y", &bad_labels)], Some(&hyper(0.5)), &[0])
        .is_err());
    assert!(exe.run(&[("x", &x[..8])], Some(&hyper(0.5)), &[0]).is_err());
    assert!(exe
        .run(&[("x", &x), ("z", &x)], Some(&hyper(0.5)), &[0])
        .is_err());
    assert_eq!(
        params.read("w").unwrap(),
        before,
        "a rejected run changed the weights"
    );
}

/// Three steps of each update rule on `loss = sum(w * x)` (so the gradient is `x`), with weight
/// decay, against the rules written out in f64 (PyTorch's definitions).
pub fn optimizer_rules_match_closed_form(backend: &Arc<dyn Backend>) {
    const N: usize = 5; // odd, so vectorised loops have a tail
    let w0: Vec<f32> = (0..N).map(|i| 0.3 - 0.17 * i as f32).collect();
    let x: Vec<f32> = (0..N).map(|i| 0.5 - 0.4 * i as f32).collect();
    let rules = [
        (OptimRule::Sgd, 0.0),
        (OptimRule::Sgd, 0.9),
        (OptimRule::Adam, 0.0),
        (OptimRule::AdamW, 0.0),
    ];
    for (rule, momentum) in rules {
        let h = OptimHyper {
            lr: 0.1,
            momentum,
            weight_decay: 0.05,
            beta1: 0.8,
            beta2: 0.95,
            eps: 1e-6,
        };
        let mut g = Graph::new();
        let xi = g.input("x", Shape::new([N]), DType::F32).unwrap();
        let w = g.param("w", Shape::new([N]), DType::F32).unwrap();
        let wx = g.add(Op::Binary(BinaryOp::Mul), &[w, xi]).unwrap();
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![0],
            keepdims: false,
        };
        let loss = g.add(sum, &[wx]).unwrap();
        let bw = rlx_ir::grad(&g, loss, &[w]).unwrap();
        let specs = [("w".to_string(), Shape::new([N]), DType::F32)];
        let params = Arc::new(Store::new(backend.as_ref(), &specs).unwrap());
        params.write("w", &f32s(&w0)).unwrap();
        let state = Arc::new(Store::for_optimizer(backend.as_ref(), rule, &params, false).unwrap());
        let opt = OptimizerSetup::new(rule, state);
        let exe = Executable::new(backend.clone(), &bw, params.clone(), Some(opt)).unwrap();
        let (mut p, mut m, mut v) = (
            w0.iter().map(|&a| a as f64).collect::<Vec<f64>>(),
            vec![0.0f64; N],
            vec![0.0f64; N],
        );
        let (lr, wd) = (h.lr as f64, h.weight_decay as f64);
        let (b1, b2, eps) = (h.beta1 as f64, h.beta2 as f64, h.eps as f64);
        for t in 1..=3 {
            exe.run(&[("x", &f32s(&x))], Some(&h), &[0]).unwrap();
            for i in 0..N {
                let g = x[i] as f64;
                match rule {
                    OptimRule::Sgd if momentum == 0.0 => p[i] -= lr * (g + wd * p[i]),
                    OptimRule::Sgd => {
                        let d = g + wd * p[i];
                        m[i] = if t == 1 {
                            d
                        } else {
                            h.momentum as f64 * m[i] + d
                        };
                        p[i] -= lr * m[i];
                    }
                    _ => {
                        let g = if rule == OptimRule::Adam {
                            g + wd * p[i]
                        } else {
                            p[i] *= 1.0 - lr * wd;
                            g
                        };
                        m[i] = b1 * m[i] + (1.0 - b1) * g;
                        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                        let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
                        p[i] -= lr * mh / (vh.sqrt() + eps);
                    }
                }
            }
            let what = format!("{rule:?} (momentum {momentum}) after step {t}");
            close(&from_bytes(&params.read("w").unwrap()), &p, &what);
        }
    }
}

/// `Backend::compile` refuses programs that read or write outside their buffers, write over
/// their own operands, or use a dtype no kernel handles; a good program still compiles.
pub fn compile_rejects_bad_programs(backend: &Arc<dyn Backend>) {
    let at = |offset: usize, n: usize, dtype: DType| TRef {
        buf: Buf::Arena,
        offset,
        shape: Shape::new([n]),
        dtype,
    };
    let neg = |x: TRef, out: TRef| Program {
        instrs: vec![Instr::Op {
            op: Op::Unary(UnaryOp::Neg),
            ins: vec![x],
            out,
        }],
    };
    let lens = [256usize];
    let good = neg(at(0, 8, DType::F32), at(64, 8, DType::F32));
    assert!(backend.compile(&good, &lens).is_ok(), "a valid program");
    let cases = [
        (neg(at(0, 8, DType::F32), at(240, 8, DType::F32)), "outside"),
        (
            neg(at(0, 8, DType::F32), at(16, 8, DType::F32)),
            "its own operand",
        ),
        (neg(at(0, 8, DType::I32), at(64, 8, DType::I32)), "dtype"),
    ];
    for (program, needle) in cases {
        match backend.compile(&program, &lens) {
            Ok(_) => panic!("a bad program compiled ({needle}): {program:?}"),
            Err(e) => assert!(e.to_string().contains(needle), "{needle}: {e}"),
        }
    }
    let elsewhere = neg(
        TRef {
            buf: Buf::State,
            ..at(0, 8, DType::F32)
        },
        at(64, 8, DType::F32),
    );
    assert!(
        backend.compile(&elsewhere, &lens).is_err(),
        "a reference into a buffer the program is not given"
    );
}

/// Naive attention of one block in f64: (out, dq, dk, dv) for row-major q (l x e), k (s x e),
/// v (s x ev) and output gradient g (l x ev).
#[allow(clippy::too_many_arguments)]
fn attention_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: &[f64],
    (l, s, e, ev): (usize, usize, usize, usize),
    scale: f64,
    causal: Option<i64>,
) -> [Vec<f64>; 4] {
    let mut p = vec![0.0; l * s];
    for i in 0..l {
        let vis = causal.map_or(s as i64, |o| (i as i64 + o + 1).clamp(0, s as i64)) as usize;
        let sc: Vec<f64> = (0..vis)
            .map(|j| (0..e).map(|c| q[i * e + c] * k[j * e + c]).sum::<f64>() * scale)
            .collect();
        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
        for j in 0..vis {
            p[i * s + j] = (sc[j] - m).exp() / z;
        }
    }
    let mm = |a: &dyn Fn(usize, usize) -> f64, b: &dyn Fn(usize, usize) -> f64, r, c, n| {
        let mut o = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                o[i * c + j] = (0..n).map(|t| a(i, t) * b(t, j)).sum();
            }
        }
        o
    };
    let out = mm(&|i, j| p[i * s + j], &|j, c| v[j * ev + c], l, ev, s);
    let dv = mm(&|j, i| p[i * s + j], &|i, c| g[i * ev + c], s, ev, l);
    let dp = mm(&|i, c| g[i * ev + c], &|c, j| v[j * ev + c], l, s, ev);
    let mut ds = vec![0.0; l * s];
    for i in 0..l {
        let d: f64 = (0..s).map(|j| p[i * s + j] * dp[i * s + j]).sum();
        for j in 0..s {
            ds[i * s + j] = p[i * s + j] * (dp[i * s + j] - d) * scale;
        }
    }
    let dq = mm(&|i, j| ds[i * s + j], &|j, c| k[j * e + c], l, e, s);
    let dk = mm(&|j, i| ds[i * s + j], &|i, c| q[i * e + c], s, e, l);
    [out, dq, dk, dv]
}

/// The instructions the fusion pass makes (`Attention`/`AttentionGrad` in both layouts,
/// `MatMulEpilogue`, `FusedSumTo`, `NormalizeGradAdd`) against naive float64 references.
pub fn fused_instructions_match_reference(backend: &Arc<dyn Backend>) {
    use rlx_ir::{Fused, FusedStep};
    let data = |n: usize, seed: f64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f64 * 0.61 + seed).sin()) as f32)
            .collect()
    };
    let wide = |x: &[f32]| -> Vec<f64> { x.iter().map(|&v| v as f64).collect() };
    let run = |g: &Graph, feeds: &[(&str, &[f32])]| -> Vec<Vec<f32>> {
        let params = Arc::new(Store::new(backend.as_ref(), &[]).unwrap());
        let exe = Executable::new(backend.clone(), g, params, None).unwrap();
        let bytes: Vec<(&str, Vec<u8>)> = feeds.iter().map(|(n, v)| (*n, f32s(v))).collect();
        let refs: Vec<(&str, &[u8])> = bytes.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        let outs: Vec<usize> = (0..g.outputs().len()).collect();
        exe.run(&refs, None, &outs)
            .unwrap()
            .iter()
            .map(|b| from_bytes(b))
            .collect()
    };
    // Separate layout: (blocks, L, S, E, Ev, causal offset). Key j is visible to query i when
    // j <= i + offset. Sizes cross the GPU kernels' tiles (64 query rows, 32 keys, head sizes
    // up to 32 / 64 / beyond).
    let f = DType::F32;
    let scale = 0.6f32;
    for (u, l, s, e, ev, causal) in [
        (2, 3, 4, 2, 3, Some(1)),
        (3, 33, 33, 32, 32, None),
        (1, 70, 67, 40, 48, Some(3)),
        (1, 5, 9, 72, 8, None),
    ] {
        let (q, k, v, gy) = (
            data(u * l * e, 0.1),
            data(u * s * e, 0.9),
            data(u * s * ev, 1.7),
            data(u * l * ev, 2.5),
        );
        let mut g = Graph::new();
        let qi = g.input("q", Shape::new([u, l, e]), f).unwrap();
        let ki = g.input("k", Shape::new([u, s, e]), f).unwrap();
        let vi = g.input("v", Shape::new([u, s, ev]), f).unwrap();
        let gi = g.input("g", Shape::new([u, l, ev]), f).unwrap();
        let attrs = |grad: bool, lowp: Option<DType>| {
            let heads = None;
            if grad {
                Op::AttentionGrad {
                    scale,
                    causal,
                    heads,
                    lowp,
                }
            } else {
                Op::Attention {
                    scale,
                    causal,
                    heads,
                    lowp,
                }
            }
        };
        let o = g.add(attrs(false, None), &[qi, ki, vi]).unwrap();
        let d = g.add(attrs(true, None), &[qi, ki, vi, o, gi]).unwrap();
        // The same attention with low-precision products (mixed precision): bfloat16 and
        // float16 operands, float32 sums, within those dtypes' rounding of the float32 results.
        let mut low = vec![o, d];
        for dt in [DType::BF16, DType::F16] {
            let o = g.add(attrs(false, Some(dt)), &[qi, ki, vi]).unwrap();
            low.push(o);
            low.push(g.add(attrs(true, Some(dt)), &[qi, ki, vi, o, gi]).unwrap());
        }
        g.set_outputs(low).unwrap();
        let got = run(&g, &[("q", &q), ("k", &k), ("v", &v), ("g", &gy)]);
        let mut want = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for b in 0..u {
            let r = attention_ref(
                &wide(&q[b * l * e..][..l * e]),
                &wide(&k[b * s * e..][..s * e]),
                &wide(&v[b * s * ev..][..s * ev]),
                &wide(&gy[b * l * ev..][..l * ev]),
                (l, s, e, ev),
                scale as f64,
                causal,
            );
            for (w, x) in want.iter_mut().zip(r) {
                w.extend(x);
            }
        }
        close(
            &got[0],
            &want[0],
            &format!("attention {:?}", (u, l, s, e, ev)),
        );
        let flat: Vec<f64> = want[1..].concat();
        close(
            &got[1],
            &flat,
            &format!("attention_grad [dq | dk | dv] {:?}", (u, l, s, e, ev)),
        );
        for (i, dt) in ["bfloat16", "float16"].iter().enumerate() {
            let what = format!("attention, {dt} products {:?}", (u, l, s, e, ev));
            close_within(&got[2 + 2 * i], &want[0], 4e-2, &what);
            close_within(&got[3 + 2 * i], &flat, 4e-2, &format!("{what}, gradient"));
        }
    }

    // Packed layout: qkv (B, T, 3 * H * E), causal offset 0.
    for (b, t, h, e) in [(2, 4, 2, 2), (1, 80, 2, 64)] {
        let qkv = data(b * t * 3 * h * e, 0.3);
        let gy = data(b * t * h * e, 1.1);
        let mut g = Graph::new();
        let xi = g.input("qkv", Shape::new([b, t, 3 * h * e]), f).unwrap();
        let gi = g.input("g", Shape::new([b, t, h * e]), f).unwrap();
        let causal = Some(0);
        let packed = |grad: bool| {
            let (heads, lowp) = (Some(h), None);
            if grad {
                Op::AttentionGrad {
                    scale,
                    causal,
                    heads,
                    lowp,
                }
            } else {
                Op::Attention {
                    scale,
                    causal,
                    heads,
                    lowp,
                }
            }
        };
        let o = g.add(packed(false), &[xi]).unwrap();
        let d = g.add(packed(true), &[xi, o, gi]).unwrap();
        g.set_outputs(vec![o, d]).unwrap();
        let got = run(&g, &[("qkv", &qkv), ("g", &gy)]);
        let (mut want_o, mut want_d) = (vec![0.0; b * t * h * e], vec![0.0; qkv.len()]);
        let w3 = 3 * h * e;
        for bi in 0..b {
            for j in 0..h {
                let cut = |x: &[f32], width: usize, col: usize| -> Vec<f64> {
                    (0..t)
                        .flat_map(|ti| (0..e).map(move |c| (ti, c)))
                        .map(|(ti, c)| x[(bi * t + ti) * width + col + c] as f64)
                        .collect()
                };
                let r = attention_ref(
                    &cut(&qkv, w3, j * e),
                    &cut(&qkv, w3, (h + j) * e),
                    &cut(&qkv, w3, (2 * h + j) * e),
                    &cut(&gy, h * e, j * e),
                    (t, t, e, e),
                    scale as f64,
                    causal,
                );
                for ti in 0..t {
                    for c in 0..e {
                        want_o[(bi * t + ti) * h * e + j * e + c] = r[0][ti * e + c];
                        for (part, x) in r[1..].iter().enumerate() {
                            want_d[(bi * t + ti) * w3 + (part * h + j) * e + c] = x[ti * e + c];
                        }
                    }
                }
            }
        }
        close(
            &got[0],
            &want_o,
            &format!("packed attention {:?}", (b, t, h, e)),
        );
        close(
            &got[1],
            &want_d,
            &format!("packed attention_grad {:?}", (b, t, h, e)),
        );
    }

    // relu(a @ b^T + bias) as one MatMulEpilogue; sum_to((x * y), [3]) as one FusedSumTo;
    // normalize_grad(x, y) + z as one NormalizeGradAdd.
    let (m, kk, n) = (5, 4, 3);
    let (a, bm, bias) = (data(m * kk, 0.2), data(n * kk, 1.3), data(n, 2.1));
    let (x, y, z) = (data(4 * n, 0.4), data(4 * n, 1.9), data(4 * n, 2.8));
    let mut g = Graph::new();
    let ai = g.input("a", Shape::new([m, kk]), f).unwrap();
    let bi = g.input("b", Shape::new([n, kk]), f).unwrap();
    let ci = g.input("bias", Shape::new([n]), f).unwrap();
    let xi = g.input("x", Shape::new([4, n]), f).unwrap();
    let yi = g.input("y", Shape::new([4, n]), f).unwrap();
    let zi = g.input("z", Shape::new([4, n]), f).unwrap();
    let epilogue = Arc::new(Fused {
        shape: Shape::new([m, n]),
        n_inputs: 2,
        steps: vec![
            FusedStep::Binary(BinaryOp::Add, 0, 1),
            FusedStep::Unary(UnaryOp::Relu, 2),
        ],
    });
    let mm = g
        .add(
            Op::MatMulEpilogue {
                trans_a: false,
                trans_b: true,
                epilogue,
            },
            &[ai, bi, ci],
        )
        .unwrap();
    let expr = Arc::new(Fused {
        shape: Shape::new([4, n]),
        n_inputs: 2,
        steps: vec![FusedStep::Binary(BinaryOp::Mul, 0, 1)],
    });
    let st = g
        .add(
            Op::FusedSumTo {
                expr,
                shape: Shape::new([n]),
            },
            &[xi, yi],
        )
        .unwrap();
    let na = g
        .add(Op::NormalizeGradAdd { eps: 1e-5 }, &[xi, yi, zi])
        .unwrap();
    g.set_outputs(vec![mm, st, na]).unwrap();
    let got = run(
        &g,
        &[
            ("a", &a),
            ("b", &bm),
            ("bias", &bias),
            ("x", &x),
            ("y", &y),
            ("z", &z),
        ],
    );
    let want_mm: Vec<f64> = (0..m * n)
        .map(|o| {
            let (i, j) = (o / n, o % n);
            let dot: f64 = (0..kk)
                .map(|p| a[i * kk + p] as f64 * bm[j * kk + p] as f64)
                .sum();
            (dot + bias[j] as f64).max(0.0)
        })
        .collect();
    close(&got[0], &want_mm, "matmul_epilogue");
    let want_st: Vec<f64> = (0..n)
        .map(|j| {
            (0..4)
                .map(|i| x[i * n + j] as f64 * y[i * n + j] as f64)
                .sum()
        })
        .collect();
    close(&got[1], &want_st, "fused_sum_to");
    let mut want_na = Vec::new();
    for i in 0..4 {
        let (xr, gr) = (wide(&x[i * n..][..n]), wide(&y[i * n..][..n]));
        let mean = xr.iter().sum::<f64>() / n as f64;
        let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        let xhat: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
        let mg = gr.iter().sum::<f64>() / n as f64;
        let mgx = gr.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / n as f64;
        for c in 0..n {
            want_na.push(rstd * (gr[c] - mg - xhat[c] * mgx) + z[i * n + c] as f64);
        }
    }
    close(&got[2], &want_na, "normalize_grad_add");

    // A fused expression over a zero-size axis, one operand broadcast along it: nothing to
    // compute, and no row length to tile by (the CPU kernel once divided by it).
    let mut g = Graph::new();
    let ei = g.input("e", Shape::new([3, 0]), f).unwrap();
    let ri = g.input("r", Shape::new([3, 1]), f).unwrap();
    let expr = Arc::new(Fused {
        shape: Shape::new([3, 0]),
        n_inputs: 2,
        steps: vec![FusedStep::Binary(BinaryOp::Mul, 0, 1)],
    });
    let fe = g.add(Op::Fused(expr), &[ei, ri]).unwrap();
    g.set_outputs(vec![fe]).unwrap();
    let got = run(&g, &[("e", &[]), ("r", &data(3, 0.3))]);
    assert!(
        got[0].is_empty(),
        "a (3, 0) fused expression gave {:?}",
        got[0]
    );
}

/// Mixed precision (what `rlx_ir::autocast` makes): float32 -> bfloat16/float16 casts rounding
/// to nearest even (ties, overflow, subnormals, NaN), casts back, and matrix products of
/// low-precision operands summed in float32 (plain, transposed, a stack times one matrix, and
/// batch broadcasting), against float64. A backend without mixed precision must refuse it with
/// an `Unsupported` error naming itself.
pub fn mixed_precision_matches_reference(backend: &Arc<dyn Backend>) {
    let f = DType::F32;
    let two = |e: i32| 2f64.powi(e);
    // (input, its bfloat16 value, its float16 value).
    // Twelve: a GPU may cast four at a time.
    let cases: [(f64, f64, f64); 12] = [
        (1.0 + two(-8), 1.0, 1.0 + two(-8)),
        (1.0 + 3.0 * two(-8), 1.0 + two(-6), 1.0 + 3.0 * two(-8)),
        (1.0 + two(-8) + two(-20), 1.0 + two(-7), 1.0 + two(-8)),
        (1.0 + two(-11), 1.0, 1.0),
        (65504.0, 65536.0, 65504.0),
        (65520.0, 65536.0, f64::INFINITY),
        (-two(-24), -two(-24), -two(-24)),
        (two(-25), two(-25), 0.0),
        (f64::NAN, f64::NAN, f64::NAN),
        (-3.5, -3.5, -3.5),
        (f64::NEG_INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY),
        (two(100), two(100), f64::INFINITY),
    ];
    let xs: Vec<f32> = cases.iter().map(|c| c.0 as f32).collect();
    let (m, k, n, batch) = (5usize, 7usize, 3usize, 2usize);
    let val = |i: usize, s: usize| ((i * 7 + s * 3) % 17) as f32 / 8.0 - 1.0; // exact in both
    let a: Vec<f32> = (0..batch * m * k).map(|i| val(i, 1)).collect();
    let b: Vec<f32> = (0..k * n).map(|i| val(i, 2)).collect();
    let bt: Vec<f32> = (0..batch * n * k).map(|i| val(i, 3)).collect();
    // Output matrix `(z, y)` of a batch: `a[y] @ op(b[z])`, `b`'s matrices `bs` elements apart.
    let prod = |a: &[f32], b: &[f32], tb: bool, bs: usize, zs: usize| -> Vec<f64> {
        let mut c = Vec::new();
        for z in 0..zs {
            for y in 0..batch {
                for i in 0..m {
                    for j in 0..n {
                        c.push(
                            (0..k)
                                .map(|p| {
                                    let bv = if tb {
                                        b[z * bs + j * k + p]
                                    } else {
                                        b[z * bs + p * n + j]
                                    };
                                    a[(y * m + i) * k + p] as f64 * bv as f64
                                })
                                .sum(),
                        );
                    }
                }
            }
        }
        c
    };
    for low in [DType::BF16, DType::F16] {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([xs.len()]), f).unwrap();
        let ai = g.input("a", Shape::new([batch, m, k]), f).unwrap();
        let bi = g.input("b", Shape::new([k, n]), f).unwrap();
        let bti = g.input("bt", Shape::new([batch, 1, n, k]), f).unwrap();
        let cast = |g: &mut Graph, t| g.add(Op::Cast { to: low }, &[t]).unwrap();
        let xl = cast(&mut g, x);
        let back = g.add(Op::Cast { to: f }, &[xl]).unwrap();
        let (al, bl, btl) = (cast(&mut g, ai), cast(&mut g, bi), cast(&mut g, bti));
        let mm = |ta: bool, tb: bool| Op::MatMul {
            trans_a: ta,
            trans_b: tb,
        };
        // A stack times one matrix (one tall product); transposed right operands broadcast
        // against the stack (a product per output matrix).
        let c1 = g.add(mm(false, false), &[al, bl]).unwrap();
        let c2 = g.add(mm(false, true), &[al, btl]).unwrap();
        g.set_outputs(vec![back, c1, c2]).unwrap();
        let params = Arc::new(Store::new(backend.as_ref(), &[]).unwrap());
        let exe = match Executable::new(backend.clone(), &g, params, None) {
            Ok(exe) => exe,
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    matches!(
                        e,
                        rlx_ir::Error::Unsupported { .. } | rlx_ir::Error::DType { .. }
                    ) && msg.contains(&format!("the {} backend", backend.name())),
                    "{low} products on {}: {msg}",
                    backend.name()
                );
                assert_ne!(
                    backend.name(),
                    "cpu",
                    "the cpu backend runs mixed precision"
                );
                return;
            }
        };
        let feeds = [
            ("x", f32s(&xs)),
            ("a", f32s(&a)),
            ("b", f32s(&b)),
            ("bt", f32s(&bt)),
        ];
        let refs: Vec<(&str, &[u8])> = feeds.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let got: Vec<Vec<f32>> = exe
            .run(&refs, None, &[0, 1, 2])
            .unwrap()
            .iter()
            .map(|b| from_bytes(b))
            .collect();
        let want: Vec<f64> = cases
            .iter()
            .map(|c| if low == DType::BF16 { c.1 } else { c.2 })
            .collect();
        for (i, (g, w)) in got[0].iter().zip(&want).enumerate() {
            let same = (g.is_nan() && w.is_nan()) || *g as f64 == *w;
            assert!(same, "cast to {low} and back, case {i}: got {g}, want {w}");
        }
        close(&got[1], &prod(&a, &b, false, 0, 1), &format!("{low} a @ b"));
        // (batch, 1, n, k) against a's (batch,): (batch, batch) output matrices.
        close(
            &got[2],
            &prod(&a, &bt, true, n * k, batch),
            &format!("{low} a @ bt^T"),
        );
    }
}

/// int64 and bool tensors at a program's edges and inside it: a backend computing integers in
/// int32 (`Backend::narrows_integers`) takes int64 ids into an int32 slot and gives int64 and
/// bool outputs back in their dtypes, with the results of the CPU's int64 kernels (values within
/// int32). A backend without casts at the integer edges refuses the program by name.
pub fn int64_and_bool_programs_match_reference(backend: &Arc<dyn Backend>) {
    let n = 10usize;
    let ids: Vec<i64> = (0..n as i64).map(|i| i * 37 % 23 - 11).collect();
    let mask: Vec<u8> = (0..n).map(|i| (i % 3 == 0) as u8).collect();
    let x: Vec<f32> = vec![0.0, -0.0, f32::NAN, 2.5, -1.0, 0.0, 3.0, 1e-30, -0.5, 0.0];
    let mut g = Graph::new();
    let shape = Shape::new([2, n / 2]);
    let gi = g.input("ids", shape.clone(), DType::I64).unwrap();
    let gm = g.input("m", shape.clone(), DType::Bool).unwrap();
    let gx = g.input("x", shape.clone(), DType::F32).unwrap();
    let bin = |g: &mut Graph, b, x, y| g.add(Op::Binary(b), &[x, y]).unwrap();
    let cast = |g: &mut Graph, to, x| g.add(Op::Cast { to }, &[x]).unwrap();
    let three = g.constant_i64(&[3], Shape::scalar()).unwrap();
    let minus2 = g.constant_i64(&[-2], Shape::scalar()).unwrap();
    let four = g.constant_i64(&[4], Shape::scalar()).unwrap();
    let a = bin(&mut g, BinaryOp::Mul, gi, three);
    let a = bin(&mut g, BinaryOp::Add, a, minus2); // 3 * ids - 2
    let pos = cast(&mut g, DType::Bool, gx); // x != 0 (NaN counts)
    let (pl, ml) = (cast(&mut g, DType::I64, pos), cast(&mut g, DType::I64, gm));
    let both = bin(&mut g, BinaryOp::Mul, pl, ml);
    let both = cast(&mut g, DType::Bool, both); // pos and m
    let sel = g.add(Op::Where, &[both, a, gi]).unwrap();
    let fd = bin(&mut g, BinaryOp::FloorDiv, a, four);
    let mf = cast(&mut g, DType::F32, gm);
    let xm = bin(&mut g, BinaryOp::Mul, gx, mf);
    let sel_t = g.add(Op::Transpose { perm: vec![1, 0] }, &[sel]).unwrap();
    let sel32 = cast(&mut g, DType::I32, sel);
    let reduce = |g: &mut Graph, op, axes: Vec<usize>, x| {
        g.add(
            Op::Reduce {
                op,
                axes,
                keepdims: false,
            },
            &[x],
        )
        .unwrap()
    };
    let row_sums = reduce(&mut g, ReduceOp::Sum, vec![1], sel);
    let top = reduce(&mut g, ReduceOp::Max, vec![0, 1], a);
    let bl = cast(&mut g, DType::I64, both);
    let count = reduce(&mut g, ReduceOp::Sum, vec![0, 1], bl);
    g.set_outputs(vec![sel, both, fd, xm, sel_t, sel32, row_sums, top, count])
        .unwrap();
    let params = Arc::new(Store::new(backend.as_ref(), &[]).unwrap());
    let exe = match Executable::new(backend.clone(), &g, params, None) {
        Ok(exe) => exe,
        Err(e) => {
            let msg = e.to_string();
            assert!(
                matches!(e, rlx_ir::Error::DType { .. })
                    && msg.contains(&format!("the {} backend", backend.name()))
                    && msg.contains("bool"),
                "int64 and bool edges on {}: {msg}",
                backend.name()
            );
            assert_ne!(backend.name(), "cpu", "the cpu backend has int64 and bool");
            return;
        }
    };
    // The ids go in as the slot's dtype: int64 on the CPU, int32 where integers are narrowed.
    let slot = exe.inputs().into_iter().find(|s| s.name == "ids").unwrap();
    let id_bytes: Vec<u8> = match slot.at.dtype {
        DType::I64 => ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::I32 => ids.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
        d => panic!("ids slot is {d}"),
    };
    assert_eq!(slot.at.dtype == DType::I32, backend.narrows_integers());
    let feeds = [("ids", id_bytes), ("m", mask.clone()), ("x", f32s(&x))];
    let refs: Vec<(&str, &[u8])> = feeds.iter().map(|(n, v)| (*n, v.as_slice())).collect();
    let got = exe.run(&refs, None, &[0, 1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let i64s = |b: &[u8]| -> Vec<i64> {
        b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let want_a: Vec<i64> = ids.iter().map(|v| 3 * v - 2).collect();
    let want_both: Vec<u8> = (0..n)
        .map(|i| (x[i] != 0.0 && mask[i] != 0) as u8)
        .collect();
    let want_sel: Vec<i64> = (0..n)
        .map(|i| if want_both[i] != 0 { want_a[i] } else { ids[i] })
        .collect();
    assert_eq!(i64s(&got[0]), want_sel, "where(pos & m, 3 * ids - 2, ids)");
    assert_eq!(got[1], want_both, "bool(x) & m");
    let floor: Vec<i64> = want_a.iter().map(|v| v.div_euclid(4)).collect();
    assert_eq!(i64s(&got[2]), floor, "(3 * ids - 2) // 4");
    let xm: Vec<f64> = (0..n).map(|i| x[i] as f64 * mask[i] as f64).collect();
    close(&from_bytes(&got[3]), &xm, "x * float(m)");
    let h = n / 2;
    let sel_t: Vec<i64> = (0..n).map(|j| want_sel[(j % 2) * h + j / 2]).collect();
    assert_eq!(i64s(&got[4]), sel_t, "transpose of an int64 tensor");
    let sel32: Vec<i32> = got[5]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        sel32,
        want_sel.iter().map(|&v| v as i32).collect::<Vec<_>>(),
        "int64 -> int32"
    );
    let row_sums: Vec<i64> = (0..2)
        .map(|r| want_sel[r * h..(r + 1) * h].iter().sum())
        .collect();
    assert_eq!(i64s(&got[6]), row_sums, "int64 row sums");
    assert_eq!(i64s(&got[7]), [*want_a.iter().max().unwrap()], "int64 max");
    let count = want_both.iter().map(|&b| b as i64).sum::<i64>();
    assert_eq!(i64s(&got[8]), [count], "count of a bool mask");
}
