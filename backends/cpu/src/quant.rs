//! Weight quantization and dynamic activation quantization (docs/numerics.md, "Quantization", "Weights", "Activations").

use std::borrow::Cow;

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Error, Result};
use crate::fp8::{fake_quant_slice, quantize, scale_for_amax};
use fp8nsa_types::{ActQuant, ScaleDType};

/// Largest finite magnitude in `xs` (NaN and ±Inf ignored), and whether `xs` holds any NaN or
/// ±Inf. Eight independent lanes let it vectorize (a single running `max` is a serial chain
/// LLVM keeps scalar).
fn amax(xs: &[f32]) -> (f32, bool) {
    let mut lanes = [0f32; 8];
    let mut bad = [0u32; 8];
    let step = |l: &mut f32, b: &mut u32, x: f32| {
        let a = x.abs();
        let finite = a < f32::INFINITY; // false for NaN too
        *l = l.max(if finite { a } else { 0.0 });
        *b |= !finite as u32;
    };
    let chunks = xs.chunks_exact(8);
    let (mut tail, mut tail_bad) = (0f32, 0u32);
    for &x in chunks.remainder() {
        step(&mut tail, &mut tail_bad, x);
    }
    for c in chunks {
        for ((l, b), &x) in lanes.iter_mut().zip(&mut bad).zip(c) {
            step(l, b, x);
        }
    }
    let any_bad = bad.iter().fold(tail_bad, |a, &b| a | b) != 0;
    (lanes.iter().fold(tail, |a, &l| a.max(l)), any_bad)
}

/// Quantizes a row-major `[n, k]` weight in `bn x bk` blocks (edge blocks partial).
/// Returns the e4m3fn codes `[n, k]` and the dequantization scales `[ceil(n/bn), ceil(k/bk)]`.
pub fn quantize_weight(
    w: &[f32],
    n: usize,
    k: usize,
    bn: usize,
    bk: usize,
) -> Result<(Vec<u8>, Vec<f32>)> {
    quantize_weight_as(w, n, k, bn, bk, ScaleDType::F32)
}

/// [`quantize_weight`] with scales that `scale_dtype` stores exactly: each block's f32 scale is
/// rounded up to that dtype ([`ScaleDType::round_up`]) before its codes are computed, so the
/// codes match the scale a checkpoint keeps.
pub fn quantize_weight_as(
    w: &[f32],
    n: usize,
    k: usize,
    bn: usize,
    bk: usize,
    scale_dtype: ScaleDType,
) -> Result<(Vec<u8>, Vec<f32>)> {
    for (arg, v) in [("n", n), ("k", k), ("bn", bn), ("bk", bk)] {
        check_positive(arg, v)?;
    }
    check_len("weight", w.len(), n * k)?;
    // the amax below skips NaN and ±Inf (right for activations): a weight holding one is
    // corrupt and refused here (docs/numerics.md, non-finite values)
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(Error::Invalid {
            arg: "weight",
            msg: format!(
                "element [{}, {}] is {}: weights must be finite",
                i / k,
                i % k,
                w[i]
            ),
        });
    }
    // a block larger than the matrix is the matrix (and keeps bn * k from overflowing)
    let (bn, bk) = (bn.min(n), bk.min(k));
    let kbs = k.div_ceil(bk);
    let mut codes = vec![0u8; n * k];
    let mut scales = vec![0f32; n.div_ceil(bn) * kbs];
    codes
        .par_chunks_mut(bn * k)
        .zip(w.par_chunks(bn * k))
        .zip(scales.par_chunks_mut(kbs))
        .for_each(|((codes, w), scales)| {
            let rows = w.len() / k;
            for (kb, s) in scales.iter_mut().enumerate() {
                let (k0, k1) = (kb * bk, (kb * bk + bk).min(k));
                let a = (0..rows).fold(0f32, |a, r| a.max(amax(&w[r * k + k0..r * k + k1]).0));
                *s = scale_dtype.round_up(scale_for_amax(a));
                for r in 0..rows {
                    for i in r * k + k0..r * k + k1 {
                        codes[i] = quantize(w[i], *s);
                    }
                }
            }
        });
    Ok((codes, scales))
}

/// Activations after dynamic quantization.
///
/// `values` holds the fp8 values decoded to f32 (exact), or, when built with `dequantize`, those
/// values already multiplied by their scale. For [`ActQuant::None`] it borrows the input.
#[derive(Debug, Clone)]
pub struct QuantizedAct<'a> {
    pub values: Cow<'a, [f32]>,
    /// `[ceil(m / rows_per_scale), k_blocks]`, row-major.
    pub scales: Cow<'a, [f32]>,
    pub rows_per_scale: usize,
    pub k_blocks: usize,
}

impl<'a> QuantizedAct<'a> {
    fn new(
        values: Cow<'a, [f32]>,
        scales: Cow<'a, [f32]>,
        rows_per_scale: usize,
        k: usize,
        bk: usize,
    ) -> Self {
        Self {
            values,
            scales,
            rows_per_scale,
            k_blocks: k.div_ceil(bk),
        }
    }

    /// The scale of row `row`, K-block `kb`.
    #[inline]
    pub fn scale(&self, row: usize, kb: usize) -> f32 {
        self.scales[(row / self.rows_per_scale) * self.k_blocks + kb]
    }
}

/// Quantizes row-major activations `x: [m, k]` with K-groups of width `bk`.
pub fn quantize_act(
    x: &[f32],
    m: usize,
    k: usize,
    bk: usize,
    mode: ActQuant,
    dequantize: bool,
) -> Result<QuantizedAct<'_>> {
    if mode == ActQuant::None {
        return quantize_act_in(x, m, k, bk, mode, dequantize, &mut []);
    }
    let mut values = vec![0f32; x.len()];
    let mut scales = vec![0f32; act_scales_len(m, k, bk, mode)?];
    let (_, rows) = quantize_core(x, m, k, bk, mode, dequantize, &mut values, &mut scales)?;
    Ok(QuantizedAct::new(
        Cow::Owned(values),
        Cow::Owned(scales),
        rows,
        k,
        bk,
    ))
}

/// [`quantize_act`] writing the values into `buf` (`m * k` long, its contents overwritten), so a
/// caller can reuse one buffer across calls. [`ActQuant::None`] leaves `buf` alone (it may be
/// empty) and borrows `x`.
pub fn quantize_act_in<'a>(
    x: &'a [f32],
    m: usize,
    k: usize,
    bk: usize,
    mode: ActQuant,
    dequantize: bool,
    buf: &'a mut [f32],
) -> Result<QuantizedAct<'a>> {
    let mut scales = vec![0f32; act_scales_len(m, k, bk, mode)?];
    let (values, rows) = quantize_core(x, m, k, bk, mode, dequantize, buf, &mut scales)?;
    Ok(QuantizedAct::new(values, Cow::Owned(scales), rows, k, bk))
}

/// How many scales quantizing `m` rows of `k` activations in `mode` gives (what
/// [`quantize_act_into`] takes).
pub fn act_scales_len(m: usize, k: usize, bk: usize, mode: ActQuant) -> Result<usize> {
    for (arg, v) in [("m", m), ("k", k), ("bk", bk)] {
        check_positive(arg, v)?;
    }
    Ok(m.div_ceil(rows_per_scale(m, mode)?) * k.div_ceil(bk))
}

/// [`quantize_act_in`] with the scales also written into a caller's buffer (`scales`,
/// [`act_scales_len`] long), so that a call in a decode step allocates nothing.
#[allow(clippy::too_many_arguments)]
pub fn quantize_act_into<'a>(
    x: &'a [f32],
    m: usize,
    k: usize,
    bk: usize,
    mode: ActQuant,
    dequantize: bool,
    buf: &'a mut [f32],
    scales: &'a mut [f32],
) -> Result<QuantizedAct<'a>> {
    check_len(
        "scale buffer",
        scales.len(),
        act_scales_len(m, k, bk, mode)?,
    )?;
    let (values, rows) = quantize_core(x, m, k, bk, mode, dequantize, buf, scales)?;
    Ok(QuantizedAct::new(
        values,
        Cow::Borrowed(scales),
        rows,
        k,
        bk,
    ))
}

/// Activation rows per scale row in `mode` (all `m` for [`ActQuant::None`], whose scales are
/// ones).
fn rows_per_scale(m: usize, mode: ActQuant) -> Result<usize> {
    Ok(match mode {
        ActQuant::None => m,
        ActQuant::Group => 1,
        ActQuant::Block2d { bm } => {
            check_positive("bm", bm)?;
            bm.min(m)
        }
    })
}

/// The quantization itself: the values into `buf` (borrowed from `x` for
/// [`ActQuant::None`]), the scales into `scales` (sized by [`act_scales_len`]); returns the
/// values and the rows per scale row.
#[allow(clippy::too_many_arguments)]
fn quantize_core<'a>(
    x: &'a [f32],
    m: usize,
    k: usize,
    bk: usize,
    mode: ActQuant,
    dequantize: bool,
    buf: &'a mut [f32],
    scales: &mut [f32],
) -> Result<(Cow<'a, [f32]>, usize)> {
    check_len("x", x.len(), m * k)?;
    let kbs = k.div_ceil(bk);
    let rows_per_scale = rows_per_scale(m, mode)?;
    if mode == ActQuant::None {
        scales.fill(1.0);
        return Ok((Cow::Borrowed(x), rows_per_scale));
    }
    check_len("activation buffer", buf.len(), m * k)?;
    let quant = |((out, x), scales): ((&mut [f32], &[f32]), &mut [f32])| {
        let rows = x.len() / k;
        // docs/numerics.md, non-finite activations: the scale comes from the finite elements
        // (one bad token must not move a scale it shares with others, as in Block2d), and a
        // row span holding NaN / ±Inf becomes NaN, so its own token's outputs turn NaN
        // (on the stack for the usual row groups: a decode step quantizes hundreds of times)
        let (mut small, mut big) = ([false; 128], Vec::new());
        let bad: &mut [bool] = if rows <= small.len() {
            &mut small[..rows]
        } else {
            big.resize(rows, false);
            &mut big
        };
        for (kb, s) in scales.iter_mut().enumerate() {
            let (k0, k1) = (kb * bk, (kb * bk + bk).min(k));
            let mut a = 0f32;
            for (r, bad) in bad.iter_mut().enumerate() {
                let (ar, br) = amax(&x[r * k + k0..r * k + k1]);
                a = a.max(ar);
                *bad = br;
            }
            *s = scale_for_amax(a);
            let mul = if dequantize { *s } else { 1.0 };
            for (r, &bad) in bad.iter().enumerate() {
                let span = r * k + k0..r * k + k1;
                if bad {
                    out[span].fill(f32::NAN);
                } else {
                    fake_quant_slice(&x[span.clone()], *s, mul, &mut out[span]);
                }
            }
        }
    };
    let chunk = rows_per_scale * k;
    // a decode step's few rows are quicker done here than handed to the pool
    if m * k <= PAR_MIN_ELEMS {
        buf.chunks_mut(chunk)
            .zip(x.chunks(chunk))
            .zip(scales.chunks_mut(kbs))
            .for_each(quant);
    } else {
        buf.par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .zip(scales.par_chunks_mut(kbs))
            .for_each(quant);
    }
    Ok((Cow::Borrowed(buf), rows_per_scale))
}

/// Below this many activations, quantizing on the calling thread beats a hand-off to the pool
/// (a 16 x 4096 decode batch takes a few microseconds).
const PAR_MIN_ELEMS: usize = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::fp8::{e4m3_to_f32, E4M3_MAX};

    #[test]
    fn weight_round_trip_is_within_half_an_ulp() {
        let (n, k, bn, bk) = (37, 300, 16, 128);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 10f32.powi((i / k % 3) as i32 - 1))
            .collect();
        let (q, s) = quantize_weight(&w, n, k, bn, bk).unwrap();
        let kbs = k.div_ceil(bk);
        for r in 0..n {
            for c in 0..k {
                let sc = s[(r / bn) * kbs + c / bk];
                let back = e4m3_to_f32(q[r * k + c]) * sc;
                let bound = (w[r * k + c].abs() / 16.0).max(sc * 2f32.powi(-10)) * 1.0001;
                assert!((back - w[r * k + c]).abs() <= bound, "{r},{c}");
            }
        }
        // the block amax maps to exactly 448
        assert!(q.iter().any(|&c| e4m3_to_f32(c).abs() == E4M3_MAX));
    }

    /// bf16 scales: every scale a bf16 value at or above the f32 one, so no element saturates
    /// and the round trip is as tight as with f32 scales up to bf16's step.
    #[test]
    fn bf16_scales_are_bf16_values_rounded_up() {
        let (n, k, bn, bk) = (19, 260, 8, 128);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 10f32.powi((i / k % 5) as i32 - 2))
            .collect();
        let (_, s32) = quantize_weight(&w, n, k, bn, bk).unwrap();
        let (q, s) = quantize_weight_as(&w, n, k, bn, bk, ScaleDType::Bf16).unwrap();
        for (a, b) in s.iter().zip(&s32) {
            assert_eq!(a.to_bits() & 0xffff, 0, "{a} is not a bf16 value");
            assert!(a >= b && *a <= b * (1.0 + 1.0 / 128.0), "{a} vs {b}");
        }
        let kbs = k.div_ceil(bk);
        for r in 0..n {
            for c in 0..k {
                let sc = s[(r / bn) * kbs + c / bk];
                let back = e4m3_to_f32(q[r * k + c]) * sc;
                let bound = (w[r * k + c].abs() / 16.0).max(sc * 2f32.powi(-10)) * 1.0001;
                assert!((back - w[r * k + c]).abs() <= bound, "{r},{c}");
                assert!(e4m3_to_f32(q[r * k + c]).abs() <= E4M3_MAX);
            }
        }
    }

    #[test]
    fn zero_block_gets_floor_scale_and_zero_codes() {
        let (q, s) = quantize_weight(&[0.0; 8], 2, 4, 2, 4).unwrap();
        assert_eq!(s, vec![1e-12 / 448.0]);
        assert!(q.iter().all(|&c| c == 0));
        let a = quantize_act(&[0.0; 8], 2, 4, 4, ActQuant::Group, false).unwrap();
        assert!(a.values.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn rejects_bad_arguments() {
        assert!(matches!(
            quantize_weight(&[0.0; 8], 2, 4, 0, 4),
            Err(Error::Invalid { arg: "bn", .. })
        ));
        assert!(matches!(
            quantize_weight(&[0.0; 7], 2, 4, 2, 4),
            Err(Error::Shape { arg: "weight", .. })
        ));
        assert!(matches!(
            quantize_act(&[0.0; 8], 2, 4, 4, ActQuant::Block2d { bm: 0 }, false),
            Err(Error::Invalid { arg: "bm", .. })
        ));
    }
}
