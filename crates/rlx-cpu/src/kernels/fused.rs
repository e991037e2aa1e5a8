//! The fused elementwise kernel: evaluates an `Op::Fused` expression tile by tile, so every
//! intermediate lives in a cache-sized scratch tile and memory is read and written once.
use super::{elementwise, map_rows, math, thread_scratch, Strided, PAR_MIN};
use rayon::prelude::*;
use rlx_ir::{BinaryOp, Fused, FusedStep, UnaryOp};
use std::cell::RefCell;

/// Elements per tile: a few registers of this size stay in L1/L2.
const TILE: usize = 512;
/// Inputs one expression may read (the fusion pass keeps to fewer).
const MAX_IN: usize = 32;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Where an input register's values come from within one tile.
#[derive(Clone, Copy)]
enum Src<'a> {
    Slice(&'a [f32]),
    Scalar(f32),
}

/// Evaluates `f` into `out`; `ins[i]` is input `i` with its shape (broadcast to `f.shape`).
pub fn fused(f: &Fused, ins: &[(&[f32], &[usize])], out: &mut [f32]) {
    fused_shaped(f, f.shape.dims(), ins, out, true)
}

/// Elements of one block of a (single-threaded) matmul epilogue's product: 128 KB, in cache
/// while the epilogue reads it.
const EPI_BLOCK: usize = 32 * 1024;

thread_local! {
    /// A matmul epilogue's product (a block of it, or all of it when it is computed whole).
    static PRODUCT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out = f(a @ b, xs..)` (see `rlx_ir::Op::MatMulEpilogue`). A small product (one thread) that
/// is one tall GEMM (`a` not transposed, `b` shared by every batch) whose other operands are
/// full-size, scalars or rows of its width runs block by block: each block of rows is
/// multiplied into a scratch and the epilogue writes `out` from it while it is in cache. A batch
/// of small products (see [`per_product`]) runs product by product the same way. Other
/// products are computed whole into a per-thread scratch (never the arena), then the epilogue
/// runs over it in parallel tiles.
#[allow(clippy::too_many_arguments)]
pub fn matmul_epilogue(
    f: &Fused,
    a: &[f32],
    ad: &[usize],
    ta: bool,
    b: &[f32],
    bd: &[usize],
    tb: bool,
    xs: &[(&[f32], &[usize])],
    out: &mut [f32],
) {
    use super::matmul::{gemm_view, View, PAR_FLOPS};
    let (ra, ca) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (rb, cb) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
    let n = if tb { rb } else { cb };
    let a_batch: usize = ad[..ad.len() - 2].iter().product();
    let b_batch: usize = bd[..bd.len() - 2].iter().product();
    if out.is_empty() {
        return;
    }
    let rows = out.len() / n.max(1);
    let last = f.shape.dims().last().copied().unwrap_or(1);
    let row_like =
        |d: &[usize]| last == n && d.last() == Some(&n) && d[..d.len() - 1].iter().all(|&v| v == 1);
    let parallel = rows * n * k >= PAR_FLOPS;
    // Large products are shared between threads by the GEMM itself (its own fine-grained
    // blocking balances the cores; fixed row blocks with one GEMM each stall on the slowest
    // core and pack `b` again per block), then the epilogue runs over it in parallel tiles.
    let blocked = !parallel
        && !ta
        && b_batch == 1
        && n > 0
        && rows == a_batch * m
        && xs
            .iter()
            .all(|(x, d)| x.len() == 1 || x.len() == out.len() || row_like(d));
    if !blocked && per_product(f, a, ad, ta, b, bd, tb, xs, out) {
        return;
    }
    if !blocked {
        let mut od: Vec<usize> = {
            let (pa, pb) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
            let r = pa.len().max(pb.len());
            let at = |p: &[usize], i: usize| {
                if i + p.len() >= r {
                    p[i + p.len() - r]
                } else {
                    1
                }
            };
            (0..r).map(|i| at(pa, i).max(at(pb, i))).collect()
        };
        od.extend([m, n]);
        debug_assert_eq!(od, product_dims(ad, bd, ta, tb));
        return thread_scratch(&PRODUCT, |p| {
            if p.len() < out.len() {
                p.resize(out.len(), 0.0);
            }
            let product = &mut p[..out.len()];
            super::matmul::matmul(a, ad, ta, b, bd, tb, product, &od);
            let mut ins: Vec<(&[f32], &[usize])> = vec![(product, f.shape.dims())];
            ins.extend_from_slice(xs);
            fused(f, &ins, out)
        });
    }
    let bv = if tb {
        View {
            off: 0,
            rs: 1,
            cs: cb,
        }
    } else {
        View::rows(0, cb)
    };
    let block_rows = (EPI_BLOCK / n).clamp(1, rows);
    let one = |(c, o): (usize, &mut [f32]), product: &mut Vec<f32>| {
        let r0 = c * block_rows;
        let r = o.len() / n;
        product.resize(r * n, 0.0);
        gemm_view(
            r,
            n,
            k,
            product,
            View::rows(0, n),
            0.0,
            a,
            View::rows(r0 * k, k),
            b,
            bv,
        );
        let rn = [r, n];
        let mut ins: Vec<(&[f32], &[usize])> = vec![(product, &rn)];
        for (x, d) in xs {
            ins.push(if x.len() == 1 {
                (x, &[1])
            } else if x.len() == rows * n {
                (&x[r0 * n..(r0 + r) * n], &rn)
            } else {
                (x, &d[d.len() - 1..])
            });
        }
        fused_shaped(f, &rn, &ins, o, false);
    };
    thread_scratch(&PRODUCT, |p| {
        out.chunks_mut(block_rows * n)
            .enumerate()
            .for_each(|c| one(c, p))
    });
}

/// `matmul_epilogue` for a batch of small products (each below `PAR_FLOPS_BATCHED`, one operand
/// per batch or shared), e.g. conv2d's per-image GEMMs: each product is computed into a
/// per-thread scratch and its block of `out` written from it while it is in cache, the
/// products shared between the threads whole, so the product is never stored whole. Returns
/// false (doing nothing) when this does not apply: fewer than two products, a tall product
/// (one GEMM does it better), products of `PAR_FLOPS_BATCHED` multiply-adds or more (each is
/// split over the threads instead), batch dims that broadcast other than one operand against
/// a shared one, or an input of the epilogue that differs between products other than as a
/// full-size tensor.
#[allow(clippy::too_many_arguments)]
fn per_product(
    f: &Fused,
    a: &[f32],
    ad: &[usize],
    ta: bool,
    b: &[f32],
    bd: &[usize],
    tb: bool,
    xs: &[(&[f32], &[usize])],
    out: &mut [f32],
) -> bool {
    use super::matmul::{View, PAR_FLOPS, PAR_FLOPS_BATCHED};
    let (ra, ca) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (rb, cb) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
    let n = if tb { rb } else { cb };
    let size = m * n;
    if size == 0 || k == 0 || out.len() / size * size != out.len() {
        return false;
    }
    let batch = out.len() / size;
    let a_batch: usize = ad[..ad.len() - 2].iter().product();
    let b_batch: usize = bd[..bd.len() - 2].iter().product();
    let tall = a_batch == batch && b_batch == 1 && !ta;
    if batch < 2 || tall || size * k >= PAR_FLOPS_BATCHED {
        return false;
    }
    if ![1, batch].contains(&a_batch) || ![1, batch].contains(&b_batch) {
        return false;
    }
    let Some(shares) = Shares::new(f, batch, xs, out.len()) else {
        return false;
    };
    let (a_rs, a_cs) = if ta { (1, ca) } else { (ca, 1) };
    let (b_rs, b_cs) = if tb { (1, cb) } else { (cb, 1) };
    let one = |i: usize, o: &mut [f32]| {
        let a_off = if a_batch == 1 { 0 } else { i * ra * ca };
        let b_off = if b_batch == 1 { 0 } else { i * rb * cb };
        let av = View {
            off: a_off,
            rs: a_rs,
            cs: a_cs,
        };
        let bv = View {
            off: b_off,
            rs: b_rs,
            cs: b_cs,
        };
        product_epilogue(f, &shares, i, [m, n, k], (a, av), (b, bv), o);
    };
    if batch * size * k >= PAR_FLOPS {
        out.par_chunks_mut(size)
            .enumerate()
            .for_each(|(i, o)| one(i, o));
    } else {
        out.chunks_mut(size)
            .enumerate()
            .for_each(|(i, o)| one(i, o));
    }
    true
}

/// The inputs of a matmul epilogue as one product of a batch sees them (see [`per_product`]):
/// each a scalar, a block of a full-size tensor, or the same values for every product.
pub(super) struct Shares<'a> {
    /// The epilogue's shape for one product (its dims after the batch's).
    one_dims: &'a [usize],
    /// (values, dims, whether product `i` takes block `i` of the values).
    xs: Vec<(&'a [f32], &'a [usize], bool)>,
    /// Elements of one product.
    size: usize,
}

impl<'a> Shares<'a> {
    /// The shares of `xs` among `batch` products of `out_len / batch` elements each; `None`
    /// when an input differs between products other than as a full-size tensor, or the
    /// epilogue's shape does not start with the batch.
    pub(super) fn new(
        f: &'a Fused,
        batch: usize,
        xs: &[(&'a [f32], &'a [usize])],
        out_len: usize,
    ) -> Option<Shares<'a>> {
        // The epilogue's shape is the batch's dims, then one product's.
        let fd = f.shape.dims();
        let lead = (0..=fd.len()).find(|&p| fd[..p].iter().product::<usize>() == batch)?;
        let one_dims = &fd[lead..];
        let mut shares = Vec::with_capacity(xs.len());
        for &(x, d) in xs {
            if x.len() == 1 {
                shares.push((x, &[1][..], false));
            } else if x.len() == out_len {
                shares.push((x, one_dims, true));
            } else {
                if d.len() > fd.len() {
                    return None;
                }
                // `d` is right-aligned to `fd`: its dims before `start` face the batch's.
                let start = lead.saturating_sub(fd.len() - d.len());
                if d[..start].iter().any(|&v| v != 1) {
                    return None;
                }
                shares.push((x, &d[start..], false));
            }
        }
        Some(Shares {
            one_dims,
            xs: shares,
            size: out_len / batch.max(1),
        })
    }
}

/// Product `i` of a batch, `o = f(a[av] (m x k) @ b[bv] (k x n), shares of i)`, on this
/// thread: the product goes to a per-thread scratch and the epilogue writes `o` from it.
pub(super) fn product_epilogue(
    f: &Fused,
    shares: &Shares,
    i: usize,
    [m, n, k]: [usize; 3],
    (a, av): (&[f32], super::matmul::View),
    (b, bv): (&[f32], super::matmul::View),
    o: &mut [f32],
) {
    use super::matmul::{gemm_view, View};
    let size = shares.size;
    thread_scratch(&PRODUCT, |p| {
        if p.len() < size {
            p.resize(size, 0.0);
        }
        let product = &mut p[..size];
        gemm_view(m, n, k, product, View::rows(0, n), 0.0, a, av, b, bv);
        let mut ins: Vec<(&[f32], &[usize])> = vec![(product, shares.one_dims)];
        for &(x, d, blocked) in &shares.xs {
            ins.push(if blocked {
                (&x[i * size..(i + 1) * size], d)
            } else {
                (x, d)
            });
        }
        fused_shaped(f, shares.one_dims, &ins, o, false);
    })
}

thread_local! {
    /// A fused sum's whole expression, when it is evaluated before summing.
    static WHOLE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows of one block of a fused sum (each block is evaluated, then added into a partial sum).
const SUM_BLOCK: usize = 16 * 1024;

/// `out (od) = sum_to(f(ins..), od)` (see `rlx_ir::Op::FusedSumTo`). When `od` is the trailing
/// dims of the expression's shape (the leading ones summed away: a bias gradient) and every
/// input is full-size, a scalar or a row of that width, blocks of rows are evaluated into a
/// per-thread scratch and added into per-block partial sums, so the expression is never stored;
/// otherwise it is evaluated whole, then summed.
pub fn fused_sum_to(f: &Fused, ins: &[(&[f32], &[usize])], out: &mut [f32], od: &[usize]) {
    let xd = f.shape.dims();
    let total = f.shape.numel();
    let trimmed: &[usize] = {
        let lead = od.iter().take_while(|&&d| d == 1).count();
        &od[lead..]
    };
    let n = trimmed.iter().product::<usize>().max(1);
    let rows_sum = trimmed.len() <= xd.len()
        && xd[xd.len() - trimmed.len()..] == *trimmed
        && total > 0
        && ins.iter().all(|(x, d)| {
            x.len() == 1
                || x.len() == total
                || (x.len() == n
                    && d.iter()
                        .rev()
                        .zip(trimmed.iter().rev())
                        .all(|(a, b)| a == b))
        });
    if !rows_sum {
        // A per-thread scratch, not a fresh allocation per call (large ones are fresh pages).
        return thread_scratch(&WHOLE, |w| {
            if w.len() < total {
                w.resize(total, 0.0);
            }
            fused(f, ins, &mut w[..total]);
            super::reduce::sum_to(&w[..total], xd, out, od)
        });
    }
    let rows = total / n;
    let block_rows = (SUM_BLOCK / n).clamp(1, rows);
    let blocks = rows.div_ceil(block_rows);
    let part = |c: usize, scratch: &mut Vec<f32>| -> Vec<f32> {
        let r0 = c * block_rows;
        let r = block_rows.min(rows - r0);
        scratch.resize(r * n, 0.0);
        let rn = [r, n];
        let nd = [n];
        let sub: Vec<(&[f32], &[usize])> = ins
            .iter()
            .map(|(x, _)| -> (&[f32], &[usize]) {
                if x.len() == 1 {
                    (x, &[1])
                } else if x.len() == total {
                    (&x[r0 * n..(r0 + r) * n], &rn)
                } else {
                    (x, &nd)
                }
            })
            .collect();
        fused_shaped(f, &rn, &sub, scratch, false);
        let mut acc = vec![0.0f32; n];
        for row in scratch.chunks(n) {
            acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
        }
        acc
    };
    let partials: Vec<Vec<f32>> = if split(f, total) {
        (0..blocks)
            .into_par_iter()
            .map_init(Vec::new, |s, c| part(c, s))
            .collect()
    } else {
        let mut s = Vec::new();
        (0..blocks).map(|c| part(c, &mut s)).collect()
    };
    out.fill(0.0);
    for p in partials {
        out.iter_mut().zip(&p).for_each(|(o, &v)| *o += v);
    }
}

/// `fused` over an output of shape `od` (the expression's shape or a block of its rows), split
/// between the threads where large unless `!par` (a block that is already one task of a split).
fn fused_shaped(f: &Fused, od: &[usize], ins: &[(&[f32], &[usize])], out: &mut [f32], par: bool) {
    assert!(
        ins.len() <= MAX_IN,
        "a fused expression reads at most {MAX_IN} inputs"
    );
    if out.is_empty() {
        return; // a zero-size axis: nothing to compute (and no row length to tile by)
    }
    let flat = ins
        .iter()
        .all(|(x, _)| x.len() == out.len() || x.len() == 1);
    if flat {
        let total = out.len();
        let tile = |(c, chunk): (usize, &mut [f32])| {
            let o0 = c * TILE;
            let mut srcs = [Src::Scalar(0.0); MAX_IN];
            for (s, (x, _)) in srcs.iter_mut().zip(ins) {
                *s = if x.len() != total {
                    Src::Scalar(x[0])
                } else {
                    Src::Slice(&x[o0..o0 + chunk.len()])
                };
            }
            with_scratch(f, |scratch| eval(f, &srcs[..ins.len()], chunk, scratch));
        };
        if par && split(f, out.len()) {
            out.par_chunks_mut(TILE).enumerate().for_each(tile);
        } else {
            out.chunks_mut(TILE).enumerate().for_each(tile);
        }
        return;
    }
    let strided: Vec<Strided> = ins.iter().map(|(_, d)| Strided::broadcast(d, od)).collect();
    let refs: Vec<&Strided> = strided.iter().collect();
    let (cd, cs) = super::collapse(od, &refs);
    if cd.last().is_some_and(|&row| 2 * row <= TILE) {
        return row_groups(f, ins, out, &cd, &cs, par);
    }
    map_rows(
        out,
        od,
        &refs,
        #[inline(always)]
        |row, starts, steps| {
            // Inputs walked with a stride (rare: a transposed broadcast) are gathered per tile.
            let mut gathered: Vec<Vec<f32>> = Vec::new();
            if steps.iter().any(|&s| s > 1) {
                gathered.resize(ins.len(), Vec::new());
            }
            for t0 in (0..row.len()).step_by(TILE) {
                let len = TILE.min(row.len() - t0);
                for (i, (x, _)) in ins.iter().enumerate() {
                    if steps[i] > 1 {
                        let at = starts[i] + t0 * steps[i];
                        gathered[i].clear();
                        gathered[i].extend((0..len).map(|j| x[at + j * steps[i]]));
                    }
                }
                let mut srcs = [Src::Scalar(0.0); MAX_IN];
                for (i, (s, (x, _))) in srcs.iter_mut().zip(ins).enumerate() {
                    let at = starts[i] + t0 * steps[i];
                    *s = match steps[i] {
                        0 => Src::Scalar(x[at]),
                        1 => Src::Slice(&x[at..at + len]),
                        _ => Src::Slice(&gathered[i]),
                    };
                }
                let chunk = &mut row[t0..t0 + len];
                with_scratch(f, |scratch| eval(f, &srcs[..ins.len()], chunk, scratch));
            }
        },
    );
}

thread_local! {
    /// `row_groups`' broadcast operands, expanded to one tile each.
    static EXPANDED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `fused` over short rows (an NCHW tensor with per-channel operands: rows of H*W): each tile
/// is a run of whole rows, and every operand that is neither full-size nor a scalar is expanded
/// into a tile-sized buffer first, so the expression's per-tile cost is paid once per `TILE`
/// elements rather than once per row. `cd`/`cs`: the output's collapsed dims and each operand's
/// strides over them (`collapse`).
fn row_groups(
    f: &Fused,
    ins: &[(&[f32], &[usize])],
    out: &mut [f32],
    cd: &[usize],
    cs: &[Vec<usize>],
    par: bool,
) {
    let total = out.len();
    let row = cd[cd.len() - 1];
    let outer = &cd[..cd.len() - 1];
    let group = (TILE / row).max(1);
    // An operand that is the same for every row (a layer norm's scale and shift over rows of
    // the width) expands to the same tile everywhere: once, here, not once a tile. Tiles start
    // at whole rows, so a short last tile reads a prefix.
    let same_rows: Vec<Option<Vec<f32>>> = ins
        .iter()
        .enumerate()
        .map(|(i, (x, _))| {
            let step = cs[i][outer.len()];
            let per_row =
                x.len() != total && x.len() != 1 && cs[i][..outer.len()].iter().all(|&s| s == 0);
            per_row.then(|| {
                let one: Vec<f32> = (0..row).map(|j| x[j * step]).collect();
                one.repeat(group.min(total / row.max(1)))
            })
        })
        .collect();
    let tile = |(c, chunk): (usize, &mut [f32])| {
        let (r0, len) = (c * group, chunk.len());
        thread_scratch(&EXPANDED, |e| {
            if e.len() < ins.len() * TILE {
                e.resize(ins.len() * TILE, 0.0);
            }
            for (i, (x, _)) in ins.iter().enumerate() {
                if x.len() == total || x.len() == 1 || same_rows[i].is_some() {
                    continue;
                }
                let step = cs[i][outer.len()];
                let buf = &mut e[i * TILE..i * TILE + len];
                for (k, seg) in buf.chunks_mut(row).enumerate() {
                    let (mut rem, mut start) = (r0 + k, 0);
                    for d in (0..outer.len()).rev() {
                        start += (rem % outer[d]) * cs[i][d];
                        rem /= outer[d];
                    }
                    match step {
                        0 => seg.fill(x[start]),
                        1 => seg.copy_from_slice(&x[start..start + row]),
                        _ => seg
                            .iter_mut()
                            .enumerate()
                            .for_each(|(j, v)| *v = x[start + j * step]),
                    }
                }
            }
            let mut srcs = [Src::Scalar(0.0); MAX_IN];
            for (i, (s, (x, _))) in srcs.iter_mut().zip(ins).enumerate() {
                *s = if x.len() == total {
                    Src::Slice(&x[r0 * row..r0 * row + len])
                } else if x.len() == 1 {
                    Src::Scalar(x[0])
                } else if let Some(same) = &same_rows[i] {
                    Src::Slice(&same[..len])
                } else {
                    Src::Slice(&e[i * TILE..i * TILE + len])
                };
            }
            with_scratch(f, |scratch| eval(f, &srcs[..ins.len()], chunk, scratch));
        })
    };
    if par && split(f, total) {
        out.par_chunks_mut(group * row).enumerate().for_each(tile);
    } else {
        out.chunks_mut(group * row).enumerate().for_each(tile);
    }
}

/// Whether a fused expression over `total` elements is split between the threads: by its work
/// (elements times steps), since a long expression costs far more per element than a copy.
fn split(f: &Fused, total: usize) -> bool {
    total * (f.steps.len() + 1) >= PAR_MIN
}

fn with_scratch(f: &Fused, body: impl FnOnce(&mut [f32])) {
    thread_scratch(&SCRATCH, |s| {
        let need = f.steps.len() * TILE;
        if s.len() < need {
            s.resize(need, 0.0);
        }
        body(&mut s[..need]);
    });
}

/// One tile: each step writes its scratch register (the last writes `out`).
fn eval(f: &Fused, ins: &[Src], out: &mut [f32], scratch: &mut [f32]) {
    let n = out.len();
    let n_in = f.n_inputs;
    for (k, step) in f.steps.iter().enumerate() {
        let (done, rest) = scratch.split_at_mut(k * TILE);
        let reg = |r: u16| -> Src {
            let r = r as usize;
            if r < n_in {
                ins[r]
            } else {
                let j = (r - n_in) * TILE;
                Src::Slice(&done[j..j + n])
            }
        };
        let dst: &mut [f32] = if k + 1 == f.steps.len() {
            &mut *out
        } else {
            &mut rest[..n]
        };
        match *step {
            FusedStep::Unary(u, a) => unary(u, reg(a), dst),
            FusedStep::Binary(b, x, y) => binary(b, reg(x), reg(y), dst),
            FusedStep::Where(c, x, y) => select(reg(c), reg(x), reg(y), dst),
        }
    }
}

/// `dst = c != 0 ? x : y` as one tight (branch-free) loop per operand kind.
fn select(c: Src, x: Src, y: Src, dst: &mut [f32]) {
    let pick = |c: f32, x: f32, y: f32| if c != 0.0 { x } else { y };
    crate::isa::dispatch(
        #[inline(always)]
        || match (c, x, y) {
            (Src::Scalar(c), x, y) => match if c != 0.0 { x } else { y } {
                Src::Slice(v) => dst.copy_from_slice(&v[..dst.len()]),
                Src::Scalar(v) => dst.fill(v),
            },
            (Src::Slice(c), Src::Scalar(x), Src::Slice(y)) => dst
                .iter_mut()
                .zip(c.iter().zip(y))
                .for_each(|(o, (&c, &y))| *o = pick(c, x, y)),
            (Src::Slice(c), Src::Slice(x), Src::Scalar(y)) => dst
                .iter_mut()
                .zip(c.iter().zip(x))
                .for_each(|(o, (&c, &x))| *o = pick(c, x, y)),
            (Src::Slice(c), Src::Slice(x), Src::Slice(y)) => dst
                .iter_mut()
                .zip(c.iter().zip(x.iter().zip(y)))
                .for_each(|(o, (&c, (&x, &y)))| *o = pick(c, x, y)),
            (Src::Slice(c), Src::Scalar(x), Src::Scalar(y)) => {
                dst.iter_mut().zip(c).for_each(|(o, &c)| *o = pick(c, x, y))
            }
        },
    )
}

/// `dst = f(a)` as one tight loop per op.
fn unary(op: UnaryOp, a: Src, dst: &mut [f32]) {
    #[inline(always)]
    fn map(a: Src, dst: &mut [f32], f: impl Fn(f32) -> f32) {
        crate::isa::dispatch(
            #[inline(always)]
            || match a {
                Src::Slice(v) => dst.iter_mut().zip(v).for_each(|(o, &x)| *o = f(x)),
                Src::Scalar(x) => dst.fill(f(x)),
            },
        )
    }
    match op {
        UnaryOp::Neg => map(a, dst, |x| -x),
        UnaryOp::Relu => map(a, dst, |x| if x < 0.0 { 0.0 } else { x }), // NaN stays NaN
        UnaryOp::Tanh => map(a, dst, math::tanh),
        UnaryOp::Sigmoid => map(a, dst, |x| 1.0 / (1.0 + math::exp(-x))),
        UnaryOp::Exp => map(a, dst, math::exp),
        UnaryOp::Log => map(a, dst, f32::ln),
        UnaryOp::Sqrt => map(a, dst, f32::sqrt),
        UnaryOp::Gelu => map(a, dst, elementwise::gelu),
        UnaryOp::GeluTanh => map(a, dst, |x| elementwise::gelu_tanh(x).0),
        UnaryOp::GeluDeriv => map(a, dst, elementwise::gelu_deriv),
        UnaryOp::GeluTanhDeriv => map(a, dst, |x| elementwise::gelu_tanh(x).1),
        UnaryOp::PowScalar(1.0) => map(a, dst, |x| x),
        UnaryOp::PowScalar(2.0) => map(a, dst, |x| x * x),
        UnaryOp::PowScalar(p) => map(a, dst, |x| x.powf(p)),
    }
}

/// `dst = a (op) b` as one tight loop per op and operand kind.
fn binary(op: BinaryOp, a: Src, b: Src, dst: &mut [f32]) {
    #[inline(always)]
    fn zip(a: Src, b: Src, dst: &mut [f32], f: impl Fn(f32, f32) -> f32) {
        crate::isa::dispatch(
            #[inline(always)]
            || match (a, b) {
                (Src::Slice(x), Src::Slice(y)) => dst
                    .iter_mut()
                    .zip(x.iter().zip(y))
                    .for_each(|(o, (&x, &y))| *o = f(x, y)),
                (Src::Slice(x), Src::Scalar(y)) => {
                    dst.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, y))
                }
                (Src::Scalar(x), Src::Slice(y)) => {
                    dst.iter_mut().zip(y).for_each(|(o, &y)| *o = f(x, y))
                }
                (Src::Scalar(x), Src::Scalar(y)) => dst.fill(f(x, y)),
            },
        )
    }
    let mask = |v: bool| if v { 1.0 } else { 0.0 };
    match op {
        BinaryOp::Add => zip(a, b, dst, |x, y| x + y),
        BinaryOp::Sub => zip(a, b, dst, |x, y| x - y),
        BinaryOp::Mul => zip(a, b, dst, |x, y| x * y),
        BinaryOp::Div => zip(a, b, dst, |x, y| x / y),
        BinaryOp::FloorDiv => zip(a, b, dst, <f32 as elementwise::Num>::floor_div),
        BinaryOp::Mod => zip(a, b, dst, <f32 as elementwise::Num>::rem),
        BinaryOp::Lt => zip(a, b, dst, |x, y| mask(x < y)),
        BinaryOp::Le => zip(a, b, dst, |x, y| mask(x <= y)),
        BinaryOp::Gt => zip(a, b, dst, |x, y| mask(x > y)),
        BinaryOp::Ge => zip(a, b, dst, |x, y| mask(x >= y)),
        BinaryOp::Eq => zip(a, b, dst, |x, y| mask(x == y)),
        BinaryOp::Ne => zip(a, b, dst, |x, y| mask(x != y)),
    }
}

/// `matmul_epilogue` for bfloat16 or float16 operands (`lowp::matmul`): the float32 product is
/// computed whole into the per-thread scratch, then the epilogue runs over it.
#[allow(clippy::too_many_arguments)]
pub fn matmul_epilogue_lowp(
    f: &Fused,
    ops: super::lowp::Lowp,
    ad: &[usize],
    ta: bool,
    bd: &[usize],
    tb: bool,
    xs: &[(&[f32], &[usize])],
    out: &mut [f32],
) {
    let od = product_dims(ad, bd, ta, tb);
    thread_scratch(&PRODUCT, |p| {
        if p.len() < out.len() {
            p.resize(out.len(), 0.0);
        }
        let product = &mut p[..out.len()];
        super::lowp::matmul(ops, ad, ta, bd, tb, product, &od);
        let mut ins: Vec<(&[f32], &[usize])> = vec![(product, f.shape.dims())];
        ins.extend_from_slice(xs);
        fused(f, &ins, out)
    })
}

/// The dims of `op(a) @ op(b)`: the broadcast batch dims, then `m x n`.
pub fn product_dims(ad: &[usize], bd: &[usize], ta: bool, tb: bool) -> Vec<usize> {
    let (pa, pb) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
    let r = pa.len().max(pb.len());
    let at = |p: &[usize], i: usize| {
        if i + p.len() >= r {
            p[i + p.len() - r]
        } else {
            1
        }
    };
    let mut od: Vec<usize> = (0..r).map(|i| at(pa, i).max(at(pb, i))).collect();
    let m = if ta {
        ad[ad.len() - 1]
    } else {
        ad[ad.len() - 2]
    };
    let n = if tb {
        bd[bd.len() - 2]
    } else {
        bd[bd.len() - 1]
    };
    od.extend([m, n]);
    od
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::Shape;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.377 + seed).sin()).collect()
    }

    /// `relu(r0 + r1) * r2`: product, bias row, full-size (or scalar) multiplier.
    fn expr(shape: &[usize]) -> Fused {
        Fused {
            shape: Shape::new(shape.to_vec()),
            n_inputs: 3,
            steps: vec![
                FusedStep::Binary(BinaryOp::Add, 0, 1),
                FusedStep::Unary(UnaryOp::Relu, 3),
                FusedStep::Binary(BinaryOp::Mul, 4, 2),
            ],
        }
    }

    /// Blocked (several blocks with a tail, sequential and parallel) and whole-product paths
    /// against a naive product and epilogue, both transposes of each operand.
    #[test]
    #[allow(clippy::needless_range_loop)]
    fn matmul_epilogue_matches_naive() {
        for &(batch, m, k, n, ta, tb, full) in &[
            (1usize, 2000usize, 5usize, 37usize, false, false, true),
            (3, 300, 64, 150, false, true, true),
            (1, 1, 1, 1, false, false, false),
            (2, 7, 3, 5, true, false, true),
            (2, 9, 4, 6, true, true, false),
        ] {
            let a = data(batch * m * k, 0.3);
            let b = data(k * n, 1.1);
            let bias = data(n, 2.0);
            let mul = data(if full { batch * m * n } else { 1 }, 0.7);
            let ad = if ta { [batch, k, m] } else { [batch, m, k] };
            let bd = if tb { [n, k] } else { [k, n] };
            let at = |bi: usize, i: usize, p: usize| {
                a[bi * m * k + if ta { p * m + i } else { i * k + p }]
            };
            let bt = |p: usize, j: usize| b[if tb { j * k + p } else { p * n + j }];
            let mut want = vec![0.0f32; batch * m * n];
            for bi in 0..batch {
                for i in 0..m {
                    for j in 0..n {
                        let s: f32 = (0..k).map(|p| at(bi, i, p) * bt(p, j)).sum();
                        let o = (bi * m + i) * n + j;
                        let x = if full { mul[o] } else { mul[0] };
                        want[o] = (s + bias[j]).max(0.0) * x;
                    }
                }
            }
            let shape = [batch, m, n];
            let mul_shape: Vec<usize> = if full { shape.to_vec() } else { vec![1] };
            let mut out = vec![0.0; want.len()];
            matmul_epilogue(
                &expr(&shape),
                &a,
                &ad,
                ta,
                &b,
                &bd,
                tb,
                &[(&bias, &[n]), (&mul, &mul_shape)],
                &mut out,
            );
            for (i, (x, y)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "{batch}x{m}x{k}x{n} ta={ta} tb={tb}: {i}: {x} vs {y}"
                );
            }
        }
    }

    /// A shared left operand times a batch of transposed right ones, the epilogue in NCHW shape
    /// with a per-channel bias (conv2d's per-image GEMMs: one product at a time, in parallel),
    /// and inputs that differ per product in a way it cannot split (computed whole).
    #[test]
    fn per_product_epilogues_match_naive() {
        for &(batch, m, k, h, w, per_channel) in &[
            (64usize, 8usize, 27usize, 16usize, 16usize, true),
            (3, 5, 4, 3, 2, true),
            (4, 6, 5, 2, 3, false),
        ] {
            let n = h * w;
            let a = data(m * k, 0.3);
            let b = data(batch * n * k, 1.1);
            // Per channel (m, 1, 1), or per image and channel (batch, m, 1, 1).
            let bias = data(if per_channel { m } else { batch * m }, 2.0);
            let mul = data(batch * m * n, 0.7);
            let mut want = vec![0.0f32; batch * m * n];
            for bi in 0..batch {
                for i in 0..m {
                    for j in 0..n {
                        let s: f32 = (0..k).map(|p| a[i * k + p] * b[(bi * n + j) * k + p]).sum();
                        let o = (bi * m + i) * n + j;
                        let bv = if per_channel {
                            bias[i]
                        } else {
                            bias[bi * m + i]
                        };
                        want[o] = (s + bv).max(0.0) * mul[o];
                    }
                }
            }
            let shape = [batch, m, h, w];
            let bias_shape: Vec<usize> = if per_channel {
                vec![m, 1, 1]
            } else {
                vec![batch, m, 1, 1]
            };
            let mut out = vec![0.0; want.len()];
            matmul_epilogue(
                &expr(&shape),
                &a,
                &[m, k],
                false,
                &b,
                &[batch, n, k],
                true,
                &[(&bias, &bias_shape), (&mul, &shape)],
                &mut out,
            );
            for (i, (x, y)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "{batch}x{m}x{k}x{n} per_channel={per_channel}: {i}: {x} vs {y}"
                );
            }
        }
    }

    /// Sums of `r0 * r1 + r2` down to trailing dims (blocks with a tail, parallel) and down to
    /// other shapes (evaluated whole), against a naive sum.
    #[test]
    fn fused_sum_to_matches_naive() {
        let f = |shape: &[usize]| Fused {
            shape: Shape::new(shape.to_vec()),
            n_inputs: 3,
            steps: vec![
                FusedStep::Binary(BinaryOp::Mul, 0, 1),
                FusedStep::Binary(BinaryOp::Add, 3, 2),
            ],
        };
        for (xd, od) in [
            (vec![3000usize, 37usize], vec![37usize]),
            (vec![40, 64, 130], vec![1, 130]),
            (vec![5, 7, 3], vec![7, 3]),
            (vec![6, 4], vec![6, 1]),
            (vec![2, 3, 4], vec![]),
        ] {
            let total: usize = xd.iter().product();
            let n = *xd.last().unwrap();
            let a = data(total, 0.2);
            let b = data(total, 1.4);
            let row = data(n, 2.2);
            let mut want = vec![0.0f64; od.iter().product::<usize>().max(1)];
            let on: usize = want.len();
            for i in 0..total {
                let v = a[i] as f64 * b[i] as f64 + row[i % n] as f64;
                // Output index: the trailing dims of `od` that are not 1, right-aligned.
                let mut idx = 0;
                let mut rest = i;
                let mut stride = 1;
                for (k, &d) in xd.iter().enumerate().rev() {
                    let c = rest % d;
                    rest /= d;
                    let j = k as isize - (xd.len() - od.len()) as isize;
                    if j >= 0 && od[j as usize] != 1 {
                        idx += c * stride;
                        stride *= d;
                    }
                }
                want[idx % on] += v;
            }
            let mut out = vec![0.0; on];
            fused_sum_to(
                &f(&xd),
                &[(&a, &xd), (&b, &xd), (&row, &[n])],
                &mut out,
                &od,
            );
            for (x, y) in out.iter().zip(&want) {
                assert!(
                    (*x as f64 - y).abs() <= 1e-3 * (1.0 + y.abs()),
                    "{xd:?} -> {od:?}: {x} vs {y}"
                );
            }
        }
    }

    /// Short rows (per-channel operands of NCHW tensors) go through `row_groups`: against a
    /// naive evaluation, with row lengths that do and do not divide the tile, a scalar and a
    /// full-size operand, one thread and the parallel path.
    #[test]
    fn short_rows_match_naive() {
        for (dims, scalar) in [
            ([64usize, 16usize, 8usize, 8usize], false),
            ([3, 5, 4, 3], true),
            ([2, 7, 1, 1], false),
            ([64, 16, 16, 16], false),
            ([5, 3, 7, 11], true),
        ] {
            let total: usize = dims.iter().product();
            let c = dims[1];
            let hw = dims[2] * dims[3];
            let x = data(total, 0.3);
            let per_channel = data(c, 1.7);
            let m = data(if scalar { 1 } else { total }, 0.9);
            let m_shape: Vec<usize> = if scalar { vec![1] } else { dims.to_vec() };
            let mut out = vec![0.0; total];
            fused(
                &expr(&dims),
                &[(&x, &dims), (&per_channel, &[1, c, 1, 1]), (&m, &m_shape)],
                &mut out,
            );
            for (i, &o) in out.iter().enumerate() {
                let ch = (i / hw) % c;
                let mul = if scalar { m[0] } else { m[i] };
                let want = (x[i] + per_channel[ch]).max(0.0) * mul;
                assert!((o - want).abs() <= 1e-6, "{dims:?} {i}: {o} vs {want}");
            }
        }
    }
}
