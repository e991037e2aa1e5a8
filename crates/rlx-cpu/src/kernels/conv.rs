//! Vision and regularisation kernels: convolution patches (im2col / col2im, the GEMM lowering
//! of conv2d), 2-D max / average pooling with their VJPs, seeded dropout and `log1p`.
use super::PAR_MIN;
use rayon::prelude::*;
use rlx_ir::{dropout_keep, Window};

/// The element types of the patch and pooling kernels: float32, and float64 on the CPU (the
/// same loops; float64 runs without the fused pairs of `conv_gemm`).
pub trait Px:
    Copy
    + Default
    + Send
    + Sync
    + PartialOrd
    + std::ops::AddAssign
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + 'static
{
    const NEG_INF: Self;
    fn is_nan(self) -> bool;
    /// `1 / n` for an average's `n` elements (in the type: float32 rounds it once, as before).
    fn inv(n: usize) -> Self;
}

impl Px for f32 {
    const NEG_INF: f32 = f32::NEG_INFINITY;
    #[inline(always)]
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    #[inline(always)]
    fn inv(n: usize) -> f32 {
        1.0 / n as f32
    }
}

impl Px for f64 {
    const NEG_INF: f64 = f64::NEG_INFINITY;
    #[inline(always)]
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    #[inline(always)]
    fn inv(n: usize) -> f64 {
        1.0 / n as f64
    }
}

/// Runs `body(plane_index, out_plane)` over `out` split into planes of `plane` elements, in
/// parallel when the whole output is large.
#[inline(always)]
fn planes<T: Px>(out: &mut [T], plane: usize, body: impl Fn(usize, &mut [T]) + Sync) {
    let work = out.len();
    planes_on(out, plane, work, body)
}

/// [`planes`], split between the threads only when `work` (the elements the kernel reads or
/// writes, 0 for never) is large.
#[inline(always)]
fn planes_on<T: Px>(
    out: &mut [T],
    plane: usize,
    work: usize,
    body: impl Fn(usize, &mut [T]) + Sync,
) {
    if out.is_empty() || plane == 0 {
        return;
    }
    let n = out.len() / plane;
    if work >= PAR_MIN / 4 && n > 1 {
        // A few tasks per thread, each a run of whole planes (a task per small plane costs
        // more in scheduling than the plane's work).
        let per = n.div_ceil(rayon::current_num_threads() * 4).max(1);
        out.par_chunks_mut(per * plane)
            .enumerate()
            .for_each(|(c, run)| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || {
                        run.chunks_mut(plane)
                            .enumerate()
                            .for_each(|(i, o)| body(c * per + i, o))
                    },
                )
            });
    } else {
        crate::isa::dispatch(
            #[inline(always)]
            || {
                out.chunks_mut(plane)
                    .enumerate()
                    .for_each(|(i, o)| body(i, o))
            },
        );
    }
}

/// `dst = src` for the few elements of one kernel row: the common widths unrolled (a call to
/// `memcpy` per 3 floats costs more than the copy).
#[inline(always)]
fn copy_short<T: Px>(dst: &mut [T], src: &[T]) {
    match (dst, src) {
        ([d0], [s0]) => *d0 = *s0,
        ([d0, d1, d2], [s0, s1, s2]) => (*d0, *d1, *d2) = (*s0, *s1, *s2),
        (d, s) => d.copy_from_slice(s),
    }
}

/// `dst += src` for the few elements of one kernel row (see [`copy_short`]).
#[inline(always)]
fn add_short<T: Px>(dst: &mut [T], src: &[T]) {
    match (dst, src) {
        ([d0], [s0]) => *d0 += *s0,
        ([d0, d1, d2], [s0, s1, s2]) => {
            *d0 += *s0;
            *d1 += *s1;
            *d2 += *s2;
        }
        (d, s) => d.iter_mut().zip(s).for_each(|(t, &v)| *t += v),
    }
}

/// `Op::Im2Col`: [`im2col_k`] (tap-major) or [`im2col`].
pub fn patches<T: Px>(k_major: bool, x: &[T], xd: &[usize], w: &Window, out: &mut [T]) {
    if k_major {
        im2col_k(x, xd, w, out)
    } else {
        im2col(x, xd, w, out)
    }
}

/// `Op::Col2Im`: [`col2im_k`] (tap-major) or [`col2im`].
pub fn unpatch<T: Px>(k_major: bool, cols: &[T], w: &Window, od: &[usize], out: &mut [T]) {
    if k_major {
        col2im_k(cols, w, od, out)
    } else {
        col2im(cols, w, od, out)
    }
}

/// x `[N, C, H, W]` (dims `xd`) into patches `[N, Ho*Wo, C*kh*kw]`: row `oy*Wo + ox` holds
/// the window of output (oy, ox), channel-major, zeros where it reaches into the padding.
pub fn im2col<T: Px>(x: &[T], xd: &[usize], w: &Window, out: &mut [T]) {
    let (c, h, wd) = (xd[1], xd[2], xd[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let [kh, kw] = w.kernel;
    let k = c * kh * kw;
    let rxs: Vec<_> = (0..ow)
        .map(|ox| span(ox, kw, w.stride[1], w.padding[1], wd))
        .collect();
    // One task unit: the patches of one output row (n, oy).
    planes(
        out,
        ow * k,
        #[inline(always)]
        |row, o| {
            let (n, oy) = (row / oh, row % oh);
            let img = &x[n * c * h * wd..(n + 1) * c * h * wd];
            let (ilo, ihi, iy0) = span(oy, kh, w.stride[0], w.padding[0], h);
            for (dst, &(jlo, jhi, ix0)) in o.chunks_exact_mut(k).zip(&rxs) {
                if ihi - ilo < kh || jhi - jlo < kw {
                    dst.fill(T::default());
                }
                for ch in 0..c {
                    for i in ilo..ihi {
                        let line = (ch * h + iy0 + i - ilo) * wd + ix0;
                        let d = (ch * kh + i) * kw;
                        copy_short(&mut dst[d + jlo..d + jhi], &img[line..line + jhi - jlo]);
                    }
                }
            }
        },
    );
}

/// Patches `[N, Ho*Wo, C*kh*kw]` summed back into an image `[N, C, H, W]` (dims `od`).
pub fn col2im<T: Px>(cols: &[T], w: &Window, od: &[usize], out: &mut [T]) {
    let (c, h, wd) = (od[1], od[2], od[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let [kh, kw] = w.kernel;
    let k = c * kh * kw;
    let rxs: Vec<_> = (0..ow)
        .map(|ox| span(ox, kw, w.stride[1], w.padding[1], wd))
        .collect();
    // Split by the patches read: the image written is a ninth of them for a 3x3 kernel.
    planes_on(
        out,
        c * h * wd,
        cols.len(),
        #[inline(always)]
        |n, img| {
            img.fill(T::default());
            let patches = &cols[n * oh * ow * k..(n + 1) * oh * ow * k];
            for oy in 0..oh {
                let (ilo, ihi, iy0) = span(oy, kh, w.stride[0], w.padding[0], h);
                for (ox, &(jlo, jhi, ix0)) in rxs.iter().enumerate() {
                    let src = &patches[(oy * ow + ox) * k..(oy * ow + ox + 1) * k];
                    for ch in 0..c {
                        for i in ilo..ihi {
                            let line = (ch * h + iy0 + i - ilo) * wd + ix0;
                            let d = (ch * kh + i) * kw;
                            add_short(&mut img[line..line + jhi - jlo], &src[d + jlo..d + jhi]);
                        }
                    }
                }
            }
        },
    );
}

/// The output positions `[lo, hi)` (of `o` in all) whose kernel tap `j` lands inside
/// `0..size`: input index `o * stride + j - pad`.
#[inline(always)]
fn tap_span(j: usize, o: usize, stride: usize, pad: usize, size: usize) -> (usize, usize) {
    let lo = pad.saturating_sub(j).div_ceil(stride).min(o);
    let hi = (size + pad)
        .saturating_sub(j)
        .div_ceil(stride)
        .min(o)
        .max(lo);
    (lo, hi)
}

/// x `[N, C, H, W]` into tap-major patches `[N, C*kh*kw, Ho*Wo]`: row `(c*kh + i)*kw + j`
/// holds tap (i, j) of channel c at every output position, zeros where it reaches into the
/// padding. Each output row is a run of (shifted, for stride 1 contiguous) input row pieces.
pub fn im2col_k<T: Px>(x: &[T], xd: &[usize], w: &Window, out: &mut [T]) {
    im2col_k_on(x, xd, w, out, true)
}

/// [`im2col_k`], on the calling thread only unless `par`.
pub fn im2col_k_on<T: Px>(x: &[T], xd: &[usize], w: &Window, out: &mut [T], par: bool) {
    let (c, h, wd) = (xd[1], xd[2], xd[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let [kh, kw] = w.kernel;
    let ([sh, sw], [ph, pw]) = (w.stride, w.padding);
    let k = c * kh * kw;
    let work = if par { out.len() } else { 0 };
    planes_on(
        out,
        oh * ow,
        work,
        #[inline(always)]
        |row, o| {
            let (n, kk) = (row / k, row % k);
            let (ch, i, j) = (kk / (kh * kw), kk / kw % kh, kk % kw);
            let plane = &x[(n * c + ch) * h * wd..(n * c + ch + 1) * h * wd];
            let (lo, hi) = tap_span(j, ow, sw, pw, wd);
            for (oy, dst) in o.chunks_exact_mut(ow).enumerate() {
                let iy = (oy * sh + i).wrapping_sub(ph);
                // A row in the padding, or a tap that misses every column (a kernel wider
                // than the padded image's reach): zeros.
                if iy >= h || lo == hi {
                    dst.fill(T::default());
                    continue;
                }
                dst[..lo].fill(T::default());
                dst[hi..].fill(T::default());
                let x0 = iy * wd + (lo * sw + j) - pw;
                if sw == 1 {
                    dst[lo..hi].copy_from_slice(&plane[x0..x0 + hi - lo]);
                } else {
                    for (d, s) in dst[lo..hi].iter_mut().zip(plane[x0..].iter().step_by(sw)) {
                        *d = *s;
                    }
                }
            }
        },
    );
}

/// Tap-major patches `[N, C*kh*kw, Ho*Wo]` summed back into an image `[N, C, H, W]` (dims
/// `od`): the adjoint of [`im2col_k`], one (image, channel) plane per task.
pub fn col2im_k<T: Px>(cols: &[T], w: &Window, od: &[usize], out: &mut [T]) {
    col2im_k_on(cols, w, od, out, true)
}

/// [`col2im_k`], on the calling thread only unless `par`.
pub fn col2im_k_on<T: Px>(cols: &[T], w: &Window, od: &[usize], out: &mut [T], par: bool) {
    let (h, wd) = (od[2], od[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let [kh, kw] = w.kernel;
    let ([sh, sw], [ph, pw]) = (w.stride, w.padding);
    let p = oh * ow;
    planes_on(
        out,
        h * wd,
        if par { cols.len() } else { 0 },
        #[inline(always)]
        |nc, img| {
            img.fill(T::default());
            // The taps of this channel: rows nc*kh*kw .. (nc+1)*kh*kw of the patches.
            let taps = &cols[nc * kh * kw * p..(nc + 1) * kh * kw * p];
            for i in 0..kh {
                for j in 0..kw {
                    let row = &taps[(i * kw + j) * p..(i * kw + j + 1) * p];
                    let (lo, hi) = tap_span(j, ow, sw, pw, wd);
                    for (oy, src) in row.chunks_exact(ow).enumerate() {
                        let iy = (oy * sh + i).wrapping_sub(ph);
                        if iy >= h || lo == hi {
                            continue;
                        }
                        let x0 = iy * wd + (lo * sw + j) - pw;
                        if sw == 1 {
                            img[x0..x0 + hi - lo]
                                .iter_mut()
                                .zip(&src[lo..hi])
                                .for_each(|(t, &v)| *t += v);
                        } else {
                            for (t, &v) in img[x0..].iter_mut().step_by(sw).zip(&src[lo..hi]) {
                                *t += v;
                            }
                        }
                    }
                }
            }
        },
    );
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
fn argmax<T: Px>(
    img: &[T],
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
pub fn pool2d<T: Px>(x: &[T], xd: &[usize], w: &Window, max: bool, out: &mut [T]) {
    let (h, wd) = (xd[2], xd[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let inv = T::inv(w.kernel[0] * w.kernel[1]);
    let rxs: Vec<_> = (0..ow)
        .map(|xo| span(xo, w.kernel[1], w.stride[1], w.padding[1], wd))
        .collect();
    if max && w.padding == [0, 0] {
        // Every window lies inside the image: one output row at a time, folding the kernel's
        // rows into it (NaN propagates).
        let ([kh, kw], [sh, sw]) = (w.kernel, w.stride);
        let nan_max = |a: T, b: T| if a > b || a.is_nan() { a } else { b };
        if [kh, kw, sh, sw] == [2, 2, 2, 2] {
            planes(
                out,
                oh * ow,
                #[inline(always)]
                |nc, o| {
                    let img = &x[nc * h * wd..(nc + 1) * h * wd];
                    for (y, orow) in o.chunks_exact_mut(ow).enumerate() {
                        let i0 = &img[2 * y * wd..2 * y * wd + 2 * ow];
                        let i1 = &img[(2 * y + 1) * wd..(2 * y + 1) * wd + 2 * ow];
                        for ((m, p), q) in orow
                            .iter_mut()
                            .zip(i0.chunks_exact(2))
                            .zip(i1.chunks_exact(2))
                        {
                            *m = nan_max(nan_max(p[0], p[1]), nan_max(q[0], q[1]));
                        }
                    }
                },
            );
            return;
        }
        planes(
            out,
            oh * ow,
            #[inline(always)]
            |nc, o| {
                let img = &x[nc * h * wd..(nc + 1) * h * wd];
                for (y, orow) in o.chunks_exact_mut(ow).enumerate() {
                    orow.fill(T::NEG_INF);
                    for i in 0..kh {
                        let line = &img[(y * sh + i) * wd..(y * sh + i + 1) * wd];
                        for j in 0..kw {
                            // Column j of every window of this row: a strided walk with a
                            // branch-free select (random data would mispredict a branch half the
                            // time).
                            for (m, &v) in orow.iter_mut().zip(line[j..].iter().step_by(sw)) {
                                *m = if v > *m || v.is_nan() { v } else { *m };
                            }
                        }
                    }
                }
            },
        );
        return;
    }
    planes(
        out,
        oh * ow,
        #[inline(always)]
        |nc, o| {
            let img = &x[nc * h * wd..(nc + 1) * h * wd];
            for y in 0..oh {
                let ry = span(y, w.kernel[0], w.stride[0], w.padding[0], h);
                for (xo, &rx) in rxs.iter().enumerate() {
                    o[y * ow + xo] = if max {
                        argmax(img, wd, ry, rx).map_or(T::NEG_INF, |at| img[at])
                    } else {
                        let mut s = T::default();
                        for i in 0..ry.1 - ry.0 {
                            let line = (ry.2 + i) * wd + rx.2;
                            let mut r = T::default();
                            for &v in &img[line..line + rx.1 - rx.0] {
                                r += v;
                            }
                            s += r;
                        }
                        s * inv
                    };
                }
            }
        },
    );
}

/// Rows of fewer than this many 2x2 windows get their max-pool gradient a block of row pairs
/// at a time.
const NARROW: usize = 16;
/// Windows in one block of narrow row pairs (at least `NARROW`, so that a block has a row pair).
const NARROW_WINDOWS: usize = 64;

/// Copies the `pairs` row pairs from pair `first` of `x` (rows of `wd` elements, an even count
/// per image, so that row pairs run on across images) into `i0` (the even rows) and `i1` (the
/// odd rows), each contiguous; returns the elements copied into each.
#[inline(always)]
fn gather_row_pairs<T: Px>(
    x: &[T],
    wd: usize,
    first: usize,
    pairs: usize,
    i0: &mut [T],
    i1: &mut [T],
) -> usize {
    let src = &x[first * 2 * wd..(first + pairs) * 2 * wd];
    for ((pair, r0), r1) in src
        .chunks_exact(2 * wd)
        .zip(i0.chunks_exact_mut(wd))
        .zip(i1.chunks_exact_mut(wd))
    {
        r0.copy_from_slice(&pair[..wd]);
        r1.copy_from_slice(&pair[wd..]);
    }
    pairs * wd
}

/// One row of 2x2, stride-2 max-pool windows: the gradient `g[j]` goes to the first maximum
/// (or the first NaN) of window j — (`i0[2j]`, `i0[2j+1]`, `i1[2j]`, `i1[2j+1]`) — and zeros to
/// the other three. Written with plain indices and selects so it vectorizes (stride-2 loads
/// and stores).
#[inline(always)]
fn window_row_grad<T: Px>(i0: &[T], i1: &[T], g: &[T], o0: &mut [T], o1: &mut [T]) {
    let n = g.len();
    let (i0, i1, o0, o1) = (
        &i0[..2 * n],
        &i1[..2 * n],
        &mut o0[..2 * n],
        &mut o1[..2 * n],
    );
    for j in 0..n {
        let (a, b, c, d, gv) = (i0[2 * j], i0[2 * j + 1], i1[2 * j], i1[2 * j + 1], g[j]);
        // `v` beats `best` when larger, or NaN over a number: the first maximum wins ties.
        let beats = |v: T, best: T| v > best || (v.is_nan() && !best.is_nan());
        let tb = beats(b, a);
        let best = if tb { b } else { a };
        let tc = beats(c, best);
        let best = if tc { c } else { best };
        let td = beats(d, best);
        let zero = T::default();
        o0[2 * j] = if !tb && !tc && !td { gv } else { zero };
        o0[2 * j + 1] = if tb && !tc && !td { gv } else { zero };
        o1[2 * j] = if tc && !td { gv } else { zero };
        o1[2 * j + 1] = if td { gv } else { zero };
    }
}

/// The VJP of `pool2d` w.r.t. x: `g` `[N, C, Ho, Wo]` into `[N, C, H, W]`.
pub fn pool2d_grad<T: Px>(x: &[T], xd: &[usize], g: &[T], w: &Window, max: bool, out: &mut [T]) {
    let (h, wd) = (xd[2], xd[3]);
    let [oh, ow] = w.out_size([h, wd]).expect("checked by infer");
    let inv = T::inv(w.kernel[0] * w.kernel[1]);
    let rxs: Vec<_> = (0..ow)
        .map(|xo| span(xo, w.kernel[1], w.stride[1], w.padding[1], wd))
        .collect();
    if max && w.padding == [0, 0] {
        let ([kh, kw], [sh, sw]) = (w.kernel, w.stride);
        if [kh, kw, sh, sw] == [2, 2, 2, 2] && h == 2 * oh && wd == 2 * ow && ow < NARROW {
            // Narrow rows: blocks of row pairs gathered into two contiguous rows each, so that
            // the loop runs over a block's windows, not over one row's few (a short loop's
            // scalar remainder mispredicts on real data); the gradient rows are scattered back.
            let k = NARROW_WINDOWS / ow;
            planes(
                out,
                k * 2 * wd,
                #[inline(always)]
                |b, gx| {
                    let z = T::default();
                    let (i0, i1) = &mut ([z; 2 * NARROW_WINDOWS], [z; 2 * NARROW_WINDOWS]);
                    let (o0, o1) = &mut ([z; 2 * NARROW_WINDOWS], [z; 2 * NARROW_WINDOWS]);
                    let pairs = gx.len() / (2 * wd);
                    let n = gather_row_pairs(x, wd, b * k, pairs, i0, i1);
                    let gp = &g[b * k * ow..(b * k + pairs) * ow];
                    window_row_grad(&i0[..n], &i1[..n], gp, &mut o0[..n], &mut o1[..n]);
                    for ((pair, r0), r1) in gx
                        .chunks_exact_mut(2 * wd)
                        .zip(o0[..n].chunks_exact(wd))
                        .zip(o1[..n].chunks_exact(wd))
                    {
                        pair[..wd].copy_from_slice(r0);
                        pair[wd..].copy_from_slice(r1);
                    }
                },
            );
            return;
        }
        if [kh, kw, sh, sw] == [2, 2, 2, 2] {
            planes(
                out,
                h * wd,
                #[inline(always)]
                |nc, gx| {
                    let img = &x[nc * h * wd..(nc + 1) * h * wd];
                    let gp = &g[nc * oh * ow..(nc + 1) * oh * ow];
                    // Rows and columns past the last window (odd sizes) stay 0.
                    if h != 2 * oh || wd != 2 * ow {
                        gx.fill(T::default());
                    }
                    for y in 0..oh {
                        let (r0, r1) = (2 * y * wd, (2 * y + 1) * wd);
                        let (o0, o1) = gx.split_at_mut(r1);
                        window_row_grad(
                            &img[r0..r0 + 2 * ow],
                            &img[r1..r1 + 2 * ow],
                            &gp[y * ow..(y + 1) * ow],
                            &mut o0[r0..r0 + 2 * ow],
                            &mut o1[..2 * ow],
                        );
                    }
                },
            );
            return;
        }
        planes(
            out,
            h * wd,
            #[inline(always)]
            |nc, gx| {
                gx.fill(T::default());
                let img = &x[nc * h * wd..(nc + 1) * h * wd];
                let gp = &g[nc * oh * ow..(nc + 1) * oh * ow];
                for y in 0..oh {
                    for xo in 0..ow {
                        let base = y * sh * wd + xo * sw;
                        let (mut at, mut best) = (base, img[base]);
                        for i in 0..kh {
                            for j in 0..kw {
                                let v = img[base + i * wd + j];
                                // The first maximum, or the first NaN (then kept): branch-free.
                                let take = v > best || (v.is_nan() && !best.is_nan());
                                at = if take { base + i * wd + j } else { at };
                                best = if take { v } else { best };
                            }
                        }
                        gx[at] += gp[y * ow + xo];
                    }
                }
            },
        );
        return;
    }
    planes(
        out,
        h * wd,
        #[inline(always)]
        |nc, gx| {
            gx.fill(T::default());
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
        },
    );
}

/// `x * keep / (1 - p)` with the mask of [`rlx_ir::dropout_keep`].
pub fn dropout<T: Copy + Send + Sync + std::ops::Mul<Output = T> + Default + From<f32>>(
    x: &[T],
    seed: [i32; 2],
    p: f32,
    out: &mut [T],
) {
    // 1 / (1 - p) in float32 (the float32 path's value), widened for float64.
    let scale = T::from(1.0 / (1.0 - p));
    const CHUNK: usize = 1 << 14;
    // The mask hash is branch-free integer arithmetic: the compiled copy for the CPU's vector
    // extensions runs it over a vector of indices at a time.
    let body = |c: usize, o: &mut [T]| {
        let base = c * CHUNK;
        let x = &x[base..base + o.len()];
        crate::isa::dispatch(
            #[inline(always)]
            || {
                for (k, (v, &xv)) in o.iter_mut().zip(x).enumerate() {
                    let keep = dropout_keep(seed, (base + k) as u64, p);
                    *v = if keep { xv * scale } else { T::default() };
                }
            },
        )
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
        for (case, (k, s, p)) in [
            (3, 1, 1),
            (3, 2, 1),
            (2, 2, 0),
            (5, 1, 2),
            (1, 1, 0),
            (3, 1, 3),
            (5, 1, 2),
            (5, 2, 2),
        ]
        .into_iter()
        .enumerate()
        {
            let w = win(k, s, p);
            // The last two on a 4 x 1 image: taps that miss every column.
            let (n, c, h, wd) = if case >= 6 {
                (2, 3, 4, 1)
            } else {
                (2, 3, 5, 6)
            };
            let x: Vec<f32> = (0..n * c * h * wd)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let [oh, ow] = w.out_size([h, wd]).unwrap();
            let mut cols = vec![f32::NAN; n * c * k * k * oh * ow];
            im2col(&x, &[n, c, h, wd], &w, &mut cols);
            for (idx, &v) in cols.iter().enumerate() {
                let row = idx % (c * k * k);
                let col = (idx / (c * k * k)) % (oh * ow);
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
            // Tap-major: each image's patch matrix transposed, and its adjoint gives the same
            // image back from the transposed `r`.
            let (kk, pp) = (c * k * k, oh * ow);
            let t = |m: &[f32]| -> Vec<f32> {
                (0..m.len())
                    .map(|i| m[(i / (kk * pp) * pp + i % pp) * kk + i / pp % kk])
                    .collect()
            };
            let mut cols_k = vec![f32::NAN; cols.len()];
            im2col_k(&x, &[n, c, h, wd], &w, &mut cols_k);
            assert_eq!(cols_k, t(&cols), "k-major k{k} s{s} p{p}");
            let mut back_k = vec![f32::NAN; x.len()];
            col2im_k(&t(&r), &w, &[n, c, h, wd], &mut back_k);
            for (a, b) in back_k.iter().zip(&back) {
                assert!((a - b).abs() < 1e-5, "k-major col2im k{k} s{s} p{p}");
            }
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
        // NaN propagates and takes the gradient (the first NaN of its window), with and
        // without padding.
        let x = [1.0, f32::NAN, 3.0, 0.0, f32::NAN, 9.0, 1.0, 0.0];
        for pad in [0, 1] {
            let w = win(2, 2, pad);
            let [oh, ow] = w.out_size([2, 4]).unwrap();
            let mut y = vec![0.0; oh * ow];
            pool2d(&x, &[1, 1, 2, 4], &w, true, &mut y);
            let mut gx = [0.0; 8];
            pool2d_grad(&x, &[1, 1, 2, 4], &vec![1.0; oh * ow], &w, true, &mut gx);
            if pad == 0 {
                assert!(y[0].is_nan() && y[1] == 3.0, "{y:?}");
                assert_eq!(gx, [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
            } else {
                // Windows over columns (-1, 0), (1, 2), (3, 4) of rows -1..1 and 1..3.
                assert!(y[1].is_nan() && y[3].is_nan() && y[4] == 9.0, "{y:?}");
                assert_eq!(gx[1], 1.0);
                assert_eq!(gx[4], 1.0);
            }
        }
    }

    /// The vectorized 2x2 stride-2 gradient, on long rows and on narrow ones (blocks of row
    /// pairs across images, a short last block, split between threads), with ties, NaNs and odd
    /// sizes (a last row and column no window covers), against a naive first-maximum walk.
    #[test]
    fn max_pool_2x2_gradient_matches_a_naive_walk() {
        // Wide rows, odd sizes, and narrow rows (blocks of row pairs across images, the last
        // block short).
        for xd in [
            [2usize, 3, 6, 40],
            [1, 2, 7, 37],
            [3, 5, 8, 8],
            [2, 3, 4, 6],
            [5, 7, 6, 2],
            [64, 3, 4, 4],
            [256, 17, 4, 4],
        ] {
            let (h, wd) = (xd[2], xd[3]);
            let (oh, ow) = (h / 2, wd / 2);
            let total: usize = xd.iter().product();
            let vals = [0.0f32, 1.0, 2.0, f32::NAN, -1.0];
            let x: Vec<f32> = (0..total).map(|i| vals[(i * 7 + i / 3) % 5]).collect();
            let g: Vec<f32> = (0..total / (h * wd) * oh * ow)
                .map(|i| i as f32 + 1.0)
                .collect();
            let mut want = vec![0.0f32; total];
            for nc in 0..xd[0] * xd[1] {
                for y in 0..oh {
                    for xo in 0..ow {
                        let at = |i: usize, j: usize| nc * h * wd + (2 * y + i) * wd + 2 * xo + j;
                        let mut best = at(0, 0);
                        for (i, j) in [(0, 1), (1, 0), (1, 1)] {
                            let (v, b) = (x[at(i, j)], x[best]);
                            if v > b || (v.is_nan() && !b.is_nan()) {
                                best = at(i, j);
                            }
                        }
                        want[best] += g[(nc * oh + y) * ow + xo];
                    }
                }
            }
            let mut got = vec![7.0f32; total];
            pool2d_grad(&x, &xd, &g, &win(2, 2, 0), true, &mut got);
            assert_eq!(got, want, "{xd:?}");
        }
    }

    /// Element i is kept exactly where `dropout_keep` says, across chunks, serial and split.
    #[test]
    fn dropout_mask_is_the_shared_hash() {
        for n in [40_000usize, PAR_MIN + 5] {
            let x: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
            let mut y = vec![0.0; n];
            dropout(&x, [-3, 11], 0.4, &mut y);
            for (i, (&v, &xv)) in y.iter().zip(&x).enumerate() {
                let want = if dropout_keep([-3, 11], i as u64, 0.4) {
                    xv * (1.0 / (1.0 - 0.4f32))
                } else {
                    0.0
                };
                assert_eq!(v, want, "element {i} of {n}");
            }
        }
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
