//! `Fp8Experts` on CUDA tensors: the stacked experts are laid out for fp8nsa-cuda's grouped
//! kernels and uploaded once per device (kept with the layer); each call is one op whose
//! `cuda_fwd` quantizes the activations and runs the grouped plan.

use fp8nsa_types::ExpertsShape;

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::{Arc, Mutex};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::CudaDType;
    use candle_core::{
        CpuStorage, CudaStorage, CustomOp1, DType, Device, DeviceLocation, Layout, Shape, Tensor,
    };
    use cudarc::driver::CudaSlice;
    use fp8nsa_cuda::fp8::{fp8_grouped, WeightLayout, WeightRef};
    use fp8nsa_types::ExpertsShape;
    use fp8nsa_types::{ActQuant, CudaFp8Kernel, CudaFp8Path};

    use crate::cuda::{stream_of, view};
    use crate::error::{invalid, Error, Result};
    use crate::storage::ParkedError;

    /// All experts in the kernels' layout on one device.
    #[derive(Debug)]
    pub(crate) struct CudaExperts {
        location: DeviceLocation,
        layout: WeightLayout,
        codes: CudaSlice<u8>,
        scales: CudaSlice<f32>,
    }

    /// `rows` rows of `cols` values, each padded with zeros to `ld`.
    fn padded<T: Copy + Default>(v: &[T], rows: usize, cols: usize, ld: usize) -> Vec<T> {
        let mut out = vec![T::default(); rows * ld];
        for (o, i) in out.chunks_exact_mut(ld).zip(v.chunks_exact(cols)) {
            o[..cols].copy_from_slice(i);
        }
        out
    }

    pub(crate) fn prepare(
        codes: &[u8],
        scales: &[f32],
        s: ExpertsShape,
        dev: &Device,
    ) -> Result<Arc<CudaExperts>> {
        let layout = WeightLayout::new([s.n(), s.k()], [s.bn(), s.bk()])?;
        let [nb, kb] = layout.scale_dims();
        let stream = dev.as_cuda_device()?.cuda_stream();
        let codes = stream
            .clone_htod(&padded(codes, s.e() * s.n(), s.k(), layout.ld))
            .map_err(fp8nsa_cuda::Error::from)?;
        let scales = stream
            .clone_htod(&padded(scales, s.e() * nb, kb, layout.scale_ld))
            .map_err(fp8nsa_cuda::Error::from)?;
        tracing::debug!(
            op = "fp8_experts",
            backend = "cuda",
            experts = s.e(),
            n = s.n(),
            k = s.k(),
            "experts ready"
        );
        Ok(Arc::new(CudaExperts {
            location: dev.location(),
            layout,
            codes,
            scales,
        }))
    }

    pub(crate) fn is_on(w: &CudaExperts, loc: &DeviceLocation) -> bool {
        w.location == *loc
    }

    struct GroupedOp<'a> {
        w: &'a CudaExperts,
        counts: &'a [usize],
        act: ActQuant,
        kernel: CudaFp8Kernel,
        ran: Mutex<Option<CudaFp8Path>>,
        err: ParkedError,
    }

    impl GroupedOp<'_> {
        fn run<T: fp8nsa_cuda::Element + CudaDType>(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let stream = stream_of(s);
            let x = view::<T>("x", s, l)?;
            let (t, n) = (self.counts.iter().sum::<usize>(), self.w.layout.n);
            // SAFETY: fp8_grouped writes every element of `out` (the poisoned-output tests).
            let mut out = unsafe { stream.alloc::<T>(t * n) }.map_err(fp8nsa_cuda::Error::from)?;
            let (codes, scales) = (self.w.codes.as_view(), self.w.scales.as_view());
            let w = WeightRef {
                data: &codes,
                scales: &scales,
                layout: self.w.layout,
            };
            let path = fp8_grouped(
                &stream,
                &x,
                &w,
                self.counts,
                self.act,
                self.kernel,
                &mut out.as_view_mut(),
            )?;
            *self.ran.lock().unwrap_or_else(|p| p.into_inner()) = Some(path);
            Ok((
                CudaStorage::wrap_cuda_slice(out, s.device().clone()),
                Shape::from((t, n)),
            ))
        }
    }

    impl CustomOp1 for GroupedOp<'_> {
        fn name(&self) -> &'static str {
            "fp8nsa-fp8-experts"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            self.err.park(Err(invalid(
                "x",
                "the call was planned for CUDA and got a CPU tensor",
            )))
        }

        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            self.err.park(match s.dtype() {
                DType::F32 => self.run::<f32>(s, l),
                DType::BF16 => self.run::<half::bf16>(s, l),
                DType::F16 => self.run::<half::f16>(s, l),
                got => Err(Error::DType {
                    arg: "x",
                    expected: "f32, bf16 or f16",
                    got,
                }),
            })
        }
    }

    /// `y [T, N]` for the contiguous `x [T, K]` on `w`'s device; returns the path that ran.
    pub(crate) fn forward(
        w: &CudaExperts,
        x: &Tensor,
        counts: &[usize],
        act: ActQuant,
        kernel: CudaFp8Kernel,
    ) -> Result<(Tensor, CudaFp8Path)> {
        let op = GroupedOp {
            w,
            counts,
            act,
            kernel,
            ran: Mutex::new(None),
            err: ParkedError::new(),
        };
        let y = x
            .contiguous()?
            .apply_op1_no_bwd(&op)
            .map_err(|e| op.err.or(e))?;
        let ran = op.ran.lock().unwrap_or_else(|p| p.into_inner()).take();
        let ran = ran.ok_or_else(|| invalid("x", "the grouped op did not run on CUDA"))?;
        Ok((y, ran))
    }
}

/// Stand-ins without the `cuda` feature: nothing can build them, and preparing says why.
#[cfg(not(feature = "cuda"))]
mod imp {
    use std::sync::Arc;

    use candle_core::{Device, DeviceLocation, Tensor};
    use fp8nsa_types::ExpertsShape;
    use fp8nsa_types::{ActQuant, CudaFp8Kernel, CudaFp8Path};

    use crate::error::{Error, Result};

    #[derive(Debug)]
    pub(crate) enum CudaExperts {}

    pub(crate) fn prepare(
        _: &[u8],
        _: &[f32],
        _: ExpertsShape,
        dev: &Device,
    ) -> Result<Arc<CudaExperts>> {
        Err(Error::Unsupported {
            op: "fp8-experts",
            device: format!("{dev:?}"),
            hint: "fp8nsa was built without the `cuda` feature",
        })
    }

    pub(crate) fn is_on(w: &CudaExperts, _: &DeviceLocation) -> bool {
        match *w {}
    }

    pub(crate) fn forward(
        w: &CudaExperts,
        _: &Tensor,
        _: &[usize],
        _: ActQuant,
        _: CudaFp8Kernel,
    ) -> crate::error::Result<(Tensor, CudaFp8Path)> {
        match *w {}
    }
}

pub(crate) use imp::{forward, CudaExperts};

/// The experts prepared for `dev`: the ones kept in `slot`, or new ones put there (replacing
/// another device's).
pub(crate) fn prepared(
    slot: &std::sync::Mutex<Option<std::sync::Arc<CudaExperts>>>,
    codes: &[u8],
    scales: &[f32],
    shape: ExpertsShape,
    dev: &candle_core::Device,
) -> crate::error::Result<std::sync::Arc<CudaExperts>> {
    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
    let loc = dev.location();
    if let Some(w) = slot.as_ref().filter(|w| imp::is_on(w, &loc)) {
        return Ok(w.clone());
    }
    let w = imp::prepare(codes, scales, shape, dev)?;
    *slot = Some(w.clone());
    Ok(w)
}
