//! The fp8 block-scaled linear layer on CUDA: activation quantization, cuBLASLt block scaling,
//! our tensor-core and small-M kernels, and dequantize + cuBLAS as the last resort.
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use fp8nsa_cuda::fp8::{fp8_linear, PreparedWeight};
//! use fp8nsa_types::{ActQuant, CudaFp8Kernel};
//!
//! let stream = CudaContext::new(0)?.default_stream();
//! let (m, n, k) = (7, 576, 3884);
//! let codes = stream.clone_htod(&vec![0x38u8; n * k])?; // e4m3 1.0
//! let scales = stream.clone_htod(&vec![0.5f32; n.div_ceil(128) * k.div_ceil(128)])?;
//! let w = PreparedWeight::new(&stream, &codes.as_view(), &scales.as_view(), [n, k], [128, 128])?;
//! let (wd, ws) = (w.data_view(), w.scales_view());
//! let x = stream.clone_htod(&vec![1f32; m * k])?;
//! let mut y = stream.alloc_zeros::<f32>(m * n)?;
//! let path = fp8_linear(&stream, &x.as_view(), &w.as_ref(&wd, &ws), None, m, ActQuant::Group,
//!     CudaFp8Kernel::Auto, &mut y.as_view_mut())?;
//! println!("ran {path}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod args;
mod build;
pub(crate) mod names;
mod plan;
mod weight;

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

pub use plan::{
    plan, Fp8Path, MmaTile, CUBLASLT_MIN_M, MAX_SPLITS, SMALL_M_MAX, SMALL_M_PREFERRED,
};

use fp8nsa_types::{ActQuant, CudaFp8Kernel, LinearShape};

use crate::context::{gpu, DeviceInfo};
use crate::element::Element;
use crate::error::{invalid, Result};
use crate::launch;
use crate::step::{DevBuf, Dtype};

pub use build::plan_fp8_linear;
pub use weight::{pad_rows, plan_pad_rows, PadElement, PreparedWeight, WeightLayout, WeightRef};

/// `out[m, n] = x[m, k] . W^T (+ bias)` per the numerics contract, in x's dtype, on `stream`.
/// `bias`, when given, is `[n]` f32. Returns the path that ran. Every element of `out` is
/// written. A forced `kernel` that does not apply is an error saying why; with
/// `CudaFp8Kernel::Auto` a cuBLASLt refusal at run time falls back to our tensor-core kernel.
#[allow(clippy::too_many_arguments)]
pub fn fp8_linear<T: Element>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    w: &WeightRef<'_>,
    bias: Option<&CudaView<'_, f32>>,
    m: usize,
    act: ActQuant,
    kernel: CudaFp8Kernel,
    out: &mut CudaViewMut<'_, T>,
) -> Result<Fp8Path> {
    let lay = w.layout;
    let (n, k) = (lay.n, lay.k);
    check_linear_args(&lay, m, act, x.len(), out.len(), bias.map(|b| b.len()))?;
    let [nb, _] = lay.scale_dims();
    if w.data.len() != n * lay.ld {
        return Err(invalid(
            "weight",
            format!(
                "codes: expected [{n}, {}] (rows padded to 16 bytes), got {} bytes",
                lay.ld,
                w.data.len()
            ),
        ));
    }
    if w.scales.len() != nb * lay.scale_ld {
        return Err(invalid(
            "weight",
            format!(
                "scales: expected [{nb}, {}], got {} values",
                lay.scale_ld,
                w.scales.len()
            ),
        ));
    }
    let g = gpu(stream)?;
    let shape = LinearShape {
        m,
        n,
        k,
        bn: lay.bn,
        bk: lay.bk,
    };
    let dtype = Dtype::of::<T>();
    let lt_key = (
        n,
        m.next_multiple_of(crate::blas::cublaslt::TOKEN_ALIGN),
        lay.ld,
        dtype,
    );
    // Auto's cuBLASLt pick falls back to our kernel when cuBLASLt refuses the problem
    let may_fall_back = |path: Fp8Path| path == Fp8Path::CublasLt && kernel == CudaFp8Kernel::Auto;
    let fallback = || plan(&g.info, &shape, act, CudaFp8Kernel::Mma);
    let mut path = plan(&g.info, &shape, act, kernel)?;
    if may_fall_back(path) && g.lt_refused(lt_key) {
        path = fallback()?;
    }
    let size = dtype.size();
    let (xp, _g1) = x.device_ptr(stream);
    let (wp, _g2) = w.data.device_ptr(stream);
    let (sp, _g3) = w.scales.device_ptr(stream);
    // the kernels read the codes in 16-byte vectors; cuBLASLt wants 16-byte scale pointers
    if wp % 16 != 0 || sp % 16 != 0 {
        return Err(invalid(
            "weight",
            "codes and scales must start on a 16-byte boundary",
        ));
    }
    let (bp, _g4) = match bias {
        Some(b) => {
            let (p, g) = b.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    let (op, _g5) = out.device_ptr_mut(stream);
    let args = [
        DevBuf {
            ptr: xp,
            bytes: m * k * size,
        },
        DevBuf {
            ptr: wp,
            bytes: w.data.len(),
        },
        DevBuf {
            ptr: sp,
            bytes: 4 * w.scales.len(),
        },
        DevBuf {
            ptr: bp,
            bytes: 4 * n,
        },
        DevBuf {
            ptr: op,
            bytes: m * n * size,
        },
    ];
    let run = |path: Fp8Path| {
        let p = plan_fp8_linear(&lay, m, act, path, dtype, bias.is_some(), op % 16 == 0);
        launch::execute(&g, stream, &p, &args)
    };
    match run(path) {
        Ok(()) => Ok(path),
        Err(e) if may_fall_back(path) => {
            let fallback = fallback()?;
            g.refuse_lt(lt_key);
            tracing::warn!(op = "fp8_linear", backend = "cuda", error = %e, fallback = %fallback, "cuBLASLt refused this problem; not asking again");
            run(fallback)?;
            Ok(fallback)
        }
        Err(e) => Err(e),
    }
}

/// The argument checks of [`fp8_linear`], shared with the emulator.
pub fn check_linear_args(
    w: &WeightLayout,
    m: usize,
    act: ActQuant,
    x_len: usize,
    out_len: usize,
    bias_len: Option<usize>,
) -> Result<()> {
    let (n, k) = (w.n, w.k);
    if m == 0 {
        return Err(invalid("x", "needs at least one row"));
    }
    if m > i32::MAX as usize / 2 || m.saturating_mul(w.ld) > i32::MAX as usize * 16 {
        return Err(invalid(
            "x",
            format!("{m} rows exceed the kernels' indexing"),
        ));
    }
    if x_len != m * k {
        return Err(invalid(
            "x",
            format!("expected [{m}, {k}] = {} elements, got {x_len}", m * k),
        ));
    }
    if out_len != m * n {
        return Err(invalid(
            "out",
            format!("expected [{m}, {n}] = {} elements, got {out_len}", m * n),
        ));
    }
    if let Some(b) = bias_len {
        if b != n {
            return Err(invalid("bias", format!("expected [{n}], got {b} values")));
        }
    }
    if let ActQuant::Block2d { bm: 0 } = act {
        return Err(invalid("act", "Block2d row block must be at least 1"));
    }
    if m.div_ceil(MmaTile::M16.rows()) > 65535 {
        return Err(invalid(
            "x",
            format!("{m} rows need more than 65535 row tiles"),
        ));
    }
    Ok(())
}

/// The device facts the planner uses, for tests and tools that plan without a stream.
pub fn device_info_for(cc: (i32, i32), sms: u32, smem_optin: u32) -> Option<DeviceInfo> {
    Some(DeviceInfo {
        cc,
        sms,
        smem_optin,
        family: crate::ptx::Family::for_capability(cc)?,
    })
}
