//! float16 <-> float32 conversion with the CPU's F16C instructions (x86-64), used by the cast
//! kernel when the AVX2 or AVX-512 kernels are chosen (`crate::isa`) and the CPU has F16C. The `unsafe` of
//! calling that target-feature code and of its unaligned vector loads and stores lives here.
//! The portable conversions in `kernels/cast.rs` give the same bits (tested over every float16).

/// Whether casts use F16C in this process: the AVX2 kernel set is chosen and the CPU has F16C.
pub fn in_use() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::isa::current().has_avx2() && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// float32 -> float16 bits (round to nearest even) with F16C; `false` (nothing written) when
/// F16C is not in use.
pub fn f32_to_f16(src: &[f32], out: &mut [u16]) -> bool {
    assert_eq!(src.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if in_use() {
        hw::chunked(src, out, |s, o| {
            // SAFETY: `in_use()` returned true, so this CPU has F16C and AVX (AVX2 implies AVX).
            unsafe { hw::f32_to_f16(s, o) }
        });
        return true;
    }
    false
}

/// float16 bits -> float32 with F16C; `false` (nothing written) when F16C is not in use.
pub fn f16_to_f32(src: &[u16], out: &mut [f32]) -> bool {
    assert_eq!(src.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if in_use() {
        hw::chunked(src, out, |s, o| {
            // SAFETY: as in `f32_to_f16`.
            unsafe { hw::f16_to_f32(s, o) }
        });
        return true;
    }
    false
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use crate::kernels::cast;
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    /// Runs `f` over matching chunks of `src` and `out`, in parallel when large.
    pub fn chunked<S: Sync, D: Send>(src: &[S], out: &mut [D], f: impl Fn(&[S], &mut [D]) + Sync) {
        let n = out.len();
        if n >= crate::kernels::PAR_MIN {
            let per = n
                .div_ceil(rayon::current_num_threads() * 4)
                .next_multiple_of(8);
            out.par_chunks_mut(per)
                .zip(src.par_chunks(per))
                .for_each(|(o, s)| f(s, o));
        } else {
            f(src, out)
        }
    }

    /// # Safety
    /// The CPU must support F16C and AVX; `s` and `o` have the same length.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn f32_to_f16(s: &[f32], o: &mut [u16]) {
        let n = s.len().min(o.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` elements are in bounds of both slices; the loads and stores
            // are the unaligned forms.
            unsafe {
                let v = _mm256_loadu_ps(s.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(o.as_mut_ptr().add(i) as *mut __m128i, h);
            }
            i += 8;
        }
        for k in i..n {
            o[k] = cast::f32_to_f16(s[k]);
        }
    }

    /// # Safety
    /// As `f32_to_f16`.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn f16_to_f32(s: &[u16], o: &mut [f32]) {
        let n = s.len().min(o.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: as in `f32_to_f16`.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for k in i..n {
            o[k] = cast::f16_to_f32(s[k]);
        }
    }

    /// Test access to the hardware loops regardless of the chosen kernel set.
    #[cfg(test)]
    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::hw;
    use crate::kernels::cast;

    /// Every float16 bit pattern converts to the same float32 bits both ways, and float32s
    /// around every rounding boundary (and NaN/inf/subnormals) give the same float16 bits.
    #[test]
    fn hardware_and_portable_conversions_agree_bit_for_bit() {
        if !hw::available() {
            eprintln!("no F16C on this CPU: only the portable path runs");
            return;
        }
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut hw_out = vec![0f32; all.len()];
        // SAFETY: F16C and AVX are present (checked above).
        unsafe { hw::f16_to_f32(&all, &mut hw_out) };
        for (&h, &f) in all.iter().zip(&hw_out) {
            assert_eq!(cast::f16_to_f32(h).to_bits(), f.to_bits(), "f16 {h:#06x}");
        }
        // float32s: every f16 value, its neighbours one float32 ulp away, the midpoints
        // between consecutive f16 values and their neighbours, plus a pseudo-random sweep.
        let mut xs: Vec<f32> = Vec::new();
        for &f in &hw_out {
            let b = f.to_bits();
            xs.extend([
                f,
                f32::from_bits(b.wrapping_add(1)),
                f32::from_bits(b.wrapping_sub(1)),
            ]);
        }
        for w in hw_out.windows(2) {
            let mid = ((w[0] as f64 + w[1] as f64) / 2.0) as f32;
            let b = mid.to_bits();
            xs.extend([
                mid,
                f32::from_bits(b + 1),
                f32::from_bits(b.wrapping_sub(1)),
            ]);
        }
        let mut z: u32 = 0x1234_5678;
        for _ in 0..1 << 20 {
            z ^= z << 13;
            z ^= z >> 17;
            z ^= z << 5;
            xs.push(f32::from_bits(z));
        }
        let mut got = vec![0u16; xs.len()];
        // SAFETY: as above.
        unsafe { hw::f32_to_f16(&xs, &mut got) };
        for (&x, &h) in xs.iter().zip(&got) {
            assert_eq!(cast::f32_to_f16(x), h, "f32 {:#010x} ({x:e})", x.to_bits());
        }
    }
}
