//! Candle CUDA storage to fp8nsa-cuda arguments and back (`cuda` feature only).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaDType;
use candle_core::{CudaStorage, CustomOp1, Layout, Shape, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, CudaView};

use crate::error::{invalid, Result};

/// The contiguous elements `layout` covers in `s`, as a view.
pub(crate) fn view<'a, T: CudaDType>(
    arg: &'static str,
    s: &'a CudaStorage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| invalid(arg, "must be contiguous"))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// Runs `f` on the CUDA storage of `t` (which must be on a CUDA device).
pub(crate) fn with_storage<R>(
    arg: &'static str,
    t: &Tensor,
    f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(s, layout),
        _ => Err(invalid(arg, "must be on a CUDA device")),
    }
}

/// The stream candle runs `s`'s device on.
pub(crate) fn stream_of(s: &CudaStorage) -> Arc<CudaStream> {
    s.device().cuda_stream()
}

/// A device buffer and the device it belongs to.
type Parked<T> = (CudaSlice<T>, candle_core::CudaDevice);

/// Candle custom ops return one tensor. A kernel with a second output (NSA's lse) parks it
/// here inside its op; applying this op then hands it over as a tensor, without copying.
pub(crate) struct Stashed<T: CudaDType> {
    slot: Arc<Mutex<Option<Parked<T>>>>,
    shape: Shape,
}

impl<T: CudaDType> Stashed<T> {
    pub(crate) fn new(shape: impl Into<Shape>) -> Self {
        Self {
            slot: Arc::default(),
            shape: shape.into(),
        }
    }

    pub(crate) fn put(&self, slice: CudaSlice<T>, dev: candle_core::CudaDevice) {
        *self.slot.lock().expect("stash") = Some((slice, dev));
    }

    /// The parked output as a tensor (on the device of `like`).
    pub(crate) fn take(&self, like: &Tensor) -> Result<Tensor> {
        Ok(like.apply_op1_no_bwd(self)?)
    }
}

impl<T: CudaDType> CustomOp1 for Stashed<T> {
    fn name(&self) -> &'static str {
        "fp8nsa-stashed-output"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "fp8nsa: stashed outputs live on CUDA".into(),
        ))
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (slice, dev) = self
            .slot
            .lock()
            .expect("stash")
            .take()
            .ok_or_else(|| candle_core::Error::Msg("fp8nsa: no stashed output".into()))?;
        Ok((CudaStorage::wrap_cuda_slice(slice, dev), self.shape.clone()))
    }
}
