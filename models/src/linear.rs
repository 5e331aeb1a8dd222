use candle_core::{Module, Tensor};
use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Linear};

use crate::error::Result;
use crate::weights::Weights;

/// What a projection becomes when the model is built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinearKind {
    /// `candle_nn::Linear` on the weight as stored; a weight stored in fp8 stays fp8 and runs
    /// W8A16 (activations not quantized), so nothing is rounded that the checkpoint did not
    /// round.
    #[default]
    Dense,
    /// `Fp8Linear`: dense weights are quantized on load in `block`s; fp8 checkpoints keep
    /// theirs.
    Fp8 { block: [usize; 2], act: ActQuant },
}

/// A projection of the model.
#[derive(Clone, Debug)]
pub enum Linear {
    Dense(candle_nn::Linear),
    Fp8(Fp8Linear),
}

impl Linear {
    /// Builds `{name}.weight` (and `{name}.bias` when present) as `kind`. A stored fp8 weight
    /// (with `{name}.weight_scale_inv`) is loaded as fp8 with its block size, its activations
    /// quantized as `kind` says (`Dense`: not at all).
    pub fn build(w: &Weights, name: &str, kind: LinearKind, keep_dense: bool) -> Result<Self> {
        let bias = w.get_opt(&format!("{name}.bias"))?;
        if let Some((data, scales, block)) = w.fp8(name)? {
            let weight = Fp8BlockWeight::from_parts(data, scales, block)?;
            let act = match kind {
                LinearKind::Fp8 { act, .. } => act,
                LinearKind::Dense => ActQuant::None,
            };
            return Ok(Linear::Fp8(Fp8Linear::new(weight, bias, act)?));
        }
        let weight = w.get(&format!("{name}.weight"))?;
        match kind {
            LinearKind::Fp8 { block, act } if !keep_dense => {
                let q = Fp8BlockWeight::quantize(&weight, block)?;
                Ok(Linear::Fp8(Fp8Linear::new(q, bias, act)?))
            }
            _ => {
                // every decode step streams a dense weight once: on huge pages where the
                // kernel allows (fp8 weights do this when they are made)
                fp8nsa_ops::advise_huge_pages(&weight);
                Ok(Linear::Dense(candle_nn::Linear::new(weight, bias)))
            }
        }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Linear::Dense(l) => fp8nsa_ops::dense_linear(x, l.weight(), l.bias())
                .map_err(|e| candle_core::Error::Msg(e.to_string())),
            Linear::Fp8(l) => l.forward(x),
        }
    }
}

/// `ls[i].forward(x)` for projections that read the same input (q, k, v; gate, up): when all
/// are fp8, one fused call (`Fp8Linear::forward_fused`: one activation quantization and one
/// parallel region on the CPU at decode), with each output the projection's own.
pub(crate) fn forward_all<const N: usize>(ls: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
    let fp8: Vec<&Fp8Linear> = ls
        .iter()
        .filter_map(|l| match l {
            Linear::Fp8(f) => Some(f),
            Linear::Dense(_) => None,
        })
        .collect();
    let outs: Vec<Tensor> = if fp8.len() == N {
        Fp8Linear::forward_fused(&fp8, x)?
    } else {
        ls.iter()
            .map(|l| l.forward(x))
            .collect::<candle_core::Result<_>>()?
    };
    Ok(outs
        .try_into()
        .unwrap_or_else(|_| unreachable!("one output per projection")))
}

/// `silu(gate(x)) · up(x)`: when both are fp8, one op (`Fp8Linear::forward_swiglu`), otherwise
/// the two projections and `fp8nsa_ops::silu_mul`; the same bits either way.
pub(crate) fn swiglu(gate: &Linear, up: &Linear, x: &Tensor) -> Result<Tensor> {
    if let (Linear::Fp8(g), Linear::Fp8(u)) = (gate, up) {
        return Ok(Fp8Linear::forward_swiglu(g, u, x)?);
    }
    let [g, u] = forward_all([gate, up], x)?;
    Ok(fp8nsa_ops::silu_mul(&g, &u)?)
}
