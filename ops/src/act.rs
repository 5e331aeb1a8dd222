//! SwiGLU's `silu(gate) · up` as one op: on f32 CPU tensors one pass of the CPU backend's
//! vectorized kernel, elsewhere Candle's `silu` and product. The decision is made here, once per
//! call.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use crate::error::{Error, Result};
use crate::storage::{contiguous, ParkedError};

/// `silu(gate) · up`, element-wise, for `gate` and `up` of one shape. f32 on the CPU runs
/// `fp8nsa_cpu::act::silu_mul` (one pass, no temporary, the exponential vectorized); other
/// devices and dtypes run `candle_nn::ops::silu(gate) * up`. Both agree to a few ulp.
///
/// ```
/// use candle_core::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let g = Tensor::randn(0f32, 3.0, (2, 5, 64), &dev)?;
/// let u = Tensor::randn(0f32, 1.0, (2, 5, 64), &dev)?;
/// let y = fp8nsa_ops::silu_mul(&g, &u)?;
/// let want = (candle_nn::ops::silu(&g)? * &u)?;
/// let diff = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// assert!(fp8nsa_ops::silu_mul(&g, &u.narrow(2, 0, 8)?).is_err()); // shapes differ
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        return Err(Error::Shape {
            arg: "up",
            expected: format!("{:?}, the gate's shape", gate.dims()),
            got: up.dims().to_vec(),
        });
    }
    let fused = [gate, up]
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32);
    if !fused {
        return Ok((candle_nn::ops::silu(gate)? * up)?);
    }
    let op = SiluMulOp {
        err: ParkedError::new(),
    };
    let y = gate
        .contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &op)
        .map_err(|e| op.err.or(e))?;
    Ok(y)
}

struct SiluMulOp {
    err: ParkedError,
}

impl CustomOp2 for SiluMulOp {
    fn name(&self) -> &'static str {
        "fp8nsa-silu-mul"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (CpuStorage::F32(gd), CpuStorage::F32(ud)) = (gs, us) else {
                return Err(Error::DType {
                    arg: "gate",
                    expected: "f32 gate and up",
                    got: gs.dtype(),
                });
            };
            let (g, u) = (contiguous("gate", gd, gl)?, contiguous("up", ud, ul)?);
            let mut y = vec![0f32; g.len()];
            fp8nsa_cpu::act::silu_mul(g, u, &mut y)?;
            Ok((CpuStorage::F32(y), gl.shape().clone()))
        })())
    }
}
