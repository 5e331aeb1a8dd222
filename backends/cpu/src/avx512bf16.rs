//! The W8A8 GEMV and panel GEMM on bf16 pairs, for CPUs with AVX512-BF16 and VBMI (Zen 4,
//! Sapphire Rapids):
//! both factors of every product are e4m3 values, which bf16 holds exactly (a sign, 8 exponent
//! bits and 3 of its 7 mantissa bits; even the e4m3 subnormals, 2^-9 and up, are bf16 normals),
//! and `vdpbf16ps` multiplies 32 bf16 pairs into 16 f32 lanes per instruction, twice what an
//! f32 FMA does. Products of two e4m3 values have at most 8 significant bits, so they are exact
//! in f32 and only the f32 additions round, as in the f32 kernels: the contract holds.
//!
//! The decode is a table lookup instead of the F16C trick of `x86` / `avx512`: `vpermi2b` looks
//! 64 codes up in a 128-entry byte table at once (the low 7 bits index it), one table for the
//! low byte of each value's bf16 pattern and one for the high byte; the sign bit is or-ed into
//! the high byte, and two byte interleaves (`vpunpck{l,h}bw`) give two vectors of 32 bf16 values.
//! That is 5 shuffles per 64 codes where the F16C decode spends 10, and the table maps the NaN
//! codes to NaN, so a NaN weight needs no separate scan: `vdpbf16ps` carries it to the output.
//! The interleaves work within 128-bit lanes, so the 64 values come out permuted; the
//! activations are laid out once per call in the same order ([`act_layout`]), and a dot product
//! does not care about order.
//!
//! `vdpbf16ps` treats bf16 subnormal inputs as zero; none occur here (see above), and no product
//! or sum of products of e4m3 values and e4m3-valued activations reaches f32's subnormal range.
//!
//! Every kernel is `unsafe`: it is compiled for AVX-512 F / BW / VL / VBMI / BF16 and the
//! caller must have checked the CPU has them (`Tier::current() >= Tier::Avx512Bf16`).

use std::arch::x86_64::*;

/// Codes per step: one 64-byte load, two vectors of 32 bf16 values.
pub(crate) const STEP: usize = 64;

/// bf16 bit pattern of e4m3fn magnitude code `c` (0..128): `0x7f` is NaN.
const fn bf16_of(c: u8) -> u16 {
    let (e, m) = ((c >> 3) as u16, (c & 7) as u16);
    if c == 0x7f {
        0x7fc0
    } else if e > 0 {
        // 2^(e - 7) · (1 + m/8): exponent field e - 7 + 127, mantissa m in the top 3 bits
        ((e + 120) << 7) | (m << 4)
    } else if m == 0 {
        0
    } else {
        // m · 2^-9 with m = 2^p · (1 + f): normalize to 2^(p - 9) · (1 + f)
        let p = 15 - m.leading_zeros() as u16; // 0..=2
        ((p + 118) << 7) | (((m << (3 - p)) & 7) << 4)
    }
}

/// Byte `HI` (0 low, 1 high) of every magnitude code's bf16 pattern, as a 128-entry table.
const fn table(hi: bool) -> [u8; 128] {
    let mut t = [0u8; 128];
    let mut c = 0;
    while c < 128 {
        let b = bf16_of(c as u8);
        t[c] = if hi { (b >> 8) as u8 } else { b as u8 };
        c += 1;
    }
    t
}
static LO: [u8; 128] = table(false);
static HI: [u8; 128] = table(true);

/// Position, within a step of 64 codes, of the code whose value lands in bf16 slot `j` of the
/// step's two vectors (slots 0..32 the first, 32..64 the second): per 128-bit lane `L`, the low
/// interleave holds codes `16L..16L + 8`, the high one codes `16L + 8..16L + 16`.
#[inline]
fn source_of(j: usize) -> usize {
    let (half, w) = (j / 32, j % 32);
    16 * (w / 8) + 8 * half + w % 8
}

/// Words of [`act_layout`] per K-block of `bk` codes: the block rounded up to whole steps.
pub(crate) fn block_words(bk: usize) -> usize {
    bk.div_ceil(STEP) * STEP
}

/// The bf16 pattern of an e4m3 value held as f32: the top half of its f32 pattern (exact), and
/// every NaN as the one quiet NaN 0x7fc0.
#[inline(always)]
fn bf16_bits(v: f32) -> u16 {
    if v.is_nan() {
        0x7fc0
    } else {
        (v.to_bits() >> 16) as u16
    }
}

/// The bf16 patterns of activation rows `x` (rows of `k` e4m3 values, exact in bf16), one row
/// after the other, laid out for [`dot_blocks`]: in each row, K-block `kb` at word
/// `kb · block_words(bk)`, each of its steps permuted as the decode permutes codes, zeros past
/// the block's end. NaN stays NaN. The rows are laid out in parallel.
#[cfg(test)]
pub(crate) fn act_layout(x: &[f32], k: usize, bk: usize) -> Vec<u16> {
    let mut out = vec![0u16; act_layout_len(x.len() / k, k, bk)];
    act_layout_into(x, k, bk, &mut out);
    out
}

/// How many words [`act_layout`] gives `rows` rows of `k` values.
pub(crate) fn act_layout_len(rows: usize, k: usize, bk: usize) -> usize {
    rows * k.div_ceil(bk) * block_words(bk)
}

/// [`act_layout`] into `out` ([`act_layout_len`] words, every one written), so that a call
/// can lay its activations out in a reused buffer.
pub(crate) fn act_layout_into(x: &[f32], k: usize, bk: usize, out: &mut [u16]) {
    use rayon::prelude::*;
    let bw = block_words(bk);
    assert_eq!(
        out.len(),
        act_layout_len(x.len() / k, k, bk),
        "out is the layout's size"
    );
    out.par_chunks_mut(k.div_ceil(bk) * bw)
        .zip(x.par_chunks(k))
        .for_each(|(row, x)| {
            for (kb, dst) in row.chunks_exact_mut(bw).enumerate() {
                let block = &x[kb * bk..(kb * bk + bk).min(k)];
                for (s, step) in dst.chunks_exact_mut(STEP).enumerate() {
                    let src = &block[(s * STEP).min(block.len())..];
                    if src.len() >= STEP {
                        // a whole step: eight runs of eight consecutive values (`source_of`),
                        // each a plain loop the compiler vectorizes; the per-slot form below
                        // was ~5% of a one-row GEMV call
                        for (run, d) in step.chunks_exact_mut(8).enumerate() {
                            let from = source_of(8 * run);
                            for (d, &v) in d.iter_mut().zip(&src[from..from + 8]) {
                                *d = bf16_bits(v);
                            }
                        }
                    } else {
                        // zeros past the block's end: the buffer may hold an earlier call's
                        for (j, d) in step.iter_mut().enumerate() {
                            *d = src.get(source_of(j)).map_or(0, |&v| bf16_bits(v));
                        }
                    }
                }
            }
        });
}

/// The first `left.min(64)` byte lanes.
#[inline(always)]
fn lanes64(left: usize) -> __mmask64 {
    if left >= 64 {
        !0
    } else {
        (1u64 << left) - 1
    }
}

/// 64 e4m3fn codes as two vectors of 32 bf16 values, in [`source_of`]'s order.
#[inline(always)]
unsafe fn decode64(c: __m512i, lo_t: [__m512i; 2], hi_t: [__m512i; 2]) -> (__m512bh, __m512bh) {
    let lo = _mm512_permutex2var_epi8(lo_t[0], c, lo_t[1]);
    let hi = _mm512_permutex2var_epi8(hi_t[0], c, hi_t[1]);
    // hi | (c & 0x80): the code's sign into the pattern's sign bit
    let hi = _mm512_ternarylogic_epi32::<0xf8>(hi, c, _mm512_set1_epi8(0x80u8 as i8));
    // SAFETY (of the transmutes): same size, and every bit pattern is a valid bf16 vector.
    (
        std::mem::transmute::<__m512i, __m512bh>(_mm512_unpacklo_epi8(lo, hi)),
        std::mem::transmute::<__m512i, __m512bh>(_mm512_unpackhi_epi8(lo, hi)),
    )
}

/// `out[i][r] = Σ_kb sx_i[kb] · sw_r[kb] · Σ_{k in kb} x_i[k] · decode(w_r[k])` for `M`
/// activation rows, given in [`act_layout`] (built with the same `bk`), and `R` weight rows of
/// `k` codes, decoded in registers once per step for all `M` rows. Each (activation row, weight
/// row) pair has its own accumulators, and the same operations in the same order whatever `R`
/// and `M` are, so a row of a batch gets the bits it gets alone (`M = 1`). A row with a NaN code
/// (or NaN activations) gives NaN. `ahead` is prefetched as in `x86::dot4_blocks`, `R` lines per
/// step: the start of the rows `PREFETCH_ROWS` further on, contiguous with these.
///
/// # Safety
/// The CPU must have AVX-512 F / BW / VL / VBMI / BF16. Every `xb` row must hold
/// `k.div_ceil(bk)` blocks of [`block_words`]`(bk)` words, every weight row at least `k` codes
/// and every scale row `k.div_ceil(bk)` entries (checked, panicking).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")]
#[inline]
// `kb`, `x` and `r` index codes, layouts, scales and accumulators alike
#[allow(clippy::needless_range_loop)]
pub(crate) unsafe fn dot_blocks<const R: usize, const M: usize>(
    xb: [&[u16]; M],
    w: [&[u8]; R],
    k: usize,
    bk: usize,
    sx: [&[f32]; M],
    sw: [&[f32]; R],
    ahead: *const u8,
) -> [[f32; R]; M] {
    let bw = block_words(bk);
    let kbs = k.div_ceil(bk);
    assert!(xb.iter().all(|x| x.len() >= kbs * bw) && w.iter().all(|r| r.len() >= k));
    assert!(sx.iter().chain(&sw).all(|s| s.len() >= kbs));
    let (lo_t, hi_t) = (tables(&LO), tables(&HI));
    let mut tot = [[_mm512_setzero_ps(); R]; M];
    for kb in 0..kbs {
        let (k0, len) = (kb * bk, bk.min(k - kb * bk));
        // two accumulators per pair, for the two halves of a step, summed at the block's end
        let mut acc = [[[_mm512_setzero_ps(); 2]; R]; M];
        let mut i = 0;
        while i < len {
            let m = lanes64(len - i);
            let pf = ahead.wrapping_add(R * (k0 + i));
            for j in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(64 * j).cast());
            }
            for r in 0..R {
                // SAFETY: the mask covers bytes k0 + i .. k0 + min(len, i + 64) <= k of the
                // row; masked-off bytes are not read and load as the zero code (0.0).
                let c = _mm512_maskz_loadu_epi8(m, w[r].as_ptr().add(k0 + i).cast());
                let (a, b) = decode64(c, lo_t, hi_t);
                for x in 0..M {
                    // SAFETY: `i + 64 <= bw`, so both 32-word loads lie in this block of the
                    // row's layout.
                    let xp = xb[x].as_ptr().add(kb * bw + i);
                    acc[x][r][0] = _mm512_dpbf16_ps(acc[x][r][0], a, load_bh(xp));
                    acc[x][r][1] = _mm512_dpbf16_ps(acc[x][r][1], b, load_bh(xp.add(32)));
                }
            }
            i += STEP;
        }
        for x in 0..M {
            for r in 0..R {
                let s = _mm512_set1_ps(sx[x][kb] * sw[r][kb]);
                let a = _mm512_add_ps(acc[x][r][0], acc[x][r][1]);
                tot[x][r] = _mm512_fmadd_ps(a, s, tot[x][r]);
            }
        }
    }
    // loops, not `map` closures: a closure does not inherit the function's target features, so
    // the reduction in it would not be inlined (measured: a third of a call's time)
    let mut out = [[0f32; R]; M];
    for x in 0..M {
        for r in 0..R {
            out[x][r] = _mm512_reduce_add_ps(tot[x][r]);
        }
    }
    out
}

/// Weight row `w [k]` decoded into `dst` (`k.div_ceil(bk)` blocks of [`block_words`]`(bk)`
/// words) in [`act_layout`]'s order, zeros past each block's end: the panel GEMM decodes each
/// weight row once into its tile, then multiplies it with every activation row.
///
/// # Safety
/// The CPU must have AVX-512 F / BW / VL / VBMI / BF16. `w` must hold at least `k` codes and
/// `dst` the stated words (checked, panicking).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")]
pub(crate) unsafe fn decode_row(w: &[u8], k: usize, bk: usize, dst: &mut [u16]) {
    let bw = block_words(bk);
    assert!(w.len() >= k && dst.len() >= k.div_ceil(bk) * bw);
    let (lo_t, hi_t) = (tables(&LO), tables(&HI));
    for kb in 0..k.div_ceil(bk) {
        let (k0, len) = (kb * bk, bk.min(k - kb * bk));
        let dp = dst.as_mut_ptr().add(kb * bw);
        let mut i = 0;
        while i < bw {
            // SAFETY: the mask covers codes k0 + i .. k0 + min(len, i + 64) <= k; a step wholly
            // past the block's end loads nothing and stores zeros; the stores lie inside this
            // block of `dst` (i + 64 <= bw).
            let c = _mm512_maskz_loadu_epi8(
                lanes64(len.saturating_sub(i)),
                w.as_ptr().add(k0 + i).cast(),
            );
            let (a, b) = decode64(c, lo_t, hi_t);
            _mm512_storeu_si512(
                dp.add(i).cast(),
                std::mem::transmute::<__m512bh, __m512i>(a),
            );
            _mm512_storeu_si512(
                dp.add(i + 32).cast(),
                std::mem::transmute::<__m512bh, __m512i>(b),
            );
            i += STEP;
        }
    }
}

/// 32 bf16 values from `p` (unaligned).
#[inline(always)]
unsafe fn load_bh(p: *const u16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast()))
}

/// The two 64-byte halves of a 128-entry table.
#[inline(always)]
unsafe fn tables(t: &[u8; 128]) -> [__m512i; 2] {
    [
        _mm512_loadu_si512(t.as_ptr().cast()),
        _mm512_loadu_si512(t.as_ptr().add(64).cast()),
    ]
}

/// Activation rows already in [`act_layout`] (`xb`: `m` rows of equal length) as
/// [`act_pair_columns`]' columns: the two-pass form that the one-pass builder is tested against.
#[cfg(test)]
pub(crate) fn pair_columns(xb: &[u16], m: usize, m_pad: usize) -> Vec<u32> {
    use rayon::prelude::*;
    let rw = xb.len() / m;
    let mut out = vec![0u32; rw / 2 * m_pad];
    // 64 pairs per task: each row's 256 bytes of them are one contiguous read
    out.par_chunks_mut(64 * m_pad)
        .enumerate()
        .for_each(|(c, cols)| {
            for (i, row) in xb.chunks_exact(rw).enumerate() {
                let words = &row[128 * c..(128 * c + 128).min(rw)];
                for (p, w) in words.chunks_exact(2).enumerate() {
                    cols[p * m_pad + i] = w[0] as u32 | (w[1] as u32) << 16;
                }
            }
        });
    out
}

/// Activation rows `x` (`m` rows of `k` e4m3 values as f32) as the panel GEMM's columns of
/// bf16 pairs: each row's words in [`act_layout`]'s order, then `u32 [pairs, m_pad]`, where word
/// pair `p` of row `i` (words `2p`, `2p + 1`, little-endian, the low one first as `vdpbf16ps`
/// pairs them) sits at `p · m_pad + i`, and rows `m..m_pad` are zeros. Transposed so that one
/// load gives one pair of 16 rows, to multiply with a broadcast weight pair.
///
/// A pair's two words are the values of two adjacent codes (the layout permutes whole pairs
/// within a step of 64 codes), so 16 rows' steps go through registers: each row's 64 values
/// loaded (masked past the block's end), NaN made the one quiet NaN [`bf16_bits`] gives, the
/// high halves packed into 32 pairs by one word permute per 32 values, the 16 rows transposed
/// ([`crate::avx512::transpose16_regs`]) and every pair's 16 rows stored at its place. The
/// scalar form, a pair per load and per store, was ~7% of a 512-token prefill's samples on
/// Zen 4.
///
/// # Safety
/// The CPU must have AVX-512 F and BW (the sizes are checked, panicking).
pub(crate) unsafe fn act_pair_columns(
    x: &[f32],
    m: usize,
    k: usize,
    bk: usize,
    m_pad: usize,
    out: &mut [u32],
) {
    use rayon::prelude::*;
    assert!(k > 0 && bk > 0 && m <= m_pad && m_pad.is_multiple_of(16) && x.len() >= m * k);
    let bw = block_words(bk);
    let steps = bw / STEP; // per block
    assert_eq!(out.len(), k.div_ceil(bk) * bw / 2 * m_pad);
    // two steps (64 pairs) per task
    out.par_chunks_mut(STEP * m_pad)
        .enumerate()
        .for_each(|(c, cols)| {
            for (h, cols) in cols.chunks_mut(STEP / 2 * m_pad).enumerate() {
                let st = 2 * c + h;
                let (kb, start) = (st / steps, st % steps * STEP);
                let len = bk.min(k - kb * bk).saturating_sub(start).min(STEP);
                // SAFETY: the caller's contract (AVX-512 F and BW); the step's codes
                // kb · bk + start .. + len lie inside every row (len 0 past a block's end).
                unsafe { pair_step(x, (m, k), kb * bk + start, len, m_pad, cols) };
            }
        });
}

/// The pairs of one step of [`act_pair_columns`]: codes `k0 .. k0 + len` (`len <= 64`, zeros
/// past it) of the `m` rows of `x [m, k]`, into `cols [32, m_pad]`.
#[target_feature(enable = "avx512f,avx512bw")]
// `r` indexes the rows of `x` and of both halves of `packed` alike
#[allow(clippy::needless_range_loop)]
unsafe fn pair_step(
    x: &[f32],
    (m, k): (usize, usize),
    k0: usize,
    len: usize,
    m_pad: usize,
    cols: &mut [u32],
) {
    assert!(cols.len() == STEP / 2 * m_pad && m <= m_pad && m_pad.is_multiple_of(16));
    assert!(len <= STEP && (len == 0 || (m - 1) * k + k0 + len <= x.len()));
    // where packed pair q (codes 2q, 2q + 1 of the step) goes: the pair whose first word
    // `act_layout` takes from code 2q
    const PLACE: [usize; STEP / 2] = {
        let mut t = [0; STEP / 2];
        let mut p = 0;
        while p < STEP / 2 {
            let (half, w) = (2 * p / 32, 2 * p % 32);
            t[(16 * (w / 8) + 8 * half + w % 8) / 2] = p;
            p += 1;
        }
        t
    };
    // the odd words of 32 f32 lanes: their high halves, the bf16 patterns of e4m3 values
    const ODD: [u16; 32] = {
        let mut t = [0; 32];
        let mut j = 0;
        while j < 32 {
            t[j] = 2 * j as u16 + 1;
            j += 1;
        }
        t
    };
    let odd = _mm512_loadu_si512(ODD.as_ptr().cast());
    let qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc0_0000));
    let mask = |j: usize| -> __mmask16 {
        let left = len.saturating_sub(16 * j);
        if left >= 16 {
            !0
        } else {
            (1u16 << left) - 1
        }
    };
    for i0 in (0..m_pad).step_by(16) {
        let mut packed = [[_mm512_setzero_ps(); 16]; 2];
        for r in 0..16.min(m.saturating_sub(i0)) {
            let p = x.as_ptr().add((i0 + r) * k + k0);
            let f: [__m512i; 4] = std::array::from_fn(|j| {
                // SAFETY: the mask covers codes k0 + 16j .. k0 + min(len, 16j + 16) of the row
                // (checked above); masked-off lanes are not read and load as +0.0.
                let v = _mm512_maskz_loadu_ps(mask(j), p.add(16 * j));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
                _mm512_castps_si512(_mm512_mask_mov_ps(v, nan, qnan))
            });
            for h in 0..2 {
                packed[h][r] =
                    _mm512_castsi512_ps(_mm512_permutex2var_epi16(f[2 * h], odd, f[2 * h + 1]));
            }
        }
        for (h, rows) in packed.into_iter().enumerate() {
            for (q, v) in crate::avx512::transpose16_regs(rows)
                .into_iter()
                .enumerate()
            {
                // SAFETY: pair PLACE[..] < 32 of cols' 32 pairs of m_pad, lanes i0..i0 + 16.
                let at = cols.as_mut_ptr().add(PLACE[16 * h + q] * m_pad + i0);
                _mm512_storeu_ps(at.cast(), v);
            }
        }
    }
}

/// The panel GEMM's micro-kernel, for `16 · MV` activation rows (the lanes) and `NR` weight
/// rows over `blocks` K-blocks of `ppb` pairs each:
/// `yt[r · yt_ld + i] += Σ_b (sx[b · sx_ld + i] · sw[r][b]) · Σ_{p in b} x_i pair p · w_r pair p`.
/// `a` holds the activations' pairs from [`act_pair_columns`] (row stride `a_ld`, already offset to
/// the first lane), `w` the weight rows decoded by [`decode_row`] (row stride `w_ld` words),
/// both starting at the first block. The block partials stay in `MV · NR` registers; the
/// running totals live in `yt`, touched once per block. With `overwrite`, the first block
/// starts them from zero instead of adding to what `yt` holds (the same bits as adding to a
/// zero-filled `yt`, without the fill).
///
/// # Safety
/// The CPU must have AVX-512 F / BW / VL / VBMI / BF16. The slices must hold what the strides
/// address (checked, panicking).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")]
// `b` and `r` index the K-blocks and weight rows of several arrays alike
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
pub(crate) unsafe fn gemm_tile<const MV: usize, const NR: usize>(
    a: &[u32],
    a_ld: usize,
    w: &[u16],
    w_ld: usize,
    sx: &[f32],
    sx_ld: usize,
    sw: [&[f32]; NR],
    (ppb, blocks): (usize, usize),
    yt: &mut [f32],
    yt_ld: usize,
    overwrite: bool,
) {
    let pairs = ppb * blocks;
    assert!(pairs > 0 && a.len() >= (pairs - 1) * a_ld + 16 * MV);
    assert!(w_ld >= 2 * pairs && w.len() >= (NR - 1) * w_ld + 2 * pairs);
    assert!(sx.len() >= (blocks - 1) * sx_ld + 16 * MV && sw.iter().all(|s| s.len() >= blocks));
    assert!(yt.len() >= (NR - 1) * yt_ld + 16 * MV);
    let (ap, wp, sxp, yp) = (a.as_ptr(), w.as_ptr(), sx.as_ptr(), yt.as_mut_ptr());
    for b in 0..blocks {
        let mut acc = [[_mm512_setzero_ps(); NR]; MV];
        for p in b * ppb..(b + 1) * ppb {
            // SAFETY (of every access below): inside the bounds asserted above.
            let av: [__m512bh; MV] = std::array::from_fn(|v| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    ap.add(p * a_ld + 16 * v).cast(),
                ))
            });
            for r in 0..NR {
                let pair = wp.add(r * w_ld + 2 * p).cast::<i32>().read_unaligned();
                let wv = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                for v in 0..MV {
                    acc[v][r] = _mm512_dpbf16_ps(acc[v][r], av[v], wv);
                }
            }
        }
        for (v, acc) in acc.iter().enumerate() {
            let sxv = _mm512_loadu_ps(sxp.add(b * sx_ld + 16 * v));
            for (r, acc) in acc.iter().enumerate() {
                // sx · sw rounded to f32 first, as in the GEMV kernels
                let s = _mm512_mul_ps(sxv, _mm512_set1_ps(sw[r][b]));
                let y = yp.add(r * yt_ld + 16 * v);
                let y0 = if overwrite && b == 0 {
                    _mm512_setzero_ps()
                } else {
                    _mm512_loadu_ps(y)
                };
                _mm512_storeu_ps(y, _mm512_fmadd_ps(*acc, s, y0));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::e4m3_to_f32;
    use crate::simd::Tier;

    #[test]
    fn the_table_holds_every_code_exactly() {
        for c in 0..=255u8 {
            let b = bf16_of(c & 0x7f) | (((c & 0x80) as u16) << 8);
            let v = f32::from_bits((b as u32) << 16);
            let want = e4m3_to_f32(c);
            if want.is_nan() {
                assert!(v.is_nan(), "code {c:#x}");
            } else {
                assert_eq!(v.to_bits(), want.to_bits(), "code {c:#x}: {v} vs {want}");
            }
        }
    }

    #[test]
    fn the_layout_is_a_permutation_of_each_step() {
        let mut seen = [false; STEP];
        for j in 0..STEP {
            assert!(
                !std::mem::replace(&mut seen[source_of(j)], true),
                "slot {j}"
            );
        }
    }

    /// The register builder gives the two-pass layout's words, NaN included, for blocks that
    /// split a step (bk < 64), end mid-step (200) or are whole steps, k not a multiple of bk,
    /// and m short of m_pad (in the first and in a later group of 16 rows).
    #[test]
    fn act_pair_columns_equals_the_two_passes() {
        if !bf16() {
            return;
        }
        for (m, k, bk, m_pad) in [
            (1usize, 1usize, 128usize, 16usize),
            (3, 100, 32, 16),
            (17, 576, 128, 32),
            (5, 3884, 128, 16),
            (2, 450, 200, 16),
            (16, 130, 64, 16),
            (35, 300, 128, 48),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| match i % 97 {
                    13 => f32::NAN,
                    // NaNs whose high half alone is no NaN (an Inf) or is negative: every NaN
                    // must become the one pattern
                    29 => f32::from_bits(0x7f80_0001),
                    41 => f32::from_bits(0xffc0_0000),
                    // e4m3 values: a few exponents and signs
                    r => e4m3_to_f32(((r * 37 + i / 7) % 126) as u8 | ((i % 3 == 0) as u8) << 7),
                })
                .collect();
            let want = pair_columns(&act_layout(&x, k, bk), m, m_pad);
            assert_eq!(
                {
                    // a dirty buffer: every element must be written
                    let mut out = vec![u32::MAX; k.div_ceil(bk) * block_words(bk) / 2 * m_pad];
                    // SAFETY: the test runs only where the tier was detected (checked above).
                    unsafe { act_pair_columns(&x, m, k, bk, m_pad, &mut out) };
                    out
                },
                want,
                "m {m} k {k} bk {bk}"
            );
        }
    }

    /// Whether the tier exists here; without it these kernel tests skip, saying so (most CI
    /// machines lack BF16; `tests/cpu_tiers.rs` runs every tier a machine has).
    fn bf16() -> bool {
        let ok = Tier::detected() >= Tier::Avx512Bf16;
        if !ok {
            eprintln!("skipped: no AVX512-BF16 / VBMI on this CPU, its kernel is untested here");
        }
        ok
    }

    /// `act_layout` puts every value at the slot `source_of` names (NaN as the quiet NaN, zeros
    /// past each block's end), for rows whose blocks are whole steps, partial steps and shorter
    /// than a step, several rows at once.
    #[test]
    fn act_layout_puts_each_value_where_source_of_says() {
        for (k, bk) in [
            (1usize, 128usize),
            (63, 64),
            (65, 64),
            (300, 200),
            (576, 128),
            (3884, 128),
        ] {
            let m = 3;
            let x: Vec<f32> = (0..m * k)
                .map(|i| match i % 97 {
                    13 => f32::NAN,
                    j => e4m3_to_f32((j * 7 % 126) as u8) * if i % 2 == 0 { 1.0 } else { -1.0 },
                })
                .collect();
            let got = act_layout(&x, k, bk);
            let bw = block_words(bk);
            let rw = k.div_ceil(bk) * bw;
            assert_eq!(got.len(), m * rw);
            for r in 0..m {
                for kb in 0..k.div_ceil(bk) {
                    let len = bk.min(k - kb * bk);
                    for slot in 0..bw {
                        let (s, j) = (slot / STEP, slot % STEP);
                        let pos = s * STEP + source_of(j);
                        let want = if pos < len {
                            bf16_bits(x[r * k + kb * bk + pos])
                        } else {
                            0
                        };
                        assert_eq!(
                            got[r * rw + kb * bw + slot],
                            want,
                            "k {k} bk {bk} row {r} block {kb} slot {slot}"
                        );
                    }
                }
            }
        }
    }

    /// `decode_row` writes each code's exact value at the slot `act_layout` gives its position,
    /// and zeros past each block's end over whatever the buffer held.
    #[test]
    fn decoded_row_is_in_the_activation_layout() {
        if !bf16() {
            return;
        }
        for (n, bk) in [(1usize, 128usize), (65, 64), (3884, 128), (300, 200)] {
            let w: Vec<u8> = (0..n)
                .map(|i| match ((i * 53 + 5) % 256) as u8 {
                    c if c & 0x7f == 0x7f => 0x7e,
                    c => c,
                })
                .collect();
            let mut d = vec![0xffffu16; n.div_ceil(bk) * block_words(bk)];
            // SAFETY: the tier was checked above; the buffers have the stated sizes.
            unsafe { decode_row(&w, n, bk, &mut d) };
            let values: Vec<f32> = w.iter().map(|&c| e4m3_to_f32(c)).collect();
            assert_eq!(d, act_layout(&values, n, bk), "n {n} bk {bk}");
        }
    }

    /// `dot_blocks` against f64 for four weight rows and one activation row at a time (every
    /// code but NaN, heterogeneous scales, K not a multiple of the block or step); the same rows
    /// as a batch (`M` = 2, 3, 4 with `R` = 2 or 4) give every pair the bits it gets alone; a
    /// NaN code makes its row NaN and no other.
    #[test]
    fn dot_blocks_matches_f64_batches_match_rows_and_nan_propagates() {
        if !bf16() {
            return;
        }
        for (n, bk) in [
            (1, 128),
            (63, 128),
            (64, 128),
            (65, 128),
            (3884, 128),
            (300, 96),
        ] {
            for (n, bk) in [(n, bk), (n, 64), (n, 200)] {
                // every code but NaN, in a scrambled order, so every table entry is used
                let code = |r: usize, i: usize| {
                    let c = ((i * 37 + r * 101 + 11) % 254) as u8;
                    if c & 0x7f == 0x7f {
                        0
                    } else {
                        c
                    }
                };
                let mut rows: Vec<Vec<u8>> = (0..4)
                    .map(|r| (0..n).map(|i| code(r, i)).collect())
                    .collect();
                // activations: e4m3 values, as the quantizer produces them
                let xs: Vec<Vec<f32>> = (0..4)
                    .map(|a| (0..n).map(|i| e4m3_to_f32(code(7 + a, i))).collect())
                    .collect();
                let kbs = n.div_ceil(bk);
                let scale = |r: usize| -> Vec<f32> {
                    (0..kbs)
                        .map(|b| 10f32.powi((b * 3 + r) as i32 % 7 - 3))
                        .collect()
                };
                let (sx, sw): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                    ((0..4).map(scale).collect(), (4..8).map(scale).collect());
                let xb: Vec<Vec<u16>> = xs.iter().map(|x| act_layout(x, n, bk)).collect();
                let wr = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
                let swr = [&sw[0][..], &sw[1], &sw[2], &sw[3]];
                let alone: Vec<[f32; 4]> = (0..4)
                    .map(|a| {
                        // SAFETY: the tier was checked above; the buffers have the stated sizes.
                        let [d] = unsafe {
                            dot_blocks::<4, 1>([&xb[a]], wr, n, bk, [&sx[a]], swr, wr[0].as_ptr())
                        };
                        d
                    })
                    .collect();
                for (a, got) in alone.iter().enumerate() {
                    for r in 0..4 {
                        let term = |i: usize| {
                            xs[a][i] as f64
                                * e4m3_to_f32(rows[r][i]) as f64
                                * (sx[a][i / bk] * sw[r][i / bk]) as f64
                        };
                        let want: f64 = (0..n).map(term).sum();
                        let mag: f64 = (0..n).map(|i| term(i).abs()).sum();
                        assert!(
                            (got[r] as f64 - want).abs() <= 1e-6 * mag.max(1e-30),
                            "n {n} bk {bk} [{a}][{r}]: {} vs {want}",
                            got[r]
                        );
                    }
                }
                let (xr, sxr) = (
                    [&xb[0][..], &xb[1], &xb[2], &xb[3]],
                    [&sx[0][..], &sx[1], &sx[2], &sx[3]],
                );
                let p = wr[0].as_ptr();
                // SAFETY (of the batched calls): as above.
                let b42 = unsafe {
                    dot_blocks::<2, 4>(xr, [wr[1], wr[3]], n, bk, sxr, [swr[1], swr[3]], p)
                };
                let b23 = unsafe {
                    dot_blocks::<2, 3>(
                        [xr[3], xr[0], xr[2]],
                        [wr[2], wr[0]],
                        n,
                        bk,
                        [sxr[3], sxr[0], sxr[2]],
                        [swr[2], swr[0]],
                        p,
                    )
                };
                let b24 = unsafe {
                    dot_blocks::<4, 2>([xr[2], xr[1]], wr, n, bk, [sxr[2], sxr[1]], swr, p)
                };
                let bits = |v: f32| v.to_bits();
                for a in 0..4 {
                    assert_eq!(
                        [bits(b42[a][0]), bits(b42[a][1])],
                        [bits(alone[a][1]), bits(alone[a][3])],
                        "n {n} bk {bk}"
                    );
                }
                for (j, a) in [3, 0, 2].into_iter().enumerate() {
                    assert_eq!(
                        [bits(b23[j][0]), bits(b23[j][1])],
                        [bits(alone[a][2]), bits(alone[a][0])],
                        "n {n} bk {bk}"
                    );
                }
                for (j, a) in [2, 1].into_iter().enumerate() {
                    assert_eq!(b24[j].map(bits), alone[a].map(bits), "n {n} bk {bk}");
                }
                if n >= 2 {
                    rows[2][0] = 0xff;
                    rows[3][n - 1] = 0x7f;
                    let wr = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
                    // SAFETY: as above.
                    let got = unsafe {
                        dot_blocks::<4, 2>([xr[0], xr[1]], wr, n, bk, [sxr[0], sxr[1]], swr, p)
                    };
                    for g in got {
                        assert!(!g[0].is_nan() && !g[1].is_nan(), "n {n}: {got:?}");
                        assert!(g[2].is_nan() && g[3].is_nan(), "n {n}: {got:?}");
                    }
                }
            }
        }
    }
}
