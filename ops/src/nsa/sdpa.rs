//! The dense fallback: masked scaled-dot-product attention from Candle ops, so it runs on any
//! device. The mask is the selection (clamped, merged, causal) expanded per query and kv head.

use candle_core::{DType, Device, Tensor, D};
use fp8nsa_types::Seq;

use super::selection::HostSelection;
use crate::error::Result;

/// Token-packed `q [Σtq, Hq, D]`, `k [Σtk, Hkv, D]`, `v [Σtk, Hkv, Dv]` -> `o [Σtq, Hq, Dv]` f32
/// and `lse [Σtq, Hq]` f32.
pub(crate) fn masked_sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[Seq],
    sel: &HostSelection,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let (_, hq, d) = q.dims3()?;
    let (_, hkv, _) = k.dims3()?;
    let dv = v.dims()[2];
    let g = hq / hkv;
    let (mut os, mut lses) = (Vec::new(), Vec::new());
    for s in seqs {
        if s.q_len == 0 {
            continue;
        }
        let (tq, tk) = (s.q_len, s.k_len);
        if tk == 0 {
            // no keys at all: every query sees nothing
            os.push(Tensor::zeros((tq, hq, dv), DType::F32, q.device())?);
            lses.push(Tensor::full(f32::NEG_INFINITY, (tq, hq), q.device())?);
            continue;
        }
        let mask = selection_mask(sel, s, hkv);
        let mask = Tensor::from_vec(mask, (hkv, 1, tq, tk), &Device::Cpu)?.to_device(q.device())?;
        let qs = q.narrow(0, s.q_start, tq)?.to_dtype(DType::F32)?;
        // [Tq, Hkv, G, D] -> [Hkv, G * Tq, D]
        let qs = qs
            .reshape((tq, hkv, g, d))?
            .permute((1, 2, 0, 3))?
            .reshape((hkv, g * tq, d))?
            .contiguous()?;
        let (ks, vs) = if tk == 0 {
            (
                Tensor::zeros((hkv, 0, d), DType::F32, q.device())?,
                Tensor::zeros((hkv, 0, dv), DType::F32, q.device())?,
            )
        } else {
            (
                k.narrow(0, s.k_start, tk)?
                    .to_dtype(DType::F32)?
                    .transpose(0, 1)?
                    .contiguous()?,
                v.narrow(0, s.k_start, tk)?
                    .to_dtype(DType::F32)?
                    .transpose(0, 1)?
                    .contiguous()?,
            )
        };
        let scores = (qs.matmul(&ks.t()?)? * scale as f64)?.reshape((hkv, g, tq, tk))?;
        let scores = scores.broadcast_add(&mask)?;
        // a row with nothing visible has max -inf: clamp so that exp(-inf - m) = 0, not NaN
        let m = scores.max_keepdim(D::Minus1)?.maximum(f32::MIN)?;
        let p = scores.broadcast_sub(&m)?.exp()?;
        let l = p.sum_keepdim(D::Minus1)?;
        let pv = p
            .reshape((hkv, g * tq, tk))?
            .matmul(&vs)?
            .reshape((hkv, g, tq, dv))?;
        let o = pv.broadcast_div(&l.maximum(f32::MIN_POSITIVE)?)?;
        let lse = (m + l.log()?)?.squeeze(D::Minus1)?;
        // back to [Tq, Hq, ..]
        os.push(o.permute((2, 0, 1, 3))?.reshape((tq, hq, dv))?);
        lses.push(lse.permute((2, 0, 1))?.reshape((tq, hq))?);
    }
    Ok((Tensor::cat(&os, 0)?, Tensor::cat(&lses, 0)?))
}

/// The selection of one sequence as an additive mask `[Hkv, Tq, Tk]`: 0 where the query sees
/// a selected key (clamped, merged, causal), -inf elsewhere.
pub(crate) fn selection_mask(sel: &HostSelection, s: &Seq, hkv: usize) -> Vec<f32> {
    let (tq, tk) = (s.q_len, s.k_len);
    let spans = sel.as_slice();
    let mut row = Vec::new();
    let mut mask = vec![f32::NEG_INFINITY; hkv * tq * tk];
    for t in 0..tq {
        let limit = tk.min(s.q_offset + t + 1);
        for h in 0..hkv {
            spans.row_spans((s.q_start + t) * hkv + h, limit, &mut row);
            let m = &mut mask[(h * tq + t) * tk..(h * tq + t + 1) * tk];
            for &(a, b) in &row {
                m[a..b].fill(0.0);
            }
        }
    }
    mask
}

/// Softmax over the last dim of `-inf`-masked scores, and the log-sum-exp. A row that sees
/// nothing has max `-inf`; clamping it keeps `exp(-inf - m) = 0` (not NaN), so such a row gives
/// zero probabilities and `lse = -inf`.
pub(crate) fn masked_softmax(scores: &Tensor) -> Result<(Tensor, Tensor)> {
    let m = scores.max_keepdim(D::Minus1)?.maximum(f32::MIN)?;
    let p = scores.broadcast_sub(&m)?.exp()?;
    let l = p.sum_keepdim(D::Minus1)?;
    let probs = p.broadcast_div(&l.maximum(f32::MIN_POSITIVE)?)?;
    let lse = (m + l.log()?)?;
    Ok((probs, lse))
}
