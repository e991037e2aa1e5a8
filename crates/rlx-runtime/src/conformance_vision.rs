//! Conformance check of the vision and regularisation ops (im2col / col2im, pooling and its
//! VJP, dropout, log1p, stop_gradient, cross-entropy's ignored label) against float64
//! references written from each op's definition in `rlx_ir::Op`.
use crate::conformance::{close, f32s, from_bytes};
use crate::{Backend, Executable, Store};
use rlx_ir::{dropout_keep, DType, Graph, NodeId, Op, Shape, Window};
use std::sync::Arc;

const N: usize = 2;
const C: usize = 3;
const H: usize = 5;
const W: usize = 6;

/// `x[n, c, y, x]` with the window's padding (None outside the image).
fn at(x: &[f32], n: usize, c: usize, y: isize, xx: isize) -> Option<f64> {
    if y < 0 || xx < 0 || y >= H as isize || xx >= W as isize {
        return None;
    }
    Some(x[((n * C + c) * H + y as usize) * W + xx as usize] as f64)
}

/// The input position of output (oy, ox) and kernel offset (i, j).
fn pos(w: &Window, oy: usize, ox: usize, i: usize, j: usize) -> (isize, isize) {
    (
        (oy * w.stride[0] + i) as isize - w.padding[0] as isize,
        (ox * w.stride[1] + j) as isize - w.padding[1] as isize,
    )
}

fn im2col_ref(x: &[f32], w: &Window) -> Vec<f64> {
    let [oh, ow] = w.out_size([H, W]).unwrap();
    let [kh, kw] = w.kernel;
    let mut out = Vec::new();
    for n in 0..N {
        for oy in 0..oh {
            for ox in 0..ow {
                for c in 0..C {
                    for i in 0..kh {
                        for j in 0..kw {
                            let (y, xx) = pos(w, oy, ox, i, j);
                            out.push(at(x, n, c, y, xx).unwrap_or(0.0));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Pooled values and, for `g`, the pooling VJP.
fn pool_ref(x: &[f32], w: &Window, max: bool, g: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let [oh, ow] = w.out_size([H, W]).unwrap();
    let mut out = Vec::new();
    let mut gx = vec![0.0f64; x.len()];
    let area = (w.kernel[0] * w.kernel[1]) as f64;
    for n in 0..N {
        for c in 0..C {
            for oy in 0..oh {
                for ox in 0..ow {
                    let gv = g[out.len()] as f64;
                    let mut best: Option<(f64, usize)> = None;
                    let mut sum = 0.0;
                    for i in 0..w.kernel[0] {
                        for j in 0..w.kernel[1] {
                            let (y, xx) = pos(w, oy, ox, i, j);
                            let Some(v) = at(x, n, c, y, xx) else {
                                continue;
                            };
                            let flat = ((n * C + c) * H + y as usize) * W + xx as usize;
                            sum += v;
                            gx[flat] += if max { 0.0 } else { gv / area };
                            if best.is_none_or(|(b, _)| v > b) {
                                best = Some((v, flat));
                            }
                        }
                    }
                    if max {
                        let (b, flat) = best.expect("a window inside the image");
                        gx[flat] += gv;
                        out.push(b);
                    } else {
                        out.push(sum / area);
                    }
                }
            }
        }
    }
    (out, gx)
}

/// Runs `g` (inputs "x" and "seed", outputs as set) and returns every output.
fn run(backend: &Arc<dyn Backend>, g: &Graph, feeds: &[(&str, Vec<u8>)]) -> Vec<Vec<f32>> {
    let params = Arc::new(Store::new(backend.as_ref(), &[]).unwrap());
    let exe = Executable::new(backend.clone(), g, params, None).unwrap();
    let views: Vec<(&str, &[u8])> = feeds.iter().map(|(n, d)| (*n, d.as_slice())).collect();
    let read: Vec<usize> = (0..g.outputs().len()).collect();
    exe.run(&views, None, &read)
        .unwrap()
        .iter()
        .map(|b| from_bytes(b))
        .collect()
}

/// Every new op's forward (and the pooling VJP) against its definition.
pub fn vision_ops_match_references(backend: &Arc<dyn Backend>) {
    // Distinct values (no ties), some negative.
    let x: Vec<f32> = (0..N * C * H * W)
        .map(|i| ((i * 37) % (N * C * H * W)) as f32 * 0.05 - 2.0)
        .collect();
    let windows = [
        Window {
            kernel: [3, 3],
            stride: [2, 2],
            padding: [1, 1],
        },
        Window {
            kernel: [2, 3],
            stride: [1, 2],
            padding: [0, 1],
        },
        Window {
            kernel: [1, 1],
            stride: [1, 1],
            padding: [0, 0],
        },
    ];
    for w in windows {
        let [oh, ow] = w.out_size([H, W]).unwrap();
        let pooled = N * C * oh * ow;
        let gvals: Vec<f32> = (0..pooled).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut g = Graph::new();
        let xi = g.input("x", Shape::new([N, C, H, W]), DType::F32).unwrap();
        let gi = g
            .input("g", Shape::new([N, C, oh, ow]), DType::F32)
            .unwrap();
        let mut outs: Vec<NodeId> = Vec::new();
        for k_major in [false, true] {
            let cols = g.add(Op::Im2Col { window: w, k_major }, &[xi]).unwrap();
            let back = g
                .add(
                    Op::Col2Im {
                        window: w,
                        size: [H, W],
                        k_major,
                    },
                    &[cols],
                )
                .unwrap();
            outs.extend([cols, back]);
        }
        for max in [true, false] {
            outs.push(g.add(Op::Pool2d { window: w, max }, &[xi]).unwrap());
            outs.push(g.add(Op::Pool2dGrad { window: w, max }, &[xi, gi]).unwrap());
        }
        g.set_outputs(outs).unwrap();
        let got = run(backend, &g, &[("x", f32s(&x)), ("g", f32s(&gvals))]);
        let what = format!("window {w:?}");
        let want_cols = im2col_ref(&x, &w);
        close(&got[0], &want_cols, &format!("im2col {what}"));
        // col2im(im2col(x)): each pixel times the number of windows that cover it.
        let ones = vec![1.0f32; x.len()];
        let covers = im2col_ref(&ones, &w);
        let mut count = vec![0.0f64; x.len()];
        let probe: Vec<f32> = (0..x.len()).map(|i| i as f32).collect();
        for (c, v) in im2col_ref(&probe, &w).iter().zip(&covers) {
            if *v != 0.0 {
                count[*c as usize] += 1.0;
            }
        }
        let want_back: Vec<f64> = x.iter().zip(&count).map(|(&v, &k)| v as f64 * k).collect();
        close(&got[1], &want_back, &format!("col2im {what}"));
        // Tap-major: each image's patch matrix transposed; the same image back.
        let (p, k) = (
            want_cols.len() / N / (C * w.kernel[0] * w.kernel[1]),
            C * w.kernel[0] * w.kernel[1],
        );
        let want_cols_k: Vec<f64> = (0..want_cols.len())
            .map(|i| {
                let (n, kk, col) = (i / (k * p), i / p % k, i % p);
                want_cols[(n * p + col) * k + kk]
            })
            .collect();
        close(&got[2], &want_cols_k, &format!("im2col k-major {what}"));
        close(&got[3], &want_back, &format!("col2im k-major {what}"));
        for (k, max) in [true, false].into_iter().enumerate() {
            let (y, gx) = pool_ref(&x, &w, max, &gvals);
            close(&got[4 + 2 * k], &y, &format!("pool max={max} {what}"));
            close(&got[5 + 2 * k], &gx, &format!("pool grad max={max} {what}"));
        }
    }

    // Dropout (the shared mask function), log1p, stop_gradient, ignored cross-entropy rows.
    let mut g = Graph::new();
    let xi = g.input("x", Shape::new([N, C, H, W]), DType::F32).unwrap();
    let seed = g.input("seed", Shape::new([2]), DType::I32).unwrap();
    let logits = g.input("logits", Shape::new([3, 4]), DType::F32).unwrap();
    let labels = g.input("labels", Shape::new([3]), DType::I32).unwrap();
    let d = g.add(Op::Dropout { p: 0.4 }, &[xi, seed]).unwrap();
    let sq = g.add(Op::Binary(rlx_ir::BinaryOp::Mul), &[xi, xi]).unwrap();
    let l = g.add(Op::Log1p, &[sq]).unwrap();
    let s = g.add(Op::StopGradient, &[xi]).unwrap();
    let ce = g.add(Op::SoftmaxCrossEntropy, &[logits, labels]).unwrap();
    g.set_outputs(vec![d, l, s, ce]).unwrap();
    let lg: Vec<f32> = (0..12).map(|i| (i as f32 * 0.7).cos()).collect();
    let got = run(
        backend,
        &g,
        &[
            ("x", f32s(&x)),
            (
                "seed",
                [5i32, 77].iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
            ("logits", f32s(&lg)),
            (
                "labels",
                [2i32, -100, 0]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
        ],
    );
    let want: Vec<f64> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            if dropout_keep([5, 77], i as u64, 0.4) {
                v as f64 / 0.6
            } else {
                0.0
            }
        })
        .collect();
    close(&got[0], &want, "dropout");
    let want: Vec<f64> = x.iter().map(|&v| (v as f64 * v as f64).ln_1p()).collect();
    close(&got[1], &want, "log1p");
    let want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    close(&got[2], &want, "stop_gradient");
    let row = |r: usize, y: usize| {
        let z = &lg[r * 4..r * 4 + 4];
        let lse = z.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        lse - z[y] as f64
    };
    close(
        &got[3],
        &[(row(0, 2) + row(2, 0)) / 2.0],
        "cross_entropy, a row ignored",
    );
}
