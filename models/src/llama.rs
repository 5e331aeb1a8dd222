use candle_core::{Device, Module, Tensor};
use candle_nn::{Embedding, RmsNorm};

use crate::attention::{Attention, AttnCache, Rope};
use crate::config::{LlamaConfig, ModelOptions};
use crate::error::Result;
use crate::linear::{Linear, LinearKind};
use crate::weights::Weights;

#[derive(Clone, Debug)]
struct Block {
    ln1: RmsNorm,
    attn: Attention,
    ln2: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied or untied head) on
/// the CPU, batch 1, f32 activations.
#[derive(Clone, Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
}

/// Decode state of every layer.
#[derive(Clone, Debug)]
pub struct Cache {
    layers: Vec<AttnCache>,
    pos: usize,
}

impl Cache {
    /// Tokens seen.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
}

impl Llama {
    /// Builds the model; `on_layer(done, total)` reports progress (quantizing on load takes a
    /// moment on big models).
    pub fn new(cfg: &LlamaConfig, w: &Weights, opts: &ModelOptions) -> Result<Self> {
        Self::with_progress(cfg, w, opts, &mut |_, _| {})
    }

    pub fn with_progress(
        cfg: &LlamaConfig,
        w: &Weights,
        opts: &ModelOptions,
        on_layer: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        cfg.validate()?;
        let not_convert: Vec<&String> = opts
            .modules_to_not_convert
            .iter()
            .chain(&w.modules_to_not_convert)
            .collect();
        let keep_dense = |name: &str| {
            not_convert
                .iter()
                .any(|m| name == m.as_str() || name.starts_with(&format!("{m}.")))
        };
        let eps = cfg.rms_norm_eps;
        let norm = |n: &str| -> Result<RmsNorm> { Ok(RmsNorm::new(w.get(n)?, eps)) };
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let lin = |n: &str| {
                let name = format!("{p}.mlp.{n}");
                Linear::build(w, &name, opts.linear, keep_dense(&name))
            };
            blocks.push(Block {
                ln1: norm(&format!("{p}.input_layernorm.weight"))?,
                attn: Attention::new(cfg, w, &format!("{p}.self_attn"), opts, &keep_dense)?,
                ln2: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                gate: lin("gate_proj")?,
                up: lin("up_proj")?,
                down: lin("down_proj")?,
            });
            on_layer(l + 1, cfg.num_hidden_layers);
        }
        let embed_w = w.get("model.embed_tokens.weight")?;
        let head_kind = if opts.fp8_lm_head {
            opts.linear
        } else {
            LinearKind::Dense
        };
        let lm_head = if cfg.tie_word_embeddings || w.get_opt("lm_head.weight").is_none() {
            let mut tied =
                Weights::from_tensors([("lm_head.weight".to_string(), embed_w.clone())].into());
            tied.fp8_block = w.fp8_block;
            Linear::build(&tied, "lm_head", head_kind, keep_dense("lm_head"))?
        } else {
            Linear::build(w, "lm_head", head_kind, keep_dense("lm_head"))?
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed: Embedding::new(embed_w, cfg.hidden_size),
            blocks,
            norm: norm("model.norm.weight")?,
            lm_head,
            rope: Rope::new(cfg)?,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// How many projections (output head included) run as [`Linear::Fp8`].
    pub fn fp8_layer_count(&self) -> usize {
        let fp8 = |l: &Linear| matches!(l, Linear::Fp8(_)) as usize;
        fp8(&self.lm_head)
            + self
                .blocks
                .iter()
                .map(|b| {
                    b.attn.projections().iter().map(|l| fp8(l)).sum::<usize>()
                        + fp8(&b.gate)
                        + fp8(&b.up)
                        + fp8(&b.down)
                })
                .sum::<usize>()
    }

    pub fn new_cache(&self) -> Cache {
        Cache {
            layers: self.blocks.iter().map(|b| b.attn.new_cache()).collect(),
            pos: 0,
        }
    }

    /// Logits `[T, vocab]` (f32) of `tokens`, appended to what `cache` has seen.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache) -> Result<Tensor> {
        // The step runs on a thread of the rayon pool its kernels use, so each parallel kernel
        // starts on a running worker with the caller's thread taking part. Called from outside
        // the pool, every kernel would instead queue its work, wake the workers and put the
        // caller to sleep until they finish: hundreds of hand-offs per decode step.
        rayon::scope(|_| self.forward_in_pool(tokens, cache))
    }

    fn forward_in_pool(&self, tokens: &[u32], cache: &mut Cache) -> Result<Tensor> {
        let t = tokens.len();
        if t == 0 {
            return Err(crate::error::invalid("tokens", "needs at least one token"));
        }
        if let Some(&bad) = tokens
            .iter()
            .find(|&&id| id as usize >= self.cfg.vocab_size)
        {
            return Err(crate::error::invalid(
                "tokens",
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.cfg.vocab_size
                ),
            ));
        }
        let ids = Tensor::from_vec(tokens.to_vec(), (1, t), &Device::Cpu)?;
        let mut x = self.embed.forward(&ids)?;
        let _span = tracing::debug_span!("fp8nsa::llama_forward", t, pos = cache.pos).entered();
        for (b, c) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            let h = b
                .attn
                .forward(&b.ln1.forward(&x)?, cache.pos, &self.rope, c)?;
            x = (x + h)?;
            let y = b.ln2.forward(&x)?;
            let m = b
                .down
                .forward(&(candle_nn::ops::silu(&b.gate.forward(&y)?)? * b.up.forward(&y)?)?)?;
            x = (x + m)?;
        }
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?.squeeze(0)?;
        // the whole step succeeded: the positions each layer wrote now count
        for c in cache.layers.iter_mut() {
            c.commit(t);
        }
        cache.pos += t;
        Ok(logits)
    }
}
