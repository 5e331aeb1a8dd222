//! Dense f32 projections: `y = x · Wᵀ + b`, as `candle_nn::Linear` computes it, with one row on
//! the CPU (a decode step) run by the CPU backend's f32 GEMV instead of a general matrix
//! product. The decision is made here, once per call.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Module, Shape, Tensor};

use crate::error::{Error, Result};
use crate::storage::{contiguous, ParkedError};

/// `x [.., k] · weight [n, k]ᵀ (+ bias [n])`. One row of f32 on the CPU with an f32 weight
/// runs `fp8nsa_cpu::linear::gemv_f32` (four weight rows per pass, the rows ahead prefetched);
/// everything else is `candle_nn::Linear`'s matmul. Both sum in f32; they agree to rounding.
///
/// ```
/// use candle_core::{Device, Module, Tensor};
///
/// let dev = Device::Cpu;
/// let w = Tensor::randn(0f32, 1.0, (576, 300), &dev)?;
/// let x = Tensor::randn(0f32, 1.0, (1, 1, 300), &dev)?;
/// let y = fp8nsa_ops::dense_linear(&x, &w, None)?;
/// let want = candle_nn::Linear::new(w, None).forward(&x)?;
/// assert_eq!(y.dims(), &[1, 1, 576]);
/// let diff = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dense_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let one_row = x.dims().iter().rev().skip(1).product::<usize>() == 1;
    let gemv = one_row
        && x.device().is_cpu()
        && weight.device().is_cpu()
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && weight.rank() == 2
        && weight.is_contiguous();
    if !gemv {
        return Ok(candle_nn::Linear::new(weight.clone(), bias.cloned()).forward(x)?);
    }
    let op = GemvOp {
        err: ParkedError::new(),
    };
    let y = x
        .contiguous()?
        .apply_op2_no_bwd(weight, &op)
        .map_err(|e| op.err.or(e))?;
    Ok(match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

struct GemvOp {
    err: ParkedError,
}

impl CustomOp2 for GemvOp {
    fn name(&self) -> &'static str {
        "fp8nsa-gemv-f32"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (CpuStorage::F32(xd), CpuStorage::F32(wd)) = (xs, ws) else {
                return Err(Error::DType {
                    arg: "x",
                    expected: "f32 activations and weight",
                    got: xs.dtype(),
                });
            };
            let (x, w) = (contiguous("x", xd, xl)?, contiguous("weight", wd, wl)?);
            let (n, k) = wl.shape().dims2()?;
            let mut y = vec![0f32; n];
            fp8nsa_cpu::linear::gemv_f32(x, w, n, k, None, &mut y)?;
            let mut dims = xl.dims().to_vec();
            if let Some(last) = dims.last_mut() {
                *last = n;
            }
            Ok((CpuStorage::F32(y), Shape::from(dims)))
        })())
    }
}
