use candle_core::{DType, Device, Tensor};
use fp8nsa_types::Spans;

use crate::error::{invalid, shape_err, Error, Result};

/// Fixed-size key blocks per (batch, query, kv head): `indices [B, Tq, Hkv, S]` i32, block `i`
/// covering keys `[i * block_size, (i + 1) * block_size)`, `-1` padding, any order. Shared by
/// the G query heads of a kv head.
#[derive(Clone, Debug)]
pub struct BlockSelection {
    indices: Tensor,
    block_size: usize,
}

/// Arbitrary key ranges per (batch, query, kv head): `ranges [B, Tq, Hkv, R, 2]` i32,
/// half-open `[start, end)` at any alignment; `end <= start` is padding.
#[derive(Clone, Debug)]
pub struct SelectionRanges {
    ranges: Tensor,
}

/// Individual keys per (batch, query, kv head), as DeepSeek-V3.2's sparse attention (DSA)
/// selects them: `indices [B, Tq, Hkv, K]` i32 key positions, `-1` padding, any order. The
/// same rules as blocks of one key (causality, duplicates, out-of-range entries), and it runs
/// as exactly that on every backend, the reference and the fallback.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::nsa::{SelectionAttention, TokenSelection};
///
/// let dev = Device::Cpu;
/// let (q, k, v) = (
///     Tensor::ones((1, 1, 2, 8), candle_core::DType::F32, &dev)?,
///     Tensor::randn(0f32, 1.0, (1, 100, 1, 8), &dev)?,
///     Tensor::randn(0f32, 1.0, (1, 100, 1, 8), &dev)?,
/// );
/// // the decode query sees keys 3, 97 and 50 only
/// let sel = TokenSelection::new(Tensor::new(&[[[[3i32, 97, -1, 50]]]], &dev)?)?;
/// let (o, _lse) = SelectionAttention::new().forward(&q, &k, &v, &sel)?;
/// assert_eq!(o.dims(), &[1, 1, 2, 8]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct TokenSelection(BlockSelection);

impl TokenSelection {
    pub fn new(indices: Tensor) -> Result<Self> {
        Ok(Self(BlockSelection::new(indices, 1)?))
    }

    pub fn indices(&self) -> &Tensor {
        self.0.indices()
    }

    /// `[B, Tq, Hkv, K]`.
    pub fn dims(&self) -> [usize; 4] {
        self.0.dims()
    }

    /// Errors for an index below `-1`, one at or past `tk`, or a duplicate.
    pub fn validate(&self, tk: usize) -> Result<()> {
        self.0.validate(tk)
    }

    /// The same selection as blocks of one key.
    pub fn as_blocks(&self) -> &BlockSelection {
        &self.0
    }
}

impl<'a> From<&'a TokenSelection> for Selection<'a> {
    fn from(s: &'a TokenSelection) -> Self {
        Selection::Blocks(&s.0)
    }
}

/// Any kind of selection, as taken by [`super::SelectionAttention`] (a [`TokenSelection`] is
/// blocks of one key).
#[derive(Clone, Copy, Debug)]
pub enum Selection<'a> {
    Blocks(&'a BlockSelection),
    Ranges(&'a SelectionRanges),
}

impl<'a> From<&'a BlockSelection> for Selection<'a> {
    fn from(s: &'a BlockSelection) -> Self {
        Selection::Blocks(s)
    }
}

impl<'a> From<&'a SelectionRanges> for Selection<'a> {
    fn from(s: &'a SelectionRanges) -> Self {
        Selection::Ranges(s)
    }
}

fn check_i32(arg: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::I32 {
        return Err(Error::DType {
            arg,
            expected: "i32",
            got: t.dtype(),
        });
    }
    Ok(())
}

impl BlockSelection {
    pub fn new(indices: Tensor, block_size: usize) -> Result<Self> {
        check_i32("indices", &indices)?;
        if indices.rank() != 4 {
            return Err(shape_err("indices", "[B, Tq, Hkv, S]", indices.dims()));
        }
        if block_size == 0 || block_size > i32::MAX as usize {
            return Err(invalid(
                "block_size",
                format!("must be in 1..={}, got {block_size}", i32::MAX),
            ));
        }
        Ok(Self {
            indices,
            block_size,
        })
    }

    pub fn indices(&self) -> &Tensor {
        &self.indices
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// `[B, Tq, Hkv, S]`.
    pub fn dims(&self) -> [usize; 4] {
        let d = self.indices.dims();
        [d[0], d[1], d[2], d[3]]
    }

    /// Errors for an index below `-1`, a block that starts at or past `tk`, or a duplicate.
    pub fn validate(&self, tk: usize) -> Result<()> {
        let [_, tq, hkv, _] = self.dims();
        validate_host(
            &host_selection(Selection::Blocks(self))?,
            &|t| (t / tq.max(1), t % tq.max(1), tk),
            hkv,
        )
    }

    /// The same selection as ranges `[B, Tq, Hkv, S, 2]` (padding becomes `[0, 0)`).
    pub fn to_ranges(&self) -> Result<SelectionRanges> {
        let bs = self.block_size as i64;
        let v: Vec<i32> = self
            .indices
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<i32>()?
            .into_iter()
            .flat_map(|i| {
                if i < 0 {
                    [0, 0]
                } else {
                    let a = (i as i64 * bs).min(i32::MAX as i64);
                    [a as i32, (a + bs).min(i32::MAX as i64) as i32]
                }
            })
            .collect();
        let mut dims = self.indices.dims().to_vec();
        dims.push(2);
        SelectionRanges::new(Tensor::from_vec(v, dims, self.indices.device())?)
    }
}

impl SelectionRanges {
    pub fn new(ranges: Tensor) -> Result<Self> {
        check_i32("ranges", &ranges)?;
        if ranges.rank() != 5 || ranges.dims()[4] != 2 {
            return Err(shape_err("ranges", "[B, Tq, Hkv, R, 2]", ranges.dims()));
        }
        Ok(Self { ranges })
    }

    pub fn ranges(&self) -> &Tensor {
        &self.ranges
    }

    /// `[B, Tq, Hkv, R]`.
    pub fn dims(&self) -> [usize; 4] {
        let d = self.ranges.dims();
        [d[0], d[1], d[2], d[3]]
    }

    /// Errors for a non-empty range that does not start on a key (`start < 0` or
    /// `start >= tk`), or that overlaps another range of its row. An end past `tk` is clamped,
    /// as a partial last block is, so `BlockSelection::to_ranges` always validates.
    pub fn validate(&self, tk: usize) -> Result<()> {
        let [_, tq, hkv, _] = self.dims();
        validate_host(
            &host_selection(Selection::Ranges(self))?,
            &|t| (t / tq.max(1), t % tq.max(1), tk),
            hkv,
        )
    }
}

impl Selection<'_> {
    /// `[B, Tq, Hkv, S or R]`.
    pub fn dims(&self) -> [usize; 4] {
        match self {
            Selection::Blocks(s) => s.dims(),
            Selection::Ranges(s) => s.dims(),
        }
    }

    pub fn device(&self) -> &Device {
        match self {
            Selection::Blocks(s) => s.indices.device(),
            Selection::Ranges(s) => s.ranges.device(),
        }
    }
}

/// A selection copied to the host: the entries of every row, row = `token * hkv + head`.
pub(crate) type HostSelection = Spans<Vec<i32>>;

/// The selection's entries on the host, whatever device they live on.
pub(crate) fn host_selection(sel: Selection<'_>) -> Result<HostSelection> {
    let host = |t: &Tensor| -> Result<Vec<i32>> {
        Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<i32>()?)
    };
    Ok(match sel {
        Selection::Blocks(s) => Spans::Blocks {
            indices: host(&s.indices)?,
            per_row: s.dims()[3],
            block_size: s.block_size,
        },
        Selection::Ranges(s) => Spans::Ranges {
            ranges: host(&s.ranges)?,
            per_row: s.dims()[3],
        },
    })
}

/// Checks every row against the contract (docs/nsa.md, "Selection validity");
/// `locate(token)` gives the row's `(batch, token in its sequence, keys of its sequence)`, so
/// the error names where the bad entry is.
pub(crate) fn validate_host(
    sel: &HostSelection,
    locate: &dyn Fn(usize) -> (usize, usize, usize),
    hkv: usize,
) -> Result<()> {
    if sel.per_row() == 0 || hkv == 0 {
        return Ok(());
    }
    for row in 0..sel.rows() {
        let (batch, token, tk) = locate(row / hkv);
        sel.check_row(row, tk).map_err(|issue| Error::Selection {
            batch,
            token,
            head: row % hkv,
            entry: issue.entry,
            msg: issue.msg,
        })?;
    }
    Ok(())
}
