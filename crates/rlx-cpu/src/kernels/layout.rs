//! Data movement kernels: broadcasting and transposition as one strided gather (a float32 swap
//! of the last two axes as 8 x 8 register blocks); slicing, zero padding and concatenation along
//! an axis as block copies.
use super::{map_rows, Strided, PAR_MIN};
use rayon::prelude::*;

/// Whether `perm` swaps the last two axes and keeps the others (a batch of matrix transposes).
pub fn swaps_last_two(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
}

/// `out[b][j][i] = x[b][i][j]` for a batch of `rows x cols` matrices: 8 x 8 blocks transposed in
/// registers where the chosen instruction set has AVX2 (`RLX_CPU_ISA=portable` moves element by
/// element), the edges element by element; split over the threads by
/// matrices when large.
pub fn transpose_last_two(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    let m = rows * cols;
    if m == 0 {
        return;
    }
    let blocks = crate::isa::current().has_avx2() && crate::sgemm::transpose8_available();
    let one = |(b, o): (usize, &mut [f32])| {
        let src = &x[b * m..(b + 1) * m];
        let (r8, c8) = if blocks {
            (rows / 8 * 8, cols / 8 * 8)
        } else {
            (0, 0)
        };
        for i in (0..r8).step_by(8) {
            for j in (0..c8).step_by(8) {
                crate::sgemm::transpose8(&src[i * cols + j..], cols, &mut o[j * rows + i..], rows);
            }
        }
        for i in 0..rows {
            // Columns right of the blocks, then (below the blocks) whole rows.
            let from = if i < r8 { c8 } else { 0 };
            for j in from..cols {
                o[j * rows + i] = src[i * cols + j];
            }
        }
    };
    if out.len() >= PAR_MIN / 4 && out.len() > m {
        out.par_chunks_mut(m).enumerate().for_each(one);
    } else {
        out.chunks_mut(m).enumerate().for_each(one);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocked transpose against the strided gather, on block multiples, edges, a single
    /// matrix and a batch large enough to split.
    #[test]
    fn batched_transpose_matches_the_gather() {
        for (batch, r, c) in [
            (2, 8, 8),
            (3, 17, 9),
            (2, 5, 3),
            (1, 64, 16),
            (64, 64, 16),
            (4, 9, 40),
        ] {
            let d = [batch, r, c];
            let x: Vec<f32> = (0..batch * r * c).map(|i| i as f32).collect();
            let mut want = vec![0.0f32; x.len()];
            gather(
                &x,
                &Strided::permuted(&d, &[0, 2, 1]),
                &[batch, c, r],
                &mut want,
            );
            let mut got = vec![-1.0f32; x.len()];
            transpose_last_two(&x, r, c, &mut got);
            assert_eq!(got, want, "{d:?}");
        }
        assert!(swaps_last_two(&[0, 2, 1]) && swaps_last_two(&[1, 0]));
        assert!(
            !swaps_last_two(&[1, 0, 2]) && !swaps_last_two(&[2, 1, 0]) && !swaps_last_two(&[0])
        );
    }
}
