//! Picks a cuBLASLt algorithm for each product by timing the heuristic's candidates once per
//! process, where `RLX_CUDA_TUNE=1` asks for it (else the heuristic's first choice runs). The products run on
//! scratch allocations of their own shape at compile time, never on a program's buffers, and
//! the choice is kept per device and product description, so later programs with the same
//! product (another variant, a second model) reuse it without timing again.
use crate::driver::Device;
use crate::epilogue::{Epi, LtSpec};
use crate::lt::Matmul;
use rlx_ir::Result;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Whether products are timed (`RLX_CUDA_TUNE=1`).
pub fn enabled() -> bool {
    std::env::var("RLX_CUDA_TUNE").is_ok_and(|v| v.trim() == "1")
}

/// A candidate replaces the heuristic's choice only when it is faster by more than this
/// fraction: near-equal timings keep the heuristic's algorithm, so two processes on one GPU
/// rarely pick differently (different algorithms may sum in a different order).
const MARGIN: f32 = 0.03;

/// Timed runs of each candidate (after one untimed run).
const REPS: usize = 5;

/// The chosen candidate per device ordinal and product description.
fn chosen() -> &'static Mutex<HashMap<(usize, String), usize>> {
    static CHOSEN: OnceLock<Mutex<HashMap<(usize, String), usize>>> = OnceLock::new();
    CHOSEN.get_or_init(Default::default)
}

/// Bytes each operand of `spec` spans: `A`, `B`, `C`/`D` (one buffer: cuBLASLt allows `D` on
/// `C` with the same layout) and the bias vector.
fn extents(spec: &LtSpec) -> [usize; 3] {
    let g = &spec.g;
    let span = |rows: usize, cols: usize, ld: usize, stride: usize| {
        if rows == 0 || cols == 0 {
            return 0;
        }
        (g.batch - 1) * stride + ld * (cols - 1) + rows
    };
    let (ar, ac) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
    let ab = g.dtype.size();
    [
        span(ar, ac, g.lda, g.stride_a) * ab,
        span(br, bc, g.ldb, g.stride_b) * ab,
        // The bias vector after `C`/`D`, 256-byte aligned as real runs' vectors are at least
        // 16-byte aligned.
        (span(g.m, g.n, g.ldc, g.stride_c) * 4).div_ceil(256) * 256 + bias_bytes(spec),
    ]
}

/// Bytes of the bias (or bias gradient) vector `spec`'s epilogue reads or writes, with room
/// for one a batch.
fn bias_bytes(spec: &LtSpec) -> usize {
    match spec.epi {
        Epi::None | Epi::Relu | Epi::GeluTanh => 0,
        _ => spec.g.m.max(spec.g.n) * spec.g.batch * 4,
    }
}

/// Times each of `m`'s candidates on zeroed scratch operands and keeps the fastest (see
/// [`MARGIN`]); a choice made before for the same product is reused.
pub fn tune(dev: &Device, spec: &LtSpec, tf32: bool, m: &mut Matmul) -> Result<()> {
    if m.candidates() < 2 {
        return Ok(());
    }
    let key = (dev.ordinal, format!("{spec:?} tf32={tf32}"));
    if let Some(&i) = chosen().lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        m.choose(i.min(m.candidates() - 1));
        return Ok(());
    }
    let bytes = extents(spec);
    let debug = std::env::var("RLX_CUDA_DEBUG").is_ok_and(|v| v == "1");
    // Timing is optional: without room for the operands the heuristic's choice stays.
    let bufs = match Scratch::new(dev, bytes) {
        Ok(b) => b,
        Err(e) => {
            if debug {
                eprintln!("rlx cuda: not timing {:?}: {e}", spec.g);
            }
            m.choose(0);
            return Ok(());
        }
    };
    let [a, b, cd] = bufs.at;
    // The bias vector sits past `C`/`D` in the same allocation.
    let bias = match bias_bytes(spec) {
        0 => 0,
        n => cd + (bytes[2] - n) as u64,
    };
    let mut times = Vec::with_capacity(m.candidates());
    {
        let _one_at_a_time = dev.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        dev.bind()?;
        for i in 0..m.candidates() {
            m.choose(i);
            // A candidate cuBLASLt refuses to queue (a status it returns) is not taken; a
            // fault of the device (reported by the events) ends the compile.
            let queued = (|| {
                dev.lt_matmul(m, [a, b, cd, cd], bias)?;
                let start = dev.timing()?;
                for _ in 0..REPS {
                    dev.lt_matmul(m, [a, b, cd, cd], bias)?;
                }
                Ok::<_, rlx_ir::Error>((start, dev.timing()?))
            })();
            match queued {
                Ok((start, end)) => {
                    end.wait()?;
                    times.push(end.ms_since(&start)?);
                }
                Err(e) => {
                    // Whatever was queued before the refusal completes before the next.
                    dev.sync()?;
                    if debug {
                        eprintln!("rlx cuda: candidate {i} for {:?} refused: {e}", spec.g);
                    }
                    times.push(f32::INFINITY);
                }
            }
        }
    }
    let best = pick(&times);
    m.choose(best);
    chosen()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, best);
    if debug {
        eprintln!(
            "rlx cuda: tuned {:?} {:?}: candidate {best} of {:?} ms",
            spec.g, spec.epi, times
        );
    }
    Ok(())
}

/// The candidate to use given each one's time: the fastest, unless it beats the first (the
/// heuristic's choice) by no more than [`MARGIN`].
fn pick(times: &[f32]) -> usize {
    let (best, t) =
        times.iter().enumerate().fold(
            (0, f32::INFINITY),
            |(bi, bt), (i, &t)| {
                if t < bt {
                    (i, t)
                } else {
                    (bi, bt)
                }
            },
        );
    if times[0] <= t * (1.0 + MARGIN) || !t.is_finite() {
        0
    } else {
        best
    }
}

/// Zeroed device allocations for the timed products, freed when dropped.
struct Scratch<'a> {
    dev: &'a Device,
    at: [u64; 3],
}

impl<'a> Scratch<'a> {
    fn new(dev: &'a Device, bytes: [usize; 3]) -> Result<Scratch<'a>> {
        let mut s = Scratch { dev, at: [0; 3] };
        for (slot, n) in s.at.iter_mut().zip(bytes) {
            *slot = dev.alloc(n.max(4))?;
        }
        Ok(s)
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        for p in self.at {
            self.dev.free(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Gemm;
    use rlx_ir::DType;

    fn spec(epi: Epi, batch: usize) -> LtSpec {
        LtSpec {
            g: Gemm {
                dtype: DType::BF16,
                ta: true,
                tb: false,
                m: 8,
                n: 5,
                k: 3,
                lda: 4,
                ldb: 3,
                ldc: 8,
                stride_a: 40,
                stride_b: 15,
                stride_c: 40,
                batch,
            },
            epi,
            residual: false,
            align: [16; 4],
        }
    }

    #[test]
    fn scratch_covers_every_matrix_of_every_batch_and_the_bias() {
        // A is stored k x m = 3 x 8 with ld 4: the last column starts at 4 * 7.
        assert_eq!(
            extents(&spec(Epi::None, 1)),
            [(4 * 7 + 3) * 2, (3 * 4 + 3) * 2, 256]
        );
        let [a, b, cd] = extents(&spec(Epi::Bias, 3));
        assert_eq!(a, (2 * 40 + 4 * 7 + 3) * 2);
        assert_eq!(b, (2 * 15 + 3 * 4 + 3) * 2);
        // C/D spans (2 * 40 + 8 * 4 + 8) floats = 480 bytes; the bias starts 256-aligned.
        assert_eq!(cd, 512 + 8 * 3 * 4);
        assert_eq!((cd - bias_bytes(&spec(Epi::Bias, 3))) % 256, 0);
    }

    #[test]
    fn the_heuristics_choice_stays_unless_another_is_clearly_faster() {
        assert_eq!(pick(&[1.0, 0.99, 1.2]), 0);
        assert_eq!(pick(&[1.0, 0.9, 0.95]), 1);
        assert_eq!(pick(&[1.0]), 0);
        assert_eq!(pick(&[2.0, 1.5, 1.0]), 2);
        // A refused candidate (never timed) is never taken.
        assert_eq!(pick(&[1.0, f32::INFINITY]), 0);
        assert_eq!(pick(&[f32::INFINITY, f32::INFINITY]), 0);
    }
}
