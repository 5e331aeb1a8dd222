//! One sequence's decode state on [`NsaPages`]: page lists it owns through its allocator.

use candle_core::{Device, Tensor};

use super::{NsaPages, NsaPool, PageAllocator, SharedAllocator};
use crate::error::{invalid, Error, Result};
use crate::nsa::NsaConfig;

/// One sequence's NSA decode state on [`NsaPages`]: its raw and compressed page lists and how
/// many tokens and compressed blocks they hold. The state owns its pages: dropping it, or
/// truncating it, returns them to its allocator. Clone it only through [`Self::fork`], which
/// shares the pages (the allocator counts the holders).
#[derive(Debug)]
pub struct NsaSeqState {
    alloc: SharedAllocator,
    pages: [Vec<usize>; 2],
    len: usize,
    compressed_len: usize,
}

impl NsaSeqState {
    /// An empty state whose pages will come from (and go back to) `alloc`.
    pub fn new(alloc: &SharedAllocator) -> Self {
        Self {
            alloc: alloc.clone(),
            pages: [Vec::new(), Vec::new()],
            len: 0,
            compressed_len: 0,
        }
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

    /// The allocator this state's pages come from.
    pub fn allocator(&self) -> &SharedAllocator {
        &self.alloc
    }

    /// A state for another sequence with the same prefix (prefix sharing, beam search,
    /// speculative branches): every page is shared through the allocator, nothing is copied
    /// until one of the two writes into a page the other still holds. An allocator that
    /// refuses a share is an error, with no page shared.
    pub fn fork(&self) -> Result<Self> {
        let mut a = self.alloc.lock();
        let mut shared = Vec::new();
        for pool in NsaPool::BOTH {
            for &p in &self.pages[pool.index()] {
                if let Err(e) = a.share(pool, p) {
                    // undo the shares made so far (these pages are held, so releases succeed)
                    for &(pool, p) in &shared {
                        let _ = a.release(pool, p);
                    }
                    return Err(e);
                }
                shared.push((pool, p));
            }
        }
        drop(a);
        Ok(Self {
            alloc: self.alloc.clone(),
            pages: self.pages.clone(),
            len: self.len,
            compressed_len: self.compressed_len,
        })
    }

    /// Keeps the first `len` tokens (and the compressed blocks that need only them), e.g. to
    /// roll back rejected speculative tokens; the pages past the end go back to the allocator.
    /// `truncate(0, ..)` releases everything. An allocator that refuses a release (it does
    /// not count the page as held) is [`Error::PageNotHeld`]; the state drops the page either
    /// way.
    pub fn truncate(&mut self, len: usize, cfg: &NsaConfig, pages: &NsaPages) -> Result<()> {
        let page_size = pages.page_size();
        self.len = self.len.min(len);
        self.compressed_len = self.compressed_len.min(cfg.compressed_len(self.len));
        let keep = [
            self.len.div_ceil(page_size),
            self.compressed_len.div_ceil(page_size),
        ];
        self.release_past(keep)
    }

    /// Releases every page past `keep[pool]` pages; the first refusal is returned.
    fn release_past(&mut self, keep: [usize; 2]) -> Result<()> {
        let mut first = Ok(());
        let mut a = self.alloc.lock();
        for pool in NsaPool::BOTH {
            let list = &mut self.pages[pool.index()];
            let from = keep[pool.index()].min(list.len());
            for p in list.drain(from..) {
                if let Err(e) = a.release(pool, p) {
                    first = first.and(Err(e));
                }
            }
        }
        first
    }

    /// The block table of this sequence's raw pages, `[1, pages]` i32.
    pub fn block_table(&self, device: &Device) -> Result<Tensor> {
        block_table(std::slice::from_ref(self), device)
    }

    /// The same page lists and lengths on `alloc`, the allocator of a copy of the pools they
    /// index (not a fork: `alloc` already counts these pages).
    pub(crate) fn duplicate_on(&self, alloc: &SharedAllocator) -> Self {
        Self {
            alloc: alloc.clone(),
            pages: self.pages.clone(),
            len: self.len,
            compressed_len: self.compressed_len,
        }
    }

    /// Pages of each pool this state needs to hold `len` tokens (beyond those it holds).
    pub(crate) fn pages_short(&self, len: usize, cfg: &NsaConfig, page_size: usize) -> [usize; 2] {
        [
            len.div_ceil(page_size).saturating_sub(self.pages[0].len()),
            cfg.compressed_len(len)
                .div_ceil(page_size)
                .saturating_sub(self.pages[1].len()),
        ]
    }

    /// Sets the lengths after a write (`len` tokens, `compressed_len` blocks).
    pub(crate) fn set_lens(&mut self, len: usize, compressed_len: usize) {
        (self.len, self.compressed_len) = (len, compressed_len);
    }

    /// Writes `xs [n, Hkv, ..]` (one per tensor of the pool) at rows `at..at + n` of the
    /// sequence, taking pages from the allocator as the sequence grows and copying a page
    /// another state still holds before changing it. Pages taken stay in the list on an error
    /// (a truncation to the old length returns them).
    pub(crate) fn write(
        &mut self,
        pages: &NsaPages,
        pool: NsaPool,
        at: usize,
        xs: [&Tensor; 2],
    ) -> Result<()> {
        let ps = pages.page_size();
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
        let mut alloc = self.alloc.lock();
        let take = |alloc: &mut dyn PageAllocator| -> Result<usize> {
            let page = alloc
                .alloc(pool)
                .ok_or(Error::OutOfPages { pool, pages: np })?;
            if page >= np {
                // not ours to keep: the pools have no such page
                let _ = alloc.release(pool, page);
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
                let page = take(&mut *alloc)?;
                self.pages[i].push(page);
            } else if alloc.holders(pool, self.pages[i][pi]) > 1 {
                // another state reads this page: write into a copy of its first r rows
                let page = take(&mut *alloc)?;
                let old = self.pages[i][pi];
                if r > 0 {
                    let copied = flat.iter().try_for_each(|f| -> Result<()> {
                        // a copy: slice_set refuses a source that shares the pool's storage
                        f.slice_set(&f.narrow(0, old * ps, r)?.copy()?, 0, page * ps)?;
                        Ok(())
                    });
                    if let Err(e) = copied {
                        let _ = alloc.release(pool, page);
                        return Err(e);
                    }
                }
                // the copy is ours first, so a refused release below leaks nothing of ours;
                // `old` is held by another state too, so the release only drops our count
                self.pages[i][pi] = page;
                alloc.release(pool, old)?;
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

impl Drop for NsaSeqState {
    fn drop(&mut self) {
        // a refusal here means the allocator does not count a page this state holds: nothing
        // is left to return, and a drop has no one to report to
        let _ = self.release_past([0, 0]);
    }
}

/// The block table of the states' raw pages, `[B, max pages]` i32, `-1` past a row's pages.
pub(crate) fn block_table(states: &[NsaSeqState], device: &Device) -> Result<Tensor> {
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
