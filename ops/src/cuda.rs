//! Candle CUDA storage to fp8nsa-cuda arguments and back (`cuda` feature only).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaDType;
use candle_core::{CudaStorage, Layout, Storage, Tensor};
use cudarc::driver::{CudaStream, CudaView};

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
