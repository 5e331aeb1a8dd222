//! Side-by-side runs of model variants on the same prompt: speed, and how far each variant's
//! logits move from the dense f32 model's. Used by the `fp8nsa` demo and the end-to-end bench.

use std::time::Instant;

use candle_core::{Tensor, D};
use fp8nsa_ops::nsa::NsaConfig;
use fp8nsa_ops::ActQuant;

use crate::attention::AttentionKind;
use crate::config::{LlamaConfig, ModelOptions};
use crate::error::Result;
use crate::linear::LinearKind;
use crate::llama::Llama;
use crate::weights::Weights;

/// A few paragraphs of English written for this repository: the prompt of the demo and the
/// text of the perplexity checks.
pub const SAMPLE_TEXT: &str = include_str!("../data/quality_text.txt");

/// `n` tokens of [`SAMPLE_TEXT`], repeated as needed.
pub fn sample_tokens(tok: &tokenizers::Tokenizer, n: usize) -> Result<Vec<u32>> {
    let ids = crate::tokenizer::encode(tok, SAMPLE_TEXT)?;
    Ok(ids.iter().cycle().take(n).copied().collect())
}

/// A named way to build the model.
#[derive(Clone, Debug)]
pub struct Variant {
    pub name: String,
    pub opts: ModelOptions,
}

/// The NSA setting of the demo: 4 selected blocks of 64 (1 initial, 2 local, 1 by importance),
/// so a 512-token prompt is really sparse; gates fixed to the selection branch (training-free).
pub fn demo_nsa() -> NsaConfig {
    NsaConfig {
        num_selected: 4,
        ..NsaConfig::default()
    }
}

/// Dense f32; fp8 W8A8 (128x128 weight blocks, 1x128 activation groups, the LM head dense);
/// the same with an fp8 LM head; fp8 W8A8 plus NSA.
pub fn standard_variants(nsa: NsaConfig) -> Vec<Variant> {
    let fp8 = LinearKind::Fp8 {
        block: [128, 128],
        act: ActQuant::Group,
    };
    vec![
        Variant {
            name: "dense f32".into(),
            opts: ModelOptions::default(),
        },
        Variant {
            name: "fp8 W8A8".into(),
            opts: ModelOptions {
                linear: fp8,
                ..Default::default()
            },
        },
        Variant {
            name: "fp8 W8A8, fp8 head".into(),
            opts: ModelOptions {
                linear: fp8,
                fp8_lm_head: true,
                ..Default::default()
            },
        },
        Variant {
            name: format!("fp8 W8A8 + NSA ({}x{})", nsa.num_selected, nsa.select_block),
            opts: ModelOptions {
                linear: fp8,
                attention: AttentionKind::Nsa(nsa),
                ..Default::default()
            },
        },
    ]
}

/// What one variant did.
#[derive(Clone, Debug)]
pub struct Report {
    pub name: String,
    pub prefill_tokens: usize,
    pub prefill_s: f64,
    pub decode_tokens: usize,
    pub decode_s: f64,
    /// Max and mean `|logit - dense logit|` over every prefill position.
    pub max_dev: f32,
    pub mean_dev: f32,
    /// Greedy continuation.
    pub generated: Vec<u32>,
}

impl Report {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_s
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_s
    }
}

/// Builds each variant, prefills `prompt`, decodes `decode` greedy tokens, and compares the
/// prefill logits with the first variant's (the reference, normally dense f32).
/// `on_event(message)` reports progress.
pub fn compare(
    cfg: &LlamaConfig,
    weights: &Weights,
    variants: &[Variant],
    prompt: &[u32],
    decode: usize,
    on_event: &mut dyn FnMut(&str),
) -> Result<Vec<Report>> {
    if prompt.is_empty() {
        return Err(crate::error::invalid("prompt", "needs at least one token"));
    }
    let mut reference: Option<Tensor> = None;
    let mut out = Vec::with_capacity(variants.len());
    for v in variants {
        on_event(&format!("building {}", v.name));
        let model = Llama::new(cfg, weights, &v.opts)?;
        on_event(&format!("prefill {} tokens: {}", prompt.len(), v.name));
        let mut cache = model.new_cache();
        let t = Instant::now();
        let logits = model.forward(prompt, &mut cache)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let (max_dev, mean_dev) = match &reference {
            None => (0.0, 0.0),
            Some(r) => {
                let d = (&logits - r)?.abs()?;
                (d.max_all()?.to_scalar()?, d.mean_all()?.to_scalar()?)
            }
        };
        on_event(&format!("decode {decode} tokens: {}", v.name));
        let mut next = logits
            .get(prompt.len() - 1)?
            .argmax(D::Minus1)?
            .to_scalar::<u32>()?;
        let mut generated = Vec::with_capacity(decode);
        let t = Instant::now();
        for _ in 0..decode {
            generated.push(next);
            let l = model.forward(&[next], &mut cache)?;
            next = l.get(0)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
        }
        let decode_s = t.elapsed().as_secs_f64();
        if reference.is_none() {
            reference = Some(logits);
        }
        out.push(Report {
            name: v.name.clone(),
            prefill_tokens: prompt.len(),
            prefill_s,
            decode_tokens: decode,
            decode_s,
            max_dev,
            mean_dev,
            generated,
        });
    }
    Ok(out)
}

/// The reports as a text table.
pub fn table(reports: &[Report]) -> String {
    let mut s = format!(
        "{:<28} {:>14} {:>13} {:>14} {:>15}\n",
        "variant", "prefill tok/s", "decode tok/s", "max |dlogit|", "mean |dlogit|"
    );
    for r in reports {
        s += &format!(
            "{:<28} {:>14.1} {:>13.2} {:>14.4} {:>15.5}\n",
            r.name,
            r.prefill_tok_s(),
            r.decode_tok_s(),
            r.max_dev,
            r.mean_dev
        );
    }
    s
}
