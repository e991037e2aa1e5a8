//! Vision and regularisation kernels: convolution patches (im2col / col2im, the GEMM lowering
//! of conv2d), 2-D max / average pooling with their VJPs, seeded dropout and `log1p`.
use super::PAR_MIN;
use rayon::prelude::*;
use rlx_ir::{dropout_keep, Window};

/// Runs `body(plane_index, out_plane)` over `out` split into planes of `plane` elements, in
/// parallel when the whole output is large.
#[inline(always)]
fn planes(out: &mut [f32], plane: usize, body: impl Fn(usize, &mut [f32]) + Sync) {
    if out.is_empty() || plane == 0 {
        return;
    }
    let n = out.len() / plane;
    if out.len() >= PAR_MIN / 4 && n > 1 {
        // A few tasks per thread, each a run of whole planes (a task per small plane costs
        // more in scheduling than the plane's work).
        let per = n.div_ceil(rayon::current_num_threads() * 4).max(1);
        out.par_chunks_mut(per * plane)
            .enumerate()
            .for_each(|(c, run)| {
                crate::isa::dispatch(|| {
                    run.chunks_mut(plane)
                        .enumerate()
                        .for_each(|(i, o)| body(c * per + i, o))
                })
            });
    } else {
        crate::isa::dispatch(|| {
            out.chunks_mut(plane)
                .enumerate()
                .for_each(|(i, o)| body(i, o))
        });
    }
}

/// Input row (or column) `o * stride + k - pad` when it lies inside `0..size`.
#[inline(always)]
fn src(o: usize, k: usize, stride: usize, pad: usize, size: usize) -> Option<usize> {
    (o * stride + k).checked_sub(pad).filter(|&v| v < size)
}

/// x `[N, C, H, W]` (dims `xd`) into patches `[N, C*kh*kw, Ho*Wo]`.
pub fn im2col(x: &[f32], xd: &[usize], w: &Window, out: &mut [f32]) {
    let (h, wd) = (xd[2], xd[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let [kh, kw] = w.kernel;
    let [sh, sw] = w.stride;
    let [ph, pw] = w.padding;
    let p = oh * ow;
    // One (n, c) plane of x gives kh*kw rows of patches.
    planes(out, kh * kw * p, |nc, o| {
        let img = &x[nc * h * wd..(nc + 1) * h * wd];
        for i in 0..kh {
            for j in 0..kw {
                let row = &mut o[(i * kw + j) * p..(i * kw + j + 1) * p];
                for y in 0..oh {
                    let dst = &mut row[y * ow..(y + 1) * ow];
                    let Some(iy) = src(y, i, sh, ph, h) else {
                        dst.fill(0.0);
                        continue;
                    };
                    let line = &img[iy * wd..(iy + 1) * wd];
                    if sw == 1 {
                        // Columns j - pw + ox, contiguous: zeros, a copy, zeros.
                        let lo = pw.saturating_sub(j).min(ow);
                        let hi = (wd + pw).saturating_sub(j).clamp(lo, ow);
                        dst[..lo].fill(0.0);
                        if hi > lo {
                            let start = lo + j - pw;
                            dst[lo..hi].copy_from_slice(&line[start..start + hi - lo]);
                        }
                        dst[hi..].fill(0.0);
                    } else {
                        for (xo, d) in dst.iter_mut().enumerate() {
                            *d = src(xo, j, sw, pw, wd).map_or(0.0, |ix| line[ix]);
                        }
                    }
                }
            }
        }
    });
}

/// Patches `[N, C*kh*kw, Ho*Wo]` summed back into an image `[N, C, H, W]` (dims `od`).
pub fn col2im(cols: &[f32], w: &Window, od: &[usize], out: &mut [f32]) {
    let (h, wd) = (od[2], od[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let [kh, kw] = w.kernel;
    let [sh, sw] = w.stride;
    let [ph, pw] = w.padding;
    let p = oh * ow;
    planes(out, h * wd, |nc, img| {
        img.fill(0.0);
        let patch = &cols[nc * kh * kw * p..(nc + 1) * kh * kw * p];
        for i in 0..kh {
            for j in 0..kw {
                let row = &patch[(i * kw + j) * p..(i * kw + j + 1) * p];
                for y in 0..oh {
                    let Some(iy) = src(y, i, sh, ph, h) else {
                        continue;
                    };
                    let line = &mut img[iy * wd..(iy + 1) * wd];
                    let from = &row[y * ow..(y + 1) * ow];
                    if sw == 1 {
                        let lo = pw.saturating_sub(j).min(ow);
                        let hi = (wd + pw).saturating_sub(j).clamp(lo, ow);
                        if hi > lo {
                            let start = lo + j - pw;
                            let to = &mut line[start..start + hi - lo];
                            for (d, s) in to.iter_mut().zip(&from[lo..hi]) {
                                *d += s;
                            }
                        }
                    } else {
                        for (xo, s) in from.iter().enumerate() {
                            if let Some(ix) = src(xo, j, sw, pw, wd) {
                                line[ix] += s;
                            }
                        }
                    }
                }
            }
        }
    });
}

/// The kernel offsets `[lo, hi)` of output position `o` that land inside `0..size`, and the
/// input index of offset `lo`.
#[inline(always)]
fn span(o: usize, k: usize, stride: usize, pad: usize, size: usize) -> (usize, usize, usize) {
    let start = o * stride;
    let lo = pad.saturating_sub(start).min(k);
    let hi = (size + pad).saturating_sub(start).min(k).max(lo);
    if hi == lo {
        return (lo, lo, 0);
    }
    (lo, hi, start + lo - pad)
}

/// The flat index (in the plane) of the first maximal element of the window with row span
/// `ry` and column span `rx` (NaN counts as maximal); `None` for a window wholly in padding.
#[inline(always)]
fn argmax(
    img: &[f32],
    wd: usize,
    ry: (usize, usize, usize),
    rx: (usize, usize, usize),
) -> Option<usize> {
    let (rows, cols) = (ry.1 - ry.0, rx.1 - rx.0);
    if rows == 0 || cols == 0 {
        return None;
    }
    let mut at = ry.2 * wd + rx.2;
    let mut best = img[at];
    if best.is_nan() {
        return Some(at);
    }
    for i in 0..rows {
        let line = (ry.2 + i) * wd + rx.2;
        for (j, &v) in img[line..line + cols].iter().enumerate() {
            if v > best || v.is_nan() {
                if v.is_nan() {
                    return Some(line + j);
                }
                best = v;
                at = line + j;
            }
        }
    }
    Some(at)
}

/// Max or average pooling of x `[N, C, H, W]` into `[N, C, Ho, Wo]`.
pub fn pool2d(x: &[f32], xd: &[usize], w: &Window, max: bool, out: &mut [f32]) {
    let (h, wd) = (xd[2], xd[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let inv = 1.0 / (w.kernel[0] * w.kernel[1]) as f32;
    let rxs: Vec<_> = (0..ow)
        .map(|xo| span(xo, w.kernel[1], w.stride[1], w.padding[1], wd))
        .collect();
    if max && w.padding == [0, 0] {
        // Every window lies inside the image: one output row at a time, folding the kernel's
        // rows into it (NaN propagates).
        let ([kh, kw], [sh, sw]) = (w.kernel, w.stride);
        planes(out, oh * ow, |nc, o| {
            let img = &x[nc * h * wd..(nc + 1) * h * wd];
            for (y, orow) in o.chunks_exact_mut(ow).enumerate() {
                orow.fill(f32::NEG_INFINITY);
                for i in 0..kh {
                    let line = &img[(y * sh + i) * wd..(y * sh + i + 1) * wd];
                    for (xo, m) in orow.iter_mut().enumerate() {
                        for &v in &line[xo * sw..xo * sw + kw] {
                            if v > *m || v.is_nan() {
                                *m = v;
                            }
                        }
                    }
                }
            }
        });
        return;
    }
    planes(out, oh * ow, |nc, o| {
        let img = &x[nc * h * wd..(nc + 1) * h * wd];
        for y in 0..oh {
            let ry = span(y, w.kernel[0], w.stride[0], w.padding[0], h);
            for (xo, &rx) in rxs.iter().enumerate() {
                o[y * ow + xo] = if max {
                    argmax(img, wd, ry, rx).map_or(f32::NEG_INFINITY, |at| img[at])
                } else {
                    let mut s = 0.0;
                    for i in 0..ry.1 - ry.0 {
                        let line = (ry.2 + i) * wd + rx.2;
                        s += img[line..line + rx.1 - rx.0].iter().sum::<f32>();
                    }
                    s * inv
                };
            }
        }
    });
}

/// The VJP of `pool2d` w.r.t. x: `g` `[N, C, Ho, Wo]` into `[N, C, H, W]`.
pub fn pool2d_grad(x: &[f32], xd: &[usize], g: &[f32], w: &Window, max: bool, out: &mut [f32]) {
    let (h, wd) = (xd[2], xd[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let inv = 1.0 / (w.kernel[0] * w.kernel[1]) as f32;
    let rxs: Vec<_> = (0..ow)
        .map(|xo| span(xo, w.kernel[1], w.stride[1], w.padding[1], wd))
        .collect();
    planes(out, h * wd, |nc, gx| {
        gx.fill(0.0);
        let img = &x[nc * h * wd..(nc + 1) * h * wd];
        let gp = &g[nc * oh * ow..(nc + 1) * oh * ow];
        for y in 0..oh {
            let ry = span(y, w.kernel[0], w.stride[0], w.padding[0], h);
            for (xo, &rx) in rxs.iter().enumerate() {
                let gv = gp[y * ow + xo];
                if max {
                    if let Some(at) = argmax(img, wd, ry, rx) {
                        gx[at] += gv;
                    }
                    continue;
                }
                for i in 0..ry.1 - ry.0 {
                    let line = (ry.2 + i) * wd + rx.2;
                    gx[line..line + rx.1 - rx.0]
                        .iter_mut()
                        .for_each(|v| *v += gv * inv);
                }
            }
        }
    });
}

/// `x * keep / (1 - p)` with the mask of [`rlx_ir::dropout_keep`].
pub fn dropout(x: &[f32], seed: [i32; 2], p: f32, out: &mut [f32]) {
    let scale = 1.0 / (1.0 - p);
    const CHUNK: usize = 1 << 14;
    let body = |c: usize, o: &mut [f32]| {
        let base = c * CHUNK;
        for (k, v) in o.iter_mut().enumerate() {
            let i = base + k;
            *v = if dropout_keep(seed, i as u64, p) {
                x[i] * scale
            } else {
                0.0
            };
        }
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, o)| body(c, o));
    } else {
        out.chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, o)| body(c, o));
    }
}

/// `log(1 + x)`.
pub fn log1p(x: &[f32], out: &mut [f32]) {
    super::par_zip(out, x, |o, &x| *o = x.ln_1p());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn win(k: usize, s: usize, p: usize) -> Window {
        Window {
            kernel: [k, k],
            stride: [s, s],
            padding: [p, p],
        }
    }

    /// im2col against the definition, for stride 1 (the contiguous path) and 2.
    #[test]
    fn im2col_matches_the_definition_and_col2im_is_its_adjoint() {
        for (k, s, p) in [
            (3, 1, 1),
            (3, 2, 1),
            (2, 2, 0),
            (5, 1, 2),
            (1, 1, 0),
            (3, 1, 3),
        ] {
            let w = win(k, s, p);
            let (n, c, h, wd) = (2, 3, 5, 6);
            let x: Vec<f32> = (0..n * c * h * wd)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let [oh, ow] = w.out_size([h, wd]).unwrap();
            let mut cols = vec![f32::NAN; n * c * k * k * oh * ow];
            im2col(&x, &[n, c, h, wd], &w, &mut cols);
            for (idx, &v) in cols.iter().enumerate() {
                let col = idx % (oh * ow);
                let row = (idx / (oh * ow)) % (c * k * k);
                let b = idx / (oh * ow * c * k * k);
                let (ch, i, j) = (row / (k * k), (row / k) % k, row % k);
                let (y, xo) = (col / ow, col % ow);
                let iy = (y * s + i) as isize - p as isize;
                let ix = (xo * s + j) as isize - p as isize;
                let want = if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                    0.0
                } else {
                    x[((b * c + ch) * h + iy as usize) * wd + ix as usize]
                };
                assert_eq!(v, want, "k{k} s{s} p{p} at {idx}");
            }
            // <im2col(x), c> == <x, col2im(c)>.
            let r: Vec<f32> = (0..cols.len()).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut back = vec![f32::NAN; x.len()];
            col2im(&r, &w, &[n, c, h, wd], &mut back);
            let lhs: f64 = cols.iter().zip(&r).map(|(a, b)| (a * b) as f64).sum();
            let rhs: f64 = x.iter().zip(&back).map(|(a, b)| (a * b) as f64).sum();
            assert!(
                (lhs - rhs).abs() < 1e-3 * lhs.abs().max(1.0),
                "k{k} s{s} p{p}"
            );
        }
    }

    #[test]
    fn max_pool_gives_the_first_maximum_its_gradient() {
        let w = win(2, 2, 0);
        let x = [1.0, 3.0, 3.0, 0.0, 2.0, 3.0, 1.0, 0.0];
        let mut y = [0.0; 2];
        pool2d(&x, &[1, 1, 2, 4], &w, true, &mut y);
        assert_eq!(y, [3.0, 3.0]);
        let mut gx = [9.0; 8];
        pool2d_grad(&x, &[1, 1, 2, 4], &[1.0, 2.0], &w, true, &mut gx);
        assert_eq!(gx, [0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn dropout_keeps_about_one_minus_p_and_scales() {
        let x = vec![1.0f32; 100_000];
        let mut y = vec![0.0; x.len()];
        dropout(&x, [7, 1], 0.3, &mut y);
        let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / x.len() as f64;
        assert!((kept - 0.7).abs() < 0.01, "{kept}");
        assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6));
        let mut z = vec![0.0; x.len()];
        dropout(&x, [7, 2], 0.3, &mut z);
        assert_ne!(y, z, "another counter gives another mask");
    }
}
