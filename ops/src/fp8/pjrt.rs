//! `Fp8Linear` through a PJRT plugin: the weight is uploaded once per runtime and kept there;
//! activations are staged through the host as f32 and the result comes back in x's dtype.

use std::sync::Arc;

use candle_core::Tensor;
use fp8nsa_types::TpuKernel;

use super::{ActQuant, Fp8BlockWeight};
use crate::backend::PjrtRuntime;
use crate::error::Result;

#[cfg(feature = "pjrt")]
mod imp {
    use candle_core::{DType, Device};
    use fp8nsa_pjrt::DeviceWeight;

    use super::*;

    /// The weight on one runtime's device.
    #[derive(Debug)]
    pub(crate) struct PjrtWeight {
        runtime: Arc<PjrtRuntime>,
        weight: DeviceWeight,
    }

    pub(crate) fn runtime(w: &PjrtWeight) -> &Arc<PjrtRuntime> {
        &w.runtime
    }

    /// Whether the runtime's platform runs `variant` (refused before anything is uploaded).
    pub(crate) fn check(rt: &PjrtRuntime, variant: TpuKernel) -> Result<()> {
        Ok(rt.check_kernel(variant)?)
    }

    /// Uploads `w` (and its f32 `bias`) to `rt`'s device.
    pub(crate) fn upload(
        w: &Fp8BlockWeight,
        bias: Option<&[f32]>,
        rt: &Arc<PjrtRuntime>,
    ) -> Result<Arc<PjrtWeight>> {
        let [n, k] = w.shape();
        let codes = crate::fp8::weight::host_bytes("data", w.data())?;
        let scales = w
            .scales()
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let weight = rt.upload_weight(&codes, &scales, bias, n, k, w.block())?;
        Ok(Arc::new(PjrtWeight {
            runtime: rt.clone(),
            weight,
        }))
    }

    /// `x` with `m` rows of K through the uploaded weight `w` (`[n, k]`, `act`).
    pub(crate) fn run(
        (w, [n, k], act): (&PjrtWeight, [usize; 2], ActQuant),
        x: &Tensor,
        m: usize,
        variant: TpuKernel,
    ) -> Result<Tensor> {
        let rt = &w.runtime;
        let xs = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let y = rt.fp8_linear(&xs, m, &w.weight, act, variant)?;
        tracing::debug!(op = "fp8_linear", backend = "pjrt", platform = rt.platform(), kernel = ?variant, m, n, k, act = ?act);
        Ok(Tensor::from_vec(y, (m, n), x.device())?.to_dtype(x.dtype())?)
    }
}

/// Stand-ins without the `pjrt` feature: nothing can build them, and uploading says why.
#[cfg(not(feature = "pjrt"))]
mod imp {
    use super::*;

    #[derive(Debug)]
    pub(crate) enum PjrtWeight {}

    pub(crate) fn runtime(w: &PjrtWeight) -> &Arc<PjrtRuntime> {
        match *w {}
    }

    pub(crate) fn check(_: &PjrtRuntime, _: TpuKernel) -> Result<()> {
        Ok(())
    }

    pub(crate) fn upload(
        _: &Fp8BlockWeight,
        _: Option<&[f32]>,
        rt: &Arc<PjrtRuntime>,
    ) -> Result<Arc<PjrtWeight>> {
        Err(crate::error::Error::Unsupported {
            op: "Fp8Linear",
            device: rt.platform().to_string(),
            hint: "fp8nsa was built without the `pjrt` feature",
        })
    }

    pub(crate) fn run(
        (w, _, _): (&PjrtWeight, [usize; 2], ActQuant),
        _: &Tensor,
        _: usize,
        _: TpuKernel,
    ) -> Result<Tensor> {
        match *w {}
    }
}

pub(crate) use imp::{check, run, runtime, upload, PjrtWeight};
