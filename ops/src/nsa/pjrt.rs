//! Selection attention through a PJRT plugin: the masked program, one sequence at a time.

use std::sync::Arc;

use candle_core::Tensor;
use fp8nsa_types::Seq;

use super::selection::HostSelection;
use crate::backend::PjrtRuntime;
use crate::error::Result;

/// Token-packed `q [Σtq, Hq, D]`, `k`, `v` -> `o [Σtq, Hq, Dv]`, `lse [Σtq, Hq]` (f32).
#[cfg(feature = "pjrt")]
pub(crate) fn selection(
    rt: &Arc<PjrtRuntime>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[Seq],
    sel: &HostSelection,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    use candle_core::{DType, Device};
    use fp8nsa_pjrt::programs::AttnShape;

    let (_, hq, d) = q.dims3()?;
    let (_, hkv, _) = k.dims3()?;
    let dv = v.dims()[2];
    let host = |t: &Tensor, start: usize, len: usize| -> Result<Vec<f32>> {
        Ok(t.narrow(0, start, len)?
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?)
    };
    let (mut os, mut lses) = (Vec::new(), Vec::new());
    for s in seqs.iter().filter(|s| s.q_len > 0) {
        if s.k_len == 0 {
            // no keys at all: every query sees nothing (and the mask rows below are empty)
            os.push(Tensor::zeros((s.q_len, hq, dv), DType::F32, q.device())?);
            lses.push(Tensor::full(f32::NEG_INFINITY, (s.q_len, hq), q.device())?);
            continue;
        }
        let shape = AttnShape {
            tq: s.q_len,
            tk: s.k_len,
            hq,
            hkv,
            d,
            dv,
        };
        let attend = super::sdpa::selection_mask(sel, s, hkv);
        // The program masks by adding -inf, so the non-finite rule (docs/nsa.md) is kept
        // here: non-finite keys and values are zeroed before they reach it (an unattended one
        // then cannot turn a score or a product NaN), and the queries that do attend one get
        // NaN afterwards.
        let (mut k_s, mut v_s) = (host(k, s.k_start, s.k_len)?, host(v, s.k_start, s.k_len)?);
        let bad_k = zero_non_finite_rows(&mut k_s, d);
        let bad_v = zero_non_finite_rows(&mut v_s, dv);
        let mask: Vec<f32> = attend
            .iter()
            .map(|&a| if a == 1 { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let (mut o, mut lse) = rt.nsa_selection(
            shape,
            &host(q, s.q_start, s.q_len)?,
            &k_s,
            &v_s,
            &mask,
            scale,
        )?;
        let (tq, tk, g) = (s.q_len, s.k_len, hq / hkv);
        for (row, seen) in attend.chunks_exact(tk).enumerate() {
            // mask rows are [Hkv, Tq]
            let (h, t) = (row / tq, row % tq);
            let hit = |bad: &[bool]| (0..tk).any(|j| seen[j] == 1 && bad[j * hkv + h]);
            let (key, value) = (hit(&bad_k), hit(&bad_v));
            // a query that attends nothing reads nothing (the program gives NaN for a NaN
            // query even then)
            let none = !seen.contains(&1);
            for qh in h * g..(h + 1) * g {
                if none {
                    lse[t * hq + qh] = f32::NEG_INFINITY;
                    o[(t * hq + qh) * dv..(t * hq + qh + 1) * dv].fill(0.0);
                    continue;
                }
                if key {
                    lse[t * hq + qh] = f32::NAN;
                }
                if key || value {
                    o[(t * hq + qh) * dv..(t * hq + qh + 1) * dv].fill(f32::NAN);
                }
            }
        }
        os.push(Tensor::from_vec(o, (s.q_len, hq, dv), q.device())?);
        lses.push(Tensor::from_vec(lse, (s.q_len, hq), q.device())?);
    }
    tracing::debug!(
        op = "nsa_selection",
        backend = "pjrt",
        platform = rt.platform(),
        kernel = "masked",
        hq,
        hkv,
        d,
        dv
    );
    Ok((Tensor::cat(&os, 0)?, Tensor::cat(&lses, 0)?))
}

/// Zeroes every row of `x [rows, width]` holding a NaN or ±Inf; returns which rows did.
#[cfg(feature = "pjrt")]
fn zero_non_finite_rows(x: &mut [f32], width: usize) -> Vec<bool> {
    x.chunks_exact_mut(width)
        .map(|r| {
            let bad = r.iter().any(|e| !e.is_finite());
            if bad {
                r.fill(0.0);
            }
            bad
        })
        .collect()
}

#[cfg(not(feature = "pjrt"))]
pub(crate) fn selection(
    rt: &Arc<PjrtRuntime>,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &[Seq],
    _: &HostSelection,
    _: f32,
) -> Result<(Tensor, Tensor)> {
    Err(crate::error::Error::Unsupported {
        op: "SelectionAttention",
        device: rt.platform().to_string(),
        hint: "fp8nsa was built without the `pjrt` feature",
    })
}
