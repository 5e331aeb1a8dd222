//! The architecture of a DeepSeek-V3 / V3.2 checkpoint: `config.json` as published.

use candle_core::Tensor;
use serde::Deserialize;

use crate::config::{one_or_many, LlamaConfig, MoeConfig, RopeStyle};
use crate::error::{invalid, Result};
use crate::rope::RopeScaling;
use crate::weights::Weights;

/// The architecture of a DeepSeek-V3 / V3.2 checkpoint (`config.json` field names).
///
/// ```
/// use fp8nsa_models::{DeepSeekConfig, Llama, ModelOptions};
///
/// let cfg = DeepSeekConfig::tiny(); // V3.2-shaped: the indexer keeps 8 keys per query
/// let model = Llama::deepseek(&cfg, &cfg.random_weights(7)?, &ModelOptions::default())?;
/// let mut cache = model.new_cache();
/// let logits = model.forward(&(0..12).collect::<Vec<u32>>(), &mut cache)?;
/// assert_eq!(logits.dims(), &[12, cfg.vocab_size]);
/// // per token and layer: the latent row (64 + 16) and the index key (32)
/// assert_eq!(cache.floats_per_token(), Some(2 * (64 + 16 + 32)));
/// # Ok::<(), fp8nsa_models::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
pub struct DeepSeekConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense MLP of the first `first_k_dense_replace` layers.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// `None`: queries come from `q_proj` directly (no query latent).
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    #[serde(default = "eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "theta")]
    pub rope_theta: f64,
    #[serde(default = "max_pos")]
    pub max_position_embeddings: usize,
    /// YaRN in the published checkpoints (`factor`, `beta_fast`, `beta_slow`, `mscale`,
    /// `mscale_all_dim`, `original_max_position_embeddings`), applied at every length.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub n_routed_experts: Option<usize>,
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default = "one")]
    pub moe_layer_freq: usize,
    #[serde(default = "one")]
    pub n_group: usize,
    #[serde(default = "one")]
    pub topk_group: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "one_f")]
    pub routed_scaling_factor: f64,
    #[serde(default = "sigmoid")]
    pub scoring_func: String,
    #[serde(default = "noaux_tc")]
    pub topk_method: String,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default, deserialize_with = "one_or_many")]
    pub eos_token_id: Vec<u32>,
    /// V3.2's indexer: heads, head size, and keys each query keeps.
    #[serde(default)]
    pub index_n_heads: Option<usize>,
    #[serde(default)]
    pub index_head_dim: Option<usize>,
    #[serde(default)]
    pub index_topk: Option<usize>,
}

fn eps() -> f64 {
    1e-6
}
fn theta() -> f64 {
    10_000.0
}
fn max_pos() -> usize {
    4096
}
fn one() -> usize {
    1
}
fn one_f() -> f64 {
    1.0
}
fn sigmoid() -> String {
    "sigmoid".into()
}
fn noaux_tc() -> String {
    "noaux_tc".into()
}
fn silu() -> String {
    "silu".into()
}

/// The indexer's settings, present for `deepseek_v32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

impl DeepSeekConfig {
    /// A small V3.2-shaped model for tests and examples: hidden 256, 2 layers (the first
    /// dense, the second MoE with 8 experts in 4 groups and a shared expert), 4 heads, latent
    /// 64 + 16, and an indexer keeping 8 keys.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 300,
            hidden_size: 256,
            intermediate_size: 384,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            q_lora_rank: Some(96),
            kv_lora_rank: 64,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 32,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            max_position_embeddings: 4096,
            rope_scaling: Some(serde_json::json!({"type": "yarn", "factor": 40.0,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 128})),
            n_routed_experts: Some(8),
            n_shared_experts: Some(1),
            num_experts_per_tok: Some(2),
            moe_intermediate_size: 64,
            first_k_dense_replace: 1,
            moe_layer_freq: 1,
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            scoring_func: sigmoid(),
            topk_method: noaux_tc(),
            hidden_act: silu(),
            tie_word_embeddings: false,
            bos_token_id: Some(0),
            eos_token_id: vec![1],
            index_n_heads: Some(4),
            index_head_dim: Some(32),
            index_topk: Some(8),
        }
    }

    /// Whether layer `l` runs the MoE block.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.n_routed_experts.is_some_and(|e| e > 0)
            && l >= self.first_k_dense_replace
            && l.is_multiple_of(self.moe_layer_freq.max(1))
    }

    /// The indexer of V3.2 (`None` without the three `index_*` fields).
    pub fn indexer(&self) -> Option<IndexerDims> {
        Some(IndexerDims {
            heads: self.index_n_heads?,
            head_dim: self.index_head_dim?,
            topk: self.index_topk?,
        })
    }

    /// `(qk_nope + qk_rope)^-0.5 · m²`, `m = 0.1 · mscale_all_dim · ln(factor) + 1` under YaRN
    /// scaling with a nonzero `mscale_all_dim` (else `m = 1`).
    pub fn softmax_scale(&self) -> f64 {
        let base = ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f64).powf(-0.5);
        let get = |k: &str| {
            self.rope_scaling
                .as_ref()
                .and_then(|r| r.get(k))
                .and_then(|v| v.as_f64())
        };
        match (get("mscale_all_dim"), get("factor")) {
            (Some(all), Some(factor)) if all != 0.0 && factor > 1.0 => {
                let m = 0.1 * all * factor.ln() + 1.0;
                base * m * m
            }
            _ => base,
        }
    }

    /// The RoPE scaling of the rotated dimensions.
    pub fn rope(&self) -> Result<RopeScaling> {
        RopeScaling::parse(self.rope_scaling.as_ref(), self.max_position_embeddings)
    }

    /// Checks the config for a model of `model_type` (`deepseek_v32` needs the indexer).
    pub fn validate(&self, v32: bool) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (arg, v) in positive {
            if v == 0 {
                return Err(invalid(arg, "must be at least 1"));
            }
        }
        if self.q_lora_rank == Some(0) {
            return Err(invalid("q_lora_rank", "must be at least 1 (or null)"));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(invalid(
                "qk_rope_head_dim",
                "must be even for rotary embeddings",
            ));
        }
        if self.first_k_dense_replace > 0 && self.intermediate_size == 0 {
            return Err(invalid("intermediate_size", "must be at least 1"));
        }
        // the projections' widths are products of these sizes: ones that overflow are refused
        // here, not computed wrapped (or panicking) when the layers are built
        let h = self.num_attention_heads;
        let (nope, rope) = (self.qk_nope_head_dim, self.qk_rope_head_dim);
        let widths = [
            (
                "qk_nope_head_dim",
                nope.checked_add(rope).and_then(|w| w.checked_mul(h)),
            ),
            (
                "v_head_dim",
                nope.checked_add(self.v_head_dim)
                    .and_then(|w| w.checked_mul(h)),
            ),
            ("kv_lora_rank", self.kv_lora_rank.checked_add(rope)),
        ];
        for (arg, w) in widths {
            if w.is_none() {
                return Err(invalid(
                    arg,
                    "the projection widths it gives overflow the address space",
                ));
            }
        }
        crate::config::check_theta_eps_act(self.rope_theta, self.rms_norm_eps, &self.hidden_act)?;
        self.rope()?;
        if let Some(e) = self.n_routed_experts.filter(|&e| e > 0) {
            let k = self.num_experts_per_tok.unwrap_or(0);
            crate::config::check_experts((e, "n_routed_experts"), k, self.moe_intermediate_size)?;
            if self.n_group == 0 || !e.is_multiple_of(self.n_group) {
                return Err(invalid(
                    "n_group",
                    format!("must divide the {e} routed experts, got {}", self.n_group),
                ));
            }
            if self.topk_group == 0 || self.topk_group > self.n_group {
                return Err(invalid(
                    "topk_group",
                    format!(
                        "must be in 1..={} (n_group), got {}",
                        self.n_group, self.topk_group
                    ),
                ));
            }
            if self.moe_layer_freq == 0 {
                return Err(invalid("moe_layer_freq", "must be at least 1"));
            }
            // the shared experts run as one MLP `moe_intermediate_size * n_shared_experts` wide
            let shared = self.n_shared_experts.unwrap_or(0);
            if self.moe_intermediate_size.checked_mul(shared).is_none() {
                return Err(invalid(
                    "n_shared_experts",
                    format!(
                        "{shared} shared experts of {} overflow the MLP width",
                        self.moe_intermediate_size
                    ),
                ));
            }
            // V2's softmax and greedy routing would run as V3's and give other experts
            if self.scoring_func != "sigmoid" {
                return Err(invalid(
                    "scoring_func",
                    format!(
                        "{:?} is not implemented (DeepSeek-V3: sigmoid)",
                        self.scoring_func
                    ),
                ));
            }
            if self.topk_method != "noaux_tc" {
                return Err(invalid(
                    "topk_method",
                    format!(
                        "{:?} is not implemented (DeepSeek-V3: noaux_tc)",
                        self.topk_method
                    ),
                ));
            }
        }
        match (v32, self.indexer()) {
            (false, _) => {}
            (true, None) => {
                return Err(invalid(
                    "index_topk",
                    "deepseek_v32 needs index_n_heads, index_head_dim and index_topk",
                ))
            }
            (true, Some(ix)) => {
                if ix.heads == 0 || ix.topk == 0 {
                    return Err(invalid(
                        "index_topk",
                        "index_n_heads and index_topk must be at least 1",
                    ));
                }
                if ix.heads.checked_mul(ix.head_dim).is_none() {
                    return Err(invalid(
                        "index_n_heads",
                        "index_n_heads x index_head_dim overflows the address space",
                    ));
                }
                if ix.head_dim < self.qk_rope_head_dim {
                    return Err(invalid(
                        "index_head_dim",
                        format!(
                            "must hold the {} rotated dimensions, got {}",
                            self.qk_rope_head_dim, ix.head_dim
                        ),
                    ));
                }
                if self.q_lora_rank.is_none() {
                    return Err(invalid(
                        "q_lora_rank",
                        "the V3.2 indexer reads the query latent",
                    ));
                }
            }
        }
        Ok(())
    }

    /// What the shared decoder needs (embeddings, head, limits, special tokens).
    pub(super) fn decoder_config(&self) -> LlamaConfig {
        LlamaConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size.max(1),
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: Some(self.num_attention_heads),
            head_dim: Some(self.qk_rope_head_dim),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: Some(self.tie_word_embeddings),
            bos_token_id: self.bos_token_id,
            eos_token_id: self.eos_token_id.clone(),
            hidden_act: self.hidden_act.clone(),
            rope_scaling: self.rope_scaling.clone(),
            moe: MoeConfig::default(),
            rope_style: RopeStyle::Interleaved,
        }
    }

    /// Seeded N(0, 0.02) weights in the published layout (norms at 1 with small noise,
    /// LayerNorm bias, router bias), f32: a model to run without a download. The MTP module is
    /// not generated.
    pub fn random_weights(&self, seed: u64) -> Result<Weights> {
        use rand::SeedableRng;
        use rand_distr::{Distribution, Normal};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut w = Weights::default();
        let mut put = |w: &mut Weights, name: String, dims: &[usize], mean: f32, std: f32| {
            let normal = Normal::new(mean, std).expect("valid std");
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
            Tensor::from_vec(v, dims, &candle_core::Device::Cpu).map(|t| w.insert(name, t))
        };
        let (h, heads) = (self.hidden_size, self.num_attention_heads);
        let (nope, rd, v, r) = (
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
        );
        put(
            &mut w,
            "model.embed_tokens.weight".into(),
            &[self.vocab_size, h],
            0.0,
            0.5,
        )?;
        if !self.tie_word_embeddings {
            put(
                &mut w,
                "lm_head.weight".into(),
                &[self.vocab_size, h],
                0.0,
                0.02,
            )?;
        }
        put(&mut w, "model.norm.weight".into(), &[h], 1.0, 0.05)?;
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let mut mats: Vec<(String, Vec<usize>)> = Vec::new();
            match self.q_lora_rank {
                Some(q) => {
                    mats.push((format!("{a}.q_a_proj"), vec![q, h]));
                    mats.push((format!("{a}.q_b_proj"), vec![heads * (nope + rd), q]));
                    put(&mut w, format!("{a}.q_a_layernorm.weight"), &[q], 1.0, 0.05)?;
                }
                None => mats.push((format!("{a}.q_proj"), vec![heads * (nope + rd), h])),
            }
            mats.push((format!("{a}.kv_a_proj_with_mqa"), vec![r + rd, h]));
            mats.push((format!("{a}.kv_b_proj"), vec![heads * (nope + v), r]));
            mats.push((format!("{a}.o_proj"), vec![h, heads * v]));
            put(
                &mut w,
                format!("{a}.kv_a_layernorm.weight"),
                &[r],
                1.0,
                0.05,
            )?;
            if let Some(ix) = self.indexer() {
                let q = self.q_lora_rank.unwrap_or(h);
                mats.push((format!("{a}.indexer.wq_b"), vec![ix.heads * ix.head_dim, q]));
                mats.push((format!("{a}.indexer.wk"), vec![ix.head_dim, h]));
                mats.push((format!("{a}.indexer.weights_proj"), vec![ix.heads, h]));
                put(
                    &mut w,
                    format!("{a}.indexer.k_norm.weight"),
                    &[ix.head_dim],
                    1.0,
                    0.05,
                )?;
                put(
                    &mut w,
                    format!("{a}.indexer.k_norm.bias"),
                    &[ix.head_dim],
                    0.0,
                    0.05,
                )?;
            }
            let mlp = |mats: &mut Vec<(String, Vec<usize>)>, pre: &str, i: usize| {
                mats.push((format!("{pre}.gate_proj"), vec![i, h]));
                mats.push((format!("{pre}.up_proj"), vec![i, h]));
                mats.push((format!("{pre}.down_proj"), vec![h, i]));
            };
            if self.is_moe_layer(l) {
                let e = self.n_routed_experts.unwrap_or(0);
                let mi = self.moe_intermediate_size;
                mats.push((format!("{p}.mlp.gate"), vec![e, h]));
                put(
                    &mut w,
                    format!("{p}.mlp.gate.e_score_correction_bias"),
                    &[e],
                    0.0,
                    0.05,
                )?;
                for x in 0..e {
                    mlp(&mut mats, &format!("{p}.mlp.experts.{x}"), mi);
                }
                if let Some(s) = self.n_shared_experts.filter(|&s| s > 0) {
                    mlp(&mut mats, &format!("{p}.mlp.shared_experts"), mi * s);
                }
            } else {
                mlp(&mut mats, &format!("{p}.mlp"), self.intermediate_size);
            }
            for (name, dims) in mats {
                put(&mut w, format!("{name}.weight"), &dims, 0.0, 0.02)?;
            }
            for n in ["input_layernorm", "post_attention_layernorm"] {
                put(&mut w, format!("{p}.{n}.weight"), &[h], 1.0, 0.05)?;
            }
        }
        Ok(w)
    }
}
