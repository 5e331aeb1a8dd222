//! The fp8 linear layer. Codes are decoded by the `float8` crate and quantization picks the
//! nearest representable value by search: nothing is shared with the kernels.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::error::{shape_err, Result};
use crate::fp8::{ActQuant, Fp8BlockWeight};

/// All 127 non-negative finite e4m3fn values, in code order (which is value order).
fn e4m3_values() -> Vec<f64> {
    (0u8..0x7f)
        .map(|c| float8::F8E4M3::from_bits(c).to_f64())
        .collect()
}

/// `sat(rne(v))` onto e4m3fn by search: the nearest value, ties to the even code.
fn round_to_e4m3(v: f64, table: &[f64]) -> f64 {
    if v.is_nan() {
        return v;
    }
    let a = v.abs().min(448.0);
    let i = table.partition_point(|&t| t < a);
    let q = if i == 0 {
        table[0]
    } else if i == table.len() {
        table[i - 1]
    } else {
        let (lo, hi) = (table[i - 1], table[i]);
        match (a - lo).partial_cmp(&(hi - a)) {
            Some(std::cmp::Ordering::Less) => lo,
            Some(std::cmp::Ordering::Greater) => hi,
            _ if (i - 1) % 2 == 0 => lo,
            _ => hi,
        }
    };
    q.copysign(v)
}

/// The activation scale of a group with this amax: an f32 value, as stored.
fn act_scale(amax: f64) -> f64 {
    (amax.max(1e-12f32 as f64) / 448.0) as f32 as f64
}

/// `y = Σ_kb sx · Sw · Σ_{k in kb} xq · W + bias`, in f64, returned as f32 `[.., N]` on x's
/// device. `x` is `[.., K]` of any float dtype; activations are quantized per `act`.
pub fn fp8_linear(
    x: &Tensor,
    w: &Fp8BlockWeight,
    bias: Option<&Tensor>,
    act: ActQuant,
) -> Result<Tensor> {
    let [n, k] = w.shape();
    let [bn, bk] = w.block();
    if x.dims().last() != Some(&k) {
        return Err(shape_err("x", format!("[.., {k}]"), x.dims()));
    }
    act.validate()?;
    let m = x.elem_count() / k;
    let kbs = k.div_ceil(bk);
    let xs = x
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let codes = crate::fp8::weight::host_bytes("data", w.data())?;
    let lut: Vec<f64> = (0..=255u8)
        .map(|c| float8::F8E4M3::from_bits(c).to_f64())
        .collect();
    let wv: Vec<f64> = codes.iter().map(|&c| lut[c as usize]).collect();
    let sw: Vec<f64> = w
        .scales()
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let b: Vec<f64> = match bias {
        Some(b) => b
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?,
        None => vec![0.0; n],
    };

    // Quantize the activations: xq (fp8 values) and sx per (row, k-block).
    let table = e4m3_values();
    let rows_per_scale = match act {
        ActQuant::None => 0,
        ActQuant::Group => 1,
        ActQuant::Block2d { bm } => bm,
    };
    let mut xq = xs.clone();
    let mut sx = vec![1.0f64; m * kbs];
    if rows_per_scale > 0 {
        for r0 in (0..m).step_by(rows_per_scale) {
            let r1 = (r0 + rows_per_scale).min(m);
            for kb in 0..kbs {
                let (k0, k1) = (kb * bk, (kb * bk + bk).min(k));
                let mut amax = 0f64;
                for r in r0..r1 {
                    for i in k0..k1 {
                        // docs/numerics.md: over finite elements only
                        if xs[r * k + i].is_finite() {
                            amax = amax.max(xs[r * k + i].abs());
                        }
                    }
                }
                let s = act_scale(amax);
                for r in r0..r1 {
                    sx[r * kbs + kb] = s;
                    for i in k0..k1 {
                        // x / s is the IEEE f32 quotient, as in every kernel: with bf16 inputs,
                        // exact f64 quotients often sit a hair off an fp8 midpoint that the f32
                        // quotient lands on, flipping the rounding of whole dominant blocks.
                        let q = (xs[r * k + i] as f32 / s as f32) as f64;
                        xq[r * k + i] = if q.is_finite() {
                            round_to_e4m3(q, &table)
                        } else {
                            f64::NAN // and so the token's outputs
                        };
                    }
                }
            }
        }
    }

    let mut y = vec![0f32; m * n];
    y.par_chunks_mut(n).enumerate().for_each(|(r, yr)| {
        for (j, out) in yr.iter_mut().enumerate() {
            let mut acc = b[j];
            for kb in 0..kbs {
                let (k0, k1) = (kb * bk, (kb * bk + bk).min(k));
                let dot: f64 = (k0..k1).map(|i| xq[r * k + i] * wv[j * k + i]).sum();
                acc += sx[r * kbs + kb] * sw[(j / bn) * kbs + kb] * dot;
            }
            *out = acc as f32;
        }
    });
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has a last dim") = n;
    Ok(Tensor::from_vec(y, dims, x.device())?)
}

/// The grouped expert GEMM by definition: rows grouped by expert (`counts[e]` rows for expert
/// `e`, in order), each group through [`fp8_linear`] with its expert's weight, in f64.
pub fn fp8_experts(
    x: &Tensor,
    experts: &[Fp8BlockWeight],
    counts: &[usize],
    act: ActQuant,
) -> Result<Tensor> {
    if counts.len() != experts.len() {
        return Err(crate::error::invalid(
            "counts",
            format!("one per expert ({}), got {}", experts.len(), counts.len()),
        ));
    }
    let mut parts = Vec::new();
    let mut r0 = 0;
    for (w, &c) in experts.iter().zip(counts) {
        if c > 0 {
            parts.push(fp8_linear(&x.narrow(0, r0, c)?, w, None, act)?);
            r0 += c;
        }
    }
    Ok(Tensor::cat(&parts, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_rounding_agrees_with_the_codec_on_ties() {
        let t = e4m3_values();
        assert_eq!(round_to_e4m3(1.0625, &t), 1.0);
        assert_eq!(round_to_e4m3(1.1875, &t), 1.25);
        assert_eq!(round_to_e4m3(-500.0, &t), -448.0);
        assert_eq!(round_to_e4m3(2f64.powi(-10), &t), 0.0);
        assert_eq!(round_to_e4m3(3.0 * 2f64.powi(-10), &t), 2f64.powi(-8));
        for c in 0..0x7eu8 {
            let mid = (t[c as usize] + t[c as usize + 1]) / 2.0;
            let ours = fp8nsa_cpu::fp8::e4m3_to_f32(fp8nsa_cpu::fp8::f32_to_e4m3(mid as f32));
            assert_eq!(
                round_to_e4m3(mid, &t),
                ours as f64,
                "midpoint after code {c:#x}"
            );
        }
    }
}
