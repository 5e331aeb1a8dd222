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
        let (rows, cols) = match split {
            Split::Column => (shard.range(n, block[0])?, 0..k),
            Split::Row => (0..n, shard.range(k, block[1])?),
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
        let (data, scales) = match split {
            Split::Column => {
                let r = shard.range(n, block[0])?;
                (
                    self.data().narrow(0, r.start, r.len())?,
                    self.scales()
                        .narrow(0, r.start / block[0], r.len().div_ceil(block[0]))?,
                )
            }
            Split::Row => {
                let c = shard.range(k, block[1])?;
                (
                    self.data().narrow(1, c.start, c.len())?,
                    self.scales()
                        .narrow(1, c.start / block[1], c.len().div_ceil(block[1]))?,
                )
            }
        };
        Self::from_parts(data.contiguous()?, scales.contiguous()?, block)
    }
}

/// The collective operations a tensor-parallel layer needs. An implementation is one rank's
/// handle on a group: every rank calls each operation, in the same order.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// The elementwise sum over the ranks of `t` (same shape everywhere), on every rank.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The ranks' tensors concatenated along `dim`, in rank order, on every rank.
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
        Ok(Tensor::cat(&self.exchange(t)?, dim)?)
    }
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
        let bias = bias
            .map(|b| b.narrow(0, outputs.start, outputs.len()))
            .transpose()?;
        let linear = Fp8Linear::new(weight.shard(Split::Column, shard)?, bias, act)?;
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
        let bias = if shard.rank == 0 { bias.cloned() } else { None };
        let linear = Fp8Linear::new(weight.shard(Split::Row, shard)?, bias, act)?;
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
