//! `Fp8Linear` on CUDA tensors: the weight is made ready once per device and kept with the
//! layer. Codes already on the device with K a multiple of 16 are used in place (no second
//! copy of the weight); otherwise, and for scale rows that need padding to a multiple of 4,
//! a padded copy is made. Every call quantizes the activations on the GPU and runs the path
//! fp8nsa-cuda plans.

use candle_core::Tensor;

use super::Fp8Linear;
use crate::error::Result;

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::{Arc, Mutex};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::CudaDType;
    use candle_core::{CudaStorage, CustomOp1, DType, Device, DeviceLocation, Layout, Shape};
    use cudarc::driver::{CudaSlice, CudaView};
    use fp8nsa_cuda::fp8::{self as kernels, pad_rows, WeightLayout, WeightRef};
    use fp8nsa_types::{ActQuant, CudaFp8Kernel};

    use super::*;
    use crate::cuda::{stream_of, view, with_storage};
    use crate::error::{invalid, Error};

    /// A buffer of the weight on the device: the layer's own tensor, or a padded copy.
    #[derive(Debug)]
    enum Part<T> {
        InPlace(Tensor),
        Padded(CudaSlice<T>),
    }

    impl<T: CudaDType> Part<T> {
        /// Runs `f` on a view of the buffer.
        fn with_view<R>(&self, f: impl FnOnce(&CudaView<'_, T>) -> Result<R>) -> Result<R> {
            match self {
                Part::InPlace(t) => {
                    with_storage("weight", t, |s, l| f(&view::<T>("weight", s, l)?))
                }
                Part::Padded(p) => f(&p.as_view()),
            }
        }
    }

    /// The layer's weight and bias on one CUDA device.
    #[derive(Debug)]
    pub(crate) struct CudaWeight {
        location: DeviceLocation,
        layout: WeightLayout,
        codes: Part<u8>,
        scales: Part<f32>,
        bias: Option<CudaSlice<f32>>,
    }

    /// Shared by clones of the layer.
    pub(crate) type CudaWeightCache = Arc<Mutex<Option<Arc<CudaWeight>>>>;

    /// `t` as it is when the layout allows (and it starts on 16 bytes), else a padded copy.
    fn part<T: CudaDType + kernels::PadElement>(
        t: Tensor,
        needs_padding: bool,
        [rows, cols, ld]: [usize; 3],
    ) -> Result<Part<T>> {
        let aligned = (t.layout().start_offset() * std::mem::size_of::<T>()) % 16 == 0;
        if !needs_padding && aligned {
            return Ok(Part::InPlace(t));
        }
        let padded = with_storage("weight", &t, |s, l| {
            Ok(pad_rows(
                &stream_of(s),
                &view::<T>("weight", s, l)?,
                rows,
                cols,
                ld,
            )?)
        })?;
        Ok(Part::Padded(padded))
    }

    /// The weight ready for `dev`, made on first use (and again if the layer moves).
    fn prepared(layer: &Fp8Linear, dev: &Device) -> Result<Arc<CudaWeight>> {
        let mut slot = layer.cuda_weight().lock().expect("cuda weight cache");
        if let Some(w) = slot.as_ref() {
            if w.location == dev.location() {
                return Ok(w.clone());
            }
        }
        let w = layer.weight();
        let layout = WeightLayout::new(w.shape(), w.block())?;
        let [n, k] = w.shape();
        let [nb, kb] = layout.scale_dims();
        let codes = part::<u8>(
            w.data().to_device(dev)?.contiguous()?,
            layout.codes_need_padding(),
            [n, k, layout.ld],
        )?;
        let scales = part::<f32>(
            w.scales().to_device(dev)?.contiguous()?,
            layout.scales_need_padding(),
            [nb, kb, layout.scale_ld],
        )?;
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
        tracing::debug!(
            op = "fp8_linear",
            backend = "cuda",
            n,
            k,
            block = ?w.block(),
            codes_copied = matches!(codes, Part::Padded(_)),
            scales_copied = matches!(scales, Part::Padded(_)),
            "weight ready"
        );
        let cw = Arc::new(CudaWeight {
            location: dev.location(),
            layout,
            codes,
            scales,
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
            act: layer.act(),
            kernel: layer.cuda_kernel()?,
            m,
        };
        Ok(x.apply_op1_no_bwd(&op)?)
    }

    struct CudaOp {
        w: Arc<CudaWeight>,
        act: ActQuant,
        kernel: CudaFp8Kernel,
        m: usize,
    }

    impl CudaOp {
        fn run<T: fp8nsa_cuda::Element + CudaDType>(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let stream = stream_of(s);
            let x = view::<T>("x", s, l)?;
            let layout = self.w.layout;
            let n = layout.n;
            // SAFETY: fp8_linear writes every element of `out` (poisoned-output tests check it).
            let mut out =
                unsafe { stream.alloc::<T>(self.m * n) }.map_err(fp8nsa_cuda::Error::from)?;
            let bias = self.w.bias.as_ref().map(|b| b.as_view());
            let path = self.w.codes.with_view(|codes| {
                self.w.scales.with_view(|scales| {
                    let w = WeightRef {
                        data: codes,
                        scales,
                        layout,
                    };
                    Ok(kernels::fp8_linear(
                        &stream,
                        &x,
                        &w,
                        bias.as_ref(),
                        self.m,
                        self.act,
                        self.kernel,
                        &mut out.as_view_mut(),
                    )?)
                })
            })?;
            tracing::debug!(
                op = "fp8_linear",
                backend = "cuda",
                kernel = %path,
                m = self.m,
                n,
                k = layout.k,
                block = ?[layout.bn, layout.bk],
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
