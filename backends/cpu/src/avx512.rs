//! AVX-512 forms of the e4m3 kernels in `x86` (the decode and the M = 1 row kernel): the same
//! arithmetic on 16-lane vectors; and the attention's decode fold for up to three query heads
//! per pass ([`fold_chunk16`]). The f32 GEMVs of M = 2..16 (`x86::dot_blocks`, `dot_mx3`) have
//! none: a 16-lane form of the buffered one measured slower (see `linear::gemv_small_rows`).
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
    // a loop, not `tot.map(..)`: a closure does not inherit the function's target features, so
    // the reduction in it would not be inlined
    let mut out = [0f32; 4];
    for (o, t) in out.iter_mut().zip(tot) {
        *o = _mm512_reduce_add_ps(t) * DECODE_SHIFT;
    }
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

/// The online-softmax fold of `x86::fold_chunk8` for `G` (1..=3) query heads at once, `d` and
/// `dv` multiples of 16: each key row is loaded and converted once for the `G` heads' scores
/// and each value row once for their outputs (`fold_chunk8` loads and converts both once per
/// head, and that conversion work, not memory, bounded it with keys in cache). Scores of
/// eight keys for every head are in 8·G accumulators (24 of the 32 registers at G = 3),
/// reduced together; the outputs of all heads, 64 lanes each, stay in registers over the
/// chunk's keys. Same arguments, prefetching and non-finite rules as `fold_chunk8`
/// (`q [G, d]` prescaled, `scores` at least `G · c.next_multiple_of(8)`); the sums run in
/// another order, so the two agree to rounding. An f32 row and a 16-bit row of the same values
/// give the same bits, as the load is the only difference.
///
/// # Safety
/// The CPU must have AVX-512 F with AVX2, FMA and F16C (the sizes are checked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
// `j` indexes the rows and the scores alike
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
pub(crate) unsafe fn fold_chunk16<E: crate::x86::Lanes, const G: usize>(
    q: &[f32],
    k: &[E],
    v: &[E],
    rows: &[u32],
    d: usize,
    dv: usize,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    scores: &mut [f32],
    ahead: &[u32],
) {
    use crate::x86::{live8, prefetch_bytes, scores8, softmax8};
    let c = rows.len();
    if c == 0 {
        return;
    }
    let cp = c.next_multiple_of(8);
    let es = std::mem::size_of::<E>();
    assert!((1..=3).contains(&G) && q.len() == G * d);
    assert!(d.is_multiple_of(16) && dv.is_multiple_of(16) && scores.len() >= G * cp);
    assert!(rows
        .iter()
        .all(|&r| (r as usize + 1) * d <= k.len() && (r as usize + 1) * dv <= v.len()));
    assert!(m.len() >= G && l.len() >= G && acc.len() >= G * dv);
    let (kp, vp, sp, qp) = (k.as_ptr(), v.as_ptr(), scores.as_mut_ptr(), q.as_ptr());
    let mut run_max = [_mm256_set1_ps(f32::NEG_INFINITY); G];
    for j0 in (0..c).step_by(8) {
        for &r in ahead.iter().skip(j0).take(8) {
            let r = r as usize;
            prefetch_bytes(kp.cast::<u8>().wrapping_add(r * d * es), d * es);
            prefetch_bytes(vp.cast::<u8>().wrapping_add(r * dv * es), dv * es);
        }
        // keys past the chunk repeat its last key; their scores are not kept
        let krow: [usize; 8] = std::array::from_fn(|r| rows[(j0 + r).min(c - 1)] as usize * d);
        let mut a = [[_mm512_setzero_ps(); 8]; G];
        for t in (0..d).step_by(16) {
            // SAFETY: t + 16 <= d: inside q's G rows and every key row (checked above).
            let qv: [__m512; G] = std::array::from_fn(|gi| _mm512_loadu_ps(qp.add(gi * d + t)));
            for r in 0..8 {
                let kv = E::load16(kp.add(krow[r] + t));
                for gi in 0..G {
                    a[gi][r] = _mm512_fmadd_ps(qv[gi], kv, a[gi][r]);
                }
            }
        }
        let live = live8(c, j0);
        for gi in 0..G {
            // each key's 16 lanes to 8 (the scores then as in `fold_chunk8`)
            let h: [__m256; 8] = std::array::from_fn(|r| {
                let x = a[gi][r];
                _mm256_add_ps(
                    _mm512_castps512_ps256(x),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))),
                )
            });
            let s = scores8(h, live, &mut run_max[gi]);
            // SAFETY: gi · cp + j0 + 8 <= G · cp <= scores.len().
            _mm256_storeu_ps(sp.add(gi * cp + j0), s);
        }
    }
    // SAFETY: head gi's scores start at gi · cp, cp = c rounded up to 8, inside `scores`.
    // a loop, not `array::from_fn`: its closure was compiled out of line, a call per head
    let mut alpha = [0f32; G];
    for gi in 0..G {
        alpha[gi] = softmax8(sp.add(gi * cp), c, run_max[gi], &mut m[gi], &mut l[gi]);
    }
    let ap = acc.as_mut_ptr();
    // 64 output lanes of every head at a time (4·G registers), then 16 at a time
    let mut c0 = 0;
    while c0 + 64 <= dv {
        let mut o: [[__m512; 4]; G] = std::array::from_fn(|gi| {
            let al = _mm512_set1_ps(alpha[gi]);
            std::array::from_fn(|i| {
                _mm512_mul_ps(_mm512_loadu_ps(ap.add(gi * dv + c0 + 16 * i)), al)
            })
        });
        for j in 0..c {
            // SAFETY: j < c rows of dv values each in v; c0 + 64 <= dv; the scores of head gi
            // start at gi · cp.
            let vj = vp.add(rows[j] as usize * dv + c0);
            let vr: [__m512; 4] = std::array::from_fn(|i| E::load16(vj.add(16 * i)));
            for gi in 0..G {
                let p = _mm512_set1_ps(*sp.add(gi * cp + j));
                for i in 0..4 {
                    o[gi][i] = _mm512_fmadd_ps(p, vr[i], o[gi][i]);
                }
            }
        }
        for gi in 0..G {
            for i in 0..4 {
                _mm512_storeu_ps(ap.add(gi * dv + c0 + 16 * i), o[gi][i]);
            }
        }
        c0 += 64;
    }
    while c0 < dv {
        let mut o: [__m512; G] = std::array::from_fn(|gi| {
            _mm512_mul_ps(
                _mm512_loadu_ps(ap.add(gi * dv + c0)),
                _mm512_set1_ps(alpha[gi]),
            )
        });
        for j in 0..c {
            // SAFETY: as above, c0 + 16 <= dv (dv is a multiple of 16).
            let vr = E::load16(vp.add(rows[j] as usize * dv + c0));
            for gi in 0..G {
                o[gi] = _mm512_fmadd_ps(_mm512_set1_ps(*sp.add(gi * cp + j)), vr, o[gi]);
            }
        }
        for gi in 0..G {
            _mm512_storeu_ps(ap.add(gi * dv + c0), o[gi]);
        }
        c0 += 16;
    }
}

/// Sixteen vectors of 16 lanes transposed: lane `c` of result `r` is lane `r` of input `c`.
/// Four rounds of two-source permutes: round b pairs vectors 2^b apart, each result lane taking
/// its own lane (bit b of the lane clear) or lane `i ^ 2^b` of the partner; after the four,
/// vector and lane indices have traded every bit.
#[inline(always)]
pub(crate) unsafe fn transpose16_regs(mut x: [__m512; 16]) -> [__m512; 16] {
    for b in 0..4 {
        let step = 1 << b;
        let (lo, hi) = match b {
            0 => (
                _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31),
            ),
            1 => (
                _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31),
            ),
            2 => (
                _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31),
            ),
            _ => (
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31),
            ),
        };
        let mut y = x;
        for i in (0..16).filter(|i| i & step == 0) {
            y[i] = _mm512_permutex2var_ps(x[i], lo, x[i + step]);
            y[i + step] = _mm512_permutex2var_ps(x[i], hi, x[i + step]);
        }
        x = y;
    }
    x
}

/// `dst[r · ld_dst + c] = src[c · ld_src + r]` for `r < rows` (at most 16) and `c < 16`: a
/// 16 x 16 block of `src` transposed in registers ([`transpose16_regs`]), its first `rows`
/// rows stored. The bf16 panel GEMM's panels are column-major; this puts them in
/// the row-major output with whole-vector loads and stores, where a scalar copy made 16
/// strided stores per column (~7% of a 512-token prefill's samples on Zen 4). `dst` is a raw
/// pointer because the panels write their column blocks of the output's rows at once.
///
/// # Safety
/// The CPU must have AVX-512 F. `src` must hold 16 readable rows of 16 at stride `ld_src`
/// (checked, panicking); `dst` must be valid for writes of `rows` rows of 16 at stride
/// `ld_dst`, which no other thread reads or writes during the call.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose16(
    src: &[f32],
    ld_src: usize,
    dst: *mut f32,
    ld_dst: usize,
    rows: usize,
) {
    assert!(rows <= 16 && src.len() >= 15 * ld_src + 16);
    let sp = src.as_ptr();
    // SAFETY (of the loads): row c < 16 at c · ld_src, 16 wide, is inside `src` (checked).
    let x = transpose16_regs(std::array::from_fn(|c| _mm512_loadu_ps(sp.add(c * ld_src))));
    for (r, v) in x.iter().take(rows).enumerate() {
        // SAFETY: row r < rows of `dst`, 16 wide (the caller's contract).
        _mm512_storeu_ps(dst.add(r * ld_dst), *v);
    }
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

    /// Every element lands at its transposed place, for every row count and strides wider
    /// than the block; rows past `rows` and columns past 16 are not written.
    #[test]
    fn transpose16_moves_each_element_once() {
        if !avx512() {
            return;
        }
        let (ld_src, ld_dst) = (21, 19);
        let src: Vec<f32> = (0..16 * ld_src).map(|i| i as f32).collect();
        for rows in 0..=16 {
            let mut dst = vec![-1f32; 16 * ld_dst];
            // SAFETY: the tier was checked; the sizes are the kernel's to check.
            unsafe { transpose16(&src, ld_src, dst.as_mut_ptr(), ld_dst, rows) };
            for r in 0..16 {
                for c in 0..ld_dst {
                    let want = if r < rows && c < 16 {
                        src[c * ld_src + r]
                    } else {
                        -1.0
                    };
                    assert_eq!(dst[r * ld_dst + c], want, "rows {rows}: ({r}, {c})");
                }
            }
        }
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
