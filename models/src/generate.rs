use candle_core::{DType, Tensor, D};
use rand::{Rng, SeedableRng};

use crate::error::{invalid, Result};
use crate::llama::{Cache, Llama};

/// Next-token choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    Greedy,
    /// Nucleus sampling at `temperature`, reproducible from `seed`.
    TopP {
        p: f64,
        temperature: f64,
        seed: u64,
    },
}

impl Sampling {
    /// `p` must be in (0, 1] and `temperature` finite and >= 0 (0 is greedy); NaN is neither.
    pub fn validate(&self) -> Result<()> {
        if let Sampling::TopP { p, temperature, .. } = *self {
            if !(p > 0.0 && p <= 1.0) {
                return Err(invalid(
                    "sampling",
                    format!("top-p p must be in (0, 1], got {p}"),
                ));
            }
            if !(temperature.is_finite() && temperature >= 0.0) {
                return Err(invalid(
                    "sampling",
                    format!("temperature must be finite and >= 0, got {temperature}"),
                ));
            }
        }
        Ok(())
    }
}

/// Runs `prompt` through the model (appending to `cache`), then produces up to `max_new`
/// tokens, stopping after any token of `eos` (a config may name several, as Llama 3.1's
/// `[128001, 128008, 128009]`). `on_token` sees each new token as it comes.
pub fn generate(
    model: &Llama,
    cache: &mut Cache,
    prompt: &[u32],
    max_new: usize,
    sampling: Sampling,
    eos: &[u32],
    on_token: &mut dyn FnMut(u32),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(invalid("prompt", "needs at least one token"));
    }
    sampling.validate()?;
    let mut rng = match sampling {
        Sampling::TopP { seed, .. } => rand::rngs::StdRng::seed_from_u64(seed),
        Sampling::Greedy => rand::rngs::StdRng::seed_from_u64(0),
    };
    let mut out = Vec::with_capacity(max_new);
    let mut logits = model.forward_logits(prompt, cache, crate::Logits::Last)?;
    for _ in 0..max_new {
        let last = logits.get(logits.dims()[0] - 1)?;
        let next = pick(&last, sampling, &mut rng)?;
        out.push(next);
        on_token(next);
        if eos.contains(&next) {
            break;
        }
        logits = model.forward(&[next], cache)?;
    }
    Ok(out)
}

pub(crate) fn pick(
    logits: &Tensor,
    sampling: Sampling,
    rng: &mut rand::rngs::StdRng,
) -> Result<u32> {
    let v: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
    // a NaN logit means the model's output is broken; picking around it (argmax skips NaN, so
    // all-NaN logits would give token 0) would hide that
    if let Some(i) = v.iter().position(|x| x.is_nan()) {
        return Err(invalid(
            "logits",
            format!(
                "the model produced NaN (token {i} of {}); refusing to sample",
                v.len()
            ),
        ));
    }
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 {
                    (i, x)
                } else {
                    best
                }
            })
            .0 as u32
    };
    match sampling {
        Sampling::Greedy => Ok(argmax(&v)),
        Sampling::TopP { p, temperature, .. } => {
            if temperature <= 0.0 {
                return Ok(argmax(&v));
            }
            let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let mut probs: Vec<(usize, f64)> = v
                .iter()
                .map(|&x| ((x as f64 - m) / temperature).exp())
                .enumerate()
                .collect();
            let z: f64 = probs.iter().map(|x| x.1).sum();
            probs.sort_by(|a, b| b.1.total_cmp(&a.1));
            let mut kept = Vec::new();
            let mut acc = 0.0;
            for (i, w) in probs {
                kept.push((i, w));
                acc += w / z;
                if acc >= p {
                    break;
                }
            }
            // the nucleus is chosen by probability, the draw walks it in token order: two
            // near-equal probabilities swapped by rounding (a batched step against the same
            // sequence alone) then change the drawn token only when the draw lands within that
            // rounding of a boundary, not whenever their order flips
            kept.sort_unstable_by_key(|x| x.0);
            let total: f64 = kept.iter().map(|x| x.1).sum();
            let mut r = rng.random::<f64>() * total;
            for (i, w) in &kept {
                r -= w;
                if r <= 0.0 {
                    return Ok(*i as u32);
                }
            }
            Ok(kept.last().map_or(0, |x| x.0 as u32))
        }
    }
}

/// `exp(mean NLL)` of `tokens[1..]` given their prefixes, in one forward pass from an empty
/// cache.
pub fn perplexity(model: &Llama, tokens: &[u32]) -> Result<f64> {
    if tokens.len() < 2 {
        return Err(invalid("tokens", "needs at least two tokens"));
    }
    let mut cache = model.new_cache();
    let logits = model.forward(&tokens[..tokens.len() - 1], &mut cache)?;
    let lsm = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F64)?, D::Minus1)?;
    let targets = Tensor::new(&tokens[1..], logits.device())?.unsqueeze(1)?;
    let nll = lsm
        .gather(&targets, 1)?
        .neg()?
        .mean_all()?
        .to_scalar::<f64>()?;
    Ok(nll.exp())
}
