use crate::error::{check_positive, Result};

/// An fp8 linear problem: `x [m, k]`, `W [n, k]` in `bn x bk` blocks (edge blocks partial),
/// `y [m, n]`.
///
/// ```
/// use fp8nsa_types::LinearShape;
/// let s = LinearShape { m: 1, n: 576, k: 3884, bn: 128, bk: 128 };
/// assert_eq!((s.n_blocks(), s.k_blocks()), (5, 31));
/// assert!(LinearShape { bk: 0, ..s }.validate().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinearShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub bn: usize,
    pub bk: usize,
}

impl LinearShape {
    /// Rows of the weight-scale matrix, `ceil(n / bn)`.
    pub fn n_blocks(&self) -> usize {
        self.n.div_ceil(self.bn.max(1))
    }

    /// Columns of the weight-scale matrix (and activation K-groups), `ceil(k / bk)`.
    pub fn k_blocks(&self) -> usize {
        self.k.div_ceil(self.bk.max(1))
    }

    /// Every field must be at least 1.
    pub fn validate(&self) -> Result<()> {
        for (arg, v) in [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("bn", self.bn),
            ("bk", self.bk),
        ] {
            check_positive(arg, v)?;
        }
        Ok(())
    }
}

/// Attention head counts and head dims: `hq = G * hkv` query heads of dim `d`, keys of dim
/// `d`, values of dim `dv`.
///
/// ```
/// use fp8nsa_types::AttnDims;
/// let dims = AttnDims { hq: 16, hkv: 1, d: 128, dv: 128 };
/// assert_eq!(dims.group(), 16);
/// assert!(dims.validate().is_ok());
/// assert!(AttnDims { hq: 3, hkv: 2, ..dims }.validate().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnDims {
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub dv: usize,
}

impl AttnDims {
    /// Query heads per kv head, `G = hq / hkv`.
    pub fn group(&self) -> usize {
        self.hq / self.hkv.max(1)
    }

    /// Every field at least 1 and `hq` a multiple of `hkv`.
    pub fn validate(&self) -> Result<()> {
        for (arg, v) in [
            ("hq", self.hq),
            ("hkv", self.hkv),
            ("d", self.d),
            ("dv", self.dv),
        ] {
            check_positive(arg, v)?;
        }
        if !self.hq.is_multiple_of(self.hkv) {
            return Err(crate::Error::Invalid {
                arg: "hq",
                msg: format!("must be a multiple of hkv = {}, got {}", self.hkv, self.hq),
            });
        }
        Ok(())
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
/// ```
/// use fp8nsa_types::Pages;
/// let p = Pages { table: &[3, 0, -1, -1, 1, 2, 4, -1], max_pages: 4, page_size: 16 };
/// assert_eq!(p.row(0, 17), 1); // page 0, token 1: pool row 0 * 16 + 1
/// assert_eq!(p.row(1, 40), 4 * 16 + 8);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pages<'a> {
    pub table: &'a [i32],
    pub max_pages: usize,
    pub page_size: usize,
}

impl Pages<'_> {
    /// The pool row (token index within the pool) of sequence `seq`'s logical key `j`, for an
    /// entry already checked to be a page of the pool.
    #[inline]
    pub fn row(&self, seq: usize, j: usize) -> usize {
        let page = self.table[seq * self.max_pages + j / self.page_size] as usize;
        page * self.page_size + j % self.page_size
    }
}
