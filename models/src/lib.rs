//! fp8nsa-models: a Llama-family decoder whose linear layers and attention are pluggable
//! (`LinearKind::{Dense, Fp8}`, `AttentionKind::{Dense, Nsa}`), with a KV cache, greedy / top-p
//! generation, and loaders for Hugging Face safetensors checkpoints (fp8 ones included), GGUF
//! files (dequantized on load) and seeded random weights.
//!
//! ```
//! use fp8nsa_models::{AttentionKind, LinearKind, Llama, LlamaConfig, ModelOptions, Weights};
//!
//! let cfg = LlamaConfig::tiny();
//! let weights = Weights::random(&cfg, 42)?;
//! let model = Llama::new(&cfg, &weights, &ModelOptions::default())?;
//! let mut cache = model.new_cache();
//! let logits = model.forward(&[1, 2, 3], &mut cache)?; // [3, vocab]
//! assert_eq!(logits.dims(), &[3, cfg.vocab_size]);
//! # Ok::<(), fp8nsa_models::Error>(())
//! ```

mod attention;
mod config;
mod deepseek;
mod engine;
mod error;
pub mod eval;
mod generate;
mod linear;
mod llama;
pub mod locate;
mod model;
mod paged;
mod rope;
mod shards;
pub mod tokenizer;
mod weights;

pub use attention::AttentionKind;
pub use config::{LlamaConfig, ModelOptions, MoeConfig, RopeStyle};
pub use deepseek::{DeepSeekConfig, IndexerDims};
pub use engine::{Engine, EngineConfig, EngineStats, Event, FinishReason, Request};
pub use error::{Error, Result};
pub use generate::{generate, perplexity, Sampling};
pub use linear::{Linear, LinearKind};
pub use llama::{BatchSeq, Cache, Llama, Logits};
pub use model::{Model, SUPPORTED_MODEL_TYPES};
pub use paged::{KvPool, SeqKv};
pub use rope::RopeScaling;
pub use weights::Weights;
