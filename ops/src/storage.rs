//! Borrowing typed slices out of Candle's CPU storage.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout};

use crate::error::{invalid, Error, Result};

fn offsets(arg: &'static str, l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| invalid(arg, "must be contiguous"))
}

/// The float tensor as f32, borrowed when it already is f32.
pub(crate) fn f32_slice<'a>(
    arg: &'static str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<Cow<'a, [f32]>> {
    let (a, b) = offsets(arg, l)?;
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[a..b]),
        CpuStorage::BF16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        other => {
            return Err(Error::DType {
                arg,
                expected: "f32, bf16 or f16",
                got: other.dtype(),
            })
        }
    })
}

/// Raw e4m3fn bytes from U8 or F8E4M3 storage.
pub(crate) fn fp8_bytes<'a>(
    arg: &'static str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<Cow<'a, [u8]>> {
    let (a, b) = offsets(arg, l)?;
    Ok(match s {
        CpuStorage::U8(v) => Cow::Borrowed(&v[a..b]),
        CpuStorage::F8E4M3(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_bits()).collect()),
        other => {
            return Err(Error::DType {
                arg,
                expected: "u8 or f8e4m3",
                got: other.dtype(),
            })
        }
    })
}

/// f32 results in the storage type of the input.
pub(crate) fn from_f32(v: Vec<f32>, dtype: candle_core::DType) -> CpuStorage {
    use candle_core::DType;
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

/// Candle custom ops return one tensor. An op with a second output (selection attention's
/// lse) parks that output's storage here, on whichever device it ran, and the caller takes it
/// as a tensor afterwards: no copy, and the same way on every device.
pub(crate) struct SecondOutput {
    slot: std::sync::Mutex<Option<(candle_core::Storage, candle_core::Shape)>>,
}

impl SecondOutput {
    pub(crate) fn new() -> Self {
        Self {
            slot: std::sync::Mutex::new(None),
        }
    }

    /// Called by the op's `*_fwd`.
    pub(crate) fn put(&self, storage: candle_core::Storage, shape: impl Into<candle_core::Shape>) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some((storage, shape.into()));
    }

    /// The parked output as a contiguous tensor; an error if the op did not park one.
    pub(crate) fn take(&self) -> Result<candle_core::Tensor> {
        let (storage, shape) = self
            .slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| invalid("lse", "the op produced no second output"))?;
        Ok(candle_core::Tensor::from_storage(
            storage,
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}
