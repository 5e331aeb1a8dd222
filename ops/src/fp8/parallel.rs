//! Tensor parallelism on block boundaries: a rank's slice of an fp8 weight and its scales, the
//! column- and row-parallel layers over it, and the communicator that does the reduction.
//!
//! A split of N (column-parallel) or K (row-parallel) must not cut a scale block, or the
//! per-block scales no longer line up. The blocks of the split dimension are dealt out as
//! evenly as they go: with `nb` blocks over `world` ranks, the first `nb % world` ranks get one
//! block more. So any world size up to `nb` works, including ones that do not divide N or K.
//! N = 576 in blocks of 128 is 5 blocks (the last of 64): 4 ranks get 256, 128, 128 and 64
//! rows; 6 ranks would cut a block and are refused, with the sizes that work.

use std::ops::Range;
use std::sync::{Arc, Barrier, Mutex};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::{ActQuant, Fp8BlockWeight, Fp8Linear};
use crate::error::{invalid, Error, Result};

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
fn check_on_blocks(
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

impl Fp8BlockWeight {
    /// This rank's slice of `{prefix}.weight` (F8_E4M3 or U8 codes) and the matching rows or
    /// columns of `{prefix}.weight_scale_inv`, read from safetensors without touching the
    /// other ranks' bytes (the file is memory-mapped; only this slice is copied). The result is
    /// an ordinary weight `[N_r, K]` (column split) or `[N, K_r]` (row split) on `device`.
    pub fn load_shard(
        st: &MmapedSafetensors,
        prefix: &str,
        block: [usize; 2],
        split: Split,
        shard: Shard,
        device: &Device,
    ) -> Result<Self> {
        Self::load_slice(st, prefix, block, split, Slice::Shard(shard), device)
    }

    /// Rows (`Split::Column`) or columns (`Split::Row`) `range` of `{prefix}.weight` and the
    /// matching scales, as [`Self::load_shard`] reads them: for splits that are not an even
    /// deal of blocks, such as a rank's attention heads ([`Shard::heads`]). The range must
    /// fall on blocks.
    pub fn load_range(
        st: &MmapedSafetensors,
        prefix: &str,
        block: [usize; 2],
        split: Split,
        range: Range<usize>,
        device: &Device,
    ) -> Result<Self> {
        Self::load_slice(st, prefix, block, split, Slice::Range(range), device)
    }

    fn load_slice(
        st: &MmapedSafetensors,
        prefix: &str,
        block: [usize; 2],
        split: Split,
        slice: Slice,
        device: &Device,
    ) -> Result<Self> {
        use safetensors::Dtype;
        let name = format!("{prefix}.weight");
        let view = st.get(&name)?;
        if !matches!(view.dtype(), Dtype::F8_E4M3 | Dtype::U8) {
            return Err(invalid(
                "weight",
                format!(
                    "{name} is stored as {:?}; fp8 weights are F8_E4M3 (or U8 codes)",
                    view.dtype()
                ),
            ));
        }
        let (n, k) = match *view.shape() {
            [n, k] => (n, k),
            _ => {
                return Err(invalid(
                    "weight",
                    format!("{name} is not 2-D: {:?}", view.shape()),
                ))
            }
        };
        let bytes = view.data();
        if block[0] == 0 || block[1] == 0 {
            return Err(invalid("block", format!("{block:?} has a zero side")));
        }
        let (rows, cols) = match split {
            Split::Column => (slice.resolve(n, block[0])?, 0..k),
            Split::Row => (0..n, slice.resolve(k, block[1])?),
        };
        let mut codes = Vec::with_capacity(rows.len() * cols.len());
        for r in rows.clone() {
            codes.extend_from_slice(&bytes[r * k + cols.start..r * k + cols.end]);
        }
        let scale_name = format!("{prefix}.weight_scale_inv");
        let scales = st.load(&scale_name, &Device::Cpu)?;
        if !scales.dtype().is_float() || scales.dtype() == DType::F8E4M3 {
            return Err(invalid(
                "scales",
                format!("{scale_name} is stored as {:?}", scales.dtype()),
            ));
        }
        let scales = scales.to_dtype(DType::F32)?;
        let expected = [n.div_ceil(block[0]), k.div_ceil(block[1])];
        if scales.dims() != expected {
            return Err(crate::error::shape_err(
                "scales",
                format!("{expected:?} for {name} {:?} in blocks {block:?}", [n, k]),
                scales.dims(),
            ));
        }
        let scales = match split {
            Split::Column => {
                scales.narrow(0, rows.start / block[0], rows.len().div_ceil(block[0]))?
            }
            Split::Row => scales.narrow(1, cols.start / block[1], cols.len().div_ceil(block[1]))?,
        };
        let data = Tensor::from_vec(codes, (rows.len(), cols.len()), device)?;
        Self::from_parts(data, scales.contiguous()?.to_device(device)?, block)
    }

    /// This rank's slice of a weight already in memory (the same blocks as
    /// [`Self::load_shard`] would read).
    pub fn shard(&self, split: Split, shard: Shard) -> Result<Self> {
        let [n, k] = self.shape();
        let block = self.block();
        let range = match split {
            Split::Column => shard.range(n, block[0])?,
            Split::Row => shard.range(k, block[1])?,
        };
        self.slice(split, range)
    }

    /// Rows (`Split::Column`) or columns (`Split::Row`) `range` of a weight in memory, with
    /// the matching scales; the range must fall on blocks.
    pub fn slice(&self, split: Split, range: Range<usize>) -> Result<Self> {
        let [n, k] = self.shape();
        let block = self.block();
        let (dim, len, b) = match split {
            Split::Column => (0, n, block[0]),
            Split::Row => (1, k, block[1]),
        };
        check_on_blocks("range", &range, len, b)?;
        let data = self.data().narrow(dim, range.start, range.len())?;
        let scales = self
            .scales()
            .narrow(dim, range.start / b, range.len().div_ceil(b))?;
        Self::from_parts(data.contiguous()?, scales.contiguous()?, block)
    }
}

/// What part of the split dimension a load takes.
enum Slice {
    Shard(Shard),
    Range(Range<usize>),
}

impl Slice {
    fn resolve(self, len: usize, block: usize) -> Result<Range<usize>> {
        match self {
            Slice::Shard(s) => s.range(len, block),
            Slice::Range(r) => {
                check_on_blocks("range", &r, len, block)?;
                Ok(r)
            }
        }
    }
}

/// The collective operations a tensor-parallel layer needs. An implementation is one rank's
/// handle on a group: every rank calls each operation, in the same order.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// The elementwise sum over the ranks of `t` (same shape everywhere), on every rank.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The ranks' tensors concatenated along `dim`, in rank order, on every rank. The ranks'
    /// tensors may differ in size along `dim` (a column split that is not even), nowhere else.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;
}

/// Ranks as threads of one process, for CPU tensors (and tests): [`HostGroup::new`] returns
/// one handle per rank. Sums are taken in rank order, so every rank gets the same bits. As
/// with any collective, every rank must make each call: a rank that stops early leaves the
/// others waiting.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::fp8::{Communicator, HostGroup};
///
/// let handles = HostGroup::new(3);
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let jobs: Vec<_> = handles.iter().map(|c| s.spawn(move || {
///         let t = Tensor::new(&[c.rank() as f32, 1.0], &Device::Cpu).unwrap();
///         c.all_reduce_sum(&t).unwrap().to_vec1::<f32>().unwrap()
///     })).collect();
///     jobs.into_iter().map(|j| j.join().unwrap()).collect()
/// });
/// assert!(sums.iter().all(|s| s == &[3.0, 3.0]));
/// ```
pub struct HostGroup {
    rank: usize,
    shared: Arc<HostShared>,
}

struct HostShared {
    world: usize,
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

impl HostGroup {
    /// Handles for ranks `0..world_size` (each to be moved to its own thread).
    pub fn new(world_size: usize) -> Vec<HostGroup> {
        let shared = Arc::new(HostShared {
            world: world_size,
            slots: Mutex::new(vec![None; world_size]),
            barrier: Barrier::new(world_size),
        });
        (0..world_size)
            .map(|rank| HostGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Every rank's tensor, in rank order: deposit, wait for all, copy out, wait again so the
    /// slots can be reused by the next operation.
    fn exchange(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        if !t.device().is_cpu() {
            return Err(invalid("t", "HostGroup exchanges CPU tensors"));
        }
        let lock = || {
            self.shared
                .slots
                .lock()
                .map_err(|_| invalid("communicator", "another rank panicked"))
        };
        lock()?[self.rank] = Some(t.clone());
        self.shared.barrier.wait();
        let all: Option<Vec<Tensor>> = lock()?.iter().cloned().collect();
        self.shared.barrier.wait();
        all.ok_or_else(|| invalid("communicator", "a rank did not contribute"))
    }
}

impl Communicator for HostGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let all = self.exchange(t)?;
        let mut sum = all[0].clone();
        for (r, x) in all.iter().enumerate().skip(1) {
            if x.dims() != sum.dims() {
                return Err(Error::Shape {
                    arg: "t",
                    expected: format!("{:?} (rank 0's) on rank {r}", sum.dims()),
                    got: x.dims().to_vec(),
                });
            }
            sum = (sum + x)?;
        }
        Ok(sum)
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let all = self.exchange(t)?;
        check_gather(
            &all.iter().map(|x| x.dims().to_vec()).collect::<Vec<_>>(),
            dim,
        )?;
        Ok(Tensor::cat(&all, dim)?)
    }
}

/// Every communicator's rule for an all-gather: the ranks' shapes (in rank order) agree
/// except along `dim`. Every rank sees the same shapes, so all refuse together.
pub(crate) fn check_gather(shapes: &[Vec<usize>], dim: usize) -> Result<()> {
    let first = &shapes[0];
    if dim >= first.len() {
        return Err(invalid(
            "dim",
            format!("{dim} is past the rank of {first:?}"),
        ));
    }
    for (r, s) in shapes.iter().enumerate() {
        let same_elsewhere = s.len() == first.len()
            && s.iter()
                .zip(first)
                .enumerate()
                .all(|(d, (a, b))| d == dim || a == b);
        if !same_elsewhere {
            return Err(Error::Shape {
                arg: "t",
                expected: format!("{first:?} (rank 0's) except along dim {dim}, on rank {r}"),
                got: s.clone(),
            });
        }
    }
    Ok(())
}

/// A column-parallel fp8 linear: this rank's rows of the weight (and of the bias), so
/// `forward` gives this rank's slice of the outputs `[.., N_r]`; an all-gather along the last
/// dim (or a row-parallel layer next, as in an MLP) completes them.
#[derive(Clone, Debug)]
pub struct ColumnParallel {
    pub linear: Fp8Linear,
    /// The output features `[start, end)` this rank computes.
    pub outputs: Range<usize>,
}

impl ColumnParallel {
    /// From the full weight and bias, keeping this rank's slice.
    pub fn new(
        weight: &Fp8BlockWeight,
        bias: Option<&Tensor>,
        act: ActQuant,
        shard: Shard,
    ) -> Result<Self> {
        let outputs = shard.range(weight.shape()[0], weight.block()[0])?;
        Self::with_outputs(weight, bias, act, outputs)
    }

    /// From the full weight and bias, keeping the output features `outputs` (on blocks), such
    /// as a rank's attention heads ([`HeadShard::q_rows`]).
    pub fn with_outputs(
        weight: &Fp8BlockWeight,
        bias: Option<&Tensor>,
        act: ActQuant,
        outputs: Range<usize>,
    ) -> Result<Self> {
        let linear = weight.slice(Split::Column, outputs.clone())?;
        let n = weight.shape()[0];
        let bias = match bias {
            Some(b) if b.dims() != [n] => {
                return Err(crate::error::shape_err("bias", format!("[{n}]"), b.dims()))
            }
            b => b
                .map(|b| b.narrow(0, outputs.start, outputs.len()))
                .transpose()?,
        };
        let linear = Fp8Linear::new(linear, bias, act)?;
        Ok(Self { linear, outputs })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward_t(x)
    }
}

/// A row-parallel fp8 linear: this rank's columns of the weight; `forward` takes this rank's
/// slice of the inputs `[.., K_r]` and returns its partial sum `[.., N]` (the bias on rank 0
/// only), which an all-reduce completes.
#[derive(Clone, Debug)]
pub struct RowParallel {
    pub linear: Fp8Linear,
    /// The input features `[start, end)` this rank takes.
    pub inputs: Range<usize>,
}

impl RowParallel {
    pub fn new(
        weight: &Fp8BlockWeight,
        bias: Option<&Tensor>,
        act: ActQuant,
        shard: Shard,
    ) -> Result<Self> {
        let inputs = shard.range(weight.shape()[1], weight.block()[1])?;
        Self::with_inputs(weight, bias.filter(|_| shard.rank == 0), act, inputs)
    }

    /// From the full weight, keeping the input features `inputs` (on blocks), such as the
    /// outputs of a rank's attention heads. `bias` is added by this rank's partial sum: pass
    /// it on one rank only.
    pub fn with_inputs(
        weight: &Fp8BlockWeight,
        bias: Option<&Tensor>,
        act: ActQuant,
        inputs: Range<usize>,
    ) -> Result<Self> {
        let linear = Fp8Linear::new(
            weight.slice(Split::Row, inputs.clone())?,
            bias.cloned(),
            act,
        )?;
        Ok(Self { linear, inputs })
    }

    /// The partial sum for this rank's input slice `x_r [.., K_r]`.
    pub fn forward_partial(&self, x_r: &Tensor) -> Result<Tensor> {
        self.linear.forward_t(x_r)
    }

    /// The full output: the partial sum reduced over the group.
    pub fn forward(&self, x_r: &Tensor, comm: &dyn Communicator) -> Result<Tensor> {
        comm.all_reduce_sum(&self.forward_partial(x_r)?)
    }
}

/// Expert parallelism for a mixture-of-experts block: this rank holds the experts
/// `experts` (all three projections, whole) and the full router. Every rank routes every
/// token the same way; [`Self::forward_partial`] computes the weighted outputs of the tokens'
/// picks that fall on this rank's experts, and the all-reduce of [`Self::forward`] sums the
/// ranks' parts into the [`Fp8Moe`](super::Fp8Moe) output. A server loads only its experts'
/// weights ([`Shard::experts`] says which).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::fp8::{ExpertParallel, Shard};
/// use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Experts, MoeRouter};
///
/// let (e, h, i, dev) = (4, 8, 16, Device::Cpu);
/// let shard = Shard { rank: 1, world_size: 2 };
/// let mine = shard.experts(e)?; // 2..4
/// let stack = |n: usize, k: usize| -> Result<Fp8Experts, fp8nsa_ops::Error> {
///     let ws: Vec<Fp8BlockWeight> = mine
///         .clone()
///         .map(|_| Fp8BlockWeight::quantize(&Tensor::randn(0f32, 0.1, (n, k), &dev)?, [128, 128]))
///         .collect::<Result<_, _>>()?;
///     Fp8Experts::new(&ws, ActQuant::Group)
/// };
/// let router = MoeRouter::new(Tensor::randn(0f32, 1.0, (e, h), &dev)?, 2, true)?;
/// let ep = ExpertParallel::new(router, stack(i, h)?, stack(i, h)?, stack(h, i)?, mine)?;
/// let x = Tensor::randn(0f32, 1.0, (3, h), &dev)?;
/// assert_eq!(ep.forward_partial(&x)?.dims(), &[3, h]); // this rank's part of the sum
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct ExpertParallel {
    router: super::MoeRouter,
    gate: super::Fp8Experts,
    up: super::Fp8Experts,
    down: super::Fp8Experts,
    experts: Range<usize>,
}

impl ExpertParallel {
    /// `router` over all `E` experts; `gate` and `up` `[E_r, I, H]`, `down` `[E_r, H, I]` for
    /// the experts `experts` (`E_r` of them) of this rank.
    pub fn new(
        router: super::MoeRouter,
        gate: super::Fp8Experts,
        up: super::Fp8Experts,
        down: super::Fp8Experts,
        experts: Range<usize>,
    ) -> Result<Self> {
        let e = router.num_experts();
        if experts.is_empty() || experts.end > e {
            return Err(invalid(
                "experts",
                format!("{experts:?} is not a non-empty range of the router's {e} experts"),
            ));
        }
        let [er, i, h] = gate.shape();
        if er != experts.len() {
            return Err(crate::error::shape_err(
                "gate",
                format!("[{}, I, H] (one per expert of {experts:?})", experts.len()),
                &gate.shape(),
            ));
        }
        if up.shape() != [er, i, h] {
            return Err(crate::error::shape_err(
                "up",
                format!("[{er}, {i}, {h}]"),
                &up.shape(),
            ));
        }
        if down.shape() != [er, h, i] {
            return Err(crate::error::shape_err(
                "down",
                format!("[{er}, {h}, {i}]"),
                &down.shape(),
            ));
        }
        // checked here, not left to `route`: a rank that refused a call after its peers had
        // entered the all-reduce would leave them waiting
        if router.hidden() != h {
            return Err(crate::error::shape_err(
                "router",
                format!("[{e}, {h}] (the experts' hidden size)"),
                &[e, router.hidden()],
            ));
        }
        Ok(Self {
            router,
            gate,
            up,
            down,
            experts,
        })
    }

    /// The experts this rank holds.
    pub fn experts(&self) -> Range<usize> {
        self.experts.clone()
    }

    /// `[.., H]` f32: the part of the block's output for `x [.., H]` that this rank's experts
    /// contribute (zeros where no token picked one of them).
    pub fn forward_partial(&self, x: &Tensor) -> Result<Tensor> {
        let (x2, r) = self.router.group(x)?;
        let h = x2.dims()[1];
        // rows are grouped by expert, so this rank's are one contiguous run of them
        let skip: usize = r.counts[..self.experts.start].iter().sum();
        let counts = r.counts[self.experts.clone()].to_vec();
        let take: usize = counts.iter().sum();
        let out_dims = [&x.dims()[..x.rank() - 1], &[h]].concat();
        if take == 0 {
            return Ok(Tensor::zeros(out_dims, DType::F32, x.device())?);
        }
        let local = super::Routing {
            counts,
            rows: r.rows.narrow(0, skip, take)?,
            weights: r.weights[skip..skip + take].to_vec(),
            tokens: r.tokens,
        };
        let xp = x2.index_select(&local.rows, 0)?;
        let g = self.gate.forward_contiguous(&xp, &local.counts)?;
        let u = self.up.forward_contiguous(&xp, &local.counts)?;
        let a = (g.silu()? * u)?;
        let d = self.down.forward_contiguous(&a, &local.counts)?;
        Ok(local.combine(&d)?.reshape(out_dims)?)
    }

    /// The block's output `[.., H]` in x's dtype: the partial parts reduced (in f32) over
    /// the group.
    pub fn forward(&self, x: &Tensor, comm: &dyn Communicator) -> Result<Tensor> {
        Ok(comm
            .all_reduce_sum(&self.forward_partial(x)?)?
            .to_dtype(x.dtype())?)
    }
}
