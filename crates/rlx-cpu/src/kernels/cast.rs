//! Element type conversions (`Op::Cast`) between every pair of dtypes, and the float16 /
//! bfloat16 bit conversions they rest on.
//!
//! Narrowing float conversions round to nearest, ties to even, as numpy and PyTorch do:
//! float32 -> float16/bfloat16 on the bits (subnormals kept, overflow to inf), float64 and
//! int64 -> float16/bfloat16 through a float32 rounded to odd (which then rounds correctly: a
//! double rounding through a plain float32 could be off by one unit). NaN stays NaN (quieted,
//! sign and top payload bits kept), inf stays inf. Float -> integer truncates toward zero and
//! saturates at the integer's range, NaN giving 0 (numpy leaves these cases undefined);
//! int64 -> int32 wraps (as numpy's `astype`); anything -> bool is `x != 0` (NaN is true).
//!
//! float16 <-> float32 uses the CPU's F16C instructions when it has them (see `crate::f16c`,
//! chosen with the AVX2 kernels; `RLX_CPU_ISA=portable` keeps this file's code); the two give
//! identical bits, which the tests check over every float16 and many float32 values.
//! bfloat16 has no hardware path: AVX512-BF16's `vcvtneps2bf16` treats subnormal inputs as zero
//! and flushes subnormal results (numpy, ml_dtypes and PyTorch keep them), and the portable
//! rounding is a few integer operations per element, which the AVX2 build vectorises.
use super::par_zip;
use std::cmp::Ordering;

/// float32 -> float16 bits, round to nearest even.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let abs = b & 0x7fff_ffff;
    if abs >= 0x7f80_0000 {
        if abs > 0x7f80_0000 {
            // NaN: quiet, with the top payload bits.
            return sign | 0x7e00 | ((abs >> 13) & 0x3ff) as u16;
        }
        return sign | 0x7c00;
    }
    if abs >= 0x477f_f000 {
        // >= 65520 (the midpoint above float16's largest, 65504, which is odd): inf.
        return sign | 0x7c00;
    }
    if abs < 0x3300_0000 {
        // Below 2^-25 (half the smallest subnormal): zero. 2^-25 itself ties to even, 0 too.
        return sign;
    }
    let (q, rem, half) = if abs < 0x3880_0000 {
        // A float16 subnormal: units of 2^-24.
        let e = abs >> 23;
        let m = (abs & 0x7f_ffff) | 0x80_0000;
        let shift = 126 - e;
        (m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1))
    } else {
        // Rebias the exponent (127 -> 15) and drop 13 mantissa bits; a carry may bump the
        // exponent, which is the right result.
        let r = abs - 0x3800_0000;
        (r >> 13, r & 0x1fff, 0x1000)
    };
    let up = rem > half || (rem == half && q & 1 == 1);
    sign | (q + up as u32) as u16
}

/// float16 bits -> float32 (exact; a NaN is quieted, as the F16C instruction does).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let e = ((h >> 10) & 0x1f) as u32;
    let m = (h & 0x3ff) as u32;
    let bits = match e {
        0 => {
            // Zero or subnormal: m * 2^-24, exact in float32.
            let v = m as f32 * (1.0 / 16_777_216.0);
            return f32::from_bits(v.to_bits() | sign);
        }
        31 if m == 0 => sign | 0x7f80_0000,
        31 => sign | 0x7fc0_0000 | (m << 13),
        _ => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// float32 -> bfloat16 bits, round to nearest even.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        return ((b >> 16) | 0x0040) as u16;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// bfloat16 bits -> float32 (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// The float32 nearest `f` rounded to odd, given how the exact value compares with `f` (the
/// round-to-nearest result): on an inexact result, step toward zero if `f` overshot, then
/// make the last mantissa bit 1. Rounding that again to 11 or 8 bits is then correct.
#[inline(always)]
fn round_odd(f: f32, exact_vs_f: Ordering) -> f32 {
    if exact_vs_f == Ordering::Equal || f.is_nan() {
        return f;
    }
    // Overshot: |f| > |exact| (f = 0 never is; f = inf for a finite value always is).
    let overshot = if f > 0.0 {
        exact_vs_f == Ordering::Less
    } else {
        f < 0.0 && exact_vs_f == Ordering::Greater
    };
    let mut bits = f.to_bits();
    if overshot {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

/// float64 -> float32 rounded to odd.
#[inline(always)]
fn f64_to_f32_odd(x: f64) -> f32 {
    let f = x as f32;
    if x.is_nan() || x.is_infinite() {
        return f;
    }
    round_odd(f, x.partial_cmp(&(f as f64)).unwrap_or(Ordering::Equal))
}

/// int64 -> float32 rounded to odd.
#[inline(always)]
fn i64_to_f32_odd(x: i64) -> f32 {
    let f = x as f32;
    // `f` is an integer of at most 2^63 in size: exact in i128.
    round_odd(f, (x as i128).cmp(&(f as i128)))
}

pub fn f64_to_f16(x: f64) -> u16 {
    f32_to_f16(f64_to_f32_odd(x))
}
pub fn f64_to_bf16(x: f64) -> u16 {
    f32_to_bf16(f64_to_f32_odd(x))
}
fn i64_to_f16(x: i64) -> u16 {
    f32_to_f16(i64_to_f32_odd(x))
}
fn i64_to_bf16(x: i64) -> u16 {
    f32_to_bf16(i64_to_f32_odd(x))
}

/// The source of a cast, as typed slices of the arena.
pub enum Src<'a> {
    F32(&'a [f32]),
    I32(&'a [i32]),
    F16(&'a [u16]),
    BF16(&'a [u16]),
    F64(&'a [f64]),
    I64(&'a [i64]),
    Bool(&'a [u8]),
}

/// The destination of a cast.
pub enum Dst<'a> {
    F32(&'a mut [f32]),
    I32(&'a mut [i32]),
    F16(&'a mut [u16]),
    BF16(&'a mut [u16]),
    F64(&'a mut [f64]),
    I64(&'a mut [i64]),
    Bool(&'a mut [u8]),
}

/// One source element as the widest exact value of its kind.
#[derive(Clone, Copy)]
enum Wide {
    F(f64),
    I(i64),
}

/// Converts every element of `src` into `dst` (same length). The common float16 / bfloat16
/// <-> float32 pairs have loops of their own (vectorised; F16C for float16 when present).
pub fn cast(src: Src<'_>, dst: Dst<'_>) {
    match (src, dst) {
        (Src::F32(s), Dst::F16(d)) => {
            if !crate::f16c::f32_to_f16(s, d) {
                par_zip(d, s, |o, &x| *o = f32_to_f16(x))
            }
        }
        (Src::F16(s), Dst::F32(d)) => {
            if !crate::f16c::f16_to_f32(s, d) {
                par_zip(d, s, |o, &x| *o = f16_to_f32(x))
            }
        }
        (Src::F32(s), Dst::BF16(d)) => par_zip(d, s, |o, &x| *o = f32_to_bf16(x)),
        (Src::BF16(s), Dst::F32(d)) => par_zip(d, s, |o, &x| *o = bf16_to_f32(x)),
        (Src::F32(s), Dst::F32(d)) => par_zip(d, s, |o, &x| *o = x),
        (Src::I32(s), Dst::I32(d)) => par_zip(d, s, |o, &x| *o = x),
        (Src::F32(s), Dst::I32(d)) => par_zip(d, s, |o, &x| *o = x as i32),
        (Src::I32(s), Dst::F32(d)) => par_zip(d, s, |o, &x| *o = x as f32),
        (Src::F64(s), Dst::F32(d)) => par_zip(d, s, |o, &x| *o = x as f32),
        (Src::F32(s), Dst::F64(d)) => par_zip(d, s, |o, &x| *o = x as f64),
        (Src::I64(s), Dst::I32(d)) => par_zip(d, s, |o, &x| *o = x as i32),
        (Src::I32(s), Dst::I64(d)) => par_zip(d, s, |o, &x| *o = x as i64),
        (src, dst) => generic(src, dst),
    }
}

/// One destination's loop for a source read through `$wide` (element -> `Wide`): each pair
/// gets its own monomorphised, parallel loop (the `Wide` match folds away after inlining).
macro_rules! into_dst {
    ($s:expr, $wide:expr, $dst:expr) => {{
        let wide = $wide;
        match $dst {
            Dst::F32(d) => par_zip(d, $s, |o, &x| {
                *o = match wide(x) {
                    Wide::F(v) => v as f32,
                    Wide::I(v) => v as f32,
                }
            }),
            Dst::F64(d) => par_zip(d, $s, |o, &x| {
                *o = match wide(x) {
                    Wide::F(v) => v,
                    Wide::I(v) => v as f64,
                }
            }),
            Dst::F16(d) => par_zip(d, $s, |o, &x| {
                *o = match wide(x) {
                    Wide::F(v) => f64_to_f16(v),
                    Wide::I(v) => i64_to_f16(v),
                }
            }),
            Dst::BF16(d) => par_zip(d, $s, |o, &x| {
                *o = match wide(x) {
                    Wide::F(v) => f64_to_bf16(v),
                    Wide::I(v) => i64_to_bf16(v),
                }
            }),
            Dst::I32(d) => par_zip(d, $s, |o, &x| {
                *o = match wide(x) {
                    Wide::F(v) => v as i32,
                    Wide::I(v) => v as i32,
                }
            }),
            Dst::I64(d) => par_zip(d, $s, |o, &x| {
                *o = match wide(x) {
                    Wide::F(v) => v as i64,
                    Wide::I(v) => v,
                }
            }),
            Dst::Bool(d) => par_zip(d, $s, |o, &x| {
                *o = match wide(x) {
                    Wide::F(v) => (v != 0.0) as u8,
                    Wide::I(v) => (v != 0) as u8,
                }
            }),
        }
    }};
}

/// Every other pair, through one widened value per element (exact for each source dtype; the
/// narrowing step rounds once, see the module comment).
fn generic(src: Src<'_>, dst: Dst<'_>) {
    match src {
        Src::F32(s) => into_dst!(s, |x: f32| Wide::F(x as f64), dst),
        Src::F16(s) => into_dst!(s, |x: u16| Wide::F(f16_to_f32(x) as f64), dst),
        Src::BF16(s) => into_dst!(s, |x: u16| Wide::F(bf16_to_f32(x) as f64), dst),
        Src::F64(s) => into_dst!(s, |x: f64| Wide::F(x), dst),
        Src::I32(s) => into_dst!(s, |x: i32| Wide::I(x as i64), dst),
        Src::I64(s) => into_dst!(s, |x: i64| Wide::I(x), dst),
        Src::Bool(s) => into_dst!(s, |x: u8| Wide::I((x != 0) as i64), dst),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_values() -> Vec<(u16, f32)> {
        (0..=u16::MAX).map(|h| (h, f16_to_f32(h))).collect()
    }

    #[test]
    fn float16_decodes_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24)); // smallest subnormal
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24)); // largest subnormal
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14)); // smallest normal
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000); // -0
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
        assert!(f16_to_f32(0x7c01).is_nan() && f16_to_f32(0xfe00).is_nan());
        assert!(f16_to_f32(0xfe00).is_sign_negative());
    }

    #[test]
    fn every_float16_round_trips_through_float32() {
        for (h, f) in f16_values() {
            if f.is_nan() {
                let back = f32_to_f16(f);
                assert!(back & 0x7c00 == 0x7c00 && back & 0x3ff != 0, "{h:#06x}");
                assert_eq!(back & 0x8000, h & 0x8000, "NaN keeps its sign");
            } else {
                assert_eq!(f32_to_f16(f), h, "{h:#06x} = {f:e}");
            }
        }
        for h in 0..=u16::MAX {
            let f = bf16_to_f32(h);
            if !f.is_nan() {
                assert_eq!(f32_to_bf16(f), h, "bf16 {h:#06x}");
            } else {
                assert!(f32_to_bf16(f) & 0x7f80 == 0x7f80 && f32_to_bf16(f) & 0x7f != 0);
            }
        }
    }

    /// Midpoints between neighbouring float16 / bfloat16 values (exact in float32) go to the
    /// even neighbour; one float32 ulp either side goes to the nearer one.
    #[test]
    fn narrowing_rounds_to_nearest_even_at_every_midpoint() {
        type Conv = (fn(f32) -> u16, fn(u16) -> f32, u16);
        let convs: [Conv; 2] = [
            (f32_to_f16, f16_to_f32, 0x7c00),
            (f32_to_bf16, bf16_to_f32, 0x7f80),
        ];
        for (to, from, inf) in convs {
            for lo in 0..inf - 1 {
                for sign in [0u16, 0x8000] {
                    let (a, b) = (lo | sign, (lo + 1) | sign);
                    let (fa, fb) = (from(a), from(b));
                    let mid = ((fa as f64 + fb as f64) / 2.0) as f32;
                    assert_eq!(mid as f64, (fa as f64 + fb as f64) / 2.0, "exact midpoint");
                    let even = if lo & 1 == 0 { a } else { b };
                    assert_eq!(to(mid), even, "midpoint of {a:#06x} and {b:#06x}");
                    let toward_b = f32::from_bits(mid.to_bits() + 1);
                    let toward_a = f32::from_bits(mid.to_bits() - 1);
                    assert_eq!(to(toward_b), b, "just above the midpoint of {a:#06x}");
                    if mid != 0.0 {
                        assert_eq!(to(toward_a), a, "just below the midpoint of {a:#06x}");
                    }
                }
            }
        }
        // Overflow: float16's largest is 65504; 65519.99 rounds to it, 65520 to inf.
        assert_eq!(f32_to_f16(65519.99), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(-1e6), 0xfc00);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_f16(1e-8), 0); // below half the smallest subnormal
        assert_eq!(f32_to_f16(-1e-8), 0x8000);
    }

    /// float64 and int64 narrow in one correct rounding, where a double rounding through a
    /// nearest float32 would land on the even neighbour instead.
    #[test]
    fn wide_sources_round_once() {
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(
            f32_to_f16(x as f32),
            0x3c00,
            "double rounding would give 1.0"
        );
        assert_eq!(f64_to_f16(x), 0x3c01);
        let y = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(f64_to_bf16(y), 0x3f81);
        assert_eq!(f64_to_bf16(-y), 0xbf81);
        assert_eq!(
            f64_to_bf16(1.0 + 2f64.powi(-8)),
            0x3f80,
            "an exact tie goes to even"
        );
        let n: i64 = (1 << 30) + (1 << 22) + 1;
        assert_eq!(i64_to_bf16(n), 0x4e81);
        assert_eq!(i64_to_bf16(-n), 0xce81);
        assert_eq!(i64_to_f16(70_000), 0x7c00);
        assert_eq!(i64_to_f16(2049), 0x6800, "2049 ties to 2048");
        assert_eq!(f64_to_f16(1e300), 0x7c00);
        assert_eq!(f64_to_bf16(1e300), 0x7f80);
        assert_eq!(f64_to_f16(1e-300), 0);
        assert_eq!(f64_to_f16(-1e-300), 0x8000);
        assert_eq!(f64_to_f16(f64::NEG_INFINITY), 0xfc00);
        assert!(f16_to_f32(f64_to_f16(f64::NAN)).is_nan());
        assert!(bf16_to_f32(f64_to_bf16(f64::NAN)).is_nan());
        // A float64 subnormal-range float16 value: 3 * 2^-24 exactly.
        assert_eq!(f64_to_f16(3.0 * 2f64.powi(-24)), 0x0003);
    }

    #[test]
    fn every_pair_of_dtypes_converts() {
        let f = [1.5f32, -2.75, 0.0, f32::NAN, 3e9, -7.0];
        let mut i32s = [0i32; 6];
        cast(Src::F32(&f), Dst::I32(&mut i32s));
        assert_eq!(i32s, [1, -2, 0, 0, i32::MAX, -7]);
        let mut b = [9u8; 6];
        cast(Src::F32(&f), Dst::Bool(&mut b));
        assert_eq!(b, [1, 1, 0, 1, 1, 1]);
        let mut i64s = [0i64; 6];
        cast(Src::Bool(&b), Dst::I64(&mut i64s));
        assert_eq!(i64s, [1, 1, 0, 1, 1, 1]);
        let big = [i64::MAX, 1 << 40, -3];
        let mut wrapped = [0i32; 3];
        cast(Src::I64(&big), Dst::I32(&mut wrapped));
        assert_eq!(wrapped, [-1, 0, -3]);
        let mut h = [0u16; 6];
        cast(Src::F32(&f), Dst::BF16(&mut h));
        let mut d = [0f64; 6];
        cast(Src::BF16(&h), Dst::F64(&mut d));
        assert_eq!(&d[..3], &[1.5, -2.75, 0.0]);
        assert!(d[3].is_nan());
        let mut h16 = [0u16; 6];
        cast(Src::F64(&d), Dst::F16(&mut h16));
        assert_eq!(h16[0], 0x3e00);
        assert_eq!(h16[4], 0x7c00, "3e9 overflows float16");
        let mut back = [0u8; 6];
        cast(Src::F16(&h16), Dst::Bool(&mut back));
        assert_eq!(back, [1, 1, 0, 1, 1, 1]);
    }
}
