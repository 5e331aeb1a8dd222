//! The layer's step on server-owned pages.

use candle_core::Tensor;

use super::state::block_table;
use super::{NsaPages, NsaPool, NsaSeqState};
use crate::error::{invalid, shape_err, Error, Result};
use crate::nsa::layer::{check_step_queries, Kv, NativeSparseAttention, NsaOutput};
use crate::nsa::PagedKv;

impl NativeSparseAttention {
    /// [`Self::forward_step`] on server-owned pages: appends `k_new` / `v_new [1, Tn, Hkv, ..]`
    /// (one sequence) and the compressed blocks they complete to `state`'s pages in `pages`,
    /// then attends `q [1, Tq, Hq, D]` (the last `Tq <= Tn` new positions) over everything the
    /// state holds: the selection and window branches read the pages in place
    /// ([`SelectionAttention::forward_paged`](crate::nsa::SelectionAttention::forward_paged)),
    /// the compressed branch gathers the (stride times fewer) compressed rows. Equals the same
    /// steps on an [`NsaCache`](crate::nsa::NsaCache). On an error `state` holds what it held
    /// before (pages taken for the failed step go back to its allocator); a pool without a
    /// free page is [`Error::OutOfPages`].
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use fp8nsa_ops::nsa::*;
    ///
    /// let dev = Device::Cpu;
    /// let dims = NsaDims::new(4, 1, 32, 32)?;
    /// let nsa = NativeSparseAttention::new(NsaConfig::default(), dims, Compressor::MeanPool,
    ///                                      Gates::Fixed([1.0, 1.0, 1.0]))?;
    /// let pages = NsaPages::new(dims, 16, 64, 8, DType::F32, &dev)?; // the server's pools
    /// let alloc = SharedAllocator::new(PagePool::new(64, 8)?);
    /// let mut seq = NsaSeqState::new(&alloc);
    /// let x = Tensor::zeros((1, 1, 8), DType::F32, &dev)?; // gate input (unused here)
    /// for _ in 0..40 {
    ///     let (q, k, v) = (Tensor::randn(0f32, 1.0, (1, 1, 4, 32), &dev)?,
    ///                      Tensor::randn(0f32, 1.0, (1, 1, 1, 32), &dev)?,
    ///                      Tensor::randn(0f32, 1.0, (1, 1, 1, 32), &dev)?);
    ///     nsa.forward_step_paged(&x, &q, &k, &v, &pages, &mut seq)?;
    /// }
    /// let branch = seq.fork()?; // shares all 3 raw pages
    /// assert_eq!((seq.len(), branch.pages(NsaPool::Raw).len()), (40, 3));
    /// assert_eq!(alloc.lock().free_pages(NsaPool::Raw), 61);
    /// drop((seq, branch)); // dropped states return their pages
    /// assert_eq!(alloc.lock().free_pages(NsaPool::Raw), 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_step_paged(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        pages: &NsaPages,
        state: &mut NsaSeqState,
    ) -> Result<Tensor> {
        Ok(self
            .forward_step_paged_detailed(gate_input, q, k_new, v_new, pages, state)?
            .o)
    }

    /// [`Self::forward_step_paged`] with every branch.
    pub fn forward_step_paged_detailed(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        pages: &NsaPages,
        state: &mut NsaSeqState,
    ) -> Result<NsaOutput> {
        check_step_queries(q, k_new)?;
        let before = state.len();
        self.append_kv_paged(k_new, v_new, pages, state)?;
        let out = self.attend_paged(gate_input, q, pages, std::slice::from_ref(state));
        if out.is_err() {
            // the step's error is the one to report; this truncation only returns its pages
            let _ = state.truncate(before, self.config(), pages);
        }
        out
    }

    /// Appends `k_new` / `v_new [1, Tn, Hkv, ..]` and the compressed blocks they complete to
    /// `state` without attending (a prompt's KV computed elsewhere, say).
    pub fn append_kv_paged(
        &self,
        k_new: &Tensor,
        v_new: &Tensor,
        pages: &NsaPages,
        state: &mut NsaSeqState,
    ) -> Result<()> {
        let tn = self.check_kv(k_new, v_new)?;
        let (hkv, d, dv) = (self.dims().hkv(), self.dims().d(), self.dims().dv());
        if k_new.dims()[0] != 1 {
            return Err(shape_err(
                "k_new",
                format!("[1, Tn, {hkv}, {d}]: one sequence per state"),
                k_new.dims(),
            ));
        }
        let (pk, pv) = (pages.k.dims(), pages.v.dims());
        if (pk[2], pk[3], pv[3]) != (hkv, d, dv) {
            return Err(shape_err(
                "pages",
                format!("pools of [P, page_size, {hkv}, {d} / {dv}] (the layer's heads)"),
                pk,
            ));
        }
        if k_new.dtype() != pages.k.dtype() || v_new.dtype() != pages.k.dtype() {
            return Err(Error::DType {
                arg: "k_new",
                expected: "the pages' dtype",
                got: k_new.dtype(),
            });
        }
        if !k_new.device().same_device(pages.k.device()) {
            return Err(invalid("k_new", "is not on the pages' device"));
        }
        let (before, before_c) = (state.len(), state.compressed_len());
        let out = self.append_paged_inner(k_new, v_new, tn, pages, state);
        if out.is_err() {
            // back to what the state held (the lengths first, so truncate frees the new pages)
            state.set_lens(before, before_c);
            let _ = state.truncate(before, self.config(), pages);
        }
        out
    }

    fn append_paged_inner(
        &self,
        k_new: &Tensor,
        v_new: &Tensor,
        tn: usize,
        pages: &NsaPages,
        state: &mut NsaSeqState,
    ) -> Result<()> {
        if tn == 0 {
            return Ok(());
        }
        let (k, v) = (k_new.squeeze(0)?, v_new.squeeze(0)?);
        let len = state.len();
        state.write(pages, NsaPool::Raw, len, [&k, &v])?;
        // the new length counts only once its rows are written (truncate on failure then
        // releases whatever pages the write took)
        let len = len + tn;
        let cfg = self.config();
        let (old, new) = (state.compressed_len(), cfg.compressed_len(len));
        state.set_lens(len, old);
        if new > old {
            let (l, s) = (cfg.compress_block, cfg.compress_stride);
            // the raw rows the new compressed blocks cover, block `old` first
            let (from, to) = (old * s, ((new - 1) * s + l).min(len));
            let [kw, vw] = pages.gather(NsaPool::Raw, state.pages(NsaPool::Raw), from, to)?;
            let ck = self.compressor().compress(cfg, &kw, 0, new - old, true)?;
            let cv = self.compressor().compress(cfg, &vw, 0, new - old, false)?;
            let (ck, cv) = (ck.squeeze(0)?, cv.squeeze(0)?);
            state.write(pages, NsaPool::Compressed, old, [&ck, &cv])?;
            state.set_lens(len, new);
        }
        Ok(())
    }

    /// Attends `q [B, Tq, Hq, D]` over the states of `B` sequences of equal length.
    pub(super) fn attend_paged(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        pages: &NsaPages,
        states: &[NsaSeqState],
    ) -> Result<NsaOutput> {
        let len = states.first().map_or(0, |s| s.len());
        if len == 0 {
            return Err(invalid(
                "k_new",
                "the state is empty: append at least one token",
            ));
        }
        if q.dims().get(1) == Some(&0) {
            return Err(shape_err(
                "q",
                "[B, Tq, Hq, D] with Tq >= 1: a step attends at least one query",
                q.dims(),
            ));
        }
        let compressed: Vec<[Tensor; 2]> = states
            .iter()
            .map(|s| {
                let list = s.pages(NsaPool::Compressed);
                pages.gather(NsaPool::Compressed, list, 0, s.compressed_len())
            })
            .collect::<Result<_>>()?;
        let (ck, cv) = if let [[ck, cv]] = compressed.as_slice() {
            (ck.clone(), cv.clone())
        } else {
            let cat = |i: usize| -> Result<Tensor> {
                let parts: Vec<&Tensor> = compressed.iter().map(|c| &c[i]).collect();
                Ok(Tensor::cat(&parts, 0)?)
            };
            (cat(0)?, cat(1)?)
        };
        let table = block_table(states, pages.k.device())?;
        let seq_lens: Vec<usize> = states.iter().map(|s| s.len()).collect();
        let paged = PagedKv {
            k_pages: &pages.k,
            v_pages: &pages.v,
            block_table: &table,
            seq_lens: &seq_lens,
        };
        self.core_on(
            gate_input,
            q,
            Kv::Paged(paged),
            (states.len(), len),
            &ck,
            &cv,
        )
    }
}
