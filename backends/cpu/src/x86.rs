//! Explicit AVX2 kernels for the e4m3 decode, which LLVM does not turn into fast code from the
//! branch-free scalar decoder (on AVX2 it becomes a chain of blends per byte).
//!
//! The decode goes through F16C. An e4m3fn byte `s eeee mmm` moved to the half-precision bit
//! pattern `s 0eeee mmm0000000` is a half with the same sign, an exponent field of the same
//! value and the same three leading mantissa bits. Its bias is 15 instead of 7, so its value is
//! exactly the e4m3 value times 2^-8, subnormals included (a half subnormal `0.mmm · 2^-14` is
//! `mmm · 2^-17`; the e4m3 one is `mmm · 2^-9`). `vcvtph2ps` converts eight such halves per
//! instruction, exactly; the 2^8 goes into a scale the caller multiplies by anyway.
//!
//! The one code this gets wrong is NaN (`0x7f` / `0xff` become ±1.875, i.e. ±480 · 2^-8), so
//! every kernel here also looks for NaN codes, two byte operations per 16 codes, and answers
//! NaN as the scalar decoder does (the NaN's sign and payload may differ).
//!
//! Every function is `unsafe` because it is compiled for AVX2 + FMA + F16C: the caller must
//! have checked that the CPU has them (`Tier::current() >= Tier::Avx2`).

use std::arch::x86_64::*;

use crate::fp8::e4m3_to_f32;

/// What [`decode16`] is off by: its values are the codes' values times 2^-8.
pub(crate) const DECODE_SHIFT: f32 = 256.0;

/// 16 e4m3fn codes as two vectors of 8 f32, each value times 2^-8 (NaN codes excepted).
#[inline(always)]
unsafe fn decode16(b: __m128i) -> (__m256, __m256) {
    // code in the high byte of a 16-bit lane; an arithmetic shift by one copies the sign into
    // bit 14, which the mask clears: s 0eeee mmm 0000000
    let w = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(b));
    let h = _mm256_and_si256(
        _mm256_srai_epi16::<1>(w),
        _mm256_set1_epi16(0xbf80_u16 as i16),
    );
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(h)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)),
    )
}

/// Folds 16 codes into a NaN detector: `(b + b) mod 256` is `0xfe` exactly for `0x7f` / `0xff`
/// and at most `0xfc` otherwise, so the running byte maximum reaches `0xfe` iff a NaN was seen.
#[inline(always)]
unsafe fn nan_fold(seen: __m128i, b: __m128i) -> __m128i {
    _mm_max_epu8(seen, _mm_add_epi8(b, b))
}

#[inline(always)]
unsafe fn nan_seen(seen: __m128i) -> bool {
    _mm_movemask_epi8(_mm_cmpeq_epi8(seen, _mm_set1_epi8(0xfe_u8 as i8))) != 0
}

#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `dst[i] = decode(src[i]) * scale` over the common length, NaN codes as NaN.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn decode_scaled(src: &[u8], scale: f32, dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    // (v · 2^-8) · 2^8 is v exactly; times scale it is rounded once, as in the scalar decoder,
    // so the values are bit-identical (NaN sign and payload aside) for every scale
    let shift = _mm256_set1_ps(DECODE_SHIFT);
    let s = _mm256_set1_ps(scale);
    let nan = _mm256_set1_ps(f32::NAN);
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n <= both lengths; unaligned loads and stores.
        let b = _mm_loadu_si128(sp.add(i).cast());
        let (lo, hi) = decode16(b);
        let is_nan = _mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
        let m_lo = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(is_nan));
        let m_hi = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(is_nan)));
        let (lo, hi) = (_mm256_mul_ps(lo, shift), _mm256_mul_ps(hi, shift));
        _mm256_storeu_ps(dp.add(i), _mm256_blendv_ps(_mm256_mul_ps(lo, s), nan, m_lo));
        _mm256_storeu_ps(
            dp.add(i + 8),
            _mm256_blendv_ps(_mm256_mul_ps(hi, s), nan, m_hi),
        );
        i += 16;
    }
    for j in i..n {
        dst[j] = e4m3_to_f32(src[j]) * scale;
    }
}

/// [`decode_scaled`] for codes known to hold no NaN (`0x7f` / `0xff`; a weight checked once,
/// as `LinearPlan::assume_nan_free` says), without the NaN scan and with one multiply: the
/// decoded `v · 2^-8` times `scale · 2^8` is `v · scale` rounded once, the same bits as the two
/// multiplies (both factors are exact), unless `scale · 2^8` overflows, where it takes the two.
/// A NaN code gives a finite wrong value here.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn decode_scaled_nan_free(src: &[u8], scale: f32, dst: &mut [f32]) {
    let s256 = scale * DECODE_SHIFT;
    if !s256.is_finite() {
        return decode_scaled(src, scale, dst);
    }
    let n = src.len().min(dst.len());
    let s = _mm256_set1_ps(s256);
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n <= both lengths; unaligned loads and stores.
        let (lo, hi) = decode16(_mm_loadu_si128(sp.add(i).cast()));
        _mm256_storeu_ps(dp.add(i), _mm256_mul_ps(lo, s));
        _mm256_storeu_ps(dp.add(i + 8), _mm256_mul_ps(hi, s));
        i += 16;
    }
    for j in i..n {
        dst[j] = e4m3_to_f32(src[j]) * scale;
    }
}

/// `Σ_kb scale_r[kb] · Σ_{k in kb} x[k] · decode(w_r[k])` for four weight rows over the same
/// `x`: [`dot_blocks`] at one activation row, with the scales given per row and K-block.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn dot4_blocks<const CHECK_NAN: bool>(
    x: &[f32],
    w: [&[u8]; 4],
    bk: usize,
    scales: [&[f32]; 4],
    ahead: *const u8,
) -> [f32; 4] {
    let [out] = dot_blocks::<4, 1, CHECK_NAN>([x], w, bk, |_, r, kb| scales[r][kb], ahead);
    out
}

/// `out[a][r] = Σ_kb scale(a, r, kb) · Σ_{k in kb} x_a[k] · decode(w_r[k])` for `M` activation
/// rows and `R` weight rows (each activation load shared by the `R` rows, each decoded code by
/// the `M`), K-blocks of `bk` codes: the per-block scale is applied to the vector partial sums,
/// so each pair is reduced to a scalar once. Every pair has its own two accumulators and the
/// same operations in the same order whatever `R` and `M` are, so a row of a batch gets the
/// bits it gets alone. A weight row with a NaN code gives NaN in all its pairs, as the scalar
/// decoder would, when `CHECK_NAN`; without it the caller guarantees the rows hold no NaN code
/// (the scan was ~15% of this loop). `ahead` is prefetched as a stream of `R` bytes per code
/// (`ahead + R·i`, a line per 64 bytes); any address will do, as a prefetch never faults.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
// `a`, `r` index the rows, accumulators and results alike
#[allow(clippy::needless_range_loop)]
pub(crate) unsafe fn dot_blocks<const R: usize, const M: usize, const CHECK_NAN: bool>(
    x: [&[f32]; M],
    w: [&[u8]; R],
    bk: usize,
    scale: impl Fn(usize, usize, usize) -> f32,
    ahead: *const u8,
) -> [[f32; R]; M] {
    let n = w
        .iter()
        .map(|r| r.len())
        .chain(x.iter().map(|r| r.len()))
        .min()
        .unwrap_or(0);
    let mut tot = [[_mm256_setzero_ps(); R]; M];
    let mut tail = [[0f32; R]; M];
    let mut seen = _mm_setzero_si128();
    let mut k0 = 0;
    let mut kb = 0;
    while k0 < n {
        let k1 = (k0 + bk).min(n);
        let mut acc = [[[_mm256_setzero_ps(); 2]; R]; M];
        let mut i = k0;
        while i + 16 <= k1 {
            // once per line of the stream: every step from four rows up, else where a step
            // reaches a new line
            if R * 16 >= 64 || (R * i) / 64 != (R * (i + 16)) / 64 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(R * i).cast());
            }
            for r in 0..R {
                // SAFETY: i + 16 <= k1 <= n <= every length; unaligned loads.
                let b = _mm_loadu_si128(w[r].as_ptr().add(i).cast());
                if CHECK_NAN {
                    seen = nan_fold(seen, b);
                }
                let (lo, hi) = decode16(b);
                for a in 0..M {
                    let xp = x[a].as_ptr().add(i);
                    acc[a][r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp), lo, acc[a][r][0]);
                    acc[a][r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(8)), hi, acc[a][r][1]);
                }
            }
            i += 16;
        }
        for a in 0..M {
            for r in 0..R {
                let sc = scale(a, r, kb);
                let mut t = 0f32;
                for j in i..k1 {
                    t = x[a][j].mul_add(e4m3_to_f32(w[r][j]), t);
                }
                tail[a][r] = t.mul_add(sc, tail[a][r]);
                // the 2^8 of the decode is applied once at the end, so no scale can overflow
                let s = _mm256_set1_ps(sc);
                let sum = _mm256_add_ps(acc[a][r][0], acc[a][r][1]);
                tot[a][r] = _mm256_fmadd_ps(sum, s, tot[a][r]);
            }
        }
        k0 = k1;
        kb += 1;
    }
    let mut out = [[0f32; R]; M];
    for a in 0..M {
        for r in 0..R {
            out[a][r] = hsum(tot[a][r]).mul_add(DECODE_SHIFT, tail[a][r]);
        }
    }
    if CHECK_NAN && nan_seen(seen) {
        // rare: say which rows hold a NaN code (the tails already gave NaN by themselves)
        for r in 0..R {
            if w[r][..n].iter().any(|&c| c & 0x7f == 0x7f) {
                for o in out.iter_mut() {
                    o[r] = f32::NAN;
                }
            }
        }
    }
    out
}

/// `out[i][j] = Σ x_i[k] · w_j[k]` for `M` (up to four) activation rows and three weight rows,
/// all f32 (the weight rows already decoded and scaled), over the common length: one
/// accumulator per pair, each activation load shared by three rows and each weight load by
/// `M`; a pair's result does not depend on `M`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn dot_mx3<const M: usize>(x: [&[f32]; M], w: [&[f32]; 3]) -> [[f32; 3]; M] {
    let n = x
        .iter()
        .map(|r| r.len())
        .chain(w.iter().map(|r| r.len()))
        .min()
        .unwrap_or(0);
    let xp: [_; M] = crate::simd::lanes(|i| x[i].as_ptr());
    let wp: [_; 3] = crate::simd::lanes(|i| w[i].as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 3]; M];
    let mut k = 0;
    while k + 8 <= n {
        // SAFETY: k + 8 <= n <= every length; unaligned loads.
        let wv = [
            _mm256_loadu_ps(wp[0].add(k)),
            _mm256_loadu_ps(wp[1].add(k)),
            _mm256_loadu_ps(wp[2].add(k)),
        ];
        for i in 0..M {
            let xv = _mm256_loadu_ps(xp[i].add(k));
            for j in 0..3 {
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
        k += 8;
    }
    let mut out = [[0f32; 3]; M];
    for i in 0..M {
        for j in 0..3 {
            let mut tail = 0f32;
            for t in k..n {
                tail = x[i][t].mul_add(w[j][t], tail);
            }
            out[i][j] = hsum(acc[i][j]) + tail;
        }
    }
    out
}

/// `Σ_k x[k] · w_r[k]` for four f32 weight rows over the same `x` (each activation load shared
/// by the four rows), over the common length, with `ahead` prefetched as one stream of 128
/// bytes per 8 columns (`ahead + 16·i`: the four rows' bytes of those columns, when the rows
/// are adjacent). Any `ahead` will do, as a prefetch never faults.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn dot4_f32(x: &[f32], w: [&[f32]; 4], ahead: *const u8) -> [f32; 4] {
    let n = w.iter().fold(x.len(), |n, r| n.min(r.len()));
    let xp = x.as_ptr();
    let wp: [_; 4] = crate::simd::lanes(|i| w[i].as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i + 16 <= n {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * i).cast());
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * i + 64).cast());
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * i + 128).cast());
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * i + 192).cast());
        // SAFETY: i + 16 <= n <= every length; unaligned loads.
        let (x0, x1) = (_mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(xp.add(i + 8)));
        for r in 0..4 {
            let (w0, w1) = (
                _mm256_loadu_ps(wp[r].add(i)),
                _mm256_loadu_ps(wp[r].add(i + 8)),
            );
            acc[2 * r] = _mm256_fmadd_ps(x0, w0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(x1, w1, acc[2 * r + 1]);
        }
        i += 16;
    }
    let mut out = [0f32; 4];
    for (r, o) in out.iter_mut().enumerate() {
        let mut tail = 0f32;
        for j in i..n {
            tail = x[j].mul_add(w[r][j], tail);
        }
        *o = hsum(_mm256_add_ps(acc[2 * r], acc[2 * r + 1])) + tail;
    }
    out
}

/// [`crate::simd::exp_nonpos`] on eight lanes, the same arithmetic in the same order (so the
/// same values): NaN lanes stay NaN, lanes below -87.3 give 0, positive lanes 1.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp_nonpos8(x: __m256) -> __m256 {
    // NaN lanes: every comparison below is false for them, so they pass through to `r` as NaN
    let x = _mm256_blendv_ps(
        x,
        _mm256_setzero_ps(),
        _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_setzero_ps()),
    );
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
    let xc = _mm256_blendv_ps(x, _mm256_set1_ps(-87.3), under);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        xc,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693_145_75))),
        _mm256_mul_ps(n, _mm256_set1_ps(1.428_606_8e-6)),
    );
    let mut p = _mm256_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let v = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    _mm256_andnot_ps(under, v)
}

/// Asks for the `bytes` from `p` in L1 ahead of use, one prefetch per 64-byte line. Any
/// address will do: a prefetch never faults, and `wrapping_add` forms the addresses without
/// claiming they are inside an allocation.
#[inline(always)]
pub(crate) fn prefetch_bytes(p: *const u8, bytes: usize) {
    for off in (0..bytes).step_by(64) {
        // SAFETY: SSE (the prefetch's feature) is part of x86_64's baseline; a prefetch reads
        // nothing architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast()) };
    }
}

/// Lanes of `c` keys from `j0`: all ones for keys `j0 + r < c`, zeros past the chunk.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn live8(c: usize, j0: usize) -> __m256 {
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32((c - j0) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    ))
}

/// Eight keys' scores from their eight accumulators (lane r of the result: the sum of `a[r]`'s
/// lanes), under the folds' rules: a score of -inf (only an Inf in a key gives one) becomes NaN,
/// which exp(-inf) = 0 would otherwise hide; `run_max` takes the `live` lanes, NaN left out.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn scores8(a: [__m256; 8], live: __m256, run_max: &mut __m256) -> __m256 {
    // eight horizontal sums at once
    let t0 = _mm256_hadd_ps(a[0], a[1]);
    let t1 = _mm256_hadd_ps(a[2], a[3]);
    let t2 = _mm256_hadd_ps(a[4], a[5]);
    let t3 = _mm256_hadd_ps(a[6], a[7]);
    let (u0, u1) = (_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
    let s = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(u0, u1),
        _mm256_permute2f128_ps::<0x31>(u0, u1),
    );
    let ninf = _mm256_cmp_ps::<_CMP_EQ_OQ>(s, _mm256_set1_ps(f32::NEG_INFINITY));
    let s = _mm256_blendv_ps(s, _mm256_set1_ps(f32::NAN), ninf);
    // max ignoring NaN scores: the second operand is returned when either is NaN
    let cand = _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), s, live);
    *run_max = _mm256_max_ps(cand, *run_max);
    s
}

/// One head's online-softmax step over its `c` scores at `s` (written in steps of eight, lanes
/// past `c` unused): the new max from `run_max` and `m`, the scores replaced by their
/// exponentials (zeros past `c`), `m` and `l` updated. Returns the factor the head's
/// accumulator must be scaled by.
///
/// # Safety
/// AVX2 and FMA; `s` must hold `c.next_multiple_of(8)` writable values.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn softmax8(
    s: *mut f32,
    c: usize,
    run_max: __m256,
    m: &mut f32,
    l: &mut f32,
) -> f32 {
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), run_max);
    let mx = lanes.iter().fold(*m, |a, &b| a.max(b));
    let alpha = (*m - mx).exp();
    let mxv = _mm256_set1_ps(mx);
    let mut sum = _mm256_setzero_ps();
    for j0 in (0..c).step_by(8) {
        let p = s.add(j0);
        let e = _mm256_and_ps(
            exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(p), mxv)),
            live8(c, j0),
        );
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(p, e);
    }
    *m = mx;
    *l = *l * alpha + hsum(sum);
    alpha
}

/// An element type the fold reads eight at a time as f32: f32 rows in place, and the rows of
/// a 16-bit KV cache converted in the load (F16C for f16, a shift for bf16), so that a 16-bit
/// cache costs no pass of its own. Public in this private module: nameable only here, it is
/// the bound `nsa::KeyElem` carries.
pub trait Lanes: Copy {
    /// Eight elements from `p` as f32.
    ///
    /// # Safety
    /// `p` must point at eight readable elements; the CPU must have AVX2 and F16C.
    unsafe fn load8(p: *const Self) -> __m256;

    /// Sixteen elements from `p` as f32, converted as [`Self::load8`] converts them.
    ///
    /// # Safety
    /// `p` must point at sixteen readable elements; the CPU must have AVX-512 F.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }

    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Lanes for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

impl Lanes for half::bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const half::bf16) -> __m256 {
        // bf16 is the high half of an f32
        let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
    }

    #[inline(always)]
    unsafe fn load16(p: *const half::bf16) -> __m512 {
        let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
    }
}

/// The online-softmax fold of `nsa::fold_chunk` for `d` and `dv` multiples of 8, over the
/// key rows `rows` of `k [.., d]` / `v [.., dv]` (any rows, in the order given: a chunk may
/// span pages): scores of
/// eight keys at a time in registers (eight accumulators reduced together), the
/// exponentials eight lanes at a time, and each 32-wide slice of the output accumulator kept in
/// registers over all the chunk's keys. `q [g, d]` prescaled, `c = rows.len()` keys, every
/// row inside `k` and `v` (checked, panicking), `m`/`l [g]`, `acc [g, dv]`, `scores` at least
/// `c.next_multiple_of(8)`. The rows `ahead` (the caller's next chunk; any values, as a
/// prefetch never faults) are prefetched eight per eight keys of the first head's scores, so
/// their fetches from memory overlap this chunk's arithmetic.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (the sizes are checked).
#[target_feature(enable = "avx2,fma,f16c")]
// `j` indexes the rows and the scores alike
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
pub(crate) unsafe fn fold_chunk8<E: Lanes>(
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
    let c = rows.len();
    if c == 0 {
        return;
    }
    let g = q.len() / d;
    let es = std::mem::size_of::<E>();
    assert!(d.is_multiple_of(8) && dv.is_multiple_of(8) && scores.len() >= c.next_multiple_of(8));
    assert!(rows
        .iter()
        .all(|&r| (r as usize + 1) * d <= k.len() && (r as usize + 1) * dv <= v.len()));
    assert!(m.len() >= g && l.len() >= g && acc.len() >= g * dv);
    let (kp, vp, sp) = (k.as_ptr(), v.as_ptr(), scores.as_mut_ptr());
    for gi in 0..g {
        let qp = q.as_ptr().add(gi * d);
        let mut run_max = _mm256_set1_ps(f32::NEG_INFINITY);
        for j0 in (0..c).step_by(8) {
            if gi == 0 {
                for &r in ahead.iter().skip(j0).take(8) {
                    let r = r as usize;
                    prefetch_bytes(kp.cast::<u8>().wrapping_add(r * d * es), d * es);
                    prefetch_bytes(vp.cast::<u8>().wrapping_add(r * dv * es), dv * es);
                }
            }
            // keys past the chunk repeat its last key; their scores are not kept
            let krow: [usize; 8] = std::array::from_fn(|r| rows[(j0 + r).min(c - 1)] as usize * d);
            let mut a = [_mm256_setzero_ps(); 8];
            for t in (0..d).step_by(8) {
                // SAFETY: t + 8 <= d and every row index is below c, inside q and kc.
                let qv = _mm256_loadu_ps(qp.add(t));
                for r in 0..8 {
                    a[r] = _mm256_fmadd_ps(qv, E::load8(kp.add(krow[r] + t)), a[r]);
                }
            }
            let s = scores8(a, live8(c, j0), &mut run_max);
            // SAFETY: j0 + 8 <= c.next_multiple_of(8) <= scores.len().
            _mm256_storeu_ps(sp.add(j0), s);
        }
        let alpha = softmax8(sp, c, run_max, &mut m[gi], &mut l[gi]);
        let ap = acc.as_mut_ptr().add(gi * dv);
        let al = _mm256_set1_ps(alpha);
        // 32 output lanes at a time in four named registers (an array indexed up to a runtime
        // width was kept on the stack, a store and reload per key), then 8 at a time
        let mut c0 = 0;
        while c0 + 32 <= dv {
            let ld = |i: usize| _mm256_mul_ps(_mm256_loadu_ps(ap.add(c0 + 8 * i)), al);
            let (mut o0, mut o1, mut o2, mut o3) = (ld(0), ld(1), ld(2), ld(3));
            for j in 0..c {
                // SAFETY: j < c keys of dv values each in vc; c0 + 32 <= dv.
                let p = _mm256_broadcast_ss(&*sp.add(j));
                let vj = vp.add(rows[j] as usize * dv + c0);
                o0 = _mm256_fmadd_ps(p, E::load8(vj), o0);
                o1 = _mm256_fmadd_ps(p, E::load8(vj.add(8)), o1);
                o2 = _mm256_fmadd_ps(p, E::load8(vj.add(16)), o2);
                o3 = _mm256_fmadd_ps(p, E::load8(vj.add(24)), o3);
            }
            for (i, o) in [o0, o1, o2, o3].into_iter().enumerate() {
                _mm256_storeu_ps(ap.add(c0 + 8 * i), o);
            }
            c0 += 32;
        }
        while c0 < dv {
            let mut o = _mm256_mul_ps(_mm256_loadu_ps(ap.add(c0)), al);
            for j in 0..c {
                // SAFETY: as above, c0 + 8 <= dv (dv is a multiple of 8).
                let p = _mm256_broadcast_ss(&*sp.add(j));
                o = _mm256_fmadd_ps(p, E::load8(vp.add(rows[j] as usize * dv + c0)), o);
            }
            _mm256_storeu_ps(ap.add(c0), o);
            c0 += 8;
        }
    }
}

/// Rows per [`mk_6x16`] call.
pub(crate) const MK_MR: usize = 6;
/// Columns per [`mk_6x16`] call.
pub(crate) const MK_NR: usize = 16;

/// The f32 micro-kernel of the blocked attention: `c[r · ldc + j] = alpha[r] · c[r · ldc + j]
/// + Σ_kk a[kk · 6 + r] · b[kk · ldb + j]` for `r < 6`, `j < 16` (`alpha` `None`: `c` is
/// overwritten, no read). Twelve accumulators (6 x 2 vectors) stay in registers: per `kk`,
/// two loads of `b` and six broadcasts of `a` feed twelve FMAs.
///
/// # Safety
/// The CPU must have AVX2 and FMA (the sizes are checked, panicking).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn mk_6x16(
    kc: usize,
    a: &[f32],
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    alpha: Option<&[f32; MK_MR]>,
) {
    assert!(kc > 0 && ldb >= MK_NR && ldc >= MK_NR);
    // checked products: a wrapped size would pass a bound it breaks
    let need = |n: usize, ld: usize, w: usize| n.checked_mul(ld).and_then(|x| x.checked_add(w));
    assert!(need(kc, MK_MR, 0).is_some_and(|n| a.len() >= n));
    assert!(need(kc - 1, ldb, MK_NR).is_some_and(|n| b.len() >= n));
    assert!(need(MK_MR - 1, ldc, MK_NR).is_some_and(|n| c.len() >= n));
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    let z = _mm256_setzero_ps();
    let mut acc = [[z; 2]; MK_MR];
    if let Some(al) = alpha {
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: row r < 6 holds 16 values at r · ldc (asserted above).
            let x = _mm256_set1_ps(al[r]);
            row[0] = _mm256_mul_ps(x, _mm256_loadu_ps(cp.add(r * ldc)));
            row[1] = _mm256_mul_ps(x, _mm256_loadu_ps(cp.add(r * ldc + 8)));
        }
    }
    let [mut c00, mut c01] = acc[0];
    let [mut c10, mut c11] = acc[1];
    let [mut c20, mut c21] = acc[2];
    let [mut c30, mut c31] = acc[3];
    let [mut c40, mut c41] = acc[4];
    let [mut c50, mut c51] = acc[5];
    for kk in 0..kc {
        // SAFETY: kk < kc: b's row kk holds 16 values, a's step kk holds 6 (asserted above).
        let (b0, b1) = (
            _mm256_loadu_ps(bp.add(kk * ldb)),
            _mm256_loadu_ps(bp.add(kk * ldb + 8)),
        );
        let ak = ap.add(kk * MK_MR);
        let x = _mm256_broadcast_ss(&*ak);
        c00 = _mm256_fmadd_ps(x, b0, c00);
        c01 = _mm256_fmadd_ps(x, b1, c01);
        let x = _mm256_broadcast_ss(&*ak.add(1));
        c10 = _mm256_fmadd_ps(x, b0, c10);
        c11 = _mm256_fmadd_ps(x, b1, c11);
        let x = _mm256_broadcast_ss(&*ak.add(2));
        c20 = _mm256_fmadd_ps(x, b0, c20);
        c21 = _mm256_fmadd_ps(x, b1, c21);
        let x = _mm256_broadcast_ss(&*ak.add(3));
        c30 = _mm256_fmadd_ps(x, b0, c30);
        c31 = _mm256_fmadd_ps(x, b1, c31);
        let x = _mm256_broadcast_ss(&*ak.add(4));
        c40 = _mm256_fmadd_ps(x, b0, c40);
        c41 = _mm256_fmadd_ps(x, b1, c41);
        let x = _mm256_broadcast_ss(&*ak.add(5));
        c50 = _mm256_fmadd_ps(x, b0, c50);
        c51 = _mm256_fmadd_ps(x, b1, c51);
    }
    let out = [
        [c00, c01],
        [c10, c11],
        [c20, c21],
        [c30, c31],
        [c40, c41],
        [c50, c51],
    ];
    for (r, [lo, hi]) in out.into_iter().enumerate() {
        // SAFETY: as above, row r < 6 of c holds 16 values.
        _mm256_storeu_ps(cp.add(r * ldc), lo);
        _mm256_storeu_ps(cp.add(r * ldc + 8), hi);
    }
}

/// Checks of the e4m3 kernels against the scalar decoder and f64, shared by this module's tests
/// and `avx512`'s: each tier's kernel is passed in as a function pointer.
#[cfg(test)]
pub(crate) mod checks {
    use crate::fp8::e4m3_to_f32;

    /// A `decode_scaled` kernel.
    pub(crate) type Decode = unsafe fn(&[u8], f32, &mut [f32]);
    /// A `dot4_blocks` kernel (one of its two NaN-scan forms).
    pub(crate) type Dot4 = unsafe fn(&[f32], [&[u8]; 4], usize, [&[f32]; 4], *const u8) -> [f32; 4];

    /// Four weight rows of `n` codes, every code but the NaN ones (0x7f / 0xff become 0x7e),
    /// the rows offset from each other.
    pub(crate) fn nan_free_rows(n: usize) -> Vec<Vec<u8>> {
        (0..4)
            .map(|r| {
                (0..n)
                    .map(|i| ((i * 11 + r * 53) % 256) as u8)
                    .map(|c| if c & 0x7f == 0x7f { 0x7e } else { c })
                    .collect()
            })
            .collect()
    }

    /// Every code, at every position of a vector and in a tail, is decoded bit-identically to
    /// the scalar decoder for scales up to `f32::MAX` (where `scale · 2^8` would overflow), and
    /// nothing is written past the end.
    ///
    /// # Safety
    /// The CPU must have the features `decode` is compiled for.
    pub(crate) unsafe fn decode_bit_for_bit(decode: Decode) {
        let codes: Vec<u8> = (0..=255u8).chain(0..=255u8).chain(0..7).collect();
        for scale in [1.0f32, 0.5, 3.0e-5, 7.6e35, 1e37, f32::MAX, 1e-12 / 448.0] {
            for len in [codes.len(), 16, 5, 0] {
                // a guard after the written part: a store past `len` would show there
                let mut got = vec![-7f32; len + 16];
                // SAFETY: the caller guarantees the kernel's features.
                unsafe { decode(&codes[..len], scale, &mut got[..len]) };
                assert!(
                    got[len..].iter().all(|&g| g == -7.0),
                    "store past len {len}"
                );
                for (c, g) in codes[..len].iter().zip(&got) {
                    let want = e4m3_to_f32(*c) * scale;
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "code {c:#04x} scale {scale:e}: {g:e} vs {want:e}"
                    );
                }
            }
        }
    }

    /// `checked` (the form with the NaN scan) against f64 over vector steps, tails, block sizes
    /// that are not multiples of the vector width, K = 3884, and block scales of two kinds
    /// (close to 1, and over 1e-3..1e3); `fast` (without the scan) gives the same bits on NaN-free
    /// rows; a NaN code in a vector position or in a tail makes exactly its row NaN.
    ///
    /// # Safety
    /// The CPU must have the features both kernels are compiled for.
    pub(crate) unsafe fn dot4_blocks_against_f64(checked: Dot4, fast: Dot4) {
        let cases = [
            (0usize, 16),
            (1, 16),
            (15, 16),
            (16, 16),
            (17, 16),
            (33, 64),
            (128, 128),
            (300, 128),
            (300, 40),
            (3884, 128),
        ];
        let near_one = |r: usize, b: usize| 0.5 + (r * 3 + b) as f32 * 0.75;
        let spread = |r: usize, b: usize| 10f32.powi(((r * 5 + b * 3) % 7) as i32 - 3);
        for (n, bk) in cases {
            for scale_of in [&near_one as &dyn Fn(usize, usize) -> f32, &spread] {
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.25)
                    .collect();
                // no NaN codes at first
                let mut rows = nan_free_rows(n);
                let scales: Vec<Vec<f32>> = (0..4)
                    .map(|r| (0..n.div_ceil(bk).max(1)).map(|b| scale_of(r, b)).collect())
                    .collect();
                let sc = [&scales[0][..], &scales[1], &scales[2], &scales[3]];
                let wr = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
                // SAFETY: the caller guarantees the kernels' features.
                let (got, same) = unsafe {
                    (
                        checked(&x, wr, bk, sc, x.as_ptr().cast()),
                        fast(&x, wr, bk, sc, x.as_ptr().cast()),
                    )
                };
                assert_eq!(
                    got.map(f32::to_bits),
                    same.map(f32::to_bits),
                    "n {n} bk {bk}"
                );
                for r in 0..4 {
                    let term = |i: usize| {
                        x[i] as f64 * e4m3_to_f32(rows[r][i]) as f64 * scales[r][i / bk] as f64
                    };
                    let want: f64 = (0..n).map(term).sum();
                    let mag: f64 = (0..n).map(|i| term(i).abs()).sum();
                    assert!(
                        (got[r] as f64 - want).abs() <= 1e-6 * mag.max(1e-30),
                        "n {n} bk {bk} row {r}: {} vs {want}",
                        got[r]
                    );
                }
                if n >= 17 {
                    // one NaN code in row 2's vector part, one in row 3's last (tail) position
                    rows[2][3] = 0xff;
                    rows[3][n - 1] = 0x7f;
                    let wr = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
                    // SAFETY: as above.
                    let got = unsafe { checked(&x, wr, bk, sc, x.as_ptr().cast()) };
                    assert!(!got[0].is_nan() && !got[1].is_nan(), "n {n}: {got:?}");
                    assert!(got[2].is_nan() && got[3].is_nan(), "n {n}: {got:?}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::Tier;

    /// Whether the AVX2 tier exists here; without it the kernel tests skip, saying so, unless
    /// `FP8NSA_REQUIRE_AVX2=1` (set by CI) makes that a failure.
    fn avx2() -> bool {
        fp8nsa_test_support::resource::require(
            (Tier::detected() >= Tier::Avx2).then_some(()),
            fp8nsa_test_support::resource::AVX2,
            "the AVX2 tier (AVX2 + FMA + F16C)",
            "run on an x86-64 CPU from Haswell / Zen on",
        )
        .is_some()
    }

    /// The eight-lane exponential gives the scalar one's bits, specials included.
    #[test]
    fn exp_nonpos8_equals_the_scalar_form() {
        if !avx2() {
            return;
        }
        let mut xs: Vec<f32> = (0..20000).map(|i| -(i as f32) * 0.004_57).collect();
        xs.extend([
            0.0,
            -0.0,
            3.0,
            f32::NEG_INFINITY,
            f32::NAN,
            -87.2,
            -87.3,
            -87.4,
            -1e30,
        ]);
        while !xs.len().is_multiple_of(8) {
            xs.push(-1.0);
        }
        for c in xs.chunks_exact(8) {
            let mut got = [0f32; 8];
            // SAFETY: AVX2 + FMA checked above; eight lanes in and out.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), exp_nonpos8(_mm256_loadu_ps(c.as_ptr()))) };
            for (x, g) in c.iter().zip(got) {
                let want = crate::simd::exp_nonpos(*x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{x}: {g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn decode_matches_the_scalar_decoder_bit_for_bit() {
        if avx2() {
            // SAFETY: AVX2 + FMA + F16C checked above.
            unsafe { checks::decode_bit_for_bit(decode_scaled) };
        }
    }

    /// The NaN-free decode gives the checked decode's bits on every non-NaN code, for scales
    /// from subnormal to `f32::MAX` (where `scale · 2^8` overflows and it takes two multiplies).
    #[test]
    fn nan_free_decode_equals_the_checked_one() {
        if !avx2() {
            return;
        }
        let codes: Vec<u8> = (0..=255u8)
            .filter(|c| c & 0x7f != 0x7f)
            .cycle()
            .take(600)
            .collect();
        for scale in [
            1.0f32,
            0.5,
            3.0e-5,
            1e-40,
            7.6e35,
            1e37,
            f32::MAX,
            1e-12 / 448.0,
        ] {
            for len in [codes.len(), 16, 5, 0] {
                let (mut a, mut b) = (vec![0f32; len], vec![0f32; len]);
                // SAFETY: AVX2 + FMA + F16C checked above.
                unsafe {
                    decode_scaled(&codes[..len], scale, &mut a);
                    decode_scaled_nan_free(&codes[..len], scale, &mut b);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "scale {scale:e} len {len}");
            }
        }
    }

    #[test]
    fn dot4_blocks_matches_f64_and_propagates_nan() {
        if avx2() {
            // SAFETY: as above.
            unsafe { checks::dot4_blocks_against_f64(dot4_blocks::<true>, dot4_blocks::<false>) };
        }
    }

    /// `dot_blocks` over a batch of activation rows (one or two weight rows, 1..4 activation
    /// rows, with and without the NaN scan) gives every pair the bits `dot4_blocks` gives it
    /// alone, tails and partial blocks included; a NaN code makes its weight row NaN in every
    /// activation row.
    #[test]
    fn dot_blocks_batch_rows_get_their_single_row_bits() {
        if !avx2() {
            return;
        }
        for (n, bk) in [(17usize, 16usize), (300, 128), (300, 40), (3884, 128)] {
            let xs: Vec<Vec<f32>> = (0..4)
                .map(|a| {
                    (0..n)
                        .map(|i| ((i * 37 + a * 11) % 17) as f32 * 0.25 - 2.0)
                        .collect()
                })
                .collect();
            let mut rows = checks::nan_free_rows(n);
            let kbs = n.div_ceil(bk);
            let sx: Vec<Vec<f32>> = (0..4)
                .map(|a| {
                    (0..kbs)
                        .map(|b| 10f32.powi(((a + b * 3) % 7) as i32 - 3))
                        .collect()
                })
                .collect();
            let sw: Vec<Vec<f32>> = (0..4)
                .map(|r| {
                    (0..kbs)
                        .map(|b| 10f32.powi(((r * 5 + b) % 7) as i32 - 3))
                        .collect()
                })
                .collect();
            for nan in [false, true] {
                if nan {
                    rows[1][n / 2] = 0xff;
                }
                let wr = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
                let p = xs[0].as_ptr().cast();
                // SAFETY (of the calls): AVX2 + FMA + F16C checked above.
                let alone: Vec<[f32; 4]> = (0..4)
                    .map(|a| {
                        let prod: Vec<Vec<f32>> = (0..4)
                            .map(|r| (0..kbs).map(|b| sx[a][b] * sw[r][b]).collect())
                            .collect();
                        let sc = [&prod[0][..], &prod[1], &prod[2], &prod[3]];
                        unsafe { dot4_blocks::<true>(&xs[a], wr, bk, sc, p) }
                    })
                    .collect();
                let bits = |v: f32| v.to_bits();
                let scale = |a0: usize, r0: usize| {
                    let (sx, sw) = (&sx, &sw);
                    move |a: usize, r: usize, kb: usize| sx[a0 + a][kb] * sw[r0 + r][kb]
                };
                let x = [&xs[0][..], &xs[1], &xs[2], &xs[3]];
                let b14 = unsafe { dot_blocks::<1, 4, true>(x, [wr[1]], bk, scale(0, 1), p) };
                let b13 = unsafe {
                    dot_blocks::<1, 3, false>([x[1], x[2], x[3]], [wr[2]], bk, scale(1, 2), p)
                };
                let b22 = unsafe {
                    dot_blocks::<2, 2, true>([x[2], x[3]], [wr[0], wr[1]], bk, scale(2, 0), p)
                };
                for a in 0..4 {
                    assert_eq!(
                        bits(b14[a][0]),
                        bits(alone[a][1]),
                        "n {n} bk {bk} nan {nan}"
                    );
                }
                for a in 0..3 {
                    assert_eq!(bits(b13[a][0]), bits(alone[a + 1][2]), "n {n} bk {bk}");
                }
                for a in 0..2 {
                    assert_eq!(
                        b22[a].map(bits),
                        [bits(alone[a + 2][0]), bits(alone[a + 2][1])]
                    );
                }
                assert_eq!(nan, alone.iter().all(|o| o[1].is_nan()), "n {n}");
                assert!(alone.iter().all(|o| !o[0].is_nan() && !o[2].is_nan()));
            }
        }
    }

    #[test]
    fn dot_mx3_matches_f64_whatever_m() {
        if !avx2() {
            return;
        }
        for n in [0usize, 1, 7, 8, 9, 64, 301] {
            let row = |seed: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| (((i + 3) * (seed + 7) * 2654435761) % 1000) as f32 / 250.0 - 2.0)
                    .collect()
            };
            let xs: Vec<Vec<f32>> = (0..4).map(row).collect();
            let ws: Vec<Vec<f32>> = (4..7).map(row).collect();
            let w = [&ws[0][..], &ws[1], &ws[2]];
            // SAFETY (of the calls): AVX2 + FMA + F16C checked above.
            let got = unsafe { dot_mx3([&xs[0][..], &xs[1], &xs[2], &xs[3]], w) };
            let bits = |r: [f32; 3]| r.map(f32::to_bits);
            // fewer activation rows: each pair the same bits
            let one = unsafe { dot_mx3([&xs[2][..]], w) };
            let two = unsafe { dot_mx3([&xs[3][..], &xs[0]], w) };
            let three = unsafe { dot_mx3([&xs[1][..], &xs[2], &xs[3]], w) };
            assert_eq!(bits(one[0]), bits(got[2]), "n {n}");
            assert_eq!(
                [bits(two[0]), bits(two[1])],
                [bits(got[3]), bits(got[0])],
                "n {n}"
            );
            assert_eq!(
                three.map(bits),
                [bits(got[1]), bits(got[2]), bits(got[3])],
                "n {n}"
            );
            for i in 0..4 {
                for j in 0..3 {
                    let want: f64 = xs[i]
                        .iter()
                        .zip(&ws[j])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    assert!(
                        (got[i][j] as f64 - want).abs() <= 1e-5 * (n as f64 + 1.0),
                        "n {n} [{i}][{j}]: {} vs {want}",
                        got[i][j]
                    );
                }
            }
        }
    }
}
