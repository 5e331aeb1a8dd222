//! KV pages for the whole model: the pools a server sizes once, and each sequence's share of
//! them.
//!
//! Dense attention keeps one allocator for the model and one key and one value pool per layer,
//! all indexed by the same page ids (a sequence's page list is its block table in every layer,
//! as in vLLM). The NSA variant keeps each layer's [`NsaPages`] with its own allocator and a
//! [`NsaSeqState`] per layer and sequence; every layer stores the same tokens, so their
//! allocators stay in step and the first one speaks for all. MLA (DeepSeek) keeps pages as dense
//! attention does, one allocator and page ids shared by every layer, each page holding rows of
//! the latent `[c | k_pe]` (and V3.2's index keys) instead of per-head keys and values.

use candle_core::{DType, Device, Tensor};
use fp8nsa_ops::nsa::{NsaPages, NsaPool, NsaSeqState, PagePool, SharedAllocator};

use crate::error::{invalid, Error, Result};

/// The KV pools of every layer of one model, made by [`Llama::new_kv_pool`](crate::Llama::new_kv_pool).
#[derive(Debug)]
pub struct KvPool {
    page_size: usize,
    pages: usize,
    pub(crate) store: Store,
}

#[derive(Debug)]
pub(crate) enum Store {
    /// Keys and values `[Hkv, pages · page_size, D]` per layer (a gather along the rows gives
    /// attention its `[1, Hkv, T, D]` operands without a transpose).
    Dense {
        alloc: SharedAllocator,
        layers: Vec<(Tensor, Tensor)>,
    },
    Nsa {
        layers: Vec<(NsaPages, SharedAllocator)>,
    },
    /// MLA (DeepSeek): one allocator, the same page ids in every layer, as `Dense`.
    Latent {
        alloc: SharedAllocator,
        layers: Vec<LatentPools>,
    },
}

/// One MLA layer's pools: the latent rows `[rows, W]` and, with V3.2's indexer, its key rows
/// `[rows, D_I]`.
pub(crate) type LatentPools = (Tensor, Option<Tensor>);

/// What one layer's attention needs to be made.
pub(crate) enum LayerKv {
    Dense {
        hkv: usize,
        d: usize,
    },
    Nsa(fp8nsa_ops::nsa::NsaDims),
    /// Floats per token of the latent row and of the index key (0: no indexer).
    Latent {
        width: usize,
        index: usize,
    },
}

/// The element types a model's keys and values may be kept in (pages or a one-sequence
/// cache): f32 always; f16 or bf16 where every layer is dense attention (NSA's compressed
/// pages and MLA's latent rows stay f32).
pub(crate) fn check_kv_dtype(layers: &[LayerKv], dtype: DType) -> Result<()> {
    let dense = layers.iter().all(|l| matches!(l, LayerKv::Dense { .. }));
    match dtype {
        DType::F32 => Ok(()),
        DType::F16 | DType::BF16 if dense => Ok(()),
        DType::F16 | DType::BF16 => Err(invalid(
            "kv_dtype",
            format!(
                "{dtype:?} keys and values are for dense attention layers; NSA and MLA keep f32"
            ),
        )),
        _ => Err(invalid(
            "kv_dtype",
            format!("{dtype:?}: keys and values are kept in f32, f16 or bf16"),
        )),
    }
}

impl KvPool {
    pub(crate) fn new(
        layers: &[LayerKv],
        pages: usize,
        page_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if pages == 0 || page_size == 0 {
            return Err(invalid(
                "kv_pages",
                format!("a pool needs pages of rows, got {pages} pages of {page_size} rows"),
            ));
        }
        let rows = pages
            .checked_mul(page_size)
            .filter(|&r| r <= u32::MAX as usize);
        let Some(rows) = rows else {
            return Err(invalid(
                "kv_pages",
                format!("{pages} pages of {page_size} rows are more rows than a u32 indexes"),
            ));
        };
        check_kv_dtype(layers, dtype)?;
        let bytes_ok = |per_row: usize| {
            rows.checked_mul(per_row)
                .and_then(|x| x.checked_mul(dtype.size_in_bytes()))
                .is_some_and(|b| b <= isize::MAX as usize)
        };
        let store = match layers.first() {
            Some(LayerKv::Latent { .. }) => Store::Latent {
                alloc: SharedAllocator::new(PagePool::new(pages, 1)?),
                layers: layers
                    .iter()
                    .map(|l| {
                        let LayerKv::Latent { width, index } = *l else {
                            return Err(invalid("attention", "every layer must be MLA or none"));
                        };
                        if !bytes_ok(width + index) {
                            return Err(invalid(
                                "kv_pages",
                                format!("{pages} pages do not fit in memory's address space"),
                            ));
                        }
                        let ix = match index {
                            0 => None,
                            d => Some(fp8nsa_ops::zeros_committed(
                                (rows, d),
                                dtype,
                                device,
                                "kv_pages",
                            )?),
                        };
                        Ok((
                            fp8nsa_ops::zeros_committed((rows, width), dtype, device, "kv_pages")?,
                            ix,
                        ))
                    })
                    .collect::<Result<_>>()?,
            },
            Some(LayerKv::Nsa(_)) => Store::Nsa {
                layers: layers
                    .iter()
                    .map(|l| {
                        let LayerKv::Nsa(dims) = l else {
                            return Err(invalid("attention", "every layer must be NSA or none"));
                        };
                        // as many compressed pages as raw ones: the compressed pool never runs
                        // out before the raw one, so the raw count is the one capacity
                        let p = NsaPages::new(*dims, page_size, pages, pages, dtype, device)?;
                        Ok((p, SharedAllocator::new(PagePool::new(pages, pages)?)))
                    })
                    .collect::<Result<_>>()?,
            },
            _ => Store::Dense {
                alloc: SharedAllocator::new(PagePool::new(pages, 1)?),
                layers: layers
                    .iter()
                    .map(|l| {
                        let LayerKv::Dense { hkv, d } = *l else {
                            return Err(invalid("attention", "every layer must be NSA or none"));
                        };
                        if !hkv.checked_mul(d).is_some_and(bytes_ok) {
                            return Err(invalid(
                                "kv_pages",
                                format!("{pages} pages do not fit in memory's address space"),
                            ));
                        }
                        let z = || {
                            fp8nsa_ops::zeros_committed((hkv, rows, d), dtype, device, "kv_pages")
                        };
                        Ok((z()?, z()?))
                    })
                    .collect::<Result<_>>()?,
            },
        };
        Ok(Self {
            page_size,
            pages,
            store,
        })
    }

    /// Rows per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages of the pool (per layer).
    pub fn total_pages(&self) -> usize {
        self.pages
    }

    /// Tokens the pool holds when full.
    pub fn capacity_tokens(&self) -> usize {
        self.pages * self.page_size
    }

    /// Pages no sequence holds.
    pub fn free_pages(&self) -> usize {
        match &self.store {
            Store::Dense { alloc, .. } | Store::Latent { alloc, .. } => {
                alloc.lock().free_pages(NsaPool::Raw)
            }
            Store::Nsa { layers } => layers
                .iter()
                .map(|(_, a)| a.lock().free_pages(NsaPool::Raw))
                .min()
                .unwrap_or(0),
        }
    }

    /// Pages `tokens` tokens of one sequence occupy.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// An empty sequence whose pages come from this pool (and go back to it when dropped).
    pub fn new_seq(&self) -> SeqKv {
        let inner = match &self.store {
            // MLA pages are kept as dense ones are: one page list for every layer
            Store::Dense { alloc, .. } | Store::Latent { alloc, .. } => SeqInner::Dense {
                alloc: alloc.clone(),
                pages: Vec::new(),
            },
            Store::Nsa { layers } => {
                SeqInner::Nsa(layers.iter().map(|(_, a)| NsaSeqState::new(a)).collect())
            }
        };
        SeqKv { len: 0, inner }
    }

    /// Gives `seq` the pages for `len` tokens (dense attention; NSA states take their own).
    /// All or nothing: when the pool runs out, the pages taken here go back and the answer is
    /// [`fp8nsa_ops::Error::OutOfPages`].
    pub(crate) fn reserve(&self, seq: &mut SeqKv, len: usize) -> Result<()> {
        let SeqInner::Dense { alloc, pages } = &mut seq.inner else {
            return Ok(());
        };
        let need = len.div_ceil(self.page_size);
        let mut a = alloc.lock();
        let had = pages.len();
        while pages.len() < need {
            match a.alloc(NsaPool::Raw) {
                Some(p) => pages.push(p),
                None => {
                    for p in pages.drain(had..) {
                        let _ = a.release(NsaPool::Raw, p);
                    }
                    return Err(Error::Ops(fp8nsa_ops::Error::OutOfPages {
                        pool: NsaPool::Raw,
                        pages: self.pages,
                    }));
                }
            }
        }
        Ok(())
    }

    /// Writes `k`, `v [1, T, Hkv, D]` at positions `pos..pos + T` of `seq` in `layer` (dense
    /// attention; the pages must be reserved).
    pub(crate) fn write(
        &self,
        layer: usize,
        seq: &SeqKv,
        pos: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        if k.dtype() == DType::F32 && v.dtype() == DType::F32 {
            // each new row to its page in one pass, rounded once for a 16-bit pool
            return self.write_all(layer, [seq], &[(pos, k.dims()[1])], k, v);
        }
        let ((kp, vp), pages) = self.dense(layer, seq)?;
        let runs = self.runs(pages, pos, pos + k.dims()[1])?;
        // [1, T, Hkv, D] -> [Hkv, T, D] in the pages' type (rounded once, here, for a 16-bit
        // pool), then one copy per run of rows within a page
        let (kt, vt) = (
            k.squeeze(0)?
                .transpose(0, 1)?
                .to_dtype(kp.dtype())?
                .contiguous()?,
            v.squeeze(0)?
                .transpose(0, 1)?
                .to_dtype(vp.dtype())?
                .contiguous()?,
        );
        for (off, row, run) in runs {
            kp.slice_set(&kt.narrow(1, off, run)?.contiguous()?, 1, row)?;
            vp.slice_set(&vt.narrow(1, off, run)?.contiguous()?, 1, row)?;
        }
        Ok(())
    }

    /// [`Self::write`] for a batch step's sequences at once: `k`, `v [1, M, Hkv, D]` f32 hold
    /// sequence `i`'s `segs[i] = (pos, len)` rows in turn, written at its positions `pos..pos +
    /// len` (pages reserved): one pass per pool, not a few Candle copies per sequence.
    pub(crate) fn write_all<'s>(
        &self,
        layer: usize,
        seqs: impl IntoIterator<Item = &'s SeqKv>,
        segs: &[(usize, usize)],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let mut rows = Vec::with_capacity(k.dims()[1]);
        let mut kv = None;
        for (seq, &(pos, t)) in seqs.into_iter().zip(segs) {
            let (pools, pages) = self.dense(layer, seq)?;
            kv = Some(pools);
            for (_, row, run) in self.runs(pages, pos, pos + t)? {
                rows.extend(row..row + run);
            }
        }
        let Some((kp, vp)) = kv else {
            return Ok(());
        };
        fp8nsa_ops::nsa::write_rows(kp, k, &rows)?;
        fp8nsa_ops::nsa::write_rows(vp, v, &rows)?;
        Ok(())
    }

    /// The first `len` keys and values of `seq` in `layer`, gathered: `[1, Hkv, len, D]`.
    pub(crate) fn read(&self, layer: usize, seq: &SeqKv, len: usize) -> Result<(Tensor, Tensor)> {
        let ((kp, vp), pages) = self.dense(layer, seq)?;
        let rows = self.rows(pages, 0, len, kp.device())?;
        Ok((
            kp.index_select(&rows, 1)?.unsqueeze(0)?,
            vp.index_select(&rows, 1)?.unsqueeze(0)?,
        ))
    }

    /// The runs of a sequence's positions `pos..end` on its `pages`, one per page touched:
    /// `(offset from pos, first pool row, rows)`; the pages must be reserved up to `end`.
    fn runs(&self, pages: &[usize], pos: usize, end: usize) -> Result<Vec<(usize, usize, usize)>> {
        let ps = self.page_size;
        if end.div_ceil(ps) > pages.len() {
            return Err(invalid("kv", "pages not reserved for the step's tokens"));
        }
        let mut runs = Vec::with_capacity(end.saturating_sub(pos).div_ceil(ps) + 1);
        let mut p = pos;
        while p < end {
            let run = (ps - p % ps).min(end - p);
            runs.push((p - pos, pages[p / ps] * ps + p % ps, run));
            p += run;
        }
        Ok(runs)
    }

    /// Pool rows of `seq`'s positions `from..to` (its pages must cover them).
    fn rows(&self, pages: &[usize], from: usize, to: usize, device: &Device) -> Result<Tensor> {
        let ps = self.page_size;
        let rows: Vec<u32> = (from..to)
            .map(|p| (pages[p / ps] * ps + p % ps) as u32)
            .collect();
        Ok(Tensor::from_vec(rows, to - from, device)?)
    }

    /// MLA `layer`'s pools (latent, index keys) and `seq`'s pages in them.
    fn latent<'a>(
        &'a self,
        layer: usize,
        seq: &'a SeqKv,
    ) -> Result<(&'a LatentPools, &'a [usize])> {
        match (&self.store, &seq.inner) {
            (Store::Latent { layers, .. }, SeqInner::Dense { pages, .. }) => {
                Ok((&layers[layer], pages))
            }
            _ => Err(invalid("kv", "the pool was not made for MLA")),
        }
    }

    /// Writes MLA rows `latent [T, W]` (and `index [T, D_I]`) at positions `pos..pos + T` of
    /// `seq` in `layer`, then returns its rows `0..pos + T` gathered (pages reserved).
    pub(crate) fn write_read_latent(
        &self,
        layer: usize,
        seq: &SeqKv,
        pos: usize,
        latent: &Tensor,
        index: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let ((lp, ip), pages) = self.latent(layer, seq)?;
        let t = latent.dims()[0];
        // one copy per run of rows within a page
        for (off, row, run) in self.runs(pages, pos, pos + t)? {
            lp.slice_set(&latent.narrow(0, off, run)?.contiguous()?, 0, row)?;
            if let (Some(ip), Some(ix)) = (ip, index) {
                ip.slice_set(&ix.narrow(0, off, run)?.contiguous()?, 0, row)?;
            }
        }
        let all = self.rows(pages, 0, pos + t, lp.device())?;
        let index = match ip {
            Some(ip) => Some(ip.index_select(&all, 0)?),
            None => None,
        };
        Ok((lp.index_select(&all, 0)?, index))
    }

    /// The key and value pools `[Hkv, rows, D]` of dense `layer`, and `seq`'s pages in them.
    pub(crate) fn dense<'a>(
        &'a self,
        layer: usize,
        seq: &'a SeqKv,
    ) -> Result<(&'a (Tensor, Tensor), &'a [usize])> {
        match (&self.store, &seq.inner) {
            (Store::Dense { layers, .. }, SeqInner::Dense { pages, .. }) => {
                Ok((&layers[layer], pages))
            }
            _ => Err(invalid("kv", "the pool was not made for dense attention")),
        }
    }
}

/// One sequence's KV in a [`KvPool`]: its pages (in every layer) and how many tokens they
/// hold. Dropping it gives its pages back.
#[derive(Debug)]
pub struct SeqKv {
    len: usize,
    pub(crate) inner: SeqInner,
}

#[derive(Debug)]
pub(crate) enum SeqInner {
    Dense {
        alloc: SharedAllocator,
        pages: Vec<usize>,
    },
    Nsa(Vec<NsaSeqState>),
}

impl SeqKv {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pages held (per layer).
    pub fn pages(&self) -> usize {
        match &self.inner {
            SeqInner::Dense { pages, .. } => pages.len(),
            SeqInner::Nsa(states) => states.first().map_or(0, |s| s.pages(NsaPool::Raw).len()),
        }
    }

    /// The step wrote `t` more tokens in every layer.
    pub(crate) fn commit(&mut self, t: usize) {
        self.len += t;
    }

    /// Back to `len` tokens after a failed step: pages past them go back to the pool.
    pub(crate) fn roll_back(
        &mut self,
        len: usize,
        pool: &KvPool,
        nsa: &[Option<&fp8nsa_ops::nsa::NsaConfig>],
    ) {
        self.len = self.len.min(len);
        let keep = len.div_ceil(pool.page_size);
        match (&mut self.inner, &pool.store) {
            (SeqInner::Dense { alloc, pages }, _) => {
                let mut a = alloc.lock();
                for p in pages.drain(keep.min(pages.len())..) {
                    let _ = a.release(NsaPool::Raw, p);
                }
            }
            (SeqInner::Nsa(states), Store::Nsa { layers }) => {
                for ((s, (pages, _)), cfg) in states.iter_mut().zip(layers).zip(nsa) {
                    if let Some(cfg) = cfg {
                        // a refused release is the allocator's bookkeeping, not this step's
                        let _ = s.truncate(len, cfg, pages);
                    }
                }
            }
            _ => {}
        }
    }
}

impl Drop for SeqKv {
    fn drop(&mut self) {
        if let SeqInner::Dense { alloc, pages } = &mut self.inner {
            let mut a = alloc.lock();
            for p in pages.drain(..) {
                let _ = a.release(NsaPool::Raw, p);
            }
        }
        // NSA states return their own pages when they drop
    }
}
