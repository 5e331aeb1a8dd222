//! [`NsaCache`]: the layer's decode state for a caller that does not manage pages.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::Tensor;

use super::{NsaPages, NsaPool, NsaSeqState, PageAllocator, PagePool, SharedAllocator};
use crate::error::{invalid, shape_err, Result};
use crate::nsa::layer::{check_step_queries, NativeSparseAttention, NsaOutput};
use crate::nsa::NsaConfig;

/// Rows per page of an [`NsaCache`]'s own pools.
const CACHE_PAGE: usize = 64;

/// Keys, values and compressed keys / values of a batch of sequences being decoded, for a
/// caller that does not manage pages: a convenience over one [`NsaSeqState`] per batch row on
/// [`NsaPages`] the cache owns (pages of 64 rows), which grow (doubling) as the sequences do.
/// Compressed blocks are appended as they complete, never recomputed. [`Self::try_clone`]
/// makes an independent copy.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use fp8nsa_ops::nsa::*;
///
/// let dev = Device::Cpu;
/// let dims = NsaDims::new(4, 1, 32, 32)?;
/// let nsa = NativeSparseAttention::new(NsaConfig::default(), dims, Compressor::MeanPool,
///                                      Gates::Fixed([1.0, 1.0, 1.0]))?;
/// let mut cache = NsaCache::new();
/// let x = Tensor::zeros((2, 1, 8), DType::F32, &dev)?; // gate input (unused here)
/// for _ in 0..40 {
///     let (q, k, v) = (Tensor::randn(0f32, 1.0, (2, 1, 4, 32), &dev)?,
///                      Tensor::randn(0f32, 1.0, (2, 1, 1, 32), &dev)?,
///                      Tensor::randn(0f32, 1.0, (2, 1, 1, 32), &dev)?);
///     nsa.forward_step(&x, &q, &k, &v, &mut cache)?; // two sequences, one token each
/// }
/// assert_eq!((cache.len(), cache.compressed_len()), (40, 1)); // blocks of 32, stride 16
/// assert_eq!(cache.keys()?.unwrap().dims(), &[2, 40, 1, 32]);
/// cache.truncate(30, nsa.config())?; // roll back 10 tokens
/// assert_eq!((cache.len(), cache.compressed_len()), (30, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Default)]
pub struct NsaCache {
    store: Option<CacheStore>,
}

#[derive(Debug)]
struct CacheStore {
    pages: NsaPages,
    /// The allocator, typed so the cache can grow it; `alloc` is the same one as the states
    /// hold it.
    pool: Arc<Mutex<PagePool>>,
    alloc: SharedAllocator,
    /// One per batch row, all of the same length.
    seqs: Vec<NsaSeqState>,
}

impl CacheStore {
    fn new(pages: NsaPages, pool: PagePool, batch: usize) -> Self {
        let pool = Arc::new(Mutex::new(pool));
        let alloc = SharedAllocator::from_arc(pool.clone());
        let seqs = (0..batch).map(|_| NsaSeqState::new(&alloc)).collect();
        Self {
            pages,
            pool,
            alloc,
            seqs,
        }
    }

    fn pool(&self) -> MutexGuard<'_, PagePool> {
        // only this cache's own calls hold the lock, and none of them panics while holding it
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl NsaCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// An independent copy (steps write into the pools in place, so a copy must not share
    /// them). Fails, typed, where an allocation of the pools' size does.
    pub fn try_clone(&self) -> Result<Self> {
        let Some(s) = &self.store else {
            return Ok(Self::default());
        };
        let pool = s.pool().clone();
        let mut copy = CacheStore::new(s.pages.deep_copy()?, pool, 0);
        copy.seqs = s.seqs.iter().map(|q| q.duplicate_on(&copy.alloc)).collect();
        Ok(Self { store: Some(copy) })
    }

    /// Tokens held (by each sequence of the batch).
    pub fn len(&self) -> usize {
        self.first().map_or(0, |s| s.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Compressed blocks held.
    pub fn compressed_len(&self) -> usize {
        self.first().map_or(0, |s| s.compressed_len())
    }

    fn first(&self) -> Option<&NsaSeqState> {
        self.store.as_ref().and_then(|s| s.seqs.first())
    }

    /// A copy of the `[B, T, Hkv, D]` keys held, `None` when the cache is empty.
    pub fn keys(&self) -> Result<Option<Tensor>> {
        self.gathered(NsaPool::Raw, 0)
    }

    /// A copy of the `[B, T, Hkv, Dv]` values held, `None` when the cache is empty.
    pub fn values(&self) -> Result<Option<Tensor>> {
        self.gathered(NsaPool::Raw, 1)
    }

    /// A copy of the `[B, n_c, Hkv, D]` compressed keys (f32), `None` when there are none.
    pub fn compressed_keys(&self) -> Result<Option<Tensor>> {
        self.gathered(NsaPool::Compressed, 0)
    }

    fn gathered(&self, pool: NsaPool, which: usize) -> Result<Option<Tensor>> {
        let Some(s) = &self.store else {
            return Ok(None);
        };
        let rows = |q: &NsaSeqState| match pool {
            NsaPool::Raw => q.len(),
            NsaPool::Compressed => q.compressed_len(),
        };
        if s.seqs.first().is_none_or(|q| rows(q) == 0) {
            return Ok(None);
        }
        let parts: Vec<Tensor> = s
            .seqs
            .iter()
            .map(|q| {
                let [a, b] = s.pages.gather(pool, q.pages(pool), 0, rows(q))?;
                Ok([a, b][which].clone())
            })
            .collect::<Result<_>>()?;
        Ok(Some(Tensor::cat(&parts, 0)?))
    }

    /// Forgets everything after the first `len` tokens (and the compressed blocks that need
    /// them), e.g. to roll back rejected speculative tokens.
    pub fn truncate(&mut self, len: usize, cfg: &NsaConfig) -> Result<()> {
        if let Some(s) = &mut self.store {
            for q in &mut s.seqs {
                q.truncate(len, cfg, &s.pages)?;
            }
        }
        Ok(())
    }

    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

impl NativeSparseAttention {
    /// Decoding (or chunked prefill) with a cache: appends `k_new`/`v_new [B, Tn, Hkv, ..]` and
    /// their completed compressed blocks to `cache`, then attends `q [B, Tn, Hq, D]` (the new
    /// positions) over everything cached. Prefill of T tokens equals T calls of one token.
    /// `q` may hold fewer tokens than `k_new` (then it is the last of them), never more and
    /// never none: a query for a position already in the cache is an error.
    pub fn forward_step(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        cache: &mut NsaCache,
    ) -> Result<Tensor> {
        Ok(self
            .forward_step_detailed(gate_input, q, k_new, v_new, cache)?
            .o)
    }

    /// [`Self::forward_step`] with every branch.
    pub fn forward_step_detailed(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        cache: &mut NsaCache,
    ) -> Result<NsaOutput> {
        check_step_queries(q, k_new)?;
        let before = cache.len();
        self.append_kv(k_new, v_new, cache)?;
        let out = match &cache.store {
            Some(s) => self.attend_paged(gate_input, q, &s.pages, &s.seqs),
            None => Err(invalid(
                "k_new",
                "the cache is empty: append at least one token",
            )),
        };
        if out.is_err() {
            // leave the cache as it was, so a corrected retry does not append twice (the
            // step's error is the one to report)
            let _ = cache.truncate(before, self.config());
        }
        out
    }

    /// Appends `k_new` / `v_new [B, Tn, Hkv, ..]` and the compressed blocks they complete to
    /// the cache's states without attending (e.g. to load a prompt's KV computed elsewhere),
    /// growing its pools first so the append cannot run out of pages. On an error every state
    /// holds what it held before.
    pub fn append_kv(&self, k_new: &Tensor, v_new: &Tensor, cache: &mut NsaCache) -> Result<()> {
        let tn = self.check_kv(k_new, v_new)?;
        let b = k_new.dims()[0];
        let cfg = self.config();
        // a first append builds the store aside, kept only if the append succeeds (so a failed
        // first call does not fix the batch size)
        let mut fresh = None;
        let store = match &mut cache.store {
            Some(s) => {
                let (pd, pdt) = (s.pages.keys().dims(), s.pages.keys().dtype());
                if s.seqs.len() != b || k_new.dtype() != pdt || v_new.dtype() != pdt {
                    return Err(shape_err(
                        "k_new",
                        format!(
                            "[{}, Tn, {}, {}] of {pdt:?}, like the cache",
                            s.seqs.len(),
                            pd[2],
                            pd[3]
                        ),
                        k_new.dims(),
                    ));
                }
                s
            }
            None if tn == 0 || b == 0 => return Ok(()), // nothing to hold yet
            None => {
                let short = |len: usize, per_block: usize| len.div_ceil(per_block);
                let raw = (short(tn, CACHE_PAGE) * b).max(4);
                let cmp = (short(cfg.compressed_len(tn), CACHE_PAGE) * b).max(4);
                let pages = NsaPages::new(
                    self.dims(),
                    CACHE_PAGE,
                    raw,
                    cmp,
                    k_new.dtype(),
                    k_new.device(),
                )?;
                fresh.insert(CacheStore::new(pages, PagePool::new(raw, cmp)?, b))
            }
        };
        let len = store.seqs[0].len();
        let mut short = [0usize; 2];
        for q in &store.seqs {
            let [r, c] = q.pages_short(len + tn, cfg, CACHE_PAGE);
            short[0] += r;
            short[1] += c;
        }
        let (add_raw, add_cmp) = {
            let pool = store.pool();
            let grow = |p: NsaPool, need: usize| {
                let (free, have) = (pool.free_pages(p), store.pages.num_pages(p));
                if need > free {
                    (need - free).max(have)
                } else {
                    0
                }
            };
            (
                grow(NsaPool::Raw, short[0]),
                grow(NsaPool::Compressed, short[1]),
            )
        };
        if add_raw + add_cmp > 0 {
            store.pages.grow(add_raw, add_cmp)?;
            store.pool().grow(add_raw, add_cmp)?;
        }
        for i in 0..b {
            let (k, v) = (k_new.narrow(0, i, 1)?, v_new.narrow(0, i, 1)?);
            let out = self.append_kv_paged(&k, &v, &store.pages, &mut store.seqs[i]);
            if let Err(e) = out {
                for q in &mut store.seqs[..i] {
                    let _ = q.truncate(len, cfg, &store.pages);
                }
                return Err(e);
            }
        }
        if fresh.is_some() {
            cache.store = fresh;
        }
        Ok(())
    }
}
