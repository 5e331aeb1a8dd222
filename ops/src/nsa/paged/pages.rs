//! The page pools of one NSA layer, which every sequence's state indexes.

use candle_core::{DType, Device, Tensor};

use super::NsaPool;
use crate::error::{invalid, Error, Result};
use crate::nsa::NsaDims;

/// The page pools of one NSA layer, shared by all its sequences: keys `[P, page_size, Hkv, D]`
/// and values `[P, page_size, Hkv, Dv]` in the model's dtype, compressed keys and values
/// `[Pc, page_size, Hkv, D / Dv]` in f32. Pages are written in place.
#[derive(Clone, Debug)]
pub struct NsaPages {
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    ck: Tensor,
    cv: Tensor,
    page_size: usize,
}

impl NsaPages {
    /// Zeroed pools of `raw_pages` and `compressed_pages` pages of `page_size` rows. A
    /// compressed page fills `compress_stride` times slower than a raw one, so
    /// `raw_pages / compress_stride` (plus one per sequence) compressed pages are enough.
    /// Sizes whose byte count overflows are [`Error::Invalid`] naming the count.
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
        let (hkv, d, dv) = (dims.hkv(), dims.d(), dims.dv());
        for (arg, pages, size) in [
            ("raw_pages", raw_pages, dtype.size_in_bytes()),
            (
                "compressed_pages",
                compressed_pages,
                DType::F32.size_in_bytes(),
            ),
        ] {
            pool_bytes(pages, page_size, hkv, d.max(dv), size).ok_or_else(|| {
                invalid(
                    arg,
                    format!(
                        "{pages} pages of {page_size} rows x {hkv} heads x {} do not fit in \
                         memory's address space",
                        d.max(dv)
                    ),
                )
            })?;
        }
        // mapped as they fill (the compressed pools fill `compress_stride` times slower); a size
        // the allocator refuses is an error, not an abort
        let z =
            |arg, p, d, dt| crate::storage::zeros_checked((p, page_size, hkv, d), dt, device, arg);
        Ok(Self {
            k: z("raw_pages", raw_pages, d, dtype)?,
            v: z("raw_pages", raw_pages, dv, dtype)?,
            ck: z("compressed_pages", compressed_pages, d, DType::F32)?,
            cv: z("compressed_pages", compressed_pages, dv, DType::F32)?,
            page_size,
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The key pool `[P, page_size, Hkv, D]` (for [`PagedKv`](crate::nsa::PagedKv)).
    pub fn keys(&self) -> &Tensor {
        &self.k
    }

    /// The value pool `[P, page_size, Hkv, Dv]`.
    pub fn values(&self) -> &Tensor {
        &self.v
    }

    /// Pages in `pool`.
    pub fn num_pages(&self, pool: NsaPool) -> usize {
        self.pools(pool)[0].dims()[0]
    }

    /// `raw` and `compressed` more zeroed pages, the pages held kept as they are (the pools
    /// are copied into larger ones).
    pub(crate) fn grow(&mut self, raw: usize, compressed: usize) -> Result<()> {
        let bigger = |t: &Tensor, add: usize| -> Result<Tensor> {
            if add == 0 {
                return Ok(t.clone());
            }
            let (p, ps, h, d) = t.dims4()?;
            let n = p
                .checked_add(add)
                .filter(|&n| pool_bytes(n, ps, h, d, t.dtype().size_in_bytes()).is_some())
                .ok_or_else(|| invalid("pages", format!("cannot grow {p} pages by {add}")))?;
            let out = crate::storage::zeros_checked((n, ps, h, d), t.dtype(), t.device(), "pages")?;
            out.slice_set(t, 0, 0)?;
            Ok(out)
        };
        // all four first: a failed allocation leaves the pools as they were
        let (k, v) = (bigger(&self.k, raw)?, bigger(&self.v, raw)?);
        let (ck, cv) = (bigger(&self.ck, compressed)?, bigger(&self.cv, compressed)?);
        (self.k, self.v, self.ck, self.cv) = (k, v, ck, cv);
        Ok(())
    }

    /// An independent copy of the pools (pages are written in place, so copies must not share
    /// storage).
    pub(crate) fn deep_copy(&self) -> Result<Self> {
        Ok(Self {
            k: self.k.copy()?,
            v: self.v.copy()?,
            ck: self.ck.copy()?,
            cv: self.cv.copy()?,
            page_size: self.page_size,
        })
    }

    pub(crate) fn pools(&self, pool: NsaPool) -> [&Tensor; 2] {
        match pool {
            NsaPool::Raw => [&self.k, &self.v],
            NsaPool::Compressed => [&self.ck, &self.cv],
        }
    }

    /// Rows `[from, to)` of a page list, gathered: `[1, to - from, Hkv, D]` per pool.
    pub(crate) fn gather(
        &self,
        pool: NsaPool,
        list: &[usize],
        from: usize,
        to: usize,
    ) -> Result<[Tensor; 2]> {
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

/// Bytes of a pool of `pages` pages, `None` past what an allocation can address. Block tables
/// hold page ids as i32 and the gather's row ids are u32, so rows past `i32::MAX` are refused
/// too.
fn pool_bytes(pages: usize, page_size: usize, hkv: usize, d: usize, size: usize) -> Option<usize> {
    let rows = pages.checked_mul(page_size)?;
    i32::try_from(rows).ok()?;
    let bytes = rows.checked_mul(hkv)?.checked_mul(d)?.checked_mul(size)?;
    (bytes <= isize::MAX as usize).then_some(bytes)
}
