//! The one Candle op of `Fp8Linear`: `x [M, K] -> y [M, N]` in x's dtype, with a `cpu_fwd` and
//! a `cuda_fwd` that each run the plan the layer made before applying it.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Storage, Tensor};
use fp8nsa_cpu::linear::LinearPlan;
use fp8nsa_types::{CpuFp8Path, CudaFp8Path, TpuKernel};

use super::{cuda, Fp8BlockWeight};
use crate::error::{invalid, Error, Result};
use crate::storage::{f32_slice, fp8_bytes, from_f32, ParkedError};

/// Which implementation an `Fp8Linear` call ran, returned by
/// [`Fp8Linear::forward_with_path`](super::Fp8Linear::forward_with_path).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Path {
    /// fp8nsa-cpu's GEMV (decode) or panel GEMM, and the SIMD tier it ran at.
    Cpu(CpuFp8Path),
    /// fp8nsa-cuda's path: cuBLASLt, our tensor-core or small-M kernel, or dequantize + cuBLAS.
    Cuda(CudaFp8Path),
    /// A PJRT program with this fp8 kernel variant.
    Pjrt(TpuKernel),
}

/// A call checked and planned for one device.
pub(crate) enum CallPlan {
    Cpu(LinearPlan),
    Cuda(cuda::CudaCall),
}

pub(crate) struct Fp8LinearOp<'a> {
    weight: &'a Fp8BlockWeight,
    /// The bias as f32 on the host (the CPU kernels add it).
    bias: Option<&'a [f32]>,
    plan: CallPlan,
    /// The CPU op's output shape: `x`'s with N last (the CPU op reads `x` of any rank in
    /// place, so a call makes no views around it); the CUDA op gives `[M, N]`.
    out: Shape,
    /// What ran on CUDA when it differs from the plan (a cuBLASLt refusal at run time).
    ran: Mutex<Option<CudaFp8Path>>,
    err: ParkedError,
}

impl<'a> Fp8LinearOp<'a> {
    pub(crate) fn new(
        weight: &'a Fp8BlockWeight,
        bias: Option<&'a [f32]>,
        plan: CallPlan,
        out: Shape,
    ) -> Self {
        Self {
            weight,
            bias,
            plan,
            out,
            ran: Mutex::new(None),
            err: ParkedError::new(),
        }
    }

    /// Applies the op to `x [.., K]` (contiguous; `[M, K]` for CUDA); a failure inside it
    /// comes back typed.
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op1_no_bwd(self).map_err(|e| self.err.or(e))
    }

    /// Whether the op runs on the CPU (and gives its output the caller's shape itself).
    pub(crate) fn on_cpu(&self) -> bool {
        matches!(self.plan, CallPlan::Cpu(_))
    }

    /// The output shape the caller asked for.
    pub(crate) fn out_shape(&self) -> &Shape {
        &self.out
    }

    /// The path that ran (after the op was applied) or that is planned (before).
    pub(crate) fn path(&self) -> Fp8Path {
        match &self.plan {
            CallPlan::Cpu(p) => Fp8Path::Cpu(p.path()),
            CallPlan::Cuda(c) => {
                let ran = *self.ran.lock().unwrap_or_else(|p| p.into_inner());
                Fp8Path::Cuda(ran.unwrap_or_else(|| c.path()))
            }
        }
    }

    fn cpu(&self, plan: &LinearPlan, xs: &CpuStorage, xl: &Layout) -> Result<CpuStorage> {
        let s = plan.shape();
        let x = f32_slice("x", xs, xl)?;
        let w = self.weight;
        let (data, dl) = w.data().storage_and_layout();
        let (scales, sl) = w.scales().storage_and_layout();
        let (codes, scales) = host_weight(&data, dl, &scales, sl)?;
        let mut out = vec![0f32; s.m() * s.n()];
        let nan_free = self.weight.nan_free(&codes);
        plan.assume_nan_free(nan_free)
            .run(&x, &codes, scales, self.bias, &mut out)?;
        Ok(from_f32(out, xs.dtype()))
    }
}

/// A CPU weight's codes and scales as host slices, from the storages of its two tensors.
pub(crate) fn host_weight<'g>(
    data: &'g Storage,
    dl: &Layout,
    scales: &'g Storage,
    sl: &Layout,
) -> Result<(std::borrow::Cow<'g, [u8]>, &'g [f32])> {
    let (Storage::Cpu(data), Storage::Cpu(scales)) = (data, scales) else {
        return Err(invalid("weight", "must be on the CPU for the CPU kernels"));
    };
    let codes = fp8_bytes("weight", data, dl)?;
    let scales = match scales {
        CpuStorage::F32(v) => {
            let (a, b) = sl
                .contiguous_offsets()
                .ok_or_else(|| invalid("scales", "must be contiguous"))?;
            &v[a..b]
        }
        other => {
            return Err(Error::DType {
                arg: "scales",
                expected: "f32",
                got: other.dtype(),
            })
        }
    };
    Ok((codes, scales))
}

impl CustomOp1 for Fp8LinearOp<'_> {
    fn name(&self) -> &'static str {
        "fp8nsa-fp8-linear"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let CallPlan::Cpu(plan) = &self.plan else {
                return Err(invalid(
                    "x",
                    "the call was planned for CUDA and got a CPU tensor",
                ));
            };
            Ok((self.cpu(plan, xs, xl)?, self.out.clone()))
        })())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.err.park((|| {
            let CallPlan::Cuda(call) = &self.plan else {
                return Err(invalid(
                    "x",
                    "the call was planned for the CPU and got a CUDA tensor",
                ));
            };
            let (out, shape, ran) = cuda::run(call, xs, xl)?;
            *self.ran.lock().unwrap_or_else(|p| p.into_inner()) = Some(ran);
            Ok((out, shape))
        })())
    }
}
