//! The one Candle op of selection attention: `(q, k, v)` token-packed -> `o [Σtq, Hq, Dv]` in
//! q's dtype, with the lse `[Σtq, Hq]` f32 parked as a second output. `cpu_fwd` and
//! `cuda_fwd` each run the plan the layer made before applying it.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Storage, Tensor};
use fp8nsa_cpu::nsa::SelectionPlan;
use fp8nsa_types::AttnDims;

use super::cuda;
use super::selection::HostSelection;
use crate::error::{invalid, Error, Result};
use crate::storage::{contiguous, from_f32, ParkedError, SecondOutput};

/// A call checked and planned for one device.
pub(crate) enum SelPlan<'a> {
    /// fp8nsa-cpu's kernel over the validated host selection.
    Cpu(SelectionPlan<'a>, &'a HostSelection),
    /// fp8nsa-cuda's kernel, the selection on the device.
    Cuda(Box<cuda::CudaSel>),
}

pub(crate) struct SelectionOp<'a> {
    dims: AttnDims,
    scale: f32,
    plan: SelPlan<'a>,
    lse: SecondOutput,
    err: ParkedError,
}

impl<'a> SelectionOp<'a> {
    pub(crate) fn new(dims: AttnDims, scale: f32, plan: SelPlan<'a>) -> Self {
        Self {
            dims,
            scale,
            plan,
            lse: SecondOutput::new(),
            err: ParkedError::new(),
        }
    }

    /// Applies the op to token-packed `q`, `k`, `v`: `(o, lse)`.
    pub(crate) fn apply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (hq, hkv, d, dv) = (
            self.dims.hq(),
            self.dims.hkv(),
            self.dims.d(),
            self.dims.dv(),
        );
        let (backend, kernel) = match &self.plan {
            SelPlan::Cpu(..) => ("cpu", "cpu-selection".to_string()),
            SelPlan::Cuda(c) => ("cuda", format!("cuda-selection, {}", c.describe())),
        };
        tracing::debug!(
            op = "nsa_selection",
            backend,
            kernel,
            tq = q.dims()[0],
            hq,
            hkv,
            d,
            dv
        );
        let o = q
            .contiguous()?
            .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, self)
            .map_err(|e| self.err.or(e))?;
        Ok((o, self.lse.take()?))
    }

    fn cpu(
        &self,
        plan: &SelectionPlan<'_>,
        sel: &HostSelection,
        (qs, ql): (&CpuStorage, &Layout),
        (ks, kl): (&CpuStorage, &Layout),
        (vs, vl): (&CpuStorage, &Layout),
    ) -> Result<(CpuStorage, Shape)> {
        let (hq, dv) = (self.dims.hq(), self.dims.dv());
        let tq = ql.dims()[0];
        let mut o = vec![0f32; tq * hq * dv];
        let mut lse = vec![0f32; tq * hq];
        macro_rules! go {
            ($q:expr, $k:expr, $v:expr) => {
                plan.run(
                    contiguous("q", $q, ql)?,
                    contiguous("k", $k, kl)?,
                    contiguous("v", $v, vl)?,
                    sel.as_slice(),
                    self.scale,
                    &mut o,
                    &mut lse,
                )?
            };
        }
        match (qs, ks, vs) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => go!(q, k, v),
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => go!(q, k, v),
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => go!(q, k, v),
            _ => {
                return Err(Error::DType {
                    arg: "q, k, v",
                    expected: "one of f32, bf16, f16 for all three",
                    got: qs.dtype(),
                })
            }
        }
        self.lse.put(Storage::Cpu(CpuStorage::F32(lse)), (tq, hq));
        Ok((from_f32(o, qs.dtype()), Shape::from((tq, hq, dv))))
    }
}

impl CustomOp3 for SelectionOp<'_> {
    fn name(&self) -> &'static str {
        "fp8nsa-nsa-selection"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let SelPlan::Cpu(plan, sel) = &self.plan else {
                return Err(invalid(
                    "q",
                    "the call was planned for CUDA and got CPU tensors",
                ));
            };
            self.cpu(plan, sel, (qs, ql), (ks, kl), (vs, vl))
        })())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.err.park((|| {
            let SelPlan::Cuda(call) = &self.plan else {
                return Err(invalid(
                    "q",
                    "the call was planned for the CPU and got CUDA tensors",
                ));
            };
            let (o, lse) = cuda::run(call, self.dims, (qs, ql), (ks, kl), (vs, vl))?;
            let tq = ql.dims()[0];
            let (hq, dv) = (self.dims.hq(), self.dims.dv());
            self.lse.put(Storage::Cuda(lse), (tq, hq));
            Ok((o, Shape::from((tq, hq, dv))))
        })())
    }
}
