//! `Fp8Linear` through a PJRT plugin: the weight is uploaded once per runtime and kept there;
//! activations are staged through the host as f32 and the result comes back in x's dtype.

use std::sync::Arc;

use candle_core::Tensor;
use fp8nsa_types::TpuKernel;

use super::linear::Prepared;
use super::Fp8Linear;
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

    pub(crate) fn upload(layer: &Fp8Linear, rt: &Arc<PjrtRuntime>) -> Result<Arc<PjrtWeight>> {
        let w = layer.weight();
        let [n, k] = w.shape();
        let codes = crate::fp8::weight::host_bytes("data", w.data())?;
        let scales = w
            .scales()
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let weight = rt.upload_weight(&codes, &scales, layer.bias_host(), n, k, w.block())?;
        Ok(Arc::new(PjrtWeight {
            runtime: rt.clone(),
            weight,
        }))
    }

    pub(crate) fn run(
        layer: &Fp8Linear,
        w: &PjrtWeight,
        x: &Tensor,
        m: usize,
        variant: TpuKernel,
    ) -> Result<Tensor> {
        let rt = &w.runtime;
        let [n, k] = layer.weight().shape();
        let xs = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let y = rt.fp8_linear(&xs, m, &w.weight, layer.act(), variant)?;
        tracing::debug!(op = "fp8_linear", backend = "pjrt", platform = rt.platform(), kernel = ?variant, m, n, k, act = ?layer.act());
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

    pub(crate) fn upload(_: &Fp8Linear, rt: &Arc<PjrtRuntime>) -> Result<Arc<PjrtWeight>> {
        Err(crate::error::Error::Unsupported {
            op: "Fp8Linear",
            device: rt.platform().to_string(),
            hint: "fp8nsa was built without the `pjrt` feature",
        })
    }

    pub(crate) fn run(
        _: &Fp8Linear,
        w: &PjrtWeight,
        _: &Tensor,
        _: usize,
        _: TpuKernel,
    ) -> Result<Tensor> {
        match *w {}
    }
}

pub(crate) use imp::PjrtWeight;

/// `x` with `m` rows of K -> `y [m, N]` and the kernel variant that ran; the weight is
/// uploaded on the first call for `rt` and kept with the layer.
pub(crate) fn fp8_linear(
    layer: &Fp8Linear,
    rt: &Arc<PjrtRuntime>,
    x: &Tensor,
    m: usize,
) -> Result<(Tensor, TpuKernel)> {
    let variant = layer.tpu_kernel()?;
    imp::check(rt, variant)?;
    let w = layer.prepared(
        |p| match p {
            Prepared::Pjrt(w) if Arc::ptr_eq(imp::runtime(w), rt) => Some(w.clone()),
            _ => None,
        },
        || {
            let w = imp::upload(layer, rt)?;
            Ok((Prepared::Pjrt(w.clone()), w))
        },
    )?;
    Ok((imp::run(layer, &w, x, m, variant)?, variant))
}
