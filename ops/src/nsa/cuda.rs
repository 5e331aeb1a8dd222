//! Selection attention on CUDA tensors through fp8nsa-cuda's kernel. The call is planned
//! before the op is applied (what the kernel does not take comes back as a reason, and the
//! caller falls back to the masked SDPA); the op's `cuda_fwd` runs that plan. The selection
//! stays on the device and is not validated on the host: the kernel clamps, sorts and merges
//! every row, so whatever the indices say it reads nothing out of bounds and counts each key
//! once.

use candle_core::Tensor;
use fp8nsa_types::Seq;

use super::paged_kv::PoolRef;
use super::selection::Selection;
use crate::error::Result;

/// A planned call, or why the kernel does not take it.
pub(crate) type Planned = std::result::Result<CudaSel, String>;

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::CudaDType;
    use candle_core::{CudaStorage, DType, Layout};
    use fp8nsa_cuda::nsa::{self as kernels, NsaCall, PageLayout, SelKind};
    use fp8nsa_types::AttnDims;

    use super::*;
    use crate::cuda::{stream_of, view, with_storage};
    use crate::error::Error;

    /// One planned call: fp8nsa-cuda's plan and the selection on the device.
    pub(crate) struct CudaSel {
        call: NsaCall,
        sel: Tensor,
        /// The block table on the device, for a call over a page pool.
        table: Option<Tensor>,
    }

    impl CudaSel {
        /// How the kernel launches, for logs.
        pub(crate) fn describe(&self) -> String {
            let p = self.call.launch();
            format!("{} warps, {} splits", p.warps, p.splits)
        }
    }

    /// Plans the kernel for contiguous token-packed `q`, `k`, `v` (with `pages`, `k` and `v`
    /// are the page pools `[num_pages * page_size, Hkv, *]`), or says why it does not take
    /// them. Arguments no path could take are errors.
    pub(crate) fn plan(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqs: &[Seq],
        sel: Selection<'_>,
        scale: f32,
        pages: Option<&PoolRef<'_>>,
    ) -> Result<Planned> {
        let (_, hq, d) = q.dims3()?;
        let (_, hkv, _) = k.dims3()?;
        let dv = v.dims()[2];
        let dims = AttnDims::new(hq, hkv, d, dv)?;
        let per_row = sel.dims()[3];
        let (entries, kind) = match sel {
            Selection::Blocks(s) => (
                s.indices(),
                SelKind::Blocks {
                    per_row,
                    block_size: s.block_size(),
                },
            ),
            Selection::Ranges(s) => (s.ranges(), SelKind::Ranges { per_row }),
        };
        if !matches!(q.dtype(), DType::BF16 | DType::F16) {
            return Ok(Err(format!(
                "no {:?} selection kernel (bf16 and f16 only)",
                q.dtype()
            )));
        }
        // cp.async moves 16-byte rows of k and v; q is read in 4-byte pairs
        let misaligned = |t: &Tensor, bytes: usize| {
            !(t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(bytes)
        };
        if misaligned(k, 16) || misaligned(v, 16) || misaligned(q, 4) {
            return Ok(Err(
                "q, k or v starts at an offset unaligned for vector loads".into(),
            ));
        }
        let stream = q.device().as_cuda_device()?.cuda_stream();
        // from here an `Unsupported` also covers a device below sm_80 (no PTX family for it)
        let layout = pages.map(|p| PageLayout {
            num_pages: p.num_pages,
            page_size: p.host.page_size(),
            max_pages: p.host.max_pages(),
        });
        let planned = match (q.dtype(), layout) {
            (DType::BF16, None) => {
                kernels::plan_call::<half::bf16>(&stream, dims, seqs, kind, scale)
            }
            (_, None) => kernels::plan_call::<half::f16>(&stream, dims, seqs, kind, scale),
            (DType::BF16, Some(l)) => {
                kernels::plan_call_paged::<half::bf16>(&stream, dims, seqs, kind, scale, l)
            }
            (_, Some(l)) => {
                kernels::plan_call_paged::<half::f16>(&stream, dims, seqs, kind, scale, l)
            }
        };
        match planned {
            Ok(call) => Ok(Ok(CudaSel {
                call,
                sel: entries.to_device(q.device())?.contiguous()?,
                table: pages
                    .map(|p| p.table.to_device(q.device())?.flatten_all()?.contiguous())
                    .transpose()?,
            })),
            Err(fp8nsa_cuda::Error::Unsupported { reason, .. }) => Ok(Err(reason)),
            Err(e) => Err(e.into()),
        }
    }

    fn run_typed<T: fp8nsa_cuda::Element + CudaDType>(
        c: &CudaSel,
        dims: AttnDims,
        (qs, ql): (&CudaStorage, &Layout),
        (ks, kl): (&CudaStorage, &Layout),
        (vs, vl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, CudaStorage)> {
        let (hq, dv) = (dims.hq(), dims.dv());
        let stream = stream_of(qs);
        let tq = ql.dims()[0];
        let (q, k, v) = (
            view::<T>("q", qs, ql)?,
            view::<T>("k", ks, kl)?,
            view::<T>("v", vs, vl)?,
        );
        with_storage("selection", &c.sel, |ss, sl| {
            let sel = view::<i32>("selection", ss, sl)?;
            // SAFETY: the kernel writes every (token, head) row of o and lse.
            let mut o =
                unsafe { stream.alloc::<T>(tq * hq * dv) }.map_err(fp8nsa_cuda::Error::from)?;
            // SAFETY: as above.
            let mut lse =
                unsafe { stream.alloc::<f32>(tq * hq) }.map_err(fp8nsa_cuda::Error::from)?;
            match &c.table {
                None => kernels::execute(
                    &stream,
                    &c.call,
                    &q,
                    &k,
                    &v,
                    &sel,
                    &mut o.as_view_mut(),
                    &mut lse.as_view_mut(),
                )?,
                Some(table) => with_storage("block_table", table, |ts, tl| {
                    let table = view::<i32>("block_table", ts, tl)?;
                    Ok(kernels::execute_paged(
                        &stream,
                        &c.call,
                        &q,
                        &k,
                        &v,
                        &table,
                        &sel,
                        &mut o.as_view_mut(),
                        &mut lse.as_view_mut(),
                    )?)
                })?,
            };
            let dev = qs.device().clone();
            Ok((
                CudaStorage::wrap_cuda_slice(o, dev.clone()),
                CudaStorage::wrap_cuda_slice(lse, dev),
            ))
        })
    }

    /// Runs a planned call (the op's `cuda_fwd`): `(o, lse)`.
    pub(crate) fn run(
        c: &CudaSel,
        dims: AttnDims,
        q: (&CudaStorage, &Layout),
        k: (&CudaStorage, &Layout),
        v: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, CudaStorage)> {
        match q.0.dtype() {
            DType::BF16 => run_typed::<half::bf16>(c, dims, q, k, v),
            DType::F16 => run_typed::<half::f16>(c, dims, q, k, v),
            got => Err(Error::DType {
                arg: "q",
                expected: "bf16 or f16",
                got,
            }),
        }
    }
}

/// Stand-ins without the `cuda` feature: nothing can build them, and planning says why.
#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(crate) enum CudaSel {}

    impl CudaSel {
        pub(crate) fn describe(&self) -> String {
            match *self {}
        }
    }

    pub(crate) fn plan(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &[Seq],
        _: Selection<'_>,
        _: f32,
        _: Option<&PoolRef<'_>>,
    ) -> Result<Planned> {
        Ok(Err("fp8nsa was built without the `cuda` feature".into()))
    }
}

#[cfg(feature = "cuda")]
pub(crate) use imp::run;
pub(crate) use imp::{plan, CudaSel};
