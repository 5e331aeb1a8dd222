//! What a rank of a tensor- or expert-parallel group holds: the even deal of a dimension's
//! scale blocks over the ranks ([`Shard::range`]), whole key / value heads ([`Shard::heads`])
//! and experts ([`Shard::experts`]).
//!
//! A split of N (column-parallel) or K (row-parallel) must not cut a scale block, or the
//! per-block scales no longer line up. The blocks of the split dimension are dealt out as
//! evenly as they go: with `nb` blocks over `world` ranks, the first `nb % world` ranks get one
//! block more. So any world size up to `nb` works, including ones that do not divide N or K.
//! N = 576 in blocks of 128 is 5 blocks (the last of 64): 4 ranks get 256, 128, 128 and 64
//! rows; 6 ranks would cut a block and are refused, with the sizes that work.

use std::ops::Range;

use crate::error::{invalid, Result};

/// Which dimension of a `[N, K]` weight a rank holds a slice of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Output features (rows, N): each rank computes its slice of the outputs.
    Column,
    /// Input features (columns, K): each rank computes a partial sum of all outputs.
    Row,
}

/// This process's place in a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world_size: usize,
}

impl Shard {
    /// The elements `[start, end)` of a dimension of `len` elements in blocks of `block` that
    /// this rank holds (whole blocks only, dealt out as evenly as they go).
    ///
    /// ```
    /// use fp8nsa_ops::fp8::Shard;
    /// let r = |rank| Shard { rank, world_size: 4 }.range(576, 128).unwrap();
    /// assert_eq!([r(0), r(1), r(2), r(3)], [0..256, 256..384, 384..512, 512..576]);
    /// let e = Shard { rank: 0, world_size: 6 }.range(576, 128).unwrap_err();
    /// assert!(e.to_string().contains("world sizes 1..=5"));
    /// ```
    pub fn range(&self, len: usize, block: usize) -> Result<Range<usize>> {
        let Shard { rank, world_size } = *self;
        if world_size == 0 || rank >= world_size {
            return Err(invalid(
                "shard",
                format!("rank {rank} of world size {world_size}: need rank < world size"),
            ));
        }
        if block == 0 || len == 0 {
            return Err(invalid(
                "shard",
                "an empty dimension or block cannot be split",
            ));
        }
        let blocks = len.div_ceil(block);
        if world_size > blocks {
            return Err(invalid(
                "shard",
                format!(
                    "{len} elements are {blocks} blocks of {block}; splitting them over \
                     {world_size} ranks would cut a block: world sizes 1..={blocks} work"
                ),
            ));
        }
        let (base, extra) = (blocks / world_size, blocks % world_size);
        let first = rank * base + rank.min(extra);
        let count = base + usize::from(rank < extra);
        Ok(first * block..((first + count) * block).min(len))
    }

    /// The experts `[start, end)` this rank holds for expert parallelism (dealt out as evenly
    /// as they go; any world size up to the number of experts).
    ///
    /// ```
    /// use fp8nsa_ops::fp8::Shard;
    /// assert_eq!(Shard { rank: 1, world_size: 3 }.experts(8).unwrap(), 3..6);
    /// assert!(Shard { rank: 0, world_size: 9 }.experts(8).is_err());
    /// ```
    pub fn experts(&self, num_experts: usize) -> Result<Range<usize>> {
        if self.world_size > num_experts && num_experts > 0 {
            return Err(invalid(
                "shard",
                format!(
                    "{num_experts} experts over {} ranks would leave a rank without one: \
                     world sizes 1..={num_experts} work",
                    self.world_size
                ),
            ));
        }
        self.range(num_experts, 1)
    }

    /// The attention heads this rank holds for tensor-parallel attention, as Megatron and
    /// vLLM shard it: whole key/value heads with the query heads that read them, so each rank
    /// attends on its own. The world size must divide the number of key/value heads, and every
    /// rank's rows of the q and k/v projections (`heads x head_dim`) must start on a block of
    /// `block_n` rows, or the per-block scales would be cut; the error lists the world sizes
    /// that work.
    ///
    /// ```
    /// use fp8nsa_ops::fp8::Shard;
    /// // 16 query heads, 4 key/value heads of 128, weight blocks of 128 rows
    /// let h = Shard { rank: 1, world_size: 2 }.heads(16, 4, 128, 128).unwrap();
    /// assert_eq!((h.q_heads.clone(), h.kv_heads.clone()), (8..16, 2..4));
    /// assert_eq!((h.q_rows(128), h.kv_rows(128)), (1024..2048, 256..512));
    /// let e = Shard { rank: 0, world_size: 3 }.heads(16, 4, 128, 128).unwrap_err();
    /// assert!(e.to_string().contains("world sizes [1, 2, 4]"));
    /// ```
    pub fn heads(
        &self,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_n: usize,
    ) -> Result<HeadShard> {
        let Shard { rank, world_size } = *self;
        if world_size == 0 || rank >= world_size {
            return Err(invalid(
                "shard",
                format!("rank {rank} of world size {world_size}: need rank < world size"),
            ));
        }
        if num_kv_heads == 0
            || head_dim == 0
            || block_n == 0
            || !num_heads.is_multiple_of(num_kv_heads)
        {
            return Err(invalid(
                "heads",
                format!(
                    "{num_heads} query heads over {num_kv_heads} key/value heads of \
                     {head_dim} in blocks of {block_n}: need whole query groups and non-zero sizes"
                ),
            ));
        }
        let works = |w: usize| {
            num_kv_heads.is_multiple_of(w)
                && (w == 1
                    || (((num_kv_heads / w) * head_dim).is_multiple_of(block_n)
                        && ((num_heads / w) * head_dim).is_multiple_of(block_n)))
        };
        if !works(world_size) {
            let ok: Vec<usize> = (1..=num_kv_heads).filter(|&w| works(w)).collect();
            return Err(invalid(
                "shard",
                format!(
                    "{num_heads} query / {num_kv_heads} key-value heads of {head_dim} in weight \
                     blocks of {block_n} rows cannot be split over {world_size} ranks on whole \
                     heads and blocks: world sizes {ok:?} work"
                ),
            ));
        }
        let (kv, q) = (num_kv_heads / world_size, num_heads / world_size);
        Ok(HeadShard {
            q_heads: rank * q..(rank + 1) * q,
            kv_heads: rank * kv..(rank + 1) * kv,
        })
    }
}

/// One rank's attention heads (from [`Shard::heads`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadShard {
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
}

impl HeadShard {
    /// The rows of the q projection (the columns of the output projection) of these heads.
    pub fn q_rows(&self, head_dim: usize) -> Range<usize> {
        self.q_heads.start * head_dim..self.q_heads.end * head_dim
    }

    /// The rows of the k and v projections of these heads.
    pub fn kv_rows(&self, head_dim: usize) -> Range<usize> {
        self.kv_heads.start * head_dim..self.kv_heads.end * head_dim
    }
}

/// `range` of a dimension of `len` elements in blocks of `block` must start on a block and end
/// on one or at `len`, or the slice's scales would not line up.
pub(crate) fn check_on_blocks(
    what: &'static str,
    range: &Range<usize>,
    len: usize,
    block: usize,
) -> Result<()> {
    let on = |i: usize| i.is_multiple_of(block) || i == len;
    if range.start >= range.end || range.end > len || !on(range.start) || !on(range.end) {
        return Err(invalid(
            what,
            format!(
                "{range:?} of {len} must be non-empty and fall on blocks of {block} (or end at {len})"
            ),
        ));
    }
    Ok(())
}
