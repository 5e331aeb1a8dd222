//! DeepSeek-V3 (`deepseek_v3`) and V3.2 (`deepseek_v32`) on the decoder of [`Llama`]: multi-head
//! latent attention (MLA) with a latent cache, sigmoid group-limited MoE with shared experts, and
//! V3.2's sparse attention (DSA), whose lightning indexer picks each query's keys, run as a
//! [`TokenSelection`] through the selection kernel.
//!
//! MLA keeps per token only the normalized latent `c` (`kv_lora_rank`) and the shared rotated
//! key `k_pe` (`qk_rope_head_dim`): 576 floats at the published sizes, where per-head keys and
//! values would take `heads x (192 + 128)`. Attention runs on that latent ("absorbed"): each
//! head's `k_nope` projection is folded into its query (`q_nope . W_uk[h]`), and its value
//! projection `W_uv[h]` applied after the weighted sum of latents, so scores are one dot product
//! of `[q_lat | q_pe]` with the cached row `[c | k_pe]`. Both projections come from `kv_b_proj`,
//! dequantized once on load.

use candle_core::{DType, Module, Tensor};
use candle_nn::{Embedding, LayerNorm, RmsNorm};
use fp8nsa_ops::nsa::{SelectionAttention, TokenSelection};
use fp8nsa_ops::{Fp8BlockWeight, MoeRouter};
use serde::Deserialize;

use crate::attention::Rope;
use crate::config::{one_or_many, LlamaConfig, ModelOptions, MoeConfig, RopeStyle};
use crate::error::{invalid, Result};
use crate::linear::{Linear, LinearKind};
use crate::llama::{
    build_head, check_layer_count, experts_mlp, keep_dense, Block, Llama, Mixer, Mlp,
};
use crate::paged::{KvPool, LayerKv, SeqKv};
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
        crate::config::check_theta_eps_act(self.rope_theta, self.rms_norm_eps, &self.hidden_act)?;
        self.rope()?;
        if let Some(e) = self.n_routed_experts.filter(|&e| e > 0) {
            let k = self.num_experts_per_tok.unwrap_or(0);
            if k == 0 || k > e {
                return Err(invalid(
                    "num_experts_per_tok",
                    format!("must be in 1..={e} (n_routed_experts), got {k}"),
                ));
            }
            if self.moe_intermediate_size == 0 {
                return Err(invalid("moe_intermediate_size", "must be at least 1"));
            }
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
    fn decoder_config(&self) -> LlamaConfig {
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

/// `[out, in]` of a projection.
fn out_in(l: &Linear) -> [usize; 2] {
    match l {
        Linear::Dense(d) => {
            let d = d.weight().dims();
            [d[0], d[1]]
        }
        Linear::Fp8(f) => f.weight().shape(),
    }
}

fn expect_shape(name: &str, l: &Linear, want: [usize; 2]) -> Result<()> {
    if out_in(l) != want {
        return Err(invalid(
            "weights",
            format!("{name}.weight is {:?}, the config says {want:?}", out_in(l)),
        ));
    }
    Ok(())
}

/// `{name}.weight` as f32, dequantized when stored in fp8.
fn dense_weight(w: &Weights, name: &str) -> Result<Tensor> {
    Ok(match w.fp8(name)? {
        Some((data, scales, block)) => {
            Fp8BlockWeight::from_parts(data, scales, block)?.dequantize(DType::F32)?
        }
        None => w.get(&format!("{name}.weight"))?,
    })
}

#[derive(Clone, Debug)]
enum QProj {
    /// `q_b(norm(q_a(x)))`; the normalized latent also feeds the V3.2 indexer.
    Lora {
        a: Linear,
        norm: RmsNorm,
        b: Linear,
    },
    Direct(Linear),
}

/// V3.2's lightning indexer: one key per token (`LayerNorm(wk(x))`), `heads` queries per
/// token from the query latent, ReLU'd dot products weighted per head by `weights_proj(x)`.
#[derive(Clone, Debug)]
struct Indexer {
    wq_b: Linear,
    wk: Linear,
    k_norm: LayerNorm,
    weights_proj: Linear,
    dims: IndexerDims,
    rope_dim: usize,
    /// Half-split pairs (DeepSeek's reference code since Nov 2025), rotated part first.
    rope: Rope,
}

/// Per-layer cache of MLA: `[c | k_pe]` rows and, with the indexer, its key rows. Buffers grow
/// by doubling; the first `len` rows are valid, the step's rows count after `commit`.
#[derive(Debug, Default)]
pub(crate) struct MlaCache {
    latent: Option<Tensor>,
    index: Option<Tensor>,
    len: usize,
}

impl MlaCache {
    pub(crate) fn try_clone(&self) -> Result<Self> {
        let copy = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
            Ok(match t {
                Some(t) => Some(t.copy()?),
                None => None,
            })
        };
        Ok(Self {
            latent: copy(&self.latent)?,
            index: copy(&self.index)?,
            len: self.len,
        })
    }

    pub(crate) fn commit(&mut self, t: usize) {
        self.len += t;
    }

    /// Floats kept per token (latent, plus the indexer's key).
    pub(crate) fn row_floats(&self) -> usize {
        [&self.latent, &self.index]
            .iter()
            .filter_map(|b| b.as_ref().map(|t| t.dims()[1]))
            .sum()
    }
}

/// Writes `rows [T, W]` after the first `len` rows of `buf` (growing it) and returns rows
/// `0..len + T`.
fn append(buf: &mut Option<Tensor>, len: usize, rows: &Tensor) -> Result<Tensor> {
    let (t, w) = rows.dims2()?;
    let need = len + t;
    let cap = buf.as_ref().map_or(0, |b| b.dims()[0]);
    if need > cap {
        let grown = Tensor::zeros((need.max(2 * cap).max(64), w), rows.dtype(), rows.device())?;
        if let Some(old) = buf.as_ref() {
            if len > 0 {
                grown.slice_set(&old.narrow(0, 0, len)?, 0, 0)?;
            }
        }
        *buf = Some(grown);
    }
    let b = buf.as_ref().expect("allocated above");
    b.slice_set(&rows.contiguous()?, 0, len)?;
    Ok(b.narrow(0, 0, need)?)
}

/// Multi-head latent attention of one layer (and V3.2's indexer).
#[derive(Clone, Debug)]
pub(crate) struct Mla {
    q: QProj,
    kv_a: Linear,
    kv_norm: RmsNorm,
    /// `[H, nope, r]`: folds each head's key projection into its query.
    w_uk: Tensor,
    /// `[H, r, v]`: each head's value projection, applied to its attended latent.
    w_uv: Tensor,
    o: Linear,
    heads: usize,
    nope: usize,
    rope_dim: usize,
    rank: usize,
    v: usize,
    scale: f32,
    /// Interleaved pairs.
    rope: Rope,
    indexer: Option<Indexer>,
}

impl Mla {
    fn new(
        cfg: &DeepSeekConfig,
        w: &Weights,
        prefix: &str,
        opts: &ModelOptions,
        keep_dense: &dyn Fn(&str) -> bool,
        scaling: &RopeScaling,
    ) -> Result<Self> {
        let lin = |n: &str, want: [usize; 2]| -> Result<Linear> {
            let name = format!("{prefix}.{n}");
            let l = Linear::build(w, &name, opts.linear, keep_dense(&name))?;
            expect_shape(&name, &l, want)?;
            Ok(l)
        };
        let norm = |n: &str, dim: usize| -> Result<RmsNorm> {
            let name = format!("{prefix}.{n}.weight");
            let t = w.get(&name)?;
            if t.dims() != [dim] {
                return Err(invalid(
                    "weights",
                    format!("{name} is {:?}, expected [{dim}]", t.dims()),
                ));
            }
            Ok(RmsNorm::new(t, cfg.rms_norm_eps))
        };
        let (h, hidden) = (cfg.num_attention_heads, cfg.hidden_size);
        let (nope, rd, v, r) = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        );
        let q = match cfg.q_lora_rank {
            Some(ql) => QProj::Lora {
                a: lin("q_a_proj", [ql, hidden])?,
                norm: norm("q_a_layernorm", ql)?,
                b: lin("q_b_proj", [h * (nope + rd), ql])?,
            },
            None => QProj::Direct(lin("q_proj", [h * (nope + rd), hidden])?),
        };
        let kv_b_name = format!("{prefix}.kv_b_proj");
        let kv_b = dense_weight(w, &kv_b_name)?;
        if kv_b.dims() != [h * (nope + v), r] {
            return Err(invalid(
                "weights",
                format!(
                    "{kv_b_name}.weight is {:?}, the config says [{}, {r}]",
                    kv_b.dims(),
                    h * (nope + v)
                ),
            ));
        }
        let kv_b = kv_b.reshape((h, nope + v, r))?;
        let max = cfg.max_position_embeddings;
        let indexer = match cfg.indexer() {
            Some(ix) => {
                let ql = cfg.q_lora_rank.unwrap_or(hidden);
                let p = format!("{prefix}.indexer");
                let get = |n: &str| w.get(&format!("{p}.{n}"));
                let (kw, kb) = (get("k_norm.weight")?, get("k_norm.bias")?);
                for (n, t) in [("k_norm.weight", &kw), ("k_norm.bias", &kb)] {
                    if t.dims() != [ix.head_dim] {
                        return Err(invalid(
                            "weights",
                            format!("{p}.{n} is {:?}, expected [{}]", t.dims(), ix.head_dim),
                        ));
                    }
                }
                // weights_proj stays as stored (bf16 in the checkpoints): it decides which keys
                // are kept, so it is never quantized
                let wp_name = format!("{p}.weights_proj");
                let weights_proj = Linear::build(w, &wp_name, LinearKind::Dense, true)?;
                expect_shape(&wp_name, &weights_proj, [ix.heads, hidden])?;
                Some(Indexer {
                    wq_b: lin("indexer.wq_b", [ix.heads * ix.head_dim, ql])?,
                    wk: lin("indexer.wk", [ix.head_dim, hidden])?,
                    k_norm: LayerNorm::new(kw, kb, 1e-6),
                    weights_proj,
                    dims: ix,
                    rope_dim: rd,
                    rope: Rope::with_dim(scaling, cfg.rope_theta, rd, max, RopeStyle::Half)?,
                })
            }
            None => None,
        };
        Ok(Self {
            q,
            kv_a: lin("kv_a_proj_with_mqa", [r + rd, hidden])?,
            kv_norm: norm("kv_a_layernorm", r)?,
            w_uk: kv_b.narrow(1, 0, nope)?.contiguous()?,
            w_uv: kv_b.narrow(1, nope, v)?.transpose(1, 2)?.contiguous()?,
            o: lin("o_proj", [hidden, h * v])?,
            heads: h,
            nope,
            rope_dim: rd,
            rank: r,
            v,
            scale: cfg.softmax_scale() as f32,
            rope: Rope::with_dim(scaling, cfg.rope_theta, rd, max, RopeStyle::Interleaved)?,
            indexer,
        })
    }

    /// The projections that run (fp8 or dense); `kv_b_proj` runs absorbed, in f32.
    pub(crate) fn projections(&self) -> Vec<&Linear> {
        let mut v = match &self.q {
            QProj::Lora { a, b, .. } => vec![a, b],
            QProj::Direct(q) => vec![q],
        };
        v.extend([&self.kv_a, &self.o]);
        if let Some(ix) = &self.indexer {
            v.extend([&ix.wq_b, &ix.wk, &ix.weights_proj]);
        }
        v
    }

    /// What this layer keeps per token in a [`KvPool`].
    pub(crate) fn kv_layout(&self) -> LayerKv {
        LayerKv::Latent {
            width: self.rank + self.rope_dim,
            index: self.indexer.as_ref().map_or(0, |ix| ix.dims.head_dim),
        }
    }

    /// `x [1, T, hidden]` at positions `pos..pos + T`.
    pub(crate) fn forward(&self, x: &Tensor, pos: usize, cache: &mut MlaCache) -> Result<Tensor> {
        let (_, t, _) = x.dims3()?;
        let segs = [(pos, t)];
        let p = self.project(x, &segs)?;
        let latent = append(&mut cache.latent, cache.len, &p.rows)?; // [pos + T, W]
        let selection = match (&self.indexer, &p.cq) {
            (Some(ix), Some(cq)) => {
                let keys = append(&mut cache.index, cache.len, &ix.keys(x, &segs)?)?;
                ix.select(x, cq, &keys, pos)?
            }
            _ => None,
        };
        self.output(&self.attend(&p.qa, &latent, pos, selection)?)
    }

    /// A ragged batch (`Llama::forward_batch`): `x [1, M, hidden]` holds each sequence's new
    /// tokens in turn, `segs[i] = (pos, len)`; the projections run once over all M tokens,
    /// attention per sequence over the rows of its pages in `pool` (layer `layer`).
    pub(crate) fn forward_batch(
        &self,
        x: &Tensor,
        segs: &[(usize, usize)],
        layer: usize,
        pool: &KvPool,
        seqs: &[&mut SeqKv],
    ) -> Result<Tensor> {
        let p = self.project(x, segs)?;
        let ikeys = match &self.indexer {
            Some(ix) => Some(ix.keys(x, segs)?),
            None => None,
        };
        let mut outs = Vec::with_capacity(segs.len());
        let mut off = 0;
        for (&(pos, t), seq) in segs.iter().zip(seqs) {
            let rows = p.rows.narrow(0, off, t)?;
            let ik = match &ikeys {
                Some(k) => Some(k.narrow(0, off, t)?),
                None => None,
            };
            let (latent, keys) = pool.write_read_latent(layer, seq, pos, &rows, ik.as_ref())?;
            let selection = match (&self.indexer, &p.cq, &keys) {
                (Some(ix), Some(cq), Some(keys)) => {
                    ix.select(&x.narrow(1, off, t)?, &cq.narrow(1, off, t)?, keys, pos)?
                }
                _ => None,
            };
            outs.push(self.attend(&p.qa.narrow(1, off, t)?, &latent, pos, selection)?);
            off += t;
        }
        let o = match outs.len() {
            1 => outs.pop().expect("one output"),
            _ => Tensor::cat(&outs, 1)?,
        };
        self.output(&o)
    }

    /// The step's queries in latent space and cache rows, for `x [1, M, hidden]` whose rows
    /// are runs of positions `segs`.
    fn project(&self, x: &Tensor, segs: &[(usize, usize)]) -> Result<Projected> {
        let (_, m, _) = x.dims3()?;
        let (h, nope, rd, r) = (self.heads, self.nope, self.rope_dim, self.rank);
        let (q, cq) = match &self.q {
            QProj::Lora { a, norm, b } => {
                let cq = norm.forward(&a.forward(x)?)?;
                (b.forward(&cq)?, Some(cq))
            }
            QProj::Direct(p) => (p.forward(x)?, None),
        };
        let q = q.reshape((1, m, h, nope + rd))?;
        let q_pe = self
            .rope
            .apply_segments(&q.narrow(3, nope, rd)?.contiguous()?, segs)?;
        let kv = self.kv_a.forward(x)?;
        let c = self.kv_norm.forward(&kv.narrow(2, 0, r)?.contiguous()?)?;
        let k_pe = kv.narrow(2, r, rd)?.contiguous()?.reshape((1, m, 1, rd))?;
        let k_pe = self.rope.apply_segments(&k_pe, segs)?.reshape((m, rd))?;
        let rows = Tensor::cat(&[&c.reshape((m, r))?, &k_pe], 1)?;
        // [H, M, nope] . [H, nope, r]: the query in latent space, then its rotated part
        let qn = q
            .narrow(3, 0, nope)?
            .squeeze(0)?
            .transpose(0, 1)?
            .contiguous()?;
        let q_lat = qn.matmul(&self.w_uk)?;
        let qp = q_pe.squeeze(0)?.transpose(0, 1)?.contiguous()?;
        Ok(Projected {
            qa: Tensor::cat(&[&q_lat, &qp], 2)?,
            rows,
            cq,
        })
    }

    /// `qa [H, T, W]` at positions `pos..` against `latent [Tk, W]`, every causal key or the
    /// indexer's `selection`: the attended latents `[H, T, r]`.
    fn attend(
        &self,
        qa: &Tensor,
        latent: &Tensor,
        pos: usize,
        selection: Option<TokenSelection>,
    ) -> Result<Tensor> {
        let r = self.rank;
        match selection {
            None => self.attend_all(qa, latent, pos),
            Some(sel) => {
                // the cache row serves as key and as value: the first r outputs are the
                // weighted latents, the rotated tail is dropped
                let q4 = qa.transpose(0, 1)?.unsqueeze(0)?.contiguous()?; // [1, T, H, W]
                let kv4 = latent.unsqueeze(0)?.unsqueeze(2)?; // [1, Tk, 1, W]
                let (o, _) = SelectionAttention::new()
                    .scale(self.scale)
                    .q_offset(pos)
                    .min_len(0)
                    .forward(&q4, &kv4, &kv4, &sel)?;
                Ok(o.narrow(3, 0, r)?
                    .squeeze(0)?
                    .transpose(0, 1)?
                    .contiguous()?)
            }
        }
    }

    /// Each head's value projection of its attended latents `[H, M, r]`, then `o_proj`.
    fn output(&self, o_lat: &Tensor) -> Result<Tensor> {
        let (h, m, _) = o_lat.dims3()?;
        let o = o_lat.matmul(&self.w_uv)?; // [H, M, v]
        let o = o
            .transpose(0, 1)?
            .contiguous()?
            .reshape((1, m, h * self.v))?;
        Ok(self.o.forward(&o)?)
    }

    /// Every causal key: `qa [H, T, W]` against `latent [Tk, W]`; `[H, T, r]`.
    fn attend_all(&self, qa: &Tensor, latent: &Tensor, pos: usize) -> Result<Tensor> {
        let (h, t, w) = qa.dims3()?;
        let r = self.rank;
        let tk = latent.dims()[0];
        if t == 1 && latent.device().is_cpu() {
            // one query: the cache read in place, key and value alike
            let kv = latent.reshape((1, 1, tk, w))?;
            let q = qa.reshape((1, h, w))?;
            let o = fp8nsa_ops::nsa::decode_attention(&q, &kv, &kv, self.scale)?;
            return Ok(o.narrow(2, 0, r)?.reshape((h, 1, r))?);
        }
        let s = (qa.reshape((h * t, w))?.matmul(&latent.t()?)? * self.scale as f64)?;
        let mask: Vec<f32> = (0..h * t)
            .flat_map(|row| {
                let i = row % t;
                (0..tk).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 })
            })
            .collect();
        let s = (s + Tensor::from_vec(mask, (h * t, tk), latent.device())?)?;
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        let c = latent.narrow(1, 0, r)?.contiguous()?;
        Ok(p.matmul(&c)?.reshape((h, t, r))?)
    }
}

/// One step's MLA projections.
struct Projected {
    /// `[H, M, W]`: each head's query as `[q_nope . W_uk | rotated q_pe]`.
    qa: Tensor,
    /// `[M, W]`: the cache rows `[norm(c) | rotated k_pe]`.
    rows: Tensor,
    /// `[1, M, q_lora_rank]`: the normalized query latent (the indexer's input).
    cq: Option<Tensor>,
}

impl Indexer {
    /// `[d]` with its first `rope_dim` dimensions rotated, for rows `[1, M, n, d]` at `segs`.
    fn rotate(&self, v: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
        let (_, m, n, d) = v.dims4()?;
        let rd = self.rope_dim;
        let pe = self
            .rope
            .apply_segments(&v.narrow(3, 0, rd)?.contiguous()?, segs)?;
        Ok(Tensor::cat(&[&pe, &v.narrow(3, rd, d - rd)?], 3)?.reshape((m * n, d))?)
    }

    /// The index keys `[M, d]` of `x [1, M, hidden]` at `segs`.
    fn keys(&self, x: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
        let (_, m, _) = x.dims3()?;
        let d = self.dims.head_dim;
        let k = self
            .k_norm
            .forward(&self.wk.forward(x)?)?
            .reshape((1, m, 1, d))?;
        self.rotate(&k, segs)
    }

    /// The keys each query of `x [1, T, hidden]` (positions `pos..`, query latent `cq`) keeps
    /// among `keys [pos + T, d]`, or `None` when every query keeps all its causal keys
    /// (`pos + T <= topk`).
    fn select(
        &self,
        x: &Tensor,
        cq: &Tensor,
        keys: &Tensor,
        pos: usize,
    ) -> Result<Option<TokenSelection>> {
        let (_, t, _) = x.dims3()?;
        let IndexerDims {
            heads,
            head_dim: d,
            topk,
        } = self.dims;
        if pos + t <= topk {
            return Ok(None);
        }
        let _span = tracing::debug_span!("fp8nsa::dsa_indexer", t, keys = pos + t).entered();
        let q = self.wq_b.forward(cq)?.reshape((1, t, heads, d))?;
        let q = self.rotate(&q, &[(pos, t)])?; // [T · heads, d]
        let wts =
            (self.weights_proj.forward(x)? * ((heads as f64).powf(-0.5) * (d as f64).powf(-0.5)))?;
        let score = fp8nsa_ops::nsa::index_scores(
            &q.reshape((t, heads, d))?,
            &wts.reshape((t, heads))?,
            keys,
        )?;
        let score: Vec<Vec<f32>> = score.to_vec2()?;
        let lists: Vec<Vec<i32>> = score
            .iter()
            .enumerate()
            .map(|(i, sc)| {
                let vis = pos + i + 1;
                let mut keys: Vec<i32> = (0..vis as i32).collect();
                if vis > topk {
                    let by = |a: &i32, b: &i32| {
                        sc[*b as usize].total_cmp(&sc[*a as usize]).then(a.cmp(b))
                    };
                    keys.select_nth_unstable_by(topk - 1, by);
                    keys.truncate(topk);
                }
                keys
            })
            .collect();
        let width = lists.iter().map(Vec::len).max().unwrap_or(1);
        let mut idx = vec![-1i32; t * width];
        for (i, l) in lists.iter().enumerate() {
            idx[i * width..i * width + l.len()].copy_from_slice(l);
        }
        let idx = Tensor::from_vec(idx, (1, t, 1, width), x.device())?;
        Ok(Some(TokenSelection::new(idx)?))
    }
}

impl Llama {
    /// DeepSeek-V3, or V3.2 when `cfg` has the indexer fields, from weights in the published
    /// layout (see [`DeepSeekConfig`]); [`crate::Model::load_hf`] does this for a checkpoint.
    pub fn deepseek(cfg: &DeepSeekConfig, w: &Weights, opts: &ModelOptions) -> Result<Self> {
        build(cfg, w, opts, cfg.indexer().is_some())
    }
}

/// Builds a DeepSeek-V3 (`v32` false) or V3.2 model from checkpoint tensors in the published
/// layout. `model.layers.{num_hidden_layers}` (the multi-token-prediction module) is not read.
pub(crate) fn build(
    cfg: &DeepSeekConfig,
    w: &Weights,
    opts: &ModelOptions,
    v32: bool,
) -> Result<Llama> {
    cfg.validate(v32)?;
    let v3_only;
    let cfg = if !v32 && cfg.indexer().is_some() {
        // a V3 config never has one; V3.2 weights under the V3 type run without it
        tracing::warn!("deepseek_v3 config with index_* fields: the indexer is not used");
        v3_only = DeepSeekConfig {
            index_n_heads: None,
            index_head_dim: None,
            index_topk: None,
            ..cfg.clone()
        };
        &v3_only
    } else {
        cfg
    };
    if matches!(opts.attention, crate::AttentionKind::Nsa(_)) {
        return Err(invalid(
            "attention",
            "DeepSeek models run MLA (and V3.2 its own sparse attention), not the NSA variant",
        ));
    }
    // layer num_hidden_layers is the multi-token-prediction module: allowed, not read
    let n = cfg.num_hidden_layers;
    check_layer_count(w, n, 1)?;
    let keep_dense = keep_dense(opts, w);
    let scaling = cfg.rope()?;
    let eps = cfg.rms_norm_eps;
    let hidden = cfg.hidden_size;
    let norm = |name: &str| -> Result<RmsNorm> {
        let t = w.get(name)?;
        if t.dims() != [hidden] {
            return Err(invalid(
                "weights",
                format!("{name} is {:?}, expected [{hidden}]", t.dims()),
            ));
        }
        Ok(RmsNorm::new(t, eps))
    };
    let swiglu = |pre: &str, i: usize| -> Result<Mlp> {
        let lin = |n: &str, want: [usize; 2]| -> Result<Linear> {
            let name = format!("{pre}.{n}");
            let l = Linear::build(w, &name, opts.linear, keep_dense(&name))?;
            expect_shape(&name, &l, want)?;
            Ok(l)
        };
        Ok(Mlp::Dense {
            gate: lin("gate_proj", [i, hidden])?,
            up: lin("up_proj", [i, hidden])?,
            down: lin("down_proj", [hidden, i])?,
        })
    };
    let mut blocks = Vec::with_capacity(n);
    for l in 0..n {
        let p = format!("model.layers.{l}");
        let mlp = if cfg.is_moe_layer(l) {
            let e = cfg.n_routed_experts.unwrap_or(0);
            let router = w.get(&format!("{p}.mlp.gate.weight"))?;
            if router.dims() != [e, hidden] {
                return Err(invalid(
                    "n_routed_experts",
                    format!(
                        "{p}.mlp.gate.weight is {:?}, the config says [{e}, {hidden}]",
                        router.dims()
                    ),
                ));
            }
            let router = MoeRouter::sigmoid_grouped(
                router,
                cfg.num_experts_per_tok.unwrap_or(0),
                cfg.norm_topk_prob,
                w.get(&format!("{p}.mlp.gate.e_score_correction_bias"))?,
                cfg.n_group,
                cfg.topk_group,
                cfg.routed_scaling_factor as f32,
            )?;
            let mi = cfg.moe_intermediate_size;
            let experts = (0..e)
                .map(|x| match swiglu(&format!("{p}.mlp.experts.{x}"), mi)? {
                    Mlp::Dense { gate, up, down } => Ok([gate, up, down]),
                    _ => unreachable!("swiglu builds a dense MLP"),
                })
                .collect::<Result<Vec<_>>>()?;
            let routed = experts_mlp(router, experts)?;
            match cfg.n_shared_experts.filter(|&s| s > 0) {
                Some(s) => Mlp::Shared {
                    routed: Box::new(routed),
                    shared: Box::new(swiglu(&format!("{p}.mlp.shared_experts"), mi * s)?),
                },
                None => routed,
            }
        } else {
            swiglu(&format!("{p}.mlp"), cfg.intermediate_size)?
        };
        let attn = Mla::new(
            cfg,
            w,
            &format!("{p}.self_attn"),
            opts,
            &keep_dense,
            &scaling,
        )?;
        blocks.push(Block {
            ln1: norm(&format!("{p}.input_layernorm.weight"))?,
            attn: Mixer::Mla(Box::new(attn)),
            ln2: norm(&format!("{p}.post_attention_layernorm.weight"))?,
            mlp,
        });
    }
    let dcfg = cfg.decoder_config();
    let embed_w = w.get("model.embed_tokens.weight")?;
    if embed_w.dims() != [cfg.vocab_size, hidden] {
        return Err(invalid(
            "weights",
            format!(
                "model.embed_tokens.weight is {:?}, the config says [{}, {hidden}]",
                embed_w.dims(),
                cfg.vocab_size
            ),
        ));
    }
    let lm_head = build_head(&dcfg, w, &embed_w, opts, &keep_dense)?;
    expect_shape("lm_head", &lm_head, [cfg.vocab_size, hidden])?;
    Ok(Llama {
        embed: Embedding::new(embed_w, hidden),
        blocks,
        norm: norm("model.norm.weight")?,
        lm_head,
        rope: Rope::new(&dcfg)?,
        cfg: dcfg,
    })
}
