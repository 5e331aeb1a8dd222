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
    let op = Elementwise {
        name: "fp8nsa-silu-mul",
        args: ["gate", "up"],
        kernel: fp8nsa_cpu::act::silu_mul,
        err: ParkedError::new(),
    };
    op.apply(gate, up, || Ok((candle_nn::ops::silu(gate)? * up)?))
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
    let op = Elementwise {
        name: "fp8nsa-residual-add",
        args: ["x", "h"],
        kernel: fp8nsa_cpu::act::add,
        err: ParkedError::new(),
    };
    op.apply(x, h, || Ok((x + h)?))
}

/// A CPU backend kernel of two equal-length inputs into an output of their length.
type SliceKernel = fn(&[f32], &[f32], &mut [f32]) -> fp8nsa_cpu::Result<()>;

/// An element-wise op of two f32 tensors of one shape: on the CPU the backend's `kernel` over
/// the contiguous slices (one pass on rayon's pool), elsewhere `fallback` (Candle's ops).
struct Elementwise {
    name: &'static str,
    /// The two operands' names, for errors.
    args: [&'static str; 2],
    kernel: SliceKernel,
    err: ParkedError,
}

impl Elementwise {
    fn apply(
        &self,
        a: &Tensor,
        b: &Tensor,
        fallback: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        if a.dims() != b.dims() {
            return Err(Error::Shape {
                arg: self.args[1],
                expected: format!("{:?}, the shape of {}", a.dims(), self.args[0]),
                got: b.dims().to_vec(),
            });
        }
        let fused = [a, b]
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == DType::F32);
        if !fused {
            return fallback();
        }
        let y = a
            .contiguous()?
            .apply_op2_no_bwd(&b.contiguous()?, self)
            .map_err(|e| self.err.or(e))?;
        Ok(y)
    }
}

impl CustomOp2 for Elementwise {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        as_: &CpuStorage,
        al: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (CpuStorage::F32(ad), CpuStorage::F32(bd)) = (as_, bs) else {
                return Err(Error::DType {
                    arg: self.args[0],
                    expected: "f32 operands",
                    got: as_.dtype(),
                });
            };
            let (a, b) = (
                contiguous(self.args[0], ad, al)?,
                contiguous(self.args[1], bd, bl)?,
            );
            let mut y = vec![0f32; a.len()];
            (self.kernel)(a, b, &mut y)?;
            Ok((CpuStorage::F32(y), al.shape().clone()))
        })())
    }
}
