//! conv2d's GEMMs run image by image together with the patch copies beside them: `im2col` then
//! the forward product, and the input-gradient product then `col2im`. Each image's patches
//! (hundreds of KB) are read back from cache right after they are written, instead of from
//! memory after the whole batch's patches (tens of MB) went by. The executor pairs the two
//! instructions (`exec.rs` says when it may); the results are exactly those of running them one
//! after the other, patches included.
use super::conv::{col2im_k_on, im2col_k_on};
use super::fused::{product_epilogue, Shares};
use super::matmul::{gemm_view, View, PAR_FLOPS};
use rayon::prelude::*;
use rlx_ir::{Fused, Window};

/// A matmul epilogue: its expression and its inputs after the two operands.
pub type Epilogue<'a, 'b> = (&'a Fused, &'b [(&'a [f32], &'a [usize])]);

/// `cols = im2col_k(x)` (tap-major patches `[N, K, P]` of x `[N, C, H, W]`), then
/// `out = f(a @ cols, xs..)` (or `a @ cols` without an epilogue) for a shared `a` `[M, K]`, image
/// by image. Returns false, doing nothing, where the epilogue's inputs cannot be split by
/// image (the caller runs the two instructions instead).
#[allow(clippy::too_many_arguments)]
pub fn im2col_matmul(
    x: &[f32],
    xd: &[usize],
    w: &Window,
    cols: &mut [f32],
    a: &[f32],
    ad: &[usize],
    epilogue: Option<Epilogue>,
    out: &mut [f32],
) -> bool {
    let images = xd[0];
    let (m, k) = (ad[0], ad[1]);
    if images == 0 || m == 0 || k == 0 || cols.is_empty() {
        return false;
    }
    let p = cols.len() / (images * k);
    let shares = match epilogue {
        Some((f, xs)) => match Shares::new(f, images, xs, out.len()) {
            Some(s) => Some((f, s)),
            None => return false,
        },
        None => None,
    };
    let one_x = x.len() / images;
    let one_dims = [1, xd[1], xd[2], xd[3]];
    let one = |i: usize, patches: &mut [f32], o: &mut [f32]| {
        im2col_k_on(&x[i * one_x..(i + 1) * one_x], &one_dims, w, patches, false);
        let (b, bv) = (&*patches, View::rows(0, p));
        match &shares {
            Some((f, s)) => product_epilogue(f, s, i, [m, p, k], (a, View::rows(0, k)), (b, bv), o),
            None => gemm_view(
                m,
                p,
                k,
                o,
                View::rows(0, p),
                0.0,
                a,
                View::rows(0, k),
                b,
                bv,
            ),
        }
    };
    each_image(cols, out, images, images * m * p * k, one);
    true
}

/// `cols = op(a) @ dy` for a shared `a` (`[O, K]` transposed when `ta`, else `[K, O]`) and
/// `dy` `[N, O, P]`, then `out = col2im_k(cols)` (an image `[N, C, H, W]`, dims `od`), image by
/// image.
#[allow(clippy::too_many_arguments)]
pub fn matmul_col2im(
    a: &[f32],
    ad: &[usize],
    ta: bool,
    dy: &[f32],
    cols: &mut [f32],
    w: &Window,
    od: &[usize],
    out: &mut [f32],
) {
    let images = od[0];
    let (m, k) = if ta { (ad[1], ad[0]) } else { (ad[0], ad[1]) };
    if images == 0 || m == 0 || cols.is_empty() {
        return;
    }
    let p = cols.len() / (images * m);
    let av = if ta {
        View::rows(0, m).t()
    } else {
        View::rows(0, k)
    };
    let one_dims = [1, od[1], od[2], od[3]];
    let one = |i: usize, patches: &mut [f32], img: &mut [f32]| {
        let g = &dy[i * k * p..(i + 1) * k * p];
        gemm_view(
            m,
            p,
            k,
            patches,
            View::rows(0, p),
            0.0,
            a,
            av,
            g,
            View::rows(0, p),
        );
        col2im_k_on(patches, w, &one_dims, img, false);
    };
    each_image(cols, out, images, images * m * p * k, one);
}

/// Runs `one(image, its patches, its output)` for every image: `cols` and `out` split into
/// `images` equal parts, in parallel over the images when the products total at least
/// `PAR_FLOPS` multiply-adds.
fn each_image(
    cols: &mut [f32],
    out: &mut [f32],
    images: usize,
    flops: usize,
    one: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) {
    let (c, o) = (cols.len() / images, out.len() / images);
    if images > 1 && flops >= PAR_FLOPS {
        cols.par_chunks_mut(c)
            .zip(out.par_chunks_mut(o))
            .enumerate()
            .for_each(|(i, (c, o))| one(i, c, o));
    } else {
        cols.chunks_mut(c)
            .zip(out.chunks_mut(o))
            .enumerate()
            .for_each(|(i, (c, o))| one(i, c, o));
    }
}
