//! The matrix engine's attention, platform-neutral: which planned attention launches run as one
//! compiled graph (MPSGraph on Apple, `crate::sys`) instead of the MSL row kernel, the key an
//! executable is compiled and cached under, and a reference of what that graph computes (the
//! host GPU runs it, so routing and results are tested on Linux against the CPU backend).
//!
//! The engine takes the forward pass (`rlx_attention`): `out = softmax(scale * q k^T + mask)
//! v` per head, the causal mask hiding key `j` from query `i` where `j > i + off`; and the
//! gradient (`rlx_attention_grad`), which recomputes the probabilities `p` and gives
//! `dv = p^T g`, `ds = scale p (g v^T - rowsum(p g v^T))`, `dq = ds k`, `dk = ds^T q`. The
//! operands must be head-major (`[blocks, heads, rows, cols]` packed, so each is one array of
//! `[blocks * heads, rows, cols]` at a byte offset) or the packed q|k|v layout of
//! `Op::Attention { heads: Some(h) }` (one `[b, t, 3, h, e]` array in, `[b, t, h, e]` out; the
//! graph slices and transposes it into heads and back), every query must see a key (`off >= 0`, as
//! a query that sees none is NaN by definition), and the scores (materialised by the graph)
//! must stay under the plan's bound for materialised scores. The size threshold is the matmul
//! engine's; the switch is `RLX_METAL_MPSGRAPH_ATTENTION`, which follows `RLX_METAL_MPSGRAPH`
//! unless set.
use crate::matmul::{offset_ok, MatmulPolicy, MAX_ARRAY_ELEMENTS};
use rlx_runtime::gpu_plan::{Loc, GEMM_ATTENTION_MAX_SCORES, P};

/// One attention as the engine compiles it: `bh` heads (blocks x heads) of `l` queries and `s`
/// keys, head sizes `e` (q, k) and `ev` (v, out), the scale (as its bits, so the key hashes),
/// the causal offset, whether it is the gradient, and the layout (`heads: None` head-major,
/// `Some(h)`: packed q|k|v of `h` heads, `l = s` tokens). Offsets are not part of the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionKey {
    pub bh: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    pub scale_bits: u32,
    pub causal: Option<i64>,
    pub grad: bool,
    pub heads: Option<usize>,
}

impl AttentionKey {
    pub fn scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
    /// The shapes of the arrays of a call, feeds first. Head-major: q, k, v, out for the
    /// forward pass; q, k, v, g (the output's gradient), dq, dk, dv for the gradient. Packed:
    /// qkv `[b, t, 3, h, e]`, out `[b, t, h, e]`; qkv, g, dqkv for the gradient.
    pub fn shapes(&self) -> Vec<Vec<usize>> {
        if let Some(h) = self.heads {
            let (b, t, e) = (self.bh / h, self.l, self.e);
            let (qkv, o) = (vec![b, t, 3, h, e], vec![b, t, h, e]);
            return if self.grad {
                vec![qkv.clone(), o, qkv]
            } else {
                vec![qkv, o]
            };
        }
        let (q, k, v, o) = (
            vec![self.bh, self.l, self.e],
            vec![self.bh, self.s, self.e],
            vec![self.bh, self.s, self.ev],
            vec![self.bh, self.l, self.ev],
        );
        if self.grad {
            vec![q.clone(), k.clone(), v.clone(), o, q, k, v]
        } else {
            vec![q, k, v, o]
        }
    }
    /// How many of [`AttentionKey::shapes`] are feeds (the rest are results).
    pub fn feeds(&self) -> usize {
        match (self.heads.is_some(), self.grad) {
            (false, true) => 4,
            (false, false) => 3,
            (true, true) => 2,
            (true, false) => 1,
        }
    }
    /// The byte sizes of the arrays of a call, as `shapes`.
    pub fn bytes(&self) -> Vec<usize> {
        self.shapes()
            .iter()
            .map(|s| s.iter().product::<usize>() * 4)
            .collect()
    }
    /// Multiply-adds, as the GEMM path's threshold counts them.
    pub fn work(&self) -> usize {
        self.bh * self.l * self.s * self.e.max(self.ev)
    }
    /// Whether key `j` is hidden from query `i`.
    pub fn masked(&self, i: usize, j: usize) -> bool {
        self.causal.is_some_and(|off| j as i64 > i as i64 + off)
    }
}

/// A planned attention launch as an engine key and the places of its arrays (as
/// [`AttentionKey::shapes`]), or why it stays on the MSL kernel: the forward pass
/// (`rlx_attention`, `operands` by slot: 0 q, 1 k, 2 v, 3 out) or, with `grad`, the gradient
/// (`rlx_attention_grad`: 0 q, 1 k, 2 v, 3 the forward output, 4 g, 5 the gradient output
/// holding dq, dk and dv at their record bases).
pub fn attention_of(
    p: &P,
    operands: &[(usize, Loc)],
    grad: bool,
) -> std::result::Result<(AttentionKey, Vec<Loc>), String> {
    let dim = |i: usize| usize::try_from(p.iv[i]).map_err(|_| "a negative dimension".to_string());
    let (units, h, l, s, e, ev) = (dim(0)?, dim(1)?, dim(2)?, dim(3)?, dim(4)?, dim(5)?);
    if [units, h, l, s, e, ev].contains(&0) {
        return Err("an empty dimension (no array of it can be made)".into());
    }
    let causal = (p.iv[6] != 0).then_some(p.iv[7]);
    if causal.is_some_and(|off| off < 0) {
        return Err("a causal offset below 0 (queries that see no key)".into());
    }
    let key = AttentionKey {
        bh: units * h,
        l,
        s,
        e,
        ev,
        scale_bits: p.fv[0].to_bits(),
        causal,
        grad,
        heads: None,
    };
    let scores = key.bh * l * s;
    if scores > MAX_ARRAY_ELEMENTS || scores * 4 > GEMM_ATTENTION_MAX_SCORES {
        return Err(format!(
            "{scores} scores, more than the engine materialises"
        ));
    }
    match head_major(p, operands, key, units, h) {
        Ok(places) => Ok((key, places)),
        Err(why) => match packed(p, operands, key, units, h) {
            Some(places) => Ok((
                AttentionKey {
                    heads: Some(h),
                    ..key
                },
                places,
            )),
            None => Err(why),
        },
    }
}

/// The places of a launch's arrays where they are all head-major, or why not.
fn head_major(
    p: &P,
    operands: &[(usize, Loc)],
    key: AttentionKey,
    units: usize,
    h: usize,
) -> std::result::Result<Vec<Loc>, String> {
    let AttentionKey {
        l, s, e, ev, grad, ..
    } = key;
    // (name, operand slot, record strides, rows, columns) of each array, in call order
    let arrays: &[(&str, usize, usize, usize, usize)] = if grad {
        &[
            ("q", 0, 0, l, e),
            ("k", 1, 1, s, e),
            ("v", 2, 2, s, ev),
            ("g", 4, 3, l, ev),
            ("dq", 5, 4, l, e),
            ("dk", 5, 5, s, e),
            ("dv", 5, 6, s, ev),
        ]
    } else {
        &[
            ("q", 0, 0, l, e),
            ("k", 1, 1, s, e),
            ("v", 2, 2, s, ev),
            ("out", 3, 3, l, ev),
        ]
    };
    let mut places = Vec::with_capacity(arrays.len());
    for &(name, slot, x, rows, cols) in arrays {
        let loc = operands
            .iter()
            .find(|(o, _)| *o == slot)
            .map(|(_, l)| *l)
            .ok_or_else(|| format!("the launch has no {name}"))?;
        let [su, sh, sr, base] = [p.st[x][0], p.st[x][1], p.st[x][2], p.st[x][3]];
        let dims = [units, h, rows];
        let want = [(h * rows * cols) as i64, (rows * cols) as i64, cols as i64];
        let packed = dims
            .iter()
            .zip([su, sh, sr].iter().zip(want))
            .all(|(&d, (&st, w))| d == 1 || st == w);
        if !packed {
            return Err(format!(
                "{name} is not head-major (strides {su}, {sh}, {sr} for [{units}, {h}, {rows}, \
                 {cols}])"
            ));
        }
        if key.bh * rows * cols > MAX_ARRAY_ELEMENTS {
            return Err(format!("{name} has 2^31 elements or more"));
        }
        let base = usize::try_from(base).map_err(|_| format!("{name} at a negative offset"))?;
        let offset = loc.offset + base * 4;
        offset_ok(offset)?;
        places.push(Loc {
            buf: loc.buf,
            offset,
        });
    }
    Ok(places)
}

/// The places of a launch's arrays (qkv, out; or qkv, g, dqkv) where it is the packed q|k|v
/// layout the plan makes for `heads: Some(h)` (`b` blocks of `t` tokens, each row
/// `q | k | v` of `h` heads of `e`, the output rows `h` heads of `e`), else `None`.
fn packed(
    p: &P,
    operands: &[(usize, Loc)],
    key: AttentionKey,
    b: usize,
    h: usize,
) -> Option<Vec<Loc>> {
    let AttentionKey { l, s, e, ev, .. } = key;
    // The q|k|v array holds three times a head-major array's elements (the bound those check).
    if l != s || e != ev || 3 * key.bh * l * e > MAX_ARRAY_ELEMENTS {
        return None;
    }
    let (t, he) = (l as i64, (h * e) as i64);
    let at = |slot: usize| operands.iter().find(|(o, _)| *o == slot).map(|(_, l)| *l);
    // dims of size 1 take any stride
    let matches = |x: usize, want: [i64; 4]| {
        let st = &p.st[x];
        [b as i64, h as i64, t]
            .iter()
            .enumerate()
            .all(|(d, &n)| n == 1 || st[d] == want[d])
            && st[3] == want[3]
    };
    let row = 3 * he;
    let qkv_ok =
        |first: usize| (0..3).all(|x| matches(first + x, [t * row, e as i64, row, x as i64 * he]));
    let out_ok = matches(3, [t * he, e as i64, he, 0]);
    let qkv = at(0)?;
    if !qkv_ok(0) || !out_ok || at(1)? != qkv || at(2)? != qkv {
        return None;
    }
    let places = if key.grad {
        if !qkv_ok(4) {
            return None;
        }
        vec![qkv, at(4)?, at(5)?]
    } else {
        vec![qkv, at(3)?]
    };
    places
        .iter()
        .all(|l| offset_ok(l.offset).is_ok())
        .then_some(places)
}

/// The attention policy a value of `RLX_METAL_MPSGRAPH_ATTENTION` asks for: unset or empty
/// follows the matmuls' policy (`RLX_METAL_MPSGRAPH`); otherwise the same values as that
/// variable (`0`/`off`, `1`/`on`, `all`); anything else is an `Input` error naming it.
pub fn policy(matmul: MatmulPolicy, value: Option<&str>) -> rlx_ir::Result<MatmulPolicy> {
    match value.map(str::trim) {
        None | Some("") => Ok(matmul),
        Some(v) => MatmulPolicy::parse(Some(v)).map_err(|_| {
            rlx_ir::Error::input(
                "RLX_METAL_MPSGRAPH_ATTENTION",
                format!("must be 0, off, 1, on or all, not {v:?}"),
            )
        }),
    }
}

/// Whether an attention of key (or ineligibility) `key` runs on the engine under `policy`;
/// `Err` says why not.
pub fn route(
    policy: &MatmulPolicy,
    key: std::result::Result<AttentionKey, String>,
) -> std::result::Result<AttentionKey, String> {
    if !policy.enabled {
        return Err("the engine is off for attention (RLX_METAL_MPSGRAPH(_ATTENTION)=0)".into());
    }
    let key = key?;
    if key.work() < policy.min_work {
        return Err(format!(
            "{} multiply-adds, below the engine's threshold of {}",
            key.work(),
            policy.min_work
        ));
    }
    Ok(key)
}

/// The probabilities of query `i` of head `z` (the masked softmax of its scaled scores).
fn probabilities(key: &AttentionKey, q: &[f32], k: &[f32], z: usize, i: usize, p: &mut [f32]) {
    let AttentionKey { l, s, e, .. } = *key;
    let scale = key.scale();
    let qi = &q[(z * l + i) * e..][..e];
    let mut max = f32::NEG_INFINITY;
    for (j, sc) in p.iter_mut().enumerate() {
        *sc = if key.masked(i, j) {
            f32::NEG_INFINITY
        } else {
            let kj = &k[(z * s + j) * e..][..e];
            scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>()
        };
        max = max.max(*sc);
    }
    let mut sum = 0f32;
    for sc in p.iter_mut() {
        *sc = (*sc - max).exp();
        sum += *sc;
    }
    for sc in p.iter_mut() {
        *sc /= sum;
    }
}

/// What the engine's graph computes, in float32 as the graph does: from the feeds (packed
/// arrays of the key's shapes, in order) the results, each zeroed first (the host GPU's engine
/// attention).
pub fn reference(key: &AttentionKey, feeds: &[&[f32]], results: &mut [Vec<f32>]) {
    if let Some(h) = key.heads {
        // The packed layout through the head-major one: (b, t, x, j, d) <-> x (b, j, t, d).
        let (b, t, e) = (key.bh / h, key.l, key.e);
        let at = |parts: usize, x: usize, bb: usize, tt: usize, j: usize| {
            (((bb * t + tt) * parts + x) * h + j) * e
        };
        let split = |a: &[f32], parts: usize| -> Vec<Vec<f32>> {
            (0..parts)
                .map(|x| {
                    let mut o = Vec::with_capacity(b * h * t * e);
                    for bb in 0..b {
                        for j in 0..h {
                            for tt in 0..t {
                                o.extend_from_slice(&a[at(parts, x, bb, tt, j)..][..e]);
                            }
                        }
                    }
                    o
                })
                .collect()
        };
        let join = |parts: &[Vec<f32>], out: &mut Vec<f32>| {
            let n = parts.len();
            for (x, part) in parts.iter().enumerate() {
                let mut rows = part.chunks(e);
                for bb in 0..b {
                    for j in 0..h {
                        for tt in 0..t {
                            let row = rows.next().expect("a full head-major array");
                            out[at(n, x, bb, tt, j)..][..e].copy_from_slice(row);
                        }
                    }
                }
            }
        };
        let flat = AttentionKey {
            heads: None,
            ..*key
        };
        let mut heads: Vec<Vec<f32>> = split(feeds[0], 3);
        if key.grad {
            heads.extend(split(feeds[1], 1));
        }
        let views: Vec<&[f32]> = heads.iter().map(Vec::as_slice).collect();
        let n = if key.grad { 3 } else { 1 };
        let mut out: Vec<Vec<f32>> = vec![vec![0f32; b * h * t * e]; n];
        reference(&flat, &views, &mut out);
        join(&out, &mut results[0]);
        return;
    }
    let AttentionKey { l, s, e, ev, .. } = *key;
    let (q, k, v) = (feeds[0], feeds[1], feeds[2]);
    let mut p = vec![0f32; s];
    for r in results.iter_mut() {
        r.fill(0.0);
    }
    if !key.grad {
        let out = &mut results[0];
        for z in 0..key.bh {
            for i in 0..l {
                probabilities(key, q, k, z, i, &mut p);
                let o = &mut out[(z * l + i) * ev..][..ev];
                for (j, &w) in p.iter().enumerate() {
                    for (od, vd) in o.iter_mut().zip(&v[(z * s + j) * ev..][..ev]) {
                        *od += w * vd;
                    }
                }
            }
        }
        return;
    }
    let g = feeds[3];
    let scale = key.scale();
    let [dq, dk, dv] = results else {
        panic!("the gradient has three results");
    };
    let mut dp = vec![0f32; s];
    for z in 0..key.bh {
        for i in 0..l {
            probabilities(key, q, k, z, i, &mut p);
            let gi = &g[(z * l + i) * ev..][..ev];
            for (j, d) in dp.iter_mut().enumerate() {
                let vj = &v[(z * s + j) * ev..][..ev];
                *d = gi.iter().zip(vj).map(|(a, b)| a * b).sum::<f32>();
            }
            let rs: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            let qi = &q[(z * l + i) * e..][..e];
            for j in 0..s {
                for (dvd, gd) in dv[(z * s + j) * ev..][..ev].iter_mut().zip(gi) {
                    *dvd += p[j] * gd;
                }
                let ds = scale * p[j] * (dp[j] - rs);
                let kj = &k[(z * s + j) * e..][..e];
                for (dqd, kd) in dq[(z * l + i) * e..][..e].iter_mut().zip(kj) {
                    *dqd += ds * kd;
                }
                for (dkd, qd) in dk[(z * s + j) * e..][..e].iter_mut().zip(qi) {
                    *dkd += ds * qd;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward record as the plan makes it for `heads: None` tensors of `units` blocks (the
    /// gradient's extra strides too: dq | dk | dv in one output).
    fn record(units: usize, l: usize, s: usize, e: usize, causal: Option<i64>) -> P {
        let mut p = P::sized(units * l);
        p.iv[..6].copy_from_slice(&[units as i64, 1, l as i64, s as i64, e as i64, e as i64]);
        if let Some(off) = causal {
            p.iv[6] = 1;
            p.iv[7] = off;
        }
        p.fv[0] = 0.125;
        let (l_, s_, e_) = (l as i64, s as i64, e as i64);
        let (qn, kn) = (units as i64 * l_ * e_, units as i64 * s_ * e_);
        p.st[0][..4].copy_from_slice(&[l_ * e_, 0, e_, 0]);
        p.st[1][..4].copy_from_slice(&[s_ * e_, 0, e_, 0]);
        p.st[2][..4].copy_from_slice(&[s_ * e_, 0, e_, 0]);
        p.st[3][..4].copy_from_slice(&[l_ * e_, 0, e_, 0]);
        p.st[4][..4].copy_from_slice(&[l_ * e_, 0, e_, 0]);
        p.st[5][..4].copy_from_slice(&[s_ * e_, 0, e_, qn]);
        p.st[6][..4].copy_from_slice(&[s_ * e_, 0, e_, qn + kn]);
        p
    }

    fn ops() -> Vec<(usize, Loc)> {
        (0..6)
            .map(|x| {
                (
                    x,
                    Loc {
                        buf: 0,
                        offset: x * 4096,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn head_major_launches_become_keys_with_their_places() {
        let (key, places) = attention_of(&record(6, 16, 24, 8, Some(0)), &ops(), false).unwrap();
        assert_eq!(
            key,
            AttentionKey {
                bh: 6,
                l: 16,
                s: 24,
                e: 8,
                ev: 8,
                scale_bits: 0.125f32.to_bits(),
                causal: Some(0),
                grad: false,
                heads: None,
            }
        );
        let at: Vec<usize> = places.iter().map(|p| p.offset).collect();
        assert_eq!(at, [0, 4096, 8192, 12288]);
        assert_eq!(
            key.bytes(),
            [6 * 16 * 32, 6 * 24 * 32, 6 * 24 * 32, 6 * 16 * 32]
        );
        assert!(key.masked(0, 1) && !key.masked(1, 1));
        // the gradient: g in slot 4 with the output's strides; dq | dk | dv in slot 5
        let (key, places) = attention_of(&record(6, 16, 24, 8, None), &ops(), true).unwrap();
        assert!(key.grad && key.feeds() == 4 && key.shapes().len() == 7);
        let at: Vec<usize> = places.iter().map(|p| p.offset).collect();
        let (qb, kb) = (6 * 16 * 8 * 4, 6 * 24 * 8 * 4);
        let out = 5 * 4096;
        assert_eq!(at, [0, 4096, 8192, 4 * 4096, out, out + qb, out + qb + kb]);
    }

    #[test]
    fn other_layouts_and_masks_stay_on_the_kernel_with_the_reason() {
        // a packed qkv row (stride 3 * e) is not head-major
        let mut p = record(2, 8, 8, 4, None);
        p.st[1][2] = 12;
        let e = attention_of(&p, &ops(), false).unwrap_err();
        assert!(e.contains("k is not head-major"), "{e}");
        let e = attention_of(&record(2, 8, 8, 4, Some(-1)), &ops(), true).unwrap_err();
        assert!(e.contains("causal offset"), "{e}");
        let mut odd = ops();
        odd[2].1.offset = 2;
        let e = attention_of(&record(2, 8, 8, 4, None), &odd, false).unwrap_err();
        assert!(e.contains("float32 boundary"), "{e}");
        let e = attention_of(&record(2, 8, 0, 4, None), &ops(), false).unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let small = attention_of(&record(1, 4, 4, 4, None), &ops(), false).map(|k| k.0);
        let e = route(&MatmulPolicy::default(), small.clone()).unwrap_err();
        assert!(e.contains("threshold"), "{e}");
        assert!(route(&MatmulPolicy::ALL, small.clone()).is_ok());
        assert!(route(&MatmulPolicy::OFF, small)
            .unwrap_err()
            .contains("off"));
    }

    #[test]
    fn the_attention_switch_follows_the_matmuls_unless_set() {
        let on = MatmulPolicy::default();
        assert_eq!(policy(on, None).unwrap(), on);
        assert_eq!(
            policy(MatmulPolicy::OFF, Some("")).unwrap(),
            MatmulPolicy::OFF
        );
        assert_eq!(policy(on, Some("0")).unwrap(), MatmulPolicy::OFF);
        assert_eq!(
            policy(MatmulPolicy::OFF, Some("all")).unwrap(),
            MatmulPolicy::ALL
        );
        let e = policy(on, Some("yes")).unwrap_err().to_string();
        assert!(e.contains("RLX_METAL_MPSGRAPH_ATTENTION"), "{e}");
    }

    #[test]
    fn the_reference_is_a_masked_softmax_average_and_its_gradient() {
        // one head, 2 queries, 2 keys of size 1; causal: query 0 sees only key 0
        let mut key = AttentionKey {
            bh: 1,
            l: 2,
            s: 2,
            e: 1,
            ev: 1,
            scale_bits: 1.0f32.to_bits(),
            causal: Some(0),
            grad: false,
            heads: None,
        };
        let (q, k, v) = ([1.0f32, 1.0], [0.0f32, 1.0], [10.0f32, 20.0]);
        let mut out = vec![vec![0f32; 2]];
        reference(&key, &[&q, &k, &v], &mut out);
        let w = 1.0f32.exp() / (1.0 + 1.0f32.exp());
        assert_eq!(out[0][0], 10.0);
        assert!((out[0][1] - (10.0 * (1.0 - w) + 20.0 * w)).abs() < 1e-4);
        // the gradient of sum(out * g) against central differences in q, k, v
        key.grad = true;
        let g = [0.5f32, -2.0];
        let mut grads = vec![vec![0f32; 2]; 3];
        reference(&key, &[&q, &k, &v, &g], &mut grads);
        let loss = |q: &[f32], k: &[f32], v: &[f32]| {
            let fwd = AttentionKey { grad: false, ..key };
            let mut o = vec![vec![0f32; 2]];
            reference(&fwd, &[q, k, v], &mut o);
            o[0].iter().zip(&g).map(|(a, b)| a * b).sum::<f32>()
        };
        let h = 1e-2f32;
        for (which, grad) in grads.iter().enumerate() {
            for i in 0..2 {
                let mut x = [q, k, v];
                x[which][i] += h;
                let up = loss(&x[0], &x[1], &x[2]);
                x[which][i] -= 2.0 * h;
                let down = loss(&x[0], &x[1], &x[2]);
                let fd = (up - down) / (2.0 * h);
                assert!(
                    (grad[i] - fd).abs() < 1e-2,
                    "d{}[{i}]: {} vs {fd}",
                    ["q", "k", "v"][which],
                    grad[i]
                );
            }
        }
    }
}
