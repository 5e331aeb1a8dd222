//! SwiGLU's `silu(gate) · up` as one op, and the residual add: on f32 CPU tensors one pass of the
//! CPU backend's kernels on rayon's pool, elsewhere Candle's ops. The decision is made here, once
//! per call.

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

/// `x + h` for tensors of one shape: a decoder layer's residual add. f32 on the CPU runs
/// `fp8nsa_cpu::act::add` on rayon's pool, the pool every other kernel of the step runs on;
/// Candle's add of a tensor of 64Ki elements or more runs on Candle's own thread pool, whose
/// thread spins after each op and so takes a core from the kernel that follows (~3% of a
/// 512-token prefill on 2 cores). Other devices and dtypes run Candle's add. The same bits
/// either way.
///
/// ```
/// use candle_core::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let x = Tensor::randn(0f32, 1.0, (2, 300, 576), &dev)?;
/// let h = Tensor::randn(0f32, 1.0, (2, 300, 576), &dev)?;
/// let y = fp8nsa_ops::residual_add(&x, &h)?;
/// let want = (&x + &h)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
/// assert!(fp8nsa_ops::residual_add(&x, &h.narrow(2, 0, 8)?).is_err()); // shapes differ
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn residual_add(x: &Tensor, h: &Tensor) -> Result<Tensor> {
    if x.dims() != h.dims() {
        return Err(Error::Shape {
            arg: "h",
            expected: format!("{:?}, the residual's shape", x.dims()),
            got: h.dims().to_vec(),
        });
    }
    let fused = [x, h]
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32);
    if !fused {
        return Ok((x + h)?);
    }
    let op = AddOp {
        err: ParkedError::new(),
    };
    let y = x
        .contiguous()?
        .apply_op2_no_bwd(&h.contiguous()?, &op)
        .map_err(|e| op.err.or(e))?;
    Ok(y)
}

struct AddOp {
    err: ParkedError,
}

impl CustomOp2 for AddOp {
    fn name(&self) -> &'static str {
        "fp8nsa-residual-add"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        hs: &CpuStorage,
        hl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (CpuStorage::F32(xd), CpuStorage::F32(hd)) = (xs, hs) else {
                return Err(Error::DType {
                    arg: "x",
                    expected: "f32 x and h",
                    got: xs.dtype(),
                });
            };
            let (x, h) = (contiguous("x", xd, xl)?, contiguous("h", hd, hl)?);
            let mut y = vec![0f32; x.len()];
            fp8nsa_cpu::act::add(x, h, &mut y)?;
            Ok((CpuStorage::F32(y), xl.shape().clone()))
        })())
    }
}
