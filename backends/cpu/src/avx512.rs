//! AVX-512 forms of the e4m3 kernels in `x86` (the decode and the M = 1 row kernel): the same
//! arithmetic on 16-lane vectors. The f32 `dot_4x3` of M = 2..16 has none: a 16-lane form
//! measured slower (see `linear::gemv_small_rows`).
//!
//! The e4m3 decode is the F16C trick described in `x86` (a code moved into a half's bit pattern
//! is its value times 2^-8), with two changes:
//! - 32 codes at a time: one `vpmovsxbw` widens them to 16-bit lanes of a zmm and two
//!   `vcvtph2ps` convert its halves, where AVX2 needs two of each and twice the integer work;
//! - the bit shuffle is one operation shorter: a *sign*-extended code shifted left by 7 already
//!   has the sign in bit 15 and `eeeemmm` in bits 13..7; only the sign's copy in bit 14 has to
//!   be cleared (AVX2 zero-extends, shifts by 8, then shifts back arithmetically by 1).
//!
//! Tails (a K-block that is not a multiple of 16, an odd row length) use masked loads and
//! stores, which never touch the masked-off bytes, so every length runs in vector code.
//!
//! Every function is `unsafe` because it is compiled for AVX-512 F / BW / VL with AVX2, FMA and
//! F16C: the caller must have checked that the CPU has them (`Tier::current() >= Tier::Avx512`).

use std::arch::x86_64::*;

use crate::x86::DECODE_SHIFT;

/// The mask of the first `left.min(16)` lanes.
#[inline(always)]
fn lanes(left: usize) -> __mmask16 {
    if left >= 16 {
        0xffff
    } else {
        ((1u32 << left) - 1) as __mmask16
    }
}

/// 16 codes (sign-extended to 16 bits) as the half-precision bit patterns `s 0eeee mmm 0000000`.
#[inline(always)]
unsafe fn halves16(b: __m128i) -> __m256i {
    _mm256_and_si256(
        _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b)),
        _mm256_set1_epi16(0xbf80_u16 as i16),
    )
}

/// 16 e4m3fn codes as 16 f32, each value times 2^-8 (NaN codes excepted).
#[inline(always)]
unsafe fn decode16(b: __m128i) -> __m512 {
    _mm512_cvtph_ps(halves16(b))
}

/// 32 e4m3fn codes as two vectors of 16 f32, each value times 2^-8 (NaN codes excepted).
#[inline(always)]
unsafe fn decode32(b: __m256i) -> (__m512, __m512) {
    let h = _mm512_and_si512(
        _mm512_slli_epi16::<7>(_mm512_cvtepi8_epi16(b)),
        _mm512_set1_epi16(0xbf80_u16 as i16),
    );
    (
        _mm512_cvtph_ps(_mm512_castsi512_si256(h)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)),
    )
}

/// The NaN codes (`0x7f` / `0xff`) among 16, as a lane mask.
#[inline(always)]
unsafe fn nan_lanes(b: __m128i) -> __mmask16 {
    let m = _mm_set1_epi8(0x7f);
    _mm_cmpeq_epi8_mask(_mm_and_si128(b, m), m)
}

/// `dst[i] = decode(src[i]) * scale` over the common length, NaN codes as NaN; bit-identical to
/// the scalar decoder and the AVX2 kernel (a NaN's sign and payload aside).
///
/// # Safety
/// The CPU must have AVX-512 F / BW / VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn decode_scaled(src: &[u8], scale: f32, dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    // (v · 2^-8) · 2^8 is v exactly; times scale it is rounded once, as in the scalar decoder
    let shift = _mm512_set1_ps(DECODE_SHIFT);
    let s = _mm512_set1_ps(scale);
    let nan = _mm512_set1_ps(f32::NAN);
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n <= both lengths; unaligned loads and stores.
        let b = _mm_loadu_si128(sp.add(i).cast());
        let v = _mm512_mul_ps(_mm512_mul_ps(decode16(b), shift), s);
        _mm512_storeu_ps(dp.add(i), _mm512_mask_blend_ps(nan_lanes(b), v, nan));
        i += 16;
    }
    if i < n {
        let m = lanes(n - i);
        // SAFETY: the mask covers only lanes below n - i, so every byte and float touched is
        // inside both slices; masked-off lanes are neither read nor written.
        let b = _mm_maskz_loadu_epi8(m, sp.add(i).cast());
        let v = _mm512_mul_ps(_mm512_mul_ps(decode16(b), shift), s);
        _mm512_mask_storeu_ps(dp.add(i), m, _mm512_mask_blend_ps(nan_lanes(b), v, nan));
    }
}

/// `Σ_kb scale_r[kb] · Σ_{k in kb} x[k] · decode(w_r[k])` for four weight rows over the same
/// `x`, K-blocks of `bk` codes: the AVX-512 form of `x86::dot4_blocks`, with the same contract
/// (NaN rows give NaN when `CHECK_NAN`; without it the caller guarantees NaN-free rows), and
/// the same prefetch stream from `ahead` (128 bytes per 32 codes).
///
/// # Safety
/// The CPU must have AVX-512 F / BW / VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn dot4_blocks<const CHECK_NAN: bool>(
    x: &[f32],
    w: [&[u8]; 4],
    bk: usize,
    scales: [&[f32]; 4],
    ahead: *const u8,
) -> [f32; 4] {
    let n = w.iter().fold(x.len(), |n, r| n.min(r.len()));
    let xp = x.as_ptr();
    let wp = w.map(|r| r.as_ptr());
    let mut tot = [_mm512_setzero_ps(); 4];
    // byte maximum of `code + code`: reaches 0xfe iff a NaN code was seen (see `x86::nan_fold`)
    let mut seen = _mm256_setzero_si256();
    let mut k0 = 0;
    let mut kb = 0;
    while k0 < n {
        let k1 = (k0 + bk).min(n);
        let mut acc = [_mm512_setzero_ps(); 8];
        let mut i = k0;
        while i + 32 <= k1 {
            // SAFETY: i + 32 <= k1 <= n <= every length; unaligned loads.
            let (x0, x1) = (_mm512_loadu_ps(xp.add(i)), _mm512_loadu_ps(xp.add(i + 16)));
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(4 * i).cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(4 * i + 64).cast());
            for r in 0..4 {
                let b = _mm256_loadu_si256(wp[r].add(i).cast());
                if CHECK_NAN {
                    seen = _mm256_max_epu8(seen, _mm256_add_epi8(b, b));
                }
                let (lo, hi) = decode32(b);
                acc[2 * r] = _mm512_fmadd_ps(x0, lo, acc[2 * r]);
                acc[2 * r + 1] = _mm512_fmadd_ps(x1, hi, acc[2 * r + 1]);
            }
            i += 32;
        }
        // the block's last < 32 codes in masked steps of 16: masked-off lanes load as zero
        // codes and zero activations, which add nothing and are no NaN
        while i < k1 {
            let m = lanes(k1 - i);
            // SAFETY: the mask covers only lanes below k1 - i <= n - i.
            let xv = _mm512_maskz_loadu_ps(m, xp.add(i));
            for r in 0..4 {
                let b = _mm_maskz_loadu_epi8(m, wp[r].add(i).cast());
                if CHECK_NAN {
                    seen = _mm256_max_epu8(seen, _mm256_zextsi128_si256(_mm_add_epi8(b, b)));
                }
                acc[2 * r] = _mm512_fmadd_ps(xv, decode16(b), acc[2 * r]);
            }
            i += 16;
        }
        for r in 0..4 {
            // the 2^8 of the decode is applied once at the end, so no scale can overflow here
            let s = _mm512_set1_ps(scales[r][kb]);
            tot[r] = _mm512_fmadd_ps(_mm512_add_ps(acc[2 * r], acc[2 * r + 1]), s, tot[r]);
        }
        k0 = k1;
        kb += 1;
    }
    let mut out = tot.map(|t| _mm512_reduce_add_ps(t) * DECODE_SHIFT);
    if CHECK_NAN {
        let nan = _mm256_cmpeq_epi8_mask(seen, _mm256_set1_epi8(0xfe_u8 as i8));
        if nan != 0 {
            // rare: say which rows hold a NaN code
            for (r, o) in out.iter_mut().enumerate() {
                if w[r][..n].iter().any(|&c| c & 0x7f == 0x7f) {
                    *o = f32::NAN;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::Tier;
    use crate::x86::checks;

    /// Whether the AVX-512 tier exists here; without it these kernel tests skip, saying so (the
    /// AVX2 CI machines cannot run them; `tests/cpu_tiers.rs` runs every tier a machine has).
    fn avx512() -> bool {
        let ok = Tier::detected() >= Tier::Avx512;
        if !ok {
            eprintln!(
                "skipped: no AVX-512 F/BW/VL on this CPU, the AVX-512 kernels are untested here"
            );
        }
        ok
    }

    #[test]
    fn decode_matches_the_scalar_decoder_bit_for_bit() {
        if avx512() {
            // SAFETY: AVX-512 checked above.
            unsafe { checks::decode_bit_for_bit(decode_scaled) };
        }
    }

    #[test]
    fn dot4_blocks_matches_f64_and_propagates_nan() {
        if avx512() {
            // SAFETY: as above.
            unsafe { checks::dot4_blocks_against_f64(dot4_blocks::<true>, dot4_blocks::<false>) };
        }
    }
}
