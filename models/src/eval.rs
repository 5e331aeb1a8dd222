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
/// prefill logits with the first variant's (the reference, normally dense f32). The timed
/// work of the variants is interleaved (three rounds of prefill, the fastest counting; decode
/// in rounds of 8 steps per variant), so their speeds are compared under the same machine
/// conditions; all models are in memory at once.
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
    // every model is built first and the timed work is interleaved (prefills in turn, then
    // decode in rounds of a few steps per model), so a slow spell of the machine falls on all
    // variants alike instead of on whichever ran then
    struct Run {
        model: Llama,
        cache: crate::llama::Cache,
        next: u32,
        report: Report,
    }
    let mut runs = Vec::with_capacity(variants.len());
    for v in variants {
        on_event(&format!("building {}", v.name));
        let model = Llama::new(cfg, weights, &v.opts)?;
        let cache = model.new_cache();
        runs.push(Run {
            model,
            cache,
            next: 0,
            report: Report {
                name: v.name.clone(),
                prefill_tokens: prompt.len(),
                prefill_s: 0.0,
                decode_tokens: decode,
                decode_s: 0.0,
                max_dev: 0.0,
                mean_dev: 0.0,
                generated: Vec::with_capacity(decode),
            },
        });
    }
    // prefill is one long call per variant: a slow spell of the VM during it (or a variant's
    // first-call costs) would decide the comparison, so each variant prefills in turn a few
    // times over, each time from an empty cache, and the fastest counts
    const PREFILL_ROUNDS: usize = 3;
    for round in 0..PREFILL_ROUNDS {
        for r in &mut runs {
            on_event(&format!(
                "prefill {} tokens ({}/{PREFILL_ROUNDS}): {}",
                prompt.len(),
                round + 1,
                r.report.name
            ));
            let mut cache = r.model.new_cache();
            let t = Instant::now();
            let logits = r.model.forward(prompt, &mut cache)?;
            let dt = t.elapsed().as_secs_f64();
            r.report.prefill_s = if round == 0 {
                dt
            } else {
                r.report.prefill_s.min(dt)
            };
            if round + 1 < PREFILL_ROUNDS {
                continue;
            }
            r.cache = cache;
            if let Some(reference) = &reference {
                let d = (&logits - reference)?.abs()?;
                r.report.max_dev = d.max_all()?.to_scalar()?;
                r.report.mean_dev = d.mean_all()?.to_scalar()?;
            } else {
                reference = Some(logits.clone());
            }
            r.next = logits
                .get(prompt.len() - 1)?
                .argmax(D::Minus1)?
                .to_scalar::<u32>()?;
        }
    }
    const ROUND: usize = 8;
    let mut done = 0;
    while done < decode {
        let steps = ROUND.min(decode - done);
        on_event(&format!("decode {done}..{} of {decode}", done + steps));
        for r in &mut runs {
            let t = Instant::now();
            for _ in 0..steps {
                r.report.generated.push(r.next);
                let l = r.model.forward(&[r.next], &mut r.cache)?;
                r.next = l.get(0)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
            }
            r.report.decode_s += t.elapsed().as_secs_f64();
        }
        done += steps;
    }
    Ok(runs.into_iter().map(|r| r.report).collect())
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
