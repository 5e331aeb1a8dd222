use serde::{Deserialize, Serialize};

use fp8nsa_cpu::nsa_select::NsaParams;

use crate::error::Result;

/// How blocks of keys / values become one compressed key / value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompressorKind {
    /// Mean of the block: training-free, the default.
    #[default]
    MeanPool,
    /// The paper's learnable MLP with an intra-block position term (weights from a checkpoint).
    Mlp,
}

/// Hyper-parameters of the three-branch NSA layer; the defaults are the paper's. Deserializes
/// from a model's `config.json` section (missing keys take the defaults).
///
/// ```
/// let cfg: fp8nsa_ops::nsa::NsaConfig =
///     serde_json::from_str(r#"{"window": 256, "num_selected": 8}"#).unwrap();
/// assert_eq!((cfg.compress_block, cfg.select_block, cfg.window), (32, 64, 256));
/// cfg.validate().unwrap();
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NsaConfig {
    /// Keys per compressed block, `l` (32).
    pub compress_block: usize,
    /// Stride between compressed blocks, `d` (16).
    pub compress_stride: usize,
    /// Keys per selection block, `l'` (64).
    pub select_block: usize,
    /// Selected blocks per query, forced ones included, `n` (16).
    pub num_selected: usize,
    /// Leading blocks always selected (1).
    pub num_initial: usize,
    /// Blocks ending at the query always selected (2).
    pub num_local: usize,
    /// Sliding-window length, `w` (512).
    pub window: usize,
    pub compressor: CompressorKind,
    /// Hidden width of the MLP compressor (default `compress_block * head_dim / 4` when 0).
    pub mlp_hidden: usize,
}

impl Default for NsaConfig {
    fn default() -> Self {
        Self {
            compress_block: 32,
            compress_stride: 16,
            select_block: 64,
            num_selected: 16,
            num_initial: 1,
            num_local: 2,
            window: 512,
            compressor: CompressorKind::MeanPool,
            mlp_hidden: 0,
        }
    }
}

impl NsaConfig {
    /// Checks the relations the layer relies on: positive sizes, the stride dividing both
    /// block lengths (so compression and selection blocks line up, paper eq. 9), and the forced
    /// blocks fitting in the budget.
    pub fn validate(&self) -> Result<()> {
        Ok(self.params().validate()?)
    }

    /// The sizes the CPU backend's selection helpers (`fp8nsa_cpu::nsa_select`) take; they
    /// hold the one implementation of the checks and block arithmetic above.
    pub(crate) fn params(&self) -> NsaParams {
        NsaParams {
            compress_block: self.compress_block,
            compress_stride: self.compress_stride,
            select_block: self.select_block,
            num_selected: self.num_selected,
            num_initial: self.num_initial,
            num_local: self.num_local,
            window: self.window,
        }
    }

    /// Compressed blocks that exist once `t` keys are known: block `i` covers keys
    /// `[i * stride, i * stride + compress_block)`.
    pub fn compressed_len(&self, t: usize) -> usize {
        self.params().compressed_len(t)
    }
}
