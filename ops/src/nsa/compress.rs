use candle_core::{DType, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

use super::config::{CompressorKind, NsaConfig};
use crate::error::{invalid, Result};

/// The learnable compressor of one of keys or values: `φ(block) = fc2(gelu(fc1(flatten(block +
/// pos))))`, with `pos [l, D]` the intra-block position term. Shared by all kv heads.
#[derive(Clone, Debug)]
pub struct MlpCompressor {
    pos: Tensor,
    fc1: Linear,
    fc2: Linear,
}

impl MlpCompressor {
    /// Loads `pos [l, D]`, `fc1 [hidden, l * D]` (+ bias), `fc2 [D, hidden]` (+ bias).
    pub fn load(vb: VarBuilder, l: usize, d: usize, hidden: usize) -> Result<Self> {
        // the compressor runs in f32 whatever the checkpoint's dtype
        let f32_linear = |l: Linear| -> Result<Linear> {
            let b = l.bias().map(|b| b.to_dtype(DType::F32)).transpose()?;
            Ok(Linear::new(l.weight().to_dtype(DType::F32)?, b))
        };
        Ok(Self {
            pos: vb.get((l, d), "pos")?.to_dtype(DType::F32)?,
            fc1: f32_linear(candle_nn::linear(l * d, hidden, vb.pp("fc1"))?)?,
            fc2: f32_linear(candle_nn::linear(hidden, d, vb.pp("fc2"))?)?,
        })
    }

    /// From tensors: `pos [l, D]`, fc1/fc2 weights `[out, in]` with optional biases.
    pub fn new(pos: Tensor, fc1: Linear, fc2: Linear) -> Self {
        Self { pos, fc1, fc2 }
    }
}

/// Compressed keys or values, per [`CompressorKind`].
#[derive(Clone, Debug)]
pub enum Compressor {
    MeanPool,
    Mlp { k: MlpCompressor, v: MlpCompressor },
}

impl Compressor {
    pub fn kind(&self) -> CompressorKind {
        match self {
            Compressor::MeanPool => CompressorKind::MeanPool,
            Compressor::Mlp { .. } => CompressorKind::Mlp,
        }
    }

    /// Compressed blocks `first .. first + count` of `x [B, T, H, D]` (`is_key` picks the key
    /// or value MLP) -> `[B, count, H, D]` f32. Each block is computed from its own keys only, so
    /// a block comes out bit-identical whether made in prefill or during decode.
    pub(crate) fn compress(
        &self,
        cfg: &NsaConfig,
        x: &Tensor,
        first: usize,
        count: usize,
        is_key: bool,
    ) -> Result<Tensor> {
        let (b, t, h, d) = x.dims4()?;
        let (l, s) = (cfg.compress_block, cfg.compress_stride);
        if count == 0 {
            return Ok(Tensor::zeros((b, 0, h, d), DType::F32, x.device())?);
        }
        let span = (first + count - 1) * s + l;
        if span > t {
            return Err(invalid(
                "compress",
                format!("blocks up to {} need {span} keys, have {t}", first + count),
            ));
        }
        let x = x.to_dtype(DType::F32)?;
        match self {
            Compressor::MeanPool => {
                // sums of stride-sized pieces, then each block adds its l / s pieces
                let pieces = count - 1 + l / s;
                let sums = x
                    .narrow(1, first * s, pieces * s)?
                    .reshape((b, pieces, s, h, d))?
                    .sum(2)?;
                let mut acc = sums.narrow(1, 0, count)?;
                for r in 1..l / s {
                    acc = (acc + sums.narrow(1, r, count)?)?;
                }
                Ok((acc / l as f64)?)
            }
            Compressor::Mlp { k, v } => {
                let m = if is_key { k } else { v };
                let idx: Vec<u32> = (0..count)
                    .flat_map(|i| (0..l).map(move |r| ((first + i) * s + r) as u32))
                    .collect();
                let idx = Tensor::from_vec(idx, count * l, x.device())?;
                let blocks = x
                    .index_select(&idx, 1)?
                    .reshape((b, count, l, h, d))?
                    .permute((0, 1, 3, 2, 4))?
                    .broadcast_add(&m.pos.to_dtype(DType::F32)?)?
                    .reshape((b, count, h, l * d))?;
                let hid = m.fc1.forward(&blocks)?.gelu()?;
                Ok(m.fc2.forward(&hid)?.reshape((b, count, h, d))?)
            }
        }
    }
}
