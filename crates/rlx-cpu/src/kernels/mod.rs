//! CPU kernels, one file per op family, plus the strided row walker they share.
pub mod attention;
pub mod cast;
pub mod conv;
pub mod conv_gemm;
pub mod elementwise;
pub mod fused;
pub mod layout;
pub mod lowp;
pub mod math;
pub mod matmul;
pub mod nn;
pub mod optim;
pub mod reduce;
pub mod wide;

use rayon::prelude::*;

/// Runs `body` with this thread's scratch vector `key`, or with a fresh one when this thread is
/// already using it: a worker waiting inside a parallel loop runs other tasks meanwhile (of this
/// program, or of another program on the pool), and they may ask for the same scratch.
pub(crate) fn thread_scratch<R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<Vec<f32>>>,
    body: impl FnOnce(&mut Vec<f32>) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => body(&mut v),
        Err(_) => body(&mut Vec::new()),
    })
}

/// Below this many output elements a kernel runs on the calling thread: splitting costs more
/// than the work (32K was tried with the pool kept awake: within noise, so it stayed).
pub const PAR_MIN: usize = 1 << 18;

/// How a source tensor is read while walking an output shape: one element stride per output dim
/// (0 where the source is broadcast).
#[derive(Clone, Debug)]
pub struct Strided {
    pub strides: Vec<usize>,
}

impl Strided {
    /// Reading `src` (right-aligned, numpy rules) while walking `out`.
    pub fn broadcast(src: &[usize], out: &[usize]) -> Strided {
        let mut strides = vec![0; out.len()];
        let mut s = 1;
        for k in 1..=src.len() {
            let d = src[src.len() - k];
            if d != 1 {
                strides[out.len() - k] = s;
            }
            s *= d;
        }
        Strided { strides }
    }

    /// Reading `src` through a permutation: output dim `i` is source dim `perm[i]`.
    pub fn permuted(src: &[usize], perm: &[usize]) -> Strided {
        let contiguous = rlx_ir::Shape::from(src).strides();
        Strided {
            strides: perm.iter().map(|&p| contiguous[p]).collect(),
        }
    }
}

/// Merges adjacent dims that every operand walks contiguously, and drops size-1 dims.
fn collapse(dims: &[usize], ops: &[&Strided]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut cd: Vec<usize> = Vec::new();
    let mut cs: Vec<Vec<usize>> = vec![Vec::new(); ops.len()];
    for (d, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let mergeable = !cd.is_empty()
            && ops
                .iter()
                .enumerate()
                .all(|(k, o)| *cs[k].last().unwrap() == o.strides[d] * n);
        if mergeable {
            *cd.last_mut().unwrap() *= n;
            for (k, o) in ops.iter().enumerate() {
                *cs[k].last_mut().unwrap() = o.strides[d];
            }
        } else {
            cd.push(n);
            for (k, o) in ops.iter().enumerate() {
                cs[k].push(o.strides[d]);
            }
        }
    }
    (cd, cs)
}

/// Walks `out` (contiguous, shape `dims`) row by row. For each row, `body(row, starts, steps)`
/// gets the row's output slice and, per operand, the element offset of the row's first element
/// and the stride along the row. Large outputs are split across threads by rows.
#[inline(always)]
pub fn map_rows<O: Send>(
    out: &mut [O],
    dims: &[usize],
    ops: &[&Strided],
    body: impl Fn(&mut [O], &[usize], &[usize]) + Sync,
) {
    if out.is_empty() {
        return;
    }
    let (cd, cs) = collapse(dims, ops);
    let row = cd.last().copied().unwrap_or(1);
    let outer = &cd[..cd.len().saturating_sub(1)];
    let steps: Vec<usize> = cs.iter().map(|s| s.last().copied().unwrap_or(0)).collect();
    let work = crate::isa::inlined(
        #[inline(always)]
        |first_row: usize, chunk: &mut [O]| {
            let mut idx = vec![0; outer.len()];
            let mut r = first_row;
            for d in (0..outer.len()).rev() {
                idx[d] = r % outer[d];
                r /= outer[d];
            }
            let mut starts: Vec<usize> = cs
                .iter()
                .map(|s| idx.iter().zip(s).map(|(i, st)| i * st).sum())
                .collect();
            for rowslice in chunk.chunks_mut(row) {
                body(rowslice, &starts, &steps);
                for d in (0..outer.len()).rev() {
                    idx[d] += 1;
                    for (k, s) in cs.iter().enumerate() {
                        starts[k] += s[d];
                    }
                    if idx[d] < outer[d] {
                        break;
                    }
                    for (k, s) in cs.iter().enumerate() {
                        starts[k] -= s[d] * outer[d];
                    }
                    idx[d] = 0;
                }
            }
        },
    );
    let rows = out.len() / row;
    if out.len() >= PAR_MIN && rows > 1 {
        let per = rows.div_ceil(rayon::current_num_threads() * 4).max(1);
        out.par_chunks_mut(per * row)
            .enumerate()
            .for_each(|(c, ch)| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || work(c * per, ch),
                )
            });
    } else {
        crate::isa::dispatch(
            #[inline(always)]
            || work(0, out),
        );
    }
}

/// Applies `f` to every element of `out` in parallel chunks when large.
#[inline(always)]
pub fn par_zip<O: Send, I: Sync>(out: &mut [O], src: &[I], f: impl Fn(&mut O, &I) + Sync) {
    if out.len() >= PAR_MIN {
        let per = out.len().div_ceil(rayon::current_num_threads() * 4);
        out.par_chunks_mut(per)
            .zip(src.par_chunks(per))
            .for_each(|(o, s)| {
                crate::isa::dispatch(
                    #[inline(always)]
                    || o.iter_mut().zip(s).for_each(|(o, s)| f(o, s)),
                )
            });
    } else {
        crate::isa::dispatch(
            #[inline(always)]
            || out.iter_mut().zip(src).for_each(|(o, s)| f(o, s)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walker_visits_broadcast_offsets() {
        // out (2, 3) reading a (3,) broadcast and a (2, 1) broadcast.
        let a = Strided::broadcast(&[3], &[2, 3]);
        let b = Strided::broadcast(&[2, 1], &[2, 3]);
        let mut out = vec![(0usize, 0usize); 6];
        map_rows(&mut out, &[2, 3], &[&a, &b], |row, st, sp| {
            for (i, o) in row.iter_mut().enumerate() {
                *o = (st[0] + i * sp[0], st[1] + i * sp[1]);
            }
        });
        assert_eq!(out, vec![(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]);
    }

    #[test]
    fn walker_transposes() {
        let t = Strided::permuted(&[2, 3], &[1, 0]);
        let mut out = vec![0usize; 6];
        map_rows(&mut out, &[3, 2], &[&t], |row, st, sp| {
            for (i, o) in row.iter_mut().enumerate() {
                *o = st[0] + i * sp[0];
            }
        });
        assert_eq!(out, vec![0, 3, 1, 4, 2, 5]);
    }
}
