//! Tensor- and expert-parallel layers: a rank's slice of an fp8 linear (column- or
//! row-parallel) or its experts, and the collective that completes the layer's output. What a
//! rank holds is decided in `shard`, loading a rank's slice in `weight`, the collectives in
//! `comm`.

use std::ops::Range;

use candle_core::{DType, Tensor};

use super::comm::{agreed, Communicator};
use super::shard::{Shard, Split};
use super::{ActQuant, Fp8BlockWeight, Fp8Linear};
use crate::error::{invalid, Result};

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
    /// A rank whose input is refused returns that error and every other rank an error
    /// naming the group: the ranks agree before reducing (no rank is left waiting).
    pub fn forward(&self, x_r: &Tensor, comm: &dyn Communicator) -> Result<Tensor> {
        agreed(comm, self.forward_partial(x_r), |p| comm.all_reduce_sum(&p))
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
        let a = crate::silu_mul(&g, &u)?;
        let d = self.down.forward_contiguous(&a, &local.counts)?;
        Ok(local.combine(&d)?.reshape(out_dims)?)
    }

    /// The block's output `[.., H]` in x's dtype: the partial parts reduced (in f32) over
    /// the group.
    /// As [`RowParallel::forward`], the ranks agree before reducing.
    pub fn forward(&self, x: &Tensor, comm: &dyn Communicator) -> Result<Tensor> {
        let sum = agreed(comm, self.forward_partial(x), |p| comm.all_reduce_sum(&p))?;
        Ok(sum.to_dtype(x.dtype())?)
    }
}
