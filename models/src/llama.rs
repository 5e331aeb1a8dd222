use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, RmsNorm};

use crate::attention::{Attention, AttnCache, Rope};
use crate::config::{LlamaConfig, ModelOptions};
use crate::deepseek::{Mla, MlaCache};
use crate::error::{invalid, Result};
use crate::linear::{swiglu, Linear, LinearKind};
use crate::paged::{KvPool, LayerKv, SeqKv, Store};
use crate::weights::Weights;
use fp8nsa_ops::{Fp8BlockWeight, Fp8Experts, Fp8Moe, MoeRouter};

#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub(crate) ln1: RmsNorm,
    pub(crate) attn: Mixer,
    pub(crate) ln2: RmsNorm,
    pub(crate) mlp: Mlp,
}

/// A layer's token mixer: grouped-query attention (dense or NSA), or DeepSeek's multi-head
/// latent attention.
#[derive(Clone, Debug)]
pub(crate) enum Mixer {
    Gqa(Box<Attention>),
    Mla(Box<Mla>),
}

impl Mixer {
    fn forward(
        &self,
        x: &Tensor,
        pos: usize,
        rope: &Rope,
        cache: &mut AttnCache,
    ) -> Result<Tensor> {
        match (self, cache) {
            (Mixer::Mla(m), AttnCache::Mla(c)) => m.forward(x, pos, c),
            (Mixer::Gqa(a), c) => a.forward(x, pos, rope, c),
            (Mixer::Mla(_), _) => Err(invalid("cache", "built for another attention kind")),
        }
    }

    fn new_cache(&self, kv_dtype: DType) -> AttnCache {
        match self {
            Mixer::Gqa(a) => a.new_cache(kv_dtype),
            Mixer::Mla(_) => AttnCache::Mla(MlaCache::default()),
        }
    }

    fn projections(&self) -> Vec<&Linear> {
        match self {
            Mixer::Gqa(a) => a.projections().to_vec(),
            Mixer::Mla(m) => m.projections(),
        }
    }

    /// What the layer keeps per token in a [`KvPool`].
    fn kv_layout(&self) -> Result<LayerKv> {
        match self {
            Mixer::Gqa(a) => a.kv_layout(),
            Mixer::Mla(m) => Ok(m.kv_layout()),
        }
    }

    fn nsa_config(&self) -> Option<&fp8nsa_ops::nsa::NsaConfig> {
        match self {
            Mixer::Gqa(a) => a.nsa_config(),
            Mixer::Mla(_) => None,
        }
    }

    fn forward_batch(
        &self,
        x: &Tensor,
        segs: &[(usize, usize)],
        rope: &Rope,
        layer: usize,
        pool: &KvPool,
        seqs: &mut [&mut SeqKv],
    ) -> Result<Tensor> {
        match self {
            Mixer::Gqa(a) => a.forward_batch(x, segs, rope, layer, pool, seqs),
            Mixer::Mla(m) => m.forward_batch(x, segs, layer, pool, seqs),
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Mlp {
    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Qwen3-MoE: a dense router over fp8 experts (one grouped call per projection).
    Moe(Fp8Moe),
    /// Qwen3-MoE with dense (or mixed) experts: the same routing, then a loop of per-expert
    /// SwiGLU MLPs, as a plain candle model runs it (the dense baseline).
    MoeLoop {
        router: MoeRouter,
        /// `[gate, up, down]` per expert.
        experts: Vec<[Linear; 3]>,
    },
    /// DeepSeek's MoE: the routed experts plus shared experts every token runs.
    Shared { routed: Box<Mlp>, shared: Box<Mlp> },
}

impl Mlp {
    fn forward(&self, y: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Mlp::Dense { gate, up, down } => down.forward(&swiglu(gate, up, y)?)?,
            Mlp::Moe(moe) => moe.forward(y)?,
            Mlp::Shared { routed, shared } => (routed.forward(y)? + shared.forward(y)?)?,
            Mlp::MoeLoop { router, experts } => {
                let (x2, r) = router.group(y)?;
                let xp = x2.index_select(&r.rows, 0)?;
                let mut parts = Vec::new();
                let mut r0 = 0;
                for ([gate, up, down], &c) in experts.iter().zip(&r.counts) {
                    if c > 0 {
                        let xs = xp.narrow(0, r0, c)?;
                        let a = fp8nsa_ops::silu_mul(&gate.forward(&xs)?, &up.forward(&xs)?)?;
                        parts.push(down.forward(&a)?);
                        r0 += c;
                    }
                }
                r.combine(&Tensor::cat(&parts, 0)?)?
                    .reshape(y.dims())?
                    .to_dtype(y.dtype())?
            }
        })
    }

    fn fp8_count(&self) -> usize {
        match self {
            Mlp::Dense { gate, up, down } => [gate, up, down]
                .iter()
                .filter(|l| matches!(l, Linear::Fp8(_)))
                .count(),
            Mlp::Moe(moe) => 3 * moe.num_experts(),
            Mlp::Shared { routed, shared } => routed.fp8_count() + shared.fp8_count(),
            Mlp::MoeLoop { experts, .. } => experts
                .iter()
                .flatten()
                .filter(|l| matches!(l, Linear::Fp8(_)))
                .count(),
        }
    }
}

/// The MoE block of layer prefix `p`: router `{p}.mlp.gate.weight` (dense), experts
/// `{p}.mlp.experts.{e}.{gate,up,down}_proj`, each built as `opts.linear` says (stored fp8 stays
/// fp8). All fp8: the grouped `Fp8Moe`; otherwise the per-expert loop.
fn moe_block(
    cfg: &LlamaConfig,
    w: &Weights,
    p: &str,
    opts: &ModelOptions,
    keep_dense: &dyn Fn(&str) -> bool,
) -> Result<Mlp> {
    let m = &cfg.moe;
    // the router stays dense in published checkpoints; one quantized anyway is dequantized
    let router = w.dense(&format!("{p}.mlp.gate"))?;
    if router.dims() != [m.num_experts, cfg.hidden_size] {
        return Err(crate::error::invalid(
            "num_experts",
            format!(
                "{p}.mlp.gate.weight is {:?}, the config says [{}, {}]",
                router.dims(),
                m.num_experts,
                cfg.hidden_size
            ),
        ));
    }
    let experts = (0..m.num_experts)
        .map(|e| {
            let build = |proj: &str| {
                let name = format!("{p}.mlp.experts.{e}.{proj}");
                Linear::build(w, &name, opts.linear, keep_dense(&name))
            };
            Ok([build("gate_proj")?, build("up_proj")?, build("down_proj")?])
        })
        .collect::<Result<Vec<_>>>()?;
    experts_mlp(
        MoeRouter::new(router, m.num_experts_per_tok, m.norm_topk_prob)?,
        experts,
    )
}

/// Routed experts (`[gate, up, down]` each) behind `router`: all fp8, the grouped [`Fp8Moe`];
/// otherwise the per-expert loop.
pub(crate) fn experts_mlp(router: MoeRouter, experts: Vec<[Linear; 3]>) -> Result<Mlp> {
    let fp8 = |i: usize| -> Option<(Vec<Fp8BlockWeight>, fp8nsa_ops::ActQuant)> {
        let mut act = None;
        let ws = experts
            .iter()
            .map(|ex| match &ex[i] {
                Linear::Fp8(l) => {
                    act = Some(l.act());
                    Some(l.weight().clone())
                }
                Linear::Dense(_) => None,
            })
            .collect::<Option<Vec<_>>>()?;
        Some((ws, act?))
    };
    if let (Some(g), Some(u), Some(d)) = (fp8(0), fp8(1), fp8(2)) {
        let stack = |(ws, act): (Vec<Fp8BlockWeight>, _)| Fp8Experts::new(&ws, act);
        return Ok(Mlp::Moe(Fp8Moe::with_router(
            router,
            stack(g)?,
            stack(u)?,
            stack(d)?,
        )?));
    }
    Ok(Mlp::MoeLoop { router, experts })
}

/// The output head: the checkpoint's `lm_head` or the embeddings as `cfg.tie_word_embeddings`
/// says, dense unless `opts.fp8_lm_head`.
pub(crate) fn build_head(
    cfg: &LlamaConfig,
    w: &Weights,
    embed_w: &Tensor,
    opts: &ModelOptions,
    keep_dense: &dyn Fn(&str) -> bool,
) -> Result<Linear> {
    let head_kind = if opts.fp8_lm_head {
        opts.linear
    } else {
        LinearKind::Dense
    };
    // untied: the checkpoint's own head, never the embeddings in its place
    let has_head = w.contains("lm_head.weight");
    if cfg.tie_word_embeddings == Some(false) && !has_head {
        return Err(invalid(
            "lm_head.weight",
            "missing: the config says tie_word_embeddings = false, so the checkpoint \
             needs its own head",
        ));
    }
    if cfg.tie_word_embeddings.unwrap_or(!has_head) {
        let mut tied =
            Weights::from_tensors([("lm_head.weight".to_string(), embed_w.clone())].into());
        tied.fp8_block = w.fp8_block;
        Linear::build(&tied, "lm_head", head_kind, keep_dense("lm_head"))
    } else {
        Linear::build(w, "lm_head", head_kind, keep_dense("lm_head"))
    }
}

/// A Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied or untied head) on
/// the CPU, batch 1, f32 activations.
#[derive(Clone, Debug)]
pub struct Llama {
    pub(crate) cfg: LlamaConfig,
    pub(crate) embed: Embedding,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Linear,
    pub(crate) rope: Rope,
}

/// Decode state of every layer.
#[derive(Debug)]
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

    /// Floats the cache keeps per token, summed over layers (keys and values of dense
    /// attention, the latent row of MLA plus V3.2's index key); `None` for NSA layers, whose
    /// compressed pages are not per token.
    pub fn floats_per_token(&self) -> Option<usize> {
        self.layers.iter().map(AttnCache::floats_per_token).sum()
    }

    /// An independent copy (to branch a conversation): the caches are written in place, so a
    /// copy holds its own buffers. Fails, typed, where allocating them does.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            layers: self
                .layers
                .iter()
                .map(AttnCache::try_clone)
                .collect::<Result<_>>()?,
            pos: self.pos,
        })
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
        let w = &*opts.placed(w);
        check_weights_match(cfg, w)?;
        let keep_dense = keep_dense(opts, w);
        let eps = cfg.rms_norm_eps;
        let norm = |n: &str| -> Result<RmsNorm> { Ok(RmsNorm::new(w.get(n)?, eps)) };
        let mut blocks = Vec::new();
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let lin = |n: &str| {
                let name = format!("{p}.mlp.{n}");
                Linear::build(w, &name, opts.linear, keep_dense(&name))
            };
            let mlp = if cfg.moe.is_moe_layer(l) {
                moe_block(cfg, w, &p, opts, &keep_dense)?
            } else {
                Mlp::Dense {
                    gate: lin("gate_proj")?,
                    up: lin("up_proj")?,
                    down: lin("down_proj")?,
                }
            };
            blocks.push(Block {
                ln1: norm(&format!("{p}.input_layernorm.weight"))?,
                attn: Mixer::Gqa(Box::new(Attention::new(
                    cfg,
                    w,
                    &format!("{p}.self_attn"),
                    opts,
                    &keep_dense,
                )?)),
                ln2: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                mlp,
            });
            on_layer(l + 1, cfg.num_hidden_layers);
        }
        let embed_w = w.get("model.embed_tokens.weight")?;
        let lm_head = build_head(cfg, w, &embed_w, opts, &keep_dense)?;
        Ok(Self {
            cfg: cfg.clone(),
            embed: Embedding::new(embed_w, cfg.hidden_size),
            blocks,
            norm: norm("model.norm.weight")?,
            lm_head,
            rope: Rope::new(cfg)?,
        })
    }

    /// Where the model runs ([`ModelOptions::device`]).
    ///
    /// ```
    /// use candle_core::Device;
    /// use fp8nsa_models::{Llama, LlamaConfig, ModelOptions, Weights};
    ///
    /// let cfg = LlamaConfig::tiny();
    /// let opts = ModelOptions { device: Some(Device::Cpu), ..ModelOptions::default() };
    /// let model = Llama::new(&cfg, &Weights::random(&cfg, 1)?, &opts)?;
    /// assert!(model.device().is_cpu());
    /// # Ok::<(), fp8nsa_models::Error>(())
    /// ```
    pub fn device(&self) -> &Device {
        self.embed.embeddings().device()
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// How many projections (output head included, each expert of an MoE layer counted) run
    /// in fp8.
    pub fn fp8_layer_count(&self) -> usize {
        let fp8 = |l: &Linear| matches!(l, Linear::Fp8(_)) as usize;
        fp8(&self.lm_head)
            + self
                .blocks
                .iter()
                .map(|b| {
                    b.attn.projections().into_iter().map(fp8).sum::<usize>() + b.mlp.fp8_count()
                })
                .sum::<usize>()
    }

    /// An empty decode state for [`Self::forward`], keys and values in f32.
    pub fn new_cache(&self) -> Cache {
        self.empty_cache(DType::F32)
    }

    /// Every layer's empty state, dense keys and values as `kv_dtype` (checked by the caller).
    fn empty_cache(&self, kv_dtype: DType) -> Cache {
        Cache {
            layers: self
                .blocks
                .iter()
                .map(|b| b.attn.new_cache(kv_dtype))
                .collect(),
            pos: 0,
        }
    }

    /// [`Self::new_cache`] keeping dense attention's keys and values as `kv_dtype`: F32, or
    /// F16 / BF16 (a 16-bit cache, as llama.cpp keeps by default and [`Self::new_kv_pool`]
    /// offers the serving step: half the bytes each decode step reads, each row rounded once
    /// when written, the attention itself in f32). NSA and MLA layers keep f32: a 16-bit type
    /// for them is [`crate::Error::Invalid`] naming `kv_dtype`, as is any other type.
    ///
    /// ```
    /// use candle_core::DType;
    /// use fp8nsa_models::{Llama, LlamaConfig, ModelOptions, Weights};
    ///
    /// let cfg = LlamaConfig::tiny();
    /// let model = Llama::new(&cfg, &Weights::random(&cfg, 3)?, &ModelOptions::default())?;
    /// let tokens = [1, 2, 3, 4];
    /// let f32_logits = model.forward(&tokens, &mut model.new_cache())?;
    /// let f16_logits = model.forward(&tokens, &mut model.new_cache_with(DType::F16)?)?;
    /// let diff = (&f32_logits - &f16_logits)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// let top = f32_logits.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff <= 1e-2 * top);
    /// assert!(model.new_cache_with(DType::U8).is_err());
    /// # Ok::<(), fp8nsa_models::Error>(())
    /// ```
    pub fn new_cache_with(&self, kv_dtype: DType) -> Result<Cache> {
        let layers = self
            .blocks
            .iter()
            .map(|b| b.attn.kv_layout())
            .collect::<Result<Vec<_>>>()?;
        crate::paged::check_kv_dtype(&layers, kv_dtype)?;
        Ok(self.empty_cache(kv_dtype))
    }

    /// Logits `[T, vocab]` (f32) of `tokens`, appended to what `cache` has seen.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache) -> Result<Tensor> {
        self.forward_logits(tokens, cache, Logits::All)
    }

    /// [`Self::forward`] with the logits `which` asks for: [`Logits::Last`] gives `[1, vocab]`
    /// for the last token only (what sampling after a prompt needs: the head, a fifth of
    /// SmolLM2's prefill work, runs over one row instead of all of them).
    ///
    /// ```
    /// use fp8nsa_models::{Llama, LlamaConfig, Logits, ModelOptions, Weights};
    ///
    /// let cfg = LlamaConfig::tiny();
    /// let model = Llama::new(&cfg, &Weights::random(&cfg, 7)?, &ModelOptions::default())?;
    /// let (mut a, mut b) = (model.new_cache(), model.new_cache());
    /// let all = model.forward(&[1, 2, 3], &mut a)?;
    /// let last = model.forward_logits(&[1, 2, 3], &mut b, Logits::Last)?;
    /// assert_eq!(last.dims(), &[1, cfg.vocab_size]);
    /// let diff = (all.narrow(0, 2, 1)? - last)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-5);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_logits(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
    ) -> Result<Tensor> {
        // The step runs on a thread of the rayon pool its kernels use, so each parallel kernel
        // starts on a running worker with the caller's thread taking part. Called from outside
        // the pool, every kernel would instead queue its work, wake the workers and put the
        // caller to sleep until they finish: hundreds of hand-offs per decode step. (Only for
        // CPU weights: a CUDA backend keeps per-thread library handles, which steps wandering
        // across workers would multiply.)
        if self.embed.embeddings().device().is_cpu() {
            rayon::scope(|_| self.forward_in_pool(tokens, cache, which))
        } else {
            self.forward_in_pool(tokens, cache, which)
        }
    }

    fn forward_in_pool(&self, tokens: &[u32], cache: &mut Cache, which: Logits) -> Result<Tensor> {
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
        let ids = Tensor::from_vec(tokens.to_vec(), (1, t), self.embed.embeddings().device())?;
        let mut x = self.embed.forward(&ids)?;
        let _span = tracing::debug_span!("fp8nsa::llama_forward", t, pos = cache.pos).entered();
        // each residual add runs with the norm after it: the next layer's, the last the model's
        let mut normed = self.first_norm().forward(&x)?;
        for (i, (b, c)) in self.blocks.iter().zip(cache.layers.iter_mut()).enumerate() {
            let h = b.attn.forward(&normed, cache.pos, &self.rope, c)?;
            let (x1, n2) = add_norm(&x, &h, &b.ln2)?;
            let m = b.mlp.forward(&n2)?;
            (x, normed) = add_norm(&x1, &m, self.norm_after(i))?;
        }
        if which == Logits::Last {
            normed = normed.narrow(1, t - 1, 1)?;
        }
        let logits = self.lm_head.forward(&normed)?.squeeze(0)?;
        // the whole step succeeded: the positions each layer wrote now count
        for c in cache.layers.iter_mut() {
            c.commit(t);
        }
        cache.pos += t;
        Ok(logits)
    }
}

impl Llama {
    /// The norm before layer 0's attention (the model's own without layers).
    fn first_norm(&self) -> &RmsNorm {
        self.blocks.first().map_or(&self.norm, |b| &b.ln1)
    }

    /// The norm after layer `i`'s residual stream: the next layer's first, the model's last.
    fn norm_after(&self, i: usize) -> &RmsNorm {
        self.blocks.get(i + 1).map_or(&self.norm, |b| &b.ln1)
    }
}

/// `(x + h, norm(x + h))` in one op (`fp8nsa_ops::add_rms_norm`).
fn add_norm(x: &Tensor, h: &Tensor, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
    Ok(fp8nsa_ops::add_rms_norm(
        x,
        h,
        norm.weight(),
        norm.eps() as f32,
    )?)
}

/// One sequence of a ragged batch step: its new tokens (a prefill chunk, or one decode token)
/// and its KV pages, which hold everything before them.
#[derive(Debug)]
pub struct BatchSeq<'a> {
    pub tokens: &'a [u32],
    pub kv: &'a mut SeqKv,
}

/// Which positions of a batch step get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Each sequence's last new token: `[1, vocab]` per sequence (what sampling needs; the
    /// head runs over one row per sequence, not over whole prefill chunks).
    Last,
    /// Every new token: `[T_i, vocab]` per sequence.
    All,
}

impl Llama {
    /// KV pools for [`Self::forward_batch`]: `pages` pages of `page_size` tokens in every layer,
    /// on the model's device, holding `dtype`: F32, or F16 / BF16 for dense attention layers (a
    /// 16-bit cache, as llama.cpp keeps by default: half the bytes each decode step reads, the
    /// keys and values rounded once when written; the attention itself stays f32; f16 holds
    /// magnitudes up to 65504, beyond which a key or value becomes inf and its heads NaN:
    /// bf16 keeps f32's range at 8 bits of precision). A server
    /// sizes this once; sequences take pages from it with [`KvPool::new_seq`] and give them
    /// back when dropped. On the CPU its memory is written (committed) here, so no decode step
    /// takes the first-touch page faults of fresh pages.
    pub fn new_kv_pool(&self, pages: usize, page_size: usize, dtype: DType) -> Result<KvPool> {
        let layers = self
            .blocks
            .iter()
            .map(|b| b.attn.kv_layout())
            .collect::<Result<Vec<_>>>()?;
        let device = self.embed.embeddings().device();
        KvPool::new(&layers, pages, page_size, dtype, device)
    }

    /// One step over several sequences of different lengths, each with its own new tokens and
    /// positions (continuous batching): the projections and MLPs run once over all the step's
    /// tokens (MoE routes them together), attention runs per sequence over its pages. Every
    /// sequence gets the logits it would get alone. On an error no sequence changed: each
    /// holds the tokens and pages it held before. A pool without the pages the step needs is
    /// [`fp8nsa_ops::Error::OutOfPages`] (a scheduler checks [`KvPool::free_pages`] first).
    ///
    /// ```
    /// use fp8nsa_models::{BatchSeq, Llama, LlamaConfig, Logits, ModelOptions, Weights};
    ///
    /// let cfg = LlamaConfig::tiny();
    /// let model = Llama::new(&cfg, &Weights::random(&cfg, 1)?, &ModelOptions::default())?;
    /// let pool = model.new_kv_pool(64, 16, candle_core::DType::F32)?;
    /// let (mut a, mut b) = (pool.new_seq(), pool.new_seq());
    /// model.forward_batch(&pool, &mut [BatchSeq { tokens: &[1, 2, 3], kv: &mut a }], Logits::Last)?;
    /// // a decodes its 4th token while b prefills 5
    /// let out = model.forward_batch(
    ///     &pool,
    ///     &mut [BatchSeq { tokens: &[4], kv: &mut a }, BatchSeq { tokens: &[5, 6, 7, 8, 9], kv: &mut b }],
    ///     Logits::Last,
    /// )?;
    /// assert_eq!((a.len(), b.len(), out[1].dims()), (4, 5, &[1, cfg.vocab_size][..]));
    /// drop((a, b)); // their pages go back
    /// assert_eq!(pool.free_pages(), 64);
    /// # Ok::<(), fp8nsa_models::Error>(())
    /// ```
    pub fn forward_batch(
        &self,
        pool: &KvPool,
        batch: &mut [BatchSeq<'_>],
        logits: Logits,
    ) -> Result<Vec<Tensor>> {
        if batch.is_empty() {
            return Err(invalid("batch", "needs at least one sequence"));
        }
        let layers_ok = match &pool.store {
            Store::Dense { layers, .. } => layers.len() == self.blocks.len(),
            Store::Nsa { layers } => layers.len() == self.blocks.len(),
            Store::Latent { layers, .. } => layers.len() == self.blocks.len(),
        };
        if !layers_ok {
            return Err(invalid("kv", "the pool was made for another model"));
        }
        for (i, s) in batch.iter().enumerate() {
            let t = s.tokens.len();
            if t == 0 {
                return Err(invalid("batch", format!("sequence {i} has no new token")));
            }
            if let Some(&bad) = s
                .tokens
                .iter()
                .find(|&&id| id as usize >= self.cfg.vocab_size)
            {
                return Err(invalid(
                    "batch",
                    format!(
                        "sequence {i}: token id {bad} is outside the vocabulary of {}",
                        self.cfg.vocab_size
                    ),
                ));
            }
            let end = s.kv.len().checked_add(t);
            if end.is_none_or(|e| e > self.cfg.max_position_embeddings) {
                return Err(invalid(
                    "batch",
                    format!(
                        "sequence {i}: {} + {t} tokens exceed max_position_embeddings = {}",
                        s.kv.len(),
                        self.cfg.max_position_embeddings
                    ),
                ));
            }
        }
        let before: Vec<usize> = batch.iter().map(|s| s.kv.len()).collect();
        let nsa: Vec<_> = self.blocks.iter().map(|b| b.attn.nsa_config()).collect();
        let roll_back = |batch: &mut [BatchSeq<'_>]| {
            for (s, &len) in batch.iter_mut().zip(&before) {
                s.kv.roll_back(len, pool, &nsa);
            }
        };
        for i in 0..batch.len() {
            let s = &mut batch[i];
            let end = s.kv.len() + s.tokens.len();
            if let Err(e) = pool.reserve(s.kv, end) {
                roll_back(batch);
                return Err(e);
            }
        }
        let run = |batch: &mut [BatchSeq<'_>]| self.batch_in_pool(pool, batch, logits);
        let out = if self.embed.embeddings().device().is_cpu() {
            // as `forward`: the step's kernels start on running pool workers
            rayon::scope(|_| run(batch))
        } else {
            run(batch)
        };
        match out {
            Ok(out) => {
                for s in batch.iter_mut() {
                    s.kv.commit(s.tokens.len());
                }
                Ok(out)
            }
            Err(e) => {
                roll_back(batch);
                Err(e)
            }
        }
    }

    fn batch_in_pool(
        &self,
        pool: &KvPool,
        batch: &mut [BatchSeq<'_>],
        logits: Logits,
    ) -> Result<Vec<Tensor>> {
        let segs: Vec<(usize, usize)> =
            batch.iter().map(|s| (s.kv.len(), s.tokens.len())).collect();
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let m = ids.len();
        let device = self.embed.embeddings().device();
        let mut x = self
            .embed
            .forward(&Tensor::from_vec(ids, (1, m), device)?)?;
        let _span = tracing::debug_span!("fp8nsa::llama_batch", seqs = batch.len(), m).entered();
        let mut seqs: Vec<&mut SeqKv> = batch.iter_mut().map(|s| &mut *s.kv).collect();
        let mut normed = self.first_norm().forward(&x)?;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = b
                .attn
                .forward_batch(&normed, &segs, &self.rope, l, pool, &mut seqs)?;
            let (x1, n2) = add_norm(&x, &h, &b.ln2)?;
            let m = b.mlp.forward(&n2)?;
            (x, normed) = add_norm(&x1, &m, self.norm_after(l))?;
        }
        let x = normed;
        match logits {
            Logits::Last => {
                let mut end = 0u32;
                let rows: Vec<u32> = segs
                    .iter()
                    .map(|&(_, t)| {
                        end += t as u32;
                        end - 1
                    })
                    .collect();
                let rows = Tensor::from_vec(rows, segs.len(), device)?;
                let last = x.squeeze(0)?.index_select(&rows, 0)?.unsqueeze(0)?;
                let all = self.lm_head.forward(&last)?.squeeze(0)?;
                (0..segs.len()).map(|i| Ok(all.narrow(0, i, 1)?)).collect()
            }
            Logits::All => {
                let all = self.lm_head.forward(&x)?.squeeze(0)?;
                let mut off = 0;
                segs.iter()
                    .map(|&(_, t)| {
                        off += t;
                        Ok(all.narrow(0, off - t, t)?)
                    })
                    .collect()
            }
        }
    }
}

/// Whether the linear `name` stays dense: named (or under a module named) in the options' or
/// the checkpoint's `modules_to_not_convert`.
pub(crate) fn keep_dense<'a>(opts: &'a ModelOptions, w: &'a Weights) -> impl Fn(&str) -> bool + 'a {
    move |name: &str| {
        opts.modules_to_not_convert
            .iter()
            .chain(&w.modules_to_not_convert)
            .any(|m| name == m.as_str() || name.starts_with(&format!("{m}.")))
    }
}

/// The config's `n` layers against the `model.layers.{i}` the weights hold: a layer at or past
/// `n + extra` (`extra` layers past the decoder are allowed: DeepSeek's MTP module), or fewer
/// layers than `n` (none at all counting as fewer when `extra` > 0, DeepSeek's rule; a Llama
/// file without layers fails on its first missing tensor instead), is an error naming
/// `num_hidden_layers`.
pub(crate) fn check_layer_count(w: &Weights, n: usize, extra: usize) -> Result<()> {
    let layers: Vec<usize> = w
        .names()
        .filter_map(|name| {
            name.strip_prefix("model.layers.")?
                .split('.')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    let allowed = n.saturating_add(extra);
    let mtp = if extra > 0 { " (+ MTP)" } else { "" };
    let (first_beyond, last) = (
        layers.iter().copied().filter(|&l| l >= allowed).min(),
        layers.iter().copied().max(),
    );
    if let (Some(l), Some(last)) = (first_beyond, last) {
        return Err(invalid(
            "num_hidden_layers",
            format!(
                "the config declares {n} layers{mtp} but the weights hold layer {l} (up to \
                 {last}): num_hidden_layers / block_count disagrees with the file"
            ),
        ));
    }
    let held = last.map(|l| l + 1);
    if held.map_or(extra > 0 && n > 0, |h| n > h) {
        return Err(invalid(
            "num_hidden_layers",
            format!(
                "the config declares {n} layers but the weights hold {}",
                held.unwrap_or(0)
            ),
        ));
    }
    Ok(())
}

/// What the config declares against what the weights hold, before anything is sized from the
/// config: no tensor of a layer past `num_hidden_layers` (a file whose `block_count` says 2
/// but holds 30 layers would otherwise run 2 and say nothing), and a `head_dim` that the
/// query projection's rows agree with (the RoPE tables are sized from it).
fn check_weights_match(cfg: &LlamaConfig, w: &Weights) -> Result<()> {
    check_layer_count(w, cfg.num_hidden_layers, 0)?;
    let q = "model.layers.0.self_attn.q_proj.weight";
    if let Some(dims) = w.dims(q) {
        let want = cfg.num_attention_heads.checked_mul(cfg.head_dim());
        if want != dims.first().copied() {
            return Err(invalid(
                "head_dim",
                format!(
                    "num_attention_heads {} x head_dim {} does not match {q} with {} rows",
                    cfg.num_attention_heads,
                    cfg.head_dim(),
                    dims.first().copied().unwrap_or(0)
                ),
            ));
        }
    }
    Ok(())
}
