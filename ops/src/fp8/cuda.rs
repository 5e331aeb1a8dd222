//! `Fp8Linear` on CUDA tensors: the weight is prepared once per device (rows padded to 16
//! bytes, scale rows to a multiple of 4, bias as f32) and kept with the layer; every call
//! quantizes the activations on the GPU and runs the path fp8nsa-cuda plans.

use candle_core::Tensor;

use super::Fp8Linear;
use crate::error::Result;

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::{Arc, Mutex};

    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, CustomOp1, DType, Device, DeviceLocation, Layout, Shape};
    use cudarc::driver::CudaSlice;
    use fp8nsa_cuda::fp8::{self as kernels, ActScheme, Fp8Kernel, PreparedWeight};

    use super::*;
    use crate::backend::CudaFp8Kernel;
    use crate::cuda::{stream_of, view, with_storage};
    use crate::error::{invalid, Error};
    use crate::fp8::ActQuant;

    /// The layer's weight and bias on one CUDA device.
    #[derive(Debug)]
    pub(crate) struct CudaWeight {
        location: DeviceLocation,
        weight: PreparedWeight,
        bias: Option<CudaSlice<f32>>,
    }

    /// Shared by clones of the layer.
    pub(crate) type CudaWeightCache = Arc<Mutex<Option<Arc<CudaWeight>>>>;

    fn scheme(a: ActQuant) -> ActScheme {
        match a {
            ActQuant::None => ActScheme::None,
            ActQuant::Group => ActScheme::Group,
            ActQuant::Block2d { bm } => ActScheme::Block2d { bm },
        }
    }

    fn kernel(k: CudaFp8Kernel) -> Fp8Kernel {
        match k {
            CudaFp8Kernel::Auto => Fp8Kernel::Auto,
            CudaFp8Kernel::CublasLt => Fp8Kernel::CublasLt,
            CudaFp8Kernel::Mma => Fp8Kernel::Mma,
            CudaFp8Kernel::SmallM => Fp8Kernel::SmallM,
            CudaFp8Kernel::Dequant => Fp8Kernel::Dequant,
        }
    }

    /// The prepared weight for `dev`, made on first use (and again if the layer moves).
    fn prepared(layer: &Fp8Linear, dev: &Device) -> Result<Arc<CudaWeight>> {
        let mut slot = layer.cuda_weight().lock().expect("cuda weight cache");
        if let Some(w) = slot.as_ref() {
            if w.location == dev.location() {
                return Ok(w.clone());
            }
        }
        let w = layer.weight();
        let [n, k] = w.shape();
        let data = w.data().to_device(dev)?.contiguous()?;
        let scales = w.scales().to_device(dev)?.contiguous()?;
        let weight = with_storage("weight", &data, |ds, dl| {
            with_storage("scales", &scales, |ss, sl| {
                let stream = stream_of(ds);
                Ok(PreparedWeight::new(
                    &stream,
                    &view::<u8>("weight", ds, dl)?,
                    &view::<f32>("scales", ss, sl)?,
                    [n, k],
                    w.block(),
                )?)
            })
        })?;
        let bias = match layer.bias_host() {
            Some(b) => {
                let cuda = dev.as_cuda_device()?;
                Some(
                    cuda.cuda_stream()
                        .clone_htod(b)
                        .map_err(candle_core::Error::wrap)?,
                )
            }
            None => None,
        };
        tracing::debug!(op = "fp8_linear", backend = "cuda", n, k, block = ?w.block(), bytes = weight.device_bytes(), "prepared weight");
        let cw = Arc::new(CudaWeight {
            location: dev.location(),
            weight,
            bias,
        });
        *slot = Some(cw.clone());
        Ok(cw)
    }

    /// `x [m, K]` contiguous on a CUDA device -> `y [m, N]`.
    pub(crate) fn fp8_linear(layer: &Fp8Linear, x: &Tensor, m: usize) -> Result<Tensor> {
        let w = prepared(layer, x.device())?;
        let op = CudaOp {
            w,
            act: scheme(layer.act()),
            kernel: kernel(layer.cuda_kernel()?),
            m,
        };
        Ok(x.apply_op1_no_bwd(&op)?)
    }

    struct CudaOp {
        w: Arc<CudaWeight>,
        act: ActScheme,
        kernel: Fp8Kernel,
        m: usize,
    }

    impl CudaOp {
        fn run<T: fp8nsa_cuda::Element + candle_core::cuda::CudaDType>(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let stream = stream_of(s);
            let x = view::<T>("x", s, l)?;
            let n = self.w.weight.shape()[0];
            // SAFETY: fp8_linear writes every element of `out` (poisoned-output tests check it).
            let mut out =
                unsafe { stream.alloc::<T>(self.m * n) }.map_err(fp8nsa_cuda::Error::from)?;
            let bias = self.w.bias.as_ref().map(|b| b.as_view());
            let path = kernels::fp8_linear(
                &stream,
                &x,
                &self.w.weight,
                bias.as_ref(),
                self.m,
                self.act,
                self.kernel,
                &mut out.as_view_mut(),
            )?;
            tracing::debug!(
                op = "fp8_linear",
                backend = "cuda",
                kernel = %path,
                m = self.m,
                n,
                k = self.w.weight.shape()[1],
                block = ?self.w.weight.block(),
                act = ?self.act,
                dtype = T::SUFFIX,
            );
            Ok((
                CudaStorage::wrap_cuda_slice(out, s.device().clone()),
                Shape::from((self.m, n)),
            ))
        }
    }

    impl CustomOp1 for CudaOp {
        fn name(&self) -> &'static str {
            "fp8nsa-fp8-linear-cuda"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
            Err(invalid("x", "the CUDA op got a CPU tensor").into())
        }

        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let r = match s.dtype() {
                DType::F32 => self.run::<f32>(s, l),
                DType::BF16 => self.run::<half::bf16>(s, l),
                DType::F16 => self.run::<half::f16>(s, l),
                got => Err(Error::DType {
                    arg: "x",
                    expected: "f32, bf16 or f16",
                    got,
                }),
            };
            Ok(r?)
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use std::sync::Arc;

    use super::*;

    pub(crate) type CudaWeightCache = Arc<()>;

    pub(crate) fn fp8_linear(_: &Fp8Linear, x: &Tensor, _: usize) -> Result<Tensor> {
        Err(crate::error::Error::Unsupported {
            op: "Fp8Linear",
            device: format!("{:?}", x.device()),
            hint: "fp8nsa was built without the `cuda` feature",
        })
    }
}

pub(crate) use imp::{fp8_linear, CudaWeightCache};
