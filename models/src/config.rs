use serde::Deserialize;

use crate::attention::AttentionKind;
use crate::error::{invalid, Result};
use crate::linear::LinearKind;
use crate::rope::RopeScaling;
use crate::weights::Weights;

pub use fp8nsa_types::RopeStyle;

/// The architecture of a Llama-family model (Hugging Face `config.json` field names).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// `Some(true)`: the head is the embeddings; `Some(false)`: the checkpoint's own
    /// `lm_head.weight`, which must be there; absent (`None`): the checkpoint's head when it
    /// has one, else the embeddings (model families default differently).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// The tokens that end generation: `config.json` gives one id or a list of them.
    #[serde(default, deserialize_with = "one_or_many")]
    pub eos_token_id: Vec<u32>,
    /// The MLP's activation; the decoder implements `silu` (SwiGLU) only, and refuses others
    /// rather than running them as SiLU.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// `linear`, `llama3` or `yarn` scaling ([`RopeScaling`]); any other kind is refused, not
    /// misread.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Mixture-of-experts fields (Qwen3-MoE); none for a dense model.
    #[serde(flatten)]
    pub moe: MoeConfig,
    #[serde(skip)]
    pub rope_style: RopeStyle,
}

/// The mixture-of-experts part of a config (Qwen3-MoE field names). A layer runs an MoE block
/// when `num_experts > 0`, it is not in `mlp_only_layers`, and `(layer + 1) %
/// decoder_sparse_step == 0`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct MoeConfig {
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `l` is an MoE layer.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        let step = self.decoder_sparse_step.unwrap_or(1).max(1);
        self.num_experts > 0 && !self.mlp_only_layers.contains(&l) && (l + 1).is_multiple_of(step)
    }
}

fn default_act() -> String {
    "silu".into()
}

/// An id, a list of ids, or null (none).
pub(crate) fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => Vec::new(),
        Some(OneOrMany::One(id)) => vec![id],
        Some(OneOrMany::Many(ids)) => ids,
    })
}

fn default_eps() -> f64 {
    1e-5
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}

impl LlamaConfig {
    /// A small model for demos and tests (hidden 576 like SmolLM2, 4 layers, GQA 9/3).
    pub fn tiny() -> Self {
        Self {
            vocab_size: 512,
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 4,
            num_attention_heads: 9,
            num_key_value_heads: Some(3),
            head_dim: Some(64),
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            max_position_embeddings: 4096,
            tie_word_embeddings: Some(true),
            bos_token_id: Some(1),
            eos_token_id: vec![2],
            hidden_act: default_act(),
            rope_scaling: None,
            moe: MoeConfig::default(),
            rope_style: RopeStyle::Half,
        }
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The parsed `rope_scaling`.
    pub fn rope_scaling(&self) -> Result<RopeScaling> {
        RopeScaling::parse(self.rope_scaling.as_ref(), self.max_position_embeddings)
    }

    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
        ];
        for (arg, v) in positive {
            if v == 0 {
                return Err(invalid(arg, "must be at least 1"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "must divide num_attention_heads = {}, got {}",
                    self.num_attention_heads,
                    self.kv_heads()
                ),
            ));
        }
        check_theta_eps_act(self.rope_theta, self.rms_norm_eps, &self.hidden_act)?;
        self.rope_scaling()?;
        let m = &self.moe;
        if m.num_experts > 0 {
            check_experts(
                (m.num_experts, "num_experts"),
                m.num_experts_per_tok,
                m.moe_intermediate_size,
            )?;
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(invalid("head_dim", "must be even for rotary embeddings"));
        }
        Ok(())
    }
}

/// How to build a model from its weights.
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// Kind of the attention and MLP projections. Weights that a checkpoint already stores in
    /// fp8 are used as fp8 whatever this says (W8A16 under `Dense`).
    pub linear: LinearKind,
    pub attention: AttentionKind,
    /// Also quantize the output head (off by default, as in fp8 checkpoints).
    pub fp8_lm_head: bool,
    /// Module names (e.g. `model.layers.0.mlp.down_proj`) kept dense (from
    /// `quantization_config.modules_to_not_convert`).
    pub modules_to_not_convert: Vec<String>,
    /// Where the model runs (`None`: the host, where weights load). Every tensor it is built
    /// from is moved there as the builder takes it, so its KV pages, activations and logits
    /// live there too; fp8 projections prepare their weights for it on first use (a CUDA
    /// device needs the `cuda` feature).
    pub device: Option<candle_core::Device>,
}

impl ModelOptions {
    /// `w` as the builder reads it: handing its tensors out on [`Self::device`].
    pub(crate) fn placed<'a>(&self, w: &'a Weights) -> std::borrow::Cow<'a, Weights> {
        match &self.device {
            Some(d) => std::borrow::Cow::Owned(w.clone().on_device(d)),
            None => std::borrow::Cow::Borrowed(w),
        }
    }
}

/// The checks every MoE config shares (Qwen3-MoE's and DeepSeek's): `per_tok` experts of the
/// `experts` a layer has (the config's field `experts_field`), each an MLP of
/// `moe_intermediate_size`.
pub(crate) fn check_experts(
    (experts, experts_field): (usize, &str),
    per_tok: usize,
    moe_intermediate_size: usize,
) -> Result<()> {
    if per_tok == 0 || per_tok > experts {
        return Err(invalid(
            "num_experts_per_tok",
            format!("must be in 1..={experts} ({experts_field}), got {per_tok}"),
        ));
    }
    if moe_intermediate_size == 0 {
        return Err(invalid("moe_intermediate_size", "must be at least 1"));
    }
    Ok(())
}

/// The checks every decoder config shares (Llama's and DeepSeek's): a non-positive or NaN RoPE
/// base gives NaN frequencies, a negative epsilon NaN norms (every logit NaN, with no error
/// anywhere else), and an activation other than SiLU would run as SiLU and give wrong logits.
pub(crate) fn check_theta_eps_act(
    rope_theta: f64,
    rms_norm_eps: f64,
    hidden_act: &str,
) -> Result<()> {
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(invalid(
            "rope_theta",
            format!("must be finite and > 0, got {rope_theta}"),
        ));
    }
    if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
        return Err(invalid(
            "rms_norm_eps",
            format!("must be finite and >= 0, got {rms_norm_eps}"),
        ));
    }
    // "silu" and its alias "swish"
    if !matches!(hidden_act, "silu" | "swish") {
        return Err(invalid(
            "hidden_act",
            format!("{hidden_act:?} is not implemented (the decoder's MLP is SwiGLU: silu)"),
        ));
    }
    Ok(())
}
