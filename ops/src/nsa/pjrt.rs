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
        let shape = AttnShape {
            tq: s.q_len,
            tk: s.k_len,
            hq,
            hkv,
            d,
            dv,
        };
        let mask = super::sdpa::selection_mask(sel, s, hkv);
        let (o, lse) = rt.nsa_selection(
            shape,
            &host(q, s.q_start, s.q_len)?,
            &host(k, s.k_start, s.k_len)?,
            &host(v, s.k_start, s.k_len)?,
            &mask,
            scale,
        )?;
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
