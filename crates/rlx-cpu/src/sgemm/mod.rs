//! rlx's own float32 GEMM: `C = beta * C + op(A) @ op(B)` over strided operands (so transposed
//! inputs are read in place), packed and cache-blocked, with a register-blocked micro-kernel per
//! instruction set chosen once per process by run-time detection: AVX-512F (`avx512.rs`),
//! AVX2 + FMA (`avx2.rs`), else the `gemm` crate (`fallback.rs`, also the reference in tests).
//! `RLX_CPU_GEMM=crate` selects the `gemm` crate on any CPU, `RLX_CPU_GEMM=avx2` the AVX2 kernel
//! on an AVX-512 CPU. `RLX_CPU_ISA` does not change the GEMM (as before this GEMM existed, when
//! the `gemm` crate chose its kernels itself): the baseline and AVX2 builds of the other kernels
//! keep giving the same bits.
//!
//! This file owns the choice of kernel and the driver: the K/N/M blocking, packing into
//! per-thread buffers (`pack.rs`) and the split over the rayon pool.
mod avx2;
mod avx512;
pub(crate) mod fallback;
mod pack;

/// The 8 x 8 register transpose, for the layout kernels' batched transposes.
pub(crate) use avx2::{available as transpose8_available, transpose8};

use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};

/// A strided matrix inside a slice: element (i, j) is at `off + i * rs + j * cs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl View {
    /// Row-major rows of `rs` elements starting at `off`.
    pub fn rows(off: usize, rs: usize) -> View {
        View { off, rs, cs: 1 }
    }
    /// The transpose of this view.
    pub fn t(self) -> View {
        View {
            off: self.off,
            rs: self.cs,
            cs: self.rs,
        }
    }
    /// The index of element (r - 1, c - 1): the last one an `r x c` matrix reads.
    pub fn last(self, r: usize, c: usize) -> usize {
        self.off + (r - 1) * self.rs + (c - 1) * self.cs
    }
}

/// Which GEMM code runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// rlx's kernel for AVX-512F (14 x 32 register tile).
    Avx512,
    /// rlx's kernel for AVX2 + FMA (6 x 16 register tile).
    Avx2Fma,
    /// The `gemm` crate (its own run-time dispatch); any CPU.
    Crate,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Avx512 => "avx512",
            Path::Avx2Fma => "avx2",
            Path::Crate => "crate",
        }
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Path::Avx512 => avx512::available(),
            Path::Avx2Fma => avx2::available(),
            Path::Crate => true,
        }
    }
}

const UNSET: u8 = 0;
static CHOSEN: AtomicU8 = AtomicU8::new(UNSET);

fn code(p: Path) -> u8 {
    match p {
        Path::Avx512 => 1,
        Path::Avx2Fma => 2,
        Path::Crate => 3,
    }
}

/// The path GEMMs take in this process: chosen once from `RLX_CPU_GEMM` and the CPU (the
/// fastest kernel the CPU has, unless the environment asks for another).
pub fn path() -> Path {
    match CHOSEN.load(Ordering::Relaxed) {
        1 => Path::Avx512,
        2 => Path::Avx2Fma,
        3 => Path::Crate,
        _ => {
            let gemm = std::env::var("RLX_CPU_GEMM")
                .unwrap_or_default()
                .to_ascii_lowercase();
            let p = if gemm == "crate" {
                Path::Crate
            } else if gemm != "avx2" && Path::Avx512.available() {
                Path::Avx512
            } else if Path::Avx2Fma.available() {
                Path::Avx2Fma
            } else {
                Path::Crate
            };
            let _ = CHOSEN.compare_exchange(UNSET, code(p), Ordering::Relaxed, Ordering::Relaxed);
            path_from(CHOSEN.load(Ordering::Relaxed))
        }
    }
}

fn path_from(c: u8) -> Path {
    match c {
        1 => Path::Avx512,
        2 => Path::Avx2Fma,
        _ => Path::Crate,
    }
}

/// Makes every later GEMM in this process take `p` (benchmarks compare them); a path this CPU
/// cannot run is refused (`false`) and the choice is left as it was.
pub fn force(p: Path) -> bool {
    if !p.available() {
        return false;
    }
    CHOSEN.store(code(p), Ordering::Relaxed);
    true
}

/// `c[cv] = beta * c[cv] + a[av] (m x k) @ b[bv] (k x n)` on the process's [`path`]. With
/// `beta == 0` the old contents of `c` are not read (NaNs there do not propagate). `parallel`
/// allows splitting the work over the rayon pool (done only for a row-major `c`).
///
/// Panics if a view reaches outside its slice.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
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
    sgemm_on(path(), m, n, k, c, cv, beta, a, av, b, bv, parallel);
}

/// [`sgemm`] on a given path; returns `false` (and does nothing) when this CPU cannot run it.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_on(
    p: Path,
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
) -> bool {
    if !p.available() {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    assert!(cv.last(m, n) < c.len(), "sgemm: C view outside its slice");
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let x = &mut c[cv.off + i * cv.rs + j * cv.cs];
                *x = if beta == 0.0 { 0.0 } else { beta * *x };
            }
        }
        return true;
    }
    assert!(
        av.last(m, k) < a.len() && bv.last(k, n) < b.len(),
        "sgemm: A or B view outside its slice"
    );
    if p == Path::Crate {
        fallback::gemm(m, n, k, c, cv, beta, a, av, b, bv, parallel);
        return true;
    }
    // A column-major C is the row-major C^T = B^T A^T.
    if cv.cs != 1 && cv.rs == 1 {
        return sgemm_on(p, n, m, k, c, cv.t(), beta, b, bv.t(), a, av.t(), parallel);
    }
    if cv.cs != 1 || (m > 1 && cv.rs < n) {
        // Any other layout of C (not on a hot path): compute into a row-major scratch matrix
        // and combine.
        let mut t = vec![0.0f32; m * n];
        sgemm_on(
            p,
            m,
            n,
            k,
            &mut t,
            View::rows(0, n),
            0.0,
            a,
            av,
            b,
            bv,
            parallel,
        );
        for i in 0..m {
            for j in 0..n {
                let x = &mut c[cv.off + i * cv.rs + j * cv.cs];
                let v = t[i * n + j];
                *x = if beta == 0.0 { v } else { beta * *x + v };
            }
        }
        return true;
    }
    let c = &mut c[cv.off..];
    let rs = if m == 1 { n } else { cv.rs };
    match p {
        Path::Avx512 => split::<avx512::Kernel>(m, n, k, c, rs, beta, a, av, b, bv, parallel),
        Path::Avx2Fma => split::<avx2::Kernel>(m, n, k, c, rs, beta, a, av, b, bv, parallel),
        Path::Crate => unreachable!(),
    }
    true
}

/// One instruction set's micro-kernel, as the driver sees it.
pub(crate) trait Micro {
    /// Rows of the register tile (and of one packed A panel).
    const MR: usize;
    /// Columns of the register tile (and of one packed B panel).
    const NR: usize;
    /// Whether a column-major A (a transposed operand) is read in place rather than packed.
    /// In place, one tile reads `MR` floats from each of `kc` cache lines: on a 32 KB L1 a
    /// 512-deep tile fills it (the weight-gradient products on an AVX2 Zen 3: 58-72 GFLOP/s in
    /// place, see BENCHMARKS.md); a 48 KB L1 keeps it.
    const COLS_IN_PLACE: bool;
    /// `C[0..mc, 0..nc] = beta * C + A (mc x kc, see [`ASrc`]) @ packed B (panels of kc x NR)`,
    /// C row-major with row stride `rs` from `c`. Panics unless `a` and `pb` hold every
    /// element the block reads.
    ///
    /// # Safety
    /// The CPU must run the kernel's instruction set; `c` must be valid for writes of every
    /// element `i * rs + j` (`i < mc`, `j < nc`), and no other thread may touch them meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(
        kc: usize,
        mc: usize,
        nc: usize,
        a: ASrc,
        pb: &[f32],
        c: *mut f32,
        rs: usize,
        beta: f32,
    );
}

/// How a micro-kernel reads the rows of A.
#[derive(Clone, Copy)]
pub(crate) enum ASrc<'a> {
    /// Packed panels of MR rows (zero-padded): element (i, p) of panel t at
    /// `t * MR * kc + p * MR + i % MR`.
    Packed(&'a [f32]),
    /// Row-major A read in place (whole tiles of MR rows only): element (i, p) at `i * rs + p`.
    Rows(&'a [f32], usize),
    /// Column-major A (a transposed operand) read in place (whole tiles only): element (i, p)
    /// at `p * cs + i`.
    Cols(&'a [f32], usize),
}

// The blocking, chosen by measurement on the shapes of the benchmark workloads (Sapphire
// Rapids: 48 KB L1, 2 MB L2 per core): the micro-kernels keep one tile of A rows (MR x KC,
// 28 KB for AVX-512) in L1 while the packed B block (KC x NC, 1 MB) streams by from L2.
/// Depth of one block (KC = 256 was 5-10 % slower at K = 384 and 512: C is read back once
/// more per block).
const KC: usize = 512;
/// Rows of A packed at once (only the edge rows and strided A are packed).
const MC: usize = 336;
/// Columns of B packed at once.
const NC: usize = 512;

thread_local! {
    /// Set while this thread runs one product of a side-by-side pair (`on_own_core`).
    static OWN_CORE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static BUF_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static BUF_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with every product it starts kept on the calling thread (not split), where the
/// pool has two threads: the caller runs another product on the other thread at the same time
/// (`schedule::Step::Both`). With more threads the products still split, over all of them.
pub fn on_own_core<R>(f: impl FnOnce() -> R) -> R {
    if rayon::current_num_threads() > 2 {
        return f();
    }
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            OWN_CORE.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(OWN_CORE.with(|c| c.replace(true)));
    f()
}

/// Runs `f` on a 64-byte aligned scratch slice of `len` floats from the thread's buffer `key`
/// (a fresh one if this thread is already using it: a join can run another GEMM's task here).
fn with_buf<R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    fn aligned(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
        if v.len() < len + 16 {
            v.resize(len + 16, 0.0);
        }
        let s = v.as_ptr().align_offset(64).min(16);
        &mut v[s..s + len]
    }
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => f(aligned(&mut v, len)),
        Err(_) => f(aligned(&mut Vec::new(), len)),
    })
}

/// The output matrix as the parts of a split see it: a base pointer they write disjoint
/// elements through.
#[derive(Clone, Copy)]
struct Out(*mut f32);

// SAFETY: `Out` only carries the base of the `&mut [f32]` that `split` holds for the whole
// parallel loop to the parts of the split, which write disjoint elements (see `split`).
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// The base pointer (a method, so closures capture the whole `Sync` wrapper).
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

/// Runs the product on the calling thread, or (`parallel`, with a pool of several threads)
/// split into one independent product per thread: blocks of whole tiles of rows, or of whole
/// panels of columns when that balances better. Each part packs its own operands, so the
/// threads meet once, at the end. `c` is row-major with row stride `rs >= n`.
#[allow(clippy::too_many_arguments)]
fn split<K: Micro>(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [f32],
    rs: usize,
    beta: f32,
    a: &[f32],
    av: View,
    b: &[f32],
    bv: View,
    parallel: bool,
) {
    assert!(rs >= n && (m - 1) * rs + n <= c.len());
    let out = Out(c.as_mut_ptr());
    let (tiles, panels) = (m.div_ceil(K::MR), n.div_ceil(K::NR));
    let threads = if parallel && !OWN_CORE.with(|c| c.get()) {
        rayon::current_num_threads().min(tiles.max(panels))
    } else {
        1
    };
    // (first row, rows, first column, columns) of each part.
    let parts: Vec<(usize, usize, usize, usize)> = if threads <= 1 {
        vec![(0, m, 0, n)]
    } else {
        // Rows on a tie: no B panel is packed twice.
        let cost = |units: usize, other: usize| units.div_ceil(threads) * other;
        if cost(tiles, panels) <= cost(panels, tiles) {
            let per = tiles.div_ceil(threads) * K::MR;
            (0..m)
                .step_by(per)
                .map(|r| (r, per.min(m - r), 0, n))
                .collect()
        } else {
            let per = panels.div_ceil(threads) * K::NR;
            (0..n)
                .step_by(per)
                .map(|j| (0, m, j, per.min(n - j)))
                .collect()
        }
    };
    let run = |&(r0, rows, j0, cols): &(usize, usize, usize, usize)| {
        let av = View {
            off: av.off + r0 * av.rs,
            ..av
        };
        let bv = View {
            off: bv.off + j0 * bv.cs,
            ..bv
        };
        // SAFETY: the kernel was chosen only after its instruction set was detected
        // (`sgemm_on` checks `available`); the part's rows and columns lie inside `c` (asserted
        // above: `(m - 1) * rs + n <= c.len()`), and the parts own disjoint blocks of a
        // row-major C with `rs >= n`, so no two threads touch one element.
        unsafe {
            drive::<K>(
                rows,
                cols,
                k,
                out.ptr().add(r0 * rs + j0),
                rs,
                beta,
                a,
                av,
                b,
                bv,
            )
        }
    };
    if parts.len() == 1 {
        run(&parts[0]);
    } else {
        parts.par_iter().for_each(run);
    }
}

/// The blocked loops on one thread: for each KC slice of the depth and NC slice of the
/// columns, pack B, then for each MC block of rows pack A (or read row-major A in place) and
/// run the micro-kernel over the block.
///
/// # Safety
/// The CPU must run `K`'s instruction set; `c` must be valid for writes of every element
/// `i * rs + j` (`i < m`, `j < n`) and no other thread may touch them meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn drive<K: Micro>(
    m: usize,
    n: usize,
    k: usize,
    c: *mut f32,
    rs: usize,
    beta: f32,
    a: &[f32],
    av: View,
    b: &[f32],
    bv: View,
) {
    let (mr, nr) = (K::MR, K::NR);
    let mc_max = MC.div_ceil(mr) * mr;
    for p0 in (0..k).step_by(KC) {
        let kc = KC.min(k - p0);
        let beta = if p0 == 0 { beta } else { 1.0 };
        for j0 in (0..n).step_by(NC) {
            let nc = NC.min(n - j0);
            with_buf(&BUF_B, nc.div_ceil(nr) * nr * kc, |pb| {
                if bv.cs == 1 {
                    // Row-major B: each row read once, in order, into every panel. Panel by
                    // panel would read B with a row-sized stride, slow where B comes from
                    // memory (convolution patches: 124 -> 111 us a 64x288x256 product).
                    pack::b_rows(pb, b, bv, p0, kc, j0, nc, nr);
                } else {
                    for (q, dst) in pb.chunks_mut(nr * kc).enumerate() {
                        let j = j0 + q * nr;
                        pack::b_panel(dst, b, bv, p0, kc, j, nr.min(n - j), nr);
                    }
                }
                let pb = &*pb;
                for i0 in (0..m).step_by(mc_max) {
                    let mc = mc_max.min(m - i0);
                    // Row- or column-major A is read in place by whole tiles (packing
                    // row-major A would be a transpose, column-major A a copy); the rest is
                    // packed.
                    let in_place = av.cs == 1 || (av.rs == 1 && K::COLS_IN_PLACE);
                    let direct = if in_place && m > 1 && k > 1 {
                        mc / mr * mr
                    } else {
                        0
                    };
                    let packed = mc - direct;
                    // SAFETY (both blocks): the caller's contract covers `K`'s instruction set
                    // and rows [i0, i0 + mc) x columns [j0, j0 + nc) of `c`.
                    let c0 = unsafe { c.add(i0 * rs + j0) };
                    if direct > 0 {
                        let from = &a[av.off + i0 * av.rs + p0 * av.cs..];
                        let src = if av.cs == 1 {
                            ASrc::Rows(from, av.rs)
                        } else {
                            ASrc::Cols(from, av.cs)
                        };
                        unsafe { K::block(kc, direct, nc, src, pb, c0, rs, beta) };
                    }
                    if packed > 0 {
                        let i1 = i0 + direct;
                        with_buf(&BUF_A, packed.div_ceil(mr) * mr * kc, |pa| {
                            for (t, dst) in pa.chunks_mut(mr * kc).enumerate() {
                                let i = i1 + t * mr;
                                pack::a_panel(dst, a, av, i, mr.min(m - i), p0, kc, mr);
                            }
                            let (src, ci) = (ASrc::Packed(pa), unsafe { c0.add(direct * rs) });
                            unsafe { K::block(kc, packed, nc, src, pb, ci, rs, beta) };
                        });
                    }
                }
            });
        }
    }
}
