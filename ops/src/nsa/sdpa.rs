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
        let attend = selection_mask(sel, s, hkv);
        let attend =
            Tensor::from_vec(attend, (hkv, 1, tq, tk), &Device::Cpu)?.to_device(q.device())?;
        let qs = q.narrow(0, s.q_start, tq)?.to_dtype(DType::F32)?;
        // [Tq, Hkv, G, D] -> [Hkv, G * Tq, D]
        let qs = qs
            .reshape((tq, hkv, g, d))?
            .permute((1, 2, 0, 3))?
            .reshape((hkv, g * tq, d))?
            .contiguous()?;
        let heads_first = |t: &Tensor| -> Result<Tensor> {
            Ok(t.narrow(0, s.k_start, tk)?
                .to_dtype(DType::F32)?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let (o, _, lse) =
            masked_attention(&qs, &heads_first(k)?, &heads_first(v)?, &attend, scale)?;
        // back to [Tq, Hq, ..]
        os.push(o.permute((2, 0, 1, 3))?.reshape((tq, hq, dv))?);
        lses.push(lse.permute((2, 0, 1))?.reshape((tq, hq))?);
    }
    Ok((Tensor::cat(&os, 0)?, Tensor::cat(&lses, 0)?))
}

/// The selection of one sequence as a mask `[Hkv, Tq, Tk]`: 1 where the query attends a
/// selected key (clamped, merged, causal), 0 elsewhere.
pub(crate) fn selection_mask(sel: &HostSelection, s: &Seq, hkv: usize) -> Vec<u8> {
    let (tq, tk) = (s.q_len, s.k_len);
    let spans = sel.as_slice();
    let mut row = Vec::new();
    let mut mask = vec![0u8; hkv * tq * tk];
    for t in 0..tq {
        let limit = tk.min(s.q_offset + t + 1);
        for h in 0..hkv {
            spans.row_spans((s.q_start + t) * hkv + h, limit, &mut row);
            let m = &mut mask[(h * tq + t) * tk..(h * tq + t + 1) * tk];
            for &(a, b) in &row {
                m[a..b].fill(1);
            }
        }
    }
    mask
}

/// Softmax attention of `qs [Hkv, G·Tq, D]` over `ks [Hkv, Tk, D]` and `vs [Hkv, Tk, Dv]`
/// (f32), restricted to where `attend [Hkv or 1, 1, Tq, Tk]` (u8) is 1. Returns
/// `o [Hkv, G, Tq, Dv]`, the probabilities `[Hkv, G, Tq, Tk]` and `lse [Hkv, G, Tq]`.
///
/// A query that attends nothing gets `o = 0`, `lse = -inf`, whatever it holds. The non-finite
/// rule (docs/nsa.md): a key or value the query does not attend must not reach it, so scores
/// outside the mask are *replaced* by `-inf` (adding `-inf` keeps a NaN score NaN), and
/// non-finite values are zeroed before the product (a zero probability times NaN is NaN).
/// What the query does attend decides explicitly: a non-finite query or attended key makes
/// `o` and `lse` NaN, a non-finite attended value makes `o` NaN.
pub(crate) fn masked_attention(
    qs: &Tensor,
    ks: &Tensor,
    vs: &Tensor,
    attend: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (hkv, gtq, _) = qs.dims3()?;
    let (_, tk, dv) = vs.dims3()?;
    let (ha, _, tq, _) = attend.dims4()?;
    let g = gtq / tq;
    let dev = qs.device();
    let full = (hkv, g, tq, tk);
    let scores = (qs.matmul(&ks.t()?)? * scale as f64)?.reshape(full)?;
    let neg_inf = Tensor::new(f32::NEG_INFINITY, dev)?.broadcast_as(full)?;
    let scores = attend.broadcast_as(full)?.where_cond(&scores, &neg_inf)?;
    // a row with nothing visible has max -inf: clamp so that exp(-inf - m) = 0, not NaN
    let m = scores.max_keepdim(D::Minus1)?.maximum(f32::MIN)?;
    let p = scores.broadcast_sub(&m)?.exp()?;
    let l = p.sum_keepdim(D::Minus1)?;
    let probs = p.broadcast_div(&l.maximum(f32::MIN_POSITIVE)?)?;
    let lse = (m + l.log()?)?;
    // The usual case, all inputs finite, needs none of the marking below (it costs several
    // passes over K and V). A finite sum proves it in one pass; a sum that overflows only
    // sends finite inputs down the exact path, which gives the same result.
    let finite = |t: &Tensor| -> Result<bool> { Ok(t.sum_all()?.to_scalar::<f32>()?.is_finite()) };
    if finite(qs)? && finite(ks)? && finite(vs)? {
        let o = probs
            .reshape((hkv, g * tq, tk))?
            .matmul(vs)?
            .reshape((hkv, g, tq, dv))?;
        return Ok((o, probs, lse.squeeze(D::Minus1)?));
    }
    let (bad_v, vs) = non_finite_rows(vs)?;
    let o = probs
        .reshape((hkv, g * tq, tk))?
        .matmul(&vs)?
        .reshape((hkv, g, tq, dv))?;
    // how many non-finite keys / values each query attends: [Hkv, 1, Tq, 1]
    let seen = attend.to_dtype(DType::F32)?.reshape((ha, tq, tk))?;
    let hits = |bad: &Tensor| -> Result<Tensor> {
        Ok(seen.broadcast_matmul(bad)?.reshape((hkv, 1, tq, 1))?)
    };
    // a query that attends nothing reads nothing: o = 0, lse = -inf whatever it holds
    let attends = seen.sum_keepdim(2)?.gt(0f32)?.to_dtype(DType::F32)?;
    let (bad_q, _) = non_finite_rows(qs)?;
    let bad_q = bad_q
        .reshape((hkv, g, tq, 1))?
        .broadcast_mul(&attends.reshape((ha, 1, tq, 1))?)?;
    let (bad_k, _) = non_finite_rows(ks)?;
    let bad_lse = hits(&bad_k)?.broadcast_add(&bad_q)?;
    let bad_o = (hits(&bad_v)?.broadcast_add(&bad_lse))?.gt(0f32)?;
    let nan = Tensor::new(f32::NAN, dev)?;
    let lse = bad_lse
        .gt(0f32)?
        .where_cond(&nan.broadcast_as(lse.shape())?, &lse)?
        .squeeze(D::Minus1)?;
    let o = bad_o
        .broadcast_as(o.shape())?
        .where_cond(&nan.broadcast_as(o.shape())?, &o)?;
    Ok((o, probs, lse))
}

/// For `x [.., T, D]` f32: 1.0 for each row holding a NaN or ±Inf, else 0.0 (`[.., T, 1]`),
/// and `x` with those elements zeroed.
fn non_finite_rows(x: &Tensor) -> Result<(Tensor, Tensor)> {
    // |x| <= f32::MAX is false for NaN and ±Inf
    let finite = x.abs()?.le(f32::MAX)?;
    let rows = finite
        .to_dtype(DType::F32)?
        .min_keepdim(D::Minus1)?
        .affine(-1.0, 1.0)?;
    let clean = finite.where_cond(x, &x.zeros_like()?)?;
    Ok((rows, clean))
}
