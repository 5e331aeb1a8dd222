//! The NSA layer's decode state on pages a server owns: raw keys / values and compressed keys /
//! values live in page pools ([`NsaPages`]) that every sequence shares, a sequence's state
//! ([`NsaSeqState`]) is two page lists and two lengths, and the server's allocator
//! ([`PageAllocator`]) hands pages out and takes them back. Forking a state shares every page
//! (prefix sharing); a shared page is copied on the first write that would change it, so the
//! copies never see each other's tokens. Rolling back is a truncation that releases the pages
//! past the new end. [`NsaCache`] is the convenience over these for a caller that does not
//! manage pages: a state per batch row on pools it owns and grows.

use candle_core::{DType, Device, Tensor};

use super::layer::{Kv, NativeSparseAttention, NsaOutput};
use super::{NsaConfig, NsaDims, PagedKv};
use crate::error::{invalid, shape_err, Error, Result};

/// The two pools of an NSA layer's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NsaPool {
    /// Keys and values, one row per token.
    Raw,
    /// Compressed keys and values, one row per compressed block (one every
    /// `compress_stride` tokens).
    Compressed,
}

impl NsaPool {
    fn index(self) -> usize {
        match self {
            NsaPool::Raw => 0,
            NsaPool::Compressed => 1,
        }
    }
}

/// The server's page bookkeeping, as a sequence's state uses it. Pages are reference counted:
/// [`NsaSeqState::fork`] shares every page of the forked state, and a page goes back to the
/// free list when its last holder releases it.
pub trait PageAllocator {
    /// A free page of `pool` (held once), or `None` when the pool is exhausted.
    fn alloc(&mut self, pool: NsaPool) -> Option<usize>;
    /// One more holder of `page`.
    fn share(&mut self, pool: NsaPool, page: usize);
    /// One holder fewer of `page`.
    fn release(&mut self, pool: NsaPool, page: usize);
}

/// Free lists and reference counts for the two pools: a complete [`PageAllocator`] for a
/// server that has no block manager of its own (and for tests).
///
/// ```
/// use fp8nsa_ops::nsa::{NsaPool, PageAllocator, PagePool};
/// let mut pool = PagePool::new(2, 1);
/// let p = pool.alloc(NsaPool::Raw).unwrap();
/// pool.share(NsaPool::Raw, p); // a fork holds it too
/// pool.release(NsaPool::Raw, p);
/// assert_eq!(pool.free_pages(NsaPool::Raw), 1); // still held once
/// pool.release(NsaPool::Raw, p);
/// assert_eq!(pool.free_pages(NsaPool::Raw), 2);
/// assert_eq!(pool.alloc(NsaPool::Compressed), Some(0));
/// assert_eq!(pool.alloc(NsaPool::Compressed), None);
/// ```
#[derive(Clone, Debug)]
pub struct PagePool {
    free: [Vec<usize>; 2],
    refs: [Vec<u32>; 2],
}

impl PagePool {
    /// Pools of `raw_pages` and `compressed_pages` pages, all free.
    pub fn new(raw_pages: usize, compressed_pages: usize) -> Self {
        // popped from the back: hand out low ids first
        let free = |n: usize| (0..n).rev().collect();
        Self {
            free: [free(raw_pages), free(compressed_pages)],
            refs: [vec![0; raw_pages], vec![0; compressed_pages]],
        }
    }

    pub fn free_pages(&self, pool: NsaPool) -> usize {
        self.free[pool.index()].len()
    }

    /// How many holders `page` has (0 when free or unknown).
    pub fn holders(&self, pool: NsaPool, page: usize) -> u32 {
        self.refs[pool.index()].get(page).copied().unwrap_or(0)
    }

    /// `raw` and `compressed` more free pages (ids after the current ones, handed out after
    /// the free ones below them), for pools grown by [`NsaPages::grow`].
    pub(crate) fn grow(&mut self, raw: usize, compressed: usize) {
        for (i, add) in [(0, raw), (1, compressed)] {
            let n = self.refs[i].len();
            self.refs[i].resize(n + add, 0);
            self.free[i].splice(0..0, (n..n + add).rev());
        }
    }
}

impl PageAllocator for PagePool {
    fn alloc(&mut self, pool: NsaPool) -> Option<usize> {
        let i = pool.index();
        let page = self.free[i].pop()?;
        self.refs[i][page] = 1;
        Some(page)
    }

    fn share(&mut self, pool: NsaPool, page: usize) {
        if let Some(r) = self.refs[pool.index()].get_mut(page) {
            *r = r.saturating_add(1);
        }
    }

    fn release(&mut self, pool: NsaPool, page: usize) {
        let i = pool.index();
        // releasing a page nobody holds is the caller's bug; it must not free it twice
        if let Some(r) = self.refs[i].get_mut(page).filter(|r| **r > 0) {
            *r -= 1;
            if *r == 0 {
                self.free[i].push(page);
            }
        }
    }
}

/// The page pools of one NSA layer, shared by all its sequences: keys `[P, page_size, Hkv, D]`
/// and values `[P, page_size, Hkv, Dv]` in the model's dtype, compressed keys and values
/// `[Pc, page_size, Hkv, D / Dv]` in f32. Pages are written in place.
#[derive(Clone, Debug)]
pub struct NsaPages {
    k: Tensor,
    v: Tensor,
    ck: Tensor,
    cv: Tensor,
    page_size: usize,
}

impl NsaPages {
    /// Zeroed pools of `raw_pages` and `compressed_pages` pages of `page_size` rows. A
    /// compressed page fills `compress_stride` times slower than a raw one, so
    /// `raw_pages / compress_stride` (plus one per sequence) compressed pages are enough.
    pub fn new(
        dims: NsaDims,
        page_size: usize,
        raw_pages: usize,
        compressed_pages: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if page_size == 0 || raw_pages == 0 || compressed_pages == 0 {
            return Err(invalid(
                "page_size",
                format!(
                    "pools need pages of at least one row, got page_size {page_size}, \
                     {raw_pages} raw and {compressed_pages} compressed pages"
                ),
            ));
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::DType {
                arg: "dtype",
                expected: "f32, bf16 or f16",
                got: dtype,
            });
        }
        let NsaDims { hkv, d, dv, .. } = dims;
        let z = |p, d, dt| Tensor::zeros((p, page_size, hkv, d), dt, device);
        Ok(Self {
            k: z(raw_pages, d, dtype)?,
            v: z(raw_pages, dv, dtype)?,
            ck: z(compressed_pages, d, DType::F32)?,
            cv: z(compressed_pages, dv, DType::F32)?,
            page_size,
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The key pool `[P, page_size, Hkv, D]` (for [`PagedKv`]).
    pub fn keys(&self) -> &Tensor {
        &self.k
    }

    /// The value pool `[P, page_size, Hkv, Dv]`.
    pub fn values(&self) -> &Tensor {
        &self.v
    }

    /// `raw` and `compressed` more zeroed pages, the pages held kept as they are (the pools
    /// are copied into larger ones).
    pub(crate) fn grow(&mut self, raw: usize, compressed: usize) -> Result<()> {
        let bigger = |t: &Tensor, add: usize| -> Result<Tensor> {
            if add == 0 {
                return Ok(t.clone());
            }
            let (p, ps, h, d) = t.dims4()?;
            let out = Tensor::zeros((p + add, ps, h, d), t.dtype(), t.device())?;
            out.slice_set(t, 0, 0)?;
            Ok(out)
        };
        // all four first: a failed allocation leaves the pools as they were
        let (k, v) = (bigger(&self.k, raw)?, bigger(&self.v, raw)?);
        let (ck, cv) = (bigger(&self.ck, compressed)?, bigger(&self.cv, compressed)?);
        (self.k, self.v, self.ck, self.cv) = (k, v, ck, cv);
        Ok(())
    }

    /// An independent copy of the pools (pages are written in place, so clones must not share
    /// storage).
    fn deep_copy(&self) -> Result<Self> {
        Ok(Self {
            k: self.k.copy()?,
            v: self.v.copy()?,
            ck: self.ck.copy()?,
            cv: self.cv.copy()?,
            page_size: self.page_size,
        })
    }

    fn pools(&self, pool: NsaPool) -> [&Tensor; 2] {
        match pool {
            NsaPool::Raw => [&self.k, &self.v],
            NsaPool::Compressed => [&self.ck, &self.cv],
        }
    }

    fn num_pages(&self, pool: NsaPool) -> usize {
        self.pools(pool)[0].dims()[0]
    }

    /// Rows `[from, to)` of a page list, gathered: `[1, to - from, Hkv, D]` per pool.
    fn gather(&self, pool: NsaPool, list: &[usize], from: usize, to: usize) -> Result<[Tensor; 2]> {
        let ps = self.page_size;
        let rows: Vec<u32> = (from..to)
            .map(|p| (list[p / ps] * ps + p % ps) as u32)
            .collect();
        let [a, b] = self.pools(pool);
        let rows = Tensor::new(rows.as_slice(), a.device())?;
        let take = |t: &Tensor| -> Result<Tensor> {
            let (np, _, h, d) = t.dims4()?;
            Ok(t.reshape((np * ps, h, d))?
                .index_select(&rows, 0)?
                .unsqueeze(0)?)
        };
        Ok([take(a)?, take(b)?])
    }
}

/// One sequence's NSA decode state on [`NsaPages`]: its raw and compressed page lists and how
/// many tokens and compressed blocks they hold. Clone it only through [`Self::fork`], which
/// tells the allocator that the pages are now shared.
#[derive(Debug, Default)]
pub struct NsaSeqState {
    pages: [Vec<usize>; 2],
    /// Per pool, the leading pages that another state may hold too: written only after a copy.
    shared: [usize; 2],
    len: usize,
    compressed_len: usize,
}

impl NsaSeqState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Compressed blocks held.
    pub fn compressed_len(&self) -> usize {
        self.compressed_len
    }

    /// The pages of `pool` this state reads, in order.
    pub fn pages(&self, pool: NsaPool) -> &[usize] {
        &self.pages[pool.index()]
    }

    /// A state for another sequence with the same prefix (prefix sharing, beam search,
    /// speculative branches): every page is shared through `alloc`, nothing is copied until
    /// one of the two writes into a shared page.
    pub fn fork(&mut self, alloc: &mut dyn PageAllocator) -> Self {
        for pool in [NsaPool::Raw, NsaPool::Compressed] {
            let i = pool.index();
            for &p in &self.pages[i] {
                alloc.share(pool, p);
            }
            self.shared[i] = self.pages[i].len();
        }
        Self {
            pages: self.pages.clone(),
            shared: self.shared,
            len: self.len,
            compressed_len: self.compressed_len,
        }
    }

    /// Keeps the first `len` tokens (and the compressed blocks that need only them), e.g. to
    /// roll back rejected speculative tokens; the pages past the end go back to `alloc`.
    /// `truncate(0, ..)` releases everything.
    pub fn truncate(
        &mut self,
        len: usize,
        cfg: &NsaConfig,
        pages: &NsaPages,
        alloc: &mut dyn PageAllocator,
    ) {
        self.len = self.len.min(len);
        self.compressed_len = self.compressed_len.min(cfg.compressed_len(self.len));
        let ps = pages.page_size;
        for (pool, keep) in [
            (NsaPool::Raw, self.len.div_ceil(ps)),
            (NsaPool::Compressed, self.compressed_len.div_ceil(ps)),
        ] {
            let i = pool.index();
            for p in self.pages[i].drain(keep.min(self.pages[i].len())..) {
                alloc.release(pool, p);
            }
            self.shared[i] = self.shared[i].min(keep);
        }
    }

    /// The block table of this sequence's raw pages, `[1, pages]` i32.
    pub fn block_table(&self, device: &Device) -> Result<Tensor> {
        block_table(std::slice::from_ref(self), device)
    }

    /// The same page lists and lengths, for a copy of the pools they index (not a fork: the
    /// allocator is not told).
    fn duplicate(&self) -> Self {
        Self {
            pages: self.pages.clone(),
            shared: self.shared,
            len: self.len,
            compressed_len: self.compressed_len,
        }
    }

    /// Pages of each pool this state needs to hold `len` tokens (beyond those it holds).
    fn pages_short(&self, len: usize, cfg: &NsaConfig, page_size: usize) -> [usize; 2] {
        [
            len.div_ceil(page_size).saturating_sub(self.pages[0].len()),
            cfg.compressed_len(len)
                .div_ceil(page_size)
                .saturating_sub(self.pages[1].len()),
        ]
    }

    /// Writes `xs [n, Hkv, ..]` (one per tensor of the pool) at rows `at..at + n` of the
    /// sequence, taking pages from `alloc` as the sequence grows and copying a shared page
    /// before changing it.
    fn write(
        &mut self,
        pages: &NsaPages,
        pool: NsaPool,
        at: usize,
        xs: [&Tensor; 2],
        alloc: &mut dyn PageAllocator,
    ) -> Result<()> {
        let ps = pages.page_size;
        let np = pages.num_pages(pool);
        let flat: Vec<Tensor> = pages
            .pools(pool)
            .iter()
            .map(|t| {
                let (_, _, h, d) = t.dims4()?;
                Ok(t.reshape((np * ps, h, d))?)
            })
            .collect::<Result<_>>()?;
        let i = pool.index();
        let n = xs[0].dims()[0];
        let take = |alloc: &mut dyn PageAllocator| -> Result<usize> {
            let page = alloc.alloc(pool).ok_or_else(|| {
                invalid(
                    "pages",
                    format!("the {pool:?} pool ({np} pages of {ps}) has no free page left"),
                )
            })?;
            if page >= np {
                alloc.release(pool, page);
                return Err(invalid(
                    "pages",
                    format!("the allocator gave page {page} of a {pool:?} pool of {np}"),
                ));
            }
            Ok(page)
        };
        let (mut pos, mut off) = (at, 0);
        while off < n {
            let (pi, r) = (pos / ps, pos % ps);
            if pi == self.pages[i].len() {
                let page = take(alloc)?;
                self.pages[i].push(page);
            } else if pi < self.shared[i] {
                // another state may read this page: write into a copy of its first r rows
                let page = take(alloc)?;
                let old = self.pages[i][pi];
                if r > 0 {
                    for f in &flat {
                        // a copy: slice_set refuses a source that shares the pool's storage
                        f.slice_set(&f.narrow(0, old * ps, r)?.copy()?, 0, page * ps)?;
                    }
                }
                alloc.release(pool, old);
                self.pages[i][pi] = page;
                self.shared[i] = pi;
            }
            let count = (ps - r).min(n - off);
            let dst = self.pages[i][pi] * ps + r;
            for (f, x) in flat.iter().zip(xs) {
                f.slice_set(&x.narrow(0, off, count)?.contiguous()?, 0, dst)?;
            }
            pos += count;
            off += count;
        }
        Ok(())
    }
}

impl NativeSparseAttention {
    /// [`Self::forward_step`] on server-owned pages: appends `k_new` / `v_new [1, Tn, Hkv, ..]`
    /// (one sequence) and the compressed blocks they complete to `state`'s pages in `pages`,
    /// then attends `q [1, Tq, Hq, D]` (the last `Tq <= Tn` new positions) over everything the
    /// state holds: the selection and window branches read the pages in place
    /// ([`SelectionAttention::forward_paged`](super::SelectionAttention::forward_paged)), the
    /// compressed branch gathers the (stride times fewer) compressed rows. Equals the same
    /// steps on an [`NsaCache`](super::NsaCache). On an error `state` holds what it held
    /// before (pages taken for the failed step go back to `alloc`).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use fp8nsa_ops::nsa::*;
    ///
    /// let dev = Device::Cpu;
    /// let dims = NsaDims { hq: 4, hkv: 1, d: 32, dv: 32 };
    /// let nsa = NativeSparseAttention::new(NsaConfig::default(), dims, Compressor::MeanPool,
    ///                                      Gates::Fixed([1.0, 1.0, 1.0]))?;
    /// let pages = NsaPages::new(dims, 16, 64, 8, DType::F32, &dev)?; // the server's pools
    /// let mut alloc = PagePool::new(64, 8);
    /// let mut seq = NsaSeqState::new();
    /// let x = Tensor::zeros((1, 1, 8), DType::F32, &dev)?; // gate input (unused here)
    /// for _ in 0..40 {
    ///     let (q, k, v) = (Tensor::randn(0f32, 1.0, (1, 1, 4, 32), &dev)?,
    ///                      Tensor::randn(0f32, 1.0, (1, 1, 1, 32), &dev)?,
    ///                      Tensor::randn(0f32, 1.0, (1, 1, 1, 32), &dev)?);
    ///     nsa.forward_step_paged(&x, &q, &k, &v, &pages, &mut seq, &mut alloc)?;
    /// }
    /// let mut branch = seq.fork(&mut alloc); // shares all 3 raw pages
    /// assert_eq!((seq.len(), branch.pages(NsaPool::Raw).len()), (40, 3));
    /// branch.truncate(0, nsa.config(), &pages, &mut alloc); // done with the branch
    /// seq.truncate(0, nsa.config(), &pages, &mut alloc);
    /// assert_eq!(alloc.free_pages(NsaPool::Raw), 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn forward_step_paged(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        pages: &NsaPages,
        state: &mut NsaSeqState,
        alloc: &mut dyn PageAllocator,
    ) -> Result<Tensor> {
        Ok(self
            .forward_step_paged_detailed(gate_input, q, k_new, v_new, pages, state, alloc)?
            .o)
    }

    /// [`Self::forward_step_paged`] with every branch.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_step_paged_detailed(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        pages: &NsaPages,
        state: &mut NsaSeqState,
        alloc: &mut dyn PageAllocator,
    ) -> Result<NsaOutput> {
        super::layer::check_step_queries(q, k_new)?;
        let before = state.len();
        self.append_kv_paged(k_new, v_new, pages, state, alloc)?;
        let out = self.attend_paged(gate_input, q, pages, std::slice::from_ref(state));
        if out.is_err() {
            state.truncate(before, self.config(), pages, alloc);
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
        alloc: &mut dyn PageAllocator,
    ) -> Result<()> {
        let tn = self.check_kv(k_new, v_new)?;
        let NsaDims { hkv, d, dv, .. } = self.dims();
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
        let (before, before_c) = (state.len, state.compressed_len);
        let out = self.append_paged_inner(k_new, v_new, tn, pages, state, alloc);
        if out.is_err() {
            // back to what the state held (the lengths first, so truncate frees the new pages)
            state.len = before;
            state.compressed_len = before_c;
            state.truncate(before, self.config(), pages, alloc);
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
        alloc: &mut dyn PageAllocator,
    ) -> Result<()> {
        if tn == 0 {
            return Ok(());
        }
        let (k, v) = (k_new.squeeze(0)?, v_new.squeeze(0)?);
        state.write(pages, NsaPool::Raw, state.len, [&k, &v], alloc)?;
        // the new length counts only once its rows are written (truncate on failure then
        // releases whatever pages the write took)
        state.len += tn;
        let cfg = self.config();
        let (old, new) = (state.compressed_len, cfg.compressed_len(state.len));
        if new > old {
            let (l, s) = (cfg.compress_block, cfg.compress_stride);
            // the raw rows the new compressed blocks cover, block `old` first
            let (from, to) = (old * s, ((new - 1) * s + l).min(state.len));
            let [kw, vw] = pages.gather(NsaPool::Raw, &state.pages[0], from, to)?;
            let ck = self.compressor().compress(cfg, &kw, 0, new - old, true)?;
            let cv = self.compressor().compress(cfg, &vw, 0, new - old, false)?;
            let (ck, cv) = (ck.squeeze(0)?, cv.squeeze(0)?);
            state.write(pages, NsaPool::Compressed, old, [&ck, &cv], alloc)?;
            state.compressed_len = new;
        }
        Ok(())
    }

    /// Attends `q [B, Tq, Hq, D]` over the states of `B` sequences of equal length.
    fn attend_paged(
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
        let compressed: Vec<[Tensor; 2]> = states
            .iter()
            .map(|s| pages.gather(NsaPool::Compressed, &s.pages[1], 0, s.compressed_len))
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

/// The block table of the states' raw pages, `[B, max pages]` i32, `-1` past a row's pages.
fn block_table(states: &[NsaSeqState], device: &Device) -> Result<Tensor> {
    let width = states.iter().map(|s| s.pages[0].len()).max().unwrap_or(0);
    let t: Vec<i32> = states
        .iter()
        .flat_map(|s| {
            let mut row: Vec<i32> = s.pages[0].iter().map(|&p| p as i32).collect();
            row.resize(width, -1);
            row
        })
        .collect();
    Ok(Tensor::from_vec(t, (states.len(), width), device)?)
}

/// Rows per page of an [`NsaCache`]'s own pools.
const CACHE_PAGE: usize = 64;

/// Keys, values and compressed keys / values of a batch of sequences being decoded, for a
/// caller that does not manage pages: a convenience over one [`NsaSeqState`] per batch row on
/// [`NsaPages`] the cache owns (pages of 64 rows), which grow (doubling) as the sequences do.
/// Compressed blocks are appended as they complete, never recomputed. `clone` makes an
/// independent copy.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use fp8nsa_ops::nsa::*;
///
/// let dev = Device::Cpu;
/// let dims = NsaDims { hq: 4, hkv: 1, d: 32, dv: 32 };
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
/// assert_eq!(cache.keys().unwrap().dims(), &[2, 40, 1, 32]);
/// cache.truncate(30, nsa.config()); // roll back 10 tokens
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
    alloc: PagePool,
    /// One per batch row, all of the same length.
    seqs: Vec<NsaSeqState>,
}

impl Clone for NsaCache {
    /// A deep copy: steps write into the pools, so clones must not share them.
    fn clone(&self) -> Self {
        Self {
            store: self.store.as_ref().map(|s| CacheStore {
                pages: s.pages.deep_copy().expect("copying a cache's pools"),
                alloc: s.alloc.clone(),
                seqs: s.seqs.iter().map(NsaSeqState::duplicate).collect(),
            }),
        }
    }
}

impl NsaCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens held (by each sequence of the batch).
    pub fn len(&self) -> usize {
        self.store
            .as_ref()
            .and_then(|s| s.seqs.first())
            .map_or(0, |s| s.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Compressed blocks held.
    pub fn compressed_len(&self) -> usize {
        self.store
            .as_ref()
            .and_then(|s| s.seqs.first())
            .map_or(0, |s| s.compressed_len())
    }

    /// A copy of the `[B, T, Hkv, D]` keys held, if any.
    pub fn keys(&self) -> Option<Tensor> {
        self.gathered(NsaPool::Raw, 0)
    }

    /// A copy of the `[B, T, Hkv, Dv]` values held, if any.
    pub fn values(&self) -> Option<Tensor> {
        self.gathered(NsaPool::Raw, 1)
    }

    /// A copy of the `[B, n_c, Hkv, D]` compressed keys (f32), if any.
    pub fn compressed_keys(&self) -> Option<Tensor> {
        self.gathered(NsaPool::Compressed, 0)
    }

    fn gathered(&self, pool: NsaPool, which: usize) -> Option<Tensor> {
        let s = self.store.as_ref()?;
        let rows = |q: &NsaSeqState| match pool {
            NsaPool::Raw => q.len(),
            NsaPool::Compressed => q.compressed_len(),
        };
        if s.seqs.first().is_none_or(|q| rows(q) == 0) {
            return None;
        }
        let parts: Vec<Tensor> = s
            .seqs
            .iter()
            .map(|q| {
                let [a, b] = s.pages.gather(pool, &q.pages[pool.index()], 0, rows(q))?;
                Ok([a, b][which].clone())
            })
            .collect::<Result<_>>()
            .ok()?;
        Tensor::cat(&parts, 0).ok()
    }

    /// Forgets everything after the first `len` tokens (and the compressed blocks that need
    /// them), e.g. to roll back rejected speculative tokens.
    pub fn truncate(&mut self, len: usize, cfg: &NsaConfig) {
        if let Some(s) = &mut self.store {
            for q in &mut s.seqs {
                q.truncate(len, cfg, &s.pages, &mut s.alloc);
            }
        }
    }

    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

impl NativeSparseAttention {
    /// Appends `k_new` / `v_new [B, Tn, Hkv, ..]` to the cache's states, growing its pools
    /// first so the append cannot run out of pages. On an error every state holds what it
    /// held before.
    pub(crate) fn append_cached(
        &self,
        k_new: &Tensor,
        v_new: &Tensor,
        cache: &mut NsaCache,
    ) -> Result<()> {
        let tn = self.check_kv(k_new, v_new)?;
        let b = k_new.dims()[0];
        let cfg = self.config();
        // a first append builds the store aside, kept only if the append succeeds (so a failed
        // first call does not fix the batch size)
        let mut fresh = None;
        let store = match &mut cache.store {
            Some(s) => {
                let (pd, pdt) = (s.pages.k.dims(), s.pages.k.dtype());
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
                let [raw, cmp] = NsaSeqState::new().pages_short(tn, cfg, CACHE_PAGE);
                let (raw, cmp) = ((raw * b).max(4), (cmp * b).max(4));
                let pages = NsaPages::new(
                    self.dims(),
                    CACHE_PAGE,
                    raw,
                    cmp,
                    k_new.dtype(),
                    k_new.device(),
                )?;
                fresh.insert(CacheStore {
                    pages,
                    alloc: PagePool::new(raw, cmp),
                    seqs: (0..b).map(|_| NsaSeqState::new()).collect(),
                })
            }
        };
        let len = store.seqs[0].len();
        let mut short = [0usize; 2];
        for q in &store.seqs {
            let [r, c] = q.pages_short(len + tn, cfg, CACHE_PAGE);
            short[0] += r;
            short[1] += c;
        }
        let grow = |pool: NsaPool, need: usize| {
            let (free, have) = (store.alloc.free_pages(pool), store.pages.num_pages(pool));
            if need > free {
                (need - free).max(have)
            } else {
                0
            }
        };
        let (add_raw, add_cmp) = (
            grow(NsaPool::Raw, short[0]),
            grow(NsaPool::Compressed, short[1]),
        );
        if add_raw + add_cmp > 0 {
            store.pages.grow(add_raw, add_cmp)?;
            store.alloc.grow(add_raw, add_cmp);
        }
        for i in 0..b {
            let (k, v) = (k_new.narrow(0, i, 1)?, v_new.narrow(0, i, 1)?);
            let out =
                self.append_kv_paged(&k, &v, &store.pages, &mut store.seqs[i], &mut store.alloc);
            if let Err(e) = out {
                for q in &mut store.seqs[..i] {
                    q.truncate(len, cfg, &store.pages, &mut store.alloc);
                }
                return Err(e);
            }
        }
        if fresh.is_some() {
            cache.store = fresh;
        }
        Ok(())
    }

    /// Attends `q [B, Tq, Hq, D]` over everything the cache holds.
    pub(crate) fn attend_cached(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        cache: &NsaCache,
    ) -> Result<NsaOutput> {
        match &cache.store {
            Some(s) => self.attend_paged(gate_input, q, &s.pages, &s.seqs),
            None => Err(invalid(
                "k_new",
                "the cache is empty: append at least one token",
            )),
        }
    }
}
