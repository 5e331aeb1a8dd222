use crate::error::{check_positive, Result};

/// An fp8 linear problem: `x [m, k]`, `W [n, k]` in `bn x bk` blocks (edge blocks partial),
/// `y [m, n]`. Constructed only valid (every size at least 1), so no layer or backend checks
/// it again.
///
/// ```
/// use fp8nsa_types::LinearShape;
/// let s = LinearShape::new(1, 576, 3884, 128, 128)?;
/// assert_eq!((s.n_blocks(), s.k_blocks()), (5, 31));
/// assert!(LinearShape::new(1, 576, 3884, 128, 0).is_err());
/// assert_eq!(s.with_m(7)?.m(), 7);
/// // a block past the matrix is one partial block
/// let big = LinearShape::new(1, 576, 3884, usize::MAX, 4096)?;
/// assert_eq!((big.bk(), big.fitted().bk(), big.fitted().k_blocks()), (4096, 3884, 1));
/// # Ok::<(), fp8nsa_types::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinearShape {
    m: usize,
    n: usize,
    k: usize,
    bn: usize,
    bk: usize,
}

impl LinearShape {
    /// `m` rows of `x`, a `[n, k]` weight in `bn x bk` blocks; each at least 1 (else
    /// `Error::Invalid` naming it).
    pub fn new(m: usize, n: usize, k: usize, bn: usize, bk: usize) -> Result<Self> {
        for (arg, v) in [("m", m), ("n", n), ("k", k), ("bn", bn), ("bk", bk)] {
            check_positive(arg, v)?;
        }
        Ok(Self { m, n, k, bn, bk })
    }

    /// The same problem with each block at most the matrix's size: a block larger than the
    /// matrix is one partial block either way, and the fitted size keeps a kernel's size
    /// arithmetic (`bk` times anything) far from overflow. Kernels whose applicability
    /// depends on the block as stored (the CUDA planner) use [`LinearShape::new`]'s.
    pub fn fitted(self) -> Self {
        Self {
            bn: self.bn.min(self.n),
            bk: self.bk.min(self.k),
            ..self
        }
    }

    /// The same weight for `m` rows.
    pub fn with_m(self, m: usize) -> Result<Self> {
        check_positive("m", m)?;
        Ok(Self { m, ..self })
    }

    pub fn m(&self) -> usize {
        self.m
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn bn(&self) -> usize {
        self.bn
    }

    pub fn bk(&self) -> usize {
        self.bk
    }

    /// Rows of the weight-scale matrix, `ceil(n / bn)`.
    pub fn n_blocks(&self) -> usize {
        self.n.div_ceil(self.bn)
    }

    /// Columns of the weight-scale matrix (and activation K-groups), `ceil(k / bk)`.
    pub fn k_blocks(&self) -> usize {
        self.k.div_ceil(self.bk)
    }
}

/// The weights of a grouped (mixture-of-experts) call: `e` experts of `[n, k]` in `bn x bk`
/// blocks. Constructed only valid (every size at least 1). [`ExpertsShape::routed_rows`] is
/// the one check of a call's routing, on every backend.
///
/// ```
/// use fp8nsa_types::ExpertsShape;
/// let s = ExpertsShape::new(4, 576, 3884, 128, 128)?;
/// assert_eq!((s.e(), s.scales_per_expert()), (4, 5 * 31));
/// assert_eq!(s.routed_rows(&[0, 3, 1, 0])?, 4);
/// assert!(s.routed_rows(&[0, 0, 0, 0]).is_err()); // nothing routed
/// assert!(s.routed_rows(&[1, 1]).is_err()); // one count per expert
/// assert_eq!(s.linear(3)?.n(), 576);
/// # Ok::<(), fp8nsa_types::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertsShape {
    e: usize,
    n: usize,
    k: usize,
    bn: usize,
    bk: usize,
}

impl ExpertsShape {
    /// Every size at least 1 (else `Error::Invalid` naming it).
    pub fn new(e: usize, n: usize, k: usize, bn: usize, bk: usize) -> Result<Self> {
        for (arg, v) in [("e", e), ("n", n), ("k", k), ("bn", bn), ("bk", bk)] {
            check_positive(arg, v)?;
        }
        Ok(Self { e, n, k, bn, bk })
    }

    /// Experts.
    pub fn e(&self) -> usize {
        self.e
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn bn(&self) -> usize {
        self.bn
    }

    pub fn bk(&self) -> usize {
        self.bk
    }

    /// Scales per expert, `ceil(n / bn) · ceil(k / bk)`.
    pub fn scales_per_expert(&self) -> usize {
        self.n.div_ceil(self.bn) * self.k.div_ceil(self.bk)
    }

    /// One expert's problem for `m >= 1` rows.
    pub fn linear(&self, m: usize) -> Result<LinearShape> {
        LinearShape::new(m, self.n, self.k, self.bn, self.bk)
    }

    /// The rows a call routes: one count per expert, summing without overflow to at least one
    /// row (`Error::Invalid` naming `counts` otherwise).
    pub fn routed_rows(&self, counts: &[usize]) -> Result<usize> {
        let bad = |msg: String| crate::Error::Invalid { arg: "counts", msg };
        if counts.len() != self.e {
            return Err(bad(format!(
                "{} counts for {} experts: one per expert",
                counts.len(),
                self.e
            )));
        }
        let t = counts
            .iter()
            .try_fold(0usize, |a, &c| a.checked_add(c))
            .ok_or_else(|| bad("the counts overflow".into()))?;
        if t == 0 {
            return Err(bad("route at least one row".into()));
        }
        Ok(t)
    }
}

/// Attention head counts and head dims: `hq = G * hkv` query heads of dim `d`, keys of dim
/// `d`, values of dim `dv`. Constructed only valid (every size at least 1, `hq` a multiple
/// of `hkv`), so the layers and backends that take it check nothing again.
///
/// ```
/// use fp8nsa_types::AttnDims;
/// let dims = AttnDims::new(16, 1, 128, 128)?;
/// assert_eq!((dims.group(), dims.hq(), dims.dv()), (16, 16, 128));
/// assert!(AttnDims::new(3, 2, 128, 128).is_err());
/// assert!(AttnDims::new(4, 2, 0, 128).is_err());
/// # Ok::<(), fp8nsa_types::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnDims {
    hq: usize,
    hkv: usize,
    d: usize,
    dv: usize,
}

impl AttnDims {
    /// Every size at least 1 and `hq` a multiple of `hkv` (else `Error::Invalid` naming the
    /// size).
    pub fn new(hq: usize, hkv: usize, d: usize, dv: usize) -> Result<Self> {
        for (arg, v) in [("hq", hq), ("hkv", hkv), ("d", d), ("dv", dv)] {
            check_positive(arg, v)?;
        }
        if !hq.is_multiple_of(hkv) {
            return Err(crate::Error::Invalid {
                arg: "hq",
                msg: format!("must be a multiple of hkv = {hkv}, got {hq}"),
            });
        }
        Ok(Self { hq, hkv, d, dv })
    }

    /// Query heads.
    pub fn hq(&self) -> usize {
        self.hq
    }

    /// Key / value heads.
    pub fn hkv(&self) -> usize {
        self.hkv
    }

    /// Query and key head dim.
    pub fn d(&self) -> usize {
        self.d
    }

    /// Value head dim.
    pub fn dv(&self) -> usize {
        self.dv
    }

    /// Query heads per kv head, `G = hq / hkv`.
    pub fn group(&self) -> usize {
        self.hq / self.hkv
    }
}

/// One sequence of a token-packed batch (docs/nsa.md, "Varlen"): its query and key token
/// ranges, and the absolute position of its first query. Query `i` sees key `j` iff
/// `j <= q_offset + i`.
///
/// ```
/// use fp8nsa_types::Seq;
/// let decode = Seq { q_start: 0, q_len: 1, k_start: 0, k_len: 100, q_offset: 99 };
/// assert_eq!(decode.visible_keys(0), 100);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Seq {
    pub q_start: usize,
    pub q_len: usize,
    pub k_start: usize,
    pub k_len: usize,
    pub q_offset: usize,
}

impl Seq {
    /// Keys query `i` (relative to the sequence) may see: `min(q_offset + i + 1, k_len)`,
    /// saturating (callers check `q_offset + q_len` for overflow before launching).
    pub fn visible_keys(&self, i: usize) -> usize {
        self.q_offset
            .saturating_add(i)
            .saturating_add(1)
            .min(self.k_len)
    }
}

/// A paged KV cache's addressing (the vLLM v1 / FlashInfer NHD layout): keys and values live in
/// a pool of pages of `page_size` tokens, and row `i` of `table` (`max_pages` page ids,
/// row-major) lists the pages of sequence `i` in order, so its logical key `j` is token
/// `j % page_size` of page `table[i * max_pages + j / page_size]`. Entries past a sequence's
/// last page are not read.
///
/// Constructed only checked ([`Pages::new`]): every entry a sequence uses is a page of the pool
/// and every sequence's keys fit in its row, so the kernels that read through it check
/// nothing again (once per call, however many paths look at it).
///
/// ```
/// use fp8nsa_types::{Pages, Seq};
/// let seq = |k_len| Seq { q_start: 0, q_len: 1, k_start: 0, k_len, q_offset: k_len - 1 };
/// let seqs = [seq(20), seq(41)];
/// let table = [3, 0, -1, -1, 1, 2, 4, -1];
/// let p = Pages::new(&table, 4, 16, &seqs, 5 * 16)?; // a pool of 5 pages
/// assert_eq!(p.row(0, 17), 1); // page 0, token 1: pool row 0 * 16 + 1
/// assert_eq!(p.row(1, 40), 4 * 16 + 8);
/// // page 4 is past a pool of 4 pages; 41 keys need more than a row of 2 pages
/// assert!(Pages::new(&table, 4, 16, &seqs, 4 * 16).is_err());
/// assert!(Pages::new(&table[..4], 2, 16, &seqs, 5 * 16).is_err());
/// # Ok::<(), fp8nsa_types::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pages<'a> {
    table: &'a [i32],
    max_pages: usize,
    page_size: usize,
    /// The sequences (their key counts) and pool tokens the table was checked for.
    seqs: &'a [crate::Seq],
    pool_tokens: usize,
}

impl<'a> Pages<'a> {
    /// Checks a block table of `seqs.len()` rows of `max_pages` entries against the sequences'
    /// key counts (`k_len`) and a pool of `pool_tokens` tokens in pages of `page_size`: every
    /// entry a sequence reads (its first `ceil(k_len / page_size)`) must be a page of the
    /// pool, and its keys must fit in its row. Errors are `Error::Invalid` naming
    /// `block_table`, `seq_lens` or `page_size`, and the sequence and entry.
    pub fn new(
        table: &'a [i32],
        max_pages: usize,
        page_size: usize,
        seqs: &'a [crate::Seq],
        pool_tokens: usize,
    ) -> Result<Self> {
        use crate::Error::Invalid;
        check_positive("page_size", page_size)?;
        let overflow = || Invalid {
            arg: "block_table",
            msg: "its size overflows usize".into(),
        };
        let rows = seqs.len().checked_mul(max_pages).ok_or_else(overflow)?;
        if table.len() != rows {
            return Err(Invalid {
                arg: "block_table",
                msg: format!(
                    "{} entries for {} sequences of {max_pages} pages",
                    table.len(),
                    seqs.len()
                ),
            });
        }
        let covered = max_pages.checked_mul(page_size).ok_or_else(overflow)?;
        let pool_pages = pool_tokens / page_size;
        for (i, s) in seqs.iter().enumerate() {
            if s.k_len > covered {
                return Err(Invalid {
                    arg: "seq_lens",
                    msg: format!(
                        "sequence {i}: {} keys exceed its block table row ({max_pages} pages \
                         of {page_size})",
                        s.k_len
                    ),
                });
            }
            let row = &table[i * max_pages..][..s.k_len.div_ceil(page_size)];
            if let Some((e, &p)) = row
                .iter()
                .enumerate()
                .find(|&(_, &p)| p < 0 || p as usize >= pool_pages)
            {
                return Err(Invalid {
                    arg: "block_table",
                    msg: format!(
                        "sequence {i}, entry {e}: page {p} is not a page of the pool \
                         (0..{pool_pages})"
                    ),
                });
            }
        }
        Ok(Self {
            table,
            max_pages,
            page_size,
            seqs,
            pool_tokens,
        })
    }

    pub fn table(&self) -> &'a [i32] {
        self.table
    }

    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The sequences the table was checked for: each reads at most its `k_len` keys.
    pub fn seqs(&self) -> &'a [crate::Seq] {
        self.seqs
    }

    /// The pool size (tokens) the table was checked against.
    pub fn pool_tokens(&self) -> usize {
        self.pool_tokens
    }

    /// Keys a row holds at most, `max_pages · page_size` (no overflow: checked in `new`).
    pub fn row_capacity(&self) -> usize {
        self.max_pages * self.page_size
    }

    /// The pool row (token index within the pool) of sequence `seq`'s logical key `j`, for a
    /// key the sequence holds (checked when the table was made).
    #[inline]
    pub fn row(&self, seq: usize, j: usize) -> usize {
        let page = self.table[seq * self.max_pages + j / self.page_size] as usize;
        page * self.page_size + j % self.page_size
    }
}

/// The two pools of an NSA layer's paged state (a vocabulary type, so that errors about
/// pages can name one).
///
/// ```
/// use fp8nsa_types::NsaPool;
/// assert_eq!(NsaPool::BOTH.map(NsaPool::index), [0, 1]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NsaPool {
    /// Keys and values, one row per token.
    Raw,
    /// Compressed keys and values, one row per compressed block (one every
    /// `compress_stride` tokens).
    Compressed,
}

impl NsaPool {
    /// Both pools, in [`NsaPool::index`] order.
    pub const BOTH: [NsaPool; 2] = [NsaPool::Raw, NsaPool::Compressed];

    /// The pool's place in per-pool arrays: `Raw` 0, `Compressed` 1.
    pub fn index(self) -> usize {
        match self {
            NsaPool::Raw => 0,
            NsaPool::Compressed => 1,
        }
    }
}
