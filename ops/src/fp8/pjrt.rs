//! `Fp8Linear` through a PJRT plugin: the weight is uploaded once per runtime and kept there;
//! activations are staged through the host as f32 and the result comes back in x's dtype.

use candle_core::Tensor;

use super::Fp8Linear;
use crate::backend::PjrtRuntime;
use crate::error::Result;

#[cfg(feature = "pjrt")]
mod imp {
    use std::sync::{Arc, Mutex};

    use candle_core::{DType, Device};
    use fp8nsa_pjrt::DeviceWeight;

    use super::*;

    /// `(runtime, weight on that runtime's device)`.
    pub(crate) type WeightCache = Arc<Mutex<Option<(Arc<PjrtRuntime>, Arc<DeviceWeight>)>>>;

    fn weight(layer: &Fp8Linear, rt: &Arc<PjrtRuntime>) -> Result<Arc<DeviceWeight>> {
        let mut slot = layer.device_weight().lock().expect("weight cache");
        if let Some((owner, w)) = slot.as_ref() {
            if Arc::ptr_eq(owner, rt) {
                return Ok(w.clone());
            }
        }
        let w = layer.weight();
        let [n, k] = w.shape();
        let codes = crate::fp8::weight::host_bytes("data", w.data())?;
        let scales = w
            .scales()
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let dw = Arc::new(rt.upload_weight(&codes, &scales, layer.bias_host(), n, k, w.block())?);
        *slot = Some((rt.clone(), dw.clone()));
        Ok(dw)
    }

    pub(crate) fn fp8_linear(
        layer: &Fp8Linear,
        rt: &Arc<PjrtRuntime>,
        x: &Tensor,
        m: usize,
    ) -> Result<Tensor> {
        let [n, k] = layer.weight().shape();
        let dw = weight(layer, rt)?;
        let xs = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let variant = layer.tpu_kernel()?;
        let y = rt.fp8_linear(&xs, m, &dw, layer.act(), variant)?;
        tracing::debug!(op = "fp8_linear", backend = "pjrt", platform = rt.platform(), kernel = ?variant, m, n, k, act = ?layer.act());
        Ok(Tensor::from_vec(y, (m, n), x.device())?.to_dtype(x.dtype())?)
    }
}

#[cfg(not(feature = "pjrt"))]
mod imp {
    use std::sync::Arc;

    use super::*;

    pub(crate) type WeightCache = Arc<()>;

    pub(crate) fn fp8_linear(
        _: &Fp8Linear,
        rt: &Arc<PjrtRuntime>,
        _: &Tensor,
        _: usize,
    ) -> Result<Tensor> {
        Err(crate::error::Error::Unsupported {
            op: "Fp8Linear",
            device: rt.platform().to_string(),
            hint: "fp8nsa was built without the `pjrt` feature",
        })
    }
}

pub(crate) use imp::{fp8_linear, WeightCache};
