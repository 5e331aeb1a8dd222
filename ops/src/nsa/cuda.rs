//! Selection attention on CUDA tensors through fp8nsa-cuda's kernel. The selection stays on
//! the device and is not validated on the host: the kernel clamps, sorts and merges every row,
//! so whatever the indices say it reads nothing out of bounds and counts each key once.

use candle_core::Tensor;
use fp8nsa_types::Seq;

use super::selection::Selection;
use crate::error::Result;

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, CustomOp1, DType, Layout, Shape};
    use fp8nsa_cuda::nsa as kernels;
    use fp8nsa_types::AttnDims;

    use super::*;
    use crate::cuda::{stream_of, view, with_storage, Stashed};
    use crate::error::{invalid, Error};

    struct NsaOp {
        k: Tensor,
        v: Tensor,
        sel: Tensor,
        /// `Some(block_size)` for block ids, `None` for ranges.
        block_size: Option<usize>,
        per_row: usize,
        seqs: Vec<Seq>,
        dims: AttnDims,
        scale: f32,
        lse: Stashed<f32>,
    }

    impl NsaOp {
        fn run<T: fp8nsa_cuda::Element + candle_core::cuda::CudaDType>(
            &self,
            qs: &CudaStorage,
            ql: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let stream = stream_of(qs);
            let q = view::<T>("q", qs, ql)?;
            let tq = ql.dims()[0];
            let AttnDims { hq, dv, .. } = self.dims;
            with_storage("k", &self.k, |ks, kl| {
                with_storage("v", &self.v, |vs, vl| {
                    with_storage("selection", &self.sel, |ss, sl| {
                        let k = view::<T>("k", ks, kl)?;
                        let v = view::<T>("v", vs, vl)?;
                        let s = view::<i32>("selection", ss, sl)?;
                        let sel = match self.block_size {
                            Some(block_size) => kernels::Selection::Blocks {
                                indices: s,
                                per_row: self.per_row,
                                block_size,
                            },
                            None => kernels::Selection::Ranges {
                                ranges: s,
                                per_row: self.per_row,
                            },
                        };
                        // SAFETY: the kernel writes every (token, head) row of o and lse.
                        let mut o = unsafe { stream.alloc::<T>(tq * hq * dv) }
                            .map_err(fp8nsa_cuda::Error::from)?;
                        // SAFETY: as above.
                        let mut lse = unsafe { stream.alloc::<f32>(tq * hq) }
                            .map_err(fp8nsa_cuda::Error::from)?;
                        let plan = kernels::selection_attention(
                            &stream,
                            &q,
                            &k,
                            &v,
                            &sel,
                            &self.seqs,
                            self.dims,
                            self.scale,
                            &mut o.as_view_mut(),
                            &mut lse.as_view_mut(),
                        )?;
                        tracing::debug!(
                            op = "nsa_selection",
                            backend = "cuda",
                            kernel = "cuda-selection",
                            warps = plan.warps,
                            splits = plan.splits,
                            tq,
                            hq,
                            hkv = self.dims.hkv,
                            d = self.dims.d,
                            dv,
                            selected = self.per_row,
                            dtype = T::SUFFIX,
                        );
                        self.lse.put(lse, qs.device().clone());
                        Ok((
                            CudaStorage::wrap_cuda_slice(o, qs.device().clone()),
                            Shape::from((tq, hq, dv)),
                        ))
                    })
                })
            })
        }
    }

    impl CustomOp1 for NsaOp {
        fn name(&self) -> &'static str {
            "fp8nsa-nsa-selection-cuda"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
            Err(invalid("q", "the CUDA op got a CPU tensor").into())
        }

        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let r = match s.dtype() {
                DType::BF16 => self.run::<half::bf16>(s, l),
                DType::F16 => self.run::<half::f16>(s, l),
                got => Err(Error::DType {
                    arg: "q",
                    expected: "bf16 or f16",
                    got,
                }),
            };
            Ok(r?)
        }
    }

    /// Token-packed `q [Σtq, Hq, D]`, `k`, `v` on one CUDA device -> `o [Σtq, Hq, Dv]` (q's
    /// dtype) and, `with_lse`, `lse [Σtq, Hq]` f32. `Error::Cuda(Unsupported)` for what the
    /// kernel does not take (the caller falls back).
    pub(crate) fn selection(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqs: &[Seq],
        sel: Selection<'_>,
        scale: f32,
        with_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (tq, hq, d) = q.dims3()?;
        let (_, hkv, _) = k.dims3()?;
        let dv = v.dims()[2];
        let (sel_t, block_size) = match sel {
            Selection::Blocks(s) => (s.indices(), Some(s.block_size())),
            Selection::Ranges(s) => (s.ranges(), None),
        };
        let op = NsaOp {
            k: k.contiguous()?,
            v: v.contiguous()?,
            sel: sel_t.to_device(q.device())?.contiguous()?,
            block_size,
            per_row: sel.dims()[3],
            seqs: seqs.to_vec(),
            dims: AttnDims { hq, hkv, d, dv },
            scale,
            lse: Stashed::new((tq, hq)),
        };
        let o = q.contiguous()?.apply_op1_no_bwd(&op)?;
        let lse = if with_lse {
            Some(op.lse.take(&o)?)
        } else {
            None
        };
        Ok((o, lse))
    }

    /// Why the kernel cannot take this call, if it cannot (checked before launching: errors
    /// from inside a Candle op reach the caller only as text).
    pub(crate) fn unsupported(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        per_row: usize,
    ) -> Option<String> {
        let (_, hq, d) = q.dims3().ok()?;
        let (_, hkv, _) = k.dims3().ok()?;
        let dv = v.dims()[2];
        if !matches!(q.dtype(), DType::BF16 | DType::F16) {
            return Some(format!(
                "no {:?} selection kernel (bf16 and f16 only)",
                q.dtype()
            ));
        }
        if let Err(why) = kernels::supports(d, dv, hq / hkv.max(1), per_row) {
            return Some(why);
        }
        // cp.async moves 16-byte rows of k and v; q is read in 4-byte pairs
        let misaligned = |t: &Tensor, bytes: usize| (t.layout().start_offset() * 2) % bytes != 0;
        if misaligned(k, 16) || misaligned(v, 16) || misaligned(q, 4) {
            return Some("q, k or v starts at an offset unaligned for vector loads".into());
        }
        None
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;
    use crate::error::Error;

    pub(crate) fn selection(
        q: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &[Seq],
        _: Selection<'_>,
        _: f32,
        _: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        Err(Error::Unsupported {
            op: "SelectionAttention",
            device: format!("{:?}", q.device()),
            hint: "fp8nsa was built without the `cuda` feature",
        })
    }

    pub(crate) fn unsupported(_: &Tensor, _: &Tensor, _: &Tensor, _: usize) -> Option<String> {
        Some("fp8nsa was built without the `cuda` feature".into())
    }
}

pub(crate) use imp::{selection, unsupported};
