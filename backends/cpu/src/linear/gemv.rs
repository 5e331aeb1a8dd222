//! The GEMV variants of the decode kernel (M <= `GEMV_MAX_M`), one per tier and row count;
//! [`super::gemv_task`] picks one per task.

use super::*;

/// Dot product of f32 activations with fp8 codes, decoding in registers.
#[inline(always)]
fn dot_fp8<A: Arith>(x: &[f32], w: &[u8]) -> f32 {
    const L: usize = 16;
    let n = x.len().min(w.len());
    let (x, w) = (&x[..n], &w[..n]);
    let mut acc = [0f32; L];
    let (cx, cw) = (x.chunks_exact(L), w.chunks_exact(L));
    let (rx, rw) = (cx.remainder(), cw.remainder());
    for (a, b) in cx.zip(cw) {
        for i in 0..L {
            acc[i] = A::mul_add(a[i], e4m3_to_f32(b[i]), acc[i]);
        }
    }
    let mut tail = 0f32;
    for (a, b) in rx.iter().zip(rw) {
        tail = A::mul_add(*a, e4m3_to_f32(*b), tail);
    }
    acc.iter().sum::<f32>() + tail
}

/// Fills `yt [rows, m]` for weight rows `n0..` (overwriting it): one pass over those weight
/// rows.
#[inline(always)]
fn gemv_rows_impl<A: Arith>(
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
) {
    const CHUNK: usize = 256;
    let (m, k, kbs) = (s.m(), s.k(), s.k_blocks());
    let x = &xq.values[..];
    let mut buf = [0f32; CHUNK];
    let mut part = [0f32; GEMV_MAX_M];
    for (r, acc) in yt.chunks_exact_mut(m).enumerate() {
        // `yt` is a reused buffer (or the caller's output): start each sum from zero
        acc.fill(0.0);
        let n = n0 + r;
        let wrow = &w[n * k..(n + 1) * k];
        let sw_row = &sw[(n / s.bn()) * kbs..(n / s.bn() + 1) * kbs];
        for (kb, &swv) in sw_row.iter().enumerate() {
            let (k0, k1) = (kb * s.bk(), (kb * s.bk() + s.bk()).min(k));
            if m == 1 {
                let d = dot_fp8::<A>(&x[k0..k1], &wrow[k0..k1]);
                acc[0] += d * (xq.scale(0, kb) * swv);
                continue;
            }
            part[..m].fill(0.0);
            let mut c0 = k0;
            while c0 < k1 {
                let c1 = (c0 + CHUNK).min(k1);
                let b = &mut buf[..c1 - c0];
                decode_scaled(&wrow[c0..c1], 1.0, b);
                for (mi, p) in part[..m].iter_mut().enumerate() {
                    *p += dot::<A>(&x[mi * k + c0..mi * k + c1], b);
                }
                c0 = c1;
            }
            for (mi, a) in acc.iter_mut().enumerate() {
                *a += part[mi] * (xq.scale(mi, kb) * swv);
            }
        }
    }
}

simd_dispatch!(pub(super) fn gemv_rows => gemv_rows_impl(
    xq: &QuantizedAct<'_>, w: &[u8], sw: &[f32], s: LinearShape, n0: usize, yt: &mut [f32]
));

/// How far ahead of the four weight rows in flight the M = 1 kernels prefetch: the rows
/// `PREFETCH_ROWS` later, as one linear stream (the four rows are contiguous, so the kernel
/// walks `4·k` bytes per pass and the prefetch walks the same distance, 64 bytes per step).
/// Four interleaved streams of short rows (SmolLM2's 576 or 1536 codes) are more than the
/// hardware prefetcher follows: on the AVX2 EPYC (Zen 3, 2 vCPU) the decode of SmolLM2 with an
/// fp8 head went from 52 to 82 tok/s with it; 4 to 12 rows measured alike, 32 worse.
const PREFETCH_ROWS: usize = 8;

/// [`gemv_rows`] at M = 1 (`yt` is `[rows]`), on the AVX2 tier and up: four weight rows per
/// pass share each activation load, each decoded through F16C in registers (16 codes per step
/// on AVX2, 32 on AVX-512), with the rows [`PREFETCH_ROWS`] ahead prefetched.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv1_rows(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
    nan_free: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        /// The kernel's body, compiled into each tier's copy below; `WIDE` picks the AVX-512
        /// row kernel.
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn body<const WIDE: bool>(
            xq: &QuantizedAct<'_>,
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            nan_free: bool,
            prod: &mut [f32],
        ) {
            let (k, kbs) = (s.k(), s.k_blocks());
            let x = &xq.values[..];
            let rows = yt.len();
            let nb0 = scale_products(xq, sw, s, n0, prod);
            for r0 in (0..rows).step_by(4) {
                // a short last group repeats its last row rather than branching per row
                let n: [usize; 4] = lanes(|i| n0 + (r0 + i).min(rows - 1));
                let wr = lanes(|i| &w[n[i] * k..(n[i] + 1) * k]);
                let sc =
                    lanes(|i| &prod[(n[i] / s.bn() - nb0) * kbs..(n[i] / s.bn() - nb0 + 1) * kbs]);
                let ahead = w.as_ptr().wrapping_add((n0 + r0 + PREFETCH_ROWS) * k);
                // SAFETY: the callers below are compiled for the features of the kernel they
                // pick (AVX-512 F/BW/VL with WIDE, AVX2 + FMA + F16C in both), which they
                // checked the CPU has.
                let acc = unsafe {
                    match (WIDE, nan_free) {
                        (true, true) => {
                            crate::avx512::dot4_blocks::<false>(x, wr, s.bk(), sc, ahead)
                        }
                        (true, false) => {
                            crate::avx512::dot4_blocks::<true>(x, wr, s.bk(), sc, ahead)
                        }
                        (false, true) => crate::x86::dot4_blocks::<false>(x, wr, s.bk(), sc, ahead),
                        (false, false) => crate::x86::dot4_blocks::<true>(x, wr, s.bk(), sc, ahead),
                    }
                };
                // element by element: a `copy_from_slice` of a run-time length (at most 4) was
                // a `memmove` call per four rows
                for (y, &v) in yt[r0..].iter_mut().zip(&acc) {
                    *y = v;
                }
            }
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn run512(
            xq: &QuantizedAct<'_>,
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            nan_free: bool,
            prod: &mut [f32],
        ) {
            body::<true>(xq, w, sw, s, n0, yt, nan_free, prod)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn run(
            xq: &QuantizedAct<'_>,
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            nan_free: bool,
            prod: &mut [f32],
        ) {
            body::<false>(xq, w, sw, s, n0, yt, nan_free, prod)
        }
        // the scale products in this thread's kept buffer: a task of every GEMV call
        let plen = scale_products_len(s, n0, yt.len());
        if tier >= Tier::Avx512 {
            // SAFETY: `tier` came from `Tier::current()`, which is never above the detected
            // tier, and the AVX-512 tier is only detected with AVX-512 F/BW/VL, AVX2, FMA and
            // F16C present.
            return with_f32(plen, |p| unsafe {
                run512(xq, w, sw, s, n0, yt, nan_free, p)
            });
        }
        if tier >= Tier::Avx2 {
            // SAFETY: as above; the AVX2 tier is only detected with AVX2, FMA and F16C present.
            return with_f32(plen, |p| unsafe { run(xq, w, sw, s, n0, yt, nan_free, p) });
        }
    }
    gemv_rows(xq, w, sw, s, n0, yt)
}

/// For the weight-row blocks of rows `n0..n0 + rows` (from block `nb0`, returned): the M = 1
/// activation scale times the weight scale of each K-block, `[blocks, k_blocks]`, into `prod`
/// ([`scale_products_len`] floats).
fn scale_products(
    xq: &QuantizedAct<'_>,
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    prod: &mut [f32],
) -> usize {
    let kbs = s.k_blocks();
    let nb0 = n0 / s.bn();
    for (i, p) in prod.chunks_exact_mut(kbs).enumerate() {
        for (kb, v) in p.iter_mut().enumerate() {
            *v = xq.scale(0, kb) * sw[(nb0 + i) * kbs + kb];
        }
    }
    nb0
}

/// The floats [`scale_products`] writes for rows `n0..n0 + rows` (`rows >= 1`).
fn scale_products_len(s: LinearShape, n0: usize, rows: usize) -> usize {
    ((n0 + rows - 1) / s.bn() + 1 - n0 / s.bn()) * s.k_blocks()
}

/// [`gemv_rows`] on the AVX512-BF16 tier, with the activations in that tier's layout (`xb`,
/// from [`gemv_bf16_act`]; `yt` is `[rows, m]`): weight rows decoded by table lookup in
/// registers (`avx512bf16::dot_blocks`), four per pass at M = 1, two per pass for up to four
/// activation rows at a time above it, each (row, row, K-block) partial scaled by `sx · sw`. A
/// row of a batch gets the bits it gets at M = 1.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv_rows_bf16(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    xb: &[u16],
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if tier >= Tier::Avx512Bf16 {
        use crate::avx512bf16::{block_words, dot_blocks};
        let (m, k, bk, kbs) = (s.m(), s.k(), s.bk(), s.k_blocks());
        let rw = kbs * block_words(bk);
        let rows = yt.len() / m;
        let x_row = |i: usize| &xb[i * rw..(i + 1) * rw];
        let sx_row = |i: usize| &xq.scales[(i / xq.rows_per_scale) * kbs..][..kbs];
        let sw_row = |n: usize| &sw[(n / s.bn()) * kbs..][..kbs];
        let w_row = |n: usize| &w[n * k..(n + 1) * k];
        if m == 1 {
            for r0 in (0..rows).step_by(4) {
                // a short last group repeats its last row rather than branching per row
                let n: [usize; 4] = lanes(|i| n0 + (r0 + i).min(rows - 1));
                let ahead = w.as_ptr().wrapping_add((n0 + r0 + PREFETCH_ROWS) * k);
                // SAFETY: `tier` came from `Tier::current()`, never above the detected tier,
                // and that tier is only detected with AVX-512 F/BW/VL/VBMI/BF16; `xb` was laid
                // out for this shape by `gemv_bf16_act`, every row holds `k` codes and every
                // scale row `kbs` entries.
                let d = unsafe {
                    dot_blocks::<4, 1>(
                        [x_row(0)],
                        lanes(|i| w_row(n[i])),
                        k,
                        bk,
                        [sx_row(0)],
                        lanes(|i| sw_row(n[i])),
                        ahead,
                    )
                };
                // element by element, as in `gemv1_rows`
                for (y, &v) in yt[r0..].iter_mut().zip(&d[0]) {
                    *y = v;
                }
            }
            return;
        }
        for r0 in (0..rows).step_by(2) {
            let n: [usize; 2] = lanes(|j| n0 + (r0 + j).min(rows - 1));
            let (wr, swr) = (lanes(|j| w_row(n[j])), lanes(|j| sw_row(n[j])));
            let ahead = w.as_ptr().wrapping_add((n0 + r0 + PREFETCH_ROWS) * k);
            for i0 in (0..m).step_by(4) {
                let xr = |x: usize| x_row(i0 + x);
                let sxr = |x: usize| sx_row(i0 + x);
                // weight rows r0, r0 + 1 (those that exist) times activation rows i0..i0 + $g
                macro_rules! group {
                    ($g:literal) => {{
                        // SAFETY: as above.
                        let d = unsafe {
                            dot_blocks::<2, $g>(lanes(xr), wr, k, bk, lanes(sxr), swr, ahead)
                        };
                        for (x, d) in d.iter().enumerate() {
                            for (j, &v) in d.iter().enumerate().take(rows - r0) {
                                yt[(r0 + j) * m + i0 + x] = v;
                            }
                        }
                    }};
                }
                match m - i0 {
                    1 => group!(1),
                    2 => group!(2),
                    3 => group!(3),
                    _ => group!(4),
                }
            }
        }
        return;
    }
    // `gemv_bf16_act` lays the activations out only on that tier
    let _ = (tier, xq, xb, w, sw, s, n0, yt);
    unreachable!("the bf16 layout exists only on the AVX512-BF16 tier")
}

/// [`gemv_rows`] for 2..=[`super::GEMV_REG_MAX_M`] rows on the AVX2 tier and up, with the
/// activations as their e4m3 values and scales (`yt` is `[rows, m]`): each weight row decoded
/// in registers once per four activation rows (`x86::dot_blocks`, as the M = 1 kernel decodes
/// it), each (row, row, K-block) partial scaled by `sx · sw`, so on the AVX2 tier a row of a
/// batch gets the bits it gets at M = 1. Past a few rows, decoding once into a buffer
/// ([`gemv_small_rows`]) costs less than decoding once per four rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv_rows_regs(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
    nan_free: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn run<const CHECK_NAN: bool>(
            xq: &QuantizedAct<'_>,
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
        ) {
            use crate::x86::dot_blocks;
            let (m, k, bk, kbs) = (s.m(), s.k(), s.bk(), s.k_blocks());
            let rows = yt.len() / m;
            for r in 0..rows {
                let n = n0 + r;
                let wr = [&w[n * k..(n + 1) * k]];
                let swr = &sw[(n / s.bn()) * kbs..][..kbs];
                let ahead = w.as_ptr().wrapping_add((n + PREFETCH_ROWS) * k);
                let xr = |a: usize| &xq.values[a * k..(a + 1) * k];
                let scale = |a: usize, _: usize, kb: usize| xq.scale(a, kb) * swr[kb];
                let out = &mut yt[r * m..(r + 1) * m];
                macro_rules! all_rows {
                    ($m:literal) => {{
                        // SAFETY: this function is compiled for AVX2 + FMA + F16C, which the
                        // caller checked the CPU has.
                        let d = unsafe {
                            dot_blocks::<1, $m, CHECK_NAN>(lanes(xr), wr, bk, scale, ahead)
                        };
                        for (o, d) in out.iter_mut().zip(d) {
                            *o = d[0];
                        }
                    }};
                }
                // all activation rows in one call: `gemv_task` runs this for 2..=4 rows
                const { assert!(super::GEMV_REG_MAX_M == 4) };
                match m {
                    2 => all_rows!(2),
                    3 => all_rows!(3),
                    _ => all_rows!(4),
                }
            }
        }
        if tier >= Tier::Avx2 {
            // SAFETY: `tier` came from `Tier::current()`, which is never above the detected
            // tier, and the AVX2 tier is only detected with AVX2, FMA and F16C present.
            return unsafe {
                if nan_free {
                    run::<false>(xq, w, sw, s, n0, yt)
                } else {
                    run::<true>(xq, w, sw, s, n0, yt)
                }
            };
        }
    }
    // callers take this path only with an AVX2 `tier`, the value passed here
    let _ = (tier, xq, w, sw, s, n0, yt, nan_free);
    unreachable!("gemv_rows_regs runs on the AVX2 tier only")
}

/// [`gemv_rows`] for `m > GEMV_REG_MAX_M` on the AVX2 tier and up (`yt` is `[rows, m]`, `xd`
/// the activations already multiplied by their scales): three weight rows at a time are decoded
/// with their block scales into `buf`, then multiplied with four activation rows at a time in
/// registers. Scaling each factor by its own block scale before the product is the contract's
/// per-K-block scaling, distributed over the sum, as in the panel GEMM. The AVX-512 tier runs
/// the same 256-bit code, decode included: on an Ice Lake-class Xeon a 16-lane `dot_4x3` (now
/// `dot_mx3`) measured 10-25% slower, and the 16-lane row decode alone ~10% slower at M = 16
/// (not profiled further; a lower clock under 512-bit instructions would explain it).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv_small_rows(
    tier: Tier,
    xd: &[f32],
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
    buf: &mut [f32],
    nan_free: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn run(
            xd: &[f32],
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            buf: &mut [f32],
            nan_free: bool,
        ) {
            let (m, k) = (s.m(), s.k());
            let rows = yt.len() / m;
            for g0 in (0..rows).step_by(3) {
                // a short last group repeats its last row rather than branching per row
                let r: [usize; 3] = lanes(|j| (g0 + j).min(rows - 1));
                for (j, dst) in buf[..3 * k].chunks_exact_mut(k).enumerate() {
                    dequant_row(w, sw, s, n0 + r[j], dst, nan_free);
                }
                let wr = [&buf[..k], &buf[k..2 * k], &buf[2 * k..3 * k]];
                for i0 in (0..m).step_by(4) {
                    let xr = |i: usize| &xd[(i0 + i) * k..(i0 + i + 1) * k];
                    let put = |d: &[[f32; 3]], yt: &mut [f32]| {
                        for (j, _) in r.iter().enumerate().take(rows - g0) {
                            for (i, row) in d.iter().enumerate() {
                                yt[(g0 + j) * m + i0 + i] = row[j];
                            }
                        }
                    };
                    // the last group of activation rows as it is, not padded to four (half the
                    // products at M = 2; the row decode above dominates: 1536 x 576 from memory
                    // at M = 2, AVX2 tier capped on Zen 4, 0.165 -> 0.149 ms)
                    // SAFETY (of the calls): this function is compiled for AVX2 + FMA + F16C,
                    // which the caller checked the CPU has.
                    match m - i0 {
                        1 => put(&unsafe { crate::x86::dot_mx3::<1>(lanes(xr), wr) }, yt),
                        2 => put(&unsafe { crate::x86::dot_mx3::<2>(lanes(xr), wr) }, yt),
                        3 => put(&unsafe { crate::x86::dot_mx3::<3>(lanes(xr), wr) }, yt),
                        _ => put(&unsafe { crate::x86::dot_mx3::<4>(lanes(xr), wr) }, yt),
                    }
                }
            }
        }
        if tier >= Tier::Avx2 {
            // SAFETY: `tier` came from `Tier::current()`, which is never above the detected
            // tier, and the AVX2 tier is only detected with AVX2, FMA and F16C present.
            return unsafe { run(xd, w, sw, s, n0, yt, buf, nan_free) };
        }
    }
    // callers take this path only with an AVX2 `tier`, the value passed here
    let _ = (tier, xd, w, sw, s, n0, yt, buf, nan_free);
    unreachable!("gemv_small_rows runs on the AVX2 tier only")
}

/// Weight row `n` decoded and multiplied by its block scales into `dst [k]`, by the AVX2
/// decoder on every tier that has it (the caller's tier).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dequant_row(
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n: usize,
    dst: &mut [f32],
    nan_free: bool,
) {
    let kbs = s.k_blocks();
    for kb in 0..kbs {
        let (k0, k1) = (kb * s.bk(), (kb * s.bk() + s.bk()).min(s.k()));
        let (src, scale) = (
            &w[n * s.k() + k0..n * s.k() + k1],
            sw[(n / s.bn()) * kbs + kb],
        );
        // SAFETY: this function is compiled for AVX2 + FMA + F16C, which its caller (compiled
        // for them itself) checked the CPU has.
        unsafe {
            if nan_free {
                crate::x86::decode_scaled_nan_free(src, scale, &mut dst[k0..k1])
            } else {
                crate::x86::decode_scaled(src, scale, &mut dst[k0..k1])
            }
        };
    }
}
