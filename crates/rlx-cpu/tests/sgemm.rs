//! rlx's float32 GEMM (`rlx_cpu::sgemm`) against a float64 reference on random shapes, strides,
//! transposes and accumulate modes, on every path this CPU can run (the AVX-512 and AVX2
//! kernels and the `gemm` crate), one thread and split over the pool.
use rlx_cpu::sgemm::{sgemm_on, Path, View};

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn val(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

/// A matrix of `r x c` stored at `v` inside a random buffer (untouched elements stay random).
fn stored(rng: &mut Rng, r: usize, c: usize, v: View) -> Vec<f32> {
    (0..v.last(r, c) + 1 + rng.below(3))
        .map(|_| rng.val())
        .collect()
}

/// A view of an `r x c` matrix: row-major or transposed, with padded strides and an offset.
fn view(rng: &mut Rng, r: usize, c: usize, transposed: bool) -> View {
    let off = rng.below(5);
    let pad = [0, 0, 1, 3][rng.below(4)];
    if transposed {
        View {
            off,
            rs: 1,
            cs: r + pad,
        }
    } else {
        View {
            off,
            rs: c + pad,
            cs: 1,
        }
    }
}

const PATHS: [Path; 3] = [Path::Avx512, Path::Avx2Fma, Path::Crate];

#[allow(clippy::too_many_arguments)]
fn check(
    rng: &mut Rng,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    cv: View,
    beta: f32,
    parallel: bool,
) -> usize {
    let av = view(rng, m, k, ta);
    let bv = view(rng, k, n, tb);
    let a = stored(rng, m, k, av);
    let b = stored(rng, k, n, bv);
    let c0 = stored(rng, m, n, cv);
    let at = |x: &[f32], v: View, i: usize, j: usize| x[v.off + i * v.rs + j * v.cs] as f64;
    let mut ran = 0;
    for p in PATHS {
        let mut c = c0.clone();
        if beta == 0.0 {
            // With beta == 0 the old contents must not be read: NaNs there must vanish.
            for i in 0..m {
                for j in 0..n {
                    c[cv.off + i * cv.rs + j * cv.cs] = f32::NAN;
                }
            }
        }
        if !sgemm_on(p, m, n, k, &mut c, cv, beta, &a, av, &b, bv, parallel) {
            continue;
        }
        ran += 1;
        let mut inside = vec![false; c.len()];
        for i in 0..m {
            for j in 0..n {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for q in 0..k {
                    let x = at(&a, av, i, q) * at(&b, bv, q, j);
                    want += x;
                    mag += x.abs();
                }
                let old = at(&c0, cv, i, j);
                want += beta as f64 * old;
                mag += (beta as f64 * old).abs();
                let idx = cv.off + i * cv.rs + j * cv.cs;
                inside[idx] = true;
                let got = c[idx] as f64;
                assert!(
                    (got - want).abs() <= 2e-6 * mag + 1e-6,
                    "{} m{m} n{n} k{k} ta{ta} tb{tb} c{cv:?} beta{beta} par{parallel}: \
                     C[{i},{j}] = {got}, want {want}",
                    p.name()
                );
            }
        }
        // Elements outside the C view are untouched.
        for (idx, (x, y)) in c.iter().zip(&c0).enumerate() {
            assert!(
                inside[idx] || x.to_bits() == y.to_bits(),
                "{} wrote C[{idx}]",
                p.name()
            );
        }
    }
    ran
}

#[test]
fn random_shapes_strides_and_transposes_match_f64() {
    let dims = [1, 7, 13, 31, 33, 65, 257];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut ran = 0;
    for case in 0..160 {
        let (m, n, k) = (
            dims[rng.below(dims.len())],
            dims[rng.below(dims.len())],
            dims[rng.below(dims.len())],
        );
        let (ta, tb) = (case % 2 == 1, case / 2 % 2 == 1);
        let beta = [0.0, 1.0, 0.5][rng.below(3)];
        let cv = view(&mut rng, m, n, false);
        ran += check(&mut rng, m, n, k, ta, tb, cv, beta, case % 3 == 0);
    }
    // The `gemm` crate runs on every CPU; on x86-64 with AVX2 the kernels ran too.
    assert!(ran >= 160);
    if rlx_cpu::isa::avx2_fma_available() {
        assert!(ran >= 320);
    }
}

#[test]
fn every_row_and_column_remainder_of_the_tiles() {
    // Every m mod 14 and mod 6, every n mod 32 and mod 16 (the kernels' tiles).
    let mut rng = Rng(12345);
    for m in 1..=29 {
        for n in [1, 5, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65] {
            let cv = View::rows(0, n);
            check(&mut rng, m, n, 9, false, true, cv, 1.0, false);
        }
    }
}

#[test]
fn deep_and_large_products_split_over_threads() {
    // Depth beyond one packed block (256), rows beyond one A block (336), both splits.
    let mut rng = Rng(777);
    for (m, n, k) in [
        (700, 70, 600),
        (64, 256, 256),
        (33, 1000, 300),
        (1024, 128, 128),
        (128, 512, 1024),
    ] {
        for (ta, tb) in [(false, true), (true, false), (false, false)] {
            let cv = View::rows(0, n);
            check(&mut rng, m, n, k, ta, tb, cv, 0.0, true);
            check(&mut rng, m, n, k, ta, tb, cv, 1.0, true);
        }
    }
}

#[test]
fn column_major_and_strided_outputs() {
    let mut rng = Rng(4242);
    for (m, n, k) in [(13, 33, 31), (65, 7, 257), (1, 31, 13), (31, 1, 65)] {
        let colmajor = View {
            off: 2,
            rs: 1,
            cs: m + 1,
        };
        let strided = View {
            off: 1,
            rs: 2 * n + 3,
            cs: 2,
        };
        for cv in [colmajor, strided] {
            for beta in [0.0, 1.0] {
                check(&mut rng, m, n, k, false, true, cv, beta, false);
                check(&mut rng, m, n, k, true, false, cv, beta, true);
            }
        }
    }
}

#[test]
fn empty_and_zero_depth_products() {
    for p in PATHS {
        let mut c = vec![3.0f32; 6];
        if !sgemm_on(
            p,
            2,
            3,
            0,
            &mut c,
            View::rows(0, 3),
            0.5,
            &[],
            View::rows(0, 0),
            &[],
            View::rows(0, 3),
            false,
        ) {
            continue;
        }
        assert_eq!(c, [1.5; 6], "{}", p.name());
        sgemm_on(
            p,
            2,
            3,
            0,
            &mut c,
            View::rows(0, 3),
            0.0,
            &[],
            View::rows(0, 0),
            &[],
            View::rows(0, 3),
            false,
        );
        assert_eq!(c, [0.0; 6], "{}", p.name());
        let mut c = vec![3.0f32; 2];
        sgemm_on(
            p,
            0,
            2,
            5,
            &mut c,
            View::rows(0, 2),
            0.0,
            &[],
            View::rows(0, 5),
            &[1.0; 10],
            View::rows(0, 2),
            false,
        );
        assert_eq!(c, [3.0; 2], "{}", p.name());
    }
}

#[test]
#[should_panic(expected = "outside its slice")]
fn a_view_outside_its_slice_panics() {
    let mut c = vec![0.0f32; 4];
    let a = [1.0f32; 3];
    let b = [1.0f32; 4];
    sgemm_on(
        Path::Crate,
        2,
        2,
        2,
        &mut c,
        View::rows(0, 2),
        0.0,
        &a,
        View::rows(0, 2),
        &b,
        View::rows(0, 2),
        false,
    );
}
