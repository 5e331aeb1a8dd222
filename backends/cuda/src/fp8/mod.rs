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
mod grouped;
pub(crate) mod names;
mod plan;
mod weight;

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

pub use fp8nsa_types::{CudaFp8Path, MmaTile};
pub use plan::{plan, CUBLASLT_MIN_M, MAX_SPLITS, SMALL_M_MAX, SMALL_M_PREFERRED};

use fp8nsa_types::{ActQuant, CudaFp8Kernel, LinearShape};

use crate::context::{gpu, DeviceInfo};
use crate::element::Element;
use crate::error::{invalid, Result};
use crate::launch;
use crate::step::{DevBuf, Dtype};

pub use build::plan_fp8_linear;
pub use grouped::{check_grouped, fp8_grouped, plan_fp8_grouped, plan_grouped, row_offsets};
pub use weight::{pad_rows, plan_pad_rows, PadElement, PreparedWeight, WeightLayout, WeightRef};

/// One fp8 linear call, checked and planned once; [`execute`] runs it as it is. Made by
/// [`plan_call`] before anything launches, so a refusal reaches the caller as a typed error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Call {
    /// The CUDA context it was planned for (its paths depend on the device).
    context: usize,
    layout: WeightLayout,
    m: usize,
    act: ActQuant,
    dtype: Dtype,
    path: CudaFp8Path,
    /// Set when `Auto` picked cuBLASLt: what runs if cuBLASLt refuses the problem at run time
    /// (its heuristic is the one thing no planner can ask in advance).
    fallback: Option<CudaFp8Path>,
}

impl Fp8Call {
    /// The path the plan takes (a cuBLASLt refusal at run time may still fall back; the path
    /// that ran is what [`execute`] returns).
    pub fn path(&self) -> CudaFp8Path {
        self.path
    }

    /// `[m, n, k]`.
    pub fn dims(&self) -> [usize; 3] {
        [self.m, self.layout.n, self.layout.k]
    }
}

/// Checks and plans `out[m, n] = x[m, k] . W^T` for `T` on `stream`'s device: the sizes the
/// kernels index, the activation scheme, and the path (`kernel`, or the best that applies for
/// `CudaFp8Kernel::Auto`). A forced kernel that does not apply is `Error::Unsupported` saying
/// why.
pub fn plan_call<T: Element>(
    stream: &Arc<CudaStream>,
    layout: &WeightLayout,
    m: usize,
    act: ActQuant,
    kernel: CudaFp8Kernel,
) -> Result<Fp8Call> {
    check_call(layout, m, act)?;
    let g = gpu(stream)?;
    let shape = LinearShape::new(m, layout.n, layout.k, layout.bn, layout.bk)?;
    let dtype = Dtype::of::<T>();
    let mut path = plan(&g.info, &shape, act, kernel)?;
    let mut fallback = None;
    if path == CudaFp8Path::CublasLt && kernel == CudaFp8Kernel::Auto {
        let mma = plan(&g.info, &shape, act, CudaFp8Kernel::Mma)?;
        if g.lt_refused(lt_problem(layout, m, dtype)) {
            path = mma;
        } else {
            fallback = Some(mma);
        }
    }
    Ok(Fp8Call {
        context: stream.context().cu_ctx() as usize,
        layout: *layout,
        m,
        act,
        dtype,
        path,
        fallback,
    })
}

fn lt_problem(layout: &WeightLayout, m: usize, dtype: Dtype) -> crate::context::LtProblem {
    (
        layout.n,
        m.next_multiple_of(crate::blas::cublaslt::TOKEN_ALIGN),
        layout.ld,
        dtype,
    )
}

/// Runs a planned call: `out[m, n] = x[m, k] . W^T (+ bias)` per the numerics contract, in x's
/// dtype, on `stream`. `bias`, when given, is `[n]` f32. Every element of `out` is written.
/// Returns the path that ran: the plan's, or its fallback when cuBLASLt refused the problem
/// (remembered per device, so the next plan skips cuBLASLt). The buffers must be the ones the
/// plan describes (`Error::Invalid` naming the buffer otherwise).
pub fn execute<T: Element>(
    stream: &Arc<CudaStream>,
    call: &Fp8Call,
    x: &CudaView<'_, T>,
    w: &WeightRef<'_>,
    bias: Option<&CudaView<'_, f32>>,
    out: &mut CudaViewMut<'_, T>,
) -> Result<CudaFp8Path> {
    let lay = call.layout;
    let (m, n, k) = (call.m, lay.n, lay.k);
    if call.dtype != Dtype::of::<T>() {
        return Err(invalid("x", "element type differs from the planned call's"));
    }
    if call.context != stream.context().cu_ctx() as usize {
        return Err(invalid(
            "stream",
            "belongs to another device than the planned call's",
        ));
    }
    if w.layout != lay {
        return Err(invalid("weight", "layout differs from the planned call's"));
    }
    check_buffers(&lay, m, x.len(), out.len(), bias.map(|b| b.len()))?;
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
    let size = call.dtype.size();
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
    let run = |path: CudaFp8Path| {
        let p = plan_fp8_linear(
            &lay,
            m,
            call.act,
            path,
            call.dtype,
            bias.is_some(),
            op % 16 == 0,
        );
        launch::execute(&g, stream, &p, &args)
    };
    let refused = call.fallback.is_some() && g.lt_refused(lt_problem(&lay, m, call.dtype));
    if let (true, Some(fallback)) = (refused, call.fallback) {
        // refused since this call was planned (a caller that plans once and executes often)
        run(fallback)?;
        return Ok(fallback);
    }
    match (run(call.path), call.fallback) {
        (Ok(()), _) => Ok(call.path),
        (Err(e), Some(fallback)) => {
            g.refuse_lt(lt_problem(&lay, m, call.dtype));
            tracing::warn!(op = "fp8_linear", backend = "cuda", error = %e, fallback = %fallback, "cuBLASLt refused this problem; not asking again");
            run(fallback)?;
            Ok(fallback)
        }
        (Err(e), None) => Err(e),
    }
}

/// [`plan_call`] then [`execute`]: `out[m, n] = x[m, k] . W^T (+ bias)`, returning the path
/// that ran.
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
) -> Result<CudaFp8Path> {
    let call = plan_call::<T>(stream, &w.layout, m, act, kernel)?;
    execute(stream, &call, x, w, bias, out)
}

/// What a call must satisfy before it is planned: rows the kernels can index, a valid
/// activation scheme.
pub fn check_call(w: &WeightLayout, m: usize, act: ActQuant) -> Result<()> {
    if m == 0 {
        return Err(invalid("x", "needs at least one row"));
    }
    if m > i32::MAX as usize / 2 || m.saturating_mul(w.ld) > i32::MAX as usize * 16 {
        return Err(invalid(
            "x",
            format!("{m} rows exceed the kernels' indexing"),
        ));
    }
    if let ActQuant::Block2d { bm } = act {
        if bm == 0 || bm > i32::MAX as usize {
            return Err(invalid(
                "act",
                format!("Block2d row block must be in 1..={}, got {bm}", i32::MAX),
            ));
        }
    }
    if m.div_ceil(MmaTile::M16.rows()) > 65535 {
        return Err(invalid(
            "x",
            format!("{m} rows need more than 65535 row tiles"),
        ));
    }
    Ok(())
}

/// The buffers of a planned call have the sizes its plan reads and writes.
fn check_buffers(
    w: &WeightLayout,
    m: usize,
    x_len: usize,
    out_len: usize,
    bias_len: Option<usize>,
) -> Result<()> {
    let (n, k) = (w.n, w.k);
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
