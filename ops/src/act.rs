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

/// A decoder layer's residual add and the RMSNorm that follows it (vLLM's
/// `fused_add_rms_norm`): `(x + h, rms_norm(x + h) · weight)`, for `x` and `h` of one shape
/// `[.., D]` and `weight [D]`. f32 on the CPU runs `fp8nsa_cpu::act::add_rms_norm` (one pass,
/// one op), elsewhere [`residual_add`] then `candle_nn::ops::rms_norm`. The same bits either
/// way.
///
/// ```
/// use candle_core::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let x = Tensor::randn(0f32, 1.0, (1, 3, 64), &dev)?;
/// let h = Tensor::randn(0f32, 1.0, (1, 3, 64), &dev)?;
/// let w = Tensor::randn(0f32, 1.0, 64, &dev)?;
/// let (sum, normed) = fp8nsa_ops::add_rms_norm(&x, &h, &w, 1e-5)?;
/// let want = (&x + &h)?;
/// let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
/// assert_eq!(flat(&sum)?, flat(&want)?);
/// assert_eq!(flat(&normed)?, flat(&candle_nn::ops::rms_norm(&want, &w, 1e-5)?)?);
/// assert!(fp8nsa_ops::add_rms_norm(&x, &h, &w.narrow(0, 0, 8)?, 1e-5).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn add_rms_norm(x: &Tensor, h: &Tensor, weight: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    if x.dims() != h.dims() {
        return Err(Error::Shape {
            arg: "h",
            expected: format!("{:?}, the shape of x", x.dims()),
            got: h.dims().to_vec(),
        });
    }
    let d = x.dims().last().copied().unwrap_or(0);
    if weight.dims() != [d] {
        return Err(Error::Shape {
            arg: "weight",
            expected: format!("[{d}], x's last dimension"),
            got: weight.dims().to_vec(),
        });
    }
    let fused = [x, h, weight]
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32);
    if !fused || x.elem_count() == 0 || x.rank() == 0 {
        let sum = residual_add(x, h)?;
        let normed = candle_nn::ops::rms_norm(&sum.contiguous()?, weight, eps)?;
        return Ok((sum, normed));
    }
    let op = AddRmsNorm {
        eps,
        err: ParkedError::new(),
    };
    // both results in one buffer: [sum | normed], x's shape with its first dimension doubled,
    // so each half is one narrow of it (a view per result: a decode step makes 60 of these
    // calls, and every view is an allocation)
    let both = x
        .contiguous()?
        .apply_op3_no_bwd(&h.contiguous()?, &weight.contiguous()?, &op)
        .map_err(|e| op.err.or(e))?;
    let d0 = x.dims()[0];
    Ok((both.narrow(0, 0, d0)?, both.narrow(0, d0, d0)?))
}

struct AddRmsNorm {
    eps: f32,
    err: ParkedError,
}

impl candle_core::CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "fp8nsa-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        hs: &CpuStorage,
        hl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (CpuStorage::F32(xd), CpuStorage::F32(hd), CpuStorage::F32(wd)) = (xs, hs, ws)
            else {
                return Err(Error::DType {
                    arg: "x",
                    expected: "f32 x, h and weight",
                    got: xs.dtype(),
                });
            };
            let (x, h, w) = (
                contiguous("x", xd, xl)?,
                contiguous("h", hd, hl)?,
                contiguous("weight", wd, wl)?,
            );
            let mut both = vec![0f32; 2 * x.len()];
            let (sum, normed) = both.split_at_mut(x.len());
            fp8nsa_cpu::act::add_rms_norm(x, h, w, self.eps, sum, normed)?;
            let mut dims = xl.dims().to_vec();
            dims[0] *= 2;
            Ok((CpuStorage::F32(both), Shape::from(dims)))
        })())
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The fused op equals the residual add then Candle's RMSNorm, bit for bit, for a decode
    /// row and for a prefill's rows (both sides' parallel paths); the results are the input's
    /// shape; mismatched shapes are typed errors.
    #[test]
    fn add_rms_norm_equals_add_then_norm() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, 576, &dev).unwrap();
        // a decode row, a prefill's rows, a batch of several (the first dimension, which the
        // op doubles, above 1) and a single vector
        let shapes: [&[usize]; 4] = [&[1, 1, 576], &[1, 100, 576], &[3, 5, 576], &[576]];
        for &shape in &shapes {
            let rows = shape.iter().product::<usize>() / 576;
            let x = Tensor::randn(0f32, 3.0, shape, &dev).unwrap();
            let h = Tensor::randn(0f32, 3.0, shape, &dev).unwrap();
            let (sum, normed) = add_rms_norm(&x, &h, &w, 1e-5).unwrap();
            assert_eq!((sum.dims(), normed.dims()), (x.dims(), x.dims()));
            let want = residual_add(&x, &h).unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&sum), flat(&want), "{rows} rows: sum");
            let wn = candle_nn::ops::rms_norm(&want, &w, 1e-5).unwrap();
            assert_eq!(flat(&normed), flat(&wn), "{rows} rows: norm");
        }
        let x = Tensor::zeros((2, 576), DType::F32, &dev).unwrap();
        let e = add_rms_norm(&x, &x.narrow(0, 0, 1).unwrap(), &w, 1e-5).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "h", .. }), "{e:?}");
        let e = add_rms_norm(&x, &x, &w.narrow(0, 0, 5).unwrap(), 1e-5).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "weight", .. }), "{e:?}");
    }
}
