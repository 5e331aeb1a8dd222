//! One entry point for a Hugging Face model directory, dispatching on `config.json`'s
//! `model_type`.

use std::path::Path;

use candle_core::{DType, Tensor};

use crate::config::ModelOptions;
use crate::error::{invalid, Error, Result};
use crate::llama::{BatchSeq, Cache, Llama, Logits};
use crate::paged::KvPool;
use crate::weights::Weights;

/// The `model_type`s [`Model::load_hf`] runs.
pub const SUPPORTED_MODEL_TYPES: [&str; 5] =
    ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32"];

/// A decoder loaded from a Hugging Face directory (`config.json` + `*.safetensors`, fp8
/// checkpoints included): Llama 1-3 (RoPE scaling included), Qwen3 (its per-head q/k RMSNorm)
/// and Qwen3-MoE (MoE layers as [`fp8nsa_ops::Fp8Moe`] over fp8 experts) all run as [`Llama`],
/// which picks up `q_norm` / `k_norm` and MoE layers where the config and weights have them.
/// DeepSeek-V3 (`deepseek_v3`) and V3.2 (`deepseek_v32`) run on the same decoder with
/// multi-head latent attention, sigmoid group-limited MoE and, for V3.2, the DSA indexer
/// ([`DeepSeekConfig`](crate::DeepSeekConfig)); their multi-token-prediction layer is not read.
///
/// ```no_run
/// use fp8nsa_models::{Model, ModelOptions};
///
/// // e.g. a Qwen/Qwen3-0.6B-FP8 snapshot: fp8 weights with bf16 block scales stay fp8
/// let model = Model::load_hf("Qwen3-0.6B-FP8/".as_ref(), &ModelOptions::default())?;
/// let mut cache = model.new_cache();
/// let logits = model.forward(&[9707, 11, 1879], &mut cache)?; // [3, vocab], f32
/// assert_eq!(logits.dims()[0], 3);
/// # Ok::<(), fp8nsa_models::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Model {
    model_type: String,
    inner: Llama,
}

impl Model {
    /// Loads `dir`; `opts` applies to every architecture (linear and attention kinds,
    /// `modules_to_not_convert`).
    pub fn load_hf(dir: &Path, opts: &ModelOptions) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::File {
            path: cfg_path.clone(),
            msg: e.to_string(),
        })?;
        let raw: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::File {
            path: cfg_path.clone(),
            msg: e.to_string(),
        })?;
        let model_type = raw
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| invalid("model_type", "config.json has no `model_type`"))?
            .to_string();
        if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(invalid(
                "model_type",
                format!(
                    "`{model_type}` is not supported (supported: {})",
                    SUPPORTED_MODEL_TYPES.join(", ")
                ),
            ));
        }
        if model_type.starts_with("deepseek") {
            let cfg: crate::DeepSeekConfig =
                serde_json::from_value(raw.clone()).map_err(|e| Error::File {
                    path: cfg_path.clone(),
                    msg: e.to_string(),
                })?;
            let weights = Weights::open_hf_dir(dir, &raw)?;
            let inner = crate::deepseek::build(&cfg, &weights, opts, model_type == "deepseek_v32")?;
            return Ok(Self { model_type, inner });
        }
        let (cfg, weights) = Weights::load_hf_dir(dir)?;
        if model_type.starts_with("qwen3") {
            for l in 0..cfg.num_hidden_layers {
                let name = format!("model.layers.{l}.self_attn.q_norm.weight");
                if !weights.contains(&name) {
                    return Err(invalid(
                        "weights",
                        format!("a {model_type} checkpoint needs {name} (Qwen3's q/k norms)"),
                    ));
                }
            }
        }
        Ok(Self {
            model_type,
            inner: Llama::new(&cfg, &weights, opts)?,
        })
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(&self) -> &str {
        &self.model_type
    }

    /// The decoder itself (configuration, fp8 layer count).
    pub fn llama(&self) -> &Llama {
        &self.inner
    }

    /// [`Llama::new_cache`].
    pub fn new_cache(&self) -> Cache {
        self.inner.new_cache()
    }

    /// [`Llama::new_cache_with`]: keys and values kept as `kv_dtype`.
    pub fn new_cache_with(&self, kv_dtype: DType) -> Result<Cache> {
        self.inner.new_cache_with(kv_dtype)
    }

    /// Logits `[T, vocab]` (f32) of `tokens`, appended to what `cache` has seen.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache) -> Result<Tensor> {
        self.inner.forward(tokens, cache)
    }

    /// [`Llama::new_kv_pool`].
    pub fn new_kv_pool(&self, pages: usize, page_size: usize, dtype: DType) -> Result<KvPool> {
        self.inner.new_kv_pool(pages, page_size, dtype)
    }

    /// [`Llama::forward_batch`]: one ragged step over several sequences' pages.
    pub fn forward_batch(
        &self,
        pool: &KvPool,
        batch: &mut [BatchSeq<'_>],
        logits: Logits,
    ) -> Result<Vec<Tensor>> {
        self.inner.forward_batch(pool, batch, logits)
    }
}
