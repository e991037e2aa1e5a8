//! Elementwise kernels: unary math, broadcast binary ops and comparisons, `where`.
use super::{map_rows, par_zip, Strided};
use rlx_ir::{BinaryOp, UnaryOp};

pub fn unary(op: UnaryOp, x: &[f32], out: &mut [f32]) {
    match op {
        UnaryOp::Neg => par_zip(out, x, |o, &x| *o = -x),
        UnaryOp::Relu => par_zip(out, x, |o, &x| *o = x.max(0.0)),
        UnaryOp::Tanh => par_zip(out, x, |o, &x| *o = x.tanh()),
        UnaryOp::Sigmoid => par_zip(out, x, |o, &x| *o = 1.0 / (1.0 + (-x).exp())),
        UnaryOp::Exp => par_zip(out, x, |o, &x| *o = x.exp()),
        UnaryOp::Log => par_zip(out, x, |o, &x| *o = x.ln()),
        UnaryOp::Sqrt => par_zip(out, x, |o, &x| *o = x.sqrt()),
        UnaryOp::PowScalar(p) => {
            if p == 2.0 {
                par_zip(out, x, |o, &x| *o = x * x)
            } else {
                par_zip(out, x, |o, &x| *o = x.powf(p))
            }
        }
    }
}

/// Numbers the binary kernels work on.
pub trait Num: Copy + Send + Sync + PartialOrd + 'static {
    fn arith(op: BinaryOp, a: Self, b: Self) -> Self;
}

impl Num for f32 {
    #[inline(always)]
    fn arith(op: BinaryOp, a: f32, b: f32) -> f32 {
        match op {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            _ => compare(op, a, b),
        }
    }
}

impl Num for i32 {
    #[inline(always)]
    fn arith(op: BinaryOp, a: i32, b: i32) -> i32 {
        match op {
            BinaryOp::Add => a.wrapping_add(b),
            BinaryOp::Sub => a.wrapping_sub(b),
            BinaryOp::Mul => a.wrapping_mul(b),
            // Integer division by zero gives 0 rather than trapping.
            BinaryOp::Div => a.checked_div(b).unwrap_or(0),
            _ => compare(op, a, b) as i32,
        }
    }
}

#[inline(always)]
fn compare<T: PartialOrd>(op: BinaryOp, a: T, b: T) -> f32 {
    let r = match op {
        BinaryOp::Lt => a < b,
        BinaryOp::Le => a <= b,
        BinaryOp::Gt => a > b,
        BinaryOp::Ge => a >= b,
        BinaryOp::Eq => a == b,
        _ => a != b,
    };
    r as i32 as f32
}

/// `out = a (op) b` with numpy broadcasting.
#[allow(clippy::too_many_arguments)]
pub fn binary<T: Num>(op: BinaryOp, a: &[T], ash: &[usize], b: &[T], bsh: &[usize], od: &[usize], out: &mut [T]) {
    zip_with(a, ash, b, bsh, od, out, move |x, y| T::arith(op, x, y));
}

/// Comparisons whose float32 mask output differs in type from the operands.
#[allow(clippy::too_many_arguments)]
pub fn compare_into<T: Num>(op: BinaryOp, a: &[T], ash: &[usize], b: &[T], bsh: &[usize], od: &[usize], out: &mut [f32]) {
    zip_with(a, ash, b, bsh, od, out, move |x, y| compare(op, x, y));
}

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
    map_rows(out, od, &[&sa, &sb], |row, st, sp| {
        let n = row.len();
        match (sp[0], sp[1]) {
            (1, 1) => {
                for ((o, &x), &y) in row.iter_mut().zip(&a[st[0]..st[0] + n]).zip(&b[st[1]..st[1] + n]) {
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
    });
}

/// `out = cond != 0 ? a : b`, all broadcast.
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
    let (sc, sa, sb) = (Strided::broadcast(csh, od), Strided::broadcast(ash, od), Strided::broadcast(bsh, od));
    map_rows(out, od, &[&sc, &sa, &sb], |row, st, sp| {
        for (i, o) in row.iter_mut().enumerate() {
            *o = if c[st[0] + i * sp[0]] != 0.0 { a[st[1] + i * sp[1]] } else { b[st[2] + i * sp[2]] };
        }
    });
}
