//! The panel GEMMs: f32 panels through the `gemm` crate, and bf16 pairs on AVX512-BF16.

use std::marker::PhantomData;

use super::*;

/// Weight rows per panel (at most) and K columns per tile: a 128 x 512 f32 tile (256 KiB) stays
/// in a 512 KiB L2 while `gemm` packs it, with room for the activations it streams (a 256 x 1024
/// tile, 1 MiB, measured 5-15% slower on such a core), and each `gemm` call is still large
/// enough that packing costs little next to the multiply.
const PANEL_ROWS: usize = 128;
const TILE_K: usize = 512;

/// Writes `codes * block scale` of weight rows `n0..n0 + rows`, columns `c0..c1`, into
/// `buf [rows, c1 - c0]`; `nan_free_avx2`: the codes hold no NaN
/// ([`LinearPlan::assume_nan_free`]) and the call's tier is AVX2, so its decoder skips the NaN
/// scan (the same values for such codes).
#[allow(clippy::too_many_arguments)]
fn dequant_tile(
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    c0: usize,
    c1: usize,
    buf: &mut [f32],
    nan_free_avx2: bool,
) {
    let decode = |src: &[u8], scale: f32, dst: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if nan_free_avx2 {
            // SAFETY: set only for a call planned on the AVX2 tier, which is only detected
            // with AVX2, FMA and F16C present.
            return unsafe { crate::x86::decode_scaled_nan_free(src, scale, dst) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = nan_free_avx2;
        decode_scaled(src, scale, dst)
    };
    let kbs = s.k_blocks();
    for (r, row) in buf.chunks_exact_mut(c1 - c0).enumerate() {
        let n = n0 + r;
        let mut c = c0;
        while c < c1 {
            let kb = c / s.bk();
            let end = ((kb + 1) * s.bk()).min(c1);
            let scale = sw[(n / s.bn()) * kbs + kb];
            let (src, dst) = (
                &w[n * s.k() + c..n * s.k() + end],
                &mut row[c - c0..end - c0],
            );
            decode(src, scale, dst);
            c = end;
        }
    }
}

pub(super) fn panel_gemm(
    x: &[f32],
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    out: &mut [f32],
    tier: Tier,
    nan_free: bool,
) {
    // the AVX-512 tier keeps its own (NaN-checking) decoder: only the AVX2 one was measured
    let nan_free_avx2 = nan_free && tier == Tier::Avx2;
    let threads = rayon::current_num_threads();
    // a multiple of `threads` panels of at most PANEL_ROWS rows, so every thread gets the same
    // number of equal panels (the last may be a little shorter)
    let panels = s.n().div_ceil(threads * PANEL_ROWS) * threads;
    let p = s.n().div_ceil(panels);
    // K in equal tiles of about TILE_K (576 is one tile, not 512 + a thin 64 whose product
    // would re-read and re-write the whole output block for little work)
    let kc = s
        .k()
        .div_ceil((s.k() as f64 / TILE_K as f64).round().max(1.0) as usize);
    let per_panel = s.n().div_ceil(p) >= threads;
    let inner = if per_panel {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(threads)
    };
    let dst = OutCols::new(out, s.m(), s.n());
    // panel i computes columns i·p.. of every output row, straight into `out`
    let panel = |i: usize, buf: &mut [f32]| {
        let (col0, rows) = (i * p, p.min(s.n() - i * p));
        for c0 in (0..s.k()).step_by(kc) {
            let c1 = (c0 + kc).min(s.k());
            let tile = &mut buf[..rows * (c1 - c0)];
            dequant_tile(w, sw, s, col0, c0, c1, tile, nan_free_avx2);
            let lhs = Operand {
                data: &x[c0..],
                ld: s.k(),
            };
            let rhs = Operand {
                data: tile,
                ld: c1 - c0,
            };
            // SAFETY: panel i alone writes columns col0..col0 + rows (the panels split 0..n).
            unsafe { gemm_nt(s.m(), rows, c1 - c0, lhs, rhs, dst, col0, c0 > 0, inner) };
        }
    };
    let count = s.n().div_ceil(p);
    if per_panel {
        (0..count)
            .into_par_iter()
            .for_each(|i| with_f32(p * kc, |buf| panel(i, buf)));
    } else {
        with_f32(p * kc, |buf| (0..count).for_each(|i| panel(i, buf)));
    }
}

/// The output `[m, n]` (row-major) of [`panel_gemm`], written by all its panels at once, each
/// to its own columns: a raw pointer, because each panel's columns are strided through every
/// row (no split of `&mut [f32]` hands them out), and writing them in place saves the copy of
/// a per-panel block into `out` (1.7% of a 512-token prefill's samples). It holds the
/// output's `&mut` borrow for its lifetime, so nothing else touches the output meanwhile.
#[derive(Clone, Copy)]
struct OutCols<'a> {
    ptr: *mut f32,
    m: usize,
    n: usize,
    _out: PhantomData<&'a mut [f32]>,
}

// SAFETY: an `OutCols` is only written through `gemm_nt` and `put_transposed`, whose callers
// guarantee that no two threads touch the same columns, and it borrows the output exclusively
// while it lives.
unsafe impl Send for OutCols<'_> {}
// SAFETY: as for `Send`: shared references only lead to disjoint column writes.
unsafe impl Sync for OutCols<'_> {}

impl<'a> OutCols<'a> {
    fn new(out: &'a mut [f32], m: usize, n: usize) -> Self {
        assert_eq!(out.len(), m * n, "out is [m, n]");
        Self {
            ptr: out.as_mut_ptr(),
            m,
            n,
            _out: PhantomData,
        }
    }
    /// Writes the transposed panel `yt [cols, m_pad]` (column `j`'s `m` values from
    /// `yt[j · m_pad]`) into columns `col0..col0 + cols` of every row: 16 x 16 blocks through
    /// [`transpose16`](crate::avx512::transpose16), the last `cols % 16` columns one by one.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F. No other thread reads or writes these columns during the
    /// call.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn put_transposed(&self, col0: usize, cols: usize, yt: &[f32], m_pad: usize) {
        assert!(col0 + cols <= self.n && m_pad >= self.m && yt.len() >= cols * m_pad);
        let c16 = cols - cols % 16;
        for m0 in (0..self.m).step_by(16) {
            let nr = 16.min(self.m - m0);
            // SAFETY: rows m0..m0 + nr < m and columns col0..col0 + cols < n lie inside the
            // [m, n] output this borrows; the caller owns these columns.
            let row0 = self.ptr.add(m0 * self.n + col0);
            for j0 in (0..c16).step_by(16) {
                crate::avx512::transpose16(&yt[j0 * m_pad + m0..], m_pad, row0.add(j0), self.n, nr);
            }
            for j in c16..cols {
                for r in 0..nr {
                    *row0.add(r * self.n + j) = yt[j * m_pad + m0 + r];
                }
            }
        }
    }
}

/// Weight rows per micro-kernel call of [`panel_gemm_bf16`]: with two vectors of 16 activation
/// rows that is 24 accumulators of the 32 vector registers, two activation loads and 12
/// broadcast weight pairs per 24 `vdpbf16ps`.
const BF16_NR: usize = 12;

/// Bytes of decoded weights per row group (`BF16_NR` rows) in a bf16 panel GEMM of one 16-row
/// tile: half of a 1 MiB L2, so whole rows of K up to 21,760 codes.
const BF16_DECODE_TILE: usize = 512 << 10;

/// [`gemm_tile`](crate::avx512bf16::gemm_tile) for one row-tile height, `BF16_NR` weight rows.
#[cfg(target_arch = "x86_64")]
type TileFn = unsafe fn(
    &[u32],
    usize,
    &[u16],
    usize,
    &[f32],
    usize,
    [&[f32]; BF16_NR],
    (usize, usize),
    &mut [f32],
    usize,
    bool,
);

/// The panel GEMM on the AVX512-BF16 tier, for W8A8 (`xq` holds the e4m3 values, not
/// dequantized): the same panels of weight rows per thread as [`panel_gemm`], but each K tile
/// of whole blocks is decoded to bf16 without its scale (exact), `BF16_NR` weight rows at a
/// time, and multiplied by [`gemm_tile`](crate::avx512bf16::gemm_tile) with the activations in
/// bf16 pairs, and each (row, row, K-block) partial is scaled by `sx · sw` as in the GEMV.
/// `vdpbf16ps` does twice the multiplies of an f32 FMA, and the per-block scaling costs one
/// FMA per 64 of them at 128-wide blocks.
pub(super) fn panel_gemm_bf16(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if tier >= Tier::Avx512Bf16 {
        use crate::avx512bf16::{act_pair_columns, block_words, decode_row, gemm_tile};
        let (m, n, k, bk, kbs) = (s.m(), s.n(), s.k(), s.bk(), s.k_blocks());
        let (bw, m_pad) = (block_words(bk), m.next_multiple_of(16));
        let ppb = bw / 2;
        with_buf(kbs * bw / 2 * m_pad, |a: &mut [u32]| {
            // SAFETY: `tier` came from `Tier::current()`: this tier has AVX-512 F and BW.
            unsafe { act_pair_columns(&xq.values[..m * k], m, k, bk, m_pad, a) };
            let a = &*a;
            // the activation scales as columns too, zeros for the padding rows (in a kept
            // buffer: a batched decode step runs this path)
            with_f32(kbs * m_pad, |sxt| {
                for (kb, col) in sxt.chunks_exact_mut(m_pad).enumerate() {
                    for (i, v) in col.iter_mut().enumerate() {
                        *v = if i < m { xq.scale(i, kb) } else { 0.0 };
                    }
                }
                let sxt = &*sxt;
                let threads = rayon::current_num_threads();
                let panels = n.div_ceil(threads * PANEL_ROWS) * threads;
                let p = n.div_ceil(panels).next_multiple_of(BF16_NR);
                // K tiles of whole blocks, all of about the same size: about TILE_K codes, so that
                // the activations' tile stays in L2 across the panel's row groups; with one tile of
                // 16 rows (a decode step) the activations are small and each decoded weight is
                // used once, so as many blocks as keep a row group's decoded tile within
                // BF16_DECODE_TILE bytes: each weight row is then decoded in one pass over its
                // codes, not in strided segments (16-sequence decode 375 -> 410 tok/s, Zen 4;
                // `linear_time 16 2048 5632 10` 2.01 -> 1.63 ms when the limit went from the
                // panel's rows to one group's)
                let per_tile = if m_pad == 16 {
                    (BF16_DECODE_TILE / (BF16_NR * bw * 2)).max(1)
                } else {
                    (TILE_K as f64 / bw as f64).round().max(1.0) as usize
                };
                let per_tile = kbs.div_ceil(kbs.div_ceil(per_tile));
                let dst = OutCols::new(out, m, n);
                // panel i computes its rows i·p.. of the transposed output in a [p, m_pad] scratch
                // (the rows past the weight's end multiply zero weights and are dropped), then puts
                // them in columns i·p.. of every output row: one parallel region per call
                (0..n.div_ceil(p)).into_par_iter().for_each(|i| {
                    let (n0, rows) = (i * p, p.min(n - i * p));
                    with_f32(p * m_pad, |yt| {
                        with_buf(BF16_NR * per_tile * bw, |wt: &mut [u16]| {
                            for kb0 in (0..kbs).step_by(per_tile) {
                                let nb = per_tile.min(kbs - kb0);
                                let (c0, c1, tw) = (kb0 * bk, ((kb0 + nb) * bk).min(k), nb * bw);
                                // groups wholly past the weight's end are skipped: their yt rows
                                // are never put
                                for g in (0..rows).step_by(BF16_NR) {
                                    // this group's rows decoded right before their products, which
                                    // then read them from L1 (or L2 for long rows) instead of the
                                    // whole panel's tile from L2 (M = 128, N = K = 4096: 12.7 ->
                                    // 12.1 ms, Zen 4); rows past the weight's end are zeros
                                    for (r, dst) in
                                        wt.chunks_exact_mut(tw).take(BF16_NR).enumerate()
                                    {
                                        if g + r >= rows {
                                            dst.fill(0);
                                            continue;
                                        }
                                        let row = &w[(n0 + g + r) * k..(n0 + g + r + 1) * k];
                                        // SAFETY: `tier` came from `Tier::current()`, never above
                                        // the detected tier, which needs AVX-512 F/BW/VL/VBMI/BF16;
                                        // `dst` holds the nb blocks of c1 - c0 codes.
                                        unsafe { decode_row(&row[c0..c1], c1 - c0, bk, dst) };
                                    }
                                    // the next group's codes on their way while this one
                                    // multiplies (with the decode moved next to the products,
                                    // nothing else overlaps their arrival from memory)
                                    for r in
                                        (g + BF16_NR..g + 2 * BF16_NR).take_while(|&r| r < rows)
                                    {
                                        crate::x86::prefetch_bytes(
                                            w[(n0 + r) * k + c0..].as_ptr(),
                                            c1 - c0,
                                        );
                                    }
                                    let swr: [&[f32]; BF16_NR] = std::array::from_fn(|r| {
                                        let o = ((n0 + g + r).min(n - 1) / s.bn()) * kbs + kb0;
                                        &sw[o..o + nb]
                                    });
                                    let wg = &wt[..BF16_NR * tw];
                                    let ytg = &mut yt[g * m_pad..];
                                    let mut m0 = 0;
                                    while m0 < m_pad {
                                        // tiles of 32 rows, and one of 16 where m_pad leaves it
                                        let (tile_m, tile) = if m_pad - m0 >= 32 {
                                            (32, gemm_tile::<2, BF16_NR> as TileFn)
                                        } else {
                                            (16, gemm_tile::<1, BF16_NR> as TileFn)
                                        };
                                        let (ao, so) = (kb0 * ppb * m_pad + m0, kb0 * m_pad + m0);
                                        let (a, sx) = (&a[ao..], &sxt[so..]);
                                        let yg = &mut ytg[m0..];
                                        // the first K tile writes yt's panel, no zero fill first
                                        let first = kb0 == 0;
                                        // SAFETY: as above for the tier; every slice holds what the
                                        // strides address from its offset (checked by the kernel).
                                        unsafe {
                                            tile(
                                                a,
                                                m_pad,
                                                wg,
                                                tw,
                                                sx,
                                                m_pad,
                                                swr,
                                                (ppb, nb),
                                                yg,
                                                m_pad,
                                                first,
                                            )
                                        };
                                        m0 += tile_m;
                                    }
                                }
                            }
                        });
                        // SAFETY: the AVX512-BF16 tier includes AVX-512 F; panel i alone writes
                        // columns n0..n0 + rows.
                        unsafe { dst.put_transposed(n0, rows, yt, m_pad) };
                    });
                });
            });
        });
        return;
    }
    // `uses_bf16` picks this path only on that tier
    let _ = (tier, xq, w, sw, s, out);
    unreachable!("the bf16 panel GEMM runs on the AVX512-BF16 tier only")
}

/// A row-major matrix operand: row `r` starts at `data[r * ld]`.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [f32],
    ld: usize,
}

/// `dst[i, col0 + j] (+)= Σ_kk lhs[i, kk] · rhs[j, kk]` for `i < m, j < p, kk < k`: lhs `[m, k]`
/// and rhs `[p, k]` row-major, `dst` the `[m, n]` output.
///
/// # Safety
/// No other thread reads or writes columns `col0..col0 + p` of `dst` during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_nt(
    m: usize,
    p: usize,
    k: usize,
    lhs: Operand<'_>,
    rhs: Operand<'_>,
    dst: OutCols<'_>,
    col0: usize,
    accumulate: bool,
    par: gemm::Parallelism,
) {
    assert!(m > 0 && p > 0 && k > 0 && lhs.ld >= k && rhs.ld >= k);
    assert!(lhs.data.len() >= (m - 1) * lhs.ld + k);
    assert!(rhs.data.len() >= (p - 1) * rhs.ld + k);
    assert!(m <= dst.m && col0 + p <= dst.n);
    // SAFETY: the asserts above bound every element the strides address inside the two input
    // slices and the [m, n] output; the caller guarantees the output columns are this call's
    // alone, so gemm touches only memory it may.
    unsafe {
        gemm::gemm(
            m,
            p,
            k,
            dst.ptr.add(col0),
            1,
            dst.n as isize,
            accumulate,
            lhs.data.as_ptr(),
            1,
            lhs.ld as isize,
            rhs.data.as_ptr(),
            rhs.ld as isize,
            1,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}
