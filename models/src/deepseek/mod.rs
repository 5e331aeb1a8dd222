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

mod config;
mod indexer;
mod mla;

pub use config::{DeepSeekConfig, IndexerDims};
pub(crate) use mla::{Mla, MlaCache};

use candle_nn::{Embedding, RmsNorm};
use fp8nsa_ops::MoeRouter;

use crate::attention::Rope;
use crate::config::ModelOptions;
use crate::error::{invalid, Result};
use crate::linear::Linear;
use crate::llama::{
    build_head, check_layer_count, experts_mlp, keep_dense, Block, Llama, Mixer, Mlp,
};
use crate::weights::Weights;

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
    let w = &*opts.placed(w);
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
            // published checkpoints keep the router bf16; one stored fp8 is dequantized
            let router = w.dense(&format!("{p}.mlp.gate"))?;
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
