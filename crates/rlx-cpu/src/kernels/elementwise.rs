//! Elementwise kernels: unary math, broadcast binary ops and comparisons, `where`.
use super::{map_rows, math, par_zip, Strided};
use rlx_ir::{BinaryOp, UnaryOp};

#[inline(always)]
pub fn unary(op: UnaryOp, x: &[f32], out: &mut [f32]) {
    match op {
        UnaryOp::Neg => par_zip(out, x, |o, &x| *o = -x),
        UnaryOp::Relu => par_zip(out, x, |o, &x| *o = if x < 0.0 { 0.0 } else { x }), // NaN stays NaN
        UnaryOp::Tanh => par_zip(out, x, |o, &x| *o = math::tanh(x)),
        UnaryOp::Sigmoid => par_zip(out, x, |o, &x| *o = 1.0 / (1.0 + math::exp(-x))),
        UnaryOp::Exp => par_zip(out, x, |o, &x| *o = math::exp(x)),
        UnaryOp::Log => par_zip(out, x, |o, &x| *o = x.ln()),
        UnaryOp::Sqrt => par_zip(out, x, |o, &x| *o = x.sqrt()),
        UnaryOp::Gelu => par_zip(out, x, |o, &x| *o = gelu(x)),
        UnaryOp::GeluTanh => par_zip(out, x, |o, &x| *o = gelu_tanh(x).0),
        UnaryOp::GeluDeriv => par_zip(out, x, |o, &x| *o = gelu_deriv(x)),
        UnaryOp::GeluTanhDeriv => par_zip(out, x, |o, &x| *o = gelu_tanh(x).1),
        UnaryOp::PowScalar(p) => {
            if p == 2.0 {
                par_zip(out, x, |o, &x| *o = x * x)
            } else if p == 1.0 {
                par_zip(out, x, |o, &x| *o = x)
            } else {
                par_zip(out, x, |o, &x| *o = x.powf(p))
            }
        }
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `x * Phi(x)`.
#[inline(always)]
pub(super) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + math::erf(x * INV_SQRT_2))
}

/// `Phi(x) + x * phi(x)`; erf(x/sqrt 2) and phi(x) share the one `exp(-x^2/2)`.
#[inline(always)]
pub(super) fn gelu_deriv(x: f32) -> f32 {
    let e = math::exp(-0.5 * x * x);
    0.5 * (1.0 + math::erf_with_exp(x * INV_SQRT_2, e)) + x * INV_SQRT_2PI * e
}

/// The tanh approximation and its derivative.
#[inline(always)]
pub(super) fn gelu_tanh(x: f32) -> (f32, f32) {
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let t = math::tanh(u);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * x * x);
    (
        0.5 * x * (1.0 + t),
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
    )
}

/// Numbers the binary kernels work on.
pub trait Num: Copy + Send + Sync + PartialOrd + 'static {
    fn add(a: Self, b: Self) -> Self;
    fn sub(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn div(a: Self, b: Self) -> Self;
    /// Floor division (Python's `//`).
    fn floor_div(a: Self, b: Self) -> Self;
    /// Remainder with the divisor's sign (Python's `%`).
    fn rem(a: Self, b: Self) -> Self;
    fn from_bool(v: bool) -> Self;
}

macro_rules! float_num {
    ($t:ty) => {
        impl Num for $t {
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline(always)]
            fn sub(a: $t, b: $t) -> $t {
                a - b
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a * b
            }
            #[inline(always)]
            fn div(a: $t, b: $t) -> $t {
                a / b
            }
            /// Python's algorithm (PyTorch's `div_floor_floating`): the quotient of `a - fmod(a, b)`,
            /// corrected so it is exact for representable results; by zero, `a / b` (inf or NaN).
            #[inline(always)]
            fn floor_div(a: $t, b: $t) -> $t {
                if b == 0.0 {
                    return a / b;
                }
                let m = a % b;
                let mut div = (a - m) / b;
                if m != 0.0 && (b < 0.0) != (m < 0.0) {
                    div -= 1.0;
                }
                if div == 0.0 {
                    return (0.0 as $t).copysign(a / b);
                }
                let f = div.floor();
                if div - f > 0.5 {
                    f + 1.0
                } else {
                    f
                }
            }
            /// `fmod` moved to the divisor's sign; NaN by zero.
            #[inline(always)]
            fn rem(a: $t, b: $t) -> $t {
                let m = a % b;
                if m != 0.0 && (b < 0.0) != (m < 0.0) {
                    m + b
                } else {
                    m
                }
            }
            #[inline(always)]
            fn from_bool(v: bool) -> $t {
                v as i32 as $t
            }
        }
    };
}

float_num!(f32);
float_num!(f64);

/// Integer arithmetic as numpy's: wrapping `+ - *`, floor division and the divisor-signed
/// remainder (callers check divisors for zero first, `has_zero`; 0 if one slips by).
macro_rules! int_num {
    ($t:ty) => {
        impl Num for $t {
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn sub(a: $t, b: $t) -> $t {
                a.wrapping_sub(b)
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            /// Truncating division, for the trait only: an integer `Div` node computes a
            /// float32 quotient (`int_true_div`).
            #[inline(always)]
            fn div(a: $t, b: $t) -> $t {
                a.checked_div(b).unwrap_or(0)
            }
            /// Rounds toward -inf; `MIN // -1` wraps to `MIN` as numpy's does.
            #[inline(always)]
            fn floor_div(a: $t, b: $t) -> $t {
                if b == 0 {
                    return 0;
                }
                let (q, r) = (a.wrapping_div(b), a.wrapping_rem(b));
                if r != 0 && (r < 0) != (b < 0) {
                    q - 1
                } else {
                    q
                }
            }
            /// The remainder with the divisor's sign; `MIN % -1` is 0.
            #[inline(always)]
            fn rem(a: $t, b: $t) -> $t {
                if b == 0 {
                    return 0;
                }
                let r = a.wrapping_rem(b);
                if r != 0 && (r < 0) != (b < 0) {
                    r + b
                } else {
                    r
                }
            }
            #[inline(always)]
            fn from_bool(v: bool) -> $t {
                v as $t
            }
        }

        impl Int for $t {
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            const ZERO: $t = 0;
            const MIN: $t = <$t>::MIN;
        }
    };
}

/// The integer dtypes' extras: an exact-enough float for true division, zero and the minimum
/// (a max reduction's start).
pub trait Int: Num + Eq + Ord {
    fn to_f64(self) -> f64;
    const ZERO: Self;
    const MIN: Self;
}

int_num!(i32);
int_num!(i64);

/// `out = a (op) b` with numpy broadcasting. Each op is its own monomorphic loop so the
/// compiler can vectorise it; comparisons give 0/1 in the operand type.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn binary<T: Num>(
    op: BinaryOp,
    a: &[T],
    ash: &[usize],
    b: &[T],
    bsh: &[usize],
    od: &[usize],
    out: &mut [T],
) {
    match op {
        BinaryOp::Add => zip_with(a, ash, b, bsh, od, out, T::add),
        BinaryOp::Sub => zip_with(a, ash, b, bsh, od, out, T::sub),
        BinaryOp::Mul => zip_with(a, ash, b, bsh, od, out, T::mul),
        BinaryOp::Div => zip_with(a, ash, b, bsh, od, out, T::div),
        BinaryOp::FloorDiv => zip_with(a, ash, b, bsh, od, out, T::floor_div),
        BinaryOp::Mod => zip_with(a, ash, b, bsh, od, out, T::rem),
        _ => compare_into(op, a, ash, b, bsh, od, out),
    }
}

/// True division of integer tensors: a float32 quotient (computed in f64: int32 operands
/// exactly, so it is rounded once; int64 ones beyond 2^53 are rounded to f64 first), as numpy
/// and PyTorch give a float for `/` on integers; by zero, +-inf or NaN.
pub fn int_true_div<T: Int>(
    a: &[T],
    ash: &[usize],
    b: &[T],
    bsh: &[usize],
    od: &[usize],
    out: &mut [f32],
) {
    zip_with(a, ash, b, bsh, od, out, |x, y| {
        (x.to_f64() / y.to_f64()) as f32
    })
}

/// Whether an integer divisor holds a zero (every element of a broadcast operand is read when
/// the output is not empty, so any zero would be divided by).
pub fn has_zero<T: Int>(x: &[T]) -> bool {
    x.iter().fold(false, |z, &v| z | (v == T::ZERO))
}

/// Comparisons as 0/1 masks of type `O` (float32 masks from int32 operands, for instance).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn compare_into<T: Num, O: Num>(
    op: BinaryOp,
    a: &[T],
    ash: &[usize],
    b: &[T],
    bsh: &[usize],
    od: &[usize],
    out: &mut [O],
) {
    match op {
        BinaryOp::Lt => zip_with(a, ash, b, bsh, od, out, |x, y| O::from_bool(x < y)),
        BinaryOp::Le => zip_with(a, ash, b, bsh, od, out, |x, y| O::from_bool(x <= y)),
        BinaryOp::Gt => zip_with(a, ash, b, bsh, od, out, |x, y| O::from_bool(x > y)),
        BinaryOp::Ge => zip_with(a, ash, b, bsh, od, out, |x, y| O::from_bool(x >= y)),
        BinaryOp::Eq => zip_with(a, ash, b, bsh, od, out, |x, y| O::from_bool(x == y)),
        BinaryOp::Ne => zip_with(a, ash, b, bsh, od, out, |x, y| O::from_bool(x != y)),
        _ => unreachable!("arithmetic ops are handled by `binary`"),
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn zip_with<A: Copy + Sync, B: Copy + Sync, O: Send>(
    a: &[A],
    ash: &[usize],
    b: &[B],
    bsh: &[usize],
    od: &[usize],
    out: &mut [O],
    f: impl Fn(A, B) -> O + Sync,
) {
    let (sa, sb) = (Strided::broadcast(ash, od), Strided::broadcast(bsh, od));
    map_rows(
        out,
        od,
        &[&sa, &sb],
        #[inline(always)]
        |row, st, sp| {
            let n = row.len();
            match (sp[0], sp[1]) {
                (1, 1) => {
                    for ((o, &x), &y) in row
                        .iter_mut()
                        .zip(&a[st[0]..st[0] + n])
                        .zip(&b[st[1]..st[1] + n])
                    {
                        *o = f(x, y);
                    }
                }
                (1, 0) => {
                    let y = b[st[1]];
                    for (o, &x) in row.iter_mut().zip(&a[st[0]..st[0] + n]) {
                        *o = f(x, y);
                    }
                }
                (0, 1) => {
                    let x = a[st[0]];
                    for (o, &y) in row.iter_mut().zip(&b[st[1]..st[1] + n]) {
                        *o = f(x, y);
                    }
                }
                (pa, pb) => {
                    for (i, o) in row.iter_mut().enumerate() {
                        *o = f(a[st[0] + i * pa], b[st[1] + i * pb]);
                    }
                }
            }
        },
    );
}

/// `out = cond != 0 ? a : b`, all broadcast.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn select<T: Copy + Send + Sync>(
    c: &[f32],
    csh: &[usize],
    a: &[T],
    ash: &[usize],
    b: &[T],
    bsh: &[usize],
    od: &[usize],
    out: &mut [T],
) {
    let (sc, sa, sb) = (
        Strided::broadcast(csh, od),
        Strided::broadcast(ash, od),
        Strided::broadcast(bsh, od),
    );
    map_rows(
        out,
        od,
        &[&sc, &sa, &sb],
        #[inline(always)]
        |row, st, sp| {
            let n = row.len();
            match (sp[0], sp[1], sp[2]) {
                // The causal-mask pattern: contiguous condition and values, a scalar fill.
                (1, 1, 0) => {
                    let fill = b[st[2]];
                    for ((o, &m), &v) in row
                        .iter_mut()
                        .zip(&c[st[0]..st[0] + n])
                        .zip(&a[st[1]..st[1] + n])
                    {
                        *o = if m != 0.0 { v } else { fill };
                    }
                }
                (1, 1, 1) => {
                    let rows = c[st[0]..st[0] + n]
                        .iter()
                        .zip(&a[st[1]..st[1] + n])
                        .zip(&b[st[2]..st[2] + n]);
                    for (o, ((&m, &x), &y)) in row.iter_mut().zip(rows) {
                        *o = if m != 0.0 { x } else { y };
                    }
                }
                (pc, pa, pb) => {
                    for (i, o) in row.iter_mut().enumerate() {
                        *o = if c[st[0] + i * pc] != 0.0 {
                            a[st[1] + i * pa]
                        } else {
                            b[st[2] + i * pb]
                        };
                    }
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python's `//` and `%` on ints, by brute force over small values and the int32 edges.
    #[test]
    fn int_floor_div_and_rem_follow_python() {
        for a in -20i32..=20 {
            for b in (-7i32..=7).filter(|&b| b != 0) {
                let (q, r) = (i32::floor_div(a, b), i32::rem(a, b));
                assert_eq!(q, (a as f64 / b as f64).floor() as i32, "{a} // {b}");
                assert_eq!(q * b + r, a, "{a} % {b}");
                assert!(r == 0 || (r < 0) == (b < 0), "{a} % {b} = {r}");
            }
        }
        assert_eq!(i32::floor_div(i32::MIN, -1), i32::MIN); // wraps, as numpy's
        assert_eq!(i32::rem(i32::MIN, -1), 0);
        assert_eq!(i32::floor_div(i32::MAX, i32::MIN), -1);
        assert_eq!(i32::rem(i32::MAX, i32::MIN), -1);
        assert!(has_zero(&[3, 0, 1]) && !has_zero(&[3, -1]) && !has_zero::<i64>(&[]));
        assert_eq!(i64::floor_div(i64::MIN, -1), i64::MIN);
        assert_eq!((i64::floor_div(-7, 2), i64::rem(-7, 2)), (-4, 1));
        assert_eq!(i64::add(i64::MAX, 1), i64::MIN);
    }

    #[test]
    fn float_floor_div_and_rem_follow_python() {
        let cases = [
            (7.5f32, 2.0f32, 3.0f32, 1.5f32),
            (-7.5, 2.0, -4.0, 0.5),
            (7.5, -2.0, -4.0, -0.5),
            (-7.5, -2.0, 3.0, -1.5),
            (1.0, f32::INFINITY, 0.0, 1.0),
            (-1.0, f32::INFINITY, -1.0, f32::INFINITY),
        ];
        for (a, b, q, r) in cases {
            assert_eq!(f32::floor_div(a, b), q, "{a} // {b}");
            assert_eq!(f32::rem(a, b), r, "{a} % {b}");
        }
        assert_eq!(f32::floor_div(1.0, 0.0), f32::INFINITY);
        assert!(f32::floor_div(0.0, 0.0).is_nan() && f32::rem(1.0, 0.0).is_nan());
        assert!(f32::floor_div(-0.0, 3.0).is_sign_negative());
    }

    #[test]
    fn int_true_division_is_a_float_quotient() {
        let mut out = [0.0f32; 4];
        int_true_div(&[7, -7, 1, i32::MIN], &[4], &[2], &[1], &[4], &mut out);
        assert_eq!(out, [3.5, -3.5, 0.5, -1_073_741_824.0]);
    }
}
