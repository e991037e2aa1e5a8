//! The `gemm` crate path of the float32 GEMM: what CPUs without AVX2 + FMA run, what
//! `RLX_CPU_GEMM=crate` selects, and the reference the tests compare rlx's kernels with.
use super::View;
use gemm::Parallelism;

/// `c[cv] = beta * c[cv] + a[av] @ b[bv]` through `gemm::gemm`; the caller checked that every
/// view lies inside its slice and that `m, n, k > 0`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [f32],
    cv: View,
    beta: f32,
    a: &[f32],
    av: View,
    b: &[f32],
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
            beta != 0.0,
            a.as_ptr().add(av.off),
            av.cs as isize,
            av.rs as isize,
            b.as_ptr().add(bv.off),
            bv.cs as isize,
            bv.rs as isize,
            beta,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}
