//! The `gemm` crate path: the float32 GEMM of CPUs without AVX2 + FMA, what
//! `RLX_CPU_GEMM=crate` selects, the reference the tests compare rlx's kernels with, and the
//! float64 GEMM.
use super::View;
use gemm::Parallelism;

/// Element types the `gemm` crate multiplies here.
pub trait Real: Copy + PartialEq + 'static {
    const ZERO: Self;
    const ONE: Self;
}
impl Real for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
}
impl Real for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
}

/// `c[cv] = beta * c[cv] + a[av] @ b[bv]` through `gemm::gemm`; the caller checked that every
/// view lies inside its slice and that `m, n, k > 0`.
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [T],
    cv: View,
    beta: T,
    a: &[T],
    av: View,
    b: &[T],
    bv: View,
    parallel: bool,
) {
    assert!(cv.last(m, n) < c.len() && av.last(m, k) < a.len() && bv.last(k, n) < b.len());
    let par = if parallel {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    // SAFETY: the assert proves every index the GEMM touches (offsets and strides as given)
    // lies inside `c`, `a` and `b`; `c` is a unique borrow, so it aliases neither input; with
    // `read_dst = false` (beta == 0) `c` is only written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr().add(cv.off),
            cv.cs as isize,
            cv.rs as isize,
            beta != T::ZERO,
            a.as_ptr().add(av.off),
            av.cs as isize,
            av.rs as isize,
            b.as_ptr().add(bv.off),
            bv.cs as isize,
            bv.rs as isize,
            beta,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    }
}
