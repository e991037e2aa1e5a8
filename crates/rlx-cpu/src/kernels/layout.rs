//! Data movement kernels: broadcasting and transposition as one strided gather; slicing,
//! zero padding and concatenation along an axis as block copies.
use super::{map_rows, Strided};

/// `out[i] = src[offset of i under `how`]`.
#[inline(always)]
pub fn gather<T: Copy + Send + Sync>(src: &[T], how: &Strided, od: &[usize], out: &mut [T]) {
    map_rows(
        out,
        od,
        &[how],
        #[inline(always)]
        |row, st, sp| {
            if sp[0] == 1 {
                row.copy_from_slice(&src[st[0]..st[0] + row.len()]);
            } else {
                for (i, o) in row.iter_mut().enumerate() {
                    *o = src[st[0] + i * sp[0]];
                }
            }
        },
    );
}

/// Splits `dims` around `axis` into (outer count, axis length, inner count).
fn around(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    )
}

/// `out = x[..., start:start+len, ...]` along `axis`.
#[inline(always)]
pub fn slice<T: Copy>(x: &[T], xd: &[usize], axis: usize, start: usize, out: &mut [T]) {
    let (outer, n, inner) = around(xd, axis);
    let len = out.len().checked_div(outer * inner).unwrap_or(0);
    for o in 0..outer {
        let src = (o * n + start) * inner;
        out[o * len * inner..(o + 1) * len * inner].copy_from_slice(&x[src..src + len * inner]);
    }
}

/// `out` = `x` with `before` zero rows in front along `axis` (and zeros after).
#[inline(always)]
pub fn pad<T: Copy + Default>(
    x: &[T],
    xd: &[usize],
    axis: usize,
    before: usize,
    od: &[usize],
    out: &mut [T],
) {
    out.fill(T::default());
    let (outer, n, inner) = around(xd, axis);
    let m = od[axis];
    for o in 0..outer {
        let dst = (o * m + before) * inner;
        out[dst..dst + n * inner].copy_from_slice(&x[o * n * inner..(o + 1) * n * inner]);
    }
}

/// Joins `parts` (each with its dims) along `axis` into `out`.
#[inline(always)]
pub fn concat<T: Copy>(parts: &[(&[T], &[usize])], axis: usize, od: &[usize], out: &mut [T]) {
    let (outer, m, inner) = around(od, axis);
    let mut at = 0;
    for (x, xd) in parts {
        let n = xd[axis];
        for o in 0..outer {
            let dst = (o * m + at) * inner;
            out[dst..dst + n * inner].copy_from_slice(&x[o * n * inner..(o + 1) * n * inner]);
        }
        at += n;
    }
}
