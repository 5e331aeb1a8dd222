//! DeepSeek-V3.2's sparse attention (DSA) against the same model attending every key: decode
//! time per token at a given context on a random V3.2-shaped model scaled to a small machine
//! (hidden 1024, 16 MLA heads with the published head sizes, so the latent row is the published
//! 576 floats; 16 routed experts in 4 groups plus a shared one; an indexer of 8 heads of 128
//! keeping 2048 keys), fp8 W8A8 projections, and the indexer's own time per token.
//!
//! ```text
//! cargo run --release -p fp8nsa-models --example dsa_decode -- 4096 32768
//! ```
//!
//! For each context `C`: the cache is filled by the DSA model's own chunked prefill (256 tokens
//! a step) and one decode token, then both models decode `N` tokens (default 16; `DECODE=n`) from copies of that
//! cache, alternating in rounds so that the machine's drift falls on both. The all-keys model
//! is the same weights with `index_topk` past the context: the indexer keeps its keys but every
//! query attends every key. The step at a 64-token context (attention negligible) is measured
//! first as the floor, so each context also gets the ratio of the attention part alone:
//! `(all keys - floor) / (DSA - floor)`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use fp8nsa_models::{Cache, DeepSeekConfig, LinearKind, Llama, ModelOptions};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Sums the wall time spent inside `fp8nsa::dsa_indexer` spans.
struct IndexerClock(Arc<AtomicU64>);

struct Entered(Instant);

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for IndexerClock {
    fn on_enter(&self, id: &tracing::span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if span.name() == "fp8nsa::dsa_indexer" {
                span.extensions_mut().insert(Entered(Instant::now()));
            }
        }
    }

    fn on_exit(&self, id: &tracing::span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(Entered(t)) = span.extensions_mut().remove::<Entered>() {
                self.0
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }
}

fn config(topk: usize) -> DeepSeekConfig {
    DeepSeekConfig {
        vocab_size: 4096,
        hidden_size: 1024,
        intermediate_size: 2816,
        num_hidden_layers: 2,
        num_attention_heads: 16,
        q_lora_rank: Some(384),
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        max_position_embeddings: 1 << 17,
        n_routed_experts: Some(16),
        n_shared_experts: Some(1),
        num_experts_per_tok: Some(4),
        moe_intermediate_size: 512,
        first_k_dense_replace: 1,
        n_group: 4,
        topk_group: 2,
        index_n_heads: Some(8),
        index_head_dim: Some(128),
        index_topk: Some(topk),
        ..DeepSeekConfig::tiny()
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let contexts: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let contexts = if contexts.is_empty() {
        vec![4096, 32768]
    } else {
        contexts
    };
    let n: usize = std::env::var("DECODE").map_or(Ok(16), |s| s.parse())?;
    let clock = Arc::new(AtomicU64::new(0));
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(IndexerClock(clock.clone())),
    )?;
    let opts = ModelOptions {
        linear: LinearKind::Fp8 {
            block: [128, 128],
            act: fp8nsa_ops::ActQuant::Group,
        },
        ..ModelOptions::default()
    };
    let dsa_cfg = config(2048);
    let weights = dsa_cfg.random_weights(1)?;
    let dsa = Llama::deepseek(&dsa_cfg, &weights, &opts)?;
    let all = Llama::deepseek(&config(1 << 20), &weights, &opts)?;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    println!(
        "cpu: {cpu}, {} threads; 2 layers, hidden 1024, 16 heads, latent 512 + 64, indexer 8 x 128 \
         keeping 2048",
        rayon::current_num_threads()
    );
    let mut floor = None;
    for &ctx in std::iter::once(&64).chain(&contexts) {
        let t0 = Instant::now();
        let mut cache = dsa.new_cache();
        let mut fed = 0;
        while fed < ctx {
            let chunk = 256.min(ctx - fed);
            let ids: Vec<u32> = (fed..fed + chunk)
                .map(|i| (i * 7919 % 4096) as u32)
                .collect();
            dsa.forward(&ids, &mut cache)?;
            fed += chunk;
            if fed % 4096 == 0 {
                eprintln!(
                    "  prefill {fed}/{ctx} ({:.0} s)",
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        // one decode token before timing: a cache whose length just reached a power of two
        // grows (doubling, one copy) at the next token, which is not what a decode step costs
        dsa.forward(&[1], &mut cache)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        let (mut t_dsa, mut t_all, mut t_ix) = (0f64, 0f64, 0f64);
        let run = |m: &Llama, c: &mut Cache| -> Result<f64, Box<dyn std::error::Error>> {
            let t = Instant::now();
            for i in 0..n {
                m.forward(&[(i * 31 % 4096) as u32], c)?;
            }
            Ok(t.elapsed().as_secs_f64() / n as f64)
        };
        let rounds = 3;
        for _ in 0..rounds {
            let mut c = cache.try_clone()?;
            clock.store(0, Ordering::Relaxed);
            t_dsa += run(&dsa, &mut c)?;
            t_ix += clock.load(Ordering::Relaxed) as f64 * 1e-9 / n as f64;
            let mut c = cache.try_clone()?;
            t_all += run(&all, &mut c)?;
        }
        let (t_dsa, t_all, t_ix) = (
            t_dsa / rounds as f64,
            t_all / rounds as f64,
            t_ix / rounds as f64,
        );
        let Some(f) = floor else {
            println!(
                "context {ctx} (the floor: projections, MoE, head): {:.2} ms/token",
                t_dsa * 1e3
            );
            floor = Some(t_dsa);
            continue;
        };
        println!(
            "context {ctx}: decode DSA {:.2} ms/token, all keys {:.2} ms/token: {:.2}x; attention \
             part alone {:.2}x; indexer {:.2} ms/token ({:.2} per layer); prefill {prefill_s:.0} s",
            t_dsa * 1e3,
            t_all * 1e3,
            t_all / t_dsa,
            (t_all - f) / (t_dsa - f),
            t_ix * 1e3,
            t_ix * 1e3 / 2.0
        );
    }
    Ok(())
}
