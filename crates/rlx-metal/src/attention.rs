//! The matrix engine's attention, platform-neutral: which planned attention launches run as one
//! compiled graph (MPSGraph on Apple, `crate::sys`) instead of the MSL row kernel, the key an
//! executable is compiled and cached under, and a reference of what that graph computes (the
//! host GPU runs it, so routing and results are tested on Linux against the CPU backend).
//!
//! The engine takes the forward pass only (`rlx_attention`): `out = softmax(scale * q k^T +
//! mask) v` per head, the causal mask hiding key `j` from query `i` where `j > i + off`. Its
//! operands must be head-major (`[blocks, heads, rows, cols]` packed, so each is one array of
//! `[blocks * heads, rows, cols]` at a byte offset), every query must see a key (`off >= 0`, as
//! a query that sees none is NaN by definition), and the scores (materialised by the graph)
//! must stay under the plan's bound for materialised scores. The gradient stays on the MSL
//! kernel. The size threshold is the matmul engine's; the switch is
//! `RLX_METAL_MPSGRAPH_ATTENTION`, which follows `RLX_METAL_MPSGRAPH` unless set.
use crate::matmul::{offset_ok, MatmulPolicy, MAX_ARRAY_ELEMENTS};
use rlx_runtime::gpu_plan::{Loc, GEMM_ATTENTION_MAX_SCORES, P};

/// One attention as the engine compiles it: `bh` heads (blocks x heads) of `l` queries and `s`
/// keys, head sizes `e` (q, k) and `ev` (v, out), the scale (as its bits, so the key hashes)
/// and the causal offset. Offsets are not part of the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionKey {
    pub bh: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    pub scale_bits: u32,
    pub causal: Option<i64>,
}

impl AttentionKey {
    pub fn scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
    /// The shapes of q, k, v and out, as arrays.
    pub fn shapes(&self) -> [[usize; 3]; 4] {
        [
            [self.bh, self.l, self.e],
            [self.bh, self.s, self.e],
            [self.bh, self.s, self.ev],
            [self.bh, self.l, self.ev],
        ]
    }
    /// The byte sizes of q, k, v and out.
    pub fn bytes(&self) -> [usize; 4] {
        self.shapes().map(|s| s.iter().product::<usize>() * 4)
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

/// A planned attention forward launch (`rlx_attention`, record `p`, `operands` by slot: 0 q,
/// 1 k, 2 v, 3 out) as an engine key and the places of q, k, v and out, or why it stays on the
/// MSL kernel.
pub fn attention_of(
    p: &P,
    operands: &[(usize, Loc)],
) -> std::result::Result<(AttentionKey, [Loc; 4]), String> {
    let dim = |i: usize| usize::try_from(p.iv[i]).map_err(|_| "a negative dimension".to_string());
    let (units, h, l, s, e, ev) = (dim(0)?, dim(1)?, dim(2)?, dim(3)?, dim(4)?, dim(5)?);
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
    };
    let scores = key.bh * l * s;
    if scores > MAX_ARRAY_ELEMENTS || scores * 4 > GEMM_ATTENTION_MAX_SCORES {
        return Err(format!(
            "{scores} scores, more than the engine materialises"
        ));
    }
    let mut places = [Loc { buf: 0, offset: 0 }; 4];
    for (x, (rows, cols)) in [(l, e), (s, e), (s, ev), (l, ev)].into_iter().enumerate() {
        let name = ["q", "k", "v", "out"][x];
        let loc = operands
            .iter()
            .find(|(slot, _)| *slot == x)
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
        places[x] = Loc {
            buf: loc.buf,
            offset,
        };
    }
    Ok((key, places))
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

/// What the engine's graph computes, in float32 as the graph does: `out` from `q`, `k`, `v`
/// (packed arrays of the key's shapes). The host GPU's engine attention.
pub fn reference(key: &AttentionKey, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
    let AttentionKey { l, s, e, ev, .. } = *key;
    let scale = key.scale();
    let mut scores = vec![0f32; s];
    for z in 0..key.bh {
        for i in 0..l {
            let qi = &q[(z * l + i) * e..][..e];
            let mut max = f32::NEG_INFINITY;
            for (j, sc) in scores.iter_mut().enumerate() {
                *sc = if key.masked(i, j) {
                    f32::NEG_INFINITY
                } else {
                    let kj = &k[(z * s + j) * e..][..e];
                    scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>()
                };
                max = max.max(*sc);
            }
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            let o = &mut out[(z * l + i) * ev..][..ev];
            o.fill(0.0);
            for (j, &w) in scores.iter().enumerate() {
                let vj = &v[(z * s + j) * ev..][..ev];
                for (od, vd) in o.iter_mut().zip(vj) {
                    *od += w / sum * vd;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward record as the plan makes it for `heads: None` tensors of `units` blocks.
    fn record(units: usize, l: usize, s: usize, e: usize, causal: Option<i64>) -> P {
        let mut p = P::sized(units * l);
        p.iv[..6].copy_from_slice(&[units as i64, 1, l as i64, s as i64, e as i64, e as i64]);
        if let Some(off) = causal {
            p.iv[6] = 1;
            p.iv[7] = off;
        }
        p.fv[0] = 0.125;
        let (l_, s_, e_) = (l as i64, s as i64, e as i64);
        p.st[0][..4].copy_from_slice(&[l_ * e_, 0, e_, 0]);
        p.st[1][..4].copy_from_slice(&[s_ * e_, 0, e_, 0]);
        p.st[2][..4].copy_from_slice(&[s_ * e_, 0, e_, 0]);
        p.st[3][..4].copy_from_slice(&[l_ * e_, 0, e_, 0]);
        p
    }

    fn ops() -> Vec<(usize, Loc)> {
        (0..4)
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
        let (key, places) = attention_of(&record(6, 16, 24, 8, Some(0)), &ops()).unwrap();
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
            }
        );
        assert_eq!(places.map(|p| p.offset), [0, 4096, 8192, 12288]);
        assert_eq!(
            key.bytes(),
            [6 * 16 * 32, 6 * 24 * 32, 6 * 24 * 32, 6 * 16 * 32]
        );
        assert!(key.masked(0, 1) && !key.masked(1, 1));
    }

    #[test]
    fn other_layouts_and_masks_stay_on_the_kernel_with_the_reason() {
        // a packed qkv row (stride 3 * e) is not head-major
        let mut p = record(2, 8, 8, 4, None);
        p.st[1][2] = 12;
        let e = attention_of(&p, &ops()).unwrap_err();
        assert!(e.contains("k is not head-major"), "{e}");
        let e = attention_of(&record(2, 8, 8, 4, Some(-1)), &ops()).unwrap_err();
        assert!(e.contains("causal offset"), "{e}");
        let mut odd = ops();
        odd[2].1.offset = 2;
        let e = attention_of(&record(2, 8, 8, 4, None), &odd).unwrap_err();
        assert!(e.contains("float32 boundary"), "{e}");
        let small = attention_of(&record(1, 4, 4, 4, None), &ops()).map(|k| k.0);
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
    fn the_reference_is_a_masked_softmax_average() {
        // one head, 2 queries, 2 keys of size 1; causal: query 0 sees only key 0
        let key = AttentionKey {
            bh: 1,
            l: 2,
            s: 2,
            e: 1,
            ev: 1,
            scale_bits: 1.0f32.to_bits(),
            causal: Some(0),
        };
        let mut out = [0f32; 2];
        reference(&key, &[1.0, 1.0], &[0.0, 1.0], &[10.0, 20.0], &mut out);
        let w = 1.0f32.exp() / (1.0 + 1.0f32.exp());
        assert_eq!(out[0], 10.0);
        assert!(
            (out[1] - (10.0 * (1.0 - w) + 20.0 * w)).abs() < 1e-4,
            "{out:?}"
        );
    }
}
