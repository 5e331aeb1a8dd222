//! `Fp8Linear` on CUDA tensors: the weight is made ready once per device and kept with the
//! layer. Codes already on the device with K a multiple of 16 are used in place (no second
//! copy of the weight); otherwise, and for scale rows that need padding to a multiple of 4,
//! a padded copy is made. Each call is planned by fp8nsa-cuda before the op is applied; the
//! op's `cuda_fwd` quantizes the activations on the GPU and runs that plan.

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::CudaDType;
    use candle_core::{CudaStorage, DType, Device, DeviceLocation, Layout, Shape, Tensor};
    use cudarc::driver::{CudaSlice, CudaView};
    use fp8nsa_cuda::fp8::{self as kernels, pad_rows, Fp8Call, WeightLayout, WeightRef};
    use fp8nsa_types::{CudaFp8Kernel, CudaFp8Path};

    use crate::cuda::{stream_of, view, with_storage};
    use crate::error::{Error, Result};
    use crate::fp8::{ActQuant, Fp8BlockWeight};

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

    /// `t` as it is when the layout allows (and it starts on 16 bytes), else a padded copy.
    fn part<T: CudaDType + kernels::PadElement>(
        t: Tensor,
        needs_padding: bool,
        [rows, cols, ld]: [usize; 3],
    ) -> Result<Part<T>> {
        let aligned = (t.layout().start_offset() * std::mem::size_of::<T>()).is_multiple_of(16);
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

    /// The weight `w` (and its f32 `bias`) made ready for the kernels on `dev`.
    pub(crate) fn prepare(
        w: &Fp8BlockWeight,
        bias: Option<&[f32]>,
        dev: &Device,
    ) -> Result<Arc<CudaWeight>> {
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
        let bias = match bias {
            Some(b) => {
                let cuda = dev.as_cuda_device()?;
                Some(
                    cuda.cuda_stream()
                        .clone_htod(b)
                        .map_err(fp8nsa_cuda::Error::from)?,
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
        Ok(Arc::new(CudaWeight {
            location: dev.location(),
            layout,
            codes,
            scales,
            bias,
        }))
    }

    /// One planned call: the weight it reads and fp8nsa-cuda's plan.
    pub(crate) struct CudaCall {
        w: Arc<CudaWeight>,
        call: Fp8Call,
    }

    impl CudaCall {
        pub(crate) fn path(&self) -> CudaFp8Path {
            self.call.path()
        }
    }

    pub(crate) fn is_on(w: &CudaWeight, loc: &DeviceLocation) -> bool {
        w.location == *loc
    }

    /// fp8nsa-cuda's plan for `m` rows of `dtype` on `dev`, made from the weight's shape
    /// alone (a refusal uploads nothing); then the weight `prepared` for `dev`.
    pub(crate) fn plan(
        (w, act): (&Fp8BlockWeight, ActQuant),
        dev: &Device,
        m: usize,
        dtype: DType,
        kernel: CudaFp8Kernel,
        prepared: impl FnOnce() -> Result<Arc<CudaWeight>>,
    ) -> Result<CudaCall> {
        let stream = dev.as_cuda_device()?.cuda_stream();
        let layout = &WeightLayout::new(w.shape(), w.block())?;
        let call = match dtype {
            DType::F32 => kernels::plan_call::<f32>(&stream, layout, m, act, kernel),
            DType::BF16 => kernels::plan_call::<half::bf16>(&stream, layout, m, act, kernel),
            DType::F16 => kernels::plan_call::<half::f16>(&stream, layout, m, act, kernel),
            got => {
                return Err(Error::DType {
                    arg: "x",
                    expected: "f32, bf16 or f16",
                    got,
                })
            }
        }?;
        Ok(CudaCall {
            w: prepared()?,
            call,
        })
    }

    fn run_typed<T: fp8nsa_cuda::Element + CudaDType>(
        c: &CudaCall,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape, CudaFp8Path)> {
        let stream = stream_of(s);
        let x = view::<T>("x", s, l)?;
        let [m, n, _] = c.call.dims();
        // SAFETY: execute writes every element of `out` (poisoned-output tests check it).
        let mut out = unsafe { stream.alloc::<T>(m * n) }.map_err(fp8nsa_cuda::Error::from)?;
        let bias = c.w.bias.as_ref().map(|b| b.as_view());
        let ran = c.w.codes.with_view(|codes| {
            c.w.scales.with_view(|scales| {
                let w = WeightRef {
                    data: codes,
                    scales,
                    layout: c.w.layout,
                };
                Ok(kernels::execute(
                    &stream,
                    &c.call,
                    &x,
                    &w,
                    bias.as_ref(),
                    &mut out.as_view_mut(),
                )?)
            })
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, s.device().clone()),
            Shape::from((m, n)),
            ran,
        ))
    }

    /// Runs a planned call on `x [m, K]` (the op's `cuda_fwd`); returns the path that ran.
    pub(crate) fn run(
        c: &CudaCall,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape, CudaFp8Path)> {
        match s.dtype() {
            DType::F32 => run_typed::<f32>(c, s, l),
            DType::BF16 => run_typed::<half::bf16>(c, s, l),
            DType::F16 => run_typed::<half::f16>(c, s, l),
            got => Err(Error::DType {
                arg: "x",
                expected: "f32, bf16 or f16",
                got,
            }),
        }
    }
}

/// Stand-ins without the `cuda` feature: nothing can build them, and preparing says why.
#[cfg(not(feature = "cuda"))]
mod imp {
    use std::sync::Arc;

    use candle_core::{DType, Device, DeviceLocation};
    use fp8nsa_types::{CudaFp8Kernel, CudaFp8Path};

    use crate::error::{Error, Result};
    use crate::fp8::{ActQuant, Fp8BlockWeight};

    #[derive(Debug)]
    pub(crate) enum CudaWeight {}

    pub(crate) enum CudaCall {}

    impl CudaCall {
        pub(crate) fn path(&self) -> CudaFp8Path {
            match *self {}
        }
    }

    pub(crate) fn is_on(w: &CudaWeight, _: &DeviceLocation) -> bool {
        match *w {}
    }

    pub(crate) fn prepare(
        _: &Fp8BlockWeight,
        _: Option<&[f32]>,
        dev: &Device,
    ) -> Result<Arc<CudaWeight>> {
        Err(Error::Unsupported {
            op: "Fp8Linear",
            device: format!("{dev:?}"),
            hint: "fp8nsa was built without the `cuda` feature",
        })
    }

    pub(crate) fn plan(
        _: (&Fp8BlockWeight, ActQuant),
        dev: &Device,
        _: usize,
        _: DType,
        _: CudaFp8Kernel,
        _: impl FnOnce() -> Result<Arc<CudaWeight>>,
    ) -> Result<CudaCall> {
        Err(Error::Unsupported {
            op: "Fp8Linear",
            device: format!("{dev:?}"),
            hint: "fp8nsa was built without the `cuda` feature",
        })
    }
}

#[cfg(feature = "cuda")]
pub(crate) use imp::run;
pub(crate) use imp::{is_on, plan, prepare, CudaCall, CudaWeight};
