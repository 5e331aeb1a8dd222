//! Borrowing typed slices out of Candle's CPU storage.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout};

use crate::error::{invalid, Error, Result};

fn offsets(arg: &'static str, l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| invalid(arg, "must be contiguous"))
}

/// The elements of a contiguous layout over `v`.
pub(crate) fn contiguous<'a, T>(arg: &'static str, v: &'a [T], l: &Layout) -> Result<&'a [T]> {
    let (a, b) = offsets(arg, l)?;
    Ok(&v[a..b])
}

/// The storage's f32 elements, or [`Error::DType`] naming `arg`.
pub(crate) fn f32s<'a>(arg: &'static str, s: &'a CpuStorage) -> Result<&'a [f32]> {
    match s {
        CpuStorage::F32(x) => Ok(x),
        _ => Err(Error::DType {
            arg,
            expected: "f32",
            got: s.dtype(),
        }),
    }
}

/// The elements of a contiguous layout over `v`, to write in place.
pub(crate) fn contiguous_mut<'a, T>(
    arg: &'static str,
    v: &'a mut [T],
    l: &Layout,
) -> Result<&'a mut [T]> {
    let (a, b) = offsets(arg, l)?;
    Ok(&mut v[a..b])
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

/// A value an op's `cpu_fwd` / `cuda_fwd` hands back to the caller past candle's interface,
/// which returns one tensor and keeps errors only as text.
pub(crate) struct Slot<T>(std::sync::Mutex<Option<T>>);

impl<T> Slot<T> {
    pub(crate) fn new() -> Self {
        Self(std::sync::Mutex::new(None))
    }

    pub(crate) fn put(&self, v: T) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
    }

    pub(crate) fn take(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// An op's second output (selection attention's lse), parked as storage on whichever device
/// it ran and taken as a tensor afterwards: no copy, and the same way on every device.
pub(crate) struct SecondOutput(Slot<(candle_core::Storage, candle_core::Shape)>);

impl SecondOutput {
    pub(crate) fn new() -> Self {
        Self(Slot::new())
    }

    /// Called by the op's `*_fwd`.
    pub(crate) fn put(&self, storage: candle_core::Storage, shape: impl Into<candle_core::Shape>) {
        self.0.put((storage, shape.into()));
    }

    /// The parked output as a contiguous tensor; an error if the op did not park one.
    pub(crate) fn take(&self) -> Result<candle_core::Tensor> {
        let (storage, shape) = self
            .0
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

/// The typed error of an op that failed inside candle: the op parks it, candle carries only its
/// text, and the layer returns the parked one, so `forward_t` / `forward_with_path` never turn
/// an error of ours into text.
pub(crate) struct ParkedError(Slot<Error>);

impl ParkedError {
    pub(crate) fn new() -> Self {
        Self(Slot::new())
    }

    /// The op's result as candle wants it; a failure is parked typed first.
    pub(crate) fn park<T>(&self, r: Result<T>) -> candle_core::Result<T> {
        r.map_err(|e| {
            let text = candle_core::Error::Msg(e.to_string());
            self.0.put(e);
            text
        })
    }

    /// What a failed apply returns: the parked typed error, else candle's own.
    pub(crate) fn or(&self, e: candle_core::Error) -> Error {
        self.0.take().unwrap_or(Error::Candle(e))
    }
}

/// Backs a CPU tensor's storage with transparent huge pages where the kernel allows
/// (`fp8nsa_cpu::mem::advise_huge_pages`): for weights, which every decode step streams once.
/// Returns whether it took; always `false` off the CPU or for a buffer under 2 MiB. Contents
/// and layout are unchanged.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
///
/// let w = Tensor::ones((2048, 1024), DType::F32, &Device::Cpu)?; // 8 MiB
/// let _ = fp8nsa_ops::advise_huge_pages(&w); // whether it took depends on the kernel
/// assert_eq!(w.sum_all()?.to_scalar::<f32>()?, (2048 * 1024) as f32);
/// assert!(!fp8nsa_ops::advise_huge_pages(&Tensor::ones(8, DType::F32, &Device::Cpu)?));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn advise_huge_pages(t: &candle_core::Tensor) -> bool {
    use fp8nsa_cpu::mem::advise_huge_pages as advise;
    if !t.device().is_cpu() {
        return false;
    }
    let (storage, _) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cs) = &*storage else {
        return false;
    };
    match cs {
        CpuStorage::U8(v) => advise(v),
        CpuStorage::F32(v) => advise(v),
        CpuStorage::F16(v) => advise(v),
        CpuStorage::BF16(v) => advise(v),
        CpuStorage::F64(v) => advise(v),
        _ => false,
    }
}

/// Zeros whose memory is taken and written now, or [`Error::Invalid`] naming `arg` where the
/// allocator refuses it (instead of the abort a refused allocation is otherwise; under Linux's
/// overcommit, memory it grants but the machine cannot back still meets the OOM killer while
/// it is written). On the CPU a zeroed allocation is otherwise
/// mapped lazily, each page faulting on its first write: in a KV pool, inside the decode step
/// that first reaches it (16 sequences decoding into fresh pages: ~0.5 ms a step on SmolLM2,
/// Zen 4). A pool is committed when it is made, as llama.cpp clears its cache when it makes it;
/// the memory a server sized for is then taken up front, not in the middle of serving. Off the
/// CPU, and for dtypes other than f32 / f16 / bf16, Candle's own zeros.
///
/// ```
/// use candle_core::{DType, Device};
///
/// let t = fp8nsa_ops::zeros_committed((2, 3), DType::F16, &Device::Cpu, "pages")?;
/// assert_eq!(t.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?, 0.0);
/// // more than any allocator gives: a typed error, not an abort
/// let huge = fp8nsa_ops::zeros_committed((1usize << 40, 1usize << 20), DType::F32, &Device::Cpu, "pages");
/// assert!(matches!(huge, Err(fp8nsa_ops::Error::Invalid { arg: "pages", .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn zeros_committed(
    shape: impl Into<candle_core::Shape>,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    arg: &'static str,
) -> Result<candle_core::Tensor> {
    use candle_core::{DType, Tensor};
    fn written<T: Clone>(n: usize, zero: T, arg: &'static str) -> Result<Vec<T>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|_| refused(arg, n, std::mem::size_of::<T>()))?;
        v.resize(n, zero);
        Ok(v)
    }
    let shape = shape.into();
    let n = shape.elem_count();
    if !device.is_cpu() {
        return Ok(Tensor::zeros(shape, dtype, device)?);
    }
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(written(n, 0f32, arg)?, shape, device)?,
        DType::F16 => Tensor::from_vec(written(n, half::f16::ZERO, arg)?, shape, device)?,
        DType::BF16 => Tensor::from_vec(written(n, half::bf16::ZERO, arg)?, shape, device)?,
        _ => Tensor::zeros(shape, dtype, device)?,
    })
}

/// Candle's zeros (on the CPU mapped lazily, each page on its first write), after checking that
/// the allocator can reserve that much: a size it refuses is [`Error::Invalid`] naming `arg`
/// instead of an abort inside Candle. For pools that fill slowly (NSA's compressed rows), where
/// committing every page up front would take memory a server may never use.
pub(crate) fn zeros_checked(
    shape: impl Into<candle_core::Shape>,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    arg: &'static str,
) -> Result<candle_core::Tensor> {
    let shape = shape.into();
    if device.is_cpu() {
        let (n, size) = (shape.elem_count(), dtype.size_in_bytes());
        let bytes = n.checked_mul(size).ok_or_else(|| refused(arg, n, size))?;
        // a reservation only (no page is touched), given back at once
        Vec::<u8>::new()
            .try_reserve_exact(bytes)
            .map_err(|_| refused(arg, n, size))?;
    }
    Ok(candle_core::Tensor::zeros(shape, dtype, device)?)
}

/// The error of a zeros call for `n` elements of `size` bytes that the allocator refused.
fn refused(arg: &'static str, n: usize, size: usize) -> Error {
    invalid(
        arg,
        format!("{n} elements of {size} bytes: the allocator cannot give that much memory"),
    )
}
