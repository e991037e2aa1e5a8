//! Times rlx's float32 GEMM paths (AVX-512 kernel, AVX2 kernel, `gemm` crate) on the products of
//! the benchmark workloads (the shapes of `benches/gemm_study.py`), as the matmul driver calls
//! them: row-major C, transposed operands read in place.
//!
//!     cargo run --release -p rlx-cpu --example sgemm_bench [-- 1|2]   # 1: one thread only,
//!                                                                      # 2: every shape split
//!
//! Each cell is the best single call (and the median call), the paths called in turn (on a shared machine each sees
//! the same load). With one thread on Linux the time is the thread's CPU time (time the thread
//! was descheduled does not count); with two it is wall time. `ONLY=fwd` keeps the shapes whose
//! label contains `fwd`.
use rlx_cpu::sgemm::{sgemm_on, Path, View};
use std::time::Instant;

/// Seconds of CPU time this thread has run (Linux), else wall time since some fixed instant.
fn thread_seconds() -> f64 {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
        }
        const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
        let mut ts = Timespec { sec: 0, nsec: 0 };
        // SAFETY: `clock_gettime` writes one `struct timespec` (two 64-bit fields on 64-bit
        // Linux) through the pointer, which points at one.
        if unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            return ts.sec as f64 + ts.nsec as f64 * 1e-9;
        }
    }
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

const SHAPES: [(&str, usize, usize, usize, bool, bool); 35] = [
    ("gpt qkv fwd", 1024, 128, 384, false, true),
    ("gpt proj fwd", 1024, 128, 128, false, true),
    ("gpt fc1 fwd", 1024, 128, 512, false, true),
    ("gpt fc2 fwd", 1024, 512, 128, false, true),
    ("gpt head fwd", 1024, 128, 256, false, true),
    ("gpt qkv dX", 1024, 384, 128, false, false),
    ("gpt fc1 dX", 1024, 512, 128, false, false),
    ("gpt fc2 dX", 1024, 128, 512, false, false),
    ("gpt qkv dW", 384, 1024, 128, true, false),
    ("gpt fc1 dW", 512, 1024, 128, true, false),
    ("gpt fc2 dW", 128, 1024, 512, true, false),
    ("gpt head dW", 256, 1024, 128, true, false),
    // GPT d256 (`bench_cpu.py`'s gpt_large: B8 x T128, weights stored [out, in]).
    ("gpt256 qkv fwd", 1024, 256, 768, false, true),
    ("gpt256 fc1 fwd", 1024, 256, 1024, false, true),
    ("gpt256 fc2 fwd", 1024, 1024, 256, false, true),
    ("gpt256 fc1 dX", 1024, 1024, 256, false, false),
    ("gpt256 fc2 dX", 1024, 256, 1024, false, false),
    ("gpt256 fc1 dW", 1024, 1024, 256, true, false),
    ("gpt256 fc2 dW", 256, 1024, 1024, true, false),
    ("gpt256 qkv dW", 768, 1024, 256, true, false),
    ("mlp64 l1 fwd", 64, 64, 256, false, true),
    ("mlp64 l2 fwd", 64, 256, 256, false, true),
    ("mlp64 l2 dW", 256, 64, 256, true, false),
    ("mlp512 l2 fwd", 512, 256, 256, false, true),
    ("mlp512 l2 dX", 512, 256, 256, false, false),
    ("mlp512 l2 dW", 256, 512, 256, true, false),
    // The CIFAR CNN's second convolution, one image (tap-major patches [288, 256]).
    ("cifar conv2 fwd", 64, 288, 256, false, false),
    ("cifar conv2 dW", 64, 256, 288, false, true),
    ("cifar conv2 dX", 288, 64, 256, true, false),
    // The tiny GPT's attention blocks (T = 64 in causal blocks of 32, head size 32): scores,
    // probabilities times V, a key block's gradient.
    ("attn scores", 32, 32, 64, false, true),
    ("attn pv", 32, 64, 32, false, false),
    ("attn dk", 32, 64, 32, true, false),
    // Square products (`benches/bench_cpu.py --only sgemm`).
    ("square 512", 512, 512, 512, false, false),
    ("square 1024", 1024, 1024, 1024, false, false),
    ("square 2048", 2048, 2048, 2048, false, false),
];

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_default();
    let (one, all) = (arg == "1", arg == "2");
    println!("| product | m x k x n | threads | avx512 us | avx2 us | crate us |");
    println!("|---|---|---|---|---|---|");
    let only = std::env::var("ONLY").unwrap_or_default();
    for (label, m, k, n, ta, tb) in SHAPES {
        if !label.contains(only.as_str()) {
            continue;
        }
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        // COLD=c: c copies of B taken in turn (B comes from memory, not cache, as a batch
        // of convolution patches does).
        let copies: usize = std::env::var("COLD")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let bs: Vec<f32> = (0..k * n * copies)
            .map(|i| ((i * 104729) % 1000) as f32 * 1e-3)
            .collect();
        let av = if ta {
            View::rows(0, m).t()
        } else {
            View::rows(0, k)
        };
        let bv = if tb {
            View::rows(0, k).t()
        } else {
            View::rows(0, n)
        };
        let mut c = vec![0.0f32; m * n];
        // The driver's rule (matmul::PAR_FLOPS): one thread below 64 * 256 * 256 multiply-adds.
        let par = all || (!one && m * n * k >= 64 * 256 * 256);
        // Interleaved calls (the machine is shared: each path sees the same load), the best
        // single call of each path.
        let paths: Vec<Path> = [Path::Avx512, Path::Avx2Fma, Path::Crate]
            .into_iter()
            .filter(|p| p.available())
            .collect();
        let mut times = vec![Vec::new(); paths.len()];
        let calls = (4e9 / (m * n * k) as f64).clamp(100.0, 3000.0) as usize;
        for call in 0..calls {
            let b = &bs[(call % copies) * k * n..][..k * n];
            for (p, t) in paths.iter().zip(&mut times) {
                let (w0, c0) = (Instant::now(), thread_seconds());
                sgemm_on(
                    *p,
                    m,
                    n,
                    k,
                    &mut c,
                    View::rows(0, n),
                    0.0,
                    &a,
                    av,
                    b,
                    bv,
                    par,
                );
                let s = if par {
                    w0.elapsed().as_secs_f64()
                } else {
                    thread_seconds() - c0
                };
                t.push(s);
            }
        }
        // The best call and the median one (on a shared machine the median moves with the load).
        let stats: Vec<(f64, f64)> = times
            .iter_mut()
            .map(|t| {
                t.sort_by(f64::total_cmp);
                (t[0], t[t.len() / 2])
            })
            .collect();
        let cells: Vec<String> = [Path::Avx512, Path::Avx2Fma, Path::Crate]
            .iter()
            .map(|p| match paths.iter().position(|q| q == p) {
                Some(i) => {
                    let (best, median) = stats[i];
                    let gf = 2.0 * (m * n * k) as f64 / best * 1e-9;
                    format!(
                        "{:.0} ({gf:.0} GF/s), median {:.0}",
                        best * 1e6,
                        median * 1e6
                    )
                }
                None => "-".to_string(),
            })
            .collect();
        let th = if par { 2 } else { 1 };
        println!("| {label} | {m}x{k}x{n} | {th} | {} |", cells.join(" | "));
    }
}
