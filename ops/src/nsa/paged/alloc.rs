//! Page bookkeeping: which pages of a pool are free and how many sequence states hold each.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};

pub use fp8nsa_types::NsaPool;

/// The server's page bookkeeping, as a sequence's state uses it. Pages are reference counted:
/// [`NsaSeqState::fork`](super::NsaSeqState::fork) shares every page of the forked state, a
/// state writes into a page only while it is that page's one holder (it copies the page
/// first otherwise), and a page goes back to the free list when its last holder releases it.
/// States reach their allocator through a [`SharedAllocator`], so that dropping a state can
/// return its pages.
pub trait PageAllocator: Send {
    /// A free page of `pool` (held once), or `None` when the pool is exhausted.
    fn alloc(&mut self, pool: NsaPool) -> Option<usize>;
    /// One more holder of `page`. Sharing a page nobody holds is [`Error::PageNotHeld`].
    fn share(&mut self, pool: NsaPool, page: usize) -> Result<()>;
    /// One holder fewer of `page`. Releasing a page nobody holds (a double release) is
    /// [`Error::PageNotHeld`], and frees nothing.
    fn release(&mut self, pool: NsaPool, page: usize) -> Result<()>;
    /// How many holders `page` has (0 when free or unknown).
    fn holders(&self, pool: NsaPool, page: usize) -> u32;
    /// Pages of `pool` that [`Self::alloc`] can still hand out.
    fn free_pages(&self, pool: NsaPool) -> usize;
}

/// Free lists and reference counts for the two pools: a complete [`PageAllocator`] for a
/// server that has no block manager of its own (and for tests).
///
/// ```
/// use fp8nsa_ops::{nsa::{NsaPool, PageAllocator, PagePool}, Error};
/// let mut pool = PagePool::new(2, 1)?;
/// let p = pool.alloc(NsaPool::Raw).unwrap();
/// pool.share(NsaPool::Raw, p)?; // a fork holds it too
/// pool.release(NsaPool::Raw, p)?;
/// assert_eq!(pool.free_pages(NsaPool::Raw), 1); // still held once
/// pool.release(NsaPool::Raw, p)?;
/// assert_eq!(pool.free_pages(NsaPool::Raw), 2);
/// // a second release of a free page is refused and frees nothing
/// assert!(matches!(pool.release(NsaPool::Raw, p), Err(Error::PageNotHeld { page: 0, .. })));
/// assert_eq!(pool.free_pages(NsaPool::Raw), 2);
/// assert_eq!(pool.alloc(NsaPool::Compressed), Some(0));
/// assert_eq!(pool.alloc(NsaPool::Compressed), None);
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct PagePool {
    free: [Vec<usize>; 2],
    refs: [Vec<u32>; 2],
}

impl PagePool {
    /// Pools of `raw_pages` and `compressed_pages` pages, all free. Counts whose bookkeeping
    /// cannot be allocated are [`Error::Invalid`] naming them (never an abort).
    pub fn new(raw_pages: usize, compressed_pages: usize) -> Result<Self> {
        let mut pool = Self {
            free: [Vec::new(), Vec::new()],
            refs: [Vec::new(), Vec::new()],
        };
        pool.grow(raw_pages, compressed_pages)?;
        Ok(pool)
    }

    /// `raw` and `compressed` more free pages (ids after the current ones, handed out after
    /// the free ones below them), for pools grown by `NsaPages::grow`. On an error nothing
    /// changed.
    pub(crate) fn grow(&mut self, raw: usize, compressed: usize) -> Result<()> {
        for (i, add) in [(0, raw), (1, compressed)] {
            let n = self.refs[i].len();
            let ok = n.checked_add(add).is_some()
                && self.refs[i].try_reserve_exact(add).is_ok()
                && self.free[i].try_reserve_exact(add).is_ok();
            if !ok {
                return Err(Error::Invalid {
                    arg: if i == 0 {
                        "raw_pages"
                    } else {
                        "compressed_pages"
                    },
                    msg: format!("cannot keep track of {n} + {add} pages in memory"),
                });
            }
        }
        for (i, add) in [(0, raw), (1, compressed)] {
            let n = self.refs[i].len();
            self.refs[i].resize(n + add, 0);
            // popped from the back: low ids first, and the new ids after the free old ones
            self.free[i].splice(0..0, (n..n + add).rev());
        }
        Ok(())
    }
}

impl PageAllocator for PagePool {
    fn alloc(&mut self, pool: NsaPool) -> Option<usize> {
        let i = pool.index();
        let page = self.free[i].pop()?;
        self.refs[i][page] = 1;
        Some(page)
    }

    fn share(&mut self, pool: NsaPool, page: usize) -> Result<()> {
        match self.refs[pool.index()].get_mut(page) {
            Some(r) if *r > 0 => {
                *r = r.saturating_add(1);
                Ok(())
            }
            // a free page is on the free list: sharing it would hand it out twice
            _ => Err(Error::PageNotHeld {
                pool,
                page,
                op: "share",
            }),
        }
    }

    fn release(&mut self, pool: NsaPool, page: usize) -> Result<()> {
        let i = pool.index();
        match self.refs[i].get_mut(page) {
            Some(r) if *r > 0 => {
                *r -= 1;
                if *r == 0 {
                    self.free[i].push(page);
                }
                Ok(())
            }
            _ => Err(Error::PageNotHeld {
                pool,
                page,
                op: "release",
            }),
        }
    }

    fn holders(&self, pool: NsaPool, page: usize) -> u32 {
        self.refs[pool.index()].get(page).copied().unwrap_or(0)
    }

    fn free_pages(&self, pool: NsaPool) -> usize {
        self.free[pool.index()].len()
    }
}

/// A [`PageAllocator`] that sequence states hold, so that a state returns its pages when it is
/// dropped: one allocator (the server's block manager, or a [`PagePool`]) behind a lock, shared
/// by every state of the pools it manages. Cloning the handle shares the allocator.
///
/// ```
/// use fp8nsa_ops::nsa::{NsaPool, PagePool, SharedAllocator};
/// let alloc = SharedAllocator::new(PagePool::new(4, 2)?);
/// let p = alloc.lock().alloc(NsaPool::Raw).unwrap();
/// assert_eq!((p, alloc.lock().free_pages(NsaPool::Raw)), (0, 3));
/// # Ok::<(), fp8nsa_ops::Error>(())
/// ```
#[derive(Clone)]
pub struct SharedAllocator(Arc<Mutex<dyn PageAllocator>>);

impl SharedAllocator {
    pub fn new(alloc: impl PageAllocator + 'static) -> Self {
        Self(Arc::new(Mutex::new(alloc)))
    }

    /// The allocator of a handle whose concrete type the caller keeps (as `NsaCache` keeps its
    /// `PagePool` to grow it).
    pub(crate) fn from_arc(alloc: Arc<Mutex<dyn PageAllocator>>) -> Self {
        Self(alloc)
    }

    /// Exclusive access to the allocator.
    pub fn lock(&self) -> MutexGuard<'_, dyn PageAllocator + 'static> {
        // a holder that panicked left at worst a count it had not finished changing; the pages
        // of every other state are still right, so keep serving them
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl std::fmt::Debug for SharedAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let a = self.lock();
        f.debug_struct("SharedAllocator")
            .field("free_raw", &a.free_pages(NsaPool::Raw))
            .field("free_compressed", &a.free_pages(NsaPool::Compressed))
            .finish()
    }
}
