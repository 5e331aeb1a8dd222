//! How a weight lies on the device (codes padded to 16 bytes a row, scales to 4 columns), the
//! prepared weight that owns or borrows it, and the padding copy.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut};

use crate::context::gpu;
use crate::error::{invalid, Result};
use crate::launch;
use crate::step::{Buf, DevBuf, Plan};

use super::args::{elementwise, i32v, i64v, val};
use super::names;

/// How a prepared weight lies in memory: e4m3 codes `[n, ld]` with `ld = round_up(k, 16)`
/// (zeros past k), f32 scales `[ceil(n/bn), scale_ld]` with
/// `scale_ld = round_up(ceil(k/bk), 4)` (zeros past the last K-block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightLayout {
    pub n: usize,
    pub k: usize,
    pub bn: usize,
    pub bk: usize,
    pub ld: usize,
    pub scale_ld: usize,
}

impl WeightLayout {
    /// The layout of an `[n, k]` weight in `[bn, bk]` blocks; errors for empty shapes and
    /// sizes past the kernels' i32 indexing.
    pub fn new([n, k]: [usize; 2], [bn, bk]: [usize; 2]) -> Result<Self> {
        if n == 0 || k == 0 || bn == 0 || bk == 0 {
            return Err(invalid(
                "weight",
                format!("shape [{n}, {k}] and block [{bn}, {bk}] must be non-zero"),
            ));
        }
        if n > i32::MAX as usize || k > i32::MAX as usize - 16 {
            return Err(invalid(
                "weight",
                format!("[{n}, {k}] exceeds the kernels' i32 indexing"),
            ));
        }
        Ok(Self {
            n,
            k,
            bn,
            bk,
            ld: k.next_multiple_of(16),
            scale_ld: k.div_ceil(bk).next_multiple_of(4),
        })
    }

    /// Scale rows and K-blocks of the checkpoint layout.
    pub fn scale_dims(&self) -> [usize; 2] {
        [self.n.div_ceil(self.bn), self.k.div_ceil(self.bk)]
    }
}

/// A weight in the layout every path reads ([`WeightLayout`]), borrowed: the codes `[n, ld]`
/// (16-byte aligned) and the scales `[ceil(n/bn), scale_ld]`. Checkpoints with K a multiple
/// of 16 need no copy of their codes (see [`WeightLayout::codes_need_padding`]).
#[derive(Clone, Copy)]
pub struct WeightRef<'a> {
    pub data: &'a CudaView<'a, u8>,
    pub scales: &'a CudaView<'a, f32>,
    pub layout: WeightLayout,
}

impl WeightLayout {
    /// Whether the checkpoint's `[n, k]` codes need a padded copy (k not a multiple of 16).
    pub fn codes_need_padding(&self) -> bool {
        self.ld != self.k
    }

    /// Whether the checkpoint's scales need a padded copy (K-blocks not a multiple of 4).
    pub fn scales_need_padding(&self) -> bool {
        self.scale_ld != self.scale_dims()[1]
    }
}

/// A weight fully copied into [`WeightLayout`] (codes and scales), for tests and callers that
/// hold no device copy of their own. Layers keep their codes in place where they can, padding
/// only what needs it ([`pad_rows`]).
pub struct PreparedWeight {
    pub(crate) data: CudaSlice<u8>,
    pub(crate) scales: CudaSlice<f32>,
    pub(crate) layout: WeightLayout,
}

impl std::fmt::Debug for PreparedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PreparedWeight {{ {:?} }}", self.layout)
    }
}

/// Element types [`pad_rows`] copies.
pub trait PadElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {
    const KERNEL: &'static str;
}

impl PadElement for u8 {
    const KERNEL: &'static str = names::PAD[0];
}

impl PadElement for f32 {
    const KERNEL: &'static str = names::PAD[1];
}

/// The plan copying `[rows, cols]` (argument 0) into `[rows, ld]` with zeros past `cols`
/// (argument 1).
pub fn plan_pad_rows<T: PadElement>(rows: usize, cols: usize, ld: usize) -> Plan {
    let mut plan = Plan::default();
    plan.kernel(elementwise(
        names::QUANT_MODULE,
        T::KERNEL.to_string(),
        rows * ld,
        vec![
            val(Buf::Arg(0)),
            val(Buf::Arg(1)),
            i32v(rows),
            i32v(cols),
            i64v(ld),
        ],
    ));
    plan
}

/// `src [rows, cols]` copied into a new `[rows, ld]` buffer, zeros past `cols`.
pub fn pad_rows<T: PadElement>(
    stream: &Arc<CudaStream>,
    src: &CudaView<'_, T>,
    rows: usize,
    cols: usize,
    ld: usize,
) -> Result<CudaSlice<T>> {
    if src.len() != rows * cols || ld < cols {
        return Err(invalid(
            "src",
            format!(
                "expected [{rows}, {cols}] (<= ld {ld}), got {} values",
                src.len()
            ),
        ));
    }
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(invalid("src", "rows and columns must fit in i32"));
    }
    let g = gpu(stream)?;
    let mut out = stream.alloc_zeros::<T>(rows * ld)?;
    {
        let size = std::mem::size_of::<T>();
        let (s, _g1) = src.device_ptr(stream);
        let (o, _g2) = out.device_ptr_mut(stream);
        let args = [
            DevBuf {
                ptr: s,
                bytes: rows * cols * size,
            },
            DevBuf {
                ptr: o,
                bytes: rows * ld * size,
            },
        ];
        launch::execute(&g, stream, &plan_pad_rows::<T>(rows, cols, ld), &args)?;
    }
    Ok(out)
}

impl PreparedWeight {
    /// From the checkpoint layout: `data` e4m3 `[N, K]`, `scales` `[ceil(N/bn), ceil(K/bk)]`.
    pub fn new(
        stream: &Arc<CudaStream>,
        data: &CudaView<'_, u8>,
        scales: &CudaView<'_, f32>,
        shape: [usize; 2],
        block: [usize; 2],
    ) -> Result<Self> {
        let layout = WeightLayout::new(shape, block)?;
        let [n, k] = shape;
        let [nb, kb] = layout.scale_dims();
        Ok(Self {
            data: pad_rows(stream, data, n, k, layout.ld)?,
            scales: pad_rows(stream, scales, nb, kb, layout.scale_ld)?,
            layout,
        })
    }

    /// `[N, K]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.layout.n, self.layout.k]
    }

    /// `[bn, bk]`.
    pub fn block(&self) -> [usize; 2] {
        [self.layout.bn, self.layout.bk]
    }

    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// Device bytes held.
    pub fn device_bytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }

    /// Views for [`fp8_linear`], good while the two views live (`let (d, s) = (w.data_view(),
    /// w.scales_view()); fp8_linear(.., &w.as_ref(&d, &s), ..)`).
    pub fn as_ref<'a>(
        &self,
        data: &'a CudaView<'a, u8>,
        scales: &'a CudaView<'a, f32>,
    ) -> WeightRef<'a> {
        WeightRef {
            data,
            scales,
            layout: self.layout,
        }
    }

    pub fn data_view(&self) -> CudaView<'_, u8> {
        self.data.as_view()
    }

    pub fn scales_view(&self) -> CudaView<'_, f32> {
        self.scales.as_view()
    }
}
