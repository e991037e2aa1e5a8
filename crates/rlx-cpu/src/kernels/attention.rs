//! Fused scaled-dot-product attention, forward and backward, one (batch, head) block at a time:
//! the block's scores live in a per-thread scratch of L x S floats (in cache for the usual
//! sizes), never in the arena; the backward pass recomputes them instead of saving them.
use super::math;
use super::matmul::{gemm_view, View};
use rayon::prelude::*;

/// The block structure of one attention op (see `rlx_ir::Op::Attention` for the layouts).
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// Parallel units: leading index (separate layout) or batch row (packed layout).
    pub units: usize,
    /// Blocks per unit: 1, or the number of heads of the packed layout.
    pub heads: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    pub packed: bool,
    pub scale: f32,
    pub causal: Option<i64>,
}

impl Geometry {
    /// From the first input's shape (packed) or q, k, v shapes (separate).
    pub fn new(
        shapes: &[&[usize]],
        heads: Option<usize>,
        scale: f32,
        causal: Option<i64>,
    ) -> Geometry {
        match heads {
            Some(h) => {
                let d = shapes[0];
                let e = d[2] / (3 * h);
                Geometry {
                    units: d[0],
                    heads: h,
                    l: d[1],
                    s: d[1],
                    e,
                    ev: e,
                    packed: true,
                    scale,
                    causal,
                }
            }
            None => {
                let (q, k, v) = (shapes[0], shapes[1], shapes[2]);
                let r = q.len();
                Geometry {
                    units: q[..r - 2].iter().product(),
                    heads: 1,
                    l: q[r - 2],
                    s: k[r - 2],
                    e: q[r - 1],
                    ev: v[r - 1],
                    packed: false,
                    scale,
                    causal,
                }
            }
        }
    }

    /// Views of head `j`'s q, k, v inside one unit's chunk(s), and of its output.
    fn views(&self, j: usize) -> [View; 4] {
        if self.packed {
            let (h, e) = (self.heads, self.e);
            let rs = 3 * h * e;
            [
                View::rows(j * e, rs),
                View::rows((h + j) * e, rs),
                View::rows((2 * h + j) * e, rs),
                View::rows(j * e, h * e),
            ]
        } else {
            [
                View::rows(0, self.e),
                View::rows(0, self.e),
                View::rows(0, self.ev),
                View::rows(0, self.ev),
            ]
        }
    }

    /// Keys visible to query `i`.
    fn visible(&self, i: usize) -> usize {
        match self.causal {
            None => self.s,
            Some(off) => (i as i64 + off + 1).clamp(0, self.s as i64) as usize,
        }
    }
}

/// `p (l x s)` = softmax over each row of `p * scale` with the causal mask; masked entries 0,
/// rows that see no key NaN. Each row's passes run 8 lanes wide with the CPU's instruction set.
/// With a positive scale (the usual `1/sqrt(e)`) the scale is applied inside the `exp` pass,
/// `exp((x - max) * scale)` with the maximum of the raw scores, not as a pass of its own.
fn softmax_rows(g: &Geometry, p: &mut [f32]) {
    crate::isa::dispatch(
        #[inline(always)]
        || {
            for i in 0..g.l {
                let row = &mut p[i * g.s..][..g.s];
                let vis = g.visible(i);
                if vis == 0 {
                    row.fill(f32::NAN);
                    continue;
                }
                let (seen, hidden) = row.split_at_mut(vis);
                let inv = if g.scale > 0.0 {
                    let max = math::max(seen);
                    for x in seen.iter_mut() {
                        *x = math::exp((*x - max) * g.scale);
                    }
                    1.0 / math::sum(seen)
                } else {
                    for x in seen.iter_mut() {
                        *x *= g.scale;
                    }
                    let max = math::max(seen);
                    for x in seen.iter_mut() {
                        *x = math::exp(*x - max);
                    }
                    1.0 / math::sum(seen)
                };
                for x in seen.iter_mut() {
                    *x *= inv;
                }
                hidden.fill(0.0);
            }
        },
    )
}

/// Query rows (and keys) a block of the causal products takes: a causal mask hides the keys
/// past each block's last visible one, so the products skip them (for T = 64 in blocks of 32,
/// 3/4 of the full products' work). Blocks of 16 measured no faster: the small products' fixed
/// costs ate the rest.
const CAUSAL_BLOCK: usize = 32;

/// `v` moved down `r` rows.
fn down(v: View, r: usize) -> View {
    View {
        off: v.off + r * v.rs,
        ..v
    }
}

/// `(start, end)` of the blocks over `n` rows or keys: [`CAUSAL_BLOCK`] each under a causal
/// mask, else one block of all.
fn blocks(g: &Geometry, n: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = if g.causal.is_some() {
        CAUSAL_BLOCK
    } else {
        n.max(1)
    };
    (0..n).step_by(step).map(move |a| (a, (a + step).min(n)))
}

/// Rows `r0..r1` of a block and the keys `0..kb` they may see (at least one where there are
/// keys, so that rows that see none still meet their NaN probabilities in the products);
/// one block of every row without a causal mask.
fn row_blocks(g: &Geometry) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    blocks(g, g.l).map(move |(r0, r1)| (r0, r1, g.visible(r1 - 1).max(1).min(g.s)))
}

/// Keys `c0..c1` of a block and the first query row that sees any of them (the products over
/// queries start there: earlier rows' probabilities and score gradients are 0 for these keys).
fn key_blocks(g: &Geometry) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    blocks(g, g.s).map(move |(c0, c1)| {
        let first = match g.causal {
            None => 0,
            Some(off) => (c0 as i64 - off).clamp(0, g.l as i64) as usize,
        };
        (c0, c1, first)
    })
}

/// The probabilities of one block into `p` (l x s; hidden keys 0): the scores of each row
/// block only over the keys it may see.
fn probs(g: &Geometry, q: &[f32], qv: View, k: &[f32], kv: View, p: &mut Vec<f32>) {
    p.resize(g.l * g.s, 0.0);
    for (r0, r1, kb) in row_blocks(g) {
        let pv = View::rows(r0 * g.s, g.s);
        gemm_view(r1 - r0, kb, g.e, p, pv, 0.0, q, down(qv, r0), k, kv.t());
    }
    softmax_rows(g, p);
}

/// Forward: `ins` are `[qkv]` (packed) or `[q, k, v]`; `out` the attention output.
pub fn forward(g: &Geometry, ins: &[&[f32]], out: &mut [f32]) {
    if out.is_empty() || g.units == 0 {
        return;
    }
    let (qc, kc, vc) = chunk_sizes(g);
    let oc = out.len() / g.units;
    let unit = |(u, o): (usize, &mut [f32]), p: &mut Vec<f32>| {
        let (q, k, v) = unit_inputs(g, ins, u, qc, kc, vc);
        for j in 0..g.heads {
            let [qv, kv, vv, ov] = g.views(j);
            probs(g, q, qv, k, kv, p);
            for (r0, r1, kb) in row_blocks(g) {
                let pv = View::rows(r0 * g.s, g.s);
                gemm_view(r1 - r0, g.ev, kb, o, down(ov, r0), 0.0, p, pv, v, vv);
            }
        }
    };
    out.par_chunks_mut(oc)
        .enumerate()
        .for_each_init(Vec::new, |p, c| unit(c, p));
}

/// Elements of one unit's q, k, v (for packed: the whole qkv row block, thrice).
fn chunk_sizes(g: &Geometry) -> (usize, usize, usize) {
    if g.packed {
        let n = g.l * 3 * g.heads * g.e;
        (n, n, n)
    } else {
        (g.l * g.e, g.s * g.e, g.s * g.ev)
    }
}

fn unit_inputs<'a>(
    g: &Geometry,
    ins: &[&'a [f32]],
    u: usize,
    qc: usize,
    kc: usize,
    vc: usize,
) -> (&'a [f32], &'a [f32], &'a [f32]) {
    if g.packed {
        let x = &ins[0][u * qc..(u + 1) * qc];
        (x, x, x)
    } else {
        (
            &ins[0][u * qc..(u + 1) * qc],
            &ins[1][u * kc..(u + 1) * kc],
            &ins[2][u * vc..(u + 1) * vc],
        )
    }
}

/// One product of the backward pass, `a[av] (m x k) @ b[bv] (k x n)`, for result `which`
/// (0: dq, 1: dk, 2: dv) at view `dst`.
struct Product<'a> {
    which: usize,
    dst: View,
    mnk: (usize, usize, usize),
    a: (&'a [f32], View),
    b: (&'a [f32], View),
}

/// Stores one `Product` where its layout puts it.
type Write<'w> = dyn FnMut(Product) + 'w;

impl Product<'_> {
    fn into(self, out: &mut [f32]) {
        let (m, n, k) = self.mnk;
        gemm_view(
            m, n, k, out, self.dst, 0.0, self.a.0, self.a.1, self.b.0, self.b.1,
        )
    }
}

/// Backward: `ins` are `[qkv, out, g]` (packed) or `[q, k, v, out, g]`; `grad` is `d qkv`
/// (packed) or the flat `[dq | dk | dv]`.
pub fn backward(g: &Geometry, ins: &[&[f32]], grad: &mut [f32]) {
    if grad.is_empty() || g.units == 0 {
        return;
    }
    let (qc, kc, vc) = chunk_sizes(g);
    let n_in = if g.packed { 1 } else { 3 };
    let (o_all, g_all) = (ins[n_in], ins[n_in + 1]);
    let oc = o_all.len() / g.units;
    // One block: recompute P, then dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)) * scale,
    // dQ = dS K, dK = dS^T Q, each handed to `write`.
    let block = |u: usize, j: usize, scratch: &mut (Vec<f32>, Vec<f32>), write: &mut Write| {
        let (q, k, v) = unit_inputs(g, ins, u, qc, kc, vc);
        let o = &o_all[u * oc..(u + 1) * oc];
        let gy = &g_all[u * oc..(u + 1) * oc];
        let [qv, kv, vv, ov] = g.views(j);
        let (p, ds) = scratch;
        probs(g, q, qv, k, kv, p);
        ds.resize(g.l * g.s, 0.0);
        // dS over each row block's visible keys, 0 past them (P is 0 there).
        for (r0, r1, kb) in row_blocks(g) {
            let dv = View::rows(r0 * g.s, g.s);
            gemm_view(r1 - r0, kb, g.ev, ds, dv, 0.0, gy, down(ov, r0), v, vv.t());
            crate::isa::dispatch(
                #[inline(always)]
                || {
                    for i in r0..r1 {
                        let at = ov.off + i * ov.rs;
                        let d = math::dot(&o[at..][..g.ev], &gy[at..][..g.ev]);
                        let (row, hidden) = ds[i * g.s..][..g.s].split_at_mut(kb);
                        let pr = &p[i * g.s..][..kb];
                        for j in 0..kb {
                            row[j] = pr[j] * (row[j] - d) * g.scale;
                        }
                        hidden.fill(0.0);
                    }
                },
            );
        }
        let (p, ds): (&[f32], &[f32]) = (p, ds);
        let sv = View::rows(0, g.s);
        // dV = P^T dO and dK = dS^T Q by key blocks, over the query rows that see them.
        for (c0, c1, first) in key_blocks(g) {
            let at = View::rows(first * g.s + c0, g.s).t();
            write(Product {
                which: 2,
                dst: down(vv, c0),
                mnk: (c1 - c0, g.ev, g.l - first),
                a: (p, at),
                b: (gy, down(ov, first)),
            });
            write(Product {
                which: 1,
                dst: down(kv, c0),
                mnk: (c1 - c0, g.e, g.l - first),
                a: (ds, at),
                b: (q, down(qv, first)),
            });
        }
        // dQ = dS K by row blocks, over the keys each sees.
        for (r0, r1, kb) in row_blocks(g) {
            write(Product {
                which: 0,
                dst: down(qv, r0),
                mnk: (r1 - r0, g.e, kb),
                a: (ds, down(sv, r0)),
                b: (k, kv),
            });
        }
    };
    if g.packed {
        grad.par_chunks_mut(qc).enumerate().for_each_init(
            || (Vec::new(), Vec::new()),
            |scratch, (u, dqkv)| {
                for j in 0..g.heads {
                    let mut write = |pr: Product| pr.into(dqkv);
                    block(u, j, scratch, &mut write);
                }
            },
        );
    } else {
        let (dq, rest) = grad.split_at_mut(g.units * qc);
        let (dk, dv) = rest.split_at_mut(g.units * kc);
        dq.par_chunks_mut(qc)
            .zip(dk.par_chunks_mut(kc))
            .zip(dv.par_chunks_mut(vc))
            .enumerate()
            .for_each_init(
                || (Vec::new(), Vec::new()),
                |scratch, (u, ((dq, dk), dv))| {
                    let mut write = |pr: Product| {
                        let dst: &mut [f32] = match pr.which {
                            0 => &mut *dq,
                            1 => &mut *dk,
                            _ => &mut *dv,
                        };
                        pr.into(dst)
                    };
                    block(u, 0, scratch, &mut write);
                },
            );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive attention of one block (row-major q l x e, k s x e, v s x ev).
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        l: usize,
        s: usize,
        e: usize,
        ev: usize,
        scale: f32,
        causal: Option<i64>,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut p = vec![0f64; l * s];
        for i in 0..l {
            let vis = causal.map_or(s as i64, |o| (i as i64 + o + 1).clamp(0, s as i64)) as usize;
            let sc: Vec<f64> = (0..vis)
                .map(|j| {
                    (0..e)
                        .map(|c| (q[i * e + c] * k[j * e + c]) as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            for j in 0..vis {
                p[i * s + j] = (sc[j] - m).exp() / z;
            }
        }
        let mut o = vec![0f64; l * ev];
        for i in 0..l {
            for c in 0..ev {
                o[i * ev + c] = (0..s).map(|j| p[i * s + j] * v[j * ev + c] as f64).sum();
            }
        }
        (p, o)
    }

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.731 + seed).sin() * 1.7)
            .collect()
    }

    fn close(a: &[f32], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (*x as f64 - y).abs() <= tol * (1.0 + y.abs()),
                "{i}: {x} vs {y}"
            );
        }
    }

    /// Odd sizes (tails in every gemm dimension), L != S, both causal offsets and none.
    #[test]
    fn separate_layout_matches_naive_forward_and_backward() {
        for &(units, l, s, e, ev, causal) in &[
            (3usize, 5usize, 7usize, 3usize, 4usize, Some(0i64)),
            (2, 9, 4, 5, 1, None),
            (1, 17, 17, 13, 11, Some(0)),
            (2, 6, 9, 2, 3, Some(3)),
            // Several row and key blocks (CAUSAL_BLOCK = 32), the last ones partial, with and
            // without an offset.
            (1, 70, 66, 3, 2, Some(0)),
            (1, 66, 75, 2, 3, Some(7)),
        ] {
            let scale = 1.0 / (e as f32).sqrt();
            let (q, k, v) = (
                data(units * l * e, 0.1),
                data(units * s * e, 0.7),
                data(units * s * ev, 1.3),
            );
            let gy = data(units * l * ev, 2.1);
            let shapes: [&[usize]; 3] = [&[units, l, e], &[units, s, e], &[units, s, ev]];
            let geo = Geometry::new(&shapes, None, scale, causal);
            let mut out = vec![0.0; units * l * ev];
            forward(&geo, &[&q, &k, &v], &mut out);
            let mut grad = vec![0.0; units * (l * e + s * e + s * ev)];
            backward(&geo, &[&q, &k, &v, &out, &gy], &mut grad);
            // Gradients by central differences of sum(out * gy) in f64 through `naive`.
            let f = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
                (0..units)
                    .map(|u| {
                        let (_, o) = naive(
                            &q[u * l * e..][..l * e],
                            &k[u * s * e..][..s * e],
                            &v[u * s * ev..][..s * ev],
                            l,
                            s,
                            e,
                            ev,
                            scale,
                            causal,
                        );
                        o.iter()
                            .zip(&gy[u * l * ev..][..l * ev])
                            .map(|(a, b)| a * *b as f64)
                            .sum::<f64>()
                    })
                    .sum()
            };
            let mut want_o = Vec::new();
            for u in 0..units {
                let (_, o) = naive(
                    &q[u * l * e..][..l * e],
                    &k[u * s * e..][..s * e],
                    &v[u * s * ev..][..s * ev],
                    l,
                    s,
                    e,
                    ev,
                    scale,
                    causal,
                );
                want_o.extend(o);
            }
            close(&out, &want_o, 1e-4);
            let mut want_g = Vec::new();
            let h = 1e-2f32;
            for which in 0..3 {
                let n = [q.len(), k.len(), v.len()][which];
                for i in 0..n {
                    let mut xs = [q.clone(), k.clone(), v.clone()];
                    xs[which][i] += h;
                    let up = f(&xs[0], &xs[1], &xs[2]);
                    xs[which][i] -= 2.0 * h;
                    let dn = f(&xs[0], &xs[1], &xs[2]);
                    want_g.push((up - dn) / (2.0 * h as f64));
                }
            }
            close(&grad, &want_g, 2e-3);
        }
    }

    /// The packed layout gives the separate layout's results, head by head.
    #[test]
    fn packed_layout_matches_separate_layout() {
        let (b, t, h, e) = (3usize, 11usize, 3usize, 5usize);
        let qkv = data(b * t * 3 * h * e, 0.4);
        let gy = data(b * t * h * e, 0.9);
        let geo = Geometry::new(&[&[b, t, 3 * h * e]], Some(h), 0.37, Some(0));
        let mut out = vec![0.0; b * t * h * e];
        forward(&geo, &[&qkv], &mut out);
        let mut dqkv = vec![0.0; qkv.len()];
        backward(&geo, &[&qkv, &out, &gy], &mut dqkv);
        // Split into (b*h, t, e) separate tensors.
        let split = |x: &[f32], width: usize, part: usize| -> Vec<f32> {
            let mut r = Vec::new();
            for bi in 0..b {
                for j in 0..h {
                    for ti in 0..t {
                        let base = (bi * t + ti) * width + (part * h + j) * e;
                        r.extend_from_slice(&x[base..base + e]);
                    }
                }
            }
            r
        };
        let (q, k, v) = (
            split(&qkv, 3 * h * e, 0),
            split(&qkv, 3 * h * e, 1),
            split(&qkv, 3 * h * e, 2),
        );
        let g2 = split(&gy, h * e, 0);
        let sep = Geometry::new(
            &[&[b * h, t, e], &[b * h, t, e], &[b * h, t, e]],
            None,
            0.37,
            Some(0),
        );
        let mut out2 = vec![0.0; out.len()];
        forward(&sep, &[&q, &k, &v], &mut out2);
        let mut grad2 = vec![0.0; 3 * out.len()];
        backward(&sep, &[&q, &k, &v, &out2, &g2], &mut grad2);
        let n = out.len();
        let pairs = [
            (split(&out, h * e, 0), out2.clone()),
            (split(&dqkv, 3 * h * e, 0), grad2[..n].to_vec()),
            (split(&dqkv, 3 * h * e, 1), grad2[n..2 * n].to_vec()),
            (split(&dqkv, 3 * h * e, 2), grad2[2 * n..].to_vec()),
        ];
        for (a, b) in pairs {
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-5, "{x} vs {y}");
            }
        }
    }

    /// A query that sees no key gives NaN, as a softmax over nothing.
    #[test]
    fn fully_masked_rows_are_nan() {
        let (l, s, e) = (4usize, 2usize, 3usize);
        let geo = Geometry::new(&[&[1, l, e], &[1, s, e], &[1, s, e]], None, 1.0, Some(-2));
        let mut out = vec![0.0; l * e];
        forward(
            &geo,
            &[&data(l * e, 0.0), &data(s * e, 1.0), &data(s * e, 2.0)],
            &mut out,
        );
        assert!(out[..2 * e].iter().all(|x| x.is_nan()));
        assert!(out[2 * e..].iter().all(|x| x.is_finite()));
    }
}
